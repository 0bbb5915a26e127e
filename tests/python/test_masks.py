"""Custom masks (the prefill wrappers' ``plan(custom_mask= / packed_custom_mask=)``) and tree
masks (the decode wrapper's ``plan(tree_mask=)``) on the CPU against the float64 numpy reference
with the masks ANDed into each request's visible matrix; ``tessera.packbits`` /
``segment_packbits`` against ``numpy.packbits``; errors name the Python argument; a plan without
a mask after one with it is unmasked again (and back on the fast path)."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from _reference import PagedCache, attention_ref, fold_sinks_ref, indptr, tolerance


@pytest.fixture
def workspace() -> np.ndarray:
    return np.empty(16 << 20, np.uint8)


def random_masks(rng, q_lens, kv_lens, density=0.5):
    """Per request a boolean [q_len, kv_len]; every third request keeps an all-False row."""
    masks = []
    for b, (lq, lk) in enumerate(zip(q_lens, kv_lens)):
        m = rng.random((lq, lk)) < density
        if b % 3 == 0 and lq > 1:
            m[lq // 2] = False
        masks.append(m)
    return masks


def flat(masks):
    return np.concatenate([m.reshape(-1) for m in masks]) if masks else np.zeros(0, bool)


# ---- packing ----

@pytest.mark.parametrize("bitorder", ["little", "big"])
def test_packbits_matches_numpy(rng, bitorder):
    for n in [0, 1, 7, 8, 9, 63, 64, 65, 1000]:
        x = rng.random(n) < 0.5
        np.testing.assert_array_equal(tessera.packbits(x, bitorder=bitorder),
                                      np.packbits(x, bitorder=bitorder))
    x = rng.random((3, 5)) < 0.5  # flattened, as FlashInfer does
    np.testing.assert_array_equal(tessera.packbits(x, bitorder="little"),
                                  np.packbits(x.reshape(-1), bitorder="little"))
    np.testing.assert_array_equal(tessera.packbits(x), np.packbits(x.reshape(-1)))  # "big"


def test_segment_packbits_packs_each_segment(rng):
    lengths = [0, 5, 8, 17, 1, 0, 64]
    x = rng.random(sum(lengths)) < 0.5
    packed, packed_indptr = tessera.segment_packbits(x, indptr(lengths), bitorder="little")
    expected_indptr = indptr([(n + 7) // 8 for n in lengths])
    np.testing.assert_array_equal(packed_indptr, expected_indptr)
    assert packed.dtype == np.uint8 and packed_indptr.dtype == np.int32
    starts = indptr(lengths)
    for i, n in enumerate(lengths):
        np.testing.assert_array_equal(
            packed[expected_indptr[i]:expected_indptr[i + 1]],
            np.packbits(x[starts[i]:starts[i] + n], bitorder="little"))
    with pytest.raises(ValueError, match="'indptr'"):
        tessera.segment_packbits(x, [0, 5, 3])
    with pytest.raises(ValueError, match="'bitorder'"):
        tessera.packbits(x, bitorder="middle")


def test_packing_torch_tensors():
    torch = pytest.importorskip("torch")
    x = torch.rand(100) < 0.5
    out = tessera.packbits(x, bitorder="little")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.uint8
    np.testing.assert_array_equal(out.numpy(), np.packbits(x.numpy(), bitorder="little"))
    packed, ind = tessera.segment_packbits(x, torch.tensor([0, 30, 100], dtype=torch.int32),
                                           bitorder="little")
    assert isinstance(packed, torch.Tensor) and isinstance(ind, torch.Tensor)
    assert ind.tolist() == [0, 4, 13]


# ---- the wrappers against the reference ----

@pytest.mark.parametrize("causal,window", [(False, -1), (True, -1), (True, 20), (False, 9)])
def test_ragged_custom_mask(rng, dtype, workspace, causal, window):
    q_lens, kv_lens = [7, 0, 33, 5, 64], [9, 4, 33, 0, 200]
    q = rng.standard_normal((sum(q_lens), 8, 64)).astype(dtype)
    k = rng.standard_normal((sum(kv_lens), 2, 64)).astype(dtype)
    v = rng.standard_normal((sum(kv_lens), 2, 64)).astype(dtype)
    masks = random_masks(rng, q_lens, kv_lens)
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan(indptr(q_lens), indptr(kv_lens), 8, 2, 64, custom_mask=flat(masks),
                 causal=causal, window_left=window)
    o, lse = wrapper.run(q, k, v, return_lse=True)
    ref_o, ref_lse = attention_ref(q, k, v, q_lens, kv_lens, causal=causal, window=(window, -1),
                                   mask=masks)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)
    assert np.isneginf(lse[3]).all() and not o[3].any()  # request 0's all-False row
    # packed_custom_mask (FlashInfer's packed layout) gives the same answer, and so does an
    # explicit mask_indptr over a buffer with gaps between the segments.
    packed, packed_indptr = tessera.segment_packbits(flat(masks), indptr(
        [a * b for a, b in zip(q_lens, kv_lens)]), bitorder="little")
    wrapper.plan(indptr(q_lens), indptr(kv_lens), 8, 2, 64, packed_custom_mask=packed,
                 causal=causal, window_left=window)
    np.testing.assert_array_equal(wrapper.run(q, k, v), o)
    gaps = np.full(packed.size + 3 * len(q_lens) + 2, 0xAB, np.uint8)
    offsets = packed_indptr + 2 + 3 * np.arange(len(q_lens) + 1, dtype=np.int32)
    for r in range(len(q_lens)):
        gaps[offsets[r]:offsets[r] + packed_indptr[r + 1] - packed_indptr[r]] = \
            packed[packed_indptr[r]:packed_indptr[r + 1]]
    wrapper.plan(indptr(q_lens), indptr(kv_lens), 8, 2, 64, packed_custom_mask=gaps,
                 mask_indptr=offsets, causal=causal, window_left=window)
    np.testing.assert_array_equal(wrapper.run(q, k, v), o)


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_paged_custom_mask_with_sinks(rng, workspace, page_size):
    q_lens, kv_lens = [7, 1, 20, 3], [30, 1, 20, 300]
    cache = PagedCache(rng, kv_lens, page_size, 2, 32, np.float32, "NHD")
    q = rng.standard_normal((sum(q_lens), 8, 32)).astype(np.float32)
    sinks = rng.uniform(-3, 5, 8).astype(np.float32)
    masks = random_masks(rng, q_lens, kv_lens, 0.3)
    wrapper = tessera.BatchPrefillWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr(q_lens), cache.page_indptr, cache.page_indices, cache.last_page_len, 8, 2,
                 32, page_size, custom_mask=flat(masks), causal=True)
    o, lse = wrapper.run(q, (cache.k_cache, cache.v_cache), return_lse=True, sinks=sinks)
    ref_o, ref_lse = fold_sinks_ref(*attention_ref(q, None, None, q_lens, kv_lens, causal=True,
                                                   k_rows=cache.rows(), mask=masks), sinks)
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)


def tree_of(rng, batch, q):
    """Random trees in topological order: [b, i, d] True when d is i or an ancestor of i."""
    tree = np.zeros((batch, q, q), bool)
    for b in range(batch):
        parent = [-1] + [int(rng.integers(-1, i)) for i in range(1, q)]
        for i in range(q):
            a = i
            while a >= 0:
                tree[b, i, a] = True
                a = parent[a]
    return tree


def decode_mask(tree, kv_lens, q):
    """The [q, kv_len] visible matrices of a tree: the prefix, then the drafts' bits."""
    masks = []
    for b, lk in enumerate(kv_lens):
        j = np.arange(lk) - (lk - q)  # the draft index of key j (negative: the prefix)
        m = np.ones((q, lk), bool)
        drafts = j >= 0
        m[:, drafts] = tree[b][:, j[drafts]]
        masks.append(m)
    return masks


@pytest.mark.parametrize("q_per_request", [1, 4, 13, 64])
def test_decode_tree_mask(rng, workspace, q_per_request):
    kv_lens = [3000, 70, q_per_request, 200]
    cache = PagedCache(rng, kv_lens, 16, 2, 64, np.float32)
    q = rng.standard_normal((4 * q_per_request, 8, 64)).astype(np.float32)
    tree = tree_of(rng, 4, q_per_request)
    tree[1] = rng.random((q_per_request, q_per_request)) < 0.5  # drafts in no order
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 8, 2, 64, 16,
                 q_per_request=q_per_request, tree_mask=tree)
    o, lse = wrapper.run(q, (cache.k_cache, cache.v_cache), return_lse=True)
    ref_o, ref_lse = attention_ref(q, None, None, [q_per_request] * 4, kv_lens,
                                   k_rows=cache.rows(),
                                   mask=decode_mask(tree, kv_lens, q_per_request))
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)
    # The same rows packed by the caller; and a chain is plain (causal) speculative decoding.
    packed = np.packbits(tree.reshape(4, -1), axis=1, bitorder="little")
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 8, 2, 64, 16,
                 q_per_request=q_per_request, tree_mask=packed)
    np.testing.assert_array_equal(wrapper.run(q, (cache.k_cache, cache.v_cache)), o)
    chain = np.broadcast_to(np.tril(np.ones((q_per_request, q_per_request), bool)),
                            (4, q_per_request, q_per_request))
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 8, 2, 64, 16,
                 q_per_request=q_per_request, tree_mask=chain)
    chained = wrapper.run(q, (cache.k_cache, cache.v_cache))
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 8, 2, 64, 16,
                 q_per_request=q_per_request)
    np.testing.assert_allclose(chained, wrapper.run(q, (cache.k_cache, cache.v_cache)),
                               atol=1e-6, rtol=1e-6)


def test_torch_masks():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    q_lens, kv_lens = [5, 9], [12, 9]
    q = rng.standard_normal((14, 4, 32)).astype(np.float32)
    k = rng.standard_normal((21, 4, 32)).astype(np.float32)
    masks = random_masks(rng, q_lens, kv_lens)
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan(torch.tensor(indptr(q_lens)), torch.tensor(indptr(kv_lens)), 4, 4, 32,
                 custom_mask=torch.from_numpy(flat(masks)))
    o = wrapper.run(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(k))
    ref_o, _ = attention_ref(q, k, k, q_lens, kv_lens, mask=masks)
    np.testing.assert_allclose(o.numpy(), ref_o, atol=2e-5, rtol=2e-5)


# ---- plans without masks, errors ----

def test_replanning_without_a_mask_drops_it(rng, workspace):
    q_lens, kv_lens = [6, 3], [6, 11]
    q = rng.standard_normal((9, 2, 16)).astype(np.float32)
    k = rng.standard_normal((17, 2, 16)).astype(np.float32)
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan(indptr(q_lens), indptr(kv_lens), 2, 2, 16,
                 custom_mask=flat(random_masks(rng, q_lens, kv_lens, 0.2)))
    served = tessera.fastcall_info()["calls"]
    masked = wrapper.run(q, k, k)
    assert tessera.fastcall_info()["calls"] == served  # a planned mask: the ctypes path
    wrapper.plan(indptr(q_lens), indptr(kv_lens), 2, 2, 16)
    plain = wrapper.run(q, k, k)
    np.testing.assert_allclose(plain, attention_ref(q, k, k, q_lens, kv_lens)[0], atol=2e-5)
    assert not np.allclose(masked, plain)
    if tessera.fastcall_info()["loaded"] and tessera.fastcall_info()["numpy"] == "on":
        assert tessera.fastcall_info()["calls"] > served  # the fast path again


def test_mask_errors_name_the_argument(rng, workspace):
    cache = PagedCache(rng, [10, 4], 4, 1, 16, np.float32)
    ragged = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    with pytest.raises(ValueError, match="'custom_mask'"):  # 3 x 5 + 2 x 2 = 19 bits
        ragged.plan([0, 3, 5], [0, 5, 7], 2, 1, 16, custom_mask=np.ones(18, bool))
    with pytest.raises(ValueError, match="'custom_mask'"):
        ragged.plan([0, 3, 5], [0, 5, 7], 2, 1, 16, custom_mask=np.ones(19, bool),
                    packed_custom_mask=np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="'packed_custom_mask'"):
        ragged.plan([0, 3, 5], [0, 5, 7], 2, 1, 16, packed_custom_mask=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="'mask_indptr'"):
        ragged.plan([0, 3, 5], [0, 5, 7], 2, 1, 16, mask_indptr=[0, 2, 3])
    with pytest.raises(ValueError, match="'packed_custom_mask'"):  # 2 + 1 bytes needed
        ragged.plan([0, 3, 5], [0, 5, 7], 2, 1, 16, packed_custom_mask=np.zeros(2, np.uint8))
    # Offsets that give request 0 too few bytes: the library's check at run(), naming its field
    # and the Python argument.
    ragged.plan([0, 3, 5], [0, 5, 7], 2, 1, 16, packed_custom_mask=np.zeros(4, np.uint8),
                mask_indptr=[0, 1, 3])
    q = np.zeros((5, 2, 16), np.float32)
    k = np.zeros((7, 1, 16), np.float32)
    with pytest.raises(ValueError, match="'run_options.mask_indptr'.*request 0.*mask_indptr"):
        ragged.run(q, k, k)
    decode = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    with pytest.raises(ValueError, match="'tree_mask'"):
        decode.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4,
                    q_per_request=3, tree_mask=np.ones((2, 3, 2), bool))
    decode.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 2, 1, 16, 4,
                q_per_request=3, tree_mask=np.zeros((2, 1), np.uint8))  # 9 bits need 2 bytes
    with pytest.raises(ValueError, match="run_options.tree_mask.*tree_mask"):
        decode.run(np.zeros((6, 2, 16), np.float32), (cache.k_cache, cache.v_cache))
