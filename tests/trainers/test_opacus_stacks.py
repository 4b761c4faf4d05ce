"""Opacus over a block whose parameters a scan stacks (``nn.remat_scan``), against pure JAX.

The batched VJP computes a stacked leaf's per-sample gradients with the batch behind the
layer axes; the per-sample program returns them there (``flaxside``'s ``per_sample_axes``)
rather than copying them batch first. Per-sample gradients (the grad sampler, as Opacus's
hooks call it, and as views) and per-sample norms (the norm sampler) are compared with
pure JAX's ``vmap(grad)`` of the same block.
"""

import jax
import jax.numpy as jnp
import pytest
import torch

pytest.importorskip("opacus", reason="the 'dp' extra: pip install 'flaxtorch[dp]'")

from opacus import GradSampleModule  # noqa: E402

from tests.support.closeness import close  # noqa: E402
from tests.support.references import to_jax  # noqa: E402
from tests.support.twins import ReadmeDeep  # noqa: E402
from torchside import FlaxModule  # noqa: E402

# Opacus hooks the block, whose input (the data) needs no gradient.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook is firing when gradients:UserWarning")

WIDTH, BATCH = 8, 8


def _scan_stack_case():
    """A remat_scan stack (every leaf stacked by the scan), a batch, per-sample weights, and
    pure JAX's per-sample gradients of ``(block(x_i) * w_i).sum()`` by parameter path."""
    block = ReadmeDeep(WIDTH)
    layer = FlaxModule(block, example_args=(torch.zeros(2, WIDTH),))
    g = torch.Generator().manual_seed(6)
    x, weights = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    params = jax.tree_util.tree_map(jnp.array, layer.flax_variables()["params"])

    def loss(p, x, w):
        return (block.apply({"params": p}, x[None]) * w[None]).sum()

    want = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, to_jax(x), to_jax(weights))
    flat = dict(jax.tree_util.tree_leaves_with_path(want))
    return layer, x, weights, lambda name: flat[tuple(jax.tree_util.DictKey(k)
                                                      for k in name.split(".")[1:])]


def _hooked(layer, x, weights) -> dict:
    """Each parameter's ``grad_sample`` under ``GradSampleModule`` (hooks mode)."""
    gsm = GradSampleModule(layer, loss_reduction="sum")
    (gsm(x) * weights).sum().backward()
    got = {k: p.grad_sample for k, p in layer.named_parameters()}
    gsm._close()
    return got


def test_a_remat_scan_stack_equals_pure_jax():
    """The block's own traced body, remat levels included, under one vmap of its VJP."""
    layer, x, weights, want = _scan_stack_case()
    for name, value in _hooked(layer, x, weights).items():
        close(value, want(name), name)


def test_scan_stacked_per_sample_gradients_come_as_views_not_moved_by_the_program():
    """The batched VJP computes a scan-stacked leaf's per-sample gradients with the batch
    behind the layer axes; moving it first inside the program is a copy of all of them
    (``flaxside``'s ``per_sample_axes``). The grad sampler returns them batch first as a
    view of the program's output instead (not contiguous; contiguous with the batch moved
    back behind a layer axis), equal to pure JAX's. Opacus copies what a grad sampler
    returns into its own ``grad_sample`` anyway."""
    from torchside.integrations._opacus import per_sample_gradients

    layer, x, weights, want = _scan_stack_case()
    names = {p: n for n, p in layer.named_parameters()}
    grads = per_sample_gradients(layer, (x,), weights)
    assert set(grads) == set(names)
    for p, g in grads.items():
        assert g.shape == (BATCH, *p.shape)
        assert not g.is_contiguous(), (names[p], g.shape, g.stride())
        assert any(g.movedim(0, k).is_contiguous() for k in range(1, g.dim())), (
            names[p], g.shape, g.stride())
        close(g, want(names[p]), names[p])


def test_per_sample_norms_of_a_scan_stack_equal_pure_jax():
    """The norm sampler reduces each stacked leaf's per-sample gradients where the program
    computed them (batch behind the layer axes) to one norm per sample."""
    from torchside.integrations._opacus import per_sample_norms

    layer, x, weights, want = _scan_stack_case()
    names = {p: n for n, p in layer.named_parameters()}
    norms = per_sample_norms(layer, (x,), weights)
    assert set(norms) == set(names)
    for p, got in norms.items():
        g = want(names[p])
        assert got.shape == (BATCH,), (names[p], got.shape)
        # A norm taken over the wrong axes mixes the samples: the layer axis read as batch.
        mixed = jnp.linalg.norm(jnp.moveaxis(g, 0, 1).reshape(BATCH, -1), axis=1)
        close(got, jnp.linalg.norm(g.reshape(BATCH, -1), axis=1), names[p], wrong=[mixed])
