"""The Hugging Face attention function of tessera.integrations.transformers called directly (no
transformers needed): the dense path against torch SDPA, its plan cache, and the workspace /
upload bookkeeping (CPU, with a fake library where a GPU would be needed); plus the upload and
CUDA-graph behaviour on a GPU (skipped without one). The model-level tests are test_hf_gpu.py."""

from __future__ import annotations

import math
import types
from collections import OrderedDict

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import tessera  # noqa: E402
import tessera.integrations.transformers as hf  # noqa: E402
from tessera import _capi  # noqa: E402
from tessera._common import attention_options  # noqa: E402

CUDA = torch.cuda.is_available() and tessera.cuda_device_count() > 0
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build")
MODULE = types.SimpleNamespace(is_causal=True, training=False)  # what the function reads


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test starts without cached plans or workspaces (and leaves the module's as they
    were)."""
    monkeypatch.setattr(hf, "_PLANS", OrderedDict())
    monkeypatch.setattr(hf, "_WORKSPACES", OrderedDict())
    monkeypatch.setattr(hf, "_GRAPH_PLANS", {})
    torch.manual_seed(0)


def reference(query, key, value, causal):
    """SDPA in fp32: [B, H, S_q, D] / [B, H_kv, S_kv, D] -> [B, S_q, H, D], causal aligned
    bottom-right."""
    heads, seqlen_q, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads, seqlen_kv = key.shape[1], key.shape[2]
    group = heads // kv_heads
    mask = None
    if causal:
        i = torch.arange(seqlen_q, device=query.device)[:, None]
        j = torch.arange(seqlen_kv, device=query.device)[None, :]
        mask = j <= i + (seqlen_kv - seqlen_q)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float().repeat_interleave(group, 1),
        value.float().repeat_interleave(group, 1), attn_mask=mask, scale=1 / math.sqrt(dim))
    return out.transpose(1, 2)


def forward(query, key, value):
    out, weights = hf.tessera_attention_forward(MODULE, query, key, value, None,
                                                scaling=1 / math.sqrt(query.shape[-1]))
    assert weights is None
    return out


def qkv(batch, heads, kv_heads, seqlen_q, seqlen_kv, dim, dtype=torch.float32, device="cpu"):
    return (torch.randn(batch, heads, seqlen_q, dim, dtype=dtype, device=device),
            torch.randn(batch, kv_heads, seqlen_kv, dim, dtype=dtype, device=device),
            torch.randn(batch, kv_heads, seqlen_kv, dim, dtype=dtype, device=device))


# ---- CPU --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 8, 2, 100, 100, 64), (2, 8, 2, 1, 37, 64),
                                   (3, 4, 1, 4, 40, 32), (1, 4, 4, 70, 90, 32)],
                         ids=["prefill-gqa", "decode", "speculative-mqa", "chunked-prefill"])
def test_dense_path_matches_sdpa(shape):
    batch, heads, kv_heads, seqlen_q, seqlen_kv, dim = shape
    query, key, value = qkv(*shape)
    out = forward(query, key, value)
    torch.testing.assert_close(out, reference(query, key, value, seqlen_q > 1), atol=2e-5,
                               rtol=1e-4)


def test_dense_plan_index_arrays_and_cache():
    """The index arrays are made on the device (no host copy) with the values the plan was made
    from; plans are cached by shape and stream, except those made during a CUDA-graph capture
    (their arrays get values only when the graph replays): those are shared by the layers of
    one capture and held for its replays."""
    cpu = torch.device("cpu")
    options = attention_options(True, -1, -1, 0.0, None)
    prefill = hf._dense_plan(torch, cpu, 0, None, 3, 70, 90, 4, 2, 32, options)
    page_indptr, page_indices, last_page_len, qo_indptr = prefill.tensors
    assert not prefill.decode
    assert page_indptr.dtype == torch.int32 and page_indptr.tolist() == [0, 1, 2, 3]
    assert page_indices.tolist() == [0, 1, 2]
    assert last_page_len.tolist() == [90, 90, 90]
    assert qo_indptr.tolist() == [0, 70, 140, 210]
    assert hf._dense_plan(torch, cpu, 0, None, 3, 70, 90, 4, 2, 32, options) is prefill
    decode = hf._dense_plan(torch, cpu, 0, None, 2, 1, 41, 4, 2, 32, options)
    assert decode.decode and len(decode.tensors) == 3 and decode.dls[3] is None
    assert [t.tolist() for t in decode.tensors] == [[0, 1, 2], [0, 1], [41, 41]]
    # Another stream, another plan (its arrays are written on that stream).
    assert hf._dense_plan(torch, cpu, 7, None, 2, 1, 41, 4, 2, 32, options) is not decode
    assert len(hf._PLANS) == 3
    # Made in a capture: shared by that capture's layers, not by another capture, not cached.
    captured = hf._dense_plan(torch, cpu, 5, 11, 2, 1, 41, 4, 2, 32, options)
    assert hf._dense_plan(torch, cpu, 5, 11, 2, 1, 41, 4, 2, 32, options) is captured
    other_capture = hf._dense_plan(torch, cpu, 5, 12, 2, 1, 41, 4, 2, 32, options)
    assert other_capture is not captured
    assert len(hf._PLANS) == 3 and len(hf._GRAPH_PLANS) == 2
    # A plan cached before the capture serves it and is held for its replays.
    assert hf._dense_plan(torch, cpu, 0, 13, 2, 1, 41, 4, 2, 32, options) is decode
    decode_key = next(key for key, value in hf._PLANS.items() if value is decode)
    assert len(hf._GRAPH_PLANS) == 3 and hf._GRAPH_PLANS[(13,) + decode_key] is decode
    # An invalidated capture (CUDA reports no active capture: id 0) shares and keeps nothing.
    broken = hf._dense_plan(torch, cpu, 5, 0, 2, 1, 41, 4, 2, 32, options)
    assert hf._dense_plan(torch, cpu, 5, 0, 2, 1, 41, 4, 2, 32, options) is not broken
    assert len(hf._PLANS) == 3 and len(hf._GRAPH_PLANS) == 3


class _FakePlan:
    def __init__(self, workspace_bytes):
        self.handle = object()
        self.workspace_bytes = workspace_bytes


def _entry(workspace_bytes):
    return hf._DensePlan(_FakePlan(workspace_bytes), True, (), ())


def test_shared_workspace_uploads_once_per_plan(monkeypatch):
    """One workspace per (device, stream), grown to powers of two, and one upload per plan
    change (not per layer): what makes the steady-state runs launch kernels only. A dropped
    workspace (grown or evicted) is forgotten by the library: its memory may come back at the
    same address."""
    uploads, forgotten = [], []

    def upload(handle, pointer, nbytes, stream):
        uploads.append((handle, pointer, nbytes, None if stream is None else stream.value))
        return 0

    monkeypatch.setattr(_capi, "lib", lambda: types.SimpleNamespace(
        tessera_plan_upload=upload, tessera_workspace_forget_uploads=forgotten.append))
    cpu = torch.device("cpu")  # the bookkeeping is device-independent; buffers are cheap here
    first, second = _entry(1000), _entry(5000)
    workspace = hf._shared_workspace(torch, cpu, 11, first)
    assert workspace.nbytes == hf._MIN_WORKSPACE_BYTES == workspace.buffer.numel()
    assert uploads == [(first.plan.handle, workspace.pointer, workspace.nbytes, 11)]
    for _layer in range(4):
        assert hf._shared_workspace(torch, cpu, 11, first) is workspace
    assert len(uploads) == 1
    assert hf._shared_workspace(torch, cpu, 11, second) is workspace  # fits: same buffer
    assert hf._shared_workspace(torch, cpu, 11, second) is workspace
    hf._shared_workspace(torch, cpu, 11, first)  # the first plan again: uploaded again
    assert [u[0] for u in uploads] == [first.plan.handle, second.plan.handle, first.plan.handle]

    big = _entry(3 * hf._MIN_WORKSPACE_BYTES)
    grown = hf._shared_workspace(torch, cpu, 11, big)
    assert grown is not workspace and grown.nbytes == 4 * hf._MIN_WORKSPACE_BYTES
    assert forgotten == [workspace.pointer]
    assert uploads[-1] == (big.plan.handle, grown.pointer, grown.nbytes, 11)
    assert hf._shared_workspace(torch, cpu, 11, first) is grown  # kept at its size
    assert len(uploads) == 5

    other = hf._shared_workspace(torch, cpu, 0, first)  # another stream (0: the default)
    assert other is not grown and uploads[-1][3] is None and len(uploads) == 6
    for stream in range(100, 100 + 2 * hf._MAX_WORKSPACES):
        hf._shared_workspace(torch, cpu, stream, first)
        hf._shared_workspace(torch, cpu, 11, first)  # kept in use: never the one evicted
    assert len(hf._WORKSPACES) == hf._MAX_WORKSPACES
    assert hf._WORKSPACES[(0, 11)] is grown and (0, 0) not in hf._WORKSPACES
    assert other.pointer in forgotten and grown.pointer not in forgotten
    assert len(forgotten) == 1 + 2 * hf._MAX_WORKSPACES - (hf._MAX_WORKSPACES - 2)


def test_cpu_runs_do_not_share_a_workspace(monkeypatch):
    """CPU runs keep a workspace of their own (runs from several threads may overlap), and
    CPU plans need no upload."""
    calls = []
    real = _capi.lib()

    class Library:
        def __getattr__(self, name):
            return getattr(real, name)

        def tessera_plan_upload(self, *args):
            calls.append(args)
            return real.tessera_plan_upload(*args)

    monkeypatch.setattr(_capi, "lib", Library)
    query, key, value = qkv(1, 4, 2, 1, 30, 32)
    for _layer in range(3):
        forward(query, key, value)
    assert calls == [] and not hf._WORKSPACES


# ---- CUDA -------------------------------------------------------------------------------------


class _CountingLibrary:
    """The library, counting tessera_plan_upload calls."""

    def __init__(self, library):
        self._library = library
        self.uploads = 0

    def __getattr__(self, name):
        return getattr(self._library, name)

    def tessera_plan_upload(self, *args):
        self.uploads += 1
        return self._library.tessera_plan_upload(*args)


BF16 = dict(atol=2e-2, rtol=2e-2)


@cuda_only
def test_cuda_dense_path_uploads_once_per_plan(monkeypatch):
    counting = _CountingLibrary(_capi.lib())
    monkeypatch.setattr(_capi, "lib", lambda: counting)
    for seqlen_q, seqlen_kv in ((300, 300), (1, 301), (1, 302), (1, 301)):
        before = counting.uploads
        for _layer in range(4):
            query, key, value = qkv(2, 8, 2, seqlen_q, seqlen_kv, 64, torch.bfloat16, "cuda")
            out = forward(query, key, value)
            torch.testing.assert_close(out.float(), reference(query, key, value, seqlen_q > 1),
                                       **BF16)
        assert counting.uploads == before + 1  # one per plan change, not one per layer
    assert len(hf._WORKSPACES) == 1


@cuda_only
def test_cuda_dense_path_runs_through_the_fast_path():
    """With the C extension in use, the dense path's CUDA runs go through its runner (one C call
    describes the tensors and runs), prefill and decode alike, with the same results."""
    info = tessera.fastcall_info()
    if not info["loaded"] or not info["enabled"]:
        pytest.skip(f"the C fast path is not in use: {info['reason']}")
    before = tessera.fastcall_info()["calls"]
    for seqlen_q, seqlen_kv in ((130, 130), (1, 131), (2, 133)):
        query, key, value = qkv(2, 8, 2, seqlen_q, seqlen_kv, 64, torch.bfloat16, "cuda")
        out = forward(query, key, value)
        torch.testing.assert_close(out.float(), reference(query, key, value, seqlen_q > 1),
                                   **BF16)
    assert tessera.fastcall_info()["calls"] == before + 3
    assert all(entry.runner is not None and entry.runner[1] is not None
               for entry in hf._PLANS.values())


@cuda_only
@pytest.mark.parametrize("warm", [True, False], ids=["plan-made-before", "plan-made-in-capture"])
def test_cuda_graph_capture_of_the_dense_path(warm):
    """A captured run copies the work lists itself from the plan's host memory (no upload while
    capturing), and the plan outlives the plan cache for the replays. warm: the plan comes from
    a warm-up on the capture stream; else it is made inside the capture (its index arrays are
    written by the graph, so it is not cached for eager runs)."""
    query, key, value = qkv(2, 8, 2, 1, 200, 64, torch.bfloat16, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        if warm:
            forward(query, key, value)
        else:
            forward(*qkv(2, 8, 2, 1, 100, 64, torch.bfloat16, "cuda"))
    torch.cuda.current_stream().wait_stream(side)
    cached = dict(hf._PLANS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        first_layer = forward(query, key, value)
        out = forward(query, key, value)  # a second layer of the same shape
    assert dict(hf._PLANS) == cached  # nothing made inside the capture is cached
    # One plan per shape per capture, kept for the replays.
    assert len(hf._GRAPH_PLANS) == 1
    (held,) = hf._GRAPH_PLANS.values()
    assert (held in cached.values()) == warm
    # A second capture of the same shape holds its own entry (its index arrays, when made in the
    # capture, are written by that graph).
    other = torch.cuda.CUDAGraph()
    with torch.cuda.graph(other, stream=side):
        forward(query, key, value)
    assert len(hf._GRAPH_PLANS) == 2
    assert len({capture for capture, *_ in hf._GRAPH_PLANS}) == 2
    # Eager runs of other plans upload into the shared workspaces; the cache forgets them all.
    for seqlen_kv in (57, 300):
        with torch.cuda.stream(side):
            forward(*qkv(2, 8, 2, 1, seqlen_kv, 64, torch.bfloat16, "cuda"))
        forward(*qkv(2, 8, 2, 1, seqlen_kv, 64, torch.bfloat16, "cuda"))
    hf._PLANS.clear()
    for _ in range(2):
        for tensor in (query, key, value):
            tensor.copy_(torch.randn_like(tensor))  # new contents at the captured addresses
        graph.replay()
        torch.cuda.synchronize()
        expected = reference(query, key, value, False)
        torch.testing.assert_close(first_layer.float(), expected, **BF16)
        torch.testing.assert_close(out.float(), expected, **BF16)


@cuda_only
def test_cuda_varlen_host_and_device_lengths_agree():
    """Host lengths: a plan per call, whose lists run() uploads itself (one pinned copy);
    device lengths: the one-shot call. Both give the same result."""
    lengths_q, lengths_k = [5, 130, 1], [40, 130, 300]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = torch.randn(int(cu_q[-1]), 8, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(int(cu_k[-1]), 2, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    out = tessera.varlen_attention(q, k, v, cu_q, cu_k, causal=True)  # host lengths
    expected = tessera.varlen_attention(q, k, v, torch.from_numpy(cu_q).cuda(),
                                        torch.from_numpy(cu_k).cuda(), causal=True)
    torch.testing.assert_close(out.float(), expected.float(), **BF16)
