#!/usr/bin/env python3
"""Summarise where a kernel's warps wait, from the per-instruction CSV that tools/gpu-check.sh
writes with TESSERA_NCU_SOURCE=1 (`ncu --import R --page source --csv --print-source sass`).

  tools/ncu-stalls.py ncu-source-N.csv [--top 25]

Prints the instructions with the most warp-stall samples (share of all samples, address, SASS)
and the samples per opcode (the mnemonic before the first '.', e.g. SYNCS for mbarrier waits,
BAR for named barriers, HGMMA, WARPGROUP for wgmma waits), and the samples per wait target: an
mbarrier poll loop (a SYNCS...TRYWAIT and the branch that retries it) is named by the barrier's
shared-memory offset, and an instruction whose samples are mostly barrier stalls by the named
barrier (BAR.SYNC) before it - so that a device call can return a few lines instead of the whole
table. Columns are found by name: the sampling column is the
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
    barrier = find_column(header, "stall_barrier")
    if samples < 0:
        raise SystemExit(f"{path}: no 'Warp Stall Sampling (All Samples)' column in {header}")
    rows = []
    for row in reader:
        if len(row) <= max(source, samples):
            continue
        rows.append((row[address] if address >= 0 else "", row[source].strip(),
                     number(row[samples]), number(row[not_issued]) if not_issued >= 0 else 0.0,
                     number(row[barrier]) if barrier >= 0 else 0.0))
    return rows


# How far back (instructions) a retry branch looks for its TRYWAIT, and a barrier-held
# instruction for the BAR.SYNC that holds it.
POLL_WINDOW = 64
BARRIER_WINDOW = 8


def wait_target(rows, index):
    """What instruction `index` waits on: 'mbarrier +OFFSET' for a TRYWAIT poll or the branch
    that retries it, 'BAR.SYNC ID' for an instruction held mostly by a named barrier, else None."""
    instruction = rows[index][1]
    poll = re.search(r"TRYWAIT (U?P\d+), \[[^\]]*?(0x[0-9a-f]+)\]", instruction)
    if poll:
        return f"mbarrier +{poll.group(2)}"
    branch = re.match(r"@!?(U?P\d+)\s+BRA\b", instruction)
    if branch:
        for earlier in range(index - 1, max(index - POLL_WINDOW, -1), -1):
            poll = re.search(r"TRYWAIT " + branch.group(1) + r", \[[^\]]*?(0x[0-9a-f]+)\]",
                             rows[earlier][1])
            if poll:
                return f"mbarrier +{poll.group(1)}"
    if rows[index][4] > 0.5 * rows[index][2]:
        for earlier in range(index - 1, max(index - BARRIER_WINDOW, -1), -1):
            named = re.search(r"BAR\.SYNC\S*\s+([^;]+)", rows[earlier][1])
            if named:
                return "BAR.SYNC " + named.group(1).strip()
    return None


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
    for address, instruction, all_samples, not_issued, _ in sorted(rows, key=lambda r: -r[2])[
            :args.top]:
        print(f"{all_samples / total:6.1%} {not_issued / total:7.1%}  {address:>7}  "
              f"{instruction[:90]}")
    by_opcode = Counter()
    by_wait = Counter()
    for index, (_, instruction, all_samples, _, _) in enumerate(rows):
        by_opcode[opcode(instruction)] += all_samples
        target = wait_target(rows, index) if all_samples > 0 else None
        if target:
            by_wait[target] += all_samples
    print("by opcode: " + ", ".join(f"{name} {value / total:.1%}"
                                    for name, value in by_opcode.most_common(12)))
    # mbarrier offsets: PrefillSmem's q_full, q_empty, then k_full, k_empty, v_full, v_empty per
    # stage, 8 bytes each from Traits::kBarrierOffset (prefill_producer.cuh).
    print("by wait target: " + ", ".join(f"{name} {value / total:.1%}"
                                         for name, value in by_wait.most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
