"""Compile-only tests of the 1x1-as-GEMM family: one real sm_90a kernel per kind (and per schedule: fprop
cooperative, dgrad ping-pong, wgrad cooperative stream-K), loaded and asked through its host-side API (no GPU
needed for can_implement and workspace sizes). ~60-200 s and ~3.5 GB of memory per kernel."""

from __future__ import annotations

import ctypes

import pytest

from cutlass_byoc.build import build
from cutlass_byoc.gemm1x1 import gemm1x1_config
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.runtime import KernelLibrary, make_args

pytestmark = pytest.mark.compile

FPROP = Conv2dProblem.make("fprop", 32, 256, 56, 56, 64, 1)
DGRAD = Conv2dProblem.make("dgrad", 32, 64, 56, 56, 256, 1, dtype="bf16")
WGRAD = Conv2dProblem.make("wgrad", 32, 64, 56, 56, 64, 1, out_dtype="f32")

#: Shared with tests/test_gpu_gemm1x1.py (the same configs, so a warm cache serves both).
KERNELS = {
    "fprop": (FPROP, gemm1x1_config(FPROP, (128, 128, 64), "cooperative")),
    "dgrad": (DGRAD, gemm1x1_config(DGRAD, (128, 64, 64), "pingpong", (2, 1, 1))),
    "wgrad": (WGRAD, gemm1x1_config(WGRAD, (128, 128, 64), "cooperative_streamk")),
}


@pytest.fixture(scope="module")
def built(shared_cache):
    return build([cfg for _, cfg in KERNELS.values()], cache=shared_cache)


def _raw_can_implement(lib: KernelLibrary, problem: Conv2dProblem, slices: int = 1, source_kind=None, fields=None,
                       **ptrs) -> str:
    """The C side's own answer (KernelLibrary.can_implement asks the Python rules first); `fields` overrides
    arguments of the struct, `ptrs` the addresses (a, b, d, source). Shared with tests/test_compile_im2col.py."""
    p = dict(a=0x10000, b=0x20000, d=0x30000, source=0x40000 if problem.epilogue.source.value != "none" else 0)
    p.update(ptrs)
    args = make_args(problem, slices, p["a"], p["b"], p["d"], p["source"])
    if source_kind is not None:
        args.source_kind = source_kind
    for name, value in (fields or {}).items():
        setattr(args, name, value)
    msg = ctypes.create_string_buffer(512)
    rc = lib._lib.cb_can_implement(ctypes.byref(args), msg, len(msg))
    return "" if rc == 0 else msg.value.decode()


@pytest.mark.parametrize("which", list(KERNELS))
def test_kernel_compiles_and_exports_the_api(built, which):
    problem, cfg = KERNELS[which]
    result = built[cfg]
    assert result.ok, result.error_report()
    src = result.entry.source.read_text()
    assert src.startswith(f"// {cfg.name}\n")
    assert "// Compile: nvcc " in src and "-gencode=arch=compute_90a,code=sm_90a" in src and "-DNDEBUG" in src
    lib = KernelLibrary(cfg, result.library)  # checks ABI and that the library holds exactly this config
    assert lib.can_implement(problem) is None
    assert _raw_can_implement(lib, problem) == ""
    assert result.entry.meta["compile_seconds"] > 0
    print(f"{cfg.name}: compiled in {result.entry.meta['compile_seconds']:.0f} s")


@pytest.mark.parametrize("which", list(KERNELS))
def test_host_api_refuses_what_is_not_a_plain_gemm(built, which):
    problem, cfg = KERNELS[which]
    lib = KernelLibrary(cfg, built[cfg].library)
    assert "filter" in _raw_can_implement(lib, problem.replace(r=3, s=3, pad_h=1, pad_w=1))
    assert "stride" in _raw_can_implement(lib, problem.replace(stride_h=2, stride_w=2))
    assert "padding" in _raw_can_implement(lib, problem.replace(pad_h=1, pad_w=1))
    assert "alignment" in _raw_can_implement(lib, problem.replace(c=36, k=36))
    if which == "wgrad":
        assert "bias" in _raw_can_implement(lib, problem, source_kind=1)


def test_split_k_only_on_the_stream_k_kernel(built):
    problem, cfg = KERNELS["fprop"]
    lib = KernelLibrary(cfg, built[cfg].library)
    assert "split_k_slices" in _raw_can_implement(lib, problem, 2)
    assert lib.workspace_size(problem) == 0  # the persistent scheduler needs none

    problem, cfg = KERNELS["wgrad"]
    lib = KernelLibrary(cfg, built[cfg].library)
    assert _raw_can_implement(lib, problem, 8) == ""
    m, n, _ = problem.gemm_mnk
    # split-k: fp32 partials of the output tiles (plus flags) in the workspace
    assert lib.workspace_size(problem, 8) >= m * n * 4
