"""A model ``Sequential(Linear, FlaxModule(block), Linear)`` and its loss in one FlaxModule.

The DDP and FSDP2 workers train both, with the same SGD steps (``sgd_steps``): the second
is the same function from the same weights with a scalar output, so it takes the
scalar-loss route (its gradients are computed in the forward and handed to ``.grad`` in
the backward).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchside import FlaxModule


class WithLoss(nn.Module):
    """``Dense -> block -> Dense`` and the mean squared error against ``y``."""

    block: nn.Module
    width: int
    out: int

    @nn.compact
    def __call__(self, x, y):
        h = self.block(nn.Dense(self.width, name="inp")(x))
        return jnp.mean((nn.Dense(self.out, name="out")(h) - y) ** 2)


def with_loss(model: torch.nn.Sequential, block: nn.Module) -> FlaxModule:
    """``model``'s function and weights, and its mean squared error, in one FlaxModule."""

    def dense(linear):
        return {"kernel": linear.weight.detach().numpy().T.copy(),
                "bias": linear.bias.detach().numpy().copy()}

    inp, wrapped, out = model
    params = {"inp": dense(inp), "out": dense(out),
              "block": jax.tree_util.tree_map(lambda a: np.asarray(a).copy(),
                                              wrapped.flax_variables()["params"])}
    return FlaxModule(WithLoss(block, inp.out_features, out.out_features),
                      variables={"params": params})


def save_routes(owner, path: str) -> None:
    """Writes, as JSON, the kinds of program the owner's calls ran (``pipeline``).

    The loss-inside model must run ``value_and_grad`` alone (the fused route): a silent
    fall-back to a forward and a backward program would train the same and pass unseen.
    """
    import json

    from tests.support import pipeline

    with open(path, "w") as f:
        json.dump(sorted({kind for _, kind, _ in pipeline.executables_run(owner)}), f)


def sgd_steps(model, rank: int, world: int, *, steps: int, batch: int, sizes: tuple[int, int],
              loss_inside: bool, device="cpu") -> None:
    """``steps`` SGD steps (lr 0.1) on rank ``rank``'s rows of each batch.

    Every process draws the same batches (one generator, seeded 1) and takes its
    ``batch // world`` rows, so the ranks together see what the single process sees.
    ``sizes``: the features of inputs and targets. ``loss_inside``: ``model(x, y)`` is the
    loss; else the mean squared error of ``model(x)`` in float32.
    """
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(batch, sizes[0], generator=gen)
        y = torch.randn(batch, sizes[1], generator=gen)
        rows = slice(rank * batch // world, (rank + 1) * batch // world)
        x, y = x[rows].to(device), y[rows].to(device)
        loss = model(x, y) if loss_inside else torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
