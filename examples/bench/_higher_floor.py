"""The no-bridge floor of the benchmark's higher-order rows (``_higher.py``).

The programs the bridge runs for a derivative of a derivative, built the same way
(``flaxside.internal``'s ``Program`` over the block, ``vjp_function`` for each further
order), jitted once and run back to back from torch, arrays crossing by DLPack, with no
bridge code on the path. ``Node`` is one such JAX function and its programs; ``_Call``
runs one from torch's autograd (its backward, under ``create_graph``, a ``_Call`` of the
VJP's programs, as the bridge's is); ``FloorTrunk`` is the PINN's trunk through it.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter, defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import torch

from flaxside.internal import (
    LeafSpec,
    Program,
    WriteBack,
    given_vjp,
    linearized_vjp,
    unpack,
    vjp_function,
    vjp_work,
)
from torchside.edges._higher import VjpCalls  # the split's threshold (a constant, read once)

jtu = jax.tree_util


def _to_jax(t: torch.Tensor):
    return jax.dlpack.from_dlpack(t.detach().contiguous())


class Node:
    """A JAX function of flat leaves, its ``Program`` per grad flags, and its VJP's node.

    ``runs`` counts program runs by ``(order, kind)``; with ``timed[0]`` set, each adds
    its seconds to ``seconds``. A node's derivatives share its counters and held arrays.
    """

    def __init__(self, fn, order: int = 1, parent: Node | None = None, role: str = ""):
        self.fn, self.order, self.role = fn, order, role  # role: "", "linearize ", "apply "
        self.runs = Counter() if parent is None else parent.runs
        self.seconds = defaultdict(float) if parent is None else parent.seconds
        self.timed = [False] if parent is None else parent.timed
        self.held = {} if parent is None else parent.held
        self._programs, self._derived, self._zeros, self._shares = {}, {}, {}, {}

    def to_jax(self, t: torch.Tensor):
        """A parameter's memory is imported once, as the bridge holds it; the rest per call.

        Zero-copy: JAX reads torch's in-place updates (an optimizer's) through it.
        """
        start = time.perf_counter()
        if not isinstance(t, torch.nn.Parameter):
            out = _to_jax(t)
        else:
            held = self.held.get(id(t))
            if held is None:  # keeps t, so that its id stays its own
                held = self.held[id(t)] = (t, _to_jax(t))
            out = held[1]
        self._spent("dlpack", start)
        return out

    def to_torch(self, array) -> torch.Tensor:
        start = time.perf_counter()
        out = torch.from_dlpack(array)
        self._spent("dlpack", start)
        return out

    def _spent(self, key, start: float) -> None:
        if self.timed[0]:
            self.seconds[key] += time.perf_counter() - start

    def program(self, leaves, diff) -> Program:
        key = tuple((tuple(t.shape), t.dtype, d) for t, d in zip(leaves, diff, strict=True))
        program = self._programs.get(key)
        if program is None:
            specs = [LeafSpec(tuple(t.shape), np.dtype(str(t.dtype).removeprefix("torch.")), d)
                     for t, d in zip(leaves, diff, strict=True)]
            fn = self.fn
            program = self._programs[key] = Program(
                lambda xs: (fn(xs), [], WriteBack()), specs, name=f"order {self.order}")
        return program

    def derived(self, program: Program, wanted: tuple | None, role: str = "") -> Node:
        """The node of ``vjp_function(program, wanted)``: ``f(leaves + cotangents)``; with
        ``role`` "linearize " or "apply ", of that part of ``linearized_vjp``'s split:
        ``linearize(leaves)``, ``apply(leaves + residuals + cotangents)``; with "given
        apply " or "given transpose ", of that part of ``given_vjp`` (NOTE [Given
        residuals]): ``f(leaves + z + cotangents)``, ``f(leaves + z + cotangents of z)``."""
        node = self._derived.get((program, wanted, role))
        if node is None:
            n, k = len(program.specs), len(program.diff_out_index)
            if not role:
                vjp = vjp_function(program, wanted)
                fn = lambda xs: vjp(xs[:n], xs[n:])  # noqa: E731
            elif role.startswith("given"):
                rmap = program.residual_map()
                nz = len(rmap.saved_outputs) + len(rmap.residual_specs)
                part = given_vjp(program, wanted)[role == "given transpose "]
                fn = lambda xs: part(xs[:n], xs[n:n + nz], xs[n + nz:])  # noqa: E731
            else:
                parts = self._shares[program, wanted].parts
                fn = parts[0] if role == "linearize " else (
                    lambda xs: parts[1](xs[:n], xs[n:-k], xs[-k:]))
            node = self._derived[program, wanted, role] = Node(fn, self.order + 1, self, role)
        return node

    def share(self, program: Program, wanted: tuple | None) -> _Share:
        """The calls of ``program``'s VJP for ``wanted``: split as the bridge splits them."""
        share = self._shares.get((program, wanted))
        if share is None:
            share = self._shares[program, wanted] = _Share(
                linearized_vjp(program, wanted),
                vjp_work(program, wanted) >= VjpCalls.SPLIT_MIN_WORK)
        return share

    def run(self, program: Program, kind: str, *args) -> list:
        self.runs[self.order, self.role + kind] += 1
        start = time.perf_counter()
        out = program.executable(kind)(*args)
        jax.block_until_ready(out)  # torch reads the results next
        self._spent((self.order, self.role + kind), start)
        return out

    def profile(self, step, repeats: int) -> float:
        """Seconds per ``step``, run ``repeats`` times; ``runs`` and ``seconds`` per step."""
        self.runs.clear()
        self.seconds.clear()
        self.timed[0] = True
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        total = time.perf_counter() - start
        self.timed[0] = False
        for counter in (self.runs, self.seconds):
            for key in counter:
                counter[key] /= repeats
        return total / repeats

    def arrays_out(self) -> dict:
        """``(order, kind) -> arrays`` each program returns (results and residuals)."""
        out = {}
        for program in self._programs.values():
            out[self.order, self.role + "forward_with_residuals"] = len(
                program.out_specs) + len(program.residual_map().residual_specs)
            out[self.order, self.role + "forward"] = len(program.out_specs)
            out[self.order, self.role + "backward"] = len(program.grad_specs)
            for (p, *_), node in self._derived.items():
                if p is program:
                    out.update(node.arrays_out())
        return out

    def zeros(self, program: Program, k: int):
        """The cotangent of output ``k`` when torch has none (a JAX array, made once)."""
        key = (program, k)
        if key not in self._zeros:
            s = program.out_specs[k]
            self._zeros[key] = jnp.zeros(s.shape, s.dtype)
        return self._zeros[key]

    def backward(self, program: Program, leaves, out, cots) -> list:
        """Per diff leaf its gradient (torch views), from what the forward returned."""
        rmap, n = program.residual_map(), len(program.out_specs)
        cots = [self.zeros(program, k) if c is None else c
                for k, c in zip(program.diff_out_index, cots, strict=True)]
        buffers = self.run(program, "backward", [leaves[j] for j in rmap.saved_inputs],
                           [out[k] for k in rmap.saved_outputs], out[n:], cots)
        return unpack([self.to_torch(b) for b in buffers], program.grad_pack)


class _Call(torch.autograd.Function):
    """``apply(node, *leaves)``: one program call as an autograd node, as small as it gets.

    Its backward runs the program's backward; under ``create_graph`` it is a ``_Call`` of
    the VJP's node instead, so torch can differentiate it again (NOTE [Higher order]).
    """

    @staticmethod
    def forward(ctx, node, *leaves):
        program = node.program(leaves, ctx.needs_input_grad[1:])
        arrays = [node.to_jax(t) for t in leaves]
        out = node.run(program, "forward_with_residuals", arrays)
        ctx.node, ctx.program, ctx.arrays, ctx.out = node, program, arrays, out
        ctx.save_for_backward(*leaves)
        ctx.set_materialize_grads(False)
        results = [node.to_torch(a) for a in out[: program.n_out]]
        ctx.mark_non_differentiable(*(r for r, s in zip(results, program.out_specs,
                                                        strict=False) if not s.diff))
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        node, program = ctx.node, ctx.program
        cots = [grads[k] for k in program.diff_out_index]
        full = [None] * len(program.specs)
        if torch.is_grad_enabled():
            # Only the gradients the running backward reads, as the bridge does.
            edges = ctx.next_functions
            wanted = tuple(p for p, i in enumerate(program.diff_index)
                           if _executes(edges[i][0]))
            cots = [node.to_torch(node.zeros(program, k)) if c is None else c
                    for k, c in zip(program.diff_out_index, cots, strict=True)]
            key = None if len(wanted) == len(program.diff_index) else wanted
            out = node.share(program, key)(node, program, key, ctx.saved_tensors, cots)
            index = [program.diff_index[p] for p in wanted]
        else:
            out = node.backward(program, ctx.arrays, ctx.out,
                                [None if c is None else node.to_jax(c) for c in cots])
            index = program.diff_index
        for i, g in zip(index, out, strict=True):
            full[i] = g
        return (None, *full)


class _Share:
    """The bridge's NOTE [Shared linearization] (``torchside/edges/_higher.py``), as small as it
    gets: a leaf set (the same tensors, at the same versions) after one with several calls
    is linearized once and applied per call, where the VJP's work reaches the bridge's
    ``SPLIT_MIN_WORK``."""

    def __init__(self, parts, worth_it: bool):
        self.parts, self.worth_it = parts, worth_it
        self.leaves, self.residuals, self.calls, self.split = (), (), 0, False

    def __call__(self, node, program, key, leaves, cots) -> tuple:
        same = len(self.leaves) == len(leaves) and all(
            ref() is t and t._version == v
            for (ref, v), t in zip(self.leaves, leaves, strict=True))
        if same:
            self.calls += 1
            residuals = [r() for r in self.residuals]
            if residuals and all(r is not None for r in residuals):
                return _Call.apply(node.derived(program, key, "apply "), *leaves,
                                   *residuals, *cots)
        else:
            self.split, self.calls = self.calls >= 2 and self.worth_it, 1
            self.leaves = tuple((weakref.ref(t), t._version) for t in leaves)
            self.residuals = ()
        if not self.split:
            return _Call.apply(node.derived(program, key), *leaves, *cots)
        residuals = _Call.apply(node.derived(program, key, "linearize "), *leaves)
        self.residuals = tuple(weakref.ref(r) for r in residuals)
        return _Call.apply(node.derived(program, key, "apply "), *leaves, *residuals, *cots)


def _executes(node) -> bool:
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a node autograd.grad captures its result at: read
        return True


class FloorTrunk(torch.nn.Module):
    """``pinn.Trunk`` through ``_Call``: the PINN floor's block."""

    def __init__(self, trunk, bias, kernel):  # trunk: a pinn.Trunk
        super().__init__()
        self.bias = torch.nn.Parameter(torch.tensor(np.asarray(bias)))
        self.kernel = torch.nn.Parameter(torch.tensor(np.asarray(kernel)))
        treedef = jtu.tree_structure({"params": {"stack": {"Dense_0": {"bias": 0,
                                                                      "kernel": 0}}}})
        self.node = Node(lambda xs: trunk.apply(jtu.tree_unflatten(treedef, xs[:2]), xs[2]))

    def forward(self, h):
        return _Call.apply(self.node, self.bias, self.kernel, h)[0]


# -- contestants --------------------------------------------------------------------------
