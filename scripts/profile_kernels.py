#!/usr/bin/env python3
"""Where a launch's time goes on the GPU: each kernel's own duration (torch.profiler's CUDA activity) for the
depthwise-workload layers named, for every candidate launch of the model whose name contains one of the given
substrings, next to cuDNN's kernels for the same problem. A diagnostic for the GPU round (bench times the whole
call between CUDA events; this splits it into kernels).

    python scripts/profile_kernels.py --layers mbv2_dw_960_7 effb0_dw_1152_7 --kinds wgrad --match rows4 smem
    ncu --clock-control none --section SpeedOfLight python scripts/profile_kernels.py --layers mbv2_dw_144_56 \
        --kinds fprop --decided --iters 1
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if (ROOT / "cutlass_byoc").is_dir() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="depthwise")
    ap.add_argument("--layers", nargs="+", required=True)
    ap.add_argument("--kinds", nargs="+", default=["wgrad"])
    ap.add_argument("--match", nargs="+", default=None,
                    help="launch-name substrings; the model's best of each (with --decided / --winners: besides those)")
    ap.add_argument("--decided", action="store_true",
                    help="the launch the decision cache holds for each problem (after `tune`), not --match's")
    ap.add_argument("--winners", default=None,
                    help="a bench --json report of the workload: each problem's published launch, not --match's (with "
                         "--cluster-twins also that launch's cluster-split twin at each of its split counts)")
    ap.add_argument("--cluster-twins", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--plain", action="store_true",
                    help="run each launch --iters times without torch.profiler (under ncu, which owns the counters)")
    a = ap.parse_args(argv)

    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    from cutlass_byoc.build import build  # noqa: PLC0415
    from cutlass_byoc.gemm1x1 import im2col_candidates  # noqa: PLC0415
    from cutlass_byoc.profiler.plan import enumerate_kernels, launches_for  # noqa: PLC0415
    from cutlass_byoc.ops import run_problem  # noqa: PLC0415
    from cutlass_byoc.profiler.verify import cudnn_fn  # noqa: PLC0415
    from cutlass_byoc.profiler.worker import WorkerSettings, make_problem_sets  # noqa: PLC0415
    from cutlass_byoc.workloads import named_workload  # noqa: PLC0415

    items = [i for i in named_workload(a.workload) if i.layer in a.layers and i.problem.kind.value in a.kinds]
    for item in items:
        p = item.problem
        valid, _ = enumerate_kernels(p, 90)
        valid += list(im2col_candidates(p))  # the GEMM family's im2col lowering (planned on a budget of its own)
        launches = []
        if a.decided:
            from cutlass_byoc.select import choose  # noqa: PLC0415

            decided = choose(p, "cached")
            launches += [decided] if decided is not None else []
        if a.winners:
            from depthwise_defaults import launches as depthwise_launches, load_winners  # noqa: PLC0415

            from cutlass_byoc.depthwise import cluster_variant  # noqa: PLC0415

            name = load_winners(a.winners).get((item.layer, p.kind.value))
            won = [lc for lc in depthwise_launches(p) if lc.name == name]
            launches += won
            twin = cluster_variant(won[0].kernel) if won and a.cluster_twins else None
            if twin is not None:
                launches += [lc for _, lc in launches_for(p, twin)]
        for m in a.match or ([] if (a.decided or a.winners) else [""]):  # the model's best launch among the kernels whose name contains m
            ranked = [launches_for(p, k) for k in valid if m in k.name]
            best = [ls[0] for ls in ranked if ls]
            if best:
                launches.append(min(best, key=lambda t: t[0])[1])
        build([lc.kernel for lc in launches], progress=False)
        sets, _ = make_problem_sets(p, WorkerSettings())
        runs = [("cudnn", cudnn_fn(p, sets))]
        for lc in launches:
            def fn(i, lc=lc):
                s = sets[i]
                run_problem(p, s.a, s.b, s.out, s.source, config=lc, bias=s.bias)
            runs.append((lc.name, fn))
        print(f"== {item.layer} {p.kind.value} ({p.bytes_moved / 1e6:.1f} MB compulsory)")
        for name, fn in runs:
            if a.plain:
                for i in range(a.iters):
                    fn(i % len(sets))
                torch.cuda.synchronize()
                print(f"  {name}: {a.iters} calls")
                continue
            for i in range(3):
                fn(i % len(sets))
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(a.iters):
                    fn(i % len(sets))
                torch.cuda.synchronize()
            per = collections.defaultdict(float)
            spans = []  # (start, end) of each kernel, us
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    per[e.name] += e.device_time / a.iters if hasattr(e, "device_time") else e.cuda_time / a.iters
                    spans.append((e.time_range.start, e.time_range.end))
            total = sum(per.values())
            # GPU time per call from its first kernel's start to its last one's end (a programmatic dependent launch
            # overlaps its predecessor, so the kernels' sum can exceed it): every call launches the same kernels
            spans.sort()
            per_call = max(1, len(spans) // a.iters)
            calls = [max(e for _, e in spans[i:i + per_call]) - spans[i][0] for i in range(0, len(spans), per_call)]
            span = sorted(calls)[len(calls) // 2] if calls else float("nan")
            print(f"  {name}: {total:.1f} us of kernels per call, {span:.1f} us first start to last end (median)")
            for k, us in sorted(per.items(), key=lambda kv: -kv[1])[:6]:
                print(f"      {us:8.1f} us  {k[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
