"""Train a torch classifier whose trunk is a 128-layer Flax stack, on a laptop CPU.

What this shows:
    A PyTorch model (torch embedding, torch head, ``torch.optim.AdamW``, a plain torch
    training loop) whose trunk is a deep Flax stack built with ``nn.remat_scan``, wrapped in
    ``torchside.FlaxModule``. torch owns every parameter; JAX compiles the trunk once and
    runs it without copying tensors. Remat-scan keeps the memory the trunk holds between
    forward and backward nearly independent of depth: the script prints it next to what
    the same depth holds without remat.

    The data is scikit-learn's bundled digits set (1797 8x8 images, no download).

How to run (about a minute on 2 CPU cores):
    pip install -e '.[examples]'
    python examples/train_digits.py
    python examples/train_digits.py --depth 256 --epochs 12   # deeper, longer
"""

from __future__ import annotations

import argparse
import math
import os
import time

# torch's OpenMP threads spin after each parallel region by default and would steal the
# cores XLA is about to use; passive waiting lets both runtimes share a small CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm import tqdm  # noqa: E402

from torchside import FlaxModule  # noqa: E402


class Block(nn.Module):
    """Pre-norm residual MLP block: ``x + Dense(w)(gelu(Dense(2w)(LayerNorm(x))))``."""

    width: int
    depth: int  # of the whole stack: scales the residual branch so 128 of them stay stable

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.gelu(nn.Dense(2 * self.width)(h))
        out_init = nn.initializers.variance_scaling(1.0 / self.depth, "fan_in", "truncated_normal")
        return x + nn.Dense(self.width, kernel_init=out_init)(h)


class RematScanTrunk(nn.Module):
    """``prod(lengths)`` blocks; each level of the nested scan is rematerialised."""

    width: int
    lengths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        depth = math.prod(self.lengths)
        stack = nn.remat_scan(nn.remat(Block), lengths=self.lengths)
        return stack(self.width, depth, name="blocks")(x)


class ScanTrunk(nn.Module):
    """The same blocks under a plain ``nn.scan``: every activation is kept for backward."""

    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            lambda block, carry, _: (block(carry), None),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.depth,
        )
        x, _ = stack(Block(self.width, self.depth, name="blocks"), x, None)
        return x


class DigitsClassifier(torch.nn.Module):
    """torch embedding -> Flax trunk (FlaxModule) -> torch head."""

    def __init__(self, width: int, lengths: tuple[int, ...]):
        super().__init__()
        self.embed = torch.nn.Linear(64, width)
        self.trunk = FlaxModule(
            RematScanTrunk(width, lengths), example_args=(torch.zeros(1, width),)
        )
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 10))

    def forward(self, images):
        return self.head(self.trunk(self.embed(images)))


def held_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes ``module`` keeps for its backward on input ``x``, beyond its parameters and ``x``.

    Every tensor autograd saves passes through ``saved_tensors_hooks``; storages that are a
    parameter or the input are not extra memory, so they are left out.
    """
    known = {p.untyped_storage().data_ptr() for p in module.parameters()}
    known.add(x.untyped_storage().data_ptr())
    held = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in known:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    y.backward(torch.randn_like(y))
    return sum(held.values())


def split_depth(depth: int) -> tuple[int, int]:
    """Two scan lengths whose product is ``depth``, as close to its square root as possible."""
    outer = max(d for d in range(1, math.isqrt(depth) + 1) if depth % d == 0)
    return outer, depth // outer


def load_data(seed: int, limit: int | None = None):
    """Train and held-out images and labels (at most ``limit`` of each), standardized."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-3)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, digits.target, test_size=0.2, random_state=seed, stratify=digits.target
    )
    return tuple(torch.from_numpy(a[:limit]) for a in (x_tr, y_tr, x_te, y_te))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=128, help="blocks in the Flax trunk")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--limit", type=int, default=None, help="use only this many images")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load_data(args.seed, args.limit)
    lengths = split_depth(args.depth)
    model = DigitsClassifier(args.width, lengths)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"digits: {len(x_tr)} train / {len(x_te)} held-out images; trunk: {args.depth} Flax "
        f"blocks (remat_scan lengths {lengths}), {n_params:,} parameters, all owned by torch"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    steps_per_epoch = len(x_tr) // args.batch
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=max(args.epochs * steps_per_epoch, 1)
    )
    loss_fn = torch.nn.CrossEntropyLoss()

    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_tr))
        # drop_last: every step has the same shapes, so the trunk compiles once.
        batches = [
            order[i : i + args.batch] for i in range(0, len(order) - args.batch + 1, args.batch)
        ]
        total = 0.0
        bar = tqdm(batches, desc=f"epoch {epoch}/{args.epochs}", leave=False)
        for idx in bar:
            loss = loss_fn(model(x_tr[idx]), y_tr[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_te).argmax(-1) == y_te).float().mean().item()
        print(
            f"epoch {epoch:2d}/{args.epochs}  train loss {total / max(len(batches), 1):.4f}  "
            f"held-out accuracy {accuracy:.3f}  ({time.perf_counter() - start:5.1f} s)"
        )

    # Memory the trunk holds between forward and backward, for one training batch.
    h = model.embed(x_tr[: args.batch]).detach().requires_grad_()
    remat = held_bytes(model.trunk, h)
    plain = FlaxModule(
        ScanTrunk(args.width, args.depth), example_args=(torch.zeros(1, args.width),)
    )
    no_remat = held_bytes(plain, h)
    print(
        f"trunk held for backward (batch {len(h)}): {remat / 2**20:.3f} MiB with remat_scan "
        f"{lengths}, {no_remat / 2**20:.3f} MiB for the same {args.depth} blocks without remat "
        f"({no_remat / max(remat, 1):.0f}x more)"
    )
    elapsed = time.perf_counter() - start
    print(f"total {elapsed:.1f} s (compiles included)")
    return {
        "accuracy": accuracy,
        "held_remat": remat,
        "held_no_remat": no_remat,
        "seconds": elapsed,
    }


if __name__ == "__main__":
    main()
