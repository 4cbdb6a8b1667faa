"""Benchmark the chosen kernels against cuDNN (PyTorch, cudnn.benchmark on, channels_last) in one process.

Both sides are timed by the same function (`profiler.timing.time_gpu`: warm-up, CUDA events, inputs rotated
beyond L2, median) on the same operand sets. Ours runs through `ops.run_problem` with the launch `select.choose`
returns (the recorded decision, else the model's default, marked as such). Each row also checks our output
against the fp32 reference. Ratio = cuDNN time / our time: above 1 we are faster.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import math
from pathlib import Path
from typing import Optional, Sequence

from .problem import Conv2dProblem
from .types import ConvKind
from .profiler.verify import cudnn_fn
from .workloads import WorkloadItem

log = logging.getLogger("cutlass_byoc.bench")

#: H200 ceilings (BRIEF.md): the roofline ridge that splits compute- from memory-bound layers.
PEAK_TFLOPS = 708.0
PEAK_GBS = 4240.0
RIDGE_FLOP_PER_BYTE = PEAK_TFLOPS * 1e12 / (PEAK_GBS * 1e9)


def lower_ratio(ratio: Optional[float], tune_ratio: Optional[float]) -> Optional[float]:
    """The lower of a cell's ratio in the bench's process and in its tune's (either alone where the other is
    missing), or None: BenchRow.min_ratio, and publish_results' README line from a bench JSON's rows."""
    ratios = [r for r in (ratio, tune_ratio) if r is not None and r > 0]
    return min(ratios) if ratios else None


@dataclasses.dataclass(frozen=True)
class BenchRow:
    layer: str
    kind: str
    problem: str
    resnet50: bool
    bound: str  # "compute" or "memory" (roofline of the fewest bytes the problem must move)
    launch: Optional[str]
    chosen_by: str  # "decision", "model" (no decision recorded) or "none"
    ours_us: Optional[float]
    cudnn_us: Optional[float]
    ours_tflops: Optional[float]
    cudnn_tflops: Optional[float]
    ours_gbs: Optional[float]
    cudnn_gbs: Optional[float]
    ratio: Optional[float]  # cudnn_us / ours_us
    max_error: Optional[float]
    status: str  # "ok", "wrong", "error: ..."
    depthwise: bool = False  # a depthwise layer (groups == C == K): memory-bound, compared in GB/s
    #: the same launch and cuDNN as timed by the tune that chose it (the decision's record: another process), and
    #: their ratio. cuDNN's benchmark mode picks its algorithm per process and does not always pick the same one (on
    #: the H200 a depthwise wgrad's cuDNN time read 34.6 us in the tune and 46.8 us in the bench), so the summary
    #: also gives each cell's lower ratio of the two processes.
    tune_us: Optional[float] = None
    tune_cudnn_us: Optional[float] = None
    tune_ratio: Optional[float] = None

    @property
    def min_ratio(self) -> Optional[float]:
        """The lower of this process's ratio and the tune's (lower_ratio)."""
        return lower_ratio(self.ratio, self.tune_ratio)

    @property
    def metric(self) -> str:
        return "GB/s" if self.bound == "memory" else "TFLOP/s"


@dataclasses.dataclass(frozen=True)
class BenchReport:
    rows: tuple[BenchRow, ...]
    gpu: str
    torch_version: str
    cudnn_version: Optional[int]

    def _ratios(self, rows: Sequence[BenchRow]) -> list[float]:
        return [r.ratio for r in rows if r.ratio is not None and r.ratio > 0]

    @staticmethod
    def geomean(values: Sequence[float]) -> Optional[float]:
        return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None

    @property
    def geomean_all(self) -> Optional[float]:
        return self.geomean(self._ratios(self.rows))

    @property
    def geomean_resnet50(self) -> Optional[float]:
        return self.geomean(self._ratios([r for r in self.rows if r.resnet50]))

    def geomean_kind(self, kind: str) -> Optional[float]:
        return self.geomean(self._ratios([r for r in self.rows if r.kind == kind]))

    @property
    def worst(self) -> Optional[BenchRow]:
        ok = [r for r in self.rows if r.ratio is not None]
        return min(ok, key=lambda r: r.ratio) if ok else None

    def summary(self) -> dict:
        w = self.worst
        return {
            "geomean_cudnn_over_ours_all": self.geomean_all,
            "geomean_cudnn_over_ours_resnet50": self.geomean_resnet50,
            "resnet50_cells": sum(1 for r in self.rows if r.resnet50 and r.ratio is not None),
            "geomean_by_kind": {k.value: self.geomean_kind(k.value) for k in ConvKind},
            "worst": {"layer": w.layer, "kind": w.kind, "ratio": w.ratio, "ours_us": w.ours_us,
                      "cudnn_us": w.cudnn_us, "launch": w.launch} if w else None,
            "undecided": sum(1 for r in self.rows if r.chosen_by != "decision"),
            "geomean_depthwise_by_kind": {
                k.value: self.geomean(self._ratios([r for r in self.rows if r.depthwise and r.kind == k.value]))
                for k in ConvKind},
            # each cell's lower ratio of this process and the tune's (BenchRow.min_ratio)
            "geomean_min_ratio_all": self.geomean([r.min_ratio for r in self.rows if r.min_ratio]),
            "geomean_min_ratio_by_kind": {
                k.value: self.geomean([r.min_ratio for r in self.rows if r.min_ratio and r.kind == k.value])
                for k in ConvKind},
        }

    def to_json(self) -> str:
        return json.dumps({"gpu": self.gpu, "torch": self.torch_version, "cudnn": self.cudnn_version,
                           "summary": self.summary(), "rows": [dataclasses.asdict(r) for r in self.rows]}, indent=1)

    def to_csv(self) -> str:
        buf = io.StringIO()
        fields = [f.name for f in dataclasses.fields(BenchRow)]
        wr = csv.DictWriter(buf, fieldnames=fields)
        wr.writeheader()
        for r in self.rows:
            wr.writerow(dataclasses.asdict(r))
        return buf.getvalue()

    def table(self) -> str:
        def f(v: Optional[float], spec: str) -> str:
            return "-" if v is None else format(v, spec)

        head = ["layer", "kind", "ours us", "cuDNN us", "ours", "cuDNN", "unit", "ratio", "chosen", "status"]
        lines = []
        for r in self.rows:
            mem = r.bound == "memory"
            lines.append([
                r.layer, r.kind, f(r.ours_us, ".1f"), f(r.cudnn_us, ".1f"),
                f(r.ours_gbs if mem else r.ours_tflops, ".0f" if mem else ".1f"),
                f(r.cudnn_gbs if mem else r.cudnn_tflops, ".0f" if mem else ".1f"), r.metric,
                f(r.ratio, ".2f"), r.chosen_by, r.status,
            ])
        widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(head)]
        fmt = lambda cells: "  ".join(c.ljust(w) if i in (0, 1, 6, 8, 9) else c.rjust(w)  # noqa: E731
                                      for i, (c, w) in enumerate(zip(cells, widths)))
        out = [f"{self.gpu}; torch {self.torch_version}; cuDNN {self.cudnn_version}; ratio = cuDNN time / ours",
               fmt(head), fmt(["-" * w for w in widths])]
        out += [fmt(l) for l in lines]
        s = self.summary()
        g = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        out.append("")
        out.append(f"geometric mean of cuDNN/ours: all {g(s['geomean_cudnn_over_ours_all'])}; "
                   f"ResNet-50 ({s['resnet50_cells']} cells) {g(s['geomean_cudnn_over_ours_resnet50'])}; "
                   + ", ".join(f"{k} {g(v)}" for k, v in s["geomean_by_kind"].items()))
        if s["geomean_min_ratio_all"] is not None and any(r.tune_ratio for r in self.rows):
            out.append(f"each cell's lower ratio of this run and its tune's: all {g(s['geomean_min_ratio_all'])}; "
                       + ", ".join(f"{k} {g(v)}" for k, v in s["geomean_min_ratio_by_kind"].items()))
        if s["worst"]:
            w = s["worst"]
            out.append(f"worst cell: {w['layer']} {w['kind']}: {w['ratio']:.3f} "
                       f"({w['ours_us']:.1f} us vs cuDNN {w['cudnn_us']:.1f} us, {w['launch']})")
        if s["undecided"]:
            out.append(f"{s['undecided']} rows ran the model's default launch (no tuned decision): "
                       "run `cutlass-byoc tune` first for tuned numbers")
        return "\n".join(out)

    def plot(self, path: str | Path) -> None:
        """Bar chart of the ratio per layer and kind (needs matplotlib)."""
        try:
            import matplotlib  # noqa: PLC0415

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # noqa: PLC0415
        except ImportError as e:
            raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from e
        layers = list(dict.fromkeys(r.layer for r in self.rows))
        kinds = [k.value for k in ConvKind]
        fig, ax = plt.subplots(figsize=(max(8, len(layers) * 0.7), 5))
        width = 0.8 / len(kinds)
        for j, kind in enumerate(kinds):
            vals = {r.layer: r.ratio for r in self.rows if r.kind == kind}
            ax.bar([i + j * width for i in range(len(layers))], [vals.get(l) or 0 for l in layers], width, label=kind)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(layers))], layers, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("cuDNN time / cutlass-byoc time")
        ax.set_title(f"{self.gpu}: geomean {self.geomean_all or 0:.3f}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def check_and_time(p: Conv2dProblem, launch, sets, ref, timing) -> tuple[Optional[float], Optional[float], str]:
    """Runs `launch` once on operand set 0 (output poisoned first) against the float64 reference `ref`, then, if it
    is right, times it over the rotated `sets` as the profiler does: (median us or None, max error or None, status:
    "ok", "wrong: ..." or "error: ..."). A CUDA error is raised (it would recur on the next launch)."""
    import torch  # noqa: PLC0415

    from .ops import run_problem  # noqa: PLC0415
    from .profiler.timing import time_gpu  # noqa: PLC0415
    from .profiler.verify import compare, poison  # noqa: PLC0415

    err = None
    try:
        s0 = sets[0]
        poison(s0.out)
        run_problem(p, s0.a, s0.b, s0.out, s0.source, config=launch, bias=s0.bias)
        torch.cuda.synchronize()
        chk = compare(p, s0.out, ref)
        err = chk.max_error
        if not chk.ok:
            return None, err, "wrong: " + chk.message

        def fn(i: int) -> None:
            s = sets[i]
            run_problem(p, s.a, s.b, s.out, s.source, config=launch, bias=s.bias)

        return time_gpu(fn, len(sets), timing).median_us, err, "ok"
    except Exception as e:  # noqa: BLE001 - reported in the row; a CUDA error would recur on the next row
        if "CUDA error" in str(e):
            raise
        return None, err, f"error: {type(e).__name__}: {str(e)[:200]}"


def bench_item(item: WorkloadItem, settings=None) -> BenchRow:
    import torch  # noqa: PLC0415

    from .decisions import lookup  # noqa: PLC0415
    from .heuristics import default_launch  # noqa: PLC0415
    from .profiler.timing import time_gpu  # noqa: PLC0415
    from .profiler.worker import WorkerSettings, make_problem_sets  # noqa: PLC0415

    ws = settings or WorkerSettings()
    p = item.problem
    bound = "memory" if p.flops / p.bytes_moved < RIDGE_FLOP_PER_BYTE else "compute"
    base = dict(layer=item.layer, kind=p.kind.value, problem=p.name, resnet50=item.resnet50, bound=bound,
                depthwise=p.is_depthwise)
    dec = lookup(p)
    launch = dec.launch if dec else None  # a channel-padded launch carries its padding
    chosen_by = "decision"
    if launch is None:
        launch, chosen_by = default_launch(p), "model"
    sets, ref = make_problem_sets(p, ws)
    cudnn = time_gpu(cudnn_fn(p, sets), len(sets), ws.timing)
    ours_us = err = None
    status = "ok"
    if launch is None:
        chosen_by, status = "none", "no kernel"
    else:
        ours_us, err, status = check_and_time(p, launch, sets, ref, ws.timing)
    del sets, ref
    torch.cuda.empty_cache()
    tf = lambda us: None if not us else p.flops / (us * 1e-6) / 1e12  # noqa: E731
    gb = lambda us: None if not us else p.bytes_moved / (us * 1e-6) / 1e9  # noqa: E731
    return BenchRow(
        **base, launch=launch.name if launch else None, chosen_by=chosen_by, ours_us=ours_us,
        cudnn_us=cudnn.median_us, ours_tflops=tf(ours_us), cudnn_tflops=tf(cudnn.median_us), ours_gbs=gb(ours_us),
        cudnn_gbs=gb(cudnn.median_us), ratio=(cudnn.median_us / ours_us) if ours_us else None, max_error=err,
        status=status, tune_us=dec.time_us if dec else None, tune_cudnn_us=dec.cudnn_us if dec else None,
        tune_ratio=dec.cudnn_us / dec.time_us if dec and dec.cudnn_us and dec.time_us else None,
    )


def bench_workload(items: Sequence[WorkloadItem], *, progress: bool = False, settings=None) -> BenchReport:
    """One row per workload item (needs a CUDA GPU and PyTorch with cuDNN)."""
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise RuntimeError("bench needs a CUDA GPU: no device is visible to PyTorch")
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False  # fp16 convs are unaffected; keeps the fp32 reference exact
    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=len(items), desc="bench", unit="problem")
    rows = []
    for it in items:
        rows.append(bench_item(it, settings))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return BenchReport(tuple(rows), torch.cuda.get_device_name(), torch.__version__, torch.backends.cudnn.version())
