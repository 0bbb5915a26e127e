"""Decode steps replayed from CUDA graphs, one set per batch-size bucket (torch on CUDA).

NOT RUN ON A GPU YET: written against torch's CUDA-graph API and Tessera's wrapper contract,
never executed (the development machine has no GPU); the GPU test
``tests/python/test_serving_gpu.py`` exercises it where torch and CUDA are present.

Piecewise capture. A Tessera plan fixes the work partition of the lengths it was made for, and
the C ABI has no fixed-capacity plan yet from Python: a graph that captured ``run`` would replay
the captured step's kv lengths (see :mod:`tessera.wrappers`, "Not graph safe"). Decode kv lengths
grow every step, so attention stays outside the graphs. For a bucket of ``B`` rows the step is
``L + 1`` graphs with attention run eagerly between them (as vLLM's piecewise graphs do):

* graph 0: embedding of the ``B`` static token ids, layer 0's norm and q/k/v projections;
* graph i (1 .. L-1): layer i-1's o_proj, residual, MLP, then layer i's norm and q/k/v;
* graph L: the last layer's o_proj and MLP, final norm, LM head, argmax into static tokens;
* between graph i and i+1: RoPE, ``append_paged_kv_cache`` and the planned decode wrapper on
  the first ``b`` rows of the static q/k/v, writing into the static attention output.

A step of ``b`` requests runs in the smallest bucket ``B >= b`` (1, 2, 4, ... up to
``max_batch_size``); rows ``b .. B-1`` carry token 0 and zero attention and are ignored. The
graphs of all buckets share one memory pool and are captured the first time a bucket is used
(or all at once by :meth:`DecodeGraphs.capture`). Sharing is safe here because every tensor a
graph leaves for later (q/k/v, hidden states, tokens) stays referenced, so no later capture is
given its memory, and a step replays its bucket's graphs in capture order, each consuming only
what an earlier graph of the same step produced; the static inputs (token ids, attention
outputs) are allocated outside the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine


def buckets(max_batch_size: int) -> List[int]:
    """Batch-size buckets: powers of two below ``max_batch_size``, then ``max_batch_size``."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch_size]


class _Bucket:
    """The static buffers and graphs of one bucket of ``size`` rows."""

    def __init__(self, engine: "Engine", size: int, pool: Any) -> None:
        import torch

        model, device = engine.model, engine.device
        cfg = model.config
        layers = cfg.num_hidden_layers
        self.size = size
        self.token_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.attn_out = [torch.zeros(size, cfg.num_attention_heads, cfg.head_dim,
                                     dtype=model.dtype, device=device) for _ in range(layers)]
        self.hidden: List[Any] = [None] * layers
        self.qkv: List[Any] = [None] * layers
        self.tokens: Any = None

        def piece(index: int) -> None:
            if index == 0:
                self.hidden[0] = model.embed_tokens(self.token_ids)
            else:
                hidden = model.after_attention(index - 1, self.hidden[index - 1],
                                               self.attn_out[index - 1])
                if index == layers:
                    self.tokens = model.greedy(model.logits(hidden))
                    return
                self.hidden[index] = hidden
            self.qkv[index] = model.qkv(index, self.hidden[index])

        # Warm up on a side stream (torch's advice before a capture), then capture each piece.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for index in range(layers + 1):
                piece(index)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graphs = []
        for index in range(layers + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                piece(index)
            self.graphs.append(graph)


class DecodeGraphs:
    """Runs decode steps through the bucket graphs (see the module docstring)."""

    def __init__(self, engine: "Engine", max_batch_size: int) -> None:
        import torch

        self.engine = engine
        self.sizes = buckets(max_batch_size)
        self._pool = torch.cuda.graph_pool_handle()
        self._buckets: Dict[int, _Bucket] = {}

    def bucket(self, batch_size: int) -> _Bucket:
        size = next((s for s in self.sizes if s >= batch_size), None)
        if size is None:
            raise ValueError(f"'batch_size': {batch_size} is above the largest CUDA-graph "
                             f"bucket {self.sizes[-1]} (max_batch_size)")
        if size not in self._buckets:
            self._buckets[size] = _Bucket(self.engine, size, self._pool)
        return self._buckets[size]

    def capture(self) -> None:
        """Captures every bucket now (the benchmark does, so no capture lands in a timed run)."""
        for size in self.sizes:
            self.bucket(size)

    def run(self, token_ids: np.ndarray, qo_indptr: np.ndarray, kv_indptr: np.ndarray,
            kv_indices: np.ndarray, kv_last_page_len: np.ndarray, positions: np.ndarray) -> Any:
        """The greedy tokens ``[b]`` (a device tensor) of a decode step of ``b`` requests."""
        from .engine import StepAttention

        rows = token_ids.shape[0]
        bucket = self.bucket(rows)
        engine = self.engine
        bucket.token_ids[:rows].copy_(engine.to_device(token_ids))
        bucket.token_ids[rows:].zero_()
        attention = StepAttention(engine, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                  positions, decode=True)
        attention.out = [out[:rows] for out in bucket.attn_out]
        layers = len(bucket.attn_out)
        for index in range(layers + 1):
            bucket.graphs[index].replay()
            if index < layers:
                q, k, v = bucket.qkv[index]
                attention(index, q[:rows], k[:rows], v[:rows])
        return bucket.tokens[:rows]
