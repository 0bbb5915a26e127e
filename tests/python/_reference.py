"""float64 numpy references for the CPU tests (the formulas of include/tessera/attention.hpp and
ops.hpp, written independently of the library)."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np


def attention_ref(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    causal: bool = False,
    window: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sm_scale: Optional[float] = None,
    k_rows: Optional[Sequence[np.ndarray]] = None,
    mask: Optional[Sequence[np.ndarray]] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """Ragged attention in float64: q [total_q, H, D]; k, v [total_kv, H_kv, D] ragged by the
    lengths (or per-request key/value rows in ``k_rows`` as (k_b, v_b) pairs). ``mask``: per
    request a boolean [q_len, kv_len] (True: visible) ANDed with causal / window.
    Returns (o [total_q, H, D], lse [total_q, H]).

    Non-finite inputs as include/tessera/attention.hpp defines them: a row without a visible
    key is o = 0, lse = -inf; a NaN or +inf visible score makes the row NaN (o and lse); a -inf
    score has weight 0 and a row of only -inf scores is empty; NaN / inf in v reach o per IEEE
    (0 * inf = NaN for a visible key of weight 0), and a masked key's v is never read."""
    q = np.asarray(q, np.float64)
    total_q, heads, dim = q.shape
    scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    # o rows have v's width (head_dim_vo), which may differ from q's.
    dim_v = np.shape(k_rows[0][1])[-1] if k_rows else (dim if v is None else v.shape[-1])
    o = np.zeros((total_q, heads, dim_v))
    lse = np.full((total_q, heads), -np.inf)
    q_start = kv_start = 0
    for b, (lq, lk) in enumerate(zip(q_lens, kv_lens)):
        if k_rows is not None:
            kb, vb = (np.asarray(x, np.float64) for x in k_rows[b])
        else:
            kb = np.asarray(k[kv_start:kv_start + lk], np.float64)
            vb = np.asarray(v[kv_start:kv_start + lk], np.float64)
        kv_heads = kb.shape[1] if lk else (k.shape[1] if k is not None else heads)
        group = heads // kv_heads
        qb = q[q_start:q_start + lq]
        i = np.arange(lq)[:, None]
        j = np.arange(lk)[None, :]
        off = lk - lq
        visible = np.ones((lq, lk), bool)
        if causal:
            visible &= j <= i + off
        if window[0] >= 0:
            visible &= j >= i + off - window[0]
        if window[1] >= 0:
            visible &= j <= i + off + window[1]
        if mask is not None:
            visible &= np.asarray(mask[b], bool).reshape(lq, lk)
        for h in range(heads):
            if lk == 0:
                continue
            out, row_lse = _attention_rows(qb[:, h], kb[:, h // group], vb[:, h // group],
                                           visible, scale, softcap)
            o[q_start:q_start + lq, h] = out
            lse[q_start:q_start + lq, h] = row_lse
        q_start += lq
        kv_start += lk
    return o, lse


def _attention_rows(qh: np.ndarray, kh: np.ndarray, vh: np.ndarray, visible: np.ndarray,
                    scale: float, softcap: float) -> Tuple[np.ndarray, np.ndarray]:
    """The rows of one (request, query head): qh [lq, D], kh, vh [lk, D], visible [lq, lk]."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.einsum("id,jd->ij", qh, kh) * scale  # per IEEE (BLAS may reorder inf * 0)
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        poisoned = (visible & (np.isnan(s) | (s == np.inf))).any(axis=1)
        s = np.where(visible & ~poisoned[:, None], s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        rows = np.isfinite(m[:, 0])  # some visible score is finite
        p = np.zeros_like(s)
        p[rows] = np.exp(s[rows] - m[rows])
        denominator = p.sum(axis=1, keepdims=True)
        if np.isfinite(vh).all():
            numerator = p @ vh
        else:  # p = 0 for masked keys must not meet their v (0 * inf)
            terms = p[:, :, None] * vh[None, :, :]
            numerator = np.where(visible[:, :, None], terms, 0.0).sum(axis=1)
        out = np.zeros((len(qh), vh.shape[1]))
        out[rows] = numerator[rows] / denominator[rows]
        out[poisoned] = np.nan
        row_lse = np.where(rows, m[:, 0] + np.log(np.where(rows, denominator[:, 0], 1.0)),
                           -np.inf)
        row_lse[poisoned] = np.nan
    return out, row_lse


def indptr(lengths: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def rope_frequencies(rotary_dim: int, theta: float = 1e4, scale: float = 1.0,
                     llama31: Optional[Tuple[float, float, float, int]] = None) -> np.ndarray:
    """theta^(-2i/rotary_dim) (Llama 3.1 rescaled with (factor, low, high, old_context_len)),
    divided by the linear position scale."""
    inv_freq = theta ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim)
    if llama31 is not None:
        factor, low, high, old = llama31
        wavelen = 2 * np.pi / inv_freq
        low_wavelen, high_wavelen = old / low, old / high
        smooth = (old / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor,
                          (1 - smooth) * inv_freq / factor + smooth * inv_freq)
        inv_freq = np.where(wavelen < high_wavelen, inv_freq, scaled)
    return inv_freq / scale


def rope_ref(x: np.ndarray, positions: np.ndarray, rotary_dim: Optional[int] = None,
             interleave: bool = False, theta: float = 1e4, scale: float = 1.0,
             llama31: Optional[Tuple[float, float, float, int]] = None) -> np.ndarray:
    """RoPE of x [nnz, H, D] by positions [nnz] in float64."""
    x = np.asarray(x, np.float64).copy()
    dim = x.shape[-1]
    rotary = dim if rotary_dim is None else rotary_dim
    # As in FlashInfer (and ops.hpp): frequencies rounded once to float32, the angle is the
    # float32 product float(position) * frequency, then sin/cos are taken accurately.
    frequencies = rope_frequencies(rotary, theta, scale, llama31).astype(np.float32)
    angles = (positions.astype(np.float32)[:, None] * frequencies[None, :]).astype(np.float64)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    if interleave:
        a, b = x[..., 0:rotary:2].copy(), x[..., 1:rotary:2].copy()
        x[..., 0:rotary:2] = a * cos - b * sin
        x[..., 1:rotary:2] = b * cos + a * sin
    else:
        half = rotary // 2
        a, b = x[..., :half].copy(), x[..., half:rotary].copy()
        x[..., :half] = a * cos - b * sin
        x[..., half:rotary] = b * cos + a * sin
    return x


def merge_ref(states: Sequence[Tuple[np.ndarray, np.ndarray]]) -> Tuple[np.ndarray, np.ndarray]:
    """Merge of partial states (o [N, H, D], lse [N, H]) in float64. An empty state (lse = -inf)
    has weight 0 and its o is never read; a NaN (or +inf) lse makes the row NaN."""
    lses = np.stack([np.asarray(s, np.float64) for _, s in states])  # [S, N, H]
    outs = np.stack([np.asarray(o, np.float64) for o, _ in states])  # [S, N, H, D]
    poisoned = (np.isnan(lses) | (lses == np.inf)).any(axis=0)
    present = np.isfinite(lses)
    m = np.where(present, lses, -np.inf).max(axis=0)
    finite = np.isfinite(m) & ~poisoned
    safe_m = np.where(finite, m, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        weights = np.where(present, np.exp(np.where(present, lses, 0.0) - safe_m), 0.0)
        total = weights.sum(axis=0)
        weighted = np.where(present[..., None], weights[..., None] * outs, 0.0).sum(axis=0)
        o = np.where(finite[..., None], weighted / np.where(finite, total, 1.0)[..., None], 0.0)
    lse = np.where(finite, safe_m + np.log(np.where(finite, total, 1.0)), -np.inf)
    o[poisoned] = np.nan
    lse[poisoned] = np.nan
    return o, lse


def tolerance(dtype) -> dict:
    return {"atol": 2e-3, "rtol": 2e-3} if np.dtype(dtype) == np.float16 else {"atol": 2e-5,
                                                                              "rtol": 2e-5}


class PagedCache:
    """A random paged KV cache holding ``kv_lens`` tokens per request on shuffled pages, with
    its block table, CSR page table and the per-request rows (for the reference)."""

    def __init__(self, rng: np.random.Generator, kv_lens: Sequence[int], page_size: int,
                 kv_heads: int, dim: int, dtype, layout: str = "NHD", spare_pages: int = 3):
        self.kv_lens = list(kv_lens)
        self.page_size = page_size
        self.layout = layout
        pages = [(n + page_size - 1) // page_size for n in kv_lens]
        self.num_pages = sum(pages) + spare_pages
        order = rng.permutation(self.num_pages).astype(np.int32)
        shape = ((self.num_pages, page_size, kv_heads, dim) if layout == "NHD"
                 else (self.num_pages, kv_heads, page_size, dim))
        self.k_cache = rng.standard_normal(shape).astype(dtype)
        self.v_cache = rng.standard_normal(shape).astype(dtype)
        max_pages = max(pages + [1]) + 1
        self.block_table = rng.integers(0, self.num_pages, (len(kv_lens), max_pages)).astype(
            np.int32)
        self.page_indices = []
        start = 0
        for b, count in enumerate(pages):
            mine = order[start:start + count]
            start += count
            self.block_table[b, :count] = mine
            self.page_indices.extend(mine.tolist())
        self.page_indices = np.array(self.page_indices, np.int32)
        self.page_indptr = indptr(pages)
        self.last_page_len = np.array(
            [n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)], np.int32)
        self.seq_lens = np.array(kv_lens, np.int32)

    def token_rows(self, cache: np.ndarray, b: int) -> np.ndarray:
        """[kv_len_b, H_kv, D] rows of request b."""
        pages = self.page_indices[self.page_indptr[b]:self.page_indptr[b + 1]]
        if self.layout == "NHD":
            rows = cache[pages].reshape(-1, cache.shape[2], cache.shape[3])
        else:
            rows = cache[pages].transpose(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])
        return rows[:self.kv_lens[b]]

    def rows(self) -> list:
        return [(self.token_rows(self.k_cache, b), self.token_rows(self.v_cache, b))
                for b in range(len(self.kv_lens))]


def fold_sinks_ref(o: np.ndarray, lse: np.ndarray,
                   sinks: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Attention sinks (include/tessera/attention.hpp) folded into sink-free (o, lse) in
    float64: lse' = log(e^lse + e^z) per query head, o' = o e^(lse - lse') (0 for a row without
    keys, whose lse' is the sink)."""
    z = np.asarray(sinks, np.float64)[None, :]
    lse = np.asarray(lse, np.float64)
    folded = np.logaddexp(lse, z)
    share = np.where(np.isneginf(lse), 0.0, np.exp(lse - folded))
    return np.asarray(o, np.float64) * share[..., None], folded
