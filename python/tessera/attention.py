"""FlashAttention-style one-shot attention: :func:`varlen_attention` (``flash_attn_varlen_func``)
and :func:`attention_with_kvcache` (``flash_attn_with_kvcache`` over a paged or dense KV cache).

Both take arrays of any framework (numpy, torch, cupy, jax, ... through DLPack), allocate their
outputs with the framework of ``q`` unless ``out=`` is given, and run on the device of ``q`` on
the framework's current CUDA stream. Differences from FlashAttention worth knowing:

* ``lse`` is ``[total_q, num_heads]`` float32 (natural log), FlashInfer's layout; FlashAttention
  returns ``[num_heads, total_q]`` (use ``lse.T``).
* The index arrays are read on the host to plan the work: with CUDA index arrays each call
  synchronises the stream once. Pass host index arrays (numpy, lists or CPU tensors) with CUDA
  ``q``/``k``/``v`` to skip that synchronisation, or use the plan/run wrappers of
  :mod:`tessera.wrappers` on a serving hot path (and for CUDA graphs).
* Causal masks are aligned bottom-right (FlashAttention >= 2.1): query ``i`` of a request with
  ``q_len`` queries and ``kv_len`` keys sees key ``j`` iff ``j <= i + kv_len - q_len``.
* A query row that sees no key gives ``o = 0`` and ``lse = -inf`` (never NaN).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import ctypes

import numpy as np

from . import _capi
from ._capi import Plan, check, kDLCUDA
from ._common import (
    arange_int32,
    attention_options,
    kv_layout_code,
    paged_kv,
    require_ndim,
    stream_arg,
    window_pair,
)
from ._dlpack import (
    device_of,
    empty,
    framework,
    from_numpy,
    index_array,
    merge_leading,
    ref,
    stream_of,
    to_dl,
    to_host_int32,
)

__all__ = ["varlen_attention", "attention_with_kvcache", "paged_attention"]

ArrayLike = Any

_OPTION_NAMES = {
    "options.window_left": "window_size",
    "options.window_right": "window_size",
    "options.logits_soft_cap": "softcap",
    "options.sm_scale": "softmax_scale",
    "options.k_scale": "k_scale",
    "options.v_scale": "v_scale",
    "o": "out",
}
_VARLEN_NAMES = dict(_OPTION_NAMES, qo_indptr="cu_seqlens_q", kv_indptr="cu_seqlens_k",
                     qo_indptr_host="cu_seqlens_q", kv_indptr_host="cu_seqlens_k")
_KVCACHE_NAMES = dict(_OPTION_NAMES, seq_lens="cache_seqlens", page_indptr="kv_page_indptr",
                      page_indices="kv_page_indices", last_page_len="kv_last_page_len",
                      k_new="k", v_new="v", append_indptr="k")
_FA_NAMES = ("window_size", "softcap", "softmax_scale", "k_scale")


def _is_host(obj: Any) -> bool:
    """Whether an index array lives in host memory (so plan() can read it without a sync)."""
    if isinstance(obj, (list, tuple, range, np.ndarray)):
        return True
    if framework(obj) == "torch":
        return obj.device.type == "cpu"
    return False


def _lse_output(q: Any, q_dl: Any, rows_shape: Tuple[int, ...], lse: Any, wanted: bool):
    if not wanted and lse is None:
        return None, None
    if lse is None:
        lse = empty(q, q_dl, rows_shape, "float32", "lse")
    return lse, to_dl(lse, "lse", writable=True)


def varlen_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    *,
    out: Optional[ArrayLike] = None,
    lse: Optional[ArrayLike] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: Optional[ArrayLike] = None,
) -> Union[ArrayLike, Tuple[ArrayLike, ArrayLike]]:
    """Attention over a ragged (varlen) batch, like FlashAttention's ``flash_attn_varlen_func``.

    Args:
        q: ``[total_q, num_heads, head_dim]`` fp16/bf16 (fp32 too on the CPU).
        k, v: ``[total_k, num_kv_heads, head_dim]``, q's dtype (or an fp8 e4m3/e5m2 KV with
            ``k_scale``/``v_scale``); v's head_dim (head_dim_vo) may differ from q's and k's
            (e.g. 192 / 128; CPU only for now), and o then has v's. ``num_heads`` must be a multiple of ``num_kv_heads``
            (GQA/MQA). Token and head strides are honoured (views of a fused QKV buffer need no
            copy); the last dimension must be contiguous.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch_size + 1]`` cumulative lengths starting at 0.
        max_seqlen_q, max_seqlen_k: accepted for FlashAttention compatibility; not needed.
        softmax_scale: scale of ``q @ k^T``; None = ``1 / sqrt(head_dim)``.
        causal: causal mask aligned bottom-right.
        window_size: ``(left, right)`` sliding window, -1 = unbounded.
        softcap: logits soft-cap ``softcap * tanh(s / softcap)``; 0 = off.
        return_lse: also return the log-sum-exp ``[total_q, num_heads]`` float32.
        out, lse: optional preallocated outputs.
        sinks: optional attention sinks, float32 ``[num_heads]`` on q's device: one logit per
            query head, in the units of the scaled (and soft-capped) scores, that joins every
            row's softmax denominator and has no value row (gpt-oss's ``s_aux``, FA4's
            ``learnable_sink``). A row without keys then gets o = 0, lse = the sink.

    Returns:
        ``o`` ``[total_q, num_heads, head_dim_vo]`` in q's dtype, or ``(o, lse)``.

    Raises:
        ValueError: a bad argument (the message names it), or a request this build or device
            cannot serve (:class:`tessera.UnsupportedError`).
        RuntimeError: a failure while running.
    """
    del max_seqlen_q, max_seqlen_k
    q_dl = to_dl(q, "q")
    q_shape = require_ndim(q_dl, (3,), "q", "[total_q, num_heads, head_dim]")
    k_dl = to_dl(k, "k")
    v_dl = to_dl(v, "v")
    k_shape = require_ndim(k_dl, (3,), "k", "[total_k, num_kv_heads, head_dim]")
    v_shape = require_ndim(v_dl, (3,), "v", "[total_k, num_kv_heads, head_dim_vo]")
    left, right = window_pair(window_size)
    options = attention_options(causal, left, right, softcap, softmax_scale, k_scale, v_scale,
                                names=_FA_NAMES)
    # o has v's width (head_dim_vo, which may differ from q's where k's matches q's).
    head_dim_vo = v_shape[2] if k_shape[2] == q_shape[2] else q_shape[2]
    if out is None:
        out = empty(q, q_dl, (q_shape[0], q_shape[1], head_dim_vo))
    o_dl = to_dl(out, "out", writable=True)
    lse, lse_dl = _lse_output(q, q_dl, q_shape[:2], lse, return_lse)
    stream = stream_arg(stream_of(q, q_dl))
    library = _capi.lib()
    run = _capi.run_options(None if sinks is None else to_dl(sinks, "sinks"))
    device_type, device_id = device_of(q_dl)
    if device_type == kDLCUDA and _is_host(cu_seqlens_q) and _is_host(cu_seqlens_k):
        # Plan from the host copies and run: no device-to-host read, no synchronisation.
        qo_host = to_host_int32(cu_seqlens_q, "cu_seqlens_q")
        kv_host = to_host_int32(cu_seqlens_k, "cu_seqlens_k")
        if qo_host.ndim != 1 or qo_host.size < 1:
            raise ValueError("'cu_seqlens_q': expected a 1-D array of batch_size + 1 values")
        if kv_host.shape != qo_host.shape:
            raise ValueError(f"'cu_seqlens_k': expected {qo_host.size} values like cu_seqlens_q, "
                             f"got shape {list(kv_host.shape)}")
        handle = ctypes.c_void_p()
        i32p = ctypes.POINTER(ctypes.c_int32)
        extra = _capi.plan_options(0 if head_dim_vo == q_shape[2] else head_dim_vo)
        check(library.tessera_plan_ragged_prefill_v2(
            qo_host.ctypes.data_as(i32p), kv_host.ctypes.data_as(i32p), qo_host.size - 1,
            q_shape[1], k_shape[1], q_shape[2], ctypes.byref(options), ctypes.byref(extra),
            device_type, device_id, ctypes.byref(handle)), _VARLEN_NAMES)
        plan = Plan(handle)
        workspace = empty(q, q_dl, (max(plan.workspace_bytes, 1),), "uint8", "workspace")
        workspace_dl = to_dl(workspace, "workspace", writable=True)
        qo_dl = to_dl(from_numpy(qo_host, q, q_dl), "cu_seqlens_q")
        kv_dl = to_dl(from_numpy(kv_host, q, q_dl), "cu_seqlens_k")
        check(library.tessera_run_ragged_prefill_v2(
            plan.handle, ref(q_dl), ref(k_dl), ref(v_dl), ref(qo_dl), ref(kv_dl), ref(o_dl),
            ref(lse_dl), workspace_dl.data + workspace_dl.byte_offset, plan.workspace_bytes,
            stream, ctypes.byref(run)), _VARLEN_NAMES)
    else:
        qo_dl = to_dl(index_array(cu_seqlens_q, "cu_seqlens_q", q, q_dl), "cu_seqlens_q")
        kv_dl = to_dl(index_array(cu_seqlens_k, "cu_seqlens_k", q, q_dl), "cu_seqlens_k")
        check(library.tessera_ragged_prefill_v2(
            ref(q_dl), ref(k_dl), ref(v_dl), ref(qo_dl), ref(kv_dl), ref(o_dl), ref(lse_dl),
            ctypes.byref(options), stream, ctypes.byref(run)), _VARLEN_NAMES)
    return (out, lse) if return_lse else out


def attention_with_kvcache(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    k: Optional[ArrayLike] = None,
    v: Optional[ArrayLike] = None,
    cache_seqlens: Optional[Union[ArrayLike, int]] = None,
    block_table: Optional[ArrayLike] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    *,
    kv_page_indptr: Optional[ArrayLike] = None,
    kv_page_indices: Optional[ArrayLike] = None,
    kv_last_page_len: Optional[ArrayLike] = None,
    kv_layout: str = "NHD",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: Optional[ArrayLike] = None,
    lse: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
) -> Union[ArrayLike, Tuple[ArrayLike, ArrayLike]]:
    """Attention of new queries against a KV cache, like FlashAttention's
    ``flash_attn_with_kvcache``: decode (1 query per request), speculative decoding (a few) or
    chunked prefill (many).

    Args:
        q: ``[batch_size, seqlen_q, num_heads, head_dim]``, or ``[batch_size, num_heads,
            head_dim]`` for one query per request.
        k_cache, v_cache: the cache, in one of three forms:

            * paged with ``block_table`` ``[batch_size, max_pages]`` int32 (vLLM / FA):
              ``[num_pages, page_size, num_kv_heads, head_dim]`` (``kv_layout="NHD"``) or
              ``[num_pages, num_kv_heads, page_size, head_dim]`` (``"HND"``);
            * paged with a CSR page table (FlashInfer): ``kv_page_indptr`` ``[batch_size+1]``,
              ``kv_page_indices``, ``kv_last_page_len`` ``[batch_size]`` (all int32), which
              describe the cache *after* the append of ``k``/``v``;
            * dense (no page table): ``[batch_size, seqlen_cache, num_kv_heads, head_dim]`` (NHD)
              or ``[batch_size, num_kv_heads, seqlen_cache, head_dim]`` (HND, the Hugging Face
              cache layout).
        k, v: optional new keys/values ``[batch_size, seqlen_new, num_kv_heads, head_dim]``
            written into the cache at positions ``cache_seqlens[b] ...`` before the attention
            (FlashAttention semantics).
        cache_seqlens: int32 ``[batch_size]`` (or an int) tokens in the cache *before* the
            append; None = the whole cache (``max_pages * page_size`` or ``seqlen_cache``).
        block_table: int32 ``[batch_size, max_pages]``.
        softmax_scale, causal, window_size, softcap: as in :func:`varlen_attention`.
        return_lse: also return ``lse`` ``[batch_size, seqlen_q, num_heads]`` float32.
        k_scale, v_scale: dequantisation scales of an fp8 cache.
        out, lse: optional preallocated outputs (q's shape; q's shape without head_dim).
        sinks: optional attention sinks, float32 ``[num_heads]`` on q's device (see
            :func:`varlen_attention`).

    Returns:
        ``o`` with q's shape and dtype, or ``(o, lse)``.
    """
    q_dl = to_dl(q, "q")
    q_shape = require_ndim(q_dl, (3, 4), "q",
                           "[batch_size, seqlen_q, num_heads, head_dim] or [batch_size, num_heads, "
                           "head_dim]")
    if len(q_shape) == 3:
        batch, seqlen_q = q_shape[0], 1
        q3 = q_dl
    else:
        batch, seqlen_q = q_shape[0], q_shape[1]
        q3 = merge_leading(q_dl)
        if q3 is None:
            q3 = to_dl(q.reshape(batch * seqlen_q, q_shape[2], q_shape[3]), "q")
    layout = kv_layout_code(kv_layout)
    appending = k is not None or v is not None
    if appending and (k is None or v is None):
        raise ValueError("'k': k and v must be given together")
    k_cache_dl = to_dl(k_cache, "k_cache", writable=appending)
    v_cache_dl = to_dl(v_cache, "v_cache", writable=appending)
    left, right = window_pair(window_size)
    options = attention_options(causal, left, right, softcap, softmax_scale, k_scale, v_scale,
                                names=_FA_NAMES)
    stream = stream_arg(stream_of(q, q_dl))
    library = _capi.lib()
    run = _capi.run_options(None if sinks is None else to_dl(sinks, "sinks"))

    seqlen_new = 0
    if appending:
        k_new = to_dl(k, "k")
        v_new = to_dl(v, "v")
        k_shape = require_ndim(k_new, (3, 4), "k",
                               "[batch_size, seqlen_new, num_kv_heads, head_dim]")
        seqlen_new = 1 if len(k_shape) == 3 else k_shape[1]
        if len(k_shape) == 4:
            merged_k, merged_v = merge_leading(k_new), merge_leading(v_new)
            k_new = merged_k if merged_k is not None else to_dl(
                k.reshape(batch * seqlen_new, k_shape[2], k_shape[3]), "k")
            v_shape = require_ndim(v_new, (4,), "v", "k's shape")
            v_new = merged_v if merged_v is not None else to_dl(
                v.reshape(batch * seqlen_new, v_shape[2], v_shape[3]), "v")

    csr = (kv_page_indptr, kv_page_indices, kv_last_page_len)
    if any(x is not None for x in csr):
        if any(x is None for x in csr):
            raise ValueError("'kv_page_indptr': kv_page_indptr, kv_page_indices and "
                             "kv_last_page_len must be given together")
        if block_table is not None or cache_seqlens is not None:
            raise ValueError("'block_table': pass either block_table/cache_seqlens or the CSR "
                             "page table (kv_page_indptr, ...), not both")
        indptr_dl = to_dl(index_array(kv_page_indptr, "kv_page_indptr", q, q_dl), "kv_page_indptr")
        indices_dl = to_dl(index_array(kv_page_indices, "kv_page_indices", q, q_dl),
                           "kv_page_indices")
        last_dl = to_dl(index_array(kv_last_page_len, "kv_last_page_len", q, q_dl),
                        "kv_last_page_len")
    else:
        cache_shape = require_ndim(k_cache_dl, (4,), "k_cache",
                                   "a 4-D cache [pages_or_batch, page_size, num_kv_heads, "
                                   "head_dim] (NHD) or [.., num_kv_heads, page_size, ..] (HND)")
        page_size = cache_shape[1] if layout == _capi.TESSERA_KV_LAYOUT_NHD else cache_shape[2]
        if block_table is None:
            if cache_shape[0] != batch:
                raise ValueError(
                    f"'k_cache': a dense cache (no block_table) must have batch_size = {batch} "
                    f"rows in dim 0, got shape {list(cache_shape)}")
            table = from_numpy(np.arange(batch, dtype=np.int32).reshape(batch, 1), q, q_dl)
            max_pages = 1
        else:
            table = index_array(block_table, "block_table", q, q_dl)
        table_dl = to_dl(table, "block_table")
        if block_table is not None:
            table_shape = require_ndim(table_dl, (2,), "block_table",
                                       "[batch_size, max_pages] of int32")
            if table_shape[0] != batch:
                raise ValueError(f"'block_table': expected batch_size = {batch} rows (q's batch), "
                                 f"got shape {list(table_shape)}")
            max_pages = table_shape[1]
        if cache_seqlens is None:
            if appending:
                raise ValueError("'cache_seqlens': required when new k/v are appended")
            seqlens: Any = from_numpy(np.full(batch, max_pages * page_size, np.int32), q, q_dl)
        elif isinstance(cache_seqlens, (int, np.integer)):
            seqlens = from_numpy(np.full(batch, int(cache_seqlens) + seqlen_new, np.int32), q, q_dl)
        else:
            seqlens = index_array(cache_seqlens, "cache_seqlens", q, q_dl)
            if seqlen_new:
                seqlens = seqlens + seqlen_new
        seqlens_dl = to_dl(seqlens, "cache_seqlens")
        page_indptr = empty(q, q_dl, (batch + 1,), "int32", "kv_page_indptr")
        page_indices = empty(q, q_dl, (max(batch * max_pages, 1),), "int32", "kv_page_indices")
        last_page_len = empty(q, q_dl, (batch,), "int32", "kv_last_page_len")
        indptr_dl = to_dl(page_indptr, "kv_page_indptr", writable=True)
        indices_dl = to_dl(page_indices, "kv_page_indices", writable=True)
        last_dl = to_dl(last_page_len, "kv_last_page_len", writable=True)
        check(library.tessera_block_table_to_csr(
            ref(table_dl), ref(seqlens_dl), page_size, ref(indptr_dl), ref(indices_dl),
            ref(last_dl), stream), _KVCACHE_NAMES)

    kv = paged_kv(k_cache_dl, v_cache_dl, indptr_dl, indices_dl, last_dl, layout)
    if appending:
        append_indptr = to_dl(from_numpy(arange_int32(batch + 1, seqlen_new), q, q_dl), "k")
        check(library.tessera_append_paged_kv_cache(
            ref(k_new), ref(v_new), ref(append_indptr), ctypes.byref(kv), None, stream),
            _KVCACHE_NAMES)

    if out is None:
        out = empty(q, q_dl, q_shape)
    o_dl = to_dl(out, "out", writable=True)
    o3 = o_dl if len(q_shape) == 3 else merge_leading(o_dl)
    if o3 is None:
        raise ValueError("'out': its first two dimensions cannot be merged without a copy")
    lse, lse_dl = _lse_output(q, q_dl, q_shape[:-1], lse, return_lse)
    lse2 = lse_dl
    if lse_dl is not None and len(q_shape) == 4:
        lse2 = merge_leading(lse_dl)
        if lse2 is None:
            raise ValueError("'lse': its first two dimensions cannot be merged without a copy")

    if seqlen_q <= 64:
        check(library.tessera_decode_v2(ref(q3), ctypes.byref(kv), ref(o3), ref(lse2),
                                        ctypes.byref(options), stream, ctypes.byref(run)),
              _KVCACHE_NAMES)
    else:
        qo_indptr = to_dl(from_numpy(arange_int32(batch + 1, seqlen_q), q, q_dl), "q")
        check(library.tessera_paged_prefill_v2(ref(q3), ctypes.byref(kv), ref(qo_indptr),
                                               ref(o3), ref(lse2), ctypes.byref(options), stream,
                                               ctypes.byref(run)), _KVCACHE_NAMES)
    return (out, lse) if return_lse else out


def paged_attention(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    kv_page_indptr: ArrayLike,
    kv_page_indices: ArrayLike,
    kv_last_page_len: ArrayLike,
    qo_indptr: Optional[ArrayLike] = None,
    *,
    kv_layout: str = "NHD",
    sm_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    logits_soft_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    return_lse: bool = False,
    out: Optional[ArrayLike] = None,
    lse: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
) -> Union[ArrayLike, Tuple[ArrayLike, ArrayLike]]:
    """One-shot attention over a paged KV cache with FlashInfer's CSR page table (plan + run
    in one call; the index arrays are read on the host).

    Args:
        q: ``[total_q, num_qo_heads, head_dim]``: ragged by ``qo_indptr`` ``[batch_size + 1]``
            (paged prefill), or, with ``qo_indptr=None``, ``batch_size * q_per_request`` rows
            with the same number of queries per request (decode).
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
            ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND).
        kv_page_indptr, kv_page_indices, kv_last_page_len: the CSR page table (int32).
        sm_scale, causal, window_left, window_right, logits_soft_cap, k_scale, v_scale: options
            (see :func:`varlen_attention`).
        sinks: optional attention sinks, float32 ``[num_qo_heads]`` on q's device (see
            :func:`varlen_attention`).

    Returns:
        ``o`` ``[total_q, num_qo_heads, head_dim]`` or ``(o, lse)``.
    """
    q_dl = to_dl(q, "q")
    q_shape = require_ndim(q_dl, (3,), "q", "[total_q, num_qo_heads, head_dim]")
    layout = kv_layout_code(kv_layout)
    options = attention_options(causal, window_left, window_right, logits_soft_cap, sm_scale,
                                k_scale, v_scale)
    kv = paged_kv(
        to_dl(k_cache, "k_cache"), to_dl(v_cache, "v_cache"),
        to_dl(index_array(kv_page_indptr, "kv_page_indptr", q, q_dl), "kv_page_indptr"),
        to_dl(index_array(kv_page_indices, "kv_page_indices", q, q_dl), "kv_page_indices"),
        to_dl(index_array(kv_last_page_len, "kv_last_page_len", q, q_dl), "kv_last_page_len"),
        layout)
    if out is None:
        out = empty(q, q_dl, q_shape)
    o_dl = to_dl(out, "out", writable=True)
    lse, lse_dl = _lse_output(q, q_dl, q_shape[:2], lse, return_lse)
    stream = stream_arg(stream_of(q, q_dl))
    names = {"page_indptr": "kv_page_indptr", "page_indices": "kv_page_indices",
             "last_page_len": "kv_last_page_len", "o": "out", "options.sm_scale": "sm_scale",
             "options.logits_soft_cap": "logits_soft_cap", "options.window_left": "window_left",
             "options.window_right": "window_right"}
    library = _capi.lib()
    run = _capi.run_options(None if sinks is None else to_dl(sinks, "sinks"))
    if qo_indptr is None:
        check(library.tessera_decode_v2(ref(q_dl), ctypes.byref(kv), ref(o_dl), ref(lse_dl),
                                        ctypes.byref(options), stream, ctypes.byref(run)), names)
    else:
        qo_dl = to_dl(index_array(qo_indptr, "qo_indptr", q, q_dl), "qo_indptr")
        check(library.tessera_paged_prefill_v2(ref(q_dl), ctypes.byref(kv), ref(qo_dl),
                                               ref(o_dl), ref(lse_dl), ctypes.byref(options),
                                               stream, ctypes.byref(run)), names)
    return (out, lse) if return_lse else out
