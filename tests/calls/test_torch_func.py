"""``torch.func`` over calls: grad, vjp, jacrev, hessian, jvp, jacfwd, vmap, ensembles.

NOTE [torch.func] in ``torchside/edges/_higher.py``. References are pure JAX (``jax.grad``,
``jax.jvp``, ``jax.hessian``) on the same values, or the module called in a loop (per-sample
gradients, ensembles). Refusals (a custom VJP under forward mode, state written back under
a transform, dropout under ``vmap(randomness="error")``) name the path and the fix.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from flax import nnx

from tests.support.references import to_jax
from tests.support.twins import BatchNormMLP, NnxDropoutMLP, ReadmeDeep, TanhMLP
from torchside import FlaxModule, jax_function


def _close(got, want, what: str) -> None:
    want = torch.as_tensor(np.array(want))
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=1e-5 * max(scale, 1e-6),
                               msg=lambda m: f"{what}: {m}")


def _tanh_layer(x, w):
    return jnp.tanh(x @ w)


@pytest.fixture
def layer():
    return jax_function(_tanh_layer), torch.randn(3, 4), torch.randn(4, 2)


def test_reverse_mode_transforms_equal_jax(layer):
    f, x, w = layer
    g = torch.func.grad(lambda x: f(x, w).sum())(x)
    _close(g, jax.grad(lambda x: _tanh_layer(x, to_jax(w)).sum())(to_jax(x)), "grad")
    ct = torch.randn(3, 2)
    out, pull = torch.func.vjp(lambda x, w: f(x, w), x, w)
    gx, gw = pull(ct)
    _, jpull = jax.vjp(_tanh_layer, to_jax(x), to_jax(w))
    jgx, jgw = jpull(to_jax(ct))
    _close(gx, jgx, "vjp x")
    _close(gw, jgw, "vjp w")
    _close(torch.func.jacrev(lambda x: f(x, w))(x[0]),
           jax.jacrev(lambda x: _tanh_layer(x, to_jax(w)))(to_jax(x[0])), "jacrev")
    _close(torch.func.hessian(lambda x: f(x, w).sum())(x[0]),
           jax.hessian(lambda x: _tanh_layer(x, to_jax(w)).sum())(to_jax(x[0])), "hessian")


def test_forward_mode_transforms_equal_jax(layer):
    f, x, w = layer
    t = torch.randn(3, 4)
    out, tangent = torch.func.jvp(lambda x: f(x, w), (x,), (t,))
    _, want = jax.jvp(lambda x: _tanh_layer(x, to_jax(w)), (to_jax(x),), (to_jax(t),))
    _close(tangent, want, "jvp")
    _close(torch.func.jacfwd(lambda x: f(x, w))(x[0]),
           jax.jacfwd(lambda x: _tanh_layer(x, to_jax(w)))(to_jax(x[0])), "jacfwd")
    with fwAD.dual_level():  # torch's own forward AD, outside torch.func
        _, dual_tangent = fwAD.unpack_dual(f(fwAD.make_dual(x, t), w))
    _close(dual_tangent, want, "forward_ad")


def test_vmap_maps_in_dims_onto_the_program(layer):
    f, x, w = layer
    ws = torch.randn(5, 4, 2)
    got = torch.func.vmap(f, in_dims=(None, 0))(x, ws)
    assert got.shape == (5, 3, 2)
    for k in range(5):
        _close(got[k], _tanh_layer(to_jax(x), to_jax(ws[k])), f"entry {k}")
    xs = torch.randn(3, 7, 4)  # the batch on dimension 1
    got = torch.func.vmap(f, in_dims=(1, None), out_dims=2)(xs, w)
    _close(got, np.stack([_tanh_layer(to_jax(xs[:, k]), to_jax(w)) for k in range(7)], 2),
           "in_dims=1, out_dims=2")


def test_per_sample_gradients_equal_pure_jax_and_a_loop_over_samples():
    """Opacus's route for a layer it has no rule for: vmap(grad(functional_call)), against
    pure JAX's ``vmap(grad)`` of the same Flax block and the module called per sample."""
    m = FlaxModule(TanhMLP(8, 2), example_args=(torch.zeros(1, 3),))
    params = {k: v.detach() for k, v in m.named_parameters()}
    xs, ys = torch.randn(6, 3), torch.randn(6, 2)

    def loss(p, x, y):
        return ((torch.func.functional_call(m, p, (x[None],)) - y[None]) ** 2).mean()

    def jax_loss(p, x, y):
        return ((TanhMLP(8, 2).apply({"params": p}, x[None]) - y[None]) ** 2).mean()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    jax_params = jax.tree_util.tree_map(jnp.asarray, m.flax_variables()["params"])
    want = jax.vmap(jax.grad(jax_loss), in_axes=(None, 0, 0))(jax_params, to_jax(xs),
                                                               to_jax(ys))
    for name, got in per_sample.items():
        scope, leaf = name.split(".")[-2:]
        _close(got, want[scope][leaf], f"{name} against jax.vmap(jax.grad)")
    for i in range(6):
        m.zero_grad()
        loss(dict(m.named_parameters()), xs[i], ys[i]).backward()
        for name, p in m.named_parameters():
            _close(per_sample[name][i], p.grad.numpy(), f"sample {i}, {name}")


def test_per_sample_gradients_of_a_scan_stack_come_batched_where_computed():
    """``vmap(grad(functional_call))`` of a remat_scan stack, against pure JAX's
    ``vmap(grad)``. The batched VJP computes each stacked parameter's per-sample gradients
    with the batch behind the layer axes; the vmap rule tells torch that axis instead of
    moving it first inside the program (a copy of all of them), so torch's result is a view
    with the batch moved out front: not contiguous (it was, with the copy)."""
    block = ReadmeDeep(4)
    m = FlaxModule(block, example_args=(torch.zeros(1, 4),))
    params = {k: v.detach() for k, v in m.named_parameters()}
    g = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)

    def loss(p, x, y):
        return ((torch.func.functional_call(m, p, (x[None],)) - y[None]) ** 2).sum()

    def jax_loss(p, x, y):
        return ((block.apply({"params": p}, x[None]) - y[None]) ** 2).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    jax_params = jax.tree_util.tree_map(jnp.asarray, m.flax_variables()["params"])
    want = jax.vmap(jax.grad(jax_loss), in_axes=(None, 0, 0))(jax_params, to_jax(xs),
                                                               to_jax(ys))
    flat = dict(jax.tree_util.tree_leaves_with_path(want))
    assert set(per_sample) == set(params)
    for name, got in per_sample.items():
        assert got.shape == (6, *params[name].shape)
        assert not got.is_contiguous(), (name, got.stride())
        key = tuple(jax.tree_util.DictKey(k) for k in name.split(".")[1:])
        _close(got, flat[key], f"{name} against jax.vmap(jax.grad)")


def test_an_ensemble_of_modules_under_vmap_equals_each_module():
    models = [FlaxModule(TanhMLP(8, 2), example_args=(torch.zeros(1, 3),), seed=s)
              for s in range(3)]
    params, buffers = torch.func.stack_module_state(models)
    x = torch.randn(4, 3)

    def one(p, b):
        return torch.func.functional_call(models[0], (p, b), (x,))

    got = torch.func.vmap(one)(params, buffers)
    for k, model in enumerate(models):
        with torch.no_grad():
            _close(got[k], model(x).numpy(), f"model {k}")


def test_an_nnx_module_under_grad_and_vmap():
    m = FlaxModule(NnxDropoutMLP(nnx.Rngs(0)), rngs=("default",)).eval()
    x = torch.randn(4, 5)
    g = torch.func.grad(lambda x: m(x).sum())(x)
    graphdef, state = nnx.split(m.flax_module)
    want = jax.grad(lambda x: nnx.merge(graphdef, state)(x).sum())(to_jax(x))
    _close(g, want, "grad")
    batched = torch.func.vmap(m)(x[:, None])
    with torch.no_grad():
        _close(batched[:, 0], m(x).numpy(), "vmap")


class Dropped(nn.Module):
    """Dropout on a Dense layer; its key comes from torch (``rngs=("dropout",)``)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(nn.Dense(16)(x))


def test_vmap_randomness_reaches_the_rng_streams():
    m = FlaxModule(Dropped(), example_args=(torch.zeros(2, 5),), rngs=("dropout",))
    x = torch.randn(1, 2, 5).expand(5, 2, 5)  # the same input for every entry
    same = torch.func.vmap(m, randomness="same")(x)
    different = torch.func.vmap(m, randomness="different")(x)
    assert all(torch.equal(same[0], same[k]) for k in range(1, 5))
    assert not any(torch.equal(different[0], different[k]) for k in range(1, 5))
    with torch.no_grad():  # each entry is a dropout of the same values
        full = m.params.Dense_0
        dense = x[0] @ full.kernel + full.bias
    for out in (same, different):
        kept = out != 0
        torch.testing.assert_close(out[kept], (2 * dense.expand(5, 2, 16))[kept])
    with pytest.raises(RuntimeError, match=r"FlaxModule\(Dropped\) under "
                                           r"torch.func.vmap draws a key.*randomness='different'"):
        torch.func.vmap(m)(x)


def test_state_written_back_under_a_transform_is_refused_and_eval_works():
    bn = FlaxModule(BatchNormMLP(), example_args=(torch.zeros(4, 5),), train_kwarg="train")
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    x = torch.randn(4, 5)
    for transform in (torch.func.grad, torch.func.vmap):
        fn = (lambda x: bn(x).sum()) if transform is torch.func.grad else bn
        with pytest.raises(NotImplementedError, match=r"under a torch.func transform: the call "
                                                      r"writes back.*batch_stats.*eval\(\)"):
            transform(fn)(x if transform is torch.func.grad else x[None])
    assert all(torch.equal(bn.state_dict()[k], v) for k, v in before.items())
    bn.eval()
    torch.func.grad(lambda x: bn(x).sum())(x)


@jax.custom_vjp
def _clipped(x):
    return x


_clipped.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))


def test_forward_mode_through_a_custom_vjp_is_refused_by_name():
    f = jax_function(lambda x: jnp.sin(_clipped(x)))
    x = torch.randn(3)
    with pytest.raises(NotImplementedError, match=r"forward-mode.*jax.custom_vjp.*jacrev"):
        torch.func.jvp(f, (x,), (torch.ones(3),))
    _close(torch.func.grad(lambda x: f(x).sum())(x), np.cos(x.numpy()), "reverse mode works")
