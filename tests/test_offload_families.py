"""CPU tests: model families the partitioner must never break (issue: conv+bias+ReLU chains crashed the compile).

Each family is partitioned forward and backward on fake tensors with ``strict=True`` (any partitioner error fails the
test) and every convolution pass gets the expected offloaded/left decision; each family also runs through
``torch.compile`` with the eager AOT variant of the backend on the CPU, against eager. A planted partitioner failure
shows that ``torch.compile`` still compiles and runs the model, with the reason in the report.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from cutlass_byoc.offload import Pass, explain, make_backend
from cutlass_byoc.offload import library
from models import FAMILIES, Chain, Dilated, Grouped, UNet

partition_mod = sys.modules["cutlass_byoc.offload.partition"]

CL = torch.channels_last
OPTS = {"require_cuda": False, "select": "heuristic", "strict": True}


def _input(model: nn.Module) -> torch.Tensor:
    c = 8 if isinstance(model, (Grouped, Dilated)) else 3
    return torch.randn(2, c, 16, 16)


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
    assert rep.count(Pass.DGRAD) == 10 and rep.count(Pass.WGRAD) == 11, rep.summary()
    left = rep.rejected
    # only the backward of the two transposed convs stays in PyTorch, with its reason
    assert left and all(e.reason.startswith("transposed") for e in left), rep.summary()
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
@pytest.mark.parametrize("family", ["chain", "chain_pool", "unet", "grouped", "dilated"])
def test_family_through_torch_compile_eager_backend(family):
    torch.manual_seed(0)
    m = FAMILIES[family]()
    ref = type(m)(*( [m.pool] if isinstance(m, Chain) else []))
    ref.load_state_dict(m.state_dict())
    x = _input(m)
    backend = make_backend(OPTS, inductor=False)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend=backend)
    library.RUNTIME.clear()
    out = compiled(x)
    out.square().sum().backward()
    ref_out = ref(x)
    ref_out.square().sum().backward()
    assert torch.allclose(out, ref_out, rtol=1e-4, atol=1e-5)
    for (n, p), r in zip(m.named_parameters(), ref.parameters()):
        err = (p.grad - r.grad).norm() / r.grad.norm().clamp_min(1e-12)
        assert err < 1e-4, f"{n}: {err:.2e}"
    rep = backend.report()
    assert rep.failure is None and rep.offloaded, rep.summary()
    assert library.RUNTIME.reference_calls >= len(rep.offloaded)  # the offloaded ops ran (their CPU reference)


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
