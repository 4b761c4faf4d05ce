"""The benchmark's models: Flax stacks, their torch twins with the same weights, and inputs.

Every Flax model here is a stack of one residual MLP block (or, for TINY, a 2-layer MLP);
its torch twin is built from the very same parameter values, so the three contestants
(``FlaxModule``, pure JAX, eager torch) compute the same function on the same inputs.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

import flaxside

# -- Flax -----------------------------------------------------------------------------------


class Block(nn.Module):
    """``x + Dense(w)(gelu(Dense(2w)(LayerNorm(x))))``: 6 parameter leaves."""

    width: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(epsilon=1e-5)(x)
        h = nn.gelu(nn.Dense(2 * self.width)(h), approximate=False)
        return x + nn.Dense(self.width)(h)


class TinyMLP(nn.Module):
    """``Dense(w)(relu(Dense(w)(x)))``: the smallest useful call, to expose fixed costs."""

    width: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.width)(x))  # built first, so named Dense_0
        return nn.Dense(self.width)(h)


class Unrolled(nn.Module):
    """``depth`` blocks written as a Python loop: ``6 * depth`` separate parameter leaves."""

    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = Block(self.width, name=f"block_{i}")(x)
        return x


class Scan(nn.Module):
    """``depth`` blocks under ``nn.scan``, optionally each one under ``nn.remat``."""

    width: int
    depth: int
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        body = nn.remat(Block) if self.remat else Block
        stack = nn.scan(
            lambda block, carry, _: (block(carry), None),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.depth,
        )
        x, _ = stack(body(self.width, name="stack"), x, None)
        return x


class RematScan(nn.Module):
    """``prod(lengths)`` blocks, nested ``nn.remat_scan`` with every level rematerialised."""

    width: int
    lengths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        stack = nn.remat_scan(nn.remat(Block), lengths=self.lengths)
        return stack(self.width, name="stack")(x)


class RematStack(nn.Module):
    """``prod(lengths)`` blocks under ``flaxside.remat_stack``: the same parameters (names
    and shapes) and function as ``RematScan``, with flaxtorch's hand-written nested-scan VJP
    (pure JAX/Flax, usable without torch)."""

    width: int
    lengths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        stack = flaxside.remat_stack(Block, math.prod(self.lengths), lengths=self.lengths,
                                     width=self.width, name="stack")
        return stack(x)


def scan_lengths(depth: int, levels: int) -> tuple[int, ...]:
    """``levels`` factors of ``depth``, as equal as possible, largest last (innermost).

    Example:
        >>> scan_lengths(1024, 2), scan_lengths(1024, 3)
        ((32, 32), (8, 8, 16))
    """
    if levels == 1:
        return (depth,)
    target = round(depth ** (1 / levels))
    divisors = [d for d in range(1, depth + 1) if depth % d == 0]
    first = min(divisors, key=lambda d: (abs(math.log(d) - math.log(target)), d))
    return tuple(sorted((first, *scan_lengths(depth // first, levels - 1))))


# -- torch twins ----------------------------------------------------------------------------


class TorchBlock(torch.nn.Module):
    """The torch twin of ``Block``."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width, eps=1e-5)
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float32))


def _load_linear(linear: torch.nn.Linear, p) -> None:
    linear.weight.copy_(_t(p["kernel"]).T)
    linear.bias.copy_(_t(p["bias"]))


def _torch_block(width: int, p) -> TorchBlock:
    block = TorchBlock(width)
    with torch.no_grad():
        block.norm.weight.copy_(_t(p["LayerNorm_0"]["scale"]))
        block.norm.bias.copy_(_t(p["LayerNorm_0"]["bias"]))
        _load_linear(block.fc1, p["Dense_0"])
        _load_linear(block.fc2, p["Dense_1"])
    return block


def torch_twin(module: nn.Module, params) -> list[torch.nn.Module]:
    """The torch layers computing ``module`` with ``params``, as a list to run in order."""
    if isinstance(module, TinyMLP):
        first = torch.nn.Linear(module.width, module.width)
        last = torch.nn.Linear(module.width, module.width)
        with torch.no_grad():
            _load_linear(first, params["Dense_0"])
            _load_linear(last, params["Dense_1"])
        return [torch.nn.Sequential(first, torch.nn.ReLU()), last]
    if isinstance(module, Unrolled):
        return [_torch_block(module.width, params[f"block_{i}"]) for i in range(module.depth)]
    # Scanned stacks: leading axes are the scan lengths; layer i is their row-major index.
    stacked = params["stack"]
    lead = np.shape(stacked["Dense_0"]["bias"])[:-1]
    depth = math.prod(lead)
    flat = jax.tree_util.tree_map(
        lambda a: np.asarray(a).reshape(depth, *np.shape(a)[len(lead) :]), stacked
    )
    return [
        _torch_block(module.width, jax.tree_util.tree_map(lambda a, i=i: a[i], flat))
        for i in range(depth)
    ]


# -- workloads --------------------------------------------------------------------------------


@dataclasses.dataclass
class Workload:
    """One model at one size, with its parameters and the inputs every contestant gets."""

    name: str
    module: nn.Module
    batch: int
    width: int
    depth: int
    variables: dict = dataclasses.field(repr=False, default=None)
    x: np.ndarray = dataclasses.field(repr=False, default=None)
    cotangent: np.ndarray = dataclasses.field(repr=False, default=None)

    def __post_init__(self):
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((self.batch, self.width), dtype=np.float32)
        self.cotangent = rng.standard_normal((self.batch, self.width), dtype=np.float32)
        if self.variables is None:
            # Initialized on the CPU wherever the contestants run: XLA's GPU compiler spent
            # more than 70 s compiling LEAVES' init (768 parameters unrolled) on an H200.
            with jax.default_device(jax.devices("cpu")[0]):
                self.variables = jax.jit(self.module.init)(jax.random.key(0),
                                                           jnp.asarray(self.x))

    @property
    def n_leaves(self) -> int:
        return len(jax.tree_util.tree_leaves(self.variables))

    def describe(self) -> str:
        return (
            f"{type(self.module).__name__}, depth {self.depth}, width {self.width}, "
            f"batch {self.batch}, {self.n_leaves} parameter leaves"
        )


def stack(kind: str, width: int, depth: int) -> nn.Module:
    """The Flax stack of ``depth`` blocks for a sweep variant name."""
    if kind == "scan":
        return Scan(width, depth)
    if kind == "scan(remat)":
        return Scan(width, depth, remat=True)
    if kind == "remat_scan x2":
        return RematScan(width, scan_lengths(depth, 2))
    if kind == "remat_scan x3":
        return RematScan(width, scan_lengths(depth, 3))
    if kind == "unrolled":
        return Unrolled(width, depth)
    raise ValueError(f"stack: unknown kind {kind!r}; expected one of {FLAX_VARIANTS}.")


def restack(variables, module: nn.Module):
    """``Scan`` variables (leading axis ``depth``) reshaped to ``module``'s scan lengths.

    ``Scan`` and ``RematScan`` name their parameters alike (``params.stack.*``) and differ
    only in the leading axes, so one initialisation serves every variant of a depth.
    """
    lead = tuple(getattr(module, "lengths", None) or (module.depth,))
    return jax.tree_util.tree_map(lambda a: a.reshape(*lead, *a.shape[1:]), variables)


FLAX_VARIANTS = ("scan", "scan(remat)", "remat_scan x2", "remat_scan x3")
