"""FlashInfer-style plan/run wrappers for serving:

* :class:`BatchPrefillWithRaggedKVCacheWrapper` — prefill over ragged K/V (``[total_kv, H, D]``).
* :class:`BatchPrefillWithPagedKVCacheWrapper` — chunked prefill / append over a paged KV cache.
* :class:`BatchDecodeWithPagedKVCacheWrapper` — batch decode (and speculative decoding with a few
  query tokens per request) over a paged KV cache.
* :class:`MultiLevelCascadeAttentionWrapper` — cascade attention: shared prefixes read once per
  group of requests, merged exactly with each request's own keys (:mod:`.cascade`).
* :class:`BatchMLAPagedAttentionWrapper` — DeepSeek-style multi-head latent attention over a
  paged latent cache, and :func:`append_paged_mla_cache` (:mod:`.mla`; CPU only for now).

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

The package has a module per wrapper family (:mod:`.ragged_prefill`, :mod:`.paged_prefill`,
:mod:`.decode`) over the state they share (:mod:`._base`: workspace, plan, index arrays; the
argument names and checks of :mod:`._args`; the C fast path's call, :mod:`._fast_run`).
"""

from __future__ import annotations

# Also importable from here: the fast path's call (integrations/transformers.py) and the HND view.
from ._base import _hnd_to_nhd  # noqa: F401
from ._fast_run import NOT_SERVED, fast_run  # noqa: F401
from .cascade import MultiLevelCascadeAttentionWrapper
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .mla import BatchMLAPagedAttentionWrapper, append_paged_mla_cache
from .paged_prefill import BatchPrefillWithPagedKVCacheWrapper
from .ragged_prefill import BatchPrefillWithRaggedKVCacheWrapper

__all__ = [
    "BatchPrefillWithRaggedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchDecodeWithPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "BatchMLAPagedAttentionWrapper",
    "append_paged_mla_cache",
]
