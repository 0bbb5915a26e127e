#!/usr/bin/env bash
# Builds for the GPU machine on this (CPU-only) host and stages what a device run needs into
# .devbuild/ (git-ignored): the tessera command, libtessera.so (as libtessera.so.xz; the device
# scripts unpack it), the Python extension _fastcall.abi3.so and the test binaries.
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
# The Python package's run() fast path (abi3: the build host's Python headers serve the GPU
# host's Python): PYTHONPATH=python TESSERA_LIBRARY=.devbuild/libtessera.so finds it beside the
# library.
if [ -f "$build/_fastcall.abi3.so" ]; then
  cp "$build/_fastcall.abi3.so" "$root/.devbuild/"
  strip --strip-unneeded "$root/.devbuild/_fastcall.abi3.so" 2>/dev/null || true
else
  echo "stage-gpu: no _fastcall.abi3.so (Python headers not found): Python uses its ctypes path"
fi
cp "$build"/tests/test_* "$root/.devbuild/tests/"
# The soak (not a test_*: gpu-check.sh runs it only when TESSERA_SOAK_CYCLES is set).
cp "$build/tests/soak_cuda_graph" "$root/.devbuild/tests/"
# The sm90 micro-benchmarks of bench/ (TMA box shapes, wgmma forms): gpu-check.sh runs them
# with TESSERA_MICRO=1. A few seconds each; nvcc directly, as their headers describe.
mkdir -p "$root/.devbuild/bench"
for micro in tma_boxes wgmma_rates; do
  extra=()
  [ "$micro" = tma_boxes ] && extra=("$root/src/cuda/sm90/tensor_map.cpp")
  nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -I"$root/src" -I"$root/include" \
    "$root/bench/$micro.cu" "${extra[@]}" -o "$root/.devbuild/bench/$micro"
done
strip --strip-unneeded "$root/.devbuild/tessera" "$root/.devbuild"/libtessera.so* \
  "$root/.devbuild/tests"/test_* "$root/.devbuild/tests/soak_cuda_graph" 2>/dev/null || true
# The library xz-compressed (44 MiB -> ~5): a device call carries at most 64 MiB, and an A/B
# run carries variant libraries beside it. gpu-check.sh and gpu-ab.sh unpack it.
rm -f "$root/.devbuild/libtessera.so.xz"
xz -T0 -6 "$root/.devbuild/libtessera.so"
du -sh "$root/.devbuild"
