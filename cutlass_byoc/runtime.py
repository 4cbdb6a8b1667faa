"""Load compiled kernel libraries and launch them on raw device pointers (torch-free; see ops.py for tensors)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import threading
from pathlib import Path
from typing import Optional

from .build import CompileError, build
from .cache import KernelCache, cache_root_path
from .config import KernelConfig, LaunchConfig
from .problem import Conv2dProblem
from .render import ABI_VERSION
from .trust import ensure_trusted_kernel, ensure_trusted_root
from .types import DType, SourceKind


class KernelLaunchError(RuntimeError):
    """The kernel refused the problem or its launch failed; the message says which parameter and why."""


class CbConv2dArgs(ctypes.Structure):
    """Mirror of struct CbConv2dArgs in templates/conv2d_api.h.j2."""

    _fields_ = [
        ("abi_version", ctypes.c_int64),
        *[(f, ctypes.c_int64) for f in ("n", "h", "w", "c", "k", "r", "s", "p", "q")],
        *[(f, ctypes.c_int64) for f in ("pad_h", "pad_w", "stride_h", "stride_w", "dilation_h", "dilation_w")],
        ("split_k_slices", ctypes.c_int64),
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("source", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("source_kind", ctypes.c_int64),
        ("alpha", ctypes.c_float),
        ("beta", ctypes.c_float),
        # Declared in the C struct of bias-vector kernels only (after every other field, so kernels without it read
        # the same prefix): the bias of source_kind 3 (bias and residual).
        ("bias", ctypes.c_void_p),
        # Declared in the C struct of channel-statistics kernels only (after bias, which they declare too): 2 x K fp32
        # sums and sums of squares of the output per channel (KernelConfig.channel_stats).
        ("stats", ctypes.c_void_p),
    ]


_SOURCE_CODES = {SourceKind.NONE: 0, SourceKind.BIAS: 1, SourceKind.RESIDUAL: 2, SourceKind.BIAS_RESIDUAL: 3}


def make_args(
    problem: Conv2dProblem, split_k_slices: int = 1, a: int = 0, b: int = 0, d: int = 0, source: int = 0,
    alpha: float = 1.0, beta: Optional[float] = None, bias: int = 0, stats: int = 0,
) -> CbConv2dArgs:
    """The launch arguments. `source` is the epilogue's C operand: the bias (SourceKind.BIAS) or the residual
    (RESIDUAL, BIAS_RESIDUAL); `bias` is the bias of BIAS_RESIDUAL."""
    p = problem
    kind = p.epilogue.source
    return CbConv2dArgs(
        ABI_VERSION, p.n, p.h, p.w, p.c, p.k, p.r, p.s, p.p, p.q,
        p.pad_h, p.pad_w, p.stride_h, p.stride_w, p.dilation_h, p.dilation_w,
        split_k_slices, a or None, b or None, source or None, d or None, _SOURCE_CODES[kind],
        alpha, (1.0 if kind is not SourceKind.NONE else 0.0) if beta is None else beta, bias or None, stats or None,
    )


def open_library(path: Path | str) -> ctypes.CDLL:
    """dlopen a kernel library with the signatures of its extern "C" API declared (no checks: see KernelLibrary).

    dlopen runs the library's code (its initialisers) as this user: open only files you trust. `load_kernel` checks
    that a cached library and its cache are the user's alone first (trust.py)."""
    lib = ctypes.CDLL(str(path))
    try:
        lib.cb_abi_version.restype = ctypes.c_int64
    except AttributeError as e:
        raise KernelLaunchError(f"{path} is not a cutlass-byoc kernel library ({e})") from None
    lib.cb_config_json.restype = ctypes.c_char_p
    lib.cb_kernel_name.restype = ctypes.c_char_p
    lib.cb_can_implement.argtypes = [ctypes.POINTER(CbConv2dArgs), ctypes.c_char_p, ctypes.c_int]
    lib.cb_workspace_size.argtypes = [ctypes.POINTER(CbConv2dArgs)]
    lib.cb_workspace_size.restype = ctypes.c_int64
    lib.cb_run.argtypes = [ctypes.POINTER(CbConv2dArgs), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_char_p, ctypes.c_int]
    if hasattr(lib, "cb_launch_memo"):  # the CUTLASS-based templates' launch memo (launch_memo.h.j2)
        lib.cb_launch_memo.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
        lib.cb_launch_memo.restype = ctypes.c_int64
    return lib


@dataclasses.dataclass(frozen=True)
class MemoState:
    """A kernel library's launch memo: on or off, the calls it relaunched and those that took the full path."""

    on: bool
    relaunches: int
    full: int


class KernelLibrary:
    """One compiled kernel, loaded. Thread-safe: cb_run prepares a launch per call, or relaunches one it prepared
    for the very same argument block, under the library's lock (the launch memo of the CUTLASS-based templates).

    It opens the file it is given without asking who wrote it; `load_kernel` is the checked way in."""

    def __init__(self, config: KernelConfig, path: Path):
        self.config = config
        self.path = Path(path)
        lib = open_library(self.path)
        if lib.cb_abi_version() != ABI_VERSION:
            raise KernelLaunchError(f"{self.path}: ABI {lib.cb_abi_version()}, this cutlass_byoc speaks {ABI_VERSION}")
        shipped = KernelConfig.from_dict(json.loads(lib.cb_config_json()))
        if shipped != config:  # never run a kernel other than the one asked for
            raise KernelLaunchError(f"{self.path} holds {shipped.name}, expected {config.name}")
        self._lib = lib

    @property
    def name(self) -> str:
        return self.config.name

    def can_implement(self, problem: Conv2dProblem, split_k_slices: int = 1) -> Optional[str]:
        """None if this kernel computes `problem` with that many slices; else why not."""
        why = LaunchConfig(self.config, split_k_slices).reject_reason(problem)
        if why:
            return why
        args = make_args(problem, split_k_slices)
        buf = ctypes.create_string_buffer(512)
        if self._lib.cb_can_implement(ctypes.byref(args), buf, len(buf)):
            return buf.value.decode()
        return None

    def workspace_size(self, problem: Conv2dProblem, split_k_slices: int = 1) -> int:
        return int(self._lib.cb_workspace_size(ctypes.byref(make_args(problem, split_k_slices))))

    def check_pointers(self, problem: Conv2dProblem, a: int, b: int, d: int, source: int = 0, bias: int = 0) -> None:
        why = pointer_error(self.config, problem, a, b, d, source, bias)
        if why:
            raise KernelLaunchError(why)

    def run(
        self, problem: Conv2dProblem, *, a: int, b: int, d: int, source: int = 0, split_k_slices: int = 1,
        workspace: int = 0, workspace_bytes: int = 0, stream: int = 0, alpha: float = 1.0, beta: Optional[float] = None,
        bias: int = 0,
    ) -> None:
        """Launch on raw device pointers (ints) on `stream` (a cudaStream_t as int; 0 is the legacy default stream)."""
        why = LaunchConfig(self.config, split_k_slices).reject_reason(problem)
        if why:
            raise KernelLaunchError(f"{self.name} cannot run {problem.name}: {why}")
        self.check_pointers(problem, a, b, d, source, bias)
        self.launch(make_args(problem, split_k_slices, a, b, d, source, alpha, beta, bias), workspace, workspace_bytes,
                    stream)

    def launch_memo(self, on: Optional[bool] = None) -> Optional[MemoState]:
        """The library's launch memo (None where its template has none: depthwise, shared-memory im2col, the lowered
        1x1 GEMM), switched on or off first unless `on` is None. The state is the library's, shared by every thread
        and call site using it."""
        fn = getattr(self._lib, "cb_launch_memo", None)
        if fn is None:
            return None
        counters = (ctypes.c_int64 * 2)()
        was = bool(fn(-1 if on is None else int(on), counters))
        return MemoState(was if on is None else bool(on), int(counters[0]), int(counters[1]))

    def launch(self, args: CbConv2dArgs, workspace: int, workspace_bytes: int, stream: int) -> None:
        """The bare launch of already validated arguments (the kernel still runs its own can_implement)."""
        buf = ctypes.create_string_buffer(256)
        rc = self._lib.cb_run(ctypes.byref(args), workspace or None, workspace_bytes, stream or None, buf, 256)
        if rc:
            raise KernelLaunchError(f"{self.name}: {buf.value.decode()}")


def pointer_rules(config: KernelConfig, problem: Conv2dProblem) -> list[tuple[str, DType, int]]:
    """(operand, element type, bytes its address must be a multiple of) for each pointer a launch of `config` on
    `problem` takes: A, B, the output, and the epilogue's source and bias where the problem has them."""
    c = config
    rules = [("A", c.element_a, c.align_a), ("B", c.element_b, c.align_b), ("output", c.element_out, c.align_c)]
    src = problem.epilogue.source
    if src.has_residual:
        rules.append(("residual" if src is SourceKind.BIAS_RESIDUAL else "source", c.element_out, c.align_c))
    if src.has_bias:
        el = c.element_bias or c.element_out  # a bias read as C has the output's type
        rules.append(("bias" if src is SourceKind.BIAS_RESIDUAL else "source", el, c.align_c))
    return [(name, el, align * el.nbytes) for name, el, align in rules]


def pointer_error(config: KernelConfig, problem: Conv2dProblem, a: int, b: int, d: int, source: int = 0,
                  bias: int = 0) -> Optional[str]:
    """Why these device addresses cannot go to a launch of `config` (null, or not aligned as it needs), or None.
    For SourceKind.BIAS the bias is `source`; for BIAS_RESIDUAL the residual is `source` and the bias `bias`."""
    ptrs = {"A": a, "B": b, "output": d, "source": source, "residual": source, "bias": bias}
    for name, el, align in pointer_rules(config, problem):
        ptr = ptrs[name]
        if not ptr:
            return f"{name}: null device pointer"
        if ptr % align:
            return (f"{name}: address {ptr:#x} is not {align}-byte aligned as kernel {config.name} needs "
                    f"(alignment {align // el.nbytes} elements of {el.value})")
    return None


_loaded: dict[tuple[str, KernelConfig], KernelLibrary] = {}
_lock = threading.Lock()


def loaded_libraries() -> list[KernelLibrary]:
    """The kernel libraries this process has loaded (each once)."""
    with _lock:
        return list(_loaded.values())


def load_kernel(config: KernelConfig, cache: Optional[KernelCache] = None, *, build_missing: bool = True) -> KernelLibrary:
    """The loaded library of `config`, compiling it first if it is not in the cache (and `build_missing`).

    Before the first library of a cache root is opened, the root must be the user's alone, and so must the
    kernel's folder and kernel.so (trust.UntrustedCacheError otherwise, unless $CUTLASS_BYOC_TRUST_CACHE_DIR=1).
    A library once loaded is remembered, so a launch checks nothing on disk."""
    key = (str(cache.root) if cache else str(Path(cache_root_path())), config)
    lib = _loaded.get(key)
    if lib is not None:
        return lib
    cache = cache or KernelCache()
    ensure_trusted_root(cache.root)  # KernelCache() checked it already; a cache made by the caller too (memoised)
    if build_missing:
        result = build([config], cache=cache)[config]
    else:
        from .build import BuildResult, prepare  # noqa: PLC0415

        result = BuildResult(config, cache.lookup(prepare(config)[1]), False)
    if not result.ok:
        if not build_missing and result.entry.state.value == "missing":
            raise KernelLaunchError(f"{config.name} is not compiled (run `cutlass-byoc tune` or build it)")
        raise CompileError(result.error_report())
    ensure_trusted_kernel(result.entry.path)
    lib = KernelLibrary(config, result.library)
    with _lock:
        return _loaded.setdefault(key, lib)


@functools.lru_cache(maxsize=None)
def device_properties() -> tuple[str, int, int]:
    """(name, compute capability as 90, multiprocessor count) of the current CUDA device, through cuda-python."""
    from cuda.bindings import runtime as rt  # noqa: PLC0415

    err, dev = rt.cudaGetDevice()
    if err != rt.cudaError_t.cudaSuccess:
        raise KernelLaunchError(f"no CUDA device: {err}")
    err, prop = rt.cudaGetDeviceProperties(dev)
    if err != rt.cudaError_t.cudaSuccess:
        raise KernelLaunchError(f"cudaGetDeviceProperties: {err}")
    name = prop.name.decode() if isinstance(prop.name, bytes) else str(prop.name)
    return name.rstrip("\x00"), prop.major * 10 + prop.minor, prop.multiProcessorCount
