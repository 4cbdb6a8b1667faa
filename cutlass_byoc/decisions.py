"""The decision cache: which launch won the profiler for a problem on a GPU, persistent and shared by processes.

A decision is keyed by everything that can change the answer (`DecisionKey`): the problem as a whole
(`Conv2dProblem.to_dict()`: sizes, conv parameters, element and accumulator types, epilogue), the GPU's name
and compute capability, CUTLASS's version, a hash of the kernel templates' text, and `DECISIONS_FORMAT`.
Changing any one of them gives a different key, so stale entries are never found (they are not deleted
either: `cutlass-byoc cache clear --decisions` does that).

Layout under the kernel cache's root::

    decisions/<key[:2]>/<key>.json   one decision: the key's fields, the chosen launch, its time, the runner-up
    locks/decision-<key>.lock        held while a process writes that key

Writes go to a temporary file in the same directory and are renamed into place (atomic on POSIX), under a
per-key file lock: a reader sees the old decision or the new one, never a torn file, and concurrent writers
of one key leave one of their decisions, whole.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Iterator, Optional

import filelock

from .cache import cache_root
from .trust import ensure_trusted_root, make_private_dir
from .config import LaunchConfig
from .problem import Conv2dProblem

log = logging.getLogger("cutlass_byoc.decisions")

#: Bump when the decision format or the meaning of a key changes: older decisions are then ignored.
DECISIONS_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """The device a decision was measured on."""

    name: str
    arch: int  # compute capability as 90

    @property
    def tag(self) -> str:
        return f"{self.name} (sm_{self.arch})"


@functools.lru_cache(maxsize=None)
def current_gpu() -> Optional[GpuInfo]:
    """The current CUDA device, or None on a machine without one (or without a working driver). Asked once per
    process."""
    try:
        from .runtime import device_properties  # noqa: PLC0415

        name, arch, _ = device_properties()
    except Exception as e:  # noqa: BLE001 - no driver, no device, no cuda-python: all mean "no GPU here"
        log.debug("no CUDA device: %s", e)
        return None
    return GpuInfo(name, arch)


#: The depthwise family's own template: the only family that computes depthwise problems, and it computes nothing else.
DEPTHWISE_TEMPLATE = "conv2d_depthwise_direct.cu.j2"


#: What a template pulls in: {% include "X" %}, {% import "X" ... %} and {% from "X" import ... %}.
_TEMPLATE_DEPENDENCY = re.compile(r"""\{%-?\s*(?:include|import|from)\s+["']([^"']+)["']""")


@functools.lru_cache(maxsize=None)
def template_hash(depthwise: bool = False) -> str:
    """sha256 over the text of the kernel templates whose kernels compete for a problem: for a depthwise problem
    (groups == C == K) the depthwise family's template, for any other problem every other template; each with the
    templates it includes (followed through their includes). An edit of a template invalidates the decisions it could
    have changed, and only those (tuning the depthwise kernels leaves a model's dense decisions standing, and the
    other way round; the launch memo, included by the dense families only, is theirs)."""
    root = resources.files("cutlass_byoc.templates")
    texts = {e.name: e.read_bytes() for e in root.iterdir() if e.name.endswith(".j2")}
    todo = [n for n in texts if n.endswith(".cu.j2") and (n == DEPTHWISE_TEMPLATE) == depthwise]
    used: set[str] = set()
    while todo:
        name = todo.pop()
        if name in used or name not in texts:
            continue
        used.add(name)
        todo += _TEMPLATE_DEPENDENCY.findall(texts[name].decode())
    h = hashlib.sha256()
    for name in sorted(used):
        h.update(name.encode() + b"\0" + texts[name] + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _cutlass_version() -> str:
    from .toolchain import cutlass_version  # noqa: PLC0415

    return cutlass_version()


@dataclasses.dataclass(frozen=True)
class DecisionKey:
    problem: Conv2dProblem
    gpu_name: str
    gpu_arch: int
    cutlass_version: str
    template_hash: str
    format: int = DECISIONS_FORMAT

    @classmethod
    def for_problem(cls, problem: Conv2dProblem, gpu: GpuInfo) -> "DecisionKey":
        return cls(problem, gpu.name, gpu.arch, _cutlass_version(), template_hash(problem.is_depthwise))

    def fields(self) -> dict:
        return {
            "format": self.format, "problem": self.problem.to_dict(), "gpu_name": self.gpu_name,
            "gpu_arch": self.gpu_arch, "cutlass_version": self.cutlass_version, "template_hash": self.template_hash,
        }

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields(), sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Decision:
    key: DecisionKey
    launch: LaunchConfig
    time_us: float
    candidates_timed: int = 0
    runner_up: Optional[str] = None
    runner_up_us: Optional[float] = None
    max_error: Optional[float] = None
    recorded_at: float = 0.0
    #: cuDNN's time for the problem, measured with the candidates (None: not measured). Where it is below `time_us`
    #: the partitioner leaves the conv to PyTorch (select.cudnn_faster).
    cudnn_us: Optional[float] = None
    #: The problem's pass measured inside a model's compiled step (`cutlass-byoc tune --model ... --in-step`,
    #: offload.step_times): the median GPU time of its calls there on `launch` and on cuDNN, with the neighbouring
    #: kernels and the cache state of the step, not the tune's operands rotated through more than L2. Where both are
    #: set they, not `time_us` and `cudnn_us`, decide whether cuDNN is faster (select.cudnn_faster). None: not measured.
    step_us: Optional[float] = None
    step_cudnn_us: Optional[float] = None
    #: what the step measurement ran in (e.g. "torchvision:resnet50 b32 training fp16")
    step_model: Optional[str] = None

    def to_dict(self) -> dict:
        return {
            **self.key.fields(), "digest": self.key.digest, "launch": self.launch.to_dict(),
            "launch_name": self.launch.name, "time_us": self.time_us, "candidates_timed": self.candidates_timed,
            "runner_up": self.runner_up, "runner_up_us": self.runner_up_us, "max_error": self.max_error,
            "recorded_at": self.recorded_at, "cudnn_us": self.cudnn_us,
            **({"step_us": self.step_us, "step_cudnn_us": self.step_cudnn_us, "step_model": self.step_model}
               if self.step_us is not None or self.step_cudnn_us is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Decision":
        key = DecisionKey(
            Conv2dProblem.from_dict(d["problem"]), d["gpu_name"], int(d["gpu_arch"]), d["cutlass_version"],
            d["template_hash"], int(d["format"]),
        )
        return cls(
            key, LaunchConfig.from_dict(d["launch"]), float(d["time_us"]), int(d.get("candidates_timed", 0)),
            d.get("runner_up"), d.get("runner_up_us"), d.get("max_error"), float(d.get("recorded_at", 0.0)),
            d.get("cudnn_us"), _opt_float(d.get("step_us")), _opt_float(d.get("step_cudnn_us")),
            d.get("step_model"),
        )

    @property
    def in_step(self) -> bool:
        """Both times of the in-step measurement are recorded."""
        return self.step_us is not None and self.step_cudnn_us is not None


def _opt_float(v) -> Optional[float]:
    return None if v is None else float(v)


_generation = 0


def generation() -> int:
    """Bumped by every decision written or cleared in this process: memos of choices key on it."""
    return _generation


def _bump() -> None:
    global _generation
    _generation += 1


class DecisionStore:
    """Decisions as one JSON file per key under `<root>/decisions`. Like KernelCache, it creates its folders 0700
    and refuses a cache root that is not the user's alone (trust.py)."""

    def __init__(self, root: Optional[Path] = None):
        self.root = make_private_dir(Path(root)) if root else cache_root()
        ensure_trusted_root(self.root)  # before anything is read or written under it
        self.dir = make_private_dir(self.root / "decisions")
        make_private_dir(self.root / "locks")
        self._memo: dict[str, tuple[tuple[int, int, int], Optional[Decision]]] = {}

    def path(self, digest: str) -> Path:
        return self.dir / digest[:2] / f"{digest}.json"

    def _lock(self, digest: str) -> filelock.FileLock:
        return filelock.FileLock(str(self.root / "locks" / f"decision-{digest}.lock"))

    def lookup(self, key: DecisionKey) -> Optional[Decision]:
        p = self.path(key.digest)
        try:
            st = p.stat()
            stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
        except FileNotFoundError:
            return None
        memo = self._memo.get(key.digest)
        if memo is not None and memo[0] == stamp:  # unchanged since last read: no parsing on the launch path
            return memo[1]
        dec = self._read(p, key)
        self._memo[key.digest] = (stamp, dec)
        return dec

    def _read(self, p: Path, key: DecisionKey) -> Optional[Decision]:
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable decision %s: %s", p, e)
            return None
        if d.get("format") != DECISIONS_FORMAT:
            return None
        try:
            dec = Decision.from_dict(d)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("ignoring malformed decision %s: %s", p, e)
            return None
        if dec.key != key:  # a hash collision or a hand-edited file: never trust it
            log.warning("ignoring decision %s: its fields do not match the key", p)
            return None
        if dec.launch.reject_reason(key.problem) is not None:
            log.warning("ignoring decision %s: %s", p, dec.launch.reject_reason(key.problem))
            return None
        return dec

    def record(self, decision: Decision) -> Path:
        digest = decision.key.digest
        p = self.path(digest)
        make_private_dir(p.parent)
        text = json.dumps(decision.to_dict(), indent=1, sort_keys=True)
        with self._lock(digest):
            fd, tmp = tempfile.mkstemp(prefix=f".{digest[:16]}-", suffix=".tmp", dir=p.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, p)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        _bump()
        return p

    def iter_files(self) -> Iterator[Path]:
        yield from sorted(self.dir.glob("*/*.json"))

    def entries(self) -> Iterator[tuple[Path, Optional[Decision], Optional[str]]]:
        """(file, decision or None, why it is unusable or None) for every file: current ones and stale ones."""
        for p in self.iter_files():
            try:
                d = json.loads(p.read_text())
                if d.get("format") != DECISIONS_FORMAT:
                    yield p, None, f"format {d.get('format')} (this version reads {DECISIONS_FORMAT})"
                    continue
                yield p, Decision.from_dict(d), None
            except (OSError, ValueError, KeyError, TypeError) as e:
                yield p, None, f"unreadable: {e}"

    def find(self, prefix: str) -> list[Path]:
        return [p for p in self.iter_files() if p.stem.startswith(prefix)]

    def clear(self) -> int:
        n = 0
        for p in list(self.iter_files()):
            p.unlink(missing_ok=True)
            n += 1
        _bump()
        return n

    def import_file(self, src: Path, *, overwrite: bool = False) -> bool:
        """Copy one exported decision file in (validated, atomically). False if skipped."""
        return self.import_decision(Decision.from_dict(json.loads(Path(src).read_text())), overwrite=overwrite)

    def import_decision(self, dec: Decision, *, overwrite: bool = False) -> bool:
        """Record a decision made elsewhere unless one exists for its key (or `overwrite`). False if skipped."""
        if not overwrite and self.path(dec.key.digest).exists():
            return False
        self.record(dec)
        return True


_stores: dict[Path, DecisionStore] = {}


def default_store() -> DecisionStore:
    """The store under the current cache root (one instance per root and process, so its memo is shared)."""
    root = cache_root()
    st = _stores.get(root)
    if st is None:
        st = _stores.setdefault(root, DecisionStore(root))
    return st


def lookup_decision(problem: Conv2dProblem, *, gpu: Optional[GpuInfo] = None,
                    store: Optional[DecisionStore] = None) -> Optional[LaunchConfig]:
    """The recorded launch for `problem` on `gpu` (default: the current device), or None."""
    dec = lookup(problem, gpu=gpu, store=store)
    return dec.launch if dec else None


def lookup(problem: Conv2dProblem, *, gpu: Optional[GpuInfo] = None,
           store: Optional[DecisionStore] = None) -> Optional[Decision]:
    """The full recorded decision (launch, time, runner-up) for `problem` on `gpu`, or None."""
    gpu = gpu or current_gpu()
    if gpu is None:
        return None
    return (store or default_store()).lookup(DecisionKey.for_problem(problem, gpu))


def differs(key: DecisionKey, current: DecisionKey) -> str:
    """What makes a decision recorded under `key` unusable where `current` is looked up, in words ('' if nothing)."""
    why = []
    if (key.gpu_name, key.gpu_arch) != (current.gpu_name, current.gpu_arch):
        why.append(f"tuned on {key.gpu_name} (sm_{key.gpu_arch})")
    if key.cutlass_version != current.cutlass_version:
        why.append(f"CUTLASS {key.cutlass_version}")
    if key.template_hash != current.template_hash:
        why.append("other kernel templates")
    if key.format != current.format:
        why.append(f"decision format {key.format}")
    return ", ".join(why)


def decisions_elsewhere(problems, *, gpu: Optional[GpuInfo] = None,
                        store: Optional[DecisionStore] = None) -> dict[str, list[Conv2dProblem]]:
    """For the `problems` without a decision for `gpu` (default: the current device), the decisions the store holds
    for them under another key (another GPU, CUTLASS version, template set or format), grouped by what differs:
    {"tuned on NVIDIA H200 (sm_90)": [problem, ...]}. Such decisions are never used (a launch tuned for one GPU or one
    template set is no measurement of another); the backend names them so that a user whose cache came from another
    machine, or from before an upgrade, knows the model runs untuned. Reads every decision file: call it only where
    problems were found untuned."""
    gpu = gpu or current_gpu()
    if gpu is None:
        return {}
    st = store or default_store()
    wanted = {p: DecisionKey.for_problem(p, gpu) for p in dict.fromkeys(problems)}
    wanted = {p: k for p, k in wanted.items() if st.lookup(k) is None}
    out: dict[str, list[Conv2dProblem]] = {}
    if not wanted:
        return out
    for _, dec, _ in st.entries():
        current = wanted.get(dec.key.problem) if dec is not None else None
        why = differs(dec.key, current) if current is not None else ""
        if why and dec.key.problem not in out.setdefault(why, []):
            out[why].append(dec.key.problem)
    return {k: v for k, v in out.items() if v}


def record_decision(
    problem: Conv2dProblem, launch: LaunchConfig, time_us: float, *, gpu: Optional[GpuInfo] = None,
    store: Optional[DecisionStore] = None, candidates_timed: int = 0, runner_up: Optional[str] = None,
    runner_up_us: Optional[float] = None, max_error: Optional[float] = None, cudnn_us: Optional[float] = None,
) -> Decision:
    """Store `launch` as the decision for `problem` on `gpu` (default: the current device)."""
    gpu = gpu or current_gpu()
    if gpu is None:
        raise RuntimeError("record_decision: no CUDA device; pass gpu= to record a decision measured elsewhere")
    why = launch.reject_reason(problem)
    if why:
        raise ValueError(f"record_decision: {launch.name} cannot compute {problem.name}: {why}")
    dec = Decision(DecisionKey.for_problem(problem, gpu), launch, float(time_us), candidates_timed, runner_up,
                   runner_up_us, max_error, time.time(), cudnn_us)
    (store or default_store()).record(dec)
    return dec


def record_step_times(problem: Conv2dProblem, launch_name: str, step_us: float, step_cudnn_us: float, model: str,
                      *, gpu: Optional[GpuInfo] = None, store: Optional[DecisionStore] = None) -> Optional[Decision]:
    """Add a pass's in-step times (Decision.step_us, step_cudnn_us) to the recorded decision of `problem`, if that
    decision's launch is `launch_name` (the one that ran in the step). None, nothing written, otherwise: no decision,
    or one recorded since with another launch, whose step times would be another kernel's."""
    gpu = gpu or current_gpu()
    if gpu is None:
        raise RuntimeError("record_step_times: no CUDA device; pass gpu= to record times measured elsewhere")
    for name, v in (("step_us", step_us), ("step_cudnn_us", step_cudnn_us)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"record_step_times: {name} must be a finite time > 0 us, got {v!r}")
    st = store or default_store()
    dec = lookup(problem, gpu=gpu, store=st)
    if dec is None or dec.launch.name != launch_name:
        return None
    dec = dataclasses.replace(dec, step_us=float(step_us), step_cudnn_us=float(step_cudnn_us), step_model=model)
    st.record(dec)
    return dec
