"""The tuner's orchestration on the CPU, with the compiler and the GPU worker replaced by fakes: one build call for
all problems, compile failures and failing candidates never win, decisions recorded for what ships, and a second
run does nothing."""

from __future__ import annotations

import json

import pytest

from cutlass_byoc.decisions import DecisionStore, GpuInfo, lookup
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.profiler import tune as T
from cutlass_byoc.profiler import worker as W

import fake_profiler  # noqa: E402

GPU = GpuInfo("NVIDIA H200", 90)
PROBLEMS = [
    Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1),
    Conv2dProblem.make("wgrad", 32, 64, 56, 56, 64, 3, padding=1),
    Conv2dProblem.make("dgrad", 32, 3, 224, 224, 64, 7, stride=2, padding=3),  # runs channel-padded
]


class FakeRunner(fake_profiler.FakeRunner):
    """Candidate i of each problem: 0 crashes, 1 is wrong, 2 has time 0 (must not win), others take 100 - i us; cuDNN
    (the baseline) takes 50 us."""

    calls: list = []
    BASELINE_US = 50.0

    def results(self, problem, launches):
        FakeRunner.calls.append((problem, list(launches)))
        out = []
        for i, l in enumerate(launches):
            if i == 0:
                out.append(W.CandidateResult(l, W.CRASHED, message="illegal address"))
            elif i == 1:
                out.append(W.CandidateResult(l, W.WRONG, max_error=0.9))
            elif i == 2:
                out.append(W.CandidateResult(l, W.OK, 0.0, 0.0, 20, 1, 0.0))
            else:
                out.append(W.CandidateResult(l, W.OK, 100.0 - i, 99.0 - i, 20, 2, 1e-4))
        return out


@pytest.fixture
def fakes(tmp_cache, monkeypatch):
    builds: list = []
    FakeRunner.calls = []
    monkeypatch.setattr(T, "build", fake_profiler.fake_build(builds, tmp_cache.root / "x", fail_last=True))
    monkeypatch.setattr(T, "CandidateRunner", FakeRunner)
    monkeypatch.setattr(T, "current_gpu", lambda: GPU)
    return builds, tmp_cache


def test_tune_orchestration(fakes):
    builds, cache = fakes
    store = DecisionStore(cache.root)
    rep = T.tune_workload(PROBLEMS, max_candidates=8, cache=cache, store=store)
    assert len(builds) == 1  # every kernel of every problem in one parallel build
    assert rep.timed and rep.kernels_failed == 1
    for o in rep.outcomes:
        assert o.status == T.TUNED, o.message
        statuses = {r.launch: r.status for r in o.results}
        assert statuses[o.launch] == W.OK
        assert o.time_us > 0  # the time-0 candidate never wins
        assert o.time_us == min(r.median_us for r in o.results if r.ok and r.median_us > 0)
        assert o.cudnn_us == 50.0 and lookup(o.problem, gpu=GPU, store=store).cudnn_us == 50.0  # timed alongside
    # the narrow strided dgrad is timed and decided on the user's problem, its launch carrying the padding
    dgrad = rep.outcomes[2]
    assert any(p == PROBLEMS[2] for p, _ in FakeRunner.calls)
    assert dgrad.launch.padded and dgrad.launch.pad_c in (4, 8)
    assert lookup(PROBLEMS[2], gpu=GPU, store=store).launch == dgrad.launch
    assert lookup(PROBLEMS[2].replace(c=8), gpu=GPU, store=store) is None
    recs = [json.loads(l) for l in rep.log_path.read_text().splitlines()]
    events = {r["event"] for r in recs}
    assert {"plan", "compile_failed", "candidate", "decision"} <= events
    assert any(r["event"] == "candidate" and r["status"] == W.CRASHED for r in recs)

    # a second run: nothing planned, compiled or timed
    n_calls = len(FakeRunner.calls)
    again = T.tune_workload(PROBLEMS, max_candidates=8, cache=cache, store=store)
    assert [o.status for o in again.outcomes] == [T.CACHED] * 3
    assert len(builds) == 1 and len(FakeRunner.calls) == n_calls
    assert [o.launch for o in again.outcomes] == [o.launch for o in rep.outcomes]
    assert [o.cudnn_us for o in again.outcomes] == [50.0] * 3
    # --force re-times
    T.tune_workload(PROBLEMS[:1], max_candidates=4, cache=cache, store=store, force=True)
    assert len(builds) == 2


def test_no_winner_records_nothing(fakes, monkeypatch):
    _, cache = fakes
    store = DecisionStore(cache.root)

    class AllFail(FakeRunner):
        BASELINE_US = 40.0

        def results(self, problem, launches):
            return [W.CandidateResult(l, W.WRONG, max_error=1.0) for l in launches]

    monkeypatch.setattr(T, "CandidateRunner", AllFail)
    rep = T.tune_workload(PROBLEMS[:1], max_candidates=2, cache=cache, store=store)
    assert rep.outcomes[0].status == T.NO_WINNER and "wrong" in rep.outcomes[0].message
    assert lookup(PROBLEMS[0], gpu=GPU, store=store) is None
    assert T.tune_problem(PROBLEMS[0], cache=cache, store=store, max_candidates=2) is None


def test_the_timings_spin_check_is_counted_and_logged(fakes, monkeypatch):
    """What the timing's spin check did to each launch (re-timed behind a longer spin; still host-bound) reaches the
    report's counts and the tune log's candidate records."""
    _, cache = fakes
    store = DecisionStore(cache.root)

    class Retimed(FakeRunner):
        def results(self, problem, launches):
            return [W.CandidateResult(l, W.OK, 20.0 + i, 19.0 + i, 20, 2, 1e-4, spin_retries=min(i, 2),
                                      host_bound=i == 2) for i, l in enumerate(launches)]

    monkeypatch.setattr(T, "CandidateRunner", Retimed)
    rep = T.tune_workload(PROBLEMS[:1], max_candidates=3, cache=cache, store=store)
    assert rep.outcomes[0].status == T.TUNED and rep.launches_timed == 3
    assert (rep.launches_retimed, rep.launches_host_bound) == (2, 1)
    assert rep.to_dict()["launches_retimed"] == 2
    recs = [r for r in map(json.loads, rep.log_path.read_text().splitlines())
            if r["event"] == "candidate" and r["status"] == W.OK]  # not the launch whose kernel failed to build
    assert sorted((r["spin_retries"], r["host_bound"]) for r in recs) == [(0, False), (1, False), (2, True)]


def test_no_gpu_compiles_but_does_not_time(fakes, monkeypatch):
    builds, cache = fakes
    monkeypatch.setattr(T, "current_gpu", lambda: None)
    rep = T.tune_workload(PROBLEMS, max_candidates=2, cache=cache)
    assert not rep.timed and "timing needs a GPU" in rep.message
    assert len(builds) == 1 and not FakeRunner.calls
    assert {o.status for o in rep.outcomes} == {T.COMPILED}


def _pipelined(tmp_cache, monkeypatch, on_each, runner=FakeRunner):
    builds: list = []
    FakeRunner.calls = []
    fake = fake_profiler.fake_build(builds, tmp_cache.root / "x", on_each=on_each)
    monkeypatch.setattr(T, "build", fake)
    monkeypatch.setattr(T, "CandidateRunner", runner)
    monkeypatch.setattr(T, "current_gpu", lambda: GPU)
    return fake


def _wait_for(cond, seconds=10.0):
    import time

    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_problems_are_timed_while_the_build_goes_on(tmp_cache, monkeypatch):
    """A problem is timed as soon as each of its kernels has a build result, beside the rest of the build (whose
    compilers then run niced), and never before: every launch handed to the runner is of a kernel already built."""
    built: set = set()
    timed_during_build: list = []
    plan = T.plan_workload(PROBLEMS, 8)
    order = plan.kernels  # what the tuner hands the build (which orders the compiles by family itself)

    def on_each(kc):
        if kc == order[-1]:  # the build's last kernel: some problem must have been timed by now
            timed_during_build.append(_wait_for(lambda: len(FakeRunner.calls) > 0))
        built.add(kc)

    class Checked(FakeRunner):
        def results(self, problem, launches):
            assert all(l.kernel in built for l in launches), "a problem was timed before its kernels were built"
            return super().results(problem, launches)

    fake = _pipelined(tmp_cache, monkeypatch, on_each, Checked)
    rep = T.tune_workload(PROBLEMS, max_candidates=8, cache=tmp_cache, store=DecisionStore(tmp_cache.root))
    assert timed_during_build == [True]
    assert rep.overlapped and fake.nice == [T.BUILD_NICE]
    assert [o.status for o in rep.outcomes] == [T.TUNED] * 3
    assert {p for p, _ in FakeRunner.calls} == set(PROBLEMS)  # each problem timed once
    assert len(FakeRunner.calls) == 3
    assert rep.timing_s >= rep.timing_after_build_s >= 0.0
    events = [json.loads(l)["event"] for l in rep.log_path.read_text().splitlines()]
    assert events[0] == "plan" and events.count("build") == 1 and events.count("decision") == 3


def test_timing_after_the_build_when_asked(tmp_cache, monkeypatch):
    """overlap_timing=False: nothing is timed until the whole build has ended, and the compilers are not niced."""
    def on_each(kc):
        assert not FakeRunner.calls

    fake = _pipelined(tmp_cache, monkeypatch, on_each)
    rep = T.tune_workload(PROBLEMS, max_candidates=4, cache=tmp_cache, store=DecisionStore(tmp_cache.root),
                          overlap_timing=False)
    assert not rep.overlapped and fake.nice == [0]
    assert [o.status for o in rep.outcomes] == [T.TUNED] * 3


def test_a_failed_timing_worker_lets_the_build_finish_then_raises(tmp_cache, monkeypatch):
    """The worker cannot start (no usable GPU): the build still compiles every kernel (they stay cached), then the
    worker's error reaches the caller."""
    seen: list = []

    class NoWorker(FakeRunner):
        def __enter__(self):
            raise W.WorkerError("the tuning worker died while starting")

    fake = _pipelined(tmp_cache, monkeypatch, seen.append, NoWorker)
    with pytest.raises(W.WorkerError, match="died while starting"):
        T.tune_workload(PROBLEMS, max_candidates=4, cache=tmp_cache, store=DecisionStore(tmp_cache.root))
    assert len(fake.nice) == 1 and seen and len(seen) == len(set(seen))


def test_an_interrupted_build_stops_the_timing(tmp_cache, monkeypatch):
    """Ctrl-C during the build: the timing thread stops after its current problem and the interrupt propagates."""
    import threading

    count = [0]

    def on_each(kc):
        count[0] += 1
        if count[0] == 4:
            raise KeyboardInterrupt

    _pipelined(tmp_cache, monkeypatch, on_each)
    with pytest.raises(KeyboardInterrupt):
        T.tune_workload(PROBLEMS, max_candidates=8, cache=tmp_cache, store=DecisionStore(tmp_cache.root))
    assert not any(t.name.startswith("cutlass-byoc-timing") and t.is_alive() for t in threading.enumerate())
