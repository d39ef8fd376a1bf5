#!/usr/bin/env python3
"""mutants.py: reads and applies the mutant list (tests/mutants/mutants.txt).

Owns the list's format; scripts/mutate.sh is its only caller. A mutant is a
block of `key: value` lines opened by `[id]`:

    [pool.high_water_after_release]
    file: src/pager/pool.c
    tag: normal            (or threads: also run the ThreadSanitizer tests)
    from: if (held > pool->high_water_pages) {
    to: if (held != pool->high_water_pages) {
    equivalent: why no test can tell it from the original (optional)

`from` must occur exactly once in `file`; `to` replaces it. In both, `\\n`
stands for a newline (a snippet may span lines) and `\\\\` for a backslash.
Lines starting with `#` and blank lines are ignored.

Commands (exit status 1 on any problem, with one line per problem):
    check LIST ROOT [--quiet]     every mutant well formed and applicable
    ids LIST [ID,ID...]           the ids to run, in list order
    has-threads LIST [ID,...]     1 if any of them is tagged threads, else 0
    field LIST ID KEY             one field ('' when absent)
    apply LIST ID ROOT            writes the mutant into ROOT/file
"""
import os
import re
import sys

KEYS = ("file", "tag", "from", "to", "equivalent")
TAGS = ("normal", "threads")


def unescape(text):
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def parse(path):
    mutants = []
    problems = []
    current = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.startswith("#"):
                continue
            header = re.fullmatch(r"\[([A-Za-z0-9_.-]+)\]", line)
            if header:
                current = {"id": header.group(1), "line": number}
                mutants.append(current)
                continue
            match = re.fullmatch(r"(\w+): ?(.*)", line)
            if current is None or not match or match.group(1) not in KEYS:
                problems.append(f"{path}:{number}: not a mutant line: {line}")
                continue
            key, value = match.groups()
            if key in current:
                problems.append(f"{path}:{number}: {current['id']}: {key} given twice")
            current[key] = unescape(value) if key in ("from", "to") else value
    seen = set()
    for m in mutants:
        where = f"{path}:{m['line']}: {m['id']}"
        if m["id"] in seen:
            problems.append(f"{where}: duplicate id")
        seen.add(m["id"])
        for key in ("file", "tag", "from", "to"):
            if key not in m:
                problems.append(f"{where}: no {key}")
        if m.get("tag") not in TAGS:
            problems.append(f"{where}: tag must be one of {', '.join(TAGS)}")
        if "from" in m and m["from"] == m.get("to"):
            problems.append(f"{where}: the replacement equals the original")
        if "equivalent" in m and not m["equivalent"].strip():
            problems.append(f"{where}: an equivalent mutant needs its reason")
    return mutants, problems


def check(path, root, quiet):
    mutants, problems = parse(path)
    for m in mutants:
        if "file" not in m or "from" not in m:
            continue
        where = f"{path}:{m['line']}: {m['id']}"
        target = os.path.join(root, m["file"])
        try:
            with open(target, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            problems.append(f"{where}: cannot read {m['file']}: {e.strerror}")
            continue
        count = text.count(m["from"])
        if count != 1:
            problems.append(f"{where}: the snippet occurs {count} times in {m['file']}, "
                            f"not once: {m['from']!r}")
    for p in problems:
        print(p)
    if not quiet or problems:
        scored = sum(1 for m in mutants if "equivalent" not in m)
        print(f"mutants.py: {len(mutants)} mutants ({scored} scored, "
              f"{len(mutants) - scored} equivalent), {len(problems)} problems")
    return 1 if problems else 0


def select(mutants, only):
    if not only:
        return mutants
    wanted = [i for i in only.split(",") if i]
    known = {m["id"] for m in mutants}
    unknown = [i for i in wanted if i not in known]
    if unknown:
        sys.exit(f"mutants.py: unknown mutant ids: {', '.join(unknown)}")
    return [m for m in mutants if m["id"] in wanted]


def find(mutants, ident):
    for m in mutants:
        if m["id"] == ident:
            return m
    sys.exit(f"mutants.py: unknown mutant id {ident}")


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    command, path = argv[1], argv[2]
    mutants, problems = parse(path)
    if command == "check":
        return check(path, argv[3], "--quiet" in argv[4:])
    if problems:
        sys.exit("\n".join(problems))
    if command == "ids":
        print(" ".join(m["id"] for m in select(mutants, argv[3] if len(argv) > 3 else "")))
    elif command == "has-threads":
        chosen = select(mutants, argv[3] if len(argv) > 3 else "")
        print(1 if any(m["tag"] == "threads" for m in chosen) else 0)
    elif command == "field":
        print(find(mutants, argv[3]).get(argv[4], ""))
    elif command == "apply":
        m = find(mutants, argv[3])
        target = os.path.join(argv[4], m["file"])
        with open(target, encoding="utf-8") as f:
            text = f.read()
        if text.count(m["from"]) != 1:
            sys.exit(f"mutants.py: {m['id']}: the snippet does not occur exactly once")
        with open(target, "w", encoding="utf-8") as f:
            f.write(text.replace(m["from"], m["to"], 1))
    else:
        sys.exit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
