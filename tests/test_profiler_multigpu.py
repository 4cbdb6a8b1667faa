"""`tune --gpus`: parsing, refusal of a mix of GPU models (probed before compiling, and as each worker reports
itself), one shared compile step, and problems spread over one worker per GPU. CPU only: the GPUs and their
workers are fakes (real worker processes, fake GPU side), as in test_profiler_tune.py / test_profiler_worker.py."""

from __future__ import annotations

import os
import time

import pytest

from cutlass_byoc import cli
from cutlass_byoc.candidates import sm80_candidates
from cutlass_byoc.config import LaunchConfig
from cutlass_byoc.decisions import DecisionStore, GpuInfo, lookup
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.profiler import multigpu as M
from cutlass_byoc.profiler import tune as T
from cutlass_byoc.profiler import worker as W

from fake_profiler import FakeRunner, fake_build, serve_fake_worker  # noqa: E402

H200 = GpuInfo("NVIDIA H200", 90)
H100 = GpuInfo("NVIDIA H100 80GB HBM3", 90)
PROBLEMS = [
    Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1),
    Conv2dProblem.make("wgrad", 32, 64, 56, 56, 64, 3, padding=1),
    Conv2dProblem.make("fprop", 32, 128, 28, 28, 128, 3, padding=1),
    Conv2dProblem.make("dgrad", 32, 256, 14, 14, 256, 1),
    Conv2dProblem.make("fprop", 32, 256, 14, 14, 1024, 1),
]


# ---------------------------------------------------------------------------------------------- --gpus parsing
def test_parse_gpus():
    assert M.parse_gpus("all", 2) == [0, 1]
    assert M.parse_gpus("ALL", 0) == []  # no GPU: tune then compiles only and says so
    assert M.parse_gpus("0,1", 2) == [0, 1]
    assert M.parse_gpus(" 1 , 0 ", 4) == [1, 0]
    assert M.parse_gpus("3", 4) == [3]
    for spec, count, match in [
        ("", 2, "expected 'all'"),
        ("0,x", 2, "'x' is not a device index"),
        ("-1", 2, "negative"),
        ("0,0", 2, "listed twice"),
        ("0,2", 2, r"there is no GPU 2: 2 CUDA devices are visible \(indices 0..1\)"),
        ("1", 1, r"there is no GPU 1: 1 CUDA device is visible"),
        ("0", 0, "no CUDA device is visible"),
        ("0;1", 2, "not a device index"),
    ]:
        with pytest.raises(M.GpuSelectionError, match=match):
            M.parse_gpus(spec, count)


def test_parse_gpus_names_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(M.GpuSelectionError, match="CUDA_VISIBLE_DEVICES=3"):
        M.parse_gpus("0,1", 1)


def test_visible_device(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert M.visible_device(1) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, GPU-abc,6")
    assert [M.visible_device(i) for i in range(3)] == ["2", "GPU-abc", "6"]


def test_mixed_gpu_message():
    assert M.mixed_gpu_message([0, 1], [H200, H200]) is None
    assert M.mixed_gpu_message([], []) is None
    msg = M.mixed_gpu_message([0, 1, 2], [H200, H200, H100])
    assert "GPU 0 is NVIDIA H200 (sm_90)" in msg and "GPU 2 is NVIDIA H100 80GB HBM3 (sm_90)" in msg
    assert M.mixed_gpu_message([0, 1], [H200, GpuInfo("NVIDIA H200", 100)]) is not None  # same name, other arch


def test_cli_gpus_usage_errors(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(M, "visible_gpu_count", lambda: 0)
    rc = cli.main(["tune", "--gpus", "0,1", "--cache-dir", str(tmp_path), "--kind", "fprop", "--c", "64", "--h", "8",
                   "--k", "64", "--r", "1"])
    assert rc == cli.EXIT_USAGE
    assert "--gpus 0,1: there is no GPU 0: no CUDA device is visible" in capsys.readouterr().err
    monkeypatch.setattr(M, "visible_gpu_count", lambda: 2)
    assert cli.main(["tune", "--gpus", "zero", "--cache-dir", str(tmp_path)]) == cli.EXIT_USAGE
    assert "not a device index" in capsys.readouterr().err


def test_cli_passes_devices_and_prints_scaling(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_tune(problems, **kw):
        seen.update(kw)
        per_gpu = (M.GpuTiming(0, H200.tag, 3, 6.0), M.GpuTiming(1, H200.tag, 2, 5.0))
        outcomes = tuple(T.ProblemOutcome(p, T.TUNED, None, 1.0) for p in problems)
        return T.TuneReport(outcomes, H200, True, timing_s=6.0, devices=(0, 1), per_gpu=per_gpu)

    monkeypatch.setattr(M, "visible_gpu_count", lambda: 2)
    monkeypatch.setattr(T, "tune_workload", fake_tune)
    out = tmp_path / "r.json"
    rc = cli.main(["tune", "--gpus", "all", "--no-progress", "--cache-dir", str(tmp_path), "--json", str(out),
                   "--kind", "fprop", "--c", "64", "--h", "8", "--k", "64", "--r", "1"])
    assert rc == cli.EXIT_OK
    assert seen["devices"] == [0, 1]
    text = capsys.readouterr().out
    assert "x 2 (GPUs 0,1)" in text and "(balance 1.83 of 2)" in text and "time again with --gpus 0" in text
    import json

    d = json.loads(out.read_text())
    assert d["devices"] == [0, 1] and d["scaling"]["gpus"] == 2
    assert abs(d["scaling"]["balance"] - 11 / 6) < 1e-9 and d["scaling"]["problems_per_gpu"] == [3, 2]


# ---------------------------------------------------------------------------------------------- tune_workload
class FakeGpuRunner(FakeRunner):
    """A runner whose worker sits on settings.device; the GPU it reports comes from FakeGpuRunner.gpus."""

    gpus: dict = {}
    calls: list = []
    BASELINE_US = 60.0

    def __init__(self, settings):
        super().__init__(settings)
        self.device = settings.device
        g = FakeGpuRunner.gpus[self.device]
        self.gpu = (g.name, g.arch)

    def results(self, problem, launches):
        FakeGpuRunner.calls.append((self.device, problem))
        time.sleep(0.05)  # so both GPUs get work
        return [W.CandidateResult(l, W.OK, 50.0 + i, 49.0 + i, 20, 2, 1e-4) for i, l in enumerate(launches)]


@pytest.fixture
def fakes(tmp_cache, monkeypatch):
    builds: list = []
    FakeGpuRunner.gpus = {0: H200, 1: H200}
    FakeGpuRunner.calls = []
    monkeypatch.setattr(T, "build", fake_build(builds, tmp_cache.root))
    monkeypatch.setattr(T, "CandidateRunner", FakeGpuRunner)
    monkeypatch.setattr(T, "current_gpu", lambda: H100)  # the parent's current device is not what decides
    monkeypatch.setattr(T, "probe_gpus", lambda devices: [FakeGpuRunner.gpus[d] for d in devices])
    return builds, tmp_cache


def test_two_gpus_share_one_build_and_split_the_problems(fakes):
    builds, cache = fakes
    store = DecisionStore(cache.root)
    rep = T.tune_workload(PROBLEMS, max_candidates=3, cache=cache, store=store, devices=[0, 1])
    assert len(builds) == 1  # one compile step for both GPUs
    assert [o.status for o in rep.outcomes] == [T.TUNED] * len(PROBLEMS)
    assert sorted(p.name for _, p in FakeGpuRunner.calls) == sorted(p.name for p in PROBLEMS)  # each timed once
    assert {d for d, _ in FakeGpuRunner.calls} == {0, 1}
    assert rep.gpu == H200 and rep.devices == (0, 1)
    assert [g.device for g in rep.per_gpu] == [0, 1] and sum(g.problems for g in rep.per_gpu) == len(PROBLEMS)
    assert all(g.gpu == H200.tag for g in rep.per_gpu)
    assert rep.scaling["gpus"] == 2 and rep.scaling["balance"] > 1.2
    for p in PROBLEMS:  # recorded for the GPUs that timed, not for the parent's current device
        assert lookup(p, gpu=H200, store=store) is not None
        assert lookup(p, gpu=H100, store=store) is None
    assert "gpus" in {__import__("json").loads(l)["event"] for l in rep.log_path.read_text().splitlines()}
    again = T.tune_workload(PROBLEMS, max_candidates=3, cache=cache, store=store, devices=[0, 1])
    assert {o.status for o in again.outcomes} == {T.CACHED} and len(builds) == 1


def test_two_gpus_time_beside_the_build(tmp_cache, monkeypatch):
    """With several GPUs too, problems are timed as their kernels are built: by the build's last kernel some problem
    has been timed already; every problem is still timed once, and the workers stop when the build has ended."""
    FakeGpuRunner.gpus = {0: H200, 1: H200}
    FakeGpuRunner.calls = []
    plan = T.plan_workload(PROBLEMS, 3)
    last = plan.kernels[-1]  # the last kernel the tuner hands the build
    seen_early = []

    def on_each(kc):
        if kc == last:
            end = time.monotonic() + 10
            while not FakeGpuRunner.calls and time.monotonic() < end:
                time.sleep(0.01)
            seen_early.append(bool(FakeGpuRunner.calls))

    builds: list = []
    monkeypatch.setattr(T, "build", fake_build(builds, tmp_cache.root, on_each=on_each))
    monkeypatch.setattr(T, "CandidateRunner", FakeGpuRunner)
    monkeypatch.setattr(T, "probe_gpus", lambda devices: [FakeGpuRunner.gpus[d] for d in devices])
    rep = T.tune_workload(PROBLEMS, max_candidates=3, cache=tmp_cache, store=DecisionStore(tmp_cache.root),
                          devices=[0, 1])
    assert seen_early == [True] and rep.overlapped
    assert sorted(p.name for _, p in FakeGpuRunner.calls) == sorted(p.name for p in PROBLEMS)
    assert [o.status for o in rep.outcomes] == [T.TUNED] * len(PROBLEMS)
    assert sum(g.problems for g in rep.per_gpu) == len(PROBLEMS)


def test_one_device_runs_one_worker_on_it(fakes):
    _, cache = fakes
    rep = T.tune_workload(PROBLEMS[:2], max_candidates=2, cache=cache, devices=[1])
    assert {d for d, _ in FakeGpuRunner.calls} == {1} and rep.per_gpu == () and rep.scaling is None


def test_mixed_gpus_are_refused_before_compiling(fakes):
    builds, cache = fakes
    FakeGpuRunner.gpus = {0: H200, 1: H100}
    with pytest.raises(T.TuneError, match=r"GPU 0 is NVIDIA H200 \(sm_90\) but GPU 1 is NVIDIA H100"):
        T.tune_workload(PROBLEMS, max_candidates=2, cache=cache, devices=[0, 1])
    assert builds == [] and FakeGpuRunner.calls == []


def test_mixed_gpus_reported_by_the_workers_are_refused(fakes, monkeypatch):
    """The probe saw two H200s, but a worker reports something else (e.g. CUDA_VISIBLE_DEVICES changed)."""
    _, cache = fakes
    monkeypatch.setattr(T, "probe_gpus", lambda devices: [H200 for _ in devices])
    FakeGpuRunner.gpus = {0: H200, 1: H100}
    with pytest.raises(T.TuneError, match="but GPU 1 is NVIDIA H100"):
        T.tune_workload(PROBLEMS, max_candidates=2, cache=cache, devices=[0, 1])
    assert FakeGpuRunner.calls == []


def test_cli_refuses_mixed_gpus(fakes, monkeypatch, capsys):
    FakeGpuRunner.gpus = {0: H200, 1: H100}
    monkeypatch.setattr(M, "visible_gpu_count", lambda: 2)
    rc = cli.main(["tune", "--gpus", "all", "--no-progress", "--kind", "fprop", "--c", "64", "--h", "8", "--k", "64",
                   "--r", "1"])
    assert rc == cli.EXIT_USAGE
    assert "GPU 0 is NVIDIA H200 (sm_90) but GPU 1 is NVIDIA H100 80GB HBM3 (sm_90)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- real worker processes
PROBLEM = Conv2dProblem.make("wgrad", 8, 64, 16, 16, 64, 3, padding=1)


def fake_device_worker(tasks, results, settings) -> None:
    """A worker process on settings.device: reports the GPU named in $FAKE_GPU_<device> (default H200) and answers
    each candidate with time 10 + device after a short sleep."""
    W.apply_environment(settings)  # as the real worker does: CUDA_VISIBLE_DEVICES = its one GPU
    name = os.environ.get(f"FAKE_GPU_{settings.device}", "NVIDIA H200")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")

    def answer(idx: int, launch: LaunchConfig) -> W.CandidateResult:
        time.sleep(0.2)
        return W.CandidateResult(launch, W.OK, 10.0 + settings.device, 10.0, 5, 1, 0.0,
                                 message=f"pid {os.getpid()} sees {cvd}")

    serve_fake_worker(tasks, results, name, 20.0, answer)


def _runner(settings):
    return W.CandidateRunner(settings, target=fake_device_worker)


def test_one_worker_process_per_gpu(monkeypatch):
    launches = [LaunchConfig(k, 1) for k in list(sm80_candidates(PROBLEM))[:2]]
    problems = [PROBLEM.replace(n=n) for n in (1, 2, 3, 4, 5, 6)]
    done: list = []

    def evaluate(runner, p):
        return runner.evaluate(p, launches)

    def finish(p, results):
        done.append((p, results))

    settings = W.WorkerSettings(start_timeout_s=60.0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # --gpus indices are this process's: GPU 1 is physical 7
    stats = M.time_on_gpus([0, 1], settings, problems, evaluate, finish, _runner)
    assert sorted(p.n for p, _ in done) == [1, 2, 3, 4, 5, 6]
    pids = {r.message for _, res in done for r in res}
    assert {m.split(" sees ")[1] for m in pids} == {"5", "7"}  # each worker sees only its own GPU
    devices = {r.median_us - 10.0 for _, res in done for r in res}
    assert len(pids) == 2 and devices == {0.0, 1.0}  # two worker processes, one on each device
    assert [s.device for s in stats] == [0, 1] and sum(s.problems for s in stats) == 6
    assert all(s.gpu == "NVIDIA H200 (sm_90)" for s in stats)
    busy = sum(s.busy_s for s in stats)
    assert busy > 2.0 and max(s.busy_s for s in stats) < 0.8 * busy  # 12 candidates x 0.2 s, split over two

    monkeypatch.setenv("FAKE_GPU_1", "NVIDIA H100 80GB HBM3")
    done.clear()
    with pytest.raises(M.GpuSelectionError, match="GPU 0 is NVIDIA H200 .* but GPU 1 is NVIDIA H100"):
        M.time_on_gpus([0, 1], settings, problems, evaluate, finish, _runner)
    assert done == []
