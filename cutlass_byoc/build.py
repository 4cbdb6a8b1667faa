"""Compile kernel configs into the cache: render, key, skip what is cached, build the rest in parallel with ninja.

Each kernel is published into the cache the moment ninja finishes it, so a build that is interrupted (Ctrl-C, a
killed tune, a lost machine) keeps every kernel it had compiled. Failures are stored beside their source with nvcc's
log and are not retried unless asked (`retry_failed`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from .cache import CACHE_FORMAT, EntryState, KernelCache, KernelEntry, kernel_key, sha256_file
from .config import KernelConfig
from .render import render
from .toolchain import Toolchain, toolchain
from .trust import provenance
from .types import KernelFamily

log = logging.getLogger("cutlass_byoc.build")


class CompileError(RuntimeError):
    """A kernel failed to compile; the message holds the failing lines of the generated source and of nvcc's log."""


@dataclasses.dataclass(frozen=True)
class BuildResult:
    config: KernelConfig
    entry: KernelEntry
    built_now: bool  # compiled by this call (False: came from the cache)

    @property
    def ok(self) -> bool:
        return self.entry.state is EntryState.OK

    @property
    def library(self) -> Path:
        return self.entry.library

    def error_report(self, context: int = 2, max_lines: int = 40) -> str:
        return format_compile_error(self.entry, context=context, max_lines=max_lines)


def default_jobs() -> int:
    """One compile per core, bounded by memory (a 2.x kernel takes ~0.6 GB, a 3.x one ~3.5 GB while compiling)."""
    env = os.environ.get("CUTLASS_BYOC_JOBS")
    if env:
        return max(1, int(env))
    return max(1, os.cpu_count() or 1)


def _ninja() -> str:
    try:
        import ninja  # noqa: PLC0415

        exe = os.path.join(ninja.BIN_DIR, "ninja")
        if os.path.exists(exe):
            return exe
    except ImportError:
        pass
    exe = shutil.which("ninja")
    if not exe:
        raise RuntimeError("ninja not found: pip install ninja")
    return exe


def _ninja_escape(s: str) -> str:
    return s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def format_compile_error(entry: KernelEntry, context: int = 2, max_lines: int = 40) -> str:
    """nvcc's first errors, each with the generated source lines it points at."""
    logtext = entry.log
    src = entry.source.read_text().splitlines() if entry.source.exists() else []
    errors = [ln for ln in logtext.splitlines() if "error" in ln.lower()][:8]
    shown, out = set(), [f"kernel {entry.meta.get('name', entry.key)} failed to compile ({entry.path}):"]
    out += ["  " + e for e in errors] or ["  " + ln for ln in logtext.splitlines()[-10:]]
    for m in re.finditer(r"kernel\.cu\((\d+)\)", logtext):
        line = int(m.group(1))
        if line in shown or not src:
            continue
        shown.add(line)
        out.append(f"  kernel.cu:{line}:")
        for i in range(max(1, line - context), min(len(src), line + context) + 1):
            out.append(f"  {'>' if i == line else ' '} {i:5d} | {src[i - 1]}")
        if len(out) > max_lines:
            break
    return "\n".join(out[:max_lines])


@dataclasses.dataclass
class _Job:
    config: KernelConfig
    key: str
    source: str
    staged: Path


#: Typical nvcc seconds of one kernel per family, relative to the CUTLASS 3.x kernels (medians of the default workload's
#: 218 kernels compiled two at a time on the CPU machine, 2026-12-04: 3.x conv 57-64 s, 3.x GEMM 1x1 53-62, 2.x 12-16,
#: shared-memory im2col 5; depthwise ~2.5). Only their order matters: the build lists the longest first, so ninja
#: (which starts edges in that order when it has no history of them) ends on short kernels instead of leaving one
#: minute-long kernel compiling alone at the end (longest-processing-time-first scheduling).
COMPILE_WEIGHT = {KernelFamily.SM90_TMA_WGMMA: 60.0, KernelFamily.SM90_GEMM_1X1: 57.0,
                  KernelFamily.SM80_IMPLICIT_GEMM: 14.0, KernelFamily.SMEM_IM2COL: 5.0,
                  KernelFamily.DEPTHWISE_DIRECT: 2.5}


def compile_weight(config: KernelConfig) -> float:
    return COMPILE_WEIGHT.get(config.family, 30.0)  # a family without a measurement: between the two groups


def prepare(config: KernelConfig, tc: Optional[Toolchain] = None) -> tuple[str, str]:
    """(rendered source, cache key) of a config."""
    tc = tc or toolchain(config.arch)
    source = render(config, tc.describe())
    return source, kernel_key(source, tc)


def build(
    configs: Iterable[KernelConfig],
    *,
    jobs: Optional[int] = None,
    cache: Optional[KernelCache] = None,
    progress: bool = False,
    retry_failed: bool = False,
    raise_on_error: bool = False,
    on_result: Optional[Callable[[KernelConfig, BuildResult], None]] = None,
    nice: int = 0,
) -> dict[KernelConfig, BuildResult]:
    """Make sure every config has a cache entry (compiled or failed) and return them.

    Safe with several processes building at once: each key is built under its lock by one of them; the others wait
    for that lock and then find the published entry.

    `on_result(config, result)` is called once per config, in this thread, as soon as its result is known: at once for
    a cached one, as ninja finishes a compiled one (the tuner starts timing a problem whose kernels are all there).
    `nice` > 0 runs the compilers at that lower CPU priority (`nice -n`), so a process timing kernels beside the
    build keeps its core.
    """
    cache = cache or KernelCache()
    configs = list(dict.fromkeys(configs))
    results: dict[KernelConfig, BuildResult] = {}

    def settle(result: BuildResult) -> None:
        results[result.config] = result
        if on_result is not None:
            on_result(result.config, result)

    pending: list[tuple[KernelConfig, str, str]] = []
    for cfg in configs:
        source, key = prepare(cfg)
        entry = cache.lookup(key)
        if entry.state is EntryState.OK or (entry.state is EntryState.FAILED and not retry_failed):
            settle(BuildResult(cfg, entry, False))
        else:
            pending.append((cfg, key, source))

    # Take the lock of every key we will build; keys locked by someone else are waited for afterwards.
    mine: list[_Job] = []
    theirs: list[tuple[KernelConfig, str]] = []
    locks = []
    try:
        for cfg, key, source in pending:
            lk = cache.lock(key)
            try:
                lk.acquire(timeout=0)
            except Exception:  # filelock.Timeout: another process is building it
                theirs.append((cfg, key))
                continue
            locks.append(lk)
            entry = cache.lookup(key)  # re-check under the lock
            if entry.state is EntryState.OK or (entry.state is EntryState.FAILED and not retry_failed):
                settle(BuildResult(cfg, entry, False))
                continue
            mine.append(_Job(cfg, key, source, cache.staging_dir(key)))
        if mine:
            published: dict[str, BuildResult] = {}

            def done(job: _Job) -> None:  # ninja finished this kernel: publish it now, whatever happens to the rest
                published[job.key] = BuildResult(job.config, cache.publish(job.key, job.staged), True)
                settle(published[job.key])

            mine.sort(key=lambda j: -compile_weight(j.config))  # longest first (stable: the given order in a family)
            _run_ninja(mine, cache, jobs or default_jobs(), progress, on_done=done, nice=nice)
            for job in mine:
                if job.key not in published:
                    done(job)
    finally:
        for lk in locks:
            lk.release()
    for cfg, key in theirs:
        with cache.lock(key):
            entry = cache.lookup(key)
        if entry.state is EntryState.MISSING:  # the other process died mid-build: build it ourselves
            results.update(build([cfg], jobs=jobs, cache=cache, progress=False, retry_failed=retry_failed,
                                 on_result=on_result, nice=nice))
        else:
            settle(BuildResult(cfg, entry, False))

    for r in results.values():
        if r.built_now and r.ok and r.entry.log.strip():
            log.info("%s compiled with warnings (see %s/build.log)", r.config.name, r.entry.path)
        if not r.ok:
            log.warning("%s", r.error_report())
    if raise_on_error:
        failed = [r for r in results.values() if not r.ok]
        if failed:
            raise CompileError("\n\n".join(r.error_report() for r in failed))
    return {cfg: results[cfg] for cfg in configs}


def _run_ninja(jobs_: Sequence[_Job], cache: KernelCache, jobs: int, progress: bool,
               on_done: Optional[Callable[[_Job], None]] = None, nice: int = 0) -> None:
    """Compile `jobs_` with ninja, each job's staging dir then holding its library and meta.json (or failed.json);
    `on_done(job)` is called as each one finishes (ninja, its output piped, reports an edge when it ends; its log has
    the edge's times by then), and for any it did not report once ninja exits. `nice` > 0: ninja and the compilers
    it starts run under `nice -n nice` (where a `nice` program exists)."""
    tc = toolchain(jobs_[0].config.arch)
    # absolute paths: ninja runs in build_dir (-C), where a cache given as a relative path would not resolve
    build_dir = cache.staging_dir("ninja").absolute()
    lines = [
        "ninja_required_version = 1.10",
        f"nvcc = {_ninja_escape(tc.nvcc)}",
        "flags = " + " ".join(_ninja_escape(f) for f in tc.flags),
        "rule nvcc",
        "  command = $nvcc $flags $in -o $out > $log 2>&1",
        "  description = $key $name",
        "",
    ]
    by_key = {job.key: job for job in jobs_}
    for job in jobs_:
        (job.staged / "kernel.cu").write_text(job.source)
        src, out, logf = (_ninja_escape(str(job.staged.absolute() / f)) for f in ("kernel.cu", "kernel.so", "build.log"))
        lines += [f"build {out}: nvcc {src}", f"  log = {logf}", f"  key = {job.key}",
                  f"  name = {_ninja_escape(job.config.name)}", ""]
    (build_dir / "build.ninja").write_text("\n".join(lines))

    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=len(jobs_), desc=f"compiling ({jobs} jobs)", unit="kernel")
    built_by = provenance()  # who compiled these kernels, where and when (`cutlass-byoc cache show` prints it)
    finished: set[str] = set()
    times = _NinjaTimes(build_dir / ".ninja_log")

    def seconds_of(job: _Job) -> Optional[float]:
        # ninja prints an edge's status line just before it appends the edge to its log: wait a moment for that
        lib = str((job.staged / "kernel.so").absolute())
        for _ in range(50):
            seconds = times.get(lib)
            if seconds is not None or proc.poll() is not None:
                return seconds
            time.sleep(0.002)
        return None

    def finish(job: _Job) -> None:
        finished.add(job.key)
        _record(job, tc, seconds_of(job), built_by)
        if on_done is not None:
            on_done(job)

    env = dict(os.environ, NINJA_STATUS="[%f/%t] ")
    t0 = time.time()
    lower = [nice_exe, "-n", str(nice)] if nice > 0 and (nice_exe := shutil.which("nice")) else []
    proc = subprocess.Popen(
        [*lower, _ninja(), "-C", str(build_dir), "-j", str(jobs), "-k", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    done = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.debug("ninja: %s", line.rstrip())
            m = re.match(r"\[(\d+)/(\d+)\] (\S+)", line)
            if not m:
                continue
            if bar is not None:
                n = int(m.group(1))
                bar.update(n - done)
                done = n
            job = by_key.get(m.group(3))
            if job is not None and job.key not in finished:
                finish(job)
        proc.wait()
        for job in jobs_:  # any edge ninja did not report (it failed to start, say): recorded as it is
            if job.key not in finished:
                finish(job)
    finally:
        if proc.poll() is None:  # interrupted: what finished is published, the rest stays uncompiled
            proc.terminate()
            proc.wait()
        if bar is not None:
            bar.update(len(jobs_) - done)
            bar.close()
        shutil.rmtree(build_dir, ignore_errors=True)
    log.info("compiled %d kernels in %.1f s with %d jobs", len(jobs_), time.time() - t0, jobs)


def _record(job: _Job, tc: Toolchain, seconds: Optional[float], built_by: dict) -> None:
    """Write a finished job's meta.json (its library compiled cleanly) or failed.json into its staging dir."""
    lib, logf = job.staged / "kernel.so", job.staged / "build.log"
    meta = {
        "format": CACHE_FORMAT, "key": job.key, "name": job.config.name, "config": job.config.to_dict(),
        "nvcc": tc.nvcc_version, "cutlass": tc.cutlass_version, "command": tc.describe(),
        "compile_seconds": seconds, "built_at": time.time(), "built_by": built_by,
    }
    if lib.is_file() and lib.stat().st_size > 0 and not _log_has_error(logf):
        meta["sha256"] = sha256_file(lib)
        (job.staged / "meta.json").write_text(json.dumps(meta, indent=1))
    else:
        if lib.exists():
            lib.unlink()
        meta["error"] = "compile failed"
        (job.staged / "failed.json").write_text(json.dumps(meta, indent=1))


def _log_has_error(logf: Path) -> bool:
    return logf.exists() and bool(re.search(r"(^|: )(fatal )?error\b", logf.read_text(errors="replace"), re.M))


class _NinjaTimes:
    """Per-output compile seconds from ninja's log (start and end in ms), read as ninja appends to it: each lookup
    reads only the lines added since the last one."""

    def __init__(self, path: Path):
        self.path, self.offset, self.seconds = path, 0, {}

    def get(self, output: str) -> Optional[float]:
        if output not in self.seconds and self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line ninja is still writing waits for the next lookup
            self.offset += len(complete)
            for ln in complete.decode(errors="replace").splitlines():
                parts = ln.split("\t")  # (the "# ninja log" header has no tabs)
                if len(parts) >= 4:
                    self.seconds[parts[3]] = (int(parts[1]) - int(parts[0])) / 1000.0
        return self.seconds.get(output)
