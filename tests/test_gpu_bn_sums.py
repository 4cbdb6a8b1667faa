"""GPU: OffloadOptions.bn_sums through Inductor on CUDA. A conv -> BN -> ReLU -> conv -> BN net's fp16-autocast training
step compiled by the backend with the batch norms' statistics as shifted sums (statistics.py), the convs left to
PyTorch (the rewrite alone, no kernel of this project to build): the loss and gradients against an fp32 truth no worse
than eager autocast's (the step tolerances of the family tests), the running statistics equal to the step's without
the option within fp32 rounding, and Inductor's generated kernels free of Welford reductions (what the rewrite is for:
without it, each batch norm's statistics are one)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from gpu_util import STEP_ABS as ABS, STEP_SLACK as SLACK, fp32_truth, training_step

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: Inductor's GPU code")]

CL = torch.channels_last
#: convs alone left to PyTorch, as the offload bench's cutlass_byoc-bnsums-only mode
ONLY_SUMS = {"fprop": False, "dgrad": False, "wgrad": False, "transposed": False, "max_pool": False,
             "batch_params": False, "strict": True}


def net():
    return nn.Sequential(nn.Conv2d(16, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 128, 1, bias=False), nn.BatchNorm2d(128))


def running_stats(model):
    return [t.clone() for m in model.modules() if isinstance(m, nn.BatchNorm2d) for t in (m.running_mean, m.running_var)]


def test_training_step_with_sums_vs_fp32_and_without_welford():
    from torch._inductor.utils import run_and_get_code

    from cutlass_byoc.offload import make_backend
    from cutlass_byoc.offload.bench import relative_errors

    torch.manual_seed(0)
    base = net().cuda().to(memory_format=CL).train()
    # 32 x 56 x 56 = 100,352 elements a channel: past Inductor's two-step threshold, a Welford reduction without the
    # option; an offset, so that the first conv's outputs have means apart from 0
    x = (torch.randn(32, 16, 56, 56, device="cuda") + 2.0).contiguous(memory_format=CL)
    truth = fp32_truth(copy.deepcopy(base), x)
    eager = training_step(copy.deepcopy(base), x, autocast=True)
    runs = {}
    for sums in (False, True):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        backend = make_backend({**ONLY_SUMS, "bn_sums": sums})
        compiled = torch.compile(model, backend=backend)
        out, code = run_and_get_code(training_step, compiled, x, True)
        torch.cuda.synchronize()
        runs[sums] = (out, running_stats(model), backend.report(), "\n".join(code))
    (plain, plain_rs, plain_rep, plain_code), (ours, ours_rs, rep, code) = runs[False], runs[True]
    e_eager, e_plain, e_ours = (relative_errors(*r, *truth) for r in (eager, plain, ours))
    print(f"\nrelative errors (loss, grad, worst param) vs fp32: eager fp16 {e_eager}, Welford {e_plain}, "
          f"shifted sums {e_ours}\n{rep.summary()}")
    assert rep.failure is None and rep.bn_sums == 2 and plain_rep.bn_sums == 0
    assert "welford" in plain_code and "welford" not in code
    assert e_ours[0] <= SLACK * e_eager[0] + ABS, (e_ours, e_eager)
    assert e_ours[1] <= SLACK * e_eager[1] + ABS, (e_ours, e_eager)
    for a, b in zip(ours_rs, plain_rs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
