"""Flax modules (Linen, NNX) as adapters: named leaves, an apply per mode, state updates.

Above ``program``: the adapters' functions are what a ``Program`` compiles.
"""
