"""Every error a ``FlaxModule`` or ``jax_function`` user sees from torchside, worded here.

Each function returns the exception; the caller raises it (``from None`` where the cause
is ours to explain). A message names the owner the user called (``FlaxModule(Block)``,
``jax_function(f)``) and the argument, shows what was received and what was expected, and
says how to fix it. ``bridge`` and ``flaxside`` word their own errors about arrays and
traces; ``for_owner`` puts the owner's name in front of those that concern a call.
"""

from __future__ import annotations

import torch


def for_owner(error: Exception, where: str) -> Exception:
    """The same error, its message naming the owner the user called.

    For errors that bridge raises about a call's tensors (a dtype or device JAX cannot
    hold, an int64 value beyond int32).
    """
    return type(error)(f"{where}: {error}")


# -- construction -----------------------------------------------------------------------
def bad_choice(value, choices: tuple, *, option: str, where: str, meaning: str) -> ValueError:
    """An option that is not one of its lower-case choices."""
    return ValueError(f"{where}: {option}={value!r} is not one of {choices}. {meaning}")


def not_positive_int(value, *, option: str, where: str, meaning: str,
                     none_ok: bool) -> ValueError:
    """An option that must be a positive int (or ``None``)."""
    allowed = "a positive int" + (" or None" if none_ok else "")
    return ValueError(f"{where}: {option}={value!r} must be {allowed} ({meaning}).")


def no_example_args(where: str, cause: Exception) -> TypeError:
    """A Linen module that needs example inputs for ``init`` and got none."""
    return TypeError(
        f"{where}: a Linen module is initialized by calling module.init with example "
        f"inputs, and none were given ({cause}). Pass example_args=(torch.zeros(batch, "
        f"features),) (shapes and dtypes like the real inputs), or variables= with "
        f"existing Flax variables."
    )


def wide_dtype(dtype: torch.dtype, method: str) -> TypeError:
    """A move to a 64-bit dtype while JAX runs 32-bit."""
    return TypeError(
        f"FlaxModule.{method}: moving to {dtype} needs JAX's 64-bit mode, which is off, "
        f"so JAX would silently compute in 32 bits. Enable it before the first call with "
        f"jax.config.update('jax_enable_x64', True), or keep the module in float32."
    )


def scope_called() -> RuntimeError:
    """A ``FlaxScope`` (a namespace of variables) called as if it were a module."""
    return RuntimeError("FlaxScope only holds variables; call the FlaxModule that owns it.")


# -- a call's arguments -----------------------------------------------------------------
def unhashable_static(name: str, value, where: str) -> TypeError:
    """A non-tensor argument that cannot be part of a compile key."""
    return TypeError(
        f"{where}: argument {name} is a {type(value).__name__}, which is neither a "
        f"torch.Tensor nor hashable. Non-tensor arguments are static (part of the "
        f"compile key) and must be hashable: pass a tensor, or a tuple instead of "
        f"a list of numbers."
    )


def other_device(name: str, device: torch.device, expected: torch.device, lead: str | None,
                 where: str) -> ValueError:
    """A tensor on another device than the call's (``lead``: the argument that decided it).

    ``lead=None``: the module's parameters decided the device.
    """
    if lead is None:
        what = "the module's parameters are"
        fix = f"Move the input with .to('{expected}') or the module with .to('{device}')."
    else:
        what = f"{lead} is"
        fix = f"Move every tensor argument to one device, e.g. {name}.to('{expected}')."
    return ValueError(f"{where}: argument {name} is on {device}, but {what} on {expected}. {fix}")


def compiled_arguments(where: str, n_args: int, n_kwargs: int) -> TypeError:
    """A call under ``torch.compile`` with pytrees, keywords or static values."""
    return TypeError(
        f"{where} under torch.compile takes tensors as positional arguments only "
        f"(got {n_args} positional, {n_kwargs} keyword). Pass static values "
        f"through the Flax module's attributes, or call it outside torch.compile."
    )


# -- what a program returns -------------------------------------------------------------
def output_dtype(path: str, dtype, where: str) -> TypeError:
    """An output whose dtype torch has no match for."""
    return TypeError(
        f"{where}: output {path or '(the result)'} has dtype {dtype}, which torch cannot "
        f"hold. Cast it inside the function (e.g. .astype(jnp.int8) for int4) or leave it "
        f"out of the outputs."
    )


def compiled_outputs(treedef) -> TypeError:
    """An output structure the ``torch.compile`` route cannot rebuild in traced code."""
    return TypeError(
        f"FlaxModule under torch.compile: the module returns {treedef}; the compiled path "
        f"supports one array, or a flat tuple, list or dict of arrays. Return one of those, "
        f"or call the module outside torch.compile."
    )


def update_mismatch(name: str, update, held, where: str) -> TypeError:
    """State written back with another dtype or shape than its buffer (``LeafSpec``s)."""
    return TypeError(
        f"{where}: the forward updates '{name}' to {update.dtype}{list(update.shape)}, but "
        f"the buffer holds {held.dtype}{list(held.shape)}; torch keeps its buffers' dtype "
        f"and shape. Keep the state's dtype and shape in the forward (e.g. cast the new "
        f"value with .astype(old.dtype))."
    )


# -- autograd -----------------------------------------------------------------------------
def higher_order_after_write_back(where: str, name: str) -> RuntimeError:
    """A derivative of a backward whose forward's state was overwritten since."""
    return RuntimeError(
        f"{where}: differentiating this call's backward (create_graph=True, torch.func) "
        f"recomputes its forward, whose differentiable outputs read the state '{name}', "
        f"which the forward itself updated in place since. Build the module with "
        f"residuals='recompute' (it keeps the forward's copy of that state), or call it "
        f"in eval() mode."
    )


def dtensor_not_sharded(name: str, where: str) -> RuntimeError:
    """A variable that is a DTensor on a module ``shard`` did not shard in this process."""
    return RuntimeError(
        f"{where}: the variable '{name}' is a DTensor, but this module was not sharded in "
        f"this process (torchside.shard): a pickled or torch.save'd sharded module keeps "
        f"its DTensors but not its meshes. Build the module again, call shard() on it, "
        f"and load the state with torch.distributed.checkpoint (copy.deepcopy, in the "
        f"same process, keeps the sharding)."
    )


def sharded_higher_order(where: str) -> NotImplementedError:
    """A derivative of a sharded block's backward (``create_graph``)."""
    return NotImplementedError(
        f"{where} is sharded (torchside.shard): differentiating its backward again "
        f"(create_graph=True, torch.autograd.functional, torch.func) is not supported; "
        f"its derivatives would have to be SPMD programs over the ranks too. Take such "
        f"derivatives with an unsharded FlaxModule, or compute the penalty inside the "
        f"Flax block (jax.grad there), where a first-order backward reaches it."
    )


def sharded_under_transform(where: str) -> NotImplementedError:
    """A sharded block called under a ``torch.func`` transform or forward-mode AD."""
    return NotImplementedError(
        f"{where} is sharded (torchside.shard) and was called under a torch.func "
        f"transform (vmap, grad, jvp, ...) or with forward-mode dual tensors: DTensor "
        f"parameters cannot be transformed, and its programs are SPMD over the ranks. Call "
        f"it outside the transform, or use an unsharded FlaxModule there."
    )


def modified_for_higher_order(where: str, name: str) -> RuntimeError:
    """A leaf written in place between the forward and a derivative of its backward."""
    return RuntimeError(
        f"{where}: '{name}' was modified by an inplace operation after the forward, and "
        f"differentiating this call's backward (create_graph=True, torch.func) recomputes "
        f"the forward from it. Modify a clone, or take the derivative before the write."
    )


def no_forward_mode(where: str) -> NotImplementedError:
    """Forward-mode AD of a function JAX has no forward-mode rule for."""
    return NotImplementedError(
        f"{where}: forward-mode differentiation (torch.func.jvp, jacfwd, forward_ad) runs "
        f"jax.jvp, and the function holds a jax.custom_vjp, which defines reverse mode "
        f"only. Use reverse mode (torch.func.vjp, jacrev), or give the custom rule a "
        f"jax.custom_jvp instead."
    )


def owner_gone() -> RuntimeError:
    """A compiled graph that names a module that was freed."""
    return RuntimeError(
        "flaxtorch: a compiled graph refers to a FlaxModule that no longer exists. "
        "Compile the module you call (torch.compile(model)) rather than reusing a graph."
    )


# -- methods ------------------------------------------------------------------------------
def nothing_to_report(where: str) -> ValueError:
    """``memory_report`` of a call with no backward."""
    return ValueError(
        f"{where}.memory_report: nothing in the call requires grad (no floating parameter "
        f"that requires grad, no floating argument), so there is no backward to measure."
    )


def flax_shape(name: str, got: tuple, expected: tuple) -> ValueError:
    """``load_flax_variables`` given a leaf of another shape."""
    return ValueError(
        f"load_flax_variables: '{name}' has shape {got}, expected {expected}."
    )


def no_initializer(where: str, nnx: bool) -> RuntimeError:
    """``reset_parameters`` of a module whose init cannot run again."""
    how = ("it was given an NNX module instance; pass a factory instead, "
           "FlaxModule(lambda rngs: Model(..., rngs=rngs)), which reset_parameters runs "
           "again with nnx.Rngs(seed)") if nnx else (
           "it was built from variables=; rebuild it without variables= (Flax's init with "
           "seed=), or load values with load_flax_variables")
    return RuntimeError(f"{where}.reset_parameters: there is no init to run again: {how}.")


def reset_on_meta(where: str) -> RuntimeError:
    """``reset_parameters`` while the variables have no memory."""
    return RuntimeError(
        f"{where}.reset_parameters: the parameters are on the meta device, which holds no "
        f"memory to initialize. Give them memory first: module.to_empty(device='cpu') (or "
        f"'cuda'), then reset_parameters()."
    )


def meta_variables(name: str, where: str) -> ValueError:
    """A call while the variables are on the meta device (``name``: the first)."""
    return ValueError(
        f"{where}: argument '{name}' is on meta, which holds shapes but no values (the "
        f"module was built under torch.device('meta'), or moved there). Materialize the "
        f"module before calling it: module.to_empty(device='cpu') (or 'cuda'), then "
        f"module.reset_parameters()."
    )


def write_back_under_transform(where: str, names: list) -> NotImplementedError:
    """A call that writes state back, under a ``torch.func`` transform."""
    return NotImplementedError(
        f"{where} under a torch.func transform: the call writes back the state {names} "
        f"(batch statistics, counters) into the module's buffers, which a transform may "
        f"not mutate (and under vmap a batch of calls would give one update per batch "
        f"entry). Call the module in eval() mode there (its state is then read only), or "
        f"keep the statistics inside the transformed function."
    )


def random_under_vmap(where: str) -> RuntimeError:
    """A call that draws an RNG key under ``vmap(randomness="error")``."""
    return RuntimeError(
        f"{where} under torch.func.vmap draws a key for its RNG streams (dropout), and "
        f"vmap's randomness='error' (its default) refuses random draws. Pass "
        f"randomness='different' (a key per batch entry) or 'same' (one key for all), or "
        f"call the module in eval() mode."
    )


def mp_policy_type(where: str, policy) -> TypeError:
    """``shard(mp_policy=...)`` given something other than FSDP2's policy class."""
    return TypeError(
        f"shard({where}): argument 'mp_policy' is {type(policy).__name__} {policy!r}, but "
        f"torch.distributed.fsdp.MixedPrecisionPolicy or None was expected. Pass "
        f"MixedPrecisionPolicy(param_dtype=torch.bfloat16), as for fully_shard."
    )


def mp_policy_field(where: str, field: str, value, supported: str, why: str) -> ValueError:
    """A ``MixedPrecisionPolicy`` field the sharded block cannot run with."""
    return ValueError(
        f"shard({where}): mp_policy.{field} is {value!r}, but a sharded block takes "
        f"{supported} there ({why}). Pass MixedPrecisionPolicy({field}=...) with one of "
        f"those; the module is unchanged."
    )


def per_sample_batch(where: str, k: int, value, n: int) -> ValueError:
    """Opacus's per-sample gradients of a call whose argument is not batched on dim 0."""
    got = (f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
           else type(value).__name__)
    return ValueError(
        f"{where} under Opacus: positional argument {k} has {got}, but per-sample gradients "
        f"need every argument to be a tensor with the batch ({n} samples, as the output) on "
        f"dimension 0 (Opacus's batch_first=True). Pass batch-first tensors only; other "
        f"values belong in the Flax module's attributes."
    )


def per_sample_keywords(where: str, names: tuple) -> ValueError:
    """Opacus's per-sample gradients of a call that had keyword arguments."""
    return ValueError(
        f"{where} under Opacus: the call had keyword arguments {list(names)}, but Opacus "
        f"captures a module's positional arguments only, and per-sample gradients without "
        f"them would be those of another function. Pass them positionally (batch-first "
        f"tensors), or make the non-tensor ones attributes of the Flax module."
    )


def sharded_variable_tensors(where: str) -> NotImplementedError:
    """``flax_variable_tensors()`` of a sharded block."""
    return NotImplementedError(
        f"{where}.flax_variable_tensors(): the module is sharded (torchside.shard), so its "
        f"tensors are DTensors whose local pieces are this rank's shards; a jax_function "
        f"would compute with the shards as if they were the block's parameters. Use it on "
        f"an unsharded FlaxModule, or compute the loss inside the Flax block, where the "
        f"sharded call's first-order backward reaches it."
    )


def per_sample_unsupported(where: str, what: str) -> NotImplementedError:
    """Opacus's per-sample gradients of a call they cannot be computed for."""
    return NotImplementedError(
        f"{where} under Opacus: per-sample gradients of a block with {what} are not "
        f"supported: they are computed sample by sample from the first output's gradient "
        f"alone, without the forward's RNG key or its state updates. Use a block with one "
        f"output and no dropout or batch statistics (or call it in eval() mode)."
    )


def per_sample_state(where: str, names: list) -> str:
    """Opacus's validator: a FlaxModule that holds state besides parameters."""
    return (
        f"{where} holds state besides parameters ({', '.join(names)}): a train-mode call "
        f"updates it from the whole batch (batch statistics), so per-sample gradients "
        f"through it are not per sample. Use a normalization without batch statistics "
        f"(nn.LayerNorm, nn.GroupNorm) for differential privacy."
    )
