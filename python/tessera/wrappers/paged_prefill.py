"""The prefill wrapper over a paged KV cache (chunked prefill, append):
:class:`BatchPrefillWithPagedKVCacheWrapper`."""

from __future__ import annotations

import ctypes
from typing import Any, List, Optional, Tuple, Union

import numpy as np

from .. import _capi
from .._capi import check
from .._common import attention_options
from .._dlpack import DLTensor, cached_dl, to_host_int32
from .._masks import plan_custom_mask
from ._args import (
    _I32P,
    _OPTION_ARG_NAMES,
    _PLAN_NAMES,
    _RUN_NAMES,
    ArrayLike,
    _head_dim_vo,
    _check_pos_encoding,
    _int_arg,
)
from ._base import _IndexSlot, _PagedWrapper
from ._fast_run import NOT_SERVED


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    _run_symbol = "tessera_run_paged_prefill"

    """Prefill / chunked prefill attention of ragged queries against a paged KV cache
    (FlashInfer's wrapper of the same name).

    ``q`` is ``[total_q, num_qo_heads, head_dim]`` ragged by ``qo_indptr``; the cache is
    ``paged_kv_cache = (k_cache, v_cache)`` with ``[num_pages, page_size, num_kv_heads,
    head_dim]`` (NHD) or ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND), or one tensor
    ``[num_pages, 2, ...]``. Pages of request ``b`` are
    ``paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b+1]]``; its last page holds
    ``paged_kv_last_page_len[b]`` tokens.
    """

    def __init__(self, float_workspace_buffer: ArrayLike, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: Optional[ArrayLike] = None,
                 paged_kv_indptr_buf: Optional[ArrayLike] = None,
                 paged_kv_indices_buf: Optional[ArrayLike] = None,
                 paged_kv_last_page_len_buf: Optional[ArrayLike] = None,
                 custom_mask_buf: Optional[ArrayLike] = None,
                 mask_indptr_buf: Optional[ArrayLike] = None, backend: str = "auto") -> None:
        """``backend`` is accepted for FlashInfer compatibility and ignored, and so are
        ``custom_mask_buf`` / ``mask_indptr_buf`` (each plan keeps its mask in arrays of its
        own on the workspace's device)."""
        del backend
        del custom_mask_buf, mask_indptr_buf  # masks live in arrays of the plan (see plan())
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, paged_kv_indptr_buf,
                         paged_kv_indices_buf, paged_kv_last_page_len_buf)
        self._qo_indptr = _IndexSlot("qo_indptr", qo_indptr_buf, self._device)

    def plan(
        self,
        qo_indptr: ArrayLike,
        paged_kv_indptr: ArrayLike,
        paged_kv_indices: ArrayLike,
        paged_kv_last_page_len: ArrayLike,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: Optional[ArrayLike] = None,
        packed_custom_mask: Optional[ArrayLike] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        non_blocking: bool = True,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        mask_indptr: Optional[ArrayLike] = None,
    ) -> None:
        """Plans the batch (arguments as in FlashInfer; see
        :meth:`BatchPrefillWithRaggedKVCacheWrapper.plan` for the options, the custom masks
        included: a request's keys are its ``kv_len`` cached tokens, in page-table order)."""
        del use_fp16_qk_reduction, q_data_type, kv_data_type, non_blocking
        _check_pos_encoding(pos_encoding_mode, rope_scale, rope_theta)
        vo = _head_dim_vo(head_dim_vo)
        qo_host = to_host_int32(qo_indptr, "qo_indptr").reshape(-1)
        indptr_host = to_host_int32(paged_kv_indptr, "paged_kv_indptr").reshape(-1)
        last_host = to_host_int32(paged_kv_last_page_len, "paged_kv_last_page_len").reshape(-1)
        if indptr_host.size != qo_host.size:
            raise ValueError(f"'paged_kv_indptr': expected {qo_host.size} values like qo_indptr, "
                             f"got {indptr_host.size}")
        if last_host.size + 1 != qo_host.size:
            raise ValueError(f"'paged_kv_last_page_len': expected {qo_host.size - 1} values (one "
                             f"per request), got {last_host.size}")
        options = attention_options(causal, window_left, -1, logits_soft_cap, sm_scale, k_scale,
                                    v_scale, names=_OPTION_ARG_NAMES)
        handle = ctypes.c_void_p()
        extra = _capi.plan_options(vo)
        check(_capi.lib().tessera_plan_paged_prefill_v2(
            qo_host.ctypes.data_as(_I32P), indptr_host.ctypes.data_as(_I32P),
            last_host.ctypes.data_as(_I32P), max(qo_host.size - 1, 0),
            _int_arg(page_size, "page_size"), _int_arg(num_qo_heads, "num_qo_heads"),
            _int_arg(num_kv_heads, "num_kv_heads"), _int_arg(head_dim_qk, "head_dim_qk"),
            ctypes.byref(options), ctypes.byref(extra), self._device[0], self._device[1],
            ctypes.byref(handle)),
            dict(_PLAN_NAMES, head_dim="head_dim_qk", **{"options.head_dim_vo": "head_dim_vo"}))
        plan = self._new_plan(handle)
        pages = np.diff(indptr_host).astype(np.int64)
        kv_lens = np.where(pages > 0, (pages - 1) * int(page_size) + last_host, 0)
        # After the plan checked the lengths; before anything of the wrapper changes.
        masks = plan_custom_mask(custom_mask, packed_custom_mask, mask_indptr, np.diff(qo_host),
                                 kv_lens, self._workspace, self._workspace_dl)
        staged = [self._qo_indptr.stage(self, qo_indptr, qo_host)]
        staged += self._stage_pages(paged_kv_indptr, indptr_host, paged_kv_indices,
                                    paged_kv_last_page_len, last_host)
        staged.append(self._stage_masks(masks))
        staged.append(self._stage_out_dim(int(head_dim_qk), vo))
        self._install(plan, options, staged)

    def _index_descriptors(self) -> List[DLTensor]:
        return [self._page_indptr.dl, self._page_indices.dl, self._last_page_len.dl,
                self._qo_indptr.dl]

    def run(self, q: ArrayLike, paged_kv_cache: Any, *, k_scale: Optional[float] = None,
            v_scale: Optional[float] = None, out: Optional[ArrayLike] = None,
            lse: Optional[ArrayLike] = None, return_lse: bool = False,
            enable_pdl: Optional[bool] = None, sinks: Optional[ArrayLike] = None
            ) -> Union[ArrayLike, Tuple[ArrayLike, ArrayLike]]:
        """Runs the plan: ``o`` ``[total_q, num_qo_heads, head_dim]``, or ``(o, lse)``.
        ``sinks`` (FlashInfer's run argument): optional attention sinks, float32
        ``[num_qo_heads]`` on q's device, one logit per query head that joins every row's softmax
        denominator (gpt-oss). ``enable_pdl``: programmatic dependent launch (sm_90+; the
        kernel overlaps the previous kernel's tail and waits for it before touching memory).
        Calls with either, or with a planned mask, take the ctypes path."""
        plan = self._plan
        if plan is None:
            self._require_plan()
        if k_scale is not None or v_scale is not None:
            self._scales(k_scale, v_scale)
        if self._fast is not None and sinks is None and not enable_pdl:
            result = self._run_fast((q, paged_kv_cache), out, lse, return_lse)
            if result is not NOT_SERVED:
                return result
        q_dl = cached_dl(q, "q")
        kv = self._paged_kv(paged_kv_cache)
        out, o_dl, lse, lse_dl = self._outputs(q, q_dl, out, lse, return_lse)
        if self._watch_capture:
            self._note_capture()
        status = self._invoke(
            sinks, enable_pdl, plan.handle, q_dl, kv, self._qo_indptr.dl, o_dl, lse_dl,
            self._workspace_ptr,
            self._workspace_bytes, None if q_dl._cuda is None else self._stream(q, q_dl))
        if status:
            check(status, _RUN_NAMES)
        return (out, lse) if return_lse else out
