"""Multi-level cascade attention over one paged KV cache:
:class:`MultiLevelCascadeAttentionWrapper` (FlashInfer's wrapper of the same name).

Every level covers the same query rows and groups them with its own ``qo_indptr`` and page table
into the one cache. A row attends, in one softmax, to its group's keys at every level: all of
them at the upper levels (shared prefixes: no mask), and at the last level as paged prefill with
the plan's options (``causal`` aligned bottom-right to that level's keys). Each level runs once
(a shared prefix is read once per group, not once per request) into the workspace, and the
level states are merged exactly (``merge_state``). A level whose requests each hold one query
row runs the decode kernels. Sliding windows are rejected. The semantics are the C library's
(``include/tessera/cascade.hpp``).
"""

from __future__ import annotations

import ctypes
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import _capi
from .._capi import CascadePlan, check, kDLCUDA
from .._common import attention_options, split_paged_kv_cache, stream_arg
from .._dlpack import DLTensor, cached_dl, from_numpy, stream_of, to_dl, to_host_int32
from ._args import (
    _I32P,
    _OPTION_ARG_NAMES,
    _PLAN_NAMES,
    _RUN_NAMES,
    ArrayLike,
    _check_head_dim_vo,
    _check_pos_encoding,
    _int_arg,
)
from ._base import _Wrapper

_LEVEL_ARRAYS = ("qo_indptr", "page_indptr", "page_indices", "last_page_len")
_CASCADE_PLAN_NAMES = dict(_PLAN_NAMES, head_dim="head_dim")


class MultiLevelCascadeAttentionWrapper(_Wrapper):
    """Cascade attention with ``num_levels`` levels over a paged KV cache.

    ``plan`` takes per-level lists (FlashInfer's signature): ``qo_indptr_arr``,
    ``paged_kv_indptr_arr``, ``paged_kv_indices_arr``, ``paged_kv_last_page_len``; level 0 is the
    outermost shared prefix, the last level each request's own keys. ``run(q, paged_kv_cache)``
    returns ``o`` ``[total_q, num_qo_heads, head_dim]`` (or ``(o, lse)``).

    CUDA graphs: a captured ``run`` replays the plan current at capture time (its lists were
    uploaded into the workspace by ``plan``); plan again and re-capture when the batch changes,
    and give the wrapper a workspace of its own. ``use_cuda_graph=True`` (FlashInfer's
    fixed-address index buffers) is not offered by this wrapper.
    """

    _run_symbol = "tessera_run_cascade"

    def __init__(self, num_levels: int, float_workspace_buffer: ArrayLike, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, *unused_buffers: Any) -> None:
        self._num_levels = _int_arg(num_levels, "num_levels")
        if not 1 <= self._num_levels <= 16:
            raise ValueError(f"'num_levels': expected 1..16, got {num_levels}")
        if use_cuda_graph:
            raise ValueError("'use_cuda_graph': the cascade wrapper keeps no fixed-address index "
                             "buffers; capture run() of a plan and re-capture after each plan()")
        super().__init__(float_workspace_buffer, kv_layout, False)
        self._levels: List[Any] = []          # per level: the device index arrays (kept alive)
        self._level_structs: Any = None       # ctypes array of CascadeLevel

    # -- plan -----------------------------------------------------------------------------------

    def _level_list(self, values: Sequence[ArrayLike], name: str) -> Sequence[ArrayLike]:
        if not isinstance(values, (list, tuple)) or len(values) != self._num_levels:
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(f"'{name}': expected a list of num_levels = {self._num_levels} "
                             f"arrays, got {count}")
        return values

    def plan(self, qo_indptr_arr: Sequence[ArrayLike], paged_kv_indptr_arr: Sequence[ArrayLike],
             paged_kv_indices_arr: Sequence[ArrayLike],
             paged_kv_last_page_len: Sequence[ArrayLike], num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1,
             logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, *, head_dim_vo: Optional[int] = None,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Plans every level (arguments as in FlashInfer; ``causal`` applies to the last
        level). Nothing of the wrapper changes when an argument is rejected."""
        del use_fp16_qk_reduction, q_data_type, kv_data_type
        _check_pos_encoding(pos_encoding_mode, rope_scale, rope_theta)
        _check_head_dim_vo(head_dim, head_dim_vo)
        lists = [self._level_list(values, name) for values, name in (
            (qo_indptr_arr, "qo_indptr_arr"), (paged_kv_indptr_arr, "paged_kv_indptr_arr"),
            (paged_kv_indices_arr, "paged_kv_indices_arr"),
            (paged_kv_last_page_len, "paged_kv_last_page_len"))]
        hosts = []
        for level in range(self._num_levels):
            arrays = []
            for values, array_name in zip(lists, _LEVEL_ARRAYS):
                arrays.append(to_host_int32(values[level], f"{array_name}[{level}]").reshape(-1))
            hosts.append(arrays)
        lengths = (_capi.CascadeLevelLengths * self._num_levels)()
        for level, (qo, indptr, _, last) in enumerate(hosts):
            if indptr.size != qo.size or last.size + 1 != qo.size:
                raise ValueError(
                    f"level {level}: expected paged_kv_indptr of {qo.size} values and "
                    f"paged_kv_last_page_len of {qo.size - 1} (one per group of qo_indptr), got "
                    f"{indptr.size} and {last.size}")
            lengths[level] = _capi.CascadeLevelLengths(
                qo.ctypes.data_as(_I32P), indptr.ctypes.data_as(_I32P),
                last.ctypes.data_as(_I32P), max(qo.size - 1, 0))
        options = attention_options(causal, window_left, -1, logits_soft_cap, sm_scale, k_scale,
                                    v_scale, names=_OPTION_ARG_NAMES)
        handle = ctypes.c_void_p()
        check(_capi.lib().tessera_plan_cascade(
            lengths, self._num_levels, _int_arg(page_size, "page_size"),
            _int_arg(num_qo_heads, "num_qo_heads"), _int_arg(num_kv_heads, "num_kv_heads"),
            _int_arg(head_dim, "head_dim"), ctypes.byref(options), self._device[0],
            self._device[1], ctypes.byref(handle)), _CASCADE_PLAN_NAMES)
        plan = CascadePlan(handle)
        self._check_workspace(plan)
        device_arrays = [[self._on_device(array) for array in arrays] for arrays in hosts]
        descriptors = [[to_dl(array, name) for array, name in zip(arrays, _LEVEL_ARRAYS)]
                       for arrays in device_arrays]
        structs = (_capi.CascadeLevel * self._num_levels)()
        for level, dls in enumerate(descriptors):
            structs[level] = _capi.CascadeLevel(*(ctypes.pointer(dl) for dl in dls))
        self._upload(plan, self._workspace, self._workspace_dl, self._workspace_ptr,
                     self._workspace_bytes)
        self._plan = plan
        self._options = options
        self._levels = [device_arrays, descriptors]
        self._level_structs = structs

    def _on_device(self, host: np.ndarray) -> Any:
        return from_numpy(host if host.size else np.zeros(1, np.int32), self._workspace,
                          self._workspace_dl)

    def _upload(self, plan: Any, workspace: ArrayLike, workspace_dl: DLTensor, pointer: int,
                nbytes: int) -> None:
        """On a GPU, copies every level's work lists into the workspace (one async copy per
        level), so run() launches kernels only."""
        if self._device[0] == kDLCUDA:
            check(_capi.lib().tessera_cascade_plan_upload(
                plan.handle, pointer, nbytes, stream_arg(stream_of(workspace, workspace_dl))))

    def _arm_fast(self) -> None:
        self._fast = None  # run() always takes the ctypes path

    # -- run ------------------------------------------------------------------------------------

    def run(self, q: ArrayLike, paged_kv_cache: Any, *, out: Optional[ArrayLike] = None,
            lse: Optional[ArrayLike] = None, return_lse: bool = False,
            sinks: Optional[ArrayLike] = None, enable_pdl: Optional[bool] = None
            ) -> Union[ArrayLike, Tuple[ArrayLike, ArrayLike]]:
        """Cascade attention of ``q`` ``[total_q, num_qo_heads, head_dim]`` against the cache
        (``(k_cache, v_cache)`` or one ``[num_pages, 2, ...]`` tensor). ``sinks``: optional
        float32 ``[num_qo_heads]`` attention sinks (joined once); ``enable_pdl`` as in the other
        wrappers."""
        plan = self._require_plan()
        q_dl = cached_dl(q, "q")
        if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
            k_dl = cached_dl(paged_kv_cache[0], "k_cache")
            v_dl = cached_dl(paged_kv_cache[1], "v_cache")
        else:
            k_dl, v_dl = split_paged_kv_cache(paged_kv_cache)
        out, o_dl, lse, lse_dl = self._outputs(q, q_dl, out, lse, return_lse)
        options = _capi.run_options(None if sinks is None else cached_dl(sinks, "sinks"),
                                    bool(enable_pdl))
        status = _capi.lib().tessera_run_cascade(
            plan.handle, q_dl, k_dl, v_dl, self._layout, self._level_structs, self._num_levels,
            o_dl, lse_dl, self._workspace_ptr, self._workspace_bytes,
            None if q_dl._cuda is None else self._stream(q, q_dl), ctypes.byref(options))
        if status:
            check(status, _RUN_NAMES)
        return (out, lse) if return_lse else out

    forward = run
    begin_forward = plan
