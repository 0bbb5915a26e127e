#!/usr/bin/env python3
"""Per-call overhead of the FlashInfer-style wrappers' ``run()`` from Python.

    python bench/python_overhead.py                 # CPU numpy (+ torch CUDA when available)
    python bench/python_overhead.py --calls 20000 --repeats 5 --no-cuda

Tiny problems, so the time is the binding's cost plus the C call: one request, 16 keys,
2 query heads / 1 KV head, head_dim 64 (decode: one page of 16; ragged prefill: one query row),
``tessera.set_num_threads(1)``. Each line is the best over --repeats of (total time of --calls
consecutive calls, time.perf_counter) / --calls, in microseconds, nothing subtracted.
``run`` allocates its output each call; ``run(out=)`` writes into preallocated buffers (the
static-buffer / CUDA-graph serving pattern). For reference the script also times the bare C call
through ctypes with prebuilt descriptors (``ctypes floor``).

Every case is timed through run()'s C fast path (the ``tessera._fastcall`` extension beside
libtessera.so) when it is available and again with it off (``ctypes path``: the ctypes binding
with its descriptor cache); ``--ctypes-only`` times only the latter. With torch installed the
numpy cases are repeated with torch CPU tensors (``torch cpu``).

On a host with torch and a CUDA device it also times torch CUDA tensors (fp16, same shapes):
the host time of a call (batches of 200 calls on an idle GPU, the synchronisation outside the
clock: the cost the binding and the C++ run() add) and, for reference, calls back to back with
one synchronisation at the end (bounded by the GPU's time per call once the launch queue fills).
"""

from __future__ import annotations

import argparse
import ctypes
import time
from typing import Callable, List, Optional, Tuple

import numpy as np

import tessera
from tessera import _capi, _fast

HEADS_QO, HEADS_KV, DIM, KEYS = 2, 1, 64, 16


def best_us(call: Callable[[], object], calls: int, repeats: int,
            sync: Optional[Callable[[], None]] = None) -> float:
    for _ in range(min(calls, 1000)):  # warm-up (descriptor caches, allocator, branch history)
        call()
    if sync is not None:
        sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        if sync is not None:
            sync()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def host_us(call: Callable[[], object], calls: int, repeats: int,
            sync: Callable[[], None], batch: int = 200) -> float:
    """Host time per call of a CUDA call: batches of `batch` calls (fewer than the launch queue
    holds) timed from an idle GPU to the last call's return, the synchronisation outside the
    clock. best_us with a sync measures max(host time, GPU time) per call instead: once the
    launch queue is full the host waits for the GPU."""
    for _ in range(min(calls, 1000)):
        call()
    sync()
    best = float("inf")
    for _ in range(repeats * max(1, calls // batch)):
        sync()
        start = time.perf_counter()
        for _ in range(batch):
            call()
        best = min(best, time.perf_counter() - start)
        sync()
    return best / batch * 1e6


def numpy_cases(workspace: np.ndarray) -> List[Tuple[str, Callable[[], object]]]:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, HEADS_QO, DIM)).astype(np.float32)
    k_cache = rng.standard_normal((1, KEYS, HEADS_KV, DIM)).astype(np.float32)
    v_cache = rng.standard_normal((1, KEYS, HEADS_KV, DIM)).astype(np.float32)
    paged = (k_cache, v_cache)
    out = np.empty_like(q)

    decode = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    decode.plan(np.array([0, 1], np.int32), np.array([0], np.int32),
                np.array([KEYS], np.int32), HEADS_QO, HEADS_KV, DIM, KEYS)
    k = rng.standard_normal((KEYS, HEADS_KV, DIM)).astype(np.float32)
    v = rng.standard_normal((KEYS, HEADS_KV, DIM)).astype(np.float32)
    ragged = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    ragged.plan(np.array([0, 1], np.int32), np.array([0, KEYS], np.int32), HEADS_QO, HEADS_KV,
                DIM, causal=True)

    cases = [
        ("decode  run()", lambda: decode.run(q, paged)),
        ("decode  run(out=)", lambda: decode.run(q, paged, out=out)),
        ("ragged  run()", lambda: ragged.run(q, k, v)),
        ("ragged  run(out=)", lambda: ragged.run(q, k, v, out=out)),
    ]
    floor = _ctypes_floor(decode, q, k_cache, v_cache, out, workspace)
    if floor is not None:
        cases.append(("decode  ctypes floor", floor))
    if decode._fast is not None:
        _C_FLOOR_CASE.append((decode, (q, paged, out, None)))
    return cases


_C_FLOOR_CASE: list = []  # (wrapper, runner arguments) for the in-process C floor


def _ctypes_floor(wrapper, q, k_cache, v_cache, out, workspace) -> Optional[Callable[[], int]]:
    """The bare tessera_run_decode call with descriptors built once (what run() cannot beat)."""
    try:
        from tessera._dlpack import to_dl
    except ImportError:
        return None
    q_dl, k_dl, v_dl = to_dl(q, "q"), to_dl(k_cache, "k"), to_dl(v_cache, "v")
    o_dl = to_dl(out, "out", writable=True)
    slots = (wrapper._page_indptr.dl, wrapper._page_indices.dl, wrapper._last_page_len.dl)
    kv = _capi.PagedKV(ctypes.pointer(k_dl), ctypes.pointer(v_dl), *map(ctypes.pointer, slots),
                       _capi.TESSERA_KV_LAYOUT_NHD)
    function = _capi.lib().tessera_run_decode
    handle, q_ref, kv_ref, o_ref = (wrapper._plan.handle, ctypes.byref(q_dl), ctypes.byref(kv),
                                    ctypes.byref(o_dl))
    ws_ptr, ws_bytes = workspace.ctypes.data, workspace.nbytes
    return lambda: function(handle, q_ref, kv_ref, o_ref, None, ws_ptr, ws_bytes, None)


def torch_cpu_cases() -> List[Tuple[str, Callable[[], object]]]:
    """The numpy cases with torch CPU tensors (fp32): the binding's cost for torch tensors
    without a GPU (the C++ floor is the CPU backend's run_*(), about 1 us)."""
    try:
        import torch
    except ImportError:
        return []
    gen = torch.Generator().manual_seed(0)
    return _torch_problem(torch, 16 << 20, lambda *shape: torch.randn(*shape, generator=gen))[0]


def _torch_problem(torch, workspace_bytes: int, randn, suffix: str = ""):
    """The tiny decode / ragged problem on torch tensors made by `randn(*shape)` (their device
    and dtype), planned; returns the four run() cases and (decode, q, k_cache, v_cache, paged,
    out, workspace) for the floor and breakdown timings."""
    q = randn(1, HEADS_QO, DIM)
    k_cache = randn(1, KEYS, HEADS_KV, DIM)
    v_cache = randn(1, KEYS, HEADS_KV, DIM)
    k, v = k_cache[0].contiguous(), v_cache[0].contiguous()
    out = torch.empty_like(q)
    paged = (k_cache, v_cache)

    def workspace_of():
        return torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device)

    def decode_wrapper(workspace):
        wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
        wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                     torch.tensor([KEYS], dtype=torch.int32), HEADS_QO, HEADS_KV, DIM, KEYS)
        return wrapper

    def ragged_wrapper(workspace):
        wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
        wrapper.plan(torch.tensor([0, 1], dtype=torch.int32),
                     torch.tensor([0, KEYS], dtype=torch.int32), HEADS_QO, HEADS_KV, DIM,
                     causal=True)
        return wrapper

    # Each wrapper its own workspace, so each run() finds its plan's lists resident (uploaded by
    # plan()), as in `tessera bench --suite overhead`.
    workspace = workspace_of()
    decode = decode_wrapper(workspace)
    ragged = ragged_wrapper(workspace_of())
    cases = [
        ("decode  run()" + suffix, lambda: decode.run(q, paged)),
        ("decode  run(out=)" + suffix, lambda: decode.run(q, paged, out=out)),
        ("ragged  run()" + suffix, lambda: ragged.run(q, k, v)),
        ("ragged  run(out=)" + suffix, lambda: ragged.run(q, k, v, out=out)),
    ]
    if q.device.type == "cuda":
        # Two wrappers on one workspace (as FlashInfer users often share one buffer): the later
        # plan overwrote the earlier one's lists, so every run() of the decode wrapper uploads
        # them again (one copy from pinned staging).
        shared = workspace_of()
        shared_decode = decode_wrapper(shared)
        ragged_wrapper(shared)
        cases.append(("decode  run(out=), shared workspace" + suffix,
                      lambda: shared_decode.run(q, paged, out=out)))
    return cases, (decode, q, k_cache, v_cache, paged, out, workspace, ragged, k, v)


def torch_cases():
    try:
        import torch
    except ImportError:
        return None, None, None
    if not torch.cuda.is_available() or tessera.cuda_device_count() < 1:
        return None, None, None
    cases, (decode, q, k_cache, v_cache, paged, out, workspace, ragged, k, v) = _torch_problem(
        torch, 128 << 20,
        lambda *shape: torch.randn(*shape, dtype=torch.float16, device="cuda"), "  torch cuda")
    floor = _ctypes_floor_torch(decode, q, k_cache, v_cache, out, workspace)
    if floor is not None:
        cases.append(("decode  ctypes floor  torch cuda", floor))
    return cases, torch.cuda.synchronize, (decode, q, paged, out, ragged, k, v)


def _ctypes_floor_torch(wrapper, q, k_cache, v_cache, out, workspace):
    """The bare tessera_run_decode call on CUDA with descriptors and stream built once."""
    try:
        from tessera._dlpack import cached_dl
    except ImportError:
        return None
    q_dl, k_dl, v_dl = cached_dl(q, "q"), cached_dl(k_cache, "k"), cached_dl(v_cache, "v")
    o_dl = cached_dl(out, "out", True)
    slots = (wrapper._page_indptr.dl, wrapper._page_indices.dl, wrapper._last_page_len.dl)
    kv = _capi.PagedKV(ctypes.pointer(k_dl), ctypes.pointer(v_dl), *map(ctypes.pointer, slots),
                       _capi.TESSERA_KV_LAYOUT_NHD)
    function = _capi.lib().tessera_run_decode
    import torch
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream or None)
    handle, q_ref, kv_ref, o_ref = (wrapper._plan.handle, ctypes.byref(q_dl), ctypes.byref(kv),
                                    ctypes.byref(o_dl))
    ws_ptr, ws_bytes = workspace.data_ptr(), workspace.numel()
    return lambda: function(handle, q_ref, kv_ref, o_ref, None, ws_ptr, ws_bytes, stream)


def breakdown(objects, calls: int, repeats: int) -> None:
    """Host cost of the pieces of a torch CUDA run(out=): torch attribute reads, the descriptor
    cache, the stream getter, the paged-KV struct (pure host work, no launch); then, with the C
    fast path, its runner alone and the bare C call on the current (default) stream and on a
    side stream."""
    import torch
    from tessera._dlpack import cached_dl
    decode, q, paged, out, ragged, k, v = objects
    raw = torch._C._cuda_getCurrentRawStream
    pieces = [
        ("q.data_ptr()", lambda: q.data_ptr()),
        ("q.shape", lambda: q.shape),
        ("q.stride()", lambda: q.stride()),
        ("q.dtype", lambda: q.dtype),
        ("q.device", lambda: q.device),
        ("q.get_device()", lambda: q.get_device()),
        ("key tuple (6 reads)", lambda: (type(q), q.data_ptr(), q.shape, q.stride(), q.dtype,
                                         q.device)),
        ("cached_dl(q)", lambda: cached_dl(q, "q")),
        ("cached_dl(out, writable)", lambda: cached_dl(out, "out", True)),
        ("stream getter (raw)", lambda: raw(0)),
        ("wrapper._paged_kv(kv)", lambda: decode._paged_kv(paged)),
        ("empty python call", lambda: None),
        ("torch.empty_like(q) (run()'s allocation)", lambda: torch.empty_like(q)),
    ]
    for name, call in pieces:
        print(f"  piece {name:42s} {best_us(call, calls, repeats):7.3f} us")
    if decode._fast is not None:  # the fast path's runner alone: describe 4 tensors + C run
        fast = decode._fast
        sync = torch.cuda.synchronize
        host = host_us(lambda: fast(q, paged, out, None), calls, repeats, sync)
        print(f"  piece {'fast runner(q, kv, out) (host)':42s} {host:7.3f} us")
        c_us = c_call_us(decode, (q, paged, out, None), calls, repeats, sync)
        print(f"  piece {'C run_decode in this process':42s} {c_us:7.3f} us")
        # The same on a non-default stream: the runner launches on torch's current stream (read
        # per call), so this tells whether launching on the legacy default stream costs more
        # inside a torch process than from a C++ binary. The workspace upload happened at plan()
        # on the default stream; c_call_us synchronises the device before each batch.
        with torch.cuda.stream(torch.cuda.Stream()):
            c_us = c_call_us(decode, (q, paged, out, None), calls, repeats, sync)
        print(f"  piece {'C run_decode in this process, side stream':42s} {c_us:7.3f} us")
    if ragged._fast is not None:  # the ragged run(): runner with and without out, bare C call
        fast = ragged._fast
        sync = torch.cuda.synchronize
        for name, arguments in (("fast runner(q, k, v, out) (host)", (q, k, v, out, None)),
                                ("fast runner(q, k, v, None) (host, allocates)",
                                 (q, k, v, None, None))):
            host = host_us(lambda: fast(*arguments), calls, repeats, sync)
            print(f"  piece {name:42s} {host:7.3f} us")
        for batch in (200, 20):
            host = host_us(lambda: ragged.run(q, k, v), calls, repeats, sync, batch)
            print(f"  piece {'ragged.run(q, k, v), batches of ' + str(batch):42s} {host:7.3f} us")
        for batch in (200, 20):  # a short batch: whether 200 calls fill a queue
            c_us = c_call_us(ragged, (q, k, v, out, None), calls, repeats, sync, batch)
            print(f"  piece {'C run_ragged_prefill, batches of ' + str(batch):42s} {c_us:7.3f} us")


def c_call_us(wrapper, arguments, calls: int, repeats: int,
              sync: Optional[Callable[[], None]] = None, batch: int = 200) -> float:
    """Host time of the bare C run function inside this process (the fast path's runner calls
    it `batch` times in a row with descriptors built once; GIL release included): the floor
    under run() here, to compare with `tessera bench --suite overhead`."""
    module = _fast.module()
    best = float("inf")
    for _ in range(repeats * max(1, calls // batch)):
        if sync is not None:
            sync()
        status, ns = module.time_c_call(wrapper._fast, batch, *arguments)
        if status:
            raise RuntimeError(f"status {status}")
        best = min(best, ns / 1e3)
    if sync is not None:
        sync()
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cuda", action="store_true", help="skip the torch CUDA cases")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the pieces of a torch CUDA run(out=)")
    parser.add_argument("--ctypes-only", action="store_true",
                        help="time only the ctypes path (the fast path off)")
    args = parser.parse_args()

    tessera.set_num_threads(1)
    print(f"tessera {tessera.__version__}: per-call microseconds, best of {args.repeats} x "
          f"{args.calls} calls")
    # Each case runs through the C fast path (tessera._fastcall) when it is available, then,
    # marked "ctypes path", with the fast path off (the wrappers' ctypes binding).
    fast_on = bool(tessera.fastcall_info()["loaded"]) and not args.ctypes_only
    paths = [(True, ""), (False, ", ctypes path")] if fast_on else [(False, "")]
    workspace = np.empty(16 << 20, np.uint8)
    for enabled, label in paths:
        _fast.set_enabled(enabled)
        for name, call in numpy_cases(workspace):
            if label and "floor" in name:
                continue
            print(f"  {name:32s} {best_us(call, args.calls, args.repeats):7.2f} us  "
                  f"(numpy cpu{label})")
        if enabled and _C_FLOOR_CASE:
            wrapper, arguments = _C_FLOOR_CASE[-1]
            print(f"  {'decode  C call in-process':32s} "
                  f"{c_call_us(wrapper, arguments, args.calls, args.repeats):7.2f} us  (numpy cpu)")
    for enabled, label in paths:
        _fast.set_enabled(enabled)
        for name, call in torch_cpu_cases():
            print(f"  {name:32s} {best_us(call, args.calls, args.repeats):7.2f} us  "
                  f"(torch cpu{label})")
    if not args.no_cuda:
        for enabled, label in paths:
            _fast.set_enabled(enabled)
            cases, sync, objects = torch_cases()
            for name, call in cases or []:
                if label and "floor" in name:
                    continue
                host = host_us(call, args.calls, args.repeats, sync)
                stream = best_us(call, args.calls, args.repeats, sync)
                print(f"  {name:32s} {host:7.2f} us host  ({stream:.2f} us per call back to "
                      f"back, GPU time included{label})")
            if args.breakdown and objects is not None and enabled == paths[0][0]:
                breakdown(objects, args.calls, args.repeats)
    _fast.set_enabled(True)
    info = tessera.fastcall_info()
    print(f"  fast path: {'on' if fast_on else 'off'} ({info['path'] or info['reason']}; numpy "
          f"{info['numpy']}, torch {info['torch']}; calls served {info['calls']}, handed back "
          f"{info['declined']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
