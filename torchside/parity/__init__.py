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

Tolerances (``TOLERANCES``, by the less precise dtype of the two tensors) apply
elementwise::

    |ours - ref| <= atol * max(1, max|ref|) + rtol * |ref|

This is torch's ``assert_close`` rule except that the absolute floor scales with the
tensor's magnitude once that exceeds 1: parameter gradients are sums over a batch and a
stack and reach tens, where float32 cannot resolve an absolute 1e-5. Each row's reason is
written beside ``TOLERANCES``; ``rtol=`` and ``atol=`` of ``assert_matches`` override them.

Example:
    ``TOLERANCES`` maps a dtype to ``(rtol, atol)``:

    >>> from torchside.parity import TOLERANCES
    >>> TOLERANCES[torch.float32], TOLERANCES[torch.bfloat16]
    ((1.3e-06, 1e-05), (0.08, 0.08))
    >>> rtol, atol = TOLERANCES[torch.float32]
    >>> ref = torch.tensor([30.0, 0.0])  # a gradient summed over a batch reaches tens
    >>> ours = ref + 1e-4
    >>> err = (ours - ref).abs()
    >>> bool((err <= atol * max(1.0, float(ref.abs().max())) + rtol * ref.abs()).all())
    True
    >>> torch.allclose(ours, ref, rtol=rtol, atol=atol)  # torch's fixed absolute floor
    False
"""

from torchside.parity._compare import assert_matches as assert_matches
from torchside.parity._compare import compare as compare
from torchside.parity._mapping import FlaxSource as FlaxSource
from torchside.parity._mapping import nest_mapping as nest_mapping
from torchside.parity._mapping import stack_mapping as stack_mapping
from torchside.parity._report import TOLERANCES as TOLERANCES
from torchside.parity._report import ParityError as ParityError
from torchside.parity._report import ParityReport as ParityReport
from torchside.parity._report import TensorDiff as TensorDiff
from torchside.parity._weights import copy_weights as copy_weights

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
