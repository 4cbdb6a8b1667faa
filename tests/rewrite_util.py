"""Run ops' operand rewrites (channel padding, space-to-depth) on the CPU with the kernel replaced by a float64
reference, for tests/test_padding.py and tests/test_s2d.py."""

from __future__ import annotations

import torch

from cutlass_byoc.config import LaunchConfig
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.types import Activation, ConvKind


def reference(p: Conv2dProblem, a, b, source=None, bias=None):
    """float64 act(conv + source + bias) of `p` from its kernel operands a, b (PyTorch's logical shapes)."""
    st, pd, dl = (p.stride_h, p.stride_w), (p.pad_h, p.pad_w), (p.dilation_h, p.dilation_w)
    a, b = a.double(), b.double()
    if p.kind is ConvKind.FPROP:
        out = torch.nn.functional.conv2d(a, b, None, st, pd, dl)
    elif p.kind is ConvKind.DGRAD:
        out = torch.nn.grad.conv2d_input((p.n, p.c, p.h, p.w), b, a, st, pd, dl)
    else:
        out = torch.nn.grad.conv2d_weight(b, (p.k, p.c, p.r, p.s), a, st, pd, dl)
    for t in (source, bias):
        if t is not None:
            out = out + (t.double().view(1, -1, 1, 1) if t.dim() == 1 else t.double())
    if p.epilogue.activation is Activation.RELU:
        out = out.relu()
    return out


def check_rewritten_run(monkeypatch, p: Conv2dProblem, launch: LaunchConfig, source: str | None) -> None:
    """ops._run_rewritten on fresh random fp32 operands (source None, "residual", "bias" or "bias_residual"), the
    kernel (ops.run_problem on the rewritten problem) replaced by `reference`, which also checks that it got the
    rewritten problem's shapes in channels_last; the user's output, poisoned first, must equal the reference."""
    from cutlass_byoc import ops  # noqa: PLC0415

    big = launch.kernel_problem(p)
    kind = p.kind.value
    g = torch.Generator().manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(p.n, p.c, p.h, p.w, generator=g).contiguous(memory_format=cl)
    wt = torch.randn(p.k, p.c, p.r, p.s, generator=g).contiguous(memory_format=cl)
    dy = torch.randn(p.n, p.k, p.p, p.q, generator=g).contiguous(memory_format=cl)
    a, b = {"fprop": (x, wt), "dgrad": (dy, wt), "wgrad": (dy, x)}[kind]
    out_shape = {"fprop": (p.n, p.k, p.p, p.q), "dgrad": (p.n, p.c, p.h, p.w), "wgrad": (p.k, p.c, p.r, p.s)}[kind]
    out_chans = p.c if kind == "dgrad" else p.k
    src = bias = None
    if source in ("residual", "bias_residual"):
        src = torch.randn(out_shape, generator=g).contiguous(memory_format=cl)
    if source == "bias":
        src = torch.randn(out_chans, generator=g)
    if source == "bias_residual":
        bias = torch.randn(out_chans, generator=g)
    out = torch.full(out_shape, float("nan")).contiguous(memory_format=cl)
    seen = {}

    def fake_run(prob, a_p, b_p, out_p, src_p=None, *, config=None, select=None, bias=None):
        seen.update(problem=prob, config=config)
        want_a = {"fprop": big.x_shape, "dgrad": big.y_shape, "wgrad": big.y_shape}[kind]
        assert tuple(a_p.shape) == (want_a[0], want_a[3], want_a[1], want_a[2])
        for t in (a_p, b_p, out_p):
            assert t.is_contiguous(memory_format=cl)
        out_p.fill_(float("nan"))
        out_p.copy_(reference(prob, a_p, b_p, src_p, bias).to(out_p.dtype))

    monkeypatch.setattr(ops, "run_problem", fake_run)
    ops._run_rewritten(p, launch, a, b, out, src, bias)
    assert seen["problem"] == big and seen["config"] == launch.unpadded
    ref = reference(p, a, b, src, bias)
    assert not torch.isnan(out).any()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5), (out.double() - ref).abs().max()
