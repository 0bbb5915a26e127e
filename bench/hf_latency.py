#!/usr/bin/env python3
"""Hugging Face transformers latency: the "tessera" attention backend vs "sdpa" (and any other
registered implementation) on one model: a 1 x N-token prefill and per-token greedy decode.

    python bench/hf_latency.py                          # small random-init Llama, 1 x 8192
    python bench/hf_latency.py --model meta-llama/Llama-3.2-1B --seq-len 8192 --decode-tokens 128
    python bench/hf_latency.py --impls tessera,sdpa,flash_attention_2 --json out.json

Prefill: one forward of [1, seq_len] tokens with a fresh cache (CUDA-event timed, median of
--repeats after --warmup runs). Decode: after a prefill, --decode-tokens single-token forwards
with the growing dynamic cache; reported per token (median over repeats of the mean).
Needs torch, transformers >= 4.48 and a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Callable, Dict, List


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="",
                        help="a Hugging Face model name or path (default: a random-init Llama with "
                             "hidden 512, 4 layers, 8 heads, 2 kv heads, vocab 1000)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--impls", default="tessera,sdpa",
                        help="comma-separated attention implementations to compare")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="", help="also write the results to this file")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one prefill and 8 decode steps per implementation "
                             "(torch.profiler: the top kernels by GPU time and ops by CPU time)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        print(f"hf_latency: needs torch and transformers: {error}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("hf_latency: no CUDA device", file=sys.stderr)
        return 2
    import tessera
    import tessera.integrations.transformers as tessera_hf

    tessera_hf.register()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype,
                                                     attn_implementation="sdpa")
    else:
        config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                             max_position_embeddings=args.seq_len + args.decode_tokens + 16,
                             attn_implementation="sdpa")
        model = LlamaForCausalLM(config).to(dtype)
    model = model.to("cuda").eval()
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (1, args.seq_len), device="cuda")

    def set_attention(name: str) -> None:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(name)
        else:
            model.config._attn_implementation = name

    def timed(fn) -> float:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)

    results: List[Dict] = []
    for name in [item.strip() for item in args.impls.split(",") if item.strip()]:
        try:
            set_attention(name)
        except (ValueError, ImportError) as error:
            print(f"{name}: skipped ({error})", file=sys.stderr)
            continue

        def prefill():
            cache = DynamicCache()
            with torch.no_grad():
                output = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
            return output, cache

        def decode_run() -> float:
            output, cache = prefill()
            token = output.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()

            def steps():
                nonlocal token
                with torch.no_grad():
                    for _ in range(args.decode_tokens):
                        step = model(input_ids=token, past_key_values=cache, use_cache=True)
                        token = step.logits[:, -1:].argmax(-1)

            return timed(steps) / args.decode_tokens

        for _ in range(args.warmup):
            prefill()
            decode_run()
        prefill_ms = statistics.median(timed(prefill) for _ in range(args.repeats))
        decode_ms = statistics.median(decode_run() for _ in range(args.repeats))
        if args.profile:  # after the timing, which it would disturb
            profile(torch, name, prefill, model)
        results.append({"impl": name, "prefill_ms": prefill_ms, "decode_ms_per_token": decode_ms})
        torch.cuda.empty_cache()

    device = torch.cuda.get_device_name()
    print(f"model: {args.model or 'random-init Llama (512 hidden, 4 layers, 8/2 heads)'}, "
          f"{args.dtype}, {device}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, tessera {tessera.__version__}")
    print(f"{'impl':<20} {'prefill 1x' + str(args.seq_len) + ' (ms)':>22} "
          f"{'decode (ms/token)':>18}")
    baseline = next((r for r in results if r["impl"] == "sdpa"), None)
    for row in results:
        ratio = ""
        if baseline is not None and row is not baseline:
            ratio = (f"   speedup over sdpa: prefill "
                     f"{baseline['prefill_ms'] / row['prefill_ms']:.2f}x, decode "
                     f"{baseline['decode_ms_per_token'] / row['decode_ms_per_token']:.2f}x")
        print(f"{row['impl']:<20} {row['prefill_ms']:>22.3f} {row['decode_ms_per_token']:>18.3f}"
              f"{ratio}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": args.model or "random-llama-512x4", "seq_len": args.seq_len,
                       "decode_tokens": args.decode_tokens, "dtype": args.dtype,
                       "device": device, "results": results}, handle, indent=2)
    return 0


def profile(torch, name: str, prefill, model) -> None:
    """Where one prefill and 8 decode steps spend their time under implementation ``name``:
    the top kernels by GPU time (torch.profiler) and the top Python functions by host time
    (cProfile, a separate run: the two profilers' overheads do not mix)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile as torch_profile

    def decode_steps() -> Callable[[], None]:
        """8 decode steps after a fresh prefill (the prefill is not part of the returned run)."""
        output, cache = prefill()
        token = output.logits[:, -1:].argmax(-1)

        def steps() -> None:
            nonlocal token
            for _ in range(8):
                step = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = step.logits[:, -1:].argmax(-1)
        return steps

    for phase in ("prefill", "decode x8"):
        with torch.no_grad():
            run = prefill if phase == "prefill" else decode_steps()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            print(f"--- profile {name}, {phase}: kernels by GPU time")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10,
                                            max_name_column_width=70))
            run = prefill if phase == "prefill" else decode_steps()
            torch.cuda.synchronize()
            host = cProfile.Profile()
            host.enable()
            run()
            host.disable()
            torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(18)
        print(f"--- profile {name}, {phase}: Python functions by host time")
        print(text.getvalue())


if __name__ == "__main__":
    sys.exit(main())
