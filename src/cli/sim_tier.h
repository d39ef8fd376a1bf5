/*
 * sim_tier.h: the second tier of a `kvpager simulate` run (issue 20): the
 * tiers a run attaches to its pool (--tier host:SIZE, --tier redis://...,
 * in order, composed near to far), the deployment secret, the write policy
 * and the load decisions, and the counters the report prints.
 *
 * Owns: kvp_sim_tier_config (what the flags say; simulate_tier.c reads
 * them), kvp_sim_tier (the tiers one run made) and kvp_sim_tier_result.
 * Invariants: a run with tiers has a pool key secret derived from the
 * deployment secret (keyed BLAKE2b), so every process given the same
 * secret file computes the same chain keys; tiers are made after the pool
 * and destroyed after it (the pool's destroy detaches), Redis tiers
 * flushed first so a later process finds every write.
 * Callers: sim.c (open, attach, read, close), simulate_tier.c (the flags,
 * checks and report lines).
 */
#ifndef KVPAGER_CLI_SIM_TIER_H
#define KVPAGER_CLI_SIM_TIER_H

#include <stddef.h>
#include <stdint.h>

#include "kvpager/kvpager.h"

/* Most --tier flags of one run. */
#define KVP_SIM_TIERS_MAX 4

/* One --tier: host memory of host_bytes, or a Redis server at url (not owned). */
typedef struct kvp_sim_tier_spec {
    int redis;
    size_t host_bytes;
    const char *url;
    kvp_tier *given; /* not NULL: this tier (the caller's: made, kept across runs and
                        destroyed by it, e.g. a benchmark's host tier in its steady
                        state) instead of one made from the fields above */
} kvp_sim_tier_spec;

typedef struct kvp_sim_tier_config {
    size_t count; /* 0: no tier */
    kvp_sim_tier_spec tiers[KVP_SIM_TIERS_MAX];
    unsigned char secret[KVP_TIER_SECRET_BYTES]; /* the deployment secret */
    int write_through;                           /* --tier-policy publish */
    int loads;                                   /* --tier-loads: a kvp_tier_loads */
    int keys_only; /* allocator-only (--no-compute): host tiers keep keys only */
    unsigned redis_timeout_ms; /* --tier-timeout-ms: Redis connect and command timeouts
                                  (0: the tier's default, 1000 ms) */
    int redis_retry_given;     /* --tier-retry-ms was given: redis_retry_ms holds it */
    unsigned redis_retry_ms;   /* wait after a failed connect (0: at the next batch); without
                                  --tier-retry-ms 1000 ms */
} kvp_sim_tier_config;

/* The tiers one run made: the leaves in order, the compositions, the top one attached. */
typedef struct kvp_sim_tier {
    kvp_tier *leaves[KVP_SIM_TIERS_MAX];
    kvp_tier *composed[KVP_SIM_TIERS_MAX];
    int given[KVP_SIM_TIERS_MAX]; /* leaf i is the caller's (kvp_sim_tier_spec.given) */
    size_t leaf_count;
    size_t composed_count;
    kvp_tier *top;
} kvp_sim_tier;

/* The report's tier figures (the scheduler's tier_* and the pool's writes). */
typedef struct kvp_sim_tier_result {
    int present;              /* the run had a tier */
    int keys_only;            /* it kept keys only (allocator-only run) */
    uint64_t hit_blocks;      /* prompt blocks loaded instead of computed */
    uint64_t hit_tokens;
    uint64_t load_bytes;
    double load_seconds;
    size_t block_bytes;       /* a tier block's size (header + page) */
    uint64_t writes;          /* pages handed to the tier (write-back or write-through) */
    uint64_t write_failures;  /* refused by the tier, or (Redis) failed by its writer after */
    uint64_t rejected;        /* blocks that failed verification, never mapped */
    uint64_t errors;          /* blocks the tier failed to read, and loads refused */
    uint64_t recomputes;      /* missed blocks the cost model chose to recompute */
    uint64_t prefetches;      /* tier gets issued for waiting requests (prefetch) */
    uint64_t prefetch_used;   /* of those, mapped at admission */
    uint64_t prefetch_late;   /* still in flight at admission: the blocks were computed */
    uint64_t prefetch_wasted; /* cancelled unused */
    double bytes_per_second;  /* the cost model's rates at the end (0: not measured) */
    double prefill_tokens_per_second;
} kvp_sim_tier_result;

/* The pool key secret for a run with tiers (a keyed hash of the deployment secret). */
void kvp_sim_tier_pool_secret(const kvp_sim_tier_config *config, kvp_pool_config *pool_config);

/* Makes the tiers and attaches the top one to `pool`. KVP_OK, or *err filled (the
 * tiers made so far are kept in *t for kvp_sim_tier_close). */
kvp_status kvp_sim_tier_open(const kvp_sim_tier_config *config, kvp_pool *pool, kvp_sim_tier *t,
                             kvp_error *err);

/*
 * The counters of a run, before its pool and scheduler go. final: the
 * run's last read, which first flushes the Redis tiers' writers (waiting for
 * every queued write) so their failed writes are all counted; the reads
 * after each step (final 0) never flush: a flush is a wait on the network,
 * and a step that waited for every write would pay the round trips the
 * writer thread exists to keep off it.
 */
void kvp_sim_tier_read(const kvp_sim_tier *t, kvp_pool *pool, const kvp_scheduler_stats *stats,
                       int final, kvp_sim_tier_result *out);

/* After the pool is destroyed: flushes Redis tiers (writes done), destroys every tier
 * the run made (not a given one). */
void kvp_sim_tier_close(kvp_sim_tier *t);

#endif /* KVPAGER_CLI_SIM_TIER_H */
