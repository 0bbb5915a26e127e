"""apply_rope_with_cos_sin_cache(_inplace) (FlashInfer's signature, vLLM's table layout) on the
CPU against numpy: flattened [nnz, heads * head_size] and 3-D layouts, int32 and int64
positions, NeoX and GPT-J pairs, partial rotary_dim; in place really in place; bad positions
named."""

from __future__ import annotations

import numpy as np
import pytest

import tessera


def rope_ref(x: np.ndarray, positions: np.ndarray, table: np.ndarray, is_neox: bool) -> np.ndarray:
    """x [nnz, heads, head_size] in float64."""
    x = x.astype(np.float64).copy()
    rotary = table.shape[1]
    half = rotary // 2
    cos = table[positions, :half][:, None, :].astype(np.float64)
    sin = table[positions, half:][:, None, :].astype(np.float64)
    if is_neox:
        a, b = x[..., :half].copy(), x[..., half:rotary].copy()
        x[..., :half] = a * cos - b * sin
        x[..., half:rotary] = b * cos + a * sin
    else:
        a, b = x[..., 0:rotary:2].copy(), x[..., 1:rotary:2].copy()
        x[..., 0:rotary:2] = a * cos - b * sin
        x[..., 1:rotary:2] = b * cos + a * sin
    return x


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("positions_dtype", [np.int32, np.int64])
def test_matches_numpy(rng, is_neox, positions_dtype):
    nnz, q_heads, k_heads, head_size, rotary, max_position = 11, 4, 2, 64, 32, 100
    query = rng.standard_normal((nnz, q_heads * head_size)).astype(np.float32)
    key = rng.standard_normal((nnz, k_heads, head_size)).astype(np.float32)
    angles = rng.uniform(0, 6.3, (max_position, rotary // 2))
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    positions = rng.integers(0, max_position, nnz).astype(positions_dtype)
    q_out, k_out = tessera.apply_rope_with_cos_sin_cache(positions, query, key, head_size, table,
                                                         is_neox)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    np.testing.assert_allclose(q_out.reshape(nnz, q_heads, head_size),
                               rope_ref(query.reshape(nnz, q_heads, head_size), positions, table,
                                        is_neox), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k_out, rope_ref(key, positions, table, is_neox), rtol=1e-5,
                               atol=1e-5)
    # In place: the caller's arrays change, to the out-of-place result.
    tessera.apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, table,
                                                  is_neox)
    np.testing.assert_array_equal(query, q_out)
    np.testing.assert_array_equal(key, k_out)


def test_bad_arguments_are_named(rng):
    query = rng.standard_normal((3, 2 * 16)).astype(np.float32)
    table = np.ones((5, 16), np.float32)
    before = query.copy()
    with pytest.raises(ValueError, match="positions"):
        tessera.apply_rope_with_cos_sin_cache_inplace(np.array([0, 5, 1], np.int32), query, None,
                                                      16, table)
    np.testing.assert_array_equal(query, before)
    with pytest.raises(ValueError, match="query"):
        tessera.apply_rope_with_cos_sin_cache_inplace(np.array([0, 1, 1], np.int32), query, None,
                                                      12, table)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        tessera.apply_rope_with_cos_sin_cache_inplace(np.array([0, 1, 1], np.int32), query, None,
                                                      16, np.ones((5, 15), np.float32))
