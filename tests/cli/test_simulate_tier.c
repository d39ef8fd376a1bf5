/*
 * test_simulate_tier.c: `kvpager simulate --tier redis://...` against a real
 * redis-server the test starts on its own loopback port
 * (tests/redis_server.c); a server that cannot start fails the test, never
 * skips it.
 *
 * Two processes, one Redis: the same simulate run twice (write-through, so
 * the first run's every published block is in Redis when it exits; its
 * Redis writes are flushed at close). The second computes at most a fifth
 * of the first's prompt tokens, loads the rest, and its outputs are the
 * first's (the output checksum, and --verify's recompute of every request
 * from scratch: 0 mismatches). A run under another secret file shares
 * nothing (its pool keys differ: every block a miss) and computes as the
 * first did. Every value in Redis corrupted (a flipped byte, a truncation,
 * another key's block) between two runs: the next run rejects them, counts
 * them and computes the same outputs (--verify: 0 mismatches). A full
 * Redis (maxmemory 1, noeviction): its writes fail (it holds no key after
 * the run), nothing else does. A run whose Redis is down completes with the
 * same outputs, its errors counted.
 * Usage: test_simulate_tier KVPAGER (the program under test).
 * Callers: ctest (test_simulate_tier).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>
#include <hiredis/hiredis.h>

#include "../redis_server.h"
#include "sim_json.h"

static const char *kvpager;
static kvpt_redis_server server;
static char dir[64];

typedef struct run_figures {
    int exit_code;
    unsigned long long prefill_tokens;
    unsigned long long completed;
    unsigned long long verify_mismatches;
    unsigned long long hit_blocks;
    unsigned long long hit_tokens;
    unsigned long long rejected;
    unsigned long long errors;
    unsigned long long writes;
    unsigned long long write_failures;
    char checksum[64];
} run_figures;

static void write_file(const char *path, const char *content)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(content, f);
    assert_int_equal(fclose(f), 0);
}

/* One simulate run against the test's server under secret file `secret`. */
static run_figures simulate(const char *secret)
{
    char command[2048];
    snprintf(command, sizeof command,
             "'%s' simulate --requests 6 --layers 1 --model-width 32 --heads 2 "
             "--block-tokens 8 --prompt-mean 64 --output-mean 8 --capacity 256 --seed 5 "
             "--tier redis://127.0.0.1:%u --tier-secret-file %s/%s --tier-policy publish "
             "--tier-loads always --verify 1 --json --quiet 2>%s/stderr",
             kvpager, server.port, dir, secret, dir);
    static char json[1 << 16];
    run_figures r;
    memset(&r, 0, sizeof r);
    r.exit_code = json_run(command, json, sizeof json);
    assert_int_equal(r.exit_code, 0);
    r.prefill_tokens = json_number(json, "prefill_tokens");
    r.completed = json_number(json, "requests_completed");
    r.verify_mismatches = json_number(json, "verify_mismatches");
    const char *tier = strstr(json, "\"tier\":{");
    assert_non_null(tier);
    r.hit_blocks = json_number(tier, "hit_blocks");
    r.hit_tokens = json_number(tier, "hit_tokens");
    r.rejected = json_number(tier, "rejected");
    r.errors = json_number(tier, "errors");
    r.writes = json_number(tier, "writes");
    r.write_failures = json_number(tier, "write_failures");
    json_text(json, "output_checksum", r.checksum, sizeof r.checksum);
    return r;
}

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/kvp-sim-tier-XXXXXX");
    assert_non_null(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/secret", dir);
    write_file(path, "a deployment secret of this test, 42 bytes\n");
    snprintf(path, sizeof path, "%s/other", dir);
    write_file(path, "another deployment's secret, not this one\n");
    if (!kvpt_redis_start(&server, NULL)) {
        fail_msg("redis-server did not start: %s", server.why); /* never a skip */
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    kvpt_redis_stop(&server);
    char command[160];
    snprintf(command, sizeof command, "rm -rf '%s'", dir);
    return system(command) == 0 ? 0 : -1;
}

static run_figures first;

static void test_simulate_tier_second_process_loads_the_first_ones_blocks(void **state)
{
    (void)state;
    first = simulate("secret");
    run_figures second = simulate("secret");
    assert_int_equal(first.completed, 6);
    assert_int_equal(second.completed, 6);
    assert_int_equal(first.hit_blocks, 0); /* a fresh server */
    assert_true(first.writes > 0);
    assert_int_equal(first.write_failures, 0); /* the writer wrote every block */
    assert_true(second.hit_blocks > 0);
    assert_int_equal(second.hit_tokens, second.hit_blocks * 8);
    assert_true(second.prefill_tokens * 5 <= first.prefill_tokens); /* <= 20% */
    assert_int_equal(first.prefill_tokens - second.prefill_tokens, second.hit_tokens);
    assert_int_equal(second.rejected, 0);
    assert_int_equal(second.errors, 0);
    assert_string_equal(first.checksum, second.checksum);
    assert_int_equal(first.verify_mismatches, 0);
    assert_int_equal(second.verify_mismatches, 0);
}

static void test_simulate_tier_another_secret_shares_nothing(void **state)
{
    (void)state;
    run_figures other = simulate("other");
    assert_int_equal(other.hit_blocks, 0);
    assert_int_equal(other.prefill_tokens, first.prefill_tokens);
    assert_string_equal(other.checksum, first.checksum);
    assert_int_equal(other.verify_mismatches, 0);
}

/* A direct connection to the test's server (tampering from outside, as another writer). */
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

static long long dbsize(redisContext *c)
{
    redisReply *r = redisCommand(c, "DBSIZE");
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_INTEGER);
    long long n = r->integer;
    freeReplyObject(r);
    return n;
}

static void test_simulate_tier_corrupt_values_are_rejected(void **state)
{
    (void)state;
    redisContext *c = direct();
    redisReply *keys = redisCommand(c, "KEYS *");
    assert_non_null(keys);
    assert_int_equal(keys->type, REDIS_REPLY_ARRAY);
    assert_true(keys->elements >= 3); /* the first runs' blocks */
    for (size_t i = 0; i < keys->elements; i++) {
        const char *key = keys->element[i]->str;
        const char *other = keys->element[(i + 1) % keys->elements]->str;
        redisReply *v = redisCommand(c, "GET %s", i % 3 == 2 ? other : key);
        assert_non_null(v);
        assert_int_equal(v->type, REDIS_REPLY_STRING);
        size_t len = v->len;
        if (i % 3 == 0) {
            v->str[len / 2] ^= 0x10; /* a flipped byte */
        } else if (i % 3 == 1) {
            len /= 2; /* truncated */
        }                /* else another key's (valid) block */
        redisReply *w = redisCommand(c, "SET %s %b", key, v->str, len);
        assert_non_null(w);
        assert_int_equal(w->type, REDIS_REPLY_STATUS);
        freeReplyObject(w);
        freeReplyObject(v);
    }
    freeReplyObject(keys);
    redisFree(c);
    run_figures r = simulate("secret");
    assert_int_equal(r.completed, 6);
    assert_int_equal(r.hit_blocks, 0); /* never mapped */
    assert_true(r.rejected > 0);       /* counted */
    assert_int_equal(r.errors, 0);
    assert_int_equal(r.prefill_tokens, first.prefill_tokens);
    assert_string_equal(r.checksum, first.checksum);
    assert_int_equal(r.verify_mismatches, 0);
}

static void test_simulate_tier_full_redis_fails_writes_only(void **state)
{
    (void)state;
    redisContext *c = direct();
    command_ok(c, "FLUSHALL");
    command_ok(c, "CONFIG SET maxmemory-policy noeviction");
    command_ok(c, "CONFIG SET maxmemory 1"); /* below an empty server's use: writes fail */
    run_figures r = simulate("secret");
    long long held = dbsize(c);
    command_ok(c, "CONFIG SET maxmemory 0");
    redisFree(c);
    assert_int_equal(held, 0); /* every write failed ... */
    assert_true(r.writes > 0);
    assert_int_equal(r.write_failures, r.writes); /* ... and the report says so (the writer's) */
    assert_int_equal(r.completed, 6); /* ... and nothing else did */
    assert_int_equal(r.errors, 0);
    assert_int_equal(r.rejected, 0);
    assert_int_equal(r.hit_blocks, 0);
    assert_int_equal(r.prefill_tokens, first.prefill_tokens);
    assert_string_equal(r.checksum, first.checksum);
    assert_int_equal(r.verify_mismatches, 0);
}

static void test_simulate_tier_redis_down_completes_without_it(void **state)
{
    (void)state;
    kvpt_redis_kill(&server);
    run_figures down = simulate("secret");
    assert_true(kvpt_redis_restart(&server));
    assert_int_equal(down.completed, 6);
    assert_int_equal(down.hit_blocks, 0);
    assert_true(down.errors > 0); /* the counters say the tier failed */
    assert_int_equal(down.prefill_tokens, first.prefill_tokens);
    assert_string_equal(down.checksum, first.checksum);
    assert_int_equal(down.verify_mismatches, 0);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_simulate_tier KVPAGER\n");
        return 2;
    }
    kvpager = argv[1];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_simulate_tier_second_process_loads_the_first_ones_blocks),
        cmocka_unit_test(test_simulate_tier_another_secret_shares_nothing),
        cmocka_unit_test(test_simulate_tier_corrupt_values_are_rejected),
        cmocka_unit_test(test_simulate_tier_full_redis_fails_writes_only),
        cmocka_unit_test(test_simulate_tier_redis_down_completes_without_it),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
