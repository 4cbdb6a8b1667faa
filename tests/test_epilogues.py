"""CPU tests of issue 13's epilogues: bias + residual in one epilogue, an fp32 bias under a 16-bit output (the
bias-vector kernels, KernelConfig.element_bias), the types the generated sources compute and store in, and that no
existing kernel's source changed (kernels are cached by the hash of their source)."""

from __future__ import annotations

import hashlib
import re

import pytest

from cutlass_byoc import render as render_mod
from cutlass_byoc.candidates import sm80_candidates
from cutlass_byoc.config import KernelConfig, LaunchConfig
from cutlass_byoc.heuristics import default_launch
from cutlass_byoc.problem import Conv2dProblem, Epilogue, ProblemError
from cutlass_byoc.render import render
from cutlass_byoc.runtime import CbConv2dArgs, make_args, pointer_error
from cutlass_byoc.sm90 import sm90_candidates
from cutlass_byoc.types import Activation, ConvKind, DType, IteratorAlgorithm, SourceKind, SplitKMode

BR = SourceKind.BIAS_RESIDUAL


def fprop(c=64, k=64, dtype="f16", out=None, act=Activation.IDENTITY, source=SourceKind.NONE, bias=None, **kw):
    return Conv2dProblem.make("fprop", 8, c, 28, 28, k, 3, padding=1, dtype=dtype, out_dtype=out,
                              epilogue=Epilogue(act, source, bias), **kw)


# ---------------------------------------------------------------------------------------------- no cache churn
#: (config JSON, sha256 of render(config, "nvcc CMD") at cutlass_byoc 0.1.0) of existing kernels, taken before the
#: bias-vector epilogue was added. A change here changes those kernels' sources, so their cache keys: every cached
#: kernel would be rebuilt. Update only for a change meant to do that (and say so). Re-pinned once: the 3.x split-k
#: change of the sm90 template (alpha/beta computed per kernel variant) changed the sm90 kernels' sources. Re-pinned
#: again for the launch memo (templates/launch_memo.h.j2), which the 2.x and 3.x kernels' host code includes. The 2.x
#: ones re-pinned once more when their unused code went (nvcc warnings: CbLaunchList, source_layout; 2026-12-04).
EXISTING_SOURCES = [
    ('{"activation": "identity", "align_a": 8, "align_b": 8, "align_c": 8, "arch": 90, "cluster": [1, 1, 1], "element_a": "f16", "element_acc": "f32", "element_b": "f16", "element_out": "f16", "family": "sm80_implicit_gemm", "filter_rs": null, "iterator": "optimized", "kind": "fprop", "schedule": null, "split_k_mode": "serial", "stages": 10, "stride_support": "unity", "swizzle": 1, "tile": [64, 64, 32], "warps": [2, 2, 1]}',
     "8b93ef912731273027a8500957147aa6a23be623ac46de3cd9e509daaaf3cdcd"),  # fprop_f16_opt
    ('{"activation": "relu", "align_a": 8, "align_b": 8, "align_c": 8, "arch": 90, "cluster": [1, 1, 1], "element_a": "f16", "element_acc": "f32", "element_b": "f16", "element_out": "f16", "family": "sm80_implicit_gemm", "filter_rs": null, "iterator": "optimized", "kind": "fprop", "schedule": null, "split_k_mode": "serial", "stages": 10, "stride_support": "unity", "swizzle": 1, "tile": [64, 64, 32], "warps": [2, 2, 1]}',
     "7599bb177c32f9d637ebcda8a71cf741739e2a8ebc80c01d0eebd8dfe29a95da"),  # fprop_f16_relu
    ('{"activation": "identity", "align_a": 1, "align_b": 1, "align_c": 8, "arch": 90, "cluster": [1, 1, 1], "element_a": "f16", "element_acc": "f32", "element_b": "f16", "element_out": "f16", "family": "sm80_implicit_gemm", "filter_rs": null, "iterator": "few_channels", "kind": "fprop", "schedule": null, "split_k_mode": "serial", "stages": 2, "stride_support": "strided", "swizzle": 1, "tile": [64, 64, 32], "warps": [2, 2, 1]}',
     "0bc5565663139cd276032ff22cf869db1dd88326488bc4a36e235e9b4f9b31e9"),  # fprop_few
    ('{"activation": "identity", "align_a": 8, "align_b": 8, "align_c": 8, "arch": 90, "cluster": [1, 1, 1], "element_a": "f16", "element_acc": "f32", "element_b": "f16", "element_out": "f16", "family": "sm80_implicit_gemm", "filter_rs": null, "iterator": "fixed_channels", "kind": "fprop", "schedule": null, "split_k_mode": "serial", "stages": 10, "stride_support": "strided", "swizzle": 1, "tile": [64, 64, 32], "warps": [2, 2, 1]}',
     "f37e7d5295c2be9579f46344c1402e85720c7d0c5946a064380c3e940b241ed1"),  # fprop_fixed
    ('{"activation": "gelu", "align_a": 4, "align_b": 4, "align_c": 8, "arch": 90, "cluster": [1, 1, 1], "element_a": "f32", "element_acc": "f32", "element_b": "f32", "element_out": "f16", "family": "sm80_implicit_gemm", "filter_rs": null, "iterator": "optimized", "kind": "fprop", "schedule": null, "split_k_mode": "serial", "stages": 10, "stride_support": "unity", "swizzle": 1, "tile": [64, 64, 16], "warps": [2, 2, 1]}',
     "8917bd1b9d8ac041736947c40c8046d076d9629ddeea6511bfb73d5499ff3635"),  # fprop_tf32_to_f16_gelu
    ('{"activation": "identity", "align_a": 8, "align_b": 8, "align_c": 4, "arch": 90, "cluster": [1, 1, 1], "element_a": "f16", "element_acc": "f32", "element_b": "f16", "element_out": "f16", "family": "sm80_implicit_gemm", "filter_rs": null, "iterator": "optimized", "kind": "wgrad", "schedule": null, "split_k_mode": "parallel", "stages": 10, "stride_support": "strided", "swizzle": 1, "tile": [64, 64, 32], "warps": [2, 2, 1]}',
     "c32868e7c9a0ceb0327c1726de1c1473aa13a23a95ce0314ab5f14b2d328a74e"),  # wgrad_parallel
    ('{"activation": "identity", "align_a": 8, "align_b": 8, "align_c": 8, "arch": 90, "cluster": [1, 1, 1], "element_a": "f16", "element_acc": "f32", "element_b": "f16", "element_out": "f16", "family": "sm80_implicit_gemm", "filter_rs": null, "iterator": "optimized", "kind": "dgrad", "schedule": null, "split_k_mode": "serial", "stages": 10, "stride_support": "strided", "swizzle": 1, "tile": [64, 64, 32], "warps": [2, 2, 1]}',
     "1decedbc7c931fff5074b035ee6245350477216fb5b4af35411d965f1d7c4e14"),  # dgrad_strided
    ('{"activation": "silu", "align_a": 8, "align_b": 8, "align_c": 8, "arch": 90, "cluster": [1, 1, 1], "element_a": "f16", "element_acc": "f32", "element_b": "f16", "element_out": "f16", "family": "sm90_tma_wgmma", "filter_rs": null, "iterator": "optimized", "kind": "fprop", "schedule": "implicit_tma_ws", "split_k_mode": "serial", "stages": 8, "stride_support": "unity", "swizzle": 1, "tile": [64, 64, 64], "warps": [4, 1, 1]}',
     "dbd262b97efc5958ed778d6e7ae5916341e17399f8ac9b19922d43eeeb8d7dd1"),  # sm90_fprop_silu
    ('{"activation": "identity", "align_a": 8, "align_b": 8, "align_c": 8, "arch": 90, "cluster": [1, 1, 1], "element_a": "bf16", "element_acc": "f32", "element_b": "bf16", "element_out": "bf16", "family": "sm90_tma_wgmma", "filter_rs": null, "iterator": "optimized", "kind": "fprop", "schedule": "implicit_tma_ws", "split_k_mode": "serial", "stages": 8, "stride_support": "unity", "swizzle": 1, "tile": [64, 64, 64], "warps": [4, 1, 1]}',
     "a4b61be95219ba4dca787ca1cd81f9641f9bce4a43f6520eb726811cc9b59767"),  # sm90_fprop_bias
    ('{"activation": "identity", "align_a": 8, "align_b": 8, "align_c": 8, "arch": 90, "cluster": [1, 1, 1], "element_a": "f16", "element_acc": "f32", "element_b": "f16", "element_out": "f16", "family": "sm90_tma_wgmma", "filter_rs": null, "iterator": "optimized", "kind": "wgrad", "schedule": "implicit_tma_ws", "split_k_mode": "serial", "stages": 8, "stride_support": "unity", "swizzle": 1, "tile": [64, 64, 64], "warps": [4, 1, 1]}',
     "06e0637dbd1ac25d9781109ba76b0248164cabd0a2d3503f400e8cd3efafb9aa"),  # sm90_wgrad
    ('{"activation": "identity", "align_a": 8, "align_b": 8, "align_c": 8, "arch": 90, "cluster": [1, 1, 1], "element_a": "f16", "element_acc": "f32", "element_b": "f16", "element_out": "f16", "family": "sm90_tma_wgmma", "filter_rs": null, "iterator": "optimized", "kind": "dgrad", "schedule": "implicit_tma_ws", "split_k_mode": "serial", "stages": 8, "stride_support": "unity", "swizzle": 1, "tile": [64, 64, 64], "warps": [4, 1, 1]}',
     "18cdde7f0dce167017e526040bc8025d82f9e4104622eda9d9cb81afeb78a318"),  # sm90_dgrad
]


@pytest.mark.parametrize("config_json, digest", EXISTING_SOURCES, ids=lambda v: v[-8:] if len(v) == 64 else None)
def test_existing_kernels_render_the_same_source(config_json, digest, monkeypatch):
    import json

    monkeypatch.setattr(render_mod, "__version__", "0.1.0")  # the version is in the header: pin it
    cfg = KernelConfig.from_dict(json.loads(config_json))
    assert cfg.element_bias is None and cfg.to_json() == config_json  # no new key in existing configs' JSON
    assert hashlib.sha256(render(cfg, "nvcc CMD").encode()).hexdigest() == digest


def test_existing_problem_dicts_and_names_are_unchanged():
    p = fprop(act=Activation.RELU, source=SourceKind.BIAS)
    assert p.to_dict()["epilogue"] == {"activation": "relu", "source": "bias"}  # decision keys of old problems
    assert p.name.endswith("_bias+relu")
    assert fprop(source=SourceKind.BIAS, bias="f16").epilogue.bias_dtype is None  # the output's type: normalised


# ---------------------------------------------------------------------------------------------- problems
def test_bias_residual_problem():
    p = fprop(dtype="f32", out="f16", act=Activation.RELU, source=BR, bias="f32")
    assert p.name.endswith("_f32f32_f16_accf32_bias_residual_f32+relu")
    assert p.element_bias is DType.F32 and p.epilogue.bias_vector
    assert Conv2dProblem.from_dict(p.to_dict()) == p
    assert p.bytes_moved == fprop(dtype="f32", out="f16", source=SourceKind.RESIDUAL).bytes_moved
    same = fprop(source=BR)  # a 16-bit bias under a 16-bit output: still a bias vector (two sources)
    assert same.element_bias is DType.F16 and same.epilogue.bias_vector and same.name.endswith("_bias_residual")
    assert not fprop(source=SourceKind.BIAS).epilogue.bias_vector
    assert fprop(source=SourceKind.BIAS, bias="f32").epilogue.bias_vector
    with pytest.raises(ProblemError, match="bias_dtype f32 given without a bias"):
        fprop(source=SourceKind.RESIDUAL, bias="f32")
    with pytest.raises(ProblemError, match="epilogue"):
        Conv2dProblem.make("dgrad", 8, 64, 28, 28, 64, 3, padding=1, epilogue=Epilogue(source=BR))


# ---------------------------------------------------------------------------------------------- configs
def test_bias_vector_candidates_and_rules():
    p = fprop(dtype="f32", out="f16", act=Activation.GELU, source=BR, bias="f32")
    cands = list(sm80_candidates(p))
    assert cands and all(c.element_bias is DType.F32 for c in cands)
    assert {c.split_k_mode for c in cands} == {SplitKMode.SERIAL}  # no parallel split-k: its reduction has no vector
    c = cands[0]
    assert "_gelu_vbiasf32_" in c.name and c.to_dict()["element_bias"] == "f32"
    assert KernelConfig.from_dict(c.to_dict()) == c
    # the plain kernels refuse it, and the bias-vector kernel refuses epilogues without a vector
    plain = next(sm80_candidates(fprop(dtype="f32", out="f16", act=Activation.GELU, source=SourceKind.RESIDUAL)))
    assert "needs a kernel with a f32 bias vector" in plain.reject_reason(p)
    assert "takes a bias vector" in c.reject_reason(fprop(dtype="f32", out="f16", act=Activation.GELU,
                                                          source=SourceKind.RESIDUAL))
    assert "f16 bias vector" in c.reject_reason(p.replace(epilogue=Epilogue(Activation.GELU, BR)))
    assert "split_k_slices" in LaunchConfig(c, 2).reject_reason(p)
    p32 = fprop(dtype="f32", out="f32", source=BR)  # fp32 output: serial split-k would be allowed, not here
    assert "runs unsplit" in LaunchConfig(next(sm80_candidates(p32)), 2).reject_reason(p32)
    assert default_launch(p).split_k_slices == 1
    import dataclasses

    with pytest.raises(ValueError, match="parallel split-k"):
        dataclasses.replace(c, split_k_mode=SplitKMode.PARALLEL, align_c=4)
    with pytest.raises(ValueError, match="fprop only"):
        dataclasses.replace(c, kind=ConvKind.WGRAD)
    # a bias of the output's type alone keeps the plain kernels (and their cache entries)
    assert all(k.element_bias is None for k in sm80_candidates(fprop(source=SourceKind.BIAS)))


def test_every_iterator_has_a_bias_vector_kernel():
    few = Conv2dProblem.make("fprop", 8, 3, 32, 32, 64, 3, padding=1, epilogue=Epilogue(Activation.RELU, BR, "f32"))
    its = {c.iterator for c in sm80_candidates(few)}
    assert {IteratorAlgorithm.FEW_CHANNELS, IteratorAlgorithm.ANALYTIC} <= its
    fixed = Conv2dProblem.make("fprop", 8, 8, 32, 32, 64, 3, padding=1, epilogue=Epilogue(Activation.RELU, BR))
    assert IteratorAlgorithm.FIXED_CHANNELS in {c.iterator for c in sm80_candidates(fixed)}


# ---------------------------------------------------------------------------------------------- rendered types
def _types(src: str) -> dict[str, str]:
    return dict(re.findall(r"^using (Element\w+) = ([\w:]+);", src, re.M))


@pytest.mark.parametrize("dtype, out, bias", [("f32", "f16", "f32"), ("f32", "bf16", "f32"), ("f16", "f32", "f32"),
                                              ("bf16", "bf16", "bf16"), ("f16", "f16", "f32")])
def test_2x_bias_residual_epilogue_types(dtype, out, bias):
    """Accumulate and compute high, store low: the accumulator and the epilogue's arithmetic are fp32, the output
    is the (cast) output type, the bias keeps its own type, the residual (C) has the output's."""
    p = fprop(dtype=dtype, out=out, act=Activation.SILU, source=BR, bias=bias)
    cfg = next(sm80_candidates(p))
    src = render(cfg, "cmd")
    t = _types(src)
    assert t["ElementAccumulator"] == "float" and t["ElementCompute"] == "float"
    assert t["ElementOutput"] == DType(out).cutlass and t["ElementBias"] == DType(bias).cutlass
    assert t["ElementA"] == DType(dtype).cutlass
    assert "DefaultConv2dFpropWithBroadcast<" in src
    assert ("LinearCombinationBiasElementwise<\n    ElementOutput, ElementAccumulator, ElementCompute, ElementOutput, "
            "ElementOutput, ") in src
    assert "cutlass::epilogue::thread::SiLu<ElementCompute>, cutlass::plus<ElementCompute>, false, ElementBias>" in src
    assert "  const void* bias;" in src  # the appended API field
    assert "x.source_kind == 3 ? x.bias : x.source_kind == 1 ? x.source : nullptr" in src


def test_3x_bias_residual_epilogue_types():
    p = fprop(dtype="bf16", out="bf16", act=Activation.GELU, source=BR, bias="f32")
    cfg = next(sm90_candidates(p))
    assert cfg.element_bias is DType.F32
    src = render(cfg, "cmd")
    t = _types(src)
    assert t["ElementAccumulator"] == "float" and t["ElementCompute"] == "float" and t["ElementBias"] == "float"
    assert t["ElementOutput"] == "cutlass::bfloat16_t" and t["ElementSource"] == "ElementOutput"
    assert ("LinCombPerColBiasEltAct<\n    cutlass::epilogue::thread::GELU, ElementOutput, ElementCompute, ElementBias, "
            "ElementSource, ElementCompute>") in src
    assert "args.epilogue.thread.bias_ptr = static_cast<const ElementBias*>(bias_ptr);" in src
    ident = render(next(sm90_candidates(fprop(source=BR))), "cmd")
    assert "LinCombPerColBiasEltAct<\n    cutlass::epilogue::thread::Identity," in ident


@pytest.mark.parametrize("dtype, out", [("f32", "f16"), ("f32", "bf16"), ("f16", "f32"), ("bf16", "f32")])
def test_fused_cast_kernels_accumulate_high_and_store_the_cast_type(dtype, out):
    p = fprop(dtype=dtype, out=out, act=Activation.RELU, source=SourceKind.BIAS)
    for cfg in [next(sm80_candidates(p))] + list(sm90_candidates(p))[:1]:
        t = _types(render(cfg, "cmd"))
        assert t["ElementAccumulator"] == "float" and t["ElementCompute"] == "float", cfg.name
        assert t["ElementOutput"] == DType(out).cutlass, cfg.name


# ---------------------------------------------------------------------------------------------- launch arguments
def test_args_struct_appends_bias_and_pointer_rules():
    import ctypes

    # bias, then the channel-statistics kernels' buffer (KernelConfig.channel_stats), each declared in C only by the
    # kernels that read it, after every other field
    assert [f for f, _ in CbConv2dArgs._fields_][-4:] == ["alpha", "beta", "bias", "stats"]
    assert CbConv2dArgs.bias.offset == CbConv2dArgs.beta.offset + 4  # right after the two floats, 8-aligned
    assert CbConv2dArgs.bias.offset % ctypes.alignment(ctypes.c_void_p) == 0
    assert CbConv2dArgs.stats.offset == CbConv2dArgs.bias.offset + ctypes.sizeof(ctypes.c_void_p)
    p = fprop(dtype="f32", out="f16", source=BR, bias="f32")
    args = make_args(p, 1, a=0x1000, b=0x2000, d=0x3000, source=0x4000, bias=0x5000)
    assert args.source_kind == 3 and args.bias == 0x5000 and args.beta == 1.0
    cfg = next(sm80_candidates(p))  # align_c 8: the fp32 bias needs 32-byte addresses, the fp16 residual 16
    assert pointer_error(cfg, p, 0x1000, 0x2000, 0x3000, 0x4000, 0x5000) is None
    assert "bias: address 0x5010 is not 32-byte aligned" in pointer_error(cfg, p, 0x1000, 0x2000, 0x3000, 0x4000, 0x5010)
    assert "residual: null" in pointer_error(cfg, p, 0x1000, 0x2000, 0x3000, 0, 0x5000)
    assert "bias: null" in pointer_error(cfg, p, 0x1000, 0x2000, 0x3000, 0x4000, 0)
    pb = fprop(dtype="f32", out="f16", source=SourceKind.BIAS, bias="f32")
    assert make_args(pb, 1, source=0x4000).source_kind == 1
    assert "source: address 0x4010 is not 32-byte" in pointer_error(next(sm80_candidates(pb)), pb, 0x1000, 0x2000,
                                                                     0x3000, 0x4010)
