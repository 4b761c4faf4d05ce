"""FlaxModule as a torch.nn.Module: variables, state, RNG, NNX, dtypes, copies."""
