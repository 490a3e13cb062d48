#!/bin/bash
OUT=/work/records-pending/diagnosis
PY=/work/wt-diagnosis/.venv/bin/python
export OMP_NUM_THREADS=1  # as .ci/run
FILES="tests/test_diagnose.py tests/test_localize.py tests/test_shadow_session.py tests/test_engine.py tests/test_kill_matrix.py"
l=$(cut -d' ' -f1-3 /proc/loadavg); s=$(date +%s)
(cd /tmp/diag-main && PYTHONPATH=/tmp/diag-main nice -n 10 $PY -m pytest -q -p no:cacheprovider --durations=0 $FILES > $OUT/pytest-main.log 2>&1)
echo "main rc=$? wall=$(( $(date +%s) - s )) load_before=$l load_after=$(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/pytest-times.txt
l=$(cut -d' ' -f1-3 /proc/loadavg); s=$(date +%s)
(cd /work/wt-diagnosis && nice -n 10 $PY -m pytest -q -p no:cacheprovider --durations=0 tests/test_diagnose_nan.py $FILES tests/test_imports.py tests/test_readme_layout.py > $OUT/pytest-branch.log 2>&1)
echo "branch rc=$? wall=$(( $(date +%s) - s )) load_before=$l load_after=$(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/pytest-times.txt
