#!/usr/bin/env bash
# Runs GPU stages on the device machine, each under its own time limit, each logged to $OUT/<stage>.log:
#   tests/benchmarks/gpu_stage.sh tests catalog timer nvml timing sweep
# Stages: tests (pytest -m gpu), catalog / timer / nvml (smoke scripts), timing (gpu_timing.py),
# sweep (gpu_sweep.py), pool (pool_check.py), placement (placement_check.py), moe (moe_decode_check.py), address (address_check.py), producer (producer_check.py), between (between_check.py, $BETWEEN_ARGS), scaling (pool_scaling.py, $SCALING_ARGS), model (model_step.py, $MODEL_ARGS), protocol (protocol_check.py, $PROTOCOL_ARGS: all six cases are estimated at ~690 s, past $PROTOCOL_S's 330 default; its log's first line
# estimates the cases given and says how to split them), settle (capped_settle_check.py, $SETTLE_ARGS). The short table of each is printed at the end.
set -u
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
for stage in "$@"; do
  case $stage in
    tests)   cmd=(timeout 240 $py -m pytest -q -m gpu -p no:cacheprovider tests/measure tests/runners -rs) ;;
    catalog) cmd=(timeout 120 $py tests/benchmarks/gpu_catalog_smoke.py) ;;
    timer)   cmd=(timeout 120 $py tests/benchmarks/gpu_timer_smoke.py) ;;
    nvml)    cmd=(timeout 90 $py tests/benchmarks/nvml_smoke.py --out "$OUT") ;;
    timing)  cmd=(timeout 300 $py tests/benchmarks/gpu_timing.py --out "$OUT") ;;
    sweep)   cmd=(timeout 400 $py tests/benchmarks/gpu_sweep.py --out "$OUT") ;;
    model)   cmd=(timeout ${MODEL_S:-330} $py tests/benchmarks/model_step.py --out "$OUT" ${MODEL_ARGS:-}) ;;
    scaling) cmd=(timeout ${SCALING_S:-500} $py tests/benchmarks/pool_scaling.py --out "$OUT" ${SCALING_ARGS:-}) ;;
    pool)    cmd=(timeout ${POOL_S:-400} $py tests/benchmarks/pool_check.py --out "$OUT") ;;
    placement) cmd=(timeout ${PLACEMENT_S:-240} $py tests/benchmarks/placement_check.py --out "$OUT") ;;
    moe)     cmd=(timeout ${MOE_S:-240} $py tests/benchmarks/moe_decode_check.py --out "$OUT") ;;
    address) cmd=(timeout ${ADDRESS_S:-240} $py tests/benchmarks/address_check.py --out "$OUT") ;;
    producer) cmd=(timeout ${PRODUCER_S:-240} $py tests/benchmarks/producer_check.py --out "$OUT") ;;
    between) cmd=(timeout ${BETWEEN_S:-240} $py tests/benchmarks/between_check.py --out "$OUT" ${BETWEEN_ARGS:-}) ;;
    settle)  cmd=(timeout ${SETTLE_S:-420} $py tests/benchmarks/capped_settle_check.py --out "$OUT" ${SETTLE_ARGS:-}) ;;
    protocol) cmd=(timeout ${PROTOCOL_S:-330} $py tests/benchmarks/protocol_check.py --out "$OUT" ${PROTOCOL_ARGS:-}) ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  start=$(date +%s)
  "${cmd[@]}" > "$OUT/$stage.log" 2>&1
  echo "== $stage: exit $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.log"
done
for stage in "$@"; do echo "==== $stage"; tail -n 25 "$OUT/$stage.log"; done
