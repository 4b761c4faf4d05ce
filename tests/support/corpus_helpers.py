"""Checks a wrapped module or function against pure JAX, and records what the corpus covers.

The corpus tests (``tests/corpus/``) reproduce the examples in the docstrings of
Flax's lifted transforms and ``jax.checkpoint``. Each runs the example once through the
bridge and once as pure JAX on the same variables and inputs, and compares:

* outputs;
* the gradient of every parameter and every floating input, pulled with a random
  cotangent (never ``.sum()`` alone, which hides transposes);
* the state collections the bridge writes back after a training-mode forward.

``covers`` tags a test with the rows it backs in the coverage table of ``docs/coverage.md``;
``tests/corpus/test_table.py`` renders the table from those tags and checks that file.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from torchside import FlaxModule, jax_function

jtu = jax.tree_util

RESULTS = ("works", "forward only", "error", "bridge bug")

# Where the reference runs: None leaves it to JAX's default device; ``reference_on`` pins it
# (tests/devices/cases.py, where JAX's default device is not the tensors').
_REFERENCE_DEVICE = None


@contextlib.contextmanager
def reference_on(device):
    """Computes every reference inside on ``device`` (and checks that it did)."""
    global _REFERENCE_DEVICE
    previous, _REFERENCE_DEVICE = _REFERENCE_DEVICE, device
    try:
        yield
    finally:
        _REFERENCE_DEVICE = previous


# -- coverage tags ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the coverage table (``docs/coverage.md``).

    ``test`` is the pytest node id of the test that backs it.
    """

    transform: str
    option: str
    result: str
    note: str
    test: str


def covers(transform: str, *options: str, result: str = "works", note: str = ""):
    """Tags a test with the coverage table's rows it backs: one row per option.

    ``result`` is what the test asserts: ``"works"`` (equal to pure JAX), ``"forward only"``
    (forward and state equal; a backward raises a clear error), ``"error"`` (a clear error,
    as pure JAX gives) or ``"bridge bug"`` (a strict xfail that documents our bug).
    """
    if result not in RESULTS:
        raise ValueError(f"covers: result={result!r} is not one of {RESULTS}")

    def tag(fn):
        rows = getattr(fn, "corpus_rows", ())
        fn.corpus_rows = rows + tuple(
            Row(transform, o, result, note, f"{fn.__module__.replace('.', '/')}.py::{fn.__name__}")
            for o in options
        )
        return fn

    return tag


# -- conversions -----------------------------------------------------------------------
def to_jax(t):
    """A JAX copy of a tensor (the reference never shares memory with the bridge)."""
    values = np.array(t.detach().cpu().numpy())
    if _REFERENCE_DEVICE is not None:
        return jax.device_put(values, _REFERENCE_DEVICE)
    return jnp.asarray(values)


def _dotted(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    if parts and parts[-1] == "value":  # nnx.Variable's own attribute
        parts = parts[:-1]
    return ".".join(parts)


def by_name(tree) -> dict:
    """``{dotted path: leaf}`` in the naming FlaxModule uses for its state_dict."""
    return {_dotted(p): leaf for p, leaf in jtu.tree_flatten_with_path(tree)[0]}


def _assert_tree_close(actual, expected, what: str, **tol):
    a_leaves, a_def = jtu.tree_flatten(actual)
    e_leaves, e_def = jtu.tree_flatten(expected)
    assert a_def == e_def, f"{what}: structure {a_def} != {e_def}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        # The device was checked where the call ran; the values are compared on the CPU.
        torch.testing.assert_close(a.detach().cpu(), torch.from_numpy(np.array(e)),
                                   msg=lambda m, i=i: f"{what} leaf {i}: {m}", **tol)


def _cotangents(outs):
    """Random torch cotangents for float outputs that carry grad; None elsewhere."""
    return [torch.randn_like(o) if o.requires_grad and o.is_floating_point() else None
            for o in jtu.tree_leaves(outs)]


def _pull(outs, cts) -> bool:
    terms = [(o * c).sum() for o, c in zip(jtu.tree_leaves(outs), cts, strict=True)
             if c is not None]
    if not terms:
        return False
    torch.stack(terms).sum().backward()
    return True


def _torch_inputs(args, grad: bool):
    """Clones tensor leaves; floating ones require grad when ``grad``."""
    def prep(a):
        if isinstance(a, torch.Tensor):
            a = a.detach().clone()
            return a.requires_grad_(grad and a.is_floating_point())
        return a
    return jtu.tree_map(prep, args)


def _reference(pure, consts, primals, outs, cts):
    """Pure JAX, jitted as a whole: ``(outputs, aux, grads of primals)``.

    ``pure(consts, *primals) -> (outputs, aux)``. The cotangent is the one torch pulled
    with: ``cts`` where given, zeros for other float outputs, float0 for integer ones.
    Constants and primals enter as flat leaves and are rebuilt inside the differentiated
    function, as the bridge does: an ``nnx.State`` rebuilt at an outer trace level holds
    Variables that NNX refuses to mutate at an inner one.
    """
    out_leaves = jtu.tree_leaves(outs)
    given = [to_jax(c) if c is not None else None for c in cts]
    slots = [(c is not None, tuple(o.shape), o.is_floating_point() or o.is_complex())
             for o, c in zip(out_leaves, cts, strict=True)]
    c_leaves, c_def = jtu.tree_flatten(consts)
    p_leaves, p_def = jtu.tree_flatten(list(primals))

    def inner(c_leaves, *p_leaves):
        return pure(jtu.tree_unflatten(c_def, c_leaves), *jtu.tree_unflatten(p_def, p_leaves))

    @jax.jit
    def run(c_leaves, p_leaves, given):
        out, vjp, aux = jax.vjp(lambda *p: inner(c_leaves, *p), *p_leaves, has_aux=True)
        leaves, treedef = jtu.tree_flatten(out)
        full = []
        for (has, shape, is_float), o, g in zip(slots, leaves, given, strict=True):
            if has:
                full.append(g)
            elif is_float:
                full.append(jnp.zeros(shape, o.dtype))
            else:
                full.append(np.zeros(shape, jax.dtypes.float0))
        return out, aux, list(vjp(jtu.tree_unflatten(treedef, full)))

    if _REFERENCE_DEVICE is not None:
        c_leaves, p_leaves, given = jax.device_put((c_leaves, p_leaves, given),
                                                   _REFERENCE_DEVICE)
    out, aux, grads = run(c_leaves, p_leaves, given)
    if _REFERENCE_DEVICE is not None:
        placed = {d for x in jtu.tree_leaves((out, aux, grads)) for d in x.devices()}
        assert placed <= {_REFERENCE_DEVICE}, f"the reference ran on {placed}"
    return out, aux, jtu.tree_unflatten(p_def, grads)


def _compare(wrapped, t_args, t_kwargs, pure, consts, params, param_names, tol):
    """Runs the bridge, then the reference, and compares outputs and every gradient."""
    leaves, treedef = jtu.tree_flatten((t_args, t_kwargs))
    diff = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor) and a.requires_grad]
    j_leaves = [to_jax(a) if isinstance(a, torch.Tensor) else a for a in leaves]
    outs = wrapped(*t_args, **t_kwargs)
    cts = _cotangents(outs)

    def with_inputs(consts, params, *diff_values):
        full = list(j_leaves)
        for i, v in zip(diff, diff_values, strict=True):
            full[i] = v
        a, k = jtu.tree_unflatten(treedef, full)
        return pure(consts, params, *a, **k)

    ref_out, aux, ref_grads = _reference(with_inputs, consts,
                                         [params, *[j_leaves[i] for i in diff]], outs, cts)
    _assert_tree_close(outs, ref_out, "output", **tol)
    named = dict(wrapped.named_parameters()) if hasattr(wrapped, "named_parameters") else {}
    if _pull(outs, cts):
        g_params = param_names(ref_grads[0])
        assert set(g_params) == set(named)
        for name, p in named.items():
            assert p.grad is not None, f"no gradient reached {name}"
            torch.testing.assert_close(p.grad.cpu(), torch.from_numpy(np.array(g_params[name])),
                                       msg=lambda m, n=name: f"grad of {n}: {m}", **tol)
        for i, g in zip(diff, ref_grads[1:], strict=True):
            torch.testing.assert_close(leaves[i].grad.cpu(), torch.from_numpy(np.array(g)),
                                       msg=lambda m, i=i: f"grad of input leaf {i}: {m}", **tol)
    return outs, ref_out, aux


def _compare_state(wrapped, expected: dict, tol):
    buffers = dict(wrapped.named_buffers())
    assert set(buffers) == set(expected), (set(buffers), set(expected))
    for name, b in buffers.items():
        want = np.array(expected[name])
        if want.dtype.kind == "u" and want.dtype.itemsize > 1:
            # torch holds unsigned 16/32/64-bit state as the signed dtype: the same bits.
            assert b.dtype.itemsize == want.dtype.itemsize and b.dtype.is_signed, name
            want = want.view(f"i{want.dtype.itemsize}")
        torch.testing.assert_close(b.cpu(), torch.from_numpy(want),
                                   msg=lambda m, n=name: f"state {n}: {m}", **tol)


# -- Linen -----------------------------------------------------------------------------
@dataclasses.dataclass
class Checked:
    """What a check ran, for tests that assert more (e.g. a counter's value)."""

    wrapped: object
    outputs: object
    reference: object
    state: dict  # updated non-parameter state by name, as the reference computed it
    initial: dict  # non-parameter state by name before the call


def check_linen(module, args, kwargs=None, *, init_args=None, init_kwargs=None,
                grad_inputs=True, train=True, tol=None, **options) -> Checked:
    """Runs ``module`` through ``FlaxModule`` and as ``module.apply``; asserts they agree.

    Args:
        module: the Linen module.
        args: positional arguments (torch tensors and static values).
        kwargs: keyword arguments.
        init_args, init_kwargs: for ``module.init`` if they differ from the call's.
        grad_inputs: whether floating inputs require grad (they are compared too).
        train: ``train()`` (non-params collections mutable, buffers written back) or
            ``eval()``.
        tol: ``dict(rtol=, atol=)`` for ``assert_close``; dtype defaults otherwise.
        **options: passed to ``FlaxModule``.
    """
    kwargs = dict(kwargs or {})
    tol = tol or {}
    wrapped = FlaxModule(module, example_args=init_args if init_args is not None else args,
                         example_kwargs=init_kwargs if init_kwargs is not None else kwargs,
                         **options)
    variables = jtu.tree_map(jnp.array, wrapped.flax_variables())  # our own copy
    initial = by_name({c: v for c, v in variables.items() if c != "params"})
    wrapped.train(train)
    cols = [c for c in variables if c != "params"] if train else []

    t_args, t_kwargs = _torch_inputs((tuple(args), kwargs), grad_inputs)

    def pure(rest, params, *a, **k):
        v = {**rest, "params": params}
        if cols:
            return module.apply(v, *a, mutable=cols, **k)
        return module.apply(v, *a, **k), {}

    rest = {c: v for c, v in variables.items() if c != "params"}
    outs, ref_out, updates = _compare(wrapped, t_args, t_kwargs, pure, rest,
                                      variables.get("params", {}),
                                      lambda g: by_name({"params": g}), tol)
    expected_state = by_name({**rest, **dict(updates)})
    _compare_state(wrapped, expected_state, tol)
    return Checked(wrapped, outs, ref_out, expected_state, initial)


# -- NNX -------------------------------------------------------------------------------
def _raw(x):
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def check_nnx(module: nnx.Module, args, kwargs=None, *, grad_inputs=True, train=True,
              tol=None, **options) -> Checked:
    """Runs an ``nnx.Module`` through ``FlaxModule`` and as merge/call/split; asserts they agree.

    The reference starts from the module's own state, before the bridge runs, and calls a
    module merged from it in the same mode; updated non-Param state (RNG counts, batch
    statistics, counters) is compared with the bridge's buffers after the forward.
    """
    kwargs = dict(kwargs or {})
    tol = tol or {}
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    wrapped = FlaxModule(module, **options)
    wrapped.train(train)

    t_args, t_kwargs = _torch_inputs((tuple(args), kwargs), grad_inputs)

    def pure(rest, params, *a, **k):
        model = nnx.merge(graphdef, params, rest)
        model.train() if train else model.eval()
        out = model(*a, **k)
        _, _, new_rest = nnx.split(model, nnx.Param, ...)
        return out, new_rest

    outs, ref_out, new_rest = _compare(wrapped, t_args, t_kwargs, pure, rest, params,
                                       by_name, tol)
    expected_state = {n: _raw(v) for n, v in by_name(new_rest if train else rest).items()}
    initial = {n: _raw(v) for n, v in by_name(rest).items()}
    _compare_state(wrapped, expected_state, tol)
    return Checked(wrapped, outs, ref_out, expected_state, initial)


# -- plain JAX -------------------------------------------------------------------------
def check_function(fn, args, kwargs=None, *, reference=None, tol=None, **options) -> Checked:
    """Runs ``fn`` through ``jax_function`` and ``jax.vjp``; asserts outputs and grads agree.

    Args:
        fn: the JAX function (e.g. one decorated with ``jax.checkpoint``).
        args, kwargs: torch tensors (floating ones get gradients) and static values.
        reference: the function the reference differentiates; ``fn`` itself by default.
            Pass the undecorated function to check a remat'd one against plain math.
    """
    kwargs = dict(kwargs or {})
    tol = tol or {}
    reference = reference or fn
    wrapped = jax_function(fn, **options)
    t_args, t_kwargs = _torch_inputs((tuple(args), kwargs), True)

    def pure(_consts, _params, *a, **k):
        return reference(*a, **k), ()

    outs, ref_out, _ = _compare(wrapped, t_args, t_kwargs, pure, (), {}, by_name, tol)
    assert any(t.grad is not None for t in jtu.tree_leaves((t_args, t_kwargs))
               if isinstance(t, torch.Tensor)), "no input received a gradient"
    return Checked(wrapped, outs, ref_out, {}, {})
