"""Choose the launch for a problem: the profiler's recorded decision if there is one, else the model's default."""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Optional

from .config import KernelConfig, LaunchConfig
from .cache import cache_root_path
from .decisions import generation, lookup_decision
from .gemm1x1 import deterministic_required
from .heuristics import default_launch
from .problem import ALIGNMENTS, Conv2dProblem
from .types import DType, KernelFamily, SourceKind

log = logging.getLogger("cutlass_byoc.select")


class SelectMode(str, enum.Enum):
    HEURISTIC = "heuristic"  # the analytic model's pick; never profiles
    CACHED = "cached"  # a recorded decision if one exists, else the model's pick
    TUNE = "tune"  # profile now if no decision is recorded (needs a GPU)


_chosen: dict[tuple, Optional[LaunchConfig]] = {}


def choose(problem: Conv2dProblem, mode: SelectMode | str = SelectMode.CACHED) -> Optional[LaunchConfig]:
    """The launch to use for `problem`, or None when no kernel of this project can compute it.

    Remembered per (problem, mode, cache root, whether deterministic algorithms are requested) until a decision is
    written or cleared in this process: choosing ranks every candidate and hashes the decision key, far too slow
    for each call of a training step. The offload's call sites bind their launch at their first call: setting the
    flag later does not change a site that has run."""
    mode = SelectMode(mode)
    deterministic = deterministic_required()
    key = (problem, mode, cache_root_path(), generation(), deterministic)
    if key not in _chosen:
        _chosen[key] = honour_determinism(_choose(problem, mode), deterministic)
    return _chosen[key]


def honour_determinism(launch: Optional[LaunchConfig], deterministic: bool) -> Optional[LaunchConfig]:
    """`launch`, or under ``torch.use_deterministic_algorithms(True)`` (`deterministic`) its deterministic twin where
    its kernel adds partial sums in arrival order (the GEMM family's nondeterministic stream-K reduction, the sm90
    family's atomic split-k wgrad; a decision recorded without the flag may hold one): the same tile, cluster and
    slices, the partials added in k order."""
    if launch is None or not deterministic:
        return launch
    if launch.kernel.family is KernelFamily.SM90_GEMM_1X1:
        from .gemm1x1 import deterministic_twin  # noqa: PLC0415
        how = "stream-K partials added in k order"
    elif launch.kernel.family is KernelFamily.SM90_TMA_WGMMA:
        from .sm90 import deterministic_twin  # noqa: PLC0415
        how = "split-k partials per slice, summed in slice order"
    else:
        return launch
    twin = deterministic_twin(launch.kernel)
    if twin == launch.kernel:
        return launch
    log.info("deterministic algorithms requested: %s runs as %s (%s)", launch.kernel.name, twin.name, how)
    return dataclasses.replace(launch, kernel=twin)


def _choose(problem: Conv2dProblem, mode: SelectMode) -> Optional[LaunchConfig]:
    if mode is not SelectMode.HEURISTIC:
        hit = lookup_decision(problem)
        if hit is not None:
            return hit
        if mode is SelectMode.TUNE:
            # Imported here: the profiler imports ops (through its worker), which imports this module.
            from .profiler.coordinate import coordinated_tune, worker_settings  # noqa: PLC0415
            from .profiler.tune import tune_problem  # noqa: PLC0415

            # once per problem across the processes sharing the cache (DDP ranks): one tunes, the others wait
            co = coordinated_tune([problem], lambda ps: tune_problem(ps[0], settings=worker_settings()))
            hit = lookup_decision(problem)
            if hit is not None:
                return hit
            log.info("no tuned launch for %s (%s); using the model's default", problem.name,
                     co.fell_back.get(problem, "tuning found no winner"))
    return default_launch(problem)


_cudnn_memo: dict[tuple, Optional[str]] = {}
#: how cudnn_faster's reasons begin (the offload report counts them)
CUDNN_FASTER = "cuDNN is faster"
#: how host_credit_note's notes begin (the offload report counts them)
HOST_CREDIT = "offloaded on the host credit"


def keeps_cudnn(cudnn_us: float, time_us: float, host_credit_us: float = 0.0) -> bool:
    """prefer_cudnn's rule: a conv stays with cuDNN where cuDNN's time plus the host credit is at most the tuned
    kernel's."""
    return cudnn_us + host_credit_us <= time_us


def decision_times(dec) -> Optional[tuple[float, float]]:
    """(our kernel's us, cuDNN's us) that decide between them for a recorded decision: the in-step times where the
    decision has both (measured inside a model's step, Decision.in_step), else the tune's; None without a cuDNN time."""
    if dec is None:
        return None
    if dec.in_step:
        return dec.step_us, dec.step_cudnn_us
    return (dec.time_us, dec.cudnn_us) if dec.cudnn_us is not None else None


def cudnn_faster(problem: Conv2dProblem, host_credit_us: float = 0.0) -> Optional[str]:
    """Why the backend should leave `problem` to PyTorch (cuDNN): its recorded decision measured cuDNN faster than the
    tuned winner (`decision_times`: inside a model's step where it was measured there, else both timed by the profiler
    on the same operands) by more than `host_credit_us`, the host time an
    offloaded call saves over aten's convolution where the step is launched op by op (OffloadOptions.host_credit_us;
    0 under CUDA graphs, where host time is gone). None when there is no decision, no cuDNN time in it, or the kernel
    is faster after the credit. Remembered like `choose`."""
    key = (problem, float(host_credit_us), cache_root_path(), generation())
    if key not in _cudnn_memo:
        from .decisions import lookup  # noqa: PLC0415

        dec = lookup(problem)
        why = None
        times = decision_times(dec)
        if times is not None and keeps_cudnn(times[1], times[0], host_credit_us):
            credit = f" + {host_credit_us:.1f} us host credit" if host_credit_us else ""
            where = f"in the step of {dec.step_model}" if dec.in_step else "decision cache"
            why = (f"{CUDNN_FASTER}: {times[1]:.1f} us{credit} vs {times[0]:.1f} us for the tuned "
                   f"{dec.launch.name} ({where}; prefer_cudnn=False offloads it anyway)")
        _cudnn_memo[key] = why
    return _cudnn_memo[key]


def host_credit_note(problem: Conv2dProblem, host_credit_us: float) -> Optional[str]:
    """For an offloaded problem: a note saying it was offloaded on the host credit (cuDNN measured faster, by no more
    than the credit), with both times; None otherwise."""
    if host_credit_us <= 0 or cudnn_faster(problem) is None or cudnn_faster(problem, host_credit_us) is not None:
        return None
    from .decisions import lookup  # noqa: PLC0415

    ours, cudnn = decision_times(lookup(problem))
    return (f"{HOST_CREDIT}: cuDNN measured {cudnn:.1f} us vs {ours:.1f} us, within the "
            f"{host_credit_us:.1f} us an offloaded call saves in host time")


# ---------------------------------------------------------------------------------------------- offset views
Caps = tuple[int, int, int]


def _address_alignment(extent: int, dtype: DType, address: int) -> int:
    """The widest of 8/4/2/1 elements of `dtype` that divides `extent` and whose byte size divides `address` (no
    128-bit limit: a kernel's alignment counts elements of several operands, e.g. 8 fp32 bias values under an fp16
    output)."""
    for a in ALIGNMENTS:
        if extent % a == 0 and address % (a * dtype.nbytes) == 0:
            return a
    return 1


def address_alignments(problem: Conv2dProblem, a: int, b: int, d: int, source: int = 0, bias: int = 0) -> Caps:
    """The widest alignment (elements) each of A, B and the output side allows at these addresses. The output side
    is the output, the residual and the bias: a kernel's align_c applies to each of them (a bias counted in its
    own type). `source` is the bias for SourceKind.BIAS, the residual otherwise; null addresses are left out (a
    missing operand is reported by the pointer checks, not here)."""
    ca, cb, cc = problem.channel_dims
    src = problem.epilogue.source
    out = [(d, problem.element_out)]
    if src is SourceKind.BIAS:
        out.append((source, problem.element_bias))
    elif src.has_residual:
        out.append((source, problem.element_out))
    if src is SourceKind.BIAS_RESIDUAL:
        out.append((bias, problem.element_bias))
    cap_c = min(_address_alignment(cc, dt, p) for p, dt in out if p) if any(p for p, _ in out) else ALIGNMENTS[0]
    return (_address_alignment(ca, problem.element_a, a) if a else ALIGNMENTS[0],
            _address_alignment(cb, problem.element_b, b) if b else ALIGNMENTS[0], cap_c)


def accepts_alignments(kernel: KernelConfig, caps: Caps) -> bool:
    """Whether `kernel`'s alignments are within what the addresses allow."""
    return kernel.align_a <= caps[0] and kernel.align_b <= caps[1] and kernel.align_c <= caps[2]


_rechosen: dict[tuple, Optional[LaunchConfig]] = {}


def choose_for_alignments(problem: Conv2dProblem, caps: Caps, launch: Optional[LaunchConfig] = None, *,
                          explicit: bool = False) -> Optional[LaunchConfig]:
    """The launch for `problem` when its operands' addresses allow only the alignments `caps` (views with a storage
    offset), always a config that accepts the problem, or None if none does.

    The tuned choice first: the recorded decision for the problem (or the caller's own `launch`, if `explicit`) with
    its alignments lowered (``KernelConfig.with_alignments``: same tile, warps and iterator where they still
    apply), if that config is valid and accepts the problem. Lowering can break a config's own rules (a few-channels
    or fixed-channels iterator tied to its alignment, a strided dgrad under 4-byte accesses, a TMA kernel), so
    otherwise the model's best among the 2.x candidates generated within `caps`. Remembered per (problem, caps,
    launch) like :func:`choose`."""
    deterministic = deterministic_required()
    key = (problem, caps, launch, explicit, cache_root_path(), generation(), deterministic)
    if key not in _rechosen:
        _rechosen[key] = _choose_for_alignments(problem, caps, launch, explicit, deterministic)
    return _rechosen[key]


def _choose_for_alignments(problem: Conv2dProblem, caps: Caps, launch: Optional[LaunchConfig],
                           explicit: bool, deterministic: bool) -> Optional[LaunchConfig]:
    from .candidates import sm80_candidates  # noqa: PLC0415
    from .heuristics import rank  # noqa: PLC0415

    tuned = launch if explicit else honour_determinism(lookup_decision(problem), deterministic)
    if tuned is None and problem.is_depthwise:  # only the depthwise family takes it: narrow the model's pick
        from .heuristics import default_launch  # noqa: PLC0415

        tuned = default_launch(problem)
    if tuned is not None:
        k = tuned.kernel
        try:
            narrowed = LaunchConfig(k.with_alignments(min(k.align_a, caps[0]), min(k.align_b, caps[1]),
                                                      min(k.align_c, caps[2])), tuned.split_k_slices)
        except ValueError:
            narrowed = None
        if narrowed is not None and accepts_alignments(narrowed.kernel, caps) and \
                narrowed.reject_reason(problem) is None:
            return narrowed
    ranked = [lc for _, lc in rank(problem, sm80_candidates(problem, max_align=caps))
              if accepts_alignments(lc.kernel, caps)]
    return ranked[0] if ranked else None


def alignment_refusal(problem: Conv2dProblem, caps: Caps, a: int, b: int, d: int, source: int = 0,
                      bias: int = 0) -> str:
    """The error when no config takes operands at these addresses: names each operand whose address lowers its
    alignment below what its channel extent allows, with the address and the alignment it allows."""
    ca, cb, cc = problem.channel_dims
    src = problem.epilogue.source
    ops = [("A", a, ca, problem.element_a), ("B", b, cb, problem.element_b), ("output", d, cc, problem.element_out)]
    if src is SourceKind.BIAS:
        ops.append(("bias", source, cc, problem.element_bias))
    elif src.has_residual:
        ops.append(("residual", source, cc, problem.element_out))
    if src is SourceKind.BIAS_RESIDUAL:
        ops.append(("bias", bias, cc, problem.element_bias))
    named = []
    for name, ptr, extent, dt in ops:
        if not ptr:
            continue
        got, full = _address_alignment(extent, dt, ptr), _address_alignment(extent, dt, 0)
        if got < full:
            named.append(f"{name} at address {ptr:#x} allows alignment {got} ({got * dt.nbytes} bytes of "
                         f"{dt.value}; its {extent} channels would allow {min(full, 16 // dt.nbytes)})")
    what = "; ".join(named) or f"alignments {caps}"
    return f"alignment: no kernel computes {problem.name} on these operands: {what}"
