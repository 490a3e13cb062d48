#!/usr/bin/env bash
# The same run with --no-isolate and --isolate started together, so that both see the same load on the shared
# 2-core machine; each pair twice. cli_kernels:good (tests/) has millisecond cases: the per-case cost of the
# pipe shows there; correct_kernel premerge is the CPU gate's size.
set -uo pipefail
cd /work/wt-crash && . .venv/bin/activate
OUT=/work/records-pending/crash
FX=$(mktemp -d)
pair() {  # label, kernel, args...
  local label=$1 kernel=$2; shift 2
  echo "== $label: load $(cut -d' ' -f1-3 /proc/loadavg) at $(date -u +%H:%M:%S)"
  for mode in --no-isolate --isolate; do
    ( t0=$(date +%s.%N)
      line=$(nice -n 10 env PYTHONPATH=tests mla-verify check --kernel "$kernel" --device cpu --fixtures-dir "$FX" \
        --report "$OUT/ab-$label$mode.json" "$mode" "$@" 2>/dev/null | grep -E "judged in")
      echo "$mode: $line | wall $(echo "$(date +%s.%N) - $t0" | bc) s" ) &
  done
  wait
  echo "   load after $(cut -d' ' -f1-3 /proc/loadavg)"
}
for i in 1 2; do
  pair good-fuzz-$i cli_kernels:good --profile fuzz --minutes 0.5 --seed 1
done
pair correct-premerge mla_verify.kernels.mutants:correct_kernel --profile premerge
