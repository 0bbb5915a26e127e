#!/usr/bin/env bash
# One entry point for a fresh machine: installs dependencies, builds, then runs
#   tools/run.sh bench [tessera bench options]   the main job (GPU if present, else CPU)
#   tools/run.sh test  [ctest options]           the test suite (GPU tests skip without a GPU)
# Environment: TESSERA_BUILD_DIR (default build/), TESSERA_CMAKE_ARGS (extra configure flags).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
action=${1:-}
case "$action" in
  bench|test) shift ;;
  *) echo "usage: tools/run.sh bench|test [options]" >&2; exit 2 ;;
esac
bash "$root/tools/install-deps.sh"
build=${TESSERA_BUILD_DIR:-$root/build}
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${TESSERA_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j"$(nproc)"
if [ "$action" = bench ]; then
  exec "$build/tessera" bench "$@"
fi
exec ctest --test-dir "$build" --output-on-failure "$@"
