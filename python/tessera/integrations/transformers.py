"""Hugging Face transformers attention backend ``"tessera"`` (transformers >= 4.48).

Usage::

    import tessera.integrations.transformers as tessera_hf
    tessera_hf.register()                       # adds "tessera" to AttentionInterface
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="tessera")
    # or, on a loaded model: model.set_attn_implementation("tessera") (transformers >= 4.54),
    # or model.config._attn_implementation = "tessera"

What it serves (anything else raises ValueError instead of computing a wrong answer):

* causal self-attention (``module.is_causal``) and non-causal attention, prefill and decode with
  the dynamic KV cache, GQA/MQA, ``scaling``, ``sliding_window`` and ``softcap`` keyword arguments
  (Mistral, Gemma 2 style);
* masks: none (causal from ``module.is_causal`` when there is more than one query), a 2-D
  padding mask ``[batch, kv_len]``, or a 4-D mask that is exactly "causal (if the module is) and
  a contiguous range of valid keys per row" (plus the sliding window) — left or right padding.
  Other 4-D masks (custom patterns, per-head masks) are rejected;
* packed sequences when transformers passes FlashAttention-2 style ``cu_seq_lens_q`` /
  ``cu_seq_lens_k`` keyword arguments (batch size 1).

Without padding, the key/value tensors ``[batch, num_kv_heads, kv_len, head_dim]`` are used in
place as an HND paged cache with one page per sequence: no copy and no host synchronisation.
The plan is cached across layers, and its work lists are uploaded once per plan (one async copy)
into a workspace kept per CUDA device and stream, so each layer's run only launches kernels.
While a CUDA graph is being captured the run copies the lists itself instead (recorded into the
graph), and plans used by a capture are kept alive for its replays. With padding, the valid rows
are gathered into a ragged batch (one host read of the mask per forward, cached across layers)
and scattered back; padded query rows get zeros.
"""

from __future__ import annotations

import ctypes
import weakref
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .. import _capi, _fast
from .._capi import Plan, check, kDLCPU, kDLCUDA
from .._common import attention_options, paged_kv, stream_arg, stream_capture_id
from .._dlpack import to_dl, torch_stream, torch_stream_capturing
from ..attention import varlen_attention
from ..wrappers import NOT_SERVED, fast_run

__all__ = ["register", "tessera_attention_forward", "ATTENTION_NAME"]

ATTENTION_NAME = "tessera"
_I32P = ctypes.POINTER(ctypes.c_int32)
_MAX_PLANS = 32


def register(name: str = ATTENTION_NAME) -> str:
    """Registers the backend under ``name`` in transformers' ``AttentionInterface`` (and, where
    transformers has one, a mask function in ``AttentionMaskInterface`` that hands the attention
    the 2-D padding mask, or None without padding). Returns ``name``."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        try:  # transformers 4.48 / 4.49: a plain dict
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError as error:
            raise ImportError("tessera.integrations.transformers needs transformers >= 4.48 "
                              "(AttentionInterface / ALL_ATTENTION_FUNCTIONS)") from error
        ALL_ATTENTION_FUNCTIONS[name] = tessera_attention_forward
    else:
        AttentionInterface.register(name, tessera_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return name  # transformers < 4.53 builds 4-D masks, which the backend converts
    try:
        from transformers.masking_utils import flash_attention_mask as mask_function
    except ImportError:
        mask_function = _padding_mask
    AttentionMaskInterface.register(name, mask_function)
    return name


def _padding_mask(*args: Any, attention_mask: Optional[Any] = None,
                  kv_length: Optional[int] = None, **kwargs: Any) -> Optional[Any]:
    """The 2-D boolean padding mask sliced to the last ``kv_length`` keys, or None without
    padding (the form FlashAttention-2's mask function produces)."""
    if attention_mask is None:
        return None
    if kv_length is not None:
        attention_mask = attention_mask[:, -kv_length:]
    return None if bool(attention_mask.all()) else attention_mask


# ---------------------------------------------------------------------------------------------
# mask analysis


class _MaskCache:
    """The key ranges of the last mask seen (one host read per forward, shared by the layers).
    Keyed by the tensor object (weakly) and its version counter, so an in-place change or a new
    mask at the same address is never mistaken for the cached one."""

    def __init__(self) -> None:
        self.ref: Optional[weakref.ReferenceType] = None
        self.key: Tuple = ()
        self.value: Optional[Tuple[np.ndarray, np.ndarray]] = None

    def get(self, mask: Any, key: Tuple):
        if self.ref is not None and self.ref() is mask and self.key == key:
            return True, self.value
        return False, None

    def put(self, mask: Any, key: Tuple, value) -> None:
        self.ref = weakref.ref(mask)
        self.key = key
        self.value = value


_MASK_CACHE = _MaskCache()


def _key_ranges(torch: Any, valid: Any) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a boolean [B, S] tensor: (count, first, end) per row on the host (one transfer)."""
    length = valid.shape[-1]
    positions = torch.arange(length, device=valid.device)
    count = valid.sum(dim=-1)
    first = torch.where(valid, positions, length).amin(dim=-1)
    end = torch.where(valid, positions + 1, 0).amax(dim=-1)
    stats = torch.stack([count, first, end]).to("cpu").numpy()
    return stats[0], stats[1], stats[2]


def _valid_ranges(torch: Any, attention_mask: Any, batch: int, seqlen_q: int, seqlen_kv: int,
                  causal: bool, window_left: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """None when every key is valid (plain causal / full attention), else per-row valid key
    ranges [start, end). Raises ValueError for masks that are not causal (+ sliding window) with
    contiguous padding."""
    if attention_mask is None:
        return None
    key = (tuple(attention_mask.shape), attention_mask.dtype, attention_mask._version,
           seqlen_q, seqlen_kv, causal, window_left)
    hit, value = _MASK_CACHE.get(attention_mask, key)
    if hit:
        return value
    mask = attention_mask
    if mask.dim() == 2:
        if mask.shape[0] != batch or mask.shape[1] < seqlen_kv:
            raise ValueError(f"'attention_mask': expected a 2-D padding mask [{batch}, >= "
                             f"{seqlen_kv}], got {list(mask.shape)}")
        valid = mask[:, -seqlen_kv:].bool()
        count, first, end = _key_ranges(torch, valid)
        check_pattern = None
    elif mask.dim() == 4:
        if mask.shape[0] != batch or mask.shape[1] != 1 or mask.shape[2] != seqlen_q:
            raise ValueError(
                f"'attention_mask': expected a 4-D mask [{batch}, 1, {seqlen_q}, kv_len], got "
                f"{list(mask.shape)} (per-head masks are not supported by the tessera backend)")
        if mask.shape[3] < seqlen_kv:
            raise ValueError(f"'attention_mask': its last dimension {mask.shape[3]} is shorter "
                             f"than the {seqlen_kv} keys")
        mask = mask[:, 0, :, :seqlen_kv]  # as eager attention slices it
        visible = mask if mask.dtype == torch.bool else mask == 0
        # Keys some query sees: with causal + window + padding, a contiguous range per row.
        count, first, end = _key_ranges(torch, visible.any(dim=1))
        check_pattern = visible
    else:
        raise ValueError(f"'attention_mask': expected None, a 2-D padding mask or a 4-D mask, got "
                         f"{mask.dim()} dimensions")
    count = count.astype(np.int64)
    empty = count == 0
    start = np.where(empty, 0, first).astype(np.int64)
    stop = np.where(empty, 0, end).astype(np.int64)
    if (stop - start != count).any():
        raise ValueError("'attention_mask': the valid keys of a row are not contiguous; the "
                         "tessera backend supports causal masks with left or right padding only")
    if check_pattern is not None:
        device = check_pattern.device
        positions = torch.arange(seqlen_kv, device=device)
        start_t = torch.from_numpy(start).to(device)[:, None, None]
        stop_t = torch.from_numpy(stop).to(device)[:, None, None]
        expected = (positions >= start_t) & (positions < stop_t)
        rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_kv - seqlen_q)
        if causal:
            expected = expected & (positions[None, :] <= rows)[None]
        if window_left >= 0:
            expected = expected & (positions[None, :] >= rows - window_left)[None]
        if not bool((expected == check_pattern).all()):
            raise ValueError(
                "'attention_mask': this 4-D mask is not a "
                + ("causal " if causal else "")
                + "mask with contiguous padding; arbitrary masks are not supported by the tessera "
                "backend (use attn_implementation='sdpa' for them)")
    if (start == 0).all() and (stop == seqlen_kv).all():
        value = None
    else:
        value = (start, stop)
    _MASK_CACHE.put(attention_mask, key, value)
    return value


# ---------------------------------------------------------------------------------------------
# the dense (no padding) path: K/V used in place as an HND cache with one page per sequence


class _DensePlan:
    __slots__ = ("plan", "decode", "tensors", "dls", "runner")

    def __init__(self, plan: Plan, decode: bool, tensors: Tuple, dls: Tuple) -> None:
        self.plan = plan
        self.decode = decode
        self.tensors = tensors  # device index arrays (kept alive)
        self.dls = dls  # (page_indptr, page_indices, last_page_len, qo_indptr or None)
        # ((workspace pointer, bytes), the C fast path's runner for this plan on it, or None)
        self.runner: Optional[Tuple[Tuple[int, int], Any]] = None


# Plans by shape, device and stream (the index arrays are written on that stream, and a plan is
# uploaded into that stream's workspace); the last _MAX_PLANS are kept.
_PLANS: "OrderedDict[Tuple, _DensePlan]" = OrderedDict()
# Plans run during a CUDA graph capture, by (capture id, plan key): the captured run copies the
# work lists from the plan's host memory and reads its index arrays on every replay, so these
# are never freed (the graph's lifetime is not visible from here). The layers of one capture
# share one plan per shape: a model's capture keeps a plan per shape, not one per layer.
_GRAPH_PLANS: Dict[Tuple, _DensePlan] = {}


def _dense_plan(torch: Any, device: Any, stream: int, capture: Optional[int], batch: int,
                seqlen_q: int, seqlen_kv: int, heads: int, kv_heads: int, dim: int,
                options: _capi.AttentionOptions) -> _DensePlan:
    """The plan of a dense batch. capture: None outside a CUDA graph capture, else the id of the
    capture in progress on the stream (0 when CUDA reports none active, e.g. an invalidated
    capture: its plans are then neither shared nor cached)."""
    key = (str(device), stream, batch, seqlen_q, seqlen_kv, heads, kv_heads, dim, options.causal,
           options.window_left, options.logits_soft_cap, options.sm_scale)
    if capture:
        entry = _GRAPH_PLANS.get((capture,) + key)
        if entry is not None:
            return entry  # an earlier layer of this capture made or took it
    entry = _PLANS.get(key)
    if entry is not None:
        _PLANS.move_to_end(key)
        if capture:
            _GRAPH_PLANS[(capture,) + key] = entry
        return entry
    device_type, device_id = (kDLCUDA, device.index or 0) if device.type == "cuda" else (kDLCPU, 0)
    page_indptr = np.arange(batch + 1, dtype=np.int32)
    last_page_len = np.full(batch, seqlen_kv, np.int32)
    handle = ctypes.c_void_p()
    library = _capi.lib()
    decode = seqlen_q <= 64
    qo_indptr = None
    if decode:
        check(library.tessera_plan_decode(
            page_indptr.ctypes.data_as(_I32P), last_page_len.ctypes.data_as(_I32P), batch,
            seqlen_kv, heads, kv_heads, dim, seqlen_q, ctypes.byref(options), device_type,
            device_id, ctypes.byref(handle)))
    else:
        qo_indptr = (np.arange(batch + 1, dtype=np.int64) * seqlen_q).astype(np.int32)
        check(library.tessera_plan_paged_prefill(
            qo_indptr.ctypes.data_as(_I32P), page_indptr.ctypes.data_as(_I32P),
            last_page_len.ctypes.data_as(_I32P), batch, seqlen_kv, heads, kv_heads, dim,
            ctypes.byref(options), device_type, device_id, ctypes.byref(handle)))
    plan = Plan(handle)
    # The same values on the device, written by kernels on the current stream: no host copy, so
    # no synchronisation (a pageable copy would wait for the stream). One page per sequence:
    # page i is sequence i, so page_indices is page_indptr without its last entry.
    int32 = torch.int32
    device_indptr = torch.arange(batch + 1, dtype=int32, device=device)
    tensors = [device_indptr, device_indptr[:-1],
               torch.full((batch,), seqlen_kv, dtype=int32, device=device)]
    if qo_indptr is not None:
        tensors.append(torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=int32,
                                    device=device))
    dls = tuple(to_dl(tensor, "index") for tensor in tensors)
    if qo_indptr is None:
        dls = dls + (None,)
    entry = _DensePlan(plan, decode, tuple(tensors), dls)
    if capture is not None:
        # Made inside a capture: the index arrays get their values only when the graph replays
        # (before the first layer that uses them), so this plan serves this capture only (an
        # invalidated capture, which will not replay, shares and keeps nothing).
        if capture:
            _GRAPH_PLANS[(capture,) + key] = entry
        return entry
    _PLANS[key] = entry
    while len(_PLANS) > _MAX_PLANS:
        _PLANS.popitem(last=False)
    return entry


class _Workspace:
    """A workspace shared by the dense path's runs on one CUDA device and stream (they use it one
    after the other in stream order), and the plan whose work lists it holds (uploaded by
    tessera_plan_upload)."""

    __slots__ = ("buffer", "pointer", "nbytes", "uploaded")

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.pointer = buffer.data_ptr()
        self.nbytes = buffer.numel()
        self.uploaded: Optional[_DensePlan] = None


# By (device index, stream), least recently used first; at most _MAX_WORKSPACES are kept.
_WORKSPACES: "OrderedDict[Tuple[int, int], _Workspace]" = OrderedDict()
_MAX_WORKSPACES = 8
_MIN_WORKSPACE_BYTES = 1 << 20


def _shared_workspace(torch: Any, device: Any, stream: int, entry: _DensePlan) -> _Workspace:
    """The workspace of (device, stream) holding ``entry``'s work lists: grown when the plan
    needs more (to a power of two, so a growing decode reallocates rarely), and uploaded into
    (one async copy from pinned staging) when another plan was uploaded last. run() checks that
    the workspace still holds the plan's upload and otherwise copies the lists itself, so this
    bookkeeping decides only whether runs launch kernels alone."""
    key = (device.index or 0, stream)
    workspace = _WORKSPACES.get(key)
    if workspace is not None:
        _WORKSPACES.move_to_end(key)
    needed = entry.plan.workspace_bytes
    if workspace is None or workspace.nbytes < needed:
        # The dropped buffer's memory may come back at the same address (another workspace, a
        # capture's): the library must not take it for holding the plans uploaded there.
        if workspace is not None:
            _capi.lib().tessera_workspace_forget_uploads(workspace.pointer)
        elif len(_WORKSPACES) >= _MAX_WORKSPACES:
            _, evicted = _WORKSPACES.popitem(last=False)  # the least recently used stream's
            _capi.lib().tessera_workspace_forget_uploads(evicted.pointer)
        # A dropped buffer goes back to torch's caching allocator, which hands it out again only
        # in order on the stream it was allocated on (this one): safe while runs are in flight.
        capacity = max(_MIN_WORKSPACE_BYTES, 1 << max(needed - 1, 0).bit_length())
        workspace = _Workspace(torch.empty(capacity, dtype=torch.uint8, device=device))
        _WORKSPACES[key] = workspace
    if workspace.uploaded is not entry:
        check(_capi.lib().tessera_plan_upload(entry.plan.handle, workspace.pointer,
                                              workspace.nbytes, stream_arg(stream)))
        workspace.uploaded = entry
    return workspace


def _fast_runner(entry: _DensePlan, shared: _Workspace, device_index: int) -> Any:
    """The C fast path's runner of ``entry``'s plan on ``shared`` (made once per plan and
    workspace), or None when the extension is not in use."""
    where = (shared.pointer, shared.nbytes)
    cached = entry.runner
    if cached is not None and cached[0] == where:
        return cached[1]
    index = entry.dls if not entry.decode else entry.dls[:3]
    symbol = "tessera_run_decode" if entry.decode else "tessera_run_paged_prefill"
    # The runner holds the plan and index arrays, not the workspace: it is used only while
    # `shared` (which holds the buffer) still has this pointer and size.
    runner = _fast.runner(symbol, entry.plan, shared.pointer, shared.nbytes,
                          _capi.TESSERA_KV_LAYOUT_HND, list(index), None, (kDLCUDA, device_index))
    entry.runner = (where, runner)
    return runner


def _dense_attention(torch: Any, query: Any, key: Any, value: Any,
                     options: _capi.AttentionOptions, sinks: Optional[Any] = None) -> Any:
    batch, heads, seqlen_q, dim = query.shape
    kv_heads, seqlen_kv = key.shape[1], key.shape[2]
    device = query.device
    q_rows = query.transpose(1, 2)
    if q_rows.stride(-1) != 1:
        q_rows = q_rows.contiguous()
    q_rows = q_rows.reshape(batch * seqlen_q, heads, dim)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    cuda = device.type == "cuda"
    device_index = (device.index or 0) if cuda else 0
    stream = torch_stream(device_index) if cuda else 0
    capturing = cuda and torch_stream_capturing(device_index)
    capture = stream_capture_id(stream) if capturing else None
    entry = _dense_plan(torch, device, stream, capture, batch, seqlen_q, seqlen_kv, heads,
                        kv_heads, dim, options)
    if cuda and not capturing:
        # Steady state: the shared workspace already holds this plan's lists (uploaded once per
        # plan, not once per layer), so the run only launches kernels.
        shared = _shared_workspace(torch, device, stream, entry)
        workspace, workspace_bytes = shared.buffer, shared.nbytes
        runner = _fast_runner(entry, shared, device_index)
        if runner is not None and sinks is None:
            # The C fast path, as the wrappers' run() takes it (tensors described, out allocated
            # and the C run called in one call).
            result = fast_run(runner, (q_rows, (key, value)))
            if result is not NOT_SERVED:
                return result.view(batch, seqlen_q, heads, dim)
            # Not served (an argument the fast path does not describe): the ctypes path
    else:
        # CPU (runs may come from several threads at once), or a CUDA graph capture: a fresh
        # workspace (from the graph's pool when capturing) without an upload, so the captured
        # run copies the lists itself from the plan's host memory, which _GRAPH_PLANS keeps.
        workspace_bytes = entry.plan.workspace_bytes
        workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device=device)
        if capturing:
            # Fresh memory, possibly at the address of a dropped workspace that a warm plan was
            # uploaded into: the captured run must record the list copies, not trust that.
            _capi.lib().tessera_workspace_forget_uploads(workspace.data_ptr())
    q_dl = to_dl(q_rows, "query")
    out = torch.empty((batch, seqlen_q, heads, dim), dtype=query.dtype, device=device)
    o_dl = to_dl(out.view(batch * seqlen_q, heads, dim), "out", writable=True)
    page_indptr, page_indices, last_page_len, qo_indptr = entry.dls
    kv = paged_kv(to_dl(key, "key"), to_dl(value, "value"), page_indptr, page_indices,
                  last_page_len, _capi.TESSERA_KV_LAYOUT_HND)
    library = _capi.lib()
    stream_ptr = stream_arg(stream)
    run = _capi.run_options(None if sinks is None else to_dl(sinks, "s_aux"))
    if entry.decode:
        check(library.tessera_run_decode_v2(
            entry.plan.handle, ctypes.byref(q_dl), ctypes.byref(kv), ctypes.byref(o_dl), None,
            workspace.data_ptr(), workspace_bytes, stream_ptr, ctypes.byref(run)),
            {"sinks": "s_aux"})
    else:
        check(library.tessera_run_paged_prefill_v2(
            entry.plan.handle, ctypes.byref(q_dl), ctypes.byref(kv), ctypes.byref(qo_indptr),
            ctypes.byref(o_dl), None, workspace.data_ptr(), workspace_bytes, stream_ptr,
            ctypes.byref(run)), {"sinks": "s_aux"})
    return out


def _padded_attention(torch: Any, query: Any, key: Any, value: Any, ranges, causal: bool,
                      window_left: int, softcap: float, scaling: Optional[float],
                      sinks: Optional[Any] = None) -> Any:
    batch, heads, seqlen_q, dim = query.shape
    kv_heads, seqlen_kv = key.shape[1], key.shape[2]
    start, stop = ranges
    offset = seqlen_kv - seqlen_q  # query i sits at key position offset + i
    q_first = np.clip(start - offset, 0, seqlen_q)
    q_last = np.clip(stop - offset, 0, seqlen_q)
    q_last = np.maximum(q_last, q_first)
    q_index = np.concatenate([b * seqlen_q + np.arange(q_first[b], q_last[b])
                              for b in range(batch)]).astype(np.int64)
    k_index = np.concatenate([b * seqlen_kv + np.arange(start[b], stop[b])
                              for b in range(batch)]).astype(np.int64)
    q_lens = (q_last - q_first).astype(np.int64)
    kv_lens = (stop - start).astype(np.int64)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    device = query.device
    # Stream-ordered copies without a host synchronisation (the driver stages pageable memory
    # before the call returns; see _dlpack.from_numpy).
    q_index_t = torch.from_numpy(q_index).to(device, non_blocking=True)
    k_index_t = torch.from_numpy(k_index).to(device, non_blocking=True)
    q_rows = query.transpose(1, 2).reshape(batch * seqlen_q, heads, dim).index_select(0, q_index_t)
    k_rows = key.transpose(1, 2).reshape(batch * seqlen_kv, kv_heads, dim).index_select(0,
                                                                                     k_index_t)
    v_rows = value.transpose(1, 2).reshape(batch * seqlen_kv, kv_heads, dim).index_select(
        0, k_index_t)
    packed = varlen_attention(q_rows, k_rows, v_rows, cu_q, cu_k, softmax_scale=scaling,
                              causal=causal, window_size=(window_left, -1), softcap=softcap,
                              sinks=sinks)
    out = torch.zeros((batch * seqlen_q, heads, dim), dtype=query.dtype, device=device)
    out.index_copy_(0, q_index_t, packed)
    return out.view(batch, seqlen_q, heads, dim)


def _sinks_of(torch: Any, kwargs: dict, query: Any) -> Optional[Any]:
    """gpt-oss's attention sinks (``s_aux``: the module's ``sinks`` parameter, one logit per
    query head in the units of the scaled scores, concatenated to the logits before the softmax
    and dropped after it, as Tessera's sinks are defined) as float32 ``[num_heads]`` on the
    query's device, or None."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is None:
        return None
    heads = query.shape[1]
    sinks = sinks.detach().to(device=query.device, dtype=torch.float32).reshape(-1).contiguous()
    if sinks.shape[0] != heads:
        raise ValueError(f"'s_aux': expected one sink per query head ({heads}), got "
                         f"{list(sinks.shape)}")
    return sinks


def tessera_attention_forward(module: Any, query: Any, key: Any, value: Any,
                              attention_mask: Optional[Any], scaling: Optional[float] = None,
                              dropout: float = 0.0, **kwargs: Any) -> Tuple[Any, None]:
    """The ``AttentionInterface`` function: ``query`` ``[B, H, S_q, D]``, ``key``/``value``
    ``[B, H_kv, S_kv, D]`` -> ``(attn_output [B, S_q, H, D], None)``."""
    import torch

    if dropout and getattr(module, "training", False):
        raise ValueError("'dropout': the tessera backend is for inference (dropout must be 0)")
    sinks = _sinks_of(torch, kwargs, query)
    if kwargs.get("output_attentions"):
        raise ValueError("'output_attentions': the tessera backend does not return attention "
                         "weights (use attn_implementation='eager')")
    batch, heads, seqlen_q, dim = query.shape
    if key.dim() != 4 or key.shape[0] != batch or key.shape[3] != dim:
        raise ValueError(f"'key': expected [{batch}, num_kv_heads, kv_len, {dim}], got "
                         f"{list(key.shape)}")
    seqlen_kv = key.shape[2]
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal) and seqlen_q > 1
    sliding_window = kwargs.get("sliding_window")
    window_left = -1 if not sliding_window else int(sliding_window) - 1
    softcap = float(kwargs.get("softcap") or 0.0)
    cu_seqlens_q, cu_seqlens_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_seqlens_q is not None and cu_seqlens_k is not None:
        # Packed sequences (FlashAttention-2 style kwargs from transformers): one ragged batch.
        if batch != 1:
            raise ValueError("'cu_seq_lens_q': packed sequences need batch size 1")
        kv_heads = key.shape[1]
        out = varlen_attention(
            query.transpose(1, 2).reshape(seqlen_q, heads, dim),
            key.transpose(1, 2).reshape(seqlen_kv, kv_heads, dim),
            value.transpose(1, 2).reshape(seqlen_kv, kv_heads, dim),
            cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), softmax_scale=scaling,
            causal=bool(is_causal), window_size=(window_left, -1), softcap=softcap,
            sinks=sinks)
        return out.view(batch, seqlen_q, heads, dim), None
    ranges = _valid_ranges(torch, attention_mask, batch, seqlen_q, seqlen_kv, causal, window_left)
    if ranges is None:
        options = attention_options(causal, window_left, -1, softcap, scaling)
        out = _dense_attention(torch, query, key, value, options, sinks)
    else:
        out = _padded_attention(torch, query, key, value, ranges, causal, window_left, softcap,
                                scaling, sinks)
    return out, None
