"""Plan what to compile and time: every valid config per problem, pruned before compiling, ranked by the cheap
model (`heuristics.estimate_us`), cut to a budget of kernels per problem, deduplicated across problems.

Kernel families:

- CUTLASS 2.x implicit GEMM (`candidates.sm80_candidates`): always.
- direct depthwise kernels (`cutlass_byoc.depthwise.depthwise_candidates`): always; they yield configs only for
  depthwise problems (groups == C == K), which no other family takes.
- CUTLASS 3.x TMA + wgmma (`cutlass_byoc.sm90.sm90_candidates`): an optional module written separately; it is
  imported inside ``try/except ImportError`` (the only optional import of the planner), and its configs join
  when the module exists. The analytic model only knows mma.sync ceilings, so each family gets its own share
  of the budget instead of competing on estimates the model cannot make for it.
- 1x1 stride-1 convs as CUTLASS 3.x GEMMs (`cutlass_byoc.gemm1x1.gemm1x1_candidates`): joins the same way; it
  yields configs for 1x1 stride-1 unpadded problems only. Its stream-K kernels also take split-k slice counts.
- the shared-memory im2col kernels (`cutlass_byoc.smem_im2col.smem_im2col_candidates`): fprop and wgrad of few input
  channels (the RGB stem) and stride-1 dgrad of few dy channels only, timed on a budget of their own
  (SMEM_IM2COL_BUDGET) like the depthwise side budgets: the model cannot rank its gathered reduction against the
  implicit-GEMM kernels'. (Their prefetch twins, timed beside each on the H100, never won: none is planned.) Each
  kernel the budget takes is timed beside its pairs twin (`smem_im2col.pairs_twin`: paired shared-memory loads) where
  the problem takes one.

Split-k slice counts are launch parameters, not kernels: a kernel enters the plan once and is timed with the
few slice counts the model ranks best for each problem (`heuristics.launch_slices`: 2.x kernels, and the sm90
split-k wgrad kernels of the project's own).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable, Iterator, Optional, Sequence

from ..candidates import channel_pad_options, rewrite_options, sm80_candidates
from ..config import KernelConfig, LaunchConfig, padding_reject_reason, round_up
from ..depthwise import depthwise_candidates, is_cluster_split, is_cols, is_pipelined, is_wide_strip
from ..generators import generator_module
from ..smem_im2col import smem_im2col_candidates
from ..heuristics import H200_SMS, calibration, estimate_us, launch_slices, order_key, rewritten_us
from ..problem import Conv2dProblem
from ..types import ConvKind, KernelFamily, SplitKMode

log = logging.getLogger("cutlass_byoc.profiler.plan")

DEFAULT_MAX_CANDIDATES = 8  # kernels per problem
#: A depthwise problem times this many times `max_candidates` kernels: they run in microseconds, and the model ranks
#: their schedules (pixel tiles through L1 or shared memory, "rows", "taprows") and vector widths poorly against each
#: other (on the H200 the budget of 8 left a 1.4x faster "taprows" kernel of a strided wgrad untimed); and every
#: config comes with its register-capped twin (depthwise.min_blocks_variant), timed right after it.
DEPTHWISE_BUDGET_FACTOR = 3
#: Depthwise pixel-tile kernels with strips of depthwise.WIDE_STRIP columns or more (fprop and stride-1 dgrad) are
#: timed on a budget of their own, this many of the model's best, on top of the others: the memory model cannot tell
#: them apart from the narrower strips, which they beat where the SMs' instruction issue is the limit (5x5 filters).
WIDE_STRIP_BUDGET = 6
#: Likewise the pipelined depthwise kernels (resident CTAs, double-buffered halo; depthwise.is_pipelined), whose
#: overlap of loads and arithmetic the model does not see either.
PIPELINED_BUDGET = 6
#: ... and the depthwise "cols" kernels (input rows kept in registers, the next row's loads in flight), whose
#: register-bound occupancy and overlap the model does not see either: this many of the model's best, one per CTA
#: shape first.
COLS_BUDGET = 8
#: ... and the depthwise wgrad kernels whose splits reduce in one thread-block cluster (depthwise.cluster_variant: no
#: partials, no second kernel, at most 8 splits per channel block), which the model ranks above their partials twins
#: wherever a few splits fill the GPU and cannot judge where they do not: this many of the model's best, one per
#: schedule first, on top of the others.
CLUSTER_SPLIT_BUDGET = 4
#: The shared-memory im2col kernels (few input channels), timed on a budget of their own on top of the others.
SMEM_IM2COL_BUDGET = 8
#: The GEMM 1x1 family's whole-wave tiles (gemm1x1.WAVE_TILES: 192 rows), this many of the model's best on top of the
#: others: they won some stride-1 1x1 cells by up to 7% and lost others by up to 15%, which the model cannot tell.
GEMM_WAVE_BUDGET = 1
#: Below this budget per problem (a quick tune, e.g. --max-candidates 1 or 2) the plan takes neither the whole-wave
#: tiles nor a wgrad's deep-pipeline twins (_deep_twins) nor its atomic split-k twins (_atomic_twins) on top.
SMALL_BUDGET = 4
#: The 3.x conv family's persistent ping-pong kernels (the project's own, sm90.PINGPONG), up to this many of the
#: model's best (one per tile shape first) on top of the others: the model does not see the overlap of one tile's
#: epilogue with the next one's mainloop, so it cannot rank them against CUTLASS's one-tile-per-CTA conv kernels, and
#: sharing the 3.x conv budget with them would drop those kernels' winners from the plan. A problem's budget of K
#: kernels adds K // 4 of them, at least one and at most this many, none for a budget of 1 (which means one kernel).
#: On the H200 they won 11 of the default workload's 48 cells, every stride-1 3x3 fprop and dgrad but layer 3's.
PINGPONG_BUDGET = 2
#: ... and one more for a strided dgrad (the ping-pong kernel walking the sub-pixel phases' tiles in one launch), where
#: the model is least sure: against the same tile launched once per phase it ran 0.84-1.35x on the H200, and the
#: 128x128 twin of layer 2's 3x3 winner (CUTLASS's kernel, 33.0 us) came third by the model, outside a budget of 2.
SUBPIXEL_PINGPONG_EXTRA = 1
DEFAULT_SLICES_PER_KERNEL = 3  # split-k launches per kernel and problem
#: A family other than 2.x keeps its share of the budget only for kernels the model puts within this factor of the
#: best 2.x estimate. The model ranks 3.x kernels as mma.sync ones and so overestimates them (they won at up to 3x
#: the 2.x estimate on the H200); beyond 8x they are 3.x kernels without split-k on a wgrad of few output tiles,
#: which ran 8-10x slower than 2.x split-k there. (Both on the uncalibrated model: heuristics.CALIBRATION came later.)
OTHER_FAMILY_CUTOFF = 8.0


def _sm90_enumerator() -> Optional[Callable[[Conv2dProblem], Iterable[KernelConfig]]]:
    """The CUTLASS 3.x family's enumerator if that module is present in this build (it is optional)."""
    try:
        from ..sm90 import sm90_candidates  # noqa: PLC0415
    except ImportError:
        return None
    return sm90_candidates


def _gemm1x1_enumerator() -> Optional[Callable[[Conv2dProblem], Iterable[KernelConfig]]]:
    """The 1x1-as-GEMM family's enumerator if that module is present in this build."""
    try:
        from ..gemm1x1 import gemm1x1_candidates  # noqa: PLC0415
    except ImportError:
        return None
    return gemm1x1_candidates


def kernel_enumerators() -> list[tuple[KernelFamily, Callable[[Conv2dProblem], Iterable[KernelConfig]]]]:
    generator_module()  # imported with a bare sys.argv before any family enumerates
    out: list[tuple[KernelFamily, Callable[[Conv2dProblem], Iterable[KernelConfig]]]] = [
        (KernelFamily.SM80_IMPLICIT_GEMM, sm80_candidates),
        (KernelFamily.DEPTHWISE_DIRECT, depthwise_candidates),
        (KernelFamily.SMEM_IM2COL, smem_im2col_candidates),
    ]
    sm90 = _sm90_enumerator()
    if sm90 is not None:
        out.append((KernelFamily.SM90_TMA_WGMMA, sm90))
    gemm1x1 = _gemm1x1_enumerator()
    if gemm1x1 is not None:
        out.append((KernelFamily.SM90_GEMM_1X1, gemm1x1))
    return out


@dataclasses.dataclass(frozen=True)
class Pruned:
    name: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Candidate:
    launch: LaunchConfig
    estimate_us: float

    @property
    def name(self) -> str:
        return self.launch.name


@dataclasses.dataclass(frozen=True)
class ProblemPlan:
    problem: Conv2dProblem
    candidates: tuple[Candidate, ...]  # launches to time, best estimate first
    valid_kernels: int  # configs that can implement the problem (before the budget)
    pruned: tuple[Pruned, ...]  # configs an enumerator offered that cannot implement the problem

    @property
    def kernels(self) -> tuple[KernelConfig, ...]:
        return tuple(dict.fromkeys(c.launch.kernel for c in self.candidates))


@dataclasses.dataclass(frozen=True)
class WorkloadPlan:
    plans: tuple[ProblemPlan, ...]

    @property
    def kernels(self) -> tuple[KernelConfig, ...]:
        """Distinct kernels over every problem: each is compiled once and serves every problem it implements."""
        return tuple(dict.fromkeys(k for p in self.plans for k in p.kernels))

    @property
    def launches(self) -> int:
        return sum(len(p.candidates) for p in self.plans)


def enumerate_kernels(problem: Conv2dProblem, arch: int = 90) -> tuple[list[KernelConfig], list[Pruned]]:
    """Every config of every family for `problem`, split into those that can implement it and those pruned."""
    valid: list[KernelConfig] = []
    pruned: list[Pruned] = []
    for family, enum_fn in kernel_enumerators():
        try:
            configs = list(enum_fn(problem))
        except Exception as e:  # noqa: BLE001 - one family's bug must not hide the others
            log.warning("%s enumerator failed on %s: %s", family.value, problem.name, e)
            continue
        for cfg in configs:
            if cfg.arch != arch:
                cfg = dataclasses.replace(cfg, arch=arch)
            why = cfg.reject_reason(problem)
            if why:
                pruned.append(Pruned(cfg.name, why))
            else:
                valid.append(cfg)
    return list(dict.fromkeys(valid)), pruned


def launches_for(problem: Conv2dProblem, kernel: KernelConfig, sms: int = H200_SMS) -> list[tuple[float, LaunchConfig]]:
    """(estimate, launch) for each slice count worth trying with `kernel`, best first; for a stream-K kernel its
    own decomposition (one slice: the scheduler balances the k tiles over the SMs) always first, since the model
    cannot rank it against fixed splits (its partials mostly stay in L2)."""
    out = []
    for s in launch_slices(problem, kernel, sms):
        if s > 1 and kernel.split_k_mode is SplitKMode.NONE:
            continue
        launch = LaunchConfig(kernel, s)
        if launch.reject_reason(problem) is None:
            out.append((estimate_us(problem, launch, sms), launch))
    streamk = kernel.family is KernelFamily.SM90_GEMM_1X1 and kernel.splits_at_launch
    out.sort(key=lambda t: (not (streamk and t[1].split_k_slices == 1), order_key(problem, t[0], kernel, t[1].name)))
    return out


def plan_problem(
    problem: Conv2dProblem, max_candidates: int = DEFAULT_MAX_CANDIDATES, *, arch: int = 90, sms: int = H200_SMS,
    slices_per_kernel: int = DEFAULT_SLICES_PER_KERNEL,
) -> ProblemPlan:
    """The launches to time for `problem`: the `max_candidates` kernels the model likes best (each family
    getting a fair share), each with its best `slices_per_kernel` split-k counts.

    Channel padding (`candidates.channel_pad_options`: the stem's C=3, the odd 7->33 layer) makes more than one
    problem a kernel may compute for `problem`: the unpadded one and each padded one. Each of them that some kernel
    takes gets its share of the budget, so the profiler always times a padded launch against its unpadded twin
    (where the unpadded problem has any kernel at all) and keeps the faster; a padded launch's estimate includes
    the padding's copies (`heuristics.padding_cost_us`), and it is timed through ops.run_problem, copies included.
    The space-to-depth fold of a strided conv of few channels (`candidates.s2d_options`, `LaunchConfig.s2d`) is
    one more way, with its own channel paddings and a budget of its own (half the problem's, at least 2 kernels)
    on top, like the im2col lowering's."""
    if max_candidates < 1:
        raise ValueError(f"max_candidates: expected >= 1, got {max_candidates}")
    if problem.is_depthwise:
        max_candidates *= DEPTHWISE_BUDGET_FACTOR
    pruned: list[Pruned] = []
    n_valid = 0
    cands: list[Candidate] = []
    groups: dict[int, list] = {}  # s2d block -> [(pad_c, pad_k, families ranked, side budgets, kernel problem)]
    for blk, pad_c, pad_k, kp, why in rewrite_options(problem):
        # the conv as it is, then its space-to-depth fold (a budget of its own on top, like the im2col lowering)
        options = groups.setdefault(blk, [])
        if why:
            pruned.append(Pruned(f"padc{pad_c}_padk{pad_k}", why))
            continue
        by_family, valid, opt_pruned = _rank_families(kp, arch, sms)
        if (blk, pad_c, pad_k) != (1, 1, 1):  # it reads any C as it is: its padded or folded twins only cost more
            by_family.pop(KernelFamily.SMEM_IM2COL, None)
            by_family.pop(_IM2COL_PAIRS, None)
        side = [t for key, budget in _side_budgets(max_candidates, kp).items() for t in by_family.pop(key, [])[:budget]]
        side += _twins_of(side, by_family.pop(_IM2COL_PAIRS, []), "pairs")
        side += _twins_of(side, by_family.pop(_COLS_AHEAD, []), "prefetch")
        side += _twins_of(side, by_family.pop(_COLS_CAPPED, []), "min_blocks")
        tag = ("" if blk == 1 else f" (space-to-depth {blk}x{blk})") + \
            ("" if (pad_c, pad_k) == (1, 1) else f" (padded to C={kp.c} K={kp.k})")
        pruned += [Pruned(pr.name + tag, pr.reason) for pr in opt_pruned]
        n_valid += valid
        if by_family:
            options.append((pad_c, pad_k, by_family, side, kp))
    for blk, options in groups.items():
        group_budget = max_candidates if blk == 1 else max(2, max_candidates // 2)
        for i, (pad_c, pad_k, by_family, side, kp) in enumerate(options):
            budget = max(1, group_budget // len(options) + (1 if i < group_budget % len(options) else 0))
            chosen = _take_budget(by_family, budget) + side
            if max_candidates >= SMALL_BUDGET:
                chosen += _deep_twins(kp, chosen, sms)
                chosen += _atomic_twins(kp, chosen, sms)
            for _, kc, launches in chosen:
                # a "cols" wgrad kernel: every split count (its model cannot tell the CTAs an SM holds, which decide
                # whether the last wave is nearly empty or nearly full); a cluster split: each of its few counts
                for us, l in launches[:len(launches) if is_cols(kc) or is_cluster_split(kc) else slices_per_kernel]:
                    if (pad_c, pad_k, blk) != (1, 1, 1):
                        l = dataclasses.replace(l, pad_c=pad_c, pad_k=pad_k, s2d=blk)
                        us = rewritten_us(problem, l, us)  # the copies' cost too; a fold's S2D_CALIBRATION
                    cands.append(Candidate(l, us))
    lowered, n_lowered = _im2col_candidates(problem, max(2, max_candidates // 2), arch, sms, slices_per_kernel)
    cands += lowered
    n_valid += n_lowered
    if problem.is_depthwise:  # the untuned default, always timed: see _depthwise_default
        cands += _depthwise_default(problem, cands, arch, sms)
    cands.sort(key=lambda c: (c.estimate_us, c.name))
    return ProblemPlan(problem, tuple(cands), n_valid, tuple(pruned))


def _depthwise_default(problem: Conv2dProblem, cands: Sequence[Candidate], arch: int, sms: int) -> list[Candidate]:
    """The depthwise default launch (`depthwise.default_depthwise_launch`) where the budgets left it out, so that a
    tuned decision is never slower than the untuned default: the default ranks by the calibrated model
    (`depthwise.DW_CALIBRATION`), the budgets by the model alone (on the `depthwise` workload they left the default
    out of 10 of the 57 plans at the default budget)."""
    from ..depthwise import default_depthwise_launch  # noqa: PLC0415

    launch = default_depthwise_launch(problem, sms)
    if launch is None:
        return []
    if launch.kernel.arch != arch:
        launch = dataclasses.replace(launch, kernel=dataclasses.replace(launch.kernel, arch=arch))
    if any(c.name == launch.name for c in cands):
        return []
    return [Candidate(launch, estimate_us(problem, launch, sms))]


def _im2col_candidates(problem: Conv2dProblem, budget: int, arch: int, sms: int,
                       slices_per_kernel: int) -> tuple[list[Candidate], int]:
    """The im2col-lowered GEMM kernels of a conv of few input channels (`gemm1x1.im2col_candidates`; none for other
    problems), with a budget of their own on top of the problem's: like a channel-padded launch, the lowering is a
    different computation of the same conv, which the model cannot rank against the implicit-GEMM kernels, so the
    profiler always times its best few against them. Returns the candidates and the number of valid kernels."""
    try:
        from ..gemm1x1 import im2col_candidates  # noqa: PLC0415
    except ImportError:  # pragma: no cover - the GEMM family is optional, like sm90
        return [], 0
    kernels = [kc if kc.arch == arch else dataclasses.replace(kc, arch=arch) for kc in im2col_candidates(problem)]
    ranked, _ = _ranked(problem, kernels, sms)
    out = [Candidate(l, us) for _, _, launches in _spread_over_tiles(ranked)[:budget]
           for us, l in launches[:slices_per_kernel]]
    return out, len(ranked)


def _ranked(problem: Conv2dProblem, kernels: Iterable[KernelConfig], sms: int) -> tuple[list, list[KernelConfig]]:
    """(estimate, kernel, launches) of each of `kernels` that has a launch for `problem`, best first by the model
    (order_key), and the kernels that have none."""
    ranked, unlaunchable = [], []
    for kc in kernels:
        launches = launches_for(problem, kc, sms)
        if launches:
            ranked.append((launches[0][0], kc, launches))
        else:
            unlaunchable.append(kc)
    ranked.sort(key=lambda t: order_key(problem, t[0], t[1], t[1].name))
    return ranked, unlaunchable


#: The keys under which _rank_families lists the depthwise pipelined kernels and the other wide-strip kernels, apart
#: from the family's others, and the budget of each (timed on top of the problem's own budget).
_WIDE = "depthwise wide strips"
_PIPELINED = "depthwise pipelined"
_PINGPONG = "sm90 ping-pong"
_COLS = "depthwise cols"
_COLS_AHEAD = "depthwise cols, prefetch twins"
_COLS_CAPPED = "depthwise cols fprop/dgrad, register-capped twins"
_CLUSTER = "depthwise wgrad, cluster split"
_GEMM_WAVE = "GEMM 1x1, whole-wave tiles"
_IM2COL_PAIRS = "shared-memory im2col, pairs twins"
_SIDE_BUDGETS = {_WIDE: WIDE_STRIP_BUDGET, _PIPELINED: PIPELINED_BUDGET, _COLS: COLS_BUDGET,
                 KernelFamily.SMEM_IM2COL: SMEM_IM2COL_BUDGET, _PINGPONG: PINGPONG_BUDGET,
                 _CLUSTER: CLUSTER_SPLIT_BUDGET, _GEMM_WAVE: GEMM_WAVE_BUDGET}
#: Side budgets whose kernels are taken one per tile shape first (_spread_over_tiles), as the families' are.
_SPREAD_SIDES = (_PINGPONG, _COLS)


def _side_budgets(max_candidates: int, problem: Conv2dProblem) -> dict:
    """The side budgets of `problem` when its own budget is `max_candidates` kernels."""
    pingpong = min(PINGPONG_BUDGET, max(1, max_candidates // 4)) if max_candidates > 1 else 0
    if pingpong and problem.is_strided_dgrad:
        pingpong += SUBPIXEL_PINGPONG_EXTRA
    # measured on fprop and dgrad only; none on small budgets (--max-candidates 1-3: a quick tune)
    wave = GEMM_WAVE_BUDGET if problem.kind is not ConvKind.WGRAD and max_candidates >= SMALL_BUDGET else 0
    return {**_SIDE_BUDGETS, _PINGPONG: pingpong, _GEMM_WAVE: wave}


def _twins_of(side: list, twins: list, field: str) -> list:
    """The twins (`twins` as _rank_families lists them) of the kernels in `side` that differ from them in `field`
    alone: each kernel the depthwise cols budget takes is timed beside its prefetch twin ("prefetch":
    depthwise.prefetch_variant, loads two rows ahead) and, for fprop / dgrad, its register-capped twin
    ("min_blocks": depthwise.min_blocks_variant, taps read from shared memory, more CTAs per SM). The model cannot
    tell which wins (more loads in flight, or more warps). Likewise each shared-memory im2col kernel beside its pairs
    twin ("pairs")."""
    taken = {t[1] for t in side}
    return [t for t in twins if dataclasses.replace(t[1], **{field: None}) in taken]


def _family_key(kernel: KernelConfig):
    """The list _rank_families puts `kernel` in: its family, or a side budget's key."""
    if kernel.is_conv_pingpong:
        return _PINGPONG
    if is_wave_tile(kernel):
        return _GEMM_WAVE
    if kernel.family is KernelFamily.SMEM_IM2COL and kernel.pairs:
        return _IM2COL_PAIRS
    if kernel.family is KernelFamily.DEPTHWISE_DIRECT:
        if is_cluster_split(kernel):
            return _CLUSTER
        if is_pipelined(kernel):
            return _PIPELINED
        if is_cols(kernel):
            if kernel.min_blocks and kernel.kind is not ConvKind.WGRAD:
                return _COLS_CAPPED
            return _COLS_AHEAD if kernel.prefetch else _COLS
        if is_wide_strip(kernel):
            return _WIDE
    return kernel.family


def _deep_twins(problem: Conv2dProblem, chosen: list, sms: int) -> list:
    """For a wgrad, the deep twin of each GEMM 1x1 kernel and 3.x split-k kernel in `chosen` (gemm1x1.deep_twin,
    sm90.deep_twin: more pipeline stages than the families' cap, which the model does not see) with its launches,
    timed beside it: its reduction runs over every output pixel, and on the H200 the 64 x 64 kernels' twins ran 3-14%
    faster on most ResNet-50 wgrad cells and slower on a few. None for other kinds (they gained nothing as a rule)."""
    if problem.kind is not ConvKind.WGRAD:
        return []

    def twin_of(kc: KernelConfig) -> Optional[KernelConfig]:
        if kc.family is KernelFamily.SM90_TMA_WGMMA and kc.split_k_mode is not SplitKMode.PARALLEL:
            return None  # measured on the split-k kernels only (the unsplit and ping-pong ones were not timed deep)
        return deep_twin(kc)

    return _timed_twins(problem, chosen, sms, twin_of)


def _timed_twins(problem: Conv2dProblem, chosen: list, sms: int,
                 twin_of: Callable[[KernelConfig], Optional[KernelConfig]]) -> list:
    """(estimate, twin, launches) for each kernel of `chosen` whose twin (`twin_of`; None: none) is a kernel not in
    `chosen` yet that can implement `problem` and has launches."""
    taken = {t[1] for t in chosen}
    out = []
    for _, kc, _ in chosen:
        twin = twin_of(kc)
        if twin is None or twin in taken or twin.reject_reason(problem) is not None:
            continue
        launches = launches_for(problem, twin, sms)
        if launches:
            taken.add(twin)
            out.append((launches[0][0], twin, launches))
    return out


def _atomic_twins(problem: Conv2dProblem, chosen: list, sms: int) -> list:
    """For a wgrad, the atomic twin of each 3.x split-k kernel in `chosen`, deep twins included (sm90.atomic_twin: the
    slices' sums added into one fp32 buffer by TMA reduce-adds instead of partials and a reduction kernel) with its
    launches, timed beside it: the model cannot tell what the partials' second pass costs against adds in L2. None
    under torch.use_deterministic_algorithms(True), where the order of those adds must not vary."""
    from ..gemm1x1 import deterministic_required  # noqa: PLC0415

    if problem.kind is not ConvKind.WGRAD or deterministic_required():
        return []
    try:
        from ..sm90 import atomic_twin  # noqa: PLC0415
    except ImportError:  # pragma: no cover - the 3.x families are optional
        return []
    return _timed_twins(problem, chosen, sms, atomic_twin)


def deep_twin(kernel: KernelConfig) -> Optional[KernelConfig]:
    """`kernel`'s deep-pipeline twin (sm90.deep_twin, gemm1x1.deep_twin), or None: not a 3.x kernel, the cap does not
    bind, or the optional family is absent from this build."""
    try:
        if kernel.family is KernelFamily.SM90_TMA_WGMMA:
            from ..sm90 import deep_twin as twin  # noqa: PLC0415
        elif kernel.family is KernelFamily.SM90_GEMM_1X1:
            from ..gemm1x1 import deep_twin as twin  # noqa: PLC0415
        else:
            return None
    except ImportError:  # pragma: no cover - the 3.x families are optional
        return None
    return twin(kernel)


def is_wave_tile(kernel: KernelConfig) -> bool:
    """A GEMM 1x1 kernel (not lowered) of a whole-wave tile (gemm1x1.WAVE_TILES; none where that optional family is
    absent): timed on a budget of its own (GEMM_WAVE_BUDGET)."""
    if kernel.family is not KernelFamily.SM90_GEMM_1X1 or kernel.lowering is not None:
        return False
    try:
        from ..gemm1x1 import WAVE_TILES  # noqa: PLC0415
    except ImportError:  # pragma: no cover - the GEMM family is optional, like sm90
        return False
    return kernel.tile in WAVE_TILES


def _rank_families(problem: Conv2dProblem, arch: int, sms: int) -> tuple[dict, int, list[Pruned]]:
    """The kernels of each family for `problem` with their launches, ranked by the model, hopeless families
    dropped (the depthwise pipelined and wide-strip kernels apart, under _PIPELINED and _WIDE); and the number of
    valid kernels and the pruned ones."""
    valid, pruned = enumerate_kernels(problem, arch)
    ranked, unlaunchable = _ranked(problem, valid, sms)
    pruned += [Pruned(kc.name, "no split-k count fits the problem") for kc in unlaunchable]
    by_family: dict = {}  # _family_key -> [(estimate, kernel, launches)]
    for t in ranked:  # (each family's order is the overall one)
        by_family.setdefault(_family_key(t[1]), []).append(t)
    for fam, lst in by_family.items():
        spread = fam not in _SIDE_BUDGETS or fam in _SPREAD_SIDES
        by_family[fam] = _alternate_schedules(_spread_over_tiles(lst) if spread else lst)
    sm80 = by_family.get(KernelFamily.SM80_IMPLICIT_GEMM)
    if sm80:  # hopeless candidates of the other families give their share back to 2.x
        # on the model's own estimates, before heuristics.CALIBRATION, which OTHER_FAMILY_CUTOFF was measured on
        def uncalibrated(t) -> float:
            return t[0] / calibration(problem, t[2][0][1])

        best_2x = uncalibrated(sm80[0])
        for fam in [f for f in by_family if f is not KernelFamily.SM80_IMPLICIT_GEMM]:
            by_family[fam] = [t for t in by_family[fam] if uncalibrated(t) <= OTHER_FAMILY_CUTOFF * best_2x]
            if not by_family[fam]:
                del by_family[fam]
    return by_family, len(valid), pruned


def _take_budget(by_family: dict, max_candidates: int) -> list:
    """Up to `max_candidates` kernels (with their launches) across the families."""
    # Budget: the families share max_candidates equally (at least one kernel each), because the model cannot rank
    # them against each other. What an equal split leaves over goes one kernel each to the families other than 2.x:
    # with three families (a 1x1 stride-1 conv: 2.x, 3.x conv and 3.x GEMM) 2.x used to take the remainder, four of
    # eight kernels, and won none of those 18 ResNet-50 cells on the H200 (cold tune of 2026-12-01), while the wgrad
    # cells' best 3.x split kernels were left out (a 64x128 tile for layer 3's: 15.8 against the plan's 16.5-17.6 us).
    # With two families (2.x and one other) the split stays four and four.
    if len(by_family) == 1:  # one family (e.g. depthwise): its own order, which alternates its schedules
        return next(iter(by_family.values()))[:max_candidates]
    others = [f for f in by_family if f is not KernelFamily.SM80_IMPLICIT_GEMM]
    if max_candidates < len(by_family):  # too few for one kernel per family: each family's best, best estimate first
        return sorted((lst[0] for lst in by_family.values() if lst), key=lambda t: t[0])[:max_candidates]
    equal, extra = divmod(max_candidates, len(by_family))
    share = {f: equal + (1 if f in others[:extra] else 0) for f in others}
    chosen: list[tuple[float, KernelConfig, list[tuple[float, LaunchConfig]]]] = []
    for f in others:
        chosen += by_family[f][: share[f]]
    rest = max(0, max_candidates - len(chosen))
    chosen += by_family.get(KernelFamily.SM80_IMPLICIT_GEMM, [])[:rest]
    if len(chosen) < max_candidates:  # fill from any family if 2.x had too few
        taken = {id(t) for t in chosen}
        spare = sorted((t for lst in by_family.values() for t in lst if id(t) not in taken), key=lambda t: t[0])
        chosen += spare[: max_candidates - len(chosen)]
    return chosen


def _spread_over_tiles(ranked: list) -> list:
    """The family's kernels, best first, reordered so the best kernel of each M x N tile shape comes before any
    second kernel of a shape. Memory-bound layers (1x1 convs of few channels) tie in the model, which cannot tell
    a 128x64 tile from a 64x64 one although they run up to 2x apart: a budget spent on one shape's K, stage and
    iterator variants would leave the profiler nothing to choose from."""
    seen: set[tuple[int, int]] = set()
    firsts, rest = [], []
    for t in ranked:
        shape = t[1].tile[:2]
        (firsts if shape not in seen else rest).append(t)
        seen.add(shape)
    return firsts + rest


def _schedule_group(kernel: KernelConfig):
    """The group _alternate_schedules puts `kernel` in within its family (None: the family is one group)."""
    if kernel.family is KernelFamily.DEPTHWISE_DIRECT:
        return kernel.schedule, kernel.halo_smem
    if kernel.family is KernelFamily.SM90_TMA_WGMMA:
        return kernel.split_k_mode
    return None


def _alternate_schedules(ranked: list) -> list:
    """The family's kernels taken in turn from each of its schedules (each schedule's own order kept), where the
    family has more than one and the model cannot rank them against each other: the depthwise kernels' pixel tiles
    read through L1 or staged in shared memory, and wgrad's "rows" and "taprows" schedules; the 3.x conv wgrad
    kernels with and without the project's split-k (fp32 partials, then a reduction), which the model ranks as it
    ranks 2.x split-k: on the H200 an unsplit 64x128 kernel of the 256-channel 3x3 wgrad ran 21.7 us, every split
    one 26.6 us or more, and the model had put all of its split kernels first (scripts/sweep_kernels.py, 2026-11-30).
    A budget then times the best few of each instead of the first schedule's only."""
    groups: dict = {}
    for t in ranked:
        groups.setdefault(_schedule_group(t[1]), []).append(t)
    if len(groups) < 2:
        return ranked
    out, lists = [], list(groups.values())
    for i in range(max(len(lst) for lst in lists)):
        out += [lst[i] for lst in lists if i < len(lst)]
    return out


def plan_workload(
    problems: Sequence[Conv2dProblem], max_candidates: int = DEFAULT_MAX_CANDIDATES, *, arch: int = 90,
    sms: int = H200_SMS, slices_per_kernel: int = DEFAULT_SLICES_PER_KERNEL,
) -> WorkloadPlan:
    return WorkloadPlan(tuple(
        plan_problem(p, max_candidates, arch=arch, sms=sms, slices_per_kernel=slices_per_kernel)
        for p in dict.fromkeys(problems)
    ))


def has_kernels(problem: Conv2dProblem, arch: int = 90) -> bool:
    """Whether any kernel family of this build can compute `problem`, unpadded or channel-padded (e.g. depthwise
    layers join the default workload only once a family yields configs for them)."""
    for pad_c, pad_k in channel_pad_options(problem):
        if padding_reject_reason(problem, pad_c, pad_k):
            continue
        if enumerate_kernels(problem.replace(c=round_up(problem.c, pad_c), k=round_up(problem.k, pad_k)), arch)[0]:
            return True
    return False


def iter_candidate_names(plan: WorkloadPlan) -> Iterator[str]:
    for p in plan.plans:
        for c in p.candidates:
            yield f"{p.problem.name}: {c.name} ({c.estimate_us:.1f} us est.)"
