"""Package-level behaviour: version, library lookup, TESSERA_LIBRARY, errors, DLPack interop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tessera
from _reference import attention_ref, indptr


def test_version_and_library():
    assert isinstance(tessera.__version__, str) and tessera.__version__.count(".") >= 2
    path = Path(tessera.library_path())
    assert path.is_file() and path.name.startswith("libtessera")
    assert tessera.library_version() == tessera.__version__
    assert tessera.cuda_device_count() >= 0


def test_stream_capture_id_of_a_stream_not_capturing():
    # The default stream is never captured (the GPU test of the HF backend checks ids inside
    # captures); without a CUDA device every stream answers 0.
    from tessera._common import stream_capture_id
    assert stream_capture_id(None) == 0
    assert stream_capture_id(0) == 0


def test_installed_layout_ships_the_library():
    package = Path(tessera.__file__).parent
    if os.environ.get("TESSERA_LIBRARY"):
        pytest.skip("TESSERA_LIBRARY overrides the packaged library")
    if (package.parent.parent / "CMakeLists.txt").is_file():
        pytest.skip("imported from the source tree (python/), not from an installed package")
    assert (package / "_lib" / "libtessera.so").is_file()
    assert not (package / "_cmake").exists()  # build-only file stays out of the wheel


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True,
                          text=True, timeout=120)


def test_tessera_library_env_overrides(tmp_path):
    copy = tmp_path / "libtessera-copy.so"
    copy.write_bytes(Path(tessera.library_path()).read_bytes())
    result = _run_python("import tessera; print(tessera.library_path())",
                         TESSERA_LIBRARY=str(copy))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(copy)


def test_tessera_library_env_bad_path_is_a_clear_error(tmp_path):
    result = _run_python("import tessera; tessera.cuda_device_count()",
                         TESSERA_LIBRARY=str(tmp_path / "missing.so"))
    assert result.returncode != 0
    assert "TESSERA_LIBRARY" in result.stderr


def test_import_does_not_need_torch():
    result = _run_python("import sys, tessera; print('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_torch_ops_import_is_guarded():
    result = _run_python(
        "import importlib.util, tessera\n"
        "if importlib.util.find_spec('torch') is None:\n"
        "    try:\n"
        "        import tessera.torch_ops\n"
        "    except ImportError as error:\n"
        "        print('ImportError', 'torch' in str(error))\n"
        "else:\n"
        "    print('ImportError True')\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ImportError True"


def test_cpu_controls():
    tessera.set_num_threads(1)
    tessera.set_num_threads(0)
    with pytest.raises(ValueError, match="threads"):
        tessera.set_num_threads(-3)
    tessera.use_cpu_reference(True)
    tessera.use_cpu_reference(False)
    saved = tessera.index_checking()
    tessera.set_index_checking(True)
    assert tessera.index_checking()
    tessera.set_index_checking(False)
    assert not tessera.index_checking()
    tessera.set_index_checking(saved)


class DLPackOnly:
    """An array exposing only the DLPack protocol (like jax/cupy arrays): exercises the
    PyCapsule path on the CPU."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, stream=None):
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_generic_dlpack_inputs(rng):
    lens = [5, 12]
    q = rng.standard_normal((17, 4, 32)).astype(np.float32)
    k = rng.standard_normal((17, 2, 32)).astype(np.float32)
    v = rng.standard_normal((17, 2, 32)).astype(np.float32)
    o = tessera.varlen_attention(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v),
                                 DLPackOnly(indptr(lens)), DLPackOnly(indptr(lens)), causal=True)
    assert isinstance(o, np.ndarray)  # CPU outputs of unknown frameworks are numpy
    reference, _ = attention_ref(q, k, v, lens, lens, causal=True)
    np.testing.assert_allclose(o, reference, atol=2e-5, rtol=2e-5)


def test_generic_dlpack_strided_view(rng):
    # A non-contiguous DLPack view (token stride 3*H*D of a fused QKV buffer).
    qkv = rng.standard_normal((9, 3, 2, 16)).astype(np.float32)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    lens = [9]
    o = tessera.varlen_attention(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v), indptr(lens),
                                 indptr(lens))
    reference, _ = attention_ref(q, k, v, lens, lens)
    np.testing.assert_allclose(o, reference, atol=2e-5, rtol=2e-5)


def test_dlpack_capsule_is_not_consumed(rng):
    # The capsule path must leave ownership with the producer: the array stays valid and
    # usable afterwards, and repeated calls work.
    array = rng.standard_normal((4, 2, 16)).astype(np.float32)
    wrapped = DLPackOnly(array)
    for _ in range(3):
        out = tessera.varlen_attention(wrapped, wrapped, wrapped, [0, 4], [0, 4])
    assert np.isfinite(out).all()
    assert array.sum() == array.sum()


def test_not_an_array_is_a_value_error():
    with pytest.raises(ValueError, match="'q'"):
        tessera.varlen_attention("q", None, None, [0, 1], [0, 1])


def test_read_only_output_is_refused(rng):
    q = rng.standard_normal((4, 2, 16)).astype(np.float32)
    out = np.empty_like(q)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="'out'.*read-only"):
        tessera.varlen_attention(q, q, q, [0, 4], [0, 4], out=out)


def test_unsupported_numpy_dtype(rng):
    q = rng.standard_normal((4, 2, 16)).astype(np.complex64)
    with pytest.raises(ValueError, match="'q'"):
        tessera.varlen_attention(q, q, q, [0, 4], [0, 4])


def test_cuda_plan_without_cuda_is_unsupported():
    if tessera.cuda_device_count() > 0:
        pytest.skip("a CUDA device is visible")
    from tessera import _capi
    import ctypes

    values = np.array([0, 1], np.int32)
    handle = ctypes.c_void_p()
    pointer = values.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    status = _capi.lib().tessera_plan_ragged_prefill(
        pointer, pointer, 1, 2, 2, 64, None, _capi.kDLCUDA, 0, ctypes.byref(handle))
    error = _capi.error_for(status, _capi.last_error())
    assert isinstance(error, tessera.UnsupportedError) and isinstance(error, ValueError)
    assert "device" in str(error)


def test_status_to_exception_mapping():
    from tessera import _capi

    assert type(_capi.error_for(1, "m")) is ValueError
    assert type(_capi.error_for(2, "m")) is tessera.UnsupportedError
    assert type(_capi.error_for(3, "m")) is RuntimeError
    assert type(_capi.error_for(4, "m")) is tessera.OutOfMemoryError
    assert issubclass(tessera.OutOfMemoryError, RuntimeError)
    error = _capi.error_for(1, "tessera::op: 'qo_indptr': bad", {"qo_indptr": "cu_seqlens_q"})
    assert "qo_indptr" in str(error) and "'cu_seqlens_q'" in str(error)
