"""The owners users hold: ``FlaxModule`` (with its variables and initializer), ``jax_function``."""
