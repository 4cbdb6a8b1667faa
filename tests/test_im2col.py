"""CPU tests of the GEMM family's im2col lowering (convs of few input channels): configs, names and rules, which
problems it takes, the planner's own budget for it, the model, and the rendered source."""

from __future__ import annotations

import dataclasses

import pytest

from cutlass_byoc import gemm1x1
from cutlass_byoc.config import KernelConfig
from cutlass_byoc.gemm1x1 import IM2COL, im2col_candidates, im2col_config, im2col_reject_reason, lowered_gemm_mnk
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.profiler.plan import launches_for, plan_problem
from cutlass_byoc.render import render
from cutlass_byoc.types import Activation, DType, KernelFamily, SourceKind, StrideSupport

STEM = {k: Conv2dProblem.make(k, 32, 3, 224, 224, 64, 7, stride=2, padding=3) for k in ("fprop", "dgrad", "wgrad")}


def test_config_name_alignments_and_json():
    c = im2col_config(STEM["fprop"])
    assert c.family is KernelFamily.SM90_GEMM_1X1 and c.lowering == IM2COL
    assert c.name.endswith("_im2col_sm90") and "_strided_align118_" in c.name
    assert (c.align_a, c.align_b, c.align_c) == (1, 1, 8)  # x, w element-wise; y by TMA
    d = im2col_config(STEM["dgrad"])
    assert (d.align_a, d.align_b, d.align_c) == (8, 1, 1)  # dy by TMA; w and dx element-wise
    assert KernelConfig.from_dict(c.to_dict()) == c and c.to_dict()["lowering"] == "im2col"
    # an unlowered config's JSON has no lowering key (so its source and cache key are unchanged)
    plain = gemm1x1.gemm1x1_config(Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 1))
    assert "lowering" not in plain.to_dict() and "im2col" not in plain.name


def test_static_rules():
    c = im2col_config(STEM["fprop"])
    with pytest.raises(ValueError, match="lowers with"):
        dataclasses.replace(c, lowering="winograd")
    with pytest.raises(ValueError, match="strided"):
        dataclasses.replace(c, stride_support=StrideSupport.UNITY)
    with pytest.raises(ValueError, match="alignments"):
        dataclasses.replace(c, align_a=8)
    with pytest.raises(ValueError, match="activation"):
        dataclasses.replace(im2col_config(STEM["dgrad"]), activation=Activation.RELU)
    sm80 = next(iter(__import__("cutlass_byoc.candidates", fromlist=["x"]).sm80_candidates(STEM["fprop"])))
    with pytest.raises(ValueError, match="only the GEMM 1x1 family"):
        dataclasses.replace(sm80, lowering=IM2COL)
    # the fp32 GEMM output of dgrad/wgrad sizes the epilogue's shared memory
    assert gemm1x1.gemm_output(im2col_config(STEM["wgrad"])) is DType.F32
    assert gemm1x1.gemm_output(c) is DType.F16


def test_which_problems_it_takes():
    for p in STEM.values():
        assert im2col_reject_reason(p) is None
        assert list(im2col_candidates(p))
    assert "channels" in im2col_reject_reason(STEM["fprop"].replace(c=8))
    assert "channels" in im2col_reject_reason(STEM["fprop"].replace(c=4))  # 8-byte accesses: the 2.x kernels take it
    assert "R*S*C" in im2col_reject_reason(STEM["fprop"].replace(c=17))
    assert "16-byte" in im2col_reject_reason(STEM["fprop"].replace(k=33))  # the odd 7->33 layer: y rows by TMA
    assert "source" in im2col_reject_reason(STEM["dgrad"].replace(epilogue=Epilogue(source=SourceKind.RESIDUAL)))
    assert im2col_reject_reason(STEM["fprop"].replace(epilogue=Epilogue(Activation.RELU, SourceKind.BIAS))) is None
    assert "groups" in im2col_reject_reason(STEM["fprop"].replace(c=6, k=64, groups=2))
    assert "f16/bf16" in im2col_reject_reason(Conv2dProblem.make("fprop", 2, 3, 32, 32, 64, 3, dtype="f32"))
    # a lowered kernel refuses problems through the config rules like any other
    c = im2col_config(STEM["fprop"])
    assert c.reject_reason(STEM["fprop"]) is None
    assert "kind" in c.reject_reason(STEM["wgrad"])
    assert "activation" in c.reject_reason(STEM["fprop"].replace(epilogue=Epilogue(Activation.RELU)))


def test_gemm_shapes_and_model():
    assert lowered_gemm_mnk(STEM["fprop"]) == (32 * 112 * 112, 64, 147)  # 147 taps: the transposed matrices need
    assert lowered_gemm_mnk(STEM["dgrad"]) == (32 * 112 * 112, 147, 64)  # no padding of RSC
    assert lowered_gemm_mnk(STEM["wgrad"]) == (64, 147, 32 * 112 * 112)
    for kind, p in STEM.items():
        us = min(t for k in im2col_candidates(p) for t, _ in launches_for(p, k))
        # the best launch (wgrad: a split reduction) is memory-bound: the conv's bytes plus the im2col (or fp32 T) matrix written and read, at ~3 TB/s
        assert 20 < us < 400, (kind, us)


def test_plan_gives_the_lowering_its_own_budget():
    for kind, p in STEM.items():
        plan = plan_problem(p, 8)
        lowered = {c.launch.kernel for c in plan.candidates if c.launch.kernel.lowering}
        others = [c for c in plan.candidates if not c.launch.kernel.lowering]
        assert len(lowered) == 4, kind  # max(2, 8 // 2) kernels on top of the problem's budget
        assert len({c.launch.kernel for c in others}) >= 6, kind  # the implicit-GEMM kernels keep theirs
        assert len({k.tile[:2] for k in lowered}) >= 3, kind  # spread over tile shapes
    # a problem the lowering does not take gets none
    plan = plan_problem(Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1), 8)
    assert not any(c.launch.kernel.lowering for c in plan.candidates)


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_rendered_source(kind):
    c = im2col_config(STEM[kind], (128, 64, 64), "cooperative_streamk")
    src = render(c, "nvcc ...")
    assert src.startswith(f"// {c.name}\n") and "lowered to a CUTLASS 3.x GEMM through an explicit im2col" in src
    assert "namespace cb_lowered" in src and "kChunkBytes" in src
    assert ("im2col_kernel<<<" in src) == (kind != "dgrad")
    assert ("col2im_kernel<<<" in src) == (kind == "dgrad")
    assert ("::pad_filter_kernel<<<" in src) == (kind != "wgrad")
    assert ("unpad_filter_kernel<<<" in src) == (kind == "wgrad")
    assert ("using ElementGemmD = float;" in src) == (kind != "fprop")
    assert "//   lowering        im2col" in src
    plain = render(gemm1x1.gemm1x1_config(Conv2dProblem.make(kind, 32, 64, 56, 56, 64, 1)), "nvcc ...")
    assert "im2col" not in plain and "cb_lowered" not in plain
