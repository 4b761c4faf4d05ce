"""NNX RNG streams through FlaxModule: stacked stream keys, and streams the module lacks.

Keys stacked by ``nnx.split_rngs`` + ``nnx.vmap`` (one per layer) and applied in
``nnx.scan`` keep their shape, follow torch's seed, and match pure NNX run with the keys
the bridge drew. Also: streams drawn from torch's seed (module/test_nnx.py), Linen streams
(module/test_linen_state_and_rng.py, module/test_eval_rng.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.support.docstring_models import Model  # the flax.nnx.scan docstring model
from tests.support.references import nnx_step, to_jax, to_torch
from torchside import FlaxModule


# -- stacked stream keys (nnx.split_rngs + nnx.vmap, applied in nnx.scan) ----------------
def _stacked():
    return Model(3, 4, rngs=nnx.Rngs(params=0, dropout=1))


def test_stacked_stream_keys_keep_their_shape_and_match_pure_nnx():
    m = FlaxModule(_stacked(), rngs=("dropout",))
    key_before = m.get_buffer("blocks.dropout.rngs.key").clone()
    x = torch.randn(5, 4, requires_grad=True)
    ct = torch.randn(5, 4)
    torch.manual_seed(3)
    y = m(x)
    y.backward(ct)
    drawn = m.get_buffer("blocks.dropout.rngs.key")  # the keys the forward ran with
    assert drawn.shape == key_before.shape == (3, 2)  # one key per layer
    assert not torch.equal(drawn, key_before)
    # Pure NNX from the state before the call, with the per-layer keys the bridge drew.
    ref = _stacked()
    ref.blocks.dropout.rngs.key.set_value(jax.random.wrap_key_data(
        jnp.asarray(drawn.numpy().view(np.uint32))))
    want_y, want_g, want_gx = nnx_step(ref, to_jax(x), to_jax(ct))
    torch.testing.assert_close(y.detach(), to_torch(want_y))
    torch.testing.assert_close(x.grad, to_torch(want_gx))
    for name, p in m.named_parameters():
        torch.testing.assert_close(p.grad, to_torch(want_g[name]), msg=name)
    np.testing.assert_array_equal(m.get_buffer("blocks.dropout.rngs.count").numpy(),
                                  np.asarray(ref.blocks.dropout.rngs.count.get_value()))


def _assert_follows_the_torch_seed(m, x):
    """The same seed draws the same keys, another seed other keys; the seed-3 output."""
    outs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        outs.append(m(x))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    return outs[0]


def test_stacked_stream_keys_follow_the_torch_seed():
    m = FlaxModule(_stacked(), rngs=("dropout",))
    x = torch.randn(5, 4)
    y = _assert_follows_the_torch_seed(m, x)
    assert not torch.equal(y, m.eval()(x))  # dropout was active


# -- a requested stream the module does not have ---------------------------------------
def test_a_stream_no_key_belongs_to_is_refused():
    # nnx.Rngs(0) tags every key 'default': rngs=("dropout",) would draw nothing.
    with pytest.raises(ValueError, match=r"stream 'dropout'.*its streams: \['default'\]"):
        FlaxModule(Model(3, 4, rngs=nnx.Rngs(0)), rngs=("dropout",))
    m = FlaxModule(Model(3, 4, rngs=nnx.Rngs(0)), rngs=("default",))  # the fix it gives
    _assert_follows_the_torch_seed(m, torch.randn(5, 4))
