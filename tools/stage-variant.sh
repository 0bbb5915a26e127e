#!/usr/bin/env bash
# Builds libtessera.so (sm_90a) from a git ref and stages it, xz-compressed, as
# .devbuild/var/NAME.so.xz for tools/gpu-ab.sh (run tools/stage-gpu.sh first: the variant runs
# under that staging's tessera and test binaries, so the ref must keep their C ABI).
#   tools/stage-variant.sh NAME REF [NVCC_DEFINE...]
# NVCC_DEFINEs (e.g. -DSOME_MACRO=1) are added to the CUDA flags of this build only. The ref is
# checked out in build-variant/src (a git worktree, reused so a second variant rebuilds only what
# differs) and built in build-variant/build.
set -euo pipefail
name=${1:?usage: tools/stage-variant.sh NAME REF [NVCC_DEFINE...]}
ref=${2:?usage: tools/stage-variant.sh NAME REF [NVCC_DEFINE...]}
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
work=$root/build-variant
[ -d "$root/.devbuild" ] || { echo "stage-variant: run tools/stage-gpu.sh first" >&2; exit 2; }
if [ ! -e "$work/src/.git" ]; then
  mkdir -p "$work"
  git -C "$root" worktree add --detach "$work/src" "$ref" >/dev/null
else
  git -C "$work/src" checkout --detach --quiet "$ref"
fi
cmake -S "$work/src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DTESSERA_CUDA_ARCHS="${TESSERA_STAGE_ARCHS:-90a}" -DCMAKE_CUDA_FLAGS="$*" >/dev/null
cmake --build "$work/build" --target tessera_shared -j"$(nproc)"
mkdir -p "$root/.devbuild/var"
strip --strip-unneeded -o "$work/libtessera.so" "$work/build/libtessera.so"
xz -T0 -6 -c "$work/libtessera.so" >"$root/.devbuild/var/$name.so.xz"
ls -l "$root/.devbuild/var/$name.so.xz"
