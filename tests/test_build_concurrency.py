"""Two processes building the same kernels into one cache compile each kernel once (the other waits on the key's
lock and takes the published entry): the "one rank compiles, the other waits" of a DDP job on one host. The
compiler is a fake (no nvcc), so this runs everywhere; test_cache.py checks the same with nvcc."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

from cutlass_byoc import build as build_mod
from cutlass_byoc.cache import CACHE_FORMAT, EntryState, KernelCache, sha256_file
from cutlass_byoc.candidates import sm80_candidates
from cutlass_byoc.problem import Conv2dProblem

PROBLEM = Conv2dProblem.make("fprop", 8, 64, 16, 16, 64, 3, padding=1)


def _configs(n=4):
    return list(sm80_candidates(PROBLEM))[:n]


def _fake_prepare(config, tc=None):
    import hashlib

    key = hashlib.sha256(config.name.encode()).hexdigest()
    return f"// {config.name}\n", key


def _fake_ninja(jobs_, cache, jobs, progress, on_done=None, nice=0):
    """Writes a library and meta.json per job after a pause, and logs which process compiled what."""
    time.sleep(1.0)
    with open(cache.root / "compiles.log", "a") as f:
        for job in jobs_:
            f.write(f"{os.getpid()} {job.key}\n")
    for job in jobs_:
        (job.staged / "kernel.cu").write_text(job.source)
        lib = job.staged / "kernel.so"
        lib.write_bytes(b"fake library " + job.key.encode())
        (job.staged / "build.log").write_text("")
        (job.staged / "meta.json").write_text(json.dumps({
            "format": CACHE_FORMAT, "key": job.key, "name": job.config.name, "sha256": sha256_file(lib),
            "built_at": time.time()}))


def _build_child(root, barrier, q):
    build_mod.prepare = _fake_prepare
    build_mod._run_ninja = _fake_ninja
    barrier.wait(30)
    res = build_mod.build(_configs(), cache=KernelCache(root), jobs=1)
    q.put(sorted((r.config.name, r.built_now, r.ok) for r in res.values()))


def test_two_processes_compile_each_kernel_once(tmp_path):
    ctx = mp.get_context("spawn")
    root = str(tmp_path / "cache")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_child, args=(root, barrier, q), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    out = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(ok for res in out for _, _, ok in res)
    lines = (tmp_path / "cache" / "compiles.log").read_text().split("\n")
    keys = [ln.split()[1] for ln in lines if ln.strip()]
    assert len(keys) == len(_configs()) and len(set(keys)) == len(keys)  # each kernel compiled by one process
    built = {name: 0 for name, _, _ in out[0]}
    for res in out:
        for name, now, _ in res:
            built[name] += now
    assert set(built.values()) == {1}  # and reported as built now by exactly one of them
    cache = KernelCache(root)
    assert all(cache.lookup(_fake_prepare(c)[1]).state is EntryState.OK for c in _configs())


def test_each_kernel_is_published_as_ninja_finishes_it(tmp_path, monkeypatch):
    """The real ninja driver with a fake compiler that takes 0.2 s for one kernel and 30 s for the other: the fast
    kernel is in the cache while the slow one still compiles, and interrupting the build (as a killed tune is) keeps it
    there and leaves the slow one uncompiled, not half-published."""
    import threading

    from cutlass_byoc.toolchain import Toolchain

    fast, slow = _configs(2)
    nvcc = tmp_path / "fake-nvcc"
    nvcc.write_text("#!/bin/sh\n"  # $flags... kernel.cu -o kernel.so: the slow kernel's source names it SLOW
                    "for a; do out=$a; done\n"
                    "case \"$(cat \"$(dirname \"$out\")/kernel.cu\")\" in *SLOW*) sleep 30;; *) sleep 0.2;; esac\n"
                    "echo library > \"$out\"\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(build_mod, "toolchain", lambda arch=90: Toolchain(str(nvcc), "13.0", "4.2", ()))
    monkeypatch.setattr(build_mod, "prepare", lambda c, tc=None: (
        f"// {c.name}{' SLOW' if c is slow else ''}\n", _fake_prepare(c)[1]))
    cache = KernelCache(tmp_path / "cache")
    seen = []

    def watch():  # the fast kernel appears in the cache while the build is still running
        for _ in range(200):
            if cache.lookup(_fake_prepare(fast)[1]).state is EntryState.OK:
                seen.append(time.time())
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    real = build_mod._run_ninja

    def interrupted(jobs_, cache_, jobs, progress, on_done=None, nice=0):
        def stop_after_fast(job):
            on_done(job)
            if job.config is fast:
                raise KeyboardInterrupt  # as Ctrl-C during a long tune
        return real(jobs_, cache_, jobs, progress, on_done=stop_after_fast)

    monkeypatch.setattr(build_mod, "_run_ninja", interrupted)
    t0 = time.time()
    try:
        build_mod.build([fast, slow], cache=cache, jobs=2)
    except KeyboardInterrupt:
        pass
    watcher.join()
    assert time.time() - t0 < 20  # ninja and its slow compile were stopped, not waited for
    assert seen and seen[0] - t0 < 10
    assert cache.lookup(_fake_prepare(fast)[1]).state is EntryState.OK
    assert cache.lookup(_fake_prepare(slow)[1]).state is EntryState.MISSING
    meta = json.loads((cache.lookup(_fake_prepare(fast)[1]).path / "meta.json").read_text())
    assert meta["name"] == fast.name and meta["compile_seconds"] is not None


def test_ninja_log_times_are_read_as_ninja_appends(tmp_path):
    """The compile seconds come from ninja's log as it grows: each lookup reads only the new lines, and a line still
    being written is read once it is whole."""
    log = tmp_path / ".ninja_log"
    log.write_text("# ninja log v6\n100\t2600\t0\t/a/kernel.so\tdeadbeef\n")
    times = build_mod._NinjaTimes(log)
    assert times.get("/a/kernel.so") == 2.5 and times.get("/b/kernel.so") is None
    with open(log, "a") as f:
        f.write("200\t1200\t0\t/b/ker")  # ninja mid-line
    assert times.get("/b/kernel.so") is None
    with open(log, "a") as f:
        f.write("nel.so\tcafe\n")
    assert times.get("/b/kernel.so") == 1.0 and times.get("/a/kernel.so") == 2.5


def test_the_longest_kernels_are_handed_to_ninja_first(tmp_path, monkeypatch):
    """The build lists the kernels by their family's typical compile time, longest first (3.x before 2.x; a family's
    own kernels in the given order), so ninja ends on short compiles instead of one long kernel compiling alone."""
    from cutlass_byoc.sm90 import sm90_candidates

    sm80 = _configs(3)
    sm90 = list(sm90_candidates(PROBLEM))[:2]
    seen = []

    def record(jobs_, cache, jobs, progress, on_done=None, nice=0):
        seen.extend(job.config for job in jobs_)
        _fake_ninja(jobs_, cache, jobs, progress, on_done)

    monkeypatch.setattr(build_mod, "prepare", _fake_prepare)
    monkeypatch.setattr(build_mod, "_run_ninja", record)
    res = build_mod.build([sm80[0], sm90[0], sm80[1], sm90[1], sm80[2]], cache=KernelCache(tmp_path / "c"), jobs=2)
    assert seen == [sm90[0], sm90[1], *sm80] and len(res) == 5
    assert build_mod.compile_weight(sm90[0]) > build_mod.compile_weight(sm80[0])


def test_results_are_handed_over_as_they_come_and_compilers_can_run_niced(tmp_path, monkeypatch):
    """`on_result` gets each config once: a cached kernel at once, a compiled one as ninja finishes it (the tuner
    times a problem as soon as its kernels are there); with `nice`, ninja's compilers run at that lower priority."""
    from cutlass_byoc.toolchain import Toolchain

    a, b, c = _configs(3)
    nvcc = tmp_path / "fake-nvcc"
    nvcc.write_text("#!/bin/sh\n"
                    "for a; do out=$a; done\n"
                    "nice > \"$(dirname \"$out\")/niceness\"\n"  # coreutils `nice` alone prints the niceness
                    "echo library > \"$out\"\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(build_mod, "toolchain", lambda arch=90: Toolchain(str(nvcc), "13.0", "4.2", ()))
    monkeypatch.setattr(build_mod, "prepare", _fake_prepare)
    cache = KernelCache(tmp_path / "cache")
    base = os.nice(0)

    first = build_mod.build([a], cache=cache, jobs=1)
    assert first[a].built_now and first[a].ok
    assert int((first[a].entry.path / "niceness").read_text()) == base  # no nice asked: unchanged

    got = []
    res = build_mod.build([b, a, c], cache=cache, jobs=1, nice=5,
                          on_result=lambda cfg, r: got.append((cfg, r.built_now, r.ok)))
    assert got[0] == (a, False, True)  # the cached kernel first, before ninja runs
    assert sorted(got[1:], key=lambda x: x[0].name) == sorted([(b, True, True), (c, True, True)],
                                                             key=lambda x: x[0].name)
    assert len(got) == 3 and all(res[cfg].ok for cfg in (a, b, c))
    for cfg in (b, c):
        assert int((res[cfg].entry.path / "niceness").read_text()) == min(19, base + 5)
