"""The `cutlass-byoc` CLI on a machine without a GPU: usage errors, workloads, the cache commands, and `tune`
planning and compiling while saying that timing needs a GPU."""

from __future__ import annotations

import json
import tarfile

import pytest

from cutlass_byoc import cli
from cutlass_byoc import decisions as dec_mod
from cutlass_byoc.decisions import DecisionStore, GpuInfo, record_decision
from cutlass_byoc.heuristics import default_launch
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.workloads import WorkloadError, default_workload, dump_workload, load_workload, workload

GPU = GpuInfo("NVIDIA H200", 90)


def no_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------- workloads
def test_default_workload():
    items = default_workload()
    assert len(items) == 16 * 3
    assert sum(1 for it in items if it.resnet50) == 45
    stem = [it.problem for it in items if it.layer.startswith("conv1")]
    assert {p.kind.value for p in stem} == {"fprop", "dgrad", "wgrad"}
    p = stem[0]
    assert (p.n, p.c, p.k, p.r, p.s, p.stride_h, p.pad_h, p.h, p.p) == (32, 3, 64, 7, 7, 2, 3, 224, 112)
    assert all(it.problem.groups == 1 for it in items)  # depthwise layers are the named workload "depthwise"
    odd = [it.problem for it in items if it.layer.startswith("odd")]
    assert odd[0].c == 7 and odd[0].k == 33 and odd[0].pad_h == 1


def test_workload_json_forms(tmp_path):
    f = tmp_path / "w.json"
    f.write_text(json.dumps({"batch": 8, "kinds": ["fprop"], "layers": [
        {"name": "a", "c": 64, "k": 64, "r": 3, "hw": 28},
        {"name": "b", "c": 32, "k": 16, "r": 1, "h": 14, "w": 10, "stride": 2, "kinds": ["dgrad", "wgrad"]},
    ]}))
    items = load_workload(f)
    assert [(it.layer, it.kind.value) for it in items] == [("a", "fprop"), ("b", "dgrad"), ("b", "wgrad")]
    assert items[0].problem.n == 8 and items[0].problem.pad_h == 1 and items[1].problem.w == 10
    # --kinds (the round's TUNE_KINDS) keeps those kinds' problems of a file, as of a named workload
    assert [(it.layer, it.kind.value) for it in workload(str(f), kinds=["wgrad"])] == [("b", "wgrad")]
    assert len(workload(str(f), kinds=["fprop", "dgrad", "wgrad"])) == 3
    only_fprop = tmp_path / "fprop.json"
    only_fprop.write_text(json.dumps({"kinds": ["fprop"], "layers": [{"c": 64, "k": 64, "r": 3, "hw": 8}]}))
    with pytest.raises(WorkloadError, match="no problems of the kinds wgrad"):
        workload(str(only_fprop), kinds=["wgrad"])
    g = tmp_path / "dump.json"
    dump_workload(items, g)
    assert [it.problem for it in load_workload(g)] == [it.problem for it in items]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": [{"name": "x", "c": 64, "r": 3, "hw": 8}]}))
    with pytest.raises(WorkloadError, match=r"layers\[0\].*'k'"):
        load_workload(bad)
    bad.write_text(json.dumps({"layers": [{"c": 64, "k": 64, "r": 3, "hw": 8, "stride": 0}]}))
    with pytest.raises(WorkloadError, match="stride"):
        load_workload(bad)


# ---------------------------------------------------------------------------------------------- usage
@pytest.mark.parametrize("argv,needle", [
    (["tune", "/nonexistent.json"], "no such file"),
    (["bench", "resnet5"], "workload: expected a JSON file or one of default, resnet50, depthwise, all, got 'resnet5'"),
    (["tune", "--c", "64", "--h", "56"], "--k, --r"),
    (["tune", "--kind", "fprop", "--c", "64", "--h", "2", "--k", "8", "--r", "7", "--padding", "0"], "output size"),
    (["tune", "--max-candidates", "0"], "--max-candidates"),
    (["cache", "show", "ffffffffff"], "no decision or kernel"),
    (["cache", "import", "/nonexistent.tgz"], "no such file"),
])
def test_usage_errors_exit_2(tmp_cache, capsys, argv, needle):
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert needle in err, err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--arch", "80"])
    assert e.value.code == 2


def test_common_options_before_or_after_the_command(tmp_path, capsys):
    root = tmp_path / "c1"
    assert cli.main(["--cache-dir", str(root), "cache", "list"]) == 0
    assert str(root) in capsys.readouterr().out
    root2 = tmp_path / "c2"
    assert cli.main(["cache", "list", "--cache-dir", str(root2)]) == 0
    assert str(root2) in capsys.readouterr().out


@pytest.mark.skipif(not no_gpu(), reason="checks the message on a machine without a GPU")
def test_bench_without_gpu_says_so(tmp_cache, capsys):
    assert cli.main(["bench"]) == cli.EXIT_NO_GPU
    assert "needs a GPU" in capsys.readouterr().err


def test_check_and_time_checks_before_it_times(monkeypatch):
    """bench.check_and_time (bench's rows, scripts/depthwise_defaults.py): a launch is run once on a poisoned output
    and compared with the float64 reference before it is timed; a wrong one is reported and never timed, an error is
    reported, a CUDA error raised. Here on the CPU, the kernel stood in for by PyTorch (right, or off by one)."""
    torch = pytest.importorskip("torch")
    from cutlass_byoc import bench, ops  # noqa: PLC0415
    from cutlass_byoc.profiler import timing, verify  # noqa: PLC0415
    from cutlass_byoc.profiler.timing import TimingSettings, TimingStats  # noqa: PLC0415

    p = Conv2dProblem.make("fprop", 2, 8, 6, 6, 8, 3, padding=1)
    gen = torch.Generator().manual_seed(0)
    sets = [verify.make_operand_set(p, "cpu", gen) for _ in range(2)]
    ref = verify.reference(p, sets[0])
    behaviour = {"add": 0.0, "raise": None}
    timed = []

    def fake_run(problem, a, b, out, source=None, *, config=None, bias=None):
        if behaviour["raise"]:
            raise RuntimeError(behaviour["raise"])
        y = torch.nn.functional.conv2d(a.float(), b.float(), padding=1) + behaviour["add"]
        out.copy_(y.to(out.dtype))

    def fake_time(fn, rotations, settings=TimingSettings()):
        timed.append(rotations)
        for i in range(rotations):
            fn(i)
        return TimingStats(12.5, 12.0, 12.5, 0.1, rotations, rotations)

    monkeypatch.setattr(ops, "run_problem", fake_run)
    monkeypatch.setattr(timing, "time_gpu", fake_time)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    launch = default_launch(p)
    us, err, status = bench.check_and_time(p, launch, sets, ref, TimingSettings())
    assert (us, status, timed) == (12.5, "ok", [2]) and err < 1e-2
    behaviour["add"] = 1.0
    us, err, status = bench.check_and_time(p, launch, sets, ref, TimingSettings())
    assert us is None and status.startswith("wrong: ") and err > 1e-2 and timed == [2]
    behaviour["raise"] = "no kernel library"
    assert bench.check_and_time(p, launch, sets, ref, TimingSettings()) == (
        None, None, "error: RuntimeError: no kernel library")
    behaviour["raise"] = "CUDA error: an illegal memory access was encountered"
    with pytest.raises(RuntimeError, match="CUDA error"):
        bench.check_and_time(p, launch, sets, ref, TimingSettings())


# ---------------------------------------------------------------------------------------------- cache commands
def _seed_decisions(n: int = 3) -> list[Conv2dProblem]:
    probs = [Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1).replace(n=8 * (i + 1)) for i in range(n)]
    for i, p in enumerate(probs):
        record_decision(p, default_launch(p), 10.0 + i, gpu=GPU)
    return probs


def test_cache_list_show_export_import_clear(tmp_path, monkeypatch, capsys):
    src = tmp_path / "src"
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(src))
    probs = _seed_decisions()
    assert cli.main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "3 decisions" in out and "NVIDIA H200" in out and probs[0].name in out
    digest = next(DecisionStore(src).iter_files()).stem
    assert cli.main(["cache", "show", digest[:10]]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["digest"] == digest and shown["gpu_name"] == "NVIDIA H200"

    tgz = tmp_path / "tuned.tar.gz"
    assert cli.main(["cache", "export", str(tgz)]) == 0
    assert "exported 3 decisions" in capsys.readouterr().out
    with tarfile.open(tgz) as t:
        assert all(n.startswith(("decisions", "kernels")) for n in t.getnames())

    # --decisions-only: the decisions and nothing else (kernels are not even looked up)
    small = tmp_path / "decisions.tar.gz"
    monkeypatch.setattr(cli, "_decision_kernel_keys", lambda *a: pytest.fail("looked up kernels"))
    assert cli.main(["cache", "export", "--decisions-only", str(small)]) == 0
    assert "exported 3 decisions and 0 kernels" in capsys.readouterr().out
    with tarfile.open(small) as t:
        names = [n for n in t.getnames() if t.getmember(n).isfile()]
    assert len(names) == 3 and all(n.startswith("decisions/") for n in names)
    monkeypatch.undo()
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(src))

    dst = tmp_path / "dst"
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(dst))
    assert cli.main(["cache", "import", str(tgz)]) == 0
    assert "imported 3 decisions" in capsys.readouterr().out
    st = DecisionStore(dst)
    for p in probs:  # the other machine (same GPU) finds every decision
        assert dec_mod.lookup_decision(p, gpu=GPU, store=st) == default_launch(p)
    assert cli.main(["cache", "import", str(tgz)]) == 0
    assert "imported 0 decisions (3 already present)" in capsys.readouterr().out

    assert cli.main(["cache", "clear", "--decisions"]) == 0
    assert "removed 3 decisions" in capsys.readouterr().out
    assert dec_mod.lookup_decision(probs[0], gpu=GPU, store=DecisionStore(dst)) is None


def test_import_refuses_path_traversal(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(tmp_path / "c"))
    evil = tmp_path / "evil.tar.gz"
    payload = tmp_path / "x.json"
    payload.write_text("{}")
    with tarfile.open(evil, "w:gz") as t:
        t.add(payload, arcname="decisions/../../escape.json")
    assert cli.main(["cache", "import", str(evil)]) == cli.EXIT_USAGE
    assert "refusing member" in capsys.readouterr().err
    assert not (tmp_path / "escape.json").exists()


# ---------------------------------------------------------------------------------------------- tune without a GPU
@pytest.mark.compile
@pytest.mark.skipif(not no_gpu(), reason="checks the no-GPU path")
def test_tune_without_gpu_plans_compiles_and_says_timing_needs_a_gpu(tmp_cache, capsys, monkeypatch):
    monkeypatch.setattr(dec_mod, "current_gpu", lambda: None)
    argv = ["tune", "--kind", "fprop", "--n", "8", "--c", "64", "--h", "28", "--k", "64", "--r", "1",
            "--max-candidates", "1", "--jobs", "2"]
    assert cli.main(argv) == cli.EXIT_NO_GPU
    cap = capsys.readouterr()
    assert "timing needs a GPU" in cap.err
    assert "1 compiled now" in cap.out and "compiled" in cap.out
    assert sum(1 for e in tmp_cache.entries() if e.state.value == "ok") == 1
    logs = list((tmp_cache.root / "logs").glob("tune-*.jsonl"))
    assert logs and json.loads(logs[0].read_text().splitlines()[0])["event"] == "plan"
    # a second run finds the kernel in the cache: nothing is compiled again
    assert cli.main(argv) == cli.EXIT_NO_GPU
    assert "0 compiled now" in capsys.readouterr().out
    # --compile-only is a success without a GPU
    assert cli.main(argv + ["--compile-only"]) == cli.EXIT_OK


def test_tune_second_run_compiles_and_times_nothing(tmp_cache, monkeypatch):
    """With every decision recorded, tune returns before planning: no build, no worker."""
    from cutlass_byoc.profiler import tune as tune_mod

    probs = _seed_decisions(2)
    monkeypatch.setattr(tune_mod, "current_gpu", lambda: GPU)

    def boom(*a, **k):
        raise AssertionError("must not be called")

    monkeypatch.setattr(tune_mod, "build", boom)
    monkeypatch.setattr(tune_mod, "CandidateRunner", boom)
    monkeypatch.setattr(tune_mod, "plan_workload", boom)
    rep = tune_mod.tune_workload(probs)
    assert [o.status for o in rep.outcomes] == [tune_mod.CACHED, tune_mod.CACHED]
    assert rep.kernels_compiled == 0 and rep.launches_timed == 0
    assert rep.outcomes[0].launch == default_launch(probs[0])


def test_tune_refuses_a_gpu_of_another_arch(tmp_cache):
    from cutlass_byoc.profiler import tune as tune_mod

    with pytest.raises(tune_mod.TuneError, match="sm_90a"):
        tune_mod.tune_workload([Conv2dProblem.make("fprop", 1, 8, 8, 8, 8, 1)], gpu=GpuInfo("NVIDIA A100", 80))


def test_tune_times_beside_the_build_unless_asked_not_to(tmp_cache, monkeypatch, capsys):
    """`tune` passes overlap_timing (off with --time-after-build) and says how much timing was left after the build."""
    from cutlass_byoc.profiler import tune as tune_mod

    seen = []

    def fake_tune(problems, **kw):
        seen.append(kw["overlap_timing"])
        outcomes = tuple(tune_mod.ProblemOutcome(p, tune_mod.TUNED, None, 1.0) for p in problems)
        return tune_mod.TuneReport(outcomes, GPU, True, compile_s=30.0, timing_s=31.0, total_s=32.0,
                                   overlapped=kw["overlap_timing"], timing_after_build_s=1.5)

    monkeypatch.setattr(tune_mod, "tune_workload", fake_tune)
    argv = ["tune", "--no-progress", "--kind", "fprop", "--c", "64", "--h", "8", "--k", "64", "--r", "1"]
    assert cli.main(argv) == cli.EXIT_OK
    assert "timing ran beside the build: 1.5 s of it after the build ended" in capsys.readouterr().out
    assert cli.main(argv + ["--time-after-build"]) == cli.EXIT_OK
    assert "beside the build" not in capsys.readouterr().out
    assert seen == [True, False]


def test_cache_list_marks_each_decision_current_or_stale(tmp_path, monkeypatch, capsys):
    """`cache list`: a decision for this GPU is current, one for another GPU or from other templates is stale, and
    without a GPU only the templates and CUTLASS version can make one stale ("-" otherwise)."""
    import dataclasses

    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(tmp_path / "c"))
    here, there = _seed_decisions(2)
    store = DecisionStore(tmp_path / "c")
    h100 = GpuInfo("NVIDIA H100 80GB HBM3", 90)
    record_decision(there, default_launch(there), 5.0, gpu=h100)
    old_key = dataclasses.replace(dec_mod.DecisionKey.for_problem(here, h100), template_hash="0" * 64)
    store.record(dec_mod.Decision(old_key, default_launch(here), 6.0))

    def states():
        assert cli.main(["cache", "list"]) == 0
        return sorted(line.split()[1] for line in capsys.readouterr().out.splitlines() if " sm_90 " in line)

    monkeypatch.setattr(dec_mod, "current_gpu", lambda: h100)  # the H100 decision current, the H200 ones stale
    assert states() == ["current", "stale", "stale", "stale"]
    monkeypatch.setattr(dec_mod, "current_gpu", lambda: None)  # no GPU: only the old templates' decision stale
    assert states() == ["-", "-", "-", "stale"]
