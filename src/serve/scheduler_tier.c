/*
 * scheduler_tier.c: the scheduler reads the pool's second tier (the
 * scheduler's rooms: scheduler_internal.h; kvpager/scheduler.h, 6.).
 *
 * Owns: the load of an admitted request's prompt blocks that the prefix
 * index missed from the pool's tier (kvpi_sched_tier_load), the decision
 * to load or recompute them (the cost model: s->tier, measured prefill
 * tokens per second against the tier's observed bytes per second), and the
 * tier counters of the scheduler's stats (tier_*).
 *
 * Invariants: a load happens only in a step that stands (after admission,
 * before the prompt is computed), at the block boundary adoption left; a
 * refused or short load changes nothing but what the prefill computes (the
 * pager's contract: a block past the loaded run is never mapped); loaded
 * pages are the lease's own, as computed ones would be, so promises and
 * publication read them as computed pages. Decisions depend on measured
 * times: they change which blocks are computed and the counters, never an
 * output (loaded rows are the published rows, bit for bit).
 * Both lease kinds read the tier: a computed lease (a byte tier: the rows
 * are copied in) and an allocator-only one (external caches, fused or per
 * layer; its pool has no data, so its tier keeps keys only and a load maps
 * pages unwritten). An allocator-only run always loads what the tier holds:
 * it computes nothing (no prefill rate) and moves no bytes (no tier rate),
 * so the cost model has nothing to compare; its loads count the block bytes
 * a byte tier would have moved.
 * Callers: scheduler_prefill.c (kvpi_sched_prefill_prompts).
 */
#include <time.h>

#include "kvpager/tier.h"
#include "serve/scheduler_internal.h"
#include "serve/share_internal.h"

/* Every this many asks the model refused in a row, one loads anyway (to follow the tier). */
#define TIER_PROBE_EVERY 16
/* The weight of a load's rate in the tier's moving average (the first load, which may
 * include connecting, is forgotten after a few). */
#define TIER_RATE_WEIGHT 0.25

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double kvpi_sched_tier_clock(void)
{
    return now_seconds();
}

void kvpi_sched_tier_prefilled(kvp_scheduler *s, size_t tokens, double seconds)
{
    if (tokens != 0 && seconds > 0.0) {
        s->tier.prefill_tokens += tokens;
        s->tier.prefill_seconds += seconds;
    }
}

/*
 * 1 when a block is worth loading: its bytes (every layer's tier block) at
 * the tier's observed bytes per second (a moving average, weight 1/4, of
 * the rate of each load that brought blocks: its bytes over its time, round
 * trip, verification and copy included)
 * take no longer than its tokens at the measured prefill tokens per second. Optimistic (load) until both
 * rates are measured; a refusal counts toward the next probe.
 */
static int worth_loading(kvp_scheduler *s, size_t block_bytes)
{
    if (s->config.tier_loads == KVP_TIER_LOADS_ALWAYS || !s->leases->on_decoder) {
        return 1; /* allocator-only: no rate to compare (the file's head) */
    }
    if (s->tier.bytes_per_second <= 0.0 || s->tier.prefill_tokens == 0) {
        return 1; /* the optimistic prior */
    }
    double bytes_per_second = s->tier.bytes_per_second;
    double tokens_per_second = (double)s->tier.prefill_tokens / s->tier.prefill_seconds;
    double load = (double)(block_bytes * s->layers) / bytes_per_second;
    double compute = (double)s->block_tokens / tokens_per_second;
    if (load <= compute || ++s->tier.refused_in_row >= TIER_PROBE_EVERY) {
        s->tier.refused_in_row = 0;
        return 1;
    }
    return 0;
}

/* The counters of a load: the pool's tier counters after it, less those before. */
static void count_load(kvp_scheduler *s, const kvp_pool_tier_stats *before,
                       const kvp_pool_tier_stats *after, size_t loaded)
{
    s->stats.tier_hit_blocks += loaded;
    s->stats.tier_hit_tokens += loaded * s->block_tokens;
    s->stats.tier_load_bytes += after->load_bytes - before->load_bytes;
    s->stats.tier_rejected += after->rejected - before->rejected;
    s->stats.tier_errors += after->load_failures - before->load_failures;
}

size_t kvpi_sched_tier_load(kvp_scheduler *s, const planned *pl, size_t adopted, size_t adoptable,
                            lease *l0)
{
    size_t last = adoptable < pl->key_blocks ? adoptable : pl->key_blocks;
    if (!s->config.sharing || s->config.tier_loads == KVP_TIER_LOADS_NEVER || adopted >= last) {
        return 0;
    }
    kvp_pool_tier_stats before;
    kvp_pool_tier_stats_init(&before);
    if (kvp_pool_tier_stats_get(s->pool, &before, NULL) != KVP_OK) {
        return 0; /* no tier attached */
    }
    size_t want = last - adopted;
    if (!worth_loading(s, before.block_bytes)) {
        s->stats.tier_recomputes += want;
        return 0;
    }
    size_t loaded = 0;
    double t0 = now_seconds();
    kvp_status status =
        kvp_cache_group_tier_load(lease_caches(l0), s->layers,
                                  s->keys + pl->keys + adopted * s->layers, want, &loaded, NULL,
                                  NULL);
    double seconds = now_seconds() - t0;
    s->stats.tier_load_seconds += seconds;
    if (status != KVP_OK) {
        s->stats.tier_errors++; /* refused: nothing changed */
        return 0;
    }
    kvp_pool_tier_stats after;
    kvp_pool_tier_stats_init(&after);
    if (kvp_pool_tier_stats_get(s->pool, &after, NULL) == KVP_OK) {
        count_load(s, &before, &after, loaded);
        /* Loads that brought bytes (a miss says nothing; keys only bring none). */
        if (loaded != 0 && seconds > 0.0 && s->leases->on_decoder) {
            double rate = (double)(after.load_bytes - before.load_bytes) / seconds;
            double *r = &s->tier.bytes_per_second;
            *r = *r > 0.0 ? (1.0 - TIER_RATE_WEIGHT) * *r + TIER_RATE_WEIGHT * rate : rate;
        }
    }
    return loaded;
}
