"""Converting single tensors and arrays (and pytrees of them) between torch and JAX.

The user-facing functions; a call of a compiled block uses ``_exchange`` directly. Both
share memory where JAX can use it in place (see NOTE [Exchange] in ``_exchange.py``).
"""

from __future__ import annotations

import jax
import torch

from bridge import _devices, _dtypes
from bridge._exchange import cpu_tensor, cpu_view, is_zero_copy
from bridge._rules import ALIGNMENT, check_memory


def _named(function: str, check, *args, **kwargs):
    """``check(*args, **kwargs)``, its error naming ``function`` (the one the user called)."""
    try:
        return check(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{function}: {e}") from None


def to_jax(tensor: torch.Tensor, *, copy: bool | None = None, name: str = "tensor") -> jax.Array:
    """A JAX array holding the values of a torch tensor, sharing its memory when possible.

    Tensors that require grad are detached (JAX gets the values, not the graph). Compact,
    64-byte aligned tensors are shared without a copy: writing to the tensor afterwards
    changes the array. Others (transposed, sliced, expanded, unaligned, with a lazy
    conjugate or negative bit) are copied once. The tensor's storage stays resizable.

    Args:
        tensor: a torch tensor on cpu or cuda.
        copy: ``None`` shares memory where possible and copies otherwise; ``False`` raises
            instead of copying; ``True`` always copies.
        name: the argument name used in error messages.

    Returns:
        A ``jax.Array`` on the JAX device matching ``tensor.device``.

    Raises:
        TypeError: not a tensor, a dtype JAX cannot hold exactly (64-bit without x64), or
            a tensor subclass without memory of its own (a DTensor).
        ValueError: ``copy=False`` but the memory cannot be shared, or an unmapped device.

    Example:
        >>> t = torch.arange(4, dtype=torch.float32)
        >>> to_jax(t).unsafe_buffer_pointer() == t.data_ptr()
        True
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"to_jax: argument '{name}' must be a torch.Tensor, got {type(tensor).__name__}."
        )
    _named("to_jax", _dtypes.numpy_dtype, tensor.dtype, name=name)
    device = _named("to_jax", _devices.jax_device, tensor.device, name=name)
    check_memory(tensor, f"argument '{name}'")
    if copy is False and not is_zero_copy(tensor):
        if not tensor.is_contiguous():
            reason = "not contiguous (transposed, sliced or expanded)"
        elif tensor.is_conj() or tensor.is_neg():
            reason = "a lazy conjugate or negative view (its memory holds other values)"
        else:
            reason = f"at an address not aligned to {ALIGNMENT} bytes"
        raise ValueError(
            f"to_jax: argument '{name}' (shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}) is {reason}, so JAX cannot share its memory and copy=False "
            f"forbids a copy. Pass {name}.contiguous().clone() or use copy=None."
        )
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        view = cpu_view(tensor)
        if copy:
            view = view.copy()
        return jax.device_put(view, device)
    if copy:
        tensor = tensor.clone()
    tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    # __dlpack__ protocol: JAX passes its stream, torch orders its pending work before it.
    return jax.dlpack.from_dlpack(tensor)


def to_torch(array: jax.Array, *, copy: bool | None = None, name: str = "array") -> torch.Tensor:
    """A torch tensor over a JAX array's memory, without copying unless asked to.

    Waits until the array is computed (JAX dispatch is asynchronous), so torch never reads
    memory JAX has not written yet.

    Args:
        array: a JAX array on one CPU or GPU device.
        copy: ``True`` returns a tensor with its own memory; otherwise the memory is shared.
        name: the argument name used in error messages.

    Returns:
        A torch tensor on the matching device with the exact dtype.

    Raises:
        TypeError: not a JAX array, or a dtype torch cannot hold.
        ValueError: the array spans several devices.

    Example:
        >>> a = jax.numpy.arange(4.0)
        >>> to_torch(a).data_ptr() == a.unsafe_buffer_pointer()
        True
    """
    if not isinstance(array, jax.Array):
        raise TypeError(f"to_torch: argument '{name}' must be a jax.Array, got {type(array)}.")
    _named("to_torch", _dtypes.torch_dtype, array.dtype, name=name)
    devices = array.devices()
    if len(devices) != 1:
        raise ValueError(
            f"to_torch: argument '{name}' is spread over {len(devices)} devices; gather it "
            f"onto one first, e.g. jax.device_put(x, jax.devices()[0])."
        )
    (device,) = devices
    if _named("to_torch", _devices.torch_device, device).type == "cpu":
        array.block_until_ready()
        out = cpu_tensor(array)
    else:
        out = torch.from_dlpack(array)
    return out.clone() if copy else out


def _map_tree(tree, kind: type, convert, copy):
    """``convert`` on every leaf of type ``kind``, named by its path; others as they are."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [convert(leaf, copy=copy, name=jax.tree_util.keystr(path) or "tree")
              if isinstance(leaf, kind) else leaf for path, leaf in paths]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def tree_to_jax(tree, *, copy: bool | None = None):
    """``to_jax`` on every torch tensor in a pytree; other leaves are left as they are.

    Example:
        >>> tree_to_jax({"x": torch.ones(2), "n": 3})["n"]
        3
    """
    return _map_tree(tree, torch.Tensor, to_jax, copy)


def tree_to_torch(tree, *, copy: bool | None = None):
    """``to_torch`` on every JAX array in a pytree; other leaves are left as they are.

    Example:
        >>> tree_to_torch({"x": jax.numpy.ones(2)})["x"].dtype
        torch.float32
    """
    jax.block_until_ready([x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)])
    return _map_tree(tree, jax.Array, to_torch, copy)
