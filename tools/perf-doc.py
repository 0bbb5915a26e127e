#!/usr/bin/env python3
"""The current-performance table of one GPU for docs/PERFORMANCE.md, from one device call.

  tools/perf-doc.py OUT_DIR [--build REV] [--date YYYY-MM-DD] [--flashinfer FILE]
                    [--suite NAME] [--update docs/PERFORMANCE.md]

OUT_DIR is what tools/gpu-check.sh leaves there:
  bench.json    `tessera bench --json`: {"device", "dtype", "results": [{"name", "op", "ms",
                "tflops", "bytes", "rate", "graph", "status", ...}]}
  compare.json  `bench/compare.py --out`: {"device", "rows": [{"name", "tessera_ms", "flash_ms",
                "cudnn_ms", ...}]}, torch SDPA's FlashAttention-2 and cuDNN timed in the same call
  compare.log   its first line: "torch VERSION, cuDNN NUMBER, GPU NAME"
FlashInfer, when it was measured: FILE (default OUT_DIR/flashinfer.json, used when present):
  {"version": "0.5.3", "date": "YYYY-MM-DD", "same_call": false,
   "rows": [{"name": <a bench case name>, "flashinfer_ms": ..., "tessera_ms": ...}]}
  "tessera_ms" is Tessera timed in the same process as FlashInfer (x FlashInfer uses it; without
  it, the bench's time). Instead of times a row may give rates ("flashinfer_rate",
  "tessera_rate": TFLOP/s, or TB/s for decode). A case missing from bench.json takes its Tessera
  figure from this file (marked *) and needs "op" (and "graph": 1 for a graph replay) in the row.
The build is --build, else the first line of OUT_DIR/build.txt; the date is --date, else
bench.json's modification date (UTC).

Prints one block: prefill in TFLOP/s, decode in TB/s of K and V read (a CUDA-graph replay in
microseconds), each case's Tessera, cuDNN, FA2 and FlashInfer (when present) figures and the
ratios other time / Tessera time (> 1: Tessera is faster). The block sits between
"<!-- perf:KEY -->" and "<!-- /perf -->" (KEY: the GPU, e.g. H100); --update FILE replaces that
GPU's block in FILE, or appends it, and prints nothing.
"""

import argparse
import datetime
import json
import os
import re
import sys

END_MARKER = "<!-- /perf -->"


def begin_marker(key):
    return f"<!-- perf:{key} -->"


def load_json(path):
    with open(path) as f:
        return json.load(f)


def cudnn_text(number):
    """torch.backends.cudnn.version() as dotted text: 91900 -> 9.19.0 (cuDNN 9 encodes
    major * 10000 + minor * 100 + patch, cuDNN 8 major * 1000 + minor * 100 + patch)."""
    value = int(number)
    if value >= 90000:
        return f"{value // 10000}.{value % 10000 // 100}.{value % 100}"
    return f"{value // 1000}.{value % 1000 // 100}.{value % 100}"


def versions(compare_log):
    """(torch, cuDNN, GPU name) from compare.log's first line, or Nones."""
    if not os.path.exists(compare_log):
        return None, None, None
    with open(compare_log) as f:
        first = f.readline().strip()
    match = re.match(r"torch (\S+), cuDNN (\d+), (.+)$", first)
    if not match:
        return None, None, None
    return match.group(1), cudnn_text(match.group(2)), match.group(3)


def gpu_key(device):
    """The GPU's short name (H100, H200, A100, L40S ...) from a device description."""
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device)
    if match:
        return match.group(1)
    return re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-") or "GPU"


def is_decode(case):
    return case.get("op") == "decode"


def amount(case):
    """What a rate divides by time: FLOPs (prefill) or bytes of K and V (decode)."""
    if is_decode(case):
        return float(case.get("bytes") or 0.0)
    return float(case.get("tflops") or 0.0) * 1e12


def rate_from_ms(case, ms):
    """TFLOP/s or TB/s for a time in ms (None without a time or an amount)."""
    if not ms or not amount(case):
        return None
    return amount(case) / (ms * 1e-3) / 1e12


def ms_from_rate(case, rate):
    if not rate or not amount(case):
        return None
    return amount(case) / (rate * 1e12) * 1e3


def figure(case, rate, ms):
    """One table cell: the rate, or microseconds for a graph replay."""
    if case.get("graph"):
        if ms is None:
            ms = ms_from_rate(case, rate)
        return "-" if ms is None else f"{ms * 1e3:.1f} us"
    if rate is None:
        return "-"
    return f"{rate:.2f}" if is_decode(case) else f"{rate:.1f}"


def ratio(tessera_rate, other_rate):
    if not tessera_rate or not other_rate:
        return "-"
    return f"{tessera_rate / other_rate:.2f}"


def row_rate(case, row, prefix):
    """A rate from a compare / FlashInfer row: PREFIX_rate, else from PREFIX_ms."""
    if row is None:
        return None
    if row.get(prefix + "_rate") is not None:
        return float(row[prefix + "_rate"])
    return rate_from_ms(case, row.get(prefix + "_ms"))


def build_tables(bench, compare, flashinfer):
    """The rows of the prefill and decode tables, as lists of cells, and whether any Tessera
    figure came from the FlashInfer file (the * footnote)."""
    compare_rows = {row["name"]: row for row in (compare or {}).get("rows", [])}
    fi_rows = {row["name"]: row for row in (flashinfer or {}).get("rows", [])}
    with_fi = bool(fi_rows)
    cases = list(bench.get("results", []))
    known = {case["name"] for case in cases}
    cases += [dict(row, status="ok", from_flashinfer=True)
              for row in (flashinfer or {}).get("rows", []) if row["name"] not in known]
    tables = {"prefill": [], "decode": []}
    starred = False
    for case in cases:
        cells = [case["name"]]
        if case.get("status", "ok") != "ok":
            cells += ["failed"] + ["-"] * (6 if with_fi else 4)
            tables["decode" if is_decode(case) else "prefill"].append(cells)
            continue
        fi = fi_rows.get(case["name"])
        if case.get("from_flashinfer"):
            tessera_rate = row_rate(case, fi, "tessera")
            tessera_ms = fi.get("tessera_ms") or ms_from_rate(case, tessera_rate)
            text = figure(case, tessera_rate, tessera_ms)
            cells.append(text + " *" if text != "-" else text)
            starred = starred or text != "-"
        else:
            tessera_ms = case.get("ms")
            tessera_rate = case.get("rate") or rate_from_ms(case, tessera_ms)
            cells.append(figure(case, tessera_rate, tessera_ms))
        compared = compare_rows.get(case["name"])
        cudnn = row_rate(case, compared, "cudnn")
        flash = row_rate(case, compared, "flash")
        cells += [figure(case, cudnn, None), figure(case, flash, None)]
        fi_rate = row_rate(case, fi, "flashinfer")
        if with_fi:
            cells.append(figure(case, fi_rate, fi.get("flashinfer_ms") if fi else None))
        cells += [ratio(tessera_rate, cudnn), ratio(tessera_rate, flash)]
        if with_fi:
            # Against Tessera in FlashInfer's process where the file has it.
            same_process = row_rate(case, fi, "tessera") if fi else None
            cells.append(ratio(same_process or tessera_rate, fi_rate))
        tables["decode" if is_decode(case) else "prefill"].append(cells)
    return tables, starred


def markdown_table(rows, with_fi):
    header = ["case", "Tessera", "cuDNN", "FA2"] + (["FlashInfer"] if with_fi else [])
    header += ["x cuDNN", "x FA2"] + (["x FlashInfer"] if with_fi else [])
    lines = ["| " + " | ".join(header) + " |",
             "|---" + "|---:" * (len(header) - 1) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return lines


def render(out_dir, build=None, date=None, flashinfer_path=None, suite=None):
    """The markdown block of one device call's OUT_DIR, and its GPU key."""
    bench_path = os.path.join(out_dir, "bench.json")
    bench = load_json(bench_path)
    compare_path = os.path.join(out_dir, "compare.json")
    compare = load_json(compare_path) if os.path.exists(compare_path) else None
    if flashinfer_path is None:
        candidate = os.path.join(out_dir, "flashinfer.json")
        flashinfer_path = candidate if os.path.exists(candidate) else None
    flashinfer = load_json(flashinfer_path) if flashinfer_path else None
    torch_version, cudnn_version, gpu_name = versions(os.path.join(out_dir, "compare.log"))
    device = (compare or {}).get("device") or gpu_name or bench.get("device", "unknown device")
    key = gpu_key(device) + (f" {suite}" if suite else "")
    if build is None:
        build_txt = os.path.join(out_dir, "build.txt")
        if os.path.exists(build_txt):
            with open(build_txt) as f:
                build = f.readline().strip() or None
    if date is None:
        stamp = os.path.getmtime(bench_path)
        date = datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).strftime("%Y-%m-%d")
    tables, starred = build_tables(bench, compare, flashinfer)
    with_fi = bool((flashinfer or {}).get("rows"))

    lines = [begin_marker(key), f"### {key} ({device})", ""]
    facts = [date, f"build `{build}`" if build else "build not recorded",
             bench.get("dtype", "bf16")]
    if compare is not None:
        facts.append(f"cuDNN {cudnn_version or '?'} and FA2 through torch {torch_version or '?'} "
                     "SDPA in the same call")
    else:
        facts.append("no cuDNN / FA2 comparison in this call")
    if with_fi:
        version = flashinfer.get("version", "?")
        if flashinfer.get("same_call"):
            facts.append(f"FlashInfer {version} in the same call")
        else:
            when = f" ({flashinfer['date']})" if flashinfer.get("date") else ""
            facts.append(f"FlashInfer {version} measured in another call{when}; x FlashInfer "
                         "compares it with Tessera timed in that process")
    lines.append("; ".join(facts) + ". x: other time / Tessera time (> 1: Tessera is faster).")
    for op, title in (("prefill", "Prefill, TFLOP/s"),
                      ("decode", "Decode, TB/s of K and V read (CUDA-graph replay: us per step)")):
        if not tables[op]:
            continue
        lines += ["", title + ":", ""]
        lines += markdown_table(tables[op], with_fi)
    if starred:
        lines += ["", "\\* Tessera timed in the FlashInfer call (this call did not run the case)."]
    lines.append(END_MARKER)
    return "\n".join(lines) + "\n", key


def update(path, block, key):
    """Replaces KEY's block in the file at path (or appends it); returns the new text."""
    text = open(path).read() if os.path.exists(path) else ""
    begin = begin_marker(key)
    start = text.find(begin)
    if start >= 0:
        end = text.find(END_MARKER, start)
        if end < 0:
            raise SystemExit(f"perf-doc: {path}: '{begin}' has no '{END_MARKER}' after it")
        end += len(END_MARKER)
        if text[end:end + 1] == "\n":
            end += 1
        text = text[:start] + block + text[end:]
    else:
        text = text + ("" if text.endswith("\n") or not text else "\n") + "\n" + block
    with open(path, "w") as f:
        f.write(text)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="a tools/gpu-check.sh OUT_DIR")
    parser.add_argument("--build", help="the build measured (a commit), else OUT_DIR/build.txt")
    parser.add_argument("--date", help="YYYY-MM-DD, else bench.json's modification date")
    parser.add_argument("--flashinfer", help="FlashInfer timings (default OUT_DIR/flashinfer.json)")
    parser.add_argument("--suite", help="the bench suite of OUT_DIR when it is not the standard "
                        "one (e.g. serving): its block is the GPU's name and this")
    parser.add_argument("--update", metavar="FILE",
                        help="replace this GPU's block in FILE (docs/PERFORMANCE.md) instead of "
                             "printing it")
    args = parser.parse_args(argv)
    if not os.path.exists(os.path.join(args.out_dir, "bench.json")):
        parser.error(f"{args.out_dir}/bench.json not found (tools/gpu-check.sh writes it)")
    block, key = render(args.out_dir, args.build, args.date, args.flashinfer, args.suite)
    if args.update:
        update(args.update, block, key)
    else:
        sys.stdout.write(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
