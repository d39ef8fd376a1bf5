"""The second tier from Python (include/kvpager/tier.h): kvpager.HostTier,
Pool.attach_tier / detach_tier / tier_stats and kvpager.group_tier_load. Published pages
the pool evicts (or, write-through, publishes) go to the tier as MACed blocks; a load maps
them back, verified, and the rows equal the ones written. Every error changes nothing."""
import gc

import numpy as np
import pytest

import kvpager
from conftest import rows, state
from tier_helpers import BATCH, SECRET, published, small_pool


def test_write_back_eviction_then_load():
    pool = small_pool()
    tier = kvpager.HostTier(1 << 20)
    pool.attach_tier(tier, SECRET)
    a, k, v, keys = published(pool)
    a.close()                                    # 4 published pages, evictable
    assert pool.stats()["evictable_pages"] == 4
    filler = kvpager.Cache(pool, batch_size=BATCH, capacity=32)
    filler.append_rows(*rows(BATCH, 2, 16, 8, seed=9))   # takes all 8 pages: 4 evicted
    assert pool.tier_stats()["writes"] == 4 and tier.stats()["blocks"] == 4
    filler.close()
    b = kvpager.Cache(pool, batch_size=BATCH, capacity=16, identity=5)
    assert kvpager.group_probe([b], keys) == (0, 0)       # gone from the index
    view = b.block_table(0)
    assert kvpager.group_tier_load([b], keys) == (2, None)
    with pytest.raises(kvpager.PageNotHeld):
        np.asarray(view)
    assert b.len == 8
    assert np.array_equal(b.keys(), k) and np.array_equal(b.values(), v)
    t = pool.tier_stats()
    assert t["loads"] == 4 and t["rejected"] == 0 and t["load_bytes"] == 4 * t["block_bytes"]
    c = kvpager.Cache(pool, batch_size=BATCH, capacity=16, identity=5)
    assert kvpager.group_adopt([c], keys) == 2            # loaded blocks are published again
    pool.audit()


def test_write_through_misses_and_rejections():
    tier = kvpager.HostTier(1 << 20)
    pool = small_pool(16)
    pool.attach_tier(tier, SECRET, write_through=True)
    a, k, v, keys = published(pool)
    assert pool.tier_stats()["writes"] == 4              # written when published
    b = kvpager.Cache(pool, batch_size=BATCH, capacity=16, identity=5)
    before = state(pool, b)
    misses = pool.tier_stats()["misses"]
    assert kvpager.group_tier_load([b], [(1, 2), (3, 4)]) == (0, None)   # not in the tier
    assert pool.tier_stats()["misses"] == misses + 2
    assert state(pool, b) == before
    # another pool on the same tier under another secret: every block fails its MAC
    other = small_pool(16)
    other.attach_tier(tier, bytes(reversed(SECRET)))
    o = kvpager.Cache(other, batch_size=BATCH, capacity=16, identity=5)
    before = state(other, o)
    assert kvpager.group_tier_load([o], keys) == (0, "TierBlockRejected")
    t = other.tier_stats()
    assert t["rejected"] >= 1 and t["rejected_mac"] == t["rejected"] and t["loads"] == 0
    assert state(other, o) == before
    # another key secret: the keys are not this pool's (its binding digests differ)
    fourth = small_pool(16, key_secret=None)
    fourth.attach_tier(tier, SECRET)
    f = kvpager.Cache(fourth, batch_size=BATCH, capacity=16, identity=5)
    assert kvpager.group_tier_load([f], keys) == (0, "TierBlockRejected")
    t = fourth.tier_stats()
    assert t["rejected"] >= 1 and t["rejected_binding"] == t["rejected"]
    assert f.len == 0 and f.block_key(k[0, :, :4].tobytes()) != keys[0]
    with pytest.raises(ValueError):
        small_pool(key_secret=b"short")
    # the same secrets: it loads (the binding is the same, identity 5)
    third = small_pool(16)
    third.attach_tier(tier, SECRET)
    c = kvpager.Cache(third, batch_size=BATCH, capacity=16, identity=5)
    assert kvpager.group_tier_load([c], keys) == (2, None)
    assert np.array_equal(c.keys(), k) and np.array_equal(c.values(), v)
    for p in (pool, other, third):
        p.audit()


def test_errors_change_nothing():
    pool = small_pool()
    tier = kvpager.HostTier(1 << 20)
    with pytest.raises(kvpager.ZeroSize):
        kvpager.HostTier(0)
    with pytest.raises(ValueError):
        kvpager.HostTier(-1)
    with pytest.raises(kvpager.InvalidArgument) as e:
        pool.tier_stats()
    assert e.value.argument == "pool"
    c = kvpager.Cache(pool, batch_size=BATCH, capacity=16)
    keys = [(1, 2)] * BATCH
    before = state(pool, c)
    with pytest.raises(kvpager.InvalidArgument) as e:     # no tier attached
        kvpager.group_tier_load([c], keys)
    assert e.value.argument == "pool"
    with pytest.raises(ValueError):
        pool.attach_tier(tier, b"short")
    with pytest.raises(kvpager.InvalidArgument) as e:
        pool.attach_tier(tier, bytes(32))
    assert e.value.argument == "secret"
    assert state(pool, c) == before and tier.stats()["blocks"] == 0
    pool.attach_tier(tier, SECRET)
    with pytest.raises(kvpager.InvalidArgument) as e:
        pool.attach_tier(tier, SECRET)                    # one tier per pool
    assert e.value.argument == "pool"
    c.append_rows(*rows(BATCH, 2, 3, 8))
    before = state(pool, c)
    with pytest.raises(kvpager.NotAtBlockBoundary):
        kvpager.group_tier_load([c], keys)
    a = c.block_table(0)
    arr = np.asarray(a)
    with pytest.raises(BufferError):
        kvpager.group_tier_load([c], keys)
    del arr
    assert state(pool, c) == before
    with pytest.raises(RuntimeError, match="attached"):
        tier.close()
    pool.detach_tier()
    pool.detach_tier()                                    # without a tier: nothing
    with pytest.raises(kvpager.InvalidArgument):
        pool.tier_stats()
    tier.close()
    with pytest.raises(ValueError, match="closed"):
        tier.stats()
    with pytest.raises(ValueError, match="closed"):
        pool.attach_tier(tier, SECRET)
    pool.audit()


def test_gc_in_any_order():
    for order in range(2):
        tier = kvpager.HostTier(1 << 16)
        pool = small_pool()
        pool.attach_tier(tier, SECRET)
        a, _, _, _ = published(pool)
        objs = [tier, pool, a] if order == 0 else [a, pool, tier]
        del tier, pool, a
        while objs:
            objs.pop(0)
            gc.collect()
    with kvpager.HostTier(1 << 16) as tier:
        with small_pool() as pool:
            pool.attach_tier(tier, SECRET)
        assert pool.closed                                # close() detached it
    assert tier.closed
