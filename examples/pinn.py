"""A physics-informed network for a 2-D Poisson problem, trained from a plain torch loop.

What this shows: the loss holds second derivatives of the network in its inputs (the
Laplacian, by ``torch.autograd.grad`` with ``create_graph=True``), so each training step
differentiates the network three times: twice in the inputs, once more in the parameters.
The network's trunk is a deep Flax ``nn.remat_scan`` block in a ``FlaxModule`` between
torch layers; every derivative through it is computed by JAX (NOTE [Higher order] in
``torchside/edges/_higher.py``). Problem: ``-laplace(u) = f`` on the unit square with ``u = 0`` on
its boundary, ``f = 2 pi^2 sin(pi x) sin(pi y)``, whose exact solution is ``u = sin(pi x)
sin(pi y)``. The boundary condition is built into the network's output (it is multiplied
by ``x (1 - x) y (1 - y)``), and Adam minimizes the mean squared residual of the equation
at random points. It prints the loss and the relative L2 error against the exact solution
on a grid, and saves a plot of the solution and its error (no download; about a minute on
2 CPU cores).

With ``--fast`` the loss is written in JAX instead (``jax_loss``) and called through one
``jax_function`` of the model's own tensors (``fast_loss``): the same training, its
derivatives taken inside one JAX program. That is the fast path when torch would ask for
the same derivative chain every step; the default (torch's nested ``autograd.grad``)
works for any loss torch can write.

How to run:
    python examples/pinn.py                      # 600 steps
    python examples/pinn.py --fast               # the same, the loss as one jax_function
    python examples/pinn.py --steps 20 --out /tmp/pinn   # a smoke run
"""

import argparse
import functools
import math
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from torchside import FlaxModule, jax_function  # noqa: E402


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


def jax_loss(trunk: nn.Module, variables, w_in, b_in, w_out, b_out, xy):
    """The same loss written in JAX: ``PINN``'s network with these weights, its Laplacian by
    nested ``jax.grad`` of sums over the points (as torch takes it), the mean squared
    residual."""
    def u_sum(xy):
        net = trunk.apply(variables, jnp.tanh(xy @ w_in.T + b_in)) @ w_out.T + b_out
        x, y = xy[:, :1], xy[:, 1:]
        return (x * (1 - x) * y * (1 - y) * net).sum()

    grad = jax.grad(u_sum)
    lap = sum(jax.grad(lambda xy, i=i: grad(xy)[:, i].sum())(xy)[:, i] for i in range(2))
    f = 2 * math.pi**2 * jnp.sin(math.pi * xy[:, 0]) * jnp.sin(math.pi * xy[:, 1])
    return jnp.mean((lap + f) ** 2)


def fast_loss(model: PINN):
    """The fast path: the whole loss, its derivatives included, as one ``jax_function`` of the
    model's own tensors (the trunk's by ``flax_variable_tensors()``). A scalar output: one
    program, the one ``jit(value_and_grad)`` compiles; the gradients reach every parameter
    of ``model`` as from ``loss(model, xy)``."""
    loss = jax_function(functools.partial(jax_loss, model.trunk.flax_module))
    return lambda xy: loss(model.trunk.flax_variable_tensors(), model.inp.weight,
                           model.inp.bias, model.out.weight, model.out.bias, xy)


def loss(model: PINN, xy: torch.Tensor) -> torch.Tensor:
    """The mean squared residual of the equation, derivatives taken by torch."""
    return (laplacian(model(xy), xy) + source(xy)).pow(2).mean()


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
    parser.add_argument("--fast", action="store_true",
                        help="the loss as one jax_function (fast_loss) instead of torch's "
                             "nested autograd.grad through the trunk")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = PINN(args.width, tuple(args.lengths))
    step_loss = fast_loss(model) if args.fast else functools.partial(loss, model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    print(f"trunk: {math.prod(args.lengths)} layers of width {args.width} under "
          f"nn.remat_scan(lengths={tuple(args.lengths)}); relative error at start "
          f"{relative_error(model):.3f}")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        xy = torch.rand(args.points, 2, requires_grad=not args.fast)
        value = step_loss(xy)
        opt.zero_grad()
        value.backward()  # the third derivative through the Flax trunk
        opt.step()
        if step == 1 or step % max(1, args.steps // 10) == 0 or step == args.steps:
            print(f"step {step:4d}  loss {value.item():.4e}  relative L2 error "
                  f"{relative_error(model):.4f}  ({time.perf_counter() - start:.1f} s)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pinn.png")
    save_plot(model, path)
    print(f"final relative L2 error {relative_error(model):.4f}; plot: {path}")


if __name__ == "__main__":
    main()
