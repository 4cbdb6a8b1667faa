import re

from cutlass_byoc.candidates import sm80_candidates
from cutlass_byoc.build import prepare
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.render import render
from cutlass_byoc.types import Activation, IteratorAlgorithm, SplitKMode


def first(problem, **want):
    return next(c for c in sm80_candidates(problem) if all(getattr(c, k) == v for k, v in want.items()))


def test_header_names_config_and_compile_command():
    cfg = first(Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1), tile=(128, 128, 32))
    src = render(cfg, "nvcc -O3 kernel.cu -o kernel.so")
    head = src.splitlines()
    assert head[0] == f"// {cfg.name}"
    assert "// Compile: nvcc -O3 kernel.cu -o kernel.so" in src
    assert re.search(r"//   tile\s+\[128, 128, 32\]", src)
    assert "DefaultConv2dFprop<" in src and "GemmShape<128, 128, 32>" in src and "GemmShape<64, 64, 32>" in src
    assert 'extern "C"' in src and "int cb_run(" in src and "cb_can_implement" in src


def test_strided_dgrad_uses_the_strided_kernel_and_swizzle():
    cfg = first(Conv2dProblem.make("dgrad", 32, 128, 56, 56, 128, 3, stride=2, padding=1))
    src = render(cfg, "cmd")
    assert "DefaultConv2dDgrad<" in src
    assert "cutlass::conv::StrideSupport::kStrided" in src
    assert "StridedDgradIdentityThreadblockSwizzle<1>" in src
    unity = first(Conv2dProblem.make("dgrad", 32, 128, 56, 56, 128, 3, padding=1))
    assert "StrideSupport::kUnity" in render(unity, "cmd")


def test_parallel_split_k_stores_fp32_partials_and_reduces_with_the_real_epilogue():
    p = Conv2dProblem.make("wgrad", 32, 64, 56, 56, 64, 3, padding=1, out_dtype="f16")
    cfg = first(p, split_k_mode=SplitKMode.PARALLEL)
    src = render(cfg, "cmd")
    assert "using ElementKernelOut = ElementAccumulator;" in src
    assert "ReduceSplitK" in src and "SplitKMode::kParallel" in src
    assert "using ElementAccumulator = float;" in src and "using ElementOutput = cutlass::half_t;" in src
    serial = first(p, split_k_mode=SplitKMode.SERIAL)
    assert "ReduceSplitK" not in render(serial, "cmd")


def test_activation_epilogues_and_fixed_iterators():
    p = Conv2dProblem.make("fprop", 32, 3, 224, 224, 64, 7, stride=2, padding=3)
    cfg = first(p, iterator=IteratorAlgorithm.FEW_CHANNELS)
    assert "IteratorAlgorithm::kFewChannels" in render(cfg, "cmd")
    from cutlass_byoc.problem import Epilogue

    for act, functor in [(Activation.RELU, "LinearCombinationRelu"), (Activation.SILU, "LinearCombinationSilu"),
                         (Activation.GELU, "LinearCombinationGELU"), (Activation.HARDSWISH, "LinearCombinationHardSwish"),
                         (Activation.SIGMOID, "LinearCombinationSigmoid")]:
        q = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1, epilogue=Epilogue(act))
        assert functor + "<" in render(first(q), "cmd")


def test_cache_key_depends_on_source_and_is_stable():
    p = Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1)
    a, b = list(sm80_candidates(p))[:2]
    assert prepare(a)[1] == prepare(a)[1]
    assert prepare(a)[1] != prepare(b)[1]
