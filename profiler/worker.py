"""Run candidates in a worker process, so a kernel that crashes, hangs or corrupts the CUDA context cannot take
tuning down.

One worker (``multiprocessing`` spawn context) serves a whole tuning run. For each problem it allocates the
rotated operand sets, computes the reference once, then for each candidate: poisons the output, runs the launch
through `ops.run_problem` (the path that ships), checks the result, and times it. Results come back one
candidate at a time. If the worker dies or a candidate exceeds its timeout, that candidate is recorded as
crashed / timed out, the worker is restarted and the problem continues with the next candidate. After a CUDA
error the worker exits on purpose: its context is unusable.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import time
import traceback
from typing import Callable, Optional, Sequence

from ..config import LaunchConfig
from ..problem import Conv2dProblem
from .timing import TimingSettings

log = logging.getLogger("cutlass_byoc.profiler.worker")

# Candidate statuses. Only OK can win.
OK = "ok"
WRONG = "wrong"  # ran, output differs from the reference
CANNOT_IMPLEMENT = "cannot_implement"  # the kernel refused the problem at launch
ERROR = "error"  # launch raised (not a CUDA error)
CRASHED = "crashed"  # CUDA error or the worker died
TIMEOUT = "timeout"
BAD_TIMING = "bad_timing"  # a zero, negative or non-finite time: never trusted
SETUP_FAILED = "setup_failed"  # operands or reference could not be made (e.g. out of memory)
COMPILE_FAILED = "compile_failed"  # set by the tuner, not the worker


@dataclasses.dataclass(frozen=True)
class CandidateResult:
    launch: LaunchConfig
    status: str
    median_us: Optional[float] = None
    min_us: Optional[float] = None
    iters: int = 0
    rotations: int = 0
    max_error: Optional[float] = None
    message: str = ""
    #: the timing's own check (timing.TimingStats): passes re-timed behind a longer spin, and whether the last one
    #: still ran out (its runs may include host time)
    spin_retries: int = 0
    host_bound: bool = False

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["launch"] = self.launch.name
        return d


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    timing: TimingSettings = TimingSettings()
    candidate_timeout_s: float = 60.0
    setup_timeout_s: float = 180.0
    start_timeout_s: float = 180.0
    seed: int = 1234
    device: int = 0
    cache_root: Optional[str] = None  # the kernel cache the worker loads from (default: the environment's)
    #: CUDA_VISIBLE_DEVICES for the worker (the parent's entry for `device`): the worker then sees one GPU, as
    #: device 0, exactly as in a one-GPU run (multigpu.visible_device; `device` is used if CUDA started before)
    visible_device: Optional[str] = None


# ---------------------------------------------------------------------------------------------- worker side
def _is_cuda_error(e: BaseException) -> bool:
    text = str(e)
    return "CUDA error" in text or "cudaError" in text or "illegal" in text.lower() or "CUDA_ERROR" in text


def evaluate_candidate(problem: Conv2dProblem, launch: LaunchConfig, sets, ref, settings: TimingSettings) -> CandidateResult:
    """Check `launch` on operand set 0 against `ref`, then time it over all sets. Runs in the worker (and in
    tests). A CUDA error propagates (the caller must not continue in this context)."""
    import torch  # noqa: PLC0415

    from ..ops import UnsupportedConvError, run_problem  # noqa: PLC0415
    from ..runtime import KernelLaunchError, load_kernel  # noqa: PLC0415
    from .timing import time_gpu  # noqa: PLC0415
    from .verify import compare, poison  # noqa: PLC0415

    s0 = sets[0]
    kp = launch.kernel_problem(problem)  # what the kernel computes (a channel-padded launch pads C and K)
    why = launch.reject_reason(problem) or load_kernel(launch.kernel, build_missing=False).can_implement(
        kp, launch.split_k_slices)
    if why:
        return CandidateResult(launch, CANNOT_IMPLEMENT, message=why[:500])
    try:
        poison(s0.out)
        run_problem(problem, s0.a, s0.b, s0.out, s0.source, config=launch, bias=s0.bias)
        torch.cuda.synchronize()
    except (UnsupportedConvError, KernelLaunchError) as e:
        if _is_cuda_error(e):
            raise
        return CandidateResult(launch, ERROR, message=str(e)[:500])
    check = compare(problem, s0.out, ref)
    if not check.ok:
        return CandidateResult(launch, WRONG, max_error=check.max_error, message=check.message)

    def fn(i: int) -> None:
        s = sets[i]
        run_problem(problem, s.a, s.b, s.out, s.source, config=launch, bias=s.bias)

    stats = time_gpu(fn, len(sets), settings)
    # Check once more after timing: a kernel racing on its workspace or output shows up here.
    poison(s0.out)
    run_problem(problem, s0.a, s0.b, s0.out, s0.source, config=launch, bias=s0.bias)
    torch.cuda.synchronize()
    check2 = compare(problem, s0.out, ref)
    if not check2.ok:
        return CandidateResult(launch, WRONG, max_error=check2.max_error, message="after timing: " + check2.message)
    if not stats.valid:
        return CandidateResult(launch, BAD_TIMING, stats.median_us, message=f"invalid time {stats.median_us!r}")
    return CandidateResult(launch, OK, stats.median_us, stats.min_us, stats.iters, stats.rotations,
                           max(check.max_error, check2.max_error), spin_retries=stats.spin_retries,
                           host_bound=stats.host_bound)


def _time_baseline(problem: Conv2dProblem, sets, settings: WorkerSettings) -> Optional[float]:
    """cuDNN's median time for `problem` (verify.cudnn_fn, with cudnn.benchmark: its best algorithm), or None if it
    failed or timed invalid (the candidates are still timed)."""
    import torch  # noqa: PLC0415

    from .timing import time_gpu  # noqa: PLC0415
    from .verify import cudnn_fn  # noqa: PLC0415

    prev = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        stats = time_gpu(cudnn_fn(problem, sets), len(sets), settings.timing)
        return stats.median_us if stats.valid else None
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is no reason to lose the candidates
        log.debug("cuDNN baseline of %s: %s", problem.name, e)
        return None
    finally:
        torch.backends.cudnn.benchmark = prev


def make_problem_sets(problem: Conv2dProblem, settings: WorkerSettings):
    import torch  # noqa: PLC0415

    from .timing import l2_bytes, rotation_count  # noqa: PLC0415
    from .verify import make_operand_set, operand_bytes, reference  # noqa: PLC0415

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device)
    gen.manual_seed(settings.seed)
    n = rotation_count(operand_bytes(problem), l2_bytes(), settings.timing.l2_multiple)
    sets = [make_operand_set(problem, device, gen) for _ in range(n)]
    ref = reference(problem, sets[0])
    torch.cuda.synchronize()
    return sets, ref


def apply_environment(settings: WorkerSettings) -> None:
    """The worker's environment, set first thing in the worker process (before CUDA starts)."""
    if settings.cache_root:
        os.environ["CUTLASS_BYOC_CACHE_DIR"] = settings.cache_root
    if settings.visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = settings.visible_device


def _worker_main(tasks, results, settings: WorkerSettings) -> None:
    logging.basicConfig(level=logging.WARNING)
    apply_environment(settings)
    try:
        import torch  # noqa: PLC0415

        device = settings.device
        if settings.visible_device is not None and torch.cuda.device_count() == 1:
            device = 0  # the one GPU this process sees
            settings = dataclasses.replace(settings, device=0)
        torch.cuda.set_device(device)
        torch.backends.cudnn.allow_tf32 = False
        props = torch.cuda.get_device_properties(device)
        results.put(("hello", props.name, props.major * 10 + props.minor, os.getpid()))
    except BaseException as e:  # noqa: BLE001
        results.put(("fatal", f"worker could not start CUDA: {e}"))
        return
    while True:
        msg = tasks.get()
        if msg is None:
            return
        job, problem_d, launch_ds, start, baseline = msg
        problem = Conv2dProblem.from_dict(problem_d)
        try:
            sets, ref = make_problem_sets(problem, settings)
        except BaseException as e:  # noqa: BLE001
            results.put((job, "setup_failed", f"{type(e).__name__}: {e}"))
            if _is_cuda_error(e):
                os._exit(3)
            try:
                torch.cuda.empty_cache()
            except BaseException:  # noqa: BLE001
                os._exit(3)
            continue
        results.put((job, "ready", len(sets)))
        if baseline:  # cuDNN's time for the problem, on the same operand sets and timing as the candidates
            results.put((job, "baseline", _time_baseline(problem, sets, settings)))
        for idx in range(start, len(launch_ds)):
            launch = LaunchConfig.from_dict(launch_ds[idx])
            try:
                res = evaluate_candidate(problem, launch, sets, ref, settings.timing)
            except BaseException as e:  # noqa: BLE001
                crashed = _is_cuda_error(e)
                res = CandidateResult(launch, CRASHED if crashed else ERROR,
                                      message=f"{type(e).__name__}: {str(e)[:400]}")
                if crashed:
                    results.put((job, idx, res))
                    os._exit(3)  # the context is poisoned: the parent restarts us
                log.debug("candidate %s: %s", launch.name, traceback.format_exc())
            results.put((job, idx, res))
        del sets, ref
        results.put((job, "done", None))


# ---------------------------------------------------------------------------------------------- parent side
class _Sender:
    """The worker's end of the result pipe, with a queue's `put` (sends synchronously)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def put(self, msg) -> None:
        self.conn.send(msg)


class WorkerError(RuntimeError):
    """The worker could not start (no GPU, no CUDA in torch); the message says why."""


class CandidateRunner:
    """Owns one worker process; restarts it when it dies. Use as a context manager."""

    def __init__(self, settings: WorkerSettings = WorkerSettings(), target: Optional[Callable] = None):
        """`target` replaces the worker's main function (tests inject a fake GPU worker; it must be importable
        by module and name, as spawn requires)."""
        self.settings = settings
        self._target = target or _worker_main
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._tasks = None
        self._results = None
        self._job = 0
        self.restarts = 0
        self.gpu: Optional[tuple[str, int]] = None

    def __enter__(self) -> "CandidateRunner":
        self._start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        # Results come back through a pipe: each send is written before the worker goes on, so a result sent just
        # before the worker dies is not lost in a queue's feeder thread.
        self._tasks = self._ctx.Queue()
        self._results, child_end = self._ctx.Pipe(duplex=False)
        self._proc = self._ctx.Process(target=self._target, args=(self._tasks, _Sender(child_end), self.settings),
                                       name="cutlass-byoc-tuner", daemon=True)
        self._proc.start()
        child_end.close()
        try:
            msg = self._get(self.settings.start_timeout_s)
        except EOFError as e:
            self._kill()
            raise WorkerError(f"the tuning worker died while starting ({e})") from None
        if msg is None:
            self._kill()
            raise WorkerError(f"the tuning worker did not start within {self.settings.start_timeout_s:.0f} s") from None
        if msg[0] != "hello":
            self._kill()
            raise WorkerError(msg[1])
        self.gpu = (msg[1], msg[2])
        log.debug("tuning worker %d on %s (sm_%d)", msg[3], msg[1], msg[2])

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=10)
        if self._tasks is not None:
            self._tasks.cancel_join_thread()
            self._tasks.close()
        if self._results is not None:
            self._results.close()
        self._proc = self._tasks = self._results = None

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._tasks.put(None)
                self._proc.join(timeout=10)
            except (OSError, ValueError):
                pass
        self._kill()

    def _get(self, timeout: float):
        """Next message, or None on timeout; raises EOFError if the worker died."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._results.poll(min(1.0, max(0.01, deadline - time.monotonic()))):
                    return self._results.recv()
            except (EOFError, OSError):
                self._proc.join(timeout=5)
                raise EOFError(f"worker exited with code {self._proc.exitcode}") from None
            if not self._proc.is_alive():
                if self._results.poll(0):  # what it sent just before dying
                    try:
                        return self._results.recv()
                    except (EOFError, OSError):
                        pass
                raise EOFError(f"worker exited with code {self._proc.exitcode}") from None
            if time.monotonic() >= deadline:
                return None

    def evaluate(self, problem: Conv2dProblem, launches: Sequence[LaunchConfig],
                 baseline: bool = False) -> list[CandidateResult]:
        """Check and time every launch on `problem`; one result per launch, in order. With `baseline`, the worker
        first times cuDNN on the same operand sets: `self.baseline_us` (None if it could not be timed)."""
        out: list[Optional[CandidateResult]] = [None] * len(launches)
        launch_ds = [l.to_dict() for l in launches]
        self.baseline_us: Optional[float] = None
        want_baseline = baseline
        nxt = 0
        while nxt < len(launches):
            if self._proc is None or not self._proc.is_alive():
                self._kill()
                self._start()
                self.restarts += 1
            self._job += 1
            job = self._job
            self._tasks.put((job, problem.to_dict(), launch_ds, nxt, want_baseline))
            timeout = self.settings.setup_timeout_s
            restart = False
            while nxt < len(launches):
                try:
                    msg = self._get(timeout)
                except EOFError as e:
                    out[nxt] = CandidateResult(launches[nxt], CRASHED, message=str(e))
                    nxt += 1
                    restart = True
                    break
                if msg is None:
                    out[nxt] = CandidateResult(launches[nxt], TIMEOUT, message=f"no result within {timeout:.0f} s")
                    nxt += 1
                    restart = True
                    break
                if msg[0] != job:
                    continue  # a stale message
                if msg[1] == "setup_failed":
                    for i in range(nxt, len(launches)):
                        out[i] = CandidateResult(launches[i], SETUP_FAILED, message=msg[2])
                    nxt = len(launches)
                    break
                if msg[1] == "ready":
                    timeout = self.settings.candidate_timeout_s
                    continue
                if msg[1] == "baseline":
                    self.baseline_us, want_baseline = msg[2], False  # (not timed again after a restart)
                    continue
                if msg[1] == "done":
                    break
                idx, res = msg[1], msg[2]
                out[idx] = res
                nxt = idx + 1
                if res.status == CRASHED:
                    restart = True
                    break
            if restart:
                self._kill()
        return [r for r in out if r is not None]
