"""The CUTLASS 3.x Hopper family (TMA + wgmma): candidates, config rules, rendering, and one nvcc build.

No GPU needed. The compile test (`-m compile`, ~60 s, ~3.5 GB of memory) also loads the library and asks its
`cb_can_implement`, which is host code only.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil

import pytest

import cutlass_byoc.sm90 as sm90_mod

from cutlass_byoc.config import KernelConfig, LaunchConfig
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.render import render
from cutlass_byoc.sm90 import CLUSTERS, PINGPONG, SCHEDULE, sm90_applicable, sm90_candidates, sm90_config, sm90_tiles
from cutlass_byoc.types import Activation, ConvKind, DType, KernelFamily, SourceKind, SplitKMode, StrideSupport

KINDS = ("fprop", "dgrad", "wgrad")


def problem(kind="fprop", n=2, c=64, h=16, w=16, k=128, r=3, **kw) -> Conv2dProblem:
    kw.setdefault("padding", 1)
    return Conv2dProblem.make(kind, n, c, h, w, k, r, **kw)


def one(p: Conv2dProblem, tile=(128, 128, 64), cluster=(1, 1, 1)) -> KernelConfig:
    return sm90_config(p, tile, cluster)


# ---------------------------------------------------------------------------------------------- candidates
def test_tiles_come_from_the_generator_filtered():
    tiles = sm90_tiles()
    assert (128, 128, 64) in tiles and (64, 128, 64) in tiles and (128, 64, 64) in tiles
    assert all(m * n <= 128 * 128 and k == 64 for m, n, k in tiles)


@pytest.mark.parametrize("kind", KINDS)
def test_candidates_are_valid_sm90_configs(kind):
    p = problem(kind)
    cands = list(sm90_candidates(p, split_k=False, schedules=(SCHEDULE,)))
    assert len(cands) == len(sm90_tiles()) * len(CLUSTERS)
    for cfg in cands:
        assert cfg.family is KernelFamily.SM90_TMA_WGMMA
        assert cfg.schedule == SCHEDULE and cfg.cluster in CLUSTERS
        assert cfg.reject_reason(p) is None
        assert (cfg.align_a, cfg.align_b, cfg.align_c) == (8, 8, 8)
        assert cfg.split_k_mode is SplitKMode.SERIAL
    assert len({c.name for c in cands}) == len(cands)


def test_candidates_fp32_output_aligns_c_to_four():
    cfg = next(sm90_candidates(problem(out_dtype="f32")))
    assert (cfg.align_a, cfg.align_b, cfg.align_c) == (8, 8, 4)


def test_candidates_follow_the_activation():
    p = problem(epilogue=Epilogue(Activation.RELU))
    assert {c.activation for c in sm90_candidates(p)} == {Activation.RELU}


@pytest.mark.parametrize(
    "p, why",
    [
        (problem(c=4), "alignment"),  # 8 bytes of channels: TMA needs 16
        (problem(k=36), "alignment"),
        (problem("dgrad", stride=2, dilation=2, padding=2), "dilation"),  # sub-pixel dgrad: dilation 1 only
        (problem(groups=2), "groups"),
        (problem(dtype="f32"), "element_a"),
    ],
)
def test_no_candidates_where_sm90_cannot_run(p, why):
    assert why in sm90_applicable(p)
    assert list(sm90_candidates(p)) == []


def test_strided_fprop_and_wgrad_have_candidates():
    assert list(sm90_candidates(problem("fprop", stride=2)))
    assert list(sm90_candidates(problem("wgrad", stride=2)))


def test_bias_and_residual_have_candidates():
    p = problem(epilogue=Epilogue(source=SourceKind.BIAS))
    assert one(problem()).reject_reason(p) is None
    assert list(sm90_candidates(p))
    assert list(sm90_candidates(problem(epilogue=Epilogue(source=SourceKind.RESIDUAL))))


def test_tile_filter():
    cands = list(sm90_candidates(problem(), tile_filter=lambda t: t == (64, 128, 64), clusters=((1, 1, 1),)))
    assert [(c.tile, c.schedule) for c in cands] == [((64, 128, 64), SCHEDULE), ((64, 128, 64), PINGPONG)]


# ---------------------------------------------------------------------------------------------- config rules
def test_static_rules():
    cfg = one(problem())
    bad = {
        "split_k_mode": SplitKMode.PARALLEL,
        "align_a": 4,
        "align_c": 4,
        "schedule": "cooperative",
        "tile": (32, 128, 64),
        "cluster": (3, 1, 1),
        "stages": 12,
    }
    for field, value in bad.items():
        with pytest.raises(ValueError):
            dataclasses.replace(cfg, **{field: value})
    with pytest.raises(ValueError, match="stride_support"):  # fprop and wgrad take any stride themselves
        dataclasses.replace(cfg, stride_support=StrideSupport.STRIDED)
    with pytest.raises(ValueError):
        LaunchConfig(cfg, split_k_slices=2)


# ---------------------------------------------------------------------------------------------- split-k (wgrad)
def split_one(p: Conv2dProblem, tile=(128, 128, 64), cluster=(1, 1, 1)) -> KernelConfig:
    return sm90_config(p, tile, cluster, SplitKMode.PARALLEL)


@pytest.mark.parametrize("out", ["f16", "f32"])
def test_split_k_candidates_are_wgrad_kernels_storing_fp32_partials(out, monkeypatch):
    monkeypatch.setattr(sm90_mod, "SPLIT_K_OUTPUTS", frozenset(DType))  # the generator's rules (see sm90.py)
    p = problem("wgrad", out_dtype=out)
    cands = list(sm90_candidates(p, schedules=(SCHEDULE,)))
    split = [c for c in cands if c.split_k_mode is SplitKMode.PARALLEL]
    assert len(split) == len(cands) // 2 == len(sm90_tiles()) * len(CLUSTERS)
    for cfg in split:
        assert cfg.element_kernel_out is DType.F32 and cfg.element_out is DType(out)
        assert cfg.align_c == 4  # 16-byte TMA stores of fp32
        assert cfg.reject_reason(p) is None and "splitk_parallel" in cfg.name
    for kind in ("fprop", "dgrad"):
        assert all(c.split_k_mode is SplitKMode.SERIAL for c in sm90_candidates(problem(kind)))


def test_split_k_rules():
    p = problem("wgrad", n=32, h=56, w=56, k=64)
    cfg = split_one(p)
    for kind in ("fprop", "dgrad"):  # refused: only wgrad has the split-k kernel
        with pytest.raises(ValueError, match="splits wgrad only"):
            dataclasses.replace(one(problem(kind)), split_k_mode=SplitKMode.PARALLEL, align_c=4)
    with pytest.raises(ValueError, match="no split-k"):
        LaunchConfig(one(p), split_k_slices=2)  # the plain kernel takes one slice only
    npq = p.n * p.p * p.q  # 100352: 1568 k tiles of 64
    assert LaunchConfig(cfg, 1).reject_reason(p) is None
    assert LaunchConfig(cfg, 64).reject_reason(p) is None
    assert LaunchConfig(cfg, npq // 64).reject_reason(p) is None
    assert "exceed the reduction extent" in LaunchConfig(cfg, npq // 64 + 1).reject_reason(p)
    tiny = problem("wgrad", n=1, h=8, w=8)  # N*P*Q = 64: one k tile
    assert LaunchConfig(split_one(tiny), 1).reject_reason(tiny) is None
    assert "exceed" in LaunchConfig(split_one(tiny), 2).reject_reason(tiny)
    assert LaunchConfig.from_dict(LaunchConfig(cfg, 16).to_dict()) == LaunchConfig(cfg, 16)
    assert LaunchConfig(cfg, 16).name.endswith("_k16")


def test_split_k_slice_counts_come_from_the_problem():
    from cutlass_byoc.heuristics import launch_slices, split_k_slice_candidates  # noqa: PLC0415

    early = problem("wgrad", n=32, h=56, w=56, c=64, k=64)  # K x CRS = 64 x 576: 5 output tiles of 128x128
    late = problem("wgrad", n=32, h=7, w=7, c=512, k=512)  # 4 x 36 output tiles, N*P*Q = 1568
    assert launch_slices(early, one(early)) == [1]  # the plain kernel runs unsplit
    s_early = launch_slices(early, split_one(early))
    assert 1 not in s_early and max(s_early) >= 64  # one slice is the plain kernel's job
    assert s_early == [s for s in split_k_slice_candidates(early, (128, 128, 64)) if s > 1]
    assert max(launch_slices(late, split_one(late)), default=1) <= 4  # many output tiles, short reduction
    b64 = problem("wgrad", n=64, h=56, w=56, c=64, k=64)
    assert all(LaunchConfig(split_one(b64), s).reject_reason(b64) is None for s in (1, 2, 4, 8, 16, 32, 64))


def test_split_k_is_planned_for_early_wgrad(monkeypatch):
    from cutlass_byoc.profiler.plan import launches_for, plan_problem  # noqa: PLC0415

    monkeypatch.setattr(sm90_mod, "SPLIT_K_OUTPUTS", frozenset(DType))

    p = problem("wgrad", n=32, h=56, w=56, c=64, k=64)
    launches = launches_for(p, split_one(p))
    assert launches and all(l.split_k_slices > 1 for _, l in launches)
    sm90 = [c.launch for c in plan_problem(p, 8).candidates if c.launch.kernel.family is KernelFamily.SM90_TMA_WGMMA
            and c.launch.kernel.schedule != PINGPONG]  # (the ping-pong kernels, unsplit, come on a budget of their own)
    assert sm90 and all(l.kernel.split_k_mode.fp32_sums and l.split_k_slices > 1 for l in sm90)
    # each split-k kernel beside its atomic twin, with the same slice counts (profiler.plan._atomic_twins)
    assert {(sm90_mod.atomic_twin(l.kernel), l.split_k_slices) for l in sm90 if l.kernel.split_k_mode is SplitKMode.PARALLEL} == \
        {(l.kernel, l.split_k_slices) for l in sm90 if l.kernel.split_k_mode is SplitKMode.ATOMIC}


def test_render_split_k_wgrad():
    p = problem("wgrad")
    src = render(split_one(p), "nvcc")
    assert "cb_split_wgrad_kernel" in src and "cb_splitk_reduce" in src
    # the reduction is the split kernel's programmatic dependent launch: the split kernel lets it launch first thing,
    # it waits for the partials before reading one
    assert "cudaLaunchKernelEx(&cfg, cb_splitk_reduce," in src
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in src
    split_body = src[src.index("cb_split_wgrad_kernel(CUTLASS_GRID_CONSTANT"):]
    assert split_body.index("griddepcontrol.launch_dependents") < split_body.index("SharedStorage& shared_storage")
    reduce_body = src[src.index("cb_splitk_reduce(const float4*"):]
    assert reduce_body.index("griddepcontrol.wait") < reduce_body.index("partials[")
    assert "using ElementKernelOut = float;" in src and "using ElementOutput = cutlass::half_t;" in src
    assert "return cb_splitk::partial_bytes(*x);" in src
    plain = render(one(p), "nvcc")
    assert "cb_split_wgrad_kernel" not in plain and "using ElementKernelOut = ElementOutput;" in plain
    assert "griddepcontrol" not in plain and "cudaLaunchAttributeProgrammaticStreamSerialization" not in plain


def test_reject_reason_strided_dgrad_and_padding():
    cfg = one(problem("dgrad"))
    assert "stride" in cfg.reject_reason(problem("dgrad", stride=2))
    assert "padding" in one(problem()).reject_reason(problem(padding=300, h=8, w=8))


def test_config_roundtrip():
    cfg = one(problem("wgrad"), cluster=(2, 1, 1))
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert "c2x1x1_implicit_tma_ws" in cfg.name


# ---------------------------------------------------------------------------------------------- render
@pytest.mark.parametrize("kind", KINDS)
def test_render_header_and_api(kind):
    cfg = one(problem(kind))
    src = render(cfg, "nvcc -DX kernel.cu -o kernel.so")
    assert src.startswith(f"// {cfg.name}\n")
    assert "templates/conv2d_sm90_tma_wgmma.cu.j2" in src
    assert "// Compile: nvcc -DX kernel.cu -o kernel.so" in src
    assert "//   tile            [128, 128, 64]" in src and "//   cluster         [1, 1, 1]" in src
    for fn in ("cb_abi_version", "cb_kernel_name", "cb_config_json", "cb_can_implement", "cb_workspace_size", "cb_run"):
        assert f" {fn}(" in src
    # The API struct must not be in the anonymous namespace, or the extern "C" functions taking it lose linkage.
    assert src.index("struct CbConv2dArgs") < src.index("\nnamespace {\n")
    assert f"cutlass::conv::Operator::k{cfg.kind.cutlass}" in src
    assert "cutlass::conv::KernelImplicitTmaWarpSpecializedSm90" in src
    assert "cutlass::epilogue::TmaWarpSpecialized" in src
    assert f"StageCount<{cfg.stages}>" in src
    assert cfg.to_json() in src
    # Headers in the order BRIEF.md found necessary.
    assert src.index('"cute/tensor.hpp"') < src.index('"cutlass/kernel_hardware_info.hpp"') \
        < src.index('"cutlass/conv/collective/collective_builder.hpp"') \
        < src.index('"cutlass/conv/device/conv_universal_adapter.hpp"')


def test_render_kind_specifics():
    fprop = render(one(problem("fprop")), "nvcc")
    dgrad = render(one(problem("dgrad")), "nvcc")
    wgrad = render(one(problem("wgrad")), "nvcc")
    assert "using TileShape = Shape<_128, _128, Shape<_64>>;" in fprop
    assert "using TileShape = Shape<_128, Shape<_128>, Shape<_64>>;" in wgrad
    assert "TensorKCSR" in wgrad and "TensorKCSR" not in fprop
    assert "ignores the conv stride" in dgrad and "ignores the conv stride" not in fprop
    assert "the sm90 wgrad kernel has no per-output-channel broadcast" in wgrad
    assert "does not broadcast a bias" not in fprop  # bias_broadcast is on in the template


@pytest.mark.parametrize(
    "act, functor",
    [(Activation.IDENTITY, "fusion::LinearCombination<"), (Activation.RELU, "thread::ReLu"),
     (Activation.GELU, "thread::GELU"), (Activation.SILU, "thread::SiLu")],
)
def test_render_activation(act, functor):
    src = render(one(problem(epilogue=Epilogue(act))), "nvcc")
    assert functor in src
    if act is not Activation.IDENTITY:
        assert "LinCombEltAct<" in src


def test_render_types():
    src = render(one(problem(dtype="bf16", out_dtype="f32")), "nvcc")
    assert "using ElementA = cutlass::bfloat16_t;" in src
    assert "using ElementOutput = float;" in src
    assert "constexpr int kAlignC = 4;" in src


def test_render_cluster():
    assert "using ClusterShape = Shape<_2, _1, _1>;" in render(one(problem(), cluster=(2, 1, 1)), "nvcc")


# ---------------------------------------------------------------------------------------------- ping-pong
@pytest.mark.parametrize("kind", KINDS)
def test_pingpong_candidates_for_every_tile_and_cluster(kind):
    """The project's persistent ping-pong kernel joins every plain (unsplit, unity) config: each tile fits one
    consumer warp group's accumulators, so every tile x cluster has its ping-pong twin."""
    p = problem(kind)
    cands = list(sm90_candidates(p, split_k=False))
    pingpong = [c for c in cands if c.schedule == PINGPONG]
    plain = [c for c in cands if c.schedule == SCHEDULE]
    assert len(pingpong) == len(plain) == len(sm90_tiles()) * len(CLUSTERS)
    assert {dataclasses.replace(c, schedule=SCHEDULE) for c in pingpong} == set(plain)
    for cfg in pingpong:
        assert cfg.name.endswith("_pingpong_sm90") and cfg.reject_reason(p) is None


def test_pingpong_rules():
    """No split-k (the split kernel is CUTLASS's one-tile-per-CTA body over a grid z); the sub-pixel strided dgrad
    (its phases' tiles walked as one list) with clusters of one CTA only."""
    wgrad = problem("wgrad", n=32, h=56, w=56)
    split = list(sm90_candidates(wgrad))
    assert any(c.split_k_mode is SplitKMode.PARALLEL for c in split)
    assert all(c.schedule == SCHEDULE for c in split if c.split_k_mode is SplitKMode.PARALLEL)
    with pytest.raises(ValueError, match="split-k"):
        sm90_config(wgrad, (64, 128, 64), split_k_mode=SplitKMode.PARALLEL, schedule=PINGPONG)
    strided = problem("dgrad", stride=2)
    pingpong = [c for c in sm90_candidates(strided) if c.schedule == PINGPONG]
    assert len(pingpong) == len(sm90_tiles())
    assert all(c.stride_support is StrideSupport.STRIDED and c.cluster == (1, 1, 1) for c in pingpong)
    with pytest.raises(ValueError, match="clusters of one"):
        sm90_config(strided, (128, 128, 64), (2, 1, 1), schedule=PINGPONG)
    with pytest.raises(ValueError, match="schedule"):
        sm90_config(problem(), (128, 128, 64), schedule="cooperative")


def test_render_pingpong_subpixel():
    """The sub-pixel config's ping-pong kernel takes the phases' Params (a group) and walks their tiles as one list;
    cb_run zero-fills and launches it as prepare_subpixel prepared it; CUTLASS's grouped one-tile-per-CTA kernel is not built."""
    src = render(sm90_config(problem("dgrad", stride=2), (128, 128, 64), schedule=PINGPONG), "nvcc")
    assert "cb_pingpong_kernel(CUTLASS_GRID_CONSTANT GroupParams const group)" in src
    assert "return cb_pingpong::prepare_subpixel(x, list, msg, len);" in src
    assert "group_tile(group, first_tile)" in src and "cudaMemsetAsync" in src
    assert "cb_subpixel_kernel" not in src and "Params make_params(" not in src
    plain = render(sm90_config(problem("dgrad", stride=2), (128, 128, 64)), "nvcc")
    assert "cb_subpixel_kernel" in plain and "pingpong" not in plain


def test_render_pingpong():
    """The ping-pong config renders the project's persistent kernel and launches it from cb_run; the plain config's
    source has none of it (its cache key, and so every kernel compiled before, is unchanged)."""
    src = render(sm90_config(problem(), (128, 64, 64), schedule=PINGPONG), "nvcc")
    assert "namespace cb_pingpong" in src and "cb_pingpong_kernel" in src
    assert "return cb_pingpong::prepare(x, list, msg, len);" in src
    assert "// Kernel: the project's persistent ping-pong kernel" in src
    assert "//   schedule        pingpong" in src
    assert "sa.max_swizzle_size = 1;" in src
    plain = render(sm90_config(problem(), (128, 64, 64)), "nvcc")
    assert "pingpong" not in plain and "reg_reconfig" not in plain


# ---------------------------------------------------------------------------------------------- compile
@pytest.mark.compile
@pytest.mark.timeout(900)
def test_compile_one_fprop_kernel(tmp_path):
    if not shutil.which("nvcc"):
        from cutlass_byoc.toolchain import ToolchainError, nvcc_path  # noqa: PLC0415

        try:
            nvcc_path()
        except ToolchainError as e:
            pytest.skip(f"nvcc missing: {e}")
    from cutlass_byoc.build import build  # noqa: PLC0415
    from cutlass_byoc.cache import KernelCache  # noqa: PLC0415
    from cutlass_byoc.runtime import make_args, open_library  # noqa: PLC0415

    p = problem()
    cfg = one(p)
    result = build([cfg], jobs=1, cache=KernelCache(tmp_path))[cfg]
    assert result.ok, result.error_report()
    assert "error" not in result.entry.log.lower()

    lib = open_library(result.library)
    assert KernelConfig.from_dict(__import__("json").loads(lib.cb_config_json())) == cfg
    assert lib.cb_kernel_name().decode() == cfg.name
    for fn in ("cb_can_implement", "cb_workspace_size", "cb_run"):
        assert hasattr(lib, fn), f"{fn} is not exported"

    # cb_can_implement and cb_workspace_size run on the host only: check them without a GPU.
    fake = dict(a=0x10000, b=0x20000, d=0x30000)

    def why(q, **kw):
        args = make_args(q, **{**fake, **kw})
        buf = ctypes.create_string_buffer(512)
        rc = lib.cb_can_implement(ctypes.byref(args), buf, len(buf))
        return rc, buf.value.decode()

    assert why(p) == (0, "")
    assert lib.cb_workspace_size(ctypes.byref(make_args(p, **fake))) == 0
    assert why(problem(stride=2, h=17, w=17)) == (0, "")
    assert why(problem(epilogue=Epilogue(source=SourceKind.RESIDUAL)), source=0x40000) == (0, "")
    rc, msg = why(p, split_k_slices=2)
    assert rc and "split-k" in msg
    assert why(problem(epilogue=Epilogue(source=SourceKind.BIAS)), source=0x40000) == (0, "")
    rc, msg = why(problem(c=4))  # 8-byte channel rows: TMA cannot load them
    assert rc and "alignment" in msg
    rc, msg = why(p, b=0x20008)
    assert rc and "B address" in msg
    rc, msg = why(problem(padding=300))
    assert rc and "padding" in msg
    args = make_args(p, **fake)
    args.p = 7
    buf = ctypes.create_string_buffer(512)
    assert lib.cb_can_implement(ctypes.byref(args), buf, len(buf)) and b"output size" in buf.value


def _split_why(lib):
    """The split-k library's own cb_can_implement on a problem and slice count, with fake, 16-byte aligned addresses
    (overridden by keyword): (return code, message)."""
    from cutlass_byoc.runtime import make_args  # noqa: PLC0415

    fake = dict(a=0x10000, b=0x20000, d=0x30000)

    def why(q, slices, **kw):
        args = make_args(q, slices, **{**fake, **kw})
        buf = ctypes.create_string_buffer(512)
        rc = lib._lib.cb_can_implement(ctypes.byref(args), buf, len(buf))
        return rc, buf.value.decode()

    return why


@pytest.mark.compile
@pytest.mark.timeout(900)
def test_compile_one_split_k_wgrad_kernel(shared_cache):
    """The project's split-k wgrad kernel (its own kernel body over a grid z of slices, fp32 partials, reduction
    kernel) builds for sm_90a; its host API sizes the partials and refuses what it cannot do."""
    from cutlass_byoc.build import build  # noqa: PLC0415
    from cutlass_byoc.runtime import KernelLibrary  # noqa: PLC0415

    p = problem("wgrad", n=32, h=56, w=56, c=64, k=64)
    cfg = split_one(p, tile=(64, 128, 64))
    result = build([cfg], jobs=1, cache=shared_cache)[cfg]
    assert result.ok, result.error_report()
    assert "error" not in result.entry.log.lower()
    lib = KernelLibrary(cfg, result.library)
    why = _split_why(lib)

    partial = p.k * p.r * p.s * p.c * 4  # one slice's fp32 partials
    for slices in (1, 2, 16, 64, 1568):
        assert why(p, slices) == (0, ""), slices
        assert lib.workspace_size(p, slices) == -(-slices * partial // 256) * 256
    rc, msg = why(p, 1569)  # N*P*Q = 100352 is 1568 k tiles of 64
    assert rc and "split_k_slices" in msg
    rc, msg = why(p, 4, d=0x30004)  # the reduction stores 4 fp16 (8 bytes) at a time
    assert rc and "output address" in msg
    assert why(p, 4, d=0x30008) == (0, "")
    res = p.replace(epilogue=Epilogue(source=SourceKind.RESIDUAL))
    assert why(res, 8, source=0x40000) == (0, "")
    rc, msg = why(problem("wgrad", c=4), 2)
    assert rc and "alignment" in msg
    assert lib.can_implement(p, 64) is None


@pytest.mark.compile
@pytest.mark.timeout(900)
def test_compile_one_atomic_split_k_wgrad_kernel(shared_cache):
    """The atomic twin (CUTLASS's epilogue with its TMA store swapped for the reduce-add store) builds for sm_90a with
    an fp32 output: it needs no workspace where the sums are the output (no source), one slice of fp32 sums where a
    source is added by the reduction, and a 16-byte aligned output for its TMA reduce-adds."""
    from cutlass_byoc.build import build  # noqa: PLC0415
    from cutlass_byoc.runtime import KernelLibrary  # noqa: PLC0415

    p = problem("wgrad", n=32, h=56, w=56, c=64, k=64, out_dtype="f32")
    cfg = sm90_mod.atomic_twin(split_one(p, tile=(64, 128, 64)))
    result = build([cfg], jobs=1, cache=shared_cache)[cfg]
    assert result.ok, result.error_report()
    assert "error" not in result.entry.log.lower()
    lib = KernelLibrary(cfg, result.library)
    why = _split_why(lib)

    for slices in (1, 2, 16, 1568):
        assert why(p, slices) == (0, ""), slices
        assert lib.workspace_size(p, slices) == 0  # the sums are the output
    rc, msg = why(p, 1569)  # N*P*Q = 100352 is 1568 k tiles of 64
    assert rc and "split_k_slices" in msg
    rc, msg = why(p, 4, d=0x30008)  # TMA reduce-adds of fp32 rows: 16-byte aligned
    assert rc and "output address" in msg
    res = p.replace(epilogue=Epilogue(source=SourceKind.RESIDUAL))
    assert why(res, 8, source=0x40000) == (0, "")
    assert lib.workspace_size(res, 8) == lib.workspace_size(res, 2) == p.k * p.r * p.s * p.c * 4  # one slice's sums
    assert lib.can_implement(p, 64) is None

def test_split_k_is_offered_for_every_output_type():
    """The project's 3.x split-k wgrad is a candidate for 16-bit and fp32 outputs alike (the 16-bit reduction was
    fixed after it stored nothing on the H200), and never for fprop or dgrad."""
    assert sm90_mod.SPLIT_K_OUTPUTS == {DType.F16, DType.BF16, DType.F32}
    for out in ("f16", "bf16", "f32"):
        p = problem("wgrad", n=32, h=56, w=56, c=64, k=64, out_dtype=out)
        assert any(c.split_k_mode is SplitKMode.PARALLEL for c in sm90_candidates(p)), out
    assert not any(c.split_k_mode is SplitKMode.PARALLEL for c in sm90_candidates(problem("fprop", n=32, h=56, w=56, c=64, k=64)))



def test_atomic_split_k_twin():
    """The atomic split-k wgrad kernel (split_k_mode ATOMIC: the slices' sums added into one fp32 buffer by TMA
    reduce-adds) is the split-k kernel's twin and nothing else's: same tile, stages and slices, fp32 sums; its
    deterministic twin is the split-k kernel; no other kind, schedule or family has one."""
    from cutlass_byoc.candidates import sm80_candidates  # noqa: PLC0415

    p = problem("wgrad", n=32, h=56, w=56, c=64, k=64, out_dtype="f32")
    split = split_one(p, tile=(64, 128, 64))
    twin = sm90_mod.atomic_twin(split)
    assert twin == dataclasses.replace(split, split_k_mode=SplitKMode.ATOMIC)
    assert twin.name == split.name.replace("_splitk_parallel_", "_splitk_atomic_")
    assert twin.element_kernel_out is DType.F32 and twin.stages == split.stages
    assert KernelConfig.from_dict(twin.to_dict()) == twin
    assert sm90_mod.deterministic_twin(twin) == split and sm90_mod.deterministic_twin(split) is split
    assert sm90_mod.atomic_twin(one(p)) is None and sm90_mod.atomic_twin(twin) is None
    for slices in (2, 16, 64):
        assert LaunchConfig(twin, slices).reject_reason(p) is None
    # not among the family's candidates: the planner adds it beside its twin (profiler.plan._atomic_twins)
    assert not any(c.split_k_mode is SplitKMode.ATOMIC for c in sm90_candidates(p))
    for kind in ("fprop", "dgrad"):
        with pytest.raises(ValueError, match="splits wgrad only"):
            dataclasses.replace(one(problem(kind)), split_k_mode=SplitKMode.ATOMIC, align_c=4)
    with pytest.raises(ValueError, match="ping-pong conv kernel has no split-k"):
        dataclasses.replace(twin, schedule=PINGPONG)
    sm80 = next(c for c in sm80_candidates(p) if c.split_k_mode is SplitKMode.PARALLEL)
    with pytest.raises(ValueError, match="split_k_mode atomic"):
        dataclasses.replace(sm80, split_k_mode=SplitKMode.ATOMIC)


def test_atomic_split_k_model():
    """The model charges the atomic twin one pass of adds per slice and a zeroing, the split-k kernel its partials
    written and read back: where the sums' traffic binds (layer 4's 3x3 wgrad: 2.4 M weights) the same launch ranks
    the atomic twin ahead, more so with more slices; where the math binds they tie."""
    from cutlass_byoc.heuristics import estimate_us  # noqa: PLC0415

    p = problem("wgrad", n=32, h=7, w=7, c=512, k=512, out_dtype="f32")
    split = split_one(p, tile=(64, 128, 64))
    twin = sm90_mod.atomic_twin(split)
    gains = [estimate_us(p, LaunchConfig(split, s)) - estimate_us(p, LaunchConfig(twin, s)) for s in (2, 4, 8, 16)]
    assert gains[0] == 0 < gains[1] < gains[2] < gains[3]


def test_render_atomic_split_k_wgrad():
    """The atomic twin renders the split-k kernel with CUTLASS's epilogue store swapped for TMA's reduce-add store
    into batch 0 of one buffer, zeroed first by a kernel whose programmatic dependent it is (its consumers wait for the
    zeroing before the epilogue, not before the loads); the reduction runs only where that buffer is not the output.
    The split-k kernel's own source is left as it was."""
    p = problem("wgrad")
    split = split_one(p)
    src = render(sm90_mod.atomic_twin(split), "nvcc")
    assert "cute::SM90_TMA_REDUCE_ADD" in src and "using SplitKernel = cutlass::conv::kernel::ConvUniversal<" in src
    # issued by one lane: CUTLASS's epilogue issues its TMA store from a whole warp, which for a reduce-add added every
    # tile 32 times (the H100, 2026-12-05)
    once = src[src.index("struct Copy_Traits<cb_splitk::TmaReduceAddOnce"):]
    assert once.index("if (cute::elect_one_sync())") < once.index("traits.copy_unpack_(")
    assert "std::is_same_v<Args, cute::SM90_TMA_STORE>, TmaReduceAddOnce, Args>" in src
    assert "static_assert(std::is_same_v<ElementKernelOut, float>" in src
    assert "make_coord(m_coord, n_coord, _, 0)" in src and "cb_split_wgrad_kernel(CUTLASS_GRID_CONSTANT" in src
    body = src[src.index("int prepare_split("):]
    order = ["cb_splitk_zero<<<", "cudaLaunchAttributeProgrammaticStreamSerialization",
             "cudaLaunchKernelEx(&cfg, cb_split_wgrad_kernel, params, slices)", "if (into_output) return 0;",
             "cb_splitk_reduce"]
    assert [body.index(t) for t in order] == sorted(body.index(t) for t in order)
    zero = src[src.index("cb_splitk_zero(float4*"):]
    assert zero.index("griddepcontrol.launch_dependents") < zero.index("sums[i] = zero")
    consumer = src[src.index("collective_mainloop.mma_tail("):]
    assert consumer.index("griddepcontrol.wait") < consumer.index("collective_epilogue.store(")
    assert "return adds_into_output(x) ? 0 :" in src
    plain = render(split, "nvcc")
    assert "SM90_TMA_REDUCE_ADD" not in plain and "cb_splitk_zero" not in plain and "SplitKernel" not in plain
    assert "make_coord(m_coord, n_coord, _, int(blockIdx.z))" in plain

# ---------------------------------------------------------------------------------------------- sub-pixel dgrad
def _subpixel_dgrad_f64(p: Conv2dProblem, dy, w):
    """dx computed phase by phase exactly as the template's cb_run does (each phase a stride-1 dgrad over the taps
    sm90.subpixel_phases gives it, with its lower padding), in float64 on the CPU."""
    import torch  # noqa: PLC0415

    dx = torch.zeros(p.n, p.c, p.h, p.w, dtype=torch.float64)
    for ra, ca in sm90_mod.subpixel_phases(p):
        if 0 in (ra.extent, ca.extent, ra.taps, ca.taps):
            continue
        assert ra.pad_hi >= 0 and ca.pad_hi >= 0
        wsub = w[:, :, ra.tap0::p.stride_h, ca.tap0::p.stride_w][:, :, :ra.taps, :ca.taps]
        # a stride-1 dgrad with padding (lo, hi) is a correlation of dy padded by (taps-1-lo, ...) with the rotated
        # filter; written out directly here
        out = torch.zeros(p.n, p.c, ra.extent, ca.extent, dtype=torch.float64)
        for t in range(ra.taps):
            for u in range(ca.taps):
                for i in range(ra.extent):
                    pi = i + ra.pad_lo - t
                    if not 0 <= pi < p.p:
                        continue
                    for j in range(ca.extent):
                        qj = j + ca.pad_lo - u
                        if 0 <= qj < p.q:
                            out[:, :, i, j] += dy[:, :, pi, qj] @ wsub[:, :, t, u]
        dx[:, :, ra.phase::p.stride_h, ca.phase::p.stride_w] = out
    return dx


@pytest.mark.parametrize("h, w, r, s, stride, pad", [
    (8, 8, 3, 3, 2, 1), (7, 9, 3, 3, 2, 1), (8, 8, 1, 1, 2, 0), (9, 7, 5, 5, 2, 2), (10, 11, 3, 3, 3, 1),
    (8, 6, 5, 3, 2, 2), (6, 8, 7, 7, 2, 3), (10, 10, 2, 2, 2, 0), (11, 10, 1, 3, 3, (0, 1)), (7, 8, 3, 1, (2, 3), 1),
])
def test_subpixel_phases_compute_the_strided_dgrad(h, w, r, s, stride, pad):
    """The decomposition itself, in float64: its phases add up to torch's dgrad of the strided conv."""
    torch = pytest.importorskip("torch")
    p = Conv2dProblem.make("dgrad", 2, 16, h, w, 8, r, s, stride=stride, padding=pad)
    assert sm90_mod.subpixel_reject_reason(p) is None
    torch.manual_seed(0)
    dy = torch.randn(p.n, p.k, p.p, p.q, dtype=torch.float64)
    wt = torch.randn(p.k, p.c, p.r, p.s, dtype=torch.float64)
    ref = torch.nn.grad.conv2d_input((p.n, p.c, p.h, p.w), wt, dy, stride=stride, padding=pad)
    assert torch.allclose(_subpixel_dgrad_f64(p, dy, wt), ref, atol=1e-10)


def test_subpixel_phases_of_resnet_layers():
    """3x3 stride 2 over an even image: four phases of 1, 2, 2 and 4 taps, each needing padding (0|1, 0) only; a
    1x1 stride-2 conv reaches one phase, the other three are zeros."""
    p = problem("dgrad", n=32, h=56, w=56, c=128, k=128, stride=2)
    taps = [(r.taps, c.taps) for r, c in sm90_mod.subpixel_phases(p)]
    assert taps == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert {(r.pad_lo, r.pad_hi) for r, _ in sm90_mod.subpixel_phases(p)} == {(0, 0), (1, 0)}
    p1 = problem("dgrad", n=32, h=56, w=56, c=256, k=512, r=1, padding=0, stride=2)
    assert [(r.taps, c.taps) for r, c in sm90_mod.subpixel_phases(p1)] == [(1, 1), (1, 0), (0, 1), (0, 0)]


def test_strided_dgrad_gets_the_subpixel_configs():
    p = problem("dgrad", stride=2)
    cands = list(sm90_candidates(p))
    assert cands and all(c.stride_support is StrideSupport.STRIDED for c in cands)
    assert all("_strided_" in c.name for c in cands)
    unity = one(problem("dgrad"))
    assert unity.stride_support is StrideSupport.UNITY and "stride" in unity.reject_reason(p)
    assert "stride > 1" in cands[0].reject_reason(problem("dgrad"))  # and the sub-pixel config not for stride 1
    # the same tile's two configs are two kernels (the host code differs), with names telling them apart
    assert cands[0].name != dataclasses.replace(cands[0], stride_support=StrideSupport.UNITY).name


@pytest.mark.parametrize("p, why", [
    # 3x3 stride 2 without padding over an even image: the last row's phase would need dy rows past P
    (problem("dgrad", h=8, w=8, padding=0, stride=2), "padding"),
    (problem("dgrad", stride=2, dilation=2, padding=2), "dilation"),
    (problem("dgrad", stride=5), "stride"),  # 25 phases
    # a 1x1 stride-2 conv leaves three phases of dx zero: a residual would change them
    (problem("dgrad", r=1, padding=0, stride=2, epilogue=Epilogue(source=SourceKind.RESIDUAL)), "epilogue"),
])
def test_subpixel_refusals_name_the_parameter(p, why):
    assert why in sm90_mod.subpixel_reject_reason(p)
    assert list(sm90_candidates(p)) == []


def test_subpixel_residual_where_every_phase_is_reached():
    # 3x3 stride 2: every phase has taps, so a residual is added phase by phase
    assert list(sm90_candidates(problem("dgrad", stride=2, epilogue=Epilogue(source=SourceKind.RESIDUAL))))


def test_render_subpixel():
    src = render(one(problem("dgrad", stride=2)), "nvcc")
    assert "subpixel_can_implement" in src and "phase_arguments" in src and "cudaMemsetAsync" in src
    assert "subpixel_can_implement" not in render(one(problem("dgrad")), "nvcc")


def test_subpixel_model_counts_only_the_taps_that_reach():
    """The model's estimate of the sub-pixel launch is the sum of its phases', each over the taps it uses: for a 3x3
    stride-2 dgrad about a quarter of the unity-stride dgrad of the same dx (9 taps for every pixel)."""
    from cutlass_byoc.heuristics import estimate_us  # noqa: PLC0415

    p = problem("dgrad", n=32, h=56, w=56, c=128, k=128, stride=2)
    unit = problem("dgrad", n=32, h=56, w=56, c=128, k=128)
    sub = estimate_us(p, LaunchConfig(one(p, (128, 64, 64))))
    full = estimate_us(unit, LaunchConfig(one(unit, (128, 64, 64))))
    assert 0.2 * full < sub < 0.6 * full


@pytest.mark.compile
@pytest.mark.timeout(900)
def test_compile_subpixel_dgrad_kernel(shared_cache):
    """The sub-pixel strided dgrad builds for sm_90a, and its host API takes the problems the rules take (asking
    CUTLASS about each phase) and refuses the others with the reason."""
    from cutlass_byoc.build import build  # noqa: PLC0415
    from cutlass_byoc.runtime import make_args  # noqa: PLC0415

    p = problem("dgrad", n=32, h=56, w=56, c=128, k=128, stride=2)
    cfg = one(p)
    result = build([cfg], jobs=1, cache=shared_cache)[cfg]
    assert result.ok, result.error_report()
    raw = __import__("cutlass_byoc.runtime", fromlist=["open_library"]).open_library(result.library)
    fake = dict(a=0x10000, b=0x20000, d=0x30000)

    def why(q, **kw):
        args = make_args(q, **{**fake, **kw})
        buf = ctypes.create_string_buffer(512)
        return raw.cb_can_implement(ctypes.byref(args), buf, len(buf)), buf.value.decode()

    for q in (p, problem("dgrad", h=17, w=15, stride=2), problem("dgrad", r=1, padding=0, stride=2),
              problem("dgrad", r=5, padding=2, h=9, w=11, stride=2), problem("dgrad", stride=3),
              problem("dgrad", stride=(2, 1))):
        assert sm90_mod.subpixel_reject_reason(q) is None
        assert why(q) == (0, ""), q.name
        assert raw.cb_workspace_size(ctypes.byref(make_args(q, **fake))) == 0
    assert why(problem("dgrad", stride=2, epilogue=Epilogue(source=SourceKind.RESIDUAL)), source=0x40000) == (0, "")
    for q, text in ((problem("dgrad"), "stride"), (problem("dgrad", h=8, w=8, padding=0, stride=2), "padding"),
                    (problem("dgrad", stride=2, dilation=2, padding=2), "dilation"),
                    (problem("dgrad", r=1, padding=0, stride=2, epilogue=Epilogue(source=SourceKind.RESIDUAL)), "epilogue"),
                    (problem("dgrad", c=4, stride=2), "alignment")):
        rc, msg = why(q, **({"source": 0x40000} if q.epilogue.source is not SourceKind.NONE else {}))
        assert rc and text in msg, (q.name, msg)


@pytest.mark.compile
@pytest.mark.timeout(900)
def test_compile_one_pingpong_kernel(shared_cache):
    """The project's persistent ping-pong conv kernel builds for sm_90a without warnings; its host API (CUTLASS's
    can_implement on the same collectives) takes the problem and refuses what TMA cannot load."""
    from cutlass_byoc.build import build  # noqa: PLC0415
    from cutlass_byoc.runtime import KernelLibrary, make_args  # noqa: PLC0415

    p = problem("fprop", n=32, h=56, w=56, c=64, k=64)
    cfg = sm90_config(p, (128, 64, 64), schedule=PINGPONG)
    result = build([cfg], jobs=1, cache=shared_cache)[cfg]
    assert result.ok, result.error_report()
    assert "warning" not in result.entry.log.lower()
    lib = KernelLibrary(cfg, result.library)
    assert lib.can_implement(p, 1) is None
    assert lib.workspace_size(p, 1) == 0
    args = make_args(p, 1, a=0x10000, b=0x20008, d=0x30000)
    buf = ctypes.create_string_buffer(512)
    assert lib._lib.cb_can_implement(ctypes.byref(args), buf, len(buf)) and b"alignment" in buf.value


def test_sourceless_twin_rules_and_render():
    """The sourceless sm90 kernel (KernelConfig.sourceless: CUTLASS's ElementC = void): for problems without bias or
    residual only, refused with the channel-statistics and bias-vector epilogues; its source passes a void C and
    no C pointer and refuses a source at launch."""
    p = problem("fprop")
    cfg = dataclasses.replace(one(p), sourceless=True)
    assert cfg.name.endswith("_nosrc_sm90") and cfg.reject_reason(p) is None
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg and "sourceless" not in one(p).to_dict()
    for src in (SourceKind.BIAS, SourceKind.RESIDUAL):
        q = problem("fprop", epilogue=Epilogue(Activation.IDENTITY, src))
        assert "sourceless kernel reads no epilogue source" in cfg.reject_reason(q)
    assert cfg.with_channel_stats().sourceless is None  # the statistics twin keeps its own epilogue
    with pytest.raises(ValueError, match="not with the channel-statistics"):
        dataclasses.replace(cfg.with_channel_stats(), sourceless=True)
    src = render(cfg, "nvcc")
    assert "    void, LayoutC, kAlignC,  // sourceless" in src
    assert "args.epilogue.ptr_C = nullptr;" in src and "this kernel is built without an epilogue source" in src
    for kind in ("dgrad", "wgrad"):
        twin = dataclasses.replace(one(problem(kind)), sourceless=True)
        assert "    void, LayoutC, kAlignC," in render(twin, "nvcc")
    sub = problem("dgrad", stride=2)  # the sub-pixel phases' arguments take no C either
    sub_cfg = next(k for k in sm90_candidates(sub) if k.is_subpixel_dgrad)
    sub_src = render(dataclasses.replace(sub_cfg, sourceless=True), "nvcc")
    assert sub_src.count("args.epilogue.ptr_C = nullptr;") == 2
    plain = render(one(p), "nvcc")
    assert "    ElementSource, LayoutC, kAlignC,\n" in plain and "ptr_C = nullptr" not in plain
