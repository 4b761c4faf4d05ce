"""flaxside.remat_stack: values and gradients, layout, memory, lengths="auto"."""
