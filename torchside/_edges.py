"""The edges above the first-order pipeline, as every owner hands them to its ``Caller``.

The first-order files (``_resolve.py``, ``_call.py``, ``_eager.py``, ``_entry.py``,
``_build.py``) never import the
``torch.compile`` edge or the layer of derivatives; an owner (``FlaxModule``,
``jax_function``) passes ``EDGES`` to its ``Caller``, and the pipeline calls up through
it (NOTE [Call path] in ``_call.py``).
"""

from __future__ import annotations

import functools

from torchside._compile import compiled_call
from torchside._higher import differentiate, transformed
from torchside._values import Edges

EDGES = Edges(compiled=compiled_call, transformed=transformed, differentiate=differentiate)
# The same without NOTE [Given residuals]'s route: a backward differentiated again takes
# the whole VJP or the shared linearization (an owner's value: tests of those routes, the
# benchmark's contestant without sharing). Derived owners inherit their call's edges.
WHOLE_VJPS = EDGES._replace(differentiate=functools.partial(differentiate,
                                                            given_residuals=False))
