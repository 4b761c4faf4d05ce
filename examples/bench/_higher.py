"""The benchmark's higher-order rows: a gradient-penalty step and a PINN step from torch.

Each step differentiates a Flax block more than once from torch (NOTE [Higher order] in
``torchside/edges/_higher.py``):

* PENALTY (WGAN-GP): a tanh MLP critic; ``gx = autograd.grad(critic(x).sum(), x,
  create_graph=True)``, then ``((gx.norm(dim=1) - 1)**2).mean().backward()``;
* PINN: ``examples/pinn.py``'s model (torch Linear, a ``FlaxModule`` over an
  ``nn.remat_scan`` trunk, torch Linear, zero on the boundary); the mean squared residual of
  the Poisson equation, the Laplacian by nested ``autograd.grad``, then ``.backward()``:
  third derivatives through the trunk.

Contestants, one step each, on the same weights and points (interleaved rounds, medians):

* ``bridge``: the torch step through ``FlaxModule``;
* ``pure JAX``: ``jit(grad)`` of the same loss written in JAX (the Laplacian by nested
  ``jax.grad`` of batch sums, as torch takes it: faster here than a per-point
  ``jax.hessian``): one program, the limit;
* ``no bridge``: the programs the bridge runs, built the same way (``flaxside.internal``'s
  ``Program`` over the block, ``vjp_function`` for each further order), jitted once, run
  back to back with torch's part between them and arrays crossing by DLPack. PENALTY: the
  three programs called by hand (the forward, the VJP's forward with residuals, its
  backward). PINN: torch must drive nested derivatives through its own layers around the
  trunk, so each program call is a minimal ``torch.autograd.Function`` whose backward,
  under ``create_graph``, is a call of the VJP's programs, as the bridge's is
  (``_higher_floor.py``). Meant as what any bridge that lets torch drive the
  derivatives pays; on CPU a DLPack conversion costs more than the bridge's pointer views,
  so the bridge may beat it;
* ``torch``: the torch twin, eager (parameters in Flax's layout, same operations);
* ``bridge, whole VJPs`` (PINN): the bridge step with every derived VJP called whole,
  its linearization shared by no call (NOTE [Shared linearization] off);
* ``fast path``: the loss written in JAX (``pure JAX``'s function) as one ``jax_function``
  of the model's own tensors (``FlaxModule.flax_variable_tensors``; ``pinn.py --fast``):
  torch asks for the gradients of one scalar, so the call is the one program
  ``jit(value_and_grad)`` compiles, plus the bridge's call.

Also, per order: the programs the bridge compiled, how many runs a step makes (counted on
the floor, which runs the same schedule), each program's time (the floor, timed apart)
and the bytes the bridge's step holds for backward, by the order whose call saved them.
"""

from __future__ import annotations

import math
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this folder, and examples/ for pinn.py
from _higher_floor import FloorTrunk, Node  # noqa: E402
from _measure import Contestant, race  # noqa: E402
from _orders import bridge_programs, held_by_order, kind_rank  # noqa: E402
from pinn import PINN, Trunk, fast_loss, jax_loss, laplacian, source  # noqa: E402

from torchside import FlaxModule, jax_function  # noqa: E402
from torchside.edges._edges import WHOLE_VJPS  # noqa: E402  (internals: the route's switch)
from torchside.edges._higher import VjpCalls  # noqa: E402

jtu = jax.tree_util

# Per size: PENALTY (batch, features, width, layers), PINN (points, width, lengths).
SHAPES = {
    "full": dict(penalty=(256, 64, 256, 4), pinn=(256, 32, (2, 4))),
    "quick": dict(penalty=(256, 64, 256, 4), pinn=(256, 32, (2, 4))),
    "smoke": dict(penalty=(8, 4, 16, 2), pinn=(16, 8, (2, 2))),
}
TARGETS = {"PENALTY": 1.5, "PINN": 2.0}  # bridge <= this x pure JAX (CPU)
# The bridge with every VJP whole: NOTE [Shared linearization] and NOTE [Given residuals]
# off, what they save measured side by side.
WHOLE = "bridge, whole VJPs"
FLOOR_TARGET = 1.1  # bridge <= this x the no-bridge floor
# What each order's programs compute (NOTE [Higher order]), per workload and order.
COMPUTES = {
    "PENALTY": {
        1: "the critic's forward; its residuals are what order 2 reads",
        2: "the VJP for gx alone (no weight gradients: the penalty reads none), from "
           "order 1's residuals (NOTE [Given residuals]): given apply, the first-order "
           "backward body on them (no forward), its backward the VJP of that; given "
           "transpose, the VJP of the residuals in the leaves, the forward's matmuls "
           "taken out, run once by the step's backward",
    },
    "PINN": {
        1: "the trunk's forward (remat_scan: keeps the carries); backward recomputes "
           "each layer",
        2: "the VJP for the input alone, called for the first derivative and once per "
           "dimension back through order 1, on one leaf set: split (NOTE [Shared "
           "linearization]) into linearize (the trunk's forward and linearization, once a "
           "step; its backward once) and apply (per call); the first step runs the whole "
           "VJP, which recomputes the forward per call",
        3: "the VJPs of order 2's linearize and of its first apply, each called once per "
           "dimension of the Laplacian on one leaf set: split the same way",
    },
}


class Critic(nn.Module):
    """``layers`` tanh Dense layers of ``width``, then a Dense to one output."""

    width: int
    layers: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = jnp.tanh(nn.Dense(self.width)(x))
        return nn.Dense(1)(x)


class _TwinCritic(torch.nn.Module):
    """``Critic`` in torch, its parameters in Flax's layout and order (bias, kernel)."""

    def __init__(self, leaves):
        super().__init__()
        self.leaves = torch.nn.ParameterList(torch.tensor(np.asarray(a)) for a in leaves)

    def forward(self, x):
        pairs = list(zip(self.leaves[::2], self.leaves[1::2], strict=True))
        for b, k in pairs[:-1]:
            x = torch.tanh(torch.addmm(b, x, k))
        return torch.addmm(pairs[-1][0], x, pairs[-1][1])


class _TwinTrunk(torch.nn.Module):
    """``pinn.Trunk`` in torch: ``h + tanh(h @ kernel + bias)`` per layer, scan order."""

    def __init__(self, bias, kernel):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.tensor(np.asarray(bias)))
        self.kernel = torch.nn.Parameter(torch.tensor(np.asarray(kernel)))

    def forward(self, h):
        width = h.shape[-1]
        biases = self.bias.reshape(-1, width).unbind(0)
        for b, k in zip(biases, self.kernel.reshape(-1, width, width).unbind(0), strict=True):
            h = h + torch.tanh(torch.addmm(b, h, k))
        return h


# -- the no-bridge floor ------------------------------------------------------------------
class _Contestant(Contestant):
    """A contestant made of a function; ``grads()`` reads the parameter gradients."""

    def __init__(self, name, call, params, inputs=()):
        self.name, self.call, self.params = name, call, [*params, *inputs]
        # None where the loss does not depend on a parameter (the critic's last bias).
        self.grads = lambda: [np.zeros(p.shape, np.float32) if p.grad is None
                              else p.grad.numpy().copy() for p in params]


def _penalty_loss(apply, params, x):
    gx = jax.grad(lambda x: apply({"params": params}, x).sum())(x)
    return jnp.mean((jnp.linalg.norm(gx, axis=1) - 1) ** 2)


def _torch_penalty(critic, x) -> None:
    (gx,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
    ((gx.norm(dim=1) - 1) ** 2).mean().backward()


def penalty_contestants(batch, features, width, layers) -> tuple[list, dict]:
    """The PENALTY contestants, and the bridge's step and module (for the per-order rows)."""
    critic = Critic(width, layers)
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((batch, features), dtype=np.float32)
    variables = jax.jit(critic.init)(jax.random.key(0), x_np)
    leaves, treedef = jtu.tree_flatten(variables["params"])
    out = []

    module = FlaxModule(critic, variables=variables)
    x_b = torch.tensor(x_np, requires_grad=True)
    out.append(_Contestant("bridge", lambda: _torch_penalty(module, x_b),
                           list(module.parameters()), [x_b]))
    whole = FlaxModule(critic, variables=variables)
    whole._caller.edges = WHOLE_VJPS  # NOTE [Given residuals] off for this owner
    x_w = torch.tensor(x_np, requires_grad=True)

    def whole_step():
        _torch_penalty(whole, x_w)

    step = jax.jit(jax.grad(lambda p, x: _penalty_loss(critic.apply, p, x)))
    args = jax.device_put((variables["params"], x_np))
    box = {}

    def pure():
        box["grads"] = jax.block_until_ready(step(*args))

    pure_c = _Contestant("pure JAX", pure, [])
    pure_c.grads = lambda: [np.asarray(g) for g in jtu.tree_leaves(box["grads"])]
    out.append(pure_c)

    # The floor: the bridge's four programs by hand, the penalty in torch between them:
    # the forward, then (NOTE [Given residuals]) the first-order backward body on its
    # residuals z for gx, that body's backward, and the VJP of z in the leaves.
    params = [torch.nn.Parameter(torch.tensor(np.asarray(a))) for a in leaves]
    x_f = torch.tensor(x_np, requires_grad=True)
    n = len(params)
    node = Node(lambda xs: critic.apply({"params": jtu.tree_unflatten(treedef, xs[:n])},
                                         xs[n]))
    first = node.program([*params, x_f], (True,) * (n + 1))
    rmap, n_out = first.residual_map(), len(first.out_specs)
    z_of = lambda out: [out[k] for k in rmap.saved_outputs] + list(out[n_out:])  # noqa: E731
    z_t = [torch.zeros(s.shape) for s in (*(first.out_specs[k] for k in rmap.saved_outputs),
                                          *rmap.residual_specs)]
    apply_node = node.derived(first, (n,), "given apply ")  # x's gradient: what it reads
    ones = torch.ones(batch, 1)
    second = apply_node.program([*params, x_f, *z_t, ones],
                                (True,) * (n + 1 + len(z_t)) + (False,))
    transpose_node = node.derived(first, None, "given transpose ")
    third = transpose_node.program([*params, x_f, *z_t, *z_t], (False,) * (n + 1 + 2 * len(z_t)))

    def floor():
        arrays = [*map(node.to_jax, params), node.to_jax(x_f)]
        z = z_of(node.run(first, "forward_with_residuals", arrays))  # y and z
        args = [*arrays, *z, node.to_jax(torch.ones(batch, 1))]  # y.sum()'s cotangent
        res = apply_node.run(second, "forward_with_residuals", args)
        gx = node.to_torch(res[0]).requires_grad_()
        ((gx.norm(dim=1) - 1) ** 2).mean().backward()
        grads = apply_node.backward(second, args, res, [node.to_jax(gx.grad)])
        z_cots = [node.to_jax(g) for g in grads[n + 1:]]
        more = transpose_node.run(third, "forward", [*arrays, *z, *z_cots])
        for p, g, h in zip([*params, x_f], grads, more, strict=False):
            p.grad = g + node.to_torch(h)

    out.append(_Contestant("no bridge", floor, params, [x_f]))
    out[-1].node = node

    twin = _TwinCritic(leaves)
    x_t = torch.tensor(x_np, requires_grad=True)
    out.append(_Contestant("torch", lambda: _torch_penalty(twin, x_t),
                           list(twin.parameters()), [x_t]))

    # The fast path: the penalty written in JAX, one jax_function of the module's tensors.
    fast = FlaxModule(critic, variables=variables)
    penalty = jax_function(lambda v, x: _penalty_loss(critic.apply, v["params"], x))
    x_j = torch.tensor(x_np)
    out.append(_Contestant("fast path",
                           lambda: penalty(fast.flax_variable_tensors(), x_j).backward(),
                           list(fast.parameters())))
    out.append(_Contestant(WHOLE, whole_step, list(whole.parameters()), [x_w]))
    return out, dict(module=module, step=out[0].call, exclude=out[0].params)


def _pinn_loss(trunk, treedef, params, xy):
    wi, bi, tb, tk, wo, bo = params
    return jax_loss(trunk, jtu.tree_unflatten(treedef, [tb, tk]), wi, bi, wo, bo, xy)


def _torch_pinn(model, xy) -> None:
    (laplacian(model(xy), xy) + source(xy)).pow(2).mean().backward()


def pinn_contestants(points, width, lengths) -> tuple[list, dict]:
    """The PINN contestants, and the bridge's step and module (for the per-order rows)."""
    torch.manual_seed(0)
    bridge = PINN(width, lengths)
    xy_np = torch.rand(points, 2).numpy()
    state = bridge.state_dict()
    variables = bridge.trunk.flax_variables()
    bias, kernel = (np.asarray(a) for a in jtu.tree_leaves(variables))
    out = []
    xy_b = torch.tensor(xy_np, requires_grad=True)
    out.append(_Contestant("bridge", lambda: _torch_pinn(bridge, xy_b),
                           list(bridge.parameters()), [xy_b]))

    treedef = jtu.tree_structure(variables)
    # inp.weight, inp.bias, the trunk's bias and kernel, out.weight, out.bias
    params = [jnp.asarray(p.detach().numpy()) for p in bridge.parameters()]
    trunk = Trunk(width, lengths)
    step = jax.jit(jax.grad(lambda p, xy: _pinn_loss(trunk, treedef, p, xy)))
    box = {}

    def pure():
        box["grads"] = jax.block_until_ready(step(params, xy_np))

    pure_c = _Contestant("pure JAX", pure, [])
    pure_c.grads = lambda: [np.asarray(g) for g in box["grads"]]
    out.append(pure_c)

    floor_trunk = FloorTrunk(trunk, bias, kernel)
    for name, block in (("no bridge", floor_trunk), ("torch", _TwinTrunk(bias, kernel))):
        model = PINN(width, lengths)
        model.load_state_dict(state)
        model.trunk = block  # the same weights, another trunk
        xy = torch.tensor(xy_np, requires_grad=True)
        out.append(_Contestant(name, lambda m=model, xy=xy: _torch_pinn(m, xy),
                               list(model.parameters()), [xy]))
    out[2].node = floor_trunk.node

    # The fast path: pinn.py's --fast, the loss as one jax_function of the model's tensors.
    fast = PINN(width, lengths)
    fast.load_state_dict(state)
    fast_step, xy_j = fast_loss(fast), torch.tensor(xy_np)
    out.append(_Contestant("fast path", lambda: fast_step(xy_j).backward(),
                           list(fast.parameters())))

    # The bridge with every VJP whole, never split (NOTE [Shared linearization] off): what
    # sharing the linearization saves, side by side.
    whole = PINN(width, lengths)
    whole.load_state_dict(state)
    whole.trunk._caller.edges = WHOLE_VJPS  # NOTE [Given residuals] off for this owner
    xy_w = torch.tensor(xy_np, requires_grad=True)

    def whole_step():
        share = VjpCalls.SHARE_AFTER
        VjpCalls.SHARE_AFTER = math.inf
        try:
            _torch_pinn(whole, xy_w)
        finally:
            VjpCalls.SHARE_AFTER = share

    out.append(_Contestant(WHOLE, whole_step, list(whole.parameters()), [xy_w]))
    return out, dict(module=bridge.trunk, step=out[0].call, exclude=out[0].params)


def _mismatch(grads: list, reference: list) -> float:
    """Worst leaf's ``max |g - ref| / max |ref|``."""
    return max(float(np.abs(g - r).max()) / max(float(np.abs(r).max()), 1e-30)
               for g, r in zip(grads, reference, strict=True))


def higher_rows(size_name: str, size: dict) -> list[dict]:
    """Times, agreement and per-order figures of both workloads."""
    shapes = SHAPES[size_name]
    b, f, w, n = shapes["penalty"]
    points, width, lengths = shapes["pinn"]
    rows = []
    for name, make, args, describe in (
        ("PENALTY", penalty_contestants, shapes["penalty"],
         f"critic {n} tanh Dense {w} + Dense 1, batch {b} x {f}"),
        ("PINN", pinn_contestants, shapes["pinn"],
         f"pinn.py: {math.prod(lengths)} layers, width {width}, nn.remat_scan{lengths}, "
         f"{points} points"),
    ):
        t0 = time.perf_counter()
        contestants, bridge = make(*args)
        first, compile_s = {}, {}
        for c in contestants:
            first[c.name], compile_s[c.name] = c.first_call()
        # The bridge's second step compiles the VJPs it splits (NOTE [Shared linearization]).
        second = contestants[0].first_call()
        grads = {}
        for c in contestants:
            c.call()
            grads[c.name] = c.grads()
            c.reset()
        reference = grads["pure JAX"]
        mismatch = {k: _mismatch(g, reference) for k, g in grads.items()}
        times, rounds = race(contestants, budget=size["budget"],
                             min_repeats=size["min_repeats"], warmup=size["warmup"],
                             label=name)
        node = contestants[2].node
        floor_seconds = node.profile(contestants[2].call_and_keep, max(2, min(20, rounds)))
        compiled = bridge_programs(bridge["module"])
        held = held_by_order(bridge["module"], bridge["step"], bridge["exclude"])
        contestants[0].reset()
        arrays, runs, spent = node.arrays_out(), node.runs, node.seconds
        programs = [dict(order=o, kind=k, compiled=compiled.get((o, k), 0),
                         arrays=arrays.get((o, k)), runs=runs[o, k],
                         seconds=spent[o, k] / max(runs[o, k], 1))
                    for o, k in sorted(set(compiled) | set(runs),
                                       key=lambda ok: (ok[0], *kind_rank(ok[1])))]
        rows.append(dict(name=name, describe=describe, times=times, rounds=rounds,
                         first_call=first, compile=compile_s, second_call=second,
                         mismatch=mismatch,
                         programs=programs, held=held, computes=COMPUTES[name],
                         floor_seconds=floor_seconds,
                         program_seconds=sum(v for k, v in spent.items() if k != "dlpack"),
                         dlpack_seconds=spent.get("dlpack", 0.0)))
        print(f"  {name}: {describe}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows
