"""GPU tests through PyTorch: varlen and paged attention vs torch SDPA, torch.compile of the
custom ops, CUDA-graph capture/replay of the decode wrapper, errors. Skipped (with the reason)
without torch, without a CUDA device, or with a CPU-only build of the library."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import tessera  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to PyTorch", allow_module_level=True)
if tessera.cuda_device_count() == 0:
    pytest.skip("libtessera has no CUDA backend or sees no device", allow_module_level=True)

import tessera.torch_ops as tops  # noqa: E402

DEVICE = "cuda"
TOLERANCE = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=4e-3, rtol=4e-3)}


@pytest.fixture(params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def dtype(request):
    return request.param


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                        device=DEVICE)


def sdpa_request(q, k, v, causal, scale=None):
    """Reference for one request: q [Lq, H, D], k/v [Lk, Hkv, D] -> o [Lq, H, D] (fp32 math),
    lse [Lq, H]. Causal aligned bottom-right via an explicit mask; GQA through enable_gqa."""
    lq, heads, dim = q.shape
    lk, kv_heads = k.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    qh, kh, vh = (x.transpose(0, 1)[None].float() for x in (q, k, v))
    mask = None
    if causal:
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        mask = j <= i + (lk - lq)
    try:
        o = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
    except TypeError:  # torch < 2.5: no enable_gqa
        group = heads // kv_heads
        o = torch.nn.functional.scaled_dot_product_attention(
            qh, kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1), attn_mask=mask,
            scale=scale)
    group = heads // kv_heads
    scores = (qh[0] @ kh[0].repeat_interleave(group, 0).transpose(1, 2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1).transpose(0, 1)
    return o[0].transpose(0, 1), lse


def ragged(q_lens, kv_lens, heads, kv_heads, dim, dtype):
    q = torch.randn(sum(q_lens), heads, dim, dtype=dtype, device=DEVICE)
    k = torch.randn(sum(kv_lens), kv_heads, dim, dtype=dtype, device=DEVICE)
    v = torch.randn(sum(kv_lens), kv_heads, dim, dtype=dtype, device=DEVICE)
    return q, k, v


def reference_ragged(q, k, v, q_lens, kv_lens, causal):
    outs, lses = [], []
    qs = ks = 0
    for lq, lk in zip(q_lens, kv_lens):
        o, lse = sdpa_request(q[qs:qs + lq], k[ks:ks + lk], v[ks:ks + lk], causal)
        outs.append(o)
        lses.append(lse)
        qs += lq
        ks += lk
    return torch.cat(outs), torch.cat(lses)


# ---- varlen ------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_vs_sdpa(dtype, dim, causal):
    q_lens, kv_lens = [1, 100, 513, 37], [1, 300, 513, 1200]
    q, k, v = ragged(q_lens, kv_lens, 16, 4, dim, dtype)
    o, lse = tessera.varlen_attention(q, k, v, cu(q_lens), cu(kv_lens), max(q_lens),
                                      max(kv_lens), causal=causal, return_lse=True)
    ref_o, ref_lse = reference_ragged(q, k, v, q_lens, kv_lens, causal)
    assert o.dtype == dtype and o.device.type == "cuda" and lse.dtype == torch.float32
    torch.testing.assert_close(o.float(), ref_o, **TOLERANCE[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3)


def test_varlen_host_cu_seqlens_matches_device(dtype):
    q_lens = [17, 200, 3]
    q, k, v = ragged(q_lens, q_lens, 8, 2, 128, dtype)
    host = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    o_host = tessera.varlen_attention(q, k, v, host, host, causal=True)
    o_device = tessera.varlen_attention(q, k, v, cu(q_lens), cu(q_lens), causal=True)
    torch.testing.assert_close(o_host, o_device, atol=0, rtol=0)


def test_varlen_fused_qkv_views(dtype):
    lens = [64, 130]
    qkv = torch.randn(sum(lens), 8 + 2 + 2, 128, dtype=dtype, device=DEVICE)
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    o = tessera.varlen_attention(q, k, v, cu(lens), cu(lens), causal=True)
    ref_o, _ = reference_ragged(q, k, v, lens, lens, True)
    torch.testing.assert_close(o.float(), ref_o, **TOLERANCE[dtype])


def test_ragged_wrapper_vs_sdpa(dtype):
    q_lens, kv_lens = [5, 700], [900, 700]
    q, k, v = ragged(q_lens, kv_lens, 32, 8, 128, dtype)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = tessera.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan(cu(q_lens), cu(kv_lens), 32, 8, 128, causal=True)
    o = wrapper.run(q, k, v)
    ref_o, _ = reference_ragged(q, k, v, q_lens, kv_lens, True)
    torch.testing.assert_close(o.float(), ref_o, **TOLERANCE[dtype])


# ---- paged -------------------------------------------------------------------------------


def paged_cache(kv_lens, page_size, kv_heads, dim, dtype):
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    num_pages = sum(pages) + 4
    order = torch.randperm(num_pages, device=DEVICE).to(torch.int32)
    k_cache = torch.randn(num_pages, page_size, kv_heads, dim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32, device=DEVICE)
    start = 0
    for b, count in enumerate(pages):
        block_table[b, :count] = order[start:start + count]
        start += count
    return k_cache, v_cache, block_table


def gather(cache, block_table, b, length):
    page_size = cache.shape[1]
    count = (length + page_size - 1) // page_size
    rows = cache[block_table[b, :count].long()].reshape(-1, cache.shape[2], cache.shape[3])
    return rows[:length]


@pytest.mark.parametrize("q_per_request", [1, 4])
def test_paged_decode_vs_sdpa(dtype, q_per_request):
    kv_lens = [1, 15, 16, 17, 999, 4096]
    k_cache, v_cache, table = paged_cache(kv_lens, 16, 8, 128, dtype)
    seqlens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    batch = len(kv_lens)
    q = torch.randn(batch, q_per_request, 32, 128, dtype=dtype, device=DEVICE)
    o = tessera.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                       block_table=table, causal=True)
    # FlashInfer-style wrapper on the same cache
    indptr, indices, last = tessera.block_table_to_csr(table, seqlens, 16)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_per_request=q_per_request)
    o_wrapper = wrapper.run(q.reshape(batch * q_per_request, 32, 128), (k_cache, v_cache))
    for b, length in enumerate(kv_lens):
        if length < q_per_request:
            continue  # rows that see no key: covered by the CPU tests
        ref, _ = sdpa_request(q[b], gather(k_cache, table, b, length),
                              gather(v_cache, table, b, length), causal=True)
        torch.testing.assert_close(o[b].float(), ref, **TOLERANCE[dtype])
        torch.testing.assert_close(
            o_wrapper[b * q_per_request:(b + 1) * q_per_request].float(), ref, **TOLERANCE[dtype])


def test_append_then_decode(dtype):
    kv_lens = [30, 64]
    k_cache, v_cache, table = paged_cache([n + 1 for n in kv_lens], 16, 2, 64, dtype)
    seqlens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 1, 8, 64, dtype=dtype, device=DEVICE)
    k_new = torch.randn(2, 1, 2, 64, dtype=dtype, device=DEVICE)
    v_new = torch.randn_like(k_new)
    o = tessera.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                       block_table=table)
    for b, length in enumerate(kv_lens):
        keys = gather(k_cache, table, b, length + 1)
        torch.testing.assert_close(keys[-1], k_new[b, 0], atol=0, rtol=0)
        ref, _ = sdpa_request(q[b], keys, gather(v_cache, table, b, length + 1), causal=False)
        torch.testing.assert_close(o[b].float(), ref, **TOLERANCE[dtype])


# ---- torch.compile -----------------------------------------------------------------------


def test_torch_compile_fullgraph_varlen(dtype):
    lens = [33, 100]
    q, k, v = ragged(lens, lens, 8, 2, 128, dtype)
    cu_q = cu(lens)

    def block(q, k, v, cu_q):
        o = tops.varlen_attention(q, k, v, cu_q, cu_q, causal=True)
        return o * 2.0 + 1.0

    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, cu_q), block(q, k, v, cu_q), atol=0, rtol=0)


def test_torch_compile_fullgraph_paged_and_merge(dtype):
    kv_lens = [40, 300]
    k_cache, v_cache, table = paged_cache(kv_lens, 16, 2, 64, dtype)
    seqlens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 1, 8, 64, dtype=dtype, device=DEVICE)

    def step(q, seqlens):
        o, lse = tops.attention_with_kvcache(q, k_cache, v_cache, seqlens, table,
                                             return_lse=True)
        merged, _ = tops.merge_state(o[:, 0], lse[:, 0], o[:, 0], lse[:, 0])
        return merged

    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(q, seqlens), step(q, seqlens), atol=0, rtol=0)


def test_opcheck_fake_implementations(dtype):
    lens = [5, 9]
    q, k, v = ragged(lens, lens, 4, 2, 64, dtype)
    torch.library.opcheck(torch.ops.tessera.varlen_attention.default,
                          (q, k, v, cu(lens), cu(lens), 0.0, True, -1, -1, 0.0, 1.0, 1.0),
                          test_utils=("test_schema", "test_faketensor"))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.tessera.block_table_to_csr.default,
                          (table, torch.tensor([20, 3], dtype=torch.int32, device=DEVICE), 16),
                          test_utils=("test_schema", "test_faketensor"))


def test_rope_custom_op_mutates_in_place(dtype):
    q = torch.randn(6, 4, 64, dtype=dtype, device=DEVICE)
    k = torch.randn(6, 2, 64, dtype=dtype, device=DEVICE)
    pos = torch.arange(6, dtype=torch.int32, device=DEVICE)
    q_ref, k_ref = tessera.apply_rope_pos_ids(q, k, pos)
    tops.apply_rope_pos_ids_inplace(q, k, pos)
    torch.testing.assert_close(q, q_ref, atol=0, rtol=0)
    torch.testing.assert_close(k, k_ref, atol=0, rtol=0)


# ---- CUDA graphs -------------------------------------------------------------------------


def test_cuda_graph_capture_and_replay_decode_wrapper(dtype):
    kv_lens = [7, 130, 1000, 33]
    batch, heads, kv_heads, dim, page_size = len(kv_lens), 32, 8, 128, 16
    k_cache, v_cache, table = paged_cache(kv_lens, page_size, kv_heads, dim, dtype)
    seqlens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    indptr, indices, last = tessera.block_table_to_csr(table, seqlens, page_size)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace, use_cuda_graph=True)
    wrapper.plan(indptr, indices, last, heads, kv_heads, dim, page_size)
    q = torch.randn(batch, heads, dim, dtype=dtype, device=DEVICE)
    out = torch.empty_like(q)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, (k_cache, v_cache), out=out)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, (k_cache, v_cache), out=out)

    eager_wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE))
    eager_wrapper.plan(indptr, indices, last, heads, kv_heads, dim, page_size)
    for _ in range(3):
        q.copy_(torch.randn_like(q))  # new contents at the captured addresses
        k_cache.copy_(torch.randn_like(k_cache))
        graph.replay()
        torch.cuda.synchronize()
        expected = eager_wrapper.run(q, (k_cache, v_cache))
        torch.testing.assert_close(out, expected, atol=0, rtol=0)

    # Re-plan with the same lengths but other pages: the fixed index buffers get the new
    # indices, and the replay follows them.
    permutation = torch.randperm(k_cache.shape[0], device=DEVICE).to(torch.int32)
    new_table = permutation[table.long()]
    k_cache_moved = torch.empty_like(k_cache)
    v_cache_moved = torch.empty_like(v_cache)
    k_cache_moved[permutation.long()] = k_cache
    v_cache_moved[permutation.long()] = v_cache
    k_cache.copy_(k_cache_moved)
    v_cache.copy_(v_cache_moved)
    indptr2, indices2, last2 = tessera.block_table_to_csr(new_table, seqlens, page_size)
    wrapper.plan(indptr2, indices2, last2, heads, kv_heads, dim, page_size)
    graph.replay()
    torch.cuda.synchronize()
    eager_wrapper.plan(indptr2, indices2, last2, heads, kv_heads, dim, page_size)
    torch.testing.assert_close(out, eager_wrapper.run(q, (k_cache, v_cache)), atol=0, rtol=0)


# ---- errors ------------------------------------------------------------------------------


def test_errors_are_value_errors(dtype):
    q, k, v = ragged([4], [4], 4, 2, 64, dtype)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        tessera.varlen_attention(q, k, v, cu([4]).long(), cu([4]))
    with pytest.raises(ValueError, match="'k'"):
        tessera.varlen_attention(q, k.float(), v, cu([4]), cu([4]))
    with pytest.raises(ValueError, match="k_cache|'q'"):  # CPU q with a CUDA cache
        tessera.attention_with_kvcache(q[None].cpu(), k[None], v[None], cache_seqlens=4)
    workspace = torch.empty(16, dtype=torch.uint8, device=DEVICE)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(workspace)
    k_cache, v_cache, table = paged_cache([100000], 16, 1, 64, dtype)
    indptr, indices, last = tessera.block_table_to_csr(
        table, torch.tensor([100000], dtype=torch.int32, device=DEVICE), 16)
    with pytest.raises(ValueError, match="float_workspace_buffer"):
        wrapper.plan(indptr, indices, last, 8, 1, 64, 16)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        tops.varlen_attention(q, k, v, cu([4]).long(), cu([4]))


def test_cuda_graph_capture_of_run_without_out_keeps_the_plan(dtype):
    """A capture of run() without out= (the output allocated by the C fast path, from the
    graph's pool) still marks the plan captured, so the next plan() keeps it alive for the
    graph's replays (which copy its lists from its host memory)."""
    kv_lens = [7, 130, 1000, 33]
    batch, heads, kv_heads, dim, page_size = len(kv_lens), 32, 8, 128, 16
    k_cache, v_cache, table = paged_cache(kv_lens, page_size, kv_heads, dim, dtype)
    seqlens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    indptr, indices, last = tessera.block_table_to_csr(table, seqlens, page_size)
    wrapper = tessera.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE), use_cuda_graph=True)
    wrapper.plan(indptr, indices, last, heads, kv_heads, dim, page_size)
    q = torch.randn(batch, heads, dim, dtype=dtype, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, (k_cache, v_cache))  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wrapper.run(q, (k_cache, v_cache))
    assert wrapper._plan_captured
    captured = wrapper._plan
    wrapper.plan(indptr, indices, last, heads, kv_heads, dim, page_size)  # a new plan
    assert any(plan is captured for plan in wrapper._captured_plans)
    eager = tessera.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE))
    eager.plan(indptr, indices, last, heads, kv_heads, dim, page_size)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager.run(q, (k_cache, v_cache)), atol=0, rtol=0)
