#!/usr/bin/env python3
"""make_corpus.py: writes the seed corpus of the kvpager fuzz target.

Owns: tests/fuzz/corpus/*.bin, one hand-written operation script per file,
each aimed at a different path of the API. The byte encoding mirrors
fuzz_api.c (setup bytes, then an operation byte indexing g_ops and its
arguments); if g_ops or an operation's arguments change, change OPS and
the scripts here and run this again. Usage: tests/fuzz/make_corpus.py
"""
import os

# Indices into g_ops in fuzz_api.c.
OPS = {
    "cache_create": 0, "cache_destroy": 2, "cache_reset": 3, "ticket_create": 4,
    "ticket_destroy": 6, "prepare": 7, "commit": 10, "discard": 12, "forward": 13,
    "seq_create": 16, "seq_destroy": 17, "seq_reset": 18, "step": 19, "prefill": 21,
    "promise": 22, "admit": 23, "param_update": 24, "decoder": 25, "pool_destroy": 27,
    "cache_truncate": 28, "seq_truncate": 29, "fork": 30, "publish": 32, "adopt": 33,
    "set_accum": 35, "paged": 36,
}
SPECIAL = {"nan": 0, "inf": 1, "-inf": 2, "1e308": 3, "-1e308": 4, "1e154": 5,
           "1e300": 6, "-1e200": 7}


def setup(geometry=0, block=2, pages=6, layers=1, model=(0, 1), threads=1, seed=1,
          base=0, extra=0):
    """geometry: index of (D, H) in (4,1) (4,2) (6,1) (8,1) (8,2); block 1..3;
    pages 2..12; layers 1..2 over model layer indices; threads 1..2; base:
    RoPE base index 0..3, plus 4 to chain layers with next_half instead of
    the residual stream."""
    m = (layers - 1) | (model[0] << 1) | (model[1] << 3) | ((threads - 1) << 5)
    return bytes([geometry, block - 1, pages - 2, m, seed, base, extra])


def values(seed=0, special=None, at=0):
    if special is None:
        return bytes([seed, 0])
    return bytes([seed, 0xE0 | SPECIAL[special], at])


def op(name, *args):
    out = bytes([OPS[name]])
    for a in args:
        out += a if isinstance(a, bytes) else bytes([a])
    return out


def cache(slot, layer=0, batch=1, cap=8):
    return op("cache_create", slot, layer, 8 + (batch - 1), cap)


def prepare(name, cache_slot, ticket, seed=0, special=None, at=0, layer_sel=0, shape=0):
    return op(name, layer_sel, cache_slot, ticket, shape, values(seed, special, at))


def forward(cache_slot, ticket, **kw):
    return prepare("forward", cache_slot, ticket, **kw)


# The typed sub-world (fuzz_paged.c): op("paged", which, ...) with which % 16
# selecting the operation. The first paged operation of an input (and
# which % 16 == 0) first reads the pool's three bytes (paged_pool below).
PAGED = {"pool": 0, "cache_create": 1, "cache_end": 3, "append": 4, "reserve": 6,
         "commit_rows": 7, "write": 8, "commit_written": 10, "forward": 11,
         "layer": 12, "attend": 13}
DTYPES = {"f64": 0, "f32": 1, "bf16": 2, "f16": 3, "fp8": 4}
SCALES = {1.0: 0, 2.0: 1, 0.25: 2, 0.3: 3, 3.7: 4}
# p_values's planted elements: NaN, +Inf, -Inf, 1e6, 70000, 500, 1e39, -3e38
BIG = {"nan": 0, "inf": 1, "-inf": 2, "1e6": 3, "70000": 4, "500": 5, "1e39": 6, "-3e38": 7}


TINY = {"1e-3": 0, "1e-5": 1, "2^-20": 2, "1e-8": 3, "1e-39": 4, "1e-42": 5, "1e-310": 6,
        "2^-24": 7}


def pvalues(seed=0, big=None, at=0, tiny=None):
    """Moderate values; or one planted big/special element; or the whole row
    scaled by a tiny factor (subnormal ranges)."""
    if tiny is not None:
        return bytes([seed, 0xC0 | TINY[tiny]])
    if big is None:
        return bytes([seed, 0])
    return bytes([seed, 0xE0 | BIG[big], at])


def paged_pool(dtype="f64", kv_heads=1, group=1, head_width=2, block=1, pages=6, seed=1):
    """kv_heads 1-2, group 1, 2 or 4 (H = kv_heads * group), head_width 2 or 4,
    block 1-3, pages 2-10."""
    a = DTYPES[dtype] + 5 * (kv_heads - 1) + 10 * {1: 0, 2: 1, 4: 2}[group] \
        + 30 * (head_width == 4)
    return bytes([a, (block - 1) + 3 * (pages - 2), seed])


def paged(name, *args):
    return op("paged", PAGED[name], *args)


def pcache(slot, bound=False, k_scale=1.0, v_scale=1.0, batch=1, cap=4):
    """An external cache with its fp8 scales, or one bound to the layer."""
    return paged("cache_create", slot, 0 if bound else 1,
                 SCALES[k_scale] + 6 * SCALES[v_scale], (batch - 1) + 2 * (cap - 1))


def prows(name, slot, src="f64", rows=1, k=pvalues(1), v=pvalues(2)):
    return paged(name, slot, DTYPES[src], rows, k, v)


def pattend(slot, heads_mult=0, f32=False, fast=False, candidate=False, scale=0, fault=0,
            q=pvalues(3), k=pvalues(4), v=pvalues(5)):
    """heads_mult 0: the binding's heads, else H_kv * 1, 2 or 3; scale index
    of 0 (1/sqrt(d_h)), 0.5, 1, 0.125; fault 1-8 (paged.h's refusals)."""
    sel = {0: 0, 2: 1, 3: 2, 1: 3}[heads_mult] | f32 << 2 | fast << 3 | candidate << 4 \
        | scale << 5
    return paged("attend", slot, sel, 224 + fault if fault else 0, q, k, v)


def pcommit_written(slot, rows):
    """rows <= 3 of the rows written in place (the write covers them all)."""
    return paged("commit_written", slot, 4 * (rows - 1))


def pwrite(slot, poison=None, k=pvalues(6), v=pvalues(7)):
    """Writes every reserved row in place; poison: a NaN in the last row's
    first key element or last value element."""
    return paged("write", slot, {None: 0, "key": 7, "value": 15}[poison], k, v)


def paged_script(dtype):
    """Every typed write path and the attention call on one external cache of
    a GQA-ready pool (K/V scales 0.3 and 2 for fp8)."""
    return (setup() + op("paged", PAGED["cache_create"]) + paged_pool(dtype, kv_heads=2,
                                                                    head_width=4, block=2,
                                                                    pages=8)
            + bytes([0, 1, SCALES[0.3] + 6 * SCALES[2.0], 2 * 7])
            + prows("append", 0, "f32", 2) + prows("append", 0, "bf16", 1, pvalues(8))
            + prows("append", 0, "f16", 1, pvalues(9, "70000", 3))
            + pattend(0) + pattend(0, 2, f32=True) + pattend(0, 3, fast=True, candidate=True)
            + pattend(0, 1, fast=True, f32=True, scale=1)
            + paged("reserve", 0, 1) + pwrite(0) + pcommit_written(0, 2)
            + pattend(0, candidate=True, scale=3)
            + paged("reserve", 0, 2) + prows("commit_rows", 0, "bf16", 1, pvalues(10))
            + pwrite(0, "key") + pcommit_written(0, 2) + paged("commit_written", 0, 3)
            + paged("reserve", 0, 0) + pwrite(0, "value") + pcommit_written(0, 1)
            + pwrite(0) + pcommit_written(0, 1)
            + pattend(0, q=pvalues(11, "nan", 5)) + pattend(0, candidate=True,
                                                             k=pvalues(12, "1e6", 2))
            + pattend(0, candidate=True, f32=True, v=pvalues(12, "1e39", 7))
            + b"".join(pattend(0, fault=f) for f in range(1, 9))
            + pcache(1, batch=2, cap=3)
            + prows("append", 1, "f64", 1, pvalues(13, tiny="1e-5"), pvalues(14, tiny="1e-42"))
            + prows("append", 1, "f32", 1, pvalues(15, tiny="1e-39"), pvalues(16, tiny="1e-3"))
            + prows("append", 1, "f64", 1, pvalues(17, tiny="2^-24"), pvalues(18, tiny="1e-310"))
            + pattend(1, fast=True) + pattend(1, f32=True)
            + pattend(1, candidate=True, k=pvalues(19, tiny="2^-20"), v=pvalues(20, tiny="1e-8"))
            + paged("cache_end", 1, 0) + prows("append", 1, "f64", 3)
            + paged("reserve", 0, 3) + prows("append", 1, "f32", 1) + pattend(1, fast=True)
            + paged("cache_end", 1, 0) + pattend(1) + paged("cache_end", 0, 1))


SCRIPTS = {
    # Prepare, commit, discard and forward until FULL; reset and start over.
    "cache_full.bin": setup(block=2, pages=8)
    + cache(0, cap=5) + op("ticket_create", 0, 0)
    + b"".join(forward(0, 0, seed=i) for i in range(6))
    + prepare("prepare", 0, 0) + op("cache_reset", 0) + prepare("prepare", 0, 0, seed=9)
    + op("commit", 0, 0) + prepare("prepare", 0, 0, seed=3) + op("discard", 0)
    + op("commit", 0, 0) + op("ticket_destroy", 0) + op("cache_destroy", 0),
    # Two caches of batch 2 racing for a 4-page pool: PoolExhausted.
    "exhaustion.bin": setup(geometry=1, block=1, pages=4)
    + cache(0, batch=2) + cache(1, batch=2) + op("ticket_create", 0, 0)
    + op("ticket_create", 1, 1)
    + b"".join(forward(0, 0, seed=i) + forward(1, 1, seed=i) for i in range(3))
    + op("admit", 1, 0) + op("pool_destroy") + op("cache_destroy", 0)
    + forward(1, 1, seed=7),
    # Stale bindings: an update bumps the revision; layer 1 is another
    # identity, layer 2 another RoPE base; a foreign and a stale commit.
    "stale.bin": setup(geometry=3, block=3)
    + cache(0) + cache(1, layer=2) + op("ticket_create", 0, 0) + op("ticket_create", 1, 0)
    + forward(0, 0) + prepare("prepare", 0, 0, layer_sel=6) + prepare("prepare", 0, 0, layer_sel=7)
    + prepare("prepare", 1, 1, layer_sel=7) + op("commit", 1, 0)
    + prepare("prepare", 0, 0) + op("commit", 0, 1) + op("cache_reset", 0) + op("commit", 0, 0)
    + op("param_update", 0, 1, 1, 5) + forward(0, 0) + cache(2) + forward(2, 0),
    # Non-finite inputs at each stage, and the shape checks.
    "nonfinite.bin": setup(geometry=4, block=2, pages=10)
    + cache(0, batch=2, cap=12) + op("ticket_create", 0, 0)
    + forward(0, 0, seed=1) + forward(0, 0, special="nan", at=3)
    + forward(0, 0, special="inf", at=0) + forward(0, 0, special="1e308", at=5)
    + forward(0, 0, special="1e154", at=2) + forward(0, 0, special="-1e200", at=9)
    + forward(0, 0, shape=0xF0) + forward(0, 0, shape=0xF1) + forward(0, 0, shape=0xF2)
    + forward(0, 0, shape=0xF3) + op("param_update", 0, 3, 3, 7)
    + cache(1, batch=2) + op("ticket_create", 1, 1) + forward(1, 1) + forward(1, 1, seed=4),
    # Sequences: promise, admission, prefill, steps, reset.
    "sequence.bin": setup(geometry=1, block=2, pages=12, layers=2, model=(0, 1))
    + op("seq_create", 0, 8, 10) + op("promise", 0, 6) + op("admit", 4, 1) + op("admit", 9, 2)
    + op("prefill", 0, 3, values(2)) + op("step", 0, values(3)) + op("step", 0, values(4))
    + op("prefill", 0, 4, values(5, "nan", 9)) + op("promise", 0, 23)
    + op("prefill", 0, 0, values(1)) + op("seq_reset", 0) + op("prefill", 0, 4, values(6))
    + op("param_update", 1, 2, 0, 0) + op("step", 0, values(1)) + op("seq_destroy", 0),
    # The decoder on two threads, chaining layers with next_half: two
    # sequences compete for the last pages, then a batch naming one sequence
    # twice is refused.
    "decoder.bin": setup(geometry=0, block=1, pages=5, layers=2, model=(2, 0), threads=2,
                         base=4)
    + op("seq_create", 0, 8, 8) + op("seq_create", 1, 8, 8)
    + b"".join(op("decoder", 3, 0, values(i), values(i + 1)) for i in range(4))
    + op("decoder", 1, 0xF0, values(3)) + op("seq_destroy", 1)
    + op("decoder", 1, 0, values(8)),
    # Sharing: publish a prefix, fork mid-block (copy-on-write on both
    # sides), truncate, adopt the published blocks into a new sequence, let
    # them go evictable, evict them under pressure, and miss after an update.
    "sharing.bin": setup(geometry=1, block=2, pages=12, layers=2, model=(2, 1))
    + op("seq_create", 0, 8, 12) + op("prefill", 0, 4, values(2)) + op("step", 0, values(3))
    + op("publish", 0, 4) + op("fork", 0, 1) + op("step", 1, values(4))
    + op("step", 0, values(5)) + op("seq_truncate", 1, 3)
    + op("seq_create", 2, 8, 12) + op("adopt", 2, 9, 0) + op("step", 2, values(6))
    + op("seq_destroy", 0) + op("seq_destroy", 1) + op("publish", 2, 5) + op("seq_destroy", 2)
    + op("seq_create", 0, 8, 12) + op("prefill", 0, 4, values(7))
    + op("prefill", 0, 4, values(8)) + op("prefill", 0, 4, values(9))
    + op("seq_create", 1, 8, 12) + op("publish", 0, 11) + op("adopt", 1, 9, 0) + op("seq_destroy", 0)
    + op("param_update", 0, 1, 1, 5) + op("seq_create", 2, 8, 12) + op("adopt", 2, 10, 0),
    # Borrowed pages in a full 2-page pool: a prepare borrows the oldest
    # cached page (block 0 of prompt 2), a prefill of the same prompt borrows
    # and evicts the other one and publishes the same key meanwhile, so the
    # discarded ticket's page goes free; an adopt finds the new page.
    "borrowed.bin": setup(geometry=0, block=1, pages=2, layers=1, model=(0, 1))
    + op("seq_create", 0, 8, 8) + op("prefill", 0, 1, values(2)) + op("publish", 0, 0)
    + op("seq_create", 1, 8, 8) + op("prefill", 1, 1, values(3)) + op("publish", 1, 0)
    + op("seq_destroy", 0) + op("seq_destroy", 1)
    + cache(0) + op("ticket_create", 0, 0) + prepare("prepare", 0, 0, seed=4)
    + op("seq_create", 0, 8, 8) + op("prefill", 0, 1, values(2)) + op("publish", 0, 0)
    + op("discard", 0)
    + op("seq_create", 1, 8, 8) + op("adopt", 1, 8, 0) + op("seq_destroy", 0)
    + op("seq_destroy", 1) + prepare("prepare", 0, 0, seed=5) + op("ticket_destroy", 0),
}
for _dtype in DTYPES:
    SCRIPTS[f"paged_{_dtype}.bin"] = paged_script(_dtype)
# A layer-bound fp8 cache (H 4 over H_kv 1, K/V scales 0.25 and 3.7) filled by
# forward steps at the fast level, then read by kvp_paged_attention at both
# levels; the world's model at the fast level too.
SCRIPTS["paged_bound_fp8.bin"] = (
    setup(threads=2) + op("paged", PAGED["layer"]) + paged_pool("fp8", group=4, pages=10)
    + bytes([0, 2 + 5 * 4]) + paged("layer", 3, 0)
    + pcache(0, bound=True, batch=2, cap=7) + pcache(1, k_scale=0.25, v_scale=3.7)
    + b"".join(paged("forward", 0, pvalues(i)) for i in range(4))
    + pattend(0, candidate=True) + pattend(0, fast=True, candidate=True)
    + pattend(0, f32=True) + pattend(0, 2, fast=True, scale=2)
    + paged("layer", 1, 0) + paged("forward", 0, pvalues(9)) + pattend(0)
    + prows("append", 0, "f32") + paged("reserve", 0, 1) + paged("write", 0, 0)
    + op("set_accum", 0x11) + op("seq_create", 0, 8, 8) + op("step", 0, values(3))
    + op("set_accum", 0x10) + op("step", 0, values(4)) + op("set_accum", 0x0E))
# Two bf16 caches racing for a 4-page pool: reservations and appends exhausted.
SCRIPTS["paged_exhaustion.bin"] = (
    setup() + op("paged", PAGED["cache_create"]) + paged_pool("bf16", block=1, pages=4)
    + bytes([0, 1, 0, 1 + 2 * 6]) + pcache(1, batch=2, cap=7)
    + paged("reserve", 0, 2) + paged("reserve", 1, 3) + prows("append", 1, "f16", 2)
    + pwrite(0) + pcommit_written(0, 1) + paged("commit_written", 0, 3)
    + prows("append", 1, "bf16", 1) + paged("reserve", 1, 0) + pattend(0, fast=True)
    + pattend(1, fast=True, candidate=True) + paged("cache_end", 0, 0) + paged("reserve", 1, 0))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(here, "corpus")
    os.makedirs(out, exist_ok=True)
    for name, data in sorted(SCRIPTS.items()):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
        print(f"{name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
