"""Split-k study (issue 3's benchmark): for each wgrad layer, the best split-k launch against the best unsplit
launch against cuDNN, all timed in one process on the same operands with the same timer.

The launches compared are the model's top few of each side (`per_side`) and the tuned decision's launch (the
tune's winner, where the cache has one) on its own side, each verified before it is timed; a wrong or failing
launch is reported and never counts as best.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional, Sequence

from ..config import KernelConfig, LaunchConfig
from ..types import ConvKind, KernelFamily, SplitKMode
from ..workloads import WorkloadItem
from .plan import enumerate_kernels, launches_for


@dataclasses.dataclass(frozen=True)
class SplitKRow:
    layer: str
    problem: str
    cudnn_us: float
    unsplit_us: Optional[float]
    unsplit: Optional[str]
    split_us: Optional[float]
    split: Optional[str]
    timed: int
    failed: int

    @property
    def split_speedup(self) -> Optional[float]:
        return self.unsplit_us / self.split_us if self.unsplit_us and self.split_us else None

    def ratio(self, us: Optional[float]) -> Optional[float]:
        return self.cudnn_us / us if us else None


@dataclasses.dataclass(frozen=True)
class SplitKReport:
    rows: tuple[SplitKRow, ...]

    @staticmethod
    def _geo(vals) -> Optional[float]:
        vals = [v for v in vals if v]
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None

    def table(self) -> str:
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        head = (f"{'layer':<24} {'cuDNN us':>9} {'unsplit us':>10} {'split-k us':>10} {'cuDNN/unsplit':>13} "
                f"{'cuDNN/split':>11} {'split gain':>10}  best split-k launch")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(
                f"{r.layer:<24} {r.cudnn_us:>9.1f} {f(r.unsplit_us, '.1f'):>10} {f(r.split_us, '.1f'):>10} "
                f"{f(r.ratio(r.unsplit_us), '.3f'):>13} {f(r.ratio(r.split_us), '.3f'):>11} "
                f"{f(r.split_speedup, '.2f'):>10}  {r.split or '-'}"
            )
        lines.append(
            f"geomean: cuDNN/unsplit {f(self._geo(r.ratio(r.unsplit_us) for r in self.rows), '.3f')}, "
            f"cuDNN/split-k {f(self._geo(r.ratio(r.split_us) for r in self.rows), '.3f')}, "
            f"split-k gain over unsplit {f(self._geo(r.split_speedup for r in self.rows), '.2f')}"
        )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps([dataclasses.asdict(r) for r in self.rows], indent=1)


def _with_decision(split: list[LaunchConfig], unsplit: list[LaunchConfig],
                   decided: Optional[LaunchConfig]) -> tuple[list[LaunchConfig], list[LaunchConfig]]:
    """The sides with the tuned decision's launch added to its own (split when it has more than one slice), unless
    the model's picks hold it already. A channel-padded or folded decision is left out: the study compares kernels on
    the problem as it is."""
    if decided is None or decided.padded or decided in split + unsplit:
        return split, unsplit
    if decided.split_k_slices > 1:
        return [*split, decided], unsplit
    return split, [*unsplit, decided]


def _sides(problem, per_side: int) -> tuple[list[LaunchConfig], list[LaunchConfig]]:
    kernels, _ = enumerate_kernels(problem)
    ranked = sorted(((est, l) for k in kernels for est, l in launches_for(problem, k)), key=lambda t: (t[0], t[1].name))
    # split side: the `per_side` best split kernels, each with every slice count worth trying (the model is
    # least sure about the slice count)
    split_kernels = list(dict.fromkeys(l.kernel for _, l in ranked if l.split_k_slices > 1))[:per_side]
    split = [l for _, l in ranked if l.split_k_slices > 1 and l.kernel in split_kernels]
    unsplit = [l for _, l in ranked if l.split_k_slices == 1 and (
        l.kernel.family is not KernelFamily.SM80_IMPLICIT_GEMM or l.kernel.split_k_mode is SplitKMode.SERIAL)]
    # the best of each family without a split: the model cannot rank 2.x against 3.x
    per_family = {}
    for l in unsplit:
        per_family.setdefault(l.kernel.family, []).append(l)
    unsplit = [l for fam in per_family.values() for l in fam[:per_side]]
    return split, unsplit


def study_kernels(items: Sequence[WorkloadItem], per_side: int = 3) -> list[KernelConfig]:
    """The kernels of the study's two sides on the workload's wgrad problems, in order, without repeats. With the
    tune's plan (which holds each tuned decision's kernel) they are all that `cutlass-byoc bench --split-k` builds, so
    `scripts/warm_cache.py --split-k-study` can compile them ahead of a GPU round (on the default workload 41, 19 of
    them outside the plan)."""
    sides = (_sides(it.problem, per_side) for it in items if it.problem.kind is ConvKind.WGRAD)
    return list(dict.fromkeys(l.kernel for split, unsplit in sides for l in split + unsplit))


def bench_split_k(items: Sequence[WorkloadItem], *, per_side: int = 3, jobs: Optional[int] = None,
                  progress: bool = False) -> SplitKReport:
    import torch  # noqa: PLC0415

    from .verify import cudnn_fn  # noqa: PLC0415
    from ..build import build  # noqa: PLC0415
    from .timing import time_gpu  # noqa: PLC0415
    from .worker import WorkerSettings, evaluate_candidate, make_problem_sets  # noqa: PLC0415
    from ..decisions import lookup_decision  # noqa: PLC0415

    items = [it for it in items if it.problem.kind is ConvKind.WGRAD]
    plans = {it: _with_decision(*_sides(it.problem, per_side), lookup_decision(it.problem)) for it in items}
    build([l.kernel for s, u in plans.values() for l in s + u], jobs=jobs, progress=progress)
    torch.backends.cudnn.benchmark = True
    ws = WorkerSettings()
    rows = []
    for it in items:
        p = it.problem
        split, unsplit = plans[it]
        sets, ref = make_problem_sets(p, ws)
        cudnn = time_gpu(cudnn_fn(p, sets), len(sets), ws.timing).median_us
        results = [evaluate_candidate(p, l, sets, ref, ws.timing) for l in split + unsplit]
        ok = [r for r in results if r.ok]
        best = lambda rs: min(rs, key=lambda r: r.median_us) if rs else None  # noqa: E731
        bs = best([r for r in ok if r.launch.split_k_slices > 1])
        bu = best([r for r in ok if r.launch.split_k_slices == 1])
        rows.append(SplitKRow(
            layer=it.layer, problem=p.name, cudnn_us=cudnn,
            unsplit_us=bu.median_us if bu else None, unsplit=bu.launch.name if bu else None,
            split_us=bs.median_us if bs else None, split=bs.launch.name if bs else None,
            timed=len(ok), failed=len(results) - len(ok),
        ))
        del sets, ref
        torch.cuda.empty_cache()
    return SplitKReport(tuple(rows))
