"""Compile, on a machine without a GPU, the kernels the GPU round's tests and offload benchmark will launch, and pack
them into one compressed archive that the device tool can carry (a kernel is ~1.1 MB, ~250 kB compressed; the
device tool carries at most 64 MiB). ``scripts/gpu_round.sh`` unpacks ``.kcache.tar.xz`` into the cache its tests
and offload steps use; the tune step always starts from its own cold cache.

    python scripts/warm_cache.py [--jobs N] [--cache-dir .kcache] [--archive .kcache.tar.xz] [--list]

Which kernels: the fixed picks of the GPU test modules (conv, split-k, sm90, sm90 split-k, padding, tune), and the kernels the offload
partitioner chooses (compile-time select: decision cache, else heuristic) for the models and batch sizes of
tests/test_gpu_offload.py and ``cutlass_byoc.offload.bench``, traced here on fake tensors under fp16 autocast.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from cutlass_byoc.build import build  # noqa: E402
from cutlass_byoc.cache import KernelCache  # noqa: E402
from cutlass_byoc.config import KernelConfig  # noqa: E402

#: (model, batch, channels_last) of the offload GPU tests and benchmark, at 224x224
OFFLOAD_RUNS = [("resnet50", 16, True), ("mobilenet_v2", 16, True), ("resnet18", 16, False),
                ("resnet50", 64, True), ("mobilenet_v2", 64, True)]


def test_kernels() -> list[KernelConfig]:
    import test_gpu_conv  # noqa: PLC0415
    import test_gpu_padding  # noqa: PLC0415
    import test_gpu_sm90  # noqa: PLC0415
    import test_gpu_sm90_splitk  # noqa: PLC0415
    import test_gpu_splitk  # noqa: PLC0415
    import test_gpu_tune  # noqa: PLC0415
    from cutlass_byoc.profiler.plan import plan_workload  # noqa: PLC0415

    cfgs = test_gpu_conv.all_configs() + test_gpu_splitk.used_configs() + test_gpu_sm90._used_configs()
    cfgs += test_gpu_sm90_splitk.used_configs() + test_gpu_padding.used_configs()
    cfgs += plan_workload(test_gpu_tune.PROBLEMS, max_candidates=2).kernels
    return cfgs


def offload_kernels(runs=OFFLOAD_RUNS) -> list[KernelConfig]:
    from models import MODELS  # noqa: PLC0415

    from cutlass_byoc.offload import OffloadOptions  # noqa: PLC0415
    from cutlass_byoc.offload.trace import explain  # noqa: PLC0415

    out: list[KernelConfig] = []
    for name, batch, channels_last in runs:
        torch.manual_seed(0)
        model = MODELS[name]()
        x = torch.randn(batch, 3, 224, 224)
        if channels_last:
            model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

        with FakeTensorMode(allow_non_fake_inputs=True):
            _, rep = explain(model, x, training=True, autocast=torch.float16,
                             options=OffloadOptions(require_cuda=False, prebuild=False))
        kernels = [launch.kernel for launch in rep.launches]
        print(f"{name} batch {batch}: {len(rep.launches)} launches, {len(set(kernels))} kernels", flush=True)
        out += kernels
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", "-j", type=int, default=None)
    ap.add_argument("--cache-dir", type=Path, default=ROOT / ".kcache")
    ap.add_argument("--archive", type=Path, default=ROOT / ".kcache.tar.xz")
    ap.add_argument("--list", action="store_true", help="print the kernels and stop")
    a = ap.parse_args()
    cfgs = list(dict.fromkeys(test_kernels() + offload_kernels()))
    print(f"{len(cfgs)} kernels", flush=True)
    if a.list:
        for c in cfgs:
            print(" ", c.name)
        return 0
    cache = KernelCache(a.cache_dir)
    t0 = time.time()
    results = build(cfgs, cache=cache, jobs=a.jobs, progress=True)
    failed = [r for r in results.values() if not r.ok]
    print(f"built in {time.time() - t0:.0f} s; {len(failed)} failed", flush=True)
    wanted = {r.entry.path.relative_to(a.cache_dir) for r in results.values() if r.ok}
    with tarfile.open(a.archive, "w:xz", preset=6) as tar:
        for rel in sorted(wanted):
            tar.add(a.cache_dir / rel, arcname=str(Path("kernels") / rel.relative_to("kernels")))
    print(f"{a.archive}: {a.archive.stat().st_size / 2**20:.1f} MiB, {len(wanted)} kernels")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
