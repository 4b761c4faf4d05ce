"""``flaxside``'s ``summed_squares``: each sample's sum of squares, summed where computed.

Fast gradient clipping (Opacus's ghost mode) needs each sample's gradient norm only. The
per-sample VJP of a scanned block stacks every sample's gradient of every layer; reducing
that stack afterwards stores all of them as XLA temporaries. ``summed_squares`` moves the
reduction into the scans, checkpoints, nested ``jit`` and transposes that make each output
(NOTE [Summed squares] in ``flaxside/derivatives/_summed_squares.py``). Each case is compared
with the sums of the outputs as ``f`` returns them; the memory case also with the compiled
program's temporaries of that reference, which store every per-sample gradient.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from flaxside import jaxprs
from flaxside.derivatives._functions import _moved_axes
from flaxside.derivatives._summed_squares import squares, summed_squares
from tests.support.closeness import close
from tests.support.twins import ReadmeBlock, ReadmeDeep

WIDTH, BATCH = 32, 6


class _Scanned(nn.Module):
    """``nn.scan`` of ``ReadmeBlock`` (no remat): the VJP's scan body returns each layer's
    per-sample gradients directly."""

    depth: int = 4

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(lambda block, carry, _: (block(carry), None),
                        variable_axes={"params": 0}, split_rngs={"params": True},
                        length=self.depth)
        return stack(ReadmeBlock(WIDTH, name="stack"), x, None)[0]


def _per_sample_grads(block, x_shape=(BATCH, WIDTH), c_shape=(BATCH, WIDTH), seed=3):
    """``(g, args, axes)``: ``g(params, x, c)`` each sample's parameter gradients (a flat
    list), batched where the batched VJP computes them (``axes``, behind the layer axes
    for stacked leaves), on random arguments ``x`` and cotangents ``c`` of these shapes."""
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], x_shape)
    c = jax.random.normal(k[1], c_shape)
    params = block.init(k[2], x[:1])

    def one(p, x, c):
        _, vjp = jax.vjp(lambda p: block.apply(p, x[None]), p)
        return jax.tree_util.tree_leaves(vjp(c[None])[0])

    axes = _moved_axes(jax.make_jaxpr(jax.vmap(one, in_axes=(None, 0, 0)))(
        params, x[:2], c[:2]).jaxpr)
    return jax.vmap(one, in_axes=(None, 0, 0), out_axes=list(axes)), [params, x, c], axes


def _stacked_bytes(f, args) -> int:
    """The bytes the scans in ``f``'s jaxpr stack (their ``ys``), at any depth."""
    return sum(v.aval.size * v.aval.dtype.itemsize
               for e in jaxprs.walk(jax.make_jaxpr(f)(*args).jaxpr, deep=True)
               if e.primitive.name == "scan" for v in e.outvars[e.params["num_carry"]:])


def _check(f, args, axes, moved: bool | None = None) -> list:
    """``summed_squares(f, args, axes)`` against the sums of ``f``'s outputs; the sums.

    ``moved``: whether the sums are taken inside the scans (they stack fewer bytes than
    ``f``'s: the sums, not the values), or left after them (the same bytes); ``None``: not
    asked. Value checks alone pass with nothing moved (mutation: ``_evaluate`` with
    ``moves = {}``, every output reduced after the fact).
    """
    got = jax.jit(lambda *a: summed_squares(f, list(a), axes)[0])(*args)
    if moved is not None:
        ours = _stacked_bytes(lambda *a: summed_squares(f, list(a), axes)[0], args)
        theirs = _stacked_bytes(f, args)
        assert (ours < theirs) if moved else (ours == theirs), (ours, theirs)
    avals = summed_squares(f, list(args), axes)[1]
    outs = f(*args)
    assert [(a.shape, a.dtype) for a in avals] == [(o.shape, o.dtype) for o in outs]
    for k, (s, out, axis) in enumerate(zip(got, outs, axes, strict=True)):
        wide = np.asarray(out.astype(jnp.promote_types(out.dtype, jnp.float32)))
        want = (np.abs(wide) ** 2).sum(axis=tuple(a for a in range(out.ndim) if a != axis))
        assert s.dtype == jnp.promote_types(jnp.finfo(out.dtype).dtype, jnp.float32), (k, s.dtype)
        # Each layer's sums added up: the order of a float32 sum differs, nothing else. The
        # sums kept on the next axis instead (a layer axis read as the batch) must fail.
        other = (np.abs(wide) ** 2).sum(axis=tuple(a for a in range(out.ndim)
                                                   if a != (axis + 1) % out.ndim))
        close(torch.from_numpy(np.array(s)), want, f"output {k}",
              wrong=[other] if other.shape == want.shape else [])
    return got


def _two_temporaries(g, args, axes) -> tuple[int, int]:
    """The compiled temporaries of ``g``'s sums taken by ``summed_squares``, and after ``g``."""
    ours = _temporaries(g, args, axes)
    after = jax.jit(lambda *a: [squares(x, k) for x, k in zip(g(*a), axes, strict=True)]
                    ).lower(*args).compile().memory_analysis().temp_size_in_bytes
    return ours, after


@pytest.mark.parametrize(("make", "depth"), [(lambda k: ReadmeDeep(WIDTH, (2, 3 * k)), 6),
                                             (lambda k: _Scanned(4 * k), 4)],
                         ids=["nn.remat_scan", "nn.scan"])
def test_stacked_per_sample_gradients_are_never_stored(make, depth):
    """A scanned block's per-sample gradient sums equal the stored gradients' sums, and the
    compiled program's temporaries grow with the depth by what the backward holds per
    layer only: twice as deep, by less than a quarter of one layer's per-sample gradients
    per added layer, where the reduction after the fact stores every layer's and grows by
    at least half of them (the negative control). Growth, with a loose bound on one depth
    (two layers' gradients): what XLA keeps besides (the backward's residuals, one layer's
    gradient where it does not fuse the product into its sum) differs between releases:
    for ``nn.scan`` jax 0.8.1 keeps a little more than one layer's, jax 0.10 less."""
    g, args, axes = _per_sample_grads(make(1))
    assert any(a > 0 for a in axes), axes  # stacked leaves: the batch behind a layer axis
    _check(g, args, axes)
    layer = sum(a.size * a.dtype.itemsize for a in jax.eval_shape(g, *args)) / depth
    ours, after = _two_temporaries(g, args, axes)
    ours_deeper, after_deeper = _two_temporaries(*_per_sample_grads(make(2)))
    assert after_deeper - after > depth * layer / 2, (after, after_deeper, layer)
    assert ours_deeper - ours < depth * layer / 4, (ours, ours_deeper, layer)
    assert ours < 2 * layer, (ours, layer)


def _temporaries(f, args, axes) -> int:
    return jax.jit(lambda *a: summed_squares(f, list(a), axes)[0]).lower(
        *args).compile().memory_analysis().temp_size_in_bytes


def test_through_a_nested_jit_and_a_transpose():
    """Through a nested ``jit`` and a ``transpose`` of a stacked output: equal sums, and the
    stacked per-sample gradients still never stored."""
    g, args, axes = _per_sample_grads(ReadmeDeep(WIDTH, (2, 3)))
    inner = jax.jit(g)
    stacked = [k for k, a in enumerate(axes) if a > 0][0]

    def f(*a):
        outs = inner(*a)
        return [*outs[:stacked], jnp.moveaxis(outs[stacked], axes[stacked], -1),
                *outs[stacked + 1 :]]

    ndim = jax.eval_shape(g, *args)[stacked].ndim
    out_axes = (*axes[:stacked], ndim - 1, *axes[stacked + 1 :])
    _check(f, args, out_axes)
    stored = sum(a.size * a.dtype.itemsize for a in jax.eval_shape(g, *args))
    # Two of its six layers' per-sample gradients at most (as in the test above), where
    # reducing after the fact stores more than half of them all.
    assert _temporaries(f, args, out_axes) < 2 * stored / 6


def test_a_value_read_twice_is_reduced_where_it_is():
    """A stacked output also read elsewhere (returned whole, on another axis, or summed
    over its layers) is computed as it was and reduced where it is; so is a transpose's
    operand read elsewhere, which the transpose's sum cannot stand for."""
    xs = jax.random.normal(jax.random.key(0), (4, BATCH, WIDTH))

    def stacked(xs):
        return jax.lax.scan(lambda c, x: (c, jnp.sin(x) * 2.0), 0.0, xs)[1]

    _check(lambda xs: [stacked(xs), stacked(xs)], [xs], (1, 2))
    _check(lambda xs: (lambda y: [y, y.sum(0)])(stacked(xs)), [xs], (1, 0))
    _check(lambda xs: (lambda y: [jnp.transpose(y, (1, 0, 2)), y.sum(0)])(stacked(xs)),
           [xs], (0, 0))
    _check(lambda xs: (lambda y: [jnp.transpose(y, (1, 0, 2)), y])(stacked(xs)), [xs], (0, 2))


def _loop(xs, **kw):
    return jax.lax.scan(lambda c, x: (c + x.sum(), jnp.sin(x) * c), 1.0, xs, **kw)


def test_a_closed_call():
    """The primal output of a checkpointed scan under ``vjp``: JAX stages the known loop as
    a ``closed_call`` (without remat3), its sums moved in."""
    xs = jax.random.normal(jax.random.key(0), (4, BATCH, WIDTH))

    def f(xs):
        (_, ys), vjp = jax.vjp(jax.checkpoint(_loop), xs)
        return [ys, vjp((1.0, jnp.ones_like(ys)))[0]]

    if not any(e.primitive.name == "closed_call" for e in jax.make_jaxpr(f)(xs).jaxpr.eqns):
        pytest.skip("this JAX stages no closed_call here (jax_remat3 on)")
    _check(f, [xs], (1, 1), moved=True)


def test_a_reversed_scan_unrolled_by_two():
    xs = jax.random.normal(jax.random.key(0), (4, BATCH, WIDTH))
    _check(lambda xs: [_loop(xs, reverse=True, unroll=2)[1]], [xs], (1,), moved=True)


def test_batch_on_the_scanned_axis_is_left_to_the_sum_after():
    """A scan whose stacked axis is the batch (a loop over the samples) cannot sum inside
    its body: its output is reduced after the loop, still per sample."""
    w = jax.random.normal(jax.random.key(1), (WIDTH, WIDTH))

    def f(x):
        def body(carry, xi):
            y = jnp.tanh(xi @ w)
            return carry + y.sum(), jnp.outer(y, xi)

        return [jax.lax.scan(body, 0.0, x)[1]]

    _check(f, [jax.random.normal(jax.random.key(2), (BATCH, WIDTH))], (0,), moved=False)


def test_a_complex_output_sums_its_squared_moduli():
    """A complex output's ``|z| ** 2``, summed in its real dtype."""
    k = jax.random.split(jax.random.key(4), 2)
    w = jax.random.normal(k[0], (3, WIDTH, WIDTH)).astype(jnp.complex64) * (1 + 1j) / 4
    x = jax.random.normal(k[1], (BATCH, WIDTH)).astype(jnp.complex64)

    def f(x):
        def body(h, wl):
            h = h @ wl
            return h, h[:, :, None] * h[:, None, :]

        return [jax.lax.scan(body, x, w)[1]]

    _check(f, [x], (1,), moved=True)


def test_a_bfloat16_output_sums_in_float32():
    """A bfloat16 output's squares summed in float32 (as ``torch.linalg.vector_norm``): the
    same as the stored output's float32 sums up to each product's bfloat16 rounding (XLA
    may skip it where the product is fused into the sum), and far from a sum accumulated in
    bfloat16 (the negative control)."""
    xs = jax.random.normal(jax.random.key(4), (3, BATCH, WIDTH)).astype(jnp.bfloat16)

    def f(xs):
        return [jax.lax.scan(lambda c, x: (c, x[:, :, None] * x[:, None, :]), 0.0, xs)[1]]

    (got,) = jax.jit(lambda xs: summed_squares(f, [xs], (1,))[0])(xs)
    assert got.dtype == jnp.float32
    assert _stacked_bytes(lambda xs: summed_squares(f, [xs], (1,))[0], [xs]) < _stacked_bytes(
        f, [xs])  # the sums moved into the scan (mutation: nothing moved)
    out = np.asarray(f(xs)[0].astype(jnp.float32))
    terms = np.moveaxis(out, 1, 0).reshape(BATCH, -1) ** 2
    in_bf16 = np.zeros(BATCH, jnp.bfloat16)
    for column in terms.T:
        in_bf16 = (in_bf16 + column.astype(jnp.bfloat16)).astype(jnp.bfloat16)
    assert np.allclose(got, terms.sum(1), rtol=2.0 ** -8)
    assert not np.allclose(in_bf16.astype(np.float32), terms.sum(1), rtol=2.0 ** -8)


def _dense_grads(rows: int, width_in: int, width_out: int):
    """``_per_sample_grads`` of a ``Dense`` layer, each sample ``rows`` positions (0: a
    vector)."""
    rows = () if rows == 0 else (rows,)
    return _per_sample_grads(nn.Dense(width_out), (BATCH, *rows, width_in),
                             (BATCH, *rows, width_out), seed=5)


def _products(f, args) -> list:
    """The output shapes of the ``dot_general``s in ``f``'s jaxpr, at any depth, sorted."""
    return [tuple(sorted(e.outvars[0].aval.shape))
            for e in jaxprs.walk(jax.make_jaxpr(f)(*args).jaxpr, deep=True)
            if e.primitive.name == "dot_general"]


@pytest.mark.parametrize(("rows", "formed"), [(0, False), (3, False), (96, True)],
                         ids=["vector", "sequence", "long-sequence"])
def test_a_layers_product_is_summed_from_its_operands_grams(rows, formed):
    """NOTE [Ghost norms]: a ``Dense`` layer's per-sample kernel gradient summed from the
    Gram matrices of its activations and backprops, equal to the formed gradient's sums;
    the ``(batch, in, out)`` product is never formed where its Grams cost fewer operations
    (a vector input, a short sequence), and formed where they cost more (96 positions of
    width 32 and 24). Mutation: ``_ghost_pays`` always false (the product formed), or
    always true (the Grams of the long sequence, larger than the product)."""
    g, args, axes = _dense_grads(rows, WIDTH, 24)
    _check(g, args, axes)
    product = tuple(sorted((BATCH, WIDTH, 24)))  # in any order of its axes
    ours = _products(lambda *a: summed_squares(g, list(a), axes)[0], args)
    assert (product in ours) == formed, ours
    assert product in _products(lambda *a: summed_squares(g, list(a), axes, ghost=False)[0],
                                args)  # the control: without the rule, formed


def test_ghost_norms_inside_a_scanned_block_and_in_float64():
    """The rule inside ``nn.remat_scan``'s layers (each layer's kernels, width 32 by 64,
    summed by their Grams in the scan's body, never formed per sample), and in float64,
    where the Grams stay float64."""
    g, args, axes = _per_sample_grads(ReadmeDeep(WIDTH, (2, 3)))
    _check(g, args, axes)
    kernel = tuple(sorted((BATCH, WIDTH, 2 * WIDTH)))  # a layer's per-sample kernel gradient
    assert kernel not in _products(lambda *a: summed_squares(g, list(a), axes)[0], args)
    assert kernel in _products(  # the control: formed without the rule
        lambda *a: summed_squares(g, list(a), axes, ghost=False)[0], args)
    with jax.enable_x64(True):
        g, args, axes = _dense_grads(0, WIDTH, 24)
        args = [jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), a) for a in args]
        assert tuple(sorted((BATCH, WIDTH, 24))) not in _products(
            lambda *a: summed_squares(g, list(a), axes)[0], args)
        assert _check(g, args, axes)[0].dtype == jnp.float64
