"""The README's quick starts run as written.

Each quick start is the fenced block right after a marker comment in README.md
(``<!-- quickstart:numpy -->``, ``<!-- quickstart:cpp -->``). The numpy one runs in a fresh
interpreter with the package importable as the suite imports it (tools/python-test.sh: the
installed package), so it runs in CI; a missing marker or block fails. The C++ one is compiled
against the headers of this tree and a built libtessera.so: $TESSERA_BUILD_DIR (tools/run.sh's
build folder), else build/ (what `tools/run.sh test`, and so CI, builds before the Python
suite); it skips, saying why, when there is no such library or no C++ compiler.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def quickstart(name: str, language: str) -> str:
    """The code of the fenced block that directly follows <!-- quickstart:NAME --> in README."""
    text = README.read_text()
    marker = f"<!-- quickstart:{name} -->"
    at = text.find(marker)
    assert at >= 0, f"README.md has no '{marker}' marker (the quick start this test runs)"
    match = re.compile(r"\s*```" + re.escape(language) + r"\n(.*?)^```", re.S | re.M).match(
        text, at + len(marker))
    assert match, f"README.md: no ```{language} block right after '{marker}'"
    return match.group(1)


def test_readme_numpy_quickstart_runs(tmp_path):
    script = tmp_path / "quickstart_numpy.py"
    script.write_text(quickstart("numpy", "python"))
    # A fresh interpreter, outside the source tree, so nothing but the package under test (and
    # the environment this suite runs in) is importable.
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout.splitlines() == ["(8, 4, 64) (8, 4)", "(2, 4, 64)"], result.stdout


def built_library() -> Path:
    build = Path(os.environ.get("TESSERA_BUILD_DIR") or ROOT / "build")
    library = build / "libtessera.so"
    if not library.exists():
        pytest.skip(f"no built library at {library} (tools/run.sh test builds it; "
                    f"TESSERA_BUILD_DIR names another build folder): C++ quick start not run")
    # A library older than the public headers may not match their types (a crash, not a test).
    newest_header = max(path.stat().st_mtime for path in (ROOT / "include").rglob("*.h*"))
    if library.stat().st_mtime < newest_header:
        pytest.skip(f"{library} is older than include/tessera/ (rebuild it, e.g. tools/run.sh "
                    f"test): C++ quick start not run")
    return library


def test_readme_cpp_quickstart_builds_and_runs(tmp_path):
    source = tmp_path / "quickstart.cpp"
    source.write_text(quickstart("cpp", "cpp"))
    library = built_library()
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        pytest.skip("no C++ compiler (g++ / c++ / $CXX): C++ quick start not built")
    binary = tmp_path / "quickstart"
    # The README's command line, with absolute paths: g++ -std=c++20 -Iinclude quickstart.cpp
    # -Lbuild -ltessera -Wl,-rpath,$PWD/build -o quickstart
    build = subprocess.run(
        [compiler, "-std=c++20", f"-I{ROOT / 'include'}", str(source), f"-L{library.parent}",
         "-ltessera", f"-Wl,-rpath,{library.parent}", "-o", str(binary)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"compiling against {library}:\n{build.stderr}"
    result = subprocess.run([str(binary)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, (f"{library}: exit {result.returncode}\nstdout:\n"
                                    f"{result.stdout}\nstderr:\n{result.stderr}")
    assert "o[3, 3, :4] = " in result.stdout, result.stdout
