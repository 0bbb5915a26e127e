"""Custom and tree masks: bit packing as FlashInfer does it (:func:`packbits`,
:func:`segment_packbits`, the ``flashinfer.quantization`` functions) and the masks of one plan of
the wrappers (custom masks of the two prefill wrappers, tree masks of the decode wrapper),
packed the way the C ABI's ``tessera_run_options`` takes them (include/tessera/attention.hpp,
``RunOptions``).

Both masks are bit strings packed *little-endian*: bit ``b`` is bit ``b % 8`` of byte ``b // 8``
(``numpy.packbits(..., bitorder="little")``; FlashInfer's ``packed_custom_mask``).

* Custom mask (prefill): request ``r``'s bits start at byte ``mask_indptr[r]``; bit
  ``i * kv_len_r + j`` is 1 when its query row ``i`` may see its key ``j``. A boolean
  ``custom_mask`` is FlashInfer's: every request's ``[q_len_r, kv_len_r]`` matrix flattened and
  concatenated.
* Tree mask (decode, speculative decoding): ``[batch_size, q_per_request, q_per_request]``
  booleans, ``[b, i, d]`` True when draft token ``i`` sees draft ``d`` (the request's last
  ``q_per_request`` keys are the drafts' own; every draft sees the keys before them).

Masks run on the CPU backend only for now: on a CUDA workspace the run raises
:class:`tessera.UnsupportedError` naming the mask.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ._dlpack import DLTensor, framework, from_numpy, to_dl, to_host_int32

__all__ = ["packbits", "segment_packbits"]


def _to_host(obj: Any, name: str) -> np.ndarray:
    """A host numpy copy (or view) of an array of any framework, or of a Python sequence."""
    kind = framework(obj)
    if kind == "torch":
        obj = obj.detach().to("cpu").numpy()
    elif kind == "cupy":
        obj = obj.get()
    elif kind == "dlpack":
        try:
            obj = np.from_dlpack(obj)
        except (TypeError, RuntimeError, BufferError, ValueError):
            obj = np.asarray(obj)
    return np.asarray(obj)


def _bool_bits(obj: Any, name: str) -> np.ndarray:
    array = _to_host(obj, name)
    if array.dtype != np.bool_ and array.dtype.kind not in "iu":
        raise ValueError(f"'{name}': expected a boolean (or 0/1 integer) array, got dtype "
                         f"{array.dtype}")
    return array.astype(bool, copy=False)


def _check_bitorder(bitorder: str) -> str:
    if bitorder not in ("big", "little"):
        raise ValueError(f"'bitorder': expected 'big' or 'little', got {bitorder!r}")
    return bitorder


def _like_input(values: np.ndarray, obj: Any) -> Any:
    """``values`` in the framework and on the device of ``obj`` (torch), else numpy."""
    if framework(obj) == "torch":
        torch = sys.modules["torch"]
        return torch.from_numpy(np.ascontiguousarray(values)).to(obj.device)
    return values


def packbits(x: Any, bitorder: str = "big") -> Any:
    """Packs the elements of boolean array ``x`` (flattened) into uint8, 8 per byte, like
    ``numpy.packbits(x, bitorder=bitorder)`` and ``flashinfer.packbits`` (the default is theirs,
    ``"big"``; the masks need ``bitorder="little"``). Returns a torch tensor on ``x``'s device
    for a torch ``x``, else a numpy array."""
    bits = _bool_bits(x, "x").reshape(-1)
    return _like_input(np.packbits(bits, bitorder=_check_bitorder(bitorder)), x)


def segment_packbits(x: Any, indptr: Any, bitorder: str = "big") -> Tuple[Any, Any]:
    """Packs each segment ``x[indptr[i]:indptr[i + 1]]`` of boolean array ``x`` into its own
    ``ceil(len / 8)`` bytes (``flashinfer.quantization.segment_packbits``). Returns
    ``(packed, packed_indptr)``: the segments' bytes back to back (uint8) and where each starts
    (int32, ``[len(indptr)]``), in ``x``'s framework (torch on ``x``'s device, else numpy)."""
    bits = _bool_bits(x, "x").reshape(-1)
    offsets = _to_host(indptr, "indptr").reshape(-1)
    if offsets.dtype.kind not in "iu":
        raise ValueError(f"'indptr': expected integers, got dtype {offsets.dtype}")
    offsets = offsets.astype(np.int64)
    order = _check_bitorder(bitorder)
    if offsets.size < 1 or offsets[0] < 0 or np.any(np.diff(offsets) < 0) or \
            offsets[-1] > bits.size:
        raise ValueError(f"'indptr': expected non-decreasing offsets into the {bits.size} "
                         f"elements of x starting at >= 0, got {offsets.tolist()}")
    lengths = np.diff(offsets)
    packed_indptr = np.zeros(offsets.size, np.int64)
    packed_indptr[1:] = np.cumsum((lengths + 7) // 8)
    if packed_indptr[-1] >= 2**31:
        raise ValueError("'x': the packed segments need more than 2^31 - 1 bytes")
    packed = np.zeros(int(packed_indptr[-1]), np.uint8)
    for i in range(lengths.size):
        segment = bits[offsets[i]:offsets[i + 1]]
        packed[packed_indptr[i]:packed_indptr[i + 1]] = np.packbits(segment, bitorder=order)
    return _like_input(packed, x), _like_input(packed_indptr.astype(np.int32), indptr)


class PlannedMasks:
    """The masks of one plan on the workspace's device, as descriptors for
    ``tessera_run_options`` (the arrays are kept alive with them)."""

    __slots__ = ("arrays", "custom_mask", "mask_indptr", "tree_mask")

    def __init__(self) -> None:
        self.arrays: list = []
        self.custom_mask: Optional[DLTensor] = None
        self.mask_indptr: Optional[DLTensor] = None
        self.tree_mask: Optional[DLTensor] = None

    def _place(self, values: np.ndarray, name: str, like: Any, like_dl: DLTensor) -> DLTensor:
        array = from_numpy(values, like, like_dl)
        self.arrays.append(array)
        return to_dl(array, name)


def plan_custom_mask(custom_mask: Any, packed_custom_mask: Any, mask_indptr: Any,
                     q_lens: Sequence[int], kv_lens: Sequence[int], like: Any,
                     like_dl: DLTensor) -> Optional[PlannedMasks]:
    """A prefill plan's custom mask (None without one): FlashInfer's boolean ``custom_mask``
    (every request's ``[q_len, kv_len]`` flattened, concatenated; packed here) or its
    ``packed_custom_mask`` (uint8, little-endian), whose ``mask_indptr`` (byte offsets, Tessera
    extension) defaults to the layout :func:`segment_packbits` makes: each request's
    ``ceil(q_len * kv_len / 8)`` bytes back to back."""
    if custom_mask is None and packed_custom_mask is None:
        if mask_indptr is not None:
            raise ValueError("'mask_indptr': given without custom_mask or packed_custom_mask")
        return None
    if custom_mask is not None and packed_custom_mask is not None:
        raise ValueError("'custom_mask': pass custom_mask or packed_custom_mask, not both")
    q = np.asarray(q_lens, np.int64)
    kv = np.asarray(kv_lens, np.int64)
    bits_indptr = np.zeros(q.size + 1, np.int64)
    bits_indptr[1:] = np.cumsum(q * kv)
    masks = PlannedMasks()
    if custom_mask is not None:
        bits = _bool_bits(custom_mask, "custom_mask").reshape(-1)
        if bits.size != bits_indptr[-1]:
            raise ValueError(f"'custom_mask': expected sum(q_len * kv_len) = {bits_indptr[-1]} "
                             f"elements (each request's [q_len, kv_len] mask, flattened), got "
                             f"{bits.size}")
        packed, indptr = segment_packbits(bits, bits_indptr, bitorder="little")
    else:
        packed = _to_host(packed_custom_mask, "packed_custom_mask")
        if packed.dtype != np.uint8:
            raise ValueError(f"'packed_custom_mask': expected uint8 (bits packed little-endian), "
                             f"got dtype {packed.dtype}")
        packed = packed.reshape(-1)
        if mask_indptr is None:
            indptr = np.zeros(q.size + 1, np.int64)
            indptr[1:] = np.cumsum((q * kv + 7) // 8)
            if indptr[-1] >= 2**31:
                raise ValueError("'packed_custom_mask': more than 2^31 - 1 bytes")
            if packed.size < indptr[-1]:
                raise ValueError(f"'packed_custom_mask': expected at least {indptr[-1]} bytes "
                                 f"(each request's ceil(q_len * kv_len / 8), back to back; or "
                                 f"pass mask_indptr), got {packed.size}")
            indptr = indptr.astype(np.int32)
        else:
            indptr = to_host_int32(mask_indptr, "mask_indptr").reshape(-1)
    masks.custom_mask = masks._place(np.ascontiguousarray(packed), "custom_mask", like, like_dl)
    masks.mask_indptr = masks._place(np.ascontiguousarray(indptr, np.int32), "mask_indptr", like,
                                     like_dl)
    return masks


def plan_tree_mask(tree_mask: Any, batch_size: int, q_per_request: int, like: Any,
                   like_dl: DLTensor) -> Optional[PlannedMasks]:
    """A decode plan's tree mask (None without one): booleans ``[batch_size, q, q]`` (or
    ``[batch_size, q * q]``), packed here little-endian per request, or uint8 rows already
    packed ``[batch_size, >= ceil(q^2 / 8)]``."""
    if tree_mask is None:
        return None
    array = _to_host(tree_mask, "tree_mask")
    q = int(q_per_request)
    if array.dtype == np.uint8:
        if array.ndim != 2:
            raise ValueError(f"'tree_mask': expected packed uint8 [batch_size, bytes_per_request], "
                             f"got shape {list(array.shape)}")
        packed = array
    else:
        bits = _bool_bits(array, "tree_mask")
        if bits.shape not in ((batch_size, q, q), (batch_size, q * q)):
            raise ValueError(f"'tree_mask': expected booleans [batch_size, q_per_request, "
                             f"q_per_request] = [{batch_size}, {q}, {q}], got shape "
                             f"{list(bits.shape)}")
        packed = np.packbits(bits.reshape(batch_size, q * q), axis=1, bitorder="little")
    masks = PlannedMasks()
    masks.tree_mask = masks._place(np.ascontiguousarray(packed), "tree_mask", like, like_dl)
    return masks
