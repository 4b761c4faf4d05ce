"""A physics-informed network for a 2-D Poisson problem, trained from a plain torch loop.

What this shows: the loss holds second derivatives of the network in its inputs (the
Laplacian, by ``torch.autograd.grad`` with ``create_graph=True``), so each training step
differentiates the network three times: twice in the inputs, once more in the parameters.
The network's trunk is a deep Flax ``nn.remat_scan`` block in a ``FlaxModule`` between
torch layers; every derivative through it is computed by JAX (NOTE [Higher order] in
``torchside/_higher.py``). Problem: ``-laplace(u) = f`` on the unit square with ``u = 0`` on
its boundary, ``f = 2 pi^2 sin(pi x) sin(pi y)``, whose exact solution is ``u = sin(pi x)
sin(pi y)``. The boundary condition is built into the network's output (it is multiplied
by ``x (1 - x) y (1 - y)``), and Adam minimizes the mean squared residual of the equation
at random points. It prints the loss and the relative L2 error against the exact solution
on a grid, and saves a plot of the solution and its error (no download; about a minute on
2 CPU cores).

How to run:
    python examples/pinn.py                      # 600 steps
    python examples/pinn.py --steps 20 --out /tmp/pinn   # a smoke run
"""

import argparse
import math
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from torchside import FlaxModule  # noqa: E402


class Layer(nn.Module):
    """A smooth residual layer: the Laplacian needs second derivatives of the activation."""

    width: int

    @nn.compact
    def __call__(self, h):
        return h + jnp.tanh(nn.Dense(self.width)(h))


class Trunk(nn.Module):
    """``prod(lengths)`` layers under a nested, rematerialized scan."""

    width: int
    lengths: tuple = (2, 4)

    @nn.compact
    def __call__(self, h):
        return nn.remat_scan(Layer, lengths=self.lengths)(self.width, name="stack")(h)


class PINN(torch.nn.Module):
    """``u(x, y) = x (1 - x) y (1 - y) * net(x, y)``: zero on the boundary by construction."""

    def __init__(self, width: int, lengths: tuple):
        super().__init__()
        self.inp = torch.nn.Linear(2, width)
        self.trunk = FlaxModule(Trunk(width, lengths), example_args=(torch.zeros(1, width),))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, xy):
        x, y = xy[:, :1], xy[:, 1:]
        net = self.out(self.trunk(torch.tanh(self.inp(xy))))
        return x * (1 - x) * y * (1 - y) * net


def laplacian(u: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
    """``d2u/dx2 + d2u/dy2`` at each point, as a differentiable function of the parameters."""
    (grad,) = torch.autograd.grad(u.sum(), xy, create_graph=True)
    out = 0
    for i in range(xy.shape[1]):
        (second,) = torch.autograd.grad(grad[:, i].sum(), xy, create_graph=True)
        out = out + second[:, i : i + 1]
    return out


def source(xy: torch.Tensor) -> torch.Tensor:
    return 2 * math.pi**2 * exact(xy)


def exact(xy: torch.Tensor) -> torch.Tensor:
    return torch.sin(math.pi * xy[:, :1]) * torch.sin(math.pi * xy[:, 1:])


def relative_error(model: PINN, n: int = 64) -> float:
    """Relative L2 error against the exact solution on an ``n`` x ``n`` grid."""
    g = torch.linspace(0, 1, n)
    xy = torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    with torch.no_grad():
        err = model(xy) - exact(xy)
    return float(err.norm() / exact(xy).norm())


def save_plot(model: PINN, path: str, n: int = 64) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = torch.linspace(0, 1, n)
    xy = torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    with torch.no_grad():
        u = model(xy).reshape(n, n)
    err = (u - exact(xy).reshape(n, n)).abs()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, values, title in ((axes[0], u, "PINN solution"), (axes[1], err, "|error|")):
        im = ax.imshow(values.T, origin="lower", extent=(0, 1, 0, 1))
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--points", type=int, default=256, help="collocation points per step")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", default="examples/out", help="folder for pinn.png")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = PINN(args.width, tuple(args.lengths))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    print(f"trunk: {math.prod(args.lengths)} layers of width {args.width} under "
          f"nn.remat_scan(lengths={tuple(args.lengths)}); relative error at start "
          f"{relative_error(model):.3f}")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        xy = torch.rand(args.points, 2, requires_grad=True)
        residual = laplacian(model(xy), xy) + source(xy)
        loss = residual.pow(2).mean()
        opt.zero_grad()
        loss.backward()  # the third derivative through the Flax trunk
        opt.step()
        if step == 1 or step % max(1, args.steps // 10) == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4e}  relative L2 error "
                  f"{relative_error(model):.4f}  ({time.perf_counter() - start:.1f} s)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pinn.png")
    save_plot(model, path)
    print(f"final relative L2 error {relative_error(model):.4f}; plot: {path}")


if __name__ == "__main__":
    main()
