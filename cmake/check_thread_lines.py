#!/usr/bin/env python3
"""
check_thread_lines.py: fails when a public function's comment does not say
its thread contract (issue 9: "a thread-safety line on every public
function").

Usage: check_thread_lines.py INCLUDE_DIR              checks INCLUDE_DIR/*.h
       check_thread_lines.py --self-test INCLUDE_DIR  proves the check fails
Run by ctest (tests/CMakeLists.txt, label unit) on include/kvpager.

The rule, for every declaration of a header (a line starting with KVP_API;
`#define KVP_API` is not one):
  - the block comment that ends on the line just above it must contain a
    line that starts (after the comment's " * ") with one of
        Threads: thread-safe
        Threads: one caller at a time per
        Threads: not safe while
    (kvpager/kvpager.h explains the three forms);
  - between that comment and the declaration there may be only other KVP_API
    declarations (a group such as kvp_cache_len .. kvp_cache_is_full shares
    one comment, and so one contract) and #define lines; a blank line or any
    other code in between means the declaration has no comment, and fails.
A header-level "Threads:" paragraph (the top of pool.h, cache.h, ...) gives
the picture but counts for no function: a declaration needs its own line, so
moving a function, or adding one, cannot inherit a contract by accident.

--self-test plants, one at a time, each of these faults into an in-memory
copy of the headers and requires the check to report exactly the functions
concerned: every declaration group's Threads line deleted; its contract
reworded into none of the three forms; a blank line inserted between the
group's comment and its first declaration.
"""
import pathlib
import re
import sys

DECL = re.compile(r"^KVP_API\b")
NAME = re.compile(r"\b(\w+)\s*\(")
THREADS = re.compile(
    r"^\s*(?:/\*+|\*)?\s*Threads: (?:thread-safe|one caller at a time per |not safe while )")
ANY_THREADS = re.compile(r"^\s*(?:/\*+|\*)?\s*Threads:")


def declarations(lines):
    """[(first, last, name)] line indexes of each KVP_API declaration."""
    found = []
    i = 0
    while i < len(lines):
        if DECL.match(lines[i]):
            first = i
            while not lines[i].rstrip().endswith(";"):
                i += 1
            text = " ".join(lines[first:i + 1])
            match = NAME.search(text)
            found.append((first, i, match.group(1) if match else "?"))
        i += 1
    return found


def comment_above(lines, decl_first, decl_lines):
    """The comment block above a declaration (its group's), or None."""
    i = decl_first - 1
    while i >= 0:
        line = lines[i].strip()
        if i in decl_lines:
            i = decl_lines[i] - 1  # an earlier declaration of the same group
            continue
        if line.startswith("#define"):
            i -= 1
            continue
        if line.endswith("*/") and (line.startswith("/*") or line.startswith("*")):
            end = i
            while i >= 0 and not lines[i].strip().startswith("/*"):
                i -= 1
            return lines[max(i, 0):end + 1]
        return None  # blank line or other code: no comment
    return None


def missing(text):
    """[(line number, function, why)] for every declaration without a contract."""
    lines = text.split("\n")
    decls = declarations(lines)
    # every line of a declaration -> the declaration's first line
    decl_lines = {}
    for first, last, _ in decls:
        for k in range(first, last + 1):
            decl_lines[k] = first
    bad = []
    for first, _, name in decls:
        block = comment_above(lines, first, decl_lines)
        if block is None:
            bad.append((first + 1, name, "no comment directly above"))
        elif not any(THREADS.match(l) for l in block):
            worded = any(ANY_THREADS.match(l) for l in block)
            bad.append((first + 1, name, "Threads: line not in one of the three forms"
                        if worded else "no Threads: line in its comment"))
    return decls, bad


def headers(include_dir):
    files = sorted(pathlib.Path(include_dir).glob("*.h"))
    if not files:
        sys.exit(f"check_thread_lines: no headers in {include_dir}")
    return {f.name: f.read_text() for f in files}


def check(include_dir):
    total = 0
    failures = []
    for name, text in headers(include_dir).items():
        decls, bad = missing(text)
        total += len(decls)
        failures += [f"{name}:{line}: {fn}: {why}" for line, fn, why in bad]
    if total == 0:
        sys.exit("check_thread_lines: no KVP_API declarations found")
    if failures:
        print("public functions without a thread contract (see cmake/check_thread_lines.py):")
        print("\n".join("  " + f for f in failures))
        return 1
    print(f"check_thread_lines: {total} KVP_API declarations, each with a Threads: line")
    return 0


def groups(text):
    """Each declaration group: (comment line indexes, first decl line, names)."""
    lines = text.split("\n")
    decls = declarations(lines)
    decl_lines = {}
    for first, last, _ in decls:
        for k in range(first, last + 1):
            decl_lines[k] = first
    by_comment = {}
    for first, _, name in decls:
        # the comment's last line identifies the group
        i = first - 1
        while i in decl_lines or lines[i].strip().startswith("#define"):
            i = decl_lines[i] - 1 if i in decl_lines else i - 1
        entry = by_comment.setdefault(i, [first, []])
        entry[0] = min(entry[0], first)
        entry[1].append(name)
    return lines, by_comment


def self_test(include_dir):
    planted = 0
    wrong = []
    for hname, text in headers(include_dir).items():
        _, bad = missing(text)
        if bad:
            sys.exit(f"self-test needs clean headers first; {hname} fails already")
        lines, by_comment = groups(text)
        for comment_end, (first_decl, names) in by_comment.items():
            start = comment_end
            while not lines[start].strip().startswith("/*"):
                start -= 1
            threads = [k for k in range(start, comment_end + 1) if ANY_THREADS.match(lines[k])]
            faults = {
                "Threads line deleted":
                    [l for k, l in enumerate(lines) if k not in threads],
                "contract reworded":
                    [l.replace("Threads: ", "Threads: usually ") if k in threads else l
                     for k, l in enumerate(lines)],
                "blank line before the declaration":
                    lines[:first_decl] + [""] + lines[first_decl:],
            }
            for fault, mutated in faults.items():
                planted += 1
                _, bad = missing("\n".join(mutated))
                reported = sorted(fn for _, fn, _ in bad)
                if reported != sorted(names):
                    wrong.append(f"{hname}: {fault} above {names[0]}: reported {reported}, "
                                 f"expected {sorted(names)}")
    if wrong:
        print("the check missed planted faults:")
        print("\n".join("  " + w for w in wrong))
        return 1
    print(f"check_thread_lines self-test: {planted} planted faults, each reported "
          f"for exactly the functions concerned")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "--self-test":
        sys.exit(self_test(args[1]))
    if len(args) == 1:
        sys.exit(check(args[0]))
    sys.exit(__doc__)
