"""The benchmark's DP-SGD rows: a differentially private step through Opacus.

The model: a torch ``Linear`` into a ``FlaxModule`` over an ``nn.remat_scan`` trunk of residual
MLP blocks and a ``Dense`` head (10 classes), cross-entropy loss. One DP-SGD step: each
sample's gradient, clipped to norm ``CLIP``, summed, Gaussian noise of standard deviation
``NOISE * CLIP`` added, divided by the batch, an SGD update. Contestants, on the same
weights and batch (interleaved rounds, medians):

* ``bridge``: the model through ``PrivacyEngine.make_private`` (hooks mode: the block's
  per-sample gradients from one JAX program, ``torchside/integrations/_opacus.py``);
* ``bridge ghost``: the same with ``grad_sample_mode="ghost"`` (fast gradient clipping: the
  block's per-sample norms only, then a second, clipped backward);
* ``torch``, ``torch ghost``: the torch twin (the same weights) through Opacus alike;
* ``pure JAX``: the whole model in JAX, ``vmap(grad)`` of the per-sample loss, clipping,
  noise and the update in one ``jit`` (the limit).

Also: how one step without noise changes each model's outputs on a probe batch, against
pure JAX's change, and the bytes of per-sample gradients each holds as tensors (Opacus's
``grad_sample``; the norm samplers' norms under ghost clipping) and, for pure JAX, its
program's temporaries (the bridge's per-sample programs hold theirs as temporaries too),
and the minor page faults of a step (``_page_faults``: fresh memory the step maps).
"""

from __future__ import annotations

import resource
import time
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from _measure import Contestant, race
from _report import _table, fmt_bytes, fmt_time, ratio_targets
from _workloads import RematScan, torch_twin

from torchside import FlaxModule

PrivacyEngine = None  # opacus's, imported by dp_rows (the 'dp' extra)

CLIP, NOISE, LR, CLASSES = 1.0, 1.0, 0.1, 10
# (features, width, nn.remat_scan lengths, batch) per benchmark size.
SHAPES = {"full": (64, 128, (4, 4), 64), "quick": (64, 128, (2, 4), 32),
          "smoke": (8, 16, (2, 2), 4)}
# DP-SGD step through the bridge: at most this many times pure JAX, and no slower than the
# twin through Opacus.
TARGET_JAX, TARGET_TWIN = 1.5, 1.0


class Head(nn.Module):
    """The Flax part: an ``nn.remat_scan`` trunk then a ``Dense`` head."""

    width: int
    lengths: tuple
    classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.classes, name="head")(RematScan(self.width, self.lengths,
                                                             name="trunk")(x))


def _models(features, width, lengths):
    """The bridge's model, its torch twin with the same values, and the pure JAX params."""
    torch.manual_seed(0)
    head = Head(width, lengths, CLASSES)
    variables = jax.jit(head.init)(jax.random.key(0), jnp.zeros((1, width)))
    linear = torch.nn.Linear(features, width)
    bridge = torch.nn.Sequential(linear, FlaxModule(head, variables=variables))
    twin_linear, twin_head = torch.nn.Linear(features, width), torch.nn.Linear(width, CLASSES)
    twin_linear.load_state_dict(linear.state_dict())
    with torch.no_grad():
        p = variables["params"]["head"]
        twin_head.weight.copy_(torch.from_numpy(np.array(p["kernel"])).T)
        twin_head.bias.copy_(torch.from_numpy(np.array(p["bias"])))
    blocks = torch_twin(RematScan(width, lengths), variables["params"]["trunk"])
    twin = torch.nn.Sequential(twin_linear, *blocks, twin_head)
    params = {"linear": {"kernel": jnp.asarray(linear.weight.detach().numpy().T),
                         "bias": jnp.asarray(linear.bias.detach().numpy())},
              "head": {"params": jax.tree_util.tree_map(jnp.asarray, variables["params"])}}
    return bridge, twin, params, head


class _Opacus(Contestant):
    """A model through ``PrivacyEngine.make_private`` (``mode``: its ``grad_sample_mode``)."""

    def __init__(self, name, model, mode, x, y):
        self.name, self.model, self.x, self.y = name, model, x, y
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                             batch_size=len(x))
        private = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.0,
            max_grad_norm=CLIP, poisson_sampling=False, grad_sample_mode=mode,
            criterion=torch.nn.CrossEntropyLoss(),
            noise_generator=torch.Generator().manual_seed(1))
        self.gsm, self.opt = private[0], private[1]
        self.loss = private[2] if mode == "ghost" else torch.nn.CrossEntropyLoss()
        self.params, self.per_sample = [], 0

    def set_noise(self, noise: float) -> None:
        self.opt.noise_multiplier = noise

    def call(self) -> None:
        self.opt.zero_grad()
        self.loss(self.gsm(self.x), self.y).backward()
        self.per_sample = sum(t.nbytes for p in self.model.parameters()
                              for t in (getattr(p, "grad_sample", None),
                                        getattr(p, "_norm_sample", None))
                              if isinstance(t, torch.Tensor))
        self.opt.step()

    def outputs(self, x: torch.Tensor) -> np.ndarray:
        """The model's logits on ``x`` with its parameters now (no hooks: grad off)."""
        with torch.no_grad():
            return self.model(x).numpy().copy()


class _PureJax(Contestant):
    """The DP-SGD step of the whole model in one ``jit``."""

    def __init__(self, head, params, x, y):
        self.name, self.params, self.noise = "pure JAX", [], jnp.float32(0.0)

        def logits(p, x):  # one sample
            return head.apply(p["head"], x[None] @ p["linear"]["kernel"] + p["linear"]["bias"])[0]

        def loss(p, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y)

        self.logits = jax.jit(logits)

        def step(p, x, y, key, noise):
            g = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(p, x, y)
            leaves, tree = jax.tree_util.tree_flatten(g)
            norms = jnp.sqrt(sum(jnp.sum(jnp.square(a.reshape(len(x), -1)), axis=1)
                                 for a in leaves))
            coef = jnp.minimum(1.0, CLIP / (norms + 1e-6))
            keys = jax.random.split(key, len(leaves))
            noisy = [jnp.tensordot(coef, a, 1) + noise * CLIP * jax.random.normal(k, a.shape[1:])
                     for a, k in zip(leaves, keys, strict=True)]
            update = jax.tree_util.tree_unflatten(tree, noisy)
            return jax.tree_util.tree_map(lambda w, u: w - LR * u / len(x), p, update)

        self.x, self.y = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
        self.p, self.key = params, jax.random.key(1)
        self.step = jax.jit(step, donate_argnums=0)
        compiled = self.step.lower(params, self.x, self.y, self.key, self.noise).compile()
        self.per_sample = compiled.memory_analysis().temp_size_in_bytes

    def call(self) -> None:
        self.key, k = jax.random.split(self.key)
        self.p = jax.block_until_ready(self.step(self.p, self.x, self.y, k, self.noise))

    def set_noise(self, noise: float) -> None:
        self.noise = jnp.float32(noise)

    def outputs(self, x: torch.Tensor) -> np.ndarray:
        return np.asarray(jax.vmap(self.logits, in_axes=(None, 0))(self.p, jnp.asarray(x)))


def dp_rows(size_name: str, size: dict) -> list[dict]:
    """Times, per-sample-gradient bytes and the one-step agreement of every contestant."""
    try:
        global PrivacyEngine
        from opacus import PrivacyEngine
    except ImportError as e:
        raise SystemExit("benchmark.py: the dp part needs Opacus (pip install -e '.[dp]'); "
                         "leave it out with --only") from e
    features, width, lengths, batch = SHAPES[size_name]
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(batch, features, generator=g)
    y = torch.randint(0, CLASSES, (batch,), generator=g)

    bridge, twin, params, head = _models(features, width, lengths)
    ghost_bridge, ghost_twin, _, _ = _models(features, width, lengths)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Secure RNG turned off")
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        racers = [_Opacus("bridge", bridge, "hooks", x, y),
                  _Opacus("bridge ghost", ghost_bridge, "ghost", x, y),
                  _Opacus("torch", twin, "hooks", x, y),
                  _Opacus("torch ghost", ghost_twin, "ghost", x, y),
                  _PureJax(head, params, x, y)]
        # The first step, without noise, against pure JAX's: each model's change of output
        # on a probe batch (any parameter stepped otherwise moves it), relative to pure
        # JAX's change; the frameworks name and lay out their parameters differently.
        probe = torch.randn(batch, features, generator=g)
        before = {c.name: c.outputs(probe) for c in racers}
        first = {}
        for c in racers:
            start = time.perf_counter()
            c.call()
            first[c.name] = time.perf_counter() - start
        moved = {c.name: c.outputs(probe) - before[c.name] for c in racers}
        want = moved["pure JAX"]
        mismatch = {k: float(np.abs(v - want).max() / np.abs(want).max())
                    for k, v in moved.items()}
        for c in racers:
            c.set_noise(NOISE)
        times, rounds = race(racers, budget=size["budget"], min_repeats=size["min_repeats"],
                             warmup=size["warmup"], label="DP-SGD")
        faults = {c.name: _page_faults(c) for c in racers}
    n_params = sum(p.numel() for p in racers[2].model.parameters())
    describe = (f"Linear {features}->{width}, nn.remat_scan{lengths} of residual MLP blocks, "
                f"Dense {CLASSES}; batch {batch}, {n_params:,} parameters, clip {CLIP}, "
                f"noise {NOISE}")
    print(f"  DP-SGD: {describe}: {time.perf_counter() - t0:.0f} s", flush=True)
    return [dict(name="DP-SGD", describe=describe, times=times, rounds=rounds, first=first,
                 mismatch=mismatch, per_sample={c.name: c.per_sample for c in racers},
                 faults=faults,
                 per_sample_full=4 * batch * n_params)]


def _page_faults(c: Contestant, steps: int = 3) -> int:
    """The median minor page faults of a step: pages the kernel maps fresh, zeroed.

    A buffer larger than glibc's mmap threshold (32 MiB at most) is mapped anew at each
    allocation and every page of it faults when first written; smaller ones are reused
    from the heap. On a virtual machine a fault is dear, and it is what a step that
    allocates large per-sample buffers (a stacked leaf's) pays that one allocating them
    layer by layer does not.
    """
    counts = []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c.call()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        c.reset()
    return int(np.median(counts))


def print_dp(rows: list[dict]) -> tuple[list[list[str]], str]:
    """Prints the DP-SGD table. Returns the target rows and the table as markdown."""
    title = "DP-SGD step through Opacus (median per step)"
    names = ("bridge", "bridge ghost", "torch", "torch ghost", "pure JAX")
    header = ["workload", *names, "bridge/JAX", "bridge/torch", "rounds"]
    table, targets, md = [], [], []
    for r in rows:
        t = r["times"]
        table.append([r["name"], *(fmt_time(t[n]) for n in names),
                      f"{t['bridge'] / t['pure JAX']:.2f}x",
                      f"{t['bridge'] / t['torch']:.2f}x", str(r["rounds"])])
        held = ", ".join(f"{n} {fmt_bytes(r['per_sample'][n])}" for n in names)
        line = (f"{r['name']}: {r['describe']}. Per-sample gradients held as tensors (Opacus's "
                f"grad_sample, or the norms under ghost clipping), and pure JAX's program "
                f"temporaries (the bridge's per-sample programs have theirs too, not "
                f"counted): {held} (every per-sample gradient: "
                f"{fmt_bytes(r['per_sample_full'])}); minor page faults per step: "
                + ", ".join(f"{n} {r['faults'][n]:,}" for n in names) + "; first step: "
                + ", ".join(f"{n} {fmt_time(r['first'][n])}" for n in names))
        md.append(f"- {line}")
        # Ghost clipping (fast gradient clipping) against the twin under ghost clipping:
        # the route README recommends for a FlaxModule.
        targets += ratio_targets(r, (("pure JAX DP-SGD", "pure JAX", TARGET_JAX),
                                     ("Opacus on the torch twin", "torch", TARGET_TWIN),
                                     ("the twin's ghost", "torch ghost", TARGET_TWIN,
                                      "bridge ghost")),
                                 ("one step without noise, every model's output change",
                                  "max |d - pure JAX's d| / max |pure JAX's d|"))
    text = _table(header, table)
    print(title)
    print(text)
    for line in md:
        print(f"  {line[2:]}")
    print()
    return targets, "\n".join([f"### {title}", "", text, "", *md, ""])

