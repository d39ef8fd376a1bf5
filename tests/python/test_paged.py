"""Cache.paged_attention (kvp_paged_attention): an engine's attention over
the pages, against NumPy and against the layer's own attention."""
import numpy as np
import pytest

import kvpager
from conftest import rows, state


def numpy_attention(q, keys, values, scale):
    """q [B, H, d], keys/values [B, H_kv, n, d] -> [B, H, d]."""
    b, h, d = q.shape
    group = h // keys.shape[1]
    out = np.empty_like(q)
    for lane in range(b):
        for head in range(h):
            k, v = keys[lane, head // group], values[lane, head // group]
            s = (k @ q[lane, head]) * scale
            w = np.exp(s - s.max())
            out[lane, head] = (w / w.sum()) @ v
    return out


def test_external_cache_equals_numpy(pool):
    c = kvpager.Cache(pool, batch_size=2, capacity=16)
    k, v = rows(2, 2, 7, 8)
    c.append_rows(k, v)
    q = np.random.default_rng(1).standard_normal((2, 4, 8))  # 4 query heads over 2 KV heads
    out = c.paged_attention(q)
    assert out.shape == (2, 4, 8) and out.dtype == np.float64
    assert np.allclose(out, numpy_attention(q, k, v, 1 / np.sqrt(8)), rtol=1e-12, atol=1e-14)
    # a candidate row is scored as if stored, and nothing changes
    k1, v1 = rows(2, 2, 1, 8, seed=3)
    before = state(pool, c)
    out1 = c.paged_attention(q, k1[:, :, 0], v1[:, :, 0], scale=0.5)
    assert state(pool, c) == before
    both_k, both_v = np.concatenate([k, k1], 2), np.concatenate([v, v1], 2)
    assert np.allclose(out1, numpy_attention(q, both_k, both_v, 0.5), rtol=1e-12, atol=1e-14)
    with kvpager.Decoder(2) as d:
        assert np.array_equal(d.paged_attention(c, q), out)  # same bits on threads
    q32 = q.astype(np.float32)
    out32 = c.paged_attention(q32)
    assert out32.dtype == np.float32
    assert np.allclose(out32, out, rtol=1e-5, atol=1e-6)
    c.close()


def test_errors_change_nothing(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=8)
    q = np.zeros((1, 2, 8))
    with pytest.raises(kvpager.InvalidArgument) as e:
        c.paged_attention(q)  # empty cache, no candidate
    assert e.value.argument == "keys"
    c.append_rows(*rows(1, 2, 2, 8))
    with pytest.raises(kvpager.InvalidArgument) as e:
        c.paged_attention(np.zeros((1, 3, 8)))  # 3 heads over 2 KV heads
    assert e.value.argument == "heads"
    bad = np.zeros((1, 2, 8))
    bad[0, 1, 3] = np.nan
    before = state(pool, c)
    with pytest.raises(kvpager.NonFiniteKey):
        c.paged_attention(q, bad, np.zeros((1, 2, 8)))
    with pytest.raises(kvpager.InvalidArgument) as e:
        c.paged_attention(q, np.zeros((1, 2, 8)))  # keys without values
    assert e.value.argument == "values"
    assert state(pool, c) == before
    c.close()


def test_layer_cache_equals_the_layers_attention(pool):
    """Paged attention over a sequence's layer cache with the layer's queries
    and candidate row gives the head outputs of the layer's own step: the
    step's output minus its input is (merged heads) W_o."""
    width, heads = 16, 2
    m = kvpager.Model.random(1, width, heads, 64, seed=8)
    wq, wk, wv, wo = (m.param(0, i) for i in range(4))
    d = width // heads

    def rope(x, p):
        theta = 10000.0 ** (-np.arange(0, d, 2) / d)
        c, s = np.cos(p * theta), np.sin(p * theta)
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
        return out

    with kvpager.Sequence(m, pool, 1, 16) as s:
        x = np.random.default_rng(2).standard_normal((1, 6, width)) * 0.5
        s.prefill(x[:, :5])
        lc = s.cache(0)
        t = x[0, 5]
        q = rope((t @ wq).reshape(heads, d), 5)[None]
        k = rope((t @ wk).reshape(heads, d), 5)[None]
        v = (t @ wv).reshape(heads, d)[None]
        heads_out = lc.paged_attention(q, k, v)
        del lc
        out = s.step(x[:, 5:6])[0, 0]
        assert np.allclose(heads_out.reshape(width) @ wo + t, out, rtol=1e-12, atol=1e-12)
    m.close()
