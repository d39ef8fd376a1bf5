/*
 * test_redis_store.c: the Redis store of blocks (src/serve/redis_store.h)
 * against a real redis-server that each test starts on its own loopback
 * port and stops (tests/redis_server.h). A server that cannot start fails
 * the test; nothing is skipped.
 *
 * Every situation is forced, never waited for by luck: a full write queue
 * by holding the writer, a busy reader by blocking in a completion, a dead
 * server by SIGKILL, a silent one by SIGSTOP; the one timing bound (a
 * command timeout) is checked from below by the clock and from above with
 * seconds of slack.
 * Callers: ctest (test_redis_store, memcheck.test_redis_store).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>
#include <hiredis/hiredis.h>
#include <pthread.h>

#include "redis_server.h"
#include "serve/redis_store.h"

#define START(server, extra)                                                                   \
    do {                                                                                       \
        if (!kvpt_redis_start((server), (extra))) {                                            \
            fail_msg("redis-server did not start: %s", (server)->why);                         \
        }                                                                                      \
    } while (0)

/* The test's server; the teardown stops it even when the test failed. */
static kvpt_redis_server server;

static int stop_server(void **state) {
    (void)state;
    kvpt_redis_stop(&server);
    return 0;
}

static kvp_block_key key_of(uint64_t i) {
    kvp_block_key k = {.lo = 0x9e3779b97f4a7c15ull * (i + 1), .hi = 0xc2b2ae3d27d4eb4full ^ i};
    return k;
}

static void url_of(const kvpt_redis_server *s, const char *userinfo, char *buf, size_t size) {
    snprintf(buf, size, "redis://%s127.0.0.1:%u/0", userinfo, s->port);
}

static kvpi_redis_store *open_store(const char *url, kvpi_redis_config *c) {
    c->url = url;
    kvpi_redis_store *st = NULL;
    kvpi_redis_error err;
    kvpi_redis_code code = kvpi_redis_create(c, &st, &err);
    if (code != KVPI_REDIS_OK) {
        fail_msg("kvpi_redis_create: %s: %s", kvpi_redis_code_name(code), err.text);
    }
    return st;
}

static void expect_ok(kvpi_redis_code code, const kvpi_redis_error *err) {
    if (code != KVPI_REDIS_OK) {
        fail_msg("%s: %s", kvpi_redis_code_name(code), err->text);
    }
}

/* Block i: `length` bytes, a pattern of i. Not inlined: gcc -O3 unrolls it
 * for a constant small length and then warns of writes past the end
 * (-Wstringop-overflow) on paths the length excludes. */
__attribute__((noinline)) static void fill_block(unsigned char *buf, size_t length, uint64_t i) {
    for (size_t b = 0; b < length; b++) {
        buf[b] = (unsigned char)(i * 31 + b * 7 + (b >> 8));
    }
}

/* Puts blocks [0, n) of `length` + 37 * i bytes and waits for them. */
static void put_blocks(kvpi_redis_store *st, size_t n, size_t length) {
    for (size_t i = 0; i < n; i++) {
        size_t len = length + 37 * i;
        unsigned char *buf = malloc(len);
        assert_non_null(buf);
        fill_block(buf, len, i);
        kvp_block_key k = key_of(i);
        const void *data[1] = {buf};
        kvpi_redis_error err;
        size_t accepted = 0;
        expect_ok(kvpi_redis_put(st, &k, data, &len, 1, &accepted, &err), &err);
        assert_int_equal(accepted, 1);
        free(buf);
    }
    kvpi_redis_error err;
    expect_ok(kvpi_redis_drain(st, 10000, &err), &err);
}

/* ---- URLs and key names ---------------------------------------------------------- */

static void test_url_parse_good(void **state) {
    (void)state;
    static const struct {
        const char *text, *host, *user, *password;
        unsigned port, db;
        const char *shown;
    } cases[] = {
        {"redis://127.0.0.1:6379/0", "127.0.0.1", "", "", 6379, 0, "redis://127.0.0.1:6379/0"},
        {"redis://localhost", "localhost", "", "", 6379, 0, "redis://localhost:6379/0"},
        {"redis://cache-1.example:1/", "cache-1.example", "", "", 1, 0,
         "redis://cache-1.example:1/0"},
        {"redis://:s3cret@h:6380/15", "h", "", "s3cret", 6380, 15, "redis://:***@h:6380/15"},
        {"redis://alice:p%40ss%3Aw0rd@r1:65535/2147483647", "r1", "alice", "p@ss:w0rd", 65535,
         2147483647u, "redis://alice:***@r1:65535/2147483647"},
        {"redis://[::1]:7000/3", "::1", "", "", 7000, 3, "redis://[::1]:7000/3"},
        {"redis://h/4", "h", "", "", 6379, 4, "redis://h:6379/4"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvpi_redis_url url;
        kvpi_redis_error err;
        kvpi_redis_code code = kvpi_redis_url_parse(cases[i].text, &url, &err);
        if (code != KVPI_REDIS_OK) {
            fail_msg("%s: %s", cases[i].text, err.text);
        }
        assert_string_equal(url.host, cases[i].host);
        assert_string_equal(url.user, cases[i].user);
        assert_string_equal(url.password, cases[i].password);
        assert_int_equal(url.port, cases[i].port);
        assert_int_equal(url.db, cases[i].db);
        char shown[256];
        kvpi_redis_url_format(&url, shown, sizeof shown);
        assert_string_equal(shown, cases[i].shown);
    }
}

static void test_url_parse_bad(void **state) {
    (void)state;
    static const struct {
        const char *text, *part, *message;
    } cases[] = {
        {"", "url", "redis URL is empty"},
        {"127.0.0.1:6379", "scheme", "redis URL has no scheme (want redis://host:port/db)"},
        {"rediss://h:1/0", "scheme", "redis URL scheme \"rediss\" is not supported (want redis)"},
        {"REDIS://h", "scheme", "redis URL scheme \"REDIS\" is not supported (want redis)"},
        {"redis://", "host", "redis URL host is empty"},
        {"redis://:1/0", "host", "redis URL host is empty"},
        {"redis://h_x:1", "host",
         "redis URL host \"h_x\" has a byte other than letters, digits, '-' and '.'"},
        {"redis://[::1:1/0", "host", "redis URL host \"[::1:1/0\" has no closing ']'"},
        {"redis://[::g]:1/0", "host", "redis URL host \"[::g]\" is not an IPv6 address"},
        {"redis://h:0/0", "port", "redis URL port \"0\" is not a number from 1 to 65535"},
        {"redis://h:65536", "port", "redis URL port \"65536\" is not a number from 1 to 65535"},
        {"redis://h:/0", "port", "redis URL port \"\" is not a number from 1 to 65535"},
        {"redis://h:012/0", "port", "redis URL port \"012\" is not a number from 1 to 65535"},
        {"redis://h:-1/0", "port", "redis URL port \"-1\" is not a number from 1 to 65535"},
        {"redis://h:1/x", "database",
         "redis URL database \"x\" is not a number from 0 to 2147483647"},
        {"redis://h:1/2147483648", "database",
         "redis URL database \"2147483648\" is not a number from 0 to 2147483647"},
        {"redis://h:1/0?timeout=5", "database",
         "redis URL database \"0?timeout=5\" is not a number from 0 to 2147483647"},
        {"redis://alice@h:1", "password",
         "redis URL names user \"alice\" but no password (want user:password@)"},
        {"redis://alice:@h:1", "password", "redis URL password is empty"},
        {"redis://a:b@c@h:1", "password",
         "redis URL has more than one '@' (write '@' in a password as %40)"},
        {"redis://alice:hunter%2@h:1", "password",
         "redis URL password has a byte that must be %-escaped, or a bad %-escape"},
        {"redis://alice:hunter%00x@h:1", "password", "redis URL password holds a NUL (%00)"},
        {"redis://al/ce:hunter2@h:1", "user",
         "redis URL user has a byte that must be %-escaped, or a bad %-escape"},
        {"redis://alice:hunter2@h:99999", "port",
         "redis URL port \"99999\" is not a number from 1 to 65535"},
        {"redis://al ice:pw@h", "url",
         "redis URL has a space, control or non-ASCII byte at offset 10"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvpi_redis_url url, before;
        memset(&url, 0x5a, sizeof url);
        before = url;
        kvpi_redis_error err;
        kvpi_redis_code code = kvpi_redis_url_parse(cases[i].text, &url, &err);
        if (code != KVPI_REDIS_BAD_URL) {
            fail_msg("%s parsed (%s)", cases[i].text, kvpi_redis_code_name(code));
        }
        assert_string_equal(err.part, cases[i].part);
        assert_string_equal(err.text, cases[i].message);
        assert_memory_equal(&url, &before, sizeof url); /* nothing changed */
        assert_null(strstr(err.text, "hunter"));         /* never the password */
    }
    /* create refuses the same URLs, with the same error */
    kvpi_redis_config c = {.url = "redis://h:0"};
    kvpi_redis_store *st = (kvpi_redis_store *)&c;
    kvpi_redis_error err;
    assert_int_equal(kvpi_redis_create(&c, &st, &err), KVPI_REDIS_BAD_URL);
    assert_string_equal(err.part, "port");
    assert_ptr_equal(st, (kvpi_redis_store *)&c);
}

static void test_key_names(void **state) {
    (void)state;
    kvp_block_key k = {.lo = 0x0123456789abcdefull, .hi = 0xfedcba9876543210ull};
    char name[KVPI_REDIS_KEY_MAX];
    assert_int_equal(kvpi_redis_key_name(NULL, &k, name), 36);
    assert_string_equal(name, "kvp:fedcba98765432100123456789abcdef");
    kvpi_redis_key_name("llama3-8b_r2", &k, name);
    assert_string_equal(name, "kvp:llama3-8b_r2:fedcba98765432100123456789abcdef");
    char longest[KVPI_REDIS_NAMESPACE_MAX + 1];
    memset(longest, 'n', KVPI_REDIS_NAMESPACE_MAX);
    longest[KVPI_REDIS_NAMESPACE_MAX] = '\0';
    assert_true(kvpi_redis_namespace_valid(longest));
    assert_int_equal(kvpi_redis_key_name(longest, &k, name), KVPI_REDIS_KEY_MAX - 1);
    assert_false(kvpi_redis_namespace_valid(""));
    assert_false(kvpi_redis_namespace_valid("a:b"));
    assert_false(kvpi_redis_namespace_valid("a b"));
    assert_false(kvpi_redis_namespace_valid("*"));
    kvpi_redis_config c = {.url = "redis://h:1/0", .name_space = "has space"};
    kvpi_redis_store *st = NULL;
    kvpi_redis_error err;
    assert_int_equal(kvpi_redis_create(&c, &st, &err), KVPI_REDIS_BAD_ARGUMENT);
    assert_string_equal(err.part, "name_space");
    assert_null(st);
    c.name_space = NULL;
    c.backoff_min_ms = 10;
    c.backoff_max_ms = 5;
    assert_int_equal(kvpi_redis_create(&c, &st, &err), KVPI_REDIS_BAD_ARGUMENT);
    assert_string_equal(err.part, "backoff_min_ms");
}

/* ---- against a server ------------------------------------------------------------ */

/* Blocks put then got back byte for byte; a short buffer gets TOO_BIG. */
static void test_put_get_round_trip(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, NULL);
    char url[128];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 5000};
    kvpi_redis_store *st = open_store(url, &c);
    enum { N = 8, LEN = 4096 };
    put_blocks(st, N, LEN);
    kvp_block_key keys[N];
    kvpi_redis_value values[N];
    unsigned char *bufs[N];
    size_t total = 0;
    for (size_t i = 0; i < N; i++) {
        keys[i] = key_of(i);
        bufs[i] = malloc(LEN + 37 * N);
        assert_non_null(bufs[i]);
        values[i] = (kvpi_redis_value){.data = bufs[i], .capacity = LEN + 37 * N};
        total += LEN + 37 * i;
    }
    values[N - 1].capacity = LEN; /* shorter than block N-1 */
    kvpi_redis_error err;
    expect_ok(kvpi_redis_get(st, keys, N, values, &err), &err);
    for (size_t i = 0; i < N; i++) {
        size_t len = LEN + 37 * i;
        assert_int_equal(values[i].length, len);
        if (i == N - 1) {
            assert_int_equal(values[i].found, KVPI_REDIS_TOO_BIG);
            continue;
        }
        assert_int_equal(values[i].found, KVPI_REDIS_HIT);
        unsigned char *want = malloc(len);
        assert_non_null(want);
        fill_block(want, len, i);
        assert_memory_equal(bufs[i], want, len);
        free(want);
    }
    kvpi_redis_stats stats;
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.puts, N);
    assert_int_equal(stats.writes, N);
    assert_int_equal(stats.bytes_written, total);
    assert_int_equal(stats.bytes_read, total - (LEN + 37 * (N - 1)));
    assert_int_equal(stats.too_big, 1);
    assert_true(stats.read_ns > 0 && stats.write_ns > 0);
    assert_int_equal(stats.hits, N);
    assert_int_equal(stats.queue_drops + stats.write_errors + stats.errors, 0);
    assert_int_equal(stats.connects, 2); /* the writer's and the reader's */
    assert_int_equal(stats.queued + stats.queued_bytes, 0);
    for (size_t i = 0; i < N; i++) {
        free(bufs[i]);
    }
    kvpi_redis_destroy(st);
    kvpt_redis_stop(srv);
}

/* A prompt's whole chain: one round trip per lookup, hits and misses counted. */
static void test_batch_is_one_round_trip(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, NULL);
    char url[128];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 5000};
    kvpi_redis_store *st = open_store(url, &c);
    enum { PRESENT = 24, N = 64 };
    put_blocks(st, PRESENT, 64);
    kvpi_redis_error err;
    expect_ok(kvpi_redis_ping(st, &err), &err); /* the reader's connection */
    kvpi_redis_stats before, after;
    kvpi_redis_stats_get(st, &before);
    kvp_block_key keys[N];
    bool found[N];
    for (size_t i = 0; i < N; i++) {
        keys[i] = key_of(i);
    }
    expect_ok(kvpi_redis_contains(st, keys, N, found, &err), &err);
    kvpi_redis_stats_get(st, &after);
    assert_int_equal(after.round_trips, before.round_trips + 1);
    assert_int_equal(after.hits - before.hits, PRESENT);
    assert_int_equal(after.misses - before.misses, N - PRESENT);
    assert_int_equal(after.lookups - before.lookups, N);
    for (size_t i = 0; i < N; i++) {
        assert_int_equal(found[i], i < PRESENT);
    }
    /* misses of a get: MISS, length 0, the buffer untouched */
    static unsigned char buf[N][8];
    memset(buf, 0xee, sizeof buf);
    kvpi_redis_value values[N];
    for (size_t i = 0; i < N; i++) {
        keys[i] = key_of(1000 + i);
        values[i] = (kvpi_redis_value){.data = buf[i], .capacity = 8, .length = 99, .found = 7};
    }
    expect_ok(kvpi_redis_get(st, keys, N, values, &err), &err);
    kvpi_redis_stats_get(st, &before);
    assert_int_equal(before.round_trips, after.round_trips + 1);
    assert_int_equal(before.misses - after.misses, N);
    for (size_t i = 0; i < N; i++) {
        assert_int_equal(values[i].found, KVPI_REDIS_MISS);
        assert_int_equal(values[i].length, 0);
        assert_int_equal(buf[i][0], 0xee);
    }
    /* an empty batch: no round trip */
    expect_ok(kvpi_redis_contains(st, keys, 0, found, &err), &err);
    kvpi_redis_stats_get(st, &after);
    assert_int_equal(after.round_trips, before.round_trips);
    kvpi_redis_destroy(st);
    kvpt_redis_stop(srv);
}

static kvpi_redis_code try_url(const char *url, kvpi_redis_error *err) {
    kvpi_redis_config c = {.url = url, .command_timeout_ms = 5000};
    kvpi_redis_store *st = open_store(url, &c);
    kvpi_redis_code code = kvpi_redis_ping(st, err);
    if (code == KVPI_REDIS_OK) {
        kvp_block_key k = key_of(7);
        bool found = true;
        code = kvpi_redis_contains(st, &k, 1, &found, err);
        assert_false(found);
    }
    kvpi_redis_destroy(st);
    return code;
}

static void test_auth_requirepass(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, "requirepass s3cr%t");
    char url[160], want[256];
    kvpi_redis_error err;
    url_of(srv, ":s3cr%25t@", url, sizeof url);
    expect_ok(try_url(url, &err), &err);
    url_of(srv, "", url, sizeof url);
    assert_int_equal(try_url(url, &err), KVPI_REDIS_AUTH);
    snprintf(want, sizeof want, "redis at 127.0.0.1:%u refused AUTH: NOAUTH Authentication required.",
             srv->port);
    assert_string_equal(err.text, want);
    url_of(srv, ":wrong-secret@", url, sizeof url);
    assert_int_equal(try_url(url, &err), KVPI_REDIS_AUTH);
    assert_string_equal(err.part, "AUTH");
    assert_null(strstr(err.text, "wrong-secret"));
    assert_non_null(strstr(err.text, "refused AUTH: WRONGPASS"));
    kvpt_redis_stop(srv);
}

/* An ACL user (AUTH user pass) limited to the store's keys; the default user off. */
static void test_auth_acl_user(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, "user default off\nuser alice on >alice-pw ~kvp:* +@all");
    char url[160], want[256];
    kvpi_redis_error err;
    url_of(srv, "alice:alice-pw@", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 5000};
    kvpi_redis_store *st = open_store(url, &c);
    put_blocks(st, 3, 100);
    kvp_block_key keys[3] = {key_of(0), key_of(1), key_of(2)};
    bool found[3];
    expect_ok(kvpi_redis_contains(st, keys, 3, found, &err), &err);
    assert_true(found[0] && found[1] && found[2]);
    kvpi_redis_stats stats;
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.writes, 3); /* ~kvp:* let every SET through */
    kvpi_redis_destroy(st);
    url_of(srv, "alice:not-alices@", url, sizeof url);
    assert_int_equal(try_url(url, &err), KVPI_REDIS_AUTH);
    snprintf(want, sizeof want,
             "redis at 127.0.0.1:%u refused AUTH as user \"alice\": WRONGPASS invalid "
             "username-password pair or user is disabled.",
             srv->port);
    assert_string_equal(err.text, want);
    url_of(srv, "", url, sizeof url); /* the default user is off */
    assert_int_equal(try_url(url, &err), KVPI_REDIS_AUTH);
    kvpt_redis_stop(srv);
}

/* An error reply inside a batch (a key of another type): the batch fails
 * whole, outputs untouched, the connection stays (every reply was read). */
static void test_error_reply_in_batch(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, NULL);
    char url[128], want[256];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 5000};
    kvpi_redis_store *st = open_store(url, &c);
    put_blocks(st, 1, 10);
    kvp_block_key keys[3] = {key_of(0), key_of(1), key_of(2)};
    char name[KVPI_REDIS_KEY_MAX];
    kvpi_redis_key_name(NULL, &keys[1], name);
    redisContext *raw = redisConnect("127.0.0.1", (int)srv->port);
    assert_true(raw != NULL && raw->err == 0);
    redisReply *r = redisCommand(raw, "LPUSH %s x", name);
    assert_non_null(r);
    freeReplyObject(r);
    redisFree(raw);
    unsigned char bufs[3][64];
    memset(bufs, 0xab, sizeof bufs);
    kvpi_redis_value values[3];
    for (size_t i = 0; i < 3; i++) {
        values[i] = (kvpi_redis_value){.data = bufs[i], .capacity = 64, .length = 5, .found = 9};
    }
    kvpi_redis_error err;
    expect_ok(kvpi_redis_ping(st, &err), &err);
    kvpi_redis_stats before, after;
    kvpi_redis_stats_get(st, &before);
    assert_int_equal(kvpi_redis_get(st, keys, 3, values, &err), KVPI_REDIS_REPLY);
    snprintf(want, sizeof want,
             "redis at 127.0.0.1:%u answered GET with an error: WRONGTYPE Operation against a "
             "key holding the wrong kind of value",
             srv->port);
    assert_string_equal(err.text, want);
    assert_string_equal(err.part, "GET");
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(values[i].length, 5);
        assert_int_equal(values[i].found, 9);
        assert_int_equal(bufs[i][0], 0xab);
    }
    kvpi_redis_stats_get(st, &after);
    assert_int_equal(after.errors, before.errors + 1);
    assert_int_equal(after.hits + after.misses, before.hits + before.misses);
    bool found[3];
    expect_ok(kvpi_redis_contains(st, keys, 3, found, &err), &err); /* EXISTS has no type */
    assert_true(found[0] && found[1] && !found[2]);
    kvpi_redis_stats_get(st, &after);
    assert_int_equal(after.connects, before.connects); /* the same connection */
    kvpi_redis_destroy(st);
    kvpt_redis_stop(srv);
}

/* Killed, then restarted on the same port: both threads reconnect, no batch lost. */
static void test_reconnect_after_restart(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, NULL);
    char url[128];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 5000, .backoff_min_ms = 50,
                           .backoff_max_ms = 50};
    kvpi_redis_store *st = open_store(url, &c);
    put_blocks(st, 2, 100);
    kvp_block_key keys[2] = {key_of(0), key_of(1)};
    bool found[2] = {false, false};
    kvpi_redis_error err;
    expect_ok(kvpi_redis_contains(st, keys, 2, found, &err), &err);
    assert_true(found[0] && found[1]);
    kvpt_redis_kill(srv);
    found[0] = false;
    /* the old connection breaks; the one retry finds nothing listening */
    assert_int_equal(kvpi_redis_contains(st, keys, 2, found, &err), KVPI_REDIS_CONNECT);
    assert_string_equal(err.part, "connect");
    assert_false(found[0]); /* outputs unchanged on failure */
    if (!kvpt_redis_restart(srv)) {
        fail_msg("redis-server did not restart: %s", srv->why);
    }
    struct timespec wait = {0, 60000000L}; /* past the 50 ms backoff, by the clock */
    nanosleep(&wait, NULL);
    expect_ok(kvpi_redis_contains(st, keys, 2, found, &err), &err);
    assert_false(found[0] || found[1]); /* a fresh server: nothing saved */
    kvpi_redis_stats stats;
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.reconnects, 1);
    put_blocks(st, 2, 100); /* the writer's stale connection: retried at once */
    expect_ok(kvpi_redis_contains(st, keys, 2, found, &err), &err);
    assert_true(found[0] && found[1]);
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.reconnects, 2);
    assert_int_equal(stats.writes, 4);
    assert_int_equal(stats.write_errors, 0);
    kvpi_redis_destroy(st);
    kvpt_redis_stop(srv);
}

/* Down at start: create succeeds, the first call says why, the backoff holds retries. */
static void test_down_and_backoff(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, NULL);
    kvpt_redis_kill(srv);
    char url[128], want[160];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.backoff_min_ms = 60000, .backoff_max_ms = 60000};
    kvpi_redis_store *st = open_store(url, &c);
    kvpi_redis_error err;
    assert_int_equal(kvpi_redis_ping(st, &err), KVPI_REDIS_CONNECT);
    snprintf(want, sizeof want, "cannot connect to redis at 127.0.0.1:%u: Connection refused",
             srv->port);
    assert_string_equal(err.text, want);
    kvp_block_key k = key_of(0);
    bool found = true;
    assert_int_equal(kvpi_redis_contains(st, &k, 1, &found, &err), KVPI_REDIS_DOWN);
    snprintf(want, sizeof want, "redis at 127.0.0.1:%u is down; next attempt in ", srv->port);
    assert_memory_equal(err.text, want, strlen(want));
    assert_true(found);
    /* writes while down fail at once, counted; a put never waits */
    unsigned char block[32] = {1};
    const void *data[3] = {block, block, block};
    size_t lens[3] = {32, 32, 32};
    kvp_block_key keys[3] = {key_of(0), key_of(1), key_of(2)};
    size_t accepted = 0;
    expect_ok(kvpi_redis_put(st, keys, data, lens, 3, &accepted, &err), &err);
    assert_int_equal(accepted, 3);
    expect_ok(kvpi_redis_drain(st, 10000, &err), &err);
    kvpi_redis_stats stats;
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.write_errors, 3);
    assert_int_equal(stats.writes, 0);
    assert_int_equal(stats.errors, 2); /* one refused connect per thread; DOWN is no attempt */
    assert_int_equal(stats.connects, 0);
    assert_true(kvpi_redis_last_write_error(st, &err));
    assert_true(err.code == KVPI_REDIS_CONNECT || err.code == KVPI_REDIS_DOWN);
    kvpi_redis_destroy(st);
    kvpt_redis_stop(srv);
}

static double seconds_since(const struct timespec *t0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) * 1e-9;
}

/* A server that stops answering (SIGSTOP): TIMEOUT within the bound, then back. */
static void test_command_timeout(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, NULL);
    char url[128], want[160];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 200};
    kvpi_redis_store *st = open_store(url, &c);
    kvpi_redis_error err;
    expect_ok(kvpi_redis_ping(st, &err), &err);
    kvpt_redis_pause(srv, true);
    kvp_block_key k = key_of(0);
    bool found = true;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kvpi_redis_code code = kvpi_redis_contains(st, &k, 1, &found, &err);
    double took = seconds_since(&t0);
    kvpt_redis_pause(srv, false);
    assert_int_equal(code, KVPI_REDIS_TIMEOUT);
    snprintf(want, sizeof want, "redis at 127.0.0.1:%u did not answer EXISTS within 200 ms",
             srv->port);
    assert_string_equal(err.text, want);
    assert_string_equal(err.part, "EXISTS");
    assert_true(took >= 0.19);
    assert_true(took < 0.2 + 5.0); /* the bound, with slack for Valgrind */
    assert_true(found);
    expect_ok(kvpi_redis_contains(st, &k, 1, &found, &err), &err);
    assert_false(found);
    kvpi_redis_stats stats;
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.timeouts, 1);
    assert_int_equal(stats.reconnects, 1);
    kvpi_redis_destroy(st);
    kvpt_redis_stop(srv);
}

/* Destroy against a silent server: one batch waits out the timeout, the rest
 * fail at once (20 batches of one would wait 20 timeouts, >= 4 s). */
static void test_destroy_with_silent_server(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, NULL);
    char url[128];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 200, .write_batch = 1};
    kvpi_redis_store *st = open_store(url, &c);
    kvpi_redis_error err;
    expect_ok(kvpi_redis_ping(st, &err), &err);
    kvpi_redis_hold_writes(st, true);
    enum { N = 20 };
    unsigned char block[8] = {0};
    for (size_t i = 0; i < N; i++) {
        kvp_block_key k = key_of(i);
        const void *data[1] = {block};
        size_t len = sizeof block;
        expect_ok(kvpi_redis_put(st, &k, data, &len, 1, NULL, &err), &err);
    }
    kvpt_redis_pause(srv, true);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kvpi_redis_destroy(st);
    double took = seconds_since(&t0);
    kvpt_redis_pause(srv, false);
    assert_true(took >= 0.19); /* the first batch did wait its timeout */
    assert_true(took < 2.0);
    kvpt_redis_stop(srv);
}

/* A held writer: the queue fills exactly, the rest drop (counted), nothing waits. */
static void test_queue_drops(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, NULL);
    char url[128];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 5000, .queue_entries = 4};
    kvpi_redis_store *st = open_store(url, &c);
    kvpi_redis_hold_writes(st, true);
    enum { N = 6 };
    unsigned char blocks[N][16];
    const void *data[N];
    size_t lens[N];
    kvp_block_key keys[N];
    for (size_t i = 0; i < N; i++) {
        fill_block(blocks[i], 16, i);
        data[i] = blocks[i];
        lens[i] = 16;
        keys[i] = key_of(i);
    }
    size_t accepted = 0;
    kvpi_redis_error err;
    assert_int_equal(kvpi_redis_put(st, keys, data, lens, N, &accepted, &err),
                     KVPI_REDIS_QUEUE_FULL);
    assert_int_equal(accepted, 4);
    assert_string_equal(err.text,
                        "the redis write queue is full (4 blocks, 64 bytes): block dropped");
    kvpi_redis_stats stats;
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.queue_drops, 2);
    assert_int_equal(stats.queued, 4);
    assert_int_equal(stats.queued_bytes, 64);
    assert_int_equal(kvpi_redis_drain(st, 50, &err), KVPI_REDIS_TIMEOUT);
    assert_string_equal(err.text,
                        "the redis write queue did not drain within 50 ms (4 blocks queued)");
    kvpi_redis_hold_writes(st, false);
    expect_ok(kvpi_redis_drain(st, 10000, &err), &err);
    bool found[N];
    expect_ok(kvpi_redis_contains(st, keys, N, found, &err), &err);
    for (size_t i = 0; i < N; i++) {
        assert_int_equal(found[i], i < 4);
    }
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.writes, 4);
    assert_int_equal(stats.queued, 0);
    kvpi_redis_destroy(st);

    /* the byte bound: 3 blocks of 400 bytes into 1000 */
    c.queue_entries = 100;
    c.queue_bytes = 1000;
    st = open_store(url, &c);
    kvpi_redis_hold_writes(st, true);
    static unsigned char big[400];
    const void *bigs[3] = {big, big, big};
    size_t big_lens[3] = {400, 400, 400};
    assert_int_equal(kvpi_redis_put(st, keys, bigs, big_lens, 3, &accepted, &err),
                     KVPI_REDIS_QUEUE_FULL);
    assert_int_equal(accepted, 2);
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.queue_drops, 1);
    assert_int_equal(stats.queued_bytes, 800);
    kvpi_redis_destroy(st); /* writes what is queued, hold or not */
    st = open_store(url, &c);
    expect_ok(kvpi_redis_contains(st, keys, 3, found, &err), &err);
    assert_true(found[0] && found[1]);
    kvpi_redis_destroy(st);
    kvpt_redis_stop(srv);
}

/* Polls the store's writes until `want` (a 20 s bound: the lingers below are 60 s). */
static void wait_writes(kvpi_redis_store *st, uint64_t want) {
    kvpi_redis_stats stats;
    for (int tick = 0; tick < 2000; tick++) {
        kvpi_redis_stats_get(st, &stats);
        if (stats.writes >= want) {
            break;
        }
        struct timespec ten_ms = {0, 10000000L};
        nanosleep(&ten_ms, NULL);
    }
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.writes, want);
}

/* write_linger_us: a writer waiting for a fuller batch is cut short by a
 * full batch (written in one round trip, no drain needed), by a drain and by
 * destroy; nothing is lost. The linger (60 s) is far above any wait here, so
 * only those cut it short. */
static void test_write_linger(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, NULL);
    char url[128];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 5000, .write_batch = 4,
                           .write_linger_us = 60000000u};
    kvpi_redis_store *st = open_store(url, &c);
    enum { N = 6 };
    unsigned char blocks[N][16];
    const void *data[N];
    size_t lens[N];
    kvp_block_key keys[N];
    for (size_t i = 0; i < N; i++) {
        fill_block(blocks[i], 16, i);
        data[i] = blocks[i];
        lens[i] = 16;
        keys[i] = key_of(i);
    }
    kvpi_redis_error err;
    size_t accepted = 0;
    /* one block, then a drain: written at once */
    expect_ok(kvpi_redis_put(st, keys, data, lens, 1, &accepted, &err), &err);
    expect_ok(kvpi_redis_drain(st, 10000, &err), &err);
    kvpi_redis_stats before, after;
    kvpi_redis_stats_get(st, &before);
    assert_int_equal(before.writes, 1);
    /* a full batch of 4, one put at a time: written in one round trip, no drain */
    for (size_t i = 1; i <= 4; i++) {
        expect_ok(kvpi_redis_put(st, &keys[i], &data[i], &lens[i], 1, &accepted, &err), &err);
    }
    wait_writes(st, 5);
    kvpi_redis_stats_get(st, &after);
    assert_int_equal(after.round_trips, before.round_trips + 1);
    assert_int_equal(after.queued, 0);
    /* one block left lingering: destroy writes it */
    expect_ok(kvpi_redis_put(st, &keys[5], &data[5], &lens[5], 1, &accepted, &err), &err);
    kvpi_redis_destroy(st);
    st = open_store(url, &c);
    bool found[N];
    expect_ok(kvpi_redis_contains(st, keys, N, found, &err), &err);
    for (size_t i = 0; i < N; i++) {
        assert_true(found[i]);
    }
    kvpi_redis_destroy(st);
    kvpt_redis_stop(srv);
}

/* A full server (maxmemory, noeviction): writes fail with OOM, counted and
 * named; lookups go on. */
static void test_full_server(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, "maxmemory 1\nmaxmemory-policy noeviction");
    char url[128], want[256];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 5000};
    kvpi_redis_store *st = open_store(url, &c);
    kvpi_redis_error err;
    assert_false(kvpi_redis_last_write_error(st, &err));
    kvpi_redis_hold_writes(st, true); /* the three in one batch: one error */
    unsigned char block[100] = {0};
    const void *data[3] = {block, block, block};
    size_t lens[3] = {100, 100, 100};
    kvp_block_key keys[3] = {key_of(0), key_of(1), key_of(2)};
    expect_ok(kvpi_redis_put(st, keys, data, lens, 3, NULL, &err), &err);
    kvpi_redis_hold_writes(st, false);
    expect_ok(kvpi_redis_drain(st, 10000, &err), &err);
    kvpi_redis_stats stats;
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.write_errors, 3);
    assert_int_equal(stats.writes, 0);
    assert_int_equal(stats.errors, 1);
    assert_true(kvpi_redis_last_write_error(st, &err));
    assert_int_equal(err.code, KVPI_REDIS_REPLY);
    snprintf(want, sizeof want,
             "redis at 127.0.0.1:%u answered SET with an error: OOM command not allowed when "
             "used memory > 'maxmemory'.",
             srv->port);
    assert_string_equal(err.text, want);
    bool found[3] = {true, true, true};
    expect_ok(kvpi_redis_contains(st, keys, 3, found, &err), &err);
    assert_false(found[0] || found[1] || found[2]);
    kvpi_redis_destroy(st);
    kvpt_redis_stop(srv);
}

/* Key names: the prefix, the namespace and hex of the chain key; no payload; TTL. */
static void test_key_names_hold_no_payload(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, NULL);
    char url[128];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 5000, .name_space = "m1", .ttl_seconds = 100};
    kvpi_redis_store *st = open_store(url, &c);
    enum { N = 5 };
    char payload[N][64];
    const void *data[N];
    size_t lens[N];
    kvp_block_key keys[N];
    for (size_t i = 0; i < N; i++) {
        lens[i] = (size_t)snprintf(payload[i], sizeof payload[i], "TOKENS the quick %zu fox", i);
        data[i] = payload[i];
        keys[i] = key_of(i);
    }
    kvpi_redis_error err;
    expect_ok(kvpi_redis_put(st, keys, data, lens, N, NULL, &err), &err);
    expect_ok(kvpi_redis_drain(st, 10000, &err), &err);
    kvpi_redis_destroy(st);

    redisContext *raw = redisConnect("127.0.0.1", (int)srv->port);
    assert_non_null(raw);
    assert_int_equal(raw->err, 0);
    redisReply *r = redisCommand(raw, "KEYS *");
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_ARRAY);
    assert_int_equal(r->elements, N);
    for (size_t e = 0; e < r->elements; e++) {
        const char *name = r->element[e]->str;
        assert_int_equal(strlen(name), strlen("kvp:m1:") + 32);
        assert_memory_equal(name, "kvp:m1:", 7);
        assert_int_equal(strspn(name + 7, "0123456789abcdef"), 32);
        assert_null(strstr(name, "TOKENS"));
        bool known = false;
        for (size_t i = 0; i < N; i++) {
            char want[KVPI_REDIS_KEY_MAX];
            kvpi_redis_key_name("m1", &keys[i], want);
            known |= strcmp(want, name) == 0;
        }
        assert_true(known);
        redisReply *ttl = redisCommand(raw, "TTL %s", name);
        assert_non_null(ttl);
        assert_int_equal(ttl->type, REDIS_REPLY_INTEGER);
        assert_true(ttl->integer > 0 && ttl->integer <= 100);
        freeReplyObject(ttl);
        redisReply *value = redisCommand(raw, "GET %s", name);
        assert_non_null(value);
        assert_int_equal(value->type, REDIS_REPLY_STRING);
        assert_memory_equal(value->str, "TOKENS the quick ", 17);
        freeReplyObject(value);
    }
    freeReplyObject(r);
    redisFree(raw);
    kvpt_redis_stop(srv);
}

/* Lookups complete on the reader thread; a full reader queue refuses (counted). */
typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cond;
    int entered, released, completed;
    pthread_t thread;
} gate;

static void gated_done(kvpi_redis_lookup *lk, void *context) {
    gate *g = context;
    pthread_mutex_lock(&g->mu);
    g->thread = pthread_self();
    if (lk->count == 0) { /* the first lookup holds the reader here */
        g->entered = 1;
        pthread_cond_broadcast(&g->cond);
        while (!g->released) {
            pthread_cond_wait(&g->cond, &g->mu);
        }
    }
    g->completed++;
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->mu);
}

static void test_async_lookups(void **state) {
    (void)state;
    kvpt_redis_server *const srv = &server;
    START(srv, NULL);
    char url[128];
    url_of(srv, "", url, sizeof url);
    kvpi_redis_config c = {.command_timeout_ms = 5000, .read_jobs = 1};
    kvpi_redis_store *st = open_store(url, &c);
    put_blocks(st, 2, 10);
    gate g = {.entered = 0};
    pthread_mutex_init(&g.mu, NULL);
    pthread_cond_init(&g.cond, NULL);
    kvp_block_key keys[2] = {key_of(0), key_of(5)};
    bool found[2] = {false, true};
    kvpi_redis_lookup hold = {.done = gated_done, .context = &g};
    kvpi_redis_lookup real = {.keys = keys, .count = 2, .found = found, .done = gated_done,
                              .context = &g};
    kvpi_redis_lookup extra = real;
    kvpi_redis_error err;
    expect_ok(kvpi_redis_submit(st, &hold, &err), &err);
    pthread_mutex_lock(&g.mu);
    while (!g.entered) {
        pthread_cond_wait(&g.cond, &g.mu);
    }
    pthread_mutex_unlock(&g.mu);
    /* the reader is inside `hold`'s completion: one lookup may wait, not two */
    expect_ok(kvpi_redis_submit(st, &real, &err), &err);
    assert_int_equal(kvpi_redis_submit(st, &extra, &err), KVPI_REDIS_QUEUE_FULL);
    assert_string_equal(err.text, "the redis reader's queue holds 1 lookups already");
    pthread_mutex_lock(&g.mu);
    g.released = 1;
    pthread_cond_broadcast(&g.cond);
    while (g.completed < 2) {
        pthread_cond_wait(&g.cond, &g.mu);
    }
    pthread_mutex_unlock(&g.mu);
    assert_false(pthread_equal(g.thread, pthread_self()));
    assert_int_equal(real.error.code, KVPI_REDIS_OK);
    assert_true(found[0]);
    assert_false(found[1]);
    kvpi_redis_stats stats;
    kvpi_redis_stats_get(st, &stats);
    assert_int_equal(stats.read_drops, 1);
    kvpi_redis_destroy(st);
    pthread_cond_destroy(&g.cond);
    pthread_mutex_destroy(&g.mu);
    kvpt_redis_stop(srv);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_url_parse_good, stop_server),
        cmocka_unit_test_teardown(test_url_parse_bad, stop_server),
        cmocka_unit_test_teardown(test_key_names, stop_server),
        cmocka_unit_test_teardown(test_put_get_round_trip, stop_server),
        cmocka_unit_test_teardown(test_batch_is_one_round_trip, stop_server),
        cmocka_unit_test_teardown(test_auth_requirepass, stop_server),
        cmocka_unit_test_teardown(test_auth_acl_user, stop_server),
        cmocka_unit_test_teardown(test_error_reply_in_batch, stop_server),
        cmocka_unit_test_teardown(test_reconnect_after_restart, stop_server),
        cmocka_unit_test_teardown(test_down_and_backoff, stop_server),
        cmocka_unit_test_teardown(test_command_timeout, stop_server),
        cmocka_unit_test_teardown(test_destroy_with_silent_server, stop_server),
        cmocka_unit_test_teardown(test_queue_drops, stop_server),
        cmocka_unit_test_teardown(test_write_linger, stop_server),
        cmocka_unit_test_teardown(test_full_server, stop_server),
        cmocka_unit_test_teardown(test_key_names_hold_no_payload, stop_server),
        cmocka_unit_test_teardown(test_async_lookups, stop_server),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
