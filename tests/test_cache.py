"""Kernel cache behaviour: hit, miss, concurrent builders, corrupted entries, recorded compile errors."""

import dataclasses
import multiprocessing as mp
import os

import pytest

from cutlass_byoc import build as build_mod
from cutlass_byoc.build import build, prepare
from cutlass_byoc.cache import EntryState, KernelCache, kernel_key
from cutlass_byoc.candidates import sm80_candidates
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.toolchain import ToolchainError, toolchain

SMALL = Conv2dProblem.make("fprop", 1, 64, 8, 8, 64, 1)


def small_config():
    return next(c for c in sm80_candidates(SMALL) if c.tile == (64, 64, 32) and c.stages == 10)


def test_key_covers_source_nvcc_flags_and_cutlass():
    tc = toolchain()
    base = kernel_key("src", tc)
    assert kernel_key("src2", tc) != base
    assert kernel_key("src", dataclasses.replace(tc, nvcc_version="12.8.1")) != base
    assert kernel_key("src", dataclasses.replace(tc, cutlass_version="4.1.0")) != base
    assert kernel_key("src", dataclasses.replace(tc, arch=100)) != base


def test_missing_nvcc_says_what_to_install(monkeypatch):
    from cutlass_byoc import toolchain as tc_mod

    tc_mod.nvcc_path.cache_clear()
    monkeypatch.setenv("CUTLASS_BYOC_NVCC", "/nonexistent/nvcc")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(tc_mod.os.path, "isfile", lambda p: False)
    with pytest.raises(ToolchainError, match="install the CUDA toolkit"):
        tc_mod.nvcc_path()
    tc_mod.nvcc_path.cache_clear()


def test_missing_cutlass_headers_say_what_to_install(monkeypatch, tmp_path):
    from cutlass_byoc import toolchain as tc_mod

    tc_mod.cutlass_root.cache_clear()
    monkeypatch.setenv("CUTLASS_BYOC_CUTLASS_DIR", str(tmp_path))
    with pytest.raises(ToolchainError, match="pip install nvidia-cutlass"):
        tc_mod.cutlass_root()
    tc_mod.cutlass_root.cache_clear()


def _fail_render(monkeypatch):
    real = build_mod.render

    def broken(config, cmd):
        src = real(config, cmd)
        return src.replace("namespace {", "namespace {\nstatic_assert(sizeof(int) == 3, \"planted failure\");", 1)

    monkeypatch.setattr(build_mod, "render", broken)


@pytest.mark.compile
def test_compile_error_is_recorded_reported_and_not_retried(tmp_cache, monkeypatch):
    _fail_render(monkeypatch)
    cfg = small_config()
    r = build([cfg], cache=tmp_cache)[cfg]
    assert not r.ok and r.built_now and r.entry.state is EntryState.FAILED
    assert (r.entry.path / "failed.json").exists() and not (r.entry.path / "kernel.so").exists()
    report = r.error_report()
    assert "planted failure" in report
    assert "static_assert(sizeof(int) == 3" in report  # the failing source line is shown
    again = build([cfg], cache=tmp_cache)[cfg]
    assert not again.built_now and again.entry.state is EntryState.FAILED  # not retried blindly
    with pytest.raises(build_mod.CompileError, match="planted failure"):
        build([cfg], cache=tmp_cache, raise_on_error=True)


def _build_in_child(root, queue):
    cfg = small_config()
    r = build([cfg], cache=KernelCache(root), jobs=1)[cfg]
    queue.put((r.ok, r.built_now, r.entry.meta.get("sha256")))


@pytest.mark.compile
def test_hit_miss_concurrency_and_corruption(tmp_cache):
    cfg = small_config()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_cache.root), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    outcomes = [q.get(timeout=5) for _ in procs]
    assert all(ok for ok, _, _ in outcomes)
    assert sorted(built for _, built, _ in outcomes) == [False, True]  # exactly one process compiled it
    assert len({sha for _, _, sha in outcomes}) == 1

    hit = build([cfg], cache=tmp_cache)[cfg]  # hit: nothing compiled
    assert hit.ok and not hit.built_now
    assert not list((tmp_cache.root / "tmp").iterdir())  # no staging leftovers

    lib = hit.library
    lib.write_bytes(lib.read_bytes()[:1000])  # corrupt it
    assert tmp_cache.lookup(hit.entry.key).state is EntryState.CORRUPT
    rebuilt = build([cfg], cache=tmp_cache)[cfg]
    assert rebuilt.ok and rebuilt.built_now

    other = dataclasses.replace(cfg, swizzle=2)  # miss: another config is another kernel
    assert prepare(other)[1] != prepare(cfg)[1]
    assert tmp_cache.lookup(prepare(other)[1]).state is EntryState.MISSING
