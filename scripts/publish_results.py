"""Publish a GPU round's results: copy the JSON files `scripts/gpu_round.sh` wrote on the H200 into benchmarks/h200/
and render the README's performance tables from them. Nothing here is typed by hand: every number comes from those
files.

    python scripts/publish_results.py DIR...  # each DIR: one device call's $OUT as fetched (bench.json,
                                              # bench-splitk.json, bench-depthwise.json, offload.json; any subset);
                                              # offload.json rows of several calls are concatenated in the given
                                              # order; then the README tables are re-rendered
    python scripts/publish_results.py --print # only print the tables rendered from benchmarks/h200/
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
RESULTS = ROOT / "benchmarks" / "h200"
FILES = ("bench.json", "bench-splitk.json", "bench-depthwise.json", "offload.json")
BEGIN, END = "<!-- results:begin (scripts/publish_results.py) -->", "<!-- results:end -->"


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
    for what, cells in (("ResNet-50", [r for r in dense if r.get("resnet50")]), ("depthwise", dw)):
        cells = [r for r in cells if r.get("ratio")]
        if not cells:
            continue
        by_kind = {k: _geomean([r["ratio"] for r in cells if r["kind"] == k]) for k in ("fprop", "dgrad", "wgrad")}
        worst = min(cells, key=lambda r: r["ratio"])
        out.append(f"{what} cells: {len(cells)}, geomean {_geomean([r['ratio'] for r in cells]):.3f} (fprop "
                   f"{by_kind['fprop']:.3f}, dgrad {by_kind['dgrad']:.3f}, wgrad {by_kind['wgrad']:.3f}); worst "
                   f"{worst['layer']} {worst['kind']} {worst['ratio']:.2f}.")
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


def offload_tables(data: dict) -> list[str]:
    out = [f"Training steps and inference through `torch.compile` ({data.get('device')}, torch {data.get('torch')}, "
           f"cuDNN {data.get('cudnn')}, {data.get('image')}x{data.get('image')}, autocast {data.get('dtype')}, "
           f"channels_last, {data.get('steps')} timed steps; `vs Inductor` = Inductor's time in the same mode, with or "
           "without CUDA graphs, over this row's):", "",
           "| model | batch | training | mode | step ms | vs Inductor | fallbacks |", "|---|---|---|---|---|---|---|"]
    for r in data.get("rows", []):
        out.append(f"| {r['model']} | {r['batch']} | {r['training']} | {r['mode']} | {r['step_ms']:.2f} | "
                   f"{_f(r.get('speedup_vs_inductor_same_mode'), '.3f')} | {r.get('fallbacks', 0)} |")
    host = data.get("host_overhead")
    if host:
        out += ["", "Host time per call on a tiny problem (µs; the GPU idle, so this is the launch path's cost; one row "
                "set per device call, each measured in one process):", "",
                "| run | pass | path | µs per call |", "|---|---|---|---|"]
        out += [f"| {h.get('run', 1)} | {h['pass']} | {h['path']} | {h['us_per_call']:.1f} |" for h in host]
    return out


def render(results: Path = RESULTS) -> str:
    parts: list[str] = []
    for name, fn in (("bench.json", bench_tables), ("bench-splitk.json", splitk_table),
                     ("bench-depthwise.json", bench_tables), ("offload.json", offload_tables)):
        path = results / name
        if path.exists():
            parts += fn(json.loads(path.read_text())) + [""]
            parts.append(f"(from `benchmarks/h200/{name}`)")
            parts.append("")
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", type=Path, help="the GPU round's output folders (one per device call)")
    ap.add_argument("--print", action="store_true", help="print the tables rendered from benchmarks/h200/")
    a = ap.parse_args(argv)
    if a.dirs:
        RESULTS.mkdir(parents=True, exist_ok=True)
        offload = None
        for d in a.dirs:
            for f in FILES:
                if not (d / f).exists():
                    continue
                data = json.loads((d / f).read_text())  # only whole, valid files are published
                if f == "offload.json":  # several calls' cases: one file, rows in call order
                    runs = 1 if offload is None else offload.get("runs", 1) + 1
                    for h in data.get("host_overhead", []):
                        h["run"] = runs  # host overheads of separate device calls (their spread shows the noise)
                    if offload is None:
                        offload = data
                    else:
                        offload["rows"] += data["rows"]
                        offload["host_overhead"] = offload.get("host_overhead", []) + data.get("host_overhead", [])
                    offload["runs"] = runs
                    continue
                shutil.copyfile(d / f, RESULTS / f)
                print(f"copied {d / f} into {RESULTS}")
        if offload is not None:
            (RESULTS / "offload.json").write_text(json.dumps(offload, indent=1) + "\n")
            print(f"wrote {RESULTS / 'offload.json'} ({len(offload['rows'])} rows)")
    text = render()
    if a.print or not a.dirs:
        print(text)
    else:
        splice_readme(text)
        print("README.md performance section re-rendered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
