"""Shared fixtures. GPU tests (marker `gpu`) skip with a reason where no CUDA GPU of compute capability 9.0 is
visible; compile tests (marker `compile`) skip where nvcc or the CUTLASS headers are missing."""

from __future__ import annotations

import functools
import os

import pytest


@functools.lru_cache(maxsize=None)
def gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs PyTorch with CUDA (pip install 'cutlass-byoc[torch]')"
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU: torch.cuda.is_available() is False on this machine (GPU tests run on the H200)"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"needs compute capability 9.0 (kernels are built for sm_90a), found {major}.{minor}"
    return None


@functools.lru_cache(maxsize=None)
def compile_skip_reason() -> str | None:
    from cutlass_byoc.toolchain import ToolchainError, toolchain

    try:
        toolchain()
    except ToolchainError as e:
        return str(e)
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and gpu_skip_reason():
            item.add_marker(pytest.mark.skip(reason=gpu_skip_reason()))
        if "compile" in item.keywords and compile_skip_reason():
            item.add_marker(pytest.mark.skip(reason=compile_skip_reason()))


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """A fresh, private kernel cache (and decision cache) for one test."""
    from cutlass_byoc.cache import KernelCache

    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(tmp_path / "cache"))
    return KernelCache(tmp_path / "cache")


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory):
    """One kernel cache for the whole session (compile-only and GPU tests share their builds). Honours
    CUTLASS_BYOC_CACHE_DIR so a warm cache can be reused across runs."""
    from cutlass_byoc.cache import KernelCache

    root = os.environ.get("CUTLASS_BYOC_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("kernel-cache"))
    return KernelCache(root)
