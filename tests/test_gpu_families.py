"""GPU: the model families the partitioner must never break (conv+bias+ReLU chains with and without pooling, a UNet
with transposed convs, concat and a 2-class 1x1 head, grouped convs, dilated convs at stride 1 and 2), each through
the real backend on the H200: one fp16-autocast training step against an fp32 reference, the backend's error no
worse than eager autocast's (within SLACK), no op falling back at run time.

The partitioned graphs run eagerly (``make_backend(inductor=False)``): Inductor's compile of each family would cost
device time and is covered by the CPU tests and the offload benchmark; the kernels are the ones that ship."""

from __future__ import annotations

import pytest
import torch

from gpu_util import STEP_ABS as ABS, STEP_SLACK as SLACK, backend_step_vs_eager
from models import FAMILIES, input_channels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (these tests run on the H200)"),
]

CL = torch.channels_last


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_training_step_vs_fp32(family):
    from cutlass_byoc.offload import library
    from cutlass_byoc.offload.bench import relative_errors

    torch.manual_seed(0)
    base = FAMILIES[family]().cuda().to(memory_format=CL).train()
    c = input_channels(base)
    x = torch.randn(8, c, 64, 64, device="cuda").contiguous(memory_format=CL)
    truth, eager, ours, backend = backend_step_vs_eager(base, x, {"select": "heuristic", "strict": True})
    e_eager = relative_errors(*eager, *truth)
    e_ours = relative_errors(*ours, *truth)
    rep = backend.report()
    print(f"\n{family}: relative errors (loss, grad, worst param) vs fp32: eager fp16 {e_eager}, backend {e_ours}; "
          f"kernel calls {dict(library.RUNTIME.kernel_calls)}\n{rep.summary()}")
    assert rep.failure is None and rep.offloaded
    assert not library.RUNTIME.fallbacks, library.RUNTIME.fallbacks
    assert sum(library.RUNTIME.kernel_calls.values()) >= len(rep.offloaded)
    assert e_ours[0] <= SLACK * e_eager[0] + ABS, (e_ours, e_eager)
    assert e_ours[1] <= SLACK * e_eager[1] + ABS, (e_ours, e_eager)
