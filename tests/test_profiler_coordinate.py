"""Tuning coordinated across processes sharing a cache (the ranks of a DDP job): only one process tunes a problem,
the others wait and read its decisions; a holder that fails, finds no winner, hangs or dies never leaves the others
hanging or tuning everything again. Real processes (spawn) and file locks, a fake tune function, no GPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from cutlass_byoc import decisions as dec_mod
from cutlass_byoc import select as select_mod
from cutlass_byoc.candidates import sm80_candidates
from cutlass_byoc.config import LaunchConfig
from cutlass_byoc.decisions import DecisionStore, GpuInfo, lookup, record_decision
from cutlass_byoc.heuristics import default_launch
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.profiler import coordinate as C

GPU = GpuInfo("NVIDIA H200", 90)
PROBLEMS = [
    Conv2dProblem.make("fprop", 16, 64, 56, 56, 64, 3, padding=1),
    Conv2dProblem.make("wgrad", 16, 64, 56, 56, 64, 3, padding=1),
    Conv2dProblem.make("dgrad", 16, 256, 14, 14, 256, 1),
]


def tuned_launch(kp: Conv2dProblem) -> LaunchConfig:
    """A valid launch that is not the model's default: a decision is then told apart from a fallback."""
    d = default_launch(kp)
    for k in sm80_candidates(kp):
        launch = LaunchConfig(k, 1)
        if launch.reject_reason(kp) is None and launch != d:
            return launch
    raise AssertionError("no second launch")


def fake_tune(root: str, behaviour: str, claimed=None, delay: float = 1.0):
    """A tune function: records a decision per problem after `delay` s (behaviour "ok"), records nothing ("none"),
    raises ("raise"), hangs ("hang") or kills its process while holding the locks ("die"). Each call appends a line
    to <root>/tune-calls.log."""
    def tune(problems):
        with open(os.path.join(root, "tune-calls.log"), "a") as f:
            f.write(f"{os.getpid()} {len(problems)}\n")
        if claimed is not None:
            claimed.set()
        time.sleep(delay)
        if behaviour == "raise":
            raise RuntimeError("the tuning worker could not start CUDA")
        if behaviour == "hang":
            time.sleep(3600)
        if behaviour == "die":
            os._exit(9)
        if behaviour == "ok":
            store = DecisionStore(root)
            for p in problems:
                kp = p
                record_decision(kp, tuned_launch(kp), 42.0, gpu=GPU, store=store)
        return len(problems)
    return tune


def tune_calls(root) -> list[tuple[int, int]]:
    p = os.path.join(root, "tune-calls.log")
    if not os.path.exists(p):
        return []
    return [tuple(map(int, ln.split())) for ln in open(p).read().splitlines()]


def rank_main(root, rank, behaviour, barrier, claimed, results, wait_s=60.0, delay=1.0, job=None):
    """One 'rank': the same problems, the same cache; reports what coordination did and the launches it would use."""
    os.environ["CUTLASS_BYOC_CACHE_DIR"] = root
    os.environ["RANK"] = str(rank)
    if job:
        os.environ["TORCHELASTIC_RUN_ID"] = job
    store = DecisionStore(root)
    if barrier is not None:
        barrier.wait(30)
    t0 = time.monotonic()
    co = C.coordinated_tune(PROBLEMS, fake_tune(root, behaviour, claimed, delay), gpu=GPU, store=store,
                            wait_s=wait_s, poll_s=0.02)
    launches = []
    for p in PROBLEMS:
        dec = lookup(p, gpu=GPU, store=store)
        launches.append(dec.launch.name if dec else None)
    results.put({"rank": rank, "tuned": [p.name for p in co.tuned], "waited": [p.name for p in co.waited],
                 "fell_back": {p.name: r for p, r in co.fell_back.items()}, "error": co.error,
                 "elapsed": time.monotonic() - t0, "launches": launches})


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return p


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


def test_one_rank_tunes_the_other_reads_its_decisions(tmp_path, ctx):
    root = str(tmp_path / "cache")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    procs = [_spawn(rank_main, root, r, "ok", barrier, None, q) for r in (0, 1)]
    out = sorted((q.get(timeout=120) for _ in procs), key=lambda d: d["rank"])
    for p in procs:
        p.join(30)
    names = sorted(p.name for p in PROBLEMS)
    assert sorted(len(d["tuned"]) for d in out) == [0, len(PROBLEMS)]  # exactly one rank tuned
    leader = next(d for d in out if d["tuned"])
    follower = next(d for d in out if not d["tuned"])
    assert sorted(leader["tuned"]) == names and sorted(follower["waited"]) == names
    assert follower["fell_back"] == {} and leader["fell_back"] == {}
    assert len(tune_calls(root)) == 1  # one call of the tune function in all: one compile step, one timing pass
    assert out[0]["launches"] == out[1]["launches"]  # both ranks launch the same kernels: the tuned ones
    assert out[0]["launches"] == [tuned_launch(p).name for p in PROBLEMS]
    # a third process later finds everything decided and waits for nothing
    q2 = ctx.Queue()
    rank_main(root, 2, "ok", None, None, q2)
    late = q2.get(timeout=5)
    assert late["tuned"] == [] and late["waited"] == [] and late["fell_back"] == {}
    assert len(tune_calls(root)) == 1


def _hold(root, behaviour, ctx, delay=1.0, job=None):
    """Start a rank that claims every problem and then behaves as told; returns once it holds the locks."""
    claimed, q = ctx.Event(), ctx.Queue()
    p = _spawn(rank_main, root, 0, behaviour, None, claimed, q, 60.0, delay, job)
    assert claimed.wait(60), "the holder did not start tuning"
    return p, q


def _follow(root, wait_s=60.0, job=None, store=None):
    os.environ["RANK"] = "1"
    try:
        if job:
            os.environ["TORCHELASTIC_RUN_ID"] = job
        return C.coordinated_tune(PROBLEMS, fake_tune(root, "ok", delay=0.0), gpu=GPU,
                                  store=store or DecisionStore(root), wait_s=wait_s, poll_s=0.02)
    finally:
        os.environ.pop("RANK", None)
        os.environ.pop("TORCHELASTIC_RUN_ID", None)


@pytest.fixture(autouse=True)
def _fresh():
    C.reset()
    yield
    C.reset()


def test_a_failing_holder_makes_the_others_fall_back_at_once(tmp_path, ctx):
    root = str(tmp_path / "cache")
    holder, q = _hold(root, "raise", ctx, delay=1.0)
    t0 = time.monotonic()
    co = _follow(root, wait_s=60)
    assert time.monotonic() - t0 < 30  # not the whole wait
    assert co.tuned == [] and co.waited == [] and set(co.fell_back) == set(PROBLEMS)
    assert all("could not start CUDA" in r and "rank 0" in r for r in co.fell_back.values())
    lead = q.get(timeout=30)
    assert lead["error"] and set(lead["fell_back"]) == {p.name for p in PROBLEMS}
    holder.join(10)
    assert len(tune_calls(root)) == 1


def test_no_winner_is_not_tuned_again_by_the_others(tmp_path, ctx):
    root = str(tmp_path / "cache")
    holder, q = _hold(root, "none", ctx)
    co = _follow(root)
    assert set(co.fell_back) == set(PROBLEMS) and all("no candidate passed" in r for r in co.fell_back.values())
    q.get(timeout=30)
    holder.join(10)
    assert len(tune_calls(root)) == 1


def test_a_hung_holder_times_out_with_a_clear_message_and_the_models_launch(tmp_path, ctx, monkeypatch):
    root = str(tmp_path / "cache")
    holder, _ = _hold(root, "hang", ctx)
    try:
        store = DecisionStore(root)
        t0 = time.monotonic()
        co = _follow(root, wait_s=2.0, store=store)
        waited = time.monotonic() - t0
        assert 1.5 < waited < 15
        assert co.tuned == [] and co.waited == [] and set(co.fell_back) == set(PROBLEMS)
        reason = co.fell_back[PROBLEMS[0]]
        assert "waited 2 s for rank 0 (pid" in reason and "gave up" in reason and "tune-" in reason
        assert C.WAIT_ENV in reason and C.STATS["timeouts"] == len(PROBLEMS)
        # settled for this process: asking again neither waits nor tunes
        t1 = time.monotonic()
        again = _follow(root, wait_s=2.0, store=store)
        assert time.monotonic() - t1 < 1.0 and set(again.fell_back) == set(PROBLEMS)
        # the ops' first call with select="tune" takes the model's launch at once
        monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", root)
        monkeypatch.setattr(dec_mod, "current_gpu", lambda: GPU)
        monkeypatch.setattr(C, "current_gpu", lambda: GPU)
        import cutlass_byoc.profiler.tune as T

        monkeypatch.setattr(T, "tune_problem", lambda *a, **k: pytest.fail("tuned a problem another rank holds"))
        t2 = time.monotonic()
        assert select_mod.choose(PROBLEMS[0], "tune") == default_launch(PROBLEMS[0])
        assert time.monotonic() - t2 < 1.0
        assert len(tune_calls(root)) == 1
    finally:
        holder.kill()
        holder.join(10)


def test_a_holder_that_dies_is_taken_over(tmp_path, ctx):
    root = str(tmp_path / "cache")
    holder, _ = _hold(root, "die", ctx, delay=1.0)
    co = _follow(root, wait_s=60)
    holder.join(10)
    assert holder.exitcode == 9
    assert set(co.tuned) == set(PROBLEMS) and co.fell_back == {}  # claimed again and tuned here
    assert [pid for pid, _ in tune_calls(root)] == [holder.pid, os.getpid()]
    store = DecisionStore(root)
    assert all(lookup(p, gpu=GPU, store=store) for p in PROBLEMS)


def test_a_late_rank_of_the_same_job_honours_the_no_winner_marker(tmp_path, ctx):
    root = str(tmp_path / "cache")
    q = ctx.Queue()
    rank_main(root, 0, "none", None, None, q, 60.0, 0.0, "job-1")  # done and unlocked before the others come
    q.get(timeout=5)
    C.reset()
    co = _follow(root, job="job-1")
    assert co.tuned == [] and set(co.fell_back) == set(PROBLEMS)
    assert all("of this job tuned it already" in r for r in co.fell_back.values())
    assert len(tune_calls(root)) == 1
    C.reset()
    other = _follow(root, job="job-2")  # another job (or none) tries again: its tune may find a winner
    assert set(other.tuned) == set(PROBLEMS)
    assert len(tune_calls(root)) == 2


def test_partly_decided_sets_only_tune_what_is_missing(tmp_path):
    root = str(tmp_path / "cache")
    store = DecisionStore(root)
    kp = PROBLEMS[0]
    record_decision(kp, tuned_launch(kp), 1.0, gpu=GPU, store=store)
    seen = []
    co = C.coordinated_tune(PROBLEMS, lambda ps: seen.extend(ps), gpu=GPU, store=store, wait_s=1)
    assert seen == PROBLEMS[1:] and co.decided_before == PROBLEMS[:1]


def test_no_gpu_calls_tune_directly(tmp_path, monkeypatch):
    monkeypatch.setattr(C, "current_gpu", lambda: None)
    seen = []
    co = C.coordinated_tune(PROBLEMS, lambda ps: seen.extend(ps) or "compiled", store=DecisionStore(tmp_path))
    assert seen == PROBLEMS and co.result == "compiled"


def test_rank_info_and_wait_seconds(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    info = C.rank_info()
    assert (info["rank"], info["local_rank"], info["world_size"], info["job"]) == (3, 1, 4, "abc")
    assert info["pid"] == os.getpid()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert C.job_id() is None
    monkeypatch.setenv(C.WAIT_ENV, "12.5")
    assert C.wait_seconds() == 12.5
    monkeypatch.setenv(C.WAIT_ENV, "soon")
    assert C.wait_seconds() == C.DEFAULT_WAIT_S


# ---------------------------------------------------------------------------------------------- the backend's use
def test_tune_report_names_decisions_tuned_here_and_elsewhere(tmp_cache, monkeypatch):
    """partition.tune_report (select="tune" at graph compile time) goes through the coordination: problems tuned
    by another rank are named as such, those left to the model say why."""
    pytest.importorskip("torch")
    from cutlass_byoc.offload.partition import tune_report
    from cutlass_byoc.offload.report import OffloadEntry, OffloadReport, Pass
    import cutlass_byoc.profiler.tune as T

    store = dec_mod.default_store()
    monkeypatch.setattr(dec_mod, "current_gpu", lambda: GPU)
    monkeypatch.setattr(C, "current_gpu", lambda: GPU)
    kp0 = PROBLEMS[0]
    record_decision(kp0, tuned_launch(kp0), 7.0, gpu=GPU, store=store)  # "another rank" decided this one
    C._settled[(str(store.root), GPU.tag, PROBLEMS[2])] = "waited 5 s for rank 0 and gave up"
    calls = []

    def fake_tune_workload(problems, **kw):
        calls.append(list(problems))
        for p in problems:
            kp = p
            record_decision(kp, tuned_launch(kp), 3.0, gpu=GPU, store=store)

    monkeypatch.setattr(T, "tune_workload", fake_tune_workload)
    rep = OffloadReport("g")
    for i, p in enumerate(PROBLEMS):
        rep.add(OffloadEntry(node=f"n{i}", kind=Pass.FPROP, offloaded=True, problem=p.name, kernel="heuristic"))
        rep.problems.append(p)
    tune_report(rep)
    assert calls == [[PROBLEMS[1]]]
    e0, e1, e2 = rep.offloaded
    assert e0.kernel.endswith("(cached, 7.0 us)") and e1.kernel.endswith("(tuned, 3.0 us)")
    assert e2.kernel == "heuristic" and "not tuned: waited 5 s for rank 0" in e2.notes[0]

    # the same graph's problems again in this process (with prefer_cudnn the backend tunes a probe of the graph, then
    # names the real partition's launches): what this process tuned stays "tuned", older decisions "cached"
    again = OffloadReport("g again")
    for i, p in enumerate(PROBLEMS[:2]):
        again.add(OffloadEntry(node=f"n{i}", kind=Pass.FPROP, offloaded=True, problem=p.name, kernel="heuristic"))
        again.problems.append(p)
    tune_report(again)
    assert calls == [[PROBLEMS[1]]]  # nothing tuned twice
    a0, a1 = again.offloaded
    assert a0.kernel.endswith("(cached, 7.0 us)") and a1.kernel.endswith("(tuned, 3.0 us)")
