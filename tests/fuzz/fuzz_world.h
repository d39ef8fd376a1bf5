/*
 * fuzz_world.h: what the two single-file fuzz targets fuzz_scheduler.c and
 * fuzz_tier.c share (nothing else includes it; fuzz_api.c's files have
 * fuzz_common.h): the failure report (the operation's index and name, then
 * abort), CHECK, the input reader, the audit's mismatch printer, and the
 * pool their worlds are built on (a fixed key secret, so keys, and with
 * them index slots and coverage, repeat run to run).
 *
 * Invariants: nothing here reads the input but rd(), one byte a call (0
 * past the end), so a target consumes its input exactly as it did with its
 * own copies. Define FUZZ_WORLD_TARGET (the target's name in the report)
 * before including. Static inline; one world per process.
 */
#ifndef KVP_FUZZ_WORLD_H
#define KVP_FUZZ_WORLD_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvpager/kvpager.h"

#ifndef FUZZ_WORLD_TARGET
#error "define FUZZ_WORLD_TARGET (the target's name in its reports) before fuzz_world.h"
#endif

/* ---- failure reporting ------------------------------------------------- */

static size_t g_op_index;
static const char *g_op_name = "setup";

/* Prints "kvpager TARGET: MISMATCH at op N (name): ..." and aborts. */
static inline void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static inline void fail(const char *fmt, ...)
{
    va_list args;
    va_start(args, fmt);
    fprintf(stderr, "kvpager " FUZZ_WORLD_TARGET ": MISMATCH at op %zu (%s): ", g_op_index,
            g_op_name);
    vfprintf(stderr, fmt, args);
    fprintf(stderr, "\n");
    va_end(args);
    abort();
}

#define CHECK(cond, ...)                                                                    \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            fail(__VA_ARGS__);                                                              \
        }                                                                                   \
    } while (0)

/* ---- the input ---------------------------------------------------------- */

typedef struct reader {
    const uint8_t *data;
    size_t size;
    size_t at;
} reader;

/* The next input byte (0 past the end). */
static inline uint8_t rd(reader *r)
{
    return r->at < r->size ? r->data[r->at++] : 0;
}

/* ---- the world ---------------------------------------------------------- */

/* kvp_pool_check's callback: prints each mismatch (the caller then fails). */
static inline void on_mismatch(void *ctx, const kvp_mismatch *m)
{
    (void)ctx;
    fprintf(stderr, "audit: invariant %d, %s, page %zu\n", (int)m->invariant,
            m->what != NULL ? m->what : "", m->page);
}

/*
 * A pool of `pages` pages of bt-token blocks, kv_heads x hd, its key secret
 * word i = secret_base + secret_step * i (fixed: keys repeat run to run).
 * Returns kvp_pool_create's status; the caller checks it its own way.
 */
static inline kvp_status fz_world_pool(size_t bt, size_t kv_heads, size_t hd, size_t pages,
                                       uint64_t secret_base, uint64_t secret_step,
                                       kvp_pool **pool, kvp_error *err)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = bt;
    config.heads = kv_heads;
    config.head_width = hd;
    for (size_t i = 0; i < KVP_KEY_SECRET_BYTES / sizeof(uint64_t); i++) {
        config.key_secret[i] = secret_base + secret_step * i;
    }
    config.budget_bytes = pages * 2 * kv_heads * bt * hd * sizeof(double);
    *pool = NULL;
    return kvp_pool_create(&config, pool, err);
}

#endif /* KVP_FUZZ_WORLD_H */
