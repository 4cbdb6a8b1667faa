"""CPU tests of the depthwise family: configs (fields, names, rules, JSON), candidates and splits, rendering, the
planner, the model's default, the named workload and unsupported reasons (issue 12)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from cutlass_byoc import depthwise as dwmod
from cutlass_byoc.candidates import sm80_candidates, unsupported_reason
from cutlass_byoc.config import KernelConfig, LaunchConfig
from cutlass_byoc.depthwise import (
    WIDE_STRIP,
    prefetch_variant,
    prefetch_variants,
    default_depthwise_launch,
    depthwise_candidates,
    is_pipelined,
    is_pipelined_wgrad,
    is_wide_strip,
    halo_shape,
    lanes,
    pad_groups,
    pixel_tiles,
    row_groups,
    smem_bytes,
    split_candidates,
    strip,
    thread_taps,
    with_alignments,
)
from cutlass_byoc.heuristics import default_launch
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.profiler.plan import (
    CLUSTER_SPLIT_BUDGET, COLS_BUDGET, DEPTHWISE_BUDGET_FACTOR, PIPELINED_BUDGET, WIDE_STRIP_BUDGET, has_kernels, plan_problem,
)
from cutlass_byoc.render import render
from cutlass_byoc.types import Activation, ConvKind, DType, KernelFamily, SourceKind, SplitKMode
from cutlass_byoc.workloads import DEPTHWISE_LAYERS, default_workload, depthwise_workload, named_workload


def dw(kind="fprop", n=4, c=96, hw=15, r=3, stride=1, pad=None, **kw) -> Conv2dProblem:
    return Conv2dProblem.make(kind, n, c, hw, hw, c, r, stride=stride, padding=r // 2 if pad is None else pad,
                              groups=c, **kw)


def first(problem, **want) -> KernelConfig:
    return next(c for c in depthwise_candidates(problem) if all(getattr(c, k) == v for k, v in want.items()))


# ---------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("kind", list(ConvKind))
@pytest.mark.parametrize("r, stride", [(3, 1), (3, 2), (5, 1), (5, 2), (7, 1), (7, 2)])
def test_candidates_exist_and_are_valid_for_every_kind_filter_and_stride(kind, r, stride):
    p = dw(kind.value, r=r, stride=stride)
    cands = list(depthwise_candidates(p))
    assert cands, p.name
    assert len({c.name for c in cands}) == len(cands), "names are unique"
    for c in cands:
        assert c.family is KernelFamily.DEPTHWISE_DIRECT and c.static_error() is None
        assert c.reject_reason(p) is None
        assert c.filter_rs == (r, r) and c.conv_stride == (stride, stride)
        assert c.name.startswith(f"cb_dw_{kind.value}_") and f"_f{r}x{r}_u{stride}x{stride}_" in c.name
        assert (c.split_k_mode in (SplitKMode.PARALLEL, SplitKMode.CLUSTER)) == (kind is ConvKind.WGRAD)
        if kind is ConvKind.WGRAD:
            assert dwmod.thread_taps(c) * c.align_a <= dwmod.WGRAD_MAX_ACC and c.align_c == 1
            assert dwmod.thread_taps(c) == (r if c.schedule == "taprows" or dwmod.is_pipelined_wgrad(c) else r * r)
        else:
            assert c.align_b == 1
    assert {c.halo_smem for c in cands} == ({False} if kind is ConvKind.DGRAD and stride > 1 else {False, True})


def test_every_wgrad_config_has_its_cluster_split_twin():
    """Each wgrad config comes with the same kernel reducing its splits in one thread-block cluster: 1-8 splits (the
    portable cluster size, each with work), no workspace split count beyond that, its own name; fprop / dgrad have
    none; the model's default never picks one (its few splits can leave the GPU idle)."""
    p = dw("wgrad", c=960, hw=7, n=32)
    cands = list(depthwise_candidates(p))
    parallel = {c for c in cands if c.split_k_mode is SplitKMode.PARALLEL}
    cluster = {c for c in cands if c.split_k_mode is SplitKMode.CLUSTER}
    assert cluster and {dataclasses.replace(c, split_k_mode=SplitKMode.PARALLEL) for c in cluster} == parallel
    assert all("_splitk_cluster_" in c.name for c in cluster) and not any("cluster" in c.name for c in parallel)
    c = next(k for k in sorted(cluster, key=lambda k: k.name) if dwmod.pixel_tiles(k, p) >= 16)  # 16 splits have work
    assert dwmod.cluster_variant(c) is None and dwmod.cluster_variant(first(dw(), align_a=8)) is None
    assert set(dwmod.split_candidates(p, c)) <= {1, 2, 4, 8}
    assert LaunchConfig(c, 8).reject_reason(p) is None
    assert "at most 8" in LaunchConfig(c, 16).reject_reason(p)
    assert dwmod.default_depthwise_launch(p).kernel.split_k_mode is SplitKMode.PARALLEL
    # no partials: the model charges neither their traffic nor the reduction's launch
    twin = dataclasses.replace(c, split_k_mode=SplitKMode.PARALLEL)
    assert dwmod.estimate_us(p, LaunchConfig(c, 4)) < dwmod.estimate_us(p, LaunchConfig(twin, 4))
    assert not any(dwmod.is_cluster_split(k) for k in depthwise_candidates(dw("fprop")))


def test_vector_width_follows_the_channel_count():
    assert {c.align_a for c in depthwise_candidates(dw(c=96)) if c.schedule != "cols"} == {8, 4}
    assert {c.align_a for c in depthwise_candidates(dw(c=96)) if c.schedule == "cols"} == {4, 2}  # taps + 3 rows fp32
    assert {c.align_a for c in depthwise_candidates(dw(c=36))} == {4, 2}  # C not a multiple of 8
    assert {c.align_a for c in depthwise_candidates(dw(c=7))} == {1}
    assert {c.align_a for c in depthwise_candidates(dw(c=96, dtype="f32"))} == {4, 2}  # 16 bytes of fp32
    fp32_out = first(dw(c=96, out_dtype="f32"), align_a=8)
    assert fp32_out.align_c == 4  # 8 fp32 outputs stored as two 16-byte accesses
    sev = list(depthwise_candidates(dw("wgrad", c=96, r=7)))
    assert {c.align_a for c in sev if c.schedule in (None, "rows") and not is_pipelined_wgrad(c)} == {2}  # 49 x 2 sums
    assert {c.align_a for c in sev if c.schedule == "taprows"} == {8, 4}  # one filter row: 7 x 8
    assert {c.align_a for c in sev if c.schedule == "cols"} == {1}  # 49 sums and 7 input rows in fp32 per channel


def test_config_json_round_trip_and_other_families_unchanged():
    c = first(dw("wgrad"), halo_smem=True)
    d = json.loads(c.to_json())
    assert d["conv_stride"] == [1, 1] and d["halo_smem"] is True and d["filter_rs"] == [3, 3]
    assert KernelConfig.from_dict(d) == c
    launch = LaunchConfig(c, 8)
    assert LaunchConfig.from_dict(json.loads(json.dumps(launch.to_dict()))) == launch
    sm80 = next(sm80_candidates(Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1)))
    assert "conv_stride" not in sm80.to_dict() and "halo_smem" not in sm80.to_dict()  # sources (cache keys) unchanged
    with pytest.raises(ValueError, match="depthwise family only"):
        dataclasses.replace(sm80, halo_smem=True)
    with pytest.raises(ValueError, match="depthwise family only"):
        dataclasses.replace(sm80, min_blocks=4)
    assert "min_blocks" not in c.to_dict()  # unset: the depthwise sources (cache keys) of before are unchanged
    capped = dataclasses.replace(c, min_blocks=4)
    assert KernelConfig.from_dict(json.loads(capped.to_json())) == capped and capped.to_dict()["min_blocks"] == 4


def test_register_capped_twins():
    """Every candidate of which two CTAs fit under MIN_BLOCKS_REGS (fprop / dgrad "cols" kernels: COLS_CAPPED_REGS)
    comes with its min_blocks twin (registers capped there) right after it, named _mb<n>, ranked by the model just
    behind it; the unbounded kernel's source has the plain __launch_bounds__. The others are the pipelined wgrad CTAs
    of 384 threads and more. The capped "cols" fprop / dgrad twins read their taps from shared memory."""
    from cutlass_byoc.depthwise import COLS_CAPPED_REGS, MIN_BLOCKS_REGS, estimate_us, min_blocks_variant

    def cap(c):
        return COLS_CAPPED_REGS if c.schedule == "cols" and c.kind.value != "wgrad" else MIN_BLOCKS_REGS[c.kind]

    for kind in ("fprop", "dgrad", "wgrad"):
        cands = list(depthwise_candidates(dw(kind)))
        plain = [c for c in cands if c.min_blocks is None and not c.prefetch]  # (prefetch twins: "cols" ones)
        capped = [c for c in cands if c.min_blocks is not None]
        alone = [c for c in plain if 65536 // (cap(c) * c.threads) < 2]
        assert all(is_pipelined_wgrad(c) and c.threads >= 384 for c in alone) and (kind == "wgrad") == bool(alone)
        assert any(c.schedule == "cols" for c in capped)
        assert plain and len(capped) == len(plain) - len(alone)
        for c in (c for c in plain if c not in alone):
            twin = cands[cands.index(c) + 1]
            assert twin == dataclasses.replace(c, min_blocks=twin.min_blocks) and twin.name == c.name.replace(
                "_sm90", f"_mb{twin.min_blocks}_sm90")
            assert twin.min_blocks == min(65536 // (cap(c) * c.threads), 2048 // c.threads)
            assert min_blocks_variant(twin) is None
            p = dw(kind)
            for s in split_candidates(p, c)[:1]:
                assert estimate_us(p, LaunchConfig(twin, s)) <= estimate_us(p, LaunchConfig(c, s)) * 1.011
    c = first(dw("fprop"), halo_smem=False, align_a=8, min_blocks=None)
    assert "__launch_bounds__(kThreads) depthwise_kernel" in render(c, "nvcc")
    src = render(min_blocks_variant(c), "nvcc")
    assert f"__launch_bounds__(kThreads, {min_blocks_variant(c).min_blocks}) depthwise_kernel" in src
    assert "reduce_kernel" not in src  # fprop: no reduction kernel
    k = first(dw("fprop"), schedule="cols", prefetch=None, min_blocks=None)
    src, capped = render(k, "nvcc"), render(min_blocks_variant(k), "nvcc")
    assert "float w[kR][kS][kVec];" in src and "fresh_filter_row" not in src
    assert "float w[kR][kS][kVec];" not in capped and "ld.volatile.shared.v4.f32" in capped
    assert f"__launch_bounds__(kThreads, {min_blocks_variant(k).min_blocks}) depthwise_kernel" in capped


@pytest.mark.parametrize("change, message", [
    (dict(filter_rs=None), "filter_rs"),
    (dict(filter_rs=(3, 11)), "filter_rs"),
    (dict(conv_stride=None), "conv_stride"),
    (dict(halo_smem=None), "halo_smem"),
    (dict(stages=2), "stages"),
    (dict(tile=(4, 8, 60)), "tile"),
    (dict(warps=(3, 1, 1)), "tile"),
    (dict(align_b=8), "align_b"),
    (dict(split_k_mode=SplitKMode.PARALLEL, align_c=4), "split_k_mode"),
    (dict(align_a=16), "align_a"),
    (dict(tile=(16, 32, 64), warps=(4, 1, 1)), "strip"),
    (dict(min_blocks=1), "min_blocks"),
    (dict(min_blocks=17), "min_blocks"),  # 17 x 128 threads > 2048
])
def test_static_errors_name_the_field(change, message):
    c = first(dw(), halo_smem=False, align_a=8)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(c, **change)


def test_static_errors_of_wgrad_and_dgrad():
    w = first(dw("wgrad"), align_a=8)
    with pytest.raises(ValueError, match="split_k_mode"):
        dataclasses.replace(w, split_k_mode=SplitKMode.SERIAL)
    with pytest.raises(ValueError, match="accumulators"):
        dataclasses.replace(w, filter_rs=(7, 7))
    d = first(dw("dgrad", stride=2), align_a=8)
    with pytest.raises(ValueError, match="halo_smem"):
        dataclasses.replace(d, halo_smem=True)
    big = first(dw(), halo_smem=True, align_a=8)
    with pytest.raises(ValueError, match="shared memory"):
        dataclasses.replace(big, tile=(32, 32, 64), warps=(32, 1, 1))


def test_pipelined_halo_kernels():
    """stages 2 (pipelined): fprop and stride-1 dgrad with a staged halo only, one halo buffer per stage, resident CTAs
    sized on the device; the one-stage kernels render without any of it."""
    c = first(dw(), halo_smem=True, align_a=8, stages=1, min_blocks=None)
    piped = dataclasses.replace(c, stages=2)
    assert is_pipelined(piped) and not is_pipelined(c) and piped.name == c.name.replace("_smem_", "_smem2_")
    hh, ww = halo_shape(c)
    assert smem_bytes(piped) - smem_bytes(c) == hh * ww * c.tile[2] * 2
    src, plain = render(piped, "nvcc"), render(c, "nvcc")
    for text in ("cp_async_wait<kStages - 1>()", "resident_ctas()", "halo[kStages][kHaloRows]", "#include <atomic>",
                 "cudaOccupancyMaxActiveBlocksPerMultiprocessor"):
        assert text in src and text not in plain, text
    with pytest.raises(ValueError, match="stages"):
        dataclasses.replace(piped, stages=3)
    with pytest.raises(ValueError, match="stages"):
        dataclasses.replace(piped, halo_smem=False)
    for kind, stride, has in (("fprop", 1, True), ("fprop", 2, True), ("dgrad", 1, True), ("dgrad", 2, False),
                              ("wgrad", 1, True), ("wgrad", 2, True)):
        cands = [k for k in depthwise_candidates(dw(kind, stride=stride)) if k.schedule is None]
        assert any(is_pipelined(k) for k in cands) == has, (kind, stride)
    w = first(dw("wgrad"), halo_smem=False, align_a=8, schedule=None)
    with pytest.raises(ValueError, match="stages"):
        dataclasses.replace(w, stages=2)


def test_pipelined_wgrad_kernels():
    """The pipelined wgrad: pixel tiles with halo_smem and stages 2, the filter rows split over R groups of whole warps
    (S*vector sums per thread, so 5x5 takes vector 8), the dy tile double-buffered beside the halo, one CTA per split
    and channel block (no resident-CTA query)."""
    p = dw("wgrad", r=5, c=96, hw=28)
    cands = [k for k in depthwise_candidates(p) if is_pipelined_wgrad(k)]
    assert cands and all(k.halo_smem and k.stages == 2 and k.schedule is None for k in cands)
    assert {k.align_a for k in cands} == {8, 4}  # 5 taps x 8 sums fit where 25 x 8 do not
    for k in cands:
        rows, cols, ch = k.tile
        assert row_groups(k) == 5 and thread_taps(k) == 5 and (k.threads // 5) % 32 == 0
        assert k.threads == 5 * rows * cols // strip(k) * ch // k.align_a
        hh, ww = halo_shape(k)
        halo_group, dy_group = pad_groups(k)  # a pad column per group (bank conflicts), where it fits
        assert halo_group in (0, strip(k)) and dy_group in (0, strip(k))
        ww += (ww - 1) // halo_group if halo_group else 0
        cols += cols // dy_group if dy_group else 0
        assert smem_bytes(k) == 25 * ch * 4 + (hh * ww + rows * cols) * ch * 2 * 2 <= 48 * 1024
    assert not is_pipelined_wgrad(default_depthwise_launch(p).kernel)  # left to the profiler (its model misses the copies)
    c = next(k for k in cands if k.tile == (4, 16, 32) and k.align_a == 8 and k.min_blocks is None)
    assert strip(c) in (2, 4) and c.name.endswith("_smem2_align881_splitk_parallel_f5x5_u1x1_sm90")
    src = render(c, "nvcc")
    for text in ("dy_tile[kStages][kTileRows][kDyStoreCols][kLanes]", "load_dy_tile(", "cp_async_wait<kStages - 1>()",
                 "constexpr int kRowGroups = kR;", "cta_sum(acc, total, lane, channel_ok, r * kS)"):
        assert text in src, text
    for text in ("resident_ctas", "#include <atomic>", "stage_filter("):
        assert text not in src, text
    four = next(k for k in depthwise_candidates(dw("wgrad", r=4, c=96, hw=28)) if is_pipelined_wgrad(k))
    with pytest.raises(ValueError, match="filter-row groups must be whole warps"):
        dataclasses.replace(four, tile=(1, 16, 32), warps=(2, 1, 1))  # 4 groups of 16 threads
    with pytest.raises(ValueError, match="do not divide"):
        dataclasses.replace(c, warps=(7, 1, 1))


def test_cols_kernels():
    """The "cols" schedule: all kinds (strided dgrad: strips of whole stride periods); registers within COLS_MAX_REGS
    (so 3x3 at vector 4 at most, 5x5 at 2; the strided dgrad, reading ceil(R / 2) dy rows per dx row, 3x3 at 8); strips
    of rows leaving at most 15% of the pixel grid's rows idle; the rendered kernel keeps
    input rows in registers and reads nothing through shared memory but the filter (fprop) or the CTA's sum (wgrad)."""
    from cutlass_byoc.depthwise import COLS_MAX_REGS, cols_registers, is_cols  # noqa: PLC0415

    for kind, stride in (("wgrad", 1), ("wgrad", 2), ("fprop", 1), ("fprop", 2), ("dgrad", 1), ("dgrad", 2)):
        for r, hw in ((3, 56), (5, 28), (3, 14)):
            p = dw(kind, r=r, c=144, hw=hw, stride=stride)
            cols = [k for k in depthwise_candidates(p) if is_cols(k)]
            gathered = kind == "dgrad" and stride == 2
            assert cols and all(cols_registers(k) <= COLS_MAX_REGS and not k.halo_smem for k in cols)
            assert max(k.align_a for k in cols) == ((8 if gathered else 4) if r == 3 else 2)
            if gathered:  # whole stride periods; the first strip starts a row above dx (padding r // 2, odd for 3x3)
                assert all(k.stages % 2 == 0 and k.tile[1] % 2 == 0 for k in cols)
            height = (p.h + p.pad_h % 2 if gathered else p.h) if kind == "dgrad" else p.p
            assert all(-(-height // k.stages) * k.stages <= 1.15 * height for k in cols), {k.stages for k in cols}
            assert any(144 % k.tile[2] == 0 for k in cols)  # a channel tile dividing C (no idle lanes)
            assert any(k.min_blocks for k in cols)  # capped twins (fprop / dgrad: taps from shared memory)
            assert not any(k.min_blocks and k.prefetch for k in cols)
            if kind == "wgrad":
                assert all(s <= pixel_tiles(k, p) for k in cols for s in split_candidates(p, k))
    k = next(k for k in depthwise_candidates(dw("fprop", r=3, c=144, hw=56)) if is_cols(k) and k.stages == 7)
    assert "_cols7_" in k.name
    src = render(k, "nvcc")
    for text in ("constexpr int kRun = 7;", "float xf[kInRows][kWindow][kVec];", "load_strip_row<kAlignA>(",
                 "filter_row(filter, r, lane, w[r])", "store_cols_output<kSource>(", "depthwise_kernel<0><<<",
                 "depthwise_kernel<1><<<", "depthwise_kernel<2><<<",
                 "float(p.filter[int64_t(c) * kTaps + tap]) * p.alpha"):
        assert text in src, text  # one instantiation per epilogue source, alpha in the staged taps
    assert "halo[" not in src and "cp_async" not in src and "store_output(" not in src
    with pytest.raises(ValueError, match="registers"):
        dataclasses.replace(k, align_a=8, tile=(k.tile[0], k.tile[1], k.tile[2] * 2))  # 3x3 at vector 8
    with pytest.raises(ValueError, match="whole stride periods"):
        dataclasses.replace(k, kind=ConvKind.DGRAD, conv_stride=(2, 2))  # 7 rows
    g = next(k for k in depthwise_candidates(dw("dgrad", r=3, c=144, hw=56, stride=2)) if is_cols(k))
    src = render(g, "nvcc")
    for text in ("constexpr int kRowsBack = (kR - 1) / kStrideH;", "if ((k - r) % kStrideH != 0) continue;",
                 "int const shift_h = p.pad_h % kStrideH", "depthwise_kernel<2><<<"):
        assert text in src, text
    assert "depthwise_kernel<1><<<" not in src  # dgrad takes no bias


def test_strided_dgrad_without_a_stride_period_strip_has_no_cols_kernels():
    """A strided dgrad's "cols" strips are whole stride periods: at stride 3 no strip width (1, 2, 4) and no row run
    (7, 8, 14, 4) is one, so that schedule offers nothing and the others still do (the planner once took the min of an
    empty list there: a ConvTranspose2d of stride 3 crashed the user's compile); stride 4 keeps its cols kernels."""
    from cutlass_byoc.depthwise import is_cols  # noqa: PLC0415

    p = dw("dgrad", r=3, c=16, hw=12, stride=3)
    cands = list(depthwise_candidates(p))
    assert cands and not any(is_cols(k) for k in cands)
    launch = default_launch(p)
    assert launch.kernel.family.value == "depthwise_direct" and launch.kernel.conv_stride == (3, 3)
    four = [k for k in depthwise_candidates(dw("dgrad", r=3, c=16, hw=12, stride=4)) if is_cols(k)]
    assert four and all(k.stages % 4 == 0 and k.tile[1] % 4 == 0 for k in four)


def test_calibrated_default_on_the_measured_problems():
    """The untuned default ranks every schedule but the cluster split by the calibrated model (DW_CALIBRATION, fitted
    to benchmarks/h200/dw-defaults.json: scripts/depthwise_defaults.py's H200 run). On that run's 57 problems its
    pick was always among the launches timed, and they sum to 1231 us against 1536 for the defaults before (no
    "cols" kernel), 1011 for the best timed and 1542 for cuDNN; MobileNetV2's 144-channel 56x56 layer runs "cols"
    kernels (the tuned winners of every kind there), and never a one-column strip without prefetch where those ran
    2-4x slower than their twins (the 576-channel stride-2 fprop: 25.6 against 9.0 us). Outside what was measured
    (filters past 5x5, "cols" kernels of vector 1) the factors are not used."""
    from pathlib import Path  # noqa: PLC0415

    from cutlass_byoc.depthwise import (DW_CALIBRATION, DW_GROUP_CALIBRATION, calibration_group,  # noqa: PLC0415
                                        is_cluster_split, is_cols, pass_class)

    data = json.loads((Path(__file__).parent.parent / "benchmarks/h200/dw-defaults.json").read_text())
    timed = {(r["problem"], r["launch"]): r["time_us"] for r in data["rows"] if r["time_us"]}
    old = {r["problem"]: r["time_us"] for r in data["rows"] if r["default"]}
    best: dict[str, float] = {}
    for (name, _), us in timed.items():
        best[name] = min(best.get(name, us), us)
    new = 0.0
    for item in depthwise_workload():
        p = item.problem
        for c in depthwise_candidates(p):  # every pair the default can meet has its own factor
            assert is_cluster_split(c) or (calibration_group(c), pass_class(p)) in DW_CALIBRATION, (c.name, p.name)
        launch = default_depthwise_launch(p)
        assert not is_cluster_split(launch.kernel)
        assert (p.name, launch.name) in timed, (item.layer, p.kind.value, launch.name)
        new += timed[(p.name, launch.name)]
        if item.layer == "mbv2_dw_144_56":
            assert is_cols(launch.kernel), launch.name
        if item.layer == "mbv2_dw_576_s2_14" and p.kind is ConvKind.FPROP:
            assert calibration_group(launch.kernel) != "cols1", launch.name
    assert len(old) == 57 and round(new) == 1231
    assert round(sum(old.values())) == 1536 and round(sum(best.values())) == 1011
    assert set(DW_GROUP_CALIBRATION) == {g for g, _ in DW_CALIBRATION}
    # outside the measured range the factors are not used: ConvNeXt's 7x7 keeps the model's own pick (no "cols"
    # kernel, no pipelined wgrad), and no "cols" kernel of one channel per thread (2-byte loads) is a default
    for kind in ("fprop", "dgrad", "wgrad"):
        for c, hw in ((96, 56), (768, 7)):
            k = default_depthwise_launch(dw(kind, n=32, c=c, hw=hw, r=7)).kernel
            assert not is_cols(k) and not is_pipelined_wgrad(k) and not is_cluster_split(k), k.name
        odd = dw(kind, n=32, c=33, hw=28)
        assert any(is_cols(c) and c.align_a == 1 for c in depthwise_candidates(odd))
        k = default_depthwise_launch(odd).kernel
        assert not (is_cols(k) and k.align_a == 1), k.name


def test_cols_prefetch_twins():
    """A "cols" kernel's prefetch twins issue their loads PREFETCH_ROWS rows ahead and as many rows ahead as the
    registers allow (at most the strip's rows - 1): their own names, more registers (the rows of loads in flight),
    within COLS_MAX_REGS or not proposed; "cols" only, fewer rows ahead than the strip has."""
    from cutlass_byoc.depthwise import COLS_MAX_REGS, PREFETCH_ROWS, cols_registers, is_cols  # noqa: PLC0415

    deep_seen = 0
    for kind in ("fprop", "dgrad", "wgrad"):
        for p in (dw(kind, r=3, c=144, hw=56), dw(kind, r=3, c=1152, hw=7), dw(kind, r=5, c=672, hw=14, stride=2)):
            cands = list(depthwise_candidates(p))
            twins = [k for k in cands if k.prefetch]
            assert twins and all(is_cols(k) and 2 <= k.prefetch < k.stages and not k.min_blocks for k in twins)
            for k in twins:
                base = dataclasses.replace(k, prefetch=None)
                assert base in cands and k in prefetch_variants(base) and f"_cols{k.stages}pf{k.prefetch}_" in k.name
                assert base.name == k.name.replace(f"pf{k.prefetch}", "")
                assert cols_registers(base) < cols_registers(k) <= COLS_MAX_REGS
            # for every "cols" kernel with the registers and rows for them: the PREFETCH_ROWS twin, and the deepest one
            # past it that fits
            for k in cands:
                if is_cols(k) and not k.prefetch and not k.min_blocks:
                    got = [t.prefetch for t in prefetch_variants(k)]
                    fits = [rows for rows in range(PREFETCH_ROWS, k.stages) if _fits_ahead(k, rows)]
                    want = ([PREFETCH_ROWS] if PREFETCH_ROWS in fits else []) + \
                        ([max(fits)] if fits and max(fits) > PREFETCH_ROWS else [])
                    assert got == want, (k.name, got, want)
                    assert (prefetch_variant(k) is not None) == (PREFETCH_ROWS in fits)
                    deep_seen += len(got) == 2 and got[1] == k.stages - 1
    assert deep_seen  # some strips load all their rows ahead
    k = next(k for k in depthwise_candidates(dw("wgrad", r=3, c=144, hw=56)) if k.prefetch == 2 and k.stages == 7)
    src = render(k, "nvcc")
    assert "constexpr int kPrefetch = 2;" in src and "if (k + kPrefetch < kRun)" in src
    assert "constexpr int kPrefetch = 1;" in render(dataclasses.replace(k, prefetch=None), "nvcc")
    with pytest.raises(ValueError, match="prefetch"):
        dataclasses.replace(k, prefetch=7)  # as many rows ahead as the strip has
    with pytest.raises(ValueError, match="prefetch"):
        dataclasses.replace(first(dw("wgrad")), prefetch=2)  # not a "cols" kernel
    with pytest.raises(ValueError, match="prefetch"):
        dataclasses.replace(first(dw("fprop")), family=KernelFamily.SM80_IMPLICIT_GEMM, prefetch=2)


def _fits_ahead(k, rows: int = 2) -> bool:
    """Whether `k` loading `rows` rows ahead stays within COLS_MAX_REGS (computed here from the register count of one
    row ahead: each row ahead adds the new input rows' and wgrad's dy row's vectors as loaded)."""
    from cutlass_byoc.depthwise import COLS_MAX_REGS, cols_registers, cols_window, is_gathered  # noqa: PLC0415

    if is_gathered(k):  # a dy row every u dx rows
        per_row = cols_window(k)
    else:
        per_row = min(k.conv_stride[0], k.filter_rs[0]) * cols_window(k) + \
            (k.tile[1] if k.kind is ConvKind.WGRAD else 0)
    return math.ceil(cols_registers(k) + (rows - 1) * per_row * k.align_a * k.element_a.nbytes / 4) <= COLS_MAX_REGS


def test_reject_reason_names_what_does_not_fit():
    c = first(dw(), align_a=8)
    assert c.reject_reason(dw(r=5)).startswith("filter")
    assert c.reject_reason(dw(stride=2)).startswith("stride")
    assert c.reject_reason(dw(c=100)).startswith("alignment")
    assert c.reject_reason(dw(dilation=2, pad=2)).startswith("dilation")
    assert c.reject_reason(Conv2dProblem.make("fprop", 4, 96, 15, 15, 96, 3, padding=1, groups=2)).startswith("groups")
    assert c.reject_reason(Conv2dProblem.make("fprop", 4, 96, 15, 15, 96, 3, padding=1)).startswith("groups")
    assert c.reject_reason(dw(epilogue=Epilogue(Activation.RELU))).startswith("activation")
    assert c.reject_reason(dw(hw=1000, c=96, n=64)) is not None  # past int32 indexing
    assert c.reject_reason(dw(hw=7, n=1, pad=0)) is None  # one kernel serves every size
    sm80 = next(sm80_candidates(Conv2dProblem.make("fprop", 4, 96, 15, 15, 96, 3, padding=1)))
    assert sm80.reject_reason(dw()).startswith("groups")


def test_splits_are_a_launch_parameter_of_wgrad_only():
    f = first(dw(), align_a=8)
    with pytest.raises(ValueError, match="only depthwise wgrad"):
        LaunchConfig(f, 2)
    p = dw("wgrad", n=32, hw=56)
    w = first(p, align_a=8)
    splits = split_candidates(p, w)
    assert len(splits) >= 2 and all(s >= 1 for s in splits) and splits == sorted(splits)
    assert all(LaunchConfig(w, s).reject_reason(p) is None for s in splits)
    small = dw("wgrad", n=1, hw=8)
    tiles = pixel_tiles(w, small)
    assert "exceed" in LaunchConfig(w, tiles + 1).reject_reason(small)
    assert split_candidates(dw(), f) == [1]


def test_narrowing_to_pointer_alignment_keeps_a_valid_kernel():
    c = first(dw(), align_a=8)
    n = with_alignments(c, 2, 8, 8)
    assert (n.align_a, n.align_b, n.align_c, n.tile[2]) == (2, 1, 2, c.tile[2] // 4)
    assert n.static_error() is None and n.reject_reason(dw()) is None
    w = first(dw("wgrad"), align_a=8)
    nw = with_alignments(w, 8, 2, 8)
    assert (nw.align_a, nw.align_b, nw.align_c) == (8, 2, 1) and nw.reject_reason(dw("wgrad")) is None


# ---------------------------------------------------------------------------------------------- rendering
def test_render_fprop_with_epilogue():
    p = dw(r=5, stride=2, epilogue=Epilogue(Activation.SILU, SourceKind.BIAS), out_dtype="f32")
    c = first(p, halo_smem=True, align_a=8)
    src = render(c, "nvcc test")
    assert src.startswith(f"// {c.name}\n") and "// Compile: nvcc test" in src
    assert "templates/conv2d_depthwise_direct.cu.j2" in src
    assert "cutlass::epilogue::thread::SiLu<float>" in src
    assert "using ElementOutput = float;" in src and "using Element = cutlass::half_t;" in src
    assert "constexpr int kR = 5;" in src and "constexpr int kStrideW = 2;" in src
    assert "__shared__ Vec halo[kHaloRows][kHaloCols][kLanes];" in src
    assert src.count("cudaGetLastError") == 1 and "cb_workspace_size" in src
    assert "reduce_kernel" not in src and "{{" not in src and "{%" not in src
    assert "griddepcontrol" not in src and "cudaLaunchKernelEx" not in src  # no dependent launch without a reduction


def test_render_wgrad_cluster_split():
    """The cluster twin: one kernel launched in clusters of `splits` CTAs, split fastest; the splits' sums added in
    split order through distributed shared memory, between two cluster barriers; no partials, no reduction kernel."""
    c = dwmod.cluster_variant(first(dw("wgrad"), halo_smem=False))
    src = render(c, "nvcc")
    assert "#include <cooperative_groups.h>" in src and "cudaLaunchAttributeClusterDimension" in src
    assert "cudaLaunchKernelEx(&cfg, depthwise_kernel, p)" in src and "clusterDim.x = unsigned(splits)" in src
    assert "work = int(blockIdx.x % splits);" in src
    body = src[src.index("CUTLASS_DEVICE void finish_split"):]
    body = body[:body.index("\n}\n")]
    assert body.count("cluster.sync();") == 2 and "map_shared_rank(&total[tap][cl], r)" in body
    assert body.index("cluster.sync();") < body.index("map_shared_rank") < body.rindex("cluster.sync();")
    assert "reduce_kernel" not in src and "p.partials[" not in src and "griddepcontrol" not in src
    assert "kMaxClusterSplits = 8" in src and "atomicAdd" not in src


def test_render_dgrad_stride_1_is_rotated_fprop_and_strided_gathers_valid_taps():
    flipped = render(first(dw("dgrad"), halo_smem=False), "nvcc")
    assert "rotated 180 degrees" in flipped and "kTaps - 1 - tap" in flipped and "kR - 1 - int(x->pad_h)" in flipped
    assert "constexpr int kStrideH = 1;" in flipped
    strided = render(first(dw("dgrad", stride=2)), "nvcc")
    assert "r += kStrideH" in strided and "s += kStrideW" in strided and "kTaps - 1 - tap" not in strided
    assert "kWindow" not in strided and "no bias" in strided


def test_render_wgrad_partials_and_reduction():
    c = first(dw("wgrad", out_dtype="f32"), halo_smem=False)
    src = render(c, "nvcc")
    assert "depthwise_kernel<<<" in src and src.count("cudaGetLastError") == 1
    # the reduction is the partials kernel's programmatic dependent: every partials kernel lets it launch first thing,
    # it waits for the partials before touching memory, and cb_run launches it with programmatic stream serialization
    assert "cudaLaunchKernelEx(&cfg, reduce_kernel, p, splits)" in src
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in src
    assert src.count("griddepcontrol.launch_dependents") == 1 and src.count("allow_reduction_launch();") == 1
    body = src[src.index("reduce_kernel(Params p, int splits) {"):]
    assert body.index("griddepcontrol.wait") < body.index("p.partials[")
    assert "x.split_k_slices * int64_t(kTaps) * x.c * int64_t(sizeof(float))" in src
    # the CTA's threads are summed by shuffles and warp by warp (deterministic), not by shared-memory atomics
    assert "cta_sum(acc, total" in src and "__shfl_xor_sync" in src and "atomicAdd" not in src
    assert "using ElementOutput = float;" in src


# ---------------------------------------------------------------------------------------------- planner, model
def test_plan_and_default_launch_use_the_depthwise_family(monkeypatch):
    from cutlass_byoc.profiler import plan as plan_mod  # noqa: PLC0415

    for kind in ConvKind:
        p = dw(kind.value, n=32, c=144, hw=56)
        # the untuned default is always among the launches timed, on top of the budgets where they left it out
        full = plan_problem(p, max_candidates=4)
        assert default_depthwise_launch(p).name in {c.name for c in full.candidates}
        with monkeypatch.context() as m:  # the budgets alone
            m.setattr(plan_mod, "_depthwise_default", lambda *a: [])
            plan = plan_problem(p, max_candidates=4)
        assert len(full.candidates) - len(plan.candidates) in (0, 1)
        assert plan.candidates and all(c.launch.kernel.family is KernelFamily.DEPTHWISE_DIRECT for c in plan.candidates)
        # depthwise kernels time in microseconds; fprop and stride-1 dgrad add their pipelined and (other)
        # wide-strip kernels on budgets of their own
        # wgrad's cluster-split twins: a budget of their own (CLUSTER_SPLIT_BUDGET), whatever their schedule
        clustered = [k for k in plan.kernels if dwmod.is_cluster_split(k)]
        others = [k for k in plan.kernels if not dwmod.is_cluster_split(k)]
        assert len(clustered) == (CLUSTER_SPLIT_BUDGET if kind is ConvKind.WGRAD else 0)
        piped = [k for k in others if is_pipelined(k)]
        wide = [k for k in others if is_wide_strip(k) and not is_pipelined(k)]
        # the "cols" kernels: a budget of their own, each with its prefetch twin where it has one and (fprop, dgrad)
        # its register-capped twin (taps from shared memory)
        capped = [k for k in others if k.schedule == "cols" and k.min_blocks and kind is not ConvKind.WGRAD]
        cols = [k for k in others if k.schedule == "cols" and not k.prefetch and k not in capped]
        ahead = [k for k in others if k.prefetch]
        assert len(plan.kernels) == (4 * DEPTHWISE_BUDGET_FACTOR + len(wide) + len(piped) + len(cols) + len(ahead)
                                     + len(capped) + len(clustered))
        assert len(wide) == (0 if kind is ConvKind.WGRAD else WIDE_STRIP_BUDGET)
        assert len(piped) == PIPELINED_BUDGET
        assert len(cols) == COLS_BUDGET
        assert ahead and {dataclasses.replace(k, prefetch=None) for k in ahead} == \
            {k for k in cols if prefetch_variant(k) is not None}
        assert (kind is ConvKind.WGRAD) != bool(capped)
        assert {dataclasses.replace(k, min_blocks=None) for k in capped} <= set(cols)
        if cols:  # one per CTA shape first
            assert len({k.tile[:2] for k in cols}) >= 4, [k.name for k in cols]
        assert all(strip(k) >= WIDE_STRIP for k in wide) and all(k.stages == 2 and k.halo_smem for k in piped)
        assert len({(k.schedule, k.halo_smem) for k in plan.kernels}) >= 2  # schedules alternate
        if kind is ConvKind.WGRAD:
            assert len({c.launch.split_k_slices for c in plan.candidates}) > 1
        launch = default_launch(p)
        assert launch is not None and launch.kernel.family is KernelFamily.DEPTHWISE_DIRECT
        assert launch == default_depthwise_launch(p) and launch.reject_reason(p) is None
        assert has_kernels(p)
    dense = plan_problem(Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1), max_candidates=4)
    assert all(c.launch.kernel.family is not KernelFamily.DEPTHWISE_DIRECT for c in dense.candidates)


def test_unsupported_reasons():
    assert unsupported_reason(dw()) is None
    assert unsupported_reason(dw("wgrad", dtype="bf16", out_dtype="f32")) is None
    assert unsupported_reason(dw(dilation=2, pad=2)).startswith("depthwise: dilation")
    assert unsupported_reason(dw(r=11)).startswith("depthwise: filter")
    grouped = Conv2dProblem.make("fprop", 2, 16, 8, 8, 16, 3, groups=2)
    assert unsupported_reason(grouped).startswith("groups:")


# ---------------------------------------------------------------------------------------------- workloads
def test_depthwise_workload_is_named_and_out_of_the_default():
    items = depthwise_workload()
    assert len(items) == 3 * len(DEPTHWISE_LAYERS) == 3 * 19
    assert all(it.problem.is_depthwise and it.problem.n == 32 and not it.resnet50 for it in items)
    assert {(it.problem.r, it.problem.stride_h) for it in items} == {(3, 1), (3, 2), (5, 1), (5, 2)}
    assert len({it.problem for it in items}) == len(items)
    assert all(not it.problem.is_depthwise for it in default_workload())
    assert named_workload("depthwise", kinds=["fprop"]) == depthwise_workload(kinds=["fprop"])
    assert len(named_workload("all")) == len(default_workload()) + len(items)
    assert all(unsupported_reason(it.problem) is None for it in items)


def test_cli_accepts_the_named_workload():
    from cutlass_byoc.cli import _items_from_args, build_parser

    args = build_parser().parse_args(["tune", "depthwise", "--kinds", "wgrad"])
    items = _items_from_args(args)
    assert len(items) == 19 and all(it.kind is ConvKind.WGRAD for it in items)
    args = build_parser().parse_args(["bench", "depthwise", "--batch", "8"])
    assert all(it.problem.n == 8 for it in _items_from_args(args))


def test_bench_rows_are_flagged_depthwise():
    from cutlass_byoc.bench import BenchReport, BenchRow

    row = BenchRow(layer="mbv2_dw_96_s2_112", kind="fprop", problem=dw().name, resnet50=False, bound="memory",
                   launch="x", chosen_by="decision", ours_us=10.0, cudnn_us=12.0, ours_tflops=None,
                   cudnn_tflops=None, ours_gbs=2000.0, cudnn_gbs=1666.0, ratio=1.2, max_error=0.0, status="ok",
                   depthwise=True)
    d = json.loads(BenchReport((row,), "H200", "2", 9).to_json())
    assert d["rows"][0]["depthwise"] is True
    assert d["summary"]["geomean_depthwise_by_kind"]["fprop"] == pytest.approx(1.2)


def test_element_types_of_the_family():
    for dt, out in (("f16", "f16"), ("bf16", "bf16"), ("f16", "f32"), ("bf16", "f32"), ("f32", "f32")):
        for kind in ConvKind:
            p = dw(kind.value, dtype=dt, out_dtype=out)
            c = first(p)
            assert c.element_a is DType(dt) and c.element_out is DType(out) and c.element_acc is DType.F32


def test_staged_halos_are_padded_against_bank_conflicts():
    """A pad column per strip window step where a 16-byte load phase (8 threads) reads several pixels' strips an even
    number of columns apart (fewer than 8 channel vectors per pixel): fprop, stride-1 dgrad and wgrad halos, and the
    pipelined wgrad's dy tile; none for 8+ vectors, "rows", L1 reads or the strided dgrad; none where the padded
    buffers would not fit (the config keeps its layout)."""
    four = first(dw(), halo_smem=True, align_a=8, tile=(8, 16, 32), stages=1, min_blocks=None)  # strips of 4
    assert pad_groups(four) == (4, 0)
    src = render(four, "nvcc")
    assert "constexpr int kHaloStoreCols = kHaloCols + (kHaloCols - 1) / kHaloGroup;" in src
    assert "halo[kHaloRows][kHaloStoreCols][kLanes]" in src and "[seg * (kHaloGroup + 1) + i + i / kHaloGroup]" in src
    hh, ww = halo_shape(four)
    assert smem_bytes(four) == 9 * 32 * 4 + hh * (ww + (ww - 1) // 4) * 32 * 2
    strided = first(dw(stride=2), halo_smem=True, align_a=8, tile=(4, 16, 32), stages=1, min_blocks=None)
    assert pad_groups(strided) == (strip(strided) * 2, 0)
    eight = first(dw(), halo_smem=True, align_a=8, tile=(8, 16, 64), stages=1, min_blocks=None)
    assert pad_groups(eight) == (0, 0) and "kHaloStoreCols" not in render(eight, "nvcc")
    for c in depthwise_candidates(dw("dgrad", stride=2)):
        assert pad_groups(c) == (0, 0)
    for c in depthwise_candidates(dw("wgrad", r=5)):
        if c.halo_smem and lanes(c) < 8 and strip(c) % 2 == 0 and pad_groups(c) == (0, 0):
            # the unpadded layout is kept only where the padded one would not fit
            dy_group = strip(c) if is_pipelined_wgrad(c) else 0
            assert dwmod._smem_bytes(c, strip(c) * c.conv_stride[1], dy_group) > 48 * 1024


def test_depthwise_defaults_script_picks(tmp_path):
    """scripts/depthwise_defaults.py (the round's dw-defaults step) times, per problem, the untuned default first, the
    model's best launch of each schedule group, its three best "cols" ones and the bench report's winner, matched by
    name; --list prints their kernels without a GPU."""
    import importlib.util  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from cutlass_byoc.depthwise import schedule_group  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location(
        "depthwise_defaults", Path(__file__).parents[1] / "scripts" / "depthwise_defaults.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    item = next(it for it in depthwise_workload() if it.layer == "mbv2_dw_144_56" and it.kind is ConvKind.WGRAD)
    every = mod.launches(item.problem)
    winner = every[-1].name  # any enumerated launch
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({"rows": [{"layer": item.layer, "kind": "wgrad", "launch": winner}]}))
    picks = mod.chosen(item, 1, mod.load_winners(str(report)), cols=3)
    assert picks[0][1] and picks[0][0] == default_depthwise_launch(item.problem)  # the default first, flagged
    assert sum(w for _, _, w in picks) == 1 and any(l.name == winner and w for l, _, w in picks)
    groups = [schedule_group(l.kernel) for l, d, w in picks if not d and not w]
    assert groups.count("cols") <= 3 and all(groups.count(g) <= 1 for g in set(groups) - {"cols"})
    assert {"cols", "taprows", "rows", "cluster"} <= set(groups) | {schedule_group(picks[0][0].kernel)}
    assert mod.main(["--list", "--layers", item.layer]) == 0
    # --twins: a "cols" winner brings its kernel at one row ahead (no register cap) and that one's prefetch twins, at
    # the winner's split count; --per-group 0 --cols 0 leaves the default and those
    cols_winner = next(l for l in every if l.kernel.schedule == "cols" and l.kernel.prefetch == 2)
    report.write_text(json.dumps({"rows": [{"layer": item.layer, "kind": "wgrad", "launch": cols_winner.name}]}))
    picks = mod.chosen(item, 0, mod.load_winners(str(report)), cols=0, twins=True)
    base = dataclasses.replace(cols_winner.kernel, prefetch=None)
    want = {dataclasses.replace(cols_winner, kernel=k).name for k in (base, *dwmod.prefetch_variants(base))}
    assert want <= {l.name for l, _, _ in picks} and len(want) >= 2
    assert {l.name for l, _, _ in picks} <= want | {default_depthwise_launch(item.problem).name}
    assert all(l.split_k_slices == cols_winner.split_k_slices for l, d, _ in picks if not d)
