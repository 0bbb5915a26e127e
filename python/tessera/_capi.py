"""ctypes binding of the Tessera C ABI (include/tessera/tessera.h).

This module loads ``libtessera.so``, declares the C structs and function prototypes, and turns a
failed status into a Python exception that carries ``tessera_last_error()``:

* ``TESSERA_ERROR_INVALID_ARGUMENT`` -> :class:`ValueError`
* ``TESSERA_ERROR_UNSUPPORTED`` -> :class:`UnsupportedError` (a :class:`ValueError`)
* ``TESSERA_ERROR_RUNTIME`` -> :class:`RuntimeError`
* ``TESSERA_ERROR_OUT_OF_MEMORY`` -> :class:`OutOfMemoryError` (a :class:`RuntimeError`)

Library lookup order: ``$TESSERA_LIBRARY`` (a path to ``libtessera.so``; an error if it cannot be
loaded), the copy installed with the package (``tessera/_lib/libtessera.so``), ``build/`` of the
source tree when the package is imported from ``python/`` of a checkout, then the system loader
path (``ctypes.util.find_library("tessera")``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import threading
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

# ---------------------------------------------------------------------------------------------
# DLPack structs (dlpack.h; layout identical in 0.6 .. 1.x for DLTensor)

kDLCPU = 1
kDLCUDA = 2
kDLCUDAHost = 3
kDLCUDAManaged = 13

kDLInt = 0
kDLUInt = 1
kDLFloat = 2
kDLBfloat = 4
kDLBool = 6
TESSERA_DL_FLOAT8_E4M3FN = 10
TESSERA_DL_FLOAT8_E5M2 = 12

TESSERA_KV_LAYOUT_NHD = 0
TESSERA_KV_LAYOUT_HND = 1

TESSERA_OK = 0
TESSERA_ERROR_INVALID_ARGUMENT = 1
TESSERA_ERROR_UNSUPPORTED = 2
TESSERA_ERROR_RUNTIME = 3
TESSERA_ERROR_OUT_OF_MEMORY = 4

#: ABI version this binding was written for (TESSERA_ABI_VERSION of tessera.h).
ABI_VERSION = 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


# ---------------------------------------------------------------------------------------------
# Tessera structs


class AttentionOptions(ctypes.Structure):
    """``tessera_attention_options``."""

    _fields_ = [
        ("causal", ctypes.c_int),
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("logits_soft_cap", ctypes.c_float),
        ("sm_scale", ctypes.c_float),
        ("k_scale", ctypes.c_float),
        ("v_scale", ctypes.c_float),
    ]


class RopeOptionsC(ctypes.Structure):
    """``tessera_rope_options``."""

    _fields_ = [
        ("rotary_dim", ctypes.c_int32),
        ("interleave", ctypes.c_int),
        ("rope_theta", ctypes.c_float),
        ("rope_scale", ctypes.c_float),
        ("llama31", ctypes.c_int),
        ("llama31_factor", ctypes.c_float),
        ("llama31_low_freq_factor", ctypes.c_float),
        ("llama31_high_freq_factor", ctypes.c_float),
        ("llama31_original_max_position", ctypes.c_int32),
    ]


_DLTensorP = ctypes.POINTER(DLTensor)


class PagedKV(ctypes.Structure):
    """``tessera_paged_kv``."""

    _fields_ = [
        ("k_cache", _DLTensorP),
        ("v_cache", _DLTensorP),
        ("page_indptr", _DLTensorP),
        ("page_indices", _DLTensorP),
        ("last_page_len", _DLTensorP),
        ("layout", ctypes.c_int),
    ]


class RunOptions(ctypes.Structure):
    """``tessera_run_options`` (per-call options of the *_v2 calls: attention sinks, PDL, custom
    and tree masks); the fields in the order of tessera.h."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("sinks", _DLTensorP),
                ("enable_pdl", ctypes.c_int32), ("custom_mask", _DLTensorP),
                ("mask_indptr", _DLTensorP), ("tree_mask", _DLTensorP)]


class PlanOptions(ctypes.Structure):
    """``tessera_plan_options`` (plan-time options of the *_v2 plan calls: head_dim_vo)."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("head_dim_vo", ctypes.c_int32)]


def plan_options(head_dim_vo: int = 0) -> PlanOptions:
    """A ``tessera_plan_options`` with ``head_dim_vo`` (0: head_dim)."""
    return PlanOptions(ctypes.sizeof(PlanOptions), head_dim_vo)


class CascadeLevelLengths(ctypes.Structure):
    """``tessera_cascade_level_lengths``: host lengths of one cascade level."""

    _fields_ = [("qo_indptr", ctypes.POINTER(ctypes.c_int32)),
                ("page_indptr", ctypes.POINTER(ctypes.c_int32)),
                ("last_page_len", ctypes.POINTER(ctypes.c_int32)),
                ("batch_size", ctypes.c_int64)]


class CascadeLevel(ctypes.Structure):
    """``tessera_cascade_level``: index tensors of one cascade level on the plan's device."""

    _fields_ = [("qo_indptr", _DLTensorP), ("page_indptr", _DLTensorP),
                ("page_indices", _DLTensorP), ("last_page_len", _DLTensorP)]


class MlaOptions(ctypes.Structure):
    """``tessera_mla_options``."""

    _fields_ = [("causal", ctypes.c_int), ("sm_scale", ctypes.c_float)]


class MlaCache(ctypes.Structure):
    """``tessera_mla_cache``: the paged latent cache (kpe_cache NULL when rope_dim is 0)."""

    _fields_ = [("ckv_cache", _DLTensorP), ("kpe_cache", _DLTensorP),
                ("page_indptr", _DLTensorP), ("page_indices", _DLTensorP),
                ("last_page_len", _DLTensorP)]


def run_options(sinks_dl: Optional[DLTensor], enable_pdl: bool = False,
                masks: Any = None) -> RunOptions:
    """A ``tessera_run_options`` whose sinks are ``sinks_dl`` (None: none), with programmatic
    dependent launch when ``enable_pdl``, and the descriptors of ``masks`` (an object with
    ``custom_mask``, ``mask_indptr`` and ``tree_mask`` DLTensor-or-None attributes, kept alive
    by the caller; None: no masks)."""
    def pointer(tensor: Optional[DLTensor]) -> Any:
        return None if tensor is None else ctypes.pointer(tensor)

    return RunOptions(ctypes.sizeof(RunOptions), pointer(sinks_dl), 1 if enable_pdl else 0,
                      pointer(getattr(masks, "custom_mask", None)),
                      pointer(getattr(masks, "mask_indptr", None)),
                      pointer(getattr(masks, "tree_mask", None)))


# ---------------------------------------------------------------------------------------------
# Errors


class UnsupportedError(ValueError):
    """A valid request that this build of the library or this device cannot serve
    (``TESSERA_ERROR_UNSUPPORTED``): for example a CUDA tensor with a CPU-only build."""


class OutOfMemoryError(RuntimeError):
    """The library could not allocate memory (``TESSERA_ERROR_OUT_OF_MEMORY``)."""


class LibraryNotFoundError(OSError):
    """libtessera.so could not be found or loaded."""


_QUOTED_ARG = re.compile(r"'([A-Za-z_][A-Za-z0-9_.]*)'")


def error_for(status: int, message: str, names: Optional[Mapping[str, str]] = None) -> Exception:
    """The exception for a failed status. ``names`` maps the C argument names that the library
    quotes in its messages to the Python argument names of the calling function; a matching
    name is appended to the message so that an FA/FlashInfer user sees their own argument."""
    if names:
        found = _QUOTED_ARG.search(message)
        if found is not None:
            python_name = names.get(found.group(1))
            if python_name is not None and python_name != found.group(1):
                message = f"{message} [Python argument '{python_name}']"
    if status == TESSERA_ERROR_INVALID_ARGUMENT:
        return ValueError(message)
    if status == TESSERA_ERROR_UNSUPPORTED:
        return UnsupportedError(message)
    if status == TESSERA_ERROR_OUT_OF_MEMORY:
        return OutOfMemoryError(message)
    return RuntimeError(message)


def check(status: int, names: Optional[Mapping[str, str]] = None) -> None:
    """Raises the exception for a non-zero tessera_status."""
    if status != TESSERA_OK:
        raise error_for(status, last_error(), names)


# ---------------------------------------------------------------------------------------------
# Loading

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None

_VOIDP = ctypes.c_void_p
_I32P = ctypes.POINTER(ctypes.c_int32)
_OPTS_P = ctypes.POINTER(AttentionOptions)
_ROPE_P = ctypes.POINTER(RopeOptionsC)
_KV_P = ctypes.POINTER(PagedKV)
_RUN_P = ctypes.POINTER(RunOptions)
_STATUS = ctypes.c_int

# name -> (restype, argtypes)
_PROTOTYPES: Dict[str, tuple] = {
    "tessera_last_error": (ctypes.c_char_p, []),
    "tessera_version": (ctypes.c_char_p, []),
    "tessera_abi_version": (ctypes.c_int, []),
    "tessera_cuda_device_count": (ctypes.c_int, []),
    "tessera_stream_capture_id": (_STATUS, [_VOIDP, ctypes.POINTER(ctypes.c_uint64)]),
    "tessera_attention_options_default": (None, [_OPTS_P]),
    "tessera_rope_options_default": (None, [_ROPE_P]),
    "tessera_plan_ragged_prefill": (
        _STATUS,
        [_I32P, _I32P, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, _OPTS_P,
         ctypes.c_int, ctypes.c_int, ctypes.POINTER(_VOIDP)],
    ),
    "tessera_plan_paged_prefill": (
        _STATUS,
        [_I32P, _I32P, _I32P, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
         ctypes.c_int, _OPTS_P, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_VOIDP)],
    ),
    "tessera_plan_decode": (
        _STATUS,
        [_I32P, _I32P, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
         ctypes.c_int, _OPTS_P, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_VOIDP)],
    ),
    "tessera_plan_ragged_prefill_v2": (
        _STATUS,
        [_I32P, _I32P, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, _OPTS_P,
         ctypes.POINTER(PlanOptions), ctypes.c_int, ctypes.c_int, ctypes.POINTER(_VOIDP)],
    ),
    "tessera_plan_paged_prefill_v2": (
        _STATUS,
        [_I32P, _I32P, _I32P, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
         ctypes.c_int, _OPTS_P, ctypes.POINTER(PlanOptions), ctypes.c_int, ctypes.c_int,
         ctypes.POINTER(_VOIDP)],
    ),
    "tessera_plan_head_dim_vo": (ctypes.c_int32, [_VOIDP]),
    "tessera_plan_cascade": (
        _STATUS,
        [ctypes.POINTER(CascadeLevelLengths), ctypes.c_int, ctypes.c_int, ctypes.c_int,
         ctypes.c_int, ctypes.c_int, _OPTS_P, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_VOIDP)],
    ),
    "tessera_cascade_plan_workspace_bytes": (ctypes.c_size_t, [_VOIDP]),
    "tessera_cascade_plan_num_levels": (ctypes.c_int, [_VOIDP]),
    "tessera_cascade_plan_explain": (
        _STATUS, [_VOIDP, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    ),
    "tessera_cascade_plan_upload": (_STATUS, [_VOIDP, _VOIDP, ctypes.c_size_t, _VOIDP]),
    "tessera_cascade_plan_destroy": (None, [_VOIDP]),
    "tessera_run_cascade": (
        _STATUS,
        [_VOIDP, _DLTensorP, _DLTensorP, _DLTensorP, ctypes.c_int,
         ctypes.POINTER(CascadeLevel), ctypes.c_int, _DLTensorP, _DLTensorP, _VOIDP,
         ctypes.c_size_t, _VOIDP, _RUN_P],
    ),
    "tessera_plan_mla": (
        _STATUS,
        [_I32P, _I32P, _I32P, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
         ctypes.c_int, ctypes.POINTER(MlaOptions), ctypes.c_int, ctypes.c_int,
         ctypes.POINTER(_VOIDP)],
    ),
    "tessera_mla_plan_workspace_bytes": (ctypes.c_size_t, [_VOIDP]),
    "tessera_mla_plan_explain": (
        _STATUS, [_VOIDP, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    ),
    "tessera_mla_plan_destroy": (None, [_VOIDP]),
    "tessera_run_mla": (
        _STATUS,
        [_VOIDP, _DLTensorP, _DLTensorP, ctypes.POINTER(MlaCache), _DLTensorP, _DLTensorP,
         _DLTensorP, _VOIDP, ctypes.c_size_t, _VOIDP],
    ),
    "tessera_append_paged_mla_cache": (
        _STATUS,
        [_DLTensorP, _DLTensorP, _DLTensorP, ctypes.POINTER(MlaCache), _ROPE_P, _VOIDP],
    ),
    "tessera_plan_workspace_bytes": (ctypes.c_size_t, [_VOIDP]),
    "tessera_plan_upload": (_STATUS, [_VOIDP, _VOIDP, ctypes.c_size_t, _VOIDP]),
    "tessera_workspace_forget_uploads": (None, [_VOIDP]),
    "tessera_plan_explain": (
        _STATUS, [_VOIDP, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    ),
    "tessera_plan_destroy": (None, [_VOIDP]),
    "tessera_run_ragged_prefill": (
        _STATUS,
        [_VOIDP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP,
         _DLTensorP, _VOIDP, ctypes.c_size_t, _VOIDP],
    ),
    "tessera_run_paged_prefill": (
        _STATUS,
        [_VOIDP, _DLTensorP, _KV_P, _DLTensorP, _DLTensorP, _DLTensorP, _VOIDP, ctypes.c_size_t,
         _VOIDP],
    ),
    "tessera_run_decode": (
        _STATUS,
        [_VOIDP, _DLTensorP, _KV_P, _DLTensorP, _DLTensorP, _VOIDP, ctypes.c_size_t, _VOIDP],
    ),
    "tessera_ragged_prefill": (
        _STATUS,
        [_DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP,
         _OPTS_P, _VOIDP],
    ),
    "tessera_paged_prefill": (
        _STATUS, [_DLTensorP, _KV_P, _DLTensorP, _DLTensorP, _DLTensorP, _OPTS_P, _VOIDP]
    ),
    "tessera_decode": (_STATUS, [_DLTensorP, _KV_P, _DLTensorP, _DLTensorP, _OPTS_P, _VOIDP]),
    "tessera_run_ragged_prefill_v2": (
        _STATUS,
        [_VOIDP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP,
         _DLTensorP, _VOIDP, ctypes.c_size_t, _VOIDP, _RUN_P],
    ),
    "tessera_run_paged_prefill_v2": (
        _STATUS,
        [_VOIDP, _DLTensorP, _KV_P, _DLTensorP, _DLTensorP, _DLTensorP, _VOIDP, ctypes.c_size_t,
         _VOIDP, _RUN_P],
    ),
    "tessera_run_decode_v2": (
        _STATUS,
        [_VOIDP, _DLTensorP, _KV_P, _DLTensorP, _DLTensorP, _VOIDP, ctypes.c_size_t, _VOIDP,
         _RUN_P],
    ),
    "tessera_ragged_prefill_v2": (
        _STATUS,
        [_DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP,
         _OPTS_P, _VOIDP, _RUN_P],
    ),
    "tessera_paged_prefill_v2": (
        _STATUS, [_DLTensorP, _KV_P, _DLTensorP, _DLTensorP, _DLTensorP, _OPTS_P, _VOIDP, _RUN_P]
    ),
    "tessera_decode_v2": (
        _STATUS, [_DLTensorP, _KV_P, _DLTensorP, _DLTensorP, _OPTS_P, _VOIDP, _RUN_P]
    ),
    "tessera_apply_rope_inplace": (
        _STATUS, [_DLTensorP, _DLTensorP, _DLTensorP, _ROPE_P, _VOIDP]
    ),
    "tessera_apply_rope_with_cos_sin_cache_inplace": (
        _STATUS, [_DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, ctypes.c_int, _VOIDP]
    ),
    "tessera_append_paged_kv_cache": (
        _STATUS, [_DLTensorP, _DLTensorP, _DLTensorP, _KV_P, _ROPE_P, _VOIDP]
    ),
    "tessera_block_table_to_csr": (
        _STATUS,
        [_DLTensorP, _DLTensorP, ctypes.c_int, _DLTensorP, _DLTensorP, _DLTensorP, _VOIDP],
    ),
    "tessera_merge_state": (
        _STATUS,
        [_DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _VOIDP],
    ),
    "tessera_merge_states": (
        _STATUS, [_DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _DLTensorP, _VOIDP]
    ),
    "tessera_set_num_threads": (_STATUS, [ctypes.c_int]),
    "tessera_set_cpu_reference": (_STATUS, [ctypes.c_int]),
    "tessera_set_index_checking": (_STATUS, [ctypes.c_int]),
    "tessera_index_checking": (ctypes.c_int, []),
}


def _candidates() -> List[Path]:
    here = Path(__file__).resolve().parent
    paths = [here / "_lib" / "libtessera.so", here / "_lib" / "lib" / "libtessera.so"]
    # Imported from python/ of a source checkout (PYTHONPATH=python): the default CMake build
    # folder of that checkout (tools/run.sh builds into build/); TESSERA_LIBRARY for any other.
    root = here.parent.parent
    if (root / "CMakeLists.txt").is_file() and (root / "include" / "tessera").is_dir():
        paths.append(root / "build" / "libtessera.so")
    return paths


def _load() -> ctypes.CDLL:
    override = os.environ.get("TESSERA_LIBRARY")
    tried: List[str] = []
    if override:
        try:
            return _bind(ctypes.CDLL(override), override)
        except OSError as error:
            raise LibraryNotFoundError(
                f"tessera: TESSERA_LIBRARY={override!r} could not be loaded: {error}"
            ) from error
    for path in _candidates():
        if path.is_file():
            return _bind(ctypes.CDLL(str(path)), str(path))
        tried.append(str(path))
    found = ctypes.util.find_library("tessera")
    if found:
        try:
            return _bind(ctypes.CDLL(found), found)
        except OSError:
            tried.append(found)
    raise LibraryNotFoundError(
        "tessera: libtessera.so not found (looked at: " + ", ".join(tried) + " and the system "
        "library path). Install the package with `pip install .` from the repository, or set "
        "TESSERA_LIBRARY=/path/to/libtessera.so."
    )


def _bind(handle: ctypes.CDLL, path: str) -> ctypes.CDLL:
    global _lib_path
    missing = []
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            function = getattr(handle, name)
        except AttributeError:
            missing.append(name)
            continue
        function.restype = restype
        function.argtypes = argtypes
    if missing:
        raise LibraryNotFoundError(
            f"tessera: {path} is not a compatible libtessera.so (missing {', '.join(missing)})"
        )
    abi = handle.tessera_abi_version()
    if abi != ABI_VERSION:
        raise LibraryNotFoundError(
            f"tessera: {path} has C ABI version {abi}, this package needs {ABI_VERSION}"
        )
    _lib_path = path
    return handle


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first use)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load()
    return _lib


def library_path() -> str:
    """Path of the libtessera.so in use (loads it if needed)."""
    lib()
    assert _lib_path is not None
    return _lib_path


def last_error() -> str:
    return lib().tessera_last_error().decode("utf-8", "replace")


def default_attention_options() -> AttentionOptions:
    options = AttentionOptions()
    lib().tessera_attention_options_default(ctypes.byref(options))
    return options


def default_rope_options() -> RopeOptionsC:
    options = RopeOptionsC()
    lib().tessera_rope_options_default(ctypes.byref(options))
    return options


class Plan:
    """Owns a ``tessera_plan*``: destroyed when this object is garbage-collected."""

    __slots__ = ("handle", "workspace_bytes", "_destroy", "_explain", "__weakref__")
    _prefix = "tessera_plan"

    def __init__(self, handle: ctypes.c_void_p) -> None:
        library = lib()
        self.handle = handle
        self.workspace_bytes = int(getattr(library, self._prefix + "_workspace_bytes")(handle))
        self._destroy = getattr(library, self._prefix + "_destroy")
        self._explain = getattr(library, self._prefix + "_explain")

    def explain(self) -> str:
        """Human-readable description of how the batch is partitioned."""
        needed = ctypes.c_size_t(0)
        check(self._explain(self.handle, None, 0, ctypes.byref(needed)))
        buffer = ctypes.create_string_buffer(needed.value)
        check(self._explain(self.handle, buffer, needed.value, None))
        return buffer.value.decode("utf-8", "replace")

    def __del__(self) -> None:
        handle, self.handle = self.handle, None
        if handle:
            self._destroy(handle)


class CascadePlan(Plan):
    """Owns a ``tessera_cascade_plan*`` (same interface as :class:`Plan`)."""

    __slots__ = ()
    _prefix = "tessera_cascade_plan"


class MlaPlan(Plan):
    """Owns a ``tessera_mla_plan*`` (same interface as :class:`Plan`)."""

    __slots__ = ()
    _prefix = "tessera_mla_plan"
