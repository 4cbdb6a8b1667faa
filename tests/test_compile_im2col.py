"""Compile-only tests of the im2col lowering of the GEMM family (convs of few input channels, e.g. the RGB stem):
one real sm_90a kernel per kind, loaded and asked through its host-side API (no GPU needed for can_implement and
workspace sizes). The same configs serve tests/test_gpu_im2col.py."""

from __future__ import annotations

import pytest

from cutlass_byoc.build import build
from cutlass_byoc.gemm1x1 import im2col_config
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.runtime import KernelLibrary
from cutlass_byoc.types import Activation, SourceKind

from compile_util import loaded_kernel, raw_can_implement  # noqa: E402

pytestmark = pytest.mark.compile

#: The stem's shape at a small batch and image: 7x7 stride 2 over C=3.
FPROP = Conv2dProblem.make("fprop", 4, 3, 64, 64, 64, 7, stride=2, padding=3,
                           epilogue=Epilogue(Activation.RELU, SourceKind.BIAS))
DGRAD = Conv2dProblem.make("dgrad", 4, 3, 64, 64, 64, 7, stride=2, padding=3)
WGRAD = Conv2dProblem.make("wgrad", 4, 3, 64, 64, 64, 7, stride=2, padding=3)

#: Shared with tests/test_gpu_im2col.py (the same configs, so a warm cache serves both).
KERNELS = {
    "fprop": (FPROP, im2col_config(FPROP, (128, 64, 64), "pingpong")),
    "dgrad": (DGRAD, im2col_config(DGRAD, (128, 64, 64), "pingpong")),
    "wgrad": (WGRAD, im2col_config(WGRAD, (128, 64, 64), "cooperative_streamk")),
}


@pytest.fixture(scope="module")
def built(shared_cache):
    return build([cfg for _, cfg in KERNELS.values()], cache=shared_cache)


@pytest.mark.parametrize("which", list(KERNELS))
def test_kernel_compiles_and_exports_the_api(built, which):
    problem, cfg = KERNELS[which]
    result = built[cfg]
    _, lib = loaded_kernel(result, cfg, problem)
    assert "im2col" in cfg.name
    assert raw_can_implement(lib, problem) is None
    print(f"{cfg.name}: compiled in {result.entry.meta['compile_seconds']:.0f} s")


@pytest.mark.parametrize("which", list(KERNELS))
def test_workspace_holds_a_chunk_and_the_filter(built, which):
    problem, cfg = KERNELS[which]
    lib = KernelLibrary(cfg, built[cfg].library)
    rows, kp = problem.n * problem.p * problem.q, 152  # Wp / dWp: 7*7*3 = 147 taps in rows of 152
    chunk = 147 * -(-rows // 64) * 64 * (4 if which == "dgrad" else 2)  # 147 tap rows of the 4 small images' pixels
    filt = problem.k * kp * (4 if which == "wgrad" else 2)
    assert lib.workspace_size(problem) >= chunk + filt
    # a batch past one chunk (64 MiB of rows) takes no more than one chunk's buffer
    big = problem.replace(n=96, h=224, w=224)
    assert chunk + filt < lib.workspace_size(big) < 72 << 20


@pytest.mark.parametrize("which", list(KERNELS))
def test_host_api_checks(built, which):
    problem, cfg = KERNELS[which]
    lib = KernelLibrary(cfg, built[cfg].library)
    assert "output size" in raw_can_implement(lib, problem, fields={"p": problem.p + 1})
    assert "R*S*C" in raw_can_implement(lib, problem.replace(c=17, r=7, s=7))
    assert "alignment" in raw_can_implement(lib, problem.replace(k=36))
    if which == "fprop":
        assert "alignment" in raw_can_implement(lib, problem, d=0x30008)  # y moves by TMA
        assert raw_can_implement(lib, problem, a=0x10002, b=0x20006) is None  # x and w are read element-wise
    else:
        assert "alignment" in raw_can_implement(lib, problem, a=0x10008)  # dy moves by TMA
        assert "source_kind" in raw_can_implement(lib, problem, source_kind=2)
        assert raw_can_implement(lib, problem, b=0x20002, d=0x30002) is None
