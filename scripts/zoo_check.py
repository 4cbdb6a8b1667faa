"""The backend on real models' graphs, on the CPU: torchvision's and timm's models (random weights) partitioned as
`torch.compile` would hand them to the backend, and optionally one training step through the backend against eager.

    python scripts/zoo_check.py [--models tv:resnet50 timm:ghostnet_100 seg:fcn_resnet50 ...] [--numerics]
        [--layout cl|nchw] [--amp none|bf16] [--image 96] [--numerics-image 64] [--json out.jsonl]

- Partition (always): `offload.trace.model_problems` on fake tensors, training (fp16 autocast, the joint graph) and
  inference. Per model: whether a graph was left whole to PyTorch (`report.failure`, a partitioner defect to fix),
  the passes offloaded, and the reasons of those left.
- `--numerics`: one fp32 training step through `torch.compile(backend=make_backend(require_cuda=False,
  inductor=False))` (the partitioned graphs run eagerly, each offloaded call on its PyTorch reference) and through
  eager, both against eager float64. A parameter's gradient error is its distance from float64 over the larger of
  its float64 norm and 1e-3 of the largest one (gradients that are zero in exact arithmetic, such as a batch norm's
  bias before another batch norm, are noise in any fp32 run). The model is flagged when its error is over 1e-4 and
  over 10x eager's on the same parameter. `--amp bf16` runs both steps under CPU autocast (eager's is then a bf16
  one; float64 never is). Dropout and stochastic depth are set to 0, and batch norms use their running statistics
  (a batch of 4 small images makes training-mode statistics too ill-conditioned to compare).

Model names: `tv:NAME` (torchvision.models), `seg:NAME` (torchvision.models.segmentation, its "out"), `timm:NAME`,
or `pkg.module:factory` (called with no arguments).
Models that cannot be traced at all (e.g. a transformer at the wrong image size) are listed as model errors, apart
from the backend's. Exit status 1 when a graph was left whole or a model is flagged.

When torchvision's compiled ops do not load (a wheel built for another torch build), its models still build: the
registration errors of its C++ ops (nms, roi_align) are ignored on import.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import logging
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DEFAULT_MODELS = (
    "tv:resnet18 tv:resnet50 tv:resnext50_32x4d tv:wide_resnet50_2 tv:densenet121 tv:googlenet tv:inception_v3 "
    "tv:squeezenet1_1 tv:vgg11_bn tv:alexnet tv:shufflenet_v2_x1_0 tv:mnasnet1_0 tv:mobilenet_v2 "
    "tv:mobilenet_v3_large tv:efficientnet_b0 tv:efficientnet_v2_s tv:regnet_x_400mf tv:regnet_y_400mf "
    "tv:convnext_tiny tv:swin_t tv:vit_b_16 tv:maxvit_t seg:deeplabv3_mobilenet_v3_large seg:fcn_resnet50 "
    "seg:lraspp_mobilenet_v3_large timm:resnet50d timm:cspdarknet53 timm:dla34 timm:ghostnet_100 timm:rexnet_100 "
    "timm:mixnet_s timm:tinynet_a timm:nfnet_f0 timm:res2net50_26w_4s timm:resnest14d timm:repvgg_a2 "
    "timm:skresnet18 timm:xception41 timm:hrnet_w18_small timm:mobilevit_xs timm:poolformer_s12 timm:regnetz_b16 "
    "timm:convnextv2_atto timm:tf_efficientnet_b0 timm:ese_vovnet19b_dw timm:lcnet_050 timm:fastvit_t8 "
    "timm:selecsls42b timm:gernet_s").split()
TRANSFORMERS = ("vit", "swin", "maxvit", "deit", "beit", "efficientformer", "mvit")


def import_torchvision():
    try:
        import torchvision  # noqa: PLC0415
        return torchvision
    except RuntimeError:  # its C++ ops did not load: register their fake kernels leniently
        pass
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    original = torch.library.register_fake

    def lenient(*args, **kwargs):
        try:
            register = original(*args, **kwargs)
        except Exception:  # noqa: BLE001
            return lambda fn: fn

        def wrap(fn):
            try:
                return register(fn)
            except Exception:  # noqa: BLE001
                return fn
        return wrap

    torch.library.register_fake = lenient
    try:
        import torchvision  # noqa: PLC0415
    finally:
        torch.library.register_fake = original
    return torchvision


class SegmentationOut(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]


def build(spec: str, num_classes: int = 10) -> torch.nn.Module:
    where, name = spec.split(":", 1)
    if where not in ("tv", "seg", "timm"):  # pkg.module:factory, called with no arguments
        from cutlass_byoc.offload.trace import load_model  # noqa: PLC0415
        return load_model(spec)
    if where == "timm":
        try:
            import_torchvision()  # timm imports torchvision where it is installed: leniently first
        except ImportError:
            pass
        import timm  # noqa: PLC0415
        return timm.create_model(name, pretrained=False, num_classes=num_classes)
    tv = import_torchvision()
    if where == "seg":
        return SegmentationOut(tv.models.get_model_builder(name)(weights=None, weights_backbone=None,
                                                                 num_classes=num_classes))
    kwargs = {"weights": None, "num_classes": num_classes}
    if name.startswith("inception") or name == "googlenet":
        kwargs.update(aux_logits=False, init_weights=False)
    return tv.models.get_model_builder(name)(**kwargs)


class ModelError(Exception):
    """The model itself does not run (not the backend's doing)."""


def image_size(spec: str, default: int) -> int:
    """`default`, or what the model needs: 224 for a transformer's fixed patch grid, 128 for Inception's unpadded
    stride-2 convs."""
    name = spec.split(":", 1)[1]
    if any(t in name for t in TRANSFORMERS):
        return 224
    return max(default, 128) if name.startswith("inception") else default


def no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        random_drop = "Drop" in type(m).__name__ or "Stochastic" in type(m).__name__
        for attr in ("p", "drop_prob", "drop_rate"):
            if isinstance(getattr(m, attr, None), float) and (random_drop or attr == "drop_rate"):
                setattr(m, attr, 0.0)
    return model


def frozen_batch_norm(model: torch.nn.Module) -> torch.nn.Module:
    """Batch norms on their running statistics (eval mode), the rest training: a batch of 4 small images makes
    training-mode statistics so ill-conditioned that two fp32 runs differ from float64 by 1e-5 to 1e-2 at random, and
    a comparison would tell nothing about the convs; every conv still has its fprop, dgrad and wgrad."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.eval()
    return model


def partition(spec: str, image: int) -> dict:
    from cutlass_byoc.offload.trace import model_problems  # noqa: PLC0415

    model = build(spec)
    out = {}
    for training in (True, False):
        _, rep = model_problems(model, 2, training=training, image=image)
        left = collections.Counter(e.reason or "?" for e in rep.entries if not e.offloaded)
        out["training" if training else "inference"] = {
            "failure": rep.failure, "offloaded": len(rep.offloaded), "passes": len(rep.entries), "left": dict(left)}
    return out


def numerics(spec: str, image: int, channels_last: bool, amp: Optional[torch.dtype] = None) -> dict:
    # PyTorch's own CPU kernels, not oneDNN's: with oneDNN, eager's backward of FastViT-T8 (torch 2.13 CPU) crashed
    # the process with a corrupted heap, and went through with it off
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        return _numerics(spec, image, channels_last, amp)
    finally:
        torch.backends.mkldnn.enabled = was


def _numerics(spec: str, image: int, channels_last: bool, amp: Optional[torch.dtype]) -> dict:
    from cutlass_byoc.offload.backend import make_backend  # noqa: PLC0415
    from cutlass_byoc.offload.report import Pass  # noqa: PLC0415

    torch.manual_seed(0)
    model = frozen_batch_norm(no_dropout(build(spec)).train())
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.randn(4, 3, image, image)
    x64 = x.double()
    if channels_last:
        model, eager, exact = (m.to(memory_format=torch.channels_last) for m in (model, eager, exact))
        x, x64 = (t.contiguous(memory_format=torch.channels_last) for t in (x, x64))

    def autocast():
        return torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()

    try:
        with autocast():
            out = eager(x)
        out.float().logsumexp(1).mean().backward()
    except Exception as e:  # noqa: BLE001 - the model does not run at this size
        raise ModelError(f"eager: {type(e).__name__}: {e}") from e
    backend = make_backend(require_cuda=False, inductor=False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with autocast():
        out = compiled(x)
    loss = out.float().logsumexp(1).mean()
    loss.backward()
    exact_loss = exact(x64).logsumexp(1).mean()
    exact_loss.backward()
    truth = [p.grad for p in exact.parameters()]
    floor = 1e-3 * max(g.norm().item() for g in truth if g is not None)
    worst, worst_name, worst_eager, missing = 0.0, None, 0.0, []
    flagged = []
    for (name, p), e, g in zip(model.named_parameters(), eager.parameters(), truth):
        if g is None:
            continue
        if p.grad is None:
            missing.append(name)
            continue
        scale = max(g.norm().item(), floor)
        ours = (p.grad.double() - g).norm().item() / scale
        theirs = (e.grad.double() - g).norm().item() / scale
        if ours > worst:
            worst, worst_name, worst_eager = ours, name, theirs
        if ours > 1e-4 and ours > 10 * theirs:
            flagged.append(name)
    rep = backend.report()
    return {"loss_error": abs(loss.item() - exact_loss.item()) / abs(exact_loss.item()),
            "grad_error": worst, "worst": worst_name, "eager_error_there": worst_eager,
            "flagged": flagged, "missing_grads": missing,
            "offloaded": {k.value: rep.count(k) for k in (Pass.FPROP, Pass.DGRAD, Pass.WGRAD)},
            "failures": sum(1 for r in backend.reports if r.failure)}


def summary(rec: dict) -> str:
    """One model's line: its training graph's passes offloaded and left, and the numerics step's worst error."""
    if "model_error" in rec:
        return f"MODEL ERROR {rec['model_error'][:70]}"
    tr = rec["partition"]["training"]
    line = f"train {tr['offloaded']:3d}/{tr['passes']:3d} offloaded, {sum(tr['left'].values()):3d} left"
    if "numerics" in rec:
        line += f"; grad error {rec['numerics']['grad_error']:.1e} (eager {rec['numerics']['eager_error_there']:.1e})"
    if "numerics_error" in rec:
        line += f"; NUMERICS ERROR {rec['numerics_error'][:60]}"
    return line


def model_spec(text: str) -> str:
    """A --models entry: SOURCE:NAME (tv, seg, timm) or pkg.module:factory."""
    where, _, name = text.partition(":")
    if not where or not name:
        raise argparse.ArgumentTypeError(f"expected tv:NAME, seg:NAME, timm:NAME or pkg.module:factory, got {text!r}")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", type=model_spec, default=DEFAULT_MODELS)
    ap.add_argument("--numerics", action="store_true", help="also one CPU training step through the backend")
    ap.add_argument("--layout", choices=("cl", "nchw"), default="cl", help="the numerics step's layout")
    ap.add_argument("--amp", choices=("none", "bf16"), default="none",
                    help="the numerics step under CPU autocast (ours and eager alike; float64 without)")
    ap.add_argument("--image", type=int, default=96, help="the partition's image size (transformers: 224)")
    ap.add_argument("--numerics-image", type=int, default=64, help="the numerics step's (CPU time)")
    ap.add_argument("--json", default=None, help="also write one JSON line per model here")
    a = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # a left conv logs its reason at INFO; the report counts them
    try:
        return _run(a)
    finally:
        logging.disable(logging.NOTSET)  # a caller in the same process (tests) logs again


def _run(a: argparse.Namespace) -> int:
    bad = 0
    lines = []
    for spec in a.models:
        t0 = time.perf_counter()
        rec: dict = {"model": spec}
        try:
            rec["partition"] = partition(spec, image_size(spec, a.image))
        except Exception as e:  # noqa: BLE001 - the model cannot be traced: not the backend's
            rec["model_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rec["traceback"] = traceback.format_exc()[-1500:]
        if a.numerics and "model_error" not in rec:
            try:
                rec["numerics"] = numerics(spec, image_size(spec, a.numerics_image), a.layout == "cl",
                                           torch.bfloat16 if a.amp == "bf16" else None)
            except ModelError as e:
                rec["model_error"] = str(e)[:300]
            except Exception as e:  # noqa: BLE001
                rec["numerics_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rec["traceback"] = traceback.format_exc()[-1500:]
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        num = rec.get("numerics", {})
        failed = (any(v["failure"] for v in rec.get("partition", {}).values()) or "numerics_error" in rec
                  or bool(num.get("flagged") or num.get("missing_grads") or num.get("failures")))
        bad += failed
        lines.append(rec)
        print(f"{spec:34s} {summary(rec)}" + ("  <-- FAILED" if failed else ""), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(rec) + "\n")
    reasons = collections.Counter()
    for rec in lines:
        for reason, n in rec.get("partition", {}).get("training", {}).get("left", {}).items():
            reasons[re.sub(r"\d+", "N", reason.split(";")[0])[:100]] += n  # one line per kind of reason
    print(f"\n{len(lines)} models, {sum('model_error' in r for r in lines)} model errors, {bad} failed; "
          "passes left (training graphs), by reason:")
    for reason, n in reasons.most_common():
        print(f"  {n:4d}  {reason}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
