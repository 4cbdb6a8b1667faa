"""Compile, on a machine without a GPU, the kernels the GPU round's tests and offload benchmark will launch, and pack
them into one compressed archive that the device tool can carry (a kernel is ~1.1 MB, ~250 kB compressed; the
device tool carries at most 64 MiB). ``scripts/gpu_round.sh`` unpacks ``.kcache.tar.xz`` into the cache its tests
and offload steps use; the tune step always starts from its own cold cache.

    python scripts/warm_cache.py [--jobs N] [--cache-dir .kcache] [--archive .kcache.tar.xz] [--list]

Which kernels: the fixed picks of the GPU test modules (conv, split-k, sm90, sm90 split-k, padding, tune,
depthwise), and the kernels the offload
partitioner chooses (compile-time select: decision cache, else heuristic) for the models and batch sizes of
tests/test_gpu_offload.py and ``cutlass_byoc.offload.bench``, traced here on fake tensors under fp16 autocast.
``--depthwise``: the depthwise tests' and `tune depthwise` plan's kernels; ``--tune-model resnet50 --batch 32
--max-candidates 2``: what the round's tune-model step (TUNE_MAX=2) plans, so it compiles nothing there (``--batch 32
64``: both of the offload bench's ResNet-50 batches, for two tune-model steps);
``--modules gemm1x1 sm90_splitk``: those GPU test modules' kernels; ``--sweep 1x1 [--sweep-kinds fprop dgrad]
[--sweep-tiles 192x64x64:pingpong]``: what the round's sweep step times (scripts/sweep_kernels.py); ``--workload
default --archive .tune-cache.tar.xz``: what `cutlass-byoc tune` plans for the default workload (the round's tune
step then times only, and says it was not a cold tune; with ``--split-k-study`` also the kernels its bench's split-k
study times). The selectors add up (``--offload-only
--tune-model resnet50 --modules gemm1x1``: one archive for a round's several steps); with none, the tests' and
the offload's kernels. ``--fuzz 0:30``: what the round's fuzz step (scripts/fuzz_partition.py --device cuda)
launches.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from cutlass_byoc.build import build  # noqa: E402
from cutlass_byoc.cache import KernelCache  # noqa: E402
from cutlass_byoc.config import KernelConfig  # noqa: E402
from cutlass_byoc.offload.bench import host_overhead_problems  # noqa: E402
from models import DYNAMIC_BATCHES, DYNAMIC_FAMILIES, FAMILIES, MODELS, input_channels, model_from_spec  # noqa: E402

#: (model, batch, channels_last, training) of the offload GPU tests and benchmark, at 224x224
OFFLOAD_RUNS = [("resnet50", 16, True, True), ("mobilenet_v2", 16, True, True), ("resnet18", 16, False, True),
                ("resnet50", 32, True, True), ("resnet50", 64, True, True), ("mobilenet_v2", 32, True, True),
                ("mobilenet_v2", 64, True, True), ("resnet50", 1, True, False), ("resnet50", 32, True, False),
                ("convnext_tiny", 16, True, True), ("convnext_tiny", 32, True, True),
                ("efficientnet_b0", 16, True, True),
                # the offload bench's dynamic modes at batch 32: the step at the smaller batch (bench.DYNAMIC_FRACTION)
                ("resnet50", 24, True, True)]
#: (family, batch, image) of tests/test_gpu_families.py and tests/test_gpu_host_path.py (fp16 autocast, training)
FAMILY_RUNS = [(name, 8, 64) for name in sorted(FAMILIES)] + [("chain_pool", 8, 32)]
#: tests/test_gpu_dynamic.py's other batch sizes: the dynamic graph's plan (the second size) and, where the plan's
#: launch cannot take a batch size, the launch chosen for it
FAMILY_RUNS += [(name, n, 64) for name in DYNAMIC_FAMILIES for n in sorted(set(DYNAMIC_BATCHES) - {8})]
#: tests/test_gpu_bn_stats.py's runs (model, batch, image): the plain launches and their channel-statistics twins
from test_gpu_bn_stats import RUNS as BN_STATS_RUNS  # noqa: E402


#: each GPU test module's kernels, by the module's name without test_gpu_ (--modules; all of them: --tests-only)
MODULE_KERNELS = {
    "conv": lambda m: m.all_configs(), "splitk": lambda m: m.used_configs(), "sm90": lambda m: m._used_configs(),
    "sm90_splitk": lambda m: m.used_configs(), "sm90_pingpong": lambda m: m.used_configs(),
    "padding": lambda m: m.used_configs(),
    "epilogues": lambda m: m.all_configs(), "gemm1x1": lambda m: list(m.KERNELS.values()),
    "im2col": lambda m: list(m.KERNELS.values()),
    "tune": lambda m: [*_plan_kernels(m.PROBLEMS, 2), *m.backend_kernels()], "depthwise": lambda m: m.all_kernels(),
    "s2d": lambda m: m.used_configs(), "smem_im2col": lambda m: m.used_configs(),
    "launch_memo": lambda m: m.used_configs(), "channel_stats": lambda m: m.used_configs(),
    "fuzz": lambda m: m.kernels(),
}


def stats_twins(cfgs: list[KernelConfig]) -> list[KernelConfig]:
    """The channel-statistics twins (KernelConfig.with_channel_stats: the sm90 conv fprop kernels have one) of the
    plain kernels among `cfgs`: the launches fuse_bn_stats runs in place of a plain one (offload.library.stats_launch)."""
    twins = (c.with_channel_stats() for c in cfgs if not c.channel_stats)
    return list(dict.fromkeys(t for t in twins if t is not None))


def _plan_kernels(problems, max_candidates: int):
    from cutlass_byoc.profiler.plan import plan_workload  # noqa: PLC0415

    return plan_workload(problems, max_candidates=max_candidates).kernels


def module_kernels(names: list[str]) -> list[KernelConfig]:
    """The kernels of the named GPU test modules (tests/test_gpu_<name>.py, see MODULE_KERNELS)."""
    import importlib  # noqa: PLC0415

    out: list[KernelConfig] = []
    for name in names:
        if name not in MODULE_KERNELS:
            raise SystemExit(f"--modules: expected names among {sorted(MODULE_KERNELS)}, got {name!r}")
        out += MODULE_KERNELS[name](importlib.import_module(f"test_gpu_{name}"))
    return out


def test_kernels() -> list[KernelConfig]:
    """Every GPU test module's kernels."""
    return module_kernels(list(MODULE_KERNELS))


def depthwise_kernels(kinds: Optional[list[str]] = None) -> list[KernelConfig]:
    """test_gpu_depthwise.py's kernels and the tune plan of the named workload `depthwise` (its defaults: batch 32,
    fp16, every kind or `kinds`, the default candidate budget), as `cutlass-byoc tune depthwise [--kinds ...]` makes
    it."""
    from cutlass_byoc.profiler.plan import DEFAULT_MAX_CANDIDATES  # noqa: PLC0415

    return module_kernels(["depthwise"]) + workload_kernels("depthwise", DEFAULT_MAX_CANDIDATES, kinds)


def workload_kernels(name: str, max_candidates: int, kinds: Optional[list[str]] = None) -> list[KernelConfig]:
    """The kernels `cutlass-byoc tune NAME --max-candidates K [--kinds ...]` plans for a named workload (its defaults:
    batch 32, fp16, every kind or `kinds`) or a workload file (as the round's TUNE_WORKLOAD, which names its own
    kinds): carried to the GPU round as .tune-cache.tar.xz, its tune step then only times."""
    from cutlass_byoc.workloads import workload  # noqa: PLC0415

    problems = [getattr(item, "problem", item) for item in workload(name, **({"kinds": kinds} if kinds else {}))]
    kernels = list(_plan_kernels(problems, max_candidates))
    print(f"tune {name}: {len(problems)} problems, {len(kernels)} kernels", flush=True)
    return kernels


def _launch_kernels(model, batch: int, image: int, channels_last: bool, training: bool, what: str,
                    options: dict | None = None) -> list:
    from cutlass_byoc.offload.trace import model_problems  # noqa: PLC0415
    from cutlass_byoc.select import choose  # noqa: PLC0415

    c = input_channels(model)
    problems, rep = model_problems(model, batch, training=training, image=image, in_channels=c,
                                   channels_last=channels_last, options=options)
    kernels = []
    for p in problems:  # what the call sites launch at run time (a channel-padded launch names its kernel too)
        launch = choose(p, "cached")
        if launch is not None:
            kernels.append(launch.kernel)
    # the channel-statistics twins the partitioner chose (options fuse_bn_stats)
    kernels += [launch.kernel for launch in rep.launches if launch.kernel.channel_stats]
    print(f"{what}: {len(problems)} problems, {len(set(kernels))} kernels", flush=True)
    return kernels


def tune_model_kernels(models: list[str], batch: int, training: bool, max_candidates: int) -> list[KernelConfig]:
    """The kernels `cutlass-byoc tune --model M --batch B [--training] --amp fp16 --max-candidates K` plans for each
    model (tests/models.py's resnet18 / resnet50 / mobilenet_v2, torchvision's twins; or a `pkg.module:factory`
    spec), traced on fake tensors here: carried to the GPU round, its tune-model step then compiles nothing."""
    from cutlass_byoc.offload.trace import model_problems  # noqa: PLC0415

    out: list[KernelConfig] = []
    for spec in models:
        problems, _ = model_problems(model_from_spec(spec), batch, training=training)
        kernels = list(_plan_kernels(problems, max_candidates))
        print(f"tune --model {spec} --batch {batch}: {len(problems)} problems, {len(kernels)} kernels", flush=True)
        out += kernels
    return out


def host_overhead_kernels() -> list[KernelConfig]:
    """The heuristic launches of the offload benchmark's host-overhead problems, which every offload-bench step runs."""
    from cutlass_byoc.select import choose  # noqa: PLC0415

    return [choose(p, "heuristic").kernel for p in host_overhead_problems().values()]


def offload_runs(skip=()) -> list[tuple]:
    """OFFLOAD_RUNS without the runs of the models in `skip` (--skip-models)."""
    skip = set(skip)
    return [r for r in OFFLOAD_RUNS if r[0] not in skip]


def offload_kernels(runs=OFFLOAD_RUNS, families=FAMILY_RUNS) -> list[KernelConfig]:
    out: list[KernelConfig] = []
    for name, batch, channels_last, training in runs:
        torch.manual_seed(0)
        out += _launch_kernels(MODELS[name](), batch, 224, channels_last, training,
                               f"{name} batch {batch} {'training' if training else 'inference'}")
    for name, batch, image in families:
        out += _launch_kernels(FAMILIES[name](), batch, image, True, True, f"family {name} batch {batch}")
    for name, batch, image in BN_STATS_RUNS if families else ():
        out += _launch_kernels(MODELS[name](), batch, image, True, True, f"{name} batch {batch} with fused statistics",
                               {"fuse_bn_stats": True})
    return out


def _fuzz_seeds(text: str) -> range:
    import fuzz_partition  # noqa: PLC0415 - scripts/fuzz_partition.py, beside this file

    return fuzz_partition.seed_range(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", "-j", type=int, default=None)
    ap.add_argument("--cache-dir", type=Path, default=ROOT / ".kcache")
    ap.add_argument("--archive", type=Path, default=ROOT / ".kcache.tar.xz")
    ap.add_argument("--list", action="store_true", help="print the kernels and stop")
    ap.add_argument("--offload-only", action="store_true", help="the offload tests' and benchmark's kernels")
    ap.add_argument("--offload-tests", action="store_true",
                    help="tests/test_gpu_offload.py's kernels alone (its batch-16 runs; not the benchmark's cases)")
    ap.add_argument("--families", action="store_true",
                    help="the model-family runs' kernels alone (tests/test_gpu_families.py, tests/test_gpu_host_path.py)")
    ap.add_argument("--tests-only", action="store_true",
                    help="the GPU test modules' kernels and the model-family tests' (no ResNet/MobileNet runs)")
    ap.add_argument("--depthwise", action="store_true",
                    help="the depthwise GPU tests' kernels and those `cutlass-byoc tune depthwise` plans (so the "
                         "round's tune-depthwise step compiles nothing)")
    ap.add_argument("--tune-model", nargs="+", default=None, metavar="MODEL",
                    help="the kernels `cutlass-byoc tune --model MODEL` plans (resnet18, resnet50, mobilenet_v2 "
                         "or pkg.module:factory), at --batch, training unless --inference, with --max-candidates, "
                         "and those of the offload benchmark's host-overhead problem")
    ap.add_argument("--workload", nargs="+", default=None, metavar="NAME",
                    help="the kernels `cutlass-byoc tune NAME` plans for these named workloads (default, depthwise, "
                         "all) with --max-candidates; archive them as .tune-cache.tar.xz for the round's tune step")
    ap.add_argument("--split-k-study", action="store_true",
                    help="the kernels of `cutlass-byoc bench --split-k`'s two sides on the default workload's wgrad "
                         "layers (each side's best picks, most of them outside the tune's plan): with --workload "
                         "default, the round's tune and bench steps then compile nothing")
    ap.add_argument("--kinds", nargs="+", default=None, choices=["fprop", "dgrad", "wgrad"],
                    help="--workload (named ones) and --depthwise: these kinds' problems only, as `tune --kinds`")
    ap.add_argument("--batch", type=int, nargs="+", default=[32],
                    help="--tune-model: each of these batch sizes (e.g. 32 64: the offload bench's two ResNet-50 cases "
                         "in one archive); --channel-stats: the first")
    ap.add_argument("--inference", action="store_true")
    ap.add_argument("--max-candidates", type=int, default=None)
    ap.add_argument("--no-archive", action="store_true", help="build into --cache-dir only (e.g. on the GPU machine)")
    ap.add_argument("--sweep", nargs="+", default=None, choices=["1x1", "3x3"],
                    help="scripts/sweep_kernels.py's kernels of these cells (the round's sweep step)")
    ap.add_argument("--sweep-kinds", nargs="+", default=["fprop", "dgrad", "wgrad"])
    ap.add_argument("--sweep-tiles", nargs="+", default=[], metavar="MxNxK:SCHEDULE[:nosrc][:cMxNx1][:eMxN][:sd[N]]")
    ap.add_argument("--sweep-store-stages", action="store_true",
                    help="with --sweep: each sourceless GEMM 1x1 kernel's twin with one epilogue D buffer per "
                         "sub-tile too (the round's SWEEP_STORE_STAGES=1)")
    ap.add_argument("--sweep-tiles-only", action="store_true",
                    help="with --sweep: the --sweep-tiles configs (and the twins asked for) alone, not the family's "
                         "kernels: the round's sweep then times those and whatever else the cache holds")
    ap.add_argument("--channel-stats", action="store_true",
                    help="the round's channel-stats step's kernels (scripts/channel_stats_bench.py on ResNet-50 at "
                         "--batch: one plain sm90 kernel per fprop problem and schedule, and its statistics twin)")
    ap.add_argument("--fuzz", default=None, metavar="A:B", type=_fuzz_seeds,
                    help="the kernels `scripts/fuzz_partition.py --device cuda --seeds A:B` launches (the round's "
                         "fuzz step, FUZZ_SEEDS), its programs partitioned here under fp16 autocast")
    ap.add_argument("--stats-twins", action="store_true",
                    help="also the channel-statistics twin (KernelConfig.with_channel_stats) of every sm90 conv fprop "
                         "kernel selected: what the offload bench's bnstats modes (fuse_bn_stats) launch after "
                         "`tune --model`")
    ap.add_argument("--skip-models", nargs="+", default=[], choices=sorted({r[0] for r in OFFLOAD_RUNS}),
                    metavar="MODEL", help="leave these models' offload runs out (e.g. convnext_tiny efficientnet_b0 "
                    "for a round whose offload tests run with -k 'not convnext and not efficientnet')")
    ap.add_argument("--modules", nargs="+", default=None, metavar="NAME",
                    help=f"the kernels of these GPU test modules ({', '.join(MODULE_KERNELS)}): "
                         "the archive of a round that runs a few test modules and tunes a model")
    a = ap.parse_args()
    # The selectors add up (one archive for a round's several steps); none of them: the tests' and the offload's.
    from cutlass_byoc.profiler.plan import DEFAULT_MAX_CANDIDATES  # noqa: PLC0415

    mc = a.max_candidates or DEFAULT_MAX_CANDIDATES
    runs = offload_runs(a.skip_models)
    cfgs: list[KernelConfig] = []
    if a.tune_model:
        for batch in a.batch:
            cfgs += tune_model_kernels(a.tune_model, batch, not a.inference, mc)
        cfgs += host_overhead_kernels()
    for name in a.workload or []:
        cfgs += workload_kernels(name, mc, a.kinds)
    if a.split_k_study:
        from cutlass_byoc.profiler.splitk import study_kernels  # noqa: PLC0415
        from cutlass_byoc.workloads import default_workload  # noqa: PLC0415

        study = study_kernels(default_workload())
        print(f"split-k study: {len(study)} kernels", flush=True)
        cfgs += study
    if a.depthwise:
        cfgs += depthwise_kernels(a.kinds)
    if a.modules:
        cfgs += module_kernels(a.modules)
    if a.sweep:
        import sweep_kernels  # noqa: PLC0415 - scripts/sweep_kernels.py, beside this file

        tiles = [sweep_kernels.parse_tile(t) for t in a.sweep_tiles]
        cfgs += [k for it in sweep_kernels.cells(a.sweep, a.sweep_kinds)
                 for k in sweep_kernels.kernels_of(it.problem, tiles, store_stages=a.sweep_store_stages,
                                                   tiles_only=a.sweep_tiles_only)]
    if a.channel_stats:
        import channel_stats_bench  # noqa: PLC0415 - scripts/channel_stats_bench.py, beside this file

        torch.manual_seed(0)
        cfgs += channel_stats_bench.kernels(channel_stats_bench.fprop_problems(MODELS["resnet50"](), a.batch[0]))
    if a.fuzz:
        import fuzz_partition  # noqa: PLC0415 - scripts/fuzz_partition.py, beside this file

        fuzzed = fuzz_partition.fuzz_kernels(a.fuzz)
        print(f"fuzz seeds {a.fuzz.start}:{a.fuzz.stop}: {len(fuzzed)} kernels", flush=True)
        cfgs += fuzzed
    if a.tests_only:
        cfgs += test_kernels() + offload_kernels([])  # the model-family tests' runs too
    if a.offload_only:
        cfgs += offload_kernels(runs)
    if a.families:
        cfgs += offload_kernels([])
    if a.offload_tests:
        cfgs += offload_kernels([r for r in runs if r[1] == 16], [])
    if not (a.tune_model or a.workload or a.split_k_study or a.depthwise or a.modules or a.sweep or a.tests_only
            or a.offload_only or a.families or a.offload_tests or a.channel_stats or a.fuzz):
        cfgs += test_kernels() + offload_kernels(runs)
    if a.stats_twins:
        cfgs += stats_twins(cfgs)
    cfgs = list(dict.fromkeys(cfgs))
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
    for r in failed:
        print(f"  failed: {r.entry.path}", flush=True)
    if a.no_archive:
        return 1 if failed else 0
    wanted = {r.entry.path.relative_to(a.cache_dir) for r in results.values() if r.ok}
    # preset 9: a 64 MiB window, which spans dozens of kernels and finds the code they share (CUTLASS's host code,
    # the templates' common parts): 1,518 depthwise kernels took 37 MB this way against about 60 at preset 6
    with tarfile.open(a.archive, "w:xz", preset=9) as tar:
        for rel in sorted(wanted):
            tar.add(a.cache_dir / rel, arcname=str(Path("kernels") / rel.relative_to("kernels")))
    print(f"{a.archive}: {a.archive.stat().st_size / 2**20:.1f} MiB, {len(wanted)} kernels")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
