"""``jax.checkpoint`` (and every documented option) inside functions wrapped by jax_function.

The examples follow the docstring of ``jax.checkpoint`` (``jax/_src/ad_checkpoint.py``,
jax 0.10.2) and the policies in ``jax.checkpoint_policies``, in our own code. Each runs
through ``jax_function`` and is compared with ``jax.vjp`` of the same function, and where
the option is about what is saved, with the undecorated function too (the same math).
"""

import functools as ft

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.ad_checkpoint import checkpoint_name

from tests.support import pipeline
from tests.support.corpus_helpers import check_function, covers
from tests.support.docstring_models import deep_checkpointed, deep_plain
from torchside import jax_function

P = jax.checkpoint_policies
needs_remat3 = pytest.mark.skipif(
    not hasattr(jax.config, "jax_remat3"), reason=f"jax {jax.__version__}: jax.checkpoint's "
    "static_argnames= and the jax_remat3 flag are new in jax 0.10.2 (issue 17)")


# jax.checkpoint docstring: the first example, g = sin . sin.
def g_plain(x):
    return jnp.sin(jnp.sin(x))


@covers("jax.checkpoint", "docstring g(x) = sin(sin(x))")
def test_checkpoint_docstring_g():
    x = torch.randn(5)
    check_function(jax.checkpoint(g_plain), (x,))
    check_function(jax.checkpoint(g_plain), (x,), reference=g_plain)  # the same math


def mlp(x, w1, w2):
    h = checkpoint_name(jnp.tanh(x @ w1), "hidden")
    return jnp.sin(h @ w2) * checkpoint_name(jnp.cos(h).sum(-1, keepdims=True), "gate")


def _mlp_args():
    return torch.randn(4, 6), torch.randn(6, 8) / 3, torch.randn(8, 3) / 3


POLICY_CASES = {
    "everything_saveable": P.everything_saveable,
    "nothing_saveable": P.nothing_saveable,
    "dots_saveable": P.dots_saveable,
    "dots_with_no_batch_dims_saveable": P.dots_with_no_batch_dims_saveable,
    "save_only_these_names": P.save_only_these_names("hidden"),
    "save_anything_except_these_names": P.save_anything_except_these_names("hidden"),
    "save_any_names_but_these": P.save_any_names_but_these("gate"),
    "save_from_both_policies": P.save_from_both_policies(
        P.dots_saveable, P.save_only_these_names("gate")),
    "offload_dot_with_no_batch_dims": P.offload_dot_with_no_batch_dims(
        "device", "pinned_host"),
    "save_and_offload_only_these_names": P.save_and_offload_only_these_names(
        names_which_can_be_saved=["gate"], names_which_can_be_offloaded=["hidden"],
        offload_src="device", offload_dst="pinned_host"),
}


@covers("jax.checkpoint", *(f"policy=checkpoint_policies.{n}" for n in POLICY_CASES))
@pytest.mark.parametrize("policy", list(POLICY_CASES), ids=list(POLICY_CASES))
def test_checkpoint_policy(policy):
    fn = jax.checkpoint(mlp, policy=POLICY_CASES[policy])
    check_function(fn, _mlp_args(), reference=mlp)


def _residual_bytes(fn, args):
    wrapped = jax_function(fn)
    wrapped(*[a.requires_grad_() for a in args])
    specs = pipeline.residual_map(wrapped).residual_specs
    return sum(s.aval.size * s.dtype.itemsize for s in specs)


def test_policy_decides_what_the_bridge_holds():
    # The bridge holds exactly what the policy keeps: less with nothing_saveable than
    # with everything_saveable, and no more than without checkpointing.
    held = {name: _residual_bytes(fn, _mlp_args()) for name, fn in [
        ("none", mlp),
        ("everything", jax.checkpoint(mlp, policy=P.everything_saveable)),
        ("nothing", jax.checkpoint(mlp, policy=P.nothing_saveable)),
    ]}
    assert held["nothing"] < held["everything"] <= held["none"], held


@covers("jax.checkpoint", "prevent_cse=False", "prevent_cse as a tuple of bools")
@pytest.mark.parametrize("prevent_cse", [False, (True, False, False)],
                         ids=["false", "per-argument"])
def test_checkpoint_prevent_cse(prevent_cse):
    fn = jax.checkpoint(mlp, prevent_cse=prevent_cse)
    check_function(fn, _mlp_args(), reference=mlp)


# jax.checkpoint docstring: static_argnums for Python control flow on a flag.
@ft.partial(jax.checkpoint, static_argnums=(1,))
def foo(x, is_training):
    if is_training:
        return jnp.sin(x) * 2.0
    return jnp.cos(x)


# jax.checkpoint docstring: static_argnums with jax.ensure_compile_time_eval.
@ft.partial(jax.checkpoint, static_argnums=(1,))
def foo_with_eval(x, y):
    with jax.ensure_compile_time_eval():
        y_pos = y > 0
    if y_pos:
        return jnp.sin(x) * y
    return jnp.cos(x) * y


def by_name(x, mode):
    return jnp.tanh(x) if mode == "tanh" else jnp.sin(x)


@covers("jax.checkpoint", "static_argnums= (a Python flag)",
        "static_argnums= with ensure_compile_time_eval")
@pytest.mark.parametrize(
    ("fn", "static"),
    [(foo, True), (foo, False), (foo_with_eval, 2.0), (foo_with_eval, -1.5)],
    ids=["flag-true", "flag-false", "eval-pos", "eval-neg"],
)
def test_checkpoint_static_argnums(fn, static):
    checked = check_function(fn, (torch.randn(5), static))
    assert len(pipeline.entries(checked.wrapped)) == 1  # non-tensor arguments are static


def _remat3(on: bool):
    before = jax.config.jax_remat3
    jax.config.update("jax_remat3", on)
    yield
    jax.config.update("jax_remat3", before)


@pytest.fixture
def remat3():
    """JAX's experimental remat implementation, for this test only."""
    yield from _remat3(True)


@pytest.fixture
def remat3_off():
    """JAX's default remat, for this test only (CI also runs the suite with remat3 on)."""
    yield from _remat3(False)


@covers("jax.checkpoint", "static_argnames= (default jax config)", result="error",
        note="jax 0.10.2 honours static_argnames only under the experimental jax_remat3 "
             "flag; without it pure JAX raises the TypeError the bridge passes on")
@needs_remat3
def test_checkpoint_static_argnames_needs_remat3(remat3_off):
    fn = jax.checkpoint(by_name, static_argnames=("mode",))
    with pytest.raises(TypeError, match="'tanh' of type <class 'str'> is not a valid JAX"):
        fn(jnp.ones(5), mode="tanh")  # pure JAX
    with pytest.raises(TypeError, match="'tanh' of type <class 'str'> is not a valid JAX"):
        jax_function(fn)(torch.randn(5), mode="tanh")


@covers("jax.checkpoint", "static_argnames= (jax_remat3 on)", "policy= (jax_remat3 on)")
@pytest.mark.parametrize("case", ["static_argnames", "policy"])
@needs_remat3
def test_checkpoint_under_remat3(remat3, case):
    if case == "static_argnames":
        fn = jax.checkpoint(by_name, static_argnames=("mode",))
        for mode in ("tanh", "sin"):
            check_function(fn, (torch.randn(5),), {"mode": mode}, reference=by_name)
    else:
        fn = jax.checkpoint(mlp, policy=P.save_only_these_names("hidden"))
        check_function(fn, _mlp_args(), reference=mlp)


@covers("jax.checkpoint", "recursive_checkpoint (docstring), 7 layers")
def test_recursive_checkpoint():
    ws = [torch.randn(4, 4) / 2 for _ in range(7)]
    # The docstring's recursive_checkpoint, shared with brainstate's copy of it.
    check_function(deep_checkpointed(jax.checkpoint), (torch.randn(3, 4), ws),
                   reference=deep_plain)
