"""FlashInfer-style plan/run wrappers for serving:

* :class:`BatchPrefillWithRaggedKVCacheWrapper` — prefill over ragged K/V (``[total_kv, H, D]``).
* :class:`BatchPrefillWithPagedKVCacheWrapper` — chunked prefill / append over a paged KV cache.
* :class:`BatchDecodeWithPagedKVCacheWrapper` — batch decode (and speculative decoding with a few
  query tokens per request) over a paged KV cache.

``plan(...)`` takes the batch's index arrays (any framework; they are read on the host, once),
builds Tessera's work partition on the host and keeps it (an opaque ``tessera_plan``), and places
the index arrays on the workspace's device. ``run(q, ...)`` launches the kernels using the
user-owned ``float_workspace_buffer``: it never synchronises the host, never reads device memory
on the host and allocates nothing but its outputs (pass ``out=``/``lse=`` to allocate nothing).
A plan is reused by every ``run`` until the next ``plan`` (e.g. once per decode step, shared by
all layers).

``run`` costs about a microsecond of binding per call with the C extension ``tessera._fastcall``
(built with the library; see :mod:`._fast`): it reads each numpy / torch argument's data
pointer, shape, strides, dtype and device every call, fills the DLTensor descriptors on the C
stack and calls the C ABI directly. Without it (or for other frameworks, tensor subclasses, and
any argument it does not describe exactly as the ctypes path would) run() goes through ctypes, a
few microseconds: the DLPack descriptors of its arguments are cached, keyed on (data pointer,
shape, strides, dtype, device), so buffers that come back every step (static / preallocated
buffers, per-layer KV caches, ``out=``) are not re-described; a new buffer, or one reallocated
with another shape, gets a new descriptor. Both paths pass the same descriptors. Checks the C
library does itself (shapes, dtypes, devices against the plan) are left to it; its errors name
the Python argument.

The workspace is a byte buffer on the device the plans are for (FlashInfer allocates
``torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")``; on the CPU a numpy
``np.empty(n, np.uint8)`` works). ``plan`` raises ValueError naming ``float_workspace_buffer``
when the batch needs more than the buffer holds; :attr:`workspace_bytes_needed` reports the
amount.

CUDA graphs (``use_cuda_graph=True``): the index arrays are copied by ``plan`` into fixed-address
buffers owned by the wrapper (or passed to the constructor: ``paged_kv_indptr_buffer`` etc.),
sized by the first plan (or the buffers given), so the device addresses a captured ``run`` reads
never change. What is graph safe with the current C ABI:

* capturing ``run`` and replaying it with new *contents* of the fixed-address tensors: q, the
  KV cache pages, the page indices (``paged_kv_indices`` re-planned with the same lengths), and
  the output buffer the capture allocated;
* the plan's work list is uploaded by the captured ``run`` itself from the plan's host memory;
  the wrapper keeps every plan that was run during a capture alive, so a replay never reads
  freed memory.

Not graph safe: calling ``plan`` with *different lengths* (batch size, kv lengths / page counts,
query counts) and replaying a graph captured for the previous plan — the captured launches keep
the previous partition. Re-capture after such a ``plan`` (one graph per batch shape bucket).
Give a CUDA-graph wrapper a workspace of its own: each replay rewrites the workspace with the
captured plan's lists, which the library cannot see, so an eager wrapper sharing that buffer
would run with the captured plan's lists after a replay.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np

from . import _capi, _fast
from ._capi import Plan, check, kDLCUDA
from ._common import (
    attention_options,
    kv_layout_code,
    split_combined_kv,
    split_paged_kv_cache,
    stream_arg,
    stream_capture_id,
)
from ._dlpack import (
    _KIND_CACHE,
    DLTensor,
    cached_dl,
    contiguous_like,
    data_pointer,
    device_of,
    empty,
    framework,
    from_numpy,
    nbytes_of,
    numpy_data_pointer,
    shape_of,
    strides_of,
    stream_of,
    to_dl,
    to_host_int32,
    torch_stream_capturing,
    view,
)

__all__ = [
    "BatchPrefillWithRaggedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchDecodeWithPagedKVCacheWrapper",
]

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
}
_OPTION_ARG_NAMES = ("window_left", "logits_soft_cap", "sm_scale", "k_scale")
# Per-wrapper caches of derived structs (paged-KV structs, HND views) keyed on the cached
# descriptors they were made from; emptied when they grow past this (and on every plan).
_DERIVED_CACHE_LIMIT = 1024


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


def _check_no_custom_mask(custom_mask: Any, packed_custom_mask: Any) -> None:
    if custom_mask is not None or packed_custom_mask is not None:
        raise ValueError("'custom_mask': custom masks are not supported; use causal, window_left "
                         "or split the batch")


def _check_head_dim_vo(head_dim_qk: int, head_dim_vo: Optional[int]) -> None:
    if head_dim_vo is not None and head_dim_vo != head_dim_qk:
        raise ValueError(f"'head_dim_vo': must equal head_dim_qk ({head_dim_qk}), got "
                         f"{head_dim_vo}")


def _copy_into(buffer: Any, values: np.ndarray) -> None:
    """buffer[:len(values)] = values, for the fixed-address buffers of CUDA-graph mode."""
    kind = framework(buffer)
    count = values.shape[0]
    if kind == "torch":
        torch = sys.modules["torch"]
        buffer[:count].copy_(torch.from_numpy(values), non_blocking=True)
    elif kind == "cupy":
        buffer[:count].set(values)
    elif kind == "numpy":
        buffer[:count] = values
    else:
        raise ValueError("CUDA-graph buffers must be torch, cupy or numpy arrays")


class _IndexSlot:
    """One index array of a plan, on the plan's device. In CUDA-graph mode it lives in a
    fixed-address buffer (given or allocated by the first plan); otherwise the user's array is
    used as-is when it already is int32 on the right device, else a copy is made."""

    def __init__(self, name: str, buffer: Optional[ArrayLike], device: Tuple[int, int]) -> None:
        self.name = name
        self.buffer = buffer
        self.buffer_dl: Optional[DLTensor] = None if buffer is None else to_dl(
            buffer, name, writable=True)
        if self.buffer_dl is not None:
            # The run reads the buffer as count contiguous int32 values on the plan's device.
            dtype = self.buffer_dl.dtype
            if (self.buffer_dl.ndim != 1 or dtype.code != _capi.kDLInt or dtype.bits != 32
                    or (shape_of(self.buffer_dl)[0] > 1 and strides_of(self.buffer_dl)[0] != 1)
                    or device_of(self.buffer_dl) != device):
                raise ValueError(
                    f"'{name}' buffer: expected a 1-D contiguous int32 array on the workspace's "
                    f"device {device}, got shape {list(shape_of(self.buffer_dl))}, strides "
                    f"{list(strides_of(self.buffer_dl))}, dtype code {dtype.code} bits "
                    f"{dtype.bits}, device {device_of(self.buffer_dl)}")
        self.array: Optional[ArrayLike] = None  # keeps the device array alive
        self.dl: Optional[DLTensor] = None

    def stage(self, wrapper: "_Wrapper", original: ArrayLike,
              host: Optional[np.ndarray] = None) -> Callable[[], None]:
        """Converts and checks ``original`` (host copy ``host``, made here when None and needed)
        without changing the slot, and returns what puts it in place: plan() stages every array
        before it changes anything, so a bad one leaves the previous plan whole."""
        if not wrapper._use_cuda_graph and not isinstance(original, (list, tuple, range)):
            original_dl = to_dl(original, self.name)
            dtype = original_dl.dtype
            if (device_of(original_dl) == wrapper._device and dtype.code == _capi.kDLInt
                    and dtype.bits == 32 and original_dl.ndim == 1
                    and strides_of(original_dl)[0] == 1):
                return lambda: self._set(original, original_dl)
        if host is None:
            host = to_host_int32(original, self.name).reshape(-1)
        count = int(host.shape[0])
        if wrapper._use_cuda_graph:
            buffer, buffer_dl = self.buffer, self.buffer_dl
            if buffer is None:
                buffer = empty(wrapper._workspace, wrapper._workspace_dl, (max(count, 1),),
                               "int32", self.name)
                buffer_dl = to_dl(buffer, self.name, writable=True)
            assert buffer_dl is not None
            capacity = shape_of(buffer_dl)[0]
            if count > capacity:
                raise ValueError(
                    f"'{self.name}': {count} entries do not fit in its CUDA-graph buffer of "
                    f"{capacity}; pass a larger buffer to the constructor or plan the largest batch "
                    "first")

            def commit() -> None:
                self.buffer, self.buffer_dl = buffer, buffer_dl
                _copy_into(buffer, host)
                self._set(buffer, view(buffer_dl, (count,), (1,)))
            return commit
        array = from_numpy(host, wrapper._workspace, wrapper._workspace_dl)
        array_dl = to_dl(array, self.name)
        return lambda: self._set(array, array_dl)

    def _set(self, array: ArrayLike, dl: DLTensor) -> None:
        self.array, self.dl = array, dl


class _Wrapper:
    """State shared by the three wrappers: workspace, current plan, CUDA-graph bookkeeping.

    run() is the per-layer hot path (a few microseconds of Python around the C call): argument
    descriptors come from the descriptor cache (:func:`._dlpack.cached_dl`), structs derived from
    them are cached per wrapper, and everything the C ABI validates itself (shapes, dtypes,
    devices against the plan) is left to it; its errors name the Python argument."""

    _op = ""
    _run_symbol = ""

    def __init__(self, float_workspace_buffer: ArrayLike, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False) -> None:
        self._layout = kv_layout_code(kv_layout)
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._plan: Optional[Plan] = None
        self._plan_captured = False
        self._captured_plans: List[Plan] = []
        self._options = _capi.AttentionOptions()
        # Structs/views derived from cached descriptors (NHD views, paged-KV structs), keyed on
        # the ids of those descriptors, which each entry holds (so the ids are not reused).
        self._derived: dict = {}
        self._run_fn: Any = None  # the C run function, bound by plan()
        self._fast: Any = None  # the C fast path's runner of the current plan (see _fast.py)
        self.reset_workspace_buffer(float_workspace_buffer)

    # -- workspace ----------------------------------------------------------------------------

    def reset_workspace_buffer(self, float_workspace_buffer: ArrayLike, *unused: Any) -> None:
        """Replaces the workspace (FlashInfer's method; extra buffers are ignored). The current
        plan, if any, must fit it; its work lists are uploaded into it (GPU, outside CUDA-graph
        mode), so runs keep launching kernels only."""
        workspace_dl = to_dl(float_workspace_buffer, "float_workspace_buffer", writable=True)
        nbytes = nbytes_of(workspace_dl, "float_workspace_buffer")
        pointer = data_pointer(workspace_dl)
        device = device_of(workspace_dl)
        if self._plan is not None:
            if device != self._device:
                raise ValueError(f"'float_workspace_buffer': expected a buffer on the plan's "
                                 f"device {self._device}, got {device}")
            self._check_workspace(self._plan, nbytes)
            self._upload(self._plan, float_workspace_buffer, workspace_dl, pointer, nbytes)
        self._workspace = float_workspace_buffer
        self._workspace_dl = workspace_dl
        self._workspace_bytes = nbytes
        self._workspace_ptr = pointer
        self._device = device
        # run() asks whether a graph is being captured only in CUDA-graph mode on a GPU.
        self._watch_capture = self._use_cuda_graph and self._device[0] == kDLCUDA
        self._fast = None
        if self._plan is not None:
            self._arm_fast()

    def _check_workspace(self, plan: Plan, nbytes: Optional[int] = None) -> None:
        """``plan`` fits the workspace (of ``nbytes``; default: the current one)."""
        nbytes = self._workspace_bytes if nbytes is None else nbytes
        if plan.workspace_bytes > nbytes:
            raise ValueError(
                f"'float_workspace_buffer': this batch needs {plan.workspace_bytes} bytes of "
                f"workspace (tessera_plan_workspace_bytes), the buffer has {nbytes}; "
                "allocate a larger one")

    @property
    def workspace_bytes_needed(self) -> int:
        """Bytes of workspace the current plan needs (0 before ``plan``)."""
        return 0 if self._plan is None else self._plan.workspace_bytes

    @property
    def device(self) -> Tuple[int, int]:
        """(DLPack device type, id) the plans are made for: the workspace's device."""
        return self._device

    def explain(self) -> str:
        """How the current plan partitions the batch (``tessera plan --explain``)."""
        return self._require_plan().explain()

    # -- plan bookkeeping ---------------------------------------------------------------------

    def _new_plan(self, handle: ctypes.c_void_p) -> Plan:
        """The plan of a handle plan() just made, checked against the workspace (nothing of the
        wrapper changes yet)."""
        plan = Plan(handle)
        self._check_workspace(plan)
        return plan

    def _install(self, plan: Plan, options: _capi.AttentionOptions,
                 staged: List[Callable[[], None]]) -> None:
        """Makes ``plan`` current with its staged index arrays (plan() calls this only once
        everything has been converted and checked)."""
        # First what can fail: the upload (the previous plan, if it runs again, finds its lists
        # overwritten and uploads them itself).
        self._upload(plan, self._workspace, self._workspace_dl, self._workspace_ptr,
                     self._workspace_bytes)
        self._fast = None  # made again below, once the index arrays are in place
        if self._plan is not None and self._plan_captured:
            # A captured graph re-uploads this plan's lists from its host memory on replay.
            self._captured_plans.append(self._plan)
        self._plan = plan
        self._plan_captured = False
        self._options = options
        self._derived.clear()  # paged-KV structs point at the previous plan's index arrays
        self._run_fn = getattr(_capi.lib(), self._run_symbol)
        for put in staged:
            put()
        self._arm_fast()

    def _upload(self, plan: Plan, workspace: ArrayLike, workspace_dl: DLTensor, pointer: int,
                nbytes: int) -> None:
        """On a GPU outside CUDA-graph mode, copies the plan's work lists into the workspace
        (one async copy on the workspace's current stream), so run() launches kernels only. A
        run after another plan was uploaded into the same workspace (wrappers sharing a buffer)
        re-uploads by itself. CUDA-graph mode keeps the upload inside run(), so a captured graph
        replays the plan it was captured with."""
        if device_of(workspace_dl)[0] == kDLCUDA and not self._use_cuda_graph:
            _capi.check(_capi.lib().tessera_plan_upload(
                plan.handle, pointer, nbytes, stream_arg(stream_of(workspace, workspace_dl))))

    def _index_descriptors(self) -> List[DLTensor]:
        """The plan's index array descriptors in the order of the C run function."""
        raise NotImplementedError

    def _arm_fast(self) -> None:
        """Makes the C fast path's runner for the current plan, index arrays and workspace
        (None when the extension is not available)."""
        assert self._plan is not None
        self._fast = _fast.runner(self._run_symbol, self._plan, self._workspace_ptr,
                                  self._workspace_bytes, self._layout, self._index_descriptors(),
                                  self._workspace, self._device)

    def _require_plan(self) -> Plan:
        if self._plan is None:
            raise ValueError(f"'plan': call {type(self).__name__}.plan(...) before run()")
        return self._plan

    def _note_capture(self) -> None:
        if not self._use_cuda_graph or self._device[0] != kDLCUDA or self._plan_captured:
            return
        if framework(self._workspace) == "torch":
            captured = torch_stream_capturing(self._device[1])
        else:  # cupy and others: ask CUDA about the framework's current stream
            stream = stream_of(self._workspace, self._workspace_dl)
            captured = bool(stream) and stream_capture_id(stream) != 0
        if captured:
            self._plan_captured = True

    def _scales(self, k_scale: Optional[float], v_scale: Optional[float]) -> None:
        """run()'s k_scale/v_scale must be the planned ones (only called when one is given)."""
        for value, planned, name in ((k_scale, self._options.k_scale, "k_scale"),
                                     (v_scale, self._options.v_scale, "v_scale")):
            if value is not None and float(np.float32(value)) != planned:
                raise ValueError(f"'{name}': the plan was made with {name}={planned}; pass "
                                 f"{name} to plan() (it is part of the plan)")

    def _outputs(self, q: ArrayLike, q_dl: DLTensor, out: Optional[ArrayLike],
                 lse: Optional[ArrayLike], return_lse: bool):
        """run()'s outputs and their descriptors: ``out``/``lse`` when given (descriptors from
        the cache: the static-buffer pattern), else fresh arrays like q."""
        if out is None:
            kind = _KIND_CACHE.get(type(q))
            if kind == "numpy":
                out = np.empty(q.shape, q.dtype)
                o_dl = contiguous_like(q_dl, numpy_data_pointer(out))
            elif kind == "torch":
                out = sys.modules["torch"].empty(q.shape, dtype=q.dtype, device=q.device)
                o_dl = contiguous_like(q_dl, out.data_ptr())
            else:
                out = empty(q, q_dl, shape_of(q_dl))
                o_dl = to_dl(out, "out", writable=True)
        else:
            o_dl = cached_dl(out, "out", True)
        lse_dl = None
        if return_lse or lse is not None:
            if lse is None:
                lse = empty(q, q_dl, shape_of(q_dl)[:2], "float32", "lse")
                lse_dl = to_dl(lse, "lse", writable=True)
            else:
                lse_dl = cached_dl(lse, "lse", True)
        return out, o_dl, lse, lse_dl

    def _stream(self, q: ArrayLike, q_dl: DLTensor) -> Optional[ctypes.c_void_p]:
        return stream_arg(stream_of(q, q_dl))

    def _run_fast(self, inputs: tuple, out: Optional[ArrayLike], lse: Optional[ArrayLike],
                  return_lse: bool) -> Any:
        """run() through the C fast path: its result, or NOT_SERVED when the fast path hands
        the call back (an argument it does not describe exactly; the ctypes path decides).
        `inputs` are the run's inputs in the C order, q first."""
        if self._watch_capture:
            self._note_capture()  # before any launch: a capture must keep this plan alive
        return fast_run(self._fast, inputs, out, lse, return_lse)

    def _nhd(self, tensor: DLTensor, name: str) -> DLTensor:
        """The NHD view of an HND k/v descriptor (cached per descriptor)."""
        if not getattr(tensor, "_cached", False):  # holds its array: do not keep it
            return _hnd_to_nhd(tensor, name)
        derived = self._derived
        key = ("nhd", id(tensor))
        hit = derived.get(key)
        if hit is not None and hit[0] is tensor:
            return hit[1]
        result = _hnd_to_nhd(tensor, name)
        if len(derived) >= _DERIVED_CACHE_LIMIT:
            derived.clear()
        derived[key] = (tensor, result)
        return result


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
        by device); custom masks are not supported."""
        del backend
        _check_no_custom_mask(custom_mask_buf, mask_indptr_buf)
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
    ) -> None:
        """Plans the batch.

        Args:
            qo_indptr, kv_indptr: ``[batch_size + 1]`` cumulative query / key lengths.
            num_qo_heads, num_kv_heads, head_dim_qk: problem shape (``head_dim_vo`` must equal
                ``head_dim_qk``).
            causal: causal mask aligned bottom-right. window_left: sliding window (-1 = off).
            logits_soft_cap: soft-cap (None/0 = off). sm_scale: None = 1/sqrt(head_dim).
            k_scale, v_scale: fp8 KV dequantisation scales (Tessera extension).
            custom_mask, pos_encoding_mode other than "NONE": not supported (ValueError).
            use_fp16_qk_reduction, q_data_type, kv_data_type: accepted and ignored (accumulation
                is always fp32; dtypes are checked by run()).
        """
        del use_fp16_qk_reduction, q_data_type, kv_data_type
        _check_no_custom_mask(custom_mask, packed_custom_mask)
        _check_pos_encoding(pos_encoding_mode, rope_scale, rope_theta)
        _check_head_dim_vo(head_dim_qk, head_dim_vo)
        qo_host = to_host_int32(qo_indptr, "qo_indptr").reshape(-1)
        kv_host = to_host_int32(kv_indptr, "kv_indptr").reshape(-1)
        if kv_host.size != qo_host.size:
            raise ValueError(f"'kv_indptr': expected {qo_host.size} values like qo_indptr, got "
                             f"{kv_host.size}")
        options = attention_options(causal, window_left, -1, logits_soft_cap, sm_scale, k_scale,
                                    v_scale, names=_OPTION_ARG_NAMES)
        handle = ctypes.c_void_p()
        check(_capi.lib().tessera_plan_ragged_prefill(
            qo_host.ctypes.data_as(_I32P), kv_host.ctypes.data_as(_I32P), max(qo_host.size - 1, 0),
            _int_arg(num_qo_heads, "num_qo_heads"), _int_arg(num_kv_heads, "num_kv_heads"),
            _int_arg(head_dim_qk, "head_dim_qk"), ctypes.byref(options), self._device[0],
            self._device[1], ctypes.byref(handle)), dict(_PLAN_NAMES, head_dim="head_dim_qk"))
        plan = self._new_plan(handle)
        self._install(plan, options, [self._qo_indptr.stage(self, qo_indptr, qo_host),
                                      self._kv_indptr.stage(self, kv_indptr, kv_host)])

    def _index_descriptors(self) -> List[DLTensor]:
        return [self._qo_indptr.dl, self._kv_indptr.dl]

    def run(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: Optional[ArrayLike] = None,
            lse: Optional[ArrayLike] = None, return_lse: bool = False, *,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            enable_pdl: Optional[bool] = None
            ) -> Union[ArrayLike, Tuple[ArrayLike, ArrayLike]]:
        """Runs the plan: returns ``o`` ``[total_q, num_qo_heads, head_dim]`` (q's dtype), or
        ``(o, lse)`` with ``lse`` ``[total_q, num_qo_heads]`` float32 when ``return_lse``."""
        del enable_pdl
        plan = self._plan
        if plan is None:
            self._require_plan()
        if k_scale is not None or v_scale is not None:
            self._scales(k_scale, v_scale)
        if self._fast is not None:
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
        status = self._run_fn(
            plan.handle, q_dl, k_dl, v_dl, self._qo_indptr.dl, self._kv_indptr.dl, o_dl, lse_dl,
            self._workspace_ptr, self._workspace_bytes,
            None if q_dl._cuda is None else self._stream(q, q_dl))
        if status:
            check(status, _RUN_NAMES)
        return (out, lse) if return_lse else out


NOT_SERVED = object()  # fast_run: the ctypes path must run the call


def fast_run(runner: Any, inputs: tuple, out: Optional[ArrayLike] = None,
             lse: Optional[ArrayLike] = None, return_lse: bool = False) -> Any:
    """One run() through a C fast-path runner (tessera._fast.runner): its result, or NOT_SERVED
    when the runner hands the call back (an argument it does not describe exactly; the ctypes
    path decides). `inputs` are the run's inputs in the C order, q first. Errors of the C run
    raise here."""
    q = inputs[0]
    if out is None and lse is None and not return_lse and _is_torch(q):
        # The extension allocates out itself (torch, through DLPack's exchange API) and
        # returns it; no allocator comes back as -1 (then allocated below).
        result = runner(*inputs, None, None)
        if type(result) is not int:
            return result
        if result > 0:
            check(result, _RUN_NAMES)
    if out is not None and lse is None and not return_lse:
        o, o_lse = out, None
    else:
        o, o_lse = _fast_outputs(q, out, lse, return_lse)
    if o is None:
        return NOT_SERVED
    status = runner(*inputs, o, o_lse)
    if not status:
        return (o, o_lse) if return_lse else o
    if status > 0:
        check(status, _RUN_NAMES)
    return NOT_SERVED  # -1


def _is_torch(obj: Any) -> bool:
    """A torch.Tensor or nn.Parameter (exact types: what the C fast path describes)."""
    torch = sys.modules.get("torch")
    return torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter)


def _fast_outputs(q: ArrayLike, out: Optional[ArrayLike], lse: Optional[ArrayLike],
                  return_lse: bool) -> Tuple[Optional[ArrayLike], Optional[ArrayLike]]:
    """run()'s outputs for the fast path, allocated as the ctypes path allocates them (out like
    q, lse float32 [rows, heads]), or (None, None) when q is not a numpy array / torch tensor."""
    if type(q) is np.ndarray:
        kind = "numpy"
    elif _is_torch(q):
        kind = "torch"
    else:
        return None, None
    if out is None:
        if kind == "numpy":
            out = np.empty(q.shape, q.dtype)
        else:
            # empty_like: about 4 us cheaper per call than torch.empty(shape, dtype=, device=);
            # contiguous, as the ctypes path's output.
            torch = sys.modules["torch"]
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None and return_lse:
        lse = empty(q, None, tuple(q.shape)[:2], "float32", "lse")  # type: ignore[arg-type]
    return out, lse


def _hnd_to_nhd(tensor: DLTensor, name: str) -> DLTensor:
    shape, strides = shape_of(tensor), strides_of(tensor)
    if len(shape) != 3:
        raise ValueError(f"'{name}': expected [num_kv_heads, total_kv, head_dim] (HND), got "
                         f"shape {list(shape)}")
    return view(tensor, (shape[1], shape[0], shape[2]), (strides[1], strides[0], strides[2]))


class _PagedWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer: ArrayLike, kv_layout: str, use_cuda_graph: bool,
                 indptr_buffer: Optional[ArrayLike], indices_buffer: Optional[ArrayLike],
                 last_page_len_buffer: Optional[ArrayLike]) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        self._page_indptr = _IndexSlot("paged_kv_indptr", indptr_buffer, self._device)
        self._page_indices = _IndexSlot("paged_kv_indices", indices_buffer, self._device)
        self._last_page_len = _IndexSlot("paged_kv_last_page_len", last_page_len_buffer,
                                         self._device)

    def _stage_pages(self, indptr: ArrayLike, indptr_host: np.ndarray, indices: ArrayLike,
                     last_page_len: ArrayLike,
                     last_host: np.ndarray) -> List[Callable[[], None]]:
        # _install empties the derived structs, which point at the index descriptors replaced.
        return [self._page_indptr.stage(self, indptr, indptr_host),
                self._page_indices.stage(self, indices),
                self._last_page_len.stage(self, last_page_len, last_host)]

    def _paged_kv(self, paged_kv_cache: Any) -> _capi.PagedKV:
        """The ``tessera_paged_kv`` struct of this run (cached per pair of cached descriptors;
        the cache is emptied by plan(), whose index arrays the struct points at)."""
        if isinstance(paged_kv_cache, (tuple, list)):
            if len(paged_kv_cache) != 2:
                split_paged_kv_cache(paged_kv_cache)  # raises the error naming the argument
            k_dl = cached_dl(paged_kv_cache[0], "k_cache")
            v_dl = cached_dl(paged_kv_cache[1], "v_cache")
            key: tuple = ("kv", id(k_dl), id(v_dl))
            anchor: tuple = (k_dl, v_dl)
        else:
            both = cached_dl(paged_kv_cache, "paged_kv_cache")
            key, anchor = ("kv5d", id(both)), (both,)
        derived = self._derived
        hit = derived.get(key)
        if hit is not None and hit[0] == anchor:  # identity of the held descriptors
            return hit[1]
        if len(anchor) == 1:
            k_dl, v_dl = split_combined_kv(anchor[0], "paged_kv_cache")
        kv = _capi.PagedKV(
            ctypes.pointer(k_dl), ctypes.pointer(v_dl), ctypes.pointer(self._page_indptr.dl),
            ctypes.pointer(self._page_indices.dl), ctypes.pointer(self._last_page_len.dl),
            self._layout)
        if all(getattr(tensor, "_cached", False) for tensor in anchor):
            if len(derived) >= _DERIVED_CACHE_LIMIT:
                derived.clear()
            derived[key] = (anchor, kv)
        return kv


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
        """``backend`` is accepted for FlashInfer compatibility and ignored."""
        del backend
        _check_no_custom_mask(custom_mask_buf, mask_indptr_buf)
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
    ) -> None:
        """Plans the batch (arguments as in FlashInfer; see
        :meth:`BatchPrefillWithRaggedKVCacheWrapper.plan` for the options)."""
        del use_fp16_qk_reduction, q_data_type, kv_data_type, non_blocking
        _check_no_custom_mask(custom_mask, packed_custom_mask)
        _check_pos_encoding(pos_encoding_mode, rope_scale, rope_theta)
        _check_head_dim_vo(head_dim_qk, head_dim_vo)
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
        check(_capi.lib().tessera_plan_paged_prefill(
            qo_host.ctypes.data_as(_I32P), indptr_host.ctypes.data_as(_I32P),
            last_host.ctypes.data_as(_I32P), max(qo_host.size - 1, 0),
            _int_arg(page_size, "page_size"), _int_arg(num_qo_heads, "num_qo_heads"),
            _int_arg(num_kv_heads, "num_kv_heads"), _int_arg(head_dim_qk, "head_dim_qk"),
            ctypes.byref(options), self._device[0], self._device[1], ctypes.byref(handle)),
            dict(_PLAN_NAMES, head_dim="head_dim_qk"))
        plan = self._new_plan(handle)
        staged = [self._qo_indptr.stage(self, qo_indptr, qo_host)]
        staged += self._stage_pages(paged_kv_indptr, indptr_host, paged_kv_indices,
                                    paged_kv_last_page_len, last_host)
        self._install(plan, options, staged)

    def _index_descriptors(self) -> List[DLTensor]:
        return [self._page_indptr.dl, self._page_indices.dl, self._last_page_len.dl,
                self._qo_indptr.dl]

    def run(self, q: ArrayLike, paged_kv_cache: Any, *, k_scale: Optional[float] = None,
            v_scale: Optional[float] = None, out: Optional[ArrayLike] = None,
            lse: Optional[ArrayLike] = None, return_lse: bool = False,
            enable_pdl: Optional[bool] = None
            ) -> Union[ArrayLike, Tuple[ArrayLike, ArrayLike]]:
        """Runs the plan: ``o`` ``[total_q, num_qo_heads, head_dim]``, or ``(o, lse)``."""
        del enable_pdl
        plan = self._plan
        if plan is None:
            self._require_plan()
        if k_scale is not None or v_scale is not None:
            self._scales(k_scale, v_scale)
        if self._fast is not None:
            result = self._run_fast((q, paged_kv_cache), out, lse, return_lse)
            if result is not NOT_SERVED:
                return result
        q_dl = cached_dl(q, "q")
        kv = self._paged_kv(paged_kv_cache)
        out, o_dl, lse, lse_dl = self._outputs(q, q_dl, out, lse, return_lse)
        if self._watch_capture:
            self._note_capture()
        status = self._run_fn(
            plan.handle, q_dl, kv, self._qo_indptr.dl, o_dl, lse_dl, self._workspace_ptr,
            self._workspace_bytes, None if q_dl._cuda is None else self._stream(q, q_dl))
        if status:
            check(status, _RUN_NAMES)
        return (out, lse) if return_lse else out


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    _run_symbol = "tessera_run_decode"

    """Batch decode attention over a paged KV cache (FlashInfer's wrapper of the same name).

    ``q`` is ``[batch_size * q_per_request, num_qo_heads, head_dim]`` (``q_per_request = 1`` for
    plain decode; up to 64 for speculative decoding, causal within the request's last tokens).

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
        """
        del q_data_type, kv_data_type, data_type, non_blocking
        _check_pos_encoding(pos_encoding_mode, rope_scale, rope_theta)
        indptr_host = to_host_int32(indptr, "indptr").reshape(-1)
        last_host = to_host_int32(last_page_len, "last_page_len").reshape(-1)
        if indptr_host.size < 1:
            raise ValueError("'indptr': expected batch_size + 1 >= 1 values")
        q_per_request = _int_arg(q_per_request, "q_per_request")
        options = attention_options(q_per_request > 1, window_left, -1, logits_soft_cap, sm_scale,
                                    k_scale, v_scale, names=_OPTION_ARG_NAMES)
        handle = ctypes.c_void_p()
        check(_capi.lib().tessera_plan_decode(
            indptr_host.ctypes.data_as(_I32P), last_host.ctypes.data_as(_I32P),
            indptr_host.size - 1, _int_arg(page_size, "page_size"),
            _int_arg(num_qo_heads, "num_qo_heads"), _int_arg(num_kv_heads, "num_kv_heads"),
            _int_arg(head_dim, "head_dim"), q_per_request, ctypes.byref(options),
            self._device[0], self._device[1], ctypes.byref(handle)),
            dict(_PLAN_NAMES, page_indptr_host="indptr", last_page_len_host="last_page_len"))
        plan = self._new_plan(handle)
        self._install(plan, options,
                      self._stage_pages(indptr, indptr_host, indices, last_page_len, last_host))

    def _index_descriptors(self) -> List[DLTensor]:
        return [self._page_indptr.dl, self._page_indices.dl, self._last_page_len.dl]

    def run(self, q: ArrayLike, paged_kv_cache: Any, *, q_rope_offset: Optional[ArrayLike] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            out: Optional[ArrayLike] = None, lse: Optional[ArrayLike] = None,
            return_lse: bool = False, enable_pdl: Optional[bool] = None,
            window_left: Optional[int] = None
            ) -> Union[ArrayLike, Tuple[ArrayLike, ArrayLike]]:
        """Runs the plan: ``o`` ``[batch_size * q_per_request, num_qo_heads, head_dim]`` in q's
        dtype, or ``(o, lse)`` with ``lse`` float32 ``[rows, num_qo_heads]``."""
        del enable_pdl
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
        if self._fast is not None:
            result = self._run_fast((q, paged_kv_cache), out, lse, return_lse)
            if result is not NOT_SERVED:
                return result
        q_dl = cached_dl(q, "q")
        kv = self._paged_kv(paged_kv_cache)
        out, o_dl, lse, lse_dl = self._outputs(q, q_dl, out, lse, return_lse)
        if self._watch_capture:
            self._note_capture()
        status = self._run_fn(
            plan.handle, q_dl, kv, o_dl, lse_dl, self._workspace_ptr, self._workspace_bytes,
            None if q_dl._cuda is None else self._stream(q, q_dl))
        if status:
            check(status, _RUN_NAMES)
        return (out, lse) if return_lse else out
