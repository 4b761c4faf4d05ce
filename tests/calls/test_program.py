"""flaxside.Program on its own: pure JAX, no torch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxside.internal import (
    PACK_BYTES,
    Alone,
    LeafSpec,
    Packed,
    Program,
    ResidualMap,
    unpack,
)


def _split(program, flat):
    """``forward_with_residuals``'s flat list as (results, residual buffers)."""
    n = len(program.out_specs)
    return flat[:n], flat[n:]

def _pure(f):
    """A function of the leaves in Program's contract: (outputs, aux, static)."""
    return lambda leaves: (f(leaves), [], None)


def _mlp_out(leaves):
    w1, w2, x = leaves
    return {"y": jnp.tanh(jnp.tanh(x @ w1) @ w2), "n": jnp.sum(x > 0).astype(jnp.int32)}


_mlp = _pure(_mlp_out)


def _data(seed=0):
    r = np.random.default_rng(seed)
    return [r.standard_normal(s).astype(np.float32) for s in ((8, 16), (16, 4), (5, 8))]


def _specs(diff=(True, True, True)):
    return [LeafSpec(a.shape, a.dtype, d) for a, d in zip(_data(), diff, strict=True)]


def test_forward_backward_match_jax_vjp():
    leaves = _data()
    p = Program(_mlp, _specs())
    outs, res = _split(p, p.forward_with_residuals(leaves))
    ref_out, ref_vjp = jax.vjp(lambda *ls: _mlp_out(list(ls))["y"], *leaves)
    np.testing.assert_allclose(outs[1], ref_out, rtol=1e-6)  # flatten order: n, y
    assert outs[0].dtype == jnp.int32 and p.diff_out_index == (1,)
    ct = np.random.default_rng(1).standard_normal(ref_out.shape).astype(np.float32)
    saved_in = [leaves[j] for j in p.residual_map().saved_inputs]
    saved_out = [outs[k] for k in p.residual_map().saved_outputs]
    grads = unpack(p.backward(saved_in, saved_out, res, [ct]), p.grad_pack)
    for g, r in zip(grads, ref_vjp(ct), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_residuals_exclude_inputs_and_outputs():
    leaves = _data()
    p = Program(_mlp, _specs())
    _, res = _split(p, p.forward_with_residuals(leaves))
    # tanh's VJP needs its outputs; the inputs w1, w2, x come back from the caller.
    saved = p.residual_map().saved_inputs
    assert set(saved) <= {0, 1, 2} and len(saved) >= 2
    in_shapes = {a.shape for a in leaves}
    assert all(r.shape not in in_shapes for r in res)
    assert [r.shape for r in res] == [s.shape for s in p.residual_map().residual_specs]


def test_only_diff_leaves_get_gradients():
    leaves = _data()
    p = Program(_mlp, _specs((True, False, False)))
    outs, res = _split(p, p.forward_with_residuals(leaves))
    rmap = p.residual_map()
    grads = unpack(p.backward([leaves[j] for j in rmap.saved_inputs],
                              [outs[k] for k in rmap.saved_outputs], res,
                              [np.ones((5, 4), np.float32)]), p.grad_pack)
    assert len(grads) == 1 and grads[0].shape == (8, 16)


def test_each_program_traces_once():
    leaves = _data()
    p = Program(_mlp, _specs())
    for seed in range(3):
        leaves = _data(seed)
        outs, res = _split(p, p.forward_with_residuals(leaves))
        rmap = p.residual_map()
        p.backward([leaves[j] for j in rmap.saved_inputs],
                   [outs[k] for k in rmap.saved_outputs], res, [np.ones((5, 4), np.float32)])
        p.forward(leaves)
    assert p.trace_count == 3  # forward_with_residuals, backward, forward: once each


def test_results_never_alias_inputs_or_each_other():
    n = 2 * PACK_BYTES // 4  # too large to be packed: each gradient leaves alone
    x = np.arange(n, dtype=np.float32)
    p = Program(_pure(lambda ls: (ls[0], ls[0], ls[0] + ls[1])),
                [LeafSpec((n,), np.float32, True)] * 2)
    outs = p.forward([x, x])
    ptrs = [o.unsafe_buffer_pointer() for o in outs]
    assert len(set(ptrs)) == 3 and x.ctypes.data not in ptrs
    outs, res = _split(p, p.forward_with_residuals([x, x]))
    ct = [np.ones(n, np.float32)] * 3
    grads = p.backward([], [], res, ct)
    assert p.grad_pack == (Alone(0), Alone(1))
    gptrs = {g.unsafe_buffer_pointer() for g in grads}
    assert len(gptrs) == 2 and not gptrs & {c.ctypes.data for c in ct}


def test_a_call_with_other_dtypes_is_refused_not_recompiled():
    p = Program(_mlp, _specs())
    p.forward(_data())
    with pytest.raises(TypeError):
        p.forward([a.astype(np.float16) for a in _data()])
    assert p.trace_count == 1


def test_residual_map_is_one_frozen_value_fixed_by_the_first_lowering():
    p = Program(_mlp, _specs())
    rmap = p.residual_map()
    assert isinstance(rmap, ResidualMap) and p.residual_map() is rmap
    with pytest.raises(dataclasses.FrozenInstanceError):
        rmap.saved_inputs = ()
    leaves = _data()
    outs, res = _split(p, p.forward_with_residuals(leaves))
    assert p.residual_map() is rmap and p.trace_count == 1  # the call reused that lowering
    assert [r.shape for r in res] == [s.shape for s in rmap.residual_specs]
    assert len(rmap.sources) == len(jax.tree_util.tree_leaves(rmap.vjp_treedef.unflatten(
        [0] * rmap.vjp_treedef.num_leaves)))


def test_complex_gradients_follow_torch_convention():
    """torch's gradient is the conjugate of JAX's VJP of the conjugated cotangent."""
    r = np.random.default_rng(0)
    z = (r.standard_normal(5) + 1j * r.standard_normal(5)).astype(np.complex64)
    w = (r.standard_normal(5) + 1j * r.standard_normal(5)).astype(np.complex64)
    ct = (r.standard_normal(5) + 1j * r.standard_normal(5)).astype(np.complex64)
    f = lambda a, b: a * jnp.conj(b) + a * a  # noqa: E731 - neither holomorphic in b nor trivial
    p = Program(_pure(lambda ls: f(ls[0], ls[1])), [LeafSpec((5,), np.complex64, True)] * 2)
    outs, res = _split(p, p.forward_with_residuals([z, w]))
    rmap = p.residual_map()
    grads = unpack(p.backward([[z, w][j] for j in rmap.saved_inputs],
                              [outs[k] for k in rmap.saved_outputs], res, [ct]), p.grad_pack)
    _, vjp = jax.vjp(f, z, w)
    for g, want in zip(grads, vjp(np.conj(ct)), strict=True):
        np.testing.assert_allclose(g, np.conj(want), rtol=1e-5, atol=1e-6)
    re = unpack(p.backward_recompute([z, w], [ct]), p.grad_pack)
    for g, want in zip(re, vjp(np.conj(ct)), strict=True):
        np.testing.assert_allclose(g, np.conj(want), rtol=1e-5, atol=1e-6)


def test_reads_and_grad_reach_follow_the_dependencies():
    def heads(ls):
        a, b, unused = ls
        return {"a": a * 2, "b": b * 3}

    p = Program(_pure(heads), [LeafSpec((2,), np.float32, True)] * 3)
    assert p.reads == (True, True, False)
    assert p.diff_out_index == (0, 1) and p.grad_reach == (0b001, 0b010)


def test_non_array_output_is_a_clear_error():
    with pytest.raises(TypeError, match=r"output \['m'\].*only arrays"):
        Program(_pure(lambda ls: {"m": object()}), [LeafSpec((2,), np.float32)])


def test_small_residuals_cross_packed_one_buffer_per_dtype():
    def chain(leaves):
        x = leaves[0]
        for w in leaves[1:]:
            x = jnp.tanh(x * w)  # each layer keeps a small float32 residual
        return x

    r = np.random.default_rng(0)
    leaves = [r.standard_normal((4, 8)).astype(np.float32) for _ in range(12)]
    p = Program(_pure(chain), [LeafSpec(a.shape, a.dtype, True) for a in leaves])
    outs, res = _split(p, p.forward_with_residuals(leaves))
    assert len(res) == 1 and res[0].ndim == 1  # 11+ residuals, one float32 buffer
    ct = r.standard_normal((4, 8)).astype(np.float32)
    grads = unpack(p.backward([leaves[j] for j in p.residual_map().saved_inputs],
                              [outs[k] for k in p.residual_map().saved_outputs], res, [ct]),
                   p.grad_pack)
    _, vjp = jax.vjp(lambda *ls: chain(list(ls)), *leaves)
    for g, want in zip(grads, vjp(ct), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_small_gradients_leave_packed_one_buffer_per_dtype_large_ones_alone():
    """Three small float32, two small bfloat16 and one large gradient: three buffers."""
    r = np.random.default_rng(3)
    big = 2 * PACK_BYTES // 4
    shapes = [((3, 4), np.float32), ((4,), jnp.bfloat16), ((big,), np.float32),
              ((5,), np.float32), ((2, 2), jnp.bfloat16), ((7,), np.float32)]
    leaves = [r.standard_normal(s).astype(d) for s, d in shapes]

    def f(ls):
        return sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) * (k + 1) for k, x in enumerate(ls))

    p = Program(_pure(f), [LeafSpec(a.shape, a.dtype, True) for a in leaves])
    kinds = [type(e) for e in p.grad_pack]
    assert kinds == [Packed, Packed, Alone, Packed, Packed, Packed]
    assert sorted((s.shape, str(s.dtype)) for s in p.grad_specs) == sorted(
        [((big,), "float32"), ((12 + 5 + 7,), "float32"), ((4 + 4,), "bfloat16")])
    ct = np.float32(r.standard_normal())
    for buffers in (p.backward_recompute(leaves, [ct]),):
        assert [b.shape for b in buffers] == [s.shape for s in p.grad_specs]
        _, vjp = jax.vjp(lambda *ls: f(list(ls)), *leaves)
        for g, want in zip(unpack(buffers, p.grad_pack), vjp(ct), strict=True):
            assert g.shape == want.shape and g.dtype == want.dtype
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(want, np.float32),
                                       rtol=1e-6, atol=1e-6 * float(np.abs(ct)))
