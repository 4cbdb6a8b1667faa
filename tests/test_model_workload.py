"""CPU tests of `cutlass-byoc tune/bench --model`: the problems traced from a model are exactly those the backend's
partitioner offloads (fprop, dgrad, wgrad with autocast's dtypes and the fused epilogues)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # `models:resnet50` specs name tests/models.py

from cutlass_byoc.cli import UsageError, _items_from_args, build_parser  # noqa: E402
from cutlass_byoc.offload import explain  # noqa: E402
from cutlass_byoc.offload.trace import load_model, model_problems  # noqa: E402
from cutlass_byoc.types import ConvKind  # noqa: E402


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2"])
def test_model_problems_are_the_partitioners(name):
    problems, rep = model_problems(f"models:{name}", 2, image=64)
    # the same model partitioned as explain() does it on real (CPU) tensors
    torch.manual_seed(0)
    m = load_model(f"models:{name}").to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    _, ref = explain(m, x, training=True, autocast=torch.float16, options={"require_cuda": False})
    assert {p.name for p in problems} == {e.problem for e in ref.offloaded}
    assert len(problems) == len(set(problems))
    kinds = {p.kind for p in problems}
    assert kinds == {ConvKind.FPROP, ConvKind.DGRAD, ConvKind.WGRAD}
    assert all(p.element_a.value == "f16" for p in problems)
    # fused epilogues as the partitioner fuses them (autocast's fp32 wgrad outputs for fp32 master weights)
    assert any(p.kind is ConvKind.WGRAD and p.element_out.value == "f32" for p in problems)


def test_inference_traces_forward_only():
    problems, _ = model_problems("models:resnet18", 1, training=False, image=64)
    assert problems and {p.kind for p in problems} == {ConvKind.FPROP}


def test_a_callers_module_is_left_as_it_was():
    """Tracing a module the caller passed leaves it usable: its parameters stay real tensors in their layout, its
    train/eval mode stays, and it can be traced again (training, then inference)."""
    from models import resnet18  # noqa: PLC0415

    torch.manual_seed(0)
    m = resnet18().eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    train_problems, _ = model_problems(m, 2, training=True, image=64)
    infer_problems, _ = model_problems(m, 2, training=False, image=64)
    assert train_problems and infer_problems and not m.training
    after = m.state_dict()
    assert all(type(v) is torch.Tensor and torch.equal(v, before[k]) for k, v in after.items())
    assert m.conv1.weight.is_contiguous()  # not converted to channels_last
    assert m(torch.randn(1, 3, 32, 32)).shape == (1, 1000)


def test_cli_model_items():
    args = build_parser().parse_args(["tune", "--model", "models:resnet18", "--batch", "2", "--image", "64",
                                      "--amp", "bf16"])
    items = _items_from_args(args)
    assert items and all(it.problem.element_a.value == "bf16" and it.problem.n == 2 for it in items)
    assert items[0].layer == "resnet18#0"


@pytest.mark.parametrize("spec, match", [("resnet50", "expected torchvision"), ("nosuchpkg_xyz:f", "cannot import"),
                                         ("models:nope", "no callable")])
def test_bad_model_spec_names_the_flag(spec, match):
    args = build_parser().parse_args(["tune", "--model", spec])
    with pytest.raises(UsageError, match=match):
        _items_from_args(args)
    args = build_parser().parse_args(["bench", "--model", "models:resnet18", "--kind", "fprop"])
    with pytest.raises(UsageError, match="--model"):
        _items_from_args(args)


def test_cli_model_items_count_the_step_passes():
    """Each item counts the conv passes of the traced step that run its problem (ResNet-50's repeated bottlenecks share
    problems): the counts sum to every offloaded pass."""
    args = build_parser().parse_args(["tune", "--model", "models:resnet50", "--batch", "2", "--image", "64"])
    items = _items_from_args(args)
    _, rep = model_problems("models:resnet50", 2, image=64)
    assert sum(it.count for it in items) == len(rep.problems) > len(items)
    assert max(it.count for it in items) > 1


def test_step_summary_sums_the_plans():
    """`tune --model`'s per-step line: cuDNN alone, the CUDA-graphs plan (the faster per pass), the host-credit plan
    and all on ours, each problem weighted by its count; problems without both times are left out and said."""
    from types import SimpleNamespace

    from cutlass_byoc.cli import step_summary
    from cutlass_byoc.workloads import WorkloadItem

    p = [object() for _ in range(4)]
    items = [WorkloadItem("a", p[0], count=3), WorkloadItem("b", p[1], count=2), WorkloadItem("c", p[2]),
             WorkloadItem("d", p[3])]
    outcomes = [SimpleNamespace(problem=p[0], time_us=10.0, cudnn_us=20.0),  # ours faster
                SimpleNamespace(problem=p[1], time_us=25.0, cudnn_us=20.0),  # cuDNN faster by 5: within the credit
                SimpleNamespace(problem=p[2], time_us=50.0, cudnn_us=30.0),  # cuDNN faster by 20: stays with cuDNN
                SimpleNamespace(problem=p[3], time_us=5.0, cudnn_us=None)]   # no cuDNN time: left out
    line = step_summary(items, outcomes, 10.0)
    # cuDNN 3*20+2*20+30 = 130; graphs 3*10+2*20+30 = 100 (3 ours); credit 3*10+2*25+30 = 110 (5 ours);
    # ours 3*10+2*25+50 = 130 us
    assert "6 of the traced step's 7 conv passes" in line
    assert "cuDNN alone 0.13 ms" in line and "under CUDA graphs 0.10 ms, 3 passes on our kernels" in line
    assert "without them 0.11 ms of GPU time, 5 on ours (host credit 10 us" in line and "all on ours 0.13 ms" in line
    assert step_summary(items[3:], outcomes, 10.0) is None


def test_step_summary_adds_the_untuned_plan():
    """With each problem's untuned launch (what runs without a decision), the line adds that plan's time from the
    tune's results, against the tuned and cuDNN times of the same passes; a problem whose untuned launch was not
    timed (or failed) is left out of those three sums, and the line says over how many passes they run."""
    from types import SimpleNamespace

    from cutlass_byoc.cli import step_summary, untuned_time_us
    from cutlass_byoc.workloads import WorkloadItem

    p = [object() for _ in range(3)]
    la, lb, lc, other = (SimpleNamespace(name=n) for n in "abcz")

    def res(launch, us, ok=True):
        return SimpleNamespace(launch=launch, median_us=us, ok=ok)

    items = [WorkloadItem("a", p[0], count=2), WorkloadItem("b", p[1]), WorkloadItem("c", p[2])]
    outcomes = [SimpleNamespace(problem=p[0], time_us=10.0, cudnn_us=12.0, results=(res(other, 10.0), res(la, 15.0))),
                SimpleNamespace(problem=p[1], time_us=20.0, cudnn_us=18.0, results=(res(lb, 20.0),)),
                SimpleNamespace(problem=p[2], time_us=5.0, cudnn_us=6.0, results=(res(lc, 4.0, ok=False),))]
    untuned = {p[0]: la, p[1]: lb, p[2]: lc}
    assert untuned_time_us(outcomes[0], la) == 15.0 and untuned_time_us(outcomes[2], lc) is None
    line = step_summary(items, outcomes, 10.0, untuned)
    # untuned 2*15+20 = 50 us over 3 of the 4 passes; tuned there 2*10+20 = 40; cuDNN 2*12+18 = 42
    assert "untuned (no decisions: the model's launch on every pass) over the 3 passes whose untuned launch was " \
           "timed 0.05 ms against 0.04 ms tuned and 0.04 ms cuDNN" in line
    assert "untuned" not in step_summary(items, outcomes, 10.0)


def test_cli_tune_model_prints_the_step_line(monkeypatch, capsys, tmp_path):
    """`tune --model` prints the per-step line from its outcomes (here a fake tune: ours 10 us, cuDNN 12 us on every
    problem, so both plans put every pass on our kernels)."""
    from cutlass_byoc import cli
    from cutlass_byoc.profiler import tune as T

    def fake_tune(problems, **kw):
        return T.TuneReport(tuple(T.ProblemOutcome(p, T.TUNED, None, 10.0, cudnn_us=12.0) for p in problems), None,
                            True)

    monkeypatch.setattr(T, "tune_workload", fake_tune)
    rc = cli.main(["tune", "--model", "models:resnet18", "--batch", "2", "--image", "64", "--no-progress",
                   "--cache-dir", str(tmp_path)])
    assert rc == cli.EXIT_OK
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("per step ("))
    _, rep = model_problems("models:resnet18", 2, image=64)
    n = len(rep.problems)
    assert f"the traced step's {n} conv passes" in line
    assert f"cuDNN alone {n * 12 / 1e3:.2f} ms" in line and f"{n} passes on our kernels" in line


def test_default_regret_sums_the_plans_of_a_report(tmp_path, capsys):
    """scripts/default_regret.py on a `tune --model --json` report (here made up from the plan: each launch at
    twice its estimate, cuDNN at the best time plus 1 us): the model is traced again, each report problem matched by
    name, and the class rows and the total weigh each problem by its passes; the untuned launch recorded and the
    current code's default are the same launch here, so both columns agree, and --calibration gives each group the
    factor 2 over the uncalibrated model."""
    import importlib.util
    import json

    from cutlass_byoc.heuristics import H200_SMS, _model_us, default_launch
    from cutlass_byoc.profiler.plan import plan_problem

    problems, rep = model_problems("models:resnet18", 2, image=64)
    counts = {p: rep.problems.count(p) for p in problems}
    outcomes, passes, untuned_total, cudnn_total = [], [], 0.0, 0.0
    for p in problems:
        launches = [c.launch for c in plan_problem(p, 2).candidates if not c.launch.padded and c.launch.s2d == 1
                    and not c.launch.kernel.lowering]
        d = default_launch(p)
        if d not in launches:
            launches.append(d)
        times = {l.name: 2 * _model_us(p, l, H200_SMS) for l in launches}
        best = min(times.values())
        outcomes.append({"problem": p.name, "time_us": best, "cudnn_us": best + 1.0,
                         "results": [{"launch": n, "status": "ok", "median_us": t} for n, t in times.items()]})
        passes.append({"problem": p.name, "layer": "x", "count": counts[p], "untuned": d.name})
        untuned_total += times[d.name] * counts[p]
        cudnn_total += (best + 1.0) * counts[p]
    report = tmp_path / "tune-model.json"
    report.write_text(json.dumps({"outcomes": outcomes, "passes": passes}))
    spec = importlib.util.spec_from_file_location("default_regret", Path(__file__).parents[1] / "scripts" /
                                                  "default_regret.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(report), "--model", "models:resnet18", "--batch", "2", "--image", "64",
                     "--calibration"]) == 0
    out = capsys.readouterr().out
    total = next(line for line in out.splitlines() if line.startswith("all (us per step)"))
    n = sum(counts.values())
    assert f"{cudnn_total:10.1f} ({n:>3})" in total and f"{untuned_total:10.1f} ({n:>3})" in total
    assert total.count(f"{untuned_total:10.1f} ({n:>3})") == 2  # untuned then and now: the same launches
    factors = [line for line in out.splitlines() if "geomean" in line and "now" in line]
    assert factors and all("geomean  2.00" in line for line in factors)
