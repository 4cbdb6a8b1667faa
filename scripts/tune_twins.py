"""What the planner's extra candidates won in a tune: for each problem of a `cutlass-byoc tune --json` report (the
round's tune.json, TUNE_JSON=1) whose winner is a deep-pipeline twin (sm90.deep_twin, gemm1x1.deep_twin), an atomic
split-k twin (sm90.atomic_twin) or a whole-wave tile (gemm1x1.WAVE_TILES), its time against the best launch of the
plan without those extras, both from the same tune; then each atomic split-k launch against its split-k twin's
launch of the same slice count, won or not. A CPU-side reading of a GPU run.

    python scripts/tune_twins.py TUNE.json [--workload default] [--max-candidates 8]
    python scripts/tune_twins.py tune-model.json --model resnet50 --batch 32 [--inference]

A model's tune (the round's tune-model step, TUNE_JSON=1) is read against the problems `cutlass-byoc tune --model`
traces: tests/models.py's resnet18 / resnet50 / mobilenet_v2 (torchvision's twins) or a `pkg.module:factory` spec.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from cutlass_byoc import workloads
from cutlass_byoc.config import LaunchConfig
from cutlass_byoc.profiler import plan
from cutlass_byoc.sm90 import deterministic_twin
from cutlass_byoc.types import SplitKMode


def extra_kind(launch: LaunchConfig) -> str | None:
    """'atomic' (split_k_mode ATOMIC), 'deep' (KernelConfig.is_deep_twin), 'wave' (plan.is_wave_tile), or None: a
    launch of the families' shares."""
    if launch.kernel.split_k_mode is SplitKMode.ATOMIC:
        return "atomic"
    if launch.kernel.is_deep_twin:
        return "deep"
    return "wave" if plan.is_wave_tile(launch.kernel) else None


def rows(report: dict, planned: dict) -> list[dict]:
    """The report's problems won by an extra. `planned`: problem name -> (layer, {launch name: LaunchConfig}) of the
    plan the tune timed; the launches are the planner's configs, never parsed back from their names."""
    out = []
    for o in report["outcomes"]:
        if not o.get("launch") or o["problem"] not in planned:
            continue
        layer, launches = planned[o["problem"]]
        missing = [n for n in [o["launch"]] + [r["launch"] for r in o["results"]] if n not in launches]
        if missing:
            raise SystemExit(f"{o['problem']}: {missing[0]} is not in the plan of --workload / --max-candidates")
        kind = extra_kind(launches[o["launch"]])
        if not kind:
            continue
        rest = [r["median_us"] for r in o["results"] if r["status"] == "ok" and r.get("median_us")
                and extra_kind(launches[r["launch"]]) is None]
        out.append({"layer": layer, "extra": kind, "launch": o["launch"], "us": o["time_us"],
                    "best_without_us": min(rest) if rest else None})
    return out


def atomic_pairs(report: dict, planned: dict) -> list[dict]:
    """Each atomic split-k launch the tune timed (status ok) beside its split-k twin's launch of the same slice count:
    the same kernel but for the reduction, so their ratio is what the reduce-adds gain or lose."""
    out = []
    for o in report["outcomes"]:
        if o["problem"] not in planned:
            continue
        layer, launches = planned[o["problem"]]
        us = {r["launch"]: r["median_us"] for r in o["results"] if r["status"] == "ok" and r.get("median_us")}
        for name, t in us.items():
            launch = launches.get(name)
            if launch is None or launch.kernel.split_k_mode is not SplitKMode.ATOMIC:
                continue
            twin = LaunchConfig(deterministic_twin(launch.kernel), launch.split_k_slices, launch.pad_c, launch.pad_k,
                                launch.s2d)
            if twin.name in us:
                out.append({"layer": layer, "launch": name, "us": t, "twin_us": us[twin.name]})
    return out


def model_problems(spec: str, batch: int, training: bool) -> list:
    """The problems `cutlass-byoc tune --model SPEC --batch B [--training] --amp fp16` tunes, in its order (its report
    numbers them MODEL#i the same way)."""
    from cutlass_byoc.offload.trace import model_problems as traced  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from models import model_from_spec  # noqa: PLC0415 - tests/models.py: torchvision's twins, without torchvision

    return traced(model_from_spec(spec), batch, training=training)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report")
    ap.add_argument("--workload", default="default", help="the workload the tune ran (its plan is recomputed)")
    ap.add_argument("--max-candidates", type=int, default=plan.DEFAULT_MAX_CANDIDATES, help="the tune's budget")
    ap.add_argument("--model", default=None,
                    help="the tune was `tune --model MODEL` (its traced problems, not --workload)")
    ap.add_argument("--batch", type=int, default=32, help="with --model: the tune's batch")
    ap.add_argument("--inference", action="store_true", help="with --model: the tune traced the inference graph")
    a = ap.parse_args()
    if a.model:
        items = [(f"{a.model}#{i}", p) for i, p in enumerate(model_problems(a.model, a.batch, not a.inference))]
    else:
        items = [(it.layer, it.problem) for it in workloads.workload(a.workload)]
    planned = {p.name: (f"{layer} {p.kind.value}",
                        {c.name: c.launch for c in plan.plan_problem(p, a.max_candidates).candidates})
               for layer, p in items}
    report = json.loads(Path(a.report).read_text())
    logs = []
    for r in rows(report, planned):
        gain = r["best_without_us"] / r["us"] if r["best_without_us"] else float("nan")
        if math.isfinite(gain):
            logs.append(math.log(gain))
        print(f"{r['layer']:26s} {r['extra']:4s} {r['us']:7.2f} us, without the extras {r['best_without_us'] or math.nan:7.2f}"
              f" us ({gain:.3f}x)  {r['launch']}")
    if logs:
        print(f"{len(logs)} problems won by an extra; geomean gain {math.exp(sum(logs) / len(logs)):.3f}x")
    pairs = atomic_pairs(report, planned)
    for r in pairs:
        print(f"{r['layer']:26s} atomic {r['us']:7.2f} us, split-k twin {r['twin_us']:7.2f} us "
              f"({r['twin_us'] / r['us']:.3f}x)  {r['launch']}")
    if pairs:
        g = math.exp(sum(math.log(r["twin_us"] / r["us"]) for r in pairs) / len(pairs))
        print(f"{len(pairs)} atomic split-k launches against their split-k twins: geomean {g:.3f}x "
              f"(above 1: the reduce-adds faster)")


if __name__ == "__main__":
    main()
