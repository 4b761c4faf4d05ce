"""Reading and evaluating jaxprs: one interpreter, the rules of each meaning beside it.

NOTE [One interpreter] in ``_interpret.py``. The meanings live with what they serve: the
mesh's packed and per-rank scans (``flaxside/mesh/_packed_scans.py``), the per-sample sums
of squares (``flaxside/derivatives/_summed_squares.py``), the given residuals
(``flaxside/derivatives/_given.py``).
"""

# jax.extend.core holds these in every release the project admits (jax >= 0.8.1).
from jax.extend.core import ClosedJaxpr as ClosedJaxpr
from jax.extend.core import Jaxpr as Jaxpr
from jax.extend.core import Literal as Literal
from jax.extend.core import Var as Var

from flaxside.jaxprs._interpret import ANY as ANY
from flaxside.jaxprs._interpret import again as again
from flaxside.jaxprs._interpret import bind as bind
from flaxside.jaxprs._interpret import body_of as body_of
from flaxside.jaxprs._interpret import evaluate as evaluate
from flaxside.jaxprs._interpret import runs_again as runs_again
from flaxside.jaxprs._walk import dropped as dropped
from flaxside.jaxprs._walk import is_var as is_var
from flaxside.jaxprs._walk import live as live
from flaxside.jaxprs._walk import primitives as primitives
from flaxside.jaxprs._walk import producers as producers
from flaxside.jaxprs._walk import sub_jaxprs as sub_jaxprs
from flaxside.jaxprs._walk import uses as uses
from flaxside.jaxprs._walk import walk as walk

__all__ = [
    "ANY",
    "ClosedJaxpr",
    "Jaxpr",
    "Literal",
    "Var",
    "again",
    "bind",
    "body_of",
    "dropped",
    "evaluate",
    "is_var",
    "live",
    "primitives",
    "producers",
    "runs_again",
    "sub_jaxprs",
    "uses",
    "walk",
]
