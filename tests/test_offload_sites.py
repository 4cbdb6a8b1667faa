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
        assert not site.deterministic
    # OffloadOptions.deterministic: every site the partitioner makes binds deterministic kernels only
    gm, rep = explain(m, torch.randn(2, 8, 8, 8), training=True, options={"require_cuda": False, "deterministic": True})
    sites = [library.site(n.args[-1]) for n in gm.graph.nodes if n.target in (library.FPROP, library.DGRAD, library.WGRAD)]
    assert len(sites) == 5 and all(s.deterministic for s in sites)


# ---------------------------------------------------------------------------------------------- dynamic batch
class _FakePrep:
    """What ops.bind returns, for a fake library."""

    def __init__(self, problem, launch, run):
        from cutlass_byoc.runtime import make_args

        self.lib = type("Lib", (), {"_lib": type("L", (), {"cb_run": run})(), "name": launch.name})()
        self.template = make_args(problem, launch.split_k_slices)
        self.workspace_bytes = 64 * launch.split_k_slices
        self.align_bytes = (16, 16, 16)
        self.source_bytes = self.bias_bytes = 0


def _fake_binding(monkeypatch, plan, decided=None):
    """ops.bind checking the config rules as the real one does (then a fake library), select.choose giving `plan`
    for every problem, and `decided` recorded for the problems it maps; the launches bound, in order."""
    from cutlass_byoc import ops, select
    from cutlass_byoc.offload import native
    from cutlass_byoc.ops import UnsupportedConvError

    bound = []

    def bind(problem, launch):
        why = launch.reject_reason(problem)
        if why:
            raise UnsupportedConvError(why)
        bound.append((problem.n, launch))
        return _FakePrep(problem, launch, FakeRun())

    monkeypatch.setattr(ops, "bind", bind)
    monkeypatch.setattr(select, "choose", lambda problem, mode=None: plan)
    monkeypatch.setattr(select, "lookup_decision", lambda problem: (decided or {}).get(problem))
    monkeypatch.setattr(native, "load", lambda: None)
    return bound


def _parallel_wgrad_launch(problem, splits):
    from cutlass_byoc.candidates import sm80_candidates
    from cutlass_byoc.config import LaunchConfig
    from cutlass_byoc.types import SplitKMode

    cfg = next(c for c in sm80_candidates(problem) if c.split_k_mode is SplitKMode.PARALLEL)
    return LaunchConfig(cfg, splits)


def test_a_dynamic_site_binds_each_batch_size_once_with_the_plan_launch(monkeypatch):
    """A symbolic-batch site: planned at N=4 (8 parallel split-k slices of a wgrad); each batch size met binds once,
    the plan's launch where its rules accept the problem, its split count halved where the shorter reduction needs
    it (N=1: 64 pixels, 2 slices of 32), each binding its own problem's shapes; later calls only check and launch."""
    p = Conv2dProblem.make("wgrad", 4, 16, 8, 8, 32, 3, padding=1)
    plan = _parallel_wgrad_launch(p, 8)
    bound = _fake_binding(monkeypatch, plan)
    i = library.register_site("wgrad", p, "cached", dynamic=True)
    site = library.site(i)
    assert site.bind_batch(4).a_shape == (4, 32, 8, 8)
    st1 = site.bind_batch(1)
    assert st1.a_shape == (1, 32, 8, 8) and st1.b_shape == (1, 16, 8, 8) and st1.out_size == (32, 16, 3, 3)
    assert [(n, launch.split_k_slices) for n, launch in bound] == [(4, 8), (1, 2)]
    assert {launch.kernel for _, launch in bound} == {plan.kernel}  # the same compiled kernel
    assert site.bind_batch(1) is st1 and len(bound) == 2  # once per size
    gy, x = t(1, 32, 8, 8), t(1, 16, 8, 8)
    gw = site(gy, x, None)
    (call,) = st1.run.calls  # the N=1 binding's launch, its own argument block and workspace
    assert gw.shape == (32, 16, 3, 3) and (call["n"], call["a"], call["d"]) == (1, gy.data_ptr(), gw.data_ptr())
    assert call["ws_len"] == 64 * 2
    assert site(t(2, 32, 8, 8), t(1, 16, 8, 8), None) is None  # operands of two batch sizes: the general path
    # the fake implementation: fprop / dgrad take the batch of their first operand, wgrad's output is static
    assert site.empty_output(torch.empty(3, 32, 8, 8)).shape == (32, 16, 3, 3)
    pf = Conv2dProblem.make("fprop", 4, 16, 8, 8, 32, 3, padding=1)
    fsite = library.site(library.register_site("fprop", pf, "cached", dynamic=True))
    assert fsite.empty_output(torch.empty(3, 16, 8, 8)).shape == (3, 32, 8, 8)


def test_a_dynamic_site_prefers_the_decision_recorded_for_that_batch(monkeypatch):
    p = Conv2dProblem.make("wgrad", 4, 16, 8, 8, 32, 3, padding=1)
    plan = _parallel_wgrad_launch(p, 8)
    p2 = p.replace(n=2)
    tuned = _parallel_wgrad_launch(p2, 1)
    bound = _fake_binding(monkeypatch, plan, decided={p2: tuned})
    site = library.site(library.register_site("wgrad", p, "cached", dynamic=True))
    site.bind_batch(2)
    site.bind_batch(4)
    site.bind_batch(3)  # no decision, the plan's 8 slices exceed the 192 pixels: 4
    assert [(n, launch.split_k_slices) for n, launch in bound] == [(2, 1), (4, 8), (3, 4)]
    # select="heuristic" never reads decisions
    bound.clear()
    hsite = library.site(library.register_site("wgrad", p, "heuristic", dynamic=True))
    hsite.bind_batch(2)
    assert [(n, launch.split_k_slices) for n, launch in bound] == [(2, 4)]  # the plan's, halved for 128 pixels


def test_a_dynamic_site_that_no_launch_takes_uses_the_general_path(monkeypatch):
    p = Conv2dProblem.make("fprop", 4, 16, 8, 8, 32, 3, padding=1)
    bound = _fake_binding(monkeypatch, None)
    site = library.site(library.register_site("fprop", p, "cached", dynamic=True))
    assert site.bind_batch(2) is False and site.bind_batch(2) is False and not bound


def test_dynamic_site_ops_run_on_every_batch_size(monkeypatch):
    """The call-site ops of a dynamic site on the general path (CPU: the reference) at several batch sizes: the
    dgrad twin takes the batch from grad_output, not the plan's problem."""
    import torch.nn.functional as F

    p = Conv2dProblem.make("dgrad", 4, 16, 8, 8, 32, 3, padding=1)
    i = library.register_site("dgrad", p, "heuristic", dynamic=True)
    w = torch.randn(32, 16, 3, 3)
    for n in (4, 3, 1):
        gy = torch.randn(n, 32, 8, 8)
        gx = library.DGRAD(gy, w, i)
        ref = torch.nn.grad.conv2d_input([n, 16, 8, 8], w, gy, 1, 1)
        assert gx.shape == (n, 16, 8, 8) and gx.dtype == torch.float16  # the site's output type
        torch.testing.assert_close(gx.float(), ref, rtol=1e-2, atol=2e-2)
    x = torch.randn(2, 16, 8, 8)
    f = library.site(library.register_site("fprop", Conv2dProblem.make("fprop", 4, 16, 8, 8, 32, 3, padding=1,
                                                                       dtype="f32"),
                                           "heuristic", dynamic=True))
    torch.testing.assert_close(library.FPROP(x, w, None, None, f.index), F.conv2d(x, w, padding=1), rtol=1e-4,
                               atol=1e-4)


def test_a_site_made_under_forced_determinism_binds_deterministic_twins(monkeypatch, tmp_cache):
    """OffloadOptions.deterministic: the partitioner makes its sites inside gemm1x1.forced_determinism, and such a
    site binds a decision's deterministic twin (an atomic split-k wgrad as its split-k twin, the same slices) without
    torch.use_deterministic_algorithms; a site made outside binds the decision as recorded."""
    import dataclasses

    from cutlass_byoc import select, sm90
    from cutlass_byoc.config import LaunchConfig
    from cutlass_byoc.gemm1x1 import deterministic_required, forced_determinism
    from cutlass_byoc.offload import OffloadOptions
    from cutlass_byoc.types import SplitKMode

    p = Conv2dProblem.make("wgrad", 4, 64, 8, 8, 64, 3, padding=1, out_dtype="f32")
    atomic = LaunchConfig(sm90.atomic_twin(sm90.sm90_config(p, (64, 128, 64), split_k_mode=SplitKMode.PARALLEL)), 2)
    real_choose = select.choose
    bound = _fake_binding(monkeypatch, None, decided={p: atomic})
    monkeypatch.setattr(select, "choose", real_choose)  # the real selection, on the planted decision
    plain = library.site(library.register_site("wgrad", p, "cached"))
    assert not deterministic_required()
    with forced_determinism():
        assert deterministic_required()
        forced = library.site(library.register_site("wgrad", p, "cached"))
    assert not deterministic_required()
    assert forced.deterministic and not plain.deterministic
    plain.bind(torch.device("cpu"))
    forced.bind(torch.device("cpu"))
    twin = dataclasses.replace(atomic, kernel=sm90.deterministic_twin(atomic.kernel))
    assert [launch for _, launch in bound] == [atomic, twin] and twin.kernel.split_k_mode is SplitKMode.PARALLEL
    with forced_determinism(False):
        assert not deterministic_required()
    with pytest.raises(ValueError, match="deterministic"):
        OffloadOptions(deterministic="yes")
