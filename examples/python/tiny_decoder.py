#!/usr/bin/env python3
"""A two-layer NumPy transformer decoder that keeps its K/V in kvpager pages.

The model's weights come from a kvpager.Model (Model.random); the NumPy code
computes every projection, RoPE, attention and the residual stream itself,
appends each token's rotated keys and values to one external kvpager.Cache
per layer, and reads them back for attention through the lane's block table
and zero-copy page views (no copy of the cache per step). The same tokens go
through kvpager.Sequence (the C library's own attention), and the example
checks that:
  - the keys and values NumPy stored in its pages equal the ones the C
    library stored in its own, and
  - every output equals the C library's.
"Equal" means to 1e-12 relative: the C library sums in its documented order
(attention.h, "Math"), NumPy's matrix products in BLAS's; both are f64.

Run: PYTHONPATH=<build>/python python3 examples/python/tiny_decoder.py
Exit status 0 when everything matches.
"""
import sys

import numpy as np

import kvpager

LAYERS, WIDTH, HEADS, CONTEXT, ROPE_BASE = 2, 32, 4, 64, 10000.0
HEAD_WIDTH = WIDTH // HEADS
BLOCK = 4


def rope(x, position):
    """Rotate pairs (2i, 2i+1) of the last axis by position * base^(-2i/d) (rope.h)."""
    d = x.shape[-1]
    theta = ROPE_BASE ** (-np.arange(0, d, 2) / d)
    angle = position * theta
    cos, sin = np.cos(angle), np.sin(angle)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def gather(cache, lane):
    """The lane's keys and values [heads, len, d_h], read through the block
    table and the page views (each a zero-copy array over the pool's slab)."""
    n = cache.len
    keys = np.empty((HEADS, n, HEAD_WIDTH))
    values = np.empty((HEADS, n, HEAD_WIDTH))
    table = np.asarray(cache.block_table(lane))
    for block in range(len(table)):
        page = np.asarray(cache.page_view(lane, block))  # (2, heads, rows, d_h)
        lo = block * BLOCK
        keys[:, lo:lo + page.shape[2]] = page[0]
        values[:, lo:lo + page.shape[2]] = page[1]
        del page  # release the export before the cache changes
    del table
    return keys, values


class NumpyDecoder:
    def __init__(self, model, pool):
        self.w = [[model.param(layer, i) for i in range(4)] for layer in range(LAYERS)]
        self.caches = [kvpager.Cache(pool, batch_size=1, capacity=CONTEXT)
                       for _ in range(LAYERS)]

    def layer(self, layer, x):
        wq, wk, wv, wo = self.w[layer]
        cache = self.caches[layer]
        pos = cache.len
        q = rope((x @ wq).reshape(HEADS, HEAD_WIDTH), pos)
        k = rope((x @ wk).reshape(HEADS, HEAD_WIDTH), pos)
        v = (x @ wv).reshape(HEADS, HEAD_WIDTH)
        cache.append_rows(k.reshape(1, HEADS, 1, HEAD_WIDTH), v.reshape(1, HEADS, 1, HEAD_WIDTH))
        keys, values = gather(cache, 0)
        scores = np.einsum("hd,hnd->hn", q, keys) * (1.0 / np.sqrt(HEAD_WIDTH))
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        merged = np.einsum("hn,hnd->hd", weights, values).reshape(WIDTH)
        return merged @ wo

    def step(self, x):
        for layer in range(LAYERS):
            x = x + self.layer(layer, x)  # the residual stream (sequence.h)
        return x

    def close(self):
        for c in self.caches:
            c.close()


def main():
    tokens = np.random.default_rng(7).standard_normal((12, WIDTH)) * 0.5
    model = kvpager.Model.random(LAYERS, WIDTH, HEADS, CONTEXT, rope_base=ROPE_BASE, seed=11)
    pool = kvpager.Pool(block_tokens=BLOCK, heads=HEADS, head_width=HEAD_WIDTH,
                        budget_bytes=1 << 20)
    ours = NumpyDecoder(model, pool)
    theirs = kvpager.Sequence(model, pool, batch_size=1, capacity=CONTEXT)
    worst = 0.0
    for t, x in enumerate(tokens):
        mine = ours.step(x)
        ref = theirs.step(x.reshape(1, 1, WIDTH)).reshape(WIDTH)
        worst = max(worst, float(np.max(np.abs(mine - ref) / (np.abs(ref) + 1e-300))))
        if not np.allclose(mine, ref, rtol=1e-12, atol=1e-12):
            print("token %d: NumPy %s != kvpager %s" % (t, mine[:4], ref[:4]))
            return 1
    for layer in range(LAYERS):
        c_keys, c_values = theirs.cache(layer).keys(), theirs.cache(layer).values()
        if not (np.allclose(ours.caches[layer].keys(), c_keys, rtol=1e-12, atol=1e-12) and
                np.allclose(ours.caches[layer].values(), c_values, rtol=1e-12, atol=1e-12)):
            print("layer %d: stored rows differ" % layer)
            return 1
    pool.audit()
    stats = pool.stats()
    print("tiny_decoder: %d tokens, %d layers: NumPy over kvpager pages equals kvpager's "
          "own attention (largest relative difference %.1e); %d pages held"
          % (len(tokens), LAYERS, worst, stats["held_pages"]))
    ours.close()
    theirs.close()
    model.close()
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
