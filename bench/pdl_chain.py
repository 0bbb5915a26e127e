#!/usr/bin/env python3
"""Programmatic dependent launch in a two-kernel chain: the q projection GEMM (torch.matmul,
cuBLAS/cuBLASLt), then Tessera's paged decode reading the q it wrote, as in a model's decode step.

    python bench/pdl_chain.py [--steps 20] [--replays 50] [--json FILE]

Needs torch with a CUDA device (sm_90+ for PDL to have an effect) and libtessera.so
(TESSERA_LIBRARY / PYTHONPATH=python). Shapes: GQA 32/8, head_dim 128 (hidden 4096), bf16,
page 16; batch 1 / 16 / 64 over 1k and 4k keys. For each shape, --steps copies of the chain are
captured into one CUDA graph (so graph launch is amortised) and the graph is replayed --replays
times; a figure is the median replay time / --steps, in microseconds:
  gemm       the GEMM alone;
  attention  the decode alone;
  chain      GEMM then decode, the decode launched without PDL;
  chain+pdl  the same with enable_pdl=True (the decode's kernels are launched with programmatic
             stream serialisation and wait on the grid dependency before reading q);
  adds       chain - gemm, what attention adds behind the GEMM (issue 33's target: <= 5 us at
             1 x 1k with PDL).
Every chain's output is checked against the decode run eagerly on the same q (bit for bit).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import tessera

DEVICE = "cuda"
HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16


def graph_us(fn, steps, replays):
    """Median replay time / steps of a graph holding `steps` calls of fn, in microseconds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside the capture (plans, cuBLAS handles, lazy module loads)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / steps)
    return statistics.median(times)


def measure(batch, kv_len, steps, replays):
    dtype = torch.bfloat16
    pages_per_request = (kv_len + PAGE - 1) // PAGE
    num_pages = batch * pages_per_request
    k_cache = torch.randn(num_pages, PAGE, KV_HEADS, DIM, dtype=dtype, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    indices = torch.randperm(num_pages, device=DEVICE).to(torch.int32)
    indptr = torch.arange(0, num_pages + 1, pages_per_request, dtype=torch.int32, device=DEVICE)
    last = torch.full((batch,), kv_len - (pages_per_request - 1) * PAGE, dtype=torch.int32,
                      device=DEVICE)
    hidden = HEADS * DIM
    x = torch.randn(batch, hidden, dtype=dtype, device=DEVICE) / hidden ** 0.5
    w = torch.randn(hidden, hidden, dtype=dtype, device=DEVICE)
    q = torch.empty(batch, hidden, dtype=dtype, device=DEVICE)
    out = torch.empty(batch, HEADS, DIM, dtype=dtype, device=DEVICE)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace, use_cuda_graph=True)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type=dtype)
    cache = (k_cache, v_cache)
    q_heads = q.view(batch, HEADS, DIM)

    def gemm():
        torch.matmul(x, w, out=q)

    def attention(pdl):
        wrapper.run(q_heads, cache, out=out, enable_pdl=pdl)

    def chain(pdl):
        gemm()
        attention(pdl)

    figures = {"gemm": graph_us(gemm, steps, replays),
               "attention": graph_us(lambda: attention(False), steps, replays)}
    for pdl in (False, True):
        key = "chain+pdl" if pdl else "chain"
        figures[key] = graph_us(lambda: chain(pdl), steps, replays)
        expected = out.clone()
        eager = tessera.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE))
        eager.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type=dtype)
        gemm()
        reference = eager.run(q_heads, cache)
        torch.cuda.synchronize()
        if not torch.equal(expected, reference):
            raise SystemExit(f"{key} {batch}x{kv_len}: the chained decode differs from the "
                             "eager one")
    figures["adds"] = figures["chain"] - figures["gemm"]
    figures["adds+pdl"] = figures["chain+pdl"] - figures["gemm"]
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--json", help="also write the figures to FILE")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pdl_chain.py: needs a CUDA device")
    name = torch.cuda.get_device_name()
    print(f"pdl_chain: {name}, torch {torch.__version__}, GQA {HEADS}/{KV_HEADS} d{DIM} "
          f"p{PAGE} bf16, {args.steps} chains per graph, median of {args.replays} replays (us)")
    columns = ["gemm", "attention", "chain", "chain+pdl", "adds", "adds+pdl"]
    print(f"{'case':14s}" + "".join(f"{c:>11s}" for c in columns))
    rows = []
    for batch in (1, 16, 64):
        for kv_len in (1024, 4096):
            figures = measure(batch, kv_len, args.steps, args.replays)
            case = f"{batch}x{kv_len}"
            rows.append({"case": case, **figures})
            print(f"{case:14s}" + "".join(f"{figures[c]:>11.2f}" for c in columns), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
