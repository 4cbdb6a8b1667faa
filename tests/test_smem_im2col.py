"""The shared-memory im2col family (cutlass_byoc/smem_im2col.py) on the CPU: its configs and rules, what the planner
offers it, its rendered source, and real sm_90a kernels (fprop, dgrad, wgrad) compiled and asked through their
host-side API."""

from __future__ import annotations

import dataclasses

import pytest

from cutlass_byoc.build import build
from cutlass_byoc.config import KernelConfig, LaunchConfig
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.profiler.plan import SMEM_IM2COL_BUDGET, plan_problem
from cutlass_byoc.render import render
from cutlass_byoc.smem_im2col import (MAX_PREFETCH, MAX_SLICES, MAX_TAPS, SHAPES, WGRAD_SHAPES, config, smem_bytes,
                                      smem_im2col_candidates)
from cutlass_byoc.types import Activation, DType, KernelFamily, SourceKind

from compile_util import loaded_kernel, raw_can_implement  # noqa: E402

STEM = Conv2dProblem.make("fprop", 32, 3, 224, 224, 64, 7, stride=2, padding=3)
ODD = Conv2dProblem.make("fprop", 32, 7, 56, 56, 33, 3, padding=1)


def test_every_shape_is_a_valid_config_for_the_stem():
    """Each shape, then its pairs twin (the stem takes them: stride_w * C = 6, dilation 1) and (twins=True) its
    prefetch twin (the stem's 8 x 16 tile: a patch of 21 x 37 x 3, 10 elements a thread); without twins=True, the
    plain kernels and pairs twins alone (the prefetch twins never won on the H100)."""
    assert [(c.prefetch, c.pairs) for c in smem_im2col_candidates(STEM)] == [(None, None), (None, True)] * len(SHAPES)
    cs = list(smem_im2col_candidates(STEM, twins=True))
    assert len(cs) == 3 * len(SHAPES) and len({c.name for c in cs}) == len(cs)
    for c in cs:
        assert c.family is KernelFamily.SMEM_IM2COL and c.reject_reason(STEM) is None
        assert c.name.startswith("cb_im2colsm_fprop_f16f16_f16_accf32_t") and c.align_c == 8
        assert KernelConfig.from_dict(c.to_dict()) == c
    assert [(c.prefetch is None, c.pairs) for c in cs] == [(True, None), (True, True), (False, None)] * len(SHAPES)
    assert all(twin == dataclasses.replace(c, prefetch=twin.prefetch) for c, twin in zip(cs[0::3], cs[2::3]))
    assert all(pair == dataclasses.replace(c, pairs=True) for c, pair in zip(cs[0::3], cs[1::3]))
    assert cs[1].name == "cb_im2colsm_fprop_f16f16_f16_accf32_t8x16x64_w8x1_align118_pair_sm90"
    assert cs[2].name == "cb_im2colsm_fprop_f16f16_f16_accf32_t8x16x64_w8x1_align118_pf10_sm90"
    assert "pairs" not in cs[0].to_dict() and cs[1].to_dict()["pairs"] is True  # the plain kernels' keys unchanged


def test_output_accesses_follow_k():
    assert {c.align_c for c in smem_im2col_candidates(ODD)} == {1}  # K=33
    assert {c.align_c for c in smem_im2col_candidates(STEM.replace(element_out=DType.F32))} == {4}


@pytest.mark.parametrize("problem, why", [
    (STEM.replace(c=8), "channels: C=8"),
    (Conv2dProblem.make("fprop", 2, 3, 32, 32, 16, 7, dtype="f32"), "element_a"),
    (Conv2dProblem.make("dgrad", 2, 3, 32, 32, 16, 7, stride=2, padding=3), "stride 1 only"),
    (Conv2dProblem.make("wgrad", 2, 3, 32, 32, 12, 7, padding=3), "K=12 is not a multiple"),
    (Conv2dProblem.make("wgrad", 2, 8, 32, 32, 16, 7, padding=3), "channels: C=8"),
    (Conv2dProblem.make("dgrad", 2, 7, 32, 32, 33, 3, padding=3), "past dilation * (R - 1)"),
    (Conv2dProblem.make("dgrad", 2, 7, 32, 32, 32, 3, padding=1), "channels: K=32"),
    (Conv2dProblem.make("fprop", 2, 7, 32, 32, 16, 9), f"past the family's {MAX_TAPS} taps"),
    (Conv2dProblem.make("fprop", 2, 6, 32, 32, 16, 3, groups=2), "groups"),
])
def test_problems_the_family_refuses_name_the_parameter(problem, why):
    assert not list(smem_im2col_candidates(problem))
    from cutlass_byoc.smem_im2col import problem_error  # noqa: PLC0415

    assert why in problem_error(problem)
    c = dataclasses.replace(config(STEM), element_a=problem.element_a, element_b=problem.element_b,
                            element_out=problem.element_out) if problem.element_a.bits == 16 else None
    if c is not None and problem.kind is STEM.kind:
        assert why in c.reject_reason(problem)


def test_static_rules():
    c = config(STEM)
    for change, why in [(dict(stages=2), "stages"), (dict(align_a=8), "align_a"), (dict(tile=(8, 16, 40)), "n8 tiles"),
                        (dict(tile=(8, 12, 64)), "m16 x n8"),
                        (dict(warps=(4, 4, 1), tile=(16, 16, 64)), "at most 8 warps"),
                        (dict(activation=Activation.RELU6), "relu6"), (dict(schedule="rows"), "other families")]:
        with pytest.raises(ValueError, match=why):
            dataclasses.replace(c, **change)


def test_shared_memory_limit_refuses_a_patch_too_large():
    wide = Conv2dProblem.make("fprop", 1, 7, 512, 512, 64, 9, stride=4, padding=4)  # 9x9x7 = 567 taps: refused anyway
    assert "taps" in config(STEM).reject_reason(wide)
    huge = Conv2dProblem.make("fprop", 1, 5, 512, 512, 64, 5, stride=1, padding=2, dilation=40)
    c = config(STEM)
    assert smem_bytes(c, huge) > 227 * 1024 and "shared memory" in c.reject_reason(huge)


def test_the_planner_times_the_unpadded_family_on_a_budget_of_its_own():
    """SMEM_IM2COL_BUDGET kernels of the family, each beside its pairs twin, no prefetch twin (none won on the
    H100)."""
    plan = plan_problem(STEM)
    ours = [c.launch for c in plan.candidates if c.launch.kernel.family is KernelFamily.SMEM_IM2COL]
    assert len({l.kernel for l in ours}) == len(ours) == 2 * SMEM_IM2COL_BUDGET
    plain = {l.kernel for l in ours if not l.kernel.pairs}
    assert len(plain) == SMEM_IM2COL_BUDGET
    assert {l.kernel for l in ours if l.kernel.pairs} == {dataclasses.replace(k, pairs=True) for k in plain}
    assert all(l.kernel.prefetch is None for l in ours)
    assert all(not l.padded for l in ours)  # its padded or folded twins only cost more
    others = [c for c in plan.candidates if c.launch.kernel.family is not KernelFamily.SMEM_IM2COL]
    assert len(others) == len(plan_problem(STEM, max_candidates=8).candidates) - 2 * SMEM_IM2COL_BUDGET
    assert not [c for c in plan_problem(STEM.replace(c=8)).candidates
                if c.launch.kernel.family is KernelFamily.SMEM_IM2COL]


def test_rendered_source_names_the_config_and_reads_whole_taps():
    c = config(STEM.replace(epilogue=Epilogue(Activation.SILU, SourceKind.BIAS)))
    src = render(c, "nvcc ...")
    assert src.startswith(f"// {c.name}\n") and "// Compile: nvcc ..." in src
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src
    assert "cutlass::epilogue::thread::SiLu<float>" in src
    bf = config(STEM.replace(element_a=DType.BF16, element_b=DType.BF16, element_out=DType.BF16))
    assert "row.col.f32.bf16.bf16.f32" in render(bf, "nvcc ...")


#: Compiled once for the compile-only tests (with a bias + ReLU epilogue).
BIAS_RELU = STEM.replace(n=4, h=64, w=64, epilogue=Epilogue(Activation.RELU, SourceKind.BIAS))


@pytest.fixture(scope="module")
def built(shared_cache):
    cfg = config(BIAS_RELU)
    return cfg, build([cfg], cache=shared_cache)[cfg]


@pytest.mark.compile
def test_kernel_compiles_and_checks_its_problem(built):
    cfg, result = built
    src, lib = loaded_kernel(result, cfg, BIAS_RELU)
    assert lib.workspace_size(BIAS_RELU) == 0
    assert raw_can_implement(lib, BIAS_RELU) is None
    assert "output size" in raw_can_implement(lib, BIAS_RELU, fields={"p": 31})
    assert "K=36" in raw_can_implement(lib, BIAS_RELU, fields={"k": 36})
    assert "taps" in raw_can_implement(lib, BIAS_RELU, fields={"c": 11, "r": 7, "s": 7})
    assert "split_k_slices" in raw_can_implement(lib, BIAS_RELU, slices=2)
    assert "source_kind" in raw_can_implement(lib, BIAS_RELU, source_kind=3)
    # the Python rules say the same before the library is asked
    assert "alignment" in LaunchConfig(cfg).reject_reason(BIAS_RELU.replace(k=36))


def test_the_model_ranks_the_measured_best_first():
    """On the H200 (2026-12-01) the stem's kernels ran from 64 us (16x16x64, 8x1 warps) to 81 us (8x8x64, 4x1), with
    the 4x2-warp ones at 71-76: the model, an instruction count, puts the 16x16x64 8x1 first and 2x4-mma warp tiles
    after 2x8 ones."""
    from cutlass_byoc.smem_im2col import estimate_us  # noqa: PLC0415

    ranked = sorted(smem_im2col_candidates(STEM), key=lambda c: estimate_us(STEM, LaunchConfig(c)))
    assert ranked[0].tile == (16, 16, 64) and ranked[0].warps == (8, 1, 1)
    by_shape = {(c.tile, c.warps[:2]): i for i, c in enumerate(ranked)}
    assert by_shape[((8, 16, 64), (4, 1))] < by_shape[((8, 16, 64), (4, 2))]


def test_stride_1_dgrad_is_the_fprop_of_dy():
    """The odd layer's dgrad (7 -> 33, 3x3, pad 1): dy's K=33 channels gathered, dx's C=7 written, padding R-1-pad."""
    from cutlass_byoc.smem_im2col import gathered  # noqa: PLC0415

    dgrad = ODD.replace(kind=ODD.kind.DGRAD)
    g = gathered(dgrad)
    assert (g.kind.value, g.c, g.k, g.h, g.w, g.p, g.q, g.pad_h) == ("fprop", 33, 7, 56, 56, 56, 56, 1)
    dil = Conv2dProblem.make("dgrad", 2, 5, 23, 21, 12, 3, padding=2, dilation=2)
    gd = gathered(dil)
    assert (gd.pad_h, gd.pad_w, gd.p, gd.q) == (2, 2, 23, 21)  # 2 * (3 - 1) - 2
    cs = list(smem_im2col_candidates(dgrad))
    assert cs and all(c.kind is dgrad.kind and c.align_c == 1 and c.reject_reason(dgrad) is None for c in cs)
    ours = [c for c in plan_problem(dgrad).candidates if c.launch.kernel.family is KernelFamily.SMEM_IM2COL]
    assert len(ours) == SMEM_IM2COL_BUDGET and all(c.launch.kernel.prefetch is None for c in ours)
    assert {c.launch.kernel.tile[2] for c in ours[:2]} == {16}  # 7 output channels: the narrow tiles first


@pytest.mark.compile
def test_dgrad_kernel_compiles_and_checks_its_problem(shared_cache):
    dgrad = ODD.replace(kind=ODD.kind.DGRAD, n=2, h=20, w=24)
    cfg = config(dgrad)
    result = build([cfg], cache=shared_cache)[cfg]
    src, lib = loaded_kernel(result, cfg, dgrad)
    assert "w[k][k0 + n][R-1-r][S-1-s]" in src
    assert lib.workspace_size(dgrad) == 0
    assert "stride" in raw_can_implement(lib, dgrad.replace(stride_h=2, stride_w=2, h=40, w=48))
    assert "no bias" in raw_can_implement(lib, dgrad, source_kind=1, source=0x50000)
    assert "padding" in raw_can_implement(lib, dgrad.replace(pad_h=3, pad_w=3, h=16, w=20))


# ------------------------------------------------------------------------------------------------------------ wgrad
#: The stem's wgrad as autocast training runs it: f16 dy and x, the weight gradient stored in fp32.
STEM_WGRAD = STEM.replace(kind=STEM.kind.WGRAD, element_out=DType.F32)


def test_wgrad_configs_for_the_stem():
    """Each shape, then its pairs twin (Q=112 is even), then its prefetch twin: enough patch elements a thread for the
    tile's whole patch (21 x 37 x 3 for 8 x 16 pixels at stride 2: 10 a thread of 256), at most MAX_PREFETCH."""
    cs = list(smem_im2col_candidates(STEM_WGRAD, twins=True))
    assert len(cs) == 3 * len(WGRAD_SHAPES) and len({c.name for c in cs}) == len(cs)
    plain, pairs, twins = cs[0::3], cs[1::3], cs[2::3]
    assert pairs == [dataclasses.replace(c, pairs=True) for c in plain]
    for c, twin, shape in zip(plain, twins, WGRAD_SHAPES):
        for k in (c, twin):
            assert k.reject_reason(STEM_WGRAD) is None and KernelConfig.from_dict(k.to_dict()) == k
            assert (k.align_a, k.align_b, k.align_c) == (8, 1, 1) and k.warps == shape[3:]
            assert k.name.startswith("cb_im2colsm_wgrad_f16f16_f32_accf32_t")
        threads = 32 * shape[3] * shape[4] * shape[5]
        ph, pw = (shape[0] - 1) * 2 + 7, (shape[1] - 1) * 2 + 7
        ahead = min(MAX_PREFETCH, -(-ph * pw * 3 // threads))
        assert c.prefetch is None and twin == dataclasses.replace(c, prefetch=ahead)
    assert cs[0].name == "cb_im2colsm_wgrad_f16f16_f32_accf32_t8x16x64_w1x4x2_align811_sm90"
    assert cs[1].name == "cb_im2colsm_wgrad_f16f16_f32_accf32_t8x16x64_w1x4x2_align811_pair_sm90"
    assert cs[2].name == "cb_im2colsm_wgrad_f16f16_f32_accf32_t8x16x64_w1x4x2_align811_pf10_sm90"
    # the fprop's names are unchanged by the third warp count (their kernels stay in the cache)
    assert config(STEM).name == "cb_im2colsm_fprop_f16f16_f16_accf32_t8x16x64_w8x1_align118_sm90"


def test_wgrad_rules_name_the_parameter():
    c = config(STEM_WGRAD)
    for change, why in [(dict(align_a=1), "align_a, align_b, align_c"), (dict(align_c=4), "align_c"),
                        (dict(activation=Activation.RELU), "no epilogue"), (dict(warps=(1, 4, 4)), "at most 8 warps"),
                        (dict(tile=(8, 16, 40)), "whole m16 tiles"), (dict(warps=(1, 4, 3)), "k16 steps"),
                        (dict(stages=2), "stages"), (dict(prefetch=17), "prefetch"), (dict(prefetch=0), "prefetch")]:
        with pytest.raises(ValueError, match=why):
            dataclasses.replace(c, **change)
    from cutlass_byoc.smem_im2col import problem_error  # noqa: PLC0415

    biased = STEM_WGRAD.replace(epilogue=Epilogue(source=SourceKind.RESIDUAL))
    assert "epilogue" in problem_error(biased) and not list(smem_im2col_candidates(biased))
    # taps past one CTA's (160) are covered by blocks of taps; past MAX_TAPS the patch is refused
    big = Conv2dProblem.make("wgrad", 2, 7, 40, 40, 16, 7, padding=3)
    assert big.r * big.s * big.c == 343 and config(big).reject_reason(big) is None
    assert "taps" in problem_error(Conv2dProblem.make("wgrad", 2, 7, 40, 40, 16, 9, padding=4))


def test_the_planner_times_the_wgrad_kernels_on_the_stem():
    """The family's budget of plain kernels, each beside its pairs twin (no prefetch twin: none won on the H100)."""
    ours = [c.launch for c in plan_problem(STEM_WGRAD).candidates
            if c.launch.kernel.family is KernelFamily.SMEM_IM2COL]
    assert len(ours) == 2 * min(SMEM_IM2COL_BUDGET, len(WGRAD_SHAPES)) and all(not l.padded for l in ours)
    assert sum(bool(l.kernel.pairs) for l in ours) == min(SMEM_IM2COL_BUDGET, len(WGRAD_SHAPES))
    assert all(l.kernel.kind is STEM_WGRAD.kind and l.kernel.prefetch is None for l in ours)


def test_wgrad_source_gathers_x_and_reduces_slices_in_order():
    c = config(STEM_WGRAD)
    src = render(c, "nvcc ...")
    assert src.startswith(f"// {c.name}\n") and "// Compile: nvcc ..." in src
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in src and "cp.async.cg.shared.global" in src
    assert "reduce_slices_kernel" in src and f"kMaxSlices = {MAX_SLICES}" in src
    assert "using ElementOutput = float;" in src


@pytest.mark.compile
def test_wgrad_kernel_compiles_and_checks_its_problem(shared_cache):
    p = STEM_WGRAD.replace(n=2, h=40, w=48)
    cfg = config(p)
    result = build([cfg], cache=shared_cache)[cfg]
    src, lib = loaded_kernel(result, cfg, p)
    tiles = 2 * -(-20 // 8) * -(-24 // 16)  # P=20, Q=24 in 8x16 tiles
    assert lib.workspace_size(p) == min(tiles, MAX_SLICES) * 64 * 147 * 4
    assert raw_can_implement(lib, p) is None
    assert "K=12" in raw_can_implement(lib, p, fields={"k": 12})
    assert "no epilogue source" in raw_can_implement(lib, p, source_kind=2, source=0x50000)
    assert "split_k_slices" in raw_can_implement(lib, p, slices=2)
    assert "taps" in raw_can_implement(lib, p, fields={"c": 11, "r": 7, "s": 7})
    huge = p.replace(c=5, r=5, s=5, pad_h=2, pad_w=2, dilation_h=40, dilation_w=40, h=512, w=512)
    assert smem_bytes(cfg, huge) > 227 * 1024 and "shared memory" in cfg.reject_reason(huge)
    assert "shared memory" in raw_can_implement(lib, huge)
