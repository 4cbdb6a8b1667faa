"""scripts/tune_twins.py on the CPU: which planned extras won a tune's problems, and each atomic split-k launch
against its split-k twin of the same slice count, read from a tune report (the launches are the planner's configs,
matched by name, never parsed back)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import tune_twins  # noqa: E402

from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem  # noqa: E402
from cutlass_byoc.profiler.plan import plan_problem  # noqa: E402
from cutlass_byoc.sm90 import deterministic_twin  # noqa: E402
from cutlass_byoc.types import SplitKMode  # noqa: E402


def test_atomic_twins_read_against_their_split_k_twins():
    pytest.importorskip("torch")
    p = Conv2dProblem.make("wgrad", 32, 64, 56, 56, 64, 3, padding=1, out_dtype="f32")
    launches = {c.name: c.launch for c in plan_problem(p, 8).candidates}
    planned = {p.name: ("l1_3x3 wgrad", launches)}
    a = next(l for l in launches.values() if l.kernel.split_k_mode is SplitKMode.ATOMIC and not l.kernel.is_deep_twin)
    twin = LaunchConfig(deterministic_twin(a.kernel), a.split_k_slices)
    assert twin.name in launches
    assert tune_twins.extra_kind(a) == "atomic" and tune_twins.extra_kind(twin) is None
    other = next(n for n, l in launches.items() if tune_twins.extra_kind(l) is None and n != twin.name)
    results = [{"launch": a.name, "status": "ok", "median_us": 20.0},
               {"launch": twin.name, "status": "ok", "median_us": 25.0},
               {"launch": other, "status": "ok", "median_us": 30.0}]
    report = {"outcomes": [{"problem": p.name, "launch": a.name, "time_us": 20.0, "results": results}]}
    won = tune_twins.rows(report, planned)
    assert [(r["extra"], r["us"]) for r in won] == [("atomic", 20.0)]
    assert won[0]["best_without_us"] == 25.0  # the best launch that is no extra: the split-k twin
    pairs = tune_twins.atomic_pairs(report, planned)
    assert [(r["launch"], r["us"], r["twin_us"]) for r in pairs] == [(a.name, 20.0, 25.0)]


def test_a_model_tune_is_read_against_the_traced_problems():
    """--model: the problems `tune --model resnet50 --batch 32` traces (68 for the training step), each with its
    plan's atomic twins among the wgrads'."""
    pytest.importorskip("torch")
    problems = tune_twins.model_problems("resnet50", 32, True)
    assert len(problems) == 68
    wgrads = [p for p in problems if p.kind.value == "wgrad"]
    assert any(tune_twins.extra_kind(c.launch) == "atomic" for p in wgrads for c in plan_problem(p, 8).candidates)
