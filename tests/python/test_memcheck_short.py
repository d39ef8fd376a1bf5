"""The short run ctest repeats under Valgrind memcheck (memcheck.python.pytest):
every class once, a failed call, a view, its release, a step, a layer's steps
(forward, prepare + Ticket, reference), group sharing and a host tier's load."""
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
        c.reserve_rows(2)
        (span,) = c.reserved_slots(0)
        w = np.asarray(span["view"])
        w[...] = 0x3F80                     # 1.0 in bf16, written in place
        del w
        c.commit_written(2)
        assert np.array_equal(c.keys(), np.ones((1, 2, 2, 8)))
        c.close()
        p.audit()
    with kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=1 << 14) as p:
        m = kvpager.Model.random(1, 16, 2, 8, seed=2)
        with kvpager.Sequence(m, p, 1, 8) as s:
            out = s.prefill(np.full((1, 2, 16), 0.25))
            assert np.all(np.isfinite(out))
        m.close()


def test_layer_steps_and_groups_under_memcheck():
    tier = kvpager.HostTier(1 << 16)
    with kvpager.Pool(block_tokens=4, heads=2, head_width=4, budget_bytes=1 << 14,
                      dtype="f32") as p:
        p.attach_tier(tier, bytes(range(1, 33)), write_through=True)
        layer = kvpager.Layer.random(8, 2, 16, seed=4)
        x = np.linspace(-1.0, 1.0, 5 * 8).reshape(1, 5, 8)
        a = layer.cache(p, capacity=8)
        out = [layer.forward(a, x[:, t:t + 1]) for t in range(4)]
        ref = layer.reference(x, dtype="f32")[0]
        assert all(np.array_equal(o[:, 0], ref[:, t]) for t, o in enumerate(out))
        t = layer.prepare(a, x[:, 4:5])
        assert t.result()["reserved_pages"] == 1
        with pytest.raises(kvpager.TicketForeignCache):
            t.commit(layer.cache(p, capacity=8))
        t.discard()
        with pytest.raises(kvpager.InputWidthMismatch):
            layer.forward(a, np.zeros((1, 1, 3)))
        key = a.block_key(x[:, :4].tobytes())
        assert kvpager.group_publish([a], [key]) == 1
        b = layer.cache(p, capacity=8)
        assert kvpager.group_probe([b], [key]) == (1, 0)
        assert kvpager.group_adopt([b], [key]) == 1
        assert np.array_equal(b.keys(), a.keys())
        assert p.tier_stats()["writes"] == 1
        c = layer.cache(p, capacity=8)
        assert kvpager.group_tier_load([c], [key]) == (1, None)
        assert np.array_equal(c.values(), a.values())
        c.close()
        pending = layer.prepare(b, x[:, 4:5])
        a.close()
        b.close()
        del pending, t
        p.audit()
