"""What a cached kernel compiled to: its SASS (cuobjdump, on a machine with the CUDA toolkit's binary utilities),
summarised per kernel function: instruction counts by opcode, and the order of its global loads, multiply-adds,
conversions, shared-memory accesses, barriers and branches as runs ("LDG.E.64 x6, FFMA x72, ..."), so one can see
whether a loop's loads are issued ahead of the arithmetic that waits for them. A diagnostic: it records nothing.

    python scripts/sass_summary.py NAME_SUBSTRING [...] [--cache-dir DIR] [--function depthwise_kernel] [--runs 60]

Each NAME_SUBSTRING selects the cached kernels (meta.json "name") that contain it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

#: Opcode families the run summary keeps (the rest, integer and predicate work, is counted only).
KEPT = ("LDG", "STG", "LDS", "STS", "FFMA", "FADD", "FMUL", "HADD2", "F2F", "F2FP", "BAR", "BRA", "EXIT", "SHFL",
        "LDGSTS", "LDGDEPBAR", "DEPBAR")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if not found:
        for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
            if root and (Path(root) / "bin" / "cuobjdump").exists():
                return str(Path(root) / "bin" / "cuobjdump")
        raise SystemExit("cuobjdump not found: this needs the CUDA toolkit's binary utilities")
    return found


def functions(sass: str) -> dict[str, list[str]]:
    """Opcode lists per SASS function."""
    out: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = m.group(1)
            out[current] = []
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and current:
            out[current].append(m.group(1))
    return out


def runs(ops: list[str], limit: int) -> str:
    """The kept opcodes in order, consecutive repeats folded ("FFMA x72")."""
    seq = [op for op in ops if op.split(".")[0] in KEPT]
    folded: list[list] = []
    for op in seq:
        if folded and folded[-1][0] == op:
            folded[-1][1] += 1
        else:
            folded.append([op, 1])
    text = [f"{op} x{n}" if n > 1 else op for op, n in folded]
    more = f" ... ({len(text) - limit} more runs)" if len(text) > limit else ""
    return ", ".join(text[:limit]) + more


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("CUTLASS_BYOC_CACHE_DIR", ".")))
    ap.add_argument("--function", default="depthwise_kernel", help="a substring of the SASS functions to show")
    ap.add_argument("--runs", type=int, default=60, help="runs of the order summary shown per function")
    a = ap.parse_args(argv)
    tool = cuobjdump()
    for meta in sorted((a.cache_dir / "kernels").glob("*/*/meta.json")):
        name = json.loads(meta.read_text()).get("name", "")
        if not any(s in name for s in a.names) or not (meta.parent / "kernel.so").exists():
            continue
        sass = subprocess.run([tool, "-sass", str(meta.parent / "kernel.so")], capture_output=True, text=True).stdout
        for fn, ops in functions(sass).items():
            if a.function not in fn:
                continue
            counts = collections.Counter(op.split(".")[0] for op in ops)
            print(f"== {name}: {fn[:60]}: {len(ops)} instructions")
            print("   " + ", ".join(f"{k} {v}" for k, v in counts.most_common(14)))
            print("   order: " + runs(ops, a.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
