"""DeepSeek-style multi-head latent attention (MLA, absorbed form) over a paged latent cache:
:class:`BatchMLAPagedAttentionWrapper` (FlashInfer's plan/run signature) and
:func:`append_paged_mla_cache`.

Per token the cache holds a latent ``ckv`` [head_dim_ckv] (DeepSeek: 512) and a rotary key
``kpe`` [head_dim_kpe] (64), shared by every query head. Queries are ``q_nope``
``[total_q, num_heads, head_dim_ckv]`` (already multiplied by the absorbed W_UK) and ``q_pe``
``[total_q, num_heads, head_dim_kpe]``, ragged by ``qo_indptr`` (decode: one or a few rows per
request; prefill: causal bottom-right with ``causal=True``). Scores are
``sm_scale * (q_nope . ckv + q_pe . kpe)``; the output is ``softmax . ckv``
``[total_q, num_heads, head_dim_ckv]`` in q's dtype, and the optional lse is float32
``[total_q, num_heads]`` in natural log (FlashInfer's MLA kernels return base-2 unless
``return_lse_base_on_e``: multiply by log2(e) to compare). The semantics are the C library's
(``include/tessera/mla.hpp``); CPU only for now (a CUDA workspace raises
:class:`tessera.UnsupportedError` at plan time).

The cache is ``ckv_cache [num_pages, page_size, head_dim_ckv]`` and ``kpe_cache [num_pages,
page_size, head_dim_kpe]``, or one combined ``[num_pages, page_size, head_dim_ckv +
head_dim_kpe]`` array passed as ``ckv_cache`` with ``kpe_cache=None`` (FlashMLA's layout; no
copy either way).
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Tuple, Union

import numpy as np

from .. import _capi
from .._capi import MlaPlan, check
from .._dlpack import (
    DLTensor,
    device_of,
    empty,
    from_numpy,
    itemsize_of,
    nbytes_of,
    shape_of,
    strides_of,
    to_dl,
    to_host_int32,
    view,
)

_I32P = ctypes.POINTER(ctypes.c_int32)
# C argument names -> this module's Python names (appended to the library's messages).
_PLAN_NAMES = {"page_indptr": "kv_indptr", "last_page_len": "kv_len_arr",
               "kv_lora_rank": "head_dim_ckv", "rope_dim": "head_dim_kpe"}
_RUN_NAMES = {"page_indices": "kv_indices"}

ArrayLike = Any


def _ptr(array: np.ndarray) -> Any:
    return array.ctypes.data_as(_I32P)


def _last_page_len(kv_indptr: np.ndarray, kv_len: np.ndarray, page_size: int) -> np.ndarray:
    """kv_len_arr (FlashInfer's) as Tessera's last_page_len, checked against the page counts."""
    pages = np.diff(kv_indptr.astype(np.int64))
    if kv_len.size != pages.size:
        raise ValueError(f"'kv_len_arr': expected batch_size = {pages.size} values, got "
                         f"{kv_len.size}")
    last = kv_len.astype(np.int64) - (pages - 1) * page_size
    bad = np.nonzero(((pages == 0) & (kv_len != 0)) |
                     ((pages > 0) & ((last < 1) | (last > page_size))))[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"'kv_len_arr': request {b} has kv_len {int(kv_len[b])} but "
                         f"{int(pages[b])} pages of {page_size} in kv_indptr")
    return np.ascontiguousarray(np.where(pages == 0, 0, last).astype(np.int32))


def _split_combined(cache: DLTensor, ckv_dim: int) -> Tuple[DLTensor, DLTensor]:
    """ckv / kpe views of a combined [num_pages, page_size, ckv + kpe] cache."""
    shape, strides = shape_of(cache), strides_of(cache)
    if len(shape) != 3 or shape[2] <= ckv_dim:
        raise ValueError(f"'ckv_cache': with kpe_cache=None expected a combined cache "
                         f"[num_pages, page_size, {ckv_dim} + head_dim_kpe], got shape {shape}")
    ckv = view(cache, (shape[0], shape[1], ckv_dim), strides)
    kpe = view(cache, (shape[0], shape[1], shape[2] - ckv_dim), strides,
               ckv_dim * strides[2] * itemsize_of(cache))
    return ckv, kpe


class BatchMLAPagedAttentionWrapper:
    """MLA decode / prefill over a paged latent cache (FlashInfer's wrapper of the same name).

    Example::

        wrapper = tessera.BatchMLAPagedAttentionWrapper(np.empty(1 << 24, np.uint8))
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, 128, 512, 64, 64,
                     False, sm_scale, "bfloat16", "bfloat16")
        o = wrapper.run(q_nope, q_pe, ckv_cache, kpe_cache)
    """

    def __init__(self, float_workspace_buffer: ArrayLike, use_cuda_graph: bool = False,
                 qo_indptr: Any = None, kv_indptr: Any = None, kv_indices: Any = None,
                 kv_len_arr: Any = None, backend: str = "auto") -> None:
        """``use_cuda_graph``, the fixed index buffers and ``backend`` are accepted for
        FlashInfer compatibility; CUDA graphs are not offered (CPU only for now)."""
        del qo_indptr, kv_indptr, kv_indices, kv_len_arr, backend
        if use_cuda_graph:
            raise ValueError("'use_cuda_graph': MLA runs on the CPU backend only for now")
        self._workspace = float_workspace_buffer
        self._workspace_dl = to_dl(float_workspace_buffer, "float_workspace_buffer",
                                   writable=True)
        self._workspace_bytes = nbytes_of(self._workspace_dl, "float_workspace_buffer")
        self._device = device_of(self._workspace_dl)
        self._plan: Optional[MlaPlan] = None
        self._arrays: Any = None
        self._dims = (0, 0, 0)  # num_heads, head_dim_ckv, head_dim_kpe

    @property
    def workspace_bytes_needed(self) -> int:
        return 0 if self._plan is None else self._plan.workspace_bytes

    def explain(self) -> str:
        if self._plan is None:
            raise RuntimeError("plan() has not been called")
        return self._plan.explain()

    def plan(self, qo_indptr: ArrayLike, kv_indptr: ArrayLike, kv_indices: ArrayLike,
             kv_len_arr: ArrayLike, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
             page_size: int, causal: bool, sm_scale: float, q_data_type: Any = "bfloat16",
             kv_data_type: Any = None, use_profiler: bool = False) -> None:
        """Plans the batch: ``kv_indptr`` [B+1] / ``kv_indices`` are the CSR page table of
        each request, ``kv_len_arr`` [B] its key count (the cache after the new tokens).
        ``q_data_type`` / ``kv_data_type`` are accepted for compatibility (the run's tensors
        decide). Nothing of the wrapper changes when an argument is rejected."""
        del q_data_type, kv_data_type, use_profiler
        qo = to_host_int32(qo_indptr, "qo_indptr").reshape(-1)
        pages = to_host_int32(kv_indptr, "kv_indptr").reshape(-1)
        indices = to_host_int32(kv_indices, "kv_indices").reshape(-1)
        lens = to_host_int32(kv_len_arr, "kv_len_arr").reshape(-1)
        if qo.size < 1 or pages.size != qo.size:
            raise ValueError(f"'kv_indptr': expected batch_size + 1 = {qo.size} values like "
                             f"qo_indptr, got {pages.size}")
        page_size = int(page_size)
        if page_size < 1:
            raise ValueError(f"'page_size': expected >= 1, got {page_size}")
        last = _last_page_len(pages, lens, page_size)
        options = _capi.MlaOptions(1 if causal else 0, float(sm_scale or 0.0))
        handle = ctypes.c_void_p()
        check(_capi.lib().tessera_plan_mla(
            _ptr(qo), _ptr(pages), _ptr(last), qo.size - 1, page_size, int(num_heads),
            int(head_dim_ckv), int(head_dim_kpe), ctypes.byref(options), self._device[0],
            self._device[1], ctypes.byref(handle)), _PLAN_NAMES)
        plan = MlaPlan(handle)
        if plan.workspace_bytes > self._workspace_bytes:
            raise ValueError(f"'float_workspace_buffer': the batch needs {plan.workspace_bytes} "
                             f"bytes, the buffer holds {self._workspace_bytes}")
        arrays = [from_numpy(a if a.size else np.zeros(1, np.int32), self._workspace,
                             self._workspace_dl) for a in (qo, pages, indices, last)]
        descriptors = [to_dl(a, name) for a, name in
                       zip(arrays, ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"))]
        if qo.size == 1:  # an empty batch: last_page_len has no element
            descriptors[3] = view(descriptors[3], (0,), (1,))
        if indices.size == 0:
            descriptors[2] = view(descriptors[2], (0,), (1,))
        self._plan = plan
        self._arrays = (arrays, descriptors)
        self._dims = (int(num_heads), int(head_dim_ckv), int(head_dim_kpe))
        self._total_q = int(qo[-1])

    def run(self, q_nope: ArrayLike, q_pe: ArrayLike, ckv_cache: ArrayLike,
            kpe_cache: Optional[ArrayLike] = None, out: Optional[ArrayLike] = None,
            lse: Optional[ArrayLike] = None, return_lse: bool = False,
            profiler_buffer: Any = None, kv_len: Any = None, page_table: Any = None,
            return_lse_base_on_e: bool = True) -> Union[Any, Tuple[Any, Any]]:
        """Returns ``o`` (or ``(o, lse)`` with ``return_lse`` or ``lse=``). ``kpe_cache=None``
        reads a combined cache from ``ckv_cache``. ``kv_len`` / ``page_table`` (FlashInfer's
        run-time overrides) are not supported: plan again instead."""
        if self._plan is None:
            raise RuntimeError("plan() has not been called")
        for value, name in ((profiler_buffer, "profiler_buffer"), (kv_len, "kv_len"),
                            (page_table, "page_table")):
            if value is not None:
                raise ValueError(f"'{name}': not supported by Tessera's MLA wrapper (pass None)")
        if not return_lse_base_on_e:
            raise ValueError("'return_lse_base_on_e': Tessera returns the natural-log lse only")
        num_heads, ckv_dim, kpe_dim = self._dims
        q_nope_dl = to_dl(q_nope, "q_nope")
        q_pe_dl = to_dl(q_pe, "q_pe") if q_pe is not None else None
        ckv_dl = to_dl(ckv_cache, "ckv_cache")
        if kpe_cache is None and kpe_dim > 0:
            ckv_dl, kpe_dl = _split_combined(ckv_dl, ckv_dim)
        else:
            kpe_dl = to_dl(kpe_cache, "kpe_cache") if kpe_cache is not None else None
        if out is None:
            out = empty(q_nope, q_nope_dl, (self._total_q, num_heads, ckv_dim), name="out")
        want_lse = return_lse or lse is not None
        if want_lse and lse is None:
            lse = empty(q_nope, q_nope_dl, (self._total_q, num_heads), "float32", name="lse")
        out_dl = to_dl(out, "out", writable=True)
        lse_dl = to_dl(lse, "lse", writable=True) if want_lse else None
        _, (qo_dl, pages_dl, indices_dl, last_dl) = self._arrays
        cache = _capi.MlaCache(ctypes.pointer(ckv_dl),
                               None if kpe_dl is None else ctypes.pointer(kpe_dl),
                               ctypes.pointer(pages_dl), ctypes.pointer(indices_dl),
                               ctypes.pointer(last_dl))
        workspace = self._workspace_dl.data + self._workspace_dl.byte_offset \
            if self._workspace_dl.data else None
        check(_capi.lib().tessera_run_mla(
            self._plan.handle, ctypes.byref(q_nope_dl),
            None if q_pe_dl is None else ctypes.byref(q_pe_dl), ctypes.byref(cache),
            ctypes.byref(qo_dl), ctypes.byref(out_dl),
            None if lse_dl is None else ctypes.byref(lse_dl), workspace, self._workspace_bytes,
            None), _RUN_NAMES)
        return (out, lse) if want_lse else out


def append_paged_mla_cache(ckv_new: ArrayLike, kpe_new: Optional[ArrayLike],
                           append_indptr: ArrayLike, ckv_cache: ArrayLike,
                           kpe_cache: Optional[ArrayLike], page_indptr: ArrayLike,
                           page_indices: ArrayLike, last_page_len: ArrayLike,
                           rope: Optional[Any] = None) -> None:
    """Writes new tokens' latent rows into the cache in place: ``ckv_new [nnz, head_dim_ckv]``
    and ``kpe_new [nnz, head_dim_kpe]``, ragged by ``append_indptr [B+1]``, land at each
    request's last positions (the page table describes the cache after the append). ``rope``
    (a :class:`tessera.RopeOptions`) rotates the kpe rows by those positions as they are
    written (DeepSeek's checkpoints rotate interleaved pairs: ``interleave=True``)."""
    names = ("ckv_new", "kpe_new", "append_indptr", "page_indptr", "page_indices",
             "last_page_len")
    dls = [None if obj is None else to_dl(obj, name)
           for obj, name in zip((ckv_new, kpe_new, append_indptr, page_indptr, page_indices,
                                 last_page_len), names)]
    ckv_dl = to_dl(ckv_cache, "ckv_cache", writable=True)
    kpe_dl = None if kpe_cache is None else to_dl(kpe_cache, "kpe_cache", writable=True)
    cache = _capi.MlaCache(ctypes.pointer(ckv_dl),
                           None if kpe_dl is None else ctypes.pointer(kpe_dl),
                           ctypes.pointer(dls[3]), ctypes.pointer(dls[4]),
                           ctypes.pointer(dls[5]))
    rope_c = None if rope is None else rope.to_c()
    check(_capi.lib().tessera_append_paged_mla_cache(
        ctypes.byref(dls[0]), None if dls[1] is None else ctypes.byref(dls[1]),
        ctypes.byref(dls[2]), ctypes.byref(cache),
        None if rope_c is None else ctypes.byref(rope_c), None))
