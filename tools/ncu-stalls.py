#!/usr/bin/env python3
"""Summarise where a kernel's warps wait, from the per-instruction CSV that tools/gpu-check.sh
writes with TESSERA_NCU_SOURCE=1 (`ncu --import R --page source --csv --print-source sass`).

  tools/ncu-stalls.py ncu-source-N.csv [--top 25]

Prints the instructions with the most warp-stall samples (share of all samples, address, SASS)
and the samples per opcode (the mnemonic before the first '.', e.g. SYNCS for mbarrier waits,
BAR for named barriers, HGMMA, WARPGROUP for wgmma waits), so that a device call can return a
few lines instead of the whole table. Columns are found by name: the sampling column is the
first whose header contains "Warp Stall Sampling (All", the instruction the one named "Source".
"""

import argparse
import csv
import re
import sys
from collections import Counter


def number(text):
    text = (text or "").replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def find_column(header, *needles):
    for index, name in enumerate(header):
        if all(needle in name for needle in needles):
            return index
    return -1


def read_rows(path):
    """(address, instruction, all samples, not-issued samples) per SASS line."""
    with open(path, newline="") as handle:
        lines = handle.read().splitlines()
    # ncu may print a few lines before the table; the header is the first line naming Source.
    start = next((i for i, line in enumerate(lines) if '"Source"' in line or "Source," in line),
                 None)
    if start is None:
        raise SystemExit(f"{path}: no header with a 'Source' column")
    reader = csv.reader(lines[start:])
    header = next(reader)
    source = find_column(header, "Source")
    address = find_column(header, "Address")
    samples = find_column(header, "Warp Stall Sampling (All")
    not_issued = find_column(header, "Warp Stall Sampling (Not")
    if samples < 0:
        raise SystemExit(f"{path}: no 'Warp Stall Sampling (All Samples)' column in {header}")
    rows = []
    for row in reader:
        if len(row) <= max(source, samples):
            continue
        rows.append((row[address] if address >= 0 else "", row[source].strip(),
                     number(row[samples]), number(row[not_issued]) if not_issued >= 0 else 0.0))
    return rows


def opcode(instruction):
    text = re.sub(r"^@!?U?P\w+\s+", "", instruction)  # predicate guard
    word = text.split(" ", 1)[0]
    return word.split(".", 1)[0] or "?"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows = read_rows(args.csv)
    total = sum(row[2] for row in rows)
    if total <= 0:
        print(f"{args.csv}: no stall samples")
        return 1
    print(f"{args.csv}: {len(rows)} instructions, {total:.0f} samples "
          f"({sum(row[3] for row in rows) / total:.0%} not issued)")
    print(f"{'share':>6} {'not-iss':>7}  address  instruction")
    for address, instruction, all_samples, not_issued in sorted(rows, key=lambda r: -r[2])[
            :args.top]:
        print(f"{all_samples / total:6.1%} {not_issued / total:7.1%}  {address:>7}  "
              f"{instruction[:90]}")
    by_opcode = Counter()
    for _, instruction, all_samples, _ in rows:
        by_opcode[opcode(instruction)] += all_samples
    print("by opcode: " + ", ".join(f"{name} {value / total:.1%}"
                                    for name, value in by_opcode.most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
