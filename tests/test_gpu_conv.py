"""GPU correctness of fprop, dgrad and wgrad against float64 PyTorch, outputs poisoned with NaN first (issue 2)."""

from __future__ import annotations

import itertools
import math

import pytest

torch = pytest.importorskip("torch")

from cutlass_byoc import ops  # noqa: E402
from cutlass_byoc.candidates import sm80_candidates  # noqa: E402
from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.runtime import load_kernel  # noqa: E402
from cutlass_byoc.types import Activation, ConvKind, IteratorAlgorithm, SourceKind, SplitKMode  # noqa: E402

from gpu_util import (  # noqa: E402
    TOLERANCE, TORCH, kernel_operands, module_kernels, operands, pick, poisoned_output, reference, rel_err,
)

pytestmark = pytest.mark.gpu

# name, N, C, H(=W), K, R(=S), stride, pad
LAYERS = [
    ("3x3_b1", 1, 64, 56, 64, 3, 1, 1),
    ("1x1_b32", 32, 64, 56, 256, 1, 1, 0),
    ("3x3_s2_b32", 32, 128, 56, 128, 3, 2, 1),
    ("1x1_s2_b32", 32, 256, 28, 512, 1, 2, 0),
    ("stem_7x7_s2_b32", 32, 3, 224, 64, 7, 2, 3),
    ("7x7_pad3_b1", 1, 16, 20, 32, 7, 1, 3),
    ("odd_7to33_b32", 32, 7, 56, 33, 3, 1, 1),
    ("odd_7to33_s2_pad0_b1", 1, 7, 15, 33, 3, 2, 0),
]
DTYPES = [("f16", "f16"), ("f16", "f32"), ("bf16", "bf16"), ("bf16", "f32"), ("f32", "f32")]
CASES = [
    (kind, layer, dt)
    for kind, layer, dt in itertools.product(ConvKind, LAYERS, DTYPES)
    # the whole dtype matrix on four layers, fp16 on all of them
    if dt == ("f16", "f16") or layer[0] in ("3x3_b1", "3x3_s2_b32", "stem_7x7_s2_b32", "odd_7to33_b32")
]


def make_problem(kind, layer, dt, **kw) -> Conv2dProblem:
    _, n, c, h, k, r, stride, pad = layer
    return Conv2dProblem.make(kind, n, c, h, h, k, r, stride=stride, padding=pad, dtype=dt[0], out_dtype=dt[1], **kw)


EPILOGUES = [Epilogue(Activation.RELU, SourceKind.BIAS), Epilogue(Activation.RELU, SourceKind.RESIDUAL),
             Epilogue(Activation.SILU), Epilogue(Activation.GELU), Epilogue(Activation.HARDSWISH),
             Epilogue(Activation.SIGMOID), Epilogue(Activation.IDENTITY, SourceKind.BIAS)]
EPI_LAYER = ("3x3", 8, 64, 28, 64, 3, 1, 1)
SPLIT_PROBLEMS = [make_problem(kind, ("3x3_14", 32, 256, 14, 256, 3, 1, 1), ("f16", "f16")) for kind in (ConvKind.FPROP, ConvKind.DGRAD)]
# Split-k under each activation: serial slices (fp32 output: the only one serial split-k takes) must skip the
# activation on every slice but the last, parallel split-k applies it once in the reduction (fp16 output).
SPLIT_ACTIVATIONS = [Activation.RELU, Activation.SILU, Activation.GELU, Activation.HARDSWISH, Activation.SIGMOID]
SPLIT_ACT_LAYER = ("3x3_14_c128", 8, 128, 14, 128, 3, 1, 1)
SPLIT_ACT_OUT = {SplitKMode.SERIAL: ("f16", "f32"), SplitKMode.PARALLEL: ("f16", "f16")}


def split_act_problem(activation, mode, source=SourceKind.NONE):
    return make_problem("fprop", SPLIT_ACT_LAYER, SPLIT_ACT_OUT[mode], epilogue=Epilogue(activation, source))


# stride-1 dilated dgrad (DeepLab-style): (layer, dilation, dtype, iterator): odd channels, bf16, both iterators
DILATED_DGRAD = [
    (("d2_c16_k32", 4, 16, 21, 32, 3, 1, 2), 2, ("f16", "f16"), IteratorAlgorithm.OPTIMIZED),
    (("d2_c16_k32", 4, 16, 21, 32, 3, 1, 2), 2, ("f16", "f16"), IteratorAlgorithm.ANALYTIC),
    (("d3_c7_k33", 3, 7, 19, 33, 3, 1, 3), 3, ("f16", "f16"), None),
    (("d3_c24_k40", 2, 24, 17, 40, 3, 1, 3), 3, ("bf16", "bf16"), IteratorAlgorithm.OPTIMIZED),
    (("d2_c24_k40_pad1", 2, 24, 17, 40, 5, 1, 1), 2, ("bf16", "f32"), IteratorAlgorithm.ANALYTIC),
]


def dilated_config(layer, dilation, dt, iterator):
    problem = make_problem("dgrad", layer, dt, dilation=dilation)
    if iterator is None:
        return problem, pick(problem)
    return problem, next(c for c in sm80_candidates(problem, split_k=False)
                         if c.iterator is iterator and c.tile == (64, 64, 32))


STRIDED_DGRAD_VARIANTS = [  # (layer, iterator) beyond CASES: the alignments and iterators strided dgrad runs with
    (("s2_c6_k10", 4, 6, 20, 10, 3, 2, 1), None),
    (("s2_c12_k20", 4, 12, 20, 20, 3, 2, 1), None),
    (("s2_c64_k64", 4, 64, 20, 64, 3, 2, 1), IteratorAlgorithm.ANALYTIC),
    (("s2_c64_k64", 4, 64, 20, 64, 3, 2, 1), IteratorAlgorithm.OPTIMIZED),
]


def config_for(problem):
    """The fixed pick, or None where only a channel-padded launch computes the problem (strided dgrad of odd channel
    counts): ops then runs the model's padded default."""
    return pick(problem) if next(sm80_candidates(problem), None) is not None else None


def variant_config(layer, iterator):
    problem = make_problem("dgrad", layer, ("f16", "f16"))
    if iterator is None:
        return problem, pick(problem)
    return problem, next(c for c in sm80_candidates(problem) if c.iterator is iterator and c.tile == (64, 64, 32))


def all_configs():
    cfgs = [config_for(make_problem(kind, layer, dt)) for kind, layer, dt in CASES]
    cfgs = [c for c in cfgs if c is not None]
    cfgs += [variant_config(*v)[1] for v in STRIDED_DGRAD_VARIANTS]
    cfgs += [dilated_config(*v)[1] for v in DILATED_DGRAD]
    cfgs += [pick(make_problem("fprop", EPI_LAYER, ("f16", "f16"), epilogue=e)) for e in EPILOGUES]
    cfgs += [pick(make_problem("fprop", EPI_LAYER, ("f16", "f32"), epilogue=EPILOGUES[0]))]
    cfgs += [pick(p, m) for p in SPLIT_PROBLEMS for m in (SplitKMode.SERIAL, SplitKMode.PARALLEL)]
    cfgs += [pick(split_act_problem(a, m), m) for a in SPLIT_ACTIVATIONS for m in SPLIT_ACT_OUT
             if not (a is Activation.RELU and m is SplitKMode.SERIAL)]  # refused (below)
    return cfgs


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    with module_kernels(shared_cache, all_configs):
        yield


def epilogue_source(problem, ref):
    """The epilogue's random source (a bias vector, a residual tensor, or None) and the float64 result `ref` with the
    problem's epilogue applied."""
    out_t = TORCH[problem.element_out]
    source = None
    if problem.epilogue.source is SourceKind.BIAS:
        source = torch.randn(problem.k, device="cuda").to(out_t)
        ref = ref + source.double().view(1, -1, 1, 1)
    elif problem.epilogue.source is SourceKind.RESIDUAL:
        source = torch.randn(ref.shape, device="cuda").to(out_t).contiguous(memory_format=torch.channels_last)
        ref = ref + source.double()
    return source, ops._apply_activation(ref, problem.epilogue.activation)


def check(problem, cfg, seed, slices=1, tol=None):
    x, w, dy = operands(problem, seed)
    a, b = kernel_operands(problem, x, w, dy)
    source, ref = epilogue_source(problem, reference(problem, x, w, dy))
    out = poisoned_output(problem)
    ops.run_problem(problem, a, b, out, source, config=LaunchConfig(cfg, slices) if cfg else None, select="heuristic")
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    bound = tol or TOLERANCE[problem.element_out]
    assert not math.isnan(err), f"{cfg.name}: NaN in output (unwritten or invalid) for {problem.name}"
    assert err < bound, f"{cfg.name} on {problem.name}: relative error {err:.3e} >= {bound}"
    return err


@pytest.mark.parametrize("kind, layer, dt", CASES, ids=[f"{k.value}-{l[0]}-{d[0]}to{d[1]}" for k, l, d in CASES])
def test_kind_layer_dtype(kind, layer, dt):
    problem = make_problem(kind, layer, dt)
    check(problem, config_for(problem), seed=hash((kind.value, layer[0], dt)) % 2**31)


@pytest.mark.parametrize("layer, iterator", STRIDED_DGRAD_VARIANTS,
                         ids=[f"{l[0]}-{i.value if i else 'default'}" for l, i in STRIDED_DGRAD_VARIANTS])
def test_strided_dgrad_alignments_and_iterators(layer, iterator):
    problem, cfg = variant_config(layer, iterator)
    check(problem, cfg, seed=17)


@pytest.mark.parametrize("layer, dilation, dt, iterator", DILATED_DGRAD,
                         ids=[f"{l[0]}-{d[0]}to{d[1]}-{i.value if i else 'default'}" for l, _, d, i in DILATED_DGRAD])
def test_dilated_unity_stride_dgrad(layer, dilation, dt, iterator):
    problem, cfg = dilated_config(layer, dilation, dt, iterator)
    assert problem.dilation_h == dilation and problem.stride_h == 1
    check(problem, cfg, seed=hash((layer[0], dilation, dt)) % 2**31)


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: e.tag)
def test_fused_epilogues(epilogue):
    for dt in (("f16", "f16"),) + ((("f16", "f32"),) if epilogue == EPILOGUES[0] else ()):
        problem = make_problem("fprop", EPI_LAYER, dt, epilogue=epilogue)
        check(problem, pick(problem), seed=7)


@pytest.mark.parametrize("problem", SPLIT_PROBLEMS, ids=lambda p: p.kind.value)
@pytest.mark.parametrize("mode", [SplitKMode.SERIAL, SplitKMode.PARALLEL], ids=lambda m: m.value)
def test_split_k_fprop_and_unit_stride_dgrad(problem, mode):
    cfg = pick(problem, mode)
    for slices in (1, 2, 4, 8):
        if mode is SplitKMode.SERIAL and slices > 1:  # fp16 output: serial partials would be rounded, refused
            assert "parallel split-k" in LaunchConfig(cfg, slices).reject_reason(problem)
            continue
        check(problem, cfg, seed=slices, slices=slices)


@pytest.mark.parametrize("activation", SPLIT_ACTIVATIONS, ids=lambda a: a.value)
@pytest.mark.parametrize("mode", [SplitKMode.SERIAL, SplitKMode.PARALLEL], ids=lambda m: m.value)
def test_split_k_with_an_activation(activation, mode):
    """An activation epilogue under split-k: applied once, to the whole sum, never to a slice's partial sum (CUTLASS's
    LinearCombinationRelu wrote NaN from every serial slice but the last: refused since; the GPU fuzz's seeds 131
    and 149). Without and with a residual source, whose slices after the first must not add it again."""
    for source in (SourceKind.NONE, SourceKind.RESIDUAL):
        problem = split_act_problem(activation, mode, source)
        if activation is Activation.RELU and mode is SplitKMode.SERIAL:
            cfg = next(c for c in sm80_candidates(problem) if c.split_k_mode is mode)
            assert "LinearCombinationRelu" in LaunchConfig(cfg, 2).reject_reason(problem)
            continue
        cfg = pick(problem, mode)
        for slices in (1, 2, 3, 8):
            why = LaunchConfig(cfg, slices).reject_reason(problem)
            assert why is None, why
            check(problem, cfg, seed=hash((activation.value, mode.value, source.value, slices)) % 2**31, slices=slices)


def test_public_ops_match_pytorch():
    x, w, dy = operands(make_problem("fprop", ("l", 4, 32, 20, 48, 3, 2, 1), ("f16", "f16")), seed=3)
    bias = torch.randn(48, device="cuda", dtype=torch.float16)
    y = ops.conv2d(x, w, bias, stride=2, padding=1, activation="relu")
    ref = torch.relu(torch.nn.functional.conv2d(x.double(), w.double(), bias.double(), 2, 1))
    assert rel_err(y, ref) < 1e-2 and y.is_contiguous(memory_format=torch.channels_last)
    y32 = ops.conv2d(x, w, stride=2, padding=1, out_dtype=torch.float32)  # fp16 in, fp32 out, one kernel
    assert y32.dtype == torch.float32
    assert rel_err(y32, torch.nn.functional.conv2d(x.double(), w.double(), None, 2, 1)) < 5e-3
    gi, gw, gb = ops.convolution_backward(dy, x, w, [48], [2, 2], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
    assert rel_err(gi, torch.nn.grad.conv2d_input(x.shape, w.double(), dy.double(), 2, 1)) < 1e-2
    assert rel_err(gw, torch.nn.grad.conv2d_weight(x.double(), w.shape, dy.double(), 2, 1)) < 1e-2
    assert rel_err(gb, dy.double().sum((0, 2, 3))) < 1e-2
    gw32 = ops.conv2d_wgrad(dy, x, w.shape, 2, 1, out_dtype=torch.float32)  # fp32 master-weight gradient
    assert gw32.dtype == torch.float32
    assert rel_err(gw32, torch.nn.grad.conv2d_weight(x.double(), w.shape, dy.double(), 2, 1)) < 5e-3


def test_misaligned_pointer_runs_a_narrower_kernel():
    problem = make_problem("fprop", ("l", 2, 64, 16, 64, 3, 1, 1), ("f16", "f16"))
    x, w, _ = operands(problem, seed=11)
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
    shifted = buf[1:].view(2, 16, 16, 64).permute(0, 3, 1, 2)  # channels_last, address 2 bytes off
    shifted.copy_(x)
    assert shifted.is_contiguous(memory_format=torch.channels_last) and shifted.data_ptr() % 16 == 2
    out = poisoned_output(problem)
    ops.run_problem(problem, shifted, w, out, select="heuristic")
    assert rel_err(out, reference(problem, x, w, None)) < 1e-2


def test_refusals_name_the_parameter():
    x, w, dy = operands(make_problem("fprop", ("l", 2, 16, 8, 16, 3, 1, 1), ("f16", "f16")), seed=1)
    with pytest.raises(ops.UnsupportedConvError, match="input: expected a CUDA tensor"):
        ops.conv2d(x.cpu(), w.cpu(), padding=1)
    with pytest.raises(ops.UnsupportedConvError, match="input: expected channels_last"):
        ops.conv2d(x.contiguous(), w, padding=1)
    with pytest.raises(ops.UnsupportedConvError, match="weight: expected dtype"):
        ops.conv2d(x, w.float(), padding=1)
    with pytest.raises(ops.UnsupportedConvError, match="input dtype: expected one of"):
        ops.conv2d(x.double(), w.double(), padding=1)
    with pytest.raises(ops.UnsupportedConvError, match="groups"):
        ops.conv2d(x, w[:, :8].contiguous(memory_format=torch.channels_last), padding=1, groups=2)
    with pytest.raises(ops.UnsupportedConvError, match="dilation"):  # strided + dilated dgrad
        ops.conv2d_dgrad(torch.randn(2, 16, 2, 2, device="cuda", dtype=torch.float16).contiguous(
            memory_format=torch.channels_last), w, x.shape, stride=2, padding=0, dilation=2)
    # fallback=True runs PyTorch instead, with the reason logged
    y = ops.conv2d(x, w[:, :8].contiguous(memory_format=torch.channels_last), padding=1, groups=2, fallback=True)
    ref = torch.nn.functional.conv2d(x.double(), w[:, :8].double(), None, 1, 1, 1, 2)
    assert rel_err(y, ref) < 1e-2


def test_workspace_comes_from_the_caching_allocator_per_call():
    """No buffer outlives a call (CUDA-graph safe); the caching allocator hands the same block back, so the
    per-call allocation costs no cudaMalloc after the first."""
    problem = SPLIT_PROBLEMS[0]
    cfg = pick(problem, SplitKMode.PARALLEL)
    x, w, _ = operands(problem, seed=5)
    out = poisoned_output(problem)
    ops.run_problem(problem, x, w, out, config=LaunchConfig(cfg, 4))
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for _ in range(3):
        ops.run_problem(problem, x, w, out, config=LaunchConfig(cfg, 4))
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved  # the freed workspace block is reused: no new cudaMalloc
    assert not hasattr(ops, "_workspaces")
    ref = reference(problem, x, w, None)
    assert rel_err(out, ref) < TOLERANCE[problem.element_out]


def test_raw_device_pointers_through_cuda_python():
    """The torch-free path: buffers from cudaMalloc, a stream from cudaStreamCreate."""
    import numpy as np
    from cuda.bindings import runtime as rt

    problem = make_problem("fprop", ("l", 2, 32, 12, 64, 3, 1, 1), ("f16", "f16"))
    lib = load_kernel(pick(problem))
    rng = np.random.default_rng(0)
    x = rng.standard_normal(problem.x_shape).astype(np.float16)
    w = rng.standard_normal(problem.w_shape).astype(np.float16)

    def check_cuda(res):
        err = res[0] if isinstance(res, tuple) else res
        assert err == rt.cudaError_t.cudaSuccess, err
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    dx = check_cuda(rt.cudaMalloc(x.nbytes))
    dw = check_cuda(rt.cudaMalloc(w.nbytes))
    out_bytes = math.prod(problem.y_shape) * 2
    dout = check_cuda(rt.cudaMalloc(out_bytes))
    stream = check_cuda(rt.cudaStreamCreate())
    check_cuda(rt.cudaMemcpy(dx, x.ctypes.data, x.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice))
    check_cuda(rt.cudaMemcpy(dw, w.ctypes.data, w.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice))
    check_cuda(rt.cudaMemset(dout, 0xFF, out_bytes))  # NaN poison
    lib.run(problem, a=int(dx), b=int(dw), d=int(dout), stream=int(stream))
    check_cuda(rt.cudaStreamSynchronize(stream))
    y = np.empty(problem.y_shape, dtype=np.float16)
    check_cuda(rt.cudaMemcpy(y.ctypes.data, dout, out_bytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))
    for p in (dx, dw, dout):
        check_cuda(rt.cudaFree(p))
    check_cuda(rt.cudaStreamDestroy(stream))
    ref = torch.nn.functional.conv2d(torch.from_numpy(x).permute(0, 3, 1, 2).double(),
                                     torch.from_numpy(w).permute(0, 3, 1, 2).double(), None, 1, 1)
    assert rel_err(torch.from_numpy(y).permute(0, 3, 1, 2), ref) < 1e-2
