"""Helpers of the compile-only tests: the checks every built kernel gets, and the compiled library's own
can_implement below the Python rules."""

from __future__ import annotations

import ctypes
from typing import Optional

from cutlass_byoc.config import KernelConfig
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.runtime import KernelLibrary, make_args


def loaded_kernel(result, cfg: KernelConfig, problem: Conv2dProblem) -> tuple[str, KernelLibrary]:
    """(generated source, loaded library) of a build result, after the checks every compile-only test makes: it
    built, its source opens with the config's name and records the sm_90a compile command, the library holds exactly
    this config (KernelLibrary checks the ABI and the config), and it takes `problem`."""
    assert result.ok, result.error_report()
    src = result.entry.source.read_text()
    assert src.startswith(f"// {cfg.name}\n")
    assert "// Compile: nvcc " in src and "-gencode=arch=compute_90a,code=sm_90a" in src
    lib = KernelLibrary(cfg, result.library)
    assert lib.can_implement(problem) is None
    return src, lib


def raw_can_implement(lib: KernelLibrary, problem: Conv2dProblem, slices: int = 1, source_kind=None, fields=None,
                      **ptrs) -> Optional[str]:
    """The compiled kernel's own cb_can_implement (KernelLibrary.can_implement asks the Python rules first): None, or
    its message. `fields` overrides arguments of the struct, `ptrs` the addresses (a, b, d, source; by default
    distinct, 16-byte aligned and non-null, the source only where the problem's epilogue has one)."""
    p = dict(a=0x10000, b=0x20000, d=0x30000, source=0x40000 if problem.epilogue.source.value != "none" else 0)
    p.update(ptrs)
    args = make_args(problem, slices, p["a"], p["b"], p["d"], p["source"])
    if source_kind is not None:
        args.source_kind = source_kind
    for name, value in (fields or {}).items():
        setattr(args, name, value)
    msg = ctypes.create_string_buffer(512)
    rc = lib._lib.cb_can_implement(ctypes.byref(args), msg, len(msg))
    return msg.value.decode() if rc else None
