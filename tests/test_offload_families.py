"""CPU tests: model families the partitioner must never break (issue: conv+bias+ReLU chains crashed the compile).

Each family is partitioned forward and backward on fake tensors with ``strict=True`` (any partitioner error fails the
test) and every convolution pass gets the expected offloaded/left decision; each family also runs through
``torch.compile`` with the eager AOT variant of the backend on the CPU, against eager. A planted partitioner failure
shows that ``torch.compile`` still compiles and runs the model, with the reason in the report.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn as nn

from cutlass_byoc.offload import Pass, explain, make_backend
from cutlass_byoc.offload import library
from models import FAMILIES, Chain, Dilated, Grouped, UNet, input_channels

partition_mod = sys.modules["cutlass_byoc.offload.partition"]

CL = torch.channels_last
OPTS = {"require_cuda": False, "select": "heuristic", "strict": True}


def _input(model: nn.Module) -> torch.Tensor:
    return torch.randn(2, input_channels(model), 16, 16)


def _convs(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]


# ---------------------------------------------------------------------------------------------- explain
@pytest.mark.parametrize("pool", [False, True])
def test_conv_bias_relu_chain_partitions(pool):
    m = Chain(pool)
    for training in (False, True):
        gm, rep = explain(m, _input(m), training=training, autocast=torch.float16, options=OPTS)
        gm.graph.lint()
        assert rep.failure is None
        assert rep.count(Pass.FPROP) == 4 and rep.count(Pass.FPROP, offloaded=False) == 0, rep.summary()
        assert all(e.fused == ("bias", "relu") for e in rep.entries if e.kind is Pass.FPROP), rep.summary()
        if training:
            # the input needs no gradient: 3 dgrad, 4 wgrad
            assert rep.count(Pass.DGRAD) == 3 and rep.count(Pass.WGRAD) == 4, rep.summary()
            assert not rep.rejected, rep.summary()


def test_issue_reproducer_no_longer_fails():
    m = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU())
    gm, rep = explain(m, torch.randn(2, 3, 32, 32), autocast=torch.float16, options=OPTS)
    gm.graph.lint()
    assert rep.count(Pass.FPROP) == 2, rep.summary()


def test_unet_partitions():
    m = UNet()
    gm, rep = explain(m, _input(m), training=True, autocast=torch.float16, options=OPTS)
    gm.graph.lint()
    assert rep.count(Pass.FPROP) == 11, rep.summary()  # 10 block convs + the 2-class head
    assert rep.count(Pass.TRANSPOSED_FPROP) == 2, rep.summary()
    # the two transposed convs' backward too: grad_input as the fprop of grad_output, grad_weight as a wgrad
    assert rep.count(Pass.DGRAD) == 12 and rep.count(Pass.WGRAD) == 13, rep.summary()
    assert not rep.rejected, rep.summary()
    back = [e for e in rep.offloaded if e.kind in (Pass.DGRAD, Pass.WGRAD) and "(transposed)" in e.pattern]
    assert sorted(e.problem.split("_")[0] for e in back) == ["fprop", "fprop", "wgrad", "wgrad"], rep.summary()
    head = [e for e in rep.offloaded if e.kind is Pass.FPROP and "k2_" in (e.problem or "")]
    assert head, rep.summary()


def test_grouped_left_with_reason():
    m = Grouped()
    gm, rep = explain(m, _input(m), training=True, autocast=torch.float16, options=OPTS)
    gm.graph.lint()
    left = rep.rejected
    assert {e.kind for e in left} == {Pass.FPROP, Pass.DGRAD, Pass.WGRAD}, rep.summary()
    assert all(e.reason.startswith("groups") for e in left), rep.summary()
    assert rep.count(Pass.FPROP) == 2 and rep.count(Pass.WGRAD) == 2 and rep.count(Pass.DGRAD) == 1


def test_dilated_partitions_and_strided_dilated_dgrad_is_refused():
    m = Dilated()
    gm, rep = explain(m, _input(m), training=True, autocast=torch.float16, options=OPTS)
    gm.graph.lint()
    assert rep.count(Pass.FPROP) == 4 and rep.count(Pass.WGRAD) == 4, rep.summary()
    # stride-1 dilated dgrad is offloaded (d2, d3; c0's input needs no gradient)
    assert rep.count(Pass.DGRAD) == 2, rep.summary()
    dilated_dgrad = [e for e in rep.offloaded if e.kind is Pass.DGRAD and "_d2x2" in e.problem or
                     e.kind is Pass.DGRAD and "_d3x3" in (e.problem or "")]
    assert len(dilated_dgrad) == 2, rep.summary()
    (left,) = rep.rejected
    assert left.kind is Pass.DGRAD and left.reason.startswith("dilation"), rep.summary()
    assert "stride" in left.reason


# ---------------------------------------------------------------------------------------------- torch.compile
#: The families added after the first five (tests/models.py): per training pass, how many conv passes the joint graph
#: has (fprop, dgrad, wgrad), and the reasons (their first word) of the passes left to PyTorch, one per pass.
JOINT = {
    "convnext": ((4, 3, 4), []),
    "resnext": ((3, 2, 3), ["groups"] * 3),
    "mobilenet_v3": ((6, 5, 6), []),
    "inception": ((4, 1, 4), []),  # dgrad only where the input's gradient is needed: b2 after b1
    "aspp": ((5, 1, 5), []),
    "multiplier": ((3, 2, 3), ["groups"] * 5),  # channel multiplier 2 and 2 groups: fprop, wgrad each; b's dgrad
    "paddings": ((4, 3, 4), []),
    "shared_frozen": ((4, 3, 3), []),  # c applied twice (two wgrads, summed), the frozen conv has no wgrad
    "slices": ((3, 2, 3), []),
    "weight_std": ((1, 0, 1), []),
    "dense": ((6, 6, 6), []),
    "regnet": ((6, 4, 6), ["groups"] * 3),
    "odd_channels": ((3, 2, 3), []),
    "positional": ((4, 3, 4), []),
}


@pytest.mark.parametrize("family", sorted(JOINT))
def test_family_partitions_with_every_pass_offloaded_or_left_with_its_reason(family):
    m = FAMILIES[family]()
    (fprop, dgrad, wgrad), reasons = JOINT[family]
    for training in (False, True):
        gm, rep = explain(m, _input(m), training=training, autocast=torch.float16, options=OPTS)
        gm.graph.lint()
        assert rep.failure is None, rep.summary()
        assert rep.count(Pass.FPROP, None) == fprop, rep.summary()  # offloaded or not
        if training:
            assert (rep.count(Pass.DGRAD, None), rep.count(Pass.WGRAD, None)) == (dgrad, wgrad), rep.summary()
            assert sorted(e.reason.split(":")[0] for e in rep.rejected) == sorted(reasons), rep.summary()
        left = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
        assert len(left) == len([e for e in rep.rejected if e.kind is Pass.FPROP]), rep.summary()


def test_depthwise_with_bias_and_patchify_stem_of_convnext_are_offloaded():
    m = FAMILIES["convnext"]()
    _, rep = explain(m, _input(m), training=True, autocast=torch.bfloat16, options=OPTS)
    dw = [e for e in rep.offloaded if e.kind is Pass.FPROP and e.kernel.startswith("cb_dw_")]
    assert len(dw) == 2 and all(e.fused == ("bias",) for e in dw), rep.summary()
    stem = [e for e in rep.offloaded if e.kind is Pass.FPROP and "_r4s4_" in e.problem]
    assert len(stem) == 1 and "bias" in stem[0].fused, rep.summary()


def test_positional_conv_fuses_bias_and_residual_into_the_depthwise_kernel():
    """CPVT's y + dwconv(y) under autocast: the 16-bit bias and the residual in one bias-vector depthwise epilogue;
    the next depthwise conv fuses its bias (not the GELU, whose input the backward needs); their dgrad and wgrad are
    offloaded too."""
    m = FAMILIES["positional"]()
    _, rep = explain(m, _input(m), training=True, autocast=torch.float16, options=OPTS)
    dw = sorted((e for e in rep.offloaded if e.kind is Pass.FPROP and e.kernel.startswith("cb_dw_")),
                key=lambda e: len(e.fused))
    assert [e.fused for e in dw] == [("bias",), ("bias", "residual")], rep.summary()
    assert "_vbiasf16_" in dw[1].kernel and "_vbias" not in dw[0].kernel, rep.summary()
    assert sum(e.kernel.startswith("cb_dw_") for e in rep.offloaded if e.kind is not Pass.FPROP) == 4, rep.summary()


def _projected_step(model, x, autocast, weights, compiled=None):
    """Loss = <output, weights> (a fixed random projection: training-mode batch norm makes the usual sum of squares
    of a normalised output nearly constant, its gradients nearly zero and their relative errors meaningless)."""
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = (model if compiled is None else compiled)(x)
    (out.double() * weights).sum().backward()
    return out.detach().double(), x.grad.double(), {n: p.grad.double() for n, p in model.named_parameters()
                                                    if p.requires_grad}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _truth(m, x):
    """The projection weights and the float64 truth's (output, input gradient, parameter gradients) of family `m`."""
    truth_model = copy.deepcopy(m).double()
    weights = torch.randn(truth_model(x.double()).shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1))
    return weights, _projected_step(truth_model, x.double(), False, weights)


def _backend_step(m, x, autocast, weights, inductor):
    """One projected step of a copy of `m` through torch.compile with the backend (strict); the report must show
    offloaded convs, which ran (their CPU reference)."""
    backend = make_backend(OPTS, inductor=inductor)
    torch._dynamo.reset()
    library.RUNTIME.clear()
    mine = copy.deepcopy(m)
    ours = _projected_step(mine, x, autocast, weights, torch.compile(mine, backend=backend))
    rep = backend.report()
    assert rep.failure is None and rep.offloaded, rep.summary()
    assert library.RUNTIME.reference_calls >= len(rep.offloaded)
    return ours


def _pairs(step, truth):
    """(name, ours, truth) of the output, the input gradient and each parameter's gradient."""
    return [("out", step[0], truth[0]), ("dx", step[1], truth[1])] + [(n, step[2][n], truth[2][n]) for n in truth[2]]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_through_torch_compile_eager_backend(family):
    """Every family through torch.compile with the backend (graphs run eagerly, the ops' reference on the CPU):
    fp32 matches eager to rounding; under bf16 autocast the error against a float64 truth is no worse than eager
    autocast's (within 2.5x)."""
    torch.manual_seed(0)
    m = FAMILIES[family]()
    x = _input(m)
    weights, truth = _truth(m, x)
    for autocast in (False, True):
        eager_step = _projected_step(copy.deepcopy(m), x, autocast, weights)
        eager = {name: e for name, e, _ in _pairs(eager_step, truth)}
        for name, o, t in _pairs(_backend_step(m, x, autocast, weights, inductor=False), truth):
            err, eager_err = _rel(o, t), _rel(eager[name], t)
            if autocast:
                assert err <= 2.5 * eager_err + 1e-3, f"{family} {name}: bf16 error {err:.2e}, eager's {eager_err:.2e}"
            else:
                assert err <= 1e-4 and _rel(o, eager[name]) <= 1e-4, f"{family} {name}: fp32 error {err:.2e}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_through_torch_compile_with_inductor(family):
    """The path users run: torch.compile with the backend and Inductor (its CPU code here, the offloaded ops on their
    reference), strict, so neither a partitioner error nor an Inductor failure on the offloaded graph (which would
    otherwise recompile it without offload) passes: fp32 loss and gradients as eager's."""
    torch.manual_seed(0)
    m = FAMILIES[family]()
    x = _input(m)
    weights, truth = _truth(m, x)
    for name, o, t in _pairs(_backend_step(m, x, False, weights, inductor=True), truth):
        assert _rel(o, t) <= 1e-4, f"{family} {name}: fp32 error {_rel(o, t):.2e}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_inference_through_torch_compile_with_inductor(family):
    """Inference as served: eval mode under torch.inference_mode, torch.compile with the backend and Inductor (strict):
    the forward graph is partitioned (no backward passes) and the output is the float64 truth's within 1e-4."""
    torch.manual_seed(0)
    m = FAMILIES[family]().eval()
    x = _input(m)
    truth = copy.deepcopy(m).double()(x.double())
    backend = make_backend(OPTS, inductor=True)
    torch._dynamo.reset()
    library.RUNTIME.clear()
    with torch.inference_mode():
        out = torch.compile(m, backend=backend)(x)
    rep = backend.report()
    assert rep.failure is None and rep.offloaded, rep.summary()
    assert {e.kind for e in rep.entries} == {Pass.FPROP} | ({Pass.TRANSPOSED_FPROP} if family == "unet" else set())
    assert library.RUNTIME.reference_calls >= len(rep.offloaded)
    assert _rel(out.double(), truth) <= 1e-4, f"{family}: error {_rel(out.double(), truth):.2e}"


def _batches(dynamic, sizes=(4, 3, 2, 4), **options):
    """Training steps of the chain family compiled with `dynamic` over batches of `sizes`, each against eager; the
    offloaded ops' calls per step (their CPU reference) and the backend."""
    torch.manual_seed(0)
    m = FAMILIES["chain"]()
    ref = copy.deepcopy(m)
    backend = make_backend({**OPTS, **options}, inductor=False)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend=backend, dynamic=dynamic)
    calls = []
    for n in sizes:
        library.RUNTIME.clear()
        x = torch.randn(n, input_channels(m), 16, 16)
        out = compiled(x)
        out.square().sum().backward()
        expect = ref(x)
        expect.square().sum().backward()
        assert _rel(out, expect) <= 1e-5, n
        for p, q in zip(m.parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) <= 1e-4, n
            p.grad = q.grad = None
        calls.append(library.RUNTIME.reference_calls)
    return calls, backend


def test_a_smaller_last_batch_keeps_the_offload(caplog, monkeypatch):
    """torch.compile's default: after a second batch size it recompiles with a symbolic batch, and that graph then
    serves every later step, the full batch too. Its convs are offloaded all the same (planned at the batch size
    it was traced at, each size bound at its first call): every pass of every step, results equal eager's, and no
    warning."""
    monkeypatch.setattr(sys.modules["cutlass_byoc.offload.report"], "_dynamic_warned", False)
    first_site = len(library._SITES)  # (other tests' sites come before)
    calls, backend = _batches(dynamic=None)
    assert calls == [11, 11, 11, 11], calls  # 4 fprop, 3 dgrad, 4 wgrad at every batch size
    static, dyn = backend.reports[0], backend.reports[-1]
    assert not static.rejected and not dyn.rejected, dyn.summary()
    assert not any(e.notes for e in static.offloaded)
    assert len(dyn.offloaded) == 11 and all(any(n.startswith("dynamic batch: planned at N=3") for n in e.notes)
                                            for e in dyn.offloaded), dyn.summary()
    assert sum(s.dynamic for s in library._SITES[first_site:]) == 11
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "dynamic" in r.getMessage()]


def test_dynamic_batch_off_leaves_symbolic_graphs_to_pytorch_with_a_warning(caplog, monkeypatch):
    """OffloadOptions(dynamic_batch=False): the dynamic graph's convs stay in PyTorch (the reason names the
    option), once warned, results right."""
    monkeypatch.setattr(sys.modules["cutlass_byoc.offload.report"], "_dynamic_warned", False)
    calls, backend = _batches(dynamic=None, dynamic_batch=False)
    assert calls[0] == 11 and calls[1:] == [0, 0, 0], calls
    reasons = {e.reason for e in backend.report().rejected}
    assert all(r.startswith("dynamic shape") and "dynamic_batch=False" in r for r in reasons), reasons
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "dynamic=False" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


def test_symbolic_image_sizes_are_left_to_pytorch():
    """dynamic=True marks every size symbolic: the images' too, which no kernel takes (the reason says which)."""
    calls, backend = _batches(dynamic=True, sizes=(4, 2))
    assert calls == [0, 0], calls
    reasons = {e.reason for e in backend.report().rejected}
    assert reasons and all("only the batch size may be symbolic" in r for r in reasons), reasons


def test_dynamic_false_keeps_every_batch_size_offloaded():
    """torch.compile(..., dynamic=False): one static graph per batch size, each offloaded, the first one met again
    when its size comes back."""
    calls, backend = _batches(dynamic=False)
    assert calls == [11, 11, 11, 11], calls
    assert not backend.report().rejected and len(backend.reports) == 3, backend.report().summary()


def test_frozen_parameters_trace_without_their_weight_gradient():
    """A model with frozen convs (a fine-tuned backbone) traces for explain and `tune --model`: no wgrad for them."""
    from cutlass_byoc.offload.trace import model_problems

    m = FAMILIES["shared_frozen"]()
    problems, rep = model_problems(m, 2, training=True, image=16, in_channels=16, channels_last=True)
    assert rep.count(Pass.WGRAD, None) == 3 and rep.count(Pass.DGRAD, None) == 3, rep.summary()
    assert problems


# ---------------------------------------------------------------------------------------------- defence in depth
def _planted(monkeypatch, how: str):
    if how == "raise":
        def boom(self):
            raise RuntimeError("planted partitioner bug")
        monkeypatch.setattr(partition_mod._Rewriter, "run_backward", boom)
    else:  # a graph that fails lint: move the first new op before its operands
        orig = partition_mod._Rewriter.fix_layouts

        def misorder(self):
            orig(self)
            first = next(n for n in self.graph.nodes if n.op != "placeholder")
            first.prepend(self.new_nodes[-1])
        monkeypatch.setattr(partition_mod._Rewriter, "fix_layouts", misorder)


@pytest.mark.parametrize("how", ["raise", "misordered"])
def test_partitioner_failure_leaves_graph_unchanged(monkeypatch, how):
    from cutlass_byoc.offload import trace

    m = Chain(False)
    gm = trace(m, _input(m), training=True, autocast=torch.float16)
    before = gm.code
    _planted(monkeypatch, how)
    rep = partition_mod.partition(gm, {**OPTS, "strict": False})
    assert rep.failure and not rep.entries, rep.summary()
    assert "planted" in rep.failure if how == "raise" else "lint" in rep.failure.lower() or "before" in rep.failure
    gm.graph.lint()
    assert gm.code == before
    with pytest.raises(Exception):
        partition_mod.partition(trace(m, _input(m), training=True, autocast=torch.float16), OPTS)  # strict


@pytest.mark.parametrize("inductor", [False, True])
def test_torch_compile_survives_a_partitioner_failure(monkeypatch, caplog, inductor):
    torch.manual_seed(0)
    m, ref = Chain(True), Chain(True)
    ref.load_state_dict(m.state_dict())
    x = _input(m)
    _planted(monkeypatch, "raise")
    backend = make_backend({"require_cuda": False, "select": "heuristic"}, inductor=inductor)
    torch._dynamo.reset()
    out = torch.compile(m, backend=backend)(x)
    out.sum().backward()
    ref_out = ref(x)
    ref_out.sum().backward()
    assert torch.allclose(out, ref_out, rtol=1e-4, atol=1e-5)
    rep = backend.report()
    assert rep.failure and "planted partitioner bug" in rep.failure
    assert "left whole to PyTorch" in caplog.text
    assert "planted partitioner bug" in str(rep)
