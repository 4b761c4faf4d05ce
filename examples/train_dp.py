"""Train a classifier with differential privacy (DP-SGD, Opacus) whose trunk is a Flax stack.

What this shows:
    A PyTorch model (torch embedding, a ``FlaxModule`` over an ``nn.remat_scan`` trunk, torch
    head) trained with Opacus's ``PrivacyEngine.make_private_with_epsilon``, the user's
    Opacus code unchanged: Opacus clips each sample's gradient and adds noise; the Flax
    trunk's per-sample gradients come from one JAX program (``jax.vmap`` of the trunk's
    VJP, its remat policy kept), the torch layers' from Opacus's own hooks. The script prints
    the held-out accuracy and the privacy spent (epsilon at the chosen delta) after each
    epoch.

    The data is scikit-learn's bundled digits set (1797 8x8 images, no download). Poisson
    sampling (Opacus's default, the one its accountant assumes) draws batches of varying
    size: the bridge compiles one program per batch size it meets, so the first epoch is the
    slow one (the script prints how many sizes it compiled for).

How to run (about two minutes on 2 CPU cores):
    pip install -e '.[examples,dp]'
    python examples/train_dp.py
    python examples/train_dp.py --epsilon 1.0 --epochs 10   # a tighter budget
    python examples/train_dp.py --ghost                     # fast gradient clipping
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

# torch's OpenMP threads spin after each parallel region by default and would steal the
# cores XLA is about to use; passive waiting lets both runtimes share a small CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import flax.linen as nn  # noqa: E402
import torch  # noqa: E402
from opacus import PrivacyEngine  # noqa: E402
from opacus.validators import ModuleValidator  # noqa: E402
from train_digits import load_data, split_depth  # noqa: E402

from torchside import FlaxModule  # noqa: E402


class Block(nn.Module):
    """Residual MLP block without normalisation state: ``x + Dense(w)(tanh(Dense(w)(x)))``."""

    width: int

    @nn.compact
    def __call__(self, x):
        return x + 0.5 * nn.Dense(self.width)(nn.tanh(nn.Dense(self.width)(x)))


class Trunk(nn.Module):
    width: int
    lengths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        return nn.remat_scan(nn.remat(Block), lengths=self.lengths)(self.width, name="blocks")(x)


def make_model(width: int, depth: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, width),
        # Poisson sampling meets a new batch size every few steps, each compiled once: the
        # recompile warning, which would say so, is expected here.
        FlaxModule(Trunk(width, split_depth(depth)), example_args=(torch.zeros(1, width),),
                   recompile_warning=None),
        torch.nn.Linear(width, 10))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=16, help="blocks in the Flax trunk")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=128, help="expected batch size")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--epsilon", type=float, default=4.0, help="privacy budget")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--clip", type=float, default=1.0, help="per-sample gradient norm")
    parser.add_argument("--ghost", action="store_true",
                        help="Opacus's fast gradient clipping (per-sample norms only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="use only this many images")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load_data(args.seed, args.limit)
    model = make_model(args.width, args.depth)
    errors = ModuleValidator.validate(model)
    assert not errors, errors  # a Flax block with batch statistics would be reported here
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_tr, y_tr),
                                         batch_size=args.batch)
    engine = PrivacyEngine()
    private = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=args.lr),
        data_loader=loader, target_epsilon=args.epsilon, target_delta=args.delta,
        epochs=args.epochs, max_grad_norm=args.clip, criterion=torch.nn.CrossEntropyLoss(),
        grad_sample_mode="ghost" if args.ghost else "hooks")
    dp_model, optimizer, loader = private[0], private[1], private[-1]
    loss_fn = private[2] if args.ghost else torch.nn.CrossEntropyLoss()
    print(f"digits: {len(x_tr)} train / {len(x_te)} held-out images; Flax trunk of "
          f"{args.depth} blocks (remat_scan {split_depth(args.depth)}); DP-SGD to epsilon "
          f"{args.epsilon} at delta {args.delta}: noise multiplier "
          f"{optimizer.noise_multiplier:.2f}, clip {args.clip}, "
          f"{'ghost (fast gradient) clipping' if args.ghost else 'per-sample gradients'}")
    sizes, accuracy = set(), 0.0
    for epoch in range(1, args.epochs + 1):
        dp_model.train()
        for x, y in loader:
            # Poisson sampling may draw an empty batch: it steps too (noise only), as the
            # accountant assumes; its loss is nan and its per-sample gradients are empty.
            sizes.add(len(x))
            optimizer.zero_grad()
            loss_fn(dp_model(x), y).backward()
            optimizer.step()
        dp_model.eval()
        with torch.no_grad():
            accuracy = (dp_model(x_te).argmax(-1) == y_te).float().mean().item()
        epsilon = engine.get_epsilon(args.delta)
        print(f"epoch {epoch:2d}/{args.epochs}  held-out accuracy {accuracy:.3f}  epsilon "
              f"{epsilon:.2f} (delta {args.delta})  ({time.perf_counter() - start:5.1f} s)")
    print(f"batch sizes met (one compiled program each): {len(sizes)}; total "
          f"{time.perf_counter() - start:.1f} s")
    return {"accuracy": accuracy, "epsilon": engine.get_epsilon(args.delta)}


if __name__ == "__main__":
    with warnings.catch_warnings():
        # Opacus's note that its noise comes from torch's generator (secure_mode=False), and
        # its note that the hooked embedding's input (the data) needs no gradient.
        warnings.filterwarnings("ignore", "Secure RNG turned off")
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        # The accountant's note that a larger order might give a tighter bound.
        warnings.filterwarnings("ignore", "Optimal order is the largest alpha")
        main()
