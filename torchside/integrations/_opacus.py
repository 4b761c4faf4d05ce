"""Opacus (DP-SGD) over a FlaxModule: its per-sample gradients and norms, its validator.

NOTE [Opacus]. Opacus (``opacus/grad_sample/grad_sample_module.py``) hooks the modules
that own parameters directly (``parameters(recurse=False)``) and, in the backward hook,
hands a module's grad sampler (its norm sampler, under fast gradient clipping) its inputs
(``activations``) and the gradient of its first output (``backprops``, already scaled for
a mean loss). A FlaxModule is the module that runs its parameters, so it answers
``named_parameters(recurse=False)`` with them (``FlaxModule.named_parameters``), and
Opacus hooks it; ``per_sample_gradients`` is its grad sampler, ``per_sample_norms`` its
norm sampler and ``validate`` its validator, registered with Opacus's own registries
(``register_grad_sampler``, ``register_norm_sampler``, ``register_module_validator``) when
Opacus is imported, before or after ``torchside`` (``_WhenImported``): flaxtorch never
imports Opacus itself.

The per-sample gradients of the whole block are one JAX program: the block's program is
built for one sample (each argument's first row, a batch of one) and
``flaxside.internal.per_sample_vjp_function`` runs ``jax.vmap`` over the batch of its VJP
with each sample's cotangent: the block's own traced body, remat policy included. They are
exact where the block's output for sample ``i`` depends only on input ``i``: state the
call writes back (batch statistics) is refused here and reported by ``validate``; a
cross-batch op without state (``x - x.mean(0)``) cannot be seen, and must not be used.
"""

from __future__ import annotations

import importlib.abc
import sys

import torch

import bridge
from flaxside.internal import per_sample_norms_function, per_sample_vjp_function
from torchside import _errors
from torchside.call._routes import REPORT
from torchside.owners._module import FlaxModule


def per_sample_gradients(module: FlaxModule, activations, backprops) -> dict:
    """Opacus's grad sampler of a FlaxModule: ``{parameter: per-sample gradients}``.

    Args:
        module: the FlaxModule, called with positional tensor arguments, batch first.
        activations: the call's positional arguments, as Opacus captured them.
        backprops: the gradient of the loss with respect to the call's output, per sample.

    Raises:
        ValueError: an argument is not batched on dimension 0 like the output. (A call
            with keyword arguments is refused when it runs: ``FlaxModule.forward``.)
        NotImplementedError: the call draws an RNG key, writes state back, has more
            than one differentiable output, or the module is sharded.
    """
    return _per_sample(module, activations, backprops, "per-sample vjp",
                       per_sample_vjp_function)


def per_sample_norms(module: FlaxModule, activations, backprops) -> dict:
    """Opacus's norm sampler of a FlaxModule: ``{parameter: per-sample gradient norms}``.

    For fast gradient clipping (``GradSampleModuleFastGradientClipping``, ``make_private``
    with ``grad_sample_mode="ghost"``): one JAX program returns the norms only, a vector of
    the batch's length per parameter; the per-sample gradients are never torch tensors.
    Arguments and errors as ``per_sample_gradients``.
    """
    return _per_sample(module, activations, backprops, "per-sample norms",
                       per_sample_norms_function)


def _per_sample(module: FlaxModule, activations, backprops, kind: str, make) -> dict:
    """``{parameter: make's result}``, one JAX program for the batch.

    ``make(program, batched)`` of the block's program for one sample, run on the whole
    batch with ``backprops`` as the cotangents.
    """
    from torchside.edges._derived import derived  # the derivative layer, loaded on use

    caller = module._caller
    where = caller.where
    if caller.plan is not None:
        raise _errors.per_sample_unsupported(where, "a sharded block")
    n = backprops.shape[0]
    for k, a in enumerate(activations):
        if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] != n:
            raise _errors.per_sample_batch(where, k, a, n)
    call = module._resolve(tuple(a[:1] for a in activations), {})
    var_grads = tuple(t.requires_grad and (t.is_floating_point() or t.is_complex())
                      for t in call.variables)
    # REPORT: the signature's entry without running it or drawing a key.
    entry, _, leaves = caller.prepare(call, (False,) * len(call.tensors), var_grads, REPORT)
    if entry.rng_read:
        raise _errors.per_sample_unsupported(where, "RNG streams (dropout)")
    if entry.write_back.targets:
        raise _errors.per_sample_unsupported(where, "state written back ({})".format(
            ", ".join(entry.layout.names[i] for i in entry.write_back.targets)))
    if entry.n_out != 1:
        raise _errors.per_sample_unsupported(where, f"{entry.n_out} outputs")
    if not entry.grad_slots:
        return {}
    arguments = entry.layout.arguments
    leaves = list(leaves)
    leaves[arguments] = list(activations)
    batched = tuple(arguments.start <= i < arguments.stop for i in range(len(leaves)))
    owner = derived(caller.edges, entry, kind, lambda program: make(program, batched), batched)
    # In the program's output dtype (autocast may have cast the output torch saw).
    out_dtype = bridge.torch_dtype(entry.program.out_specs[entry.diff_out_index[0]].dtype)
    with torch.no_grad():
        results = owner(leaves, [backprops.to(out_dtype)])
    if owner.batch_axes is not None:  # gradients stacked by a scan: the batch first, a view
        results = [r.movedim(axis, 0) for r, axis in zip(results, owner.batch_axes,
                                                         strict=True)]
    params = [scope._parameters.get(name) for scope, name, _ in module._refs]
    return {params[i]: r for i, r in zip(entry.grad_slots, results, strict=True)
            if params[i] is not None}


def validate(module: FlaxModule) -> list:
    """Opacus's validator of a FlaxModule: an error per state it holds besides parameters.

    A Flax block's other collections (``batch_stats``) are written by a train-mode call
    from the whole batch: they mix samples, and per-sample gradients through them are not
    per sample (as Opacus refuses ``BatchNorm``).
    """
    from opacus.validators.errors import UnsupportedModuleError

    state = [name for name, _ in module.named_buffers()]
    if not state:
        return []
    return [UnsupportedModuleError(_errors.per_sample_state(module._caller.where, state))]


def register() -> None:
    """Registers the grad and norm samplers and the validator with Opacus (imports it)."""
    from opacus.grad_sample.utils import register_grad_sampler, register_norm_sampler
    from opacus.validators.utils import register_module_validator

    register_grad_sampler(FlaxModule)(per_sample_gradients)
    register_norm_sampler(FlaxModule)(per_sample_norms)
    register_module_validator(FlaxModule)(validate)


class _WhenImported(importlib.abc.MetaPathFinder):
    """Runs ``register`` right after ``opacus`` is imported.

    A post-import hook, as ``wrapt.register_post_import_hook``: the other finders find
    the package, this one wraps its loader, and leaves ``sys.meta_path`` once it has.
    """

    def find_spec(self, name, path=None, target=None):
        if name != "opacus":
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_register(module):
                exec_module(module)
                register()

            spec.loader.exec_module = exec_then_register
        return spec


def register_when_imported() -> None:
    """Registers now if Opacus is imported, else right after it is (if it ever is)."""
    if "opacus" in sys.modules:
        register()
    elif not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported())


register_when_imported()
