"""tools/perf-doc.py: the table of docs/PERFORMANCE.md from a synthetic device call's OUT_DIR."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "perf-doc.py"

# One prefill case (1 TFLOP in 2 ms: 500 TFLOP/s), one decode case (1 GB in 0.5 ms: 2 TB/s), a
# graph replay (14 us) and a case that failed.
PREFILL = {"name": "prefill d128 4x4096 h16", "op": "ragged_prefill", "ms": 2.0, "tflops": 1.0,
           "bytes": 1e8, "rate": 500.0, "graph": 0, "checked": 0, "status": "ok"}
DECODE = {"name": "decode gqa32/8 d128 p16 64x4096", "op": "decode", "ms": 0.5, "tflops": 0.001,
          "bytes": 1e9, "rate": 2.0, "graph": 0, "checked": 0, "status": "ok"}
GRAPH = {"name": "decode gqa32/8 d128 p16 1x1024 (graph)", "op": "decode", "ms": 0.014,
         "tflops": 0.0, "bytes": 4194304.0, "rate": 0.3, "graph": 1, "checked": 0, "status": "ok"}
FAILED = {"name": "prefill d64 1x16384 h32", "op": "ragged_prefill", "ms": 0, "tflops": 0,
          "bytes": 0, "rate": 0, "graph": 0, "checked": 0, "status": "failed"}


def write_out_dir(path: Path, flashinfer: dict | None = None, compare: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    bench = {"device": "cuda:0 NVIDIA H100 80GB HBM3 sm_90, 132 SMs", "dtype": "bf16",
             "results": [PREFILL, DECODE, GRAPH, FAILED]}
    (path / "bench.json").write_text(json.dumps(bench))
    if compare:
        rows = [
            # cuDNN 2.5 ms (400 TFLOP/s, x 1.25), FA2 4 ms (250, x 2.00)
            {"name": PREFILL["name"], "op": "ragged_prefill", "tessera_ms": 2.0,
             "flash_ms": 4.0, "cudnn_ms": 2.5},
            # cuDNN 0.4 ms (2.50 TB/s, x 0.80); FA2 did not run this shape
            {"name": DECODE["name"], "op": "decode", "tessera_ms": 0.5, "flash_ms": None,
             "cudnn_ms": 0.4, "flash_note": "not supported"},
        ]
        (path / "compare.json").write_text(
            json.dumps({"device": "NVIDIA H100 80GB HBM3", "rows": rows}))
        (path / "compare.log").write_text(
            "torch 2.11.0+cu130, cuDNN 91900, NVIDIA H100 80GB HBM3\nprefill ...\n")
    (path / "build.txt").write_text("abc1234\n")
    if flashinfer is not None:
        (path / "flashinfer.json").write_text(json.dumps(flashinfer))
    return path


def run(*args: str) -> str:
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def table_row(text: str, name: str) -> list:
    for line in text.splitlines():
        if line.startswith(f"| {name} |"):
            return [cell.strip() for cell in line.strip("|").split("|")]
    raise AssertionError(f"no row for {name!r} in:\n{text}")


def test_table_from_bench_and_compare(tmp_path):
    text = run(str(write_out_dir(tmp_path / "out")), "--date", "2026-12-07")
    lines = text.splitlines()
    assert lines[0] == "<!-- perf:H100 -->" and lines[-1] == "<!-- /perf -->"
    assert "### H100 (NVIDIA H100 80GB HBM3)" in text
    assert "2026-12-07; build `abc1234`; bf16" in text
    assert "cuDNN 9.19.0 and FA2 through torch 2.11.0+cu130 SDPA in the same call" in text
    assert "FlashInfer" not in text  # no FlashInfer file: no column
    assert "| case | Tessera | cuDNN | FA2 | x cuDNN | x FA2 |" in text
    assert table_row(text, PREFILL["name"]) == [PREFILL["name"], "500.0", "400.0", "250.0",
                                                "1.25", "2.00"]
    assert table_row(text, DECODE["name"]) == [DECODE["name"], "2.00", "2.50", "-", "0.80", "-"]
    # A graph replay shows its time; SDPA has no such case.
    assert table_row(text, GRAPH["name"]) == [GRAPH["name"], "14.0 us", "-", "-", "-", "-"]
    assert table_row(text, FAILED["name"])[1] == "failed"
    # Prefill and decode in separate tables, prefill first.
    assert text.index("Prefill, TFLOP/s") < text.index(PREFILL["name"]) < text.index(
        "Decode, TB/s") < text.index(DECODE["name"])


def test_flashinfer_from_another_call(tmp_path):
    flashinfer = {"version": "0.5.3", "date": "2026-12-06", "same_call": False, "rows": [
        # FlashInfer 1.6 ms against Tessera 2.0 ms in its process: x 0.80 (not the bench's 2.0).
        {"name": PREFILL["name"], "flashinfer_ms": 1.6, "tessera_ms": 2.0},
        # Rates instead of times; no Tessera figure of its own: against the bench's 2.00 TB/s.
        {"name": DECODE["name"], "flashinfer_rate": 2.5},
        # A case the bench did not run: Tessera's figure from this file, marked *.
        {"name": "decode gqa32/8 d128 p16 16x4096", "op": "decode", "bytes": 5e8,
         "flashinfer_rate": 2.0, "tessera_rate": 2.2},
    ]}
    text = run(str(write_out_dir(tmp_path / "out", flashinfer)), "--date", "2026-12-07")
    assert "FlashInfer 0.5.3 measured in another call (2026-12-06)" in text
    assert ("| case | Tessera | cuDNN | FA2 | FlashInfer | x cuDNN | x FA2 | x FlashInfer |"
            in text)
    assert table_row(text, PREFILL["name"]) == [PREFILL["name"], "500.0", "400.0", "250.0",
                                                "625.0", "1.25", "2.00", "0.80"]
    assert table_row(text, DECODE["name"])[4] == "2.50"
    assert table_row(text, DECODE["name"])[7] == "0.80"
    starred = table_row(text, "decode gqa32/8 d128 p16 16x4096")
    assert starred == ["decode gqa32/8 d128 p16 16x4096", "2.20 *", "-", "-", "2.00", "-", "-",
                       "1.10"]
    assert "\\* Tessera timed in the FlashInfer call" in text
    # A case FlashInfer did not run has no FlashInfer figure.
    assert table_row(text, GRAPH["name"])[4] == "-"


def test_bench_only_call(tmp_path):
    text = run(str(write_out_dir(tmp_path / "out", compare=False)), "--build", "def5678",
               "--date", "2026-12-08")
    assert "no cuDNN / FA2 comparison in this call" in text
    assert "build `def5678`" in text  # --build wins over build.txt
    # The GPU comes from bench.json's device text when compare.json is absent.
    assert text.startswith("<!-- perf:H100 -->")
    assert table_row(text, PREFILL["name"]) == [PREFILL["name"], "500.0", "-", "-", "-", "-"]


def test_update_replaces_only_that_gpus_block(tmp_path):
    doc = tmp_path / "PERFORMANCE.md"
    doc.write_text("# Performance\n\nintro\n\n<!-- perf:H100 -->\nold table\n<!-- /perf -->\n\n"
                   "between\n\n<!-- perf:H200 -->\nthe H200's\n<!-- /perf -->\n\nend\n")
    out = write_out_dir(tmp_path / "out")
    assert run(str(out), "--date", "2026-12-07", "--update", str(doc)) == ""
    text = doc.read_text()
    assert "old table" not in text and "| 500.0 |" in text
    assert text.startswith("# Performance\n\nintro\n\n<!-- perf:H100 -->\n")
    assert "\n<!-- /perf -->\n\nbetween\n\n<!-- perf:H200 -->\nthe H200's\n<!-- /perf -->\n\nend\n" in text
    # Idempotent: the same call again gives the same file.
    run(str(out), "--date", "2026-12-07", "--update", str(doc))
    assert doc.read_text() == text
    # A GPU without a block is appended.
    other = tmp_path / "other.md"
    other.write_text("# Performance\n")
    run(str(out), "--date", "2026-12-07", "--update", str(other))
    assert other.read_text().startswith("# Performance\n\n<!-- perf:H100 -->\n")


def test_missing_bench_json_is_an_error(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True,
                            text=True)
    assert result.returncode != 0
    assert "bench.json not found" in result.stderr


@pytest.mark.parametrize("number, text", [(91900, "9.19.0"), (90100, "9.1.0"), (8902, "8.9.2")])
def test_cudnn_version_text(number, text):
    import importlib.util

    spec = importlib.util.spec_from_file_location("perf_doc", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.cudnn_text(number) == text
