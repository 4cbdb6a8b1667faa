#!/usr/bin/env bash
# The whole GPU round, the same every session: install, gpu tests, tune, bench, offload. Run on the H200 machine from
# the repository root (the device tool does), with the nvidia-cutlass (+ platformdirs) wheels in .whl/ beside it:
#   bash scripts/gpu_round.sh [tests] [tune] [bench] [offload] [tune-model] [offload-bench] [tune-depthwise]
#   [bench-depthwise]   (no argument: tests tune bench offload)
# prebuild: compile the kernels of every GPU test module in one parallel build (then the tests build nothing)
# tests:    the gpu-marked tests but the offload ones (GPU_TESTS="test_a.py ..." narrows them, GPU_TESTS_K="expr" selects)
# tune:     `cutlass-byoc tune` of the default workload from a cold cache (on a fresh machine), then a second tune
#           that must compile and time nothing (TUNE_EXPORT=1: the tuned cache is exported to $OUT/tuned.tar.gz;
#           TUNE_JSON=1: the first tune's report, every candidate's time, to $OUT/tune.json; TUNE_WORKLOAD=FILE:
#           a JSON workload instead of the default one, e.g. scripts/workloads/strided-dgrad.json, or
#           scripts/workloads/convnext-dw.json with the bench step and BENCH_SPLITK=0, then
#           `publish_results.py --bench-as bench-convnext-dw.json OUT`; TUNE_MAX=N:
#           --max-candidates N, a wider search than the default plan's; TUNE_KINDS=wgrad or fprop,dgrad: those kinds'
#           problems only, in the tune and the bench)
# bench:    `cutlass-byoc bench` and `bench --split-k` on the tuned cache (a carried tuned.tar.gz is imported first
#           when the cache is empty, e.g. on a fresh machine; BENCH_SPLITK=0: not the split-k study, whose launches
#           beyond the tune's plan compile first; TUNE_WORKLOAD and TUNE_KINDS narrow it as they do the tune, e.g.
#           scripts/workloads/resnet50-1x1.json: the 21 stride-1 1x1 cells, whose rows publish_results.py
#           --merge-bench merges into the published table)
# offload:  tests/test_gpu_offload.py with its output (training-step accuracy of ResNet-50, MobileNetV2, NCHW ResNet-18)
# tune-model: `cutlass-byoc tune --model $MODEL --batch $MODEL_BATCH --training` into the offload cache, so the
#           benchmark's "cached" selection runs the model's own tuned problems (MODEL default torchvision:resnet50;
#           MODEL_INFERENCE=1: the inference graph's problems instead of the training step's;
#           TUNE_MAX=N: --max-candidates N; TUNE_EXPORT=1: the cache's decisions exported to $OUT/tuned.tar.gz;
#           TUNE_JSON=1: the tune's report, every candidate's time and cuDNN's, to $OUT/tune-model.json, which
#           scripts/default_regret.py reads; TUNE_IN_STEP=1: --in-step, each pass then timed inside the model's
#           compiled step on its kernel and on cuDNN and both recorded in its decision, which they then decide)
# import:   a carried tuned.tar.gz (decisions and their kernels, from an earlier call's TUNE_EXPORT=1) or
#           decisions.tar.gz (decisions alone, TUNE_EXPORT=decisions; their kernels from the carried .kcache.tar.xz or
#           compiled here) imported into the offload cache (and the tune cache where a tune or bench step follows), so a
#           fresh machine benches what an earlier call tuned
# offload-bench: `python -m cutlass_byoc.offload.bench` ($BENCH_CASES, default the issue's six cases; all five modes
#           or $BENCH_MODES; BENCH_ROUNDS=N: the modes interleaved over N rounds of BENCH_STEPS, median round;
#           host overhead per call; BENCH_PROFILE=1: a torch.profiler split of each mode's step;
#           BENCH_OPTIMIZERS="sgd sgd-fused": the training steps timed with each optimizer, a row each) ->
#           $OUT/offload.json, which scripts/publish_results.py copies into benchmarks/h200/ (BENCH_JSON=NAME: $OUT/NAME
#           instead, so that each of several bench steps of one call keeps its own file, written when it ends; publish
#           each from a folder of its own as offload.json)
# inductor-kernels: scripts/inductor_kernels.py -> inductor-kernels.json, .log and inductor-code-<mode>.tar.xz:
#           Inductor's Triton kernels under inductor-cudagraphs and cutlass_byoc-cudagraphs, by name, time and code
#           (IK_CASE, IK_SELECT; IK_REFERENCE=1: offloaded convs on the PyTorch reference, nothing to compile;
#           IK_BANDWIDTH=1: instead plain Inductor's Triton kernels timed alone against their bytes and the copy
#           speed -> inductor-bandwidth.json, inductor-kernels-bandwidth.log)
# time-launches: scripts/time_launches.py $TIME_LAYERS (default stem; any default-workload layer as bench names it,
#           or stem / down) --extra -> $OUT/time-launches.log: each launch of the layers' plans (and the stem fold's
#           sm90 variants; TIME_EXTRA=0: not those) timed whole and kernel alone (TIME_KINDS=fprop,wgrad narrows the
#           kinds; TIME_ONLY="NAME ...": only the launches whose names contain one of these; a diagnostic; its
#           kernels must be in the test cache)
# ncu:      Nsight Compute (--clock-control none) on the kernels named by the regex $NCU_KERNEL (default
#           im2col_smem_kernel; the first $NCU_COUNT launches, default 1) while scripts/time_launches.py times
#           $TIME_LAYERS / $TIME_KINDS, once per name in $NCU_ONLY (the launches whose names contain it; an entry
#           LAYER:NAME times that layer alone) -> ncu.log; NCU_PROFILE_ARGS="...": instead, the launches
#           scripts/profile_kernels.py names with those arguments, each run once (NCU_KERNEL default depthwise_kernel)
# sweep:    scripts/sweep_kernels.py time: every kernel of the GEMM 1x1 family on the ResNet-50 stride-1 1x1 cells and
#           of the 3.x conv family on the 3x3 ones (SWEEP_LAYERS="1x1", SWEEP_KINDS="fprop dgrad", SWEEP_TILES=
#           "192x64x64:pingpong ..." narrow or extend it; SWEEP_PROFILE=1: each cell's best launch and cuDNN also
#           timed kernel alone by torch.profiler; SWEEP_SOURCELESS=1: each 3.x kernel's sourceless twin too;
#           SWEEP_DEEP=1: each kernel's twin of more pipeline stages than the families' cap; SWEEP_WITH_SM90=1: the
#           3.x conv family's kernels on the 1x1 cells too; SWEEP_STORE_STAGES=1: each sourceless GEMM 1x1 kernel's
#           twin with one epilogue D buffer per sub-tile), those in the test cache -> sweep.json, sweep.log
# channel-stats: scripts/channel_stats_bench.py: the channel-statistics epilogue's cost on each fprop problem of a
#           training step against the batch-norm statistics pass it would replace (CS_MODEL, default
#           torchvision:resnet50; CS_BATCH, default 32; kernels from the test cache) -> channel-stats.json, .log
# fuzz:     scripts/fuzz_partition.py --device cuda: $FUZZ_SEEDS (default 0:30) random conv programs through the backend
#           on the kernels against eager and float64 (every $FUZZ_INDUCTOR_EVERY-th through Inductor) -> fuzz.jsonl,
#           fuzz.log; carry `scripts/warm_cache.py --fuzz 0:30` as .kcache.tar.xz
# dw-defaults: scripts/depthwise_defaults.py: the depthwise workload's untuned defaults timed against the model's best
#           launches of each schedule group and the published bench's winners (kernels from the test cache, those
#           it lacks compiled first in one parallel build; DW_ARGS: the script's other arguments) -> dw-defaults.json,
#           dw-defaults.log
# profile:  scripts/profile_kernels.py $PROFILE_ARGS: kernel by kernel GPU time of the named launches and cuDNN's, and
#           each call's span from its first kernel's start to its last one's end -> profile.log
# cudnn-kernels: scripts/sweep_kernels.py cudnn-kernels: cuDNN's kernels per default and depthwise cell, and cuBLAS's
#           time of each 1x1 cell's GEMM -> cudnn-kernels.json, cudnn-kernels.log
# tune-depthwise, bench-depthwise: tune and bench of the named workload `depthwise` (MobileNetV2 and EfficientNet-B0
#           depthwise layers, batch 32) in the tune cache -> tune-depthwise.log, bench-depthwise.json (rows carry
#           "depthwise": true; the bench log is appended to tune-depthwise.log); run them in a call of their own
#           (DW_KINDS=wgrad or fprop,dgrad: those kinds' problems only, as `--kinds`; TUNE_JSON=1: the tune's report,
#           every candidate's time, to tune-depthwise.json)
# pool-bench: scripts/pool_bench.py: kernel times of the max-pool ops' forward and both backward kernels (one gradient
#           and the sum of two) on ResNet's stem pool, next to Inductor's and ATen's (POOL_BATCH, default "32 64")
#           -> pool-bench.json, pool-bench.log
# copy-floor: scripts/copy_floor.py: each published bench cell's compulsory bytes moved by one device-to-device copy,
#           timed as the bench times (the floor no memory-bound kernel beats; cuDNN's time over it bounds the ratio any
#           kernel can reach) -> copy-floor.json, copy-floor.log
# The files a call may bring back from the device (plan the steps of one call so they write at most 8): gpu-tests.log,
# tune.log, tune.json (TUNE_JSON=1), tune-model.json (TUNE_JSON=1), bench.json, bench-splitk.json, bench.log,
# time-launches.log, gpu-offload.log, offload.json, offload-bench.log (tune-model's log is appended to
# offload-bench.log), sweep.json, sweep.log,
# cudnn-kernels.json, cudnn-kernels.log, channel-stats.json, channel-stats.log, dw-defaults.json, dw-defaults.log,
# profile.log, copy-floor.json, copy-floor.log, pool-bench.json, pool-bench.log, inductor-kernels.json,
# inductor-kernels.log, inductor-code-<mode>.tar.xz, inductor-bandwidth.json, inductor-kernels-bandwidth.log,
# inductor-code-bandwidth.tar.xz.
# Kernel caches: tests and offload use $CUTLASS_BYOC_CACHE_DIR, seeded from a carried .kcache.tar.xz (made on a CPU
# machine by scripts/warm_cache.py); tune and bench use $CB_TUNE_CACHE, cold unless a .tune-cache.tar.xz of kernels
# compiled elsewhere is carried (the tune then still plans, verifies and times everything, but compiles little).
# Logs and machine-readable results go to $OUT (default ./out): at most 8 files per call come back from the device.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests tune bench offload)
export PYTHONUNBUFFERED=1
export CUTLASS_BYOC_CACHE_DIR=${CUTLASS_BYOC_CACHE_DIR:-/tmp/cutlass-byoc-cache}
export CUTLASS_BYOC_TEST_CACHE_DIR=$CUTLASS_BYOC_CACHE_DIR
TUNE_CACHE=${CB_TUNE_CACHE:-/tmp/cutlass-byoc-tune}
# The unpacked files belong to the user running this with the umask's modes, whoever made the archive: the cache
# refuses folders and kernels that another user owns or others can write (README, "Kernel cache").
seed() {  # seed ARCHIVE CACHE_DIR MESSAGE: unpack carried kernels into a cache, once per machine
  if [ -f "$1" ] && [ ! -e "$2/.seeded" ]; then
    mkdir -p -m 700 "$2" && tar -xJf "$1" -C "$2" --no-same-owner --no-same-permissions && touch "$2/.seeded" \
      && echo "$3"
  fi
}
seed .kcache.tar.xz "$CUTLASS_BYOC_CACHE_DIR" "seeded the test cache from .kcache.tar.xz"
# kernels only: every problem is still planned, checked and timed
seed .tune-cache.tar.xz "$TUNE_CACHE" \
  "seeded the tune cache with kernels compiled elsewhere from .tune-cache.tar.xz: NOT a cold tune"
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
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

compile_times() {  # seconds per compiled kernel in a cache (meta.json records each kernel's compile time)
  python3 - "$1" <<'PY'
import json, os, pathlib, statistics, sys
root = pathlib.Path(sys.argv[1]) / "kernels"
secs = [json.loads(p.read_text()).get("compile_seconds") for p in root.glob("*/*/meta.json")]
secs = sorted(s for s in secs if s)
if secs:
    print(f"{root}: kernels compiled: {len(secs)}, seconds per kernel: median {statistics.median(secs):.1f}, "
          f"min {secs[0]:.1f}, max {secs[-1]:.1f} (parallel, {os.environ['CUTLASS_BYOC_JOBS']} jobs)")
PY
}

export_tuned() {  # export_tuned CACHE_DIR: TUNE_EXPORT=1: decisions and kernels -> $OUT/tuned.tar.gz (large);
  # TUNE_EXPORT=decisions: the decisions alone -> $OUT/decisions.tar.gz (small; carry it back for the import step)
  case ${TUNE_EXPORT:-} in
    "") ;;
    decisions) CUTLASS_BYOC_CACHE_DIR=$1 cutlass-byoc cache export --decisions-only "$OUT/decisions.tar.gz" || rc=1 ;;
    *) CUTLASS_BYOC_CACHE_DIR=$1 cutlass-byoc cache export "$OUT/tuned.tar.gz" || rc=1 ;;
  esac
}

rc=0
for step in "${steps[@]}"; do
  t0=$(date +%s)
  case $step in
    prebuild)
      # every GPU test module's kernels (and the model-family tests') in ONE parallel build on this machine's cores,
      # instead of one build per module; the tests then compile nothing up front
      python3 scripts/warm_cache.py --tests-only --no-archive --cache-dir "$CUTLASS_BYOC_CACHE_DIR" \
        --jobs "$CUTLASS_BYOC_JOBS" 2>&1 | tr '\r' '\n' | grep -v "kernel/s\]$" | tee -a "$OUT/gpu-tests.log" || rc=1
      export CUTLASS_BYOC_TEST_NO_PREBUILD=1 ;;
    tests)
      # run from tests/ so the installed package (not the source tree) is what gets imported; -v: a line as each test
      # ends, so a call cut by its limit still brings back which tests ran (with -q the dots of an unfinished line
      # never passed the line filter: the forty-fourth session's call 6 brought back an empty log). Durations on an
      # H100 (forty-third session): test_gpu_offload.py without ConvNeXt/EfficientNet, test_gpu_pooling.py and
      # test_gpu_step_times.py together about 400 s; test_gpu_families/depthwise/fuzz 260 s
      (cd tests && python3 -m pytest -m gpu -v -rA -p no:cacheprovider --timeout=900 \
        ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} ${GPU_TESTS:---ignore=test_gpu_offload.py .} 2>&1 \
        | grep --line-buffered -v "^PASSED" | tee "$OUT/gpu-tests.log") || rc=1
      compile_times "$CUTLASS_BYOC_CACHE_DIR" | tee -a "$OUT/gpu-tests.log"
      ;;
    tune)
      # the log says itself whether its kernels were compiled here (a cold tune) or carried
      seeded=0
      [ -e "$TUNE_CACHE/.seeded" ] && seeded=1
      if [ $seeded = 1 ]; then
        echo "tune cache seeded from the carried .tune-cache.tar.xz: NOT a cold tune" > "$OUT/tune.log"
      else
        : > "$OUT/tune.log"
      fi
      CUTLASS_BYOC_CACHE_DIR=$TUNE_CACHE cutlass-byoc tune ${TUNE_WORKLOAD:-} ${TUNE_KINDS:+--kinds $TUNE_KINDS} \
        --verbose --no-progress ${TUNE_MAX:+--max-candidates $TUNE_MAX} ${TUNE_JSON:+--json "$OUT/tune.json"} 2>&1 \
        | tee -a "$OUT/tune.log" || rc=1
      [ $seeded = 1 ] || compile_times "$TUNE_CACHE" | tee -a "$OUT/tune.log"  # carried: not this GPU machine's
      echo "== the second tune" | tee -a "$OUT/tune.log"
      CUTLASS_BYOC_CACHE_DIR=$TUNE_CACHE cutlass-byoc tune ${TUNE_WORKLOAD:-} ${TUNE_KINDS:+--kinds $TUNE_KINDS} 2>&1 \
        | tee -a "$OUT/tune.log" || rc=1
      export_tuned "$TUNE_CACHE" ;;
    bench)
      if [ ! -d "$TUNE_CACHE/decisions" ] && [ -f tuned.tar.gz ]; then
        CUTLASS_BYOC_CACHE_DIR=$TUNE_CACHE cutlass-byoc cache import tuned.tar.gz || rc=1
      fi
      CUTLASS_BYOC_CACHE_DIR=$TUNE_CACHE cutlass-byoc bench ${TUNE_WORKLOAD:-} ${TUNE_KINDS:+--kinds $TUNE_KINDS} \
        --no-progress --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || rc=1
      [ "${BENCH_SPLITK:-1}" = 1 ] && { CUTLASS_BYOC_CACHE_DIR=$TUNE_CACHE cutlass-byoc bench --no-progress --split-k \
        --json "$OUT/bench-splitk.json" 2>&1 | tee -a "$OUT/bench.log" || rc=1; } ;;
    tune-depthwise)
      CUTLASS_BYOC_CACHE_DIR=$TUNE_CACHE cutlass-byoc tune depthwise ${DW_KINDS:+--kinds $DW_KINDS} --verbose \
        --no-progress ${TUNE_JSON:+--json "$OUT/tune-depthwise.json"} 2>&1 \
        | tee "$OUT/tune-depthwise.log" || rc=1
      [ -e "$TUNE_CACHE/.seeded" ] || compile_times "$TUNE_CACHE" | tee -a "$OUT/tune-depthwise.log"
      export_tuned "$TUNE_CACHE" ;;
    bench-depthwise)
      if [ ! -d "$TUNE_CACHE/decisions" ] && [ -f tuned.tar.gz ]; then
        CUTLASS_BYOC_CACHE_DIR=$TUNE_CACHE cutlass-byoc cache import tuned.tar.gz || rc=1
      fi
      CUTLASS_BYOC_CACHE_DIR=$TUNE_CACHE cutlass-byoc bench depthwise ${DW_KINDS:+--kinds $DW_KINDS} --no-progress \
        --json "$OUT/bench-depthwise.json" 2>&1 | tee -a "$OUT/tune-depthwise.log" || rc=1 ;;
    copy-floor)
      python3 scripts/copy_floor.py --json "$OUT/copy-floor.json" 2>&1 | tee "$OUT/copy-floor.log" || rc=1 ;;
    offload)
      (cd tests && python3 -m pytest -m gpu -q -s -p no:cacheprovider \
        --timeout=900 test_gpu_offload.py 2>&1 | tee "$OUT/gpu-offload.log") || rc=1 ;;
    tune-model)
      cutlass-byoc tune --no-progress --model "${MODEL:-torchvision:resnet50}" --batch "${MODEL_BATCH:-32}" \
        $([ -n "${MODEL_INFERENCE:-}" ] && echo --inference || echo --training) --amp fp16 \
        ${TUNE_MAX:+--max-candidates $TUNE_MAX} ${TUNE_JSON:+--json "$OUT/tune-model.json"} ${TUNE_IN_STEP:+--in-step} 2>&1 \
        | tee -a "$OUT/offload-bench.log" || rc=1
      export_tuned "$CUTLASS_BYOC_CACHE_DIR" ;;
    import)
      # the tune cache too only where a tune or bench step of this call reads it (its own copy of every decision's
      # kernel: compiled here unless that cache was seeded, 154 s for ResNet-50's 47 on the H200)
      dirs=("$CUTLASS_BYOC_CACHE_DIR")
      if [ "$TUNE_CACHE" != "$CUTLASS_BYOC_CACHE_DIR" ] && printf '%s\n' "${steps[@]}" \
          | grep -qxE 'tune|bench|tune-depthwise|bench-depthwise'; then
        dirs+=("$TUNE_CACHE")
      fi
      for dir in "${dirs[@]}"; do
        [ -f tuned.tar.gz ] && { CUTLASS_BYOC_CACHE_DIR=$dir cutlass-byoc cache import tuned.tar.gz || rc=1; }
        # decisions alone (an earlier call's TUNE_EXPORT=decisions): their kernels come from the carried cache, or
        # are compiled here from the templates
        [ -f decisions.tar.gz ] && { CUTLASS_BYOC_CACHE_DIR=$dir cutlass-byoc cache import --decisions-only \
          --no-progress decisions.tar.gz || rc=1; }
      done ;;
    offload-bench)
      python3 -m cutlass_byoc.offload.bench ${BENCH_CASES:+--cases $BENCH_CASES} --steps "${BENCH_STEPS:-20}" \
        ${BENCH_ROUNDS:+--rounds $BENCH_ROUNDS} ${BENCH_OPTIMIZERS:+--optimizers $BENCH_OPTIMIZERS} \
        ${BENCH_MODES:+--modes $BENCH_MODES} ${BENCH_PROFILE:+--profile} \
        --host-overhead --json "$OUT/${BENCH_JSON:-offload.json}" 2>&1 | tee -a "$OUT/offload-bench.log" || rc=1 ;;
    inductor-kernels)
      # Inductor's Triton kernels of a training step under plain Inductor and under this backend, one by one, with
      # their generated code (IK_CASE, default resnet50:32; IK_REFERENCE=1: the offloaded convs on the PyTorch
      # reference, so no kernel is needed; IK_SELECT, default heuristic)
      python3 scripts/inductor_kernels.py "$OUT" --case "${IK_CASE:-resnet50:32}" --select "${IK_SELECT:-heuristic}" \
        $([ -n "${IK_REFERENCE:-}" ] && echo --reference) $([ -n "${IK_BANDWIDTH:-}" ] && echo --bandwidth) 2>&1 \
        | grep -v "^W[0-9]" | tee "$OUT/inductor-kernels${IK_BANDWIDTH:+-bandwidth}.log" || rc=1 ;;
    time-launches)
      python3 scripts/time_launches.py ${TIME_LAYERS:-stem} ${TIME_KINDS:+--kinds $TIME_KINDS} \
        $([ "${TIME_EXTRA:-1}" = 1 ] && echo --extra) ${TIME_ONLY:+--only $TIME_ONLY} 2>&1 \
        | tee "$OUT/time-launches.log" || rc=1 ;;
    ncu)
      if [ -n "${NCU_PROFILE_ARGS:-}" ]; then  # the launches scripts/profile_kernels.py names (e.g. depthwise layers)
        ncu --clock-control none -k "regex:${NCU_KERNEL:-depthwise_kernel}" --launch-count "${NCU_COUNT:-1}" \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
          --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
          --section InstructionStats python3 scripts/profile_kernels.py --plain --iters 1 $NCU_PROFILE_ARGS 2>&1 \
          | grep -v "^W[0-9]\|UserWarning\|_warn_once" | tee -a "$OUT/ncu.log" || rc=1
      else
        for only in ${NCU_ONLY:-im2colsm}; do  # one profiled process per launch name (LAYER:NAME: of that layer only)
          layers=${TIME_LAYERS:-stem}
          case $only in *:*) layers=${only%%:*}; only=${only#*:} ;; esac
          ncu --clock-control none -k "regex:${NCU_KERNEL:-im2col_smem_kernel}" --launch-count "${NCU_COUNT:-1}" \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
            --section InstructionStats python3 scripts/time_launches.py $layers \
            --kinds "${TIME_KINDS:-fprop}" --only "$only" 2>&1 | tee -a "$OUT/ncu.log" || rc=1
        done
      fi ;;
    pool-bench)
      # scripts/pool_bench.py: the max-pool ops' Triton kernels on ResNet's stem pool against Inductor's and ATen's
      # (POOL_BATCH, default "32 64") -> pool-bench.json, pool-bench.log
      python3 scripts/pool_bench.py --batch ${POOL_BATCH:-32 64} --json "$OUT/pool-bench.json" 2>&1 \
        | grep -v "^W[0-9]" | tee "$OUT/pool-bench.log" || rc=1 ;;
    sweep)
      python3 scripts/sweep_kernels.py time "$OUT/sweep.json" ${SWEEP_LAYERS:+--layers $SWEEP_LAYERS} \
        ${SWEEP_KINDS:+--kinds $SWEEP_KINDS} ${SWEEP_TILES:+--tiles $SWEEP_TILES} ${SWEEP_PROFILE:+--profile} \
        ${SWEEP_SOURCELESS:+--sourceless} ${SWEEP_DEEP:+--deep} ${SWEEP_WITH_SM90:+--with-sm90} \
        ${SWEEP_STORE_STAGES:+--store-stages} 2>&1 \
        | tee "$OUT/sweep.log" || rc=1 ;;
    fuzz)
      # scripts/fuzz_partition.py on the GPU: random conv programs through the backend and the kernels against eager
      # and float64 (FUZZ_SEEDS; `warm_cache.py --fuzz` compiles their kernels ahead)
      python3 scripts/fuzz_partition.py --device cuda --seeds "${FUZZ_SEEDS:-0:30}" \
        --inductor-every "${FUZZ_INDUCTOR_EVERY:-0}" --json "$OUT/fuzz.jsonl" 2>&1 | grep -v "^W[0-9]" \
        | tee "$OUT/fuzz.log" || rc=1 ;;
    channel-stats)
      # scripts/channel_stats_bench.py: each fprop problem of the model's training step on one sm90 kernel, its
      # channel-statistics twin, and the batch-norm statistics pass the twin would replace (CS_MODEL, CS_BATCH)
      python3 scripts/channel_stats_bench.py --model "${CS_MODEL:-torchvision:resnet50}" --batch "${CS_BATCH:-32}" \
        --json "$OUT/channel-stats.json" 2>&1 | grep -v "^W[0-9]" | tee "$OUT/channel-stats.log" || rc=1 ;;
    dw-defaults)
      # scripts/depthwise_defaults.py: on the depthwise workload, the untuned default against the model's best launches
      # of each schedule group and the published bench's winner (kernels from the test cache)
      # (DW_ARGS: more arguments, e.g. "--per-group 0 --cols 0 --twins": the winners, their prefetch twins, defaults)
      python3 scripts/depthwise_defaults.py --winners benchmarks/h200/bench-depthwise.json ${DW_ARGS:-} \
        --jobs "$CUTLASS_BYOC_JOBS" --json "$OUT/dw-defaults.json" 2>&1 | tee "$OUT/dw-defaults.log" || rc=1 ;;
    profile)
      # scripts/profile_kernels.py: each kernel's own GPU time and the call's first-start-to-last-end span, for the
      # launches PROFILE_ARGS names (e.g. "--layers mbv2_dw_960_7 --kinds wgrad --winners
      # benchmarks/h200/bench-depthwise.json --cluster-twins"), next to cuDNN's (kernels from the test cache)
      python3 scripts/profile_kernels.py ${PROFILE_ARGS:-} 2>&1 | grep -v "^W[0-9]\|UserWarning\|_warn_once" \
        | tee "$OUT/profile.log" || rc=1 ;;
    cudnn-kernels)
      python3 scripts/sweep_kernels.py cudnn-kernels "$OUT/cudnn-kernels.json" > "$OUT/cudnn-kernels.log" 2>&1 \
        || rc=1 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  echo "== step $step: $(( $(date +%s) - t0 )) s"
done
exit $rc
