"""Argument names and checks the wrappers' plan() and run() share: the C ABI's argument names
mapped to the Python ones for its error messages, and the checks of the FlashInfer arguments
Tessera does not serve."""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import numpy as np

ArrayLike = Any
_I32P = ctypes.POINTER(ctypes.c_int32)

_PLAN_NAMES = {
    "qo_indptr_host": "qo_indptr",
    "kv_indptr_host": "kv_indptr",
    "page_indptr_host": "paged_kv_indptr",
    "last_page_len_host": "paged_kv_last_page_len",
    "page_indptr": "paged_kv_indptr",
    "last_page_len": "paged_kv_last_page_len",
    "options.window_left": "window_left",
    "options.logits_soft_cap": "logits_soft_cap",
    "options.sm_scale": "sm_scale",
    "options.k_scale": "k_scale",
    "options.v_scale": "v_scale",
    "head_dim": "head_dim",
}
_RUN_NAMES = {
    "o": "out",
    "page_indptr": "paged_kv_indptr (plan)",
    "page_indices": "paged_kv_indices (plan)",
    "last_page_len": "paged_kv_last_page_len (plan)",
    "workspace": "float_workspace_buffer",
    "run_options.custom_mask": "custom_mask / packed_custom_mask (plan)",
    "run_options.mask_indptr": "mask_indptr (plan)",
    "run_options.tree_mask": "tree_mask (plan)",
}
_OPTION_ARG_NAMES = ("window_left", "logits_soft_cap", "sm_scale", "k_scale")


def _int_arg(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"'{name}': expected an int, got {value!r}")
    return int(value)


def _check_pos_encoding(pos_encoding_mode: str, rope_scale: Any, rope_theta: Any) -> None:
    if pos_encoding_mode != "NONE":
        raise ValueError(
            f"'pos_encoding_mode': only \"NONE\" is supported, got {pos_encoding_mode!r}; apply "
            "RoPE before attention with tessera.apply_rope_inplace / apply_rope_pos_ids_inplace "
            "(or fused into append_paged_kv_cache)"
        )
    del rope_scale, rope_theta


def _check_head_dim_vo(head_dim_qk: int, head_dim_vo: Optional[int]) -> None:
    """For the wrappers that keep equal widths (decode, cascade)."""
    if head_dim_vo is not None and head_dim_vo != head_dim_qk:
        raise ValueError(f"'head_dim_vo': must equal head_dim_qk ({head_dim_qk}), got "
                         f"{head_dim_vo}")


def _head_dim_vo(head_dim_vo: Optional[int]) -> int:
    """The prefill wrappers' head_dim_vo for tessera_plan_options (0: head_dim_qk); its range
    is checked by the C ABI, which names options.head_dim_vo."""
    return 0 if head_dim_vo is None else _int_arg(head_dim_vo, "head_dim_vo")
