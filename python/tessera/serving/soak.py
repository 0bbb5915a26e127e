"""The serving loop under load (issue 38 item 6): random requests with random lengths, shared
prefixes (prefix reuse), eos ids, random arrivals and cancellations, stepped to completion, then
checked: the allocator's free count back to its start and every page's reference count zero
(no page leaks), every finished request's tokens equal to a one-at-a-time run of it (a
cancelled one's a prefix of them), and the process's resident memory sampled along the way.

``tests/python/test_serving.py`` runs 300 requests; ``python -m tessera.serving.soak
--requests 10000`` is the long run whose figures docs/RELIABILITY.md records.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

from .engine import Engine
from .model import CONFIGS, LlamaModel, random_llama_weights


def current_rss_bytes() -> int:
    """The process's resident set now (/proc/self/statm; the peak where that is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def solo_outputs(model: LlamaModel, specs: List[tuple], page_size: int = 4) -> List[List[int]]:
    """Each (prompt, max_new_tokens, eos) alone: whole prompt in one step, no prefix cache."""
    engine = Engine(model, num_pages=256, page_size=page_size, max_tokens_per_step=4096,
                    prefix_caching=False)
    outputs = []
    for prompt, max_new_tokens, eos in specs:
        request = engine.add_request(prompt, max_new_tokens, eos)
        engine.run()
        outputs.append(request.output)
    if engine.allocator.num_free != 256:
        raise AssertionError("the one-at-a-time engine leaked pages")
    return outputs


def run_soak(model: LlamaModel, num_requests: int, seed: int = 7, num_pages: int = 96,
             page_size: int = 4, max_tokens_per_step: int = 24, max_batch_size: int = 12,
             cancel_rate: float = 0.05, rss_every: int = 1000,
             check_solo: bool = True) -> Dict[str, Any]:
    """Runs the soak and returns its figures (see the module docstring); raises nothing itself:
    the caller asserts on ``page_leaks``, ``nonzero_ref_counts`` and ``mismatches``. Without
    ``check_solo`` finished requests are dropped as they finish (only their counts kept), so the
    RSS samples show the engine's own memory rather than the soak's record of every request.
    Arrivals come from a bounded client: at most 4 x max_batch_size requests in the engine at
    once (random arrivals outpace a step's service, so an unbounded queue would grow for the
    whole run, and the RSS samples would show that backlog instead of the engine)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 256, int(n)).tolist() for n in (8, 13, 21)]
    specs = []
    for _ in range(num_requests):
        tail = rng.integers(0, 256, int(rng.integers(1, 16))).tolist()
        prompt = (prefixes[int(rng.integers(3))] if rng.random() < 0.6 else []) + tail
        eos = int(rng.integers(0, 256)) if rng.random() < 0.3 else None
        specs.append((prompt, int(rng.integers(1, 10)), eos))
    engine = Engine(model, num_pages=num_pages, page_size=page_size,
                    max_tokens_per_step=max_tokens_per_step, max_batch_size=max_batch_size)
    start_free = engine.allocator.num_free
    every: List[Any] = []  # every request, in arrival order (check_solo)
    live: List[Any] = []  # the unfinished ones
    pending = list(reversed(specs))
    rss: List[List[int]] = []
    steps = cancelled = reused = 0
    start = time.perf_counter()
    while pending or engine.has_work:
        for _ in range(int(rng.integers(0, 4))):
            if pending and len(live) < 4 * max_batch_size:
                request = engine.add_request(*pending.pop())
                live.append(request)
                if check_solo:
                    every.append(request)
        if live and rng.random() < cancel_rate:
            engine.cancel(live[int(rng.integers(len(live)))])
        engine.step()
        steps += 1
        for request in live:
            if request.done:
                cancelled += request.state == "cancelled"
                reused += request.num_prefix_reused
        live = [r for r in live if not r.done]
        if rss_every and steps % rss_every == 0:
            rss.append([steps, current_rss_bytes()])
    seconds = time.perf_counter() - start
    rss.append([steps, current_rss_bytes()])
    mismatches: Optional[int] = None
    if check_solo:
        mismatches = 0
        for request, expected in zip(every, solo_outputs(model, specs, page_size)):
            if request.state == "cancelled":
                mismatches += request.output != expected[:len(request.output)]
            else:
                mismatches += request.output != expected
    return {
        "requests": num_requests - len(pending),
        "steps": steps,
        "seconds": round(seconds, 3),
        "cancelled": cancelled,
        "prompt_tokens_reused": reused,
        "num_pages": num_pages,
        "free_pages_start": start_free,
        "free_pages_end": engine.allocator.num_free,
        "page_leaks": start_free - engine.allocator.num_free,
        "nonzero_ref_counts": sum(engine.allocator.ref_count(p) != 0 for p in range(num_pages)),
        "mismatches": mismatches,
        "rss_bytes": rss,
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera.serving.soak",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--rss-every", type=int, default=1000, help="steps between RSS samples")
    parser.add_argument("--no-solo", action="store_true",
                        help="skip the one-at-a-time comparison")
    args = parser.parse_args(argv)
    config = CONFIGS["tiny"]
    model = LlamaModel(config, random_llama_weights(config, 0, init_std=0.5))
    report = run_soak(model, args.requests, seed=args.seed, rss_every=args.rss_every,
                      check_solo=not args.no_solo)
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    ok = report["page_leaks"] == 0 and report["nonzero_ref_counts"] == 0 and \
        report["mismatches"] in (0, None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
