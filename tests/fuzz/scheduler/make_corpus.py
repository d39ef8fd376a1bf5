#!/usr/bin/env python3
"""make_corpus.py: writes the seed corpus of the scheduler fuzz target.

Owns: tests/fuzz/scheduler/corpus/*.bin, one hand-written script per file,
each aimed at a different path of the scheduler. The byte encoding mirrors
tests/fuzz/fuzz_scheduler.c (setup bytes, then an operation byte indexing
g_ops and its argument bytes); if g_ops or an operation's arguments change,
change OPS and the scripts here and run this again.
Usage: tests/fuzz/scheduler/make_corpus.py
"""
import os

# Indices into g_ops in fuzz_scheduler.c.
OPS = {
    "submit": 0, "step": 1, "collect": 3, "update": 4, "direct_adopt": 5,
    "direct_step": 6, "direct_fork": 7, "direct_truncate": 8, "direct_publish": 9,
    "direct_destroy": 10, "step_fault": 13,
}
GEOMETRIES = [(4, 1, 1), (4, 2, 1), (4, 2, 2), (8, 2, 1), (8, 2, 2)]
FRACTIONS = [0.0, 0.25, 0.5, 1.0]


def setup(geometry=1, block=4, pages=24, layers=2, threads=1, compute=True, sharing=True,
          aware=False, watermark=False, cap=24, reserve=4, max_running=0, ttl=0,
          fraction=0.5, seed=7, windows=None):
    """windows: per layer (w, s), indices into fuzz_scheduler.c's make_windowed_model
    lists: W in [full, 1, bt, bt + 1, 2 bt - 1, 3, cap, 32], S in [0, 0, 1, bt]."""
    m = (layers - 1) | (threads - 1) << 1 | (not compute) << 2 | (not sharing) << 3 \
        | aware << 4 | watermark << 5 | (windows is not None) << 6
    out = bytes([geometry, block - 1, pages - 4, m, cap - 4,
                 reserve | max_running << 3, ttl | FRACTIONS.index(fraction) << 3, seed])
    for w, sinks in windows or []:
        out += bytes([w | sinks << 3])
    return out


def op(name, *args):
    return bytes([OPS[name]] + list(args))


def submit(prompt, new, cap=24, samples=1, session=0, parent=None, parent_sample=0,
           upto_all=True, upto=1, array=False, no_input=False):
    """prompt 1..cap-1, new 1..8 (within the capacity), samples 1..3; parent:
    an earlier request id whose rows (sample parent_sample's past its prompt)
    this one's first rows are: all it can (upto_all) or 1 + upto."""
    a = (prompt - 1) % (cap - 1)
    assert a < 32, "prompt too long for this encoding"
    b = (new - 1) | (samples - 1) << 4
    c = session | no_input << 5 | array << 4
    e = 0
    if parent is not None:
        c |= 0x80 | (0x40 if upto_all else 0)
        e = parent | parent_sample << 5
    return op("submit", a, b, c, e, upto - 1)


def steps(n):
    out = b""
    while n > 0:
        k = min(n, 4)
        out += op("step", k - 1)
        n -= k
    return out


def collect(cap=4, null=False):
    return op("collect", cap | (8 if null else 0))


SCRIPTS = {
    # Collect before anything finished (cap 0 with NULL, cap 4), then a run.
    "collect_first.bin": setup() + collect(0, null=True) + collect(4)
    + submit(5, 3) + steps(4) + collect(4),
    # Samples forked over a shared prompt; a second request adopts its blocks.
    "samples_shared.bin": setup(pages=30) + submit(9, 5, samples=3)
    + submit(13, 4, samples=2, parent=0, upto_all=False, upto=8) + steps(8) + collect(4)
    + collect(4),
    # A conversation: turn 2 holds turn 1's prompt and reply and adopts them
    # from the kept session sequence.
    "conversation.bin": setup(ttl=5, fraction=0.5) + submit(6, 6, session=1) + steps(7)
    + submit(16, 3, session=1, parent=0) + steps(5) + collect(4),
    # Two kept sessions whose prompts share a block: retained pages count it once.
    "sessions_share_blocks.bin": setup(ttl=5, fraction=0.5) + submit(5, 3, session=1)
    + steps(4) + submit(5, 3, session=2, parent=0, upto_all=False, upto=4) + steps(4)
    + collect(4),
    # Allocator-only, sharing off and rows nobody reads.
    "allocator_only.bin": setup(compute=False, sharing=False, pages=16)
    + submit(3, 5, samples=2, no_input=True) + submit(9, 2) + steps(8) + collect(4),
    # Allocator-only with sharing: no rows at all, then keyed prompts.
    "allocator_sharing.bin": setup(compute=False, pages=20)
    + submit(3, 2, no_input=True) + submit(9, 4, samples=2, array=True)
    + submit(10, 2, parent=1, upto_all=False, upto=8) + steps(8) + collect(4),
    # Direct sequences on the scheduler's pool: adopt a request's published
    # blocks, publish, fork, truncate, step; a weight update between.
    "direct_sharing.bin": setup(pages=28, threads=2) + submit(9, 6, samples=2) + steps(7)
    + op("direct_adopt", 0x80, 0x01, 13) + op("direct_fork", 0) + op("direct_truncate", 4 << 2)
    + op("direct_step", 1) + op("direct_step", 1) + op("direct_publish", 1)
    + submit(12, 3, parent=0, parent_sample=1) + steps(2) + op("update", 2) + steps(5)
    + op("direct_step", 0) + op("direct_destroy", 0) + collect(4),
    # Pressure: a small pool, cache-aware, max_running, preemption and a watermark.
    "pressure.bin": setup(pages=10, aware=True, watermark=True, max_running=3, reserve=2)
    + submit(7, 8) + submit(5, 8, samples=2) + submit(4, 6, parent=0, upto_all=False, upto=4)
    + submit(20, 3) + steps(16) + collect(4) + steps(8) + collect(4),
    # Allocation faults in steps, before and after a weight update (stale idle leases).
    "faults.bin": setup(pages=20, ttl=3) + submit(6, 3, samples=2, session=1)
    + op("step_fault", 0) + op("step_fault", 1) + steps(4) + op("update", 3)
    + submit(9, 2, samples=3, parent=0) + op("step_fault", 0) + op("step_fault", 2)
    + op("step_fault", 5) + op("step_fault", 9) + steps(4) + collect(4),
    # Sliding layers (W = 1; W = bt with a sink): direct sequences adopt,
    # fork, truncate into released blocks (refused) and to 0, step again.
    "windows_direct.bin": setup(block=2, pages=28, windows=[(1, 0), (2, 2)])
    + submit(9, 6, samples=2) + steps(7) + op("direct_adopt", 0x81, 0x01, 13)
    + op("direct_fork", 0) + op("direct_truncate", 9 << 2) + op("direct_truncate", 12 << 2)
    + op("direct_step", 1) + op("direct_publish", 1) + op("direct_truncate", 1)
    + op("direct_step", 1) + submit(12, 3, parent=0, parent_sample=1) + steps(4)
    + op("update", 2) + steps(5) + collect(4) + collect(4),
    # W >= capacity (the capacity; the RoPE positions, with a block of sinks):
    # every layer full in effect; forked samples, a conversation, pressure.
    "windows_wide.bin": setup(block=1, pages=30, windows=[(6, 0), (7, 3)], reserve=2,
                              ttl=5, fraction=0.5)
    + submit(9, 5, samples=3, session=1) + steps(6) + submit(16, 3, session=1, parent=0)
    + steps(8) + collect(4) + collect(4),
}


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    os.makedirs(out, exist_ok=True)
    for name, data in SCRIPTS.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
