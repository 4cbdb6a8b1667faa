"""Choose the launch for a problem: the profiler's recorded decision if there is one, else the model's default."""

from __future__ import annotations

import enum
import logging
from typing import Optional

from .config import LaunchConfig
from .cache import cache_root_path
from .decisions import generation, lookup_decision
from .heuristics import default_launch
from .problem import Conv2dProblem

log = logging.getLogger("cutlass_byoc.select")


class SelectMode(str, enum.Enum):
    HEURISTIC = "heuristic"  # the analytic model's pick; never profiles
    CACHED = "cached"  # a recorded decision if one exists, else the model's pick
    TUNE = "tune"  # profile now if no decision is recorded (needs a GPU)


_chosen: dict[tuple, Optional[LaunchConfig]] = {}


def choose(problem: Conv2dProblem, mode: SelectMode | str = SelectMode.CACHED) -> Optional[LaunchConfig]:
    """The launch to use for `problem`, or None when no kernel of this project can compute it.

    Remembered per (problem, mode, cache root) until a decision is written or cleared in this process: choosing
    ranks every candidate and hashes the decision key, far too slow for each call of a training step."""
    mode = SelectMode(mode)
    key = (problem, mode, cache_root_path(), generation())
    if key not in _chosen:
        _chosen[key] = _choose(problem, mode)
    return _chosen[key]


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
