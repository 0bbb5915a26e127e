#!/usr/bin/env bash
# The device side of an A/B run: several builds of libtessera.so timed against each other in the
# same call, alternating round by round (the machine's speed drifts from call to call by more
# than most kernel changes are worth; docs/log/PERF.md).
#   tools/gpu-ab.sh OUT_DIR BUILD_DIR TESTED VARIANT...
# BUILD_DIR is a staged build (tools/stage-gpu.sh): its tessera and tests/ run against each
# variant through LD_LIBRARY_PATH (their RUNPATH is $ORIGIN, searched after it). A variant NAME is
# BUILD_DIR/var/NAME.so.xz (tools/stage-variant.sh makes them) or, without that file, BUILD_DIR's
# own libtessera.so; "old" (BUILD_DIR/var/old.so.xz, or BUILD_DIR's library) is timed last in
# odd rounds and first in even ones. A variant VAR=VALUE is BUILD_DIR's library run with that
# environment setting (e.g. TESSERA_PLAN_L2_MB=0: a knob's other side timed without a second
# build). Steps, all
# into OUT_DIR/ab.log:
#   1. AB_TESTS (default: test_cuda_prefill test_cuda_graph test_api_sweep test_mixed_batch) and
#      test_cuda_prefill with TESSERA_SM90_WIDE=1, on each of TEST_VARIANTS (default TESTED;
#      AB_SKIP_TESTS=1: none);
#   2. ROUNDS (default 2) x (variants, old; reversed in even rounds) of `tessera bench --quiet
#      --filter AB_FILTER`
#      (default "prefill"), then as many with TESSERA_SM90_WIDE=1 on AB_WIDE_FILTER if set;
#   2b. with AB_NCU=FILTER, ncu's per-instruction stall samples of that case for each variant,
#      summarised by tools/ncu-stalls.py (AB_NCU_KERNEL: the kernel regex, default prefill_kernel);
#   3. memcheck, racecheck and synccheck of test_cuda_prefill's *Sanitizer* set on TESTED, by
#      default and with TESSERA_SM90_WIDE=1 (AB_SKIP_SANITIZER=1 skips them).
# Summarise with `python3 tools/ab-table.py OUT_DIR/ab.log` (each variant's mean and % vs old).
set -uo pipefail
out=${1:?usage: tools/gpu-ab.sh OUT_DIR BUILD_DIR TESTED VARIANT...}
build=$(cd "${2:?build dir}" && pwd)
tested=${3:?tested variant}
shift 3
log=$out/ab.log
# tools/stage-gpu.sh stores the library xz-compressed (the carry limit): unpack it once.
if [ ! -f "$build/libtessera.so" ] && [ -f "$build/libtessera.so.xz" ]; then
  xz -dk "$build/libtessera.so.xz"
fi
limit=${TESSERA_TIMEOUT:-200}
libs=$(mktemp -d)
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$log" 2>&1
for v in "$@" old; do
  mkdir -p "$libs/$v"
  if [ -f "$build/var/$v.so.xz" ]; then
    xz -dc "$build/var/$v.so.xz" >"$libs/$v/libtessera.so"
  else
    cp "$build/libtessera.so" "$libs/$v/"
  fi
done
[ -d "$libs/$tested" ] || { echo "gpu-ab: the tested variant $tested is not among $*" >&2; exit 2; }

# The environment setting a variant name carries (VAR=VALUE), or nothing.
setting() { [[ $1 == *=* ]] && echo "$1"; }

[ "${AB_SKIP_TESTS:-0}" = 1 ] && TEST_VARIANTS=" "  # step 1 off: the tests run elsewhere
for v in ${TEST_VARIANTS:-$tested}; do
  for t in ${AB_TESTS:-test_cuda_prefill test_cuda_graph test_api_sweep test_mixed_batch}; do
    [ -x "$build/tests/$t" ] || continue
    echo "=== [$v] $t" >>"$log"
    env LD_LIBRARY_PATH="$libs/$v" $(setting "$v") timeout "$limit" "$build/tests/$t" \
      --gtest_brief=1 >>"$log" 2>&1
    echo "exit $?" >>"$log"
  done
  echo "=== [$v] test_cuda_prefill (TESSERA_SM90_WIDE=1)" >>"$log"
  env LD_LIBRARY_PATH="$libs/$v" $(setting "$v") TESSERA_SM90_WIDE=1 timeout "$limit" \
    "$build/tests/test_cuda_prefill" --gtest_brief=1 >>"$log" 2>&1
  echo "exit $?" >>"$log"
done

# Even rounds run the variants in reverse order: a variant's place in a round biased its rate
# by up to 7% on some shapes (two processes running identical plans, 2026-12-06).
order() { if [ $(($1 % 2)) = 1 ]; then echo "$@" | cut -d' ' -f2-; else echo "$@" | cut -d' ' -f2- | tr ' ' '\n' | tac | tr '\n' ' '; fi; }
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in $(order "$r" "$@" old); do
    echo "=== [$v] bench round $r" >>"$log"
    env LD_LIBRARY_PATH="$libs/$v" $(setting "$v") timeout 300 "$build/tessera" bench --quiet \
      --filter "${AB_FILTER:-prefill}" >>"$log" 2>&1
  done
done
if [ -n "${AB_WIDE_FILTER:-}" ]; then
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for v in $(order "$r" "$@" old); do
      echo "=== [$v+wide] bench round $r" >>"$log"
      env LD_LIBRARY_PATH="$libs/$v" $(setting "$v") TESSERA_SM90_WIDE=1 timeout 300 \
        "$build/tessera" bench --quiet --filter "$AB_WIDE_FILTER" >>"$log" 2>&1
    done
  done
fi

# 2b. Optional (AB_NCU=FILTER): one launch of that bench case per variant under ncu with warp-stall
#     sampling per instruction, summarised by tools/ncu-stalls.py into the log (where each
#     variant's warps wait: "by wait target").
if [ -n "${AB_NCU:-}" ]; then
  index=0
  for v in "$@" old; do
    index=$((index + 1))
    echo "=== [$v] ncu '$AB_NCU'" >>"$log"
    env LD_LIBRARY_PATH="$libs/$v" $(setting "$v") NCU_TIMEOUT=300 \
      "$(dirname "$0")/ncu-source.sh" "$libs/ncu-$index.csv" "$build/tessera" "$AB_NCU" \
      "${AB_NCU_KERNEL:-prefill_kernel}" 8 >>"$log" 2>&1
  done
fi

if [ "${AB_SKIP_SANITIZER:-0}" != 1 ]; then
  for wide in 0 1; do
    for tool in memcheck racecheck synccheck; do
      echo "=== [$tested] $tool (TESSERA_SM90_WIDE=$wide)" >>"$log"
      env LD_LIBRARY_PATH="$libs/$tested" $(setting "$tested") TESSERA_TEST_REDUCED=1 \
        $([ $wide = 1 ] && echo TESSERA_SM90_WIDE=1) timeout "$limit" compute-sanitizer \
        --tool "$tool" --error-exitcode 99 "$build/tests/test_cuda_prefill" --gtest_brief=1 \
        --gtest_filter='*Sanitizer*' >>"$log" 2>&1
      echo "exit $?" >>"$log"
    done
  done
fi
rm -rf "$libs"
grep -E "^(===|exit|by wait target)|FAILED|ERROR SUMMARY" "$log" | grep -v " bench round "
