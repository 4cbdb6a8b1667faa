"""GPU tests of the offload (H200): ResNet-50, MobileNetV2, ConvNeXt-T and EfficientNet-B0 training steps under fp16
autocast, channels_last, with the cutlass_byoc backend against eager (loss and gradients close; the relative errors are
printed and recorded). The step-time benchmark against Inductor (with and without CUDA graphs) is the GPU round's
offload-bench step (``python -m cutlass_byoc.offload.bench``), which writes benchmarks/h200/offload.json."""

from __future__ import annotations

import copy

import pytest
import torch

from models import MODELS, conv_counts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the offload GPU tests run on the H200)"),
]

#: Randomly initialised ResNet-50 / MobileNetV2 in training mode are chaotic in their gradients: two correct fp16
#: implementations (eager and Inductor) differ by tens of percent on the same step. So each fp16 mode is measured
#: against an fp32 reference without TF32 (the "truth"), and the backend must be about as accurate as eager fp16
#: (and Inductor, where it runs): within SLACK times the larger of their errors (plus ABS) for the loss and the
#: gradients. (Seen on
#: the H200, batch 16: gradient errors vs truth 0.76-0.78 for all three modes on ResNet-50 and MobileNetV2; loss
#: errors 1e-4..5e-4 on ResNet-50, and 4.2e-3 eager, 5.4e-3 Inductor, 1.0e-2 backend on MobileNetV2.)
#: Errors against eager are printed too.
SLACK = 2.5
ABS = 2e-2


def _run(mode, base, x, y, options=None, fp32=False):
    from cutlass_byoc.offload import library
    from cutlass_byoc.offload.bench import _step, compile_mode

    torch._dynamo.reset()
    library.RUNTIME.clear()
    model = copy.deepcopy(base)
    run, backend = compile_mode(model, mode, options)
    if fp32:
        tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        try:
            loss = _step(run, x, y, None, torch.float32, autocast=False)
        finally:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    else:
        loss = _step(run, x, y, None, torch.float16)
    torch.cuda.synchronize()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    runtime = copy.deepcopy((dict(library.RUNTIME.kernel_calls), dict(library.RUNTIME.fallbacks)))
    return loss.detach(), grads, backend, runtime


def _check(name, base, x, y, modes=("eager", "inductor", "cutlass_byoc"), options=None):
    """Errors of each fp16 mode against the fp32 truth (and against eager); asserts the backend's accuracy."""
    from cutlass_byoc.offload.bench import head_rel_err, relative_errors

    truth = _run("eager", base, x, y, fp32=True)
    runs = {m: _run(m, base, x, y, options if m == "cutlass_byoc" else None) for m in modes}
    errs = {m: relative_errors(r[0], r[1], truth[0], truth[1]) for m, r in runs.items()}
    vs_eager = {m: relative_errors(r[0], r[1], runs["eager"][0], runs["eager"][1]) for m, r in runs.items()}
    head = {m: head_rel_err(r[1], truth[1]) for m, r in runs.items()}
    print(f"\n{name}: relative errors (loss, grad, worst param) vs fp32 truth: {errs}\n  vs eager fp16: {vs_eager}"
          f"\n  gradients of the last 20% of the parameters vs fp32 truth: {head}")
    ours = errs["cutlass_byoc"]
    others = [errs[m] for m in errs if m != "cutlass_byoc"]
    assert ours[0] <= SLACK * max(e[0] for e in others) + 1e-3, errs
    assert ours[1] <= SLACK * max(e[1] for e in others) + ABS, errs
    return runs["cutlass_byoc"], errs, vs_eager


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2", "convnext_tiny", "efficientnet_b0"])
def test_training_step_matches_eager(name, record_property):
    from cutlass_byoc.offload import Pass

    torch.manual_seed(0)
    base = MODELS[name]().cuda().to(memory_format=torch.channels_last).train()
    x = torch.randn(16, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (16,), device="cuda")
    # Inductor alone is left out here (its accuracy was seen equal to eager's, see SLACK): its compile of a whole
    # training graph costs minutes of device time, and the benchmark test below runs it anyway.
    (loss, grads, backend, (kernel_calls, fallbacks)), errs, vs_eager = _check(
        name, base, x, y, modes=("eager", "cutlass_byoc"), options={"select": "cached"})
    record_property("rel_err_vs_fp32", errs)
    record_property("rel_err_vs_eager", vs_eager)
    print(backend.report().summary())
    rep = backend.report()
    counts = conv_counts(base)
    # every conv, depthwise included (untuned problems: no decision says cuDNN is faster); no dgrad of the stem
    assert rep.count(Pass.FPROP) == rep.count(Pass.WGRAD) == counts["all"]
    assert rep.count(Pass.DGRAD) == counts["all"] - 1
    assert not fallbacks, f"ops fell back to PyTorch at run time: {fallbacks}"
    assert sum(kernel_calls.values()) >= 3 * counts["all"] - 1


def test_nchw_model_runs_channels_last_inside():
    """An NCHW ResNet-18: the convs run on channels_last operands (converted once at the input and weights), the
    gradients come back in the parameters' layout, and the step is as accurate as eager's."""
    torch.manual_seed(0)
    base = MODELS["resnet18"]().cuda().train()
    x = torch.randn(16, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (16,), device="cuda")
    (loss, grads, backend, (_, fallbacks)), _, _ = _check("resnet18 NCHW", base, x, y, modes=("eager", "cutlass_byoc"))
    print(backend.report().summary().splitlines()[0])
    assert not fallbacks
    assert all(g.is_contiguous() for g in grads)
    n_spatial = sum(1 for m in base.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1))
    assert backend.report().layout_conversions <= n_spatial + 2


def test_bench_fused_optimizer_steps_without_a_host_sync():
    """The offload bench's sgd-fused steps: GradScaler's step and update of a fused SGD never wait for the GPU
    (CUDA's sync debug mode raises on any synchronizing call), where the default SGD's step reads found-inf on the
    host; both update the parameters alike."""
    from cutlass_byoc.offload.bench import _step, make_optimizer

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)).cuda()
    x, y = torch.randn(4, 3, 8, 8, device="cuda"), torch.randint(0, 10, (4,), device="cuda")
    after = {}
    for name in ("sgd", "sgd-fused"):
        model = copy.deepcopy(base)
        opt = make_optimizer(name, model.parameters())
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            if name == "sgd":
                with pytest.raises(RuntimeError, match="synchroniz"):
                    scaler.step(opt)
            else:
                scaler.step(opt)
                scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if name == "sgd":  # the step again, syncing, for the comparison below
            scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
            model = copy.deepcopy(base)
            opt = make_optimizer(name, model.parameters())
            _step(model, x, y, opt, torch.float16, scaler)
        after[name] = [(p.detach() - p0.detach()).float() for p, p0 in zip(model.parameters(), base.parameters())]
    for a, b in zip(after["sgd"], after["sgd-fused"]):  # the updates themselves (the bench's lr is small)
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * a.abs().max().item())


def test_profile_leaves_out_annotations_and_names_the_launchers():
    """bench.profile_steps on a real CUDA step with an optimizer: the GPU timeline's range of the optimizer's
    record_function (Optimizer.step#SGD.step) is not counted as a kernel, and the launches outside CUDA graphs are
    put on the ops that made them (here every launch is outside a graph: the optimizer's among them)."""
    from cutlass_byoc.offload.bench import profile_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    x, y = torch.randn(4, 3, 8, 8, device="cuda"), torch.randint(0, 10, (4,), device="cuda")

    def one():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    one()  # the momentum buffers
    prof = profile_steps(one, steps=2)
    names = [name for _, _, name in prof["top_kernels"]]
    assert names and not any(name.startswith(("Optimizer.", "ProfilerStep")) for name in names), names
    assert "other" in prof["gpu_ms_by_source"]
    launchers = {name: n for n, name in prof["launchers"]}
    print(f"\nlaunchers per step: {prof['launchers']}\ntop kernels: {names}")
    assert any(name.startswith("aten::_foreach") for name in launchers), launchers
