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
``triton_kernels`` with whole names, ms and launches per step) and, for every Triton kernel run, the aten ops it
fuses (from its name) and its size; DIR/inductor-code-<mode>.tar.xz: the generated Python/Triton modules of the
mode's graphs, to read the kernels' index expressions.

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
    if len(names) == 2:  # the Triton kernels by the aten ops they fuse (the name without its counter)
        def by_ops(mode: str) -> dict:
            acc: dict = {}
            for ms, n, name in result["modes"][mode]["profile"]["triton_kernels"]:
                ops = name.rsplit("_", 1)[0] if name.rsplit("_", 1)[-1].isdigit() else name
                t = acc.setdefault(ops, [0.0, 0.0])
                t[0] += ms
                t[1] += n
            return acc
        x, y = by_ops(names[0]), by_ops(names[1])
        diff = sorted(((y.get(k, [0, 0])[0] - x.get(k, [0, 0])[0], k, x.get(k, [0, 0]), y.get(k, [0, 0]))
                       for k in set(x) | set(y)), key=lambda d: -abs(d[0]))
        result["triton_by_ops"] = [{"ops": k, names[0]: a_, names[1]: b_, "ms_diff": round(d, 4)}
                                   for d, k, a_, b_ in diff]
        print(f"Triton kernels by the ops they fuse, {names[1]} minus {names[0]} (ms per step, launches):")
        for d, k, a_, b_ in diff[:40]:
            print(f"  {d:+8.4f}  {a_[0]:7.4f} x{a_[1]:<4.0f} {b_[0]:7.4f} x{b_[1]:<4.0f} {k}")
    (a.out / "inductor-kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
