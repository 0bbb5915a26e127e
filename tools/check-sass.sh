#!/usr/bin/env bash
# Checks the machine code of the sm90 prefill kernels in a built library:
#   tools/check-sass.sh [path/to/libtessera.so]
# Every tessera::sm90::prefill kernel must contain HGMMA (wgmma), UTMALDG (TMA loads), the
# setmaxnreg register moves, and no local-memory traffic (LDL/STL: spills or stack arrays).
# Needs cuobjdump: the CUDA toolkit's, or the one the `triton` wheel carries
# (triton/backends/nvidia/bin), found on PATH or through TESSERA_CUOBJDUMP.
set -euo pipefail
lib=${1:-build/libtessera.so}
cuobjdump=${TESSERA_CUOBJDUMP:-$(command -v cuobjdump || true)}
if [ -z "$cuobjdump" ]; then
  echo "check-sass: no cuobjdump on PATH (set TESSERA_CUOBJDUMP)" >&2
  exit 2
fi
sass=$(mktemp)
trap 'rm -f "$sass"' EXIT
"$cuobjdump" -sass "$lib" >"$sass"
# Split per function; keep the sm90 prefill kernels (mangled: ...sm9014prefill_kernel...).
awk -v out="$sass.fn" '
  /Function : / { name = $3; next }
  name ~ /sm9014prefill_kernel/ { print name "\t" $0 }
' "$sass" >"$sass.fn"
kernels=$(cut -f1 "$sass.fn" | sort -u)
if [ -z "$kernels" ]; then
  echo "check-sass: no sm90 prefill kernel in $lib (built without sm_90a?)" >&2
  rm -f "$sass.fn"
  exit 1
fi
status=0
count=0
while read -r kernel; do
  count=$((count + 1))
  body=$(grep -F "$kernel"$'\t' "$sass.fn" | cut -f2-)
  hgmma=$(grep -c "HGMMA" <<<"$body" || true)
  tma=$(grep -c "UTMALDG" <<<"$body" || true)
  tma_store=$(grep -c "UTMASTG" <<<"$body" || true)
  maxreg=$(grep -c "USETMAXREG" <<<"$body" || true)
  local_mem=$(grep -cE "\b(LDL|STL)\b" <<<"$body" || true)
  line="$kernel: HGMMA $hgmma, UTMALDG $tma, UTMASTG $tma_store, USETMAXREG $maxreg, LDL/STL $local_mem"
  if [ "$hgmma" -eq 0 ] || [ "$tma" -eq 0 ] || [ "$maxreg" -lt 2 ] || [ "$local_mem" -ne 0 ]; then
    echo "FAIL $line"
    status=1
  else
    echo "ok   $line"
  fi
done <<<"$kernels"
rm -f "$sass.fn"
echo "check-sass: $count sm90 prefill kernels checked"
exit $status
