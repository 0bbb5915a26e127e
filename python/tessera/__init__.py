"""Tessera: attention kernels for LLM inference, from Python.

A pure-Python package over Tessera's C ABI (``libtessera.so`` through ctypes), so one build
serves every Python version and every framework that speaks DLPack (numpy, torch, cupy, jax).

FlashAttention-style::

    o = tessera.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal=True)
    o = tessera.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                       block_table=table, causal=True)

FlashInfer-style plan/run (serving hot path, CUDA-graph friendly)::

    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(kv_page_indptr, kv_page_indices, kv_last_page_len, 32, 8, 128, page_size)
    o = wrapper.run(q, (k_cache, v_cache))

Masks: the prefill wrappers' ``plan(custom_mask= / packed_custom_mask=)`` (FlashInfer's custom
masks) and the decode wrapper's ``plan(tree_mask=)`` (speculative decoding with a tree of
drafts), CPU only for now; :func:`packbits` and :func:`segment_packbits` pack boolean masks.

Ops: :func:`append_paged_kv_cache`, :func:`apply_rope_inplace` (and the FlashInfer family
``apply_rope_pos_ids_inplace``, ``apply_llama31_rope_inplace``, out-of-place ``apply_rope`` ...),
:func:`merge_state`, :func:`merge_states`, :func:`block_table_to_csr`.

PyTorch: :mod:`tessera.torch_ops` registers ``torch.ops.tessera.*`` custom ops (torch.compile
safe); :mod:`tessera.integrations.transformers` adds a Hugging Face attention backend.

Errors: a bad argument raises ValueError naming it (:class:`UnsupportedError`, a ValueError, for
a request this build or device cannot serve); a failure while running raises RuntimeError.
``TESSERA_LIBRARY=/path/libtessera.so`` selects the library to load.
"""

from __future__ import annotations

from ._capi import LibraryNotFoundError, OutOfMemoryError, UnsupportedError
from ._capi import library_path as _library_path
from ._capi import check as _check
from ._capi import lib as _lib
from .attention import attention_with_kvcache, paged_attention, varlen_attention
from ._masks import packbits, segment_packbits
from .ops import (
    RopeOptions,
    append_paged_kv_cache,
    apply_llama31_rope,
    apply_llama31_rope_inplace,
    apply_llama31_rope_pos_ids,
    apply_llama31_rope_pos_ids_inplace,
    apply_rope,
    apply_rope_inplace,
    apply_rope_pos_ids,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
    apply_rope_pos_ids_inplace,
    block_table_to_csr,
    merge_state,
    merge_states,
)
from .wrappers import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchMLAPagedAttentionWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
    append_paged_mla_cache,
)


def fastcall_info() -> dict:
    """Whether the wrappers' run() uses the C fast path (the ``tessera._fastcall`` extension,
    found beside libtessera.so; ``TESSERA_FASTCALL=0`` turns it off): its path, the numpy /
    torch state, and how many run calls it served or handed back to the ctypes path."""
    from . import _fast

    return _fast.info()


def _package_version() -> str:
    try:
        from ._version import __version__ as version  # written by the wheel build

        return version
    except ImportError:
        pass
    try:
        from importlib.metadata import PackageNotFoundError, version as metadata_version

        try:
            return metadata_version("tessera")
        except PackageNotFoundError:
            pass
    except ImportError:
        pass
    # Running from a source tree (PYTHONPATH=python, TESSERA_LIBRARY=...): the library knows.
    try:
        return _lib().tessera_version().decode()
    except Exception:  # no loadable library: the import itself still works
        return "0+unknown"


__version__: str = _package_version()


def library_path() -> str:
    """Absolute path of the ``libtessera.so`` this package uses (loads it if needed)."""
    return _library_path()


def library_version() -> str:
    """``major.minor.patch`` of the loaded library (may differ from ``__version__`` when
    ``TESSERA_LIBRARY`` points at another build)."""
    return _lib().tessera_version().decode()


def cuda_device_count() -> int:
    """Visible CUDA devices; 0 in a CPU-only build or without a driver."""
    return int(_lib().tessera_cuda_device_count())


def set_num_threads(threads: int) -> None:
    """Threads of the CPU backend (process-wide): >= 1 pins the count, 0 restores the default
    (``TESSERA_NUM_THREADS`` or the hardware count)."""
    _check(_lib().tessera_set_num_threads(int(threads)), {"threads": "threads"})


def set_index_checking(enable: bool = True) -> None:
    """Checked mode (process-wide): run() copies device-resident index arrays (indptr,
    page_indices, last_page_len) to the host and validates them before any kernel runs, raising
    ValueError that names the first bad entry; it also raises ValueError naming the tensor and
    the first NaN / inf element among the q, k and v values a call reads. Synchronises the
    stream, so keep it off in production and during CUDA-graph capture; ``TESSERA_CHECK=1``
    turns it on at start-up."""
    _check(_lib().tessera_set_index_checking(1 if enable else 0))


def index_checking() -> bool:
    """Whether checked mode is on."""
    return bool(_lib().tessera_index_checking())


def use_cpu_reference(enable: bool = True) -> None:
    """Serve CPU attention with the double-accumulating reference (tests) instead of the fast
    tiled path (process-wide)."""
    _check(_lib().tessera_set_cpu_reference(1 if enable else 0))


__all__ = [
    "__version__",
    "library_path",
    "fastcall_info",
    "library_version",
    "cuda_device_count",
    "set_num_threads",
    "set_index_checking",
    "index_checking",
    "use_cpu_reference",
    "UnsupportedError",
    "OutOfMemoryError",
    "LibraryNotFoundError",
    "varlen_attention",
    "attention_with_kvcache",
    "paged_attention",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchDecodeWithPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "BatchMLAPagedAttentionWrapper",
    "append_paged_mla_cache",
    "RopeOptions",
    "append_paged_kv_cache",
    "apply_rope_inplace",
    "apply_rope_pos_ids_inplace",
    "apply_llama31_rope_inplace",
    "apply_llama31_rope_pos_ids_inplace",
    "apply_rope",
    "apply_rope_pos_ids",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "apply_llama31_rope",
    "apply_llama31_rope_pos_ids",
    "merge_state",
    "merge_states",
    "block_table_to_csr",
    "packbits",
    "segment_packbits",
]
