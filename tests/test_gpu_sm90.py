"""The CUTLASS 3.x Hopper family on a GPU: fprop, dgrad and wgrad against a float64 PyTorch reference.

Needs an sm_90 GPU (H100/H200), torch and nvcc (each kernel compiles on first use, ~60 s; set
CUTLASS_BYOC_CACHE_DIR to reuse a cache). Every output is filled with NaN before the run, so an element the kernel
fails to write shows up as an error.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")

from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.ops import UnsupportedConvError, run_problem  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.sm90 import sm90_config  # noqa: E402
from cutlass_byoc.types import Activation, ConvKind, DType, SourceKind  # noqa: E402

from gpu_util import SM90_GPU  # noqa: E402

pytestmark = SM90_GPU

CL = torch.channels_last
TOL = {"f16": 1e-2, "bf16": 2e-2, "f32": 1e-2}


def _used_configs():
    """Every kernel this module launches (a config never depends on N, H, W, C), to compile them all at once."""
    base = dict(n=2, c=64, h=16, w=16, k=128, r=3, s=3, pad_h=1, pad_w=1)
    cfgs = []
    for kind in ConvKind:
        p = Conv2dProblem(kind=kind, **base)
        cfgs += [sm90_config(p, (128, 128, 64)), sm90_config(p, (64, 128, 64), (2, 1, 1))]
    p = Conv2dProblem.make("fprop", 2, 64, 16, 16, 128, 3, padding=1, dtype="bf16", out_dtype="f32")
    cfgs.append(sm90_config(p, (128, 128, 64)))
    p = Conv2dProblem.make("fprop", 2, 64, 16, 16, 128, 3, padding=1, epilogue=Epilogue(Activation.RELU))
    cfgs.append(sm90_config(p, (128, 128, 64)))
    # the sub-pixel strided dgrad (stride_support STRIDED), f16 and bf16 -> f32
    p = Conv2dProblem.make("dgrad", 2, 64, 16, 16, 128, 3, padding=1, stride=2)
    cfgs += [sm90_config(p, (128, 128, 64)), sm90_config(p, (64, 128, 64), (2, 1, 1))]
    p = Conv2dProblem.make("dgrad", 2, 64, 16, 16, 128, 3, padding=1, stride=2, dtype="bf16", out_dtype="f32")
    cfgs.append(sm90_config(p, (128, 128, 64)))
    return cfgs


@pytest.fixture(scope="module", autouse=True)
def _prebuilt():
    """Compile the module's kernels in parallel up front (CUTLASS_BYOC_JOBS; ~60 s and ~3.5 GB each); a kernel that
    fails to compile fails the tests that launch it, with nvcc's errors."""
    import os  # noqa: PLC0415

    from cutlass_byoc.build import build  # noqa: PLC0415

    if os.environ.get("CUTLASS_BYOC_TEST_NO_PREBUILD"):  # a carried, warm cache: compile only what is missing
        return
    build(_used_configs())


def rel_err(out, ref) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


def _torch_dtype(dtype: str):
    return getattr(torch, DType(dtype).torch_name)


def tensor(shape, dtype, scale=1.0):
    return (torch.randn(shape, device="cuda") * scale).to(_torch_dtype(dtype)).contiguous(memory_format=CL)


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=_torch_dtype(dtype)).contiguous(memory_format=CL)


def nchw(shape):
    """NHWC/KRSC shape -> the PyTorch (N, C, H, W) shape of the same tensor."""
    return (shape[0], shape[3], shape[1], shape[2])


def run(p: Conv2dProblem, tile=(128, 128, 64), cluster=(1, 1, 1), source=None):
    """Run `p` on the sm90 config with this tile; returns (out, a, b)."""
    cfg = sm90_config(p, tile, cluster)
    assert cfg.reject_reason(p) is None, cfg.reject_reason(p)
    a = tensor(nchw(p.a_shape), p.element_a.value)
    b = tensor(nchw(p.b_shape), p.element_b.value)
    out = poisoned(nchw(p.out_shape), p.element_out.value)
    run_problem(p, a, b, out, source, config=LaunchConfig(cfg))
    torch.cuda.synchronize()
    return out, a, b


def reference(p: Conv2dProblem, a, b):
    conv = dict(stride=(p.stride_h, p.stride_w), padding=(p.pad_h, p.pad_w), dilation=(p.dilation_h, p.dilation_w))
    a64, b64 = a.double().cpu(), b.double().cpu()
    if p.kind is ConvKind.FPROP:
        return torch.nn.functional.conv2d(a64, b64, **conv)
    if p.kind is ConvKind.DGRAD:
        return torch.nn.grad.conv2d_input((p.n, p.c, p.h, p.w), b64, a64, **conv)
    return torch.nn.grad.conv2d_weight(b64, (p.k, p.c, p.r, p.s), a64, **conv)


def check(p: Conv2dProblem, **kw):
    out, a, b = run(p, **kw)
    assert not torch.isnan(out).any(), "the kernel left output elements unwritten"
    err = rel_err(out, reference(p, a, b))
    assert err < TOL[p.element_out.value], f"{p.name}: relative error {err:.2e}"
    return err


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_basic(kind):
    check(Conv2dProblem.make(kind, 2, 64, 16, 16, 128, 3, padding=1))


@pytest.mark.parametrize("kind", ["fprop", "wgrad"])
def test_strided(kind):
    check(Conv2dProblem.make(kind, 2, 64, 17, 15, 64, 3, stride=2, padding=1))


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_odd_sizes_and_1x1(kind):
    # M and N not multiples of the tile; 1x1 filter without padding.
    check(Conv2dProblem.make(kind, 3, 24, 7, 9, 40, 1))


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_other_tiles_and_cluster(kind):
    p = Conv2dProblem.make(kind, 2, 64, 14, 14, 128, 3, padding=1)
    check(p, tile=(64, 128, 64), cluster=(2, 1, 1))


def test_bf16_fp32_output():
    check(Conv2dProblem.make("fprop", 2, 64, 16, 16, 128, 3, padding=1, dtype="bf16", out_dtype="f32"))


def test_fprop_relu():
    p = Conv2dProblem.make("fprop", 2, 64, 16, 16, 128, 3, padding=1, epilogue=Epilogue(Activation.RELU))
    out, a, b = run(p)
    ref = torch.relu(reference(p, a, b))
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2
    assert (out >= 0).all()


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_residual(kind):
    p = Conv2dProblem.make(kind, 2, 64, 16, 16, 128, 3, padding=1, epilogue=Epilogue(source=SourceKind.RESIDUAL))
    res = tensor(nchw(p.out_shape), p.element_out.value)
    out, a, b = run(p, source=res)
    ref = reference(p, a, b) + res.double().cpu()
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize(
    "tile, cluster, dtype, out_dtype, act",
    [((128, 128, 64), (1, 1, 1), "f16", "f16", Activation.IDENTITY),
     ((64, 128, 64), (2, 1, 1), "f16", "f16", Activation.IDENTITY),
     ((128, 128, 64), (1, 1, 1), "bf16", "f32", Activation.IDENTITY),
     ((128, 128, 64), (1, 1, 1), "f16", "f16", Activation.RELU)],
)
def test_fprop_bias(tile, cluster, dtype, out_dtype, act):
    """A per-output-channel bias: C read through a zero stride across M (the template's `bias_broadcast`)."""
    p = Conv2dProblem.make("fprop", 2, 64, 15, 13, 128, 3, padding=1, dtype=dtype, out_dtype=out_dtype,
                           epilogue=Epilogue(act, SourceKind.BIAS))
    bias = torch.randn(p.k, device="cuda").to(_torch_dtype(out_dtype))
    out, a, b = run(p, tile, cluster, source=bias)
    ref = torch.nn.functional.conv2d(a.double().cpu(), b.double().cpu(), bias.double().cpu(), padding=1)
    if act is Activation.RELU:
        ref = torch.relu(ref)
    assert not torch.isnan(out).any(), "the kernel left output elements unwritten"
    assert rel_err(out, ref) < TOL[out_dtype]


def test_wgrad_bias_is_refused():
    """No problem can ask for it (dgrad/wgrad take no bias); the raw library refuses source_kind 1 for wgrad."""
    import ctypes  # noqa: PLC0415

    from cutlass_byoc.runtime import load_kernel, make_args  # noqa: PLC0415

    p = Conv2dProblem.make("wgrad", 2, 64, 16, 16, 128, 3, padding=1)
    lib = load_kernel(sm90_config(p, (128, 128, 64)))._lib
    args = make_args(p, 1, 0x10000, 0x20000, 0x30000, 0x40000)
    args.source_kind = 1
    msg = ctypes.create_string_buffer(512)
    assert lib.cb_can_implement(ctypes.byref(args), msg, len(msg)) and b"bias" in msg.value


@pytest.mark.parametrize("n, c, h, w, k, r, s, stride, pad", [
    (2, 64, 16, 16, 128, 3, 3, 2, 1),     # ResNet's 3x3 stride 2: phases of 1, 2, 2, 4 taps
    (3, 64, 17, 15, 64, 3, 3, 2, 1),      # odd H and W: phases of unequal rows
    (2, 256, 14, 14, 128, 1, 1, 2, 0),    # 1x1 stride 2: one phase, a memset of dx for the three of zeros
    (3, 128, 15, 13, 64, 1, 1, 2, 0),     # the same over odd H and W
    (2, 64, 12, 12, 64, 1, 1, 3, 0),      # 1x1 stride 3: nine phases, one with taps, launched alone after the memset
    (2, 64, 13, 11, 64, 5, 5, 2, 2),
    (2, 64, 13, 10, 64, 3, 3, 3, 1),      # stride 3: nine phases
    (2, 64, 15, 14, 64, 3, 3, (2, 1), 1),  # stride 2 along H only
    (4, 128, 7, 7, 64, 3, 3, 2, 1),       # ResNet's last stage: 7x7 dx
])
def test_subpixel_strided_dgrad(n, c, h, w, k, r, s, stride, pad):
    """The 3.x dgrad kernel ignores the stride; the STRIDED config launches it once per phase of dx (sub-pixel)."""
    p = Conv2dProblem.make("dgrad", n, c, h, w, k, r, s, stride=stride, padding=pad)
    cfg = sm90_config(p, (128, 128, 64))
    assert cfg.stride_support.value == "strided"
    check(p)


def test_subpixel_other_tile_cluster_and_bf16_fp32_output():
    check(Conv2dProblem.make("dgrad", 2, 64, 16, 16, 128, 3, stride=2, padding=1), tile=(64, 128, 64), cluster=(2, 1, 1))
    check(Conv2dProblem.make("dgrad", 2, 64, 17, 16, 128, 3, stride=2, padding=1, dtype="bf16", out_dtype="f32"))


def test_subpixel_residual():
    """Every phase reached (3x3 stride 2): the residual is read through the same strided view as dx."""
    p = Conv2dProblem.make("dgrad", 2, 64, 15, 16, 128, 3, stride=2, padding=1,
                           epilogue=Epilogue(source=SourceKind.RESIDUAL))
    res = tensor(nchw(p.out_shape), p.element_out.value)
    out, a, b = run(p, source=res)
    assert not torch.isnan(out).any()
    assert rel_err(out, reference(p, a, b) + res.double().cpu()) < 1e-2


def replays_under_cuda_graph(p: Conv2dProblem, cfg):
    """`cfg` on `p` captured once (after one call outside the capture, which sets the kernel's attributes) and
    replayed twice on new inputs into a poisoned output, against the float64 reference each time."""
    a, b = tensor(nchw(p.a_shape), "f16"), tensor(nchw(p.b_shape), "f16")
    out = poisoned(nchw(p.out_shape), "f16")
    run_problem(p, a, b, out, config=LaunchConfig(cfg))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        run_problem(p, a, b, out, config=LaunchConfig(cfg))
    for _ in range(2):
        a.copy_(tensor(nchw(p.a_shape), "f16"))
        b.copy_(tensor(nchw(p.b_shape), "f16"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        assert rel_err(out, reference(p, a, b)) < 1e-2


def test_subpixel_under_cuda_graph_capture():
    """The phases' launches and the zero-fill are stream work only: captured once, replayed on new dy and w."""
    p = Conv2dProblem.make("dgrad", 2, 256, 14, 14, 128, 1, stride=2)  # one phase and a memset
    replays_under_cuda_graph(p, sm90_config(p, (128, 128, 64)))


def test_unity_dgrad_kernel_refuses_a_stride():
    p = Conv2dProblem.make("dgrad", 2, 64, 16, 16, 64, 3, padding=1, stride=2)
    cfg = sm90_config(p.replace(stride_h=1, stride_w=1), (128, 128, 64))
    a, b = tensor(nchw(p.a_shape), "f16"), tensor(nchw(p.b_shape), "f16")
    with pytest.raises(UnsupportedConvError, match="stride"):
        run_problem(p, a, b, poisoned(nchw(p.out_shape), "f16"), config=LaunchConfig(cfg))


@pytest.mark.parametrize("dilation, pad", [(2, 2), (3, 3), (2, 0)])
def test_dilated_unity_stride_dgrad(dilation, pad):
    """The 3.x dgrad collective applies dilation (it negates it for dgrad's gbasis strides): stride-1 dilated
    dgrad runs on the same compiled kernel as undilated dgrad (a config never depends on the dilation)."""
    check(Conv2dProblem.make("dgrad", 3, 64, 13, 11, 128, 3, padding=pad, dilation=dilation))
