"""Pure JAX/Flax: compiled forward/residual/backward programs. Never imports torch."""

from flaxside._flat import ARRAY as ARRAY
from flaxside._flat import flat_apply as flat_apply
from flaxside._program import LeafSpec as LeafSpec
from flaxside._program import Program as Program
from flaxside._program import StaleSignature as StaleSignature
from flaxside._program import is_differentiable as is_differentiable
