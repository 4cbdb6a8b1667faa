"""CPU tests of the wgrad overlap (OffloadOptions.overlap_wgrad): the partitioner turns the offloaded wgrads whose
result only leaves the graph into one chain of ``wgrad_site_async`` calls, each call's ``after`` holding what it
joins (so the compiled graph orders the calls and keeps every joined call's operands and output alive until its
join), the last call joining the rest; and a model compiled with it by Inductor trains like eager (on the CPU the op
runs its reference in line). The side stream itself runs on the GPU (tests/test_gpu_offload.py)."""

from __future__ import annotations

import pytest
import torch

from cutlass_byoc.offload import OffloadOptions, Pass, last_report
from cutlass_byoc.offload import library
from cutlass_byoc.offload.partition import offloaded_calls
from cutlass_byoc.offload.trace import explain
from models import MODELS

CL = torch.channels_last


def _joint(overlap: int, **kw):
    torch.manual_seed(0)
    model = MODELS["resnet18"](num_classes=10).to(memory_format=CL)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=CL)
    return explain(model, x, training=True, autocast=torch.bfloat16,
                   options=OffloadOptions(require_cuda=False, overlap_wgrad=overlap, **kw))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_wgrads_become_one_chain_that_joins_each_call_n_calls_later(n):
    gm, rep = _joint(n)
    calls = offloaded_calls(gm)
    chain = [c for c in calls if c.target is library.WGRAD_ASYNC]
    assert not [c for c in calls if c.target is library.WGRAD]  # every wgrad's result only leaves the graph
    assert len(chain) == rep.count(Pass.WGRAD) == 20 and rep.overlapped_wgrads == 19
    assert "19 wgrads on a side stream" in rep.summary()
    assert [c.args[3] for c in chain] == [n] * 19 + [0]
    order = {v: i for i, v in enumerate(gm.graph.nodes)}
    last = len(chain) - 1
    for i, c in enumerate(chain):
        go, x, _site, _overlap, after = c.args
        assert all(order[a] < order[c] for a in after)
        joins = range(max(0, i - n), i) if i == last else ([i - n] if i >= n else [])
        expect = [t for j in joins for t in (chain[j].args[0], chain[j].args[1], chain[j])]
        if i and chain[i - 1] not in expect:
            expect.append(chain[i - 1])  # orders the chain
        assert after == expect, (i, after, expect)
        assert all(u.op == "output" or u.target is library.WGRAD_ASYNC for u in c.users)
    # every call but the last is joined by exactly one later call, which holds its operands and output
    for j, c in enumerate(chain[:-1]):
        holders = [k for k, d in enumerate(chain) if all(t in d.args[4] for t in (c.args[0], c.args[1], c))]
        assert holders == [min(j + n, last)], (j, holders)


def test_off_by_default_and_a_wgrad_whose_result_the_graph_reads_stays_in_line():
    gm, rep = _joint(0)
    assert not [c for c in offloaded_calls(gm) if c.target is library.WGRAD_ASYNC] and rep.overlapped_wgrads == 0
    # cast fusion off: each wgrad's bf16 result is cast to fp32 in the graph, so it is read there: no chain
    gm, rep = _joint(1, fuse_casts=False)
    assert not [c for c in offloaded_calls(gm) if c.target is library.WGRAD_ASYNC] and rep.overlapped_wgrads == 0
    assert rep.count(Pass.WGRAD) == 20


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_overlap_option_is_checked(bad):
    with pytest.raises(ValueError, match="overlap_wgrad"):
        OffloadOptions(overlap_wgrad=bad)


def test_inductor_compiles_the_chain_and_computes_what_the_in_line_graph_does():
    """Inductor compiles the chain (its Tensor[] operands); the gradients are those of the same model compiled without
    the overlap, bit for bit (on the CPU both run the ops' reference), and the loss is eager's."""
    grads, losses = [], []
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=CL)
    for overlap in (0, 2):
        torch.manual_seed(0)
        m = MODELS["resnet18"](num_classes=10).to(memory_format=CL)
        torch._dynamo.reset()
        compiled = torch.compile(m, backend="cutlass_byoc",
                                 options={"require_cuda": False, "select": "heuristic", "overlap_wgrad": overlap})
        loss = compiled(x).square().sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in m.parameters()])
        rep = last_report()
        assert rep.overlapped_wgrads == (rep.count(Pass.WGRAD) - 1 if overlap else 0) and rep.count(Pass.WGRAD) == 20
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    ref = MODELS["resnet18"](num_classes=10).to(memory_format=CL)
    # (loosely: batch norm over 2 images at 1x1 in the last stage amplifies rounding differences)
    torch.testing.assert_close(losses[1], ref(x).square().sum().detach(), rtol=1e-2, atol=1e-3)


def test_the_overlap_composes_with_fused_batch_norm_statistics():
    """overlap_wgrad with fuse_bn_stats (the offload bench's cutlass_byoc-bnstats-overlap modes): both rewrites apply
    to one training graph (the statistics come from the fprop twins, the wgrads run as the chain), Inductor compiles
    it, and the step computes what the same model compiled with the statistics fused and every wgrad in line does,
    bit for bit (on the CPU both run the ops' reference)."""
    out = []
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=CL)
    for overlap in (0, 1):
        torch.manual_seed(0)
        m = MODELS["resnet18"](num_classes=10).to(memory_format=CL)
        torch._dynamo.reset()
        compiled = torch.compile(m, backend="cutlass_byoc", options={
            "require_cuda": False, "select": "heuristic", "fuse_bn_stats": True, "overlap_wgrad": overlap})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(x).float().square().sum()
        loss.backward()
        rep = last_report()
        out.append((loss.detach(), [p.grad for p in m.parameters()], rep))
    (loss0, grads0, rep0), (loss1, grads1, rep1) = out
    assert rep0.overlapped_wgrads == 0 and rep1.overlapped_wgrads == rep1.count(Pass.WGRAD) - 1 > 0, rep1.summary()
    assert rep1.bn_stats == rep0.bn_stats > 0, rep1.summary()
    assert torch.equal(loss1, loss0)
    for g0, g1 in zip(grads0, grads1):
        assert torch.equal(g1, g0)
