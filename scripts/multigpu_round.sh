#!/usr/bin/env bash
# Issue 15 on a host with 2+ identical GPUs (2 x H200): tuning spread over the GPUs, DDP training with the backend,
# and a tuned cache serving another DDP job. Run from the repository root with the wheels in .whl/ (as gpu_round.sh):
#   bash scripts/multigpu_round.sh [tune-gpus] [tune-gpus-warm] [ddp-tune] [ddp] [fleet]     (no argument: all)
# tune-gpus:      `cutlass-byoc tune --gpus all` of the default workload from an empty cache ($TUNE_CACHE)
# tune-gpus-warm: on that cache, re-time everything (`--force`) on one GPU, then on all: timing seconds 1 vs N
# ddp-tune:       2-rank DDP ResNet-50 with select=tune from an empty cache ($DDP_CACHE): one rank tunes each problem,
#                 each kernel compiled once on this host (see tuning_per_rank and kernels_per_host in ddp.jsonl)
# ddp:            on that cache: 2 ranks x 16 (select=cached), 1 rank x 32 (the same global batch), 1 rank x 32 as
#                 2 micro-batches of 16 (the same conv problems as the 2 ranks: the first step's loss should agree exactly),
#                 2 ranks with Inductor, 1 rank eager (numerics reference); then the comparison table
# fleet:          `cache export` of $DDP_CACHE, `cache import` into an empty cache, a 2-rank run on it: nothing
#                 compiled, nothing tuned
# DDP_ARGS adds ddp_check.py arguments to every run (e.g. "--bn train"); NPROC, STEPS, BATCH as named.
# Results in $OUT (at most 8 files): tune-gpus.log, tune-gpus-cold.json, tune-gpus-1.json, tune-gpus-n.json,
# ddp.jsonl, ddp.log, fleet.log.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tune-gpus tune-gpus-warm ddp-tune ddp fleet)
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export CUTLASS_BYOC_JOBS=${CUTLASS_BYOC_JOBS:-$(nproc)}
TUNE_CACHE=${CB_TUNE_CACHE:-/tmp/cb-mg-tune}
DDP_CACHE=${CB_DDP_CACHE:-/tmp/cb-mg-ddp}
FLEET_CACHE=/tmp/cb-mg-fleet
NPROC=${NPROC:-2}
STEPS=${STEPS:-5}
BATCH=${BATCH:-32}
if [ -f .tune-cache.tar.xz ] && [ ! -e "$TUNE_CACHE/.seeded" ]; then  # kernels compiled elsewhere: not a cold tune
  mkdir -p "$TUNE_CACHE" && tar -xJf .tune-cache.tar.xz -C "$TUNE_CACHE" && touch "$TUNE_CACHE/.seeded"
  echo "seeded $TUNE_CACHE from .tune-cache.tar.xz" | tee -a "$OUT/tune-gpus.log"
fi

site=/tmp/cb-site
if [ -d .whl ]; then  # a fresh install, as gpu_round.sh does
  rm -rf "$site" build
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$site" . || exit 1
  export PYTHONPATH=$site
  export PATH=$site/bin:$PATH
fi
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader

summary() {  # summary JSON: the tune report's timing line
  python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s = d.get("scaling") or {}
print(f"{sys.argv[1]}: devices {d.get('devices')}, compile {d['compile_s']:.1f} s, timing {d['timing_s']:.1f} s, "
      f"{d['launches_timed']} launches timed, total {d['total_s']:.1f} s"
      + (f"; GPUs busy {[round(b, 1) for b in s['busy_s']]} s, problems per GPU {s['problems_per_gpu']}"
         if s and 'busy_s' in s else ""))
PY
}
ddp() {  # ddp LABEL NPROC ARGS...: one ddp_check run appended to ddp.jsonl
  local label=$1 n=$2; shift 2
  echo "== $label" | tee -a "$OUT/ddp.log"
  torchrun --standalone --nproc_per_node "$n" scripts/ddp_check.py --steps "$STEPS" --batch "$BATCH" \
    --label "$label" --json "$OUT/ddp.jsonl" ${DDP_ARGS:-} "$@" >>"$OUT/ddp.log" 2>&1 || { echo "FAILED: $label" | tee -a "$OUT/ddp.log"; rc=1; }
  tail -n 1 "$OUT/ddp.jsonl" | cut -c1-400
}

rc=0
for step in "${steps[@]}"; do
  t0=$(date +%s)
  case $step in
    tune-gpus)
      CUTLASS_BYOC_CACHE_DIR=$TUNE_CACHE cutlass-byoc tune --gpus all --no-progress --verbose \
        --json "$OUT/tune-gpus-cold.json" 2>&1 | tail -n 25 | tee -a "$OUT/tune-gpus.log" || rc=1
      summary "$OUT/tune-gpus-cold.json" | tee -a "$OUT/tune-gpus.log"
      ;;
    tune-gpus-warm)
      for g in 0 all; do
        name=$([ $g = 0 ] && echo 1 || echo n)
        CUTLASS_BYOC_CACHE_DIR=$TUNE_CACHE cutlass-byoc tune --gpus $g --force --no-progress \
          --json "$OUT/tune-gpus-$name.json" 2>&1 | tail -n 4 | tee -a "$OUT/tune-gpus.log" || rc=1
        summary "$OUT/tune-gpus-$name.json" | tee -a "$OUT/tune-gpus.log"
      done
      ;;
    ddp-tune)
      CUTLASS_BYOC_CACHE_DIR=$DDP_CACHE ddp "byoc tune ${NPROC}x$((BATCH / NPROC)) cold" "$NPROC" --select tune
      ;;
    ddp)
      CUTLASS_BYOC_CACHE_DIR=$DDP_CACHE ddp "byoc ${NPROC}x$((BATCH / NPROC))" "$NPROC" --select cached
      CUTLASS_BYOC_CACHE_DIR=$DDP_CACHE ddp "byoc 1x$BATCH" 1 --select cached
      CUTLASS_BYOC_CACHE_DIR=$DDP_CACHE ddp "byoc 1x$BATCH as ${NPROC}x$((BATCH / NPROC)) micro" 1 --select cached \
        --accum "$NPROC"
      ddp "inductor ${NPROC}x$((BATCH / NPROC))" "$NPROC" --mode inductor
      ddp "eager 1x$BATCH" 1 --mode eager
      python3 scripts/ddp_check.py --compare "$OUT/ddp.jsonl" | tee -a "$OUT/ddp.log"
      ;;
    fleet)
      rm -rf "$FLEET_CACHE" /tmp/cb-mg-export.tar.gz
      { CUTLASS_BYOC_CACHE_DIR=$DDP_CACHE cutlass-byoc cache export /tmp/cb-mg-export.tar.gz &&
        CUTLASS_BYOC_CACHE_DIR=$FLEET_CACHE cutlass-byoc cache import /tmp/cb-mg-export.tar.gz; } 2>&1 | tee -a "$OUT/fleet.log"
      CUTLASS_BYOC_CACHE_DIR=$FLEET_CACHE ddp "fleet: imported cache ${NPROC}x$((BATCH / NPROC))" "$NPROC" --select cached
      tail -n 1 "$OUT/ddp.jsonl" | python3 -c "
import json, sys
d = json.loads(sys.stdin.read())
print('fleet: kernels per host', json.dumps(d['kernels_per_host']), '| tuning per rank', json.dumps(d['tuning_per_rank']),
      '| fallbacks', len(d['offload'].get('fallbacks', {})))" | tee -a "$OUT/fleet.log"
      ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  echo "[$step: $(( $(date +%s) - t0 )) s]" | tee -a "$OUT/ddp.log"
done
exit $rc
