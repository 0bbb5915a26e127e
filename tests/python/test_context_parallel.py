"""Context parallelism on the CPU: the zigzag sharding and ring schedule, and N simulated ranks
running tessera.context_parallel.run_rank_prefill (the loop the torch.distributed path runs, with
the K/V "communication" being a look-up of the other simulated rank's shard) against the float64
reference; decode partials over KV shards merged with merge_states."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from tessera import context_parallel as cp
from _reference import attention_ref


def _rel_l2(actual, expected):
    actual = np.asarray(actual, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("seq_len", [1, 7, 33, 100])
def test_sharding_partitions_the_sequence(world, seq_len):
    bounds = cp.zigzag_chunk_bounds(seq_len, world)
    lengths = np.diff(bounds)
    assert bounds[0] == 0 and bounds[-1] == seq_len
    assert lengths.max() - lengths.min() <= 1
    positions = np.concatenate([cp.zigzag_positions(seq_len, world, r) for r in range(world)])
    assert sorted(positions.tolist()) == list(range(seq_len))
    x = np.arange(seq_len * 2).reshape(seq_len, 2)
    shards = [cp.shard_zigzag(x, world, r) for r in range(world)]
    np.testing.assert_array_equal(cp.unshard_zigzag(shards), x)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
def test_schedule_covers_every_visible_pair_once(world, causal):
    for seq_len in (1, 2 * world - 1, 2 * world + 1, 45):
        covered = np.zeros((seq_len, seq_len), np.int64)
        for rank in range(world):
            mine = cp.zigzag_positions(seq_len, world, rank)
            for b in cp.prefill_schedule(seq_len, world, rank, causal):
                assert b.source_rank == (rank - b.step) % world
                theirs = cp.zigzag_positions(seq_len, world, b.source_rank)
                q_len, kv_len = b.q_end - b.q_begin, b.kv_end
                i = np.arange(q_len)[:, None]
                j = np.arange(kv_len)[None, :]
                visible = (j <= i + kv_len - q_len) if b.causal else np.ones((q_len, kv_len), bool)
                assert visible.any(), "a fully masked block was scheduled"
                qpos = np.broadcast_to(mine[b.q_begin:b.q_end][:, None], visible.shape)[visible]
                kpos = np.broadcast_to(theirs[:kv_len][None, :], visible.shape)[visible]
                np.add.at(covered, (qpos, kpos), 1)
        expected = np.tril(np.ones((seq_len, seq_len), np.int64)) if causal else 1
        np.testing.assert_array_equal(covered, np.broadcast_to(expected, covered.shape))


def _simulate(world, seq_len, heads, kv_heads, dim, dtype, causal, rng):
    q = rng.standard_normal((seq_len, heads, dim)).astype(dtype)
    k = rng.standard_normal((seq_len, kv_heads, dim)).astype(dtype)
    v = rng.standard_normal((seq_len, kv_heads, dim)).astype(dtype)
    shards_k = [cp.shard_zigzag(k, world, r) for r in range(world)]
    shards_v = [cp.shard_zigzag(v, world, r) for r in range(world)]
    outputs, lses = [], []
    for rank in range(world):
        def kv_for_step(step, rank=rank):  # the simulated ring: the source rank's shard
            source = (rank - step) % world
            return shards_k[source], shards_v[source]

        o, lse = cp.run_rank_prefill(cp.shard_zigzag(q, world, rank), seq_len, world, rank,
                                     kv_for_step, causal=causal)
        outputs.append(np.asarray(o))
        lses.append(np.asarray(lse))
    o_ref, lse_ref = attention_ref(q, k, v, [seq_len], [seq_len], causal=causal)
    return cp.unshard_zigzag(outputs), cp.unshard_zigzag(lses), o_ref, lse_ref


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_simulated_ranks_match_the_reference(world, causal, dtype, rng):
    heads, kv_heads = [(4, 4), (4, 2), (8, 1)][world % 3]
    seq_len = int(rng.integers(20, 120)) | 1
    if seq_len % (2 * world) == 0:
        seq_len += 1
    o, lse, o_ref, lse_ref = _simulate(world, seq_len, heads, kv_heads, 64, dtype, causal, rng)
    assert np.isfinite(o.astype(np.float64)).all() and not np.isnan(lse).any()
    assert _rel_l2(o, o_ref) < (1e-2 if dtype == np.float16 else 1e-5)
    np.testing.assert_allclose(lse, lse_ref, atol=1e-3)


def test_bfloat16_simulation(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="numpy bfloat16 needs ml_dtypes")
    o, lse, o_ref, lse_ref = _simulate(4, 77, 4, 2, 64, ml_dtypes.bfloat16, True, rng)
    assert _rel_l2(o.astype(np.float32), o_ref) < 1e-2
    np.testing.assert_allclose(lse, lse_ref, atol=1e-3)


def test_sequences_shorter_than_the_chunks(rng):
    for seq_len in (1, 2, 5):
        o, lse, o_ref, lse_ref = _simulate(4, seq_len, 2, 1, 32, np.float32, True, rng)
        assert _rel_l2(o, o_ref) < 1e-5
        np.testing.assert_allclose(lse, lse_ref, atol=1e-4)


@pytest.mark.parametrize("world", [1, 2, 5])
def test_decode_partials_over_kv_shards_merge_exactly(world, rng):
    """What merge_across_ranks does after its all-gather: every rank's (o, lse) over its KV shard
    (a contiguous cut, possibly empty), merged with tessera.merge_states."""
    kv_len, heads, kv_heads, dim = 203, 8, 2, 64
    q = rng.standard_normal((1, heads, dim)).astype(np.float32)
    k = rng.standard_normal((kv_len, kv_heads, dim)).astype(np.float32)
    v = rng.standard_normal((kv_len, kv_heads, dim)).astype(np.float32)
    cuts = np.sort(np.concatenate([[0, kv_len], rng.integers(0, kv_len, world - 1)]))
    partial_o, partial_lse = [], []
    for r in range(world):
        ks, vs = k[cuts[r]:cuts[r + 1]], v[cuts[r]:cuts[r + 1]]
        o, lse = tessera.varlen_attention(q, ks, vs, np.array([0, 1], np.int32),
                                          np.array([0, len(ks)], np.int32), return_lse=True)
        partial_o.append(o)
        partial_lse.append(lse)
    o, lse = tessera.merge_states(np.stack(partial_o, 1), np.stack(partial_lse, 1))
    o_ref, lse_ref = attention_ref(q, k, v, [1], [kv_len])
    assert _rel_l2(o, o_ref) < 1e-5
    np.testing.assert_allclose(lse, lse_ref, atol=1e-5)


def test_disable_nvls_keeps_a_user_setting(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert cp.disable_nvls() == "0"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert cp.disable_nvls() == "1"


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        cp.zigzag_chunk_bounds(10, 0)
    with pytest.raises(ValueError, match="rank"):
        cp.zigzag_positions(10, 2, 2)
