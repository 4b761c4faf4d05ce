"""A Transformer stack annotated for 2-D meshes, in Flax and as its torch twin.

``TPStack`` scans ``nn.remat`` of a pre-LayerNorm causal attention + MLP layer whose
parameters carry logical partitioning names (``nn.with_logical_partitioning``): ``RULES``
maps the model dimension to ``"fsdp"`` and the MLP's hidden units and attention heads to
``"tensor"``, as a Megatron-style block over a ``("fsdp", "tensor")`` mesh is sharded.
``TorchTPStack`` is the same computation in torch with separate query, key, value and out
projections (``parallelize_module`` splits those, not a fused ``in_proj``), and
``twin_state`` maps a ``FlaxModule``'s parameters onto its names.
"""

import flax.linen as nn
import jax.numpy as jnp
import torch
import torch.nn.functional as F

WIDTH, HEADS, LAYERS = 16, 2, 2
RULES = (("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("kv", None),
         ("layers", None))


def _named(init, *names):
    return nn.with_logical_partitioning(init, names)


class TPLayer(nn.Module):
    width: int = WIDTH
    heads: int = HEADS

    @nn.compact
    def __call__(self, x):
        w, k, zeros, ones = (self.width, nn.initializers.lecun_normal(),
                             nn.initializers.zeros_init(), nn.initializers.ones_init())
        small = nn.initializers.normal(0.02)  # biases: nonzero, so their gradients count

        def norm(name):
            return nn.LayerNorm(epsilon=1e-6, scale_init=_named(ones, "embed"),
                                bias_init=_named(zeros, "embed"), name=name)

        h = norm("ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(
            num_heads=self.heads, kernel_init=_named(k, "embed", "heads", "kv"),
            bias_init=_named(small, "heads", "kv"),
            out_kernel_init=_named(k, "heads", "kv", "embed"),
            out_bias_init=_named(small, "embed"), name="attn")(
            h, h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
        h = norm("ln2")(x)
        h = nn.Dense(4 * w, kernel_init=_named(k, "embed", "mlp"),
                     bias_init=_named(small, "mlp"), name="fc1")(h)
        h = nn.Dense(w, kernel_init=_named(k, "mlp", "embed"),
                     bias_init=_named(small, "embed"), name="fc2")(nn.gelu(h))
        return x + h


class _Scanned(nn.Module):
    """``TPLayer`` as ``nn.scan``'s body: ``(carry, x) -> (carry, y)``."""

    @nn.compact
    def __call__(self, x, _):
        return TPLayer(name="layer")(x), None


class TPStack(nn.Module):
    """``LAYERS`` ``TPLayer``s under ``nn.scan(nn.remat(...))``, the layer axis named
    ``"layers"`` (``metadata_params``; Flax's boxes need a name for it)."""

    layers: int = LAYERS

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(nn.remat(_Scanned), variable_axes={"params": 0},
                       split_rngs={"params": True}, length=self.layers,
                       metadata_params={nn.PARTITION_NAME: "layers"})
        return scan(name="stack")(x, None)[0]


class TorchTPLayer(torch.nn.Module):
    def __init__(self, width: int = WIDTH, heads: int = HEADS):
        super().__init__()
        self.head_dim = width // heads
        self.ln1 = torch.nn.LayerNorm(width, eps=1e-6)
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(width, width) for _ in range(4))
        self.ln2 = torch.nn.LayerNorm(width, eps=1e-6)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        # Heads from the local width: under ColwiseParallel a rank holds some heads whole.
        q, k, v = ((lin(h).view(b, t, -1, self.head_dim).transpose(1, 2))
                   for lin in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class TorchTPStack(torch.nn.Module):
    def __init__(self, layers: int = LAYERS):
        super().__init__()
        self.blocks = torch.nn.ModuleList(TorchTPLayer() for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


TP_PLAN = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise",
           "fc1": "colwise", "fc2": "rowwise"}


def twin_state(flax: dict, prefix: str = "params.stack.layer.") -> dict:
    """``TorchTPStack``'s state dict from a ``FlaxModule(TPStack())``'s (whole tensors).

    ``prefix``: the path to the stacked layer's parameters.

    A Flax kernel is ``(in, out)`` (attention's ``(in, heads, head_dim)`` and ``(heads,
    head_dim, out)``), a torch weight ``(out, in)``; heads-major order on both sides.
    """
    out = {}
    for i in range(LAYERS):
        def get(path, i=i):
            return flax[prefix + path][i]

        t = f"blocks.{i}."
        for n in ("ln1", "ln2"):
            out[t + n + ".weight"], out[t + n + ".bias"] = get(n + ".scale"), get(n + ".bias")
        for torch_name, flax_name in (("wq", "query"), ("wk", "key"), ("wv", "value")):
            kernel = get(f"attn.{flax_name}.kernel")
            out[t + torch_name + ".weight"] = kernel.reshape(kernel.shape[0], -1).T
            out[t + torch_name + ".bias"] = get(f"attn.{flax_name}.bias").reshape(-1)
        kernel = get("attn.out.kernel")
        out[t + "wo.weight"] = kernel.reshape(-1, kernel.shape[-1]).T
        out[t + "wo.bias"] = get("attn.out.bias")
        for n in ("fc1", "fc2"):
            out[t + n + ".weight"], out[t + n + ".bias"] = get(n + ".kernel").T, get(n + ".bias")
    return {k: v.contiguous() for k, v in out.items()}
