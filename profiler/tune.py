"""Tune a workload: skip what is decided, plan, compile every missing kernel in one parallel build, check and time
the candidates in a worker process and record each problem's winner in the decision cache.

Timing overlaps the build: a problem is timed as soon as every kernel of its candidates has a build result, while
the build compiles the rest (feed.py). A cold tune then takes about as long as its build (the timing of ~1 s per
problem hides behind the compiles), where timing after the build added its whole duration. The compilers run at
lower CPU priority meanwhile (BUILD_NICE), so the timing worker is never starved while it enqueues timed runs.

A second run of the same workload finds every decision and returns before planning: it compiles nothing and
times nothing. Without a GPU, planning and compiling still happen (the kernel cache is then warm for a GPU
machine sharing it, or for `cutlass-byoc cache export`), and the report says that timing needs a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Optional, Sequence

from ..build import BuildResult, build
from ..cache import KernelCache
from ..config import KernelConfig, LaunchConfig
from ..decisions import DecisionStore, GpuInfo, current_gpu, lookup, record_decision
from ..problem import Conv2dProblem
from ..trust import make_private_dir
from .feed import ProblemFeed
from .multigpu import (
    GpuSelectionError, GpuTiming, mixed_gpu_message, probe_gpus, time_on_gpus, visible_device,
)
from .plan import DEFAULT_MAX_CANDIDATES, plan_workload
from .worker import COMPILE_FAILED, CandidateResult, CandidateRunner, WorkerSettings

log = logging.getLogger("cutlass_byoc.profiler.tune")

# Problem outcomes
CACHED = "cached"  # a decision was recorded before: nothing compiled or timed
TUNED = "tuned"  # timed now; the winner is recorded
NO_WINNER = "no_winner"  # every candidate failed (compile, crash, wrong result): nothing recorded
NO_CANDIDATES = "no_candidates"  # no kernel of this build can compute the problem
COMPILED = "compiled"  # no GPU: planned and compiled, not timed

#: CPU priority of the compilers while kernels are timed beside the build (`nice -n`). The timing worker then keeps its
#: core: kernel times are GPU events, but a worker starved of CPU could fall behind the GPU while it enqueues the
#: timed runs, and a short kernel's runs would then include launch gaps.
BUILD_NICE = 10

NO_GPU_MESSAGE = (
    "timing needs a GPU: no CUDA device was found, so the candidates were planned and compiled into the kernel "
    "cache but not timed, and no decision was recorded. Run `cutlass-byoc tune` again on the GPU machine (with "
    "the same cache, or after `cutlass-byoc cache export/import`) to time them."
)


class TuneError(RuntimeError):
    """Tuning cannot proceed; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class ProblemOutcome:
    problem: Conv2dProblem
    status: str
    launch: Optional[LaunchConfig] = None
    time_us: Optional[float] = None
    results: tuple[CandidateResult, ...] = ()
    planned: int = 0  # launches planned
    message: str = ""
    cudnn_us: Optional[float] = None  # cuDNN's time, measured with the candidates

    def to_dict(self) -> dict:
        return {
            "problem": self.problem.name, "status": self.status,
            "launch": self.launch.name if self.launch else None, "time_us": self.time_us,
            "planned": self.planned, "message": self.message, "cudnn_us": self.cudnn_us,
            "results": [r.to_dict() for r in self.results],
        }


@dataclasses.dataclass(frozen=True)
class TuneReport:
    outcomes: tuple[ProblemOutcome, ...]
    gpu: Optional[GpuInfo]
    timed: bool
    kernels_planned: int = 0
    kernels_compiled: int = 0  # compiled by this run
    kernels_failed: int = 0
    launches_timed: int = 0
    compile_s: float = 0.0
    timing_s: float = 0.0
    total_s: float = 0.0
    worker_restarts: int = 0
    log_path: Optional[Path] = None
    message: str = ""
    devices: tuple[int, ...] = ()  # the GPUs that timed (--gpus); () for the one current device
    per_gpu: tuple[GpuTiming, ...] = ()  # with several devices: each one's problems and busy seconds
    #: timing ran beside the build (each problem timed once its kernels were built); timing_s then runs from the
    #: build's start, and timing_after_build_s is the part the build did not hide
    overlapped: bool = False
    timing_after_build_s: float = 0.0
    #: timed launches whose timing re-timed a pass behind a longer spin (CandidateResult.spin_retries), and those
    #: whose last pass still ran out of spin (host_bound: their times may include host time)
    launches_retimed: int = 0
    launches_host_bound: int = 0

    @property
    def all_decided(self) -> bool:
        return all(o.status in (CACHED, TUNED) for o in self.outcomes)

    @property
    def scaling(self) -> Optional[dict]:
        """What this run can say about timing over several GPUs: the wall time, each GPU's busy time (its worker
        timing launches), how evenly the problems were spread (`balance`: summed / longest busy time, at most the
        number of GPUs) and the wall time outside the longest busy time (worker start-up, kernel loading,
        coordination). It is no speed-up over one GPU: a run on one GPU pays its own, smaller start-up cost (on
        2 x H200 the summed busy time over the wall read well below the measured speed-up; benchmarks/h200/multigpu
        has both); time again with `--gpus 0` for that. With timing beside a build that compiled kernels, the wall
        time also holds the waits for them: read the scaling of a run on a warm cache. None unless several GPUs
        timed."""
        if len(self.per_gpu) < 2 or self.timing_s <= 0:
            return None
        busy = [g.busy_s for g in self.per_gpu]
        longest = max(busy)
        return {"gpus": len(self.per_gpu), "timing_s": self.timing_s, "busy_s": busy, "busy_s_sum": sum(busy),
                "busy_s_max": longest, "balance": sum(busy) / longest if longest > 0 else None,
                "outside_busy_s": max(0.0, self.timing_s - longest),
                "problems_per_gpu": [g.problems for g in self.per_gpu]}

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("outcomes", "gpu", "per_gpu", "devices")}
        d["log_path"] = str(self.log_path) if self.log_path else None
        d["gpu"] = self.gpu.tag if self.gpu else None
        d["devices"] = list(self.devices)
        d["per_gpu"] = [g.to_dict() for g in self.per_gpu]
        d["scaling"] = self.scaling
        d["outcomes"] = [o.to_dict() for o in self.outcomes]
        return d


def _log_file(cache: KernelCache) -> Path:
    d = make_private_dir(cache.root / "logs")
    return d / f"tune-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"


def pick_winner(results: Sequence[CandidateResult]) -> Optional[CandidateResult]:
    """The fastest candidate that ran, matched the reference and has a valid time; None if there is none."""
    ok = [r for r in results if r.ok and r.median_us is not None and r.median_us > 0]
    return min(ok, key=lambda r: (r.median_us, r.launch.name)) if ok else None


def tune_workload(
    problems: Sequence[Conv2dProblem],
    *,
    jobs: Optional[int] = None,
    max_candidates: int = DEFAULT_MAX_CANDIDATES,
    progress: bool = False,
    arch: int = 90,
    force: bool = False,
    compile_only: bool = False,
    cache: Optional[KernelCache] = None,
    store: Optional[DecisionStore] = None,
    settings: WorkerSettings = WorkerSettings(),
    gpu: Optional[GpuInfo] = None,
    devices: Optional[Sequence[int]] = None,
    overlap_timing: bool = True,
) -> TuneReport:
    """Decide a launch for every problem (see the module docstring). `force` re-times decided problems;
    `compile_only` stops after the build even with a GPU. `devices`: time on these GPUs, one worker each (see
    multigpu.py; they must all be the same GPU model); default: one worker on `settings.device`.
    `overlap_timing`: time each problem as soon as its kernels are built, while the build goes on (the compilers
    then run at lower CPU priority, BUILD_NICE); False times after the whole build, on an idle CPU."""
    t_start = time.perf_counter()
    cache = cache or KernelCache()
    store = store or DecisionStore(cache.root)
    problems = list(dict.fromkeys(problems))
    devices = list(devices) if devices else []
    if devices and gpu is None and not compile_only:
        # checked before compiling anything: a mix of GPU models is refused, and the decisions are keyed by the
        # GPUs that time (not by whichever device is current in this process)
        try:
            infos = probe_gpus(devices)
        except GpuSelectionError as e:
            raise TuneError(str(e)) from None
        msg = mixed_gpu_message(devices, infos)
        if msg:
            raise TuneError(msg)
        gpu = infos[0]
    if len(devices) == 1:
        settings = dataclasses.replace(settings, device=devices[0], visible_device=visible_device(devices[0]))
    gpu = gpu if gpu is not None else (None if compile_only else current_gpu())
    if gpu is not None and gpu.arch != arch:
        raise TuneError(
            f"the GPU is {gpu.tag} but kernels are built for sm_{arch}a; run with --arch {gpu.arch} "
            f"(this build generates sm_90a kernels: an H100/H200 is needed to time them)"
        )

    outcomes: dict[Conv2dProblem, ProblemOutcome] = {}
    todo: list[Conv2dProblem] = []
    for p in problems:
        dec = lookup(p, gpu=gpu, store=store) if (gpu is not None and not force) else None
        if dec is not None:
            outcomes[p] = ProblemOutcome(p, CACHED, dec.launch, dec.time_us, message="decision cache",
                                         cudnn_us=dec.cudnn_us)
        else:
            todo.append(p)
    if not todo:
        return TuneReport(tuple(outcomes[p] for p in problems), gpu, gpu is not None,
                          total_s=time.perf_counter() - t_start, message="every problem was decided before")

    # Plans and decisions are for the user's problem; a channel-padded launch carries its padding (pad_c, pad_k).
    plan = plan_workload(todo, max_candidates, arch=arch)
    plan_of = {pp.problem: pp for pp in plan.plans}
    kernels = plan.kernels
    log.info("planned %d launches of %d distinct kernels for %d problems", plan.launches, len(kernels), len(todo))
    timed = gpu is not None and not compile_only
    overlap = timed and overlap_timing

    log_path = _log_file(cache)
    log_lock = threading.Lock()
    timing_s, timing_after_build_s, launches_timed, restarts = 0.0, 0.0, 0, 0
    launches_retimed, launches_host_bound = 0, 0
    per_gpu: list[GpuTiming] = []
    builds: dict[KernelConfig, BuildResult] = {}  # filled as the build settles each kernel (on_result)
    with open(log_path, "a") as logf:
        def emit(rec: dict) -> None:  # from the build (this thread) and the timing thread(s)
            with log_lock:
                logf.write(json.dumps(rec, sort_keys=True) + "\n")
                logf.flush()

        emit({"event": "plan", "problems": len(todo), "kernels": len(kernels), "launches": plan.launches,
              "gpu": gpu.tag if gpu else None, "overlap_timing": overlap})

        # A problem is ready to time once each of its kernels has a build result (compiled, cached or failed).
        # Costliest first (candidates x flops): with several GPUs, no GPU is left with a big problem at the end.
        feed: ProblemFeed[Conv2dProblem] = ProblemFeed(cost=lambda p: len(plan_of[p].candidates) * p.flops)
        missing = {p: set(plan_of[p].kernels) for p in todo}
        users: dict[KernelConfig, list[Conv2dProblem]] = {}
        for p in todo:
            for k in missing[p]:
                users.setdefault(k, []).append(p)

        def on_result(kc: KernelConfig, r: BuildResult) -> None:
            builds[kc] = r
            if not r.ok:
                emit({"event": "compile_failed", "kernel": kc.name, "entry": str(r.entry.path)})
            for p in users.get(kc, ()):
                missing[p].discard(kc)
                if not missing[p]:
                    feed.put(p)

        for p in todo:
            if not missing[p]:  # no candidates: nothing to wait for
                feed.put(p)

        bar = None
        cudnn_us: dict[Conv2dProblem, Optional[float]] = {}

        def evaluate(runner, p: Conv2dProblem) -> list[CandidateResult]:
            pp = plan_of[p]
            runnable = [c.launch for c in pp.candidates if builds[c.launch.kernel].ok]
            results = [CandidateResult(c.launch, COMPILE_FAILED, message=f"see {builds[c.launch.kernel].entry.path}")
                       for c in pp.candidates if not builds[c.launch.kernel].ok]
            if runnable:  # cuDNN timed first, on the same operands: the bar the winner must clear
                results += runner.evaluate(p, runnable, baseline=True)
                cudnn_us[p] = runner.baseline_us
            return results

        def finish(p: Conv2dProblem, results: list[CandidateResult]) -> None:  # one problem at a time
            nonlocal launches_timed, launches_retimed, launches_host_bound
            pp = plan_of[p]
            launches_timed += sum(1 for r in results if r.median_us is not None)
            launches_retimed += sum(1 for r in results if r.spin_retries)
            launches_host_bound += sum(1 for r in results if r.host_bound)
            for r in results:
                emit({"event": "candidate", "problem": p.name, **r.to_dict()})
            win = pick_winner(results)
            if not pp.candidates:
                outcomes[p] = ProblemOutcome(p, NO_CANDIDATES, message="no kernel family computes it")
            elif win is None:
                counts: dict[str, int] = {}
                for r in results:
                    counts[r.status] = counts.get(r.status, 0) + 1
                outcomes[p] = ProblemOutcome(p, NO_WINNER, results=tuple(results), planned=len(pp.candidates),
                                             message="no candidate passed: " + ", ".join(
                                                 f"{n} {s}" for s, n in sorted(counts.items())))
            else:
                others = sorted((r for r in results if r.ok and r is not win), key=lambda r: r.median_us)
                record_decision(
                    p, win.launch, win.median_us, gpu=gpu, store=store,
                    candidates_timed=sum(1 for r in results if r.ok),
                    runner_up=others[0].launch.name if others else None,
                    runner_up_us=others[0].median_us if others else None, max_error=win.max_error,
                    cudnn_us=cudnn_us.get(p),
                )
                outcomes[p] = ProblemOutcome(p, TUNED, win.launch, win.median_us, tuple(results),
                                             len(pp.candidates), cudnn_us=cudnn_us.get(p))
            emit({"event": "decision", **{k: v for k, v in outcomes[p].to_dict().items() if k != "results"}})
            if bar is not None:
                bar.update(1)

        def time_all() -> object:
            worker_settings = dataclasses.replace(settings, cache_root=str(cache.root))
            if len(devices) > 1:
                try:
                    return time_on_gpus(devices, worker_settings, feed, evaluate, finish, CandidateRunner)
                except GpuSelectionError as e:
                    raise TuneError(str(e)) from None
            with CandidateRunner(worker_settings) as runner:
                while (p := feed.get()) is not None:
                    finish(p, evaluate(runner, p))
                return runner.restarts

        pool = ThreadPoolExecutor(1, thread_name_prefix="cutlass-byoc-timing") if timed else None
        timing: Optional[Future] = None

        def start_timing() -> None:
            nonlocal bar, timing
            if progress:
                from tqdm import tqdm  # noqa: PLC0415

                bar = tqdm(total=len(todo), desc="timing", unit="problem", position=1 if overlap else 0)
            timing = pool.submit(time_all)

        t0 = time.perf_counter()
        try:
            if overlap:  # time each problem as soon as its kernels are built, beside the rest of the build
                start_timing()
            # In the plan's problem order: the build hands ninja the longest-compiling families first and keeps this
            # order within a family (build.COMPILE_WEIGHT), so problems become ready for timing one by one.
            build(kernels, jobs=jobs, cache=cache, progress=progress, on_result=on_result,
                  nice=BUILD_NICE if overlap else 0)
            compile_s = time.perf_counter() - t0
            compiled_now = sum(1 for r in builds.values() if r.built_now and r.ok)
            failed = sum(1 for r in builds.values() if not r.ok)
            emit({"event": "build", "compiled_now": compiled_now, "compile_failed": failed, "compile_s": compile_s})
            feed.close()
            if timed:
                if not overlap:
                    start_timing()
                t_build = time.perf_counter()
                got = timing.result()
                timing_after_build_s = time.perf_counter() - t_build
                timing_s = time.perf_counter() - (t0 if overlap else t_build)
                if isinstance(got, list):
                    per_gpu = got
                    restarts = sum(g.restarts for g in per_gpu)
                    emit({"event": "gpus", "per_gpu": [g.to_dict() for g in per_gpu]})
                else:
                    restarts = int(got)
        except BaseException:
            feed.abort()  # an interrupted build or a failed timing thread: stop timing after the current problem
            if timing is not None:
                wait([timing])
            raise
        finally:
            if pool is not None:
                pool.shutdown()
            if bar is not None:
                bar.close()

        if not timed:
            for p in todo:
                pp = plan_of[p]
                n_ok = sum(1 for c in pp.candidates if builds[c.launch.kernel].ok)
                status = COMPILED if pp.candidates else NO_CANDIDATES
                outcomes[p] = ProblemOutcome(
                    p, status, planned=len(pp.candidates),
                    message=f"{n_ok} of {len(pp.candidates)} launches compiled; not timed",
                )

    return TuneReport(
        tuple(outcomes[p] for p in problems), gpu, timed, len(kernels), compiled_now, failed, launches_timed,
        compile_s, timing_s, time.perf_counter() - t_start, restarts, log_path,
        "" if timed else NO_GPU_MESSAGE, tuple(devices), tuple(per_gpu), overlap, timing_after_build_s,
        launches_retimed, launches_host_bound,
    )


def tune_problem(problem: Conv2dProblem, **kwargs) -> Optional[LaunchConfig]:
    """Tune one problem (see `tune_workload`); its winning launch, or None (no GPU, or no candidate passed)."""
    report = tune_workload([problem], **kwargs)
    o = report.outcomes[0]
    return o.launch if o.status in (CACHED, TUNED) else None
