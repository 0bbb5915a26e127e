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


@pytest.mark.parametrize("graph_mode", [False, True], ids=["eager", "cuda-graph-buffers"])
def test_failed_plan_leaves_the_previous_plan_whole(rng, workspace, graph_mode):
    """A plan() that fails after the C plan was made (a bad index array, or one too large for
    its CUDA-graph buffer) changes nothing: the previous plan runs with its own page table.
    Before, the new plan was installed with the previous plan's (or half-overwritten) arrays."""
    buffers = {}
    if graph_mode:
        buffers = dict(use_cuda_graph=True, paged_kv_indptr_buffer=np.zeros(4, np.int32),
                       paged_kv_indices_buffer=np.zeros(8, np.int32),
                       paged_kv_last_page_len_buffer=np.zeros(3, np.int32))
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace, **buffers)
    cache = PagedCache(rng, [8, 7], 4, 1, 16, np.float32)  # 2 + 2 pages
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4)
    q = rng.standard_normal((2, 2, 16)).astype(np.float32)
    expected = wrapper.run(q, (cache.k_cache, cache.v_cache))
    ref_o, _ = attention_ref(q, None, None, [1, 1], [8, 7], k_rows=cache.rows())
    np.testing.assert_allclose(expected, ref_o, atol=2e-5, rtol=2e-5)
    # Other lengths (the same page counts), pages given as floats: refused while converting
    # page_indices, after the C plan was made.
    other = PagedCache(rng, [8, 8], 4, 1, 16, np.float32)
    with pytest.raises(ValueError, match="paged_kv_indices"):
        wrapper.plan(other.page_indptr, other.page_indices.astype(np.float32),
                     other.last_page_len, 2, 1, 16, 4)
    np.testing.assert_array_equal(wrapper.run(q, (cache.k_cache, cache.v_cache)), expected)
    if graph_mode:
        # Three requests of 3 pages each: page_indptr (4 entries) fits, page_indices (9) does
        # not; nothing is written into the buffers.
        bigger = PagedCache(rng, [12, 12, 12], 4, 1, 16, np.float32)
        before = [buffers[name].copy() for name in sorted(buffers) if name.endswith("buffer")]
        with pytest.raises(ValueError, match="paged_kv_indices"):
            wrapper.plan(bigger.page_indptr, bigger.page_indices, bigger.last_page_len, 2, 1, 16,
                         4)
        after = [buffers[name] for name in sorted(buffers) if name.endswith("buffer")]
        for old, new in zip(before, after):
            np.testing.assert_array_equal(old, new)
        np.testing.assert_array_equal(wrapper.run(q, (cache.k_cache, cache.v_cache)), expected)


def test_cuda_graph_buffers_must_be_contiguous_int32(workspace):
    """The run reads a CUDA-graph index buffer as contiguous int32 values: a strided or int64
    buffer is refused by the constructor (a strided one used to give wrong page ids)."""
    for bad in (np.zeros(16, np.int32)[::2], np.zeros(8, np.int64), np.zeros((2, 4), np.int32)):
        with pytest.raises(ValueError, match="paged_kv_indices"):
            tessera.BatchDecodeWithPagedKVCacheWrapper(
                workspace, use_cuda_graph=True, paged_kv_indices_buffer=bad)


def test_preallocated_outputs(rng, workspace):
    cache = PagedCache(rng, [10], 4, 1, 16, np.float32)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    out, lse = np.empty_like(q), np.empty((1, 2), np.float32)
    o, l = wrapper.run(q, (cache.k_cache, cache.v_cache), out=out, lse=lse, return_lse=True)
    assert o is out and l is lse


# ---- descriptor cache (run() reuses the descriptors of buffers it has seen) ----------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_consecutive_runs_with_different_buffers(rng, workspace, layout):
    """Two "layers" with their own q / cache / out buffers of the same shapes, alternated: each
    run must read its own inputs and write its own output (descriptor cache keyed correctly)."""
    kv_lens = [12, 5]
    caches = [PagedCache(np.random.default_rng(seed), kv_lens, 4, 1, 16, np.float32, layout)
              for seed in (1, 2)]
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace, layout)
    c0 = caches[0]
    wrapper.plan(c0.page_indptr, c0.page_indices, c0.last_page_len, 2, 1, 16, 4)
    qs = [rng.standard_normal((2, 2, 16)).astype(np.float32) for _ in caches]
    outs = [np.full((2, 2, 16), np.nan, np.float32) for _ in caches]
    refs = []
    for q, cache in zip(qs, caches):
        # Both caches hold their pages at the same indices (same page table, other contents).
        cache.page_indices, cache.page_indptr = c0.page_indices, c0.page_indptr
        refs.append(attention_ref(q, None, None, [1, 1], kv_lens, k_rows=cache.rows())[0])
    for _ in range(3):
        for i in (0, 1):
            result = wrapper.run(qs[i], (caches[i].k_cache, caches[i].v_cache), out=outs[i])
            assert result is outs[i]
            np.testing.assert_allclose(outs[i], refs[i], atol=2e-5, rtol=2e-5)
            fresh = wrapper.run(qs[i], (caches[i].k_cache, caches[i].v_cache))
            assert fresh is not outs[i]
            np.testing.assert_allclose(fresh, refs[i], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(outs[0], refs[0], atol=2e-5, rtol=2e-5)  # not overwritten
    # The combined [num_pages, 2, ...] form of the same caches.
    for i in (0, 1):
        both = np.stack([caches[i].k_cache, caches[i].v_cache], axis=1)
        np.testing.assert_allclose(wrapper.run(qs[i], both), refs[i], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_ragged_consecutive_runs_with_different_buffers(rng, workspace, layout):
    lens = [3, 9]
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace, layout)
    wrapper.plan(indptr(lens), indptr(lens), 4, 2, 16, causal=True)
    data = []
    for _ in range(2):
        q = rng.standard_normal((12, 4, 16)).astype(np.float32)
        k = rng.standard_normal((12, 2, 16)).astype(np.float32)
        v = rng.standard_normal((12, 2, 16)).astype(np.float32)
        ref_o, ref_lse = attention_ref(q, k, v, lens, lens, causal=True)
        if layout == "HND":
            k, v = np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(
                v.transpose(1, 0, 2))
        data.append((q, k, v, np.empty_like(q), np.empty((12, 4), np.float32), ref_o, ref_lse))
    for _ in range(2):
        for q, k, v, out, lse, ref_o, ref_lse in data:
            o, l = wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
            assert o is out and l is lse
            np.testing.assert_allclose(out, ref_o, atol=2e-5, rtol=2e-5)
            np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)
            np.testing.assert_allclose(wrapper.run(q, k, v), ref_o, atol=2e-5, rtol=2e-5)
    for q, k, v, out, lse, ref_o, ref_lse in data:  # each output kept its own result
        np.testing.assert_allclose(out, ref_o, atol=2e-5, rtol=2e-5)


def test_same_address_other_shape_is_not_stale(rng, workspace):
    """Buffers re-created at the same address with another shape or strides (a re-planned batch
    in the same arena, a reallocated buffer) get their own descriptors."""
    arena_q = np.zeros(4096, np.float32)
    arena_o = np.zeros(4096, np.float32)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    cache = PagedCache(rng, [10, 7, 3], 4, 1, 16, np.float32)
    k_rows = cache.rows()
    for batch in (1, 3, 2, 3, 1):
        sub = PagedCache(rng, [10, 7, 3][:batch], 4, 1, 16, np.float32)
        wrapper.plan(cache.page_indptr[:batch + 1], cache.page_indices,
                     cache.last_page_len[:batch], 2, 1, 16, 4)
        del sub
        q = arena_q[:batch * 32].reshape(batch, 2, 16)  # same address, shape follows the batch
        q[...] = rng.standard_normal(q.shape)
        out = arena_o[:batch * 32].reshape(batch, 2, 16)
        assert q.__array_interface__["data"][0] == arena_q.__array_interface__["data"][0]
        ref_o, _ = attention_ref(q, None, None, [1] * batch, [10, 7, 3][:batch],
                                 k_rows=k_rows[:batch])
        assert wrapper.run(q, (cache.k_cache, cache.v_cache), out=out) is out
        np.testing.assert_allclose(out, ref_o, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(wrapper.run(q, (cache.k_cache, cache.v_cache)), ref_o,
                                   atol=2e-5, rtol=2e-5)
    # Same address and shape, other strides: q as a strided view of a wider buffer.
    wrapper.plan(cache.page_indptr[:2], cache.page_indices, cache.last_page_len[:1], 2, 1, 16, 4)
    dense = arena_q[:32].reshape(1, 2, 16)
    strided = arena_q[:64].reshape(1, 2, 32)[:, :, :16]
    arena_q[:64] = rng.standard_normal(64)
    for q in (dense, strided, dense):
        ref_o, _ = attention_ref(q, None, None, [1], [10], k_rows=k_rows[:1])
        np.testing.assert_allclose(wrapper.run(q, (cache.k_cache, cache.v_cache)), ref_o,
                                   atol=2e-5, rtol=2e-5)
    # Same object reshaped in place (numpy allows assigning .shape): not served the old shape.
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4)
    q = rng.standard_normal((3, 2, 16)).astype(np.float32)
    ref_o, _ = attention_ref(q, None, None, [1] * 3, [10, 7, 3], k_rows=k_rows)
    np.testing.assert_allclose(wrapper.run(q, (cache.k_cache, cache.v_cache)), ref_o,
                               atol=2e-5, rtol=2e-5)
    q.shape = (6, 1, 16)
    with pytest.raises(ValueError, match="'q'"):
        wrapper.run(q, (cache.k_cache, cache.v_cache))


def test_cached_out_still_checked_read_only(rng, workspace):
    cache = PagedCache(rng, [10], 4, 1, 16, np.float32)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    out = np.empty_like(q)
    wrapper.run(q, (cache.k_cache, cache.v_cache), out=out)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        wrapper.run(q, (cache.k_cache, cache.v_cache), out=out)
    out.flags.writeable = True
    wrapper.run(q, (cache.k_cache, cache.v_cache), out=out)


def test_descriptor_cache_is_bounded(rng, workspace, monkeypatch):
    from tessera import _dlpack

    monkeypatch.setattr(_dlpack, "DESCRIPTOR_CACHE_LIMIT", 8)
    _dlpack.clear_descriptor_cache()  # entries of earlier tests may match freed addresses
    cache = PagedCache(rng, [10], 4, 1, 16, np.float32)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4)
    keep = []
    for _ in range(40):
        q = rng.standard_normal((1, 2, 16)).astype(np.float32)
        keep.append(q)  # distinct live buffers: distinct addresses
        ref_o, _ = attention_ref(q, None, None, [1], [10], k_rows=cache.rows())
        np.testing.assert_allclose(wrapper.run(q, (cache.k_cache, cache.v_cache)), ref_o,
                                   atol=2e-5, rtol=2e-5)
        assert len(_dlpack._DESCRIPTOR_CACHE) <= 8
    assert _dlpack.cached_dl(keep[-1], "q") is _dlpack.cached_dl(keep[-1], "q")  # a hit


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
    with pytest.raises(ValueError, match="custom_mask"):  # 4 x 4 bits expected (test_masks.py)
        ragged.plan([0, 4], [0, 4], 2, 1, 16, custom_mask=np.ones(15, bool))
    with pytest.raises(ValueError, match="head_dim_vo"):
        ragged.plan([0, 4], [0, 4], 2, 1, 16, head_dim_vo=12)  # a multiple of 8 expected
    with pytest.raises(ValueError, match="kv_layout"):
        tessera.BatchDecodeWithPagedKVCacheWrapper(workspace, "NDH")
    # FlashInfer's CUDA-graph mask buffers are accepted (each plan keeps its own mask arrays).
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
