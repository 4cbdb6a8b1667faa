"""Where the compiler and the CUTLASS headers are, their versions, and the exact nvcc flags."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


class ToolchainError(RuntimeError):
    """nvcc or the CUTLASS headers are missing; the message says what to install."""


@functools.lru_cache(maxsize=None)
def nvcc_path() -> str:
    explicit = os.environ.get("CUTLASS_BYOC_NVCC")
    candidates = [explicit] if explicit else []
    candidates += [shutil.which("nvcc") or ""]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "bin", "nvcc"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise ToolchainError(
        "nvcc not found: install the CUDA toolkit (12.4 or newer; 13.0 is tested) and put nvcc on PATH, "
        "or set CUTLASS_BYOC_NVCC / CUDA_HOME"
    )


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"release (\d+\.\d+), V([\d.]+)", out)
    if not m:
        raise ToolchainError(f"could not read the version of {nvcc_path()}: {out!r}")
    return m.group(2)


@functools.lru_cache(maxsize=None)
def cutlass_root() -> Path:
    """The CUTLASS source tree shipped in the nvidia-cutlass wheel (or CUTLASS_BYOC_CUTLASS_DIR)."""
    explicit = os.environ.get("CUTLASS_BYOC_CUTLASS_DIR")
    if explicit:
        root = Path(explicit)
    else:
        try:
            import cutlass_library  # noqa: PLC0415
        except ImportError as e:
            raise ToolchainError("CUTLASS not found: pip install nvidia-cutlass==4.2.0.0") from e
        root = Path(cutlass_library.__file__).parent / "source"
    if not (root / "include" / "cutlass" / "cutlass.h").is_file():
        raise ToolchainError(
            f"CUTLASS headers not found under {root}/include: pip install nvidia-cutlass==4.2.0.0 "
            "(or set CUTLASS_BYOC_CUTLASS_DIR to a CUTLASS checkout)"
        )
    return root


@functools.lru_cache(maxsize=None)
def cutlass_version() -> str:
    text = (cutlass_root() / "include" / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    headers = ".".join(m.group(1) for m in parts if m)
    try:
        wheel = importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        wheel = "none"
    return f"{headers} (wheel {wheel})"


@dataclass(frozen=True)
class Toolchain:
    nvcc: str
    nvcc_version: str
    cutlass_version: str
    include_dirs: tuple[str, ...]
    arch: int = 90

    @property
    def flags(self) -> tuple[str, ...]:
        # sm_90a (not sm_90): with plain sm_90 the 3.x kernels silently compile to an abort (BRIEF.md).
        gencode = f"-gencode=arch=compute_{self.arch}a,code=sm_{self.arch}a"
        return (
            "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", gencode,
            "-Xcompiler=-fPIC", "-shared", "-cudart=static", "-Xcompiler=-Wall", "-Xcompiler=-Wno-unused-function",
            *(f"-I{d}" for d in self.include_dirs),
        )

    def command(self, source: str, output: str) -> list[str]:
        return [self.nvcc, *self.flags, source, "-o", output]

    @property
    def portable_flags(self) -> tuple[str, ...]:
        """The flags with the CUTLASS location written as $CUTLASS_DIR: what goes into cache keys and headers, so a
        kernel cache moves between machines whose wheels live in different places."""
        root = str(cutlass_root())
        return tuple(f.replace(root, "$CUTLASS_DIR") for f in self.flags)

    def describe(self, source: str = "kernel.cu", output: str = "kernel.so") -> str:
        """The compile command as recorded in each generated file ($CUTLASS_DIR: the wheel's cutlass_library/source)."""
        return " ".join(["nvcc", *self.portable_flags, source, "-o", output])


@functools.lru_cache(maxsize=None)
def toolchain(arch: int = 90) -> Toolchain:
    root = cutlass_root()
    return Toolchain(
        nvcc=nvcc_path(), nvcc_version=nvcc_version(), cutlass_version=cutlass_version(),
        include_dirs=(str(root / "include"), str(root / "tools" / "util" / "include")), arch=arch,
    )
