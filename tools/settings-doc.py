#!/usr/bin/env python3
"""Rewrites the settings tables of README.md (user) and docs/DEVELOPING.md (developer) from the
settings registry (src/core/settings.cpp), as `tessera settings --markdown SCOPE` prints it.

  tools/settings-doc.py [path/to/tessera]      (default: build/tessera)

tests/test_settings.cpp fails while a table is out of date.
"""
import pathlib
import re
import subprocess
import sys

root = pathlib.Path(__file__).resolve().parent.parent
cli = sys.argv[1] if len(sys.argv) > 1 else str(root / "build" / "tessera")
for doc, scope in (("README.md", "user"), ("docs/DEVELOPING.md", "developer")):
    table = subprocess.run([cli, "settings", "--markdown", scope], check=True,
                           capture_output=True, text=True).stdout
    path = root / doc
    text = path.read_text()
    pattern = re.compile(r"(<!-- settings:%s -->\n).*?(<!-- /settings -->)" % scope, re.S)
    if not pattern.search(text):
        sys.exit(f"settings-doc: {doc} has no <!-- settings:{scope} --> marker")
    path.write_text(pattern.sub(lambda m: m.group(1) + table + m.group(2), text))
    print(f"settings-doc: {doc} ({scope}) written")
