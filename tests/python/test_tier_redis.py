"""kvpager.RedisTier (include/kvpager/tier_redis.h) from Python, against a redis-server
this file starts itself on a free loopback port (stopped at the end; the tests fail, never
skip, when it cannot start). A pool writes blocks to the server (evictions, or publishes
under write-through); a second pool with its own RedisTier (another "process") loads them,
rows bit-identical, counters exact; another secret is rejected and counted. Also: a
server that is down (failures counted) and bad arguments (typed errors, nothing changed)."""
import os
import shutil
import socket
import subprocess
import tempfile
import time

import numpy as np
import pytest

import kvpager
from conftest import rows, state
from tier_helpers import BATCH, SECRET, published, small_pool


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ping(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_server(tmp):
    """(process, port) of a redis-server ready on 127.0.0.1; pytest.fail otherwise."""
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    why = "redis-server not found (scripts/deps.sh installs it)"
    for _ in range(5):  # another process may take the port between probe and bind
        port = free_port()
        conf = os.path.join(tmp, "redis.conf")
        with open(conf, "w") as f:
            f.write("bind 127.0.0.1\nport %d\nsave \"\"\nappendonly no\ndir %s\n"
                    "logfile %s/redis.log\ndaemonize no\n" % (port, tmp, tmp))
        try:
            # setpriv: the server gets KILL if this process dies without its teardown
            pre = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
            proc = subprocess.Popen(pre + [exe, conf], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as e:
            why = "cannot run %s: %s" % (exe, e)
            break
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            if ping(port):
                return proc, port
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        why = "redis-server on port %d did not answer PING" % port
    pytest.fail(why)


@pytest.fixture(scope="module")
def redis_url():
    tmp = tempfile.mkdtemp(prefix="kvp-pyredis-")
    proc = None
    try:
        proc, port = start_server(tmp)
        yield "redis://127.0.0.1:%d" % port
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


_spaces = iter(range(1 << 30))


def name_space():
    """A name space of its own per tier group, so tests never see each other's blocks."""
    return "t%d-%d" % (os.getpid(), next(_spaces))


def pages(cache):
    return [np.array(cache.page_view(lane, j)) for lane in range(BATCH) for j in range(2)]


def test_write_back_eviction_then_load_in_another_pool(redis_url):
    ns = name_space()
    tier = kvpager.RedisTier(redis_url, name_space=ns, ttl_seconds=600)
    assert tier.name == "redis" and not tier.keys_only
    pool = small_pool()
    pool.attach_tier(tier, SECRET)
    a, k, v, keys = published(pool)
    a.close()                                              # 4 published pages, evictable
    filler = kvpager.Cache(pool, batch_size=BATCH, capacity=32)
    filler.append_rows(*rows(BATCH, 2, 16, 8, seed=9))     # all 8 pages: the 4 evicted
    t = pool.tier_stats()
    assert t["writes"] == 4 and t["write_failures"] == 0
    tier.flush(5000)
    r = tier.stats()
    assert r["puts"] == 4 and r["writes"] == 4 and r["queued"] == 0
    assert r["bytes_written"] == 4 * t["block_bytes"]
    assert r["queue_drops"] == 0 and r["write_errors"] == 0 and r["errors"] == 0
    filler.close()
    pool.audit()
    # another "process": its own pool (same key secret) and its own connection
    other_tier = kvpager.RedisTier(redis_url, name_space=ns)
    other = small_pool()
    other.attach_tier(other_tier, SECRET)
    b = kvpager.Cache(other, batch_size=BATCH, capacity=16, identity=5)
    assert kvpager.group_tier_load([b], keys) == (2, None)
    assert b.len == 8
    for lane in range(BATCH):
        for j in range(2):
            page = np.asarray(b.page_view(lane, j))
            assert np.array_equal(page[0], k[lane, :, 4 * j:4 * (j + 1)])
            assert np.array_equal(page[1], v[lane, :, 4 * j:4 * (j + 1)])
    o = other.tier_stats()
    assert o["loads"] == 4 and o["load_bytes"] == 4 * o["block_bytes"]
    assert o["misses"] == 0 and o["rejected"] == 0 and o["load_failures"] == 0
    r = other_tier.stats()
    assert r["hits"] == 4 and r["misses"] == 0 and r["bytes_read"] == 4 * o["block_bytes"]
    assert r["lookups"] == r["hits"] and r["errors"] == 0 and r["puts"] == 0
    # keys nobody wrote: misses, counted, nothing changes
    c = kvpager.Cache(other, batch_size=BATCH, capacity=16, identity=5)
    before = state(other, c)
    assert kvpager.group_tier_load([c], [(1, 2), (3, 4)]) == (0, None)
    assert other.tier_stats()["misses"] == o["misses"] + 2
    assert other_tier.stats()["misses"] == r["misses"] + 2
    assert state(other, c) == before
    other.audit()
    del page                                               # the last view's export
    b.close()
    c.close()
    for p in (pool, other):
        p.close()
    tier.close()
    other_tier.close()


def test_write_through_rows_identical_and_wrong_secret_rejected(redis_url):
    ns = name_space()
    tier = kvpager.RedisTier(redis_url, name_space=ns)
    pool = small_pool(16)
    pool.attach_tier(tier, SECRET, write_through=True)
    a, k, v, keys = published(pool)
    assert pool.tier_stats()["writes"] == 4                # written when published
    tier.flush(5000)
    assert tier.stats()["writes"] == 4
    # a second pool, the same secrets: every page bit-identical to the writer's
    second = small_pool(16)
    second_tier = kvpager.RedisTier(redis_url, name_space=ns)
    second.attach_tier(second_tier, SECRET)
    b = kvpager.Cache(second, batch_size=BATCH, capacity=16, identity=5)
    assert kvpager.group_tier_load([b], keys) == (2, None)
    for x, y in zip(pages(a), pages(b)):
        assert x.shape == (2, 2, 4, 8) and np.array_equal(x, y)
    assert second.tier_stats()["loads"] == 4
    # another deployment secret: every block fails its MAC, is counted, never mapped
    third = small_pool(16)
    third_tier = kvpager.RedisTier(redis_url, name_space=ns)
    third.attach_tier(third_tier, bytes(reversed(SECRET)))
    c = kvpager.Cache(third, batch_size=BATCH, capacity=16, identity=5)
    before = state(third, c)
    assert kvpager.group_tier_load([c], keys) == (0, "TierBlockRejected")
    t = third.tier_stats()
    assert t["rejected"] >= 1 and t["rejected_mac"] == t["rejected"]
    assert t["loads"] == 0 and t["load_bytes"] == 0
    assert third_tier.stats()["hits"] >= 1                 # the server had them: rejected here
    assert state(third, c) == before
    # another name space: the server holds nothing there
    fourth = small_pool(16)
    fourth_tier = kvpager.RedisTier(redis_url, name_space=name_space())
    fourth.attach_tier(fourth_tier, SECRET)
    d = kvpager.Cache(fourth, batch_size=BATCH, capacity=16, identity=5)
    assert kvpager.group_tier_load([d], keys) == (0, None)
    assert fourth.tier_stats()["misses"] == 4 and fourth.tier_stats()["rejected"] == 0
    for p in (pool, second, third, fourth):
        p.audit()


def test_pool_holds_its_redis_tier_alive(redis_url):
    tier = kvpager.RedisTier(redis_url, name_space=name_space())
    pool = small_pool()
    pool.attach_tier(tier, SECRET)
    with pytest.raises(RuntimeError, match="attached"):
        tier.close()
    del tier                                               # the pool keeps it
    a, _, _, _ = published(pool)
    assert pool.tier_stats()["writes"] == 0
    a.close()
    pool.close()                                           # detaches, then frees the tier
    with kvpager.RedisTier(redis_url) as t:
        assert not t.closed
    assert t.closed
    with pytest.raises(ValueError, match="closed"):
        t.stats()
    with pytest.raises(ValueError, match="closed"):
        t.flush()


def test_unreachable_server_counts_failures():
    """A server that is down fails batches (counted), not the create nor the pool."""
    port = free_port()                                     # nothing listens there
    tier = kvpager.RedisTier("redis://127.0.0.1:%d" % port, connect_timeout_ms=200,
                             command_timeout_ms=200, backoff_min_ms=0)
    pool = small_pool(16)
    pool.attach_tier(tier, SECRET, write_through=True)
    a, k, v, keys = published(pool)
    assert pool.tier_stats()["writes"] == 4
    tier.flush(5000)
    r = tier.stats()
    assert r["writes"] == 0 and r["write_errors"] == 4 and r["errors"] >= 1
    b = kvpager.Cache(pool, batch_size=BATCH, capacity=16, identity=5)
    before = state(pool, b)
    assert kvpager.group_tier_load([b], [(1, 2), (3, 4)]) == (0, "TierUnavailable")
    assert pool.tier_stats()["load_failures"] == 2
    assert state(pool, b) == before
    pool.audit()


def test_bad_arguments_raise_typed_errors(redis_url):
    with pytest.raises(kvpager.InvalidArgument) as e:
        kvpager.RedisTier("http://127.0.0.1:1")
    assert e.value.argument == "url" and e.value.what == "scheme"
    with pytest.raises(kvpager.InvalidArgument) as e:
        kvpager.RedisTier("redis://127.0.0.1:99999")
    assert e.value.argument == "url" and e.value.what == "port"
    with pytest.raises(kvpager.InvalidArgument) as e:
        kvpager.RedisTier("redis://u:s3cret@127.0.0.1:x")
    assert "s3cret" not in str(e.value)                    # never the password's text
    with pytest.raises(kvpager.InvalidArgument) as e:
        kvpager.RedisTier(redis_url, name_space="no spaces")
    assert e.value.argument == "name_space"
    with pytest.raises(kvpager.InvalidArgument) as e:
        kvpager.RedisTier(redis_url, backoff_min_ms=500, backoff_max_ms=100)
    assert e.value.argument == "backoff_min_ms"            # min <= max is the rule broken
    with pytest.raises(ValueError):
        kvpager.RedisTier(redis_url, connect_timeout_ms=-1)
    with pytest.raises(ValueError):
        kvpager.RedisTier(redis_url, ttl_seconds=1 << 40)
    with pytest.raises(TypeError):
        kvpager.RedisTier(None)
    # attach refusals change nothing: the pool's state, the tier's counters
    tier = kvpager.RedisTier(redis_url, name_space=name_space())
    reserved = small_pool(slab_source="reserved")
    before = (reserved.stats(), tier.stats())
    with pytest.raises(kvpager.InvalidArgument) as e:      # a pool without data
        reserved.attach_tier(tier, SECRET)
    assert e.value.argument == "pool"
    with pytest.raises(kvpager.InvalidArgument):
        reserved.tier_stats()                              # still no tier
    assert (reserved.stats(), tier.stats()) == before
    tier.close()                                           # nothing holds it
