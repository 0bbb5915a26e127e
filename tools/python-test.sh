#!/usr/bin/env bash
# Builds and installs the Python package (CPU-only library, the tessera command behind the
# `tessera` console script and the tessera._fastcall extension, `pip install
# --no-build-isolation`) into a virtual environment under build-py/venv, then runs the Python
# tests (tests/python; the GPU files skip without torch / a CUDA device). Exits non-zero on any
# failure.
#
# Environment:
#   TESSERA_PY_BUILD_DIR  build folder (default build-py/): venv/ and the CMake tree skbuild/
#   PYTHON                interpreter that creates the venv (default python3)
#   CMAKE_ARGS            extra CMake flags (-DTESSERA_ENABLE_CUDA=OFF is always added first)
#   TESSERA_BUILD_JOBS    parallel compile jobs (default: nproc)
# Extra arguments go to pytest (e.g. tools/python-test.sh -k decode -x).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TESSERA_PY_BUILD_DIR:-$root/build-py}
venv=$build/venv
python=${PYTHON:-python3}
start=$(date +%s)

# Build tools (cmake, ninja, g++, dlpack headers) from Debian; a no-op when present.
bash "$root/tools/install-deps.sh"

if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$build"
  if ! "$python" -m venv "$venv" 2>/dev/null; then
    # Debian's python3 needs python3-venv for `python3 -m venv`.
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq python3-venv >/dev/null
    rm -rf "$venv"
    "$python" -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# ml_dtypes gives numpy bfloat16, so the bf16 CPU path is tested too.
"${pip[@]}" install -q "numpy>=1.22" "pytest>=7" "scikit-build-core>=0.10" ml_dtypes

# --no-build-isolation: the build uses the venv's scikit-build-core and the system cmake/ninja,
# so it needs no network beyond the line above; build-dir keeps the CMake tree for fast reruns.
export CMAKE_BUILD_PARALLEL_LEVEL=${TESSERA_BUILD_JOBS:-$(nproc)}
CMAKE_ARGS="-DTESSERA_ENABLE_CUDA=OFF ${CMAKE_ARGS:-}" \
  "${pip[@]}" install -q --no-build-isolation --no-deps --force-reinstall \
  --config-settings=build-dir="$build/skbuild" "$root"

# Run from the build folder so `import tessera` is the installed package, not python/.
cd "$build"
# Whether run() has its C fast path (_fastcall.abi3.so beside the installed libtessera.so);
# tests/python/test_fastcall.py skips, saying why, when it has not.
"$venv/bin/python" -c "import tessera; print('python-test: fastcall', tessera.fastcall_info())"
# The `tessera` console script runs the command the wheel carries (tests/python/test_cli_entry.py).
"$venv/bin/python" -c "import tessera.__main__ as m; print('python-test: command', m.command_path())"
status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$root/tests/python" "$@" || status=$?
echo "python-test: finished in $(( $(date +%s) - start )) s (pytest exit status $status)"
exit "$status"
