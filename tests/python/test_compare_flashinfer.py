"""bench/compare.py: its output without FlashInfer is what it was before the FlashInfer anchor
(a stand-in torch, SDPA timings stubbed), and its FlashInfer plumbing (tensor layouts, shuffled
page table, the fp32 reference check, rows and JSON) on the CPU against a stand-in flashinfer that
computes attention from the documented meaning of the wrappers' arguments."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "compare.py"


def load_compare():
    spec = importlib.util.spec_from_file_location("tessera_bench_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case(name, op, batch, q_len, kv_len, hq, hkv, d, page, causal, ms, tflops, nbytes, rate,
         first=None, first_count=1, graph=0, status="ok"):
    first_q, first_kv = first or (q_len, kv_len)
    return {"name": name, "op": op, "batch": batch, "q_len": q_len, "kv_len": kv_len,
            "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d, "page_size": page,
            "causal": causal, "first_q_len": first_q, "first_kv_len": first_kv,
            "first_count": first_count, "checked": 0, "graph": graph, "ms": ms,
            "tflops": tflops, "bytes": nbytes, "rate": rate, "status": status}


# The standard suite's kinds of row: SDPA-comparable ragged / paged / decode, a skewed decode,
# a graph replay and a failed case.
LEGACY_CASES = [
    case("prefill d128 4x4096 h16", "ragged_prefill", 4, 4096, 4096, 16, 16, 128, 0, 0, 1.5,
         1.0995, 1e8, 733.0),
    case("paged prefill p16 gqa32/8 d128 causal 4x4096", "paged_prefill", 4, 4096, 4096, 32, 8,
         128, 16, 1, 2.0, 1.1, 1e8, 550.0),
    case("decode gqa32/8 d128 p16 64x4096", "decode", 64, 1, 4096, 32, 8, 128, 16, 0, 0.2, 0.01,
         5.4e8, 2.7),
    case("decode gqa32/8 d128 p16 skewed 1x32k+255x512", "decode", 256, 1, 512, 32, 8, 128, 16, 0,
         0.1, 0.01, 2.5e8, 2.5, first=(1, 32768)),
    case("decode gqa32/8 d128 p16 1x1024 (graph)", "decode", 1, 1, 1024, 32, 8, 128, 16, 0, 0.014,
         0.0, 4194304, 0.3, graph=1),
    case("prefill d64 1x16384 h32", "ragged_prefill", 1, 16384, 16384, 32, 32, 64, 0, 0, 0, 0, 0,
         0, status="failed"),
]

# What bench/compare.py printed for LEGACY_CASES before FlashInfer came in (same stubs), with the
# one line it now adds when flashinfer does not import.
LEGACY_OUTPUT = """\
torch 2.11.0+cu130, cuDNN 91900, NVIDIA H100 80GB HBM3
FlashInfer not found (ModuleNotFoundError: import of flashinfer halted; None in sys.modules): torch SDPA anchors only
case                                           tessera       FA2     cuDNN   x FA2  x cuDNN
prefill d128 4x4096 h16                          733.0     488.7     586.4    1.50     1.25
paged prefill p16 gqa32/8 d128 causal 4x4096     550.0     366.7     440.0    1.50     1.25
decode gqa32/8 d128 p16 64x4096                   2.70         -      2.16       -     1.25
decode gqa32/8 d128 p16 skewed 1x32k+255x512      2.50   (tessera only)
decode gqa32/8 d128 p16 1x1024 (graph)            0.30   (tessera only)
prefill d64 1x16384 h32                      tessera failed: skipped
(rates: TFLOP/s for prefill, TB/s of K+V for decode; ratio > 1: tessera faster)
"""

LEGACY_ROWS = [
    {"name": "prefill d128 4x4096 h16", "op": "ragged_prefill", "tessera_ms": 1.5,
     "flash_ms": 2.25, "cudnn_ms": 1.875, "tessera_rate": 732.9999999999999,
     "flash_rate": 488.6666666666666, "cudnn_rate": 586.4, "ratio_flash": 1.5,
     "ratio_cudnn": 1.25},
    {"name": "paged prefill p16 gqa32/8 d128 causal 4x4096", "op": "paged_prefill",
     "tessera_ms": 2.0, "flash_ms": 3.0, "cudnn_ms": 2.5, "tessera_rate": 550.0,
     "flash_rate": 366.6666666666667, "cudnn_rate": 440.0, "ratio_flash": 1.5,
     "ratio_cudnn": 1.25},
    {"name": "decode gqa32/8 d128 p16 64x4096", "op": "decode", "tessera_ms": 0.2,
     "flash_ms": None, "flash_note": "No available kernel. Aborting execution.",
     "cudnn_ms": 0.25, "tessera_rate": 2.7, "flash_rate": None, "cudnn_rate": 2.16,
     "ratio_flash": None, "ratio_cudnn": 1.25},
]


def fake_sdpa(case, backend, iters, *rest):
    if case["op"] == "decode" and backend == "flash":
        return None, "No available kernel. Aborting execution."
    return case["ms"] * (1.25 if backend == "cudnn" else 1.5), ""


def test_without_flashinfer_output_is_unchanged(tmp_path, monkeypatch, capsys):
    fake_torch = types.ModuleType("torch")
    fake_torch.__version__ = "2.11.0+cu130"
    fake_torch.backends = types.SimpleNamespace(cudnn=types.SimpleNamespace(version=lambda: 91900))
    fake_torch.cuda = types.SimpleNamespace(get_device_name=lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer raises
    compare = load_compare()
    calls = []

    def sdpa(case, backend, iters, *rest):
        calls.append(rest)
        return fake_sdpa(case, backend, iters)

    monkeypatch.setattr(compare, "sdpa_ms", sdpa)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"device": "x", "results": LEGACY_CASES}))
    out = tmp_path / "compare.json"
    monkeypatch.setattr(sys, "argv", ["compare.py", str(bench), "--out", str(out)])
    assert compare.main() is None
    assert capsys.readouterr().out == LEGACY_OUTPUT
    assert json.loads(out.read_text()) == {"device": "NVIDIA H100 80GB HBM3", "rows": LEGACY_ROWS}
    assert calls == [()] * 6  # SDPA made its own tensors, as before


def test_dry_run_lists_the_anchors(tmp_path, monkeypatch, capsys):
    compare = load_compare()
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"device": "x", "results": LEGACY_CASES}))
    monkeypatch.setattr(sys, "argv", ["compare.py", str(bench), "--dry-run"])
    assert compare.main() is None
    text = capsys.readouterr().out
    assert "FlashInfer ragged 16/16 d128" in text
    assert "FlashInfer paged 32/8 d128 causal p16" in text
    assert "groups [(1, 1, 32768), (255, 1, 512)]" in text
    assert "no FlashInfer (checked mode / graph replay: tessera only)" in text
    assert "[('page',), ('prefill', 'fa2', 128), ('prefill', 'fa3', 128)]" in text


# ---- the FlashInfer path on the CPU ----------------------------------------------------------


def attention(torch, q, k, v, causal):
    """q [sq, Hq, D], k/v [skv, Hkv, D] -> [sq, Hq, D] in fp32, bottom-right causal."""
    sq, hq, d = q.shape
    skv, hkv = k.shape[:2]
    k = k.float().repeat_interleave(hq // hkv, dim=1)
    v = v.float().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(d)
    if causal:
        allowed = torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def fake_flashinfer(torch, shuffle_blind=False, wrong_from_batch=0):
    """Ragged, paged and decode wrappers computing attention from their arguments as FlashInfer
    documents them. Wrong anchors: shuffle_blind reads pages in order, ignoring the page ids;
    wrong_from_batch (> 0) perturbs the output of batches of that many requests or more."""
    fi = types.ModuleType("flashinfer")
    fi.__version__ = "0.5.3"
    built = []
    jit = types.ModuleType("flashinfer.jit")
    jit.gen_batch_prefill_module = lambda *a: ("prefill",) + a
    jit.gen_batch_decode_module = lambda *a: ("decode",) + a
    jit.build_jit_specs = lambda specs, verbose=False: built.extend(specs)
    page = types.ModuleType("flashinfer.jit.page")
    page.gen_page_module = lambda: ("page",)
    jit.page = page
    fi.jit = jit
    fi.built = built

    def pages_of(cache, indptr, indices, last, page, r):
        ids = indices[indptr[r]:indptr[r + 1]].long()
        if shuffle_blind:
            ids = torch.arange(int(indptr[r]), int(indptr[r + 1]))
        rows = cache[ids].reshape(-1, *cache.shape[2:])
        return rows[:(len(ids) - 1) * page + int(last[r])]

    def perturb(out, batch):
        if wrong_from_batch and batch >= wrong_from_batch:
            out[0] += 1.0
        return out

    class Ragged:
        def __init__(self, workspace, layout, backend="auto"):
            assert layout == "NHD"
            self._backend = backend

        def plan(self, qo_indptr, kv_indptr, hq, hkv, d, causal=False, q_data_type=None,
                 kv_data_type=None):
            assert q_data_type == torch.bfloat16 and kv_data_type == torch.bfloat16
            self.args = (qo_indptr.tolist(), kv_indptr.tolist(), causal)

        def run(self, q, k, v, out=None, enable_pdl=None):
            assert enable_pdl is False
            qo, kv, causal = self.args
            for r in range(len(qo) - 1):
                out[qo[r]:qo[r + 1]] = attention(torch, q[qo[r]:qo[r + 1]], k[kv[r]:kv[r + 1]],
                                                 v[kv[r]:kv[r + 1]], causal).to(out.dtype)
            return perturb(out, len(qo) - 1)

    class Paged:
        def __init__(self, workspace, layout, backend="auto"):
            assert layout == "NHD"
            self._backend = backend

        def plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, page, causal=False,
                 q_data_type=None, kv_data_type=None):
            assert q_data_type == torch.bfloat16 and kv_data_type == torch.bfloat16
            assert 1 <= int(last.min()) and int(last.max()) <= page
            self.args = (qo_indptr.tolist(), indptr.tolist(), indices, last, page, causal)

        def run(self, q, cache, out=None, enable_pdl=None):
            assert enable_pdl is False
            qo, indptr, indices, last, page, causal = self.args
            k_cache, v_cache = cache
            assert k_cache.shape[1] == page  # NHD: [pages, page_size, H, D]
            for r in range(len(qo) - 1):
                k = pages_of(k_cache, indptr, indices, last, page, r)
                v = pages_of(v_cache, indptr, indices, last, page, r)
                out[qo[r]:qo[r + 1]] = attention(torch, q[qo[r]:qo[r + 1]], k, v,
                                                 causal).to(out.dtype)
            return perturb(out, len(qo) - 1)

    class Decode(Paged):
        def __init__(self, workspace, layout, use_tensor_cores=False):
            assert layout == "NHD"
            self.use_tensor_cores = use_tensor_cores

        def plan(self, indptr, indices, last, hq, hkv, d, page, q_data_type=None,
                 kv_data_type=None):
            assert self.use_tensor_cores == (hq != hkv)
            qo = torch.arange(len(last) + 1, dtype=torch.int32)
            Paged.plan(self, qo, indptr, indices, last, hq, hkv, d, page, False, q_data_type,
                       kv_data_type)

        def run(self, q, cache, out=None, enable_pdl=None):
            assert q.dim() == 3 and q.shape[0] == len(self.args[3])  # [batch, Hq, D]
            return Paged.run(self, q, cache, out=out, enable_pdl=enable_pdl)

    fi.BatchPrefillWithRaggedKVCacheWrapper = Ragged
    fi.BatchPrefillWithPagedKVCacheWrapper = Paged
    fi.BatchDecodeWithPagedKVCacheWrapper = Decode
    return fi


SMALL_CASES = [
    case("prefill d32 causal 2x40 h4", "ragged_prefill", 2, 40, 40, 4, 4, 32, 0, 1, 0.5, 1e-3,
         1e6, 2.0),
    case("paged prefill p16 gqa4/2 d32 causal 2x70", "paged_prefill", 2, 70, 70, 4, 2, 32, 16, 1,
         0.5, 1e-3, 1e6, 2.0),
    case("decode gqa4/2 d32 p16 3x100", "decode", 3, 1, 100, 4, 2, 32, 16, 0, 0.01, 1e-6, 1e7,
         1.0),
    case("decode mha d32 p8 2x33", "decode", 2, 1, 33, 2, 2, 32, 8, 0, 0.01, 1e-6, 1e7, 1.0),
    case("decode gqa4/2 d32 p16 skewed 1x300+3x20", "decode", 4, 1, 20, 4, 2, 32, 16, 0, 0.01,
         1e-6, 1e7, 1.0, first=(1, 300)),
    case("prefill gqa4/2 d32 p16 causal mixed 2x48+3x1", "paged_prefill", 5, 1, 48, 4, 2, 32, 16,
         1, 0.01, 1e-6, 1e7, 1.0, first=(48, 48), first_count=2),
    case("decode gqa4/2 d32 p16 1x100 (graph)", "decode", 1, 1, 100, 4, 2, 32, 16, 0, 0.01, 0.0,
         1e6, 0.1, graph=1),
]


def run_cpu(tmp_path, monkeypatch, torch, fi, extra=()):
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.jit", fi.jit)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.page", fi.jit.page)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args, **kwargs: "CPU stand-in")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
    compare = load_compare()
    monkeypatch.setattr(compare, "DEVICE", "cpu")
    sdpa_calls = []

    def sdpa(case, backend, iters, tensors=None):
        sdpa_calls.append(tensors is not None)
        return fake_sdpa(case, backend, iters)

    def timing(fn, iters):
        fn()
        return 0.25

    monkeypatch.setattr(compare, "sdpa_ms", sdpa)
    monkeypatch.setattr(compare, "time_ms", timing)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"device": "x", "results": SMALL_CASES}))
    out, fi_out = tmp_path / "compare.json", tmp_path / "flashinfer.json"
    monkeypatch.setattr(sys, "argv", ["compare.py", str(bench), "--out", str(out),
                                      "--flashinfer-out", str(fi_out), *extra])
    rc = compare.main()
    return rc, json.loads(out.read_text()), json.loads(fi_out.read_text()), sdpa_calls


def test_flashinfer_rows_on_the_cpu(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    fi = fake_flashinfer(torch)
    rc, result, fi_json, sdpa_calls = run_cpu(tmp_path, monkeypatch, torch, fi)
    text = capsys.readouterr().out
    assert rc is None, text
    assert "FlashInfer 0.5.3: ragged fa3, paged fa3, decode fa2 CUDA cores/fa2 tensor cores" in text
    assert "x FlashInfer" in text
    assert "6 timed, 0 with wrong output (not timed), 0 failed to run, of 6 cases" in text
    # One JIT pre-build of the modules the cases need: fa3 prefill d32, fa2 prefill d32 (tensor
    # core decode) and the CUDA-core decode module (MHA decode).
    # ("page",): fa3's page-id-to-offset kernel for paged prefill.
    assert sorted(spec[:2] for spec in fi.built) == [("decode", torch.bfloat16), ("page",),
                                                     ("prefill", "fa2"), ("prefill", "fa3")]
    rows = {row["name"]: row for row in result["rows"]}
    assert len(rows) == 6  # every case but the graph replay
    for row in rows.values():
        assert row["flashinfer_ms"] == 0.25, row
        assert row["flashinfer_rel_l2"] < 1e-2
        assert row["ratio_flashinfer"] == pytest.approx(0.25 / row["tessera_ms"])
    assert rows["decode gqa4/2 d32 p16 3x100"]["flashinfer_backend"] == "fa2 tensor cores"
    assert rows["decode mha d32 p8 2x33"]["flashinfer_backend"] == "fa2 CUDA cores"
    skewed = rows["decode gqa4/2 d32 p16 skewed 1x300+3x20"]
    assert skewed["flash_ms"] is None and skewed["cudnn_ms"] is None
    # SDPA ran on the same tensors as FlashInfer, for the four uniform cases.
    assert sdpa_calls == [True] * 8
    assert result["flashinfer"]["version"] == "0.5.3"
    assert result["flashinfer"]["enable_pdl"] is False
    assert fi_json["same_call"] is True and fi_json["version"] == "0.5.3"
    assert {row["name"] for row in fi_json["rows"]} == set(rows)


def test_a_wrong_flashinfer_output_is_not_timed(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    rc, result, _, _ = run_cpu(tmp_path, monkeypatch, torch, fake_flashinfer(torch, True),
                               ["--flashinfer-only", "--filter", "p16"])
    text = capsys.readouterr().out
    assert rc == 1
    # The warm-up already finds the paged configurations wrong (their pages are shuffled).
    assert "paged 4/2 d32 causal p16: wrong output in the warm-up: rel L2" in text
    assert "0 timed, 4 with wrong output (not timed), 0 failed to run, of 4 cases" in text
    rows = {row["name"]: row for row in result["rows"]}
    assert set(rows) == {"paged prefill p16 gqa4/2 d32 causal 2x70", "decode gqa4/2 d32 p16 3x100",
                         "decode gqa4/2 d32 p16 skewed 1x300+3x20",
                         "prefill gqa4/2 d32 p16 causal mixed 2x48+3x1"}
    for row in rows.values():
        assert row["flashinfer_ms"] is None
        assert row["flash_ms"] is None and row["cudnn_ms"] is None


def test_a_case_whose_output_is_wrong_is_not_timed(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    # Right on the warm-up's two requests, wrong on the cases of three requests or more.
    fi = fake_flashinfer(torch, wrong_from_batch=3)
    rc, result, fi_json, _ = run_cpu(tmp_path, monkeypatch, torch, fi)
    text = capsys.readouterr().out
    assert rc == 1
    rows = {row["name"]: row for row in result["rows"]}
    wrong = {name for name, row in rows.items() if row.get("flashinfer_note", "").startswith(
        "wrong output: rel L2")}
    assert wrong == {"decode gqa4/2 d32 p16 3x100", "decode gqa4/2 d32 p16 skewed 1x300+3x20",
                     "prefill gqa4/2 d32 p16 causal mixed 2x48+3x1"}
    for name in wrong:
        assert rows[name]["flashinfer_ms"] is None and rows[name]["ratio_flashinfer"] is None
    assert "3 timed, 3 with wrong output (not timed), 0 failed to run, of 6 cases" in text
    assert text.count("     wrong ") == 3
    assert {row["name"] for row in fi_json["rows"]} == set(rows) - wrong
