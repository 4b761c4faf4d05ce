"""Comparisons with a reference whose tolerance scales with what is compared.

``close(got, want, what, wrong=...)`` passes when ``|got - want| <= rtol * (|want| +
max|want|)`` elementwise: relative to each value and to the tensor's largest one, with no
absolute floor, so a gradient of 1e-4 is held to 1e-4's precision and not to a fixed
0.02. Every ``wrong`` value given (the result of a missed gradient accumulation, a stale
parameter, an input overwritten too early) must fail the same comparison: the negative
control that shows the tolerance can see the bug the test is about.

``rtol`` is per device: on the CPU both sides run XLA's CPU kernels in float32; on CUDA
the module runs at JAX's highest matmul precision (``highest_precision``) while the
reference runs on the CPU, so only the order of float32 sums differs.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
import torch

RTOL = {"cpu": 1e-5, "cuda": 1e-4}


def _numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def within(got, want, rtol: float) -> bool:
    """Whether ``got`` is within ``rtol`` of ``want`` by the rule above."""
    got, want = _numpy(got), _numpy(want)
    if got.shape != want.shape:
        return False
    scale = float(np.abs(want).max()) if want.size else 0.0
    return bool(np.all(np.abs(got - want) <= rtol * (np.abs(want) + scale)))


def close(got: torch.Tensor, want, what: str, wrong=()) -> None:
    """Asserts ``got`` matches ``want``, and that it matches none of ``wrong``."""
    rtol = RTOL[got.device.type]
    if not within(got, want, rtol):
        g, w = _numpy(got), _numpy(want)
        raise AssertionError(
            f"{what}: max |got - want| = {np.abs(g - w).max():.3g} with max |want| = "
            f"{np.abs(w).max():.3g} (rtol {rtol})")
    for k, bad in enumerate(wrong):
        assert not within(got, bad, rtol), (
            f"{what}: also within tolerance of wrong answer {k}, so this comparison could not "
            f"see the bug it checks for")


@contextlib.contextmanager
def highest_precision():
    """float32 matmuls in full float32 on both frameworks (no TF32) for the duration.

    Set globally, not with ``jax.default_matmul_precision``'s context: JAX's contexts are
    thread-local, and torch runs a CUDA backward on a thread of its own, where the programs
    first compiled in a backward (derived programs, NOTE [Higher order]) would not see it.
    """
    tf32 = torch.backends.cuda.matmul.allow_tf32
    precision = jax.config.jax_default_matmul_precision
    torch.backends.cuda.matmul.allow_tf32 = False
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
        torch.backends.cuda.matmul.allow_tf32 = tf32


@contextlib.contextmanager
def on_route(route: tuple[str, str]):
    """``route``: ``(torch device, exchange mode)``. Yields the device, with the exchange
    in that mode and matmuls at ``highest_precision`` (on CUDA no TF32 hides an error in
    a comparison), both restored after."""
    import bridge

    device, mode = route
    previous = bridge.set_exchange_mode(mode)
    try:
        with highest_precision():
            yield device
    finally:
        bridge.set_exchange_mode(previous)


# The routes a call can take: pointer views on the CPU, the DLPack route (CUDA's exchange
# code) forced on the CPU, and CUDA itself.
ALL_ROUTES = (
    pytest.param(("cpu", "auto"), id="cpu-views"),
    pytest.param(("cpu", "dlpack"), id="cpu-dlpack"),
    pytest.param(("cuda", "auto"), id="cuda", marks=pytest.mark.gpu),
)


def route_fixture(routes=ALL_ROUTES):
    """A ``route`` fixture over ``routes``: runs each test on the route (``on_route``) and
    yields its torch device. A test module binds it to a name: ``_route = route_fixture()``."""

    @pytest.fixture(params=routes, name="route")
    def route(request):
        with on_route(request.param) as device:
            yield device

    return route


def close_dicts(got: dict, want: dict, what: str) -> None:
    """Each tensor of ``got`` within 1e-5 of ``want``'s, relative to its largest element
    (float32, two partitionings of one sum)."""
    assert set(got) == set(want), what
    for name, value in want.items():  # float32, two partitionings of one sum: scaled
        torch.testing.assert_close(got[name], value, rtol=1e-5,
                                   atol=1e-6 * float(value.abs().max()),
                                   msg=lambda m, name=name: f"{what}, {name}: {m}")


def close_steps(got: dict, want: dict, initial: dict, share: float, what: str,
                untrained: tuple = ("key.bias",)) -> None:
    """Each parameter's update within ``share`` of the largest element of ``want``'s.

    Plus 1e-6 (1e-3 of the learning rate): attention's key bias has a gradient of zero (it
    adds one constant to a query's logits, which softmax ignores), so its AdamW updates
    are rounding noise scaled up, about 5e-7 here; it is the one parameter left untrained
    (names ending in one of ``untrained``).
    """
    assert set(got) == set(want) and len(want) > 8, what
    floor = 1e-6
    for name, value in want.items():
        step = value - initial[name]
        scale = float(step.abs().max())
        assert scale > floor or name.endswith(untrained), f"{what}: {name} did not train"
        torch.testing.assert_close(got[name] - initial[name], step, rtol=0,
                                   atol=share * scale + floor,
                                   msg=lambda m, name=name: f"{what}, {name}: {m}")
