"""The torch.library custom ops an offloaded graph calls: ``cutlass_byoc::conv2d_fprop``, ``::conv2d_dgrad`` and
``::conv2d_wgrad``, with fake (meta) implementations so Inductor and AOTAutograd can trace and compile around them.

Layout contract (the design decision of the offload):

* Every op *returns* a channels_last-contiguous tensor (NHWC activations, KRSC filters), because that is what the
  kernels write. The fake implementations declare exactly these strides, so the compiled graph around an op sees the
  true layout and the graph stays channels_last from one conv to the next without transposes.
* Every op *expects* channels_last-contiguous 4-D operands. The partitioner inserts one ``aten.clone(...,
  memory_format=torch.channels_last)`` where a graph value is not channels_last (an NCHW model's input and weights),
  and the ops carry ``needs_fixed_stride_order`` so Inductor keeps that stride order. The CUDA path still checks and
  converts (a copy) if it is handed anything else: a wrong layout must never reach a kernel.
* On CUDA the ops call :mod:`cutlass_byoc.ops` with the launch chosen once per distinct problem (:func:`_call`;
  ``select`` = tune / cached / heuristic as given by the backend's options): a call signature's first call goes
  through the checked public op, later ones straight to ``ops.run_problem``. If the kernel library cannot run a call
  (no kernel, a launch or compile error, no CUDA toolchain), the call falls back to the PyTorch reference and the
  reason is logged and recorded in :data:`RUNTIME`. On any other device the reference runs: it computes in fp32 and
  casts once to the output type, i.e. what the kernels compute (fp32 accumulation, epilogue in fp32, one rounding at
  the store).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..types import Activation

log = logging.getLogger("cutlass_byoc.offload")

NAMESPACE = "cutlass_byoc"
_TAGS = (torch.Tag.needs_fixed_stride_order,)
CL = torch.channels_last


# ---------------------------------------------------------------------------------------------- runtime record
@dataclasses.dataclass
class RuntimeRecord:
    """What the ops did at run time: kernel launches per pass, and the calls that fell back (by signature) with
    their reasons."""

    kernel_calls: dict[str, int] = dataclasses.field(default_factory=dict)  # "fprop" / "dgrad" / "wgrad" -> count
    fallbacks: dict[str, str] = dataclasses.field(default_factory=dict)
    reference_calls: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def kernel(self, key: str) -> None:
        with self._lock:
            self.kernel_calls[key] = self.kernel_calls.get(key, 0) + 1

    def fallback(self, key: str, reason: str) -> None:
        with self._lock:
            if key not in self.fallbacks:
                log.warning("cutlass_byoc: %s falls back to PyTorch: %s", key, reason)
            self.fallbacks[key] = reason

    def reference(self) -> None:
        with self._lock:
            self.reference_calls += 1

    def clear(self) -> None:
        with self._lock:
            self.kernel_calls.clear()
            self.fallbacks.clear()
            self.reference_calls = 0


RUNTIME = RuntimeRecord()

#: Set to False to force the PyTorch reference even on CUDA (debugging, A/B checks).
use_kernels = True


_MISSING = object()
_PROBLEMS: dict[tuple, object] = {}
_VALIDATED: set[tuple] = set()  # call signatures whose first call passed every check of cutlass_byoc.ops
_problem_lock = threading.Lock()


def _signature(kind: str, x_shape, w_shape, stride, padding, dilation, groups: int, in_dtype: torch.dtype,
               out_dtype: torch.dtype, activation: str = "identity", source: str = "none",
               operand_dtypes: tuple = ()) -> tuple:
    """Everything a call's problem and its checks depend on (operand dtypes included: the fast path trusts them)."""
    return (kind, tuple(x_shape), tuple(w_shape), tuple(stride), tuple(padding), tuple(dilation), groups, in_dtype,
            out_dtype, activation, source, operand_dtypes)


def problem_for(sig: tuple):
    """The Conv2dProblem of a call signature (built once per signature), or None when no kernel takes it."""
    problem = _PROBLEMS.get(sig, _MISSING)
    if problem is _MISSING:
        from ..problem import Epilogue  # noqa: PLC0415
        from ..types import ConvKind, SourceKind  # noqa: PLC0415
        from .patterns import Reject, make_problem  # noqa: PLC0415

        kind, x_shape, w_shape, stride, padding, dilation, groups, in_dtype, out_dtype, activation, source, odt = sig
        from ..types import DType  # noqa: PLC0415

        # fprop's operand dtypes are (weight, residual, bias): the bias may be fp32 under a 16-bit output
        bias_dt = odt[2] if kind == "fprop" and len(odt) > 2 and isinstance(odt[2], torch.dtype) else None
        try:
            problem = make_problem(ConvKind(kind), x_shape, w_shape, _pair(stride), _pair(padding), _pair(dilation),
                                   groups, in_dtype, out_dtype,
                                   Epilogue(Activation(activation), SourceKind(source),
                                            DType.from_torch(bias_dt) if bias_dt is not None else None))
        except Reject as e:
            log.info("no kernel for %s: %s", sig, e)
            problem = None
        with _problem_lock:
            _PROBLEMS[sig] = problem
    return problem


def _call(kind: str, sig: tuple, select: str, checked: Callable[[object], torch.Tensor],
          operands: Callable[[], tuple], out_dtype: torch.dtype, what: Callable[[], str]) -> Optional[torch.Tensor]:
    """Run a call on the kernels: its signature's first call through the checked public op of
    :mod:`cutlass_byoc.ops` (`checked(launch)`), later ones straight to `ops.run_problem` on `operands()` (A, B and
    the epilogue source, channels_last), which still validates a (problem, launch) pair it has not seen and every
    pointer's alignment. None (with the reason recorded) when the call must run on PyTorch."""
    from .. import ops  # noqa: PLC0415
    from ..select import choose  # noqa: PLC0415

    problem = problem_for(sig)
    launch = None if problem is None else choose(problem, select)

    def run() -> torch.Tensor:
        if sig in _VALIDATED:
            a, b, source, *bias = operands()  # fprop with bias and residual: the residual is source, then the bias
            n, h, w, c = problem.out_shape
            out = torch.empty((n, c, h, w), dtype=out_dtype, device=a.device, memory_format=CL)
            kw = {"bias": bias[0]} if bias and bias[0] is not None else {}
            ops.run_problem(problem, a, b, out, source, config=launch, **kw)
            return out
        y = checked(launch)
        with _problem_lock:
            _VALIDATED.add(sig)
        return y

    return _on_kernels(kind, launch, run, what)


@functools.lru_cache(maxsize=None)
def _kernel_errors() -> tuple[type[BaseException], ...]:
    """Exceptions meaning "the kernel library cannot run this call", which fall back to the reference."""
    errs: list[type[BaseException]] = [ImportError, OSError]
    from ..ops import UnsupportedConvError  # noqa: PLC0415

    errs.append(UnsupportedConvError)
    for mod, name in (("..runtime", "KernelLaunchError"), ("..build", "CompileError"), ("..toolchain", "ToolchainError")):
        try:
            import importlib  # noqa: PLC0415

            errs.append(getattr(importlib.import_module(mod, __package__), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errs)


def _cl(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None or t.dim() != 4 or t.is_contiguous(memory_format=CL):
        return t
    return t.contiguous(memory_format=CL)


def _pair(v: Sequence[int]) -> list[int]:
    v = list(v)
    return v * 2 if len(v) == 1 else v


def conv_out_size(size: int, k: int, stride: int, pad: int, dil: int) -> int:
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


def apply_activation(y: torch.Tensor, activation: str) -> torch.Tensor:
    """The epilogue activations with PyTorch's definitions (GELU exact, as F.gelu's default)."""
    act = Activation(activation)
    return {
        Activation.IDENTITY: lambda t: t, Activation.RELU: F.relu, Activation.SIGMOID: torch.sigmoid,
        Activation.SILU: F.silu, Activation.HARDSWISH: F.hardswish, Activation.GELU: F.gelu,
    }[act](y)


# ---------------------------------------------------------------------------------------------- references
def reference_fprop(input, weight, bias, residual, stride, padding, dilation, groups, activation, out_dtype):
    """act(conv2d(x, w) + bias + residual) in fp32, one cast to out_dtype, channels_last output."""
    f32 = torch.float32
    y = F.conv2d(input.to(f32), weight.to(f32), bias.to(f32) if bias is not None else None,
                 _pair(stride), _pair(padding), _pair(dilation), groups)
    if residual is not None:
        y = y + residual.to(f32)
    y = apply_activation(y, activation)
    return y.to(out_dtype or input.dtype).contiguous(memory_format=CL)


def reference_dgrad(grad_output, weight, input_size, stride, padding, dilation, groups, out_dtype):
    f32 = torch.float32
    gi = torch.nn.grad.conv2d_input(list(input_size), weight.to(f32), grad_output.to(f32), _pair(stride),
                                    _pair(padding), _pair(dilation), groups)
    return gi.to(out_dtype or grad_output.dtype).contiguous(memory_format=CL)


def reference_wgrad(grad_output, input, weight_size, stride, padding, dilation, groups, out_dtype):
    f32 = torch.float32
    gw = torch.nn.grad.conv2d_weight(input.to(f32), list(weight_size), grad_output.to(f32), _pair(stride),
                                     _pair(padding), _pair(dilation), groups)
    return gw.to(out_dtype or grad_output.dtype).contiguous(memory_format=CL)


def _on_kernels(kind: str, launch, run: Callable[[], torch.Tensor], what: Callable[[], str]) -> Optional[torch.Tensor]:
    """`run()` on this project's kernels, or None with the reason recorded (the caller then runs the reference)."""
    try:
        if launch is None:
            raise ValueError("no kernel computes this problem")
        y = run()
        RUNTIME.kernel(kind)
        return y
    except (ValueError, *_kernel_errors()) as e:
        RUNTIME.fallback(what(), f"{type(e).__name__}: {e}")
        return None


# ---------------------------------------------------------------------------------------------- fprop
@torch.library.custom_op(
    f"{NAMESPACE}::conv2d_fprop", mutates_args=(), tags=_TAGS,
    schema="(Tensor input, Tensor weight, Tensor? bias, Tensor? residual, int[] stride, int[] padding, "
           "int[] dilation, int groups, str activation, ScalarType? out_dtype, str select) -> Tensor",
)
def conv2d_fprop(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 residual: Optional[torch.Tensor], stride: Sequence[int], padding: Sequence[int],
                 dilation: Sequence[int], groups: int, activation: str, out_dtype: Optional[torch.dtype],
                 select: str) -> torch.Tensor:
    """``act(conv2d(input, weight) + bias + residual)`` stored as out_dtype, channels_last (either source optional; the
    bias may be fp32 under a 16-bit output)."""
    args = (input, weight, bias, residual, stride, padding, dilation, groups, activation, out_dtype)
    if input.is_cuda and use_kernels:
        from .. import ops  # noqa: PLC0415

        out_t = out_dtype or input.dtype
        source = ("bias_residual" if bias is not None and residual is not None else "residual" if residual is not None
                  else "bias" if bias is not None else "none")
        sig = _signature("fprop", input.shape, weight.shape, stride, padding, dilation, groups, input.dtype, out_t,
                         activation, source, (weight.dtype, residual.dtype if residual is not None else None,
                                              bias.dtype if bias is not None else None))

        y = _call(
            "fprop", sig, select,
            lambda launch: ops.conv2d(_cl(input), _cl(weight), bias.contiguous() if bias is not None else None,
                                      _pair(stride), _pair(padding), _pair(dilation), groups, activation=activation,
                                      residual=_cl(residual), out_dtype=out_t, config=launch),
            lambda: (_cl(input), _cl(weight), _cl(residual) if residual is not None else
                     bias.contiguous() if bias is not None else None,
                     bias.contiguous() if bias is not None and residual is not None else None),
            out_t,
            lambda: f"fprop {tuple(input.shape)}x{tuple(weight.shape)} {input.dtype}->{out_dtype} {activation}")
        if y is not None:
            return y
    RUNTIME.reference()
    return reference_fprop(*args)


@conv2d_fprop.register_fake
def _conv2d_fprop_fake(input, weight, bias, residual, stride, padding, dilation, groups, activation, out_dtype,
                       select):
    n, _, h, w = input.shape
    k, _, r, s = weight.shape
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    p, q = conv_out_size(h, r, sh, ph, dh), conv_out_size(w, s, sw, pw, dw)
    return input.new_empty((n, k, p, q), dtype=out_dtype or input.dtype).contiguous(memory_format=CL)


# ---------------------------------------------------------------------------------------------- dgrad
@torch.library.custom_op(
    f"{NAMESPACE}::conv2d_dgrad", mutates_args=(), tags=_TAGS,
    schema="(Tensor grad_output, Tensor weight, SymInt[] input_size, int[] stride, int[] padding, int[] dilation, "
           "int groups, ScalarType? out_dtype, str select) -> Tensor",
)
def conv2d_dgrad(grad_output: torch.Tensor, weight: torch.Tensor, input_size: Sequence[int], stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], groups: int, out_dtype: Optional[torch.dtype],
                 select: str) -> torch.Tensor:
    """grad_input of conv2d (also the forward of a transposed conv), channels_last."""
    args = (grad_output, weight, input_size, stride, padding, dilation, groups, out_dtype)
    if grad_output.is_cuda and use_kernels:
        from .. import ops  # noqa: PLC0415

        out_t = out_dtype or grad_output.dtype
        sig = _signature("dgrad", input_size, weight.shape, stride, padding, dilation, groups, grad_output.dtype,
                         out_t, operand_dtypes=(weight.dtype, tuple(grad_output.shape)))

        y = _call(
            "dgrad", sig, select,
            lambda launch: ops.conv2d_dgrad(_cl(grad_output), _cl(weight), list(input_size), _pair(stride),
                                            _pair(padding), _pair(dilation), groups, out_dtype=out_t, config=launch),
            lambda: (_cl(grad_output), _cl(weight), None), out_t,
            lambda: f"dgrad {tuple(grad_output.shape)}x{tuple(weight.shape)}->{tuple(input_size)} {grad_output.dtype}")
        if y is not None:
            return y
    RUNTIME.reference()
    return reference_dgrad(*args)


@conv2d_dgrad.register_fake
def _conv2d_dgrad_fake(grad_output, weight, input_size, stride, padding, dilation, groups, out_dtype, select):
    return grad_output.new_empty(list(input_size), dtype=out_dtype or grad_output.dtype).contiguous(memory_format=CL)


# ---------------------------------------------------------------------------------------------- wgrad
@torch.library.custom_op(
    f"{NAMESPACE}::conv2d_wgrad", mutates_args=(), tags=_TAGS,
    schema="(Tensor grad_output, Tensor input, SymInt[] weight_size, int[] stride, int[] padding, int[] dilation, "
           "int groups, ScalarType? out_dtype, str select) -> Tensor",
)
def conv2d_wgrad(grad_output: torch.Tensor, input: torch.Tensor, weight_size: Sequence[int], stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], groups: int, out_dtype: Optional[torch.dtype],
                 select: str) -> torch.Tensor:
    """grad_weight of conv2d accumulated in fp32, stored as out_dtype (fp32 for fp32 master weights), KRSC."""
    args = (grad_output, input, weight_size, stride, padding, dilation, groups, out_dtype)
    if grad_output.is_cuda and use_kernels:
        from .. import ops  # noqa: PLC0415

        out_t = out_dtype or grad_output.dtype
        sig = _signature("wgrad", input.shape, weight_size, stride, padding, dilation, groups, input.dtype, out_t,
                         operand_dtypes=(grad_output.dtype, tuple(grad_output.shape)))

        y = _call(
            "wgrad", sig, select,
            lambda launch: ops.conv2d_wgrad(_cl(grad_output), _cl(input), list(weight_size), _pair(stride),
                                            _pair(padding), _pair(dilation), groups, out_dtype=out_t, config=launch),
            lambda: (_cl(grad_output), _cl(input), None), out_t,
            lambda: f"wgrad {tuple(grad_output.shape)}x{tuple(input.shape)}->{tuple(weight_size)} "
                    f"{input.dtype}->{out_dtype}")
        if y is not None:
            return y
    RUNTIME.reference()
    return reference_wgrad(*args)


@conv2d_wgrad.register_fake
def _conv2d_wgrad_fake(grad_output, input, weight_size, stride, padding, dilation, groups, out_dtype, select):
    return input.new_empty(list(weight_size), dtype=out_dtype or grad_output.dtype).contiguous(memory_format=CL)


FPROP = torch.ops.cutlass_byoc.conv2d_fprop.default
DGRAD = torch.ops.cutlass_byoc.conv2d_dgrad.default
WGRAD = torch.ops.cutlass_byoc.conv2d_wgrad.default
