"""torchside.parity and parity against torch twins."""
