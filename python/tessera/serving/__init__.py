"""A small serving loop over Tessera's attention (issue 36): continuous batching, a paged KV
allocator with prefix reuse, chunked prefill under a per-step token budget, decode steps
replayed from CUDA graphs per batch-size bucket (torch on CUDA), greedy sampling, and a
Llama-architecture model with Hugging Face weight names whose attention is Tessera's.

Modules: :mod:`.model` (the decoder over numpy or torch), :mod:`.kv_cache` (page allocator,
prefix cache, page tensors), :mod:`.scheduler` (requests, continuous batching),
:mod:`.engine` (the step), :mod:`.graphs` (CUDA graphs of decode steps), :mod:`.bench` and
``python -m tessera.serving`` (the serve benchmark). See docs/SERVING.md.
"""

from __future__ import annotations

from .engine import Engine
from .kv_cache import PageAllocator, PagedKVCache, prefix_keys
from .model import (
    CONFIGS,
    LlamaConfig,
    LlamaModel,
    random_llama_weights,
    to_torch,
    weights_from_state_dict,
)
from .scheduler import Request, Scheduler

__all__ = [
    "CONFIGS",
    "Engine",
    "LlamaConfig",
    "LlamaModel",
    "PageAllocator",
    "PagedKVCache",
    "Request",
    "Scheduler",
    "prefix_keys",
    "random_llama_weights",
    "to_torch",
    "weights_from_state_dict",
]
