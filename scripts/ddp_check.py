#!/usr/bin/env python3
"""Data-parallel training with the cutlass_byoc backend (issue 15): DDP + torch.compile under torchrun.

    torchrun --standalone --nproc_per_node 2 scripts/ddp_check.py --steps 5 --batch 32            # 2 ranks x 16
    torchrun --standalone --nproc_per_node 1 scripts/ddp_check.py --steps 5 --batch 32            # reference: 1 x 32
    torchrun --standalone --nproc_per_node 1 scripts/ddp_check.py --steps 5 --batch 32 --accum 2  # 1 GPU, 2 x 16
    torchrun --standalone --nproc_per_node 2 scripts/ddp_check.py --steps 5 --batch 32 --mode inductor
    python scripts/ddp_check.py --compare runs.jsonl                                               # loss / time table

ResNet-50 (torchvision's; tests/models.py's when torchvision is missing), channels_last, fp16 autocast, DDP, then
torch.compile with backend="cutlass_byoc" (``--mode inductor``: the DDP + Inductor baseline; ``--mode eager``: no
compile). Seeded weights and fixed data: every step's global batch is drawn from one seeded generator on every rank
and split across the ranks by rank order, so a run on N GPUs and a run on one GPU see the same global batches.

BatchNorm: ``--bn frozen`` (the default) runs BN on running statistics taken from one fixed batch before training
(eval mode; its affine parameters still train), so the N-rank run and the one-GPU run are the same computation and their losses agree within autocast
tolerance. ``--bn train`` is ordinary DDP (each rank normalises with its own batch's statistics: a different
computation from one GPU with the whole batch, so the losses differ by more than rounding); ``--bn sync`` uses
SyncBatchNorm.

Rank 0 prints one JSON line (and appends it to ``--json``): the global loss per step (the mean over ranks of each
rank's mean loss = the loss of the global batch), the first step's time (compilation, tuning) and the median of the
others, the offload report over all graphs (DDP's graph splitting gives one graph per bucket), what each rank
compiled and tuned, the kernels compiled per host (by the ranks' own count of nvcc runs, and from the kernel cache's
meta.json records newer than the run's start), and whether the ranks launched the same kernels for the same
problems.

Comparing losses: the N-rank run and the one-GPU run of the same global batch are the same computation, but a batch
of 32 runs other kernels (other conv problems, other cuDNN/Inductor choices) than two of 16, and ResNet-50 at
initialisation is sensitive to rounding (its fp32 gradients differ from fp64 ones by ~1% here), so after an update the
losses drift apart by more than one rounding: compare the first step's loss tightly (fp16: ~1e-3) and later ones
loosely. ``--accum 2`` on one GPU runs the 2 x 16 micro-batches of the 2-rank run, i.e. the very same conv problems
and kernels: that pair's first-step loss agrees exactly (seen on 2 x H200); later steps follow updates whose fp16
gradient sums were added in another order (over the ranks by NCCL, over the micro-batches by autograd), and drift
like the other runs (on the CPU in fp32 the pair agrees to ~1e-7 with the same thread count).

NCCL: NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set unless given (no NVLink multicast).
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if (REPO / "cutlass_byoc").is_dir() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's package, also where another copy is installed


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32, help="global batch (split across the ranks)")
    ap.add_argument("--accum", type=int, default=1,
                    help="split each rank's batch into this many micro-batches and accumulate their gradients: "
                         "`--nproc_per_node 1 --accum 2` runs the same conv problems as 2 ranks")
    ap.add_argument("--mode", choices=["cutlass_byoc", "inductor", "eager"], default="cutlass_byoc")
    ap.add_argument("--select", choices=["cached", "heuristic", "tune"], default="cached",
                    help="the backend's kernel selection (tune: one rank tunes, the others wait for its decisions)")
    ap.add_argument("--bn", choices=["frozen", "train", "sync"], default="frozen")
    ap.add_argument("--amp", choices=["fp16", "bf16", "none"], default="fp16")
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--lr", type=float, default=1e-4, help="SGD learning rate (frozen BN from random init: keep it small)")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="append rank 0's JSON line to this file")
    ap.add_argument("--label", default=None, help="a name for this run in the JSON line")
    ap.add_argument("--compare", nargs="+", default=None, metavar="JSONL",
                    help="print the runs recorded in these files side by side (the first run is the reference)")
    return ap.parse_args(argv)


def build_model():
    try:
        import torchvision  # noqa: PLC0415

        return torchvision.models.resnet50(weights=None), "torchvision.models.resnet50"
    except ImportError:
        sys.path.insert(0, str(REPO / "tests"))
        from models import resnet50  # noqa: PLC0415

        return resnet50(), "tests/models.py:resnet50 (torchvision is not installed)"


def global_batches(steps: int, batch: int, image: int, seed: int):
    """The same global batches on every rank and in every run: (inputs, labels) per step, on the CPU."""
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(batch, 3, image, image, generator=g), torch.randint(0, 1000, (batch,), generator=g))
            for _ in range(steps)]


def calibrate_bn(model, device, image: int, seed: int, n: int = 16) -> None:
    """For --bn frozen: set every BatchNorm's running statistics to those of one fixed batch (the same on every rank
    and in every run), so the frozen network is normalised (at initialisation they are 0 and 1: an unnormalised
    ResNet-50, whose activations overflow fp16)."""
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(n, 3, image, image, generator=g).to(device).contiguous(memory_format=torch.channels_last)
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in bns]
    for m in bns:
        m.momentum = 1.0  # running stats := this batch's
    model.train()
    with torch.no_grad():
        model(x)
    for m, mom in zip(bns, saved):
        m.momentum = mom
    model.eval()


class CompileCounter:
    """Counts the kernels this process compiles (each nvcc run of build._run_ninja), to show one build per host."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.seconds = 0.0
        try:
            from cutlass_byoc import build as build_mod  # noqa: PLC0415
        except ImportError:
            return
        real = build_mod._run_ninja

        def counted(jobs_, cache, jobs, progress):
            t0 = time.perf_counter()
            try:
                return real(jobs_, cache, jobs, progress)
            finally:
                self.seconds += time.perf_counter() - t0
                self.keys += [j.key for j in jobs_]

        build_mod._run_ninja = counted


def cache_records_since(t0: float) -> dict:
    """Kernels in this host's cache whose meta.json (or failed.json) was written since t0 (wall clock)."""
    from cutlass_byoc.cache import cache_root  # noqa: PLC0415

    root = cache_root()
    n_ok = n_failed = 0
    for name in ("meta.json", "failed.json"):
        for p in (root / "kernels").glob(f"*/*/{name}"):
            try:
                built = json.loads(p.read_text()).get("built_at") or 0
            except (OSError, ValueError):
                continue
            if built >= t0:
                if name == "meta.json":
                    n_ok += 1
                else:
                    n_failed += 1
    return {"root": str(root), "compiled": n_ok, "failed": n_failed}


def report_summary(args) -> dict:
    if args.mode != "cutlass_byoc":
        return {}
    from cutlass_byoc.offload import library  # noqa: PLC0415
    from cutlass_byoc.offload.backend import reports  # noqa: PLC0415
    from cutlass_byoc.offload.report import OffloadReport, Pass  # noqa: PLC0415

    reps = reports()
    merged = OffloadReport("all graphs")
    for r in reps:
        merged = merged.merge(r)
    rt = library.RUNTIME
    return {
        "graphs": len(reps),
        "graphs_failed": [r.failure for r in reps if r.failure],
        "offloaded": {k.value: [merged.count(k), merged.count(k, None)] for k in Pass if merged.count(k, None)},
        "kernel_calls": rt.kernel_calls, "fallbacks": dict(rt.fallbacks), "reference_calls": rt.reference_calls,
        "summary_first_graph": reps[0].summary().splitlines()[0] if reps else None,
    }


def launches_used(args) -> dict:
    """problem -> launch name this rank bound or chose (call sites, then the general path's choices)."""
    if args.mode != "cutlass_byoc":
        return {}
    from cutlass_byoc import select as select_mod  # noqa: PLC0415
    from cutlass_byoc.offload import library  # noqa: PLC0415

    out = {}
    for key, launch in list(getattr(select_mod, "_chosen", {}).items()):
        if launch is not None and getattr(key[1], "value", key[1]) == args.select:
            out[key[0].name] = launch.name
    for s in list(getattr(library, "_SITES", [])):
        if s.state:
            out[s.problem.name] = s.state.name
    return out


def compare(paths) -> int:
    runs = []
    for p in paths:
        for line in Path(p).read_text().splitlines():
            if line.strip():
                runs.append(json.loads(line))
    if not runs:
        print("no runs")
        return 1
    ref = runs[0]
    print(f"reference: {ref.get('label')} ({ref['world_size']} x {ref['local_batch']})")
    print(f"{'run':40s} {'ranks':>5s} {'step ms':>8s} {'first s':>8s} {'max rel loss diff':>18s} {'max rel grad diff':>18s}  losses")
    for r in runs:
        n = min(len(r["losses"]), len(ref["losses"]))
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"][:n], ref["losses"][:n]))
        gdiff = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r.get("grad_norms", []), ref.get("grad_norms", []))),
                    default=float("nan"))
        print(f"{str(r.get('label'))[:40]:40s} {r['world_size']:5d} {r['step_ms']:8.1f} {r['first_step_s']:8.1f} "
              f"{diff:18.2e} {gdiff:18.2e}  " + " ".join(f"{x:.4f}" for x in r["losses"]))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        return compare(args.compare)

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    if "RANK" not in os.environ:  # plain `python scripts/ddp_check.py`: a one-rank job
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if args.batch % (world * args.accum):
        raise SystemExit(f"--batch {args.batch} does not split over {world} ranks x {args.accum} micro-batches")
    local = args.batch // world
    micro = local // args.accum
    t_run0 = time.time()
    counter = CompileCounter()

    torch.manual_seed(args.seed)
    model, model_name = build_model()
    if args.bn == "sync":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last)
    if args.bn == "frozen":
        calibrate_bn(model, device, args.image, args.seed)
    ddp = DDP(model, device_ids=[local_rank] if cuda else None)
    if args.bn == "frozen":
        ddp.eval()  # running statistics: each sample's loss is independent of the batch it shares
    if args.mode == "cutlass_byoc":
        import cutlass_byoc.offload.backend  # noqa: F401, PLC0415 - registers the backend

        net = torch.compile(ddp, backend="cutlass_byoc", options={"select": args.select})
    elif args.mode == "inductor":
        net = torch.compile(ddp)
    else:
        net = ddp
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16, "none": None}[args.amp]

    data = global_batches(args.steps, args.batch, args.image, args.seed)
    lo, hi = rank * local, (rank + 1) * local
    losses, times, gnorms, psums = [], [], [], []
    for x_all, y_all in data:
        x = x_all[lo:hi].to(device).contiguous(memory_format=torch.channels_last)
        y = y_all[lo:hi].to(device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for i in range(args.accum):  # (DDP averages the accumulated gradients over the ranks at each backward)
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                out = net(x[i * micro:(i + 1) * micro])
            part = F.cross_entropy(out.float(), y[i * micro:(i + 1) * micro]) / args.accum
            part.backward()
            loss = loss + part.detach()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        # the gradient of the global batch's loss (DDP averaged it over the ranks), outside the timed region
        psums.append(torch.stack([p.detach().double().abs().sum() for p in model.parameters()]).sum())
        gnorms.append(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()
                                                            if p.grad is not None])))

    loss_t = torch.stack(losses).float()
    dist.all_reduce(loss_t)  # after the timed steps: no extra sync inside them
    global_losses = (loss_t / world).tolist()

    from cutlass_byoc.profiler import coordinate  # noqa: PLC0415

    mine = {
        "rank": rank, "local_rank": local_rank, "host": socket.gethostname(), "pid": os.getpid(),
        "compiled_keys": counter.keys, "compile_s": counter.seconds, "cache_records": cache_records_since(t_run0),
        "tuning": dict(coordinate.STATS), "launches": launches_used(args), "offload": report_summary(args),
        "step_ms": 1e3 * statistics.median(times[1:]) if len(times) > 1 else None, "first_step_s": times[0],
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        hosts: dict = {}
        for r in everyone:
            h = hosts.setdefault(r["host"], {"ranks": [], "compiled_by_ranks": 0, "distinct": set(),
                                            "cache_records_since_start": r["cache_records"]})
            h["ranks"].append(r["rank"])
            h["compiled_by_ranks"] += len(r["compiled_keys"])
            h["distinct"].update(r["compiled_keys"])
        per_host = {}
        for name, h in hosts.items():
            per_host[name] = {"ranks": h["ranks"], "kernels_compiled": h["compiled_by_ranks"],
                              "distinct_kernels": len(h["distinct"]),
                              "compiled_twice": h["compiled_by_ranks"] - len(h["distinct"]),
                              "cache_records_since_start": h["cache_records_since_start"]}
        base = everyone[0]["launches"]
        common = [p for p in base if all(p in r["launches"] for r in everyone)]
        same = all(r["launches"][p] == base[p] for r in everyone for p in common)
        rec = {
            "label": args.label or f"{args.mode}/{args.select} {world}x{local}"
                     + (f" ({args.accum}x{micro})" if args.accum > 1 else ""),
            "mode": args.mode, "select": args.select, "bn": args.bn, "amp": args.amp, "model": model_name,
            "world_size": world, "global_batch": args.batch, "local_batch": local, "micro_batch": micro,
            "accum": args.accum, "steps": args.steps,
            "image": args.image, "seed": args.seed,
            "losses": global_losses,
            "grad_norms": [float(g) for g in gnorms],
            "param_abs_sums": [float(p) for p in psums],  # after each step's update: the runs' weights agree?
            "first_step_s": times[0],
            "step_ms": 1e3 * statistics.median(times[1:]) if len(times) > 1 else None,
            "step_ms_per_rank": [r["step_ms"] for r in everyone],
            "images_per_s": args.batch / statistics.median(times[1:]) if len(times) > 1 else None,
            "offload": everyone[0]["offload"],
            "kernels_per_host": per_host,
            "tuning_per_rank": {str(r["rank"]): r["tuning"] for r in everyone},
            "compiled_per_rank": {str(r["rank"]): len(r["compiled_keys"]) for r in everyone},
            "same_launches": {"problems_compared": len(common), "same": same},
            "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "torch": torch.__version__,
            "nccl_env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
        }
        line = json.dumps(rec, sort_keys=True)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
