"""tessera.varlen_attention (FlashAttention's flash_attn_varlen_func) on the CPU vs float64."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from _reference import attention_ref, indptr, tolerance


def _problem(rng, q_lens, kv_lens, heads, kv_heads, dim, dtype):
    q = rng.standard_normal((sum(q_lens), heads, dim)).astype(dtype)
    k = rng.standard_normal((sum(kv_lens), kv_heads, dim)).astype(dtype)
    v = rng.standard_normal((sum(kv_lens), kv_heads, dim)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_prefill(rng, dtype, heads, kv_heads, causal):
    q_lens, kv_lens = [1, 7, 33, 0, 5], [1, 19, 33, 4, 70]
    q, k, v = _problem(rng, q_lens, kv_lens, heads, kv_heads, 64, dtype)
    o, lse = tessera.varlen_attention(q, k, v, indptr(q_lens), indptr(kv_lens), max(q_lens),
                                      max(kv_lens), causal=causal, return_lse=True)
    assert o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == q.shape[:2]
    ref_o, ref_lse = attention_ref(q, k, v, q_lens, kv_lens, causal=causal)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("window", [(4, 0), (3, 2), (-1, 5), (0, 0)])
def test_sliding_window(rng, window):
    q_lens, kv_lens = [20, 3], [20, 30]
    q, k, v = _problem(rng, q_lens, kv_lens, 4, 2, 32, np.float32)
    o, lse = tessera.varlen_attention(q, k, v, indptr(q_lens), indptr(kv_lens), causal=False,
                                      window_size=window, return_lse=True)
    ref_o, ref_lse = attention_ref(q, k, v, q_lens, kv_lens, window=window)
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)


def test_causal_window_softcap_scale(rng, dtype):
    q_lens, kv_lens = [9, 16], [25, 16]
    q, k, v = _problem(rng, q_lens, kv_lens, 4, 2, 128, dtype)
    o, lse = tessera.varlen_attention(q, k, v, indptr(q_lens), indptr(kv_lens), 16, 25,
                                      softmax_scale=0.3, causal=True, window_size=(6, -1),
                                      softcap=5.0, return_lse=True)
    ref_o, ref_lse = attention_ref(q, k, v, q_lens, kv_lens, causal=True, window=(6, -1),
                                   softcap=5.0, sm_scale=0.3)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_row_with_no_visible_key_is_zero_not_nan(rng):
    # Causal with q_len > kv_len: the first queries see no key.
    q_lens, kv_lens = [6], [2]
    q, k, v = _problem(rng, q_lens, kv_lens, 2, 2, 16, np.float32)
    o, lse = tessera.varlen_attention(q, k, v, indptr(q_lens), indptr(kv_lens), causal=True,
                                      return_lse=True)
    assert not np.isnan(o).any()
    np.testing.assert_array_equal(o[:4], 0)
    assert np.isneginf(lse[:4]).all()
    ref_o, _ = attention_ref(q, k, v, q_lens, kv_lens, causal=True)
    np.testing.assert_allclose(o, ref_o, atol=2e-5)


def test_strided_views_of_fused_qkv(rng):
    lens = [10, 6]
    qkv = rng.standard_normal((16, 4 + 2 + 2, 32)).astype(np.float32)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    o = tessera.varlen_attention(q, k, v, indptr(lens), indptr(lens), causal=True)
    ref_o, _ = attention_ref(q, k, v, lens, lens, causal=True)
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)


def test_preallocated_outputs_and_list_indptr(rng):
    lens = [3, 4]
    q, k, v = _problem(rng, lens, lens, 2, 1, 16, np.float32)
    out = np.full_like(q, np.nan)
    lse = np.full(q.shape[:2], np.nan, np.float32)
    o, l = tessera.varlen_attention(q, k, v, [0, 3, 7], [0, 3, 7], out=out, lse=lse,
                                    return_lse=True)
    assert o is out and l is lse
    ref_o, ref_lse = attention_ref(q, k, v, lens, lens)
    np.testing.assert_allclose(out, ref_o, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)


def test_reference_backend_agrees(rng):
    lens = [40]
    q, k, v = _problem(rng, lens, lens, 4, 2, 64, np.float32)
    fast = tessera.varlen_attention(q, k, v, indptr(lens), indptr(lens), causal=True)
    tessera.use_cpu_reference(True)
    try:
        slow = tessera.varlen_attention(q, k, v, indptr(lens), indptr(lens), causal=True)
    finally:
        tessera.use_cpu_reference(False)
    np.testing.assert_allclose(fast, slow, atol=1e-5)


# ---- errors name the argument ------------------------------------------------------------


def test_error_int64_cu_seqlens(rng):
    q, k, v = _problem(rng, [4], [4], 2, 2, 16, np.float32)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        tessera.varlen_attention(q, k, v, indptr([4]), indptr([4]).astype(np.int64))


def test_error_gqa_ratio(rng):
    q, k, v = _problem(rng, [4], [4], 3, 2, 16, np.float32)
    with pytest.raises(ValueError, match="num_qo_heads|num_kv_heads"):
        tessera.varlen_attention(q, k, v, indptr([4]), indptr([4]))


def test_error_dtype_mismatch(rng):
    q, k, v = _problem(rng, [4], [4], 2, 2, 16, np.float32)
    with pytest.raises(ValueError, match="'k'"):
        tessera.varlen_attention(q, k.astype(np.float16), v, indptr([4]), indptr([4]))


def test_error_bad_window(rng):
    q, k, v = _problem(rng, [4], [4], 2, 2, 16, np.float32)
    with pytest.raises(ValueError, match="window_size"):
        tessera.varlen_attention(q, k, v, indptr([4]), indptr([4]), window_size=(-2, 0))
    with pytest.raises(ValueError, match="window_size"):
        tessera.varlen_attention(q, k, v, indptr([4]), indptr([4]), window_size=3)


def test_error_bad_softcap_and_scale(rng):
    q, k, v = _problem(rng, [4], [4], 2, 2, 16, np.float32)
    with pytest.raises(ValueError, match="softcap"):
        tessera.varlen_attention(q, k, v, indptr([4]), indptr([4]), softcap=-1.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        tessera.varlen_attention(q, k, v, indptr([4]), indptr([4]), softmax_scale=-1.0)


def test_error_wrong_q_rank(rng):
    q = rng.standard_normal((4, 2, 2, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="'q'"):
        tessera.varlen_attention(q, q, q, indptr([4]), indptr([4]))


def test_error_indptr_exceeds_k(rng):
    q, k, v = _problem(rng, [4], [4], 2, 2, 16, np.float32)
    with pytest.raises(ValueError, match="cu_seqlens_k|'k'"):
        tessera.varlen_attention(q, k, v, indptr([4]), indptr([9]))


def test_error_out_shape(rng):
    q, k, v = _problem(rng, [4], [4], 2, 2, 16, np.float32)
    with pytest.raises(ValueError, match="out"):
        tessera.varlen_attention(q, k, v, indptr([4]), indptr([4]), out=np.empty((4, 2, 8),
                                                                                 np.float32))


def test_failed_call_leaves_output_untouched(rng):
    q, k, v = _problem(rng, [4], [4], 2, 2, 16, np.float32)
    out = np.full_like(q, 7.0)
    with pytest.raises(ValueError):
        tessera.varlen_attention(q, k, v, indptr([4]), indptr([5]), out=out)
    assert (out == 7.0).all()


def test_bfloat16_numpy_through_ml_dtypes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes gives numpy a bfloat16")
    lens = [12, 30]
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in _problem(rng, lens, lens, 4, 2, 64,
                                                               np.float32))
    o = tessera.varlen_attention(q, k, v, indptr(lens), indptr(lens), causal=True)
    assert o.dtype == q.dtype
    ref_o, _ = attention_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                             lens, lens, causal=True)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, atol=2e-2, rtol=2e-2)
