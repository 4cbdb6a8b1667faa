"""The layers the operand-rewrite tests (channel padding, space-to-depth) share, CPU and GPU alike (no torch)."""

from __future__ import annotations

from cutlass_byoc.problem import Conv2dProblem


def stem(kind, n: int = 32, **kw) -> Conv2dProblem:
    """ResNet-50's stem (3 -> 64 channels, 7x7 stride 2, 224x224) at batch n."""
    return Conv2dProblem.make(kind, n, 3, 224, 224, 64, 7, stride=2, padding=3, **kw)


def odd(kind, n: int = 32, **kw) -> Conv2dProblem:
    """The default workload's odd-channel layer (7 -> 33 channels, 3x3, 56x56) at batch n."""
    return Conv2dProblem.make(kind, n, 7, 56, 56, 33, 3, padding=1, **kw)
