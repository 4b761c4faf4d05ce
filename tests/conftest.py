import contextlib
import fcntl
import os
import sys
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Inductor's on-disk caches key custom ops by name, not by their Python implementation: a
# cache left by an older flaxtorch would replay stale compiled graphs. One per session.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="flaxtorch-inductor-"))

import jax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def x64():
    """64-bit JAX for the duration of a test."""
    with jax.enable_x64(True):
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with Dynamo's caches empty, as a fresh process does.

    Every new owner recompiles its ``forward`` (the caller id is a constant of the graph),
    and Dynamo counts recompiles per code object over the process: without this, a test
    that compiles a few owners failed or passed by how many earlier tests in its worker
    had compiled some.
    """
    yield
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


# The files that take longest (minutes: the examples' runs, the parity matrix), collected
# first: pytest-xdist's ``--dist loadfile`` hands files out in collection order, so a long
# file collected last keeps one worker busy while the other has run out of work.
FIRST = ("tests/test_examples.py", "tests/parity/test_matrix.py",
         "tests/calls/test_shared_linearization.py")


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available() and any(
        d.platform == "gpu" for d in jax.devices()
    ) if torch.cuda.is_available() else False
    skip = pytest.mark.skip(reason="needs a CUDA GPU visible to both torch and JAX")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
    rank = {path: k for k, path in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(FIRST)))


@contextlib.contextmanager
def _ranks_run_alone(root, exclusive: bool):
    """A readers-writer lock over the pytest-xdist workers (``root``: their shared folder).

    A test marked ``processes`` starts ranks that talk over gloo (DDP, FSDP2, ``shard``):
    it runs alone, as ``tests/support/ranks.py`` needs (a rank once stalled with three JAX
    processes on two cores); other tests run side by side. The turnstile keeps a waiting
    ``processes`` test from being starved by the other worker's next tests.
    """
    with open(root / "turnstile.lock", "a") as turnstile, open(root / "ranks.lock", "a") as ranks:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(ranks, fcntl.LOCK_EX)  # new tests wait at the turnstile meanwhile
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(ranks, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(ranks, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a ``processes`` test runs alone (setup, module fixtures too)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return (yield)
    root = item.config._tmp_path_factory.getbasetemp().parent
    with _ranks_run_alone(root, item.get_closest_marker("processes") is not None):
        return (yield)
