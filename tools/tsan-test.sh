#!/usr/bin/env bash
# ThreadSanitizer: a CPU-only build with -fsanitize=thread (RelWithDebInfo) in build-tsan/ (or
# TESSERA_TSAN_BUILD_DIR), then the host tests that run the library from several threads (the
# CPU thread pool, concurrent plans and runs, the C API's per-thread errors, the once-only
# settings / tuning file / ISA choice). Any data race, lock-order inversion or other report
# aborts the test that hit it (halt_on_error), so ctest fails.
#   tools/tsan-test.sh [ctest options]
# TESSERA_TSAN_TESTS narrows the run to some of them (a ctest regex, e.g. 'test_threads').
# No suppressions: the library's races are fixed, never suppressed. Should a third-party library
# ever need one, put it in tools/tsan.supp with the reason; the run picks that file up.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/tools/install-deps.sh"
build=${TESSERA_TSAN_BUILD_DIR:-$root/build-tsan}
# The tests that matter for threads, and short enough under TSan (about 5-15x slower) on a
# 2-core CI host. The rest of the suite is single-threaded host code or planner maths.
tests=(test_threads test_capi test_capi_errors test_capi_sinks test_settings test_tuning
       test_api_sweep test_determinism test_cpu_attention)
flags="-fsanitize=thread -fno-omit-frame-pointer"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTESSERA_ENABLE_CUDA=OFF -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" \
  -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=thread" >/dev/null
cmake --build "$build" -j"$(nproc)" --target "${tests[@]}"
options=halt_on_error=1:second_deadlock_stack=1:history_size=4
[ -f "$root/tools/tsan.supp" ] && options+=":suppressions=$root/tools/tsan.supp"
export TSAN_OPTIONS=${TSAN_OPTIONS:-$options}
# Reduced case counts: TSan runs every memory access through its shadow state.
export TESSERA_TEST_REDUCED=${TESSERA_TEST_REDUCED:-1}
regex=${TESSERA_TSAN_TESTS:-$(IFS='|'; echo "${tests[*]}")}
# GCC 12's TSan runtime cannot place its shadow memory under more than 28 bits of mmap
# randomisation (the default of some newer kernels): run without ASLR there.
launcher=()
if [ "$(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo 28)" -gt 28 ]; then
  launcher=(setarch "$(uname -m)" -R)
fi
exec "${launcher[@]}" ctest --test-dir "$build" --output-on-failure -j"$(nproc)" -R "^($regex)\$" "$@"
