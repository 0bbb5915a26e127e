"""The `tessera` command from Python: `python -m tessera` and the `tessera` console script run the
C++ command the package carries (tessera/_lib/tessera, or the one beside the libtessera.so in
use), pass the arguments and the exit status through, and say clearly when it is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tessera
import tessera.__main__ as entry


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120)


needs_command = pytest.mark.skipif(
    entry.command_path() is None, reason="no tessera command beside the library or in _lib/"
)


@needs_command
def test_python_m_tessera_info_describes_the_build():
    result = _run(sys.executable, "-m", "tessera", "info")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("tessera " + tessera.__version__), result.stdout
    assert "build: " in result.stdout and "cpu kernels: " in result.stdout, result.stdout


@needs_command
def test_python_m_tessera_passes_errors_and_status_through():
    result = _run(sys.executable, "-m", "tessera", "bogus")
    assert result.returncode == 2
    assert "unknown subcommand 'bogus'" in result.stderr, result.stderr


def test_the_installed_package_carries_the_command():
    installed = Path(tessera.__file__).resolve().parent / "_lib"
    if not (installed / "libtessera.so").is_file():
        pytest.skip("not the installed package (no tessera/_lib/libtessera.so)")
    command = installed / "tessera"
    assert command.is_file() and os.access(command, os.X_OK), f"{command} missing"
    # It finds the library beside it (RPATH $ORIGIN), whatever the environment says.
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "TESSERA_LIBRARY")}
    result = subprocess.run([str(command), "info"], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tessera " + tessera.__version__ in result.stdout


def test_the_console_script_runs_the_command():
    script = Path(sys.executable).parent / "tessera"
    if not script.is_file():
        found = shutil.which("tessera")
        if found is None:
            pytest.skip("no tessera console script (the package is not pip-installed here)")
        script = Path(found)
    if entry.command_path() is None:
        pytest.skip("no tessera command to run")
    result = _run(str(script), "info")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("tessera "), result.stdout


def test_a_missing_command_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(entry, "command_path", lambda: None)
    assert entry.main(["info"]) == 127
    message = capsys.readouterr().err
    assert "the tessera command is not part of this installation" in message
    assert "libcli11-dev" in message
