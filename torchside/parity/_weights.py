"""copy_weights, and the pull-back of torch gradients onto Flax names that assert_matches uses."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from torchside.parity._mapping import flax_leaves
from torchside.parity._rules import Rule, compile_rules, torch_tensors


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating or complex dtype (larger is less precise)."""
    return torch.finfo(dtype.to_real() if dtype.is_complex else dtype).eps


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _listing(names, limit: int = 6) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def uncovered(rules: list[Rule], leaves: Mapping) -> dict[tuple[str, ...], int]:
    """Flax leaves with elements that no rule reads: ``{path: number of such elements}``.

    Every rule is linear, so the gradient of the sum of all rule outputs counts, per Flax
    element, how many torch elements read it; a zero means the mapping misses it (a stack
    deeper in Flax than in torch, a forgotten bias).
    """
    used = {p.path for r in rules for p in r.parts}
    probes = {
        path: torch.zeros(leaf.shape, dtype=torch.float32, requires_grad=True)
        for path, leaf in leaves.items()
        if path in used and _floating(leaf)
    }
    total = sum((r.build(probes).sum() for r in rules if r.parts), torch.zeros(()))
    counts = dict(zip(probes, torch.autograd.grad(total, list(probes.values()),
                                                  allow_unused=True) if probes else (),
                      strict=True))
    out = {}
    for path, leaf in leaves.items():
        if not _floating(leaf):
            continue
        count = counts.get(path)
        missing = leaf.numel() if count is None else int((count == 0).sum())
        if missing:
            out[path] = missing
    return out


def _check_torch_side(rules: list[Rule], torch_module: torch.nn.Module) -> None:
    mapped = {r.torch_name for r in rules}
    tensors = torch_tensors(torch_module)
    missing = [n for n, t in tensors.items() if _floating(t) and n not in mapped]
    if missing:
        raise ValueError(
            f"copy_weights: the mapping leaves {len(missing)} floating-point tensor(s) of the "
            f"torch {type(torch_module).__name__} unfilled: {_listing(missing)}. Map them (a "
            f"torch-only tensor such as LSTM's bias_ih maps to None, which zeroes it), or pass "
            f"strict=False."
        )


def copy_weights(flax_variables, torch_module: torch.nn.Module, mapping: Mapping, *,
                 strict: bool = True) -> None:
    """Fills a torch module's parameters and buffers from Flax variables through a mapping.

    ``mapping`` goes from torch names (relative to ``torch_module``; ``""`` is the module
    itself) to Flax paths. A torch **submodule** entry converts by the submodule's type:

    ==============================  =============================================================
    torch                           Flax (under the scope the entry names)
    ==============================  =============================================================
    ``Linear``                      ``Dense``/``DenseGeneral``: ``weight = kernel`` as (in, out),
                                    transposed; ``bias = bias`` flattened
    ``Conv1d/2d/3d``                ``Conv``: ``weight = kernel`` permuted (*sp, in, out) ->
                                    (out, in, *sp)
    ``LayerNorm``, ``GroupNorm``,   ``weight = scale``, ``bias = bias``
    ``RMSNorm``
    ``BatchNorm1d/2d/3d``           also ``running_mean = batch_stats mean``, ``running_var =
                                    batch_stats var``
    ``Embedding``                   ``Embed``: ``weight = embedding``
    ``MultiheadAttention``          ``MultiHeadDotProductAttention``: ``in_proj`` = query, key,
                                    value stacked; ``out_proj`` = ``out``
    ``LSTM``                        ``LSTMCell`` (one scope per layer, as a list): gates i, f, g,
                                    o stacked; ``bias_hh`` = the ``h*`` biases, ``bias_ih`` = 0
    ==============================  =============================================================

    A torch **tensor** entry takes a path string, a ``FlaxSource`` (with ``layer`` for a
    slice of stacked scan variables and ``layout``), a list of them (concatenated along
    dim 0), or ``None`` (zeros: a torch-only tensor). Values are cast to each torch tensor's
    dtype and device; every value is computed before anything is written.

    Args:
        flax_variables: a Flax variables dict (``{"params": ..., "batch_stats": ...}``) of
            JAX, numpy or torch arrays, or a module whose names are Flax paths (a
            ``FlaxModule``).
        torch_module: the torch module to fill, in place.
        mapping: torch name -> Flax path, ``FlaxSource``, list of them, or ``None``.
        strict: require that every floating-point torch tensor is filled and every
            floating-point Flax element is read (a mismatch in depth or a forgotten
            bias fails here instead of as a numerical mismatch later).

    Raises:
        KeyError: a torch name or a Flax path that does not exist (closest names shown).
        ValueError: shapes that do not match, a module type without a rule, or (strict)
            tensors left unfilled or Flax elements left unread.

    Example:
        >>> import flax.linen as nn, jax, numpy as np
        >>> variables = nn.Dense(3).init(jax.random.key(0), jax.numpy.ones((1, 4)))
        >>> linear = torch.nn.Linear(4, 3)
        >>> copy_weights(variables, linear, {"": ""})  # the Linear <- the root Dense scope
        >>> kernel = torch.from_numpy(np.array(variables["params"]["kernel"]))
        >>> torch.equal(linear.weight, kernel.T)
        True
    """
    leaves = flax_leaves(flax_variables)
    rules = compile_rules(mapping, torch_module, leaves)
    if strict:
        _check_torch_side(rules, torch_module)
        missing = uncovered(rules, leaves)
        if missing:
            shown = _listing(f"{'/'.join(p)} ({n} elements)" for p, n in missing.items())
            raise ValueError(
                f"copy_weights: the mapping reads no torch tensor from {len(missing)} Flax "
                f"leaf/leaves: {shown}. Map them (for a stack: as many torch blocks as Flax "
                f"layers), or pass strict=False."
            )
    tensors = torch_tensors(torch_module)
    with torch.no_grad():
        values = [(tensors[r.torch_name], r.build(leaves)) for r in rules]
        for target, value in values:
            target.copy_(value.to(device=target.device, dtype=target.dtype))


class GradientMap:
    """Carries a torch module's parameter gradients onto Flax names through a mapping.

    Args:
        ours: the module named by Flax paths (a ``FlaxModule``).
        reference: the torch module the mapping fills.
        mapping: as for ``copy_weights``.

    Raises:
        ValueError: a parameter of ``ours`` that the mapping does not fully read, since its
            gradient would have nothing to be compared with.
    """

    def __init__(self, ours: torch.nn.Module, reference: torch.nn.Module, mapping: Mapping):
        self.leaves = flax_leaves(ours)
        self.rules = compile_rules(mapping, reference, self.leaves)
        self.ref_dtypes = {n: t.dtype for n, t in torch_tensors(reference).items()}
        params = {tuple(n.split(".")) for n, p in ours.named_parameters() if p.requires_grad}
        missing = {p: n for p, n in uncovered(self.rules, self.leaves).items() if p in params}
        if missing:
            shown = _listing(f"{'.'.join(p)} ({n} elements)" for p, n in missing.items())
            raise ValueError(
                f"assert_matches: argument 'mapping' does not reach every parameter of ours: "
                f"{shown}; their gradients would have no reference. Map them."
            )

    def pull_back(self, grads: Mapping[str, torch.Tensor | None]):
        """Gradients by ours' names, from gradients by the reference's names.

        ``grads`` holds every reference parameter that requires grad, ``None`` where the
        backward did not reach it (a zero gradient).

        Returns:
            ``(values, dtypes, sources)``: per parameter name of ours, the gradient in
            float64 (exact: the adjoint only moves and adds elements), the least precise
            dtype among the reference gradients that reach it, and their torch names.
            Torch-only tensors (rules without parts) contribute nothing.
        """
        used = {p.path for r in self.rules for p in r.parts}
        probes = {
            path: torch.zeros(self.leaves[path].shape, dtype=torch.float64, requires_grad=True)
            for path in used
        }
        outs, cots = [], []
        dtypes: dict[str, torch.dtype] = {}
        sources: dict[str, list[str]] = {}
        for rule in self.rules:
            if not rule.parts or rule.torch_name not in grads:
                continue  # torch-only tensors, buffers
            g = grads[rule.torch_name]
            if g is None:  # a parameter the reference's graph never reached
                g = torch.zeros(rule.shape, dtype=self.ref_dtypes[rule.torch_name])
            outs.append(rule.build(probes, dtype=g.dtype))
            cots.append(g)
            for part in rule.parts:
                name = ".".join(part.path)
                sources.setdefault(name, []).append(rule.torch_name)
                old = dtypes.get(name)
                if old is None or eps(g.dtype) > eps(old):
                    dtypes[name] = g.dtype
        values = {".".join(p): torch.zeros(self.leaves[p].shape, dtype=torch.float64)
                  for p in used}
        if outs:
            pulled = torch.autograd.grad(outs, list(probes.values()), cots, allow_unused=True)
            for path, g in zip(probes, pulled, strict=True):
                if g is not None:
                    values[".".join(path)] = g
        return values, dtypes, sources
