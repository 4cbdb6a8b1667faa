"""Offset views (issue 13): when an operand's address allows less alignment than the chosen config's, the launch is
re-chosen among the configs that accept those alignments, for every iterator family; with none, the error names the
operand and its alignment. CPU only: the pointers are fakes (ops._narrow_to_pointers only reads data_ptr())."""

from __future__ import annotations

import random

import pytest

from cutlass_byoc import ops, select
from cutlass_byoc.candidates import sm80_candidates
from cutlass_byoc.config import LaunchConfig
from cutlass_byoc.heuristics import default_launch
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.runtime import pointer_error
from cutlass_byoc.sm90 import sm90_candidates
from cutlass_byoc.types import Activation, IteratorAlgorithm, KernelFamily, SourceKind, StrideSupport

BASE = 1 << 20  # a 256-byte aligned allocation, as PyTorch's caching allocator gives


class Ptr:
    """A stand-in tensor: only its address matters."""

    def __init__(self, offset_bytes: int = 0, slot: int = 0):
        self.address = BASE * (slot + 1) + offset_bytes

    def data_ptr(self) -> int:
        return self.address


@pytest.fixture(autouse=True)
def no_decisions(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(select, "lookup_decision", lambda problem: None)
    select._rechosen.clear()


def narrow(problem, launch, a=0, b=0, d=0, source=None, bias=None, explicit=True):
    ptrs = dict(a=Ptr(a, 0), b=Ptr(b, 1), d=Ptr(d, 2), source=None if source is None else Ptr(source, 3),
                bias=None if bias is None else Ptr(bias, 4))
    got = ops._narrow_to_pointers(launch, problem, *ptrs.values(), explicit=explicit)
    addr = {k: (v.data_ptr() if v is not None else 0) for k, v in ptrs.items()}
    # always a launch that accepts the problem and these very addresses
    assert got.reject_reason(problem) is None, got.name
    assert pointer_error(got.kernel, problem, addr["a"], addr["b"], addr["d"], addr["source"], addr["bias"]) is None
    return got


def pick(problem, **want):
    return LaunchConfig(next(c for c in sm80_candidates(problem) if all(getattr(c, k) == v for k, v in want.items())))


def test_aligned_pointers_keep_the_launch():
    p = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1)
    launch = default_launch(p)
    assert narrow(p, launch, explicit=False) is launch


def test_optimized_narrowed():
    p = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1)
    launch = pick(p, iterator=IteratorAlgorithm.OPTIMIZED, tile=(128, 128, 32))
    got = narrow(p, launch, a=4)  # A 4 bytes off: 2 fp16 elements
    assert got.kernel.align_a == 2 and got.kernel.tile == (128, 128, 32)  # the caller's config, narrowed
    assert got.kernel.iterator is IteratorAlgorithm.OPTIMIZED and got.kernel.stages == launch.kernel.stages
    got = narrow(p, launch, explicit=False, a=4)  # chosen, not given: the model's best within the alignments
    assert got.kernel.align_a <= 2


def test_analytic_narrowed_to_the_two_stage_mainloop():
    p = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1)
    launch = pick(p, iterator=IteratorAlgorithm.ANALYTIC, tile=(128, 128, 32))
    got = narrow(p, launch, b=2)  # B 2 bytes off: 1 element, 2-byte accesses
    k = got.kernel
    assert (k.align_b, k.stages, k.iterator, k.tile) == (1, 2, IteratorAlgorithm.ANALYTIC, (128, 128, 32))


@pytest.mark.parametrize("offset, expect_few", [(4, True), (2, False)])
def test_few_channels_rechosen_where_narrowing_breaks_its_rule(offset, expect_few):
    """The 2-of-292 failure: a few-channels config for C=12 narrowed to alignment 1 breaks its own rule (C <= 8 x
    alignment), so it is re-chosen; at alignment 2 the narrowed few-channels config still holds."""
    p = Conv2dProblem.make("fprop", 4, 12, 32, 32, 64, 3, padding=1)
    launch = pick(p, iterator=IteratorAlgorithm.FEW_CHANNELS)
    assert launch.kernel.align_a == 4
    broken = launch.kernel.with_alignments(1, launch.kernel.align_b, launch.kernel.align_c)
    assert "few_channels" in broken.reject_reason(p)  # what was launched before, and refused
    got = narrow(p, launch, a=offset)
    assert (got.kernel.iterator is IteratorAlgorithm.FEW_CHANNELS) == expect_few
    assert got.kernel.align_a == offset // 2


def test_fixed_channels_rechosen():
    p = Conv2dProblem.make("fprop", 4, 8, 32, 32, 64, 3, padding=1)
    launch = pick(p, iterator=IteratorAlgorithm.FIXED_CHANNELS)
    assert launch.kernel.align_a == 8
    got = narrow(p, launch, a=4)  # fixed channels needs C == alignment: 2 != 8
    assert got.kernel.iterator is not IteratorAlgorithm.FIXED_CHANNELS and got.kernel.align_a <= 2
    got = narrow(p, default_launch(p), explicit=False, a=8)
    assert got.kernel.align_a <= 4


def test_strided_dgrad_rechosen_or_refused_naming_the_operand():
    p = Conv2dProblem.make("dgrad", 4, 64, 28, 28, 64, 3, stride=2, padding=1)
    launch = default_launch(p)
    assert launch.kernel.stride_support is StrideSupport.STRIDED
    got = narrow(p, launch, explicit=False, a=4)  # dy 4 bytes off: 4-byte accesses still run strided dgrad
    assert got.kernel.align_a == 2 and got.kernel.stride_support is StrideSupport.STRIDED
    got = narrow(p, launch, d=8)  # dx 8 bytes off
    assert got.kernel.align_c == 4
    with pytest.raises(ops.UnsupportedConvError, match=r"alignment: no kernel computes .* A at address 0x100002 "
                                                        r"allows alignment 1 \(2 bytes of f16"):
        narrow(p, launch, a=2)  # 2-byte accesses: no strided-dgrad kernel takes them


def test_sm90_tma_launch_moves_to_the_2x_family():
    p = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1)
    launch = LaunchConfig(next(sm90_candidates(p)))
    got = narrow(p, launch, d=8)  # output 8 bytes off: TMA needs 16
    assert got.kernel.family is KernelFamily.SM80_IMPLICIT_GEMM and got.kernel.align_c == 4
    p_bias = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1, dtype="bf16",
                                epilogue=Epilogue(Activation.SILU, SourceKind.BIAS_RESIDUAL, "f32"))
    launch = LaunchConfig(next(sm90_candidates(p_bias)))
    got = narrow(p_bias, launch, source=2, bias=0)  # residual 2 bytes off
    assert got.kernel.family is KernelFamily.SM80_IMPLICIT_GEMM and got.kernel.align_c == 1
    assert got.kernel.element_bias is launch.kernel.element_bias


def test_bias_vector_address_bounds_the_output_alignment():
    p = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1, dtype="f32", out_dtype="f16",
                           epilogue=Epilogue(Activation.RELU, SourceKind.BIAS_RESIDUAL, "f32"))
    launch = default_launch(p)
    assert launch.kernel.align_c == 8
    assert narrow(p, launch, explicit=False, source=0, bias=0) is launch
    got = narrow(p, launch, explicit=False, source=0, bias=16)  # the fp32 bias 16 bytes off: 4 of 8 per access
    assert got.kernel.align_c == 4
    got = narrow(p, launch, explicit=False, source=0, bias=4)
    assert got.kernel.align_c == 1


def test_decision_narrowed_first(monkeypatch):
    p = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1)
    tuned = pick(p, iterator=IteratorAlgorithm.OPTIMIZED, tile=(64, 128, 32))
    monkeypatch.setattr(select, "lookup_decision", lambda problem: tuned if problem == p else None)
    got = narrow(p, default_launch(p), explicit=False, a=8)
    assert got.kernel.tile == (64, 128, 32) and got.kernel.align_a == 4


def test_random_offsets_always_get_an_accepting_launch_or_a_named_refusal():
    rng = random.Random(13)
    seen = 0
    for _ in range(60):
        kind = rng.choice(["fprop", "fprop", "dgrad"])
        c, k = rng.choice([3, 4, 6, 8, 12, 16, 24, 64]), rng.choice([8, 16, 32, 64])
        stride = rng.choice([1, 2])
        dt = rng.choice(["f16", "bf16", "f32"])
        try:
            p = Conv2dProblem.make(kind, 2, c, 16, 16, k, 3, stride=stride, padding=1, dtype=dt)
        except ValueError:
            continue
        cands = [LaunchConfig(cfg) for cfg in sm80_candidates(p, split_k=False)]
        if not cands:
            continue
        launch = rng.choice(cands)
        offs = [rng.choice([0, 0, 2, 4, 8]) * (2 if dt == "f32" else 1) for _ in range(3)]
        try:
            narrow(p, launch, *offs, explicit=rng.random() < 0.5)
            seen += 1
        except ops.UnsupportedConvError as e:
            assert "alignment: no kernel computes" in str(e) and "at address" in str(e), str(e)
    assert seen > 30
