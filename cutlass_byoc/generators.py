"""cutlass_library's kernel generators, as the candidate modules (2.x conv, 3.x conv, 3.x GEMM) use them: the module
imported safely, and the stand-in for the manifest the generators append their operations to."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Optional


def generator_module() -> ModuleType:
    """cutlass_library.generator, imported with a bare sys.argv: at import it runs argparse's parse_known_args() on
    the process's arguments, so a `--h 56` of our CLI would be read as its `--help` (and exit)."""
    if "cutlass_library.generator" not in sys.modules:
        saved, sys.argv = sys.argv, sys.argv[:1]
        try:
            import cutlass_library.generator  # noqa: F401, PLC0415
        finally:
            sys.argv = saved
    return sys.modules["cutlass_library.generator"]


class Collector:
    """The manifest interface cutlass_library's generators append to. `level`: what get_instantiation_level
    answers; None gives the generator's own default level (the 3.x GEMM generator needs an int, and "0" breaks it;
    the conv generators take "0")."""

    def __init__(self, level: Optional[str] = "0") -> None:
        self.operations: list = []
        self.kernel_filter = "*"  # non-empty, else the generators keep only their first tile
        self.level = level

    def append(self, op) -> None:
        self.operations.append(op)

    def get_instantiation_level(self, pruned_level=0, default_level=111, exhaustive_level=9992):
        return default_level if self.level is None else self.level
