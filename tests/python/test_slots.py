"""Writing reserved rows in place (include/kvpager/cache.h, "Writing in place"):
Cache.reserve_rows, Cache.reserved_slots (writable zero-copy views of the slots) and
Cache.commit_written. Rows written through the views equal rows appended with
append_rows; every refusal changes nothing; the views die with the next change."""
import numpy as np
import pytest

import kvpager
from conftest import rows, state


@pytest.mark.parametrize("dtype,np_dtype", [("f64", np.float64), ("f32", np.float32),
                                            ("f16", np.float16)])
def test_written_rows_equal_appended_rows(dtype, np_dtype):
    pool = kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=1 << 16,
                        dtype=dtype)
    k, v = rows(2, 2, 7, 8, seed=3, dtype=np_dtype)
    ref = kvpager.Cache(pool, batch_size=2, capacity=16)
    ref.append_rows(k[:, :, :2], v[:, :, :2])
    ref.append_rows(k[:, :, 2:], v[:, :, 2:])
    c = kvpager.Cache(pool, batch_size=2, capacity=16)
    c.append_rows(k[:, :, :2], v[:, :, :2])
    c.reserve_rows(5)                               # rows 2..6: slots 2, 3 of block 0, then 0..2
    for lane in range(2):
        spans = c.reserved_slots(lane)
        assert [(s["row"], s["rows"]) for s in spans] == [(0, 2), (2, 3)]
        for s in spans:
            a = np.asarray(s["view"])
            assert a.flags.writeable and a.shape == (2, 2, s["rows"], 8)
            lo = 2 + s["row"]
            a[0] = k[lane, :, lo:lo + s["rows"]]
            a[1] = v[lane, :, lo:lo + s["rows"]]
            del a
    table = c.block_table(0)
    assert np.asarray(table).size == 1               # the reserved pages are not mapped yet
    c.commit_written(5)
    with pytest.raises(kvpager.PageNotHeld):         # the commit changed the cache
        np.asarray(table)
    assert c.len == 7 and c.reserved_rows == 0
    assert np.array_equal(c.keys(), ref.keys()) and np.array_equal(c.values(), ref.values())
    with pytest.raises(kvpager.PageNotHeld):
        np.asarray(spans[0]["view"])                 # died with the commit
    pool.audit()


def test_refusals_change_nothing(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=16)
    assert c.reserved_slots(0) == []                 # no reservation: no spans
    c.reserve_rows(3)
    before = state(pool, c)
    with pytest.raises(kvpager.OutOfRange):
        c.reserved_slots(1)
    with pytest.raises(ValueError):
        c.reserved_slots(-1)
    with pytest.raises(kvpager.RowsNotReserved):
        c.commit_written(4)
    assert state(pool, c) == before
    (span,) = c.reserved_slots(0)
    a = np.asarray(span["view"])
    a[...] = 1.0
    a[1, 0, 2, 5] = np.nan                           # row 2's value, head 0, feature 5
    with pytest.raises(BufferError):                 # the writer still holds its array
        c.commit_written(3)
    with pytest.raises(BufferError):
        c.discard_rows()
    del a
    before = state(pool, c)
    with pytest.raises(kvpager.NonFiniteValue) as e:
        c.commit_written(3)
    assert e.value.index == (0 * 2 + 0) * 3 * 8 + 2 * 8 + 5
    assert state(pool, c) == before and c.reserved_rows == 3
    c.commit_written(2)                              # the two finite rows
    assert c.len == 2 and c.reserved_rows == 1
    assert np.array_equal(c.keys(), np.ones((1, 2, 2, 8)))
    (span,) = c.reserved_slots(0)                    # renumbered from the new len
    assert (span["row"], span["rows"]) == (0, 1)
    c.discard_rows()
    assert c.reserved_rows == 0 and c.len == 2
    layer = kvpager.Layer.random(16, 2, 32)
    lc = layer.cache(pool, capacity=8)
    with pytest.raises(kvpager.CacheLayerBound):
        lc.reserved_slots(0)
    model = kvpager.Model.random(1, 16, 2, 32)
    with kvpager.Sequence(model, pool, 1, 8) as s:
        with pytest.raises(TypeError):
            s.cache(0).commit_written(0)
    model.close()
    c.close()
    lc.close()
    pool.audit()


def test_bf16_slots_take_bits_and_read_views_stay_read_only():
    pool = kvpager.Pool(block_tokens=4, heads=1, head_width=4, budget_bytes=1 << 14,
                        dtype="bf16")
    c = kvpager.Cache(pool, batch_size=1, capacity=8)
    c.reserve_rows(2)
    (span,) = c.reserved_slots(0)
    a = np.asarray(span["view"])
    assert a.dtype == np.uint16 and span["view"].writable
    a[0] = 0x3F80                                    # 1.0 in bf16
    a[1] = 0xC000                                    # -2.0
    del a
    c.commit_written(2)
    assert np.array_equal(c.keys(), np.ones((1, 1, 2, 4)))
    assert np.array_equal(c.values(), np.full((1, 1, 2, 4), -2.0))
    view = c.page_view(0, 0)
    assert not view.writable
    assert not np.asarray(view).flags.writeable
    assert memoryview(view).readonly
    import ctypes
    with pytest.raises((BufferError, TypeError)):   # a writable export is refused
        (ctypes.c_char * 8).from_buffer(view)
