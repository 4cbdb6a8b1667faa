"""Profile-and-select: candidates, parallel compile, GPU timing with verification, decision cache (installed as cutlass_byoc.profiler)."""
