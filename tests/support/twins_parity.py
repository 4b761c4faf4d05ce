"""More twins for the parity suite: transformer, LSTM and conv + BatchNorm blocks, stacks of
any twin (Flax and torch variants), and the ``TWINS`` registry with shared weights."""

from __future__ import annotations

import dataclasses
import functools as ft

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from tests.support.twins import ResidualMLPBlock, TorchResidualMLPBlock


# -- more twins: transformer block, LSTM layer, conv + BatchNorm block ----------------------
class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(LN(x))`` (causal, multi-head), then ``x + mlp(LN(x))``."""

    width: int
    heads: int
    dropout: float = 0.0
    deterministic: bool = True
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        kw = dict(dtype=self.dtype, param_dtype=self.dtype)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:-1]), dtype=jnp.bool_)
        h = nn.LayerNorm(epsilon=1e-5, name="ln1", **kw)(x)
        h = nn.MultiHeadDotProductAttention(
            self.heads, qkv_features=self.width, out_features=self.width,
            dropout_rate=self.dropout, deterministic=self.deterministic, name="attn",
            force_fp32_for_softmax=self.dtype == jnp.bfloat16, **kw,
        )(h, mask=mask)
        x = x + nn.Dropout(self.dropout, deterministic=self.deterministic)(h)
        h = nn.Dense(4 * self.width, name="fc1", **kw)(nn.LayerNorm(epsilon=1e-5, name="ln2",
                                                                   **kw)(x))
        h = nn.Dense(self.width, name="fc2", **kw)(nn.gelu(h, approximate=False))
        return x + nn.Dropout(self.dropout, deterministic=self.deterministic)(h)


class TorchTransformerBlock(torch.nn.Module):
    """The torch twin of ``TransformerBlock`` (dropout follows ``train()``/``eval()``)."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0, dtype=torch.float32):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(width, eps=1e-5, dtype=dtype)
        self.attn = torch.nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True,
                                                dtype=dtype)
        self.drop1 = torch.nn.Dropout(dropout)
        self.ln2 = torch.nn.LayerNorm(width, eps=1e-5, dtype=dtype)
        self.fc1 = torch.nn.Linear(width, 4 * width, dtype=dtype)
        self.fc2 = torch.nn.Linear(4 * width, width, dtype=dtype)
        self.drop2 = torch.nn.Dropout(dropout)

    def forward(self, x):
        t = x.shape[1]
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)  # True: masked
        h = self.ln1(x)
        h = self.attn(h, h, h, attn_mask=future, need_weights=False)[0]
        x = x + self.drop1(h)
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class LSTMLayer(nn.Module):
    """``x + LSTM(x)`` over time: ``nn.RNN`` (a scan) of an ``LSTMCell``; (B, T, w) -> (B, T, w).

    The residual keeps gradients measurable through a stack: without it they fall to 1e-4
    at the first of 8 layers, below every tolerance's absolute floor, and a parity test of
    those layers would check nothing.
    """

    width: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        cell = nn.LSTMCell(self.width, dtype=self.dtype, param_dtype=self.dtype, name="cell")
        return x + nn.RNN(cell)(x)


class TorchLSTMLayer(torch.nn.Module):
    """The torch twin of ``LSTMLayer``: ``x + torch.nn.LSTM(x)[0]``."""

    def __init__(self, width: int, dtype=torch.float32):
        super().__init__()
        self.lstm = torch.nn.LSTM(width, width, batch_first=True, dtype=dtype)

    def forward(self, x):
        return x + self.lstm(x)[0]


class ConvBNBlock(nn.Module):
    """``silu(x + BN(conv(silu(BN(conv(x))))))`` on NHWC, BatchNorm on running statistics.

    SiLU rather than ReLU: a kink at 0 lets bfloat16 rounding flip a gradient between 0 and
    its full value, which a parity test cannot tell from a bug.
    """

    channels: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        kw = dict(dtype=self.dtype, param_dtype=self.dtype)
        h = nn.Conv(self.channels, (3, 3), padding=1, name="conv1", **kw)(x)
        # Flax keeps running statistics and normalizes in float32 unless told otherwise; in
        # float64 that alone differs from torch by 3e-7.
        bn = ft.partial(nn.BatchNorm, use_running_average=True, epsilon=1e-5,
                        force_float32_reductions=self.dtype != jnp.float64, **kw)
        h = nn.silu(bn(name="bn1")(h))
        h = nn.Conv(self.channels, (3, 3), padding=1, name="conv2", **kw)(h)
        h = bn(name="bn2")(h)
        return nn.silu(x + h)


class TorchConvBNBlock(torch.nn.Module):
    """The torch twin of ``ConvBNBlock``; takes NHWC like it. Use it in ``eval()`` mode."""

    def __init__(self, channels: int, dtype=torch.float32):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, dtype=dtype)
        self.bn1 = torch.nn.BatchNorm2d(channels, eps=1e-5, dtype=dtype)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, dtype=dtype)
        self.bn2 = torch.nn.BatchNorm2d(channels, eps=1e-5, dtype=dtype)

    def forward(self, x):
        x = x.permute(0, 3, 1, 2)
        h = F.silu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.silu(x + h).permute(0, 2, 3, 1)


# -- stacks of any twin block ---------------------------------------------------------------
FLAX_VARIANTS = ("plain", "remat", "scan_remat", "remat_scan")


class FlaxStack(nn.Module):
    """``prod(lengths)`` blocks, carry in and carry out, built one of four ways.

    ``plain``: a Python loop (``layers_i``); ``remat``: the same loop of ``nn.remat`` blocks;
    ``scan_remat``: ``nn.scan`` over ``nn.remat`` (``stack``, leading axis ``depth``);
    ``remat_scan``: ``nn.remat_scan`` of ``nn.remat`` blocks (``stack``, leading ``lengths``).
    """

    block: type
    config: tuple  # the block's keyword arguments as sorted (name, value) pairs
    variant: str
    lengths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        if self.variant not in FLAX_VARIANTS:
            raise ValueError(f"FlaxStack: variant {self.variant!r} not in {FLAX_VARIANTS}")
        kw = dict(self.config)
        depth = int(np.prod(self.lengths))
        if self.variant in ("plain", "remat"):
            cls = self.block if self.variant == "plain" else nn.remat(self.block)
            for i in range(depth):
                x = cls(**kw, name=f"layers_{i}")(x)
            return x
        if self.variant == "scan_remat":
            stack = nn.scan(lambda mdl, c, _: (mdl(c), None), variable_axes={True: 0},
                            split_rngs={True: True}, length=depth)
            x, _ = stack(nn.remat(self.block)(**kw, name="stack"), x, None)
            return x
        stack = nn.remat_scan(nn.remat(self.block), lengths=self.lengths)
        return stack(**kw, name="stack")(x)


TORCH_VARIANTS = ("plain", "checkpoint", "checkpoint_reentrant", "checkpoint_sequential")


class TorchStack(torch.nn.Module):
    """Torch blocks in sequence, checkpointed one of four ways.

    ``plain``: no checkpoint; ``checkpoint``: ``torch.utils.checkpoint.checkpoint`` per block
    with ``use_reentrant=False``; ``checkpoint_reentrant``: the same with ``True``;
    ``checkpoint_sequential``: ``checkpoint_sequential`` in ``segments`` segments.
    """

    def __init__(self, blocks, checkpoint: str = "plain", segments: int = 2):
        super().__init__()
        if checkpoint not in TORCH_VARIANTS:
            raise ValueError(f"TorchStack: checkpoint {checkpoint!r} not in {TORCH_VARIANTS}")
        self.blocks = torch.nn.ModuleList(blocks)
        self.checkpoint = checkpoint
        self.segments = segments

    def forward(self, x):
        if self.checkpoint == "checkpoint_sequential":
            return torch.utils.checkpoint.checkpoint_sequential(
                list(self.blocks), self.segments, x, use_reentrant=False)
        for block in self.blocks:
            if self.checkpoint == "plain":
                x = block(x)
            else:
                x = torch.utils.checkpoint.checkpoint(
                    block, x, use_reentrant=self.checkpoint == "checkpoint_reentrant")
        return x


# -- the twins, by name ---------------------------------------------------------------------
DTYPES = {
    "float64": (jnp.float64, torch.float64),
    "float32": (jnp.float32, torch.float32),
    "bfloat16": (jnp.bfloat16, torch.bfloat16),
}


@dataclasses.dataclass(frozen=True)
class Twin:
    """A Flax block and its torch twin, with one block's weight mapping and an input shape.

    ``config`` holds the keyword arguments both blocks share; ``flax_only`` those only the
    Flax block takes (its train flag). ``eval_mode``: run the torch side in ``eval()``.
    """

    name: str
    flax_block: type
    torch_block: type
    config: dict
    mapping: dict
    input_shape: tuple[int, ...]
    flax_only: dict = dataclasses.field(default_factory=dict)
    eval_mode: bool = False

    def flax_config(self, dtype: str) -> tuple:
        """``FlaxStack.config`` for this twin in ``dtype``."""
        return tuple(sorted({**self.config, **self.flax_only, "dtype": DTYPES[dtype][0]}.items()))

    def flax_stack(self, variant: str, lengths: tuple[int, ...], dtype: str) -> FlaxStack:
        """The Flax stack of ``prod(lengths)`` blocks."""
        return FlaxStack(self.flax_block, self.flax_config(dtype), variant, tuple(lengths))

    def torch_stack(self, depth: int, dtype: str, checkpoint: str = "plain",
                    segments: int = 2) -> TorchStack:
        """The torch stack of ``depth`` blocks (weights still torch's own init)."""
        blocks = [self.torch_block(**self.config, dtype=DTYPES[dtype][1]) for _ in range(depth)]
        stack = TorchStack(blocks, checkpoint, segments)
        return stack.train(not self.eval_mode)

    def stack_mapping(self, variant: str, lengths: tuple[int, ...]) -> dict:
        """The ``copy_weights`` mapping from a ``FlaxStack`` to a ``TorchStack``."""
        from torchside.parity import nest_mapping, stack_mapping

        depth = int(np.prod(lengths))
        if variant in ("plain", "remat"):
            out = {}
            for i in range(depth):
                out.update(nest_mapping(self.mapping, f"blocks.{i}", f"layers_{i}"))
            return out
        lead = (depth,) if variant == "scan_remat" else tuple(lengths)
        return stack_mapping(self.mapping, "blocks", "stack", lead)

    def example(self, dtype: str, seed: int = 0, batch: int | None = None) -> torch.Tensor:
        """A standard-normal input in ``dtype`` (drawn in float64, then rounded)."""
        shape = self.input_shape if batch is None else (batch, *self.input_shape[1:])
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(DTYPES[dtype][1])

    def with_config(self, **changes) -> Twin:
        """The same twin with some shared or Flax-only settings changed."""
        config = {**self.config, **{k: v for k, v in changes.items() if k in self.config}}
        flax_only = {**self.flax_only, **{k: v for k, v in changes.items() if k not in config}}
        return dataclasses.replace(self, config=config, flax_only=flax_only)


TWINS = {
    "mlp": Twin("mlp", ResidualMLPBlock, TorchResidualMLPBlock, {"width": 16},
                {"norm": "LayerNorm_0", "fc1": "Dense_0", "fc2": "Dense_1"}, (4, 16)),
    "transformer": Twin(
        "transformer", TransformerBlock, TorchTransformerBlock,
        {"width": 16, "heads": 2, "dropout": 0.0},
        {"ln1": "ln1", "attn": "attn", "ln2": "ln2", "fc1": "fc1", "fc2": "fc2"}, (2, 6, 16),
        flax_only={"deterministic": True},
    ),
    "lstm": Twin("lstm", LSTMLayer, TorchLSTMLayer, {"width": 8}, {"lstm": "cell"},
                 (2, 5, 8)),
    "conv": Twin("conv", ConvBNBlock, TorchConvBNBlock, {"channels": 8},
                 {"conv1": "conv1", "bn1": "bn1", "conv2": "conv2", "bn2": "bn2"}, (2, 5, 5, 8),
                 eval_mode=True),
}


def perturb(variables, seed: int = 0, scale: float = 0.2):
    """Makes constant leaves (zero biases, unit scales, BatchNorm statistics) non-trivial.

    A mapping that swaps a scale with a bias, or forgets the running statistics, computes
    the same as a correct one while those leaves are 0 and 1. Random kernels stay as drawn;
    running variances become uniform in [0.5, 1.5]. Works on numpy leaves (fast: no JAX
    compile per shape) and returns numpy leaves.
    """
    rng = np.random.default_rng(seed)
    paths, treedef = jax.tree_util.tree_flatten_with_path(variables)
    out = []
    for path, leaf in paths:
        leaf = np.asarray(leaf)
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "var":
            leaf = rng.uniform(0.5, 1.5, leaf.shape).astype(leaf.dtype)
        elif leaf.size and np.all(leaf == leaf.reshape(-1)[0]):
            leaf = (leaf + scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def random_variables(shapes, seed: int = 0):
    """Random float32 numpy variables for a tree of shapes (e.g. ``jax.eval_shape(init)``).

    Kernels and embeddings ~ N(0, 1/fan_in) with fan_in the product of all but the last
    axis; scales 1 + 0.2 N; biases and running means 0.2 N; running variances U(0.5, 1.5).
    Nothing is constant, so a mapping that swaps a scale and a bias or drops the statistics
    fails. Unlike Flax's ``init`` (op by op for scans, or a jitted init that compiles for
    seconds) this costs no compile.
    """
    rng = np.random.default_rng(seed)
    paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    out = []
    for path, leaf in paths:
        shape = tuple(leaf.shape)
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "var":
            value = rng.uniform(0.5, 1.5, shape)
        elif name == "scale":
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        elif len(shape) >= 2 and name in ("kernel", "embedding"):
            value = rng.standard_normal(shape) / np.sqrt(max(int(np.prod(shape[:-1])), 1))
        else:
            value = 0.2 * rng.standard_normal(shape)
        out.append(value.astype(np.float32))
    return jax.tree_util.tree_unflatten(treedef, out)


def flax_variables(module, x, seed: int = 0):
    """Random (nothing constant) float32 variables for a Linen ``module`` at input ``x``."""
    return random_variables(jax.eval_shape(module.init, jax.random.key(0), jnp.asarray(x)), seed)


def stack_variables(twin: Twin, variant: str, lengths: tuple[int, ...], dtype: str,
                    seed: int = 0):
    """Random numpy variables for ``twin.flax_stack(variant, lengths, dtype)``.

    Layer ``i`` gets the same values in every variant (``layers_i``, row ``i`` of a scanned
    ``stack``) and in every dtype (drawn in float32, then rounded), so the variants compute
    the same function. Shapes and layout come from ``jax.eval_shape`` of the stack's own
    ``init``. Call inside ``jax.enable_x64(True)`` for float64.
    """
    depth = int(np.prod(lengths))
    np_dtype = np.dtype(DTYPES[dtype][0])
    x = jax.ShapeDtypeStruct(twin.input_shape, np_dtype)
    block = twin.flax_block(**dict(twin.flax_config(dtype)))
    one = jax.eval_shape(block.init, jax.random.key(0), x)
    layers = [random_variables(one, seed * 100_003 + i) for i in range(depth)]
    if variant in ("plain", "remat"):
        variables = {col: {f"layers_{i}": layers[i][col] for i in range(depth)} for col in one}
    else:
        lead = (depth,) if variant == "scan_remat" else tuple(lengths)
        variables = {col: {"stack": jax.tree_util.tree_map(
            lambda *a: np.stack(a).reshape(*lead, *a[0].shape), *[v[col] for v in layers])}
            for col in one}
    expected = jax.eval_shape(twin.flax_stack(variant, lengths, dtype).init, jax.random.key(0), x)
    if jax.tree_util.tree_structure(expected) != jax.tree_util.tree_structure(variables) or any(
            e.shape != g.shape for e, g in zip(jax.tree_util.tree_leaves(expected),
                                               jax.tree_util.tree_leaves(variables), strict=True)):
        raise AssertionError(f"stack_variables: the {variant} layout differs from Flax's init")
    # Rounded to the twin's dtype (what the torch twin holds), then stored in the dtype Flax
    # gives the leaf (BatchNorm keeps bfloat16 statistics in float32).
    return jax.tree_util.tree_map(lambda e, g: g.astype(np_dtype).astype(e.dtype), expected,
                                  variables)
