/*
 * redis_store.c: what a prompt's chain costs through the Redis store
 * (src/serve/redis_store.h), against hiredis used directly, on a private
 * redis-server (tests/redis_server.c: its own 127.0.0.1 port, no
 * persistence) in the same run.
 *
 * One iteration handles a chain of --blocks blocks of --block-bytes bytes,
 * all present on the server:
 *   get, store            kvpi_redis_get: one pipelined round trip on the
 *                         reader thread, values copied into the caller's
 *                         buffers (what a tier load costs);
 *   get, raw pipelined    hiredis on this thread: GET appended per block,
 *                         then the replies read (the floor without the
 *                         store's thread hand-off and copies);
 *   get, raw one by one   hiredis: one GET round trip per block (what a
 *                         client without pipelining pays);
 *   contains, store       kvpi_redis_contains (EXISTS per block, one trip);
 *   contains, one by one  hiredis: one EXISTS round trip per block;
 *   put + drain, store    kvpi_redis_put of the chain, then kvpi_redis_drain
 *                         (the writer's pipelined SETs, write throughput).
 * The cases alternate repetition by repetition (src/cli/measure.h); each
 * figure is a median: microseconds per chain and MB/s of value bytes.
 * Before timing, the store's get returns exactly the bytes put (exit 1 if
 * not, or when the server or the store fails). Flags (bench/args.h; --help
 * lists them): --blocks N, --block-bytes N, --repetitions N, --min-ns X.
 * Exit status 0, 1 on a failure, 2 on a usage error. Speed is reported,
 * never enforced.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>

#include "args.h"
#include "measure.h"
#include "redis_server.h"
#include "serve/redis_store.h"

typedef struct bench {
    kvpi_redis_store *store;
    redisContext *raw;
    size_t blocks, bytes;
    kvp_block_key *keys;
    char (*names)[KVPI_REDIS_KEY_MAX];
    unsigned char *data;     /* blocks * bytes: block i at data + i * bytes */
    unsigned char *out;      /* the same size, for gets */
    kvpi_redis_value *values;
    bool *found;
    const void **pointers;
    size_t *lengths;
    int failed;
} bench;

static void check(bench *b, bool ok, const char *what) {
    if (!ok && !b->failed) {
        fprintf(stderr, "bench-redis-store: %s failed\n", what);
        b->failed = 1;
    }
}

static void get_store(void *ctx, size_t iterations) {
    bench *b = ctx;
    for (size_t it = 0; it < iterations; it++) {
        kvpi_redis_error err;
        check(b, kvpi_redis_get(b->store, b->keys, b->blocks, b->values, &err) == KVPI_REDIS_OK,
              "kvpi_redis_get");
    }
}

static void raw_pipelined(bench *b, const char *command, size_t iterations) {
    for (size_t it = 0; it < iterations; it++) {
        for (size_t i = 0; i < b->blocks; i++) {
            redisAppendCommand(b->raw, "%s %s", command, b->names[i]);
        }
        for (size_t i = 0; i < b->blocks; i++) {
            void *reply = NULL;
            check(b, redisGetReply(b->raw, &reply) == REDIS_OK && reply != NULL, command);
            if (reply != NULL) {
                freeReplyObject(reply);
            }
        }
    }
}

static void raw_one_by_one(bench *b, const char *command, size_t iterations) {
    for (size_t it = 0; it < iterations; it++) {
        for (size_t i = 0; i < b->blocks; i++) {
            redisReply *r = redisCommand(b->raw, "%s %s", command, b->names[i]);
            check(b, r != NULL && r->type != REDIS_REPLY_ERROR && r->type != REDIS_REPLY_NIL,
                  command);
            if (r != NULL) {
                freeReplyObject(r);
            }
        }
    }
}

static void get_raw_pipelined(void *ctx, size_t iterations) {
    raw_pipelined(ctx, "GET", iterations);
}

static void get_raw_one_by_one(void *ctx, size_t iterations) {
    raw_one_by_one(ctx, "GET", iterations);
}

static void contains_store(void *ctx, size_t iterations) {
    bench *b = ctx;
    for (size_t it = 0; it < iterations; it++) {
        kvpi_redis_error err;
        check(b, kvpi_redis_contains(b->store, b->keys, b->blocks, b->found, &err) ==
                         KVPI_REDIS_OK,
              "kvpi_redis_contains");
    }
}

static void contains_raw_one_by_one(void *ctx, size_t iterations) {
    raw_one_by_one(ctx, "EXISTS", iterations);
}

static void put_store(void *ctx, size_t iterations) {
    bench *b = ctx;
    for (size_t it = 0; it < iterations; it++) {
        kvpi_redis_error err;
        size_t accepted = 0;
        check(b, kvpi_redis_put(b->store, b->keys, b->pointers, b->lengths, b->blocks, &accepted,
                                &err) == KVPI_REDIS_OK,
              "kvpi_redis_put");
        check(b, kvpi_redis_drain(b->store, 60000, &err) == KVPI_REDIS_OK, "kvpi_redis_drain");
    }
}

static bool setup(bench *b, unsigned port) {
    size_t n = b->blocks;
    b->keys = calloc(n, sizeof *b->keys);
    b->names = calloc(n, sizeof *b->names);
    b->data = malloc(n * b->bytes);
    b->out = malloc(n * b->bytes);
    b->values = calloc(n, sizeof *b->values);
    b->found = calloc(n, sizeof *b->found);
    b->pointers = calloc(n, sizeof *b->pointers);
    b->lengths = calloc(n, sizeof *b->lengths);
    if (!b->keys || !b->names || !b->data || !b->out || !b->values || !b->found ||
        !b->pointers || !b->lengths) {
        return false;
    }
    uint64_t state = 0x5eed;
    for (size_t i = 0; i < n; i++) {
        b->keys[i] = (kvp_block_key){.lo = 0x9e3779b97f4a7c15ull * (i + 1), .hi = i};
        kvpi_redis_key_name("bench", &b->keys[i], b->names[i]);
        for (size_t j = 0; j < b->bytes; j++) {
            b->data[i * b->bytes + j] = (unsigned char)(kvp_measure_unit(&state) * 127.0);
        }
        b->pointers[i] = b->data + i * b->bytes;
        b->lengths[i] = b->bytes;
        b->values[i] = (kvpi_redis_value){.data = b->out + i * b->bytes, .capacity = b->bytes};
    }
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%u/0", port);
    kvpi_redis_config c = {.url = url, .name_space = "bench", .command_timeout_ms = 30000,
                           .queue_entries = n, .write_batch = 64};
    kvpi_redis_error err;
    if (kvpi_redis_create(&c, &b->store, &err) != KVPI_REDIS_OK) {
        fprintf(stderr, "bench-redis-store: %s\n", err.text);
        return false;
    }
    b->raw = redisConnect("127.0.0.1", (int)port);
    if (b->raw == NULL || b->raw->err != 0) {
        return false;
    }
    put_store(b, 1);
    get_store(b, 1);
    return !b->failed && memcmp(b->data, b->out, n * b->bytes) == 0;
}

static void teardown(bench *b) {
    kvpi_redis_destroy(b->store);
    if (b->raw != NULL) {
        redisFree(b->raw);
    }
    free(b->keys);
    free(b->names);
    free(b->data);
    free(b->out);
    free(b->values);
    free(b->found);
    free(b->pointers);
    free(b->lengths);
}

int main(int argc, char **argv) {
    size_t blocks = 16, bytes = 65536, repetitions = 9;
    double min_ns = 2e7;
    bench_arg table[] = {
        BENCH_SIZE("--blocks", &blocks, 1, 4096, "N", "blocks in the chain"),
        BENCH_SIZE("--block-bytes", &bytes, 1, (size_t)64 << 20, "N", "bytes of each block"),
        BENCH_SIZE("--repetitions", &repetitions, 1, 1000, "N", "alternating repetitions"),
        BENCH_DOUBLE("--min-ns", &min_ns, 1, 1e10, "X", "each sample's minimum duration"),
    };
    bench_args args = BENCH_ARGS("bench-redis-store",
                                 "A prompt's chain through the Redis store against hiredis.",
                                 table);
    int parsed = bench_args_parse(&args, argc, argv);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    kvpt_redis_server server;
    if (!kvpt_redis_start(&server, NULL)) {
        fprintf(stderr, "bench-redis-store: redis-server did not start: %s\n", server.why);
        return 1;
    }
    bench b = {.blocks = blocks, .bytes = bytes};
    int status = 1;
    if (!setup(&b, server.port)) {
        fprintf(stderr, "bench-redis-store: the store did not return the bytes put\n");
    } else {
        static const char *const names[] = {"get, store",          "get, raw pipelined",
                                            "get, raw one by one", "contains, store",
                                            "contains, one by one", "put + drain, store"};
        const kvp_measure_case cases[] = {
            {get_store, &b},      {get_raw_pipelined, &b},       {get_raw_one_by_one, &b},
            {contains_store, &b}, {contains_raw_one_by_one, &b}, {put_store, &b}};
        double ns[6];
        if (kvp_measure_alternating(cases, 6, repetitions, min_ns, ns) == 0 && !b.failed) {
            printf("private redis-server on 127.0.0.1; a chain of %zu blocks of %zu bytes; "
                   "medians of %zu alternating repetitions\n",
                   blocks, bytes, repetitions);
            printf("%-22s %12s %10s\n", "case", "us/chain", "MB/s");
            for (size_t i = 0; i < 6; i++) {
                bool moves_values = i < 3 || i == 5;
                printf("%-22s %12.1f", names[i], ns[i] / 1e3);
                if (moves_values) {
                    printf(" %10.1f\n", (double)(blocks * bytes) / ns[i] * 1e3);
                } else {
                    printf(" %10s\n", "-");
                }
            }
            status = 0;
        }
    }
    teardown(&b);
    kvpt_redis_stop(&server);
    return status;
}
