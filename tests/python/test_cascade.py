"""MultiLevelCascadeAttentionWrapper on the CPU (numpy): FlashInfer's two-level example shape
(decode and chunked prefill under a shared prefix), a three-level case, sinks, lse, the combined
[num_pages, 2, ...] cache, and bad arguments, against the float64 reference over each request's
concatenated keys."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from _reference import attention_ref

HEADS, KV_HEADS, DIM, PAGE = 8, 2, 64, 4


def _pool(rng, num_pages, dtype):
    k = rng.uniform(-1, 1, (num_pages, PAGE, KV_HEADS, DIM)).astype(dtype)
    v = rng.uniform(-1, 1, (num_pages, PAGE, KV_HEADS, DIM)).astype(dtype)
    return k, v


def _keys(k, v, pages, last):
    """The keys of a page list ([n, H_kv, D] each)."""
    if len(pages) == 0:
        return k[:0, 0], v[:0, 0]
    ks = np.concatenate([k[p] for p in pages])[: (len(pages) - 1) * PAGE + last]
    vs = np.concatenate([v[p] for p in pages])[: (len(pages) - 1) * PAGE + last]
    return ks, vs


def _levels(rng, q_lens, shared_pages, group_pages, own_lens):
    """Level 0: one group of every request over `shared_pages` full pages; level 1 (when
    group_pages is not None): groups of two requests; last: each request's own keys."""
    batch = len(q_lens)
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    next_page = 0
    levels = []

    def take(count):
        nonlocal next_page
        pages = np.arange(next_page, next_page + count, dtype=np.int32)
        next_page += count
        return pages

    levels.append(([0, qo[-1]], [0, shared_pages], take(shared_pages), [PAGE]))
    if group_pages is not None:
        starts = list(range(0, batch, 2)) + [batch]
        pages = [take(group_pages) for _ in starts[:-1]]
        levels.append(([qo[s] for s in starts], np.concatenate([[0], np.cumsum([len(p) for p in pages])]),
                       np.concatenate(pages), [PAGE] * len(pages)))
    own_pages = [take((n + PAGE - 1) // PAGE) for n in own_lens]
    levels.append((qo, np.concatenate([[0], np.cumsum([len(p) for p in own_pages])]),
                   np.concatenate(own_pages), [n - (len(p) - 1) * PAGE for n, p in zip(own_lens, own_pages)]))
    arrays = [[np.asarray(x, np.int32) for x in level] for level in levels]
    return arrays, next_page, own_pages


def _expected(q, k, v, q_lens, levels, own_pages, own_lens, causal, three):
    rows = []
    for b in range(len(q_lens)):
        parts = [_keys(k, v, levels[0][2], PAGE)]
        if three:
            group = b // 2
            lo, hi = levels[1][1][group], levels[1][1][group + 1]
            parts.append(_keys(k, v, levels[1][2][lo:hi], PAGE))
        parts.append(_keys(k, v, own_pages[b], own_lens[b] - (len(own_pages[b]) - 1) * PAGE))
        rows.append((np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])))
    kv_lens = [len(r[0]) for r in rows]
    return attention_ref(q, None, None, q_lens, kv_lens, causal=causal, k_rows=rows)


@pytest.mark.parametrize("three", [False, True], ids=["two-level", "three-level"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_cascade_matches_concatenated_keys(rng, dtype, three, decode):
    q_lens = [1] * 5 if decode else [3, 1, 4, 2, 5]
    own_lens = [6, 9, 5, 12, 7]  # >= q_len - 1: causal over the concatenation is the same mask
    levels, num_pages, own_pages = _levels(rng, q_lens, 3, 2 if three else None, own_lens)
    k, v = _pool(rng, num_pages + 2, dtype)
    q = rng.uniform(-2, 2, (sum(q_lens), HEADS, DIM)).astype(dtype)
    workspace = np.empty(64 << 20, np.uint8)
    wrapper = tessera.MultiLevelCascadeAttentionWrapper(len(levels), workspace, "NHD")
    wrapper.plan([lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels],
                 [lv[3] for lv in levels], HEADS, KV_HEADS, DIM, PAGE, causal=not decode)
    assert "cascade: %d levels" % len(levels) in wrapper.explain()
    o, lse = wrapper.run(q, (k, v), return_lse=True)
    want_o, want_lse = _expected(q, k, v, q_lens, levels, own_pages, own_lens, not decode, three)
    tol = 2e-3 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(o.astype(np.float64), want_o, atol=tol, rtol=tol)
    np.testing.assert_allclose(lse, want_lse, atol=1e-3, rtol=1e-3)
    # The combined [num_pages, 2, page, H, D] cache gives the same bits.
    both = np.stack([k, v], axis=1)
    np.testing.assert_array_equal(wrapper.run(q, both), o)


def test_cascade_sinks_join_once(rng):
    q_lens = [1, 1, 1]
    own_lens = [5, 0, 9]  # request 1 sees only the shared prefix
    levels, num_pages, own_pages = _levels(rng, q_lens, 2, None, [max(n, 1) for n in own_lens])
    levels[1][1] = np.asarray([0, 2, 2, 5], np.int32)  # request 1: no own page
    levels[1][2] = np.concatenate([own_pages[0], own_pages[2]]).astype(np.int32)
    levels[1][3] = np.asarray([1, 1, 1], np.int32)
    own_pages = [own_pages[0], np.zeros(0, np.int32), own_pages[2]]
    levels[1][3][0] = own_lens[0] - (len(own_pages[0]) - 1) * PAGE
    levels[1][3][2] = own_lens[2] - (len(own_pages[2]) - 1) * PAGE
    k, v = _pool(rng, num_pages, np.float32)
    q = rng.uniform(-2, 2, (3, HEADS, DIM)).astype(np.float32)
    sinks = rng.normal(0, 2, HEADS).astype(np.float32)
    wrapper = tessera.MultiLevelCascadeAttentionWrapper(2, np.empty(8 << 20, np.uint8))
    wrapper.plan([lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels],
                 [lv[3] for lv in levels], HEADS, KV_HEADS, DIM, PAGE)
    o, lse = wrapper.run(q, (k, v), return_lse=True, sinks=sinks)
    base_o, base_lse = wrapper.run(q, (k, v), return_lse=True)
    # The definition: lse' = log(e^lse + e^z), o' = o e^(lse - lse').
    want_lse = np.logaddexp(base_lse.astype(np.float64), sinks[None, :])
    np.testing.assert_allclose(lse, want_lse, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(o, base_o * np.exp(base_lse - want_lse)[..., None], atol=1e-5)


def test_cascade_bad_arguments():
    workspace = np.empty(1 << 20, np.uint8)
    with pytest.raises(ValueError, match="num_levels"):
        tessera.MultiLevelCascadeAttentionWrapper(0, workspace)
    with pytest.raises(ValueError, match="use_cuda_graph"):
        tessera.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD", True)
    wrapper = tessera.MultiLevelCascadeAttentionWrapper(2, workspace)
    one = [np.asarray([0, 2], np.int32)]
    with pytest.raises(ValueError, match="qo_indptr_arr"):
        wrapper.plan(one, one * 2, one * 2, one * 2, HEADS, KV_HEADS, DIM, PAGE)
    qo = [np.asarray([0, 2], np.int32), np.asarray([0, 1, 2], np.int32)]
    indptr = [np.asarray([0, 1], np.int32), np.asarray([0, 1, 2], np.int32)]
    indices = [np.asarray([0], np.int32), np.asarray([1, 2], np.int32)]
    last = [np.asarray([PAGE], np.int32), np.asarray([1, 1], np.int32)]
    with pytest.raises(ValueError, match="sliding window"):
        wrapper.plan(qo, indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, window_left=4)
    with pytest.raises(ValueError, match="plan"):
        wrapper.run(np.zeros((2, HEADS, DIM), np.float32), (np.zeros((3, PAGE, KV_HEADS, DIM), np.float32),) * 2)
    wrapper.plan(qo, indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE)
    k = np.zeros((3, PAGE, KV_HEADS, DIM), np.float32)
    with pytest.raises(ValueError, match="'q'"):
        wrapper.run(np.zeros((3, HEADS, DIM), np.float32), (k, k))
