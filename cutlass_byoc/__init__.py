"""cutlass-byoc: conv2d (fprop, dgrad, wgrad) on CUTLASS kernels generated, compiled, profiled and cached here."""

__version__ = "0.1.0"
