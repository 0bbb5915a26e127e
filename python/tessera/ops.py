"""Auxiliary ops with FlashInfer-style signatures: RoPE, paged-KV append, merging of attention
states, and the vLLM/FlashAttention block table -> CSR page table conversion.

All take arrays of any framework (through DLPack), run on the device of their inputs on the
framework's current CUDA stream, and allocate outputs with the framework of the inputs. Each
takes up to 65536 heads and a head_dim up to 4096.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from . import _capi
from ._capi import check
from ._common import (
    arange_int32,
    kv_layout_code,
    paged_kv,
    require_ndim,
    split_paged_kv_cache,
    stream_arg,
)
from ._dlpack import (
    clone,
    empty,
    framework,
    from_numpy,
    index_array,
    merge_leading,
    optional_dl,
    ref,
    shape_of,
    stream_of,
    strides_of,
    to_dl,
    view,
    to_host_int32,
)

__all__ = [
    "RopeOptions",
    "apply_rope_inplace",
    "apply_rope_pos_ids_inplace",
    "apply_llama31_rope_inplace",
    "apply_llama31_rope_pos_ids_inplace",
    "apply_rope",
    "apply_rope_pos_ids",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "apply_llama31_rope",
    "apply_llama31_rope_pos_ids",
    "append_paged_kv_cache",
    "merge_state",
    "merge_states",
    "block_table_to_csr",
]

ArrayLike = Any

_ROPE_NAMES = {
    "rope.rotary_dim": "rotary_dim",
    "rope.rope_theta": "rope_theta",
    "rope.rope_scale": "rope_scale",
    "rope.llama31_factor": "rope_scale",
    "rope.llama31_high_freq_factor": "high_freq_factor",
    "rope.llama31_original_max_position": "old_context_len",
    "positions": "pos_ids",
}


@dataclass(frozen=True)
class RopeOptions:
    """Rotary embedding settings (``tessera_rope_options``).

    Attributes:
        rotary_dim: features rotated per head (even, <= head_dim, <= 256); None = head_dim
            (then head_dim must be <= 256).
        interleave: False = NeoX / Llama pairs ``(x[i], x[i + d/2])``; True = GPT-J pairs
            ``(x[2i], x[2i+1])``.
        rope_theta: base of the frequencies ``theta^(-2i / rotary_dim)``.
        rope_scale: linear position interpolation (positions / rope_scale).
        llama31: Llama 3.1 frequency rescaling with ``llama31_factor``, ``low_freq_factor``,
            ``high_freq_factor`` and ``old_context_len`` (original max position).
    """

    rotary_dim: Optional[int] = None
    interleave: bool = False
    rope_theta: float = 1e4
    rope_scale: float = 1.0
    llama31: bool = False
    llama31_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    old_context_len: int = 8192

    def to_c(self) -> _capi.RopeOptionsC:
        return _capi.RopeOptionsC(
            0 if self.rotary_dim is None else int(self.rotary_dim),
            1 if self.interleave else 0,
            float(self.rope_theta),
            float(self.rope_scale),
            1 if self.llama31 else 0,
            float(self.llama31_factor),
            float(self.low_freq_factor),
            float(self.high_freq_factor),
            int(self.old_context_len),
        )


# ---------------------------------------------------------------------------------------------
# RoPE


def _positions_from_indptr(indptr: ArrayLike, offsets: ArrayLike, nnz: int, like: ArrayLike,
                           like_dl: Any) -> ArrayLike:
    """pos[i] = offsets[b] + i - indptr[b] for token i of request b (FlashInfer's
    indptr/offsets form), computed on the device for torch tensors."""
    if framework(indptr) == "torch" and framework(offsets) == "torch":
        torch = sys.modules["torch"]
        indptr64 = indptr.to(torch.int64)
        lengths = indptr64[1:] - indptr64[:-1]
        start = offsets.to(torch.int64) - indptr64[:-1]
        positions = torch.repeat_interleave(start, lengths, output_size=nnz)
        positions += torch.arange(nnz, device=positions.device, dtype=torch.int64)
        return positions.to(torch.int32)
    indptr_host = to_host_int32(indptr, "indptr").astype(np.int64).reshape(-1)
    offsets_host = to_host_int32(offsets, "offsets").astype(np.int64).reshape(-1)
    if indptr_host.size != offsets_host.size + 1:
        raise ValueError(f"'offsets': expected {indptr_host.size - 1} values (one per request), "
                         f"got {offsets_host.size}")
    lengths = np.diff(indptr_host)
    if (lengths < 0).any() or indptr_host[0] != 0 or indptr_host[-1] != nnz:
        raise ValueError(f"'indptr': expected non-decreasing values from 0 to nnz = {nnz}")
    positions = np.repeat(offsets_host - indptr_host[:-1], lengths) + np.arange(nnz)
    return from_numpy(positions.astype(np.int32), like, like_dl)


def _rope(q: Optional[ArrayLike], k: Optional[ArrayLike], positions: Optional[ArrayLike],
          indptr: Optional[ArrayLike], offsets: Optional[ArrayLike], options: RopeOptions) -> None:
    q_dl = optional_dl(q, "q", writable=True)
    k_dl = optional_dl(k, "k", writable=True)
    first, first_dl = (q, q_dl) if q_dl is not None else (k, k_dl)
    if first_dl is None:
        raise ValueError("'q': expected q or k (or both), got neither")
    nnz = shape_of(first_dl)[0]
    if positions is None:
        positions = _positions_from_indptr(indptr, offsets, nnz, first, first_dl)
    else:
        positions = index_array(positions, "pos_ids", first, first_dl)
    positions_dl = to_dl(positions, "pos_ids")
    rope = options.to_c()
    check(_capi.lib().tessera_apply_rope_inplace(
        ref(q_dl), ref(k_dl), ref(positions_dl), ctypes.byref(rope),
        stream_arg(stream_of(first, first_dl))), _ROPE_NAMES)


def apply_rope_pos_ids_inplace(q: Optional[ArrayLike], k: Optional[ArrayLike], pos_ids: ArrayLike,
                               rotary_dim: Optional[int] = None, interleave: bool = False,
                               rope_scale: float = 1.0, rope_theta: float = 1e4) -> None:
    """Rotates ``q`` ``[nnz, num_qo_heads, head_dim]`` and ``k`` ``[nnz, num_kv_heads,
    head_dim]`` in place by int32 positions ``pos_ids`` ``[nnz]`` (either q or k may be None).
    ``interleave=False``: NeoX/Llama pairs; True: GPT-J pairs."""
    _rope(q, k, pos_ids, None, None,
          RopeOptions(rotary_dim, interleave, rope_theta, rope_scale))


def apply_rope_inplace(q: Optional[ArrayLike], k: Optional[ArrayLike], indptr: ArrayLike,
                       offsets: ArrayLike, rotary_dim: Optional[int] = None,
                       interleave: bool = False, rope_scale: float = 1.0,
                       rope_theta: float = 1e4) -> None:
    """Rotates ``q``/``k`` in place; token ``i`` of request ``b`` (rows ``indptr[b]`` ..
    ``indptr[b+1]-1``) is at position ``offsets[b] + i - indptr[b]`` (FlashInfer's form)."""
    _rope(q, k, None, indptr, offsets,
          RopeOptions(rotary_dim, interleave, rope_theta, rope_scale))


def _llama31(rotary_dim: Optional[int], interleave: bool, rope_scale: float, rope_theta: float,
             low_freq_factor: float, high_freq_factor: float, old_context_len: int) -> RopeOptions:
    # FlashInfer passes the Llama 3.1 factor as rope_scale; Tessera keeps position scaling at 1.
    return RopeOptions(rotary_dim, interleave, rope_theta, 1.0, True, rope_scale,
                       low_freq_factor, high_freq_factor, old_context_len)


def apply_llama31_rope_pos_ids_inplace(
        q: Optional[ArrayLike], k: Optional[ArrayLike], pos_ids: ArrayLike,
        rotary_dim: Optional[int] = None, interleave: bool = False, rope_scale: float = 8.0,
        rope_theta: float = 5e5, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
        old_context_len: int = 8192) -> None:
    """Llama 3.1 RoPE in place by positions (FlashInfer's ``apply_llama31_rope_pos_ids_inplace``:
    ``rope_scale`` is the Llama 3.1 factor)."""
    _rope(q, k, pos_ids, None, None, _llama31(rotary_dim, interleave, rope_scale, rope_theta,
                                              low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope_inplace(
        q: Optional[ArrayLike], k: Optional[ArrayLike], indptr: ArrayLike, offsets: ArrayLike,
        rotary_dim: Optional[int] = None, interleave: bool = False, rope_scale: float = 8.0,
        rope_theta: float = 5e5, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
        old_context_len: int = 8192) -> None:
    """Llama 3.1 RoPE in place, positions from ``indptr``/``offsets``."""
    _rope(q, k, None, indptr, offsets, _llama31(rotary_dim, interleave, rope_scale, rope_theta,
                                                low_freq_factor, high_freq_factor,
                                                old_context_len))


def _heads_view(x_dl: Optional[Any], head_size: int, name: str) -> Optional[Any]:
    """[nnz, num_heads * head_size] (FlashInfer's and vLLM's layout) as [nnz, num_heads,
    head_size] without a copy; a 3-D tensor as it is."""
    if x_dl is None:
        return None
    shape, strides = shape_of(x_dl), strides_of(x_dl)
    if len(shape) == 3:
        return x_dl
    if len(shape) != 2 or head_size <= 0 or shape[1] % head_size or (shape[1] > 1 and
                                                                      strides[1] != 1):
        raise ValueError(f"'{name}': expected [nnz, num_heads * head_size] with head_size = "
                         f"{head_size} and contiguous rows (or [nnz, num_heads, head_size]), got "
                         f"shape {list(shape)}")
    return view(x_dl, (shape[0], shape[1] // head_size, head_size),
                (strides[0], head_size, 1))


def apply_rope_with_cos_sin_cache_inplace(positions: ArrayLike, query: Optional[ArrayLike],
                                          key: Optional[ArrayLike], head_size: int,
                                          cos_sin_cache: ArrayLike, is_neox: bool = True) -> None:
    """RoPE from a precomputed table in place (FlashInfer's
    ``apply_rope_with_cos_sin_cache_inplace``, vLLM's ``rotary_embedding``): ``query``
    ``[nnz, num_q_heads * head_size]`` and ``key`` ``[nnz, num_k_heads * head_size]`` (or 3-D
    ``[nnz, heads, head_size]``; either may be None), ``positions`` int32 / int64 ``[nnz]`` on
    their device, ``cos_sin_cache`` float32 ``[max_position, rotary_dim]`` (each row the cos of
    the rotary_dim / 2 pairs, then their sin). ``is_neox=True``: pairs (x[i], x[i + rotary_dim /
    2]); False: GPT-J pairs (x[2i], x[2i + 1]). A position outside [0, max_position) is an error
    for host arrays; on a GPU its token's rotated features become NaN."""
    head_size = int(head_size)
    q_dl = _heads_view(optional_dl(query, "query", writable=True), head_size, "query")
    k_dl = _heads_view(optional_dl(key, "key", writable=True), head_size, "key")
    first, first_dl = (query, q_dl) if q_dl is not None else (key, k_dl)
    if first_dl is None:
        raise ValueError("'query': expected query or key (or both), got neither")
    positions_dl = to_dl(index_array(positions, "positions", first, first_dl), "positions")
    table_dl = to_dl(cos_sin_cache, "cos_sin_cache")
    check(_capi.lib().tessera_apply_rope_with_cos_sin_cache_inplace(
        ref(q_dl), ref(k_dl), ref(positions_dl), ref(table_dl), 0 if is_neox else 1,
        stream_arg(stream_of(first, first_dl))), {"q": "query", "k": "key"})


def apply_rope_with_cos_sin_cache(positions: ArrayLike, query: Optional[ArrayLike],
                                  key: Optional[ArrayLike], head_size: int,
                                  cos_sin_cache: ArrayLike, is_neox: bool = True
                                  ) -> Tuple[Optional[ArrayLike], Optional[ArrayLike]]:
    """Out-of-place :func:`apply_rope_with_cos_sin_cache_inplace`: returns ``(query_out,
    key_out)`` in the inputs' shapes."""
    query_out, key_out = _copies(query, key)
    apply_rope_with_cos_sin_cache_inplace(positions, query_out, key_out, head_size, cos_sin_cache,
                                          is_neox)
    return query_out, key_out


def _copies(q: Optional[ArrayLike], k: Optional[ArrayLike]):
    return (None if q is None else clone(q, "q")), (None if k is None else clone(k, "k"))


def apply_rope_pos_ids(q: Optional[ArrayLike], k: Optional[ArrayLike], pos_ids: ArrayLike,
                       rotary_dim: Optional[int] = None, interleave: bool = False,
                       rope_scale: float = 1.0, rope_theta: float = 1e4
                       ) -> Tuple[Optional[ArrayLike], Optional[ArrayLike]]:
    """Out-of-place :func:`apply_rope_pos_ids_inplace`: returns ``(q_rope, k_rope)``."""
    q_rope, k_rope = _copies(q, k)
    apply_rope_pos_ids_inplace(q_rope, k_rope, pos_ids, rotary_dim, interleave, rope_scale,
                               rope_theta)
    return q_rope, k_rope


def apply_rope(q: Optional[ArrayLike], k: Optional[ArrayLike], indptr: ArrayLike,
               offsets: ArrayLike, rotary_dim: Optional[int] = None, interleave: bool = False,
               rope_scale: float = 1.0, rope_theta: float = 1e4
               ) -> Tuple[Optional[ArrayLike], Optional[ArrayLike]]:
    """Out-of-place :func:`apply_rope_inplace`: returns ``(q_rope, k_rope)``."""
    q_rope, k_rope = _copies(q, k)
    apply_rope_inplace(q_rope, k_rope, indptr, offsets, rotary_dim, interleave, rope_scale,
                       rope_theta)
    return q_rope, k_rope


def apply_llama31_rope_pos_ids(
        q: Optional[ArrayLike], k: Optional[ArrayLike], pos_ids: ArrayLike,
        rotary_dim: Optional[int] = None, interleave: bool = False, rope_scale: float = 8.0,
        rope_theta: float = 5e5, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
        old_context_len: int = 8192) -> Tuple[Optional[ArrayLike], Optional[ArrayLike]]:
    """Out-of-place :func:`apply_llama31_rope_pos_ids_inplace`."""
    q_rope, k_rope = _copies(q, k)
    apply_llama31_rope_pos_ids_inplace(q_rope, k_rope, pos_ids, rotary_dim, interleave,
                                       rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                                       old_context_len)
    return q_rope, k_rope


def apply_llama31_rope(
        q: Optional[ArrayLike], k: Optional[ArrayLike], indptr: ArrayLike, offsets: ArrayLike,
        rotary_dim: Optional[int] = None, interleave: bool = False, rope_scale: float = 8.0,
        rope_theta: float = 5e5, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
        old_context_len: int = 8192) -> Tuple[Optional[ArrayLike], Optional[ArrayLike]]:
    """Out-of-place :func:`apply_llama31_rope_inplace`."""
    q_rope, k_rope = _copies(q, k)
    apply_llama31_rope_inplace(q_rope, k_rope, indptr, offsets, rotary_dim, interleave,
                               rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                               old_context_len)
    return q_rope, k_rope


# ---------------------------------------------------------------------------------------------
# Paged KV cache


def append_paged_kv_cache(append_key: ArrayLike, append_value: ArrayLike,
                          append_indptr: ArrayLike, paged_kv_cache: Any, kv_indices: ArrayLike,
                          kv_indptr: ArrayLike, kv_last_page_len: ArrayLike,
                          kv_layout: str = "NHD", *, rope: Optional[RopeOptions] = None,
                          ) -> None:
    """Writes new keys/values into a paged KV cache (FlashInfer 0.1's signature).

    Args:
        append_key, append_value: ``[nnz, num_kv_heads, head_dim]``, ragged by
            ``append_indptr`` ``[batch_size + 1]`` (int32).
        paged_kv_cache: ``(k_cache, v_cache)`` or one ``[num_pages, 2, ...]`` tensor (NHD or
            HND, see :class:`tessera.BatchPrefillWithPagedKVCacheWrapper`). fp16/bf16/fp32 or
            fp8 (values are converted with saturation; scales are the caller's).
        kv_indices, kv_indptr, kv_last_page_len: the CSR page table describing the cache *after*
            the append: request ``b``'s new rows land at its last ``append_len_b`` positions.
        rope: optional :class:`RopeOptions`: keys are rotated by their positions as they are
            written (fused RoPE on k).
    """
    k_new = to_dl(append_key, "append_key")
    v_new = to_dl(append_value, "append_value")
    k_cache, v_cache = split_paged_kv_cache(paged_kv_cache)
    like = append_key
    indptr = to_dl(index_array(append_indptr, "append_indptr", like, k_new), "append_indptr")
    page_indptr = to_dl(index_array(kv_indptr, "kv_indptr", like, k_new), "kv_indptr")
    page_indices = to_dl(index_array(kv_indices, "kv_indices", like, k_new), "kv_indices")
    last = to_dl(index_array(kv_last_page_len, "kv_last_page_len", like, k_new),
                 "kv_last_page_len")
    kv = paged_kv(k_cache, v_cache, page_indptr, page_indices, last, kv_layout_code(kv_layout))
    rope_c = None if rope is None else rope.to_c()
    names = dict(_ROPE_NAMES, k_new="append_key", v_new="append_value", page_indptr="kv_indptr",
                 page_indices="kv_indices", last_page_len="kv_last_page_len")
    check(_capi.lib().tessera_append_paged_kv_cache(
        ref(k_new), ref(v_new), ref(indptr), ctypes.byref(kv),
        None if rope_c is None else ctypes.byref(rope_c),
        stream_arg(stream_of(append_key, k_new))), names)


def block_table_to_csr(block_table: ArrayLike, seq_lens: ArrayLike, page_size: int
                       ) -> Tuple[ArrayLike, ArrayLike, ArrayLike]:
    """vLLM / FlashAttention ``block_table`` ``[batch_size, max_pages]`` int32 + ``seq_lens``
    ``[batch_size]`` int32 -> FlashInfer's CSR page table ``(kv_page_indptr [batch_size + 1],
    kv_page_indices [batch_size * max_pages], kv_last_page_len [batch_size])`` on the same device.
    Only the first ``kv_page_indptr[-1]`` entries of ``kv_page_indices`` are meaningful. A
    request with no token has no page and ``last_page_len`` 0."""
    table_dl = to_dl(block_table, "block_table")
    shape = require_ndim(table_dl, (2,), "block_table", "[batch_size, max_pages] of int32")
    lens = to_dl(index_array(seq_lens, "seq_lens", block_table, table_dl), "seq_lens")
    batch, max_pages = shape
    indptr = empty(block_table, table_dl, (batch + 1,), "int32", "kv_page_indptr")
    indices = empty(block_table, table_dl, (max(batch * max_pages, 1),), "int32",
                    "kv_page_indices")
    last = empty(block_table, table_dl, (batch,), "int32", "kv_last_page_len")
    check(_capi.lib().tessera_block_table_to_csr(
        ref(table_dl), ref(lens), int(page_size), ref(to_dl(indptr, "kv_page_indptr", True)),
        ref(to_dl(indices, "kv_page_indices", True)), ref(to_dl(last, "kv_last_page_len", True)),
        stream_arg(stream_of(block_table, table_dl))))
    return indptr, indices, last


# ---------------------------------------------------------------------------------------------
# Merging attention states


def merge_state(v_a: ArrayLike, s_a: ArrayLike, v_b: ArrayLike, s_b: ArrayLike, *,
                out: Optional[ArrayLike] = None, out_lse: Optional[ArrayLike] = None
                ) -> Tuple[ArrayLike, ArrayLike]:
    """Exact merge of two partial attentions over disjoint key sets (split-KV, shared-prefix
    cascade, context parallelism), FlashInfer's ``merge_state``.

    Args:
        v_a, v_b: ``[N, num_heads, head_dim]`` partial outputs (fp16/bf16/fp32).
        s_a, s_b: ``[N, num_heads]`` float32 log-sum-exp (natural log); ``-inf`` = empty state.
        out, out_lse: optional outputs.

    Returns:
        ``(v, s)``: merged output in v_a's dtype and merged lse.
    """
    a_dl = to_dl(v_a, "v_a")
    shape = require_ndim(a_dl, (3,), "v_a", "[N, num_heads, head_dim]")
    if out is None:
        out = empty(v_a, a_dl, shape)
    if out_lse is None:
        out_lse = empty(v_a, a_dl, shape[:2], "float32", "out_lse")
    names = {"o_a": "v_a", "lse_a": "s_a", "o_b": "v_b", "lse_b": "s_b", "o_out": "out",
             "lse_out": "out_lse"}
    check(_capi.lib().tessera_merge_state(
        ref(a_dl), ref(to_dl(s_a, "s_a")), ref(to_dl(v_b, "v_b")), ref(to_dl(s_b, "s_b")),
        ref(to_dl(out, "out", True)), ref(to_dl(out_lse, "out_lse", True)),
        stream_arg(stream_of(v_a, a_dl))), names)
    return out, out_lse


def merge_states(v: ArrayLike, s: ArrayLike, indptr: Optional[ArrayLike] = None, *,
                 out: Optional[ArrayLike] = None, out_lse: Optional[ArrayLike] = None
                 ) -> Tuple[ArrayLike, ArrayLike]:
    """Merges several partial states per row.

    * FlashInfer form (``indptr=None``): ``v`` ``[N, num_states, num_heads, head_dim]``, ``s``
      ``[N, num_states, num_heads]`` -> ``[N, num_heads, head_dim]``, ``[N, num_heads]``.
    * Variable-length form: ``v`` ``[S, num_heads, head_dim]``, ``s`` ``[S, num_heads]`` and
      int32 ``indptr`` ``[N + 1]``: row ``n`` merges states ``indptr[n] .. indptr[n+1]-1``; a row
      with no state gives ``o = 0``, ``lse = -inf``.

    Returns:
        ``(v_merged, s_merged)``.
    """
    v_dl = to_dl(v, "v")
    s_dl = to_dl(s, "s")
    if indptr is None:
        shape = require_ndim(v_dl, (4,), "v", "[N, num_states, num_heads, head_dim] (or pass "
                                              "indptr with [S, num_heads, head_dim])")
        rows, states = shape[0], shape[1]
        v3 = merge_leading(v_dl)
        s2 = merge_leading(s_dl) if s_dl.ndim == 3 else None
        if v3 is None:
            v3 = to_dl(v.reshape(rows * states, shape[2], shape[3]), "v")
        if s2 is None:
            require_ndim(s_dl, (3,), "s", "[N, num_states, num_heads]")
            s2 = to_dl(s.reshape(rows * states, shape[2]), "s")
        indptr = from_numpy(arange_int32(rows + 1, states), v, v_dl)
        out_shape = (rows, shape[2], shape[3])
    else:
        shape = require_ndim(v_dl, (3,), "v", "[S, num_heads, head_dim]")
        v3, s2 = v_dl, s_dl
        indptr = index_array(indptr, "indptr", v, v_dl)
        rows = shape_of(to_dl(indptr, "indptr"))[0] - 1
        out_shape = (rows, shape[1], shape[2])
    if out is None:
        out = empty(v, v_dl, out_shape)
    if out_lse is None:
        out_lse = empty(v, v_dl, out_shape[:2], "float32", "out_lse")
    names = {"states": "v", "lse": "s", "o_out": "out", "lse_out": "out_lse"}
    check(_capi.lib().tessera_merge_states(
        ref(v3), ref(s2), ref(to_dl(indptr, "indptr")), ref(to_dl(out, "out", True)),
        ref(to_dl(out_lse, "out_lse", True)), stream_arg(stream_of(v, v_dl))), names)
    return out, out_lse
