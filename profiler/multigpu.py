"""Timing spread over several GPUs of one host (`cutlass-byoc tune --gpus all|0,1`).

The compile step stays one parallel build for the whole workload (tune.py); only timing is spread. One
`CandidateRunner` (one crash-isolated worker process that sees only its GPU: CUDA_VISIBLE_DEVICES, so it runs
exactly as in a one-GPU run) is started per GPU, the runners are started concurrently (each pays CUDA's start-up),
and one parent thread per runner pulls the next problem from a shared feed (feed.py: the build fills it as kernels
compile; the runners block on their pipes, not on the GIL), so a GPU that draws slow problems simply takes fewer of
them. Results are handed to the caller one problem at a time under a lock, so recording
decisions and writing the log need no locking of their own.

A decision is keyed by the GPU's name and compute capability, so every GPU of one run must be the same model:
the GPUs are probed before anything is compiled, and each worker's own report (its "hello") is checked again
before it times anything; a mix is refused with a message naming both devices.

Scaling: each GPU's busy time (its `evaluate` calls) is measured; their sum is what one GPU would have spent, so
``sum(busy) / wall`` estimates the speed-up over one GPU (reported next to the wall time; for a measured
comparison run `tune --gpus 0 --force` and `tune --gpus all --force` on the same warm cache).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Callable, Optional, Sequence

from ..decisions import GpuInfo
from .feed import ProblemFeed
from .worker import WorkerError

log = logging.getLogger("cutlass_byoc.profiler.multigpu")


class GpuSelectionError(ValueError):
    """A --gpus value that cannot be used; the message says why."""


def visible_gpu_count() -> int:
    """CUDA devices this process can see (honours CUDA_VISIBLE_DEVICES); 0 without a driver or device."""
    try:
        from cuda.bindings import runtime as rt  # noqa: PLC0415

        err, n = rt.cudaGetDeviceCount()
        if err == rt.cudaError_t.cudaSuccess:
            return int(n)
        return 0
    except Exception:  # noqa: BLE001 - no cuda-python: ask PyTorch
        pass
    try:
        import torch  # noqa: PLC0415

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def _visible_note() -> str:
    v = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={v})" if v is not None else ""


def visible_device(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of this process's device `index` (for a worker that should see only it)."""
    v = os.environ.get("CUDA_VISIBLE_DEVICES")
    if v is not None and v.strip():
        entries = [e.strip() for e in v.split(",") if e.strip()]
        if index < len(entries):
            return entries[index]
    return str(index)


def parse_gpus(spec: str, count: int) -> list[int]:
    """Device indices of a --gpus value: "all" (every visible GPU, possibly none) or a comma list "0,1".

    Indices are those PyTorch and CUDA use in this process (after CUDA_VISIBLE_DEVICES)."""
    s = (spec or "").strip().lower()
    if s == "all":
        return list(range(count))
    if not s:
        raise GpuSelectionError("--gpus: expected 'all' or a comma list of device indices such as 0,1")
    out: list[int] = []
    for part in s.split(","):
        part = part.strip()
        try:
            i = int(part)
        except ValueError:
            raise GpuSelectionError(
                f"--gpus {spec}: {part!r} is not a device index; expected 'all' or a comma list such as 0,1"
            ) from None
        if i < 0:
            raise GpuSelectionError(f"--gpus {spec}: device index {i} is negative")
        if i in out:
            raise GpuSelectionError(f"--gpus {spec}: device {i} is listed twice")
        if i >= count:
            seen = "no CUDA device is visible" if count == 0 else (
                f"{count} CUDA device{'s are' if count != 1 else ' is'} visible (indices 0..{count - 1})")
            raise GpuSelectionError(f"--gpus {spec}: there is no GPU {i}: {seen}{_visible_note()}")
        out.append(i)
    return out


def probe_gpus(devices: Sequence[int]) -> list[GpuInfo]:
    """Name and compute capability of each device (through cuda-python, without making it current)."""
    try:
        from cuda.bindings import runtime as rt  # noqa: PLC0415
    except ImportError as e:
        raise GpuSelectionError(f"cannot query the GPUs: cuda-python is missing ({e})") from None

    out = []
    for d in devices:
        err, prop = rt.cudaGetDeviceProperties(d)
        if err != rt.cudaError_t.cudaSuccess:
            raise GpuSelectionError(f"GPU {d}: cudaGetDeviceProperties failed: {err}{_visible_note()}")
        name = prop.name.decode() if isinstance(prop.name, bytes) else str(prop.name)
        out.append(GpuInfo(name.rstrip("\x00"), prop.major * 10 + prop.minor))
    return out


def mixed_gpu_message(devices: Sequence[int], gpus: Sequence[GpuInfo]) -> Optional[str]:
    """None if every device is the same GPU model (name and arch), else the refusal naming two that differ."""
    if not gpus:
        return None
    first = gpus[0]
    for d, g in zip(devices, gpus):
        if (g.name, g.arch) != (first.name, first.arch):
            return (f"--gpus: GPU {devices[0]} is {first.tag} but GPU {d} is {g.tag}. Decisions are keyed by the "
                    f"GPU's name and arch, so one tuning run times on one GPU model only: pass --gpus with the "
                    f"indices of identical GPUs (and run once more for the others)")
    return None


@dataclasses.dataclass
class GpuTiming:
    """What one GPU's worker did in a multi-GPU run."""

    device: int
    gpu: Optional[str] = None  # as the worker reported it
    problems: int = 0
    busy_s: float = 0.0
    restarts: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def time_on_gpus(
    devices: Sequence[int],
    settings,
    problems: "Sequence | ProblemFeed",
    evaluate: Callable[[object, object], list],
    finish: Callable[[object, list], None],
    runner_factory: Callable,
) -> list[GpuTiming]:
    """Run `evaluate(runner, problem)` for every problem on one runner per device, then `finish(problem, results)`
    (serialised). `problems`: a list, timed in its order, or a `ProblemFeed` that the build is still filling (each
    runner takes the next ready problem until the feed ends). Raises GpuSelectionError on a mix of GPU models (before
    timing anything) and re-raises the first error of a runner (after stopping the others and aborting the feed)."""
    feed = problems if isinstance(problems, ProblemFeed) else ProblemFeed.of(problems)
    stats = [GpuTiming(d) for d in devices]
    runners: list = [None] * len(devices)
    errors: list[tuple[int, BaseException]] = []

    def start(i: int) -> None:
        try:
            r = runner_factory(dataclasses.replace(settings, device=devices[i],
                                                   visible_device=visible_device(devices[i])))
            r.__enter__()
            runners[i] = r
        except BaseException as e:  # noqa: BLE001 - reported after every start attempt
            errors.append((devices[i], e))

    try:
        starters = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(len(devices))]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if errors:
            d, e = errors[0]
            if isinstance(e, WorkerError):
                raise WorkerError(f"the tuning worker of GPU {d}: {e}") from e
            raise e
        reported = []
        for i, r in enumerate(runners):
            g = getattr(r, "gpu", None)
            if g is not None:
                stats[i].gpu = f"{g[0]} (sm_{g[1]})"
                reported.append(GpuInfo(g[0], int(g[1])))
        if len(reported) == len(devices):
            msg = mixed_gpu_message(devices, reported)
            if msg:
                raise GpuSelectionError(msg)

        lock = threading.Lock()
        stop = threading.Event()

        def loop(i: int) -> None:
            r = runners[i]
            while not stop.is_set():
                p = feed.get()
                if p is None:
                    return
                try:
                    t0 = time.perf_counter()
                    results = evaluate(r, p)
                    stats[i].busy_s += time.perf_counter() - t0
                    stats[i].problems += 1
                    with lock:
                        finish(p, results)
                except BaseException as e:  # noqa: BLE001
                    errors.append((devices[i], e))
                    stop.set()
                    feed.abort()  # wakes the runners waiting for a problem
                    return

        threads = [threading.Thread(target=loop, args=(i,), name=f"cutlass-byoc-gpu{devices[i]}", daemon=True)
                   for i in range(len(devices))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0][1]
        for i, r in enumerate(runners):
            stats[i].restarts = getattr(r, "restarts", 0)
        log.info("timed %d problems on %d GPUs: %s", sum(s.problems for s in stats), len(devices),
                 ", ".join(f"GPU {s.device}: {s.problems} problems, {s.busy_s:.1f} s" for s in stats))
        return stats
    finally:
        for r in runners:
            if r is not None:
                try:
                    r.__exit__(None, None, None)
                except Exception as e:  # noqa: BLE001
                    log.debug("closing a runner: %s", e)
