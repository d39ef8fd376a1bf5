/*
 * demo.c: `kvpager demo`, the seed chapter's trace computed through pages.
 *
 * Owns: the seed chapter's fixture (D=4, H=2, d_h=2, W_q=W_k=W_v=I,
 * W_o swapping the head halves, capacity 4, block_tokens 2) and the evidence
 * the demo prints. Every printed value is computed by the run: outputs and
 * attention weights by incremental attention through the page table,
 * max_abs_diff against the full-prefix reference, work counts from the
 * tickets, reset evidence from the pool and cache audits, and each error case
 * from a before/after digest of the cache's logical rows and page tables plus
 * the pool's statistics.
 *
 * Output: the seed's six report lines byte for byte, then lines about pages,
 * pool exhaustion, in-place updates and the final audit; or, with --json, the
 * same evidence as one JSON object. Exit 0 when all evidence holds, 1 when
 * any fails, 2 on a usage or library error.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "cli.h"
#include "json.h"

#define MODEL_WIDTH 4
#define HEADS 2
#define HEAD_WIDTH 2
#define CAPACITY 4
#define MAX_POSITIONS 8
#define ROPE_BASE 10000.0
#define BLOCK_TOKENS 2
#define STEPS 3
#define MAIN_POOL_PAGES 16
#define ERROR_CASES 8

typedef struct step_evidence {
    size_t position;
    size_t cache_before;
    size_t cache_after;
    size_t shape[4];
    double max_abs_diff;
    double output[MODEL_WIDTH];
    double weights[HEADS][STEPS]; /* [head][key], keys 0..position */
    kvp_attention_work work;
} step_evidence;

typedef struct reset_evidence {
    size_t before;
    size_t after;
    int allocation_reused; /* same slab, same page tables, same physical pages */
    int storage_unchanged; /* the reset wrote no byte of the slab */
    int replay_identical;
    uint32_t pages[STEPS];  /* lane 0's pages before the reset, by block */
    size_t blocks;
    size_t free_before_reset;
    size_t free_after_reset;
    uint64_t heap_bytes;   /* jemalloc traffic during reset and replay */
} reset_evidence;

typedef struct error_case {
    const char *name;
    kvp_status expected;
    kvp_status got;
    int unchanged;
} error_case;

typedef struct exhausted_evidence {
    kvp_status got;
    size_t needed;
    size_t available;
    int unchanged;
} exhausted_evidence;

typedef struct update_evidence {
    uint64_t revision_before;
    uint64_t revision_after;
    kvp_status old_cache;
    kvp_status old_cache_after_reset;
    kvp_status new_cache;
    int unchanged;
    int new_cache_matches;
} update_evidence;

typedef struct demo_evidence {
    step_evidence steps[STEPS];
    reset_evidence reset;
    error_case errors[ERROR_CASES];
    exhausted_evidence exhausted;
    update_evidence update;
    size_t pools_checked;
    size_t audit_mismatches;
    size_t pages_held_at_exit;
} demo_evidence;

/* Every object the demo makes, so one function can free them all. */
typedef struct demo_objects {
    kvp_pool *pools[4];
    size_t npools;
    kvp_layer *layers[8];
    size_t nlayers;
    kvp_cache *caches[16];
    size_t ncaches;
    kvp_ticket *tickets[16];
    size_t ntickets;
} demo_objects;

typedef struct demo {
    demo_objects objects;
    double inputs[STEPS][MODEL_WIDTH];
    kvp_error err;
    const char *failed_at; /* context of the first library error */
} demo;

static int track_pool(demo *d, kvp_status status, kvp_pool *pool, const char *context)
{
    if (status != KVP_OK) {
        d->failed_at = context;
        return -1;
    }
    d->objects.pools[d->objects.npools++] = pool;
    return 0;
}

static kvp_pool *make_pool(demo *d, size_t heads, size_t head_width, size_t pages)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BLOCK_TOKENS;
    config.heads = heads;
    config.head_width = head_width;
    config.budget_bytes = pages * 2 * heads * BLOCK_TOKENS * head_width * sizeof(double);
    config.dtype = KVP_F64;
    kvp_pool *pool = NULL;
    kvp_status status = kvp_pool_create(&config, &pool, &d->err);
    return track_pool(d, status, pool, "creating a pool") == 0 ? pool : NULL;
}

static kvp_layer *keep_layer(demo *d, kvp_status status, kvp_layer *layer, const char *context)
{
    if (status != KVP_OK) {
        d->failed_at = context;
        return NULL;
    }
    d->objects.layers[d->objects.nlayers++] = layer;
    return layer;
}

/* A cache of `layer` on `pool`, and a ticket for it. */
static kvp_cache *make_cache(demo *d, kvp_pool *pool, const kvp_layer *layer, size_t batch,
                             size_t capacity, kvp_ticket **ticket)
{
    kvp_binding binding;
    kvp_cache *cache = NULL;
    if (kvp_layer_binding_get(layer, &binding, &d->err) != KVP_OK ||
        kvp_cache_create(pool, &binding, batch, capacity, &cache, &d->err) != KVP_OK) {
        d->failed_at = "creating a cache";
        return NULL;
    }
    d->objects.caches[d->objects.ncaches++] = cache;
    if (kvp_ticket_create(cache, ticket, &d->err) != KVP_OK) {
        d->failed_at = "creating a ticket";
        return NULL;
    }
    d->objects.tickets[d->objects.ntickets++] = *ticket;
    return cache;
}

/* Destroys everything; counts pages still held and audit mismatches first. */
static void free_objects(demo_objects *o, demo_evidence *ev)
{
    for (size_t i = 0; i < o->ntickets; i++) {
        (void)kvp_ticket_destroy(o->tickets[i], NULL);
    }
    for (size_t i = 0; i < o->ncaches; i++) {
        (void)kvp_cache_destroy(o->caches[i], NULL);
    }
    for (size_t i = 0; i < o->nlayers; i++) {
        (void)kvp_layer_destroy(o->layers[i], NULL);
    }
    for (size_t i = 0; i < o->npools; i++) {
        kvp_pool_stats stats;
        kvp_pool_stats_init(&stats);
        kvp_error err;
        if (ev != NULL) {
            ev->pools_checked++;
            if (kvp_pool_check(o->pools[i], NULL, NULL, &err) != KVP_OK) {
                ev->audit_mismatches += err.mismatches;
            }
            if (kvp_pool_stats_get(o->pools[i], &stats, NULL) == KVP_OK) {
                ev->pages_held_at_exit += stats.held_pages;
            }
        }
        if (kvp_pool_destroy(o->pools[i], NULL) != KVP_OK && ev != NULL) {
            ev->audit_mismatches++; /* a pool that cannot be destroyed still holds something */
        }
    }
    memset(o, 0, sizeof *o);
}

/* The fixture layer: identity W_q, W_k, W_v and W_o swapping the head halves. */
static kvp_layer *fixture_layer(demo *d, size_t max_positions, double base, kvp_param **shared)
{
    double identity[MODEL_WIDTH * MODEL_WIDTH] = {0};
    double swap[MODEL_WIDTH * MODEL_WIDTH] = {0};
    for (size_t i = 0; i < MODEL_WIDTH; i++) {
        identity[i * MODEL_WIDTH + i] = 1.0;
        swap[i * MODEL_WIDTH + (i + MODEL_WIDTH / 2) % MODEL_WIDTH] = 1.0;
    }
    kvp_param *params[KVP_PARAM_COUNT] = {NULL, NULL, NULL, NULL};
    kvp_status status = KVP_OK;
    for (size_t i = 0; i < KVP_PARAM_COUNT && status == KVP_OK; i++) {
        if (shared != NULL) {
            params[i] = shared[i];
            status = kvp_param_retain(params[i], &d->err);
        } else {
            status = kvp_param_create(MODEL_WIDTH, i == KVP_PARAM_OUTPUT ? swap : identity,
                                      &params[i], &d->err);
        }
    }
    kvp_layer *layer = NULL;
    if (status == KVP_OK) {
        status = kvp_layer_create(params[0], params[1], params[2], params[3], HEADS,
                                  max_positions, base, &layer, &d->err);
    }
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        if (params[i] != NULL) {
            (void)kvp_param_release(params[i], NULL);
        }
    }
    return keep_layer(d, status, layer, "creating the fixture layer");
}

static kvp_param **layer_params(kvp_layer *layer, kvp_param *out[KVP_PARAM_COUNT])
{
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        out[i] = kvp_layer_param_mut(layer, i);
    }
    return out;
}

/* The three incremental steps. Allocates nothing. */
static kvp_status run_steps(demo *d, const kvp_layer *layer, kvp_cache *cache,
                            kvp_ticket *ticket, step_evidence steps[STEPS])
{
    memset(steps, 0, STEPS * sizeof *steps);
    for (size_t t = 0; t < STEPS; t++) {
        step_evidence *step = &steps[t];
        kvp_tensor input = kvp_tensor3(d->inputs[t], 1, 1, MODEL_WIDTH);
        step->cache_before = kvp_cache_len(cache);
        kvp_status status = kvp_attention_forward(layer, &input, cache, ticket, &d->err);
        kvp_attention_result result;
        if (status == KVP_OK) {
            status = kvp_ticket_result(ticket, &result, &d->err);
        }
        if (status != KVP_OK) {
            d->failed_at = "running an incremental step";
            return status;
        }
        step->position = result.work.position;
        step->cache_after = kvp_cache_len(cache);
        step->shape[0] = 1;
        step->shape[1] = HEADS;
        step->shape[2] = step->cache_after;
        step->shape[3] = HEAD_WIDTH;
        memcpy(step->output, result.output, sizeof step->output);
        for (size_t h = 0; h < HEADS; h++) {
            memcpy(step->weights[h], result.weights + h * result.keys,
                   result.keys * sizeof(double));
        }
        step->work = result.work;
    }
    return KVP_OK;
}

/* max_abs_diff of each step against the full-prefix reference over its prefix. */
static kvp_status compare_with_reference(demo *d, const kvp_layer *layer,
                                         step_evidence steps[STEPS])
{
    for (size_t t = 0; t < STEPS; t++) {
        double reference[STEPS * MODEL_WIDTH];
        kvp_tensor prefix = kvp_tensor3(&d->inputs[0][0], 1, t + 1, MODEL_WIDTH);
        kvp_status status = kvp_attention_reference(layer, &prefix, reference,
                                                    STEPS * MODEL_WIDTH, NULL, NULL, 0, &d->err);
        if (status != KVP_OK) {
            d->failed_at = "running the full-prefix reference";
            return status;
        }
        double worst = 0.0;
        for (size_t f = 0; f < MODEL_WIDTH; f++) {
            double diff = fabs(steps[t].output[f] - reference[t * MODEL_WIDTH + f]);
            worst = diff > worst ? diff : worst;
        }
        steps[t].max_abs_diff = worst;
    }
    return KVP_OK;
}

static size_t lane0_pages(const kvp_cache *cache, uint32_t pages[STEPS])
{
    size_t blocks = 0;
    while (blocks < STEPS && kvp_cache_page(cache, 0, blocks, &pages[blocks], NULL) == KVP_OK) {
        blocks++;
    }
    return blocks;
}

static size_t free_pages(kvp_pool *pool)
{
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    return kvp_pool_stats_get(pool, &stats, NULL) == KVP_OK ? stats.free_pages : 0;
}

/* Reset, then replay: the same slab, tables and pages, no heap traffic, same results. */
static kvp_status reset_and_replay(demo *d, const kvp_layer *layer, kvp_pool *pool,
                                   kvp_cache *cache, kvp_ticket *ticket,
                                   const step_evidence steps[STEPS], reset_evidence *ev)
{
    kvp_pool_stats stats_before;
    kvp_pool_stats_init(&stats_before);
    kvp_cache_info info_before;
    kvp_cache_info_init(&info_before);
    uint64_t digest_before = 0;
    uint64_t digest_after = 0;
    if (kvp_pool_stats_get(pool, &stats_before, &d->err) != KVP_OK ||
        kvp_cache_info_get(cache, &info_before, &d->err) != KVP_OK ||
        kvp_pool_digest(pool, &digest_before, &d->err) != KVP_OK) {
        d->failed_at = "auditing before the reset";
        return d->err.status;
    }
    ev->before = info_before.len;
    ev->blocks = lane0_pages(cache, ev->pages);
    ev->free_before_reset = stats_before.free_pages;

    uint64_t heap_start = kvp_cli_heap_traffic();
    kvp_status status = kvp_cache_reset(cache, &d->err);
    uint64_t heap_reset = kvp_cli_heap_traffic() - heap_start;
    if (status != KVP_OK || kvp_pool_digest(pool, &digest_after, &d->err) != KVP_OK) {
        d->failed_at = "resetting the cache";
        return d->err.status;
    }
    ev->after = kvp_cache_len(cache);
    ev->free_after_reset = free_pages(pool);
    ev->storage_unchanged = digest_before == digest_after;

    step_evidence replay[STEPS];
    heap_start = kvp_cli_heap_traffic();
    status = run_steps(d, layer, cache, ticket, replay);
    ev->heap_bytes = heap_reset + (kvp_cli_heap_traffic() - heap_start);
    if (status != KVP_OK || compare_with_reference(d, layer, replay) != KVP_OK) {
        return d->err.status;
    }
    uint32_t pages_after[STEPS];
    size_t blocks_after = lane0_pages(cache, pages_after);
    kvp_pool_stats stats_after;
    kvp_pool_stats_init(&stats_after);
    kvp_cache_info info_after;
    kvp_cache_info_init(&info_after);
    if (kvp_pool_stats_get(pool, &stats_after, &d->err) != KVP_OK ||
        kvp_cache_info_get(cache, &info_after, &d->err) != KVP_OK) {
        d->failed_at = "auditing after the replay";
        return d->err.status;
    }
    ev->allocation_reused = stats_after.slab_address == stats_before.slab_address &&
                            info_after.tables_address == info_before.tables_address &&
                            blocks_after == ev->blocks &&
                            memcmp(pages_after, ev->pages, ev->blocks * sizeof(uint32_t)) == 0;
    ev->replay_identical = memcmp(replay, steps, sizeof replay) == 0;
    return KVP_OK;
}

/*
 * One forward that is expected to fail. *unchanged says whether it changed
 * nothing: not the cache's digest (len, logical rows, page tables) and not the
 * pool's stats, except the exhaustion counter, which must move by exactly
 * `exhaustions` (1 for a PoolExhausted case, else 0).
 */
static kvp_status forward_unchanged(const kvp_layer *layer, const kvp_tensor *input,
                                    kvp_pool *pool, kvp_cache *cache, kvp_ticket *ticket,
                                    uint64_t exhaustions, kvp_error *err, int *unchanged)
{
    uint64_t before = 0;
    uint64_t after = 0;
    kvp_pool_stats stats_before;
    kvp_pool_stats_init(&stats_before);
    kvp_pool_stats stats_after;
    kvp_pool_stats_init(&stats_after);
    int audited = kvp_cache_digest(cache, &before, NULL) == KVP_OK &&
                  kvp_pool_stats_get(pool, &stats_before, NULL) == KVP_OK;
    kvp_status status = kvp_attention_forward(layer, input, cache, ticket, err);
    audited = audited && kvp_cache_digest(cache, &after, NULL) == KVP_OK &&
              kvp_pool_stats_get(pool, &stats_after, NULL) == KVP_OK;
    int counted = stats_after.exhaustions == stats_before.exhaustions + exhaustions;
    stats_after.exhaustions = stats_before.exhaustions;
    *unchanged = audited && counted && before == after &&
                 memcmp(&stats_before, &stats_after, sizeof stats_before) == 0;
    return status;
}

/* The seed's unchanged_after_error: the call fails as expected and changes nothing. */
static void expect_unchanged_error(error_case *c, const kvp_layer *layer,
                                   const kvp_tensor *input, kvp_pool *pool, kvp_cache *cache,
                                   kvp_ticket *ticket)
{
    kvp_error err;
    c->got = forward_unchanged(layer, input, pool, cache, ticket, 0, &err, &c->unchanged);
}

static int error_evidence(demo *d, kvp_layer *layer, kvp_pool *pool, error_case cases[ERROR_CASES])
{
    static const struct {
        const char *name;
        kvp_status expected;
    } expected[ERROR_CASES] = {
        {"two_tokens", KVP_SINGLE_TOKEN_REQUIRED},
        {"full_cache", KVP_FULL},
        {"model_mismatch", KVP_CACHE_MODEL_WIDTH_MISMATCH},
        {"head_mismatch", KVP_CACHE_HEAD_COUNT_MISMATCH},
        {"layer_mismatch", KVP_CACHE_LAYER_MISMATCH},
        {"rope_mismatch", KVP_CACHE_ROPE_MISMATCH},
        {"rope_positions_mismatch", KVP_CACHE_ROPE_MISMATCH},
        {"nonfinite_projection", KVP_NONFINITE_SCORE},
    };
    for (size_t i = 0; i < ERROR_CASES; i++) {
        cases[i].name = expected[i].name;
        cases[i].expected = expected[i].expected;
        cases[i].got = KVP_OK;
        cases[i].unchanged = 0;
    }
    kvp_tensor single = kvp_tensor3(d->inputs[0], 1, 1, MODEL_WIDTH);
    kvp_tensor two = kvp_tensor3(&d->inputs[0][0], 1, 2, MODEL_WIDTH);
    double huge[MODEL_WIDTH] = {DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX};
    kvp_tensor overflowing = kvp_tensor3(huge, 1, 1, MODEL_WIDTH);
    kvp_ticket *ticket = NULL;
    kvp_param *params[KVP_PARAM_COUNT];
    layer_params(layer, params);

    kvp_cache *cache = make_cache(d, pool, layer, 1, 2, &ticket);
    if (cache == NULL) {
        return -1;
    }
    expect_unchanged_error(&cases[0], layer, &two, pool, cache, ticket);

    cache = make_cache(d, pool, layer, 1, 1, &ticket);
    if (cache == NULL || kvp_attention_forward(layer, &single, cache, ticket, &d->err) != KVP_OK) {
        d->failed_at = d->failed_at ? d->failed_at : "filling the one-row cache";
        return -1;
    }
    expect_unchanged_error(&cases[1], layer, &single, pool, cache, ticket);

    kvp_layer *wider = NULL;
    kvp_status status =
        kvp_layer_create_random(8, HEADS, MAX_POSITIONS, ROPE_BASE, 37, &wider, &d->err);
    wider = keep_layer(d, status, wider, "creating the wider layer");
    kvp_pool *wide_pool = wider ? make_pool(d, HEADS, 4, 4) : NULL;
    cache = wide_pool ? make_cache(d, wide_pool, wider, 1, CAPACITY, &ticket) : NULL;
    if (cache == NULL) {
        return -1;
    }
    expect_unchanged_error(&cases[2], layer, &single, wide_pool, cache, ticket);

    kvp_layer *one_head = NULL;
    status = kvp_layer_create_random(MODEL_WIDTH, 1, MAX_POSITIONS, ROPE_BASE, 38, &one_head,
                                     &d->err);
    one_head = keep_layer(d, status, one_head, "creating the one-head layer");
    kvp_pool *one_pool = one_head ? make_pool(d, 1, MODEL_WIDTH, 4) : NULL;
    cache = one_pool ? make_cache(d, one_pool, one_head, 1, CAPACITY, &ticket) : NULL;
    if (cache == NULL) {
        return -1;
    }
    expect_unchanged_error(&cases[3], layer, &single, one_pool, cache, ticket);

    kvp_layer *other = fixture_layer(d, MAX_POSITIONS, ROPE_BASE, NULL);
    cache = other ? make_cache(d, pool, other, 1, CAPACITY, &ticket) : NULL;
    if (cache == NULL) {
        return -1;
    }
    expect_unchanged_error(&cases[4], layer, &single, pool, cache, ticket);

    kvp_layer *different_rope = fixture_layer(d, MAX_POSITIONS, ROPE_BASE * 2.0, params);
    cache = different_rope ? make_cache(d, pool, layer, 1, CAPACITY, &ticket) : NULL;
    if (cache == NULL) {
        return -1;
    }
    expect_unchanged_error(&cases[5], different_rope, &single, pool, cache, ticket);

    kvp_layer *different_positions = fixture_layer(d, MAX_POSITIONS + 1, ROPE_BASE, params);
    cache = different_positions ? make_cache(d, pool, layer, 1, CAPACITY, &ticket) : NULL;
    if (cache == NULL) {
        return -1;
    }
    expect_unchanged_error(&cases[6], different_positions, &single, pool, cache, ticket);

    cache = make_cache(d, pool, layer, 1, CAPACITY, &ticket);
    if (cache == NULL) {
        return -1;
    }
    expect_unchanged_error(&cases[7], layer, &overflowing, pool, cache, ticket);
    return 0;
}

/* A batch of two lanes on a three-page pool: the second block cannot get both pages. */
static int exhausted_evidence_run(demo *d, const kvp_layer *layer, exhausted_evidence *ev)
{
    kvp_pool *pool = make_pool(d, HEADS, HEAD_WIDTH, 3);
    kvp_ticket *ticket = NULL;
    kvp_cache *cache = pool ? make_cache(d, pool, layer, 2, CAPACITY, &ticket) : NULL;
    if (cache == NULL) {
        return -1;
    }
    double rows[2 * MODEL_WIDTH];
    for (size_t t = 0; t < 2; t++) {
        memcpy(rows, d->inputs[t], sizeof d->inputs[t]);
        memcpy(rows + MODEL_WIDTH, d->inputs[t], sizeof d->inputs[t]);
        kvp_tensor input = kvp_tensor3(rows, 2, 1, MODEL_WIDTH);
        if (kvp_attention_forward(layer, &input, cache, ticket, &d->err) != KVP_OK) {
            d->failed_at = "filling the first block";
            return -1;
        }
    }
    memcpy(rows, d->inputs[2], sizeof d->inputs[2]);
    memcpy(rows + MODEL_WIDTH, d->inputs[2], sizeof d->inputs[2]);
    kvp_tensor input = kvp_tensor3(rows, 2, 1, MODEL_WIDTH);
    kvp_error err;
    ev->got = forward_unchanged(layer, &input, pool, cache, ticket, 1, &err, &ev->unchanged);
    ev->needed = err.needed;
    ev->available = err.available;
    return 0;
}

static void copy_values(void *ctx, double *values, size_t width)
{
    memcpy(values, ctx, width * width * sizeof *values);
}

/* An in-place update makes the old cache stale for good; a new cache works. */
static int update_evidence_run(demo *d, kvp_pool *pool, const step_evidence *first,
                               update_evidence *ev)
{
    kvp_layer *layer = fixture_layer(d, MAX_POSITIONS, ROPE_BASE, NULL);
    kvp_ticket *old_ticket = NULL;
    kvp_cache *old_cache = layer ? make_cache(d, pool, layer, 1, CAPACITY, &old_ticket) : NULL;
    kvp_tensor x0 = kvp_tensor3(d->inputs[0], 1, 1, MODEL_WIDTH);
    kvp_tensor x1 = kvp_tensor3(d->inputs[1], 1, 1, MODEL_WIDTH);
    if (old_cache == NULL ||
        kvp_attention_forward(layer, &x0, old_cache, old_ticket, &d->err) != KVP_OK) {
        d->failed_at = d->failed_at ? d->failed_at : "filling the cache to be made stale";
        return -1;
    }
    kvp_param *w_value = kvp_layer_param_mut(layer, KVP_PARAM_VALUE);
    double same[MODEL_WIDTH * MODEL_WIDTH];
    memcpy(same, kvp_param_values(w_value), sizeof same);
    ev->revision_before = kvp_param_revision(w_value);
    if (kvp_param_update_with(w_value, copy_values, same, &d->err) != KVP_OK) {
        d->failed_at = "updating a parameter in place";
        return -1;
    }
    ev->revision_after = kvp_param_revision(w_value);
    kvp_error err;
    ev->old_cache =
        forward_unchanged(layer, &x1, pool, old_cache, old_ticket, 0, &err, &ev->unchanged);
    if (kvp_cache_reset(old_cache, &d->err) != KVP_OK) {
        d->failed_at = "resetting the stale cache";
        return -1;
    }
    ev->old_cache_after_reset = kvp_attention_forward(layer, &x0, old_cache, old_ticket, &err);

    kvp_ticket *new_ticket = NULL;
    kvp_cache *new_cache = make_cache(d, pool, layer, 1, CAPACITY, &new_ticket);
    if (new_cache == NULL) {
        return -1;
    }
    ev->new_cache = kvp_attention_forward(layer, &x0, new_cache, new_ticket, &err);
    kvp_attention_result result;
    ev->new_cache_matches =
        ev->new_cache == KVP_OK && kvp_ticket_result(new_ticket, &result, NULL) == KVP_OK &&
        memcmp(result.output, first->output, sizeof first->output) == 0;
    return 0;
}

static int run_demo(demo *d, demo_evidence *ev)
{
    kvp_pool *pool = make_pool(d, HEADS, HEAD_WIDTH, MAIN_POOL_PAGES);
    kvp_layer *layer = pool ? fixture_layer(d, MAX_POSITIONS, ROPE_BASE, NULL) : NULL;
    kvp_ticket *ticket = NULL;
    kvp_cache *cache = layer ? make_cache(d, pool, layer, 1, CAPACITY, &ticket) : NULL;
    if (cache == NULL || run_steps(d, layer, cache, ticket, ev->steps) != KVP_OK ||
        compare_with_reference(d, layer, ev->steps) != KVP_OK ||
        reset_and_replay(d, layer, pool, cache, ticket, ev->steps, &ev->reset) != KVP_OK) {
        return -1;
    }
    if (error_evidence(d, layer, pool, ev->errors) != 0 ||
        exhausted_evidence_run(d, layer, &ev->exhausted) != 0 ||
        update_evidence_run(d, pool, &ev->steps[0], &ev->update) != 0) {
        return -1;
    }
    return 0;
}

static int errors_hold(const demo_evidence *ev, int *all_unchanged)
{
    int ok = 1;
    *all_unchanged = 1;
    for (size_t i = 0; i < ERROR_CASES; i++) {
        ok = ok && ev->errors[i].got == ev->errors[i].expected && ev->errors[i].unchanged;
        *all_unchanged = *all_unchanged && ev->errors[i].unchanged;
    }
    return ok && *all_unchanged;
}

/* Every step matched the reference at its position. */
static int steps_hold(const demo_evidence *ev)
{
    int ok = 1;
    for (size_t t = 0; t < STEPS; t++) {
        ok = ok && ev->steps[t].max_abs_diff <= 1e-12 && ev->steps[t].position == t;
    }
    return ok;
}

/* The reset emptied the cache, kept its allocation and storage, and replayed identically
 * without heap traffic. */
static int reset_holds(const reset_evidence *r)
{
    return r->after == 0 && r->allocation_reused && r->storage_unchanged &&
           r->replay_identical && r->heap_bytes == 0;
}

/* The update bumped the revision once; the old cache is refused (reset or not), a new one
 * accepted and matching, and nothing changed on the refusals. */
static int update_holds(const update_evidence *u)
{
    return u->revision_after == u->revision_before + 1 &&
           u->old_cache == KVP_CACHE_LAYER_REVISION_MISMATCH &&
           u->old_cache_after_reset == KVP_CACHE_LAYER_REVISION_MISMATCH &&
           u->new_cache == KVP_OK && u->unchanged && u->new_cache_matches;
}

static int evidence_holds(const demo_evidence *ev)
{
    int unchanged = 0;
    return steps_hold(ev) && reset_holds(&ev->reset) && errors_hold(ev, &unchanged) &&
           ev->exhausted.got == KVP_POOL_EXHAUSTED && ev->exhausted.unchanged &&
           update_holds(&ev->update) && ev->audit_mismatches == 0 &&
           ev->pages_held_at_exit == 0;
}

static const char *yes(int value)
{
    return value ? "true" : "false";
}

static void print_vector(const double *values, size_t n)
{
    putchar('[');
    for (size_t i = 0; i < n; i++) {
        printf("%s%.9f", i == 0 ? "" : ",", values[i]);
    }
    putchar(']');
}

static void print_text(const demo_evidence *ev)
{
    size_t full = 0;
    size_t incremental = 0;
    size_t reused = 0;
    for (size_t t = 0; t < STEPS; t++) {
        const step_evidence *s = &ev->steps[t];
        printf("step=position:%zu cache:%zu->%zu shape:[%zu,%zu,%zu,%zu] max_abs_diff:%.12f "
               "output:",
               s->position, s->cache_before, s->cache_after, s->shape[0], s->shape[1],
               s->shape[2], s->shape[3], s->max_abs_diff);
        print_vector(s->output, MODEL_WIDTH);
        putchar('\n');
        full += s->work.full_prefix_rows_per_projection;
        incremental += s->work.incremental_rows_per_projection;
        reused += s->work.reused_key_value_rows;
    }
    printf("work=full_rows_per_projection:%zu incremental_rows_per_projection:%zu "
           "reused_rows_per_kv_projection:%zu avoided_rows_across_kv:%zu\n",
           full, incremental, reused, 2 * reused);
    const reset_evidence *r = &ev->reset;
    printf("reset=before:%zu after:%zu allocation_reused:%s storage_unchanged:%s "
           "replay_identical:%s\n",
           r->before, r->after, yes(r->allocation_reused), yes(r->storage_unchanged),
           yes(r->replay_identical));
    int unchanged = 0;
    (void)errors_hold(ev, &unchanged);
    printf("errors=");
    for (size_t i = 0; i < ERROR_CASES; i++) {
        const error_case *c = &ev->errors[i];
        printf("%s:%s ", c->name, yes(c->got == c->expected && c->unchanged));
    }
    printf("unchanged:%s\n", yes(unchanged));

    printf("pages=block_tokens:%d lane0_physical:[", BLOCK_TOKENS);
    for (size_t b = 0; b < r->blocks; b++) {
        printf("%s%u", b == 0 ? "" : ",", (unsigned)r->pages[b]);
    }
    printf("] free_before_reset:%zu free_after_reset:%zu replay_same_pages:%s "
           "heap_bytes_during_reset_and_replay:%llu\n",
           r->free_before_reset, r->free_after_reset, yes(r->allocation_reused),
           (unsigned long long)r->heap_bytes);
    for (size_t i = 0; i < ERROR_CASES; i++) {
        printf("error_case=%s expected:%s got:%s unchanged:%s\n", ev->errors[i].name,
               kvp_status_name(ev->errors[i].expected), kvp_status_name(ev->errors[i].got),
               yes(ev->errors[i].unchanged));
    }
    const exhausted_evidence *x = &ev->exhausted;
    printf("exhausted=status:%s needed:%zu free:%zu unchanged:%s\n", kvp_status_name(x->got),
           x->needed, x->available, yes(x->unchanged));
    const update_evidence *u = &ev->update;
    printf("update=parameter:%d revision:%llu->%llu old_cache:%s old_cache_after_reset:%s "
           "new_cache:%s unchanged:%s new_cache_matches:%s\n",
           KVP_PARAM_VALUE, (unsigned long long)u->revision_before,
           (unsigned long long)u->revision_after, kvp_status_name(u->old_cache),
           kvp_status_name(u->old_cache_after_reset), kvp_status_name(u->new_cache),
           yes(u->unchanged), yes(u->new_cache_matches));
    printf("audit=pools_checked:%zu mismatches:%zu pages_held_at_exit:%zu\n", ev->pools_checked,
           ev->audit_mismatches, ev->pages_held_at_exit);
}

static void json_doubles(kvp_json *json, const char *key, const double *values, size_t n)
{
    kvp_json_array_begin(json, key);
    for (size_t i = 0; i < n; i++) {
        kvp_json_double(json, NULL, values[i]);
    }
    kvp_json_array_end(json);
}

static void print_json(const demo_evidence *ev, int ok)
{
    kvp_json json;
    kvp_json_init(&json, stdout);
    kvp_json_object_begin(&json, NULL);
    kvp_json_array_begin(&json, "steps");
    for (size_t t = 0; t < STEPS; t++) {
        const step_evidence *s = &ev->steps[t];
        kvp_json_object_begin(&json, NULL);
        kvp_json_uint(&json, "position", s->position);
        kvp_json_uint(&json, "cache_before", s->cache_before);
        kvp_json_uint(&json, "cache_after", s->cache_after);
        kvp_json_array_begin(&json, "shape");
        for (size_t i = 0; i < 4; i++) {
            kvp_json_uint(&json, NULL, s->shape[i]);
        }
        kvp_json_array_end(&json);
        kvp_json_double(&json, "max_abs_diff", s->max_abs_diff);
        json_doubles(&json, "output", s->output, MODEL_WIDTH);
        kvp_json_array_begin(&json, "weights");
        for (size_t h = 0; h < HEADS; h++) {
            json_doubles(&json, NULL, s->weights[h], s->position + 1);
        }
        kvp_json_array_end(&json);
        kvp_json_uint(&json, "full_rows_per_projection", s->work.full_prefix_rows_per_projection);
        kvp_json_uint(&json, "incremental_rows_per_projection",
                      s->work.incremental_rows_per_projection);
        kvp_json_uint(&json, "reused_rows_per_kv_projection", s->work.reused_key_value_rows);
        kvp_json_object_end(&json);
    }
    kvp_json_array_end(&json);
    const reset_evidence *r = &ev->reset;
    kvp_json_object_begin(&json, "reset");
    kvp_json_uint(&json, "before", r->before);
    kvp_json_uint(&json, "after", r->after);
    kvp_json_bool(&json, "allocation_reused", r->allocation_reused);
    kvp_json_bool(&json, "storage_unchanged", r->storage_unchanged);
    kvp_json_bool(&json, "replay_identical", r->replay_identical);
    kvp_json_array_begin(&json, "lane0_physical_pages");
    for (size_t b = 0; b < r->blocks; b++) {
        kvp_json_uint(&json, NULL, r->pages[b]);
    }
    kvp_json_array_end(&json);
    kvp_json_uint(&json, "free_before_reset", r->free_before_reset);
    kvp_json_uint(&json, "free_after_reset", r->free_after_reset);
    kvp_json_uint(&json, "heap_bytes_during_reset_and_replay", r->heap_bytes);
    kvp_json_object_end(&json);
    kvp_json_array_begin(&json, "errors");
    for (size_t i = 0; i < ERROR_CASES; i++) {
        kvp_json_object_begin(&json, NULL);
        kvp_json_string(&json, "case", ev->errors[i].name);
        kvp_json_string(&json, "expected", kvp_status_name(ev->errors[i].expected));
        kvp_json_string(&json, "got", kvp_status_name(ev->errors[i].got));
        kvp_json_bool(&json, "unchanged", ev->errors[i].unchanged);
        kvp_json_object_end(&json);
    }
    kvp_json_array_end(&json);
    kvp_json_object_begin(&json, "exhausted");
    kvp_json_string(&json, "status", kvp_status_name(ev->exhausted.got));
    kvp_json_uint(&json, "needed", ev->exhausted.needed);
    kvp_json_uint(&json, "free", ev->exhausted.available);
    kvp_json_bool(&json, "unchanged", ev->exhausted.unchanged);
    kvp_json_object_end(&json);
    const update_evidence *u = &ev->update;
    kvp_json_object_begin(&json, "update");
    kvp_json_uint(&json, "parameter", KVP_PARAM_VALUE);
    kvp_json_uint(&json, "revision_before", u->revision_before);
    kvp_json_uint(&json, "revision_after", u->revision_after);
    kvp_json_string(&json, "old_cache", kvp_status_name(u->old_cache));
    kvp_json_string(&json, "old_cache_after_reset", kvp_status_name(u->old_cache_after_reset));
    kvp_json_string(&json, "new_cache", kvp_status_name(u->new_cache));
    kvp_json_bool(&json, "unchanged", u->unchanged);
    kvp_json_bool(&json, "new_cache_matches", u->new_cache_matches);
    kvp_json_object_end(&json);
    kvp_json_object_begin(&json, "audit");
    kvp_json_uint(&json, "pools_checked", ev->pools_checked);
    kvp_json_uint(&json, "mismatches", ev->audit_mismatches);
    kvp_json_uint(&json, "pages_held_at_exit", ev->pages_held_at_exit);
    kvp_json_object_end(&json);
    kvp_json_bool(&json, "ok", ok);
    kvp_json_object_end(&json);
}

static void demo_usage(FILE *out)
{
    fprintf(out,
            "usage: kvpager demo [--json]\n\n"
            "Runs the seed chapter's fixture (D=4, H=2, d_h=2, identity W_q/W_k/W_v, W_o\n"
            "swapping the head halves, capacity 4) through a paged cache with\n"
            "block_tokens=2, so its three positions span two pages, and prints the\n"
            "seed's six report lines followed by evidence about pages: the physical pages\n"
            "lane 0 used, free pages around the reset, a PoolExhausted case and an\n"
            "in-place parameter update. Every value is computed by the run.\n\n"
            "options:\n"
            "  --json   print the same evidence as one JSON object\n"
            "  --help   show this help\n\n"
            "memory: one pool of a few pages of a few bytes each; the whole program peaks\n"
            "at about 6 MiB resident (/usr/bin/time -v, release build), its code and\n"
            "allocator included.\n\n"
            "exit status: 0 when all evidence holds, 1 when any fails, 2 on errors.\n");
}

int kvp_cli_demo(int argc, char **argv)
{
    int json = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            demo_usage(stdout);
            return KVP_CLI_OK;
        } else {
            fprintf(stderr, "kvpager demo: %s '%s' (see kvpager demo --help)\n",
                    argv[i][0] == '-' ? "unknown option" : "unexpected argument", argv[i]);
            return KVP_CLI_USAGE;
        }
    }
    static demo d;
    static demo_evidence ev;
    memset(&d, 0, sizeof d);
    memset(&ev, 0, sizeof ev);
    const double x[STEPS][MODEL_WIDTH] = {
        {1.0, 0.0, 1.0, 0.0},
        {cos(1.0), -sin(1.0), 0.0, 1.0},
        {cos(2.0), -sin(2.0), 1.0, 1.0},
    };
    memcpy(d.inputs, x, sizeof x);
    int failed = run_demo(&d, &ev);
    free_objects(&d.objects, &ev);
    if (failed != 0) {
        kvp_cli_report("demo", d.failed_at ? d.failed_at : "setting up", &d.err);
        return KVP_CLI_USAGE;
    }
    int ok = evidence_holds(&ev);
    if (json) {
        print_json(&ev, ok);
    } else {
        print_text(&ev);
    }
    return ok ? KVP_CLI_OK : KVP_CLI_FAILED;
}
