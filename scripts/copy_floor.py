"""The copy floor of each published bench cell: how long this GPU takes to move the cell's compulsory bytes (what the
bench's GB/s counts: `Conv2dProblem.bytes_moved`, every operand read once and the output written once) as one
device-to-device copy of half those bytes (read once, written once), timed as the bench times its calls
(`profiler.timing.time_gpu`: CUDA events, operand sets rotated through twice the L2, so nothing starts in L2).

A conv kernel moves at least those bytes, so no kernel runs a cell much below its floor, and cuDNN's time over the
floor bounds the ratio against cuDNN any kernel of ours can reach on that cell: where it is under a goal's ratio (2x
cuDNN for depthwise dgrad and wgrad, 0.9 or 1.15 for the ResNet-50 layers), the goal is out of reach of any
memory-bound kernel, not only of ours. Small cells show what a fixed launch, ramp-up and tail cost a 6-30 MB pass.

    python scripts/copy_floor.py [--bench benchmarks/h200/bench.json benchmarks/h200/bench-depthwise.json]
                                 [--json copy-floor.json]

The cells' own times (ours, cuDNN) are the published files' (another process, maybe another machine); the floors are
measured here. Round step `copy-floor` (scripts/gpu_round.sh) -> copy-floor.json, copy-floor.log.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHES = [ROOT / "benchmarks/h200/bench.json", ROOT / "benchmarks/h200/bench-depthwise.json"]
#: copy ceiling the README quotes (device-to-device copy on the H200, GB/s)
COPY_CEILING_GBS = 4200.0


def cell_bytes() -> dict[tuple[str, str], int]:
    """(layer, kind) -> compulsory bytes, from the named workloads' problems (the bench's own cells)."""
    from cutlass_byoc.workloads import workload  # noqa: PLC0415

    out = {}
    for name in ("default", "depthwise"):
        for item in workload(name):
            out[(item.layer, item.problem.kind.value)] = int(item.problem.bytes_moved)
    return out


def floor_us(nbytes: int) -> tuple[float, int]:
    """(median µs, rotations) of copying nbytes / 2 bytes device to device, operand sets rotated past the L2."""
    import torch  # noqa: PLC0415

    from cutlass_byoc.profiler.timing import l2_bytes, rotation_count, time_gpu  # noqa: PLC0415

    half = max(16, nbytes // 2 // 16 * 16)
    sets = rotation_count(2 * half, l2_bytes())
    src = [torch.empty(half, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(sets)]
    dst = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(sets)]
    stats = time_gpu(lambda i: dst[i].copy_(src[i]), sets)
    del src, dst
    return stats.median_us, sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", nargs="+", type=Path, default=BENCHES)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch  # noqa: PLC0415

    from cutlass_byoc.bench import BenchReport  # noqa: PLC0415

    if not torch.cuda.is_available():
        print("copy_floor: needs a GPU (the floors are timed)", file=sys.stderr)
        return 3
    sizes = cell_bytes()
    rows, cache, seen = [], {}, set()
    for path in args.bench:
        for r in json.loads(path.read_text())["rows"]:
            key = (r["layer"], r["kind"])
            if key in seen or key not in sizes or not r.get("ours_us") or not r.get("cudnn_us"):
                continue  # (bench.json holds bench-depthwise.json's rows too: each cell once)
            seen.add(key)
            nbytes = sizes[key]
            if nbytes not in cache:
                cache[nbytes] = floor_us(nbytes)
            f, sets = cache[nbytes]
            rows.append({
                "layer": r["layer"], "kind": r["kind"], "depthwise": bool(r.get("depthwise")),
                "resnet50": bool(r.get("resnet50")), "bytes": nbytes, "floor_us": f, "floor_gbs": nbytes / f / 1e3,
                "ours_us": r["ours_us"], "cudnn_us": r["cudnn_us"], "ratio": r["cudnn_us"] / r["ours_us"],
                "ours_of_floor": f / r["ours_us"], "cudnn_of_floor": f / r["cudnn_us"],
                "max_ratio": r["cudnn_us"] / f, "rotations": sets,
            })
    hdr = (f"{'layer':24s} {'kind':6s} {'MB':>6s} {'floor us':>8s} {'GB/s':>6s} {'ours us':>8s} {'cuDNN us':>8s} "
           f"{'ratio':>6s} {'ours/floor':>10s} {'max ratio':>9s}")
    print(f"{torch.cuda.get_device_name()}; copy floor = one device-to-device copy of half the cell's compulsory "
          f"bytes; ours/floor = floor time / our time; max ratio = cuDNN time / floor time")
    print(hdr)
    for x in rows:
        print(f"{x['layer']:24s} {x['kind']:6s} {x['bytes'] / 1e6:6.1f} {x['floor_us']:8.2f} {x['floor_gbs']:6.0f} "
              f"{x['ours_us']:8.2f} {x['cudnn_us']:8.2f} {x['ratio']:6.2f} {x['ours_of_floor']:10.2f} "
              f"{x['max_ratio']:9.2f}")
    summary = {}
    for label, sel, goal in [("resnet50", lambda x: x["resnet50"], 1.15),
                             ("depthwise fprop", lambda x: x["depthwise"] and x["kind"] == "fprop", 1.0),
                             ("depthwise dgrad", lambda x: x["depthwise"] and x["kind"] == "dgrad", 2.0),
                             ("depthwise wgrad", lambda x: x["depthwise"] and x["kind"] == "wgrad", 2.0)]:
        xs = [x for x in rows if sel(x)]
        if not xs:
            continue
        g = lambda k: BenchReport.geomean([x[k] for x in xs])  # noqa: E731
        summary[label] = {"cells": len(xs), "goal_ratio": goal, "geomean_ratio": g("ratio"),
                          "geomean_max_ratio": g("max_ratio"), "cells_max_ratio_below_goal":
                          sum(x["max_ratio"] < goal for x in xs), "geomean_ours_of_floor": g("ours_of_floor"),
                          "geomean_cudnn_of_floor": g("cudnn_of_floor")}
        s = summary[label]
        print(f"{label}: {len(xs)} cells; ratio geomean {s['geomean_ratio']:.3f}; at copy speed it would be "
              f"{s['geomean_max_ratio']:.3f} (goal {goal}; {s['cells_max_ratio_below_goal']} cells below the goal even "
              f"at copy speed); ours run at {s['geomean_ours_of_floor']:.2f} of copy speed, cuDNN at "
              f"{s['geomean_cudnn_of_floor']:.2f} (geomeans)")
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "benches": [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)
                                                     for p in args.bench],
                                         "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
