#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/fuzz_capi.cpp, fuzz/fuzz_planner.cpp) with clang and
# ASan + UBSan over the CPU-only library sources (src/core, src/cpu, src/capi; no CMake), then
# runs each for SECONDS seconds (default 30).
#   tools/fuzz.sh [SECONDS] [target ...]        targets: capi planner (default both)
# Installs clang-14 + libclang-rt-14-dev if missing (tools/install-deps.sh fuzz).
# Environment: TESSERA_FUZZ_DIR (build + corpus folder, default build-fuzz/), TESSERA_FUZZ_CXX
# (default clang++-14), TESSERA_FUZZ_JOBS (compile jobs, default 2). Corpora persist in
# $TESSERA_FUZZ_DIR/corpus-*; crash inputs land in $TESSERA_FUZZ_DIR/artifacts/;
# fuzz/seeds/<target>/ (inputs of past findings) seed every run. Non-zero exit on any finding.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-30}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(capi planner)
bash "$root/tools/install-deps.sh" fuzz
out=${TESSERA_FUZZ_DIR:-$root/build-fuzz}
cxx=${TESSERA_FUZZ_CXX:-clang++-14}
command -v "$cxx" >/dev/null || cxx=clang++
jobs=${TESSERA_FUZZ_JOBS:-2}
mkdir -p "$out/obj" "$out/artifacts"

san=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
flags=(-std=c++20 -O1 -g -DTESSERA_VERSION='"fuzz"' -I"$root/include" -I"$root/src" -I"$root"
       "${san[@]}")

# Library objects (instrumented for coverage with fuzzer-no-link), rebuilt when newer sources.
compile() {
  local src=$1 obj isa=()
  obj="$out/obj/$(echo "${src#"$root"/}" | tr / _).o"
  case "$src" in
    *_avx512.cpp) isa=(-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -mavx2) ;;
    *_avx2.cpp) isa=(-mavx2 -mfma -mf16c) ;;
  esac
  if [ ! -f "$obj" ] || [ -n "$(find "$src" "$root/src" "$root/include" -newer "$obj" -name '*.[hc]pp' -print -quit)" ]; then
    "$cxx" "${flags[@]}" -fsanitize=fuzzer-no-link "${isa[@]}" -c "$src" -o "$obj"
  fi
  echo "$obj"
}
# src/nogpu: the empty GPU backend table of a CPU-only build (core/device_backend.hpp).
sources=("$root"/src/core/*.cpp "$root"/src/cpu/*.cpp "$root"/src/capi/*.cpp
         "$root"/src/nogpu/*.cpp)
objects=()
pids=()
running=0
for src in "${sources[@]}"; do
  obj="$out/obj/$(echo "${src#"$root"/}" | tr / _).o"
  objects+=("$obj")
  ( compile "$src" >/dev/null ) &
  pids+=($!)
  running=$((running + 1))
  if ((running >= jobs)); then wait "${pids[0]}"; pids=("${pids[@]:1}"); running=$((running - 1)); fi
done
for pid in "${pids[@]}"; do wait "$pid"; done

status=0
for target in "${targets[@]}"; do
  bin="$out/fuzz_$target"
  "$cxx" "${flags[@]}" -fsanitize=fuzzer "$root/fuzz/fuzz_$target.cpp" "${objects[@]}" -lpthread \
    -o "$bin"
  mkdir -p "$out/corpus-$target"
  echo "fuzz: $target for ${seconds}s"
  log="$out/fuzz_$target.log"
  # fuzz/seeds/<target>: checked-in inputs (past findings) read as extra corpus.
  if ! "$bin" "$out/corpus-$target" "$root/fuzz/seeds/$target" -max_total_time="$seconds" -max_len=512 -timeout=20 \
      -rss_limit_mb=3072 -print_final_stats=1 -artifact_prefix="$out/artifacts/${target}-" \
      >"$log" 2>&1; then
    status=1
    tail -n 60 "$log"
    echo "fuzz: $target FAILED (log: $log)"
  fi
  grep -E "^stat::number_of_executed_units|^stat::average_exec_per_sec|^#[0-9]+.*DONE" "$log" |
    sed "s/^/fuzz: $target: /" || true
done
exit $status
