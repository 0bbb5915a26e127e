#!/usr/bin/env bash
# Builds for the GPU machine on this (CPU-only) host and stages what a device run needs into
# .devbuild/ (git-ignored): the tessera command, libtessera.so and the test binaries.
# Then, with the device tool: carry [".devbuild"], command
#   tools/gpu-check.sh "$OUT" .devbuild
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TESSERA_GPU_BUILD_DIR:-$root/build-gpu}
# The device machine is an H200: sm_90a machine code is what runs there. Staging only that keeps
# libtessera.so under the 64 MiB a device call can carry (the default build has 80;90a).
archs=${TESSERA_STAGE_ARCHS:-90a}
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA_ARCHS="$archs" >/dev/null
start=$(date +%s)
cmake --build "$build" -j"$(nproc)"
echo "build: $(( $(date +%s) - start )) s"
rm -rf "$root/.devbuild"
mkdir -p "$root/.devbuild/tests"
cp "$build/tessera" "$build"/libtessera.so* "$root/.devbuild/"
cp "$build"/tests/test_* "$root/.devbuild/tests/"
# The soak (not a test_*: gpu-check.sh runs it only when TESSERA_SOAK_CYCLES is set).
cp "$build/tests/soak_cuda_graph" "$root/.devbuild/tests/"
strip --strip-unneeded "$root/.devbuild/tessera" "$root/.devbuild"/libtessera.so* \
  "$root/.devbuild/tests"/test_* "$root/.devbuild/tests/soak_cuda_graph" 2>/dev/null || true
du -sh "$root/.devbuild"
