"""FlashInfer-style plan/run wrappers on the CPU vs float64 references."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from _reference import PagedCache, attention_ref, indptr, tolerance


@pytest.fixture
def workspace() -> np.ndarray:
    return np.empty(16 << 20, np.uint8)


@pytest.fixture
def four_threads():
    """More CPU workers than tiles, so the planner splits long key ranges (split-KV + merge)."""
    tessera.set_num_threads(4)
    yield
    tessera.set_num_threads(0)


# ---- ragged prefill ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_ragged_prefill_wrapper(rng, dtype, workspace, layout):
    q_lens, kv_lens = [5, 40, 1], [9, 40, 600]
    q = rng.standard_normal((sum(q_lens), 8, 64)).astype(dtype)
    k = rng.standard_normal((sum(kv_lens), 2, 64)).astype(dtype)
    v = rng.standard_normal((sum(kv_lens), 2, 64)).astype(dtype)
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace, layout)
    wrapper.plan(indptr(q_lens), indptr(kv_lens), 8, 2, 64, causal=True, logits_soft_cap=20.0)
    k_in = k if layout == "NHD" else np.ascontiguousarray(k.transpose(1, 0, 2))
    v_in = v if layout == "NHD" else np.ascontiguousarray(v.transpose(1, 0, 2))
    o, lse = wrapper.run(q, k_in, v_in, return_lse=True)
    ref_o, ref_lse = attention_ref(q, k, v, q_lens, kv_lens, causal=True, softcap=20.0)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)
    # The plan is reused by later runs (another "layer").
    k2, v2 = k[::-1].copy(), v[::-1].copy()
    o2 = wrapper.run(q, k2 if layout == "NHD" else np.ascontiguousarray(k2.transpose(1, 0, 2)),
                     v2 if layout == "NHD" else np.ascontiguousarray(v2.transpose(1, 0, 2)))
    ref_o2, _ = attention_ref(q, k2, v2, q_lens, kv_lens, causal=True, softcap=20.0)
    np.testing.assert_allclose(o2.astype(np.float64), ref_o2, **tolerance(dtype))


def test_ragged_wrapper_window_and_scale(rng, workspace):
    lens = [30, 17]
    q = rng.standard_normal((47, 4, 32)).astype(np.float32)
    k = rng.standard_normal((47, 4, 32)).astype(np.float32)
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan(indptr(lens), indptr(lens), 4, 4, 32, causal=True, window_left=5, sm_scale=0.25)
    o = wrapper.run(q, k, k)
    ref_o, _ = attention_ref(q, k, k, lens, lens, causal=True, window=(5, -1), sm_scale=0.25)
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)


# ---- paged prefill -----------------------------------------------------------------------


@pytest.mark.parametrize("combined", [False, True], ids=["tuple", "5d"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_prefill_wrapper(rng, dtype, workspace, layout, combined):
    q_lens, kv_lens = [7, 1, 20], [30, 1, 20]
    cache = PagedCache(rng, kv_lens, 8, 2, 32, dtype, layout)
    q = rng.standard_normal((sum(q_lens), 4, 32)).astype(dtype)
    wrapper = tessera.BatchPrefillWithPagedKVCacheWrapper(workspace, layout)
    wrapper.plan(indptr(q_lens), cache.page_indptr, cache.page_indices, cache.last_page_len, 4, 2,
                 32, 8, causal=True)
    paged = (cache.k_cache, cache.v_cache)
    if combined:
        paged = np.stack([cache.k_cache, cache.v_cache], axis=1)
    o = wrapper.run(q, paged)
    ref_o, _ = attention_ref(q, None, None, q_lens, kv_lens, causal=True, k_rows=cache.rows())
    np.testing.assert_allclose(o.astype(np.float64), ref_o, **tolerance(dtype))


# ---- decode ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_wrapper(rng, dtype, workspace, layout):
    kv_lens = [1, 17, 300, 64]
    cache = PagedCache(rng, kv_lens, 16, 2, 128, dtype, layout)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace, layout)
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 8, 2, 128, 16)
    for _ in range(2):  # layers share the plan
        q = rng.standard_normal((4, 8, 128)).astype(dtype)
        o, lse = wrapper.run(q, (cache.k_cache, cache.v_cache), return_lse=True)
        ref_o, ref_lse = attention_ref(q, None, None, [1] * 4, kv_lens, k_rows=cache.rows())
        np.testing.assert_allclose(o.astype(np.float64), ref_o, **tolerance(dtype))
        np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_decode_wrapper_split_kv(rng, workspace, four_threads):
    kv_lens = [3000]
    cache = PagedCache(rng, kv_lens, 16, 1, 64, np.float32)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 4, 1, 64, 16)
    assert wrapper.workspace_bytes_needed > 0  # split-KV partials live in the workspace
    assert "split" in wrapper.explain()
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    o, lse = wrapper.run(q, (cache.k_cache, cache.v_cache), return_lse=True)
    ref_o, ref_lse = attention_ref(q, None, None, [1], kv_lens, k_rows=cache.rows())
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)


def test_decode_speculative_q_per_request(rng, workspace):
    kv_lens = [20, 9]
    cache = PagedCache(rng, kv_lens, 4, 2, 32, np.float32)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 4, 2, 32, 4,
                 q_per_request=3)
    q = rng.standard_normal((6, 4, 32)).astype(np.float32)
    o = wrapper.run(q, (cache.k_cache, cache.v_cache))
    ref_o, _ = attention_ref(q, None, None, [3, 3], kv_lens, causal=True, k_rows=cache.rows())
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)


def test_decode_wrapper_cuda_graph_mode_buffers(rng, workspace):
    """use_cuda_graph=True: index arrays live in fixed buffers (addresses never change)."""
    indptr_buf = np.zeros(8, np.int32)
    indices_buf = np.zeros(64, np.int32)
    last_buf = np.zeros(7, np.int32)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(
        workspace, use_cuda_graph=True, paged_kv_indptr_buffer=indptr_buf,
        paged_kv_indices_buffer=indices_buf, paged_kv_last_page_len_buffer=last_buf)
    for kv_lens in ([5, 9], [12, 1, 30]):
        cache = PagedCache(rng, kv_lens, 4, 1, 16, np.float32)
        wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4)
        np.testing.assert_array_equal(indptr_buf[:len(kv_lens) + 1], cache.page_indptr)
        np.testing.assert_array_equal(indices_buf[:cache.page_indices.size], cache.page_indices)
        q = rng.standard_normal((len(kv_lens), 2, 16)).astype(np.float32)
        o = wrapper.run(q, (cache.k_cache, cache.v_cache))
        ref_o, _ = attention_ref(q, None, None, [1] * len(kv_lens), kv_lens, k_rows=cache.rows())
        np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)
    big = PagedCache(rng, [300], 4, 1, 16, np.float32)
    with pytest.raises(ValueError, match="paged_kv_indices"):
        wrapper.plan(big.page_indptr, big.page_indices, big.last_page_len, 2, 1, 16, 4)


def test_decode_wrapper_cuda_graph_mode_allocates_buffers(rng, workspace):
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace, use_cuda_graph=True)
    cache = PagedCache(rng, [8, 8], 4, 1, 16, np.float32)
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4)
    q = rng.standard_normal((2, 2, 16)).astype(np.float32)
    o = wrapper.run(q, (cache.k_cache, cache.v_cache))
    ref_o, _ = attention_ref(q, None, None, [1, 1], [8, 8], k_rows=cache.rows())
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)
    bigger = PagedCache(rng, [8, 8, 8], 4, 1, 16, np.float32)
    with pytest.raises(ValueError, match="paged_kv_indptr"):  # the first plan sized the buffers
        wrapper.plan(bigger.page_indptr, bigger.page_indices, bigger.last_page_len, 2, 1, 16, 4)


def test_preallocated_outputs(rng, workspace):
    cache = PagedCache(rng, [10], 4, 1, 16, np.float32)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    out, lse = np.empty_like(q), np.empty((1, 2), np.float32)
    o, l = wrapper.run(q, (cache.k_cache, cache.v_cache), out=out, lse=lse, return_lse=True)
    assert o is out and l is lse


# ---- errors ------------------------------------------------------------------------------


def test_workspace_too_small_names_the_buffer(rng, four_threads):
    cache = PagedCache(rng, [3000], 16, 1, 64, np.float32)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(np.empty(64, np.uint8))
    with pytest.raises(ValueError, match="float_workspace_buffer.*bytes"):
        wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 4, 1, 64, 16)


def test_run_before_plan(rng, workspace):
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    with pytest.raises(ValueError, match="plan"):
        wrapper.run(np.zeros((1, 2, 16), np.float32), (np.zeros((1, 4, 1, 16), np.float32),) * 2)


def test_unsupported_flashinfer_options(rng, workspace):
    cache = PagedCache(rng, [10], 4, 1, 16, np.float32)
    decode = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        decode.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4,
                    pos_encoding_mode="ROPE_LLAMA")
    decode.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4)
    q = np.zeros((1, 2, 16), np.float32)
    with pytest.raises(ValueError, match="k_scale"):
        decode.run(q, (cache.k_cache, cache.v_cache), k_scale=0.5)
    with pytest.raises(ValueError, match="window_left"):
        decode.run(q, (cache.k_cache, cache.v_cache), window_left=3)
    with pytest.raises(ValueError, match="q_rope_offset"):
        decode.run(q, (cache.k_cache, cache.v_cache), q_rope_offset=np.zeros(1, np.int32))
    ragged = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    with pytest.raises(ValueError, match="custom_mask"):
        ragged.plan([0, 4], [0, 4], 2, 1, 16, custom_mask=np.ones(16, bool))
    with pytest.raises(ValueError, match="head_dim_vo"):
        ragged.plan([0, 4], [0, 4], 2, 1, 16, head_dim_vo=32)
    with pytest.raises(ValueError, match="kv_layout"):
        tessera.BatchDecodeWithPagedKVCacheWrapper(workspace, "NDH")
    with pytest.raises(ValueError, match="custom_mask"):
        tessera.BatchPrefillWithPagedKVCacheWrapper(workspace, custom_mask_buf=np.ones(4, bool))


def test_plan_errors_name_flashinfer_arguments(rng, workspace):
    decode = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    with pytest.raises(ValueError, match="last_page_len"):
        decode.plan([0, 2], [0, 1], [9], 2, 1, 16, 4)  # 9 > page_size
    with pytest.raises(ValueError, match="head_dim"):
        decode.plan([0, 1], [0], [3], 2, 1, 12, 4)
    with pytest.raises(ValueError, match="num_qo_heads"):
        decode.plan([0, 1], [0], [3], 3, 2, 16, 4)
    with pytest.raises(ValueError, match="page_size"):
        decode.plan([0, 1], [0], [3], 2, 1, 16, "4")
    ragged = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    with pytest.raises(ValueError, match="kv_indptr"):
        ragged.plan([0, 4], [0, 4, 8], 2, 1, 16)
    with pytest.raises(ValueError, match="qo_indptr"):
        ragged.plan([1, 4], [0, 4], 2, 1, 16)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        ragged.plan([0, 4], [0, 4], 2, 1, 16, logits_soft_cap=-2.0)


def test_run_errors(rng, workspace):
    cache = PagedCache(rng, [10], 4, 1, 16, np.float32)
    decode = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    decode.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4)
    with pytest.raises(ValueError, match="'q'"):
        decode.run(np.zeros((2, 2, 16), np.float32), (cache.k_cache, cache.v_cache))
    with pytest.raises(ValueError, match="'q'"):
        decode.run(np.zeros((1, 2, 16), np.float64), (cache.k_cache, cache.v_cache))
    with pytest.raises(ValueError, match="k_cache"):
        decode.run(np.zeros((1, 2, 16), np.float32), (cache.k_cache[:, :2], cache.v_cache[:, :2]))
    with pytest.raises(ValueError, match="paged_kv_cache"):
        decode.run(np.zeros((1, 2, 16), np.float32), cache.k_cache)
