"""``python -m tessera.serving``: the serve benchmark (:mod:`.bench`)."""

from __future__ import annotations

import sys

from .bench import main

if __name__ == "__main__":
    sys.exit(main())
