"""Shared fixtures of the kvpager Python tests (tests/python/).

The package comes from the build tree (PYTHONPATH set by ctest: see
tests/CMakeLists.txt). Every fixture's objects are closed at teardown, and
each test's pool is audited (kvp_pool_check) before it closes.
"""
import numpy as np
import pytest

import kvpager


def state(pool, *caches):
    """What "nothing changed" compares: the pool's stats and digest, and each
    cache's digest and reserved rows."""
    return (pool.stats(), pool.digest(),
            [(c.digest(), c.reserved_rows, c.len) for c in caches])


@pytest.fixture
def pool():
    p = kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=64 * 2 * 2 * 4 * 8 * 8)
    yield p
    p.audit()


def rows(batch, heads, n, width, seed=0, dtype=np.float64):
    g = np.random.default_rng(seed)
    return (g.standard_normal((batch, heads, n, width)).astype(dtype),
            g.standard_normal((batch, heads, n, width)).astype(dtype))
