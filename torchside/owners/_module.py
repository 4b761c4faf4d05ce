"""FlaxModule: a Flax (Linen or NNX) module as a torch.nn.Module."""

from __future__ import annotations

import itertools
import operator

import jax
import torch

import bridge
from flaxside.internal import (
    adapter_for,
    is_nnx_factory,
    is_nnx_module,
    key_data_shape,
    program_report,
)
from torchside import _errors
from torchside.call._call import Caller
from torchside.call._options import check_choice
from torchside.call._owner import CallerOwner
from torchside.call._resolve import finish, resolve
from torchside.call._routes import REPORT
from torchside.call._values import AUTOCAST_MODES, Call, Settings
from torchside.edges._edges import EDGES
from torchside.owners._initializer import Initializer
from torchside.owners._sharded import ShardedVariables
from torchside.owners._variables import FlaxVariables, attach_variables

jtu = jax.tree_util
_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")


class FlaxModule(CallerOwner, FlaxVariables, ShardedVariables, torch.nn.Module):
    """Runs a Flax Linen or NNX module inside PyTorch; torch owns its variables.

    Parameters (Linen's ``params`` collection, NNX's ``nnx.Param``) become
    ``nn.Parameter``s and all other state persistent buffers, with ``state_dict`` keys equal
    to the Flax path joined by ``.`` (``params.Dense_0.kernel`` for Linen,
    ``layers.0.kernel`` for NNX; stacked scan parameters keep their leading axes). A call
    converts tensors to JAX without copying, runs a program compiled once per call
    signature, and converts results back; gradients reach every parameter and every input
    that requires grad.

    Train and eval: in ``train()`` mode non-parameter state (``batch_stats``, counters) is
    applied as mutable and the buffers are updated after each forward; in ``eval()`` mode it
    is read-only. ``train_kwarg`` names the Linen keyword that receives the mode
    (``"train"`` gets ``self.training``; ``"deterministic"`` and ``"use_running_average"``
    get its negation). NNX modules follow ``.train()``/``.eval()`` by themselves.

    A copy (``copy.deepcopy``, ``AveragedModel``) or an unpickled module has its own
    parameters and buffers; its compiled programs are rebuilt on first use.

    Args:
        module: a ``flax.linen.Module`` or ``flax.nnx.Module``.
        example_args: positional arguments for Linen ``module.init`` (tensors or static values).
        example_kwargs: keyword arguments for Linen ``module.init``.
        seed: the seed of ``jax.random.key`` used by Linen ``module.init``.
        variables: initial Linen variables; when given, ``module.init`` is not called.
        rngs: RNG stream names (e.g. ``("dropout",)``); each forward that uses them draws
            their keys from torch's default generator, so ``torch.manual_seed`` makes runs
            reproducible, and the backward (and any recompute) reuses the forward's keys.
        train_kwarg: the Linen keyword argument that receives the train/eval mode.
        residuals: ``"save"`` holds exactly what the Flax remat policy keeps between forward
            and backward, except for a scalar loss: when the one differentiable output is a
            real scalar, a grad-enabled eager call runs one fused program (JAX's
            ``jit(value_and_grad)``) at forward and holds the gradients, which the backward
            scales by the incoming gradient (NOTE [Scalar loss] in ``call/_eager.py``).
            ``"split"`` holds the policy's residuals for a scalar loss too (two programs);
            ``"recompute"`` holds only the inputs and reruns the forward in the backward,
            like ``torch.utils.checkpoint`` around the whole block.
        autocast: behaviour under ``torch.autocast``: ``"outputs"`` (default) runs the
            block in its parameters' dtype (floating inputs are cast to it) and casts
            floating outputs to the autocast dtype, as torch casts a Linear's output;
            ``"inputs"`` casts floating inputs and parameters to the autocast dtype
            (gradients flow back to the full-precision parameters, as with torch's own
            autocast) and runs the block in it; ``"off"`` ignores autocast.
        cache_size: how many call signatures keep their compiled programs (LRU).
        recompile_warning: after this many distinct call signatures, warn once with a
            ``RecompileWarning`` naming the changing dimension; ``None`` never warns.

    Example:
        >>> import flax.linen as nn
        >>> layer = FlaxModule(nn.Dense(3), example_args=(torch.zeros(2, 4),))
        >>> sorted(k for k, _ in layer.named_parameters())
        ['params.bias', 'params.kernel']
        >>> layer(torch.randn(2, 4)).shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        module,
        example_args=(),
        example_kwargs=None,
        *,
        seed: int = 0,
        variables=None,
        rngs: tuple[str, ...] | str = (),
        train_kwarg: str | None = None,
        residuals: str = "save",
        autocast: str = "outputs",
        cache_size: int = 32,
        recompile_warning: int | None = 8,
    ):
        super().__init__()
        where = f"FlaxModule({_name(module)})"
        self.autocast = check_choice(
            autocast, AUTOCAST_MODES, option="autocast", where=where,
            meaning="'outputs' runs the block in its own dtype and casts its floating outputs "
                    "to the autocast dtype, 'inputs' runs it in the autocast dtype, 'off' "
                    "ignores autocast.")
        rngs = (rngs,) if isinstance(rngs, str) else tuple(rngs)
        if not isinstance(example_args, tuple | list):
            example_args = (example_args,)
        # Variables are made where torch makes a new layer's (torch's default device, the
        # CPU unless set otherwise), whatever JAX's default device is (NOTE [Devices]); on
        # the meta device they have shapes only, and reset_parameters() computes them.
        device = bridge.internal.default_torch_device()
        meta = device.type == "meta"
        self._initializer = None
        if variables is None and is_nnx_factory(module):
            self._initializer = Initializer(module, seed, where=where)
            module = self._initializer.shapes() if meta else self._initializer.values(device)
            where = self._initializer.where = f"FlaxModule({type(module).__name__})"
        elif variables is None and hasattr(module, "init") and not is_nnx_module(module):
            self._initializer = Initializer(module, seed, rngs, tuple(example_args),
                                            example_kwargs, where)
            variables = (self._initializer.shapes() if meta else self._initializer.values(
                device, example_args, example_kwargs))
        adapter = adapter_for(module, variables, where=where, rng_streams=rngs,
                              train_kwarg=train_kwarg)
        self._adapter = adapter
        self._refs, self._scopes = attach_variables(self, adapter.names, adapter.is_param,
                                                    adapter.take_initial_values(), device)
        self._is_param = adapter.is_param
        self._nnx = adapter.kind == "nnx"
        # An NNX module holds its own arrays (a second copy of every parameter, on JAX's
        # default device): torch's copy is the state, so the module itself is not kept.
        self._linen = None if self._nnx else module
        # NNX: the module graph the next call uses (flaxside.internal.Graph).
        self._graph = adapter.graph if self._nnx else None
        n = len(self._refs)
        state_treedef = jtu.tree_structure(
            (adapter.treedef.unflatten([0] * n), 0 if rngs else None))
        settings = Settings(where, state_treedef, adapter.names, adapter.make_apply,
                            (len(rngs), *key_data_shape()) if rngs else None)
        self._caller = Caller(settings, EDGES, residuals=residuals, cache_size=cache_size,
                              recompile_warning=recompile_warning)

    # -- torch hooks that replace or re-type the variables ------------------------------
    def _apply(self, fn, recurse=True):
        before = self._variable_metadata()
        out = super()._apply(fn, recurse)
        if self._variable_metadata() != before:  # a no-op .to("cpu") keeps the programs
            self.clear_caches()
        return out

    def _variable_metadata(self) -> tuple:
        return tuple((t.dtype, t.device, t.shape) for t in self._current_tensors())

    def memory_report(self, *example_args, **example_kwargs):
        """What a training call with these arguments holds and needs, in the current mode.

        Compiles, without running, the programs a call makes with grad enabled in the
        module's current mode (``train()``: the train keyword, the RNG streams, mutable
        collections; ``eval()``: read-only state, no RNG draw) and boundary mode, for the
        device the call would run on. Every floating argument counts as requiring grad, as
        for a block inside a network. ``held_bytes`` is what the call saves for backward
        besides the parameters, buffers, arguments and outputs: the residuals, a drawn RNG
        key, copies of written-back state; for a scalar loss with ``residuals="save"``, the
        gradient buffers (NOTE [Scalar loss] in ``call/_eager.py``). The compiled programs stay
        cached for the call.

        Returns:
            A ``flaxside.MemoryReport``; ``print`` it for a table.

        Raises:
            ValueError: nothing in the call requires grad, so there is no backward.

        Example:
            >>> import flax.linen as nn
            >>> layer = FlaxModule(nn.Dense(3), example_args=(torch.zeros(2, 4),))
            >>> layer.memory_report(torch.zeros(2, 4)).param_bytes
            60
        """
        caller = self._caller
        call = self._resolve(example_args, example_kwargs)
        with torch.enable_grad():  # the signature of a training call
            entry = caller.prepare(
                call, tuple(t.is_floating_point() or t.is_complex() for t in call.tensors),
                None, REPORT)[0]
        if not entry.grad_slots:
            raise _errors.nothing_to_report(caller.where)
        param_bytes = sum(t.numel() * t.element_size()
                          for t, p in zip(call.variables, self._is_param, strict=True) if p)
        # What the call holds is read from the value its save reads (NOTE [What a call holds]).
        route = entry.routes[REPORT]
        held = entry.holding(route).held_specs(entry.program, entry.layout)
        programs = (route.forward,) if route.backward is None else (route.forward, route.backward)
        return program_report(entry.program, param_bytes=param_bytes, held=held,
                              programs=programs)

    # -- the call -----------------------------------------------------------------------
    def _resolve(self, args: tuple, kwargs: dict) -> Call:
        """Step 1 of NOTE [Call path] (``resolve`` in ``call/_call.py``)."""
        compiling = torch.compiler.is_compiling()
        if compiling:  # Dynamo traces this: plain loops it knows, not map over C functions
            variables = self._variables(traced=True)
        else:
            if any(map(_PRE_HOOKS, self._scopes)):  # (in C: no Python work per scope)
                self._run_pre_hooks()
            variables = self._current_tensors()
        if self._caller.plan is not None:
            variables = self._local_shards(variables)
        return resolve(variables, args, kwargs,
                       mode=(self.training, self._graph) if self._nnx else self.training,
                       where=self._caller.where, autocast=self.autocast,
                       is_param=self._is_param, compiling=compiling)

    def _current_tensors(self, traced: bool = False) -> list[torch.Tensor]:
        """The variables' tensors now, read as torch modules read them.

        ``.to()``, ``load_state_dict(assign=True)`` and FSDP2 replace the entries, so they
        are read at every call. A parametrized (``torch.nn.utils.parametrize``) or pruned
        variable is no longer in ``_parameters``: the attribute gives its current value,
        and gradients reach the original through torch's autograd. ``traced``: Dynamo
        traces this call (a plain loop).
        """
        if traced:
            out = []
            for scope, name, is_param in self._refs:
                t = (scope._parameters if is_param else scope._buffers).get(name)
                out.append(getattr(scope, name) if t is None else t)
            return out
        # Every scope's ``_parameters`` or ``_buffers`` dict, read by ``map`` (no Python
        # call per variable); those torch modules never replace, only their entries.
        tables = self.__dict__["_tables"] if "_tables" in self.__dict__ else None
        if tables is None:
            tables = self._tables = ([(s._parameters if p else s._buffers)
                                      for s, _, p in self._refs], [n for _, n, _ in self._refs])
        out = list(map(dict.get, *tables))
        if not all(map(operator.is_not, out, itertools.repeat(None))):  # parametrized, pruned
            out = [getattr(s, n) if t is None else t
                   for t, (s, n, _) in zip(out, self._refs, strict=True)]
        return out

    def _variables(self, traced: bool = False) -> list[torch.Tensor]:
        """The variables a call reads, after the forward pre-hooks of their scopes.

        Hook-based weight transforms (``torch.nn.utils.prune``, the older ``weight_norm``
        and ``spectral_norm``) recompute a weight there, as if the scope were called.
        """
        self._run_pre_hooks()
        return self._current_tensors(traced)

    def _run_pre_hooks(self) -> None:
        """Runs the forward pre-hooks of the scopes (``_variables``)."""
        for scope in self._scopes:
            if scope._forward_pre_hooks:
                with_kwargs = scope._forward_pre_hooks_with_kwargs
                for hook_id, hook in list(scope._forward_pre_hooks.items()):
                    if hook_id in with_kwargs:
                        hook(scope, (), {})
                    else:
                        hook(scope, ())

    def _write_back(self, wb, updates) -> None:
        """Step 5 of NOTE [Call path]: updated state into the buffers, the NNX graph after."""
        if updates:
            variables = self._current_tensors()
            with torch.no_grad():
                for i, new in zip(wb.targets, updates, strict=True):
                    variables[i].copy_(new)
        if wb.graph is not None:
            self._graph = wb.graph

    def forward(self, *args, **kwargs):
        """Applies the Flax module to pytrees of tensors and returns a pytree of tensors."""
        if kwargs and self._forward_hooks:
            _refuse_keywords_opacus_drops(self, kwargs)
        call = self._resolve(args, kwargs)
        outputs = self._caller(call, self._write_back)
        return outputs if call.out_dtype is None else finish(call, outputs)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """Torch's ``named_parameters``; with ``recurse=False``, the block's parameters too.

        The parameters sit on scope submodules (``params.Dense_0``) that never run: the
        FlaxModule is the module that runs them, and says so where torch asks which module
        owns a parameter. Hook-based libraries hook the modules that answer here (Opacus:
        NOTE [Opacus] in ``integrations/_opacus.py``). Names are unchanged:
        ``params.Dense_0.kernel``.
        """
        return super().named_parameters(prefix, True, remove_duplicate)

    # -- dtype and device moves ---------------------------------------------------------
    def to(self, *args, **kwargs):  # noqa: D102
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        _check_wide(dtype, "to")
        return super().to(*args, **kwargs)

    def double(self):  # noqa: D102
        _check_wide(torch.float64, "double")
        return super().double()

def _check_wide(dtype, method: str) -> None:
    if dtype in (torch.float64, torch.complex128) and not jax.config.jax_enable_x64:
        raise _errors.wide_dtype(dtype, method)


def _name(module) -> str:
    if is_nnx_factory(module):
        return getattr(module, "__qualname__", type(module).__name__)
    return type(module).__name__


def _refuse_keywords_opacus_drops(module: FlaxModule, kwargs: dict) -> None:
    """Refuses a call with keywords that Opacus is capturing (NOTE [Opacus]).

    Opacus's forward hook captures positional arguments only, and hands them to the
    module's grad sampler, whose per-sample gradients without the keywords would be those
    of another function. Opacus captures where its hook is attached and enabled, the module
    is in training mode and grad mode is on: refused there, before anything runs.
    """
    if not (module.training and torch.is_grad_enabled()):
        return
    for hook in module._forward_hooks.values():
        owner = getattr(getattr(hook, "func", hook), "__self__", None)
        if (type(owner).__module__.startswith("opacus.")
                and getattr(owner, "hooks_enabled", True)):
            raise _errors.per_sample_keywords(module._caller.where, tuple(kwargs))
