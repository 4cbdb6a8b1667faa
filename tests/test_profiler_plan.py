"""Planning on the CPU: enumeration of every family, pruning before compiling, ranking and the candidate budget."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from cutlass_byoc.config import KernelConfig, LaunchConfig
from cutlass_byoc.gemm1x1 import WAVE_TILES
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.profiler import plan as plan_mod
from cutlass_byoc.profiler.plan import (PINGPONG_BUDGET, SMEM_IM2COL_BUDGET, SUBPIXEL_PINGPONG_EXTRA, enumerate_kernels,
                                       plan_problem, plan_workload)
from cutlass_byoc.types import ConvKind, IteratorAlgorithm, KernelFamily, SplitKMode, StrideSupport
from cutlass_byoc.workloads import default_workload


def is_deep(k: KernelConfig) -> bool:
    """A deep-pipeline twin (sm90.deep_twin, gemm1x1.deep_twin): a 3.x kernel past the families' cap of 8 stages."""
    return k.family in (KernelFamily.SM90_TMA_WGMMA, KernelFamily.SM90_GEMM_1X1) and k.stages > 8


def is_atomic(k: KernelConfig) -> bool:
    """An atomic split-k twin (sm90.atomic_twin): the 3.x split-k wgrad kernel adding its slices' sums with TMA
    reduce-adds."""
    return k.split_k_mode is SplitKMode.ATOMIC


def on_top(k: KernelConfig) -> bool:
    """A twin the plan times beside a kernel of the budget, on top of it: deep-pipeline or atomic split-k."""
    return is_deep(k) or is_atomic(k)


def same_but_stages(a: KernelConfig, b: KernelConfig) -> bool:
    return {**a.to_dict(), "stages": 0} == {**b.to_dict(), "stages": 0}


@pytest.fixture(scope="module")
def workload_plan():
    return plan_workload([it.problem for it in default_workload()], 8)


def test_default_workload_plan_fits_budget(workload_plan):
    assert len(workload_plan.plans) == 48
    for pp in workload_plan.plans:
        assert pp.candidates, pp.problem.name
        # the stem's im2col lowering and its space-to-depth fold: a budget of its own each (4 of 8); the
        # shared-memory im2col kernels (the stem's fprop and wgrad, the odd layer's fprop and dgrad) one of
        # SMEM_IM2COL_BUDGET (each beside its prefetch twin)
        # and the 3.x conv ping-pong kernels one of PINGPONG_BUDGET (+ SUBPIXEL_PINGPONG_EXTRA for a strided dgrad)
        # for the problem as it is and for each of its channel-padded or folded twins
        # and, on top: a wgrad's deep-pipeline twins of its 3.x kernels (each beside its capped twin), the atomic
        # twins of its 3.x split-k kernels (each beside its split-k twin), and the GEMM 1x1 family's whole-wave tiles
        # (GEMM_WAVE_BUDGET, fprop and dgrad only)
        atomic = {k for k in pp.kernels if is_atomic(k)}
        deep = {k for k in pp.kernels if is_deep(k)} - atomic
        assert not (deep or atomic) or pp.problem.kind is ConvKind.WGRAD
        assert all(any(k != d and same_but_stages(k, d) for k in pp.kernels) for d in deep)
        assert all(dataclasses.replace(a, split_k_mode=SplitKMode.PARALLEL) in pp.kernels for a in atomic)
        wave = {k for k in pp.kernels if k.family is KernelFamily.SM90_GEMM_1X1 and k.tile in WAVE_TILES}
        assert not (wave and pp.problem.kind is ConvKind.WGRAD) and not any(k.lowering for k in wave)
        lowered = [k for k in pp.kernels if k.lowering and k not in deep]
        pingpong = {k for k in pp.kernels if k.is_conv_pingpong and k not in deep}
        folded = {c.launch.kernel for c in pp.candidates if c.launch.s2d > 1} - pingpong - deep - atomic - wave
        gathered = [k for k in pp.kernels if k.family is KernelFamily.SMEM_IM2COL]
        assert len(pp.kernels) - len(lowered) - len(folded) - len(gathered) - len(pingpong) - len(deep) \
            - len(atomic) - len(wave) <= 8 and len(lowered) <= 4 and len(folded) <= 4 and len(gathered) <= 2 * SMEM_IM2COL_BUDGET
        ways = {(c.launch.s2d, c.launch.pad_c, c.launch.pad_k) for c in pp.candidates}
        budget = PINGPONG_BUDGET + SUBPIXEL_PINGPONG_EXTRA * pp.problem.is_strided_dgrad
        assert len(pingpong) <= budget * len(ways)
        assert not gathered or (pp.problem.kind.value, pp.problem.c) in (("fprop", 3), ("fprop", 7), ("dgrad", 7),
                                                                         ("wgrad", 3))
        assert not lowered or (pp.problem.c, pp.problem.r) == (3, 7)
        # the fold: the stem's, and the subsample of the strided 1x1 layer
        assert not folded or (pp.problem.c, pp.problem.r) == (3, 7) or (pp.problem.r, pp.problem.stride_h) == (1, 2)
        for c in pp.candidates:  # everything planned can implement its problem
            assert c.launch.reject_reason(pp.problem) is None, (pp.problem.name, c.name)
    # kernels are keyed by config and shared across problems: far fewer than 48 x 8
    n = len(workload_plan.kernels)
    assert 40 <= n <= 280, n  # 268 with the shared-memory im2col kernels' prefetch twins and the stem's wgrads
    assert len(set(workload_plan.kernels)) == n


def test_split_k_is_a_launch_parameter_not_a_kernel(workload_plan):
    wgrad = [pp for pp in workload_plan.plans if pp.problem.kind is ConvKind.WGRAD and pp.problem.c == 64
             and pp.problem.r == 3][0]
    slices = {c.launch.split_k_slices for c in wgrad.candidates}
    assert max(slices) > 1  # early wgrad needs split-k
    assert len(wgrad.kernels) < len(wgrad.candidates)  # one kernel, several slice counts


def test_strided_dgrad_only_strided_kernels_and_no_split_k():
    p = Conv2dProblem.make("dgrad", 32, 128, 56, 56, 128, 3, stride=2, padding=1)
    pp = plan_problem(p, 8)
    assert pp.candidates
    for c in pp.candidates:
        assert c.launch.split_k_slices == 1
        # 2.x strided-dgrad kernels, and the 3.x stride-1 kernel launched per sub-pixel phase (sm90.subpixel_phases)
        assert c.launch.kernel.stride_support is StrideSupport.STRIDED
    assert {c.launch.kernel.family for c in pp.candidates} >= {KernelFamily.SM80_IMPLICIT_GEMM, KernelFamily.SM90_TMA_WGMMA}


def test_odd_channels_get_narrow_alignment():
    p = Conv2dProblem.make("fprop", 32, 7, 56, 56, 33, 3, padding=1)
    valid, _ = enumerate_kernels(p)
    assert valid
    for k in valid:
        assert k.align_a == 1 and k.align_c == 1
        # TMA needs 16-byte channels; the shared-memory im2col kernels read any C per element
        assert k.family in (KernelFamily.SM80_IMPLICIT_GEMM, KernelFamily.SMEM_IM2COL)
    assert {k.family for k in valid} == {KernelFamily.SM80_IMPLICIT_GEMM, KernelFamily.SMEM_IM2COL}


def test_pruning_happens_before_compiling(monkeypatch):
    """Configs an enumerator offers that cannot implement the problem are pruned with a reason."""
    p = Conv2dProblem.make("fprop", 8, 12, 16, 16, 16, 3, padding=1)  # C=12: alignment 4 at most
    good = next(k for k in enumerate_kernels(p)[0] if k.iterator is IteratorAlgorithm.OPTIMIZED)
    bad_align = dataclasses.replace(good, align_a=8, align_b=8)
    wrong_kind = dataclasses.replace(good, kind=ConvKind.WGRAD, stride_support=StrideSupport.STRIDED)
    monkeypatch.setattr(plan_mod, "kernel_enumerators",
                        lambda: [(KernelFamily.SM80_IMPLICIT_GEMM, lambda prob: [good, bad_align, wrong_kind])])
    valid, pruned = enumerate_kernels(p)
    assert valid == [good]
    reasons = {x.name: x.reason for x in pruned}
    assert "alignment" in reasons[bad_align.name]
    assert "kind" in reasons[wrong_kind.name]
    pp = plan_problem(p, 8)
    assert {c.launch.kernel for c in pp.candidates if not c.launch.padded} == {good}
    assert len([x for x in pp.pruned if "padded" not in x.name]) == 2
    # C=12 (8-byte rows) is also planned zero-padded to C=16, where the 8-wide kernel fits
    assert {c.launch.kernel for c in pp.candidates if c.launch.padded} == {good, bad_align}
    assert all(c.launch.pad_c == 8 for c in pp.candidates if c.launch.padded)


def test_max_candidates_keeps_the_models_best():
    p = Conv2dProblem.make("fprop", 32, 256, 14, 14, 256, 3, padding=1)
    big = plan_problem(p, 64, slices_per_kernel=1)
    one = plan_problem(p, 1, slices_per_kernel=1)
    assert len(one.kernels) == 1  # a budget of 1 gets no ping-pong kernel on top
    assert len(big.kernels) > 8
    sm80_best = min((c for c in big.candidates if c.launch.kernel.family is KernelFamily.SM80_IMPLICIT_GEMM),
                    key=lambda c: c.estimate_us)
    if not any(c.launch.kernel.family is not KernelFamily.SM80_IMPLICIT_GEMM for c in big.candidates):
        assert one.candidates[0].launch == sm80_best.launch
    with pytest.raises(ValueError, match="max_candidates"):
        plan_problem(p, 0)


def test_other_families_get_a_share(monkeypatch):
    """A family the model cannot rank against 2.x (3.x) still gets part of the budget."""
    p = Conv2dProblem.make("fprop", 32, 256, 14, 14, 256, 3, padding=1)
    base = next(iter(plan_mod.sm80_candidates(p)))
    sm90 = KernelConfig(
        family=KernelFamily.SM90_TMA_WGMMA, kind=p.kind, element_a=p.element_a, element_b=p.element_b,
        element_out=p.element_out, element_acc=p.element_acc, tile=(128, 128, 64), warps=(4, 1, 1), stages=4,
        stride_support=StrideSupport.UNITY, align_a=8, align_b=8, align_c=8, split_k_mode=SplitKMode.SERIAL,
        schedule="implicit_tma_ws",
    )
    monkeypatch.setattr(plan_mod, "_sm90_enumerator", lambda: (lambda prob: [sm90]))
    pp = plan_problem(p, 4)
    fams = [k.family for k in pp.kernels]
    assert KernelFamily.SM90_TMA_WGMMA in fams and KernelFamily.SM80_IMPLICIT_GEMM in fams
    assert len(pp.kernels) == 4
    assert all(c.launch.split_k_slices == 1 for c in pp.candidates if c.launch.kernel == sm90)
    assert base.family is KernelFamily.SM80_IMPLICIT_GEMM


def test_few_channel_iterators_for_the_stem():
    p = Conv2dProblem.make("fprop", 32, 3, 224, 224, 64, 7, stride=2, padding=3)
    valid, _ = enumerate_kernels(p)
    its = {k.iterator for k in valid}
    assert IteratorAlgorithm.FEW_CHANNELS in its
    assert all(k.align_a <= 1 or 3 % k.align_a == 0 for k in valid)


def test_plan_ranks_by_estimate():
    p = Conv2dProblem.make("wgrad", 32, 64, 56, 56, 64, 3, padding=1)
    pp = plan_problem(p, 8)
    est = [c.estimate_us for c in pp.candidates]
    assert est == sorted(est)
    assert all(isinstance(c.launch, LaunchConfig) for c in pp.candidates)


def test_narrow_strided_dgrad_is_planned_as_padded_launches_of_the_users_problem():
    p = Conv2dProblem.make("dgrad", 32, 3, 224, 224, 64, 7, stride=2, padding=3)
    pp = plan_problem(p, 4)
    assert pp.problem == p and pp.candidates
    # no strided-dgrad kernel reads C=3 (2-byte accesses): every implicit-GEMM launch pads C, to 4 or to 8; the
    # im2col lowering (its own budget) reads the user's C=3 itself
    implicit = [c for c in pp.candidates if not c.launch.kernel.lowering and c.launch.s2d == 1]
    assert {c.launch.pad_c for c in implicit} == {4, 8}
    # its space-to-depth fold (a unit-stride dgrad of C=12, or 16 padded) has a budget of its own
    assert {c.launch.kernel_problem(p).c for c in pp.candidates if c.launch.s2d == 2} == {12, 16}
    assert all(c.launch.pad_k == 1 and c.launch.reject_reason(p) is None for c in pp.candidates)
    assert all(not c.launch.padded for c in pp.candidates if c.launch.kernel.lowering)


def test_memory_bound_ties_spread_over_tile_shapes():
    """A 1x1 conv of 64 channels is memory-bound: every tile ties in the model, so the budget goes to distinct M x N
    shapes that do not pad N=64 (not to one shape's stage and iterator variants), and the default is one of them
    with precomputed offsets."""
    from cutlass_byoc.heuristics import default_launch

    p = Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 1)
    pp = plan_problem(p, 8)
    for family in (KernelFamily.SM80_IMPLICIT_GEMM, KernelFamily.SM90_GEMM_1X1):
        kernels = [k for k in pp.kernels if k.family is family]
        shapes = {k.tile[:2] for k in kernels}
        assert len(shapes) == len(kernels) >= 2, family
        assert sum(1 for s in shapes if s[1] <= 64) >= 2, family
    d = default_launch(p).kernel
    assert d.tile[1] <= 64 and d.iterator is not IteratorAlgorithm.ANALYTIC


def test_hopeless_other_family_candidates_give_their_share_back():
    """wgrad of a 64x64 filter over N*P*Q = 100352: one output tile, so only split-k fills the GPU; the unsplit 3.x
    conv kernels are estimated far beyond the cutoff and give their share back; the 3.x conv split-k kernels (the
    project's own) and the 1x1-as-GEMM family's stream-K kernels compete, both splitting the reduction."""
    p = Conv2dProblem.make("wgrad", 32, 64, 56, 56, 64, 1)
    pp = plan_problem(p, 8)
    assert len([k for k in pp.kernels if not on_top(k)]) == 8  # and the deep and atomic twins of some on top
    for c in pp.candidates:
        k = c.launch.kernel
        if k.family is KernelFamily.SM90_TMA_WGMMA:
            assert k.split_k_mode.fp32_sums and c.launch.split_k_slices > 1
        elif k.family is KernelFamily.SM90_GEMM_1X1:
            assert k.splits_at_launch  # a stream-K schedule (either reduction)
    assert max(c.launch.split_k_slices for c in pp.candidates) > 64
    # where the model cannot tell (compute-bound 3x3), 3.x keeps its share
    q = Conv2dProblem.make("fprop", 32, 256, 14, 14, 256, 3, padding=1)
    fams = {k.family for k in plan_problem(q, 8).kernels}
    assert KernelFamily.SM90_TMA_WGMMA in fams or plan_mod._sm90_enumerator() is None


def test_three_families_share_the_budget_equally_the_rest_to_3x():
    """A 1x1 stride-1 conv has three families (2.x, 3.x conv, 3.x GEMM): 8 kernels split 2 + 3 + 3, the remainder of
    an equal split going to the 3.x families (on the H200 2.x won none of ResNet-50's 18 such cells, cold tune of
    2026-12-01); with two families (a 3x3 conv: 2.x and 3.x conv) the split stays 4 + 4."""
    one = Conv2dProblem.make("wgrad", 32, 256, 14, 14, 1024, 1)
    counts = collections.Counter(k.family for k in plan_problem(one, 8).kernels
                                 if not k.is_conv_pingpong and not on_top(k))  # not the twins on top
    assert counts == {KernelFamily.SM80_IMPLICIT_GEMM: 2, KernelFamily.SM90_TMA_WGMMA: 3,
                      KernelFamily.SM90_GEMM_1X1: 3}, counts
    three = Conv2dProblem.make("fprop", 32, 256, 14, 14, 256, 3, padding=1)
    counts = collections.Counter(k.family for k in plan_problem(three, 8).kernels if not k.is_conv_pingpong)
    assert counts == {KernelFamily.SM80_IMPLICIT_GEMM: 4, KernelFamily.SM90_TMA_WGMMA: 4}, counts


def test_a_budget_smaller_than_the_families_is_kept():
    """--max-candidates 1 on a 1x1 layer (2.x, 3.x conv and 3.x GEMM families all apply): one kernel, the best
    estimate among the families' best."""
    p = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 1)
    for budget in (1, 2):
        pp = plan_problem(p, budget)
        assert len([k for k in pp.kernels if not k.is_conv_pingpong]) == budget, [c.name for c in pp.candidates]


def test_3x_wgrad_times_split_and_unsplit_kernels():
    """The 3.x conv wgrad of ResNet-50's 256-channel 3x3 layer (7 output tiles of 64x128 per 256 rows): the model
    ranks all of its split-k kernels first, yet on the H200 the unsplit 64x128 one was fastest (21.7 us against
    26.6 us for the best split one; scripts/sweep_kernels.py). The budget times the family's best of each."""
    if plan_mod._sm90_enumerator() is None:
        pytest.skip("no 3.x conv family in this build")
    p = Conv2dProblem.make("wgrad", 32, 256, 14, 14, 256, 3, padding=1)
    sm90 = [k for k in plan_problem(p, 8).kernels if k.family is KernelFamily.SM90_TMA_WGMMA]
    modes = [k.split_k_mode for k in sm90]
    assert SplitKMode.PARALLEL in modes and SplitKMode.SERIAL in modes, [k.name for k in sm90]


def test_pingpong_kernels_have_a_budget_on_top():
    """The project's persistent ping-pong 3.x conv kernels: PINGPONG_BUDGET of them per problem, one per tile shape
    first, on top of the families' shares, which stay what they are without them (so no kernel that won a cell
    before leaves the plan)."""
    if plan_mod._sm90_enumerator() is None:
        pytest.skip("no 3.x conv family in this build")
    from cutlass_byoc import sm90  # noqa: PLC0415

    for p in (Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1),
              Conv2dProblem.make("dgrad", 32, 256, 14, 14, 1024, 1),
              Conv2dProblem.make("wgrad", 32, 512, 7, 7, 512, 3, padding=1)):
        kernels = plan_problem(p, 8).kernels
        pingpong = [k for k in kernels if k.is_conv_pingpong]
        assert len(pingpong) == PINGPONG_BUDGET, [k.name for k in kernels]
        assert len([k for k in plan_problem(p, 2).kernels if k.is_conv_pingpong]) == 1  # at least one
        assert len({k.tile[:2] for k in pingpong}) == PINGPONG_BUDGET
        assert all(k.split_k_mode is SplitKMode.SERIAL for k in pingpong)
        plain = {dataclasses.replace(k, schedule=sm90.SCHEDULE) for k in pingpong}
        assert plain <= set(enumerate_kernels(p)[0])
    # without the ping-pong kernels, the same plan otherwise
    p = Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1)
    with_pp = [k for k in plan_problem(p, 8).kernels if not k.is_conv_pingpong]
    import unittest.mock as mock  # noqa: PLC0415

    only_plain = lambda q: sm90.sm90_candidates(q, schedules=(sm90.SCHEDULE,))  # noqa: E731
    with mock.patch.object(plan_mod, "_sm90_enumerator", lambda: only_plain):
        assert plan_problem(p, 8).kernels == tuple(with_pp)


def test_strided_dgrad_times_one_more_pingpong_kernel():
    """A strided dgrad's ping-pong kernels (the sub-pixel phases in one launch) get SUBPIXEL_PINGPONG_EXTRA more:
    layer 2's 3x3 stride-2 dgrad then times the 128x128 tile, whose CUTLASS twin won the cell, beside the model's
    first two."""
    if plan_mod._sm90_enumerator() is None:
        pytest.skip("no 3.x conv family in this build")
    p = Conv2dProblem.make("dgrad", 32, 128, 56, 56, 128, 3, stride=2, padding=1)
    pingpong = [k for k in plan_problem(p, 8).kernels if k.is_conv_pingpong]
    assert len(pingpong) == PINGPONG_BUDGET + SUBPIXEL_PINGPONG_EXTRA
    assert all(k.is_subpixel_dgrad for k in pingpong) and (128, 128) in {k.tile[:2] for k in pingpong}
    assert len([k for k in plan_problem(p, 2).kernels if k.is_conv_pingpong]) == 1 + SUBPIXEL_PINGPONG_EXTRA
    assert not [k for k in plan_problem(p, 1).kernels if k.is_conv_pingpong]  # a budget of one: one kernel
    # a stride-1 dgrad: no extra
    stride1 = p.replace(stride_h=1, stride_w=1)
    assert len([k for k in plan_problem(stride1, 8).kernels if k.is_conv_pingpong]) == PINGPONG_BUDGET


def test_split_k_study_times_the_tuned_decision_on_its_side():
    """bench --split-k (profiler/splitk.py): beside the model's picks, the decision's launch (the tune's winner) is
    timed on its own side, once; padded or folded decisions are not (the study compares kernels on the problem as
    it is)."""
    from cutlass_byoc.profiler.splitk import _sides, _with_decision

    p = Conv2dProblem.make("wgrad", 32, 1024, 14, 14, 256, 1)
    split, unsplit = _sides(p, 1)
    assert split and unsplit and all(l.split_k_slices > 1 for l in split)
    others = [l for k in enumerate_kernels(p)[0] for _, l in plan_mod.launches_for(p, k)]
    won_split = next(l for l in others if l.split_k_slices > 1 and l not in split)
    won_unsplit = next(l for l in others if l.split_k_slices == 1 and l not in unsplit)
    assert _with_decision(split, unsplit, won_split) == ([*split, won_split], unsplit)
    assert _with_decision(split, unsplit, won_unsplit) == (split, [*unsplit, won_unsplit])
    assert _with_decision(split, unsplit, split[0]) == (split, unsplit)  # the model's pick already
    assert _with_decision(split, unsplit, None) == (split, unsplit)
    assert _with_decision(split, unsplit, dataclasses.replace(won_unsplit, pad_c=8)) == (split, unsplit)


def test_wgrad_times_deep_pipeline_twins_beside_its_3x_kernels():
    """A wgrad's 3.x kernels whose stage count the families' cap of 8 binds (64 x 64 tiles and narrower) are timed
    beside their deep twins (sm90.deep_twin, gemm1x1.deep_twin; on the H200 3-14% faster on most ResNet-50 wgrad
    cells, slower on a few), with the same slice counts; the families' shares stay as they were; fprop and dgrad get
    none."""
    from cutlass_byoc import gemm1x1, sm90  # noqa: PLC0415

    p = Conv2dProblem.make("wgrad", 32, 512, 28, 28, 128, 1)
    pp = plan_problem(p, 8)
    deep = [k for k in pp.kernels if is_deep(k)]
    assert deep and not [k for k in plan_problem(p, 2).kernels if is_deep(k)]  # not on small budgets
    for d in deep:
        twin = (sm90.deep_twin if d.family is KernelFamily.SM90_TMA_WGMMA else gemm1x1.deep_twin)
        base = next(k for k in pp.kernels if k.family is d.family and not is_deep(k) and twin(k) == d)
        slices = lambda k: sorted(c.launch.split_k_slices for c in pp.candidates if c.launch.kernel == k)  # noqa: E731
        assert slices(d) == slices(base)
        assert d.stages <= max(sm90.DEEP_MAX_STAGES, gemm1x1.DEEP_MAX_STAGES)
    assert sm90.deep_twin(sm90.sm90_config(p, (128, 128, 64))) is None  # the cap does not bind
    import unittest.mock as mock  # noqa: PLC0415

    with mock.patch.object(plan_mod, "_deep_twins", lambda *a: []):
        assert [k for k in pp.kernels if not is_deep(k)] == list(plan_problem(p, 8).kernels)
    for kind in ("fprop", "dgrad"):
        assert not [k for k in plan_problem(p.replace(kind=ConvKind(kind)), 8).kernels if is_deep(k)]


def test_gemm_1x1_whole_wave_tiles_have_a_budget_on_top():
    """The GEMM 1x1 family's 192-row tiles (gemm1x1.WAVE_TILES; 33 x 4 = 132 tiles on layer 3's 6,272 x 256): one
    per fprop / dgrad problem on top of the families' shares (budgets of 4 kernels and more), none for wgrad, and
    never in the im2col lowering."""
    from cutlass_byoc.gemm1x1 import im2col_candidates  # noqa: PLC0415

    for kind in ("fprop", "dgrad"):
        p = Conv2dProblem.make(kind, 32, 1024, 14, 14, 256, 1)
        kernels = plan_problem(p, 8).kernels
        wave = [k for k in kernels if k.family is KernelFamily.SM90_GEMM_1X1 and k.tile in WAVE_TILES]
        assert len(wave) == plan_mod.GEMM_WAVE_BUDGET and wave[0].schedule == "pingpong"
        import unittest.mock as mock  # noqa: PLC0415

        with mock.patch.dict(plan_mod._SIDE_BUDGETS, {plan_mod._GEMM_WAVE: 0}), \
                mock.patch.object(plan_mod, "GEMM_WAVE_BUDGET", 0):
            assert plan_problem(p, 8).kernels == tuple(k for k in kernels if k not in wave)
    wgrad = Conv2dProblem.make("wgrad", 32, 1024, 14, 14, 256, 1)
    assert not [k for k in plan_problem(wgrad, 8).kernels if k.tile in WAVE_TILES]
    stem = Conv2dProblem.make("fprop", 32, 3, 224, 224, 64, 7, stride=2, padding=3)
    assert not [k for k in im2col_candidates(stem) if k.tile in WAVE_TILES]


def test_wgrad_times_atomic_twins_beside_its_split_k_kernels():
    """A wgrad's 3.x split-k kernels, deep twins included, are timed beside their atomic twins (sm90.atomic_twin: the
    slices' sums added by TMA reduce-adds into one buffer) with the same slice counts, on budgets of 4 kernels and
    more; never under torch.use_deterministic_algorithms(True), where a decision holding one runs its split-k twin."""
    torch = pytest.importorskip("torch")
    from cutlass_byoc import sm90  # noqa: PLC0415
    from cutlass_byoc.select import honour_determinism  # noqa: PLC0415

    p = Conv2dProblem.make("wgrad", 32, 64, 56, 56, 64, 3, padding=1, out_dtype="f32")
    pp = plan_problem(p, 8)
    atomic = [k for k in pp.kernels if is_atomic(k)]
    split = [k for k in pp.kernels if k.family is KernelFamily.SM90_TMA_WGMMA and k.split_k_mode is SplitKMode.PARALLEL]
    assert split and sorted(map(sm90.atomic_twin, split), key=str) == sorted(atomic, key=str)
    assert any(is_deep(k) for k in atomic)
    slices = lambda k: sorted(c.launch.split_k_slices for c in pp.candidates if c.launch.kernel == k)  # noqa: E731
    assert all(slices(sm90.atomic_twin(k)) == slices(k) for k in split)
    assert not [k for k in plan_problem(p, 2).kernels if is_atomic(k)]  # not on small budgets
    assert [k for k in pp.kernels if not is_atomic(k)] == [k for k in plan_problem(p, 8).kernels if not is_atomic(k)]
    for kind in ("fprop", "dgrad"):
        assert not [k for k in plan_problem(p.replace(kind=ConvKind(kind)), 8).kernels if is_atomic(k)]
    launch = next(c.launch for c in pp.candidates if is_atomic(c.launch.kernel))
    assert honour_determinism(launch, False) is launch
    torch.use_deterministic_algorithms(True)
    try:
        assert not [k for k in plan_problem(p, 8).kernels if is_atomic(k)]
    finally:
        torch.use_deterministic_algorithms(False)
    twin = honour_determinism(launch, True)
    assert twin == dataclasses.replace(launch, kernel=sm90.deterministic_twin(launch.kernel))
    assert twin.kernel.split_k_mode is SplitKMode.PARALLEL and twin.split_k_slices == launch.split_k_slices
