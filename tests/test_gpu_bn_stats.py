"""GPU: OffloadOptions.fuse_bn_stats on a real model. A ResNet-18 (tests/models.py) fp16-autocast training step through
the backend with each batch norm's statistics taken from the conv's channel-statistics epilogue where its launch has
a twin: the loss and gradients against an fp32 truth no worse than eager autocast's (the step tolerances of the family
tests), the running statistics the batch norms keep equal to the unfused step's within fp16 rounding, the fused
kernels launched and nothing falling back.

The partitioned graphs run eagerly (``make_backend(inductor=False)``), as in the family tests: the kernels and the
graph's mean and variance from the sums are what ships; Inductor's own compile is covered by the offload benchmark."""

from __future__ import annotations

import copy

import pytest
import torch

from gpu_util import SM90_GPU, STEP_ABS as ABS, STEP_SLACK as SLACK, fp32_truth, training_step
from models import MODELS

pytestmark = SM90_GPU  # the channel-statistics kernels are sm90 conv kernels

CL = torch.channels_last
#: (model, batch, image) of this module (scripts/warm_cache.py compiles their kernels, twins included)
RUNS = [("resnet18", 8, 64)]


def running_stats(model):
    return [t.clone() for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)
            for t in (m.running_mean, m.running_var)]


@pytest.mark.parametrize("name, batch, image", RUNS)
def test_training_step_with_fused_statistics_vs_fp32(name, batch, image):
    from cutlass_byoc.offload import library, make_backend
    from cutlass_byoc.offload.bench import relative_errors

    torch.manual_seed(0)
    base = MODELS[name]().cuda().to(memory_format=CL).train()
    x = torch.randn(batch, 3, image, image, device="cuda").contiguous(memory_format=CL)
    truth = fp32_truth(copy.deepcopy(base), x)
    eager = training_step(copy.deepcopy(base), x, autocast=True)
    runs = {}
    for fuse in (False, True):
        torch._dynamo.reset()
        library.RUNTIME.clear()
        model = copy.deepcopy(base)
        backend = make_backend({"select": "heuristic", "strict": True, "fuse_bn_stats": fuse}, inductor=False)
        out = training_step(torch.compile(model, backend=backend), x, autocast=True)
        torch.cuda.synchronize()
        rep = backend.report()
        stats_calls = sum(s.calls for s in library._STATS_SITES)
        runs[fuse] = (out, running_stats(model), rep, stats_calls, dict(library.RUNTIME.fallbacks))
    (plain, plain_rs, _, _, _), (ours, ours_rs, rep, stats_calls, fallbacks) = runs[False], runs[True]
    e_eager, e_plain, e_ours = (relative_errors(*r, *truth) for r in (eager, plain, ours))
    print(f"\n{name}: relative errors (loss, grad, worst param) vs fp32: eager fp16 {e_eager}, unfused {e_plain}, "
          f"fused statistics {e_ours}; {rep.bn_stats} batch norms fused, {stats_calls} statistics launches\n"
          f"{rep.summary()}")
    assert rep.failure is None and rep.bn_stats > 0 and stats_calls >= rep.bn_stats
    assert not fallbacks, fallbacks
    assert e_ours[0] <= SLACK * e_eager[0] + ABS, (e_ours, e_eager)
    assert e_ours[1] <= SLACK * e_eager[1] + ABS, (e_ours, e_eager)
    for a, b in zip(plain_rs, ours_rs):  # running mean and (unbiased) variance: the same statistics
        assert torch.allclose(a, b, rtol=2e-3, atol=1e-3 * b.abs().max().item()), (a - b).abs().max()
