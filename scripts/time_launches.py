"""Time launches of one problem on the GPU, each split into its kernel and the operand rewrites around it.

    python scripts/time_launches.py LAYER [LAYER ...] [--batch 32] [--kinds fprop,dgrad,wgrad] [--extra]
                                    [--only SUBSTRING ...]

LAYER is a layer of the default or the depthwise workload as `cutlass-byoc bench` names it (l1_3x3_64_64,
mbv2_dw_144_56, ...) or an alias (stem, down: the 1x1 stride-2 conv).

For each launch the planner offers for the problem (and with --extra, sm90 kernels of the space-to-depth fold with
narrow and usual tiles, whether planned or not), prints the whole launch's time
(ops.run_problem: rewrites and kernel), the kernel's alone on operands rewritten beforehand, and cuDNN's, with the
same timing as the profiler (profiler.timing.time_gpu, operands rotated past L2). A diagnostic: it records
nothing; `cutlass-byoc tune` decides.
"""

from __future__ import annotations

import argparse
import sys

import torch

from cutlass_byoc import ops
from cutlass_byoc.config import LaunchConfig, s2d_problem
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.profiler.plan import plan_problem
from cutlass_byoc.profiler.timing import rotation_count, time_gpu
from cutlass_byoc.sm90 import sm90_config
from cutlass_byoc.types import ConvKind, SplitKMode

#: Short names; any layer of the default workload (`cutlass-byoc bench`'s layer column) works too.
ALIASES = {"stem": "conv1_7x7_3_64_s2", "down": "l2_1x1_256_512_s2"}


def layer_problem(layer: str, kind: str, batch: int) -> Conv2dProblem:
    """The default or depthwise workload's problem of `layer` (a bench layer name or an alias) and kind, at `batch`."""
    from cutlass_byoc.workloads import default_workload  # noqa: PLC0415

    name = ALIASES.get(layer, layer)
    for item in default_workload(depthwise=True):
        if item.layer == name and item.kind.value == kind:
            return item.problem.replace(n=batch)
    raise SystemExit(f"layer: {layer!r} is not a layer of the default or depthwise workload (nor one of "
                     f"{sorted(ALIASES)})")


def extra_launches(p: Conv2dProblem) -> list[LaunchConfig]:
    """sm90 kernels for the stem's fold padded to C=16: the narrow tiles and the usual ones (none for other layers)."""
    if (p.c, p.r) != (3, 7):
        return []
    big = s2d_problem(p, 2).replace(c=16)
    out = []
    if p.kind is ConvKind.FPROP:
        for t in ((128, 64, 32), (256, 64, 32), (256, 64, 64)):
            out.append(LaunchConfig(sm90_config(big, t), pad_c=8, s2d=2))
    elif p.kind is ConvKind.DGRAD:
        for t in ((128, 16, 64), (256, 16, 64), (128, 32, 64), (256, 64, 64)):
            out.append(LaunchConfig(sm90_config(big, t), pad_c=8, s2d=2))
    else:
        for t in ((64, 16, 64), (64, 32, 64), (64, 256, 64)):
            k = sm90_config(big, t, (1, 1, 1), SplitKMode.PARALLEL)
            out += [LaunchConfig(k, s, pad_c=8, s2d=2) for s in (32, 64, 128, 256)]
    return out


def operands(p: Conv2dProblem, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cl = torch.channels_last
    x = torch.randn((p.n, p.c, p.h, p.w), generator=g, device="cuda").half().contiguous(memory_format=cl)
    w = torch.randn((p.k, p.c // p.groups, p.r, p.s), generator=g, device="cuda").half().contiguous(memory_format=cl)
    dy = torch.randn((p.n, p.k, p.p, p.q), generator=g, device="cuda").half().contiguous(memory_format=cl)
    a, b = {ConvKind.FPROP: (x, w), ConvKind.DGRAD: (dy, w), ConvKind.WGRAD: (dy, x)}[p.kind]
    shape = {ConvKind.FPROP: (p.n, p.k, p.p, p.q), ConvKind.DGRAD: (p.n, p.c, p.h, p.w),
             ConvKind.WGRAD: (p.k, p.c // p.groups, p.r, p.s)}[p.kind]
    return x, w, dy, a, b, torch.empty(shape, dtype=torch.float16, device="cuda").contiguous(memory_format=cl)


def rewritten(p: Conv2dProblem, launch: LaunchConfig, a, b):
    """The kernel's operands (ops.rewrite_operands, as ops._run_rewritten makes them) and an output for them."""
    big, a2, b2 = ops.rewrite_operands(p, launch, a, b)
    n, h, w, c = big.out_shape
    out = torch.empty((n, c, h, w), dtype=torch.float16, device="cuda").contiguous(memory_format=torch.channels_last)
    return big, a2, b2, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layers", nargs="+", help=f"default-workload layer names (bench's layer column) or {sorted(ALIASES)}")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kinds", default="fprop,dgrad,wgrad")
    ap.add_argument("--extra", action="store_true")
    ap.add_argument("--only", nargs="+", default=None, metavar="SUBSTRING",
                    help="time only the launches whose name contains one of these (e.g. under ncu)")
    args = ap.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    for layer, kind in [(la, k) for la in args.layers for k in args.kinds.split(",")]:
        p = layer_problem(layer, kind, args.batch)
        launches = list(dict.fromkeys(c.launch for c in plan_problem(p).candidates))
        if args.extra:
            launches += extra_launches(p)
        if args.only:
            launches = [l for l in launches if any(s in l.name for s in args.only)]
        sets = [operands(p, i) for i in range(3)]
        rot = rotation_count(sum(t.numel() * 2 for t in sets[0][3:]))
        sets = (sets * rot)[:rot]
        st, pd = (p.stride_h, p.stride_w), (p.pad_h, p.pad_w)

        def cudnn(i):
            x, w, dy, *_ = sets[i % len(sets)]
            if p.kind is ConvKind.FPROP:
                torch.nn.functional.conv2d(x, w, None, st, pd, 1, p.groups)
            elif p.kind is ConvKind.DGRAD:
                torch.ops.aten.convolution_backward(dy, x, w, None, st, pd, (1, 1), False, (0, 0), p.groups,
                                                    (True, False, False))
            else:
                torch.ops.aten.convolution_backward(dy, x, w, None, st, pd, (1, 1), False, (0, 0), p.groups,
                                                    (False, True, False))

        print(f"== {p.name}: cuDNN {time_gpu(cudnn, len(sets)).median_us:.1f} us", flush=True)
        print(f"{'whole us':>9} {'kernel us':>9} {'rewrite':>8}  launch")
        rows = []
        for launch in launches:
            if launch.reject_reason(p):
                print(f"{'-':>9} {'-':>9} {'-':>8}  {launch.name}: {launch.reject_reason(p)}")
                continue
            try:
                def whole(i, launch=launch):
                    _, _, _, a, b, out = sets[i % len(sets)]
                    ops.run_problem(p, a, b, out, config=launch)

                t_whole = time_gpu(whole, len(sets)).median_us
                big, a2, b2, out2 = rewritten(p, launch, *sets[0][3:5])
                inner = launch.unpadded

                def kernel(i):
                    ops.run_problem(big, a2, b2, out2, config=inner)

                t_kernel = time_gpu(kernel, 1).median_us
            except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
                print(f"{'ERR':>9} {'':>9} {'':>8}  {launch.name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append((t_whole, t_kernel, launch.name))
            print(f"{t_whole:9.1f} {t_kernel:9.1f} {t_whole - t_kernel:8.1f}  {launch.name}", flush=True)
        rows.sort()
        print(f"best: {rows[0][0]:.1f} us {rows[0][2]}" if rows else "no launch ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
