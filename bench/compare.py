#!/usr/bin/env python3
"""Side-by-side: the shapes `tessera bench --json` timed, run again through torch SDPA with the
FlashAttention-2 (FLASH) and cuDNN backends in the same device session, with ratios.

Usage (on the GPU host, after `tessera bench --json tessera.json`):
    python3 bench/compare.py tessera.json [--out compare.json] [--iters 30]

Prefill cases use q/k/v of shape [B, H, S, D] (enable_gqa for grouped heads); paged prefill is
compared with SDPA on the same shape with contiguous K/V (what cuDNN/FA2 would read); decode uses
one query token per request against contiguous K/V. Rates use the same FLOP / byte count as
tessera bench, so the ratio is a ratio of times.
"""
import argparse
import json
import sys


def time_ms(fn, iters):
    import torch

    # Flush L2 between runs like tessera bench does: a 256 MB scratch write, or a read of it with
    # TESSERA_BENCH_FLUSH=read (leaves L2 clean instead of dirty), nothing with =none.
    import os

    mode = os.environ.get("TESSERA_BENCH_FLUSH", "write") or "write"
    flush = torch.ones(256 << 20 >> 3, dtype=torch.int64, device="cuda")
    sink = torch.empty((), dtype=torch.int64, device="cuda")
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if mode == "write":
            flush.fill_(1)
        elif mode == "read":
            torch.sum(flush, dim=0, out=sink)
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def sdpa_ms(case, backend, iters):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16
    b, hq, hkv, d = case["batch"], case["num_qo_heads"], case["num_kv_heads"], case["head_dim"]
    sq, skv = case["q_len"], case["kv_len"]
    q = torch.randn(b, hq, sq, d, dtype=dtype, device="cuda")
    k = torch.randn(b, hkv, skv, d, dtype=dtype, device="cuda")
    v = torch.randn(b, hkv, skv, d, dtype=dtype, device="cuda")
    causal = bool(case["causal"]) and case["op"] != "decode"
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run():
        with sdpa_kernel([which]):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)

    try:
        run()
        torch.cuda.synchronize()
    except Exception as error:  # a backend may not support a shape
        return None, str(error).splitlines()[0][:80]
    return time_ms(run, iters), ""


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tessera_json")
    parser.add_argument("--out", default="")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--png", default="", help="also draw the rates per case to this PNG")
    args = parser.parse_args()
    with open(args.tessera_json) as f:
        report = json.load(f)
    import torch

    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}")
    rows = []
    header = (f"{'case':44s} {'tessera':>9s} {'FA2':>9s} {'cuDNN':>9s} "
              f"{'x FA2':>7s} {'x cuDNN':>8s}")
    print(header)
    for case in report["results"]:
        if case["status"] != "ok":
            print(f"{case['name']:44s} tessera failed: skipped")
            continue
        skewed = (case.get("first_q_len", case["q_len"]) != case["q_len"] or
                  case.get("first_kv_len", case["kv_len"]) != case["kv_len"])
        if skewed or case.get("checked", 0) or case.get("graph", 0):
            # SDPA takes one length per batch (skewed), has no checked mode, and is not timed
            # in a graph here: tessera only.
            unit = 2 if case["op"] == "decode" else 1
            print(f"{case['name']:44s} {case['rate']:>9.{unit}f}   (tessera only)")
            continue
        decode = case["op"] == "decode"
        amount = case["bytes"] if decode else case["tflops"] * 1e12
        row = {"name": case["name"], "op": case["op"], "tessera_ms": case["ms"]}
        for backend in ("flash", "cudnn"):
            ms, note = sdpa_ms(case, backend, args.iters)
            row[backend + "_ms"] = ms
            if note:
                row[backend + "_note"] = note
        def rate(ms):
            return amount / (ms * 1e-3) / 1e12 if ms else None
        row["tessera_rate"] = rate(case["ms"])
        row["flash_rate"] = rate(row["flash_ms"])
        row["cudnn_rate"] = rate(row["cudnn_ms"])
        row["ratio_flash"] = row["flash_ms"] / case["ms"] if row["flash_ms"] else None
        row["ratio_cudnn"] = row["cudnn_ms"] / case["ms"] if row["cudnn_ms"] else None
        rows.append(row)
        fmt = lambda x, p=1: f"{x:.{p}f}" if x is not None else "-"
        unit = 2 if decode else 1
        print(f"{case['name']:44s} {fmt(row['tessera_rate'], unit):>9s} "
              f"{fmt(row['flash_rate'], unit):>9s} {fmt(row['cudnn_rate'], unit):>9s} "
              f"{fmt(row['ratio_flash'], 2):>7s} {fmt(row['ratio_cudnn'], 2):>8s}")
    print("(rates: TFLOP/s for prefill, TB/s of K+V for decode; ratio > 1: tessera faster)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    if args.png:
        draw_chart(rows, args.png, torch.cuda.get_device_name())


def draw_chart(rows, path, device):
    """Two panels: prefill TFLOP/s and decode TB/s, one group of bars per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("prefill", [r for r in rows if r["op"] != "decode"], "TFLOP/s"),
              ("decode", [r for r in rows if r["op"] == "decode"], "TB/s of K+V")]
    fig, axes = plt.subplots(2, 1, figsize=(16, 10))
    for ax, (title, subset, unit) in zip(axes, panels):
        names = [r["name"] for r in subset]
        width = 0.27
        for i, (key, label) in enumerate([("tessera_rate", "tessera"), ("flash_rate", "FA2 (SDPA)"),
                                          ("cudnn_rate", "cuDNN (SDPA)")]):
            values = [r[key] or 0.0 for r in subset]
            ax.bar([x + (i - 1) * width for x in range(len(subset))], values, width, label=label)
        ax.set_xticks(range(len(subset)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(unit)
        ax.set_title(f"{title}, bf16, {device}")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
