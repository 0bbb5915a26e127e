"""Attention sinks (``sinks=``, float32 [num_qo_heads]) through varlen_attention,
paged_attention, attention_with_kvcache, the three FlashInfer-style wrappers' run() and the torch
custom ops (CPU tensors; skipped without torch) on the CPU, against the float64 reference with
the sinks folded in as include/tessera/attention.hpp defines them; bad sinks raise naming
'sinks', and checked mode rejects a NaN / +inf sink (-inf is no sink)."""

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



@pytest.mark.parametrize("q_per_request", [None, 1, 3], ids=["prefill", "decode", "decode3"])
def test_paged_attention_sinks(rng, dtype, q_per_request):
    kv_lens = [30, 0, 200]  # request 1 has no key: o = 0, lse = the sink
    q_lens = [7, 2, 20] if q_per_request is None else [q_per_request] * 3
    cache = PagedCache(rng, kv_lens, 16, 2, 32, dtype, "HND")
    q = rng.standard_normal((sum(q_lens), 8, 32)).astype(dtype)
    sinks = sinks_for(rng, 8)
    qo_indptr = indptr(q_lens) if q_per_request is None else None  # None: decode
    o, lse = tessera.paged_attention(q, cache.k_cache, cache.v_cache, cache.page_indptr,
                                     cache.page_indices, cache.last_page_len, qo_indptr,
                                     kv_layout="HND", causal=True, return_lse=True, sinks=sinks)
    ref_o, ref_lse = fold_sinks_ref(*attention_ref(q, None, None, q_lens, kv_lens, causal=True,
                                                   k_rows=cache.rows()), sinks)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)
    rows = slice(q_lens[0], q_lens[0] + q_lens[1])
    np.testing.assert_allclose(lse[rows], np.broadcast_to(sinks, (q_lens[1], 8)), rtol=1e-6)
    assert not o[rows].any()


def _kvcache_ref(q4, cache: PagedCache, sinks, causal):
    batch, seqlen_q, heads, dim = q4.shape
    q = q4.reshape(batch * seqlen_q, heads, dim)
    ref_o, ref_lse = fold_sinks_ref(*attention_ref(q, None, None, [seqlen_q] * batch,
                                                   cache.kv_lens, causal=causal,
                                                   k_rows=cache.rows()), sinks)
    return ref_o.reshape(q4.shape), ref_lse.reshape(q4.shape[:3])


# seqlen_q 1 and 3 run the decode call, 70 the paged prefill one.
@pytest.mark.parametrize("seqlen_q", [1, 3, 70], ids=["decode", "speculative", "prefill"])
def test_attention_with_kvcache_sinks(rng, dtype, seqlen_q):
    cache = PagedCache(rng, [75, 16, 130], 16, 2, 64, dtype)
    q = rng.standard_normal((3, seqlen_q, 8, 64)).astype(dtype)
    sinks = sinks_for(rng, 8)
    o, lse = tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache,
                                            cache_seqlens=cache.seq_lens,
                                            block_table=cache.block_table, causal=True,
                                            return_lse=True, sinks=sinks)
    ref_o, ref_lse = _kvcache_ref(q, cache, sinks, True)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_attention_with_kvcache_sinks_csr_and_append(rng):
    # The CSR page table (a request without keys: o = 0, lse = the sink), then the append of
    # new k/v into a block-table cache before the attention.
    cache = PagedCache(rng, [33, 0, 9], 4, 2, 16, np.float32)
    q = rng.standard_normal((3, 2, 4, 16)).astype(np.float32)
    sinks = sinks_for(rng, 4)
    o, lse = tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache, causal=True,
                                            kv_page_indptr=cache.page_indptr,
                                            kv_page_indices=cache.page_indices,
                                            kv_last_page_len=cache.last_page_len,
                                            return_lse=True, sinks=sinks)
    ref_o, ref_lse = _kvcache_ref(q, cache, sinks, True)
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)
    np.testing.assert_allclose(lse[1], np.broadcast_to(sinks, (2, 4)), rtol=1e-6)
    assert not o[1].any()

    before = [40, 12]
    full = PagedCache(rng, [n + 2 for n in before], 8, 2, 16, np.float32)
    k_new = np.stack([full.token_rows(full.k_cache, b)[before[b]:] for b in range(2)]).copy()
    v_new = np.stack([full.token_rows(full.v_cache, b)[before[b]:] for b in range(2)]).copy()
    q = rng.standard_normal((2, 2, 4, 16)).astype(np.float32)
    o = tessera.attention_with_kvcache(q, full.k_cache, full.v_cache, k_new, v_new,
                                       cache_seqlens=np.array(before, np.int32),
                                       block_table=full.block_table, causal=True, sinks=sinks)
    np.testing.assert_allclose(o, _kvcache_ref(q, full, sinks, True)[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bad", ["float16", "shape", "2d"])
def test_kvcache_calls_name_bad_sinks(rng, bad):
    cache = PagedCache(rng, [20, 5], 8, 2, 32, np.float32)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    sinks = {"float16": np.zeros(4, np.float16), "shape": np.zeros(3, np.float32),
             "2d": np.zeros((1, 4), np.float32)}[bad]
    with pytest.raises(ValueError, match="'sinks'"):
        tessera.paged_attention(q, cache.k_cache, cache.v_cache, cache.page_indptr,
                                cache.page_indices, cache.last_page_len, sinks=sinks)
    with pytest.raises(ValueError, match="'sinks'"):
        tessera.paged_attention(q, cache.k_cache, cache.v_cache, cache.page_indptr,
                                cache.page_indices, cache.last_page_len, indptr([1, 1]),
                                sinks=sinks)
    with pytest.raises(ValueError, match="'sinks'"):
        tessera.attention_with_kvcache(q[:, None], cache.k_cache, cache.v_cache,
                                       cache_seqlens=cache.seq_lens,
                                       block_table=cache.block_table, sinks=sinks)


@pytest.mark.parametrize("call", ["varlen", "paged", "kvcache"])
def test_checked_mode_rejects_nan_and_plus_inf_sinks(rng, call):
    cache = PagedCache(rng, [20, 5], 8, 2, 32, np.float32)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    k = np.concatenate([cache.token_rows(cache.k_cache, b) for b in range(2)])
    v = np.concatenate([cache.token_rows(cache.v_cache, b) for b in range(2)])

    def run(sinks):
        if call == "varlen":
            return tessera.varlen_attention(q, k, v, indptr([1, 1]), indptr([20, 5]), sinks=sinks)
        if call == "paged":
            return tessera.paged_attention(q, cache.k_cache, cache.v_cache, cache.page_indptr,
                                           cache.page_indices, cache.last_page_len, sinks=sinks)
        return tessera.attention_with_kvcache(q, cache.k_cache, cache.v_cache,
                                              cache_seqlens=cache.seq_lens,
                                              block_table=cache.block_table, sinks=sinks)

    sinks = sinks_for(rng, 4)
    tessera.set_index_checking(True)
    try:
        for value, text in ((np.nan, "nan"), (np.inf, "inf")):
            bad = sinks.copy()
            bad[2] = value
            with pytest.raises(ValueError,
                               match=rf"'sinks': non-finite value {text} at index 2 "):
                run(bad)
        none = sinks.copy()
        none[2] = -np.inf  # no sink: valid
        o = run(none)
    finally:
        tessera.set_index_checking(False)
    assert np.isfinite(o).all()
    run_nan = sinks.copy()
    run_nan[2] = np.nan  # unchecked: head 2 is NaN, as the definition says
    o = run(run_nan)
    assert np.isnan(o[:, 2]).all() and np.isfinite(o[:, [0, 1, 3]]).all()


# ---- the torch custom ops (CPU tensors) ----


def _torch_ops():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not hasattr(torch.library, "custom_op"):
        pytest.skip("tessera.torch_ops needs PyTorch >= 2.4")
    import tessera.torch_ops as tops
    return torch, tops


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_torch_paged_attention_sinks(rng, decode):
    torch, tops = _torch_ops()
    kv_lens = [30, 0, 70]
    q_lens = [1, 1, 1] if decode else [5, 2, 9]
    cache = PagedCache(rng, kv_lens, 16, 2, 32, np.float32)
    q = rng.standard_normal((sum(q_lens), 8, 32)).astype(np.float32)
    sinks = sinks_for(rng, 8)
    t = torch.from_numpy
    o, lse = tops.paged_attention(
        t(q), t(cache.k_cache), t(cache.v_cache), t(cache.page_indptr), t(cache.page_indices),
        t(cache.last_page_len), None if decode else t(indptr(q_lens)), causal=True,
        return_lse=True, sinks=t(sinks))
    ref_o, ref_lse = fold_sinks_ref(*attention_ref(q, None, None, q_lens, kv_lens, causal=True,
                                                   k_rows=cache.rows()), sinks)
    np.testing.assert_allclose(o.numpy(), ref_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse.numpy(), ref_lse, atol=1e-4)
    with pytest.raises(ValueError, match="'sinks'"):
        tops.paged_attention(t(q), t(cache.k_cache), t(cache.v_cache), t(cache.page_indptr),
                             t(cache.page_indices), t(cache.last_page_len),
                             sinks=t(sinks).double())


@pytest.mark.parametrize("seqlen_q", [1, 70], ids=["decode", "prefill"])
def test_torch_attention_with_kvcache_sinks(rng, seqlen_q):
    torch, tops = _torch_ops()
    cache = PagedCache(rng, [75, 16, 130], 16, 2, 64, np.float32)
    q = rng.standard_normal((3, seqlen_q, 8, 64)).astype(np.float32)
    sinks = sinks_for(rng, 8)
    t = torch.from_numpy
    o, lse = tops.attention_with_kvcache(t(q), t(cache.k_cache), t(cache.v_cache),
                                         t(cache.seq_lens), t(cache.block_table), causal=True,
                                         return_lse=True, sinks=t(sinks))
    ref_o, ref_lse = _kvcache_ref(q, cache, sinks, True)
    np.testing.assert_allclose(o.numpy(), ref_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse.numpy(), ref_lse, atol=1e-4)
    with pytest.raises(ValueError, match="'sinks'"):
        tops.attention_with_kvcache(t(q), t(cache.k_cache), t(cache.v_cache), t(cache.seq_lens),
                                    t(cache.block_table), sinks=t(sinks[:7].copy()))


def test_torch_kvcache_ops_fake_with_sinks():
    """The fake (meta) impls take sinks: shapes without running (FakeTensorMode)."""
    torch, tops = _torch_ops()
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(3, 8, 64)
        cache = torch.empty(10, 16, 2, 64)
        table = torch.zeros(3, 4, dtype=torch.int32)
        lens = torch.zeros(3, dtype=torch.int32)
        sinks = torch.empty(8)
        o, lse = tops.attention_with_kvcache(q, cache, cache, lens, table, return_lse=True,
                                             sinks=sinks)
        assert o.shape == q.shape and lse.shape == (3, 8)
        o, lse = tops.paged_attention(q, cache, cache, torch.zeros(4, dtype=torch.int32),
                                      torch.zeros(3, dtype=torch.int32), lens,
                                      return_lse=True, sinks=sinks)
        assert o.shape == q.shape and lse.shape == (3, 8)
