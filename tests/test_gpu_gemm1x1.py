"""The 1x1-as-GEMM family (CUTLASS 3.x sm90 GEMM kernels) on an H100/H200: 1x1 fprop, dgrad and wgrad against a
float64 PyTorch reference, with every activation, bias and residual sources, 16-bit and fp32 outputs, stream-K and
split-k launches. Fresh random inputs per test; every output is filled with NaN first, so an element the kernel fails
to write shows up as an error.

The module compiles 14 GEMM kernels (~60 s each, in parallel: CUTLASS_BYOC_JOBS; 3 of them are the compile tests'
own), plus one 2.x kernel on demand (the misaligned-view fallback): run with ``CUTLASS_BYOC_TEST_CACHE_DIR``
pointing at a cache to reuse them.
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")

from cutlass_byoc import ops  # noqa: E402
from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.gemm1x1 import deep_twin, gemm1x1_config, with_epilogue_tile, with_store_stages  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.types import Activation, ConvKind, SourceKind  # noqa: E402

from gpu_util import (  # noqa: E402
    TOLERANCE, check_launch, epilogue_case, module_kernels, operands, poisoned_output, reference, rel_err, run_launch,
)
from test_compile_gemm1x1 import KERNELS as COMPILE_KERNELS  # noqa: E402

pytestmark = pytest.mark.gpu


def problem(kind, dtype="f16", out="f16", act=Activation.IDENTITY, source=SourceKind.NONE, n=3, c=64, hw=(7, 9), k=136):
    """A 1x1 layer whose GEMM M (N*H*W = 189) and channel counts are not multiples of the tiles."""
    return Conv2dProblem(kind=ConvKind(kind), n=n, h=hw[0], w=hw[1], c=c, k=k, r=1, s=1, element_a=dtype,
                         element_b=dtype, element_out=out, epilogue=Epilogue(act, source))


def cfg(kind, dtype, out, act, tile, schedule, cluster=(1, 1, 1), sourceless=False):
    return gemm1x1_config(problem(kind, dtype, out, act), tile, schedule, cluster, sourceless=sourceless)


#: The 22 kernels of this module: the compile tests' three (one per kind and schedule), five fprop kernels, one per
#: remaining activation, spread over the schedules, tiles, clusters and output types, two wgrad kernels with the
#: nondeterministic stream-K reduction, four sourceless kernels (one per kind, the fprop ones on two schedules), a
#: deep-pipeline wgrad twin, a 192-row fprop tile, three kernels with larger epilogue sub-tiles and three with one
#: epilogue D buffer per sub-tile.
KERNELS = {
    "fprop": COMPILE_KERNELS["fprop"][1],  # f16 -> f16 identity, cooperative
    "dgrad": COMPILE_KERNELS["dgrad"][1],  # bf16 -> bf16, ping-pong, cluster 2x1x1
    "wgrad": COMPILE_KERNELS["wgrad"][1],  # f16 -> f32, cooperative stream-K
    "relu": cfg("fprop", "f16", "f16", Activation.RELU, (128, 64, 64), "cooperative_streamk"),
    "gelu": cfg("fprop", "bf16", "f32", Activation.GELU, (64, 128, 64), "pingpong", (1, 2, 1)),
    "silu": cfg("fprop", "bf16", "bf16", Activation.SILU, (256, 64, 64), "cooperative"),
    "hardswish": cfg("fprop", "f16", "f32", Activation.HARDSWISH, (128, 128, 64), "pingpong"),
    "sigmoid": cfg("fprop", "f16", "f16", Activation.SIGMOID, (128, 128, 64), "cooperative_streamk", (2, 1, 1)),
    # the nondeterministic stream-K reduction (peers add their partials with atomics), 16-bit and fp32 outputs
    "wgrad_nd": cfg("wgrad", "f16", "f16", Activation.IDENTITY, (128, 64, 64), "cooperative_streamk_nd"),
    "wgrad_nd_f32": cfg("wgrad", "bf16", "f32", Activation.IDENTITY, (128, 128, 64), "cooperative_streamk_nd", (2, 1, 1)),
    # sourceless (CUTLASS's ElementC = void): what the candidates propose for problems without bias or residual
    "nosrc_fprop": cfg("fprop", "f16", "f16", Activation.IDENTITY, (256, 64, 64), "pingpong", sourceless=True),
    "nosrc_relu": cfg("fprop", "bf16", "f32", Activation.RELU, (128, 128, 64), "cooperative", (2, 1, 1), sourceless=True),
    "nosrc_dgrad": cfg("dgrad", "f16", "f16", Activation.IDENTITY, (128, 64, 64), "pingpong", sourceless=True),
    "nosrc_wgrad": cfg("wgrad", "f16", "f32", Activation.IDENTITY, (128, 64, 64), "cooperative_streamk", sourceless=True),
    # what the planner adds on top: a wgrad kernel's deep-pipeline twin (13 stages) and the 192-row whole-wave tile
    "deep_wgrad": deep_twin(cfg("wgrad", "f16", "f16", Activation.IDENTITY, (64, 64, 64), "pingpong", sourceless=True)),
    "wave_fprop": cfg("fprop", "f16", "f16", Activation.IDENTITY, (192, 64, 64), "pingpong", sourceless=True),
    # wider TMA epilogue sub-tiles than CUTLASS's automatic 64 x 32 / 128 x 32 (KernelConfig.epi_tile): a 192x64
    # ping-pong tile in three 64x64 stores, a cooperative kernel's 128x128 C/D sub-tiles, a ping-pong kernel's 64x64
    # ones with a source and an fp32 output
    "epi_wave": with_epilogue_tile(cfg("fprop", "f16", "f16", Activation.IDENTITY, (192, 64, 64), "pingpong",
                                       sourceless=True), (64, 64)),
    "epi_coop": with_epilogue_tile(cfg("dgrad", "f16", "f16", Activation.IDENTITY, (128, 256, 64), "cooperative"),
                                   (128, 128)),
    "epi_relu": with_epilogue_tile(cfg("fprop", "bf16", "f32", Activation.RELU, (128, 128, 64), "pingpong"), (64, 64)),
    # one epilogue D buffer per sub-tile (KernelConfig.epi_stages): the 192-row ping-pong tile's six stores in
    # flight, a cooperative dgrad's four 128x32 ones, and an fp32-output ReLU kernel's with 64x64 sub-tiles
    "stores_wave": with_store_stages(cfg("fprop", "f16", "f16", Activation.IDENTITY, (192, 64, 64), "pingpong",
                                         sourceless=True)),
    "stores_coop": with_store_stages(cfg("dgrad", "bf16", "bf16", Activation.IDENTITY, (128, 128, 64), "cooperative",
                                         sourceless=True)),
    "stores_relu": with_store_stages(with_epilogue_tile(cfg("fprop", "f16", "f32", Activation.RELU, (128, 128, 64),
                                                            "pingpong", sourceless=True), (64, 64))),
}


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    with module_kernels(shared_cache, lambda: KERNELS.values()):
        yield


def problem_for(name, source=SourceKind.NONE, **kw) -> Conv2dProblem:
    c = KERNELS[name]
    return problem(c.kind.value, c.element_a.value, c.element_out.value, c.activation, source, **kw)


def run(p: Conv2dProblem, name: str, seed: int, slices: int = 1, source_scale: float = 1.0):
    """(out, float64 reference) of `p` on kernel `name`, epilogue included."""
    return run_launch(p, LaunchConfig(KERNELS[name], slices), seed, source_scale)


def check(p: Conv2dProblem, name: str, seed: int, slices: int = 1):
    return check_launch(p, LaunchConfig(KERNELS[name], slices), seed)


SOURCES = [SourceKind.NONE, SourceKind.BIAS, SourceKind.RESIDUAL]


@pytest.mark.parametrize("name", ["fprop", "relu", "gelu", "silu", "hardswish", "sigmoid"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.value)
def test_fprop_epilogues_and_output_types(name, source):
    check(problem_for(name, source), name, seed=hash((name, source.value)) % 2**31)


@pytest.mark.parametrize("source", [SourceKind.NONE, SourceKind.RESIDUAL], ids=lambda s: s.value)
@pytest.mark.parametrize("name", ["dgrad", "wgrad"])
def test_dgrad_wgrad(name, source):
    check(problem_for(name, source), name, seed=hash((name, source.value)) % 2**31)


@pytest.mark.parametrize("name", ["nosrc_fprop", "nosrc_relu", "nosrc_dgrad", "nosrc_wgrad", "deep_wgrad", "wave_fprop",
                                  "stores_wave", "stores_coop", "stores_relu"])
def test_sourceless(name):
    """The sourceless kernels on their problems (no bias, no residual), at the module's odd shape and at layer
    shapes; the stream-K one at split-k slice counts too. A problem with a source is refused, never launched."""
    for shape in (dict(), dict(n=32, hw=(14, 14), c=256, k=1024), dict(n=2, hw=(56, 56), c=64, k=64)):
        check(problem_for(name, **shape), name, seed=3)
    if name == "nosrc_wgrad":
        p = problem_for(name, n=16, hw=(28, 28), c=64, k=64)
        for slices in (2, 8):
            check(p, name, seed=slices, slices=slices)
    kind = KERNELS[name].kind
    for source in ([SourceKind.BIAS, SourceKind.RESIDUAL] if kind is ConvKind.FPROP else [SourceKind.RESIDUAL]):
        p = problem_for(name, source)
        a, b, src, _ = epilogue_case(p, 0)
        with pytest.raises(ValueError, match="sourceless kernel reads no epilogue source"):
            ops.run_problem(p, a, b, poisoned_output(p), src, config=LaunchConfig(KERNELS[name]))


@pytest.mark.parametrize("shape", [dict(n=32, hw=(14, 14), c=256, k=1024), dict(n=1, hw=(1, 1), c=8, k=8),
                                   dict(n=2, hw=(56, 56), c=64, k=64)], ids=["256to1024", "tiny", "64ch"])
@pytest.mark.parametrize("name", ["fprop", "dgrad", "wgrad", "relu", "gelu"])
def test_layer_shapes(name, shape):
    check(problem_for(name, **shape), name, seed=11)


@pytest.mark.parametrize("name, source", [("wgrad", SourceKind.NONE), ("wgrad", SourceKind.RESIDUAL),
                                          ("relu", SourceKind.BIAS), ("sigmoid", SourceKind.RESIDUAL)])
def test_stream_k_and_split_k(name, source):
    """A reduction far longer than the output (wgrad of a 64x64 filter over N*H*W = 12544, or few output tiles for
    fprop): the stream-K heuristic (1 slice) and split-k slice counts, fp32 partials in the workspace, the epilogue
    (bias, residual, activation) applied once. The deterministic reduction repeats bit for bit."""
    kind = KERNELS[name].kind.value
    shape = dict(n=16, hw=(28, 28), c=64, k=64) if kind == "wgrad" else dict(n=2, hw=(16, 16), c=1024, k=128)
    p = problem_for(name, source, **shape)
    for slices in (1, 2, 3, 8):
        out = check(p, name, seed=slices, slices=slices)
        again, _ = run(p, name, seed=slices, slices=slices)
        assert torch.equal(out, again), f"{slices} slices: two runs differ (reduction not deterministic?)"


@pytest.mark.parametrize("name", ["wgrad_nd", "wgrad_nd_f32"])
@pytest.mark.parametrize("source", [SourceKind.NONE, SourceKind.RESIDUAL], ids=lambda s: s.value)
def test_nondeterministic_stream_k(name, source):
    """The nondeterministic reduction on wgrad shapes where many peers share one output tile: ResNet-50's first 1x1
    layer (64x64 filter over N*H*W = 100352: one 128x64 tile, every SM a peer), a 256x64 one, and a short reduction,
    over the stream-K heuristic and split-k slice counts. Every element written once, the epilogue applied once;
    repeated runs may differ only by the fp32 summation order's rounding."""
    for shape, slice_counts in ((dict(n=32, hw=(56, 56), c=64, k=64), (1, 16, 64, 256)),
                                (dict(n=32, hw=(56, 56), c=256, k=64), (1, 32)),
                                (dict(n=3, hw=(7, 9), c=64, k=136), (1, 2))):  # 189 pixels: 2 k tiles of 64 at most
        p = problem_for(name, source, **shape)
        for slices in slice_counts:
            out = check(p, name, seed=slices, slices=slices)
            again, ref = run(p, name, seed=slices, slices=slices)
            drift = rel_err(again, out.double())
            assert drift < TOLERANCE[p.element_out], f"{slices} slices: two runs {drift:.3e} apart"


def test_refusals_through_ops():
    strided = Conv2dProblem.make("fprop", 2, 64, 8, 8, 136, 1, stride=2)
    x, w, _ = operands(strided, 0)
    with pytest.raises(ops.UnsupportedConvError, match="strided 1x1 conv"):
        ops.run_problem(strided, x, w, poisoned_output(strided), config=LaunchConfig(KERNELS["fprop"]))
    p = problem_for("fprop")
    x, w, _ = operands(p, 0)
    with pytest.raises(ValueError, match="stream-K"):
        ops.run_problem(p, x, w, poisoned_output(p), config=LaunchConfig(KERNELS["fprop"], 2))


def test_offset_view_falls_back_to_2x():
    """A 2-byte-offset operand cannot be loaded by TMA: ops runs the problem on a 2.x kernel instead."""
    p = problem_for("fprop", c=64)
    x, w, _ = operands(p, 3)
    big = torch.randn(x.numel() + 1, device="cuda").to(x.dtype)
    xo = big[1:].view(p.n, p.h, p.w, p.c).permute(0, 3, 1, 2)  # channels_last view at a 2-byte offset
    xo.copy_(x)
    out = poisoned_output(p)
    ops.run_problem(p, xo, w, out, config=LaunchConfig(KERNELS["fprop"]))
    torch.cuda.synchronize()
    assert rel_err(out, reference(p, x, w, None)) < TOLERANCE[p.element_out]


@pytest.mark.parametrize("name", ["epi_wave", "epi_coop", "epi_relu"])
def test_epilogue_sub_tiles(name):
    """Kernels with larger TMA epilogue sub-tiles (KernelConfig.epi_tile) at the module's odd shape (partial tiles)
    and at layer shapes, with every source the kernel takes."""
    k = KERNELS[name]
    sources = [SourceKind.NONE] if k.sourceless else (
        SOURCES if k.kind is ConvKind.FPROP else [SourceKind.NONE, SourceKind.RESIDUAL])
    for source in sources:
        for shape in (dict(), dict(n=32, hw=(14, 14), c=256, k=1024), dict(n=2, hw=(56, 56), c=64, k=64)):
            check(problem_for(name, source, **shape), name, seed=hash((name, source.value)) % 2**31)
