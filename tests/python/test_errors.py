"""kvpager.Error and its subclasses: one per kvp_status, with the detail fields."""
import numpy as np
import pytest

import kvpager
from conftest import rows, state


def test_one_class_per_status():
    classes = kvpager.error_classes
    assert sorted(classes) == list(range(1, len(classes) + 1))
    assert len(classes) >= 60  # OK is not an error; 1..60 at least (status.h)
    names = set()
    for status, cls in classes.items():
        assert issubclass(cls, kvpager.Error)
        assert issubclass(cls, Exception)
        assert getattr(kvpager, cls.__name__) is cls
        assert cls.__module__ == "kvpager"
        assert cls.__doc__  # kvp_status_message
        names.add(cls.__name__)
    assert len(names) == len(classes)
    assert classes[9] is kvpager.PoolExhausted
    assert classes[56] is kvpager.PageNotHeld
    assert classes[1] is kvpager.NullArgument


def test_every_error_class_can_be_raised_and_caught():
    # Each class is a real exception type, caught as itself and as Error.
    for cls in kvpager.error_classes.values():
        with pytest.raises(kvpager.Error):
            raise cls("x")


def test_detail_fields_zero_size():
    with pytest.raises(kvpager.ZeroSize) as e:
        kvpager.Pool(block_tokens=0)
    err = e.value
    assert err.status == 5 and err.name == "ZeroSize"
    assert err.argument == "block_tokens"
    assert "block_tokens" in err.message and str(err) == err.message


def test_detail_fields_budget_too_small():
    with pytest.raises(kvpager.BudgetTooSmall) as e:
        kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=100)
    assert e.value.budget_bytes == 100
    assert e.value.page_bytes == 2 * 2 * 4 * 8 * 8


def test_pool_exhausted_fields_and_nothing_changed(pool):
    total = pool.stats()["total_pages"]
    c = kvpager.Cache(pool, batch_size=2, capacity=4 * total)
    k, v = rows(2, 2, 4 * (total // 2), 8)
    c.append_rows(k, v)  # every page
    before = state(pool, c)
    k1, v1 = rows(2, 2, 1, 8, seed=1)
    with pytest.raises(kvpager.PoolExhausted) as e:
        c.append_rows(k1, v1)
    assert e.value.needed == 2 and e.value.available == 0
    after = state(pool, c)
    # the one counter a POOL_EXHAUSTED refusal changes (status.h)
    assert after[0]["exhaustions"] == before[0]["exhaustions"] + 1
    after[0]["exhaustions"] -= 1
    assert after == before
    c.close()


def test_full_fields(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=5)
    k, v = rows(1, 2, 6, 8)
    before = state(pool, c)
    with pytest.raises(kvpager.Full) as e:
        c.append_rows(k, v)
    assert e.value.what == "rows" and e.value.tokens == 6 and e.value.available == 5
    assert state(pool, c) == before
    c.close()


def test_nonfinite_key_fields(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=8)
    k, v = rows(1, 2, 3, 8)
    k[0, 1, 2, 5] = np.nan
    before = state(pool, c)
    with pytest.raises(kvpager.NonFiniteKey) as e:
        c.append_rows(k, v)
    assert e.value.index == (1 * 3 + 2) * 8 + 5
    assert state(pool, c) == before
    v[0, 0, 0, 0] = np.inf
    k[0, 1, 2, 5] = 1.0
    with pytest.raises(kvpager.NonFiniteValue) as e:
        c.append_rows(k, v)
    assert e.value.index == 0 and e.value.value == np.inf
    assert state(pool, c) == before
    c.close()


def test_shape_mismatch_fields(pool):
    c = kvpager.Cache(pool, batch_size=1, capacity=8)
    k, v = rows(1, 2, 3, 8)
    with pytest.raises(kvpager.KeyShapeMismatch) as e:
        c.append_rows(k[:, :1], v)
    assert e.value.expected == (1, 2, 3, 8) and e.value.actual == (1, 1, 3, 8)
    with pytest.raises(kvpager.ValueShapeMismatch) as e:
        c.append_rows(k, v[:, :, :2])
    assert e.value.actual == (1, 2, 2, 8)
    assert c.len == 0
    c.close()


def test_geometry_mismatch():
    with kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=1 << 16) as p:
        m = kvpager.Model.random(1, 24, 3, 16, seed=1)  # 3 heads of 8: the pool has 2
        with pytest.raises(kvpager.GeometryMismatch) as e:
            kvpager.Sequence(m, p, 1, 8)
        assert e.value.pool_geometry == (2, 8) and e.value.binding_geometry == (3, 8)
        m.close()


def test_audit_failed_is_typed():
    # AuditFailed carries mismatches and first_mismatch; a sound pool never
    # raises it, so check the class and that a clean audit returns None.
    assert issubclass(kvpager.AuditFailed, kvpager.Error)
    with kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=1 << 16) as p:
        assert p.audit() is None


def stub_blocks():
    import os
    import re
    stub = os.path.join(os.path.dirname(kvpager.__file__), "__init__.pyi")
    text = open(stub).read()
    # top-level names, and each class's body (up to the next top-level line)
    blocks = {m.group(1): m.group(2) for m in
              re.finditer(r"^class (\w+)[(:](.*?)(?=^\S)", text + "\nEND", re.S | re.M)}
    return text, blocks


def test_stub_lists_every_class_method_and_function():
    """The .pyi stub names every error class, every public class with each of
    its public methods and attributes, and every module function."""
    text, blocks = stub_blocks()
    for cls in kvpager.error_classes.values():
        assert cls.__name__ in blocks, cls
    for name in kvpager.__all__:
        obj = getattr(kvpager, name)
        if isinstance(obj, type) and issubclass(obj, kvpager.Error):
            continue
        if isinstance(obj, type):
            assert name in blocks, name
            for attr in dir(obj):
                if attr.startswith("_"):
                    continue
                # declared in the class's block or in a base class's (Tier for HostTier)
                own = [blocks[c.__name__] for c in obj.__mro__ if c.__name__ in blocks]
                assert any(("def %s(" % attr) in blk or ("%s:" % attr) in blk for blk in own), \
                    (name, attr)
        elif callable(obj):
            assert ("\ndef %s(" % name) in text, name
        else:
            assert ("\n%s:" % name) in text or name == "error_classes", name


def test_help_is_readable():
    import pydoc
    text = pydoc.render_doc(kvpager.Pool, renderer=pydoc.plaintext)
    assert "kvp_pool_create" in text and "audit" in text and "PoolBusy" in text
    for obj, words in ((kvpager.Layer, ("kvp_attention_forward", "Ticket", "reference")),
                       (kvpager.Ticket, ("kvp_ticket_commit", "TicketStale", "discard")),
                       (kvpager.group_adopt, ("kvp_cache_group_adopt", "keys")),
                       (kvpager.Cache, ("kvp_cache_append_rows", "block_table"))):
        text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
        assert all(w in text for w in words), (obj, words)
