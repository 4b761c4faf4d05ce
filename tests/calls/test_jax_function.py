"""jax_function and the two boundary modes, and composition with torch's checkpointing."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.support.twins import RematScanStack
from torchside import FlaxModule, jax_function


def _t(a):
    return torch.from_numpy(np.array(a))


def _j(t):
    return jnp.asarray(t.detach().numpy())


def mlp(params, x, *, activation="tanh"):
    act = getattr(jnp, activation)
    h = act(x @ params["w1"] + params["b1"])
    return {"y": act(h @ params["w2"]), "h_norm": jnp.linalg.norm(h)}


@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_gradients_equal_jax_grad_for_every_tensor_argument(residuals):
    f = jax_function(mlp, residuals=residuals)
    params = {"w1": torch.randn(5, 7, requires_grad=True), "b1": torch.randn(7, requires_grad=True),
              "w2": torch.randn(7, 3, requires_grad=True)}
    x = torch.randn(4, 5, requires_grad=True)
    ct_y, ct_n = torch.randn(4, 3), torch.randn(())
    out = f(params, x, activation="sin")
    ((out["y"] * ct_y).sum() + out["h_norm"] * ct_n).backward()

    def loss(p, x):
        o = mlp(p, x, activation="sin")
        return jnp.sum(o["y"] * _j(ct_y)) + o["h_norm"] * _j(ct_n)

    g_p, g_x = jax.grad(loss, argnums=(0, 1))({k: _j(v) for k, v in params.items()}, _j(x))
    torch.testing.assert_close(x.grad, _t(g_x))
    for k, v in params.items():
        torch.testing.assert_close(v.grad, _t(g_p[k]), msg=k)


def test_integer_inputs_and_outputs_need_no_gradient():
    @jax_function
    def embed(table, ids):
        rows = table[ids]
        return rows, jnp.argmax(rows, axis=-1), jnp.ones(3) * 2.0

    table = torch.randn(10, 4, requires_grad=True)
    ids = torch.tensor([1, 3, 3], dtype=torch.int32)
    rows, best, const = embed(table, ids)
    assert rows.requires_grad and not best.requires_grad and best.dtype == torch.int32
    assert not const.requires_grad  # does not depend on a differentiable input
    ct = torch.randn(3, 4)
    (rows * ct).sum().backward()
    expected = torch.zeros(10, 4).index_add_(0, ids.long(), ct)
    torch.testing.assert_close(table.grad, expected)


def _held(fn, *args):
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = fn(*args)
    skip = {a.untyped_storage().data_ptr() for a in args}
    if isinstance(fn, torch.nn.Module):
        skip |= {p.untyped_storage().data_ptr() for p in fn.parameters()}
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed}
    return sum(n for p, n in held.items() if p not in skip), out


def test_boundary_modes_agree_and_recompute_holds_only_inputs():
    x = torch.randn(8, 16)
    ct = torch.randn(8, 16)
    modules = {mode: FlaxModule(RematScanStack(16, (4, 4)), example_args=(x,), seed=5,
                                residuals=mode) for mode in ("save", "recompute")}
    results = {}
    for mode, m in modules.items():
        xi = x.clone().requires_grad_()
        held, y = _held(m, xi)
        (y * ct).sum().backward()
        results[mode] = (held, y.detach(), xi.grad, [p.grad for p in m.parameters()])
    assert results["recompute"][0] == 0 < results["save"][0]
    for a, b in zip(results["save"][1:3], results["recompute"][1:3], strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(results["save"][3], results["recompute"][3], strict=True):
        torch.testing.assert_close(a, b)
    variables = modules["save"].flax_variables()
    _, vjp = jax.vjp(RematScanStack(16, (4, 4)).apply, variables, _j(x))
    torch.testing.assert_close(results["save"][2], _t(vjp(_j(ct))[1]))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_inside_torch_checkpoint_same_gradients_and_nothing_held(reentrant):
    x = torch.randn(8, 16)
    m = FlaxModule(RematScanStack(16, (4, 4)), example_args=(x,))
    ct = torch.randn(8, 16)
    grads = []
    for wrap in (False, True):
        m.zero_grad()
        xi = x.clone().requires_grad_()
        y = checkpoint(m, xi, use_reentrant=reentrant) if wrap else m(xi)
        (y * ct).sum().backward()
        grads.append([xi.grad] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
    if not reentrant:
        held, _ = _held(lambda t: checkpoint(m, t, use_reentrant=False),
                        x.clone().requires_grad_())
        assert held == 0  # our residuals are dropped after forward, rebuilt on recompute


def test_save_on_cpu_applies_to_our_residuals():
    x = torch.randn(8, 16, requires_grad=True)
    m = FlaxModule(RematScanStack(16, (4, 4)), example_args=(x,))
    ct = torch.randn(8, 16)
    (m(x) * ct).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    with torch.autograd.graph.save_on_cpu():
        y = m(x)
    (y * ct).sum().backward()
    torch.testing.assert_close(x.grad, expected)


def test_jax_function_static_and_unhashable_arguments():
    f = jax_function(lambda x, n: x * n)
    x = torch.randn(3)
    torch.testing.assert_close(f(x, 3), x * 3)
    with pytest.raises(TypeError, match=r"args\[1\].*hashable"):
        f(x, np.ones(2))
    with pytest.raises(ValueError, match="residuals='nope'"):
        jax_function(mlp, residuals="nope")


def test_module_returning_non_arrays_is_refused():
    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            return {"y": x, "mod": nn.Dense(2)}

    with pytest.raises(TypeError, match="only arrays can cross"):
        FlaxModule(Bad(), variables={})(torch.zeros(2))


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_a_loss_of_flax_variable_tensors_sends_gradients_to_the_parameters(kind):
    """The fast path for a loss torch would differentiate again (``flax_variable_tensors``):
    a gradient penalty written in JAX, one ``jax_function`` of the module's own tensors,
    gives each parameter pure JAX's ``jax.grad`` of the same loss, for Linen and NNX."""
    from flax import nnx

    from tests.support.twins import TanhMLP

    x = torch.randn(6, 3)
    if kind == "linen":
        block = TanhMLP(8, 2)
        m = FlaxModule(block, example_args=(torch.zeros(1, 3),))

        def apply(variables, x):
            return block.apply(variables, x)
    else:
        m = FlaxModule(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
        graphdef = nnx.graphdef(m.flax_module)

        def apply(variables, x):
            return nnx.merge(graphdef, *variables)(jnp.tanh(x))

    def penalty(variables, x):
        gx = jax.grad(lambda x: apply(variables, x).sum())(x)
        return jnp.mean((jnp.linalg.norm(gx, axis=1) - 1) ** 2) + apply(variables, x).var()

    variables = m.flax_variable_tensors()
    assert all(any(t is p for p in m.parameters())
               for t in jax.tree_util.tree_leaves(variables))
    jax_function(penalty)(variables, x).backward()
    want = jax.grad(penalty)(jax.tree_util.tree_map(jnp.array, m.flax_variables()), _j(x))
    for (path, got), w in zip(jax.tree_util.tree_leaves_with_path(variables),
                              jax.tree_util.tree_leaves(want), strict=True):
        assert got.grad is not None, path
        np.testing.assert_allclose(got.grad.numpy(), np.asarray(w), rtol=1e-5,
                                   atol=1e-6 * float(np.abs(np.asarray(w)).max()),
                                   err_msg=jax.tree_util.keystr(path))


def test_flax_variable_tensors_read_a_pruned_weight_as_a_call_does():
    """A weight a scope's forward pre-hook recomputes (``torch.nn.utils.prune``) comes as
    the call reads it: masked, with its gradient reaching the original."""
    from torch.nn.utils import prune

    from tests.support.twins import TanhMLP

    block = TanhMLP(8, 2)
    m = FlaxModule(block, example_args=(torch.zeros(1, 3),))
    prune.random_unstructured(m.params.Dense_1, "kernel", amount=0.5)
    mask = m.params.Dense_1.kernel_mask.clone()
    with torch.no_grad():  # a stale masked weight: only the pre-hook recomputes it
        m.params.Dense_1.kernel_orig.mul_(3.0)
    x = torch.randn(4, 3)
    variables = m.flax_variable_tensors()
    kernel = variables["params"]["Dense_1"]["kernel"]
    torch.testing.assert_close(kernel, m.params.Dense_1.kernel_orig * mask)
    jax_function(lambda v, x: block.apply(v, x).sum())(variables, x).backward()
    m_grad = m.params.Dense_1.kernel_orig.grad
    m.zero_grad()
    m(x).sum().backward()  # the call's own route: the same masked gradient
    torch.testing.assert_close(m_grad, m.params.Dense_1.kernel_orig.grad)
    assert bool((m_grad[mask == 0] == 0).all())
