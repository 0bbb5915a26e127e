"""The paged KV cache: a fixed pool of pages, per-request page lists and prefix reuse.

:class:`PageAllocator` hands out page ids of a pool of ``num_pages`` pages of ``page_size``
tokens. Pages are reference counted: a page holding a full page of prompt tokens is registered
under a key of its token chain (this page's token ids and the hash of the page before, as
vLLM's prefix caching does), and a later request whose prompt starts with the same tokens maps
those pages instead of computing them again. A page whose count drops to zero stays in the
prefix cache, *evictable*: it counts as free (``num_free``) and is handed out again, least
recently released first, once the never-used pages run out.

So ``num_free`` returns to ``num_pages`` once every request has finished or been cancelled,
whatever the prefix cache still remembers; the soak tests check exactly that.

:class:`PagedKVCache` owns the page tensors, one ``(k_cache, v_cache)`` pair
``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) per layer, in the model's framework.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np


PrefixKey = Tuple[int, Tuple[int, ...]]


def prefix_keys(tokens: Sequence[int], page_size: int) -> List[PrefixKey]:
    """The prefix-cache keys of the full pages of ``tokens``: key ``i`` is ``(hash of key
    i - 1, page i's token ids)``, so it stands for tokens ``0 .. (i+1) * page_size - 1``. The
    dict compares the page's ids exactly; only a 64-bit collision of the parent hashes could
    alias two prefixes."""
    keys: List[PrefixKey] = []
    parent = 0
    for start in range(0, len(tokens) - page_size + 1, page_size):
        key = (parent, tuple(tokens[start:start + page_size]))
        keys.append(key)
        parent = hash(key)
    return keys


class PageAllocator:
    """Reference-counted pages with a prefix cache (see the module docstring)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"'num_pages': expected >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"'page_size': expected >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._never_used: List[int] = list(range(num_pages - 1, -1, -1))  # pop() gives 0 first
        self._ref_count = [0] * num_pages
        self._by_key: Dict[PrefixKey, int] = {}  # prefix key -> page
        self._key_of: Dict[int, PrefixKey] = {}  # page -> its prefix key
        self._evictable: "OrderedDict[int, None]" = OrderedDict()  # cached, count 0, LRU first
        self.pages_allocated = 0  # pages handed out fresh (not reused), for the stats

    @property
    def num_free(self) -> int:
        """Pages no request holds (never used, or only remembered by the prefix cache)."""
        return len(self._never_used) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages registered in the prefix cache (held or evictable)."""
        return len(self._by_key)

    def ref_count(self, page: int) -> int:
        return self._ref_count[page]

    def match_prefix(self, keys: Sequence[PrefixKey]) -> List[int]:
        """The cached pages of the longest prefix of ``keys`` (not taken yet: pass them to
        :meth:`take`)."""
        pages = []
        for key in keys:
            page = self._by_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def can_allocate(self, count: int, shared: Sequence[int] = ()) -> bool:
        """Whether ``count`` new pages fit besides the cached ``shared`` ones about to be taken
        (an evictable shared page stops counting as free once taken)."""
        taken_from_free = sum(1 for p in shared if self._ref_count[p] == 0)
        return count <= self.num_free - taken_from_free

    def take(self, pages: Sequence[int]) -> None:
        """Adds a reference to each cached page of ``pages`` (prefix reuse)."""
        for page in pages:
            if self._ref_count[page] == 0:
                del self._evictable[page]
            self._ref_count[page] += 1

    def allocate(self, count: int) -> List[int]:
        """``count`` fresh pages (reference count 1); evicts least recently released cached
        pages when the never-used ones run out. Raises RuntimeError when the pool has fewer
        than ``count`` free pages (check :meth:`can_allocate` first; nothing is taken then)."""
        if count > self.num_free:
            raise RuntimeError(f"KV page pool exhausted: {count} pages wanted, {self.num_free} "
                               f"of {self.num_pages} free")
        pages = []
        for _ in range(count):
            if self._never_used:
                page = self._never_used.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._by_key[self._key_of.pop(page)]
            self._ref_count[page] = 1
            pages.append(page)
        self.pages_allocated += count
        return pages

    def register(self, page: int, key: PrefixKey) -> bool:
        """Puts a held page whose tokens are all written under ``key``. False (nothing changes)
        when another page already has that key or this page has one."""
        if key in self._by_key or page in self._key_of:
            return False
        self._by_key[key] = page
        self._key_of[page] = key
        return True

    def release(self, pages: Sequence[int]) -> None:
        """Drops one reference to each page; a page at zero becomes free (evictable if cached)."""
        for page in pages:
            count = self._ref_count[page]
            if count <= 0:
                raise RuntimeError(f"page {page} released more often than taken")
            self._ref_count[page] = count - 1
            if count == 1:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._never_used.append(page)

    def clear_prefix_cache(self) -> None:
        """Forgets the cached prefixes; evictable pages become plain free pages."""
        for page in self._evictable:
            self._never_used.append(page)
        self._evictable.clear()
        self._by_key.clear()
        self._key_of.clear()


class PagedKVCache:
    """Per-layer K and V page tensors ``[num_pages, page_size, num_kv_heads, head_dim]``."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, like: Any) -> None:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        if isinstance(like, np.ndarray):
            def make() -> Any:
                return np.zeros(shape, like.dtype)
        else:
            import torch

            def make() -> Any:
                return torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.layers: List[Tuple[Any, Any]] = [(make(), make()) for _ in range(num_layers)]
        self.page_size = page_size

    def __getitem__(self, layer: int) -> Tuple[Any, Any]:
        return self.layers[layer]

    def nbytes(self) -> int:
        k, _ = self.layers[0]
        per = k.nbytes if isinstance(k, np.ndarray) else k.numel() * k.element_size()
        return 2 * per * len(self.layers)


def page_table(page_lists: Sequence[Sequence[int]], kv_lens: Sequence[int], page_size: int
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's CSR page table of requests holding ``kv_lens[b]`` tokens in the first pages
    of ``page_lists[b]``: ``(kv_page_indptr, kv_page_indices, kv_last_page_len)``, int32."""
    counts = [(n + page_size - 1) // page_size for n in kv_lens]
    indptr = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=indptr[1:])
    indices = np.fromiter((p for pages, n in zip(page_lists, counts) for p in pages[:n]),
                          np.int32, int(indptr[-1]))
    last = np.array([(n - 1) % page_size + 1 if n else 0 for n in kv_lens], np.int32)
    return indptr, indices, last
