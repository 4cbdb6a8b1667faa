"""The offload report: for every convolution in a partitioned graph, whether it went to a CUTLASS kernel, with which
kernel and fused epilogue, or why it stayed with PyTorch."""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Optional

from ..select import CUDNN_FASTER, HOST_CREDIT

log = logging.getLogger("cutlass_byoc.offload")


#: The reason a conv with symbolic sizes is left to PyTorch starts with this (patterns.py's shape check).
DYNAMIC_SHAPE = "dynamic shape"
#: The note on an offloaded call whose batch size is symbolic starts with this (partition._dynamic_note).
DYNAMIC_BATCH = "dynamic batch"
_dynamic_warned = False


def _warn_dynamic_once() -> None:
    """Say once per process, as a warning, why a graph with symbolic sizes runs its convs in PyTorch: torch.compile
    recompiles with dynamic sizes after it sees a second size, and that graph then serves every later call. A
    symbolic batch size alone is offloaded (OffloadOptions.dynamic_batch); symbolic image or channel sizes are not."""
    global _dynamic_warned
    if not _dynamic_warned:
        _dynamic_warned = True
        log.warning("cutlass_byoc: a graph with dynamic (symbolic) sizes was compiled, and its convolutions run in "
                    "PyTorch (the report says why: symbolic image or channel sizes, or a symbolic batch size with "
                    "options dynamic_batch=False): kernels are chosen per static shape. torch.compile makes a "
                    "dimension dynamic once it sees a second size, and that graph then serves every later call. Pass "
                    "dynamic=False to torch.compile (one static, offloaded graph per shape).")


class Pass(str, enum.Enum):
    """Which convolution pass a report entry is about."""

    FPROP = "fprop"
    DGRAD = "dgrad"
    WGRAD = "wgrad"
    TRANSPOSED_FPROP = "transposed_fprop"  # forward of a transposed conv, run as dgrad


@dataclasses.dataclass
class OffloadEntry:
    """One conv pass found in the graph."""

    node: str  # the graph node it came from (aten.convolution / aten.convolution_backward)
    kind: Pass
    offloaded: bool
    problem: Optional[str] = None  # Conv2dProblem.name when one could be built
    kernel: Optional[str] = None  # LaunchConfig.name chosen at compile time (or the heuristic's pick when tuning)
    pattern: Optional[str] = None  # the pattern that matched (what was fused)
    fused: tuple[str, ...] = ()  # fused epilogue steps: bias, residual, activation, cast
    reason: Optional[str] = None  # why it was not offloaded
    notes: list[str] = dataclasses.field(default_factory=list)  # layout conversions, epilogue steps left out and why

    def line(self) -> str:
        if self.offloaded:
            fused = "+".join(self.fused) or "plain"
            s = f"[offloaded] {self.kind.value:16s} {self.node}: {self.problem} fused={fused} kernel={self.kernel}"
        else:
            s = f"[pytorch]   {self.kind.value:16s} {self.node}: {self.reason}"
        if self.notes:
            s += " (" + "; ".join(self.notes) + ")"
        return s


@dataclasses.dataclass
class OffloadReport:
    """All entries of one partitioned graph."""

    graph: str = "graph"
    entries: list[OffloadEntry] = dataclasses.field(default_factory=list)
    layout_conversions: int = 0  # aten.clone(channels_last) inserted before offloaded convs
    output_restrides: int = 0  # clones restoring a graph output's original layout
    layout_restores: int = 0  # copies giving an op that needs the traced strides (a view) its original layout
    launches: list = dataclasses.field(default_factory=list, repr=False)  # LaunchConfigs chosen at compile time
    problems: list = dataclasses.field(default_factory=list, repr=False)  # their Conv2dProblems, in the same order
    #: why the graph was left to PyTorch/Inductor whole (partitioning raised or gave an invalid graph), else None
    failure: Optional[str] = None
    #: training batch norms whose statistics an offloaded conv's epilogue computes (OffloadOptions.fuse_bn_stats)
    bn_stats: int = 0
    #: offloaded wgrads launched on a side stream beside the rest of the backward (OffloadOptions.overlap_wgrad)
    overlapped_wgrads: int = 0
    #: casts of graph inputs (parameters) and counter increments batched into multi-tensor launches
    #: (OffloadOptions.batch_params)
    batched_casts: int = 0
    batched_counters: int = 0
    #: training max pools on this backend's ops (OffloadOptions.max_pool), and why others were left to Inductor
    max_pools: int = 0
    max_pools_left: list = dataclasses.field(default_factory=list)
    #: training batch norms' statistics as shifted sums (OffloadOptions.bn_sums), and why other var_means were left
    #: to Inductor (its Welford reduction)
    bn_sums: int = 0
    bn_sums_left: list = dataclasses.field(default_factory=list)
    #: offloaded problems on the model's launch for want of a decision for this GPU (select="cached"), and of those
    #: the ones whose decisions in the cache were made elsewhere (another GPU, CUTLASS or template set), by what differs
    untuned: int = 0
    tuned_elsewhere: dict = dataclasses.field(default_factory=dict)

    def fail(self, reason: str) -> None:
        """Record that this graph was compiled without offload; the entries found before the failure are dropped
        (none of them took effect)."""
        self.failure = reason
        self.entries.clear()
        self.launches.clear()
        self.problems.clear()
        self.layout_conversions = self.output_restrides = self.layout_restores = self.bn_stats = 0
        self.overlapped_wgrads = self.batched_casts = self.batched_counters = self.max_pools = self.bn_sums = 0
        self.max_pools_left, self.bn_sums_left = [], []
        self.untuned, self.tuned_elsewhere = 0, {}
        log.warning("cutlass_byoc: %s left whole to PyTorch: %s", self.graph, reason)

    def add(self, entry: OffloadEntry) -> OffloadEntry:
        self.entries.append(entry)
        if entry.offloaded:
            log.info("offload %s", entry.line())
        else:
            log.info("not offloaded %s", entry.line())
            if (entry.reason or "").startswith(DYNAMIC_SHAPE):
                _warn_dynamic_once()
        return entry

    @property
    def offloaded(self) -> list[OffloadEntry]:
        return [e for e in self.entries if e.offloaded]

    @property
    def rejected(self) -> list[OffloadEntry]:
        return [e for e in self.entries if not e.offloaded]

    def count(self, kind: Pass | str | None = None, offloaded: Optional[bool] = True) -> int:
        return sum(1 for e in self.entries
                   if (kind is None or e.kind is Pass(kind)) and (offloaded is None or e.offloaded == offloaded))

    def by_node(self, node: str) -> list[OffloadEntry]:
        return [e for e in self.entries if e.node == node]

    def summary(self) -> str:
        kinds = [k for k in Pass if self.count(k, None)]
        head = ", ".join(f"{k.value} {self.count(k)}/{self.count(k, None)}" for k in kinds) or "no convolutions"
        if self.failure:
            return (f"cutlass_byoc offload report for {self.graph}: nothing offloaded, the graph was compiled as "
                    f"without this backend: {self.failure}")
        faster = sum(1 for e in self.entries if not e.offloaded and (e.reason or "").startswith(CUDNN_FASTER))
        credit = sum(1 for e in self.entries if e.offloaded and any(n.startswith(HOST_CREDIT) for n in e.notes))
        kept = "; ".join(s for s in (f"{faster} left to cuDNN, measured faster" if faster else "",
                                     f"{credit} on the host credit, cuDNN measured faster" if credit else "") if s)
        kept = f" ({kept})" if kept else ""
        lines = [f"cutlass_byoc offload report for {self.graph}: {head} offloaded{kept}; "
                 f"{self.layout_conversions} channels_last conversions, {self.output_restrides} output re-strides, "
                 f"{self.layout_restores} layout restores"
                 + (f"; {self.bn_stats} batch-norm statistics in the convs' epilogues" if self.bn_stats else "")
                 + (f"; {self.overlapped_wgrads} wgrads on a side stream" if self.overlapped_wgrads else "")
                 + (f"; {self.batched_casts} parameter casts batched" if self.batched_casts else "")
                 + (f"; {self.batched_counters} counter increments batched" if self.batched_counters else "")
                 + (f"; {self.max_pools} max pools on this backend's kernels" if self.max_pools else "")
                 + (f"; {self.bn_sums} batch-norm statistics as shifted sums" if self.bn_sums else "")
                 + (f"; {self.untuned} problems untuned (no decision for this GPU: the model's launch)"
                    if self.untuned else "")]
        lines += ["  " + e.line() for e in self.entries]
        lines += [f"  [inductor]  max pool {why}" for why in self.max_pools_left]
        lines += [f"  [inductor]  var_mean {why}" for why in self.bn_sums_left]
        lines += [f"  [untuned]   {len(ps)} problems with decisions {why} only: not used here"
                  for why, ps in self.tuned_elsewhere.items()]
        return "\n".join(lines)

    def merge(self, other: "OffloadReport") -> "OffloadReport":
        return OffloadReport(f"{self.graph}+{other.graph}", self.entries + other.entries,
                             self.layout_conversions + other.layout_conversions,
                             self.output_restrides + other.output_restrides,
                             self.layout_restores + other.layout_restores, self.launches + other.launches,
                             self.problems + other.problems,
                             "; ".join(f for f in (self.failure, other.failure) if f) or None,
                             self.bn_stats + other.bn_stats, self.overlapped_wgrads + other.overlapped_wgrads,
                             self.batched_casts + other.batched_casts,
                             self.batched_counters + other.batched_counters,
                             self.max_pools + other.max_pools, self.max_pools_left + other.max_pools_left,
                             self.bn_sums + other.bn_sums, self.bn_sums_left + other.bn_sums_left,
                             self.untuned + other.untuned,
                             {k: list(dict.fromkeys([*self.tuned_elsewhere.get(k, ()),
                                                     *other.tuned_elsewhere.get(k, ())]))
                              for k in dict.fromkeys([*self.tuned_elsewhere, *other.tuned_elsewhere])})

    def __str__(self) -> str:
        return self.summary()
