"""The scheduler's second tier from Python (include/kvpager/scheduler.h, 6.): the
tier_loads and tier_prefetch config, every tier_* counter of Scheduler.stats(), and
HostTier(keys_only=True) under an allocator-only scheduler over a pool without data. Two
schedulers on two pools (the same key secret) share one tier: the second serves the
first's prompt from it, outputs bit-identical, counters exact (the values
tests/test_scheduler_tier.c asserts of the C stats for the same workload). Also the step
stats' sliding_held_pages and the pool's window_releases."""
import numpy as np
import pytest

import kvpager

SECRET = bytes(range(1, 33))
KEYS = bytes(range(40, 72))
WIDTH = 16
BLOCK = 4
LAYERS = 2
PROMPT = 33                    # 8 full blocks adoptable: (33 - 1) / 4
NEW_TOKENS = 3
ROWS = np.random.default_rng(3).standard_normal((64, WIDTH)) * 0.5
OTHER = np.random.default_rng(4).standard_normal((64, WIDTH)) * 0.5


@pytest.fixture
def model():
    m = kvpager.Model.random(LAYERS, WIDTH, 2, 64, seed=4)
    yield m
    m.close()


def data_pool():
    return kvpager.Pool(block_tokens=BLOCK, heads=2, head_width=8, budget_bytes=64 * 1024,
                        key_secret=KEYS)


def block_bytes(pool):
    return pool.tier_stats()["block_bytes"]


def serve(sched, requests):
    """Submits (rows, prompt_tokens) requests at once, steps until all finished; returns the
    outputs of each (position -> row) and the step dicts."""
    outs = [dict() for _ in requests]
    ids = []
    for i, (rows, n) in enumerate(requests):
        def on_token(rid, sample, pos, out, i=i):
            outs[i][pos] = out.copy()
        ids.append(sched.submit(rows[:n], max_new_tokens=NEW_TOKENS,
                                input=lambda rid, smp, pos, rows=rows: rows[pos],
                                on_token=on_token))
    steps = []
    for _ in range(200):
        steps.append(sched.step())
        if sched.stats()["uncollected"] == len(requests):
            break
    res = sorted(sched.collect(), key=lambda r: r["id"])
    assert [r["id"] for r in res] == ids and all(r["status"] == "Ok" for r in res)
    return outs, steps


def same_outputs(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y) and all(np.array_equal(x[p], y[p]) for p in x)


TIER_KEYS = ("tier_hit_blocks", "tier_hit_tokens", "tier_load_bytes", "tier_load_seconds",
             "tier_rejected", "tier_errors", "tier_recomputes", "tier_bytes_per_second",
             "prefill_tokens_per_second", "tier_prefetches", "tier_prefetch_used",
             "tier_prefetch_late", "tier_prefetch_wasted")


def test_second_pool_reads_the_first_ones_blocks(model):
    tier = kvpager.HostTier(1 << 20)
    runs = []
    for _ in range(2):
        pool = data_pool()
        pool.attach_tier(tier, SECRET, write_through=True)
        d = kvpager.Decoder(1)
        with kvpager.Scheduler(model, pool, d, capacity=64, tier_loads="always",
                               tier_prefetch=0) as s:
            outs, steps = serve(s, [(ROWS, PROMPT)])
            runs.append((outs, steps, s.stats(), pool.tier_stats(), block_bytes(pool)))
        pool.audit()
        pool.close()
        d.close()
    (o1, steps1, one, _, _), (o2, steps2, two, t2, bb) = runs
    same_outputs(o1, o2)
    for k in TIER_KEYS:
        assert k in one and k in two, k
    assert one["tier_hit_blocks"] == 0 and one["tier_load_bytes"] == 0
    assert two["tier_hit_blocks"] == 8 and two["tier_hit_tokens"] == 8 * BLOCK
    assert two["tier_load_bytes"] == 8 * LAYERS * bb and t2["loads"] == 8 * LAYERS
    assert two["prefix_hit_tokens"] == 8 * BLOCK
    assert two["prefill_tokens"] == one["prefill_tokens"] - 8 * BLOCK
    assert two["tier_rejected"] == 0 and two["tier_errors"] == 0
    assert two["tier_recomputes"] == 0
    assert two["tier_load_seconds"] > 0.0 and two["tier_bytes_per_second"] > 0.0
    assert one["tier_bytes_per_second"] == 0.0 and one["prefill_tokens_per_second"] > 0.0
    assert all(two[k] == 0 for k in ("tier_prefetches", "tier_prefetch_used",
                                     "tier_prefetch_late", "tier_prefetch_wasted"))
    assert two["stale_preemptions"] == 0
    for st in steps1 + steps2:                             # no sliding layers
        assert st["sliding_held_pages"] == 0
    tier.close()


def test_tier_loads_never_and_another_secret(model):
    tier = kvpager.HostTier(1 << 20)
    got = []
    for loads, secret in (("always", SECRET), ("never", SECRET),
                          ("always", bytes(reversed(SECRET)))):
        pool = data_pool()
        pool.attach_tier(tier, secret, write_through=True)
        d = kvpager.Decoder(1)
        with kvpager.Scheduler(model, pool, d, capacity=64, tier_loads=loads,
                               tier_prefetch=0) as s:
            outs, _ = serve(s, [(ROWS, PROMPT)])
            got.append((outs, s.stats()))
        pool.close()
        d.close()
    (o1, one), (o2, never), (o3, foreign) = got
    same_outputs(o1, o2)
    same_outputs(o1, o3)
    assert never["tier_hit_blocks"] == 0 and never["tier_rejected"] == 0
    assert never["prefill_tokens"] == one["prefill_tokens"]
    assert foreign["tier_hit_blocks"] == 0
    assert foreign["tier_rejected"] == 8 * LAYERS          # every page of every block asked
    assert foreign["prefill_tokens"] == one["prefill_tokens"]
    tier.close()


def test_prefetch_while_waiting(model):
    """A request waiting behind max_running=1 that the cache-aware window ranks has its
    missed blocks prefetched (scheduler.h, 6.); the host tier completes at once, so at its
    admission the prefetch is mapped: used, not late, no second get."""
    tier = kvpager.HostTier(1 << 20)
    pool = data_pool()
    pool.attach_tier(tier, SECRET, write_through=True)
    d = kvpager.Decoder(1)
    with kvpager.Scheduler(model, pool, d, capacity=64, tier_loads="always") as s:
        first, _ = serve(s, [(ROWS, PROMPT)])
    pool.close()
    pool = data_pool()
    pool.attach_tier(tier, SECRET, write_through=True)
    with kvpager.Scheduler(model, pool, d, capacity=64, tier_loads="always",
                           max_running=1, cache_aware=True) as s:
        outs, steps = serve(s, [(OTHER, 20), (ROWS, PROMPT)])   # the second waits
        st = s.stats()
    same_outputs(first, outs[1:])
    assert steps[0]["waiting"] == 1
    assert st["tier_prefetches"] == 1 and st["tier_prefetch_used"] == 1
    assert st["tier_prefetch_late"] == 0 and st["tier_prefetch_wasted"] == 0
    assert st["tier_hit_blocks"] == 8
    pool.audit()
    pool.close()
    d.close()
    tier.close()


def test_keys_only_tier_under_an_allocator_only_scheduler():
    keys_tier = kvpager.HostTier(1 << 20, keys_only=True)
    assert keys_tier.keys_only and keys_tier.name == "host-keys"
    runs = []
    for _ in range(2):
        pool = kvpager.Pool(block_tokens=BLOCK, heads=2, head_width=8, budget_bytes=64 * 1024,
                            slab_source="reserved", key_secret=KEYS)
        pool.attach_tier(keys_tier, SECRET, write_through=True)
        with kvpager.Scheduler(None, pool, None, capacity=64, compute=False, layers=LAYERS,
                               model_width=WIDTH, identity=11, tier_loads="model") as s:
            ids = [s.submit(ROWS[:PROMPT], max_new_tokens=NEW_TOKENS)]
            for _ in range(20):
                s.step()
            res = s.collect()
            assert [r["id"] for r in res] == ids and res[0]["status"] == "Ok"
            runs.append((s.stats(), pool.tier_stats()))
        pool.audit()
        pool.close()
    (one, t1), (two, t2) = runs
    assert one["tier_hit_blocks"] == 0 and t1["writes"] > 0
    assert two["tier_hit_blocks"] == 8 and two["tier_hit_tokens"] == 8 * BLOCK
    assert two["prefix_hit_tokens"] == 8 * BLOCK and t2["loads"] == 8 * LAYERS
    assert two["tier_bytes_per_second"] == 0.0             # nothing read: no rate measured
    hs = keys_tier.stats()
    assert hs["hits"] == 8 * LAYERS and hs["puts"] == t1["writes"] + t2["writes"]
    keys_tier.close()


def test_bad_config_and_attach_change_nothing(model):
    pool = data_pool()
    d = kvpager.Decoder(1)
    before = pool.stats()
    with pytest.raises(ValueError, match="tier_loads"):
        kvpager.Scheduler(model, pool, d, capacity=64, tier_loads="sometimes")
    with pytest.raises(TypeError):
        kvpager.Scheduler(model, pool, d, capacity=64, tier_loads=1)
    with pytest.raises(kvpager.InvalidArgument) as e:
        kvpager.Scheduler(model, pool, d, capacity=64, tier_prefetch=17)
    assert e.value.argument == "tier_prefetch"
    assert pool.stats() == before
    keys_tier = kvpager.HostTier(1 << 20, keys_only=True)
    hs = keys_tier.stats()
    with pytest.raises(kvpager.InvalidArgument) as e:      # a pool with data refuses it
        pool.attach_tier(keys_tier, SECRET)
    assert e.value.argument == "tier" and keys_tier.stats() == hs
    with pytest.raises(kvpager.InvalidArgument):
        pool.tier_stats()                                  # nothing attached
    with pytest.raises(kvpager.ZeroSize):
        kvpager.HostTier(0, keys_only=True)
    assert pool.stats() == before
    keys_tier.close()                                      # nothing holds it
    pool.close()                                           # no scheduler holds it
    d.close()


def test_window_releases():
    pool = kvpager.Pool(block_tokens=BLOCK, heads=2, head_width=8, budget_bytes=64 * 1024)
    layer = kvpager.Layer.random(WIDTH, 2, 64, seed=5)
    layer.set_window(4)
    cache = layer.cache(pool, batch_size=2, capacity=16)
    assert pool.stats()["window_releases"] == 0
    x = np.random.default_rng(6).standard_normal((2, 12, WIDTH)) * 0.5
    for t in range(12):
        layer.forward(cache, x[:, t:t + 1])
    # len 12, window 4: blocks [0, 4) and [4, 8) lie below 12 - 4, released in both lanes
    s = pool.stats()
    assert s["window_releases"] == 2 * 2 and s["held_pages"] == 2
    pool.audit()
    cache.close()
    layer.close()
