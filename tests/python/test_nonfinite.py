"""NaN / inf inputs through the Python API on the CPU (fast and reference paths), against the
float64 reference, for the semantics of include/tessera/attention.hpp: a NaN or +inf score makes
its row NaN (o and lse), a row of only -inf scores is empty (o = 0, lse = -inf), NaN / inf in v
reach the features that hold them, and every other row is as without the bad value. Checked
mode (set_index_checking) rejects them instead, naming the tensor and the first index."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from _reference import attention_ref, indptr, merge_ref

Q_LENS, KV_LENS = [5, 9, 0, 3], [0, 12, 4, 3]  # request 0 sees no key; request 1 is the site
HEADS, KV_HEADS, DIM = 4, 2, 32
KEY, DIM_AT = 6, 5  # request 1's key 6, kv head 1 (query heads 2, 3), feature 5


@pytest.fixture(params=["fast", "reference"])
def cpu_path(request):
    tessera.use_cpu_reference(request.param == "reference")
    yield request.param
    tessera.use_cpu_reference(False)


def _inputs(rng, dtype, where):
    q = rng.standard_normal((sum(Q_LENS), HEADS, DIM)).astype(dtype)
    k = rng.standard_normal((sum(KV_LENS), KV_HEADS, DIM)).astype(dtype)
    v = rng.standard_normal((sum(KV_LENS), KV_HEADS, DIM)).astype(dtype)
    rows = slice(Q_LENS[0], Q_LENS[0] + Q_LENS[1])  # request 1's queries
    keys = slice(KV_LENS[0], KV_LENS[0] + KV_LENS[1])
    key = KV_LENS[0] + KEY
    if where == "q_nan":
        q[rows.stop - 1, 3, DIM_AT] = np.nan
        q[0, 3, DIM_AT] = np.nan  # a row without keys: stays o = 0, lse = -inf
    elif where == "q_inf":
        k[keys, 1, DIM_AT] = np.abs(k[keys, 1, DIM_AT])  # q . k = +inf for every key
        q[rows.stop - 1, 3, DIM_AT] = np.inf
    elif where == "k_nan":
        k[key, 1, DIM_AT] = np.nan
    elif where == "k_all_neg_inf":
        q[rows, 2:4, DIM_AT] = np.abs(q[rows, 2:4, DIM_AT])  # every score of the group -inf
        k[keys, 1, DIM_AT] = -np.inf
    elif where in ("v_nan", "v_inf"):
        v[key, 1, DIM_AT] = np.nan if where == "v_nan" else np.inf
    return q, k, v


def _expected_rows(where, causal):
    """(NaN rows, empty rows beyond those without keys, rows with feature DIM_AT NaN / inf) as
    sets of (token, head)."""
    first = Q_LENS[0]
    tokens = range(first, first + Q_LENS[1])
    off = KV_LENS[1] - Q_LENS[1]
    sees_key = [t for t in tokens if not causal or KEY <= t - first + off]
    group = [(t, h) for t in sees_key for h in (2, 3)]
    if where in ("q_nan", "q_inf"):
        return {(first + Q_LENS[1] - 1, 3)}, set(), set()
    if where == "k_nan":
        return set(group), set(), set()
    if where == "k_all_neg_inf":
        return set(), {(t, h) for t in tokens for h in (2, 3)}, set()
    return set(), set(), set(group)


@pytest.mark.parametrize("where", ["q_nan", "q_inf", "k_nan", "k_all_neg_inf", "v_nan",
                                   "v_inf"])
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_reaches_exactly_the_rows_it_touches(rng, cpu_path, dtype, where, causal):
    q, k, v = _inputs(rng, dtype, where)
    o, lse = tessera.varlen_attention(q, k, v, indptr(Q_LENS), indptr(KV_LENS), causal=causal,
                                      return_lse=True)
    ref_o, ref_lse = attention_ref(q, k, v, Q_LENS, KV_LENS, causal=causal)
    nan_rows, empty_rows, feature_rows = _expected_rows(where, causal)
    o = o.astype(np.float64)
    for t in range(sum(Q_LENS)):
        for h in range(HEADS):
            for out, out_lse, who in ((o, lse, cpu_path), (ref_o, ref_lse, "float64 reference")):
                row, row_lse = out[t, h], out_lse[t, h]
                at = f"{who}: token {t} head {h}"
                if (t, h) in nan_rows:
                    assert np.isnan(row).all() and np.isnan(row_lse), at
                elif (t, h) in empty_rows or t < Q_LENS[0]:
                    assert (row == 0).all() and row_lse == -np.inf, at
                elif (t, h) in feature_rows:
                    bad = row[DIM_AT]
                    assert (np.isnan(bad) if where == "v_nan" else bad == np.inf), at
                    assert np.isfinite(np.delete(row, DIM_AT)).all() and np.isfinite(row_lse), at
                else:
                    assert np.isfinite(row).all() and np.isfinite(row_lse), at
    finite = np.isfinite(ref_o)
    tol = {"atol": 2e-3, "rtol": 2e-3} if dtype == np.float16 else {"atol": 2e-5, "rtol": 2e-5}
    np.testing.assert_allclose(o[finite], ref_o[finite], **tol)
    np.testing.assert_array_equal(np.isnan(o), np.isnan(ref_o))


def test_merge_state_nan_and_empty(rng):
    n, h, d = 4, 2, 8
    o_a, o_b = rng.standard_normal((2, n, h, d)).astype(np.float32)
    s_a = np.array([[np.nan] * h, [0.5] * h, [-np.inf] * h, [0.1] * h], np.float32)
    s_b = np.array([[0.2] * h, [-np.inf] * h, [-np.inf] * h, [np.nan] * h], np.float32)
    o_b[1] = np.nan  # an empty state's o is never read
    o, s = tessera.merge_state(o_a, s_a, o_b, s_b)
    ref_o, ref_s = merge_ref([(o_a, s_a), (o_b, s_b)])
    assert np.isnan(o[[0, 3]]).all() and np.isnan(s[[0, 3]]).all()
    assert (o[2] == 0).all() and (s[2] == -np.inf).all()
    np.testing.assert_allclose(o[1], o_a[1], atol=1e-6)
    np.testing.assert_array_equal(np.isnan(ref_o), np.isnan(o))
    np.testing.assert_array_equal(np.isnan(ref_s), np.isnan(s))


def test_checked_mode_names_the_first_nonfinite_input(rng):
    q, k, v = _inputs(rng, np.float32, "k_nan")
    tessera.set_index_checking(True)
    try:
        with pytest.raises(ValueError, match=r"'k': non-finite value nan at row 6 "
                                             r"\(request 1, key 6\), head 1, dim 5"):
            tessera.varlen_attention(q, k, v, indptr(Q_LENS), indptr(KV_LENS))
    finally:
        tessera.set_index_checking(False)
    o = tessera.varlen_attention(q, k, v, indptr(Q_LENS), indptr(KV_LENS))  # off: NaN rows
    assert np.isnan(o[Q_LENS[0]:Q_LENS[0] + Q_LENS[1], 2:4]).all()
