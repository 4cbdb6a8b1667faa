#!/usr/bin/env bash
# The whole GPU round, the same every session: install, gpu tests, tune, bench. Run on the H200 machine from the
# repository root (the device tool does), with the nvidia-cutlass (+ platformdirs) wheels in .whl/ beside it:
#   bash scripts/gpu_round.sh [tests] [tune] [bench] [offload]     (no argument: all four)
# GPU_TESTS="test_a.py test_b.py" narrows the tests step (paths relative to tests/).
# Logs and machine-readable results go to $OUT (default ./out).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests tune bench offload)
export PYTHONUNBUFFERED=1
export CUTLASS_BYOC_CACHE_DIR=${CUTLASS_BYOC_CACHE_DIR:-/tmp/cutlass-byoc-cache}
export CUTLASS_BYOC_TEST_CACHE_DIR=$CUTLASS_BYOC_CACHE_DIR
export CUTLASS_BYOC_JOBS=${CUTLASS_BYOC_JOBS:-$(nproc)}

# Always a fresh install (5 s): a warm machine keeps the previous call's /tmp, and a stale copy of the package
# there once ran old code against new tests.
site=/tmp/cb-site
rm -rf "$site" build
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$site" . || exit 1
echo "install: $(( $(date +%s) - t0 )) s"
export PYTHONPATH=$site
export PATH=$site/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"

rc=0
for step in "${steps[@]}"; do
  t0=$(date +%s)
  case $step in
    tests)
      # run from tests/ so the installed package (not the source tree) is what gets imported
      (cd tests && python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" \
        --timeout=900 ${GPU_TESTS:-.} 2>&1 | tee "$OUT/gpu-tests.log") || rc=1
      python3 - <<'PY' | tee "$OUT/compile-times.txt"
import json, os, pathlib, statistics
root = pathlib.Path(os.environ["CUTLASS_BYOC_CACHE_DIR"]) / "kernels"
secs = [json.loads(p.read_text()).get("compile_seconds") for p in root.glob("*/*/meta.json")]
secs = sorted(s for s in secs if s)
if secs:
    print(f"kernels compiled: {len(secs)}, seconds per kernel: median {statistics.median(secs):.1f}, "
          f"min {secs[0]:.1f}, max {secs[-1]:.1f} (parallel, {os.environ['CUTLASS_BYOC_JOBS']} jobs)")
PY
      ;;
    tune)
      cutlass-byoc tune --verbose --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" || rc=1
      cutlass-byoc tune 2>&1 | tee "$OUT/tune-again.log" || rc=1 ;;
    bench)
      cutlass-byoc bench --no-progress --json "$OUT/bench.json" --csv "$OUT/bench.csv" 2>&1 | tee "$OUT/bench.log" || rc=1
      cutlass-byoc bench --no-progress --split-k --json "$OUT/bench-splitk.json" 2>&1 | tee "$OUT/bench-splitk.log" || rc=1 ;;
    offload)
      python3 -m cutlass_byoc.offload.bench 2>&1 | tee "$OUT/offload-bench.log" || rc=1 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  echo "== step $step: $(( $(date +%s) - t0 )) s"
done
exit $rc
