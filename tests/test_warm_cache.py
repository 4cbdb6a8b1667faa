"""scripts/warm_cache.py, the GPU round's kernel pre-compiler, in its listing mode (no compiling): each selector
names the kernels of what it stands for, and selectors given together add up into one list without repeats."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="warm_cache traces models and imports the GPU test modules with PyTorch")

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    """The module of scripts/NAME.py (warm_cache, sweep_kernels), imported with scripts/ on the path for that import."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def listed(*args: str) -> list[str]:
    """The kernel names `warm_cache.py ARGS --list` prints (its `  cb_...` lines), in order."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "warm_cache.py"), *args, "--list"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    names = [line.strip() for line in out.stdout.splitlines() if line.startswith("  cb_")]
    assert f"{len(names)} kernels" in out.stdout
    return names


def test_modules_name_their_test_kernels():
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_gpu_gemm1x1  # noqa: PLC0415
        import test_gpu_sm90_splitk  # noqa: PLC0415
    finally:
        sys.path.remove(str(ROOT / "tests"))
    gemm = listed("--modules", "gemm1x1")
    assert gemm == [c.name for c in test_gpu_gemm1x1.KERNELS.values()]
    split = listed("--modules", "sm90_splitk")
    assert split == [c.name for c in test_gpu_sm90_splitk.used_configs()]
    both = listed("--modules", "gemm1x1", "sm90_splitk")
    assert both == list(dict.fromkeys(gemm + split))


def test_workload_and_modules_add_up():
    """`--workload default` is what `cutlass-byoc tune` plans (its default budget); with `--modules` the union."""
    from cutlass_byoc.profiler.plan import plan_workload  # noqa: PLC0415
    from cutlass_byoc.workloads import named_workload  # noqa: PLC0415

    problems = [item.problem for item in named_workload("default")]
    planned = [k.name for k in plan_workload(problems).kernels]
    work = listed("--workload", "default")
    assert work == list(dict.fromkeys(planned)) and len(work) > 100
    union = listed("--workload", "default", "--modules", "gemm1x1")
    assert set(union) == set(work) | set(listed("--modules", "gemm1x1")) and len(union) == len(set(union))


def test_workload_file_is_what_tune_plans():
    """`--workload FILE` takes a workload file as the round's TUNE_WORKLOAD does, and lists what `cutlass-byoc tune
    FILE` plans for it."""
    from cutlass_byoc.profiler.plan import plan_workload  # noqa: PLC0415
    from cutlass_byoc.workloads import load_workload  # noqa: PLC0415

    path = ROOT / "scripts" / "workloads" / "wgrad-split.json"
    planned = [k.name for k in plan_workload([item.problem for item in load_workload(path)]).kernels]
    work = listed("--workload", str(path))
    assert work == list(dict.fromkeys(planned)) and any("_wgrad_" in n for n in work)


def test_unknown_module_is_named():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "warm_cache.py"), "--modules", "nope", "--list"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode != 0 and "--modules" in (out.stderr + out.stdout) and "nope" in (out.stderr + out.stdout)


def test_sweep_selector_names_the_sweeps_kernels():
    """--sweep 1x1 --sweep-kinds fprop: every GEMM 1x1 kernel of the ResNet-50 stride-1 1x1 fprop cells (the round's
    sweep step times them from the carried cache), and --sweep-tiles adds its tiles; a 384-row tile is refused."""
    base = listed("--sweep", "1x1", "--sweep-kinds", "fprop")
    assert base and all(n.startswith("cb_gemm1x1_fprop_") for n in base)
    more = listed("--sweep", "1x1", "--sweep-kinds", "fprop", "--sweep-tiles", "192x64x64:pingpong",
                  "384x64x64:cooperative")
    added = [n for n in more if n not in base]
    assert added and all("_192x64x64_" in n and "pingpong" in n for n in added)
    clustered = listed("--sweep", "1x1", "--sweep-kinds", "fprop", "--sweep-tiles", "128x64x64:pingpong:c1x2x1")
    assert [n for n in clustered if n not in base] == [
        n for n in clustered if "_128x64x64_" in n and n.endswith("_c1x2x1_pingpong_sm90")] != []


def test_sweep_replay_finds_what_the_plan_times():
    """sweep_kernels.replay: a cell's best among the launches the tuner's plan would time, against the sweep's best
    (a launch outside the plan that ran faster shows as a miss)."""
    sweep_kernels = script("sweep_kernels")
    from cutlass_byoc.profiler.plan import plan_problem  # noqa: PLC0415
    from cutlass_byoc.workloads import default_workload  # noqa: PLC0415

    it = next(i for i in default_workload() if i.layer == "l3_1x1_256_1024" and i.problem.kind.value == "fprop")
    planned = {c.name for c in plan_problem(it.problem).candidates}
    swept = [k for k in sweep_kernels.kernels_of(it.problem) if not any(n.startswith(k.name) for n in planned)]
    inside = next(n for n in planned if n.startswith("cb_gemm1x1_"))
    cell = {"layer": it.layer, "kind": "fprop", "cudnn_us": 12.0, "rows": [
        {"launch": swept[0].name, "us": 9.0, "status": "ok"},  # faster, but the plan would not time it
        {"launch": inside, "us": 11.0, "status": "ok"},
        {"launch": swept[1].name, "us": None, "status": "not compiled"}]}
    (row,) = sweep_kernels.replay([cell])
    assert (row["plan_us"], row["best_us"], row["planned"]) == (11.0, 9.0, 1)


def test_sweep_deep_twins_go_past_the_stage_cap():
    """plan.deep_twin (which sweep_kernels.py --deep adds): a 64 x 64 tile's twin takes the stages its shared memory
    holds past the families' cap of 8 (13 for a GEMM 1x1 ping-pong kernel, 11 for a 3.x split-k wgrad kernel storing
    fp32 partials); a tile the cap does not bind has none."""
    sweep_kernels = script("sweep_kernels")
    from cutlass_byoc.gemm1x1 import gemm1x1_config  # noqa: PLC0415
    from cutlass_byoc.problem import Conv2dProblem  # noqa: PLC0415
    from cutlass_byoc.profiler.plan import deep_twin  # noqa: PLC0415
    from cutlass_byoc.sm90 import sm90_config  # noqa: PLC0415
    from cutlass_byoc.types import SplitKMode  # noqa: PLC0415

    fprop = Conv2dProblem.make("fprop", 32, 256, 56, 56, 64, 1)
    small = gemm1x1_config(fprop, (64, 64, 64), "pingpong", sourceless=True)
    assert small.stages == 8 and deep_twin(small).stages == 13
    assert deep_twin(gemm1x1_config(fprop, (128, 128, 64), "pingpong")) is None
    wgrad = Conv2dProblem.make("wgrad", 32, 64, 56, 56, 64, 1)
    split = sm90_config(wgrad, (64, 64, 64), split_k_mode=SplitKMode.PARALLEL)
    deep = deep_twin(split)
    assert (split.stages, deep.stages) == (8, 11) and deep.reject_reason(wgrad) is None
    assert deep.is_deep_twin and not split.is_deep_twin
    swept = sweep_kernels.kernels_of(wgrad, deep=True, with_sm90=True)
    assert deep in swept and any(k.family is split.family for k in swept)


def test_sweep_store_stages_twins_and_tile_specs():
    """sweep_kernels.py --store-stages: each sourceless GEMM 1x1 kernel of a cell gets its twin with one epilogue D
    buffer per sub-tile where that is more than the builder's two; ":sd" / ":sd4" in a --tiles spec ask for them."""
    sweep_kernels = script("sweep_kernels")
    from cutlass_byoc.gemm1x1 import epilogue_sub_tiles  # noqa: PLC0415
    from cutlass_byoc.workloads import default_workload  # noqa: PLC0415

    it = next(i for i in default_workload() if i.layer == "l1_1x1_64_64" and i.problem.kind.value == "fprop")
    plain = sweep_kernels.kernels_of(it.problem)
    both = sweep_kernels.kernels_of(it.problem, store_stages=True)
    twins = [k for k in both if k.epi_stages]
    assert not any(k.epi_stages for k in plain) and both[:len(plain)] == plain and twins
    for t in twins:
        assert t.sourceless and t.epi_stages == epilogue_sub_tiles(t.tile, t.schedule, t.epi_tile) > 2
        assert t.reject_reason(it.problem) is None
    assert sweep_kernels.parse_tile("192x64x64:pingpong:nosrc:e64x64:sd") == (
        (192, 64, 64), "pingpong", True, (1, 1, 1), (64, 64), 0)
    assert sweep_kernels.parse_tile("192x64x64:pingpong:nosrc:sd4")[-1] == 4
    assert sweep_kernels.parse_tile("192x64x64:pingpong")[-2:] == (None, None)
    spec = sweep_kernels.parse_tile("192x64x64:pingpong:nosrc:sd")
    assert any(k.tile == (192, 64, 64) and k.epi_stages == 6 for k in sweep_kernels.kernels_of(it.problem, [spec]))
    # tiles_only: the asked-for configs and their twins, none of the family's own
    tile = sweep_kernels.parse_tile("128x128x64:pingpong:nosrc:e64x64")
    only = sweep_kernels.kernels_of(it.problem, [tile], store_stages=True, tiles_only=True)
    assert [(k.tile, k.epi_tile, k.epi_stages) for k in only] == [((128, 128, 64), (64, 64), None),
                                                                  ((128, 128, 64), (64, 64), 4)]
    assert not set(only) & set(plain)


def test_stats_twins_add_each_sm90_fprop_kernels_channel_statistics_twin():
    """`--stats-twins`: the twins fuse_bn_stats launches, of the sm90 conv fprop kernels selected (only those)."""
    warm_cache = script("warm_cache")
    from cutlass_byoc.gemm1x1 import gemm1x1_config  # noqa: PLC0415
    from cutlass_byoc.problem import Conv2dProblem  # noqa: PLC0415
    from cutlass_byoc.sm90 import sm90_config  # noqa: PLC0415

    fprop = Conv2dProblem.make("fprop", 4, 64, 20, 20, 128, 3, padding=1)
    wgrad = Conv2dProblem.make("wgrad", 4, 64, 20, 20, 128, 3, padding=1)
    plain = [sm90_config(fprop, (128, 128, 64)), sm90_config(fprop, (64, 64, 64), schedule="pingpong"),
             sm90_config(wgrad, (64, 128, 64)), gemm1x1_config(Conv2dProblem.make("fprop", 4, 64, 20, 20, 128, 1))]
    twins = warm_cache.stats_twins(plain + [plain[0]])
    assert twins == [plain[0].with_channel_stats(), plain[1].with_channel_stats()]
    assert all(t.channel_stats for t in twins) and twins[0].tile[:2] == (128, 64)
    assert warm_cache.stats_twins(twins) == []


def test_split_k_study_names_what_the_benchs_study_builds():
    """`--split-k-study` lists the kernels of the split-k study's two sides on the default workload's wgrad layers
    (with the tune's plan, all that `bench --split-k` builds): split kernels and unsplit ones, wgrad only, no
    repeats."""
    from cutlass_byoc.profiler.splitk import study_kernels  # noqa: PLC0415
    from cutlass_byoc.types import ConvKind, SplitKMode  # noqa: PLC0415
    from cutlass_byoc.workloads import default_workload  # noqa: PLC0415

    study = study_kernels(default_workload())
    assert listed("--split-k-study") == [k.name for k in study]
    assert all(k.kind is ConvKind.WGRAD for k in study) and len(study) == len(set(study))
    assert any(k.split_k_mode is SplitKMode.PARALLEL for k in study)
    assert any(k.split_k_mode is not SplitKMode.PARALLEL for k in study)


def test_tune_model_takes_several_batches_into_one_list():
    """`--tune-model M --batch 8 16`: what the two tune-model steps plan (one per batch), in one list without repeats,
    the host-overhead problem's kernels once."""
    args = ("--tune-model", "resnet18", "--max-candidates", "1")
    small, large = listed(*args, "--batch", "8"), listed(*args, "--batch", "16")
    both = listed(*args, "--batch", "8", "16")
    assert set(both) == set(small) | set(large) and len(both) == len(set(both))


def test_skip_models_leaves_those_offload_runs_out():
    """`--skip-models convnext_tiny efficientnet_b0`: the offload runs without those models (what a round whose offload
    tests run with -k 'not convnext and not efficientnet' launches), every other run kept in order; an unknown model
    is refused by name."""
    wc = script("warm_cache")
    kept = wc.offload_runs(["convnext_tiny", "efficientnet_b0"])
    assert kept == [r for r in wc.OFFLOAD_RUNS if r[0] not in ("convnext_tiny", "efficientnet_b0")]
    assert {r[0] for r in kept} == {r[0] for r in wc.OFFLOAD_RUNS} - {"convnext_tiny", "efficientnet_b0"}
    assert wc.offload_runs() == wc.OFFLOAD_RUNS
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "warm_cache.py"), "--skip-models", "nope", "--list"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 2 and "nope" in out.stderr
