"""The direct depthwise family (groups == C == K, channel multiplier 1): fprop, dgrad and wgrad kernels of the
project's own (templates/conv2d_depthwise_direct.cu.j2), for NHWC fp16/bf16/fp32 with fp32 accumulation.

Depthwise convs are memory-bound (R*S multiply-adds per element moved), so the kernels are direct loops, not
implicit GEMMs. A config (a `KernelConfig` of family DEPTHWISE_DIRECT) fixes:

=============  ===============================================================================================
field          meaning
=============  ===============================================================================================
tile           (rows, cols, channels): the CTA's tile of output pixels x channels (dgrad: of input-gradient
               pixels; wgrad: the tile of dy pixels a CTA reduces per step)
align_a        channels per thread, the vector width (8/4/2/1 elements, at most 16 bytes)
warps          (warps, 1, 1): the CTA's threads / 32. Each thread computes `strip` consecutive output columns
               of one row: strip = rows * cols * (channels / vector) / threads
halo_smem      True: the CTA first stages its input halo (the input rows and columns its output tile reads) in
               shared memory, every copy issued at once (cp.async, zero-filled outside the image; 2-byte accesses
               through registers); False: every thread reads the input through L1
filter_rs      R x S, compile-time (the tap loops unroll)
conv_stride    the stride, compile-time (the sliding window along a thread's strip unrolls)
split_k_mode   CLUSTER for wgrad (the cluster twin of each config, `cluster_variant`): a channel block's splits are one
               thread-block cluster of `split_k_slices` CTAs (at most MAX_CLUSTER_SPLITS) that add their sums
               through distributed shared memory, in split order, and write dw: one kernel, no workspace.
               PARALLEL for wgrad: each CTA reduces a slice of the N*P*Q pixel tiles into fp32 partials in the
               workspace, then a reduction kernel sums the slices and casts; the slice count is the launch's
               `split_k_slices`. SERIAL (meaning: not split) for fprop and dgrad.
align_b        fprop/dgrad: 1 (the filter, [C][R][S], is read per channel into shared memory once per CTA);
               wgrad: x's alignment
align_c        fprop/dgrad: the output's store width; wgrad: 1 (the reduction writes dw [C][R][S] per element)
element_bias   fprop only: None, or the type of a separate bias-vector operand (name `vbias<type>`), for a bias with
               a residual (y = act(alpha * conv + beta * residual + bias)) or a bias typed unlike the output (an
               fp32 bias under a 16-bit output, a 16-bit bias under a trailing fp32 cast); as the implicit-GEMM
               families' bias-vector kernels. Without it a bias is read as the epilogue source, in the output's type
stages         pixel tiles: 1, or 2 with halo_smem ("pipelined", name `smem2`): fprop and stride-1 dgrad keep
               their CTAs resident (as many as the GPU holds) and walk the pixel tiles, the next tile's halo
               streaming into a second shared-memory buffer while the current one is computed; wgrad walks its
               split's tiles the same way, the dy tile staged beside the halo. "rows"/"taprows": the columns per
               step
min_blocks     None, or the CTAs per SM the compiler must fit (`__launch_bounds__(threads, min_blocks)`): a
               register cap of 65536 / (min_blocks * threads) per thread, for more warps in flight at the price
               of possible spills. Candidates come in pairs, without and with the cap of MIN_BLOCKS_REGS.
prefetch       "cols" only: None, or the rows ahead of the row being summed whose loads a thread issues first (name
               `cols<rows>pf<n>`): more loads in flight for more registers. "cols" candidates come with twins
               loading PREFETCH_ROWS rows ahead and as many rows ahead as their registers allow within
               COLS_MAX_REGS (`prefetch_variants`).
=============  ===============================================================================================

Kernels:

- fprop: a thread owns a vector of channels and `strip` output columns of one row; for each filter row it walks
  the input window of its strip once ((strip - 1) * stride + S vectors), each loaded vector feeding every output
  column whose tap it is, into fp32 accumulators; then bias / residual, activation, conversion and store.
- dgrad, stride 1: the fprop loop on dy with the filter rotated 180 degrees and padding R-1-pad.
- dgrad, stride > 1: each dx pixel sums only its valid taps, those with (h + pad - r) divisible by the stride (one
  tap row in `stride`; no multiply by zero).
- wgrad: a thread holds R*S*vector fp32 accumulators; for each dy pixel of its strip it reads the input window
  like fprop. The CTA sums its threads (warp shuffles, then the warps in turn: no atomics, deterministic) and
  writes one fp32 partial per split into the workspace ([splits][R*S][C] floats); the reduction kernel writes
  dw = alpha * sum + beta * source.
- wgrad, schedule "rows" (`ROWS`): the work is dy row segments (image n, row p, `tile[1]` columns) instead of pixel
  tiles. A thread owns a channel vector and one segment at a time; it walks the segment `stages` columns per step,
  issuing all of the step's loads (its dy vectors and, for each filter row, the (stages - 1) * stride + S input
  vectors they touch) before the step's arithmetic, so each thread keeps several 16-byte loads in flight (the tile
  kernels stage through shared memory or load one window at a time). `tile[0]` threads per channel vector take
  the split's segments in turn; the partials and the reduction are the tile kernels'. For this schedule `tile` is
  (segment threads, segment columns, channels) and `stages` the columns per step.
- wgrad, schedule "taprows" (`TAPROWS`): the "rows" schedule with the filter rows split over R groups of threads:
  each thread sums the S taps of one filter row (S*vector fp32 sums instead of R*S*vector, and one input row per
  step), the R groups walking the same segments (each reads the segment's dy; all but the first from L1). For the
  5x5 and 7x7 filters, whose R*S*vector sums leave a "rows" thread few registers for loads in flight or force a
  narrow vector. The CTA is R x `tile[0]` x (channel vectors) threads; `tile[0]` x (channel vectors) is a multiple
  of 32, so the threads of a warp share their filter row.
- wgrad, pipelined (pixel tiles, halo_smem, stages 2; name `smem2`): the filter rows split over R groups of threads
  as in "taprows", but each split's CTA walks its pixel tiles with the tile's input halo and its dy both copied
  into shared memory (cp.async, zero-filled outside the images), the next tile's copies in flight while the
  current tile is computed. No thread waits on a load it issued in the same step (on the H200 the "taprows"
  kernels issued an instruction every ~5 cycles per scheduler at 10-15 warps per SM: load latency, not bandwidth or
  arithmetic, bounded them). The CTA is R x (rows x cols / strip) x (channel vectors) threads, each thread a strip
  of `strip` dy columns of one tile row for one filter row (S * vector fp32 sums); `PIPELINED_WGRAD_SHAPES`.
  Measured on the H200: it was the best of ours on 4 of MobileNetV2's 10 distinct depthwise wgrad problems (3x3,
  fp32 output; 3 of them faster than cuDNN) and on none of the fp16-output `depthwise` workload; on 5x5 it ran
  60-70 us where "taprows" ran 41 us (the staging's per-copy index arithmetic costs more than the load latency it
  hides there). The untuned default weighs it by its measured factor (DW_CALIBRATION: 3.37 and 2.23 times the
  model's estimate at stride 1 and 2), so it is the tuner's to pick.
- wgrad, schedule "cols" (`COLS`; fprop and both dgrads have it too, below): the work is column strips of dy,
  `stages` rows x `tile[1]` columns of one image. A thread owns a channel vector and one strip at a time and walks
  it down row by row, the row loop unrolled: each input row the strip reads ((columns - 1) * stride + S vectors) is
  loaded once, converted to fp32 once, and kept in registers for the up to R dy rows that read it, and the loads of
  the next dy row (`prefetch` rows ahead in the twin) and of the input rows it adds are issued before the current
  row's multiply-adds. So a thread reads its input once, where "rows" and "taprows" read each input row once per
  filter row, and always has the next row's loads in flight. The R*S*vector sums and R
  input rows in fp32 stay in registers, which bounds the vector and the strip's columns (`cols_registers`,
  COLS_MAX_REGS): 3x3 at vector 4, 5x5 at vector 2. `tile[0]` threads (slots) per channel vector take the split's
  strips in turn, neighbouring strips on neighbouring slots; partials and reduction as the other wgrad schedules.
  For this schedule `tile` is (slots, strip columns, channels) and `stages` the strip's rows.
- fprop and stride-1 dgrad, schedule "cols": the same walk over output column strips, the R*S taps of the thread's
  channel vector in fp32 registers (staged once per CTA in shared memory): each output row's strip sums its R input
  rows, kept in registers from the rows above, then goes through the epilogue and is stored. One strip per thread
  (the grid covers them, `tile[0]` per CTA). Their register-capped twins (`min_blocks`, at COLS_CAPPED_REGS: 5 CTAs
  of 128 threads where the 3x3 kernels hold 121-127 registers, 4 CTAs) keep no taps in registers: they read each
  filter row's taps from shared memory where a row's sums need them (volatile shared loads, one 16-byte load per
  tap and channel vector), for more warps in flight; the planner times each beside its twin.
  The taps are staged times alpha (the epilogue's scale, once per tap instead of once per output), and the kernel is
  instantiated once per epilogue source (none, bias, residual), so a store carries no branch on it; loads and stores
  address from a 64-bit pointer per strip (on the H200, ncu and SASS of MobileNetV2's 32-channel 112x112 fprop:
  27 instructions per output element, 9 of them multiply-adds, at 25% occupancy and half the issue slots used;
  the offset arithmetic and the epilogue's scale and source branches were about a sixth of them).
- strided dgrad, schedule "cols": the same walk over dx column strips, each strip aligned to the stride (it starts
  on a dx row h0 with h0 + pad_h a multiple of u, the first one pad_h % u rows above dx; likewise columns), so which
  taps reach each dx row of the strip and from which dy row is fixed at compile time: dx row h0 + k reads dy row
  (h0 + pad_h) / u + (k - r) / u through each filter row r with k - r a multiple of u. No tap is tested at run time
  and none multiplies a zero (the pixel-tile kernel tests each candidate tap of each pixel). Each dy row is loaded
  and converted once and kept for the dx rows that read it (ceil(R / u) of them); strip rows and columns are whole
  stride periods. A dy row feeds u dx rows, so at stride 2 the 3x3 kernel fits vector 8 (16-byte accesses).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional

from .config import KernelConfig, LaunchConfig
from .problem import ALIGNMENTS, Conv2dProblem, max_alignment
from .types import Activation, ConvKind, IteratorAlgorithm, KernelFamily, SourceKind, SplitKMode, StrideSupport

#: Static shared memory a CTA may use without opting in (cudaFuncSetAttribute would need a device at load).
SMEM_LIMIT = 48 * 1024
#: fp32 accumulators a wgrad thread may hold (R*S*vector); past this the kernel spills.
WGRAD_MAX_ACC = 128
MAX_FILTER = 9
MAX_STRIDE = 4
#: The wgrad schedules whose work is dy row segments (see the module docstring); None is the pixel-tile schedule.
ROWS = "rows"
TAPROWS = "taprows"
#: The schedule whose work is column strips walked down (wgrad: of dy; fprop, dgrad: of the output; see the module
#: docstring).
COLS = "cols"
#: Registers a "rows" wgrad thread may need (accumulators, the step's dy in fp32 and its input window); past this the
#: kernel spills or runs one CTA per SM.
ROWS_MAX_REGS = 192
#: Registers a "cols" thread may need (`cols_registers`): past this it runs fewer than 4 CTAs of 128 threads per SM, or
#: spills. Measured on the H200 (2026-12-03): wider vectors past this bound, their taps in shared memory and capped at
#: 2-3 CTAs (5x5 at vector 4, 3x3 at vector 8; 168-252 registers), cut the 5x5 kernels' instructions per output from
#: 76 to 52-55, but none beat the planner's best on the 15 cells tried (8 MobileNetV2 / EfficientNet-B0 layers, fprop
#: and stride-1 dgrad): each cell's best variant ran 0-20% slower, 1-column strips 4-7x slower. The "cols" kernels are
#: bound by load latency at their occupancy, not by their instruction count (ncu, EfficientNet-B0's 240-channel 5x5
#: fprop: 14.1 M warp instructions, 0.65 issued per scheduler per cycle at 27% occupancy; cuDNN's xmma depthwise
#: kernel 14.6 M at 0.78).
COLS_MAX_REGS = 128
#: The rows ahead a "cols" kernel's prefetch twin (`prefetch_variant`) issues its loads: two rows of loads in flight
#: per thread instead of one. A 144-channel 56x56 layer's "cols" kernels ran at 1.6-2.3 TB/s on the H200 with 12-16
#: warps per SM, stalled on their loads (ncu: long scoreboard), one row of loads in flight each.
PREFETCH_ROWS = 2
H200_SMS = 132
DRAM_GBS = 3800.0
LAUNCH_US = 3.0
#: The most splits a cluster-split wgrad takes: the CTAs of one thread-block cluster (8: the portable cluster size)
MAX_CLUSTER_SPLITS = 8
#: Threads an SM holds (sm_90), and its 32-bit registers.
MAX_SM_THREADS = 2048
SM_REGISTERS = 65536
#: Registers per thread the `min_blocks` variants cap a kernel at: fprop/dgrad (ptxas, sm_90a: the 3x3 "rows"
#: fprop kernel with 4 columns per step needs 108 unbounded and spills 88 bytes at 80) and wgrad, whose R*S*vector
#: fp32 sums stay in registers (192 unbounded for 3x3 at vector 8).
MIN_BLOCKS_REGS = {ConvKind.FPROP: 80, ConvKind.DGRAD: 80, ConvKind.WGRAD: 128}
#: ... and of a "cols" fprop / dgrad kernel, whose capped twin reads its filter taps from shared memory per filter row
#: instead of holding the R*S*vector of them in registers (the template's shared_taps): 96, 5 CTAs of 128 threads
#: where the uncapped 3x3 kernels hold 121-127 registers, 4 CTAs (ncu on the H200: 25% occupancy, issue slots half
#: busy, latency-bound).
COLS_CAPPED_REGS = 96
#: How much the model discounts a `min_blocks` variant for the spills its register cap may cause: it ranks right
#: after its unbounded twin (the profiler times both; the model cannot tell which wins).
MIN_BLOCKS_PENALTY = 1.01


# ---------------------------------------------------------------------------------------------- derived sizes
def vector(c: KernelConfig) -> int:
    return c.align_a


def lanes(c: KernelConfig) -> int:
    """Threads across the CTA's channels."""
    return c.tile[2] // c.align_a


def strip(c: KernelConfig) -> int:
    """Consecutive output columns per thread (the pixel-tile schedules; pipelined wgrad: dy columns per thread and
    filter row)."""
    rows, cols, _ = c.tile
    return rows * cols * lanes(c) * row_groups(c) // c.threads


def is_wide_strip(c: KernelConfig) -> bool:
    """Whether a pixel-tile config's threads compute strips of at least WIDE_STRIP columns."""
    return not is_rows(c) and not is_cols(c) and strip(c) >= WIDE_STRIP


def is_rows(c: KernelConfig) -> bool:
    """Whether the config is a "rows" or "taprows" wgrad schedule (work: dy row segments; see the module docstring)."""
    return c.schedule in (ROWS, TAPROWS)


def is_cols(c: KernelConfig) -> bool:
    """Whether the config is a "cols" schedule (work: column strips walked down; see the module docstring)."""
    return c.schedule == COLS


def is_gathered(c: KernelConfig) -> bool:
    """Whether the kernel is a strided dgrad (each dx pixel sums only its valid taps)."""
    return c.kind is ConvKind.DGRAD and not is_flipped(c)


def _cols_footprint(r: int, s: int, stride: tuple[int, int], cols: int, gathered: bool) -> tuple[int, int]:
    """(input rows one row of a "cols" strip reads, input vectors of each such row) for an R x S filter, the stride and
    strips of `cols` columns: R rows of (cols - 1) * stride + S; for the strided dgrad (`gathered`), whose strips are
    aligned to the stride, ceil(R / u) dy rows of (S - 1) // v + (cols - 1) // v + 1."""
    sh, sw = stride
    if gathered:
        return -(-r // sh), (s - 1) // sw + (cols - 1) // sw + 1
    return r, (cols - 1) * sw + s


def cols_window(c: KernelConfig) -> int:
    """Input vectors of each input row a "cols" strip reads (_cols_footprint)."""
    return _cols_footprint(*c.filter_rs, c.conv_stride, c.tile[1], is_gathered(c))[1]


def cols_registers(c: KernelConfig) -> int:
    """32-bit registers a "cols" thread needs for its data at a row (a lower bound: addresses and loop state come on
    top): R*S*vector fp32 values (wgrad: its sums; fprop / dgrad: the filter taps), the input rows the row reads in
    fp32 (R; strided dgrad: the ceil(R / u) dy rows), per strip column the row's dy in fp32 (wgrad) or its fp32 sums
    (fprop / dgrad), and the loads in flight as loaded: the new input rows (and wgrad's dy row) of each of the
    `prefetch` rows ahead (None: one)."""
    vec, (r, s), (sh, _) = c.align_a, c.filter_rs, c.conv_stride
    loaded = vec * c.element_a.nbytes / 4  # registers of one vector as loaded
    rows, window = _cols_footprint(r, s, c.conv_stride, c.tile[1], is_gathered(c))
    if is_gathered(c):  # a dy row every u dx rows
        ahead = window * loaded
    else:
        ahead = min(sh, r) * window * loaded + (c.tile[1] * loaded if c.kind is ConvKind.WGRAD else 0)  # per row ahead
    return math.ceil(r * s * vec + rows * window * vec + c.tile[1] * vec + (c.prefetch or 1) * ahead)


def row_groups(c: KernelConfig) -> int:
    """Thread groups splitting the filter rows: R for "taprows" and the pipelined wgrad (one row per thread), else 1."""
    return c.filter_rs[0] if c.schedule == TAPROWS or is_pipelined_wgrad(c) else 1


def thread_taps(c: KernelConfig) -> int:
    """Filter taps a wgrad thread sums (fp32 accumulators per channel of its vector)."""
    r, s = c.filter_rs
    return r * s // row_groups(c)


def rows_window(c: KernelConfig) -> int:
    """Input vectors per filter row a "rows" step reads: (columns per step - 1) * stride + S."""
    return (c.stages - 1) * c.conv_stride[1] + c.filter_rs[1]


def rows_registers(c: KernelConfig) -> int:
    """32-bit registers a "rows"/"taprows" thread needs for its data (a lower bound: addresses and loop state come on
    top). wgrad: its taps' fp32 sums (x vector), the step's dy vectors in fp32 and its filter rows' input windows as
    loaded; fprop / stride-1 dgrad: the step's fp32 outputs, one filter row's taps and the R input windows."""
    vec = c.align_a
    rows = c.filter_rs[0] // row_groups(c)
    window = rows * rows_window(c) * vec * c.element_a.nbytes // 4
    if c.kind is not ConvKind.WGRAD:
        return c.stages * vec + c.filter_rs[1] * vec + window
    return thread_taps(c) * vec + c.stages * vec + window


def is_flipped(c: KernelConfig) -> bool:
    """Whether the kernel runs the fprop loop with the filter rotated (stride-1 dgrad)."""
    return c.kind is ConvKind.DGRAD and c.conv_stride == (1, 1)


def runs_window_loop(c: KernelConfig) -> bool:
    """Whether the kernel walks input windows into output strips: fprop and stride-1 dgrad (not wgrad, and not the
    strided dgrad, which gathers its valid taps)."""
    return c.kind is ConvKind.FPROP or is_flipped(c)


def halo_shape(c: KernelConfig) -> tuple[int, int]:
    """Input rows x columns a CTA's output tile reads (its halo)."""
    rows, cols, _ = c.tile
    (r, s), (sh, sw) = c.filter_rs, c.conv_stride
    if is_flipped(c):
        sh = sw = 1
    return (rows - 1) * sh + r, (cols - 1) * sw + s


def is_pipelined(c: KernelConfig) -> bool:
    """Whether a pixel-tile config walks its tiles with a double-buffered halo (stages 2): fprop and stride-1 dgrad
    with resident CTAs, wgrad one CTA per split and channel block."""
    return not is_rows(c) and not is_cols(c) and c.stages > 1


def is_pipelined_wgrad(c: KernelConfig) -> bool:
    """Whether the config is a pipelined wgrad (halo and dy tiles double-buffered, filter rows split over threads)."""
    return c.kind is ConvKind.WGRAD and is_pipelined(c)


def pad_groups(c: KernelConfig) -> tuple[int, int]:
    """Columns per pad column of the staged halo and of the pipelined wgrad's dy tile in shared memory (0: none).

    A 16-byte shared load is served in phases of 8 threads (128 bytes, all 32 banks). With fewer than 8 channel
    vectors per pixel a phase reads the strips of 8 / vectors pixels, strip * stride columns apart (dy: strip
    columns); where that distance is even, the column stride of vectors * 16 bytes puts them in the same banks
    (2-way conflicts at 4 vectors, 4-way at 2). A pad column after every such group spreads them over all banks.
    Padded only where the buffers still fit the static shared memory (else the config keeps its unpadded layout)."""
    if not c.halo_smem or is_rows(c) or (c.kind is ConvKind.DGRAD and not is_flipped(c)) or lanes(c) >= 8:
        return 0, 0
    group = strip(c) * (1 if is_flipped(c) else c.conv_stride[1])
    groups = (group if group % 2 == 0 else 0, strip(c) if is_pipelined_wgrad(c) and strip(c) % 2 == 0 else 0)
    return groups if _smem_bytes(c, *groups) <= SMEM_LIMIT else (0, 0)


def _smem_bytes(c: KernelConfig, halo_group: int, dy_group: int) -> int:
    r, s = c.filter_rs
    filt = r * s * c.tile[2] * 4  # fprop/dgrad: the filter in fp32; wgrad: the CTA's fp32 reduction buffer
    if not c.halo_smem or is_rows(c):
        return filt
    hh, ww = halo_shape(c)
    vectors = hh * (ww + ((ww - 1) // halo_group if halo_group else 0))  # with its pad columns
    if is_pipelined_wgrad(c):  # the dy tile beside the halo
        vectors += c.tile[0] * (c.tile[1] + (c.tile[1] // dy_group if dy_group else 0))
    return filt + vectors * c.tile[2] * c.element_a.nbytes * c.stages  # a buffer per stage


def smem_bytes(c: KernelConfig) -> int:
    return _smem_bytes(c, *pad_groups(c))


def depthwise_name(c: KernelConfig) -> str:
    rows, cols, ch = c.tile
    parts = [
        "cb_dw", c.kind.value,
        f"{c.element_a.value}{c.element_b.value}_{c.element_out.value}_acc{c.element_acc.value}",
        f"t{rows}x{cols}x{ch}_v{c.align_a}_w{c.warps[0]}",
        f"{c.schedule}{c.stages}" + (f"pf{c.prefetch}" if c.prefetch else "") if is_rows(c) or is_cols(c) else
        ("l1" if not c.halo_smem else "smem" if c.stages == 1 else f"smem{c.stages}"),
        f"align{c.align_a}{c.align_b}{c.align_c}",
    ]
    if c.split_k_mode in (SplitKMode.PARALLEL, SplitKMode.CLUSTER):
        parts.append(f"splitk_{c.split_k_mode.value}")
    if c.activation is not Activation.IDENTITY:
        parts.append(c.activation.value)
    if c.element_bias is not None:
        parts.append(f"vbias{c.element_bias.value}")
    if c.filter_rs:
        parts.append(f"f{c.filter_rs[0]}x{c.filter_rs[1]}")
    if c.conv_stride:
        parts.append(f"u{c.conv_stride[0]}x{c.conv_stride[1]}")
    if c.min_blocks:
        parts.append(f"mb{c.min_blocks}")
    parts.append(f"sm{c.arch}")
    return "_".join(parts)


# ---------------------------------------------------------------------------------------------- rules
def depthwise_static_error(c: KernelConfig) -> Optional[str]:
    """Why a DEPTHWISE_DIRECT config cannot be a kernel (called from KernelConfig.static_error)."""
    if c.filter_rs is None or len(c.filter_rs) != 2 or not all(1 <= v <= MAX_FILTER for v in c.filter_rs):
        return f"filter_rs: expected (R, S) with 1 <= R, S <= {MAX_FILTER}, got {c.filter_rs}"
    if c.conv_stride is None or len(c.conv_stride) != 2 or not all(1 <= v <= MAX_STRIDE for v in c.conv_stride):
        return f"conv_stride: expected (stride_h, stride_w) in 1..{MAX_STRIDE}, got {c.conv_stride}"
    if c.halo_smem is None:
        return "halo_smem: expected True or False for the depthwise family"
    if c.element_bias is not None:
        if c.kind is not ConvKind.FPROP:
            return f"element_bias: the bias-vector epilogue is fprop only, got {c.kind.value}"
        if c.align_c * c.element_bias.bits > 256:
            return f"element_bias: {c.align_c} x {c.element_bias.value} per bias access is over 32 bytes"
    if c.schedule not in (None, ROWS, TAPROWS, COLS):
        return (f"schedule: depthwise kernels take None (pixel tiles), {ROWS!r}, {TAPROWS!r} or {COLS!r} (wgrad "
                f"only), got {c.schedule!r}")
    if is_cols(c):
        if is_gathered(c) and (c.stages % c.conv_stride[0] or c.tile[1] % c.conv_stride[1]):
            return (f"tile {c.tile}, stages {c.stages}: a strided dgrad {COLS!r} strip is whole stride periods, its "
                    f"rows a multiple of {c.conv_stride[0]} and its columns of {c.conv_stride[1]}")
        if c.min_blocks is not None and c.prefetch is not None:
            return f"min_blocks, prefetch: a {COLS!r} kernel is register-capped or loads rows ahead, not both"
        if c.halo_smem:
            return f"halo_smem: the {COLS!r} schedule keeps its input rows in registers (halo_smem False)"
        if not 1 <= c.stages <= 16:
            return f"stages: a {COLS!r} strip has 1..16 rows (its row loop unrolls), got {c.stages}"
        if c.prefetch is not None and not 2 <= c.prefetch < c.stages:
            return (f"prefetch: None (one row ahead) or 2 .. {c.stages - 1} rows ahead within the strip's "
                    f"{c.stages} rows, got {c.prefetch}")
    elif c.prefetch is not None:
        return f"prefetch: the {COLS!r} schedule's (rows ahead of its row walk), None for the others"
    elif is_rows(c):
        if c.kind is not ConvKind.WGRAD and not (c.schedule == ROWS and runs_window_loop(c)):
            return (f"schedule {c.schedule!r}: wgrad, and for {ROWS!r} also fprop and stride-1 dgrad (strided dgrad "
                    f"gathers its taps)")
        if c.halo_smem:
            return f"halo_smem: the {c.schedule!r} schedule reads its input windows through L1 (halo_smem False)"
        if c.stages not in (1, 2, 4, 8):
            return f"stages: a {c.schedule!r} step takes 1, 2, 4 or 8 columns, got {c.stages}"
    elif c.stages != 1 and not (c.stages == 2 and c.halo_smem and (runs_window_loop(c) or c.kind is ConvKind.WGRAD)):
        return (f"stages: depthwise pixel-tile kernels take 1, or 2 (a pipelined halo) for fprop, stride-1 dgrad and "
                f"wgrad with halo_smem, got {c.stages}")
    if c.min_blocks is not None and not (2 <= c.min_blocks and c.min_blocks * c.threads <= MAX_SM_THREADS):
        return (f"min_blocks: None or 2 .. {MAX_SM_THREADS // c.threads} CTAs of {c.threads} threads per SM, "
                f"got {c.min_blocks}")
    if c.iterator.value != "analytic" or c.stride_support is not StrideSupport.UNITY or c.swizzle != 1:
        return "iterator/stride_support/swizzle: unused by the depthwise family, expected analytic/unity/1"
    if c.cluster != (1, 1, 1):
        return "cluster: a field of the sm90 families"
    vec = c.align_a
    for name, elem in (("align_a", c.element_a), ("align_b", c.element_b), ("align_c", c.element_kernel_out)):
        a = getattr(c, name)
        if a not in ALIGNMENTS or a * elem.bits > 128:
            return f"{name}: expected one of {ALIGNMENTS} within 128 bits of {elem.value}, got {a}"
    if c.kind is ConvKind.WGRAD:
        if c.split_k_mode not in (SplitKMode.PARALLEL, SplitKMode.CLUSTER):
            return ("split_k_mode: depthwise wgrad reduces its splits through fp32 partials (parallel) or in a "
                    "thread-block cluster (cluster)")
        if c.align_b > vec or c.align_c != 1:
            return f"alignments: depthwise wgrad reads x in chunks <= the vector ({vec}) and writes dw per element"
        if c.activation is not Activation.IDENTITY:
            return "activation: wgrad has no activation epilogue"
        if thread_taps(c) * vec > WGRAD_MAX_ACC:
            return (f"vector {vec}: a wgrad thread holds {thread_taps(c)} taps x vector = {thread_taps(c) * vec} fp32 "
                    f"accumulators, at most {WGRAD_MAX_ACC}")
    else:
        if c.split_k_mode is not SplitKMode.SERIAL:
            return f"split_k_mode: depthwise {c.kind.value} has no split (expected serial, meaning none)"
        if c.align_b != 1:
            return "align_b: the depthwise filter [C][R][S] is read per element (align_b 1)"
        if c.align_c > vec:
            return f"align_c: stores at most the vector width {vec}, got {c.align_c}"
        if c.kind is ConvKind.DGRAD and c.conv_stride != (1, 1) and c.halo_smem:
            return "halo_smem: strided dgrad gathers its valid taps from dy directly (no halo)"
        if c.kind is ConvKind.DGRAD and c.activation is not Activation.IDENTITY:
            return "activation: dgrad has no activation epilogue"
    rows, cols, ch = c.tile
    if min(rows, cols, ch) < 1 or ch % vec:
        return f"tile {c.tile}: expected positive rows, cols and channels a multiple of the vector {vec}"
    if c.warps[1:] != (1, 1) or not 1 <= c.warps[0] <= 32:
        return f"warps {c.warps}: expected (1..32, 1, 1)"
    if is_cols(c):
        if not 1 <= cols <= 8:
            return f"tile {c.tile}: a {COLS!r} strip has 1..8 columns, got {cols}"
        if rows * lanes(c) != c.threads:
            return f"tile {c.tile}: {rows} slots x {lanes(c)} channel vectors must be the CTA's {c.threads} threads"
        if lanes(c) % 32 and 32 % lanes(c):
            return f"tile {c.tile}: {lanes(c)} channel vectors must divide 32 or be a multiple of it (the CTA's sum)"
        if cols_registers(c) > COLS_MAX_REGS:
            return (f"tile {c.tile}: a thread would hold {cols_registers(c)} registers of sums, input rows and dy (at "
                    f"most {COLS_MAX_REGS}); fewer strip columns or a narrower vector")
        if smem_bytes(c) > SMEM_LIMIT:
            return f"{smem_bytes(c)} bytes of shared memory, past the {SMEM_LIMIT} of static shared memory"
        return None
    if is_rows(c):
        groups = row_groups(c)
        if groups * rows * lanes(c) != c.threads:
            return (f"tile {c.tile}: {groups} filter-row group(s) x {rows} segment threads x {lanes(c)} channel "
                    f"vectors must be the CTA's {c.threads} threads")
        if groups > 1 and (rows * lanes(c)) % 32:
            return (f"tile {c.tile}: {rows} segment threads x {lanes(c)} channel vectors must be a multiple of 32 "
                    f"(the threads of a warp share their filter row)")
        if cols % c.stages:
            return f"tile {c.tile}: segments of {cols} columns are not a multiple of the {c.stages} columns per step"
        if rows_registers(c) > ROWS_MAX_REGS:
            return (f"stages {c.stages}: a thread would hold {rows_registers(c)} registers of sums, dy and input "
                    f"window (at most {ROWS_MAX_REGS}); fewer columns per step or a narrower vector")
        if smem_bytes(c) > SMEM_LIMIT:
            return f"{smem_bytes(c)} bytes of shared memory, past the {SMEM_LIMIT} of static shared memory"
        return None
    groups = row_groups(c)
    if (rows * cols * lanes(c) * groups) % c.threads:
        return (f"tile {c.tile}: {rows * cols} pixels x {lanes(c)} channel vectors"
                f"{f' x {groups} filter rows' if groups > 1 else ''} do not divide over {c.threads} threads")
    if groups > 1 and (c.threads // groups) % 32:
        return (f"warps {c.warps}: each of the {groups} filter-row groups must be whole warps (the threads of a warp "
                f"share their filter row)")
    if c.threads % lanes(c) or cols % strip(c):
        return f"tile {c.tile}: a thread's strip of {strip(c)} columns must divide the {cols} columns"
    if strip(c) > 8:
        return f"tile {c.tile}: strips of {strip(c)} columns per thread, at most 8"
    if smem_bytes(c) > SMEM_LIMIT:
        return f"{smem_bytes(c)} bytes of shared memory, past the {SMEM_LIMIT} of static shared memory"
    return None


def depthwise_problem_error(problem: Conv2dProblem) -> Optional[str]:
    """Why no depthwise kernel computes `problem` whatever its config (naming the parameter), or None."""
    if not problem.is_depthwise:
        return f"groups: depthwise kernels need groups == C == K, got groups={problem.groups} C={problem.c} K={problem.k}"
    if problem.is_dilated:
        return f"dilation: depthwise kernels take dilation 1 only, got {problem.dilation_h}x{problem.dilation_w}"
    if max(problem.r, problem.s) > MAX_FILTER:
        return f"filter: depthwise kernels take R, S <= {MAX_FILTER}, got {problem.r}x{problem.s}"
    if max(problem.stride_h, problem.stride_w) > MAX_STRIDE:
        return f"stride: depthwise kernels take strides <= {MAX_STRIDE}, got {problem.stride_h}x{problem.stride_w}"
    if problem.int32_overflow:
        return f"size: {problem.int32_overflow}"
    if problem.epilogue.source is SourceKind.BIAS and problem.kind is not ConvKind.FPROP:
        return "source: only fprop broadcasts a bias"
    return None


def depthwise_reject_reason(c: KernelConfig, problem: Conv2dProblem) -> Optional[str]:
    """The per-problem rule of a depthwise config (kind, types and activation are checked by the caller)."""
    why = depthwise_problem_error(problem)
    if why:
        return why
    if c.filter_rs != (problem.r, problem.s):
        return f"filter: kernel is built for {c.filter_rs[0]}x{c.filter_rs[1]}, problem has {problem.r}x{problem.s}"
    if c.conv_stride != (problem.stride_h, problem.stride_w):
        return (f"stride: kernel is built for {c.conv_stride[0]}x{c.conv_stride[1]}, "
                f"problem has {problem.stride_h}x{problem.stride_w}")
    for name, a in (("A", c.align_a), ("B", c.align_b), ("output", c.align_c)):
        if problem.c % a:
            return f"alignment: {name}'s channel extent {problem.c} is not a multiple of the kernel's alignment {a}"
    return None


def _strip_grid(c: KernelConfig, problem: Conv2dProblem) -> tuple[int, int]:
    """The rows and columns of the pixel grid a config's work covers: dx for dgrad, else y / dy; a strided dgrad's
    "cols" strips are aligned to the stride, starting pad % stride rows / columns above / left of dx."""
    if c.kind is not ConvKind.DGRAD:
        return problem.p, problem.q
    if is_cols(c) and is_gathered(c):
        return problem.h + problem.pad_h % problem.stride_h, problem.w + problem.pad_w % problem.stride_w
    return problem.h, problem.w


def pixel_tiles(c: KernelConfig, problem: Conv2dProblem) -> int:
    """How many CTA pixel tiles cover the kernel's output (wgrad: dy), i.e. the most splits a wgrad can use. For the
    "rows" schedule: the dy row segments over the CTA's segment threads (each split has work for every thread); for
    "cols" its column strips likewise."""
    rows, cols, _ = c.tile
    ph, pw = _strip_grid(c, problem)
    if is_cols(c):  # the column strips over the CTA's slots
        return math.ceil(problem.n * math.ceil(ph / c.stages) * math.ceil(pw / cols) / rows)
    if is_rows(c):
        return math.ceil(problem.n * ph * math.ceil(pw / cols) / rows)
    return problem.n * math.ceil(ph / rows) * math.ceil(pw / cols)


# ---------------------------------------------------------------------------------------------- candidates
#: (rows, cols, channel vectors per CTA, warps): the CTA shapes proposed. A thread's strip is derived.
SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (4, 8, 8, 4),    # 32 pixels x 8 vectors, 128 threads: strips of 2
    (8, 8, 8, 4),    # 64 pixels x 8 vectors, 128 threads: strips of 4
    (4, 16, 4, 4),   # 64 pixels x 4 vectors, 128 threads: strips of 2 (few channels)
    (2, 8, 16, 4),   # 16 pixels x 16 vectors, 128 threads: strips of 2 (many channels)
    (4, 8, 16, 8),   # 32 pixels x 16 vectors, 256 threads: strips of 2
    (8, 16, 4, 4),   # 128 pixels x 4 vectors, 128 threads: strips of 4
    (1, 8, 16, 4),   # 8 pixels x 16 vectors, 128 threads: strips of 1 (7x7 images of many channels)
    (8, 16, 8, 4),   # 128 pixels x 8 vectors, 128 threads: strips of 8 (WIDE_STRIP)
    (8, 8, 16, 4),   # 64 pixels x 16 vectors, 128 threads: strips of 8
)
#: Strips of at least this many columns: each loaded input vector feeds that many outputs, so a thread converts
#: fewer inputs to fp32 per multiply-add. On the H200 a 5x5 stride-1 fprop with strips of 4 issued about 60
#: instructions per output element (25 of them multiply-adds, 10 conversions) at 25% occupancy: its SMs, not
#: DRAM, were the limit (ncu: 8% of DRAM bandwidth, 50% of SM throughput). The model ranks by memory traffic, in which
#: the strip does not appear, so the planner gives these their own share of the budget (profiler.plan).
WIDE_STRIP = 8

#: The "rows" wgrad schedule's CTA shapes: (segment threads, segment columns, channel vectors per CTA, warps), with
#: segment threads x channel vectors = the CTA's threads; and the columns per step tried with each.
ROWS_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (32, 16, 4, 4),   # 4 vectors (32 channels at 8), 32 segments at a time: few channels
    (16, 16, 8, 4),   # 8 vectors
    (8, 16, 16, 4),   # 16 vectors (128 channels at 8)
    (4, 16, 32, 4),   # 32 vectors: many channels, small images
    (16, 16, 16, 8),  # 16 vectors, 256 threads
)
ROWS_STEPS = (4, 2)
#: The "rows" schedule of fprop and stride-1 dgrad: (segment threads, segment columns, channel vectors, warps); each
#: thread computes one output row segment, the CTA's segments consecutive along the rows.
FPROP_ROWS_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (8, 16, 16, 4),   # 16 vectors (128 channels at 8)
    (16, 16, 8, 4),
    (32, 8, 4, 4),    # few channels: short segments, many of them
    (4, 16, 32, 4),   # many channels, small images
)
#: The "taprows" schedule's shapes: (segment threads, segment columns, channel vectors per CTA); the CTA has R times
#: segment threads x channel vectors threads (warps derived); each filter-row group fills one or two warps.
TAPROWS_SHAPES: tuple[tuple[int, int, int], ...] = (
    (8, 16, 4),    # 32 threads per filter row: few channels
    (4, 16, 8),
    (2, 16, 16),   # many channels, small images
    (8, 16, 8),    # 64 threads per filter row
)

#: The pipelined wgrad's tiles: (rows, cols, channel vectors, strip) of dy per CTA step, each thread a strip of
#: `strip` columns of one tile row for one filter row; the CTA is R x rows x cols / strip x vectors threads (warps
#: derived, `_pipelined_wgrad_shapes`), each filter-row group one to four warps.
PIPELINED_WGRAD_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (8, 16, 4, 4),   # 128 threads per filter row
    (4, 16, 4, 4),   # 64
    (4, 16, 8, 4),   # 128, more channels
    (2, 16, 8, 4),   # 64, small images
    (4, 8, 8, 4),    # 64, 14x14 and smaller images
    (2, 8, 16, 4),   # 64, many channels, 7x7 images
    (4, 16, 4, 2),   # 128, strips of 2
)


#: The "cols" schedule's CTA shapes: (slots, strip columns, channel vectors per CTA, warps), slots x channel
#: vectors = the CTA's threads; neighbouring slots walk neighbouring strips. 4 channel vectors at vector 4 are 16
#: channels, which divide every MobileNetV2 / EfficientNet-B0 depthwise layer's C (144, 240, 672, ...).
COLS_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (32, 2, 4, 4),    # 128 threads, 4 vectors
    (16, 2, 8, 4),    # 128 threads, 8 vectors
    (64, 2, 4, 8),    # 256 threads, 4 vectors
    (32, 4, 4, 4),    # strips of 4 columns (narrow vectors)
    (8, 2, 16, 4),    # many channels, small images
    (32, 1, 4, 4),    # strips of 1 column: 5x5 stride 2 (its 2-column input rows take too many registers)
    (64, 1, 4, 8),
)
#: The strips' rows tried (the row loop unrolls over them), each where it leaves at most COLS_IDLE of the pixel grid's
#: rows idle past the image's bottom edge (7 divides every MobileNetV2 / EfficientNet-B0 layer's P).
COLS_RUNS = (7, 8, 14, 4)
COLS_IDLE = 0.15


def _cols_runs(problem: Conv2dProblem, multiple: int = 1) -> list[int]:
    """COLS_RUNS (those a multiple of `multiple`: a strided dgrad's stride) within COLS_IDLE of the rows of the
    problem's pixel grid (dgrad: dx; else y / dy), or else the one leaving the fewest rows idle; none where no run is
    such a multiple (stride 3)."""
    height = problem.h if problem.kind is ConvKind.DGRAD else problem.p
    if multiple > 1:  # a stride-aligned strip starts pad % stride rows above dx
        height += problem.pad_h % multiple
    options = [run for run in COLS_RUNS if run % multiple == 0]
    if not options:
        return []

    def rows(run):
        return math.ceil(height / run) * run
    runs = [run for run in options if rows(run) <= (1 + COLS_IDLE) * height]
    return runs or [min(options, key=lambda run: (rows(run), -run))]


def _pipelined_wgrad_shapes(problem: Conv2dProblem) -> tuple[tuple[int, int, int, int], ...]:
    """PIPELINED_WGRAD_SHAPES as (rows, cols, channel vectors, warps) for the problem's R filter-row groups."""
    out = []
    for rows, cols, nvec, strip_cols in PIPELINED_WGRAD_SHAPES:
        threads = problem.r * rows * (cols // strip_cols) * nvec
        if threads <= 1024 and threads % 32 == 0:
            out.append((rows, cols, nvec, threads // 32))
    return tuple(out)


def _exact_channel_shapes(problem: Conv2dProblem, vec: int) -> tuple[tuple[int, int, int, int], ...]:
    """fprop/dgrad CTA shapes whose channel tile divides C exactly where no power-of-two tile does (C=144 at vector 8:
    18 vectors, which tiles of 4/8/16 vectors cover with 11% idle threads): a channel tile of C / blocks vectors for
    1-4 blocks, not a power of two, the one nearest 8 vectors; the CTA the smallest multiple of both the channel
    vectors and 32 threads that is at least 128, each thread a strip of 2 columns."""
    total = problem.c // vec
    opts = []
    for blocks in range(1, 5):
        nvec = total // blocks
        if total % blocks or not 3 <= nvec <= 32 or nvec & (nvec - 1) == 0:
            continue
        threads = math.lcm(nvec, 32)
        while threads < 128:
            threads += math.lcm(nvec, 32)
        pixels = 2 * threads // nvec
        cols = 16 if pixels % 16 == 0 and pixels >= 32 else 8
        if threads > 1024 or pixels % cols:
            continue
        opts.append((abs(nvec - 8), (pixels // cols, cols, nvec, threads // 32)))
    return tuple(shape for _, shape in sorted(opts)[:1])


def _exact_channel_rows_shapes(problem: Conv2dProblem, vec: int) -> tuple[tuple[int, int, int, int], ...]:
    """The fprop "rows" twin of `_exact_channel_shapes`: the channel tile of the nearest-8 non-power-of-two vector
    count dividing C, segments of 16 columns, as many segment threads as make the CTA a multiple of 32 threads."""
    return tuple((warps * 32 // nvec, 16, nvec, warps) for _, _, nvec, warps in _exact_channel_shapes(problem, vec))


def _config(problem: Conv2dProblem, shape, vec: int, halo: bool, schedule: Optional[str] = None,
            stages: int = 1) -> KernelConfig:
    rows, cols, nvec, warps = shape
    p = problem
    wgrad = p.kind is ConvKind.WGRAD
    return KernelConfig(
        family=KernelFamily.DEPTHWISE_DIRECT, kind=p.kind,
        element_a=p.element_a, element_b=p.element_b, element_out=p.element_out, element_acc=p.element_acc,
        tile=(rows, cols, nvec * vec), warps=(warps, 1, 1), stages=stages, schedule=schedule,
        iterator=IteratorAlgorithm.ANALYTIC, stride_support=StrideSupport.UNITY,
        align_a=vec, align_b=vec if wgrad else 1,
        align_c=1 if wgrad else min(vec, max_alignment(p.c, p.element_out)),
        split_k_mode=SplitKMode.PARALLEL if wgrad else SplitKMode.SERIAL,
        activation=p.epilogue.activation,
        filter_rs=(p.r, p.s), conv_stride=(p.stride_h, p.stride_w), halo_smem=halo,
        # the bias-vector epilogue: a bias with a residual, or a bias typed unlike the output (fprop)
        element_bias=p.element_bias if p.epilogue.bias_vector else None,
    )


def _vectors(problem: Conv2dProblem, schedule: Optional[str] = None, tap_split: bool = False) -> list[int]:
    """Vector widths worth trying: the widest the channel count allows (and, for wgrad, the thread's fp32 sums: S taps
    where the filter rows split over threads, R*S otherwise), and half of it (more threads per CTA)."""
    widest = max_alignment(problem.c, problem.element_a)
    if problem.kind is ConvKind.WGRAD:
        taps = problem.s if schedule == TAPROWS or tap_split else problem.r * problem.s
        while widest > 1 and taps * widest > WGRAD_MAX_ACC:
            widest //= 2
    if schedule == COLS:  # the sums (or taps) and the input rows in fp32 (cols_registers): the widest that fits
        stride = (problem.stride_h, problem.stride_w)
        gathered = problem.kind is ConvKind.DGRAD and stride != (1, 1)  # (a stride-1 dgrad runs the fprop loop)
        rows, window = _cols_footprint(problem.r, problem.s, stride, 2, gathered)  # of a 2-column strip
        while widest > 1 and problem.r * problem.s * widest + rows * window * widest > COLS_MAX_REGS:
            widest //= 2
    return [widest] + ([widest // 2] if widest >= 4 else [])


def _schedule_variants(problem: Conv2dProblem):
    """(CTA shapes, (halo_smem, schedule, stages) choices) of each schedule the problem's kind has: the pixel tiles
    with and without halo staging (fprop and stride-1 dgrad also pipelined, and their "rows" schedule); for wgrad
    the "rows" and "taprows" schedules at each of their columns per step, and the pipelined tiles; for all three the
    "cols" schedule at each of its strip rows (strided dgrad: strips of whole stride periods). Shapes are (rows, cols,
    channel vectors, warps)."""
    window_loop = problem.kind is ConvKind.FPROP or (problem.kind is ConvKind.DGRAD and
                                                     (problem.stride_h, problem.stride_w) == (1, 1))
    yield SHAPES, [(halo, None, 1) for halo in (False, True)] + ([(True, None, 2)] if window_loop else [])
    if window_loop:
        yield FPROP_ROWS_SHAPES, [(False, ROWS, steps) for steps in ROWS_STEPS]
    if problem.kind is ConvKind.WGRAD:
        yield ROWS_SHAPES, [(False, ROWS, steps) for steps in ROWS_STEPS]
        shapes = tuple((seg, cols, nvec, problem.r * seg * nvec // 32) for seg, cols, nvec in TAPROWS_SHAPES
                       if problem.r * seg * nvec <= 1024)
        yield shapes, [(False, TAPROWS, steps) for steps in ROWS_STEPS]
        yield _pipelined_wgrad_shapes(problem), [(True, None, 2)]
    if window_loop or problem.kind is ConvKind.WGRAD:
        yield COLS_SHAPES, [(False, COLS, run) for run in _cols_runs(problem)]
    else:  # strided dgrad: strips of whole stride periods (none for a stride no strip width or row count divides)
        sh, sw = problem.stride_h, problem.stride_w
        shapes = tuple(shape for shape in COLS_SHAPES if shape[1] % sw == 0)
        runs = _cols_runs(problem, sh)
        if shapes and runs:
            yield shapes, [(False, COLS, run) for run in runs]


def depthwise_candidates(problem: Conv2dProblem) -> Iterator[KernelConfig]:
    """Every depthwise config that can implement `problem` (before compiling); nothing for other problems."""
    if depthwise_problem_error(problem) is not None:
        return
    seen = set()
    for shapes, choices in _schedule_variants(problem):
        _, first_schedule, first_stages = choices[0]
        # the pipelined wgrad (pixel tiles, stages 2) splits the filter rows over threads: S sums per thread
        tap_split = problem.kind is ConvKind.WGRAD and first_schedule is None and first_stages > 1
        for vec in _vectors(problem, first_schedule, tap_split):
            extra: tuple = ()  # the exact channel tiles of this vector width (wgrad's CTA sum needs 2^k vectors)
            if shapes is SHAPES and problem.kind is not ConvKind.WGRAD:
                extra = _exact_channel_shapes(problem, vec)
            elif shapes is FPROP_ROWS_SHAPES:
                extra = _exact_channel_rows_shapes(problem, vec)
            for shape in shapes + extra:
                if shape[2] * vec > max(problem.c, 4 * vec) * 2:
                    continue  # a channel tile more than twice C idles most of its threads
                for halo, schedule, stages in choices:
                    try:
                        cfg = _config(problem, shape, vec, halo, schedule, stages)
                    except ValueError:
                        continue  # e.g. a "rows" step needing too many registers for this filter and vector
                    if is_wide_strip(cfg) and not runs_window_loop(cfg):
                        continue  # wide strips save window loads, which wgrad and strided dgrad do not repeat
                    if cfg not in seen and cfg.reject_reason(problem) is None:
                        seen.add(cfg)
                        yield cfg
                        twins = [t for t in (min_blocks_variant(cfg),) if t is not None] + prefetch_variants(cfg)
                        # then the cluster-split twin of each (wgrad)
                        twins += [t for t in map(cluster_variant, [cfg, *twins]) if t is not None]
                        for twin in twins:
                            if twin not in seen:
                                seen.add(twin)
                                yield twin


def min_blocks_variant(c: KernelConfig) -> Optional[KernelConfig]:
    """`c` with its registers capped at MIN_BLOCKS_REGS[kind] (a "cols" fprop / dgrad kernel: COLS_CAPPED_REGS, its
    taps then read from shared memory): min_blocks = the CTAs of its threads that fit under that cap (at most the
    SM's threads allow). None where fewer than 2 fit, `c` is capped already or loads rows ahead (a prefetch twin)."""
    regs = COLS_CAPPED_REGS if is_cols(c) and c.kind is not ConvKind.WGRAD else MIN_BLOCKS_REGS[c.kind]
    blocks = min(SM_REGISTERS // (regs * c.threads), MAX_SM_THREADS // c.threads)
    if blocks < 2 or c.min_blocks is not None or c.prefetch is not None:
        return None
    return dataclasses.replace(c, min_blocks=blocks)  # 2 <= blocks <= 2048 / threads: always a valid config


def cluster_variant(c: KernelConfig) -> Optional[KernelConfig]:
    """The cluster-split twin of a wgrad config `c` (the same kernel with its splits reduced in one thread-block
    cluster, `SplitKMode.CLUSTER`), or None for fprop / dgrad and for a twin already."""
    if c.kind is not ConvKind.WGRAD or c.split_k_mode is not SplitKMode.PARALLEL:
        return None
    return dataclasses.replace(c, split_k_mode=SplitKMode.CLUSTER)


def is_cluster_split(c: KernelConfig) -> bool:
    return c.split_k_mode is SplitKMode.CLUSTER


def schedule_group(c: KernelConfig) -> str:
    """The schedule group of a depthwise config: "cluster" (a cluster-split wgrad), its schedule ("rows", "taprows",
    "cols"), or for the pixel-tile kernels how they read the halo: "smem2" (pipelined), "smem" (staged) or "l1"."""
    if is_cluster_split(c):
        return "cluster"
    if is_cols(c) or is_rows(c):
        return c.schedule
    if is_pipelined(c):
        return "smem2"
    return "smem" if c.halo_smem else "l1"


def prefetch_variant(c: KernelConfig, rows: int = PREFETCH_ROWS) -> Optional[KernelConfig]:
    """A "cols" config `c` issuing its loads `rows` rows ahead instead of one (more loads in flight per thread, more
    registers): None where `c` is another schedule, already has a prefetch or a register cap, its strips have too few
    rows, or the registers would pass COLS_MAX_REGS."""
    if not is_cols(c) or c.prefetch is not None or c.min_blocks is not None or c.stages <= rows:
        return None
    try:
        return dataclasses.replace(c, prefetch=rows)  # the config's rules check its registers
    except ValueError:
        return None


def prefetch_variants(c: KernelConfig) -> list[KernelConfig]:
    """The prefetch twins of a "cols" config `c` (`prefetch_variant`): PREFETCH_ROWS rows ahead, and the deepest
    prefetch past that the registers allow (at most the strip's rows - 1: then every load of the strip is issued before
    its first row's multiply-adds). A strip's rows are a chain of load latencies at one row ahead: on the H200 the
    1152-channel 7x7 fprop's one-column "cols7" kernel ran 22.0 us at one row ahead and 9.1 at two
    (benchmarks/h200/dw-defaults.json), so small images, whose threads have one strip each, may want them all. Timed
    beside the published winners (benchmarks/h200/dw-prefetch-twins.json) the deep twin was the fastest on 13 of the
    57 problems of the `depthwise` workload (4-10% on 7x7 and strided layers, where every row of a narrow strip went
    ahead) and up to 27% slower where a partly deeper prefetch of a wide strip cost occupancy: the profiler decides."""
    out = [t for t in (prefetch_variant(c),) if t is not None]
    for rows in range(c.stages - 1, PREFETCH_ROWS, -1):
        deep = prefetch_variant(c, rows)
        if deep is not None:
            out.append(deep)
            break
    return out


def split_candidates(problem: Conv2dProblem, c: KernelConfig, sms: int = H200_SMS) -> list[int]:
    """wgrad split counts worth trying: powers of two putting about 1, 2 and 4 waves of CTAs on the GPU, each split
    keeping at least 4 pixel tiles ("cols": also the counts filling whole waves; the planner times them all).
    Other kinds: [1]."""
    if c.kind is not ConvKind.WGRAD:
        return [1]
    tiles = pixel_tiles(c, problem)
    ctiles = math.ceil(problem.c / c.tile[2])
    if is_cluster_split(c):  # one cluster per channel block: the powers of two up to its size, each split with work
        return [1 << i for i in range(MAX_CLUSTER_SPLITS.bit_length()) if 1 << i <= max(1, tiles)]
    per_sm = 2  # resident CTAs per SM a wgrad CTA can count on (its R*S*vector accumulators take registers)
    rows = is_rows(c) or is_cols(c)
    out = []
    for waves in ((1, 2, 4, 8) if rows else (1, 2, 4)):
        want = max(1, waves * sms * per_sm // ctiles)
        s = 1 << max(0, math.floor(math.log2(want)))
        # pixel tiles: at least 4 per split; "rows": at least one segment per thread of every split
        s = max(1, min(s, tiles if rows else (tiles // 4 or 1)))
        if s not in out:
            out.append(s)
    if is_cols(c):
        # and the counts that fill exactly one or two waves at 1-4 resident CTAs per SM: a "cols" thread's strips are
        # few (one to a few per split), so a second wave of a few CTAs costs nearly a whole wave (on the H200 the
        # 144-channel 56x56 layer's 9 channel blocks x 32 splits were 288 CTAs where 264 fit)
        for waves in (1, 2):
            for resident in (1, 2, 3, 4):
                s = max(1, min(waves * sms * resident // ctiles, tiles))
                if s not in out:
                    out.append(s)
    return out


def estimate_us(problem: Conv2dProblem, launch: LaunchConfig, sms: int = H200_SMS) -> float:
    """A memory model: compulsory bytes plus what the config adds (idle channel lanes, halo re-reads, wgrad
    partials), at DRAM speed, with wave quantisation. It only ranks depthwise configs among themselves."""
    c = launch.kernel
    rows, cols, ch = c.tile
    waste = math.ceil(problem.c / ch) * ch / problem.c
    ph, pw = (problem.h, problem.w) if c.kind is ConvKind.DGRAD else (problem.p, problem.q)
    if is_cols(c):  # strips past the image's right and bottom edges (and a strided dgrad's above and left of it)
        gh, gw = _strip_grid(c, problem)
        idle = math.ceil(gw / cols) * cols / pw * math.ceil(gh / c.stages) * c.stages / ph
    elif is_rows(c):  # segments past the image's right edge
        idle = math.ceil(pw / cols) * cols / pw
    else:
        idle = math.ceil(ph / rows) * rows * math.ceil(pw / cols) * cols / (ph * pw)  # threads past the image's edge
    waste *= idle ** 0.5
    sh, sw = (1, 1) if is_flipped(c) else c.conv_stride
    if is_cols(c) and is_gathered(c):  # a strip's dy rows and columns over those its dx rows and columns own
        dy_rows = (c.filter_rs[0] - 1) // sh + (c.stages - 1) // sh + 1
        reread = dy_rows / (c.stages / sh) * cols_window(c) / (cols / sw)
    elif is_cols(c):  # a strip reads its input rows once, its window's overlap with the next strip's from L1
        reread = ((c.stages - 1) * sh + c.filter_rs[0]) / (c.stages * sh) * cols_window(c) / (cols * sw)
    elif is_rows(c):  # each segment reads R input rows of its window: from L2 after the first
        reread = c.filter_rs[0] / sh * rows_window(c) / (c.stages * sw)
    else:
        hh, ww = halo_shape(c)
        reread = hh * ww / (rows * cols * sh * sw)  # input read per CTA over the input its tile owns
    in_bytes = math.prod(problem.a_shape if c.kind is not ConvKind.WGRAD else problem.b_shape) * problem.element_a.nbytes
    bytes_ = problem.bytes_moved + in_bytes * (reread - 1) * (0.15 if c.halo_smem else 0.3)
    bytes_ *= waste
    extra = 0.0
    if c.kind is ConvKind.WGRAD and not is_cluster_split(c):  # the partials, and the reduction kernel's launch
        bytes_ += 2 * launch.split_k_slices * problem.c * problem.r * problem.s * 4
        extra += LAUNCH_US
    ctas = pixel_tiles(c, problem) * math.ceil(problem.c / ch) if c.kind is not ConvKind.WGRAD else \
        launch.split_k_slices * math.ceil(problem.c / ch)
    smem_fit = SMEM_LIMIT * 4 // max(1, smem_bytes(c))  # CTAs an SM's shared memory holds
    per_sm = max(1, min(MAX_SM_THREADS // c.threads, smem_fit))
    if is_rows(c):
        per_sm = max(1, min(per_sm, SM_REGISTERS // ((rows_registers(c) + 24) * c.threads)))
    elif is_cols(c):
        per_sm = max(1, min(per_sm, SM_REGISTERS // ((cols_registers(c) + 24) * c.threads)))
    if c.min_blocks:  # the compiler fits at least this many
        per_sm = max(per_sm, min(c.min_blocks, smem_fit))
    waves = ctas / (sms * per_sm)
    fill = waves / math.ceil(waves) if waves < 4 and not is_pipelined(c) else min(1.0, waves)  # resident CTAs: no tail
    eff = min(1.0, (c.align_a * c.element_a.nbytes / 16) ** 0.5) * max(0.25, fill)
    penalty = MIN_BLOCKS_PENALTY if c.min_blocks else 1.0
    return (bytes_ / (DRAM_GBS * 1e9 * eff) * 1e6 + LAUNCH_US + extra) * penalty


def calibration_group(c: KernelConfig) -> str:
    """The DW_CALIBRATION group of a config: its `schedule_group`, with the "cols" kernels whose strips are one column
    wide and load one row ahead apart ("cols1"): on the H200 those fprop / dgrad kernels ran 2-4x slower than their
    prefetch twins (MobileNetV2's 576-channel stride-2 fprop: 25.6 against 9.0 us), which the model does not see."""
    g = schedule_group(c)
    return "cols1" if g == COLS and c.tile[1] == 1 and not c.prefetch else g


def pass_class(problem: Conv2dProblem) -> str:
    """The DW_CALIBRATION pass class of a problem: its kind and whether it is strided ("fprop_s1", "wgrad_s2", ...)."""
    return f"{problem.kind.value}_s{1 if (problem.stride_h, problem.stride_w) == (1, 1) else 2}"


#: Measured over modelled time (`estimate_us`) by calibration group and pass class: the geometric mean over the
#: launches `scripts/depthwise_defaults.py` timed on the H200 (2026-12-03, benchmarks/h200/dw-defaults.json: 474
#: launches over the 57 problems of the `depthwise` workload, batch 32; each problem's untuned default, the model's
#: best of each schedule group, its three best "cols" launches and the tuned winner of the published bench). Groups
#: of fewer than 3 launches take their group's factor over every class. The model's memory traffic misses what sets
#: these kernels apart (load latency at their occupancy, the staging's index arithmetic), so its ranking across
#: schedules was wrong: the untuned defaults (no "cols" kernel, never a pipelined wgrad) summed to 1536 us on those
#: problems, cuDNN to 1542, the best launch timed to 1011; the calibrated choice over every schedule, 1231.
#: Not the cluster-split wgrads: their time ranged from 0.6x to 82x the model's (a few splits per channel block can
#: leave most SMs idle), so they are left to the profiler.
DW_CALIBRATION: dict[tuple[str, str], float] = {
    ("cols", "dgrad_s1"): 1.21,  # 42
    ("cols", "dgrad_s2"): 1.28,  # 26
    ("cols", "fprop_s1"): 1.21,  # 43
    ("cols", "fprop_s2"): 1.14,  # 18
    ("cols", "wgrad_s1"): 1.26,  # 44
    ("cols", "wgrad_s2"): 1.32,  # 14
    ("cols1", "dgrad_s1"): 3.08,  # 3
    ("cols1", "fprop_s1"): 3.09,  # 3
    ("cols1", "fprop_s2"): 3.99,  # 7
    ("cols1", "wgrad_s1"): 2.19,  # 2 (pooled: the group's 24)
    ("cols1", "wgrad_s2"): 1.22,  # 9
    ("l1", "dgrad_s1"): 2.26,  # 12
    ("l1", "dgrad_s2"): 3.03,  # 9
    ("l1", "fprop_s1"): 2.26,  # 12
    ("l1", "fprop_s2"): 1.82,  # 7
    ("l1", "wgrad_s1"): 2.29,  # 12
    ("l1", "wgrad_s2"): 2.61,  # 7
    ("rows", "dgrad_s1"): 1.60,  # 12
    ("rows", "fprop_s1"): 1.60,  # 12
    ("rows", "fprop_s2"): 1.74,  # 7
    ("rows", "wgrad_s1"): 1.64,  # 12
    ("rows", "wgrad_s2"): 1.37,  # 7
    ("smem", "dgrad_s1"): 2.52,  # 12
    ("smem", "fprop_s1"): 2.52,  # 12
    ("smem", "fprop_s2"): 1.54,  # 9
    ("smem", "wgrad_s1"): 1.87,  # 12
    ("smem", "wgrad_s2"): 1.29,  # 7
    ("smem2", "dgrad_s1"): 2.33,  # 16
    ("smem2", "fprop_s1"): 2.33,  # 16
    ("smem2", "fprop_s2"): 1.66,  # 8
    ("smem2", "wgrad_s1"): 3.37,  # 12
    ("smem2", "wgrad_s2"): 2.23,  # 7
    ("taprows", "wgrad_s1"): 1.74,  # 13
    ("taprows", "wgrad_s2"): 1.28,  # 11
}
#: Each group's factor over every pass class: for a pair DW_CALIBRATION does not list.
DW_GROUP_CALIBRATION: dict[str, float] = {
    "cols": 1.23,  # 187
    "cols1": 2.19,  # 24
    "l1": 2.35,  # 59
    "rows": 1.59,  # 50
    "smem": 1.97,  # 52
    "smem2": 2.38,  # 59
    "taprows": 1.51,  # 24
}


def calibrated_estimate_us(problem: Conv2dProblem, launch: LaunchConfig, sms: int = H200_SMS) -> float:
    """`estimate_us` times DW_CALIBRATION's factor for the launch's group and the problem's pass class (for a pair it
    does not list, DW_GROUP_CALIBRATION's for the group): what the untuned default ranks depthwise launches by."""
    group = calibration_group(launch.kernel)
    factor = DW_CALIBRATION.get((group, pass_class(problem)), DW_GROUP_CALIBRATION.get(group, 1.0))
    return estimate_us(problem, launch, sms) * factor


#: The range DW_CALIBRATION was measured on: filters up to 5x5 (the `depthwise` workload has no larger one) and, of
#: the "cols" kernels, vectors of 2 or more channels (its 5x5 "cols" kernels are at vector 2, the 3x3 ones at 4).
CALIBRATED_MAX_FILTER = 5
CALIBRATED_MIN_COLS_VECTOR = 2


def default_depthwise_launch(problem: Conv2dProblem, sms: int = H200_SMS) -> Optional[LaunchConfig]:
    """The best depthwise launch for `problem`, or None if no depthwise kernel computes it. Within the calibration's
    range (filters up to CALIBRATED_MAX_FILTER) by the calibrated model (`calibrated_estimate_us`) over every schedule
    but the cluster split, the "cols" kernels narrower than CALIBRATED_MIN_COLS_VECTOR and those loading more than
    PREFETCH_ROWS rows ahead, none of which were measured.
    Past it (ConvNeXt's 7x7) by the model alone, as before the calibration: not a "cols" kernel, a pipelined wgrad nor
    a cluster split, which the model cannot rank (its memory traffic misses their register-bound occupancy, the
    staging's cost, the idle SMs of a few splits per channel block)."""
    calibrated = max(problem.r, problem.s) <= CALIBRATED_MAX_FILTER
    best = None
    for cfg in depthwise_candidates(problem):
        if is_cluster_split(cfg):
            continue
        if calibrated and is_cols(cfg) and cfg.align_a < CALIBRATED_MIN_COLS_VECTOR:
            continue
        if cfg.prefetch and cfg.prefetch > PREFETCH_ROWS:  # the deep prefetch twins: not in the calibration's data
            continue
        if not calibrated and (is_cols(cfg) or is_pipelined_wgrad(cfg)):
            continue
        for s in split_candidates(problem, cfg, sms):
            launch = LaunchConfig(cfg, s)
            if launch.reject_reason(problem) is not None:
                continue
            us = calibrated_estimate_us(problem, launch, sms) if calibrated else estimate_us(problem, launch, sms)
            key = (round(us, 1), cfg.halo_smem, launch.name)
            if best is None or key < best[0]:
                best = (key, launch)
    return best[1] if best else None


def with_alignments(c: KernelConfig, align_a: int, align_b: int, align_c: int) -> KernelConfig:
    """This depthwise kernel for operands whose addresses allow only narrower accesses (a vector no wider than A's
    alignment; the CTA keeps its number of channel vectors)."""
    vec = min(c.align_a, align_a)
    nvec = lanes(c)
    wgrad = c.kind is ConvKind.WGRAD
    return dataclasses.replace(
        c, align_a=vec, tile=(c.tile[0], c.tile[1], nvec * vec),
        align_b=min(align_b, vec) if wgrad else 1, align_c=1 if wgrad else min(align_c, vec),
    )
