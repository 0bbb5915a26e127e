"""``python -m tessera`` and the ``tessera`` console script: run the ``tessera`` command.

The command is the C++ program of the repository (``src/cli``: ``bench``, ``check``, ``plan``,
``tune``, ``info``, ``settings``); ``pip install .`` puts it in the package's ``_lib/`` beside
``libtessera.so``. This module replaces the Python process with it, passing the arguments on, so
its output and exit status are the command's. Looked for in the folder of the ``libtessera.so``
in use (``$TESSERA_LIBRARY``'s, ``build/`` of a source checkout), then in the package's ``_lib/``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence


def _candidates() -> List[Path]:
    paths: List[Path] = []
    try:
        from ._capi import library_path

        paths.append(Path(library_path()).resolve().parent / "tessera")
    except Exception:  # no loadable library: the package's own copy may still be there
        pass
    installed = Path(__file__).resolve().parent / "_lib" / "tessera"
    if installed not in paths:
        paths.append(installed)
    return paths


def command_path() -> Optional[str]:
    """Path of the ``tessera`` command this package runs, or None when there is none."""
    for path in _candidates():
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    path = command_path()
    if path is None:
        looked = ", ".join(str(p) for p in _candidates())
        sys.stderr.write(
            "tessera: the tessera command is not part of this installation (looked for "
            f"{looked}). The wheel builds it when the CLI11 headers are found (Debian: apt "
            "install libcli11-dev), so reinstall with `pip install .` after installing them, "
            "or build it with CMake (tools/run.sh bench builds build/tessera).\n"
        )
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(path, ["tessera", *args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
