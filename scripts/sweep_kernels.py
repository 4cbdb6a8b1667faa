"""Every kernel of a family on the default workload's ResNet-50 cells, timed and verified like the profiler's
candidates, against cuDNN: how far the tuner's budget of 8 kernels per problem is from the family's best, and how far
the family's best is from cuDNN. A diagnostic (like time_launches.py), run by `scripts/gpu_round.sh sweep`.

    python scripts/sweep_kernels.py build [--jobs N] [--layers 1x1 3x3]   # compile (a CPU machine does)
    python scripts/sweep_kernels.py time OUT.json [--layers ...]          # time on the GPU: the kernels in the cache
    python scripts/sweep_kernels.py cudnn-kernels OUT.json                # cuDNN's kernels per cell (torch.profiler)
    python scripts/sweep_kernels.py replay OUT.json [--max-candidates 8]  # the tuner's plan against a time run (CPU)

The cells: stride-1 1x1 layers (all three kinds) on the GEMM 1x1 family, stride-1 3x3 layers on the 3.x conv family.
`time` skips kernels the cache lacks (it compiles nothing unless --build); each cell's rows are sorted fastest first
and the JSON is rewritten after every cell, so a run cut short keeps what it measured. --profile adds the kernel time
alone (torch.profiler, no launch around it) of each cell's best launch and of cuDNN's call. Unlike the tuner it runs
every launch in this process (no crash isolation): a kernel that faults or hangs ends the run.

`cudnn-kernels` lists, for every cell of the default and depthwise workloads, the kernels cuDNN launches (name, GPU
microseconds per call from torch.profiler, launches per call), and for the stride-1 1x1 cells cuBLAS's time of the
same GEMM (torch.mm) on rotated operands, timed like the candidates.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import time
from pathlib import Path

from cutlass_byoc import workloads
from cutlass_byoc.build import build, prepare
from cutlass_byoc.cache import EntryState, KernelCache
from cutlass_byoc.profiler import plan
from cutlass_byoc.types import KernelFamily, SourceKind

#: filter size -> the family swept on those cells
FAMILY_OF = {"1x1": KernelFamily.SM90_GEMM_1X1, "3x3": KernelFamily.SM90_TMA_WGMMA}
LAUNCHES_PER_KERNEL = 2  # the model's best split-k counts of each kernel


def cells(layers, kinds):
    for it in workloads.default_workload():
        p = it.problem
        if it.resnet50 and p.stride_h == 1 and f"{p.r}x{p.s}" in layers and p.kind.value in kinds:
            yield it


def sourceless_twins(problem, kernels):
    """The sourceless twin (KernelConfig.sourceless) of each 3.x kernel in `kernels` that has one, for a problem
    without an epilogue source (none otherwise)."""
    if problem.epilogue.source is not SourceKind.NONE:
        return []
    out = []
    for k in kernels:
        if k.family in (KernelFamily.SM90_GEMM_1X1, KernelFamily.SM90_TMA_WGMMA) and not k.sourceless:
            try:
                out.append(dataclasses.replace(k, sourceless=True))
            except ValueError:
                pass
    return out


def kernels_of(problem, extra=(), sourceless=False, deep=False, with_sm90=False, store_stages=False,
               tiles_only=False):
    """The family's valid kernels for `problem`, plus GEMM 1x1 configs of the `extra` (tile, schedule, sourceless,
    cluster, epilogue sub-tile or None, D buffers: None, 0 for one per sub-tile, or a count) tuples (tiles outside
    cutlass_library's list, to try before adding them to the family's candidates); with `sourceless`, each 3.x
    kernel's sourceless twin too (sourceless_twins); with `deep`, each kernel's twin of more pipeline stages than the
    families' cap (plan.deep_twin); with `with_sm90`, the 3.x conv family's kernels on the 1x1 cells too (their wgrad
    winners are mostly its split-k kernels); with `store_stages`, each sourceless GEMM 1x1 kernel's twin with one D
    buffer per epilogue sub-tile (gemm1x1.with_store_stages). `tiles_only`: the `extra` configs (and the twins
    asked for) without the family's kernels, e.g. to compile no more than a sweep of a few tiles times (the time
    command times what the cache holds)."""
    family = FAMILY_OF[f"{problem.r}x{problem.s}"]
    valid, _ = plan.enumerate_kernels(problem)
    out = [] if tiles_only else \
        [k for k in valid if k.family is family or (with_sm90 and k.family is KernelFamily.SM90_TMA_WGMMA)]
    if family is KernelFamily.SM90_GEMM_1X1:
        from cutlass_byoc.gemm1x1 import gemm1x1_config, with_epilogue_tile, with_store_stages  # noqa: PLC0415

        for tile, schedule, nosrc, cluster, epi, stores in extra:
            if nosrc and problem.epilogue.source is not SourceKind.NONE:
                continue
            try:
                k = gemm1x1_config(problem, tile, schedule, cluster, sourceless=nosrc)
                k = with_epilogue_tile(k, epi) if epi else k
                k = with_store_stages(k, stores or None) if stores is not None else k
            except ValueError as e:
                print(f"{problem.name}: {tile} {schedule}: {e}")
                continue
            if k not in out:
                out.append(k)
    out += sourceless_twins(problem, out) if sourceless else []
    if store_stages:
        from cutlass_byoc.gemm1x1 import store_stages_twin  # noqa: PLC0415

        out += [t for t in map(store_stages_twin, out) if t is not None and t.reject_reason(problem) is None]
    if deep:
        out += [t for t in map(plan.deep_twin, out) if t is not None and t.reject_reason(problem) is None]
    return list(dict.fromkeys(out))


def parse_tile(text: str):
    """"192x64x64:pingpong" -> ((192, 64, 64), "pingpong", False, (1, 1, 1), None); ":nosrc" asks for the kernel
    without an epilogue source (e.g. "256x64x64:pingpong:nosrc"), for the cells whose epilogue has none; ":c1x2x1" a
    thread-block cluster (e.g. "192x64x64:pingpong:nosrc:c2x1x1"); ":e64x64" the TMA epilogue's sub-tile
    (KernelConfig.epi_tile, e.g. "192x64x64:pingpong:nosrc:e64x64"); ":sd" one D buffer per epilogue sub-tile,
    ":sd4" four (KernelConfig.epi_stages; sourceless kernels, e.g. "192x64x64:pingpong:nosrc:sd"), the last element
    (None without it, 0 for ":sd")."""
    tile, schedule, *more = text.split(":")
    cluster = next((tuple(int(x) for x in m[1:].split("x")) for m in more if m.startswith("c")), (1, 1, 1))
    epi = next((tuple(int(x) for x in m[1:].split("x")) for m in more if m.startswith("e")), None)
    stores = next((int(m[2:] or 0) for m in more if m.startswith("sd")), None)
    return tuple(int(x) for x in tile.split("x")), schedule, "nosrc" in more, cluster, epi, stores


def kernel_times(fn, calls: int = 5) -> list:
    """[name, GPU us per call, launches per call] of each kernel `fn(i)` runs, by torch.profiler, longest first."""
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    for i in range(3):  # module loads, cudnn.benchmark's search and the workspace first
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i)
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time / calls
            per[e.name][1] += 1
    return sorted(([n, round(us, 2), c // calls] for n, (us, c) in per.items()), key=lambda r: -r[1])


def cmd_build(args) -> None:
    kernels = {k.name: k for it in cells(args.layers, args.kinds)
               for k in kernels_of(it.problem, args.tiles, args.sourceless, args.deep, args.with_sm90,
                                         args.store_stages)}
    t0 = time.time()
    res = build(list(kernels.values()), jobs=args.jobs, cache=KernelCache(), progress=True)
    print(f"{sum(r.ok for r in res.values())} of {len(res)} kernels in the cache ({time.time() - t0:.0f} s)")


def cmd_time(args) -> None:
    import torch  # noqa: PLC0415

    from cutlass_byoc.profiler.worker import (WorkerSettings, _time_baseline,  # noqa: PLC0415
                                              evaluate_candidate, make_problem_sets)

    cache, settings, out, t0 = KernelCache(), WorkerSettings(), [], time.time()
    for it in cells(args.layers, args.kinds):
        p = it.problem
        kernels = kernels_of(p, args.tiles, args.sourceless, args.deep, args.with_sm90, args.store_stages)
        if args.build:
            build(kernels, cache=cache, progress=False)
        sets, ref = make_problem_sets(p, settings)
        cudnn_us = _time_baseline(p, sets, settings)
        rows, timed = [], {}  # timed: launch name -> the launch
        for k in kernels:
            if cache.lookup(prepare(k)[1]).state is not EntryState.OK:
                rows.append({"launch": k.name, "us": None, "status": "not compiled", "estimate_us": None})
                continue
            for est, launch in plan.launches_for(p, k)[:LAUNCHES_PER_KERNEL]:
                timed[launch.name] = launch
                r = evaluate_candidate(p, launch, sets, ref, settings.timing)
                rows.append({"launch": launch.name, "us": r.median_us, "status": r.status, "estimate_us": est,
                             "message": r.message[:200]})
        rows.sort(key=lambda r: r["us"] if r["status"] == "ok" else float("inf"))
        out.append({"layer": it.layer, "kind": p.kind.value, "cudnn_us": cudnn_us, "rows": rows})
        best = rows[0] if rows and rows[0]["status"] == "ok" else None
        if args.profile and best:
            # kernel time alone (torch.profiler) of the best launch and of cuDNN, without the launch around it
            from cutlass_byoc.ops import run_problem  # noqa: PLC0415
            from cutlass_byoc.profiler.verify import cudnn_fn  # noqa: PLC0415

            launch, n = timed[best["launch"]], len(sets)

            def run(i: int) -> None:
                s = sets[i % n]
                run_problem(p, s.a, s.b, s.out, s.source, config=launch, bias=s.bias)

            out[-1]["best_kernels"] = kernel_times(run)
            torch.backends.cudnn.benchmark = True
            cudnn = cudnn_fn(p, sets)
            out[-1]["cudnn_kernels"] = kernel_times(lambda i: cudnn(i % n))
            print(f"          kernels alone: ours {sum(k[1] for k in out[-1]['best_kernels']):.1f} us, cuDNN "
                  f"{sum(k[1] for k in out[-1]['cudnn_kernels']):.1f} us ({out[-1]['cudnn_kernels'][0][0][:60]})")
        print(f"{time.time() - t0:6.1f} s  {it.layer:18s} {p.kind.value}  cuDNN {cudnn_us or float('nan'):6.1f} us  "
              f"best {best['us'] if best else float('nan'):6.1f} us  {best['launch'] if best else '-'}", flush=True)
        del sets, ref
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(out, indent=1))


def cmd_cudnn_kernels(args) -> None:
    import torch  # noqa: PLC0415

    from cutlass_byoc.gemm1x1 import lowered_gemm_mnk  # noqa: PLC0415
    from cutlass_byoc.profiler.timing import l2_bytes, rotation_count, time_gpu  # noqa: PLC0415
    from cutlass_byoc.profiler.verify import cudnn_fn, make_operand_set  # noqa: PLC0415

    torch.backends.cudnn.benchmark = True
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    out = []
    for it in list(workloads.default_workload()) + list(workloads.depthwise_workload()):
        p = it.problem
        sets = [make_operand_set(p, torch.device("cuda"), gen) for _ in range(4)]
        fn = cudnn_fn(p, sets)
        row = {"layer": it.layer, "kind": p.kind.value, "kernels": kernel_times(lambda i: fn(i % len(sets)))}
        if p.r == 1 and p.s == 1 and p.stride_h == 1 and p.groups == 1:
            m, n, k = lowered_gemm_mnk(p)
            wgrad = p.kind.value == "wgrad"
            rot = rotation_count(2 * (m * k + k * n + m * n), l2_bytes())  # past L2, as the candidates
            a = [torch.randn((k, m) if wgrad else (m, k), device="cuda", dtype=torch.half) for _ in range(rot)]
            b = [torch.randn(k, n, device="cuda", dtype=torch.half) for _ in range(rot)]
            row["gemm_mnk"] = [m, n, k]
            row["cublas_us"] = time_gpu(lambda i: torch.mm(a[i % rot].t() if wgrad else a[i % rot], b[i % rot]),
                                        rot).median_us
            del a, b
        out.append(row)
        print(f"{it.layer:24s} {p.kind.value}  " + "; ".join(f"{n[:70]} {us} us" for n, us, _ in row["kernels"][:2]),
              flush=True)
        del sets
    Path(args.out).write_text(json.dumps(out, indent=1))


def replay(sweep: list, max_candidates: int = plan.DEFAULT_MAX_CANDIDATES) -> list[dict]:
    """For each cell of a `time` run's JSON: the best time among the launches the tuner's plan would time (those the
    sweep timed), against the sweep's best. Rows: layer, kind, plan_us, best_us, planned (how many of the plan's
    launches the sweep timed). The sweep covers one family per cell, so the plan's launches of other families
    (2.x, the other 3.x family) do not count."""
    problems = {(it.layer, it.problem.kind.value): it.problem for it in workloads.default_workload()}
    out = []
    for cell in sweep:
        p = problems[(cell["layer"], cell["kind"])]
        timed = {r["launch"]: r["us"] for r in cell["rows"] if r["status"] == "ok" and r["us"]}
        if not timed:
            continue
        got = [timed[c.name] for c in plan.plan_problem(p, max_candidates).candidates if c.name in timed]
        out.append({"layer": cell["layer"], "kind": cell["kind"], "plan_us": min(got) if got else None,
                    "best_us": min(timed.values()), "planned": len(got)})
    return out


def cmd_replay(args) -> None:
    rows = replay(json.loads(Path(args.sweep).read_text()), args.max_candidates)
    logs = []
    for r in rows:
        ratio = r["best_us"] / r["plan_us"] if r["plan_us"] else float("nan")
        if r["plan_us"]:
            logs.append(math.log(ratio))
        print(f"{r['layer']:18s} {r['kind']}  plan's best {r['plan_us'] or float('nan'):6.1f} us  sweep's best "
              f"{r['best_us']:6.1f} us  ({ratio:.3f}; {r['planned']} of the plan's launches swept)")
    if logs:
        print(f"geomean sweep's best / plan's best over {len(logs)} cells: {math.exp(sum(logs) / len(logs)):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--jobs", "-j", type=int, default=None)
    t = sub.add_parser("time")
    t.add_argument("out")
    t.add_argument("--build", action="store_true", help="compile the cache's missing kernels first")
    t.add_argument("--profile", action="store_true",
                   help="also the kernel time alone (torch.profiler) of each cell's best launch and of cuDNN")
    c = sub.add_parser("cudnn-kernels")
    c.add_argument("out")
    r = sub.add_parser("replay", help="what the tuner's plan would have found among a time run's launches (CPU)")
    r.add_argument("sweep", help="a `time` run's JSON")
    r.add_argument("--max-candidates", type=int, default=plan.DEFAULT_MAX_CANDIDATES)
    for s in (b, t):
        s.add_argument("--layers", nargs="+", default=sorted(FAMILY_OF), choices=sorted(FAMILY_OF))
        s.add_argument("--kinds", nargs="+", default=["fprop", "dgrad", "wgrad"], choices=["fprop", "dgrad", "wgrad"])
        s.add_argument("--sourceless", action="store_true",
                       help="also the sourceless twin of each 3.x kernel (cells without an epilogue source)")
        s.add_argument("--deep", action="store_true",
                       help="also each 3.x kernel's twin of more pipeline stages than the families' cap (plan.deep_twin)")
        s.add_argument("--with-sm90", action="store_true",
                       help="on the 1x1 cells, the 3.x conv family's kernels too (its split-k wgrad kernels)")
        s.add_argument("--store-stages", action="store_true",
                       help="also each sourceless GEMM 1x1 kernel's twin with one epilogue D buffer per sub-tile "
                            "(KernelConfig.epi_stages)")
        s.add_argument("--tiles", nargs="+", type=parse_tile, default=[],
                       metavar="MxNxK:SCHEDULE[:nosrc][:cMxNx1][:eMxN][:sd[N]]",
                       help="GEMM 1x1 configs to add to the family's (e.g. 192x64x64:pingpong, 256x64x64:pingpong:nosrc)")
    args = ap.parse_args()
    {"build": cmd_build, "time": cmd_time, "cudnn-kernels": cmd_cudnn_kernels, "replay": cmd_replay}[args.cmd](args)


if __name__ == "__main__":
    main()
