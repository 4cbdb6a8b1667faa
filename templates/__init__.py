"""Jinja templates of the generated CUDA sources, one per kernel family (installed as cutlass_byoc.templates)."""
