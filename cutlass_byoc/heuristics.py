"""Cheap analytic model of a launch's time: ranks candidates before profiling and picks a default config when
nothing has been profiled. It is a model, not a measurement: the profiler has the last word."""

from __future__ import annotations

import math
from typing import Iterable, Optional

from .candidates import sm80_candidates
from .config import KernelConfig, LaunchConfig
from .problem import Conv2dProblem
from .types import ConvKind, DType, IteratorAlgorithm, KernelFamily, SplitKMode

H200_SMS = 132
MMA_SYNC_TFLOPS = {DType.F16: 560.0, DType.BF16: 560.0, DType.F32: 280.0}  # mma.sync ceilings seen on H100-class
DRAM_GBS = 3800.0
LAUNCH_US = 3.0
MAX_SLICES = 256  # one 64x64 output tile (early wgrad) needs ~2 waves of 132 SMs


def split_k_slice_candidates(problem: Conv2dProblem, tile: tuple[int, int, int], sms: int = H200_SMS) -> list[int]:
    """Slice counts worth trying: powers of two from 1 until the output tiles x slices fill the GPU about twice, each
    slice keeping at least 4 main-loop iterations of the tile's K."""
    m, n, k = problem.gemm_mnk
    if problem.kind is ConvKind.DGRAD and (problem.stride_h > 1 or problem.stride_w > 1):
        return [1]
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    k_iters = math.ceil(k / tile[2])
    out, s = [1], 2
    while s <= MAX_SLICES and k_iters // s >= 4 and tiles * s <= 4 * sms:
        out.append(s)
        s *= 2
    return out


#: The 3.x GEMM family (1x1 convs): what cuBLAS-class sm90 GEMMs reach on an H200 (issue 11: cuDNN's 1x1 convs
#: move 2.4-3.5 TB/s, dense fp16 wgmma runs ~600 TF/s in practice).
GEMM_TFLOPS = 600.0
GEMM_DRAM_GBS = 3000.0


def _gemm1x1_estimate_us(problem: Conv2dProblem, launch: LaunchConfig, sms: int) -> float:
    """A persistent sm90 GEMM: the busiest SM's main-loop iterations at the wgmma rate (data-parallel tiles come
    in waves; stream-K spreads the iterations evenly; split-k makes slices x tiles units), against the bytes the
    GEMM must move at DRAM speed (plus fp32 partials through the workspace when the reduction is split)."""
    c = launch.kernel
    slices = launch.split_k_slices
    m, n, k = problem.gemm_mnk
    tm, tn, tk = c.tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    k_iters = math.ceil(k / tk)
    extra_us = 0.0
    bytes_ = problem.bytes_moved
    if slices > 1:
        iters = math.ceil(tiles * slices / sms) * math.ceil(k_iters / slices)
        bytes_ += 2 * slices * m * n * 4
    elif c.schedule == "cooperative_streamk" and tiles < sms:
        iters = math.ceil(tiles * k_iters / sms)  # stream-K: the reduction is shared out over idle SMs
        bytes_ += 2 * sms * tm * tn * 4  # partial tiles through the workspace
        extra_us += 1.0
    else:
        iters = math.ceil(tiles / sms) * k_iters
    intensity = (tm * tn) / (tm + tn) / (128 * 256 / 384)  # tile reuse relative to a 128x256 tile
    eff = min(1.0, 0.5 + 0.5 * intensity)
    compute_us = iters * 2 * tm * tn * tk / (GEMM_TFLOPS * 1e12 / sms * eff) * 1e6
    memory_us = bytes_ / (GEMM_DRAM_GBS * 1e9) * 1e6
    return max(compute_us, memory_us) + LAUNCH_US + extra_us


def estimate_us(problem: Conv2dProblem, launch: LaunchConfig, sms: int = H200_SMS) -> float:
    """Estimated microseconds of one launch (wave quantisation, tile efficiency, memory traffic, split-k overhead)."""
    c = launch.kernel
    if c.family is KernelFamily.SM90_GEMM_1X1:
        return _gemm1x1_estimate_us(problem, launch, sms)
    slices = launch.split_k_slices
    m, n, k = problem.gemm_mnk
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
    eff *= min(1.0, (align * c.element_a.nbytes / 16) ** 0.5)
    per_sm = MMA_SYNC_TFLOPS[c.element_a] * 1e12 / sms
    compute_us = waves * occupancy * 2 * tm * tn * k_slice / (per_sm * eff) * 1e6
    bytes_ = problem.bytes_moved
    extra_us = 0.0
    if c.split_k_mode is SplitKMode.PARALLEL:  # fp32 partials out and back in, plus the reduction's launch
        bytes_ += 2 * slices * m * n * 4
        extra_us += LAUNCH_US
    elif slices > 1:
        extra_us += 0.3 * slices  # serialised epilogues through the semaphore
    memory_us = bytes_ / (DRAM_GBS * 1e9) * 1e6
    return max(compute_us, memory_us) + LAUNCH_US + extra_us


def tile_waste(tile: tuple[int, int, int], m: int, n: int) -> float:
    """Output area the tiles cover over the GEMM's (1.0: no padding; a 128-wide tile on N=64 wastes half)."""
    return math.ceil(m / tile[0]) * tile[0] * math.ceil(n / tile[1]) * tile[1] / (m * n)


def order_key(problem: Conv2dProblem, estimate: float, kernel: KernelConfig, name: str = "") -> tuple:
    """The model's order: estimate first; near-ties (memory-bound layers, where every tile moves the same bytes)
    go to the tile that wastes least of its area on padding, then to the precomputed-offset iterators (faster than
    analytic ones at equal tiles on the H200), then by name for a stable order."""
    m, n, _ = problem.gemm_mnk
    return (round(estimate, 1), tile_waste(kernel.tile, m, n), kernel.iterator is IteratorAlgorithm.ANALYTIC, name)


def rank(problem: Conv2dProblem, kernels: Iterable[KernelConfig], sms: int = H200_SMS) -> list[tuple[float, LaunchConfig]]:
    """Every (kernel, slice count) the problem admits, best estimate first."""
    ranked = []
    for kc in kernels:
        slices = split_k_slice_candidates(problem, kc.tile, sms) if kc.splits_at_launch else [1]
        for s in slices:
            launch = LaunchConfig(kc, s)
            if launch.reject_reason(problem) is None:
                ranked.append((estimate_us(problem, launch, sms), launch))
    ranked.sort(key=lambda t: order_key(problem, t[0], t[1].kernel, t[1].name))
    return ranked


def default_launch(problem: Conv2dProblem, sms: int = H200_SMS) -> Optional[LaunchConfig]:
    """The model's best 2.x launch for `problem`, or None if no kernel can take it."""
    ranked = rank(problem, sm80_candidates(problem), sms)
    return ranked[0][1] if ranked else None
