"""GPU timing with CUDA events: warm-up, inputs rotated through more memory than L2 holds, median of many runs.

`time_gpu(fn, rotations)` calls ``fn(i)`` for i = 0, 1, ... and ``fn`` is expected to run on operand set
``i % rotations``; the caller sizes the sets (`rotation_count`) so that one pass over them moves more than
twice the L2 cache (60 MB on H200), so no run finds its inputs in L2 from the run before.

Each run is bracketed by its own pair of events. Before the timed runs a spin kernel (``torch.cuda._sleep``)
holds the GPU while the CPU enqueues all runs, so the events measure the GPU's time only, not Python's launch
overhead (which for a 10 us kernel would otherwise dominate). The spin is sized from the warm-up's host time per run,
the per-run events included; an event recorded right behind it tells whether it ended before the last run was
enqueued (the GPU may then have waited on the host inside a run's events), and if so the runs are timed again behind
a spin twice as long (`MAX_SPIN_TRIES`). The same function times cuDNN in `bench`, so both sides are measured alike.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable

DEFAULT_L2_BYTES = 60 * 1024 * 1024  # H200 (used when the device does not report its L2 size)
MAX_ROTATIONS = 32
GPU_CYCLES_PER_US = 1980.0  # H200 boost clock; only sizes the spin that keeps the queue full
MAX_SPIN_US = 200_000.0
SPIN_MARGIN = 1.5  # the first spin: this many times the warm-up's host time per run
MAX_SPIN_TRIES = 3  # timed passes at most, each behind a spin twice the last one's, while the spin ran out early


@dataclasses.dataclass(frozen=True)
class TimingSettings:
    warmup: int = 5
    min_iters: int = 20
    max_iters: int = 100
    target_ms: float = 15.0  # timed GPU time per candidate; more runs for fast kernels, up to max_iters
    l2_multiple: float = 2.0  # one pass over the rotated operand sets moves this many times L2


@dataclasses.dataclass(frozen=True)
class TimingStats:
    median_us: float
    min_us: float
    mean_us: float
    stdev_us: float
    iters: int
    rotations: int
    #: timed passes repeated because the spin ended before the host had enqueued every run (0: the first held)
    spin_retries: int = 0
    #: the last pass's spin also ended before its last run was enqueued: its runs may include host time
    host_bound: bool = False

    @property
    def valid(self) -> bool:
        return math.isfinite(self.median_us) and self.median_us > 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def l2_bytes() -> int:
    import torch  # noqa: PLC0415

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def rotation_count(set_bytes: int, l2: int | None = None, multiple: float = 2.0) -> int:
    """How many operand sets one pass must cycle through to move `multiple` x L2."""
    l2 = DEFAULT_L2_BYTES if l2 is None else l2
    return max(1, min(MAX_ROTATIONS, math.ceil(multiple * l2 / max(1, set_bytes))))


def _spin(us: float) -> None:
    import torch  # noqa: PLC0415

    if us > 0:
        torch.cuda._sleep(int(min(us, MAX_SPIN_US) * GPU_CYCLES_PER_US))


def time_gpu(fn: Callable[[int], None], rotations: int, settings: TimingSettings = TimingSettings()) -> TimingStats:
    """Median (and more) microseconds of ``fn`` on the current stream."""
    import torch  # noqa: PLC0415

    fn(0)  # first call untimed and unmeasured: module loads, cudnn.benchmark's search, workspace growth
    torch.cuda.synchronize()
    i = 1
    # Warm-up, which also estimates the CPU and GPU cost of one run. Each run is bracketed by a pair of events as in
    # the timed loop, so the host time per run counts their records too (for a cheap `fn`, a large part of it).
    w0, w1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    m0, m1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    w0.record()
    t0 = time.perf_counter()
    for _ in range(max(1, settings.warmup)):
        m0.record()
        fn(i % rotations)
        m1.record()
        i += 1
    cpu_us = (time.perf_counter() - t0) * 1e6 / max(1, settings.warmup)
    w1.record()
    torch.cuda.synchronize()
    gpu_us = max(1e-3, w0.elapsed_time(w1) * 1000.0 / max(1, settings.warmup))
    iters = int(min(settings.max_iters, max(settings.min_iters, math.ceil(settings.target_ms * 1000.0 / gpu_us))))
    iters = max(iters, min(rotations, settings.max_iters))  # every operand set at least once where affordable

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    spun = torch.cuda.Event()
    spin_us = SPIN_MARGIN * cpu_us * iters
    for tries in range(MAX_SPIN_TRIES):
        _spin(spin_us)  # GPU busy while the CPU enqueues: the events then see back-to-back runs
        spun.record()  # reached when the spin ends
        for j in range(iters):
            starts[j].record()
            fn(i % rotations)
            ends[j].record()
            i += 1
        ran_out = spun.query()  # the spin had ended before the last run was enqueued
        torch.cuda.synchronize()
        if not ran_out or spin_us >= MAX_SPIN_US:  # held, or no longer spin to try (_spin caps it)
            break
        spin_us = min(2.0 * spin_us, MAX_SPIN_US)
    times = [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]
    return TimingStats(
        median_us=statistics.median(times), min_us=min(times), mean_us=statistics.fmean(times),
        stdev_us=statistics.pstdev(times), iters=iters, rotations=rotations, spin_retries=tries, host_bound=ran_out,
    )
