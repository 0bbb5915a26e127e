#!/usr/bin/env bash
# The device side of a GPU round trip. Run on a GPU host from a build made elsewhere:
#   tools/gpu-check.sh OUT_DIR [BUILD_DIR]
# Runs every test binary (GPU tests included), the SASS check of the sm90 kernels, the reduced
# GPU set under compute-sanitizer (memcheck, racecheck, synccheck, initcheck), `tessera bench`
# (JSON; prefill also on the portable sm80 kernels for the side-by-side), the comparison with
# torch SDPA, and the Python GPU tests, writing logs into OUT_DIR (at most 8 files come back).
# Every binary runs under `timeout` so a hung kernel costs minutes, not the whole call.
# Environment: TESSERA_SKIP_TESTS=1, TESSERA_SKIP_SANITIZER=1, TESSERA_SKIP_BENCH=1,
# TESSERA_SKIP_PYTHON=1, TESSERA_SKIP_SM80_BENCH=1 (no sm80 side-by-side bench),
# TESSERA_TEST_FILTER (gtest filter for the test binaries), TESSERA_PREFILL_TEST_PASSES and
# TESSERA_SANITIZER_PASSES (the prefill suite / its sanitizer set again under other settings),
# TESSERA_TESTS (space-separated binary names, default all), TESSERA_BENCH_ARGS,
# TESSERA_TIMEOUT (seconds per binary, default 300).
# Soak (optional, off by default so the usual run keeps its length): TESSERA_SOAK_CYCLES=N runs
# tests/soak_cuda_graph (N plan/upload/CUDA-graph replay cycles, memory measured; 100000 is the
# issue-7 figure) after the test binaries, even with TESSERA_SKIP_TESTS=1, under
# TESSERA_SOAK_TIMEOUT seconds (default TESSERA_TIMEOUT); its output goes to tests.log.
# TESSERA_EXTRA=1: host overheads, plan() times, DRAM read ceilings, decode under the read
# flush, HF latency. TESSERA_MICRO=1: the micro-benchmarks of bench/ (TMA box shapes, wgmma
# forms) first, into micro.log.
# TESSERA_BENCH_VARIANTS: A/B runs of the bench in the same call, ';'-separated, each
# "VAR=VALUE[,VAR=VALUE...][@FILTER]" (e.g. "TESSERA_BENCH_PAGES=ordered@p16;TESSERA_SM90_WIDE=0@prefill"),
# into bench-variants.log.
# FlashInfer (optional): when the repo root holds .whl/ (flashinfer-python and the wheels it
# needs, docs/DEVELOPING.md; carried), they are installed into /tmp/site and bench/compare.py
# times FlashInfer beside SDPA, JIT-compiling into FLASHINFER_WORKSPACE_BASE (default
# /tmp/flashinfer; MAX_JOBS nvcc jobs, default 12) first, and writes flashinfer.json
# (tools/perf-doc.py reads it).
# TESSERA_SKIP_FLASHINFER=1 leaves it out; TESSERA_COMPARE_ARGS: extra compare.py arguments
# (e.g. "--flashinfer-only", "--filter d128").
# Files: micro.log, tests.log (tests, SASS, sanitizer), bench.log/json, compare.log/json/png,
# flashinfer.json, python.log, ncu.log, ncu-source-N.csv, extra.log, extra-decode-compare.json,
# bench-variants.log.
set -uo pipefail
out=${1:?usage: tools/gpu-check.sh OUT_DIR [BUILD_DIR]}
build=${2:-build}
mkdir -p "$out"
# tools/stage-gpu.sh stores the library xz-compressed (the carry limit): unpack it once.
if [ ! -f "$build/libtessera.so" ] && [ -f "$build/libtessera.so.xz" ]; then
  xz -dk "$build/libtessera.so.xz"
fi
root=$(cd "$(dirname "$0")/.." && pwd)
limit=${TESSERA_TIMEOUT:-300}
status=0
log="$out/tests.log"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  "$build/tessera" info
} >"$log" 2>&1

# 0. Optional (TESSERA_MICRO=1): the sm90 micro-benchmarks that tools/stage-gpu.sh builds.
if [ "${TESSERA_MICRO:-0}" = 1 ]; then
  for micro in "$build"/bench/*; do
    [ -x "$micro" ] || continue
    echo "=== $(basename "$micro")"
    timeout 120 "$micro" || { echo "FAILED: $(basename "$micro")"; status=1; }
  done >"$out/micro.log" 2>&1
  cat "$out/micro.log"
fi

# 1. Every test binary (CPU and GPU), one log.
if [ "${TESSERA_SKIP_TESTS:-0}" != 1 ]; then
  for test in "$build"/tests/test_*; do
    [ -x "$test" ] || continue
    name=$(basename "$test")
    if [ -n "${TESSERA_TESTS:-}" ] && [[ " $TESSERA_TESTS " != *" $name "* ]]; then continue; fi
    echo "=== $name" >>"$log"
    start=$(date +%s)
    timeout "$limit" "$test" --gtest_brief=1 --gtest_filter="${TESSERA_TEST_FILTER:-*}" \
      >>"$log" 2>&1
    rc=$?
    echo "exit $rc after $(( $(date +%s) - start )) s" >>"$log"
    if [ $rc -ne 0 ]; then
      echo "FAILED: $name (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))" | tee -a "$log"
      status=1
    fi
  done
  # The prefill suite again under settings that change which kernel path serves it: the d128
  # 176-key-tile kernel (by default only for requests of >= 4096 keys) forced on for every
  # non-causal ragged case, every K/V tile gathered (cp.async: the path of tails and unaligned
  # pages, into the ragged and the page-by-page V layouts), and any TESSERA_PREFILL_TEST_PASSES
  # (';'-separated "VAR=VALUE[,VAR=VALUE]").
  if [ -x "$build/tests/test_cuda_prefill" ] && { [ -z "${TESSERA_TESTS:-}" ] ||
      [[ " $TESSERA_TESTS " == *" test_cuda_prefill "* ]]; }; then
    IFS=';' read -ra prefill_passes <<<"TESSERA_SM90_WIDE=1;TESSERA_SM90_KV=gather${TESSERA_PREFILL_TEST_PASSES:+;$TESSERA_PREFILL_TEST_PASSES}"
    for pass in "${prefill_passes[@]}"; do
      IFS=',' read -ra assignments <<<"$pass"
      echo "=== test_cuda_prefill ($pass)" >>"$log"
      timeout "$limit" env "${assignments[@]}" "$build/tests/test_cuda_prefill" --gtest_brief=1 \
        --gtest_filter="${TESSERA_TEST_FILTER:-*}" >>"$log" 2>&1
      rc=$?
      echo "exit $rc" >>"$log"
      if [ $rc -ne 0 ]; then echo "FAILED: test_cuda_prefill with $pass" | tee -a "$log"; status=1; fi
    done
  fi
  grep -E "^(===|exit|\[  PASSED|\[  FAILED|\[  SKIPPED|FAILED)" "$log" | head -80
fi

# 1b. Optional: the CUDA-graph soak (tests/soak_cuda_graph.cpp), when TESSERA_SOAK_CYCLES is set.
if [ -n "${TESSERA_SOAK_CYCLES:-}" ]; then
  soak="$build/tests/soak_cuda_graph"
  echo "=== soak_cuda_graph ($TESSERA_SOAK_CYCLES cycles)" >>"$log"
  if [ -x "$soak" ]; then
    start=$(date +%s)
    timeout "${TESSERA_SOAK_TIMEOUT:-$limit}" "$soak" "$TESSERA_SOAK_CYCLES" >>"$log" 2>&1
    rc=$?
    echo "exit $rc after $(( $(date +%s) - start )) s" >>"$log"
    if [ $rc -ne 0 ]; then
      echo "FAILED: soak_cuda_graph (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))" |
        tee -a "$log"
      status=1
    fi
  else
    echo "FAILED: soak_cuda_graph: $soak not found (tools/stage-gpu.sh stages it)" | tee -a "$log"
    status=1
  fi
  sed -n '/^=== soak_cuda_graph/,$p' "$log" |
    grep -E "^(===|exit|FAILED|soak: ([0-9]+ cycles|PASS|FAIL|ERROR|spot check|memory|warm-up))"
fi

# 2. The sm90 kernels are what we think they are: HGMMA and TMA in the SASS, no local memory.
{
  echo "=== SASS check"
  bash "$root/tools/check-sass.sh" "$build/libtessera.so"
} >>"$log" 2>&1 || status=1
grep -A12 "^=== SASS check" "$log" | tail -12

# 3. The reduced GPU set under compute-sanitizer.
if [ "${TESSERA_SKIP_SANITIZER:-0}" != 1 ]; then
  echo "=== sanitizer" >>"$log"
  for tool in memcheck racecheck synccheck initcheck; do
    for test in "$build"/tests/test_cuda_*; do
      [ -x "$test" ] || continue
      # Only binaries that define a reduced *Sanitizer* set (the others run in full above).
      "$test" --gtest_list_tests --gtest_filter='*Sanitizer*' | grep -q '^  ' || continue
      echo "=== $tool $(basename "$test")" >>"$log"
      TESSERA_TEST_REDUCED=1 timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 99 \
        "$test" --gtest_brief=1 --gtest_filter='*Sanitizer*' >>"$log" 2>&1
      rc=$?
      echo "exit $rc" >>"$log"
      [ $rc -eq 0 ] || status=1
    done
  done
  # The prefill set again under other settings (TESSERA_SANITIZER_PASSES, ';'-separated
  # "VAR=VALUE[,VAR=VALUE]"): memcheck, racecheck and synccheck.
  sanitizer_passes=()
  [ -z "${TESSERA_SANITIZER_PASSES:-}" ] || IFS=';' read -ra sanitizer_passes <<<"$TESSERA_SANITIZER_PASSES"
  for pass in ${sanitizer_passes[@]+"${sanitizer_passes[@]}"}; do
    [ -x "$build/tests/test_cuda_prefill" ] || continue
    IFS=',' read -ra assignments <<<"$pass"
    for tool in memcheck racecheck synccheck; do
      echo "=== $tool test_cuda_prefill ($pass)" >>"$log"
      TESSERA_TEST_REDUCED=1 timeout "$limit" env "${assignments[@]}" compute-sanitizer \
        --tool "$tool" --error-exitcode 99 "$build/tests/test_cuda_prefill" --gtest_brief=1 \
        --gtest_filter='*Sanitizer*' >>"$log" 2>&1
      rc=$?
      echo "exit $rc" >>"$log"
      [ $rc -eq 0 ] || status=1
    done
  done
  sed -n '/^=== sanitizer/,$p' "$log" | grep -E "^(===|exit|=========.*ERROR SUMMARY)"
fi

# 3b. Optional: FlashInfer for the comparison, from the wheels in .whl/ (installed with
#     --no-deps; no network there). compare_env holds what compare.py then runs with; without
#     .whl it stays empty and compare.py runs as before (it says FlashInfer was not found).
compare_env=()
flashinfer_out=()
if [ "${TESSERA_SKIP_FLASHINFER:-0}" != 1 ] && compgen -G "$root/.whl/*.whl" >/dev/null; then
  site=/tmp/site
  fi_base=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer}
  mkdir -p "$fi_base"
  {
    echo "=== FlashInfer wheels: $(cd "$root/.whl" && ls ./*.whl | tr '\n' ' ')"
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$root"/.whl/*.whl; then
      fi_import() {
        PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" FLASHINFER_WORKSPACE_BASE="$fi_base" \
          timeout 300 python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)'
      }
      if ! fi_import && [ -d "$site/cudnn" ]; then
        # flashinfer imports the cuDNN frontend only for its cudnn backend (and catches an
        # ImportError); if the frontend itself breaks the import, go on without it.
        echo "flashinfer did not import: again without nvidia-cudnn-frontend"
        rm -rf "$site/cudnn" "$site"/nvidia_cudnn_frontend*
        fi_import || true
      fi
    else
      echo "FAILED: pip install of .whl/*.whl"
    fi
  } 2>&1 | tee -a "$log"
  # MAX_JOBS: FlashInfer's parallel nvcc jobs (its sm90 kernels take several GB each to build).
  compare_env=(env "PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}"
    "FLASHINFER_WORKSPACE_BASE=$fi_base" "MAX_JOBS=${MAX_JOBS:-12}")
  flashinfer_out=(--flashinfer-out "$out/flashinfer.json")
fi

# 4. Benchmark and the side-by-side comparison, in the same device session.
if [ "${TESSERA_SKIP_BENCH:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  timeout 900 "$build/tessera" bench --quiet --json "$out/bench.json" ${TESSERA_BENCH_ARGS:-} \
    >"$out/bench.log" 2>&1 || status=1
  cat "$out/bench.log"
  if [ "${TESSERA_SKIP_SM80_BENCH:-0}" != 1 ]; then
    echo "--- the same prefill shapes on the portable sm80 kernels (TESSERA_PREFILL_KERNEL=sm80)" \
      >>"$out/bench.log"
    TESSERA_PREFILL_KERNEL=sm80 timeout 900 "$build/tessera" bench --quiet --filter prefill \
      >>"$out/bench.log" 2>&1 || status=1
  fi
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 timeout 900 ${compare_env[@]+"${compare_env[@]}"} python3 \
    "$root/bench/compare.py" "$out/bench.json" --out "$out/compare.json" --png "$out/compare.png" \
    ${flashinfer_out[@]+"${flashinfer_out[@]}"} ${TESSERA_COMPARE_ARGS:-} \
    >"$out/compare.log" 2>&1 || status=1
  cat "$out/compare.log"
fi

# 4b. Optional: the bench again under other settings (TESSERA_BENCH_VARIANTS), for A/B
#     comparisons measured in the same call as the default run above.
if [ -n "${TESSERA_BENCH_VARIANTS:-}" ]; then
  IFS=';' read -ra variants <<<"$TESSERA_BENCH_VARIANTS"
  for variant in "${variants[@]}"; do
    settings=${variant%%@*}
    filter=
    [ "$settings" != "$variant" ] && filter=${variant#*@}
    IFS=',' read -ra assignments <<<"$settings"
    echo "=== ${settings} (filter: ${filter:-all})" >>"$out/bench-variants.log"
    timeout 900 env "${assignments[@]}" "$build/tessera" bench --quiet ${filter:+--filter "$filter"} \
      >>"$out/bench-variants.log" 2>&1 || status=1
  done
  cat "$out/bench-variants.log"
fi

# 5. Optional: one launch of each of some bench cases under Nsight Compute. TESSERA_NCU =
#    ';'-separated cases "FILTER[@KERNEL_REGEX]" (a bench filter, and a kernel-name regex,
#    default TESSERA_NCU_KERNEL or prefill_kernel), all into ncu.log.
if [ -n "${TESSERA_NCU:-}" ]; then
  IFS=';' read -ra ncu_cases <<<"$TESSERA_NCU"
  case_index=0
  for ncu_case in "${ncu_cases[@]}"; do
    case_index=$((case_index + 1))
    ncu_filter=${ncu_case%%@*}
    ncu_kernel=${TESSERA_NCU_KERNEL:-prefill_kernel}
    [ "$ncu_filter" != "$ncu_case" ] && ncu_kernel=${ncu_case#*@}
    echo "=== ncu case $case_index: '$ncu_filter', kernel regex '$ncu_kernel'" >>"$out/ncu.log"
    timeout 600 ncu --clock-control none --kernel-name "regex:$ncu_kernel" \
      --launch-skip 3 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section InstructionStats \
      --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      "$build/tessera" bench --quiet --filter "$ncu_filter" >>"$out/ncu.log" 2>&1 || status=1
    # TESSERA_NCU_SOURCE=1: the same launch with warp-stall sampling per SASS instruction, as
    # CSV in ncu-source-N.csv, and where the warps wait (tools/ncu-stalls.py) in ncu.log.
    if [ "${TESSERA_NCU_SOURCE:-0}" = 1 ]; then
      "$root/tools/ncu-source.sh" "$out/ncu-source-$case_index.csv" "$build/tessera" \
        "$ncu_filter" "$ncu_kernel" >>"$out/ncu.log" 2>&1 || status=1
    fi
  done
  grep -E "^=== ncu|by opcode|by wait target|samples \(|Duration|Throughput|Pipe|Issued|Stall|Warp Cycles|Eligible|Registers|Achieved" \
    "$out/ncu.log" | head -120
fi

# 6. Optional (TESSERA_EXTRA=1): host overheads and ceilings, into extra.log. The C++ and Python
#    per-call host cost with its pieces and the launch floor, the DRAM read ceiling of the decode
#    shapes with the L2 flushed by writes (the default timing) and by reads, the decode bench and
#    its SDPA comparison again with the read flush, and the Hugging Face latency script.
if [ "${TESSERA_EXTRA:-0}" = 1 ]; then
  extra="$out/extra.log"
  lib="$(cd "$build" && pwd)/libtessera.so"
  {
    echo "=== bench --suite overhead"; "$build/tessera" bench --suite overhead
    echo "=== bench --suite plan"; "$build/tessera" bench --suite plan
    echo "=== bench --suite roofline (write flush)"; "$build/tessera" bench --suite roofline
    echo "=== bench --suite roofline (read flush)"
    TESSERA_BENCH_FLUSH=read "$build/tessera" bench --suite roofline
    echo "=== python_overhead.py --breakdown"
    TESSERA_LIBRARY="$lib" PYTHONPATH="$root/python" timeout 300 python3 \
      "$root/bench/python_overhead.py" --calls 5000 --breakdown
    echo "=== decode bench + compare, read flush"
    TESSERA_BENCH_FLUSH=read timeout 600 "$build/tessera" bench --quiet --filter decode \
      --json "$out/extra-decode.json"
    TESSERA_BENCH_FLUSH=read timeout 600 python3 "$root/bench/compare.py" \
      "$out/extra-decode.json" --out "$out/extra-decode-compare.json"
    echo "=== hf_latency.py"
    TESSERA_LIBRARY="$lib" PYTHONPATH="$root/python" timeout 600 python3 \
      "$root/bench/hf_latency.py" --seq-len 8192 --decode-tokens 32
  } >"$extra" 2>&1 || status=1
  rm -f "$out/extra-decode.json"
  grep -v "^\[" "$extra" | tail -80
fi

# 7. The Python package's tests (torch, torch.compile, CUDA graphs, transformers) against the
#    library of this build.
if [ "${TESSERA_SKIP_PYTHON:-0}" != 1 ]; then
  TESSERA_LIBRARY="$(cd "$build" && pwd)/libtessera.so" PYTHONPATH="$root/python" \
    PYTHONUNBUFFERED=1 timeout 900 python3 -m pytest -q -rs -p no:cacheprovider "$root/tests/python" \
    >"$out/python.log" 2>&1 || status=1
  tail -15 "$out/python.log"
fi
exit $status
