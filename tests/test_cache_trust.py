"""Kernel cache trust (issue 14): a cache's libraries are code loaded into the process, so the cache is private
(folders 0700), a root that another user owns or others can write is refused before anything is loaded from it
(unless trusted on purpose), imports say that kernels are code, and each kernel records who built it.

This machine runs the tests as root, so other owners are simulated by reporting another uid from os.stat."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from cutlass_byoc import cli, trust
from cutlass_byoc.cache import CACHE_FORMAT, EntryState, KernelCache
from cutlass_byoc.decisions import DecisionStore, GpuInfo, record_decision
from cutlass_byoc.trust import TRUST_ENV, UntrustedCacheError

GPU = GpuInfo("NVIDIA H200", 90)
OTHER_UID = 4242


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch, tmp_path):
    """No trust override from the environment, and no verdict remembered from another test. The CLI's
    --cache-dir and --trust-cache-dir write os.environ directly: setting both here first makes monkeypatch
    restore them afterwards."""
    monkeypatch.setenv(TRUST_ENV, "0")
    monkeypatch.delenv(TRUST_ENV)
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(tmp_path / "default-cache"))
    trust.forget()
    yield
    trust.forget()


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def pretend_owned_by(monkeypatch, uid: int, *paths: Path) -> None:
    """os.stat reports `uid` as the owner of these paths (what another user's folder looks like)."""
    real_stat = os.stat
    targets = {str(Path(p).resolve()) for p in paths}

    def fake_stat(p, *args, **kwargs):
        st = real_stat(p, *args, **kwargs)
        if isinstance(p, int) or os.fspath(p) not in targets:
            return st
        extra = {k: getattr(st, k) for k in dir(st) if k.startswith("st_") and k != "st_uid"}
        return os.stat_result((*st[:4], uid, *st[5:]), extra)

    monkeypatch.setattr(os, "stat", fake_stat)


def fake_kernel(cache: KernelCache, key: str, lib: bytes, **meta) -> Path:
    """Publish an entry whose meta.json matches its kernel.so (sha256 and all), as a tamperer would write it."""
    staged = cache.staging_dir(key)
    (staged / "kernel.so").write_bytes(lib)
    (staged / "meta.json").write_text(json.dumps({
        "format": CACHE_FORMAT, "key": key, "name": "planted", "sha256": hashlib.sha256(lib).hexdigest(), **meta}))
    entry = cache.publish(key, staged)
    assert entry.state is EntryState.OK  # the sha256 check passes: it detects corruption, not tampering
    return entry.path


# ---------------------------------------------------------------------------------------------- creating
def test_new_folders_are_0700_and_files_lose_group_and_world_write_whatever_the_umask(tmp_path):
    root = tmp_path / "a" / "b" / "cache"
    old = os.umask(0)  # the worst umask: everything would be created world-writable
    try:
        cache = KernelCache(root)
        store = DecisionStore(root)
        from cutlass_byoc.heuristics import default_launch
        from cutlass_byoc.problem import Conv2dProblem

        p = Conv2dProblem.make("fprop", 8, 64, 56, 56, 64, 3, padding=1)
        record_decision(p, default_launch(p), 10.0, gpu=GPU, store=store)
        entry = fake_kernel(cache, "ab" + "0" * 62, b"\x7fELF not really")
        staged = cache.staging_dir("cd" + "0" * 62)
        log = staged / "build.log"
        log.write_text("warnings")  # created 0666 under umask 0, as nvcc's log would be
        assert mode(log) == 0o666
        published = cache.publish("cd" + "0" * 62, staged)
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", root, root / "kernels", root / "locks", root / "tmp",
              root / "decisions", entry.parent, entry, published.path):
        assert mode(d) == 0o700, d
    assert mode(next(store.iter_files()).parent) == 0o700
    for f in (entry / "kernel.so", entry / "meta.json", published.path / "build.log"):
        assert mode(f) & 0o022 == 0, f
    KernelCache(root)  # and the cache it made is accepted


# ---------------------------------------------------------------------------------------------- refusing
def test_a_world_writable_cache_dir_is_refused_with_path_problem_and_fix(tmp_path, capsys):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UntrustedCacheError) as e:
        KernelCache(root)
    msg = str(e.value)
    assert f"{root} is world-writable (mode 0777)" in msg
    assert f"chmod 700 {root}" in msg and f"{TRUST_ENV}=1" in msg and "code" in msg
    with pytest.raises(UntrustedCacheError):
        DecisionStore(root)  # decisions choose kernels: the same rule

    assert cli.main(["--cache-dir", str(root), "cache", "list"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "world-writable" in err and f"chmod 700 {root}" in err

    os.chmod(root, 0o700)  # the fix the message gave
    assert cli.main(["--cache-dir", str(root), "cache", "list"]) == 0


def test_group_writable_cache_folders_are_refused(tmp_path):
    root = tmp_path / "c"
    KernelCache(root)
    trust.forget()
    os.chmod(root / "kernels", 0o770)
    with pytest.raises(UntrustedCacheError, match=rf"{root / 'kernels'} is group-writable \(mode 0770\)"):
        KernelCache(root)


def test_a_folder_above_the_root_others_can_write_is_refused_unless_sticky(tmp_path):
    above = tmp_path / "open"
    above.mkdir()
    os.chmod(above, 0o777)  # anyone could rename the cache away and put theirs in its place
    with pytest.raises(UntrustedCacheError, match=rf"{above} is world-writable .*chmod go-w {above}"):
        KernelCache(above / "cache")
    os.chmod(above, 0o1777)  # sticky, as /tmp: others cannot rename what is ours
    KernelCache(above / "cache")


def test_a_dir_owned_by_another_uid_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "theirs"
    KernelCache(root)  # exists, 0700
    trust.forget()
    pretend_owned_by(monkeypatch, OTHER_UID, root)
    with pytest.raises(UntrustedCacheError) as e:
        KernelCache(root)
    assert f"{root} is owned by uid {OTHER_UID}, not by you (" in str(e.value)
    assert "its owner can put code in it" in str(e.value) and "chown -R " in str(e.value)
    assert f"{TRUST_ENV}=1" in str(e.value)

    # a cache folder inside our own root, owned by someone else, is refused the same way
    mine = tmp_path / "mine"
    DecisionStore(mine)
    trust.forget()
    pretend_owned_by(monkeypatch, OTHER_UID, mine / "decisions")
    with pytest.raises(UntrustedCacheError, match=f"{mine / 'decisions'} is owned by uid {OTHER_UID}"):
        DecisionStore(mine)


def test_a_dir_owned_by_you_or_root_is_accepted(tmp_path, monkeypatch):
    root = tmp_path / "c"
    KernelCache(root)
    trust.forget()
    monkeypatch.setattr(os, "getuid", lambda: 1000)  # an ordinary user: the folders above are root's (fine)
    pretend_owned_by(monkeypatch, 1000, root, *(root / s for s in ("kernels", "locks", "tmp")))
    KernelCache(root)


def test_the_trust_override_accepts_a_shared_cache(tmp_path, monkeypatch, capsys):
    root = tmp_path / "fleet"
    KernelCache(root)
    entry = fake_kernel(KernelCache(root), "ef" + "0" * 62, b"lib")
    trust.forget()
    os.chmod(root, 0o777)
    pretend_owned_by(monkeypatch, OTHER_UID, root / "kernels", entry)  # e.g. a service account's cache
    with pytest.raises(UntrustedCacheError):
        KernelCache(root)
    with pytest.raises(UntrustedCacheError):
        trust.ensure_trusted_kernel(entry)

    assert cli.main(["--cache-dir", str(root), "--trust-cache-dir", "cache", "list", "--kernels"]) == 0
    assert "1 ok" in capsys.readouterr().out
    assert os.environ[TRUST_ENV] == "1"  # set for the profiler's workers too (monkeypatch restores it)

    monkeypatch.setenv(TRUST_ENV, "1")
    KernelCache(root).lookup("ef" + "0" * 62)
    DecisionStore(root)
    trust.ensure_trusted_kernel(entry)


def test_the_verdict_is_remembered_per_root(tmp_path, monkeypatch):
    root = tmp_path / "c"
    KernelCache(root)
    calls = []
    monkeypatch.setattr(trust, "root_problems", lambda r: calls.append(r) or [])
    for _ in range(3):
        trust.ensure_trusted_root(root)
        KernelCache(root)
    assert calls == []  # checked once, when the first KernelCache was made
    trust.ensure_trusted_root(tmp_path / "other")
    assert calls == [tmp_path / "other"]


def test_a_kernel_others_can_write_or_another_user_owns_is_not_opened(tmp_path, monkeypatch):
    cache = KernelCache(tmp_path / "c")
    entry = fake_kernel(cache, "12" + "0" * 62, b"lib")
    trust.ensure_trusted_kernel(entry)
    os.chmod(entry / "kernel.so", 0o666)
    with pytest.raises(UntrustedCacheError, match=rf"{entry / 'kernel.so'} is world-writable .*chmod go-w"):
        trust.ensure_trusted_kernel(entry)
    os.chmod(entry / "kernel.so", 0o600)
    pretend_owned_by(monkeypatch, OTHER_UID, entry)
    with pytest.raises(UntrustedCacheError, match=f"{entry} is owned by uid {OTHER_UID}"):
        trust.ensure_trusted_kernel(entry)


# ---------------------------------------------------------------------------------------------- provenance, import
def test_cache_show_and_list_say_who_built_a_kernel(tmp_cache, capsys):
    key = "34" + "0" * 62
    fake_kernel(tmp_cache, key, b"lib", built_by=trust.provenance())
    old = "56" + "0" * 62
    fake_kernel(tmp_cache, old, b"old lib")  # built before built_by was recorded
    assert cli.main(["cache", "show", key[:12]]) == 0
    shown = json.loads(capsys.readouterr().out)
    by = shown["built_by"]
    assert by["uid"] == os.getuid() and by["host"] and by["user"] and by["time"].endswith("Z")
    assert cli.main(["cache", "show", old[:12]]) == 0
    assert json.loads(capsys.readouterr().out)["built_by"].startswith("unknown")
    assert cli.main(["cache", "list", "--kernels"]) == 0
    out = capsys.readouterr().out
    assert f"built by {by['user']}@{by['host']} at {by['time']}" in out and "built by ?" in out


def test_import_says_kernels_are_code_and_installs_them_private(tmp_path, monkeypatch, capsys):
    src = tmp_path / "src"
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(src))
    key = "78" + "0" * 62
    fake_kernel(KernelCache(src), key, b"lib", built_by={"user": "alice", "host": "build-box", "time": "T"})
    tgz = tmp_path / "k.tar.gz"
    assert cli.main(["cache", "export", str(tgz), "--all-kernels"]) == 0
    with tarfile.open(tgz) as t:  # the export keeps the 0700 folders; import must not depend on that
        assert {m.mode & 0o077 for m in t.getmembers() if m.isdir()} == {0}
    capsys.readouterr()

    dst = tmp_path / "dst"
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(dst))
    assert cli.main(["cache", "import", str(tgz)]) == 0
    cap = capsys.readouterr()
    assert "kernels are code" in cap.err and "--decisions-only" in cap.err and "1 compiled kernels" in cap.err
    assert "and 1 kernels" in cap.out
    entry = KernelCache(dst).lookup(key)
    assert entry.state is EntryState.OK and mode(entry.path) == 0o700
    assert entry.meta["built_by"]["user"] == "alice"  # who built it, over there
    assert entry.meta["imported"]["from"] == str(tgz) and entry.meta["imported"]["uid"] == os.getuid()


# ---------------------------------------------------------------------------------------------- compile-only
def _cc() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


EVIL_SO = r"""
#include <stdio.h>
#include <stdlib.h>
/* Runs at dlopen, before any symbol is looked up: what a planted kernel.so would do. */
__attribute__((constructor)) static void planted(void) {
    const char *p = getenv("CB_TEST_PLANTED_MARKER");
    FILE *f = p ? fopen(p, "a") : NULL;
    if (f) { fputs("ran\n", f); fclose(f); }
}
"""


@pytest.mark.compile
@pytest.mark.skipif(_cc() is None, reason="needs a C compiler to build the planted library")
def test_trust_boundary_a_tampered_kernel_with_matching_meta_loads_only_from_a_trusted_root(tmp_path, monkeypatch):
    """The sha256 in meta.json detects corruption, not tampering: a kernel.so replaced together with its meta.json
    is opened (and its code runs) whenever its cache passes the check. The check on who owns and can write the
    cache is the trust boundary: a cache owned by someone else is refused before dlopen."""
    from cutlass_byoc.build import prepare
    from cutlass_byoc.runtime import KernelLaunchError, load_kernel

    from test_cache import small_config

    cfg = small_config()
    key = prepare(cfg)[1]
    evil_c = tmp_path / "evil.c"
    evil_c.write_text(EVIL_SO)
    evil = tmp_path / "evil.so"
    subprocess.run([_cc(), "-shared", "-fPIC", "-o", str(evil), str(evil_c)], check=True)
    marker = tmp_path / "marker"
    monkeypatch.setenv("CB_TEST_PLANTED_MARKER", str(marker))

    def ran() -> int:
        return len(marker.read_text().splitlines()) if marker.exists() else 0

    def plant(root: Path) -> KernelCache:
        cache = KernelCache(root)
        fake_kernel(cache, key, evil.read_bytes(), name=cfg.name, config=cfg.to_dict())
        return cache

    # 1. A cache that passes the check: the planted library is opened and its code runs (it is then refused,
    #    too late, for lacking the kernel API). Nothing but the cache's privacy protects this process.
    mine = plant(tmp_path / "mine")
    with pytest.raises(KernelLaunchError, match="not a cutlass-byoc kernel library"):
        load_kernel(cfg, mine, build_missing=False)
    assert ran() == 1

    # 2. The same files in a cache owned by another user: refused before dlopen, so nothing runs, whether the
    #    cache comes from the environment or was made earlier by the caller.
    theirs = plant(tmp_path / "theirs")
    trust.forget()
    pretend_owned_by(monkeypatch, OTHER_UID, theirs.root)
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(theirs.root))
    with pytest.raises(UntrustedCacheError, match=f"owned by uid {OTHER_UID}"):
        load_kernel(cfg, build_missing=False)
    with pytest.raises(UntrustedCacheError, match=f"owned by uid {OTHER_UID}"):
        load_kernel(cfg, theirs, build_missing=False)
    assert ran() == 1

    # 3. A private root holding a kernel.so that others can write: refused as well.
    loose = plant(tmp_path / "loose")
    os.chmod(loose.entry_dir(key) / "kernel.so", 0o666)
    with pytest.raises(UntrustedCacheError, match="kernel.so is world-writable"):
        load_kernel(cfg, loose, build_missing=False)
    assert ran() == 1

    # 4. Trusting the shared cache on purpose means trusting whoever can write it: its library runs.
    monkeypatch.setenv(TRUST_ENV, "1")
    with pytest.raises(KernelLaunchError, match="not a cutlass-byoc kernel library"):
        load_kernel(cfg, theirs, build_missing=False)
    assert ran() == 2


@pytest.mark.compile
def test_import_decisions_only_rebuilds_the_kernels_here_and_records_the_same_decisions(tmp_path, monkeypatch,
                                                                                       capsys):
    from cutlass_byoc.build import prepare
    from cutlass_byoc.config import LaunchConfig
    from cutlass_byoc.runtime import KernelLibrary

    from test_cache import SMALL, small_config

    cfg = small_config()
    key = prepare(cfg)[1]
    src = tmp_path / "src"
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(src))
    record_decision(SMALL, LaunchConfig(cfg), 3.5, gpu=GPU)
    # the exported cache carries a library for the decision's kernel that is not what the templates make
    fake_kernel(KernelCache(src), key, b"\x7fELF planted", name=cfg.name)
    tgz = tmp_path / "tuned.tar.gz"
    assert cli.main(["cache", "export", str(tgz)]) == 0
    assert "exported 1 decisions and 1 kernels" in capsys.readouterr().out

    dst = tmp_path / "dst"
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(dst))
    assert cli.main(["cache", "import", str(tgz), "--decisions-only", "--no-progress", "--jobs", "2"]) == 0
    cap = capsys.readouterr()
    assert "imported 1 decisions (0 already present)" in cap.out and "ignored the 1 kernels" in cap.out
    assert "1 compiled now, 0 already in the cache, 0 failed" in cap.out
    assert "kernels are code" not in cap.err

    src_files = {p.name: p.read_text() for p in DecisionStore(src).iter_files()}
    dst_files = {p.name: p.read_text() for p in DecisionStore(dst).iter_files()}
    assert dst_files == src_files  # the same decisions, byte for byte

    entry = KernelCache(dst).lookup(key)
    assert entry.state is EntryState.OK
    assert entry.library.read_bytes() != b"\x7fELF planted"  # compiled here, not taken from the tarball
    assert "imported" not in entry.meta
    assert entry.meta["built_by"] == {**entry.meta["built_by"], "uid": os.getuid(), "host": trust.provenance()["host"]}
    KernelLibrary(cfg, entry.library)  # the real kernel: its ABI and config check out
    assert mode(entry.path) == 0o700
