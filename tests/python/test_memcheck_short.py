"""The short run ctest repeats under Valgrind memcheck (memcheck.python.pytest):
every class once, a failed call, a view, its release, a step."""
import numpy as np
import pytest

import kvpager


def test_short_run_under_memcheck():
    with kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=1 << 14,
                      dtype="bf16") as p:
        c = kvpager.Cache(p, batch_size=1, capacity=8)
        k = np.arange(48, dtype=np.float64).reshape(1, 2, 3, 8) / 8
        c.append_rows(k, -k)
        a = np.asarray(c.page_view(0, 0))
        assert a.dtype == np.uint16 and a.shape == (2, 2, 3, 8)
        assert int(a[0, 0, 0, 1]) == 0x3E00  # 0.125 in bf16
        del a
        with pytest.raises(kvpager.Full):
            c.append_rows(np.ones((1, 2, 9, 8)), np.ones((1, 2, 9, 8)))
        view = c.block_table(0)
        c.truncate(0)
        with pytest.raises(kvpager.PageNotHeld):
            np.asarray(view)
        c.close()
        p.audit()
    with kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=1 << 14) as p:
        m = kvpager.Model.random(1, 16, 2, 8, seed=2)
        with kvpager.Sequence(m, p, 1, 8) as s:
            out = s.prefill(np.full((1, 2, 16), 0.25))
            assert np.all(np.isfinite(out))
        m.close()
