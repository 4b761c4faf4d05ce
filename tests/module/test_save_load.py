"""Checkpoints load with ``torch.load(weights_only=True)``, and nothing in the project unpickles.

A Linen module's buffers with its optimizer's state, and an NNX module's RNG state, round
trip through a weights-only load and continue the run bit for bit. Also elsewhere: a
parameters-only state_dict (module/test_module.py::
test_state_dict_round_trips_through_torch_save_weights_only), typed PRNG keys in state
(module/test_prng_keys_in_state.py::test_key_state_round_trips), copies of a whole model
(module/test_copies.py).
"""

import io
import re

import torch
from flax import nnx

from tests.support import ROOT
from tests.support.twins import BatchNormMLP, NnxDropoutMLP
from torchside import FlaxModule


def _net():
    return FlaxModule(BatchNormMLP(), example_args=(torch.zeros(4, 5),), train_kwarg="train")


def _weights_only_round_trip(checkpoint):
    buf = io.BytesIO()
    torch.save(checkpoint, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_linen_checkpoint_with_buffers_and_optimizer_loads_weights_only():
    m = _net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        (m(torch.randn(4, 5)) * torch.randn(4, 3)).sum().backward()
        opt.step()
    assert any(k.startswith("batch_stats.") for k in m.state_dict())
    loaded = _weights_only_round_trip({"model": m.state_dict(), "optim": opt.state_dict(),
                                       "step": 2})
    other = _net()
    other.load_state_dict(loaded["model"])
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other_opt.load_state_dict(loaded["optim"])
    for k, v in m.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    x, ct = torch.randn(4, 5), torch.randn(4, 3)
    for model, o in ((m, opt), (other, other_opt)):  # one more step each: same result
        o.zero_grad()
        (model(x) * ct).sum().backward()
        o.step()
    for k, v in m.state_dict().items():
        torch.testing.assert_close(other.state_dict()[k], v, rtol=0, atol=0, msg=k)
    m.eval()
    other.eval()
    torch.testing.assert_close(other(x), m(x), rtol=0, atol=0)


def test_nnx_checkpoint_with_rng_state_loads_weights_only():
    m = FlaxModule(NnxDropoutMLP(nnx.Rngs(0, dropout=1)))
    m(torch.randn(4, 5))  # move the batch statistics and the dropout counter
    sd = m.state_dict()
    # Key data (and the uint32 counter) are held as int32, the same bits: torch's uint32
    # cannot be pickled or broadcast by gloo.
    assert sd["drop.rngs.key"].dtype == sd["drop.rngs.count"].dtype == torch.int32
    loaded = _weights_only_round_trip(sd)
    other = FlaxModule(NnxDropoutMLP(nnx.Rngs(7, dropout=8)))
    other.load_state_dict(loaded)
    for k, v in sd.items():
        assert torch.equal(other.state_dict()[k], v), k
    m.eval()
    other.eval()
    x = torch.randn(4, 5)
    torch.testing.assert_close(other(x), m(x), rtol=0, atol=0)


UNSAFE = re.compile(
    r"\bimport (c?pickle|dill|cloudpickle|marshal|shelve|joblib)\b"
    r"|\bfrom (c?pickle|dill|cloudpickle|marshal|shelve|joblib) import"
    r"|allow_pickle\s*=\s*True"
    r"|weights_only\s*=\s*False"
    r"|\bpickle\.loads?\("
)


def test_nothing_in_the_project_unpickles():
    files = [p for d in ("bridge", "flaxside", "torchside", "examples")
             for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 10
    offenders = []
    for path in files:
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in UNSAFE.finditer(text)]
        for call in re.finditer(r"torch\.load\(([^)]*)\)", text):
            if "weights_only=True" not in call.group(1):
                offenders.append(f"{path.relative_to(ROOT)}: {call.group(0)}")
    assert offenders == []
