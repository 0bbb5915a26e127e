"""The C fast path of the wrappers' run() (tessera._fastcall) against the ctypes path: the same
outputs bit for bit, the same exceptions and messages, in-place metadata changes seen, and the
fast path really taken. Skipped when the extension is not built."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tessera
from tessera import _fast
from _reference import PagedCache, indptr

if _fast.module() is None:
    pytest.skip(f"tessera._fastcall is not built or not found: {_fast.info()['reason']}",
                allow_module_level=True)

try:
    import torch
except ImportError:
    torch = None

LIBS = ["numpy", "torch"]


@pytest.fixture(params=LIBS)
def lib(request):
    if request.param == "torch" and torch is None:
        pytest.skip("torch is not installed")
    return request.param


def convert(lib, array):
    if array is None or lib == "numpy":
        return array
    if array.dtype == np.int32:
        return torch.from_numpy(np.ascontiguousarray(array))
    return torch.from_numpy(np.ascontiguousarray(array))


def as_numpy(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().numpy()
    return x


def workspace_for(lib):
    if lib == "numpy":
        return np.empty(16 << 20, np.uint8)
    return torch.empty(16 << 20, dtype=torch.uint8)


def stats():
    return _fast.module().stats()


def run_both(wrapper, call):
    """Runs call(wrapper) through the fast path (checked to be served by it) and through the
    ctypes path; returns both results (numpy copies)."""
    assert wrapper._fast is not None, _fast.info()
    before = stats()
    fast = call(wrapper)
    after = stats()
    assert after[0] == before[0] + 1 and after[1] == before[1], "fast path not taken"
    runner, wrapper._fast = wrapper._fast, None
    try:
        slow = call(wrapper)
    finally:
        wrapper._fast = runner
    assert stats() == after  # the ctypes path did not touch the extension
    return fast, slow


def assert_same(fast, slow):
    if isinstance(fast, tuple):
        assert isinstance(slow, tuple) and len(fast) == len(slow)
        for a, b in zip(fast, slow):
            assert_same(a, b)
        return
    a, b = as_numpy(fast), as_numpy(slow)
    assert type(fast) is type(slow)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()  # bit-identical


def outcome(call):
    """(exception type, message) of call(), or ("ok", None)."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - compared below
        return type(error), str(error)
    return "ok", None


def errors_both(wrapper, call, expect_fast=True):
    """The exception of call(wrapper) through both paths; they must be equal. expect_fast:
    the error comes from the C library through the fast path (not a hand-back)."""
    before = stats()
    fast = outcome(lambda: call(wrapper))
    after = stats()
    if expect_fast:
        assert after[0] == before[0] + 1, "fast path not taken"
    runner, wrapper._fast = wrapper._fast, None
    try:
        slow = outcome(lambda: call(wrapper))
    finally:
        wrapper._fast = runner
    assert fast == slow
    assert fast[0] != "ok", "expected an error"
    return fast


# ---- setups --------------------------------------------------------------------------------


def decode_setup(lib, rng, dtype=np.float32, layout="NHD", kv_lens=(1, 17, 40)):
    cache = PagedCache(rng, list(kv_lens), 8, 2, 32, dtype, layout)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace_for(lib), layout)
    wrapper.plan(convert(lib, cache.page_indptr), convert(lib, cache.page_indices),
                 convert(lib, cache.last_page_len), 4, 2, 32, 8)
    q = convert(lib, rng.standard_normal((len(kv_lens), 4, 32)).astype(dtype))
    return wrapper, q, (convert(lib, cache.k_cache), convert(lib, cache.v_cache)), cache


def ragged_setup(lib, rng, dtype=np.float32, layout="NHD"):
    q_lens, kv_lens = [3, 1, 6], [5, 9, 6]
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace_for(lib), layout)
    wrapper.plan(convert(lib, indptr(q_lens)), convert(lib, indptr(kv_lens)), 4, 2, 32,
                 causal=True)
    q = rng.standard_normal((sum(q_lens), 4, 32)).astype(dtype)
    shape = (sum(kv_lens), 2, 32) if layout == "NHD" else (2, sum(kv_lens), 32)
    k = rng.standard_normal(shape).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    return wrapper, convert(lib, q), convert(lib, k), convert(lib, v)


def paged_setup(lib, rng, dtype=np.float32, layout="NHD"):
    q_lens, kv_lens = [2, 1, 5], [9, 1, 20]
    cache = PagedCache(rng, kv_lens, 8, 2, 32, dtype, layout)
    wrapper = tessera.BatchPrefillWithPagedKVCacheWrapper(workspace_for(lib), layout)
    wrapper.plan(convert(lib, indptr(q_lens)), convert(lib, cache.page_indptr),
                 convert(lib, cache.page_indices), convert(lib, cache.last_page_len), 4, 2, 32, 8,
                 causal=True)
    q = convert(lib, rng.standard_normal((sum(q_lens), 4, 32)).astype(dtype))
    return wrapper, q, (convert(lib, cache.k_cache), convert(lib, cache.v_cache)), cache


def like(lib, x, dtype=None):
    if lib == "numpy":
        return np.empty(x.shape, x.dtype if dtype is None else dtype)
    return torch.empty(tuple(x.shape), dtype=x.dtype if dtype is None else dtype)


# ---- same outputs ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_decode_same_outputs(lib, rng, dtype, layout):
    wrapper, q, paged, _ = decode_setup(lib, rng, dtype, layout)
    assert_same(*run_both(wrapper, lambda w: w.run(q, paged)))
    assert_same(*run_both(wrapper, lambda w: w.run(q, paged, return_lse=True)))
    out = like(lib, q)
    fast, slow = run_both(wrapper, lambda w: (w.run(q, list(paged), out=out), as_numpy(out).copy()))
    assert fast[0] is out and slow[0] is out
    assert_same(fast[1], slow[1])
    lse32 = np.float32 if lib == "numpy" else torch.float32
    lse = like(lib, q[:, :, 0], lse32)
    fast, slow = run_both(wrapper, lambda w: (as_numpy(w.run(q, paged, out=out, lse=lse)).copy(),
                                              as_numpy(lse).copy()))
    assert_same(fast, slow)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_ragged_same_outputs(lib, rng, dtype, layout):
    wrapper, q, k, v = ragged_setup(lib, rng, dtype, layout)
    assert_same(*run_both(wrapper, lambda w: w.run(q, k, v)))
    assert_same(*run_both(wrapper, lambda w: w.run(q, k, v, return_lse=True)))
    out = like(lib, q)
    fast, slow = run_both(wrapper, lambda w: as_numpy(w.run(q, k, v, out)).copy())
    assert_same(fast, slow)


@pytest.mark.parametrize("combined", [False, True], ids=["tuple", "5d"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_same_outputs(lib, rng, layout, combined):
    wrapper, q, paged, cache = paged_setup(lib, rng, np.float32, layout)
    if combined:
        paged = convert(lib, np.stack([cache.k_cache, cache.v_cache], axis=1))
    assert_same(*run_both(wrapper, lambda w: w.run(q, paged)))
    assert_same(*run_both(wrapper, lambda w: w.run(q, paged, return_lse=True)))


def test_strided_arguments_same_outputs(lib, rng):
    """Non-contiguous q / k / v / out (strided views the library accepts)."""
    wrapper, _, k, v = ragged_setup(lib, rng)
    wide = convert(lib, rng.standard_normal((10, 8, 32)).astype(np.float32))
    q = wide[:, ::2]  # head stride 64
    out_wide = like(lib, wide)
    out = out_wide[:, 1::2]
    assert_same(*run_both(wrapper, lambda w: as_numpy(w.run(q, k, v, out=out)).copy()))
    kv_wide = convert(lib, rng.standard_normal((20, 4, 32)).astype(np.float32))
    assert_same(*run_both(wrapper, lambda w: w.run(q, kv_wide[:, :2], kv_wide[:, 2:])))


def test_bfloat16_torch(rng):
    if torch is None:
        pytest.skip("torch is not installed")
    wrapper, q, paged, _ = decode_setup("torch", rng)
    q16 = q.to(torch.bfloat16)
    paged16 = tuple(t.to(torch.bfloat16) for t in paged)
    assert_same(*run_both(wrapper, lambda w: w.run(q16, paged16).float()))


# ---- same errors ----------------------------------------------------------------------------


def test_same_errors_decode(lib, rng):
    wrapper, q, (k_cache, v_cache), _ = decode_setup(lib, rng)
    f64 = q.astype(np.float64) if lib == "numpy" else q.double()
    wide = convert(lib, np.zeros((3, 4, 64), np.float32))
    cases = [
        (lambda w: w.run(q[:2], (k_cache, v_cache)), True),             # wrong rows
        (lambda w: w.run(f64, (k_cache, v_cache)), True),               # wrong dtype
        (lambda w: w.run(wide[:, :, ::2], (k_cache, v_cache)), True),   # head_dim stride 2
        (lambda w: w.run(q, (k_cache[:, :, :1], v_cache[:, :, :1])), True),  # kv heads
        (lambda w: w.run(q, (k_cache, v_cache), out=like(lib, q[:2])), True),  # out shape
        (lambda w: w.run(q, (k_cache, v_cache), out=like(lib, f64)), True),    # out dtype
        (lambda w: w.run(q, (k_cache, v_cache), lse=like(lib, q)), True),      # lse shape
        (lambda w: w.run(q, (k_cache, v_cache, v_cache)), False),       # 3 items
        (lambda w: w.run(q, k_cache), False),                            # 4-D, not [P, 2, ...]
        (lambda w: w.run(q[0, 0, 0], (k_cache, v_cache)), False),       # scalar
        (lambda w: w.run([[0.0]], (k_cache, v_cache)), False),          # not an array
    ]
    for call, from_library in cases:
        kind, message = errors_both(wrapper, call, expect_fast=from_library)
        assert issubclass(kind, ValueError), message


def test_same_errors_ragged_and_paged(lib, rng):
    wrapper, q, k, v = ragged_setup(lib, rng)
    errors_both(wrapper, lambda w: w.run(q, k[:-1], v), expect_fast=True)
    errors_both(wrapper, lambda w: w.run(q, k, v[:, :1]), expect_fast=True)
    hnd, q, k, v = ragged_setup(lib, rng, layout="HND")
    errors_both(hnd, lambda w: w.run(q, k[0], v[0]), expect_fast=False)  # 2-D HND: Python error
    paged, q, kv, cache = paged_setup(lib, rng)
    errors_both(paged, lambda w: w.run(q[1:], kv), expect_fast=True)
    bad5d = convert(lib, np.zeros((3, 3, 8, 2, 32), np.float32))
    errors_both(paged, lambda w: w.run(q, bad5d), expect_fast=False)


def test_read_only_numpy_out_same_error(rng):
    wrapper, q, paged, _ = decode_setup("numpy", rng)
    out = np.empty_like(q)
    out.flags.writeable = False
    kind, message = errors_both(wrapper, lambda w: w.run(q, paged, out=out), expect_fast=False)
    assert kind is ValueError and "read-only" in message


def test_wrong_device_same_error(rng):
    if torch is None:
        pytest.skip("torch is not installed")
    wrapper, q, paged, _ = decode_setup("torch", rng)
    meta = torch.empty(tuple(q.shape), device="meta")
    fast = errors_both(wrapper, lambda w: w.run(meta, paged), expect_fast=False)
    assert fast[0] is not ValueError or "meta" in fast[1] or fast[1]
    numpy_q = q.numpy()  # a host numpy q with a torch cache: the library decides
    run_both(wrapper, lambda w: w.run(numpy_q, paged))


# ---- in-place metadata changes ----------------------------------------------------------------


def test_torch_inplace_metadata_changes_are_seen(rng):
    if torch is None:
        pytest.skip("torch is not installed")
    wrapper, q, paged, _ = decode_setup("torch", rng)
    expected = wrapper.run(q, paged).clone()
    out = torch.empty_like(q)
    assert torch.equal(wrapper.run(q, paged, out=out), expected)
    q.unsqueeze_(0)  # [1, 3, 4, 32]: 4-D q is refused by the library
    errors_both(wrapper, lambda w: w.run(q, paged, out=out))
    q.squeeze_(0)
    assert torch.equal(wrapper.run(q, paged, out=out), expected)
    out.resize_(2, 4, 32)  # out too small now
    errors_both(wrapper, lambda w: w.run(q, paged, out=out))
    out.resize_(3, 4, 32)
    assert torch.equal(wrapper.run(q, paged, out=out), expected)
    # lse [rows, heads] with rows == heads: after t_() it has the right shape but a transposed
    # layout, which the library refuses (last dimension not contiguous); t_() back and it runs.
    wrapper4, q4, paged4, _ = decode_setup("torch", rng, kv_lens=(3, 9, 1, 30))
    _, ref_lse = wrapper4.run(q4, paged4, return_lse=True)
    lse = torch.empty(4, 4)
    wrapper4.run(q4, paged4, lse=lse)
    assert torch.equal(lse, ref_lse)
    lse.t_()
    kind, message = errors_both(wrapper4, lambda w: w.run(q4, paged4, lse=lse))
    assert "'lse'" in message and "stride" in message
    lse.t_()
    lse.zero_()
    wrapper4.run(q4, paged4, lse=lse)
    assert torch.equal(lse, ref_lse)
    # set_(): the same object now views other memory.
    other = torch.zeros(3, 4, 32)
    q.set_(other)
    assert torch.equal(wrapper.run(q, paged), wrapper.run(other, paged))


def test_numpy_inplace_shape_change_is_seen(rng):
    wrapper, q, paged, _ = decode_setup("numpy", rng)
    wrapper.run(q, paged)
    q.shape = (3, 2, 64)
    errors_both(wrapper, lambda w: w.run(q, paged))
    q.shape = (3, 4, 32)
    assert_same(*run_both(wrapper, lambda w: w.run(q, paged)))


# ---- descriptors and state --------------------------------------------------------------------


def descriptor_samples(lib):
    base = np.arange(3 * 4 * 8, dtype=np.float32).reshape(3, 4, 8)
    arrays = [base, base[1:], base[:, ::2], base.transpose(1, 0, 2), base[:, 1:2],
              base.astype(np.float16), np.zeros((2, 0, 4), np.float32),
              np.zeros(5, np.int32), np.zeros((4, 4), np.uint8)]
    if lib == "numpy":
        return arrays
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    t = torch.from_numpy(base)
    tensors += [t[1:], t[:, ::2], t.transpose(0, 1), t[:, 1:2], t.expand(2, 3, 4, 8),
                torch.zeros(3, 1, 4)[:, :, ::2], t.to(torch.bfloat16), torch.nn.Parameter(t)]
    if hasattr(torch, "float8_e4m3fn"):
        tensors.append(torch.zeros(4, 8).to(torch.float8_e4m3fn))
    return tensors


def test_descriptors_match_the_ctypes_path(lib):
    module = _fast.module()
    for array in descriptor_samples(lib):
        for writable in (False, True):
            fast = module.describe(array, writable)
            assert fast is not None, (type(array), getattr(array, "dtype", None))
            assert fast == _fast.reference_descriptor(array, writable)


def test_derived_descriptors_match(lib, rng):
    from tessera._common import split_combined_kv
    from tessera._dlpack import to_dl
    from tessera.wrappers import _hnd_to_nhd

    module = _fast.module()
    both = convert(lib, rng.standard_normal((3, 2, 8, 2, 16)).astype(np.float32))
    k, v = split_combined_kv(to_dl(both, "paged_kv_cache"))
    assert module.split_kv(both) == (_fast.descriptor_tuple(k), _fast.descriptor_tuple(v))
    hnd = convert(lib, rng.standard_normal((2, 9, 16)).astype(np.float32))
    assert module.hnd_to_nhd(hnd) == _fast.descriptor_tuple(_hnd_to_nhd(to_dl(hnd, "k"), "k"))


def test_declines_what_it_does_not_describe(lib):
    module = _fast.module()
    if lib == "numpy":
        big_endian = np.zeros(4, ">f4")
        read_only = np.zeros(4, np.float32)
        read_only.flags.writeable = False
        assert module.describe(big_endian) is None
        assert module.describe(read_only, True) is None
        assert module.describe(np.float32(1.0)) is None
        assert module.describe(np.zeros(4, np.complex64)) is None
        assert module.describe(np.zeros((2, 3), np.float32).view(np.matrix)) is None
    else:
        assert module.describe(torch.tensor(1.0)) is None  # scalar
        assert module.describe(torch.zeros(2, device="meta")) is None
        assert module.describe(torch.zeros(2, 2).to_sparse()) is None

        class Sub(torch.Tensor):
            pass

        assert module.describe(torch.zeros(2).as_subclass(Sub)) is None
    assert module.describe([1.0, 2.0]) is None


def test_plan_remakes_the_runner(rng):
    wrapper, q, paged, cache = decode_setup("numpy", rng)
    first = wrapper._fast
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 4, 2, 32, 8)
    assert wrapper._fast is not None and wrapper._fast is not first
    runner = wrapper._fast
    wrapper.reset_workspace_buffer(np.empty(16 << 20, np.uint8))
    assert wrapper._fast is not None and wrapper._fast is not runner
    runner_after_reset = wrapper._fast
    assert_same(*run_both(wrapper, lambda w: w.run(q, paged)))
    with pytest.raises(ValueError):  # a refused plan keeps the previous plan (and its runner)
        wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 4, 2, 12, 8)
    assert wrapper._fast is not None
    assert_same(*run_both(wrapper, lambda w: w.run(q, paged)))
    # A plan that fails after the C plan was made (converting the index arrays) changes nothing:
    # the previous plan, its index arrays and its runner stay.
    before = wrapper.run(q, paged)
    with pytest.raises(ValueError):
        wrapper.plan(cache.page_indptr, np.zeros(4, np.float32), cache.last_page_len, 4, 2, 32, 8)
    assert wrapper._fast is runner_after_reset
    assert_same(*run_both(wrapper, lambda w: w.run(q, paged)))
    np.testing.assert_array_equal(wrapper.run(q, paged), before)
    wrapper.plan(cache.page_indptr, cache.page_indices, cache.last_page_len, 4, 2, 32, 8)
    assert_same(*run_both(wrapper, lambda w: w.run(q, paged)))


def test_info_and_disable():
    info = tessera.fastcall_info()
    assert info["loaded"] and info["numpy"] == "on"
    env = dict(os.environ, TESSERA_FASTCALL="0")
    code = "import tessera; print(tessera.fastcall_info()['reason'])"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            check=True)
    assert "TESSERA_FASTCALL=0" in result.stdout


# ---- reviewed defects: Python code run while describing, object lifetimes, shared state ------
#
# With the attributes (torch < 2.10, or when the exchange API's self-test fails) describing a
# tensor runs Python code: a torch-function mode intercepts .dtype, data_ptr(), .shape, ... The
# scenarios that could crash run in a subprocess (a segfault fails the test, not pytest).


def needs_torch():
    if torch is None:
        pytest.skip("torch is not installed")


def run_code(code: str, timeout: float = 300) -> str:
    """Runs `code` in a fresh interpreter with this process's tessera (and _reference);
    asserts that it exits with status 0 and printed "ok" (a crash or an exception fails)."""
    paths = [str(Path(__file__).resolve().parent), str(Path(tessera.__file__).resolve().parents[1])]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0 and "ok" in result.stdout.split(), (
        f"scenario exited with status {result.returncode}\n--- stdout\n{result.stdout}\n"
        f"--- stderr\n{result.stderr[-4000:]}")
    return result.stdout


def run_scenario(body: str) -> str:
    """run_code(body) after ATTRIBUTE_PRELUDE: torch read through the attributes, a decode
    wrapper planned on torch CPU tensors, its runner, q, kv() and the expected output."""
    return run_code(textwrap.dedent(ATTRIBUTE_PRELUDE) + textwrap.dedent(body))


ATTRIBUTE_PRELUDE = """
    import time
    import numpy as np
    import torch
    from torch.overrides import TorchFunctionMode
    import tessera
    from tessera import _fast
    from _reference import PagedCache

    module = _fast.module()
    _fast._init_torch(module, exchange_api=False)  # read tensors through their attributes
    assert module.torch_mode() == "attributes", _fast.info()
    rng = np.random.default_rng(7)
    cache = PagedCache(rng, [1, 17, 40], 8, 2, 32, np.float32, "NHD")
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8))
    wrapper.plan(torch.from_numpy(cache.page_indptr), torch.from_numpy(cache.page_indices),
                 torch.from_numpy(cache.last_page_len), 4, 2, 32, 8)
    runner = wrapper._fast
    assert runner is not None, _fast.info()
    q = torch.from_numpy(rng.standard_normal((3, 4, 32)).astype(np.float32))

    def kv():
        return (torch.from_numpy(cache.k_cache), torch.from_numpy(cache.v_cache))

    expected = wrapper.run(q, kv())
"""


def test_list_kv_emptied_while_described_keeps_k_and_v_alive():
    """A torch-function mode empties the [k, v] list while k is described: v (only referenced
    by the list) must stay alive until the C call has returned (it was read after being freed:
    a crash, or a wrong result)."""
    needs_torch()
    run_scenario("""
        kv_list = list(kv())  # the only references to these k and v tensors
        k = kv_list[0]

        class EmptyTheList(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if args and args[0] is k and kv_list:
                    kv_list.clear()  # frees v
                    junk = [bytearray(64) for _ in range(2000)]  # reuses its memory
                return func(*args, **(kwargs or {}))

        out = torch.zeros_like(q)
        before = module.stats()
        with EmptyTheList():
            result = wrapper.run(q, kv_list, out=out)
        assert not kv_list, "the mode did not run"
        assert module.stats()[0] == before[0] + 1, "not served by the fast path"
        assert result is out and torch.equal(out, expected)
        print("ok")
    """)


def test_runner_cannot_be_created_from_python():
    """Runner() / object.__new__(Runner) made a Runner without a C function: calling it jumped
    to a NULL pointer."""
    run_code(textwrap.dedent("""
        import numpy as np
        from tessera import _fast

        Runner = _fast.module().Runner
        q = np.zeros((3, 4, 32), np.float32)
        k = np.zeros((4, 8, 2, 32), np.float32)
        for make in (lambda: Runner(), lambda: Runner.__new__(Runner),
                     lambda: object.__new__(Runner)):
            try:
                runner = make()
            except TypeError:
                continue
            try:
                runner(q, (k, k), np.empty_like(q), None)  # the NULL function pointer
            except TypeError:
                pass
            raise SystemExit("a Runner was created from Python")
        print("ok")
    """))


def test_torch_settings_are_not_used_before_their_self_test(monkeypatch, rng):
    """While _init_torch self-tests a torch mode, run() (from any thread) must not use it yet:
    torch tensors are handed back to the ctypes path until the test has passed."""
    needs_torch()
    wrapper, q, paged, _ = decode_setup("torch", rng)
    expected = wrapper.run(q, paged)
    module = _fast.module()
    seen = []
    real_self_test = _fast._self_test

    def self_test(fast, samples):
        before = stats()
        result = wrapper.run(q, paged)  # what another thread's run() gets meanwhile
        after = stats()
        seen.append((after[0] - before[0], after[1] - before[1], torch.equal(result, expected)))
        return real_self_test(fast, samples)

    monkeypatch.setattr(_fast, "_self_test", self_test)
    try:
        _fast._init_torch(module)
    finally:
        monkeypatch.undo()
        _fast._init_torch(module)
    # Handed back twice: run() without out= first asks the extension to allocate the output,
    # then calls it again with one allocated in Python.
    assert seen and all(entry == (0, 2, True) for entry in seen), seen
    assert _fast._torch_state and module.torch_mode() not in ("off", "not enabled")
    assert_same(*run_both(wrapper, lambda w: w.run(q, paged)))


def test_stream_check_does_not_switch_before_it_passed(monkeypatch):
    """_check_stream compares the exchange API's stream with torch's getter: run() keeps the
    getter while it does (it switched first, so a concurrent run() could launch on an unchecked
    stream)."""
    needs_torch()
    module = _fast.module()
    if "exchange-api" not in module.torch_mode():
        pytest.skip(f"torch is read through {module.torch_mode()}")

    class Probe:
        """The module, with stream() recording run()'s stream mode (no CUDA device needed)."""

        def __init__(self):
            self.modes = []

        def __getattr__(self, name):
            return getattr(module, name)

        def stream(self, *args):
            self.modes.append(module.torch_mode())
            raise RuntimeError("no CUDA device (test)")

    probe = Probe()
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(_fast, "_stream_checked", False)
    monkeypatch.setattr(_fast, "_torch_reason", _fast._torch_reason)
    try:
        _fast._check_stream(probe, 0)
    finally:
        module.set_exchange_stream(False)
    assert probe.modes == ["exchange-api, stream getter"]
    assert module.torch_mode() == "exchange-api, stream getter"


def test_time_c_call_does_not_repeat_a_concurrent_call():
    """time_c_call(runner, repeat, ...) kept `repeat` on the shared Runner: a run() of the same
    runner meanwhile (here from a torch-function mode while time_c_call describes q) called the
    C function `repeat` times too."""
    needs_torch()
    run_scenario("""
        repeat = 100000
        nested = []

        class RunMeanwhile(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if not nested:
                    nested.append(None)
                    start = time.perf_counter()
                    status = runner(q.clone(), kv(), torch.empty_like(q), None)
                    nested[0] = (status, time.perf_counter() - start)
                return func(*args, **(kwargs or {}))

        out = torch.empty_like(q)
        with RunMeanwhile():
            status, ns = module.time_c_call(runner, repeat, q, kv(), out, None)
        assert status == 0 and nested[0][0] == 0, (status, nested)
        loop = ns * repeat / 1e9  # seconds of the timed calls
        print(f"timed loop {loop:.4f} s, call meanwhile {nested[0][1]:.6f} s")
        assert nested[0][1] < loop / 10, "the concurrent call was repeated"
        assert torch.equal(out, expected)
        print("ok")
    """)


def test_exchange_api_init_error_falls_back_to_attributes(monkeypatch):
    """An exception from init_torch with the exchange capsule must leave the attributes to try
    (it ended the loop and turned the torch fast path off)."""
    needs_torch()
    module = _fast.module()
    if getattr(torch.Tensor, "__dlpack_c_exchange_api__", None) is None:
        pytest.skip("this torch has no DLPack exchange API")

    class Failing:
        def __getattr__(self, name):
            return getattr(module, name)

        def init_torch(self, *args):
            if len(args) > 6 and args[6] is not None:
                raise ValueError("unsupported DLPack exchange API version (test)")
            return module.init_torch(*args)

    try:
        _fast._init_torch(Failing())
        state, mode = _fast._torch_state, module.torch_mode()
    finally:
        _fast._init_torch(module)
    assert state is True and mode == "attributes", (state, mode, _fast._torch_reason)


def test_exchange_capsule_is_owned(monkeypatch):
    """The module keeps the exchange API's capsule alive while it uses its function table, and
    releases it when initialised again."""
    needs_torch()
    original = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if original is None:
        pytest.skip("this torch has no DLPack exchange API")
    module = _fast.module()
    name = CAPSULE_NAME
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                   ctypes.c_void_p]
    capsule = new(get(original, name), name, None)  # the same table, in a capsule of ours
    monkeypatch.setattr(torch.Tensor, "__dlpack_c_exchange_api__", capsule, raising=False)
    base = sys.getrefcount(capsule)
    try:
        _fast._init_torch(_fast.module())
        assert module.torch_mode().startswith("exchange-api"), _fast.info()
        held = sys.getrefcount(capsule) - base
    finally:
        monkeypatch.undo()
        _fast._init_torch(module)
    assert held == 1
    assert sys.getrefcount(capsule) == base - 1  # released (monkeypatch's reference is gone)


CAPSULE_NAME = b"dlpack_exchange_api"  # outlives the test's capsule (it keeps the pointer)


def test_interrupts_raised_while_describing_propagate():
    """KeyboardInterrupt / MemoryError raised by Python code run while describing a tensor
    propagate (they were cleared and the call handed back); ordinary errors hand back."""
    needs_torch()
    run_scenario("""
        class RaiseOnce(TorchFunctionMode):
            def __init__(self, error):
                super().__init__()
                self.error = error

            def __torch_function__(self, func, types, args=(), kwargs=None):
                if self.error is not None:
                    error, self.error = self.error, None
                    raise error
                return func(*args, **(kwargs or {}))

        out = torch.empty_like(q)  # run(out=): no torch call before the fast path's
        for error in (KeyboardInterrupt, MemoryError):
            for call in (lambda: module.describe(q), lambda: wrapper.run(q, kv(), out=out)):
                try:
                    with RaiseOnce(error("test")):
                        call()
                except error:
                    continue
                raise SystemExit(f"{error.__name__} was swallowed")
        with RaiseOnce(RuntimeError("test")):
            assert module.describe(q) is None  # handed back: the ctypes path raises its own
        before = module.stats()
        with RaiseOnce(RuntimeError("test")):
            assert torch.equal(wrapper.run(q, kv(), out=out), expected)
        assert module.stats()[1] == before[1] + 1
        print("ok")
    """)


# ---- CUDA (skips without a GPU) --------------------------------------------------------------


def test_cuda_same_outputs_and_stream(rng):
    if torch is None or not torch.cuda.is_available() or tessera.cuda_device_count() < 1:
        pytest.skip("needs torch with a CUDA device and a CUDA build of libtessera")
    cache = PagedCache(rng, [1, 17, 300], 16, 2, 128, np.float16)
    dev = "cuda"
    workspace = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(torch.from_numpy(cache.page_indptr).to(dev),
                 torch.from_numpy(cache.page_indices).to(dev),
                 torch.from_numpy(cache.last_page_len).to(dev), 8, 2, 128, 16)
    q = torch.from_numpy(rng.standard_normal((3, 8, 128)).astype(np.float16)).to(dev)
    paged = (torch.from_numpy(cache.k_cache).to(dev), torch.from_numpy(cache.v_cache).to(dev))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # run() must launch on the current (side) stream
        fast, slow = run_both(wrapper, lambda w: w.run(q, paged, return_lse=True))
        out = torch.empty_like(q)
        for _ in range(3):
            wrapper.run(q, paged, out=out)
    side.synchronize()
    assert_same(tuple(t.cpu() for t in fast), tuple(t.cpu() for t in slow))
    assert torch.equal(out.cpu(), fast[0].cpu())
    print("fastcall torch mode:", _fast.info()["torch"])


def test_run_without_out_allocates_in_the_extension(rng):
    """run() without out= on torch: the extension allocates the output through DLPack's exchange
    API and returns it (served in one call, nothing handed back), equal to run(out=) and shaped,
    typed and placed like q, contiguous; a failing run frees it and raises the library's error."""
    needs_torch()
    for dtype in (np.float32, np.float16):
        wrapper, q, paged, _ = decode_setup("torch", rng, dtype=dtype)  # (arms torch)
        if "exchange-api" not in _fast.module().torch_mode():
            pytest.skip(f"torch is read through {_fast.module().torch_mode()}")
        before = stats()
        result = wrapper.run(q, paged)
        after = stats()
        assert after[0] == before[0] + 1 and after[1] == before[1], "not served in one call"
        assert type(result) is torch.Tensor and result.is_contiguous()
        assert (result.shape, result.dtype, result.device) == (q.shape, q.dtype, q.device)
        expected = torch.full_like(q, float("nan"))
        wrapper.run(q, paged, out=expected)
        assert torch.equal(result, expected)
        del result  # the allocated tensor is an ordinary torch tensor: freed with its last ref
    before = stats()
    with pytest.raises(ValueError, match="'q'"):
        wrapper.run(q[:1], paged)  # fewer rows than the plan's: the C check refuses
    after = stats()
    # The extension ran the call (allocated, called C, freed the output on the error status).
    assert after[0] == before[0] + 1 and after[1] == before[1]
