#!/bin/bash
# premerge on the correct kernel, main then branch then main again then branch, nice'd; times and load
PY=/work/wt-diagnosis/.venv/bin/python
OUT=/work/records-pending/diagnosis
for run in main1 branch1 main2 branch2; do
  case $run in main*) PP=/tmp/diag-main;; branch*) PP=/tmp/diag-branch;; esac
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  start=$(date +%s.%N)
  (cd /tmp && PYTHONPATH=$PP nice -n 10 $PY -m mla_verify.cli check --kernel mla_verify.kernels.mutants:correct_kernel --device cpu --profile premerge --report /tmp/diag-premerge-$run.json --fixtures-dir /tmp/diag-fx-$run > $OUT/premerge-$run.log 2>&1; echo "rc=$?" >> $OUT/premerge-$run.log)
  end=$(date +%s.%N)
  echo "$run wall=$(echo "$end - $start" | bc) load_before=$load load_after=$(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/premerge-times.txt
done
