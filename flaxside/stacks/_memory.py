"""What a block holds between forward and backward, and what XLA needs for each pass."""

from __future__ import annotations

import dataclasses
import math
import time

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from flaxside.adapters._flat_apply import ARRAY, flat_apply
from flaxside.program._compiling_for import describe, jax_default_device
from flaxside.program._one_device import OnDevice
from flaxside.program._program import Program
from flaxside.program._specs import LeafSpec, is_differentiable

jtu = jax.tree_util


def _nbytes(specs) -> int:
    return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in specs)


def format_bytes(n: int | None) -> str:
    """``n`` bytes in B, kB, MB or GB (powers of 1000), right-aligned to 10 characters."""
    if n is None:
        return f"{'n/a':>10}   "
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:10.2f} {unit}"
    return f"{n:10d} B "


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Memory of one call signature of a block under reverse-mode differentiation.

    Attributes:
        held_bytes: residuals kept from forward to backward, excluding parameters,
            inputs and outputs (which the caller holds anyway). What remat saves.
        param_bytes: the ``params`` collection (NNX: the ``nnx.Param`` state).
        forward_temp_bytes: XLA's scratch memory for the forward-with-residuals program.
        backward_temp_bytes: XLA's scratch memory for the backward program.
        compile_seconds: trace, lowering and compilation of both programs.
        residual_count: how many arrays make up ``held_bytes``.
        device: the device the compiled forward runs on (``cpu:0``, ``gpu:1``).

    Example:
        >>> x = jax.ShapeDtypeStruct((8, 3), np.float32)
        >>> report = memory_report(nn.Dense(4), x)  # compiled, never run
        >>> report.param_bytes, report.held_bytes  # 16 floats; the backward needs only x
        (64, 0)
        >>> print(report)  # "(cpu:0)": the device it was compiled for
        MemoryReport (...)
          held (residuals)          0 B   0 arrays
          parameters               64 B
          forward temp            ... B   XLA memory analysis
          backward temp           ... B   XLA memory analysis
          compile                ... s   forward + backward
    """

    held_bytes: int
    param_bytes: int
    forward_temp_bytes: int | None
    backward_temp_bytes: int | None
    compile_seconds: float
    residual_count: int = 0
    device: str = ""

    def __str__(self) -> str:
        rows = [
            ("held (residuals)", format_bytes(self.held_bytes), f"{self.residual_count} arrays"),
            ("parameters", format_bytes(self.param_bytes), ""),
            ("forward temp", format_bytes(self.forward_temp_bytes), "XLA memory analysis"),
            ("backward temp", format_bytes(self.backward_temp_bytes), "XLA memory analysis"),
            ("compile", f"{self.compile_seconds:10.2f} s ", "forward + backward"),
        ]
        head = f"MemoryReport ({self.device})" if self.device else "MemoryReport"
        return head + "\n" + "\n".join(f"  {a:<17}{b}  {c}".rstrip() for a, b, c in rows)


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array | np.ndarray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return None


def _device_of(leaves):
    """The device of the first array placed on one device, else ``None``."""
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        devices = getattr(sharding, "device_set", None)
        if devices is not None and len(devices) == 1:
            return next(iter(devices))
    return None


def memory_report(target, *example_args, variables=None, seed: int = 0, device=None,
                  **example_kwargs):
    """Compiles a block's forward-with-residuals and backward and reports their memory.

    Nothing runs and no data is allocated: arrays may be ``jax.ShapeDtypeStruct``. Every
    parameter and every floating array argument is differentiated, as for a block inside a
    network. ``held_bytes`` comes from ``Program``'s residual map, the temp sizes from
    ``Compiled.memory_analysis()``.

    Args:
        target: a ``flax.linen.Module``, an ``nnx.Module``, or a function of arrays
            (its ``param_bytes`` is 0: pass parameters as arguments).
        *example_args: call arguments (arrays, shape structs, or static values).
        variables: Linen variables (arrays or shape structs); default: shapes of
            ``target.init``.
        seed: the seed for ``target.init`` when ``variables`` is not given.
        device: the JAX device to compile for (memory differs between backends). Default:
            the device of the first array argument placed on one (a ``jax.Array``, or a
            shape struct with a ``sharding``), else JAX's default device.
        **example_kwargs: keyword call arguments.

    Returns:
        A ``MemoryReport``; ``print`` it for a table.

    Raises:
        TypeError: ``target`` is neither a Flax module nor callable.
        ValueError: nothing in the call is differentiable.

    Example:
        >>> report = memory_report(nn.Dense(4), jax.ShapeDtypeStruct((8, 3), np.float32))
        >>> report.param_bytes
        64
    """
    if isinstance(target, nnx.Module):
        graphdef, params, rest = nnx.split(target, nnx.Param, ...)
        variables = (params, rest)

        def apply(variables, *args, **kwargs):
            return nnx.merge(graphdef, *variables)(*args, **kwargs)

        is_param = (jtu.tree_map(lambda _: True, params), jtu.tree_map(lambda _: False, rest))
    elif isinstance(target, nn.Module):
        if variables is None:
            variables = jax.eval_shape(
                target.init, jax.random.key(seed), *example_args, **example_kwargs
            )
        apply = target.apply
        is_param = {k: jtu.tree_map(lambda _, k=k: k == "params", v) for k, v in variables.items()}
    elif callable(target):
        variables, is_param = (), ()

        def apply(variables, *args, **kwargs):
            return target(*args, **kwargs)
    else:
        raise TypeError(
            f"memory_report: argument 'target' is a {type(target).__name__}, but a "
            f"flax.linen.Module, an nnx.Module or a function of arrays was expected."
        )
    var_leaves, var_treedef = jtu.tree_flatten(variables)
    param_mask = jtu.tree_leaves(is_param)
    arg_leaves, arg_treedef = jtu.tree_flatten((example_args, example_kwargs))
    slots = tuple(ARRAY if _abstract(x) is not None else x for x in arg_leaves)
    specs = [
        LeafSpec(tuple(x.shape), np.dtype(x.dtype), p and is_differentiable(x.dtype))
        for x, p in zip(var_leaves, param_mask, strict=True)
    ] + [
        LeafSpec(tuple(a.shape), np.dtype(a.dtype), is_differentiable(a.dtype))
        for a in map(_abstract, arg_leaves) if a is not None
    ]
    if not any(s.diff for s in specs):
        raise ValueError(
            "memory_report: nothing in the call is differentiable (no floating parameters or "
            "array arguments), so there is no backward to measure."
        )
    fn = flat_apply(lambda v, *a, **k: (apply(v, *a, **k), [], None), var_treedef,
                    arg_treedef, slots)
    if device is None:
        device = _device_of(arg_leaves) or jax_default_device()
    program = Program(fn, specs, name=f"memory_report({type(target).__name__})",
                      placement=OnDevice(device))
    return program_report(
        program, param_bytes=_nbytes(s for s, p in zip(specs, param_mask, strict=False) if p),
        held=program.residual_map().residual_specs)


TRAINING = ("forward_with_residuals", "backward")  # a training call's programs, by default


def compile_for_report(program: Program,
                       programs: tuple[str, ...] = TRAINING) -> dict[str, tuple]:
    """Compiles the programs a training call of ``program`` runs, from the specs alone.

    No data is needed or allocated. ``programs``: their kinds (``Program.executable``), in
    call order: ``("forward_with_residuals", "backward")`` holds the residuals,
    ``("forward", "backward_recompute")`` the inputs alone, ``("value_and_grad",)`` (a
    scalar loss) the gradients.

    Returns:
        ``{kind: (compiled, seconds)}`` in call order, seconds covering trace, lowering and
        compilation.
    """
    out = {}
    for kind in programs:
        start = time.perf_counter()
        out[kind] = (program.compiled(kind), time.perf_counter() - start)
    return out


def program_report(program: Program, *, param_bytes: int, held,
                   programs: tuple[str, ...] = TRAINING) -> MemoryReport:
    """The ``MemoryReport`` of the programs a training call of ``program`` runs.

    Args:
        program: the compiled programs of one call signature.
        param_bytes: the parameters' bytes (what the caller counts as parameters).
        held: ``LeafSpec``s of everything the call holds for its backward besides its
            parameters, arguments and outputs (the residual buffers, or a scalar loss's
            gradient buffers, and what the caller keeps of its own: RNG keys, state copies).
        programs: the kinds the call runs, in order (``compile_for_report``); the second,
            if any, is the backward (a scalar loss's backward is a scaling done by the
            caller, with no program and no scratch).
    """
    compiled = list(compile_for_report(program, programs).values())
    (fwd, fwd_s), (bwd, bwd_s) = compiled[0], (compiled[1:] or [(None, 0.0)])[0]
    held = list(held)
    fwd_mem = fwd.memory_analysis()
    bwd_temp = 0 if bwd is None else getattr(bwd.memory_analysis(), "temp_size_in_bytes", None)
    placed = {d for s in jtu.tree_leaves((fwd.input_shardings, fwd.output_shardings))
              for d in s.device_set}
    return MemoryReport(
        held_bytes=_nbytes(held),
        param_bytes=param_bytes,
        forward_temp_bytes=getattr(fwd_mem, "temp_size_in_bytes", None),
        backward_temp_bytes=bwd_temp,
        compile_seconds=fwd_s + bwd_s,
        residual_count=len(held),
        device=", ".join(sorted(map(describe, placed))),
    )
