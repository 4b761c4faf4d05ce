"""``remat_stack`` over a mesh gathers each layer in one collective (``mesh_cases.py``).

The cases need two host devices, which JAX takes only when it starts: they run here in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``. The same over two
processes and torch's ranks is in ``tests/trainers/test_shard.py``.
"""

import re
import subprocess
import sys

from tests.support import ROOT, subprocess_env


def test_remat_stack_cases_on_two_host_devices(tmp_path):
    env = subprocess_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    log = tmp_path / "mesh_cases.log"
    with open(log, "w") as sink:  # a file, not a pipe: a full pipe would block the child
        code = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
             str(ROOT / "tests" / "stack" / "mesh_cases.py")],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=600).returncode
    out = log.read_text()
    assert code == 0, out[-6000:]
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (\w+)", out.strip().splitlines()[-1]))
    assert counts == {"passed": 4}, out[-2000:]
