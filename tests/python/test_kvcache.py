"""tessera.attention_with_kvcache (FlashAttention's flash_attn_with_kvcache) on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from _reference import PagedCache, attention_ref, indptr, tolerance


def _check(o, lse, q4, cache: PagedCache, causal, dtype, **options):
    batch, seqlen_q, heads, dim = q4.shape
    q = q4.reshape(batch * seqlen_q, heads, dim)
    ref_o, ref_lse = attention_ref(q, None, None, [seqlen_q] * batch, cache.kv_lens,
                                   causal=causal, k_rows=cache.rows(), **options)
    np.testing.assert_allclose(o.reshape(q.shape).astype(np.float64), ref_o, **tolerance(dtype))
    if lse is not None:
        np.testing.assert_allclose(lse.reshape(q.shape[:2]), ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("seqlen_q", [1, 3, 70], ids=["decode", "speculative", "prefill"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_block_table(rng, dtype, seqlen_q, layout):
    kv_lens = [75, 16, 1, 130]
    cache = PagedCache(rng, kv_lens, 16, 2, 64, dtype, layout)
    q = rng.standard_normal((4, seqlen_q, 8, 64)).astype(dtype)
    o, lse = tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache,
                                            cache_seqlens=cache.seq_lens,
                                            block_table=cache.block_table, causal=True,
                                            return_lse=True, kv_layout=layout)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == q.shape[:3]
    _check(o, lse, q, cache, True, dtype)


def test_three_dim_q_and_options(rng):
    cache = PagedCache(rng, [40, 9], 8, 1, 32, np.float32)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    o = tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache,
                                       cache_seqlens=cache.seq_lens, block_table=cache.block_table,
                                       softmax_scale=0.2, window_size=(7, -1), softcap=3.0)
    assert o.shape == q.shape
    _check(o, None, q[:, None], cache, False, np.float32, window=(7, -1), softcap=3.0,
           sm_scale=0.2)


def test_csr_page_table(rng):
    cache = PagedCache(rng, [33, 5, 0], 4, 2, 16, np.float32)
    q = rng.standard_normal((3, 2, 4, 16)).astype(np.float32)
    o = tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache, causal=True,
                                       kv_page_indptr=cache.page_indptr,
                                       kv_page_indices=cache.page_indices,
                                       kv_last_page_len=cache.last_page_len)
    _check(o, None, q, cache, True, np.float32)
    np.testing.assert_array_equal(o[2], 0)  # a request with no key


def test_cache_seqlens_none_means_full_cache(rng):
    # Two requests of exactly 2 full pages: without cache_seqlens the whole table is attended.
    cache = PagedCache(rng, [32, 32], 16, 2, 16, np.float32)
    table = cache.block_table[:, :2].copy()
    q = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
    o = tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache, block_table=table)
    _check(o, None, q, cache, False, np.float32)


def test_block_table_batch_must_match_q(rng):
    cache = PagedCache(rng, [32, 32], 16, 2, 16, np.float32)
    q = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="block_table"):
        tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache,
                                       block_table=cache.block_table[:1])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_dense_cache(rng, layout, dtype):
    batch, cache_len, kv_heads, dim = 3, 24, 2, 32
    shape = ((batch, cache_len, kv_heads, dim) if layout == "NHD"
             else (batch, kv_heads, cache_len, dim))
    k_cache = rng.standard_normal(shape).astype(dtype)
    v_cache = rng.standard_normal(shape).astype(dtype)
    lens = np.array([24, 7, 0], np.int32)
    q = rng.standard_normal((batch, 2, 4, dim)).astype(dtype)
    o, lse = tessera.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                            kv_layout=layout, return_lse=True)
    rows = []
    for b in range(batch):
        kb = k_cache[b] if layout == "NHD" else k_cache[b].transpose(1, 0, 2)
        vb = v_cache[b] if layout == "NHD" else v_cache[b].transpose(1, 0, 2)
        rows.append((kb[:lens[b]], vb[:lens[b]]))
    ref_o, ref_lse = attention_ref(q.reshape(-1, 4, dim), None, None, [2] * batch, lens.tolist(),
                                   causal=True, k_rows=rows)
    np.testing.assert_allclose(o.reshape(-1, 4, dim).astype(np.float64), ref_o, **tolerance(dtype))
    np.testing.assert_allclose(lse.reshape(-1, 4), ref_lse, atol=1e-4, rtol=1e-5)


def test_append_new_kv_then_attend(rng):
    cache = PagedCache(rng, [10, 31], 8, 2, 16, np.float32, spare_pages=6)
    # room for the new tokens: extend the block tables with free pages
    used = set(cache.page_indices.tolist())
    free = [p for p in range(cache.num_pages) if p not in used]
    table = np.array([[*cache.block_table[0, :2], free[0], free[1], free[3]],
                      [*cache.block_table[1, :4], free[2]]], np.int32)
    k_new = rng.standard_normal((2, 2, 2, 16)).astype(np.float32)
    v_new = rng.standard_normal((2, 2, 2, 16)).astype(np.float32)
    q = rng.standard_normal((2, 2, 4, 16)).astype(np.float32)
    before = [(kb.copy(), vb.copy()) for kb, vb in cache.rows()]
    lens = np.array([10, 31], np.int32)
    o = tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache, k_new, v_new,
                                       cache_seqlens=lens, block_table=table, causal=True)
    np.testing.assert_array_equal(lens, [10, 31])  # cache_seqlens itself is not modified
    rows = []
    for b in range(2):
        kb = np.concatenate([before[b][0], k_new[b]])
        vb = np.concatenate([before[b][1], v_new[b]])
        rows.append((kb, vb))
        # the cache now holds the new rows at positions len_b, len_b + 1
        for t in range(2):
            position = lens[b] + t
            page = table[b, position // 8]
            np.testing.assert_array_equal(cache.k_cache[page, position % 8], k_new[b, t])
            np.testing.assert_array_equal(cache.v_cache[page, position % 8], v_new[b, t])
    ref_o, _ = attention_ref(q.reshape(4, 4, 16), None, None, [2, 2], [12, 33], causal=True,
                             k_rows=rows)
    np.testing.assert_allclose(o.reshape(4, 4, 16), ref_o, atol=2e-5, rtol=2e-5)


def test_errors_name_arguments(rng):
    cache = PagedCache(rng, [10], 8, 2, 16, np.float32)
    q = rng.standard_normal((1, 1, 4, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="cache_seqlens"):
        tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache,
                                       cache_seqlens=np.array([10], np.int64),
                                       block_table=cache.block_table)
    with pytest.raises(ValueError, match="cache_seqlens"):
        tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache,
                                       cache_seqlens=np.array([1000], np.int32),
                                       block_table=cache.block_table)
    with pytest.raises(ValueError, match="kv_layout"):
        tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=10,
                                       block_table=cache.block_table, kv_layout="NDH")
    with pytest.raises(ValueError, match="kv_page_indptr"):
        tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache,
                                       kv_page_indptr=cache.page_indptr)
    with pytest.raises(ValueError, match="cache_seqlens"):
        tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache, q[:, :, :2], q[:, :, :2],
                                       block_table=cache.block_table)
    with pytest.raises(ValueError, match="'k'"):
        tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache, k=q[:, :, :2],
                                       cache_seqlens=10, block_table=cache.block_table)
    with pytest.raises(ValueError, match="'q'"):
        tessera.attention_with_kvcache(q[0, 0], cache.k_cache, cache.v_cache, cache_seqlens=10,
                                       block_table=cache.block_table)
    with pytest.raises(ValueError, match="'k_cache'"):
        tessera.attention_with_kvcache(q, cache.k_cache[..., :8], cache.v_cache[..., :8],
                                       cache_seqlens=10, block_table=cache.block_table)


def test_paged_attention_one_shot(rng):
    q_lens, kv_lens = [4, 1, 9], [10, 7, 9]
    cache = PagedCache(rng, kv_lens, 4, 2, 32, np.float32, "HND")
    q = rng.standard_normal((sum(q_lens), 4, 32)).astype(np.float32)
    o, lse = tessera.paged_attention(q, cache.k_cache, cache.v_cache, cache.page_indptr,
                                     cache.page_indices, cache.last_page_len, indptr(q_lens),
                                     kv_layout="HND", causal=True, return_lse=True)
    ref_o, ref_lse = attention_ref(q, None, None, q_lens, kv_lens, causal=True,
                                   k_rows=cache.rows())
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)
    # decode form: no qo_indptr, one query per request
    q1 = rng.standard_normal((3, 4, 32)).astype(np.float32)
    o1 = tessera.paged_attention(q1, cache.k_cache, cache.v_cache, cache.page_indptr,
                                 cache.page_indices, cache.last_page_len, kv_layout="HND")
    ref_o1, _ = attention_ref(q1, None, None, [1, 1, 1], kv_lens, k_rows=cache.rows())
    np.testing.assert_allclose(o1, ref_o1, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="kv_page_indices"):
        tessera.paged_attention(q1, cache.k_cache, cache.v_cache, cache.page_indptr,
                                cache.page_indices.astype(np.int64), cache.last_page_len,
                                kv_layout="HND")
