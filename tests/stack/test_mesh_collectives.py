"""Stacks over a mesh gather each layer in one collective: ``remat_stack``'s
(``mesh_cases.py``) and stock scans' (``packed_scan_cases.py``).

The cases need two host devices, which JAX takes only when it starts: they run here in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``. The same over two
processes and torch's ranks is in ``tests/trainers/test_shard.py``.
"""

from tests.support import ROOT, pytest_in_subprocess, subprocess_env


def test_remat_stack_cases_on_two_host_devices(tmp_path):
    # The dump after SPMD partitioning shows the collectives' element types before the
    # CPU backend widens bfloat16 ones (mesh_cases.py's mixed-precision case).
    env = subprocess_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
                                       f"--xla_dump_to={tmp_path / 'hlo'} "
                                       "--xla_dump_hlo_pass_re=spmd-partitioning"})
    code, out, counts = pytest_in_subprocess(ROOT / "tests" / "stack" / "mesh_cases.py", env,
                                             tmp_path / "mesh_cases.log")
    assert code == 0, out[-6000:]
    assert counts == {"passed": 14}, out[-2000:]


def test_stock_scan_cases_on_two_host_devices(tmp_path):
    env = subprocess_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    code, out, counts = pytest_in_subprocess(ROOT / "tests" / "stack" / "packed_scan_cases.py",
                                             env, tmp_path / "packed_scan_cases.log")
    assert code == 0, out[-6000:]
    assert counts == {"passed": 13}, out[-2000:]
