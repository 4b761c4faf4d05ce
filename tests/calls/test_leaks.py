"""No leaks: resident memory over 2,000 steps, residuals freed with their graph, a bounded
compile cache."""

import gc
import os
import weakref

import jax
import pytest
import torch

from tests.support import pipeline
from tests.support.twins import ScanStack
from torchside import FlaxModule, jax_function

MODES = pytest.mark.parametrize("residuals", ["save", "recompute"])


def _rss() -> int:
    """Resident set size of this process in bytes, now (not the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        psutil = pytest.importorskip("psutil", reason="needs /proc/self/statm or psutil")
        return psutil.Process().memory_info().rss


def _stack(width=16, depth=4, batch=8, **kwargs):
    return FlaxModule(ScanStack(width, depth), example_args=(torch.zeros(batch, width),),
                      **kwargs)


def _live_buffers() -> int:
    """Distinct live JAX buffers: jax 0.8.1 keeps two Array objects on y's one (issue 17)."""
    return len({a.unsafe_buffer_pointer() for a in jax.live_arrays()})


def _residual_bytes(m, x):
    """Bytes a forward holds for its backward beyond the inputs and parameters."""
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = m(x)
    skip = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr()
                                                 for p in m.parameters()}
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed}
    del y
    return sum(n for ptr, n in held.items() if ptr not in skip)


@pytest.mark.slow
def test_resident_memory_is_flat_over_2000_training_steps():
    width, depth, batch, warmup, steps = 32, 32, 16, 200, 2000
    m = _stack(width, depth, batch)
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)
    x = torch.randn(batch, width, requires_grad=True)

    def step():
        opt.zero_grad(set_to_none=True)
        xi = torch.randn(batch, width, requires_grad=True)
        y = m(xi)
        y.backward(torch.randn_like(y))
        opt.step()

    for _ in range(warmup):
        step()
    gc.collect()
    rss0, live0, traces0 = _rss(), len(jax.live_arrays()), m.trace_count
    per_step = _residual_bytes(m, x)
    # A leak of one step's residuals must be able to fail this test.
    assert steps * per_step > 0.05 * rss0
    samples = []
    for i in range(1, steps + 1):
        step()
        if i % 250 == 0:
            samples.append((i, _rss()))
    gc.collect()
    rss1 = _rss()
    print(f"\n{depth}-layer ScanStack width {width} batch {batch}: residuals "
          f"{per_step / 2**20:.2f} MiB/step; RSS after {warmup} warm-up steps "
          f"{rss0 / 2**20:.1f} MiB")
    for i, r in samples:
        print(f"  step {i:5d}: RSS {r / 2**20:8.1f} MiB ({100 * (r - rss0) / rss0:+.2f}%)")
    print(f"  end (after gc): {rss1 / 2**20:.1f} MiB ({100 * (rss1 - rss0) / rss0:+.2f}%)")
    assert max(r for _, r in samples + [(0, rss1)]) <= 1.05 * rss0
    assert len(jax.live_arrays()) == live0  # no JAX buffer outlives its step
    assert m.trace_count == traces0 and len(pipeline.entries(m)) == 1


@MODES
def test_forward_dropped_without_backward_frees_its_residuals(residuals):
    m = _stack(residuals=residuals)
    x = torch.randn(8, 16, requires_grad=True)
    m(x).backward(torch.randn(8, 16))  # compiled and traced
    gc.collect()  # the first call's tracing leaves garbage cycles behind
    base = _live_buffers()
    y = m(x)
    node = y.grad_fn
    held = _live_buffers() - base - 1  # JAX buffers beyond y's: the residuals
    assert held > 0 if residuals == "save" else held == 0
    assert len(node.saved_tensors) > 0
    del y, node  # no gc.collect(): the graph must not sit in a reference cycle
    assert _live_buffers() == base


def test_compile_cache_is_lru_bounded_and_evicted_programs_are_freed():
    f = jax_function(lambda x: x * 2.0, cache_size=3, recompile_warning=None)

    def sizes():
        return [p.specs[0].shape[0] for p in pipeline.programs(f)]

    first = None
    for n in (1, 2, 3):
        f(torch.ones(n))
        first = first or weakref.ref(pipeline.programs(f)[0])
    f(torch.ones(1))  # a hit: size 1 becomes the most recently used
    f(torch.ones(4))  # evicts size 2, the least recently used
    assert sizes() == [3, 1, 4]
    assert first() is not None
    f(torch.ones(5))
    f(torch.ones(6))
    assert sizes() == [4, 5, 6]
    gc.collect()
    assert first() is None  # nothing (JAX's own caches included) keeps an evicted program


def test_clear_caches_empties_the_cache_and_the_next_call_compiles_again():
    m = _stack()
    x = torch.randn(8, 16, requires_grad=True)
    y = m(x)
    y.backward(torch.randn(8, 16))
    with torch.no_grad():
        m(x)
    programs = [weakref.ref(p) for p in pipeline.programs(m)]
    assert len(programs) == 2
    expected = y.detach()
    del y
    m.clear_caches()
    assert pipeline.entries(m) == []
    gc.collect()
    assert [p for p in programs if p() is not None] == []
    with torch.no_grad():
        torch.testing.assert_close(m(x), expected, rtol=0, atol=0)
    assert m.trace_count == 1 and len(pipeline.entries(m)) == 1
