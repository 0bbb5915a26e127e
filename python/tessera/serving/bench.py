"""The serve benchmark behind ``python -m tessera.serving`` (and ``tessera-serve-bench``).

``N`` requests of ``prompt_len`` random prompt tokens (the first ``shared_prefix_len`` of them
the same for every request, to exercise prefix reuse) and ``output_len`` greedy tokens are
queued at once on a model of random weights; the engine runs until all are done. Reported:
output and total (prompt + output) tokens per second over the timed run, time to first token
(arrival to first output token) and time per output token (first to last output token over
``output_len - 1``) percentiles, and peak memory: ``torch.cuda.max_memory_allocated`` on a GPU,
the process's peak resident set (``ru_maxrss``) on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .engine import Engine
from .model import CONFIGS, LlamaModel, random_llama_weights

PERCENTILES = (50, 90, 99)
THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "TESSERA_NUM_THREADS")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tessera.serving",
        description="Serve benchmark: a continuous-batching loop over Tessera's attention on a "
                    "Llama-architecture model of random weights.")
    parser.add_argument("--requests", type=int, default=16, help="number of requests")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=16, help="output tokens per request")
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="leading prompt tokens common to all requests (prefix reuse)")
    parser.add_argument("--config", default="tiny", choices=sorted(CONFIGS),
                        help="model config (Hugging Face LlamaConfig fields)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                        help="float32 (CPU default; not on CUDA, whose kernels take 16-bit), "
                             "float16, bfloat16 (CUDA default; not on the CPU: numpy has no "
                             "bfloat16 GEMM)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pages per layer (default: enough for every request at once)")
    parser.add_argument("--max-tokens-per-step", type=int, default=512,
                        help="token budget of a step (chunked prefill)")
    parser.add_argument("--max-batch-size", type=int, default=64,
                        help="most requests running at once")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run decode steps eagerly on CUDA")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2,
                        help="requests run before the timed run (library and graph warm-up)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    for name in ("requests", "prompt_len", "output_len", "page_size", "max_tokens_per_step",
                 "max_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.dtype == ("bfloat16" if args.device == "cpu" else "float32"):
        parser.error(f"--dtype {args.dtype}: not on --device {args.device} (see --help)")
    if not 0 <= args.shared_prefix_len <= args.prompt_len:
        parser.error(f"--shared-prefix-len: expected 0 .. --prompt-len ({args.prompt_len}), got "
                     f"{args.shared_prefix_len}")
    return args


def build_engine(args: argparse.Namespace) -> Engine:
    config = CONFIGS[args.config]
    if args.device == "cpu":
        dtype = np.dtype(args.dtype or "float32")
        weights = random_llama_weights(config, args.seed, dtype, init_std=0.5)
    else:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
        dtype = getattr(torch, args.dtype or "bfloat16")
        weights = random_llama_weights(config, args.seed, dtype, init_std=0.02, device="cuda")
    model = LlamaModel(config, weights)
    per_request = (args.prompt_len + args.output_len - 1 + args.page_size - 1) // args.page_size
    num_pages = args.num_pages or per_request * max(args.requests, args.warmup) + 1
    return Engine(model, num_pages=num_pages, page_size=args.page_size,
                  max_tokens_per_step=args.max_tokens_per_step,
                  max_batch_size=args.max_batch_size,
                  prefix_caching=not args.no_prefix_caching,
                  use_cuda_graphs=False if args.no_cuda_graphs else None)


def prompts(args: argparse.Namespace, count: int, seed: int) -> List[List[int]]:
    rng = np.random.default_rng(seed)
    vocab = CONFIGS[args.config]["vocab_size"]
    shared = rng.integers(0, vocab, args.shared_prefix_len).tolist()
    rest = args.prompt_len - args.shared_prefix_len
    return [shared + rng.integers(0, vocab, rest).tolist() for _ in range(count)]


def percentiles(values: Sequence[float]) -> Dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in PERCENTILES}
    return {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}


def peak_memory(engine: Engine) -> Dict[str, Any]:
    if engine.device is not None and engine.device.type == "cuda":
        import torch

        return {"kind": "torch.cuda.max_memory_allocated",
                "bytes": int(torch.cuda.max_memory_allocated(engine.device))}
    # Linux reports ru_maxrss in KiB.
    return {"kind": "ru_maxrss (process peak RSS)",
            "bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


def synchronize(engine: Engine) -> None:
    if engine.device is not None and engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.device)


def run_bench(args: argparse.Namespace) -> Dict[str, Any]:
    engine = build_engine(args)
    if args.warmup:
        engine.generate(prompts(args, args.warmup, args.seed + 1), args.output_len)
        engine.allocator.clear_prefix_cache()  # the timed run starts cold
    if engine.graphs is not None:
        engine.graphs.capture()
    if engine.device is not None and engine.device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(engine.device)
    allocated_before = engine.allocator.pages_allocated
    steps_before, decode_before = engine.num_steps, engine.num_decode_steps
    synchronize(engine)
    start = time.perf_counter()
    requests = [engine.add_request(p, args.output_len) for p in prompts(args, args.requests,
                                                                      args.seed)]
    engine.run()
    synchronize(engine)
    wall = time.perf_counter() - start
    output_tokens = sum(len(r.output) for r in requests)
    ttft = [(r.token_times[0] - r.arrival_time) * 1e3 for r in requests]
    tpot = [(r.token_times[-1] - r.token_times[0]) * 1e3 / (len(r.token_times) - 1)
            for r in requests if len(r.token_times) > 1]
    cfg = engine.model.config
    return {
        "config": args.config, "device": args.device, "dtype": str(engine.model.dtype),
        "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
        "requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "shared_prefix_len": args.shared_prefix_len, "page_size": args.page_size,
        "num_pages": engine.allocator.num_pages, "max_tokens_per_step": args.max_tokens_per_step,
        "max_batch_size": args.max_batch_size, "cuda_graphs": engine.graphs is not None,
        "steps": engine.num_steps - steps_before,
        "decode_steps": engine.num_decode_steps - decode_before,
        "wall_s": wall, "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall,
        "total_tokens_per_s": (output_tokens + args.requests * args.prompt_len) / wall,
        "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot),
        "peak_memory": peak_memory(engine),
        "pages_allocated": engine.allocator.pages_allocated - allocated_before,
        "prompt_tokens_reused": sum(r.num_prefix_reused for r in requests),
        "free_pages_after": engine.allocator.num_free,
        # numpy's BLAS and Tessera's CPU backend both start a thread per core; on a small CPU
        # they oversubscribe it (docs/SERVING.md), so the report says what they were told.
        "thread_env": {name: os.environ.get(name) for name in THREAD_ENV},
    }


def format_report(result: Dict[str, Any]) -> str:
    def row(name: str, values: Dict[str, float]) -> str:
        return f"{name:<10}" + "  ".join(f"{k} {v:9.3f}" for k, v in values.items())

    memory = result["peak_memory"]
    lines = [
        f"tessera serve-bench: config {result['config']} ({result['layers']} layers, hidden "
        f"{result['hidden_size']}), {result['device']}, {result['dtype']}, cuda graphs "
        f"{'on' if result['cuda_graphs'] else 'off'}",
        f"requests {result['requests']} x (prompt {result['prompt_len']}, output "
        f"{result['output_len']}, shared prefix {result['shared_prefix_len']}); page size "
        f"{result['page_size']}, {result['num_pages']} pages, token budget "
        f"{result['max_tokens_per_step']}, max batch {result['max_batch_size']}",
        f"steps {result['steps']} ({result['decode_steps']} decode-only), wall "
        f"{result['wall_s']:.3f} s",
        f"throughput: {result['output_tokens_per_s']:.1f} output tok/s, "
        f"{result['total_tokens_per_s']:.1f} total tok/s",
        row("TTFT ms", result["ttft_ms"]),
        row("TPOT ms", result["tpot_ms"]),
        f"peak memory: {memory['bytes'] / 2**20:.1f} MiB ({memory['kind']})",
        f"KV pages allocated {result['pages_allocated']}, prompt tokens reused "
        f"{result['prompt_tokens_reused']}, free pages after {result['free_pages_after']} of "
        f"{result['num_pages']}",
    ]
    if result["device"] == "cpu":
        lines.append("threads: " + ", ".join(f"{name}={value or 'unset'}" for name, value in
                                            result["thread_env"].items()))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    result = run_bench(args)
    sys.stdout.write((json.dumps(result) if args.json else format_report(result)) + "\n")
    return 0
