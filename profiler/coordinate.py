"""Tune each problem once when several processes want the same decisions at the same time: the ranks of a DDP job
under torchrun compiling the same graphs with ``select="tune"``, or two jobs sharing one cache.

Design: the decision cache itself is the rendezvous, guarded by one file lock per problem, the way the kernel cache
compiles each kernel once (build.py). There is no leader chosen by rank and no collective call:

* partitioning runs inside torch.compile on each rank independently, so a collective (barrier, broadcast) there
  would hang a rank whose graphs differ or come in another order, and NCCL collectives must not be mixed into
  compilation; a file lock needs nothing from the other ranks;
* it works on one host (each host has its own cache: that host's first rank to reach a problem tunes it, so a
  multi-node job tunes once per host, on that host's GPU model), and across hosts sharing one cache directory;
* it is not tied to the job: two jobs on one host sharing a cache also tune each problem once.

For each problem still without a decision, a process tries that problem's lock without waiting
(``<cache>/locks/tune-<digest>.lock``). The problems it gets are tuned in one batch (one parallel compile, then
timing), then for each a marker ``<cache>/coord/<digest>.json`` says how it ended (decided, no winner, tuning
failed) and the lock is released. The problems whose locks are held elsewhere are waited for, each with the
remaining time of one deadline (``wait_s``, default 3600 s or ``$CUTLASS_BYOC_TUNE_WAIT_S``); once a lock is free:

* the decision is there: use it (every process then launches the same kernel for the problem);
* no decision but a marker written after we began waiting: the holder finished without a winner, or its tuning
  raised: use the model's launch, as the holder does, instead of tuning the same problem again;
* no decision and no fresh marker: the holder died mid-tuning (its lock went with it); the problem is claimed again,
  so one of the survivors tunes it.

A wait that outlasts the deadline (a hung holder) gives up with a warning naming the holder (rank, pid, host, from
``<cache>/coord/<digest>.owner.json``) and the lock file; the problem then runs the model's launch in this process.
Problems that ended without a decision here are remembered for the rest of the process (:func:`settled`), so the
ops' first calls with ``select="tune"`` neither tune them again nor wait a second time. A marker of the same job
(``$TORCHELASTIC_RUN_ID``, set by torchrun) that says "no winner" or "failed" is honoured even by a rank that
arrives after the lock was released, so a slow rank does not re-tune what a fast one gave up on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import filelock

from ..decisions import DecisionStore, GpuInfo, current_gpu, default_store, lookup
from ..problem import Conv2dProblem

log = logging.getLogger("cutlass_byoc.profiler.coordinate")

WAIT_ENV = "CUTLASS_BYOC_TUNE_WAIT_S"
DEFAULT_WAIT_S = 3600.0
MAX_ROUNDS = 4  # claims of one call (a round follows a holder that died)

# Marker outcomes
DECIDED = "decided"
NO_WINNER = "no_winner"
FAILED = "failed"


def wait_seconds() -> float:
    v = os.environ.get(WAIT_ENV)
    if v:
        try:
            return max(0.0, float(v))
        except ValueError:
            log.warning("ignoring %s=%r: not a number of seconds", WAIT_ENV, v)
    return DEFAULT_WAIT_S


def job_id() -> Optional[str]:
    """The torchrun job this process belongs to (its rendezvous run id), or None outside one."""
    v = os.environ.get("TORCHELASTIC_RUN_ID")
    return v if v and v != "none" else None


def rank_info() -> dict:
    """This process's place in a distributed job (torchrun's environment, or torch.distributed if initialised)."""
    def num(name: str) -> Optional[int]:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            return None

    rank, world = num("RANK"), num("WORLD_SIZE")
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    return {"rank": rank, "local_rank": num("LOCAL_RANK"), "world_size": world, "host": socket.gethostname(),
            "pid": os.getpid(), "job": job_id()}


def worker_settings():
    """WorkerSettings timing on this process's current CUDA device (a DDP rank's own GPU; the default is GPU 0)."""
    from .worker import WorkerSettings  # noqa: PLC0415

    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            from .multigpu import visible_device  # noqa: PLC0415

            d = torch.cuda.current_device()
            return WorkerSettings(device=d, visible_device=visible_device(d))
    except Exception:  # noqa: BLE001
        pass
    return WorkerSettings()


def _who(d: Optional[dict]) -> str:
    if not d:
        return "another process"
    r = f"rank {d['rank']} " if d.get("rank") is not None else ""
    return f"{r}(pid {d.get('pid')} on {d.get('host')})"


@dataclasses.dataclass
class Coordination:
    """How one call's problems got (or did not get) their decisions."""

    tuned: list = dataclasses.field(default_factory=list)  # tuned by this process now
    waited: list = dataclasses.field(default_factory=list)  # tuned by another process while this one waited
    decided_before: list = dataclasses.field(default_factory=list)  # had a decision already
    fell_back: dict = dataclasses.field(default_factory=dict)  # problem -> why it has no decision (model's launch)
    wait_s: float = 0.0
    result: Any = None  # what the tune function returned (its last call here)
    error: Optional[str] = None  # the tune function raised (logged; its problems fell back)

    def summary(self) -> str:
        return (f"{len(self.tuned)} tuned here, {len(self.waited)} tuned by another process "
                f"(waited {self.wait_s:.1f} s), {len(self.decided_before)} decided before, "
                f"{len(self.fell_back)} left to the model's launch")


#: what coordination did in this process, cumulative (scripts/ddp_check.py reports it per rank)
STATS = {"tuned": 0, "waited": 0, "decided_before": 0, "fell_back": 0, "wait_s": 0.0, "timeouts": 0}

_settled: dict[tuple[str, str, Conv2dProblem], str] = {}
#: how this process got a problem's decision: "tuned" here or "tuned by another process" it waited for (same key)
_decided_here: dict[tuple[str, str, Conv2dProblem], str] = {}


def settled(problem: Conv2dProblem, gpu: Optional[GpuInfo] = None, store: Optional[DecisionStore] = None) -> Optional[str]:
    """Why `problem` (as the user gives it) ended without a decision in this process (then it is not tuned again
    here), or None."""
    gpu = gpu or current_gpu()
    if gpu is None:
        return None
    root = str((store or default_store()).root)
    return _settled.get((root, gpu.tag, problem))


def decided_here(problem: Conv2dProblem, gpu: Optional[GpuInfo] = None,
                 store: Optional[DecisionStore] = None) -> Optional[str]:
    """How this process got `problem`'s decision: "tuned" (here) or "tuned by another process" (waited for); None
    for a decision older than the process, or none at all (see `settled`)."""
    gpu = gpu or current_gpu()
    if gpu is None:
        return None
    root = str((store or default_store()).root)
    return _decided_here.get((root, gpu.tag, problem))


def reset() -> None:
    """Forget what ended, with or without a decision, in this process (tests; `cache clear`)."""
    _settled.clear()
    _decided_here.clear()
    for k in STATS:
        STATS[k] = 0.0 if k == "wait_s" else 0


def _digest(kp: Conv2dProblem, gpu: GpuInfo) -> str:
    blob = json.dumps({"problem": kp.to_dict(), "gpu": gpu.tag}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class _Paths:
    def __init__(self, root: Path, digest: str) -> None:
        self.lock = root / "locks" / f"tune-{digest}.lock"
        self.marker = root / "coord" / f"{digest}.json"
        self.owner = root / "coord" / f"{digest}.owner.json"


def _write_json(path: Path, d: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(d, f, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def coordinated_tune(
    problems: Sequence[Conv2dProblem],
    tune: Callable[[list[Conv2dProblem]], Any],
    *,
    gpu: Optional[GpuInfo] = None,
    store: Optional[DecisionStore] = None,
    wait_s: Optional[float] = None,
    poll_s: float = 0.1,
) -> Coordination:
    """Get a decision for every problem, calling `tune(problems)` (e.g. ``tune_workload``) only on the problems no
    other process is tuning; wait for the others (see the module docstring). Never raises for another process's
    failure or a timeout: those problems are listed in ``fell_back`` with the reason and use the model's launch."""
    co = Coordination()
    problems = list(dict.fromkeys(problems))
    gpu = gpu or current_gpu()
    if gpu is None:  # no GPU: tuning only compiles, which the kernel cache's locks already do once
        co.result = tune(problems)
        co.tuned = problems
        return co
    store = store or default_store()
    root = store.root
    wait_s = wait_seconds() if wait_s is None else wait_s
    me = rank_info()
    deadline = time.monotonic() + wait_s

    groups: dict[Conv2dProblem, list[Conv2dProblem]] = {}
    for p in problems:
        groups.setdefault(p, []).append(p)  # decisions are keyed by the user's problem

    def key(kp):
        return (str(root), gpu.tag, kp)

    def decided(kp) -> bool:
        return lookup(kp, gpu=gpu, store=store) is not None

    def give_up(kp, reason: str) -> None:
        _settled[key(kp)] = reason
        for p in groups[kp]:
            co.fell_back[p] = reason

    pending = []
    for kp in groups:
        if decided(kp):
            co.decided_before += groups[kp]
        elif key(kp) in _settled:
            for p in groups[kp]:
                co.fell_back[p] = _settled[key(kp)]
        else:
            pending.append(kp)

    for _round in range(MAX_ROUNDS):
        if not pending:
            break
        # claim: the locks nobody holds are ours. Claims are made one process at a time (a short lock around the
        # non-blocking tries), so the first process to arrive claims the whole batch and tunes it in one compile
        # step and one timing pass, instead of two processes splitting it and compiling side by side.
        mine: list[tuple[Conv2dProblem, filelock.BaseFileLock, _Paths]] = []
        theirs: list[tuple[Conv2dProblem, _Paths, float]] = []
        (root / "locks").mkdir(parents=True, exist_ok=True)
        claim = filelock.FileLock(str(root / "locks" / "tune-claim.lock"))
        try:
            claim.acquire(timeout=60)  # held for file operations only; without it claims are still per problem
        except filelock.Timeout:
            log.warning("cutlass_byoc: the claim lock %s is held for over 60 s; claiming without it", claim.lock_file)
        try:
            for kp in pending:
                paths = _Paths(root, _digest(kp, gpu))
                paths.lock.parent.mkdir(parents=True, exist_ok=True)
                lk = filelock.FileLock(str(paths.lock))
                try:
                    lk.acquire(timeout=0)
                except filelock.Timeout:
                    theirs.append((kp, paths, time.time()))
                    continue
                if decided(kp):  # someone finished it between our first look and the lock
                    lk.release()
                    co.waited += groups[kp]
                    continue
                m = _read_json(paths.marker)
                if m and me["job"] and m.get("job") == me["job"] and m.get("outcome") in (NO_WINNER, FAILED):
                    lk.release()
                    give_up(kp, f"{_who(m)} of this job tuned it already: {m.get('message') or m.get('outcome')}")
                    continue
                _write_json(paths.owner, {**me, "started": time.time()})
                mine.append((kp, lk, paths))
        finally:
            if claim.is_locked:
                claim.release()

        if mine:
            batch = [p for kp, _, _ in mine for p in groups[kp]]
            err: Optional[str] = None
            try:
                co.result = tune(batch)
            except Exception as e:  # noqa: BLE001 - tuning is an optimisation; the ops use the model's launch
                err = f"{type(e).__name__}: {e}"
                co.error = err
                log.warning("cutlass_byoc: tuning %d problems failed: %s", len(batch), err)
            finally:
                for kp, lk, paths in mine:
                    ok = decided(kp)
                    outcome = DECIDED if ok else FAILED if err else NO_WINNER
                    msg = "" if ok else err or "no candidate passed"
                    try:
                        _write_json(paths.marker, {**me, "outcome": outcome, "message": msg, "time": time.time(),
                                                   "problem": kp.name, "gpu": gpu.tag})
                    finally:
                        lk.release()
                    if ok:
                        co.tuned += groups[kp]
                    else:
                        give_up(kp, f"tuned here: {msg}")

        # wait for the problems others hold
        retry: list[Conv2dProblem] = []
        for kp, paths, seen_at in theirs:
            owner = _read_json(paths.owner)
            lk = filelock.FileLock(str(paths.lock))
            t0 = time.monotonic()
            try:
                lk.acquire(timeout=max(0.0, deadline - time.monotonic()), poll_interval=poll_s)
            except filelock.Timeout:
                co.wait_s += time.monotonic() - t0
                reason = (f"waited {wait_s:.0f} s for {_who(owner)} to tune it (lock {paths.lock}) and gave up; "
                          f"the model's launch is used (set {WAIT_ENV} to wait longer)")
                log.warning("cutlass_byoc: %s: %s", kp.name, reason)
                STATS["timeouts"] += 1
                give_up(kp, reason)
                continue
            co.wait_s += time.monotonic() - t0
            try:
                if decided(kp):
                    co.waited += groups[kp]
                    continue
                m = _read_json(paths.marker)
                slack = 0.0 if m and m.get("host") == me["host"] else 1.0  # clocks of other hosts may differ a bit
                if m and float(m.get("time", 0)) >= seen_at - slack:  # written by the holder we waited for
                    give_up(kp, f"{_who(m)} tuned it: {m.get('message') or m.get('outcome')}")
                else:  # the holder left without a word: it died while tuning; claim it again
                    log.warning("cutlass_byoc: %s: %s stopped tuning it without a result; claiming it again",
                                kp.name, _who(owner))
                    retry.append(kp)
            finally:
                lk.release()
        pending = retry
    for kp in pending:  # still claimed away after MAX_ROUNDS rounds
        give_up(kp, f"could not get a decision after {MAX_ROUNDS} rounds of claims")

    _decided_here.update({key(p): "tuned" for p in co.tuned})
    _decided_here.update({key(p): "tuned by another process" for p in co.waited})
    STATS["tuned"] += len(co.tuned)
    STATS["waited"] += len(co.waited)
    STATS["decided_before"] += len(co.decided_before)
    STATS["fell_back"] += len(co.fell_back)
    STATS["wait_s"] += co.wait_s
    if co.waited or co.fell_back:
        log.info("cutlass_byoc: tuning of %d problems: %s", len(problems), co.summary())
    return co
