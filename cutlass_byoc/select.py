"""Choose the launch for a problem: the profiler's recorded decision if there is one, else the model's default."""

from __future__ import annotations

import enum
import logging
from typing import Optional

from .config import LaunchConfig
from .heuristics import default_launch
from .problem import Conv2dProblem

log = logging.getLogger("cutlass_byoc.select")


class SelectMode(str, enum.Enum):
    HEURISTIC = "heuristic"  # the analytic model's pick; never profiles
    CACHED = "cached"  # a recorded decision if one exists, else the model's pick
    TUNE = "tune"  # profile now if no decision is recorded (needs a GPU)


def choose(problem: Conv2dProblem, mode: SelectMode | str = SelectMode.CACHED) -> Optional[LaunchConfig]:
    """The launch to use for `problem`, or None when no kernel of this project can compute it."""
    mode = SelectMode(mode)
    if mode is not SelectMode.HEURISTIC:
        try:
            from .decisions import lookup_decision  # noqa: PLC0415
        except ImportError:  # no decision cache in this build
            lookup_decision = None
        if lookup_decision is not None:
            hit = lookup_decision(problem)
            if hit is not None:
                return hit
            if mode is SelectMode.TUNE:
                from .profiler.tune import tune_problem  # noqa: PLC0415

                won = tune_problem(problem)
                if won is not None:
                    return won
    return default_launch(problem)
