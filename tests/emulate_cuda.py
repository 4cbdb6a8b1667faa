"""Run a rendered kernel library (depthwise, shared-memory im2col) on the CPU: the exact source the template renders,
compiled by g++ with a small emulation of the CUDA launch model (blocks one after another, a block's threads as
std::threads meeting at a barrier for __syncthreads, __shared__ arrays as statics shared by them, dynamic shared memory
as a per-block buffer filled with 0xFF bytes (NaN as f16/bf16/f32) first, shared-memory atomics under a mutex), then
called through its extern "C" cb_run on host buffers. It checks the kernels' index arithmetic (tiles, halos, windows,
rotated filters, valid taps, split partials, epilogues) without a GPU; nothing about speed or the GPU's memory model.

The shared-memory im2col kernels' inline-PTX helpers are replaced by emulations (WARP_HELPERS) that follow the PTX
ISA's fragment layouts: mma.sync m16n8k16 and ldmatrix (.trans too) exchange their lanes' registers through a per-warp
scratch area at a per-warp barrier; cp.async copies (or zero-fills) at once. The fprop kernel, verified on the GPU,
checks these emulations in turn (tests/test_smem_im2col_emulated.py)."""

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
#include <algorithm>
#include <barrier>
#include <cstring>
#include <functional>
#include <memory>
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
// Warp collectives (WARP_HELPERS): a barrier per warp and a scratch area where the lanes leave their registers
struct EmuWarp { std::barrier<>* bar = nullptr; uint32_t regs[32][8]; const void* ptr[32]; };
EmuWarp emu_warps[32];
unsigned char* emu_dyn_smem = nullptr;  // the running block's dynamic shared memory (emu_launch_dyn)
size_t emu_dyn_bytes = 0;
inline int emu_tid() {
  return int(emu_threadIdx.x + emu_blockDim.x * (emu_threadIdx.y + emu_blockDim.y * emu_threadIdx.z));
}
using std::max;
using std::min;
// ldmatrix .x4 (see WARP_HELPERS): lane l gives the address of row l % 8 of matrix l / 8
inline void emu_ldsm(uint32_t (&r)[4], void const* smem_ptr, bool trans) {
  EmuWarp& w = emu_warps[emu_tid() / 32];
  int const lane = emu_tid() % 32, g = lane / 4, t = lane % 4;
  w.ptr[lane] = smem_ptr;
  w.bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (trans) {
      lo = static_cast<uint16_t const*>(w.ptr[8 * i + 2 * t])[g];
      hi = static_cast<uint16_t const*>(w.ptr[8 * i + 2 * t + 1])[g];
    } else {
      lo = static_cast<uint16_t const*>(w.ptr[8 * i + g])[2 * t];
      hi = static_cast<uint16_t const*>(w.ptr[8 * i + g])[2 * t + 1];
    }
    r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  w.bar->arrive_and_wait();
}

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
      if (emu_dyn_smem) std::memset(emu_dyn_smem, 0xFF, emu_dyn_bytes);  // no block sees another's leftovers
      std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
      for (unsigned w = 0; w * 32 < threads && w < 32; ++w) {
        warp_bars.emplace_back(new std::barrier<>(std::ptrdiff_t(std::min(32u, threads - 32 * w))));
        emu_warps[w].bar = warp_bars.back().get();
      }
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
// A <<<grid, block, bytes, stream>>> launch: `bytes` of dynamic shared memory, every byte 0xFF (NaN in any float type)
// at each block's start (emu_launch), the blocks running one after another in the one buffer.
inline void emu_launch_dyn(dim3 grid, dim3 block, size_t bytes, std::function<void()> body) {
  std::vector<unsigned char> buf(bytes ? bytes : 1);
  emu_dyn_smem = buf.data();
  emu_dyn_bytes = buf.size();
  emu_launch(grid, block, body);
  emu_dyn_smem = nullptr;
}
#define cudaFuncSetAttribute(...) (cudaSuccess)
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


#: The shared-memory im2col templates' inline-PTX helpers, emulated: each replaces the definition of the same name
#: (after `using Element`, whose bits the mma reads). Layouts (PTX ISA, mma.m16n8k16 with .f16/.bf16, ldmatrix): lane
#: l = 4 g + t holds A rows g and g + 8, columns 2t, 2t+1 (registers 0, 1) and 2t+8, 2t+9 (2, 3); B rows 2t, 2t+1
#: (register 0) and 2t+8, 2t+9 (1) of column g; C/D rows g (0, 1) and g + 8 (2, 3), columns 2t, 2t+1. ldmatrix .x4:
#: lane l gives the address of row l % 8 of matrix l / 8; without .trans lane (g, t) gets row g, elements 2t, 2t+1 of
#: each matrix, with .trans rows 2t and 2t+1 of column g.
WARP_HELPERS = {
    "mma_16816": r"""
CUTLASS_DEVICE float emu_bits(uint32_t v, int high) { return float(Element::bitcast(uint16_t(high ? v >> 16 : v))); }
CUTLASS_DEVICE void mma_16816(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2]) {
  EmuWarp& w = emu_warps[emu_tid() / 32];
  int const lane = emu_tid() % 32, g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) w.regs[lane][i] = a[i];
  w.regs[lane][4] = b[0], w.regs[lane][5] = b[1];
  w.bar->arrive_and_wait();
  for (int e = 0; e < 4; ++e) {
    int const row = g + 8 * (e / 2), col = 2 * t + e % 2;
    float s = 0.f;
    for (int k = 0; k < 16; ++k)
      s += emu_bits(w.regs[(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2) *
           emu_bits(w.regs[col * 4 + (k % 8) / 2][4 + k / 8], k % 2);
    d[e] += s;
  }
  w.bar->arrive_and_wait();
}
""",
    "ldsm_x4": r"""
CUTLASS_DEVICE void ldsm_x4(uint32_t (&r)[4], void const* smem_ptr) { emu_ldsm(r, smem_ptr, false); }
""",
    "ldsm_x4_trans": r"""
CUTLASS_DEVICE void ldsm_x4_trans(uint32_t (&r)[4], void const* smem_ptr) { emu_ldsm(r, smem_ptr, true); }
""",
    "cp_async16": r"""
CUTLASS_DEVICE void cp_async16(void* smem_dst, void const* src, bool valid) {
  if (valid) std::memcpy(smem_dst, src, 16); else std::memset(smem_dst, 0, 16);
}
""",
    "cp_async_commit": "CUTLASS_DEVICE void cp_async_commit() {}\n",
    "cp_async_wait_all": "CUTLASS_DEVICE void cp_async_wait_all() {}\n",
}


def _replace_function(src: str, name: str, replacement: str) -> str:
    """`src` with the definition of `CUTLASS_DEVICE void name(...) { ... }` replaced (its braces matched)."""
    start = src.find(f"CUTLASS_DEVICE void {name}(")
    if start < 0:
        return src
    i = src.index("{", src.index(")", start))
    depth = 0
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            return src[:start] + replacement.strip() + "\n" + src[j + 1:]
    raise ValueError(f"unbalanced braces after {name}")


def _split_top_level(text: str) -> list[str]:
    """`text` split at its commas outside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + [cur.strip()]


def _emulate_launches(src: str) -> tuple[str, int]:
    """Every `kernel<<<grid, block, bytes, s>>>(args);` (a template kernel's `kernel<N>` too, any expressions) ->
    emu_launch_dyn; and how many there were."""
    out, pos, n = "", 0, 0
    for m in re.finditer(r"(\w+(?:<\w+>)?)<<<", src):
        if m.start() < pos:
            continue
        close = src.index(">>>(", m.end())
        grid, block, smem, _ = _split_top_level(src[m.end():close])
        args_start = close + 4
        depth, j = 1, args_start
        while depth:
            depth += {"(": 1, ")": -1}.get(src[j], 0)
            j += 1
        assert src[j] == ";", src[m.start():j + 1]
        call = f"{m.group(1)}({src[args_start:j - 1]});"
        out += src[pos:m.start()] + f"emu_launch_dyn({grid}, {block}, {smem}, [&] {{ {call} }});"
        pos, n = j + 1, n + 1
    return out + src[pos:], n


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
    # the shared-memory im2col kernels: dynamic shared memory, inline-PTX helpers (neither in the depthwise kernels)
    src = src.replace("extern __shared__ __align__(16) unsigned char smem[];", "unsigned char* smem = emu_dyn_smem;")
    for name, body in WARP_HELPERS.items():
        src = _replace_function(src, name, body)
    src, launches = _emulate_launches(src)
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


def run(config, problem, a, b, out, source=None, splits: int = 1, alpha: float = 1.0, bias=None,
        workspace_bytes: Optional[int] = None) -> None:
    """cb_run of the emulated library on CPU tensors (channels_last, as the kernels read them); `bias` is the bias of
    SourceKind.BIAS_RESIDUAL (`source` then the residual); `workspace_bytes`: the workspace given (by default what
    cb_workspace_size asks)."""
    import torch  # noqa: PLC0415

    from cutlass_byoc.runtime import make_args  # noqa: PLC0415

    lib = load(config)
    args = make_args(problem, splits, a.data_ptr(), b.data_ptr(), out.data_ptr(),
                     source.data_ptr() if source is not None else 0, alpha,
                     bias=bias.data_ptr() if bias is not None else 0)
    wanted = lib.cb_workspace_size(ctypes.byref(args)) if workspace_bytes is None else workspace_bytes
    ws = torch.empty(max(1, wanted), dtype=torch.uint8)
    msg = ctypes.create_string_buffer(256)
    rc = lib.cb_run(ctypes.byref(args), ws.data_ptr() if wanted else None, wanted, None, msg, len(msg))
    if rc:
        raise RuntimeError(f"{config.name}: {msg.value.decode()}")
