"""Training-step benchmark of the offload: ResNet-50 and MobileNetV2 under fp16 autocast, channels_last, run eagerly,
with ``torch.compile`` (Inductor) and with ``torch.compile(backend="cutlass_byoc")`` in one process; step times (SGD
with momentum and GradScaler) and the relative errors of loss and gradients of both compiled modes against eager, on
the same first batch from the same weights (loss scaled by LOSS_SCALE so that fp16 gradients are not subnormal).

``python -m cutlass_byoc.offload.bench --models resnet50 mobilenet_v2 --batch 64 --steps 20`` prints the table;
:func:`benchmark` returns its rows. Models come from torchvision when it is installed, else from the repository's
tests/models.py (structurally equal definitions).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import logging
import math
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("cutlass_byoc.offload")

MODES = ("eager", "inductor", "cutlass_byoc")


@dataclasses.dataclass
class BenchRow:
    """One model in one mode."""

    model: str
    mode: str
    step_ms: float
    first_step_s: float  # compile (and kernel builds) included
    loss: float
    loss_rel_err: float  # |loss - eager| / |eager|
    grad_rel_err: float  # ||g - g_eager|| / ||g_eager|| over all parameters
    grad_rel_err_max: float  # worst parameter (among those whose gradient is not ~0)
    speedup_vs_inductor: float = float("nan")
    offload: str = ""  # the offload report's head line (cutlass_byoc mode)
    fallbacks: int = 0  # op calls that fell back to PyTorch at run time (cutlass_byoc mode)

    def line(self) -> str:
        return (f"{self.model:14s} {self.mode:13s} {self.step_ms:9.2f} {self.speedup_vs_inductor:8.3f} "
                f"{self.first_step_s:8.1f} {self.loss_rel_err:10.2e} {self.grad_rel_err:10.2e} "
                f"{self.grad_rel_err_max:10.2e}")


HEADER = (f"{'model':14s} {'mode':13s} {'step ms':>9s} {'vs ind.':>8s} {'first s':>8s} {'loss err':>10s} "
          f"{'grad err':>10s} {'grad max':>10s}")


def model_factory(name: str) -> Callable[[], nn.Module]:
    """torchvision's model if installed, else the repository's tests/models.py definition."""
    try:
        import torchvision.models as tvm  # noqa: PLC0415

        return lambda: getattr(tvm, name)(weights=None)
    except ImportError:
        pass
    path = Path(__file__).resolve().parents[2] / "tests" / "models.py"
    spec = importlib.util.spec_from_file_location("cutlass_byoc_bench_models", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no torchvision and no {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.MODELS[name]


#: the fixed loss scale of the compared first step: fp16 gradients of an unscaled loss are mostly subnormal, and
#: relative errors between any two implementations are then meaningless (GradScaler exists for the same reason)
LOSS_SCALE = 2.0 ** 12


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt: Optional[torch.optim.Optimizer],
          dtype: torch.dtype, scaler: Optional["torch.amp.GradScaler"] = None, autocast: bool = True) -> torch.Tensor:
    """One training step under autocast: forward, loss, backward of the scaled loss, and (with opt) the update.
    Without a scaler the loss is scaled by LOSS_SCALE, so the gradients left in .grad are LOSS_SCALE times the
    gradient."""
    with torch.autocast("cuda", dtype=dtype, enabled=autocast):
        out = model(x)
    loss = F.cross_entropy(out.float(), y)
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        (loss * LOSS_SCALE).backward()
    if opt is not None:
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def relative_errors(loss: torch.Tensor, grads: Sequence[torch.Tensor], ref_loss: torch.Tensor,
                    ref_grads: Sequence[torch.Tensor]) -> tuple[float, float, float]:
    """(loss, global gradient, worst-parameter gradient) relative errors; parameters whose reference gradient is
    under 1e-3 of the largest are left out of the worst (their relative error measures cancellation noise)."""
    flat = torch.cat([g.float().flatten() for g in grads])
    ref_flat = torch.cat([g.float().flatten() for g in ref_grads])
    norms = [g.float().norm().item() for g in ref_grads]
    top = max(norms) if norms else 0.0
    worst = max((_rel(g, r) for g, r, n in zip(grads, ref_grads, norms) if n >= 1e-3 * top), default=0.0)
    return abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30), _rel(flat, ref_flat), worst


def head_rel_err(grads: Sequence[torch.Tensor], ref_grads: Sequence[torch.Tensor], frac: float = 0.2) -> float:
    """Relative error of the gradients of the last `frac` of the parameters (the layers next to the loss). At
    initialisation a deep BN network amplifies rounding noise exponentially towards the input, so whole-model
    gradient errors of any two fp16 implementations are large; the head's gradients stay comparable."""
    k = max(1, int(len(grads) * frac))
    return _rel(torch.cat([g.float().flatten() for g in grads[-k:]]),
                torch.cat([g.float().flatten() for g in ref_grads[-k:]]))


def compile_mode(model: nn.Module, mode: str, options: Optional[dict] = None):
    """The model as run in `mode`, and the cutlass_byoc backend object (None for the other modes)."""
    if mode == "eager":
        return model, None
    if mode == "inductor":
        return torch.compile(model), None
    if mode == "cutlass_byoc":
        from .backend import make_backend  # noqa: PLC0415

        backend = make_backend(options or {})
        return torch.compile(model, backend=backend), backend
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


def benchmark(models: Sequence[str] = ("resnet50", "mobilenet_v2"), batch: int = 64, image: int = 224,
              steps: int = 20, warmup: int = 3, dtype: torch.dtype = torch.float16, channels_last: bool = True,
              modes: Sequence[str] = MODES, options: Optional[dict] = None, seed: int = 0,
              print_table: bool = True) -> list[BenchRow]:
    """Run the benchmark; every mode of a model starts from the same weights and sees the same batches."""
    if not torch.cuda.is_available():
        raise RuntimeError("the offload benchmark needs a CUDA GPU")
    from . import library  # noqa: PLC0415

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    modes = sorted(modes, key=lambda m: m != "eager")  # eager first: the reference of the errors
    rows: list[BenchRow] = []
    for name in models:
        torch.manual_seed(seed)
        base = model_factory(name)().cuda().to(memory_format=fmt).train()
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(batch, 3, image, image, device="cuda", generator=g).contiguous(memory_format=fmt)
        y = torch.randint(0, 1000, (batch,), device="cuda", generator=g)
        ref = None
        for mode in modes:
            torch._dynamo.reset()
            library.RUNTIME.clear()
            model = copy.deepcopy(base)
            run, backend = compile_mode(model, mode, options)
            # the first step from the shared weights: timed (compile included) and compared with eager
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = _step(run, x, y, None, dtype)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            grads = [p.grad.detach().clone() for p in model.parameters()]
            if ref is None:
                ref = (loss.detach(), grads)
            lerr, gerr, gmax = relative_errors(loss.detach(), grads, *ref)
            model.zero_grad(set_to_none=True)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
            for _ in range(warmup):
                _step(run, x, y, opt, dtype, scaler)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                _step(run, x, y, opt, dtype, scaler)
            end.record()
            torch.cuda.synchronize()
            row = BenchRow(name, mode, start.elapsed_time(end) / steps, first, loss.item(), lerr, gerr, gmax)
            if backend is not None:
                row.offload = backend.report().summary().splitlines()[0]
                row.fallbacks = len(library.RUNTIME.fallbacks)
            rows.append(row)
        ind = next((r.step_ms for r in rows if r.model == name and r.mode == "inductor"), math.nan)
        for r in rows:
            if r.model == name:
                r.speedup_vs_inductor = ind / r.step_ms
    if print_table:
        print(format_table(rows, batch, image, dtype, channels_last))
    return rows


def format_table(rows: Sequence[BenchRow], batch: int, image: int, dtype: torch.dtype, channels_last: bool) -> str:
    lines = [f"training step, batch {batch}, {image}x{image}, autocast {dtype}, "
             f"{'channels_last' if channels_last else 'NCHW'}, {torch.cuda.get_device_name()}", HEADER]
    lines += [r.line() for r in rows]
    for r in rows:
        if r.offload:
            lines.append(f"{r.model}: {r.offload}; {r.fallbacks} run-time fallbacks")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["resnet50", "mobilenet_v2"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--nchw", action="store_true", help="NCHW model and input (default channels_last)")
    ap.add_argument("--select", choices=["heuristic", "cached", "tune"], default="cached")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    benchmark(a.models, a.batch, a.image, a.steps, a.warmup, getattr(torch, a.dtype), not a.nchw, a.modes,
              {"select": a.select})


if __name__ == "__main__":
    main()
