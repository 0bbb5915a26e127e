"""The batch decode wrapper over a paged KV cache (and speculative decoding):
:class:`BatchDecodeWithPagedKVCacheWrapper`."""

from __future__ import annotations

import ctypes
from typing import Any, List, Optional, Tuple, Union

from .. import _capi
from .._capi import check
from .._common import attention_options
from .._dlpack import DLTensor, cached_dl, to_host_int32
from .._masks import plan_tree_mask
from ._args import (
    _I32P,
    _OPTION_ARG_NAMES,
    _PLAN_NAMES,
    _RUN_NAMES,
    ArrayLike,
    _check_pos_encoding,
    _int_arg,
)
from ._base import _PagedWrapper
from ._fast_run import NOT_SERVED


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    _run_symbol = "tessera_run_decode"

    """Batch decode attention over a paged KV cache (FlashInfer's wrapper of the same name).

    ``q`` is ``[batch_size * q_per_request, num_qo_heads, head_dim]`` (``q_per_request = 1`` for
    plain decode; up to 64 for speculative decoding, causal within the request's last tokens, or
    a tree of drafts given by ``plan(..., tree_mask=)``).

    Example::

        wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(kv_page_indptr, kv_page_indices, kv_last_page_len, 32, 8, 128, 16)
        for layer in range(num_layers):
            o = wrapper.run(q[layer], (k_cache[layer], v_cache[layer]))
    """

    def __init__(self, float_workspace_buffer: ArrayLike, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: Optional[ArrayLike] = None,
                 paged_kv_indices_buffer: Optional[ArrayLike] = None,
                 paged_kv_last_page_len_buffer: Optional[ArrayLike] = None,
                 backend: str = "auto") -> None:
        """``use_tensor_cores`` and ``backend`` are accepted for FlashInfer compatibility and
        ignored (Tessera picks its kernels by device and shape)."""
        del use_tensor_cores, backend
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph,
                         paged_kv_indptr_buffer, paged_kv_indices_buffer,
                         paged_kv_last_page_len_buffer)
        self._q_rows = 0

    def plan(
        self,
        indptr: ArrayLike,
        indices: ArrayLike,
        last_page_len: ArrayLike,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        data_type: Any = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        non_blocking: bool = True,
        *,
        q_per_request: int = 1,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        tree_mask: Optional[ArrayLike] = None,
    ) -> None:
        """Plans one decode step.

        Args:
            indptr, indices, last_page_len: the CSR page table (``paged_kv_indptr``
                ``[batch_size + 1]``, ``paged_kv_indices``, ``paged_kv_last_page_len``
                ``[batch_size]``), any framework; read on the host here.
            num_qo_heads, num_kv_heads, head_dim, page_size: problem shape.
            window_left, logits_soft_cap, sm_scale: as in FlashInfer.
            q_per_request: query tokens per request (1..64, Tessera extension for speculative
                decoding; causal among them, aligned bottom-right).
            k_scale, v_scale: fp8 KV dequantisation scales (Tessera extension).
            tree_mask: speculative decoding with a tree of drafts (Tessera extension): booleans
                ``[batch_size, q_per_request, q_per_request]``, ``[b, i, d]`` True when draft
                token ``i`` of request ``b`` sees draft ``d`` (set ``[b, i, i]`` for a token to see
                itself), or those rows already packed little-endian (uint8 ``[batch_size,
                >= ceil(q_per_request^2 / 8)]``). The drafts' keys are each request's last
                ``q_per_request`` keys; every draft sees all the keys before them. The tree takes
                the place of the causal relation among the drafts (the plan is not causal then)
                and joins every run of this plan. CPU only for now (a CUDA workspace's run raises
                UnsupportedError naming it); such runs take the ctypes path.
        """
        del q_data_type, kv_data_type, data_type, non_blocking
        _check_pos_encoding(pos_encoding_mode, rope_scale, rope_theta)
        indptr_host = to_host_int32(indptr, "indptr").reshape(-1)
        last_host = to_host_int32(last_page_len, "last_page_len").reshape(-1)
        if indptr_host.size < 1:
            raise ValueError("'indptr': expected batch_size + 1 >= 1 values")
        q_per_request = _int_arg(q_per_request, "q_per_request")
        options = attention_options(q_per_request > 1 and tree_mask is None, window_left, -1,
                                    logits_soft_cap, sm_scale, k_scale, v_scale,
                                    names=_OPTION_ARG_NAMES)
        handle = ctypes.c_void_p()
        check(_capi.lib().tessera_plan_decode(
            indptr_host.ctypes.data_as(_I32P), last_host.ctypes.data_as(_I32P),
            indptr_host.size - 1, _int_arg(page_size, "page_size"),
            _int_arg(num_qo_heads, "num_qo_heads"), _int_arg(num_kv_heads, "num_kv_heads"),
            _int_arg(head_dim, "head_dim"), q_per_request, ctypes.byref(options),
            self._device[0], self._device[1], ctypes.byref(handle)),
            dict(_PLAN_NAMES, page_indptr_host="indptr", last_page_len_host="last_page_len"))
        plan = self._new_plan(handle)
        masks = plan_tree_mask(tree_mask, indptr_host.size - 1, q_per_request, self._workspace,
                               self._workspace_dl)
        self._install(plan, options,
                      self._stage_pages(indptr, indptr_host, indices, last_page_len, last_host) +
                      [self._stage_masks(masks)])

    def _index_descriptors(self) -> List[DLTensor]:
        return [self._page_indptr.dl, self._page_indices.dl, self._last_page_len.dl]

    def run(self, q: ArrayLike, paged_kv_cache: Any, *, q_rope_offset: Optional[ArrayLike] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            out: Optional[ArrayLike] = None, lse: Optional[ArrayLike] = None,
            return_lse: bool = False, enable_pdl: Optional[bool] = None,
            window_left: Optional[int] = None, sinks: Optional[ArrayLike] = None
            ) -> Union[ArrayLike, Tuple[ArrayLike, ArrayLike]]:
        """Runs the plan: ``o`` ``[batch_size * q_per_request, num_qo_heads, head_dim]`` in q's
        dtype, or ``(o, lse)`` with ``lse`` float32 ``[rows, num_qo_heads]``.
        ``sinks`` (FlashInfer's run argument): optional attention sinks, float32
        ``[num_qo_heads]`` on q's device, one logit per query head that joins every row's softmax
        denominator (gpt-oss). ``enable_pdl``: programmatic dependent launch (sm_90+; the
        kernel overlaps the previous kernel's tail and waits for it before touching memory).
        Calls with either, or with a planned tree mask, take the ctypes path."""
        plan = self._plan
        if plan is None:
            self._require_plan()
        if q_rope_offset is not None:
            raise ValueError("'q_rope_offset': RoPE inside attention is not supported; rotate q "
                             "with tessera.apply_rope_pos_ids_inplace first")
        if window_left is not None and window_left != self._options.window_left:
            raise ValueError(f"'window_left': the plan was made with window_left="
                             f"{self._options.window_left}; pass it to plan()")
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
            sinks, enable_pdl, plan.handle, q_dl, kv, o_dl, lse_dl, self._workspace_ptr,
            self._workspace_bytes,
            None if q_dl._cuda is None else self._stream(q, q_dl))
        if status:
            check(status, _RUN_NAMES)
        return (out, lse) if return_lse else out
