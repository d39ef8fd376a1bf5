/*
 * test_tier_redis.c: the Redis tier (kvpager/tier_redis.h, issue 20)
 * against a real redis-server each test starts on its own loopback port
 * (tests/redis_server.h); a server that cannot start fails the test.
 *
 * A "second process" is a second pool with its own Redis tier (its own
 * connections): blocks one pool evicts are loaded by the other with
 * bit-identical rows (external cache) and attention outputs (layer-bound
 * cache); another secret, another binding, garbage, another key's block, a
 * value of the wrong size are rejected, counted, never mapped; host+Redis
 * composed counts exactly on both sides; a dead server stops a load with
 * TIER_UNAVAILABLE and changes nothing, a restarted one serves again; key
 * names carry no token content. Every situation is forced (flush waits for
 * the writer; SIGKILL kills the server), never waited for by luck.
 * Callers: ctest (test_tier_redis, memcheck.test_tier_redis).
 */
#include "tier_support.h"

#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>

#include "kvpager/tier_redis.h"
#include "redis_server.h"

#define NS "t20"

static kvpt_redis_server server;

static int stop_server(void **state)
{
    (void)state;
    kvpt_redis_stop(&server);
    return 0;
}

static void start_server(void)
{
    if (!kvpt_redis_start(&server, NULL)) {
        fail_msg("redis-server did not start: %s", server.why);
    }
}

/* A Redis tier on the test's server: its own connections (another process's view). */
static kvp_tier *redis_tier(void)
{
    char url[96];
    snprintf(url, sizeof url, "redis://127.0.0.1:%u/0", server.port);
    kvp_tier_redis_config c;
    kvp_tier_redis_config_init(&c);
    c.url = url;
    c.name_space = NS;
    c.connect_timeout_ms = 20000; /* no timeout under Valgrind on a loaded machine */
    c.command_timeout_ms = 20000;
    c.backoff_min_ms = 0; /* a restarted server is reconnected by the next batch */
    c.backoff_max_ms = 1;
    kvp_tier *tier = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_redis_create(&c, &tier, &err), &err);
    assert_string_equal(kvp_tier_name(tier), "redis");
    return tier;
}

static kvp_tier_redis_stats redis_stats(kvp_tier *tier)
{
    kvp_tier_redis_stats s;
    kvp_tier_redis_stats_init(&s);
    kvp_error err;
    kvpt_assert_ok(kvp_tier_redis_stats_get(tier, &s, &err), &err);
    return s;
}

static void flush(kvp_tier *tier)
{
    kvp_error err;
    kvpt_assert_ok(kvp_tier_redis_flush(tier, 10000, &err), &err);
}

static void attach_secret(kvp_pool *pool, kvp_tier *tier, unsigned char seed)
{
    kvp_tier_policy policy;
    kvp_tier_policy_init(&policy);
    secret_fill(policy.secret, seed);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_tier_attach(pool, tier, &policy, &err), &err);
}

/*
 * A pool whose key secret every "process" of the test shares: chain keys and
 * binding digests are keyed by it, so pools that share a tier must agree on
 * it (DESIGN.md, "The Redis tier").
 */
static kvp_pool *shared_pool(size_t block_tokens, size_t heads, size_t head_width, size_t pages)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = block_tokens;
    config.heads = heads;
    config.head_width = head_width;
    config.budget_bytes = pages * 2 * heads * block_tokens * head_width * sizeof(double);
    for (size_t i = 0; i < KVPT_COUNT_OF(config.key_secret); i++) {
        config.key_secret[i] = 0x5eed0000u + i;
    }
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    assert_int_equal(kvpt_stats(pool).total_pages, pages);
    return pool;
}

/* A direct connection to the server, for looking at and tampering with keys. */
static redisContext *direct(void)
{
    redisContext *c = redisConnect("127.0.0.1", (int)server.port);
    assert_non_null(c);
    assert_int_equal(c->err, 0);
    return c;
}

static void key_name(const kvp_block_key *k, char name[64])
{
    snprintf(name, 64, "kvp:" NS ":%016llx%016llx", (unsigned long long)k->hi,
             (unsigned long long)k->lo);
}

/* The value stored under `k` (malloc'd), *len its length; NULL when absent. */
static unsigned char *value_of(redisContext *c, const kvp_block_key *k, size_t *len)
{
    char name[64];
    key_name(k, name);
    redisReply *r = redisCommand(c, "GET %s", name);
    assert_non_null(r);
    unsigned char *out = NULL;
    *len = 0;
    if (r->type == REDIS_REPLY_STRING) {
        out = malloc(r->len);
        memcpy(out, r->str, r->len);
        *len = r->len;
    }
    freeReplyObject(r);
    return out;
}

static void set_value(redisContext *c, const kvp_block_key *k, const void *data, size_t len)
{
    char name[64];
    key_name(k, name);
    redisReply *r = redisCommand(c, "SET %s %b", name, data, len);
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_STATUS);
    freeReplyObject(r);
}

/* Every key on the server (SCAN), each checked to be "kvp:t20:" + 32 hex digits. */
static size_t scan_keys(redisContext *c)
{
    regex_t re;
    assert_int_equal(regcomp(&re, "^kvp:" NS ":[0-9a-f]{32}$", REG_EXTENDED | REG_NOSUB), 0);
    size_t keys = 0;
    char cursor[32] = "0";
    do {
        redisReply *r = redisCommand(c, "SCAN %s COUNT 100", cursor);
        assert_non_null(r);
        assert_int_equal(r->type, REDIS_REPLY_ARRAY);
        snprintf(cursor, sizeof cursor, "%s", r->element[0]->str);
        for (size_t i = 0; i < r->element[1]->elements; i++) {
            const char *name = r->element[1]->element[i]->str;
            if (regexec(&re, name, 0, NULL, 0) != 0) {
                fail_msg("key name %s is not kvp:" NS ":<32 hex>", name);
            }
            keys++;
        }
        freeReplyObject(r);
    } while (strcmp(cursor, "0") != 0);
    regfree(&re);
    return keys;
}

/* One load of `n` blocks into `cache`: the count loaded and why the run stopped. */
static size_t load(kvp_cache *cache, const kvp_block_key *keys, size_t n, kvp_status *stop)
{
    size_t loaded = 99;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_group_tier_load(&cache, 1, keys, n, &loaded, stop, &err), &err);
    return loaded;
}

/*
 * A load that rejects everything: nothing mapped, the cache and pool as
 * they were, `rejections` counted under `field`'s offset.
 */
static void expect_rejected(kvp_pool *pool, kvp_cache *cache, const kvp_block_key *keys,
                            size_t n, size_t field, uint64_t rejections)
{
    kvpt_state before;
    kvpt_state_capture(cache, pool, &before);
    kvp_pool_tier_stats ts = tier_stats(pool);
    kvp_status stop = KVP_OK;
    assert_int_equal(load(cache, keys, n, &stop), 0);
    assert_int_equal(stop, KVP_TIER_BLOCK_REJECTED);
    kvpt_assert_state_unchanged(&before, cache, pool, 0);
    kvpt_state_free(&before);
    kvp_pool_tier_stats now = tier_stats(pool);
    uint64_t was;
    uint64_t is;
    memcpy(&was, (const char *)&ts + field, sizeof was);
    memcpy(&is, (const char *)&now + field, sizeof is);
    assert_int_equal(is, was + rejections);
    assert_int_equal(now.rejected, ts.rejected + rejections);
    assert_int_equal(now.loads, ts.loads);
}

/* ---- pool -> Redis -> another pool: external cache --------------------------------- */

enum { B = 2, PAGES = 8 };

/* Pool 1 publishes 2 blocks x 2 lanes, evicts them to Redis; keys[3 * B] (the third never written). */
static void evict_to_redis(kvp_pool *pool, kvp_tier *tier, kvp_block_key *keys, double *k,
                           double *v, size_t n)
{
    kvp_cache *a = published_cache(pool, B, keys);
    chain_keys(a, B, 3, 0.0, keys);
    export_rows(a, n, k, v);
    kvpt_destroy_cache(a, pool);
    churn(pool, PAGES);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(tier_stats(pool).writes, 4);
    assert_int_equal(tier_stats(pool).write_failures, 0);
    flush(tier);
    kvp_tier_redis_stats s = redis_stats(tier);
    assert_int_equal(s.puts, 4);
    assert_int_equal(s.writes, 4);
    assert_int_equal(s.bytes_written, 4 * block_bytes(pool));
    assert_int_equal(s.queue_drops + s.write_errors, 0);
}

static void test_redis_tier_second_pool_loads_bit_identical_rows(void **state)
{
    (void)state;
    start_server();
    kvp_pool *p1 = shared_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_pool *p2 = shared_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *t1 = redis_tier();
    kvp_tier *t2 = redis_tier();
    attach(p1, t1, 0);
    attach(p2, t2, 0);
    size_t n = B * KV_HEADS * 2 * BT * HEAD_WIDTH;
    double *ka = kvpt_doubles(n);
    double *va = kvpt_doubles(n);
    kvp_block_key keys[3 * B];
    evict_to_redis(p1, t1, keys, ka, va, n);
    redisContext *rc = direct();
    assert_int_equal(scan_keys(rc), 4); /* names: namespace and hex only */

    kvp_cache *c = external_cache(p2, B, 1);
    kvp_status stop = KVP_FULL;
    assert_int_equal(load(c, keys, 3, &stop), 2);
    kvpt_assert_pool_ok(p2);
    assert_int_equal(stop, KVP_OK); /* block 2 was never written: a miss */
    double *kc = kvpt_doubles(n);
    double *vc = kvpt_doubles(n);
    export_rows(c, n, kc, vc);
    assert_memory_equal(kc, ka, n * sizeof(double));
    assert_memory_equal(vc, va, n * sizeof(double));
    kvp_pool_tier_stats ts = tier_stats(p2);
    assert_int_equal(ts.loads, 4);
    assert_int_equal(ts.load_bytes, 4 * block_bytes(p2));
    assert_int_equal(ts.misses, B);
    assert_int_equal(ts.rejected + ts.load_failures, 0);
    kvp_tier_redis_stats s2 = redis_stats(t2);
    assert_int_equal(s2.round_trips, 1); /* one pipelined GET batch */
    assert_int_equal(s2.lookups, 6);
    assert_int_equal(s2.hits, 4);
    assert_int_equal(s2.misses, 2);
    assert_int_equal(s2.bytes_read, 4 * block_bytes(p2));
    assert_int_equal(s2.connects, 1);
    kvpt_destroy_cache(c, p2);

    /* contains: the stored sizes, one round trip. */
    kvp_tier_block q[3];
    memset(q, 0, sizeof q);
    q[0].key = keys[0];
    q[1].key = keys[3];
    q[2].key = keys[4];
    kvp_error err;
    kvpt_assert_ok(kvp_tier_run(t2, KVP_TIER_CONTAINS, q, 3, &err), &err);
    assert_int_equal(q[0].bytes, block_bytes(p2));
    assert_int_equal(q[1].bytes, block_bytes(p2));
    assert_int_equal(q[2].bytes, 0);
    assert_int_equal(q[0].status + q[1].status + q[2].status, KVP_OK);
    assert_int_equal(redis_stats(t2).round_trips, 2);

    /* A revision bump (another binding) is refused the blocks. */
    kvp_cache *revised = external_cache(p2, B, 2);
    expect_rejected(p2, revised, keys, 2, offsetof(kvp_pool_tier_stats, rejected_binding), 4);
    kvpt_destroy_cache(revised, p2);

    /* A pool under another secret rejects them all (MAC). */
    kvp_pool *p3 = shared_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *t3 = redis_tier();
    attach_secret(p3, t3, 2);
    kvp_cache *o = external_cache(p3, B, 1);
    expect_rejected(p3, o, keys, 2, offsetof(kvp_pool_tier_stats, rejected_mac), 4);
    kvpt_destroy_cache(o, p3);
    detach_and_destroy(p3, t3);
    destroy_pool(p3);

    free(ka);
    free(va);
    free(kc);
    free(vc);
    redisFree(rc);
    detach_and_destroy(p1, t1);
    detach_and_destroy(p2, t2);
    destroy_pool(p1);
    destroy_pool(p2);
}

/*
 * Values tampered with in Redis: garbage of the right size (MAC), another
 * key's block (key), a short value (size: header), a long one (the tier
 * fails the block BUFFER_TOO_SMALL: rejected by size too). None is mapped.
 */
static void test_redis_tier_tampered_values_rejected(void **state)
{
    (void)state;
    start_server();
    kvp_pool *p1 = shared_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_pool *p2 = shared_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *t1 = redis_tier();
    kvp_tier *t2 = redis_tier();
    attach(p1, t1, 0);
    attach(p2, t2, 0);
    size_t n = B * KV_HEADS * 2 * BT * HEAD_WIDTH;
    double *ka = kvpt_doubles(n);
    double *va = kvpt_doubles(n);
    kvp_block_key keys[3 * B];
    evict_to_redis(p1, t1, keys, ka, va, n);
    redisContext *rc = direct();
    size_t bytes = block_bytes(p2);
    size_t len0 = 0;
    size_t len1 = 0;
    unsigned char *good0 = value_of(rc, &keys[0], &len0);
    unsigned char *good1 = value_of(rc, &keys[B], &len1); /* block 1, lane 0 */
    assert_int_equal(len0, bytes);
    assert_int_equal(len1, bytes);
    kvp_cache *c = external_cache(p2, 1, 1); /* lane 0 only: keys[0], keys[B] */
    kvp_block_key lane0[2] = {keys[0], keys[B]};

    unsigned char *junk = malloc(bytes + 1);
    memcpy(junk, good0, bytes);
    junk[bytes - 1] ^= 0x40; /* the payload's last byte */
    set_value(rc, &keys[0], junk, bytes);
    expect_rejected(p2, c, lane0, 2, offsetof(kvp_pool_tier_stats, rejected_mac), 1);
    set_value(rc, &keys[0], good1, bytes); /* block 1's bytes under block 0's key */
    expect_rejected(p2, c, lane0, 2, offsetof(kvp_pool_tier_stats, rejected_key), 1);
    set_value(rc, &keys[0], good0, bytes - 1);
    expect_rejected(p2, c, lane0, 2, offsetof(kvp_pool_tier_stats, rejected_header), 1);

    memcpy(junk, good0, bytes);
    junk[bytes] = 0;
    set_value(rc, &keys[0], junk, bytes + 1);
    kvpt_state before;
    kvpt_state_capture(c, p2, &before);
    kvp_pool_tier_stats ts = tier_stats(p2);
    kvp_status stop = KVP_OK;
    assert_int_equal(load(c, lane0, 2, &stop), 0);
    assert_int_equal(stop, KVP_TIER_BLOCK_REJECTED);
    kvpt_assert_state_unchanged(&before, c, p2, 0);
    kvpt_state_free(&before);
    assert_int_equal(tier_stats(p2).load_failures, ts.load_failures);
    assert_int_equal(tier_stats(p2).rejected_header, ts.rejected_header + 1);
    assert_int_equal(redis_stats(t2).too_big, 1);

    /* Put back: it loads. */
    set_value(rc, &keys[0], good0, bytes);
    assert_int_equal(load(c, lane0, 2, &stop), 2);
    assert_int_equal(stop, KVP_OK);
    kvpt_assert_pool_ok(p2);
    kvpt_destroy_cache(c, p2);
    free(junk);
    free(good0);
    free(good1);
    free(ka);
    free(va);
    redisFree(rc);
    detach_and_destroy(p1, t1);
    detach_and_destroy(p2, t2);
    destroy_pool(p1);
    destroy_pool(p2);
}

/* ---- a layer-bound cache: attention outputs ------------------------------------------ */

#define LHW (D / HEADS)

/*
 * A layer's two blocks go from pool 1 through Redis into pool 2: the next
 * token's output and weights are bit-identical (the exact level). A cache
 * of a layer over other weights is refused them (binding).
 */
static void test_redis_tier_layer_bound_outputs_bit_identical(void **state)
{
    (void)state;
    enum { LP = 6 };
    start_server();
    kvp_pool *p1 = shared_pool(BT, HEADS, LHW, LP);
    kvp_pool *p2 = shared_pool(BT, HEADS, LHW, LP);
    kvp_tier *t1 = redis_tier();
    kvp_tier *t2 = redis_tier();
    attach(p1, t1, 0);
    attach(p2, t2, 0);
    kvp_layer *layer = kvpt_random_layer(D, HEADS, SCAP, BASE, 31);
    kvp_layer *other = kvpt_random_layer(D, HEADS, SCAP, BASE, 33);
    kvp_binding binding;
    kvp_binding other_binding;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvpt_assert_ok(kvp_layer_binding_get(other, &other_binding, &err), &err);
    double inputs[(2 * BT + 1) * D];
    kvpt_fill_random(inputs, KVPT_COUNT_OF(inputs), 32);
    kvp_cache *a = kvpt_cache(p1, &binding, 1, SCAP);
    attend(layer, a, p1, inputs, 2 * BT);
    kvp_block_key keys[2];
    for (size_t j = 0; j < 2; j++) {
        kvpt_assert_ok(kvp_block_key_chain(j == 0 ? NULL : &keys[0], a, inputs + j * BT * D,
                                           BT * D * sizeof(double), NULL, &keys[j], &err),
                       &err);
        kvpt_assert_ok(kvp_cache_publish_block(a, 0, j, &keys[j], &err), &err);
    }
    double out_a[D];
    double w_a[HEADS * (2 * BT + 1)];
    probe(layer, a, p1, inputs + 2 * BT * D, out_a, w_a);
    kvpt_destroy_cache(a, p1);
    kvp_cache *filler = kvpt_cache(p1, &other_binding, 1, SCAP);
    double many[LP * BT * D];
    kvpt_fill_random(many, KVPT_COUNT_OF(many), 34);
    attend(other, filler, p1, many, LP * BT);
    kvpt_destroy_cache(filler, p1);
    assert_int_equal(tier_stats(p1).writes, 2);
    flush(t1);
    assert_int_equal(redis_stats(t1).writes, 2);

    kvp_cache *wrong = kvpt_cache(p2, &other_binding, 1, SCAP);
    expect_rejected(p2, wrong, keys, 2, offsetof(kvp_pool_tier_stats, rejected_binding), 2);
    kvpt_destroy_cache(wrong, p2);
    kvp_cache *c = kvpt_cache(p2, &binding, 1, SCAP);
    kvp_status stop = KVP_FULL;
    assert_int_equal(load(c, keys, 2, &stop), 2);
    assert_int_equal(stop, KVP_OK);
    kvpt_assert_pool_ok(p2);
    double out_c[D];
    double w_c[HEADS * (2 * BT + 1)];
    probe(layer, c, p2, inputs + 2 * BT * D, out_c, w_c);
    assert_memory_equal(out_c, out_a, sizeof out_a);
    assert_memory_equal(w_c, w_a, sizeof w_a);
    attend(layer, c, p2, inputs + 2 * BT * D, 1);
    assert_int_equal(kvp_cache_len(c), 2 * BT + 1);
    kvpt_destroy_cache(c, p2);
    kvpt_destroy_layer(layer);
    kvpt_destroy_layer(other);
    detach_and_destroy(p1, t1);
    detach_and_destroy(p2, t2);
    destroy_pool(p1);
    destroy_pool(p2);
}

/* ---- host in front of Redis ---------------------------------------------------------- */

/*
 * Pool 2 behind host+Redis: the first load misses the host and hits Redis
 * (4 blocks promoted into the host); after pool 2 evicts them again (written
 * back to both), the second load is served by the host alone: Redis sees no
 * lookup.
 */
static void test_redis_tier_composed_with_host(void **state)
{
    (void)state;
    start_server();
    kvp_pool *p1 = shared_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_pool *p2 = shared_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *t1 = redis_tier();
    kvp_tier *far = redis_tier();
    kvp_tier *near = host_tier(1 << 20);
    kvp_tier *both = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_compose_create(near, far, &both, &err), &err);
    attach(p1, t1, 0);
    attach(p2, both, 0);
    size_t n = B * KV_HEADS * 2 * BT * HEAD_WIDTH;
    double *ka = kvpt_doubles(n);
    double *va = kvpt_doubles(n);
    kvp_block_key keys[3 * B];
    evict_to_redis(p1, t1, keys, ka, va, n);

    kvp_cache *c = external_cache(p2, B, 1);
    kvp_status stop = KVP_FULL;
    assert_int_equal(load(c, keys, 2, &stop), 2);
    assert_int_equal(stop, KVP_OK);
    kvp_tier_host_stats h = host_stats(near);
    assert_int_equal(h.misses, 4);
    assert_int_equal(h.hits, 0);
    assert_int_equal(h.puts, 4); /* promoted */
    assert_int_equal(h.blocks, 4);
    kvp_tier_redis_stats r = redis_stats(far);
    assert_int_equal(r.round_trips, 1);
    assert_int_equal(r.lookups, 4);
    assert_int_equal(r.hits, 4);
    double *kc = kvpt_doubles(n);
    double *vc = kvpt_doubles(n);
    export_rows(c, n, kc, vc);
    assert_memory_equal(kc, ka, n * sizeof(double));
    assert_memory_equal(vc, va, n * sizeof(double));
    kvpt_destroy_cache(c, p2);
    churn(p2, PAGES); /* evicted again: written to both tiers */
    assert_int_equal(tier_stats(p2).writes, 4);
    assert_int_equal(tier_stats(p2).write_failures, 0);
    flush(far);
    r = redis_stats(far);
    assert_int_equal(r.writes, 4);
    assert_int_equal(host_stats(near).puts, 8);

    c = external_cache(p2, B, 1);
    assert_int_equal(load(c, keys, 2, &stop), 2);
    assert_int_equal(stop, KVP_OK);
    h = host_stats(near);
    assert_int_equal(h.hits, 4);
    assert_int_equal(h.misses, 4);
    kvp_tier_redis_stats r2 = redis_stats(far);
    assert_int_equal(r2.lookups, r.lookups); /* the host served all four */
    assert_int_equal(r2.round_trips, r.round_trips);
    export_rows(c, n, kc, vc);
    assert_memory_equal(kc, ka, n * sizeof(double));
    kvpt_destroy_cache(c, p2);
    free(ka);
    free(va);
    free(kc);
    free(vc);
    kvpt_assert_ok(kvp_pool_tier_detach(p2, &err), &err);
    kvpt_assert_ok(kvp_tier_destroy(both, &err), &err);
    kvpt_assert_ok(kvp_tier_destroy(near, &err), &err);
    kvpt_assert_ok(kvp_tier_destroy(far, &err), &err);
    detach_and_destroy(p1, t1);
    destroy_pool(p1);
    destroy_pool(p2);
}

/* ---- the server down, then back --------------------------------------------------------- */

static void test_redis_tier_down_then_back(void **state)
{
    (void)state;
    start_server();
    kvp_pool *p1 = shared_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_pool *p2 = shared_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *t1 = redis_tier();
    kvp_tier *t2 = redis_tier();
    attach(p1, t1, 0);
    attach(p2, t2, 0);
    size_t n = B * KV_HEADS * 2 * BT * HEAD_WIDTH;
    double *ka = kvpt_doubles(n);
    double *va = kvpt_doubles(n);
    kvp_block_key keys[3 * B];
    evict_to_redis(p1, t1, keys, ka, va, n);
    redisContext *rc = direct();
    unsigned char *saved[4];
    size_t len = 0;
    for (size_t i = 0; i < 4; i++) {
        saved[i] = value_of(rc, &keys[i], &len);
        assert_non_null(saved[i]);
        assert_int_equal(len, block_bytes(p2));
    }
    redisFree(rc);
    kvp_cache *c = external_cache(p2, B, 1);
    kvp_status stop = KVP_FULL;
    /* A first load connects t2's reader (so the next failure is a reconnect). */
    kvp_block_key missing[B] = {keys[2 * B], keys[2 * B + 1]};
    assert_int_equal(load(c, missing, 1, &stop), 0);
    assert_int_equal(stop, KVP_OK);

    kvpt_redis_kill(&server);
    kvpt_state before;
    kvpt_state_capture(c, p2, &before);
    kvp_pool_tier_stats ts = tier_stats(p2);
    assert_int_equal(load(c, keys, 2, &stop), 0);
    assert_int_equal(stop, KVP_TIER_UNAVAILABLE);
    kvpt_assert_state_unchanged(&before, c, p2, 0);
    kvpt_state_free(&before);
    kvp_pool_tier_stats now = tier_stats(p2);
    assert_int_equal(now.load_failures, ts.load_failures + 4);
    assert_int_equal(now.loads, ts.loads);
    assert_int_equal(now.misses, ts.misses);
    assert_true(redis_stats(t2).errors >= 1);

    if (!kvpt_redis_restart(&server)) {
        fail_msg("redis-server did not restart: %s", server.why);
    }
    rc = direct();
    for (size_t i = 0; i < 4; i++) {
        set_value(rc, &keys[i], saved[i], len);
        free(saved[i]);
    }
    redisFree(rc);
    assert_int_equal(load(c, keys, 2, &stop), 2);
    assert_int_equal(stop, KVP_OK);
    kvpt_assert_pool_ok(p2);
    double *kc = kvpt_doubles(n);
    double *vc = kvpt_doubles(n);
    export_rows(c, n, kc, vc);
    assert_memory_equal(kc, ka, n * sizeof(double));
    assert_memory_equal(vc, va, n * sizeof(double));
    kvp_tier_redis_stats s = redis_stats(t2);
    assert_int_equal(s.reconnects, 1);
    kvpt_destroy_cache(c, p2);
    free(ka);
    free(va);
    free(kc);
    free(vc);
    detach_and_destroy(p1, t1);
    detach_and_destroy(p2, t2);
    destroy_pool(p1);
    destroy_pool(p2);
}

/* ---- constructor and getters -------------------------------------------------------- */

static void test_redis_tier_bad_config_changes_nothing(void **state)
{
    (void)state;
    kvp_tier_redis_config c;
    kvp_tier_redis_config_init(&c);
    kvp_tier *tier = (kvp_tier *)(uintptr_t)0x1;
    kvp_error err;
    assert_int_equal(kvp_tier_redis_create(&c, &tier, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "url");
    c.url = "redis://alice:hunter2secret@127.0.0.1:99999/0";
    assert_int_equal(kvp_tier_redis_create(&c, &tier, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "url");
    assert_string_equal(err.what, "port");
    char text[512];
    kvp_error_format(&err, text, sizeof text);
    assert_null(strstr(text, "hunter2secret"));
    c.url = "redis://127.0.0.1:6379/0";
    c.name_space = "no spaces";
    assert_int_equal(kvp_tier_redis_create(&c, &tier, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "name_space");
    c.name_space = NULL;
    c.struct_size = 0;
    assert_int_equal(kvp_tier_redis_create(&c, &tier, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "struct_size");
    assert_ptr_equal(tier, (kvp_tier *)(uintptr_t)0x1);
    /* A host tier is no Redis tier. */
    kvp_tier *host = host_tier(100);
    kvp_tier_redis_stats s;
    kvp_tier_redis_stats_init(&s);
    assert_int_equal(kvp_tier_redis_stats_get(host, &s, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "tier");
    assert_int_equal(kvp_tier_redis_flush(host, 1, &err), KVP_INVALID_ARGUMENT);
    assert_int_equal(kvp_tier_redis_flush(NULL, 1, &err), KVP_NULL_ARGUMENT);
    kvpt_assert_ok(kvp_tier_destroy(host, &err), &err);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_redis_tier_second_pool_loads_bit_identical_rows,
                                  stop_server),
        cmocka_unit_test_teardown(test_redis_tier_tampered_values_rejected, stop_server),
        cmocka_unit_test_teardown(test_redis_tier_layer_bound_outputs_bit_identical,
                                  stop_server),
        cmocka_unit_test_teardown(test_redis_tier_composed_with_host, stop_server),
        cmocka_unit_test_teardown(test_redis_tier_down_then_back, stop_server),
        cmocka_unit_test(test_redis_tier_bad_config_changes_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
