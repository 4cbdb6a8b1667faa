"""Who may write into a kernel cache: only its user (or root), because its libraries are loaded into the process.

A compiled `kernel.so` runs as the user who loads it, and the sha256 in its `meta.json` detects corruption, not
tampering: whoever can write both files chooses the code. So, the way ssh treats `~/.ssh`:

- the cache creates its folders readable and writable by their owner only (0700), whatever the umask, and drops
  group and world write permission from the files it publishes;
- before anything is loaded from a cache root, the root, its cache folders (`kernels/`, `decisions/`, `locks/`,
  `tmp/`, `logs/`) and the folders above it must be owned by the user or by root and must not be writable by the
  group or the world (a folder above the root may be, with the sticky bit set, as /tmp is). The verdict is
  remembered per root and process, so this costs a few stat calls once, not one per launch;
- before a kernel library is opened, its folder and its `kernel.so` pass the same owner and mode test.

`CUTLASS_BYOC_TRUST_CACHE_DIR=1` (the CLI's `--trust-cache-dir`) accepts a shared cache on purpose, e.g. a
fleet-wide read-only cache owned by a service account: then the checks are skipped.
"""

from __future__ import annotations

import getpass
import os
import socket
import stat
import time
from pathlib import Path
from typing import Optional

#: Set to 1 to accept a cache root that is owned by another user or writable by others.
TRUST_ENV = "CUTLASS_BYOC_TRUST_CACHE_DIR"

#: The folders of a cache root that are checked with it (those that exist).
CACHE_FOLDERS = ("kernels", "decisions", "locks", "tmp", "logs", "host-ops")

_OVERRIDE_HINT = (f"set {TRUST_ENV}=1 (or pass --trust-cache-dir) to accept a shared cache on purpose, e.g. a "
                  "read-only fleet cache owned by a service account")


class UntrustedCacheError(RuntimeError):
    """A cache root (or a kernel in it) that someone other than this user could have written; the message names
    each path, what is wrong with it and the fix."""

    def __init__(self, path: Path, problems: list[str], what: str = "the kernel cache"):
        self.path = Path(path)
        self.problems = list(problems)
        super().__init__(
            f"refusing {what} {path}: kernel libraries are code that runs in this process, so only you (or root) "
            "may be able to write them.\n" + "\n".join(f"  - {p}" for p in problems)
            + f"\n  Fix the paths as shown, point CUTLASS_BYOC_CACHE_DIR at a folder of your own, or {_OVERRIDE_HINT}."
        )


def trust_override() -> bool:
    """True when $CUTLASS_BYOC_TRUST_CACHE_DIR accepts any cache root."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _supported() -> bool:
    return hasattr(os, "getuid")  # POSIX owners and modes; elsewhere there is nothing to check


# ---------------------------------------------------------------------------------------------- creating
def make_private_dir(path: Path | str) -> Path:
    """`mkdir -p` that creates each missing folder with mode 0700 whatever the umask; existing folders are left as
    they are (the trust check judges them). Returns the path."""
    path = Path(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not path.is_dir():
            raise NotADirectoryError(f"{path} exists and is not a folder") from None
        return path
    except FileNotFoundError:
        if path.parent == path:
            raise
        make_private_dir(path.parent)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # another process made it meanwhile
            return path
    os.chmod(path, 0o700)  # the umask may have removed owner bits
    return path


def seal(folder: Path) -> None:
    """Make a staged kernel folder private before it is published: the folder 0700, its files without group and
    world write permission (the compiler and the shell create them with the umask)."""
    os.chmod(folder, 0o700)
    for f in folder.iterdir():
        st = f.lstat()
        if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o022:
            os.chmod(f, stat.S_IMODE(st.st_mode) & ~0o022)


def provenance() -> dict:
    """Who and where this process runs, for a kernel's meta.json: user, uid, host and UTC time."""
    uid = os.getuid() if _supported() else None
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry (containers): the uid says who
        user = f"uid {uid}"
    return {"user": user, "uid": uid, "host": socket.gethostname(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


# ---------------------------------------------------------------------------------------------- checking
def _name(uid: int) -> Optional[str]:
    try:
        import pwd  # noqa: PLC0415

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return None


def _user(uid: int) -> str:
    name = _name(uid)
    return f"{name} (uid {uid})" if name else f"uid {uid}"


def _problem(path: Path, *, fix_mode: str, above_root: bool = False) -> Optional[str]:
    """What is wrong with one path's owner or mode, with the fix; None if nothing."""
    st = os.stat(path)
    me = os.getuid()
    if st.st_uid not in (me, 0):
        risk = "can replace the cache below it" if above_root else "can put code in it"
        return (f"{path} is owned by {_user(st.st_uid)}, not by you ({_user(me)}), and its owner {risk}: use a "
                f"cache of your own, or `chown -R {_name(me) or me} {path}` if it is yours")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and not (above_root and mode & stat.S_ISVTX):
        who = "world-writable" if mode & 0o002 else "group-writable"
        return f"{path} is {who} (mode {mode:04o}): `chmod {fix_mode} {path}`"
    return None


def root_problems(root: Path | str) -> list[str]:
    """Every reason not to trust a cache root: the folders above it, the root and its cache folders."""
    real = Path(os.path.realpath(root))
    problems = [p for a in reversed(real.parents) if (p := _problem(a, fix_mode="go-w", above_root=True))]
    problems += [p for p in [_problem(real, fix_mode="700")] if p]
    for name in CACHE_FOLDERS:
        sub = real / name
        try:
            p = _problem(sub, fix_mode="700")
        except FileNotFoundError:
            continue
        if p:
            problems.append(p)
    return problems


def kernel_problems(entry_dir: Path | str, lib_name: str = "kernel.so") -> list[str]:
    """Every reason not to open a cached library: its folders and the library file."""
    entry_dir = Path(entry_dir)
    out = [_problem(entry_dir.parent, fix_mode="700"), _problem(entry_dir, fix_mode="700")]
    lib = entry_dir / lib_name
    if lib.exists():
        out.append(_problem(lib, fix_mode="go-w"))
    return [p for p in out if p]


_trusted: set[str] = set()


def ensure_trusted_root(root: Path | str) -> None:
    """Raise UntrustedCacheError unless `root` may be loaded from. Checked once per root and process."""
    key = str(root)
    if key in _trusted or trust_override() or not _supported():
        return
    problems = root_problems(root)
    if problems:
        raise UntrustedCacheError(Path(root), problems)
    _trusted.add(key)


def ensure_trusted_kernel(entry_dir: Path | str, lib_name: str = "kernel.so", what: str = "the cached kernel") -> None:
    """Raise UntrustedCacheError unless a cached kernel's folder and library are the user's (or root's) alone.
    Called once per library opened (the loaded library is then remembered by the runtime)."""
    if trust_override() or not _supported():
        return
    problems = kernel_problems(entry_dir, lib_name)
    if problems:
        raise UntrustedCacheError(Path(entry_dir), problems, what=what)


def forget() -> None:
    """Drop the remembered verdicts (tests; or after fixing a cache's permissions in a long-lived process)."""
    _trusted.clear()
