"""Quickstart: a 64-layer Flax remat-scan block inside a torch model, trained by torch.

What this shows: a Flax Linen stack (nested ``nn.remat_scan`` over ``nn.remat``) wrapped in
``FlaxModule`` sits between two ``torch.nn.Linear`` layers; ``torch.optim.AdamW`` trains all
of it on synthetic regression data; the bytes the Flax block holds for backward (seen
through torch's saved-tensor hooks) are printed next to its parameter bytes.

How to run:
    python examples/quickstart.py            # 50 steps
    python examples/quickstart.py --steps 5  # a smoke run
"""

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import flax.linen as nn  # noqa: E402
import torch  # noqa: E402

from torchside import FlaxModule  # noqa: E402


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(2 * self.width)(nn.LayerNorm()(x))
        return x + nn.Dense(self.width)(nn.gelu(h))


class DeepStack(nn.Module):
    width: int
    lengths: tuple = (8, 8)  # 64 layers; activation memory ~ 2 * sqrt(64) carries

    @nn.compact
    def __call__(self, x):
        return nn.remat_scan(nn.remat(Block), lengths=self.lengths)(self.width, name="stack")(x)


def held_bytes(module: torch.nn.Module, *inputs) -> int:
    """Bytes saved for backward by ``module``, excluding its parameters and the inputs."""
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = module(*inputs)
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    skip |= {x.untyped_storage().data_ptr() for x in inputs}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed}
    del out
    return sum(n for ptr, n in storages.items() if ptr not in skip)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)

    features, width = 16, args.width
    x_all = torch.randn(512, features)
    target = torch.sin(x_all @ torch.randn(features, 1))

    trunk = FlaxModule(DeepStack(width), example_args=(torch.zeros(args.batch, width),))
    model = torch.nn.Sequential(torch.nn.Linear(features, width), trunk, torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    print(f"Flax trunk: 64 layers, {sum(p.numel() for p in trunk.parameters()):,} parameters "
          f"in {len(list(trunk.parameters()))} torch Parameters")

    for step in range(args.steps):
        idx = torch.randint(0, len(x_all), (args.batch,))
        loss = torch.nn.functional.mse_loss(model(x_all[idx]), target[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    h = torch.randn(args.batch, width, requires_grad=True)
    held = held_bytes(trunk, h)
    params = sum(p.numel() * p.element_size() for p in trunk.parameters())
    print(f"held for backward by the Flax block: {held:,} bytes "
          f"({held / params:.2%} of its {params:,} parameter bytes)")


if __name__ == "__main__":
    main()
