"""CPU tests of OffloadOptions.fuse_bn_stats: a training batch norm's statistics after an offloaded conv come from the
conv's channel-statistics epilogue (the op cutlass_byoc::fprop_stats_site) instead of a var_mean over its output.

On fake tensors, the joint graph of conv -> BN blocks: which convs are fused (the sm90 launches' twins), which are not
and why (a launch without a twin, a bias, the option off, eval mode), and that no var_mean of a fused conv's output is
left. Through the backend's eager variant on CPU (the ops' PyTorch reference, which computes the sums the kernel would:
fp32 sums of the stored y), a training step equals the unfused one."""

from __future__ import annotations

import torch
import torch.nn as nn

from cutlass_byoc.offload import OffloadOptions, library, make_backend
from cutlass_byoc.offload.trace import explain

aten = torch.ops.aten


def block(c_in=16, bias=False):
    """conv1x1 (16 -> 32: its untuned launch a GEMM-family kernel here, no twin) -> BN -> ReLU -> conv3x3 (32 -> 64:
    sm90) -> BN, then a conv with a bias and its BN."""
    return nn.Sequential(nn.Conv2d(c_in, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 64, 1, bias=True), nn.BatchNorm2d(64))


def partitioned(model, training=True, **opts):
    torch.manual_seed(0)
    model = model.to(memory_format=torch.channels_last).train(training)
    x = torch.randn(4, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    return explain(model, x, training=training, autocast=torch.bfloat16,
                   options=OffloadOptions(require_cuda=False, strict=True, **opts))


def targets(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def test_fused_where_the_launch_has_a_twin_and_noted_where_not():
    gm, rep = partitioned(block(), fuse_bn_stats=True)
    assert rep.bn_stats == 1 and "1 batch-norm statistics" in rep.summary()
    fprops = {e.node: e for e in rep.offloaded if e.kind.value == "fprop"}
    first, second, third = (fprops[n] for n in ("convolution", "convolution_1", "convolution_2"))
    # the second conv's sm90 launch has its twin: that kernel is prebuilt and launched
    assert "bn_stats" in second.fused and "_chstats_" in second.kernel
    assert second.kernel in {launch.name for launch in rep.launches}
    # the first conv's launch (a GEMM-family kernel) has none; the third fuses its bias, so its epilogue is not plain
    assert any("no channel-statistics twin" in n for n in first.notes), first.line()
    assert "bias" in third.fused and any("bias or residual" in n for n in third.notes), third.line()
    assert len(targets(gm, library.FPROP_STATS)) == 1 and len(targets(gm, library.FPROP)) == 2
    # the two unfused convs' batch norms: shifted sums (bn_sums, on by default), or Inductor's var_mean without them
    assert rep.bn_sums == 2 and not targets(gm, aten.var_mean.correction)
    gm, rep = partitioned(block(), fuse_bn_stats=True, bn_sums=False)
    assert rep.bn_stats == 1 and rep.bn_sums == 0 and len(targets(gm, aten.var_mean.correction)) == 2


def test_off_by_default_and_in_eval():
    gm, rep = partitioned(block(), bn_sums=False)
    assert rep.bn_stats == 0 and not targets(gm, library.FPROP_STATS)
    assert len(targets(gm, aten.var_mean.correction)) == 3
    gm, rep = partitioned(block())  # the default's shifted sums take all three
    assert rep.bn_stats == 0 and rep.bn_sums == 3 and not targets(gm, library.FPROP_STATS)
    gm, rep = partitioned(block(), training=False, fuse_bn_stats=True)  # eval: the running statistics, no var_mean
    assert rep.bn_stats == 0 and not targets(gm, library.FPROP_STATS)


def test_a_training_step_equals_the_unfused_one():
    """The eager variant (no Inductor) on CPU: the fused ops' reference computes y and its fp32 sums, the graph the
    mean and variance from them; loss, gradients and running statistics match the unfused backend's."""
    def step(fuse: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                              nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64))
        model = model.to(memory_format=torch.channels_last).train()
        x = torch.randn(4, 16, 8, 8).contiguous(memory_format=torch.channels_last)
        backend = make_backend(require_cuda=False, inductor=False, fuse_bn_stats=fuse)
        f = torch.compile(model, backend=backend)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = f(x).float().square().mean()
        loss.backward()
        return (loss.detach(), [p.grad.clone() for p in model.parameters()], model[1].running_var.clone(),
                model[4].running_mean.clone(), backend.reports)

    torch._dynamo.reset()
    loss0, grads0, rv0, rm0, _ = step(False)
    torch._dynamo.reset()
    loss1, grads1, rv1, rm1, reports = step(True)
    assert sum(r.bn_stats for r in reports) >= 1, [r.summary() for r in reports]
    assert torch.allclose(loss0, loss1, rtol=1e-4)
    for g0, g1 in zip(grads0, grads1):
        assert torch.allclose(g0, g1, rtol=1e-3, atol=1e-5 * g0.abs().max().item())
    assert torch.allclose(rv0, rv1, rtol=1e-4) and torch.allclose(rm0, rm1, rtol=1e-4, atol=1e-6)


def test_not_fused_when_deterministic_algorithms_are_required():
    """The kernels add their sums with atomicAdd (run-to-run differences in the last bits)."""
    torch.use_deterministic_algorithms(True)
    try:
        gm, rep = partitioned(block(), fuse_bn_stats=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert rep.bn_stats == 0 and not targets(gm, library.FPROP_STATS)


def test_the_statistics_site_refuses_operands_it_was_not_compiled_for():
    """A changed shape, type or layout takes the op's general path (y on the plain path, the sums on PyTorch), never
    the kernel: checked before anything is launched (the site's twin is set by hand, so no kernel is loaded)."""
    from cutlass_byoc.config import LaunchConfig
    from cutlass_byoc.problem import Conv2dProblem
    from cutlass_byoc.sm90 import sm90_config

    p = Conv2dProblem.make("fprop", 4, 64, 8, 8, 64, 1)
    site = library.StatsSite(p, "heuristic")
    site.launch = LaunchConfig(sm90_config(p, (128, 64, 64)).with_channel_stats())
    cl = torch.channels_last

    class Cuda(torch.Tensor):  # a CPU tensor that says it is on CUDA, so the site gets past its device check
        is_cuda = True

    def op(shape, dtype=torch.float16, fmt=cl):
        return torch.empty(shape, dtype=dtype).contiguous(memory_format=fmt).as_subclass(Cuda)

    w = op((64, 64, 1, 1))
    assert site(op((4, 64, 8, 9)), w) is None  # shape
    assert site(op((4, 64, 8, 8), torch.bfloat16), w) is None  # type
    assert site(op((4, 64, 8, 8), fmt=torch.contiguous_format), w) is None  # layout
    assert site.calls == 0
