"""flaxtorch's tests, one folder per concern; code they share is in ``tests/support``."""
