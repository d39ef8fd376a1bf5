/*
 * fuzz_tier.c: a libFuzzer target over the pool's second tier
 * (kvpager/tier.h): a kvp_tier whose get returns what the fuzzer says.
 *
 * Owns nothing but its own world: a source pool that publishes 4 blocks of
 * an external cache and packs them (kvp_tier_block_pack) under the
 * deployment secret and under another one; a target pool (same geometry
 * and key secret: the same keys) with the fuzzed tier attached; a target
 * cache that only ever holds a prefix of the source's rows.
 * The tier's get answers each block, by the input: a miss, TIER_UNAVAILABLE,
 * BUFFER_TOO_SMALL, the right block, the right block with a bit flipped,
 * truncated or with header bytes overwritten, another key's block, the block
 * under another secret, or fuzzer bytes of a fuzzer length. Its put takes or
 * fails blocks (write-back on evict), as the input says.
 * Operations: load n blocks (kvp_cache_group_tier_load), append a block of
 * the source's rows, churn the pool (evicting, so writing back), reset the
 * cache. Checks after every operation:
 *   - kvp_pool_check (I1 to I5);
 *   - the target cache's rows are bit for bit the source's prefix: a block
 *     the tier garbled is never mapped;
 *   - a load maps exactly the leading run of good blocks (fewer only when
 *     refused, which changes nothing: not a counter);
 *   - kvp_pool_tier_stats moved by exactly what the batch returned: loads
 *     (the run), misses, failures, rejections (every garbled block, by
 *     reason summing to the total).
 * Any mismatch prints `kvpager fuzz_tier: MISMATCH at op N (name)` and
 * aborts. Built only by the `fuzz` preset (tests/fuzz/README.md).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpager/kvpager.h"
#include "kvpager/tier.h"

#define FUZZ_WORLD_TARGET "fuzz_tier"
#include "fuzz_world.h" /* the failure report, CHECK, the reader, on_mismatch, the pool */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define BT 4
#define KV_HEADS 1
#define HEAD_WIDTH 2
#define BLOCKS 4
#define CAPACITY (BLOCKS * BT)
#define PAGES 12
#define MAX_OPS 64
#define ROW (KV_HEADS * HEAD_WIDTH)

/* ---- failure reporting ------------------------------------------------- */

static void ok(kvp_status status, const kvp_error *err, const char *what)
{
    CHECK(status == KVP_OK, "%s: %s (%s)", what, kvp_status_name(status),
          err != NULL && err->argument != NULL ? err->argument : "");
}

/* ---- the input ---------------------------------------------------------- */

/* One input byte, as unsigned (0 past the end). */
static unsigned byte(reader *in)
{
    return rd(in);
}

static unsigned word(reader *in)
{
    unsigned lo = byte(in);
    return lo | (byte(in) << 8);
}

/* ---- the world ---------------------------------------------------------- */

typedef enum answer {
    ANSWER_MISS,
    ANSWER_UNAVAILABLE,
    ANSWER_TOO_SMALL,
    ANSWER_GOOD,
    ANSWER_FLIP,
    ANSWER_TRUNCATE,
    ANSWER_HEADER,
    ANSWER_OTHER_KEY,
    ANSWER_OTHER_SECRET,
    ANSWER_BYTES,
    ANSWER_COUNT
} answer;

typedef struct world {
    kvp_pool *source_pool;
    kvp_pool *pool;
    kvp_tier *tier;
    kvp_cache *cache;
    kvp_binding binding;
    kvp_block_key keys[BLOCKS];
    double keys_rows[CAPACITY * ROW];   /* the source's rows [H, len, d] (batch 1) */
    double values_rows[CAPACITY * ROW];
    unsigned char good[BLOCKS][4096];
    unsigned char foreign[BLOCKS][4096]; /* the same blocks under another secret */
    size_t block_bytes;
    unsigned char secret[KVP_TIER_SECRET_BYTES];
    reader in;
    /* what the last get answered, per block of the batch */
    size_t answered;
    uint64_t want_misses, want_failures, want_rejected;
    size_t good_run; /* leading blocks answered ANSWER_GOOD */
    int run_broken;
} world;

static world W;

/* Key secret word i = 0x9e3779b97f4a7c15 * (i + 1): the source's keys are the target's. */
static kvp_pool *make_pool(void)
{
    kvp_pool *pool = NULL;
    kvp_error err;
    ok(fz_world_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES, 0x9e3779b97f4a7c15ull,
                     0x9e3779b97f4a7c15ull, &pool, &err),
       &err, "pool_create");
    return pool;
}

static kvp_cache *make_cache(kvp_pool *pool)
{
    kvp_cache *cache = NULL;
    kvp_error err;
    ok(kvp_cache_create(pool, &W.binding, 1, CAPACITY, &cache, &err), &err, "cache_create");
    return cache;
}

static size_t key_index(const kvp_block_key *key)
{
    for (size_t j = 0; j < BLOCKS; j++) {
        if (memcmp(&W.keys[j], key, sizeof *key) == 0) {
            return j;
        }
    }
    return BLOCKS;
}

/* One block's answer; returns it (counted into W's expectations by the caller). */
static answer answer_block(kvp_tier_block *b)
{
    answer a = (answer)(byte(&W.in) % ANSWER_COUNT);
    size_t j = key_index(&b->key);
    if (j == BLOCKS && a >= ANSWER_GOOD && a != ANSWER_BYTES) {
        a = ANSWER_MISS; /* not a key of the source: nothing to garble */
    }
    size_t n = W.block_bytes;
    b->status = KVP_OK;
    b->bytes = 0;
    switch (a) {
    case ANSWER_MISS:
        break;
    case ANSWER_UNAVAILABLE:
        b->status = KVP_TIER_UNAVAILABLE;
        break;
    case ANSWER_TOO_SMALL:
        b->status = KVP_BUFFER_TOO_SMALL;
        b->bytes = b->capacity + 1 + word(&W.in);
        break;
    case ANSWER_GOOD:
        memcpy(b->data, W.good[j], n);
        b->bytes = n;
        break;
    case ANSWER_FLIP: {
        memcpy(b->data, W.good[j], n);
        size_t bit = word(&W.in) % (n * 8);
        ((unsigned char *)b->data)[bit / 8] ^= (unsigned char)(1u << (bit % 8));
        b->bytes = n;
        break;
    }
    case ANSWER_TRUNCATE:
        memcpy(b->data, W.good[j], n);
        b->bytes = word(&W.in) % n; /* 0 reads as a miss */
        if (b->bytes == 0) {
            a = ANSWER_MISS;
        }
        break;
    case ANSWER_HEADER: {
        memcpy(b->data, W.good[j], n);
        size_t at = byte(&W.in) % KVP_TIER_HEADER_BYTES;
        unsigned char v = (unsigned char)byte(&W.in);
        if (((unsigned char *)b->data)[at] == v) {
            v ^= 0x80; /* a change, always */
        }
        ((unsigned char *)b->data)[at] = v;
        b->bytes = n;
        break;
    }
    case ANSWER_OTHER_KEY: {
        size_t other = (j + 1 + byte(&W.in) % (BLOCKS - 1)) % BLOCKS;
        memcpy(b->data, W.good[other], n);
        b->bytes = n;
        break;
    }
    case ANSWER_OTHER_SECRET:
        memcpy(b->data, W.foreign[j], n);
        b->bytes = n;
        break;
    default: { /* fuzzer bytes of a fuzzer length (at least 1) */
        size_t len = 1 + word(&W.in) % b->capacity;
        for (size_t i = 0; i < len; i++) {
            ((unsigned char *)b->data)[i] = (unsigned char)byte(&W.in);
        }
        b->bytes = len;
        break;
    }
    }
    return a;
}

static kvp_status fuzz_contains(void *impl, kvp_tier_block *blocks, size_t count,
                                kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    (void)impl;
    (void)err;
    for (size_t i = 0; i < count; i++) {
        blocks[i].status = KVP_OK;
        blocks[i].bytes = key_index(&blocks[i].key) < BLOCKS ? W.block_bytes : 0;
    }
    done(ctx, blocks, count);
    return KVP_OK;
}

static kvp_status fuzz_get(void *impl, kvp_tier_block *blocks, size_t count,
                           kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    (void)impl;
    if (byte(&W.in) % 16 == 0) { /* the whole batch refused */
        if (err != NULL) {
            memset(err, 0, sizeof *err);
            err->status = KVP_TIER_UNAVAILABLE;
        }
        return KVP_TIER_UNAVAILABLE;
    }
    W.answered = count;
    for (size_t i = 0; i < count; i++) {
        answer a = answer_block(&blocks[i]);
        if (a != ANSWER_GOOD) {
            W.run_broken = 1;
        } else if (!W.run_broken) {
            W.good_run++;
        }
        if (a == ANSWER_MISS) {
            W.want_misses++;
        } else if (a == ANSWER_UNAVAILABLE) {
            W.want_failures++; /* a value longer than a block (TOO_SMALL): rejected by size */
        } else if (a != ANSWER_GOOD) {
            W.want_rejected++;
        }
    }
    done(ctx, blocks, count);
    return KVP_OK;
}

static kvp_status fuzz_put(void *impl, kvp_tier_block *blocks, size_t count,
                           kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    (void)impl;
    (void)err;
    for (size_t i = 0; i < count; i++) {
        blocks[i].status = byte(&W.in) % 4 == 0 ? KVP_TIER_UNAVAILABLE : KVP_OK;
    }
    done(ctx, blocks, count);
    return KVP_OK;
}

static void fuzz_destroy(void *impl)
{
    (void)impl;
}

static kvp_pool_tier_stats tier_stats(void)
{
    kvp_pool_tier_stats s;
    kvp_pool_tier_stats_init(&s);
    kvp_error err;
    ok(kvp_pool_tier_stats_get(W.pool, &s, &err), &err, "tier_stats");
    return s;
}

/* ---- setup: the source's blocks --------------------------------------- */

static void make_rows(void)
{
    for (size_t r = 0; r < CAPACITY; r++) {
        for (size_t i = 0; i < HEAD_WIDTH; i++) {
            W.keys_rows[r * HEAD_WIDTH + i] = 10.0 * (double)r + (double)i + 0.25;
            W.values_rows[r * HEAD_WIDTH + i] = -(10.0 * (double)r + (double)i) - 0.5;
        }
    }
}

static void make_source(void)
{
    kvp_error err;
    ok(kvp_binding_init_external(&W.binding, KV_HEADS, HEAD_WIDTH, 64, 7, 1, &err), &err,
       "binding");
    make_rows();
    W.source_pool = make_pool();
    kvp_cache *src = make_cache(W.source_pool);
    ok(kvp_cache_append_rows(src, W.keys_rows, W.values_rows, CAPACITY, &err), &err,
       "source append");
    unsigned char other[KVP_TIER_SECRET_BYTES];
    for (size_t i = 0; i < KVP_TIER_SECRET_BYTES; i++) {
        W.secret[i] = (unsigned char)(1 + 7 * i);
        other[i] = (unsigned char)(2 + 7 * i);
    }
    for (size_t j = 0; j < BLOCKS; j++) {
        double input[BT];
        for (size_t t = 0; t < BT; t++) {
            input[t] = (double)(j * BT + t);
        }
        ok(kvp_block_key_chain(j == 0 ? NULL : &W.keys[j - 1], src, input, sizeof input, NULL,
                               &W.keys[j], &err),
           &err, "key_chain");
        ok(kvp_cache_publish_block(src, 0, j, &W.keys[j], &err), &err, "publish");
        size_t bytes = 0;
        ok(kvp_tier_block_pack(src, 0, j, W.secret, W.good[j], sizeof W.good[j], &bytes, &err),
           &err, "pack");
        W.block_bytes = bytes;
        ok(kvp_tier_block_pack(src, 0, j, other, W.foreign[j], sizeof W.foreign[j], &bytes,
                               &err),
           &err, "pack other");
    }
    ok(kvp_cache_destroy(src, &err), &err, "source destroy");
}

/* ---- checks ------------------------------------------------------------- */

/* The target cache holds exactly the source's first len rows. */
static void check_rows(void)
{
    size_t len = kvp_cache_len(W.cache);
    CHECK(len <= CAPACITY && len % BT == 0, "len %zu", len);
    double k[CAPACITY * ROW];
    double v[CAPACITY * ROW];
    kvp_error err;
    ok(kvp_cache_keys(W.cache, k, CAPACITY * ROW, &err), &err, "cache_keys");
    ok(kvp_cache_values(W.cache, v, CAPACITY * ROW, &err), &err, "cache_values");
    CHECK(memcmp(k, W.keys_rows, len * ROW * sizeof(double)) == 0, "keys differ (len %zu)",
          len);
    CHECK(memcmp(v, W.values_rows, len * ROW * sizeof(double)) == 0,
          "values differ (len %zu)", len);
}

static void check_world(void)
{
    kvp_error err;
    ok(kvp_pool_check(W.pool, on_mismatch, NULL, &err), &err, "pool_check");
    check_rows();
    kvp_pool_tier_stats s = tier_stats();
    CHECK(s.rejected == s.rejected_header + s.rejected_mac + s.rejected_geometry +
                            s.rejected_key + s.rejected_binding,
          "rejected %llu is not the sum of its reasons", (unsigned long long)s.rejected);
}

/* ---- operations ----------------------------------------------------------- */

static void op_load(void)
{
    g_op_name = "load";
    size_t at = kvp_cache_len(W.cache) / BT;
    if (at >= BLOCKS) {
        return;
    }
    size_t n = 1 + byte(&W.in) % (BLOCKS - at);
    kvp_cache *caches[1] = {W.cache};
    kvp_pool_tier_stats before = tier_stats();
    W.answered = 0;
    W.want_misses = W.want_failures = W.want_rejected = 0;
    W.good_run = 0;
    W.run_broken = 0;
    size_t loaded = SIZE_MAX;
    kvp_status stop = KVP_OK;
    kvp_error err;
    kvp_status status =
        kvp_cache_group_tier_load(caches, 1, &W.keys[at], n, &loaded, &stop, &err);
    kvp_pool_tier_stats after = tier_stats();
    if (status != KVP_OK) {
        CHECK(status == KVP_TIER_UNAVAILABLE || status == KVP_POOL_EXHAUSTED,
              "load refused with %s", kvp_status_name(status));
        CHECK(kvp_cache_len(W.cache) == at * BT, "a refused load changed len");
        after.struct_size = before.struct_size;
        CHECK(memcmp(&before, &after, sizeof before) == 0, "a refused load changed counters");
        return;
    }
    if (getenv("KVP_FUZZ_TIER_TRACE") != NULL) { /* seeing what a seed does */
        fprintf(stderr, "op %zu: load %zu at %zu: loaded %zu, stop %s, rejected +%llu\n",
                g_op_index, n, at, loaded, kvp_status_name(stop),
                (unsigned long long)(after.rejected - before.rejected));
    }
    CHECK(W.answered == n, "the tier was asked %zu blocks, not %zu", W.answered, n);
    CHECK(loaded == W.good_run, "loaded %zu blocks, the good run is %zu", loaded, W.good_run);
    CHECK(kvp_cache_len(W.cache) == (at + loaded) * BT, "len %zu after loading %zu",
          kvp_cache_len(W.cache), loaded);
    CHECK(after.loads - before.loads == loaded, "loads +%llu, loaded %zu",
          (unsigned long long)(after.loads - before.loads), loaded);
    CHECK(after.load_bytes - before.load_bytes == loaded * W.block_bytes, "load bytes");
    CHECK(after.misses - before.misses == W.want_misses, "misses +%llu, want %llu",
          (unsigned long long)(after.misses - before.misses),
          (unsigned long long)W.want_misses);
    CHECK(after.load_failures - before.load_failures == W.want_failures,
          "failures +%llu, want %llu",
          (unsigned long long)(after.load_failures - before.load_failures),
          (unsigned long long)W.want_failures);
    CHECK(after.rejected - before.rejected == W.want_rejected, "rejected +%llu, want %llu",
          (unsigned long long)(after.rejected - before.rejected),
          (unsigned long long)W.want_rejected);
    if (loaded < n) {
        CHECK(stop != KVP_OK || W.want_misses > 0, "stopped early with KVP_OK and no miss");
    }
}

static void op_append(void)
{
    g_op_name = "append";
    size_t len = kvp_cache_len(W.cache);
    if (len >= CAPACITY) {
        return;
    }
    double k[BT * ROW];
    double v[BT * ROW];
    memcpy(k, &W.keys_rows[len * ROW], sizeof k);
    memcpy(v, &W.values_rows[len * ROW], sizeof v);
    kvp_error err;
    kvp_status status = kvp_cache_append_rows(W.cache, k, v, BT, &err);
    CHECK(status == KVP_OK || status == KVP_POOL_EXHAUSTED, "append: %s",
          kvp_status_name(status));
    if (status == KVP_OK) {
        /* publish it (later evictions write it back) unless the index holds the key */
        ok(kvp_cache_publish_block(W.cache, 0, len / BT, &W.keys[len / BT], &err), &err,
           "publish");
    }
}

/* A filler takes what the pool can give (evicting, so writing back), then frees it. */
static void op_churn(void)
{
    g_op_name = "churn";
    kvp_cache *filler = make_cache(W.pool);
    double k[BT * ROW] = {0};
    double v[BT * ROW] = {0};
    size_t blocks = 1 + byte(&W.in) % BLOCKS;
    kvp_error err;
    for (size_t b = 0; b < blocks; b++) {
        if (kvp_cache_append_rows(filler, k, v, BT, &err) != KVP_OK) {
            break;
        }
    }
    ok(kvp_cache_destroy(filler, &err), &err, "filler destroy");
}

static void op_reset(void)
{
    g_op_name = "reset";
    kvp_error err;
    ok(kvp_cache_destroy(W.cache, &err), &err, "cache destroy");
    W.cache = make_cache(W.pool);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    memset(&W, 0, sizeof W);
    W.in.data = data;
    W.in.size = size;
    g_op_index = 0;
    g_op_name = "setup";
    make_source();
    W.pool = make_pool();
    kvp_tier_vtable vtable;
    kvp_tier_vtable_init(&vtable);
    vtable.name = "fuzz";
    vtable.contains = fuzz_contains;
    vtable.get = fuzz_get;
    vtable.put = fuzz_put;
    vtable.destroy = fuzz_destroy;
    kvp_error err;
    ok(kvp_tier_create(&vtable, NULL, &W.tier, &err), &err, "tier_create");
    kvp_tier_policy policy;
    kvp_tier_policy_init(&policy);
    memcpy(policy.secret, W.secret, sizeof policy.secret);
    policy.write_through = (int)(byte(&W.in) & 1u);
    ok(kvp_pool_tier_attach(W.pool, W.tier, &policy, &err), &err, "attach");
    W.cache = make_cache(W.pool);
    check_world();
    for (g_op_index = 1; g_op_index <= MAX_OPS && W.in.at < W.in.size; g_op_index++) {
        unsigned op = byte(&W.in) % 8;
        if (op < 4) {
            op_load();
        } else if (op < 6) {
            op_append();
        } else if (op == 6) {
            op_churn();
        } else {
            op_reset();
        }
        check_world();
    }
    g_op_name = "teardown";
    ok(kvp_cache_destroy(W.cache, &err), &err, "cache destroy");
    ok(kvp_pool_tier_detach(W.pool, &err), &err, "detach");
    ok(kvp_pool_check(W.pool, on_mismatch, NULL, &err), &err, "pool_check");
    ok(kvp_pool_destroy(W.pool, &err), &err, "pool destroy");
    ok(kvp_pool_destroy(W.source_pool, &err), &err, "source pool destroy");
    ok(kvp_tier_destroy(W.tier, &err), &err, "tier destroy");
    return 0;
}
