"""kvpager.Layer: one attention layer (include/kvpager/layer.h): create, random,
info, set_window, param, update_param, close; every error changes nothing."""
import gc

import numpy as np
import pytest

import kvpager


def weights(d=8, kvw=8, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in ((d, d), (d, kvw), (d, kvw), (d, d))]


def test_random_info_and_determinism():
    a = kvpager.Layer.random(8, 2, 32, seed=7)
    b = kvpager.Layer.random(8, 2, 32, seed=7)
    c = kvpager.Layer.random(8, 2, 32, seed=8)
    assert a.info() == {"model_width": 8, "heads": 2, "kv_heads": 2, "head_width": 4,
                        "window": 0, "sink_tokens": 0, "accum": "exact"}
    for i in range(4):
        assert a.param(i).shape == (8, 8)
        assert np.array_equal(a.param(i), b.param(i))
    assert not np.array_equal(a.param(0), c.param(0))
    g = kvpager.Layer.random(8, 4, 32, kv_heads=2)
    assert g.info()["kv_heads"] == 2 and g.info()["head_width"] == 2
    assert g.param(1).shape == (8, 4) and g.param(3).shape == (8, 8)


def test_create_keeps_the_weights():
    w = weights(8, 4)
    layer = kvpager.Layer.create(w, 4, 16, kv_heads=2)
    assert layer.info()["kv_heads"] == 2 and layer.info()["model_width"] == 8
    for i in range(4):
        assert np.array_equal(layer.param(i), w[i])
    layer.param(0)[0, 0] = 99.0  # a copy
    assert layer.param(0)[0, 0] == w[0][0, 0]
    # integer and float32 inputs convert once to float64
    ints = [x.astype(np.int32) for x in weights(8, 8)]
    assert np.array_equal(kvpager.Layer.create(ints, 2, 16).param(2), ints[2].astype(float))


def test_create_errors():
    with pytest.raises(kvpager.ParameterWidthMismatch):
        kvpager.Layer.create(weights(8, 6), 2, 16)
    with pytest.raises(kvpager.HeadsDoNotDivideWidth):
        kvpager.Layer.create(weights(8, 8), 3, 16)
    with pytest.raises(ValueError):
        kvpager.Layer.create(weights()[:3], 2, 16)
    with pytest.raises(ValueError):
        kvpager.Layer.create(weights(), -1, 16)
    with pytest.raises(ValueError):
        kvpager.Layer.random(8, 2, -1)
    with pytest.raises(kvpager.HeadsDoNotDivideWidth):
        kvpager.Layer.random(8, 3, 16)
    with pytest.raises(kvpager.KvHeadsDoNotDivideHeads):
        kvpager.Layer.random(8, 4, 16, kv_heads=3)


def test_set_window_and_its_errors_change_nothing():
    layer = kvpager.Layer.random(8, 2, 32)
    layer.set_window(4, sink_tokens=1)
    assert (layer.info()["window"], layer.info()["sink_tokens"]) == (4, 1)
    before = layer.info()
    with pytest.raises(kvpager.InvalidArgument) as e:
        layer.set_window(33)
    assert e.value.argument == "window"
    with pytest.raises(kvpager.InvalidArgument) as e:
        layer.set_window(0, 2)
    assert e.value.argument == "sink_tokens"
    with pytest.raises(ValueError):
        layer.set_window(-1)
    assert layer.info() == before
    layer.set_window(0)
    assert (layer.info()["window"], layer.info()["sink_tokens"]) == (0, 0)


def test_update_param_and_its_errors_change_nothing():
    layer = kvpager.Layer.random(8, 2, 32, seed=3)
    w1 = layer.param(1)
    r1 = layer.update_param(1, w1 * 0.5)
    assert np.array_equal(layer.param(1), w1 * 0.5)
    r2 = layer.update_param(1, (w1 * 0.25).astype(np.float32))
    assert r2 > r1
    now = [layer.param(i) for i in range(4)]
    with pytest.raises(kvpager.ParameterWidthMismatch) as e:
        layer.update_param(1, np.zeros(3))
    assert (e.value.expected, e.value.actual) == ((8, 8), (3,))
    with pytest.raises(kvpager.OutOfRange) as e:
        layer.update_param(4, now[0])
    assert e.value.argument == "index"
    with pytest.raises(kvpager.OutOfRange):
        layer.param(-1)
    with pytest.raises(ValueError):
        layer.update_param(0, "nope")
    assert all(np.array_equal(layer.param(i), now[i]) for i in range(4))
    assert layer.update_param(1, now[1]) == r2 + 1


def test_close_and_context_manager():
    with kvpager.Layer.random(8, 2, 16) as layer:
        assert layer.info()["heads"] == 2
    for call in (layer.info, lambda: layer.param(0), lambda: layer.set_window(2),
                 lambda: layer.update_param(0, np.zeros((8, 8)))):
        with pytest.raises(Exception) as e:
            call()
        assert "closed" in str(e.value)
    layer.close()  # twice is fine


def test_gc_in_any_order():
    layers = [kvpager.Layer.random(8, 2, 16, seed=s) for s in range(5)]
    params = [l.param(0) for l in layers]
    del layers[2]
    layers.reverse()
    gc.collect()
    del layers
    gc.collect()
    assert all(p.shape == (8, 8) for p in params)  # copies outlive their layers


def small_pool():
    return kvpager.Pool(block_tokens=4, heads=2, head_width=4, budget_bytes=1 << 16)


def test_cache_bound_to_the_layer():
    pool = small_pool()
    layer = kvpager.Layer.random(8, 2, 32, seed=5)
    layer.set_window(8)
    c = layer.cache(pool, batch_size=2, capacity=16)
    i = c.info()
    assert (i["kind"], i["batch_size"], i["capacity"], i["len"]) == ("layer", 2, 16, 0)
    assert (i["kv_heads"], i["head_width"], i["max_positions"]) == (2, 4, 32)
    rev = i["revision"]
    layer.update_param(0, layer.param(0) * 2.0)
    c2 = layer.cache(pool, capacity=4)
    assert c2.info()["revision"] == rev + 1       # the binding as of its creation
    assert c.info()["revision"] == rev            # an older cache keeps its own
    rows = np.zeros((2, 2, 1, 4))
    stats = pool.stats()
    with pytest.raises(kvpager.CacheLayerBound):  # rows come only through attention
        c.append_rows(rows, rows)
    assert c.info() == i and pool.stats() == stats
    pool.audit()


def test_cache_errors_change_nothing():
    pool = small_pool()
    layer = kvpager.Layer.random(8, 2, 32)
    stats = pool.stats()
    with pytest.raises(kvpager.CapacityExceedsPositions):
        layer.cache(pool, capacity=33)
    with pytest.raises(kvpager.ZeroCapacity):
        layer.cache(pool, capacity=0)
    with pytest.raises(kvpager.GeometryMismatch):
        kvpager.Layer.random(8, 4, 32).cache(pool, capacity=4)
    with pytest.raises(ValueError):
        layer.cache(pool, capacity=-1)
    with pytest.raises(TypeError):
        layer.cache("not a pool", capacity=4)
    assert pool.stats() == stats
    assert layer.info()["heads"] == 2
    layer.close()  # no cache was left bound
    with pytest.raises(Exception, match="closed"):
        layer.cache(pool, capacity=4)


def test_cache_keeps_its_layer_alive_and_close_refuses():
    pool = small_pool()
    layer = kvpager.Layer.random(8, 2, 32, seed=9)
    w = layer.param(2)
    c = layer.cache(pool, capacity=8)
    with pytest.raises(RuntimeError, match="in use"):
        layer.close()
    assert np.array_equal(layer.param(2), w)      # still open, unchanged
    ref = layer
    del layer
    gc.collect()
    assert np.array_equal(ref.param(2), w)
    f = c.fork()                                  # a fork is bound to the layer too
    assert f.info()["kind"] == "layer"
    c.close()
    with pytest.raises(RuntimeError, match="in use"):
        ref.close()
    f.close()
    ref.close()                                   # the caches let it go
    # GC in any order: drop the layer first, then the caches, or the reverse
    for order in (0, 1):
        layer = kvpager.Layer.random(8, 2, 32)
        caches = [layer.cache(pool, capacity=4) for _ in range(3)]
        if order == 0:
            del layer
            gc.collect()
            del caches
        else:
            del caches
            gc.collect()
            layer.close()
            del layer
        gc.collect()
    pool.audit()
