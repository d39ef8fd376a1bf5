"""Zero-copy views of pages and block tables: the page's dtype, strides into
the slab, valid only while the cache is unchanged."""
import numpy as np
import pytest

import kvpager
from conftest import rows, state


def test_page_view_is_the_page(pool):
    c = kvpager.Cache(pool, batch_size=2, capacity=16)
    k, v = rows(2, 2, 6, 8)
    c.append_rows(k, v)
    for lane in range(2):
        table = np.asarray(c.block_table(lane))
        assert table.dtype == np.uint32 and table.shape == (2,)
        for block, page in enumerate(table):
            view = c.page_view(lane, block)
            assert view.page == page
            a = np.asarray(view)
            lo, hi = 4 * block, min(4 * block + 4, 6)
            assert a.shape == (2, 2, hi - lo, 8)
            assert np.array_equal(a[0], k[lane, :, lo:hi]) and np.array_equal(a[1], v[lane, :, lo:hi])
            assert not a.flags.writeable
            with pytest.raises(ValueError):
                a[0, 0, 0, 0] = 1.0
            del a
        del table
    c.close()


def test_page_view_zero_copy_address(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=8)
    c.append_rows(*rows(1, 2, 4, 8))
    a = np.asarray(c.page_view(0, 0))
    b = np.asarray(c.page_view(0, 0))
    # the same memory, not two copies
    assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    assert a.strides == (2 * 4 * 8 * 8, 4 * 8 * 8, 8 * 8, 8)  # values, head, row, element
    del a, b
    c.close()


def test_released_view_raises(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=16)
    c.append_rows(*rows(1, 2, 5, 8))
    page = c.page_view(0, 1)
    table = c.block_table(0)
    assert page.valid and table.valid
    c.truncate(4)  # releases block 1's page
    assert not page.valid and not table.valid
    with pytest.raises(kvpager.PageNotHeld) as e:
        np.asarray(page)
    assert e.value.what == "released" and e.value.index == page.page
    with pytest.raises(kvpager.PageNotHeld):
        memoryview(table)
    with pytest.raises(kvpager.PageNotHeld):
        page.numpy()
    # a new view is fine
    assert np.asarray(c.block_table(0)).shape == (1,)
    c.close()
    with pytest.raises(kvpager.PageNotHeld):
        np.asarray(table)


def test_exported_view_blocks_changes(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=16)
    k, v = rows(1, 2, 5, 8)
    c.append_rows(k, v)
    view = c.page_view(0, 0)
    a = np.asarray(view)
    assert view.exports == 1
    before = state(pool, c)
    for change in (lambda: c.append_rows(k, v), lambda: c.truncate(1), c.reset, c.close,
                   lambda: c.reserve_rows(1), c.fork):
        with pytest.raises(BufferError):
            change()
    assert state(pool, c) == before and not c.closed and view.valid
    assert np.array_equal(a[0], k[0, :, :4])
    del a
    assert view.exports == 0
    c.truncate(1)
    assert not view.valid
    c.close()


@pytest.mark.parametrize("dtype,np_dtype", [("f64", np.float64), ("f32", np.float32),
                                            ("bf16", np.uint16), ("f16", np.float16),
                                            ("fp8_e4m3", np.uint8)])
def test_view_dtype(dtype, np_dtype):
    with kvpager.Pool(block_tokens=4, heads=1, head_width=4, budget_bytes=1 << 12,
                      dtype=dtype) as p:
        c = kvpager.Cache(p, batch_size=1, capacity=8)
        k = np.array([1.0, -2.0, 0.5, 3.0] * 3).reshape(1, 1, 3, 4)
        c.append_rows(k, -k)
        a = np.asarray(c.page_view(0, 0))
        assert a.dtype == np_dtype and a.shape == (2, 1, 3, 4)
        if dtype == "bf16":  # the top 16 bits of the binary32 (exact here)
            expect = (k.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            assert np.array_equal(a[0], expect[0])
        elif dtype != "fp8_e4m3":
            assert np.array_equal(a[0].astype(np.float64), k[0])
            assert np.array_equal(a[1].astype(np.float64), -k[0])
        del a
        assert np.array_equal(c.keys(), k)
        c.close()


def test_empty_block_table(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=8)
    assert np.asarray(c.block_table(0)).shape == (0,)
    with pytest.raises(kvpager.OutOfRange):
        c.block_table(1)
    with pytest.raises(kvpager.OutOfRange):
        c.page_view(0, 0)
    c.close()
