/*
 * test_tier.c: the second tier (kvpager/tier.h, issue 20): the block format
 * (pack, verify, every kind of rejection: counted, never mapped), the
 * host-memory tier's LRU and byte budget with exact figures, write-back on
 * evict and write-through on publish, and loads that give bit-identical
 * pages and attention outputs for an external and a layer-bound cache
 * (a tier completing on its own thread, and one that fails: test_tier_async.c).
 * Every failing call changes nothing (pool state, pool and tier counters);
 * kvp_pool_check runs after every operation (kvpt_assert_pool_ok).
 */
#include "tier_support.h"

#include <stdlib.h>
#include <string.h>

/* ---- block format ----------------------------------------------------------------- */

/* A published page packs into header + page bytes; it verifies, and its payload is the page. */
static void test_tier_pack_verify_round_trip(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 8);
    kvp_block_key keys[2];
    kvp_cache *cache = published_cache(pool, 1, keys);
    size_t bytes = block_bytes(pool);
    assert_int_equal(bytes, 112 + 2 * BT * HEAD_WIDTH * 8);
    unsigned char *block = pack(cache, pool, 1);
    assert_memory_equal(block, "KVPT", 4);
    const void *k = NULL;
    const void *v = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_page_data(pool, page_of(cache, 0, 1), &k, &v, NULL, &err), &err);
    assert_memory_equal(block + KVP_TIER_HEADER_BYTES, k, bytes - KVP_TIER_HEADER_BYTES);
    unsigned char secret[KVP_TIER_SECRET_BYTES];
    secret_fill(secret, 1);
    kvpt_assert_ok(kvp_tier_block_verify(cache, &keys[1], secret, block, bytes, &err), &err);
    /* An unpublished block does not pack; nothing is written. */
    append(cache, pool, 1, BT, 0.5);
    memset(block, 0xab, bytes);
    size_t out_bytes = 5;
    assert_int_equal(kvp_tier_block_pack(cache, 0, 2, secret, block, bytes, &out_bytes, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "block");
    assert_int_equal(out_bytes, 5);
    assert_int_equal(kvp_tier_block_pack(cache, 0, 1, secret, block, bytes - 1, &out_bytes, &err),
                     KVP_BUFFER_TOO_SMALL);
    assert_int_equal(kvp_tier_block_pack(cache, 0, 3, secret, block, bytes, &out_bytes, &err),
                     KVP_OUT_OF_RANGE);
    assert_int_equal(block[0], 0xab);
    free(block);
    kvpt_destroy_cache(cache, pool);
    destroy_pool(pool);
}

static void expect_rejected(const kvp_cache *cache, const kvp_block_key *key,
                            const unsigned char *secret, const void *block, size_t bytes,
                            const char *what)
{
    kvp_error err;
    assert_int_equal(kvp_tier_block_verify(cache, key, secret, block, bytes, &err),
                     KVP_TIER_BLOCK_REJECTED);
    assert_string_equal(err.what, what);
}

/* Every kind of tampering, and every mismatch, is told by its first failing check. */
static void test_tier_verify_names_each_rejection(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 8);
    kvp_block_key keys[2];
    kvp_cache *cache = published_cache(pool, 1, keys);
    size_t bytes = block_bytes(pool);
    unsigned char *good = pack(cache, pool, 0);
    unsigned char *bad = malloc(bytes);
    unsigned char secret[KVP_TIER_SECRET_BYTES];
    secret_fill(secret, 1);
    static const struct {
        size_t byte;
        const char *what;
    } flips[] = {{0, "magic"},  {4, "version"}, {8, "mac"},  {16, "mac"}, {48, "mac"},
                 {64, "mac"},   {80, "mac"},    {111, "mac"}, {112, "mac"}, {40, "size"}};
    for (size_t i = 0; i < KVPT_COUNT_OF(flips); i++) {
        memcpy(bad, good, bytes);
        bad[flips[i].byte] ^= 1;
        expect_rejected(cache, &keys[0], secret, bad, bytes, flips[i].what);
    }
    memcpy(bad, good, bytes);
    bad[bytes - 1] ^= 0x80; /* the payload's last byte */
    expect_rejected(cache, &keys[0], secret, bad, bytes, "mac");
    expect_rejected(cache, &keys[0], secret, good, bytes - 1, "size");
    expect_rejected(cache, &keys[0], secret, good, 10, "size");
    unsigned char other[KVP_TIER_SECRET_BYTES];
    secret_fill(other, 2);
    expect_rejected(cache, &keys[0], other, good, bytes, "mac");
    expect_rejected(cache, &keys[1], secret, good, bytes, "key");
    kvp_cache *revised = external_cache(pool, 1, 2); /* other weights' revision */
    expect_rejected(revised, &keys[0], secret, good, bytes, "binding");
    kvpt_destroy_cache(revised, pool);
    /* Validly MAC'd by a pool of another geometry (two KV heads), same secret. */
    kvp_pool *wide = kvpt_pool(BT, 2, HEAD_WIDTH, 8);
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&binding, 2, HEAD_WIDTH, 64, 7, 1, &err), &err);
    kvp_cache *w = kvpt_cache(wide, &binding, 1, CAPACITY);
    double rows[2 * BT * HEAD_WIDTH];
    for (size_t i = 0; i < KVPT_COUNT_OF(rows); i++) {
        rows[i] = (double)i;
    }
    kvpt_assert_ok(kvp_cache_append_rows(w, rows, rows, BT, &err), &err);
    kvpt_assert_ok(kvp_cache_publish_block(w, 0, 0, &keys[0], &err), &err);
    unsigned char *foreign = pack(w, wide, 0);
    expect_rejected(cache, &keys[0], secret, foreign, block_bytes(wide), "geometry");
    free(foreign);
    kvpt_destroy_cache(w, wide);
    destroy_pool(wide);
    free(bad);
    free(good);
    kvpt_destroy_cache(cache, pool);
    destroy_pool(pool);
}

/* ---- the host tier ---------------------------------------------------------------- */

static kvp_block_key key_n(uint64_t n)
{
    kvp_block_key k = {n, n * 31 + 5};
    return k;
}

static size_t tier_get(kvp_tier *tier, uint64_t n, unsigned char *buf, size_t capacity,
                       kvp_status *status)
{
    kvp_tier_block b;
    memset(&b, 0, sizeof b);
    b.key = key_n(n);
    b.data = buf;
    b.capacity = capacity;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_run(tier, KVP_TIER_GET, &b, 1, &err), &err);
    *status = b.status;
    return b.bytes;
}

static size_t tier_contains(kvp_tier *tier, uint64_t n)
{
    kvp_tier_block b;
    memset(&b, 0, sizeof b);
    b.key = key_n(n);
    kvp_error err;
    kvpt_assert_ok(kvp_tier_run(tier, KVP_TIER_CONTAINS, &b, 1, &err), &err);
    kvpt_assert_ok(b.status, NULL);
    return b.bytes;
}

static void assert_host(kvp_tier *tier, size_t bytes, size_t blocks, uint64_t hits,
                        uint64_t misses, uint64_t puts, uint64_t evictions, uint64_t rejected)
{
    kvp_tier_host_stats s = host_stats(tier);
    assert_int_equal(s.budget_bytes, 300);
    assert_int_equal(s.bytes, bytes);
    assert_int_equal(s.blocks, blocks);
    assert_int_equal(s.hits, hits);
    assert_int_equal(s.misses, misses);
    assert_int_equal(s.puts, puts);
    assert_int_equal(s.evictions, evictions);
    assert_int_equal(s.rejected_puts, rejected);
}

/* 300 bytes: three 100-byte blocks fit; the least recently used goes first. */
static void test_tier_host_lru_and_budget(void **state)
{
    (void)state;
    kvp_tier *tier = host_tier(300);
    assert_string_equal(kvp_tier_name(tier), "host");
    unsigned char data[400];
    for (size_t i = 0; i < sizeof data; i++) {
        data[i] = (unsigned char)i;
    }
    for (uint64_t n = 1; n <= 3; n++) {
        tier_put(tier, &(kvp_block_key){n, n * 31 + 5}, data + n, 100);
    }
    assert_host(tier, 300, 3, 0, 0, 3, 0, 0);
    unsigned char buf[400];
    kvp_status status;
    assert_int_equal(tier_get(tier, 1, buf, sizeof buf, &status), 100); /* 1 is the newest */
    kvpt_assert_ok(status, NULL);
    assert_memory_equal(buf, data + 1, 100);
    tier_put(tier, &(kvp_block_key){4, 4 * 31 + 5}, data + 4, 100); /* drops 2 */
    assert_host(tier, 300, 3, 1, 0, 4, 1, 0);
    assert_int_equal(tier_contains(tier, 2), 0);
    assert_int_equal(tier_contains(tier, 3), 100);
    assert_int_equal(tier_get(tier, 2, buf, sizeof buf, &status), 0);
    assert_host(tier, 300, 3, 1, 1, 4, 1, 0); /* contains counts nothing */
    /* Larger than the whole budget: refused, nothing dropped. */
    kvp_tier_block big;
    memset(&big, 0, sizeof big);
    big.key = key_n(9);
    big.data = data;
    big.bytes = 301;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_run(tier, KVP_TIER_PUT, &big, 1, &err), &err);
    assert_int_equal(big.status, KVP_TIER_UNAVAILABLE);
    assert_host(tier, 300, 3, 1, 1, 4, 1, 1);
    /* Replacing key 3 with 50 bytes frees 50; a 150-byte put then drops the LRU (1). */
    tier_put(tier, &(kvp_block_key){3, 3 * 31 + 5}, data + 30, 50);
    assert_host(tier, 250, 3, 1, 1, 5, 1, 1);
    tier_put(tier, &(kvp_block_key){5, 5 * 31 + 5}, data, 150);
    assert_host(tier, 300, 3, 1, 1, 6, 2, 1); /* 1 (oldest) dropped: 4, 3, 5 remain */
    assert_int_equal(tier_contains(tier, 1), 0);
    assert_int_equal(tier_get(tier, 3, buf, sizeof buf, &status), 50);
    assert_memory_equal(buf, data + 30, 50);
    assert_int_equal(tier_get(tier, 5, buf, 149, &status), 150); /* too small a buffer */
    assert_int_equal(status, KVP_BUFFER_TOO_SMALL);
    assert_host(tier, 300, 3, 3, 1, 6, 2, 1);
    /* A batch of three in one call: hit, miss, hit. */
    kvp_tier_block three[3];
    unsigned char bufs[3][200];
    memset(three, 0, sizeof three);
    uint64_t ns[3] = {4, 7, 3};
    for (size_t i = 0; i < 3; i++) {
        three[i].key = key_n(ns[i]);
        three[i].data = bufs[i];
        three[i].capacity = sizeof bufs[i];
    }
    kvpt_assert_ok(kvp_tier_run(tier, KVP_TIER_GET, three, 3, &err), &err);
    assert_int_equal(three[0].bytes, 100);
    assert_int_equal(three[1].bytes, 0);
    assert_int_equal(three[2].bytes, 50);
    assert_host(tier, 300, 3, 5, 2, 6, 2, 1);
    /* Refusals change nothing. */
    assert_int_equal(kvp_tier_run(tier, (kvp_tier_op)7, three, 3, &err), KVP_INVALID_ARGUMENT);
    assert_int_equal(kvp_tier_run(tier, KVP_TIER_GET, NULL, 3, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_tier_host_create(0, &tier, &err), KVP_ZERO_SIZE);
    assert_host(tier, 300, 3, 5, 2, 6, 2, 1);
    kvpt_assert_ok(kvp_tier_destroy(tier, &err), &err);
}

/*
 * Two host tiers composed: near (300 bytes) in front of far. Puts reach
 * both; a get near no longer holds is served by far and promoted to near;
 * contains looks through to far; exact counters on both sides.
 */
static void test_tier_compose_near_then_far(void **state)
{
    (void)state;
    kvp_tier *near = host_tier(300);
    kvp_tier *far = host_tier(1 << 20);
    kvp_tier *both = NULL;
    kvp_error err;
    assert_int_equal(kvp_tier_compose_create(near, near, &both, &err), KVP_INVALID_ARGUMENT);
    assert_int_equal(kvp_tier_compose_create(near, NULL, &both, &err), KVP_NULL_ARGUMENT);
    assert_null(both);
    kvpt_assert_ok(kvp_tier_compose_create(near, far, &both, &err), &err);
    assert_string_equal(kvp_tier_name(both), "compose");
    unsigned char data[500];
    for (size_t i = 0; i < sizeof data; i++) {
        data[i] = (unsigned char)(3 * i);
    }
    for (uint64_t n = 1; n <= 4; n++) {
        tier_put(both, &(kvp_block_key){n, n * 31 + 5}, data + n, 100);
    }
    assert_host(near, 300, 3, 0, 0, 4, 1, 0); /* 1 dropped from near */
    kvp_tier_host_stats f = host_stats(far);
    assert_int_equal(f.blocks, 4);
    assert_int_equal(f.puts, 4);
    unsigned char buf[200];
    kvp_status status;
    assert_int_equal(tier_get(both, 1, buf, sizeof buf, &status), 100);
    kvpt_assert_ok(status, NULL);
    assert_memory_equal(buf, data + 1, 100);
    assert_host(near, 300, 3, 0, 1, 5, 2, 0); /* a miss near, then 1 promoted (2 dropped) */
    f = host_stats(far);
    assert_int_equal(f.hits, 1);
    assert_int_equal(f.misses, 0);
    assert_int_equal(tier_get(both, 1, buf, sizeof buf, &status), 100); /* near now */
    assert_host(near, 300, 3, 1, 1, 5, 2, 0);
    assert_int_equal(host_stats(far).hits, 1);
    assert_int_equal(tier_contains(both, 2), 100); /* only far holds it */
    assert_int_equal(tier_get(both, 9, buf, sizeof buf, &status), 0);
    kvpt_assert_ok(status, NULL);
    assert_host(near, 300, 3, 1, 2, 5, 2, 0);
    assert_int_equal(host_stats(far).misses, 1);
    kvpt_assert_ok(kvp_tier_destroy(both, &err), &err);
    kvpt_assert_ok(kvp_tier_destroy(far, &err), &err);
    kvpt_assert_ok(kvp_tier_destroy(near, &err), &err);
}

/* ---- write-back and load ---------------------------------------------------------- */

/*
 * Evicted published pages go to the tier; a cache of the same binding loads
 * them back: bit-identical rows, published again (an adopter hits them).
 */
static void test_tier_evict_then_load_external(void **state)
{
    (void)state;
    enum { B = 2, PAGES = 8 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *tier = host_tier(1 << 20);
    attach(pool, tier, 0);
    kvp_block_key keys[3 * B];
    kvp_cache *a = published_cache(pool, B, keys);
    chain_keys(a, B, 3, 0.0, keys); /* a third block's keys too: never published */
    size_t n = B * KV_HEADS * 2 * BT * HEAD_WIDTH;
    double *ka = kvpt_doubles(n);
    double *va = kvpt_doubles(n);
    export_rows(a, n, ka, va);
    kvpt_destroy_cache(a, pool);
    assert_int_equal(kvpt_stats(pool).evictable_pages, 4);
    assert_int_equal(tier_stats(pool).writes, 0); /* write-back: nothing until evicted */
    churn(pool, PAGES); /* every evictable page borrowed, then mapped: evicted */
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).evictions, 4);
    assert_int_equal(kvpt_stats(pool).cached_pages, 0);
    kvp_pool_tier_stats ts = tier_stats(pool);
    assert_int_equal(ts.writes, 4);
    assert_int_equal(ts.write_failures, 0);
    assert_int_equal(ts.block_bytes, block_bytes(pool));
    assert_int_equal(host_stats(tier).blocks, 4);
    assert_int_equal(host_stats(tier).bytes, 4 * block_bytes(pool));

    kvp_cache *c = external_cache(pool, B, 1);
    kvp_pool_stats before = kvpt_stats(pool);
    size_t loaded = 0;
    kvp_status stop = KVP_FULL;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_group_tier_load(&c, 1, keys, 3, &loaded, &stop, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, 2);
    assert_int_equal(stop, KVP_OK); /* the third block's keys were never written: a miss */
    assert_int_equal(kvp_cache_len(c), 2 * BT);
    double *kc = kvpt_doubles(n);
    double *vc = kvpt_doubles(n);
    export_rows(c, n, kc, vc);
    assert_memory_equal(kc, ka, n * sizeof(double));
    assert_memory_equal(vc, va, n * sizeof(double));
    ts = tier_stats(pool);
    assert_int_equal(ts.loads, 4);
    assert_int_equal(ts.load_bytes, 4 * block_bytes(pool));
    assert_int_equal(ts.misses, B); /* the third block, in both lanes */
    assert_int_equal(ts.rejected, 0);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_int_equal(after.acquires, before.acquires + 4);
    assert_int_equal(after.cached_pages, 4); /* published again */
    assert_int_equal(after.prefix_hits, before.prefix_hits);
    /* An adopter finds them in the index now. */
    kvp_cache *d = external_cache(pool, B, 1);
    size_t adopted = 0;
    kvpt_assert_ok(kvp_cache_adopt_prefix(d, keys, 2, &adopted, &err), &err);
    assert_int_equal(adopted, 2);
    assert_int_equal(page_of(d, 1, 1), page_of(c, 1, 1));
    kvpt_destroy_cache(d, pool);
    kvpt_destroy_cache(c, pool);
    free(ka);
    free(va);
    free(kc);
    free(vc);
    detach_and_destroy(pool, tier);
    destroy_pool(pool);
}

/*
 * Room for 3 blocks, keys for 3 of which the tier holds only the first and
 * the third: one block loads, the run stops at the miss, the third is never
 * mapped (a miss counted). Write-through: publish writes, eviction does not.
 */
static void test_tier_miss_stops_the_chain_and_write_through(void **state)
{
    (void)state;
    enum { PAGES = 6 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *tier = host_tier(1 << 20);
    attach(pool, tier, 1);
    kvp_cache *a = external_cache(pool, 1, 1);
    append(a, pool, 1, 3 * BT, 0.25);
    kvp_block_key keys[3];
    chain_keys(a, 1, 3, 0.0, keys);
    kvp_error err;
    kvpt_assert_ok(kvp_cache_publish_block(a, 0, 0, &keys[0], &err), &err);
    kvpt_assert_ok(kvp_cache_publish_block(a, 0, 2, &keys[2], &err), &err);
    assert_int_equal(tier_stats(pool).writes, 2); /* write-through: at publish */
    kvpt_assert_ok(kvp_cache_publish_block(a, 0, 0, &keys[0], &err), &err);
    assert_int_equal(tier_stats(pool).writes, 2); /* already published: no second write */
    kvpt_destroy_cache(a, pool);
    churn(pool, PAGES);
    assert_int_equal(kvpt_stats(pool).evictions, 2);
    assert_int_equal(tier_stats(pool).writes, 2); /* eviction writes nothing more */
    kvp_cache *c = external_cache(pool, 1, 1);
    size_t loaded = 9;
    kvp_status stop = KVP_FULL;
    kvpt_assert_ok(kvp_cache_group_tier_load(&c, 1, keys, 3, &loaded, &stop, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, 1);
    assert_int_equal(stop, KVP_OK);
    assert_int_equal(kvp_cache_len(c), BT);
    kvp_pool_tier_stats ts = tier_stats(pool);
    assert_int_equal(ts.loads, 1);
    assert_int_equal(ts.misses, 1);
    assert_int_equal(kvpt_stats(pool).cached_pages, 1); /* the third block was never mapped */
    kvpt_destroy_cache(c, pool);
    destroy_pool(pool); /* detaches its tier (nothing leaks: ASan, memcheck) */
    kvp_error e2;
    kvpt_assert_ok(kvp_tier_destroy(tier, &e2), &e2);
}

/* A load into `cache` stops at a rejected block: counted by reason (`rejections` blocks), never mapped. */
static void expect_load_rejected(kvp_pool *pool, kvp_cache *cache, const kvp_block_key *keys,
                                 size_t n, size_t want_loaded, const char *what,
                                 uint64_t rejections)
{
    kvpt_state before;
    kvpt_state_capture(cache, pool, &before);
    kvp_pool_tier_stats ts = tier_stats(pool);
    size_t loaded = 9;
    kvp_status stop = KVP_OK;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_group_tier_load(&cache, 1, keys, n, &loaded, &stop, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, want_loaded);
    assert_int_equal(stop, KVP_TIER_BLOCK_REJECTED);
    kvp_pool_tier_stats now = tier_stats(pool);
    assert_int_equal(now.rejected, ts.rejected + rejections);
    uint64_t was = 0;
    uint64_t is = 0;
    if (strcmp(what, "mac") == 0) {
        was = ts.rejected_mac, is = now.rejected_mac;
    } else if (strcmp(what, "header") == 0) {
        was = ts.rejected_header, is = now.rejected_header;
    } else if (strcmp(what, "geometry") == 0) {
        was = ts.rejected_geometry, is = now.rejected_geometry;
    } else if (strcmp(what, "key") == 0) {
        was = ts.rejected_key, is = now.rejected_key;
    } else {
        was = ts.rejected_binding, is = now.rejected_binding;
    }
    assert_int_equal(is, was + rejections);
    assert_int_equal(now.loads, ts.loads + want_loaded);
    if (want_loaded == 0) {
        kvpt_assert_state_unchanged(&before, cache, pool, 0); /* never mapped */
    }
    kvpt_state_free(&before);
}

/*
 * Blocks in the tier that fail verification are counted by reason and never
 * mapped; a bad second block stops the chain after the good first one.
 */
static void test_tier_load_rejects_and_never_maps(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 8);
    kvp_tier *tier = host_tier(1 << 20);
    kvp_block_key keys[2];
    kvp_cache *a = published_cache(pool, 1, keys);
    size_t bytes = block_bytes(pool);
    unsigned char *good0 = pack(a, pool, 0);
    unsigned char *good1 = pack(a, pool, 1);
    unsigned char *bad = malloc(bytes);
    kvpt_destroy_cache(a, pool);
    attach(pool, tier, 0);
    kvp_cache *c = external_cache(pool, 1, 1);
    /* Flip one bit of the MAC, of the payload, of the header's magic and version. */
    size_t at[] = {80, 0, 0, 4};
    const char *what[] = {"mac", "mac", "header", "header"};
    at[1] = bytes - 3;
    for (size_t i = 0; i < 4; i++) {
        memcpy(bad, good0, bytes);
        bad[at[i]] ^= 4;
        tier_put(tier, &keys[0], bad, bytes);
        expect_load_rejected(pool, c, keys, 1, 0, what[i], 1);
    }
    /* The key: block 1's bytes stored under block 0's key. */
    tier_put(tier, &keys[0], good1, bytes);
    expect_load_rejected(pool, c, keys, 1, 0, "key", 1);
    /*
     * Validly MAC'd under the same secret by a pool of another geometry
     * with the same page size (two KV heads of width 1).
     */
    kvp_pool *other = kvpt_pool(BT, 2, 1, 4);
    assert_int_equal(block_bytes(other), bytes);
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&binding, 2, 1, 64, 7, 1, &err), &err);
    kvp_cache *o = kvpt_cache(other, &binding, 1, CAPACITY);
    double rows[2 * BT];
    for (size_t i = 0; i < KVPT_COUNT_OF(rows); i++) {
        rows[i] = (double)i;
    }
    kvpt_assert_ok(kvp_cache_append_rows(o, rows, rows, BT, &err), &err);
    kvpt_assert_ok(kvp_cache_publish_block(o, 0, 0, &keys[0], &err), &err);
    unsigned char *foreign = pack(o, other, 0);
    tier_put(tier, &keys[0], foreign, bytes);
    expect_load_rejected(pool, c, keys, 1, 0, "geometry", 1);
    free(foreign);
    kvpt_destroy_cache(o, other);
    destroy_pool(other);
    /* Another binding's cache asks for a good block. */
    tier_put(tier, &keys[0], good0, bytes);
    kvp_cache *revised = external_cache(pool, 1, 2);
    expect_load_rejected(pool, revised, keys, 1, 0, "binding", 1);
    kvpt_destroy_cache(revised, pool);
    /* A good first block, a bad second: the first loads, the second never maps. */
    memcpy(bad, good1, bytes);
    bad[bytes - 1] ^= 1;
    tier_put(tier, &keys[1], bad, bytes);
    expect_load_rejected(pool, c, keys, 2, 1, "mac", 1);
    assert_int_equal(kvp_cache_len(c), BT);
    kvpt_destroy_cache(c, pool);
    free(bad);
    free(good0);
    free(good1);
    detach_and_destroy(pool, tier);
    destroy_pool(pool);
}

/* ---- a layer-bound cache: attention outputs ------------------------------------------- */

#define LHW (D / HEADS) /* the layer's head width; it has HEADS KV heads */

/*
 * A layer's cache of two blocks is published, evicted to the tier, and
 * loaded into a fresh cache of the same layer: the next token's attention
 * output and weights are bit-identical. A cache of a layer over other
 * weights is refused the blocks (binding).
 */
static void test_tier_layer_bound_outputs_bit_identical(void **state)
{
    (void)state;
    enum { PAGES = 6 };
    kvp_pool *pool = kvpt_pool(BT, HEADS, LHW, PAGES);
    kvp_tier *tier = host_tier(1 << 20);
    attach(pool, tier, 0);
    kvp_layer *layer = kvpt_random_layer(D, HEADS, SCAP, BASE, 31);
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    double inputs[(2 * BT + 1) * D];
    kvpt_fill_random(inputs, KVPT_COUNT_OF(inputs), 32);
    kvp_cache *a = kvpt_cache(pool, &binding, 1, SCAP);
    attend(layer, a, pool, inputs, 2 * BT);
    kvp_block_key keys[2];
    for (size_t j = 0; j < 2; j++) {
        kvpt_assert_ok(kvp_block_key_chain(j == 0 ? NULL : &keys[0], a, inputs + j * BT * D,
                                           BT * D * sizeof(double), NULL, &keys[j], &err),
                       &err);
        kvpt_assert_ok(kvp_cache_publish_block(a, 0, j, &keys[j], &err), &err);
    }
    double out_a[D];
    double w_a[HEADS * (2 * BT + 1)];
    probe(layer, a, pool, inputs + 2 * BT * D, out_a, w_a);
    kvpt_destroy_cache(a, pool);
    /* Evict: a cache of another layer takes every page. */
    kvp_layer *other = kvpt_random_layer(D, HEADS, SCAP, BASE, 33);
    kvp_binding other_binding;
    kvpt_assert_ok(kvp_layer_binding_get(other, &other_binding, &err), &err);
    kvp_cache *filler = kvpt_cache(pool, &other_binding, 1, SCAP);
    double many[PAGES * BT * D];
    kvpt_fill_random(many, KVPT_COUNT_OF(many), 34);
    attend(other, filler, pool, many, PAGES * BT);
    kvpt_destroy_cache(filler, pool);
    assert_int_equal(kvpt_stats(pool).evictions, 2);
    assert_int_equal(tier_stats(pool).writes, 2);
    /* Another layer's cache asks for the blocks: refused, nothing mapped. */
    kvp_cache *wrong = kvpt_cache(pool, &other_binding, 1, SCAP);
    expect_load_rejected(pool, wrong, keys, 2, 0, "binding", 2);
    kvpt_destroy_cache(wrong, pool);
    /* The same layer's fresh cache loads them. */
    kvp_cache *c = kvpt_cache(pool, &binding, 1, SCAP);
    size_t loaded = 0;
    kvp_status stop = KVP_FULL;
    kvpt_assert_ok(kvp_cache_group_tier_load(&c, 1, keys, 2, &loaded, &stop, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, 2);
    assert_int_equal(stop, KVP_OK);
    double out_c[D];
    double w_c[HEADS * (2 * BT + 1)];
    probe(layer, c, pool, inputs + 2 * BT * D, out_c, w_c);
    assert_memory_equal(out_c, out_a, sizeof out_a);
    assert_memory_equal(w_c, w_a, sizeof w_a);
    /* The loaded cache goes on computing as the original would have. */
    attend(layer, c, pool, inputs + 2 * BT * D, 1);
    assert_int_equal(kvp_cache_len(c), 2 * BT + 1);
    kvpt_destroy_cache(c, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_layer(other);
    detach_and_destroy(pool, tier);
    destroy_pool(pool);
}

/* The output of attending `x` over `cache` (prepared, then discarded); the keys it read. */
static size_t probe_output(const kvp_layer *layer, const kvp_cache *cache, kvp_pool *pool,
                           const double *x, double out[D])
{
    kvp_ticket *ticket = kvpt_ticket(cache);
    kvp_tensor in = kvp_tensor3((double *)(uintptr_t)x, 1, 1, D);
    kvp_error err;
    kvpt_assert_ok(kvp_attention_prepare(layer, &in, cache, ticket, &err), &err);
    kvp_attention_result r;
    kvpt_assert_ok(kvp_ticket_result(ticket, &r, &err), &err);
    memcpy(out, r.output, D * sizeof(double));
    kvpt_destroy_ticket(ticket, pool);
    return r.keys;
}

/*
 * A load into a windowed cache (W = BT) releases, as a commit does, what its
 * window no longer needs: loading 3 blocks leaves blocks 0 and 1 released
 * (null entries) and block 2 held; the next token's output is the original's.
 */
static void test_tier_load_into_windowed_cache_releases(void **state)
{
    (void)state;
    enum { PAGES = 6, W = BT };
    kvp_pool *pool = kvpt_pool(BT, HEADS, LHW, PAGES);
    kvp_tier *tier = host_tier(1 << 20);
    attach(pool, tier, 0);
    kvp_error err;
    kvp_layer *layer = kvpt_random_layer(D, HEADS, SCAP, BASE, 41);
    kvpt_assert_ok(kvp_layer_set_window(layer, W, 0, &err), &err);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    double inputs[(3 * BT + 1) * D];
    kvpt_fill_random(inputs, KVPT_COUNT_OF(inputs), 42);
    kvp_cache *a = kvpt_cache(pool, &binding, 1, SCAP);
    kvp_block_key keys[3];
    for (size_t j = 0; j < 3; j++) {
        /* Block j is full at length (j + 1) BT and released at (j + 2) BT: publish it between. */
        attend(layer, a, pool, inputs + j * BT * D, BT);
        kvpt_assert_ok(kvp_block_key_chain(j == 0 ? NULL : &keys[j - 1], a, inputs + j * BT * D,
                                           BT * D * sizeof(double), NULL, &keys[j], &err),
                       &err);
        kvpt_assert_ok(kvp_cache_publish_block(a, 0, j, &keys[j], &err), &err);
    }
    double out_a[D];
    size_t keys_a = probe_output(layer, a, pool, inputs + 3 * BT * D, out_a);
    kvpt_destroy_cache(a, pool);
    /* Evict all three to the tier: a cache of another layer takes every page. */
    kvp_layer *other = kvpt_random_layer(D, HEADS, SCAP, BASE, 43);
    kvp_binding other_binding;
    kvpt_assert_ok(kvp_layer_binding_get(other, &other_binding, &err), &err);
    kvp_cache *filler = kvpt_cache(pool, &other_binding, 1, SCAP);
    double many[PAGES * BT * D];
    kvpt_fill_random(many, KVPT_COUNT_OF(many), 44);
    attend(other, filler, pool, many, PAGES * BT);
    kvpt_destroy_cache(filler, pool);
    assert_int_equal(tier_stats(pool).writes, 3);
    kvp_cache *c = kvpt_cache(pool, &binding, 1, SCAP);
    size_t loaded = 0;
    kvp_status stop = KVP_FULL;
    kvpt_assert_ok(kvp_cache_group_tier_load(&c, 1, keys, 3, &loaded, &stop, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, 3);
    assert_int_equal(kvp_cache_len(c), 3 * BT);
    for (size_t b = 0; b < 3; b++) {
        uint32_t page = 0;
        kvpt_assert_ok(kvp_cache_page(c, 0, b, &page, &err), &err);
        assert_int_equal(page == KVP_PAGE_RELEASED, b < 2);
    }
    kvp_cache_info info;
    kvp_cache_info_init(&info);
    kvpt_assert_ok(kvp_cache_info_get(c, &info, &err), &err);
    assert_int_equal(info.mapped_pages, 1);
    double out_c[D];
    assert_int_equal(probe_output(layer, c, pool, inputs + 3 * BT * D, out_c), keys_a);
    assert_memory_equal(out_c, out_a, sizeof out_a);
    kvpt_destroy_cache(c, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_layer(other);
    detach_and_destroy(pool, tier);
    destroy_pool(pool);
}

/* ---- failing calls change nothing ------------------------------------------------- */

static void assert_tier_stats_equal(const kvp_pool_tier_stats *a, const kvp_pool_tier_stats *b)
{
    assert_memory_equal(a, b, sizeof *a);
}

/*
 * Every refusal of attach, detach, stats and load: the pool (state, every
 * counter, exhaustions but for POOL_EXHAUSTED), the cache and the tier's
 * counters stay as they were; the audit passes.
 */
static void test_tier_failures_change_nothing(void **state)
{
    (void)state;
    enum { PAGES = 4 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *tier = host_tier(1 << 20);
    kvp_error err;
    kvp_cache *c = external_cache(pool, 1, 1);
    kvp_block_key keys[2] = {{1, 2}, {3, 4}};
    size_t loaded = 7;
    kvp_status stop = KVP_FULL;
    kvpt_state before;
    kvpt_state_capture(c, pool, &before);
    /* No tier yet. */
    assert_int_equal(kvp_cache_group_tier_load(&c, 1, keys, 1, &loaded, &stop, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "pool");
    kvp_pool_tier_stats ts;
    kvp_pool_tier_stats_init(&ts);
    assert_int_equal(kvp_pool_tier_stats_get(pool, &ts, &err), KVP_INVALID_ARGUMENT);
    kvp_tier_policy policy;
    kvp_tier_policy_init(&policy);
    assert_int_equal(kvp_pool_tier_attach(pool, tier, &policy, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "secret");
    secret_fill(policy.secret, 1);
    policy.write_through = 2;
    assert_int_equal(kvp_pool_tier_attach(pool, tier, &policy, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "write_through");
    policy.write_through = 0;
    policy.struct_size = 0;
    assert_int_equal(kvp_pool_tier_attach(pool, tier, &policy, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "struct_size");
    assert_int_equal(kvp_pool_tier_attach(NULL, tier, &policy, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_pool_tier_attach(pool, NULL, &policy, &err), KVP_NULL_ARGUMENT);
    kvpt_assert_state_unchanged(&before, c, pool, 0);
    attach(pool, tier, 0);
    policy.struct_size = sizeof policy;
    assert_int_equal(kvp_pool_tier_attach(pool, tier, &policy, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "pool");
    kvp_pool_tier_stats t0 = tier_stats(pool);
    /* Load refusals before the tier is asked. */
    assert_int_equal(kvp_cache_group_tier_load(NULL, 1, keys, 1, &loaded, &stop, &err),
                     KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_cache_group_tier_load(&c, 1, NULL, 1, &loaded, &stop, &err),
                     KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_cache_group_tier_load(&c, 1, keys, 1, NULL, &stop, &err),
                     KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_cache_group_tier_load(&c, 0, keys, 1, &loaded, &stop, &err),
                     KVP_INVALID_ARGUMENT);
    kvpt_assert_state_unchanged(&before, c, pool, 0);
    kvpt_state_free(&before);
    append(c, pool, 1, 1, 0.0); /* mid-block */
    kvpt_state_capture(c, pool, &before);
    assert_int_equal(kvp_cache_group_tier_load(&c, 1, keys, 1, &loaded, &stop, &err),
                     KVP_NOT_AT_BLOCK_BOUNDARY);
    kvpt_assert_state_unchanged(&before, c, pool, 0);
    kvpt_state_free(&before);
    kvpt_assert_ok(kvp_cache_reset(c, &err), &err);
    kvpt_assert_ok(kvp_cache_reserve_rows(c, 1, &err), &err);
    kvpt_state_capture(c, pool, &before);
    assert_int_equal(kvp_cache_group_tier_load(&c, 1, keys, 1, &loaded, &stop, &err),
                     KVP_ROWS_RESERVED);
    kvpt_assert_state_unchanged(&before, c, pool, 0);
    kvpt_state_free(&before);
    kvpt_assert_ok(kvp_cache_discard_rows(c, &err), &err);
    kvp_pool_tier_stats tnow = tier_stats(pool);
    assert_tier_stats_equal(&tnow, &t0); /* no refusal counted anything */
    /* POOL_EXHAUSTED: two verified blocks, one page left. */
    kvp_cache *src = published_cache(pool, 1, keys);
    unsigned char *b0 = pack(src, pool, 0);
    unsigned char *b1 = pack(src, pool, 1);
    tier_put(tier, &keys[0], b0, block_bytes(pool));
    tier_put(tier, &keys[1], b1, block_bytes(pool));
    kvp_cache *holder = external_cache(pool, 1, 5);
    append(holder, pool, 1, BT, 3.0); /* 3 of 4 pages held: 1 left */
    kvpt_state_capture(c, pool, &before);
    t0 = tier_stats(pool);
    assert_int_equal(kvp_cache_group_tier_load(&c, 1, keys, 2, &loaded, &stop, &err),
                     KVP_POOL_EXHAUSTED);
    assert_int_equal(loaded, 7);
    assert_int_equal(stop, KVP_FULL);
    kvpt_assert_state_unchanged(&before, c, pool, 1);
    kvp_pool_tier_stats t1 = tier_stats(pool);
    assert_tier_stats_equal(&t1, &t0);
    kvpt_state_free(&before);
    /* With room, the same call loads both. */
    kvpt_destroy_cache(holder, pool);
    kvpt_destroy_cache(src, pool);
    kvpt_assert_ok(kvp_cache_group_tier_load(&c, 1, keys, 2, &loaded, &stop, &err), &err);
    assert_int_equal(loaded, 2);
    kvpt_assert_pool_ok(pool);
    free(b0);
    free(b1);
    kvpt_destroy_cache(c, pool);
    detach_and_destroy(pool, tier);
    assert_int_equal(kvp_pool_tier_stats_get(pool, &ts, &err), KVP_INVALID_ARGUMENT);
    kvpt_assert_ok(kvp_pool_tier_detach(pool, &err), &err); /* none: nothing happens */
    destroy_pool(pool);
}

/*
 * Each allocation of a load, an attach and a host tier's creation, made to
 * fail in turn: ALLOCATION_FAILED, stopped at that call, and nothing changed
 * (pool, cache, pool and host tier counters); then the call succeeds.
 */
static void test_tier_allocation_failures_change_nothing(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 8);
    kvp_tier *tier = host_tier(1 << 20);
    kvp_block_key keys[2];
    kvp_cache *src = published_cache(pool, 1, keys);
    for (size_t j = 0; j < 2; j++) {
        unsigned char *b = pack(src, pool, j);
        tier_put(tier, &keys[j], b, block_bytes(pool));
        free(b);
    }
    kvpt_destroy_cache(src, pool);
    kvp_tier_policy policy;
    kvp_tier_policy_init(&policy);
    secret_fill(policy.secret, 1);
    kvpt_fault_step s;
    uint64_t nth = 1;
    for (;; nth++) {
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_pool_tier_attach(pool, tier, &policy, &s.err));
        if (!s.fired) {
            break;
        }
        kvpt_assert_fault_failed(&s, nth);
        assert_int_equal(kvp_pool_tier_stats_get(pool, &(kvp_pool_tier_stats){
                                                           .struct_size =
                                                               sizeof(kvp_pool_tier_stats)},
                                                 NULL),
                         KVP_INVALID_ARGUMENT); /* still no tier */
    }
    kvpt_assert_ok(s.status, &s.err);
    assert_int_equal(nth, 3); /* the state and the pack buffer */
    kvp_cache *c = external_cache(pool, 1, 1);
    kvpt_state before;
    kvpt_state_capture(c, pool, &before);
    kvp_pool_tier_stats ts = tier_stats(pool);
    kvp_tier_host_stats hs = host_stats(tier);
    size_t loaded = 7;
    for (nth = 1;; nth++) {
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(
            &s, kvp_cache_group_tier_load(&c, 1, keys, 2, &loaded, NULL, &s.err));
        if (!s.fired) {
            break;
        }
        kvpt_assert_fault_failed(&s, nth);
        assert_int_equal(loaded, 7);
        kvpt_assert_state_unchanged(&before, c, pool, 0);
        kvp_pool_tier_stats tnow = tier_stats(pool);
        assert_memory_equal(&tnow, &ts, sizeof ts);
        kvp_tier_host_stats hnow = host_stats(tier);
        assert_memory_equal(&hnow, &hs, sizeof hs);
    }
    kvpt_assert_ok(s.status, &s.err);
    assert_int_equal(nth, 8); /* the prefetch, its keys, five arrays of the batch */
    assert_int_equal(loaded, 2);
    kvpt_state_free(&before);
    kvpt_destroy_cache(c, pool);
    detach_and_destroy(pool, tier);
    kvp_tier *made = NULL;
    for (nth = 1;; nth++) {
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_tier_host_create(64, &made, &s.err));
        if (!s.fired) {
            break;
        }
        kvpt_assert_fault_failed(&s, nth);
        assert_null(made);
    }
    assert_int_equal(nth, 4); /* the tier's state, its buckets, the handle */
    kvp_error err;
    kvpt_assert_ok(kvp_tier_destroy(made, &err), &err);
    destroy_pool(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tier_pack_verify_round_trip),
        cmocka_unit_test(test_tier_verify_names_each_rejection),
        cmocka_unit_test(test_tier_host_lru_and_budget),
        cmocka_unit_test(test_tier_compose_near_then_far),
        cmocka_unit_test(test_tier_evict_then_load_external),
        cmocka_unit_test(test_tier_miss_stops_the_chain_and_write_through),
        cmocka_unit_test(test_tier_load_rejects_and_never_maps),
        cmocka_unit_test(test_tier_layer_bound_outputs_bit_identical),
        cmocka_unit_test(test_tier_load_into_windowed_cache_releases),
        cmocka_unit_test(test_tier_failures_change_nothing),
        cmocka_unit_test_teardown(test_tier_allocation_failures_change_nothing, kvpt_disarm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
