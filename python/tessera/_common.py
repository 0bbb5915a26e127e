"""Helpers shared by the FlashAttention-style functions, the FlashInfer-style wrappers and the
ops: option structs, paged-KV descriptors, small index arrays."""

from __future__ import annotations

import ctypes
import math
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _capi
from ._capi import AttentionOptions, PagedKV, TESSERA_KV_LAYOUT_HND, TESSERA_KV_LAYOUT_NHD
from ._dlpack import DLTensor, select, shape_of, to_dl


def attention_options(
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    logits_soft_cap: Optional[float] = 0.0,
    sm_scale: Optional[float] = None,
    k_scale: Optional[float] = 1.0,
    v_scale: Optional[float] = 1.0,
    *,
    names: Tuple[str, str, str, str] = ("window_left", "logits_soft_cap", "sm_scale", "k_scale"),
) -> AttentionOptions:
    """The C options struct. ``sm_scale`` None means 1/sqrt(head_dim) (passed as 0);
    ``logits_soft_cap`` None or 0 disables the soft-cap. Values the C struct cannot hold are
    rejected here with the Python argument name (``names``); the library checks the rest."""
    window_name, cap_name, scale_name, kscale_name = names
    for value, name in ((window_left, window_name), (window_right, window_name)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"'{name}': expected an int (-1 = unbounded), got {value!r}")
        if not -(2**31) <= int(value) < 2**31:
            raise ValueError(f"'{name}': {value} does not fit in int32")
    scale = 0.0 if sm_scale is None else float(sm_scale)
    if sm_scale is not None and not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"'{scale_name}': expected a finite value > 0 (None = 1/sqrt(head_dim)), "
                         f"got {sm_scale!r}")
    options = AttentionOptions(
        1 if causal else 0,
        int(window_left),
        int(window_right),
        0.0 if logits_soft_cap is None else float(logits_soft_cap),
        scale,
        1.0 if k_scale is None else float(k_scale),
        1.0 if v_scale is None else float(v_scale),
    )
    return options


def window_pair(window_size: Any, name: str = "window_size") -> Tuple[int, int]:
    """FlashAttention's ``window_size=(left, right)``, -1 = unbounded."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"'{name}': expected a pair (left, right), got {window_size!r}") from None
    return left, right


def kv_layout_code(kv_layout: str) -> int:
    if kv_layout == "NHD":
        return TESSERA_KV_LAYOUT_NHD
    if kv_layout == "HND":
        return TESSERA_KV_LAYOUT_HND
    raise ValueError(f"'kv_layout': expected \"NHD\" or \"HND\", got {kv_layout!r}")


def split_paged_kv_cache(paged_kv_cache: Any, name: str = "paged_kv_cache"
                         ) -> Tuple[DLTensor, DLTensor]:
    """FlashInfer's ``paged_kv_cache``: a ``(k_cache, v_cache)`` pair of
    [num_pages, page_size, H_kv, D] (NHD) / [num_pages, H_kv, page_size, D] (HND) tensors, or one
    tensor [num_pages, 2, ...] holding K at index 0 and V at index 1 of dim 1."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"'{name}': expected (k_cache, v_cache), got {len(paged_kv_cache)} items")
        return to_dl(paged_kv_cache[0], "k_cache"), to_dl(paged_kv_cache[1], "v_cache")
    return split_combined_kv(to_dl(paged_kv_cache, name), name)


def split_combined_kv(both: DLTensor, name: str = "paged_kv_cache") -> Tuple[DLTensor, DLTensor]:
    """K and V views of one paged-KV tensor [num_pages, 2, ...] (K at index 0 of dim 1)."""
    shape = shape_of(both)
    if len(shape) != 5 or shape[1] != 2:
        raise ValueError(
            f"'{name}': expected a (k_cache, v_cache) tuple or one tensor [num_pages, 2, ...] of "
            f"5 dimensions, got shape {list(shape)}"
        )
    return select(both, 1, 0), select(both, 1, 1)


def paged_kv(k_cache: DLTensor, v_cache: DLTensor, page_indptr: DLTensor, page_indices: DLTensor,
             last_page_len: DLTensor, layout: int) -> PagedKV:
    """The ``tessera_paged_kv`` struct (keeps the descriptors alive)."""
    kv = PagedKV(
        ctypes.pointer(k_cache), ctypes.pointer(v_cache), ctypes.pointer(page_indptr),
        ctypes.pointer(page_indices), ctypes.pointer(last_page_len), layout,
    )
    return kv


def arange_int32(count: int, step: int = 1) -> np.ndarray:
    """[0, step, 2*step, ..., (count-1)*step] as int32."""
    return (np.arange(count, dtype=np.int64) * step).astype(np.int32)


def require_ndim(tensor: DLTensor, ndims: Sequence[int], name: str, layout: str) -> Tuple[int, ...]:
    shape = shape_of(tensor)
    if len(shape) not in ndims:
        raise ValueError(f"'{name}': expected {layout}, got shape {list(shape)}")
    return shape


def stream_arg(stream: Optional[int]) -> Optional[ctypes.c_void_p]:
    return None if not stream else ctypes.c_void_p(stream)


def stream_capture_id(stream: Optional[int]) -> int:
    """The id of the CUDA graph capture in progress on ``stream`` (a cudaStream_t as an int;
    unique per capture), 0 when it is not being captured or there is no CUDA device."""
    capture = ctypes.c_uint64()
    _capi.check(_capi.lib().tessera_stream_capture_id(stream_arg(stream), ctypes.byref(capture)))
    return capture.value


def lib() -> ctypes.CDLL:
    return _capi.lib()
