"""GPU tests of the offload (H200): ResNet-50 and MobileNetV2 training steps under fp16 autocast, channels_last,
with the cutlass_byoc backend against eager (loss and gradients close; the relative errors are printed and recorded)
and the step-time benchmark against torch.compile with Inductor alone, in one run."""

from __future__ import annotations

import copy

import pytest
import torch

from models import MODELS, conv_counts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the offload GPU tests run on the H200)"),
]

#: bounds on the relative errors against eager: fp16 autocast through BN; the backend may also not be worse than
#: twice what Inductor alone gives on the same step
LOSS_TOL = 5e-3
GRAD_TOL = 5e-2


def _run(mode, base, x, y, options=None):
    from cutlass_byoc.offload import library
    from cutlass_byoc.offload.bench import _step, compile_mode

    torch._dynamo.reset()
    library.RUNTIME.clear()
    model = copy.deepcopy(base)
    run, backend = compile_mode(model, mode, options)
    loss = _step(run, x, y, None, torch.float16)
    torch.cuda.synchronize()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    runtime = copy.deepcopy((dict(library.RUNTIME.kernel_calls), dict(library.RUNTIME.fallbacks)))
    return loss.detach(), grads, backend, runtime


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2"])
def test_training_step_matches_eager(name, record_property):
    from cutlass_byoc.offload import Pass
    from cutlass_byoc.offload.bench import relative_errors

    torch.manual_seed(0)
    base = MODELS[name]().cuda().to(memory_format=torch.channels_last).train()
    x = torch.randn(16, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (16,), device="cuda")
    ref_loss, ref_grads, _, _ = _run("eager", base, x, y)
    ind = relative_errors(*_run("inductor", base, x, y)[:2], ref_loss, ref_grads)
    loss, grads, backend, (kernel_calls, fallbacks) = _run("cutlass_byoc", base, x, y, {"select": "cached"})
    ours = relative_errors(loss, grads, ref_loss, ref_grads)
    print(f"\n{name}: relative errors vs eager (loss, grad, worst param): cutlass_byoc {ours}, inductor {ind}")
    print(backend.report().summary())
    record_property("rel_err_cutlass_byoc", ours)
    record_property("rel_err_inductor", ind)
    assert ours[0] < max(LOSS_TOL, 2 * ind[0])
    assert ours[1] < max(GRAD_TOL, 2 * ind[1])
    rep = backend.report()
    counts = conv_counts(base)
    assert rep.count(Pass.FPROP) == rep.count(Pass.WGRAD) == counts["dense"]
    assert rep.count(Pass.DGRAD) == counts["dense"] - 1
    assert not fallbacks, f"ops fell back to PyTorch at run time: {fallbacks}"
    assert sum(kernel_calls.values()) >= 3 * counts["dense"] - 1


def test_nchw_model_runs_channels_last_inside():
    """An NCHW ResNet-18: the convs run on channels_last operands (converted once at the input and weights), the
    gradients come back in the parameters' layout, and the step matches eager."""
    from cutlass_byoc.offload.bench import relative_errors

    torch.manual_seed(0)
    base = MODELS["resnet18"]().cuda().train()
    x = torch.randn(16, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (16,), device="cuda")
    ref_loss, ref_grads, _, _ = _run("eager", base, x, y)
    loss, grads, backend, (_, fallbacks) = _run("cutlass_byoc", base, x, y)
    errs = relative_errors(loss, grads, ref_loss, ref_grads)
    print(f"\nresnet18 NCHW: relative errors vs eager {errs}\n{backend.report().summary().splitlines()[0]}")
    assert errs[0] < LOSS_TOL and errs[1] < GRAD_TOL
    assert not fallbacks
    assert all(g.is_contiguous() for g in grads)
    n_spatial = sum(1 for m in base.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1))
    assert backend.report().layout_conversions <= n_spatial + 2


def test_benchmark_backend_vs_inductor_vs_eager():
    """The benchmark table of the issue: step time of the backend vs Inductor alone (and eager), with the relative
    errors, measured in one run. Speed is reported, not asserted."""
    from cutlass_byoc.offload.bench import benchmark

    rows = benchmark(models=("resnet50", "mobilenet_v2"), batch=64, image=224, steps=20, warmup=3,
                     options={"select": "cached"})
    assert len(rows) == 6
    for r in rows:
        assert r.step_ms > 0
        if r.mode == "cutlass_byoc":
            assert r.loss_rel_err < LOSS_TOL and r.grad_rel_err < GRAD_TOL, r
            assert r.fallbacks == 0, r.offload
