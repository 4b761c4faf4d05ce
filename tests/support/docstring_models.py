"""Models from Flax's docstrings that more than one test file runs.

The corpus (``tests/corpus/``) reproduces each docstring example next to its test; the ones
here are also used elsewhere, so they live once, in our own code.
"""

import jax
from flax import nnx


# flax.nnx.scan docstring: Block (Linear + Dropout) stacked with split_rngs + vmap, then
# applied with nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry).
class Block(nnx.Module):
    def __init__(self, input_dim, features, *, rngs):
        self.linear = nnx.Linear(input_dim, features, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.dropout(self.linear(x)))


class Model(nnx.Module):
    """``num_layers`` ``Block``s with stacked stream keys, applied by ``nnx.scan``."""

    def __init__(self, num_layers, features, scan_kwargs=(), *, rngs):
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs):
            return Block(features, features, rngs=rngs)

        self.blocks = create_block(rngs)
        self.scan_kwargs = dict(scan_kwargs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, **self.scan_kwargs)
        def forward(x, model):
            return model(x)

        return forward(x, self.blocks)
