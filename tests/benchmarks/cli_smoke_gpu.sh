#!/usr/bin/env bash
# The verbs a user types on a GPU machine, end to end through the CLI: run, query (an 80-column table), calibrate,
# audit, audit --remeasure, count-missing, a launcher run with a snapshot, export and merge into a second ledger,
# measure (and one refused).
# Logs to $OUT/cli_smoke.log.
set -u
py=${PYTHON:-python3}
db=$OUT/smoke.db
specs='[{"m":1,"n":4096,"k":4096,"dtype":"bf16"},{"m":64,"n":4096,"k":4096,"dtype":"bf16"},{"m":2048,"n":4096,"k":4096,"dtype":"bf16"},{"m":256,"n":4096,"k":4096,"dtype":"fp8_e4m3"}]'
echo "$specs" > "$OUT/smoke_specs.json"
step() { echo "== $*"; "$@"; echo "   exit $?"; }
{
  step $py -m kprof run single_gemm --backend torch --specs "$OUT/smoke_specs.json" --db "$db"
  step env COLUMNS=80 $py -m kprof query single_gemm --backend torch --specs "$OUT/smoke_specs.json" --db "$db"
  step $py -m kprof calibrate --backend torch --db "$db"
  step $py -m kprof audit --db "$db"
  step $py -m kprof audit --remeasure 4 --db "$db"
  step $py -m kprof count-missing single_gemm --backend torch --specs "$OUT/smoke_specs.json" --db "$db" --timer events
  # the seed's command form, a snapshot naming the method asked for (timing in request.json) and the command as typed
  step $py -m launcher kernel-profile run single_gemm --backend torch --spec '{"m":64,"n":4096,"k":4096,"dtype":"bf16"}' --timer events --db "$db" --output-dir "$OUT/snap"
  step $py -c "import json,sys; r=json.load(open(sys.argv[1])); m=json.load(open(sys.argv[2])); print(r['timing'], '|', m['command'])" "$OUT/snap/request.json" "$OUT/snap/job.meta.json"
  step $py -m kprof export -o "$OUT/smoke.kseg" --db "$db"
  step $py -m kprof merge "$OUT/smoke.kseg" --db "$OUT/smoke2.db"
  step $py -m kprof scopes --db "$OUT/smoke2.db"
  step $py -m kprof measure single_gemm --backend torch --spec '{"m":64,"n":4096,"k":4096,"dtype":"bf16"}' --duration-s 2 --output-dir "$OUT/measure" --db "$db"
  # an hour of a 10 µs kernel replayed warm would hold about 360 million CUPTI records: refused (exit 2) before it starts
  step $py -m kprof measure single_gemm --backend torch --spec '{"m":1,"n":4096,"k":4096,"dtype":"bf16"}' --duration-s 3600 --no-clear-l2 --cuda-graph --output-dir "$OUT/measure_long"
} > "$OUT/cli_smoke.log" 2>&1
grep -E "^== |exit " "$OUT/cli_smoke.log" | paste - - | sed 's/ *exit/  -> exit/'
