"""The content-addressed kernel cache: one directory per compiled (or failed) kernel, published atomically.

Layout under the cache root (``$CUTLASS_BYOC_CACHE_DIR``, else the platform's per-user cache dir)::

    kernels/<key[:2]>/<key>/kernel.cu    rendered source (its header records config and compile command)
                           kernel.so    the library, only for a successful build
                           build.log    nvcc's output (warnings included)
                           meta.json    config, toolchain, command, compile seconds, sha256 of kernel.so,
                                        who built it (built_by: user, uid, host, time) and, if imported, from where
                           failed.json  instead of meta.json when the compile failed: never used as a kernel
    locks/<key>.lock                    held while one process builds that key
    tmp/                                staging; a finished build is renamed into kernels/ in one step

Its libraries are loaded into the process, so the cache keeps them private (trust.py): folders are created 0700,
and a root that another user owns or others can write is refused before anything is read from it.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Optional

import filelock
import platformdirs

from .toolchain import Toolchain
from .trust import ensure_trusted_root, make_private_dir, seal

#: Bump when the layout or meta format changes: older entries are then simply not found.
CACHE_FORMAT = 1


def cache_root_path() -> str:
    """Where the cache lives ($CUTLASS_BYOC_CACHE_DIR, else the per-user cache dir), without touching the disk:
    cheap enough for keys on the launch path."""
    return os.environ.get("CUTLASS_BYOC_CACHE_DIR") or platformdirs.user_cache_dir("cutlass-byoc")


def cache_root() -> Path:
    """The cache root, created (0700, as are missing folders above it) if it does not exist."""
    return make_private_dir(Path(cache_root_path()))


def kernel_key(source: str, tc: Toolchain) -> str:
    """Covers the rendered source, nvcc's version, the flags and CUTLASS's version (and the cache format)."""
    blob = json.dumps(
        {"format": CACHE_FORMAT, "source": source, "nvcc": tc.nvcc_version, "flags": tc.portable_flags,
         "cutlass": tc.cutlass_version},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class EntryState(str, enum.Enum):
    MISSING = "missing"
    OK = "ok"
    FAILED = "failed"
    CORRUPT = "corrupt"


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    key: str
    path: Path
    state: EntryState
    meta: dict

    @property
    def library(self) -> Path:
        return self.path / "kernel.so"

    @property
    def source(self) -> Path:
        return self.path / "kernel.cu"

    @property
    def log(self) -> str:
        p = self.path / "build.log"
        return p.read_text(errors="replace") if p.exists() else ""


class KernelCache:
    """The kernels under one cache root. Making one creates the missing folders (0700) and refuses a root that is
    not the user's alone (trust.UntrustedCacheError; once per root and process) unless the user trusts it."""

    def __init__(self, root: Optional[Path] = None):
        self.root = make_private_dir(Path(root)) if root else cache_root()
        ensure_trusted_root(self.root)  # before anything is read or written under it
        for sub in ("kernels", "locks", "tmp"):
            make_private_dir(self.root / sub)

    def entry_dir(self, key: str) -> Path:
        return self.root / "kernels" / key[:2] / key

    def lock(self, key: str) -> filelock.FileLock:
        return filelock.FileLock(str(self.root / "locks" / f"{key}.lock"))

    def lookup(self, key: str) -> KernelEntry:
        d = self.entry_dir(key)
        if not d.is_dir():
            return KernelEntry(key, d, EntryState.MISSING, {})
        try:
            if (d / "failed.json").exists():
                return KernelEntry(key, d, EntryState.FAILED, json.loads((d / "failed.json").read_text()))
            meta = json.loads((d / "meta.json").read_text())
            lib = d / "kernel.so"
            if meta.get("format") != CACHE_FORMAT or not lib.is_file() or sha256_file(lib) != meta.get("sha256"):
                return KernelEntry(key, d, EntryState.CORRUPT, meta)
            return KernelEntry(key, d, EntryState.OK, meta)
        except (OSError, ValueError):
            return KernelEntry(key, d, EntryState.CORRUPT, {})

    def staging_dir(self, key: str) -> Path:
        d = self.root / "tmp" / f"{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        make_private_dir(d.parent)
        os.mkdir(d, 0o700)  # unique: never an existing folder
        os.chmod(d, 0o700)
        return d

    def publish(self, key: str, staged: Path) -> KernelEntry:
        """Move a finished staging dir into place in one rename. If another process published first, keep theirs."""
        final = self.entry_dir(key)
        make_private_dir(final.parent)
        seal(staged)
        current = self.lookup(key)
        if current.state is EntryState.CORRUPT or (current.state is EntryState.FAILED and (staged / "meta.json").exists()):
            self.remove(key)
        try:
            os.rename(staged, final)
        except OSError:  # an entry appeared meanwhile (another process won the race): ours is redundant
            shutil.rmtree(staged, ignore_errors=True)
        return self.lookup(key)

    def remove(self, key: str) -> None:
        d = self.entry_dir(key)
        if d.exists():
            trash = self.root / "tmp" / f"trash-{key}-{uuid.uuid4().hex[:8]}"
            os.rename(d, trash)  # atomic disappearance, then slow delete
            shutil.rmtree(trash, ignore_errors=True)

    def entries(self):
        for d in sorted((self.root / "kernels").glob("*/*")):
            if d.is_dir():
                yield self.lookup(d.name)

    def clear(self) -> int:
        n = 0
        for e in list(self.entries()):
            self.remove(e.key)
            n += 1
        return n
