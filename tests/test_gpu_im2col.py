"""The im2col lowering of the GEMM family (convs of few input channels, e.g. the RGB stem) on an H100/H200: fprop
(every epilogue source, activation, 16-bit and fp32 outputs), dgrad (col2im of fp32 columns) and wgrad (fp32 sums
over chunks, stream-K and split-k) against a float64 PyTorch reference, on odd image sizes, strides, paddings,
dilations and channel counts, and on batches spanning several chunks. Fresh random inputs per test; every output is
filled with NaN first, so an element the kernels fail to write shows up as an error.

The module compiles 7 GEMM kernels (~60-90 s each, in parallel; 3 of them are the compile tests' own).
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")

from cutlass_byoc import ops  # noqa: E402
from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.gemm1x1 import im2col_config  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.types import Activation, SourceKind  # noqa: E402

from gpu_util import check_launch, module_kernels, operands, poisoned_output  # noqa: E402
from test_compile_im2col import KERNELS as COMPILE_KERNELS  # noqa: E402

pytestmark = pytest.mark.gpu


def problem(kind, dtype="f16", out=None, act=Activation.IDENTITY, source=SourceKind.NONE, *, n=3, c=3, hw=(37, 45),
            k=64, r=7, stride=2, pad=3, dil=1) -> Conv2dProblem:
    return Conv2dProblem.make(kind, n, c, hw[0], hw[1], k, r, stride=stride, padding=pad, dilation=dil, dtype=dtype,
                              out_dtype=out or dtype, epilogue=Epilogue(act, source))


def cfg(kind, dtype, out, act, tile, schedule):
    return im2col_config(problem(kind, dtype, out, act), tile, schedule)


#: The compile tests' three (fprop f16 ReLU ping-pong, dgrad f16 ping-pong, wgrad f16 stream-K) and four more: bf16 ->
#: fp32 fprop (cooperative), bf16 dgrad on the stream-K scheduler, fp32-output wgrad with the nondeterministic
#: stream-K reduction, bf16 wgrad on ping-pong.
KERNELS = {
    "fprop": COMPILE_KERNELS["fprop"][1],
    "dgrad": COMPILE_KERNELS["dgrad"][1],
    "wgrad": COMPILE_KERNELS["wgrad"][1],
    "fprop_f32": cfg("fprop", "bf16", "f32", Activation.IDENTITY, (128, 64, 64), "cooperative"),
    "dgrad_bf16": cfg("dgrad", "bf16", "bf16", Activation.IDENTITY, (128, 64, 64), "cooperative_streamk"),
    "wgrad_nd_f32": cfg("wgrad", "f16", "f32", Activation.IDENTITY, (128, 64, 64), "cooperative_streamk_nd"),
    "wgrad_bf16": cfg("wgrad", "bf16", "bf16", Activation.IDENTITY, (64, 64, 64), "pingpong"),
}


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    with module_kernels(shared_cache, lambda: KERNELS.values()):
        yield


def problem_for(name, source=SourceKind.NONE, **kw) -> Conv2dProblem:
    c = KERNELS[name]
    return problem(c.kind.value, c.element_a.value, c.element_out.value, c.activation, source, **kw)


def check(p: Conv2dProblem, name: str, seed: int, slices: int = 1):
    """Runs `p` on kernel `name` (epilogue included) and compares with the float64 reference."""
    launch = LaunchConfig(KERNELS[name], slices)
    assert launch.reject_reason(p) is None
    check_launch(p, launch, seed)


SOURCES = [SourceKind.NONE, SourceKind.BIAS, SourceKind.RESIDUAL]


@pytest.mark.parametrize("name", ["fprop", "fprop_f32"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.value)
def test_fprop_stem_epilogues_and_output_types(name, source):
    check(problem_for(name, source), name, seed=hash((name, source.value)) % 2**31)


@pytest.mark.parametrize("name", ["dgrad", "dgrad_bf16", "wgrad", "wgrad_nd_f32", "wgrad_bf16"])
def test_dgrad_wgrad_stem(name):
    check(problem_for(name), name, seed=hash(name) % 2**31)


#: (C, H x W, R, stride, padding, dilation): a grayscale 3x3, a 5x5 stride-1, RGB 3x3 stride 2 with odd sizes,
#: C=5 dilated, C=6 with a 3x5-tap row of 90 (Kp 96), C=2 11x11 stride 4 (AlexNet-like, RSC 242 -> 64 rows per CTA).
SHAPES = [(1, (19, 23), 3, 1, 1, 1), (3, (20, 17), 5, 1, 2, 1), (3, (33, 31), 3, 2, 1, 1), (5, (21, 18), 3, 1, 2, 2),
          (6, (16, 16), 5, 2, 0, 1), (2, (63, 63), 11, 4, 2, 1)]


@pytest.mark.parametrize("name", ["fprop", "dgrad", "wgrad", "wgrad_nd_f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"c{s[0]}_{s[1][0]}x{s[1][1]}_r{s[2]}_u{s[3]}_p{s[4]}_d{s[5]}")
def test_shapes(name, shape):
    c, hw, r, stride, pad, dil = shape
    source = SourceKind.BIAS if name == "fprop" else SourceKind.NONE
    check(problem_for(name, source, c=c, hw=hw, r=r, stride=stride, pad=pad, dil=dil, k=72), name,
          seed=hash((name, shape)) % 2**31)


@pytest.mark.parametrize("name", ["fprop", "dgrad", "wgrad", "wgrad_nd_f32"])
def test_batches_of_several_chunks(name):
    """The stem at batch 40, 224x224: fprop and wgrad take 17 images per 64 MiB chunk of im2col rows (3 chunks, the
    last of 6 images), dgrad 8 per chunk of fp32 columns (5 chunks); wgrad adds the chunks' sums in fp32."""
    check(problem_for(name, n=40, hw=(224, 224)), name, seed=hash(("chunks", name)) % 2**31)


@pytest.mark.parametrize("name,slices", [("wgrad", 4), ("wgrad_nd_f32", 16), ("dgrad_bf16", 3)])
def test_split_k(name, slices):
    check(problem_for(name), name, seed=hash(("split", name)) % 2**31, slices=slices)


def test_refusals_through_ops():
    p = problem_for("dgrad").replace(epilogue=Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL))
    why = LaunchConfig(KERNELS["dgrad"]).reject_reason(p)
    assert why and "source" in why
    p = problem_for("fprop", c=8)  # 8 channels read in 16-byte accesses: not a lowering problem
    assert "channels" in LaunchConfig(KERNELS["fprop"]).reject_reason(p)
    x, w, dy = operands(problem_for("fprop"), 0)
    out = poisoned_output(problem_for("fprop"))
    with pytest.raises(ops.UnsupportedConvError, match="channels"):
        ops.run_problem(p, x, w, out, config=LaunchConfig(KERNELS["fprop"]))

