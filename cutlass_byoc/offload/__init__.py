"""Offload of conv2d from PyTorch FX graphs to cutlass-byoc kernels (the `cutlass_byoc` torch.compile backend).

Modules: library (the torch.library custom ops), patterns (pattern table and predicates), partition (the matcher
and rewriter), report (what was offloaded and why not), backend (the torch.compile backend), trace (aten graphs of a
model on fake tensors, and explain: what would be offloaded), bench (training-step benchmark against eager and
Inductor).
"""

from .backend import cutlass_byoc_backend, last_report, make_backend, reports
from .partition import partition
from .patterns import OffloadOptions
from .report import OffloadEntry, OffloadReport, Pass
from .trace import explain, trace

__all__ = ["cutlass_byoc_backend", "last_report", "make_backend", "reports", "partition", "OffloadOptions",
           "OffloadEntry", "OffloadReport", "Pass", "explain", "trace"]
