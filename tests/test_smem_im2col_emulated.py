"""The shared-memory im2col kernels' own source, run on the CPU (tests/emulate_cuda.py: g++, the CUDA launch model and
the inline-PTX helpers emulated) against float64 PyTorch, outputs poisoned with NaN. The fprop and dgrad kernels,
verified on the GPU (tests/test_gpu_smem_im2col.py), check the emulation of mma.sync and ldmatrix; their prefetch
twins (not yet on a GPU) follow; then the wgrad kernel on every config for a small stem, across types, output types,
channel blocks, tap blocks, strides, dilation and partial tiles, with x's Inf read only by pixels past P and Q, on one
workspace slice, and on random problems. Index arithmetic without a GPU; test_gpu_smem_im2col.py runs the same
cases on the H200."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import emulate_cuda  # noqa: E402
import layers  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.types import Activation, ConvKind, DType, SourceKind  # noqa: E402
from cutlass_byoc.smem_im2col import SHAPES, WGRAD_SHAPES, config, smem_im2col_candidates  # noqa: E402

from gpu_util import TOLERANCE, TORCH  # noqa: E402

pytestmark = [pytest.mark.compile,
              pytest.mark.skipif(emulate_cuda.skip_reason() is not None, reason=str(emulate_cuda.skip_reason()))]


def operands(p: Conv2dProblem, seed: int):
    """(a, b, float64 reference) of `p` on fresh random operands (channels_last, as the kernels read them)."""
    g = torch.Generator().manual_seed(seed)
    cl, dt = torch.channels_last, TORCH[p.element_a]
    x = torch.randn(p.n, p.c, p.h, p.w, generator=g).to(dt).contiguous(memory_format=cl)
    w = torch.randn(p.k, p.c, p.r, p.s, generator=g).to(dt).contiguous(memory_format=cl)
    dy = torch.randn(p.n, p.k, p.p, p.q, generator=g).to(dt).contiguous(memory_format=cl)
    geo = dict(stride=(p.stride_h, p.stride_w), padding=(p.pad_h, p.pad_w), dilation=(p.dilation_h, p.dilation_w))
    if p.kind.value == "fprop":
        return x, w, torch.nn.functional.conv2d(x.double(), w.double(), None, **geo)
    if p.kind.value == "dgrad":
        return dy, w, torch.nn.grad.conv2d_input(x.shape, w.double(), dy.double(), **geo)
    return dy, x, torch.nn.grad.conv2d_weight(x.double(), w.shape, dy.double(), **geo)


def check(p: Conv2dProblem, cfg, seed: int = 0, operands_of=operands, **run):
    a, b, ref = operands_of(p, seed)
    out = torch.full(ref.shape, float("nan"), dtype=TORCH[p.element_out]).contiguous(memory_format=torch.channels_last)
    emulate_cuda.run(cfg, p, a, b, out, **run)
    err = float((out.double() - ref).norm() / ref.norm())
    assert not math.isnan(err), f"{cfg.name}: NaN in the output of {p.name}"
    assert err < TOLERANCE[p.element_out], f"{cfg.name} on {p.name}: relative error {err:.2e}"


@pytest.mark.parametrize("p", [
    Conv2dProblem.make("fprop", 1, 3, 20, 20, 16, 7, stride=2, padding=3),
    Conv2dProblem.make("dgrad", 1, 7, 13, 11, 33, 3, padding=1),
], ids=["stem_fprop", "odd_dgrad"])
def test_the_gpu_verified_kernels_check_the_emulation(p):
    check(p, config(p), seed=1)


@pytest.mark.parametrize("p", [
    Conv2dProblem.make("fprop", 1, 3, 30, 34, 64, 7, stride=2, padding=3),
    Conv2dProblem.make("dgrad", 1, 7, 13, 11, 33, 3, padding=1),
], ids=["stem_fprop", "odd_dgrad"])
def test_fprop_and_dgrad_prefetch_twins(p):
    """Every prefetch twin of the problem's configs (the next tile's patch loaded into registers during the
    arithmetic; where the patch is larger than MAX_PREFETCH elements a thread, the rest after it)."""
    twins = [c for c in smem_im2col_candidates(p, twins=True) if c.prefetch]
    assert len(twins) == len(SHAPES)
    for i, cfg in enumerate(twins):
        check(p, cfg, seed=70 + i)


#: The stem's wgrad at a small size, fp32 weight gradients as training stores them.
SMALL_STEM = Conv2dProblem.make("wgrad", 2, 3, 30, 34, 64, 7, stride=2, padding=3, out_dtype="f32")


@pytest.mark.parametrize("i", range(2 * len(WGRAD_SHAPES)))  # each shape and its prefetch twin
def test_every_wgrad_config_on_a_small_stem(i):
    cfgs = list(smem_im2col_candidates(SMALL_STEM, twins=True))
    assert len(cfgs) == 2 * len(WGRAD_SHAPES)
    check(SMALL_STEM, cfgs[i], seed=10 + i)


WGRAD_CASES = {
    "f16_out": SMALL_STEM.replace(element_out=SMALL_STEM.element_a),
    "bf16_f32_out": Conv2dProblem.make("wgrad", 2, 3, 30, 34, 64, 7, stride=2, padding=3, dtype="bf16",
                                       out_dtype="f32"),
    "bf16": Conv2dProblem.make("wgrad", 2, 3, 30, 34, 64, 7, stride=2, padding=3, dtype="bf16"),
    **layers.SMEM_WGRAD_CASES,
}


@pytest.mark.parametrize("case", list(WGRAD_CASES))
def test_wgrad_types_channels_taps_and_strides(case):
    p = WGRAD_CASES[case]
    check(p, config(p), seed=30 + list(WGRAD_CASES).index(case))


def with_inf(problem: Conv2dProblem, seed: int):
    """operands() with x's last row and column Inf (a wgrad's b)."""
    a, b, ref = operands(problem, seed)
    b[:, :, -1, :] = float("inf")
    b[:, :, :, -1] = float("inf")
    return a, b, ref


def test_wgrad_pixels_past_the_output_add_nothing_whatever_x_holds():
    """10x10 in, 3x3 stride 2 without padding: 4x4 out, and x's last row and column (Inf here) read by no output
    pixel, but by the pixels past P and Q of the kernel's 8x16 tile, which must read a zero window instead."""
    p = layers.INF_WGRAD
    check(p, config(p), seed=50, operands_of=with_inf)


def test_wgrad_on_one_workspace_slice_and_on_none():
    """A workspace of one slice: one CTA walks every pixel tile (the same sums); none: an error naming it."""
    p = SMALL_STEM.replace(n=1)
    slice_bytes = p.k * p.r * p.s * p.c * 4
    check(p, config(p), seed=60, workspace_bytes=slice_bytes)
    with pytest.raises(RuntimeError, match="workspace"):
        check(p, config(p), seed=60, workspace_bytes=slice_bytes - 4)


def random_wgrad(seed: int):
    """(problem, config): a random wgrad the family takes (C 1-7, K a multiple of 8 up to 128, filters up to 7x7,
    stride up to 3, dilation up to 2, any padding under the filter, odd sizes, f16/bf16 in, fp32 or the input's type
    out) and one of its configs, drawn from `seed`."""
    import random  # noqa: PLC0415

    from cutlass_byoc.config import LaunchConfig  # noqa: PLC0415

    rng = random.Random(seed)
    while True:
        c, k = rng.choice([1, 2, 3, 5, 6, 7]), rng.choice([8, 16, 24, 40, 64, 72, 96, 128])
        r, s = rng.randint(1, 7), rng.randint(1, 7)
        dil = (rng.choice([1, 1, 2]), rng.choice([1, 1, 2]))
        dt = rng.choice(["f16", "bf16"])
        try:
            p = Conv2dProblem.make("wgrad", rng.randint(1, 3), c, rng.randint(max(r * dil[0], 3), 40),
                                   rng.randint(max(s * dil[1], 3), 40), k, r, s,
                                   stride=(rng.randint(1, 3), rng.randint(1, 3)),
                                   padding=(rng.randint(0, r - 1), rng.randint(0, s - 1)), dilation=dil, dtype=dt,
                                   out_dtype=rng.choice([dt, "f32"]))
        except ValueError:
            continue
        cfgs = [cfg for cfg in smem_im2col_candidates(p, twins=True) if LaunchConfig(cfg).reject_reason(p) is None]
        if cfgs:
            return p, rng.choice(cfgs)


@pytest.mark.parametrize("seed", range(12))
def test_wgrad_random_shapes(seed):
    """Random problems and configs (session 35 also ran 40 other random ones once: none failed)."""
    p, cfg = random_wgrad(seed)
    check(p, cfg, seed=seed)


# --- pairs twins (KernelConfig.pairs: paired 4-byte shared-memory loads; smem_im2col.pairs_twin) ---------------------

#: A small stem whose output width is even (Q=16), so that its wgrad takes the pairs kernels too.
EVEN_STEM = Conv2dProblem.make("fprop", 1, 3, 30, 32, 64, 7, stride=2, padding=3)

#: fprop and dgrad problems the pairs kernels take (dilation_w 1, stride_w * C even): odd and even S*C (a padded tap
#: per filter row or none), stride 1-3, a rectangular stride, dilation_h 2, two channel blocks, bf16 into fp32, an
#: epilogue source; dgrad as the fprop of dy (K=34 and K=12 gathered).
PAIRS_CASES = {
    "stem": EVEN_STEM,
    "c1_5x5_s2": Conv2dProblem.make("fprop", 2, 1, 21, 19, 24, 5, stride=2, padding=2),
    "c5_3x3_s2_odd": Conv2dProblem.make("fprop", 2, 5, 17, 19, 40, 3, stride=2),
    "c6_rect_s2x1": Conv2dProblem.make("fprop", 2, 6, 20, 23, 64, 3, 5, stride=(2, 1), padding=(1, 2)),
    "c3_k96_dil2x1_bf16_f32": Conv2dProblem.make("fprop", 2, 3, 33, 35, 96, 7, stride=2, padding=3,
                                                 dilation=(2, 1), dtype="bf16", out_dtype="f32"),
    "dgrad_k34": Conv2dProblem.make("dgrad", 1, 7, 13, 11, 34, 3, padding=1),
    "dgrad_k12_dil2x1": Conv2dProblem.make("dgrad", 2, 5, 23, 21, 12, 3, padding=(2, 1), dilation=(2, 1)),
}


def pairs_of(p: Conv2dProblem):
    return [c for c in smem_im2col_candidates(p) if c.pairs]


def test_pairs_twins_come_where_the_problem_takes_them():
    """A pairs twin after each plain config where the rule holds; none on odd stride_w * C, dilation_w 2 or odd Q."""
    assert len(pairs_of(EVEN_STEM)) == len(SHAPES)
    assert len(pairs_of(EVEN_STEM.replace(kind=ConvKind.WGRAD, element_out=DType.F32))) == len(WGRAD_SHAPES)
    assert not pairs_of(Conv2dProblem.make("fprop", 1, 3, 30, 32, 64, 7, stride=1, padding=3))  # stride_w * C = 3
    assert not pairs_of(Conv2dProblem.make("fprop", 1, 2, 30, 32, 64, 3, padding=2, dilation=2))  # dilation_w 2
    assert not pairs_of(SMALL_STEM)  # wgrad with Q=17
    assert not pairs_of(layers.odd("dgrad", n=1))  # K=33 gathered, stride 1


@pytest.mark.parametrize("i", range(len(SHAPES)))
def test_every_fprop_pairs_config_on_a_small_stem(i):
    check(EVEN_STEM, pairs_of(EVEN_STEM)[i], seed=80 + i)


@pytest.mark.parametrize("case", list(PAIRS_CASES))
def test_fprop_and_dgrad_pairs_cases(case):
    p = PAIRS_CASES[case]
    cfgs = pairs_of(p)
    assert cfgs, f"{case}: no pairs config"
    check(p, cfgs[0], seed=90 + list(PAIRS_CASES).index(case))


def test_fprop_pairs_source_and_activation():
    p = EVEN_STEM.replace(epilogue=Epilogue(Activation.SILU, SourceKind.RESIDUAL))
    a, b, ref = operands(p, 99)
    src = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7)).to(TORCH[p.element_out]) \
        .contiguous(memory_format=torch.channels_last)
    ref = torch.nn.functional.silu(ref + src.double())
    out = torch.full(ref.shape, float("nan"), dtype=TORCH[p.element_out]).contiguous(memory_format=torch.channels_last)
    emulate_cuda.run(pairs_of(p)[0], p, a, b, out, source=src)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < TOLERANCE[p.element_out], err


def test_fprop_pairs_padding_taps_read_zero_whatever_x_holds():
    """The stem's filter rows have 21 taps, padded to 22: the padding tap of pixel q reads input column 2q + 4,
    channel 0 (7 columns from its window's first), outside its window. An Inf there must not reach pixel q's sums
    (its filter column is zero; 0 x Inf would be NaN): every output whose window misses the Inf stays finite and
    right."""
    p = EVEN_STEM
    a, b, _ = operands(p, 5)
    a[:, 0, :, 13] = float("inf")  # column 13: pixel q = 4's padding tap (2 * 4 - 3 + 8 = 13); windows of q 5..8 hold it
    geo = dict(stride=2, padding=3)
    ref = torch.nn.functional.conv2d(a.double(), b.double(), None, **geo)
    out = torch.full(ref.shape, float("nan"), dtype=TORCH[p.element_out]).contiguous(memory_format=torch.channels_last)
    emulate_cuda.run(pairs_of(p)[0], p, a, b, out)
    finite = torch.isfinite(ref)
    assert finite[..., 4].all() and not finite.all()
    assert torch.isfinite(out.double()[finite]).all(), "a padding tap read the Inf"
    err = float((out.double()[finite] - ref[finite]).norm() / ref[finite].norm())
    assert err < TOLERANCE[p.element_out], err


#: wgrad problems the pairs kernels take (Q even): the even stem in three types, two channel blocks, stride 3 on odd
#: sizes, and x's Inf read only by pixels past P and Q (whole pixel pairs past the output: a zero window).
PAIRS_WGRAD_CASES = {
    "stem_f32_out": EVEN_STEM.replace(kind=ConvKind.WGRAD, element_out=DType.F32),
    "stem_f16_out": EVEN_STEM.replace(kind=ConvKind.WGRAD, n=2),
    "stem_bf16_f32_out": Conv2dProblem.make("wgrad", 2, 3, 30, 32, 64, 7, stride=2, padding=3, dtype="bf16",
                                            out_dtype="f32"),
    "c3_k96_two_blocks": layers.SMEM_WGRAD_CASES["c3_k96_two_blocks"],
    "c5_3x3_s3_odd": layers.SMEM_WGRAD_CASES["c5_3x3_s3_odd"],
}


@pytest.mark.parametrize("i", range(len(WGRAD_SHAPES)))
def test_every_wgrad_pairs_config_on_a_small_stem(i):
    p = PAIRS_WGRAD_CASES["stem_f32_out"]
    check(p, pairs_of(p)[i], seed=110 + i)


@pytest.mark.parametrize("case", list(PAIRS_WGRAD_CASES)[1:])
def test_wgrad_pairs_cases(case):
    p = PAIRS_WGRAD_CASES[case]
    check(p, pairs_of(p)[0], seed=120 + list(PAIRS_WGRAD_CASES).index(case))


def test_wgrad_pairs_pixels_past_the_output_add_nothing_whatever_x_holds():
    """As the plain kernel's: whole pixel pairs past P and Q (Q=4 is even) read a zero window."""
    p = layers.INF_WGRAD
    for cfg in pairs_of(p)[:2]:
        check(p, cfg, seed=130, operands_of=with_inf)


def test_pairs_kernels_refuse_what_they_cannot_read():
    """cb_can_implement of the pairs kernels names the parameter: Q odd (wgrad), stride_w * C odd, dilation_w."""
    import dataclasses  # noqa: PLC0415

    wg = pairs_of(PAIRS_WGRAD_CASES["stem_f32_out"])[0]
    with pytest.raises(RuntimeError, match="Q=17 is odd"):
        check(SMALL_STEM, wg, seed=1)
    fp = pairs_of(EVEN_STEM)[0]
    with pytest.raises(RuntimeError, match="stride_w"):
        check(Conv2dProblem.make("fprop", 1, 3, 30, 32, 64, 7, stride=1, padding=3), fp, seed=1)
    with pytest.raises(RuntimeError, match="dilation"):
        check(Conv2dProblem.make("fprop", 1, 4, 30, 32, 64, 3, padding=2, dilation=2),
              dataclasses.replace(fp, tile=fp.tile), seed=1)
