"""Offload of conv2d from PyTorch FX graphs to cutlass-byoc kernels (the `cutlass_byoc` torch.compile backend)."""
