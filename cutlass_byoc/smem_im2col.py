"""The shared-memory im2col family: fprop of convs with few input channels (the RGB stem, C=3 7x7 stride 2) on the
project's own kernel (templates/conv2d_smem_im2col.cu.j2), fp16/bf16 NHWC in, fp32 accumulation on mma.sync.

The implicit-GEMM families read such inputs two bytes at a time (CUTLASS's few_channels iterator) or zero-padded to
4 or 8 channels (fixed_channels, or 16-byte TMA rows after `ops` pads C): on the H200 their best stem fprop ran
137 us, at ~55 TFLOP/s of the conv's 7.5 GFLOP, against cuDNN's dedicated first-layer kernel at 89 us (issue 11).
Their per-access address arithmetic and the padded reduction (196 or 392 taps for 147) bound them. Here a CTA
stages the input patch of a tile of output pixels in shared memory once (zeros outside the image), and its filter
tile [k][R*S*C] once for all its tiles; the im2col row of a pixel is read from the patch through a table of tap
offsets (the S*C taps of one filter row are contiguous in a patch row), so the reduction is R*S*C rounded up to 16.

A config (a `KernelConfig` of family SMEM_IM2COL) fixes:

=========  ================================================================================================
field      meaning
=========  ================================================================================================
tile       (rows, cols, channels): the tile of output pixels (rows x cols, the GEMM's M) x output channels
warps      (warps along M, warps along N, 1)
align_c    elements per access of the output and the epilogue source (8 for 16-bit K % 8 == 0, down to 1)
=========  ================================================================================================

x and w are read per element (align_a = align_b = 1): any C, any filter, stride, padding and dilation, chosen at
launch (R*S*C at most MAX_TAPS). fprop with the conv families' epilogues (bias or residual as the source, the
activations but ReLU6, any output type); no bias-vector epilogue, no split.

dgrad of a stride-1 conv whose dy rows are not 16-byte multiples (the odd 7->33 layer's K=33) is the same kernel on
`gathered(problem)`: the fprop of dy with the filter rotated 180 degrees and K and C swapped (gathered per element
when a CTA stages its filter tile), padding dilation * (R - 1) - pad, written to dx; a residual source, no bias.

wgrad of such a conv (the stem's: C=3, K=64) is the template's second kernel: the GEMM dw[k, t] = sum_pixel dy[pixel,
k] * x_patch[pixel, t], whose reduction runs over the output pixels. A CTA walks pixel tiles as the fprop does,
copying each tile's dy rows (16-byte cp.async: K a multiple of 8) and input patch into shared memory; dy is read once
(the 3.x wgrad on the stem's space-to-depth fold streamed it once per filter tap: 120 us at batch 32 on the H100,
against ~18 us of compulsory traffic). Its fp32 sums stay in registers for all its tiles and go to one slice of an
fp32 workspace; a second kernel adds the slices in order (deterministic) into dw in any output type. For wgrad the
config's warps are (along channels, along taps, along the tile's pixels), each warp holding N_TILES n8 tiles of taps,
align_a = 8 (dy's copies), align_b = align_c = 1; no epilogue (alpha only), no activation.

Each config has a prefetch twin (`prefetch_twin`, KernelConfig.prefetch: the next tile's patch loaded into registers
during the current tile's arithmetic). Timed beside every plain kernel on an H100 (2026-12-06: the stem's fprop and
wgrad at batch 32 and 64, the odd 7->33 layer's fprop and dgrad), no twin was any problem's fastest: 1-20% slower
than its plain kernel, the best twin 0.8-6.5 us behind the winner. So the planner and the untuned default no longer
take them (`smem_im2col_candidates(..., twins=False)`); `twins=True` still yields them, for the tests.

Each config also has a pairs twin (`pairs_twin`, KernelConfig.pairs), for the problems it takes (`pairs_error`), which
halves the gathered shared-memory loads, the kernels' most frequent instructions (ncu: instruction issue and latency
bound):
- fprop (and dgrad as an fprop): an A fragment register is two consecutive taps of one pixel. Each filter row's S*C
  taps are padded to an even count (a zero filter column after an odd row: the stem's 7 x 21 taps become 7 x 22 = 154,
  still 10 k-steps) and each patch row to an even length, so with dilation_w 1 and stride_w * C even (a pixel's
  window corner is then an even element) the pair is one aligned 4-byte load, ANDed with a mask that zeroes the
  padding tap (whatever the patch holds there: an Inf must not meet the zero filter column).
- wgrad: a B fragment register is two consecutive pixels (2t, 2t+1) of one tap. The patch is staged as 32-bit words,
  element e beside element e + stride_w * C (the next pixel's element at the same tap), so it is one 4-byte load from
  the even pixel's corner; Q must be even (a pair is inside the output or past it as a whole: past it, the corner is a
  zero window). The patch buffers double (the stem's: 2 x 16 KB).
The planner times each twin beside its plain kernel (profiler/plan.py). On the H100 every twin of the stem ran faster
than its plain kernel, 2-4% for the winning shapes (the README's family section has the numbers).

The wgrad kernels load a patch in 32-element pieces of the warp's rows, 16 a lane in flight across rows (the stem's
wgrad 8% faster than row by row); the fprop and dgrad kernels load it row by row, 4 a lane (the pieces made them up
to 30% slower on the H100: more address arithmetic per load, where the fprop is nearer its issue limit).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional

from .config import KernelConfig, LaunchConfig
from .problem import ALIGNMENTS, Conv2dProblem, max_alignment
from .types import Activation, ConvKind, DType, IteratorAlgorithm, KernelFamily, SourceKind, SplitKMode, StrideSupport

#: The most taps R*S*C a kernel reduces over (its filter tile, tile channels x this, stays in shared memory).
MAX_TAPS = 512
#: Channel counts this family is for: C whose rows are not 16-byte multiples (those the implicit-GEMM families read
#: whole, with their own iterators and TMA).
ROW_BYTES = 16
#: (rows, cols, channels, warps along M, warps along N): tiles of 64 to 256 output pixels x 16 to 64 channels (16 for
#: few output channels: the odd layer's dgrad writes C=7). Each warp
#: gathers its pixels' im2col rows (2-byte loads, the taps' offsets added per element) and reads the filter with
#: ldmatrix: a warp spanning all 64 channels (warps along N = 1) gathers each row once per CTA and issues the fewest
#: instructions per mma (ncu on the H200: the 4x2-warp 8x16x64 kernel issued 57M instructions for the stem, at 2.7
#: per cycle and SM, 93 us), at 32 or 64 fp32 sums per thread.
SHAPES: tuple[tuple[int, int, int, int, int], ...] = (
    (8, 16, 64, 8, 1),
    (16, 16, 64, 8, 1),
    (8, 16, 64, 4, 1),
    (16, 8, 64, 8, 1),
    (8, 8, 64, 4, 1),
    (8, 16, 64, 4, 2),
    (16, 16, 64, 4, 2),
    (8, 16, 32, 4, 1),
    (8, 16, 16, 8, 1),
    (16, 16, 16, 8, 1),
)
#: wgrad's (rows, cols, channels, warps along channels, along taps, along the tile's pixels): a warp holds N_TILES n8
#: tiles of taps, so a CTA covers warps-along-taps x 40 taps (160 for the stem's 147; the taps are covered by blocks of
#: that many) and all its channels, reading each gathered x element once.
WGRAD_SHAPES: tuple[tuple[int, int, int, int, int, int], ...] = (
    (8, 16, 64, 1, 4, 2),
    (16, 16, 64, 1, 4, 2),
    (8, 16, 64, 1, 4, 1),
    (16, 16, 64, 1, 4, 1),
    (8, 8, 64, 1, 4, 2),
    (8, 16, 64, 2, 4, 1),
    (8, 16, 64, 1, 2, 2),
    (8, 16, 32, 1, 4, 2),
)
#: n8 tiles of taps a wgrad warp holds sums for (kNTiles in the template).
N_TILES = 5
#: The most fp32 slices a wgrad launch writes (one per CTA along the pixels; the workspace does not depend on the
#: device: two CTAs on each of 132 SMs).
MAX_SLICES = 264
#: dy elements per copy (16 bytes of f16/bf16): wgrad takes K a multiple of this.
DY_VEC = 8
#: The most patch elements a wgrad thread loads ahead into registers (KernelConfig.prefetch, `prefetch_twin`).
MAX_PREFETCH = 16
#: Shared memory a CTA may have on sm_90 (opt-in).
SMEM_LIMIT = 227 * 1024
H200_SMS = 132
#: What the model assumes: warp instructions issued per cycle and SM (ncu, H200: 1.9-2.7 on the stem's kernels), the
#: SM clock, DRAM speed.
ISSUE_RATE = 2.0
CLOCK_GHZ = 1.75
DRAM_GBS = 3000.0
LAUNCH_US = 3.0
#: wgrad's issue-rate model (`_wgrad_estimate_us`) over its measured time: the kernel is latency-bound at its 8 warps
#: an SM (gathered LDS -> pack -> mma chains). Fitted to the plain configs of the stem's wgrad tuned on an H100 at
#: batch 32 and 64 (2026-12-06, benchmarks/h100/tune-model-b32-session36.json, -b64-: 82-156 us, measured / issue
#: model 3.0-4.1x; 2.5-3.3x for the 4-warp configs).
WGRAD_STALL = 3.0
#: The 8-warp wgrad configs (254 registers a thread, one CTA an SM, each barrier holding all its warps) over the
#: 4-warp ones of the same tile (two CTAs an SM), measured on the same tunes: 1.07-1.21x.
WGRAD_ONE_CTA = 1.15


def static_error(c: KernelConfig) -> Optional[str]:
    """Why an SMEM_IM2COL config cannot be a kernel (called from KernelConfig.static_error)."""
    if c.element_a.bits != 16:
        return f"element_a: the shared-memory im2col family is built for f16/bf16 inputs (mma.sync), got {c.element_a.value}"
    if c.element_acc is not DType.F32:
        return f"element_acc: the shared-memory im2col family accumulates in f32, got {c.element_acc.value}"
    if c.kind is ConvKind.WGRAD:
        return _wgrad_static_error(c)
    rows, cols, n = c.tile
    wm, wn, wk = c.warps
    if wk != 1 or wm < 1 or wn < 1 or (rows * cols) % (16 * wm) or n % (8 * wn):
        return f"tile {c.tile} / warps {c.warps}: each warp needs whole m16 x n8 tiles (warps (M, N, 1))"
    if (n // wn // 8) % 2:
        return f"tile {c.tile} / warps {c.warps}: a warp's channels must be an even number of n8 tiles (ldmatrix.x4 reads two)"
    if wm * wn > 8:
        return f"warps {c.warps}: at most 8 warps"
    if c.align_a != 1 or c.align_b != 1:
        return f"align_a, align_b: x and w are read per element, expected 1, got {c.align_a}, {c.align_b}"
    if c.align_c not in ALIGNMENTS or c.align_c * c.element_out.bits > 128 or n % c.align_c:
        return f"align_c: expected one of {ALIGNMENTS} within 128 bits of {c.element_out.value} dividing {n}, got {c.align_c}"
    if c.split_k_mode is not SplitKMode.SERIAL:
        return "split_k_mode: the shared-memory im2col kernel has no split"
    if c.activation is Activation.RELU6:
        return "activation relu6: only the depthwise family fuses the ReLU6 clamp"
    if c.element_bias is not None:
        return "element_bias: no bias-vector epilogue in the smem_im2col family (the bias is read as the source)"
    return _common_static_error(c)


def _common_static_error(c: KernelConfig) -> Optional[str]:
    """The rules every kind's config shares: one stage, the prefetch count, and the other families' fields left alone."""
    if c.pairs and c.prefetch is not None:
        return "pairs and prefetch: a pairs kernel stages its patch after the arithmetic (no prefetch twin)"
    if c.stages != 1:
        return f"stages: the shared-memory im2col kernel stages one patch per tile, expected 1, got {c.stages}"
    if c.prefetch is not None and not 1 <= c.prefetch <= MAX_PREFETCH:
        return f"prefetch: patch elements a thread loads ahead, 1 to {MAX_PREFETCH} (or None), got {c.prefetch}"
    if (c.schedule, c.cluster, c.filter_rs, c.conv_stride, c.halo_smem, c.min_blocks, c.lowering) != \
            (None, (1, 1, 1), None, None, None, None, None):
        return ("schedule, cluster, filter_rs, conv_stride, halo_smem, min_blocks and lowering are other families' "
                "fields")
    if (c.iterator, c.stride_support, c.swizzle) != (IteratorAlgorithm.OPTIMIZED, StrideSupport.UNITY, 1):
        return "iterator, stride_support and swizzle: the shared-memory im2col family has none (leave the defaults)"
    return None


def _wgrad_static_error(c: KernelConfig) -> Optional[str]:
    rows, cols, n = c.tile
    wm, wn, wr = c.warps
    if min(wm, wn, wr) < 1 or n % (16 * wm) or (rows * cols) % (16 * wr):
        return (f"tile {c.tile} / warps {c.warps}: wgrad's warps (along channels, taps, pixels) need whole m16 "
                "tiles of channels and whole k16 steps of pixels")
    if wm * wn * wr > 8:
        return f"warps {c.warps}: at most 8 warps"
    if (c.align_a, c.align_b, c.align_c) != (DY_VEC, 1, 1):
        return (f"align_a, align_b, align_c: wgrad copies dy {DY_VEC} elements at a time and reads x and writes dw per "
                f"element, expected ({DY_VEC}, 1, 1), got ({c.align_a}, {c.align_b}, {c.align_c})")
    if c.split_k_mode is not SplitKMode.SERIAL:
        return "split_k_mode: the shared-memory im2col wgrad splits the pixels by itself (leave SERIAL)"
    if c.activation is not Activation.IDENTITY:
        return f"activation: wgrad has no epilogue, got {c.activation.value}"
    if c.element_bias is not None:
        return "element_bias: wgrad has no epilogue"
    return _common_static_error(c)


def prefetch_twin(c: KernelConfig, p: Conv2dProblem) -> Optional[KernelConfig]:
    """`c` with the next tile's patch loaded into registers before a tile's arithmetic (KernelConfig.prefetch: enough
    elements a thread for `p`'s whole patch, at most MAX_PREFETCH), or None where `c` has it already. Without it every
    warp loads the next patch after its share of the arithmetic and waits for it at the tile's end (the 8-warp wgrad
    kernels, one CTA per SM at 254 registers a thread, have no other CTA to run meanwhile; the fprop's 2-3 CTAs per SM
    hide part of it); with it the loads are in flight during the mma's, for up to MAX_PREFETCH more registers (the
    fprop's register cap counts them: fewer CTAs per SM). The model cannot tell which wins: the tuner times both."""
    if c.prefetch is not None:
        return None
    p = gathered(p)
    ph, pw = patch_dims(c, p)
    threads = c.warps[0] * c.warps[1] * c.warps[2] * 32
    return dataclasses.replace(c, prefetch=min(MAX_PREFETCH, -(-ph * pw * p.c // threads)))


def pairs_error(p: Conv2dProblem) -> Optional[str]:
    """Why no pairs kernel (of any shape) can compute `p` (None if one can): see the module's docstring."""
    if p.kind is ConvKind.WGRAD:
        if p.q % 2:
            return f"output width: Q={p.q} is odd (the pairs kernel reads x for pairs of output pixels)"
        return None
    g = gathered(p)
    if g.dilation_w != 1:
        return f"dilation: the pairs kernel reads taps in pairs and needs dilation_w 1, got {g.dilation_w}"
    if (g.stride_w * g.c) % 2:
        return (f"stride: stride_w * {'K' if p.kind is ConvKind.DGRAD else 'C'} = {g.stride_w * g.c} is odd (the "
                "pairs kernel reads taps in aligned pairs)")
    if g.r * row_taps(g) > MAX_TAPS:
        return f"filter: R x (S*C rounded up to even) = {g.r * row_taps(g)} taps, past the family's {MAX_TAPS}"
    return None


def row_taps(p: Conv2dProblem) -> int:
    """Taps of a filter row in a pairs fprop kernel: S*C rounded up to even (`p` as the kernel computes it)."""
    return -(-p.s * p.c // 2) * 2


def pairs_twin(c: KernelConfig, p: Conv2dProblem) -> Optional[KernelConfig]:
    """`c` with paired loads (KernelConfig.pairs), or None where `c` has them, has a prefetch twin's loads, or `p` is
    not a problem they take (`pairs_error`)."""
    if c.pairs or c.prefetch is not None or pairs_error(p) is not None:
        return None
    return dataclasses.replace(c, pairs=True)


def taps_per_cta(c: KernelConfig) -> int:
    """Taps a wgrad CTA holds sums for (warps along taps x N_TILES n8 tiles)."""
    return c.warps[1] * N_TILES * 8


def gathered(p: Conv2dProblem) -> Conv2dProblem:
    """The fprop the kernel computes for `p`: `p` itself, or for a stride-1 dgrad the fprop of dy (K channels in, C
    out) with padding dilation * (R - 1) - pad (problem_error refuses a dgrad whose padding is past that). A wgrad is
    itself too (its patches are x's, as the fprop's)."""
    if p.kind is not ConvKind.DGRAD:
        return p
    return p.replace(kind=ConvKind.FPROP, h=p.p, w=p.q, c=p.k, k=p.c,
                     pad_h=p.dilation_h * (p.r - 1) - p.pad_h, pad_w=p.dilation_w * (p.s - 1) - p.pad_w)


def patch_dims(c: KernelConfig, p: Conv2dProblem) -> tuple[int, int]:
    """Input rows and columns the patch of one tile spans (`p` as the kernel computes it: `gathered`)."""
    rows, cols, _ = c.tile
    return ((rows - 1) * p.stride_h + (p.r - 1) * p.dilation_h + 1,
            (cols - 1) * p.stride_w + (p.s - 1) * p.dilation_w + 1)


def smem_bytes(c: KernelConfig, p: Conv2dProblem) -> int:
    """The kernel's dynamic shared memory for `p` (templates/conv2d_smem_im2col.cu.j2, smem_layout)."""
    def r16(v: int) -> int:
        return -(-v // 16) * 16

    p = gathered(p)
    rows, cols, n = c.tile
    taps = p.r * p.s * p.c
    ph, pw = patch_dims(c, p)
    if c.kind is ConvKind.WGRAD:  # the template's wgrad smem_layout (pairs: 4-byte patch and zero-window words)
        dy = rows * cols * (n + 8) * 2
        sums = n * (taps_per_cta(c) + 4) * 4
        zero = ((p.r - 1) * p.dilation_h * pw + (p.s - 1) * p.dilation_w + 1) * p.c
        word = 4 if c.pairs else 2
        return r16(max(2 * dy, sums)) + 2 * r16(ph * pw * p.c * word) + 2 * r16(rows * cols * 4) + r16(zero * word)
    row = pw * p.c
    if c.pairs:  # filter rows of row_taps taps, patch rows rounded up to even
        taps, row = p.r * row_taps(p), -(-row // 2) * 2
    filt = r16(n * (r16(taps) + 8) * 2)
    table = r16(r16(taps) * 4)
    acc = rows * cols * (n + 4) * 4
    return filt + table + acc + 2 * r16(ph * row * 2)  # two patch buffers


def problem_error(p: Conv2dProblem) -> Optional[str]:
    """Why the family does not take `p` whatever the config (None if it does)."""
    if p.kind is ConvKind.WGRAD:
        if p.k % DY_VEC:
            return f"channels: wgrad copies dy {DY_VEC} channels at a time, K={p.k} is not a multiple"
        if p.epilogue.source is not SourceKind.NONE or p.epilogue.activation is not Activation.IDENTITY \
                or p.epilogue.bias_vector:
            return "epilogue: the shared-memory im2col wgrad has none (no source, no activation)"
    dgrad = p.kind is ConvKind.DGRAD
    if dgrad:
        if (p.stride_h, p.stride_w) != (1, 1):
            return f"stride: dgrad runs as the fprop of dy for stride 1 only, got {p.stride_h}x{p.stride_w}"
        if p.pad_h > p.dilation_h * (p.r - 1) or p.pad_w > p.dilation_w * (p.s - 1):
            return f"padding: {p.pad_h}x{p.pad_w} is past dilation * (R - 1), S - 1 (dgrad as an fprop of dy)"
        p = gathered(p)
    if p.groups != 1:
        return f"groups: the shared-memory im2col family needs groups == 1, got {p.groups}"
    if p.element_a.bits != 16:
        return f"element_a: the shared-memory im2col family takes f16/bf16 inputs, got {p.element_a.value}"
    if (p.c * p.element_a.nbytes) % ROW_BYTES == 0:
        return (f"channels: {'K' if dgrad else 'C'}={p.c} makes {ROW_BYTES}-byte rows, which the implicit-GEMM "
                "families read whole; this family is for fewer")
    if p.r * p.s * p.c > MAX_TAPS:
        return f"filter: R*S*C = {p.r * p.s * p.c}, past the family's {MAX_TAPS} taps"
    return None


def reject_reason(c: KernelConfig, p: Conv2dProblem) -> Optional[str]:
    """The per-problem rule of an SMEM_IM2COL config (kind, types, activation and groups are checked by the caller)."""
    why = problem_error(p)
    if why:
        return why
    if c.pairs:
        why = pairs_error(p)
        if why:
            return why
    out_channels = gathered(p).k
    if p.kind is not ConvKind.WGRAD and out_channels % c.align_c:
        return (f"alignment: the output's channel extent {out_channels} is not a multiple of the kernel's alignment "
                f"{c.align_c}")
    overflow = p.int32_overflow
    if overflow:
        return overflow
    need = smem_bytes(c, p)
    if need > SMEM_LIMIT:
        return f"shared memory: tile {c.tile} needs {need} bytes for this problem, past {SMEM_LIMIT}"
    return None


def name(c: KernelConfig) -> str:
    rows, cols, n = c.tile
    parts = [
        "cb_im2colsm", c.kind.value,
        f"{c.element_a.value}{c.element_b.value}_{c.element_out.value}_acc{c.element_acc.value}",
        f"t{rows}x{cols}x{n}_w{c.warps[0]}x{c.warps[1]}" + (f"x{c.warps[2]}" if c.kind is ConvKind.WGRAD else ""),
        f"align{c.align_a}{c.align_b}{c.align_c}",
    ]
    if c.prefetch:
        parts.append(f"pf{c.prefetch}")
    if c.pairs:
        parts.append("pair")
    if c.activation is not Activation.IDENTITY:
        parts.append(c.activation.value)
    parts.append(f"sm{c.arch}")
    return "_".join(parts)


def output_alignment(p: Conv2dProblem) -> int:
    """The widest output access the output's channels allow (K for fprop, C for dgrad; at most 16 bytes; wgrad
    writes dw per element)."""
    if p.kind is ConvKind.WGRAD:
        return 1
    return max_alignment(gathered(p).k, p.element_out)


def config(problem: Conv2dProblem, shape: Optional[tuple[int, ...]] = None, arch: int = 90) -> KernelConfig:
    """The config of `shape` (one of SHAPES, or of WGRAD_SHAPES for a wgrad; the first by default) for `problem`."""
    p = problem
    if p.kind is ConvKind.WGRAD:
        rows, cols, n, wm, wn, wr = shape or WGRAD_SHAPES[0]
        return KernelConfig(
            family=KernelFamily.SMEM_IM2COL, kind=p.kind, element_a=p.element_a, element_b=p.element_b,
            element_out=p.element_out, element_acc=p.element_acc, tile=(rows, cols, n), warps=(wm, wn, wr), stages=1,
            align_a=DY_VEC, align_b=1, align_c=1, arch=arch,
        )
    rows, cols, n, wm, wn = shape or SHAPES[0]
    return KernelConfig(
        family=KernelFamily.SMEM_IM2COL, kind=p.kind, element_a=p.element_a, element_b=p.element_b,
        element_out=p.element_out, element_acc=p.element_acc, tile=(rows, cols, n), warps=(wm, wn, 1), stages=1,
        align_a=1, align_b=1, align_c=min(output_alignment(p), n), activation=p.epilogue.activation, arch=arch,
    )


def smem_im2col_candidates(problem: Conv2dProblem, twins: bool = False) -> Iterator[KernelConfig]:
    """Every config of the family for `problem` (nothing where the family does not apply), each followed by its pairs
    twin where `problem` takes one (the planner times the twins of the kernels it takes beside them); with `twins`,
    also by its prefetch twin (measured slower everywhere it was timed: the module's docstring)."""
    if problem_error(problem) is not None or problem.epilogue.activation is Activation.RELU6 \
            or problem.epilogue.bias_vector or problem.element_acc is not DType.F32:
        return
    for shape in WGRAD_SHAPES if problem.kind is ConvKind.WGRAD else SHAPES:
        try:
            c = config(problem, shape)
        except ValueError:
            continue
        yield c
        pair = pairs_twin(c, problem)
        if pair is not None:
            yield pair
        twin = prefetch_twin(c, problem) if twins else None
        if twin is not None:
            yield twin


def estimate_us(problem: Conv2dProblem, launch: LaunchConfig, sms: int = H200_SMS) -> float:
    """The kernel's instructions at the issue rate ncu measured (the stem's kernels were instruction- and latency-bound
    on the H200, at 2-8% of DRAM bandwidth): per k-step and warp, 3 per gathered A element (8 per m16 tile), one
    ldmatrix per two n8 tiles and one mma per tile pair; ~80 per 8-channel output vector in the epilogue; ~20 per
    patch element (the halo counts); against the compulsory bytes at DRAM speed. It ranks the family's configs among
    themselves (measured: 8x16x64 with 4x2 warps 76 us, 16x16x64 with 8x1 warps 64 us, on the stem)."""
    if problem.kind is ConvKind.WGRAD:
        return _wgrad_estimate_us(problem, launch, sms)
    c, p = launch.kernel, gathered(problem)
    rows, cols, n = c.tile
    wm, wn, _ = c.warps
    mt, nt = rows * cols // wm // 16, n // wn // 8
    tiles = p.n * math.ceil(p.p / rows) * math.ceil(p.q / cols)
    kblocks = math.ceil(p.k / n)
    ksteps = math.ceil(p.r * (row_taps(p) if c.pairs else p.s * p.c) / 16)
    ph, pw = patch_dims(c, p)
    warp_tiles = tiles * kblocks * wm * wn
    # per m16 tile: 8 gathered loads, their 8 offset adds and 4 packs, about 24 with the rest; pairs: 4 loads, 4 adds
    # and 4 masks
    kloop = warp_tiles * ksteps * ((12 if c.pairs else 24) * mt + 2 * nt + mt * nt)
    epilogue = tiles * kblocks * rows * cols * (n // c.align_c) * 80 / 32
    patch = tiles * kblocks * ph * pw * p.c * 20 / 32
    compute_us = (kloop + epilogue + patch) / (sms * ISSUE_RATE * CLOCK_GHZ * 1e3)
    written = p.n * p.p * p.q * p.k * p.element_out.nbytes * (2 if p.epilogue.source.has_residual else 1)
    memory_us = (p.n * p.h * p.w * p.c * p.element_a.nbytes + written) / (DRAM_GBS * 1e9) * 1e6
    return max(memory_us, compute_us) + LAUNCH_US


def _wgrad_estimate_us(p: Conv2dProblem, launch: LaunchConfig, sms: int) -> float:
    """wgrad's instructions at the same issue rate: per k16 step and warp (of the warps with a tap under R*S*C), an
    ldmatrix per m16 tile, two corner loads and, per n8 tile of taps, 4 gathered loads, 3 to pack them and an mma per
    m16 tile; ~20 per patch element and 4 per 16-byte dy copy; against the compulsory bytes (dy and x once, the slices
    written and read back) at DRAM speed, plus the reduction's launch. The kernel is latency-bound, not issue-bound:
    the issue time is scaled by WGRAD_STALL and, for the one-CTA-an-SM configs, WGRAD_ONE_CTA (both measured on the
    H100). With them it ranks the stem's plain configs as measured at the top (t16x16x64 with 1x4x1 warps first at
    batch 32 and 64), within 0.85-1.16x of each one's time but for the 8x8 tile (1.5x)."""
    c = launch.kernel
    rows, cols, n = c.tile
    wm, wn, wr = c.warps
    taps = p.r * p.s * p.c
    mt = n // wm // 16
    tiles = p.n * math.ceil(p.p / rows) * math.ceil(p.q / cols)
    blocks = math.ceil(p.k / n) * math.ceil(taps / taps_per_cta(c))
    ksteps = rows * cols // 16 // wr
    ph, pw = patch_dims(c, p)
    live_warps = min(wn, math.ceil(min(taps, taps_per_cta(c)) / (N_TILES * 8)))
    # per n8 tile of taps: 4 gathered loads, 3 to pack them (pairs: 2 loads, 2 adds) and an mma per m16 tile; a pairs
    # patch element is two global loads
    kloop = tiles * blocks * wm * live_warps * wr * ksteps * (mt + 2 + N_TILES * ((4 if c.pairs else 7) + mt) + 4)
    copies = tiles * blocks * (ph * pw * p.c * (30 if c.pairs else 20) + rows * cols * n // DY_VEC * 4) / 32
    one_cta = wm * wn * wr > 4  # 254 registers a thread: one CTA an SM
    compute_us = (kloop + copies) / (sms * ISSUE_RATE * CLOCK_GHZ * 1e3) * WGRAD_STALL \
        * (WGRAD_ONE_CTA if one_cta else 1.0)
    slices = min(tiles, MAX_SLICES, sms * (1 if one_cta else 2))
    moved = (p.n * p.p * p.q * p.k + p.n * p.h * p.w * p.c) * p.element_a.nbytes + 2 * slices * p.k * taps * 4
    memory_us = moved / (DRAM_GBS * 1e9) * 1e6
    return max(memory_us, compute_us) + 2 * LAUNCH_US
