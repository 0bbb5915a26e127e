"""``enable_pdl`` (FlashInfer's run argument, programmatic dependent launch) through the three
wrappers on the CPU: the call takes the C ABI's *_v2 path with the option set, which the CPU
ignores, so the result is the same as without it (the GPU tests check the launch itself)."""

from __future__ import annotations

import numpy as np

import tessera
from _reference import PagedCache, indptr


def test_wrappers_accept_enable_pdl(rng):
    workspace = np.empty(16 << 20, np.uint8)
    q_lens, kv_lens = [7, 1, 20], [30, 1, 20]
    cache = PagedCache(rng, kv_lens, 8, 2, 32, np.float32, "NHD")
    q = rng.standard_normal((sum(q_lens), 8, 32)).astype(np.float32)
    k = rng.standard_normal((sum(kv_lens), 2, 32)).astype(np.float32)
    v = rng.standard_normal((sum(kv_lens), 2, 32)).astype(np.float32)

    ragged = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    ragged.plan(indptr(q_lens), indptr(kv_lens), 8, 2, 32, causal=True)
    np.testing.assert_array_equal(ragged.run(q, k, v, enable_pdl=True), ragged.run(q, k, v))

    paged = tessera.BatchPrefillWithPagedKVCacheWrapper(workspace)
    paged.plan(indptr(q_lens), cache.page_indptr, cache.page_indices, cache.last_page_len, 8, 2,
               32, 8, causal=True)
    kv = (cache.k_cache, cache.v_cache)
    np.testing.assert_array_equal(paged.run(q, kv, enable_pdl=True), paged.run(q, kv))

    decode = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    decode.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 8, 2, 32, 8)
    qd = rng.standard_normal((3, 8, 32)).astype(np.float32)
    np.testing.assert_array_equal(decode.run(qd, kv, enable_pdl=True), decode.run(qd, kv))
