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
from cutlass_byoc.problem import Conv2dProblem  # noqa: E402
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


def test_wgrad_pixels_past_the_output_add_nothing_whatever_x_holds():
    """10x10 in, 3x3 stride 2 without padding: 4x4 out, and x's last row and column (Inf here) read by no output
    pixel, but by the pixels past P and Q of the kernel's 8x16 tile, which must read a zero window instead."""
    p = layers.INF_WGRAD

    def with_inf(problem, seed):
        a, b, ref = operands(problem, seed)
        b[:, :, -1, :] = float("inf")
        b[:, :, :, -1] = float("inf")
        return a, b, ref

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
