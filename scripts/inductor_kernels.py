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

``--bandwidth`` instead measures how close each of plain Inductor's Triton kernels comes to the memory's speed: one
training step (after the compiling one) with Inductor's own bandwidth profiler (``TORCHINDUCTOR_PROFILE``: each
kernel timed alone, L2 flushed, against the bytes Inductor's IR says it moves), beside a device-to-device copy's
speed measured in the same process. It writes DIR/inductor-bandwidth.json: every kernel (ms, GB, GB/s, its
``bench.triton_role``) and per role the time, the bytes, the speed and the time those bytes would take at copy speed.
That bounds what a faster kernel for the same work (not a fusion that removes bytes) could save.

    python scripts/inductor_kernels.py OUT_DIR [--case resnet50:32] [--modes inductor-cudagraphs
        cutlass_byoc-cudagraphs] [--reference] [--select heuristic]
    python scripts/inductor_kernels.py OUT_DIR --bandwidth [--case resnet50:64]
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def bandwidth_child(case: str, out: Path) -> None:
    """One profiled training step of `case` under plain Inductor (TORCHINDUCTOR_PROFILE is set by the parent, so
    every Triton kernel is timed alone as it runs); the profiler's file keeps only the second step's graphs. Writes
    the copy speed (GB/s, read + write bytes of a 1 GiB device-to-device copy) to `out`."""
    import torch  # noqa: PLC0415

    from cutlass_byoc.offload import bench  # noqa: PLC0415

    # torch 2.11 calls the generated module's benchmark_compiled_module() without its args when both the harness and
    # the bandwidth profiler's output file are on (fixed in later versions); the profiler does not need the harness
    torch._inductor.config.benchmark_harness = False
    c = bench.Case.parse(case)
    if not c.training:
        raise SystemExit("--bandwidth: a training case (MODEL:BATCH)")
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    model = bench.model_factory(c.model)().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(c.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (c.batch,), device="cuda")
    run, _ = bench.compile_mode(model, "inductor")
    opt = bench.make_optimizer("sgd-fused", model.parameters())
    scaler = bench.make_scaler(True)
    bench._step(run, x, y, opt, torch.float16, scaler)  # compiles (and times each kernel once: the timings are cached)
    torch.cuda.synchronize()
    Path(os.environ["TORCHINDUCTOR_PROFILE_OUTPUT"]).write_text("")
    bench._step(run, x, y, opt, torch.float16, scaler)
    torch.cuda.synchronize()
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    out.write_text(json.dumps({"copy_gbs": 2 * src.numel() * 2 * 10 / (start.elapsed_time(end) / 1e3) / 1e9,
                               "device": torch.cuda.get_device_name()}))


_BW_LINE = re.compile(r"^\s*([0-9.]+)ms\s+([0-9.]+) GB\s+([0-9.]+)GB/s\s+[0-9.]+%\s+(\S+)")


def parse_bandwidth(text: str) -> list[list]:
    """Inductor's bandwidth profile (TORCHINDUCTOR_PROFILE_OUTPUT: one block per graph, each kernel a line
    ``MS ms  GB GB  GB/s GB/s  PCT%  NAME``) as [ms, GB, GB/s, name] rows, the SUMMARY lines left out."""
    return [[float(m[1]), float(m[2]), float(m[3]), m[4]] for m in map(_BW_LINE.match, text.splitlines()) if m]


def bandwidth_summary(rows: list[list], copy_gbs: float) -> dict:
    """Per bench.triton_role (and "all"): kernels, ms, GB, GB/s and the ms those bytes take at copy speed."""
    from cutlass_byoc.offload import bench  # noqa: PLC0415

    acc: dict = {}
    for ms, gb, _, name in rows:
        for key in (bench.triton_role(name) or "other", "all"):
            t = acc.setdefault(key, [0, 0.0, 0.0])
            t[0] += 1
            t[1] += ms
            t[2] += gb
    return {k: {"kernels": n, "ms": round(ms, 4), "gb": round(gb, 4), "gbs": round(gb / ms * 1e3, 1) if ms else None,
                "ms_at_copy_speed": round(gb / copy_gbs * 1e3, 4)} for k, (n, ms, gb) in acc.items()}


def bandwidth_main(a) -> int:
    with tempfile.TemporaryDirectory(prefix="ind-bw-") as tmp:
        bw, res = Path(tmp) / "bw.txt", Path(tmp) / "copy.json"
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "cache"), TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0", TORCHINDUCTOR_PROFILE="1", TORCHINDUCTOR_PROFILE_OUTPUT=str(bw))
        cmd = [sys.executable, __file__, str(a.out), "--case", a.case, "--bandwidth-child", "--child-out", str(res)]
        p = subprocess.run(cmd, env=env)
        if p.returncode or not res.exists() or not bw.exists():
            print(f"--bandwidth: the child failed ({p.returncode})", flush=True)
            return 1
        info = json.loads(res.read_text())
        rows = parse_bandwidth(bw.read_text())
        code = sorted(Path(tmp, "cache").rglob("*.py"))
        with tarfile.open(a.out / "inductor-code-bandwidth.tar.xz", "w:xz") as tar:
            for f in code:
                tar.add(f, arcname=str(f.relative_to(tmp)))
    from cutlass_byoc.offload import bench  # noqa: PLC0415

    summary = bandwidth_summary(rows, info["copy_gbs"])
    result = {"case": a.case, "mode": "inductor", "device": info["device"], "copy_gbs": round(info["copy_gbs"], 1),
              "by_role": summary, "kernels": [[*r, bench.triton_role(r[3])] for r in rows]}
    (a.out / "inductor-bandwidth.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{info['device']}: copy {info['copy_gbs']:.0f} GB/s; {len(rows)} Triton kernel launches of one step "
          f"(each timed alone, L2 flushed)")
    print(f"{'role':14s} {'kernels':>7s} {'ms':>8s} {'GB':>8s} {'GB/s':>8s} {'ms at copy':>10s}")
    for k, v in sorted(summary.items(), key=lambda kv: -kv[1]["ms"]):
        print(f"{k:14s} {v['kernels']:7d} {v['ms']:8.3f} {v['gb']:8.3f} {v['gbs'] or 0:8.0f} {v['ms_at_copy_speed']:10.3f}")
    print("the 40 longest:")
    for ms, gb, gbs, name in sorted(rows, key=lambda r: -r[0])[:40]:
        print(f"  {ms:7.3f} ms {gb:7.3f} GB {gbs:7.0f} GB/s  {name}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--case", default="resnet50:32")
    ap.add_argument("--modes", nargs="+", default=["inductor-cudagraphs", "cutlass_byoc-cudagraphs"])
    ap.add_argument("--reference", action="store_true", help="offloaded convs on the PyTorch reference")
    ap.add_argument("--select", default="heuristic", choices=["heuristic", "cached"])
    ap.add_argument("--bandwidth", action="store_true",
                    help="plain Inductor's Triton kernels against the memory's speed (inductor-bandwidth.json)")
    ap.add_argument("--bandwidth-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.bandwidth_child:
        bandwidth_child(a.case, a.child_out)
        return 0
    if a.child:
        child(a.child, a.case, a.reference, a.select, a.child_out)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if a.bandwidth:
        return bandwidth_main(a)
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
