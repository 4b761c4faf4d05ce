"""Devices: programs run where the tensors are; the device table; CUDA."""
