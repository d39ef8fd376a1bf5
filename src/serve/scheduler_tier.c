/*
 * scheduler_tier.c: the scheduler reads the pool's second tier (the
 * scheduler's rooms: scheduler_internal.h; kvpager/scheduler.h, 6.).
 *
 * Owns: the load of an admitted request's prompt blocks that the prefix
 * index missed from the pool's tier (kvpi_sched_tier_load), the prefetch
 * of a waiting request's missed blocks (kvpi_sched_tier_prefetch: s->
 * prefetches, at most config.tier_prefetch in use; mapped at admission
 * when completed, cancelled and computed when still in flight), the decision
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
 * Prefetches: issued only once a step stands (after the plan), for
 * requests the plan did not take; a prefetch in flight is never waited
 * for (a late one is cancelled: the pager frees it when its get
 * completes); every slot is freed at the latest when its request stops
 * waiting (the next step's sweep) or the scheduler is destroyed.
 * Callers: scheduler_prefill.c (kvpi_sched_prefill_prompts), scheduler_step.c
 * (kvpi_sched_tier_prefetch), scheduler.c (kvpi_sched_tier_prefetch_drop_all).
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
 * trip, verification and copy included; a prefetch's from its issue to its
 * completion, plus its map) take no longer than its tokens at the measured
 * prefill tokens per second. Optimistic (load) until both rates are
 * measured. Changes nothing.
 */
static int cheaper_to_load(const kvp_scheduler *s, size_t block_bytes)
{
    if (s->config.tier_loads == KVP_TIER_LOADS_ALWAYS || !s->leases->on_decoder) {
        return 1; /* allocator-only: no rate to compare (the file's head) */
    }
    if (s->tier.bytes_per_second <= 0.0 || s->tier.prefill_tokens == 0) {
        return 1; /* the optimistic prior */
    }
    double tokens_per_second = (double)s->tier.prefill_tokens / s->tier.prefill_seconds;
    double load = (double)(block_bytes * s->layers) / s->tier.bytes_per_second;
    double compute = (double)s->block_tokens / tokens_per_second;
    return load <= compute;
}

/* cheaper_to_load, or every TIER_PROBE_EVERY-th refusal in a row (to follow the tier). */
static int worth_loading(kvp_scheduler *s, size_t block_bytes)
{
    if (cheaper_to_load(s, block_bytes) || ++s->tier.refused_in_row >= TIER_PROBE_EVERY) {
        s->tier.refused_in_row = 0;
        return 1;
    }
    return 0;
}

/* The tier's rate learns a load (or a prefetch and its map) that brought `bytes`. */
static void learn_rate(kvp_scheduler *s, uint64_t bytes, size_t loaded, double seconds)
{
    /* Loads that brought bytes (a miss says nothing; keys only bring none). */
    if (loaded != 0 && seconds > 0.0 && s->leases->on_decoder) {
        double rate = (double)bytes / seconds;
        double *r = &s->tier.bytes_per_second;
        *r = *r > 0.0 ? (1.0 - TIER_RATE_WEIGHT) * *r + TIER_RATE_WEIGHT * rate : rate;
    }
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

/* ---- prefetch while a request waits ------------------------------------------ */

static prefetch_slot *slot_of(kvp_scheduler *s, uint64_t id)
{
    for (size_t i = 0; i < KVP_TIER_PREFETCH_MAX; i++) {
        if (s->prefetches[i].id == id && id != NO_REQUEST) {
            return &s->prefetches[i];
        }
    }
    return NULL;
}

/* Frees the slot, cancelling its prefetch (freed by its completion when in flight). */
static void slot_free(prefetch_slot *ps, uint64_t *counter)
{
    kvp_tier_prefetch_destroy(ps->prefetch);
    ps->prefetch = NULL;
    ps->id = NO_REQUEST;
    if (counter != NULL) {
        (*counter)++;
    }
}

void kvpi_sched_tier_prefetch_drop_all(kvp_scheduler *s)
{
    for (size_t i = 0; i < KVP_TIER_PREFETCH_MAX; i++) {
        if (s->prefetches[i].id != NO_REQUEST) {
            slot_free(&s->prefetches[i], &s->stats.tier_prefetch_wasted);
        }
    }
}

/*
 * Maps request pl's prefetch, if it has one, after the `adopted` blocks
 * adoption left. Returns 1 when the admission is settled by it (*loaded
 * blocks mapped; 0 and late when it was still in flight: cancelled, never
 * waited for, the blocks computed), 0 when the load goes on as without one
 * (none, or unusable: counted wasted).
 */
static int prefetch_use(kvp_scheduler *s, const planned *pl, size_t adopted,
                        kvp_cache *const *caches, size_t *loaded)
{
    prefetch_slot *ps = slot_of(s, pl->id);
    double waited = 0.0;
    if (ps == NULL) {
        return 0;
    }
    if (!kvp_tier_prefetch_ready(ps->prefetch, &waited)) {
        slot_free(ps, &s->stats.tier_prefetch_late);
        return 1;
    }
    const kvp_block_key *keys = s->keys + pl->keys;
    const kvp_block_key *head = ps->first < pl->key_blocks ? &keys[ps->first * s->layers] : NULL;
    kvp_pool_tier_stats before;
    kvp_pool_tier_stats_init(&before);
    if (adopted < ps->first || adopted > ps->first + ps->blocks || head == NULL ||
        head->lo != ps->head.lo || head->hi != ps->head.hi ||
        kvp_pool_tier_stats_get(s->pool, &before, NULL) != KVP_OK) {
        slot_free(ps, &s->stats.tier_prefetch_wasted); /* the index lost blocks since, ... */
        return 0;
    }
    double t0 = now_seconds();
    kvp_status status = kvp_cache_group_tier_map(caches, s->layers, ps->prefetch,
                                                 adopted - ps->first, loaded, NULL, NULL);
    double seconds = now_seconds() - t0;
    if (status != KVP_OK) {
        slot_free(ps, &s->stats.tier_prefetch_wasted); /* e.g. the tier was detached since */
        return 0;
    }
    s->stats.tier_load_seconds += seconds;
    kvp_pool_tier_stats after;
    kvp_pool_tier_stats_init(&after);
    if (kvp_pool_tier_stats_get(s->pool, &after, NULL) == KVP_OK) {
        count_load(s, &before, &after, *loaded);
        learn_rate(s, after.load_bytes - before.load_bytes, *loaded, waited + seconds);
    }
    slot_free(ps, &s->stats.tier_prefetch_used);
    return 1;
}

/* 1 when `set` holds request keys made under the bindings idle[0] has now. */
static int keys_current(const kvp_scheduler *s, const keyset *set)
{
    if (set->id == NO_REQUEST || s->idle_count == 0) {
        return 0;
    }
    kvp_cache *const *caches = lease_caches(&s->idle[0]);
    for (size_t l = 0; l < s->layers; l++) {
        kvp_block_key now = kvpi_cache_binding_key(caches[l]);
        const kvp_block_key *then = &set->keys[set->count + l];
        if (now.lo != then->lo || now.hi != then->hi) {
            return 0;
        }
    }
    return 1;
}

/* 1 when request `id` waits and plan p did not take it. */
static int waits_unplanned(const kvp_scheduler *s, const plan *p, uint64_t id)
{
    const record *r = kvpi_requests_find(&s->requests, id);
    if (r == NULL || r->state != STATE_WAITING) {
        return 0;
    }
    for (size_t i = 0; i < p->popped; i++) {
        if (s->plan[i].id == id) {
            return 0;
        }
    }
    return 1;
}

/* Issues the prefetch of set's request's missed adoptable blocks into free slot ps. */
static void prefetch_issue(kvp_scheduler *s, const keyset *set, prefetch_slot *ps)
{
    const record *r = kvpi_requests_find(&s->requests, set->id);
    /* count = kvpi_prompt_keys_count(layers, 1, key_blocks): (layers + 1) a block + layers */
    size_t key_blocks = (set->count - s->layers) / (s->layers + 1);
    size_t adoptable = (r->request.prompt_tokens - 1) / s->block_tokens;
    adoptable = adoptable < key_blocks ? adoptable : key_blocks;
    size_t evictable = 0;
    size_t hits = kvpi_prefix_probe(s->pool, set->keys, s->layers, s->windows, s->block_tokens,
                                    adoptable, &evictable);
    if (hits >= adoptable) {
        return; /* the index holds every adoptable block */
    }
    const kvp_block_key *keys = set->keys + hits * s->layers;
    if (kvp_pool_tier_prefetch(s->pool, keys, adoptable - hits, s->layers, &ps->prefetch,
                               NULL) != KVP_OK) {
        s->stats.tier_errors++; /* refused: nothing changed */
        return;
    }
    ps->id = set->id;
    ps->first = hits;
    ps->blocks = adoptable - hits;
    ps->head = keys[0];
    s->stats.tier_prefetches++;
}

/* A free slot within config.tier_prefetch, or NULL. */
static prefetch_slot *slot_free_one(kvp_scheduler *s)
{
    size_t used = 0;
    prefetch_slot *free_one = NULL;
    for (size_t i = 0; i < KVP_TIER_PREFETCH_MAX; i++) {
        used += s->prefetches[i].id != NO_REQUEST;
        if (s->prefetches[i].id == NO_REQUEST && free_one == NULL) {
            free_one = &s->prefetches[i];
        }
    }
    return used < s->config.tier_prefetch ? free_one : NULL;
}

void kvpi_sched_tier_prefetch(kvp_scheduler *s, const plan *p)
{
    for (size_t i = 0; i < KVP_TIER_PREFETCH_MAX; i++) {
        prefetch_slot *ps = &s->prefetches[i];
        const record *r = ps->id == NO_REQUEST ? NULL : kvpi_requests_find(&s->requests, ps->id);
        if (ps->id != NO_REQUEST && (r == NULL || r->state != STATE_WAITING)) {
            slot_free(ps, &s->stats.tier_prefetch_wasted); /* finished, failed or dropped */
        }
    }
    kvp_pool_tier_stats ts;
    kvp_pool_tier_stats_init(&ts);
    if (!s->config.sharing || s->config.tier_loads == KVP_TIER_LOADS_NEVER ||
        s->config.tier_prefetch == 0 || kvp_pool_tier_stats_get(s->pool, &ts, NULL) != KVP_OK ||
        !cheaper_to_load(s, ts.block_bytes)) {
        return;
    }
    for (size_t i = 0; i <= WINDOW; i++) {
        const keyset *set = i == 0 ? &s->parked : &s->ranked[i - 1];
        if (!keys_current(s, set) || slot_of(s, set->id) != NULL ||
            !waits_unplanned(s, p, set->id)) {
            continue;
        }
        prefetch_slot *ps = slot_free_one(s);
        if (ps == NULL) {
            return;
        }
        prefetch_issue(s, set, ps);
    }
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
    size_t from_prefetch = 0;
    if (prefetch_use(s, pl, adopted, lease_caches(l0), &from_prefetch)) {
        return from_prefetch;
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
        learn_rate(s, after.load_bytes - before.load_bytes, loaded, seconds);
    }
    return loaded;
}
