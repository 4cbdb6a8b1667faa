"""CPU tests of the offload on whole models: the joint (forward + backward) aten graphs of ResNet-18/50 and MobileNetV2
under bf16 autocast, traced on fake tensors as torch.compile traces them; every conv pass is found with the right kind,
wgrad casts to fp32 fused, depthwise convs offloaded to the depthwise kernels in all three passes; and an NCHW ResNet-18 partitioned by the backend
(eager AOTAutograd variant) trains like eager."""

from __future__ import annotations

import pytest
import torch

from cutlass_byoc.offload import OffloadOptions, Pass, make_backend
from cutlass_byoc.offload import library
from cutlass_byoc.offload.partition import META_KEY, offloaded_calls
from cutlass_byoc.offload.trace import explain
from models import MODELS, conv_counts

CPU = OffloadOptions(require_cuda=False)
aten = torch.ops.aten


@pytest.fixture(scope="module", params=sorted(MODELS))
def joint(request):
    torch.manual_seed(0)
    model = MODELS[request.param](num_classes=10).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    gm, rep = explain(model, x, training=True, autocast=torch.bfloat16, options=CPU)
    return request.param, model, gm, rep


def test_every_conv_pass_found_with_its_kind(joint):
    name, model, gm, rep = joint
    counts = conv_counts(model)
    every = counts["all"]  # dense and depthwise convs alike
    assert rep.count(Pass.FPROP) == every, rep.summary()
    assert rep.count(Pass.WGRAD) == every
    assert rep.count(Pass.DGRAD) == every - 1, "every conv but the first (the image needs no gradient)"
    assert rep.count(Pass.FPROP, None) == counts["all"]
    assert rep.count(Pass.WGRAD, None) == counts["all"]
    assert rep.count(Pass.DGRAD, None) == counts["all"] - 1
    calls = offloaded_calls(gm)
    assert len([c for c in calls if c.target is library.FPROP]) == every
    assert len([c for c in calls if c.target is library.DGRAD]) == every - 1
    assert len([c for c in calls if c.target is library.WGRAD]) == every
    # nothing is left in aten
    assert len([n for n in gm.graph.nodes if n.target is aten.convolution.default]) == 0
    assert len([n for n in gm.graph.nodes if n.target is aten.convolution_backward.default]) == 0


def test_depthwise_offloaded_in_every_pass_on_the_depthwise_kernels(joint):
    name, model, gm, rep = joint
    dw = conv_counts(model)["depthwise"]
    assert not rep.rejected, rep.summary()
    for kind in (Pass.FPROP, Pass.DGRAD, Pass.WGRAD):
        entries = [e for e in rep.offloaded if e.kind is kind and "_g" in e.problem.split("_d1x1")[1][:2]]
        assert len(entries) == dw, (kind, rep.summary())
        assert all(e.kernel.startswith(f"cb_dw_{kind.value}_") for e in entries), rep.summary()
    dense = [e for e in rep.offloaded if not e.kernel.startswith("cb_dw_")]
    assert len(dense) == 3 * conv_counts(model)["dense"] - 1


def test_wgrad_results_cast_to_fp32_master_weights_are_fused(joint):
    name, model, gm, rep = joint
    wgrads = [e for e in rep.offloaded if e.kind is Pass.WGRAD]
    assert all(e.fused == ("cast(float32)",) and "_f32_accf32" in e.problem for e in wgrads)
    fprops = [e for e in rep.offloaded if e.kind is Pass.FPROP]
    assert all("bf16bf16_bf16_accf32" in e.problem for e in fprops)
    assert all(e.kernel and e.kernel.startswith("cb_") for e in rep.offloaded)


def test_channels_last_model_stays_channels_last(joint):
    name, model, gm, rep = joint
    for call in offloaded_calls(gm):
        for i in (0, 1):
            assert call.args[i].meta["val"].is_contiguous(memory_format=torch.channels_last)
    clones = [n for n in gm.graph.nodes if n.meta.get(META_KEY) == "channels_last"]
    assert len(clones) == rep.layout_conversions <= 1, [str(c.args[0].target) for c in clones]
    assert rep.output_restrides == 0


def test_resnet50_inference_graph():
    model = MODELS["resnet50"](num_classes=10).eval()
    _, rep = explain(model, torch.randn(1, 3, 32, 32), options=CPU)
    assert rep.count(Pass.FPROP) == rep.count(Pass.FPROP, None) == 53
    assert rep.count(Pass.DGRAD, None) == rep.count(Pass.WGRAD, None) == 0


def test_nchw_resnet18_trains_like_eager_through_the_backend():
    """fp32 NCHW ResNet-18 through torch.compile with the backend (graphs run eagerly, the ops' reference on CPU):
    same loss and gradients as eager, convs channels_last inside, gradients back in the parameters' layout."""
    torch.manual_seed(0)
    model = MODELS["resnet18"](num_classes=10)
    ref_model = MODELS["resnet18"](num_classes=10)
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 64, 64)  # the last BNs normalise 16 values: small batches are too ill-conditioned
    backend = make_backend(require_cuda=False, inductor=False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    loss = compiled(x).logsumexp(1).mean()
    loss.backward()
    ref_loss = ref_model(x).logsumexp(1).mean()
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for (n, p), r in zip(model.named_parameters(), ref_model.parameters()):
        assert p.grad.shape == r.grad.shape and p.grad.is_contiguous(), n
        err = (p.grad - r.grad).norm() / r.grad.norm().clamp_min(1e-12)
        # fp32 throughout; differences are summation order, amplified by training-mode BN (AOTAutograd's
        # decomposed graph alone, with nothing offloaded, differs from eager by ~5e-3 here)
        assert err < 1e-2, f"{n}: relative error {err:.2e}"
    rep = backend.report()
    assert rep.count(Pass.FPROP) == 20 and rep.count(Pass.WGRAD) == 20 and rep.count(Pass.DGRAD) == 19
    # NCHW in: the image and the 7x7/3x3 weights are made channels_last once; nothing between convs
    n_spatial = sum(1 for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1))
    assert rep.layout_conversions <= 1 + n_spatial + 1, rep.summary()
