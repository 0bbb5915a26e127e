#!/usr/bin/env python3
"""DRAM traffic of a prefill schedule under a simple L2 model (build host, no GPU).

Replays a static schedule of (request, head, q tile) items on W workers in cost-model time -
each key tile of an item read at its start time plus its share of the item's cost - through an
LRU cache of the L2's size, and counts the key tiles (K and V of 128 or 64 keys) that miss.
Compares the planner's orders: plain LPT (longest first), each worker's items sorted by
(request, head, q tile), and LPT section by section over S MiB of K/V (planner.cpp, step 4).
An approximation: LPT here ignores the planner's splits and worker blocks, the L2 is one LRU
(an H100's is two halves), and time is the cost model's. It ranked the orders as the device
did (docs/log/PERF.md, 2026-12-06).
  python3 tools/l2-model.py [--workers 132] [--l2-mib 50]
"""
import argparse, collections, heapq


def items(batch, seq, heads, causal, head_dim, group=1, rows=128):
    """(cost, request, q_start, head, key tiles) per item, as the planner's cost model."""
    block_n = 64 if head_dim == 256 else 128
    tokens = rows // group
    out = []
    for b in range(batch):
        for qs in range(0, seq, tokens):
            ql = min(tokens, seq - qs)
            kend = qs + ql if causal else seq
            pairs = sum(qs + i + 1 for i in range(ql)) if causal else ql * seq
            cost = pairs * group + 16 * kend + 2048
            for h in range(heads):
                out.append((cost, b, qs, h, (kend + block_n - 1) // block_n))
    return out


def lpt(its, workers, key=lambda i, its=None: -its[i][0]):
    order = sorted(range(len(its)), key=lambda i: key(i, its))
    heap = [(0, w) for w in range(workers)]
    lists = [[] for _ in range(workers)]
    for i in order:
        load, w = heapq.heappop(heap)
        lists[w].append(i)
        heapq.heappush(heap, (load + its[i][0], w))
    return lists


def sections(its, workers, pair_bytes, budget):
    pairs = sorted({(it[1], it[3]) for it in its})
    section, s, filled = {}, 0, 0
    for p in pairs:
        if filled and filled + pair_bytes > budget:
            s, filled = s + 1, 0
        section[p] = s
        filled += pair_bytes
    return lpt(its, workers, key=lambda i, its: (section[(its[i][1], its[i][3])], -its[i][0]))


def dram_bytes(its, lists, l2_bytes, tile_bytes):
    events = []
    for l in lists:
        t = 0.0
        for i in l:
            cost, b, _, h, tiles = its[i]
            for k in range(tiles):
                events.append((t, (b, h, k)))
                t += cost / tiles
    events.sort()
    lru, misses, capacity = collections.OrderedDict(), 0, l2_bytes // tile_bytes
    for _, key in events:
        if key in lru:
            lru.move_to_end(key)
        else:
            misses += 1
            lru[key] = True
            if len(lru) > capacity:
                lru.popitem(last=False)
    return misses * tile_bytes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=132)
    parser.add_argument("--l2-mib", type=int, default=50)
    args = parser.parse_args()
    l2 = args.l2_mib << 20
    cases = [  # name, batch, seq, kv heads, causal, head_dim, group
        ("d128 causal 4x4096 h16", 4, 4096, 16, True, 128, 1),
        ("d128 4x4096 h16", 4, 4096, 16, False, 128, 1),
        ("d128 1x16384 h16", 1, 16384, 16, False, 128, 1),
        ("d64 1x16384 h32", 1, 16384, 32, False, 64, 1),
        ("d256 causal 4x4096 h8", 4, 4096, 8, True, 256, 1),
        ("gqa32/8 causal 4x4096", 4, 4096, 8, True, 128, 4),
    ]
    print("%-26s %10s %10s %10s %10s   (GB of K/V read from DRAM)" % ("case", "LPT", "sorted", "sec 16M", "sec 32M"))
    for name, batch, seq, heads, causal, d, group in cases:
        its = items(batch, seq, heads, causal, d, group)
        tile = (64 if d == 256 else 128) * d * 2 * 2
        pair = seq * d * 2 * 2
        plain = lpt(its, args.workers)
        by_pair = [sorted(l, key=lambda i: (its[i][1], its[i][3], its[i][2])) for l in plain]
        row = [dram_bytes(its, plain, l2, tile), dram_bytes(its, by_pair, l2, tile)]
        row += [dram_bytes(its, sections(its, args.workers, pair, mib << 20), l2, tile) for mib in (16, 32)]
        print("%-26s" % name + "".join("%10.2f" % (b / 1e9) for b in row))


if __name__ == "__main__":
    main()
