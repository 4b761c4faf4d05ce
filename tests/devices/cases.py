"""Every call where JAX's default device is not the tensors' device (run by test_devices.py).

Under ``torchrun`` every process sees every GPU and rank ``r`` trains on ``cuda:r`` while
JAX's default device stays GPU 0. ``tests/devices/test_devices.py`` reproduces that on a CPU: it
runs this file in a process with two host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``) and JAX's default device set to
the second, while the tensors are torch ``cpu`` tensors, i.e. JAX's first CPU device
(``FLAXTORCH_TEST_JAX_DEFAULT``, ``FLAXTORCH_TEST_TORCH_DEVICE``: ``tests/support/devices_env.py``;
``examples/gpu_check.py`` runs it with CUDA tensors and the CPU as JAX's default, and with
CPU tensors and the GPU as default).

Each case compares the bridge with pure JAX placed explicitly on the tensors' device
(outputs, every gradient under a random cotangent, state written back), and checks that
no array the bridge made lives on the other device. Not collected by a plain ``pytest``
run (the file name does not start with ``test_``); to run it directly:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 FLAXTORCH_TEST_JAX_DEFAULT=cpu:1 \\
        python -m pytest tests/devices/cases.py
"""

import functools as ft
import gc

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import bridge
import flaxside
from flaxside.internal import key_data_shape, wrap_keys
from tests.support import pipeline
from tests.support.corpus_helpers import check_function, check_linen, check_nnx, reference_on
from tests.support.devices_env import apply_default_device, tensor_device
from tests.support.twins import NnxDropoutMLP, ResidualMLPBlock
from torchside import FlaxModule, jax_function

OTHER = apply_default_device()
TORCH = tensor_device()
RIGHT = bridge.jax_device(TORCH)
if OTHER is None or OTHER == RIGHT:
    raise RuntimeError(
        f"tests/devices/cases.py needs JAX's default device to differ from the tensors' "
        f"({RIGHT}); set FLAXTORCH_TEST_JAX_DEFAULT (see tests/support/devices_env.py)."
    )


if RIGHT.platform != "cpu":
    # Bridge and reference are different programs; on a GPU each would pick its own TF32
    # kernels for float32 matmuls. Full precision keeps the comparison tight.
    jax.config.update("jax_default_matmul_precision", "highest")
# check_linen / check_nnx / check_function: dtype defaults on CPU; GPU reductions differ
# in order between two programs.
TOL = {} if RIGHT.platform == "cpu" else {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(autouse=True)
def _default_is_elsewhere():
    assert jax.config.jax_default_device == OTHER  # nothing reset it under us


class Placement:
    """Arrays alive on ``OTHER`` whose memory was not there when the watch began.

    Listed from ``OTHER``'s own backend (``jax.live_arrays()`` alone lists the default
    backend's, which is not ``OTHER``'s when JAX's default device is the CPU of a GPU
    machine) and told apart by buffer address: the arrays alive at the start are held, so
    their memory cannot be reused by a new one, and an array object made again over the
    same memory (as a framework may hand out) is not a new array.
    """

    def __init__(self):
        self._before = self._alive()  # kept alive: their addresses stay theirs
        self._addresses = {a.unsafe_buffer_pointer() for a in self._before}

    @staticmethod
    def _alive() -> list:
        return [a for a in jax.live_arrays(OTHER.platform)
                if not a.is_deleted() and OTHER in a.devices()]

    def check(self) -> None:
        made = [a for a in self._alive() if a.unsafe_buffer_pointer() not in self._addresses]
        held = [sorted({type(r).__name__ for r in gc.get_referrers(a)} - {"list"})
                for a in made[:6]]
        assert not made, (f"{len(made)} arrays made on {OTHER}, JAX's default device, not on "
                          f"the tensors' {RIGHT}: {[(a.shape, str(a.dtype)) for a in made][:6]},"
                          f" held by {held}")


def _t(x, grad=False) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x)).to(TORCH).requires_grad_(grad)


def _j(t: torch.Tensor):
    return jax.device_put(np.array(t.detach().cpu().numpy()), RIGHT)


def _close(got: torch.Tensor, want, what: str, scale: float | None = None) -> None:
    """Bridge and reference are XLA programs on the same device, though not the same program
    (split forward and backward against one vjp): tight, and ``atol`` scaled with ``scale``,
    by default max|want|, with no floor. A value that is zero in exact arithmetic is float32
    rounding of a sum that cancels: pass the magnitude of its terms as ``scale``."""
    want = np.array(want)
    tol = 1e-5 if RIGHT.platform == "cpu" else 1e-4
    scale = float(np.abs(want).max(initial=0.0)) if scale is None else scale
    torch.testing.assert_close(got.detach().cpu(), torch.from_numpy(want), rtol=tol,
                               atol=tol * scale, msg=lambda m: f"{what}: {m}")


def _on_right(tree) -> None:
    placed = {d for x in jax.tree_util.tree_leaves(tree) for d in x.devices()}
    assert placed == {RIGHT}, f"the reference ran on {placed}"


# -- Linen: buffers, dropout, train and eval, both boundary modes -----------------------
class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Dense(16)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.8)(h)
        h = nn.Dropout(0.3, deterministic=not train)(jnp.tanh(h))
        return nn.Dense(4)(h)


def _linen_reference(module, variables, x, ct, train: bool, rngs=None):
    """Output, state updates and gradients (params, x) of ``module`` in pure JAX on RIGHT."""

    @jax.jit
    def reference(params, x, ct):
        def f(params, x):
            v = {**variables, "params": params}
            if train:
                return module.apply(v, x, train=True, rngs=rngs, mutable=["batch_stats"])
            return module.apply(v, x, train=False), {}

        out, pull, updates = jax.vjp(f, params, x, has_aux=True)
        return out, updates, pull(ct)

    result = reference(variables["params"], _j(x), _j(ct))
    _on_right(result)
    return result


def _raw_keys(seed: int):
    """The key data a forward draws right after ``manual_seed``: from the generator of the
    tensors' device (CUDA's draws other numbers than the CPU's for the same seed)."""
    torch.manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (1, *key_data_shape()), dtype=torch.int32,
                         device=TORCH).cpu()


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_linen_buffers_and_dropout(train, residuals):
    m = FlaxModule(Net(), example_args=(torch.zeros(8, 5),), example_kwargs={"train": False},
                   rngs=("dropout",), train_kwarg="train", residuals=residuals).to(TORCH)
    m.train(train)
    assert {p.device for p in [*m.parameters(), *m.buffers()]} == {TORCH}
    variables = jax.tree_util.tree_map(jnp.array, m.flax_variables())  # on RIGHT
    x, ct = _t(np.random.default_rng(0).standard_normal((8, 5), np.float32), grad=True), \
        _t(np.random.default_rng(1).standard_normal((8, 4), np.float32))
    watch = Placement()
    torch.manual_seed(7)
    y = m(x)
    (y * ct).sum().backward()
    watch.check()

    rngs = wrap_keys(_j(_raw_keys(7)), ("dropout",)) if train else None
    out, updates, (g_params, g_x) = _linen_reference(Net(), variables, x, ct, train, rngs)
    _close(y, out, "output")
    _close(x.grad, g_x, "x.grad")
    grads = dict(m.named_parameters())
    for path, g in jax.tree_util.tree_flatten_with_path(g_params)[0]:
        name = "params." + ".".join(k.key for k in path)
        # BatchNorm on batch statistics cancels Dense_0's bias: its gradient, the batch sum
        # of the gradient that Dense_0's kernel gradient sums against x, is zero but for
        # rounding, so it is held to the kernel gradient's magnitude.
        scale = (float(np.abs(g_params["Dense_0"]["kernel"]).max())
                 if train and name == "params.Dense_0.bias" else None)
        _close(grads[name].grad, g, f"{name}.grad", scale)
    stats = updates["batch_stats"] if train else variables["batch_stats"]
    _close(m.batch_stats.BatchNorm_0.mean, stats["BatchNorm_0"]["mean"], "running mean")
    _close(m.batch_stats.BatchNorm_0.var, stats["BatchNorm_0"]["var"], "running var")


def test_linen_module_initialized_from_static_arguments_only():
    class Sized(nn.Module):
        n: int = 6

        @nn.compact
        def __call__(self, x=None):
            w = self.param("w", nn.initializers.normal(), (self.n,))
            return w if x is None else w * x

    with torch.device(TORCH):  # where torch makes a new layer's parameters
        m = FlaxModule(Sized())  # nothing to place the init by but our own choice
    assert m.params.w.device == TORCH
    with reference_on(RIGHT), torch.device(TORCH):
        check_linen(Sized(), (torch.randn(6),), init_args=(), tol=TOL)


# -- NNX: buffers (BatchNorm), dropout (the module's own stream), train and eval --------
NNet = ft.partial(NnxDropoutMLP, din=5, hidden=16, dout=4, rate=0.3, momentum=0.8)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_nnx_buffers_and_dropout(train):
    module = NNet(nnx.Rngs(0, dropout=1))  # its arrays live on JAX's default device
    watch = Placement()
    with reference_on(RIGHT), torch.device(TORCH):
        checked = check_nnx(module, (torch.randn(8, 5),), train=train, tol=TOL)
    assert {p.device for p in checked.wrapped.parameters()} == {TORCH}
    watch.check()


def test_nnx_module_arrays_are_not_kept_on_the_default_device():
    module = NNet(nnx.Rngs(0, dropout=1))
    # Where a new NNX module's arrays land is flax's and JAX's choice (with jax 0.11 on a
    # GPU machine, not the configured default device): put them there, as a user's would be.
    nnx.update(module, jax.device_put(nnx.state(module), OTHER))
    on_default = len(Placement._alive())
    assert on_default, f"no array on {OTHER} to begin with: the check below would be vacuous"
    layer = FlaxModule(module).to(TORCH)
    del module  # the user's copy; torch now owns the state
    gc.collect()
    assert len(Placement._alive()) < on_default
    watch = Placement()
    y = layer(torch.randn(3, 5).to(TORCH))
    assert layer.flax_module.fc1.kernel[...].devices() == {RIGHT}  # views of torch's state
    assert y.shape == (3, 4)
    watch.check()


# -- plain JAX, stacks, torch.compile, memory_report ---------------------------------------
@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_jax_function(residuals):
    def f(x, w, scale):
        return {"y": jnp.tanh(x @ w) * scale, "n": jnp.sum(x > 0)}

    watch = Placement()
    with reference_on(RIGHT), torch.device(TORCH):
        checked = check_function(f, (torch.randn(4, 3), torch.randn(3, 5), 2.0),
                                 residuals=residuals, tol=TOL)
    assert checked.outputs["y"].device == TORCH and checked.outputs["n"].device == TORCH
    watch.check()


@pytest.mark.parametrize("lengths", [(2, 2), "auto"], ids=["two_levels", "auto"])
def test_linen_remat_stack(lengths, monkeypatch):
    measured = []
    real = flaxside.stacks._lengths.memory_report

    def spy(*args, **kwargs):
        # The bridge's own measurements: those made while it compiles a program. The pure
        # JAX reference measures too, for JAX's default device, where a plain jit of it
        # would run: flaxside cannot see inside a user's jit where its arguments live.
        if flaxside.program._compiling_for.target_device() is not None:
            measured.append(kwargs.get("device"))
        return real(*args, **kwargs)

    monkeypatch.setattr(flaxside.stacks._lengths, "memory_report", spy)
    watch = Placement()
    with reference_on(RIGHT), torch.device(TORCH):
        check_linen(flaxside.remat_stack(ResidualMLPBlock, 4, lengths=lengths, width=8),
                    (torch.randn(3, 8),),
                    tol=TOL)
    watch.check()
    if lengths == "auto":  # the candidates were measured for the tensors' device
        assert measured and set(measured) == {RIGHT}


def test_nnx_remat_stack():
    class NBlock(nnx.Module):
        def __init__(self, width, rngs):
            self.lin = nnx.Linear(width, width, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.lin(x))

    stack = flaxside.remat_stack(NBlock, 4, lengths=(2, 2), rngs=nnx.Rngs(0), width=8)
    watch = Placement()
    with reference_on(RIGHT), torch.device(TORCH):
        check_nnx(stack, (torch.randn(3, 8),), tol=TOL)
    watch.check()


@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_torch_compile_fullgraph(residuals):
    class BNBlock(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            h = nn.BatchNorm(use_running_average=not train, momentum=0.8)(nn.Dense(6)(x))
            return jnp.tanh(h)

    m = FlaxModule(BNBlock(), example_args=(torch.zeros(4, 3),), train_kwarg="train",
                   residuals=residuals).to(TORCH)
    variables = jax.tree_util.tree_map(jnp.array, m.flax_variables())
    compiled = torch.compile(m, fullgraph=True)
    x = torch.randn(4, 3).to(TORCH).requires_grad_()
    ct = torch.randn(4, 6).to(TORCH)
    watch = Placement()
    y = compiled(x)
    (y * ct).sum().backward()
    watch.check()

    out, updates, (g_params, g_x) = _linen_reference(BNBlock(), variables, x, ct, True)
    _close(y, out, "output")
    _close(x.grad, g_x, "x.grad")
    _close(m.params.Dense_0.kernel.grad, g_params["Dense_0"]["kernel"], "kernel.grad")
    _close(m.batch_stats.BatchNorm_0.mean, updates["batch_stats"]["BatchNorm_0"]["mean"],
           "running mean")


def test_memory_report_compiles_for_the_tensors_device():
    m = FlaxModule(flaxside.remat_stack(ResidualMLPBlock, 4, lengths=(2, 2), width=8),
                   example_args=(torch.zeros(3, 8),)).to(TORCH)
    report = m.memory_report(torch.zeros(3, 8).to(TORCH))
    assert report.device == f"{RIGHT.platform}:{RIGHT.id}", report
    shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                    m.flax_variables())
    pure = flaxside.memory_report(flaxside.remat_stack(ResidualMLPBlock, 4, lengths=(2, 2),
                                                       width=8),
                                  jax.ShapeDtypeStruct((3, 8), np.float32), variables=shapes,
                                  device=RIGHT)
    assert (report.held_bytes, report.param_bytes, report.residual_count) == \
        (pure.held_bytes, pure.param_bytes, pure.residual_count)
    assert pure.device == report.device


def test_to_jax_and_to_torch_keep_the_tensors_device():
    t = torch.randn(5).to(TORCH)
    a = bridge.to_jax(t)
    assert a.devices() == {RIGHT}
    back = bridge.to_torch(a)
    assert back.device == TORCH and torch.equal(back.cpu(), t.cpu())
    assert bridge.torch_device(RIGHT) == TORCH


def test_programs_are_compiled_for_the_tensors_device():
    m = FlaxModule(Net(), example_args=(torch.zeros(2, 5),), example_kwargs={"train": False},
                   train_kwarg="train", rngs=("dropout",)).to(TORCH)
    f = jax_function(lambda x: jnp.sin(x), residuals="recompute")
    loss = jax_function(lambda x: jnp.mean(jnp.sin(x) ** 2))  # a scalar loss: value_and_grad
    x = torch.randn(2, 5).to(TORCH).requires_grad_()
    m(x).sum().backward()
    with torch.no_grad():
        m(x)
    f(x).sum().backward()
    loss(x).backward()
    programs = [p for owner in (m, f, loss) for p in pipeline.programs(owner)]
    assert len(programs) == 4 and all(p.placement.device == RIGHT for p in programs)
    ran = [run for owner in (m, f, loss) for run in pipeline.executables_run(owner)]
    assert {kind for _, kind, _ in ran} == {"forward", "forward_with_residuals", "backward",
                                            "backward_recompute", "value_and_grad"}
    for name, kind, exe in ran:  # the executables the calls ran, arguments and results
        placed = {d for s in jax.tree_util.tree_leaves((exe.input_shardings,
                                                        exe.output_shardings))
                  for d in s.device_set}
        assert placed == {RIGHT}, (name, kind, placed)


# -- derivatives of the backward and torch.func ----------------------------------------------
def _sin3(x, w):
    return jnp.sum(jnp.sin(x @ w) ** 3)


def test_second_derivatives_and_torch_func_run_on_the_tensors_device():
    """The derived calls (NOTE [Higher order]) and the transformed ones (NOTE [torch.func])
    compile for the tensors' device too, and match pure JAX placed there."""
    f = jax_function(_sin3)
    x, w = torch.randn(3, 4).to(TORCH), torch.randn(4, 2).to(TORCH)
    watch = Placement()
    xg = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(xg, w), xg, create_graph=True)
    g.pow(2).sum().backward()
    with reference_on(RIGHT):
        want = jax.grad(lambda x: (jax.grad(_sin3)(x, _j(w)) ** 2).sum())(_j(x))
        per_row = jax.vmap(jax.grad(_sin3), in_axes=(0, None))(_j(x)[:, None], _j(w))
    _on_right((want, per_row))
    _close(xg.grad, want, "second derivative")
    got = torch.func.vmap(torch.func.grad(f), in_dims=(0, None))(x[:, None], w)
    assert got.device == TORCH
    _close(got, per_row, "vmap(grad)")
    programs = pipeline.derived_programs(f)
    assert programs and all(p.placement.device == RIGHT for p in programs)
    watch.check()
