"""Cheap analytic model of a launch's time: ranks candidates before profiling and picks a default config when
nothing has been profiled. It is a model, not a measurement: the profiler has the last word."""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

from .candidates import rewrite_options, sm80_candidates
from .config import KernelConfig, LaunchConfig
from .problem import Conv2dProblem
from .types import ConvKind, DType, IteratorAlgorithm, KernelFamily, SourceKind, SplitKMode, StrideSupport

H200_SMS = 132
MMA_SYNC_TFLOPS = {DType.F16: 560.0, DType.BF16: 560.0, DType.F32: 280.0}  # mma.sync ceilings seen on H100-class
#: wgmma (the 3.x family): the fp16 matmul ceiling measured on the H200 (BRIEF.md: 708 TFLOP/s)
WGMMA_TFLOPS = {DType.F16: 700.0, DType.BF16: 700.0}
DRAM_GBS = 3800.0
LAUNCH_US = 3.0
#: The project's persistent ping-pong 3.x conv kernel (sm90.PINGPONG) against CUTLASS's one-tile-per-CTA kernel of the
#: same config: its math runs this much faster in the model. On the H200 (cold tune of 2026-12-01, 63 pairs of twins
#: timed on the default workload) the ping-pong twin was at least 0.97x as fast everywhere, 1.24x in the geometric
#: mean, 1.3-1.5x on the 3x3 layers of 64-128 channels. Not for the sub-pixel strided dgrad, where it ranged from 1.35x
#: (layer 2's 3x3, 56x56 dx) to 0.84x (layer 4's, 14x14 dx) on ResNet-50's six (scripts/workloads/strided-dgrad.json):
#: there the model leaves the two tied, and the tuner decides.
PINGPONG_SPEEDUP = 1.2
MAX_SLICES = 256  # one 64x64 output tile (early wgrad) needs ~2 waves of 132 SMs


def split_k_slice_candidates(problem: Conv2dProblem, tile: tuple[int, int, int], sms: int = H200_SMS) -> list[int]:
    """Slice counts worth trying: powers of two from 1 until the output tiles x slices fill the GPU about twice, each
    slice keeping at least 4 main-loop iterations of the tile's K."""
    m, n, k = problem.gemm_mnk
    if problem.is_strided_dgrad:
        return [1]
    if problem.epilogue.bias_vector:
        return [1]  # the bias-vector epilogue runs unsplit
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    k_iters = math.ceil(k / tile[2])
    out, s = [1], 2
    while s <= MAX_SLICES and k_iters // s >= 4 and tiles * s <= 4 * sms:
        out.append(s)
        s *= 2
    return out


def launch_slices(problem: Conv2dProblem, kernel: KernelConfig, sms: int = H200_SMS, *,
                  one_wave: bool = False) -> list[int]:
    """The split-k slice counts to try with `kernel` on `problem`: the 2.x kernels take every count
    `split_k_slice_candidates` offers; the sm90 split-k kernels (wgrad, split_k_mode PARALLEL: fp32 partials and a
    reduction, built by the project; ATOMIC: the sums added into one buffer) take those above 1 (with one slice the
    plain sm90 kernel does the same work without the partials; with `one_wave`, only those whose CTAs fit one wave:
    `one_wave_slices`); the GEMM family's stream-K kernels take every count too (1: stream-K's own decomposition);
    every other kernel runs unsplit."""
    if kernel.family is KernelFamily.SM80_IMPLICIT_GEMM:
        return split_k_slice_candidates(problem, kernel.tile, sms)
    if kernel.family is KernelFamily.SM90_TMA_WGMMA and kernel.split_k_mode.fp32_sums:
        counts = [s for s in split_k_slice_candidates(problem, kernel.tile, sms) if s > 1]
        return one_wave_slices(problem, kernel, counts, sms) if one_wave else counts
    if kernel.family is KernelFamily.DEPTHWISE_DIRECT:  # wgrad's splits of N*P*Q ([1] for fprop and dgrad)
        from .depthwise import split_candidates  # noqa: PLC0415

        return split_candidates(problem, kernel, sms)
    if kernel.splits_at_launch:  # the GEMM family's stream-K scheduler in its split-k decomposition
        return split_k_slice_candidates(problem, kernel.tile, sms)
    return [1]


def one_wave_slices(problem: Conv2dProblem, kernel: KernelConfig, counts: list[int], sms: int = H200_SMS) -> list[int]:
    """Of the slice counts `counts` of an sm90 split-k wgrad kernel, those whose CTAs (output tiles x slices) fit one
    wave of `sms` (these kernels run one CTA per SM); the smallest where none does. What the untuned default takes
    (`launch_slices(one_wave=True)`): on the H200 the fastest count was the largest one that fits one wave on all 14
    split problems of ResNet-50's b32 training tune (2026-12-03,
    benchmarks/h200/untuned/tune-model-r50-b32-training-call1.json; within 3% on the one-tile layer): a few tiles
    past one wave leave a second wave nearly empty and write more fp32 partials, where the model saw only less work
    per CTA (layer 2's 3x3 wgrad, 9 tiles of 128 x 128: 8 slices 25.9 us, 16 slices 29.8, 32 slices 32.0; the model
    had picked 32). Not measured on very long reductions (the stem's space-to-depth fold, whose tuned winner ran 32
    slices over 16 tiles), so the tuner's plans keep every count."""
    m, n, _ = _sm90_tiled_mnk(problem, kernel.tile)
    tiles = math.ceil(m / kernel.tile[0]) * math.ceil(n / kernel.tile[1])
    return [s for s in counts if tiles * s <= sms] or counts[:1]


#: The 3.x GEMM family (1x1 convs): what cuBLAS-class sm90 GEMMs reach on an H200 (issue 11: cuDNN's 1x1 convs
#: move 2.4-3.5 TB/s, dense fp16 wgmma runs ~600 TF/s in practice).
GEMM_TFLOPS = 600.0
GEMM_DRAM_GBS = 3000.0
#: The deterministic stream-K reduction adds a split tile's partials one peer after another (each waits for its
#: predecessor's flag): ~0.65 us a link on the H200 (l1_1x1_64_64 wgrad, one 128x64 tile: 96 us over 132 peers,
#: 43 us over 16 slices; benchmarks/h200/bench-splitk.json). The nondeterministic one adds them concurrently.
FIXUP_CHAIN_US = 0.65


def _gemm1x1_estimate_us(problem: Conv2dProblem, launch: LaunchConfig, sms: int) -> float:
    """A persistent sm90 GEMM: the busiest SM's main-loop iterations at the wgmma rate (data-parallel tiles come
    in waves; stream-K spreads the iterations evenly; split-k makes slices x tiles units), against the bytes the
    GEMM must move at DRAM speed (plus fp32 partials through the workspace when the reduction is split)."""
    c = launch.kernel
    slices = launch.split_k_slices
    from .gemm1x1 import (is_deterministic, lowered_extra_bytes, lowered_gemm_mnk,  # noqa: PLC0415 - the family's
                          scheduler_splits)  # rules live in its module

    m, n, k = lowered_gemm_mnk(problem) if c.lowering else problem.gemm_mnk
    tm, tn, tk = c.tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    k_iters = math.ceil(k / tk)
    extra_us = 0.0
    bytes_ = problem.bytes_moved + (lowered_extra_bytes(problem) if c.lowering else 0)

    deterministic = is_deterministic(c)
    if slices > 1:
        iters = math.ceil(tiles * slices / sms) * math.ceil(k_iters / slices)
        bytes_ += 2 * slices * m * n * 4
        extra_us += slices * FIXUP_CHAIN_US if deterministic else 1.0
    elif scheduler_splits(c) and tiles < sms:
        iters = math.ceil(tiles * k_iters / sms)  # stream-K: the reduction is shared out over idle SMs
        bytes_ += 2 * sms * tm * tn * 4  # partial tiles through the workspace
        extra_us += (sms / tiles) * FIXUP_CHAIN_US if deterministic else 1.0
    else:
        iters = math.ceil(tiles / sms) * k_iters
    intensity = (tm * tn) / (tm + tn) / (128 * 256 / 384)  # tile reuse relative to a 128x256 tile
    eff = min(1.0, 0.5 + 0.5 * intensity)
    compute_us = iters * 2 * tm * tn * tk / (GEMM_TFLOPS * 1e12 / sms * eff) * 1e6
    memory_us = bytes_ / (GEMM_DRAM_GBS * 1e9) * 1e6
    return max(compute_us, memory_us) + LAUNCH_US + extra_us


def _sm90_tiled_mnk(problem: Conv2dProblem, tile: tuple[int, int, int]) -> tuple[int, int, int]:
    """The GEMM extents a CUTLASS 3.x conv kernel computes: its tiles cover channels of one filter tap at a time
    (fprop's and dgrad's K tile, wgrad's N tile), so channels are rounded up to the tile per tap. On the H200 a
    64x256 wgrad tile over the stem fold's 16 channels x 16 taps ran 7x slower than a 64x16 one (2026-11-30)."""
    m, n, k = problem.gemm_mnk
    rs = problem.r * problem.s
    if problem.kind is ConvKind.WGRAD:  # N = C x taps
        return m, math.ceil(problem.c / tile[1]) * tile[1] * rs, k
    chans = problem.c if problem.kind is ConvKind.FPROP else problem.k  # K = channels x taps
    return m, n, math.ceil(chans / tile[2]) * tile[2] * rs


#: Measured over modelled time, by kernel family, schedule, pass (fprop and dgrad together, or wgrad) and whether the
#: launch splits the reduction: what the model's ceilings leave out (latency, prologue and epilogue, the 2.x kernels'
#: loads without TMA). Each is the geometric mean over its group of the tune of ResNet-50's training step at batch 32
#: on the H200 (2026-12-03: `cutlass-byoc tune --model torchvision:resnet50 --training --amp fp16
#: --max-candidates 2`, the 313 timed launches that rewrite nothing; groups of 2-57 launches, the ones under 5 pooled
#: where their neighbours agree; `scripts/default_regret.py --calibration` prints them from such a report). A factor
#: changes no order within its group; across families it is what the untuned default (`default_launch`) and a budget
#: smaller than the families (`plan._take_budget`) decide by. Without it the memory-bound 1x1 convs tied across
#: families, the 2.x kernel won the tie by its name and ran 1.3-3x slower than the 3.x kernels there (layer 3's 1x1
#: wgrads split on 2.x: 53-54 us, the tuned 3.x GEMM 18 us), and that step's untuned plan summed to 3.99 ms of passes
#: against 3.38 for cuDNN and 3.24 tuned (scripts/default_regret.py on the same report).
#: Keys: `calibration_key`; a group not listed counts 1.0 (the depthwise family, which competes with no other: its
#: schedules have factors of their own, `depthwise.DW_CALIBRATION`, which its untuned default ranks by).
CALIBRATION: dict[tuple[KernelFamily, str, str, bool], float] = {
    (KernelFamily.SM80_IMPLICIT_GEMM, "", "fd", False): 1.34,  # 30 launches
    (KernelFamily.SM80_IMPLICIT_GEMM, "", "fd", True): 1.58,  # 15
    (KernelFamily.SM80_IMPLICIT_GEMM, "", "wgrad", False): 2.01,  # pooled with the next: 3 + 54
    (KernelFamily.SM80_IMPLICIT_GEMM, "", "wgrad", True): 2.01,
    (KernelFamily.SM90_TMA_WGMMA, "implicit_tma_ws", "fd", False): 1.43,  # 44
    (KernelFamily.SM90_TMA_WGMMA, "implicit_tma_ws", "wgrad", False): 1.21,  # 6
    (KernelFamily.SM90_TMA_WGMMA, "implicit_tma_ws", "wgrad", True): 1.11,  # 42
    (KernelFamily.SM90_TMA_WGMMA, "pingpong", "fd", False): 1.23,  # 50
    (KernelFamily.SM90_TMA_WGMMA, "pingpong", "wgrad", False): 1.06,  # 19
    (KernelFamily.SM90_GEMM_1X1, "data-parallel", "fd", False): 1.23,  # 9: ping-pong 6, cooperative 3
    (KernelFamily.SM90_GEMM_1X1, "data-parallel", "wgrad", False): 1.11,  # 2
    (KernelFamily.SM90_GEMM_1X1, "stream-K", "fd", False): 1.28,  # pooled with the next: 2 + 4
    (KernelFamily.SM90_GEMM_1X1, "stream-K", "fd", True): 1.28,
    (KernelFamily.SM90_GEMM_1X1, "stream-K", "wgrad", False): 1.41,  # pooled with the next: 4 + 8
    (KernelFamily.SM90_GEMM_1X1, "stream-K", "wgrad", True): 1.41,
    (KernelFamily.SMEM_IM2COL, "", "fd", False): 1.28,  # 8
}


def calibration_key(problem: Conv2dProblem, launch: LaunchConfig) -> tuple[KernelFamily, str, str, bool]:
    """The CALIBRATION group of `launch` on `problem`: (family, schedule group, "wgrad" or "fd", split)."""
    c = launch.kernel
    schedule = c.schedule or ""
    if c.family is KernelFamily.SM90_GEMM_1X1:  # its tile schedulers, whatever the warp schedule
        schedule = "stream-K" if c.splits_at_launch else "data-parallel"
    kind = "wgrad" if problem.kind is ConvKind.WGRAD else "fd"
    return c.family, schedule, kind, launch.split_k_slices > 1


def calibration(problem: Conv2dProblem, launch: LaunchConfig) -> float:
    """CALIBRATION's factor for `launch` on `problem` (1.0 for a group it does not list)."""
    return CALIBRATION.get(calibration_key(problem, launch), 1.0)


def estimate_us(problem: Conv2dProblem, launch: LaunchConfig, sms: int = H200_SMS) -> float:
    """Estimated microseconds of one launch (wave quantisation, tile efficiency, memory traffic, split-k overhead),
    calibrated by family (CALIBRATION)."""
    return _model_us(problem, launch, sms) * calibration(problem, launch)


def _model_us(problem: Conv2dProblem, launch: LaunchConfig, sms: int) -> float:
    """estimate_us before the family's calibration."""
    c = launch.kernel
    if c.family is KernelFamily.DEPTHWISE_DIRECT:
        from .depthwise import estimate_us as depthwise_estimate_us  # noqa: PLC0415

        return depthwise_estimate_us(problem, launch, sms)
    if c.family is KernelFamily.SM90_GEMM_1X1:
        return _gemm1x1_estimate_us(problem, launch, sms)
    if c.family is KernelFamily.SMEM_IM2COL:
        from .smem_im2col import estimate_us as smem_im2col_estimate_us  # noqa: PLC0415

        return smem_im2col_estimate_us(problem, launch, sms)
    if c.is_subpixel_dgrad:
        return _sm90_subpixel_estimate_us(problem, launch, sms)
    m, n, k = problem.gemm_mnk
    if c.family is KernelFamily.SM90_TMA_WGMMA:
        m, n, k = _sm90_tiled_mnk(problem, c.tile)
    return _implicit_gemm_us(problem, launch, m, n, k, problem.bytes_moved, sms)


def _sm90_subpixel_estimate_us(problem: Conv2dProblem, launch: LaunchConfig, sms: int) -> float:
    """The sub-pixel strided dgrad (sm90.subpixel_phases): one stride-1 launch per phase, each over the phase's dx
    pixels (M) and only the filter taps that reach them (K = channels x taps), reading dy again (from L2 mostly) and
    writing its share of dx; a memset of dx first where a phase no tap reaches exists."""
    from .sm90 import live_phases  # noqa: PLC0415

    p = problem
    chans = math.ceil(p.k / launch.kernel.tile[2]) * launch.kernel.tile[2]
    total = 0.0
    dy_bytes = p.n * p.p * p.q * p.k * p.element_a.nbytes
    live, empty = live_phases(p)
    for ra, ca in live:
        m = p.n * ra.extent * ca.extent
        out_bytes = m * p.c * p.element_out.nbytes * (2 if p.epilogue.source.has_residual else 1)
        w_bytes = p.k * ra.taps * ca.taps * p.c * p.element_b.nbytes
        total += _implicit_gemm_us(p, launch, m, p.c, chans * ra.taps * ca.taps, dy_bytes + w_bytes + out_bytes, sms)
    if empty:
        total += p.n * p.h * p.w * p.c * p.element_out.nbytes / (DRAM_GBS * 1e9) * 1e6 + LAUNCH_US
    return total


def _implicit_gemm_us(problem: Conv2dProblem, launch: LaunchConfig, m: int, n: int, k: int, bytes_: int,
                      sms: int) -> float:
    """One implicit-GEMM launch of M x N x K moving `bytes_`: wave quantisation, tile efficiency, memory traffic,
    split-k overhead."""
    c = launch.kernel
    slices = launch.split_k_slices
    tm, tn, tk = c.tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * slices
    occupancy = max(1, min(3, (200 * 1024) // max(1, c.smem_bytes), 2048 // c.threads))
    waves = math.ceil(tiles / (sms * occupancy))
    k_slice = math.ceil(math.ceil(k / slices) / tk) * tk
    intensity = (tm * tn) / (tm + tn) / (128 * 256 / 384)  # tile reuse relative to a 128x256 tile
    eff = min(1.0, 0.35 + 0.65 * intensity)
    if c.iterator is IteratorAlgorithm.ANALYTIC:
        eff *= 0.85
    if c.stages == 2:
        eff *= 0.7
    align = min(c.align_a, c.align_b)
    # accesses under 16 bytes: linear in the access width (the square root of it had the stem's align-1 2.x kernels at
    # 84-104 us, measured 487-1093, and the odd 7->33 fprop's at ~30, measured 66-151: H200, 2026-12-01)
    eff *= min(1.0, align * c.element_a.nbytes / 16)
    rates = WGMMA_TFLOPS if c.family is KernelFamily.SM90_TMA_WGMMA else MMA_SYNC_TFLOPS
    per_sm = rates[c.element_a] * 1e12 / sms
    compute_us = waves * occupancy * 2 * tm * tn * k_slice / (per_sm * eff) * 1e6
    if c.is_conv_pingpong and c.stride_support is StrideSupport.UNITY:
        compute_us /= PINGPONG_SPEEDUP
    extra_us = 0.0
    if c.split_k_mode is SplitKMode.PARALLEL:  # fp32 partials out and back in, plus the reduction's launch
        bytes_ += 2 * slices * m * n * 4
        extra_us += LAUNCH_US
    elif c.split_k_mode is SplitKMode.ATOMIC:  # each slice's reduce-adds, and the zeroing of the sums first
        bytes_ += (slices + 1) * m * n * 4
        extra_us += LAUNCH_US
    elif slices > 1:
        extra_us += 0.3 * slices  # serialised epilogues through the semaphore
    memory_us = bytes_ / (DRAM_GBS * 1e9) * 1e6
    return max(compute_us, memory_us) + LAUNCH_US + extra_us


def padding_cost_us(problem: Conv2dProblem, launch: LaunchConfig) -> float:
    """What ops' channel padding around the kernel costs: each padded input is zero-filled and the real channels
    copied in (the padded tensor written twice, the original read once), a padded output is sliced back (the
    real part read and written once; the kernel's own padded store is in its estimate), one launch each."""
    if not launch.padded:
        return 0.0
    big = launch.kernel_problem(problem)
    moved, ops = 0, 0
    operands = [(problem.a_shape, big.a_shape, problem.element_a), (problem.b_shape, big.b_shape, problem.element_b)]
    if problem.epilogue.source is SourceKind.RESIDUAL:
        operands.append((problem.out_shape, big.out_shape, problem.element_out))
    elif problem.epilogue.source is SourceKind.BIAS and big.k != problem.k:
        operands.append(((problem.k,), (big.k,), problem.element_out))
    for small, large, dt in operands:
        if small != large:
            moved += (2 * math.prod(large) + math.prod(small)) * dt.nbytes
            ops += 2
    if problem.out_shape != big.out_shape:
        moved += 2 * math.prod(problem.out_shape) * problem.element_out.nbytes
        ops += 1
    return moved / (DRAM_GBS * 1e9) * 1e6 + ops * LAUNCH_US


#: Measured over modelled time of the space-to-depth fold's launches (`LaunchConfig.s2d`), on top of their family's
#: CALIBRATION: the model underrates the folded stem's kernels (49 channels of 16 for a 7x7 stride-2 filter on 4x4
#: phases, narrow N tiles). Geometric mean of the 87 fold launches the H100 tunes of 2026-12-06 timed (the stem's fprop
#: and fp32 wgrad at batch 32 and 64, its fprop, dgrad and wgrad in the default workload; 0.7-2.7x; fprop 2.0-2.3,
#: wgrad 1.5-1.7). Without it the untuned default ran the stem's wgrad on the fold (116 / 232 us at batch 32 / 64)
#: over the shared-memory im2col kernel (82 / 139), and at batch 64 its fprop on the fold (260 us) over that
#: family's (117).
S2D_CALIBRATION = 1.7


def estimate_launch_us(problem: Conv2dProblem, launch: LaunchConfig, sms: int = H200_SMS) -> float:
    """`estimate_us` of the kernel on the problem it computes, plus the padding around it (`rewritten_us`)."""
    if not launch.padded:
        return estimate_us(problem, launch, sms)
    return rewritten_us(problem, launch, estimate_us(launch.kernel_problem(problem), launch.unpadded, sms))


def rewritten_us(problem: Conv2dProblem, launch: LaunchConfig, kernel_us: float) -> float:
    """A padded or folded `launch`'s time from its kernel's estimate on the rewritten problem (`kernel_us`): a fold's
    scaled by S2D_CALIBRATION, plus the padding's copies."""
    return kernel_us * (S2D_CALIBRATION if launch.s2d > 1 else 1.0) + padding_cost_us(problem, launch)


def tile_waste(tile: tuple[int, int, int], m: int, n: int) -> float:
    """Output area the tiles cover over the GEMM's (1.0: no padding; a 128-wide tile on N=64 wastes half)."""
    return math.ceil(m / tile[0]) * tile[0] * math.ceil(n / tile[1]) * tile[1] / (m * n)


def order_key(problem: Conv2dProblem, estimate: float, kernel: KernelConfig, name: str = "") -> tuple:
    """The model's order: estimate first; near-ties (memory-bound layers, where every tile moves the same bytes)
    go to the tile that wastes least of its area on padding, then to the precomputed-offset iterators (faster than
    analytic ones at equal tiles on the H200), then by name for a stable order."""
    m, n, _ = problem.gemm_mnk
    return (round(estimate, 1), tile_waste(kernel.tile, m, n), kernel.iterator is IteratorAlgorithm.ANALYTIC, name)


def rank(problem: Conv2dProblem, kernels: Iterable[KernelConfig], sms: int = H200_SMS, *,
         one_wave: bool = False) -> list[tuple[float, LaunchConfig]]:
    """Every (kernel, slice count) the problem admits (`launch_slices`), best estimate first."""
    ranked = []
    for kc in kernels:
        for s in launch_slices(problem, kc, sms, one_wave=one_wave):
            launch = LaunchConfig(kc, s)
            if launch.reject_reason(problem) is None:
                ranked.append((estimate_us(problem, launch, sms), launch))
    ranked.sort(key=lambda t: order_key(problem, t[0], t[1].kernel, t[1].name))
    return ranked


def default_launch(problem: Conv2dProblem, sms: int = H200_SMS, *, sm90: bool = True,
                   padding: bool = True) -> Optional[LaunchConfig]:
    """The model's best launch for `problem` over the 2.x and (where they apply, unless `sm90` is False) 3.x
    families, or None if no kernel can take it. Untuned layers 3-4 ran 2-3x slower on the 2.x-only default than on
    the tuned 3.x winner (H200); early wgrad layers, which need split-k, stay on 2.x through the model's estimate.
    Channel-padded and space-to-depth launches (`candidates.channel_pad_options`, `candidates.s2d_options`; not with
    ``padding=False``) compete with their rewrites' cost; a problem whose channels no kernel takes unpadded (a
    strided dgrad of C=3) runs padded or folded. (On the H200 the model's fold picks for the stem ran 136, 156 and
    145 us in fprop, dgrad and wgrad against 230, 565 and 329 us for its channel-padded picks, the previous
    defaults: 2026-11-30, scripts/time_launches.py.)
    The shared-memory im2col kernels (fprop, dgrad and wgrad of few input channels) compete unpadded: on the H200
    the model's pick for the stem's fprop, 16x16x64 with 8x1 warps, ran 64 us against 136 us for the 2.x fold
    (2026-12-01); on the H100 its pick for the stem's fp32 wgrad, 16x16x64 with 1x4x1 warps, ran 82 / 139 us at
    batch 32 / 64 against 116 / 232 us for the 3.x fold's best launch (2026-12-06). So do the 3.x GEMM
    kernels of 1x1 stride-1 convs (`gemm1x1`), the tuned winners of most of ResNet-50's 1x1 cells. The families
    compete on calibrated estimates (CALIBRATION).
    Depthwise problems (groups == C == K) get the best launch of the depthwise family, the only one that takes them."""
    if problem.is_depthwise:
        from .depthwise import default_depthwise_launch  # noqa: PLC0415

        return default_depthwise_launch(problem, sms)
    best: Optional[tuple[float, LaunchConfig]] = None
    for blk, pad_c, pad_k, kp, why in (rewrite_options(problem) if padding else [(1, 1, 1, problem, None)]):
        if why:
            continue
        kernels = list(sm80_candidates(kp))
        if sm90:
            from .sm90 import sm90_candidates  # noqa: PLC0415 - sm90 imports the config layer only

            kernels += list(sm90_candidates(kp))
            if (blk, pad_c, pad_k) == (1, 1, 1):  # 1x1 stride-1 convs as 3.x GEMMs (none for other problems)
                from .gemm1x1 import gemm1x1_candidates  # noqa: PLC0415

                # data-parallel tiles only: a stream-K decomposition is the tuner's to choose (the model cannot rank
                # it, plan.launches_for), and its faster reduction order is nondeterministic
                kernels += [kc for kc in gemm1x1_candidates(kp) if not kc.splits_at_launch]
        if (blk, pad_c, pad_k) == (1, 1, 1):  # few input channels, read as they are
            from .smem_im2col import smem_im2col_candidates  # noqa: PLC0415

            kernels += list(smem_im2col_candidates(kp))
        # the sm90 split-k wgrads of the conv as it is: slice counts within one wave (`one_wave_slices`)
        ranked = rank(kp, kernels, sms, one_wave=(blk, pad_c, pad_k) == (1, 1, 1))
        if not ranked:
            continue
        launch = dataclasses.replace(ranked[0][1], pad_c=pad_c, pad_k=pad_k, s2d=blk)
        if launch.reject_reason(problem) is not None:
            continue
        us = estimate_launch_us(problem, launch, sms)
        if best is None or us < best[0]:
            best = (us, launch)
    return atomic_default(problem, best[1]) if best else None


def atomic_default(problem: Conv2dProblem, launch: LaunchConfig) -> LaunchConfig:
    """`launch`, or for a 3.x split-k wgrad that stores fp32 without a source (a training step's wgrad with the fp32
    cast fused), on the problem as it is, its atomic twin (sm90.atomic_twin: the slices' sums added by TMA
    reduce-adds straight into the zeroed output, no partials and no reduction kernel): same tile and slices. In the
    ResNet-50 training step's tunes on the H100 (2026-12-05, b32 and b64, each pair timed by the tuner) the twin was
    the faster of the two in 344 of 359 such pairs, by 1.11x (median; 1.02-1.5x); with a 16-bit output (adds into
    a workspace the reduction still reads) it won none of the default workload's 16 wgrads, and channel-padded or
    folded launches gained nothing (0.84-1.0x). Never under deterministic algorithms, where the order of those adds
    must not vary."""
    if (problem.kind is not ConvKind.WGRAD or launch.split_k_slices < 2 or launch.padded
            or problem.element_out is not DType.F32 or problem.epilogue.source is not SourceKind.NONE):
        return launch
    from .gemm1x1 import deterministic_required  # noqa: PLC0415
    from .sm90 import atomic_twin  # noqa: PLC0415

    twin = atomic_twin(launch.kernel)  # None unless a 3.x split-k kernel
    if twin is None or deterministic_required():
        return launch
    atomic = dataclasses.replace(launch, kernel=twin)
    return atomic if atomic.reject_reason(problem) is None else launch
