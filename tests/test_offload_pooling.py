"""CPU tests of the max-pool ops and their rewrite (offload/pooling.py, OffloadOptions.max_pool): the ops (their ATen
path off CUDA) against ATen's pooling, their fake implementations, which training graphs are rewritten in either form
of the backward (aten's op, or PyTorch's scatter_add decomposition of it) and which are left alone, and compiled
training computing the same with and without the rewrite. The Triton kernels run here under Triton's interpreter
where Triton is installed (their GPU tests are test_gpu_pooling.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cutlass_byoc.offload import OffloadOptions, make_backend, pooling
from cutlass_byoc.offload.trace import explain
from models import MODELS

CL = torch.channels_last
CPU = OffloadOptions(require_cuda=False, select="heuristic")
aten = torch.ops.aten
#: (N, C, H, W, kernel, stride, padding, dilation, ceil_mode, channels_last)
CASES = [(2, 8, 9, 9, 3, 2, 1, 1, False, True), (2, 5, 8, 7, 3, 2, 1, 1, True, False),
         (1, 70, 6, 6, 2, 2, 0, 1, False, True), (2, 3, 10, 11, 3, 1, 1, 2, False, True),
         (1, 4, 7, 7, 3, 3, 1, 1, True, True), (2, 16, 12, 12, 5, 2, 2, 1, False, True)]


def _input(case, dtype=torch.float32):
    n, c, h, w, *_, cl = case
    x = (torch.randint(-3, 4, (n, c, h, w)) / 2).to(dtype)  # few levels: windows with ties
    x.view(-1)[::13] = float("nan")
    x.view(-1)[5::17] = float("-inf")
    return x.contiguous(memory_format=CL) if cl else x


def test_out_size_is_atens():
    for h in range(1, 20):
        for k, s, p, d in [(3, 2, 1, 1), (2, 2, 0, 1), (3, 3, 1, 1), (3, 1, 1, 2), (5, 2, 2, 1)]:
            if h + 2 * p < d * (k - 1) + 1:
                continue
            for ceil in (False, True):
                ref = F.max_pool2d(torch.zeros(1, 1, h, h), k, s, p, d, ceil_mode=ceil).shape[-1]
                assert pooling.out_size(h, k, s, p, d, ceil) == ref, (h, k, s, p, d, ceil)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_ops_match_aten(case, dtype):
    """Values and offsets of the forward as ATen's values and indices (ties, NaN, -inf), the backward as ATen's
    backward in fp32, both in the layouts the fake implementations give."""
    n, c, h, w, k, s, p, d, ceil, cl = case
    x = _input(case, dtype)
    args = ([k, k], [s, s], [p, p], [d, d])
    vals, offsets = pooling.FWD(x, *args, ceil)
    ref_vals, ref_idx = aten.max_pool2d_with_indices(x, *args, ceil)
    assert torch.equal(vals.nan_to_num(7), ref_vals.nan_to_num(7)) and vals.stride() == ref_vals.stride()
    assert offsets.dtype is torch.int8 and offsets.stride() == vals.stride()
    assert torch.equal(pooling.offsets_to_indices(offsets, w, *args[:1], *args[1:]), ref_idx)
    g = torch.randn(vals.shape).to(dtype)
    gi = pooling.BWD(g, offsets, list(x.shape), *args, ceil, cl)
    ref = aten.max_pool2d_with_indices_backward(g.float(), x.float(), *args, ceil, ref_idx).to(dtype)
    assert torch.equal(gi, ref)
    assert gi.is_contiguous(memory_format=CL if cl else torch.contiguous_format)
    g2 = torch.randn(vals.shape).to(dtype)  # the windows' gradient as the sum of two (added in fp32)
    gi2 = pooling.BWD(g, offsets, list(x.shape), *args, ceil, cl, g2)
    ref = aten.max_pool2d_with_indices_backward(g.float() + g2.float(), x.float(), *args, ceil, ref_idx).to(dtype)
    assert torch.equal(gi2, ref) and gi2.stride() == gi.stride()
    torch.library.opcheck(pooling.FWD, (x, *args, ceil), test_utils=("test_schema", "test_faketensor"))
    for extra in ((), (g2,)):
        torch.library.opcheck(pooling.BWD, (g, offsets, list(x.shape), *args, ceil, cl, *extra),
                              test_utils=("test_schema", "test_faketensor"))


def test_kernels_only_where_their_int32_arithmetic_holds():
    """The Triton kernels count positions and offsets inside an image in int32: tensors of 2**31 elements or more, or
    views spanning that much storage, take ATen's pooling (as off CUDA)."""
    small = torch.empty(2, 64, 112, 112, device="meta", dtype=torch.float16)
    big = torch.empty(2**31 // (64 * 112 * 112) + 1, 64, 112, 112, device="meta", dtype=torch.float16)
    sliced = torch.empty(2, 2, 2**29, 2, device="meta", dtype=torch.float16)[:, :, ::2**27]
    assert pooling.int32_holds(small, None) and not pooling.int32_holds(small, big)
    assert sliced.numel() < 2**31 and not pooling.int32_holds(sliced)
    assert pooling._kernels_for(torch.empty(2, 3, 4, 4)) is None  # off CUDA


def test_offsets_and_indices_convert_both_ways():
    x = torch.randn(2, 3, 11, 10)
    args = ([3, 3], [2, 2], [1, 1], [2, 2])
    _, idx = aten.max_pool2d_with_indices(x, *args, True)
    off = pooling.indices_to_offsets(idx, 10, *args)
    assert off.dtype is torch.int8 and int(off.min()) >= 0 and int(off.max()) < 9
    assert torch.equal(pooling.offsets_to_indices(off, 10, *args), idx)


class Stem(nn.Module):
    """conv, batch norm, ReLU, max pool, as ResNet's stem, then a 1x1 conv (two: and a second one beside it, as
    ResNet-50's first block and its shortcut, so that the pool's gradient is a sum) and a head."""

    def __init__(self, pool=(3, 2, 1), ceil_mode=False, return_indices=False, two=False):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(*pool, ceil_mode=ceil_mode, return_indices=return_indices)
        self.c2 = nn.Conv2d(16, 8, 1)
        self.c3 = nn.Conv2d(16, 8, 1) if two else None
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.pool(F.relu(self.bn(self.c1(x))))
        if isinstance(y, tuple):
            y, idx = y
            return self.fc(self.c2(y).mean((2, 3))) + idx.float().mean() * 0
        z = self.c2(y) if self.c3 is None else self.c2(y) + self.c3(y)
        return self.fc(z.mean((2, 3)))


def _targets(gm):
    return [n.target for n in gm.graph.nodes]


@pytest.mark.parametrize("two", [False, True], ids=["one", "sum"])
@pytest.mark.parametrize("decompositions", ["inductor", None], ids=["decomposed", "aten"])
def test_training_graph_pool_is_rewritten(decompositions, two):
    """Both forms of the backward (PyTorch's scatter_add decomposition under Inductor's table, aten's op without
    decompositions) become one forward and one backward of this backend; nothing of the old pool is left. Where the
    pool's gradient is the sum of two (two convs read its output), the op takes both and the add is gone."""
    from cutlass_byoc.offload.partition import partition
    from cutlass_byoc.offload.trace import trace

    torch.manual_seed(0)
    m = Stem(two=two).to(memory_format=CL)
    gm = trace(m, torch.randn(2, 3, 17, 17).contiguous(memory_format=CL), training=True,
               autocast=torch.bfloat16, decompositions=decompositions)
    rep = partition(gm, CPU)
    assert rep.max_pools == 1 and not rep.max_pools_left and "1 max pools on this backend's kernels" in rep.summary()
    t = _targets(gm)
    assert t.count(pooling.FWD) == 1 and t.count(pooling.BWD) == 1
    old = {aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default,
           aten.scatter_add.default, pooling._inductor_prim("_low_memory_max_pool_with_offsets"),
           pooling._inductor_prim("_low_memory_max_pool_offsets_to_indices")}
    assert not old & set(t)
    (bwd,) = [n for n in gm.graph.nodes if n.target is pooling.BWD]
    assert bwd.args[1].args[0].target is pooling.FWD  # reads the forward's offsets
    assert len(bwd.args) == (10 if two else 9)
    assert all(a.target is not aten.add.Tensor for a in bwd.args if isinstance(a, torch.fx.Node))
    gm.graph.lint()


def test_resnet18_joint_graph_takes_its_pool_and_inference_is_left_alone():
    torch.manual_seed(0)
    m = MODELS["resnet18"](num_classes=10).to(memory_format=CL)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=CL)
    gm, rep = explain(m, x, training=True, autocast=torch.float16, options=CPU)
    assert rep.max_pools == 1 and pooling.BWD in _targets(gm)
    (bwd,) = [n for n in gm.graph.nodes if n.target is pooling.BWD]
    assert len(bwd.args) == 10  # the first block's conv and its identity shortcut: the gradient's add taken in
    gm, rep = explain(m.eval(), x, training=False, options=CPU)
    assert rep.max_pools == 0 and pooling.FWD not in _targets(gm)


def test_what_is_left_alone():
    """A window of more than 127 elements, indices the model reads itself, graphs off CUDA where CUDA is required,
    and the option off."""
    from cutlass_byoc.offload.partition import partition
    from cutlass_byoc.offload.trace import trace

    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=CL)

    def run(model, options=CPU, decompositions="inductor"):
        gm = trace(model.to(memory_format=CL), x, training=True, decompositions=decompositions)
        return partition(gm, options)

    rep = run(Stem(pool=(12, 1, 0)), decompositions=None)  # 144 elements: past int8 offsets (Inductor falls back too)
    assert rep.max_pools == 0 and any("window of 144" in why for why in rep.max_pools_left), rep.max_pools_left
    rep = run(Stem(return_indices=True), decompositions=None)
    assert rep.max_pools == 0 and any("read elsewhere" in why for why in rep.max_pools_left), rep.max_pools_left
    assert run(Stem(), OffloadOptions(select="heuristic")).max_pools == 0  # require_cuda on a CPU graph
    assert run(Stem(), OffloadOptions(require_cuda=False, select="heuristic", max_pool=False)).max_pools == 0


@pytest.mark.parametrize("inductor", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("ceil_mode", [False, True], ids=["floor", "ceil"])
def test_compiled_training_matches_the_pool_left_to_inductor(inductor, ceil_mode):
    """torch.compile (Inductor on the CPU in fp32, or the eager variant under bf16 autocast), two SGD steps: the
    losses, the gradients and the weights with the pool rewritten are those with the pool left as it was. (Not
    Inductor under bf16: its fused kernels keep the old pool's bf16 result in fp32, where the op stores it in bf16 as
    eager does, and the batch norm's backward makes that rounding visible.) With ceil_mode the pool's gradient is a
    sum (two convs read its output), which the rewritten backward adds itself."""
    results = []
    for pool in (True, False):
        torch.manual_seed(0)
        m = Stem(ceil_mode=ceil_mode, two=ceil_mode).to(memory_format=CL)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        xs = [torch.randn(2, 3, 18, 18).contiguous(memory_format=CL) for _ in range(2)]
        torch._dynamo.reset()
        backend = make_backend(require_cuda=False, select="heuristic", max_pool=pool, inductor=inductor, strict=True)
        run = torch.compile(m, backend=backend)
        losses = []
        for x in xs:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not inductor):
                loss = run(x).float().square().sum()
            loss.backward()
            losses.append(loss.detach())
            grads = [p.grad.clone() for p in m.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
        (rep,) = [r for r in backend.reports if "joint" in r.graph]
        assert rep.max_pools == (1 if pool else 0), rep.max_pools_left
        results.append((losses, grads, [p.detach().clone() for p in m.parameters()]))
    (l1, g1, w1), (l2, g2, w2) = results
    torch.testing.assert_close(l1, l2, rtol=1e-3, atol=1e-4)
    for a, b in zip(g1 + w1, g2 + w2):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


_INTERPRETED = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_offload_pooling import CASES, CL, _input
    from cutlass_byoc.offload import pool_kernels, pooling
    torch.manual_seed(0)
    for case in CASES:
        n, c, h, w, k, s, p, d, ceil, cl = case
        x = _input(case)
        args = ([k, k], [s, s], [p, p], [d, d])
        vals, offsets = pooling._fwd_outputs(x, *args, ceil)
        vals.fill_(float("nan")), offsets.fill_(99)
        pool_kernels.max_pool2d_fwd(x, vals, offsets, *args)
        ref_vals, ref_idx = torch.ops.aten.max_pool2d_with_indices(x, *args, ceil)
        assert torch.equal(vals.nan_to_num(7), ref_vals.nan_to_num(7)), (n, c, h, w)
        assert torch.equal(pooling.offsets_to_indices(offsets, w, *args), ref_idx), (n, c, h, w)
        g = torch.randn(vals.shape)
        ref = torch.ops.aten.max_pool2d_with_indices_backward(g, x, *args, ceil, ref_idx)
        g2 = torch.randn(vals.shape).contiguous(memory_format=torch.contiguous_format if cl else CL)
        ref2 = torch.ops.aten.max_pool2d_with_indices_backward(g + g2, x, *args, ceil, ref_idx)
        for cells in (False, True):  # the gather, and the cell kernel where it takes the pool
            for second, r in ((None, ref), (g2, ref2)):  # one gradient, or the sum of two (the other layout)
                gi = pooling._bwd_output(g, list(x.shape), cl).fill_(float("nan"))
                pool_kernels.max_pool2d_bwd(g, offsets, gi, *args, cells=cells, grad2=second)
                assert torch.equal(gi, r), (n, c, h, w, cells, second is None, (gi - r).abs().max())
    print("ok")
""")


def test_cell_windows():
    """Which pools the backward's cell kernel takes (at most two windows hold an element in a row) and from which
    window on; the others take the gather over taps."""
    from importlib import util

    if util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    from cutlass_byoc.offload.pool_kernels import cell_windows

    assert cell_windows(3, 2, 1, 1) == 0  # ResNet's stem pool
    assert cell_windows(2, 2, 0, 1) == 0  # non-overlapping
    assert cell_windows(3, 3, 1, 1) == 0 and cell_windows(5, 3, 2, 1) == 0
    assert cell_windows(3, 1, 1, 1) is None and cell_windows(5, 2, 2, 1) is None and cell_windows(3, 1, 1, 2) is None


@pytest.mark.parametrize("pool", [(3, 2, 1, 1), (2, 2, 0, 1), (5, 2, 2, 1)], ids=["k3s2p1", "k2s2p0", "k5s2p2"])
def test_triton_kernels_compile_for_sm90(pool):
    """Each kernel through Triton's whole pipeline to an sm_90 cubin (Triton's own ptxas; no GPU needed), for the
    pools each takes: a kernel that does not compile would fail the user's first training step."""
    triton = pytest.importorskip("triton", reason="Triton is not installed")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cutlass_byoc.offload import pool_kernels as pk

    k, s, p, d = pool
    consts = dict(KH=k, KW=k, SH=s, SW=s, PADH=p, PADW=p, DH=d, DW=d, BLOCK_P=32, BLOCK_C=64)
    kernels = [(pk.cb_max_pool2d_fwd, {"x_ptr": "*fp16", "val_ptr": "*fp16", "off_ptr": "*i8"}, {})]
    j0 = pk.cell_windows(k, s, p, d)
    for two in (False, True):  # one gradient, or the sum of two
        kernels.append((pk.cb_max_pool2d_bwd, {"g_ptr": "*bf16", "off_ptr": "*i8", "gi_ptr": "*bf16",
                                               "g2_ptr": "*bf16"}, {"TWO": two}))
        if j0 is not None:
            kernels.append((pk.cb_max_pool2d_bwd_cells, {"g_ptr": "*fp16", "off_ptr": "*i8", "gi_ptr": "*fp16",
                                                         "g2_ptr": "*fp16"}, {"J0H": j0, "J0W": j0, "TWO": two}))
    for fn, pointers, extra in kernels:
        constexprs = {**consts, **extra}
        signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert compiled.asm.get("cubin"), fn.__name__


def test_triton_kernels_under_the_interpreter():
    """The Triton kernels themselves (fp32: the interpreter truncates fp32 to bf16 where the GPU rounds; CASES take
    both backward kernels), run by Triton's CPU interpreter in a process of their own (TRITON_INTERPRET is read when the kernels are defined)."""
    pytest.importorskip("triton", reason="Triton is not installed (the kernels' GPU tests: test_gpu_pooling.py)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = _INTERPRETED.format(tests=os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
