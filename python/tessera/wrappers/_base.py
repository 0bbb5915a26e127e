"""What the three wrappers share: the plan's index arrays on its device (:class:`_IndexSlot`),
the workspace, current plan and CUDA-graph bookkeeping (:class:`_Wrapper`), and the paged KV
cache's index arrays and structs (:class:`_PagedWrapper`)."""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from .. import _capi, _fast
from .._capi import Plan, kDLCUDA
from .._common import (
    kv_layout_code,
    split_combined_kv,
    split_paged_kv_cache,
    stream_arg,
    stream_capture_id,
)
from .._dlpack import (
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
from ._args import ArrayLike
from ._fast_run import fast_run

# Per-wrapper caches of derived structs (paged-KV structs, HND views) keyed on the cached
# descriptors they were made from; emptied when they grow past this (and on every plan).
_DERIVED_CACHE_LIMIT = 1024


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
        self._run_v2_fn: Any = None  # its *_v2 form (per-call options: sinks)
        self._fast: Any = None  # the C fast path's runner of the current plan (see _fast.py)
        # The current plan's custom / tree mask (_masks.PlannedMasks), passed to every run.
        self._masks: Any = None
        self._out_dim: Optional[int] = None  # o's last dim when head_dim_vo != head_dim_qk
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
        self._run_v2_fn = getattr(_capi.lib(), self._run_symbol + "_v2")
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

    def _stage_out_dim(self, head_dim_qk: int, head_dim_vo: int) -> Callable[[], None]:
        """What puts the plan's o width in place (None: q's; see _outputs)."""
        out_dim = head_dim_vo if head_dim_vo not in (0, head_dim_qk) else None

        def put() -> None:
            self._out_dim = out_dim
        return put

    def _stage_masks(self, masks: Any) -> Callable[[], None]:
        """What puts a plan's masks (or None) in place with its index arrays."""
        def put() -> None:
            self._masks = masks
        return put

    def _arm_fast(self) -> None:
        """Makes the C fast path's runner for the current plan, index arrays and workspace
        (None when the extension is not available, or when the plan has a mask: the fast path
        passes no run options, so such runs take the ctypes path)."""
        assert self._plan is not None
        if self._masks is not None or self._out_dim is not None:
            self._fast = None  # (the fast path allocates o like q)
            return
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
        the cache: the static-buffer pattern), else fresh arrays like q (of the plan's
        head_dim_vo in the last dimension)."""
        if out is None and self._out_dim is not None:
            shape = shape_of(q_dl)
            out = empty(q, q_dl, (shape[0], shape[1], self._out_dim))
            o_dl = to_dl(out, "out", writable=True)
        elif out is None:
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

    def _invoke(self, sinks: Optional[ArrayLike], enable_pdl: Optional[bool], *args: Any) -> int:
        """The C run call with ``args``; with attention sinks (float32 ``[num_qo_heads]`` on
        q's device, validated by the C ABI), ``enable_pdl`` (programmatic dependent launch,
        FlashInfer's run argument) or a planned mask its *_v2 form. Such calls take this
        ctypes path, never the C fast path."""
        if sinks is None and not enable_pdl and self._masks is None:
            return self._run_fn(*args)
        options = _capi.run_options(None if sinks is None else cached_dl(sinks, "sinks"),
                                    bool(enable_pdl), self._masks)
        return self._run_v2_fn(*args, ctypes.byref(options))

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
