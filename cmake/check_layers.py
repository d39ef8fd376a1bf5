#!/usr/bin/env python3
"""check_layers.py SOURCE_DIR [--self-test]: the layers' includes run one way.

Layers, bottom to top: pager <- attention <- serve <- cli (docs/DESIGN.md,
"The rules between the rooms"), with python (the Python module, src/python/)
a top layer beside cli. A file of a layer may include its own and
lower layers' internal headers ("pager/x.h", "attention/x.h", "serve/x.h")
and the public headers that belong to its own or a lower layer (PUBLIC
below); src/cli/ and src/python/ include public headers only (and their own
folder's headers, by bare name: "py_internal.h"). A public header may include
only public headers of its own or a lower layer. The umbrella kvpager.h
belongs to no layer below the program: only src/cli/ may include it.

Reads the sources only (no build). Prints every offending #include as
FILE:LINE: the line, and why; exits 1 if any, 0 otherwise. --self-test
plants one upward include per layer in a copy of the tree and checks that
each is reported.
"""
import os
import re
import shutil
import sys
import tempfile

LAYERS = ["pager", "attention", "serve", "cli", "python"]
# The top layers: public headers only. python ranks with cli: it may
# include every public header but the umbrella, which is cli's.
TOP = ("cli", "python")

# Which layer each public header (include/kvpager/) belongs to. Keep this
# table and the one in docs/DESIGN.md ("The rules between the rooms") equal.
PUBLIC = {
    "common.h": "pager",     # KVP_API, KVP_NODISCARD, KVP_MAX_RANK
    "version.h": "pager",    # generated: the headers' version macros
    "types.h": "pager",      # shapes, tensor views, geometry, RoPE config, kvp_version()
    "status.h": "pager",     # kvp_status, kvp_error, the formatter
    "pool.h": "pager",       # the pool, page layout, storage dtypes
    "tier.h": "pager",       # the second tier: vtable, block format, load
    "cache.h": "pager",      # caches, bindings, rows, reservations, sharing
    "param.h": "attention",  # parameters with identity and revision
    "rope.h": "attention",   # RoPE
    "layer.h": "attention",  # attention layers and their binding
    "attention.h": "attention",  # incremental attention, the reference
    "model.h": "serve",      # stacks of layers
    "sequence.h": "serve",   # sequences, steps, prefill, the decoder
    "scheduler.h": "serve",  # continuous batching
    "paged.h": "serve",      # paged attention for engines' own kernels
    "tier_redis.h": "serve",  # the Redis tier (over hiredis)
    "kvpager.h": "cli",      # the umbrella: everything; only the program
}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def rank(layer):
    return LAYERS.index(layer if layer != "python" else "cli")


def verdict(file_layer, target, in_public_header):
    """None if `file_layer` may include `target`, else the reason."""
    if target.startswith("kvpager/"):
        name = target[len("kvpager/"):]
        owner = PUBLIC.get(name)
        if owner is None:
            return "kvpager/%s is not in check_layers.py's table of public headers" % name
        if owner == "cli" and file_layer == "python":
            return "the umbrella %s includes every layer; only src/cli/ may" % target
        if rank(owner) > rank(file_layer):
            if owner == "cli":
                return "the umbrella %s includes every layer; only src/cli/ may" % target
            return "%s is %s's public header, above %s" % (target, owner, file_layer)
        return None
    top = target.split("/", 1)[0]
    if top in LAYERS[:3] and "/" in target:
        if in_public_header:
            return "a public header includes the internal header %s" % target
        if file_layer in TOP:
            return "src/%s/ includes public headers only, not %s" % (file_layer, target)
        if rank(top) > rank(file_layer):
            return "%s is %s's internal header, above %s" % (target, top, file_layer)
        return None
    return None  # system and third-party headers (<stdio.h>, <valgrind/...>)


def files_of(source_dir):
    """(path, layer, is_public_header) for every file the rules cover."""
    out = []
    for layer in LAYERS:
        folder = os.path.join(source_dir, "src", layer)
        if layer == "python" and not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.endswith((".c", ".h")):
                out.append((os.path.join(folder, name), layer, False))
    pub = os.path.join(source_dir, "include", "kvpager")
    for name in sorted(os.listdir(pub)):
        if name.endswith(".h"):
            out.append((os.path.join(pub, name), PUBLIC.get(name), True))
    # version.h is generated from cmake/version.h.in (no includes today).
    out.append((os.path.join(source_dir, "cmake", "version.h.in"), "pager", True))
    return out


def check(source_dir):
    problems = []
    for path, layer, public in files_of(source_dir):
        rel = os.path.relpath(path, source_dir)
        if layer is None:
            problems.append("%s: a public header missing from check_layers.py's table" % rel)
            continue
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                why = verdict(layer, m.group(2), public)
                if why:
                    problems.append("%s:%d: %s: %s" % (rel, number, line.strip(), why))
    return problems


PLANTS = [
    ("src/pager/pool.c", '#include "attention/layer_internal.h"', "attention's internal header"),
    ("src/pager/cache.c", '#include "kvpager/layer.h"', "attention's public header"),
    ("src/pager/status.c", '#include "kvpager/kvpager.h"', "the umbrella"),
    ("src/attention/layer.c", '#include "serve/model_internal.h"', "serve's internal header"),
    ("src/attention/param.c", '#include "kvpager/sequence.h"', "serve's public header"),
    ("src/serve/paged.c", '#include "kvpager/kvpager.h"', "the umbrella"),
    ("src/cli/main.c", '#include "pager/error.h"', "an internal header"),
    ("src/python/module.c", '#include "serve/sequence_internal.h"', "an internal header"),
    ("src/python/cache.c", '#include "kvpager/kvpager.h"', "the umbrella"),
    ("include/kvpager/pool.h", '#include "kvpager/rope.h"', "a public header above"),
    ("include/kvpager/param.h", '#include "kvpager/model.h"', "a public header above"),
]


def self_test(source_dir):
    failures = 0
    base = check(source_dir)
    for rel, line, what in PLANTS:
        scratch = tempfile.mkdtemp(prefix="check_layers.")
        try:
            for sub in ("src", "include", "cmake"):
                shutil.copytree(os.path.join(source_dir, sub), os.path.join(scratch, sub))
            target = os.path.join(scratch, rel)
            with open(target, encoding="utf-8") as f:
                text = f.read()
            with open(target, "w", encoding="utf-8") as f:
                f.write(line + "\n" + text)
            found = [p for p in check(scratch) if p not in base]
            if len(found) == 1 and found[0].startswith(rel + ":1: " + line):
                print("self-test: caught %s in %s" % (what, rel))
            else:
                print("self-test: planting %s in %s gave %r" % (line, rel, found))
                failures += 1
        finally:
            shutil.rmtree(scratch)
    return failures


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    if len(args) != 1 or flags not in ([], ["--self-test"]):
        print("usage: check_layers.py SOURCE_DIR [--self-test]", file=sys.stderr)
        return 2
    if flags:
        return 1 if self_test(args[0]) else 0
    problems = check(args[0])
    for p in problems:
        print(p)
    if problems:
        print("check_layers: %d include(s) run against the layers "
              "(pager <- attention <- serve <- cli, python)" % len(problems))
        return 1
    print("check_layers: every include runs one way "
          "(pager <- attention <- serve <- cli, python)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
