"""A made-up library file for ``test_no_private_name_crosses_a_module``: it imports a
private name from another module, as the check must find (never imported itself)."""

from torchside import _errors  # a private module: allowed  # noqa: F401
from torchside.edges._derived import _executes  # noqa: F401  (the case the check finds)
