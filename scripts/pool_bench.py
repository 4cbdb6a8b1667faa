"""Kernel times of the max-pool ops' Triton kernels (offload/pool_kernels.py) on ResNet's stem pool (3x3, stride 2,
padding 1, fp16, channels_last), next to Inductor's compiled pool and ATen's, at the batch sizes given.

Every row is kernel time as torch.profiler records it (each kernel's CUDA time, summed per iteration, mean over the
iterations), the L2 cache flushed before each iteration (256 MB rewritten, not counted). Rows:
  ours-fwd                 cb_max_pool2d_fwd (values and int8 offsets)
  ours-bwd-gather[-sum2]   cb_max_pool2d_bwd, one gradient [the sum of two, added in the kernel]
  ours-bwd-cells[-sum2]    cb_max_pool2d_bwd_cells, likewise
  add                      the add of two gradients as its own kernel (what the sum2 rows take in)
  inductor-fwd, -bwd       torch.compile of F.max_pool2d on an input that requires grad: the forward, then the
                           backward (all of each one's kernels)
  aten-fwd, aten-bwd       aten.max_pool2d_with_indices and its backward
Each backward of ours is also checked against the gather's one-gradient result (cells: bitwise; sum2: within fp16
rounding of the fp32 sum).

    python scripts/pool_bench.py [--batch 32 64] [--iters 50] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sweep_kernels  # noqa: E402 - scripts/sweep_kernels.py, beside this file
from cutlass_byoc.offload import pool_kernels, pooling  # noqa: E402

CL = torch.channels_last
K, S, P, D = [3, 3], [2, 2], [1, 1], [1, 1]


def kernel_us(fn, iters: int) -> dict[str, float]:
    """Each CUDA kernel's time per call of fn (us, mean over iters; sweep_kernels.kernel_times), the L2 cache flushed
    before each call (256 MB rewritten; its kernel left out)."""
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")

    def step(_):
        flush.bitwise_not_()
        fn()

    return {name: us for name, us, _ in sweep_kernels.kernel_times(step, iters) if "bitwise_not" not in name}


def bench(batch: int, iters: int) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(batch, 64, 112, 112, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    vals, offsets = pooling._fwd_outputs(x, K, S, P, D, False)
    g = torch.randn(vals.shape, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    g2 = torch.randn_like(g)
    gi = pooling._bwd_output(g, list(x.shape), True)
    rows = []

    def row(name, fn=None, check=None, times=None, us=None):
        """A row of fn's kernels (or of the given kernel times; us: their total, else their sum)."""
        times = kernel_us(fn, iters) if times is None else times
        r = dict(batch=batch, row=name, us=round(sum(times.values()) if us is None else us, 2),
                 kernels={k[:90]: round(v, 2) for k, v in sorted(times.items(), key=lambda kv: -kv[1])})
        if check is not None:
            r["check"] = check()
        rows.append(r)
        print(f"b{batch} {name:24s} {r['us']:8.2f} us  {r.get('check', '')}  {list(r['kernels'])[:3]}", flush=True)

    row("ours-fwd", lambda: pool_kernels.max_pool2d_fwd(x, vals, offsets, K, S, P, D))
    ref = pooling._bwd_output(g, list(x.shape), True)
    pool_kernels.max_pool2d_bwd(g, offsets, ref, K, S, P, D, cells=False)
    ref2 = pooling._bwd_output(g, list(x.shape), True)
    pool_kernels.max_pool2d_bwd((g.float() + g2.float()).half(), offsets, ref2, K, S, P, D, cells=False)

    def same(r, exact):
        def check():
            if exact:
                return "bitwise" if torch.equal(gi, r) else f"DIFFERS max {float((gi.float() - r.float()).abs().max())}"
            err = float((gi.float() - r.float()).abs().max())
            return f"max diff {err:.3g}" + ("" if err <= 2e-3 * max(1.0, float(r.float().abs().max())) else " TOO LARGE")
        return check

    for cells in (False, True):
        kind = "cells" if cells else "gather"
        row(f"ours-bwd-{kind}", lambda: pool_kernels.max_pool2d_bwd(g, offsets, gi, K, S, P, D, cells=cells),
            same(ref, True))
        row(f"ours-bwd-{kind}-sum2",
            lambda: pool_kernels.max_pool2d_bwd(g, offsets, gi, K, S, P, D, cells=cells, grad2=g2), same(ref2, False))
    row("add", lambda: torch.add(g, g2))

    torch._dynamo.reset()
    pool = torch.compile(lambda t: F.max_pool2d(t, 3, 2, 1))
    xr = x.detach().requires_grad_()
    holder = {}

    def fwd():
        holder["y"] = pool(xr)

    def bwd():
        xr.grad = None
        pool(xr).backward(g)

    fw = kernel_us(fwd, iters)
    row("inductor-fwd", times=fw)
    fb = kernel_us(bwd, iters)  # the forward and the backward: the backward is the difference
    row("inductor-bwd", times={k: v for k, v in fb.items() if k not in fw}, us=sum(fb.values()) - sum(fw.values()))
    xr.grad = None
    v_idx = {}

    def aten_fwd():
        v_idx["r"] = torch.ops.aten.max_pool2d_with_indices(x, K, S, P, D, False)

    row("aten-fwd", aten_fwd)
    row("aten-bwd", lambda: torch.ops.aten.max_pool2d_with_indices_backward(g, x, K, S, P, D, False, v_idx["r"][1]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("pool_bench: no CUDA GPU")
        return 3
    rows = [r for b in args.batch for r in bench(b, args.iters)]
    bad = [r for r in rows if "DIFFERS" in r.get("check", "") or "TOO LARGE" in r.get("check", "")]
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                             rows=rows), indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
