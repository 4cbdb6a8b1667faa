"""Channel padding as a launch parameter (issue 11, part 3): which problems get which padding, what is refused and
why, how the planner offers padded launches against their unpadded twins, and that ops' padding computes the
user's problem exactly (checked on the CPU with the kernel replaced by a float64 reference)."""

from __future__ import annotations

import pytest

import cutlass_byoc.sm90 as sm90_mod

from cutlass_byoc.candidates import channel_pad_options, sm80_candidates, unsupported_reason
from cutlass_byoc.config import LaunchConfig, round_up
from cutlass_byoc.decisions import DecisionStore, GpuInfo, lookup_decision, record_decision
from cutlass_byoc.heuristics import S2D_CALIBRATION, default_launch, estimate_launch_us, estimate_us, padding_cost_us
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.profiler.plan import has_kernels, plan_problem
from cutlass_byoc.types import ConvKind, IteratorAlgorithm, KernelFamily, SourceKind

from layers import odd, stem

GPU = GpuInfo("NVIDIA H200", 90)


# ---------------------------------------------------------------------------------------------- which padding
@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_stem_pads_c_to_4_or_8(kind):
    assert channel_pad_options(stem(kind)) == [(1, 1), (8, 1), (4, 1)]


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_odd_layer_pads_c_and_k_to_16_bytes(kind):
    # C=7 -> 8 and K=33 -> 40 (16-byte rows); no 8-byte option: C=7 and K=33 are wider than 4 elements
    assert set(channel_pad_options(odd(kind))) == {(1, 1), (8, 1), (1, 8), (8, 8)}


def test_aligned_grouped_and_fp32_layers():
    assert channel_pad_options(Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1)) == [(1, 1)]
    assert channel_pad_options(Conv2dProblem.make("wgrad", 8, 12, 16, 16, 16, 3, padding=1)) == [(1, 1), (8, 1)]
    assert channel_pad_options(Conv2dProblem.make("fprop", 2, 6, 8, 8, 6, 3, groups=3)) == [(1, 1)]
    # fp32 inputs: 4 elements are 16 bytes (C=3 is 12 bytes: no 8-byte option)
    assert channel_pad_options(stem("fprop", dtype="f32")) == [(1, 1), (4, 1)]
    # an fp32 output of fp16 inputs: K=64 stores 256-byte rows; C=3 is what pads
    assert channel_pad_options(stem("wgrad", out_dtype="f32")) == [(1, 1), (8, 1), (4, 1)]


# ---------------------------------------------------------------------------------------------- rules
def _kernel(problem):
    return next(iter(sm80_candidates(problem)))


def test_padded_launch_is_a_distinct_recorded_candidate(tmp_cache):
    p = stem("fprop")
    big = p.replace(c=4)
    kc = next(c for c in sm80_candidates(big) if c.iterator is IteratorAlgorithm.FIXED_CHANNELS)
    padded = LaunchConfig(kc, pad_c=4)
    assert padded.kernel_problem(p) == big and padded.unpadded == LaunchConfig(kc)
    assert padded.reject_reason(p) is None
    assert padded.name == kc.name + "_padc4" and padded != padded.unpadded
    assert padded.unpadded.reject_reason(p)  # the kernel itself needs C == 4
    assert LaunchConfig.from_dict(padded.to_dict()) == padded
    assert "pad_c" not in LaunchConfig(kc).to_dict()  # unpadded launches keep their old dict
    store = DecisionStore(tmp_cache.root)
    record_decision(p, padded, 100.0, gpu=GPU, store=store)
    assert lookup_decision(p, gpu=GPU, store=store) == padded


def test_padding_refusals_name_the_reason():
    p = stem("fprop")
    kc = _kernel(p.replace(c=8))
    with pytest.raises(ValueError, match="pad_c"):
        LaunchConfig(kc, pad_c=3)
    aligned = Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1)
    assert "already multiples" in LaunchConfig(_kernel(aligned), pad_c=8).reject_reason(aligned)
    grouped = Conv2dProblem.make("fprop", 2, 6, 8, 8, 6, 3, groups=3)
    assert "groups" in LaunchConfig(kc, pad_c=8).reject_reason(grouped)
    # the kernel must fit the padded problem: an 8-wide kernel does not compute C padded to 4
    assert "alignment" in LaunchConfig(kc, pad_c=4).reject_reason(p)


def test_narrow_strided_dgrad_runs_only_padded():
    p = stem("dgrad")
    assert not list(sm80_candidates(p))  # 2-byte accesses: no strided-dgrad kernel reads C=3
    assert unsupported_reason(p) is None and has_kernels(p)
    d = default_launch(p)  # the space-to-depth fold (tests/test_s2d.py), a rewritten launch like the padded ones
    assert d.padded and d.kernel_problem(p).c in (4, 8, 12, 16)
    assert default_launch(p, padding=False) is None
    pp = plan_problem(p, 8)
    implicit = [c for c in pp.candidates if not c.launch.kernel.lowering]  # (the im2col lowering reads C=3 itself)
    assert implicit and all(c.launch.padded for c in implicit)
    # (the space-to-depth launches run a unit-stride dgrad: tests/test_s2d.py)
    implicit = [c for c in implicit if c.launch.s2d == 1]
    assert {c.launch.pad_c for c in implicit} == {4, 8}
    assert all("alignment" in c.launch.unpadded.reject_reason(p) for c in implicit)
    sm80 = next(c for c in implicit if c.launch.kernel.family is KernelFamily.SM80_IMPLICIT_GEMM)
    narrow = sm80.launch.kernel.with_alignments(1, 1, 1)  # the same kernel for C=3 itself
    assert "strided dgrad needs channel counts giving >= 4-byte accesses" in narrow.reject_reason(p)


@pytest.mark.parametrize("problem", [stem("fprop"), stem("wgrad"), odd("fprop"), odd("dgrad"), odd("wgrad")],
                         ids=lambda p: p.kind.value + ("_stem" if p.c == 3 else "_odd"))
def test_plan_times_padded_against_unpadded(problem):
    pp = plan_problem(problem, 8)
    assert pp.problem == problem
    padded = [c for c in pp.candidates if c.launch.padded]
    plain = [c for c in pp.candidates if not c.launch.padded]
    assert padded and plain, "the profiler must see both sides"
    for c in pp.candidates:
        assert c.launch.reject_reason(problem) is None
    for c in padded:  # the padding's copies are in the estimate (a fold's kernel time scaled by S2D_CALIBRATION)
        kp = c.launch.kernel_problem(problem)
        scale = S2D_CALIBRATION if c.launch.s2d > 1 else 1.0
        assert c.estimate_us == pytest.approx(estimate_us(kp, c.launch.unpadded) * scale
                                              + padding_cost_us(problem, c.launch))
        assert c.estimate_us == pytest.approx(estimate_launch_us(problem, c.launch))
    # the 16-byte padded problems also reach the sm90 family (TMA needs 16-byte rows)
    sm90 = [c for c in padded if c.launch.kernel.family is KernelFamily.SM90_TMA_WGMMA]
    if problem.kind is ConvKind.WGRAD and problem.element_out not in sm90_mod.SPLIT_K_OUTPUTS:
        return  # unsplit 3.x wgrad of these layers is estimated far beyond the cutoff (no 3.x split-k for this output)
    if problem.kind is not ConvKind.DGRAD or problem.stride_h == 1:
        assert sm90 and all(c.launch.kernel_problem(problem).c % 8 == 0 for c in sm90)


def test_padding_cost_counts_the_copies():
    p = stem("fprop")
    kc = _kernel(p.replace(c=8))
    assert padding_cost_us(p, LaunchConfig(_kernel(p))) == 0.0
    c8 = padding_cost_us(p, LaunchConfig(kc, pad_c=8))
    c4 = padding_cost_us(p, LaunchConfig(_kernel(p.replace(c=4)), pad_c=4))
    assert c8 > c4 > 0  # x (9.6 MB) padded to 8 channels moves more than to 4
    o = odd("fprop", epilogue=Epilogue(source=SourceKind.RESIDUAL))
    both = padding_cost_us(o, LaunchConfig(_kernel(o.replace(c=8, k=40)), pad_c=8, pad_k=8))
    only_c = padding_cost_us(o, LaunchConfig(_kernel(o.replace(c=8)), pad_c=8))
    assert both > only_c  # padding K pads w, the residual and slices y too


# ---------------------------------------------------------------------------------------------- exactness
torch = pytest.importorskip("torch")
from rewrite_util import check_rewritten_run  # noqa: E402


@pytest.mark.parametrize("kind,source", [(k, s) for k in ("fprop", "dgrad", "wgrad") for s in (None, "residual")]
                         + [("fprop", "bias")])
@pytest.mark.parametrize("pads", [(8, 1), (4, 1), (1, 8), (8, 8)], ids=lambda t: f"padc{t[0]}_padk{t[1]}")
def test_padded_run_is_exact(monkeypatch, kind, pads, source):
    """ops._run_rewritten pads the right operands with zeros and copies the right channels out: the kernel
    (run_problem on the padded problem) is replaced by a float64 reference that checks it got the padded shapes."""
    ep = Epilogue(source=SourceKind(source)) if source else Epilogue()
    p = Conv2dProblem.make(kind, 2, 3 if pads[0] == 4 else 7, 9, 9, 5 if pads[1] == 1 else 33, 3, stride=2,
                           padding=1, dtype="f32", epilogue=ep)
    big = p.replace(c=round_up(p.c, pads[0]), k=round_up(p.k, pads[1]))
    launch = LaunchConfig(_kernel(big), pad_c=pads[0], pad_k=pads[1])
    assert launch.kernel_problem(p) == big
    check_rewritten_run(monkeypatch, p, launch, source)
