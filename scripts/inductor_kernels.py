"""Inductor's own kernels around the convolutions, mode against mode: which Triton kernels a training step runs
under plain Inductor and under the cutlass_byoc backend, with their GPU time and their generated source.

A diagnostic of the GPU round (step ``inductor-kernels``): the offload benchmark's profile says how much GPU time
each source takes (ours, cuDNN, Triton, aten); this says which of Inductor's kernels differ between the modes and
what they compute. Each mode runs in a process of its own with its own Inductor cache folder (so the generated
code of one mode is not mixed with the other's, and nothing is read from an earlier compile), the case built as the
offload benchmark builds it (same model, batch, autocast, channels_last, GradScaler step), 5 profiled steps after
warm-up.

``--reference`` runs the offloaded convolutions on the PyTorch reference instead of the kernels: Inductor compiles
exactly the same graph either way (the partitioner does not look at the kernels' speed under ``select=heuristic``),
so the Triton kernels and their times are what they are with the kernels, and no kernel needs to be compiled.

Writes DIR/inductor-kernels.json: per mode, the profile's split (``profile_breakdown``: ``gpu_ms_by_source``,
``triton_kernels`` with whole names, ms and launches per step) and, with two modes, ``triton_by_ops``: both modes'
Triton time summed by the aten ops the kernels fuse (their names without Inductor's counter), largest difference
first; DIR/inductor-code-<mode>.tar.xz: the generated Python/Triton modules of the mode's graphs, to read the
kernels' index expressions.

    python scripts/inductor_kernels.py OUT_DIR [--case resnet50:32] [--modes inductor-cudagraphs
        cutlass_byoc-cudagraphs] [--reference] [--select heuristic]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def triton_by_ops(a: list, b: list) -> list[dict]:
    """Two modes' Triton kernels ([ms per step, launches per step, name] each) summed by the aten ops they fuse (the
    name without Inductor's counter, which differs between two compiles), largest difference first: [{"ops", "a":
    [ms, launches], "b": [ms, launches], "ms_diff": b - a}]."""
    def by_ops(kernels: list) -> dict:
        acc: dict = {}
        for ms, n, name in kernels:
            head, _, tail = name.rpartition("_")
            t = acc.setdefault(head if tail.isdigit() else name, [0.0, 0.0])
            t[0] += ms
            t[1] += n
        return acc
    x, y = by_ops(a), by_ops(b)
    zero = [0.0, 0.0]
    rows = [{"ops": k, "a": [round(v, 4) for v in x.get(k, zero)], "b": [round(v, 4) for v in y.get(k, zero)],
             "ms_diff": round(y.get(k, zero)[0] - x.get(k, zero)[0], 4)} for k in sorted(set(x) | set(y))]
    return sorted(rows, key=lambda r: -abs(r["ms_diff"]))


def child(mode: str, case: str, reference: bool, select: str, out: Path) -> None:
    import torch  # noqa: PLC0415

    from cutlass_byoc.offload import bench, library  # noqa: PLC0415

    torch.backends.cudnn.benchmark = True
    if reference:
        library.set_use_kernels(False)
    rows = bench.run_case(bench.Case.parse(case), modes=[mode], steps=5, warmup=3, options={"select": select},
                          profile=True)
    row = rows[0]
    out.write_text(json.dumps({"mode": mode, "step_ms": row.step_ms, "offload": row.offload,
                               "profile": row.profile}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--case", default="resnet50:32")
    ap.add_argument("--modes", nargs="+", default=["inductor-cudagraphs", "cutlass_byoc-cudagraphs"])
    ap.add_argument("--reference", action="store_true", help="offloaded convs on the PyTorch reference")
    ap.add_argument("--select", default="heuristic", choices=["heuristic", "cached"])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.case, a.reference, a.select, a.child_out)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"case": a.case, "reference": a.reference, "select": a.select, "modes": {}}
    rc = 0
    for mode in a.modes:
        with tempfile.TemporaryDirectory(prefix=f"ind-{mode}-") as tmp:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "cache"),
                       TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0",
                       **({"CUTLASS_BYOC_NATIVE_OPS": "0"} if a.reference else {}))  # the reference: no C++ sites
            res = Path(tmp) / "row.json"
            cmd = [sys.executable, __file__, str(a.out), "--case", a.case, "--select", a.select, "--child", mode,
                   "--child-out", str(res), *(["--reference"] if a.reference else [])]
            p = subprocess.run(cmd, env=env)
            if p.returncode or not res.exists():
                print(f"{mode}: failed ({p.returncode})", flush=True)
                rc = 1
                continue
            row = json.loads(res.read_text())
            result["modes"][mode] = row
            code = sorted(Path(tmp, "cache").rglob("*.py"))
            with tarfile.open(a.out / f"inductor-code-{mode}.tar.xz", "w:xz") as tar:
                for f in code:
                    tar.add(f, arcname=str(f.relative_to(tmp)))
            q = row["profile"]
            print(f"{mode}: {row['step_ms']:.2f} ms per step; GPU ms by source {q['gpu_ms_by_source']}; "
                  f"{len(q['triton_kernels'])} Triton kernels, {sum(k[0] for k in q['triton_kernels']):.3f} ms; "
                  f"{len(code)} generated modules; {row['offload']}", flush=True)
    names = [m for m in a.modes if m in result["modes"]]
    if len(names) == 2:
        kernels = [result["modes"][m]["profile"]["triton_kernels"] for m in names]
        diff = triton_by_ops(*kernels)
        result["triton_by_ops"] = [{"ops": d["ops"], names[0]: d["a"], names[1]: d["b"], "ms_diff": d["ms_diff"]}
                                   for d in diff]
        print(f"Triton kernels by the ops they fuse, {names[1]} minus {names[0]} (ms per step, launches):")
        for d in diff[:40]:
            (ma, na), (mb, nb) = d["a"], d["b"]
            print(f"  {d['ms_diff']:+8.4f}  {ma:7.4f} x{na:<4.0f} {mb:7.4f} x{nb:<4.0f} {d['ops']}")
    (a.out / "inductor-kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
