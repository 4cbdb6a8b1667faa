"""CPU tests of the compile-time binding of the offload's call sites: what is resolved once (the launch, the library,
the argument block, output shape and strides, workspace size) and what every call still checks (shapes, dtypes,
layout, pointer alignment), with a fake kernel library standing in for the GPU."""

from __future__ import annotations

import ctypes

import pytest
import torch

from cutlass_byoc.offload import library
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.types import Activation, SourceKind

CL = torch.channels_last


class FakeRun:
    """Stands in for a library's cb_run: records the arguments it was launched with."""

    def __init__(self, rc=0):
        self.calls, self.rc = [], rc

    def __call__(self, args_ref, ws, ws_len, stream, msg, n):
        args = ctypes.cast(args_ref, ctypes.POINTER(library.CbConv2dArgs)).contents
        self.calls.append(dict(a=args.a, b=args.b, d=args.d, source=args.source, n=args.n, k=args.k, ws=ws,
                               ws_len=ws_len, stream=stream))
        if self.rc:
            msg.value = b"planted launch failure"
        return self.rc


def bound_site(problem, source_shape=None, workspace=0, align=(16, 16, 16), run=None):
    """A call site bound to a fake library (what CallSite.bind builds from ops.bind on a GPU machine)."""
    from cutlass_byoc.runtime import make_args

    i = library.register_site(problem.kind.value, problem, "heuristic", source_shape)
    site = library.site(i)
    n, h, w, c = problem.out_shape
    a, b = problem.a_shape, problem.b_shape
    site.state = library._Bound(run or FakeRun(), make_args(problem), workspace, *align, (a[0], a[3], a[1], a[2]),
                                (b[0], b[3], b[1], b[2]), torch.float16, torch.float16, (n, c, h, w),
                                (h * w * c, 1, w * c, c), torch.float16,
                                tuple(source_shape) if source_shape is not None else None, "fake",
                                ctypes.create_string_buffer(256))
    return i, site


@pytest.fixture(autouse=True)
def _no_cuda_stream(monkeypatch):
    monkeypatch.setattr(library, "_get_stream", lambda dev: 1234)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)  # CPU tensors report device -1


def t(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype).contiguous(memory_format=CL)


def test_a_bound_site_only_checks_and_launches(monkeypatch):
    p = Conv2dProblem.make("fprop", 2, 16, 8, 8, 32, 3, padding=1)
    i, site = bound_site(p)
    # nothing is resolved again per call: choosing or binding would fail loudly
    monkeypatch.setattr(library.CallSite, "bind", lambda self, dev: pytest.fail("bound twice"))
    x, w = t(2, 16, 8, 8), t(32, 16, 3, 3)
    y = site(x, w, None)
    assert y.shape == (2, 32, 8, 8) and y.is_contiguous(memory_format=CL) and y.dtype == torch.float16
    (call,) = site.state.run.calls
    assert (call["a"], call["b"], call["d"]) == (x.data_ptr(), w.data_ptr(), y.data_ptr())
    assert call["source"] is None and call["stream"] == 1234 and call["ws"] is None
    assert (call["n"], call["k"]) == (2, 32)
    assert site.calls == 1 and library.RUNTIME.kernel_calls.get("fprop", 0) >= 1


@pytest.mark.parametrize("what", ["shape", "dtype", "layout", "misaligned", "source_missing", "source_dtype"])
def test_a_call_that_differs_takes_the_general_path(what):
    p = Conv2dProblem.make("fprop", 2, 16, 8, 8, 32, 3, padding=1, epilogue=Epilogue(Activation.RELU, SourceKind.BIAS))
    i, site = bound_site(p, source_shape=(32,))
    x, w, bias = t(2, 16, 8, 8), t(32, 16, 3, 3), torch.randn(32).half()
    if what == "shape":
        x = t(2, 16, 9, 8)
    elif what == "dtype":
        x, w = x.bfloat16(), w.bfloat16()
    elif what == "layout":
        x = x.contiguous()
    elif what == "misaligned":  # a view whose storage offset breaks the kernel's 16-byte alignment
        flat = torch.empty(x.numel() + 8, dtype=x.dtype)
        x = flat[1:1 + x.numel()].view(2, 8, 8, 16).permute(0, 3, 1, 2)
        assert x.is_contiguous(memory_format=CL) and x.data_ptr() % 16
    elif what == "source_missing":
        bias = None
    elif what == "source_dtype":
        bias = bias.float()
    assert site(x, w, bias) is None
    assert site.state.run.calls == [] and site.calls == 0


def test_workspace_is_allocated_per_call():
    p = Conv2dProblem.make("wgrad", 2, 16, 8, 8, 32, 3, padding=1)
    i, site = bound_site(p, workspace=4096)
    dy, x = t(2, 32, 8, 8), t(2, 16, 8, 8)
    site(dy, x, None)
    site(dy, x, None)
    c1, c2 = site.state.run.calls
    assert c1["ws"] and c1["ws_len"] == 4096 and c2["ws_len"] == 4096


def test_a_failed_launch_raises_naming_the_kernel():
    from cutlass_byoc.runtime import KernelLaunchError

    p = Conv2dProblem.make("fprop", 2, 16, 8, 8, 32, 3, padding=1)
    i, site = bound_site(p, run=FakeRun(rc=5))
    with pytest.raises(KernelLaunchError, match="fake: planted launch failure"):
        site(t(2, 16, 8, 8), t(32, 16, 3, 3), None)


def test_unbound_site_on_cpu_tensors_takes_the_general_path():
    p = Conv2dProblem.make("fprop", 2, 16, 8, 8, 32, 3, padding=1)
    i = library.register_site("fprop", p, "heuristic")
    assert library.site(i)(t(2, 16, 8, 8), t(32, 16, 3, 3), None) is None
    assert library.site(i).state is None  # nothing bound off CUDA


def test_site_op_off_the_gpu_takes_the_general_path():
    """The call-site op (what the partitioner inserts) on CPU tensors: its site does not bind, the general op's
    reference runs with the site problem's parameters."""
    x, w = torch.randn(2, 16, 8, 8), torch.randn(32, 16, 3, 3)
    ref = torch.nn.functional.conv2d(x, w, padding=1)
    y = library.conv2d_fprop(x, w, None, None, [1, 1], [1, 1], [1, 1], 1, "identity", torch.float32, "heuristic")
    assert torch.allclose(y, ref, atol=1e-5)
    p32 = Conv2dProblem.make("fprop", 2, 16, 8, 8, 32, 3, padding=1, dtype="f32")
    i = library.register_site("fprop", p32, "heuristic")
    y = library.FPROP(x, w, None, None, i)
    assert torch.allclose(y, ref, atol=1e-5) and y.is_contiguous(memory_format=CL)
    assert library.site(i).state is None and library.site(i).calls == 0


def test_partitioner_gives_every_op_its_own_site():
    from cutlass_byoc.offload import explain

    m = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1))
    gm, rep = explain(m, torch.randn(2, 8, 8, 8), training=True, options={"require_cuda": False})
    calls = [n for n in gm.graph.nodes if n.target in (library.FPROP, library.DGRAD, library.WGRAD)]
    sites = [n.args[-1] for n in calls]
    assert len(calls) == 5 and len(set(sites)) == 5
    for n, s in zip(calls, sites):
        site = library.site(s)
        assert site.kind == {library.FPROP: "fprop", library.DGRAD: "dgrad", library.WGRAD: "wgrad"}[n.target]
        assert site.problem.name in {e.problem for e in rep.offloaded}
