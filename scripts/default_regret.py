"""What the untuned plan costs, from a `tune --model ... --json` report (the GPU round's tune-model step with
TUNE_JSON=1 writes tune-model.json): per conv pass of the traced step, the time of the launch the backend runs without
a decision (`heuristics.default_launch`), against the tune's best and cuDNN's, all from the same tune run (each launch
alone, L2 flushed). A diagnostic, run on the CPU machine after the round:

    python scripts/default_regret.py tune-model.json --model torchvision:resnet50 --batch 32 [--image 224]
        [--training | --inference] [--detail] [--calibration]

The model is traced again here (fake tensors) to have each problem as an object, matched to the report by name, so
the script judges the current code's default launch too: after a change to the model (heuristics.py), it says what
the new default would have cost wherever the report timed it (a launch the report did not time counts as unknown, and
the sums say over how many passes they run). `--calibration` lists, per group of `heuristics.CALIBRATION`, the
measured time over the uncalibrated model's of every timed launch (the factors that table holds); `--detail` one line per
problem.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def problem_class(p) -> str:
    """The coarse class a pass's problem belongs to (the rows of the summary)."""
    if p.is_depthwise:
        shape = "depthwise"
    elif p.c < 8:
        shape = "stem"
    elif p.r == p.s == 1:
        shape = "1x1 s1" if p.stride_h == p.stride_w == 1 else "1x1 strided"
    else:
        shape = f"{p.r}x{p.s}" + (" s1" if p.stride_h == p.stride_w == 1 else " strided")
    return f"{p.kind.value} {shape}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="tune --model --json output (tune-model.json)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image", type=int, default=224)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--training", dest="training", action="store_true", default=True)
    mode.add_argument("--inference", dest="training", action="store_false")
    ap.add_argument("--detail", action="store_true", help="one line per problem")
    ap.add_argument("--calibration", action="store_true",
                    help="measured / modelled time per group of heuristics.CALIBRATION")
    a = ap.parse_args(argv)

    from cutlass_byoc.heuristics import (CALIBRATION, H200_SMS, _model_us, calibration_key,  # noqa: PLC0415
                                         default_launch)
    from cutlass_byoc.offload.trace import model_problems  # noqa: PLC0415
    from cutlass_byoc.profiler.plan import plan_problem  # noqa: PLC0415

    doc = json.loads(Path(a.report).read_text())
    problems, _ = model_problems(a.model, a.batch, training=a.training, image=a.image)
    by_name = {p.name: p for p in problems}
    counts = {d["problem"]: d["count"] for d in doc.get("passes", [])} or {p.name: 1 for p in problems}
    recorded_untuned = {d["problem"]: d.get("untuned") for d in doc.get("passes", [])}

    sums = defaultdict(lambda: defaultdict(float))  # class -> column -> us (count-weighted)
    passes = defaultdict(lambda: defaultdict(int))
    calib = defaultdict(list)
    missing = 0
    for o in doc["outcomes"]:
        p = by_name.get(o["problem"])
        if p is None:
            missing += 1
            continue
        k = counts.get(o["problem"], 1)
        times = {r["launch"]: r["median_us"] for r in o["results"] if r["status"] == "ok"}
        best, cudnn = o.get("time_us"), o.get("cudnn_us")
        if best is None or cudnn is None:
            continue
        now = default_launch(p)
        now_us = times.get(now.name) if now else None
        was = recorded_untuned.get(o["problem"])
        was_us = times.get(was) if was else None
        cls = problem_class(p)
        for col, v in (("cudnn", cudnn), ("tuned", best), ("graphs", min(best, cudnn)), ("untuned then", was_us),
                       ("untuned now", now_us)):
            if v is not None:
                sums[cls][col] += v * k
                passes[cls][col] += k
        if now_us is not None and was_us is not None:  # both defaults timed: a like-for-like pair
            sums[cls]["pair then"] += was_us * k
            sums[cls]["pair now"] += now_us * k
            passes[cls]["pair"] += k
        if a.detail:
            print(f"{o['problem']:<78} x{k}  cuDNN {cudnn:7.1f}  best {best:7.1f}  untuned then "
                  f"{'-' if was_us is None else f'{was_us:7.1f}'}  now {'-' if now_us is None else f'{now_us:7.1f}'}"
                  f"  {now.name if now else '-'}")
        if a.calibration:  # every launch the planner could time (a budget past any family's size), by name
            plan = {c.launch.name: c.launch for c in plan_problem(p, 1000).candidates}
            for name, us in times.items():
                launch = plan.get(name)
                if launch is not None and not launch.padded and launch.s2d == 1 and not launch.kernel.lowering:
                    calib[calibration_key(p, launch)].append(us / _model_us(p, launch, H200_SMS))

    cols = ("cudnn", "tuned", "graphs", "untuned then", "untuned now")
    print(f"{'class':<22}" + "".join(f"{c:>16}" for c in cols) + f"{'then->now (pairs)':>22}")
    total = defaultdict(float)
    total_n = defaultdict(int)
    for cls in sorted(sums):
        row = f"{cls:<22}"
        for c in cols:
            row += f"{sums[cls][c]:>10.1f} ({passes[cls][c]:>3})" if passes[cls][c] else f"{'-':>16}"
            total[c] += sums[cls][c]
            total_n[c] += passes[cls][c]
        if passes[cls]["pair"]:
            row += f"{sums[cls]['pair then']:>10.1f} -> {sums[cls]['pair now']:.1f}"
            total["pair then"] += sums[cls]["pair then"]
            total["pair now"] += sums[cls]["pair now"]
            total_n["pair"] += passes[cls]["pair"]
        print(row)
    print(f"{'all (us per step)':<22}" + "".join(f"{total[c]:>10.1f} ({total_n[c]:>3})" for c in cols)
          + (f"{total['pair then']:>10.1f} -> {total['pair now']:.1f}" if total_n["pair"] else ""))
    print("(us summed over the passes in parentheses; 'graphs': the faster of cuDNN and the tuned launch per pass, the "
          "tuned plan under CUDA graphs; 'untuned then': the default launch the report recorded; 'untuned now': this "
          "code's default, where the report timed it)")
    if missing:
        print(f"{missing} problems of the report are not in the traced model (another batch or model?)")
    if a.calibration:
        print("\nmeasured / modelled (heuristics.CALIBRATION's groups, the launches that rewrite nothing): geometric "
              "mean, median (min-max), and the factor CALIBRATION holds now")
        for key in sorted(calib, key=lambda k: (k[0].value, k[1], k[2], k[3])):
            v = calib[key]
            gm = math.exp(sum(math.log(x) for x in v) / len(v))
            fam, sched, kind, split = key
            print(f"  {fam.value:<20} {sched or '-':<16} {kind:<6} {'split' if split else '':<6} n={len(v):<4} "
                  f"geomean {gm:5.2f}  median {statistics.median(v):5.2f} ({min(v):.2f}-{max(v):.2f})  "
                  f"now {CALIBRATION.get(key, 1.0):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
