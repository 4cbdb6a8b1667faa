"""CPU: the kernel libraries' launch memo (templates/launch_memo.h.j2). Its C++ is rendered as the templates include it
and compiled with the host compiler against a stand-in for the CUDA runtime (a settable current device), then driven
from a small program: what is a hit, what is a miss, which entry is replaced, the switch and its counters, and the
launch list's order. Which templates include it, and which are left byte-for-byte alone, is checked on their
renders."""

from __future__ import annotations

import shutil
import subprocess
from types import SimpleNamespace

import pytest

from cutlass_byoc.render import ABI_VERSION, environment, render
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.types import ConvKind, KernelFamily, SplitKMode

HARNESS = r"""
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
// the CUDA runtime, as far as the memo uses it
typedef int cudaError_t;
typedef void* cudaStream_t;
constexpr cudaError_t cudaSuccess = 0;
static int g_device = 0;
static cudaError_t cudaGetDevice(int* d) { *d = g_device; return cudaSuccess; }

API

MEMO

#define CHECK(cond) do { if (!(cond)) { std::printf("FAILED line %d: %s\n", __LINE__, #cond); return 1; } } while (0)

static CbConv2dArgs block(int64_t n, const void* a) {
  CbConv2dArgs x;
  std::memset(&x, 0, sizeof(x));
  x.abi_version = CB_ABI_VERSION;
  x.n = n;
  x.a = a;
  x.alpha = 1.0f;
  return x;
}

int main() {
  CbLaunchMemo<int> memo;
  char buf[2][64];
  CbMemoKey k0, k1, k;
  CbConv2dArgs x0 = block(1, buf[0]), x1 = block(1, buf[1]);
  int rc = -1;
  auto ran = [&](int& v) { return v; };
  CHECK(cb_memo_key(&x0, nullptr, 0, &k0) && cb_memo_key(&x1, nullptr, 0, &k1));
  CHECK(!memo.relaunch(k0, ran, &rc));                        // nothing kept yet
  memo.keep(k0, std::unique_ptr<int>(new int(10)));
  CHECK(memo.relaunch(k0, ran, &rc) && rc == 10);             // the same block: relaunched
  CHECK(!memo.relaunch(k1, ran, &rc));                        // another pointer: not
  CbConv2dArgs x2 = x0;
  x2.alpha = 0.5f;
  CHECK(cb_memo_key(&x2, nullptr, 0, &k) && !memo.relaunch(k, ran, &rc));  // another alpha
  CHECK(cb_memo_key(&x0, buf[1], 0, &k) && !memo.relaunch(k, ran, &rc));   // another workspace
  CHECK(cb_memo_key(&x0, nullptr, 64, &k) && !memo.relaunch(k, ran, &rc)); // another workspace size
  g_device = 1;
  CHECK(cb_memo_key(&x0, nullptr, 0, &k) && !memo.relaunch(k, ran, &rc));  // another device
  g_device = 0;
  memo.keep(k0, std::unique_ptr<int>(new int(11)));           // kept again: replaced, not added
  CHECK(memo.relaunch(k0, ran, &rc) && rc == 11);
  // fill the memo: block n = 100..100+kCbMemoEntries-1, k0 used in between, then one more block replaces the least
  // recently used one (n = 100), and k0 stays
  for (int i = 0; i < kCbMemoEntries - 1; ++i) {
    CbConv2dArgs xi = block(100 + i, buf[0]);
    CHECK(cb_memo_key(&xi, nullptr, 0, &k));
    memo.keep(k, std::unique_ptr<int>(new int(100 + i)));
  }
  CHECK(memo.relaunch(k0, ran, &rc) && rc == 11);
  CbConv2dArgs extra = block(999, buf[0]);
  CHECK(cb_memo_key(&extra, nullptr, 0, &k));
  memo.keep(k, std::unique_ptr<int>(new int(999)));
  CHECK(memo.relaunch(k, ran, &rc) && rc == 999);
  CHECK(memo.relaunch(k0, ran, &rc) && rc == 11);
  CbConv2dArgs first = block(100, buf[0]), second = block(101, buf[0]);
  CHECK(cb_memo_key(&first, nullptr, 0, &k) && !memo.relaunch(k, ran, &rc));
  CHECK(cb_memo_key(&second, nullptr, 0, &k) && memo.relaunch(k, ran, &rc) && rc == 101);
  // the switch: off, no key (every call takes the full path); the counters count lookups
  int64_t counters[2] = {-1, -1};
  CHECK(cb_launch_memo(-1, counters) == 1 && counters[0] == 6 && counters[1] == 7);
  CHECK(cb_launch_memo(0, nullptr) == 1 && cb_launch_memo(-1, nullptr) == 0);
  CHECK(!cb_memo_key(&x0, nullptr, 0, &k));
  CHECK(cb_launch_memo(1, nullptr) == 0 && cb_memo_key(&x0, nullptr, 0, &k));
  // the launch list: steps in order, the first failure ends it
  int order[4] = {0, 0, 0, 0}, next = 0;
  CbLaunchList list;
  list.steps.push_back([&](cudaStream_t, char*, int) { order[next++] = 1; return 0; });
  list.steps.push_back([&](cudaStream_t, char*, int) { order[next++] = 2; return 7; });
  list.steps.push_back([&](cudaStream_t, char*, int) { order[next++] = 3; return 0; });
  CHECK(list.run(nullptr, nullptr, 0) == 7 && next == 2 && order[0] == 1 && order[1] == 2);
  std::printf("OK\n");
  return 0;
}
"""


def _memo_source() -> str:
    env = environment()
    api = env.get_template("conv2d_api.h.j2").render(abi_version=ABI_VERSION,
                                                     c=SimpleNamespace(element_bias=None, channel_stats=None))
    # the sm90 conv template's rendering: the only one with the launch list (CbLaunchList) its phases use
    memo = env.get_template("launch_memo.h.j2").render(c=SimpleNamespace(family=KernelFamily.SM90_TMA_WGMMA))
    return HARNESS.replace("API", api, 1).replace("MEMO", memo, 1)


def test_only_the_sm90_conv_template_renders_the_launch_list():
    """The other families include the memo without CbLaunchList (nvcc warned its run() unreferenced there)."""
    tmpl = environment().get_template("launch_memo.h.j2")
    assert "struct CbLaunchList" in tmpl.render(c=SimpleNamespace(family=KernelFamily.SM90_TMA_WGMMA))
    for family in (KernelFamily.SM80_IMPLICIT_GEMM, KernelFamily.SM90_GEMM_1X1):
        text = tmpl.render(c=SimpleNamespace(family=family))
        assert "CbLaunchList" not in text and "class CbLaunchMemo" in text


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")
def test_memo_hits_misses_replacement_switch_and_list(tmp_path):
    src = tmp_path / "memo.cpp"
    src.write_text(_memo_source())
    exe = tmp_path / "memo"
    build = subprocess.run(["g++", "-std=c++17", "-Wall", "-Wno-unused-function", "-Werror", "-O1", str(src), "-o", str(exe), "-pthread"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "OK", run.stdout + run.stderr


def _fprop():
    return Conv2dProblem.make("fprop", 4, 64, 20, 20, 128, 3, padding=1)


def test_cutlass_templates_include_the_memo_and_the_others_do_not():
    from cutlass_byoc.candidates import sm80_candidates
    from cutlass_byoc.depthwise import depthwise_candidates
    from cutlass_byoc.gemm1x1 import gemm1x1_config
    from cutlass_byoc.sm90 import sm90_config

    p = _fprop()
    one = Conv2dProblem(kind=ConvKind.WGRAD, n=4, h=16, w=15, c=64, k=136, r=1, s=1, element_a="f16",
                        element_b="f16", element_out="f32")
    memoized = [next(iter(sm80_candidates(p))), sm90_config(p, (128, 64, 64)), sm90_config(p, (128, 64, 64), schedule="pingpong"),
                gemm1x1_config(one, (128, 64, 64), "cooperative_streamk"),
                next(c for c in sm80_candidates(Conv2dProblem.make("wgrad", 4, 64, 20, 20, 64, 3, padding=1))
                     if c.split_k_mode is SplitKMode.PARALLEL)]
    for cfg in memoized:
        src = render(cfg, "nvcc")
        assert 'extern "C" int64_t cb_launch_memo(' in src and "static CbLaunchMemo<" in src, cfg.name
        assert "memo.relaunch(key" in src and "memo.keep(key" in src, cfg.name
    dw = next(iter(depthwise_candidates(Conv2dProblem.make("fprop", 4, 32, 20, 20, 32, 3, padding=1, groups=32))))
    assert "cb_launch_memo" not in render(dw, "nvcc")


def test_bench_memo_off_mode_switches_every_library_around_its_steps(monkeypatch):
    """The offload benchmark's cutlass_byoc-memo-off mode: its step is plain, the switch happens in begin / end (around
    a timed loop, outside it), over every loaded library that has a memo; the counters are summed."""
    from cutlass_byoc import runtime
    from cutlass_byoc.offload import bench

    class Lib:
        def __init__(self, name, memo):
            self.name, self.memo, self.switches = name, memo, []

        def launch_memo(self, on=None):
            if self.memo is None:
                return None
            if on is not None:
                self.switches.append(on)
                self.memo = runtime.MemoState(on, self.memo.relaunches, self.memo.full)
            return self.memo

    libs = [Lib("a", runtime.MemoState(True, 5, 2)), Lib("dw", None), Lib("b", runtime.MemoState(True, 1, 1))]
    monkeypatch.setattr(runtime, "loaded_libraries", lambda: libs)
    steps = []
    one = bench._memo_off(lambda: steps.append(1))
    one()
    assert steps == [1] and libs[0].switches == [] and libs[2].switches == []
    one.begin()
    assert libs[0].switches == [False] and libs[2].switches == [False] and not libs[0].memo.on
    one.end()
    assert libs[0].switches == [False, True] and libs[0].memo.on and libs[2].memo.on
    assert bench.launch_memo_counts() == (6, 3)
    assert "cutlass_byoc-memo-off" in bench.EXTRA_MODES and "cutlass_byoc-memo-off" not in bench.MODES
