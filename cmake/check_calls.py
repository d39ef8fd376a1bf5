#!/usr/bin/env python3
"""check_calls.py [--nm NM] OBJECT...: no two files of one folder call each
other in a circle.

Reads the library's object files (CMake passes $<TARGET_OBJECTS:kvpager_objects>,
and the Python module's, $<TARGET_OBJECTS:kvpager_python>, when it is built;
each is .../src/<folder>/<file>.c.o or .o), lists with `nm` what each defines
and what it leaves undefined, and builds, within each of src/pager,
src/attention, src/serve and src/python, the graph "file A uses a symbol
file B defines".
A cycle of any length in that graph (pool.c -> audit.c -> pool.c, or
a.c -> b.c -> c.c -> a.c) fails the check: it prints each cycle with the
symbols on every edge and exits 1. Calls across folders are the layers'
business (cmake/check_layers.py); static functions never appear.

check_calls.py --self-test [--nm NM] --cc CC: compiles three small files
into a scratch folder src/demo/, first calling one way (must pass), then
with a planted call closing a circle of three (must fail naming it).
"""
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile

# Circles found when this check was written, each waiting for its fix. One
# printed here still prints but does not fail; a circle that grows, a new
# one, or one listed here that is gone (remove it then) fails.
KNOWN = set()  # circles allowed for now: none

DEFINED = set("TDBRGSVWiu")  # global text, data, bss, read-only, small, weak, ifunc, unique
OBJECT = re.compile(r"(?:^|/)src/([a-z_]+)/([A-Za-z0-9_]+\.c)(?:\.o|\.obj)$")
# A target defined in its own folder's CMakeLists.txt (src/python/) puts its
# objects at src/<folder>/CMakeFiles/<target>.dir/[./]<file>.c.o.
OBJECT_IN_FOLDER = re.compile(
    r"(?:^|/)src/([a-z_]+)/CMakeFiles/[^/]+\.dir/(?:\./)?([A-Za-z0-9_]+\.c)(?:\.o|\.obj)$")


def symbols(nm, path):
    """(defined, undefined) global symbol sets of one object file."""
    out = subprocess.run([nm, "-P", path], check=True, capture_output=True, text=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        name, kind = parts[0], parts[1]
        if kind == "U":
            undefined.add(name)
        elif kind in DEFINED:
            defined.add(name)
    return defined, undefined


def graphs(nm, objects):
    """{folder: {file: {other file: sorted symbols file uses from other}}}."""
    files = {}
    for path in objects:
        m = (OBJECT_IN_FOLDER.search(path.replace(os.sep, "/")) or
             OBJECT.search(path.replace(os.sep, "/")))
        if not m:
            raise SystemExit("check_calls: %s is not a src/<folder>/<file>.c object" % path)
        files[(m.group(1), m.group(2))] = symbols(nm, path)
    out = {}
    for (folder, name), (_, undefined) in sorted(files.items()):
        edges = out.setdefault(folder, {}).setdefault(name, {})
        for (other_folder, other), (defined, _) in files.items():
            if other_folder == folder and other != name:
                used = sorted(undefined & defined)
                if used:
                    edges[other] = used
    return out


def cycles(edges):
    """One concrete cycle per strongly connected component of more than one
    file (Tarjan), with the component."""
    index, low, stack, on, comps = {}, {}, [], set(), []
    counter = [0]

    def visit(v):  # recursion depth is bounded by a folder's file count
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [shortest_cycle(edges, comp) for comp in comps]


def shortest_cycle(edges, comp):
    """The shortest cycle inside the component, and the component."""
    return min((cycle_through(edges, comp, start) for start in comp),
               key=lambda found: len(found[0]))


def cycle_through(edges, comp, start):
    """The shortest cycle through `start` inside the component (BFS)."""
    members = set(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, {})):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start], comp
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("a strongly connected component without a cycle")


def check(nm, objects, quiet=False, known=()):
    found, seen = 0, set()
    for folder, edges in sorted(graphs(nm, objects).items()):
        for path, comp in cycles(edges):
            if (folder, tuple(comp)) in known:
                seen.add((folder, tuple(comp)))
                print("known cycle in src/%s/ (KNOWN in check_calls.py): %s"
                      % (folder, " -> ".join(path)))
            else:
                found += 1
                print("cycle in src/%s/: %s" % (folder, " -> ".join(path)))
            if len(comp) > len(path) - 1:
                print("  the files calling each other around: %s" % ", ".join(comp))
            for a in comp:
                for b in comp:
                    if b in edges[a]:
                        used = edges[a][b]
                        more = " and %d more" % (len(used) - 3) if len(used) > 3 else ""
                        print("  %s uses %s's %s%s" % (a, b, ", ".join(used[:3]), more))
        if not quiet:
            calls = sum(len(v) for v in edges.values())
            print("src/%s/: %d files, %d file-to-file uses" % (folder, len(edges), calls))
    for folder, comp in sorted(set(known) - seen):
        found += 1
        print("src/%s/: the known circle %s is gone: remove it from KNOWN in "
              "cmake/check_calls.py" % (folder, ", ".join(comp)))
    if found:
        print("check_calls: %d circle(s) between files of one folder" % found)
        return 1
    if seen:
        print("check_calls: within each folder, files call one way but for "
              "%d known circle(s)" % len(seen))
    else:
        print("check_calls: within each folder, files call one way")
    return 0


def self_test(nm, cc):
    sources = {
        "a.c": "int b_f(int);\nint a_f(int x) { return b_f(x) + 1; }\n",
        "b.c": "int c_f(int);\nint b_f(int x) { return c_f(x) * 2; }\n",
        "c.c": "int c_f(int x) { return x - 3; }\n",
    }
    planted = "int a_f(int);\nint c_f(int x) { return x > 0 ? a_f(x - 1) : 3; }\n"
    with tempfile.TemporaryDirectory(prefix="check_calls.") as scratch:
        folder = os.path.join(scratch, "src", "demo")
        os.makedirs(folder)

        def build():
            objects = []
            for name, text in sorted(sources.items()):
                src = os.path.join(folder, name)
                with open(src, "w") as f:
                    f.write(text)
                subprocess.run([cc, "-c", src, "-o", src + ".o"], check=True)
                objects.append(src + ".o")
            return objects

        if check(nm, build(), quiet=True) != 0:
            print("self-test: a -> b -> c, one way, was reported as a circle")
            return 1
        sources["c.c"] = planted
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            rc = check(nm, build(), quiet=True)
        print(text.getvalue(), end="")
        if rc != 1 or "cycle in src/demo/: a.c -> b.c -> c.c -> a.c" not in text.getvalue():
            print("self-test: the planted circle a -> b -> c -> a was not reported")
            return 1
        print("self-test: the planted circle of three was caught")
        return 0


def main():
    args, nm, cc, test = sys.argv[1:], "nm", None, False
    objects = []
    while args:
        a = args.pop(0)
        if a == "--nm" and args:
            nm = args.pop(0)
        elif a == "--cc" and args:
            cc = args.pop(0)
        elif a == "--self-test":
            test = True
        elif a.startswith("--"):
            print("check_calls: unknown flag %s" % a, file=sys.stderr)
            return 2
        else:
            objects.append(a)
    if test:
        if cc is None or objects:
            print("usage: check_calls.py --self-test [--nm NM] --cc CC", file=sys.stderr)
            return 2
        return self_test(nm, cc)
    if not objects:
        print("usage: check_calls.py [--nm NM] OBJECT...", file=sys.stderr)
        return 2
    return check(nm, objects, known=KNOWN)


if __name__ == "__main__":
    sys.exit(main())
