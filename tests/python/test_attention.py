"""One layer's attention steps over a Layer.cache() cache (include/kvpager/attention.h):
Layer.forward, Layer.prepare + kvpager.Ticket (commit, discard, result), Layer.reference,
Layer.set_accum and set_kv_scales. Outputs are compared bit for bit with the C
reference (kvp_attention_reference(_stored)) and with a one-layer Sequence; every error
is checked to change nothing (pool stats and digest, the cache's digest)."""
import gc
import threading

import numpy as np
import pytest

import kvpager
from conftest import state

WIDTH, HEADS, KV_HEADS, HEAD_WIDTH = 8, 4, 2, 2


def make_pool(dtype="f64", pages=64):
    return kvpager.Pool(block_tokens=4, heads=KV_HEADS, head_width=HEAD_WIDTH,
                        budget_bytes=pages * 2 * KV_HEADS * 4 * HEAD_WIDTH * 8, dtype=dtype)


def make_layer(seed=5, maxpos=32):
    return kvpager.Layer.random(WIDTH, HEADS, maxpos, seed=seed, kv_heads=KV_HEADS)


def tokens(batch, n, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, n, WIDTH))


def run(layer, cache, x):
    return np.concatenate([layer.forward(cache, x[:, t:t + 1]) for t in range(x.shape[1])],
                          axis=1)


@pytest.mark.parametrize("dtype", ["f64", "f32", "bf16", "f16"])
def test_forward_equals_the_c_reference_bit_for_bit(dtype):
    pool = make_pool(dtype)
    layer = make_layer()
    cache = layer.cache(pool, batch_size=2, capacity=16)
    x = tokens(2, 9)
    out = run(layer, cache, x)
    ref, k, v = layer.reference(x, dtype=None if dtype == "f64" else dtype)
    assert out.shape == (2, 9, WIDTH) and np.isfinite(out).all()
    assert np.array_equal(out, ref)            # attention.h: equal bit for bit
    assert np.array_equal(cache.keys(), k) and np.array_equal(cache.values(), v)
    assert cache.len == 9 and cache.info()["mapped_pages"] == 2 * 3
    if dtype == "f64":
        assert np.array_equal(layer.reference(x, dtype="f64")[0], ref)
    else:  # the stored rows were rounded: the f64 reference differs a little
        full = layer.reference(x)[0]
        assert not np.array_equal(full, ref) and np.allclose(full, ref, rtol=0.1, atol=0.1)
    pool.audit()


def test_forward_equals_a_one_layer_sequence():
    pool = make_pool()
    layer = make_layer(seed=11)
    model = kvpager.Model.create([[layer.param(i) for i in range(4)]], HEADS, 32,
                                 kv_heads=KV_HEADS)
    x = tokens(1, 6, seed=3)
    with kvpager.Sequence(model, pool, 1, 16) as s:
        expect = np.concatenate([s.step(x[:, t:t + 1]) for t in range(6)], axis=1)
        seq_keys = s.cache(0).keys()
    cache = layer.cache(pool, capacity=16)
    # a sequence's output is the residual stream x + attention(x) (sequence.h)
    assert np.array_equal(x + run(layer, cache, x), expect)
    assert np.array_equal(cache.keys(), seq_keys)
    cache.close()
    model.close()
    pool.audit()


def test_prepare_commit_discard_and_result():
    pool = make_pool()
    layer = make_layer()
    cache = layer.cache(pool, batch_size=2, capacity=16)
    x = tokens(2, 6, seed=1)
    ref = layer.reference(x)[0]
    run(layer, cache, x[:, :4])                 # a block boundary: the next row needs pages
    before = state(pool, cache)
    t = layer.prepare(cache, x[:, 4:5])
    assert isinstance(t, kvpager.Ticket)
    r = t.result()
    assert np.array_equal(r["output"][:, 0], ref[:, 4])
    assert r["weights"].shape == (2, HEADS, 1, 5)
    assert np.allclose(r["weights"].sum(axis=-1), 1.0)
    assert (r["position"], r["keys"], r["reserved_pages"], r["committed"]) == (4, 5, 2, False)
    assert (r["full_prefix_rows_per_projection"], r["incremental_rows_per_projection"],
            r["reused_key_value_rows"]) == (5, 1, 4)
    assert cache.digest() == before[2][0][0] and cache.len == 4   # prepare changes no cache
    assert pool.stats()["held_pages"] == before[0]["held_pages"] + 2   # held for the commit
    t.discard()
    t.discard()                                 # idempotent
    after = state(pool, cache)                  # its pages went back (taken, then released)
    assert after[0]["acquires"] == before[0]["acquires"] + 2
    assert after[0]["releases"] == before[0]["releases"] + 2
    for k in ("acquires", "releases", "high_water_pages"):
        after[0][k] = before[0][k]
    assert after == before
    before = state(pool, cache)
    with pytest.raises(kvpager.TicketEmpty):
        t.commit(cache)
    assert state(pool, cache) == before
    layer.prepare(cache, x[:, 4:5], ticket=t)   # a ticket is reused
    t.commit(cache)
    assert cache.len == 5 and t.result()["committed"] is True
    with pytest.raises(kvpager.TicketEmpty):    # committed once
        t.commit(cache)
    assert np.array_equal(layer.forward(cache, x[:, 5:6], ticket=t)[:, 0], ref[:, 5])
    assert np.array_equal(cache.keys(), layer.reference(x)[1])
    t.close()
    t.close()
    with pytest.raises(ValueError, match="closed"):
        t.result()
    with kvpager.Ticket(cache) as t2:
        assert not t2.closed
        with pytest.raises(kvpager.TicketEmpty):
            t2.result()
    assert t2.closed
    pool.audit()


def test_ticket_refusals_change_nothing():
    pool = make_pool()
    layer = make_layer()
    a = layer.cache(pool, batch_size=2, capacity=16)
    b = layer.cache(pool, batch_size=2, capacity=16)
    x = tokens(2, 3, seed=2)
    t = layer.prepare(a, x[:, :1])
    before = state(pool, a, b)
    with pytest.raises(kvpager.TicketForeignCache):
        t.commit(b)
    with pytest.raises(kvpager.TicketBusy):     # it holds a prepared row
        layer.prepare(b, x[:, :1], ticket=t)
    with pytest.raises(kvpager.TicketBusy):
        layer.forward(b, x[:, :1], ticket=t)
    assert state(pool, a, b) == before
    layer.forward(a, x[:, 1:2])                 # the cache moved on: the ticket is stale
    before = state(pool, a, b)
    with pytest.raises(kvpager.TicketStale):
        t.commit(a)
    assert state(pool, a, b) == before
    t.discard()
    small = layer.cache(pool, batch_size=1, capacity=16)
    before = state(pool, a, b)
    with pytest.raises(kvpager.TicketGeometryMismatch):
        layer.prepare(a, x[:, :1], ticket=kvpager.Ticket(small))
    with pytest.raises(TypeError):
        layer.prepare(a, x[:, :1], ticket="not a ticket")
    assert state(pool, a, b) == before
    pool.audit()


def test_step_errors_change_nothing():
    pool = make_pool(pages=8)
    layer = make_layer()
    other = make_layer(seed=6)
    cache = layer.cache(pool, batch_size=2, capacity=8)
    x = tokens(2, 5, seed=4)
    run(layer, cache, x[:, :3])
    bad = x[:, :1].copy()
    bad[1, 0, 3] = np.nan
    ext = kvpager.Cache(pool, batch_size=2, capacity=8)
    cases = [
        (kvpager.InputWidthMismatch, cache, tokens(2, 1)[:, :, :6]),
        (kvpager.InputRank, cache, x[:, 0]),
        (kvpager.SingleTokenRequired, cache, x[:, :2]),
        (kvpager.InputBatchMismatch, cache, x[:1, :1]),
        (kvpager.NonFiniteProjection, cache, bad),
        (kvpager.CacheLayerMismatch, other.cache(pool, batch_size=2, capacity=8), x[:, :1]),
        # an external cache's binding record is the pre-0.2 one: query heads = KV heads
        (kvpager.CacheModelWidthMismatch, ext, x[:, :1]),
    ]
    for cls, c, inp in cases:
        before = state(pool, cache, c)
        for call in (layer.forward, layer.prepare):
            with pytest.raises(cls):
                call(c, inp)
            assert state(pool, cache, c) == before, cls
    stale = make_layer(seed=7)
    sc = stale.cache(pool, batch_size=2, capacity=8)
    stale.update_param(1, stale.param(1) * 0.5)
    before = state(pool, sc)
    with pytest.raises(kvpager.CacheLayerRevisionMismatch):
        stale.forward(sc, x[:, :1])
    assert state(pool, sc) == before
    windowed = make_layer(seed=8)
    wc = windowed.cache(pool, batch_size=2, capacity=8)
    windowed.set_window(4)
    before = state(pool, wc)
    with pytest.raises(kvpager.CacheWindowMismatch) as e:
        windowed.forward(wc, x[:, :1])
    assert e.value.what == "window" and state(pool, wc) == before
    pool.audit()


def test_full_and_pool_exhausted_change_nothing():
    pool = make_pool(pages=4)                   # 4 pages: two blocks of two lanes
    layer = make_layer()
    cache = layer.cache(pool, batch_size=2, capacity=9)
    x = tokens(2, 10, seed=5)
    run(layer, cache, x[:, :8])
    assert pool.stats()["free_pages"] == 0
    before = state(pool, cache)
    with pytest.raises(kvpager.PoolExhausted) as e:
        layer.forward(cache, x[:, 8:9])
    assert e.value.needed == 2
    after = state(pool, cache)
    assert after[0]["exhaustions"] == before[0]["exhaustions"] + 1   # status.h's one counter
    after[0]["exhaustions"] -= 1
    assert after == before
    small = make_pool()
    full = layer.cache(small, capacity=2)
    run(layer, full, x[:1, :2])
    before = state(small, full)
    with pytest.raises(kvpager.Full):
        layer.forward(full, x[:1, 2:3])
    assert state(small, full) == before
    pool.audit()
    small.audit()


def test_views_die_with_a_step_and_block_it_while_exported():
    pool = make_pool()
    layer = make_layer()
    cache = layer.cache(pool, capacity=16)
    x = tokens(1, 3, seed=6)
    run(layer, cache, x[:, :2])
    view = cache.page_view(0, 0)
    arr = np.asarray(view)
    assert np.array_equal(arr[0], cache.keys()[0])   # keys then values, the rows held
    before = state(pool, cache)
    with pytest.raises(BufferError):
        layer.forward(cache, x[:, 2:3])
    t = layer.prepare(cache, x[:, 2:3])              # prepare only reads: allowed
    with pytest.raises(BufferError):
        t.commit(cache)
    t.discard()
    assert state(pool, cache) == before
    del arr
    layer.forward(cache, x[:, 2:3])
    with pytest.raises(kvpager.PageNotHeld):
        np.asarray(view)
    assert np.array_equal(run(layer, layer.cache(pool, capacity=16), x), layer.reference(x)[0])


def test_sequence_caches_change_only_through_their_sequence():
    pool = make_pool()
    layer = make_layer()
    model = kvpager.Model.random(1, WIDTH, HEADS, 32, kv_heads=KV_HEADS)
    with kvpager.Sequence(model, pool, 1, 16) as s:
        with pytest.raises(TypeError):
            layer.forward(s.cache(0), tokens(1, 1))
        with pytest.raises(kvpager.CacheLayerMismatch):   # not this layer's
            layer.prepare(s.cache(0), tokens(1, 1))
    model.close()


def test_accum_and_kv_scales():
    layer = make_layer()
    assert layer.info()["accum"] == "exact"
    x = tokens(1, 9, seed=7)
    pool = make_pool("f32")
    exact = run(layer, layer.cache(pool, capacity=16), x)
    layer.set_accum("fast")
    assert layer.info()["accum"] == "fast"
    fast = run(layer, layer.cache(pool, capacity=16), x)
    assert np.allclose(fast, exact, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        layer.set_accum("medium")
    assert layer.info()["accum"] == "fast"
    layer.set_accum("exact")
    assert np.array_equal(run(layer, layer.cache(pool, capacity=16), x), exact)
    fp8 = make_pool("fp8_e4m3")
    ref1 = layer.reference(x, dtype="fp8_e4m3")
    for k, v, arg in ((0.0, 1.0, "k_scale"), (1.0, float("inf"), "v_scale")):
        with pytest.raises(kvpager.InvalidArgument) as e:
            layer.set_kv_scales(k, v)
        assert e.value.argument == arg
    assert all(np.array_equal(a, b) for a, b in zip(layer.reference(x, dtype="fp8_e4m3"), ref1))
    layer.set_kv_scales(0.5, 0.25)
    ref2, k2, v2 = layer.reference(x, dtype="fp8_e4m3")
    assert not np.array_equal(ref2, ref1[0])
    c = layer.cache(fp8, capacity=16)
    assert np.array_equal(run(layer, c, x), ref2)
    assert np.array_equal(c.keys(), k2) and np.array_equal(c.values(), v2)
    with pytest.raises(ValueError):
        layer.reference(x, dtype="f8")


def test_reference_errors():
    layer = make_layer(maxpos=8)
    with pytest.raises(kvpager.ReferenceInputShape):
        layer.reference(tokens(1, 2)[:, :, :5])
    with pytest.raises(kvpager.ReferenceInputShape):
        layer.reference(np.zeros((2, WIDTH)))
    with pytest.raises(kvpager.RopePositionOutOfRange):
        layer.reference(tokens(1, 9))
    bad = tokens(1, 3)
    bad[0, 2, 0] = np.inf
    with pytest.raises(kvpager.NonFiniteProjection) as e:
        layer.reference(bad)
    assert e.value.token == 2


def test_ticket_holds_its_pool_gc_in_any_order():
    for order in range(3):
        pool = make_pool()
        layer = make_layer()
        cache = layer.cache(pool, batch_size=2, capacity=8)
        t = layer.prepare(cache, tokens(2, 1))    # holds 2 pages for its commit
        assert t.result()["reserved_pages"] == 2
        with pytest.raises(kvpager.PoolBusy):
            pool.close()
        objs = [pool, layer, cache, t]
        del pool, layer, cache, t
        if order == 1:
            objs.reverse()
        elif order == 2:
            objs = objs[2:] + objs[:2]
        while objs:
            objs.pop(0)
            gc.collect()
    pool = make_pool()
    layer = make_layer()
    cache = layer.cache(pool, capacity=8)
    t = layer.prepare(cache, tokens(1, 1))
    cache.close()                                   # the ticket still holds its pages
    assert pool.stats()["held_pages"] == 1
    with pytest.raises(ValueError, match="closed"):
        t.commit(cache)
    t.close()                                       # and gives them back
    assert pool.stats()["held_pages"] == 0
    pool.audit()
    pool.close()


def test_layer_changes_refused_while_it_computes_on_a_thread():
    """Two threads step their own caches of one pool through one layer and a third
    runs the layer's full-prefix reference over 2048 tokens (tens of milliseconds),
    all with the GIL released; the main thread meanwhile keeps trying to change the
    layer. Pass condition, under any scheduling: each thread's outputs equal the C
    reference bit for bit (so no change ever overlapped a computation), and every
    change attempt either ran while no computation did (and then changed nothing: it
    re-set the same window) or raised RuntimeError ("in use")."""
    pool = make_pool(pages=128)
    layer = make_layer(maxpos=2048)
    xs = [tokens(2, 24, seed=40 + i) for i in range(2)]
    refs = [layer.reference(x)[0] for x in xs]
    long_x = tokens(1, 2048, seed=42)
    long_ref = layer.reference(long_x)[0]
    barrier = threading.Barrier(4)
    got, errors = [None, None, None], []

    def stepper(i):
        try:
            with layer.cache(pool, batch_size=2, capacity=24) as c:
                barrier.wait()
                got[i] = run(layer, c, xs[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def referencer():
        try:
            barrier.wait()
            got[2] = layer.reference(long_x)[0]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=stepper, args=(i,)) for i in range(2)]
    threads.append(threading.Thread(target=referencer))
    for t in threads:
        t.start()
    barrier.wait()
    refused = 0
    while any(t.is_alive() for t in threads):
        try:
            layer.set_window(0)
        except RuntimeError as e:
            assert "in use" in str(e)
            refused += 1
    for t in threads:
        t.join()
    assert errors == []
    for i in range(2):
        assert np.array_equal(got[i], refs[i])
    assert np.array_equal(got[2], long_ref)
    assert layer.info()["window"] == 0
    assert pool.stats()["held_pages"] == 0
    pool.audit()
    print("refused", refused)  # with -s: how often the main thread found the layer busy
