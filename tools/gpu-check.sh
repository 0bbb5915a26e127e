#!/usr/bin/env bash
# The device side of a GPU round trip. Run on a GPU host from a build made elsewhere:
#   tools/gpu-check.sh OUT_DIR [BUILD_DIR]
# Runs every test binary (GPU tests included), the reduced GPU set under compute-sanitizer
# (memcheck, racecheck, synccheck, initcheck), `tessera bench` (JSON) and the side-by-side
# comparison with torch SDPA, writing logs into OUT_DIR (at most 8 files).
# Environment: TESSERA_SKIP_SANITIZER=1, TESSERA_SKIP_BENCH=1, TESSERA_SKIP_PYTHON=1,
# TESSERA_BENCH_ARGS. Files: tests.log, sanitizer.log, bench.log/json, compare.log/json/png,
# python.log.
set -uo pipefail
out=${1:?usage: tools/gpu-check.sh OUT_DIR [BUILD_DIR]}
build=${2:-build}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
status=0
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  "$build/tessera" info
} >"$out/tests.log" 2>&1

# 1. Every test binary (CPU and GPU), one log.
for test in "$build"/tests/test_*; do
  [ -x "$test" ] || continue
  echo "=== $(basename "$test")" >>"$out/tests.log"
  if ! "$test" --gtest_brief=1 >>"$out/tests.log" 2>&1; then
    echo "FAILED: $(basename "$test")" | tee -a "$out/tests.log"
    status=1
  fi
done
grep -E "^(===|\[  PASSED|\[  FAILED|\[  SKIPPED|FAILED)" "$out/tests.log" | head -80

# 2. The reduced GPU set under compute-sanitizer.
if [ "${TESSERA_SKIP_SANITIZER:-0}" != 1 ]; then
  : >"$out/sanitizer.log"
  for tool in memcheck racecheck synccheck initcheck; do
    for test in "$build"/tests/test_cuda_*; do
      [ -x "$test" ] || continue
      # Only binaries that define a reduced *Sanitizer* set (the others run in full above).
      "$test" --gtest_list_tests --gtest_filter='*Sanitizer*' | grep -q '^  ' || continue
      echo "=== $tool $(basename "$test")" >>"$out/sanitizer.log"
      TESSERA_TEST_REDUCED=1 compute-sanitizer --tool "$tool" --error-exitcode 99 \
        "$test" --gtest_brief=1 --gtest_filter='*Sanitizer*' >>"$out/sanitizer.log" 2>&1
      rc=$?
      echo "exit $rc" >>"$out/sanitizer.log"
      [ $rc -eq 0 ] || status=1
    done
  done
  grep -E "^(===|exit|=========.*ERROR SUMMARY)" "$out/sanitizer.log"
fi

# 3. Benchmark and the side-by-side comparison, in the same device session.
if [ "${TESSERA_SKIP_BENCH:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  "$build/tessera" bench --quiet --json "$out/bench.json" ${TESSERA_BENCH_ARGS:-} \
    >"$out/bench.log" 2>&1 || status=1
  cat "$out/bench.log"
  PYTHONUNBUFFERED=1 python3 "$root/bench/compare.py" "$out/bench.json" \
    --out "$out/compare.json" --png "$out/compare.png" >"$out/compare.log" 2>&1 || status=1
  cat "$out/compare.log"
fi

# 4. The Python package's tests (torch, torch.compile, CUDA graphs, transformers) against the
#    library of this build.
if [ "${TESSERA_SKIP_PYTHON:-0}" != 1 ]; then
  TESSERA_LIBRARY="$(cd "$build" && pwd)/libtessera.so" PYTHONPATH="$root/python" \
    PYTHONUNBUFFERED=1 python3 -m pytest -q -rs -p no:cacheprovider "$root/tests/python" \
    >"$out/python.log" 2>&1 || status=1
  tail -15 "$out/python.log"
fi
exit $status
