"""A program's derivatives as plain JAX functions: VJPs, JVPs, per-sample gradients and norms."""
