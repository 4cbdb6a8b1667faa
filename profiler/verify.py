"""Operands for a problem and a reference to check a candidate's output against.

Inputs are random (uniform in [-1, 1], seeded), allocated as `rotation` sets in PyTorch's channels_last layout
(NHWC activations, KRSC filters: the memory the kernels read). The reference is cuDNN on the inputs upcast to
fp32 with TF32 off, plus the epilogue applied in fp32. Before every checked run the output is poisoned with NaN,
so a kernel that leaves part of it unwritten fails the check instead of passing on a previous run's values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..problem import Conv2dProblem
from ..types import Activation, ConvKind, DType, SourceKind

#: Largest error allowed, relative to the largest reference magnitude, by output type.
TOLERANCE = {DType.F16: 1e-2, DType.BF16: 3e-2, DType.F32: 2e-3}


def _torch():
    import torch  # noqa: PLC0415

    return torch


def torch_dtype(d: DType):
    return getattr(_torch(), d.torch_name)


@dataclasses.dataclass(frozen=True)
class OperandSet:
    """One set of tensors in the roles of the implicit GEMM: a, b, the output and the epilogue's source."""

    a: object
    b: object
    out: object
    source: Optional[object]
    x: object  # the same tensors by conv role, for references (one of them is `out`)
    w: object
    y: object
    bias: Optional[object] = None  # the bias of SourceKind.BIAS_RESIDUAL (`source` is then the residual)


def logical_shapes(p: Conv2dProblem) -> dict[str, tuple[int, int, int, int]]:
    """PyTorch (NCHW-ordered) shapes of x, w and y; memory is channels_last."""
    return {"x": (p.n, p.c, p.h, p.w), "w": (p.k, p.c // p.groups, p.r, p.s), "y": (p.n, p.k, p.p, p.q)}


def operand_bytes(p: Conv2dProblem) -> int:
    src = 0
    if p.epilogue.source.has_residual:
        src = math.prod(p.out_shape) * p.element_out.nbytes
    return p.bytes_moved + src


def make_operand_set(p: Conv2dProblem, device, generator=None) -> OperandSet:
    torch = _torch()
    shapes = logical_shapes(p)
    out_role = {ConvKind.FPROP: "y", ConvKind.DGRAD: "x", ConvKind.WGRAD: "w"}[p.kind]
    t = {}
    for role, shape in shapes.items():
        dt = torch_dtype(p.element_out if role == out_role else p.element_a)
        buf = torch.empty(shape, dtype=dt, device=device, memory_format=torch.channels_last)
        if role != out_role:
            buf.uniform_(-1.0, 1.0, generator=generator)
        t[role] = buf
    a, b = {ConvKind.FPROP: ("x", "w"), ConvKind.DGRAD: ("y", "w"), ConvKind.WGRAD: ("y", "x")}[p.kind]
    source = bias = None
    if p.epilogue.source.has_bias:
        bias = torch.empty((p.k,), dtype=torch_dtype(p.element_bias), device=device).uniform_(-1, 1, generator=generator)
    if p.epilogue.source.has_residual:
        source = torch.empty_like(t[out_role]).uniform_(-1, 1, generator=generator)
    if p.epilogue.source is SourceKind.BIAS:
        source, bias = bias, None
    return OperandSet(t[a], t[b], t[out_role], source, t["x"], t["w"], t["y"], bias)


def _activation(y, act: Activation):
    from ..ops import _apply_activation  # noqa: PLC0415

    return _apply_activation(y, act)


def reference(p: Conv2dProblem, ops: OperandSet):
    """The exact result in fp32 (cuDNN on upcast inputs, TF32 off), epilogue included."""
    torch = _torch()
    stride, pad, dil = (p.stride_h, p.stride_w), (p.pad_h, p.pad_w), (p.dilation_h, p.dilation_w)
    prev = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            if p.kind is ConvKind.FPROP:
                r = torch.nn.functional.conv2d(ops.x.float(), ops.w.float(), None, stride, pad, dil, p.groups)
            elif p.kind is ConvKind.DGRAD:
                r = torch.nn.grad.conv2d_input(ops.x.shape, ops.w.float(), ops.y.float(), stride, pad, dil, p.groups)
            else:
                r = torch.nn.grad.conv2d_weight(ops.x.float(), ops.w.shape, ops.y.float(), stride, pad, dil, p.groups)
            if p.epilogue.source is SourceKind.BIAS:
                r = r + ops.source.float().view(1, -1, 1, 1)
            elif p.epilogue.source.has_residual:
                r = r + ops.source.float()
            if p.epilogue.source is SourceKind.BIAS_RESIDUAL:
                r = r + ops.bias.float().view(1, -1, 1, 1)
            return _activation(r, p.epilogue.activation).contiguous(memory_format=torch.channels_last)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = prev


@dataclasses.dataclass(frozen=True)
class CheckResult:
    ok: bool
    max_error: float  # max |out - ref| / max |ref|
    message: str


def poison(out) -> None:
    out.fill_(float("nan"))


def compare(p: Conv2dProblem, out, ref) -> CheckResult:
    torch = _torch()
    o = out.float()
    finite = torch.isfinite(o)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        return CheckResult(False, math.inf, f"{bad} of {o.numel()} outputs are NaN/Inf (unwritten or overflowed)")
    scale = max(float(ref.abs().max()), 1e-6)
    err = float((o - ref).abs().max()) / scale
    tol = TOLERANCE[p.element_out]
    if err > tol:
        return CheckResult(False, err, f"max error {err:.3g} of the output's range exceeds {tol:g}")
    return CheckResult(True, err, "ok")


def cudnn_fn(problem: Conv2dProblem, sets):
    """A callable running cuDNN's version of `problem` on operand set i: aten's conv2d / convolution_backward for the
    kind (only the gradient the problem asks for), then the epilogue (bias, residual, activation) as PyTorch ops.
    What the partitioner leaves a conv to when cuDNN is faster, timed by the profiler next to the candidates."""
    import torch  # noqa: PLC0415

    p = problem
    stride, pad, dil = [p.stride_h, p.stride_w], [p.pad_h, p.pad_w], [p.dilation_h, p.dilation_w]
    act = p.epilogue.activation
    F = torch.nn.functional
    bwd = torch.ops.aten.convolution_backward

    if p.kind is ConvKind.FPROP:
        def fn(i: int) -> None:
            s = sets[i]
            bias = s.source if p.epilogue.source is SourceKind.BIAS else s.bias
            y = F.conv2d(s.x, s.w, bias.to(s.x.dtype) if bias is not None else None, stride, pad, dil, p.groups)
            if p.element_out is not p.element_a:  # the cast the kernel fuses
                y = y.to(torch_dtype(p.element_out))
            if p.epilogue.source.has_residual:
                y = y.add_(s.source)
            if act is not Activation.IDENTITY:
                _activation(y, act)
    else:
        dgrad = p.kind is ConvKind.DGRAD
        mask = [True, False, False] if dgrad else [False, True, False]
        # The gradient's own operand (x for dgrad, w for wgrad) only gives aten its shape, and aten wants it in the
        # input's type: an fp32-output problem (a 16-bit gradient with its fp32 cast fused) is the 16-bit gradient
        # plus the cast, as PyTorch runs it.
        in_dt = torch_dtype(p.element_a)
        cast = p.element_out is not p.element_a
        stand_in = [torch.empty_like(s.x if dgrad else s.w, dtype=in_dt) if cast else None for s in sets]

        def fn(i: int) -> None:
            s = sets[i]
            x = stand_in[i] if dgrad and cast else s.x
            w = stand_in[i] if not dgrad and cast else s.w
            g = bwd(s.y, x, w, None, stride, pad, dil, False, [0, 0], p.groups, mask)
            out = g[0] if dgrad else g[1]
            if cast:
                out = out.to(torch_dtype(p.element_out))
            if p.epilogue.source is SourceKind.RESIDUAL:
                out.add_(s.source)
    return fn
