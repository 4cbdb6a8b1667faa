"""CPU tests of OffloadOptions.bn_sums (statistics.py): each training batch norm's var_mean becomes one pass of
shifted sums.

The rewritten graph's mean and variance against a float64 reference on fresh random inputs (a large mean beside a
small spread, where plain sums of squares would cancel; BatchNorm1d/2d/3d shapes; an unbiased correction); which
var_means are taken and why the others are not (layer norm's, a dynamic shape, fp16, off CUDA); the joint graph of a
conv -> BN block through the backend; and a training step through the backend's eager variant that matches the one
without the option (loss, gradients, running statistics)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from cutlass_byoc.offload import OffloadOptions, make_backend
from cutlass_byoc.offload.statistics import match, rewrite_batch_statistics
from cutlass_byoc.offload.trace import explain

aten = torch.ops.aten


def var_mean_graph(shape, dims, correction=0, keepdim=True, dtype=torch.float32):
    """A graph var, mean = var_mean(x, dims) with fake-tensor metadata, as the joint graph holds it."""
    g = fx.Graph()
    x = g.placeholder("x")
    mode = FakeTensorMode()
    with mode:
        x.meta["val"] = torch.empty(shape, dtype=dtype)
        vm = g.call_function(aten.var_mean.correction, (x, dims), {"correction": correction, "keepdim": keepdim})
        vm.meta["val"] = aten.var_mean.correction(x.meta["val"], dims, correction=correction, keepdim=keepdim)
    var = g.call_function(operator.getitem, (vm, 0))
    mean = g.call_function(operator.getitem, (vm, 1))
    var.meta["val"], mean.meta["val"] = vm.meta["val"]
    g.output((var, mean))
    return g


def run(g: fx.Graph, x: torch.Tensor):
    return fx.GraphModule(torch.nn.Module(), g)(x)


@pytest.mark.parametrize("shape,dims,correction,keepdim", [
    ((8, 16, 12, 12), [0, 2, 3], 0, True),      # BatchNorm2d, as Inductor's decomposition asks
    ((8, 16, 12, 12), [0, 2, 3], 1, True),      # unbiased
    ((32, 24), [0], 0, True),                   # BatchNorm1d on (N, C)
    ((4, 8, 20), [0, 2], 0, False),             # BatchNorm1d on (N, C, L), without keepdim
    ((2, 8, 3, 4, 5), [0, 2, 3, 4], 0, True),   # BatchNorm3d
])
@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_the_sums_give_the_float64_mean_and_variance(shape, dims, correction, keepdim, offset):
    g = var_mean_graph(shape, dims, correction, keepdim)
    done, left = rewrite_batch_statistics(g, require_cuda=False)
    assert (done, left) == (1, [])
    assert not [n for n in g.nodes if n.target is aten.var_mean.correction]
    g.lint()
    torch.manual_seed(hash((shape, offset)) % 1000)
    # fp16 data as autocast stores it, per-channel means far from 0 (offset) and spreads of 0.01-1
    c = shape[1]
    scale = torch.logspace(-2, 0, c).view(1, c, *[1] * (len(shape) - 2))
    centre = (offset + torch.randn(c)).view(1, c, *[1] * (len(shape) - 2))
    x = (centre + scale * torch.randn(shape)).half().float()
    if len(shape) == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    var, mean = run(g, x)
    rv, rm = torch.var_mean(x.double(), dims, correction=correction, keepdim=keepdim)
    assert var.dtype is torch.float32 and mean.dtype is torch.float32
    assert var.shape == rv.shape and mean.shape == rm.shape
    torch.testing.assert_close(mean.double(), rm, rtol=1e-6, atol=0)
    # relative to each channel's variance (the smallest is 1e-4, next to means of 1000)
    torch.testing.assert_close(var.double(), rv, rtol=2e-5, atol=0)


def test_the_new_nodes_keep_the_var_means_provenance():
    """Inductor names a kernel after its nodes' original_aten ops (and the offload bench's profile tells the batch
    norms' statistics kernels by that name): the sums carry the var_mean's metadata, their own fake values."""
    g = var_mean_graph((4, 8, 6, 6), [0, 2, 3])
    vm = next(n for n in g.nodes if n.target is aten.var_mean.correction)
    vm.meta.update(original_aten=aten._native_batch_norm_legit_functional.default, stack_trace="model.py:7")
    rewrite_batch_statistics(g, require_cuda=False)
    new = [n for n in g.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert {n.target for n in new} >= {aten.sum.dim_IntList, aten.slice.Tensor, aten.clamp_min.default}
    for n in new:
        assert n.meta["original_aten"] is aten._native_batch_norm_legit_functional.default, n
        assert n.meta["stack_trace"] == "model.py:7" and isinstance(n.meta["val"], torch.Tensor), n
    sums = [n for n in new if n.target is aten.sum.dim_IntList]
    assert [tuple(n.meta["val"].shape) for n in sums] == [(1, 8, 1, 1)] * 2


def test_a_constant_channel_has_variance_zero_not_negative():
    g = var_mean_graph((4, 3, 5, 5), [0, 2, 3])
    rewrite_batch_statistics(g, require_cuda=False)
    x = torch.randn(4, 3, 5, 5)
    x[:, 1] = 7.25
    var, mean = run(g, x)
    assert var[0, 1].item() == 0.0 and mean[0, 1].item() == 7.25


@pytest.mark.parametrize("shape,dims,kw,why", [
    ((8, 16), [1], {}, "not every dimension but the channels"),          # layer norm's reduction
    ((8, 16, 4, 4), [0, 2, 3], {"dtype": torch.float16}, "float32 only"),
    ((1, 16, 1, 1), [0, 2, 3], {"correction": 1}, "correction 1"),        # one element a channel, unbiased
    ((8, 16, 4, 4), [0, 2, 3], {"require_cuda": True}, "not on CUDA"),
])
def test_what_is_left_to_inductor(shape, dims, kw, why):
    require_cuda = kw.pop("require_cuda", False)
    g = var_mean_graph(shape, dims, **kw)
    done, left = rewrite_batch_statistics(g, require_cuda=require_cuda)
    assert done == 0 and len(left) == 1 and why in left[0], left
    assert [n for n in g.nodes if n.target is aten.var_mean.correction]


def test_a_symbolic_shape_is_left():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: PLC0415

    g = var_mean_graph((8, 16, 4, 4), [0, 2, 3])
    x = next(iter(g.nodes))
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        x.meta["val"] = torch.empty(mode.shape_env.create_unbacked_symint(), 16, 4, 4)
    vm = next(n for n in g.nodes if n.target is aten.var_mean.correction)
    m, why = match(vm, require_cuda=False)
    assert m is None and why == "dynamic shape"


def bn_block():
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 1, bias=False), nn.BatchNorm2d(16))


def test_the_joint_graph_through_the_backend():
    torch.manual_seed(0)
    model = bn_block().to(memory_format=torch.channels_last).train()
    x = torch.randn(4, 8, 8, 8).contiguous(memory_format=torch.channels_last)
    opts = dict(require_cuda=False, strict=True)
    gm, rep = explain(model, x, training=True, autocast=torch.bfloat16, options=OffloadOptions(bn_sums=True, **opts))
    assert rep.bn_sums == 2 and "2 batch-norm statistics as shifted sums" in rep.summary()
    assert not [n for n in gm.graph.nodes if n.target is aten.var_mean.correction]
    gm, rep = explain(model, x, training=True, autocast=torch.bfloat16, options=OffloadOptions(**opts))
    assert rep.bn_sums == 2  # on by default
    gm, rep = explain(model, x, training=True, autocast=torch.bfloat16, options=OffloadOptions(bn_sums=False, **opts))
    assert rep.bn_sums == 0 and len([n for n in gm.graph.nodes if n.target is aten.var_mean.correction]) == 2
    gm, rep = explain(model.eval(), x, training=False, options=OffloadOptions(bn_sums=True, **opts))
    assert rep.bn_sums == 0  # eval: the running statistics, no var_mean


class _NormPair(nn.Module):
    """A conv -> BN block, then a layer norm over the channels (a var_mean over the last dimension)."""

    def __init__(self):
        super().__init__()
        self.block, self.ln = bn_block(), nn.LayerNorm(16)

    def forward(self, x):
        return self.ln(self.block(x).permute(0, 2, 3, 1))


def test_the_report_names_the_var_means_left_to_inductor():
    """The batch norm's statistics become sums; the layer norm's var_mean (over the last dimension) stays Inductor's,
    and the report says so, node by node, with the reason."""
    torch.manual_seed(0)
    model = _NormPair().to(memory_format=torch.channels_last).train()
    x = torch.randn(4, 8, 8, 8).contiguous(memory_format=torch.channels_last)
    gm, rep = explain(model, x, training=True, options=OffloadOptions(require_cuda=False, strict=True))
    assert rep.bn_sums == 2 and len(rep.bn_sums_left) == 1, rep.summary()
    assert "not every dimension but the channels" in rep.bn_sums_left[0]
    assert "[inductor]  var_mean " in rep.summary()
    assert len([n for n in gm.graph.nodes if n.target is aten.var_mean.correction]) == 1
    merged = rep.merge(rep)
    assert merged.bn_sums == 4 and len(merged.bn_sums_left) == 2


@pytest.mark.parametrize("inductor", [False, True], ids=["eager-variant", "inductor"])
def test_a_training_step_matches_the_one_without(inductor):
    """torch.compile on the CPU in fp32 (the backend's eager variant, or Inductor compiling the rewritten joint
    graph): loss, gradients and running statistics of a step with the sums equal the step without them, to fp32
    rounding."""
    def step(sums: bool):
        torch.manual_seed(0)
        model = bn_block().to(memory_format=torch.channels_last).train()
        x = torch.randn(4, 8, 8, 8).contiguous(memory_format=torch.channels_last) + 3.0
        torch._dynamo.reset()
        backend = make_backend(require_cuda=False, inductor=inductor, bn_sums=sums, strict=True)
        f = torch.compile(model, backend=backend)
        loss = f(x).float().square().mean()
        loss.backward()
        return (loss.detach(), [p.grad.clone() for p in model.parameters()], model[1].running_var.clone(),
                model[4].running_mean.clone(), backend.reports)

    loss, grads, rv, rm, reports = step(True)
    assert sum(r.bn_sums for r in reports) == 2
    loss0, grads0, rv0, rm0, reports0 = step(False)
    assert sum(r.bn_sums for r in reports0) == 0
    torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, grads0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rv, rv0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rm, rm0, rtol=1e-5, atol=1e-6)
