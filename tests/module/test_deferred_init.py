"""Meta-device construction and ``reset_parameters()``: PyTorch's deferred-init recipe.

Built under ``torch.device("meta")`` a ``FlaxModule`` allocates nothing and starts no JAX
backend; ``to_empty(device=...)`` then ``reset_parameters()`` runs the Flax init with the
module's seed, and the values equal a module built directly, bit for bit. The reference is
always a module built directly (Linen's ``init``, or the NNX factory called as the user
would), never the module's own earlier output.
"""

import subprocess
import sys
import textwrap

import flax.linen as nn
import numpy as np
import pytest
import torch
from flax import nnx

from tests.support.twins import BatchNormMLP, NnxDropoutMLP, ReadmeDeep
from torchside import FlaxModule


class Dropout(nn.Module):
    """A remat_scan stack, batch statistics and a dropout stream: every kind of Linen state."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = ReadmeDeep(width=8)(x)
        h = nn.Dropout(0.3, deterministic=not train)(BatchNormMLP()(h, train))
        return h


LINEN = {
    "remat_scan": dict(module=lambda: ReadmeDeep(width=8), args=(torch.zeros(4, 8),)),
    "state_and_rng": dict(module=Dropout, args=(torch.zeros(4, 8),),
                          kw=dict(rngs=("dropout",), train_kwarg="train")),
}


def _build(case, seed):
    return FlaxModule(case["module"](), example_args=case["args"], seed=seed,
                      **case.get("kw", {}))


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), f"{name} differs"


@pytest.mark.parametrize("case", list(LINEN))
def test_linen_built_on_meta_then_reset_equals_a_direct_build(case):
    direct = _build(LINEN[case], seed=3)
    with torch.device("meta"):
        deferred = _build(LINEN[case], seed=3)
    assert {t.device.type for t in deferred.state_dict().values()} == {"meta"}
    deferred.to_empty(device="cpu")
    deferred.reset_parameters()
    _same_state(deferred, direct)
    # and it computes like the direct build (train mode: state written back, a dropout key)
    x = torch.randn(4, 8)
    torch.manual_seed(1)
    want = direct(x)
    torch.manual_seed(1)
    torch.testing.assert_close(deferred(x), want, rtol=0, atol=0)
    _same_state(deferred, direct)


def test_a_different_seed_gives_different_values():
    """The negative control: the comparison above fails for another seed."""
    case = LINEN["remat_scan"]
    with torch.device("meta"):
        deferred = _build(case, seed=4)
    deferred.to_empty(device="cpu")
    deferred.reset_parameters()
    with pytest.raises(AssertionError, match="differs"):
        _same_state(deferred, _build(case, seed=3))


def test_reset_restores_the_initial_values_after_training():
    m = _build(LINEN["state_and_rng"], seed=0)
    initial = {k: v.clone() for k, v in m.state_dict().items()}
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    params = dict(m.named_parameters())
    m.reset_parameters()
    for k, v in m.state_dict().items():
        assert torch.equal(v, initial[k]), k
    assert all(p is params[k] for k, p in m.named_parameters())  # in place: optimizers keep them


def _nnx_factory(rngs):
    return NnxDropoutMLP(rngs)


def test_nnx_factory_on_meta_then_reset_equals_the_factory_called_directly():
    with torch.device("meta"):
        deferred = FlaxModule(_nnx_factory, rngs=("default",), seed=5)
    assert {t.device.type for t in deferred.state_dict().values()} == {"meta"}
    deferred.to_empty(device="cpu")
    deferred.reset_parameters()
    reference = NnxDropoutMLP(nnx.Rngs(5))  # the user's own construction, no flaxtorch
    got = deferred.state_dict()
    for name, value in [("fc1.kernel", reference.fc1.kernel), ("fc2.bias", reference.fc2.bias),
                        ("bn.var", reference.bn.var)]:
        assert np.array_equal(got[name].numpy(), np.asarray(value[...])), name
    direct = FlaxModule(_nnx_factory, rngs=("default",), seed=5)
    _same_state(deferred, direct)


def test_a_call_before_materializing_says_how():
    with torch.device("meta"):
        m = _build(LINEN["remat_scan"], seed=0)
    with pytest.raises(ValueError, match=r"is on meta, which holds shapes but no values.*"
                                         r"to_empty\(device='cpu'\).*reset_parameters\(\)"):
        m(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=r"reset_parameters: the parameters are on the meta "
                                           r"device.*to_empty"):
        m.reset_parameters()


def test_reset_without_an_init_to_rerun_is_refused_by_name():
    direct = _build(LINEN["remat_scan"], seed=0)
    from_variables = FlaxModule(ReadmeDeep(width=8), variables=direct.flax_variables())
    with pytest.raises(RuntimeError, match=r"built from variables=.*load_flax_variables"):
        from_variables.reset_parameters()
    instance = FlaxModule(NnxDropoutMLP(nnx.Rngs(0)), rngs=("default",))
    with pytest.raises(RuntimeError, match=r"NNX module instance; pass a factory"):
        instance.reset_parameters()


def test_building_on_meta_starts_no_jax_backend():
    """``jax.distributed.initialize`` must come before any backend: a sharded run builds
    its model on meta first, so building there must not start one (a fresh interpreter)."""
    code = textwrap.dedent("""
        import torch, flax.linen as nn
        from flax import nnx
        from jax._src import xla_bridge
        from torchside import FlaxModule
        from tests.support.twins import ReadmeDeep
        with torch.device("meta"):
            FlaxModule(ReadmeDeep(width=8), example_args=(torch.zeros(4, 8),),
                       rngs=("dropout",))
            FlaxModule(lambda rngs: nnx.Linear(3, 4, rngs=rngs))
        print("started" if xla_bridge.backends_are_initialized() else "none")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "none"
