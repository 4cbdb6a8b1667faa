"""Candidate kernel configs for a problem.

Tile / warp / stage combinations come from cutlass_library's own SM80 generators (the lists CUTLASS ships and
tests), never from tables copied here. Per problem, the alignments are the widest its channel extents allow,
the iterator and stride support follow the conv kind, and split-k modes are added where CUTLASS allows them.
Global filters (`tile_filter`) apply first, then the per-problem rule (`KernelConfig.reject_reason`).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator, Optional

from .config import (PAD_MULTIPLES, S2D_BLOCKS, KernelConfig, Shape3, instruction_shape_for, math_op_for,
                     padding_reject_reason, round_up, s2d_problem, s2d_reject_reason)
from .generators import Collector, generator_module
from .problem import Conv2dProblem, max_alignment
from .types import Activation, ConvKind, DType, IteratorAlgorithm, KernelFamily, MathOp, SplitKMode, StrideSupport

TileSpec = tuple[Shape3, Shape3, int]  # (threadblock tile, warp counts, stages)


@functools.lru_cache(maxsize=None)
def sm80_tile_specs(math: MathOp) -> tuple[TileSpec, ...]:
    """Distinct (tile, warps, stages) that cutlass_library generates for SM80 conv2d with this math op."""
    generator = generator_module()
    collector = Collector()
    if math is MathOp.TF32:
        generator.GenerateSM80_TensorOp_1688(collector, "13.0")
        want_a = {"tf32", "f32"}
    else:
        generator.GenerateSM80_TensorOp_16816(collector, "13.0")
        want_a = {math.value}
    inst = instruction_shape_for(math)
    specs = set()
    for op in collector.operations:
        if type(op).__name__ != "Conv2dOperation":
            continue
        td = op.tile_description
        mi = td.math_instruction
        if mi.element_a.name not in want_a or mi.element_accumulator.name != "f32":
            continue
        if tuple(mi.instruction_shape) != inst:
            continue
        specs.add((tuple(td.threadblock_shape), tuple(td.warp_count), int(td.stages)))
    return tuple(sorted(specs))


def default_stride_support(problem: Conv2dProblem, iterator: IteratorAlgorithm) -> StrideSupport:
    if iterator in (IteratorAlgorithm.FEW_CHANNELS, IteratorAlgorithm.FIXED_CHANNELS):
        return StrideSupport.STRIDED  # the only instantiation CUTLASS has of these fprop iterators
    if problem.kind is ConvKind.DGRAD:
        return StrideSupport.STRIDED if problem.is_strided else StrideSupport.UNITY
    if problem.kind is ConvKind.WGRAD:
        return StrideSupport.STRIDED  # what CUTLASS instantiates for wgrad; it handles any stride
    return StrideSupport.UNITY  # fprop's analytic/optimized iterators handle any stride


def iterators_for(problem: Conv2dProblem, align_a: int) -> list[IteratorAlgorithm]:
    its = [IteratorAlgorithm.OPTIMIZED, IteratorAlgorithm.ANALYTIC]
    if problem.kind is ConvKind.FPROP and problem.c <= 16:
        if problem.c == align_a:
            its.insert(0, IteratorAlgorithm.FIXED_CHANNELS)
        its.insert(0, IteratorAlgorithm.FEW_CHANNELS)
    return its


def operand_alignments(problem: Conv2dProblem, kernel_out: Optional[DType] = None,
                       max_align: Optional[tuple[int, int, int]] = None) -> tuple[int, int, int]:
    """Widest alignment each operand's channel extent allows (pointer addresses are checked at launch), at most
    `max_align` (what the operands' addresses allow, for a launch on offset views)."""
    ca, cb, cc = problem.channel_dims
    out = (
        max_alignment(ca, problem.element_a),
        max_alignment(cb, problem.element_b),
        max_alignment(cc, kernel_out or problem.element_out),
    )
    if max_align is None:
        return out
    return tuple(min(a, m) for a, m in zip(out, max_align))  # type: ignore[return-value]


def split_k_modes(problem: Conv2dProblem) -> list[SplitKMode]:
    strided_dgrad = problem.is_strided_dgrad
    return [SplitKMode.SERIAL] if strided_dgrad else [SplitKMode.SERIAL, SplitKMode.PARALLEL]


def sm80_candidates(
    problem: Conv2dProblem,
    *,
    tile_filter: Optional[Callable[[TileSpec], bool]] = None,
    split_k: bool = True,
    swizzles: tuple[int, ...] = (1,),
    max_align: Optional[tuple[int, int, int]] = None,
) -> Iterator[KernelConfig]:
    """Every SM80-family config that can implement `problem` (before compiling); `max_align` caps the alignments of
    A, B and the output (in elements of each), for operands whose addresses allow less than their extents."""
    math = math_op_for(problem.element_a)
    modes = split_k_modes(problem) if split_k else [SplitKMode.SERIAL]
    element_bias = problem.element_bias if problem.epilogue.bias_vector else None
    if element_bias is not None:
        modes = [SplitKMode.SERIAL]  # the bias-vector epilogue has no parallel split-k (its reduction has no vector)
    align_a, align_b, _ = operand_alignments(problem, max_align=max_align)
    narrow = min(align_a * problem.element_a.nbytes, align_b * problem.element_b.nbytes) < 4
    # cp.async moves >= 4 bytes: narrower operands run CUTLASS's two-stage register-pipelined mainloop, so the
    # generator's tiles are taken with stages = 2 (deduplicated).
    specs = dict.fromkeys((t, w, 2 if narrow else s) for t, w, s in sm80_tile_specs(math))
    for tile, warps, stages in specs:
        if tile_filter and not tile_filter((tile, warps, stages)):
            continue
        for mode in modes:
            kernel_out = problem.element_acc if mode is SplitKMode.PARALLEL else problem.element_out
            align_a, align_b, align_c = operand_alignments(problem, kernel_out, max_align)
            for it in iterators_for(problem, align_a):
                if it is IteratorAlgorithm.OPTIMIZED and min(align_a, align_b) < 2 and problem.element_a.bits == 16:
                    continue  # CUTLASS's optimized iterators need >= 32-bit accesses for 16-bit types
                for sw in swizzles:
                    try:
                        cfg = KernelConfig(
                            family=KernelFamily.SM80_IMPLICIT_GEMM, kind=problem.kind,
                            element_a=problem.element_a, element_b=problem.element_b,
                            element_out=problem.element_out, element_acc=problem.element_acc,
                            tile=tile, warps=warps, stages=stages, iterator=it,
                            stride_support=default_stride_support(problem, it),
                            align_a=align_a, align_b=align_b, align_c=align_c,
                            split_k_mode=mode, swizzle=sw, activation=problem.epilogue.activation,
                            element_bias=element_bias,
                        )
                    except ValueError:
                        continue
                    if cfg.reject_reason(problem) is None:
                        yield cfg


def channel_pad_options(problem: Conv2dProblem) -> list[tuple[int, int]]:
    """(pad_c, pad_k) launches worth trying for `problem`: (1, 1), the unpadded launch, always first; then, for C
    and K where some operand reads or writes that channel extent in accesses under 16 bytes (the stem's C=3, the
    odd 7->33 layer), the multiple giving 16-byte accesses of the inputs (8 for 16-bit types), and for extents of
    at most 8 bytes (C=3 -> 4) also the one giving 8-byte accesses (the fixed-channels fprop iterator with C == 4,
    half the padded work of C=8); alone and combined, each padded extent once. Whether a padded launch beats its
    unpadded twin is the profiler's call: the copies cost time."""
    if problem.groups != 1:
        return [(1, 1)]
    kind = problem.kind
    # the element types that hold C, and K, as their innermost extent (problem.channel_dims)
    c_types = {ConvKind.FPROP: (problem.element_a, problem.element_b),
               ConvKind.DGRAD: (problem.element_b, problem.element_out),
               ConvKind.WGRAD: (problem.element_b, problem.element_out)}[kind]
    k_types = {ConvKind.FPROP: (problem.element_out,), ConvKind.DGRAD: (problem.element_a,),
               ConvKind.WGRAD: (problem.element_a,)}[kind]
    nbytes = problem.element_a.nbytes
    wide = next(m for m in PAD_MULTIPLES if m * nbytes == 16)
    half = next(m for m in PAD_MULTIPLES if m * nbytes == 8)

    def options(extent: int, dtypes: tuple[DType, ...]) -> list[int]:
        if min(max_alignment(extent, dt) * dt.nbytes for dt in dtypes) >= 16:
            return [1]
        by_extent = {extent: 1}
        by_extent.setdefault(round_up(extent, wide), wide)
        if extent * nbytes <= 8:
            by_extent.setdefault(round_up(extent, half), half)
        return list(by_extent.values())

    return [(pc, pk) for pc in options(problem.c, c_types) for pk in options(problem.k, k_types)]


def s2d_options(problem: Conv2dProblem) -> list[int]:
    """Space-to-depth blocks worth trying for `problem` (`LaunchConfig.s2d`): 1, the conv as it is, always first;
    and the stride, for a strided conv (same stride in both dimensions, dilation 1, groups 1) that is either
    - a filter at least that wide whose input channels are read in accesses under 16 bytes: the RGB stem (7x7
      stride 2 over C=3 becomes a 4x4 stride-1 conv over C=12, 147 taps in 192). Wider layers would only add the
      folded filter's zero taps (a 3x3 stride-2 conv folds into 2x2 over 4C: 16 taps for 9); or
    - a 1x1 conv (ResNet's downsampling shortcuts), whose fold is a subsample of x: the stride-1 1x1 conv on it is
      a plain GEMM (the GEMM family), at the cost of writing the subsampled x (fprop, wgrad) or scattering dx
      (dgrad)."""
    b = problem.stride_h
    if b not in S2D_BLOCKS[1:] or s2d_reject_reason(problem, b):
        return [1]
    if problem.r == problem.s == 1:
        return [1, b]
    if problem.r < b or problem.s < b or (problem.c * problem.element_a.nbytes) % 16 == 0:
        return [1]
    return [1, b]


def rewrite_options(problem: Conv2dProblem) -> Iterator[tuple[int, int, int, Conv2dProblem, Optional[str]]]:
    """Every (s2d, pad_c, pad_k, problem the kernel computes, why not) a launch may run `problem` as: the conv as it
    is first, then each channel padding (`channel_pad_options`), of the conv itself and then of each space-to-depth
    fold (`s2d_options`); `why not` is the padding's refusal (`padding_reject_reason`), None where it applies."""
    for blk in s2d_options(problem):
        base = s2d_problem(problem, blk)
        for pad_c, pad_k in channel_pad_options(base):
            yield (blk, pad_c, pad_k, base.replace(c=round_up(base.c, pad_c), k=round_up(base.k, pad_k)),
                   padding_reject_reason(base, pad_c, pad_k))


def unsupported_reason(problem: Conv2dProblem) -> Optional[str]:
    """Why no kernel family of this project computes `problem` (naming the parameter), or None if some can."""
    if problem.int32_overflow:
        return f"size: {problem.int32_overflow}"
    if problem.is_depthwise:
        from .depthwise import depthwise_candidates, depthwise_problem_error  # noqa: PLC0415

        why = depthwise_problem_error(problem)
        if why:
            return f"depthwise: {why}"
        if next(depthwise_candidates(problem), None) is None:
            return "depthwise: no depthwise candidate accepts this problem"
        return None
    if problem.groups != 1:
        return f"groups: implicit-GEMM kernels need groups == 1 (depthwise kernels groups == C == K), got groups={problem.groups}"
    if problem.epilogue.activation is Activation.RELU6:
        return ("activation relu6: the implicit-GEMM epilogues have no clamp (only the depthwise kernels fuse "
                "ReLU6); the clamp stays in PyTorch")
    if problem.is_strided_dgrad and problem.is_dilated:
        return (f"dilation: dgrad with stride {problem.stride_h}x{problem.stride_w} takes dilation 1 only (strided-"
                f"dgrad kernels ignore dilation), got {problem.dilation_h}x{problem.dilation_w}")
    for pad_c, pad_k in channel_pad_options(problem):
        padded = problem.replace(c=round_up(problem.c, pad_c), k=round_up(problem.k, pad_k))
        if next(sm80_candidates(padded, split_k=False), None) is not None:
            return None
    if problem.is_strided_dgrad:
        a, b, c = operand_alignments(problem)
        if min(a * problem.element_a.nbytes, b * problem.element_b.nbytes, c * problem.element_out.nbytes) < 4:
            return "alignment: strided dgrad needs channel counts giving >= 4-byte accesses (ops pads them)"
    return "no sm80 candidate accepts this problem"
