#!/usr/bin/env python3
"""PyTorch attention reading K/V straight from kvpager pages.

A one-layer kvpager.Sequence decodes tokens with the C library's attention,
its K/V in a bf16 pool. After each step, PyTorch recomputes that token's
attention from the layer cache's block table and page views: each page is
wrapped without copying by torch.from_dlpack(view) (a torch.bfloat16
tensor over the pool's slab), widened to f64, and attended over. The result,
must equal kvp_paged_attention's over the same pages (Cache.paged_attention,
paged.h: vLLM's paged_attention), and, through W_o plus the residual, the
step's output (both to 1e-12 relative: all compute in f64 over the same
stored bf16 rows, in different summation orders).

Exit status: 0 when they match, 1 when not, 77 (ctest's skip) when torch
does not import.
Run: PYTHONPATH=<build>/python python3 examples/python/torch_block_tables.py
"""
import sys

import numpy as np

import kvpager

try:
    import torch
except ImportError:
    print("torch_block_tables: skipped: torch does not import (python3-torch)")
    sys.exit(77)

WIDTH, HEADS, CONTEXT, BLOCK, ROPE_BASE = 32, 4, 64, 4, 10000.0
HW = WIDTH // HEADS


def rope(x, position):
    d = x.shape[-1]
    theta = ROPE_BASE ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = position * theta
    cos, sin = torch.cos(angle), torch.sin(angle)
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def page_tensor(cache, lane, block):
    """The page of (lane, block) as a torch.bfloat16 tensor (2, heads, rows, d_h)
    over the pool's own memory, through DLPack: no copy."""
    view = cache.page_view(lane, block)
    t = torch.from_dlpack(view)
    assert t.dtype == torch.bfloat16
    assert t.data_ptr() == np.asarray(view).__array_interface__["data"][0]  # zero-copy
    return t


def torch_attention(cache, x, wq, position):
    """The new token's attention over every stored row, read page by page:
    (head outputs [heads, d_h], the rotated query)."""
    table = torch.from_numpy(np.asarray(cache.block_table(0)).astype(np.int64))
    pages = [page_tensor(cache, 0, b).to(torch.float64) for b in range(len(table))]
    keys = torch.cat([p[0] for p in pages], dim=1)     # (heads, len, d_h)
    values = torch.cat([p[1] for p in pages], dim=1)
    q = rope((x @ wq).reshape(HEADS, HW), position)
    scores = torch.einsum("hd,hnd->hn", q, keys) / np.sqrt(HW)
    weights = torch.softmax(scores, dim=1)
    return torch.einsum("hn,hnd->hd", weights, values), q


def main():
    model = kvpager.Model.random(1, WIDTH, HEADS, CONTEXT, rope_base=ROPE_BASE, seed=5)
    pool = kvpager.Pool(block_tokens=BLOCK, heads=HEADS, head_width=HW, budget_bytes=1 << 18,
                        dtype="bf16")
    seq = kvpager.Sequence(model, pool, batch_size=1, capacity=CONTEXT)
    wq = torch.from_numpy(model.param(0, 0))
    wo = torch.from_numpy(model.param(0, 3))
    tokens = torch.from_numpy(np.random.default_rng(3).standard_normal((10, WIDTH)) * 0.5)
    cache = seq.cache(0)
    worst = 0.0
    for t in range(len(tokens)):
        x = tokens[t]
        out = torch.from_numpy(seq.step(x.numpy().reshape(1, 1, WIDTH)).reshape(WIDTH))
        heads_out, q = torch_attention(cache, x, wq, t)
        paged = torch.from_numpy(cache.paged_attention(q.numpy()[None])[0])
        mine = x + heads_out.reshape(WIDTH) @ wo
        worst = max(worst, float(((mine - out).abs() / (out.abs() + 1e-300)).max()),
                    float(((heads_out - paged).abs() / (paged.abs() + 1e-300)).max()))
        if not torch.allclose(heads_out, paged, rtol=1e-12, atol=1e-12):
            print("token %d: torch %s != kvp_paged_attention %s" % (t, heads_out[0, :4],
                                                                   paged[0, :4]))
            return 1
        if not torch.allclose(mine, out, rtol=1e-12, atol=1e-12):
            print("token %d: torch %s != kvpager %s" % (t, mine[:4], out[:4]))
            return 1
    pool.audit()
    print("torch_block_tables: %d tokens: PyTorch attention over bf16 page views (zero-copy) "
          "equals kvp_paged_attention's and the layer's step (largest relative difference %.1e)" % (len(tokens), worst))
    del cache
    seq.close()
    model.close()
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
