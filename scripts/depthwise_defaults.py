"""Time the depthwise family's schedules on the `depthwise` workload: what the untuned default picks against the
model's best launches of every schedule group, so the default's rule can be fitted to measurements.

    python scripts/depthwise_defaults.py [--batch 32] [--per-group 1] [--cols 3] [--winners bench-depthwise.json]
                                         [--twins] [--record] [--json OUT] [--list] [--layers NAME ...]

For each problem of the named workload `depthwise` (MobileNetV2 and EfficientNet-B0 depthwise layers, every kind)
the launches timed are: the current untuned default (`heuristics.default_launch`), the `--per-group` best launches
(`--cols` for the "cols" group) by the model (`depthwise.estimate_us`) of each schedule group (`schedule_group`:
pixel tiles through L1, staged, pipelined; "rows", "taprows", "cols", cluster split), and the launch a bench report
names for the layer and kind (`--winners`: a `cutlass-byoc bench --json` file of this workload, matched by name among
the enumerated launches) and, with `--twins`, that winner's prefetch twins where it is a "cols" kernel.
Each launch is checked once against the float64 reference, then timed as the profiler times (operands rotated past
L2, median of the runs), beside cuDNN. `--json` writes every row (problem, layer, kind, launch, group, model
estimate, measured time, cuDNN's, flags default / winner); `--list` prints the launches' kernels and stops. The
kernels the cache lacks are compiled first, in one parallel build (`--jobs`). A diagnostic: it records no decision,
unless `--record`: then each problem's fastest right launch among those timed becomes its decision in the cache (a
tune over these launches only, for `cutlass-byoc bench depthwise` to bench).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional

from cutlass_byoc import heuristics
from cutlass_byoc.config import LaunchConfig
from cutlass_byoc.depthwise import depthwise_candidates, estimate_us, is_cols, prefetch_variants, schedule_group
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.workloads import WorkloadItem, depthwise_workload


def launches(problem: Conv2dProblem) -> list[LaunchConfig]:
    """Every launch of every depthwise config that can run `problem` (each config at each of its split counts)."""
    return [launch for _, launch in heuristics.rank(problem, depthwise_candidates(problem))]


def chosen(item: WorkloadItem, per_group: int, winners: dict, cols: int = 3,
           twins: bool = False) -> list[tuple[LaunchConfig, bool, bool]]:
    """(launch, is the default, is the named winner) to time for the item, the default first: the model's
    `per_group` best of each schedule group, `cols` of the "cols" group; with `twins`, where the winner is a "cols"
    kernel, also its kernel loading one row ahead without a register cap and that one's prefetch twins
    (`depthwise.prefetch_variants`), at the winner's split count."""
    p = item.problem
    every = launches(p)
    default = heuristics.default_launch(p)
    winner_name = winners.get((item.layer, p.kind.value))
    ranked = sorted(every, key=lambda l: (estimate_us(p, l), l.name))
    picked: dict[str, LaunchConfig] = {}
    if default is not None:
        picked[default.name] = default
    counts: dict[str, int] = {}
    for launch in ranked:
        g = schedule_group(launch.kernel)
        if counts.get(g, 0) < (cols if g == "cols" else per_group):
            counts[g] = counts.get(g, 0) + 1
            picked.setdefault(launch.name, launch)
    for launch in every:
        if launch.name == winner_name:
            picked.setdefault(launch.name, launch)
            if twins and is_cols(launch.kernel):
                base = dataclasses.replace(launch.kernel, prefetch=None, min_blocks=None)
                for k in (base, *prefetch_variants(base)):
                    twin = dataclasses.replace(launch, kernel=k)
                    if twin.reject_reason(p) is None:
                        picked.setdefault(twin.name, twin)
    return [(l, default is not None and l.name == default.name, l.name == winner_name) for l in picked.values()]


def load_winners(path: Optional[str]) -> dict:
    if not path:
        return {}
    with open(path) as f:
        rows = json.load(f)["rows"]
    return {(r["layer"], r["kind"]): r["launch"] for r in rows if r.get("launch")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--per-group", type=int, default=1, help="the model's best launches timed per schedule group")
    ap.add_argument("--cols", type=int, default=3, help="... and of the \"cols\" group")
    ap.add_argument("--winners", default=None, help="a bench --json report of the depthwise workload")
    ap.add_argument("--twins", action="store_true",
                    help="also each \"cols\" winner's prefetch twins (at one row ahead, PREFETCH_ROWS and deep)")
    ap.add_argument("--layers", nargs="+", default=None, help="only these layers (bench's layer names)")
    ap.add_argument("--record", action="store_true",
                    help="record each problem's fastest right launch of those timed as its decision in the cache (a "
                         "tune restricted to these launches; `cutlass-byoc bench depthwise` then benches them)")
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles of the kernels the cache lacks")
    ap.add_argument("--list", action="store_true", help="print the kernels the launches need and stop")
    args = ap.parse_args(argv)
    winners = load_winners(args.winners)
    items = [it for it in depthwise_workload(batch=args.batch) if not args.layers or it.layer in args.layers]
    plan = [(it, chosen(it, args.per_group, winners, args.cols, args.twins)) for it in items]
    if args.list:
        for k in dict.fromkeys(l.kernel for _, ls in plan for l, _, _ in ls):
            print(k.name)
        return 0

    import torch  # noqa: PLC0415

    from cutlass_byoc.bench import check_and_time  # noqa: PLC0415
    from cutlass_byoc.build import build  # noqa: PLC0415
    from cutlass_byoc.decisions import record_decision  # noqa: PLC0415
    from cutlass_byoc.profiler.timing import time_gpu  # noqa: PLC0415
    from cutlass_byoc.profiler.verify import cudnn_fn  # noqa: PLC0415
    from cutlass_byoc.profiler.worker import WorkerSettings, make_problem_sets  # noqa: PLC0415

    # every kernel in one parallel build first (a kernel the cache lacks would otherwise compile at its first launch)
    kernels = list(dict.fromkeys(l.kernel for _, ls in plan for l, _, _ in ls))
    failed = [c.name for c, r in build(kernels, jobs=args.jobs).items() if not r.ok]
    print(f"{len(kernels)} kernels, {len(failed)} failed to build: {failed[:5]}", flush=True)
    ws = WorkerSettings()
    rows = []
    for item, picks in plan:
        p = item.problem
        sets, ref = make_problem_sets(p, ws)
        cudnn_us = time_gpu(cudnn_fn(p, sets), len(sets), ws.timing).median_us
        print(f"== {item.layer} {p.kind.value}: cuDNN {cudnn_us:.1f} us", flush=True)
        timed = []  # (us, max error, launch) of the right ones
        for launch, is_default, is_winner in picks:
            time_us, err, status = check_and_time(p, launch, sets, ref, ws.timing)
            if status == "ok":
                timed.append((time_us, err, launch))
            row = dict(problem=p.name, layer=item.layer, kind=p.kind.value, launch=launch.name,
                       group=schedule_group(launch.kernel), estimate_us=estimate_us(p, launch),
                       model_us=heuristics.estimate_us(p, launch), default=is_default, winner=is_winner,
                       cudnn_us=cudnn_us, time_us=time_us, status=status)
            rows.append(row)
            t = f"{row['time_us']:8.1f}" if row["time_us"] else f"{'-':>8}"
            flags = ("D" if is_default else " ") + ("W" if is_winner else " ")
            print(f"{t} {row['estimate_us']:8.1f} {flags} {row['group']:8} {launch.name}"
                  + ("" if row["status"] == "ok" else f"  {row['status']}"), flush=True)
        if args.record and timed:
            timed.sort(key=lambda t: t[0])
            (us, err, best), runner = timed[0], (timed[1] if len(timed) > 1 else None)
            record_decision(p, best, us, candidates_timed=len(timed), runner_up=runner and runner[2].name,
                            runner_up_us=runner and runner[0], max_error=err, cudnn_us=cudnn_us)
            print(f"   recorded {best.name} ({us:.1f} us)", flush=True)
        del sets, ref
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
