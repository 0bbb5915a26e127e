#!/usr/bin/env bash
# One entry point for a fresh machine: installs dependencies, builds, then runs
#   tools/run.sh bench [tessera bench options]   the main job (GPU if present, else CPU)
#   tools/run.sh test  [ctest options]           the test suite (GPU tests skip without a GPU)
# Environment: TESSERA_BUILD_DIR (default build/), TESSERA_CMAKE_ARGS (extra configure flags).
# Without a visible GPU (no /dev/nvidia0, no `nvidia-smi -L` output) the build is CPU-only
# (-DTESSERA_ENABLE_CUDA=OFF: minutes less on a small machine) unless TESSERA_CMAKE_ARGS names
# TESSERA_ENABLE_CUDA, e.g. TESSERA_CMAKE_ARGS=-DTESSERA_ENABLE_CUDA=ON to compile the CUDA
# backends anyway (CI does). The flag is passed on every configure, so the CMake cache of the
# build folder follows it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
action=${1:-}
case "$action" in
  bench|test) shift ;;
  *) echo "usage: tools/run.sh bench|test [options]" >&2; exit 2 ;;
esac
bash "$root/tools/install-deps.sh"
build=${TESSERA_BUILD_DIR:-$root/build}
cmake_args=${TESSERA_CMAKE_ARGS:-}
gpu_visible() {
  [ -e /dev/nvidia0 ] && return 0
  command -v nvidia-smi >/dev/null 2>&1 && [ -n "$(nvidia-smi -L 2>/dev/null)" ]
}
cuda_flag=()
case "$cmake_args" in
  *TESSERA_ENABLE_CUDA*) ;;  # the caller's choice
  *)
    if gpu_visible; then
      cuda_flag=(-DTESSERA_ENABLE_CUDA=ON)
    else
      cuda_flag=(-DTESSERA_ENABLE_CUDA=OFF)
      echo "run.sh: no GPU visible: building CPU-only (-DTESSERA_ENABLE_CUDA=OFF); set" \
        "TESSERA_CMAKE_ARGS=-DTESSERA_ENABLE_CUDA=ON to build the CUDA backends too"
    fi
    ;;
esac
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${cuda_flag[@]}" $cmake_args \
  >/dev/null
cmake --build "$build" -j"$(nproc)"
if [ "$action" = bench ]; then
  exec "$build/tessera" bench "$@"
fi
exec ctest --test-dir "$build" --output-on-failure "$@"
