"""The shared-memory im2col family (issue 11, part 3: the stem and odd channels) on the H200: fprop of few input
channels on every config the family has for the RGB stem (each shape and its prefetch twin), then across types (bf16, fp32 output), channel counts
(C = 1, 3, 5, 7; K not a multiple of 8 or of the channel tile), filters, strides, paddings, dilation, odd image
sizes and batch 1, and with the fused epilogues (bias, residual, the activations); stride-1 dgrad of few dy
channels (the odd layer's, dilation, bf16 into fp32, a residual) as the fprop of dy; wgrad of few input channels on
every wgrad config for the stem, then across types, output types, channel and tap blocks, strides, dilation and
partial tiles, and with an Inf in x that only pixels past P and Q would read. Against the float64 reference on
fresh random inputs, outputs poisoned (NaN) first.
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.profiler.plan import plan_problem  # noqa: E402
from cutlass_byoc.smem_im2col import SHAPES, WGRAD_SHAPES, config, smem_im2col_candidates  # noqa: E402
from cutlass_byoc.types import Activation, KernelFamily, SourceKind  # noqa: E402

import layers  # noqa: E402
from gpu_util import check_launch, module_kernels  # noqa: E402

pytestmark = pytest.mark.gpu

BATCH = 4
stem = functools.partial(layers.stem, "fprop", n=BATCH)

#: (name, problem): types, channels, filters, strides, paddings, dilation and sizes past the stem's.
CASES = {
    "stem_bf16": stem(dtype="bf16"),
    "stem_f32_out": stem(out_dtype="f32"),
    "stem_batch1": layers.stem("fprop", n=1),
    "odd_7_33": layers.odd("fprop", n=BATCH),
    "c1_5x5_dil2": Conv2dProblem.make("fprop", 2, 1, 31, 29, 24, 5, padding=4, dilation=2),
    "c5_3x3_s3_odd": Conv2dProblem.make("fprop", 3, 5, 17, 19, 40, 3, stride=3),
    "c3_1x1": Conv2dProblem.make("fprop", 2, 3, 9, 11, 16, 1),
    "c3_k96_two_blocks": Conv2dProblem.make("fprop", 2, 3, 33, 35, 96, 7, stride=2, padding=3),
    "c6_rect_s2x1": Conv2dProblem.make("fprop", 2, 6, 20, 23, 64, 3, 5, stride=(2, 1), padding=(1, 2)),
    "c3_stem_no_pad": Conv2dProblem.make("fprop", 2, 3, 45, 47, 64, 7, stride=2),
    # stride-1 dgrad as the fprop of dy (K channels gathered, C written)
    "dgrad_odd_33_7": layers.odd("dgrad", n=BATCH),
    "dgrad_k12_c5_dil2": Conv2dProblem.make("dgrad", 2, 5, 23, 21, 12, 3, padding=2, dilation=2),
    "dgrad_bf16_f32_out": Conv2dProblem.make("dgrad", 2, 24, 19, 17, 3, 5, padding=(2, 1), dtype="bf16",
                                             out_dtype="f32"),
    "dgrad_k20_c40_pad0": Conv2dProblem.make("dgrad", 2, 40, 15, 16, 20, 3),
    "dgrad_residual": layers.odd("dgrad", n=2, epilogue=Epilogue(source=SourceKind.RESIDUAL)),
}

#: (name, problem): wgrad of few input channels: the stem in the other types (WGRAD_STEM, fp32 out, runs every config),
#: then layers.SMEM_WGRAD_CASES.
WGRAD_CASES = {
    "stem_f16_out": layers.stem("wgrad", n=BATCH),
    "stem_bf16_f32_out": layers.stem("wgrad", n=BATCH, dtype="bf16", out_dtype="f32"),
    "stem_bf16": layers.stem("wgrad", n=BATCH, dtype="bf16"),
    "stem_batch1": layers.stem("wgrad", n=1, out_dtype="f32"),
    **layers.SMEM_WGRAD_CASES,
}

EPILOGUES = {
    "bias_relu": Epilogue(Activation.RELU, SourceKind.BIAS),
    "residual": Epilogue(source=SourceKind.RESIDUAL),
    "silu": Epilogue(Activation.SILU),
    "gelu_bias": Epilogue(Activation.GELU, SourceKind.BIAS),
    "hardswish": Epilogue(Activation.HARDSWISH),
    "sigmoid_residual": Epilogue(Activation.SIGMOID, SourceKind.RESIDUAL),
}


#: The stem's wgrad as training runs it (fp32 weight gradients), a batch of BATCH.
WGRAD_STEM = layers.stem("wgrad", n=BATCH, out_dtype="f32")
INF_WGRAD = layers.INF_WGRAD


def epilogue_problem(name: str) -> Conv2dProblem:
    return stem(epilogue=EPILOGUES[name])


def shape_launches() -> list[LaunchConfig]:
    """Every config of the family for the stem."""
    return [LaunchConfig(c) for c in smem_im2col_candidates(stem(), twins=True)]


#: (name, problem): fprop, dgrad and wgrad problems the pairs twins take besides the stem (smem_im2col.pairs_error):
#: odd and even S*C, rectangular strides, dilation_h 2, bf16 into fp32, two channel blocks, stride 3.
PAIRS_CASES = {
    "c1_5x5_s2": Conv2dProblem.make("fprop", 2, 1, 21, 19, 24, 5, stride=2, padding=2),
    "c6_rect_s2x1": CASES["c6_rect_s2x1"],
    "c3_k96_dil2x1_bf16_f32": Conv2dProblem.make("fprop", 2, 3, 33, 35, 96, 7, stride=2, padding=3,
                                                 dilation=(2, 1), dtype="bf16", out_dtype="f32"),
    "stem_residual_silu": stem(epilogue=Epilogue(Activation.SILU, SourceKind.RESIDUAL)),
    "dgrad_k34": Conv2dProblem.make("dgrad", 2, 7, 13, 11, 34, 3, padding=1),
    "dgrad_k12_dil2x1": Conv2dProblem.make("dgrad", 2, 5, 23, 21, 12, 3, padding=(2, 1), dilation=(2, 1)),
    "wgrad_bf16_f32": WGRAD_CASES["stem_bf16_f32_out"],
    "wgrad_c3_k96_two_blocks": layers.SMEM_WGRAD_CASES["c3_k96_two_blocks"],
    "wgrad_c5_3x3_s3_odd": layers.SMEM_WGRAD_CASES["c5_3x3_s3_odd"],
}


def pairs_config(p: Conv2dProblem):
    return next(c for c in smem_im2col_candidates(p) if c.pairs)


def used_configs():
    """Every kernel this module launches (scripts/warm_cache.py compiles them beforehand)."""
    out = [l.kernel for l in shape_launches()]
    out += [pairs_config(p) for p in PAIRS_CASES.values()]
    out += [pairs_config(INF_WGRAD), pairs_config(stem())]
    out += [config(p) for p in CASES.values()]
    out += [config(epilogue_problem(e)) for e in EPILOGUES]
    out += [config(stem(out_dtype="f32", epilogue=EPILOGUES["bias_relu"]))]
    out += [config(stem()).with_alignments(1, 1, 1)]  # the misaligned output's narrowing
    out += [c for c in smem_im2col_candidates(WGRAD_STEM, twins=True)]
    out += [config(p) for p in WGRAD_CASES.values()]
    out += [config(INF_WGRAD)]
    return list(dict.fromkeys(out))


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    with module_kernels(shared_cache, used_configs):
        yield


def test_the_planner_times_the_family_on_the_stem():
    plan = plan_problem(layers.stem("fprop", n=32))
    ours = [c.launch for c in plan.candidates if c.launch.kernel.family is KernelFamily.SMEM_IM2COL]
    assert ours and all(not l.padded for l in ours)


@pytest.mark.parametrize("i", range(3 * len(SHAPES)))  # each shape, its pairs twin and its prefetch twin
def test_every_config_on_the_stem(i):
    launches = shape_launches()
    assert len(launches) == 3 * len(SHAPES)
    check_launch(stem(), launches[i], seed=700 + i)


@pytest.mark.parametrize("case", list(CASES))
def test_types_channels_filters_and_strides(case):
    p = CASES[case]
    check_launch(p, LaunchConfig(config(p)), seed=900 + list(CASES).index(case))


@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_fused_epilogues(epilogue):
    p = epilogue_problem(epilogue)
    check_launch(p, LaunchConfig(config(p)), seed=800 + list(EPILOGUES).index(epilogue))


def test_bias_relu_into_fp32():
    p = stem(out_dtype="f32", epilogue=EPILOGUES["bias_relu"])
    check_launch(p, LaunchConfig(config(p)), seed=850)


def test_misaligned_output_runs_a_narrower_kernel():
    """An output view 2 bytes past an aligned address: the launch narrows to the family's 1-element stores (the
    16-byte ones never see the address), and the result is right."""
    from cutlass_byoc import ops  # noqa: PLC0415
    from gpu_util import TOLERANCE, epilogue_case, rel_err  # noqa: PLC0415

    p = stem()
    a, b, _, ref = epilogue_case(p, 860)
    n, h, w, k = p.out_shape
    flat = torch.full((n * h * w * k + 1,), float("nan"), dtype=torch.float16, device="cuda")
    out = flat[1:].view(n, h, w, k).permute(0, 3, 1, 2)  # channels_last strides, an address 2 bytes off
    launch = LaunchConfig(config(p))
    assert launch.kernel.align_c == 8
    ops.run_problem(p, a, b, out, None, config=launch)
    torch.cuda.synchronize()
    assert rel_err(out, ref) < TOLERANCE[p.element_out]


@pytest.mark.parametrize("i", range(3 * len(WGRAD_SHAPES)))  # each shape, its pairs twin and its prefetch twin
def test_every_wgrad_config_on_the_stem(i):
    launches = [LaunchConfig(c) for c in smem_im2col_candidates(WGRAD_STEM, twins=True)]
    assert len(launches) == 3 * len(WGRAD_SHAPES)
    check_launch(WGRAD_STEM, launches[i], seed=1000 + i)


@pytest.mark.parametrize("case", list(WGRAD_CASES))
def test_wgrad_types_channels_taps_and_strides(case):
    p = WGRAD_CASES[case]
    check_launch(p, LaunchConfig(config(p)), seed=1100 + list(WGRAD_CASES).index(case))


@pytest.mark.parametrize("pairs", [False, True], ids=["plain", "pairs"])
def test_wgrad_pixels_past_the_output_add_nothing_whatever_x_holds(pairs):
    """x's last row and column hold Inf, read by no output pixel: the reference does not see them, and neither may the
    kernel (its tile's pixels past P and Q read a zero window, not the patch; the pairs twin's whole pixel pairs, Q
    being even)."""
    from cutlass_byoc import ops  # noqa: PLC0415
    from gpu_util import TOLERANCE, epilogue_operands, poisoned_output, rel_err  # noqa: PLC0415

    p = INF_WGRAD
    assert (p.p, p.q) == (4, 4)
    a, b, _, _, ref = epilogue_operands(p, 1410 if pairs else 1200)
    b[:, :, 9, :] = float("inf")
    b[:, :, :, 9] = float("inf")
    out = poisoned_output(p)
    ops.run_problem(p, a, b, out, None, config=LaunchConfig(pairs_config(p) if pairs else config(p)))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOLERANCE[p.element_out]


@pytest.mark.parametrize("case", list(PAIRS_CASES))
def test_pairs_twins_on_other_problems(case):
    p = PAIRS_CASES[case]
    check_launch(p, LaunchConfig(pairs_config(p)), seed=1300 + list(PAIRS_CASES).index(case))


def test_pairs_padding_taps_read_zero_whatever_x_holds():
    """The stem's 21 taps a filter row are padded to 22 in the pairs kernel: pixel q's padding tap reads input column
    2q + 4, channel 0, outside its window. With an Inf there, every output whose window misses it stays finite and
    right (the tap's mask zeroes it before the mma; 0 x Inf would be NaN)."""
    from cutlass_byoc import ops  # noqa: PLC0415
    from gpu_util import TOLERANCE, epilogue_operands, poisoned_output  # noqa: PLC0415

    p = stem()
    a, b, _, _, _ = epilogue_operands(p, 1400)
    a[:, 0, :, 13] = float("inf")  # pixel q = 4's padding tap; the windows of q = 5..8 hold the column
    ref = torch.nn.functional.conv2d(a.double(), b.double(), None, stride=2, padding=3)
    out = poisoned_output(p)
    ops.run_problem(p, a, b, out, None, config=LaunchConfig(pairs_config(p)))
    torch.cuda.synchronize()
    finite = torch.isfinite(ref)
    assert finite[..., 4].all() and not finite.all()
    assert torch.isfinite(out.double()[finite]).all(), "a padding tap read the Inf"
    err = float((out.double()[finite] - ref[finite]).norm() / ref[finite].norm())
    assert err < TOLERANCE[p.element_out], err

