"""Kernel configurations: how a problem is computed. A config is frozen and hashable, names itself, and is
never parsed back from a name or a dict of strings.

`KernelConfig` is everything compiled into a kernel; one compiled kernel serves every problem it can
implement (its template parameters never depend on N, H, W or C). `LaunchConfig` adds what is chosen per
call: the split-k slice count, the channel padding (`pad_c`, `pad_k`: ops zero-pads C and K up to these
multiples, runs the kernel on the padded problem and copies the real channels out) and the space-to-depth
rewrite of a strided conv (`s2d`: ops folds stride x stride input pixels into channels and runs the kernel on
the equivalent stride-1 conv).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from .problem import ALIGNMENTS, Conv2dProblem
from .types import Activation, ConvKind, DType, IteratorAlgorithm, KernelFamily, MathOp, SourceKind, SplitKMode, StrideSupport

Shape3 = tuple[int, int, int]


def math_op_for(element: DType) -> MathOp:
    return {DType.F16: MathOp.F16, DType.BF16: MathOp.BF16, DType.F32: MathOp.TF32}[element]


def instruction_shape_for(math: MathOp) -> Shape3:
    return (16, 8, 8) if math is MathOp.TF32 else (16, 8, 16)


#: Fields left out of to_dict when None, so the JSON (and so the source and cache key) of the kernels that predate
#: them is unchanged: the depthwise family's own, the bias-vector epilogue's type, the GEMM family's lowering.
_OMITTED_WHEN_NONE = ("conv_stride", "halo_smem", "min_blocks", "prefetch", "element_bias", "lowering",
                      "channel_stats", "sourceless", "epi_tile", "epi_stages", "pairs")
#: The most pipeline stages the 3.x families' configs take (sm90, gemm1x1; StageCountAutoCarveout would give their
#: 64 x 64 tiles 11-13); a wgrad's kernels also come with their deep twin (sm90.deep_twin, gemm1x1.deep_twin), timed
#: beside them with up to DEEP_MAX_STAGES (the deepest pipeline nvjet's GEMM kernels run on these problems, by their
#: names).
MAX_STAGES = 8
DEEP_MAX_STAGES = 16
#: The widest tile a channel-statistics kernel takes (KernelConfig.channel_stats): 128 x 64 outputs. At 128 x 128 the
#: consumer warp group's 128 accumulators per thread and the two row reductions exceed its registers: ptxas put 688
#: bytes on the stack, and on the H200 the epilogue cost up to 3x the plain kernel.
_CHANNEL_STATS_TILE_MN = (128, 64)
_CHANNEL_STATS_MAX_OUTPUTS = _CHANNEL_STATS_TILE_MN[0] * _CHANNEL_STATS_TILE_MN[1]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    family: KernelFamily
    kind: ConvKind
    element_a: DType
    element_b: DType
    element_out: DType
    element_acc: DType
    tile: Shape3  # threadblock (CTA) tile M x N x K of the implicit GEMM
    warps: Shape3  # warps along M, N, K (2.x); for 3.x the warp-group layout is implied by the schedule
    stages: int
    iterator: IteratorAlgorithm = IteratorAlgorithm.OPTIMIZED
    stride_support: StrideSupport = StrideSupport.UNITY
    align_a: int = 8
    align_b: int = 8
    align_c: int = 8
    split_k_mode: SplitKMode = SplitKMode.SERIAL  # SERIAL with 1 slice at launch is the plain, unsplit kernel
    swizzle: int = 1  # log-tile of the threadblock swizzle: 1, 2, 4 or 8
    activation: Activation = Activation.IDENTITY
    arch: int = 90
    # CUTLASS 3.x only (families SM90_TMA_WGMMA and SM90_GEMM_1X1; for the latter the schedule names the kernel
    # schedule and tile scheduler: "cooperative", "cooperative_streamk" or "pingpong", see gemm1x1.SCHEDULES)
    cluster: Shape3 = (1, 1, 1)
    schedule: Optional[str] = None
    # direct depthwise only (family DEPTHWISE_DIRECT): filter size and stride fixed at compile time
    filter_rs: Optional[tuple[int, int]] = None
    # direct depthwise only (see cutlass_byoc/depthwise.py; None elsewhere and then left out of to_dict, so the other
    # families' sources and cache keys are unchanged): the compile-time stride, and whether a CTA stages its input
    # halo in shared memory instead of reading it through L1.
    conv_stride: Optional[tuple[int, int]] = None
    halo_smem: Optional[bool] = None
    # direct depthwise only: CTAs per SM the compiler must fit (__launch_bounds__' second argument), which caps each
    # thread's registers at 65536 / (min_blocks * threads); None leaves the registers to the compiler. Memory-bound
    # kernels whose windows and sums take 100-200 registers run at 12-25% occupancy without it.
    min_blocks: Optional[int] = None
    # direct depthwise "cols" schedule only: how many rows ahead of the one being summed a thread issues its loads
    # (None: one row; 2 or more hold that many rows of loads in flight, in registers). Memory-level parallelism against
    # occupancy: the profiler times both.
    prefetch: Optional[int] = None
    # The bias-vector epilogue (fprop): None for the plain kernels, which read a bias as C through a zero stride in the
    # output's type. Set, the kernel takes the bias as a separate vector of this type (CbConv2dArgs.bias, or .source
    # for source_kind 1) and an optional residual as C: D = act(alpha * acc + beta * residual + bias), all in fp32,
    # one rounding at the store. Serves SourceKind.BIAS_RESIDUAL and BIAS with a bias typed unlike the output.
    element_bias: Optional[DType] = None
    # The GEMM family's lowering of a conv that is not a 1x1 GEMM (family SM90_GEMM_1X1 only; None elsewhere and then
    # left out of to_dict, so every other kernel's source and cache key is unchanged). "im2col": a conv of few input
    # channels (the RGB stem) as one GEMM over an explicit im2col matrix in the workspace (fprop, wgrad), or as a GEMM
    # into fp32 columns that a col2im kernel sums into dx (dgrad); see gemm1x1.py. Filter size, stride, padding and
    # dilation stay launch arguments.
    lowering: Optional[str] = None
    # The channel-statistics epilogue (3.x conv fprop with the plain epilogue only; None elsewhere and then left out of
    # to_dict, so every other kernel's source and cache key is unchanged). True: besides D = round(acc) the kernel
    # writes, per output channel, the fp32 sum and sum of squares of the rounded D over every output pixel
    # (CbConv2dArgs.stats: 2 x K floats, sums then sums of squares): the statistics a training batch norm after the
    # conv reads the whole output once more to compute. Per warp by CUTLASS's Sm90RowReduction, then added with
    # atomicAdd into one of sm90.CHANNEL_STATS_SLOTS copies of the sums in the workspace, which a small kernel sums into
    # the buffer: the atomics' order, so the sums' last bits, varies between runs (fuse_bn_stats stays off under
    # torch.use_deterministic_algorithms).
    channel_stats: Optional[bool] = None
    # A 3.x TMA epilogue without a source (GEMM 1x1 and sm90 conv families; None elsewhere and then left out of
    # to_dict, so every other kernel's source and cache key is unchanged). True: CUTLASS's ElementC = void, for
    # problems whose epilogue has no bias or residual (gemm1x1_candidates proposes only these for such problems; the
    # sm90 conv candidates do not use it yet, scripts/sweep_kernels.py --sourceless times them): no C buffers in
    # shared memory, no C load in the epilogue, and each sub-tile's TMA store issued after the next sub-tile's
    # registers reach shared memory (CUTLASS delays the store only without C). On the H200 these ran 4% faster than
    # the same GEMM 1x1 kernels with a C (geomean of 42 pairs on ResNet-50's 1x1 cells, up to 12%;
    # benchmarks/h200/sweep-sourceless-session19.json).
    sourceless: Optional[bool] = None
    # The TMA epilogue's sub-tile (GEMM 1x1 family, not lowered; None elsewhere and then left out of to_dict, so every
    # other kernel's source and cache key is unchanged): (M, N) rows and columns of D that go through shared memory
    # and one TMA store at a time, instead of CUTLASS's EpilogueTileAuto (min(64, M) x min(32, N) for ping-pong,
    # min(128, M) x min(32, N) cooperative). CUTLASS takes M = 64 (ping-pong) or 128 (cooperative) only, so this
    # widens N: fewer, larger sub-tiles, fewer shared-memory round trips, barriers and TMA stores per CTA tile
    # (gemm1x1.epilogue_smem_bytes sizes its buffers). The candidates do not propose it (scripts/sweep_kernels.py
    # --tiles ...:eMxN times it): on the H200 it moved the 14 stride-1 1x1 fprop / dgrad cells by -2% to +5%, 1% in
    # geomean (benchmarks/h200/sweep-epi-session25.json).
    epi_tile: Optional[tuple[int, int]] = None
    # D's buffers in the TMA epilogue's shared memory, so the TMA stores a consumer has in flight (GEMM 1x1 family,
    # sourceless and not lowered; None elsewhere and then left out of to_dict): CUTLASS's builder gives StagesD =
    # min(sub-tiles, 2), so each sub-tile waits, before its registers go to shared memory, for the store before the
    # last to have been read out of it, several waits per CTA tile. With as many buffers as the tile has sub-tiles
    # (gemm1x1.epilogue_sub_tiles) a tile's stores go out back to back and only the next tile's epilogue waits; the
    # buffers count in the shared-memory bound (gemm1x1.epilogue_smem_bytes). For the memory-bound 1x1 convs, where
    # the ping-pong consumers take turns in the epilogue and the mainloop is one or a few k tiles, the epilogue sets
    # the pace. Sweep-only (scripts/sweep_kernels.py --tiles ...:sdN); not timed yet.
    epi_stages: Optional[int] = None
    # Paired loads of the gathered operand (shared-memory im2col family only; None elsewhere and then left out of
    # to_dict, so every other kernel's source and cache key is unchanged). True: fprop (and dgrad as an fprop) reads its
    # im2col rows two taps at a time, 4-byte shared-memory loads, with each filter row's S*C taps padded to an even
    # count (dilation_w 1 and stride_w * C even); wgrad stages each input patch element beside the one the next output
    # pixel reads (stride_w * C further), so one 4-byte load is a B fragment half of two pixels (Q even). Half the
    # gathered loads and no packing: see smem_im2col.py.
    pairs: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.element_bias is not None and not isinstance(self.element_bias, DType):
            object.__setattr__(self, "element_bias", DType(self.element_bias))
        err = self.static_error()
        if err:
            raise ValueError(f"invalid kernel config: {err}")

    # ------------------------------------------------------------------ derived
    @property
    def is_conv_pingpong(self) -> bool:
        """The 3.x conv family's persistent ping-pong kernel (sm90.PINGPONG), the project's own; the GEMM 1x1 family's
        "pingpong" schedule is CUTLASS's GEMM kernel."""
        return self.family is KernelFamily.SM90_TMA_WGMMA and self.schedule == "pingpong"

    @property
    def is_deep_twin(self) -> bool:
        """A 3.x kernel with more pipeline stages than its family's cap (MAX_STAGES): a deep twin."""
        return self.family in (KernelFamily.SM90_TMA_WGMMA, KernelFamily.SM90_GEMM_1X1) and self.stages > MAX_STAGES

    @property
    def is_strided_dgrad(self) -> bool:
        """A dgrad kernel for stride > 1 (stride_support STRIDED): 2.x's strided-dgrad iterators and swizzle; in the 3.x
        conv family the sub-pixel dgrad (the stride-1 kernel launched once per phase of dx, or the ping-pong kernel
        walking the phases' tiles in one launch)."""
        return self.kind is ConvKind.DGRAD and self.stride_support is StrideSupport.STRIDED

    @property
    def is_subpixel_dgrad(self) -> bool:
        """The 3.x conv family's sub-pixel strided dgrad (is_strided_dgrad in that family)."""
        return self.family is KernelFamily.SM90_TMA_WGMMA and self.is_strided_dgrad

    @property
    def math(self) -> MathOp:
        return math_op_for(self.element_a)

    @property
    def instruction(self) -> Shape3:
        return instruction_shape_for(self.math)

    @property
    def warp_tile(self) -> Shape3:
        return tuple(t // w for t, w in zip(self.tile, self.warps))  # type: ignore[return-value]

    @property
    def threads(self) -> int:
        return 32 * self.warps[0] * self.warps[1] * self.warps[2]

    @property
    def element_epilogue(self) -> DType:
        """Type of alpha, beta and the epilogue's arithmetic: the accumulator's."""
        return self.element_acc

    @property
    def element_kernel_out(self) -> DType:
        """What the implicit-GEMM kernel itself stores: fp32 sums for parallel and atomic split-k, else the output."""
        return self.element_acc if self.split_k_mode.fp32_sums else self.element_out

    @property
    def smem_bytes(self) -> int:
        m, n, k = self.tile
        return self.stages * (m * k * self.element_a.nbytes + n * k * self.element_b.nbytes)

    @property
    def name(self) -> str:
        if self.family is KernelFamily.DEPTHWISE_DIRECT:
            from .depthwise import depthwise_name  # noqa: PLC0415

            return depthwise_name(self)
        if self.family is KernelFamily.SMEM_IM2COL:
            from .smem_im2col import name  # noqa: PLC0415 - the family's rules live in its module

            return name(self)
        fam = {KernelFamily.SM80_IMPLICIT_GEMM: "sm80", KernelFamily.SM90_TMA_WGMMA: "sm90",
               KernelFamily.DEPTHWISE_DIRECT: "dw", KernelFamily.SM90_GEMM_1X1: "gemm1x1"}[self.family]
        parts = [
            f"cb_{fam}", self.kind.value,
            f"{self.element_a.value}{self.element_b.value}_{self.element_out.value}_acc{self.element_acc.value}",
            "x".join(map(str, self.tile)) + "_w" + "x".join(map(str, self.warps)) + f"_s{self.stages}",
            self.iterator.value, self.stride_support.value,
            f"align{self.align_a}{self.align_b}{self.align_c}",
        ]
        if self.split_k_mode.fp32_sums:
            parts.append(f"splitk_{self.split_k_mode.value}")
        if self.activation is not Activation.IDENTITY:
            parts.append(self.activation.value)
        if self.element_bias is not None:
            parts.append(f"vbias{self.element_bias.value}")
        parts.append(f"sw{self.swizzle}")
        if self.family in (KernelFamily.SM90_TMA_WGMMA, KernelFamily.SM90_GEMM_1X1):
            parts.append("c" + "x".join(map(str, self.cluster)) + (f"_{self.schedule}" if self.schedule else ""))
        if self.filter_rs:
            parts.append(f"f{self.filter_rs[0]}x{self.filter_rs[1]}")
        if self.lowering:
            parts.append(self.lowering)
        if self.channel_stats:
            parts.append("chstats")
        if self.sourceless:
            parts.append("nosrc")
        if self.epi_tile:
            parts.append("e" + "x".join(map(str, self.epi_tile)))
        if self.epi_stages:
            parts.append(f"sd{self.epi_stages}")
        parts.append(f"sm{self.arch}")
        return "_".join(parts)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for f in _OMITTED_WHEN_NONE:
            if d[f] is None:
                del d[f]
        return {k: (v.value if hasattr(v, "value") else (list(v) if isinstance(v, tuple) else v)) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "KernelConfig":
        enums = dict(family=KernelFamily, kind=ConvKind, element_a=DType, element_b=DType, element_out=DType,
                     element_acc=DType, iterator=IteratorAlgorithm, stride_support=StrideSupport,
                     split_k_mode=SplitKMode, activation=Activation, element_bias=DType)
        kw = {}
        for k, v in d.items():
            if k in enums and v is not None:
                v = enums[k](v)
            elif isinstance(v, list):
                v = tuple(v)
            kw[k] = v
        return cls(**kw)

    @property
    def splits_at_launch(self) -> bool:
        """Whether the slice count is chosen per launch (LaunchConfig.split_k_slices > 1 allowed): 2.x split-k, and
        the 3.x GEMM family's stream-K scheduler in its split-k decomposition."""
        if self.family is KernelFamily.SM80_IMPLICIT_GEMM:
            return True
        if self.family is KernelFamily.SM90_GEMM_1X1:
            from .gemm1x1 import scheduler_splits  # noqa: PLC0415 - the family's rules live in its module
            return scheduler_splits(self)
        return False

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def with_alignments(self, align_a: int, align_b: int, align_c: int) -> "KernelConfig":
        """This kernel for narrower operands: the multistage mainloop gives way to the two-stage one where an
        access drops under 4 bytes, and the optimized iterators to the analytic ones under 4 bytes too. (Depthwise
        kernels: a narrower channel vector, see depthwise.with_alignments.)"""
        if self.family is KernelFamily.DEPTHWISE_DIRECT:
            from .depthwise import with_alignments  # noqa: PLC0415

            return with_alignments(self, align_a, align_b, align_c)
        if self.family is KernelFamily.SMEM_IM2COL:  # x and w are read per element already: the output's accesses
            if self.kind is ConvKind.WGRAD:  # dy in 16-byte copies, x and dw per element: nothing to narrow
                if align_a < self.align_a:
                    raise ValueError(f"align_a: the shared-memory im2col wgrad copies dy {self.align_a} elements at a "
                                     f"time, got {align_a}")
                return self
            return dataclasses.replace(self, align_c=align_c)
        narrow = min(align_a * self.element_a.nbytes, align_b * self.element_b.nbytes) < 4
        it = self.iterator
        if narrow and it is IteratorAlgorithm.OPTIMIZED:
            it = IteratorAlgorithm.ANALYTIC
        return dataclasses.replace(self, align_a=align_a, align_b=align_b, align_c=align_c, iterator=it,
                                   stages=2 if narrow else self.stages)

    # ------------------------------------------------------------------ rules
    def static_error(self) -> Optional[str]:
        """Why this config cannot be a kernel at all, or None."""
        if self.element_a is not self.element_b:
            return "element_a and element_b must match"
        if self.kind is ConvKind.WGRAD and self.element_acc is not DType.F32:
            return "wgrad accumulates in f32"
        if self.sourceless is not None:  # before the families' own rules, which return early
            if self.sourceless is not True:
                return "sourceless: True or None (left out), not False"
            if self.family not in (KernelFamily.SM90_GEMM_1X1, KernelFamily.SM90_TMA_WGMMA):
                return f"sourceless: a field of the 3.x families (TMA epilogue) only, not {self.family.value}"
            if self.channel_stats or self.element_bias is not None:
                return "sourceless: not with the channel-statistics or the bias-vector epilogue"
        if self.split_k_mode is SplitKMode.ATOMIC and self.family is not KernelFamily.SM90_TMA_WGMMA:
            return f"split_k_mode atomic: the sm90 conv family's split-k wgrad only, not {self.family.value}"
        if self.epi_tile is not None and self.family is not KernelFamily.SM90_GEMM_1X1:
            return f"epi_tile: a field of the GEMM 1x1 family only, not {self.family.value}"
        if self.epi_stages is not None and self.family is not KernelFamily.SM90_GEMM_1X1:
            return f"epi_stages: a field of the GEMM 1x1 family only, not {self.family.value}"
        if self.pairs is not None:
            if self.family is not KernelFamily.SMEM_IM2COL:
                return f"pairs: a field of the shared-memory im2col family only, not {self.family.value}"
            if self.pairs is not True:
                return "pairs: True or None (left out), not False"
        if self.channel_stats is not None:  # before the families' own rules, which return early
            why = self._channel_stats_error()
            if why:
                return why
        if self.family is KernelFamily.DEPTHWISE_DIRECT:
            from .depthwise import depthwise_static_error  # noqa: PLC0415

            return depthwise_static_error(self)
        if self.family is KernelFamily.SMEM_IM2COL:
            from .smem_im2col import static_error as smem_im2col_static_error  # noqa: PLC0415

            return smem_im2col_static_error(self)
        if (self.conv_stride is not None or self.halo_smem is not None or self.min_blocks is not None
                or self.prefetch is not None):
            return "conv_stride, halo_smem, min_blocks and prefetch are fields of the depthwise family only"
        if self.activation is Activation.RELU6:
            return (f"activation relu6: the {self.family.value} epilogue has no clamp (the ReLU6 clamp is fused by the "
                    "depthwise family only; after an implicit-GEMM conv it stays in PyTorch)")
        if self.stages < 2:
            return f"stages: expected >= 2, got {self.stages}"
        if self.swizzle not in (1, 2, 4, 8):
            return f"swizzle: expected 1, 2, 4 or 8, got {self.swizzle}"
        for name in ("align_a", "align_b", "align_c"):
            a = getattr(self, name)
            elem = {"align_a": self.element_a, "align_b": self.element_b, "align_c": self.element_kernel_out}[name]
            if a not in ALIGNMENTS or a * elem.bits > 128:
                return f"{name}: expected one of {ALIGNMENTS} within 128 bits of {elem.value}, got {a}"
        if self.element_bias is not None:
            if self.kind is not ConvKind.FPROP:
                return f"element_bias: the bias-vector epilogue is fprop only, got {self.kind.value}"
            if self.split_k_mode.fp32_sums:
                return "element_bias: parallel split-k applies the epilogue in its reduction, which has no bias vector"
            if self.family not in (KernelFamily.SM80_IMPLICIT_GEMM, KernelFamily.SM90_TMA_WGMMA):
                return f"element_bias: no bias-vector epilogue in the {self.family.value} family"
            if self.align_c * self.element_bias.bits > 256:
                return f"element_bias: {self.align_c} x {self.element_bias.value} per bias access is over 32 bytes"
        if self.family is KernelFamily.SM80_IMPLICIT_GEMM:
            if any(t % w for t, w in zip(self.tile, self.warps)):
                return f"tile {self.tile} is not divisible by warps {self.warps}"
            if any(wt % i for wt, i in zip(self.warp_tile, self.instruction)):
                return f"warp tile {self.warp_tile} is not a multiple of the instruction {self.instruction}"
            if self.iterator in (IteratorAlgorithm.FEW_CHANNELS, IteratorAlgorithm.FIXED_CHANNELS):
                if self.kind is not ConvKind.FPROP:
                    return f"iterator {self.iterator.value} exists for fprop only"
            if self.is_strided_dgrad:
                if self.split_k_mode is SplitKMode.PARALLEL:
                    return "strided dgrad has no split-k"
            narrow = min(self.align_a * self.element_a.nbytes, self.align_b * self.element_b.nbytes)
            if narrow < 4 and self.stages != 2:
                # cp.async (the multistage mainloop) moves 4, 8 or 16 bytes; narrower operands need CUTLASS's
                # two-stage register-pipelined mainloop.
                return f"stages: operands narrower than 4 bytes per access need stages == 2, got {self.stages}"
            if self.smem_bytes > 227 * 1024:
                return f"{self.smem_bytes} bytes of shared memory, past the 227 KiB an H200 CTA can have"
        if self.family is KernelFamily.SM90_TMA_WGMMA:
            if self.split_k_mode.fp32_sums:
                # The project's own split-k (templates/conv2d_sm90_tma_wgmma.cu.j2): slices of the N*P*Q reduction
                # into fp32 partials and one reduction kernel (parallel), or added into one fp32 buffer by TMA
                # reduce-add stores (atomic); CUTLASS 3.x conv has no split-k of its own.
                if self.kind is not ConvKind.WGRAD:
                    return f"split_k_mode: the sm90 family splits wgrad only (fp32 partials + reduction), not {self.kind.value}"
                if self.element_acc is not DType.F32:
                    return "split_k_mode: sm90 split-k keeps fp32 partials, so it accumulates in f32"
            if self.element_a.nbytes * self.align_a < 16 or self.element_b.nbytes * self.align_b < 16:
                return "TMA needs 16-byte aligned operands"
            if self.element_kernel_out.nbytes * self.align_c != 16:
                return f"align_c: the TMA epilogue stores 16 bytes per access, got {self.align_c} x {self.element_out.value}"
            if self.element_a.bits != 16:
                return f"element_a: the sm90 family is built for f16/bf16 inputs, got {self.element_a.value}"
            if self.schedule not in (None, "implicit_tma_ws", "pingpong"):
                return (f"schedule: sm90 conv has 'implicit_tma_ws' (CUTLASS's KernelImplicitTmaWarpSpecializedSm90) and "
                        f"'pingpong' (the project's persistent kernel), got {self.schedule!r}")
            if self.is_conv_pingpong:
                # templates/conv2d_sm90_tma_wgmma.cu.j2, cb_pingpong: two consumer warp groups each holding a whole
                # tile's fp32 accumulators; the sub-pixel strided dgrad's phases walked as one list of tiles.
                if self.split_k_mode.fp32_sums:
                    return "schedule: the ping-pong conv kernel has no split-k (the split-k wgrad is non-persistent)"
                if self.stride_support is StrideSupport.STRIDED and self.cluster != (1, 1, 1):
                    return (f"cluster {self.cluster}: the ping-pong sub-pixel dgrad walks its phases' tiles one CTA at a "
                            "time (clusters of one)")
                if self.tile[0] * self.tile[1] > 128 * 128:
                    return f"tile {self.tile}: ping-pong keeps a whole tile per consumer warp group, at most 128x128"
            if self.stride_support is StrideSupport.STRIDED and self.kind is not ConvKind.DGRAD:
                return f"stride_support: the 3.x {self.kind.value} kernel takes any stride itself (unity config)"
            m, n, k = self.tile
            if m % 64 or not 64 <= m <= 256 or n % 16 or not 16 <= n <= 256 or (k * self.element_a.nbytes) % 64:
                return f"tile {self.tile}: wgmma needs M in 64..256 (multiple of 64), N in 16..256 (multiple of 16), 64-byte K"
            if len(self.cluster) != 3 or self.cluster[2] != 1 or any(x not in (1, 2, 4) for x in self.cluster) \
                    or self.cluster[0] * self.cluster[1] > 4:
                return f"cluster {self.cluster}: expected (1|2|4, 1|2|4, 1) with at most 4 CTAs"
            epi = min(64, m) * min(32, n) * 6 * self.element_kernel_out.nbytes + 1024  # TMA epilogue: <= 4 C + 2 D stages
            if self.stages * (self.smem_bytes // self.stages + 16) + epi > 232448:
                return f"stages {self.stages}: mainloop + epilogue exceed the 227 KiB of shared memory of an sm90 CTA"
        if self.lowering is not None and self.family is not KernelFamily.SM90_GEMM_1X1:
            return f"lowering: only the GEMM 1x1 family lowers convs (im2col), not {self.family.value}"
        if self.family is KernelFamily.SM90_GEMM_1X1:
            from .gemm1x1 import static_error  # noqa: PLC0415 - the family's rules live in its module
            return static_error(self)
        return None

    def with_more_stages(self, stages: int) -> Optional["KernelConfig"]:
        """This kernel with `stages` pipeline stages where that is more than it has and a valid config, else None
        (the families' deep twins: sm90.deep_twin, gemm1x1.deep_twin)."""
        if stages <= self.stages:
            return None
        try:
            return dataclasses.replace(self, stages=stages)
        except ValueError:  # static_error: no such kernel
            return None

    def with_channel_stats(self) -> Optional["KernelConfig"]:
        """This kernel with the channel-statistics epilogue (the same schedule, cluster and tile K; a tile of more
        than 128 x 64 outputs narrowed to 128 x 64, the widest whose epilogue keeps its sums in registers), or None
        where the family or schedule has none (see channel_stats)."""
        twin = self
        if self.family is KernelFamily.SM90_TMA_WGMMA and self.tile[0] * self.tile[1] > _CHANNEL_STATS_MAX_OUTPUTS:
            from .sm90 import stage_count  # noqa: PLC0415 - sm90 builds on this module

            tile = (*_CHANNEL_STATS_TILE_MN, self.tile[2])
            stages = stage_count(tile, self.element_a, self.element_b, self.element_kernel_out)
            twin = dataclasses.replace(self, tile=tile, stages=stages)
        try:
            return dataclasses.replace(twin, channel_stats=True, sourceless=None)
        except ValueError:  # static_error: no such kernel
            return None

    def _channel_stats_error(self) -> Optional[str]:
        if self.channel_stats is not True:
            return "channel_stats: True or None (left out), not False"
        if self.kind is not ConvKind.FPROP or self.family is not KernelFamily.SM90_TMA_WGMMA:
            return (f"channel_stats: the channel-statistics epilogue is built for the sm90 conv family's fprop, got "
                    f"{self.family.value} {self.kind.value}")
        if self.activation is not Activation.IDENTITY or self.element_bias is not None:
            return "channel_stats: the statistics epilogue is plain (no activation, no bias vector)"
        if self.tile[0] * self.tile[1] > _CHANNEL_STATS_MAX_OUTPUTS:
            return (f"channel_stats: a tile of at most {_CHANNEL_STATS_TILE_MN[0]} x {_CHANNEL_STATS_TILE_MN[1]} "
                    f"outputs, got {self.tile[0]} x {self.tile[1]}")
        return None

    def reject_reason(self, problem: Conv2dProblem) -> Optional[str]:
        """Why this kernel cannot compute `problem`, or None if it can (the compiled kernel's can_implement has the
        last word at launch). Used to prune candidates before anything is compiled."""
        if problem.kind is not self.kind:
            return f"kind: kernel is {self.kind.value}, problem is {problem.kind.value}"
        for f in ("element_a", "element_b", "element_out", "element_acc"):
            if getattr(problem, f) is not getattr(self, f):
                return f"{f}: kernel has {getattr(self, f).value}, problem has {getattr(problem, f).value}"
        if problem.epilogue.activation is not self.activation:
            return f"activation: kernel applies {self.activation.value}, problem wants {problem.epilogue.activation.value}"
        if problem.epilogue.bias_vector:
            if self.element_bias is not problem.element_bias:
                have = f"a {self.element_bias.value} bias vector" if self.element_bias else "no bias vector"
                return (f"element_bias: epilogue {problem.epilogue.tag} needs a kernel with a {problem.element_bias.value} "
                        f"bias vector, kernel has {have}")
        elif self.element_bias is not None:
            return f"element_bias: kernel takes a bias vector, epilogue {problem.epilogue.tag} has none"
        if self.sourceless and problem.epilogue.source is not SourceKind.NONE:
            return f"source: a sourceless kernel reads no epilogue source, the problem has {problem.epilogue.source.value}"
        if self.channel_stats and problem.epilogue.source is not SourceKind.NONE:
            return f"channel_stats: the statistics epilogue is plain, epilogue {problem.epilogue.tag} has a source"
        if self.family is KernelFamily.DEPTHWISE_DIRECT:
            from .depthwise import depthwise_reject_reason  # noqa: PLC0415

            return depthwise_reject_reason(self, problem)
        if problem.groups != 1:
            return f"groups: implicit-GEMM kernels need groups == 1, got {problem.groups}"
        if self.family is KernelFamily.SMEM_IM2COL:
            from .smem_im2col import reject_reason as smem_im2col_reject_reason  # noqa: PLC0415

            return smem_im2col_reject_reason(self, problem)
        if self.family is KernelFamily.SM90_GEMM_1X1:
            from .gemm1x1 import reject_reason  # noqa: PLC0415 - the family's rules live in its module
            why = reject_reason(self, problem)
            if why:
                return why
        overflow = problem.int32_overflow
        if overflow:
            return overflow
        ca, cb, cc = problem.channel_dims
        for name, extent, a in (("A", ca, self.align_a), ("B", cb, self.align_b), ("output", cc, self.align_c)):
            if extent % a:
                return f"alignment: {name}'s channel extent {extent} is not a multiple of the kernel's alignment {a}"
        strided = problem.is_strided
        dilated = problem.is_dilated
        if self.kind is ConvKind.DGRAD:
            if dilated and strided:
                # CUTLASS's strided-dgrad iterators do not apply dilation; the unity-stride ones (analytic and
                # optimized 2.x iterators, the 3.x collective) do
                return "dilation: dgrad with stride > 1 takes dilation 1 only (strided-dgrad kernels ignore dilation)"
            if strided and self.stride_support is StrideSupport.UNITY:
                return "stride: unity-stride dgrad kernel, problem has stride > 1"
            narrowest = min(self.align_a * self.element_a.nbytes, self.align_b * self.element_b.nbytes,
                            self.align_c * self.element_kernel_out.nbytes)
            if strided and self.family is KernelFamily.SM80_IMPLICIT_GEMM and narrowest < 4:
                # Seen on the H200: CUTLASS's two-stage strided-dgrad kernel with 2-byte accesses (C=3, C=7)
                # returned wrong results (relative error 0.7-0.96). ops.run_problem pads such channels instead.
                return "alignment: strided dgrad needs channel counts giving >= 4-byte accesses (ops pads odd ones)"
        if self.iterator is IteratorAlgorithm.FIXED_CHANNELS and problem.c != self.align_a:
            return f"iterator fixed_channels: needs C == {self.align_a}, got C={problem.c}"
        if self.iterator is IteratorAlgorithm.FEW_CHANNELS and problem.c > 2 * self.align_a * 4:
            return f"iterator few_channels: meant for small C, got C={problem.c}"
        if self.family is KernelFamily.SM90_TMA_WGMMA:
            if self.kind is ConvKind.DGRAD and strided:
                # the 3.x dgrad collective ignores the stride: the STRIDED config launches the stride-1 kernel once
                # per sub-pixel phase (sm90.subpixel_phases)
                from .sm90 import subpixel_reject_reason  # noqa: PLC0415

                why = subpixel_reject_reason(problem)
                if why:
                    return why
            elif self.is_strided_dgrad:
                return "stride: the sub-pixel dgrad config is for stride > 1; stride-1 dgrad runs on the unity config"
            if max(problem.pad_h, problem.pad_w) > 256:
                return "padding: TMA im2col takes padding up to 256"
            if problem.epilogue.source.value == "bias" and self.kind is ConvKind.WGRAD:
                return "source: the sm90 wgrad kernel cannot broadcast a bias (its output channel is the GEMM's M)"
        return None


#: Channel multiples a launch may zero-pad C and K to (1: no padding).
PAD_MULTIPLES = (1, 2, 4, 8, 16)


def round_up(extent: int, multiple: int) -> int:
    return -(-extent // multiple) * multiple


def padding_reject_reason(problem: Conv2dProblem, pad_c: int, pad_k: int) -> Optional[str]:
    """Why `problem` cannot run zero-padded to C and K multiples of pad_c / pad_k, or None. A padding that changes
    nothing is refused too, so a padded launch and its unpadded twin are never the same computation."""
    if pad_c == 1 and pad_k == 1:
        return None
    if problem.groups != 1:
        return f"padding: channel padding is for groups == 1, got groups={problem.groups}"
    if round_up(problem.c, pad_c) == problem.c and round_up(problem.k, pad_k) == problem.k:
        return f"padding: C={problem.c} and K={problem.k} are already multiples of {pad_c} and {pad_k}"
    return None


#: Space-to-depth block sizes a launch may fold a strided conv with (1: none); the block is the conv's stride.
S2D_BLOCKS = (1, 2, 3, 4)


def s2d_reject_reason(problem: Conv2dProblem, block: int) -> Optional[str]:
    """Why `problem` cannot run as its space-to-depth rewrite with `block` x `block` pixels folded into channels, or
    None. The rewrite is exact for a conv of stride `block` in both dimensions, dilation 1 and groups 1."""
    if block == 1:
        return None
    if problem.groups != 1:
        return f"s2d: space-to-depth is for groups == 1, got groups={problem.groups}"
    if (problem.stride_h, problem.stride_w) != (block, block):
        return f"s2d: a block of {block} needs stride {block}x{block}, got {problem.stride_h}x{problem.stride_w}"
    if problem.is_dilated:
        return f"s2d: space-to-depth needs dilation 1, got {problem.dilation_h}x{problem.dilation_w}"
    ep = problem.epilogue
    if problem.kind is ConvKind.DGRAD and (ep.source is not SourceKind.NONE or ep.activation is not Activation.IDENTITY):
        folded = s2d_problem(problem, block)
        if folded.h * block - problem.pad_h < problem.h or folded.w * block - problem.pad_w < problem.w \
                or fold_phases(problem.r, problem.s, block) != (block, block):
            return ("s2d: the folded dgrad does not reach every pixel of dx (the last rows or columns, or the pixel "
                    f"phases a filter narrower than the stride skips); those would miss the epilogue {ep.tag}")
    return None


def fold_phases(r: int, s: int, block: int) -> tuple[int, int]:
    """The pixel phases (rows, columns) of a `block` x `block` fold that some tap of an r x s filter reaches: all
    `block` of each, but for filters narrower than the stride (a 1x1 stride-2 conv reads one phase of four)."""
    return min(block, r), min(block, s)


def s2d_problem(problem: Conv2dProblem, block: int) -> Conv2dProblem:
    """The stride-1 conv that `problem` (stride `block`, see s2d_reject_reason) is, once its input is folded into
    channels: x' = x zero-padded, xs[n, i, j, (bu, bv, c)] = x'[n, block*i + bu, block*j + bv, c] for the phases
    (bu, bv) some tap reaches (fold_phases), and the filter likewise, ws[k, a, b, (bu, bv, c)] = w[k, block*a + bu,
    block*b + bv, c] (zero past R, S). The output is the same P x Q; R and S become ceil(R / block), C becomes
    (phases) * C (block^2 * C for filters at least as wide as the stride, C for a 1x1: a subsample), and there is
    no padding. Block 1 is no fold: `problem` itself."""
    if block == 1:
        return problem
    r, s = -(-problem.r // block), -(-problem.s // block)
    gu, gv = fold_phases(problem.r, problem.s, block)
    return problem.replace(h=problem.p + r - 1, w=problem.q + s - 1, c=gu * gv * problem.c, r=r, s=s,
                           pad_h=0, pad_w=0, stride_h=1, stride_w=1)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """A compiled kernel plus what is chosen per launch: split-k slices, and the channel padding ops applies around
    the kernel (C and K rounded up to multiples of `pad_c` / `pad_k` with zeros; 1 is none). Zero channels add
    nothing to any of the three kinds, so a padded launch computes the same result; its cost (the copies) is part
    of what the profiler times, as it runs through ops.run_problem like every launch.

    `s2d` > 1 runs a conv of that stride as its space-to-depth rewrite (`s2d_problem`: a stride-1 conv over
    s2d^2 times the channels and a ceil(R / s2d) x ceil(S / s2d) filter), on which the channel padding then applies:
    a stem's 7x7 stride-2 conv over C=3 becomes a 4x4 stride-1 conv over C=12 (padded to 16: 16-byte accesses)."""

    kernel: KernelConfig
    split_k_slices: int = 1
    pad_c: int = 1
    pad_k: int = 1
    s2d: int = 1

    def __post_init__(self) -> None:
        if self.split_k_slices < 1:
            raise ValueError(f"split_k_slices: expected >= 1, got {self.split_k_slices}")
        for f in ("pad_c", "pad_k"):
            if getattr(self, f) not in PAD_MULTIPLES:
                raise ValueError(f"{f}: expected one of {PAD_MULTIPLES}, got {getattr(self, f)!r}")
        if self.s2d not in S2D_BLOCKS:
            raise ValueError(f"s2d: expected one of {S2D_BLOCKS}, got {self.s2d!r}")
        if self.split_k_slices > 1 and self.kernel.family is KernelFamily.DEPTHWISE_DIRECT \
                and self.kernel.kind is not ConvKind.WGRAD:
            raise ValueError("split_k_slices: only depthwise wgrad splits its reduction over N*P*Q")
        if self.split_k_slices > 1 and self.kernel.family is KernelFamily.SM90_TMA_WGMMA \
                and not self.kernel.split_k_mode.fp32_sums:
            raise ValueError("split_k_slices: this sm90 kernel has no split-k; the sm90 family splits wgrad with "
                             "split_k_mode parallel (fp32 partials + reduction) or atomic (TMA reduce-adds)")
        if self.split_k_slices > 1 and self.kernel.family is KernelFamily.SM90_GEMM_1X1 \
                and not self.kernel.splits_at_launch:
            raise ValueError(f"split_k_slices: only the stream-K scheduler splits K at launch; "
                             f"{self.kernel.schedule} takes 1, got {self.split_k_slices}")

    @property
    def name(self) -> str:
        pad = (f"_padc{self.pad_c}" if self.pad_c > 1 else "") + (f"_padk{self.pad_k}" if self.pad_k > 1 else "")
        s2d = f"_s2d{self.s2d}" if self.s2d > 1 else ""
        return self.kernel.name + (f"_k{self.split_k_slices}" if self.split_k_slices > 1 else "") + s2d + pad

    @property
    def padded(self) -> bool:
        """Whether ops rewrites the operands around the kernel (channel padding, space-to-depth, or both)."""
        return self.pad_c > 1 or self.pad_k > 1 or self.s2d > 1

    @property
    def unpadded(self) -> "LaunchConfig":
        """The launch ops runs on the rewritten problem (the same kernel and slices)."""
        return dataclasses.replace(self, pad_c=1, pad_k=1, s2d=1) if self.padded else self

    def with_channel_stats(self) -> Optional["LaunchConfig"]:
        """This launch on its kernel's channel-statistics twin (KernelConfig.with_channel_stats), or None where there
        is none: a kernel without the epilogue, a channel-padded or space-to-depth launch (the kernel's output is not
        the conv's), a split launch."""
        if self.padded or self.split_k_slices != 1:
            return None
        kernel = self.kernel.with_channel_stats()
        return dataclasses.replace(self, kernel=kernel) if kernel is not None else None

    def kernel_problem(self, problem: Conv2dProblem) -> Conv2dProblem:
        """The problem the kernel computes when this launch runs `problem`: the space-to-depth rewrite, then C and
        K rounded up to the padding."""
        if not self.padded:
            return problem
        problem = s2d_problem(problem, self.s2d)
        return problem.replace(c=round_up(problem.c, self.pad_c), k=round_up(problem.k, self.pad_k))

    def reject_reason(self, problem: Conv2dProblem) -> Optional[str]:
        if self.padded:
            why = s2d_reject_reason(problem, self.s2d)
            if why:
                return why
            why = padding_reject_reason(s2d_problem(problem, self.s2d), self.pad_c, self.pad_k)
            if why:
                return why
            problem = self.kernel_problem(problem)
        why = self.kernel.reject_reason(problem)
        if why:
            return why
        if self.kernel.family is KernelFamily.DEPTHWISE_DIRECT:
            from .depthwise import pixel_tiles  # noqa: PLC0415

            tiles = pixel_tiles(self.kernel, problem)
            if self.split_k_slices > tiles:
                return f"split_k_slices: {self.split_k_slices} splits of the N*P*Q reduction exceed its {tiles} pixel tiles"
            if self.kernel.split_k_mode is SplitKMode.CLUSTER:
                from .depthwise import MAX_CLUSTER_SPLITS  # noqa: PLC0415

                if self.split_k_slices > MAX_CLUSTER_SPLITS:
                    return (f"split_k_slices: a cluster split reduces in one thread-block cluster, at most "
                            f"{MAX_CLUSTER_SPLITS} CTAs, got {self.split_k_slices}")
            return None
        if self.split_k_slices > 1:
            k = self.kernel
            if problem.is_strided_dgrad and k.family is KernelFamily.SM80_IMPLICIT_GEMM:
                # CUTLASS 2.x's strided dgrad; the GEMM family's lowered dgrad splits its plain GEMM whatever the stride
                return "split_k_slices: strided dgrad has no split-k"
            if k.split_k_mode is SplitKMode.SERIAL and k.family is not KernelFamily.SM90_GEMM_1X1:
                # (The GEMM family's split-k is the stream-K scheduler's: fp32 partials in the workspace, reduced
                # before one epilogue, so neither rule below applies to it.)
                # Serial slices accumulate through the output tensor itself: a 16-bit output would round the
                # partial sums between slices (the split-k drift TVM saw), and a broadcast bias would be re-added.
                if k.element_out.bits < 32:
                    return (f"split_k_slices: serial split-k keeps partial sums in the {k.element_out.value} output; "
                            "use parallel split-k (fp32 partials) for 16-bit outputs")
                if problem.epilogue.source is SourceKind.BIAS:
                    return "split_k_slices: serial split-k cannot take a broadcast bias; use parallel split-k"
                if k.family is KernelFamily.SM80_IMPLICIT_GEMM and k.activation is Activation.RELU:
                    # CUTLASS's LinearCombinationRelu::set_k_partition sets every slice's threshold but the last
                    # one's to NaN to skip the ReLU there, and its ReLu takes a NaN-propagating maximum: those slices
                    # write NaN, which the next slice reads back as its source (the GPU fuzz's seeds 131 and 149:
                    # non-finite outputs). Parallel split-k applies the ReLU once, in its reduction.
                    return ("split_k_slices: serial split-k with a ReLU epilogue writes NaN from every slice but the "
                            "last (CUTLASS's LinearCombinationRelu); use parallel split-k")
            if k.element_bias is not None:
                return "split_k_slices: the bias-vector epilogue runs unsplit"
            gemm_k = problem.gemm_mnk[2]
            if self.split_k_slices * k.tile[2] > gemm_k:
                return f"split_k_slices: {self.split_k_slices} slices of {k.tile[2]} exceed the reduction extent {gemm_k}"
            if k.family is KernelFamily.SM90_TMA_WGMMA and self.split_k_slices > 65535:
                return f"split_k_slices: the sm90 split-k grid takes at most 65535 slices, got {self.split_k_slices}"
        return None

    def to_dict(self) -> dict:
        d = {"kernel": self.kernel.to_dict(), "split_k_slices": self.split_k_slices}
        if self.pad_c > 1 or self.pad_k > 1:  # unpadded launches keep the dict they always had
            d.update(pad_c=self.pad_c, pad_k=self.pad_k)
        if self.s2d > 1:
            d["s2d"] = self.s2d
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LaunchConfig":
        return cls(KernelConfig.from_dict(d["kernel"]), int(d.get("split_k_slices", 1)), int(d.get("pad_c", 1)),
                   int(d.get("pad_k", 1)), int(d.get("s2d", 1)))
