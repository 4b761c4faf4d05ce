"""compare and assert_matches: two modules, the same inputs and cotangent, every tensor checked."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import torch

from torchside.parity._report import ParityError, ParityReport, TensorDiff, diff_tensors
from torchside.parity._weights import GradientMap, eps

jtu = jax.tree_util

COTANGENTS = frozenset({"random", "ones"})


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _cotangents(outs, cotangent, seed: int):
    if isinstance(cotangent, str):
        gen = torch.Generator().manual_seed(seed + 1)
        cots = []
        for o in outs:
            if not (_floating(o) and o.requires_grad):
                cots.append(None)
            elif cotangent == "ones":
                cots.append(torch.ones_like(o))
            else:  # the same float64 draw rounded to each side's dtype: identical values
                c = torch.randn(o.shape, generator=gen, dtype=torch.float64)
                cots.append(c.to(o.device, o.dtype))
        return cots
    given = jtu.tree_leaves(cotangent)
    if len(given) != len(outs):
        raise ValueError(
            f"assert_matches: argument 'cotangent' has {len(given)} tensor(s), but the modules "
            f"return {len(outs)}; pass one per output, 'random' or 'ones'."
        )
    return [g.to(o.device, o.dtype) if _floating(o) and o.requires_grad else None
            for g, o in zip(given, outs, strict=True)]


def _run(module: torch.nn.Module, inputs: tuple, cotangent, seed: int):
    """Forward on clones of ``inputs``, backward with the cotangent; ``.grad`` left as found."""
    leaves, treedef = jtu.tree_flatten(inputs)
    clones = [x.detach().clone().requires_grad_(_floating(x)) if isinstance(x, torch.Tensor)
              else x for x in leaves]
    params = dict(module.named_parameters())
    stash = {n: p.grad for n, p in params.items()}
    for p in params.values():
        p.grad = None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = module(*jtu.tree_unflatten(treedef, clones))
        outs, out_def = jtu.tree_flatten(out)
        cots = _cotangents(outs, cotangent, seed)
        pairs = [(o, c) for o, c in zip(outs, cots, strict=True) if c is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
        in_grads = [x.grad if _floating(x) else None for x in clones]
        p_grads = {n: p.grad for n, p in params.items() if p.requires_grad}
    finally:
        for n, p in params.items():
            p.grad = stash[n]
    return outs, out_def, in_grads, p_grads


def _param_names_check(ours: dict, ref: dict) -> None:
    if set(ours) != set(ref):
        only_ours = sorted(set(ours) - set(ref))[:5]
        only_ref = sorted(set(ref) - set(ours))[:5]
        raise ValueError(
            f"assert_matches: the two modules name their parameters differently (only in "
            f"ours: {only_ours}; only in the reference: {only_ref}). Pass mapping= (the one "
            f"given to copy_weights) to compare gradients across frameworks."
        )


def compare(ours: torch.nn.Module, reference: torch.nn.Module, *inputs, cotangent="random",
            rtol: float | None = None, atol: float | None = None,
            mapping: Mapping | None = None, seed: int = 0) -> ParityReport:
    """Runs both modules like ``assert_matches`` and returns every tensor's errors.

    Same arguments as ``assert_matches``; never raises for a numerical mismatch.

    Returns:
        A ``ParityReport``; ``report.max_rel_error`` is the largest
        ``max|error| / max|reference|`` over all tensors compared.

    Example:
        Typically ``ours`` is a ``FlaxModule`` and ``reference`` its torch twin; here, two
        torch modules:

        >>> import copy
        >>> reference = torch.nn.Linear(3, 2)
        >>> ours = copy.deepcopy(reference)
        >>> x = torch.randn(4, 3)
        >>> report = compare(ours, reference, x)
        >>> report.ok, [row.name for row in report.rows]
        (True, ['output', 'grad of input[0]', 'grad of weight', 'grad of bias'])
        >>> with torch.no_grad():
        ...     ours.bias += 1e-3  # far beyond float32's tolerance
        >>> [row.name for row in compare(ours, reference, x).failures]
        ['output']
        >>> compare(ours, reference, x, atol=1e-2).ok  # a looser tolerance passes it
        True
    """
    if isinstance(cotangent, str) and cotangent not in COTANGENTS:
        raise ValueError(
            f"assert_matches: argument 'cotangent' is {cotangent!r}; expected one of "
            f"{sorted(COTANGENTS)} or a (tuple of) tensor(s) shaped like the outputs."
        )
    grad_map = GradientMap(ours, reference, mapping) if mapping is not None else None
    o_outs, o_def, o_in, o_par = _run(ours, inputs, cotangent, seed)
    r_outs, r_def, r_in, r_par = _run(reference, inputs, cotangent, seed)
    tol = dict(rtol=rtol, atol=atol)
    rows: list[TensorDiff] = []
    if len(o_outs) != len(r_outs):
        raise ValueError(
            f"assert_matches: ours returns {len(o_outs)} tensor(s) ({o_def}), the reference "
            f"{len(r_outs)} ({r_def}); make both return the same structure."
        )
    paths = [jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(
        jtu.tree_unflatten(r_def, list(range(len(r_outs)))))[0]]
    for path, a, b in zip(paths, o_outs, r_outs, strict=True):
        if isinstance(b, torch.Tensor):
            rows.append(diff_tensors(f"output{path}", a, b, **tol))
    in_paths = [jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(inputs)[0]]
    for path, a, b in zip(in_paths, o_in, r_in, strict=True):
        if b is not None or a is not None:
            a = torch.zeros_like(b) if a is None else a
            b = torch.zeros_like(a) if b is None else b
            rows.append(diff_tensors(f"grad of input{path}", a, b, **tol))
    ours_params = dict(ours.named_parameters())
    if grad_map is None:
        _param_names_check(o_par, r_par)
        ref_grads = {n: (g if g is not None else torch.zeros_like(dict(
            reference.named_parameters())[n])) for n, g in r_par.items()}
        dtypes, sources = {}, {}
    else:
        ref_grads, dtypes, sources = grad_map.pull_back(r_par)
    for name, g in o_par.items():
        if name not in ref_grads:
            continue  # a buffer-like parameter the mapping does not read and torch lacks
        a = torch.zeros_like(ours_params[name]) if g is None else g
        ref_dtype = dtypes.get(name, a.dtype)
        note = f" <- {', '.join(sources[name][:2])}{'...' if len(sources[name]) > 2 else ''}" \
            if name in sources else ""
        rows.append(diff_tensors(f"grad of {name}", a, ref_grads[name], **tol,
                                 dtype=max((a.dtype, ref_dtype), key=eps), note=note))
    return ParityReport(rows)


def assert_matches(ours: torch.nn.Module, reference: torch.nn.Module, *inputs,
                   cotangent="random", rtol: float | None = None, atol: float | None = None,
                   mapping: Mapping | None = None, seed: int = 0) -> ParityReport:
    """Asserts that two modules compute the same outputs and gradients.

    Each module runs on its own clones of ``inputs`` (floating-point ones require grad),
    then backward with the same cotangent; outputs, input gradients and every parameter
    gradient are compared elementwise, ``|ours - ref| <= atol * max(1, max|ref|) + rtol *
    |ref|``, with tolerances by the less precise dtype of the two (see ``torchside.parity``).
    Parameter gradients are matched by name; for a Flax module against a torch module pass
    the ``mapping`` given to ``copy_weights``, which carries each torch gradient onto the
    Flax parameter it came from (through stacked layers, transposes, gate blocks).
    Existing ``.grad`` fields are left as they were.

    Args:
        ours: the module under test (typically a ``FlaxModule``).
        reference: the module it must match (typically the torch original).
        *inputs: positional inputs, tensors or pytrees of tensors; cloned per side.
        cotangent: ``"random"`` (standard normal, seeded, the same on both sides),
            ``"ones"``, or tensors shaped like the outputs.
        rtol: relative tolerance; ``None`` takes the dtype's default.
        atol: absolute tolerance; ``None`` takes the dtype's default.
        mapping: torch names -> Flax paths, as for ``copy_weights``; ``None`` when both
            modules name their parameters alike.
        seed: seeds torch's generator for each forward and the random cotangent.

    Returns:
        The ``ParityReport`` (print it for a table of every tensor's errors).

    Raises:
        ParityError: (an ``AssertionError``) naming the first tensor out of tolerance with
            its max absolute and relative error, and listing the others.
        ValueError: outputs of different structure, parameters of different names without
            a mapping, or a mapping that misses a parameter of ``ours``.

    Example:
        Paste into a test file (this exact code runs in tests/parity/test_assert_matches.py)::

            import flax.linen as nn
            import torch

            from torchside import FlaxModule
            from torchside.parity import assert_matches, copy_weights


            class Block(nn.Module):
                @nn.compact
                def __call__(self, x):
                    # torch's LayerNorm eps is 1e-5, Flax's 1e-6: left at Flax's default,
                    # assert_matches fails on this block (input gradient off by 1e-5).
                    norm = nn.LayerNorm(epsilon=1e-5, name="norm")
                    h = nn.Dense(32, name="up")(norm(x))
                    return x + nn.Dense(8, name="down")(nn.gelu(h, approximate=False))


            class TorchBlock(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.norm = torch.nn.LayerNorm(8)
                    self.up = torch.nn.Linear(8, 32)
                    self.down = torch.nn.Linear(32, 8)

                def forward(self, x):
                    h = self.up(self.norm(x))
                    return x + self.down(torch.nn.functional.gelu(h))


            def test_block_matches_torch():
                x = torch.randn(4, 8)
                ours = FlaxModule(Block(), example_args=(x,))
                reference = TorchBlock()
                mapping = {"norm": "norm", "up": "up", "down": "down"}
                copy_weights(ours, reference, mapping)
                assert_matches(ours, reference, x, mapping=mapping)
    """
    report = compare(ours, reference, *inputs, cotangent=cotangent, rtol=rtol, atol=atol,
                     mapping=mapping, seed=seed)
    if not report.ok:
        raise ParityError(report)
    return report
