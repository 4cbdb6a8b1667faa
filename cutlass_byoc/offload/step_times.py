"""Each offloaded conv pass's GPU time inside a model's compiled step, on its tuned kernel and on cuDNN.

The tune times every problem alone, its operands rotated through more memory than L2 holds, so that no run finds
them cached. Inside a step the input of a conv was usually written just before by the kernel ahead of it, and other
kernels share the GPU's caches around it; cuDNN's kernels and ours need not gain alike from that. This measures both
where they run: the model compiled once with the backend, every conv offloaded (``prefer_cudnn=False``, each call
site bound to its problem's decision), its steps profiled in rounds that alternate

- on the kernels, and
- on cuDNN: the same call sites with the kernels switched off (``library.set_use_kernels(False)``) and their PyTorch
  fallback replaced, for the measurement only, by aten's convolution in the 16-bit input type and the cast to the
  output type: what PyTorch runs for the conv, as the tune's cuDNN baseline times it (``profiler.verify.cudnn_fn``).

A call's GPU time is its op's ``device_time_total`` (every kernel it launched); a problem's time is the mean over the
calls of all its sites. No CUDA graphs (the profiler must see the ops), which changes the host's pace, not the
kernels' work. `record` writes the times into the decisions (Decision.step_us, step_cudnn_us), where they then decide
whether the backend leaves a problem to cuDNN (select.cudnn_faster). Used by ``cutlass-byoc tune --model ...
--in-step``.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..select import keeps_cudnn

log = logging.getLogger("cutlass_byoc.offload")

#: the call-site ops (as the profiler names them) and the position of their `site` argument
SITE_ARG = {"cutlass_byoc::fprop_site": 4, "cutlass_byoc::dgrad_site": 2, "cutlass_byoc::wgrad_site": 2,
            "cutlass_byoc::wgrad_site_async": 2}
SIDES = ("ours", "cudnn")


@dataclasses.dataclass(frozen=True)
class PassTime:
    """One call site's in-step GPU time per call (median over the profiled calls) on each side."""

    site: int
    kind: str
    problem: object  # Conv2dProblem
    launch: Optional[str]  # the launch the site ran (ran_launch; None: not known)
    calls_per_step: float
    ours_us: float
    cudnn_us: float

    def to_dict(self) -> dict:
        return {"site": self.site, "kind": self.kind, "problem": self.problem.name, "launch": self.launch,
                "calls_per_step": self.calls_per_step, "ours_us": round(self.ours_us, 3),
                "cudnn_us": round(self.cudnn_us, 3)}


@dataclasses.dataclass(frozen=True)
class ProblemTime:
    """A problem's in-step time per call over all its sites (the calls' mean), on each side."""

    problem: object
    launch: Optional[str]
    calls_per_step: float
    ours_us: float
    cudnn_us: float


def site_times(events: Iterable) -> dict[int, list[float]]:
    """Per call site: the GPU microseconds of each of its calls, from profiler events (a call-site op's `site`
    argument is a recorded concrete input; record_shapes=True)."""
    acc: dict[int, list[float]] = {}
    for e in events:
        pos = SITE_ARG.get(e.name)
        if pos is None:
            continue
        inputs = getattr(e, "concrete_inputs", None) or []
        site = inputs[pos] if len(inputs) > pos else None
        if isinstance(site, int) and not isinstance(site, bool):
            acc.setdefault(site, []).append(float(getattr(e, "device_time_total", 0.0)))
    return acc


def per_problem(passes: Sequence[PassTime]) -> list[ProblemTime]:
    """The passes grouped by problem, in first-site order: calls-weighted mean per call of each side. A problem whose
    sites ran different launches (or none) gets launch None: its times are no one kernel's."""
    groups: dict[object, list[PassTime]] = {}
    for p in passes:
        groups.setdefault(p.problem, []).append(p)
    out = []
    for prob, ps in groups.items():
        n = sum(p.calls_per_step for p in ps)
        if n <= 0:
            continue
        launches = {p.launch for p in ps}
        out.append(ProblemTime(prob, launches.pop() if len(launches) == 1 else None, n,
                               sum(p.ours_us * p.calls_per_step for p in ps) / n,
                               sum(p.cudnn_us * p.calls_per_step for p in ps) / n))
    return out


def cudnn_by_tune(p: ProblemTime, tune_times: Callable[[object], Optional[tuple[float, float]]]) -> bool:
    """Whether the tune's times (`tune_times(problem)` -> (ours us, cuDNN us), or None: ours) leave the problem to
    cuDNN under CUDA graphs (select.keeps_cudnn, no host credit)."""
    t = tune_times(p.problem)
    return t is not None and keeps_cudnn(t[1], t[0])


def cudnn_in_step(p: ProblemTime) -> bool:
    """Whether the in-step times leave the problem to cuDNN under CUDA graphs (the same rule)."""
    return keeps_cudnn(p.cudnn_us, p.ours_us)


def step_sums(problems: Sequence[ProblemTime], tune_times: Callable[[object], Optional[tuple[float, float]]]) -> dict:
    """GPU ms per step of the measured passes: all on ours, all on cuDNN, the choice the tune's times make (the faster
    per problem as the tune timed it alone, `cudnn_by_tune`) and the choice the in-step times make (`cudnn_in_step`)."""
    def ms(pick: Callable[[ProblemTime], float]) -> float:
        return round(sum(pick(p) * p.calls_per_step for p in problems) / 1e3, 4)

    return {"all_ours": ms(lambda p: p.ours_us), "all_cudnn": ms(lambda p: p.cudnn_us),
            "tune_choice": ms(lambda p: p.cudnn_us if cudnn_by_tune(p, tune_times) else p.ours_us),
            "in_step_choice": ms(lambda p: p.cudnn_us if cudnn_in_step(p) else p.ours_us),
            "problems": len(problems), "cudnn_by_tune": sum(1 for p in problems if cudnn_by_tune(p, tune_times)),
            "cudnn_in_step": sum(1 for p in problems if cudnn_in_step(p))}


def cudnn_fallbacks() -> dict[str, Callable]:
    """Stand-ins for library.reference_fprop / reference_dgrad / reference_wgrad running what PyTorch runs for the conv
    (aten's convolution in the 16-bit input type, cuDNN; then the cast to the output type), instead of the fp32
    reference."""
    from . import library  # noqa: PLC0415

    CL = torch.channels_last
    bwd = torch.ops.aten.convolution_backward

    def fprop(input, weight, bias, residual, stride, padding, dilation, groups, activation, out_dtype):
        y = F.conv2d(input, weight.to(input.dtype), bias.to(input.dtype) if bias is not None else None, list(stride),
                     list(padding), list(dilation), groups)
        y = y.to(out_dtype or input.dtype)
        if residual is not None:
            y = y + residual
        return library.apply_activation(y, activation).contiguous(memory_format=CL)

    def dgrad(grad_output, weight, input_size, stride, padding, dilation, groups, out_dtype):
        shape = torch.empty(list(input_size), dtype=grad_output.dtype, device=grad_output.device, memory_format=CL)
        g = bwd(grad_output, shape, weight.to(grad_output.dtype), None, list(stride), list(padding), list(dilation),
                False, [0, 0], groups, [True, False, False])[0]
        return g.to(out_dtype or grad_output.dtype).contiguous(memory_format=CL)

    def wgrad(grad_output, input, weight_size, stride, padding, dilation, groups, out_dtype):
        shape = torch.empty(list(weight_size), dtype=grad_output.dtype, device=grad_output.device, memory_format=CL)
        g = bwd(grad_output, input.to(grad_output.dtype), shape, None, list(stride), list(padding), list(dilation),
                False, [0, 0], groups, [False, True, False])[1]
        return g.to(out_dtype or grad_output.dtype).contiguous(memory_format=CL)

    return {"reference_fprop": fprop, "reference_dgrad": dgrad, "reference_wgrad": wgrad}


class _Sides:
    """Switches the call sites between the kernels and cuDNN (and back to the kernels on exit)."""

    def __init__(self) -> None:
        from . import library  # noqa: PLC0415

        self.library = library
        self.kernels = {k: getattr(library, k) for k in ("reference_fprop", "reference_dgrad", "reference_wgrad")}
        self.cudnn = cudnn_fallbacks()

    def __call__(self, side: str) -> None:
        on = side == "ours"
        self.library.set_use_kernels(on)
        for k, fn in (self.kernels if on else self.cudnn).items():
            setattr(self.library, k, fn)

    def __enter__(self) -> "_Sides":
        return self

    def __exit__(self, *exc) -> None:
        self("ours")


def measure(model: torch.nn.Module, batch: int, *, training: bool = True, autocast: Optional[torch.dtype] =
            torch.float16, image: int = 224, in_channels: int = 3, steps: int = 3, rounds: int = 3,
            options: Optional[dict] = None, seed: int = 0) -> tuple[list[PassTime], str]:
    """Every offloaded pass of `model`'s step (training: forward, a loss, backward and a fused SGD update under a
    GradScaler; inference: a no-grad forward) timed inside the step on its kernel and on cuDNN, `rounds` rounds of
    `steps` profiled steps per side, the sides alternating. The passes in site order and the partition report's first
    line. The loss is the mean square of the outputs (`_loss`), so any model's output serves; the convs' problems do
    not depend on it."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    from . import bench, library  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise RuntimeError("the in-step measurement needs a CUDA GPU")
    torch.backends.cudnn.benchmark = True  # cuDNN's best algorithms, as in the tune's baseline and a user's step
    fmt = torch.channels_last
    torch.manual_seed(seed)
    model = model.cuda().to(memory_format=fmt).train(training)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, in_channels, image, image, device="cuda", generator=g).contiguous(memory_format=fmt)
    opts = {**(options or {}), "select": "cached", "prefer_cudnn": False, "cudagraphs": False}
    library.RUNTIME.clear()  # its fallbacks then are this model's (ran_launch)
    run, backend = bench.compile_mode(model, "cutlass_byoc", opts)
    amp = autocast is not None
    dtype = autocast or torch.float16
    if training:
        opt = bench.make_optimizer("sgd-fused", model.parameters())
        scaler = bench.make_scaler(enabled=dtype == torch.float16 and amp)

        def step() -> None:
            with torch.autocast("cuda", dtype=dtype, enabled=amp):
                out = run(x)
            scaler.scale(_loss(out)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    else:
        def step() -> None:
            with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=amp):
                run(x)

    times: dict[str, dict[int, list[float]]] = {s: {} for s in SIDES}
    with _Sides() as side:
        for s in ("ours", "cudnn", "ours"):  # compile, then each side's first calls (cudnn.benchmark's search)
            side(s)
            for _ in range(3):
                step()
        torch.cuda.synchronize()
        for r in range(rounds):
            for s in (SIDES if r % 2 == 0 else SIDES[::-1]):
                side(s)
                step()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                    for _ in range(steps):
                        step()
                    torch.cuda.synchronize()
                for site, ts in site_times(prof.events()).items():
                    times[s].setdefault(site, []).extend(ts)
    n = rounds * steps
    passes = []
    fell_back = bool(library.RUNTIME.fallbacks)
    for site in sorted(set(times["ours"]) & set(times["cudnn"])):
        cs = library.site(site)
        launch = ran_launch(cs, fell_back)
        passes.append(PassTime(site, cs.kind, cs.problem, launch.name if launch is not None else None,
                               len(times["ours"][site]) / n,
                               statistics.median(times["ours"][site]), statistics.median(times["cudnn"][site])))
    return passes, backend.report().summary().splitlines()[0]


def ran_launch(site, fell_back: bool):
    """The launch a call site ran on the kernels' side: its binding's; for a site on the general path (a launch the
    C++ and Python call sites cannot bind: channel-padded or space-to-depth), the one the general path chooses for
    its problem, unless some call fell back to PyTorch (`fell_back`: then no site's kernel is certain); None for a site
    never bound."""
    st = site.state
    if st:
        return getattr(st, "launch", None)
    if st is False and not fell_back:
        from ..select import choose  # noqa: PLC0415

        return choose(site.problem, site.select)
    return None


def _loss(out) -> torch.Tensor:
    """A scalar from any model output (a tensor, or a tuple, list or dict of them): the mean square of each tensor,
    summed, in fp32."""
    if isinstance(out, torch.Tensor):
        return out.float().square().mean()
    parts = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    losses = [_loss(o) for o in parts if isinstance(o, (torch.Tensor, tuple, list, dict))]
    if not losses:
        raise TypeError(f"the in-step measurement needs a model whose output holds tensors, got {type(out).__name__}")
    return torch.stack(losses).sum()


def record(problems: Sequence[ProblemTime], model: str) -> tuple[int, list[str]]:
    """Write each problem's in-step times into its decision (decisions.record_step_times). The count written and why
    each other problem was not."""
    from ..decisions import record_step_times  # noqa: PLC0415

    written, skipped = 0, []
    for p in problems:
        if p.launch is None:
            skipped.append(f"{p.problem.name}: its sites ran different launches, or one not known")
        elif p.ours_us <= 0 or p.cudnn_us <= 0:
            skipped.append(f"{p.problem.name}: no GPU time recorded ({p.ours_us:.2f} / {p.cudnn_us:.2f} us)")
        elif record_step_times(p.problem, p.launch, p.ours_us, p.cudnn_us, model) is None:
            skipped.append(f"{p.problem.name}: no decision for {p.launch}")
        else:
            written += 1
    return written, skipped


def table(problems: Sequence[ProblemTime], names: dict, tune_times: Callable) -> list[str]:
    """One line per problem: layer name, kind, calls per step, in-step us of both and their ratio, the tune's."""
    lines = [f"{'layer':<14} {'kind':<5} {'calls':>5} {'step ours':>9} {'cuDNN':>8} {'ratio':>6} {'tune ours':>9} "
             f"{'cuDNN':>8} {'ratio':>6}  in-step choice"]
    for p in problems:
        t = tune_times(p.problem)
        tr = f"{t[1] / t[0]:6.3f}" if t else "     -"
        tt = f"{t[0]:9.2f} {t[1]:8.2f}" if t else f"{'-':>9} {'-':>8}"
        step, tune = cudnn_in_step(p), cudnn_by_tune(p, tune_times)
        pick = "cuDNN" if step else "ours"
        flip = f" (tune: {'cuDNN' if tune else 'ours'})" if t and tune != step else ""
        lines.append(f"{names.get(p.problem, p.problem.name)[:14]:<14} {p.problem.kind.value:<5} "
                     f"{p.calls_per_step:5.0f} {p.ours_us:9.2f} {p.cudnn_us:8.2f} {p.cudnn_us / p.ours_us:6.3f} "
                     f"{tt} {tr}  {pick}{flip}")
    return lines
