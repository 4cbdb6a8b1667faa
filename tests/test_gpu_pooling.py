"""GPU tests of the max-pool ops (offload/pooling.py, offload/pool_kernels.py): the Triton forward and both backward
kernels (the cells of at most two windows a row, and the gather over taps for the other pools) against float64
references on fresh random inputs, outputs poisoned first (ties, NaN, -inf, padding, ceil_mode,
dilation, both layouts, fp16/bf16/fp32, ResNet-50's stem pool, one gradient or the sum of two); the rewrite found in ResNet-50's joint graph on
CUDA, the add of its gradient taken into the backward; a compiled fp16 training step, with and without CUDA graphs,
computing what the same step computes with the pools left to Inductor."""

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
#: (N, C, H, W, kernel, stride, padding, dilation, ceil_mode, channels_last)
CASES = [
    (32, 64, 112, 112, 3, 2, 1, 1, False, True),  # ResNet-50's stem pool at batch 32
    (2, 24, 17, 19, 3, 2, 1, 1, False, True),
    (2, 24, 17, 19, 3, 2, 1, 1, True, True),
    (3, 70, 16, 16, 2, 2, 0, 1, False, True),  # non-overlapping windows; channels past a block of 64
    (2, 5, 13, 11, 3, 1, 1, 2, False, False),  # dilation, NCHW
    (1, 8, 9, 9, 5, 3, 2, 1, True, True),
    (2, 3, 8, 8, 3, 2, 1, 1, False, False),
    (2, 16, 12, 12, 5, 2, 2, 1, False, True),  # three windows hold an element in a row: the gather kernel
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _input(n, c, h, w, channels_last, dtype, specials):
    """Values drawn from a few levels, so that windows hold ties, and (specials) NaN and -inf here and there."""
    x = torch.randint(-4, 5, (n, c, h, w), device="cuda").to(dtype) / 2
    if specials:
        flat = x.view(-1)
        pick = torch.randperm(flat.numel(), device="cuda")[: max(flat.numel() // 97, 2)]
        flat[pick[: len(pick) // 2]] = float("nan")
        flat[pick[len(pick) // 2:]] = float("-inf")
        x[0, 0, :3, :3] = float("-inf")  # a window of -inf only
    return x.contiguous(memory_format=CL) if channels_last else x.contiguous()


def _poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.dtype.is_floating_point else t.fill_(99)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:4])) + f"_k{c[4]}s{c[5]}p{c[6]}d{c[7]}"
                         + ("_ceil" if c[8] else "") + ("_cl" if c[9] else "_nchw"))
def test_forward_and_backward_match_float64(case, dtype):
    from cutlass_byoc.offload import pool_kernels, pooling

    n, c, h, w, k, s, p, d, ceil, cl = case
    torch.manual_seed(hash(case) % 1000)
    x = _input(n, c, h, w, cl, dtype, specials=n * c * h * w < 10**6)
    kernel, stride, padding, dilation = [k, k], [s, s], [p, p], [d, d]
    vals, offsets = pooling._fwd_outputs(x, kernel, stride, padding, dilation, ceil)
    _poison(vals), _poison(offsets)
    pool_kernels.max_pool2d_fwd(x, vals, offsets, kernel, stride, padding, dilation)
    # the float64 reference: ATen's CUDA pooling (eager's rules for ties and NaN) in double
    ref_vals, ref_idx = torch.ops.aten.max_pool2d_with_indices(x.double(), kernel, stride, padding, dilation, ceil)
    assert vals.shape == ref_vals.shape and vals.stride() == offsets.stride()
    assert vals.is_contiguous(memory_format=CL if cl else torch.contiguous_format)
    torch.testing.assert_close(vals.double(), ref_vals, rtol=0, atol=0, equal_nan=True)
    idx = pooling.offsets_to_indices(offsets, w, kernel, stride, padding, dilation)
    assert torch.equal(idx, ref_idx), "the maxima's positions differ from ATen's (ties, NaN, -inf)"

    g = torch.randn(vals.shape, device="cuda").to(dtype)
    g = g.contiguous(memory_format=CL) if cl else g.contiguous()
    g2 = torch.randn(vals.shape, device="cuda").to(dtype)  # a second gradient (the windows' gradient: g + g2),
    g2 = g2.contiguous() if cl else g2.contiguous(memory_format=CL)  # in the other layout: its strides are its own
    # fp32 sums of at most a few terms, stored in the input's dtype: within its rounding of the float64 sum
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[dtype]
    for second in (None, g2):
        gw = g.double() if second is None else g.double() + second.double()
        ref = torch.ops.aten.max_pool2d_with_indices_backward(gw, x.double(), kernel, stride, padding, dilation,
                                                              ceil, ref_idx)
        for cells in (False, True):  # the gather, and the cell kernel where it takes the pool
            what = f"cells={cells}, grad2={second is not None}"
            grad_input = pooling._bwd_output(g, list(x.shape), cl)
            _poison(grad_input)
            pool_kernels.max_pool2d_bwd(g, offsets, grad_input, kernel, stride, padding, dilation, cells=cells,
                                        grad2=second)
            assert grad_input.is_contiguous(memory_format=CL if cl else torch.contiguous_format)
            assert not grad_input.isnan().any(), f"an element of the input's gradient was not written ({what})"
            torch.testing.assert_close(grad_input.double(), ref, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def test_ops_on_cuda_match_aten_through_the_dispatcher():
    """The registered ops (the graph's calls) on CUDA: values, and the input's gradient, as ATen's."""
    from cutlass_byoc.offload import pooling

    torch.manual_seed(3)
    x = torch.randn(4, 32, 28, 28, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    vals, offsets = pooling.FWD(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
    ref_vals, ref_idx = torch.ops.aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
    assert torch.equal(vals, ref_vals) and vals.stride() == ref_vals.stride()
    g = torch.randn_like(vals)
    gi = pooling.BWD(g, offsets, list(x.shape), [3, 3], [2, 2], [1, 1], [1, 1], False, True)
    ref = torch.ops.aten.max_pool2d_with_indices_backward(g.float(), x.float(), [3, 3], [2, 2], [1, 1], [1, 1], False,
                                                          ref_idx).half()
    assert gi.stride() == x.stride()
    torch.testing.assert_close(gi, ref, rtol=1e-3, atol=1e-3)
    g2 = torch.randn_like(vals)
    gi = pooling.BWD(g, offsets, list(x.shape), [3, 3], [2, 2], [1, 1], [1, 1], False, True, g2)
    ref = torch.ops.aten.max_pool2d_with_indices_backward(g.float() + g2.float(), x.float(), [3, 3], [2, 2], [1, 1],
                                                          [1, 1], False, ref_idx).half()
    torch.testing.assert_close(gi, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("channels_last", [True, False], ids=["cl", "nchw"])
def test_backward_fallback_on_cuda_is_atens(monkeypatch, channels_last):
    """Where the kernels cannot run (pooling._kernels_for gives None), the backward is ATen's on CUDA: its gradient
    (one, or the sum of two) bitwise, in the input's layout, the output poisoned first."""
    from cutlass_byoc.offload import pooling

    torch.manual_seed(5)
    x = _input(2, 24, 17, 19, channels_last, torch.float16, specials=False)
    args = ([3, 3], [2, 2], [1, 1], [1, 1])
    vals, offsets = pooling.FWD(x, *args, False)
    _, ref_idx = torch.ops.aten.max_pool2d_with_indices(x, *args, False)
    made = []

    def poisoned_output(*a, **k):
        out = _poison(real_output(*a, **k))
        made.append(out)
        return out

    real_output = pooling._bwd_output
    monkeypatch.setattr(pooling, "_kernels_for", lambda *a: None)
    monkeypatch.setattr(pooling, "_bwd_output", poisoned_output)
    g, g2 = torch.randn_like(vals), torch.randn_like(vals)
    for extra in ((), (g2,)):
        gi = pooling.BWD(g, offsets, list(x.shape), *args, False, channels_last, *extra)
        total = g.float() + (g2.float() if extra else 0)
        ref = torch.ops.aten.max_pool2d_with_indices_backward(total, x.float(), *args, False, ref_idx).half()
        assert made and gi.data_ptr() == made[-1].data_ptr()  # the poisoned output is what came back, all written
        assert torch.equal(gi, ref) and gi.stride() == x.stride()


def test_resnet50_joint_graph_on_cuda_takes_the_stem_pool():
    """The joint graph of ResNet-50 as this torch build traces it on CUDA (fp16 autocast): its one max pool is
    rewritten, whichever form the build's decompositions give the backward."""
    torchvision = pytest.importorskip("torchvision")
    from cutlass_byoc.offload import OffloadOptions, pooling
    from cutlass_byoc.offload.trace import explain

    model = torchvision.models.resnet50().cuda().to(memory_format=CL)
    x = torch.randn(2, 3, 64, 64, device="cuda").contiguous(memory_format=CL)
    gm, rep = explain(model, x, training=True, autocast=torch.float16,
                      options=OffloadOptions(select="heuristic", prebuild=False))
    assert rep.max_pools == 1, (rep.max_pools_left, rep.summary())
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(pooling.FWD) == 1 and targets.count(pooling.BWD) == 1
    assert torch.ops.aten.max_pool2d_with_indices_backward.default not in targets
    assert torch.ops.aten.scatter_add.default not in targets
    (bwd,) = [n for n in gm.graph.nodes if n.target is pooling.BWD]
    assert len(bwd.args) == 10, "the pool's gradient (the first block's two convs' dgrads) is not added in the op"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(16, 64, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(64)
        self.c2 = nn.Conv2d(64, 64, 3, padding=1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.bn(self.c1(x))), 3, 2, 1)
        y = F.relu(self.c2(y)) + y
        return self.fc(y.mean((2, 3)))


def _float64_truth(xs, lr: float = 0.1):
    """The SGD steps of sgd_steps in float64, eager (the model as the seed makes it): the final weights and
    buffers."""
    torch.manual_seed(0)
    m = Net().cuda().double().to(memory_format=CL)
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    for x in xs:
        m(x.double()).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [t.detach().clone() for t in (*m.parameters(), *m.buffers())]


@pytest.mark.parametrize("cudagraphs", [False, True], ids=["plain", "cudagraphs"])
def test_training_as_close_to_float64_as_the_pools_left_to_inductor(cudagraphs):
    """Three fp16-autocast SGD steps of the compiled model (under CUDA graphs the third replays the graph), the convs
    left to PyTorch (the pool alone is this test's business; its gradient is the sum of the residual's and the conv's,
    which the op adds itself): the final weights with the pool on this backend's kernels are as close to the float64
    truth as those with the pool compiled by Inductor, and the losses agree. The two fp16 runs are not compared with
    each other at a fixed tolerance: the batch norm's backward amplifies fp16 rounding into the first conv's weights
    (eager fp16 itself is ~3e-2 from float64 there after three steps, and two fp16 orders of the same sums ~5e-3
    apart), so what tells a wrong gradient from rounding is the distance to float64."""
    from cutlass_byoc.offload import make_backend

    torch.manual_seed(1)
    xs = [torch.randn(8, 16, 24, 24, device="cuda").contiguous(memory_format=CL) for _ in range(3)]
    truth = _float64_truth(xs)
    results = []
    for pool in (True, False):
        torch.manual_seed(0)
        m = Net().cuda().to(memory_format=CL)
        torch._dynamo.reset()
        backend = make_backend(select="heuristic", fprop=False, dgrad=False, wgrad=False, max_pool=pool,
                               cudagraphs=cudagraphs)
        run = torch.compile(m, backend=backend)
        losses = sgd_steps(run, m, xs)
        (rep,) = [r for r in backend.reports if "joint" in r.graph]
        assert rep.max_pools == (1 if pool else 0), (rep.max_pools_left, rep.summary())
        results.append((losses, [t.detach().clone() for t in (*m.parameters(), *m.buffers())]))
    (l1, w1), (l2, w2) = results
    assert l1 == pytest.approx(l2, rel=2e-3)
    for ours, inductor, t in zip(w1, w2, truth):
        if not t.is_floating_point():
            assert torch.equal(ours, inductor)
            continue
        e_ours, e_ind = (float((w.double() - t).abs().max()) for w in (ours, inductor))
        assert e_ours <= 2 * e_ind + 1e-4, (tuple(t.shape), e_ours, e_ind)
