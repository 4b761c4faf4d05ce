"""Other libraries' ways of using an owner: Opacus's per-sample gradients, sharded blocks."""
