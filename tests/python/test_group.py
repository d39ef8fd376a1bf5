"""Prefix sharing over a group of caches at once (include/kvpager/cache.h, "Sharing for
a group of caches"): kvpager.group_probe, group_adopt and group_publish over the layers
of one "sequence" (external caches, and Layer.cache() caches stepped by attention).
keys[(block * len(caches) + cache) * batch + lane]; every error changes nothing."""
import numpy as np
import pytest

import kvpager
from conftest import rows, state

BATCH, LAYERS, BLOCK = 2, 3, 4


def chain_keys(caches, k_rows, blocks, first=0):
    """The C layout: block j of cache c, lane `lane`, chained per (cache, lane) over the
    block's key rows."""
    keys = [None] * (blocks * len(caches) * BATCH)
    for c, cache in enumerate(caches):
        for lane in range(BATCH):
            parent = None
            for j in range(first + blocks):
                data = k_rows[c][lane, :, j * BLOCK:(j + 1) * BLOCK].tobytes()
                parent = cache.block_key(data, parent)
                if j >= first:
                    keys[((j - first) * len(caches) + c) * BATCH + lane] = parent
    return keys


def filled(pool, n, seed=0):
    caches = [kvpager.Cache(pool, batch_size=BATCH, capacity=16, identity=c)
              for c in range(LAYERS)]
    data = [rows(BATCH, 2, n, 8, seed=seed + c) for c in range(LAYERS)]
    for cache, (k, v) in zip(caches, data):
        cache.append_rows(k, v)
    return caches, data


def fresh(pool):
    return [kvpager.Cache(pool, batch_size=BATCH, capacity=16, identity=c)
            for c in range(LAYERS)]


def test_publish_probe_adopt(pool):
    src, data = filled(pool, 10)                    # 2 full blocks and a partial one
    keys = chain_keys(src, [k for k, _ in data], 2)
    assert kvpager.group_publish(src, keys) == 2
    assert pool.stats()["cached_pages"] == 2 * LAYERS * BATCH
    dst = fresh(pool)
    before = state(pool, *dst)
    assert kvpager.group_probe(dst, keys) == (2, 0)  # every page still named by src
    assert kvpager.group_probe(dst, keys[:LAYERS * BATCH]) == (1, 0)
    assert state(pool, *dst) == before               # a probe changes nothing, counters too
    hits = pool.stats()["prefix_hits"]
    assert kvpager.group_adopt(dst, keys) == 2
    assert pool.stats()["prefix_hits"] == hits + 2 * LAYERS * BATCH
    for c in range(LAYERS):
        assert dst[c].len == 8
        assert np.array_equal(dst[c].keys(), data[c][0][:, :, :8])
        assert np.array_equal(dst[c].values(), data[c][1][:, :, :8])
        for lane in range(BATCH):
            assert np.array_equal(np.asarray(dst[c].block_table(lane)),
                                  np.asarray(src[c].block_table(lane))[:2])
    for c in src:
        c.close()
    assert pool.stats()["evictable_pages"] == 0      # dst still names them
    for c in dst:
        c.close()
    assert pool.stats()["evictable_pages"] == 2 * LAYERS * BATCH
    dst = fresh(pool)
    assert kvpager.group_probe(dst, keys) == (2, 2 * LAYERS * BATCH)
    assert kvpager.group_adopt(dst, keys) == 2
    pool.audit()


def test_adopt_stops_at_the_first_block_any_cache_misses(pool):
    src, data = filled(pool, 8)
    keys = chain_keys(src, [k for k, _ in data], 2)
    kvpager.group_publish(src, keys)
    bad = list(keys)
    bad[(1 * LAYERS + 2) * BATCH + 1] = (1, 2)       # block 1 of the last cache, lane 1
    dst = fresh(pool)
    misses = pool.stats()["prefix_misses"]
    assert kvpager.group_probe(dst, bad)[0] == 1
    assert kvpager.group_adopt(dst, bad) == 1
    assert [c.len for c in dst] == [4] * LAYERS      # block 1 in none of them
    assert pool.stats()["prefix_misses"] == misses + 1
    pool.audit()


def test_group_errors_change_nothing(pool):
    src, data = filled(pool, 8)
    keys = chain_keys(src, [k for k, _ in data], 2)
    other, _ = filled(pool, 5, seed=9)              # another length
    dst = fresh(pool)
    everyone = src + other + dst
    before = state(pool, *everyone)
    with pytest.raises(kvpager.InvalidArgument) as e:
        kvpager.group_publish([src[0], other[1], src[2]], keys)
    assert e.value.argument == "caches"
    with pytest.raises(kvpager.InvalidArgument) as e:
        kvpager.group_adopt([], [])
    assert e.value.argument == "count"
    with pytest.raises(kvpager.OutOfRange) as e:    # 3 blocks, 2 full
        kvpager.group_publish(src, keys + keys[:LAYERS * BATCH])
    assert e.value.argument == "blocks"
    with pytest.raises(kvpager.NotAtBlockBoundary):
        kvpager.group_adopt(other, keys)
    with pytest.raises(ValueError):                  # not a multiple of caches * batch
        kvpager.group_adopt(dst, keys[:-1])
    with pytest.raises(TypeError):
        kvpager.group_adopt(dst, [(1,)] * len(keys))
    with pytest.raises(TypeError):
        kvpager.group_probe([dst[0], "cache"], keys)
    assert state(pool, *everyone) == before
    # a page published under another key: nothing registered in any cache
    src[2].publish_block(1, 1, (7, 7))
    before = state(pool, *everyone)
    cached = pool.stats()["cached_pages"]
    with pytest.raises(kvpager.PagePublished) as e:
        kvpager.group_publish(src, keys)
    assert e.value.layer == 2
    assert pool.stats()["cached_pages"] == cached and state(pool, *everyone) == before
    # keys made by a cache of another binding (identity): refused, not a miss
    keys0 = [keys[(j * LAYERS + 0) * BATCH + lane] for j in range(2) for lane in range(BATCH)]
    assert kvpager.group_publish([src[0]], keys0) == 2
    alien = [kvpager.Cache(pool, batch_size=BATCH, capacity=16, identity=99)]
    before = state(pool, *alien)
    with pytest.raises(kvpager.BlockBindingMismatch):
        kvpager.group_adopt(alien, keys0)
    with pytest.raises(kvpager.BlockBindingMismatch):
        kvpager.group_probe(alien, keys0)
    assert state(pool, *alien) == before
    pool.audit()


def test_views_and_sequence_caches(pool):
    src, data = filled(pool, 8)
    keys = chain_keys(src, [k for k, _ in data], 2)
    kvpager.group_publish(src, keys)
    dst = fresh(pool)
    dst[0].append_rows(*rows(BATCH, 2, 0, 8))        # zero rows: nothing changes
    table = dst[1].block_table(0)
    arr = np.asarray(table)
    before = state(pool, *dst)
    with pytest.raises(BufferError):
        kvpager.group_adopt(dst, keys)
    assert state(pool, *dst) == before
    assert kvpager.group_probe(dst, keys) == (2, 0)  # a read: allowed
    del arr
    assert kvpager.group_adopt(dst, keys) == 2
    with pytest.raises(kvpager.PageNotHeld):         # made before the adopt
        np.asarray(table)
    model = kvpager.Model.random(2, 16, 2, 32)
    with kvpager.Sequence(model, pool, BATCH, 16) as s:
        with pytest.raises(TypeError):
            kvpager.group_adopt([s.cache(0), s.cache(1)], [])
    model.close()
    pool.audit()


def test_layer_bound_caches_share_and_keep_stepping():
    """Two layers' Layer.cache() caches stepped by attention are published as a group;
    a second group adopts their prefix and continues: its outputs equal the first
    group's, bit for bit (the adopted rows are the same pages)."""
    pool = kvpager.Pool(block_tokens=BLOCK, heads=2, head_width=4, budget_bytes=1 << 18)
    layers = [kvpager.Layer.random(8, 2, 32, seed=s) for s in (1, 2)]
    x = np.random.default_rng(3).standard_normal((BATCH, 10, 8))
    a = [layer.cache(pool, batch_size=BATCH, capacity=16) for layer in layers]
    outs = []
    for t in range(10):
        h = x[:, t:t + 1]
        for layer, c in zip(layers, a):
            h = h + layer.forward(c, h)
        outs.append(h)
    keys = [None] * (2 * 2 * BATCH)
    for c, cache in enumerate(a):
        for lane in range(BATCH):
            parent = None
            for j in range(2):
                parent = cache.block_key(x[lane, j * BLOCK:(j + 1) * BLOCK].tobytes(), parent)
                keys[(j * 2 + c) * BATCH + lane] = parent
    assert kvpager.group_publish(a, keys) == 2
    b = [layer.cache(pool, batch_size=BATCH, capacity=16) for layer in layers]
    assert kvpager.group_adopt(b, keys) == 2
    for t in range(8, 10):
        h = x[:, t:t + 1]
        for layer, c in zip(layers, b):
            h = h + layer.forward(c, h)
        assert np.array_equal(h, outs[t])
    for ca, cb in zip(a, b):
        assert np.array_equal(ca.keys(), cb.keys()) and np.array_equal(ca.values(), cb.values())
    pool.audit()
