"""The project's persistent ping-pong kernel for CUTLASS 3.x conv (sm90.PINGPONG) on a GPU, against a float64
PyTorch reference and against CUTLASS's own one-tile-per-CTA conv kernel on the same collectives.

The problems are large enough that the persistent grid (one CTA per SM) walks several tiles per CTA and both
consumer warp groups take turns; others leave partial tiles along M and N. Outputs are filled with NaN first, so an
element the kernel fails to write shows up as an error. Needs an sm_90 GPU; kernels compile on first use unless
CUTLASS_BYOC_CACHE_DIR holds them (scripts/warm_cache.py --modules sm90_pingpong).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")

from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.ops import run_problem  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.sm90 import PINGPONG, SCHEDULE, sm90_config  # noqa: E402
from cutlass_byoc.types import Activation, SourceKind  # noqa: E402

import test_gpu_sm90  # noqa: E402
from test_gpu_sm90 import nchw, poisoned, reference, rel_err, replays_under_cuda_graph, tensor, TOL  # noqa: E402

pytestmark = test_gpu_sm90.pytestmark  # gpu, and skipped without an sm_90 device

#: ResNet-50's first-stage 3x3 conv at batch 16: 50176 output pixels, 392 tiles of 128x64 (fprop, dgrad), about three
#: per CTA of the persistent grid (132 SMs on an H200), so both consumer groups take several turns.
STAGE1 = dict(n=16, c=64, h=56, w=56, k=64, r=3, s=3, padding=1)
#: Partial tiles along M (3 * 9 * 11 = 297 pixels) and N (40 channels), a 1x1 filter.
ODD = dict(n=3, c=24, h=9, w=11, k=40, r=1, s=1)
#: The second stage's 3x3 conv: 25088 pixels, 196 tiles of 128x128.
STAGE2 = dict(n=32, c=128, h=28, w=28, k=128, r=3, s=3, padding=1)
#: A wgrad of many tiles: 512 x (3 * 3 * 512) is 576 tiles of 64x64, over a short N*P*Q = 98 reduction.
WIDE = dict(n=2, c=512, h=7, w=7, k=512, r=3, s=3, padding=1)


def _problem(kind, dims, **kw):
    d = dict(dims)
    padding = d.pop("padding", 0)
    return Conv2dProblem.make(kind, d["n"], d["c"], d["h"], d["w"], d["k"], d["r"], d["s"], padding=padding, **kw)


#: (test id, problem, tile, cluster) of every ping-pong launch the module checks against the reference.
CASES = [
    *[(f"{kind}-stage1-128x64", _problem(kind, STAGE1), (128, 64, 64), (1, 1, 1)) for kind in ("fprop", "dgrad")],
    ("wgrad-stage1-64x64", _problem("wgrad", STAGE1), (64, 64, 64), (1, 1, 1)),
    ("wgrad-wide-64x64", _problem("wgrad", WIDE), (64, 64, 64), (1, 1, 1)),
    ("wgrad-wide-cluster2", _problem("wgrad", WIDE), (64, 64, 64), (2, 1, 1)),
    ("fprop-stage1-256x64", _problem("fprop", STAGE1), (256, 64, 64), (1, 1, 1)),
    *[(f"{kind}-stage2-128x128", _problem(kind, STAGE2), (128, 128, 64), (1, 1, 1)) for kind in ("fprop", "dgrad")],
    *[(f"{kind}-odd-1x1", _problem(kind, ODD), (128, 64, 64), (1, 1, 1)) for kind in ("fprop", "dgrad")],
    ("wgrad-odd-1x1", _problem("wgrad", ODD), (64, 64, 64), (1, 1, 1)),
    *[(f"{kind}-stage1-cluster2", _problem(kind, STAGE1), (128, 64, 64), (2, 1, 1)) for kind in ("fprop", "dgrad")],
    ("fprop-strided", Conv2dProblem.make("fprop", 8, 64, 57, 55, 128, 3, stride=2, padding=1), (128, 64, 64),
     (1, 1, 1)),
    ("fprop-bf16-f32", _problem("fprop", STAGE1, dtype="bf16", out_dtype="f32"), (128, 64, 64), (1, 1, 1)),
    ("wgrad-f16-f32", _problem("wgrad", STAGE1, out_dtype="f32"), (64, 64, 64), (1, 1, 1)),
]

#: Strided dgrads (the sub-pixel decomposition: one stride-1 phase per (row, column) offset of dx, their tiles walked as
#: one list by the ping-pong kernel): ResNet's 3x3 stride 2 (4 phases of 1, 2, 2 and 4 taps), odd H and W, 1x1
#: stride 2 (one live phase, dx zero-filled first), stride 3 (9 phases: three launches of up to 4), stride 2 along H
#: only, and bf16 in / fp32 out.
SUBPIXEL = [
    ("3x3-s2", Conv2dProblem.make("dgrad", 8, 128, 56, 56, 128, 3, stride=2, padding=1)),
    ("3x3-s2-odd", Conv2dProblem.make("dgrad", 3, 64, 17, 15, 64, 3, stride=2, padding=1)),
    ("1x1-s2", Conv2dProblem.make("dgrad", 8, 256, 56, 56, 512, 1, stride=2)),
    ("3x3-s3", Conv2dProblem.make("dgrad", 2, 64, 13, 10, 64, 3, stride=3, padding=1)),
    ("3x3-s2x1", Conv2dProblem.make("dgrad", 2, 64, 15, 14, 64, 3, stride=(2, 1), padding=1)),
    ("bf16-f32", Conv2dProblem.make("dgrad", 4, 64, 28, 28, 128, 3, stride=2, padding=1, dtype="bf16",
                                    out_dtype="f32")),
]
SUBPIXEL_RESIDUAL = Conv2dProblem.make("dgrad", 4, 128, 29, 28, 128, 3, stride=2, padding=1,
                                       epilogue=Epilogue(source=SourceKind.RESIDUAL))

RELU = _problem("fprop", STAGE1, epilogue=Epilogue(Activation.RELU))
RESIDUAL = {kind: _problem(kind, STAGE1, epilogue=Epilogue(source=SourceKind.RESIDUAL)) for kind in ("fprop", "dgrad")}
BIAS = _problem("fprop", STAGE1, epilogue=Epilogue(Activation.RELU, SourceKind.BIAS))


def used_configs():
    """Every kernel this module launches (ping-pong ones, and CUTLASS's one-tile-per-CTA twins of two of them)."""
    cfgs = [sm90_config(p, tile, cluster, schedule=PINGPONG) for _, p, tile, cluster in CASES]
    cfgs += [sm90_config(p, (128, 64, 64), schedule=PINGPONG) for p in (RELU, BIAS, *RESIDUAL.values())]
    cfgs += [sm90_config(_problem(kind, STAGE2), (128, 128, 64), schedule=SCHEDULE) for kind in ("fprop", "dgrad")]
    cfgs += [sm90_config(p, (128, 128, 64), schedule=PINGPONG) for _, p in SUBPIXEL]
    cfgs += [sm90_config(SUBPIXEL[0][1], (128, 128, 64), schedule=SCHEDULE)]
    return list(dict.fromkeys(cfgs))


@pytest.fixture(scope="module", autouse=True)
def _prebuilt():
    import os  # noqa: PLC0415

    from cutlass_byoc.build import build  # noqa: PLC0415

    if os.environ.get("CUTLASS_BYOC_TEST_NO_PREBUILD"):  # a carried, warm cache: compile only what is missing
        return
    build(used_configs())


def run(p: Conv2dProblem, tile, cluster=(1, 1, 1), schedule=PINGPONG, source=None, inputs=None):
    cfg = sm90_config(p, tile, cluster, schedule=schedule)
    assert cfg.schedule == schedule and cfg.reject_reason(p) is None, cfg.reject_reason(p)
    a, b = inputs or (tensor(nchw(p.a_shape), p.element_a.value), tensor(nchw(p.b_shape), p.element_b.value))
    out = poisoned(nchw(p.out_shape), p.element_out.value)
    run_problem(p, a, b, out, source, config=LaunchConfig(cfg))
    torch.cuda.synchronize()
    return out, a, b


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_reference(case):
    _, p, tile, cluster = case
    out, a, b = run(p, tile, cluster)
    assert not torch.isnan(out).any(), "the kernel left output elements unwritten"
    err = rel_err(out, reference(p, a, b))
    assert err < TOL[p.element_out.value], f"{p.name}: relative error {err:.2e}"


@pytest.mark.parametrize("kind", ["fprop", "dgrad"])
def test_same_bits_as_cutlass_kernel(kind):
    """The same collectives on the same tile: each output tile's sum runs in the same order, so the persistent
    kernel's output equals CUTLASS's one-tile-per-CTA kernel's bit for bit."""
    p = _problem(kind, STAGE2)
    out, a, b = run(p, (128, 128, 64))
    ref, _, _ = run(p, (128, 128, 64), schedule=SCHEDULE, inputs=(a, b))
    assert not torch.isnan(out).any()
    assert torch.equal(out, ref)


def test_relu():
    out, a, b = run(RELU, (128, 64, 64))
    assert not torch.isnan(out).any()
    assert rel_err(out, torch.relu(reference(RELU, a, b))) < 1e-2
    assert (out >= 0).all()


@pytest.mark.parametrize("kind", ["fprop", "dgrad"])
def test_residual(kind):
    """C through the producer group's epilogue load warp, started after the mainloop warp's first tile."""
    p = RESIDUAL[kind]
    res = tensor(nchw(p.out_shape), p.element_out.value)
    out, a, b = run(p, (128, 64, 64), source=res)
    assert not torch.isnan(out).any()
    assert rel_err(out, reference(p, a, b) + res.double().cpu()) < 1e-2


def test_bias_relu():
    bias = torch.randn(BIAS.k, device="cuda").half()
    out, a, b = run(BIAS, (128, 64, 64), source=bias)
    ref = torch.relu(torch.nn.functional.conv2d(a.double().cpu(), b.double().cpu(), bias.double().cpu(), padding=1))
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2


def test_under_cuda_graph_capture():
    """One launch, no host sync, no allocation: captured once, replayed on new inputs."""
    p = _problem("fprop", STAGE1)
    replays_under_cuda_graph(p, sm90_config(p, (128, 64, 64), schedule=PINGPONG))


@pytest.mark.parametrize("case", SUBPIXEL, ids=[c[0] for c in SUBPIXEL])
def test_subpixel_strided_dgrad(case):
    _, p = case
    cfg = sm90_config(p, (128, 128, 64), schedule=PINGPONG)
    assert cfg.stride_support.value == "strided"
    out, a, b = run(p, (128, 128, 64))
    assert not torch.isnan(out).any(), "the kernel left output elements unwritten"
    err = rel_err(out, reference(p, a, b))
    assert err < TOL[p.element_out.value], f"{p.name}: relative error {err:.2e}"


def test_subpixel_same_bits_as_cutlass_grouped_kernel():
    """The phases' tiles on the persistent kernel sum in the same order as on CUTLASS's kernel in the grouped
    one-tile-per-CTA launch: the same dx bit for bit."""
    p = SUBPIXEL[0][1]
    out, a, b = run(p, (128, 128, 64))
    ref, _, _ = run(p, (128, 128, 64), schedule=SCHEDULE, inputs=(a, b))
    assert not torch.isnan(out).any()
    assert torch.equal(out, ref)


def test_subpixel_residual():
    """Every phase reached (3x3 stride 2): each phase's C through its own view of the residual, loaded by the epilogue
    warp for the tiles of every phase."""
    p = SUBPIXEL_RESIDUAL
    res = tensor(nchw(p.out_shape), p.element_out.value)
    out, a, b = run(p, (128, 128, 64), source=res)
    assert not torch.isnan(out).any()
    assert rel_err(out, reference(p, a, b) + res.double().cpu()) < 1e-2


def test_subpixel_under_cuda_graph_capture():
    """The zero-fill and the grouped launch are stream work only: captured once, replayed on new dy and w."""
    p = SUBPIXEL[2][1]  # 1x1 stride 2: a memset, then one phase
    replays_under_cuda_graph(p, sm90_config(p, (128, 128, 64), schedule=PINGPONG))
