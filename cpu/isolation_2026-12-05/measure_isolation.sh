#!/usr/bin/env bash
# Isolation cost on the shared 2-core CPU machine (issue #31): premerge of correct_kernel and a 1-minute fuzz,
# each with --no-isolate and --isolate alternated, niced; the load average before each run is logged.
set -uo pipefail
cd /work/wt-crash && . .venv/bin/activate
OUT=/work/records-pending/crash
FX=$(mktemp -d)
K=mla_verify.kernels.mutants:correct_kernel
run() {  # label, args...
  local label=$1; shift
  echo "== $label: load $(cut -d' ' -f1-3 /proc/loadavg) at $(date -u +%H:%M:%S)"
  local t0=$(date +%s.%N)
  nice -n 10 mla-verify check --kernel $K --device cpu --fixtures-dir "$FX" --report "$OUT/$label.json" "$@" 2>/dev/null \
    | grep -E "judged in|: (PASS|FAIL) --"
  echo "   wall $(echo "$(date +%s.%N) - $t0" | bc) s, load after $(cut -d' ' -f1-3 /proc/loadavg)"
}
for i in 1 2; do
  run premerge-no-isolate-$i --profile premerge --no-isolate
  run premerge-isolate-$i --profile premerge --isolate
done
for i in 1 2; do
  run fuzz-no-isolate-$i --profile fuzz --minutes 1 --seed 1 --no-isolate
  run fuzz-isolate-$i --profile fuzz --minutes 1 --seed 1 --isolate
done
