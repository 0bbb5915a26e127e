#!/usr/bin/env python3
"""Compares the machine code of two builds of libtessera.so, kernel by kernel.

  tools/compare-sass.py OLD.so NEW.so [--cuobjdump PATH] [--show N]

Uses cuobjdump (the CUDA toolkit's or the one the triton wheel carries; also TESSERA_CUOBJDUMP).
Per kernel (mangled name, per architecture) it reports: identical; identical except for
constant-bank offsets (c[0x0][0x...]: a kernel-parameter struct changed layout); or different,
with the count of differing instructions. Kernels only in one build are listed as removed/added.
A renamed kernel pairs with its old self through --rename OLD_REGEX=NEW_TEXT (repeatable; applied
to the new build's demangled names, which are then compared with the old build's demangled ones):
  --rename 'CudaCoreDecode<(.*)> >\(=\1>(' pairs decode_kernel<CudaCoreDecode<T, q, kv> > with
  decode_kernel<T, q, kv>.
Exit status 0 always: the differences are for a person to explain.
"""
import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys


def find_cuobjdump(given):
    if given:
        return given
    if os.environ.get("TESSERA_CUOBJDUMP"):
        return os.environ["TESSERA_CUOBJDUMP"]
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton  # noqa: F401
        path = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    sys.exit("compare-sass: no cuobjdump (install the triton wheel or set TESSERA_CUOBJDUMP)")


def kernels(cuobjdump, lib):
    """{(arch, mangled name): [instruction text]} of every kernel in `lib`."""
    text = subprocess.run([cuobjdump, "-sass", lib], check=True, capture_output=True,
                          text=True).stdout
    result, arch, name = {}, "?", None
    for line in text.splitlines():
        match = re.search(r"arch = (sm_\w+)", line)
        if match:
            arch = match.group(1)
            continue
        match = re.search(r"Function : (\S+)", line)
        if match:
            # Anonymous namespaces are mangled with a hash of the file's path: drop it, so builds
            # of two checkouts compare.
            name = (arch, re.sub(r"_GLOBAL__N__[0-9a-f]+_", "_GLOBAL__N__", match.group(1)))
            result[name] = []
            continue
        match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line)
        if name and match:
            result[name].append(match.group(1))
    return result


def demangled(table):
    """The same table keyed by (arch, demangled name), through c++filt."""
    keys = list(table)
    text = subprocess.run(["c++filt"], input="\n".join(k[1] for k in keys), check=True,
                          capture_output=True, text=True).stdout.splitlines()
    return {(k[0], name): table[k] for k, name in zip(keys, text)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--cuobjdump")
    parser.add_argument("--show", type=int, default=0, help="print N differing lines per kernel")
    parser.add_argument("--rename", action="append", default=[], metavar="OLD_REGEX=NEW_TEXT",
                        help="rewrite the new build's demangled names before pairing")
    args = parser.parse_args()
    tool = find_cuobjdump(args.cuobjdump)
    old, new = kernels(tool, args.old), kernels(tool, args.new)
    if args.rename:
        old, new = demangled(old), demangled(new)
        for rule in args.rename:
            pattern, replacement = rule.split("=", 1)
            new = {(k[0], re.sub(pattern, replacement, k[1])): v for k, v in new.items()}
    counts = {"identical": 0, "constants only": 0, "different": 0}
    for key in sorted(set(old) | set(new)):
        label = f"{key[0]} {key[1]}"
        if key not in new:
            print(f"removed    {label}")
            continue
        if key not in old:
            print(f"added      {label}")
            continue
        a, b = old[key], new[key]
        if a == b:
            counts["identical"] += 1
            continue
        strip = lambda lines: [re.sub(r"c\[0x[0-9a-f]+\]\[0x[0-9a-f]+\]", "c[..]", x) for x in lines]
        if strip(a) == strip(b):
            counts["constants only"] += 1
            print(f"constants  {label}")
            continue
        counts["different"] += 1
        diff = [d for d in difflib.unified_diff(a, b, lineterm="", n=0)
                if d[:1] in "+-" and not d.startswith(("+++", "---"))]
        print(f"different  {label}: {len(a)} -> {len(b)} instructions, {len(diff)} diff lines")
        for d in diff[:args.show]:
            print(f"    {d}")
    print("summary: " + ", ".join(f"{v} {k}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
