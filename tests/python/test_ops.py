"""RoPE, paged-KV append, merge_state(s) and block_table_to_csr on the CPU vs direct formulas."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from _reference import PagedCache, attention_ref, indptr, merge_ref, rope_ref


def _tol(dtype):
    return {"atol": 4e-3, "rtol": 4e-3} if dtype == np.float16 else {"atol": 1e-5, "rtol": 1e-5}


# ---- RoPE --------------------------------------------------------------------------------


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [None, 32])
def test_rope_pos_ids_inplace(rng, dtype, interleave, rotary_dim):
    q = rng.standard_normal((9, 4, 64)).astype(dtype)
    k = rng.standard_normal((9, 2, 64)).astype(dtype)
    positions = rng.integers(0, 5000, 9).astype(np.int32)
    expected_q = rope_ref(q, positions, rotary_dim, interleave, 1e4, 2.0)
    expected_k = rope_ref(k, positions, rotary_dim, interleave, 1e4, 2.0)
    tessera.apply_rope_pos_ids_inplace(q, k, positions, rotary_dim=rotary_dim,
                                       interleave=interleave, rope_scale=2.0)
    np.testing.assert_allclose(q.astype(np.float64), expected_q, **_tol(dtype))
    np.testing.assert_allclose(k.astype(np.float64), expected_k, **_tol(dtype))


def test_rope_indptr_offsets_form(rng):
    lens, offsets = [3, 0, 5], np.array([10, 4, 100], np.int32)
    q = rng.standard_normal((8, 2, 32)).astype(np.float32)
    k = rng.standard_normal((8, 1, 32)).astype(np.float32)
    positions = np.array([10, 11, 12, 100, 101, 102, 103, 104])
    expected_q, expected_k = rope_ref(q, positions, theta=5e5), rope_ref(k, positions, theta=5e5)
    tessera.apply_rope_inplace(q, k, indptr(lens), offsets, rope_theta=5e5)
    np.testing.assert_allclose(q, expected_q, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(k, expected_k, atol=1e-5, rtol=1e-5)


def test_llama31_rope(rng):
    q = rng.standard_normal((6, 2, 128)).astype(np.float32)
    k = rng.standard_normal((6, 1, 128)).astype(np.float32)
    positions = np.array([0, 1, 900, 8191, 20000, 70000], np.int32)
    settings = (8.0, 1.0, 4.0, 8192)
    expected_q = rope_ref(q, positions, theta=5e5, llama31=settings)
    expected_k = rope_ref(k, positions, theta=5e5, llama31=settings)
    # out-of-place variant leaves the inputs alone
    q_rope, k_rope = tessera.apply_llama31_rope_pos_ids(q, k, positions)
    np.testing.assert_allclose(q_rope, expected_q, atol=3e-5, rtol=1e-5)
    np.testing.assert_allclose(k_rope, expected_k, atol=3e-5, rtol=1e-5)
    assert not np.allclose(q, q_rope)
    tessera.apply_llama31_rope_inplace(q, k, indptr([6]), np.zeros(1, np.int32))
    identity = rope_ref(q_rope[:1], positions[:1])
    np.testing.assert_allclose(q[:1], identity, atol=1e-6)  # position 0 = no rotation
    positions_form = rope_ref(q, np.zeros(6, np.int32))
    np.testing.assert_allclose(positions_form, q, atol=1e-6)


def test_rope_out_of_place_and_single_tensor(rng):
    q = rng.standard_normal((4, 2, 16)).astype(np.float32)
    original = q.copy()
    positions = np.array([1, 2, 3, 4], np.int32)
    q_rope, k_rope = tessera.apply_rope_pos_ids(q, None, positions)
    assert k_rope is None
    np.testing.assert_array_equal(q, original)
    np.testing.assert_allclose(q_rope, rope_ref(q, positions), atol=1e-5)
    q_rope2, _ = tessera.apply_rope(q, None, indptr([4]), np.array([1], np.int32))
    np.testing.assert_allclose(q_rope2, q_rope, atol=1e-6)
    k = q.copy()
    tessera.apply_rope_pos_ids_inplace(None, k, positions)  # k only
    np.testing.assert_allclose(k, q_rope, atol=1e-6)


def test_rope_errors(rng):
    q = rng.standard_normal((4, 2, 16)).astype(np.float32)
    positions = np.arange(4, dtype=np.int32)
    with pytest.raises(ValueError, match="rotary_dim"):
        tessera.apply_rope_pos_ids_inplace(q, None, positions, rotary_dim=5)
    with pytest.raises(ValueError, match="rope_theta"):
        tessera.apply_rope_pos_ids_inplace(q, None, positions, rope_theta=-1.0)
    with pytest.raises(ValueError, match="pos_ids"):
        tessera.apply_rope_pos_ids_inplace(q, None, positions[:3])
    with pytest.raises(ValueError, match="'q'"):
        tessera.apply_rope_pos_ids_inplace(None, None, positions)
    with pytest.raises(ValueError, match="offsets"):
        tessera.apply_rope_inplace(q, None, indptr([4]), np.zeros(2, np.int32))


# ---- paged KV append ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_paged_kv_cache(rng, dtype, layout):
    before, added = [5, 0, 16], [3, 4, 1]
    after = [b + a for b, a in zip(before, added)]
    cache = PagedCache(rng, after, 8, 2, 16, dtype, layout)
    old_k = cache.k_cache.copy()
    k_new = rng.standard_normal((sum(added), 2, 16)).astype(dtype)
    v_new = rng.standard_normal((sum(added), 2, 16)).astype(dtype)
    tessera.append_paged_kv_cache(k_new, v_new, indptr(added), (cache.k_cache, cache.v_cache),
                                  cache.page_indices, cache.page_indptr, cache.last_page_len,
                                  layout)
    rows = cache.rows()
    start = 0
    for b in range(3):
        np.testing.assert_array_equal(rows[b][0][before[b]:], k_new[start:start + added[b]])
        np.testing.assert_array_equal(rows[b][1][before[b]:], v_new[start:start + added[b]])
        start += added[b]
    # rows before the appended positions are untouched
    old = PagedCache.__new__(PagedCache)
    old.__dict__.update(cache.__dict__)
    old.k_cache = old_k
    for b in range(3):
        np.testing.assert_array_equal(cache.rows()[b][0][:before[b]],
                                      old.rows()[b][0][:before[b]])


def test_append_with_fused_rope_and_combined_cache(rng):
    before, added = [6, 2], [2, 3]
    after = [b + a for b, a in zip(before, added)]
    cache = PagedCache(rng, after, 4, 1, 32, np.float32)
    combined = np.stack([cache.k_cache, cache.v_cache], axis=1)  # [pages, 2, page, H, D]
    k_new = rng.standard_normal((5, 1, 32)).astype(np.float32)
    v_new = rng.standard_normal((5, 1, 32)).astype(np.float32)
    rope = tessera.RopeOptions(interleave=True, rope_theta=1e6)
    tessera.append_paged_kv_cache(k_new, v_new, indptr(added), combined, cache.page_indices,
                                  cache.page_indptr, cache.last_page_len, rope=rope)
    cache.k_cache, cache.v_cache = combined[:, 0], combined[:, 1]
    positions = np.array([6, 7, 2, 3, 4])
    expected_k = rope_ref(k_new, positions, interleave=True, theta=1e6)
    rows = cache.rows()
    np.testing.assert_allclose(rows[0][0][6:], expected_k[:2], atol=1e-5)
    np.testing.assert_allclose(rows[1][0][2:], expected_k[2:], atol=1e-5)
    np.testing.assert_array_equal(rows[1][1][2:], v_new[2:])  # v is not rotated


def test_append_errors(rng):
    cache = PagedCache(rng, [4], 4, 1, 16, np.float32)
    k_new = rng.standard_normal((5, 1, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="kv_indptr"):  # 5 rows do not fit in 4 tokens
        tessera.append_paged_kv_cache(k_new, k_new, indptr([5]), (cache.k_cache, cache.v_cache),
                                      cache.page_indices, cache.page_indptr, cache.last_page_len)
    with pytest.raises(ValueError, match="append_value"):
        tessera.append_paged_kv_cache(k_new[:4], k_new[:3], indptr([4]),
                                      (cache.k_cache, cache.v_cache), cache.page_indices,
                                      cache.page_indptr, cache.last_page_len)


# ---- merge -------------------------------------------------------------------------------


def test_merge_state_is_exact_for_split_attention(rng, dtype):
    """Attention over keys A and over keys B, merged, equals attention over A + B."""
    q = rng.standard_normal((6, 4, 32)).astype(np.float32)
    k = rng.standard_normal((50, 2, 32)).astype(np.float32)
    v = rng.standard_normal((50, 2, 32)).astype(np.float32)
    o_a, s_a = tessera.varlen_attention(q, k[:20], v[:20], [0, 6], [0, 20], return_lse=True)
    o_b, s_b = tessera.varlen_attention(q, k[20:], v[20:], [0, 6], [0, 30], return_lse=True)
    o, s = tessera.merge_state(o_a.astype(dtype), s_a, o_b.astype(dtype), s_b)
    assert o.dtype == dtype and s.dtype == np.float32
    ref_o, ref_lse = attention_ref(q, k, v, [6], [50])
    np.testing.assert_allclose(o.astype(np.float64), ref_o, **_tol(dtype))
    np.testing.assert_allclose(s, ref_lse, atol=1e-5)


def test_merge_state_vs_formula_and_empty_states(rng):
    o_a = rng.standard_normal((5, 3, 16)).astype(np.float32)
    o_b = rng.standard_normal((5, 3, 16)).astype(np.float32)
    s_a = rng.standard_normal((5, 3)).astype(np.float32) * 4
    s_b = rng.standard_normal((5, 3)).astype(np.float32) * 4
    s_a[0] = -np.inf  # an empty state contributes nothing
    s_a[1] = s_b[1] = -np.inf  # both empty -> o = 0, lse = -inf
    out, out_lse = np.empty_like(o_a), np.empty((5, 3), np.float32)
    o, s = tessera.merge_state(o_a, s_a, o_b, s_b, out=out, out_lse=out_lse)
    assert o is out and s is out_lse
    ref_o, ref_s = merge_ref([(o_a, s_a), (o_b, s_b)])
    np.testing.assert_allclose(o, ref_o, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(s, ref_s, atol=1e-6)
    np.testing.assert_array_equal(o[0], o_b[0])
    np.testing.assert_array_equal(o[1], 0)
    assert np.isneginf(s[1]).all()


def test_merge_states_flashinfer_form(rng):
    v = rng.standard_normal((4, 3, 2, 16)).astype(np.float32)
    s = rng.standard_normal((4, 3, 2)).astype(np.float32)
    o, lse = tessera.merge_states(v, s)
    assert o.shape == (4, 2, 16) and lse.shape == (4, 2)
    ref_o, ref_s = merge_ref([(v[:, i], s[:, i]) for i in range(3)])
    np.testing.assert_allclose(o, ref_o, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(lse, ref_s, atol=1e-6)


def test_merge_states_variable_length(rng):
    counts = [2, 0, 1, 4]
    v = rng.standard_normal((7, 2, 16)).astype(np.float32)
    s = rng.standard_normal((7, 2)).astype(np.float32)
    o, lse = tessera.merge_states(v, s, indptr(counts))
    start = 0
    for n, count in enumerate(counts):
        if count == 0:
            np.testing.assert_array_equal(o[n], 0)
            assert np.isneginf(lse[n]).all()
        else:
            ref_o, ref_s = merge_ref([(v[i:i + 1], s[i:i + 1]) for i in range(start, start + count)])
            np.testing.assert_allclose(o[n], ref_o[0], atol=1e-6, rtol=1e-6)
            np.testing.assert_allclose(lse[n], ref_s[0], atol=1e-6)
        start += count


def test_merge_errors(rng):
    o_a = rng.standard_normal((5, 3, 16)).astype(np.float32)
    s_a = rng.standard_normal((5, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="s_b"):
        tessera.merge_state(o_a, s_a, o_a, s_a[:4])
    with pytest.raises(ValueError, match="'s'"):
        tessera.merge_states(o_a, s_a.astype(np.float16), indptr([5]))


# ---- block table -------------------------------------------------------------------------


def test_block_table_to_csr(rng):
    table = rng.integers(0, 100, (4, 5)).astype(np.int32)
    seq_lens = np.array([0, 16, 17, 80], np.int32)
    page_indptr, page_indices, last = tessera.block_table_to_csr(table, seq_lens, 16)
    pages = [0, 1, 2, 5]
    np.testing.assert_array_equal(page_indptr, indptr(pages))
    expected = np.concatenate([table[b, :p] for b, p in enumerate(pages)])
    np.testing.assert_array_equal(page_indices[:page_indptr[-1]], expected)
    np.testing.assert_array_equal(last, [0, 16, 1, 16])
    with pytest.raises(ValueError, match="seq_lens"):
        tessera.block_table_to_csr(table, np.array([0, 0, 0, 81], np.int32), 16)
    with pytest.raises(ValueError, match="block_table"):
        tessera.block_table_to_csr(table.astype(np.int64), seq_lens, 16)
