"""Programmatic dependent launches (sm_90 PDL, runtime.set_dependent_launch) on a GPU: the GEMM 1x1 family's persistent
kernels and the sm90 ping-pong conv kernel start while the stream's previous kernel drains and wait in
griddepcontrol.wait before they touch global memory. What must hold, checked here against float64 references:

* read after write: a kernel reads what the kernel right before it wrote (a chain of our kernels, the first after an
  ATen copy of its input; every intermediate filled with NaN first, so a read before the wait shows up as NaN);
* write after read: a kernel whose output is the buffer the kernel right before it reads leaves that read intact;
* the same under CUDA graph capture (programmatic edges) and replay on new inputs;
* the same bits with the launches on and off (the atomic split-k wgrad's sums aside: their order varies).

Kernels are those of tests/test_gpu_gemm1x1.py, tests/test_gpu_sm90_pingpong.py and tests/test_gpu_sm90_splitk.py
(nothing of its own to compile).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")

from cutlass_byoc import runtime  # noqa: E402
from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.ops import run_problem  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem  # noqa: E402
from cutlass_byoc.sm90 import PINGPONG, atomic_twin, sm90_config  # noqa: E402

from gpu_util import module_kernels, rel_err  # noqa: E402
import test_gpu_gemm1x1  # noqa: E402
import test_gpu_sm90_pingpong  # noqa: E402
import test_gpu_sm90_splitk  # noqa: E402

pytestmark = test_gpu_sm90_pingpong.pytestmark

N = 8
#: chain A: y1 = 1x1 fprop (GEMM ping-pong) of x; y2 = 3x3 fprop (conv ping-pong) of y1; y3 = 1x1 dgrad (GEMM
#: ping-pong) with y2 as dy
FPROP_1X1 = Conv2dProblem.make("fprop", N, 64, 56, 56, 64, 1)
FPROP_3X3 = Conv2dProblem.make("fprop", N, 64, 56, 56, 64, 3, padding=1)
DGRAD_1X1 = Conv2dProblem.make("dgrad", N, 64, 56, 56, 64, 1)
#: chain B: dx = strided 3x3 dgrad (sub-pixel phases on the ping-pong kernel, no memset: every phase has taps) of dy;
#: y = 1x1 fprop (GEMM ping-pong) of dx
DGRAD_S2 = Conv2dProblem.make("dgrad", N, 128, 56, 56, 128, 3, stride=2, padding=1)
FPROP_1X1_B = Conv2dProblem.make("fprop", N, 128, 56, 56, 64, 1)
#: chain C: y1 = 1x1 fprop (GEMM ping-pong); dw = atomic split-k 3x3 wgrad with y1 as dy, fp32 out (its zeroing kernel
#: the fprop's dependent, the split kernel the zeroing's)
WGRAD_3X3 = Conv2dProblem.make("wgrad", N, 64, 56, 56, 64, 3, padding=1, out_dtype="f32")


def _gemm(name):
    return test_gpu_gemm1x1.KERNELS[name]


LAUNCHES = {
    FPROP_1X1: LaunchConfig(_gemm("nosrc_fprop")),
    FPROP_3X3: LaunchConfig(sm90_config(FPROP_3X3, (128, 64, 64), schedule=PINGPONG)),
    DGRAD_1X1: LaunchConfig(_gemm("nosrc_dgrad")),
    DGRAD_S2: LaunchConfig(sm90_config(DGRAD_S2, (128, 128, 64), schedule=PINGPONG)),
    FPROP_1X1_B: LaunchConfig(_gemm("nosrc_fprop")),
    WGRAD_3X3: LaunchConfig(atomic_twin(test_gpu_sm90_splitk.split_config(WGRAD_3X3)), 8),
}


def used_configs():
    return list(dict.fromkeys(launch.kernel for launch in LAUNCHES.values()))


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    assert set(used_configs()) <= {*test_gpu_gemm1x1.KERNELS.values(), *test_gpu_sm90_pingpong.used_configs(),
                                   *test_gpu_sm90_splitk.used_configs()}
    with module_kernels(shared_cache, used_configs):
        yield


@pytest.fixture(autouse=True)
def dependent_launch_on():
    was = runtime.set_dependent_launch(True)
    yield
    runtime.set_dependent_launch(was)


def cl(t):
    return t.contiguous(memory_format=torch.channels_last)


def fresh(shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return cl(torch.randn(shape, device="cuda", generator=g).half())


def nan(shape, dtype=torch.half):
    return cl(torch.full(shape, float("nan"), device="cuda", dtype=dtype))


def nchw(shape):
    return (shape[0], shape[3], shape[1], shape[2])


def conv(p: Conv2dProblem, a, b, out):
    run_problem(p, a, b, out, config=LAUNCHES[p])


def reference(p: Conv2dProblem, a, b):
    """float64 result of `p` from its kernel operands a, b (fprop: x, w; dgrad: dy, w; wgrad: dy, x)."""
    st, pd = (p.stride_h, p.stride_w), (p.pad_h, p.pad_w)
    if p.kind.value == "fprop":
        return torch.nn.functional.conv2d(a.double(), b.double(), None, st, pd)
    if p.kind.value == "dgrad":
        return torch.nn.grad.conv2d_input(nchw(p.out_shape), b.double(), a.double(), st, pd)
    return torch.nn.grad.conv2d_weight(b.double(), nchw(p.out_shape), a.double(), st, pd)


class Chain:
    """Buffers and weights of one chain of launches, each reading the previous one's output."""

    def __init__(self, problems, seed):
        self.problems = problems
        first = problems[0]
        self.source = fresh(nchw(first.a_shape), seed)  # copied into the first input by an ATen kernel
        self.input = nan(nchw(first.a_shape))
        self.weights = [fresh(nchw(p.b_shape), seed + 1 + i) for i, p in enumerate(problems)]
        self.outs = [nan(nchw(p.out_shape), getattr(torch, p.element_out.torch_name)) for p in problems]

    def poison(self):
        self.input.fill_(float("nan"))
        for o in self.outs:
            o.fill_(float("nan"))

    def launch(self):
        self.input.copy_(self.source)  # the kernel right before the chain's first launch writes its input
        a = self.input
        for p, w, out in zip(self.problems, self.weights, self.outs):
            conv(p, a, w, out)
            a = out

    def check(self):
        torch.cuda.synchronize()
        a = self.source
        for p, w, out in zip(self.problems, self.weights, self.outs):
            assert not torch.isnan(out).any(), f"{p.name}: NaN in the output (a read before the previous kernel's write?)"
            err = rel_err(out, reference(p, a, w))
            assert err < 1e-2, f"{p.name}: relative error {err:.2e}"
            a = out


CHAINS = {"gemm-conv-gemm": (FPROP_1X1, FPROP_3X3, DGRAD_1X1), "subpixel-gemm": (DGRAD_S2, FPROP_1X1_B),
          "gemm-atomic-wgrad": (FPROP_1X1, WGRAD_3X3)}


def test_the_kernels_launch_as_dependents():
    """Every library of the module has the switch, and it is on (the tests below then exercise PDL)."""
    for cfg in used_configs():
        assert runtime.load_kernel(cfg).dependent_launch() is True, cfg.name


@pytest.mark.parametrize("name", list(CHAINS))
def test_each_kernel_reads_what_the_previous_one_wrote(name):
    chain = Chain(CHAINS[name], seed=11)
    for i in range(4):
        chain.source.copy_(fresh(chain.source.shape, 100 + i))
        chain.poison()
        chain.launch()
        chain.check()


@pytest.mark.parametrize("name", list(CHAINS))
def test_chain_under_cuda_graph_capture_and_replay(name):
    chain = Chain(CHAINS[name], seed=23)
    chain.launch()  # outside the capture first: the launches are prepared (kernel attributes, the launch memo)
    chain.check()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        chain.launch()
    for i in range(3):
        chain.source.copy_(fresh(chain.source.shape, 200 + i))
        chain.poison()
        graph.replay()
        chain.check()


@pytest.mark.parametrize("p", [FPROP_1X1, FPROP_3X3, DGRAD_S2], ids=lambda p: p.name)
def test_a_kernel_does_not_overwrite_what_the_previous_one_reads(p):
    """An ATen kernel reads `buf` (a large elementwise product) and the next launch, ours, writes its output into
    `buf`: the product must be of the old values."""
    a, w = fresh(nchw(p.a_shape), 5), fresh(nchw(p.b_shape), 6)
    for i in range(4):
        old = fresh(nchw(p.out_shape), 300 + i)
        buf = old.clone()
        twice = torch.empty_like(buf)
        torch.mul(buf, 2, out=twice)
        conv(p, a, w, buf)
        torch.cuda.synchronize()
        assert torch.equal(twice, old * 2), f"{p.name}: the product read values the kernel wrote"
        assert rel_err(buf, reference(p, a, w)) < 1e-2


@pytest.mark.parametrize("name", ["gemm-conv-gemm", "subpixel-gemm"])
def test_same_bits_with_dependent_launches_on_and_off(name):
    chain = Chain(CHAINS[name], seed=31)
    outs = []
    for on in (False, True):
        runtime.set_dependent_launch(on)
        assert all(runtime.load_kernel(c).dependent_launch() is on for c in used_configs())
        chain.poison()
        chain.launch()
        chain.check()
        outs.append([o.clone() for o in chain.outs])
    for off, on in zip(*outs):
        assert torch.equal(off, on)
