"""``remat_stack`` (Linen and NNX), its loop lengths, and the memory a block holds."""
