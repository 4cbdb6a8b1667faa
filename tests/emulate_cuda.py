"""Run a rendered depthwise kernel library on the CPU: the exact source the template renders, compiled by g++ with a
small emulation of the CUDA launch model (blocks one after another, a block's threads as std::threads meeting at a
barrier for __syncthreads, __shared__ arrays as statics shared by them, shared-memory atomics under a mutex), then
called through its extern "C" cb_run on host buffers. It checks the kernels' index arithmetic (tiles, halos, windows,
rotated filters, valid taps, split partials, epilogues) without a GPU; nothing about speed or the GPU's memory model."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

PRELUDE = r"""
#include <barrier>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include <cuda_runtime.h>
struct EmuIdx { unsigned x = 0, y = 0, z = 0; };
thread_local EmuIdx emu_threadIdx, emu_blockIdx;
EmuIdx emu_gridDim, emu_blockDim;
std::barrier<>* emu_barrier = nullptr;
std::mutex emu_atomic_mutex;
#define threadIdx emu_threadIdx
#define blockIdx emu_blockIdx
#define gridDim emu_gridDim
#define blockDim emu_blockDim
#define __global__
#define __shared__ static
#define __launch_bounds__(...)
#define __syncthreads() emu_barrier->arrive_and_wait()
inline float atomicAdd(float* p, float v) { std::lock_guard<std::mutex> g(emu_atomic_mutex); float o = *p; *p += v; return o; }
// A warp shuffle, for code that every thread of the block calls alike (blocks run one after another here)
static float emu_shfl_buf[1024];
inline float __shfl_xor_sync(unsigned, float v, int lane_mask, int = 32) {
  unsigned t = emu_threadIdx.x + emu_blockDim.x * (emu_threadIdx.y + emu_blockDim.y * emu_threadIdx.z);
  emu_shfl_buf[t] = v;
  emu_barrier->arrive_and_wait();
  float r = emu_shfl_buf[(t & ~31u) | ((t & 31u) ^ unsigned(lane_mask))];
  emu_barrier->arrive_and_wait();
  return r;
}
inline void emu_launch(dim3 grid, dim3 block, std::function<void()> body) {
  emu_gridDim = {grid.x, grid.y, grid.z};
  emu_blockDim = {block.x, block.y, block.z};
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      unsigned const threads = block.x * block.y * block.z;
      std::barrier<> bar(threads);
      emu_barrier = &bar;
      std::vector<std::thread> ts;
      for (unsigned t = 0; t < threads; ++t)
        ts.emplace_back([&, t, bx, by] {
          emu_threadIdx = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
          emu_blockIdx = {bx, by, 0};
          body();
        });
      for (auto& th : ts) th.join();
    }
}
// cudaLaunchKernelEx (the wgrad reduction, a programmatic dependent launch): run like <<<>>>, attributes ignored (the
// blocks run one after another here anyway). Its config's gridDim / blockDim members read as emu_gridDim /
// emu_blockDim after the macros above, hence a config struct of those names.
struct emu_launch_config {
  dim3 emu_gridDim, emu_blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};
#define cudaLaunchConfig_t emu_launch_config
#define cudaLaunchKernelEx(cfg, kernel, ...) \
  (emu_launch((cfg)->emu_gridDim, (cfg)->emu_blockDim, [&] { kernel(__VA_ARGS__); }), cudaSuccess)
#define cudaGetLastError() (cudaSuccess)
// The pipelined kernels' resident-CTA count: two "SMs" of one CTA each, so that each CTA walks many tiles
#define cudaGetDevice(d) ((*(d) = 0), cudaSuccess)
#define cudaDeviceGetAttribute(v, attr, dev) ((*(v) = 2), cudaSuccess)
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, f, t, s) ((*(n) = 1), cudaSuccess)
"""


def cuda_include_dir() -> Optional[Path]:
    """The CUDA toolkit's include directory (cuda_runtime.h and cccl/), found beside nvcc or under the usual roots."""
    from cutlass_byoc.toolchain import ToolchainError, nvcc_path  # noqa: PLC0415

    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    try:
        roots.insert(0, str(Path(nvcc_path()).resolve().parent.parent))
    except ToolchainError:
        pass
    for root in filter(None, roots):
        inc = Path(root) / "include"
        if (inc / "cccl").is_dir() and (inc / "cuda_runtime.h").exists():
            return inc
    return None


def skip_reason() -> Optional[str]:
    if not shutil.which("g++"):
        return "needs g++ (C++20) to emulate the kernels on the CPU"
    if cuda_include_dir() is None:
        return "needs the CUDA toolkit's headers (cuda_runtime.h, cccl/): set CUDA_HOME"
    try:
        from cutlass_byoc.toolchain import toolchain  # noqa: PLC0415

        toolchain()
    except Exception as e:  # noqa: BLE001 - the reason to skip
        return str(e)
    return None


@functools.lru_cache(maxsize=None)
def _include_flags() -> tuple[str, ...]:
    from cutlass_byoc.toolchain import toolchain  # noqa: PLC0415

    inc = cuda_include_dir()
    return (*(f"-I{d}" for d in toolchain().include_dirs), f"-I{inc}", f"-I{inc / 'cccl'}")


def emulated_source(config) -> str:
    from cutlass_byoc.render import render  # noqa: PLC0415

    src = render(config, "g++ (CPU emulation)").replace("#include <cuda_runtime.h>", PRELUDE)
    src, launches = re.subn(r"(\w+(?:<\w+>)?)<<<([^,]+), ([^,]+), 0, s>>>\((.*?)\);",  # kernel<N> too
                            r"emu_launch(\2, \3, [&] { \1(\4); });", src)
    assert launches or "cudaLaunchKernelEx" in src, "no kernel launch found in the rendered source"
    return src


@functools.lru_cache(maxsize=None)
def load(config, build_dir: str = os.path.join(tempfile.gettempdir(), "cutlass-byoc-emulated")) -> ctypes.CDLL:
    """The CPU build of `config`'s library (g++ -fpermissive: CUTLASS's unused device-only templates stay unparsed)."""
    src = emulated_source(config)
    key = hashlib.sha256(src.encode()).hexdigest()[:16]
    out = Path(build_dir) / f"{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        cpp = out.with_suffix(".cpp")
        cpp.write_text(src)
        tmp = out.with_suffix(f".{os.getpid()}.so")
        r = subprocess.run(["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-w", "-fpermissive", *_include_flags(),
                            "-x", "c++", str(cpp), "-o", str(tmp), "-lpthread"], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"g++ failed on {config.name}:\n{r.stderr[-4000:]}")
        tmp.replace(out)
    from cutlass_byoc.runtime import open_library  # noqa: PLC0415

    return open_library(out)


def run(config, problem, a, b, out, source=None, splits: int = 1, alpha: float = 1.0, bias=None) -> None:
    """cb_run of the emulated library on CPU tensors (channels_last, as the kernels read them); `bias` is the bias of
    SourceKind.BIAS_RESIDUAL (`source` then the residual)."""
    import torch  # noqa: PLC0415

    from cutlass_byoc.runtime import make_args  # noqa: PLC0415

    lib = load(config)
    args = make_args(problem, splits, a.data_ptr(), b.data_ptr(), out.data_ptr(),
                     source.data_ptr() if source is not None else 0, alpha,
                     bias=bias.data_ptr() if bias is not None else 0)
    ws = torch.empty(max(1, lib.cb_workspace_size(ctypes.byref(args))), dtype=torch.uint8)
    msg = ctypes.create_string_buffer(256)
    rc = lib.cb_run(ctypes.byref(args), ws.data_ptr(), ws.numel(), None, msg, len(msg))
    if rc:
        raise RuntimeError(f"{config.name}: {msg.value.decode()}")
