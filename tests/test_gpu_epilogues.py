"""GPU tests of issue 13 against float64 PyTorch, outputs poisoned with NaN first, fresh random inputs per case:

* bias + residual + activation in one epilogue, an fp32 bias under a 16-bit output, casts after activations (fp32
  inputs storing fp16/bf16, 16-bit inputs storing fp32), on the 2.x family (7 kernels) and the 3.x family (3);
* offset views (a storage offset lowering an operand's alignment) on few-channels, fixed-channels and strided-dgrad
  problems: the launch is re-chosen among the configs that accept the alignments (3 kernels);
* the public op and the offload's custom op with bias and residual together (no further kernels).

Every kernel launched is in all_configs(), compiled ahead in one parallel build (10 2.x, 3 sm90)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from cutlass_byoc import ops  # noqa: E402
from cutlass_byoc.candidates import sm80_candidates  # noqa: E402
from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.heuristics import default_launch  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.sm90 import sm90_candidates  # noqa: E402
from cutlass_byoc.types import Activation, DType, IteratorAlgorithm, SourceKind, StrideSupport  # noqa: E402

from gpu_util import TOLERANCE, TORCH, module_kernels, pick, poisoned_output, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu

BR, BIAS = SourceKind.BIAS_RESIDUAL, SourceKind.BIAS
A = Activation
CL = torch.channels_last

# name, input type, output type, activation, source, bias type
FUSIONS_2X = [
    ("f16_bias_residual_relu", "f16", "f16", A.RELU, BR, "f16"),
    ("bf16_f32bias_residual_silu", "bf16", "bf16", A.SILU, BR, "f32"),
    ("f32_to_f16_f32bias_residual_relu", "f32", "f16", A.RELU, BR, "f32"),  # fp32 model: act then .half()
    ("f32_bias_residual_gelu", "f32", "f32", A.GELU, BR, "f32"),
    ("f16_f32bias_gelu", "f16", "f16", A.GELU, BIAS, "f32"),  # fp32 bias under a 16-bit output
    ("f32_to_bf16_f32bias_relu", "f32", "bf16", A.RELU, BIAS, "f32"),  # fp32 model: bias, act, then .bfloat16()
    ("f16_to_f32_bias_residual_hardswish", "f16", "f32", A.HARDSWISH, BR, "f32"),  # autocast: then .float()
]
FUSIONS_3X = [
    ("sm90_bf16_f32bias_residual_silu", "bf16", "bf16", A.SILU, BR, "f32"),
    ("sm90_f16_to_f32_bias_residual_relu", "f16", "f32", A.RELU, BR, "f32"),
    ("sm90_f16_f32bias_gelu", "f16", "f16", A.GELU, BIAS, "f32"),
]


def fusion_problem(case, c=64, k=64) -> Conv2dProblem:
    _, dt, out, act, source, bias = case
    return Conv2dProblem.make("fprop", 4, c, 20, 20, k, 3, padding=1, dtype=dt, out_dtype=out,
                              epilogue=Epilogue(act, source, bias))


def config_2x(case):
    """The model's 2.x pick (for fp32 inputs also what ops and the custom op choose: the 3.x family takes 16-bit)."""
    return default_launch(fusion_problem(case), sm90=False).kernel


def config_3x(case):
    return next(sm90_candidates(fusion_problem(case, k=128)))


# name, problem, the launch given (explicit config), the offsets (elements) of A, B, output
def offset_cases():
    few = Conv2dProblem.make("fprop", 4, 12, 32, 32, 64, 3, padding=1)
    fixed = Conv2dProblem.make("fprop", 4, 8, 32, 32, 64, 3, padding=1)
    sdg = Conv2dProblem.make("dgrad", 4, 64, 28, 28, 64, 3, stride=2, padding=1)
    it = lambda p, i: next(c for c in sm80_candidates(p) if c.iterator is i)  # noqa: E731
    return [
        ("few_channels_x_off1", few, it(few, IteratorAlgorithm.FEW_CHANNELS), (1, 0, 0)),
        ("fixed_channels_x_off2", fixed, it(fixed, IteratorAlgorithm.FIXED_CHANNELS), (2, 0, 0)),
        ("strided_dgrad_dy_off2_dx_off4", sdg, pick(sdg), (2, 0, 4)),
    ]


class _Ptr:
    def __init__(self, slot, offset_bytes):
        self.addr = (slot + 1) * (1 << 20) + offset_bytes

    def data_ptr(self):
        return self.addr


def rechosen(problem, cfg, offsets):
    """The config ops re-chooses for these offsets (computed without a GPU from the addresses' alignment)."""
    el = [problem.element_a, problem.element_b, problem.element_out]
    ptrs = [_Ptr(i, o * t.nbytes) for i, (o, t) in enumerate(zip(offsets, el))]
    return ops._narrow_to_pointers(LaunchConfig(cfg), problem, *ptrs, None, explicit=True).kernel


def all_configs():
    cfgs = [config_2x(c) for c in FUSIONS_2X] + [rechosen(p, cfg, off) for _, p, cfg, off in offset_cases()]
    cfgs += [config_3x(c) for c in FUSIONS_3X]
    return list(dict.fromkeys(cfgs))


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    with module_kernels(shared_cache, all_configs):
        yield


def test_kernel_budget():
    cfgs = all_configs()
    n90 = sum(c.family.value == "sm90_tma_wgmma" for c in cfgs)
    assert n90 <= 3 and len(cfgs) - n90 <= 10, [c.name for c in cfgs]


def operands(problem, seed, bias_scale=1.0):
    """Fresh x, w, bias (its own type), residual (the output's type), all random, channels_last."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt, out_t = TORCH[problem.element_a], TORCH[problem.element_out]
    x = torch.randn((problem.n, problem.c, problem.h, problem.w), generator=g, device="cuda").to(dt)
    w = torch.randn((problem.k, problem.c, problem.r, problem.s), generator=g, device="cuda").to(dt)
    bias = residual = None
    if problem.epilogue.source.has_bias:
        bias = (torch.randn(problem.k, generator=g, device="cuda") * bias_scale).to(TORCH[problem.element_bias])
    if problem.epilogue.source.has_residual:
        residual = torch.randn((problem.n, problem.k, problem.p, problem.q), generator=g, device="cuda").to(out_t)
        residual = residual.contiguous(memory_format=CL)
    return x.contiguous(memory_format=CL), w.contiguous(memory_format=CL), bias, residual


def reference(problem, x, w, bias, residual):
    y = torch.nn.functional.conv2d(x.double(), w.double(), None, 1, 1)
    if bias is not None:
        y = y + bias.double().view(1, -1, 1, 1)
    if residual is not None:
        y = y + residual.double()
    return ops._apply_activation(y, problem.epilogue.activation)


def bound(problem):
    # 16-bit inputs, fp32 output: the products are exact in fp32, so a bias rounded to 16 bits on the way (bias
    # scaled x100 here) would show far above this bound
    if problem.element_a.bits == 16 and problem.element_out is DType.F32:
        return 1e-4
    return TOLERANCE[problem.element_out]


def run_fusion(problem, cfg, seed):
    x, w, bias, residual = operands(problem, seed, bias_scale=100.0 if problem.element_out is DType.F32 else 1.0)
    out = poisoned_output(problem)
    if problem.epilogue.source is BR:
        ops.run_problem(problem, x, w, out, residual, config=LaunchConfig(cfg), bias=bias)
    else:
        ops.run_problem(problem, x, w, out, bias, config=LaunchConfig(cfg))
    torch.cuda.synchronize()
    err = rel_err(out, reference(problem, x, w, bias, residual))
    assert not math.isnan(err), f"{cfg.name}: NaN in the output (unwritten) for {problem.name}"
    assert err < bound(problem), f"{cfg.name} on {problem.name}: relative error {err:.3e} >= {bound(problem)}"
    return err


@pytest.mark.parametrize("case", FUSIONS_2X, ids=[c[0] for c in FUSIONS_2X])
def test_2x_fusions(case):
    problem = fusion_problem(case)
    cfg = config_2x(case)
    assert cfg.element_bias is DType(case[5])
    run_fusion(problem, cfg, seed=hash(case[0]) % 2**31)


@pytest.mark.parametrize("case", FUSIONS_3X, ids=[c[0] for c in FUSIONS_3X])
def test_3x_fusions(case):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90a kernels")
    problem = fusion_problem(case, k=128)
    run_fusion(problem, config_3x(case), seed=hash(case[0]) % 2**31)


def shifted(t, offset):
    """t's values in a channels_last view whose storage starts `offset` elements into its buffer."""
    if not offset:
        return t
    n, c, h, w = t.shape
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    v = buf[offset:].view(n, h, w, c).permute(0, 3, 1, 2)
    v.copy_(t)
    assert v.is_contiguous(memory_format=CL) and v.data_ptr() % 16 == (offset * t.element_size()) % 16
    return v


@pytest.mark.parametrize("name, problem, cfg, offsets", offset_cases(), ids=[c[0] for c in offset_cases()])
def test_offset_views_run_a_rechosen_kernel(name, problem, cfg, offsets):
    g = torch.Generator(device="cuda").manual_seed(hash(name) % 2**31)
    dt = TORCH[problem.element_a]
    rnd = lambda *s: torch.randn(s, generator=g, device="cuda").to(dt).contiguous(memory_format=CL)  # noqa: E731
    w = rnd(problem.k, problem.c, problem.r, problem.s)
    out = poisoned_output(problem)
    if problem.kind.value == "fprop":
        x = rnd(problem.n, problem.c, problem.h, problem.w)
        a, ref = x, torch.nn.functional.conv2d(x.double(), w.double(), None, 1, 1)
    else:
        dy = rnd(problem.n, problem.k, problem.p, problem.q)
        a = dy
        ref = torch.nn.grad.conv2d_input((problem.n, problem.c, problem.h, problem.w), w.double(), dy.double(),
                                         (problem.stride_h, problem.stride_w), (problem.pad_h, problem.pad_w))
    a_off, w_off = shifted(a, offsets[0]), shifted(w, offsets[1])
    out_off = shifted(out, offsets[2])  # NaN-poisoned view of a NaN buffer
    out_off.fill_(float("nan"))
    new = rechosen(problem, cfg, offsets)
    assert new.reject_reason(problem) is None
    if cfg.iterator is not IteratorAlgorithm.OPTIMIZED or cfg.stride_support is StrideSupport.STRIDED:
        assert new != cfg
    ops.run_problem(problem, a_off, w_off, out_off, config=LaunchConfig(cfg))
    torch.cuda.synchronize()
    err = rel_err(out_off, ref)
    assert not math.isnan(err) and err < TOLERANCE[problem.element_out], f"{new.name} on {name}: {err:.3e}"


def test_strided_dgrad_two_byte_offset_is_refused_naming_the_operand():
    _, problem, cfg, _ = offset_cases()[2]
    dy = torch.randn(problem.n, problem.k, problem.p, problem.q, device="cuda").half().contiguous(memory_format=CL)
    w = torch.randn(problem.k, problem.c, 3, 3, device="cuda").half().contiguous(memory_format=CL)
    with pytest.raises(ops.UnsupportedConvError, match="A at address .* allows alignment 1"):
        ops.run_problem(problem, shifted(dy, 1), w, poisoned_output(problem), config=LaunchConfig(cfg))


def test_public_op_and_custom_op_take_bias_and_residual_together():
    """ops.conv2d and the offload's cutlass_byoc::conv2d_fprop with a bias and a residual: one kernel (the model's pick
    of FUSIONS_2X[0] / [2]), first call checked, second call on the direct path."""
    from cutlass_byoc.offload import library

    p = fusion_problem(FUSIONS_2X[0])
    x, w, bias, residual = operands(p, seed=21)
    y = ops.conv2d(x, w, bias, padding=1, activation="relu", residual=residual,
                   config=LaunchConfig(config_2x(FUSIONS_2X[0])))
    assert rel_err(y, reference(p, x, w, bias, residual)) < TOLERANCE[DType.F16]

    p = fusion_problem(FUSIONS_2X[2])  # fp32 inputs, fp32 bias, fp16 residual, relu, fp16 output
    assert default_launch(p).kernel == config_2x(FUSIONS_2X[2])  # what the op will choose: compiled ahead
    library.RUNTIME.clear()
    for seed in (22, 23):  # the general path: first call checked, the second direct
        x, w, bias, residual = operands(p, seed)
        y = library.conv2d_fprop(x, w, bias, residual, [1, 1], [1, 1], [1, 1], 1, "relu", torch.float16, "heuristic")
        assert y.dtype == torch.float16 and y.is_contiguous(memory_format=CL)
        assert rel_err(y, reference(p, x, w, bias, residual)) < TOLERANCE[DType.F16]
    assert library.RUNTIME.general_calls.get("fprop") == 2 and not library.RUNTIME.fallbacks, library.RUNTIME
    # a call site (what the partitioner registers): the residual as the source, the fp32 bias beside it
    index = library.register_site("fprop", p, "heuristic", (p.n, p.k, p.p, p.q))
    for seed in (24, 25):
        x, w, bias, residual = operands(p, seed)
        y = library.FPROP(x, w, bias, residual, index)
        assert rel_err(y, reference(p, x, w, bias, residual)) < TOLERANCE[DType.F16]
    # the first call binds the site on the Python path, the second runs in C++ where it is loaded (site.launches counts
    # both); neither went through the general path
    assert library.site(index).launches == 2, "the call site took the general path"
    assert library.RUNTIME.general_calls.get("fprop") == 2
