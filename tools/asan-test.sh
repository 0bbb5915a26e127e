#!/usr/bin/env bash
# Host sanitizers: a CPU-only build with ASan + UBSan (TESSERA_SANITIZE=ON, RelWithDebInfo) in
# build-asan/ (or TESSERA_ASAN_BUILD_DIR), then the whole ctest suite there. Any sanitizer report
# aborts the test that hit it (halt_on_error, -fno-sanitize-recover), so ctest fails.
#   tools/asan-test.sh [ctest options]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/tools/install-deps.sh"
build=${TESSERA_ASAN_BUILD_DIR:-$root/build-asan}
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTESSERA_ENABLE_CUDA=OFF -DTESSERA_SANITIZE=ON >/dev/null
cmake --build "$build" -j"$(nproc)"
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# GPU tests compile to a skipped stub in a CPU-only build; the reduced sets keep any test that
# honours TESSERA_TEST_REDUCED short under the sanitizers.
export TESSERA_TEST_REDUCED=${TESSERA_TEST_REDUCED:-1}
exec ctest --test-dir "$build" --output-on-failure -j"$(nproc)" "$@"
