"""Compile-only tests of the 1x1-as-GEMM family: one real sm_90a kernel per kind (and per schedule: fprop
cooperative, dgrad ping-pong, wgrad cooperative stream-K; a sourceless fprop, also with its epilogue's D buffers
replaced), loaded and asked through its host-side API (no GPU needed for can_implement and workspace sizes).
~60-200 s and ~3.5 GB of memory per kernel."""

from __future__ import annotations

import pytest

from cutlass_byoc.build import build
from cutlass_byoc.gemm1x1 import gemm1x1_config, with_store_stages
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.runtime import KernelLibrary

from compile_util import loaded_kernel, raw_can_implement  # noqa: E402

pytestmark = pytest.mark.compile

FPROP = Conv2dProblem.make("fprop", 32, 256, 56, 56, 64, 1)
DGRAD = Conv2dProblem.make("dgrad", 32, 64, 56, 56, 256, 1, dtype="bf16")
WGRAD = Conv2dProblem.make("wgrad", 32, 64, 56, 56, 64, 1, out_dtype="f32")

#: Shared with tests/test_gpu_gemm1x1.py (the same configs, so a warm cache serves both).
KERNELS = {
    "fprop": (FPROP, gemm1x1_config(FPROP, (128, 128, 64), "cooperative")),
    "dgrad": (DGRAD, gemm1x1_config(DGRAD, (128, 64, 64), "pingpong", (2, 1, 1))),
    "wgrad": (WGRAD, gemm1x1_config(WGRAD, (128, 128, 64), "cooperative_streamk")),
    # the sourceless form the planner gives problems without bias or residual (no C operand at all)
    "fprop_nosrc": (FPROP, gemm1x1_config(FPROP, (256, 64, 64), "pingpong", sourceless=True)),
    # and with one epilogue D buffer per sub-tile (KernelConfig.epi_stages: the builder's collective, StagesD replaced)
    "fprop_nosrc_stores": (FPROP, with_store_stages(gemm1x1_config(FPROP, (256, 64, 64), "pingpong", sourceless=True))),
}


@pytest.fixture(scope="module")
def built(shared_cache):
    return build([cfg for _, cfg in KERNELS.values()], cache=shared_cache)


@pytest.mark.parametrize("which", list(KERNELS))
def test_kernel_compiles_and_exports_the_api(built, which):
    problem, cfg = KERNELS[which]
    result = built[cfg]
    src, lib = loaded_kernel(result, cfg, problem)
    assert "-DNDEBUG" in src
    assert raw_can_implement(lib, problem) is None
    assert result.entry.meta["compile_seconds"] > 0
    assert "warning" not in result.entry.log.lower(), result.entry.log  # the generated code's warnings are defects
    print(f"{cfg.name}: compiled in {result.entry.meta['compile_seconds']:.0f} s")


@pytest.mark.parametrize("which", list(KERNELS))
def test_host_api_refuses_what_is_not_a_plain_gemm(built, which):
    problem, cfg = KERNELS[which]
    lib = KernelLibrary(cfg, built[cfg].library)
    assert "filter" in raw_can_implement(lib, problem.replace(r=3, s=3, pad_h=1, pad_w=1))
    assert "stride" in raw_can_implement(lib, problem.replace(stride_h=2, stride_w=2))
    assert "padding" in raw_can_implement(lib, problem.replace(pad_h=1, pad_w=1))
    assert "alignment" in raw_can_implement(lib, problem.replace(c=36, k=36))
    if which == "wgrad":
        assert "bias" in raw_can_implement(lib, problem, source_kind=1)


def test_split_k_only_on_the_stream_k_kernel(built):
    problem, cfg = KERNELS["fprop"]
    lib = KernelLibrary(cfg, built[cfg].library)
    assert "split_k_slices" in raw_can_implement(lib, problem, 2)
    assert lib.workspace_size(problem) == 0  # the persistent scheduler needs none

    problem, cfg = KERNELS["wgrad"]
    lib = KernelLibrary(cfg, built[cfg].library)
    assert raw_can_implement(lib, problem, 8) is None
    m, n, _ = problem.gemm_mnk
    # split-k: fp32 partials of the output tiles (plus flags) in the workspace
    assert lib.workspace_size(problem, 8) >= m * n * 4
