"""The 1x1-as-GEMM family (CUTLASS 3.x sm90 GEMM kernels) on the CPU: which problems it takes and refuses (with
reasons), config rules, the decision-cache round trip, rendering (epilogue, schedule and scheduler types, the
operand layouts of each kind) and its place in the planner."""

from __future__ import annotations

import dataclasses

import pytest

from cutlass_byoc.config import KernelConfig, LaunchConfig
from cutlass_byoc.gemm1x1 import (CLUSTERS, DETERMINISTIC_TWIN, SCHEDULES, applicable, deterministic_twin,
                                  epilogue_smem_bytes, gemm1x1_candidates, gemm1x1_config, generator_configs,
                                  im2col_candidates, is_deterministic, tile_schedules)
from cutlass_byoc.heuristics import estimate_us, rank
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.profiler.plan import plan_problem
from cutlass_byoc.render import render
from cutlass_byoc.types import Activation, ConvKind, DType, KernelFamily, SourceKind, SplitKMode

KINDS = ["fprop", "dgrad", "wgrad"]


def p1x1(kind="fprop", n=32, c=256, hw=56, k=64, **kw) -> Conv2dProblem:
    return Conv2dProblem.make(kind, n, c, hw, hw, k, 1, **kw)


# ------------------------------------------------------------------------------------------- candidates
def test_generator_supplies_tiles_clusters_and_all_three_schedules():
    gen = generator_configs()
    assert {s for _, _, s in gen} == set(SCHEDULES) - set(DETERMINISTIC_TWIN)  # the nd reduction is ours to add
    assert ((128, 128, 64), (2, 1, 1), "cooperative_streamk") in gen
    assert {cl for _, cl, _ in gen} | {(1, 1, 1)} == set(CLUSTERS)  # the generator's clusters, and none
    pairs = tile_schedules()
    assert ((128, 64, 64), "pingpong") in pairs  # a narrow extra for 64-channel layers


@pytest.mark.parametrize("kind", KINDS)
def test_candidates_of_a_1x1_layer(kind):
    p = p1x1(kind)
    cands = list(gemm1x1_candidates(p))
    assert len(cands) >= 20
    assert all(c.family is KernelFamily.SM90_GEMM_1X1 and c.kind.value == kind for c in cands)
    assert {c.schedule for c in cands} == set(SCHEDULES)
    assert all(c.reject_reason(p) is None for c in cands)
    # cooperative tiles are two warp groups of 64 rows; nothing spills (<= 128 accumulators per thread)
    for c in cands:
        per_thread = c.tile[0] * c.tile[1] // (256 if c.schedule.startswith("cooperative") else 128)
        assert per_thread <= 128, c.name
        if c.schedule.startswith("cooperative"):
            assert c.tile[0] % 128 == 0
    assert len({c.name for c in cands}) == len(cands)


@pytest.mark.parametrize("dtype, out", [("f16", "f16"), ("f16", "f32"), ("bf16", "bf16"), ("bf16", "f32")])
def test_output_types_follow_the_problem(dtype, out):
    p = p1x1("fprop", dtype=dtype, out_dtype=out)
    c = next(gemm1x1_candidates(p))
    assert (c.element_a.value, c.element_out.value, c.element_acc) == (dtype, out, DType.F32)
    assert c.align_c * c.element_out.nbytes == 16


@pytest.mark.parametrize("problem, word", [
    (Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1), "1x1"),
    (p1x1("fprop", stride=2), "stride"),
    (p1x1("fprop", padding=1), "padding"),
    (p1x1("fprop", c=36), "alignment"),  # 72 bytes: not a whole number of 16-byte TMA rows
    (p1x1("dgrad", k=20), "alignment"),
    (p1x1("wgrad", c=12), "alignment"),
    (p1x1("fprop", groups=2), "groups"),
    (p1x1("fprop", dtype="f32"), "element_a"),
    (p1x1("fprop", acc_dtype="f16"), "element_acc"),
])
def test_refused_problems_say_why(problem, word):
    assert list(gemm1x1_candidates(problem)) == []
    assert word in applicable(problem)


@pytest.mark.parametrize("changes, word", [
    (dict(r=3, s=3, pad_h=1, pad_w=1), "filter"),
    (dict(stride_h=2, stride_w=2), "stride"),
    (dict(stride_h=1, stride_w=2), "stride"),
    (dict(pad_h=1, pad_w=1), "padding"),
    (dict(c=36), "alignment"),
    (dict(k=100), "alignment"),
    (dict(groups=2, c=256, k=64), "groups"),
    (dict(kind=ConvKind.DGRAD), "kind"),
    (dict(element_out=DType.F32), "element_out"),
])
def test_config_rejects_other_problems(changes, word):
    base = p1x1("fprop")
    cfg = gemm1x1_config(base)
    why = cfg.reject_reason(base.replace(**changes))
    assert why and why.startswith(word), why


def test_dilation_is_irrelevant_for_1x1():
    p = p1x1("fprop", dilation=2)
    assert gemm1x1_config(p).reject_reason(p) is None


def test_activation_is_compiled_in():
    p = p1x1("fprop", epilogue=Epilogue(Activation.GELU, SourceKind.BIAS))
    cfg = gemm1x1_config(p)
    assert cfg.activation is Activation.GELU and "gelu" in cfg.name
    assert "activation" in gemm1x1_config(p1x1("fprop")).reject_reason(p)


@pytest.mark.parametrize("changes, word", [
    (dict(schedule="implicit_tma_ws"), "schedule"),
    (dict(schedule=None), "schedule"),
    (dict(tile=(64, 128, 64), warps=(8, 1, 1)), "tile"),  # cooperative: two warp groups of 64 rows
    (dict(tile=(128, 256, 64), schedule="pingpong", warps=(4, 1, 1), stages=3), "tile"),  # 256 accumulators/thread
    (dict(tile=(128, 128, 16)), "tile"),  # K must be 64 bytes
    (dict(tile=(384, 64, 64), stages=3), "TMA box"),  # compiles, but its descriptor fails at launch and the kernel hangs
    (dict(split_k_mode=SplitKMode.PARALLEL), "split_k_mode|align_c"),  # (the generic rule on fp32 partials may say it first)
    (dict(align_a=4), "align_a"),
    (dict(stages=12), "stages"),
    (dict(cluster=(4, 2, 1)), "cluster"),
    (dict(element_acc=DType.F16), "element_acc"),
])
def test_static_rules(changes, word):
    cfg = gemm1x1_config(p1x1("fprop"))
    with pytest.raises(ValueError, match=word):
        dataclasses.replace(cfg, **changes)


def test_name_and_round_trip():
    p = p1x1("wgrad")
    cfg = gemm1x1_config(p, (128, 64, 64), "cooperative_streamk", (2, 1, 1), swizzle=2)
    assert cfg.name.startswith("cb_gemm1x1_wgrad_") and "c2x1x1_cooperative_streamk" in cfg.name and "_sw2_" in cfg.name
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    launch = LaunchConfig(cfg, 8)
    assert LaunchConfig.from_dict(launch.to_dict()) == launch and launch.name.endswith("_k8")


#: sizeof(GemmKernel::SharedStorage) printed by nvcc 13.0 / CUTLASS 4.2 for the tightest configs (16-bit inputs)
MEASURED_SMEM = {
    ((64, 128, 64), "pingpong", "f32"): (8, 231424),
    ((64, 256, 64), "pingpong", "f32"): (4, 198656),
    ((128, 64, 64), "cooperative_streamk", "f32"): (7, 223232),
    ((128, 128, 64), "cooperative", "f16"): (6, 230400),
    ((128, 128, 64), "cooperative", "f32"): (5, 231424),
    ((256, 128, 64), "cooperative_streamk", "f32"): (3, 215040),
}


@pytest.mark.parametrize("key", list(MEASURED_SMEM), ids=lambda k: f"{k[0][0]}x{k[0][1]}-{k[1]}-{k[2]}")
def test_stage_count_and_shared_memory_bound_match_nvcc(key):
    """The stage count chosen in Python is emitted as StageCount<n>; the template static_asserts the fit, and the
    Python bound must not undercount what nvcc lays out (else a candidate fails to compile)."""
    from cutlass_byoc.gemm1x1 import SMEM_CAPACITY, epilogue_smem_bytes, stage_count  # noqa: PLC0415

    tile, schedule, out = key
    stages, actual = MEASURED_SMEM[key]
    assert stage_count(tile, DType.F16, DType(out), schedule) == stages
    m, n, k = tile
    bound = stages * ((m + n) * k * 2 + 16) + epilogue_smem_bytes(tile, DType(out), schedule)
    assert actual <= bound <= SMEM_CAPACITY


# ------------------------------------------------------------------------------------------- split-k / stream-K
def test_only_the_stream_k_scheduler_splits_at_launch():
    p = p1x1("wgrad")
    assert gemm1x1_config(p, schedule="cooperative_streamk").splits_at_launch
    for sched in ("cooperative", "pingpong"):
        cfg = gemm1x1_config(p, schedule=sched)
        assert not cfg.splits_at_launch
        with pytest.raises(ValueError, match="stream-K"):
            LaunchConfig(cfg, 2)


def test_stream_k_split_takes_16_bit_outputs_and_bias():
    """Unlike 2.x serial split-k, the scheduler's partials are fp32 in the workspace and the epilogue runs once."""
    p = p1x1("fprop", epilogue=Epilogue(Activation.RELU, SourceKind.BIAS))
    launch = LaunchConfig(gemm1x1_config(p, schedule="cooperative_streamk"), 4)
    assert launch.reject_reason(p) is None
    # but not more slices than the reduction has tiles of K
    assert "exceed" in LaunchConfig(launch.kernel, 8).reject_reason(p.replace(c=256))


def test_wgrad_ranks_stream_k_splits():
    p = p1x1("wgrad", c=64, k=64)
    cfg = gemm1x1_config(p, schedule="cooperative_streamk")
    slices = {l.split_k_slices for _, l in rank(p, [cfg])}
    assert 1 in slices and max(slices) >= 16
    assert {l.split_k_slices for _, l in rank(p, [gemm1x1_config(p, schedule="pingpong")])} == {1}


def test_nondeterministic_stream_k_twins():
    """Every stream-K (tile, schedule) pair is also proposed with the nondeterministic reduction: the same kernel,
    the peers' partials added as they arrive. Its deterministic twin differs in the schedule alone."""
    pairs = set(tile_schedules())
    streamk = {t for t, s in pairs if s == "cooperative_streamk"}
    assert streamk and streamk == {t for t, s in pairs if s == "cooperative_streamk_nd"}
    p = p1x1("wgrad", c=64, k=64)
    nd = gemm1x1_config(p, (128, 64, 64), "cooperative_streamk_nd", (2, 1, 1))
    assert nd.splits_at_launch and not is_deterministic(nd) and nd.name.endswith("_c2x1x1_cooperative_streamk_nd_sm90")
    twin = deterministic_twin(nd)
    assert is_deterministic(twin) and twin == dataclasses.replace(nd, schedule="cooperative_streamk")
    assert deterministic_twin(twin) is twin
    for sched in ("cooperative", "pingpong"):
        assert is_deterministic(gemm1x1_config(p, schedule=sched))
    assert LaunchConfig(nd, 64).reject_reason(p) is None


def test_deterministic_algorithms_leave_the_nd_reduction_out():
    """Under torch.use_deterministic_algorithms(True) the planner never offers (so the profiler never times) the
    nondeterministic reduction, and a decision holding one launches its deterministic twin."""
    torch = pytest.importorskip("torch")
    from cutlass_byoc.select import honour_determinism  # noqa: PLC0415

    p = p1x1("wgrad", c=64, k=64)
    assert any(not is_deterministic(c) for c in gemm1x1_candidates(p))
    nd = LaunchConfig(gemm1x1_config(p, (128, 64, 64), "cooperative_streamk_nd"), 16)
    assert honour_determinism(nd, False) is nd
    torch.use_deterministic_algorithms(True)
    try:
        assert all(is_deterministic(c) for c in gemm1x1_candidates(p))
        assert all(is_deterministic(k) for k in plan_problem(p, 8).kernels if k.family is KernelFamily.SM90_GEMM_1X1)
    finally:
        torch.use_deterministic_algorithms(False)
    twin = honour_determinism(nd, True)
    assert twin.split_k_slices == 16 and twin.kernel == deterministic_twin(nd.kernel)
    other = LaunchConfig(gemm1x1_config(p, (128, 64, 64), "pingpong"))
    assert honour_determinism(other, True) is other and honour_determinism(None, True) is None


def test_stream_k_model_and_plan():
    """The model charges the deterministic reduction its chain of fixups (one peer after another: ~0.65 us each),
    so with many peers per tile the nd reduction ranks first; the planner times a stream-K kernel's own
    decomposition (one slice) first among its slice counts."""
    p = p1x1("wgrad", c=64, k=64)  # one 128x64 output tile, 1568 k tiles
    det = gemm1x1_config(p, (128, 64, 64), "cooperative_streamk")
    nd = dataclasses.replace(det, schedule="cooperative_streamk_nd")
    for slices in (1, 16, 64):
        assert estimate_us(p, LaunchConfig(det, slices)) > estimate_us(p, LaunchConfig(nd, slices)) + 0.5 * slices * 0.65
    from cutlass_byoc.profiler.plan import launches_for  # noqa: PLC0415

    assert launches_for(p, nd)[0][1].split_k_slices == 1
    sm80 = next(l for l in plan_problem(p, 8).candidates if l.launch.kernel.family is KernelFamily.SM80_IMPLICIT_GEMM)
    assert sm80.launch.split_k_slices > 1  # 2.x kernels keep the model's order (their one slice is hopeless here)


# ------------------------------------------------------------------------------------------- model and planner
def test_memory_bound_estimate():
    """A 1x1 layer of few channels is bytes / ~3 TB/s (plus the launch), not flops / ~600 TF/s."""
    p = p1x1("fprop", c=64, k=64)
    cfg = gemm1x1_config(p, (128, 64, 64), "pingpong")
    us = estimate_us(p, LaunchConfig(cfg))
    assert p.bytes_moved / 3e12 * 1e6 <= us <= p.bytes_moved / 3e12 * 1e6 + 10
    compute_bound = p1x1("fprop", c=2048, k=2048, hw=28)
    us = estimate_us(compute_bound, LaunchConfig(gemm1x1_config(compute_bound, (128, 256, 64), "cooperative")))
    assert us >= compute_bound.flops / 600e12 * 1e6


@pytest.mark.parametrize("kind", KINDS)
def test_planner_includes_the_family_for_1x1_layers(kind):
    pp = plan_problem(p1x1(kind, c=256, k=64), 8)
    assert any(k.family is KernelFamily.SM90_GEMM_1X1 for k in pp.kernels)


def test_planner_leaves_the_family_out_elsewhere():
    for p in (Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1), p1x1("fprop", stride=2)):
        pp = plan_problem(p, 8)
        # (a strided 1x1 conv reaches the family only through its space-to-depth fold: a subsample, then a GEMM)
        assert not any(c.launch.kernel.family is KernelFamily.SM90_GEMM_1X1 for c in pp.candidates
                       if c.launch.s2d == 1)
        assert not any("gemm1x1" in x.name for x in pp.pruned)  # not offered at all, so no noise in the pruned list
    folded = [c.launch for c in plan_problem(p1x1("fprop", stride=2), 8).candidates if c.launch.s2d == 2]
    assert any(l.kernel.family is KernelFamily.SM90_GEMM_1X1 for l in folded)


# ------------------------------------------------------------------------------------------- rendering
def _src(p, **kw):
    return render(gemm1x1_config(p, **kw), "nvcc -gencode=arch=compute_90a,code=sm_90a x.cu")


def test_render_header_and_api():
    p = p1x1("fprop")
    cfg = gemm1x1_config(p)
    src = _src(p)
    assert src.startswith(f"// {cfg.name}\n")
    assert "// Compile: nvcc -gencode=arch=compute_90a,code=sm_90a x.cu" in src
    assert '#include "cute/tensor.hpp"' in src.split('#include "cutlass/gemm')[0]
    for fn in ("cb_abi_version", "cb_kernel_name", "cb_config_json", "cb_can_implement", "cb_workspace_size", "cb_run"):
        assert f" {fn}(" in src
    assert cfg.to_json() in src and "StageCount<%d>" % cfg.stages in src


@pytest.mark.parametrize("schedule, kernel, epilogue, scheduler", [
    ("cooperative", "KernelTmaWarpSpecializedCooperative", "TmaWarpSpecializedCooperative", "PersistentScheduler"),
    ("cooperative_streamk", "KernelTmaWarpSpecializedCooperative", "TmaWarpSpecializedCooperative", "StreamKScheduler"),
    ("cooperative_streamk_nd", "KernelTmaWarpSpecializedCooperative", "TmaWarpSpecializedCooperative",
     "StreamKScheduler"),
    ("pingpong", "KernelTmaWarpSpecializedPingpong", "TmaWarpSpecialized", "PersistentScheduler"),
])
def test_render_schedules(schedule, kernel, epilogue, scheduler):
    src = _src(p1x1("wgrad"), schedule=schedule)
    assert f"using KernelSchedule = cutlass::gemm::{kernel};" in src
    assert f"using EpilogueSchedule = cutlass::epilogue::{epilogue};" in src
    assert f"using TileScheduler = cutlass::gemm::{scheduler};" in src
    streamk = scheduler == "StreamKScheduler"
    assert ("Decomposition::SplitK" in src) == streamk
    assert ("Reduction::Deterministic;" in src) == (schedule == "cooperative_streamk")
    assert ("Reduction::Nondeterministic;" in src) == (schedule == "cooperative_streamk_nd")
    assert ("the {} schedule does not split K".format(schedule) in src) == (not streamk)


@pytest.mark.parametrize("kind, a, b, shape", [
    ("fprop", "RowMajor", "ColumnMajor", "return {pixels, int(x.k), int(x.c)};"),
    ("dgrad", "RowMajor", "RowMajor", "return {pixels, int(x.c), int(x.k)};"),
    ("wgrad", "ColumnMajor", "RowMajor", "return {int(x.k), int(x.c), pixels};"),
])
def test_render_gemm_mapping(kind, a, b, shape):
    src = _src(p1x1(kind))
    assert f"using LayoutA = cutlass::layout::{a};" in src
    assert f"using LayoutB = cutlass::layout::{b};" in src
    assert "using LayoutC = cutlass::layout::RowMajor;" in src
    assert shape in src
    assert ("source_kind 1 (bias): the wgrad GEMM" in src) == (kind == "wgrad")


@pytest.mark.parametrize("act, functor", [
    (Activation.IDENTITY, None), (Activation.RELU, "ReLu"), (Activation.SIGMOID, "Sigmoid"),
    (Activation.SILU, "SiLu"), (Activation.HARDSWISH, "HardSwish"), (Activation.GELU, "GELU"),
])
def test_render_epilogue(act, functor):
    src = _src(p1x1("fprop", dtype="bf16", out_dtype="f32", epilogue=Epilogue(act, SourceKind.BIAS)))
    if functor:
        assert f"LinCombEltAct<\n    cutlass::epilogue::thread::{functor}, ElementOutput" in src
    else:
        assert "fusion::LinearCombination<ElementOutput, ElementCompute, ElementSource, ElementCompute>" in src
    assert "using ElementOutput = float;" in src and "using ElementA = cutlass::bfloat16_t;" in src
    assert "constexpr int kAlignC = 4;" in src
    assert "cute::get<0>(stride_c) = 0;" in src  # the bias: a zero stride along M


def test_sourceless_kernels_for_problems_without_a_source():
    """A problem without bias or residual gets the sourceless kernels (CUTLASS's ElementC = void), any other problem
    the kernels with a C; a sourceless kernel refuses a problem with a source, in Python and in cb_can_implement."""
    plain = p1x1("fprop")
    assert all(c.sourceless for c in gemm1x1_candidates(plain)) and list(gemm1x1_candidates(plain))
    assert all(c.name.endswith("_nosrc_sm90") for c in gemm1x1_candidates(plain))
    for src in (SourceKind.BIAS, SourceKind.RESIDUAL):
        p = p1x1("fprop", epilogue=Epilogue(Activation.IDENTITY, src))
        assert not any(c.sourceless for c in gemm1x1_candidates(p))
        assert "sourceless kernel reads no epilogue source" in gemm1x1_config(plain, sourceless=True).reject_reason(p)
    assert all(c.sourceless for c in gemm1x1_candidates(p1x1("wgrad")))
    assert not any(c.sourceless for c in im2col_candidates(Conv2dProblem(
        kind=ConvKind.FPROP, n=2, h=16, w=16, c=3, k=64, r=7, s=7, stride_h=2, stride_w=2, pad_h=3, pad_w=3)))
    cfg = gemm1x1_config(plain, (256, 64, 64), "pingpong", sourceless=True)
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert "sourceless" not in gemm1x1_config(plain).to_dict()  # older kernels' JSON, source and key unchanged
    with pytest.raises(ValueError, match="sourceless: True or None"):
        dataclasses.replace(cfg, sourceless=False)
    with pytest.raises(ValueError, match="sourceless: a field of the 3.x families"):
        dataclasses.replace(cfg, family=KernelFamily.SM80_IMPLICIT_GEMM, schedule=None)
    src = render(cfg, "nvcc x.cu")
    assert "    void, LayoutC, kAlignC,  // sourceless" in src
    assert "args.epilogue.ptr_C = nullptr;" in src
    assert "this kernel is built without an epilogue source" in src
    with_c = render(gemm1x1_config(plain, (256, 64, 64), "pingpong"), "nvcc x.cu")
    assert "    ElementSource, LayoutC, kAlignC," in with_c and "ptr_C = nullptr" not in with_c


def test_sourceless_shared_memory_leaves_the_c_buffers_out():
    # 128x128 ping-pong, f16 out: epilogue tile 64x32, 8 sub-tiles; with C: 4 shared C/D buffers, without: 2 D buffers
    assert epilogue_smem_bytes((128, 128, 64), DType.F16, "pingpong") == 4 * 64 * 32 * 2 + 2048
    assert epilogue_smem_bytes((128, 128, 64), DType.F16, "pingpong", sourceless=True) == 2 * 64 * 32 * 2 + 2048


def test_epilogue_store_stages():
    """KernelConfig.epi_stages: D's buffers (TMA stores in flight) of a sourceless kernel's epilogue instead of the
    builder's min(sub-tiles, 2): named, rendered as the builder's collective with StagesD replaced (a kernel without it
    renders as before), counted in the shared memory (fewer pipeline stages where they no longer fit), refused with a
    C, with the im2col lowering, past the sub-tile count and outside the GEMM 1x1 family."""
    from cutlass_byoc.gemm1x1 import epilogue_sub_tiles, with_epilogue_tile, with_store_stages

    plain = p1x1("fprop", c=64, k=64)
    base = gemm1x1_config(plain, (192, 64, 64), "pingpong", sourceless=True)
    assert base.epi_stages is None and "epi_stages" not in base.to_dict()
    assert "WithStoreStages" not in render(base, "nvcc x.cu")
    assert epilogue_sub_tiles(base.tile, base.schedule) == 6  # 64 x 32 sub-tiles of a 192 x 64 tile
    every = with_store_stages(base)
    assert every.epi_stages == 6 and every.name == base.name.replace("_nosrc_sm90", "_nosrc_sd6_sm90")
    assert KernelConfig.from_dict(every.to_dict()) == every and every.to_dict()["epi_stages"] == 6
    # six 4 KiB D buffers instead of two still leave room for the six 32 KiB stages
    assert epilogue_smem_bytes(base.tile, DType.F16, "pingpong", True, None, 6) == 6 * 64 * 32 * 2 + 2048
    assert every.stages == base.stages == 6
    src = render(every, "nvcc x.cu")
    assert "using BuiltEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<" in src
    assert "cutlass::epilogue::Sm90TmaWarpSpecialized<StagesC, 6, Fragment, ReuseC, Delay>;" in src
    assert "using CollectiveEpilogue = typename WithStoreStages<BuiltEpilogue>::type;" in src
    # with the wider sub-tiles: three 64x64 stores, three buffers
    both = with_store_stages(with_epilogue_tile(base, (64, 64)))
    assert both.epi_stages == 3 and both.name.endswith("_nosrc_e64x64_sd3_sm90")
    # a 256 x 64 tile: eight 4 KiB buffers take a 40 KiB stage's room (5 -> 4)
    big = gemm1x1_config(plain, (256, 64, 64), "pingpong", sourceless=True)
    assert (big.stages, with_store_stages(big).stages, with_store_stages(big, 4).stages) == (5, 4, 5)
    with pytest.raises(ValueError, match="sourceless kernels only"):
        with_store_stages(gemm1x1_config(plain, (192, 64, 64), "pingpong"))
    with pytest.raises(ValueError, match="1 to the CTA tile's 6 epilogue sub-tiles"):
        with_store_stages(base, 7)
    with pytest.raises(ValueError, match="GEMM 1x1 family only"):
        dataclasses.replace(KernelConfig(**{**base.__dict__, "epi_stages": None}), family=KernelFamily.SM90_TMA_WGMMA,
                            epi_stages=4, sourceless=None)


def test_epilogue_sub_tile():
    """KernelConfig.epi_tile: the TMA epilogue's sub-tile instead of CUTLASS's EpilogueTileAuto, named in the kernel,
    rendered as the builder's EpilogueTile, its buffers counted in the shared memory (fewer stages where they no longer
    fit), and refused where CUTLASS's builder would refuse it (M other than one ping-pong warp group's 64 rows or the
    cooperative pair's 128, N not a multiple of 16 dividing the tile's); a kernel without it renders as before (so
    its cache key is unchanged)."""
    from cutlass_byoc.gemm1x1 import with_epilogue_tile

    plain = p1x1("fprop", c=64, k=64)
    base = gemm1x1_config(plain, (192, 64, 64), "pingpong", sourceless=True)
    assert base.epi_tile is None and "epi_tile" not in base.to_dict()
    src = render(base, "nvcc x.cu")
    assert "    cutlass::epilogue::collective::EpilogueTileAuto,\n" in src and "KernelConfig.epi_tile" not in src
    wide = with_epilogue_tile(base, (64, 64))
    assert wide.name == base.name.replace("_nosrc_sm90", "_nosrc_e64x64_sm90") and wide.stages == base.stages
    assert KernelConfig.from_dict(wide.to_dict()) == wide and wide.to_dict()["epi_tile"] == [64, 64]
    src = render(wide, "nvcc x.cu")
    assert "    Shape<_64, _64>,  // epilogue sub-tile M x N (KernelConfig.epi_tile)" in src
    assert "EpilogueTileAuto" not in src
    # three 64x64 f16 sub-tiles of D: two buffers (StagesD = min(sub-tiles, 2)), as the six 64x32 ones had
    assert epilogue_smem_bytes(base.tile, DType.F16, "pingpong", True, (64, 64)) == 2 * 64 * 64 * 2 + 2048
    assert epilogue_smem_bytes(base.tile, DType.F16, "pingpong", True) == 2 * 64 * 32 * 2 + 2048
    # 128x128 C/D sub-tiles of a 128x256 cooperative kernel with a source: three 32 KiB buffers (StagesC), which
    # leave room for 2 of its 48 KiB stages instead of 4
    coop = gemm1x1_config(plain, (128, 256, 64), "cooperative")
    assert epilogue_smem_bytes(coop.tile, DType.F16, "cooperative", False, (128, 128)) == 3 * 128 * 128 * 2 + 2048
    assert (coop.stages, with_epilogue_tile(coop, (128, 128)).stages) == (4, 2)
    for kernel, bad in ((base, (192, 64)), (base, (128, 64)), (base, (64, 48)), (coop, (64, 64)), (coop, (128, 96))):
        with pytest.raises(ValueError, match="epi_tile"):
            with_epilogue_tile(kernel, bad)
    with pytest.raises(ValueError, match="GEMM 1x1 family only"):
        dataclasses.replace(KernelConfig(**{**base.__dict__, "epi_tile": None}), family=KernelFamily.SM90_TMA_WGMMA,
                            epi_tile=(64, 64), sourceless=None)
