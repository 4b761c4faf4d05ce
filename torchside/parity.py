"""Parity between a Flax module and its torch twin: weights across, every gradient compared.

Users switch from a torch block to a Flax one when they can see that both compute the same
thing, gradient for gradient. This module is what our own parity suite uses, and what users
run on their own blocks:

* ``copy_weights(flax_variables, torch_module, mapping)`` fills the torch module from Flax
  variables through a declarative mapping (``{"fc1": "Dense_0", "blocks.3":
  FlaxSource("stack/...", layer=3)}``; ``nest_mapping`` and ``stack_mapping`` build the
  entries of a stack of blocks from one block's mapping).
* ``assert_matches(ours, reference, *inputs)`` runs both on cloned inputs, backward with the
  same random cotangent, and compares outputs, input gradients and every parameter gradient
  by name; it raises ``ParityError`` (an ``AssertionError``) naming the failing tensor with
  its max absolute and relative error. ``compare`` returns the same ``ParityReport``
  without raising.

Tolerances (``TOLERANCES``) apply elementwise, by the less precise dtype of the two tensors::

    |ours - ref| <= atol * max(1, max|ref|) + rtol * |ref|

This is torch's ``assert_close`` rule except that the absolute floor scales with the
tensor's magnitude once that exceeds 1: parameter gradients are sums over a batch and a
stack and reach tens, where float32 cannot resolve torch's absolute 1e-5 (we measured
correct 8-layer transformer gradients of magnitude 30 differing by 2e-5, a normwise
relative error of 5e-7).

=========  ======  ======  ==============================================================
dtype      rtol    atol    why
=========  ======  ======  ==============================================================
float64    1e-10   1e-10   two float64 implementations of the same math agree to ~1e-14
float32    1.3e-6  1e-5    ``torch.testing.assert_close``'s defaults
float16    1e-3    1e-5    ``torch.testing.assert_close``'s defaults
bfloat16   8e-2    8e-2    see below
=========  ======  ======  ==============================================================

bfloat16 keeps 8 significant bits: one rounding moves a value by up to 2**-9 (0.2%), and
XLA and torch round at different places (torch's CPU kernels compute LayerNorm, softmax
and GELU internally in float32 and round once per op; where XLA rounds depends on what it
fuses).
Against a float64 evaluation of the same weights, each side of our 8-block twins is up to
2-3.5% off (max|error| / max|ref|, worst tensor per twin; torch and ours alike), so the two
sides differ by up to the sum of those.
Across the whole parity matrix (4 twins x 4 Flax stack variants x 4 torch checkpoint
variants) the worst bfloat16 difference we measured is 3.8% (a transformer's attention
bias gradient); 8e-2 leaves twice that. A wrong weight or transposed kernel still fails:
it moves the outputs and gradients by tens of percent (``tests/test_parity.py``).
torch's own bfloat16 default (rtol 1.6e-2, atol 1e-5) fails correct blocks. bfloat16
parity catches structural mistakes; the fine-grained check is float32 and float64.

Flax's ``MultiHeadDotProductAttention`` computes its softmax in bfloat16 unless
``force_fp32_for_softmax=True``; our transformer twin sets it, which brings Flax's
attention gradients from 6% to 3% of the float64 values (torch: 1%).
"""

from torchside._parity_compare import assert_matches as assert_matches
from torchside._parity_compare import compare as compare
from torchside._parity_mapping import FlaxSource as FlaxSource
from torchside._parity_mapping import nest_mapping as nest_mapping
from torchside._parity_mapping import stack_mapping as stack_mapping
from torchside._parity_report import TOLERANCES as TOLERANCES
from torchside._parity_report import ParityError as ParityError
from torchside._parity_report import ParityReport as ParityReport
from torchside._parity_report import TensorDiff as TensorDiff
from torchside._parity_weights import copy_weights as copy_weights

__all__ = [
    "TOLERANCES",
    "FlaxSource",
    "ParityError",
    "ParityReport",
    "TensorDiff",
    "assert_matches",
    "compare",
    "copy_weights",
    "nest_mapping",
    "stack_mapping",
]
