"""Publish a GPU round's results: copy the JSON files `scripts/gpu_round.sh` (and `scripts/multigpu_round.sh`) wrote
on the H200 into benchmarks/h200/ and render the README's performance tables from them. Nothing here is typed by hand:
every number comes from those files.

    python scripts/publish_results.py DIR...  # each DIR: one device call's $OUT as fetched (bench.json,
                                              # bench-splitk.json, bench-depthwise.json, offload.json; any subset);
                                              # offload.json rows of several calls are concatenated in the given
                                              # order; multigpu_round.sh's tune-gpus-*.json, ddp.jsonl and fleet.log
                                              # go to benchmarks/h200/multigpu/ (ddp.jsonl lines and fleet.log text
                                              # of several calls concatenated in the given order); then the README
                                              # tables are re-rendered
    python scripts/publish_results.py --merge-offload DIR...  # the same, but offload.json keeps the published
                                              # rows (and host overheads) of the cases the given folders do not
                                              # re-measure: a rerun of one model or mode replaces only its own rows
    python scripts/publish_results.py --merge-bench DIR...  # the same, but bench.json / bench-depthwise.json keep
                                              # the published rows of the cells (layer, kind) the new file does not
                                              # re-measure, e.g. a wgrad-only tune and bench; each row says its run
    python scripts/publish_results.py --bench-as bench-convnext-dw.json DIR  # DIR's bench.json (a bench of another
                                              # workload, e.g. TUNE_WORKLOAD=scripts/workloads/convnext-dw.json)
                                              # published under a name of its own (EXTRA_BENCH), rendered as its own
                                              # table; bench.json and the goals are left as they are
                                              # (with --merge-bench: its cells not re-measured are kept)
    python scripts/publish_results.py --print # only print the tables rendered from benchmarks/h200/

A file that no given folder holds is left as it is in benchmarks/h200/. A file measured on another GPU than an H200
(a call that named the H200 can run on an H100) is refused, and nothing is published. bench.json is the file the
per-layer and the depthwise issues share: whenever a bench file is published it also takes every row of
bench-depthwise.json (the depthwise step's own file), and the README renders both from it (combine_bench).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # cutlass_byoc.bench (torch-free at import) recomputes a merged bench's summary
RESULTS = ROOT / "benchmarks" / "h200"
FILES = ("bench.json", "bench-splitk.json", "bench-depthwise.json", "offload.json")
#: benches of other workloads, published beside bench.json under their own names (--bench-as) and rendered after it
EXTRA_BENCH = ("bench-convnext-dw.json",)
MULTIGPU = "multigpu"  # benchmarks/h200/multigpu/: scripts/multigpu_round.sh's output (issue 15)
TUNE_GPUS = "tune-gpus-*.json"  # copied as they are
CONCATENATED = ("ddp.jsonl", "fleet.log")  # several calls' text, in the given order
TUNE_ORDER = {"tune-gpus-cold.json": 0, "tune-gpus-1.json": 1, "tune-gpus-n.json": 2}
#: the profile table's GPU-time columns: the offload bench's gpu_ms_by_source keys (bench.SOURCE_ORDER; this script
#: stays free of torch) and their titles, in the header's order whatever the file's
SOURCE_COLUMNS = (("cutlass_byoc", "ours"), ("cudnn/cublas", "cuDNN+cuBLAS"), ("triton", "Triton"), ("aten", "aten"),
                  ("other", "other"))
BEGIN, END = "<!-- results:begin (scripts/publish_results.py) -->", "<!-- results:end -->"


def _jsonl(text: str) -> list[dict]:
    """The records of a JSON-lines text (ddp.jsonl), blank lines skipped; a line that is not whole JSON raises."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _f(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def bench_tables(data: dict) -> list[str]:
    rows = data.get("rows", [])
    dense = [r for r in rows if not r.get("depthwise")]
    dw = [r for r in rows if r.get("depthwise")]
    out = [f"Per-layer kernels vs cuDNN (`cutlass-byoc bench`, {data.get('gpu')}, torch {data.get('torch')}, cuDNN "
           f"{data.get('cudnn')}; ratio = cuDNN time / ours, above 1 means faster than cuDNN):", ""]
    runs = data.get("runs", [])
    if len(runs) > 1:  # merged (--merge-bench): say which cells each run measured
        parts = []
        for i, run in enumerate(runs, 1):
            mine = [r for r in rows if r.get("run", 1) == i]
            kinds = ", ".join(k for k in ("fprop", "dgrad", "wgrad") if any(r["kind"] == k for r in mine))
            parts.append(f"run {i} ({run.get('note') or 'torch ' + str(run.get('torch'))}): {len(mine)} cells"
                         + (f" ({kinds})" if kinds else ""))
        out[-1:] = [f"Rows from {len(runs)} bench runs, each row's two times from one process: " + "; ".join(parts)
                    + ".", ""]
    elif runs and runs[0].get("note"):  # one run, described when it was published (--merge-bench --note)
        out[-1:] = [f"All rows from one bench run, each row's two times from one process: {runs[0]['note']}.", ""]
    for what, cells in (("ResNet-50", [r for r in dense if r.get("resnet50")]), ("depthwise", dw)):
        cells = [r for r in cells if r.get("ratio")]
        if not cells:
            continue
        by_kind = {k: _geomean([r["ratio"] for r in cells if r["kind"] == k]) for k in ("fprop", "dgrad", "wgrad")}
        worst = min(cells, key=lambda r: r["ratio"])
        out.append(f"{what} cells: {len(cells)}, geomean {_geomean([r['ratio'] for r in cells]):.3f} (fprop "
                   f"{by_kind['fprop']:.3f}, dgrad {by_kind['dgrad']:.3f}, wgrad {by_kind['wgrad']:.3f}); worst "
                   f"{worst['layer']} {worst['kind']} {worst['ratio']:.2f}.")
        if any(r.get("tune_ratio") for r in cells):  # the tune's process timed the same launch and cuDNN too
            from cutlass_byoc.bench import lower_ratio  # noqa: PLC0415 - torch-free at import

            low = [lower_ratio(r["ratio"], r.get("tune_ratio")) for r in cells]
            low_kind = {k: _geomean([lo for lo, r in zip(low, cells) if r["kind"] == k]) for k in ("fprop", "dgrad",
                                                                                                   "wgrad")}
            differ = sum(1 for r in cells
                         if r.get("tune_cudnn_us") and abs(r["cudnn_us"] / r["tune_cudnn_us"] - 1) > 0.1)
            out.append(f"Each cell's lower ratio of the bench's process and its tune's (cuDNN's benchmark mode picks "
                       f"its algorithm per process; its time differed by more than 10% in {differ} of {len(cells)} "
                       f"cells): geomean {_geomean(low):.3f} (fprop {low_kind['fprop']:.3f}, dgrad "
                       f"{low_kind['dgrad']:.3f}, wgrad {low_kind['wgrad']:.3f}).")
    out += ["", "| layer | kind | ours µs | cuDNN µs | ours | cuDNN | unit | ratio | status |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in dense + dw:
        mem = r.get("bound") == "memory" or r.get("depthwise")
        unit = "GB/s" if mem else "TFLOP/s"
        ours = r.get("ours_gbs") if mem else r.get("ours_tflops")
        theirs = r.get("cudnn_gbs") if mem else r.get("cudnn_tflops")
        name = r["layer"] + (" (depthwise)" if r.get("depthwise") else "")
        out.append(f"| {name} | {r['kind']} | {_f(r.get('ours_us'), '.1f')} | {_f(r.get('cudnn_us'), '.1f')} | "
                   f"{_f(ours, '.0f' if mem else '.1f')} | {_f(theirs, '.0f' if mem else '.1f')} | {unit} | "
                   f"{_f(r.get('ratio'), '.2f')} | {r.get('status')} |")
    return out


def splitk_table(rows: list) -> list[str]:
    out = ["wgrad split-k study (`cutlass-byoc bench --split-k`; µs):", "",
           "| layer | cuDNN | best unsplit | best split-k | cuDNN/split | launch |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["cudnn_us"] / r["split_us"] if r.get("split_us") else None
        out.append(f"| {r.get('layer')} | {_f(r.get('cudnn_us'), '.1f')} | {_f(r.get('unsplit_us'), '.1f')} | "
                   f"{_f(r.get('split_us'), '.1f')} | {_f(ratio, '.2f')} | `{r.get('split') or '-'}` |")
    return out


def _run(row: dict) -> str:
    return f"run {row['run']}: " if "run" in row else ""


#: the offload bench's default optimizer (bench.OPTIMIZERS[0]): rows without an "optimizer" field ran it
DEFAULT_OPTIMIZER = "sgd"


def optimizer(row: dict) -> str:
    """The optimizer of a training row's timed steps ("" for inference)."""
    return row.get("optimizer", DEFAULT_OPTIMIZER) if row.get("training") else ""


def mode_label(row: dict) -> str:
    """The row's mode, with its optimizer where that is not the default one (bench.BenchRow.label)."""
    opt = optimizer(row)
    return row["mode"] if opt in ("", DEFAULT_OPTIMIZER) else f"{row['mode']} [{opt}]"


def offload_tables(data: dict) -> list[str]:
    out = [f"Training steps and inference through `torch.compile` ({data.get('device')}, torch {data.get('torch')}, "
           f"cuDNN {data.get('cudnn')}, {data.get('image')}x{data.get('image')}, autocast {data.get('dtype')}, "
           f"channels_last, {data.get('steps')} timed steps (per round where rounds are given: the modes of a case "
           "interleaved, the median round); `vs Inductor` = Inductor's time in the same mode, with or "
           "without CUDA graphs, over this row's, in the same run; `run` = the device call that measured the row, "
           "numbered as in the host-overhead table (`-`: published before rows carried it); `skipped updates` = "
           "timed training steps whose update GradScaler skipped for non-finite gradients (`-`: not counted, rows "
           "published before the bench counted them)):", "",
           "| run | model | batch | training | mode | step ms | rounds: min-max ms | vs Inductor | fallbacks | offloaded "
           "| skipped updates |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data.get("rows", []):
        # the conv passes the backend offloaded (the rest left to PyTorch: no kernel, or cuDNN measured faster)
        # (inference graphs have fprop only)
        m = re.search(r"((?:fprop|dgrad|wgrad) \d+/\d+(?:, (?:dgrad|wgrad) \d+/\d+)*) offloaded", r.get("offload") or "")
        # --rounds: the modes interleaved, step ms the median round; else one run of the timed steps
        rounds = r.get("step_ms_rounds")
        spread = f"{len(rounds)}: {min(rounds):.2f}-{max(rounds):.2f}" if rounds else "1"
        out.append(f"| {r.get('run', '-')} | {r['model']} | {r['batch']} | {r['training']} | {mode_label(r)} | "
                   f"{r['step_ms']:.2f} | {spread} | "
                   f"{_f(r.get('speedup_vs_inductor_same_mode'), '.3f')} | {r.get('fallbacks', 0)} | "
                   f"{m.group(1) if m else '-'} | {_f(r.get('skipped_updates'), 'd')} |")
    memo = [r for r in data.get("rows", []) if r.get("launch_memo")]
    if memo:
        out += ["", "The kernel libraries' launch memo over each mode's timed steps (relaunches of a prepared launch, "
                "launches prepared anew; under CUDA graphs the replays call no library):", ""]
        out += [f"- {_run(r)}{r['model']} b{r['batch']} {'training' if r['training'] else 'inference'} {mode_label(r)}: "
                f"{r['launch_memo']['relaunches']} relaunches, {r['launch_memo']['full']} prepared anew" for r in memo]
    out += optimizer_table(data.get("rows", []))
    prof = [r for r in data.get("rows", []) if r.get("profile")]
    if prof:
        out += ["", "Where a step goes (`--profile`: torch.profiler over 5 steps after the timing; GPU = the summed "
                "kernel time; the conv ops' host time includes everything they call; under CUDA graphs the kernels "
                "replay without their ops, so their columns apply only without graphs; the GPU timeline: busy = the union of the "
                "kernels, launch gaps = gaps between kernels up to 10 µs, host gaps = longer ones, the GPU waiting "
                "for the host):", "",
                "| run | model | batch | mode | wall ms | GPU kernels ms | GPU ms: "
                f"{', '.join(title for _, title in SOURCE_COLUMNS)} | "
                "kernels | GPU busy ms | launch gaps ms | "
                "host gaps: ms, count | graph replays, launches outside graphs | "
                "offloaded convs: calls, host ms, GPU ms | aten convs: calls, host ms, GPU ms |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in prof:
            q = r["profile"]
            split = [f"{q[t + '_calls']:.0f}, {q[t + '_cpu_ms']:.2f}, {q[t + '_gpu_ms']:.2f}"
                     for t in ("offloaded", "aten_conv")]
            launches = f"{q.get('graph_launches', 0):.0f}, {q.get('kernel_launches', 0):.0f}"
            timeline = (f"{_f(q.get('kernels'), '.0f')} | {_f(q.get('busy_ms'), '.2f')} | "
                        f"{_f(q.get('launch_gap_ms'), '.2f')} | {_f(q.get('host_gap_ms'), '.2f')}, "
                        f"{_f(q.get('host_gaps'), '.0f')}")
            src = q.get("gpu_ms_by_source")  # (profiles of earlier runs have none)
            by_source = ", ".join(f"{src.get(k, 0.0):.2f}" for k, _ in SOURCE_COLUMNS) if src else "-"
            out.append(f"| {r.get('run', '-')} | {r['model']} | {r['batch']} | {mode_label(r)} | {q['wall_ms']:.2f} | "
                       f"{q['gpu_kernel_ms']:.2f} | {by_source} | {timeline} | {launches} | {split[0]} | {split[1]} |")
    host = data.get("host_overhead")
    if host:
        out += ["", "Host time per call on a tiny problem (µs; the GPU idle, so this is the launch path's cost; one row "
                "set per device call, each measured in one process):", "",
                "| run | pass | path | µs per call |", "|---|---|---|---|"]
        out += [f"| {h.get('run', 1)} | {h['pass']} | {h['path']} | {h['us_per_call']:.1f} |" for h in host]
    return out


def optimizer_table(rows: list) -> list[str]:
    """The training rows of a case and mode measured with more than one optimizer in the same run (the offload bench's
    --optimizers), side by side: each optimizer's step ms, vs Inductor, its rounds' spread and (--profile) the GPU's
    busy ms per step."""
    groups: dict = {}
    for r in rows:
        if r.get("training"):
            groups.setdefault((r.get("run"), r["model"], r["batch"], r["mode"]), {})[optimizer(r)] = r
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if not groups:
        return []
    opts = sorted({o for v in groups.values() for o in v}, key=lambda o: (o != DEFAULT_OPTIMIZER, o))
    head = " | ".join(f"{o}: step ms (vs Inductor) | {o}: rounds min-max ms | {o}: GPU busy ms" for o in opts)
    out = ["", "The same compiled model's training steps with each optimizer of the run (`--optimizers`; sgd: "
           "PyTorch's default SGD with momentum, whose GradScaler step reads the found-inf flag on the host; "
           "sgd-fused: the same update with `fused=True`, which takes the flag as a tensor and never waits for the "
           "GPU; GPU busy from the run's profile):", "",
           f"| run | model | batch | mode | {head} |", "|---|---|---|---|" + "---|---|---|" * len(opts)]
    for (run, model, batch, mode), by in groups.items():
        cells = []
        for o in opts:
            r = by.get(o)
            if r is None:
                cells += ["-", "-", "-"]
                continue
            rounds = r.get("step_ms_rounds")
            busy = (r.get("profile") or {}).get("busy_ms")
            cells += [f"{r['step_ms']:.2f} ({_f(r.get('speedup_vs_inductor_same_mode'), '.3f')})",
                      f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else "-", _f(busy, ".2f")]
        out.append(f"| {run if run is not None else '-'} | {model} | {batch} | {mode} | {' | '.join(cells)} |")
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def tune_gpus_table(reports: dict[str, dict]) -> list[str]:
    """`cutlass-byoc tune --gpus` reports by file name: one row each, then the measured 1 vs N GPU timing."""
    gpu = next((d.get("gpu") for d in reports.values() if d.get("gpu")), None)
    out = [f"Tuning on several GPUs (`cutlass-byoc tune --gpus`, default workload, {gpu}): `tune-gpus-cold.json` from "
           "an empty cache, then on that cache everything re-timed (`--force`) on GPU 0 alone (`tune-gpus-1.json`) "
           "and on all GPUs (`tune-gpus-n.json`); seconds. `GPUs busy` is each GPU worker's time spent timing "
           "launches (the rest of the timing wall time is worker start-up and kernel loading):", "",
           "| report | devices | kernels compiled | compile s | timing s | launches timed | total s | "
           "GPUs busy s |", "|---|---|---|---|---|---|---|---|"]
    for name, d in reports.items():
        busy = [g.get("busy_s") for g in d.get("per_gpu") or []]
        est = " / ".join(_f(b, ".1f") for b in busy) if busy else "-"
        devs = ",".join(str(x) for x in d.get("devices") or []) or "-"
        out.append(f"| {name} | {devs} | {_f(d.get('kernels_compiled'), 'd')} | {_f(d.get('compile_s'), '.1f')} | "
                   f"{_f(d.get('timing_s'), '.1f')} | {_f(d.get('launches_timed'), 'd')} | "
                   f"{_f(d.get('total_s'), '.1f')} | {est} |")
    one, n = reports.get("tune-gpus-1.json"), reports.get("tune-gpus-n.json")
    if one and n:
        gpus = len(n.get("devices") or []) or None
        measured = _ratio(one.get("timing_s"), n.get("timing_s"))
        la, lb = one.get("launches_timed"), n.get("launches_timed")
        launches = f"same {_f(lb, 'd')} launches" if la == lb else f"{_f(la, 'd')} and {_f(lb, 'd')} launches"
        out += ["", f"Measured timing speed-up on {gpus} GPUs vs 1 (timing s of `tune-gpus-1.json` / "
                f"`tune-gpus-n.json`, same cache, {launches}): "
                f"{_f(measured, '.2f')}x ({_f(_ratio(measured, gpus), '.0%')} of {gpus}x)."]
    return out


def _loss_diff(run: dict, ref: dict):
    """Max relative difference of the per-step losses (as `scripts/ddp_check.py --compare`)."""
    pairs = list(zip(run.get("losses") or [], ref.get("losses") or []))
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in pairs), default=None)


def ddp_table(runs: list[dict], fleet_log: str | None = None) -> list[str]:
    """`scripts/ddp_check.py` runs (one ddp.jsonl line each): step time, first step, losses vs a reference run, what
    was compiled and tuned."""
    if not runs:
        return []
    ref = next((r for r in runs if r.get("label") == "byoc 2x16"), runs[0])
    r0 = runs[0]
    out = [f"Data-parallel training of {r0.get('model')} (`scripts/ddp_check.py` under torchrun, {r0.get('gpu')}, "
           f"torch {r0.get('torch')}, {r0.get('image')}x{r0.get('image')}, autocast {r0.get('amp')}, BN {r0.get('bn')}, "
           f"{r0.get('steps')} steps of one global batch of {r0.get('global_batch')}; step ms = rank 0's median of the "
           f"steps after the first; loss = the global batch's; `loss diff` = max relative difference of the "
           f"per-step losses from the reference run, `{ref.get('label')}`; kernels compiled on the host by the "
           "ranks; tuned/waited = problems each rank tuned / waited for another rank's decision; same launches = "
           "the ranks launched the same kernels for the problems they share; fallbacks = rank 0's):", "",
           "| run | ranks x batch | step ms | first step s | first loss | loss diff | kernels compiled | "
           "compiled twice | tuned/waited per rank | same launches | fallbacks |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        shape = f"{r.get('world_size')} x {r.get('local_batch')}"
        if (r.get("accum") or 1) > 1:
            shape += f" ({r['accum']} x {r.get('micro_batch')} micro)"
        byoc = r.get("mode") == "cutlass_byoc"  # the other modes compile, tune and offload nothing of ours
        hosts = list((r.get("kernels_per_host") or {}).values())
        compiled = sum(h.get("kernels_compiled", 0) for h in hosts) if byoc and hosts else None
        twice = sum(h.get("compiled_twice", 0) for h in hosts) if byoc and hosts else None
        tuning = ", ".join(f"{k}: {v.get('tuned', 0)}/{v.get('waited', 0)}"
                           for k, v in sorted((r.get("tuning_per_rank") or {}).items(), key=lambda kv: int(kv[0])))
        same = r.get("same_launches") or {}
        same_s = (("yes" if same.get("same") else "no") + f" ({same['problems_compared']})"
                  if byoc and (r.get("world_size") or 0) > 1 and same.get("problems_compared") else "-")
        fallbacks = len((r.get("offload") or {}).get("fallbacks") or {}) if byoc else None
        diff = "(reference)" if r is ref else _f(_loss_diff(r, ref), ".2e")
        first_loss = (r.get("losses") or [None])[0]
        out.append(f"| {r.get('label')} | {shape} | {_f(r.get('step_ms'), '.2f')} | {_f(r.get('first_step_s'), '.1f')} "
                   f"| {_f(first_loss, '.5f')} | {diff} | {_f(compiled, 'd')} | {_f(twice, 'd')} | "
                   f"{(tuning if byoc else '') or '-'} | {same_s} | {_f(fallbacks, 'd')} |")
    ours = ref if ref.get("mode") == "cutlass_byoc" and (ref.get("world_size") or 0) > 1 else None
    ind = ours and next((r for r in runs if r.get("mode") == "inductor" and r.get("world_size") == ours["world_size"]
                         and r.get("local_batch") == ours.get("local_batch")), None)
    if ours and ind:
        out += ["", f"Step time vs DDP with Inductor (`{ind.get('label')}` step ms / `{ours.get('label')}` step ms; "
                f"above 1 means faster than Inductor): {_f(_ratio(ind.get('step_ms'), ours.get('step_ms')), '.3f')}."]
    if fleet_log:
        lines = [ln.strip() for ln in fleet_log.splitlines() if ln.startswith(("exported ", "imported "))]
        fleet = next((r for r in runs if str(r.get("label", "")).startswith("fleet")), None)
        others = {h for r in runs if r is not fleet for h in r.get("kernels_per_host") or {}}
        where = ""
        if fleet and set(fleet.get("kernels_per_host") or {}) <= others:
            where = (f" on the same host as the other runs (`{', '.join(sorted(fleet['kernels_per_host']))}`), not "
                     "another machine")
        if lines:
            out += ["", f"The fleet run's cache (`cutlass-byoc cache export`, then `cache import` into an empty cache"
                    f"{where}; benchmarks/h200/multigpu/fleet.log): " + "; ".join(f"`{ln}`" for ln in lines) + "."]
    return out


def multigpu_tables(folder: Path) -> list[str]:
    """The multi-GPU section (issue 15) from benchmarks/h200/multigpu/; [] where there is nothing to show."""
    parts: list[str] = []
    tunes = sorted(folder.glob(TUNE_GPUS), key=lambda p: (TUNE_ORDER.get(p.name, len(TUNE_ORDER)), p.name))
    if tunes:
        parts += tune_gpus_table({p.name: json.loads(p.read_text()) for p in tunes}) + [""]
        parts += [f"(from `benchmarks/h200/{MULTIGPU}/{TUNE_GPUS}`)", ""]
    ddp = folder / "ddp.jsonl"
    runs = _jsonl(ddp.read_text()) if ddp.exists() else []
    if runs:
        fleet = folder / "fleet.log"
        parts += ddp_table(runs, fleet.read_text() if fleet.exists() else None) + [""]
        parts += [f"(from `benchmarks/h200/{MULTIGPU}/ddp.jsonl`)", ""]
    return parts


def _step_cell(rows: list, model: str, batch: int, mode: str, opt: str = DEFAULT_OPTIMIZER) -> str:
    """The last published training row of (model, batch, mode, optimizer) (file order is call order) and the other
    runs'."""
    found = [r for r in rows if r["model"] == model and r["batch"] == batch and r["training"] and r["mode"] == mode
             and optimizer(r) == opt and r.get("speedup_vs_inductor_same_mode") is not None]
    if not found:
        return "-"
    *others, r = found
    run = f"run {r['run']}" if "run" in r else "an earlier run"
    ratios = ", ".join(format(q["speedup_vs_inductor_same_mode"], ".3f") for q in others)
    also = f"; other runs {ratios}" if others else ""
    return f"{r['speedup_vs_inductor_same_mode']:.3f} ({run}{also})"


def goals_table(results: Path = RESULTS) -> list[str]:
    """The open issues' goal figures next to what the published files measured (nothing here is typed: every number
    comes from bench.json, bench-depthwise.json, copy-floor.json and offload.json; the goals are the issues' words)."""
    out = ["Against the goals of the open issues (each figure computed from the files below; `vs Inductor` rows: the "
           "latest run of the case and mode, and the other runs' ratios):", "",
           "| goal | measured | from |", "|---|---|---|"]
    n = len(out)
    bench = results / "bench.json"
    if bench.exists():
        cells = [r for r in json.loads(bench.read_text()).get("rows", []) if r.get("resnet50") and r.get("ratio")]
        if cells:
            worst = min(cells, key=lambda r: r["ratio"])
            low = sum(1 for r in cells if r["ratio"] < 0.9)
            out.append(f"| ResNet-50 layers: geomean cuDNN/ours >= 1.15, no cell below 0.9 | geomean "
                       f"{_geomean([r['ratio'] for r in cells]):.3f} over {len(cells)} cells; {low} below 0.9 (worst "
                       f"{worst['layer']} {worst['kind']} {worst['ratio']:.2f}) | bench.json |")
            wg = [r["ratio"] for r in cells if r["kind"] == "wgrad"]
            out.append(f"| ResNet-50 wgrad geomean >= 1.0 | {_geomean(wg):.3f} over {len(wg)} cells | bench.json |")
    dw = results / "bench-depthwise.json"
    if dw.exists():
        cells = [r for r in json.loads(dw.read_text()).get("rows", []) if r.get("depthwise") and r.get("ratio")]
        if cells:
            by = {k: [r["ratio"] for r in cells if r["kind"] == k] for k in ("fprop", "dgrad", "wgrad")}
            out.append(f"| depthwise: fprop >= 1.0x cuDNN, dgrad and wgrad >= 2x | fprop {_geomean(by['fprop']):.3f}, "
                       f"dgrad {_geomean(by['dgrad']):.3f}, wgrad {_geomean(by['wgrad']):.3f} (geomeans; cells below "
                       f"the goal: {sum(1 for x in by['fprop'] if x < 1.0)} of {len(by['fprop'])} fprop, "
                       f"{sum(1 for x in by['dgrad'] if x < 2.0)} of {len(by['dgrad'])} dgrad, "
                       f"{sum(1 for x in by['wgrad'] if x < 2.0)} of {len(by['wgrad'])} wgrad) | bench-depthwise.json |")
    floor = results / "copy-floor.json"
    if floor.exists():  # what any memory-bound kernel could reach: cuDNN's time over a copy of the cell's bytes
        summary = json.loads(floor.read_text()).get("summary", {})
        parts = [f"{label}: {s['geomean_max_ratio']:.2f} (goal {s['goal_ratio']:g}; {s['cells_max_ratio_below_goal']} "
                 f"of {s['cells']} cells below it even at copy speed; ours at {s['geomean_ours_of_floor']:.2f} of copy "
                 "speed)" for label, s in summary.items()]
        if parts:
            out.append("| bound: the geomean cuDNN/ours a kernel running at copy speed on every cell would reach | "
                       + "; ".join(parts) + " | copy-floor.json |")
    off = results / "offload.json"
    if off.exists():
        data = json.loads(off.read_text())
        rows = data.get("rows", [])
        opts = dict.fromkeys([DEFAULT_OPTIMIZER, *sorted({optimizer(r) for r in rows} - {""})])
        for model, goal, batches in (("resnet50", ">= 1.10x Inductor", (32, 64)),
                                     ("mobilenet_v2", "faster than Inductor", (32, 64))):
            for b in batches:
                for mode, what in (("cutlass_byoc", "without CUDA graphs"), ("cutlass_byoc-cudagraphs",
                                                                             "with CUDA graphs")):
                    for opt in opts:
                        cell = _step_cell(rows, model, b, mode, opt)
                        step = "" if opt == DEFAULT_OPTIMIZER else f" ({opt} steps)"
                        if cell != "-":
                            out.append(f"| {model} b{b} training step{step} {goal}, {what} | {cell} | offload.json |")
        host = data.get("host_overhead", [])
        if host:
            last = max(h.get("run", 1) for h in host)
            mine = {(h["pass"], h["path"]): h["us_per_call"] for h in host if h.get("run", 1) == last}
            per = [f"{k} {mine[(k, 'cutlass_byoc call site (C++)')]:.1f} vs {mine[(k, 'aten (cuDNN)')]:.1f}"
                   for k in ("fprop", "dgrad", "wgrad")
                   if (k, "cutlass_byoc call site (C++)") in mine and (k, "aten (cuDNN)") in mine]
            if per:
                out.append(f"| host time per offloaded call at or below aten.convolution's (aim 10-15 µs) | run "
                           f"{last}, ours vs aten µs: {'; '.join(per)} | offload.json |")
    return out + [""] if len(out) > n else []


def render(results: Path = RESULTS) -> str:
    parts: list[str] = goals_table(results)
    bench = results / "bench.json"
    combined = bench.exists() and any(r.get("depthwise") for r in json.loads(bench.read_text()).get("rows", []))
    for name, fn in (("bench.json", bench_tables), ("bench-splitk.json", splitk_table),
                     ("bench-depthwise.json", bench_tables), *((n, bench_tables) for n in EXTRA_BENCH),
                     ("offload.json", offload_tables)):
        path = results / name
        if name == "bench-depthwise.json" and combined:
            continue  # its rows are bench.json's depthwise rows (combine_bench), rendered with them
        if path.exists():
            parts += fn(json.loads(path.read_text())) + [""]
            parts.append(f"(from `benchmarks/h200/{name}`)")
            parts.append("")
    if (results / MULTIGPU).is_dir():
        parts += multigpu_tables(results / MULTIGPU)
    return "\n".join(parts).rstrip() + "\n"


def splice_readme(text: str, readme: Path = ROOT / "README.md") -> None:
    body = readme.read_text()
    block = f"{BEGIN}\n{text}{END}"
    if BEGIN in body:
        body = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, body, flags=re.S)
    else:
        body = body.rstrip() + "\n\n## Performance (H200)\n\nWritten by the GPU round's own output (never by hand): " \
            "`scripts/gpu_round.sh` on the H200, then `python scripts/publish_results.py OUT`.\n\n" + block + "\n"
    readme.write_text(body)


def offload_key(row: dict) -> tuple:
    """What an offload.json row measures: the case, the mode and (training) the optimizer of its steps."""
    return row["model"], row["batch"], row["training"], row["mode"], optimizer(row)


def _host_runs(entries: list) -> dict:
    """Host-overhead rows grouped by their run number, in order: {run: [rows]}."""
    runs: dict = {}
    for h in entries:
        runs.setdefault(h.get("run", 1), []).append(h)
    return runs


def _measured(rows: list) -> frozenset:
    return frozenset((h.get("pass"), h.get("path"), h.get("us_per_call")) for h in rows)


def merge_offload(published: dict, new: dict) -> dict:
    """`new` (the given folders' offload.json) with the rows of `published` that it does not re-measure put first,
    in their order, and the published host-overhead rows kept (runs numbered on after them). A run of `new` whose
    host-overhead rows are exactly a published run's is that run published again (a folder merged twice): its rows
    keep that run's number and its host-overhead rows are not added a second time."""
    measured = {offload_key(r) for r in new["rows"]}
    kept = [r for r in published.get("rows", []) if offload_key(r) not in measured]
    runs = published.get("runs", 1)
    seen = {_measured(rows): run for run, rows in _host_runs(published.get("host_overhead", [])).items()}
    host = _host_runs(new.get("host_overhead", []))
    number: dict = {}  # the new file's run -> its number in the merged file: a published one's, or the next
    for run in sorted(set(host) | {r.get("run", 1) for r in new["rows"]}):
        again = seen.get(_measured(host[run])) if run in host else None
        number[run] = again if again is not None else max([runs, *number.values()]) + 1
    added = [dict(h, run=number[h.get("run", 1)]) for h in new.get("host_overhead", [])
             if number[h.get("run", 1)] > runs]
    rows = [dict(r, run=number[r.get("run", 1)]) for r in new["rows"]]
    merged = dict(new, rows=kept + rows, runs=max([runs, *number.values()]),
                  host_overhead=published.get("host_overhead", []) + added)
    if kept and published.get("steps") != new.get("steps"):
        seen_steps = str(published.get("steps")).split(" / ")
        merged["steps"] = " / ".join(dict.fromkeys(seen_steps + str(new.get("steps")).split(" / ")))
    return merged


BENCH_FILES = ("bench.json", "bench-depthwise.json")


def bench_key(row: dict) -> tuple:
    """What a bench row measures: the cell."""
    return row["layer"], row["kind"]


def _published_runs(data: dict) -> list:
    """A bench JSON's runs: its "runs" list, or the one run its own gpu / torch / cuDNN describe."""
    return data.get("runs") or [{k: data.get(k) for k in ("gpu", "torch", "cudnn")}]


def _live_runs(rows: list, runs: list, first: int = 1) -> tuple[list, list]:
    """(rows, runs) with the runs no row comes from dropped and the others numbered on from `first` in their order."""
    live = sorted({r.get("run", 1) for r in rows})
    renumber = {old: i for i, old in enumerate(live, first)}
    return [dict(r, run=renumber[r.get("run", 1)]) for r in rows], [runs[i - 1] for i in live]


def _bench_summary(rows: list, data: dict) -> dict:
    """cutlass_byoc.bench.BenchReport.summary over `rows`, with `data`'s gpu / torch / cuDNN."""
    import dataclasses  # noqa: PLC0415

    from cutlass_byoc.bench import BenchReport, BenchRow  # noqa: PLC0415

    fields = [f.name for f in dataclasses.fields(BenchRow)]
    return BenchReport(tuple(BenchRow(**{k: r[k] for k in fields if k in r}) for r in rows), data.get("gpu"),
                       data.get("torch"), data.get("cudnn")).summary()


def merge_bench(published: dict, new: dict, note: str = "") -> dict:
    """`new` (a bench JSON) with the published rows of the cells it does not re-measure kept: the published rows in
    their order, each re-measured cell replaced in place, new cells appended; every row tagged with its run (1.. for
    the published runs, then `new`'s) and the runs listed ("runs": gpu, torch, cuDNN and `note`); the summary
    recomputed over the merged rows (cutlass_byoc.bench.BenchReport.summary)."""
    runs = _published_runs(published)
    run = len(runs) + 1
    fresh = {bench_key(r): dict(r, run=run) for r in new["rows"]}
    rows = [fresh.pop(bench_key(r), None) or dict(r, run=r.get("run", 1)) for r in published.get("rows", [])]
    rows += list(fresh.values())
    runs = runs + [{**{k: new.get(k) for k in ("gpu", "torch", "cudnn")}, "note": note}]
    # a run whose every cell was re-measured since is dropped, the others numbered on in their order
    rows, runs = _live_runs(rows, runs)
    return dict(new, summary=_bench_summary(rows, new), rows=rows, runs=runs)


def combine_bench(bench: dict, dw: dict) -> dict:
    """bench.json as the per-layer and depthwise issues share it: its own rows but the depthwise ones, then every
    depthwise row of bench-depthwise.json (the depthwise step's own file, which stays as it is), each part's runs kept
    in order and numbered on (a run no kept row comes from is dropped), the summary recomputed over all of them
    (cutlass_byoc.bench.BenchReport.summary: the ResNet-50 figures stay those of the resnet50 rows)."""
    dense, dense_runs = _live_runs([r for r in bench.get("rows", []) if not r.get("depthwise")], _published_runs(bench))
    dw_rows, dw_runs = _live_runs([r for r in dw.get("rows", []) if r.get("depthwise")], _published_runs(dw),
                                  first=len(dense_runs) + 1)
    rows = dense + dw_rows
    return dict(bench, summary=_bench_summary(rows, bench), rows=rows, runs=dense_runs + dw_runs)


def _measured_on(d: Path):
    """(file, GPU name) of every record in the device folder `d` that names the GPU it was measured on: the
    single-GPU round's result files (offload.json's "device", the bench files' "gpu"), the multi-GPU round's tune
    reports ("gpu") and each ddp.jsonl line ("gpu")."""
    for p in [*(d / f for f in FILES), *sorted(d.glob(TUNE_GPUS))]:
        if p.exists():
            data = json.loads(p.read_text())
            yield p, data.get("device") or data.get("gpu")
    for p in (d / f for f in CONCATENATED if f.endswith(".jsonl")):
        if p.exists():
            for record in _jsonl(p.read_text()):
                yield p, record.get("gpu")


def check_gpu(dirs: list[Path], gpu: str) -> None:
    """Refuse, before anything is written, a result file that names another GPU than `gpu` (_measured_on): a device
    call that named the H200 can run on an H100, and its numbers (and the decisions behind them) must not enter the
    H200's tables."""
    for d in dirs:
        for p, name in _measured_on(d):
            if name and gpu.lower() not in str(name).lower():
                raise SystemExit(f"{p} was measured on {name!r}, not an {gpu}: nothing published (keep another "
                                 f"GPU's files in a folder of their own, e.g. benchmarks/h100/)")


def publish(dirs: list[Path], results: Path = RESULTS, merge_offload_rows: bool = False,
            merge_bench_rows: bool = False, note: str = "", gpu: str | None = None) -> None:
    """Copy the given device folders' result files into `results` (see the module's docstring); a file no folder
    holds is left as it is there. `merge_offload_rows`: offload.json keeps the published rows the folders do not
    re-measure (merge_offload); `merge_bench_rows`: bench.json and bench-depthwise.json keep the published rows of the
    cells the folders do not re-measure (merge_bench, the new run described by `note`). `gpu`: every file must name
    it (check_gpu), else nothing is published."""
    if gpu:
        check_gpu(dirs, gpu)
    results.mkdir(parents=True, exist_ok=True)
    offload = None
    texts: dict[str, list[str]] = {}
    bench_published = False
    for d in dirs:
        for f in FILES:
            if not (d / f).exists():
                continue
            data = json.loads((d / f).read_text())  # only whole, valid files are published
            if f == "offload.json":  # several calls' cases: one file, rows in call order
                runs = 1 if offload is None else offload.get("runs", 1) + 1
                for h in data.get("host_overhead", []):
                    h["run"] = runs  # host overheads of separate device calls (their spread shows the noise)
                for r in data.get("rows", []):
                    r["run"] = runs  # which call measured the row (rows of one case and mode from several calls)
                if offload is None:
                    offload = data
                else:
                    if data.get("steps") != offload.get("steps"):  # calls timing different step counts: say both
                        seen = str(offload.get("steps")).split(" / ")
                        offload["steps"] = " / ".join(dict.fromkeys(seen + [str(data.get("steps"))]))
                    offload["rows"] += data["rows"]
                    offload["host_overhead"] = offload.get("host_overhead", []) + data.get("host_overhead", [])
                offload["runs"] = runs
                continue
            bench_published |= f in BENCH_FILES
            if merge_bench_rows and f in BENCH_FILES and (results / f).exists():
                merged = merge_bench(json.loads((results / f).read_text()), data, note)
                (results / f).write_text(json.dumps(merged, indent=1) + "\n")
                print(f"merged {d / f} into {results / f} ({len(data['rows'])} of {len(merged['rows'])} rows)")
                continue
            shutil.copyfile(d / f, results / f)
            print(f"copied {d / f} into {results}")
        for p in sorted(d.glob(TUNE_GPUS)):  # multigpu_round.sh's tune reports, as they are
            json.loads(p.read_text())  # only whole, valid files are published
            (results / MULTIGPU).mkdir(exist_ok=True)
            shutil.copyfile(p, results / MULTIGPU / p.name)
            print(f"copied {p} into {results / MULTIGPU}")
        for f in CONCATENATED:
            if not (d / f).exists():
                continue
            text = (d / f).read_text()
            if f.endswith(".jsonl"):
                _jsonl(text)  # only whole, valid records are published
            texts.setdefault(f, []).append(text if not text or text.endswith("\n") else text + "\n")
    if bench_published and all((results / f).exists() for f in BENCH_FILES):
        # bench.json is the file both issues name: it holds the depthwise rows too
        bench = combine_bench(*(json.loads((results / f).read_text()) for f in BENCH_FILES))
        (results / "bench.json").write_text(json.dumps(bench, indent=1) + "\n")
        print(f"wrote {results / 'bench.json'} with the depthwise rows of {results / 'bench-depthwise.json'} "
              f"({len(bench['rows'])} rows)")
    if offload is not None:
        if merge_offload_rows and (results / "offload.json").exists():
            offload = merge_offload(json.loads((results / "offload.json").read_text()), offload)
        (results / "offload.json").write_text(json.dumps(offload, indent=1) + "\n")
        print(f"wrote {results / 'offload.json'} ({len(offload['rows'])} rows)")
    for f, parts in texts.items():  # several calls' text, in the given order
        (results / MULTIGPU).mkdir(exist_ok=True)
        (results / MULTIGPU / f).write_text("".join(parts))
        print(f"wrote {results / MULTIGPU / f} (from {len(parts)} folder(s))")


def publish_bench_as(folder: Path, name: str, results: Path = RESULTS, merge: bool = False, note: str = "") -> None:
    """Copy `folder`'s bench.json into `results` as `name` (one of EXTRA_BENCH): a bench of another workload, kept
    apart from the published bench.json. `merge`: the published file keeps the rows of the cells the new one does not
    re-measure (merge_bench, the new run described by `note`)."""
    if name not in EXTRA_BENCH:
        raise SystemExit(f"--bench-as: expected one of {', '.join(EXTRA_BENCH)}, got {name!r}")
    data = json.loads((folder / "bench.json").read_text())  # only whole, valid files are published
    results.mkdir(parents=True, exist_ok=True)
    if merge and (results / name).exists():
        data = merge_bench(json.loads((results / name).read_text()), data, note)
    (results / name).write_text(json.dumps(data, indent=1) + "\n")
    print(f"{'merged' if merge else 'copied'} {folder / 'bench.json'} into {results / name} "
          f"({len(data.get('rows', []))} rows)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", type=Path, help="the GPU round's output folders (one per device call)")
    ap.add_argument("--print", action="store_true", help="print the tables rendered from benchmarks/h200/")
    ap.add_argument("--merge-offload", action="store_true",
                    help="offload.json keeps the published rows of the cases and modes the folders do not re-measure")
    ap.add_argument("--merge-bench", action="store_true",
                    help="bench.json and bench-depthwise.json keep the published rows of the cells the folders do not "
                         "re-measure")
    ap.add_argument("--note", default="", help="--merge-bench: what the new run was (e.g. its date and call)")
    ap.add_argument("--bench-as", default=None, metavar="NAME",
                    help=f"publish the folder's bench.json as NAME ({', '.join(EXTRA_BENCH)}), nothing else")
    a = ap.parse_args(argv)
    if a.bench_as:
        if len(a.dirs) != 1:
            raise SystemExit("--bench-as: expected one folder")
        check_gpu(a.dirs, "H200")
        publish_bench_as(a.dirs[0], a.bench_as, merge=a.merge_bench, note=a.note)
    elif a.dirs:
        publish(a.dirs, merge_offload_rows=a.merge_offload, merge_bench_rows=a.merge_bench, note=a.note, gpu="H200")
    text = render()
    if a.print or not a.dirs:
        print(text)
    else:
        splice_readme(text)
        print("README.md performance section re-rendered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
