"""The prefill wrapper over ragged K/V: :class:`BatchPrefillWithRaggedKVCacheWrapper`."""

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
from ._base import _IndexSlot, _Wrapper
from ._fast_run import NOT_SERVED


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    _run_symbol = "tessera_run_ragged_prefill"

    """Prefill attention over a ragged batch of K/V (FlashInfer's wrapper of the same name).

    ``q`` is ``[total_q, num_qo_heads, head_dim]`` ragged by ``qo_indptr``; ``k``/``v`` are
    ``[total_kv, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, total_kv, head_dim]`` (HND)
    ragged by ``kv_indptr``.

    Example::

        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
        wrapper.plan(qo_indptr, kv_indptr, 32, 8, 128, causal=True)
        o = wrapper.run(q, k, v)
    """

    def __init__(self, float_workspace_buffer: ArrayLike, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: Optional[ArrayLike] = None,
                 kv_indptr_buf: Optional[ArrayLike] = None,
                 custom_mask_buf: Optional[ArrayLike] = None,
                 mask_indptr_buf: Optional[ArrayLike] = None, backend: str = "auto") -> None:
        """``backend`` is accepted for FlashInfer compatibility and ignored (Tessera dispatches
        by device), and so are ``custom_mask_buf`` / ``mask_indptr_buf`` (each plan keeps its
        mask in arrays of its own on the workspace's device)."""
        del backend
        del custom_mask_buf, mask_indptr_buf  # masks live in arrays of the plan (see plan())
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        self._qo_indptr = _IndexSlot("qo_indptr", qo_indptr_buf, self._device)
        self._kv_indptr = _IndexSlot("kv_indptr", kv_indptr_buf, self._device)

    def plan(
        self,
        qo_indptr: ArrayLike,
        kv_indptr: ArrayLike,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: Optional[ArrayLike] = None,
        packed_custom_mask: Optional[ArrayLike] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        mask_indptr: Optional[ArrayLike] = None,
    ) -> None:
        """Plans the batch.

        Args:
            qo_indptr, kv_indptr: ``[batch_size + 1]`` cumulative query / key lengths.
            num_qo_heads, num_kv_heads, head_dim_qk: problem shape. head_dim_vo: width of v
                and o rows when it differs from head_dim_qk (None: equal; e.g. 192 / 128); CPU
                only for now (a CUDA workspace's plan raises UnsupportedError naming it); such
                runs take the ctypes path and allocate o ``[total_q, num_qo_heads,
                head_dim_vo]``.
            causal: causal mask aligned bottom-right. window_left: sliding window (-1 = off).
            custom_mask: FlashInfer's custom mask: booleans, every request's ``[q_len,
                kv_len]`` matrix (True: query row i sees key j) flattened and concatenated; packed
                here (little-endian, :func:`tessera.segment_packbits`). packed_custom_mask: the
                same already packed (uint8, little-endian), each request's
                ``ceil(q_len * kv_len / 8)`` bytes back to back, or anywhere with
                ``mask_indptr`` (int32 ``[batch_size + 1]`` byte offsets, Tessera extension). The
                mask ANDs with causal and window_left and joins every run of this plan. CPU only
                for now (a CUDA workspace's run raises UnsupportedError naming it); such runs
                take the ctypes path.
            logits_soft_cap: soft-cap (None/0 = off). sm_scale: None = 1/sqrt(head_dim).
            k_scale, v_scale: fp8 KV dequantisation scales (Tessera extension).
            pos_encoding_mode other than "NONE": not supported (ValueError).
            use_fp16_qk_reduction, q_data_type, kv_data_type: accepted and ignored (accumulation
                is always fp32; dtypes are checked by run()).
        """
        del use_fp16_qk_reduction, q_data_type, kv_data_type
        _check_pos_encoding(pos_encoding_mode, rope_scale, rope_theta)
        vo = _head_dim_vo(head_dim_vo)
        qo_host = to_host_int32(qo_indptr, "qo_indptr").reshape(-1)
        kv_host = to_host_int32(kv_indptr, "kv_indptr").reshape(-1)
        if kv_host.size != qo_host.size:
            raise ValueError(f"'kv_indptr': expected {qo_host.size} values like qo_indptr, got "
                             f"{kv_host.size}")
        options = attention_options(causal, window_left, -1, logits_soft_cap, sm_scale, k_scale,
                                    v_scale, names=_OPTION_ARG_NAMES)
        handle = ctypes.c_void_p()
        extra = _capi.plan_options(vo)
        check(_capi.lib().tessera_plan_ragged_prefill_v2(
            qo_host.ctypes.data_as(_I32P), kv_host.ctypes.data_as(_I32P), max(qo_host.size - 1, 0),
            _int_arg(num_qo_heads, "num_qo_heads"), _int_arg(num_kv_heads, "num_kv_heads"),
            _int_arg(head_dim_qk, "head_dim_qk"), ctypes.byref(options), ctypes.byref(extra),
            self._device[0], self._device[1], ctypes.byref(handle)),
            dict(_PLAN_NAMES, head_dim="head_dim_qk", **{"options.head_dim_vo": "head_dim_vo"}))
        plan = self._new_plan(handle)
        # After the plan checked the lengths; before anything of the wrapper changes.
        masks = plan_custom_mask(custom_mask, packed_custom_mask, mask_indptr, np.diff(qo_host),
                                 np.diff(kv_host), self._workspace, self._workspace_dl)
        self._install(plan, options, [self._qo_indptr.stage(self, qo_indptr, qo_host),
                                      self._kv_indptr.stage(self, kv_indptr, kv_host),
                                      self._stage_masks(masks),
                                      self._stage_out_dim(int(head_dim_qk), vo)])

    def _index_descriptors(self) -> List[DLTensor]:
        return [self._qo_indptr.dl, self._kv_indptr.dl]

    def run(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: Optional[ArrayLike] = None,
            lse: Optional[ArrayLike] = None, return_lse: bool = False, *,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            enable_pdl: Optional[bool] = None, sinks: Optional[ArrayLike] = None
            ) -> Union[ArrayLike, Tuple[ArrayLike, ArrayLike]]:
        """Runs the plan: returns ``o`` ``[total_q, num_qo_heads, head_dim]`` (q's dtype), or
        ``(o, lse)`` with ``lse`` ``[total_q, num_qo_heads]`` float32 when ``return_lse``.
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
            result = self._run_fast((q, k, v), out, lse, return_lse)
            if result is not NOT_SERVED:
                return result
        q_dl = cached_dl(q, "q")
        k_dl = cached_dl(k, "k")
        v_dl = cached_dl(v, "v")
        if self._layout == _capi.TESSERA_KV_LAYOUT_HND:
            k_dl, v_dl = self._nhd(k_dl, "k"), self._nhd(v_dl, "v")
        out, o_dl, lse, lse_dl = self._outputs(q, q_dl, out, lse, return_lse)
        if self._watch_capture:
            self._note_capture()
        # Descriptors are passed as ctypes instances (ctypes passes them by reference).
        status = self._invoke(
            sinks, enable_pdl, plan.handle, q_dl, k_dl, v_dl, self._qo_indptr.dl,
            self._kv_indptr.dl, o_dl, lse_dl,
            self._workspace_ptr, self._workspace_bytes,
            None if q_dl._cuda is None else self._stream(q, q_dl))
        if status:
            check(status, _RUN_NAMES)
        return (out, lse) if return_lse else out
