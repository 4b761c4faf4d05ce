"""Flax modules and torch modules with identical math, for parity tests and benchmarks.

Also the small Flax models several test files share (the README's ``Deep``, a BatchNorm
MLP, an NNX MLP with state of every kind), so that a test defines a model of its own only
where it needs something these lack, and says what.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from flax import nnx

from torchside import FlaxModule


class ResidualMLPBlock(nn.Module):
    """``x + Dense(w)(gelu(Dense(2w)(LayerNorm(x))))``; carry in, carry out."""

    width: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, param_dtype=self.dtype)(x)
        h = nn.Dense(2 * self.width, dtype=self.dtype, param_dtype=self.dtype)(h)
        h = nn.gelu(h, approximate=False)
        h = nn.Dense(self.width, dtype=self.dtype, param_dtype=self.dtype)(h)
        return x + h


class RematScanStack(nn.Module):
    """``depth = prod(lengths)`` residual blocks with nested remat-scan, every level remat'd."""

    width: int
    lengths: tuple[int, ...]
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        stack = nn.remat_scan(nn.remat(ResidualMLPBlock), lengths=self.lengths)
        return stack(self.width, self.dtype, name="stack")(x)


def _scanned(block: nn.Module, depth: int, x):
    """``block`` applied ``depth`` times by ``nn.scan``, its parameters stacked on axis 0."""
    stack = nn.scan(
        lambda mdl, c, _: (mdl(c), None),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=depth,
    )
    x, _ = stack(block, x, None)
    return x


class ScanRematStack(nn.Module):
    """``depth`` residual blocks with ``nn.scan`` over ``nn.remat``."""

    width: int
    depth: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        body = nn.remat(ResidualMLPBlock)
        return _scanned(body(self.width, self.dtype, name="stack"), self.depth, x)


class ScanStack(nn.Module):
    """``depth`` residual blocks with ``nn.scan`` and no remat: every layer's internals are held."""

    width: int
    depth: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        return _scanned(ResidualMLPBlock(self.width, self.dtype, name="stack"), self.depth, x)


class ReadmeBlock(nn.Module):
    """The README's ``Block``: ``ResidualMLPBlock`` at Flax's defaults.

    LayerNorm's epsilon 1e-6, gelu's tanh approximation, and the dtype of its input: the
    block a user copies from the README, not the torch twin's math.
    """

    width: int

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(x))))


class ReadmeDeep(nn.Module):
    """The README's ``Deep``, shorter: ``nn.remat_scan(nn.remat(ReadmeBlock))`` of
    ``prod(lengths)`` layers, every scan level rematerialized, parameters under ``stack``."""

    width: int = 16
    lengths: tuple[int, ...] = (2, 2)

    @nn.compact
    def __call__(self, x):
        stack = nn.remat_scan(nn.remat(ReadmeBlock), lengths=self.lengths)
        return stack(self.width, name="stack")(x)


class TanhMLP(nn.Module):
    """``Dense(out)(tanh(Dense(hidden)(x)))``: two parameter scopes, ``Dense_0`` and ``Dense_1``."""

    hidden: int
    out: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.out)(jnp.tanh(nn.Dense(self.hidden)(x)))


class BatchNormMLP(nn.Module):
    """``Dense(6) -> BatchNorm -> tanh -> Dense(3)``: Linen state (batch statistics) that a
    train-mode call updates and FlaxModule writes back into torch buffers."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(6)(x))
        return nn.Dense(3)(jnp.tanh(h))


class NnxResidualMLPBlock(nnx.Module):
    """The NNX twin of ``ResidualMLPBlock``."""

    def __init__(self, width: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.norm = nnx.LayerNorm(width, epsilon=1e-5, **kw)
        self.fc1 = nnx.Linear(width, 2 * width, **kw)
        self.fc2 = nnx.Linear(2 * width, width, **kw)

    def __call__(self, x):
        return x + self.fc2(nnx.gelu(self.fc1(self.norm(x)), approximate=False))


class NnxDropoutMLP(nnx.Module):
    """Linear -> BatchNorm -> activation -> Dropout -> Linear: NNX state of every kind
    (Params, batch statistics, an RNG stream and its count)."""

    def __init__(self, rngs, din: int = 5, hidden: int = 8, dout: int = 3,
                 rate: float = 0.5, momentum: float = 0.7):
        self.fc1 = nnx.Linear(din, hidden, rngs=rngs)
        self.bn = nnx.BatchNorm(hidden, momentum=momentum, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.drop(nnx.relu(self.bn(self.fc1(x)))))


class TorchResidualMLPBlock(torch.nn.Module):
    """The torch twin of ``ResidualMLPBlock``."""

    def __init__(self, width: int, dtype=torch.float32):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width, eps=1e-5, dtype=dtype)
        self.fc1 = torch.nn.Linear(width, 2 * width, dtype=dtype)
        self.fc2 = torch.nn.Linear(2 * width, width, dtype=dtype)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def residual_block_module(width: int = 8, **options) -> FlaxModule:
    """``FlaxModule(ResidualMLPBlock(width))``, initialized for inputs ``(batch, width)``."""
    return FlaxModule(ResidualMLPBlock(width), example_args=(torch.zeros(2, width),), **options)


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


def load_residual_block(block: TorchResidualMLPBlock, p) -> None:
    """Copies one layer's Flax params (dict with LayerNorm_0, Dense_0, Dense_1) into ``block``."""
    with torch.no_grad():
        block.norm.weight.copy_(_t(p["LayerNorm_0"]["scale"]))
        block.norm.bias.copy_(_t(p["LayerNorm_0"]["bias"]))
        block.fc1.weight.copy_(_t(p["Dense_0"]["kernel"]).T)
        block.fc1.bias.copy_(_t(p["Dense_0"]["bias"]))
        block.fc2.weight.copy_(_t(p["Dense_1"]["kernel"]).T)
        block.fc2.bias.copy_(_t(p["Dense_1"]["bias"]))


def torch_stack_from_flax(stacked_params, width: int, dtype=torch.float32) -> torch.nn.ModuleList:
    """Per-layer torch blocks from stacked scan params (leading axes = the scan lengths).

    Layer ``i`` of a nested remat-scan is the row-major index over the leading axes.
    """
    lead = np.shape(stacked_params["Dense_0"]["bias"])[:-1]
    depth = int(np.prod(lead))
    flat = jax.tree_util.tree_map(lambda a: np.asarray(a).reshape(depth, *np.shape(a)[len(lead):]),
                                  stacked_params)
    blocks = torch.nn.ModuleList(TorchResidualMLPBlock(width, dtype) for _ in range(depth))
    for i, block in enumerate(blocks):
        load_residual_block(block, jax.tree_util.tree_map(lambda a, i=i: a[i], flat))
    return blocks
