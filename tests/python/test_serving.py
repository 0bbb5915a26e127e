"""tessera.serving on the CPU (numpy, tiny configs): greedy tokens against a dense reference,
continuous batching and chunked prefill against one-at-a-time runs, prefix reuse, the page
allocator, a small soak with cancellations, and the serve-bench CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _serving_reference import reference_generate
from tessera.serving import CONFIGS, Engine, LlamaModel, PageAllocator, random_llama_weights
from tessera.serving.kv_cache import page_table, prefix_keys
from tessera.serving.soak import run_soak, solo_outputs

TINY = CONFIGS["tiny"]
# GQA 4:1, tied embeddings, head_dim 32 and Llama 3.1 rope scaling whose original context (32)
# is short enough that every frequency band (low, smoothed, high) shows in a few dozen tokens.
LLAMA31 = dict(TINY, num_attention_heads=8, num_key_value_heads=2, head_dim=32, hidden_size=96,
               tie_word_embeddings=True, rope_theta=500000.0,
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=32))


def make_model(config=TINY, seed=0) -> LlamaModel:
    # init_std 0.5: logits far from ties, so float rounding between batchings cannot flip argmax.
    return LlamaModel(config, random_llama_weights(config, seed, init_std=0.5))


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return make_model()


def random_prompts(rng, count, low, high, vocab=256):
    return [rng.integers(0, vocab, int(rng.integers(low, high + 1))).tolist()
            for _ in range(count)]


@pytest.mark.parametrize("config", [TINY, LLAMA31], ids=["tiny", "llama31-gqa4-tied"])
def test_greedy_tokens_match_dense_reference(config):
    model = make_model(config, seed=3)
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, 4, 1, 37) + [[7] * 8]  # one prompt of exactly two pages
    # Page size 4 and a budget of 9 tokens: chunked prefill across page boundaries, mixed steps.
    engine = Engine(model, num_pages=128, page_size=4, max_tokens_per_step=9)
    outputs = engine.generate(prompts, max_new_tokens=10)
    assert engine.num_mixed_steps > 0 and engine.num_decode_steps > 0
    for prompt, output in zip(prompts, outputs):
        assert output == reference_generate(model, prompt, 10)


def test_staggered_arrivals_and_chunked_prefill_match_one_at_a_time(model):
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, 10, 1, 40)
    lengths = [int(n) for n in rng.integers(1, 12, len(prompts))]
    engine = Engine(model, num_pages=256, page_size=4, max_tokens_per_step=6, max_batch_size=4)
    requests = []
    pending = list(zip(prompts, lengths))
    steps = 0
    while pending or engine.has_work:
        if pending and steps % 3 == 0:  # a new request every third step
            prompt, max_new = pending.pop(0)
            requests.append(engine.add_request(prompt, max_new))
        engine.step()
        steps += 1
        assert len(engine.scheduler.running) <= 4
    assert engine.num_mixed_steps > 0  # prefill chunks ran beside decodes
    assert [r.output for r in requests] == solo_outputs(model, [(p, n, None) for p, n in
                                                                zip(prompts, lengths)])
    assert [len(r.output) for r in requests] == lengths
    assert engine.allocator.num_free == 256


def test_every_running_request_advances_each_step(model):
    # A budget of 3 tokens below max_batch_size 8: the budget bounds the running requests (3),
    # and none is skipped a step.
    rng = np.random.default_rng(4)
    prompts = random_prompts(rng, 6, 1, 10)
    engine = Engine(model, num_pages=64, page_size=4, max_tokens_per_step=3, max_batch_size=8)
    requests = [engine.add_request(p, 5) for p in prompts]
    while engine.has_work:
        before = {r.request_id: r.num_computed for r in engine.scheduler.running}
        engine.step()
        assert len(engine.scheduler.running) <= 3
        for request in requests:
            if request.request_id in before:
                assert request.num_computed > before[request.request_id]
    assert [r.output for r in requests] == solo_outputs(model, [(p, 5, None) for p in prompts])


def test_eos_stops_a_request(model):
    prompt = [5, 6, 7, 8, 9]
    full = solo_outputs(model, [(prompt, 8, None)])[0]
    eos = full[3]
    engine = Engine(model, num_pages=32, page_size=4)
    request = engine.add_request(prompt, 8, eos_token_id=eos)
    engine.run()
    assert request.output == full[:full.index(eos) + 1]
    assert request.finish_reason == "eos" and engine.allocator.num_free == 32


def test_prefix_reuse_shares_pages_and_keeps_tokens(model):
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, 256, 13).tolist()  # 3 full pages of 4 + 1 token
    prompts = [prefix + rng.integers(0, 256, int(n)).tolist() for n in (3, 0, 9, 5)]
    prompts.append(prefix[:12])  # exactly the 3 shared pages: only 2 may be mapped

    def run(prefix_caching):
        engine = Engine(model, num_pages=64, page_size=4, max_tokens_per_step=64,
                        prefix_caching=prefix_caching)
        first = engine.add_request(prompts[0], 6)
        engine.step()  # the first prompt is computed (and its full pages cached) alone
        rest = [engine.add_request(p, 6) for p in prompts[1:]]
        engine.step()
        shared = first.pages[:3]
        counts = [engine.allocator.ref_count(p) for p in shared]
        engine.run()
        assert engine.allocator.num_free == 64
        return engine, [first, *rest], counts

    cached, cached_requests, counts = run(True)
    plain, plain_requests, _ = run(False)
    assert [r.output for r in cached_requests] == [r.output for r in plain_requests]
    assert [r.num_prefix_reused for r in cached_requests] == [0, 12, 12, 12, 8]
    assert counts == [5, 5, 4]  # the last prompt maps the first two shared pages only
    assert cached.allocator.pages_allocated == plain.allocator.pages_allocated - 3 * 3 - 2
    assert cached.allocator.num_cached > 0


def test_allocator_counts_evicts_and_refuses():
    allocator = PageAllocator(num_pages=4, page_size=2)
    keys = prefix_keys([1, 2, 3, 4, 5], 2)
    assert len(keys) == 2 and keys != prefix_keys([1, 2, 3, 9], 2)
    pages = allocator.allocate(2)
    assert allocator.num_free == 2
    assert allocator.register(pages[0], keys[0]) and not allocator.register(pages[1], keys[0])
    assert allocator.match_prefix(keys) == [pages[0]]
    with pytest.raises(RuntimeError, match="exhausted: 3 pages wanted, 2 of 4 free"):
        allocator.allocate(3)
    allocator.release(pages)
    assert allocator.num_free == 4 and allocator.num_cached == 1  # cached page is evictable
    assert allocator.can_allocate(3, shared=[pages[0]]) and not allocator.can_allocate(
        4, shared=[pages[0]])
    allocator.allocate(4)  # evicts the cached page last
    assert allocator.num_free == 0 and allocator.num_cached == 0
    assert allocator.match_prefix(keys) == []
    with pytest.raises(RuntimeError, match="released more often"):
        allocator.release([pages[0]] * 2)
    with pytest.raises(ValueError, match="'num_pages'"):
        PageAllocator(0, 16)


def test_page_table_csr():
    indptr, indices, last = page_table([[5, 6, 7], [2], [9, 3]], [9, 1, 4], 4)
    assert indptr.tolist() == [0, 3, 4, 5] and indices.tolist() == [5, 6, 7, 2, 9]
    assert last.tolist() == [1, 1, 4]


def test_page_exhaustion_waits_and_oversized_request_is_refused(model):
    # Each request needs 4 pages; the pool of 6 holds one at a time: the others wait.
    engine = Engine(model, num_pages=6, page_size=4, max_tokens_per_step=64)
    prompts = [[i + 1] * 10 for i in range(3)]
    requests = [engine.add_request(p, 6) for p in prompts]
    while engine.has_work:
        engine.step()
        assert len(engine.scheduler.running) <= 1
        assert engine.allocator.num_free >= 0
    assert [r.output for r in requests] == solo_outputs(model, [(p, 6, None) for p in prompts])
    assert engine.allocator.num_free == 6
    with pytest.raises(ValueError, match="'max_new_tokens'.*needs 7 pages.*has 6"):
        engine.add_request([1] * 20, 8)
    with pytest.raises(ValueError, match="'prompt'"):
        engine.add_request([], 4)
    with pytest.raises(ValueError, match="'prompt'.*vocab_size"):
        engine.add_request([256], 4)


def test_cancel_frees_pages(model):
    engine = Engine(model, num_pages=16, page_size=4, max_tokens_per_step=8)
    running = engine.add_request(list(range(20)), 10)
    waiting = engine.add_request(list(range(30, 50)), 10)
    engine.step()  # the first prompt's first chunk
    assert running.state == "running" and waiting.state == "waiting"
    assert engine.allocator.num_free == 16 - running.pages_needed(4)
    engine.cancel(running)
    engine.cancel(waiting)
    assert engine.allocator.num_free == 16 and not engine.has_work
    assert running.finish_reason == waiting.finish_reason == "cancelled"
    assert engine.step() == []


def test_cancelled_prefill_leaves_only_computed_pages_cached(model):
    prompt = list(range(40, 60))
    engine = Engine(model, num_pages=16, page_size=4, max_tokens_per_step=6)
    first = engine.add_request(prompt, 4)
    engine.step()  # 6 of 20 prompt tokens: page 0 full, page 1 half written
    engine.cancel(first)
    assert engine.allocator.num_free == 16 and engine.allocator.num_cached == 1
    second = engine.add_request(prompt, 4)
    engine.run()
    assert second.num_prefix_reused == 4  # page 0 only; page 1 was never complete
    assert second.output == solo_outputs(model, [(prompt, 4, None)])[0]


def test_soak_random_requests_cancellations_and_prefix_reuse(model):
    # The soak of tessera.serving.soak (whose 10,000-request run is in docs/RELIABILITY.md).
    report = run_soak(model, 300, seed=7)
    assert report["requests"] == 300
    assert report["page_leaks"] == 0 and report["free_pages_end"] == report["free_pages_start"]
    assert report["nonzero_ref_counts"] == 0
    assert report["prompt_tokens_reused"] > 0 and report["cancelled"] > 0
    assert report["mismatches"] == 0


def test_soak_module_runs_and_reports(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tessera.serving.soak", "--requests", "40",
                             "--rss-every", "10"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["requests"] == 40 and report["page_leaks"] == 0 and report["mismatches"] == 0
    assert len(report["rss_bytes"]) >= 2 and all(b > 0 for _, b in report["rss_bytes"])


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "tessera.serving", *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_prints_metrics():
    result = run_cli("--requests", "6", "--prompt-len", "24", "--output-len", "5",
                     "--shared-prefix-len", "8", "--page-size", "8", "--max-tokens-per-step",
                     "64", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["output_tokens"] == 30 and report["device"] == "cpu"
    assert report["free_pages_after"] == report["num_pages"]
    assert report["prompt_tokens_reused"] > 0
    for metric in ("ttft_ms", "tpot_ms"):
        assert set(report[metric]) == {"p50", "p90", "p99"}
        assert 0 < report[metric]["p50"] <= report[metric]["p99"]
    assert report["output_tokens_per_s"] > 0 and report["peak_memory"]["bytes"] > 0
    text = run_cli("--requests", "2", "--prompt-len", "5", "--output-len", "3")
    assert text.returncode == 0, text.stderr
    for word in ("output tok/s", "TTFT ms", "TPOT ms", "p99", "peak memory"):
        assert word in text.stdout
    bad = run_cli("--prompt-len", "4", "--shared-prefix-len", "5")
    assert bad.returncode == 2 and "--shared-prefix-len" in bad.stderr


def test_console_script_runs_the_bench():
    script = Path(sys.executable).parent / "tessera-serve-bench"
    if not script.exists():
        pytest.skip("no tessera-serve-bench console script (the package is not pip-installed)")
    result = subprocess.run([str(script), "--requests", "2", "--prompt-len", "4",
                             "--output-len", "2", "--json"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["output_tokens"] == 4
