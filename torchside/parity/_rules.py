"""Rules of the weight mapping: one linear map per torch tensor, expanded from module entries.

Every rule is built from torch ops (index, reshape, transpose, permute, concatenate,
zeros), so it both fills a torch tensor from Flax leaves and, through autograd, carries a
torch gradient back onto the Flax leaves (the adjoint of the map).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping

import torch

from torchside.parity._mapping import resolve, source


# -- rules ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Part:
    """One resolved source leaf of a rule: full path, layer index, layout."""

    path: tuple[str, ...]
    layer: tuple[int, ...] | None
    layout: str


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one torch tensor is computed from Flax leaves (``parts`` empty: zeros)."""

    torch_name: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]

    def build(self, leaves: Mapping[tuple[str, ...], torch.Tensor], dtype=None) -> torch.Tensor:
        """The torch tensor's value from the leaves (differentiable in the leaves)."""
        if not self.parts:
            return torch.zeros(self.shape, dtype=dtype)
        rest = self.shape[1:]
        pieces = []
        for part in self.parts:
            leaf = leaves[part.path]
            if dtype is not None:
                leaf = leaf.to(dtype)
            if part.layer is not None:
                leaf = self._take(leaf, part)
            target = self.shape
            if len(self.parts) > 1:  # a piece of a concatenation along dim 0
                inner = math.prod(rest)
                target = (leaf.numel() // max(inner, 1), *rest)
            pieces.append(self._convert(leaf, part, target))
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
        if tuple(out.shape) != self.shape:
            raise ValueError(
                f"copy_weights: torch {self.torch_name!r} has shape {list(self.shape)}, but "
                f"its Flax sources {[self._show(p) for p in self.parts]} give "
                f"{list(out.shape)}. Check the paths, the layer index and the layout."
            )
        return out

    @staticmethod
    def _show(part: Part) -> str:
        layer = "" if part.layer is None else f"[{', '.join(map(str, part.layer))}]"
        return "/".join(part.path) + layer

    def _take(self, leaf: torch.Tensor, part: Part) -> torch.Tensor:
        if leaf.dim() < len(part.layer) or any(
            i >= n for i, n in zip(part.layer, leaf.shape, strict=False)
        ):
            raise IndexError(
                f"copy_weights: layer {part.layer} of Flax {'/'.join(part.path)!r} (shape "
                f"{list(leaf.shape)}) for torch {self.torch_name!r} is out of range; the "
                f"stacked leading axes are {list(leaf.shape[: len(part.layer)])}."
            )
        return leaf[part.layer]

    def _convert(self, leaf: torch.Tensor, part: Part, target: tuple[int, ...]) -> torch.Tensor:
        def fail(why: str):
            raise ValueError(
                f"copy_weights: torch {self.torch_name!r} wants shape {list(target)}, but Flax "
                f"{self._show(part)} has shape {list(leaf.shape)} ({why}, layout "
                f"{part.layout!r}). Check the path, the layer index and the layout."
            )

        if part.layout == "linear":
            if len(target) != 2:
                fail("a Linear weight is 2-D")
            out_f, in_f = target
            split = next((k for k in range(leaf.dim() + 1)
                          if math.prod(leaf.shape[:k]) == in_f), None)
            if split is None or math.prod(leaf.shape[split:]) != out_f:
                fail(f"no split of the kernel into {in_f} inputs x {out_f} outputs")
            return leaf.reshape(in_f, out_f).T
        if part.layout == "conv":
            if leaf.dim() != len(target) or leaf.dim() < 3:
                fail("a conv kernel is (*spatial, in, out)")
            n = leaf.dim()
            return leaf.permute(n - 1, n - 2, *range(n - 2))
        if tuple(leaf.shape) == tuple(target):
            return leaf
        if len(target) == 1 or len(self.parts) > 1:
            if leaf.numel() != math.prod(target):
                fail("the number of elements differs")
            return leaf.reshape(target)
        fail("shapes differ")
        raise AssertionError  # unreachable


# Module-level rules: torch module type -> {tensor name: source under the scope}.
ModuleRule = Callable[[torch.nn.Module, list], dict]


def _kernel_and_bias(layout: str) -> ModuleRule:
    """The rule of a torch layer with a ``weight`` laid out as ``layout`` and a bias."""

    def rule(m, srcs):
        (s,) = srcs
        out = {"weight": s.child("kernel", layout)}
        if m.bias is not None:
            out["bias"] = s.child("bias")
        return out

    return rule


_linear = _kernel_and_bias("linear")
_conv = _kernel_and_bias("conv")


def _norm(m, srcs):
    (s,) = srcs
    out = {}
    if getattr(m, "weight", None) is not None:
        out["weight"] = s.child("scale")
    if getattr(m, "bias", None) is not None:
        out["bias"] = s.child("bias")
    return out


def _batch_norm(m, srcs):
    out = _norm(m, srcs)
    (s,) = srcs
    if m.running_mean is not None:
        out["running_mean"] = s.child("mean")
        out["running_var"] = s.child("var")
    return out


def _embedding(m, srcs):
    (s,) = srcs
    return {"weight": s.child("embedding")}


def _attention(m, srcs):
    (s,) = srcs
    if not m._qkv_same_embed_dim or m.bias_k is not None:
        raise ValueError(
            "copy_weights: torch.nn.MultiheadAttention with kdim/vdim != embed_dim or "
            "add_bias_kv=True has no rule; map its tensors one by one."
        )
    out = {"in_proj_weight": [s.child(f"{n}/kernel", "linear") for n in ("query", "key", "value")]}
    if m.in_proj_bias is not None:
        out["in_proj_bias"] = [s.child(f"{n}/bias") for n in ("query", "key", "value")]
    out["out_proj.weight"] = s.child("out/kernel", "linear")
    if m.out_proj.bias is not None:
        out["out_proj.bias"] = s.child("out/bias")
    return out


def _lstm(m, srcs):
    if m.bidirectional or m.proj_size:
        raise ValueError(
            "copy_weights: bidirectional or projected torch.nn.LSTM has no rule; map its "
            "tensors one by one (weight_ih_l0_reverse, ...)."
        )
    if len(srcs) != m.num_layers:
        raise ValueError(
            f"copy_weights: torch.nn.LSTM has num_layers={m.num_layers}, but the mapping "
            f"gives {len(srcs)} Flax cell(s); give a list with one LSTMCell scope per layer."
        )
    out = {}
    # torch stacks the gates (i, f, g, o) along dim 0; Flax's LSTMCell keeps one Dense per
    # gate: ii/if/ig/io on the input (no bias) and hi/hf/hg/ho on the hidden state.
    for k, s in enumerate(srcs):
        out[f"weight_ih_l{k}"] = [s.child(f"i{g}/kernel", "linear") for g in "ifgo"]
        out[f"weight_hh_l{k}"] = [s.child(f"h{g}/kernel", "linear") for g in "ifgo"]
        if m.bias:
            out[f"bias_ih_l{k}"] = None  # Flax has one bias per gate, torch two
            out[f"bias_hh_l{k}"] = [s.child(f"h{g}/bias") for g in "ifgo"]
    return out


MODULE_RULES: tuple[tuple[type, ModuleRule], ...] = (
    (torch.nn.Linear, _linear),
    (torch.nn.modules.conv._ConvNd, _conv),
    (torch.nn.modules.batchnorm._BatchNorm, _batch_norm),
    (torch.nn.LayerNorm, _norm),
    (torch.nn.GroupNorm, _norm),
    (torch.nn.Embedding, _embedding),
    (torch.nn.MultiheadAttention, _attention),
    (torch.nn.LSTM, _lstm),
)
if hasattr(torch.nn, "RMSNorm"):
    MODULE_RULES += ((torch.nn.RMSNorm, _norm),)
_DISPLAY = {
    torch.nn.modules.conv._ConvNd: "Conv1d/2d/3d",
    torch.nn.modules.batchnorm._BatchNorm: "BatchNorm1d/2d/3d",
}


def _module_rule(module: torch.nn.Module, key: str) -> ModuleRule:
    if isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
        raise ValueError(
            f"copy_weights: torch {key!r} is a {type(module).__name__}, whose kernel layout "
            f"depends on Flax's transpose_kernel; map 'weight' and 'bias' one by one."
        )
    for cls, rule in MODULE_RULES:
        if isinstance(module, cls):
            return rule
    names = ", ".join(_DISPLAY.get(c, c.__name__) for c, _ in MODULE_RULES)
    raise ValueError(
        f"copy_weights: torch {key!r} is a {type(module).__name__}, which has no built-in "
        f"rule (rules exist for {names}). Map its submodules or its tensors one by one, "
        f"e.g. {{'{key + '.' if key else ''}weight': 'Dense_0/kernel'}}."
    )


def torch_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of a torch module by name."""
    return dict(module.named_parameters()) | dict(module.named_buffers())


def compile_rules(mapping: Mapping, torch_module: torch.nn.Module, leaves: Mapping) -> list[Rule]:
    """Expands module entries and resolves every path: one ``Rule`` per torch tensor."""
    if not isinstance(mapping, Mapping):
        raise TypeError(
            f"copy_weights: argument 'mapping' must be a dict from torch names to Flax paths, "
            f"got {type(mapping).__name__}."
        )
    tensors = torch_tensors(torch_module)
    modules = dict(torch_module.named_modules())
    flat: dict[str, object] = {}

    def put(name: str, value, entry: str) -> None:
        if name in flat:
            raise ValueError(
                f"copy_weights: torch {name!r} is filled twice (again by mapping entry "
                f"{entry!r}); map it once, through its submodule or on its own."
            )
        flat[name] = value

    for key, value in mapping.items():
        if key in tensors:
            put(key, value, key)
            continue
        if key not in modules:
            close = difflib.get_close_matches(key, list(tensors) + list(modules), n=3)
            raise KeyError(
                f"copy_weights: mapping key {key!r} is neither a submodule nor a tensor of the "
                f"torch {type(torch_module).__name__}. Closest names: {close or 'none'}."
            )
        module = modules[key]
        srcs = value if isinstance(value, list | tuple) else [value]
        srcs = [source(s, key) for s in srcs]
        if any(s.layout != "copy" for s in srcs):
            raise ValueError(
                f"copy_weights: mapping entry {key!r} names a torch submodule, whose layouts "
                f"follow from its type; set 'layout' only on tensor entries."
            )
        for name, src in _module_rule(module, key)(module, srcs).items():
            put(f"{key}.{name}" if key else name, src, key)
    rules = []
    for key, value in flat.items():
        shape = tuple(tensors[key].shape)
        if value is None:
            rules.append(Rule(key, shape, ()))
            continue
        srcs = value if isinstance(value, list | tuple) else [value]
        parts = []
        for s in srcs:
            s = source(s, key)
            parts.append(Part(resolve(leaves, s.parts, key), s.layer, s.layout))
        rules.append(Rule(key, shape, tuple(parts)))
    return rules
