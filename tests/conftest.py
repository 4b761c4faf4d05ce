import os
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


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available() and any(
        d.platform == "gpu" for d in jax.devices()
    ) if torch.cuda.is_available() else False
    skip = pytest.mark.skip(reason="needs a CUDA GPU visible to both torch and JAX")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
