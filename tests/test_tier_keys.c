/*
 * test_tier_keys.c: the keys-only host tier (kvp_tier_host_keys_create,
 * kvpager/tier.h) and a pool without data (KVP_SLAB_RESERVED) using it:
 * the tier's LRU and byte budget with exact figures and no byte kept or
 * copied; attach refusals (a byte tier on a reserved pool, a keys-only tier
 * on a pool with data, composition) that change nothing; write-back on
 * evict and write-through on publish sending keys counted at the block
 * size; loads that map fresh pages unwritten, stop at a miss or a block of
 * the wrong size, and publish what they map. kvp_pool_check runs after
 * every operation on a pool (kvpt_assert_pool_ok).
 */
#include "tier_support.h"

#include <stdlib.h>
#include <string.h>

#include "pager/cache_internal.h"

enum { B = 2, PAGES = 8 };

/* A pool of `pages` pages of the shared geometry with no memory behind them. */
static kvp_pool *reserved_pool(size_t pages)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BT;
    config.heads = KV_HEADS;
    config.head_width = HEAD_WIDTH;
    config.budget_bytes = pages * 2 * KV_HEADS * BT * HEAD_WIDTH * sizeof(double);
    config.slab_source = KVP_SLAB_RESERVED;
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).total_pages, pages);
    assert_int_equal(kvpt_stats(pool).slab_source, KVP_SLAB_RESERVED);
    return pool;
}

static kvp_tier *keys_tier(size_t budget)
{
    kvp_tier *tier = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_host_keys_create(budget, &tier, &err), &err);
    return tier;
}

/* `rows` more rows in every lane, unwritten (as an allocator-only lease appends). */
static void grow(kvp_cache *cache, kvp_pool *pool, size_t rows)
{
    kvp_error err;
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, rows, &err), &err);
    kvpt_assert_ok(kvpi_cache_commit_unwritten(cache, rows, &err), &err);
    kvpt_assert_pool_ok(pool);
}

/* An external cache of B lanes with 2 published blocks (unwritten); keys for 3 blocks. */
static kvp_cache *published(kvp_pool *pool, kvp_block_key keys[3 * B])
{
    kvp_cache *cache = external_cache(pool, B, 1);
    grow(cache, pool, 2 * BT);
    chain_keys(cache, B, 3, 0.0, keys);
    publish_all(cache, pool, B, 2, keys);
    return cache;
}

/* Takes every page of the pool into a fresh cache (evicting the LRU list), then frees them. */
static void churn_reserved(kvp_pool *pool, size_t pages)
{
    kvp_cache *filler = external_cache(pool, 2, 99);
    for (size_t p = 0; p < pages / 2; p++) {
        grow(filler, pool, BT);
    }
    kvpt_destroy_cache(filler, pool);
}

static void assert_keys_host(kvp_tier *tier, size_t bytes, size_t blocks, uint64_t hits,
                             uint64_t misses, uint64_t puts, uint64_t evictions,
                             uint64_t rejected)
{
    kvp_tier_host_stats s = host_stats(tier);
    assert_int_equal(s.bytes, bytes);
    assert_int_equal(s.blocks, blocks);
    assert_int_equal(s.hits, hits);
    assert_int_equal(s.misses, misses);
    assert_int_equal(s.puts, puts);
    assert_int_equal(s.evictions, evictions);
    assert_int_equal(s.rejected_puts, rejected);
}

static void put_size(kvp_tier *tier, uint64_t n, size_t bytes, kvp_status expect)
{
    kvp_tier_block b;
    memset(&b, 0, sizeof b);
    b.key = (kvp_block_key){n, n * 31 + 5};
    b.bytes = bytes; /* data NULL: a keys-only tier never reads it */
    kvp_error err;
    kvpt_assert_ok(kvp_tier_run(tier, KVP_TIER_PUT, &b, 1, &err), &err);
    assert_int_equal(b.status, expect);
}

/* Its size, status OK, and buf untouched. */
static size_t get_size(kvp_tier *tier, uint64_t n)
{
    unsigned char buf[16];
    memset(buf, 0x5a, sizeof buf);
    kvp_tier_block b;
    memset(&b, 0, sizeof b);
    b.key = (kvp_block_key){n, n * 31 + 5};
    b.data = buf;
    b.capacity = 1; /* smaller than any block: a keys-only get copies nothing */
    kvp_error err;
    kvpt_assert_ok(kvp_tier_run(tier, KVP_TIER_GET, &b, 1, &err), &err);
    kvpt_assert_ok(b.status, NULL);
    for (size_t i = 0; i < sizeof buf; i++) {
        assert_int_equal(buf[i], 0x5a);
    }
    return b.bytes;
}

/* 300 bytes: three 100-byte keys fit, no byte kept; the least recent goes first. */
static void test_tier_keys_lru_and_budget(void **state)
{
    (void)state;
    kvp_tier *tier = keys_tier(300);
    kvp_tier *bytes_tier = host_tier(300);
    assert_string_equal(kvp_tier_name(tier), "host-keys");
    assert_int_equal(kvp_tier_keys_only(tier), 1);
    assert_int_equal(kvp_tier_keys_only(bytes_tier), 0);
    assert_int_equal(kvp_tier_keys_only(NULL), 0);
    for (uint64_t n = 1; n <= 3; n++) {
        put_size(tier, n, 100, KVP_OK);
    }
    assert_keys_host(tier, 300, 3, 0, 0, 3, 0, 0);
    assert_int_equal(host_stats(tier).budget_bytes, 300);
    assert_int_equal(get_size(tier, 1), 100); /* 1 is the newest now */
    assert_keys_host(tier, 300, 3, 1, 0, 3, 0, 0);
    put_size(tier, 4, 100, KVP_OK); /* drops 2 */
    assert_keys_host(tier, 300, 3, 1, 0, 4, 1, 0);
    assert_int_equal(get_size(tier, 2), 0);
    assert_keys_host(tier, 300, 3, 1, 1, 4, 1, 0);
    /* Larger than the budget, or empty: refused, nothing dropped. */
    put_size(tier, 9, 301, KVP_TIER_UNAVAILABLE);
    put_size(tier, 9, 0, KVP_TIER_UNAVAILABLE);
    assert_keys_host(tier, 300, 3, 1, 1, 4, 1, 2);
    /* Replacing 3 with 50 bytes frees 50; a 150-byte put then drops the least recent (1). */
    put_size(tier, 3, 50, KVP_OK);
    assert_keys_host(tier, 250, 3, 1, 1, 5, 1, 2);
    put_size(tier, 5, 150, KVP_OK);
    assert_keys_host(tier, 300, 3, 1, 1, 6, 2, 2);
    assert_int_equal(get_size(tier, 1), 0);
    assert_int_equal(get_size(tier, 3), 50);
    assert_int_equal(get_size(tier, 5), 150);
    assert_keys_host(tier, 300, 3, 3, 2, 6, 2, 2);
    /* It composes with nothing: refused, nothing made, nothing counted. */
    kvp_tier *both = NULL;
    kvp_error err;
    assert_int_equal(kvp_tier_compose_create(tier, bytes_tier, &both, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "near");
    assert_int_equal(kvp_tier_compose_create(bytes_tier, tier, &both, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "far");
    assert_null(both);
    assert_int_equal(kvp_tier_host_keys_create(0, &both, &err), KVP_ZERO_SIZE);
    assert_null(both);
    assert_keys_host(tier, 300, 3, 3, 2, 6, 2, 2);
    assert_keys_host(bytes_tier, 0, 0, 0, 0, 0, 0, 0);
    kvpt_assert_ok(kvp_tier_destroy(bytes_tier, &err), &err);
    kvpt_assert_ok(kvp_tier_destroy(tier, &err), &err);
}

/* Refused with `argument`, nothing changed; `had` a tier already (its counters stay 0). */
static void expect_attach_refused(kvp_pool *pool, kvp_tier *tier, const char *argument, int had)
{
    kvpt_snapshot snap;
    kvpt_snapshot_init(&snap, pool);
    kvpt_snapshot_take(&snap);
    kvp_tier_policy policy;
    kvp_tier_policy_init(&policy);
    secret_fill(policy.secret, 1);
    kvp_error err;
    assert_int_equal(kvp_pool_tier_attach(pool, tier, &policy, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, argument);
    kvpt_assert_unchanged(&snap, 0);
    kvp_pool_tier_stats s;
    kvp_pool_tier_stats_init(&s);
    if (had) {
        kvpt_assert_ok(kvp_pool_tier_stats_get(pool, &s, &err), &err);
        assert_int_equal(s.writes + s.loads + s.misses, 0);
    } else {
        assert_int_equal(kvp_pool_tier_stats_get(pool, &s, &err), KVP_INVALID_ARGUMENT);
    }
    assert_keys_host(tier, 0, 0, 0, 0, 0, 0, 0);
}

/* A reserved pool takes only a keys-only tier, a pool with data never takes one. */
static void test_tier_keys_attach_refusals(void **state)
{
    (void)state;
    kvp_pool *reserved = reserved_pool(PAGES);
    kvp_pool *data = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *bytes_tier = host_tier(1 << 20);
    kvp_tier *tier = keys_tier(1 << 20);
    expect_attach_refused(reserved, bytes_tier, "pool", 0); /* no page bytes to write */
    expect_attach_refused(data, tier, "tier", 0);           /* it would map rows unwritten */
    attach(reserved, tier, 0);
    assert_int_equal(tier_stats(reserved).block_bytes, block_bytes(reserved));
    expect_attach_refused(reserved, tier, "pool", 1); /* a tier already */
    attach(data, bytes_tier, 0);                   /* the byte path is unchanged */
    detach_and_destroy(data, bytes_tier);
    detach_and_destroy(reserved, tier);
    destroy_pool(data);
    destroy_pool(reserved);
}

/*
 * Evicted published pages of a reserved pool go to the tier as keys,
 * counted at the block size; a cache of the same binding loads them back
 * unwritten, published again (an adopter hits them); the run stops at a
 * miss, and a held key of the wrong size is rejected, never mapped.
 */
static void test_tier_keys_evict_then_load(void **state)
{
    (void)state;
    kvp_pool *pool = reserved_pool(PAGES);
    kvp_tier *tier = keys_tier(1 << 20);
    attach(pool, tier, 0);
    size_t bb = block_bytes(pool);
    assert_int_equal(bb, KVP_TIER_HEADER_BYTES + 2 * KV_HEADS * BT * HEAD_WIDTH * 8);
    kvp_block_key keys[3 * B];
    kvp_cache *a = published(pool, keys);
    kvpt_destroy_cache(a, pool);
    assert_int_equal(kvpt_stats(pool).evictable_pages, 4);
    assert_int_equal(tier_stats(pool).writes, 0); /* write-back: nothing until evicted */
    churn_reserved(pool, PAGES);
    assert_int_equal(kvpt_stats(pool).evictions, 4);
    assert_int_equal(kvpt_stats(pool).cached_pages, 0);
    kvp_pool_tier_stats ts = tier_stats(pool);
    assert_int_equal(ts.writes, 4);
    assert_int_equal(ts.write_failures, 0);
    assert_keys_host(tier, 4 * bb, 4, 0, 0, 4, 0, 0);

    kvp_cache *c = external_cache(pool, B, 1);
    kvp_pool_stats before = kvpt_stats(pool);
    size_t loaded = 0;
    kvp_status stop = KVP_FULL;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_group_tier_load(&c, 1, keys, 3, &loaded, &stop, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, 2);
    assert_int_equal(stop, KVP_OK); /* the third block was never written: a miss */
    assert_int_equal(kvp_cache_len(c), 2 * BT);
    ts = tier_stats(pool);
    assert_int_equal(ts.loads, 4);
    assert_int_equal(ts.load_bytes, 4 * bb); /* what a byte tier would have moved */
    assert_int_equal(ts.misses, B);
    assert_int_equal(ts.rejected, 0);
    assert_keys_host(tier, 4 * bb, 4, 4, 2, 4, 0, 0);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_int_equal(after.acquires, before.acquires + 4);
    assert_int_equal(after.held_pages, before.held_pages + 4);
    assert_int_equal(after.cached_pages, 4); /* published again */
    kvp_cache *d = external_cache(pool, B, 1);
    size_t adopted = 0;
    kvpt_assert_ok(kvp_cache_adopt_prefix(d, keys, 2, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, 2);
    assert_int_equal(page_of(d, 1, 1), page_of(c, 1, 1));
    kvpt_destroy_cache(d, pool);

    /* Block 2: lane 0's key held at a wrong size, lane 1's right: rejected, not mapped. */
    kvp_tier_block b[2];
    memset(b, 0, sizeof b);
    b[0].key = keys[2 * B];
    b[0].bytes = bb - 1;
    b[1].key = keys[2 * B + 1];
    b[1].bytes = bb;
    kvpt_assert_ok(kvp_tier_run(tier, KVP_TIER_PUT, b, 2, &err), &err);
    before = kvpt_stats(pool);
    kvpt_assert_ok(kvp_cache_group_tier_load(&c, 1, keys + 2 * B, 1, &loaded, &stop, &err),
                   &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, 0);
    assert_int_equal(stop, KVP_TIER_BLOCK_REJECTED);
    assert_int_equal(kvp_cache_len(c), 2 * BT);
    assert_int_equal(kvpt_stats(pool).held_pages, before.held_pages);
    assert_int_equal(kvpt_stats(pool).acquires, before.acquires);
    ts = tier_stats(pool);
    assert_int_equal(ts.loads, 4);
    assert_int_equal(ts.rejected, 1);
    assert_int_equal(ts.rejected_header, 1);
    assert_int_equal(ts.rejected_mac, 0);
    /* A refused load (not at a block boundary) changes nothing, not even counters. */
    grow(c, pool, 1);
    kvpt_snapshot snap;
    kvpt_snapshot_init(&snap, pool);
    kvpt_snapshot_add_cache(&snap, c);
    kvpt_snapshot_take(&snap);
    kvp_tier_host_stats hs = host_stats(tier);
    assert_int_equal(kvp_cache_group_tier_load(&c, 1, keys + 2 * B, 1, &loaded, &stop, &err),
                     KVP_NOT_AT_BLOCK_BOUNDARY);
    kvpt_assert_unchanged(&snap, 0);
    assert_int_equal(tier_stats(pool).rejected, 1);
    assert_int_equal(host_stats(tier).hits, hs.hits);
    kvpt_destroy_cache(c, pool);
    detach_and_destroy(pool, tier);
    destroy_pool(pool);
}

/* Write-through: publishing sends the keys at once; eviction sends nothing more. */
static void test_tier_keys_write_through(void **state)
{
    (void)state;
    kvp_pool *pool = reserved_pool(PAGES);
    kvp_tier *tier = keys_tier(3 * (KVP_TIER_HEADER_BYTES + 2 * BT * HEAD_WIDTH * 8));
    attach(pool, tier, 1);
    size_t bb = block_bytes(pool);
    kvp_block_key keys[3 * B];
    kvp_cache *a = published(pool, keys);
    assert_int_equal(tier_stats(pool).writes, 4);
    /* A budget of three blocks: the fourth key drops the first. */
    assert_keys_host(tier, 3 * bb, 3, 0, 0, 4, 1, 0);
    kvpt_destroy_cache(a, pool);
    churn_reserved(pool, PAGES);
    assert_int_equal(kvpt_stats(pool).evictions, 4);
    assert_int_equal(tier_stats(pool).writes, 4);
    kvp_cache *c = external_cache(pool, B, 1);
    size_t loaded = 0;
    kvp_status stop = KVP_FULL;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_group_tier_load(&c, 1, keys, 2, &loaded, &stop, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, 0); /* block 0 lane 0 was dropped: the run is empty */
    assert_int_equal(stop, KVP_OK);
    assert_int_equal(tier_stats(pool).misses, 1);
    assert_int_equal(kvp_cache_len(c), 0);
    kvpt_destroy_cache(c, pool);
    detach_and_destroy(pool, tier);
    destroy_pool(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tier_keys_lru_and_budget),
        cmocka_unit_test(test_tier_keys_attach_refusals),
        cmocka_unit_test(test_tier_keys_evict_then_load),
        cmocka_unit_test(test_tier_keys_write_through),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
