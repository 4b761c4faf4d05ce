"""Which ``jax.checkpoint_policies`` keep their meaning under ``jax_remat3``.

JAX's next remat (``jax_remat3``, off by default) reads policies as data: it recognises some
and recomputes everything for the others. ``remat_stack(policy=...)`` and the parity tests
hand JAX these policies, so docs/design.md ("JAX's remat3") says which keep their meaning;
this test is where that list comes from. For each policy it compares, on one function with
matmuls (one with a batch dimension), elementwise ops and a named value, what
``jax.checkpoint`` saves with remat3 on against what it saves with remat3 off (the
reference): the same for the policies listed as kept, less for the others. A JAX release
that changes either list fails here, naming the policy.
"""

import contextlib
import io

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

if "jax_remat3" not in jax.config.values:
    pytest.skip(f"jax {jax.__version__} has no jax_remat3 (new in 0.10.2)",
                allow_module_level=True)

cp = jax.checkpoint_policies

# What docs/design.md lists, measured with jax 0.10.2.
KEPT = {
    "nothing_saveable": cp.nothing_saveable,
    "dots_saveable": cp.dots_saveable,
    "dots_with_no_batch_dims_saveable": cp.dots_with_no_batch_dims_saveable,
    "save_only_these_names": cp.save_only_these_names("h"),
    "save_any_names_but_these": cp.save_any_names_but_these(),
}
CHANGED = {  # remat3 saves less: named values only, or nothing
    "everything_saveable": cp.everything_saveable,
    "save_anything_except_these_names": cp.save_anything_except_these_names("h"),
    "save_from_both_policies": cp.save_from_both_policies(cp.dots_saveable,
                                                          cp.save_only_these_names("h")),
    "a callable of your own": lambda prim, *args, **params: True,
}


def _f(w, x):
    h = checkpoint_name(jnp.sin(x @ w), "h")
    batched = jnp.einsum("bi,bj->bij", h, h).sum(0)  # a matmul with a batch dimension
    return (jnp.sin(h @ w) @ batched).sum()


def _saved(policy, remat3: bool) -> list[str]:
    """What ``jax.checkpoint(_f, policy=policy)`` keeps for its backward, arguments aside."""
    previous = jax.config.jax_remat3
    jax.config.update("jax_remat3", remat3)
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(jax.checkpoint(_f, policy=policy), jnp.ones((4, 4)),
                                  jnp.ones((2, 4)))
    finally:
        jax.config.update("jax_remat3", previous)
    # "f32[2,4] output of sin from FILE:LINE (fn)": the shape and what made it.
    return sorted(" ".join(line.split(" from ")[0].split()) for line in
                  out.getvalue().splitlines() if line.strip() and "argument" not in line)


@pytest.mark.parametrize("name", list(KEPT))
def test_these_policies_keep_their_meaning_under_remat3(name):
    reference = _saved(KEPT[name], remat3=False)
    assert _saved(KEPT[name], remat3=True) == reference, name


@pytest.mark.parametrize("name", list(CHANGED))
def test_these_policies_save_less_under_remat3(name):
    reference, got = _saved(CHANGED[name], remat3=False), _saved(CHANGED[name], remat3=True)
    assert reference, f"{name}: saves nothing without remat3 either: no difference to see"
    assert set(got) < set(reference), (name, got, reference)
    assert all("named 'h'" in r for r in got), (name, got)  # at most the named value
