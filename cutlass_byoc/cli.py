"""`cutlass-byoc`: tune a workload, benchmark it against cuDNN, manage the kernel and decision caches.

Exit codes:
  0  done
  1  unexpected internal error (the traceback is shown with -v)
  2  bad usage or input (arguments, workload file, problem, a cache root others can write); the message names
     the field or the path
  3  a GPU is needed and none is visible (tune still plans and compiles; bench cannot run)
  4  the toolchain is missing (nvcc or the CUTLASS headers); the message says what to install
  5  some problems got no working kernel (tune), or some rows failed (bench); see the table and the tuning log
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from .trust import TRUST_ENV, UntrustedCacheError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NO_GPU, EXIT_TOOLCHAIN, EXIT_PARTIAL = 0, 1, 2, 3, 4, 5

log = logging.getLogger("cutlass_byoc.cli")


class UsageError(Exception):
    """Bad arguments or input: exit code 2."""


# ---------------------------------------------------------------------------------------------- arguments
def _common(sub: bool = False) -> argparse.ArgumentParser:
    """Options every command takes, before or after the command name. On subcommands their defaults are
    suppressed, so a value given before the command is not reset by the subcommand's default."""
    c = argparse.ArgumentParser(add_help=False)
    d = (lambda v: argparse.SUPPRESS) if sub else (lambda v: v)  # noqa: E731
    c.add_argument("-v", "--verbose", action="count", default=d(0), help="more logging (-vv: debug)")
    c.add_argument("--jobs", "-j", type=int, default=d(None), help="parallel compiles (default: all cores)")
    c.add_argument("--arch", type=int, default=d(90), choices=[90], help="target SM (kernels are built for sm_90a)")
    c.add_argument("--max-candidates", type=int, default=d(None),
                   help="kernels timed per problem, best-ranked by the model (default 8; depthwise problems: "
                        "three times as many, profiler.plan.DEPTHWISE_BUDGET_FACTOR)")
    c.add_argument("--cache-dir", default=d(None),
                   help="cache root (default: $CUTLASS_BYOC_CACHE_DIR or the user cache dir)")
    c.add_argument("--trust-cache-dir", action="store_true", default=d(False),
                   help="accept a cache root owned by another user or writable by others, on purpose (a shared "
                        "fleet cache); the same as CUTLASS_BYOC_TRUST_CACHE_DIR=1")
    return c


def _problem_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", nargs="?",
                   help="JSON workload file, or a named workload: default (ResNet-50, the default), depthwise "
                        "(MobileNetV2 and EfficientNet-B0 depthwise layers) or all")
    g = p.add_argument_group("one problem from flags (instead of a workload)")
    g.add_argument("--kind", choices=["fprop", "dgrad", "wgrad", "all"], default=None)
    for name in ("n", "c", "h", "w", "k", "r", "s"):
        g.add_argument(f"--{name}", type=int, default=None)
    g.add_argument("--stride", type=int, default=1)
    g.add_argument("--padding", type=int, default=None, help="default: r // 2")
    g.add_argument("--dilation", type=int, default=1)
    g.add_argument("--groups", type=int, default=1)
    g.add_argument("--dtype", default="f16", choices=["f16", "bf16", "f32"])
    g.add_argument("--out-dtype", default=None, choices=["f16", "bf16", "f32"])
    p.add_argument("--batch", type=int, default=32, help="batch of the embedded workload or --model (default 32)")
    p.add_argument("--kinds", default="fprop,dgrad,wgrad", help="kinds of the embedded workload")
    m = p.add_argument_group("the convs of a model, as the torch.compile backend partitions them")
    m.add_argument("--model", default=None, metavar="SPEC",
                   help="torchvision:resnet50, timm:NAME or package.module:factory (a user's own model)")
    mode = m.add_mutually_exclusive_group()
    mode.add_argument("--training", dest="training", action="store_true", default=True,
                      help="forward and backward (fprop, dgrad, wgrad; the default)")
    mode.add_argument("--inference", dest="training", action="store_false", help="forward only")
    m.add_argument("--amp", choices=["fp16", "bf16", "none"], default="fp16", help="autocast dtype (default fp16)")
    m.add_argument("--image", type=int, default=224, help="input height and width (default 224)")


def build_parser() -> argparse.ArgumentParser:
    common, sub_common = _common(), _common(sub=True)
    ap = argparse.ArgumentParser(
        prog="cutlass-byoc", parents=[common],
        description="conv2d on generated, profiled and cached CUTLASS kernels",
        epilog="exit codes: 0 ok, 1 internal error, 2 bad input, 3 needs a GPU, 4 toolchain missing, 5 partial",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{tune,bench,cache}")

    t = sub.add_parser("tune", parents=[sub_common], help="plan, compile, time and record the best kernel per problem")
    _problem_args(t)
    t.add_argument("--force", action="store_true", help="re-time problems that already have a decision")
    t.add_argument("--compile-only", action="store_true", help="stop after compiling, even with a GPU")
    t.add_argument("--time-after-build", action="store_true",
                   help="time only once every kernel is compiled (default: each problem as soon as its kernels are, "
                        "while the rest compile at lower CPU priority)")
    t.add_argument("--gpus", default=None, metavar="all|0,1",
                   help="time on these GPUs of this host, one worker each (all the same GPU model); the compile "
                        "step is shared. Default: the current device")
    t.add_argument("--json", dest="json_out", default=None, help="write the tuning report as JSON here")
    t.add_argument("--in-step", action="store_true",
                   help="with --model, after the tune: time each offloaded pass inside the model's compiled step, on "
                        "its tuned kernel and on cuDNN, and record both in its decision; where both are recorded they "
                        "decide which of the two the backend runs (needs the GPU, a minute or two)")
    t.add_argument("--no-progress", action="store_true")

    b = sub.add_parser("bench", parents=[sub_common], help="time the chosen kernels against cuDNN")
    _problem_args(b)
    b.add_argument("--format", choices=["table", "json", "csv"], default="table", help="what goes to stdout")
    b.add_argument("--split-k", action="store_true",
                   help="for the wgrad layers: best split-k vs best unsplit launch vs cuDNN, timed in one run")
    b.add_argument("--json", dest="json_out", default=None, help="also write JSON here")
    b.add_argument("--csv", dest="csv_out", default=None, help="also write CSV here")
    b.add_argument("--plot", default=None, help="bar chart of the ratios (PNG; needs matplotlib)")
    b.add_argument("--no-progress", action="store_true")

    c = sub.add_parser("cache", parents=[sub_common], help="list, show, clear, export or import the caches")
    csub = c.add_subparsers(dest="cache_cmd", required=True, metavar="{list,show,clear,export,import}")
    cl = csub.add_parser("list", parents=[sub_common], help="decisions (and with --kernels, compiled kernels)")
    cl.add_argument("--kernels", action="store_true")
    cs = csub.add_parser("show", parents=[sub_common], help="one decision or kernel by (a prefix of) its key")
    cs.add_argument("key")
    cc = csub.add_parser("clear", parents=[sub_common], help="delete decisions, kernels or both")
    grp = cc.add_mutually_exclusive_group()
    grp.add_argument("--decisions", action="store_true", help="decisions only")
    grp.add_argument("--kernels", action="store_true", help="compiled kernels only")
    ce = csub.add_parser("export", parents=[sub_common], help="decisions and their kernels into a .tar.gz")
    ce.add_argument("path")
    ce_what = ce.add_mutually_exclusive_group()
    ce_what.add_argument("--all-kernels", action="store_true", help="every compiled kernel, not just the decided ones")
    ce_what.add_argument("--decisions-only", action="store_true",
                         help="the decisions alone, no kernels (small; `cache import` on the other side then compiles "
                              "or finds their kernels there)")
    ci = csub.add_parser(
        "import", parents=[sub_common], help="merge an exported .tar.gz into this cache",
        description="Merge an exported .tar.gz into this cache. Its kernels are compiled code that every process "
                    "using this cache loads and runs as you: import them only from a machine and a person you "
                    "trust, or use --decisions-only.")
    ci.add_argument("path")
    ci.add_argument("--overwrite", action="store_true", help="replace existing decisions with the imported ones")
    ci.add_argument("--decisions-only", action="store_true",
                    help="import the decisions alone and compile their kernels here from the templates (in "
                         "parallel); the tarball's kernels are not installed")
    ci.add_argument("--no-progress", action="store_true", help="no progress bar while compiling")
    return ap


def _items_from_args(args) -> list:
    from .problem import Conv2dProblem, ProblemError  # noqa: PLC0415
    from .workloads import WorkloadError, WorkloadItem, default_workload, workload  # noqa: PLC0415

    flags = {n: getattr(args, n) for n in ("n", "c", "h", "w", "k", "r", "s")}
    if args.workload and (args.kind or any(v is not None for v in flags.values())):
        raise UsageError("give either a workload file or problem flags, not both")
    if args.model:
        if args.workload or args.kind or any(v is not None for v in flags.values()):
            raise UsageError("give either --model or a workload file or problem flags")
        return _model_items(args)
    try:
        if args.workload:
            kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
            return workload(args.workload, batch=args.batch, dtype=args.dtype, kinds=kinds, arch=args.arch)
        if args.kind or any(v is not None for v in flags.values()):
            missing = [f"--{n}" for n in ("c", "h", "k", "r") if flags[n] is None]
            if missing:
                raise UsageError(f"one problem from flags needs {', '.join(missing)} (and optionally --kind, --n, "
                                 "--w, --s, --stride, --padding)")
            kinds = ["fprop", "dgrad", "wgrad"] if args.kind == "all" else [args.kind or "fprop"]
            h = flags["h"]
            r = flags["r"]
            items = []
            for kind in kinds:
                p = Conv2dProblem.make(kind, flags["n"] or args.batch, flags["c"], h, flags["w"] or h, flags["k"], r,
                                       flags["s"] or r, stride=args.stride,
                                       padding=r // 2 if args.padding is None else args.padding,
                                       dilation=args.dilation, groups=args.groups, dtype=args.dtype,
                                       out_dtype=args.out_dtype)
                items.append(WorkloadItem("cli", p))
            return items
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        return default_workload(batch=args.batch, dtype=args.dtype, kinds=kinds, arch=args.arch)
    except (WorkloadError, ProblemError) as e:
        raise UsageError(str(e)) from None
    except ValueError as e:
        raise UsageError(str(e)) from None


def _amp_dtype(amp: str):
    """--amp's autocast dtype (None: no autocast)."""
    import torch  # noqa: PLC0415

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "none": None}[amp]


def _model_items(args) -> list:
    """The problems the backend would offload from --model (traced on fake tensors), named by layer position."""
    from .workloads import WorkloadItem  # noqa: PLC0415

    try:
        from .offload.trace import model_problems  # noqa: PLC0415  (imports torch)
    except ImportError as e:
        raise UsageError(f"--model needs PyTorch: {e}") from None
    amp = _amp_dtype(args.amp)
    try:
        problems, report = model_problems(args.model, args.batch, training=args.training, autocast=amp,
                                          image=args.image)
    except ValueError as e:
        raise UsageError(str(e)) from None
    log.info("%s", report.summary())
    if not problems:
        raise UsageError(f"--model {args.model}: no conv of this model is offloaded (see the report with -v)")
    counts = collections.Counter(report.problems)
    return [WorkloadItem(f"{args.model.split(':')[-1]}#{i}", p, count=counts[p]) for i, p in enumerate(problems)]


def untuned_time_us(outcome, untuned) -> Optional[float]:
    """The tune's time of `untuned` (the launch the backend runs on the problem without a decision,
    `heuristics.default_launch`) among the outcome's results, or None where it was not timed or failed."""
    if untuned is None:
        return None
    return next((r.median_us for r in getattr(outcome, "results", ()) if r.ok and r.launch == untuned), None)


def step_summary(items: list, outcomes, host_credit_us: float, untuned: Optional[dict] = None) -> Optional[str]:
    """--model: the traced step's conv passes (each problem times its count) summed from the tune's times, for the
    plans the backend would run: cuDNN alone, under CUDA graphs (the faster of the two per pass), without them (the
    host credit), all on our kernels, and (with `untuned`, problem -> the launch it runs without a decision) the
    untuned plan: every pass on that launch, over the passes where the tune timed it. None when no problem has both
    times."""
    from .select import keeps_cudnn  # noqa: PLC0415

    by_problem = {o.problem: o for o in outcomes}
    total = sum(it.count for it in items)
    credits = {"graphs": 0.0, "credit": host_credit_us}  # the two plans: prefer_cudnn's rule at each credit
    plan_us, plan_ours = dict.fromkeys(credits, 0.0), dict.fromkeys(credits, 0)
    cudnn = ours = 0.0
    n = 0
    # the untuned plan against the tuned one and cuDNN over the same passes (those whose untuned launch was timed)
    un_n, un_us, un_tuned, un_cudnn = 0, 0.0, 0.0, 0.0
    for it in items:
        o = by_problem.get(it.problem)
        if o is None or o.time_us is None or o.cudnn_us is None:
            continue
        t, c, k = o.time_us, o.cudnn_us, it.count
        n += k
        cudnn += c * k
        ours += t * k
        for plan, credit in credits.items():
            keep = keeps_cudnn(c, t, credit)
            plan_us[plan] += (c if keep else t) * k
            plan_ours[plan] += 0 if keep else k
        u = untuned_time_us(o, (untuned or {}).get(it.problem))
        if u is not None:
            un_n, un_us, un_tuned, un_cudnn = un_n + k, un_us + u * k, un_tuned + t * k, un_cudnn + c * k
    if not n:
        return None
    part = f"{n} of the traced step's {total} conv passes" if n < total else f"the traced step's {n} conv passes"
    line = (f"per step ({part}, summed from the tune's times: each pass alone, L2 flushed; a prediction, not a "
            f"measurement of the step): cuDNN alone {cudnn / 1e3:.2f} ms; under CUDA graphs "
            f"{plan_us['graphs'] / 1e3:.2f} ms, {plan_ours['graphs']} passes on our kernels (the faster per pass); "
            f"without them {plan_us['credit'] / 1e3:.2f} ms of GPU time, {plan_ours['credit']} on ours (host credit "
            f"{host_credit_us:g} us, and each saves host time); all on ours {ours / 1e3:.2f} ms")
    if untuned is not None and un_n:
        over = "" if un_n == n else f" over the {un_n} passes whose untuned launch was timed"
        line += (f"; untuned (no decisions: the model's launch on every pass){over} {un_us / 1e3:.2f} ms against "
                 f"{un_tuned / 1e3:.2f} ms tuned and {un_cudnn / 1e3:.2f} ms cuDNN")
    return line


def _tune_in_step(args, names: dict) -> dict:
    """tune --model --in-step: the passes timed inside the model's step (offload.step_times), printed, and recorded in
    the decisions. The JSON report's "in_step" part."""
    from .decisions import lookup  # noqa: PLC0415
    from .offload import step_times  # noqa: PLC0415
    from .offload.trace import load_model  # noqa: PLC0415

    amp = _amp_dtype(args.amp)
    what = f"{args.model} b{args.batch} {'training' if args.training else 'inference'} {args.amp}"
    print(f"\nin-step times: {what}, each pass on its tuned kernel and on cuDNN, inside the compiled step")
    try:
        passes, offload = step_times.measure(load_model(args.model), args.batch, training=args.training,
                                             autocast=amp, image=args.image)
    except Exception as e:  # noqa: BLE001 - the tune's decisions stand; the measurement's failure is reported
        log.debug("in-step measurement", exc_info=True)
        print(f"in-step measurement failed ({type(e).__name__}: {e}); the decisions keep the tune's times",
              file=sys.stderr)
        return {"model": what, "error": f"{type(e).__name__}: {e}"}
    problems = step_times.per_problem(passes)
    tune = {}  # the tune's own times, each problem timed alone
    for p in problems:
        d = lookup(p.problem)
        tune[p.problem] = (d.time_us, d.cudnn_us) if d is not None and d.cudnn_us is not None else None
    sums = step_times.step_sums(problems, tune.get)
    for line in step_times.table(problems, names, tune.get):
        print(line)
    written, skipped = step_times.record(problems, what)
    print(f"per step (GPU ms of the {sums['problems']} problems' passes inside the step): all on ours "
          f"{sums['all_ours']:.3f}, all on cuDNN {sums['all_cudnn']:.3f}; the faster per problem as the tune timed "
          f"them {sums['tune_choice']:.3f} ({sums['cudnn_by_tune']} on cuDNN), as timed in the step "
          f"{sums['in_step_choice']:.3f} ({sums['cudnn_in_step']} on cuDNN)")
    print(f"recorded in {written} decisions" + (f"; not in {len(skipped)}: " + "; ".join(skipped) if skipped else ""))
    log.info("%s", offload)
    return {"model": what, "sums": sums, "passes": [p.to_dict() for p in passes], "recorded": written,
            "skipped": skipped}


# ---------------------------------------------------------------------------------------------- tune
def _fmt(v: Optional[float], spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def cmd_tune(args) -> int:
    from .profiler.plan import DEFAULT_MAX_CANDIDATES  # noqa: PLC0415
    from .profiler.tune import CACHED, COMPILED, TUNED, tune_workload  # noqa: PLC0415

    mc = DEFAULT_MAX_CANDIDATES if args.max_candidates is None else args.max_candidates
    if mc < 1:
        raise UsageError(f"--max-candidates: expected >= 1, got {mc}")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs: expected >= 1, got {args.jobs}")
    devices = None
    if args.gpus is not None:
        from .profiler.multigpu import GpuSelectionError, parse_gpus, visible_gpu_count  # noqa: PLC0415

        try:
            devices = parse_gpus(args.gpus, visible_gpu_count())
        except GpuSelectionError as e:
            raise UsageError(str(e)) from None
    if args.in_step and not args.model:
        raise UsageError("--in-step needs --model: it times the passes inside that model's step")
    items = _items_from_args(args)
    names = {it.problem: it.layer for it in items}
    report = tune_workload([it.problem for it in items], jobs=args.jobs, max_candidates=mc,
                           progress=not args.no_progress, arch=args.arch, force=args.force,
                           compile_only=args.compile_only, devices=devices,
                           overlap_timing=not args.time_after_build)
    rows = [("layer", "kind", "status", "time us", "cuDNN us", "ok/planned", "launch")]
    for o in report.outcomes:
        ok = sum(1 for r in o.results if r.ok)
        mark = "*" if o.cudnn_us is not None and o.time_us is not None and o.cudnn_us <= o.time_us else ""
        rows.append((names.get(o.problem, o.problem.name), o.problem.kind.value, o.status, _fmt(o.time_us, ".2f"),
                     _fmt(o.cudnn_us, ".2f") + mark, f"{ok}/{o.planned}" if o.planned else "-",
                     o.launch.name if o.launch else o.message))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:6], widths)) + "  " + r[6])
    if any(r[4].endswith("*") for r in rows[1:]):
        print("* cuDNN was faster: under CUDA graphs the backend leaves these convs to PyTorch; without them only where "
              "cuDNN wins by more than the host credit (option host_credit_us, default 10 us; prefer_cudnn=False "
              "offloads them all)")
    if args.model:
        from .heuristics import default_launch  # noqa: PLC0415
        from .offload.patterns import DEFAULT_HOST_CREDIT_US  # noqa: PLC0415

        untuned = {it.problem: default_launch(it.problem) for it in items}
        summary = step_summary(items, report.outcomes, DEFAULT_HOST_CREDIT_US, untuned)
        if summary:
            print(summary)
    in_step = None
    if args.in_step and report.timed:
        in_step = _tune_in_step(args, names)
    counts: dict[str, int] = {}
    for o in report.outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    print()
    print(f"{len(report.outcomes)} problems: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    print(f"kernels: {report.kernels_planned} planned, {report.kernels_compiled} compiled now, "
          f"{report.kernels_failed} failed to compile; compile {report.compile_s:.1f} s, "
          f"timing {report.timing_s:.1f} s ({report.launches_timed} launches timed, "
          f"{report.worker_restarts} worker restarts); total {report.total_s:.1f} s")
    if report.launches_retimed or report.launches_host_bound:
        print(f"timing's spin check: {report.launches_retimed} launches re-timed behind a longer spin, "
              f"{report.launches_host_bound} still host-bound (their times may include host time)")
    if report.overlapped:
        print(f"timing ran beside the build: {report.timing_after_build_s:.1f} s of it after the build ended")
    if report.gpu:
        on = f" x {len(report.devices)} (GPUs {','.join(map(str, report.devices))})" if report.devices else ""
        print(f"GPU: {report.gpu.tag}{on}")
    sc = report.scaling
    if sc:
        print(f"timing on {sc['gpus']} GPUs: {sc['timing_s']:.1f} s wall; " + ", ".join(
            f"GPU {g.device}: {g.problems} problems in {g.busy_s:.1f} s" for g in report.per_gpu)
            + f" (balance {sc['balance']:.2f} of {sc['gpus']}); {sc['outside_busy_s']:.1f} s outside the longest "
              "busy time (worker start-up, kernel loading); for the speed-up over one GPU, time again with --gpus 0")
    if report.log_path:
        print(f"tuning log: {report.log_path}")
    if args.json_out:
        doc = report.to_dict()
        if args.model:  # the traced step: each problem's layer, passes and untuned launch (scripts/default_regret.py)
            doc["passes"] = [{"problem": it.problem.name, "layer": it.layer, "count": it.count,
                              "untuned": untuned[it.problem].name if untuned[it.problem] else None} for it in items]
        if in_step is not None:
            doc["in_step"] = in_step
        Path(args.json_out).write_text(json.dumps(doc, indent=1, default=str))
    if not report.timed and not args.compile_only:
        print("\n" + report.message, file=sys.stderr)
        return EXIT_NO_GPU
    bad = [o for o in report.outcomes if o.status not in (CACHED, TUNED, COMPILED)]
    if in_step is not None and "error" in in_step:
        return EXIT_PARTIAL
    if bad:
        print(f"\n{len(bad)} problems got no working kernel; see the table and the tuning log", file=sys.stderr)
        return EXIT_PARTIAL
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- bench
def cmd_bench(args) -> int:
    items = _items_from_args(args)
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        print("bench needs PyTorch: pip install 'cutlass-byoc[torch]'", file=sys.stderr)
        return EXIT_NO_GPU
    if not torch.cuda.is_available():
        print("bench needs a GPU: no CUDA device is visible to PyTorch. Run it on the GPU machine (after "
              "`cutlass-byoc tune` there, or `cutlass-byoc cache import` of a tuned cache).", file=sys.stderr)
        return EXIT_NO_GPU
    if args.split_k:
        from .profiler.splitk import bench_split_k  # noqa: PLC0415

        sk = bench_split_k(items, jobs=args.jobs, progress=not args.no_progress)
        print(sk.to_json() if args.format == "json" else sk.table())
        if args.json_out:
            Path(args.json_out).write_text(sk.to_json())
        return EXIT_OK if all(r.split_us and r.unsplit_us for r in sk.rows) else EXIT_PARTIAL
    from .bench import bench_workload  # noqa: PLC0415

    report = bench_workload(items, progress=not args.no_progress)
    print({"table": report.table, "json": report.to_json, "csv": report.to_csv}[args.format]())
    if args.json_out:
        Path(args.json_out).write_text(report.to_json())
    if args.csv_out:
        Path(args.csv_out).write_text(report.to_csv())
    if args.plot:
        try:
            report.plot(args.plot)
        except RuntimeError as e:
            print(str(e), file=sys.stderr)
            return EXIT_PARTIAL
    return EXIT_PARTIAL if any(r.status != "ok" for r in report.rows) else EXIT_OK


# ---------------------------------------------------------------------------------------------- cache
def _decision_kernel_keys(store, cache) -> tuple[set[str], bool]:
    """Keys of the kernels decisions refer to; (keys, complete) where complete is False without a toolchain."""
    from .build import prepare  # noqa: PLC0415
    from .toolchain import ToolchainError  # noqa: PLC0415

    keys = set()
    for _, dec, _why in store.entries():
        if dec is None:
            continue
        try:
            keys.add(prepare(dec.launch.kernel)[1])
        except ToolchainError:
            return keys, False
    return keys, True


def _built_by(meta: dict) -> str:
    """'user@host at time' from a kernel's meta.json; '?' for kernels built before it was recorded."""
    who = meta.get("built_by")
    if not isinstance(who, dict):
        return "?"
    return f"{who.get('user', '?')}@{who.get('host', '?')} at {who.get('time', '?')}"


def cmd_cache(args) -> int:
    from .cache import EntryState, KernelCache  # noqa: PLC0415
    from .decisions import DecisionStore, current_gpu  # noqa: PLC0415

    cache = KernelCache()
    store = DecisionStore(cache.root)
    sub = args.cache_cmd
    if sub == "list":
        from .decisions import DecisionKey, GpuInfo, differs  # noqa: PLC0415

        gpu = current_gpu()
        n = 0
        print(f"cache root: {cache.root}")
        for path, dec, why in store.entries():
            n += 1
            if dec is None:
                print(f"{path.stem[:12]}  STALE  {why}")
                continue
            if gpu:
                state = "stale" if differs(dec.key, DecisionKey.for_problem(dec.key.problem, gpu)) else "current"
            else:  # the key under the decision's own GPU: only the CUTLASS version and the templates can differ
                try:
                    own = DecisionKey.for_problem(dec.key.problem, GpuInfo(dec.key.gpu_name, dec.key.gpu_arch))
                    state = "stale" if differs(dec.key, own) else "-"
                except Exception:  # noqa: BLE001 - the versions unreadable here: the state unknown
                    state = "-"
            in_step = (f" (in the step: {dec.step_us:.2f} us, cuDNN {dec.step_cudnn_us:.2f})"
                       if dec.in_step else "")
            print(f"{path.stem[:12]}  {state:7s}  {dec.key.gpu_name} sm_{dec.key.gpu_arch}  "
                  f"{dec.key.problem.name}  {dec.time_us:.2f} us{in_step}  {dec.launch.name}")
        print(f"{n} decisions")
        if args.kernels:
            counts: dict[str, int] = {}
            for e in cache.entries():
                counts[e.state.value] = counts.get(e.state.value, 0) + 1
                print(f"{e.key[:12]}  {e.state.value:7s}  {e.meta.get('name', '?')}  "
                      f"{_fmt(e.meta.get('compile_seconds'))} s  built by {_built_by(e.meta)}")
            print("kernels: " + (", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"))
        return EXIT_OK
    if sub == "show":
        hits = store.find(args.key)
        kernel_hits = [e for e in cache.entries() if e.key.startswith(args.key)]
        if len(hits) + len(kernel_hits) == 0:
            raise UsageError(f"no decision or kernel key starts with {args.key!r} (see `cutlass-byoc cache list`)")
        if len(hits) + len(kernel_hits) > 1:
            raise UsageError(f"{args.key!r} matches {len(hits) + len(kernel_hits)} entries; give more of the key")
        if hits:
            print(hits[0].read_text())
        else:
            e = kernel_hits[0]
            shown = {"key": e.key, "state": e.state.value, "path": str(e.path), **e.meta}
            shown.setdefault("built_by", "unknown (built before cutlass-byoc recorded who built a kernel)")
            print(json.dumps(shown, indent=1, default=str))
        return EXIT_OK
    if sub == "clear":
        nd = nk = 0
        if not args.kernels:
            nd = store.clear()
        if not args.decisions:
            nk = cache.clear()
        print(f"removed {nd} decisions and {nk} kernels from {cache.root}")
        return EXIT_OK
    if sub == "export":
        with tarfile.open(args.path, "w:gz") as tar:
            nd = 0
            for path, dec, _ in store.entries():
                if dec is not None:
                    tar.add(path, arcname=f"decisions/{path.parent.name}/{path.name}")
                    nd += 1
            nk = 0
            if not args.decisions_only:
                keys, complete = _decision_kernel_keys(store, cache)
                for e in cache.entries():
                    if e.state is EntryState.OK and (args.all_kernels or not complete or e.key in keys):
                        tar.add(e.path, arcname=f"kernels/{e.key[:2]}/{e.key}")
                        nk += 1
        print(f"exported {nd} decisions and {nk} kernels to {args.path}")
        return EXIT_OK
    if sub == "import":
        return _import(args, cache, store)
    raise UsageError(f"unknown cache command {sub}")


def _import(args, cache, store) -> int:
    """Merge an export: its decisions, and its kernels unless --decisions-only (then they are compiled here)."""
    from .cache import EntryState  # noqa: PLC0415
    from .decisions import Decision  # noqa: PLC0415
    from .trust import provenance  # noqa: PLC0415

    src = Path(args.path)
    if not src.is_file():
        raise UsageError(f"{src}: no such file")
    try:
        tar = tarfile.open(src, "r:*")
    except tarfile.TarError as e:
        raise UsageError(f"{src}: not a cutlass-byoc export ({e})") from None
    with tar, tempfile.TemporaryDirectory(dir=cache.root / "tmp") as tmp:
        members = []
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if (m.name.startswith("/") or ".." in parts or not parts or parts[0] not in ("decisions", "kernels")
                    or not (m.isfile() or m.isdir())):
                raise UsageError(f"{src}: refusing member {m.name!r} (outside decisions/ and kernels/, or a link)")
            members.append(m)
        shipped = len({Path(m.name).parts[2] for m in members if Path(m.name).parts[0] == "kernels"
                       and len(Path(m.name).parts) > 2})
        if args.decisions_only:
            members = [m for m in members if Path(m.name).parts[0] == "decisions"]
        elif shipped:
            print(f"cutlass-byoc cache import: {src} holds {shipped} compiled kernels, and kernels are code: every "
                  f"process that uses {cache.root} will load them and run them as {provenance()['user']}. Import "
                  "kernels only from a machine and a person you trust; `cutlass-byoc cache import --decisions-only` "
                  "imports the decisions alone and compiles their kernels here from the templates.", file=sys.stderr)
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp, members=members, **kwargs)
        root = Path(tmp)
        nk = nk_skip = 0
        for d in sorted((root / "kernels").glob("*/*")):
            key = d.name
            if len(key) != 64 or d.parent.name != key[:2] or not all(ch in "0123456789abcdef" for ch in key):
                log.warning("skipping %s: not a kernel key", d.relative_to(root))
                continue
            if cache.lookup(key).state is EntryState.OK:
                nk_skip += 1
                continue
            _stamp_imported(d, src)
            staged = cache.staging_dir(key)
            staged.rmdir()
            os.rename(d, staged)
            if cache.publish(key, staged).state is EntryState.OK:
                nk += 1
            else:
                log.warning("imported kernel %s is corrupt; dropped", key)
                cache.remove(key)
        nd = nd_skip = 0
        decided = []
        for f in sorted((root / "decisions").glob("*/*.json")):
            try:
                dec = Decision.from_dict(json.loads(f.read_text()))
            except (ValueError, KeyError, TypeError) as e:
                log.warning("skipping malformed decision %s: %s", f.name, e)
                continue
            decided.append(dec.launch.kernel)
            if store.import_decision(dec, overwrite=args.overwrite):
                nd += 1
            else:
                nd_skip += 1
    if args.decisions_only:
        print(f"imported {nd} decisions ({nd_skip} already present) into {cache.root}"
              + (f"; ignored the {shipped} kernels of {src}" if shipped else ""))
        return _build_here(args, cache, decided)
    print(f"imported {nd} decisions ({nd_skip} already present) and {nk} kernels ({nk_skip} already present) "
          f"into {cache.root}")
    return EXIT_OK


def _stamp_imported(entry: Path, src: Path) -> None:
    """Note in an imported kernel's meta.json where it came from and who imported it (`cache show` prints it)."""
    from .trust import provenance  # noqa: PLC0415

    meta_file = entry / "meta.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return  # not a usable kernel: publishing finds it corrupt and drops it
    if isinstance(meta, dict):
        meta["imported"] = {**provenance(), "from": str(src.resolve())}
        meta_file.write_text(json.dumps(meta, indent=1))


def _build_here(args, cache, configs: list) -> int:
    """Compile the kernels of imported decisions from this machine's templates (in parallel, with progress)."""
    from .build import build  # noqa: PLC0415

    configs = list(dict.fromkeys(configs))
    if not configs:
        return EXIT_OK
    results = build(configs, cache=cache, jobs=args.jobs, progress=not args.no_progress)
    now = sum(1 for r in results.values() if r.ok and r.built_now)
    failed = [r for r in results.values() if not r.ok]
    print(f"kernels of the decisions, built here from the templates: {now} compiled now, "
          f"{len(results) - now - len(failed)} already in the cache, {len(failed)} failed to compile")
    if failed:
        print(f"{len(failed)} kernels failed to compile here (nvcc's errors are above; `cutlass-byoc cache list "
              "--kernels` lists them)", file=sys.stderr)
        return EXIT_PARTIAL
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.cache_dir:
        os.environ["CUTLASS_BYOC_CACHE_DIR"] = str(Path(args.cache_dir).expanduser().resolve())
    if args.trust_cache_dir:  # through the environment, so the profiler's worker processes trust it too
        os.environ[TRUST_ENV] = "1"
    from .toolchain import ToolchainError  # noqa: PLC0415

    t0 = time.perf_counter()
    try:
        rc = {"tune": cmd_tune, "bench": cmd_bench, "cache": cmd_cache}[args.cmd](args)
    except UsageError as e:
        print(f"cutlass-byoc {args.cmd}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ToolchainError as e:
        print(f"cutlass-byoc {args.cmd}: {e}", file=sys.stderr)
        return EXIT_TOOLCHAIN
    except UntrustedCacheError as e:
        print(f"cutlass-byoc {args.cmd}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        from .profiler.tune import TuneError  # noqa: PLC0415
        from .profiler.worker import WorkerError  # noqa: PLC0415

        if isinstance(e, TuneError):
            print(f"cutlass-byoc {args.cmd}: {e}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(e, WorkerError):
            print(f"cutlass-byoc {args.cmd}: {e}; the kernels are compiled and cached, timing needs a working GPU "
                  "(check nvidia-smi and that PyTorch sees the device)", file=sys.stderr)
            return EXIT_NO_GPU
        if args.verbose:
            raise
        print(f"cutlass-byoc {args.cmd}: internal error: {type(e).__name__}: {e} (run with -v for the traceback)",
              file=sys.stderr)
        return EXIT_ERROR
    log.info("%s took %.1f s", args.cmd, time.perf_counter() - t0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
