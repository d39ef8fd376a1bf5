"""What the tier tests (test_tier.py, test_tier_redis.py) share: the secrets, a small pool
and two published blocks of a two-lane cache with their chain keys."""
import kvpager
from conftest import rows

SECRET = bytes(range(1, 33))
KEYS = bytes(range(40, 72))  # the pools' key secret: pools sharing a tier agree on keys
BATCH = 2


def small_pool(pages=8, key_secret=KEYS, **kw):
    return kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=pages * 1024,
                        key_secret=key_secret, **kw)


def lane_keys(cache, k, blocks):
    """keys[j * batch + lane] (one cache), chained over each block's key rows."""
    keys = [None] * (blocks * BATCH)
    for lane in range(BATCH):
        parent = None
        for j in range(blocks):
            parent = cache.block_key(k[lane, :, 4 * j:4 * (j + 1)].tobytes(), parent)
            keys[j * BATCH + lane] = parent
    return keys


def published(pool, seed=0):
    """A cache of 2 lanes x 8 rows (2 blocks a lane) whose 4 pages are published."""
    a = kvpager.Cache(pool, batch_size=BATCH, capacity=16, identity=5)
    k, v = rows(BATCH, 2, 8, 8, seed=seed)
    a.append_rows(k, v)
    keys = lane_keys(a, k, 2)
    assert kvpager.group_publish([a], keys) == 2
    return a, k, v, keys
