"""GPU tests of the batched parameter ops (offload/batching.py): ``cutlass_byoc::cast_params`` against ``Tensor.to``
on CUDA (PyTorch's multi-tensor copy: several launches, misaligned and channels_last operands), and a compiled fp16
training step under CUDA graphs computing the same with and without the batching."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpu_util import sgd_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the offload GPU tests run on the H200)"),
]

CL = torch.channels_last


def _poisoned_allocator(numel: int) -> None:
    """Leave a NaN-filled block of this size in the caching allocator, so a fresh output that is not written reads
    NaN."""
    torch.full((numel,), float("nan"), device="cuda", dtype=torch.float16)  # freed at once, kept by the allocator


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_params_on_cuda_matches_to(dtype):
    from cutlass_byoc.offload import library

    torch.manual_seed(1)
    base = torch.randn(4097, device="cuda")
    xs = [torch.randn(2048, 1024, 3, 3, device="cuda").contiguous(memory_format=CL),  # 18.9M: several launches
          torch.randn(64, 3, 7, 7, device="cuda").contiguous(memory_format=CL),
          torch.randn(1000, 2048, device="cuda"), torch.randn(1000, device="cuda"),
          base[1:1 + 4095],  # 4-byte aligned only
          *[torch.randn(i + 1, device="cuda") for i in range(130)]]  # more tensors than one launch takes
    _poisoned_allocator(sum(x.numel() for x in xs) * 2)
    outs = library.CAST_PARAMS(xs, dtype)
    torch.cuda.synchronize()
    for x, y in zip(xs, outs):
        assert y.dtype == dtype and y.stride() == x.stride() and y.device == x.device
        assert torch.equal(y, x.to(dtype))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(16, 64, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(64)
        self.c2 = nn.Conv2d(64, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.c3 = nn.Conv2d(64, 128, 1)
        self.fc = nn.Linear(128, 10)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x)))
        y = F.relu(self.bn2(self.c2(y)) + y)
        return self.fc(self.c3(y).mean((2, 3)))


def test_training_under_cuda_graphs_matches_unbatched():
    """Three fp16-autocast SGD steps of the compiled model under CUDA graphs (the third replays the graph), the
    offloaded convs deterministic: the losses, the final weights and the batch norms' buffers are the same with the
    parameter ops batched and with a kernel each."""
    from cutlass_byoc.offload import make_backend

    results = []
    for batch in (True, False):
        torch.manual_seed(0)
        m = Net().cuda().to(memory_format=CL)
        xs = [torch.randn(8, 16, 16, 16, device="cuda").contiguous(memory_format=CL) for _ in range(3)]
        torch._dynamo.reset()
        backend = make_backend(select="heuristic", batch_params=batch, cudagraphs=True, deterministic=True)
        run = torch.compile(m, backend=backend)
        losses = sgd_steps(run, m, xs)
        (rep,) = [r for r in backend.reports if "joint" in r.graph]
        # casts: the weights of the 3 convs and the fc, the biases of c2, c3 and the fc, and the batch; counters: the
        # two batch norms' num_batches_tracked
        assert (rep.batched_casts, rep.batched_counters) == ((8, 2) if batch else (0, 0)), rep.summary()
        assert [int(b.num_batches_tracked) for b in (m.bn, m.bn2)] == [3, 3]
        results.append((losses, [t.detach().clone() for t in (*m.parameters(), *m.buffers())]))
    (l1, w1), (l2, w2) = results
    # the same values; Inductor may order a reduction differently in the two graphs, so not bitwise
    assert l1 == pytest.approx(l2, rel=1e-5)
    for a, b in zip(w1, w2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
