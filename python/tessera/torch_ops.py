"""PyTorch custom ops over Tessera (``torch.ops.tessera.*``), traceable by torch.compile.

Importing this module registers the ops with ``torch.library.custom_op`` (PyTorch >= 2.4) and
``register_fake`` shape/dtype functions, so ``torch.compile(fullgraph=True)`` traces calls to
them without graph breaks. The functions below call the ops with FlashAttention/FlashInfer-style
signatures and accept torch tensors on the CPU or a CUDA device (the ops run on the current
CUDA stream).

Ops (all outputs are new tensors unless the op is marked mutating):

* ``tessera::varlen_attention`` -> (o, lse)
* ``tessera::paged_attention`` -> (o, lse)             (CSR page table, decode or paged prefill)
* ``tessera::attention_with_kvcache`` -> (o, lse)      (block_table + cache_seqlens, or dense)
* ``tessera::append_paged_kv_cache``                   (mutates k_cache, v_cache)
* ``tessera::apply_rope_pos_ids_inplace``              (mutates q, k)
* ``tessera::merge_state`` -> (o, lse)
* ``tessera::merge_states`` -> (o, lse)                (variable-length, indptr)
* ``tessera::block_table_to_csr`` -> (indptr, indices, last_page_len)

The one-shot attention ops read their index arrays on the host, so with CUDA index arrays they
synchronise the stream and cannot be captured in a CUDA graph (torch.compile's
``mode="reduce-overhead"``); the FlashInfer-style wrappers of :mod:`tessera.wrappers` are the
graph-safe path.
"""

from typing import List, Optional, Tuple

try:
    import torch
    from torch import Tensor
except ImportError as error:  # the rest of the package works without torch
    raise ImportError("tessera.torch_ops needs PyTorch (pip install 'torch>=2.4')") from error

if not hasattr(torch.library, "custom_op") or not hasattr(torch.library, "register_fake"):
    raise ImportError(
        f"tessera.torch_ops needs PyTorch >= 2.4 (torch.library.custom_op); found {torch.__version__}")

from . import attention as _attention
from . import ops as _ops

__all__ = [
    "varlen_attention",
    "paged_attention",
    "attention_with_kvcache",
    "append_paged_kv_cache",
    "apply_rope_pos_ids_inplace",
    "merge_state",
    "merge_states",
    "block_table_to_csr",
]


def _scale_or_none(value: float) -> Optional[float]:
    return value if value > 0.0 else None


def _lse_like(q: Tensor, rows_shape: List[int]) -> Tensor:
    return q.new_empty(rows_shape, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# varlen


@torch.library.custom_op("tessera::varlen_attention", mutates_args=())
def _varlen_attention_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, softmax_scale: float, causal: bool,
                         window_left: int, window_right: int, softcap: float, k_scale: float,
                         v_scale: float, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    o, lse = _attention.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=_scale_or_none(softmax_scale),
        causal=causal, window_size=(window_left, window_right), softcap=softcap,
        return_lse=True, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    return o, lse


@_varlen_attention_op.register_fake
def _varlen_attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                           window_left, window_right, softcap, k_scale, v_scale, sinks=None):
    return q.new_empty(q.shape), _lse_like(q, [q.shape[0], q.shape[1]])


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     softmax_scale: Optional[float] = None, causal: bool = False,
                     window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     return_lse: bool = False, *, k_scale: float = 1.0, v_scale: float = 1.0,
                     sinks: Optional[Tensor] = None):
    """:func:`tessera.varlen_attention` as a torch custom op (torch.compile safe).
    ``q`` ``[total_q, H, D]``, ``k``/``v`` ``[total_k, H_kv, D]``, int32 ``cu_seqlens``;
    ``sinks`` optional float32 ``[H]`` attention sinks."""
    o, lse = torch.ops.tessera.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, 0.0 if softmax_scale is None else softmax_scale,
        causal, window_size[0], window_size[1], softcap, k_scale, v_scale, sinks)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------
# paged (CSR)


@torch.library.custom_op("tessera::paged_attention", mutates_args=())
def _paged_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_page_indptr: Tensor,
                        kv_page_indices: Tensor, kv_last_page_len: Tensor,
                        qo_indptr: Optional[Tensor], kv_layout: str, sm_scale: float,
                        causal: bool, window_left: int, window_right: int,
                        logits_soft_cap: float, k_scale: float, v_scale: float,
                        sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    o, lse = _attention.paged_attention(
        q, k_cache, v_cache, kv_page_indptr, kv_page_indices, kv_last_page_len, qo_indptr,
        kv_layout=kv_layout, sm_scale=_scale_or_none(sm_scale), causal=causal,
        window_left=window_left, window_right=window_right, logits_soft_cap=logits_soft_cap,
        k_scale=k_scale, v_scale=v_scale, return_lse=True, sinks=sinks)
    return o, lse


@_paged_attention_op.register_fake
def _paged_attention_fake(q, k_cache, v_cache, kv_page_indptr, kv_page_indices,
                          kv_last_page_len, qo_indptr, kv_layout, sm_scale, causal, window_left,
                          window_right, logits_soft_cap, k_scale, v_scale, sinks=None):
    return q.new_empty(q.shape), _lse_like(q, [q.shape[0], q.shape[1]])


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_page_indptr: Tensor,
                    kv_page_indices: Tensor, kv_last_page_len: Tensor,
                    qo_indptr: Optional[Tensor] = None, *, kv_layout: str = "NHD",
                    sm_scale: Optional[float] = None, causal: bool = False,
                    window_left: int = -1, window_right: int = -1, logits_soft_cap: float = 0.0,
                    k_scale: float = 1.0, v_scale: float = 1.0, return_lse: bool = False,
                    sinks: Optional[Tensor] = None):
    """:func:`tessera.paged_attention` as a torch custom op; ``sinks`` optional float32
    ``[H]`` attention sinks."""
    o, lse = torch.ops.tessera.paged_attention(
        q, k_cache, v_cache, kv_page_indptr, kv_page_indices, kv_last_page_len, qo_indptr,
        kv_layout, 0.0 if sm_scale is None else sm_scale, causal, window_left, window_right,
        logits_soft_cap, k_scale, v_scale, sinks)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------
# FlashAttention's flash_attn_with_kvcache (no append: use append_paged_kv_cache first)


@torch.library.custom_op("tessera::attention_with_kvcache", mutates_args=())
def _attention_with_kvcache_op(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                               cache_seqlens: Optional[Tensor], block_table: Optional[Tensor],
                               kv_layout: str, softmax_scale: float, causal: bool,
                               window_left: int, window_right: int, softcap: float,
                               k_scale: float, v_scale: float, sinks: Optional[Tensor] = None
                               ) -> Tuple[Tensor, Tensor]:
    o, lse = _attention.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
        softmax_scale=_scale_or_none(softmax_scale), causal=causal,
        window_size=(window_left, window_right), softcap=softcap, return_lse=True,
        kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    return o, lse


@_attention_with_kvcache_op.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, cache_seqlens, block_table, kv_layout,
                                 softmax_scale, causal, window_left, window_right, softcap,
                                 k_scale, v_scale, sinks=None):
    return q.new_empty(q.shape), _lse_like(q, list(q.shape[:-1]))


def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                           cache_seqlens: Optional[Tensor] = None,
                           block_table: Optional[Tensor] = None,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           return_lse: bool = False, *, kv_layout: str = "NHD",
                           k_scale: float = 1.0, v_scale: float = 1.0,
                           sinks: Optional[Tensor] = None):
    """:func:`tessera.attention_with_kvcache` (without the append of new k/v) as a custom op.
    ``cache_seqlens`` must be a tensor (or None); ``sinks`` optional float32 ``[H]`` attention
    sinks."""
    o, lse = torch.ops.tessera.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, block_table, kv_layout,
        0.0 if softmax_scale is None else softmax_scale, causal, window_size[0], window_size[1],
        softcap, k_scale, v_scale, sinks)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------
# mutating ops


@torch.library.custom_op("tessera::append_paged_kv_cache", mutates_args=("k_cache", "v_cache"))
def _append_paged_kv_cache_op(append_key: Tensor, append_value: Tensor, append_indptr: Tensor,
                              k_cache: Tensor, v_cache: Tensor, kv_indices: Tensor,
                              kv_indptr: Tensor, kv_last_page_len: Tensor, kv_layout: str
                              ) -> None:
    _ops.append_paged_kv_cache(append_key, append_value, append_indptr, (k_cache, v_cache),
                               kv_indices, kv_indptr, kv_last_page_len, kv_layout)


@_append_paged_kv_cache_op.register_fake
def _append_paged_kv_cache_fake(append_key, append_value, append_indptr, k_cache, v_cache,
                                kv_indices, kv_indptr, kv_last_page_len, kv_layout):
    return None


def append_paged_kv_cache(append_key: Tensor, append_value: Tensor, append_indptr: Tensor,
                          paged_kv_cache, kv_indices: Tensor, kv_indptr: Tensor,
                          kv_last_page_len: Tensor, kv_layout: str = "NHD") -> None:
    """:func:`tessera.append_paged_kv_cache` as a custom op (``paged_kv_cache`` is a
    ``(k_cache, v_cache)`` pair or one ``[num_pages, 2, ...]`` tensor)."""
    if isinstance(paged_kv_cache, (tuple, list)):
        k_cache, v_cache = paged_kv_cache
    else:
        k_cache, v_cache = paged_kv_cache.select(1, 0), paged_kv_cache.select(1, 1)
    torch.ops.tessera.append_paged_kv_cache(append_key, append_value, append_indptr, k_cache,
                                            v_cache, kv_indices, kv_indptr, kv_last_page_len,
                                            kv_layout)


@torch.library.custom_op("tessera::apply_rope_pos_ids_inplace", mutates_args=("q", "k"))
def _apply_rope_pos_ids_inplace_op(q: Tensor, k: Tensor, pos_ids: Tensor, rotary_dim: int,
                                   interleave: bool, rope_scale: float, rope_theta: float,
                                   llama31: bool, llama31_factor: float, low_freq_factor: float,
                                   high_freq_factor: float, old_context_len: int) -> None:
    options = _ops.RopeOptions(rotary_dim if rotary_dim > 0 else None, interleave, rope_theta,
                               rope_scale, llama31, llama31_factor, low_freq_factor,
                               high_freq_factor, old_context_len)
    _ops._rope(q, k, pos_ids, None, None, options)


@_apply_rope_pos_ids_inplace_op.register_fake
def _apply_rope_pos_ids_inplace_fake(q, k, pos_ids, rotary_dim, interleave, rope_scale,
                                     rope_theta, llama31, llama31_factor, low_freq_factor,
                                     high_freq_factor, old_context_len):
    return None


def apply_rope_pos_ids_inplace(q: Tensor, k: Tensor, pos_ids: Tensor,
                               rotary_dim: Optional[int] = None, interleave: bool = False,
                               rope_scale: float = 1.0, rope_theta: float = 1e4) -> None:
    """:func:`tessera.apply_rope_pos_ids_inplace` as a custom op (q and k both required)."""
    torch.ops.tessera.apply_rope_pos_ids_inplace(
        q, k, pos_ids, 0 if rotary_dim is None else rotary_dim, interleave, rope_scale,
        rope_theta, False, 8.0, 1.0, 4.0, 8192)


def apply_llama31_rope_pos_ids_inplace(q: Tensor, k: Tensor, pos_ids: Tensor,
                                       rotary_dim: Optional[int] = None, interleave: bool = False,
                                       rope_scale: float = 8.0, rope_theta: float = 5e5,
                                       low_freq_factor: float = 1.0,
                                       high_freq_factor: float = 4.0,
                                       old_context_len: int = 8192) -> None:
    """:func:`tessera.apply_llama31_rope_pos_ids_inplace` as a custom op."""
    torch.ops.tessera.apply_rope_pos_ids_inplace(
        q, k, pos_ids, 0 if rotary_dim is None else rotary_dim, interleave, 1.0, rope_theta, True,
        rope_scale, low_freq_factor, high_freq_factor, old_context_len)


# ---------------------------------------------------------------------------------------------
# merge and block table


@torch.library.custom_op("tessera::merge_state", mutates_args=())
def _merge_state_op(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor
                    ) -> Tuple[Tensor, Tensor]:
    o, lse = _ops.merge_state(v_a, s_a, v_b, s_b)
    return o, lse


@_merge_state_op.register_fake
def _merge_state_fake(v_a, s_a, v_b, s_b):
    return v_a.new_empty(v_a.shape), _lse_like(v_a, [v_a.shape[0], v_a.shape[1]])


def merge_state(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`tessera.merge_state` as a custom op."""
    return torch.ops.tessera.merge_state(v_a, s_a, v_b, s_b)


@torch.library.custom_op("tessera::merge_states", mutates_args=())
def _merge_states_op(v: Tensor, s: Tensor, indptr: Tensor) -> Tuple[Tensor, Tensor]:
    o, lse = _ops.merge_states(v, s, indptr)
    return o, lse


@_merge_states_op.register_fake
def _merge_states_fake(v, s, indptr):
    rows = indptr.shape[0] - 1
    return v.new_empty((rows, v.shape[1], v.shape[2])), _lse_like(v, [rows, v.shape[1]])


def merge_states(v: Tensor, s: Tensor, indptr: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """:func:`tessera.merge_states` as a custom op. Without ``indptr``, ``v`` is FlashInfer's
    ``[N, num_states, H, D]`` and ``s`` ``[N, num_states, H]``."""
    if indptr is None:
        rows, states = v.shape[0], v.shape[1]
        indptr = torch.arange(0, (rows + 1) * states, states, dtype=torch.int32, device=v.device)
        v = v.reshape(rows * states, v.shape[2], v.shape[3])
        s = s.reshape(rows * states, s.shape[2])
    return torch.ops.tessera.merge_states(v, s, indptr)


@torch.library.custom_op("tessera::block_table_to_csr", mutates_args=())
def _block_table_to_csr_op(block_table: Tensor, seq_lens: Tensor, page_size: int
                           ) -> Tuple[Tensor, Tensor, Tensor]:
    indptr, indices, last = _ops.block_table_to_csr(block_table, seq_lens, page_size)
    return indptr, indices, last


@_block_table_to_csr_op.register_fake
def _block_table_to_csr_fake(block_table, seq_lens, page_size):
    batch, max_pages = block_table.shape[0], block_table.shape[1]
    return (block_table.new_empty((batch + 1,)),
            block_table.new_empty((torch.sym_max(batch * max_pages, 1),)),
            block_table.new_empty((batch,)))


def block_table_to_csr(block_table: Tensor, seq_lens: Tensor, page_size: int
                       ) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`tessera.block_table_to_csr` as a custom op."""
    return torch.ops.tessera.block_table_to_csr(block_table, seq_lens, page_size)
