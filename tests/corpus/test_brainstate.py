"""``brainstate.transform.checkpoint`` / ``remat`` inside functions wrapped by jax_function.

The examples follow the docstring of ``brainstate.transform.checkpoint``
(``brainstate/transform/_grad_checkpoint.py``, brainstate 0.5.4), in our own code.
brainstate is the optional extra ``flaxtorch[brainstate]``; without it these tests skip
(``importorskip`` inside each test, so the coverage table still sees their tags).
"""

import jax
import jax.numpy as jnp
import pytest
import torch

from tests.support.corpus_helpers import check_function, covers
from tests.support.docstring_models import deep_checkpointed, deep_plain

NOTE = "run with brainstate 0.5.4; skips without the optional brainstate extra"


def _brainstate():
    return pytest.importorskip("brainstate", reason="optional extra: pip install .[brainstate]")


def g_plain(x):
    return jnp.sin(jnp.sin(x))


def mlp(x, w1, w2):
    return jnp.sin(jnp.tanh(x @ w1) @ w2)


@covers("brainstate.transform.checkpoint", "docstring g(x) = sin(sin(x)), bare decorator",
        note=NOTE)
@covers("brainstate.transform.remat", "the same function (remat is checkpoint)", note=NOTE)
@pytest.mark.parametrize("name", ["checkpoint", "remat"])
def test_brainstate_docstring_g(name):
    bs = _brainstate()
    fn = getattr(bs.transform, name)(g_plain)
    check_function(fn, (torch.randn(5),), reference=g_plain)


@covers("brainstate.transform.checkpoint", "policy=", "prevent_cse=False", note=NOTE)
@pytest.mark.parametrize(
    "options",
    [dict(policy=jax.checkpoint_policies.dots_saveable),
     dict(policy=jax.checkpoint_policies.nothing_saveable),
     dict(prevent_cse=False)],
    ids=["dots_saveable", "nothing_saveable", "prevent_cse=False"],
)
def test_brainstate_options(options):
    bs = _brainstate()
    fn = bs.transform.checkpoint(mlp, **options)
    check_function(fn, (torch.randn(4, 6), torch.randn(6, 8) / 3, torch.randn(8, 3) / 3),
                   reference=mlp)


def foo_plain(x, is_training):
    return jnp.sin(x) * 2.0 if is_training else jnp.cos(x)


@covers("brainstate.transform.checkpoint", "static_argnums=(1,) (decorator with arguments)",
        note=NOTE)
@pytest.mark.parametrize("is_training", [True, False], ids=["train", "eval"])
def test_brainstate_static_argnums(is_training):
    bs = _brainstate()
    fn = bs.transform.checkpoint(static_argnums=(1,))(foo_plain)
    check_function(fn, (torch.randn(5), is_training), reference=foo_plain)


@covers("brainstate.transform.checkpoint", "recursive_checkpoint (docstring), 5 layers",
        note=NOTE)
def test_brainstate_recursive():
    bs = _brainstate()
    ws = [torch.randn(4, 4) / 2 for _ in range(5)]
    check_function(deep_checkpointed(bs.transform.checkpoint), (torch.randn(3, 4), ws),
                   reference=deep_plain)
