"""The optional C fast path of the wrappers' ``run()`` (``tessera._fastcall``, python/_fastcall.c).

The extension is a limited-API (abi3) module built with libtessera.so (``pip install .``, the
CMake build, tools/stage-gpu.sh) and looked up **in the folder of the libtessera.so in use** as
``_fastcall.abi3.so`` (the installed package's ``tessera/_lib/``, ``build/`` of a checkout, the
folder of ``$TESSERA_LIBRARY``, e.g. ``.devbuild/``). ``TESSERA_FASTCALL=0`` turns it off;
``TESSERA_FASTCALL=/path/_fastcall.abi3.so`` loads that file (an error if it cannot be loaded).
Without it the wrappers use the ctypes path, with the same results and errors.

What run() does through it: per call, the data pointer / shape / strides / dtype / device of each
numpy or torch argument are read (nothing is cached per object, so in-place metadata changes are
seen), DLTensor descriptors are filled on the C stack and the tessera_run_* function is called
with the GIL released. Anything it does not describe exactly as the ctypes path would (another
framework, a tensor subclass, an unknown dtype or layout, a read-only numpy output, ...) is handed
back to the ctypes path, which validates and raises as before. Before a framework is enabled,
:func:`_self_test` compares the extension's descriptors with the ctypes path's on sample arrays;
the dtype tables given to it are derived from the ctypes path.

:func:`info` reports whether it is in use, and why not.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import _capi, _dlpack

#: The extension's VERSION this module was written for.
_VERSION = 4
_FILE_NAME = "_fastcall.abi3.so"

_lock = threading.Lock()
_module: Any = None
_loaded = False
_path: Optional[str] = None
_reason = "not loaded yet"
_numpy_on = False
_numpy_reason = "not initialised"
_torch_state: Optional[bool] = None  # None: not tried (torch not imported yet)
_torch_reason = "torch not imported"
_enabled = True  # set_enabled(False): the wrappers use the ctypes path (benchmarks, tests)

_OPS = {"tessera_run_decode": 0, "tessera_run_paged_prefill": 1,
        "tessera_run_ragged_prefill": 2}


def _load_file(path: str) -> Any:
    loader = importlib.machinery.ExtensionFileLoader("tessera._fastcall", path)
    spec = importlib.util.spec_from_file_location("tessera._fastcall", path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _load() -> Any:
    global _module, _loaded, _path, _reason
    setting = os.environ.get("TESSERA_FASTCALL", "")
    if setting == "0":
        _reason = "disabled by TESSERA_FASTCALL=0"
        return None
    explicit = setting not in ("", "1")
    path = setting if explicit else str(Path(_capi.library_path()).parent / _FILE_NAME)
    if not explicit and not os.path.isfile(path):
        _reason = f"{path} not found (the package uses its ctypes path)"
        return None
    try:
        module = _load_file(path)
    except ImportError as error:
        if explicit:
            raise _capi.LibraryNotFoundError(
                f"tessera: TESSERA_FASTCALL={setting!r} could not be loaded: {error}") from error
        _reason = f"{path} could not be loaded: {error}"
        return None
    if getattr(module, "VERSION", None) != _VERSION or module.ABI_VERSION != _capi.ABI_VERSION:
        _reason = (f"{path} is version {getattr(module, 'VERSION', None)} (C ABI "
                   f"{getattr(module, 'ABI_VERSION', None)}); this package needs {_VERSION} (C "
                   f"ABI {_capi.ABI_VERSION})")
        if explicit:
            raise _capi.LibraryNotFoundError(f"tessera: {_reason}")
        return None
    _path = path
    _init_numpy(module)
    _reason = "loaded"
    return module


def module() -> Any:
    """The extension module, or None (not built, not found, disabled)."""
    global _module, _loaded
    if not _loaded:
        with _lock:
            if not _loaded:
                _module = _load()
                _loaded = True
    return _module


# ---- self test: the extension's descriptors against the ctypes path's --------------------


def reference_descriptor(obj: Any, writable: bool = False) -> Optional[Tuple]:
    """The descriptor the ctypes path passes for ``obj`` as a tuple (see describe), or None
    when it raises."""
    try:
        tensor = _dlpack.cached_dl(obj, "x", writable)
    except (ValueError, TypeError, RuntimeError, BufferError):
        return None
    return descriptor_tuple(tensor)


def descriptor_tuple(tensor: _dlpack.DLTensor) -> Tuple:
    ndim = tensor.ndim
    strides = tuple(tensor.strides[i] for i in range(ndim)) if tensor.strides else None
    return (tensor.data or 0, tensor.device.device_type, tensor.device.device_id, ndim,
            tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes,
            tuple(tensor.shape[i] for i in range(ndim)), strides, tensor.byte_offset)


def _self_test(module: Any, samples: List[Tuple[Any, bool]]) -> Optional[str]:
    """None when every sample the extension handles gets the ctypes path's descriptor and at
    least one was handled; else what differed."""
    handled = 0
    for obj, writable in samples:
        fast = module.describe(obj, writable)
        if fast is None:
            continue
        handled += 1
        reference = reference_descriptor(obj, writable)
        if fast != reference:
            return (f"descriptor of a {type(obj).__name__} {getattr(obj, 'dtype', '')} differs: "
                    f"{fast} (extension) vs {reference} (ctypes)")
    return None if handled else "no sample array was handled"


def _numpy_samples() -> List[Tuple[Any, bool]]:
    base = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)
    read_only = base.copy()
    read_only.flags.writeable = False
    return [(base, True), (base[:, :, ::2], False), (base.transpose(1, 0, 2), False),
            (base[:, 1:2], True), (read_only, False), (read_only, True),
            (np.zeros((4, 1), np.float16), True), (np.zeros(5, np.int32), False)]


def _init_numpy(module: Any) -> None:
    global _numpy_on, _numpy_reason
    module.init_numpy(None)
    if not _dlpack._NUMPY_HEAD_OK:
        _numpy_reason = "numpy's array struct layout was not recognised"
        return
    table = []
    candidates = [np.float32, np.float16, np.float64, np.int32, np.int64, np.int8, np.int16,
                  np.uint8, np.bool_]
    try:
        import ml_dtypes  # type: ignore[import-not-found]

        candidates += [getattr(ml_dtypes, name) for name in ("bfloat16", "float8_e4m3fn",
                                                              "float8_e5m2")
                       if hasattr(ml_dtypes, name)]
    except ImportError:
        pass
    for scalar in candidates:
        dtype = np.dtype(scalar)
        sample = np.zeros(2, dtype)
        if sample.dtype is not dtype:
            continue  # not a singleton descr: identity would never match
        reference = reference_descriptor(sample)
        if reference is not None:
            table.append((dtype, reference[4], reference[5], dtype.itemsize))
    module.init_numpy(np.ndarray, object.__basicsize__, table)
    problem = _self_test(module, _numpy_samples())
    if problem is not None:
        module.init_numpy(None)
        _numpy_reason = problem
        return
    _numpy_on = True
    _numpy_reason = "on"


def _torch_samples(torch: Any) -> List[Tuple[Any, bool]]:
    base = torch.arange(2 * 3 * 8, dtype=torch.float32).reshape(2, 3, 8)
    samples = [(base, True), (base[:, :, ::2], False), (base.transpose(0, 1), False),
               (base[:, 1:2], True), (base[1:], False), (torch.zeros(4, 1, dtype=torch.float16), True),
               (torch.zeros(3, 1, 4)[:, :, ::2], False), (torch.zeros(0, 3), True),
               (torch.zeros(5, dtype=torch.int32), False)]
    if hasattr(torch, "bfloat16"):
        samples.append((torch.zeros(2, 3, dtype=torch.bfloat16), True))
    if hasattr(torch, "_neg_view"):
        # A lazy negative view: the ctypes path refuses it, so the extension must decline it.
        samples.append((torch._neg_view(base), False))
    return samples


def _torch_dtype_samples(torch: Any) -> List[Tuple[Any, bool]]:
    samples = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        for name in dir(torch):
            dtype = getattr(torch, name, None)
            if isinstance(dtype, torch.dtype):
                try:
                    samples.append((torch.zeros(2, 3, dtype=dtype), True))
                except Exception:  # dtypes torch cannot allocate plainly (quantized, ...)
                    pass
    return samples


def _init_torch(module: Any, exchange_api: bool = True) -> None:
    """Enables torch tensors once torch is imported (called by runner()). Tensors are read
    through DLPack's C exchange API when torch has it (one C call per tensor) and its
    descriptors match the ctypes path's for every dtype and sample, else through their
    attributes (dtype, layout, is_cuda/is_cpu, get_device(), data_ptr(), shape, stride());
    ``exchange_api=False`` uses the attributes (tests).

    Thread safety: init_torch() only stores the settings to test (run() keeps declining torch
    tensors, so other threads' calls take the ctypes path meanwhile); the self-test reads them
    through describe(); run() uses them only after enable_torch(), once they passed."""
    global _torch_state, _torch_reason
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        return  # not imported (yet): tried again at the next plan
    _torch_state = False
    problem: Optional[str] = "not initialised"
    try:
        table = []
        for name in ("float32", "float16", "bfloat16", "float64", "int32", "int64", "int8",
                     "int16", "uint8", "bool", "float8_e4m3fn", "float8_e5m2"):
            dtype = getattr(torch, name, None)
            if dtype is None:
                continue
            reference = reference_descriptor(torch.zeros(2, dtype=dtype))
            if reference is not None:
                table.append((dtype, reference[4], reference[5], dtype.itemsize))
        # The ctypes path's descriptor of a tensor with a size-1 dimension of stride != 1 tells
        # whether this torch's DLPack export rewrites such strides.
        probe = reference_descriptor(torch.zeros(3, 1, 4)[:, :, ::2])
        normalize = probe is not None and probe[8] is not None and probe[8][1] == 1
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:
            def raw(index: int) -> int:
                return torch.cuda.current_stream(index).cuda_stream
        exchange = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None) if exchange_api \
            else None
        samples = _torch_samples(torch)
    except Exception as error:  # pragma: no cover - an unusual torch build
        problem = f"initialisation failed: {error!r}"
    else:
        for api in ([exchange, None] if exchange is not None else [None]):
            # One try per mode: an exchange API this module cannot use (an unexpected version,
            # a failing self-test) falls back to the attributes.
            try:
                module.init_torch(torch.Tensor, torch.nn.Parameter, torch.strided, raw,
                                  normalize, table, api, False)
                problem = _self_test(module, samples + (_torch_dtype_samples(torch) if api
                                                        else []))
            except Exception as error:
                problem = f"initialisation failed: {error!r}"
            if problem is None:
                break
    if problem is not None or not module.enable_torch():
        module.init_torch(None)
        _torch_reason = problem or "not enabled"
        return
    _torch_state = True
    _torch_reason = "on (" + module.torch_mode() + ")"


_stream_checked = False


def _check_stream(module: Any, device_id: int) -> None:
    """Once, for the first CUDA plan: takes torch's current stream from the exchange API when it
    agrees with torch's own getter on the default stream and on a side stream. The exchange
    API's stream is read through stream(device_id, True) while run() keeps the stream getter;
    run() switches only once the check has passed."""
    global _stream_checked, _torch_reason
    _stream_checked = True
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    module.set_exchange_stream(False)
    if raw is None or "exchange-api" not in module.torch_mode():
        return
    ok = False
    try:
        ok = module.stream(device_id, True) == (raw(device_id) or 0)
        side = torch.cuda.Stream(device=device_id)
        with torch.cuda.stream(side):
            ok = ok and module.stream(device_id, True) == side.cuda_stream == raw(device_id)
    except Exception:  # pragma: no cover
        ok = False
    module.set_exchange_stream(ok)
    _torch_reason = "on (" + module.torch_mode() + ")"


def runner(symbol: str, plan: "_capi.Plan", workspace_ptr: int, workspace_bytes: int,
           layout: int, index: List[_dlpack.DLTensor], keep: Any,
           device: Tuple[int, int] = (_capi.kDLCPU, 0)) -> Any:
    """The extension's Runner for one plan (a callable; see _fastcall.c), or None."""
    if not _enabled:
        return None
    fast = module()
    if fast is None:
        return None
    if _torch_state is None and "torch" in sys.modules:
        with _lock:
            if _torch_state is None:
                _init_torch(fast)
    if not (_numpy_on or _torch_state):
        return None
    if _torch_state and not _stream_checked and device[0] == _capi.kDLCUDA:
        with _lock:
            if not _stream_checked:
                _check_stream(fast, device[1])
    function = ctypes.cast(getattr(_capi.lib(), symbol), ctypes.c_void_p).value
    return fast.runner(_OPS[symbol], function, plan.handle.value if isinstance(
        plan.handle, ctypes.c_void_p) else plan.handle, workspace_ptr or None,
        int(workspace_bytes), int(layout), tuple(ctypes.addressof(t) for t in index),
        (plan, tuple(index), keep))


def set_enabled(enabled: bool) -> None:
    """Turns the fast path on/off for runners made from now on (plan() makes them)."""
    global _enabled
    _enabled = bool(enabled)


def info() -> Dict[str, Any]:
    """Whether the C fast path of run() is in use: path, numpy / torch state, and counts of the
    run calls it served and handed back to the ctypes path."""
    fast = module()
    served, declined = fast.stats() if fast is not None else (0, 0)
    return {
        "loaded": fast is not None,
        "path": _path,
        "reason": _reason,
        "enabled": _enabled,
        "numpy": _numpy_reason if fast is not None else "-",
        "torch": _torch_reason if fast is not None else "-",
        "calls": served,
        "declined": declined,
    }
