"""Attention sinks (``sinks=``, float32 [num_qo_heads]) through varlen_attention and the three
FlashInfer-style wrappers' run() on the CPU, against the float64 reference with the sinks
folded in as include/tessera/attention.hpp defines them; bad sinks raise naming 'sinks'."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from _reference import PagedCache, attention_ref, fold_sinks_ref, indptr, tolerance


@pytest.fixture
def workspace() -> np.ndarray:
    return np.empty(16 << 20, np.uint8)


def sinks_for(rng, heads: int) -> np.ndarray:
    return rng.uniform(-3.0, 5.0, heads).astype(np.float32)


def test_varlen_attention_sinks(rng, dtype):
    q_lens, kv_lens = [5, 40, 3], [0, 40, 700]  # request 0 sees no key: o = 0, lse = sink
    q = rng.standard_normal((sum(q_lens), 8, 64)).astype(dtype)
    k = rng.standard_normal((sum(kv_lens), 2, 64)).astype(dtype)
    v = rng.standard_normal((sum(kv_lens), 2, 64)).astype(dtype)
    sinks = sinks_for(rng, 8)
    o, lse = tessera.varlen_attention(q, k, v, indptr(q_lens), indptr(kv_lens), causal=True,
                                      window_size=(100, -1), return_lse=True, sinks=sinks)
    ref_o, ref_lse = fold_sinks_ref(*attention_ref(q, k, v, q_lens, kv_lens, causal=True,
                                                   window=(100, -1)), sinks)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(lse[:5], np.broadcast_to(sinks, (5, 8)), rtol=1e-6)
    assert not o[:5].any()


def test_ragged_wrapper_sinks(rng, workspace):
    q_lens, kv_lens = [7, 1, 30], [9, 0, 30]
    q = rng.standard_normal((sum(q_lens), 4, 32)).astype(np.float32)
    k = rng.standard_normal((sum(kv_lens), 1, 32)).astype(np.float32)
    v = rng.standard_normal((sum(kv_lens), 1, 32)).astype(np.float32)
    sinks = sinks_for(rng, 4)
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan(indptr(q_lens), indptr(kv_lens), 4, 1, 32, causal=True, logits_soft_cap=20.0)
    o, lse = wrapper.run(q, k, v, return_lse=True, sinks=sinks)
    ref_o, ref_lse = fold_sinks_ref(*attention_ref(q, k, v, q_lens, kv_lens, causal=True,
                                                   softcap=20.0), sinks)
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)
    plain = wrapper.run(q, k, v)  # the same plan without sinks: the fast path again
    np.testing.assert_allclose(plain, attention_ref(q, k, v, q_lens, kv_lens, causal=True,
                                                    softcap=20.0)[0], atol=2e-5, rtol=2e-5)


def test_paged_wrapper_sinks(rng, dtype, workspace):
    q_lens, kv_lens = [7, 1, 20], [30, 1, 20]
    cache = PagedCache(rng, kv_lens, 8, 2, 32, dtype, "NHD")
    q = rng.standard_normal((sum(q_lens), 8, 32)).astype(dtype)
    sinks = sinks_for(rng, 8)
    wrapper = tessera.BatchPrefillWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr(q_lens), cache.page_indptr, cache.page_indices, cache.last_page_len, 8, 2,
                 32, 8, causal=True)
    o, lse = wrapper.run(q, (cache.k_cache, cache.v_cache), return_lse=True, sinks=sinks)
    ref_o, ref_lse = fold_sinks_ref(*attention_ref(q, None, None, q_lens, kv_lens, causal=True,
                                                   k_rows=cache.rows()), sinks)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("q_per_request", [1, 3])
def test_decode_wrapper_sinks(rng, workspace, q_per_request):
    tessera.set_num_threads(4)  # the long request is split: the merge folds the sink once
    try:
        kv_lens = [3000, 17, 5]
        cache = PagedCache(rng, kv_lens, 16, 2, 64, np.float32)
        wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
        wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 8, 2, 64, 16,
                     q_per_request=q_per_request)
        q = rng.standard_normal((3 * q_per_request, 8, 64)).astype(np.float32)
        sinks = sinks_for(rng, 8)
        o, lse = wrapper.run(q, (cache.k_cache, cache.v_cache), return_lse=True, sinks=sinks)
        ref_o, ref_lse = fold_sinks_ref(*attention_ref(
            q, None, None, [q_per_request] * 3, kv_lens, causal=q_per_request > 1,
            k_rows=cache.rows()), sinks)
        np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(lse, ref_lse, atol=1e-4)
    finally:
        tessera.set_num_threads(0)


@pytest.mark.parametrize("bad", ["float16", "shape", "2d"])
def test_bad_sinks_name_the_argument(rng, workspace, bad):
    q = rng.standard_normal((4, 4, 32)).astype(np.float32)
    k = rng.standard_normal((4, 4, 32)).astype(np.float32)
    sinks = {"float16": np.zeros(4, np.float16), "shape": np.zeros(3, np.float32),
             "2d": np.zeros((1, 4), np.float32)}[bad]
    with pytest.raises(ValueError, match="'sinks'"):
        tessera.varlen_attention(q, k, k, indptr([4]), indptr([4]), sinks=sinks)
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan(indptr([4]), indptr([4]), 4, 4, 32)
    with pytest.raises(ValueError, match="'sinks'"):
        wrapper.run(q, k, k, sinks=sinks)
