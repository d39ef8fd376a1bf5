/*
 * tier_support.h: the fixtures test_tier.c and test_tier_async.c share: a
 * host tier attached to a pool under a test secret, the pool's and the host
 * tier's counters, packing a published page, putting a block, an external
 * cache with two published blocks, and churning a pool so that its
 * evictable pages are evicted. Static inline; tests only.
 */
#ifndef KVPAGER_TESTS_TIER_SUPPORT_H
#define KVPAGER_TESTS_TIER_SUPPORT_H

#include "share_support.h"

#include <stdlib.h>
#include <string.h>

#include "kvpager/tier.h"

/* ---- fixtures ------------------------------------------------------------------ */

static inline void secret_fill(unsigned char secret[KVP_TIER_SECRET_BYTES], unsigned char seed)
{
    for (size_t i = 0; i < KVP_TIER_SECRET_BYTES; i++) {
        secret[i] = (unsigned char)(seed + 7 * i);
    }
}

static inline kvp_tier *host_tier(size_t budget)
{
    kvp_tier *tier = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_host_create(budget, &tier, &err), &err);
    return tier;
}

static inline void attach(kvp_pool *pool, kvp_tier *tier, int write_through)
{
    kvp_tier_policy policy;
    kvp_tier_policy_init(&policy);
    secret_fill(policy.secret, 1);
    policy.write_through = write_through;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_tier_attach(pool, tier, &policy, &err), &err);
    kvpt_assert_pool_ok(pool);
}

static inline kvp_pool_tier_stats tier_stats(kvp_pool *pool)
{
    kvp_pool_tier_stats s;
    kvp_pool_tier_stats_init(&s);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_tier_stats_get(pool, &s, &err), &err);
    return s;
}

static inline kvp_tier_host_stats host_stats(kvp_tier *tier)
{
    kvp_tier_host_stats s;
    kvp_tier_host_stats_init(&s);
    kvp_error err;
    kvpt_assert_ok(kvp_tier_host_stats_get(tier, &s, &err), &err);
    return s;
}

static inline void detach_and_destroy(kvp_pool *pool, kvp_tier *tier)
{
    kvp_error err;
    kvpt_assert_ok(kvp_pool_tier_detach(pool, &err), &err);
    kvpt_assert_ok(kvp_tier_destroy(tier, &err), &err);
}

static inline size_t block_bytes(kvp_pool *pool)
{
    return KVP_TIER_HEADER_BYTES + kvpt_stats(pool).page_bytes;
}

/* Packs lane 0, block `block` of `cache` under the test secret (seed 1). */
static inline unsigned char *pack(const kvp_cache *cache, kvp_pool *pool, size_t block)
{
    size_t need = block_bytes(pool);
    unsigned char *out = malloc(need);
    assert_non_null(out);
    unsigned char secret[KVP_TIER_SECRET_BYTES];
    secret_fill(secret, 1);
    size_t bytes = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_block_pack(cache, 0, block, secret, out, need, &bytes, &err), &err);
    assert_int_equal(bytes, need);
    return out;
}

static inline void tier_put(kvp_tier *tier, const kvp_block_key *key, void *data, size_t bytes)
{
    kvp_tier_block b;
    memset(&b, 0, sizeof b);
    b.key = *key;
    b.data = data;
    b.bytes = bytes;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_run(tier, KVP_TIER_PUT, &b, 1, &err), &err);
    kvpt_assert_ok(b.status, NULL);
}

/* An external cache of `batch` lanes with 2 published blocks; keys[j * batch + lane]. */
static inline kvp_cache *published_cache(kvp_pool *pool, size_t batch, kvp_block_key *keys)
{
    kvp_cache *cache = external_cache(pool, batch, 1);
    append(cache, pool, batch, 2 * BT, 0.5);
    chain_keys(cache, batch, 2, 0.0, keys);
    publish_all(cache, pool, batch, 2, keys);
    return cache;
}

/* Takes every page of the pool into a fresh cache (evicting the LRU list), then frees them. */
static inline void churn(kvp_pool *pool, size_t pages)
{
    assert_true(pages % 2 == 0 && pages / 2 <= CAPACITY / BT);
    kvp_cache *filler = external_cache(pool, 2, 99);
    for (size_t p = 0; p < pages / 2; p++) {
        append(filler, pool, 2, BT, 77.0);
    }
    kvpt_destroy_cache(filler, pool);
}

/* The cache's rows as f64 ([B, H, len, d] each), exported. */
static inline void export_rows(const kvp_cache *cache, size_t n, double *keys, double *values)
{
    kvp_error err;
    kvpt_assert_ok(kvp_cache_keys(cache, keys, n, &err), &err);
    kvpt_assert_ok(kvp_cache_values(cache, values, n, &err), &err);
}

/* ---- a layer-bound cache (test_tier, test_tier_redis) ---- */

/* `tokens` tokens of `inputs` ([tokens][D]) through the layer into `cache`. */
static inline void attend(const kvp_layer *layer, kvp_cache *cache, kvp_pool *pool,
                          const double *inputs, size_t tokens)
{
    kvp_ticket *ticket = kvpt_ticket(cache);
    kvp_error err;
    for (size_t t = 0; t < tokens; t++) {
        kvp_tensor x = kvp_tensor3((double *)(uintptr_t)(inputs + t * D), 1, 1, D);
        kvpt_assert_ok(kvp_attention_forward(layer, &x, cache, ticket, &err), &err);
    }
    kvpt_destroy_ticket(ticket, pool);
    kvpt_assert_pool_ok(pool);
}

/* The output and weights of attending `x` over `cache`, prepared and discarded. */
static inline void probe(const kvp_layer *layer, const kvp_cache *cache, kvp_pool *pool,
                         const double *x, double out[D], double weights[HEADS * (2 * BT + 1)])
{
    kvp_ticket *ticket = kvpt_ticket(cache);
    kvp_tensor in = kvp_tensor3((double *)(uintptr_t)x, 1, 1, D);
    kvp_error err;
    kvpt_assert_ok(kvp_attention_prepare(layer, &in, cache, ticket, &err), &err);
    kvp_attention_result r;
    kvpt_assert_ok(kvp_ticket_result(ticket, &r, &err), &err);
    assert_int_equal(r.keys, 2 * BT + 1);
    memcpy(out, r.output, D * sizeof(double));
    memcpy(weights, r.weights, HEADS * r.keys * sizeof(double));
    kvpt_destroy_ticket(ticket, pool);
}

#endif /* KVPAGER_TESTS_TIER_SUPPORT_H */
