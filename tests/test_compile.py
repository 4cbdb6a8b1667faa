"""Compile-only tests: render real kernels, build them with nvcc for sm_90a, load them and ask their host-side API
(no GPU needed for can_implement and workspace sizes)."""

import pytest

from cutlass_byoc.build import build
from cutlass_byoc.candidates import sm80_candidates
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.runtime import KernelLibrary
from cutlass_byoc.types import IteratorAlgorithm, SplitKMode

from compile_util import loaded_kernel  # noqa: E402

pytestmark = pytest.mark.compile

STEM = Conv2dProblem.make("fprop", 32, 3, 224, 224, 64, 7, stride=2, padding=3)
STRIDED_DGRAD = Conv2dProblem.make("dgrad", 32, 128, 56, 56, 128, 3, stride=2, padding=1)
ODD_WGRAD = Conv2dProblem.make("wgrad", 32, 7, 56, 56, 33, 3, padding=1)


def pick(problem, **want):
    return next(c for c in sm80_candidates(problem) if all(getattr(c, k) == v for k, v in want.items()))


KERNELS = {
    "fprop": (STEM, pick(STEM, tile=(128, 64, 32), iterator=IteratorAlgorithm.FEW_CHANNELS)),
    "strided_dgrad": (STRIDED_DGRAD, pick(STRIDED_DGRAD, tile=(128, 128, 32), stages=3)),
    "wgrad_parallel": (ODD_WGRAD, pick(ODD_WGRAD, tile=(64, 64, 32), split_k_mode=SplitKMode.PARALLEL)),
}


@pytest.fixture(scope="module")
def built(shared_cache):
    results = build([cfg for _, cfg in KERNELS.values()], cache=shared_cache)
    return results


@pytest.mark.parametrize("which", list(KERNELS))
def test_kernel_compiles_and_exports_the_api(built, which):
    problem, cfg = KERNELS[which]
    result = built[cfg]
    loaded_kernel(result, cfg, problem)
    assert result.entry.meta["compile_seconds"] > 0
    assert "warning" not in result.entry.log.lower(), result.entry.log  # the generated code's warnings are defects


def test_host_api_refuses_what_the_kernel_cannot_do(built):
    problem, cfg = KERNELS["strided_dgrad"]
    lib = KernelLibrary(cfg, built[cfg].library)
    assert "strided dgrad has no split-k" in lib.can_implement(problem, split_k_slices=2)
    assert "alignment" in lib.can_implement(problem.replace(c=100, k=100))
    assert lib.workspace_size(problem) == 0


def test_parallel_split_k_workspace_holds_fp32_partials(built):
    problem, cfg = KERNELS["wgrad_parallel"]
    lib = KernelLibrary(cfg, built[cfg].library)
    m, n, _ = problem.gemm_mnk
    assert lib.workspace_size(problem, 8) == 8 * m * n * 4
    assert lib.can_implement(problem, 8) is None


def test_library_refuses_to_stand_in_for_another_config(built):
    _, fprop_cfg = KERNELS["fprop"]
    _, dgrad_cfg = KERNELS["strided_dgrad"]
    with pytest.raises(Exception, match="holds"):
        KernelLibrary(dgrad_cfg, built[fprop_cfg].library)
