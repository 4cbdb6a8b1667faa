"""scripts/sass_summary.py's reading of cuobjdump output (the tool itself runs on the GPU machine)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_summary.py"

SASS = """
\tcode for sm_90a
\t\tFunction : _ZN12_GLOBAL__N_113reduce_kernelENS_6ParamsEi
        /*0000*/                   LDC R1, c[0x0][0x28] ;                          /* 0x00000a00ff017b82 */
        /*0010*/                   EXIT ;                                          /* 0x000000000000794d */
\t\tFunction : _ZN12_GLOBAL__N_116depthwise_kernelENS_6ParamsE
        /*0000*/                   LDC R1, c[0x0][0x28] ;                          /* 0x00000a00ff017b82 */
        /*0070*/              @!P0 LDG.E.64 R4, desc[UR4][R2.64] ;                 /* 0x0000000402048981 */
        /*0080*/                   LDG.E.64 R6, desc[UR4][R2.64+0x40] ;            /* 0x0000400402067981 */
        /*0090*/                   HADD2.F32 R10, -RZ, R4.H0_H0 ;                  /* 0x20000004ff0a7230 */
        /*00a0*/                   FFMA R8, R10, R6, R8 ;                          /* 0x00000006080a7223 */
        /*00b0*/                   IADD3 R2, P0, R2, 0x80, RZ ;                    /* 0x0000008002027810 */
        /*00c0*/                   FFMA R9, R10, R7, R9 ;                          /* 0x00000007090a7223 */
        /*00d0*/               @P1 BRA 0x70 ;                                      /* 0x0000000000001947 */
        /*00e0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                   /* 0x0000000000007b1d */
"""


def load():
    spec = importlib.util.spec_from_file_location("sass_summary", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_functions_and_runs():
    s = load()
    fns = s.functions(SASS)
    assert list(fns) == ["_ZN12_GLOBAL__N_113reduce_kernelENS_6ParamsEi", "_ZN12_GLOBAL__N_116depthwise_kernelENS_6ParamsE"]
    ops = fns["_ZN12_GLOBAL__N_116depthwise_kernelENS_6ParamsE"]
    assert ops == ["LDC", "LDG.E.64", "LDG.E.64", "HADD2.F32", "FFMA", "IADD3", "FFMA", "BRA",
                   "BAR.SYNC.DEFER_BLOCKING"]  # predicated instructions by their opcode
    # integer work is left out of the order; repeats fold; the rest is cut at `limit` runs
    assert s.runs(ops, 10) == "LDG.E.64 x2, HADD2.F32, FFMA x2, BRA, BAR.SYNC.DEFER_BLOCKING"
    assert s.runs(ops, 2) == "LDG.E.64 x2, HADD2.F32 ... (3 more runs)"
