"""Space-to-depth as a launch parameter (issue 11, part 3: the stem): the folded problem, the rules, the planner's
offer, and that ops' rewrite computes the user's problem exactly (on the CPU, the kernel replaced by a float64
reference, every kind, with epilogue sources, odd sizes whose last rows the strided conv never reads)."""

from __future__ import annotations

import dataclasses

import pytest

from cutlass_byoc.candidates import s2d_options, sm80_candidates
from cutlass_byoc.config import LaunchConfig, round_up, s2d_problem, s2d_reject_reason
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.profiler.plan import plan_problem
from cutlass_byoc.types import Activation, SourceKind

from layers import stem


def _kernel(problem):
    return next(iter(sm80_candidates(problem)))


# ---------------------------------------------------------------------------------------------- the folded problem
def test_stem_folds_into_a_4x4_stride_1_conv_over_12_channels():
    for kind in ("fprop", "dgrad", "wgrad"):
        p = stem(kind)
        f = s2d_problem(p, 2)
        assert (f.n, f.c, f.k, f.r, f.s) == (32, 12, 64, 4, 4)
        assert (f.h, f.w) == (115, 115) and (f.p, f.q) == (p.p, p.q) == (112, 112)
        assert (f.pad_h, f.pad_w, f.stride_h, f.stride_w) == (0, 0, 1, 1)
        assert f.kind is p.kind and f.epilogue == p.epilogue


def test_launch_name_dict_and_kernel_problem():
    p = stem("fprop")
    big = s2d_problem(p, 2).replace(c=16)
    launch = LaunchConfig(_kernel(big), pad_c=8, s2d=2)
    assert launch.padded and launch.unpadded == LaunchConfig(launch.kernel)
    assert launch.kernel_problem(p) == big
    assert launch.name == launch.kernel.name + "_s2d2_padc8"
    assert LaunchConfig.from_dict(launch.to_dict()) == launch
    assert "s2d" not in LaunchConfig(launch.kernel).to_dict()  # the dicts of other launches are unchanged
    assert launch.reject_reason(p) is None
    with pytest.raises(ValueError, match="s2d"):
        LaunchConfig(launch.kernel, s2d=5)


def test_rules_name_the_parameter():
    assert "stride" in s2d_reject_reason(stem("fprop"), 3)
    assert "dilation" in s2d_reject_reason(Conv2dProblem.make("fprop", 2, 3, 16, 16, 8, 3, stride=2, dilation=2), 2)
    assert "groups" in s2d_reject_reason(Conv2dProblem.make("fprop", 2, 4, 16, 16, 4, 3, stride=2, groups=2), 2)
    # dgrad with an epilogue where the fold does not reach dx's last row (H=11, 2x2 stride 2, no padding: the fold
    # holds rows 0-9) is refused; a fold reaching every row (H=10, 3x3: rows 0-9, row 9 under zero taps), or no
    # epilogue, is fine
    ep = Epilogue(source=SourceKind.RESIDUAL)
    uncovered = Conv2dProblem.make("dgrad", 2, 3, 11, 11, 8, 2, stride=2, epilogue=ep)
    assert "epilogue" in s2d_reject_reason(uncovered, 2)
    assert s2d_reject_reason(uncovered.replace(epilogue=Epilogue()), 2) is None
    assert s2d_reject_reason(Conv2dProblem.make("dgrad", 2, 3, 10, 10, 8, 3, stride=2, epilogue=ep), 2) is None
    launch = LaunchConfig(_kernel(s2d_problem(stem("fprop"), 2)), s2d=2)
    assert "s2d" in launch.reject_reason(stem("fprop").replace(stride_h=1, stride_w=1))


def test_which_problems_get_the_fold():
    assert s2d_options(stem("fprop")) == [1, 2]
    assert s2d_options(stem("wgrad", out_dtype="f32")) == [1, 2]
    # a 1x1 strided conv: its fold is a subsample (one phase), then a stride-1 1x1 conv, a GEMM
    down = Conv2dProblem.make("fprop", 32, 256, 56, 56, 512, 1, stride=2)
    assert s2d_options(down) == [1, 2]
    f = s2d_problem(down, 2)
    assert (f.c, f.h, f.w, f.r, f.s, f.stride_h) == (256, 28, 28, 1, 1, 1)
    # wide channels (16-byte accesses already), narrower filters than the stride, unstrided, unequal strides,
    # dilated: as they are
    assert s2d_options(Conv2dProblem.make("fprop", 32, 128, 56, 56, 128, 3, stride=2, padding=1)) == [1]
    assert s2d_options(Conv2dProblem.make("fprop", 32, 3, 56, 56, 64, 3, stride=4, padding=1)) == [1]
    assert s2d_options(Conv2dProblem.make("fprop", 32, 3, 56, 56, 64, 3, padding=1)) == [1]
    assert s2d_options(Conv2dProblem.make("fprop", 2, 3, 16, 16, 8, 3, stride=(2, 1))) == [1]
    assert s2d_options(Conv2dProblem.make("fprop", 2, 3, 16, 16, 8, 3, stride=2, dilation=2)) == [1]
    assert s2d_options(Conv2dProblem.make("fprop", 2, 3, 32, 32, 8, 8, stride=4, padding=2)) == [1, 4]


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_planner_times_the_fold_next_to_the_plain_and_padded_launches(kind):
    plan = plan_problem(stem(kind))
    folded = [c.launch for c in plan.candidates if c.launch.s2d == 2]
    assert folded, "the stem's space-to-depth launches were not offered"
    assert any(c.launch.s2d == 1 for c in plan.candidates)
    for launch in folded:
        assert launch.reject_reason(stem(kind)) is None
        assert launch.kernel.reject_reason(launch.kernel_problem(stem(kind))) is None
    # the fold's C=12 runs as it is (8-byte accesses) and padded to 16 (16-byte accesses, the sm90 kernels)
    assert {launch.kernel_problem(stem(kind)).c for launch in folded} == {12, 16}


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_the_models_default_folds_the_stem(kind):
    """Untuned, the stem's dgrad runs folded: on the H200 the model's fold pick ran 156 us against 565 us for its
    channel-padded pick (the previous default). Its fprop and wgrad run unfolded on the shared-memory im2col family,
    at batch 32 and 64 (H100, 2026-12-06: fprop 63 / 117 us against the fold's best 136 / 260; fp32 wgrad 82 / 139
    against 116 / 232), on the configs the tunes chose, never a prefetch twin (slower wherever timed)."""
    from cutlass_byoc.heuristics import default_launch  # noqa: PLC0415
    from cutlass_byoc.types import DType, KernelFamily  # noqa: PLC0415

    d = default_launch(stem(kind))
    assert d.reject_reason(stem(kind)) is None
    if kind == "dgrad":
        assert d.s2d == 2
    else:
        for n in (32, 64):
            for out in ((None, DType.F32) if kind == "wgrad" else (None,)):
                p = stem(kind, n=n) if out is None else dataclasses.replace(stem(kind, n=n), element_out=out)
                d = default_launch(p)
                assert d.kernel.family is KernelFamily.SMEM_IM2COL and not d.padded and d.kernel.prefetch is None
                assert d.kernel.tile == (16, 16, 64)
                assert d.kernel.warps == ((8, 1, 1) if kind == "fprop" else (1, 4, 1))
    assert default_launch(stem(kind), padding=False) is None or default_launch(stem(kind), padding=False).s2d == 1
    # the 1x1 strided fprop stays as it is (its fold ran 32.4 us against 31.9 unfolded)
    assert default_launch(Conv2dProblem.make("fprop", 32, 256, 56, 56, 512, 1, stride=2)).s2d == 1


# ---------------------------------------------------------------------------------------------- exactness
torch = pytest.importorskip("torch")
from rewrite_util import check_rewritten_run  # noqa: E402


CASES = [  # (c, h, w, k, r, s, stride, padding): the stem at a small size, odd sizes, cropped and uncovered edges
    (3, 16, 16, 8, 7, 7, 2, 3),
    (3, 15, 17, 5, 7, 7, 2, 3),
    (3, 10, 10, 4, 3, 3, 2, 0),   # the conv never reads row and column 9 (the fold holds them, under zero taps)
    (3, 11, 11, 4, 2, 2, 2, 0),   # the fold does not reach row and column 10: dgrad writes zeros there
    (2, 11, 9, 3, 3, 5, 2, 1),
    (3, 14, 13, 4, 5, 5, 3, 2),
    (1, 17, 17, 3, 8, 8, 4, 2),
    (5, 13, 13, 4, 1, 1, 2, 0),   # 1x1 stride 2: a subsample (one phase of four)
    (5, 14, 12, 4, 1, 1, 2, 0),
    (4, 9, 9, 3, 1, 3, 2, 1),     # 1x3: one row phase, both column phases
]


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "c{}_{}x{}_k{}_{}x{}_u{}_p{}".format(*c))
@pytest.mark.parametrize("pad_c", [1, 8])
@pytest.mark.parametrize("source", [None, "residual", "bias", "bias_residual"])
def test_folded_run_is_exact(monkeypatch, kind, case, pad_c, source):
    """ops._run_rewritten folds the operands and unfolds the output so that the kernel's stride-1 conv (here a
    float64 reference checking it got the folded shapes) computes the user's strided conv exactly."""
    c, h, w, k, r, s, stride, padding = case
    if kind != "fprop" and source in ("bias", "bias_residual"):
        pytest.skip("only fprop takes a bias")
    act = Activation.RELU if kind == "fprop" else Activation.IDENTITY
    ep = Epilogue(activation=act, source=SourceKind(source) if source else SourceKind.NONE)
    p = Conv2dProblem.make(kind, 2, c, h, w, k, r, s, stride=stride, padding=padding, dtype="f32", epilogue=ep)
    if s2d_reject_reason(p, stride):
        p = p.replace(epilogue=dataclasses.replace(ep, source=SourceKind.NONE))
        source = None
    big = s2d_problem(p, stride)
    if pad_c > 1 and round_up(big.c, pad_c) == big.c:
        pad_c = 16  # (a fold of C=2 has 8 channels already)
        if round_up(big.c, pad_c) == big.c:
            pytest.skip(f"the fold's {big.c} channels need no padding")
    big = big.replace(c=round_up(big.c, pad_c))
    launch = LaunchConfig(_kernel(big), pad_c=pad_c, s2d=stride)
    assert launch.reject_reason(p) is None and launch.kernel_problem(p) == big
    check_rewritten_run(monkeypatch, p, launch, source)


def test_rewrites_keep_their_inputs():
    from cutlass_byoc.rewrite import d2s_filter, s2d_filter  # noqa: PLC0415

    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, 3, 7, 7, generator=g).contiguous(memory_format=torch.channels_last)
    keep = w.clone()
    ws = s2d_filter(w, 2, 16, 8)
    assert tuple(ws.shape) == (8, 16, 4, 4) and ws.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(w, keep)
    assert ws[5:].abs().sum() == 0 and ws[:, 12:].abs().sum() == 0  # padded filters and channels are zero
    back = torch.full_like(w, float("nan"))
    d2s_filter(ws, 2, back)
    assert torch.equal(back, w)
