"""Pool and Cache: config, stats, audit, rows, reservations, fork, truncate,
publish/adopt, closing and garbage collection in any order."""
import gc

import numpy as np
import pytest

import kvpager
from conftest import rows, state


def test_pool_config_and_stats():
    with kvpager.Pool(block_tokens=8, heads=4, head_width=16, budget_bytes=1 << 20,
                      dtype="f32") as p:
        s = p.stats()
        page = 2 * 4 * 8 * 16 * 4
        assert s["page_bytes"] == page
        assert s["total_pages"] == (1 << 20) // page == s["free_pages"]
        assert s["dtype"] == "f32" and s["element_bytes"] == 4
        assert s["held_pages"] == 0 and s["acquires"] == 0
        lay = p.page_layout()
        assert lay["values_offset_bytes"] == page // 2 and lay["row_stride_bytes"] == 64
        assert p.admit(1) == "now" and p.admit(s["total_pages"] + 1) == "never"
        assert isinstance(p.digest(), int)
    assert p.closed
    with pytest.raises(ValueError):
        p.stats()
    p.close()  # twice: nothing


def test_pool_bad_arguments():
    with pytest.raises(ValueError):
        kvpager.Pool(dtype="f8")
    with pytest.raises(ValueError):
        kvpager.Pool(heads=-1)
    with pytest.raises(kvpager.ZeroSize):
        kvpager.Pool(head_width=0)


def test_append_and_read_back(pool):
    c = kvpager.Cache(pool, batch_size=2, capacity=16, identity=7, revision=3)
    k, v = rows(2, 2, 6, 8)
    c.append_rows(k, v)
    assert c.len == 6 and c.capacity == 16
    assert np.array_equal(c.keys(), k) and np.array_equal(c.values(), v)
    info = c.info()
    assert info["kind"] == "external" and info["identity"] == 7 and info["revision"] == 3
    assert info["mapped_pages"] == 2 * 2
    s = pool.stats()
    assert s["held_pages"] == 4 and s["acquires"] == 4 and s["attached_caches"] == 1
    # Lists and non-contiguous arrays are converted once to float64.
    k2, v2 = rows(2, 2, 3, 8, seed=2)
    c.append_rows(k2.tolist(), np.asfortranarray(v2))
    assert np.array_equal(c.keys()[:, :, 6:], k2) and np.array_equal(c.values()[:, :, 6:], v2)
    pool.audit()
    c.close()
    assert pool.stats()["held_pages"] == 0


def test_append_typed_rows_f32_in_place():
    with kvpager.Pool(block_tokens=4, heads=1, head_width=4, budget_bytes=1 << 12,
                      dtype="f32") as p:
        c = kvpager.Cache(p, batch_size=1, capacity=8)
        k, v = rows(1, 1, 5, 4, dtype=np.float32)
        c.append_rows(k, v)  # stored bit for bit (cache.h, append_rows_typed)
        assert np.array_equal(c.keys(), k.astype(np.float64))
        assert np.asarray(c.page_view(0, 0)).dtype == np.float32
        c.close()


def test_reserve_commit_discard(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=16)
    before = state(pool, c)
    c.reserve_rows(6)
    assert c.reserved_rows == 6 and pool.stats()["tentative_pages"] == 2
    k, v = rows(1, 2, 6, 8)
    with pytest.raises(kvpager.RowsReserved):
        c.append_rows(k, v)
    with pytest.raises(kvpager.RowsReserved):
        c.reserve_rows(1)
    c.discard_rows()
    assert state(pool, c) == before  # reserve + discard changes no counter
    c.reserve_rows(6)
    c.commit_rows(k[:, :, :4], v[:, :, :4])
    assert c.len == 4 and c.reserved_rows == 2
    mid = state(pool, c)
    with pytest.raises(kvpager.RowsNotReserved) as e:
        c.commit_rows(k[:, :, :3], v[:, :, :3])
    assert e.value.tokens == 3 and e.value.available == 2
    assert state(pool, c) == mid
    c.commit_rows(k[:, :, 4:], v[:, :, 4:])
    assert np.array_equal(c.keys(), k)
    c.close()


def test_fork_truncate_and_sharing(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=16)
    k, v = rows(1, 2, 6, 8)
    c.append_rows(k, v)
    child = c.fork()
    assert child.len == 6 and pool.stats()["held_pages"] == 2  # shared
    assert np.array_equal(np.asarray(child.block_table(0)), np.asarray(c.block_table(0)))
    k2, v2 = rows(1, 2, 1, 8, seed=5)
    child.append_rows(k2, v2)  # copy-on-write of the partial page
    assert pool.stats()["cow_copies"] == 1
    assert np.array_equal(c.keys(), k)
    before = state(pool, c, child)
    with pytest.raises(kvpager.OutOfRange) as e:
        c.truncate(7)
    assert e.value.argument == "new_len"
    assert state(pool, c, child) == before
    c.truncate(2)
    assert c.len == 2 and np.array_equal(c.keys(), k[:, :, :2])
    pool.audit()
    # close in any order: the parent first
    c.close()
    assert np.array_equal(child.keys()[:, :, :6], k)
    child.close()
    assert pool.stats()["held_pages"] == 0


def test_publish_and_adopt(pool):
    a = kvpager.Cache(pool, batch_size=1, capacity=16)
    k, v = rows(1, 2, 8, 8)
    a.append_rows(k, v)
    key0 = a.block_key(k[:, :, :4].tobytes())
    key1 = a.block_key(k[:, :, 4:8].tobytes(), key0)
    a.publish_block(0, 0, key0)
    a.publish_block(0, 1, key1)
    with pytest.raises(kvpager.OutOfRange):
        a.publish_block(0, 2, key1)  # not a full block
    b = kvpager.Cache(pool, batch_size=1, capacity=16)
    assert b.adopt_prefix([key0, key1, (1, 2)]) == 2
    assert b.len == 8 and np.array_equal(b.keys(), k)
    s = pool.stats()
    assert s["prefix_hits"] == 2 and s["prefix_misses"] == 1 and s["cached_pages"] == 2
    assert np.array_equal(np.asarray(b.block_table(0)), np.asarray(a.block_table(0)))
    # another binding (revision): its own keys differ (a miss), and a key
    # made by the other cache is refused, changing nothing
    c2 = kvpager.Cache(pool, batch_size=1, capacity=16, revision=1)
    assert c2.block_key(k[:, :, :4].tobytes()) != key0
    assert c2.adopt_prefix([c2.block_key(k[:, :, :4].tobytes())]) == 0
    before = state(pool, c2)
    with pytest.raises(kvpager.BlockBindingMismatch) as e:
        c2.adopt_prefix([key0])
    assert e.value.position == 0
    assert state(pool, c2) == before
    c2.close()
    a.close()
    b.close()
    assert pool.stats()["evictable_pages"] == 2
    pool.audit()


def test_pool_busy_changes_nothing(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=8)
    k, v = rows(1, 2, 2, 8)
    c.append_rows(k, v)
    before = state(pool, c)
    with pytest.raises(kvpager.PoolBusy) as e:
        pool.close()
    assert e.value.attached_caches == 1 and e.value.held_pages == 1
    assert not pool.closed and state(pool, c) == before
    c.close()


def test_cache_keeps_pool_alive_gc_any_order():
    p = kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=1 << 14)
    c = kvpager.Cache(p, batch_size=1, capacity=8)
    child = c.fork()
    k, v = rows(1, 2, 3, 8)
    c.append_rows(k, v)
    bt = c.block_table(0)
    del p  # the caches hold it
    gc.collect()
    assert c.pool.stats()["attached_caches"] == 2
    del c  # the view holds the cache
    gc.collect()
    assert np.asarray(bt).shape == (1,)
    pool = child.pool
    del bt
    assert pool.stats()["attached_caches"] == 1
    del child
    assert pool.stats()["attached_caches"] == 0 and pool.stats()["held_pages"] == 0
    pool.close()


def test_closed_cache_raises(pool):
    with kvpager.Cache(pool, batch_size=1, capacity=8) as c:
        pass
    assert c.closed
    with pytest.raises(ValueError):
        c.keys()
    with pytest.raises(ValueError):
        c.append_rows(*rows(1, 2, 1, 8))
    c.close()


def test_cache_creation_errors(pool):
    with pytest.raises(kvpager.ZeroBatchSize):
        kvpager.Cache(pool, batch_size=0, capacity=8)
    with pytest.raises(kvpager.ZeroCapacity):
        kvpager.Cache(pool, batch_size=1, capacity=0, max_positions=8)
    with pytest.raises(kvpager.CapacityExceedsPositions):
        kvpager.Cache(pool, batch_size=1, capacity=9, max_positions=8)
    assert pool.stats()["attached_caches"] == 0


def test_promise_and_pages_for(pool):
    c = kvpager.Cache(pool, batch_size=2, capacity=16)
    assert c.pages_for(5) == 4
    c.promise(4)
    assert pool.stats()["promised_pages"] == 4
    with pytest.raises(kvpager.OutOfRange):
        c.promise(9)
    assert pool.stats()["promised_pages"] == 4
    c.close()
    assert pool.stats()["promised_pages"] == 0
