"""Arrays crossing between torch and JAX: conversions, held arrays, ordering, lifetimes."""
