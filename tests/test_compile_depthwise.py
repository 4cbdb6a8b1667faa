"""Compile-only tests of the depthwise family: one kernel per kind (and a pipelined dgrad and wgrad, a "cols" wgrad,
fprop and strided dgrad, the "rows" and "taprows" schedules, the bias-vector kernels) rendered, built with nvcc for
sm_90a (no hidden warnings), loaded, and asked its host-side API (can_implement, workspace size; no GPU needed)."""

import pytest

from cutlass_byoc.build import build
from cutlass_byoc.depthwise import depthwise_candidates, pixel_tiles
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.runtime import KernelLibrary
from cutlass_byoc.types import Activation, ConvKind, SourceKind, SplitKMode

from compile_util import loaded_kernel, raw_can_implement  # noqa: E402

pytestmark = pytest.mark.compile

FPROP = Conv2dProblem.make("fprop", 32, 96, 112, 112, 96, 3, stride=2, padding=1, groups=96,
                           epilogue=Epilogue(Activation.SILU, SourceKind.BIAS))
STRIDED_DGRAD = Conv2dProblem.make("dgrad", 32, 144, 56, 56, 144, 5, stride=2, padding=2, groups=144)
WGRAD = Conv2dProblem.make("wgrad", 32, 576, 14, 14, 576, 3, padding=1, groups=576, dtype="bf16", out_dtype="f32")
FLIPPED_DGRAD = Conv2dProblem.make("dgrad", 32, 240, 28, 28, 240, 5, padding=2, groups=240)
WGRAD_5X5 = Conv2dProblem.make("wgrad", 32, 240, 28, 28, 240, 5, padding=2, groups=240, out_dtype="f32")
# the bias-vector epilogue: an fp32 bias with a residual (CPVT's positional conv: x + dwconv(x) with a bias)
VBIAS = Conv2dProblem.make("fprop", 32, 144, 56, 56, 144, 3, padding=1, groups=144,
                           epilogue=Epilogue(Activation.RELU6, SourceKind.BIAS_RESIDUAL, bias_dtype="f32"))


def pick(problem, **want):
    return next(c for c in depthwise_candidates(problem) if all(getattr(c, k) == v for k, v in want.items()))


KERNELS = {
    "fprop": (FPROP, pick(FPROP, halo_smem=True, align_a=8)),
    "strided_dgrad": (STRIDED_DGRAD, pick(STRIDED_DGRAD, align_a=8)),
    "wgrad": (WGRAD, pick(WGRAD, halo_smem=False, align_a=8)),
    "pipelined_dgrad": (FLIPPED_DGRAD, pick(FLIPPED_DGRAD, stages=2, align_a=4, min_blocks=None)),
    "pipelined_wgrad": (WGRAD_5X5, pick(WGRAD_5X5, stages=2, schedule=None, align_a=8, min_blocks=None)),
    "cols_wgrad": (WGRAD_5X5, pick(WGRAD_5X5, schedule="cols", stages=7, align_a=2, min_blocks=None)),
    "cols_fprop": (FPROP, pick(FPROP, schedule="cols", stages=8, align_a=4)),
    "cols_strided_dgrad": (STRIDED_DGRAD, pick(STRIDED_DGRAD, schedule="cols", stages=8, align_a=2)),
    "cluster_wgrad": (WGRAD, pick(WGRAD, halo_smem=False, align_a=8, split_k_mode=SplitKMode.CLUSTER)),
    "cluster_cols_wgrad": (WGRAD_5X5, pick(WGRAD_5X5, schedule="cols", stages=7, align_a=2, min_blocks=None,
                                           split_k_mode=SplitKMode.CLUSTER)),
    "vbias_fprop": (VBIAS, pick(VBIAS, halo_smem=True, stages=1, schedule=None, align_a=8, min_blocks=None)),
    "vbias_cols_fprop": (VBIAS, pick(VBIAS, schedule="cols", align_a=4, min_blocks=None, prefetch=None)),
    # the "rows" schedules (fprop and wgrad) and wgrad's "taprows": no unused declarations left in them either
    "rows_fprop": (FLIPPED_DGRAD.replace(kind=ConvKind.FPROP), pick(FLIPPED_DGRAD.replace(kind=ConvKind.FPROP),
                                                                     schedule="rows", min_blocks=None)),
    "rows_wgrad": (WGRAD, pick(WGRAD, schedule="rows", min_blocks=None)),
    "taprows_wgrad": (WGRAD_5X5, pick(WGRAD_5X5, schedule="taprows", min_blocks=None)),
}


@pytest.fixture(scope="module")
def built(shared_cache):
    return build([cfg for _, cfg in KERNELS.values()], cache=shared_cache)


@pytest.mark.parametrize("which", list(KERNELS))
def test_kernel_compiles_without_warnings_and_exports_the_api(built, which):
    problem, cfg = KERNELS[which]
    result = built[cfg]
    _, lib = loaded_kernel(result, cfg, problem)
    assert "warning" not in result.entry.log.lower(), result.entry.log
    assert lib.can_implement(problem.replace(n=1, h=17, w=9)) is None  # odd sizes: one kernel serves them all


def test_host_api_refuses_what_the_kernel_cannot_do(built):
    problem, cfg = KERNELS["fprop"]
    lib = KernelLibrary(cfg, built[cfg].library)
    assert raw_can_implement(lib, problem) is None
    assert raw_can_implement(lib, problem.replace(r=5, s=5, pad_h=2, pad_w=2)).startswith("filter")
    assert raw_can_implement(lib, problem.replace(stride_h=1, stride_w=1)).startswith("stride")
    assert raw_can_implement(lib, problem.replace(c=100, k=100, groups=100)).startswith("alignment")
    assert raw_can_implement(lib, problem, 2).startswith("split_k_slices")
    assert raw_can_implement(lib, problem.replace(dilation_h=2, dilation_w=2, pad_h=2, pad_w=2)).startswith("dilation")
    assert "alignment" in lib.can_implement(problem.replace(c=100, k=100, groups=100))
    assert lib.workspace_size(problem) == 0
    dgrad, dcfg = KERNELS["strided_dgrad"]
    dlib = KernelLibrary(dcfg, built[dcfg].library)
    assert "bias" in raw_can_implement(dlib, dgrad, source_kind=1)  # a bias, which only fprop takes


@pytest.mark.parametrize("which", ["vbias_fprop", "vbias_cols_fprop"])
def test_bias_vector_kernel_takes_a_bias_alone_or_with_a_residual(built, which):
    problem, cfg = KERNELS[which]
    assert cfg.element_bias.value == "f32" and "_vbiasf32_" in cfg.name
    lib = KernelLibrary(cfg, built[cfg].library)
    bias = {"bias": 0x50000}
    assert raw_can_implement(lib, problem, fields=bias) is None  # source_kind 3: the residual and the bias
    assert raw_can_implement(lib, problem, source_kind=1) is None  # the bias alone, as the source
    for kind in (0, 2):
        assert raw_can_implement(lib, problem, source_kind=kind, fields=bias).startswith("source_kind")
    assert raw_can_implement(lib, problem, fields={"bias": 0x50004}).startswith("bias")  # an fp32 vector of 4 or 8
    assert "using ElementBias = float;" in built[cfg].entry.source.read_text()


@pytest.mark.parametrize("which", ["wgrad", "pipelined_wgrad", "cols_wgrad"])
def test_wgrad_workspace_holds_fp32_partials_per_split(built, which):
    problem, cfg = KERNELS[which]
    lib = KernelLibrary(cfg, built[cfg].library)
    for splits in (1, 8, min(64, pixel_tiles(cfg, problem))):
        assert lib.can_implement(problem, split_k_slices=splits) is None
        assert lib.workspace_size(problem, splits) == splits * problem.r * problem.s * problem.c * 4


def test_cluster_split_wgrad_takes_at_most_a_cluster_of_splits_and_no_workspace(built):
    problem, cfg = KERNELS["cluster_wgrad"]
    lib = KernelLibrary(cfg, built[cfg].library)
    assert raw_can_implement(lib, problem, 8) is None
    assert raw_can_implement(lib, problem, 9).startswith("split_k_slices")
    assert lib.workspace_size(problem, 8) == 0
