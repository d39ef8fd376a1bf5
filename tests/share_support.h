/*
 * share_support.h: the fixtures test_share.c, test_share_cache.c and
 * test_share_keys.c share: small external caches with rows that encode
 * (lane, position, feature), their chain keys and publication, the
 * audit-finding check, and a 2-layer model's prompts and prefills. Static
 * inline, so a test file that uses only some of them builds without
 * warnings. Tests only.
 */
#ifndef KVPAGER_TESTS_SHARE_SUPPORT_H
#define KVPAGER_TESTS_SHARE_SUPPORT_H

#include "support.h"

#include <string.h>

/* ---- external caches --------------------------------------------------------- */

#define BT 4          /* block tokens */
#define KV_HEADS 1
#define HEAD_WIDTH 2
#define CAPACITY 16

static inline kvp_cache *external_cache(kvp_pool *pool, size_t batch, uint64_t revision)
{
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&binding, KV_HEADS, HEAD_WIDTH, 64, 7, revision,
                                             &err),
                   &err);
    return kvpt_cache(pool, &binding, batch, CAPACITY);
}

/* Rows [B, H, n, d] whose values encode (lane, position, feature) from `first`. */
static inline void make_rows(size_t batch, size_t first, size_t n, double salt, double *keys,
                      double *values)
{
    for (size_t b = 0; b < batch; b++) {
        for (size_t r = 0; r < n; r++) {
            for (size_t i = 0; i < HEAD_WIDTH; i++) {
                size_t at = (b * n + r) * HEAD_WIDTH + i;
                keys[at] = 1000.0 * (double)b + 10.0 * (double)(first + r) + (double)i + salt;
                values[at] = -keys[at];
            }
        }
    }
}

static inline void append(kvp_cache *cache, kvp_pool *pool, size_t batch, size_t n, double salt)
{
    double keys[4 * CAPACITY * HEAD_WIDTH];
    double values[4 * CAPACITY * HEAD_WIDTH];
    make_rows(batch, kvp_cache_len(cache), n, salt, keys, values);
    kvp_error err;
    kvpt_assert_ok(kvp_cache_append_rows(cache, keys, values, n, &err), &err);
    kvpt_assert_pool_ok(pool);
}

static inline uint32_t page_of(const kvp_cache *cache, size_t lane, size_t block)
{
    uint32_t page = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_page(cache, lane, block, &page, &err), &err);
    return page;
}

static inline size_t held(kvp_pool *pool)
{
    return kvpt_stats(pool).held_pages;
}

/* kvpt_destroy_pool, where published pages may wait on the evictable list. */
static inline void destroy_pool(kvp_pool *pool)
{
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.held_pages, 0);
    assert_int_equal(s.free_pages + s.evictable_pages, s.total_pages);
    assert_int_equal(s.evictable_pages, s.cached_pages);
    assert_int_equal(s.attached_caches, 0);
    assert_int_equal(s.promised_pages, 0);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_destroy(pool, &err), &err);
}

/* The chain keys of `blocks` blocks of lane inputs: keys[b * batch + lane]. */
static inline void chain_keys(const kvp_cache *cache, size_t batch, size_t blocks, double salt,
                       kvp_block_key *keys)
{
    for (size_t j = 0; j < blocks; j++) {
        for (size_t lane = 0; lane < batch; lane++) {
            double input[BT];
            for (size_t t = 0; t < BT; t++) {
                input[t] = (double)(lane * 100 + j * BT + t) + salt;
            }
            kvp_error err;
            kvpt_assert_ok(kvp_block_key_chain(j == 0 ? NULL : &keys[(j - 1) * batch + lane],
                                               cache, input, sizeof input, NULL,
                                               &keys[j * batch + lane], &err),
                           &err);
        }
    }
}

static inline void publish_all(kvp_cache *cache, kvp_pool *pool, size_t batch, size_t blocks,
                        const kvp_block_key *keys)
{
    kvp_error err;
    for (size_t j = 0; j < blocks; j++) {
        for (size_t lane = 0; lane < batch; lane++) {
            kvpt_assert_ok(kvp_cache_publish_block(cache, lane, j, &keys[j * batch + lane], &err),
                           &err);
            kvpt_assert_pool_ok(pool);
        }
    }
}

/* The audit fails, and among its findings is `what` under `invariant`. */
static inline void expect_finding(kvp_pool *pool, kvp_invariant invariant, const char *what)
{
    kvpt_findings found = {0};
    kvp_error err;
    assert_int_equal(kvp_pool_check(pool, kvpt_collect_finding, &found, &err), KVP_AUDIT_FAILED);
    int seen = 0;
    for (size_t i = 0; i < found.count && i < KVPT_FINDINGS_KEPT; i++) {
        seen |= found.items[i].invariant == invariant && strcmp(found.items[i].what, what) == 0;
    }
    if (!seen) {
        print_error("no \"%s\" among %zu findings\n", what, found.count);
        fail();
    }
}

/* ---- sequences ------------------------------------------------------------- */

#define D 8
#define HEADS 2
#define LAYERS 2
#define SB 2           /* sequence batch */
#define PROMPT 10
#define STEPS 3
#define SCAP 32
#define BASE 10000.0

typedef struct outputs {
    double prompt[SB * PROMPT * D]; /* [B, T, D] */
    double steps[STEPS][SB * D];
} outputs;

static inline void inputs(double prompt[SB * PROMPT * D], double steps[STEPS][SB * D])
{
    uint64_t seed = 42;
    for (size_t i = 0; i < SB * PROMPT * D; i++) {
        prompt[i] = kvpt_rand_unit(&seed);
    }
    for (size_t s = 0; s < STEPS; s++) {
        for (size_t i = 0; i < SB * D; i++) {
            steps[s][i] = kvpt_rand_unit(&seed);
        }
    }
}

/* Tokens [from, to) of prompt as their own [B, to - from, D] tensor data. */
static inline void slice(const double *prompt, size_t from, size_t to, double *out)
{
    for (size_t b = 0; b < SB; b++) {
        memcpy(out + b * (to - from) * D, prompt + (b * PROMPT + from) * D,
               (to - from) * D * sizeof(double));
    }
}

static inline void prefill(kvp_sequence *seq, kvp_pool *pool, const double *prompt, size_t from,
                    size_t to, double *out_prompt)
{
    double part[SB * PROMPT * D];
    double out[SB * PROMPT * D];
    slice(prompt, from, to, part);
    kvp_tensor t = kvp_tensor3(part, SB, to - from, D);
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_prefill(seq, &t, NULL, NULL, out, KVPT_COUNT_OF(out), &err),
                   &err);
    kvpt_assert_pool_ok(pool);
    for (size_t b = 0; b < SB; b++) {
        memcpy(out_prompt + (b * PROMPT + from) * D, out + b * (to - from) * D,
               (to - from) * D * sizeof(double));
    }
}

/* Adopts what the index holds of `whole` into the empty `seq`, audited: the tokens adopted. */
static inline size_t adopt_whole(kvp_sequence *seq, kvp_pool *pool, const kvp_tensor *whole)
{
    size_t adopted = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_adopt_prefix(seq, whole, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    return adopted;
}

#endif /* KVPAGER_TESTS_SHARE_SUPPORT_H */
