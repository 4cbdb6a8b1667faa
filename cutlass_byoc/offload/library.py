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
* Call sites: the partitioner resolves each offloaded call's problem when the graph is compiled and registers it
  as a :class:`CallSite`, whose index the op receives (``site``). A site's first call chooses the launch, loads the
  library and prepares its argument block, output shape and strides and workspace size (``ops.bind``); every later
  call checks the operands' shapes, dtypes, layout and pointer alignment against that (a few attribute reads), fills
  in the pointers and launches: no problem is rebuilt and nothing is looked up by key. Any mismatch takes the general
  path below, which checks everything; nothing unchecked ever reaches a kernel. On CUDA those later calls run in C++
  (:mod:`.native`: the call-site ops' CUDA kernels, handed each binding by ``bind``), the Python functions below
  serving as their twins (``*_site_py``) for first calls and mismatches. Workspaces come from PyTorch's
  caching allocator per call and no call synchronizes, so the ops can be captured in CUDA graphs.
* General path (the ``conv2d_*`` ops, every parameter an argument; a call-site op whose call does not match its
  site runs it too): the ops call :mod:`cutlass_byoc.ops` with the
  launch chosen once per distinct problem (:func:`_call`;
  ``select`` = tune / cached / heuristic as given by the backend's options): a call signature's first call goes
  through the checked public op, later ones straight to ``ops.run_problem``. If the kernel library cannot run a call
  (no kernel, a launch or compile error, no CUDA toolchain), the call falls back to the PyTorch reference and the
  reason is logged and recorded in :data:`RUNTIME`. On any other device the reference runs: it computes in fp32 and
  casts once to the output type, i.e. what the kernels compute (fp32 accumulation, epilogue in fp32, one rounding at
  the store).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import threading
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..runtime import CbConv2dArgs
from . import native
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

    general_calls: dict[str, int] = dataclasses.field(default_factory=dict)  # kernel launches off the call sites
    fallbacks: dict[str, str] = dataclasses.field(default_factory=dict)
    reference_calls: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def kernel_calls(self) -> dict[str, int]:
        """Kernel launches by pass ("fprop" / "dgrad" / "wgrad"): call sites' and the general path's."""
        out = dict(self.general_calls)
        for k, n in site_calls().items():
            out[k] = out.get(k, 0) + n
        return out

    def kernel(self, key: str) -> None:
        with self._lock:
            self.general_calls[key] = self.general_calls.get(key, 0) + 1

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
            self.general_calls.clear()
            for site in (*_SITES, *_STATS_SITES):
                site.calls = 0
            nat = native.loaded()
            if nat is not None:
                nat.reset_calls()
            self.fallbacks.clear()
            self.reference_calls = 0


RUNTIME = RuntimeRecord()

#: False forces the PyTorch reference even on CUDA (debugging, A/B checks): set it with set_use_kernels().
use_kernels = True


def set_use_kernels(on: bool) -> None:
    """Run offloaded calls on the kernels (True, the default) or on the PyTorch reference (False)."""
    global use_kernels
    use_kernels = bool(on)
    nat = native.loaded()
    if nat is not None:
        nat.enable(use_kernels)


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
    """The epilogue activations with PyTorch's definitions (ops._apply_activation)."""
    from ..ops import _apply_activation  # noqa: PLC0415

    return _apply_activation(y, Activation(activation))


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


# ---------------------------------------------------------------------------------------------- call sites
_TORCH_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class CallSite:
    """One offloaded call of a compiled graph: its problem, resolved when the graph is compiled; the launch bound at
    its first call (:meth:`bind`); every call after that only checks its operands against the binding and launches.

    A site with a symbolic batch size (``dynamic``: torch.compile's dynamic graph) has its problem at the size the
    graph was traced at (the plan) and one binding per batch size met at run time (:meth:`bind_batch`), each bound
    at that size's first call: the decision recorded for that exact problem if there is one, else the plan's launch
    (its split count lowered where the smaller reduction needs it), else the selection's launch for that problem.
    Each binding is checked for its own problem (the config rules and the kernel's can_implement) like any other.

    ``__call__`` returns None where the call must take the general path: the binding failed (the reason is recorded
    there), or the operands differ from what the site was compiled for (shape, dtype, layout, or a pointer alignment
    the kernel cannot take)."""

    __slots__ = ("kind", "problem", "select", "source_shape", "state", "calls", "index", "dynamic", "batches",
                 "deterministic", "__weakref__")

    def __init__(self, kind: str, problem, select: str, source_shape: Optional[tuple] = None,
                 index: int = -1, dynamic: bool = False, deterministic: bool = False) -> None:
        self.index = index  # in the site table (the ops' `site` argument)
        self.kind = kind
        self.problem = problem
        self.select = select
        self.source_shape = source_shape  # the epilogue source's shape: (K,) for a bias, the output's for a residual
        self.state = None  # None: not bound yet; False: general path; else a _Bound
        self.calls = 0
        self.dynamic = dynamic  # symbolic batch size: self.problem is the plan, one binding per batch size
        self.batches: dict[int, object] = {}  # dynamic: batch size -> _Bound, or False (general path)
        # OffloadOptions.deterministic: bound under gemm1x1.forced_determinism (deterministic kernels only)
        self.deterministic = deterministic

    @property
    def launches(self) -> int:
        """Kernel launches through this site: the Python path's and the C++ path's."""
        nat = native.loaded()
        return self.calls + (nat.calls(self.index) if nat is not None and self.index >= 0 else 0)

    @property
    def conv_args(self) -> tuple[list[int], list[int], list[int], int]:
        """stride, padding, dilation and groups in the general ops' argument form."""
        p = self.problem
        return [p.stride_h, p.stride_w], [p.pad_h, p.pad_w], [p.dilation_h, p.dilation_w], p.groups

    @property
    def out_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.problem.element_out.value]

    def empty_output(self, like: torch.Tensor) -> torch.Tensor:
        """The output's metadata (the call-site ops' fake implementation): channels_last, the problem's shape; with
        a symbolic batch, `like`'s batch size (the first operand's: input or grad_output) for fprop and dgrad."""
        n, h, w, c = self.problem.out_shape
        if self.dynamic and self.kind != "wgrad":
            n = like.shape[0]
        return like.new_empty((n, c, h, w), dtype=self.out_dtype).contiguous(memory_format=CL)

    def bind(self, device: torch.device):
        """Choose the launch and prepare it (``ops.bind``); False if the site must take the general path."""
        from ..gemm1x1 import forced_determinism  # noqa: PLC0415
        from ..select import choose  # noqa: PLC0415

        with forced_determinism(self.deterministic):
            self.state = self._bind(self.problem, (lambda: choose(self.problem, self.select),), self.source_shape,
                                    False)
        return self.state

    def bind_batch(self, n: int):
        """The binding of a dynamic site at batch size `n` (made once per size); False for the general path."""
        st = self.batches.get(n)
        if st is None:
            problem = self.problem.replace(n=n)
            src = self.source_shape
            if src is not None and len(src) == 4:  # a residual: the output's shape at this batch
                src = (n, *src[1:])
            from ..gemm1x1 import forced_determinism  # noqa: PLC0415

            with forced_determinism(self.deterministic):
                st = self.batches[n] = self._bind(problem, self._batch_launches(problem), src, True)
        return st

    def _batch_launches(self, problem) -> list:
        """Launches to try for `problem` (this site's problem at another batch size), in order, each a thunk: the
        decision recorded for it; the plan's launch, then with its split count halved down to 1 (a smaller batch
        has a shorter wgrad reduction; the same compiled kernel); the selection's launch for it."""
        import dataclasses as dc  # noqa: PLC0415

        from ..select import SelectMode, choose, deterministic_required, honour_determinism, lookup_decision  # noqa: PLC0415

        def decided():
            if SelectMode(self.select) is SelectMode.HEURISTIC:
                return None
            return honour_determinism(lookup_decision(problem), deterministic_required())

        out = [decided]
        try:
            plan = choose(self.problem, self.select)
        except (ValueError, *_kernel_errors()) as e:
            log.info("call site %s: no plan launch: %s", self.problem.name, e)
            plan = None
        splits = plan.split_k_slices if plan is not None else 0
        while splits >= 1:  # the plan's count, then halved down to 1
            out.append(lambda s=splits: dc.replace(plan, split_k_slices=s))
            splits //= 2
        out.append(lambda: choose(problem, self.select))
        return out

    def _bind(self, problem, launches, source_shape, variant: bool):
        """The first of `launches` (thunks) that `ops.bind` accepts for `problem`, prepared as a _Bound and handed to
        the C++ path (as one more binding of the site if `variant`); False if none does (the general path)."""
        from .. import ops  # noqa: PLC0415

        prep = None
        tried = set()
        for thunk in launches:
            launch = None
            try:
                launch = thunk()
                if launch is None or launch in tried:
                    continue
                tried.add(launch)
                prep = ops.bind(problem, launch)
                break
            except (ValueError, *_kernel_errors()) as e:
                log.info("call site %s: %s: %s", problem.name, getattr(launch, "name", "?"), e)
                prep = None
        if prep is None:
            log.info("call site %s takes the general path", problem.name)
            return False
        p = problem
        n, h, w, c = p.out_shape
        a, b = p.a_shape, p.b_shape  # NHWC / KRSC extents
        el = _TORCH_DTYPES
        src = p.epilogue.source.value
        # the source is the bias for "bias" (its own type: fp32 under a 16-bit output on a bias-vector kernel), the
        # residual otherwise; "bias_residual" also takes the bias, (K,) of its type, in CbConv2dArgs.bias
        dt_src = el[p.element_bias.value] if src == "bias" else el[p.element_out.value]
        state = _Bound(
            prep.lib._lib.cb_run, prep.template, prep.workspace_bytes, *prep.align_bytes,
            (a[0], a[3], a[1], a[2]), (b[0], b[3], b[1], b[2]), el[p.element_a.value], el[p.element_b.value],
            (n, c, h, w), (h * w * c, 1, w * c, c), el[p.element_out.value],
            source_shape if src != "none" else None, prep.lib.name,
            ctypes.create_string_buffer(256), dt_src, prep.source_bytes or prep.align_bytes[2],
            el[p.element_bias.value] if src == "bias_residual" else None, prep.bias_bytes, (p.k,), launch)
        nat = native.load()
        if nat is not None and self.index >= 0:
            try:
                if variant:
                    nat.add_site_variant(self.index, state.native_spec(), problem.name)
                else:
                    nat.set_site(self.index, state.native_spec(), problem.name)
            except (ValueError, KeyError) as e:  # the site stays on the Python path (the same checks)
                log.warning("cutlass_byoc: call site %s stays on the Python path: %s", problem.name, e)
        return state

    def __call__(self, a: torch.Tensor, b: torch.Tensor, src: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        if self.dynamic:
            st = self.batches.get(a.shape[0])
            if st is None:
                if not a.is_cuda or a.dim() != 4:
                    return None
                st = self.bind_batch(int(a.shape[0]))
        else:
            st = self.state
            if st is None:
                if not a.is_cuda:
                    return None
                st = self.bind(a.device)
        if st is False:
            return None
        if (a.shape != st.a_shape or b.shape != st.b_shape or a.dtype != st.dt_a or b.dtype != st.dt_b
                or not a.is_contiguous(memory_format=CL) or not b.is_contiguous(memory_format=CL)):
            return None
        pa, pb = a.data_ptr(), b.data_ptr()
        ps = 0
        if st.source_shape is not None:
            if src is None or src.shape != st.source_shape or src.dtype != st.dt_source:
                return None
            if not (src.is_contiguous(memory_format=CL) if src.dim() == 4 else src.is_contiguous()):
                return None
            ps = src.data_ptr()
            if not ps or ps % st.align_source:
                return None
        elif src is not None:
            return None
        pbias = 0
        if st.dt_bias is not None:  # bias and residual: the bias too
            if bias is None or bias.shape != st.bias_shape or bias.dtype != st.dt_bias or not bias.is_contiguous():
                return None
            pbias = bias.data_ptr()
            if not pbias or pbias % st.align_bias:
                return None
        elif bias is not None:
            return None
        if not (pa and pb) or pa % st.align_a or pb % st.align_b:
            return None
        dev = a.get_device()
        out = torch.empty_strided(st.out_size, st.out_stride, dtype=st.dt_out, device=a.device)
        args = CbConv2dArgs.from_buffer_copy(st.template)
        args.a, args.b, args.d, args.source = pa, pb, out.data_ptr(), ps or None
        if pbias:
            args.bias = pbias
        if st.workspace_bytes:  # from the caching allocator, dead after the call: safe under CUDA graph capture
            ws = torch.empty(st.workspace_bytes, dtype=torch.uint8, device=a.device)
            ws_ptr, ws_len = ws.data_ptr(), st.workspace_bytes
        else:
            ws_ptr, ws_len = None, 0
        stream = _get_stream(dev) if _get_stream is not None else torch.cuda.current_stream(a.device).cuda_stream
        if dev != torch.cuda.current_device():
            with torch.cuda.device(dev):
                rc = st.run(ctypes.byref(args), ws_ptr, ws_len, stream, st.msg, 256)
        else:
            rc = st.run(ctypes.byref(args), ws_ptr, ws_len, stream, st.msg, 256)
        if rc:
            from ..runtime import KernelLaunchError  # noqa: PLC0415

            raise KernelLaunchError(f"{st.name}: {st.msg.value.decode()}")
        self.calls += 1
        return out


@dataclasses.dataclass(frozen=True)
class _Bound:
    """What a call site's calls need, resolved once (plain attributes: read on every call)."""

    run: Callable  # the library's cb_run (ctypes function with its argtypes declared)
    template: object  # CbConv2dArgs with everything but the pointers
    workspace_bytes: int
    align_a: int  # byte alignments the kernel needs of A, B and the output / epilogue source
    align_b: int
    align_c: int
    a_shape: tuple
    b_shape: tuple
    dt_a: torch.dtype
    dt_b: torch.dtype
    out_size: tuple
    out_stride: tuple
    dt_out: torch.dtype
    source_shape: Optional[tuple]
    name: str
    msg: object  # the library's error message buffer
    dt_source: Optional[torch.dtype] = None  # the source's type: the output's, or the bias's for a bias source
    align_source: int = 0  # byte alignment of the source address
    dt_bias: Optional[torch.dtype] = None  # bias and residual: the bias's type (else None: no bias pointer)
    align_bias: int = 0
    bias_shape: tuple = ()
    launch: object = None  # the LaunchConfig bound (what step_times reports a site ran)

    def native_spec(self) -> "native.SiteSpec":
        """This binding for the C++ call-site ops (the same checks, the same launch)."""
        codes = native.SCALAR_TYPES
        off = native.args_offsets()
        src = self.source_shape
        return native.SiteSpec(
            abi=native.SPEC_ABI, run=ctypes.cast(self.run, ctypes.c_void_p).value,
            args=ctypes.addressof(self.template), args_bytes=ctypes.sizeof(self.template),
            off_a=off["a"], off_b=off["b"], off_d=off["d"], off_source=off["source"], off_bias=off["bias"],
            workspace_bytes=self.workspace_bytes, align_a=self.align_a, align_b=self.align_b,
            align_source=self.align_source, align_bias=self.align_bias,
            a_shape=(ctypes.c_int64 * 4)(*self.a_shape), b_shape=(ctypes.c_int64 * 4)(*self.b_shape),
            dt_a=codes[self.dt_a], dt_b=codes[self.dt_b], dt_out=codes[self.dt_out],
            out_size=(ctypes.c_int64 * 4)(*self.out_size), out_stride=(ctypes.c_int64 * 4)(*self.out_stride),
            source_dim=len(src) if src is not None else -1,
            source_shape=(ctypes.c_int64 * 4)(*(tuple(src or ()) + (0, 0, 0, 0))[:4]),
            dt_source=codes[self.dt_source] if src is not None else 0,
            bias_len=self.bias_shape[0] if self.dt_bias is not None else -1,
            dt_bias=codes[self.dt_bias] if self.dt_bias is not None else 0)


_SITES: list[CallSite] = []
_sites_lock = threading.Lock()


def register_site(kind: str, problem, select: str, source_shape: Optional[Sequence[int]] = None,
                  dynamic: bool = False) -> int:
    """A new call site for `problem` (made by the partitioner for each op it inserts); its index for the op's
    ``site`` argument. `dynamic`: the graph's batch size is symbolic and `problem` is at its example value. A site made
    inside gemm1x1.forced_determinism (the partitioner's, with OffloadOptions.deterministic) binds deterministic
    kernels only."""
    from ..gemm1x1 import determinism_forced  # noqa: PLC0415

    if torch.cuda.is_available():
        native.load()  # built (once per torch install) while the graph compiles, not at its first call
    with _sites_lock:
        site = CallSite(kind, problem, select, tuple(source_shape) if source_shape is not None else None, len(_SITES),
                        dynamic, determinism_forced())
        _SITES.append(site)
        return site.index


def site(index: int) -> CallSite:
    return _SITES[index]


def site_calls() -> dict[str, int]:
    """Kernel launches through call sites, by kind."""
    out: dict[str, int] = {}
    for s in list(_SITES):
        n = s.launches
        if n:
            out[s.kind] = out.get(s.kind, 0) + n
    for s in list(_STATS_SITES):  # the convs offloaded with their batch-norm statistics
        if s.calls:
            out["fprop"] = out.get("fprop", 0) + s.calls
    return out


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
# torch.library.Library define/impl rather than torch.library.custom_op: the same dispatcher entry, about half the
# per-call host cost (custom_op wraps every call in Python layers; see ANCHORS.md, pytorch#177109).
_LIB = torch.library.Library(NAMESPACE, "DEF")
_LIB.define("conv2d_fprop(Tensor input, Tensor weight, Tensor? bias, Tensor? residual, int[] stride, int[] padding, "
            "int[] dilation, int groups, str activation, ScalarType? out_dtype, str select) -> Tensor",
            tags=_TAGS)
_LIB.define("conv2d_dgrad(Tensor grad_output, Tensor weight, SymInt[] input_size, int[] stride, int[] padding, "
            "int[] dilation, int groups, ScalarType? out_dtype, str select) -> Tensor", tags=_TAGS)
_LIB.define("conv2d_wgrad(Tensor grad_output, Tensor input, SymInt[] weight_size, int[] stride, int[] padding, "
            "int[] dilation, int groups, ScalarType? out_dtype, str select) -> Tensor", tags=_TAGS)


# With the C++ call-site ops loaded (native.py), these ops' CUDA kernels are C++; a call the C++ path cannot take
# goes to the Python twin (*_site_py: the same schema and the functions below), which binds the site or runs the
# general path. Without them (and off CUDA) the functions below serve the ops themselves.
_SITE_SCHEMAS = {
    "fprop_site": "(Tensor input, Tensor weight, Tensor? bias, Tensor? residual, int site) -> Tensor",
    "dgrad_site": "(Tensor grad_output, Tensor weight, int site) -> Tensor",
    "wgrad_site": "(Tensor grad_output, Tensor input, int site) -> Tensor",
    # wgrad of a chain of overlapped calls (OffloadOptions.overlap_wgrad; csrc/call_sites.cpp's header has the
    # protocol): overlap n > 0 launches on a side stream with at most n of the chain in flight, 0 (the chain's last
    # call) joins them all and runs on the current stream; `after` holds the tensors of the calls this one joins and
    # the previous call's output, which orders it after them and keeps those tensors alive until then.
    "wgrad_site_async": "(Tensor grad_output, Tensor input, int site, int overlap, Tensor[] after) -> Tensor",
}
for _name, _schema in _SITE_SCHEMAS.items():
    _LIB.define(_name + _schema, tags=_TAGS)
    _LIB.define(_name + "_py" + _schema, tags=_TAGS)


def _impl(name: str):
    """Register fn as the op's implementation (and as its Python twin's, for a call-site op)."""
    def register(fn):
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        if name in _SITE_SCHEMAS:
            _LIB.impl(name + "_py", fn, "CompositeExplicitAutograd")
        return fn
    return register


def _fake(name: str):
    reg = torch.library.register_fake(f"{NAMESPACE}::{name}", lib=_LIB)
    if name not in _SITE_SCHEMAS:
        return reg
    twin = torch.library.register_fake(f"{NAMESPACE}::{name}_py", lib=_LIB)  # the call-site op's Python twin

    def both(fn):
        twin(fn)
        return reg(fn)
    return both


@_impl("conv2d_fprop")
def _conv2d_fprop(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
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


@_fake("conv2d_fprop")
def _conv2d_fprop_fake(input, weight, bias, residual, stride, padding, dilation, groups, activation, out_dtype,
                       select):
    n, _, h, w = input.shape
    k, _, r, s = weight.shape
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    p, q = conv_out_size(h, r, sh, ph, dh), conv_out_size(w, s, sw, pw, dw)
    return input.new_empty((n, k, p, q), dtype=out_dtype or input.dtype).contiguous(memory_format=CL)


# ---------------------------------------------------------------------------------------------- dgrad
@_impl("conv2d_dgrad")
def _conv2d_dgrad(grad_output: torch.Tensor, weight: torch.Tensor, input_size: Sequence[int], stride: Sequence[int],
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


@_fake("conv2d_dgrad")
def _conv2d_dgrad_fake(grad_output, weight, input_size, stride, padding, dilation, groups, out_dtype, select):
    return grad_output.new_empty(list(input_size), dtype=out_dtype or grad_output.dtype).contiguous(memory_format=CL)


# ---------------------------------------------------------------------------------------------- wgrad
@_impl("conv2d_wgrad")
def _conv2d_wgrad(grad_output: torch.Tensor, input: torch.Tensor, weight_size: Sequence[int], stride: Sequence[int],
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


@_fake("conv2d_wgrad")
def _conv2d_wgrad_fake(grad_output, input, weight_size, stride, padding, dilation, groups, out_dtype, select):
    return input.new_empty(list(weight_size), dtype=out_dtype or grad_output.dtype).contiguous(memory_format=CL)


# ---------------------------------------------------------------------------------------------- call-site ops
# What the partitioner inserts: the operands and the call site's index, nothing else. Everything static (stride,
# padding, dilation, groups, activation, output type, selection, shapes) is the site's problem, resolved when the
# graph was compiled. Few, simple arguments: the dispatcher converts each argument of a Python-implemented op on every
# call (measured here: 12 arguments with three int lists cost ~14 us a call, these 3-5 arguments ~5 us).
@_impl("fprop_site")
def _fprop_site(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                residual: Optional[torch.Tensor], site: int) -> torch.Tensor:
    s = _SITES[site]
    if use_kernels:
        y = s(input, weight, residual if residual is not None else bias, bias if residual is not None else None)
        if y is not None:
            return y
    st, pd, dl, g = s.conv_args
    return _conv2d_fprop(input, weight, bias, residual, st, pd, dl, g, s.problem.epilogue.activation.value,
                         s.out_dtype, s.select)


@_fake("fprop_site")
def _fprop_site_fake(input, weight, bias, residual, site):
    return _SITES[site].empty_output(input)


@_impl("dgrad_site")
def _dgrad_site(grad_output: torch.Tensor, weight: torch.Tensor, site: int) -> torch.Tensor:
    s = _SITES[site]
    if use_kernels:
        y = s(grad_output, weight, None)
        if y is not None:
            return y
    p = s.problem
    n = grad_output.shape[0] if s.dynamic else p.n
    return _conv2d_dgrad(grad_output, weight, [n, p.c, p.h, p.w], *s.conv_args, s.out_dtype, s.select)


@_fake("dgrad_site")
def _dgrad_site_fake(grad_output, weight, site):
    return _SITES[site].empty_output(grad_output)


@_impl("wgrad_site")
def _wgrad_site(grad_output: torch.Tensor, input: torch.Tensor, site: int) -> torch.Tensor:
    s = _SITES[site]
    if use_kernels:
        y = s(grad_output, input, None)
        if y is not None:
            return y
    p = s.problem
    return _conv2d_wgrad(grad_output, input, [p.k, p.c // p.groups, p.r, p.s], *s.conv_args, s.out_dtype, s.select)


@_fake("wgrad_site")
def _wgrad_site_fake(grad_output, input, site):
    return _SITES[site].empty_output(grad_output)


@_impl("wgrad_site_async")
def _wgrad_site_async(grad_output: torch.Tensor, input: torch.Tensor, site: int, overlap: int,
                      after: Sequence[torch.Tensor]) -> torch.Tensor:
    # the Python path runs on the current stream, after every side launch the C++ fast path has pending
    overlap_join(grad_output.device)
    return _wgrad_site(grad_output, input, site)


@_fake("wgrad_site_async")
def _wgrad_site_async_fake(grad_output, input, site, overlap, after):
    return _SITES[site].empty_output(grad_output)


def overlap_join(device: torch.device) -> None:
    """The current stream of `device` waits for every wgrad launched on the side stream and not joined yet."""
    nat = native.loaded()
    if nat is not None and device.type == "cuda":
        nat.overlap_join(device)


def overlap_pending(device: torch.device) -> int:
    """wgrad launches on `device`'s side stream not joined yet (0 after every run of a compiled graph)."""
    nat = native.loaded()
    return nat.overlap_pending(device) if nat is not None and device.type == "cuda" else 0


# ---------------------------------------------------------------------------------------------- fprop + statistics
class StatsSite:
    """A conv a training batch norm follows, offloaded with its statistics (OffloadOptions.fuse_bn_stats): the launch
    chosen for the plain problem turned into its channel-statistics twin (KernelConfig.channel_stats: the same schedule,
    a 128 x 128 tile narrowed to 128 x 64, the epilogue also storing the per-channel sums and sums of squares of y), resolved at the first call. Runs through
    ``ops.run_problem``, which checks every pointer (this path's host cost is the general path's, ~20-30 us a call: it
    pays off under CUDA graphs, where no host work is replayed). Where no twin binds, or a call cannot take it, the
    call returns None and the op computes y on the plain path and the sums with PyTorch: the same values."""

    __slots__ = ("problem", "select", "launch", "calls", "__weakref__")

    def __init__(self, problem, select: str) -> None:
        self.problem = problem
        self.select = select
        self.launch = None  # None: not resolved yet; False: no statistics twin (the PyTorch sums)
        self.calls = 0

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        if self.launch is None:
            self.launch = stats_launch(self.problem, self.select) or False
            if self.launch is False:
                log.info("statistics site %s: no channel-statistics launch; its sums run on PyTorch",
                         self.problem.name)
        if self.launch is False or not x.is_cuda:
            return None
        from .. import ops  # noqa: PLC0415

        p = self.problem
        # the operands the problem was compiled for, or the general path (a changed shape, type or layout never
        # reaches the kernel; run_problem then checks every pointer's alignment)
        dt = _TORCH_DTYPES[p.element_a.value]
        if (tuple(x.shape) != (p.n, p.c, p.h, p.w) or tuple(w.shape) != (p.k, p.c, p.r, p.s) or x.dtype != dt
                or w.dtype != dt or not x.is_contiguous(memory_format=CL) or not w.is_contiguous(memory_format=CL)):
            return None
        n, h, wd, k = p.out_shape
        out = torch.empty((n, k, h, wd), dtype=_TORCH_DTYPES[p.element_out.value], device=x.device,
                          memory_format=CL)
        stats = torch.empty((2, k), dtype=torch.float32, device=x.device)
        try:
            ops.run_problem(p, x, w, out, config=self.launch, stats=stats)
        except _kernel_errors() as e:
            RUNTIME.fallback(f"fprop+stats {p.name}", str(e))
            return None
        self.calls += 1
        return out, stats


def stats_launch(problem, select: str):
    """The channel-statistics twin of the launch the plain `problem` gets (LaunchConfig.with_channel_stats), or None
    (the reason a launch could not be chosen is logged)."""
    from ..select import choose  # noqa: PLC0415

    try:
        plain = choose(problem, select)
    except (ValueError, *_kernel_errors()) as e:
        log.info("statistics site %s: no launch: %s", problem.name, e)
        return None
    return plain.with_channel_stats() if plain is not None else None


_STATS_SITES: list[StatsSite] = []


def register_stats_site(problem, select: str) -> int:
    """A new statistics call site (the partitioner's, for each conv whose batch-norm statistics it fuses); its
    index for the op's ``site`` argument."""
    with _sites_lock:
        _STATS_SITES.append(StatsSite(problem, select))
        return len(_STATS_SITES) - 1


def stats_site(index: int) -> StatsSite:
    return _STATS_SITES[index]


_LIB.define("fprop_stats_site(Tensor input, Tensor weight, int site) -> (Tensor, Tensor)", tags=_TAGS)


@_impl("fprop_stats_site")
def _fprop_stats_site(input: torch.Tensor, weight: torch.Tensor, site: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = conv2d(input, weight)`` (the site's plain problem) and ``stats``: float32 (2, K), the per-channel sums of
    y as stored and of its squares, over batch and pixels."""
    s = _STATS_SITES[site]
    if use_kernels:
        r = s(input, weight)
        if r is not None:
            return r
    st, pd, dl = [[a, b] for a, b in ((s.problem.stride_h, s.problem.stride_w), (s.problem.pad_h, s.problem.pad_w),
                                      (s.problem.dilation_h, s.problem.dilation_w))]
    y = _conv2d_fprop(input, weight, None, None, st, pd, dl, 1, "identity", _TORCH_DTYPES[s.problem.element_out.value],
                      s.select)
    yf = y.float()
    return y, torch.stack([yf.sum((0, 2, 3)), (yf * yf).sum((0, 2, 3))])


@_fake("fprop_stats_site")
def _fprop_stats_site_fake(input, weight, site):
    p = _STATS_SITES[site].problem
    n, h, w, k = p.out_shape
    y = input.new_empty((n, k, h, w), dtype=_TORCH_DTYPES[p.element_out.value]).contiguous(memory_format=CL)
    return y, input.new_empty((2, k), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- parameter casts
# One launch for all of a graph's parameter casts (batching.py inserts it): under autocast every conv and linear
# weight is cast to fp16/bf16 on each step, one small elementwise kernel each (ResNet-50: 57 per training step, ~2 us
# apiece, each a node of a CUDA graph); here they are one multi-tensor copy (torch._foreach_copy_, PyTorch's
# multi_tensor_apply: a launch per ~110 tensors or ~20M elements).
_LIB.define("cast_params(Tensor[] tensors, ScalarType dtype) -> Tensor[]")


@_impl("cast_params")
def _cast_params(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``[t.to(dtype) for t in tensors]``, each result with its tensor's strides (they are dense: batching.py checks)."""
    outs = [torch.empty_like(t, dtype=dtype) for t in tensors]
    if outs:
        torch._foreach_copy_(outs, tensors)
    return outs


@_fake("cast_params")
def _cast_params_fake(tensors, dtype):
    return [torch.empty_like(t, dtype=dtype) for t in tensors]


#: the ops the partitioner inserts (operands and a call site)
FPROP_STATS = torch.ops.cutlass_byoc.fprop_stats_site.default
FPROP = torch.ops.cutlass_byoc.fprop_site.default
DGRAD = torch.ops.cutlass_byoc.dgrad_site.default
WGRAD = torch.ops.cutlass_byoc.wgrad_site.default
WGRAD_ASYNC = torch.ops.cutlass_byoc.wgrad_site_async.default
CAST_PARAMS = torch.ops.cutlass_byoc.cast_params.default
#: their Python implementations (the C++ kernels' twins; the host-overhead benchmark times them too)
FPROP_PY = torch.ops.cutlass_byoc.fprop_site_py.default
DGRAD_PY = torch.ops.cutlass_byoc.dgrad_site_py.default
WGRAD_PY = torch.ops.cutlass_byoc.wgrad_site_py.default
WGRAD_ASYNC_PY = torch.ops.cutlass_byoc.wgrad_site_async_py.default
#: the general ops (every parameter an argument): for direct use, tests and torch.library.opcheck
conv2d_fprop = torch.ops.cutlass_byoc.conv2d_fprop.default
conv2d_dgrad = torch.ops.cutlass_byoc.conv2d_dgrad.default
conv2d_wgrad = torch.ops.cutlass_byoc.conv2d_wgrad.default
