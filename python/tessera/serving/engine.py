"""The serving engine: one step = schedule, run the model over Tessera's attention, sample.

A step's tokens (decodes and prefill chunks of several requests) run as one flat batch. Per
layer, attention is Tessera's: RoPE on q and k (``apply_rope_pos_ids_inplace``, or its Llama 3.1
form), ``append_paged_kv_cache`` into that layer's pages, then the attention wrapper, planned
once per step and reused by every layer:

* a step of decodes only: :class:`~tessera.BatchDecodeWithPagedKVCacheWrapper` (one query per
  request); on CUDA with ``use_cuda_graphs`` the rest of the step replays from CUDA graphs
  (:mod:`.graphs`);
* any other step (prefill chunks, mixed with decodes): causal
  :class:`~tessera.BatchPrefillWithPagedKVCacheWrapper`, a decode being a chunk of one token.

Sampling is greedy (argmax of the last row of each request that completes its known tokens).

Example::

    from tessera.serving import Engine, LlamaModel, random_llama_weights, CONFIGS
    model = LlamaModel(CONFIGS["tiny"], random_llama_weights(CONFIGS["tiny"], seed=0))
    engine = Engine(model, num_pages=256, page_size=16)
    outputs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=8)
"""

from __future__ import annotations

import itertools
import time
from typing import Any, List, Optional, Sequence

import numpy as np

from ..ops import (
    append_paged_kv_cache,
    apply_llama31_rope_pos_ids_inplace,
    apply_rope_pos_ids_inplace,
)
from ..wrappers import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
from .kv_cache import PageAllocator, PagedKVCache, page_table
from .model import Array, LlamaModel
from .scheduler import Request, Scheduler

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's customary float workspace


class StepAttention:
    """Tessera attention of one step, planned once and called by every layer.

    Holds the step's page table and positions (on the model's device) and the planned
    wrapper; ``__call__(layer, q, k, v)`` rotates q and k, appends k and v to the layer's
    pages and runs the wrapper. ``out`` rows, when given per layer, receive the attention
    output (the CUDA-graph runner's static buffers)."""

    def __init__(self, engine: "Engine", qo_indptr: np.ndarray, kv_indptr: np.ndarray,
                 kv_indices: np.ndarray, kv_last_page_len: np.ndarray, positions: np.ndarray,
                 decode: bool) -> None:
        cfg = engine.model.config
        self.engine = engine
        self.wrapper = engine.decode_wrapper if decode else engine.prefill_wrapper
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                 engine.page_size)
        if decode:
            self.wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, *heads,
                              q_data_type=engine.model.dtype)
        else:
            self.wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *heads,
                              causal=True, q_data_type=engine.model.dtype)
        device = engine.to_device
        self.qo_indptr, self.kv_indptr = device(qo_indptr), device(kv_indptr)
        self.kv_indices, self.kv_last_page_len = device(kv_indices), device(kv_last_page_len)
        self.positions = device(positions)
        self.out: Optional[List[Array]] = None

    def __call__(self, layer: int, q: Array, k: Array, v: Array) -> Array:
        self.engine.rope(q, k, self.positions)
        cache = self.engine.kv_cache[layer]
        append_paged_kv_cache(k, v, self.qo_indptr, cache, self.kv_indices, self.kv_indptr,
                              self.kv_last_page_len)
        out = None if self.out is None else self.out[layer]
        return self.wrapper.run(q, cache, out=out)


class Engine:
    """Continuous batching over a paged KV cache for one :class:`~.model.LlamaModel`.

    Args:
        model: the model (numpy weights run on Tessera's CPU backend, CUDA torch tensors on
            the GPU).
        num_pages, page_size: the KV page pool (per layer: ``num_pages`` pages of ``page_size``
            tokens).
        max_tokens_per_step: the token budget of a step (decodes + prefill chunks).
        max_batch_size: most requests running at once (also the largest CUDA-graph bucket).
        prefix_caching: reuse cached pages of identical prompt prefixes.
        use_cuda_graphs: replay decode steps from CUDA graphs captured per batch-size bucket;
            None = on for CUDA tensors, off otherwise (never run on a GPU yet; see
            docs/SERVING.md).
    """

    def __init__(self, model: LlamaModel, num_pages: int = 512, page_size: int = 16,
                 max_tokens_per_step: int = 512, max_batch_size: int = 64,
                 prefix_caching: bool = True, use_cuda_graphs: Optional[bool] = None) -> None:
        self.model = model
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, page_size)
        self.scheduler = Scheduler(self.allocator, max_tokens_per_step, max_batch_size,
                                   prefix_caching)
        cfg = model.config
        self.kv_cache = PagedKVCache(cfg.num_hidden_layers, num_pages, page_size,
                                     cfg.num_key_value_heads, cfg.head_dim, model.embed)
        self.device: Any = None
        if model.is_torch:
            import torch

            self.device = model.embed.device
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        else:
            workspace = np.empty(WORKSPACE_BYTES, np.uint8)
        self.prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        on_cuda = self.device is not None and self.device.type == "cuda"
        if use_cuda_graphs is None:
            use_cuda_graphs = on_cuda
        if use_cuda_graphs and not on_cuda:
            raise ValueError("'use_cuda_graphs': needs the model's weights as CUDA tensors")
        self.graphs = None
        if use_cuda_graphs:
            from .graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_batch_size)
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_decode_steps = 0  # steps of decodes only
        self.num_mixed_steps = 0  # steps with prefill chunks and decodes together

    # -- device helpers -----------------------------------------------------------------------

    def to_device(self, array: np.ndarray) -> Array:
        """A host int32 array on the model's device (numpy stays numpy)."""
        if self.device is None:
            return array
        import torch

        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def rope(self, q: Array, k: Array, positions: Array) -> None:
        """RoPE in place on q and k at ``positions`` (Llama 3.1 scaling from the config)."""
        cfg = self.model.config
        scaling = cfg.rope_scaling
        if scaling is None:
            apply_rope_pos_ids_inplace(q, k, positions, rope_theta=cfg.rope_theta)
        else:
            apply_llama31_rope_pos_ids_inplace(
                q, k, positions, rope_scale=float(scaling["factor"]),
                rope_theta=cfg.rope_theta, low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                old_context_len=int(scaling["original_max_position_embeddings"]))

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: int,
                    eos_token_id: Optional[int] = None) -> Request:
        """Queues a request; returns it (its ``output`` fills as steps run)."""
        vocab = self.model.config.vocab_size
        prompt = [int(t) for t in prompt]
        if any(t < 0 or t >= vocab for t in prompt):
            raise ValueError(f"'prompt': token ids must be in [0, {vocab}) (vocab_size)")
        request = Request(next(self._ids), prompt, int(max_new_tokens), eos_token_id)
        self.scheduler.add(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stops a request (waiting or running) and frees its pages; a finished one is left."""
        self.scheduler.finish(request, "cancelled")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> List[Request]:
        """Runs one step; returns the requests that finished in it."""
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_work:
                raise RuntimeError("scheduler made no progress (no request fits the page pool)")
            return []
        ids: List[int] = []
        positions: List[int] = []
        qo_lens: List[int] = []
        kv_lens: List[int] = []
        logit_rows: List[int] = []
        samplers: List[Request] = []
        for request, count in batch:
            start = request.num_computed
            ids.extend(request.tokens[start:start + count])
            positions.extend(range(start, start + count))
            qo_lens.append(count)
            kv_lens.append(start + count)
            if start + count == request.num_tokens:  # its next token comes from this step
                logit_rows.append(len(ids) - 1)
                samplers.append(request)
        decode = all(count == 1 and request.output for request, count in batch)
        kv_indptr, kv_indices, last = page_table([r.pages for r, _ in batch], kv_lens,
                                                 self.page_size)
        qo_indptr = np.zeros(len(batch) + 1, np.int32)
        np.cumsum(qo_lens, out=qo_indptr[1:])
        positions_host = np.asarray(positions, np.int32)
        if decode and self.graphs is not None:
            tokens = self.graphs.run(np.asarray(ids, np.int64), qo_indptr, kv_indptr,
                                     kv_indices, last, positions_host)
        else:
            attention = StepAttention(self, qo_indptr, kv_indptr, kv_indices, last,
                                      positions_host, decode)
            token_ids = self.to_device(np.asarray(ids, np.int64))
            rows = self.to_device(np.asarray(logit_rows, np.int64))
            logits = self.model.forward(token_ids, attention, rows)
            tokens = self.model.greedy(logits)
        tokens = tokens.tolist()  # the one host synchronisation of a step
        now = time.perf_counter()
        self.num_steps += 1
        self.num_decode_steps += decode
        self.num_mixed_steps += not decode and any(r.output for r, _ in batch)
        for request, count in batch:
            request.num_computed += count
        self.scheduler.register_prefix_pages([request for request, _ in batch])
        finished = []
        for request, token in zip(samplers, tokens):
            request.output.append(int(token))
            request.token_times.append(now)
            if request.eos_token_id is not None and token == request.eos_token_id:
                self.scheduler.finish(request, "eos")
            elif len(request.output) >= request.max_new_tokens:
                self.scheduler.finish(request, "length")
            else:
                continue
            finished.append(request)
        return finished

    def run(self) -> None:
        """Steps until no request is waiting or running."""
        while self.scheduler.has_work:
            self.step()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 eos_token_id: Optional[int] = None) -> List[List[int]]:
        """Greedy outputs of ``prompts``, all queued at once."""
        requests = [self.add_request(p, max_new_tokens, eos_token_id) for p in prompts]
        self.run()
        return [request.output for request in requests]
