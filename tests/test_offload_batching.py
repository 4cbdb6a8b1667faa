"""CPU tests of the batched parameter ops (offload/batching.py, OffloadOptions.batch_params): the
``cutlass_byoc::cast_params`` op against ``Tensor.to``, which casts and counter increments of a graph are batched and
which are left alone, and models compiled with and without it computing the same."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from cutlass_byoc.offload import OffloadOptions, make_backend
from cutlass_byoc.offload import library
from cutlass_byoc.offload.batching import batch_counters, batch_param_casts
from cutlass_byoc.offload.trace import explain
from models import MODELS, conv_counts

CL = torch.channels_last
prims = torch.ops.prims
CPU = OffloadOptions(require_cuda=False)


def _operands():
    base = torch.randn(1000)
    return [torch.randn(16, 8, 3, 3).contiguous(memory_format=CL), torch.randn(10, 7), torch.randn(5),
            base[1:1 + 33].view(3, 11), torch.randn(4, 3, 2, 2).permute(0, 2, 3, 1)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_params_matches_to_with_the_same_strides(dtype):
    xs = _operands()
    torch.library.opcheck(library.CAST_PARAMS, (xs, dtype), test_utils=("test_schema", "test_faketensor"))
    outs = library.CAST_PARAMS(xs, dtype)
    assert len(outs) == len(xs)
    for x, y in zip(xs, outs):
        assert y.dtype == dtype and y.shape == x.shape and y.stride() == x.stride()
        assert torch.equal(y, x.to(dtype))
    assert library.CAST_PARAMS([], dtype) == []


def test_resnet50_training_graph_batches_every_parameter_cast():
    """The joint graph of ResNet-50 under bf16 autocast: every conv weight, the fc weight and bias and the batch are
    cast in one cast_params call; no cast of a graph input is left."""
    torch.manual_seed(0)
    model = MODELS["resnet50"](num_classes=10).to(memory_format=CL)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=CL)
    gm, rep = explain(model, x, training=True, autocast=torch.bfloat16, options=CPU)
    calls = [n for n in gm.graph.nodes if n.target is library.CAST_PARAMS]
    assert len(calls) == 1
    (call,) = calls
    inputs = call.args[0]
    assert all(n.op == "placeholder" for n in inputs) and call.args[1] is torch.bfloat16
    assert len(inputs) == conv_counts(model)["all"] + 3  # conv weights, fc weight and bias, the batch
    assert rep.batched_casts == len(inputs) and f"{len(inputs)} parameter casts batched" in rep.summary()
    left = [n for n in gm.graph.nodes if n.target is prims.convert_element_type.default
            and getattr(n.args[0], "op", None) == "placeholder"]
    assert not left
    # every result is read through its own getitem, which carries the cast's metadata
    items = sorted(call.users, key=lambda n: n.args[1])
    assert [n.target for n in items] == [operator.getitem] * len(inputs)
    for n, src in zip(items, inputs):
        assert n.meta["val"].dtype is torch.bfloat16 and n.meta["val"].stride() == src.meta["val"].stride()
    gm.graph.lint()


def test_option_off_leaves_the_casts():
    torch.manual_seed(0)
    model = MODELS["resnet18"](num_classes=10).to(memory_format=CL)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=CL)
    gm, rep = explain(model, x, training=True, autocast=torch.bfloat16,
                      options=OffloadOptions(require_cuda=False, batch_params=False))
    assert not [n for n in gm.graph.nodes if n.target is library.CAST_PARAMS] and rep.batched_casts == 0


def _graph(*vals) -> tuple[fx.Graph, list[fx.Node]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = fx.Graph()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    nodes = []
    for i, v in enumerate(vals):
        p = g.placeholder(f"p{i}")
        p.meta["val"] = mode.from_tensor(v)
        nodes.append(p)
    return g, nodes


def _cast(g: fx.Graph, p: fx.Node, dtype) -> fx.Node:
    n = g.call_function(prims.convert_element_type.default, (p, dtype))
    v = p.meta["val"]
    with v.fake_mode:
        n.meta["val"] = prims.convert_element_type.default(v, dtype)
    return n


def test_what_is_left_alone():
    """Single casts, casts of computed values, integer sources, non-dense inputs and (with require_cuda) CPU tensors
    stay as they are; groups form by dtype pair."""
    a, b, c = torch.randn(4, 4), torch.randn(8), torch.randn(3, 3)
    wide = torch.randn(4, 8)[:, ::2]  # strided, not dense
    ints = torch.arange(6)
    g, (pa, pb, pc, pw, pi) = _graph(a, b, c, wide, ints)
    ca, cb = _cast(g, pa, torch.float16), _cast(g, pb, torch.float16)
    cc = _cast(g, pc, torch.bfloat16)  # alone in its group
    cw = _cast(g, pw, torch.float16)
    ci = _cast(g, pi, torch.float16)
    rel = g.call_function(torch.ops.aten.relu.default, (pa,))
    rel.meta["val"] = pa.meta["val"]
    cr = _cast(g, rel, torch.float16)  # a computed value
    g.output((ca, cb, cc, cw, ci, cr))
    assert batch_param_casts(g, require_cuda=True) == 0  # CPU tensors
    assert batch_param_casts(g, require_cuda=False) == 2
    (call,) = [n for n in g.nodes if n.target is library.CAST_PARAMS]
    assert call.args == ([pa, pb], torch.float16)
    kept = [n for n in g.nodes if n.target is prims.convert_element_type.default]
    assert kept == [cc, cw, ci, cr]
    g.lint()


def _add(g: fx.Graph, p: fx.Node, n) -> fx.Node:
    node = g.call_function(torch.ops.aten.add.Tensor, (p, n))
    v = p.meta["val"]
    with v.fake_mode:
        node.meta["val"] = torch.ops.aten.add.Tensor(v, n)
    return node


def test_incoming_gradients_are_not_batched_with_the_forward_inputs():
    """A joint graph's tangents are known only in the backward: a cast of one stays where it is (batched with the
    parameters' casts, it took them into the backward, and AOTAutograd's partitioner failed: fuzz seeds 8049, 8060,
    8113)."""
    g = fx.Graph()
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    ps = []
    for name in ("primals_1", "primals_2", "tangents_1", "tangents_2"):
        p = g.placeholder(name)
        p.meta["val"] = mode.from_tensor(torch.randn(4, 4))
        ps.append(p)
    casts = [_cast(g, p, torch.bfloat16) for p in ps]
    g.output(tuple(casts))
    assert batch_param_casts(g, require_cuda=False) == 2
    (call,) = [n for n in g.nodes if n.target is library.CAST_PARAMS]
    assert call.args[0] == ps[:2]
    assert [n for n in g.nodes if n.target is prims.convert_element_type.default] == casts[2:]


def test_which_counters_are_batched():
    """0-dim integer inputs plus the same int, per (dtype, addend); not floats, not tensors with elements, not a
    group of one."""
    g, ps = _graph(torch.tensor(3), torch.tensor(5), torch.tensor(7), torch.tensor(1.0), torch.tensor([4]),
                   torch.tensor(2, dtype=torch.int32))
    adds = [_add(g, ps[0], 1), _add(g, ps[1], 1), _add(g, ps[2], 2), _add(g, ps[3], 1), _add(g, ps[4], 1),
            _add(g, ps[5], 1)]
    g.output(tuple(adds))
    assert batch_counters(g, require_cuda=False) == 2
    (call,) = [n for n in g.nodes if n.target is torch.ops.aten._foreach_add.Scalar]
    assert call.args == ([ps[0], ps[1]], 1)
    assert [n for n in g.nodes if n.target is torch.ops.aten.add.Tensor] == adds[2:]
    g.lint()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        y = F.relu(self.bn1(self.c1(x)))
        return self.fc(F.relu(self.bn2(self.c2(y)) + y).mean((2, 3)))


@pytest.mark.parametrize("inductor", [False, True])
def test_compiled_training_under_autocast_matches_unbatched(inductor):
    """torch.compile (Inductor on the CPU, or the eager variant) under bf16 autocast, two steps: the losses, every
    gradient and the batch norms' buffers (running statistics, num_batches_tracked: the batched increments still
    reach the module) are the same with the parameter ops batched as with a kernel each."""
    results = []
    for batch in (True, False):
        torch.manual_seed(0)
        m = Net().to(memory_format=CL)
        xs = [torch.randn(2, 8, 8, 8).contiguous(memory_format=CL) for _ in range(2)]
        torch._dynamo.reset()
        backend = make_backend(require_cuda=False, select="heuristic", batch_params=batch, inductor=inductor)
        run = torch.compile(m, backend=backend)
        losses = []
        for x in xs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = run(x).float().square().sum()
            loss.backward()
            losses.append(loss.detach())
        (rep,) = [r for r in backend.reports if "joint" in r.graph]
        # conv and fc weights, c2's and the fc's biases, the batch; the two batch norms' counters
        assert (rep.batched_casts, rep.batched_counters) == ((6, 2) if batch else (0, 0)), rep.summary()
        assert [int(b.num_batches_tracked) for b in (m.bn1, m.bn2)] == [2, 2]
        results.append((losses, [p.grad.clone() for p in m.parameters()], [b.clone() for b in m.buffers()]))
    (l1, g1, b1), (l2, g2, b2) = results
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    for a, b in zip(g1 + b1, g2 + b2):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_counters_of_resnet18_batched_in_its_compiled_graph():
    """torch.compile's functionalized joint graph of ResNet-18 (eager variant): each batch norm's num_batches_tracked
    increment is one output of a single _foreach_add, and the module's counters advance once per step."""
    torch.manual_seed(0)
    m = MODELS["resnet18"](num_classes=10).to(memory_format=CL)
    backend = make_backend(require_cuda=False, select="heuristic", inductor=False)
    run = torch.compile(m, backend=backend)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            run(torch.randn(2, 3, 32, 32).contiguous(memory_format=CL)).float().sum().backward()
    bns = [b for b in m.modules() if isinstance(b, nn.BatchNorm2d)]
    (rep,) = [r for r in backend.reports if "joint" in r.graph]
    assert rep.batched_counters == len(bns) == 20 and f"{len(bns)} counter increments batched" in rep.summary()
    assert rep.batched_casts == conv_counts(m)["all"] + 3
    assert all(int(b.num_batches_tracked) == 2 for b in bns)
