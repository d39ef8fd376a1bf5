/*
 * test_tier_faults.c: issue 20's faults at the level of a scheduler run
 * with a computed model and a Redis tier (kvpager/tier_redis.h) on a real
 * redis-server the test starts on its own loopback port
 * (tests/redis_server.h); a server that cannot start fails the test.
 *
 * Each test drives the scheduler step by step and compares every output bit
 * for bit with the same workload run without a tier (the exactness check),
 * audits the pool after every step, and forces each fault between steps:
 *   - Redis killed in the middle of a run, then restarted: no request
 *     fails, loads fail while it is down (counted), and after the restart
 *     the tier is written and read again (loads counted after it);
 *   - a Redis that stops answering (SIGSTOP) under a short command
 *     timeout: no step waits much past the timeout (measured), the
 *     timeouts and failed loads are counted;
 *   - values under the run's real keys corrupted, truncated, or written
 *     under another secret, by another model or another geometry: every one
 *     rejected, counted by reason, never mapped;
 *   - a full Redis (maxmemory, noeviction and allkeys-lru): writes fail,
 *     nothing else does.
 * Callers: ctest (test_tier_faults, memcheck.test_tier_faults,
 * helgrind.test_tier_faults).
 */
#include "sched_tier_support.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <hiredis/hiredis.h>

#include "kvpager/tier.h"
#include "kvpager/tier_redis.h"
#include "redis_server.h"

#define NS "faults"

/* ---- the server ------------------------------------------------------------------- */

static kvpt_redis_server server;

static int stop_server(void **state)
{
    (void)state;
    kvpt_redis_stop(&server);
    return 0;
}

static void start_server(const char *extra)
{
    if (!kvpt_redis_start(&server, extra)) {
        fail_msg("redis-server did not start: %s", server.why);
    }
}

/* A Redis tier on the test's server; timeout_ms for connects and commands. */
static kvp_tier *redis_tier(unsigned timeout_ms)
{
    char url[96];
    snprintf(url, sizeof url, "redis://127.0.0.1:%u/0", server.port);
    kvp_tier_redis_config c;
    kvp_tier_redis_config_init(&c);
    c.url = url;
    c.name_space = NS;
    c.connect_timeout_ms = timeout_ms;
    c.command_timeout_ms = timeout_ms;
    c.backoff_min_ms = 0; /* a restarted server is reconnected by the next batch */
    c.backoff_max_ms = 1;
    kvp_tier *tier = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_redis_create(&c, &tier, &err), &err);
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
    kvpt_assert_ok(kvp_tier_redis_flush(tier, 20000, &err), &err);
}

static redisContext *direct(void)
{
    redisContext *c = redisConnect("127.0.0.1", (int)server.port);
    assert_non_null(c);
    assert_int_equal(c->err, 0);
    return c;
}

static void command_ok(redisContext *c, const char *command)
{
    redisReply *r = redisCommand(c, command);
    assert_non_null(r);
    assert_int_not_equal(r->type, REDIS_REPLY_ERROR);
    freeReplyObject(r);
}

/* ---- a scheduler over a pool with the tier ----------------------------------------- */

static void setup(fixture *f, kvp_tier *tier, unsigned char secret, int write_through)
{
    /* every ask loads: no cost-model luck */
    setup_with(f, model, 1, tier, secret, write_through, KVP_TIER_LOADS_ALWAYS);
}

/*
 * The workload of the kill and full tests, without a tier: request 0 (group
 * 0), 1 and 2 (their own rows: they evict 0's blocks), 3 (group 0), 4
 * (group 1), 5 and 6 (evict 4's), 7 (group 1).
 */
static void plain_run(book *plain)
{
    memset(plain, 0, sizeof *plain);
    fixture f;
    setup(&f, NULL, 0, 0);
    serve(&f, plain, 0, 0, PROMPT);
    serve(&f, plain, 1, 0, 0);
    serve(&f, plain, 2, 0, 0);
    serve(&f, plain, 3, 0, PROMPT - 1);
    serve(&f, plain, 4, 1, PROMPT);
    serve(&f, plain, 5, 0, 0);
    serve(&f, plain, 6, 0, 0);
    serve(&f, plain, 7, 1, PROMPT - 1);
    teardown(&f);
}

/* ---- killed in the middle of a run, then restarted --------------------------------- */

static void test_tier_faults_redis_killed_mid_run_then_restarted(void **state)
{
    (void)state;
    static book plain, tiered;
    plain_run(&plain);
    memset(&tiered, 0, sizeof tiered);
    start_server(NULL);
    kvp_tier *tier = redis_tier(20000); /* no timeout under Valgrind on a loaded machine */
    fixture f;
    setup(&f, tier, 1, 0); /* write-back: evicted blocks go to Redis */

    /* Request 0 is admitted and computed; the server dies between two of its steps. */
    submit(&f, &tiered, 0, 0, PROMPT);
    step(&f);
    assert_int_equal(stats_of(&f).running, 1);
    kvpt_redis_kill(&server);
    finish(&f, &tiered, 0);
    /* 1 and 2 evict 0's blocks: the writes fail; 3's load fails: it computes. */
    serve(&f, &tiered, 1, 0, 0);
    serve(&f, &tiered, 2, 0, 0);
    flush(tier); /* every queued write has failed by now */
    serve(&f, &tiered, 3, 0, PROMPT - 1);
    kvp_scheduler_stats down = stats_of(&f);
    kvp_tier_redis_stats rdown = redis_stats(tier);
    assert_int_equal(down.tier_hit_blocks, 0);
    assert_true(down.tier_errors > 0); /* request 3's load failed */
    assert_true(rdown.errors > 0);
    assert_true(rdown.write_errors > 0); /* 0's evicted blocks were not written */
    assert_int_equal(rdown.writes, 0);

    /* The server comes back (empty: nothing is saved). 4 publishes group 1, 5 and 6
       evict it (written to Redis over reconnected connections), 7 loads it. */
    if (!kvpt_redis_restart(&server)) {
        fail_msg("redis-server did not restart: %s", server.why);
    }
    serve(&f, &tiered, 4, 1, PROMPT);
    serve(&f, &tiered, 5, 0, 0);
    serve(&f, &tiered, 6, 0, 0);
    flush(tier);
    serve(&f, &tiered, 7, 1, PROMPT - 1);
    kvp_scheduler_stats up = stats_of(&f);
    kvp_tier_redis_stats rup = redis_stats(tier);
    teardown(&f);
    kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL); /* joins its threads */

    assert_outputs_equal(&plain, &tiered, MAX_REQUESTS);
    assert_true(rup.writes > 0);     /* written again after the restart */
    assert_true(rup.reconnects > 0); /* over connections made again */
    assert_true(up.tier_hit_blocks > down.tier_hit_blocks); /* loads after the restart */
    assert_int_equal(up.tier_hit_tokens, up.tier_hit_blocks * BLOCK);
    assert_int_equal(up.tier_rejected, 0);
    assert_int_equal(up.tier_errors, down.tier_errors); /* no failure after the restart */
}

/* ---- a Redis that stops answering --------------------------------------------------- */

#define SLOW_TIMEOUT_MS 300

static void test_tier_faults_stalled_redis_never_stalls_a_step(void **state)
{
    (void)state;
    static book plain, tiered;
    memset(&plain, 0, sizeof plain);
    memset(&tiered, 0, sizeof tiered);
    fixture f;
    setup(&f, NULL, 0, 0);
    double base = 0.0;
    for (uint64_t id = 0; id < 4; id++) {
        double ms = serve(&f, &plain, id, 0, id == 0 ? PROMPT : id == 3 ? PROMPT - 1 : 0);
        base = ms > base ? ms : base;
    }
    teardown(&f);

    start_server(NULL);
    kvp_tier *tier = redis_tier(SLOW_TIMEOUT_MS);
    setup(&f, tier, 1, 1); /* write-through: every publish puts */
    serve(&f, &tiered, 0, 0, PROMPT);
    flush(tier); /* 0's blocks are in Redis */
    kvpt_redis_pause(&server, true); /* it accepts connections and never answers */
    double longest = 0.0;
    for (uint64_t id = 1; id < 4; id++) {
        double ms = serve(&f, &tiered, id, 0, id == 3 ? PROMPT - 1 : 0);
        longest = ms > longest ? ms : longest;
    }
    kvp_scheduler_stats s = stats_of(&f);
    kvp_tier_redis_stats r = redis_stats(tier);
    kvpt_redis_pause(&server, false);
    teardown(&f);
    kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL);

    assert_outputs_equal(&plain, &tiered, 4);
    /* Request 3's load waited on a server that never answers: one timed-out batch (a
       connect's handshake and the GET at most: 3 timeouts), never the server. */
    double bound = 3.0 * SLOW_TIMEOUT_MS + 4.0 * base + 1000.0;
    print_message("longest step %.1f ms (bound %.1f, without a tier %.1f)\n", longest, bound,
                  base);
    assert_true(longest <= bound);
    assert_true(r.timeouts > 0);
    assert_true(s.tier_errors > 0); /* request 3's pages were failed, not waited for */
    assert_int_equal(s.tier_hit_blocks, 0);
    assert_int_equal(s.tier_rejected, 0);
}

/* ---- values corrupted, truncated, foreign ------------------------------------------ */

typedef struct kv {
    char *key;
    unsigned char *value;
    size_t len;
} kv;

typedef struct dump {
    kv items[64];
    size_t count;
} dump;

/* Every key on the server and its value, sorted by key. */
static int kv_order(const void *a, const void *b)
{
    return strcmp(((const kv *)a)->key, ((const kv *)b)->key);
}

static void dump_all(dump *d)
{
    memset(d, 0, sizeof *d);
    redisContext *c = direct();
    redisReply *r = redisCommand(c, "KEYS kvp:" NS ":*");
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_ARRAY);
    assert_true(r->elements <= 64);
    for (size_t i = 0; i < r->elements; i++) {
        kv *it = &d->items[d->count++];
        it->key = strdup(r->element[i]->str);
        redisReply *v = redisCommand(c, "GET %s", it->key);
        assert_non_null(v);
        assert_int_equal(v->type, REDIS_REPLY_STRING);
        it->value = malloc(v->len);
        memcpy(it->value, v->str, v->len);
        it->len = v->len;
        freeReplyObject(v);
    }
    freeReplyObject(r);
    command_ok(c, "FLUSHALL");
    redisFree(c);
    qsort(d->items, d->count, sizeof d->items[0], kv_order);
}

static void dump_free(dump *d)
{
    for (size_t i = 0; i < d->count; i++) {
        free(d->items[i].key);
        free(d->items[i].value);
    }
}

static void set_raw(redisContext *c, const char *key, const void *data, size_t len)
{
    redisReply *r = redisCommand(c, "SET %s %b", key, data, len);
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_STATUS);
    freeReplyObject(r);
}

/* One "process": a fresh pool and scheduler serving group 0's prompt, written through. */
static void publish_run(kvp_model *m, size_t kv_heads, kvp_tier *tier, unsigned char secret,
                        book *b, kvp_scheduler_stats *stats)
{
    memset(b, 0, sizeof *b);
    fixture f;
    setup_with(&f, m, kv_heads, tier, secret, 1, KVP_TIER_LOADS_ALWAYS);
    serve(&f, b, 0, 0, PROMPT);
    if (stats != NULL) {
        *stats = stats_of(&f);
    }
    teardown(&f);
    flush(tier);
}

/*
 * The real keys of a run hold, in turn (key i: reason i % 4, variant (i / 4) % 2):
 *   0 header: truncated to half a header; "KVPT" magic flipped;
 *   1 mac:    a payload bit flipped; the same block under another secret;
 *   2 key:    another model's (other weights: another revision) valid block;
 *   3 geometry: a valid block of a model with another geometry.
 * A fresh "process" asking for the prompt rejects every one, by reason, maps
 * none, and computes outputs bit-identical to the original run's.
 */
static void test_tier_faults_corrupt_values_rejected_never_mapped(void **state)
{
    (void)state;
    static book original, reread, scratch;
    start_server(NULL);
    kvp_tier *tier = redis_tier(20000);
    dump other_secret, other_model, other_geometry, real;
    publish_run(model, 1, tier, 2, &scratch, NULL);
    dump_all(&other_secret);
    kvp_model *m2 = model_of(1, SEED + 1);
    publish_run(m2, 1, tier, 1, &scratch, NULL);
    dump_all(&other_model);
    kvp_model *mg = model_of(2, SEED);
    publish_run(mg, 2, tier, 1, &scratch, NULL);
    dump_all(&other_geometry);
    kvp_scheduler_stats one;
    publish_run(model, 1, tier, 1, &original, &one);
    dump_all(&real);

    /* At least the 8 adoptable blocks of both layers; another secret, same keys. */
    assert_true(real.count >= 8 * LAYERS && real.count <= 8 * LAYERS + 2);
    assert_int_equal(other_secret.count, real.count);
    assert_true(other_model.count > 0 && other_geometry.count > 0);
    redisContext *c = direct();
    for (size_t i = 0; i < real.count; i++) {
        const kv *it = &real.items[i];
        assert_string_equal(other_secret.items[i].key, it->key);
        assert_string_not_equal(other_model.items[i % other_model.count].key, it->key);
        unsigned char *v = malloc(it->len);
        memcpy(v, it->value, it->len);
        int variant = (int)((i / 4) % 2);
        switch (i % 4) {
        case 0:
            if (variant == 0) {
                set_raw(c, it->key, v, KVP_TIER_HEADER_BYTES / 2);
            } else {
                v[0] ^= 0x20;
                set_raw(c, it->key, v, it->len);
            }
            break;
        case 1:
            if (variant == 0) {
                v[it->len - 3] ^= 0x01;
                set_raw(c, it->key, v, it->len);
            } else {
                const kv *o = &other_secret.items[i];
                set_raw(c, it->key, o->value, o->len);
            }
            break;
        case 2: {
            const kv *o = &other_model.items[i % other_model.count];
            set_raw(c, it->key, o->value, o->len);
            break;
        }
        default: {
            const kv *o = &other_geometry.items[i % other_geometry.count];
            set_raw(c, it->key, o->value, o->len);
            break;
        }
        }
        free(v);
    }
    redisFree(c);

    memset(&reread, 0, sizeof reread);
    fixture f;
    setup(&f, tier, 1, 0);
    serve(&f, &reread, 0, 0, PROMPT);
    kvp_scheduler_stats two = stats_of(&f);
    kvp_pool_tier_stats pt;
    kvp_pool_tier_stats_init(&pt);
    kvpt_assert_ok(kvp_pool_tier_stats_get(f.pool, &pt, NULL), NULL);
    teardown(&f);
    kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL);
    kvpt_assert_ok(kvp_model_destroy(m2, NULL), NULL);
    kvpt_assert_ok(kvp_model_destroy(mg, NULL), NULL);

    assert_outputs_equal(&original, &reread, 1);
    assert_int_equal(two.tier_hit_blocks, 0);
    assert_int_equal(pt.loads, 0); /* never mapped */
    assert_int_equal(two.tier_rejected, 8 * LAYERS);
    assert_int_equal(pt.rejected, 8 * LAYERS);
    assert_int_equal(pt.rejected_header + pt.rejected_mac + pt.rejected_key +
                         pt.rejected_geometry + pt.rejected_binding,
                     8 * LAYERS);
    assert_true(pt.rejected_header > 0 && pt.rejected_mac > 0);
    assert_true(pt.rejected_key > 0 && pt.rejected_geometry > 0);
    assert_int_equal(two.prefill_tokens, one.prefill_tokens);
    dump_free(&other_secret);
    dump_free(&other_model);
    dump_free(&other_geometry);
    dump_free(&real);
}

/*
 * A value longer than a block of this pool (a larger geometry's block, or
 * garbage) under a real key: the Redis tier completes it BUFFER_TOO_SMALL
 * (it does not fit the block buffer, exactly header + page bytes), and the
 * load rejects it by size (tier_rejected, not tier_errors), never mapped.
 */
static void test_tier_faults_oversized_value_is_rejected(void **state)
{
    (void)state;
    static book original, reread;
    start_server(NULL);
    kvp_tier *tier = redis_tier(20000);
    kvp_scheduler_stats one;
    publish_run(model, 1, tier, 1, &original, &one);
    dump real;
    dump_all(&real);
    redisContext *c = direct();
    for (size_t i = 0; i < real.count; i++) {
        const kv *it = &real.items[i];
        unsigned char *v = malloc(2 * it->len);
        memcpy(v, it->value, it->len);
        memcpy(v + it->len, it->value, it->len);
        set_raw(c, it->key, v, 2 * it->len);
        free(v);
    }
    redisFree(c);
    memset(&reread, 0, sizeof reread);
    fixture f;
    setup(&f, tier, 1, 0);
    serve(&f, &reread, 0, 0, PROMPT);
    kvp_scheduler_stats two = stats_of(&f);
    teardown(&f);
    kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL);
    dump_free(&real);
    assert_outputs_equal(&original, &reread, 1);
    assert_int_equal(two.tier_hit_blocks, 0);
    assert_int_equal(two.tier_rejected, 8 * LAYERS);
    assert_int_equal(two.tier_errors, 0);
}

/* ---- a full Redis ------------------------------------------------------------------- */

static void test_tier_faults_full_redis_fails_writes_only(void **state)
{
    (void)state;
    static book plain, tiered;
    plain_run(&plain);
    const char *policies[] = {"noeviction", "allkeys-lru"};
    for (size_t p = 0; p < 2; p++) {
        char extra[128];
        /* below what an empty server uses: every write needs memory it cannot have */
        snprintf(extra, sizeof extra, "maxmemory 1\nmaxmemory-policy %s\n", policies[p]);
        start_server(extra);
        kvp_tier *tier = redis_tier(20000);
        memset(&tiered, 0, sizeof tiered);
        fixture f;
        setup(&f, tier, 1, 1); /* write-through: every publish writes */
        serve(&f, &tiered, 0, 0, PROMPT);
        serve(&f, &tiered, 1, 0, 0);
        serve(&f, &tiered, 2, 0, 0);
        flush(tier);
        serve(&f, &tiered, 3, 0, PROMPT - 1);
        serve(&f, &tiered, 4, 1, PROMPT);
        serve(&f, &tiered, 5, 0, 0);
        serve(&f, &tiered, 6, 0, 0);
        flush(tier);
        serve(&f, &tiered, 7, 1, PROMPT - 1);
        flush(tier);
        kvp_scheduler_stats s = stats_of(&f);
        kvp_tier_redis_stats r = redis_stats(tier);
        teardown(&f);
        kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL);
        kvpt_redis_stop(&server);

        assert_outputs_equal(&plain, &tiered, MAX_REQUESTS);
        assert_true(r.puts > 0);
        assert_true(r.write_errors > 0); /* writes fail ... */
        assert_int_equal(r.writes + r.write_errors, r.puts); /* every accepted put ended */
        assert_int_equal(s.tier_errors, 0); /* ... nothing else does: reads answer */
        assert_int_equal(s.tier_rejected, 0);
        assert_int_equal(s.tier_hit_blocks, 0); /* nothing was stored */
        assert_true(r.lookups > 0);
        assert_int_equal(r.hits, 0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_tier_faults_redis_killed_mid_run_then_restarted,
                                  stop_server),
        cmocka_unit_test_teardown(test_tier_faults_stalled_redis_never_stalls_a_step,
                                  stop_server),
        cmocka_unit_test_teardown(test_tier_faults_corrupt_values_rejected_never_mapped,
                                  stop_server),
        cmocka_unit_test_teardown(test_tier_faults_full_redis_fails_writes_only, stop_server),
        cmocka_unit_test_teardown(test_tier_faults_oversized_value_is_rejected, stop_server),
    };
    return cmocka_run_group_tests(tests, model_setup, model_teardown);
}
