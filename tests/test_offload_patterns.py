"""CPU tests of the offload pattern table, predicates and partitioner on small hand-built blocks traced to aten graphs
on fake tensors; the partitioned graphs run with the ops' PyTorch reference and must compute what eager computes."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cutlass_byoc.offload import OffloadOptions, Pass, partition
from cutlass_byoc.offload import library
from cutlass_byoc.offload.backend import make_backend
from cutlass_byoc.offload.partition import META_KEY, offloaded_calls
from cutlass_byoc.offload.patterns import (
    ACTIVATION_OPS,
    PatternMatcher,
    Reject,
    activation_forms,
    check_dtypes,
    fprop_patterns,
)
from cutlass_byoc.offload.trace import explain, trace
from cutlass_byoc.types import Activation

CPU = OffloadOptions(require_cuda=False)
aten = torch.ops.aten
CASTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default, aten.to.dtype)


def run(gm, model, *xs):
    """Run a traced graph on the model's real parameters (its backward is in the graph: no autograd needed)."""
    with torch.no_grad():
        return gm(dict(model.named_parameters()), dict(model.named_buffers()), *xs)


def close(a, b, tol=1e-4):
    a, b = a.float(), b.float()
    return (a - b).norm() / b.norm().clamp_min(1e-12) < tol


class Lambda(nn.Module):
    """conv(s) plus a functional tail, for blocks written inline."""

    def __init__(self, fn, *convs: nn.Module):
        super().__init__()
        self.convs = nn.ModuleList(convs)
        self.fn = fn

    def forward(self, *xs):
        return self.fn(self.convs, *xs)


def x_(n=2, c=8, h=8, w=8, cl=False, dtype=torch.float32):
    t = torch.randn(n, c, h, w, dtype=dtype)
    return t.contiguous(memory_format=torch.channels_last) if cl else t


# ---------------------------------------------------------------------------------------------- the table
def test_pattern_table_is_ordered_and_has_every_activation_form():
    pats = fprop_patterns()
    sizes = [p.size for p in pats]
    assert sizes == sorted(sizes, reverse=True)
    assert pats[-1].size == 1 and pats[-1].name == "conv"
    for act in ACTIVATION_OPS:
        forms = activation_forms(act)
        assert any(any(n.target is ACTIVATION_OPS[act] for n in f.graph.nodes) for f in forms)
        if act in (Activation.SILU, Activation.HARDSWISH, Activation.GELU):
            assert len(forms) > 1, f"{act}: decomposed forms missing"
    assert {p.activation for p in pats} == {Activation.IDENTITY, *ACTIVATION_OPS}


def test_matcher_binds_one_value_to_two_placeholders():
    def f(x, w):
        return torch.relu(F.conv2d(x, w) + x)  # the residual is the conv's own input

    gm = trace(Lambda(lambda convs, x: f(x, convs[0].weight), nn.Conv2d(8, 8, 1, bias=False)), x_(),
               decompositions=None)
    pat = next(p for p in fprop_patterns() if p.name == "conv+add(conv_first)+relu")
    assert len(PatternMatcher(pat.gm.graph).match(gm.graph)) == 1


# ---------------------------------------------------------------------------------------------- fprop epilogues
@pytest.mark.parametrize("decomp", [None, "inductor", "core"])
@pytest.mark.parametrize("act", ["relu", "sigmoid", "silu", "hardswish", "gelu"])
def test_conv_bias_activation_fused(act, decomp):
    fn = {"relu": torch.relu, "sigmoid": torch.sigmoid, "silu": F.silu, "hardswish": F.hardswish, "gelu": F.gelu}[act]
    m = Lambda(lambda convs, x: fn(convs[0](x)), nn.Conv2d(8, 16, 3, padding=1))
    x = x_()
    gm, rep = explain(m, x, options=CPU, decompositions=decomp)
    (e,) = rep.entries
    assert e.offloaded and e.kind is Pass.FPROP
    assert e.fused == ("bias", act), rep.summary()
    assert f"_bias+{act}" in e.problem and e.kernel.startswith("cb_")
    (call,) = offloaded_calls(gm)
    assert library.site(call.args[-1]).problem.epilogue.activation.value == act
    assert not [n for n in gm.graph.nodes if n.target is aten.convolution.default]
    assert close(run(gm, m, x), m(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_fused_in_16bit_inductor_form(dtype):
    """Inductor decomposes silu on 16-bit tensors as convert(f32) -> x*sigmoid(x) -> convert back; it fuses too."""
    m = Lambda(lambda convs, x: F.silu(convs[0](x)), nn.Conv2d(8, 16, 3, padding=1, bias=False)).to(dtype)
    gm, rep = explain(m, x_(dtype=dtype), options=CPU)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("silu",), rep.summary()
    assert len(gm.graph.nodes) == len([n for n in gm.graph.nodes if n.op in ("placeholder", "output")]) + 1 + \
        len([n for n in gm.graph.nodes if n.target is aten.clone.default])


@pytest.mark.parametrize("order", ["conv_first", "other_first"])
def test_residual_add_relu_fused(order):
    def fn(convs, x, r):
        y = convs[0](x)
        return torch.relu(y + r if order == "conv_first" else r + y)

    m = Lambda(fn, nn.Conv2d(8, 16, 3, padding=1, bias=False))
    x, r = x_(), torch.randn(2, 16, 8, 8)
    gm, rep = explain(m, x, r, options=CPU, decompositions=None)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("residual", "relu")
    (call,) = offloaded_calls(gm)
    assert call.args[2] is None and call.args[3] is not None
    assert close(run(gm, m, x, r), m(x, r))


def test_bias_and_residual_are_one_epilogue():
    """Bias and residual both go to the kernel (no add of the bias into the residual, an extra pass over the output)."""
    m = Lambda(lambda convs, x, r: torch.relu(convs[0](x) + r), nn.Conv2d(8, 16, 3, padding=1))
    x, r = x_(), torch.randn(2, 16, 8, 8)
    gm, rep = explain(m, x, r, options=CPU, decompositions=None)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("bias", "residual", "relu")
    assert e.problem.endswith("_bias_residual+relu") and "_vbiasf32_" in e.kernel, rep.summary()
    (call,) = offloaded_calls(gm)
    assert call.args[2] is not None and call.args[2].op == "placeholder"  # the conv's bias, as it is
    res = call.args[3]
    res = res.args[0] if res.target is aten.clone.default else res  # NCHW residual: made channels_last
    assert res.op == "placeholder"
    assert not [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    assert close(run(gm, m, x, r), m(x, r))


def test_separate_per_channel_bias_add_is_a_bias():
    m = Lambda(lambda convs, x: F.gelu(convs[0](x) + convs[1].bias.view(1, -1, 1, 1)),
               nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(1, 16, 1))  # the second conv only lends its bias
    x = x_()
    gm, rep = explain(m, x, options=CPU, decompositions=None)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("bias", "gelu")
    assert close(run(gm, m, x), m(x))


def test_broadcast_add_that_is_neither_bias_nor_residual_is_left():
    m = Lambda(lambda convs, x, s: torch.relu(convs[0](x) + s), nn.Conv2d(8, 16, 3, padding=1, bias=False))
    x, s = x_(), torch.randn(2, 1, 1, 1)
    gm, rep = explain(m, x, s, options=CPU, decompositions=None)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ()
    assert any("neither a per-channel bias" in note for note in e.notes)
    assert close(run(gm, m, x, s), m(x, s))


def test_activation_whose_input_is_used_elsewhere_is_not_fused():
    m = Lambda(lambda convs, x: (lambda y: (torch.relu(y), y * 2))(convs[0](x)), nn.Conv2d(8, 16, 3, padding=1))
    x = x_()
    gm, rep = explain(m, x, options=CPU, decompositions=None)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("bias",)
    for a, b in zip(run(gm, m, x), m(x)):
        assert close(a, b)


# ---------------------------------------------------------------------------------------------- casts
@pytest.mark.parametrize("decomp", [None, "inductor"])
def test_fp32_conv_cast_to_fp16_stores_fp16(decomp):
    m = Lambda(lambda convs, x: torch.relu(convs[0](x)).half(), nn.Conv2d(8, 16, 3, padding=1, bias=False))
    x = x_()
    gm, rep = explain(m, x, options=CPU, decompositions=decomp)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("relu", "cast(float16)")
    assert "f32f32_f16_accf32" in e.problem
    (call,) = offloaded_calls(gm)
    assert library.site(call.args[-1]).out_dtype == torch.float16 and call.meta["val"].dtype == torch.float16
    out = run(gm, m, x)
    assert out.dtype == torch.float16 and close(out, m(x), 2e-3)


@pytest.mark.parametrize("decomp", [None, "inductor"])
@pytest.mark.parametrize("out", [torch.float16, torch.bfloat16])
def test_cast_after_fp32_bias_and_activation_is_fused(out, decomp):
    """conv -> bias -> activation -> cast in an fp32 model: one kernel storing the cast's type, the fp32 bias kept
    fp32 (a bias-vector kernel: rounding it to 16 bits before the add would lose the result where bias and conv
    cancel)."""
    m = Lambda(lambda convs, x: torch.relu(convs[0](x)).to(out), nn.Conv2d(8, 16, 3, padding=1))
    x = x_()
    gm, rep = explain(m, x, options=CPU, decompositions=decomp)
    (e,) = rep.entries
    tag = str(out).replace("torch.", "")
    assert e.offloaded and e.fused == ("bias", "relu", f"cast({tag})"), rep.summary()
    short = {torch.float16: "f16", torch.bfloat16: "bf16"}[out]
    assert f"f32f32_{short}_accf32" in e.problem and e.problem.endswith("_bias_f32+relu")
    assert f"f32f32_{short}_accf32" in e.kernel and "_vbiasf32_" in e.kernel
    (call,) = offloaded_calls(gm)
    assert library.site(call.args[-1]).out_dtype == out and call.meta["val"].dtype == out
    assert call.args[2].meta["val"].dtype == torch.float32  # the bias is not cast down
    assert not [n for n in gm.graph.nodes if n.target in CASTS]
    y = run(gm, m, x)
    assert y.dtype == out and close(y, m(x), 1e-2)


def test_cast_not_fused_when_it_would_round_an_fp32_residual():
    m = Lambda(lambda convs, x, r: (convs[0](x) + r).half(), nn.Conv2d(8, 16, 3, padding=1, bias=False))
    x, r = x_(), torch.randn(2, 16, 8, 8)
    gm, rep = explain(m, x, r, options=CPU, decompositions=None)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("residual",)
    assert any("would round it" in n for n in e.notes)
    assert close(run(gm, m, x, r), m(x, r), 2e-3)


ACTS = {"relu": torch.relu, "silu": F.silu, "gelu": F.gelu, "hardswish": F.hardswish, "sigmoid": torch.sigmoid}


@pytest.mark.parametrize("decomp", [None, "inductor", "core"])
@pytest.mark.parametrize("act", list(ACTS))
def test_bias_residual_activation_fused(act, decomp):
    """conv -> bias -> residual add -> activation: one kernel, in every graph form."""
    m = Lambda(lambda convs, x, r: ACTS[act](convs[0](x) + r), nn.Conv2d(8, 16, 3, padding=1))
    x, r = x_(), torch.randn(2, 16, 8, 8)
    gm, rep = explain(m, x, r, options=CPU, decompositions=decomp)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("bias", "residual", act), rep.summary()
    assert e.problem.endswith(f"_bias_residual+{act}")
    (call,) = offloaded_calls(gm)
    assert call.args[2] is not None and call.args[3] is not None and library.site(call.args[-1]).problem.epilogue.activation.value == act
    assert close(run(gm, m, x, r), m(x, r))


@pytest.mark.parametrize("decomp", [None, "inductor"])
def test_fp32_model_bias_residual_activation_cast_to_fp16(decomp):
    """conv -> bias -> residual add -> activation -> .half() in an fp32 model with an fp16 residual (added in fp32
    by type promotion): one kernel, fp32 bias, fp16 residual read as C, fp16 output."""
    m = Lambda(lambda convs, x, r: torch.relu(convs[0](x) + r).half(), nn.Conv2d(8, 16, 3, padding=1))
    x, r = x_(), torch.randn(2, 16, 8, 8).half()
    gm, rep = explain(m, x, r, options=CPU, decompositions=decomp)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("bias", "residual", "relu", "cast(float16)"), rep.summary()
    assert "f32f32_f16_accf32" in e.problem and e.problem.endswith("_bias_residual_f32+relu")
    (call,) = offloaded_calls(gm)
    assert call.meta["val"].dtype == torch.float16
    assert call.args[2].meta["val"].dtype == torch.float32 and call.args[3].meta["val"].dtype == torch.float16
    assert not [n for n in gm.graph.nodes if n.target in CASTS]
    y = run(gm, m, x, r)
    assert y.dtype == torch.float16 and close(y, m(x, r), 2e-3)


def test_fp32_residual_keeps_the_cast_out_but_fuses_bias_residual_activation():
    """An fp32 residual under a 16-bit cast: the kernels read the residual in the output's type, so the cast stays a
    separate op (exact) and the rest is still one epilogue."""
    m = Lambda(lambda convs, x, r: torch.relu(convs[0](x) + r).half(), nn.Conv2d(8, 16, 3, padding=1))
    x, r = x_(), torch.randn(2, 16, 8, 8)
    gm, rep = explain(m, x, r, options=CPU, decompositions=None)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("bias", "residual", "relu"), rep.summary()
    assert any("would round it" in n for n in e.notes)
    assert close(run(gm, m, x, r), m(x, r), 2e-3)


@pytest.mark.parametrize("autocast", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decomp", [None, "inductor"])
def test_autocast_bias_residual_activation_cast_to_fp32(autocast, decomp):
    """16-bit -> fp32 direction: under autocast, conv -> bias -> residual -> activation -> .float() is one kernel
    with 16-bit inputs and an fp32 output (accumulator and epilogue in fp32, no 16-bit rounding in between)."""
    m = Lambda(lambda convs, x, r: F.silu(convs[0](x) + r).float(), nn.Conv2d(8, 16, 3, padding=1))
    x = x_()
    r = torch.randn(2, 16, 8, 8).to(autocast)
    gm, rep = explain(m, x, r, options=CPU, decompositions=decomp, autocast=autocast)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("bias", "residual", "silu", "cast(float32)"), rep.summary()
    short = {torch.float16: "f16", torch.bfloat16: "bf16"}[autocast]
    assert f"{short}{short}_f32_accf32" in e.problem
    (call,) = offloaded_calls(gm)
    assert call.meta["val"].dtype == torch.float32
    with torch.autocast("cpu", dtype=autocast):
        ref = m(x, r)
    y = run(gm, m, x, r)
    assert y.dtype == torch.float32 and close(y, ref, 2e-2)


def test_autocast_bias_activation_cast_to_fp32():
    m = Lambda(lambda convs, x: torch.relu(convs[0](x)).float(), nn.Conv2d(8, 16, 3, padding=1))
    x = x_()
    gm, rep = explain(m, x, options=CPU, decompositions=None, autocast=torch.bfloat16)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("bias", "relu", "cast(float32)"), rep.summary()
    assert "bf16bf16_f32_accf32" in e.problem and e.problem.endswith("_bias+relu")  # bias cast up exactly: plain kernel
    assert "vbias" not in e.kernel


def test_cast_right_after_fp32_bias_is_fused():
    m = Lambda(lambda convs, x: convs[0](x).half(), nn.Conv2d(8, 16, 3, padding=1))
    x = x_()
    gm, rep = explain(m, x, options=CPU, decompositions=None)
    (e,) = rep.entries
    assert e.offloaded and e.fused == ("bias", "cast(float16)"), rep.summary()
    assert e.problem.endswith("_bias_f32")
    assert close(run(gm, m, x), m(x), 2e-3)


def test_wgrad_cast_to_fp32_master_weights_is_one_kernel():
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
    gm, rep = explain(m, x_(), training=True, autocast=torch.bfloat16, options=CPU)
    wg = [e for e in rep.entries if e.kind is Pass.WGRAD]
    assert len(wg) == 2 and all(e.offloaded and e.fused == ("cast(float32)",) for e in wg), rep.summary()
    assert all("bf16bf16_f32_accf32" in e.problem for e in wg)
    calls = [n for n in offloaded_calls(gm) if n.target is library.WGRAD]
    assert all(n.meta["val"].dtype == torch.float32 for n in calls)


# ---------------------------------------------------------------------------------------------- backward
def test_backward_split_by_output_mask_and_numerics():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, stride=2, padding=1))
    x = x_()
    gm, rep = explain(m, x, training=True, options=CPU, decompositions=None)
    assert rep.count(Pass.FPROP) == 2 and rep.count(Pass.WGRAD) == 2
    # the network input needs no gradient: only the second conv has a dgrad
    assert rep.count(Pass.DGRAD, None) == 1 and rep.count(Pass.DGRAD) == 1
    assert not [n for n in gm.graph.nodes if n.target is aten.convolution_backward.default]
    loss, grads = run(gm, m, x)
    ref_loss = m(x).sum()
    ref = torch.autograd.grad(ref_loss, list(m.parameters()))
    assert close(loss, ref_loss, 1e-5)
    for g, r in zip(grads, ref):  # conv biases' grads come from the fp32 sum left to PyTorch
        assert close(g, r, 1e-4)


def test_strided_dilated_conv_dgrad_left_with_reason():
    """Stride-1 dilated dgrad is offloaded (unity-stride kernels apply dilation); strided + dilated is not."""
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=2, dilation=2), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=2,
                                                                                      dilation=2),
                      nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, padding=2, dilation=2))
    x = x_()
    gm, rep = explain(m, x, training=True, options=CPU, decompositions=None)
    dgs = [e for e in rep.entries if e.kind is Pass.DGRAD]
    assert [e.offloaded for e in dgs] == [True, False] or [e.offloaded for e in dgs] == [False, True], rep.summary()
    (dg,) = [e for e in dgs if not e.offloaded]
    assert "dilation" in dg.reason and "stride" in dg.reason
    assert rep.count(Pass.WGRAD) == 3 and rep.count(Pass.FPROP) == 3
    # the convolution_backward left for the dgrad computes only grad_input
    (cb,) = [n for n in gm.graph.nodes if n.target is aten.convolution_backward.default]
    assert list(cb.args[10]) == [True, False, False]
    loss, grads = run(gm, m, x)
    ref = torch.autograd.grad(m(x).sum(), list(m.parameters()))
    for g, r in zip(grads, ref):
        assert close(g, r, 1e-4)


# ---------------------------------------------------------------------------------------------- transposed
def test_transposed_conv_runs_as_dgrad():
    torch.manual_seed(0)
    m = Lambda(lambda convs, x: torch.relu(convs[0](x)), nn.ConvTranspose2d(8, 16, 3, stride=2, padding=1,
                                                                             output_padding=1))
    x = x_()
    gm, rep = explain(m, x, options=CPU, decompositions=None)
    (e,) = rep.entries
    assert e.offloaded and e.kind is Pass.TRANSPOSED_FPROP and e.problem.startswith("dgrad_")
    assert any("not fused" in n for n in e.notes), "relu stays with PyTorch: dgrad has no activation epilogue"
    (call,) = offloaded_calls(gm)
    p = library.site(call.args[-1]).problem
    assert call.target is library.DGRAD and (p.n, p.c, p.h, p.w) == (2, 16, 16, 16)
    assert close(run(gm, m, x), m(x))


@pytest.mark.parametrize("stride, padding, output_padding, dilation, groups, out", [
    (2, 1, 1, 1, 1, 16), (2, 0, 0, 1, 8, 8), (3, 1, 2, 1, 1, 16), (1, 1, 0, 2, 1, 16),
    ((2, 1), (1, 0), (1, 0), 1, 1, 16)])
def test_transposed_conv_backward_runs_as_fprop_and_wgrad(stride, padding, output_padding, dilation, groups, out):
    """The backward of conv_transpose2d(x, w): grad_input is the conv of grad_output with w (an fprop problem, as
    wide as x again whatever the output_padding; depthwise for a depthwise transposed conv), grad_weight the wgrad
    of that conv with x as its output gradient; the step (float64 truth, fp32 through the backend, the graph run
    eagerly and through Inductor) matches eager."""
    torch.manual_seed(0)
    conv = nn.ConvTranspose2d(8, out, 3, stride=stride, padding=padding, output_padding=output_padding, groups=groups,
                              dilation=dilation)
    # a conv in front, so that the transposed conv's grad_input is needed
    m = Lambda(lambda convs, x: torch.relu(convs[1](convs[0](x))), nn.Conv2d(8, 8, 1), conv)
    x = x_(cl=True)
    _, rep = explain(m, x, training=True, options=CPU)
    back = [e for e in rep.entries if e.kind in (Pass.DGRAD, Pass.WGRAD) and "(transposed)" in (e.pattern or "")]
    assert [(e.kind, e.offloaded, e.problem.split("_")[0]) for e in back] == [
        (Pass.DGRAD, True, "fprop"), (Pass.WGRAD, True, "wgrad")], rep.summary()
    fp = next(e for e in back if e.kind is Pass.DGRAD)
    assert f"_c{out}k8_r3s3_" in fp.problem, fp.problem  # C: the transposed conv's output channels
    assert (groups > 1) == fp.kernel.startswith("cb_dw_"), fp.kernel
    exact = copy.deepcopy(m).double()
    xd = x.double().requires_grad_(True)
    exact(xd).square().sum().backward()
    for inductor in (False, True):
        backend = make_backend(CPU, inductor=inductor)
        torch._dynamo.reset()
        mine = copy.deepcopy(m)
        xm = x.clone().requires_grad_(True)
        torch.compile(mine, backend=backend)(xm).square().sum().backward()
        assert backend.report().count(Pass.WGRAD) == 2 and backend.report().count(Pass.DGRAD) == 2  # x needs one
        assert close(xm.grad, xd.grad) and all(close(p.grad, q.grad) for p, q in zip(mine.parameters(),
                                                                                      exact.parameters()))


def test_transposed_conv_backward_follows_the_options():
    m = Lambda(lambda convs, x: convs[1](convs[0](x)), nn.Conv2d(8, 8, 1),
               nn.ConvTranspose2d(8, 16, 3, stride=2, padding=1))
    _, rep = explain(m, x_(cl=True), training=True, options=OffloadOptions(require_cuda=False, transposed=False))
    left = [e for e in rep.entries if e.node.startswith("convolution_backward") and not e.offloaded]
    assert {e.kind for e in left} == {Pass.DGRAD, Pass.WGRAD}, rep.summary()
    assert all(e.reason == "transposed: offload of transposed convs is off" for e in left)
    _, rep = explain(m, x_(cl=True), training=True, options=OffloadOptions(require_cuda=False, wgrad=False))
    assert not any(e.offloaded for e in rep.entries if e.kind is Pass.WGRAD)
    assert [e.offloaded for e in rep.entries if e.kind is Pass.DGRAD] == [True], rep.summary()
    # output_padding past the stride (allowed where the dilation is larger): the conv of grad_output is one row and
    # column longer than the input, so both backward results stay with PyTorch, with the reason
    m = Lambda(lambda convs, x: convs[1](convs[0](x)), nn.Conv2d(8, 8, 1),
               nn.ConvTranspose2d(8, 16, 3, stride=1, padding=1, output_padding=1, dilation=2))
    _, rep = explain(m, x_(cl=True), training=True, options=CPU)
    left = [e for e in rep.entries if e.node.startswith("convolution_backward") and not e.offloaded]
    assert {e.kind for e in left} == {Pass.DGRAD, Pass.WGRAD}, rep.summary()
    assert all(e.reason.startswith("transposed: output_padding (1, 1): the conv of grad_output") for e in left)


# ---------------------------------------------------------------------------------------------- left to PyTorch
def test_depthwise_offloaded_grouped_and_dilated_depthwise_left_with_reason(caplog):
    m = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 16, 3, padding=1, groups=2),
                      nn.Conv2d(16, 16, 3, padding=2, dilation=2, groups=16))
    x = x_()
    with caplog.at_level(logging.INFO, logger="cutlass_byoc.offload"):
        gm, rep = explain(m, x, options=CPU, decompositions=None)
    dw, grouped, dilated = rep.entries
    assert dw.offloaded and dw.kind is Pass.FPROP and dw.fused == ("bias",), rep.summary()
    assert dw.kernel.startswith("cb_dw_fprop_") and "_g8_" in dw.problem
    assert not grouped.offloaded and grouped.reason.startswith("groups")
    assert not dilated.offloaded and dilated.reason.startswith("depthwise: dilation"), dilated.reason
    assert "groups" in caplog.text and "no depthwise kernels" not in caplog.text
    assert len([n for n in gm.graph.nodes if n.target is aten.convolution.default]) == 2
    assert close(run(gm, m, x), m(x))


def test_depthwise_bias_and_activation_fused():
    """A depthwise conv with its bias and SiLU (an EfficientNet-style block once BN is folded) in one kernel."""
    m = Lambda(lambda c, x: F.silu(c[0](x)), nn.Conv2d(16, 16, 5, stride=2, padding=2, groups=16))
    x = x_(c=16, h=9, w=9)
    gm, rep = explain(m, x, options=CPU, decompositions=None)
    (e,) = rep.entries
    assert e.offloaded and e.kind is Pass.FPROP and e.fused == ("bias", "silu"), rep.summary()
    assert e.kernel.startswith("cb_dw_fprop_") and "_silu_f5x5_u2x2_" in e.kernel
    assert close(run(gm, m, x), m(x))


@pytest.mark.parametrize("decomp", [None, "inductor"])
def test_depthwise_bias_and_residual_are_one_epilogue(decomp):
    """CPVT's positional conv (x + dwconv(x), the conv with a bias): bias and residual go to the depthwise kernel's
    bias-vector epilogue, one pass over the output."""
    m = Lambda(lambda c, x: c[0](x) + x, nn.Conv2d(16, 16, 3, padding=1, groups=16))
    x = x_(c=16, h=9, w=9)
    gm, rep = explain(m, x, options=CPU, decompositions=decomp)
    (e,) = rep.entries
    assert e.offloaded and e.kind is Pass.FPROP and e.fused == ("bias", "residual"), rep.summary()
    assert e.kernel.startswith("cb_dw_fprop_") and "_vbiasf32_" in e.kernel, e.kernel
    assert close(run(gm, m, x), m(x))


@pytest.mark.parametrize("decomp, dtype", [(None, torch.float32), ("inductor", torch.float32),
                                           ("inductor", torch.float16), ("core", torch.bfloat16)])
def test_relu6_fused_into_depthwise_and_left_after_a_dense_conv(decomp, dtype):
    """MobileNet's ReLU6 (hardtanh(0, 6); clamp_min/clamp_max once decomposed, around an fp32 upcast in 16 bits):
    the depthwise kernels clamp in their epilogue; the implicit-GEMM families have no clamp, so after a dense conv
    the conv (and its bias) is offloaded and the clamp stays in PyTorch, with the reason in the notes."""
    m = Lambda(lambda c, x: F.relu6(c[1](F.relu6(c[0](x)))), nn.Conv2d(16, 16, 3, padding=1, groups=16),
               nn.Conv2d(16, 8, 1))
    m = m.to(dtype)
    x = x_(c=16, h=9, w=9, dtype=dtype)
    gm, rep = explain(m, x, options=CPU, decompositions=decomp)
    dw, dense = rep.entries
    assert dw.offloaded and dw.fused == ("bias", "relu6"), rep.summary()
    assert dw.kernel.startswith("cb_dw_fprop_") and "_relu6_" in dw.kernel
    assert dense.offloaded and dense.fused[0] == "bias" and "relu6" not in dense.fused, rep.summary()
    assert any("relu6" in n and "clamp" in n for n in dense.notes), dense.notes
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert close(run(gm, m, x), m(x), tol)


class _EfficientNetBlock(nn.Module):
    """MBConv as in EfficientNet-B0: 1x1 expand, BN, SiLU; 5x5 depthwise stride 2, BN, SiLU; 1x1 project, BN."""

    def __init__(self, cin=8, hidden=48, cout=16):
        super().__init__()
        self.expand = nn.Conv2d(cin, hidden, 1, bias=False)
        self.bn0 = nn.BatchNorm2d(hidden)
        self.dw = nn.Conv2d(hidden, hidden, 5, stride=2, padding=2, groups=hidden, bias=False)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.project = nn.Conv2d(hidden, cout, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        y = F.silu(self.bn0(self.expand(x)))
        y = F.silu(self.bn1(self.dw(y)))
        return self.bn2(self.project(y))


def test_efficientnet_block_training_offloads_depthwise_fprop_dgrad_and_wgrad():
    torch.manual_seed(0)
    m = _EfficientNetBlock()
    x = x_(c=8, h=12, w=12, cl=True)
    gm, rep = explain(m, x, training=True, options=CPU)
    dw = [e for e in rep.entries if "_g48_" in (e.problem or "")]
    assert sorted(e.kind.value for e in dw) == ["dgrad", "fprop", "wgrad"], rep.summary()
    assert all(e.offloaded and e.kernel.startswith(f"cb_dw_{e.kind.value}_f32") for e in dw), rep.summary()
    assert all("_f5x5_u2x2_" in e.kernel for e in dw)
    assert not rep.rejected, rep.summary()
    assert rep.count(Pass.FPROP) == 3 and rep.count(Pass.WGRAD) == 3 and rep.count(Pass.DGRAD) == 2


def test_cpu_tensors_are_left_when_cuda_is_required():
    m = nn.Conv2d(8, 16, 3)
    gm, rep = explain(m, x_(), options=OffloadOptions())
    (e,) = rep.entries
    assert not e.offloaded and e.reason.startswith("device")


def test_fp32_without_tf32_is_left():
    gm, rep = explain(nn.Conv2d(8, 16, 3), x_(), options=OffloadOptions(require_cuda=False, allow_tf32=False))
    assert "allow_tf32" in rep.entries[0].reason
    with pytest.raises(Reject, match="operands differ"):
        check_dtypes(torch.empty(1, dtype=torch.float16), torch.empty(1), CPU)


def test_conv1d_and_dynamic_shapes_are_left():
    _, rep = explain(nn.Conv1d(8, 16, 3), torch.randn(2, 8, 16), options=CPU, decompositions=None)
    assert "conv2d" in rep.entries[0].reason
    gm = trace(nn.Conv2d(8, 16, 3), x_(), decompositions=None, tracing_mode="symbolic")
    rep = partition(gm, CPU)
    assert rep.entries[0].reason.startswith("dynamic shape")


def test_switches_turn_off_each_pass():
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1))
    _, rep = explain(m, x_(), training=True, options=OffloadOptions(require_cuda=False, wgrad=False, fprop=False))
    assert rep.count(Pass.FPROP) == 0 and rep.count(Pass.WGRAD) == 0 and rep.count(Pass.DGRAD) == 1
    assert all("off" in e.reason for e in rep.rejected)


# ---------------------------------------------------------------------------------------------- layout
def test_nchw_block_becomes_channels_last_without_transposes_between_convs():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.Conv2d(16, 8, 3, padding=1))
    x = x_()
    gm, rep = explain(m, x, training=True, options=CPU)
    clones = [n for n in gm.graph.nodes if n.meta.get(META_KEY) == "channels_last"]
    # the input and the three 3x3 weights, plus the loss gradient (an expand of ones, strides 0): nothing between
    # the convs, neither in the forward nor in the backward
    assert rep.layout_conversions == len(clones) == 5, rep.summary()
    assert sorted(c.args[0].op if c.args[0].op == "placeholder" else str(c.args[0].target) for c in clones) == [
        "aten.expand.default"] + ["placeholder"] * 4
    for call in offloaded_calls(gm):
        for i in (0, 1):
            assert call.args[i].meta["val"].is_contiguous(memory_format=torch.channels_last)
    loss, grads = run(gm, m, x)
    ref_loss = m(x).float().sum()
    ref = torch.autograd.grad(ref_loss, list(m.parameters()))
    assert close(loss, ref_loss, 1e-5)
    for g, r, p in zip(grads, ref, m.parameters()):
        assert g.shape == p.shape
        if r.norm() > 1e-3:  # biases before BN have ~0 gradient: only noise to compare
            assert close(g, r, 1e-3)
    # parameter gradients come back in the parameters' (NCHW) layout
    assert all(g.is_contiguous() for g in grads)


def test_channels_last_model_needs_no_conversion():
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1)).to(
        memory_format=torch.channels_last)
    gm, rep = explain(m, x_(cl=True), training=True, options=CPU)
    clones = [n for n in gm.graph.nodes if n.meta.get(META_KEY) == "channels_last"]
    # only the gradient of the loss (sum: an expand of ones, strides 0) is made dense
    assert [str(c.args[0].target) for c in clones] == ["aten.expand.default"] == ["aten.expand.default"] * \
        rep.layout_conversions
    assert rep.output_restrides == 0
    assert rep.count(Pass.FPROP) == 2 and rep.count(Pass.WGRAD) == 2 and rep.count(Pass.DGRAD) == 1


def test_padding_mode_backward_gets_its_inputs_in_the_traced_layout():
    """An NCHW model whose replicate-padded conv reads a value our channels_last output reached (SiLU of an offloaded
    conv plus the input): replication_pad2d_backward's CPU kernel follows its `input`'s memory format where its
    meta kernel says contiguous, so Inductor's stride check failed at run time (a random program found it). The
    pad's backward gets that input back in the layout the graph was traced with; the step equals eager's."""
    def fn(convs, x):
        return convs[1](F.silu(convs[0](x)) + x)

    m = Lambda(fn, nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 8, 3, padding=1, padding_mode="replicate"))
    x = x_()
    gm, rep = explain(m, x, training=True, options=CPU)
    (pad,) = [n for n in gm.graph.nodes if n.target is aten.replication_pad2d_backward.default]
    arg = pad.args[1]
    assert arg.meta.get(META_KEY) == "restride" and arg.kwargs["memory_format"] == torch.contiguous_format
    assert arg.meta["val"].is_contiguous() and rep.layout_restores >= 1
    assert rep.count(Pass.FPROP) == 2, rep.summary()
    backend = make_backend(CPU, inductor=True)
    torch._dynamo.reset()
    mine, ref = copy.deepcopy(m), copy.deepcopy(m)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    torch.compile(mine, backend=backend)(xs[0]).square().sum().backward()
    ref(xs[1]).square().sum().backward()
    assert close(xs[0].grad, xs[1].grad) and all(close(p.grad, q.grad) for p, q in zip(mine.parameters(),
                                                                                          ref.parameters()))


def test_export_program_partitions():
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, 16, 1, groups=16))
    x = x_()
    ep = torch.export.export(m, (x,)).run_decompositions()
    rep = partition(ep.graph_module, CPU, name="export")
    assert rep.count(Pass.FPROP) == 2 and rep.entries[0].fused == ("bias", "silu")
    assert rep.entries[1].kernel.startswith("cb_dw_fprop_") and rep.entries[1].fused == ("bias",)
    assert not rep.rejected
    assert close(ep.module()(x), m(x))
