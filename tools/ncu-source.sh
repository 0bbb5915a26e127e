#!/usr/bin/env bash
# One launch of a `tessera bench` case under Nsight Compute with warp-stall sampling per SASS
# instruction (SourceCounters), written as CSV and summarised by tools/ncu-stalls.py (the top
# instructions, samples per opcode and per wait target) on stdout. The caller's environment
# (LD_LIBRARY_PATH, TESSERA_* settings) reaches the profiled process. Used by tools/gpu-check.sh
# (TESSERA_NCU_SOURCE=1) and tools/gpu-ab.sh (AB_NCU).
#   tools/ncu-source.sh CSV TESSERA_BINARY BENCH_FILTER [KERNEL_REGEX [TOP]]
# KERNEL_REGEX defaults to prefill_kernel, TOP (instructions listed) to 30; NCU_TIMEOUT (seconds,
# default 600) bounds the profiled run.
set -uo pipefail
csv=${1:?usage: tools/ncu-source.sh CSV TESSERA_BINARY BENCH_FILTER [KERNEL_REGEX [TOP]]}
tessera=${2:?tessera binary}
filter=${3:?bench filter}
kernel=${4:-prefill_kernel}
top=${5:-30}
report=$(mktemp -d)
trap 'rm -rf "$report"' EXIT
timeout "${NCU_TIMEOUT:-600}" ncu --clock-control none --kernel-name "regex:$kernel" \
  --launch-skip 3 --launch-count 1 --section SourceCounters --section WarpStateStats \
  --import-source no --export "$report/source" --force-overwrite \
  "$tessera" bench --quiet --filter "$filter" || exit 1
ncu --import "$report/source.ncu-rep" --page source --csv --print-source sass >"$csv" || exit 1
python3 "$(dirname "$0")/ncu-stalls.py" "$csv" --top "$top"
