"""GPU (H200): the kernel libraries' launch memo (templates/launch_memo.h.j2). cb_run relaunches what it prepared for
an argument block it met before; every launch path of the CUTLASS-based templates is run here on two operand sets
(other pointers, other workspaces) in turn, twice, each output poisoned first and compared with the float64
reference: the second round must be relaunches, and a relaunch must never run with another block's pointers. The
memo switched off gives the same bits."""

from __future__ import annotations

import math

import pytest
import torch

from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.runtime import load_kernel
from cutlass_byoc.sm90 import sm90_config
from cutlass_byoc.gemm1x1 import gemm1x1_config
from cutlass_byoc.types import ConvKind, SplitKMode

from gpu_util import TOLERANCE, kernel_operands, module_kernels, operands, pick, poisoned_output, reference, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (these tests run on the H200)"),
]

PINGPONG = "pingpong"


def _p(kind, n, c, h, k, r, stride=1, **kw) -> Conv2dProblem:
    return Conv2dProblem.make(kind, n, c, h, h, k, r, stride=stride, padding=r // 2, **kw)


FPROP = _p("fprop", 4, 64, 20, 128, 3)
FPROP_F32 = _p("fprop", 4, 64, 20, 128, 3, out_dtype="f32")  # serial split-k sums its slices in the output
WGRAD = _p("wgrad", 4, 64, 20, 64, 3)
WGRAD_1X1 = Conv2dProblem(kind=ConvKind.WGRAD, n=4, h=16, w=15, c=64, k=136, r=1, s=1, element_a="f16",
                          element_b="f16", element_out="f32")

#: (id, problem, kernel, split-k slices): one case per launch path of cb_run. sm80: the plain launch, serial split-k
#: (its semaphores cleared before every launch) and parallel split-k (the reduction's second launch); sm90: CUTLASS's
#: kernel, the project's ping-pong kernel, its split-k wgrad with the dependent reduction, the sub-pixel dgrad on
#: CUTLASS's grouped phases (a 1x1 stride 2: dx zero-filled, one live phase) and on the ping-pong kernel (stride 3:
#: nine phases in three launches); the 1x1 GEMM with stream-K split (its counters initialized before every launch).
CASES = [
    ("sm80", FPROP, pick(FPROP), 1),
    ("sm80-serial", FPROP_F32, pick(FPROP_F32, SplitKMode.SERIAL), 3),
    ("sm80-parallel", WGRAD, pick(WGRAD, SplitKMode.PARALLEL), 4),
    ("sm90", FPROP, sm90_config(FPROP, (128, 64, 64)), 1),
    ("sm90-pingpong", FPROP, sm90_config(FPROP, (128, 64, 64), schedule=PINGPONG), 1),
    ("sm90-split", WGRAD, sm90_config(WGRAD, (64, 128, 64), (1, 1, 1), SplitKMode.PARALLEL), 8),
    ("sm90-subpixel", _p("dgrad", 4, 64, 20, 128, 1, stride=2), sm90_config(_p("dgrad", 4, 64, 20, 128, 1, stride=2),
                                                                          (128, 128, 64)), 1),
    ("sm90-subpixel-pingpong", Conv2dProblem.make("dgrad", 2, 64, 13, 10, 64, 3, stride=3, padding=1),
     sm90_config(Conv2dProblem.make("dgrad", 2, 64, 13, 10, 64, 3, stride=3, padding=1), (128, 128, 64),
                 schedule=PINGPONG), 1),
    ("gemm1x1-streamk", WGRAD_1X1, gemm1x1_config(WGRAD_1X1, (128, 64, 64), "cooperative_streamk"), 3),
]


def used_configs():
    return list(dict.fromkeys(cfg for _, _, cfg, _ in CASES))


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    with module_kernels(shared_cache, used_configs):
        yield


def _launch(lib, p: Conv2dProblem, slices: int, a, b, out, ws):
    lib.run(p, a=a.data_ptr(), b=b.data_ptr(), d=out.data_ptr(), split_k_slices=slices,
            workspace=ws.data_ptr() if ws is not None else 0, workspace_bytes=ws.numel() if ws is not None else 0,
            stream=torch.cuda.current_stream().cuda_stream)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_relaunch_on_two_operand_sets(case):
    _, p, cfg, slices = case
    assert cfg.reject_reason(p) is None, cfg.reject_reason(p)
    lib = load_kernel(cfg)
    assert lib.launch_memo(True) is not None, f"{cfg.name}: the library has no launch memo"
    need = lib.workspace_size(p, slices)
    sets = []
    for seed in (11, 12):
        x, w, dy = operands(p, seed)
        a, b = kernel_operands(p, x, w, dy)
        ws = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda") if need else None
        sets.append((a, b, poisoned_output(p), ws, reference(p, x, w, dy)))
    start = lib.launch_memo()
    for round_ in range(2):
        for i, (a, b, out, ws, ref) in enumerate(sets):
            out.fill_(float("nan"))
            if ws is not None:
                ws.fill_(0xFF)  # whatever a launch needs cleared, it must clear itself
            _launch(lib, p, slices, a, b, out, ws)
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            assert not math.isnan(err), f"{cfg.name}: round {round_} set {i}: NaN left in the output"
            assert err < TOLERANCE[p.element_out], f"{cfg.name}: round {round_} set {i}: {err:.3e}"
    end = lib.launch_memo()
    print(f"\n{cfg.name}: relaunches {end.relaunches - start.relaunches}, full {end.full - start.full}")
    # round 0 met each block first (full path), round 1 met each again (relaunches)
    assert (end.full - start.full, end.relaunches - start.relaunches) == (2, 2)


@pytest.mark.parametrize("case", [c for c in CASES if "gemm1x1" not in c[0]], ids=lambda c: c[0])
def test_memo_off_gives_the_same_bits(case):
    """The memo changes what the host does, never what the GPU computes (the stream-K case is left out: its
    reduction order is not fixed from run to run)."""
    _, p, cfg, slices = case
    lib = load_kernel(cfg)
    need = lib.workspace_size(p, slices)
    x, w, dy = operands(p, 21)
    a, b = kernel_operands(p, x, w, dy)
    ws = torch.empty(need, dtype=torch.uint8, device="cuda") if need else None
    outs = []
    try:
        for on in (True, True, False):
            lib.launch_memo(on)
            out = poisoned_output(p)
            _launch(lib, p, slices, a, b, out, ws)
            torch.cuda.synchronize()
            outs.append(out)
    finally:
        lib.launch_memo(True)
    assert not torch.isnan(outs[0].float()).any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_relaunch_under_cuda_graph_capture():
    """A block met before, relaunched inside a capture, records the same kernels: the replay recomputes the output."""
    _, p, cfg, slices = next(c for c in CASES if c[0] == "sm90-split")
    lib = load_kernel(cfg)
    lib.launch_memo(True)
    need = lib.workspace_size(p, slices)
    x, w, dy = operands(p, 31)
    a, b = kernel_operands(p, x, w, dy)
    ws = torch.empty(need, dtype=torch.uint8, device="cuda")
    out = poisoned_output(p)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        _launch(lib, p, slices, a, b, out, ws)  # the full path, outside the capture
    torch.cuda.synchronize()
    before = lib.launch_memo()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        _launch(lib, p, slices, a, b, out, ws)
    assert lib.launch_memo().relaunches == before.relaunches + 1
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    err = rel_err(out, reference(p, x, w, dy))
    assert err < TOLERANCE[p.element_out], err
