"""GPU (H200): the offload's host launch path. CUDA graph capture and replay give the results of the uncaptured ops
(training and inference, through Inductor's cudagraph trees), a changed layout or a misaligned view never reaches a
kernel through a call site, and the host cost per call is measured against aten.convolution (printed, not asserted:
speed lives in benchmarks)."""

from __future__ import annotations

import copy

import pytest
import torch

from models import Chain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (these tests run on the H200)"),
]

CL = torch.channels_last


def _train_steps(model, xs, cudagraph_steps: bool):
    """A plain loop with an optimizer; gradients set to None each step (with cudagraph trees, .grad of one replay
    must not be read after the next)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x in xs:
        if cudagraph_steps:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        loss = out.float().square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["options", "mode"])
def test_training_under_cuda_graphs_matches_without(how):
    from cutlass_byoc.offload import library, make_backend

    torch.manual_seed(0)
    base = Chain(True).cuda().to(memory_format=CL).train()
    xs = [torch.randn(8, 3, 32, 32, device="cuda").contiguous(memory_format=CL) for _ in range(5)]
    torch._dynamo.reset()
    plain = make_backend({"select": "heuristic", "strict": True})
    ref_losses, ref_params = _train_steps(torch.compile(copy.deepcopy(base), backend=plain), xs, False)
    torch._dynamo.reset()
    library.RUNTIME.clear()
    if how == "options":
        graphed = make_backend({"select": "heuristic", "strict": True, "cudagraphs": True})
        model = torch.compile(copy.deepcopy(base), backend=graphed)
    else:
        model = torch.compile(copy.deepcopy(base), backend="cutlass_byoc", mode="reduce-overhead")
    losses, params = _train_steps(model, xs, True)
    torch.cuda.synchronize()
    print(f"\ncudagraphs ({how}): losses {losses.tolist()} vs {ref_losses.tolist()}; "
          f"kernel calls {library.RUNTIME.kernel_calls}, fallbacks {library.RUNTIME.fallbacks}")
    assert not library.RUNTIME.fallbacks
    # replays run no Python: the ops ran (and were counted) only while cudagraph trees warmed up and recorded
    assert 0 < sum(library.RUNTIME.kernel_calls.values()) < 5 * 11
    assert torch.allclose(losses, ref_losses, rtol=1e-3, atol=1e-5), (losses, ref_losses)
    for p, r in zip(params, ref_params):
        assert torch.allclose(p, r, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("cudagraphs", [False, True], ids=["eager-launch", "cudagraphs"])
def test_overlapped_wgrads_train_as_in_line_ones(cudagraphs):
    """overlap_wgrad 1 and 2 (the wgrads on a side stream, joined back later in the backward): five training steps
    give the losses and weights of the in-line graph, with and without CUDA graphs (then the side stream is a branch
    of the captured graph), and nothing is left pending on the side stream after a step."""
    from cutlass_byoc.offload import library, make_backend

    torch.manual_seed(0)
    base = Chain(True).cuda().to(memory_format=CL).train()
    xs = [torch.randn(8, 3, 32, 32, device="cuda").contiguous(memory_format=CL) for _ in range(5)]
    runs = {}
    for overlap in (0, 1, 2):
        torch._dynamo.reset()
        library.RUNTIME.clear()
        backend = make_backend({"select": "heuristic", "strict": True, "cudagraphs": cudagraphs,
                                "overlap_wgrad": overlap})
        runs[overlap] = _train_steps(torch.compile(copy.deepcopy(base), backend=backend), xs, cudagraphs)
        torch.cuda.synchronize()
        assert library.overlap_pending(torch.device("cuda")) == 0
        assert backend.report().overlapped_wgrads == (3 if overlap else 0), backend.report().summary()
        assert not library.RUNTIME.fallbacks and sum(library.RUNTIME.kernel_calls.values()) > 0
    ref_losses, ref_params = runs[0]
    for overlap in (1, 2):
        losses, params = runs[overlap]
        worst = max(((p - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for p, r in zip(params, ref_params))
        print(f"\noverlap_wgrad={overlap} (cudagraphs={cudagraphs}): losses {losses.tolist()} vs in line "
              f"{ref_losses.tolist()}; worst weight difference {worst:.2e} of the weight's largest")
        assert torch.allclose(losses, ref_losses, rtol=1e-3, atol=1e-5), (losses, ref_losses)
        for p, r in zip(params, ref_params):
            assert torch.allclose(p, r, rtol=1e-3, atol=1e-4)


def test_inference_under_cuda_graphs_matches_without():
    from cutlass_byoc.offload import make_backend

    torch.manual_seed(0)
    base = Chain(False).cuda().half().to(memory_format=CL).eval()
    xs = [torch.randn(4, 3, 32, 32, device="cuda", dtype=torch.half).contiguous(memory_format=CL) for _ in range(4)]
    torch._dynamo.reset()
    with torch.no_grad():
        ref_model = torch.compile(copy.deepcopy(base), backend=make_backend({"select": "heuristic", "strict": True}))
        refs = [ref_model(x).clone() for x in xs]
        torch._dynamo.reset()
        model = torch.compile(copy.deepcopy(base),
                              backend=make_backend({"select": "heuristic", "strict": True, "cudagraphs": True}))
        outs = []
        for x in xs:
            torch.compiler.cudagraph_mark_step_begin()
            outs.append(model(x).clone())
    for o, r in zip(outs, refs):
        assert torch.equal(o, r)  # the same kernels on the same inputs: bit-identical


def test_changed_layout_or_misaligned_view_is_never_launched_through_a_site():
    from cutlass_byoc.offload import library, native
    from cutlass_byoc.problem import Conv2dProblem

    p = Conv2dProblem.make("fprop", 2, 16, 9, 9, 32, 3, padding=1)
    i = library.register_site("fprop", p, "heuristic")
    nat = native.loaded()
    assert nat is not None, f"the C++ call-site ops did not load here: {native.why_not()}"
    site = library.site(i)
    x = torch.randn(2, 16, 9, 9, device="cuda", dtype=torch.half).contiguous(memory_format=CL)
    w = torch.randn(32, 16, 3, 3, device="cuda", dtype=torch.half).contiguous(memory_format=CL)
    ref = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)

    def op(a, b):
        return library.FPROP(a, b, None, None, i)

    y = op(x, w)  # the first call binds the site (in Python), and hands the binding to the C++ path
    assert site.calls == 1 and nat.calls(i) == 0 and (y.double() - ref).norm() / ref.norm() < 1e-2
    y = op(x, w)  # the C++ path
    assert site.calls == 1 and nat.calls(i) == 1 and (y.double() - ref).norm() / ref.norm() < 1e-2
    # NCHW input: the site refuses it, the general path converts and computes it
    y2 = op(x.contiguous(), w)
    assert site.launches == 2 and (y2.double() - ref).norm() / ref.norm() < 1e-2
    # a view 2 bytes off the 16-byte alignment: refused by the site, run by a narrower kernel on the general path
    flat = torch.empty(x.numel() + 8, device="cuda", dtype=torch.half)
    xv = flat[1:1 + x.numel()].view(2, 9, 9, 16).permute(0, 3, 1, 2)
    xv.copy_(x)
    assert xv.is_contiguous(memory_format=CL) and xv.data_ptr() % 16
    y3 = op(xv, w)
    assert site.launches == 2 and (y3.double() - ref).norm() / ref.norm() < 1e-2
    # an fp32 input: refused by both paths of the site (the general path computes it)
    y4 = op(x.float(), w)
    assert site.launches == 2 and (y4.double() - ref).norm() / ref.norm() < 1e-2


def test_the_native_path_under_a_side_stream_and_the_outputs_poisoned_first():
    """The C++ path launches on the current stream (a side stream here) and writes every output element."""
    from cutlass_byoc.offload import library, native
    from cutlass_byoc.problem import Conv2dProblem

    p = Conv2dProblem.make("dgrad", 4, 32, 12, 12, 64, 3, padding=1)
    i = library.register_site("dgrad", p, "heuristic")
    assert native.loaded() is not None, native.why_not()
    dy = torch.randn(4, 64, 12, 12, device="cuda", dtype=torch.half).contiguous(memory_format=CL)
    w = torch.randn(64, 32, 3, 3, device="cuda", dtype=torch.half).contiguous(memory_format=CL)
    ref = torch.nn.grad.conv2d_input((4, 32, 12, 12), w.double(), dy.double(), padding=1)
    library.DGRAD(dy, w, i)  # binds
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            # poison what the caching allocator will hand out next
            torch.full((4 * 32 * 12 * 12,), float("nan"), device="cuda", dtype=torch.half)
            y = library.DGRAD(dy, w, i)
    side.synchronize()
    assert native.loaded().calls(i) == 3
    assert torch.isfinite(y).all() and (y.double() - ref).norm() / ref.norm() < 1e-2


def test_host_overhead_per_call_vs_aten():
    """Printed for the closing note: host microseconds per call (tiny problem, the GPU idle) of the op through its
    call site and of aten.convolution (cuDNN)."""
    from cutlass_byoc.offload.bench import host_overhead

    rows = host_overhead()
    for r in rows:
        print(r)
    assert all(r["us_per_call"] > 0 for r in rows)
