"""The layers the operand-rewrite tests (channel padding, space-to-depth) and the shared-memory im2col wgrad tests
share, CPU and GPU alike (no torch)."""

from __future__ import annotations

from cutlass_byoc.problem import Conv2dProblem


def stem(kind, n: int = 32, **kw) -> Conv2dProblem:
    """ResNet-50's stem (3 -> 64 channels, 7x7 stride 2, 224x224) at batch n."""
    return Conv2dProblem.make(kind, n, 3, 224, 224, 64, 7, stride=2, padding=3, **kw)


def odd(kind, n: int = 32, **kw) -> Conv2dProblem:
    """The default workload's odd-channel layer (7 -> 33 channels, 3x3, 56x56) at batch n."""
    return Conv2dProblem.make(kind, n, 7, 56, 56, 33, 3, padding=1, **kw)


#: wgrad of few input channels past the stem's (the shared-memory im2col kernel's cases; fp32 out but where noted):
#: two channel blocks, three tap blocks, dilation, stride 3 on odd sizes, 1x1, a rectangular filter and stride with
#: f16 out, no padding.
SMEM_WGRAD_CASES = {
    "c3_k96_two_blocks": Conv2dProblem.make("wgrad", 2, 3, 33, 35, 96, 7, stride=2, padding=3, out_dtype="f32"),
    "c7_343_taps_three_blocks": Conv2dProblem.make("wgrad", 2, 7, 29, 27, 16, 7, padding=3, out_dtype="f32"),
    "c1_5x5_dil2": Conv2dProblem.make("wgrad", 2, 1, 31, 29, 24, 5, padding=4, dilation=2, out_dtype="f32"),
    "c5_3x3_s3_odd": Conv2dProblem.make("wgrad", 3, 5, 17, 19, 40, 3, stride=3, out_dtype="f32"),
    "c3_1x1": Conv2dProblem.make("wgrad", 2, 3, 9, 11, 16, 1, out_dtype="f32"),
    "c6_rect_s2x1_f16_out": Conv2dProblem.make("wgrad", 2, 6, 20, 23, 64, 3, 5, stride=(2, 1), padding=(1, 2)),
    "c3_stem_no_pad": Conv2dProblem.make("wgrad", 2, 3, 45, 47, 64, 7, stride=2, out_dtype="f32"),
}
#: 10x10 in, 3x3 stride 2 without padding: 4x4 out, and x's last row and column read by no output pixel (but by the
#: pixels past P and Q of a kernel's tile).
INF_WGRAD = Conv2dProblem.make("wgrad", 2, 3, 10, 10, 16, 3, stride=2, out_dtype="f32")
