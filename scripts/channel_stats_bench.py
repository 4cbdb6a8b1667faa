"""What the channel-statistics epilogue would save a training step: for each fprop problem of a model's training step
(the convs a batch norm follows), the time of one sm90 conv kernel, of its channel-statistics twin (the same
schedule, with a 128x128 tile narrowed to 128x64, also storing the per-channel sums and sums of squares of y: the
zeroing of its slots, the kernel and the sum of the slots), and of the batch-norm statistics pass it replaces
(Inductor's compiled ``var_mean(y.float(), (0, 2, 3))``, the reduction Inductor runs after every conv in a training
graph); cuDNN's conv for reference. One process, CUDA events, operands rotated past L2 (profiler.timing.time_gpu).

    python scripts/channel_stats_bench.py [--model torchvision:resnet50] [--batch 32] [--json OUT]
    python scripts/channel_stats_bench.py --configs   # the kernels it launches, one name per line (to compile ahead)

The saving per call is var_mean's time minus the twin's extra time (twin - plain: the epilogue and, on wide layers, the
narrower tile); the totals weight each problem by how often the step runs it. A diagnostic: the partitioner uses the
twins only with OffloadOptions.fuse_bn_stats.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cutlass_byoc.config import KernelConfig, LaunchConfig  # noqa: E402
from cutlass_byoc.offload import Pass  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem  # noqa: E402
from cutlass_byoc.sm90 import sm90_config  # noqa: E402


def tile_for(problem: Conv2dProblem) -> tuple[int, int, int]:
    """One fixed tile per output width (the comparison is the twin against its own plain kernel, not a tuned plan)."""
    return (128, 128, 64) if problem.k >= 128 else (128, 64, 64)


SCHEDULES = ("implicit_tma_ws", "pingpong")  # CUTLASS's non-persistent conv kernel, the project's persistent one


def pair(problem: Conv2dProblem, schedule: str) -> tuple[KernelConfig, KernelConfig] | None:
    """(plain, statistics twin) of `schedule` for `problem`, or None where the sm90 family cannot take it (the RGB stem)."""
    try:
        plain = sm90_config(problem, tile_for(problem), schedule=schedule)
    except ValueError:
        return None
    if plain.reject_reason(problem):
        return None
    twin = plain.with_channel_stats()
    return (plain, twin) if twin is not None else None


def kernels(problems) -> list[KernelConfig]:
    """Every kernel the bench launches on `problems` (the plain kernels and their twins), sorted by name."""
    return sorted({c for p in problems for s in SCHEDULES for c in (pair(p, s) or ())}, key=lambda c: c.name)


def fprop_problems(model, batch: int) -> Counter:
    """The training step's fprop problems with the number of calls of each (`model`: a spec or a module)."""
    from cutlass_byoc.offload.trace import model_problems  # noqa: PLC0415

    _, report = model_problems(model, batch, training=True)
    by_name = {p.name: p for p in report.problems}
    return Counter(by_name[e.problem] for e in report.offloaded if e.kind is Pass.FPROP and e.problem in by_name)


def bench(problems: Counter) -> list[dict]:
    import torch  # noqa: PLC0415

    from cutlass_byoc.ops import run_problem  # noqa: PLC0415
    from profiler.timing import l2_bytes, rotation_count, time_gpu  # noqa: PLC0415

    from cutlass_byoc.build import build  # noqa: PLC0415

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    rows = []
    # every kernel in one parallel build first (a missing one would otherwise compile at its first launch, one by one)
    build(list(dict.fromkeys(c for p in problems for s in SCHEDULES for c in (pair(p, s) or ()))))

    def stats_pass(y):
        return torch.var_mean(y.float(), dim=(0, 2, 3), correction=0, keepdim=True)

    for (problem, schedule), calls in ((key, n) for p, n in problems.items() for key in ((p, s) for s in SCHEDULES)):
        p = problem
        configs = pair(p, schedule)
        row = {"problem": p.name, "schedule": schedule, "calls": calls, "n": p.n, "c": p.c, "k": p.k, "hw": p.h,
               "rs": p.r, "stride": p.stride_h, "pq": p.p}
        if configs is None:
            rows.append({**row, "skipped": "no sm90 statistics twin (the sm90 family cannot take this problem)"})
            continue
        plain, twin = configs
        row.update(plain=plain.name, twin=twin.name)
        set_bytes = 2 * (p.n * p.h * p.w * p.c + p.n * p.p * p.q * p.k)
        rot = rotation_count(set_bytes, l2_bytes())
        xs = [torch.randn(p.n, p.c, p.h, p.w, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
              for _ in range(rot)]
        w = torch.randn(p.k, p.c, p.r, p.s, device="cuda", dtype=torch.float16).contiguous(memory_format=cl) * 0.05
        ys = [torch.empty(p.n, p.k, p.p, p.q, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
              for _ in range(rot)]
        st = torch.empty(2, p.k, device="cuda", dtype=torch.float32)
        lp, lt = LaunchConfig(plain), LaunchConfig(twin)
        conv = torch.nn.functional.conv2d
        stride, pad = (p.stride_h, p.stride_w), (p.pad_h, p.pad_w)
        compiled = torch.compile(stats_pass, dynamic=False)
        try:
            times = {
                "cudnn_us": time_gpu(lambda i: conv(xs[i], w, None, stride, pad), rot),
                "plain_us": time_gpu(lambda i: run_problem(p, xs[i], w, ys[i], config=lp), rot),
                "twin_us": time_gpu(lambda i: run_problem(p, xs[i], w, ys[i], config=lt, stats=st), rot),
                "var_mean_us": time_gpu(lambda i: compiled(ys[i]), rot),
            }
        except (OSError, RuntimeError, ValueError) as e:  # a kernel that does not load or launch: the row says so
            rows.append({**row, "skipped": f"{type(e).__name__}: {e}"})
            print(f"{p.name:60s} {schedule[:8]:8s} failed: {e}", flush=True)
            continue
        row.update({k: round(v.median_us, 2) for k, v in times.items()})
        row["epilogue_extra_us"] = round(row["twin_us"] - row["plain_us"], 2)
        row["saved_us"] = round(row["var_mean_us"] - row["epilogue_extra_us"], 2)
        # the twin's statistics against the y it stored (a sanity check, the GPU tests check them properly)
        run_problem(p, xs[0], w, ys[0], config=lt, stats=st)
        y = ys[0].double()
        row["stats_rel_err"] = float(((st[0].double() - y.sum((0, 2, 3))).abs().max()
                                      / y.abs().sum((0, 2, 3)).max().clamp_min(1e-30)).item())
        rows.append(row)
        print(f"{p.name:60s} {schedule[:8]:8s} x{calls:2d}  cudnn {row['cudnn_us']:7.1f}  plain {row['plain_us']:7.1f}  twin "
              f"{row['twin_us']:7.1f}  var_mean {row['var_mean_us']:6.1f}  saved {row['saved_us']:6.1f} us", flush=True)
        del xs, ys
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="torchvision:resnet50")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--configs", action="store_true", help="print the kernels it launches and stop")
    a = ap.parse_args()
    problems = fprop_problems(a.model, a.batch)
    if a.configs:
        for cfg in kernels(problems):
            print(cfg.name)
        return 0
    rows = bench(problems)
    summary = {"model": a.model, "batch": a.batch, "problems": len(problems), "per_step_us": {}}
    for schedule in SCHEDULES:
        done = [r for r in rows if "saved_us" in r and r["schedule"] == schedule]
        skipped = [r for r in rows if "saved_us" not in r and r["schedule"] == schedule]
        summary["per_step_us"][schedule] = {
            "calls": sum(r["calls"] for r in done), "skipped_calls": sum(r["calls"] for r in skipped),
            **{key: round(sum(r[key] * r["calls"] for r in done), 1)
               for key in ("cudnn_us", "plain_us", "twin_us", "var_mean_us", "epilogue_extra_us", "saved_us")}}
    print(json.dumps(summary, indent=1))
    if a.json:
        import torch  # noqa: PLC0415

        a.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                      "summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
