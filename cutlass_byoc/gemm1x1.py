"""1x1 stride-1 convolutions as CUTLASS 3.x Hopper GEMMs (family SM90_GEMM_1X1).

A 1x1 filter with stride 1 and no padding touches each pixel once, so in NHWC the three passes are plain
GEMMs over packed matrices (no im2col at all):

=======  ===================================  =========  =====  ========  ====================  ===============
kind     D = A . B                            M          N      K (red.)  A (M x K)             B (N x K)
=======  ===================================  =========  =====  ========  ====================  ===============
fprop    y[NHW,K]  = x[NHW,C] . w[K,C]^T      N*H*W      K      C         x, K-major (RowMajor)  w, K-major (ColumnMajor)
dgrad    dx[NHW,C] = dy[NHW,K] . w[K,C]       N*H*W      C      K         dy, K-major (RowMajor) w, N-major (RowMajor)
wgrad    dw[K,C]   = dy[NHW,K]^T . x[NHW,C]   K          C      N*H*W     dy, M-major (ColMajor) x, N-major (RowMajor)
=======  ===================================  =========  =====  ========  ====================  ===============

D is row-major (N contiguous) for every kind, and every operand is packed, so the leading dimensions are the
channel counts. (The layout tags are CUTLASS's: B is K x N, so "RowMajor" B is N-contiguous.) A strided 1x1 conv
subsamples the activation (not a packed matrix) and a padded one adds zero rows of output: both are refused.

Kernels are ``cutlass::gemm::kernel::GemmUniversal`` with a TMA + wgmma mainloop and a TMA epilogue, in one of
three schedules (``KernelConfig.schedule``):

* ``cooperative``: KernelTmaWarpSpecializedCooperative (two consumer warp groups split the CTA tile along M),
  persistent tile scheduler;
* ``cooperative_streamk``: the same with ``cutlass::gemm::StreamKScheduler``: the scheduler balances the
  reduction over the SMs (stream-K), or, when the launch asks for ``split_k_slices > 1``, splits K into that many
  slices (its split-k decomposition). Partial sums stay fp32 in the workspace and the epilogue runs once, so a
  16-bit output, a bias or a residual are applied exactly as without splitting;
* ``cooperative_streamk_nd``: the same kernel with the scheduler's nondeterministic reduction: the peers of a
  split tile add their partials into the workspace with atomics as they finish, instead of one after another in
  k order. The deterministic order serializes the fixups: a 64x64 wgrad output of one tile split over the 132 SMs
  waited ~90 us for its chain on the H200 (benchmarks/h200/bench-splitk.json, l1_1x1_64_64: 96 us against
  cuDNN's 16). The sum's rounding then depends on arrival order, as cuDNN's own atomics-based wgrad does; under
  ``torch.use_deterministic_algorithms(True)`` the backend never launches these (``deterministic_twin``);
* ``pingpong``: KernelTmaWarpSpecializedPingpong (two consumer warp groups alternate over whole tiles), persistent
  scheduler (CUTLASS's ping-pong kernel static_asserts against the stream-K scheduler).

Tiles, clusters and schedules come from ``cutlass_library.generator.GenerateSM90_TensorOp_16b_WGMMA_gemm`` (what
CUTLASS generates and tests for 16-bit sm90 GEMM), kept where the fp32 accumulator fits the consumer warp groups'
registers (at most 128 per thread), plus narrow tiles for the memory-bound 1x1 layers of 64-256 channels, where a
128-wide N tile would be half padding. The element types are always the problem's own (f16/bf16 inputs, fp32
accumulation, f16/bf16/f32 output). Epilogue: act(alpha * acc + beta * C), C a residual or a per-output-channel
bias read through a zero stride along M (as the sm90 conv family does); wgrad takes no bias (its output channel is
the GEMM's M).

**The im2col lowering** (``KernelConfig.lowering == "im2col"``) takes convs of few input channels (C not a multiple
of 4: the RGB stem, 7x7 stride 2 over C=3), which the implicit-GEMM families can only run on narrow accesses or
zero-padded to C=8 (a 392-long reduction for 147 real taps at the stem). With RSC = R*S*C taps per output pixel
(c fastest) and Wp = w as [K, RSC] in rows padded to Kp (RSC rounded up to 8: 16-byte rows):

=======  ============================================================  =========  =====  ========
kind     what runs                                                     M          N      K (red.)
=======  ============================================================  =========  =====  ========
fprop    AT = im2col(x)^T [RSC, N*P*Q]; y = AT^T . Wp^T (full epilogue)  N*P*Q      K      RSC
dgrad    TT = (dy . Wp)^T [RSC, N*P*Q] in fp32; dx = col2im(TT)          N*P*Q      RSC    K
wgrad    dWp = dy^T . AT^T in fp32; dw = dWp[:, :RSC] cast               K          RSC    N*P*Q
=======  ============================================================  =========  =====  ========

The im2col and column matrices are transposed (one row per tap, the output pixels contiguous): the im2col kernel then
writes, and col2im reads, consecutive pixels across a warp, and the GEMM takes them M-major (fprop), K-major (wgrad)
or writes them M-major (dgrad), so their extent RSC needs no padding. The images are taken in chunks of at most 64 MiB of
that matrix (the workspace's bound; smaller chunks, kept in L2, ran slower on the H200); wgrad accumulates the
chunks' products in fp32 (beta = 1 after the first). The lowered configs' alignments are those of the conv's own
operands: x and w are read element by element (the im2col, filter-padding and col2im kernels), dy and y move through
TMA (16 bytes); its stride support is "strided" (any stride, padding and dilation). dgrad and wgrad take no
epilogue source (their fp32 GEMM output is not the conv's output), dgrad no activation.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Callable, Iterator, Optional

from .config import DEEP_MAX_STAGES, MAX_STAGES, KernelConfig, Shape3
from .generators import Collector, generator_module
from .problem import Conv2dProblem
from .types import Activation, ConvKind, DType, KernelFamily, SourceKind, SplitKMode, StrideSupport

#: schedule -> (CUTLASS kernel schedule, epilogue schedule, tile scheduler)
SCHEDULES: dict[str, tuple[str, str, str]] = {
    "cooperative": ("cutlass::gemm::KernelTmaWarpSpecializedCooperative",
                    "cutlass::epilogue::TmaWarpSpecializedCooperative", "cutlass::gemm::PersistentScheduler"),
    "cooperative_streamk": ("cutlass::gemm::KernelTmaWarpSpecializedCooperative",
                            "cutlass::epilogue::TmaWarpSpecializedCooperative", "cutlass::gemm::StreamKScheduler"),
    "cooperative_streamk_nd": ("cutlass::gemm::KernelTmaWarpSpecializedCooperative",
                               "cutlass::epilogue::TmaWarpSpecializedCooperative", "cutlass::gemm::StreamKScheduler"),
    "pingpong": ("cutlass::gemm::KernelTmaWarpSpecializedPingpong",
                 "cutlass::epilogue::TmaWarpSpecialized", "cutlass::gemm::PersistentScheduler"),
}

#: The stream-K schedules' reduction order (PersistentTileSchedulerSm90StreamKParams::ReductionMode), and each
#: nondeterministic schedule's deterministic twin (the same kernel, the peers' partials added in k order).
STREAMK_REDUCTION: dict[str, str] = {"cooperative_streamk": "Deterministic", "cooperative_streamk_nd": "Nondeterministic"}
DETERMINISTIC_TWIN: dict[str, str] = {"cooperative_streamk_nd": "cooperative_streamk"}

#: warps recorded in KernelConfig.warps: the consumer warp groups' warps (the producer warp group comes on top)
WARPS: dict[str, Shape3] = {"cooperative": (8, 1, 1), "cooperative_streamk": (8, 1, 1), "cooperative_streamk_nd": (8, 1, 1),
                            "pingpong": (4, 1, 1)}

#: cutlass::gemm::collective::detail::sm90_smem_capacity_bytes
SMEM_CAPACITY = 232448

#: Narrow tiles added to the generator's (see the module docstring): N = 64 for layers of 64 output channels,
#: 64 x 128 for ping-pong on few pixels; and WAVE_TILES.
EXTRA_TILES: tuple[Shape3, ...] = ((64, 64, 64), (64, 128, 64), (128, 64, 64), (192, 64, 64), (256, 64, 64))
#: Tiles of 192 rows (ping-pong only: one consumer warp group of three 64-row wgmmas), which fill the GPU's 132 SMs
#: in whole waves where the 128- and 256-row tiles do not (layer 3's 6,272 pixels x 256 channels: 33 x 4 = 132
#: tiles). On the H200 (2026-12-04, benchmarks/h200/sweep-cluster-session22.json and sweep-deep-session22.json) the
#: 192 x 64 kernel was the fastest of its family on 4-6 of the 14 ResNet-50 stride-1 1x1 fprop / dgrad cells, by
#: 0.5-7%, and 5-15% slower on others; the model cannot tell, so the planner times the best of them on a budget of
#: its own (profiler.plan), and the im2col lowering does not take them.
WAVE_TILES: tuple[Shape3, ...] = ((192, 64, 64),)

#: The generator's cluster shapes (2x1x1 multicasts B, 1x2x1 multicasts A across the pair), and none.
CLUSTERS: tuple[Shape3, ...] = ((1, 1, 1), (2, 1, 1), (1, 2, 1))

#: fp32 accumulator elements per consumer thread that fit without spilling
MAX_ACC_PER_THREAD = 128


#: The im2col lowering, and the most taps R*S*C per output pixel it takes (its im2col matrix is R*S*C/(u*v) times
#: the input: the lowering is for small filters over few channels; the bound is also the kernels' own, cb_can_implement).
IM2COL = "im2col"
IM2COL_MAX_RSC = 768


def lowered_alignments(kind: ConvKind, element_out: DType) -> tuple[int, int, int]:
    """(align_a, align_b, align_c) of an im2col-lowered config: TMA's 16 bytes for dy (A of dgrad and wgrad) and for
    y (fprop's output, and its epilogue source); one element for what the lowering's own kernels read or write."""
    if kind is ConvKind.FPROP:
        return 1, 1, 16 // element_out.nbytes
    return 8, 1, 1


def lowered_gemm_mnk(problem: Conv2dProblem) -> tuple[int, int, int]:
    """The im2col-lowered GEMM's M, N and K (see the module docstring's second table)."""
    p = problem
    rows, rsc = p.n * p.p * p.q, p.r * p.s * p.c
    return {ConvKind.FPROP: (rows, p.k, rsc), ConvKind.DGRAD: (rows, rsc, p.k), ConvKind.WGRAD: (p.k, rsc, rows)}[p.kind]


def lowered_extra_bytes(problem: Conv2dProblem) -> int:
    """Bytes the lowering moves on top of the conv's own: its im2col matrix (16-bit) or T (fp32) written and read
    once (mostly in L2, chunked)."""
    p = problem
    elem = 4 if p.kind is ConvKind.DGRAD else p.element_a.nbytes
    return 2 * p.n * p.p * p.q * p.r * p.s * p.c * elem


def _gemm_store_type(kind: ConvKind, element_out: DType, lowering: Optional[str]) -> DType:
    """What a config's GEMM stores: the conv's output type, or fp32 for the lowered dgrad (columns for col2im)
    and wgrad (the chunks' sum)."""
    return DType.F32 if lowering is not None and kind is not ConvKind.FPROP else element_out


def gemm_output(cfg: KernelConfig) -> DType:
    """What the config's GEMM stores (see _gemm_store_type)."""
    return _gemm_store_type(cfg.kind, cfg.element_out, cfg.lowering)


def scheduler_splits(cfg: KernelConfig) -> bool:
    """Whether this config splits K at launch (the stream-K scheduler's split-k decomposition)."""
    return cfg.schedule in STREAMK_REDUCTION


def is_deterministic(cfg: KernelConfig) -> bool:
    """Whether repeated launches on the same operands give bitwise the same output (every schedule but the
    stream-K one with the nondeterministic reduction)."""
    return cfg.schedule not in DETERMINISTIC_TWIN


#: Set inside `forced_determinism` (OffloadOptions.deterministic): deterministic kernels only, whatever PyTorch's flag.
_FORCED_DETERMINISM: contextvars.ContextVar[bool] = contextvars.ContextVar("cutlass_byoc_determinism", default=False)


@contextlib.contextmanager
def forced_determinism(on: bool = True) -> Iterator[None]:
    """Within the block, `deterministic_required` holds where `on` (the backend's ``deterministic`` option around
    its partitioning and its call sites' binding): the planner offers no nondeterministic kernel and a decision holding
    one launches its deterministic twin, as under ``torch.use_deterministic_algorithms(True)``, without asking that of
    the rest of PyTorch. `on` False leaves the requirement as it was."""
    token = _FORCED_DETERMINISM.set(True) if on else None
    try:
        yield
    finally:
        if token is not None:
            _FORCED_DETERMINISM.reset(token)


def determinism_forced() -> bool:
    """Whether the caller is inside `forced_determinism` (the partitioner records it in the call sites it makes)."""
    return _FORCED_DETERMINISM.get()


def deterministic_required() -> bool:
    """Whether deterministic algorithms are required: inside `forced_determinism`, or PyTorch was asked for them
    (``torch.use_deterministic_algorithms(True)``); False without torch (the CLI's planning on a machine without it)."""
    if _FORCED_DETERMINISM.get():
        return True
    try:
        import torch  # noqa: PLC0415
    except ImportError:  # pragma: no cover - torch is a dependency of every launching path
        return False
    return bool(torch.are_deterministic_algorithms_enabled())


def deterministic_twin(cfg: KernelConfig) -> KernelConfig:
    """`cfg` itself if it is deterministic, else the same kernel with the deterministic reduction order."""
    twin = DETERMINISTIC_TWIN.get(cfg.schedule)
    return cfg if twin is None else dataclasses.replace(cfg, schedule=twin)


def consumer_threads(schedule: str) -> int:
    """Threads holding one CTA tile's accumulators: two warp groups (cooperative) or one (ping-pong)."""
    return 256 if schedule.startswith("cooperative") else 128


def epilogue_sub_tile(tile: Shape3, schedule: str, epi_tile: Optional[tuple[int, int]] = None) -> tuple[int, int]:
    """The TMA epilogue's sub-tile: `epi_tile` (KernelConfig.epi_tile), else EpilogueTileAuto's min(128 | 64, M) x
    min(32, N) (cooperative | ping-pong)."""
    return tuple(epi_tile) if epi_tile else (min(128 if schedule.startswith("cooperative") else 64, tile[0]),
                                             min(32, tile[1]))


def epilogue_sub_tiles(tile: Shape3, schedule: str, epi_tile: Optional[tuple[int, int]] = None) -> int:
    """How many sub-tiles (one TMA store each) the epilogue of a CTA tile goes through."""
    em, en = epilogue_sub_tile(tile, schedule, epi_tile)
    return (tile[0] // em) * (tile[1] // en)


def epilogue_smem_bytes(tile: Shape3, element_out: DType, schedule: str, sourceless: bool = False,
                        epi_tile: Optional[tuple[int, int]] = None, epi_stages: Optional[int] = None) -> int:
    """Shared memory of the TMA epilogue (sm90_builder.inl): an epilogue tile of min(128 | 64, M) x min(32, N) (or
    `epi_tile`, KernelConfig.epi_tile), C and D of one type share StagesC = max(min(tiles, 4), min(tiles, 2) + 1)
    buffers (ReuseSmemC), plus 2 KiB for the barriers and alignment of the whole kernel's SharedStorage (nvcc's
    sizeof for every tile, schedule and output width proposed here stayed 48-1152 bytes under this bound;
    tests/test_gemm1x1.py keeps some). Sourceless: D's StagesD buffers alone, min(tiles, 2) or `epi_stages`
    (KernelConfig.epi_stages)."""
    em, en = epilogue_sub_tile(tile, schedule, epi_tile)
    epi_tiles = (tile[0] // em) * (tile[1] // en)
    if sourceless:
        return (epi_stages or min(epi_tiles, 2)) * em * en * element_out.nbytes + 2048
    stages_c = max(min(epi_tiles, 4), min(epi_tiles, 2) + 1)
    return stages_c * em * en * element_out.nbytes + 2048


def stage_count(tile: Shape3, element_in: DType, element_out: DType, schedule: str, sourceless: bool = False,
                cap: int = MAX_STAGES, epi_tile: Optional[tuple[int, int]] = None,
                epi_stages: Optional[int] = None) -> int:
    """What StageCountAutoCarveout would choose with the epilogue above (sub-tile `epi_tile`, `epi_stages` D
    buffers) carved out, at most `cap`."""
    m, n, k = tile
    per_stage = (m + n) * k * element_in.nbytes + 16  # + the stage's pipeline barriers
    epi = epilogue_smem_bytes(tile, element_out, schedule, sourceless, epi_tile, epi_stages)
    return max(2, min(cap, (SMEM_CAPACITY - epi) // per_stage))


# ------------------------------------------------------------------------------------------- rules
def static_error(c: KernelConfig) -> Optional[str]:
    """Why `c` (family SM90_GEMM_1X1) cannot be a kernel; called from KernelConfig.static_error."""
    if c.schedule not in SCHEDULES:
        return f"schedule: the GEMM 1x1 family has {sorted(SCHEDULES)}, got {c.schedule!r}"
    if c.element_a.bits != 16:
        return f"element_a: the GEMM 1x1 family is built for f16/bf16 inputs, got {c.element_a.value}"
    if c.element_acc is not DType.F32:
        return f"element_acc: the GEMM 1x1 family accumulates in f32, got {c.element_acc.value}"
    if c.split_k_mode is not SplitKMode.SERIAL:
        return "split_k_mode: the GEMM 1x1 family splits K through its tile scheduler (the stream-K schedules)"
    if c.lowering is not None:
        if c.lowering != IM2COL:
            return f"lowering: the GEMM 1x1 family lowers with {IM2COL!r}, got {c.lowering!r}"
        if c.stride_support is not StrideSupport.STRIDED:
            return "stride_support: an im2col-lowered kernel takes any stride (strided)"
        if (c.align_a, c.align_b, c.align_c) != lowered_alignments(c.kind, c.element_out):
            return (f"align: an im2col-lowered {c.kind.value} kernel has alignments "
                    f"{lowered_alignments(c.kind, c.element_out)} (TMA rows of dy / y, element-wise x and w), "
                    f"got {(c.align_a, c.align_b, c.align_c)}")
        if c.kind is ConvKind.DGRAD and c.activation is not Activation.IDENTITY:
            return "activation: the im2col-lowered dgrad sums fp32 columns after its GEMM; it applies no activation"
    elif c.stride_support is not StrideSupport.UNITY:
        return "stride_support: the GEMM 1x1 family computes stride-1 convs only"
    else:
        for name, align, elem in (("align_a", c.align_a, c.element_a), ("align_b", c.align_b, c.element_b),
                                  ("align_c", c.align_c, c.element_out)):
            if align * elem.nbytes != 16:
                return f"{name}: TMA moves 16-byte rows, got {align} x {elem.value}"
    m, n, k = c.tile
    coop = c.schedule.startswith("cooperative")
    # 256 at most in every schedule: a TMA box spans at most 256 rows, and a 384-row cooperative tile compiles but its
    # A descriptor fails to initialize at launch (H200, 2026-11-30: CUTLASS printed the error and the kernel hung).
    if m % (128 if coop else 64) or not 64 <= m <= 256:
        return (f"tile {c.tile}: M must be a multiple of {128 if coop else 64} up to 256 (the TMA box) "
                f"({'two consumer warp groups of 64 rows' if coop else 'one consumer warp group of 64 rows'})")
    if n % 16 or not 16 <= n <= 256 or (k * c.element_a.nbytes) % 64:
        return f"tile {c.tile}: wgmma needs N in 16..256 (multiple of 16) and a 64-byte K"
    if m * n // consumer_threads(c.schedule) > MAX_ACC_PER_THREAD:
        return (f"tile {c.tile}: {m * n // consumer_threads(c.schedule)} fp32 accumulators per thread in the "
                f"{c.schedule} schedule (> {MAX_ACC_PER_THREAD}: they would spill)")
    if len(c.cluster) != 3 or c.cluster[2] != 1 or any(x not in (1, 2, 4) for x in c.cluster) \
            or c.cluster[0] * c.cluster[1] > 4:
        return f"cluster {c.cluster}: expected (1|2|4, 1|2|4, 1) with at most 4 CTAs"
    if c.sourceless and c.lowering is not None:
        return "sourceless: not for the im2col lowering (its GEMMs are built with their own C)"
    if c.epi_tile is not None:
        em, en = c.epi_tile
        if c.lowering is not None:
            return "epi_tile: not for the im2col lowering"
        # sm90_builder.inl (sm90_compute_tile_shape_or_override) static_asserts M = 64 (ping-pong) or 128
        # (cooperative) and N % 16 == 0 for an explicit epilogue tile
        if em != (128 if coop else 64) or en % 16 or n % en:
            return (f"epi_tile {c.epi_tile}: M is {128 if coop else 64} in the {c.schedule} schedule (CUTLASS's sm90 "
                    f"epilogue builder), N a multiple of 16 that divides the tile's {n}")
    if c.epi_stages is not None:
        subs = epilogue_sub_tiles(c.tile, c.schedule, c.epi_tile)
        if not c.sourceless or c.lowering is not None:
            return ("epi_stages: sourceless kernels only, not lowered (with a C, CUTLASS's epilogue shares its buffers "
                    "between C and D)")
        if not 1 <= c.epi_stages <= subs:
            return f"epi_stages {c.epi_stages}: 1 to the CTA tile's {subs} epilogue sub-tiles"
    smem = c.stages * ((m + n) * k * c.element_a.nbytes + 16) + epilogue_smem_bytes(
        c.tile, gemm_output(c), c.schedule, bool(c.sourceless), c.epi_tile, c.epi_stages)
    if smem > SMEM_CAPACITY:
        return f"stages {c.stages}: mainloop + epilogue need {smem} bytes of shared memory, past the {SMEM_CAPACITY} of an sm90 CTA"
    return None


def reject_reason(c: KernelConfig, p: Conv2dProblem) -> Optional[str]:
    """Why `c` cannot compute `p` beyond the rules every family shares (kind, types, groups, alignment); called
    from KernelConfig.reject_reason."""
    if c.lowering is not None:
        return im2col_reject_reason(p)
    if (p.r, p.s) != (1, 1):
        return f"filter: the GEMM 1x1 kernels need a 1x1 filter, got {p.r}x{p.s}"
    if p.stride_h != 1 or p.stride_w != 1:
        return (f"stride: a strided 1x1 conv reads every {p.stride_h}x{p.stride_w}-th pixel, not a packed matrix; "
                "the GEMM 1x1 kernels need stride 1")
    if p.pad_h or p.pad_w:
        return f"padding: a padded 1x1 conv is not a plain GEMM; the GEMM 1x1 kernels need padding 0, got {p.pad_h}x{p.pad_w}"
    if p.epilogue.source is SourceKind.BIAS and c.kind is ConvKind.WGRAD:
        return "source: the wgrad GEMM cannot broadcast a bias (its output channel is the GEMM's M)"
    return None


def _gemm_types_error(p: Conv2dProblem, who: str) -> Optional[str]:
    """What the family's GEMMs take of every problem: 16-bit inputs, fp32 accumulation, no groups."""
    if p.element_a.bits != 16:
        return f"element_a: {who} is built for f16/bf16 inputs, got {p.element_a.value}"
    if p.element_acc is not DType.F32:
        return f"element_acc: {who} accumulates in f32, got {p.element_acc.value}"
    if p.groups != 1:
        return f"groups: {who} needs groups == 1, got {p.groups}"
    return None


def applicable(problem: Conv2dProblem) -> Optional[str]:
    """Why no config of the family can compute `problem` (checked before enumerating), or None."""
    p = problem
    why = _gemm_types_error(p, "the GEMM 1x1 family")
    if why:
        return why
    if (p.r, p.s) != (1, 1) or p.stride_h != 1 or p.stride_w != 1 or p.pad_h or p.pad_w:
        return (f"not a 1x1 stride-1 unpadded conv (filter {p.r}x{p.s}, stride {p.stride_h}x{p.stride_w}, "
                f"padding {p.pad_h}x{p.pad_w})")
    for name, extent, dt in zip(("A", "B", "output"), p.channel_dims, (p.element_a, p.element_b, p.element_out)):
        if (extent * dt.nbytes) % 16:
            return f"alignment: {name}'s channel extent {extent} ({dt.value}) is not a multiple of 16 bytes (TMA)"
    return None


def im2col_reject_reason(problem: Conv2dProblem) -> Optional[str]:
    """Why the im2col lowering cannot (or is not meant to) compute `problem`, or None."""
    p = problem
    why = _gemm_types_error(p, "the im2col lowering")
    if why:
        return why
    if (p.c * p.element_a.nbytes) % 8 == 0:
        return (f"channels: the im2col lowering is for few input channels (C={p.c} reads in 8-byte accesses "
                "or wider: the implicit-GEMM kernels take it directly)")
    if p.r * p.s * p.c > IM2COL_MAX_RSC:
        return f"filter: R*S*C = {p.r * p.s * p.c} is past the im2col lowering's {IM2COL_MAX_RSC}"
    if (p.k * p.element_a.nbytes) % 16 or (p.kind is ConvKind.FPROP and (p.k * p.element_out.nbytes) % 16):
        return f"alignment: the im2col lowering moves {'y' if p.kind is ConvKind.FPROP else 'dy'} by TMA: K={p.k} rows must be 16-byte multiples"
    if p.kind is not ConvKind.FPROP and p.epilogue.source is not SourceKind.NONE:
        return f"source: the im2col-lowered {p.kind.value} takes no epilogue source (its GEMM writes fp32 columns)"
    if max(p.n * p.p * p.q, p.n * p.h * p.w) > (2**31 - 1) // 2:  # the kernels' cb_can_implement bound
        return "size: N*P*Q or N*H*W past the im2col lowering's int32 pixel indices (at most 2^30 - 1)"
    return None


# ------------------------------------------------------------------------------------------- candidates
_SCHEDULE_NAMES = {("TmaWarpSpecializedCooperative", "Default"): "cooperative",
                   ("TmaWarpSpecializedCooperative", "Persistent"): "cooperative",
                   ("TmaWarpSpecializedCooperative", "StreamK"): "cooperative_streamk",
                   ("TmaWarpSpecializedPingpong", "Default"): "pingpong",
                   ("TmaWarpSpecializedPingpong", "Persistent"): "pingpong"}


@functools.lru_cache(maxsize=None)
def generator_configs() -> tuple[tuple[Shape3, Shape3, str], ...]:
    """Distinct (CTA tile, cluster, schedule) that cutlass_library generates for sm90 16-bit GEMM with fp32
    accumulation and a TMA epilogue."""
    generator = generator_module()
    collector = Collector(level=None)  # the GEMM generator needs its default level (an int)
    generator.GenerateSM90_TensorOp_16b_WGMMA_gemm(collector, "13.0")
    out = set()
    for op in collector.operations:
        td = op.tile_description
        mi = td.math_instruction
        if mi.element_a.name not in ("f16", "bf16") or mi.element_accumulator.name != "f32":
            continue
        if "NoSmem" in op.epilogue_schedule.name:
            continue  # the TMA epilogue only: it is what reads C (bias, residual) through TMA
        sched = _SCHEDULE_NAMES.get((op.kernel_schedule.name, op.tile_scheduler.name))
        if sched is None:
            continue
        out.add((tuple(int(t) for t in td.tile_shape), tuple(int(x) for x in td.cluster_shape), sched))
    return tuple(sorted(out))


@functools.lru_cache(maxsize=None)
def tile_schedules() -> tuple[tuple[Shape3, str], ...]:
    """(tile, schedule) pairs proposed: the generator's (each stream-K one also with the nondeterministic
    reduction), plus EXTRA_TILES in every schedule (invalid ones are dropped by static_error when the config is
    built)."""
    try:
        gen = generator_configs()
    except Exception:  # pragma: no cover - a cutlass_library without this generator
        gen = (((128, 128, 64), (1, 1, 1), "cooperative"), ((128, 128, 64), (1, 1, 1), "cooperative_streamk"),
               ((128, 128, 64), (1, 1, 1), "pingpong"))
    pairs = {(t, s) for t, _, s in gen if t[2] * 2 == 128}
    pairs |= {(t, nd) for t, s in pairs for nd, twin in DETERMINISTIC_TWIN.items() if s == twin}
    pairs |= {(t, s) for t in EXTRA_TILES for s in SCHEDULES}
    return tuple(sorted(pairs))


def _config(problem: Conv2dProblem, tile: Shape3, schedule: str, cluster: Shape3, swizzle: int,
            lowering: Optional[str], sourceless: Optional[bool] = None) -> KernelConfig:
    """The family's config of `problem` (plain, or lowered with `lowering`); raises ValueError if invalid."""
    p = problem
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {sorted(SCHEDULES)}, got {schedule!r}")
    if lowering is None:
        aligns = (16 // p.element_a.nbytes, 16 // p.element_b.nbytes, 16 // p.element_out.nbytes)
        stride_support = StrideSupport.UNITY
    else:
        aligns = lowered_alignments(p.kind, p.element_out)
        stride_support = StrideSupport.STRIDED
    stages = stage_count(tile, p.element_a, _gemm_store_type(p.kind, p.element_out, lowering), schedule,
                         bool(sourceless))
    return KernelConfig(
        family=KernelFamily.SM90_GEMM_1X1, kind=p.kind,
        element_a=p.element_a, element_b=p.element_b, element_out=p.element_out, element_acc=p.element_acc,
        tile=tile, warps=WARPS[schedule], stages=stages, stride_support=stride_support,
        align_a=aligns[0], align_b=aligns[1], align_c=aligns[2],
        split_k_mode=SplitKMode.SERIAL, swizzle=swizzle, activation=p.epilogue.activation,
        cluster=cluster, schedule=schedule, lowering=lowering, sourceless=sourceless,
    )


def deep_twin(kernel: KernelConfig) -> Optional[KernelConfig]:
    """`kernel` (not lowered) with as many pipeline stages as its shared memory holds, past MAX_STAGES (None where the
    cap does not bind: tiles of 64 x 64, 128 x 64 and 64 x 128). On the H200 (2026-12-04, scripts/sweep_kernels.py
    --deep) the 64 x 64 ping-pong wgrad kernel ran 9-14% faster with 13 stages than with 8 on every ResNet-50 1x1
    wgrad cell; fprop and dgrad (a reduction of C or K channels) gained nothing as a rule. The planner times a wgrad
    kernel's deep twin beside it (profiler.plan)."""
    if kernel.lowering is not None:
        return None
    return kernel.with_more_stages(stage_count(kernel.tile, kernel.element_a, gemm_output(kernel), kernel.schedule,
                                               bool(kernel.sourceless), cap=DEEP_MAX_STAGES,
                                               epi_tile=kernel.epi_tile, epi_stages=kernel.epi_stages))


def _with_epilogue(kernel: KernelConfig, epi_tile: Optional[tuple[int, int]],
                   epi_stages: Optional[int]) -> KernelConfig:
    """`kernel` with this epilogue sub-tile and D buffer count, and as many pipeline stages as before where they
    still fit beside its buffers, else as many as fit (ValueError where the config's rules refuse it)."""
    return dataclasses.replace(kernel, epi_tile=epi_tile, epi_stages=epi_stages, stages=stage_count(
        kernel.tile, kernel.element_a, gemm_output(kernel), kernel.schedule, bool(kernel.sourceless),
        cap=kernel.stages, epi_tile=epi_tile, epi_stages=epi_stages))


def with_epilogue_tile(kernel: KernelConfig, epi_tile: tuple[int, int]) -> KernelConfig:
    """`kernel` (GEMM 1x1, not lowered) with the TMA epilogue's sub-tile `epi_tile` (KernelConfig.epi_tile) and as
    many pipeline stages as before where they still fit beside its buffers, else as many as fit; raises ValueError
    where the sub-tile does not suit the tile."""
    return _with_epilogue(kernel, tuple(epi_tile), kernel.epi_stages)


def with_store_stages(kernel: KernelConfig, epi_stages: Optional[int] = None) -> KernelConfig:
    """`kernel` (GEMM 1x1, sourceless, not lowered) with `epi_stages` D buffers in its TMA epilogue
    (KernelConfig.epi_stages; None: one per sub-tile, every store of a tile in flight at once) and as many pipeline
    stages as before where they still fit beside them, else as many as fit. The config's rules (static_error) say
    where it does not apply."""
    return _with_epilogue(kernel, kernel.epi_tile,
                          epi_stages or epilogue_sub_tiles(kernel.tile, kernel.schedule, kernel.epi_tile))


def store_stages_twin(kernel: KernelConfig) -> Optional[KernelConfig]:
    """`kernel` with one epilogue D buffer per sub-tile (with_store_stages), or None where that is not a different
    kernel or does not apply: a kernel with a C or lowered, one whose D buffers are set already, one of at most two
    sub-tiles (the builder's min(sub-tiles, 2) buffers are one each already), and one whose buffers would leave no
    room for two pipeline stages."""
    if (kernel.family is not KernelFamily.SM90_GEMM_1X1 or not kernel.sourceless or kernel.lowering is not None
            or kernel.epi_stages is not None
            or epilogue_sub_tiles(kernel.tile, kernel.schedule, kernel.epi_tile) <= 2):
        return None
    try:
        return with_store_stages(kernel)
    except ValueError:  # (its buffers leave no room for two pipeline stages)
        return None


def gemm1x1_config(problem: Conv2dProblem, tile: Shape3 = (128, 128, 64), schedule: str = "cooperative_streamk",
                   cluster: Shape3 = (1, 1, 1), swizzle: int = 1, sourceless: bool = False) -> KernelConfig:
    """The config of `problem` with this tile, schedule and cluster (16-byte alignments; raises ValueError if
    the combination is invalid). `swizzle` is the tile scheduler's max_swizzle_size; `sourceless` builds it without
    an epilogue source (KernelConfig.sourceless: only for a problem without bias or residual)."""
    return _config(problem, tile, schedule, cluster, swizzle, None, True if sourceless else None)


def im2col_config(problem: Conv2dProblem, tile: Shape3 = (128, 64, 64), schedule: str = "cooperative",
                  cluster: Shape3 = (1, 1, 1), swizzle: int = 1) -> KernelConfig:
    """The im2col-lowered config of `problem` with this GEMM tile, schedule and cluster (raises ValueError if the
    combination is invalid). The GEMM of dgrad and wgrad stores fp32, which sets its epilogue's shared memory."""
    return _config(problem, tile, schedule, cluster, swizzle, IM2COL)


def _candidates(problem: Conv2dProblem, make: Callable[..., KernelConfig], clusters: tuple[Shape3, ...],
                tile_filter: Optional[Callable[[Shape3], bool]] = None) -> Iterator[KernelConfig]:
    """The configs `make` builds for each (tile, schedule) pair and cluster that pass the config rules; under
    ``torch.use_deterministic_algorithms(True)`` without the nondeterministic stream-K reduction, so the profiler
    never times (and records) a kernel the launch would not run."""
    deterministic = deterministic_required()
    for tile, schedule in tile_schedules():
        if tile_filter and not tile_filter(tile):
            continue
        if deterministic and schedule in DETERMINISTIC_TWIN:
            continue
        for cluster in clusters:
            try:
                cfg = make(problem, tile, schedule, cluster)
            except ValueError:
                continue
            if cfg.reject_reason(problem) is None:
                yield cfg


def im2col_candidates(problem: Conv2dProblem, clusters: tuple[Shape3, ...] = ((1, 1, 1),)) -> Iterator[KernelConfig]:
    """Every im2col-lowered config for `problem` (nothing where the lowering does not apply): the family's (tile,
    schedule) pairs, unclustered by default (the GEMMs are memory-bound: the im2col or T matrix streams once)."""
    if im2col_reject_reason(problem) is not None:
        return
    yield from _candidates(problem, im2col_config, clusters, lambda tile: tile not in WAVE_TILES)


def gemm1x1_candidates(
    problem: Conv2dProblem,
    *,
    tile_filter: Optional[Callable[[Shape3], bool]] = None,
    clusters: tuple[Shape3, ...] = CLUSTERS,
) -> Iterator[KernelConfig]:
    """Every config of the family that can implement `problem` (before compiling): (tile, schedule) x clusters,
    pruned by the config rules. Nothing for problems the family cannot take (see `applicable`). Under
    ``torch.use_deterministic_algorithms(True)`` the nondeterministic stream-K reduction is not offered, so the
    profiler never times (and records) a kernel the launch would not run. A problem whose epilogue has no source
    (no bias, no residual) gets the sourceless kernels (KernelConfig.sourceless), which ran faster on the H200."""
    if applicable(problem) is not None:
        return
    sourceless = problem.epilogue.source is SourceKind.NONE

    def make(p: Conv2dProblem, tile: Shape3, schedule: str, cluster: Shape3) -> KernelConfig:
        return gemm1x1_config(p, tile, schedule, cluster, sourceless=sourceless)

    yield from _candidates(problem, make, clusters, tile_filter)
