"""flaxside.Program on its own: pure JAX, no torch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxside import LeafSpec, Program, StaleSignature


def _mlp(leaves):
    w1, w2, x = leaves
    return {"y": jnp.tanh(jnp.tanh(x @ w1) @ w2), "n": jnp.sum(x > 0).astype(jnp.int32)}


def _data(seed=0):
    r = np.random.default_rng(seed)
    return [r.standard_normal(s).astype(np.float32) for s in ((8, 16), (16, 4), (5, 8))]


def _specs(diff=(True, True, True)):
    return [LeafSpec(a.shape, a.dtype, d) for a, d in zip(_data(), diff, strict=True)]


def test_forward_backward_match_jax_vjp():
    leaves = _data()
    p = Program(_mlp, _specs())
    outs, res = p.forward_with_residuals(leaves)
    ref_out, ref_vjp = jax.vjp(lambda *ls: _mlp(list(ls))["y"], *leaves)
    np.testing.assert_allclose(outs[1], ref_out, rtol=1e-6)  # flatten order: n, y
    assert outs[0].dtype == jnp.int32 and p.diff_out_index == (1,)
    ct = np.random.default_rng(1).standard_normal(ref_out.shape).astype(np.float32)
    saved_in = [leaves[j] for j in p.saved_input_index]
    saved_out = [outs[k] for k in p.saved_output_index]
    grads = p.backward(saved_in, saved_out, res, [ct])
    for g, r in zip(grads, ref_vjp(ct), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_residuals_exclude_inputs_and_outputs():
    leaves = _data()
    p = Program(_mlp, _specs())
    _, res = p.forward_with_residuals(leaves)
    # tanh's VJP needs its outputs; the inputs w1, w2, x come back from the caller.
    assert set(p.saved_input_index) <= {0, 1, 2} and len(p.saved_input_index) >= 2
    in_shapes = {a.shape for a in leaves}
    assert all(r.shape not in in_shapes for r in res)
    assert [r.shape for r in res] == [s.shape for s in p.residual_specs]


def test_only_diff_leaves_get_gradients():
    leaves = _data()
    p = Program(_mlp, _specs((True, False, False)))
    outs, res = p.forward_with_residuals(leaves)
    grads = p.backward([leaves[j] for j in p.saved_input_index],
                       [outs[k] for k in p.saved_output_index], res, [np.ones((5, 4), np.float32)])
    assert len(grads) == 1 and grads[0].shape == (8, 16)


def test_each_program_traces_once():
    leaves = _data()
    p = Program(_mlp, _specs())
    for seed in range(3):
        leaves = _data(seed)
        outs, res = p.forward_with_residuals(leaves)
        p.backward([leaves[j] for j in p.saved_input_index],
                   [outs[k] for k in p.saved_output_index], res, [np.ones((5, 4), np.float32)])
        p.forward(leaves)
    assert p.trace_count == 3  # forward_with_residuals, backward, forward: once each


def test_results_never_alias_inputs_or_each_other():
    x = np.arange(64, dtype=np.float32)
    p = Program(lambda ls: (ls[0], ls[0], ls[0] + ls[1]), [LeafSpec((64,), np.float32, True)] * 2)
    outs = p.forward([x, x])
    ptrs = [o.unsafe_buffer_pointer() for o in outs]
    assert len(set(ptrs)) == 3 and x.ctypes.data not in ptrs
    outs, res = p.forward_with_residuals([x, x])
    ct = [np.ones(64, np.float32)] * 3
    grads = p.backward([], [], res, ct)
    gptrs = {g.unsafe_buffer_pointer() for g in grads}
    assert len(gptrs) == 2 and not gptrs & {c.ctypes.data for c in ct}


def test_stale_signature_is_refused():
    p = Program(_mlp, _specs())
    with pytest.raises(StaleSignature, match="compiled for float32"):
        p.forward([a.astype(np.float16) for a in _data()])


def test_non_array_output_is_a_clear_error():
    with pytest.raises(TypeError, match=r"output \['m'\].*only arrays"):
        Program(lambda ls: {"m": object()}, [LeafSpec((2,), np.float32)])


def test_small_residuals_cross_packed_one_buffer_per_dtype():
    def chain(leaves):
        x = leaves[0]
        for w in leaves[1:]:
            x = jnp.tanh(x * w)  # each layer keeps a small float32 residual
        return x

    r = np.random.default_rng(0)
    leaves = [r.standard_normal((4, 8)).astype(np.float32) for _ in range(12)]
    p = Program(chain, [LeafSpec(a.shape, a.dtype, True) for a in leaves])
    outs, res = p.forward_with_residuals(leaves)
    assert len(res) == 1 and res[0].ndim == 1  # 11+ residuals, one float32 buffer
    ct = r.standard_normal((4, 8)).astype(np.float32)
    grads = p.backward([leaves[j] for j in p.saved_input_index],
                       [outs[k] for k in p.saved_output_index], res, [ct])
    _, vjp = jax.vjp(lambda *ls: chain(list(ls)), *leaves)
    for g, want in zip(grads, vjp(ct), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
