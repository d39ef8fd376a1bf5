/*
 * sim_tier.c: the second tier of a `kvpager simulate` run (sim_tier.h).
 *
 * Owns: making the run's tiers (host, Redis) and composing them near to far
 * (kvp_tier_compose_create, right to left: the first --tier is nearest),
 * attaching the top one to the run's pool under the deployment secret, the
 * pool key secret derived from that secret, the tier counters of a run, and
 * closing: Redis tiers flushed (every queued write done, at most 30 s),
 * then compositions and leaves destroyed, outermost first.
 * Invariants: nothing here runs before the flags were checked
 * (simulate_tier.c parsed every URL and the secret file); a Redis tier's
 * timeouts and reconnect wait are the config's (--tier-timeout-ms,
 * --tier-retry-ms; 1000 ms each when not given); a Redis server
 * that is down does not fail the run (the tier counts errors, the
 * scheduler computes what it cannot load).
 * An allocator-only run (keys_only: its pool holds no data) gets one
 * keys-only host tier (kvp_tier_host_keys_create): simulate_tier.c refuses
 * Redis and more than one tier there, so nothing is composed.
 * Callers: sim.c. Public headers only (and libsodium's generic hash).
 */
#include "sim_tier.h"

#include <string.h>

#include <sodium.h>

/* The context the pool key secret is derived under (docs/simulate.md). */
static const char pool_secret_context[] = "kvpager simulate pool key secret v1";

void kvp_sim_tier_pool_secret(const kvp_sim_tier_config *config, kvp_pool_config *pool_config)
{
    if (config->count == 0) {
        return; /* the pool draws a random one */
    }
    unsigned char out[KVP_KEY_SECRET_BYTES];
    crypto_generichash(out, sizeof out, (const unsigned char *)pool_secret_context,
                       sizeof pool_secret_context - 1, config->secret, sizeof config->secret);
    memcpy(pool_config->key_secret, out, sizeof out);
    sodium_memzero(out, sizeof out);
}

static kvp_status make_leaf(const kvp_sim_tier_config *c, const kvp_sim_tier_spec *spec,
                            kvp_tier **out, kvp_error *err)
{
    if (spec->given != NULL) {
        *out = spec->given;
        return KVP_OK;
    }
    if (!spec->redis) {
        return c->keys_only ? kvp_tier_host_keys_create(spec->host_bytes, out, err)
                            : kvp_tier_host_create(spec->host_bytes, out, err);
    }
    kvp_tier_redis_config config;
    kvp_tier_redis_config_init(&config);
    config.url = spec->url;
    config.connect_timeout_ms = c->redis_timeout_ms; /* --tier-timeout-ms (default 1000) */
    config.command_timeout_ms = c->redis_timeout_ms;
    /* --tier-retry-ms (0: the next batch connects again); without it a server that is
     * down is asked again after 1 s */
    config.backoff_min_ms = c->redis_retry_given ? c->redis_retry_ms : 1000;
    return kvp_tier_redis_create(&config, out, err);
}

kvp_status kvp_sim_tier_open(const kvp_sim_tier_config *config, kvp_pool *pool, kvp_sim_tier *t,
                             kvp_error *err)
{
    memset(t, 0, sizeof *t);
    if (config->count == 0) {
        return KVP_OK;
    }
    for (size_t i = 0; i < config->count; i++) {
        kvp_status status = make_leaf(config, &config->tiers[i], &t->leaves[i], err);
        if (status != KVP_OK) {
            return status;
        }
        t->given[i] = config->tiers[i].given != NULL;
        t->leaf_count++;
    }
    t->top = t->leaves[config->count - 1];
    for (size_t i = config->count - 1; i-- > 0;) {
        kvp_tier *both = NULL;
        kvp_status status = kvp_tier_compose_create(t->leaves[i], t->top, &both, err);
        if (status != KVP_OK) {
            return status;
        }
        t->composed[t->composed_count++] = both;
        t->top = both;
    }
    kvp_tier_policy policy;
    kvp_tier_policy_init(&policy);
    memcpy(policy.secret, config->secret, sizeof policy.secret);
    policy.write_through = config->write_through;
    kvp_status status = kvp_pool_tier_attach(pool, t->top, &policy, err);
    sodium_memzero(policy.secret, sizeof policy.secret);
    return status;
}

/*
 * The blocks a Redis leaf's writer failed to write (the server down or full):
 * its puts completed when queued, so the pool counted them as writes. Waits
 * for the queue first (at most 30 s), so the figure is final.
 */
static uint64_t redis_write_errors(const kvp_sim_tier *t, int flush)
{
    uint64_t failed = 0;
    for (size_t i = 0; i < t->leaf_count; i++) {
        kvp_tier_redis_stats rs;
        kvp_tier_redis_stats_init(&rs);
        if (strcmp(kvp_tier_name(t->leaves[i]), "redis") == 0) {
            kvp_status flushed = flush ? kvp_tier_redis_flush(t->leaves[i], 30000, NULL) : KVP_OK;
            (void)flushed; /* what is left queued is counted by neither */
            if (kvp_tier_redis_stats_get(t->leaves[i], &rs, NULL) == KVP_OK) {
                failed += rs.write_errors;
            }
        }
    }
    return failed;
}

void kvp_sim_tier_read(const kvp_sim_tier *t, kvp_pool *pool, const kvp_scheduler_stats *stats,
                       int final, kvp_sim_tier_result *out)
{
    memset(out, 0, sizeof *out);
    if (t->top == NULL) {
        return;
    }
    out->present = 1;
    out->keys_only = kvp_tier_keys_only(t->top);
    out->hit_blocks = stats->tier_hit_blocks;
    out->hit_tokens = stats->tier_hit_tokens;
    out->load_bytes = stats->tier_load_bytes;
    out->load_seconds = stats->tier_load_seconds;
    out->rejected = stats->tier_rejected;
    out->errors = stats->tier_errors;
    out->recomputes = stats->tier_recomputes;
    out->prefetches = stats->tier_prefetches;
    out->prefetch_used = stats->tier_prefetch_used;
    out->prefetch_late = stats->tier_prefetch_late;
    out->prefetch_wasted = stats->tier_prefetch_wasted;
    out->bytes_per_second = stats->tier_bytes_per_second;
    out->prefill_tokens_per_second = stats->prefill_tokens_per_second;
    kvp_pool_tier_stats pool_stats;
    kvp_pool_tier_stats_init(&pool_stats);
    if (pool != NULL && kvp_pool_tier_stats_get(pool, &pool_stats, NULL) == KVP_OK) {
        out->block_bytes = pool_stats.block_bytes;
        out->writes = pool_stats.writes;
        out->write_failures = pool_stats.write_failures;
    }
    out->write_failures += redis_write_errors(t, final);
}

void kvp_sim_tier_close(kvp_sim_tier *t)
{
    for (size_t i = 0; i < t->leaf_count; i++) {
        if (strcmp(kvp_tier_name(t->leaves[i]), "redis") == 0) {
            kvp_status flushed = kvp_tier_redis_flush(t->leaves[i], 30000, NULL);
            (void)flushed; /* a server that is down: the writes failed, and were counted */
        }
    }
    while (t->composed_count > 0) { /* the outermost (last made) first */
        (void)kvp_tier_destroy(t->composed[--t->composed_count], NULL);
    }
    while (t->leaf_count > 0) {
        t->leaf_count--;
        if (!t->given[t->leaf_count]) {
            (void)kvp_tier_destroy(t->leaves[t->leaf_count], NULL);
        }
    }
    t->top = NULL;
}
