"""CPU tests of the C++ call-site ops (csrc/call_sites.cpp, offload/native.py): built with the host compiler against
this torch, loaded, and run on CPU tensors (the CB_SITES_TEST_CPU build registers the kernels for CPU) with a fake
cb_run standing in for a kernel library. They check what the C++ path launches (the argument block's pointers and
fields, the output's shape, strides and dtype, the workspace) and that every operand it cannot take (dtype, shape,
layout, alignment, a missing or extra source) goes to the Python twin, which runs the general path.

The checks run in a child process: the test build's CPU registrations must not leak into the other tests."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

CL = torch.channels_last
RUN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int)  # msg as an address: the fake writes into it


def test_native_call_sites_on_cpu(tmp_path):
    env = dict(os.environ, CUTLASS_BYOC_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "checks passed" in r.stdout


def test_native_build_key_covers_defines_and_torch():
    from cutlass_byoc.offload import native

    assert native.build_key() != native.build_key(("CB_SITES_TEST_CPU",))
    assert native.build_key() == native.build_key()


def test_native_off_by_env(monkeypatch):
    from cutlass_byoc.offload import native

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv(native.ENV, "0")
    assert native.load() is None
    assert native.why_not() == f"{native.ENV}=0"


# ------------------------------------------------------------------------------------------------ the child
class _Recorder:
    def __init__(self):
        self.calls, self.rc = [], 0

    def __call__(self, args_p, ws, ws_len, stream, msg, n):
        from cutlass_byoc.runtime import CbConv2dArgs

        args = CbConv2dArgs.from_address(args_p)
        self.calls.append(dict(a=args.a, b=args.b, d=args.d, source=args.source or 0, bias=args.bias or 0,
                               n=args.n, k=args.k, r=args.r, ws=ws or 0, ws_len=ws_len, stream=stream or 0))
        if self.rc:
            ctypes.memmove(msg, b"planted launch failure\0", 23)
        return self.rc


def _site(problem, rec, source_shape=None, workspace=0, align=(16, 16, 16), bias=False, dt=torch.float16,
          dt_out=torch.float16):
    from cutlass_byoc.offload import library
    from cutlass_byoc.runtime import make_args

    i = library.register_site(problem.kind.value, problem, "heuristic", source_shape)
    site = library.site(i)
    n, h, w, c = problem.out_shape
    a, b = problem.a_shape, problem.b_shape
    run = RUN(rec)
    site.state = library._Bound(
        run, make_args(problem), workspace, *align, (a[0], a[3], a[1], a[2]), (b[0], b[3], b[1], b[2]),
        dt, dt, (n, c, h, w), (h * w * c, 1, w * c, c), dt_out,
        tuple(source_shape) if source_shape is not None else None, "fake", ctypes.create_string_buffer(256),
        dt_out, align[2], torch.float16 if bias else None, 16 if bias else 0, (problem.k,))
    return i, site, run


def _t(*shape):
    return torch.randn(*shape).to(torch.float16).contiguous(memory_format=CL)


def _child() -> None:
    from cutlass_byoc.offload import library, native
    from cutlass_byoc.problem import Conv2dProblem, Epilogue
    from cutlass_byoc.types import Activation, ConvKind, DType, SourceKind

    nat = native.Native(native.build(defines=("CB_SITES_TEST_CPU",)))
    native._state["native"] = nat  # as load() would
    fprop, dgrad = torch.ops.cutlass_byoc.fprop_site.default, torch.ops.cutlass_byoc.dgrad_site.default

    # fprop, no source: the launch, the output, the counter
    p = Conv2dProblem(kind=ConvKind.FPROP, n=2, h=8, w=8, c=16, k=32, r=3, s=3, pad_h=1, pad_w=1,
                      element_a=DType.F16, element_b=DType.F16, element_out=DType.F16)
    rec = _Recorder()
    i, site, run = _site(p, rec, workspace=100)
    nat.set_site(i, site.state.native_spec(), "fake fprop")
    x, w = _t(2, 16, 8, 8), _t(32, 16, 3, 3)
    y = fprop(x, w, None, None, i)
    assert len(rec.calls) == 1, rec.calls
    c = rec.calls[0]
    assert (c["a"], c["b"], c["d"]) == (x.data_ptr(), w.data_ptr(), y.data_ptr()), c
    assert (c["n"], c["k"], c["r"], c["source"], c["stream"]) == (2, 32, 3, 0, 0), c
    assert c["ws_len"] == 100 and c["ws"] != 0, c
    assert y.shape == (2, 32, 8, 8) and y.is_contiguous(memory_format=CL) and y.dtype == torch.float16
    assert nat.calls(i) == 1 and library.site_calls().get("fprop") == 1

    # everything the kernel cannot take goes to the twin: the general path (on CPU: the reference)
    ref = lambda xx: F.conv2d(xx.float(), w.float(), padding=1)  # noqa: E731
    for bad in (x.to(torch.float32), x.contiguous(), _t(2, 16, 8, 9),
                torch.empty(2 * 16 * 8 * 8 + 1, dtype=torch.float16)[1:].view(2, 8, 8, 16).permute(0, 3, 1, 2)):
        if bad.dtype == torch.float16 and bad.is_contiguous(memory_format=CL) and bad.shape == x.shape:
            bad.copy_(x)  # the misaligned view: the same values
            assert bad.data_ptr() % 16
        out = fprop(bad, w, None, None, i)
        assert len(rec.calls) == 1, "launched an operand the kernel cannot take"
        if bad.shape == x.shape:
            torch.testing.assert_close(out.float(), ref(bad.float()), rtol=2e-3, atol=2e-2)
    assert len(rec.calls) == 1
    fprop(x, w, torch.randn(32).half(), None, i)  # an extra source
    assert len(rec.calls) == 1

    # switched off (set_use_kernels(False)): the twin, i.e. the reference
    library.set_use_kernels(False)
    fprop(x, w, None, None, i)
    assert len(rec.calls) == 1
    library.set_use_kernels(True)
    fprop(x, w, None, None, i)
    assert len(rec.calls) == 2

    # bias and residual: source = the residual, bias = the second pointer
    p2 = Conv2dProblem(kind=ConvKind.FPROP, n=2, h=8, w=8, c=16, k=32, r=1, s=1, element_a=DType.F16,
                       element_b=DType.F16, element_out=DType.F16,
                       epilogue=Epilogue(Activation.RELU, SourceKind.BIAS_RESIDUAL))
    rec2 = _Recorder()
    i2, site2, run2 = _site(p2, rec2, source_shape=(2, 32, 8, 8), bias=True)
    nat.set_site(i2, site2.state.native_spec(), "fake fprop bias+residual")
    w1, res, bias = _t(32, 16, 1, 1), _t(2, 32, 8, 8), torch.randn(32).half()
    y2 = fprop(x, w1, bias, res, i2)
    c = rec2.calls[-1]
    assert (c["source"], c["bias"], c["d"]) == (res.data_ptr(), bias.data_ptr(), y2.data_ptr()), c
    fprop(x, w1, bias, None, i2)  # no residual: not what the site was compiled for
    fprop(x, w1, bias.float(), res, i2)  # the bias's dtype
    assert len(rec2.calls) == 1

    # dgrad; a kernel's error becomes a RuntimeError naming the site
    pd = Conv2dProblem(kind=ConvKind.DGRAD, n=2, h=8, w=8, c=16, k=32, r=3, s=3, pad_h=1, pad_w=1,
                       element_a=DType.F16, element_b=DType.F16, element_out=DType.F16)
    rec3 = _Recorder()
    i3, site3, run3 = _site(pd, rec3)
    nat.set_site(i3, site3.state.native_spec(), "fake dgrad")
    gy = _t(2, 32, 8, 8)
    gx = dgrad(gy, w, i3)
    assert gx.shape == (2, 16, 8, 8) and rec3.calls[-1]["d"] == gx.data_ptr()
    rec3.rc = 1
    try:
        dgrad(gy, w, i3)
        raise AssertionError("a failed launch returned")
    except RuntimeError as e:
        assert "fake dgrad" in str(e) and "planted launch failure" in str(e), e

    # a cleared site goes to the twin (here bound to the general path); counters reset with the runtime record
    spec = site.state.native_spec()
    nat.clear_site(i)
    site.state = False
    torch.testing.assert_close(fprop(x, w, None, None, i).float(), ref(x.float()), rtol=2e-3, atol=2e-2)
    assert len(rec.calls) == 2
    library.RUNTIME.clear()
    assert nat.calls(i2) == 0

    # bf16 operands with an fp32 output (wgrad into fp32 master weights): the dtype codes handed to C++ are right
    pw = Conv2dProblem(kind=ConvKind.WGRAD, n=2, h=8, w=8, c=16, k=32, r=3, s=3, pad_h=1, pad_w=1,
                       element_a=DType.BF16, element_b=DType.BF16, element_out=DType.F32)
    rec4 = _Recorder()
    i4, site4, run4 = _site(pw, rec4, dt=torch.bfloat16, dt_out=torch.float32)
    nat.set_site(i4, site4.state.native_spec(), "fake wgrad bf16->f32")
    gw = torch.ops.cutlass_byoc.wgrad_site.default(gy.bfloat16(), x.bfloat16(), i4)
    assert len(rec4.calls) == 1 and gw.dtype == torch.float32 and gw.shape == (32, 16, 3, 3)
    assert gw.is_contiguous(memory_format=CL) and rec4.calls[0]["d"] == gw.data_ptr()

    # wgrad_site_async (overlap_wgrad): the same checks and launch (on the CPU build in line, there is no stream);
    # `after` only orders the call; an operand it cannot take goes to its twin, which joins (nothing on the CPU) and
    # runs the general path
    wasync = torch.ops.cutlass_byoc.wgrad_site_async.default
    gyb, xb = gy.bfloat16(), x.bfloat16()
    for overlap in (2, 1, 0):
        gw2 = wasync(gyb, xb, i4, overlap, [gw, gyb] if overlap != 2 else [])
        assert len(rec4.calls) == 1 + (3 - overlap) and rec4.calls[-1]["d"] == gw2.data_ptr()
        assert gw2.dtype == torch.float32 and gw2.shape == (32, 16, 3, 3) and gw2.is_contiguous(memory_format=CL)
    ref_w = torch.ops.aten.convolution_backward(gyb.float(), xb.float(), gw.float(), None, [1, 1], [1, 1], [1, 1],
                                                False, [0, 0], 1, [False, True, False])[1]
    torch.testing.assert_close(wasync(gyb.contiguous(), xb, i4, 1, [gw]).float(), ref_w, rtol=2e-2, atol=5e-2)
    assert len(rec4.calls) == 4 and nat.overlap_pending(torch.device("cuda", 0)) == 0
    nat.overlap_join(torch.device("cuda", 0))  # nothing pending: a no-op
    rec4.calls = rec4.calls[:1]

    # the host-overhead benchmark's split: the fast path and cb_run alone in C++ loops, on operands of the spec
    # (20 warm-up calls, then the timed ones)
    n2 = len(rec2.calls)
    assert nat.time_site(i2, None, 30, nat.LAUNCH) > 0 and len(rec2.calls) == n2 + 50
    c = rec2.calls[-1]
    assert c["source"] and c["bias"] and c["d"] and c["source"] != c["bias"], c
    assert nat.time_site(i4, None, 30, nat.RUN) > 0 and len(rec4.calls) == 1 + 50
    assert len({call["d"] for call in rec4.calls[1:]}) == 1  # one prepared argument block
    for index, words in ((i, "not bound"), (i3, "planted launch failure")):  # cleared; a failing kernel
        try:
            nat.time_site(index, None, 5, nat.RUN)
            raise AssertionError(f"site {index} timed")
        except RuntimeError as e:
            assert words in str(e), e

    # a dynamic site (symbolic batch): one binding per batch size, each call on the one its operands match; a batch
    # size with no binding goes to the twin; the chain keeps the newest kMaxVariants (8) bindings
    rec5 = _Recorder()
    i5, site5, run5 = _site(p, rec5)
    site5.dynamic = True
    nat.set_site(i5, site5.state.native_spec(), "fake fprop n=2")
    runs = [run5]
    for n in range(3, 11):  # 8 more: the n=2 binding is dropped
        pn = p.replace(n=n)
        _, s_n, run_n = _site(pn, rec5)
        runs.append(run_n)
        nat.add_site_variant(i5, s_n.state.native_spec(), f"fake fprop n={n}")
    for n in (3, 10, 5):
        xn = _t(n, 16, 8, 8)
        yn = fprop(xn, w, None, None, i5)
        c = rec5.calls[-1]
        assert (c["n"], c["a"], c["d"]) == (n, xn.data_ptr(), yn.data_ptr()) and yn.shape == (n, 32, 8, 8), c
    assert len(rec5.calls) == 3 and nat.calls(i5) == 3
    y_2 = fprop(x, w, None, None, i5)  # n=2: dropped from the chain, the twin (the reference on the CPU)
    assert len(rec5.calls) == 3
    torch.testing.assert_close(y_2.float(), ref(x.float()), rtol=2e-3, atol=2e-2)
    for bad in (x.to(torch.float32), _t(3, 16, 8, 9)):  # a bound batch size, other operands wrong: the twin
        fprop(bad, w, None, None, i5)
    assert len(rec5.calls) == 3

    # malformed specs are refused by name
    for field, value, words in (("abi", 99, "ABI"), ("off_d", 10_000, "offset"), ("source_dim", 3, "source_dim")):
        bad = native.SiteSpec.from_buffer_copy(spec)  # a good spec, one field spoilt
        setattr(bad, field, value)
        try:
            nat.set_site(i, bad, "bad")
            raise AssertionError(f"{field}={value} was accepted")
        except ValueError as e:
            assert words in str(e), e
        try:
            nat.add_site_variant(i5, bad, "bad")
            raise AssertionError(f"{field}={value} was accepted as a variant")
        except ValueError as e:
            assert words in str(e), e
    print("native call-site checks passed")


if __name__ == "__main__":
    _child()


def test_a_failed_build_leaves_the_python_path(monkeypatch, caplog):
    from cutlass_byoc.offload import native

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.delenv(native.ENV, raising=False)

    def broken(*a, **k):
        raise RuntimeError("Error building extension 'cutlass_byoc_sites': c++: not found")
    monkeypatch.setattr(native, "build", broken)
    with caplog.at_level("WARNING", logger="cutlass_byoc.offload"):
        assert native.load() is None and native.load() is None  # tried once, remembered
    assert native.loaded() is None and "c++: not found" in native.why_not()
    assert sum("call-site ops are unavailable" in r.getMessage() for r in caplog.records) == 1
