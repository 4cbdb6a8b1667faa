"""Candidate configs of the CUTLASS 3.x Hopper family (TMA im2col loads + wgmma, warp-specialized).

What CUTLASS 4.2 offers for sm90 conv (BRIEF.md, read in the wheel's headers): one kernel schedule,
``KernelImplicitTmaWarpSpecializedSm90`` (one producer warp group issuing TMA, one consumer warp group issuing
wgmma; the Cooperative and Pingpong schedules hit a ``static_assert`` for conv), no split-k, operands that TMA can
load (16-byte aligned channel extents, so C and K multiples of 8 for 16-bit types), groups == 1, padding <= 256, and
no strided dgrad (the collective ignores the stride). Split-k is the project's own, for wgrad only (`split_k_mode`
PARALLEL: one launch whose grid z slices the N*P*Q reduction's k tiles into fp32 partials, then a reduction kernel of
the template's own; see templates/conv2d_sm90_tma_wgmma.cu.j2), and so is the persistent ping-pong kernel (schedule
PINGPONG below: CUTLASS's GEMM ping-pong kernel body on these conv collectives). This module only proposes configs;
the rules are in ``KernelConfig.static_error`` / ``reject_reason`` and in the compiled kernel's ``cb_can_implement``.

Tile shapes come from ``cutlass_library.generator.GenerateSM90_Conv3x`` (the tiles CUTLASS generates and tests for
sm90 conv with 16-bit inputs), restricted to:

* tile K = 64 for 16-bit inputs (4 wgmma k-steps of 16; the generator also lists K = 32, which only halves the bytes
  per TMA transaction), and
* tiles whose fp32 accumulator fits one consumer warp group: M x N <= 128 x 128, i.e. at most 128 accumulator
  registers per thread. The generator's 128x256 and 256x128 tiles are meant for two consumer warp groups
  (Cooperative), which conv cannot use; with one warp group they spill.

plus 128x64 (hardware-legal, not in the generator's list because CUTLASS prefers 64x128 for GEMM; convs with
K < 128 output channels want it). Cluster shapes are 1x1x1 and 2x1x1 (2x1x1 multicasts B across the pair).
The generator also cannot describe fp16-in / fp32-accumulate / fp16-out sm90 convs (its accumulator follows the
output type, BRIEF.md), so the element types are always the problem's own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator, Optional

from .config import DEEP_MAX_STAGES, MAX_STAGES, KernelConfig, Shape3
from .generators import Collector, generator_module
from .problem import Conv2dProblem
from .types import ConvKind, DType, KernelFamily, SourceKind, SplitKMode, StrideSupport

#: The only CUTLASS 3.x conv schedule on sm90 (cutlass::conv::KernelImplicitTmaWarpSpecializedSm90): one CTA per
#: output tile, its pipeline fill and epilogue exposed.
SCHEDULE = "implicit_tma_ws"

#: The project's persistent ping-pong kernel on the same collectives (templates/conv2d_sm90_tma_wgmma.cu.j2,
#: cb_pingpong): one CTA per SM walking the tiles, two consumer warp groups taking turns, so one's epilogue and the
#: next tile's loads overlap the other's wgmma. No split-k; the sub-pixel strided dgrad's phases (up to 4 per launch)
#: as one list of tiles, with clusters of one CTA; tiles up to 128x128 (each group holds a whole tile's accumulators).
PINGPONG = "pingpong"
SCHEDULES = (SCHEDULE, PINGPONG)

#: Copies of the 2 x K sums a channel-statistics kernel (KernelConfig.channel_stats) adds into, in its workspace: the
#: warps of the CTAs in flight spread their atomic adds over these (by CTA and warp) instead of all adding into the
#: same 2 x K floats, and a small kernel sums them into the caller's buffer after the conv.
CHANNEL_STATS_SLOTS = 32

#: One consumer warp group (4 warps) computes the whole CTA tile in this schedule; recorded in KernelConfig.warps.
WARPS: Shape3 = (4, 1, 1)

CLUSTERS: tuple[Shape3, ...] = ((1, 1, 1), (2, 1, 1))

#: cutlass::gemm::collective::detail::sm90_smem_capacity_bytes
SMEM_CAPACITY = 232448

#: Tiles added to the generator's list (see the module docstring).
EXTRA_TILES: tuple[Shape3, ...] = ((128, 64, 64),)

MAX_ACCUMULATOR_ELEMENTS = 128 * 128


@functools.lru_cache(maxsize=None)
def generator_tiles() -> tuple[Shape3, ...]:
    """Distinct CTA tiles that cutlass_library generates for 2-D sm90 conv with 16-bit inputs."""
    generator = generator_module()
    collector = Collector()
    generator.GenerateSM90_Conv3x(collector, "13.0")
    tiles = set()
    for op in collector.operations:
        td = op.tile_description
        if td.math_instruction.element_a.name not in ("f16", "bf16"):
            continue
        tiles.add(tuple(int(t) for t in td.tile_shape))
    return tuple(sorted(tiles))


@functools.lru_cache(maxsize=None)
def sm90_tiles() -> tuple[Shape3, ...]:
    """The tiles proposed for 16-bit inputs: the generator's, filtered as the module docstring says, plus extras."""
    try:
        gen = generator_tiles()
    except Exception:  # pragma: no cover - a cutlass_library without GenerateSM90_Conv3x
        gen = ((64, 64, 64), (64, 128, 64), (128, 128, 64))
    keep = [t for t in gen if t[2] == 64 and t[0] * t[1] <= MAX_ACCUMULATOR_ELEMENTS]
    return tuple(sorted(set(keep) | set(EXTRA_TILES)))


#: Tiles for channel extents narrower than the usual tiles (C <= NARROW_C: the stem's space-to-depth fold, C=16):
#: the conv kernels tile C itself (fprop's K tile and dgrad's and wgrad's N tile cover channels of one filter tap),
#: so a 64-wide tile over 16 channels computes 4x the work on zeros. fprop gets K tiles of 32 (the narrowest the
#: 16-bit wgmma takes, 64 bytes), dgrad and wgrad N tiles of 16 and 32.
NARROW_C = 32
NARROW_TILES: dict[ConvKind, tuple[Shape3, ...]] = {
    ConvKind.FPROP: ((128, 64, 32), (256, 64, 32)),
    ConvKind.DGRAD: ((128, 16, 64), (256, 16, 64), (128, 32, 64)),
    ConvKind.WGRAD: ((64, 16, 64), (64, 32, 64), (128, 16, 64)),
}


def problem_tiles(problem: Conv2dProblem) -> tuple[Shape3, ...]:
    """The tiles proposed for `problem`: sm90_tiles(), and for input channels up to NARROW_C the narrow ones."""
    if problem.c <= NARROW_C:
        return sm90_tiles() + NARROW_TILES[problem.kind]
    return sm90_tiles()


def epilogue_smem_bytes(tile: Shape3, element_out: DType) -> int:
    """An upper bound on the TMA epilogue's shared memory: an epilogue tile of 64 x 32, up to 4 stages of C and 2 of D
    (sm90_get_tma_dispatch_policy), plus barriers."""
    epi = min(64, tile[0]) * min(32, tile[1])
    return (4 + 2) * epi * element_out.nbytes + 1024


def stage_count(tile: Shape3, element_a: DType, element_b: DType, element_out: DType, cap: int = MAX_STAGES) -> int:
    """What StageCountAutoCarveout would choose, with the epilogue bound above carved out, at most `cap`."""
    m, n, k = tile
    per_stage = m * k * element_a.nbytes + n * k * element_b.nbytes + 16  # + the stage's pipeline barriers
    return max(2, min(cap, (SMEM_CAPACITY - epilogue_smem_bytes(tile, element_out)) // per_stage))


def deep_twin(kernel: KernelConfig) -> Optional[KernelConfig]:
    """`kernel` with as many pipeline stages as its shared memory holds, past MAX_STAGES (None where the cap does not
    bind: tiles of 64 x 64 and narrower). On the H200 (2026-12-04, scripts/sweep_kernels.py --deep,
    benchmarks/h200/sweep-deep-session22.json) the 64 x 64 split-k wgrad kernel ran 3-11% faster with 11 stages than
    with 8 on the ResNet-50 1x1 and 3x3 wgrad cells and 1-5% slower on a few, so the planner times a wgrad kernel's
    deep twin beside it (profiler.plan) instead of changing the family's stage count."""
    return kernel.with_more_stages(stage_count(kernel.tile, kernel.element_a, kernel.element_b,
                                               kernel.element_kernel_out, cap=DEEP_MAX_STAGES))


def atomic_twin(kernel: KernelConfig) -> Optional[KernelConfig]:
    """The split-k wgrad kernel `kernel` (split_k_mode PARALLEL) with its slices' sums added into one zeroed fp32
    buffer by TMA reduce-add stores (split_k_mode ATOMIC): the output itself where it is fp32 and the launch has no
    source (a training step's wgrad with the fp32 cast fused), else a one-slice workspace that the reduction kernel
    then reads once. Same tile, stages and slices: it drops the partials' second pass (each slice's K*R*S*C floats
    read back) and, for a direct fp32 output, the reduction's launch, for a zeroing of the output and adds in L2 whose
    order varies from run to run. None for any other kernel. The planner times it beside its twin (profiler.plan),
    never under torch.use_deterministic_algorithms(True), where a decision holding it runs its twin
    (select.honour_determinism)."""
    if kernel.family is not KernelFamily.SM90_TMA_WGMMA or kernel.split_k_mode is not SplitKMode.PARALLEL:
        return None
    try:
        return dataclasses.replace(kernel, split_k_mode=SplitKMode.ATOMIC)
    except ValueError:  # static_error: no such kernel
        return None


def deterministic_twin(kernel: KernelConfig) -> KernelConfig:
    """`kernel` itself, or for an atomic split-k kernel its deterministic twin (the same kernel with fp32 partials
    per slice, summed in slice order by the reduction kernel)."""
    if kernel.family is KernelFamily.SM90_TMA_WGMMA and kernel.split_k_mode is SplitKMode.ATOMIC:
        return dataclasses.replace(kernel, split_k_mode=SplitKMode.PARALLEL)
    return kernel


def sm90_config(problem: Conv2dProblem, tile: Shape3, cluster: Shape3 = (1, 1, 1),
                split_k_mode: SplitKMode = SplitKMode.SERIAL, schedule: str = SCHEDULE) -> KernelConfig:
    """The sm90 config of `problem` with this tile and cluster (16-byte alignments; raises ValueError if invalid).
    `split_k_mode` PARALLEL (wgrad only) gives the split-k kernel, whose CUTLASS epilogue stores fp32 partials;
    ATOMIC its twin that adds them into one fp32 buffer instead (`atomic_twin`).
    A strided dgrad gets the sub-pixel config (stride_support STRIDED: the same kernel, launched once per phase).
    `schedule` PINGPONG gives the project's persistent ping-pong kernel on the same collectives."""
    p = problem
    kernel_out = p.element_acc if split_k_mode.fp32_sums else p.element_out
    return KernelConfig(
        family=KernelFamily.SM90_TMA_WGMMA, kind=p.kind,
        element_a=p.element_a, element_b=p.element_b, element_out=p.element_out, element_acc=p.element_acc,
        tile=tile, warps=WARPS, stages=stage_count(tile, p.element_a, p.element_b, kernel_out),
        stride_support=StrideSupport.STRIDED if p.is_strided_dgrad else StrideSupport.UNITY,
        align_a=16 // p.element_a.nbytes, align_b=16 // p.element_b.nbytes, align_c=16 // kernel_out.nbytes,
        split_k_mode=split_k_mode, activation=p.epilogue.activation,
        cluster=cluster, schedule=schedule, element_bias=p.element_bias if p.epilogue.bias_vector else None,
    )


#: Which output types the planner and the default launch offer the project's 3.x split-k wgrad kernels for: every
#: output type. On the H200 (2026-11-30) the 16-bit variants first left their whole output untouched: nvcc 13.0 -O3
#: had compiled their reduction kernel to no loads and no stores. The pattern was `auto o =
#: NumericArrayConverter<half_t, float, 4>()(f);` then `out[j] = o[j]` into a cutlass::AlignedArray<half_t, 4>; a
#: standalone kernel reproduces it, while converting element by element, or assigning the converter's result whole
#: (as the depthwise template does), keeps them. The template's cb_splitk_reduce now converts element by element into
#: a plain aligned struct; tests/test_gpu_sm90_splitk.py checks both stages and every output type on the GPU.
SPLIT_K_OUTPUTS = frozenset({DType.F16, DType.BF16, DType.F32})


def sm90_split_k_modes(problem: Conv2dProblem) -> tuple[SplitKMode, ...]:
    """SERIAL (the plain kernel: with one slice it is unsplit) always; PARALLEL (the project's split-k) for wgrad of
    the output types in SPLIT_K_OUTPUTS."""
    if problem.kind is ConvKind.WGRAD and problem.element_out in SPLIT_K_OUTPUTS:
        return (SplitKMode.SERIAL, SplitKMode.PARALLEL)
    return (SplitKMode.SERIAL,)


def sm90_applicable(problem: Conv2dProblem) -> Optional[str]:
    """Why no sm90 config can compute `problem` (checked before enumerating), or None."""
    if problem.element_a.bits != 16:
        return f"element_a: the sm90 family is built for f16/bf16 inputs, got {problem.element_a.value}"
    if problem.groups != 1:
        return f"groups: sm90 kernels need groups == 1, got {problem.groups}"
    if problem.is_strided_dgrad:
        why = subpixel_reject_reason(problem)
        if why:
            return why
    for name, extent, dt in zip(("A", "B", "output"), problem.channel_dims,
                                (problem.element_a, problem.element_b, problem.element_out)):
        if (extent * dt.nbytes) % 16:
            return f"alignment: {name}'s channel extent {extent} ({dt.value}) is not a multiple of 16 bytes (TMA)"
    return None


def sm90_candidates(
    problem: Conv2dProblem,
    *,
    tile_filter: Optional[Callable[[Shape3], bool]] = None,
    clusters: tuple[Shape3, ...] = CLUSTERS,
    split_k: bool = True,
    schedules: tuple[str, ...] = SCHEDULES,
) -> Iterator[KernelConfig]:
    """Every sm90 config that can implement `problem` (before compiling): tiles x clusters x split-k modes (the
    split-k kernel for wgrad only) x schedules (the ping-pong kernel for plain launches), pruned by the config's
    rules and reject_reason."""
    if sm90_applicable(problem) is not None:
        return
    modes = sm90_split_k_modes(problem) if split_k else (SplitKMode.SERIAL,)
    for tile in problem_tiles(problem):
        if tile_filter and not tile_filter(tile):
            continue
        for cluster in clusters:
            for mode in modes:
                for schedule in schedules:
                    try:
                        cfg = sm90_config(problem, tile, cluster, mode, schedule)
                    except ValueError:
                        continue
                    if cfg.reject_reason(problem) is None:
                        yield cfg


# ------------------------------------------------------------------------------------------- sub-pixel dgrad
#: Most launches one sub-pixel dgrad may take (stride_h x stride_w phases).
SUBPIXEL_MAX_PHASES = 16


@dataclasses.dataclass(frozen=True)
class SubpixelAxis:
    """One spatial axis of one phase: output rows (or columns) phase + stride * i, i < extent, of which the filter
    taps tap0 + stride * j, j < taps, reach dy rows i + pad_lo - j: a stride-1 dgrad with lower padding pad_lo and
    upper padding pad_hi (which makes the stride-1 problem's own dy extent the real one)."""

    phase: int
    extent: int  # dx rows of this phase
    tap0: int
    taps: int
    pad_lo: int
    pad_hi: int


def subpixel_axis(extent: int, out_extent: int, filt: int, pad: int, stride: int, phase: int) -> SubpixelAxis:
    """Phase `phase` of one axis of a dgrad with dx extent `extent`, dy extent `out_extent`, filter `filt`, padding
    `pad` and stride `stride` (dilation 1): dx[phase + stride*i] = sum_j dy[i + pad_lo - j] * w[tap0 + stride*j]."""
    rows = max(0, -(-(extent - phase) // stride))
    tap0 = (phase + pad) % stride
    taps = max(0, -(-(filt - tap0) // stride))
    pad_lo = (phase + pad) // stride
    pad_hi = out_extent - rows - pad_lo + taps - 1
    return SubpixelAxis(phase, rows, tap0, taps, pad_lo, pad_hi)


def subpixel_phases(problem: Conv2dProblem) -> list[tuple[SubpixelAxis, SubpixelAxis]]:
    """The (row, column) phases of a strided dgrad, row phase major (the template launches them most taps first)."""
    p = problem
    rows = [subpixel_axis(p.h, p.p, p.r, p.pad_h, p.stride_h, a) for a in range(p.stride_h)]
    cols = [subpixel_axis(p.w, p.q, p.s, p.pad_w, p.stride_w, b) for b in range(p.stride_w)]
    return [(r, c) for r in rows for c in cols]


def live_phases(problem: Conv2dProblem) -> tuple[list[tuple[SubpixelAxis, SubpixelAxis]], bool]:
    """The phases the kernel launches (dx pixels and filter taps both present), and whether some phase holds dx
    pixels that no tap reaches (zeros, written by a memset of dx before the launches)."""
    live, zeros = [], False
    for r, c in subpixel_phases(problem):
        if r.extent == 0 or c.extent == 0:
            continue
        if r.taps == 0 or c.taps == 0:
            zeros = True
        else:
            live.append((r, c))
    return live, zeros


def subpixel_reject_reason(problem: Conv2dProblem) -> Optional[str]:
    """Why the sub-pixel decomposition cannot compute this strided dgrad on the stride-1 kernel, or None. The
    compiled kernel's cb_can_implement checks the same (and asks CUTLASS about each phase)."""
    p = problem
    if p.is_dilated:
        return f"dilation: the sub-pixel strided dgrad takes dilation 1, got {p.dilation_h}x{p.dilation_w}"
    if p.stride_h * p.stride_w > SUBPIXEL_MAX_PHASES:
        return f"stride: the sub-pixel dgrad launches one kernel per phase, at most {SUBPIXEL_MAX_PHASES}; got {p.stride_h}x{p.stride_w}"
    live, empty = live_phases(p)
    for r, c in live:
        for axis, name in ((r, "h"), (c, "w")):
            if axis.pad_hi < 0 or axis.pad_lo > 256 or axis.pad_hi > 256:
                return (f"padding: phase {r.phase},{c.phase} of the sub-pixel dgrad needs padding {axis.pad_lo}/"
                        f"{axis.pad_hi} along {name} (TMA im2col: 0..256)")
    # (a dgrad's epilogue is plain or a residual: Conv2dProblem allows no activation)
    if empty and p.epilogue.source is not SourceKind.NONE:
        return (f"epilogue: phases of dx that no filter tap reaches (stride {p.stride_h}x{p.stride_w} over a "
                f"{p.r}x{p.s} filter) are zero-filled before the other phases run, which a {p.epilogue.tag} "
                "epilogue would change")
    return None
