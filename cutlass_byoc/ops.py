"""The public tensor API: conv2d fprop, dgrad and wgrad on torch CUDA tensors in PyTorch's argument conventions.

Tensors are channels_last (NHWC in memory; the filter KRSC) and must live on the GPU. What no kernel of this
project can compute raises `UnsupportedConvError` naming the parameter, or, with ``fallback=True``, runs in
PyTorch (cuDNN) and logs the reason.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

from .candidates import unsupported_reason
from .config import LaunchConfig, fold_phases
from .problem import Conv2dProblem, Epilogue, ProblemError, max_alignment
from .rewrite import d2s_filter, d2s_image, pad_channels, s2d_filter, s2d_image, unpad_channels
from .runtime import CbConv2dArgs, KernelLaunchError, KernelLibrary, load_kernel, make_args, pointer_rules
from .select import (SelectMode, accepts_alignments, address_alignments, alignment_refusal, choose,
                     choose_for_alignments)
from .types import Activation, ConvKind, DType, SourceKind

log = logging.getLogger("cutlass_byoc.ops")


class UnsupportedConvError(ValueError):
    """No kernel of this project computes the call; the message names the parameter and what was expected."""


def _torch():
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover
        raise ImportError("cutlass_byoc.ops needs PyTorch: pip install 'cutlass-byoc[torch]'") from e
    return torch


def _pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    if len(v) == 1:
        return (int(v[0]), int(v[0]))
    if len(v) != 2:
        raise UnsupportedConvError(f"{name}: expected an int or a pair for conv2d, got {v}")
    return (int(v[0]), int(v[1]))


def _check_tensor(t, name: str, dtype=None, channels_last: bool = True) -> None:
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise UnsupportedConvError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise UnsupportedConvError(f"{name}: expected a CUDA tensor, got device {t.device}")
    if dtype is not None and t.dtype != dtype:
        raise UnsupportedConvError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if channels_last:
        if t.dim() != 4:
            raise UnsupportedConvError(f"{name}: expected a 4-D tensor, got shape {tuple(t.shape)}")
        if not t.is_contiguous(memory_format=torch.channels_last):
            raise UnsupportedConvError(
                f"{name}: expected channels_last contiguous memory (NHWC), got strides {t.stride()} for shape "
                f"{tuple(t.shape)}; use t.contiguous(memory_format=torch.channels_last)"
            )
    elif not t.is_contiguous():
        raise UnsupportedConvError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def _dtype(t, name: str = "input") -> DType:
    """DType of a tensor, or of a torch.dtype given directly (then `name` is the argument that named it)."""
    try:
        return DType.from_torch(getattr(t, "dtype", t))
    except ValueError as e:
        raise UnsupportedConvError(f"{name} {e}") from None


# ---------------------------------------------------------------------------------------------- workspace
def _workspace(device, nbytes: int):
    """The launch's workspace, from PyTorch's caching allocator and dead after the call (stream-ordered reuse makes
    it as cheap as a persistent buffer). Never a buffer kept across calls: under CUDA graph capture that would be a
    tensor of the graph's pool that no output tracks (cudagraph trees refuse it)."""
    torch = _torch()
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------------------------------- launch
def _narrow_to_pointers(launch: LaunchConfig, problem: Conv2dProblem, a, b, d, source, bias=None, *,
                        explicit: bool = False) -> LaunchConfig:
    """The launch for these operands (anything with a data_ptr(); None where absent): `launch` itself if their
    addresses allow its alignments, else one re-chosen among the configs that accept the alignments the addresses
    allow (a view with an odd storage offset): see select.choose_for_alignments. `explicit`: `launch` was given
    by the caller, not chosen. Raises UnsupportedConvError naming the operand(s) when no config accepts them."""
    addr = lambda t: t.data_ptr() if t is not None else 0  # noqa: E731
    caps = address_alignments(problem, addr(a), addr(b), addr(d), addr(source), addr(bias))
    if accepts_alignments(launch.kernel, caps):
        return launch
    chosen = choose_for_alignments(problem, caps, launch, explicit=explicit)
    if chosen is None:
        raise UnsupportedConvError(alignment_refusal(problem, caps, addr(a), addr(b), addr(d), addr(source), addr(bias)))
    return chosen


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A launch validated once for one problem: every later call only checks pointer alignment and launches."""

    lib: KernelLibrary
    template: CbConv2dArgs  # the problem's arguments; pointers are filled per call
    workspace_bytes: int
    align_bytes: tuple[int, int, int]  # what A, B and the output (and source) addresses must be multiples of
    needs_source: bool
    source_bytes: int = 0  # what the source address must be a multiple of, where not align_bytes[2] (a bias vector)
    bias_bytes: int = 0  # what the bias address must be a multiple of (SourceKind.BIAS_RESIDUAL); 0: no bias pointer

    def fits(self, pa: int, pb: int, pd: int, ps: int, pbias: int = 0) -> bool:
        """Whether these pointers may take the fast path (else the full checks run and say what is wrong)."""
        aa, ab, ac = self.align_bytes
        if not (pa and pb and pd) or (self.needs_source and not ps):
            return False
        if self.bias_bytes and (not pbias or pbias % self.bias_bytes):
            return False
        return not (pa % aa or pb % ab or pd % ac or ps % (self.source_bytes or ac))


_prepared: dict[tuple[Conv2dProblem, LaunchConfig], _Prepared] = {}


def _prepare(problem: Conv2dProblem, launch: LaunchConfig) -> _Prepared:
    why = launch.reject_reason(problem)
    if why:
        raise UnsupportedConvError(f"config {launch.name} cannot compute {problem.name}: {why}")
    lib = load_kernel(launch.kernel)
    why = lib.can_implement(problem, launch.split_k_slices)
    if why:
        raise UnsupportedConvError(f"{launch.name}: {why}")
    k = launch.kernel
    out_bytes = k.align_c * k.element_out.nbytes
    rules = {name: nbytes for name, _, nbytes in pointer_rules(k, problem)}
    return _Prepared(lib, make_args(problem, launch.split_k_slices), lib.workspace_size(problem, launch.split_k_slices),
                     (k.align_a * k.element_a.nbytes, k.align_b * k.element_b.nbytes, out_bytes),
                     problem.epilogue.source is not SourceKind.NONE, rules.get("source", 0), rules.get("bias", 0))


def bind(problem: Conv2dProblem, launch: LaunchConfig) -> Optional[_Prepared]:
    """`launch` validated for `problem` once (config rules, the kernel's can_implement, workspace size, the argument
    block), for callers that then launch on checked pointers themselves (the offload's call sites); None where
    the launch needs run_problem's general path (channel-padded or space-to-depth problems). Raises UnsupportedConvError (naming the
    parameter) when the launch cannot compute the problem."""
    why = problem.int32_overflow
    if why:
        raise UnsupportedConvError(f"size: {why}")
    if launch.padded:
        return None
    return _prepared_launch(problem, launch)


def _prepared_launch(problem: Conv2dProblem, launch: LaunchConfig) -> _Prepared:
    """`launch` prepared for `problem`, validated once per pair and remembered."""
    prep = _prepared.get((problem, launch))
    if prep is None:
        prep = _prepared[(problem, launch)] = _prepare(problem, launch)
    return prep


def run_problem(problem: Conv2dProblem, a, b, out, source=None, *, config: Optional[LaunchConfig] = None,
                select: SelectMode | str = SelectMode.CACHED, bias=None, stats=None) -> None:
    """Compute `problem` from tensors a, b (and the epilogue source) into `out` on the current stream.

    `source` is the epilogue's bias (SourceKind.BIAS) or residual (RESIDUAL, BIAS_RESIDUAL); `bias` is the bias of
    BIAS_RESIDUAL. `stats` (a channel-statistics launch only, KernelConfig.channel_stats): a contiguous float32
    tensor of 2 x K that receives the per-channel sums of the output and the sums of their squares.

    The first call of a (problem, launch) pair validates everything (sizes, config rules, the kernel's own
    can_implement, workspace); later calls with suitably aligned pointers go straight to the launch."""
    torch = _torch()
    launch = config or choose(problem, select)
    if launch is not None and (stats is not None or launch.kernel.channel_stats):
        _stats_pointer(launch.kernel, problem, stats)  # before anything loads: a wrong pairing names the parameter
    pa, pb, pd = a.data_ptr(), b.data_ptr(), out.data_ptr()
    ps = source.data_ptr() if source is not None else 0
    pbias = bias.data_ptr() if bias is not None else 0
    prep = _prepared.get((problem, launch)) if launch is not None else None
    if prep is None or not prep.fits(pa, pb, pd, ps, pbias):
        why = problem.int32_overflow
        if why:
            raise UnsupportedConvError(f"size: {why}")
        if launch is None:
            raise UnsupportedConvError(unsupported_reason(problem) or f"no kernel computes {problem.name}")
        if launch.padded:
            return _run_rewritten(problem, launch, a, b, out, source, bias)
        why = launch.reject_reason(problem)
        if why:
            raise UnsupportedConvError(f"config {launch.name} cannot compute {problem.name}: {why}")
        narrowed = _narrow_to_pointers(launch, problem, a, b, out, source, bias, explicit=config is not None)
        prep = _prepared_launch(problem, narrowed)  # a re-chosen launch too: later offset views skip its validation
        prep.lib.check_pointers(problem, pa, pb, pd, ps, pbias)  # null or misaligned pointers: an error naming it
    args = CbConv2dArgs.from_buffer_copy(prep.template)
    args.a, args.b, args.d, args.source = pa, pb, pd, ps or None
    args.bias = pbias or None
    if prep.lib.config.channel_stats or stats is not None:
        args.stats = _stats_pointer(prep.lib.config, problem, stats)
    device = a.device
    stream = torch.cuda.current_stream(device).cuda_stream
    ws_ptr = ws_len = 0
    if prep.workspace_bytes:
        ws = _workspace(device, prep.workspace_bytes)
        ws_ptr, ws_len = ws.data_ptr(), ws.numel()
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            prep.lib.launch(args, ws_ptr, ws_len, stream)
    else:
        prep.lib.launch(args, ws_ptr, ws_len, stream)


def _stats_pointer(kernel, problem: Conv2dProblem, stats) -> int:
    """The address of the statistics buffer of a channel-statistics launch, checked (a kernel without the epilogue
    takes none: asking one for statistics is an error, not a silent no-op)."""
    torch = _torch()
    if not kernel.channel_stats:
        raise UnsupportedConvError(f"stats: kernel {kernel.name} has no channel-statistics epilogue")
    if stats is None:
        raise UnsupportedConvError(f"stats: kernel {kernel.name} writes channel statistics and needs a stats tensor")
    if (stats.dtype != torch.float32 or tuple(stats.shape) != (2, problem.k) or not stats.is_contiguous()
            or stats.data_ptr() % 16):
        raise UnsupportedConvError(f"stats: expected a contiguous, 16-byte aligned float32 tensor of shape (2, "
                                   f"{problem.k}), got {stats.dtype} {tuple(stats.shape)}")
    return stats.data_ptr()


def conv2d_channel_stats(input, weight, stride=1, padding=0, dilation=1, *, out_dtype=None,
                         config: Optional[LaunchConfig] = None, select: SelectMode | str = SelectMode.CACHED):
    """``y = conv2d(input, weight)`` (no bias) and, from the same kernel's epilogue, ``stats``: float32 of 2 x K, the
    sums over batch and pixels of y (as stored, i.e. rounded to its type) per output channel, then the sums of
    their squares. The batch-norm statistics of y without a second read of it: mean = stats[0] / (N*P*Q),
    var = stats[1] / (N*P*Q) - mean**2.

    ``config``: a channel-statistics launch (KernelConfig.channel_stats), else the launch chosen for the plain
    problem (decision or heuristic) turned into its channel-statistics twin. Raises UnsupportedConvError where no
    such kernel exists (the sm90 conv family's fprop kernels, non-persistent and ping-pong, have the epilogue)."""
    torch = _torch()
    _check_tensor(input, "input")
    _check_tensor(weight, "weight", dtype=input.dtype)
    out_t = out_dtype or input.dtype
    n, c, h, w = input.shape
    k, cg, r, s = weight.shape
    if cg != c:
        raise UnsupportedConvError(f"weight: expected {c} input channels, got {cg} (grouped convs have no statistics "
                                   "epilogue)")
    problem = _problem(ConvKind.FPROP, n, c, h, w, k, r, s, stride, padding, dilation, 1, input, out_t, None,
                       Epilogue())
    if config is None:
        plain = choose(problem, select)
        config = plain.with_channel_stats() if plain is not None else None
        if config is None:
            raise UnsupportedConvError(f"channel statistics: the launch for {problem.name} "
                                       f"({plain.name if plain else 'none'}) has no channel-statistics twin")
    elif not config.kernel.channel_stats:
        raise UnsupportedConvError(f"config: {config.name} has no channel-statistics epilogue")
    out = torch.empty((n, k, problem.p, problem.q), dtype=out_t, device=input.device, memory_format=torch.channels_last)
    stats = torch.empty((2, k), dtype=torch.float32, device=input.device)
    run_problem(problem, input, weight, out, config=config, select=select, stats=stats)
    return out, stats


_rewritten_problems: dict[tuple[Conv2dProblem, LaunchConfig], Conv2dProblem] = {}


def _rewritten_problem(problem: Conv2dProblem, launch: LaunchConfig) -> Conv2dProblem:
    """`launch.kernel_problem(problem)`, the launch validated for `problem` once per pair (the kernel's own checks
    run in the inner run_problem)."""
    big = _rewritten_problems.get((problem, launch))
    if big is None:
        why = launch.reject_reason(problem)
        if why:
            raise UnsupportedConvError(f"config {launch.name} cannot compute {problem.name}: {why}")
        big = _rewritten_problems.setdefault((problem, launch), launch.kernel_problem(problem))
    return big


def _rewrite_image(problem: Conv2dProblem, launch: LaunchConfig, big: Conv2dProblem, t):
    """x (or dgrad's dx-shaped residual) as the kernel of `launch` reads it: folded and/or channel-padded."""
    if launch.s2d == 1:
        return pad_channels(t, None, big.c)
    return s2d_image(t, launch.s2d, problem.pad_h, problem.pad_w, big.h, big.w, big.c,
                     fold_phases(problem.r, problem.s, launch.s2d))


def _rewrite_filter(launch: LaunchConfig, big: Conv2dProblem, t):
    """w (or wgrad's dw-shaped residual) as the kernel of `launch` reads it."""
    return pad_channels(t, big.k, big.c) if launch.s2d == 1 else s2d_filter(t, launch.s2d, big.c, big.k)


def rewrite_operands(problem: Conv2dProblem, launch: LaunchConfig, a, b):
    """(the problem the kernel computes, a, b) for a launch that rewrites its operands (`LaunchConfig.padded`): the
    inputs folded (`launch.s2d`) and/or zero-padded in C and K, as `_run_rewritten` gives them to the kernel."""
    big = _rewritten_problem(problem, launch)
    kind = problem.kind
    if kind is ConvKind.FPROP:  # a = x (N, C, H, W), b = w (K, C, R, S)
        return big, _rewrite_image(problem, launch, big, a), _rewrite_filter(launch, big, b)
    if kind is ConvKind.DGRAD:  # a = dy (N, K, P, Q), b = w (K, C, R, S)
        return big, pad_channels(a, None, big.k), _rewrite_filter(launch, big, b)
    return big, pad_channels(a, None, big.k), _rewrite_image(problem, launch, big, b)  # wgrad: a = dy, b = x


def _run_rewritten(problem: Conv2dProblem, launch: LaunchConfig, a, b, out, source, bias=None) -> None:
    """Run a launch whose kernel computes a rewritten problem (`LaunchConfig.kernel_problem`): the space-to-depth
    fold of a strided conv (`launch.s2d`), then C and K zero-padded (`pad_c`, `pad_k`). The operands and the
    epilogue source are rewritten to match (cutlass_byoc.rewrite), the kernel runs on the rewritten problem, and the
    real output is copied out. Both rewrites compute exactly the same sums (zero channels and zero taps add nothing;
    padded output channels are dropped). Everything runs on the current stream: the profiler times this whole
    function, rewrites included, as it times every launch through run_problem."""
    big, a_p, b_p = rewrite_operands(problem, launch, a, b)
    kind = problem.kind
    torch = _torch()
    out_p = out
    if big.out_shape != problem.out_shape:
        n, h, w, c = big.out_shape  # NHWC (KRSC for wgrad); the tensors are logical NCHW in channels_last
        out_p = torch.empty((n, c, h, w), dtype=out.dtype, device=out.device, memory_format=torch.channels_last)
    src_p = bias_p = None
    if source is not None:  # a bias (over K: fprop alone takes one), or a residual shaped like the output
        if source.dim() == 1:
            src_p = pad_channels(source, big.k, None)
        elif kind is ConvKind.FPROP:
            src_p = pad_channels(source, None, big.k)
        elif kind is ConvKind.DGRAD:
            src_p = _rewrite_image(problem, launch, big, source)
        else:
            src_p = _rewrite_filter(launch, big, source)
    if bias is not None:
        bias_p = pad_channels(bias, big.k, None)
    run_problem(big, a_p, b_p, out_p, src_p, config=launch.unpadded, bias=bias_p)
    if out_p is out:
        return
    if launch.s2d == 1 or kind is ConvKind.FPROP:
        unpad_channels(out_p, out)
    elif kind is ConvKind.DGRAD:
        d2s_image(out_p, launch.s2d, problem.pad_h, problem.pad_w, out, fold_phases(problem.r, problem.s, launch.s2d))
    else:
        d2s_filter(out_p, launch.s2d, out)


# ---------------------------------------------------------------------------------------------- public ops
def conv2d(
    input, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1, *,
    activation: Activation | str = Activation.IDENTITY, residual=None, out_dtype=None, acc_dtype=None,
    config: Optional[LaunchConfig] = None, select: SelectMode | str = SelectMode.CACHED, fallback: bool = False,
):
    """``act(conv2d(input, weight) + bias + residual)`` like torch.nn.functional.conv2d, fused in one kernel.

    ``out_dtype`` (default: the input's) may differ from the input type: fp16 inputs with an fp32 output accumulate
    and store in fp32; fp32 accumulation with an fp16 output stores fp16 directly (no separate cast).
    ``bias`` has the output's type or float32 (an fp32 bias under a 16-bit output is added in fp32, unrounded);
    ``residual`` has the output's type. Bias and residual together are one epilogue: act(conv + bias + residual).
    """
    torch = _torch()
    activation = Activation(activation)
    try:
        _check_tensor(input, "input")
        _check_tensor(weight, "weight", dtype=input.dtype)
        out_t = out_dtype or input.dtype
        bias_dt = None
        if bias is not None:
            _check_tensor(bias, "bias", channels_last=False)
            if bias.dtype not in (out_t, torch.float32):
                raise UnsupportedConvError(f"bias: expected dtype {out_t} (the output's) or torch.float32, got {bias.dtype}")
            bias_dt = _dtype(bias, "bias")
            if tuple(bias.shape) != (weight.shape[0],):
                raise UnsupportedConvError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        n, c, h, w = input.shape
        k, cg, r, s = weight.shape
        if cg * groups != c:
            raise UnsupportedConvError(f"weight: expected {c // groups} input channels per group, got {cg}")
        source = (SourceKind.BIAS_RESIDUAL if bias is not None and residual is not None else SourceKind.BIAS
                  if bias is not None else SourceKind.RESIDUAL if residual is not None else SourceKind.NONE)
        problem = _problem(ConvKind.FPROP, n, c, h, w, k, r, s, stride, padding, dilation, groups, input,
                           out_t, acc_dtype, Epilogue(activation, source, bias_dt))
        out = torch.empty((n, k, problem.p, problem.q), dtype=out_t, device=input.device,
                          memory_format=torch.channels_last)
        if residual is not None:
            _check_tensor(residual, "residual", dtype=out_t)
            if tuple(residual.shape) != tuple(out.shape):
                raise UnsupportedConvError(f"residual: expected shape {tuple(out.shape)}, got {tuple(residual.shape)}")
        if source is SourceKind.BIAS_RESIDUAL:
            run_problem(problem, input, weight, out, residual, config=config, select=select, bias=bias)
        else:
            run_problem(problem, input, weight, out, bias if bias is not None else residual, config=config,
                        select=select)
        return out
    except (UnsupportedConvError, KernelLaunchError) as e:
        if not fallback:
            raise
        log.info("conv2d falls back to PyTorch: %s", e)
        if bias is not None and bias.dtype != input.dtype:  # an fp32 bias under 16-bit inputs: add it unrounded
            y = torch.nn.functional.conv2d(input, weight, None, stride, padding, dilation, groups).float()
            y = y + bias.float().view(1, -1, 1, 1)
        else:
            y = torch.nn.functional.conv2d(input, weight, bias, stride, padding, dilation, groups)
        if residual is not None:
            y = y + residual
        return _apply_activation(y, activation).to(out_dtype or input.dtype)


def conv2d_dgrad(
    grad_output, weight, input_size: Sequence[int], stride=1, padding=0, dilation=1, groups: int = 1, *,
    out_dtype=None, acc_dtype=None, config: Optional[LaunchConfig] = None,
    select: SelectMode | str = SelectMode.CACHED,
):
    """grad_input of conv2d (torch.nn.grad.conv2d_input): dx from dy and w. Strided dgrad runs CUTLASS's
    strided-dgrad kernel, unit stride the faster unity kernel."""
    torch = _torch()
    _check_tensor(grad_output, "grad_output")
    _check_tensor(weight, "weight", dtype=grad_output.dtype)
    n, c, h, w = (int(v) for v in input_size)
    k, cg, r, s = weight.shape
    out_t = out_dtype or grad_output.dtype
    problem = _problem(ConvKind.DGRAD, n, c, h, w, k, r, s, stride, padding, dilation, groups, grad_output,
                       out_t, acc_dtype, Epilogue())
    _check_grad_output(grad_output, problem)
    out = torch.empty((n, c, h, w), dtype=out_t, device=grad_output.device, memory_format=torch.channels_last)
    run_problem(problem, grad_output, weight, out, config=config, select=select)
    return out


def conv2d_wgrad(
    grad_output, input, weight_size: Sequence[int], stride=1, padding=0, dilation=1, groups: int = 1, *,
    out_dtype=None, accumulate_into=None, config: Optional[LaunchConfig] = None,
    select: SelectMode | str = SelectMode.CACHED,
):
    """grad_weight of conv2d (torch.nn.grad.conv2d_weight): dw from dy and x, always accumulated in fp32.

    ``out_dtype=torch.float32`` with 16-bit inputs gives fp32 gradients for fp32 master weights in one kernel;
    ``accumulate_into`` (a tensor of the weight's shape and out_dtype) adds into an existing gradient.
    """
    torch = _torch()
    _check_tensor(grad_output, "grad_output")
    _check_tensor(input, "input", dtype=grad_output.dtype)
    k, cg, r, s = (int(v) for v in weight_size)
    n, c, h, w = input.shape
    out_t = out_dtype or grad_output.dtype
    source = SourceKind.RESIDUAL if accumulate_into is not None else SourceKind.NONE
    problem = _problem(ConvKind.WGRAD, n, c, h, w, k, r, s, stride, padding, dilation, groups, input,
                       out_t, DType.F32, Epilogue(Activation.IDENTITY, source))
    _check_grad_output(grad_output, problem)
    out = torch.empty((k, cg, r, s), dtype=out_t, device=input.device, memory_format=torch.channels_last)
    if accumulate_into is not None:
        _check_tensor(accumulate_into, "accumulate_into", dtype=out_t)
    run_problem(problem, grad_output, input, out, accumulate_into, config=config, select=select)
    return out


def convolution_backward(
    grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed: bool, output_padding,
    groups: int, output_mask: Sequence[bool], *, select: SelectMode | str = SelectMode.CACHED,
):
    """Same arguments and results as ``torch.ops.aten.convolution_backward`` (non-transposed conv2d)."""
    if transposed:
        raise UnsupportedConvError("transposed: convolution_backward of a transposed conv is not offloaded")
    if any(_pair(output_padding, "output_padding")):
        raise UnsupportedConvError(f"output_padding: expected 0 for a plain conv2d, got {output_padding}")
    gi = gw = gb = None
    if output_mask[0]:
        gi = conv2d_dgrad(grad_output, weight, input.shape, stride, padding, dilation, groups, select=select)
    if output_mask[1]:
        gw = conv2d_wgrad(grad_output, input, weight.shape, stride, padding, dilation, groups,
                          out_dtype=weight.dtype, select=select)
    if output_mask[2]:
        gb = grad_output.sum(dim=(0, 2, 3), dtype=_torch().float32).to(grad_output.dtype)
    return gi, gw, gb


# ---------------------------------------------------------------------------------------------- helpers
def _check_grad_output(grad_output, problem: Conv2dProblem) -> None:
    want = (problem.n, problem.k, problem.p, problem.q)
    if tuple(grad_output.shape) != want:
        raise UnsupportedConvError(f"grad_output: expected shape {want} for {problem.name}, got {tuple(grad_output.shape)}")


def _problem(kind, n, c, h, w, k, r, s, stride, padding, dilation, groups, ref, out_dt, acc_dtype, epilogue):
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")
    el = _dtype(ref)
    out_dt = _dtype(out_dt, "out_dtype")
    acc = acc_dtype if isinstance(acc_dtype, DType) else _dtype(acc_dtype, "acc_dtype") if acc_dtype else DType.F32
    try:
        return Conv2dProblem(kind=kind, n=int(n), h=int(h), w=int(w), c=int(c), k=int(k), r=int(r), s=int(s),
                             pad_h=ph, pad_w=pw, stride_h=sh, stride_w=sw, dilation_h=dh, dilation_w=dw,
                             groups=int(groups), element_a=el, element_b=el, element_out=out_dt, element_acc=acc,
                             epilogue=epilogue)
    except ProblemError as e:
        raise UnsupportedConvError(str(e)) from None


def _apply_activation(y, activation: Activation):
    """The epilogue activations with PyTorch's definitions (GELU exact, as F.gelu's default; ReLU6 as F.relu6): the
    references of the tests and the profiler, and the PyTorch side of the offloaded ops."""
    F = _torch().nn.functional
    return {
        Activation.IDENTITY: lambda t: t, Activation.RELU: F.relu, Activation.SIGMOID: _torch().sigmoid,
        Activation.SILU: F.silu, Activation.HARDSWISH: F.hardswish, Activation.GELU: F.gelu, Activation.RELU6: F.relu6,
    }[activation](y)
