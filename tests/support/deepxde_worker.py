"""One DeepXDE training run, in a process of its own: ``python deepxde_worker.py KIND OUT``.

DeepXDE (pytorch backend) solves ``-Δu = 2π² sin(πx) sin(πy)`` on the unit square with
``u = 0`` on its boundary; its PDE loss takes ``dde.grad.hessian`` of the network, so each
Adam step differentiates the network three times. The network is ``Linear(2, 16)``, tanh,
a trunk of 4 residual tanh layers, ``Linear(16, 1)``: ``KIND`` "flax" runs the trunk as a
FlaxModule over ``nn.remat_scan``, "torch" as its torch twin with the same weights. Writes
``OUT`` (``torch.save``): DeepXDE's training losses per display step and the trained
parameters by the torch twin's names.

A process of its own: importing DeepXDE picks its backend from the environment and, where
CUDA is available, makes it torch's default device.
"""

import os
import sys

os.environ["DDE_BACKEND"] = "pytorch"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import deepxde as dde  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from torchside import FlaxModule  # noqa: E402

WIDTH, LENGTHS, ITERATIONS, EVERY = 16, (2, 2), 60, 20


class Layer(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + jnp.tanh(nn.Dense(WIDTH)(h))


class Trunk(nn.Module):
    @nn.compact
    def __call__(self, h):
        return nn.remat_scan(nn.remat(Layer), lengths=LENGTHS)(name="stack")(h)


class TorchTrunk(torch.nn.Module):
    """``Trunk`` in torch: one Linear per layer, in the scan's order."""

    def __init__(self, kernel: np.ndarray, bias: np.ndarray):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))
        with torch.no_grad():
            for layer, k, b in zip(self.layers, kernel.reshape(4, WIDTH, WIDTH),
                                   bias.reshape(4, WIDTH), strict=True):
                layer.weight.copy_(torch.from_numpy(k.T.copy()))
                layer.bias.copy_(torch.from_numpy(b.copy()))

    def forward(self, h):
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return h


class Net(dde.nn.NN):
    """DeepXDE's network contract (``dde.nn.NN``) around the torch layers and the trunk."""

    def __init__(self, trunk: torch.nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(2, WIDTH), torch.nn.Linear(WIDTH, 1)
        self.trunk = trunk

    def forward(self, x):
        return self.out(self.trunk(torch.tanh(self.inp(x))))


def pde(x, u):
    laplacian = dde.grad.hessian(u, x, i=0, j=0) + dde.grad.hessian(u, x, i=1, j=1)
    source = 2 * np.pi**2 * torch.sin(np.pi * x[:, 0:1]) * torch.sin(np.pi * x[:, 1:2])
    return laplacian + source


def main(kind: str, out: str) -> None:
    dde.config.set_random_seed(0)
    geometry = dde.geometry.Rectangle([0, 0], [1, 1])
    bc = dde.icbc.DirichletBC(geometry, lambda x: np.zeros((len(x), 1)),
                              lambda _, on_boundary: on_boundary)
    data = dde.data.PDE(geometry, pde, bc, num_domain=64, num_boundary=32,
                        train_distribution="uniform")
    flax = FlaxModule(Trunk(), example_args=(torch.zeros(4, WIDTH),), seed=1)
    if kind == "flax":
        trunk = flax
    else:
        params = jax.tree_util.tree_map(np.asarray, flax.flax_variables())["params"]
        dense = params["stack"]["Dense_0"]
        trunk = TorchTrunk(dense["kernel"], dense["bias"])
    net = Net(trunk)
    initial = twin_state(net, flax if kind == "flax" else None)
    model = dde.Model(data, net)
    model.compile("adam", lr=1e-3)
    history, _ = model.train(iterations=ITERATIONS, display_every=EVERY, verbose=0)
    torch.save({"loss": torch.tensor(np.array(history.loss_train)), "initial": initial,
                "final": twin_state(net, flax if kind == "flax" else None)}, out)


def twin_state(net: Net, flax: FlaxModule | None) -> dict:
    """``net``'s parameters by the torch twin's names (copies)."""
    trunk = net.trunk
    if flax is not None:
        params = jax.tree_util.tree_map(np.asarray, flax.flax_variables())["params"]
        dense = params["stack"]["Dense_0"]
        trunk = TorchTrunk(dense["kernel"], dense["bias"])
    state = {f"trunk.{k}": v.clone() for k, v in trunk.state_dict().items()}
    state.update({k: v.clone() for k, v in net.state_dict().items()
                  if not k.startswith("trunk.")})
    return state


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
