#!/usr/bin/env python3
"""Size limits of the sources (CI: .ci/run).

Fails (exit 1, listing the offenders) when
  * a file under src/, include/, python/tessera/, tests/, tools/, bench/, or python/*.c, has more
    than MAX_FILE_LINES lines, or
  * a C/C++/CUDA function body in src/ or include/ has more than MAX_FUNCTION_LINES lines (from
    the line of its `{` to the line of its `}`).

Functions are found by a brace-matching heuristic on the code with comments, strings, character
literals and preprocessor lines blanked: at namespace, class or `extern "C"` level, a `{` whose
declaration ends in `)` (plus qualifiers such as const, noexcept, override, a trailing return
type or a constructor's initializer list) opens a function body. Lambdas at namespace level count
as functions; lambdas and local classes inside a function count towards it.

Usage: tools/check-limits.py [--verbose] [ROOT]   (ROOT: the repository, default this script's)
docs/ and files outside the folders above are not checked. Files that git ignores are skipped.
"""

import os
import re
import subprocess
import sys

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 120

# Files other engineers are splitting now; each removes its own line when it is done.
FILE_ALLOW = {
}

# Functions over MAX_FUNCTION_LINES that stay, as "path:name" (name as this script prints it),
# each with its reason.
FUNCTION_ALLOW = {
}

# Every file of these folders (and python/*.c) is size-checked.
FILE_ROOTS = ("src/", "include/", "python/tessera/", "tests/", "tools/", "bench/")
# Functions are checked in these folders' C, C++ and CUDA files.
FUNCTION_ROOTS = ("src/", "include/")
CODE_EXTENSIONS = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh", ".inl")
# Not text to count (data, images, archives).
SKIP_EXTENSIONS = (".png", ".jpg", ".gz", ".xz", ".zip", ".so", ".a", ".o", ".pyc", ".bin")


def list_files(root):
    """Tracked and untracked-but-not-ignored files (git), else every file under root."""
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True, capture_output=True).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".") and not d.startswith("build")]
            for name in names:
                files.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(f.replace(os.sep, "/") for f in files if os.path.isfile(os.path.join(root, f)))


def size_checked(path):
    if path.endswith(SKIP_EXTENSIONS):
        return False
    if path.startswith(FILE_ROOTS):
        return True
    return path.startswith("python/") and path.count("/") == 1 and path.endswith(".c")


def strip_code(text):
    """The text with comments, string and character literals and preprocessor lines replaced
    by spaces (newlines kept, so line numbers stay)."""
    out = []
    i, n = 0, len(text)
    line_start = True  # only whitespace since the last newline
    while i < n:
        c = text[i]
        if line_start and c == "#":  # a preprocessor line, with its continuations
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                # comments inside a directive end it or are blanked with it
                if text.startswith("/*", i):
                    end = text.find("*/", i + 2)
                    end = n if end < 0 else end + 2
                    out.append(re.sub(r"[^\n]", " ", text[i:end]))
                    i = end
                    continue
                out.append(" ")
                i += 1
            continue
        if c == "\n":
            out.append(c)
            line_start = True
            i += 1
            continue
        if not c.isspace():
            line_start = False
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif c == "R" and text.startswith('"', i + 1) and (i == 0 or not (text[i - 1].isalnum() or
                                                                         text[i - 1] == "_")):
            match = re.match(r'R"([^()\\\s]{0,16})\(', text[i:])
            if not match:
                out.append(c)
                i += 1
                continue
            close = ")" + match.group(1) + '"'
            end = text.find(close, i + match.end())
            end = n if end < 0 else end + len(close)
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:end]))
            i = end
        elif c == '"' or (c == "'" and not (i > 0 and text[i - 1].isalnum() and
                                             i + 1 < n and text[i + 1].isalnum())):
            # a string or character literal (not a digit separator: 1'000)
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            end = min(j + 1, n)
            out.append(c + " " * max(0, end - i - 2) + (c if end - i >= 2 else ""))
            i = end
        else:
            out.append(c)
            i += 1
    return "".join(out)


# A declaration that opens a scope whose members are looked at (namespace, class, extern "C").
SCOPE_RE = re.compile(r'\b(?:namespace|class|struct|union)\b|\bextern\s*"\s*"')
INIT_LIST_RE = re.compile(r"\s*(?:(?:const|noexcept|override|final)\s*)*:(?!:)")
ENUM_RE = re.compile(r"(?:^|\s)enum\b")
TAIL_RE = re.compile(r"^\s*(?:(?:const|volatile|noexcept|override|final|mutable|try|&&|&|"
                     r"__device__|__host__)\s*)*(?:->.*)?$", re.S)
# A (qualified) name at the end of a declaration: ns::Class<T>::name, ~Class, operator+.
NAME_RE = re.compile(r"((?:[A-Za-z_]\w*\s*(?:<[^<>()]*>)?\s*::\s*)*~?\s*"
                     r"(?:operator\s*(?:\(\s*\)|[^\s(]+)|[A-Za-z_]\w*))\s*(?:<[^()]*>)?\s*$")
NOT_NAMES = {"__launch_bounds__", "alignas", "__attribute__", "__declspec", "decltype",
             "noexcept", "sizeof", "alignof", "requires", "static_assert", "__align__"}


def split_groups(head):
    """Depth-0 parenthesised groups of `head`: (start, end) of each `(`...`)`."""
    groups, depth, start = [], 0, 0
    for k, ch in enumerate(head):
        if ch == "(":
            if depth == 0:
                start = k
            depth += 1
        elif ch == ")" and depth > 0:
            depth -= 1
            if depth == 0:
                groups.append((start, k))
    return groups


def function_name(head, groups):
    """The name before the first parameter list that follows a name (not a macro like
    __launch_bounds__), else the declaration's first words."""
    for start, _ in groups:
        match = NAME_RE.search(head[:start])
        if match:
            name = re.sub(r"\s+", "", match.group(1))
            if name.split("::")[-1] not in NOT_NAMES:
                return name
    return " ".join(head.split())[:60]


def is_function_head(head):
    """Whether a declaration `head` followed by `{` opens a function body."""
    if "(" not in head:
        return False
    groups = split_groups(head)
    if not groups:
        return False
    # A constructor's initializer list (a ':' right after a parameter list).
    if any(INIT_LIST_RE.match(head[end + 1:]) for _, end in groups):
        return True
    tail = head[groups[-1][1] + 1:]
    if re.search(r"=\s*$", head) or "=" in tail:
        return False
    return bool(TAIL_RE.match(tail))


def find_functions(code):
    """(line of `{`, line of `}`, name) of every function body in the stripped `code`."""
    functions = []
    head_start = 0  # where the declaration before the next `{` begins
    i, n = 0, len(code)
    while i < n:
        ch = code[i]
        if ch == ";" or ch == "}":  # a declaration ends, or a scope closes
            head_start = i + 1
        elif ch == "{":
            head = code[head_start:i]
            head_clean = re.sub(r"^\s*(?:(?:public|private|protected)\s*:)+", "", head)
            if is_function_head(head_clean):
                ctor = any(INIT_LIST_RE.match(head_clean[end + 1:])
                           for _, end in split_groups(head_clean))
                if ctor and re.search(r"[\w>]\s*$", head_clean):
                    # a member initializer `x_{...}` of a constructor's list: skip its braces
                    i = skip_braces(code, i)
                    continue
                end = skip_braces(code, i)
                first = code.count("\n", 0, i) + 1
                last = code.count("\n", 0, end - 1) + 1
                functions.append((first, last,
                                  function_name(head_clean, split_groups(head_clean))))
                i = end
                head_start = i
                continue
            if (SCOPE_RE.search(head_clean) and not ENUM_RE.search(head_clean) and
                    not re.search(r"=\s*$", head_clean)):
                head_start = i + 1  # look inside
            else:  # an initializer, an enum, a requires-expression...: skip it whole
                i = skip_braces(code, i)
                continue
        i += 1
    return functions


def skip_braces(code, i):
    """The index after the `}` matching the `{` at i."""
    depth, n = 0, len(code)
    while i < n:
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def main(argv):
    verbose = "--verbose" in argv
    args = [a for a in argv if not a.startswith("--")]
    root = args[0] if args else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    offenders, allowed = [], []
    used = set()  # allow-list keys that something still needs
    for path in list_files(root):
        if not size_checked(path):
            continue
        try:
            with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if lines > MAX_FILE_LINES:
            entry = f"{path}: {lines} lines (limit {MAX_FILE_LINES})"
            if path in FILE_ALLOW:
                used.add(path)
                allowed.append(f"{entry} [allowed: {FILE_ALLOW[path]}]")
            else:
                offenders.append(entry)
        if path.startswith(FUNCTION_ROOTS) and path.endswith(CODE_EXTENSIONS):
            for first, last, name in find_functions(strip_code(text)):
                length = last - first + 1
                if length <= MAX_FUNCTION_LINES:
                    continue
                entry = f"{path}:{first}: {name}: {length} lines (limit {MAX_FUNCTION_LINES})"
                key = f"{path}:{name}"
                if key in FUNCTION_ALLOW:
                    used.add(key)
                    allowed.append(f"{entry} [allowed: {FUNCTION_ALLOW[key]}]")
                else:
                    offenders.append(entry)
    stale = [key for key in list(FILE_ALLOW) + list(FUNCTION_ALLOW) if key not in used]
    if verbose or offenders:
        for entry in allowed:
            print("check-limits: " + entry)
    for key in stale:  # not an error: the file or function is within the limits now
        print(f"check-limits: {key} is within the limits now; remove it from the allow-list")
    if offenders:
        print(f"check-limits: {len(offenders)} over the limits (split them, or add them to the "
              "allow-list in tools/check-limits.py with a reason):")
        for entry in offenders:
            print("  " + entry)
        return 1
    print(f"check-limits: ok (files <= {MAX_FILE_LINES} lines, functions in src/ and include/ "
          f"<= {MAX_FUNCTION_LINES} lines; {len(allowed)} allowed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
