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
import re
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("cutlass_byoc.offload")

MODES = ("eager", "inductor", "inductor-cudagraphs", "cutlass_byoc", "cutlass_byoc-cudagraphs")
#: Modes a run may add (--modes), each the cutlass_byoc backend with these options over the case's own (a name ending
#: in -cudagraphs: with CUDA graphs, compared with inductor-cudagraphs), to split a result in the same process:
#: - cutlass_byoc-memo-off: the kernel libraries' launch memo switched off while the steps are timed (every cb_run
#:   checks and prepares its launch anew), the memo's share of a step;
#: - cutlass_byoc-no-host-credit: prefer_cudnn without the host credit (host_credit_us=0), i.e. every conv whose
#:   decision measured cuDNN faster stays with cuDNN as under CUDA graphs: what the credit gains;
#: - cutlass_byoc-no-wgrad-cudagraphs, cutlass_byoc-wgrad-only-cudagraphs: under CUDA graphs, wgrad left to PyTorch,
#:   or only wgrad offloaded: which passes' kernels gain or lose in the step, against the tune's prediction;
#: - cutlass_byoc-dynamic (and inductor-dynamic, plain Inductor the same way): after the first step, one step at a
#:   smaller batch (DYNAMIC_FRACTION of it: a training loop's last batch), so torch.compile recompiles with a
#:   symbolic batch size, and that dynamic graph serves the timed steps at the full batch; compared with
#:   inductor-dynamic when the run has it;
#: - cutlass_byoc-bnstats, cutlass_byoc-bnstats-cudagraphs: with fuse_bn_stats (each batch norm's statistics from its
#:   conv's channel-statistics epilogue where the conv's launch has a twin, not from a second pass over the output);
#: - cutlass_byoc-untuned, cutlass_byoc-untuned-cudagraphs: select="heuristic", every conv on the model's launch
#:   (heuristics.default_launch) whatever the decision cache holds: the untuned plan beside the tuned one;
#: - cutlass_byoc-overlap, cutlass_byoc-overlap-cudagraphs, cutlass_byoc-overlap2-cudagraphs: overlap_wgrad 1 (2):
#:   the offloaded wgrads on a side stream beside the rest of the backward, at most one (two) in flight;
#:   cutlass_byoc-inline, cutlass_byoc-inline-cudagraphs: overlap_wgrad 0, every wgrad in line, whatever the default;
#: - cutlass_byoc-bnstats-overlap, cutlass_byoc-bnstats-overlap-cudagraphs: fuse_bn_stats and overlap_wgrad 1 together;
#: - cutlass_byoc-deterministic, cutlass_byoc-deterministic-cudagraphs: deterministic kernels only (the atomic split-k
#:   wgrad and the nondeterministic stream-K reduction of the decisions run as their deterministic twins): what the
#:   nondeterministic kernels gain in the step, measured beside the plain mode;
#:   cutlass_byoc-untuned-deterministic, cutlass_byoc-untuned-deterministic-cudagraphs: both, the untuned plan with
#:   its fp32 split-k wgrads on partials and a reduction instead of their atomic twins (heuristics.atomic_default);
#: - cutlass_byoc-unbatched, cutlass_byoc-unbatched-cudagraphs: batch_params off, each parameter cast and batch-norm
#:   counter its own kernel as Inductor compiles them: what batching them gains, measured beside the plain mode;
#: - cutlass_byoc-inductor-pool, cutlass_byoc-inductor-pool-cudagraphs: max_pool off, the max pools' forward and
#:   backward as Inductor compiles them (pooling.py): what this backend's pool kernels gain in the step;
#: - cutlass_byoc-welford, cutlass_byoc-welford-cudagraphs: bn_sums off, the batch norms' statistics as Inductor's
#:   Welford reductions: what the default's shifted sums (statistics.py) gain, measured beside the plain mode;
#:   cutlass_byoc-bnsums, cutlass_byoc-bnsums-cudagraphs: bn_sums set explicitly (the default since the forty-fifth
#:   session, so these equal the plain modes); cutlass_byoc-bnsums-only-cudagraphs:
#:   that rewrite alone, no conv, pool or cast taken from Inductor: how much of a step's gain is the statistics'.
EXTRA_MODE_OPTIONS: dict[str, dict] = {
    "cutlass_byoc-memo-off": {},
    "cutlass_byoc-no-host-credit": {"host_credit_us": 0.0},
    "cutlass_byoc-no-wgrad-cudagraphs": {"wgrad": False},
    "cutlass_byoc-wgrad-only-cudagraphs": {"fprop": False, "dgrad": False},
    "cutlass_byoc-dynamic": {},
    "cutlass_byoc-bnstats": {"fuse_bn_stats": True},
    "cutlass_byoc-bnstats-cudagraphs": {"fuse_bn_stats": True},
    "cutlass_byoc-untuned": {"select": "heuristic"},
    "cutlass_byoc-untuned-cudagraphs": {"select": "heuristic"},
    "cutlass_byoc-overlap": {"overlap_wgrad": 1},
    "cutlass_byoc-overlap-cudagraphs": {"overlap_wgrad": 1},
    "cutlass_byoc-overlap2-cudagraphs": {"overlap_wgrad": 2},
    "cutlass_byoc-inline": {"overlap_wgrad": 0},
    "cutlass_byoc-inline-cudagraphs": {"overlap_wgrad": 0},
    "cutlass_byoc-bnstats-overlap": {"fuse_bn_stats": True, "overlap_wgrad": 1},
    "cutlass_byoc-bnstats-overlap-cudagraphs": {"fuse_bn_stats": True, "overlap_wgrad": 1},
    "cutlass_byoc-deterministic": {"deterministic": True},
    "cutlass_byoc-deterministic-cudagraphs": {"deterministic": True},
    "cutlass_byoc-untuned-deterministic": {"select": "heuristic", "deterministic": True},
    "cutlass_byoc-untuned-deterministic-cudagraphs": {"select": "heuristic", "deterministic": True},
    "cutlass_byoc-unbatched": {"batch_params": False},
    "cutlass_byoc-unbatched-cudagraphs": {"batch_params": False},
    "cutlass_byoc-inductor-pool": {"max_pool": False},
    "cutlass_byoc-inductor-pool-cudagraphs": {"max_pool": False},
    "cutlass_byoc-welford": {"bn_sums": False},
    "cutlass_byoc-welford-cudagraphs": {"bn_sums": False},
    "cutlass_byoc-bnsums": {"bn_sums": True},
    "cutlass_byoc-bnsums-cudagraphs": {"bn_sums": True},
    "cutlass_byoc-bnsums-only-cudagraphs": {"bn_sums": True, "fprop": False, "dgrad": False, "wgrad": False,
                                            "transposed": False, "max_pool": False, "batch_params": False},
}
EXTRA_MODES = (*EXTRA_MODE_OPTIONS, "inductor-dynamic")
#: the dynamic modes' smaller batch, as a fraction of the case's batch
DYNAMIC_FRACTION = 0.75

#: The timed training steps' optimizer (--optimizers; every mode of a case runs each one, on the same compiled model):
#: - sgd: SGD with momentum, PyTorch's default implementation on CUDA (foreach). GradScaler.step reads its found-inf
#:   flag on the host (`.item()`), so every step waits for the GPU to finish the backward before the update is
#:   launched, and the GPU idles while the host launches the update and the next step;
#: - sgd-fused: the same update with ``fused=True``. A fused optimizer takes GradScaler's scale and found-inf flag
#:   as tensors (``_step_supports_amp_scaling``), so the step never waits on the GPU; under CUDA graphs the step
#:   time then approaches the GPU's busy time in every mode.
OPTIMIZERS = ("sgd", "sgd-fused")


#: The timed steps' learning rate. Every mode trains its own copy of the model on the same batch for ~70 steps; at
#: lr 0.01 (momentum 0.9) some copies reached non-finite gradients within them (ResNet-50 on the H100, 2026-12-05:
#: Inductor's at b32, every mode's at b64), after which GradScaler skipped each of their updates and its non-finite
#: check slowed down, so those modes timed a different step (0.27 ms of fused update missing, 0.19 ms of found-inf
#: writes added). A small rate keeps every copy next to its validated first step; the update costs the same.
BENCH_LR = 1e-4


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """The benchmark's optimizer `name` (OPTIMIZERS) over `params`: lr BENCH_LR, momentum 0.9."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {name!r}")
    return torch.optim.SGD(params, lr=BENCH_LR, momentum=0.9, **({"fused": True} if name == "sgd-fused" else {}))


def make_scaler(enabled: bool = True):
    """The timed steps' GradScaler (disabled: bf16, whose steps need none): it starts at LOSS_SCALE (the scale the
    compared first step ran finite at) and never grows within a benchmark, so every halving of its scale is one
    skipped update (skipped_updates)."""
    return torch.amp.GradScaler("cuda", init_scale=LOSS_SCALE, growth_interval=1_000_000, enabled=enabled)


def skipped_updates(scale_before: float, scale_after: float) -> int:
    """Updates GradScaler skipped between two reads of its scale (make_scaler's: each skip halves it, none grows it)."""
    if not scale_before or not scale_after or scale_after >= scale_before:
        return 0
    return int(round(math.log2(scale_before / scale_after)))


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
    batch: int = 0
    training: bool = True
    profile: Optional[dict] = None  # --profile: where a step's time goes (profile_breakdown)
    rounds_ms: Optional[list] = None  # --rounds > 1: each round's ms per step (step_ms is their median)
    launch_memo: Optional[tuple] = None  # cutlass_byoc modes: (relaunches, full-path launches) of the timed steps
    optimizer: str = ""  # training: the timed steps' optimizer (OPTIMIZERS); "" for inference
    skipped_updates: Optional[int] = None  # training: steps after the warm-up (timed, the rounds' own warm-up step,
    # profiled) whose update GradScaler skipped for non-finite gradients; None: not counted (inference, bf16)

    @property
    def label(self) -> str:
        """The mode, with the optimizer where it is not the default one."""
        return self.mode if self.optimizer in ("", OPTIMIZERS[0]) else f"{self.mode} [{self.optimizer}]"

    def record(self) -> dict:
        """The row as benchmarks/h200/offload.json holds it."""
        return {"model": self.model, "batch": self.batch, "training": self.training, "mode": self.mode,
                **({"optimizer": self.optimizer} if self.optimizer else {}),
                "step_ms": round(self.step_ms, 4), "speedup_vs_inductor_same_mode": round(self.speedup_vs_inductor, 4),
                "first_step_s": round(self.first_step_s, 2), "loss_rel_err_vs_eager": self.loss_rel_err,
                "grad_rel_err_vs_eager": None if math.isnan(self.grad_rel_err) else self.grad_rel_err,
                "fallbacks": self.fallbacks, "offload": self.offload,
                **({"step_ms_rounds": [round(t, 4) for t in self.rounds_ms]} if self.rounds_ms else {}),
                **({"launch_memo": {"relaunches": self.launch_memo[0], "full": self.launch_memo[1]}}
                   if self.launch_memo else {}),
                **({"skipped_updates": self.skipped_updates} if self.skipped_updates is not None else {}),
                **({"profile": self.profile} if self.profile else {})}

    def line(self) -> str:
        return (f"{self.model:14s} {self.label:13s} {self.step_ms:9.2f} {self.speedup_vs_inductor:8.3f} "
                f"{self.first_step_s:8.1f} {self.loss_rel_err:10.2e} {self.grad_rel_err:10.2e} "
                f"{self.grad_rel_err_max:10.2e}"
                + (f"  {self.skipped_updates} of the timed updates skipped (non-finite gradients)"
                   if self.skipped_updates else ""))


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
    if mode == "inductor-dynamic":
        # Inductor's default config spelt out: torch.compile treats two Inductor backends with equal options as one
        # (their compiled graphs serve each other's calls), so without it this mode's dynamic graph would also serve
        # the "inductor" mode's steps, and its first step would reuse that mode's static graph
        return torch.compile(model, options={"max_autotune": False}), None
    if mode == "inductor-cudagraphs":
        return torch.compile(model, mode="reduce-overhead"), None
    if mode in ("cutlass_byoc", "cutlass_byoc-cudagraphs") or mode in EXTRA_MODE_OPTIONS:
        from .backend import make_backend  # noqa: PLC0415

        extra = EXTRA_MODE_OPTIONS.get(mode, {})
        backend = make_backend({**(options or {}), **extra, "cudagraphs": mode.endswith("-cudagraphs")})
        return torch.compile(model, backend=backend), backend
    raise ValueError(f"mode: expected one of {MODES + EXTRA_MODES}, got {mode!r}")


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmarked workload: a model at a batch size, a training step or an inference forward."""

    model: str
    batch: int
    training: bool = True

    @property
    def name(self) -> str:
        return f"{self.model} b{self.batch} {'training' if self.training else 'inference'}"

    @classmethod
    def parse(cls, text: str) -> "Case":
        """``resnet50:32`` (a training step) or ``resnet50:32:inference``."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or not parts[1].isdigit() or (len(parts) == 3 and parts[2] not in
                                                                   ("training", "inference")):
            raise ValueError(f"case: expected MODEL:BATCH[:training|inference], got {text!r}")
        return cls(parts[0], int(parts[1]), len(parts) == 2 or parts[2] == "training")


#: the cases of the issue: ResNet-50 and MobileNetV2 training at batch 32 and 64, ResNet-50 inference at 1 and 32
DEFAULT_CASES = (Case("resnet50", 32), Case("resnet50", 64), Case("mobilenet_v2", 32), Case("mobilenet_v2", 64),
                 Case("resnet50", 1, False), Case("resnet50", 32, False))


#: Ops whose GPU and CPU time the profile splits out: the offloaded conv passes and PyTorch's own convolutions (cuDNN)
OFFLOADED_OPS = ("cutlass_byoc::fprop_site", "cutlass_byoc::dgrad_site", "cutlass_byoc::wgrad_site",  # graphs' ops
                 "cutlass_byoc::wgrad_site_async",
                 "cutlass_byoc::conv2d_fprop", "cutlass_byoc::conv2d_dgrad", "cutlass_byoc::conv2d_wgrad")
ATEN_CONV_OPS = ("aten::convolution", "aten::convolution_backward")
#: CUDA API calls the profile counts per step: CUDA graph replays (one per captured graph or graph partition) and
#: kernel launches outside graphs (with CUDA graphs on, each one is host work between replays)
GRAPH_LAUNCH_APIS = ("cudaGraphLaunch", "cuGraphLaunch")
KERNEL_LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


#: gaps between consecutive kernels above this (us) count as the GPU waiting for the host; shorter ones are launch and
#: dependency latency inside a stream or graph
HOST_GAP_US = 10.0


def kernel_timeline(kernels: Sequence[tuple[float, float, str]], steps: int, top: int = 3) -> dict:
    """Per-step split of the GPU's timeline from the recorded kernels' (start us, end us, name): kernels per step,
    busy ms (the union of the kernels' intervals), the idle ms between the first and the last kernel split into
    short gaps (<= HOST_GAP_US: launch latency) and long gaps (the GPU waiting for the host), the long gaps' count,
    and the `top` longest gaps as [us, the kernel that ended the wait (what the host was late with), the kernel
    before it] (under CUDA graphs a long gap between two kernels of one graph points at those two)."""
    ks = sorted(kernels)
    busy = short = long_ = 0.0
    n_long = 0
    gaps: list[tuple[float, str, str]] = []
    end = None  # the end of the busy time so far
    last = ""  # the kernel that ended last so far
    for start, stop, name in ks:
        if end is not None and start > end:
            gap = start - end
            if gap > HOST_GAP_US:
                long_ += gap
                n_long += 1
                gaps.append((gap, name, last))
            else:
                short += gap
        if end is None or start >= end:  # a new busy interval
            busy += stop - start
            end = stop
            last = name
        elif stop > end:  # overlaps the busy time and extends it
            busy += stop - end
            end = stop
            last = name
    gaps.sort(key=lambda g: -g[0])
    return {"kernels": len(ks) / steps, "busy_ms": busy / steps / 1e3, "launch_gap_ms": short / steps / 1e3,
            "host_gap_ms": long_ / steps / 1e3, "host_gaps": n_long / steps,
            "longest_gaps": [[round(g, 1), short_kernel_name(name)[:80], short_kernel_name(before)[:80]]
                             for g, name, before in gaps[:top]]}


#: Where a GPU kernel comes from, by its name (first match wins): Inductor's Triton kernels (first: Inductor names a
#: fused kernel after the aten ops it computes, so a pointwise or reduction kernel next to a convolution is called
#: e.g. triton_poi_fused_convolution_backward_12 and must not count as cuDNN's), this project's kernels (its
#: templates' cb_ namespaces; the depthwise and shared-memory im2col templates' kernels in their anonymous namespaces,
#: depthwise_kernel, reduce_kernel, im2col_smem_kernel, im2col_smem_wgrad_kernel and reduce_slices_kernel; and
#: CUTLASS's kernel wrappers around this project's kernel types; cuBLAS's and cuDNN's CUTLASS kernels carry their own
#: cutlass_80_... / cutlass3x_... names), cuDNN's and
#: cuBLAS's (their xmma / nvjet / cudnn / CUTLASS kernels), and PyTorch's own (aten) kernels.
KERNEL_SOURCES = (("triton", re.compile(r"^triton_")),
                  ("cutlass_byoc", re.compile(r"cb_|^(_ZN7cutlass|void cutlass::)(?!.*cutlass(_\d|3x))|"
                                              r"^(void )?\(anonymous namespace\)::(depthwise|reduce|im2col_smem|"
                                              r"im2col_smem_wgrad|reduce_slices)_kernel\b")),
                  ("cudnn/cublas", re.compile(r"xmma|cudnn|nvjet|cutlass|gemm|conv", re.IGNORECASE)),
                  ("aten", re.compile(r"at::native|at::cuda|^void at::")))


#: the sources in the order reports list them (ours first; the classification order above is another matter)
SOURCE_ORDER = ("cutlass_byoc", "cudnn/cublas", "triton", "aten", "other")


def kernel_source(name: str) -> str:
    """The KERNEL_SOURCES tag of a kernel name ("other" when none matches)."""
    return next((tag for tag, rx in KERNEL_SOURCES if rx.search(name)), "other")


def _ms_per_step_by(kernels: Sequence[tuple[float, float, str]], steps: int, tags: Sequence[str],
                    tag_of: Callable[[str], Optional[str]]) -> dict:
    """GPU ms per step of the kernels under each of `tags` (in that order), a kernel's tag being tag_of(its name)
    (None: left out)."""
    out = dict.fromkeys(tags, 0.0)
    for start, stop, name in kernels:
        tag = tag_of(name)
        if tag is not None:
            out[tag] += stop - start
    return {tag: round(us / steps / 1e3, 4) for tag, us in out.items()}


def gpu_ms_by_source(kernels: Sequence[tuple[float, float, str]], steps: int) -> dict:
    """GPU ms per step of each kernel source (kernel_source), the convolutions' split between this project's
    kernels and cuDNN's included; holds under CUDA graphs too (replayed kernels are recorded)."""
    return _ms_per_step_by(kernels, steps, SOURCE_ORDER, kernel_source)


#: What an Inductor kernel of a training step computes, by the aten ops its name lists (first match wins): anything of
#: the backward (batch norm's and ReLU's backward, the residual gradients' adds, the pools' backward); the forward
#: batch norm's statistics (a reduction over the batch: triton_red_ / triton_per_); the forward batch norm's
#: normalization with what Inductor fused into it (ReLU, the residual add); and as "other" everything else (casts,
#: pooling, the loss). It tells how a step's Triton time splits where no kernel of this project runs.
TRITON_ROLES = (("backward", re.compile(r"backward")),
                ("bn_statistics", re.compile(r"^triton_(red|per)_.*batch_norm")),
                ("bn_apply", re.compile(r"^triton_poi_.*batch_norm")))


def triton_role(name: str) -> Optional[str]:
    """The TRITON_ROLES tag of a kernel name ("other" when none matches), None for a kernel that is not Triton's."""
    if kernel_source(name) != "triton":
        return None
    return next((tag for tag, rx in TRITON_ROLES if rx.search(name)), "other")


def triton_ms_by_role(kernels: Sequence[tuple[float, float, str]], steps: int) -> dict:
    """GPU ms per step of Inductor's Triton kernels by TRITON_ROLES, then "other" (the other sources' kernels are
    left out)."""
    return _ms_per_step_by(kernels, steps, [tag for tag, _ in TRITON_ROLES] + ["other"], triton_role)


_NAME_NOISE = re.compile(r"^void |\(anonymous namespace\)::|\bat::native::|\bat::cuda::|\bc10::")


def short_kernel_name(name: str) -> str:
    """A kernel's name for a report line cut at 80-100 characters: without the `void `, `at::native::` and
    `(anonymous namespace)::` that PyTorch's kernels start with, so the part that tells two apart fits (which
    multi_tensor_apply_kernel functor, which elementwise op). Sources are told from the whole name."""
    return _NAME_NOISE.sub("", name)


def top_kernels(kernels: Sequence[tuple[float, float, str]], steps: int, top: Optional[int] = 10,
                width: Optional[int] = 100) -> list:
    """The `top` kernel names (None: all) by summed GPU time: [ms per step, launches per step, name (its first `width`
    characters; None: whole)]. Unlike the ops' split this holds under CUDA graphs too (replayed kernels are recorded;
    their ops are not)."""
    by: dict[str, list[float]] = {}
    for start, stop, name in kernels:
        acc = by.setdefault(name, [0.0, 0.0])
        acc[0] += stop - start
        acc[1] += 1
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return [[round(us / steps / 1e3, 4), n / steps, name[:width]] for name, (us, n) in ranked]


def profile_breakdown(averages, kernels: Sequence[tuple[float, float, str]], steps: int, wall_ms: float) -> dict:
    """A profile's per-step split, from torch.profiler's key averages (name, count, cpu_time_total,
    device_time_total in us) and the GPU kernels it recorded ((start us, end us, name)): wall ms, the sum of kernel
    ms, the GPU timeline (:func:`kernel_timeline`: busy, launch gaps, host gaps), the kernels that take the most GPU
    time (:func:`top_kernels`), and for the offloaded conv ops and
    aten's convolutions their calls, host (CPU, children included) ms and GPU ms; CUDA graph replays and kernel
    launches outside graphs per step. Under CUDA graphs the kernels replay without their ops, so the op split means
    nothing there, and the launch counts say how the step was captured (one replay per graph or partition; launches
    outside graphs are host work)."""
    every = top_kernels(kernels, steps, top=None, width=None)
    by_source: dict[str, list] = {tag: [] for tag in SOURCE_ORDER}
    for k in every:
        by_source[kernel_source(k[2])].append(k)
    out = {"steps": steps, "wall_ms": wall_ms,
           "gpu_kernel_ms": sum(stop - start for start, stop, _ in kernels) / steps / 1e3,
           **kernel_timeline(kernels, steps),
           "top_kernels": [[ms, n, short_kernel_name(name)[:100]] for ms, n, name in every[:10]],
           "gpu_ms_by_source": gpu_ms_by_source(kernels, steps),
           "triton_ms_by_role": triton_ms_by_role(kernels, steps),
           # every Inductor kernel, whole names (their numeric suffixes tell apart the fused groups), so two modes'
           # Triton kernels can be compared one by one
           "triton_kernels": by_source.pop("triton"),
           # the other sources' kernels, whole names, so a source's total can be read kernel by kernel (which convs
           # are cuDNN's, which of PyTorch's kernels a mode adds)
           "kernels_by_source": by_source}
    for tag, names in (("graph_launches", GRAPH_LAUNCH_APIS), ("kernel_launches", KERNEL_LAUNCH_APIS)):
        out[tag] = sum(e.count for e in averages if e.key in names) / steps
    for tag, names in (("offloaded", OFFLOADED_OPS), ("aten_conv", ATEN_CONV_OPS)):
        ev = [e for e in averages if e.key in names]
        out[f"{tag}_calls"] = sum(e.count for e in ev) / steps
        out[f"{tag}_cpu_ms"] = sum(e.cpu_time_total for e in ev) / steps / 1e3
        out[f"{tag}_gpu_ms"] = sum(getattr(e, "device_time_total", 0.0) for e in ev) / steps / 1e3
    return out


def profile_steps(one: Callable[[], None], steps: int = 5) -> dict:
    """torch.profiler over `steps` more steps (after the timed loop): profile_breakdown of them."""
    from torch.autograd import DeviceType  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    torch.cuda.synchronize()
    getattr(one, "begin", lambda: None)()  # a step that runs with the launch memos off (_memo_off)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                one()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) / steps * 1e3
    finally:
        getattr(one, "end", lambda: None)()
    events = prof.events()
    return {**profile_breakdown(prof.key_averages(), device_work(events, DeviceType.CUDA), steps, wall_ms),
            "launchers": launchers(events, steps)}


#: CUDA runtime and driver API calls (cudaLaunchKernel, cuLaunchKernelEx, cudaStreamSynchronize...), not ops such as
#: cutlass_byoc::fprop_site or cudnn's
_CUDA_API = re.compile(r"cu(da)?[A-Z]")


def launchers(events, steps: int, top: int = 8) -> list:
    """Who launched the kernels that ran outside CUDA graphs: per step, the op around each kernel-launch call (its
    nearest enclosing host event that is not itself a CUDA runtime or driver call; a driver launch inside a runtime
    launch is one launch), the `top` most frequent as [launches per step, op name]. Under CUDA graphs these are the
    step's host work besides the replays (optimizer, GradScaler, ...)."""
    by: Counter = Counter()
    for e in events:
        if e.name not in KERNEL_LAUNCH_APIS:
            continue
        parent = getattr(e, "cpu_parent", None)
        if parent is not None and parent.name in KERNEL_LAUNCH_APIS:
            continue  # the driver call inside a runtime launch: one launch
        while parent is not None and _CUDA_API.match(parent.name):
            parent = getattr(parent, "cpu_parent", None)
        by[parent.name if parent is not None else "(no enclosing op)"] += 1
    return [[n / steps, name] for name, n in by.most_common(top)]


def device_work(events, cuda) -> list[tuple[float, float, str]]:
    """(start, end, name) of the profiled events that are GPU work (kernels, memcpys, memsets). Ranges the profiler
    draws on the GPU's timeline for a host annotation (``Optimizer.step#SGD.step``, a record_function) are left out:
    they are no work of their own, would count their kernels twice in the GPU time by source, and would fill the
    gaps between those kernels in the busy time."""
    events = list(events)
    # the GPU copy of a range is marked itself, and in any case named like its host range, which is marked
    annotations = {e.name for e in events if e.device_type != cuda and getattr(e, "is_user_annotation", False)}
    return [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == cuda and e.time_range.end > e.time_range.start
            and not getattr(e, "is_user_annotation", False) and e.name not in annotations]


def _timed_loop(fn: Callable[[], None], steps: int, warmup: int) -> float:
    getattr(fn, "begin", lambda: None)()
    try:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
    finally:
        getattr(fn, "end", lambda: None)()
    return start.elapsed_time(end) / steps


def run_case(case: Case, modes: Sequence[str] = MODES, image: int = 224, steps: int = 20, warmup: int = 3,
             dtype: torch.dtype = torch.float16, channels_last: bool = True, options: Optional[dict] = None,
             seed: int = 0, profile: bool = False, rounds: int = 1,
             optimizers: Sequence[str] = OPTIMIZERS[:1]) -> list[BenchRow]:
    """Every mode of one case, in this process, from the same weights on the same batch. Training: the first step
    (compile included) is compared with eager's; then SGD-with-momentum + GradScaler steps are timed, once per
    optimizer of `optimizers` (OPTIMIZERS: a row each, on the same compiled model, each with its own optimizer and
    GradScaler state, compared with Inductor's row of the same optimizer). With CUDA
    graphs (cudagraph trees) each step starts with ``torch.compiler.cudagraph_mark_step_begin()`` and gradients
    are set to None, so no replay reads another's outputs. Inference: ``torch.no_grad()`` forwards, outputs
    compared with eager's.

    rounds=1 times each mode's `steps` right after compiling it (Dynamo reset before each mode). rounds > 1 compiles
    every mode first and then times `rounds` rounds of `steps` steps, the modes in turn within each round (their
    order rotating), and reports the median round: a host-bound step drifts by more than the modes differ over the
    minutes one mode takes, and interleaving puts every mode under the same drift."""
    from . import library  # noqa: PLC0415

    for name in optimizers:
        if name not in OPTIMIZERS:
            raise ValueError(f"optimizers: expected names of {', '.join(OPTIMIZERS)}, got {name!r}")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    torch.manual_seed(seed)
    base = model_factory(case.model)().cuda().to(memory_format=fmt).train(case.training)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(case.batch, 3, image, image, device="cuda", generator=g).contiguous(memory_format=fmt)
    y = torch.randint(0, 1000, (case.batch,), device="cuda", generator=g)
    small = max(1, int(case.batch * DYNAMIC_FRACTION))  # the dynamic modes' smaller batch
    rows: list[BenchRow] = []
    steppers: list[Callable[[], None]] = []
    scales: list[tuple] = []  # each stepper's enabled GradScaler (None: inference, bf16) and its scale before timing
    ref = None
    interleave = rounds > 1
    if interleave:
        torch._dynamo.reset()
    for mode in sorted(modes, key=lambda m: m != "eager"):  # eager first: the reference of the errors
        if not interleave:
            torch._dynamo.reset()
        library.RUNTIME.clear()
        model = copy.deepcopy(base)
        run, backend = compile_mode(model, mode, options)
        graphs = mode.endswith("-cudagraphs")
        mark = torch.compiler.cudagraph_mark_step_begin if graphs else (lambda: None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if case.training:
            mark()
            loss = _step(run, x, y, None, dtype).detach().clone()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            grads = [p.grad.detach().clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            if mode.endswith("-dynamic"):  # a smaller batch: the recompile with a symbolic batch size
                _step(run, x[:small], y[:small], None, dtype)
                torch.cuda.synchronize()
                model.zero_grad(set_to_none=True)
            if ref is None:
                ref = (loss, grads)
            lerr, gerr, gmax = relative_errors(loss, grads, *ref)
            steps_of = {}  # optimizer name -> (step, its enabled GradScaler or None)
            for name in dict.fromkeys(optimizers):
                opt = make_optimizer(name, model.parameters())
                scaler = make_scaler(enabled=dtype == torch.float16)

                def one(run=run, mark=mark, opt=opt, scaler=scaler) -> None:
                    mark()
                    _step(run, x, y, opt, dtype, scaler)
                steps_of[name] = (one, scaler if scaler.is_enabled() else None)
            value = loss.item()
        else:
            def fwd(run=run, mark=mark):
                mark()
                with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
                    return run(x).float().clone()
            out = fwd()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            if mode.endswith("-dynamic"):  # a smaller batch: the recompile with a symbolic batch size
                with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
                    run(x[:small])
                torch.cuda.synchronize()
            if ref is None:
                ref = (out, None)
            lerr = _rel(out, ref[0])
            gerr = gmax = math.nan
            value = float(out.float().norm())

            def one(fwd=fwd) -> None:
                fwd()
            steps_of = {"": (one, None)}
        for opt_name, (one, scaler) in steps_of.items():
            if mode == "cutlass_byoc-memo-off":
                one = _memo_off(one)
            for _ in range(warmup):
                one()
            scale0 = scaler.get_scale() if scaler is not None else None  # after the warm-up steps (a sync)
            ms = math.nan  # interleaved: timed in the rounds below
            if not interleave:
                memo0 = launch_memo_counts()  # the timed steps' launches only
                ms = _timed_loop(one, steps, 0)
                memo1 = launch_memo_counts()
            row = BenchRow(case.model, mode, ms, first, value, lerr, gerr, gmax, batch=case.batch,
                           training=case.training, profile=profile_steps(one) if profile and not interleave else None,
                           optimizer=opt_name)
            if backend is not None:
                row.offload = backend.report().summary().splitlines()[0]
                row.fallbacks = len(library.RUNTIME.fallbacks)
                if not interleave:
                    row.launch_memo = (memo1[0] - memo0[0], memo1[1] - memo0[1])
            if scaler is not None and not interleave:
                row.skipped_updates = skipped_updates(scale0, scaler.get_scale())
            rows.append(row)
            steppers.append(one)
            scales.append((scaler, scale0))
            if not interleave:
                log.info("%s", row.line())
    if interleave:
        memo: dict[int, list[int]] = {}

        def time_one(one) -> float:  # the launch memo's counts over each mode's rounds (1 warm-up step each)
            before = launch_memo_counts()
            ms = _timed_loop(one, steps, 1)
            after = launch_memo_counts()
            tally = memo.setdefault(id(one), [0, 0])
            tally[0] += after[0] - before[0]
            tally[1] += after[1] - before[1]
            return ms

        times = interleaved_rounds(steppers, rounds, time_one)
        for row, one, ts, (scaler, scale0) in zip(rows, steppers, times, scales):
            row.rounds_ms = ts
            if row.mode.startswith("cutlass_byoc"):
                row.launch_memo = tuple(memo.get(id(one), (0, 0)))
            row.step_ms = statistics.median(ts)
            if profile:
                row.profile = profile_steps(one)
            if scaler is not None:
                row.skipped_updates = skipped_updates(scale0, scaler.get_scale())
            log.info("%s", row.line())
    modes_run = {q.mode for q in rows}
    for r in rows:
        same = ("inductor-cudagraphs" if r.mode.endswith("-cudagraphs") else "inductor-dynamic"
                if r.mode.endswith("-dynamic") and "inductor-dynamic" in modes_run else "inductor")
        ind = next((q.step_ms for q in rows if q.mode == same and q.optimizer == r.optimizer), math.nan)
        r.speedup_vs_inductor = ind / r.step_ms
    return rows


class _memo_off:
    """A step run with the launch memos off: switched off before the first step of a timed loop and on again after
    the loop (bench's timed loops call `begin` and `end` around their steps), so no step pays for the switch."""

    def __init__(self, step: Callable[[], None]):
        self.step = step

    def __call__(self) -> None:
        self.step()

    def begin(self) -> None:
        _launch_memos(False)

    def end(self) -> None:
        _launch_memos(True)


def interleaved_rounds(steppers: Sequence, rounds: int, time_one: Callable) -> list[list[float]]:
    """`rounds` rounds of `time_one(stepper)` for every stepper, in turn; round i starts at stepper i (mod n), so no
    stepper always runs first or right after the same one. Each stepper's times, in round order."""
    n = len(steppers)
    times: list[list[float]] = [[] for _ in range(n)]
    for i in range(rounds):
        for j in range(n):
            k = (i + j) % n
            times[k].append(time_one(steppers[k]))
    return times


def benchmark(models: Sequence[str] = ("resnet50", "mobilenet_v2"), batch: int = 64, image: int = 224,
              steps: int = 20, warmup: int = 3, dtype: torch.dtype = torch.float16, channels_last: bool = True,
              modes: Sequence[str] = MODES, options: Optional[dict] = None, seed: int = 0,
              print_table: bool = True, cases: Optional[Sequence[Case]] = None,
              profile: bool = False, rounds: int = 1, optimizers: Sequence[str] = OPTIMIZERS[:1]) -> list[BenchRow]:
    """Run the benchmark (`cases`, else training steps of `models` at `batch`); every mode of a case starts from
    the same weights and sees the same batches; training steps are timed with each of `optimizers`."""
    if not torch.cuda.is_available():
        raise RuntimeError("the offload benchmark needs a CUDA GPU")
    cases = list(cases) if cases is not None else [Case(m, batch) for m in models]
    torch.backends.cudnn.benchmark = True  # cuDNN's best algorithms for every mode (eager, Inductor, ours' rest)
    rows: list[BenchRow] = []
    for case in cases:
        case_rows = run_case(case, modes, image, steps, warmup, dtype, channels_last, options, seed, profile, rounds,
                             optimizers)
        rows += case_rows
        if print_table:
            print(format_table(case_rows, case, image, dtype, channels_last), flush=True)
    return rows


#: The host-overhead micro-benchmark's problem, (n, c, hw, k, r): tiny, so the GPU idles and wall time is host time.
HOST_OVERHEAD_SHAPE = (1, 16, 8, 16, 3)


def host_overhead_problems(shape: tuple[int, int, int, int, int] = HOST_OVERHEAD_SHAPE) -> dict:
    """The micro-benchmark's problem of each pass (ConvKind -> Conv2dProblem): fp16, stride 1, padding R // 2, as
    the compile-time partitioner builds it (scripts/warm_cache.py compiles their heuristic kernels beforehand)."""
    from .patterns import make_problem  # noqa: PLC0415
    from ..types import ConvKind  # noqa: PLC0415

    n, c, hw, k, r = shape
    return {kind: make_problem(kind, (n, c, hw, hw), (k, c, r, r), (1, 1), (r // 2, r // 2), (1, 1), 1, torch.half,
                               torch.half) for kind in ConvKind}


def host_overhead(calls: int = 3000, warmup: int = 200,
                  shape: tuple[int, int, int, int, int] = HOST_OVERHEAD_SHAPE) -> list[dict]:
    """Host microseconds per call on a tiny problem (the GPU finishes each kernel faster than the host issues the next,
    so wall time per call is host time): the call-site ops (what compiled graphs run: their C++ kernels when
    native.py could build them), the same ops' Python implementations, the general ops (every parameter an argument,
    all checks), and aten.convolution / aten.convolution_backward (cuDNN), fp16 channels_last."""
    from . import library, native  # noqa: PLC0415
    from ..types import ConvKind  # noqa: PLC0415

    n, c, hw, k, r = shape
    cl = torch.channels_last
    x = torch.randn(n, c, hw, hw, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    w = torch.randn(k, c, r, r, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    dy = torch.randn(n, k, hw, hw, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    st, pd, dl = [1, 1], [r // 2, r // 2], [1, 1]
    xs, ws = (n, c, hw, hw), (k, c, r, r)
    site = {kind: library.register_site(kind.value, p, "heuristic")
            for kind, p in host_overhead_problems(shape).items()}
    aten = torch.ops.aten
    py = {"fprop": lambda s: library.FPROP_PY(x, w, None, None, s), "dgrad": lambda s: library.DGRAD_PY(dy, w, s),
          "wgrad": lambda s: library.WGRAD_PY(dy, x, s)}
    cases = {
        "fprop": (lambda s: library.FPROP(x, w, None, None, s) if s >= 0 else
                  library.conv2d_fprop(x, w, None, None, st, pd, dl, 1, "identity", torch.half, "heuristic"),
                  lambda: aten.convolution.default(x, w, None, st, pd, dl, False, [0, 0], 1)),
        "dgrad": (lambda s: library.DGRAD(dy, w, s) if s >= 0 else
                  library.conv2d_dgrad(dy, w, list(xs), st, pd, dl, 1, torch.half, "heuristic"),
                  lambda: aten.convolution_backward.default(dy, x, w, None, st, pd, dl, False, [0, 0], 1,
                                                            [True, False, False])),
        "wgrad": (lambda s: library.WGRAD(dy, x, s) if s >= 0 else
                  library.conv2d_wgrad(dy, x, list(ws), st, pd, dl, 1, torch.half, "heuristic"),
                  lambda: aten.convolution_backward.default(dy, x, w, None, st, pd, dl, False, [0, 0], 1,
                                                            [False, True, False])),
    }

    def per_call(fn) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls * 1e6

    rows = []
    nat = native.loaded()
    site_path = "cutlass_byoc call site" + (" (C++)" if nat is not None else f" (Python: {native.why_not()})")
    for kind, (ours, theirs) in cases.items():
        s = site[ConvKind(kind)]
        rows.append({"pass": kind, "path": site_path, "us_per_call": per_call(lambda: ours(s))})
        if nat is not None:
            before = nat.calls(s)
            rows.append({"pass": kind, "path": "cutlass_byoc call site (Python)",
                         "us_per_call": per_call(lambda: py[kind](s))})
            assert nat.calls(s) == before, f"{kind}: the Python twin went through the C++ path"
            # the C++ call split: the fast path alone in a C++ loop (its checks, the output's and workspace's
            # allocations, the argument block, cb_run), and cb_run alone (the kernel library's launch: CUTLASS's
            # arguments, initialize, the launch); the rest of a call is the dispatcher and Python in front of it
            for path, what in (("call site: C++ fast path alone", nat.LAUNCH), ("call site: cb_run alone", nat.RUN)):
                rows.append({"pass": kind, "path": path,
                             "us_per_call": nat.time_site(s, x.device, calls, what)})
            # the same with the kernel libraries' launch memo off: every cb_run checks and prepares its launch
            # (CUTLASS's arguments and Params, the TMA descriptors), as before the memo
            memo = _launch_memos(False)
            if memo:
                rows.append({"pass": kind, "path": "cutlass_byoc call site (C++), launch memo off",
                             "us_per_call": per_call(lambda: ours(s))})
                rows.append({"pass": kind, "path": "call site: cb_run alone, launch memo off",
                             "us_per_call": nat.time_site(s, x.device, calls, nat.RUN)})
            _launch_memos(True)
        rows.append({"pass": kind, "path": "cutlass_byoc general path", "us_per_call": per_call(lambda: ours(-1))})
        rows.append({"pass": kind, "path": "aten (cuDNN)", "us_per_call": per_call(theirs)})
        assert library.site(s).launches > 0, f"{kind}: the call site never launched (it fell back to the general path)"
        if nat is not None:
            assert nat.calls(s) > 0, f"{kind}: the C++ path never launched"
    return rows


def _launch_memos(on: Optional[bool] = None) -> dict[str, "object"]:
    """The launch memo of every kernel library this process loaded that has one (name -> MemoState), each switched
    on or off first unless `on` is None."""
    from ..runtime import loaded_libraries  # noqa: PLC0415

    out = {}
    for lib in loaded_libraries():
        state = lib.launch_memo(on)
        if state is not None:
            out[lib.name] = state
    return out


def launch_memo_counts() -> tuple[int, int]:
    """(relaunches, full-path launches) summed over the loaded libraries' launch memos."""
    states = _launch_memos().values()
    return sum(m.relaunches for m in states), sum(m.full for m in states)


def format_table(rows: Sequence[BenchRow], case: Case, image: int, dtype: torch.dtype, channels_last: bool) -> str:
    what = "training step" if case.training else "inference forward (loss err: output, grad errs: n/a)"
    lines = [f"{case.model} {what}, batch {case.batch}, {image}x{image}, autocast {dtype}, "
             f"{'channels_last' if channels_last else 'NCHW'}, {torch.cuda.get_device_name()}; vs ind.: Inductor's "
             "time in the same mode (with or without CUDA graphs) over this row's", HEADER]
    lines += [r.line() for r in rows]
    for r in rows:
        if r.offload:
            lines.append(f"{r.model}: {r.offload}; {r.fallbacks} run-time fallbacks")
        if r.launch_memo:
            lines.append(f"{r.model} {r.label}: launch memo over the timed steps: {r.launch_memo[0]} relaunches, "
                         f"{r.launch_memo[1]} full-path launches (prepared anew)")
    for r in rows:
        if r.profile:
            q = r.profile
            lines.append(f"profile {r.model} {r.label}: {q['wall_ms']:.2f} ms per step, GPU kernels "
                         f"{q['gpu_kernel_ms']:.2f} ms ({q.get('kernels', 0):.0f} kernels, busy "
                         f"{q.get('busy_ms', 0):.2f} ms, launch gaps {q.get('launch_gap_ms', 0):.2f} ms, host gaps "
                         f"{q.get('host_gap_ms', 0):.2f} ms in {q.get('host_gaps', 0):.0f}; longest "
                         f"{q.get('longest_gaps', [])}); {q.get('graph_launches', 0):.0f} graph replays and "
                         f"{q.get('kernel_launches', 0):.0f} kernel launches outside graphs per step; offloaded "
                         f"convs {q['offloaded_calls']:.0f} calls, GPU "
                         f"{q['offloaded_gpu_ms']:.2f} ms, host {q['offloaded_cpu_ms']:.2f} ms; aten convs "
                         f"{q['aten_conv_calls']:.0f} calls, GPU {q['aten_conv_gpu_ms']:.2f} ms, host "
                         f"{q['aten_conv_cpu_ms']:.2f} ms")
            if q.get("launchers"):
                lines.append(f"  {r.label} launches outside graphs per step by op: "
                             + ", ".join(f"{name} {n:g}" for n, name in q["launchers"]))
            src = q.get("gpu_ms_by_source")
            if src:
                lines.append(f"  {r.label} GPU ms per step by source: "
                             + ", ".join(f"{k} {v:.3f}" for k, v in src.items()))
            roles = q.get("triton_ms_by_role")
            if roles:
                lines.append(f"  {r.label} Triton GPU ms per step by role: "
                             + ", ".join(f"{k} {v:.3f}" for k, v in roles.items()))
            for ms, n, name in q.get("top_kernels", []):
                lines.append(f"  {r.label} GPU ms per step {ms:7.3f} in {n:5.1f} launches: {name}")
            for tag in ("cudnn/cublas", "aten", "other"):  # whole names, each of these sources' kernels
                for ms, n, name in q.get("kernels_by_source", {}).get(tag, []):
                    lines.append(f"  {r.label} {tag} GPU ms per step {ms:7.3f} in {n:5.1f} launches: "
                                 f"{short_kernel_name(name)[:240]}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", type=Case.parse, default=None, metavar="MODEL:BATCH[:inference]",
                    help="e.g. resnet50:32 mobilenet_v2:64 resnet50:1:inference (default: the issue's six cases, "
                         "or --models at --batch)")
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--steps", type=int, default=20, help="timed steps (per round with --rounds)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="N > 1: compile every mode of a case first, then time N rounds of --steps steps with the "
                         "modes interleaved; step ms is each mode's median round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--nchw", action="store_true", help="NCHW model and input (default channels_last)")
    ap.add_argument("--select", choices=["heuristic", "cached", "tune"], default="cached")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES + EXTRA_MODES))
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS[:1]), choices=list(OPTIMIZERS),
                    help="time the training steps with each of these (a row per mode and optimizer; sgd-fused: "
                         "SGD with fused=True, whose GradScaler step does not wait for the GPU)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows (model, batch, training, mode, step_ms, ...)")
    ap.add_argument("--host-overhead", action="store_true", help="also measure host microseconds per call")
    ap.add_argument("--profile", action="store_true",
                    help="after each mode's timing, profile 5 steps: GPU kernel time, the conv ops' host and GPU time")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cases = a.cases if a.cases else ([Case(m, a.batch) for m in a.models] if a.models else list(DEFAULT_CASES))
    rows = benchmark(steps=a.steps, warmup=a.warmup, image=a.image, dtype=getattr(torch, a.dtype),
                     channels_last=not a.nchw, modes=a.modes, options={"select": a.select}, cases=cases,
                     profile=a.profile, rounds=a.rounds, optimizers=a.optimizers)
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "cudnn": torch.backends.cudnn.version(), "image": a.image, "steps": a.steps, "rounds": a.rounds,
                 "dtype": a.dtype,
                 "rows": [r.record() for r in rows]}
    if a.host_overhead:
        out["host_overhead"] = host_overhead()
        for r in out["host_overhead"]:
            print(f"host overhead {r['pass']:6s} {r['path']:28s} {r['us_per_call']:8.2f} us/call")
    if a.json:
        import json  # noqa: PLC0415

        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
