"""What a parity comparison found, per tensor: errors, tolerances, the report and the error."""

from __future__ import annotations

import dataclasses
import math

import torch

from torchside.parity._weights import eps

# dtype -> (rtol, atol).
# - float32, float16: torch.testing.assert_close's defaults.
# - float64: tighter than torch's 1e-7, since two float64 implementations of the same math
#   agree to about 1e-14; 1e-10 still catches any float32 step hidden inside a block.
# - bfloat16 keeps 8 significant bits: one rounding moves a value by up to 2**-9, and XLA
#   and torch round at different places (torch's CPU kernels compute LayerNorm, softmax and
#   GELU in float32 and round once per op; where XLA rounds depends on what it fuses), so
#   two correct 8-block twins each drift a few percent from a float64 evaluation of the same
#   weights. 8e-2 is about twice the worst difference the parity matrix
#   (tests/parity/test_matrix.py) meets across its twins, stack variants and checkpoint
#   variants; a wrong weight or a transposed kernel moves outputs and gradients by tens of
#   percent and still fails. torch's own bfloat16 default (rtol 1.6e-2) fails correct
#   blocks: bfloat16 parity catches structural mistakes, float32 and float64 the fine ones.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.complex128: (1e-10, 1e-10),
    torch.float32: (1.3e-6, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (8e-2, 8e-2),
}


class ParityError(AssertionError):
    """Two modules disagree; the message names the first failing tensor and its errors.

    Attributes:
        report: the full ``ParityReport``.
        name: the first failing tensor's name (``"output[0]"``, ``"grad of params.x"``).
        max_abs: its max absolute error.
        max_rel: its max elementwise relative error.

    Example:
        >>> import copy
        >>> from torchside.parity import assert_matches
        >>> linear = torch.nn.Linear(3, 2)
        >>> scaled = copy.deepcopy(linear)
        >>> _ = scaled.weight.detach().mul_(1.01)  # every weight 1% off
        >>> try:
        ...     assert_matches(scaled, linear, torch.randn(4, 3))
        ... except ParityError as error:
        ...     print(error.name, [diff.name for diff in error.report.failures])
        ...     print(error)
        output ['output', 'grad of input[0]']
        assert_matches: output (float32[4, 2]): ... elements exceed atol * max(1,
        max|reference|) + rtol * |reference| with atol=1e-05, rtol=1.3e-06, ...
        1 more tensor(s) differ:
          grad of input[0] (float32[4, 3]): ...
        >>> issubclass(ParityError, AssertionError)  # pytest reports it as a failed assert
        True
    """

    def __init__(self, report: ParityReport):
        self.report = report
        first = report.failures[0]
        self.name, self.max_abs, self.max_rel = first.name, first.max_abs, first.max_rel
        super().__init__(report.message())


@dataclasses.dataclass(frozen=True)
class TensorDiff:
    """How one tensor of ours differs from the reference's.

    ``max_rel`` is elementwise (``|ours - ref| / |ref|`` over nonzero ``ref``, as torch
    reports it); ``norm_rel`` is ``max|ours - ref| / max|ref|``, which stays meaningful
    where the reference crosses zero and is what the parity tables report. ``ref_max`` is
    ``max|ref|``; a tensor with ``ref_max <= atol`` is numerically zero (the gradient of an
    attention key bias, say, is zero in exact arithmetic) and only its absolute error counts.

    Example:
        >>> import copy
        >>> from torchside.parity import compare
        >>> ref = torch.nn.Linear(3, 2)
        >>> shifted = copy.deepcopy(ref)
        >>> _ = shifted.bias.detach().add_(1e-3)
        >>> diff = compare(shifted, ref, torch.randn(4, 3)).rows[0]
        >>> diff.name, diff.shape, diff.ok, diff.n_bad, round(diff.max_abs, 5)
        ('output', (4, 2), False, 8, 0.001)
        >>> diff.rtol, diff.atol  # float32's row of TOLERANCES
        (1.3e-06, 1e-05)
        >>> print(diff.describe())
        output (float32[4, 2]): 8 of 8 elements exceed atol * max(1, max|reference|) + rtol *
        |reference| with atol=1e-05, rtol=1.3e-06, max|reference|=... Max abs error 0.001 ...
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rtol: float
    atol: float
    max_abs: float = 0.0
    abs_at: tuple[int, ...] = ()
    values_at: tuple[float, float] = (0.0, 0.0)
    max_rel: float = 0.0
    rel_at: tuple[int, ...] = ()
    norm_rel: float = 0.0
    n_bad: int = 0
    ref_max: float = 0.0
    problem: str | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        """Whether every element is within ``atol + rtol * |reference|``."""
        return self.problem is None and self.n_bad == 0

    def describe(self) -> str:
        """One paragraph for an error message."""
        dt = str(self.dtype).removeprefix("torch.")
        head = f"{self.name} ({dt}{list(self.shape)}{self.note})"
        if self.problem:
            return f"{head}: {self.problem}"
        n = math.prod(self.shape)
        return (
            f"{head}: {self.n_bad} of {n} elements exceed atol * max(1, max|reference|) + "
            f"rtol * |reference| with atol={self.atol:.2g}, rtol={self.rtol:.2g}, "
            f"max|reference|={self.ref_max:.3g}. Max abs error {self.max_abs:.3g} at index "
            f"{self.abs_at} (ours {self.values_at[0]:.6g}, reference {self.values_at[1]:.6g}); "
            f"max rel error {self.max_rel:.3g} at index {self.rel_at}; "
            f"max|error| / max|reference| = {self.norm_rel:.3g}."
        )


def diff_tensors(name, ours, ref, rtol=None, atol=None, dtype=None, note="") -> TensorDiff:
    """Errors of ``ours`` against ``ref``, computed in float64 on the CPU.

    An element passes when ``|ours - ref| <= atol * max(1, max|ref|) + rtol * |ref|``:
    torch's rule, with the absolute floor scaled by the tensor's magnitude once that
    exceeds 1 (gradients summed over a batch and a stack reach tens, where float32 cannot
    resolve torch's absolute 1e-5). Tolerances default by the less precise of the two
    dtypes (``TOLERANCES``).
    """
    if dtype is None:
        inexact = [d for d in (ours.dtype, ref.dtype) if d.is_floating_point or d.is_complex]
        dtype = max(inexact, key=eps) if inexact else ref.dtype
    exact = not (dtype.is_floating_point or dtype.is_complex)  # integers and bools: equal
    d_rtol, d_atol = (0.0, 0.0) if exact else TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    base = dict(name=name, shape=tuple(ref.shape), dtype=dtype, rtol=rtol, atol=atol, note=note)
    if tuple(ours.shape) != tuple(ref.shape):
        return TensorDiff(**base, problem=f"ours has shape {list(ours.shape)}")
    wide = torch.complex128 if (ours.is_complex() or ref.is_complex()) else torch.float64
    a = ours.detach().to("cpu", wide)
    b = ref.detach().to("cpu", wide)
    if a.numel() == 0:
        return TensorDiff(**base)
    err = (a - b).abs()
    mag = b.abs()
    scale = float(torch.nan_to_num(mag, nan=0.0).max())
    bad = ~(err <= atol * max(1.0, scale) + rtol * mag)  # NaN anywhere counts as a mismatch
    err_f = torch.nan_to_num(err, nan=math.inf)
    k = int(err_f.argmax())
    rel = torch.where(mag > 0, err_f / mag, torch.where(err_f > 0, math.inf, 0.0))
    r = int(rel.argmax())
    max_abs = float(err_f.reshape(-1)[k])
    return TensorDiff(
        **base,
        max_abs=max_abs,
        abs_at=tuple(int(i) for i in torch.unravel_index(torch.tensor(k), a.shape)),
        values_at=(complex(a.reshape(-1)[k]).real, complex(b.reshape(-1)[k]).real),
        max_rel=float(rel.reshape(-1)[r]),
        rel_at=tuple(int(i) for i in torch.unravel_index(torch.tensor(r), a.shape)),
        norm_rel=max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf),
        n_bad=int(bad.sum()),
        ref_max=scale,
    )


@dataclasses.dataclass
class ParityReport:
    """Every tensor compared by ``compare``: outputs, input gradients, parameter gradients.

    Attributes:
        rows: one ``TensorDiff`` per tensor, in the order compared.

    Example:
        >>> import copy
        >>> from torchside.parity import compare
        >>> twin = torch.nn.Linear(3, 2)
        >>> report = compare(copy.deepcopy(twin), twin, torch.randn(4, 3))
        >>> report.ok, report.max_rel_error, report.failures
        (True, 0.0, [])
        >>> print(report)
        tensor             dtype     max abs  max|err|/max|ref|  ok
        output             float32  0.00e+00           0.00e+00  yes
        grad of input[0]   float32  0.00e+00           0.00e+00  yes
        grad of weight     float32  0.00e+00           0.00e+00  yes
        grad of bias       float32  0.00e+00           0.00e+00  yes
    """

    rows: list[TensorDiff]

    @property
    def ok(self) -> bool:
        """Whether every tensor is within tolerance."""
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> list[TensorDiff]:
        """The tensors out of tolerance, in the order compared."""
        return [r for r in self.rows if not r.ok]

    @property
    def max_rel_error(self) -> float:
        """The largest ``max|error| / max|reference|`` over tensors that are not zero.

        Numerically zero references (``max|ref| <= atol``) are left out: their relative
        error is noise over noise. ``max_abs_error_at_zero`` covers them.
        """
        return max((r.norm_rel for r in self.rows if r.ref_max > r.atol), default=0.0)

    @property
    def max_abs_error_at_zero(self) -> float:
        """The largest absolute error among numerically zero references (0.0 if none)."""
        return max((r.max_abs for r in self.rows if r.ref_max <= r.atol), default=0.0)

    def message(self) -> str:
        """The failure message: the first failing tensor in full, then the others."""
        fails = self.failures
        if not fails:
            return f"assert_matches: all {len(self.rows)} tensors match."
        text = f"assert_matches: {fails[0].describe()}"
        if len(fails) > 1:
            text += f"\n{len(fails) - 1} more tensor(s) differ:\n" + "\n".join(
                "  " + f.describe() for f in fails[1:8])
            if len(fails) > 8:
                text += f"\n  ... and {len(fails) - 8} more"
        return text

    def __str__(self) -> str:
        lines = [f"{'tensor':48} {'dtype':9} {'max abs':>9} {'max|err|/max|ref|':>17}  ok"]
        for r in self.rows:
            dt = str(r.dtype).removeprefix("torch.")
            lines.append(f"{r.name[:48]:48} {dt:9} {r.max_abs:9.2e} {r.norm_rel:17.2e}  "
                         f"{'yes' if r.ok else 'NO'}")
        return "\n".join(lines)
