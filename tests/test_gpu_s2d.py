"""Space-to-depth launches (issue 11, part 3: the stem) on the H200: the RGB stem (3->64 7x7 stride 2) folded into
a 4x4 stride-1 conv over 12 channels (16 padded) in fprop, dgrad and wgrad, on every kernel the planner offers the
fold at batch 32 (the kernels `cutlass-byoc tune` times, so the round's tune compiles none of them again), at the
split-k counts it offers; the same for the 1x1 stride-2 downsampling conv (a subsample, then a GEMM); plus the fold with epilogues (fprop bias + ReLU and residual, wgrad accumulating into an
fp16 and an fp32 output). Against the float64 reference on fresh random inputs, outputs poisoned (NaN) first.
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from cutlass_byoc.config import LaunchConfig, fold_phases, s2d_problem  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.profiler.plan import plan_problem  # noqa: E402
from cutlass_byoc.types import Activation, SourceKind  # noqa: E402

import layers  # noqa: E402
from gpu_util import check_launch, module_kernels, pick  # noqa: E402

pytestmark = pytest.mark.gpu

BATCH = 4


stem = functools.partial(layers.stem, n=BATCH)


def down(kind, n=BATCH, **kw):
    """ResNet-50's first downsampling shortcut (1x1 stride 2): its fold is a subsample, then a GEMM."""
    return Conv2dProblem.make(kind, n, 256, 56, 56, 512, 1, stride=2, **kw)


LAYERS = {"stem": stem, "down": down}


def planned(kind: str, layer: str = "stem") -> list[LaunchConfig]:
    """The fold's launches the planner offers for the layer at batch 32 (a kernel never depends on the batch)."""
    out = []
    for c in plan_problem(LAYERS[layer](kind, n=32)).candidates:
        if c.launch.s2d > 1:
            out.append(c.launch)
    return list(dict.fromkeys(out))


def epilogue_launches() -> list[tuple[Conv2dProblem, LaunchConfig]]:
    """The fold with epilogue sources, on the fixed 2.x pick for the folded problem (C=12, unpadded)."""
    out = []
    for ep in (Epilogue(Activation.RELU, SourceKind.BIAS), Epilogue(source=SourceKind.RESIDUAL)):
        p = stem("fprop", epilogue=ep)
        out.append((p, LaunchConfig(pick(s2d_problem(p, 2)), s2d=2)))
    for o in ("f16", "f32"):
        p = stem("wgrad", out_dtype=o, epilogue=Epilogue(source=SourceKind.RESIDUAL))
        out.append((p, LaunchConfig(pick(s2d_problem(p, 2).replace(c=16)), pad_c=8, s2d=2)))
    return out


def used_configs():
    """Every kernel this module launches (scripts/warm_cache.py compiles them beforehand)."""
    kernels = [l.kernel for layer in LAYERS for kind in ("fprop", "dgrad", "wgrad") for l in planned(kind, layer)]
    kernels += [l.kernel for _, l in epilogue_launches()]
    return list(dict.fromkeys(kernels))


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    with module_kernels(shared_cache, used_configs):
        yield


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_every_planned_fold_of_the_stem(kind):
    p = stem(kind)
    ls = [l for l in planned(kind) if l.reject_reason(p) is None]
    assert ls, "the planner offered no space-to-depth launch"
    assert {l.kernel_problem(p).c for l in ls} == {12, 16}
    for i, launch in enumerate(ls):
        check_launch(p, launch, seed=400 + i)


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_every_planned_fold_of_the_downsampling_1x1(kind):
    p = down(kind)
    ls = [l for l in planned(kind, "down") if l.reject_reason(p) is None]
    assert ls, "the planner offered no space-to-depth launch"
    assert all(l.kernel_problem(p).c == 256 and l.kernel_problem(p).h == 28 for l in ls)  # a subsample
    for i, launch in enumerate(ls):
        check_launch(p, launch, seed=500 + i)


@pytest.mark.parametrize("case", [0, 1, 2, 3], ids=["fprop_bias_relu", "fprop_residual", "wgrad_f16_accumulate",
                                                    "wgrad_f32_accumulate"])
def test_fold_with_epilogues(case):
    """fprop's bias + ReLU and residual, wgrad accumulating into an fp16 and an fp32 output (the residual source)."""
    p, launch = epilogue_launches()[case]
    check_launch(p, launch, seed=10 + case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_triton_rewrites_match_the_view_copies(monkeypatch, dtype):
    """On the GPU the rewrites run as Triton kernels (cutlass_byoc.rewrite); they must equal the PyTorch view copies
    (the CPU path) bit for bit: folds of images and filters (odd sizes, padding, crop), their inverses, channel
    padding and unpadding."""
    from cutlass_byoc import rewrite  # noqa: PLC0415

    if rewrite._triton_kernels() is None:
        pytest.skip("Triton is not installed: the rewrites run as PyTorch copies")
    cl = torch.channels_last
    g = torch.Generator(device="cuda").manual_seed(12)

    def rnd(*shape):
        return torch.randn(shape, generator=g, device="cuda").to(dtype).contiguous(memory_format=cl)

    def both(fn):
        fast = fn()
        with monkeypatch.context() as m:
            m.setattr(rewrite, "_fast", lambda *ts: False)
            slow = fn()
        return fast, slow

    for (c, h, w, k, r, blk, pad) in [(3, 224, 224, 64, 7, 2, 3), (3, 15, 17, 5, 7, 2, 3), (3, 11, 11, 4, 2, 2, 0),
                                      (3, 14, 13, 4, 5, 3, 2), (1, 17, 17, 3, 8, 4, 2), (24, 13, 13, 8, 1, 2, 0)]:
        p = Conv2dProblem.make("fprop", 2, c, h, w, k, r, stride=blk, padding=pad)
        f = s2d_problem(p, blk)
        ph = fold_phases(r, r, blk)
        for c_to in (f.c, f.c + 4):
            x, wt = rnd(2, c, h, w), rnd(k, c, r, r)
            a, b = both(lambda: rewrite.s2d_image(x, blk, pad, pad, f.h, f.w, c_to, ph))
            assert torch.equal(a, b)
            a, b = both(lambda: rewrite.s2d_filter(wt, blk, c_to, k + 3))
            assert torch.equal(a, b)
            xs, ws = rnd(2, c_to, f.h, f.w), rnd(k + 3, c_to, f.r, f.s)

            def unfolded(fn, shape, src):
                out = torch.full(shape, float("nan"), device="cuda", dtype=dtype).contiguous(memory_format=cl)
                fn(src, out)
                return out
            a, b = both(lambda: unfolded(lambda s, o: rewrite.d2s_image(s, blk, pad, pad, o, ph), (2, c, h, w), xs))
            assert torch.equal(a, b) and not torch.isnan(a).any()
            a, b = both(lambda: unfolded(lambda s, o: rewrite.d2s_filter(s, blk, o), (k, c, r, r), ws))
            assert torch.equal(a, b) and not torch.isnan(a).any()
    t = rnd(3, 7, 56, 56)
    a, b = both(lambda: rewrite.pad_channels(t, 5, 8))
    assert torch.equal(a, b)
    out = torch.full((3, 7, 56, 56), float("nan"), device="cuda", dtype=dtype).contiguous(memory_format=cl)
    rewrite.unpad_channels(a, out)
    assert torch.equal(out, t)
