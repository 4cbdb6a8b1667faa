"""Stand-ins for the profiler's timing worker in CPU tests: the worker process's side of the candidate runner's
protocol (hello, then per task: ready, cuDNN's baseline when asked, one result per candidate, done), and a runner
object for tune_workload that starts no process. One copy of the protocol for the tests that fake it."""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Callable, Optional

from cutlass_byoc.config import LaunchConfig
from cutlass_byoc.profiler import worker as W


def serve_fake_worker(tasks, results, gpu: str, baseline_us: float,
                      answer: Callable[[int, LaunchConfig], Optional[W.CandidateResult]]) -> None:
    """Run a fake worker process's loop: report `gpu` (sm_90), then answer each task, candidate idx with
    `answer(idx, launch)` (which may also sleep or exit the process); cuDNN's baseline is `baseline_us`."""
    results.put(("hello", gpu, 90, os.getpid()))
    while True:
        msg = tasks.get()
        if msg is None:
            return
        job, _problem, launch_ds, start, baseline = msg
        results.put((job, "ready", 1))
        if baseline:
            results.put((job, "baseline", baseline_us))
        for idx in range(start, len(launch_ds)):
            results.put((job, idx, answer(idx, LaunchConfig.from_dict(launch_ds[idx]))))
        results.put((job, "done", None))


class FakeRunner:
    """A CandidateRunner for tune_workload that starts no process: subclasses give `results(problem, launches)` and
    BASELINE_US, cuDNN's time when the tuner asks for it."""

    BASELINE_US = 50.0

    def __init__(self, settings):
        self.restarts = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def evaluate(self, problem, launches, baseline=False):
        self.baseline_us = self.BASELINE_US if baseline else None
        return self.results(problem, list(launches))

    def results(self, problem, launches) -> list:
        raise NotImplementedError


def fake_build(builds: list, entry: Path, fail_last: bool = False, on_each: Optional[Callable] = None):
    """A stand-in for build.build in tune_workload: records each call's configs (and its `nice`) in `builds` and
    compiles nothing; with `fail_last`, the last kernel of each call fails to compile. Results are handed to
    `on_result` one config at a time, in order, as the real build does as ninja finishes them; `on_each(config)`, if
    given, runs just before each (a test can wait there for the timing thread)."""

    def build(configs, *, jobs=None, cache=None, progress=False, on_result=None, nice=0):
        configs = list(configs)
        builds.append(configs)
        build.nice.append(nice)
        bad = configs[-1] if fail_last and configs else None
        out = {}
        for c in configs:
            if on_each is not None:
                on_each(c)
            out[c] = types.SimpleNamespace(ok=c is not bad, built_now=True, entry=types.SimpleNamespace(path=entry))
            if on_result is not None:
                on_result(c, out[c])
        return out

    build.nice = []
    return build
