"""The edges above the first-order pipeline, as every owner hands them to its ``Caller``.

The first-order files (``call/_resolve.py``, ``call/_call.py``, ``call/_eager.py``,
``call/_entry.py``, ``call/_build.py``) never import the ``torch.compile`` edge or the layer
of derivatives; an owner (``FlaxModule``, ``jax_function``) passes ``EDGES`` to its
``Caller``, and the pipeline calls up through it (NOTE [Call path] in ``call/_call.py``).

The torch.compile edge's ops load with their owner: they register with ``torch.library``
when ``_compile.py`` is imported, so that a graph saved by Dynamo or ``torch.export`` finds
them in a fresh process. The code Dynamo traces around them (``_traced.py``) loads when
Dynamo first traces a call: it imports Dynamo, and Dynamo runs an import it meets for real.
The layer of derivatives (``_higher.py``, ``_given.py``, ``_derived.py``) loads when a
derivative is first asked for: a call differentiated again or run under a ``torch.func``
transform.
"""

from __future__ import annotations

import torchside.edges._compile  # noqa: F401  (registers the ops)
from torchside.call._values import Edges


def _compiled(*args):
    from torchside.edges._traced import compiled_call

    return compiled_call(*args)


def _transformed(*args):
    from torchside.edges._higher import transformed

    return transformed(*args)


def _differentiate(*args):
    from torchside.edges._higher import differentiate

    return differentiate(*args)


def _differentiate_whole(*args):
    from torchside.edges._higher import differentiate

    return differentiate(*args, given_residuals=False)


EDGES = Edges(compiled=_compiled, transformed=_transformed, differentiate=_differentiate)
# The same without NOTE [Given residuals]'s route: a backward differentiated again takes
# the whole VJP or the shared linearization (an owner's value: tests of those routes, the
# benchmark's contestant without sharing). Derived owners inherit their call's edges.
WHOLE_VJPS = EDGES._replace(differentiate=_differentiate_whole)
