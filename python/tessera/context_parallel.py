"""Context-parallel attention over a ``torch.distributed`` process group.

One long sequence's prefill is sharded by sequence over the N ranks of a group with the
load-balanced zigzag split (the same as the C++ ``include/tessera/context_parallel.hpp``): the
sequence is cut into 2N chunks ``[floor(c L / 2N), floor((c + 1) L / 2N))`` (lengths differ by at
most one token, nothing is padded) and rank ``r`` holds chunks ``r`` and ``2N - 1 - r``, in that
order. At ring step ``t`` rank ``r`` attends its queries to the K/V shard of rank ``(r - t) mod N``;
a query chunk sees a prefix of a shard's rows, so each (query chunk, shard) pair is one
:func:`tessera.varlen_attention` call, non-causal when the whole prefix precedes the chunk and
causal (bottom-right aligned) when the prefix ends with the chunk itself; fully masked pairs are
skipped. The partial ``(o, lse)`` of every row are combined exactly by
:func:`tessera.merge_states`.

Decode: each rank attends q to its own shard of the KV cache (any call that returns
``(o, lse)``), then :func:`merge_across_ranks` all-gathers the partials and merges them.

NCCL's NVLink multicast must stay off: set ``NCCL_NVLS_ENABLE=0`` before
``torch.distributed.init_process_group`` (:func:`disable_nvls` does it when unset).

The schedule and the per-rank step loop are plain Python over any array type: the CPU tests run
them with numpy on simulated ranks, and the torch path adds only the communication.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .attention import varlen_attention
from .ops import merge_states

__all__ = [
    "Block",
    "zigzag_chunk_bounds",
    "zigzag_positions",
    "shard_zigzag",
    "unshard_zigzag",
    "prefill_schedule",
    "run_rank_prefill",
    "context_parallel_prefill",
    "merge_across_ranks",
    "disable_nvls",
]

ArrayLike = Any


def disable_nvls() -> str:
    """Sets ``NCCL_NVLS_ENABLE=0`` unless already set; returns the value in effect."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    return os.environ["NCCL_NVLS_ENABLE"]


def zigzag_chunk_bounds(seq_len: int, world_size: int) -> List[int]:
    """The 2N + 1 chunk boundaries ``floor(c * seq_len / 2N)``."""
    if world_size < 1:
        raise ValueError(f"'world_size': expected >= 1, got {world_size}")
    if seq_len < 0:
        raise ValueError(f"'seq_len': expected >= 0, got {seq_len}")
    chunks = 2 * world_size
    return [c * seq_len // chunks for c in range(chunks + 1)]


def zigzag_positions(seq_len: int, world_size: int, rank: int) -> np.ndarray:
    """Global token positions of a rank's local rows (chunk ``rank`` then ``2N - 1 - rank``)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"'rank': expected 0 <= rank < {world_size}, got {rank}")
    bounds = zigzag_chunk_bounds(seq_len, world_size)
    high = 2 * world_size - 1 - rank
    return np.concatenate([np.arange(bounds[rank], bounds[rank + 1]),
                           np.arange(bounds[high], bounds[high + 1])]).astype(np.int64)


def shard_zigzag(x: ArrayLike, world_size: int, rank: int) -> ArrayLike:
    """A rank's rows of a full-sequence tensor ``[seq_len, ...]`` (numpy or torch)."""
    positions = zigzag_positions(int(x.shape[0]), world_size, rank)
    if type(x).__module__.startswith("torch"):
        import torch

        return x[torch.as_tensor(positions, device=x.device)]
    return x[positions]


def unshard_zigzag(shards: Sequence[ArrayLike]) -> np.ndarray:
    """Reassembles numpy shards of every rank (in rank order) into the full sequence."""
    world = len(shards)
    seq_len = sum(int(s.shape[0]) for s in shards)
    out = np.empty((seq_len,) + tuple(shards[0].shape[1:]), dtype=shards[0].dtype)
    for rank, shard in enumerate(shards):
        out[zigzag_positions(seq_len, world, rank)] = shard
    return out


@dataclass(frozen=True)
class Block:
    """One attention call of a rank: local query rows ``[q_begin, q_end)`` against rows
    ``[0, kv_end)`` of the K/V shard of ``source_rank`` at ring step ``step``."""

    step: int
    source_rank: int
    q_begin: int
    q_end: int
    kv_end: int
    causal: bool


def prefill_schedule(seq_len: int, world_size: int, rank: int, causal: bool) -> List[Block]:
    """The blocks of a rank in step order (no fully masked pair, every visible pair of the
    sequence computed by exactly one block of one rank)."""
    bounds = zigzag_chunk_bounds(seq_len, world_size)

    def local_chunks(r: int) -> List[Tuple[int, int, int]]:  # (chunk, local row begin, length)
        low, high = r, 2 * world_size - 1 - r
        low_len = bounds[low + 1] - bounds[low]
        return [(low, 0, low_len), (high, low_len, bounds[high + 1] - bounds[high])]

    blocks = []
    for step in range(world_size):
        source = (rank - step) % world_size
        for q_chunk, q_begin, q_len in local_chunks(rank):
            if q_len == 0:
                continue
            kv_end, diagonal = 0, False
            for kv_chunk, kv_begin, kv_len in local_chunks(source):  # position order
                if causal and kv_chunk > q_chunk:
                    break
                kv_end = kv_begin + kv_len
                if causal and kv_chunk == q_chunk:
                    diagonal = True
                    break
            if kv_end > 0:
                blocks.append(Block(step, source, q_begin, q_begin + q_len, kv_end, diagonal))
    return blocks


def _empty_like(x: ArrayLike, shape: Tuple[int, ...], dtype: Any, fill: float) -> ArrayLike:
    if type(x).__module__.startswith("torch"):
        import torch

        return torch.full(shape, fill, dtype=dtype, device=x.device)
    return np.full(shape, fill, dtype=dtype)


def run_rank_prefill(
    q: ArrayLike,
    seq_len: int,
    world_size: int,
    rank: int,
    kv_for_step: Callable[[int], Tuple[ArrayLike, ArrayLike]],
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
) -> Tuple[ArrayLike, ArrayLike]:
    """One rank's context-parallel prefill, with the communication left to ``kv_for_step(t)``,
    which returns ``(k, v)`` of rank ``(rank - t) mod N``'s shard (rows may be padded beyond the
    shard's length) and may start fetching step t+1's shard before returning.

    Returns ``(o, lse)`` of the local rows. Partial states go in slot ``step`` of a
    ``[rows, N, H, D]`` buffer (unused slots have lse = -inf and weigh nothing) merged by
    :func:`tessera.merge_states`."""
    rows, heads, dim = (int(s) for s in q.shape)
    is_torch = type(q).__module__.startswith("torch")
    if is_torch:
        import torch

        lse_dtype = torch.float32
    else:
        lse_dtype = np.float32
    states = _empty_like(q, (rows, world_size, heads, dim), q.dtype, 0.0)
    states_lse = _empty_like(q, (rows, world_size, heads), lse_dtype, float("-inf"))
    blocks = prefill_schedule(seq_len, world_size, rank, causal)
    for step in range(world_size):
        k, v = kv_for_step(step)
        for b in (b for b in blocks if b.step == step):
            q_len = b.q_end - b.q_begin
            o, lse = varlen_attention(
                q[b.q_begin:b.q_end], k[:b.kv_end], v[:b.kv_end],
                np.array([0, q_len], np.int32), np.array([0, b.kv_end], np.int32),
                softmax_scale=softmax_scale, causal=b.causal, softcap=softcap, return_lse=True)
            states[b.q_begin:b.q_end, step] = o
            states_lse[b.q_begin:b.q_end, step] = lse
    if rows == 0:
        return _empty_like(q, (0, heads, dim), q.dtype, 0.0), _empty_like(
            q, (0, heads), lse_dtype, 0.0)
    return merge_states(states, states_lse)


def context_parallel_prefill(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    seq_len: int,
    group: Any = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    exchange: str = "ring",
) -> Tuple[ArrayLike, ArrayLike]:
    """Context-parallel prefill of one sequence over a ``torch.distributed`` group.

    Args:
        q, k, v: this rank's zigzag rows (:func:`shard_zigzag`) of the sequence's
            ``[seq_len, H, D]`` / ``[seq_len, H_kv, D]`` CUDA tensors.
        seq_len: the full sequence length.
        group: the process group (None = the default group).
        exchange: ``"ring"`` (send/recv to neighbours, overlapped with the current step) or
            ``"all_gather"`` (one all-gather of every shard, padded to the longest).

    Returns:
        ``(o, lse)`` of the local rows.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if int(q.shape[0]) != len(zigzag_positions(seq_len, world, rank)):
        raise ValueError(f"'q': expected the {len(zigzag_positions(seq_len, world, rank))} "
                         f"zigzag rows of rank {rank}, got {int(q.shape[0])}")
    if exchange not in ("ring", "all_gather"):
        raise ValueError(f"'exchange': expected 'ring' or 'all_gather', got {exchange!r}")
    max_rows = max(len(zigzag_positions(seq_len, world, r)) for r in range(world))
    local = torch.zeros((2, max_rows) + tuple(k.shape[1:]), dtype=k.dtype, device=k.device)
    local[0, :k.shape[0]] = k
    local[1, :v.shape[0]] = v

    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    if exchange == "all_gather":
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local.contiguous(), group=group)

        def kv_for_step(step: int):
            source = gathered[(rank - step) % world]
            return source[0], source[1]
    else:
        buffers = [local, torch.empty_like(local)]
        pending: List[Any] = []

        def kv_for_step(step: int):
            for request in pending:
                request.wait()
            pending.clear()
            current = buffers[step % 2]
            if step + 1 < world:  # start the next shard's transfer, overlapped with this step
                pending.extend(dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, current, global_rank((rank + 1) % world), group),
                    dist.P2POp(dist.irecv, buffers[(step + 1) % 2],
                               global_rank((rank - 1) % world), group),
                ]))
            return current[0], current[1]

    return run_rank_prefill(q, seq_len, world, rank, kv_for_step, causal, softmax_scale, softcap)


def merge_across_ranks(o: ArrayLike, lse: ArrayLike, group: Any = None
                       ) -> Tuple[ArrayLike, ArrayLike]:
    """Context-parallel decode's combine step: every rank passes its partial ``o``
    ``[rows, H, D]`` and ``lse`` ``[rows, H]`` over its KV shard; the partials are all-gathered
    and merged exactly; every rank gets the same ``(o, lse)``."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    os_ = [torch.empty_like(o) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(os_, o.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    return merge_states(torch.stack(os_, dim=1), torch.stack(lses, dim=1))
