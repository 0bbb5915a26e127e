"""MLA (issue 37) from Python: BatchMLAPagedAttentionWrapper (FlashInfer's plan/run signature)
and append_paged_mla_cache against a numpy reference of the formula, on the CPU; bad input
raises ValueError naming the argument; outputs given as out= stay untouched then."""

from __future__ import annotations

import numpy as np
import pytest

import tessera


def _batch(rng, batch, page_size, q_per, max_kv, num_pages_spare=2):
    kv_lens = rng.integers(0, max_kv + 1, size=batch).astype(np.int32)
    kv_lens[0] = max_kv  # a skewed batch: one long request
    pages = (kv_lens + page_size - 1) // page_size
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    num_pages = int(kv_indptr[-1]) + num_pages_spare
    kv_indices = rng.permutation(num_pages)[: kv_indptr[-1]].astype(np.int32)
    q_lens = np.full(batch, q_per, np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return qo_indptr, kv_indptr, kv_indices, kv_lens, num_pages


def _reference(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens, page_size,
               causal, sm_scale):
    """The formula in float64: s = scale (q_nope . ckv + q_pe . kpe), o = softmax(s) . ckv."""
    total_q, heads, lora = q_nope.shape
    o = np.zeros((total_q, heads, lora))
    lse = np.full((total_q, heads), -np.inf)
    for b in range(len(kv_lens)):
        kv_len = int(kv_lens[b])
        ids = kv_indices[kv_indptr[b]: kv_indptr[b + 1]]
        rows_ckv = ckv[ids].reshape(-1, ckv.shape[-1])[:kv_len].astype(np.float64)
        rows_kpe = kpe[ids].reshape(-1, kpe.shape[-1])[:kv_len].astype(np.float64)
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        q_len = q1 - q0
        for i in range(q_len):
            visible = min(max(i + kv_len - q_len + 1, 0), kv_len) if causal else kv_len
            if visible == 0:
                continue
            s = (q_nope[q0 + i].astype(np.float64) @ rows_ckv[:visible].T +
                 q_pe[q0 + i].astype(np.float64) @ rows_kpe[:visible].T) * sm_scale
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            o[q0 + i] = (p @ rows_ckv[:visible]) / p.sum(axis=1, keepdims=True)
            lse[q0 + i] = (m[:, 0] + np.log(p.sum(axis=1)))
    return o, lse


def _case(rng, heads, lora, rope, page_size, q_per, max_kv, dtype=np.float32):
    qo_indptr, kv_indptr, kv_indices, kv_lens, num_pages = _batch(rng, 4, page_size, q_per,
                                                                  max_kv)
    total_q = int(qo_indptr[-1])
    q_nope = rng.standard_normal((total_q, heads, lora)).astype(dtype)
    q_pe = rng.standard_normal((total_q, heads, rope)).astype(dtype)
    ckv = rng.standard_normal((num_pages, page_size, lora)).astype(dtype)
    kpe = rng.standard_normal((num_pages, page_size, rope)).astype(dtype)
    return qo_indptr, kv_indptr, kv_indices, kv_lens, q_nope, q_pe, ckv, kpe


@pytest.mark.parametrize("heads,lora,rope", [(16, 512, 64), (128, 64, 16), (32, 64, 16)])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("q_per,causal", [(1, False), (2, True)])
def test_mla_wrapper_matches_numpy(rng, heads, lora, rope, page_size, q_per, causal):
    max_kv = 90 if lora == 512 else 300
    qo, kv_indptr, kv_indices, kv_lens, q_nope, q_pe, ckv, kpe = _case(
        rng, heads, lora, rope, page_size, q_per, max_kv)
    sm_scale = 1.0 / np.sqrt(192.0)  # DeepSeek's: the pre-absorption qk width
    wrapper = tessera.BatchMLAPagedAttentionWrapper(np.empty(1 << 22, np.uint8))
    wrapper.plan(qo, kv_indptr, kv_indices, kv_lens, heads, lora, rope, page_size, causal,
                 sm_scale, "float32", "float32")
    o, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    expected_o, expected_lse = _reference(q_nope, q_pe, ckv, kpe, qo, kv_indptr, kv_indices,
                                          kv_lens, page_size, causal, sm_scale)
    np.testing.assert_allclose(o, expected_o, atol=2e-4)
    np.testing.assert_allclose(lse, expected_lse, atol=1e-4)
    assert "kv_lora_rank" in wrapper.explain()


def test_mla_combined_cache_out_and_fp16(rng):
    qo, kv_indptr, kv_indices, kv_lens, q_nope, q_pe, ckv, kpe = _case(
        rng, 16, 512, 64, 64, 1, 200, np.float16)
    combined = np.concatenate([ckv, kpe], axis=-1)  # FlashMLA's [.., 576] cache
    wrapper = tessera.BatchMLAPagedAttentionWrapper(np.empty(1 << 22, np.uint8))
    wrapper.plan(qo, kv_indptr, kv_indices, kv_lens, 16, 512, 64, 64, False, 0.1,
                 "float16", "float16")
    out = np.full(q_nope.shape, np.nan, np.float16)
    result = wrapper.run(q_nope, q_pe, combined, None, out=out)
    assert result is out
    expected, _ = _reference(q_nope, q_pe, ckv, kpe, qo, kv_indptr, kv_indices, kv_lens, 64,
                             False, 0.1)
    np.testing.assert_allclose(out.astype(np.float64), expected, atol=5e-3)


def test_mla_bad_input_is_named(rng):
    qo, kv_indptr, kv_indices, kv_lens, q_nope, q_pe, ckv, kpe = _case(rng, 16, 64, 16, 16, 1,
                                                                       40)
    wrapper = tessera.BatchMLAPagedAttentionWrapper(np.empty(1 << 20, np.uint8))
    with pytest.raises(ValueError, match="kv_lora_rank.*head_dim_ckv"):
        wrapper.plan(qo, kv_indptr, kv_indices, kv_lens, 16, 60, 16, 16, False, 0.1)
    with pytest.raises(ValueError, match="rope_dim"):
        wrapper.plan(qo, kv_indptr, kv_indices, kv_lens, 16, 64, 20, 16, False, 0.1)
    with pytest.raises(ValueError, match="num_heads"):
        wrapper.plan(qo, kv_indptr, kv_indices, kv_lens, 0, 64, 16, 16, False, 0.1)
    bad_lens = kv_lens.copy()
    bad_lens[0] += 16
    with pytest.raises(ValueError, match="kv_len_arr"):
        wrapper.plan(qo, kv_indptr, kv_indices, bad_lens, 16, 64, 16, 16, False, 0.1)
    wrapper.plan(qo, kv_indptr, kv_indices, kv_lens, 16, 64, 16, 16, False, 0.1)
    out = np.full(q_nope.shape, np.nan, np.float32)
    with pytest.raises(ValueError, match="'q_pe'"):
        wrapper.run(q_nope, q_pe[:, :, :8], ckv, kpe, out=out)
    with pytest.raises(ValueError, match="'q_nope'"):
        wrapper.run(q_nope[:, :8], q_pe, ckv, kpe, out=out)
    with pytest.raises(ValueError, match="'kpe_cache'"):
        wrapper.run(q_nope, q_pe, ckv, kpe[:-1], out=out)
    with pytest.raises(ValueError, match="'ckv_cache'"):
        wrapper.run(q_nope, q_pe, ckv[:, :8], kpe, out=out)
    assert np.isnan(out).all()


def _rope_interleaved(x, positions, theta=1e4):
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angle = positions[:, None].astype(np.float64) * freq[None, :]
    x0, x1 = x[:, 0::2].astype(np.float64), x[:, 1::2].astype(np.float64)
    out = np.empty(x.shape, np.float64)
    out[:, 0::2] = x0 * np.cos(angle) - x1 * np.sin(angle)
    out[:, 1::2] = x0 * np.sin(angle) + x1 * np.cos(angle)
    return out


def test_append_paged_mla_cache_with_rope(rng):
    page_size, lora, rope = 16, 64, 16
    kv_lens = np.array([20, 0, 33], np.int32)
    pages = (kv_lens + page_size - 1) // page_size
    page_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    page_indices = rng.permutation(6)[: page_indptr[-1]].astype(np.int32)
    last = np.where(pages == 0, 0, kv_lens - (pages - 1) * page_size).astype(np.int32)
    ckv_cache = np.zeros((6, page_size, lora), np.float32)
    kpe_cache = np.zeros((6, page_size, rope), np.float32)
    append_indptr = np.array([0, 3, 3, 8], np.int32)
    ckv_new = rng.standard_normal((8, lora)).astype(np.float32)
    kpe_new = rng.standard_normal((8, rope)).astype(np.float32)
    tessera.append_paged_mla_cache(ckv_new, kpe_new, append_indptr, ckv_cache, kpe_cache,
                                   page_indptr, page_indices, last,
                                   rope=tessera.RopeOptions(interleave=True))
    positions = np.array([17, 18, 19, 28, 29, 30, 31, 32])
    requests = [0, 0, 0, 2, 2, 2, 2, 2]
    expected_kpe = _rope_interleaved(kpe_new, positions)
    for row, (b, position) in enumerate(zip(requests, positions)):
        page = page_indices[page_indptr[b] + position // page_size]
        np.testing.assert_array_equal(ckv_cache[page, position % page_size], ckv_new[row])
        np.testing.assert_allclose(kpe_cache[page, position % page_size], expected_kpe[row],
                                   atol=1e-5)
