"""What Dynamo traces in place of step 3 of NOTE [Call path] (the ops: ``_compile.py``).

The forward op, then the facts of the entry it ran, read as constants.

This file loads when Dynamo first traces a call (``EDGES.compiled`` imports it, and Dynamo
runs an import it meets for real), not with ``torchside``: marking ``_facts`` constant
imports Dynamo, which a run without ``torch.compile`` never needs (its cost:
docs/benchmarks.md, the ``call_costs`` block). The ops themselves register when
``_compile.py`` loads, with the owner, so that a graph Dynamo or ``torch.export`` saved
finds them in a fresh process.
"""

from __future__ import annotations

import jax
import torch

from torchside import _errors
from torchside.call._entry import apply_write_back
from torchside.call._values import Call
from torchside.edges._compile import caller_of, forward_op

jtu = jax.tree_util


def _encode_mode(mode) -> tuple[int, int]:
    """An owner's mode as the ops carry it: ``(training, graph key)`` (traced code)."""
    if mode is None:  # jax_function
        return -1, -1
    if isinstance(mode, tuple):  # NNX: (training, Graph)
        return int(mode[0]), mode[1].key
    return int(mode), -1



@torch.compiler.assume_constant_result
def _facts(caller_id: int, key: int) -> tuple:
    """``(outputs, output recipe, write-back)`` of entry ``key``."""
    entry = caller_of(caller_id).entry(key)
    return entry.n_out, _recipe(entry.out_treedef), entry.write_back



def _recipe(treedef):
    probe = jtu.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    if isinstance(probe, int):
        return ("one",)
    if isinstance(probe, tuple | list) and all(isinstance(x, int) for x in probe):
        return ("tuple" if isinstance(probe, tuple) else "list", len(probe))
    if isinstance(probe, dict) and all(isinstance(x, int) for x in probe.values()):
        return ("dict", tuple(probe))
    raise _errors.compiled_outputs(treedef)


def _rebuild(recipe, outs):
    """The owner's output structure from a flat list (traceable by Dynamo)."""
    if recipe[0] == "one":
        return outs[0]
    if recipe[0] == "tuple":
        return tuple(outs)
    if recipe[0] == "list":
        return list(outs)
    return dict(zip(recipe[1], outs, strict=True))



def compiled_call(caller, call: Call, write_back):
    """A call as Dynamo traces it: the custom ops in place of step 3 (NOTE [Call path])."""
    leaves = [*call.variables, *call.tensors]
    grad = torch.is_grad_enabled()
    mask = "".join(
        "1" if grad and t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)
        else "0"
        for t in leaves
    )
    training, graph = _encode_mode(call.mode)
    results = forward_op(caller.compile_id, training, graph, mask, leaves)
    n_out, recipe, wb = _facts(caller.compile_id, results[-1].shape[1])
    apply_write_back(write_back, wb, results, n_out)
    return _rebuild(recipe, results[:n_out])
