"""Requests and the continuous-batching scheduler.

Each step the scheduler fills a token budget (``max_tokens_per_step``) in this order:

1. one token for every running request that is decoding;
2. the next prompt chunk of every running request still in prefill (chunked prefill: a long
   prompt takes several steps, sharing them with the decodes);
3. new requests from the queue, first come first served, while budget, batch slots
   (``max_batch_size`` running requests) and KV pages last.

Every running request gets at least one token each step: a request is only admitted with
budget to spare after all running ones were served, and takes at least one token, so never more
requests run than the budget has tokens.

Pages are reserved when a request is admitted: every page its prompt plus ``max_new_tokens``
can fill, less the full prompt pages found in the prefix cache. So a running request never waits
for a page and nothing is ever preempted; a request that does not fit waits in the queue (and
the ones behind it with it) until finished or cancelled requests give pages back. A request
that could not fit even in an empty pool is refused by :meth:`Scheduler.add` with ValueError.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Optional, Sequence, Tuple

from .kv_cache import PageAllocator, PrefixKey, prefix_keys


@dataclass
class Request:
    """One generation request and its progress.

    ``tokens`` = prompt + output so far; the KV cache holds the first ``num_computed`` of them
    (in ``pages``). A request decodes once its whole prompt is computed: the input of a decode
    step is its last output token.
    """

    request_id: int
    prompt: List[int]
    max_new_tokens: int
    eos_token_id: Optional[int] = None
    output: List[int] = field(default_factory=list)
    pages: List[int] = field(default_factory=list)
    num_computed: int = 0
    num_prefix_reused: int = 0  # prompt tokens whose pages came from the prefix cache
    state: str = "waiting"  # waiting, running, finished, cancelled
    finish_reason: Optional[str] = None  # "length", "eos" or "cancelled"
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: List[float] = field(default_factory=list)  # when each output token came
    keys: List[PrefixKey] = field(default_factory=list)  # prefix keys of the full prompt pages
    num_registered: int = 0  # prompt pages registered in the prefix cache

    @property
    def tokens(self) -> List[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def decoding(self) -> bool:
        return self.num_computed >= len(self.prompt)

    @property
    def done(self) -> bool:
        return self.state in ("finished", "cancelled")

    def pages_needed(self, page_size: int) -> int:
        """Pages of the longest KV this request can have: the prompt and every output token
        but the last (which is never fed back)."""
        return (len(self.prompt) + self.max_new_tokens - 1 + page_size - 1) // page_size


class Scheduler:
    """Chooses each step's batch (see the module docstring)."""

    def __init__(self, allocator: PageAllocator, max_tokens_per_step: int, max_batch_size: int,
                 prefix_caching: bool = True) -> None:
        if max_tokens_per_step < 1:
            raise ValueError(f"'max_tokens_per_step': expected >= 1, got {max_tokens_per_step}")
        if max_batch_size < 1:
            raise ValueError(f"'max_batch_size': expected >= 1, got {max_batch_size}")
        self.allocator = allocator
        self.max_tokens_per_step = max_tokens_per_step
        self.max_batch_size = max_batch_size
        self.prefix_caching = prefix_caching
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []

    def add(self, request: Request) -> None:
        if not request.prompt:
            raise ValueError(f"'prompt': request {request.request_id} has no token")
        if request.max_new_tokens < 1:
            raise ValueError(f"'max_new_tokens': expected >= 1, got {request.max_new_tokens}")
        page_size = self.allocator.page_size
        needed = request.pages_needed(page_size)
        if needed > self.allocator.num_pages:
            raise ValueError(
                f"'max_new_tokens': request {request.request_id} needs {needed} pages of "
                f"{page_size} tokens (prompt {len(request.prompt)} + max_new_tokens "
                f"{request.max_new_tokens}), the pool has {self.allocator.num_pages} "
                "(num_pages)")
        if self.prefix_caching:
            request.keys = prefix_keys(request.prompt, page_size)
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> List[Tuple[Request, int]]:
        """This step's batch: (request, number of its tokens to run), decodes first."""
        budget = self.max_tokens_per_step
        batch: List[Tuple[Request, int]] = []
        for request in self.running:
            if request.decoding and budget > 0:
                batch.append((request, 1))
                budget -= 1
        for request in self.running:
            if not request.decoding and budget > 0:
                count = min(len(request.prompt) - request.num_computed, budget)
                batch.append((request, count))
                budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            if not self._admit(request):
                break  # first come first served: wait for pages
            self.waiting.popleft()
            count = min(len(request.prompt) - request.num_computed, budget)
            batch.append((request, count))
            budget -= count
        return batch

    def _admit(self, request: Request) -> bool:
        """Maps the request's cached prefix pages and allocates the rest; False (nothing
        taken) when the pool has too few free pages."""
        page_size = self.allocator.page_size
        # At most the full pages before the last prompt token: that token is always computed
        # (its logits give the first output token) and never written into a shared page.
        shareable = (len(request.prompt) - 1) // page_size
        shared = self.allocator.match_prefix(request.keys[:shareable])
        fresh = request.pages_needed(page_size) - len(shared)
        if not self.allocator.can_allocate(fresh, shared):
            return False
        self.allocator.take(shared)
        request.pages = shared + self.allocator.allocate(fresh)
        request.num_computed = request.num_prefix_reused = len(shared) * page_size
        request.num_registered = len(shared)
        request.state = "running"
        self.running.append(request)
        return True

    def register_prefix_pages(self, requests: Sequence[Request]) -> None:
        """Registers the prompt pages these requests have now computed in full."""
        for request in requests:
            full = min(request.num_computed // self.allocator.page_size, len(request.keys))
            for index in range(request.num_registered, full):
                self.allocator.register(request.pages[index], request.keys[index])
            request.num_registered = max(request.num_registered, full)

    def finish(self, request: Request, reason: str) -> None:
        """Ends a request (``reason``: "length", "eos" or "cancelled") and frees its pages."""
        if request.done:
            return
        if request.state == "waiting":
            self.waiting.remove(request)
        else:
            self.running.remove(request)
            self.allocator.release(request.pages)
            request.pages = []
        request.state = "cancelled" if reason == "cancelled" else "finished"
        request.finish_reason = reason
