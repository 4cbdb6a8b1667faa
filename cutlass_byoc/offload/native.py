"""The C++ launch path of the call-site ops: builds ``csrc/call_sites.cpp`` against the running torch, loads it, and
hands it each call site's prepared launch.

Why: a call through a Python-implemented op costs ~20 us of host time (the dispatcher converting arguments into
Python objects, the checks, ctypes), about what ``aten.convolution`` costs; a host-bound training step (no CUDA
graphs) pays it ~160 times. The C++ kernel of ``cutlass_byoc::{fprop,dgrad,wgrad}_site`` does the same checks and
the launch without Python (see the source's header for what it checks and when it hands a call back to Python).

Build: ``torch.utils.cpp_extension.load`` (ninja, the host C++ compiler, torch's headers and flags) into
``<cache root>/host-ops/<key>``, where the key covers the source and the torch build (version, git revision, C++
ABI): one build per torch install, reused by every process after it (~20-40 s once). Switched off by
``CUTLASS_BYOC_NATIVE_OPS=0``; when the build or the load fails, the reason is logged once and the Python
implementations keep serving every call (the same checks, slower).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("cutlass_byoc.offload")

ENV = "CUTLASS_BYOC_NATIVE_OPS"
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "call_sites.cpp"
SPEC_ABI = 1


class SiteSpec(ctypes.Structure):
    """Mirror of struct SiteSpec in csrc/call_sites.cpp."""

    _fields_ = [
        ("abi", ctypes.c_int64),
        ("run", ctypes.c_void_p),
        ("args", ctypes.c_void_p),
        ("args_bytes", ctypes.c_int64),
        *[(f, ctypes.c_int64) for f in ("off_a", "off_b", "off_d", "off_source", "off_bias", "workspace_bytes",
                                        "align_a", "align_b", "align_source", "align_bias")],
        ("a_shape", ctypes.c_int64 * 4),
        ("b_shape", ctypes.c_int64 * 4),
        *[(f, ctypes.c_int64) for f in ("dt_a", "dt_b", "dt_out")],
        ("out_size", ctypes.c_int64 * 4),
        ("out_stride", ctypes.c_int64 * 4),
        ("source_dim", ctypes.c_int64),
        ("source_shape", ctypes.c_int64 * 4),
        ("dt_source", ctypes.c_int64),
        ("bias_len", ctypes.c_int64),
        ("dt_bias", ctypes.c_int64),
    ]


#: torch dtype -> c10::ScalarType code (the enum's order; stable across torch releases)
SCALAR_TYPES = {torch.float16: 5, torch.float32: 6, torch.bfloat16: 15}


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def build_key(defines: tuple[str, ...] = (), source: Optional[str] = None) -> str:
    """The source, the preprocessor defines and the torch build it is compiled against."""
    blob = "\0".join([SOURCE.read_text() if source is None else source, *defines, torch.__version__,
                      str(getattr(torch.version, "git_version", "")), str(torch._C._GLIBCXX_USE_CXX11_ABI)])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def build(verbose: bool = False, defines: tuple[str, ...] = ()) -> Path:
    """Compile the source for this torch (once per key: a later call finds the library) and return its path.
    Raises what the compiler or torch's extension builder raises. `defines`: CB_SITES_TEST_CPU for the CPU tests
    (the kernels registered for CPU tensors)."""
    from torch.utils import cpp_extension  # noqa: PLC0415

    from ..build import _ninja  # noqa: PLC0415
    from ..cache import cache_root  # noqa: PLC0415
    from ..trust import ensure_trusted_kernel, ensure_trusted_root, make_private_dir  # noqa: PLC0415

    root = cache_root()
    ensure_trusted_root(root)
    text = SOURCE.read_text()
    key = build_key(defines, text)
    build_dir = make_private_dir(root / "host-ops" / key)
    name = f"cutlass_byoc_sites_{key}"
    lib = build_dir / f"{name}.so"
    ensure_trusted_kernel(build_dir, lib.name, what="the built call-site ops")  # torch's builder dlopens it
    src = build_dir / "call_sites.cpp"
    if not src.exists() or src.read_text() != text:
        src.write_text(text)
    if not lib.exists():
        log.info("cutlass_byoc: building the C++ call-site ops in %s (once per torch install)", build_dir)
    ninja_dir = os.path.dirname(_ninja())  # torch's builder runs `ninja` from PATH: the pip package's counts
    if ninja_dir and ninja_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    path = cpp_extension.load(name=name, sources=[str(src)], build_directory=str(build_dir),
                              extra_cflags=["-O2", "-Wall", *(f"-D{d}" for d in defines)],
                              is_python_module=False, with_cuda=False,
                              verbose=verbose)
    return Path(path) if isinstance(path, str) else lib


class Native:
    """The loaded library's C API (the op kernels themselves registered with the dispatcher on load)."""

    def __init__(self, path: Path) -> None:
        torch.ops.load_library(str(path))  # registers the CUDA kernels of the call-site ops
        lib = ctypes.CDLL(str(path))
        lib.cb_sites_abi.restype = ctypes.c_int64
        if lib.cb_sites_abi() != SPEC_ABI:
            raise OSError(f"{path}: SiteSpec ABI {lib.cb_sites_abi()}, expected {SPEC_ABI}")
        lib.cb_site_set.argtypes = [ctypes.c_int64, ctypes.POINTER(SiteSpec), ctypes.c_char_p, ctypes.c_char_p,
                                    ctypes.c_int]
        lib.cb_site_set.restype = ctypes.c_int
        lib.cb_site_add.argtypes = lib.cb_site_set.argtypes
        lib.cb_site_add.restype = ctypes.c_int
        lib.cb_site_clear.argtypes = [ctypes.c_int64]
        lib.cb_site_calls.argtypes = [ctypes.c_int64]
        lib.cb_site_calls.restype = ctypes.c_int64
        lib.cb_sites_enable.argtypes = [ctypes.c_int]
        lib.cb_site_time.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_char_p,
                                     ctypes.c_int]
        lib.cb_site_time.restype = ctypes.c_double
        lib.cb_overlap_join.argtypes = [ctypes.c_int64]
        lib.cb_overlap_pending.argtypes = [ctypes.c_int64]
        lib.cb_overlap_pending.restype = ctypes.c_int64
        self.path = path
        self._lib = lib

    def set_site(self, index: int, spec: SiteSpec, name: str) -> None:
        msg = ctypes.create_string_buffer(256)
        if self._lib.cb_site_set(index, ctypes.byref(spec), name.encode(), msg, 256):
            raise ValueError(f"call site {index} ({name}): {msg.value.decode()}")

    def add_site_variant(self, index: int, spec: SiteSpec, name: str) -> None:
        """One more binding of a site (a dynamic site's binding at another batch size), tried first."""
        msg = ctypes.create_string_buffer(256)
        if self._lib.cb_site_add(index, ctypes.byref(spec), name.encode(), msg, 256):
            raise ValueError(f"call site {index} ({name}): {msg.value.decode()}")

    def clear_site(self, index: int) -> None:
        self._lib.cb_site_clear(index)

    def calls(self, index: int) -> int:
        return int(self._lib.cb_site_calls(index))

    def reset_calls(self) -> None:
        self._lib.cb_sites_reset_calls()

    def enable(self, on: bool) -> None:
        self._lib.cb_sites_enable(1 if on else 0)

    @staticmethod
    def _index(device: torch.device) -> int:
        return device.index if device.index is not None else torch.cuda.current_device()

    def overlap_join(self, device: torch.device) -> None:
        """The current stream of CUDA `device` waits for every pending side-stream wgrad (wgrad_site_async)."""
        self._lib.cb_overlap_join(self._index(device))

    def overlap_pending(self, device: torch.device) -> int:
        return int(self._lib.cb_overlap_pending(self._index(device)))

    #: what time_site times
    LAUNCH, RUN = 0, 1

    def time_site(self, index: int, device: Optional[torch.device], iters: int, what: int) -> float:
        """Host microseconds per call of a bound site's fast path on operands of its spec, in a C++ loop (no
        dispatcher, no Python): what=LAUNCH the checks, allocations and cb_run of a call, what=RUN cb_run alone.
        device None: the CPU (the CPU test build)."""
        msg = ctypes.create_string_buffer(256)
        us = float(self._lib.cb_site_time(index, -1 if device is None else self._index(device), iters, what, msg, 256))
        if us < 0:
            raise RuntimeError(f"call site {index}: {msg.value.decode()}")
        return us


_lock = threading.Lock()
_state: dict[str, object] = {}


def load() -> Optional[Native]:
    """The native call-site ops, built and loaded on the first call (None, with the reason logged once, when they
    are switched off or cannot be built here)."""
    if "native" in _state:
        return _state["native"]  # type: ignore[return-value]
    with _lock:
        if "native" not in _state:
            native = None
            if not enabled_by_env():
                _state["why"] = f"{ENV}=0"
            else:
                try:
                    native = Native(build())
                except Exception as e:  # noqa: BLE001 - any failure leaves the (slower, equally checked) Python path
                    _state["why"] = f"{type(e).__name__}: {e}"
                    log.warning("cutlass_byoc: the C++ call-site ops are unavailable (%s); calls take the Python "
                                "path", str(e).splitlines()[0] if str(e) else type(e).__name__)
            _state["native"] = native
    return _state["native"]  # type: ignore[return-value]


def loaded() -> Optional[Native]:
    """The native ops if they were loaded (never builds)."""
    return _state.get("native")  # type: ignore[return-value]


def why_not() -> Optional[str]:
    """Why the native ops are not in use (None when they are, or were never asked for)."""
    return _state.get("why")  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def args_offsets() -> dict[str, int]:
    """Byte offsets of the launch arguments' pointer fields."""
    from ..runtime import CbConv2dArgs  # noqa: PLC0415

    return {f: getattr(CbConv2dArgs, f).offset for f in ("a", "b", "d", "source", "bias")}
