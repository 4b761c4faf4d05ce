"""The call path FlaxModule and jax_function share: programs, caching, autograd, errors."""
