#!/usr/bin/env bash
# What judging each case in a worker process costs (check --isolate, docs/cli.md): the warm fuzz throughput of
# one backend with and without isolation, alternated twice so that drift of the machine shows. Each line is the
# run's "N judged in S s (R/s)" summary. The same seed in every run: the same stream of cases.
#   source .gpu-bundle/activate.sh && bash benchmarks/h200_session.sh env warm isolation   (warm-up + 4 x 1 min)
# BACKEND (default fa3), MINUTES (default 1), DEVICE (default cuda; cpu skips the JIT warm-up).
set -uo pipefail
BACKEND=${BACKEND:-fa3}
MINUTES=${MINUTES:-1}
DEVICE=${DEVICE:-cuda}
FX=$(mktemp -d)
if [ "$DEVICE" != cpu ]; then
  python3 benchmarks/warm_jit.py --backend "$BACKEND" --device "$DEVICE" > /dev/null 2>&1 \
    || echo "warm-up: a variant did not pass; its first timed call compiles"
fi
for mode in --no-isolate --isolate --no-isolate --isolate; do
  python3 -m mla_verify.cli check --backend "$BACKEND" --device "$DEVICE" --profile fuzz --minutes "$MINUTES" \
    --seed 1 "$mode" --fixtures-dir "$FX" 2>/dev/null | grep -E "judged in|^FAIL|: (PASS|FAIL) --" | sed "s/^/$mode: /"
done
