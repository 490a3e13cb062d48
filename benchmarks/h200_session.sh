#!/usr/bin/env bash
# One GPU session on the lent H200, in phases, everything logged and packed into $OUT/results.tar.gz.
#   source .gpu-bundle/activate.sh && MLA_COMMIT=<hash> bash benchmarks/h200_session.sh env warm gputests refbench bench
#   source .gpu-bundle/activate.sh && FUZZ_MINUTES=5.2 bash benchmarks/h200_session.sh env fuzz
#   source .gpu-bundle/activate.sh && MLA_COMMIT=<hash> bash benchmarks/h200_session.sh env flashmla
#   source .gpu-bundle/activate.sh && FUZZ_BACKENDS="flashmla flashmla-fp8" bash benchmarks/h200_session.sh fuzz
# (carry .gpu-bundle, and .whl when it holds wheels to install, e.g. sgl-flash-mla for the flashmla backends)
# Phases: env (versions, doctor, commit), probe (tolerance calibration), warm (JIT-builds every variant of
# WARM_BACKENDS, benchmarks/warm_jit.py), gputests (pytest -m gpu, GPU_TEST_WORKERS workers on the GPU),
# reftests (tests/test_reference_cuda.py alone), refbench (reference vs fa3 time and memory), bench (grid twice
# + agreement), fuzz (FUZZ_BACKENDS side by side, FUZZ_MINUTES each), premerge (the gate on PREMERGE_BACKENDS),
# parallel (gputests, probe and fuzz at once), final (fuzz, gputests and premerge at once, GPU memory sampled
# each second), flashmla (issue 29's gate: premerge of flashmla and its GPU tests, only once doctor names the
# sgl-flash-mla wheel), acceptance (fuzz beside gputests, then premerge, then ALONE_TESTS alone), isolation (the cost of check --isolate: benchmarks/isolation_cost.sh, after warm).
# FUZZ_BACKENDS and PREMERGE_BACKENDS default to "fa3 fa2", BENCH_BACKENDS to "fa2 fa3" (sparse ones get the
# sparse grid; BENCH_ARGS adds bench options, e.g. "--grid anchor"), GPU_TESTS (the test paths) to tests. fuzz and
# premerge run isolated (check's default on CUDA); the crash tests alone:
# GPU_TESTS=tests/gpu/test_crash_gpu.py ... gputests.
set -uo pipefail
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
R=${OUT:-/tmp/mla-out}/r
REG=${REGRESSIONS:-/tmp/mla-regressions}  # reproducers stay on the host (each may hold up to 16 MiB); listed in $R
mkdir -p "$R" "$REG"
log() { echo "== $(date -u +%FT%TZ) $*" | tee -a "$R/session.log"; }
if [ -z "${MLA_SESSION_CHILD:-}" ]; then  # once per session, not in the parallel phase's children
  WS=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-ws}
  export FLASHINFER_WORKSPACE_BASE=$WS  # where FlashInfer builds: the cache packed at the end is this one
  # FlashInfer's JIT builds (fa2/fa3, ~25 s each) come back as jit-cache.tar.gz; carried in .gpu-bundle/ next time.
  # Unpacked on a fresh machine only: over the newer cache of a warm one it makes FlashInfer rebuild
  if [ -f .gpu-bundle/jit-cache.tar.gz ] && [ ! -d "$WS/.cache" ]; then
    mkdir -p "$WS" && tar xzf .gpu-bundle/jit-cache.tar.gz -C "$WS"
  fi
  finish() {
    (cd "$REG" && find . -type f -printf "%s %p\n") > "$R/regressions.txt"
    find "$REG" -type f -size -256k -name "*.json" -exec cp --parents {} "$R" \;
    tar czf "${OUT:-/tmp/mla-out}/results.tar.gz" -C "$R" .
    [ -d "$WS" ] && tar czf "${OUT:-/tmp/mla-out}/jit-cache.tar.gz" -C "$WS" .
    ls -la "$R" "${OUT:-/tmp/mla-out}"
  }
  trap finish EXIT
  python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . > "$R/pip.log" 2>&1 \
    || log "editable install failed (see pip.log)"
  # carried wheels (.whl/, e.g. sgl-flash-mla, installed --no-deps: its metadata asks for a newer torch)
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$R/pip.log" 2>&1 \
      || log "carried wheels failed to install (see pip.log)"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # the phases' child processes find them too
  fi
fi
export MLA_SESSION_CHILD=1
PLUGIN="-p no:mla_verify -p mla_verify.pytest_plugin"  # works whether or not the entry point is installed
MV="python3 -m mla_verify.cli"
for phase in "$@"; do
  log "phase $phase"
  case $phase in
    env)
      echo "commit ${MLA_COMMIT:-unknown (set MLA_COMMIT)}" | tee "$R/commit.txt"
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$R/nvidia-smi.csv"
      $MV doctor 2>&1 | tee "$R/doctor.txt"
      # the host that issues the launches (the reference's time on a GPU follows it, docs/reference.md): its
      # CPU, load, and the steal time the hypervisor took from its vCPUs over 5 s (/proc/stat, USER_HZ ticks)
      { grep -m1 "model name" /proc/cpuinfo; grep "cpu MHz" /proc/cpuinfo | sort | uniq -c | head -4
        echo "loadavg $(cat /proc/loadavg)"; a=$(awk '/^cpu /{print $9}' /proc/stat); sleep 5
        echo "steal ticks over 5 s, all vCPUs: $(( $(awk '/^cpu /{print $9}' /proc/stat) - a ))"; } | tee "$R/host.txt" ;;
    warm)
      start=$SECONDS
      python3 benchmarks/warm_jit.py $(printf -- "--backend %s " ${WARM_BACKENDS:-fa3 fa2}) 2>&1 | tee "$R/warm.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || log "warm: a variant did not pass (warm.log); its first timed call compiles"
      log "warm took $((SECONDS - start)) s" ;;
    gputests)
      start=$SECONDS; MLA_VERIFY_GPU_RECORD="$R/gpu_record" python3 -m pytest $PLUGIN -m gpu -n ${GPU_TEST_WORKERS:-4} -q -p no:cacheprovider -rs ${GPU_TESTS:-tests} \
        2>&1 | tee "$R/pytest_gpu.log" | tail -40; log "pytest -m gpu took $((SECONDS - start)) s" ;;
    probe)
      python3 benchmarks/tolerance_probe.py --backend fa3 --backend fa2 --cases "${PROBE_CASES:-80}" \
        --out "$R/probe" 2>&1 | tee "$R/probe.log" | tail -4 ;;
    reftests)  # the reference's own GPU tests alone (tests/test_reference_cuda.py)
      python3 -m pytest $PLUGIN -q -p no:cacheprovider tests/test_reference_cuda.py 2>&1 | tee "$R/reftests.log" | tail -5 ;;
    refbench)
      python3 benchmarks/reference_vs_fa3.py --profile --out "$R/refbench" 2>&1 | tee "$R/refbench.log" ;;
    bench)
      for run in bench1 bench2; do
        $MV bench --device cuda $(printf -- "--backend %s " ${BENCH_BACKENDS:-fa2 fa3}) ${BENCH_ARGS:-} \
          --out "$R/$run" 2>&1 | tee "$R/$run.log"
      done
      $MV bench --result "$R/bench2/bench.json" --compare "$R/bench1/bench.json" --threshold 0.05 \
        2>&1 | tee "$R/bench_agreement.log" ;;
    fuzz)
      for b in ${FUZZ_BACKENDS:-fa3 fa2}; do
        $MV check --backend $b --device cuda --profile fuzz --minutes "${FUZZ_MINUTES:-5.2}" \
          --report "$R/fuzz_$b.json" --fixtures-dir "$REG" > "$R/fuzz_$b.log" 2>&1 &
      done
      wait
      tail -5 "$R"/fuzz_*.log ;;
    parallel)  # correctness work shares the GPU fine (timings are taken in the other phases, alone)
      bash "$0" fuzz > "$R/par_fuzz.log" 2>&1 &
      GPU_TEST_WORKERS=2 bash "$0" gputests > "$R/par_gputests.log" 2>&1 &
      PROBE_CASES=${PROBE_CASES:-40} bash "$0" probe > "$R/par_probe.log" 2>&1 &
      wait
      tail -n 3 "$R"/par_*.log ;;
    final)  # fuzz, the GPU tests and the premerge gate side by side
      nvidia-smi --query-gpu=timestamp,memory.used,memory.total --format=csv,noheader -l 1 > "$R/mem_used.txt" &
      sampler=$!
      bash "$0" fuzz > "$R/par_fuzz.log" 2>&1 &
      fuzz=$!
      GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-2} bash "$0" gputests > "$R/par_gputests.log" 2>&1 &
      tests=$!
      bash "$0" premerge > "$R/par_premerge.log" 2>&1 &
      wait $fuzz $tests $!
      kill $sampler
      tail -n 4 "$R"/par_*.log ;;
    acceptance)  # the fuzz beside the GPU tests (cut at GPUTESTS_S), then the premerge gate and ALONE_TESTS
      # (tests that want the GPU's memory to themselves, e.g. tests/gpu/test_large_pool.py) one after the other
      bash "$0" fuzz > "$R/par_fuzz.log" 2>&1 &
      fuzz=$!
      timeout -s INT "${GPUTESTS_S:-330}" bash "$0" gputests > "$R/par_gputests.log" 2>&1
      wait $fuzz
      tail -n 3 "$R"/fuzz_*.log
      bash "$0" premerge > "$R/par_premerge.log" 2>&1
      grep -E ": (PASS|FAIL)" "$R/premerge_gpu.log"
      if [ -n "${ALONE_TESTS:-}" ]; then
        MLA_VERIFY_GPU_RECORD="$R/gpu_record" python3 -m pytest $PLUGIN -m gpu -q -p no:cacheprovider -rs $ALONE_TESTS \
          2>&1 | tee "$R/pytest_alone.log" | tail -8
      fi ;;
    flashmla)  # the wheel must be the FlashMLA found: without it every flashmla case would only skip
      $MV doctor 2>&1 | grep "^flashmla " | tee "$R/flashmla_build.txt"
      if ! grep -q "^flashmla wheel sgl.flash.mla" "$R/flashmla_build.txt"; then
        log "flashmla: doctor names no sgl-flash-mla wheel (carry it in .whl/); phase not run"; continue
      fi
      $MV check --backend flashmla --device cuda --profile premerge --report "$R/premerge_flashmla.json" \
        --fixtures-dir "$REG" 2>&1 | tee "$R/premerge_flashmla.log"
      MLA_VERIFY_GPU_RECORD="$R/gpu_record" python3 -m pytest $PLUGIN -m gpu -n ${GPU_TEST_WORKERS:-4} -q \
        -p no:cacheprovider -rsw tests/gpu/test_flashmla_gpu.py 2>&1 | tee "$R/pytest_flashmla_gpu.log" | tail -40 ;;
    premerge)
      $MV check $(printf -- "--backend %s " ${PREMERGE_BACKENDS:-fa3 fa2}) --device cuda --profile premerge \
        --report "$R/premerge_gpu.json" --fixtures-dir "$REG" 2>&1 | tee "$R/premerge_gpu.log" ;;
    isolation)  # warm fuzz with and without a worker process per case, alternated twice (~4 x FUZZ_MINUTES)
      MINUTES=${FUZZ_MINUTES:-1} bash benchmarks/isolation_cost.sh 2>&1 | tee "$R/isolation.log" ;;
    *) log "unknown phase $phase" ;;
  esac
done
