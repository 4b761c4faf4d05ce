"""The device cases' old path, kept for ``examples/gpu_check.py`` only.

The cases live in ``tests/devices/cases.py``. Remove this file once the example runs that
path. Like the cases, it is not collected by a plain ``pytest`` run.
"""

from tests.devices.cases import *  # noqa: F403
from tests.devices.cases import _default_is_elsewhere  # noqa: F401 - autouse, not in *
