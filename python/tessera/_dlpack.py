"""Tensor interop: builds DLPack ``DLTensor`` descriptors for the C ABI from array objects of any
framework, and allocates outputs with the framework of the inputs.

* numpy arrays: the descriptor is built directly from the array's data pointer, shape and
  strides (no capsule, no copy).
* torch tensors: ``torch.utils.dlpack.to_dlpack`` gives a ``"dltensor"`` PyCapsule; its
  ``DLManagedTensor`` pointer is read with ``PyCapsule_GetPointer`` without consuming or renaming
  the capsule, so the producer keeps ownership and releases its reference when the capsule is
  garbage-collected after the call. fp8 tensors go through a ``uint8`` view (older torch
  versions cannot export fp8) and get the DLPack 1.x fp8 type codes.
* anything else with ``__dlpack__`` (cupy, jax, ...): the capsule of ``obj.__dlpack__()``, as
  above (legacy ``"dltensor"`` and versioned ``"dltensor_versioned"`` capsules are both read).

The descriptor passed to C is always a copy owned by this module (the capsule's shape/strides
arrays stay owned by the capsule, which is kept alive with the descriptor).
"""

from __future__ import annotations

import ctypes
import struct
import sys
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ._capi import (
    DLDataType,
    DLManagedTensorVersioned,
    DLTensor,
    TESSERA_DL_FLOAT8_E4M3FN,
    TESSERA_DL_FLOAT8_E5M2,
    kDLBfloat,
    kDLBool,
    kDLCPU,
    kDLCUDA,
    kDLFloat,
    kDLInt,
    kDLUInt,
)

_Int64Array = ctypes.c_int64

_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

_DLPACK_FLAG_READ_ONLY = 1

# numpy dtype -> (DLPack code, bits)
_NUMPY_DTYPES = {
    np.dtype(np.float32): (kDLFloat, 32),
    np.dtype(np.float16): (kDLFloat, 16),
    np.dtype(np.float64): (kDLFloat, 64),
    np.dtype(np.int32): (kDLInt, 32),
    np.dtype(np.int64): (kDLInt, 64),
    np.dtype(np.int8): (kDLInt, 8),
    np.dtype(np.int16): (kDLInt, 16),
    np.dtype(np.uint8): (kDLUInt, 8),
    np.dtype(np.bool_): (kDLBool, 8),
}
# ml_dtypes (bfloat16 and fp8 for numpy), matched by name so ml_dtypes stays optional.
_NUMPY_NAMED_DTYPES = {
    "bfloat16": (kDLBfloat, 16),
    "float8_e4m3fn": (TESSERA_DL_FLOAT8_E4M3FN, 8),
    "float8_e5m2": (TESSERA_DL_FLOAT8_E5M2, 8),
}


# Framework of a type: "numpy", "torch", "cupy" or "dlpack" (anything else with __dlpack__).
_KIND_CACHE: dict = {}


def framework(obj: Any) -> str:
    """Which framework an array object belongs to."""
    kind = _KIND_CACHE.get(type(obj))
    if kind is not None:
        return kind
    cls = type(obj)
    torch = sys.modules.get("torch")
    if isinstance(obj, np.ndarray):
        kind = "numpy"
    elif torch is not None and isinstance(obj, torch.Tensor):
        kind = "torch"
    elif cls.__module__.split(".")[0] == "cupy":
        kind = "cupy"
    elif hasattr(obj, "__dlpack__"):
        kind = "dlpack"
    else:
        return "none"
    _KIND_CACHE[cls] = kind
    return kind


def _numpy_code(dtype: np.dtype, name: str) -> Tuple[int, int]:
    code = _NUMPY_DTYPES.get(dtype)
    if code is None:
        code = _NUMPY_NAMED_DTYPES.get(dtype.name)
        if code is None or not dtype.isnative:
            raise ValueError(
                f"'{name}': numpy dtype {dtype} is not supported (float32, float16, bfloat16 "
                "and fp8 through ml_dtypes, int32, int64, uint8)"
            )
    return code


class _PyArrayInterface(ctypes.Structure):
    """numpy's C-struct array interface (``__array_struct__``): data pointer, flags and the
    array's own shape, without building the ``__array_interface__`` dict (3x faster)."""

    _fields_ = [
        ("two", ctypes.c_int),
        ("nd", ctypes.c_int),
        ("typekind", ctypes.c_char),
        ("itemsize", ctypes.c_int),
        ("flags", ctypes.c_int),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("data", ctypes.c_void_p),
        ("descr", ctypes.c_void_p),
    ]


_NPY_C_CONTIGUOUS = 0x1
_NPY_WRITEABLE = 0x400
# DLTensor packed field by field: data, device (type, id), ndim, dtype (code, bits, lanes),
# shape, strides, byte_offset. Building it from bytes is cheaper than the ctypes constructor.
_DLTENSOR_PACK = struct.Struct("=QiiiBBHQQQ").pack
assert struct.calcsize("=QiiiBBHQQQ") == ctypes.sizeof(DLTensor)


def _from_numpy(array: np.ndarray, name: str, writable: bool) -> DLTensor:
    code, bits = _numpy_code(array.dtype, name)
    capsule = array.__array_struct__
    info = _PyArrayInterface.from_address(_PyCapsule_GetPointer(capsule, None))
    flags = info.flags
    if writable and not flags & _NPY_WRITEABLE:
        raise ValueError(f"'{name}': is written, but the numpy array is read-only")
    ndim = info.nd
    if ndim == 0:
        raise ValueError(f"'{name}': expected an array with at least one dimension, got a scalar")
    if flags & _NPY_C_CONTIGUOUS:  # DLPack's NULL strides = compact row-major
        tensor = DLTensor.from_buffer_copy(
            _DLTENSOR_PACK(info.data or 0, kDLCPU, 0, ndim, code, bits, 1, info.shape, 0, 0))
        tensor._keep = (array, capsule)  # shape points into the array object
        return tensor
    itemsize = array.itemsize
    byte_strides = array.strides
    if any(s % itemsize for s in byte_strides):
        raise ValueError(
            f"'{name}': strides {byte_strides} (bytes) are not multiples of the item size "
            f"{itemsize}")
    strides = (_Int64Array * ndim)(*[s // itemsize for s in byte_strides])
    tensor = DLTensor.from_buffer_copy(
        _DLTENSOR_PACK(info.data or 0, kDLCPU, 0, ndim, code, bits, 1, info.shape,
                       ctypes.addressof(strides), 0))
    tensor._keep = (array, capsule, strides)
    return tensor


def _from_capsule(capsule: Any, owner: Any, name: str, writable: bool) -> DLTensor:
    if _PyCapsule_IsValid(capsule, b"dltensor"):
        address = _PyCapsule_GetPointer(capsule, b"dltensor")
        source = DLTensor.from_address(address)  # dl_tensor is the first member
    elif _PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        address = _PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        managed = DLManagedTensorVersioned.from_address(address)
        if writable and managed.flags & _DLPACK_FLAG_READ_ONLY:
            raise ValueError(f"'{name}': is written, but the DLPack producer marked it read-only")
        source = managed.dl_tensor
    else:
        raise ValueError(
            f"'{name}': __dlpack__() did not return an unconsumed DLPack capsule "
            "('dltensor' or 'dltensor_versioned')"
        )
    tensor = DLTensor.from_buffer_copy(source)
    if tensor.ndim == 0:
        raise ValueError(f"'{name}': expected a tensor with at least one dimension, got a scalar")
    tensor._keep = (capsule, owner)
    return tensor


def _refuse_lazy_bits(tensor: Any, name: str, writable: bool) -> None:
    """Raises ValueError for a torch tensor with the negative or conjugate bit set (a lazy
    negation / ``conj()``, e.g. ``x.conj().imag`` or ``torch._neg_view(x)``): DLPack export
    ignores these bits, so its memory would be read (or written) without the negation. Refused
    rather than resolved: a resolved copy of an output would not receive the results, and the
    descriptor cache must not describe a temporary."""
    if tensor.is_neg():
        bit, method = "negative", "resolve_neg"
    elif tensor.is_conj():
        bit, method = "conjugate", "resolve_conj"
    else:
        return
    advice = ("it is written, so pass a tensor without the bit" if writable
              else f"pass {name}.{method}() (a copy holding the values)")
    raise ValueError(f"'{name}': the torch tensor has its {bit} bit set (a lazy view whose "
                     f"memory does not hold its values); {advice}")


def _from_torch(tensor: Any, name: str, writable: bool) -> DLTensor:
    torch = sys.modules["torch"]
    if tensor.requires_grad:
        tensor = tensor.detach()
    _refuse_lazy_bits(tensor, name, writable)
    fp8 = _torch_fp8_code(tensor.dtype)
    if fp8:
        view = tensor.view(torch.uint8)
        result = _from_capsule(torch.utils.dlpack.to_dlpack(view), (tensor, view), name, writable)
        result.dtype = DLDataType(fp8, 8, 1)
        return result
    return _from_capsule(torch.utils.dlpack.to_dlpack(tensor), tensor, name, writable)


_TORCH_FP8: Optional[dict] = None


def _torch_fp8_code(dtype: Any) -> int:
    global _TORCH_FP8
    if _TORCH_FP8 is None:
        torch = sys.modules["torch"]
        table = {}
        for attr, code in (("float8_e4m3fn", TESSERA_DL_FLOAT8_E4M3FN),
                           ("float8_e5m2", TESSERA_DL_FLOAT8_E5M2)):
            if hasattr(torch, attr):
                table[getattr(torch, attr)] = code
        _TORCH_FP8 = table
    return _TORCH_FP8.get(dtype, 0)


def to_dl(obj: Any, name: str, writable: bool = False) -> DLTensor:
    """A DLTensor descriptor of ``obj`` (kept alive by the descriptor). ``writable``: the call
    writes through it (read-only numpy arrays / DLPack 1.x read-only tensors are refused)."""
    kind = framework(obj)
    if kind == "numpy":
        return _from_numpy(obj, name, writable)
    if kind == "torch":
        return _from_torch(obj, name, writable)
    if kind == "none":
        raise ValueError(
            f"'{name}': expected an array (numpy, torch, cupy, jax or any object with "
            f"__dlpack__), got {type(obj).__name__}"
        )
    return _from_capsule(obj.__dlpack__(), obj, name, writable)


# ---------------------------------------------------------------------------------------------
# Descriptor cache for the hot paths (the wrappers' run): serving engines call run() with the
# same preallocated buffers every step, so the descriptor of a buffer is built once and reused.
#
# The key is everything the descriptor holds: data pointer, shape, strides, dtype and device
# (plus the type of the object, as the frameworks spell these differently). A cached descriptor
# owns its shape/strides arrays and does not reference the array object (the caller's argument
# keeps the memory alive during the call), so a buffer freed and reallocated elsewhere, or a new
# buffer at the same address with another shape/strides/dtype, gets another key: a descriptor is
# never stale. Descriptors from the cache are shared and must not be modified.
#
# numpy: the data pointer and flags are read from the PyArrayObject struct (``data`` right after
# the object header, ``flags`` after nd/dimensions/strides/base/descr; numpy's C ABI since 1.7),
# ~10x cheaper than ``__array_interface__`` / ``.ctypes``; verified at import, else not used.
# torch: ``data_ptr()``, ``shape``, ``stride()``, ``dtype``, ``device`` and ``is_neg()`` (a lazy
# negative view is refused, not described). Other frameworks (cupy, jax, ...) are not cached
# (to_dl each call).


class _NumpyHead(ctypes.Structure):
    """The leading fields of numpy's PyArrayObject (after PyObject_HEAD)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("nd", ctypes.c_int),
        ("dimensions", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("base", ctypes.c_void_p),
        ("descr", ctypes.c_void_p),
        ("flags", ctypes.c_int),
    ]


_HEAD_SIZE = object.__basicsize__
_numpy_head = _NumpyHead.from_address
_voidp_at = ctypes.c_void_p.from_address


def _numpy_head_works() -> bool:
    try:
        for array in (np.zeros((3, 4), np.float32), np.zeros(5, np.int32)[::2]):
            for writeable in (True, False):
                array.flags.writeable = writeable
                head = _numpy_head(id(array) + _HEAD_SIZE)
                if (head.data != array.__array_interface__["data"][0] or head.nd != array.ndim
                        or bool(head.flags & _NPY_WRITEABLE) != writeable
                        or bool(head.flags & _NPY_C_CONTIGUOUS) != array.flags.c_contiguous
                        or _voidp_at(id(array) + _HEAD_SIZE).value != head.data):
                    return False
        return True
    except Exception:  # pragma: no cover - unusual interpreter/numpy build
        return False


_NUMPY_HEAD_OK = _numpy_head_works()

_DESCRIPTOR_CACHE: dict = {}
#: Entries kept before the cache is emptied (each is a few hundred bytes; refilling costs one
#: to_dl per buffer). Enough for every layer's buffers of a large model.
DESCRIPTOR_CACHE_LIMIT = 4096


def _owned_copy(tensor: DLTensor) -> DLTensor:
    """A copy of ``tensor`` with its own shape/strides arrays and no reference to the array."""
    ndim = tensor.ndim
    array_type = _Int64Array * ndim
    shape = array_type(*tensor.shape[:ndim])
    strides = array_type(*tensor.strides[:ndim]) if tensor.strides else None
    result = DLTensor(tensor.data, tensor.device, ndim, tensor.dtype, shape, strides,
                      tensor.byte_offset)
    result._keep = (shape, strides)
    result._cached = True  # references no array: derived structs may be cached by its id
    device_type = tensor.device.device_type
    # CUDA device index for the stream lookup (None: host memory, no stream).
    result._cuda = tensor.device.device_id if device_type == kDLCUDA else None
    return result


def _cache_miss(key: Any, obj: Any, name: str, writable: bool) -> DLTensor:
    tensor = _owned_copy(to_dl(obj, name, writable))  # validates; raises without caching
    cache = _DESCRIPTOR_CACHE
    if len(cache) >= DESCRIPTOR_CACHE_LIMIT:
        cache.clear()
    cache[key] = tensor
    return tensor


def cached_dl(obj: Any, name: str, writable: bool = False) -> DLTensor:
    """``to_dl(obj, name, writable)`` through the descriptor cache (numpy and torch; other
    frameworks are converted each call). The result is shared: do not modify it. Its ``_cuda``
    attribute is the CUDA device index, or None for host memory."""
    cls = type(obj)
    kind = _KIND_CACHE.get(cls) or framework(obj)
    if kind == "numpy" and _NUMPY_HEAD_OK:
        if writable:
            head = _numpy_head(id(obj) + _HEAD_SIZE)
            if not head.flags & _NPY_WRITEABLE:
                return to_dl(obj, name, writable)  # raises the read-only error
            key = (cls, head.data, obj.shape, obj.strides, obj.dtype)
        else:
            key = (cls, _voidp_at(id(obj) + _HEAD_SIZE).value, obj.shape, obj.strides, obj.dtype)
    elif kind == "torch":
        # is_neg(): a negative-bit view has the memory of its base but not its values; it must
        # miss so that to_dl refuses it. (The conjugate bit exists only on complex dtypes, which
        # the library refuses by dtype.)
        key = (cls, obj.data_ptr(), obj.shape, obj.stride(), obj.dtype, obj.device, obj.is_neg())
    else:
        tensor = to_dl(obj, name, writable)
        tensor._cuda = tensor.device.device_id if tensor.device.device_type == kDLCUDA else None
        return tensor
    tensor = _DESCRIPTOR_CACHE.get(key)
    if tensor is None:
        tensor = _cache_miss(key, obj, name, writable)
    return tensor


def clear_descriptor_cache() -> None:
    """Empties the descriptor cache (tests; memory is otherwise bounded by the limit)."""
    _DESCRIPTOR_CACHE.clear()


def numpy_data_pointer(array: np.ndarray) -> int:
    """Data pointer of a numpy array (0 for NULL)."""
    if _NUMPY_HEAD_OK:
        return _voidp_at(id(array) + _HEAD_SIZE).value or 0
    return array.__array_interface__["data"][0] or 0


def contiguous_like(like: DLTensor, data: int) -> DLTensor:
    """A descriptor of a fresh C-contiguous array at ``data`` with the shape, dtype and device of
    the (cached) descriptor ``like`` — the output that run() allocates like q."""
    template = getattr(like, "_contiguous", None)
    if template is None:
        template = _DLTENSOR_PACK(0, like.device.device_type, like.device.device_id, like.ndim,
                                  like.dtype.code, like.dtype.bits, like.dtype.lanes,
                                  ctypes.cast(like.shape, ctypes.c_void_p).value or 0, 0, 0)
        like._contiguous = template
    tensor = DLTensor.from_buffer_copy(template)
    tensor.data = data
    tensor._keep = like  # owns the shape array
    return tensor


def optional_dl(obj: Any, name: str, writable: bool = False) -> Optional[DLTensor]:
    return None if obj is None else to_dl(obj, name, writable)


def ref(tensor: Optional[DLTensor]):
    """The pointer argument for a descriptor (NULL for None)."""
    return None if tensor is None else ctypes.byref(tensor)


# ---------------------------------------------------------------------------------------------
# Descriptor arithmetic (framework-independent views)


def shape_of(tensor: DLTensor) -> Tuple[int, ...]:
    return tuple(tensor.shape[i] for i in range(tensor.ndim))


def strides_of(tensor: DLTensor) -> Tuple[int, ...]:
    ndim = tensor.ndim
    if tensor.strides:
        return tuple(tensor.strides[i] for i in range(ndim))
    strides = [0] * ndim
    step = 1
    for i in range(ndim - 1, -1, -1):
        strides[i] = step
        step *= max(int(tensor.shape[i]), 1)
    return tuple(strides)


def itemsize_of(tensor: DLTensor) -> int:
    return (tensor.dtype.bits * tensor.dtype.lanes + 7) // 8


def view(base: DLTensor, shape: Sequence[int], strides: Sequence[int],
         byte_offset_delta: int = 0) -> DLTensor:
    """A descriptor over the memory of ``base`` with another shape/strides (elements)."""
    ndim = len(shape)
    array_type = _Int64Array * ndim
    shape_array = array_type(*shape)
    strides_array = array_type(*strides)
    result = DLTensor(base.data, base.device, ndim, base.dtype, shape_array, strides_array,
                      base.byte_offset + byte_offset_delta)
    result._keep = (base, shape_array, strides_array)
    return result


def merge_leading(tensor: DLTensor) -> Optional[DLTensor]:
    """[A, B, ...] -> [A*B, ...] without a copy, or None when the strides do not allow it."""
    shape, strides = shape_of(tensor), strides_of(tensor)
    if len(shape) < 2:
        return None
    a, b = shape[0], shape[1]
    if a == 1 or a * b == 0:
        inner = strides[1]
    elif b == 1:
        inner = strides[0]
    elif strides[0] == b * strides[1]:
        inner = strides[1]
    else:
        return None
    return view(tensor, (a * b,) + shape[2:], (inner,) + strides[2:])


def select(tensor: DLTensor, dim: int, index: int) -> DLTensor:
    """``tensor[..., index, ...]`` along ``dim`` (the dimension is dropped)."""
    shape, strides = shape_of(tensor), strides_of(tensor)
    delta = index * strides[dim] * itemsize_of(tensor)
    return view(tensor, shape[:dim] + shape[dim + 1:], strides[:dim] + strides[dim + 1:], delta)


def nbytes_of(tensor: DLTensor, name: str) -> int:
    """Size in bytes of a contiguous tensor (the workspace buffer)."""
    shape, strides = shape_of(tensor), strides_of(tensor)
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size > 1 and stride != expected:
            raise ValueError(f"'{name}': expected a contiguous buffer")
        expected *= size
    return expected * itemsize_of(tensor)


def data_pointer(tensor: DLTensor) -> int:
    return (tensor.data or 0) + tensor.byte_offset


def device_of(tensor: DLTensor) -> Tuple[int, int]:
    """(DLPack device type, device id), with pinned host memory reported as the CPU."""
    device_type = tensor.device.device_type
    if device_type == kDLCUDA:
        return kDLCUDA, tensor.device.device_id
    return kDLCPU, 0


# ---------------------------------------------------------------------------------------------
# Framework operations on array objects


def stream_of(obj: Any, tensor: DLTensor) -> Optional[int]:
    """The current CUDA stream of the framework of ``obj`` for a CUDA tensor, else None."""
    if tensor.device.device_type != kDLCUDA:
        return None
    kind = framework(obj)
    if kind == "torch":
        return torch_stream(tensor.device.device_id) or None
    if kind == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(tensor.device.device_id):
            return cupy.cuda.get_current_stream().ptr or None
    return None


def torch_stream(device_index: int) -> int:
    """torch's current CUDA stream on a device, as an integer cudaStream_t (0: the legacy
    default stream)."""
    torch = sys.modules["torch"]
    # torch.cuda.current_stream(device).cuda_stream without building a Stream object (the raw
    # getter torch's own compiled code uses; ~1 us cheaper per call).
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index) or 0
    return torch.cuda.current_stream(device_index).cuda_stream or 0


def torch_stream_capturing(device_index: int) -> bool:
    """Whether torch's current CUDA stream on a device is being captured into a CUDA graph."""
    torch = sys.modules["torch"]
    # torch answers for the current device; a capture makes its stream's device current.
    if device_index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device_index):
        return torch.cuda.is_current_stream_capturing()


_DL_TO_NUMPY = {
    (kDLFloat, 32): "float32",
    (kDLFloat, 16): "float16",
    (kDLFloat, 64): "float64",
    (kDLInt, 32): "int32",
    (kDLInt, 64): "int64",
    (kDLUInt, 8): "uint8",
    (kDLBfloat, 16): "bfloat16",
    (TESSERA_DL_FLOAT8_E4M3FN, 8): "float8_e4m3fn",
    (TESSERA_DL_FLOAT8_E5M2, 8): "float8_e5m2",
}


def _numpy_dtype(name: str) -> np.dtype:
    if hasattr(np, name):
        return np.dtype(getattr(np, name))
    try:
        import ml_dtypes  # type: ignore[import-not-found]
    except ImportError as error:
        raise ValueError(f"numpy has no {name}; install ml_dtypes or pass out=") from error
    return np.dtype(getattr(ml_dtypes, name))


def empty(like: Any, like_dl: DLTensor, shape: Sequence[int], dtype: Optional[str] = None,
          name: str = "out") -> Any:
    """An uninitialised array of ``shape`` with the framework and device of ``like``.
    ``dtype``: None for the dtype of ``like``, else a numpy-style name ("float32", "int32")."""
    kind = framework(like)
    shape = tuple(int(s) for s in shape)
    if kind == "numpy":
        return np.empty(shape, dtype=like.dtype if dtype is None else _numpy_dtype(dtype))
    if kind == "torch":
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=like.dtype if dtype is None else getattr(torch, dtype),
                           device=like.device)
    if kind == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(like_dl.device.device_id):
            return cupy.empty(shape, dtype=like.dtype if dtype is None else dtype)
    if like_dl.device.device_type != kDLCUDA:
        if dtype is None:
            dtype = _DL_TO_NUMPY.get((like_dl.dtype.code, like_dl.dtype.bits))
            if dtype is None:
                raise ValueError(f"'{name}': cannot allocate this dtype with numpy; pass {name}=")
        return np.empty(shape, dtype=_numpy_dtype(dtype))
    raise ValueError(
        f"'{name}': cannot allocate a CUDA output for a {type(like).__module__} array; pass "
        f"{name}= (a torch or cupy array)"
    )


def from_numpy(values: np.ndarray, like: Any, like_dl: DLTensor) -> Any:
    """``values`` (host) on the device and in the framework of ``like``."""
    kind = framework(like)
    if kind == "torch":
        torch = sys.modules["torch"]
        host = torch.from_numpy(np.ascontiguousarray(values))
        if like.device.type == "cpu":
            return host
        # Stream-ordered upload without a host synchronisation: the driver stages pageable
        # memory before cudaMemcpyAsync returns, so `host` may be freed afterwards.
        return host.to(like.device, non_blocking=True)
    if kind == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(like_dl.device.device_id):
            return cupy.asarray(values)
    if like_dl.device.device_type == kDLCUDA:
        raise ValueError(
            f"cannot move index arrays to the device of a {type(like).__module__} array; pass "
            "them as arrays on that device"
        )
    return np.ascontiguousarray(values)


def to_host_int32(obj: Any, name: str) -> np.ndarray:
    """A contiguous host int32 copy (or view) of an index array of any framework, or of a
    Python sequence. Values must fit in int32."""
    kind = framework(obj)
    if kind == "torch":
        # resolve_*: lazy conjugate / negative views, which numpy() refuses (no-ops otherwise)
        obj = obj.detach().to("cpu").resolve_conj().resolve_neg().numpy()
    elif kind == "cupy":
        obj = obj.get()
    elif kind == "dlpack":
        try:
            obj = np.from_dlpack(obj)
        except (TypeError, RuntimeError, BufferError, ValueError):
            obj = np.asarray(obj)
    array = np.asarray(obj)
    if array.dtype.kind not in "iu":
        raise ValueError(f"'{name}': expected integers, got dtype {array.dtype}")
    if array.dtype != np.int32:
        if array.size and (array.min() < -(2**31) or array.max() >= 2**31):
            raise ValueError(f"'{name}': values do not fit in int32")
        array = array.astype(np.int32)
    return np.ascontiguousarray(array)


def clone(obj: Any, name: str) -> Any:
    """A copy of an array (for the out-of-place RoPE)."""
    kind = framework(obj)
    if kind == "numpy":
        return obj.copy()
    if kind == "torch":
        return obj.clone()
    if kind == "cupy":
        return obj.copy()
    if hasattr(obj, "copy"):
        return obj.copy()
    raise ValueError(f"'{name}': cannot copy a {type(obj).__module__} array")


def index_array(obj: Any, name: str, like: Any, like_dl: DLTensor) -> Any:
    """An int32 index array argument: arrays pass through (the library checks dtype/device);
    Python sequences become int32 arrays on the device of ``like``."""
    if isinstance(obj, (list, tuple, range)):
        return from_numpy(np.asarray(obj, dtype=np.int32), like, like_dl)
    return obj
