"""Compile-only tests of the bias-vector kernels (issue 13): both families build with nvcc for sm_90a, load (ABI and
config checked), and their host API takes a bias with a residual (source_kind 3) and a bias alone (1), and refuses
what they do not do."""

import pytest

from cutlass_byoc.build import build
from cutlass_byoc.candidates import sm80_candidates
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.runtime import KernelLibrary
from cutlass_byoc.sm90 import CHANNEL_STATS_SLOTS, sm90_candidates, sm90_config
from cutlass_byoc.types import Activation, SourceKind

from compile_util import raw_can_implement  # noqa: E402

pytestmark = pytest.mark.compile

BR = SourceKind.BIAS_RESIDUAL
# the fp32 model's conv -> bias -> residual -> relu -> .half(), on TF32; and a bf16 sm90 one with an fp32 bias
P80 = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1, dtype="f32", out_dtype="f16",
                         epilogue=Epilogue(Activation.RELU, BR, "f32"))
P90 = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1, dtype="bf16",
                         epilogue=Epilogue(Activation.SILU, BR, "f32"))
KERNELS = {"sm80": (P80, next(sm80_candidates(P80))), "sm90": (P90, next(sm90_candidates(P90)))}


@pytest.fixture(scope="module")
def built(shared_cache):
    return build([cfg for _, cfg in KERNELS.values()], cache=shared_cache)


@pytest.mark.parametrize("which", list(KERNELS))
def test_bias_vector_kernel_builds_and_takes_bias_with_residual(built, which):
    problem, cfg = KERNELS[which]
    result = built[cfg]
    assert result.ok, result.error_report()
    assert "warning" not in result.entry.log.lower(), result.entry.log
    lib = KernelLibrary(cfg, result.library)
    assert lib.can_implement(problem) is None
    bias_only = problem.replace(epilogue=Epilogue(problem.epilogue.activation, SourceKind.BIAS, "f32"))
    assert lib.can_implement(bias_only) is None and raw_can_implement(lib, bias_only) is None
    residual_only = problem.replace(epilogue=Epilogue(problem.epilogue.activation, SourceKind.RESIDUAL))
    assert "source_kind must be 1 (bias) or 3" in raw_can_implement(lib, residual_only)
    assert "element_bias" in lib.can_implement(residual_only)
    assert lib.workspace_size(problem) >= 0
    if which == "sm80":
        assert "runs unsplit" in raw_can_implement(lib, problem, 2)


# The channel-statistics twin of a plain sm90 fprop kernel (KernelConfig.channel_stats): M and N tails in its problem
STATS_PROBLEM = Conv2dProblem.make("fprop", 4, 64, 30, 30, 72, 3, padding=1)
STATS_KERNEL = sm90_config(STATS_PROBLEM, (128, 64, 64)).with_channel_stats()


def test_channel_statistics_kernel_builds_and_checks_its_arguments(shared_cache):
    result = build([STATS_KERNEL], cache=shared_cache)[STATS_KERNEL]
    assert result.ok, result.error_report()
    lib = KernelLibrary(STATS_KERNEL, result.library)
    assert lib.can_implement(STATS_PROBLEM) is None  # a null buffer passes (the reductions then write nothing)
    assert raw_can_implement(lib, STATS_PROBLEM, fields={"stats": 0x50000}) is None
    assert "16-byte aligned buffer" in raw_can_implement(lib, STATS_PROBLEM, fields={"stats": 0x50004})
    assert "no source" in raw_can_implement(lib, STATS_PROBLEM, source_kind=2, source=0x40000)
    assert "alpha 1" in raw_can_implement(lib, STATS_PROBLEM, fields={"alpha": 2.0})
    assert "multiple of 4" in raw_can_implement(lib, STATS_PROBLEM.replace(k=66), fields={"k": 66})
    # the kernel's own workspace (none), then the slots its atomic adds spread over (summed into the buffer after it)
    assert lib.workspace_size(STATS_PROBLEM) == CHANNEL_STATS_SLOTS * 2 * 72 * 4
