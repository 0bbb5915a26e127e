"""torch tensors with the negative or conjugate bit set (lazy views such as ``x.conj().imag`` or
``torch._neg_view(x)``, whose memory does not hold their values) are refused with a ValueError
naming the argument, never read or written as raw memory (CPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import tessera  # noqa: E402
from tessera import _dlpack, _fast  # noqa: E402
from _reference import PagedCache  # noqa: E402


def negative(tensor):
    """A view of ``tensor`` with the negative bit (values -tensor, memory of tensor)."""
    view = torch._neg_view(tensor)
    assert view.is_neg() and view.data_ptr() == tensor.data_ptr()
    return view


def test_to_dl_refuses_negative_and_conjugate_views():
    x = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match=r"'q': .*negative bit.*q\.resolve_neg\(\)"):
        _dlpack.to_dl(negative(x), "q")
    with pytest.raises(ValueError, match=r"'out': .*negative bit.*it is written"):
        _dlpack.to_dl(negative(x), "out", writable=True)
    conjugate = torch.complex(x, x).conj()
    with pytest.raises(ValueError, match=r"'k': .*conjugate bit.*k\.resolve_conj\(\)"):
        _dlpack.to_dl(conjugate, "k")
    with pytest.raises(ValueError, match="negative bit"):  # conj().imag: a negative view
        _dlpack.to_dl(conjugate.imag, "v")
    _dlpack.to_dl(negative(x).resolve_neg(), "q")  # the resolved copy is fine


def test_descriptor_cache_does_not_serve_a_negative_view():
    x = torch.randn(4, 2, 8)
    _dlpack.cached_dl(x, "q")  # the base is cached: same pointer, shape, strides, dtype
    with pytest.raises(ValueError, match="'q': .*negative bit"):
        _dlpack.cached_dl(negative(x), "q")
    with pytest.raises(ValueError, match="'out': .*negative bit"):
        _dlpack.cached_dl(negative(x), "out", True)


def test_host_index_arrays_are_resolved():
    lengths = torch.tensor([0, -3, -7], dtype=torch.int32)
    np.testing.assert_array_equal(_dlpack.to_host_int32(negative(lengths), "cu_seqlens_q"),
                                  [0, 3, 7])


def test_varlen_attention_refuses_negative_views():
    q = torch.randn(5, 2, 16)
    k = torch.randn(5, 1, 16)
    cu = np.array([0, 5], np.int32)
    with pytest.raises(ValueError, match="'q': .*negative bit"):
        tessera.varlen_attention(negative(q), k, k, cu, cu)
    with pytest.raises(ValueError, match="'out': .*negative bit"):
        tessera.varlen_attention(q, k, k, cu, cu, out=negative(torch.empty_like(q)))
    expected = tessera.varlen_attention(-q, k, k, cu, cu)
    torch.testing.assert_close(tessera.varlen_attention(negative(q).resolve_neg(), k, k, cu, cu),
                               expected, atol=0, rtol=0)


def _decode_wrapper(rng):
    cache = PagedCache(rng, [3, 17], 8, 2, 32, np.float32, "NHD")
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8))
    wrapper.plan(torch.from_numpy(cache.page_indptr), torch.from_numpy(cache.page_indices),
                 torch.from_numpy(cache.last_page_len), 4, 2, 32, 8)
    paged = (torch.from_numpy(cache.k_cache), torch.from_numpy(cache.v_cache))
    return wrapper, torch.from_numpy(rng.standard_normal((2, 4, 32)).astype(np.float32)), paged


def test_wrapper_run_refuses_negative_views_ctypes_path(rng):
    _fast.set_enabled(False)
    try:
        wrapper, q, paged = _decode_wrapper(rng)
    finally:
        _fast.set_enabled(True)
    assert wrapper._fast is None
    with pytest.raises(ValueError, match="'q': .*negative bit"):
        wrapper.run(negative(q), paged)
    with pytest.raises(ValueError, match="'out': .*negative bit"):
        wrapper.run(q, paged, out=negative(torch.empty_like(q)))
    with pytest.raises(ValueError, match="'k_cache': .*negative bit"):
        wrapper.run(q, (negative(paged[0]), paged[1]))


def test_wrapper_run_refuses_negative_views_fast_path(rng):
    wrapper, q, paged = _decode_wrapper(rng)
    if wrapper._fast is None:
        pytest.skip(f"the C fast path is not in use: {_fast.info()}")
    # torch is on in the extension (its self-test, which includes a negative view, passed), and
    # the negative views are declined there, then refused by the ctypes path.
    assert _fast.module().torch_mode().startswith(("exchange-api", "attributes")), \
        _fast.module().torch_mode()
    declined = _fast.module().stats()[1]
    with pytest.raises(ValueError, match="'q': .*negative bit"):
        wrapper.run(negative(q), paged)
    assert _fast.module().stats()[1] > declined
    with pytest.raises(ValueError, match="'out': .*negative bit"):
        wrapper.run(q, paged, out=negative(torch.empty_like(q)))
