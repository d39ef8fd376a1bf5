/*
 * scheduler_lease.c: leases, what a running request holds (the scheduler's
 * rooms: scheduler_internal.h).
 *
 * Owns: the two lease kinds. A computed lease holds a one-lane sequence of
 * the model; its appends and decodes are decoder jobs. An allocator-only
 * lease (compute off) holds one external cache per layer, bound to the
 * configured identity, and appends rows at once without writing them
 * (kvpi_cache_commit_unwritten): pages move per block, no attention math
 * and no page is touched. Both hold the token buffers of one row in and one out.
 * The rest of the scheduler asks a lease through the lease_* calls of
 * scheduler_internal.h and never tests which kind it has.
 * Fused allocator-only pages: a pool of kv_heads x L heads and a scheduler
 * of one layer make this lease ONE external cache whose pages each hold a
 * block of all L layers (vLLM's one block id for all layers): the same
 * bytes a block, the pager's work divided by L. Its creator chooses it
 * only when that is exact (kvpager simulate: allocator-only, layers all
 * alike, the budget a whole number of fused pages; src/cli/sim_fused.c).
 * Layers of different kinds (a window on some) keep the
 * per-layer lease: one cache per layer, never merged.
 *
 * Invariants:
 *   - a lease holds exactly what its kind names (the other pointer NULL);
 *     every layer's cache holds the same tokens;
 *   - between steps a lease reserves no rows: an allocator-only append
 *     commits or discards what it reserved;
 *   - a reset returns every page and promise, in the order a sequence's
 *     reset returns them, so both kinds see the same LRU order.
 * Callers: the scheduler's rooms, through scheduler_internal.h. Calls no
 * other room.
 */
#include <string.h>

#include "kvpager/cache.h"
#include "pager/alloc.h"
#include "pager/cache_internal.h"
#include "pager/error.h"
#include "serve/scheduler_internal.h"
#include "serve/sequence_internal.h"

/* ---- both kinds --------------------------------------------------------- */

/* The token buffers of a new lease of `kind`; on failure nothing is allocated. */
static kvp_status buffers_make(const kvp_scheduler *s, const lease_kind *kind, lease *l,
                               kvp_error *err)
{
    memset(l, 0, sizeof *l);
    l->kind = kind;
    l->input = kvpi_calloc(KVPI_SITE_SCRATCH, 2 * s->width, sizeof(double));
    if (l->input == NULL) {
        return kvpi_fail_alloc(err, "scheduler token buffers", 2 * s->width * sizeof(double));
    }
    l->output = l->input + s->width;
    return KVP_OK;
}

static void buffers_free(lease *l)
{
    kvpi_free(l->input);
    memset(l, 0, sizeof *l);
}

/* ---- computed: a sequence of the model ---------------------------------- */

static void seq_free(lease *l)
{
    if (l->sequence != NULL) {
        kvp_sequence_destroy(l->sequence, NULL);
    }
    buffers_free(l);
}

static kvp_status seq_make(kvp_scheduler *s, lease *out, kvp_error *err)
{
    lease l;
    kvp_status status = buffers_make(s, &kvpi_lease_computed, &l, err);
    if (status != KVP_OK) {
        return status;
    }
    status = kvp_sequence_create(s->model, s->pool, 1, s->config.capacity, &l.sequence, err);
    if (status != KVP_OK) {
        seq_free(&l);
        return status;
    }
    *out = l;
    return KVP_OK;
}

static kvp_cache *const *seq_caches(const lease *l)
{
    return l->sequence->caches;
}

static size_t seq_pages_for(const kvp_scheduler *s, const lease *l, size_t tokens)
{
    (void)s;
    /*
     * What the lease's prefill takes (every block, held to its end): the
     * scheduler promises it before appending a prompt. Equal to
     * kvp_sequence_pages_for without windows; with them the scheduler
     * promises the level after the prefill (seq_level_for).
     */
    return kvp_sequence_prefill_pages(l->sequence, tokens);
}

static size_t seq_level_for(const kvp_scheduler *s, const lease *l, size_t tokens)
{
    (void)s;
    return kvp_sequence_pages_for(l->sequence, tokens); /* a sliding layer's level */
}

static int seq_stale(const kvp_scheduler *s, const lease *l)
{
    (void)s;
    return kvpi_sequence_stale(l->sequence);
}

static kvp_status seq_promise(const kvp_scheduler *s, lease *l, size_t pages, kvp_error *err)
{
    (void)s;
    return kvp_sequence_promise(l->sequence, pages, err);
}

static void seq_reset(const kvp_scheduler *s, lease *l)
{
    (void)s;
    /* A reset returns pages and promises; it cannot fail on a valid handle. */
    kvp_status status = kvp_sequence_reset(l->sequence, NULL);
    assert(status == KVP_OK);
    (void)status;
}

/* A prefill job over the rows (run_jobs or the decoder's reserved step runs it). */
static kvp_status seq_append(kvp_scheduler *s, slot *r, size_t row, size_t tokens, size_t *jobs,
                             kvp_error *err)
{
    (void)err;
    kvp_decode_job *job = &s->jobs[*jobs];
    memset(job, 0, sizeof *job);
    job->kind = KVP_JOB_PREFILL;
    job->sequence = r->lease.sequence;
    job->input = kvp_tensor3(s->rows + row * s->width, 1, tokens, s->width);
    r->job = (*jobs)++;
    return KVP_OK;
}

static void seq_decode_input(kvp_scheduler *s, slot *r, const kvp_request *q,
                             kvp_decode_job *job)
{
    size_t position = kvp_sequence_len(r->lease.sequence);
    q->input(q->ctx, r->id, r->sample, position, r->lease.input, s->width);
    job->sequence = r->lease.sequence;
    job->input = kvp_tensor3(r->lease.input, 1, 1, s->width);
    job->output = r->lease.output;
    job->output_len = s->width;
}

static kvp_status seq_decode_run(kvp_scheduler *s, size_t count, kvp_error *err)
{
    return kvp_decoder_step(s->decoder, s->jobs, count, NULL, NULL, err);
}

static void seq_decode_output(slot *r, const kvp_request *q, const kvp_decode_job *job,
                              size_t width)
{
    if (job->status == KVP_OK && q->on_token != NULL) {
        q->on_token(q->ctx, r->id, r->sample, kvp_sequence_len(r->lease.sequence) - 1,
                    r->lease.output, width);
    }
}

static kvp_status seq_setup(kvp_scheduler *s, kvp_error *err)
{
    (void)s;
    (void)err;
    return KVP_OK; /* a sequence's rows come from the requests */
}

const lease_kind kvpi_lease_computed = {
    .on_decoder = 1,
    .setup = seq_setup,
    .make = seq_make,
    .free = seq_free,
    .caches = seq_caches,
    .pages_for = seq_pages_for,
    .level_for = seq_level_for,
    .stale = seq_stale,
    .promise = seq_promise,
    .reset = seq_reset,
    .append = seq_append,
    .decode_input = seq_decode_input,
    .decode_run = seq_decode_run,
    .decode_output = seq_decode_output,
};

/* ---- allocator-only: one external cache per layer ------------------------ */

static kvp_status ext_setup(kvp_scheduler *s, kvp_error *err)
{
    (void)s;
    (void)err;
    return KVP_OK; /* rows are committed unwritten: nothing to make */
}

static void ext_free(lease *l)
{
    for (size_t i = 0; l->caches != NULL && l->caches[i] != NULL; i++) {
        kvp_cache_destroy(l->caches[i], NULL);
    }
    kvpi_free(l->caches);
    buffers_free(l);
}

static kvp_status ext_make(kvp_scheduler *s, lease *out, kvp_error *err)
{
    lease l;
    kvp_status status = buffers_make(s, &kvpi_lease_external, &l, err);
    if (status != KVP_OK) {
        return status;
    }
    l.caches = kvpi_calloc(KVPI_SITE_SCRATCH, s->layers + 1, sizeof *l.caches);
    if (l.caches == NULL) {
        status = kvpi_fail_alloc(err, "scheduler layer caches", (s->layers + 1) * sizeof *l.caches);
    }
    kvp_binding binding;
    if (status == KVP_OK) {
        status = kvp_binding_init_external(&binding, s->kv_heads, s->head_width,
                                           s->config.capacity, s->config.identity, 0, err);
    }
    for (size_t i = 0; status == KVP_OK && i < s->layers; i++) {
        status = kvp_cache_create(s->pool, &binding, 1, s->config.capacity, &l.caches[i], err);
    }
    if (status != KVP_OK) {
        ext_free(&l);
        return status;
    }
    *out = l;
    return KVP_OK;
}

static kvp_cache *const *ext_caches(const lease *l)
{
    return l->caches;
}

static size_t ext_pages_for(const kvp_scheduler *s, const lease *l, size_t tokens)
{
    size_t pages = 0;
    for (size_t i = 0; i < s->layers; i++) {
        pages += kvp_cache_pages_for(l->caches[i], tokens);
    }
    return pages;
}

static int ext_stale(const kvp_scheduler *s, const lease *l)
{
    (void)s;
    (void)l;
    return 0; /* external caches bind the configured identity: never stale */
}

static kvp_status ext_promise(const kvp_scheduler *s, lease *l, size_t pages, kvp_error *err)
{
    for (size_t i = 0; i < s->layers; i++) {
        kvp_status status = kvp_cache_promise(l->caches[i], pages / s->layers, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    return KVP_OK;
}

/*
 * Promises to 0, then every layer at once, so pages go back (to the free or
 * evictable list) in the order a sequence's reset gives them back: both
 * runs see the same LRU order. No rows are reserved between steps
 * (append_rows commits or discards).
 */
static void ext_reset(const kvp_scheduler *s, lease *l)
{
    kvp_status status = KVP_OK;
    for (size_t i = 0; i < s->layers; i++) {
        kvp_status layer = kvp_cache_promise(l->caches[i], 0, NULL);
        status = status != KVP_OK ? status : layer;
    }
    kvpi_cache_truncate_many(l->caches, s->layers, 0);
    assert(status == KVP_OK);
    (void)status;
}

/*
 * `tokens` rows in every layer, all or nothing, neither written nor read
 * (nobody reads an allocator-only run's rows): every layer's pages are
 * reserved first (a refusal discards the ones reserved); then each layer
 * commits them at once, which cannot fail. Pages move per block: the cost
 * does not grow with the rows' width.
 */
static kvp_status append_rows(const kvp_scheduler *s, lease *l, size_t tokens, kvp_error *err)
{
    for (size_t i = 0; i < s->layers; i++) {
        kvp_status status = kvp_cache_reserve_rows(l->caches[i], tokens, err);
        if (status != KVP_OK) {
            while (i-- > 0) {
                kvp_cache_discard_rows(l->caches[i], NULL);
            }
            return status;
        }
    }
    for (size_t i = 0; i < s->layers; i++) {
        kvp_status status = kvpi_cache_commit_unwritten(l->caches[i], tokens, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    return KVP_OK;
}

/* Rows now, unwritten; the rows at `row` are not read (an allocator-only run has none to compute). */
static kvp_status ext_append(kvp_scheduler *s, slot *r, size_t row, size_t tokens, size_t *jobs,
                             kvp_error *err)
{
    (void)row;
    (void)jobs;
    return tokens > 0 ? append_rows(s, &r->lease, tokens, err) : KVP_OK;
}

static void ext_decode_input(kvp_scheduler *s, slot *r, const kvp_request *q,
                             kvp_decode_job *job)
{
    (void)q;
    job->status = append_rows(s, &r->lease, 1, &job->error);
}

static kvp_status ext_decode_run(kvp_scheduler *s, size_t count, kvp_error *err)
{
    (void)s;
    (void)count;
    (void)err;
    return KVP_OK; /* decode_input appended the rows */
}

static void ext_decode_output(slot *r, const kvp_request *q, const kvp_decode_job *job,
                              size_t width)
{
    (void)r;
    (void)q;
    (void)job;
    (void)width; /* no output: no on_token */
}

const lease_kind kvpi_lease_external = {
    .on_decoder = 0,
    .setup = ext_setup,
    .make = ext_make,
    .free = ext_free,
    .caches = ext_caches,
    .pages_for = ext_pages_for,
    .level_for = ext_pages_for, /* external caches have no window */
    .stale = ext_stale,
    .promise = ext_promise,
    .reset = ext_reset,
    .append = ext_append,
    .decode_input = ext_decode_input,
    .decode_run = ext_decode_run,
    .decode_output = ext_decode_output,
};
