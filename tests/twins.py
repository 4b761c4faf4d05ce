"""The twins' old import path, kept for ``examples/stack_speed.py`` only.

The twins live in ``tests/support/twins.py``; tests import them from there. Remove this
file once the example imports ``tests.support.twins``.
"""

from tests.support.twins import *  # noqa: F403
