"""head_dim_qk != head_dim_vo through the FlashInfer-style prefill wrappers (``head_dim_vo`` at
plan(), as FlashInfer takes it) and the one-shot calls (which take the width from v), on the CPU
against the float64 reference; bad widths are named."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from _reference import PagedCache, attention_ref, indptr, tolerance


@pytest.fixture
def workspace() -> np.ndarray:
    return np.empty(16 << 20, np.uint8)


@pytest.mark.parametrize("dims", [(192, 128), (64, 512), (128, 64)])
def test_ragged_wrapper(rng, dtype, workspace, dims):
    qk, vo = dims
    q_lens, kv_lens = [5, 33, 1], [9, 40, 300]
    q = rng.standard_normal((sum(q_lens), 8, qk)).astype(dtype)
    k = rng.standard_normal((sum(kv_lens), 2, qk)).astype(dtype)
    v = rng.standard_normal((sum(kv_lens), 2, vo)).astype(dtype)
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan(indptr(q_lens), indptr(kv_lens), 8, 2, qk, head_dim_vo=vo, causal=True)
    o, lse = wrapper.run(q, k, v, return_lse=True)
    assert o.shape == (sum(q_lens), 8, vo)
    ref_o, ref_lse = attention_ref(q, k, v, q_lens, kv_lens, causal=True)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)
    # A caller's out of the v width is filled in place.
    out = np.full_like(o, np.nan)
    wrapper.run(q, k, v, out=out)
    np.testing.assert_array_equal(out, o)


def test_paged_wrapper(rng, workspace):
    qk, vo, page = 192, 128, 16
    q_lens, kv_lens = [3, 17], [50, 17]
    q = rng.standard_normal((sum(q_lens), 4, qk)).astype(np.float32)
    k_cache = PagedCache(rng, kv_lens, page, 1, qk, np.float32)
    v_cache = PagedCache(rng, kv_lens, page, 1, vo, np.float32)
    v_cache.page_indices = k_cache.page_indices  # one page table for both
    v_cache.page_indptr = k_cache.page_indptr
    v_cache.num_pages = k_cache.num_pages
    v_cache.v_cache = rng.standard_normal((k_cache.num_pages, page, 1, vo)).astype(np.float32)
    wrapper = tessera.BatchPrefillWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr(q_lens), k_cache.page_indptr, k_cache.page_indices,
                 k_cache.last_page_len, 4, 1, qk, page, head_dim_vo=vo, causal=True)
    o = wrapper.run(q, (k_cache.k_cache, v_cache.v_cache))
    rows = [(k_cache.token_rows(k_cache.k_cache, b), v_cache.token_rows(v_cache.v_cache, b))
            for b in range(len(kv_lens))]
    ref_o, _ = attention_ref(q, None, None, q_lens, kv_lens, causal=True, k_rows=rows)
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5)


def test_one_shot_takes_the_width_from_v(rng):
    q_lens, kv_lens = [4, 7], [10, 7]
    q = rng.standard_normal((sum(q_lens), 4, 64)).astype(np.float32)
    k = rng.standard_normal((sum(kv_lens), 2, 64)).astype(np.float32)
    v = rng.standard_normal((sum(kv_lens), 2, 32)).astype(np.float32)
    o = tessera.varlen_attention(q, k, v, indptr(q_lens), indptr(kv_lens))
    assert o.shape == (sum(q_lens), 4, 32)
    ref_o, _ = attention_ref(q, k, v, q_lens, kv_lens)
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5)


def test_bad_widths_are_named(workspace):
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    for bad in (12, 520, 4):
        with pytest.raises(ValueError, match="head_dim_vo"):
            wrapper.plan([0, 4], [0, 4], 2, 1, 16, head_dim_vo=bad)
    with pytest.raises(ValueError, match="head_dim_vo"):
        wrapper.plan([0, 4], [0, 4], 2, 1, 16, head_dim_vo=16.0)
    wrapper.plan([0, 4], [0, 4], 2, 1, 16, head_dim_vo=8)
    q = np.zeros((4, 2, 16), np.float32)
    k = np.zeros((4, 1, 16), np.float32)
    with pytest.raises(ValueError, match="'v'"):  # v of the qk width for a plan of vo 8
        wrapper.run(q, k, k)
