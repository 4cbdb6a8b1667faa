"""What the planner's extra candidates won in a tune: for each problem of a `cutlass-byoc tune --json` report (the
round's tune.json, TUNE_JSON=1) whose winner is a deep-pipeline twin (sm90.deep_twin, gemm1x1.deep_twin) or a
whole-wave tile (gemm1x1.WAVE_TILES), its time against the best launch of the plan without those extras, both
from the same tune. A CPU-side reading of a GPU run.

    python scripts/tune_twins.py TUNE.json [--workload default]
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from cutlass_byoc import workloads
from cutlass_byoc.gemm1x1 import WAVE_TILES

_STAGES = re.compile(r"_s(\d+)_")
_WAVE = tuple(f"_{m}x{n}x{k}_" for m, n, k in WAVE_TILES)


def extra_kind(launch: str) -> str | None:
    """'deep' (a 3.x kernel past the families' cap of 8 stages), 'wave' (a GEMM 1x1 whole-wave tile), or None."""
    if launch.startswith(("cb_sm90_", "cb_gemm1x1_")):
        m = _STAGES.search(launch)
        if m and int(m.group(1)) > 8:
            return "deep"
    if launch.startswith("cb_gemm1x1_") and any(t in launch for t in _WAVE):
        return "wave"
    return None


def rows(report: dict, layers: dict) -> list[dict]:
    out = []
    for o in report["outcomes"]:
        kind = extra_kind(o.get("launch") or "")
        if not kind:
            continue
        ok = [r for r in o["results"] if r["status"] == "ok" and r.get("median_us")]
        rest = [r["median_us"] for r in ok if extra_kind(r["launch"]) is None]
        out.append({"layer": layers.get(o["problem"], o["problem"]), "extra": kind, "launch": o["launch"],
                    "us": o["time_us"], "best_without_us": min(rest) if rest else None})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report")
    ap.add_argument("--workload", default="default")
    a = ap.parse_args()
    layers = {it.problem.name: f"{it.layer} {it.problem.kind.value}" for it in workloads.workload(a.workload)}
    logs = []
    for r in rows(json.loads(Path(a.report).read_text()), layers):
        gain = r["best_without_us"] / r["us"] if r["best_without_us"] else float("nan")
        if math.isfinite(gain):
            logs.append(math.log(gain))
        print(f"{r['layer']:26s} {r['extra']:4s} {r['us']:7.2f} us, without the extras {r['best_without_us'] or math.nan:7.2f}"
              f" us ({gain:.3f}x)  {r['launch']}")
    if logs:
        print(f"{len(logs)} problems won by an extra; geomean gain {math.exp(sum(logs) / len(logs)):.3f}x")


if __name__ == "__main__":
    main()
