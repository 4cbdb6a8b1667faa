"""CPU: programmatic dependent launches (sm_90 PDL). Which templates render them (the GEMM 1x1 family's persistent
schedules, the sm90 conv family's ping-pong kernel and its atomic split-k wgrad) and which are left byte-for-byte as they were; where the kernels
wait; the library switch (compiled with the host compiler and driven); runtime.set_dependent_launch over the loaded
libraries; the offload benchmark's no-pdl modes. The GPU behaviour is tests/test_gpu_dependent_launch.py's."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from cutlass_byoc import runtime
from cutlass_byoc.gemm1x1 import gemm1x1_config, im2col_config
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.render import environment, render
from cutlass_byoc.sm90 import atomic_twin, sm90_config
from cutlass_byoc.types import ConvKind, SplitKMode

SWITCH = 'extern "C" int64_t cb_dependent_launch(int64_t on)'


def _one(kind="fprop", out="f16"):
    return Conv2dProblem(kind=ConvKind(kind), n=4, h=16, w=15, c=64, k=136, r=1, s=1, element_a="f16",
                         element_b="f16", element_out=out)


def _stem():
    return Conv2dProblem.make("fprop", 4, 3, 32, 32, 64, 7, stride=2, padding=3)


def _first_include(src: str) -> int:
    return min(src.index('#include "cute/'), src.index('#include "cutlass/'))


@pytest.mark.parametrize("schedule", ["pingpong", "cooperative"])
@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_gemm1x1_persistent_schedules_launch_as_dependents(kind, schedule):
    cfg = gemm1x1_config(_one(kind, "f32" if kind == "wgrad" else "f16"), (128, 64, 64), schedule, sourceless=True)
    src = render(cfg, "nvcc")
    # CUTLASS's grid dependency control is compiled in: defined before any CUTLASS header is read
    define = src.index("#define CUTLASS_ENABLE_GDC_FOR_SM90 1")
    assert define < _first_include(src)
    assert src.count(SWITCH) == 1
    # both launches (the memo's relaunch and the full path) pass the switch to GemmUniversalAdapter::run
    assert src.count("op.run(s, nullptr, g_cb_dependent_launch.load(std::memory_order_relaxed))") == 2
    assert "op.run(s);" not in src


@pytest.mark.parametrize("schedule", ["cooperative_streamk", "cooperative_streamk_nd"])
def test_gemm1x1_streamk_and_lowered_launches_are_plain(schedule):
    cfgs = [gemm1x1_config(_one("wgrad", "f32"), (128, 64, 64), schedule),
            im2col_config(_stem(), (128, 64, 64), "pingpong"), im2col_config(_stem(), (128, 64, 64), "cooperative")]
    assert all(c.lowering == "im2col" for c in cfgs[1:])
    for cfg in cfgs:
        src = render(cfg, "nvcc")
        assert "CUTLASS_ENABLE_GDC_FOR_SM90" not in src and "cb_dependent_launch" not in src, cfg.name
        assert "g_cb_dependent_launch" not in src, cfg.name


def test_pingpong_conv_kernel_waits_before_it_touches_memory():
    for p, tile in ((Conv2dProblem.make("fprop", 4, 64, 20, 20, 128, 3, padding=1), (128, 64, 64)),
                    (Conv2dProblem.make("dgrad", 4, 64, 20, 20, 64, 3, stride=2, padding=1), (128, 128, 64))):
        cfg = sm90_config(p, tile, schedule="pingpong")
        src = render(cfg, "nvcc")
        assert src.count(SWITCH) == 1, cfg.name
        kernel = src[src.index("cb_pingpong_kernel(CUTLASS_GRID_CONSTANT"):]
        wait = kernel.index('asm volatile("griddepcontrol.wait;" ::: "memory");')
        # before the roles split (the producer's first TMA load, the consumers' first store)
        assert wait < kernel.index("warpgroup_reg_dealloc") and wait < kernel.index("collective_mainloop.load(")
        assert wait < kernel.index('asm volatile("griddepcontrol.launch_dependents;");')
        # every ping-pong launch goes through cudaLaunchKernelEx with the programmatic attribute under the switch
        assert "cudaLaunchAttributeProgrammaticStreamSerialization" in src
        assert "cb_pingpong_kernel<<<" not in src, cfg.name
    # the sub-pixel dgrad's first launch after the memset of dx is a plain one
    assert "const bool pdl = !after_memset && g_cb_dependent_launch.load(std::memory_order_relaxed);" in src


def test_atomic_split_wgrad_zeroing_waits_then_lets_the_split_kernel_in():
    p = Conv2dProblem.make("wgrad", 4, 64, 20, 20, 64, 3, padding=1, out_dtype="f32")
    cfg = atomic_twin(sm90_config(p, (64, 128, 64), split_k_mode=SplitKMode.PARALLEL))
    src = render(cfg, "nvcc")
    assert src.count(SWITCH) == 1
    zero = src[src.index("cb_splitk_zero(float4* __restrict__ sums"):]
    zero = zero[:zero.index("\n}\n")]
    assert zero.index("griddepcontrol.wait;") < zero.index("griddepcontrol.launch_dependents;") < zero.index("sums[i]")
    # launched through cudaLaunchKernelEx, the programmatic attribute under the switch
    assert "cfg.numAttrs = (g_cb_dependent_launch.load(std::memory_order_relaxed)) ? 1 : 0;" in src
    assert "cb_splitk_zero<<<" not in src


def test_other_sm90_conv_kernels_are_left_alone():
    p = Conv2dProblem.make("fprop", 4, 64, 20, 20, 128, 3, padding=1)
    w = Conv2dProblem.make("wgrad", 4, 64, 20, 20, 64, 3, padding=1)
    for cfg in (sm90_config(p, (128, 128, 64)), sm90_config(w, (64, 128, 64), split_k_mode=SplitKMode.PARALLEL)):
        src = render(cfg, "nvcc")
        assert "cb_dependent_launch" not in src and "g_cb_dependent_launch" not in src, cfg.name
    assert "griddepcontrol.wait" not in render(sm90_config(p, (128, 128, 64)), "nvcc")


HARNESS = r"""
#include <atomic>
#include <cstdint>
#include <cstdio>
SWITCH
int main() {
  int ok = cb_dependent_launch(-1) == 1;        // on by default
  ok &= cb_dependent_launch(0) == 1;            // was on
  ok &= cb_dependent_launch(-1) == 0;           // now off
  ok &= !g_cb_dependent_launch.load();
  ok &= cb_dependent_launch(1) == 0;
  ok &= cb_dependent_launch(-1) == 1 && g_cb_dependent_launch.load();
  std::printf(ok ? "OK\n" : "FAILED\n");
  return ok ? 0 : 1;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")
def test_library_switch(tmp_path):
    macro = environment().from_string('{% from "dependent_launch.j2" import dependent_launch_switch %}'
                                      "{{ dependent_launch_switch() }}").render()
    src = tmp_path / "switch.cpp"
    src.write_text(HARNESS.replace("SWITCH", macro, 1))
    exe = tmp_path / "switch"
    build = subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", str(src), "-o", str(exe)], capture_output=True,
                           text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "OK", run.stdout + run.stderr


class _Lib:
    def __init__(self, has_switch=True):
        self.state = True if has_switch else None
        self.calls = []

    def dependent_launch(self, on=None):
        if self.state is None:
            return None
        was = self.state
        if on is not None:
            self.calls.append(on)
            self.state = bool(on)
        return was


def test_set_dependent_launch_switches_every_loaded_library(monkeypatch):
    libs = {("a", 1): _Lib(), ("b", 2): _Lib(has_switch=False), ("c", 3): _Lib()}
    monkeypatch.setattr(runtime, "_loaded", libs)
    monkeypatch.setattr(runtime, "_dependent_launch", True)
    assert runtime.set_dependent_launch(False) is True
    assert not runtime.dependent_launch_enabled()
    assert libs[("a", 1)].calls == [False] and libs[("c", 3)].calls == [False] and not libs[("c", 3)].state
    assert runtime.set_dependent_launch(True) is False
    assert libs[("a", 1)].state and libs[("c", 3)].state and runtime.dependent_launch_enabled()


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("off", False), ("False", False),
                                      ("yes", True)])
def test_environment_default(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("CUTLASS_BYOC_DEPENDENT_LAUNCH", raising=False)
    else:
        monkeypatch.setenv("CUTLASS_BYOC_DEPENDENT_LAUNCH", value)
    assert runtime._env_dependent_launch() is on


def test_bench_no_pdl_modes_switch_around_each_step_or_timed_loop(monkeypatch):
    pytest.importorskip("torch")
    from cutlass_byoc.offload import bench

    calls = []

    def fake(on):
        calls.append(on)
        return True if len(calls) % 2 else False

    monkeypatch.setattr(runtime, "set_dependent_launch", fake)
    steps = []
    one = bench._pdl_off(lambda: steps.append(list(calls)))
    one()  # a lone step: off around it, then back to what it was
    assert steps == [[False]] and calls == [False, True]
    calls.clear()
    one.begin()
    one()
    one()
    one.end()
    assert calls == [False, True] and steps[1:] == [[False], [False]]
    for mode in bench.NO_PDL_MODES:
        assert mode in bench.EXTRA_MODES and mode not in bench.MODES
    assert bench.NO_PDL_MODES[1].endswith("-cudagraphs")


def test_time_gpu_times_each_run_with_dependent_launches_off(monkeypatch):
    """The profiler's timing (tune, bench) measures the kernel alone: no run overlaps the one before it."""
    from cutlass_byoc.profiler import timing

    seen = []
    monkeypatch.setattr(timing, "_time_gpu", lambda fn, rotations, settings: seen.append(
        runtime.dependent_launch_enabled()) or "stats")
    monkeypatch.setattr(runtime, "_loaded", {})
    monkeypatch.setattr(runtime, "_dependent_launch", True)
    assert timing.time_gpu(None, 1) == "stats" and seen == [False] and runtime.dependent_launch_enabled()
    monkeypatch.setattr(timing, "_time_gpu", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        timing.time_gpu(None, 1)
    assert runtime.dependent_launch_enabled()  # restored when timing fails too
