/*
 * sim.c: the continuous-batching simulation (see sim.h for the schedule).
 *
 * Invariants kept by the loop:
 *   - a request is in exactly one of: not arrived, waiting, running, done;
 *   - every running slot holds one lease (a sequence and its token
 *     buffers); finished and preempted leases are reset and kept for reuse,
 *     so steady state allocates nothing per admission or per step;
 *   - ownership: a lease is owned by exactly one place at a time, a running
 *     slot or the idle list, and moves between them only by steps that
 *     cannot fail (room in the destination is made first). A lease that
 *     was just made or taken goes into its running slot before any call
 *     that can fail. So on any error teardown() frees each lease once;
 *   - before decode, the free pages cover the new pages every running
 *     sequence needs this step (preemption makes it so), so decode never
 *     fails for want of pages;
 *   - with compute, the requests admitted in a step are prefilled together,
 *     as one batch of decoder jobs, after admission and before preemption
 *     and decode. Admission decides exactly as if each had been prefilled
 *     on admission: kvp_pool_admit counts free pages minus promises not yet
 *     taken, and a prefill draws its pages from its own promise (which
 *     covers the prompt), so taking them earlier or later changes neither
 *     side of that difference.
 */
#include "sim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alloc.h"

void kvp_sim_config_init(kvp_sim_config *config)
{
    config->layers = 2;
    config->model_width = 64;
    config->heads = 4;
    config->kv_heads = 0; /* = heads */
    config->block_tokens = 16;
    config->budget_bytes = (size_t)32 << 20;
    config->kv_dtype = KVP_F64;
    config->capacity = 2048;
    config->threads = 0;
    config->seed = 1;
    config->watermark = 0.01;
    config->reserve_tokens = 16;
    config->compute = 1;
    config->audit_every = 64;
}

/*
 * A sequence with its token buffers, reused from request to request. With
 * compute off there is no attention: the lease holds one external cache per
 * layer instead (kvpager/cache.h), bound to the run's seed, and the rows it
 * appends are zeros, through the public reserve / commit API.
 */
typedef struct lease {
    kvp_sequence *sequence; /* compute on */
    double *input;        /* [D] */
    double *output;       /* [D], in the same allocation as input */
    kvp_cache **caches;   /* compute off: [layers] external caches */
} lease;

typedef struct slot {
    lease lease;
    size_t request;
    size_t generated;     /* tokens generated so far (kept across preemption) */
    uint64_t admitted;    /* admission order; the largest is preempted first */
} slot;

typedef struct sim {
    const kvp_sim_config *config;
    const kvp_workload *workload;
    kvp_sim_result *result;
    kvp_error *err;
    const char **context;
    kvp_pool *pool;
    kvp_model *model;
    kvp_decoder *decoder;
    size_t *generated;          /* [requests]: progress kept across preemptions */
    size_t *waiting;            /* ring buffer of request indices */
    size_t waiting_head;
    size_t waiting_count;
    size_t next_arrival;
    slot *running;
    size_t running_count;
    size_t running_room;
    lease *idle;                /* reset leases kept for reuse */
    size_t idle_count;
    size_t idle_room;
    kvp_decode_job *jobs;
    size_t jobs_room;
    size_t first_admitted;      /* running slots from here on await their prefill */
    double *prompts;            /* [prompt_room][D]: the step's prompts, back to back */
    size_t prompt_room;         /* rows; grown, never shrunk, so steady state allocates nothing */
    uint64_t admissions;
    size_t lanes;               /* layers * batch (batch is 1) */
    size_t watermark_pages;
    double held_slots;
    double used_slots;
    double utilization_sum;
    double running_sum;
    size_t finished_this_step;  /* decoded in this step, then retired */
    size_t samples_room;
    double *zeros;              /* compute off: one block of zero rows, [1, H_kv, block, d_h] */
} sim;

static int fail(sim *s, const char *context)
{
    *s->context = context;
    return -1;
}

/* A failed allocation of the program's own: AllocationFailed, context "out of memory". */
static int out_of_memory(sim *s, const char *what, size_t bytes)
{
    *s->err = (kvp_error){.status = KVP_ALLOCATION_FAILED, .what = what, .bytes = bytes};
    return fail(s, "out of memory");
}

/* The pseudo-embedding of token `position` of `request`: uniform in [-1, 1). */
static void embed(uint64_t seed, size_t request, size_t position, double *row, size_t width)
{
    uint64_t state = seed ^ (0x9E3779B97F4A7C15ull * (request + 1)) ^
                     (0xC2B2AE3D27D4EB4Full * (position + 1));
    for (size_t i = 0; i < width; i++) {
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        row[i] = (double)(z >> 11) * 0x1.0p-53 * 2.0 - 1.0;
    }
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

size_t kvp_sim_kv_heads(const kvp_sim_config *config)
{
    return config->kv_heads != 0 ? config->kv_heads : config->heads;
}

static int setup(sim *s)
{
    const kvp_sim_config *c = s->config;
    size_t kv_heads = kvp_sim_kv_heads(c);
    /* simulate.c validated the shape; never divide by zero if a caller did not. */
    if (c->heads == 0 || c->model_width % c->heads != 0) {
        kvp_error e = {.status = KVP_HEADS_DO_NOT_DIVIDE_WIDTH, .model_width = c->model_width,
                       .heads = c->heads};
        *s->err = e;
        return fail(s, "checking the model shape");
    }
    if (kv_heads == 0 || c->heads % kv_heads != 0) {
        kvp_error e = {.status = KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS, .heads = c->heads,
                       .kv_heads = kv_heads};
        *s->err = e;
        return fail(s, "checking the model shape");
    }
    /* Pages hold the KV heads only, in the --kv-dtype. */
    kvp_pool_config pool_config;
    kvp_pool_config_init(&pool_config);
    pool_config.block_tokens = c->block_tokens;
    pool_config.heads = kv_heads;
    pool_config.head_width = c->model_width / c->heads;
    pool_config.budget_bytes = c->budget_bytes;
    pool_config.dtype = c->kv_dtype;
    if (kvp_pool_create(&pool_config, &s->pool, s->err) != KVP_OK) {
        return fail(s, "creating the page pool");
    }
    if (kvp_model_create_random_grouped(c->layers, c->model_width, c->heads, kv_heads,
                                        c->capacity, 10000.0, c->seed, &s->model,
                                        s->err) != KVP_OK) {
        return fail(s, "creating the model");
    }
    if (c->compute && kvp_decoder_create(c->threads, &s->decoder, s->err) != KVP_OK) {
        return fail(s, "starting the decoder threads");
    }
    if (!c->compute) {
        size_t zeros = c->block_tokens * kv_heads * (c->model_width / c->heads);
        s->zeros = kvp_cli_calloc(zeros, sizeof *s->zeros);
        if (s->zeros == NULL) {
            return out_of_memory(s, "zero rows", zeros * sizeof *s->zeros);
        }
    }
    size_t n = s->workload->count;
    s->generated = kvp_cli_calloc(n, sizeof *s->generated);
    s->waiting = s->generated ? kvp_cli_calloc(n, sizeof *s->waiting) : NULL;
    if (s->generated == NULL || s->waiting == NULL) {
        return out_of_memory(s, "the request queue", 2 * n * sizeof(size_t));
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    if (kvp_pool_stats_get(s->pool, &stats, s->err) != KVP_OK) {
        return fail(s, "reading pool stats");
    }
    s->lanes = c->layers;
    s->watermark_pages = (size_t)ceil(c->watermark * (double)stats.total_pages);
    s->result->total_pages = stats.total_pages;
    s->result->page_bytes = stats.page_bytes;
    s->result->kv_dtype = stats.dtype;
    s->result->element_bytes = stats.element_bytes;
    /*
     * Sequences of full capacity the pages hold (one lane per layer each),
     * against f64 pages of the same geometry and budget: the dtype's gain in
     * sequences, counted in whole pages.
     */
    size_t per_sequence = c->layers * (c->capacity / c->block_tokens +
                                       (c->capacity % c->block_tokens != 0));
    size_t f64_page_bytes = stats.page_bytes / stats.element_bytes * sizeof(double);
    s->result->full_sequences = stats.total_pages / per_sequence;
    s->result->f64_full_sequences = c->budget_bytes / f64_page_bytes / per_sequence;
    s->result->threads = s->decoder != NULL ? kvp_decoder_threads(s->decoder) : 1;
    return 0;
}

/* Grows a heap array of `size`-byte items to hold `need` items. */
static int grow(void **items, size_t *room, size_t need, size_t size)
{
    if (need <= *room) {
        return 0;
    }
    size_t bigger = *room ? *room * 2 : 16;
    while (bigger < need) {
        bigger *= 2;
    }
    void *grown = kvp_cli_realloc(*items, bigger, size);
    if (grown == NULL) {
        return -1;
    }
    *items = grown;
    *room = bigger;
    return 0;
}

static void lease_free(lease *l)
{
    if (l->sequence != NULL) {
        kvp_sequence_destroy(l->sequence, NULL);
    }
    for (size_t i = 0; l->caches != NULL && l->caches[i] != NULL; i++) {
        kvp_cache_destroy(l->caches[i], NULL);
    }
    kvp_cli_free(l->caches);
    kvp_cli_free(l->input);
}

/*
 * The layers' external caches of an allocator-only lease, NULL-terminated;
 * each binds the run's seed as its identity. On failure nothing is left.
 */
static int make_caches(sim *s, lease *l)
{
    const kvp_sim_config *c = s->config;
    l->caches = kvp_cli_calloc(c->layers + 1, sizeof *l->caches);
    if (l->caches == NULL) {
        return out_of_memory(s, "layer caches", (c->layers + 1) * sizeof *l->caches);
    }
    kvp_binding binding;
    if (kvp_binding_init_external(&binding, kvp_sim_kv_heads(c), c->model_width / c->heads,
                                  c->capacity, c->seed, 0, s->err) != KVP_OK) {
        return fail(s, "creating a sequence");
    }
    for (size_t i = 0; i < c->layers; i++) {
        if (kvp_cache_create(s->pool, &binding, 1, c->capacity, &l->caches[i], s->err) !=
            KVP_OK) {
            return fail(s, "creating a sequence");
        }
    }
    return 0;
}

static size_t lease_len(const lease *l)
{
    return l->sequence != NULL ? kvp_sequence_len(l->sequence) : kvp_cache_len(l->caches[0]);
}

/* Pages the lease needs to grow to `tokens`: every layer alike. */
static size_t lease_pages_for(const sim *s, const lease *l, size_t tokens)
{
    if (l->sequence != NULL) {
        return kvp_sequence_pages_for(l->sequence, tokens);
    }
    size_t per_layer = kvp_cache_pages_for(l->caches[0], tokens);
    return per_layer > SIZE_MAX / s->config->layers ? SIZE_MAX : per_layer * s->config->layers;
}

/* `pages` for the whole lease (lanes = layers, so it divides evenly among them). */
static kvp_status lease_promise(const sim *s, lease *l, size_t pages)
{
    if (l->sequence != NULL) {
        return kvp_sequence_promise(l->sequence, pages, s->err);
    }
    for (size_t i = 0; i < s->config->layers; i++) {
        kvp_status status = kvp_cache_promise(l->caches[i], pages / s->config->layers, s->err);
        if (status != KVP_OK) {
            return status;
        }
    }
    return KVP_OK;
}

static kvp_status lease_reset(const sim *s, lease *l)
{
    if (l->sequence != NULL) {
        return kvp_sequence_reset(l->sequence, s->err);
    }
    for (size_t i = 0; i < s->config->layers; i++) {
        kvp_status status = kvp_cache_reset(l->caches[i], s->err);
        if (status != KVP_OK) {
            return status;
        }
    }
    return KVP_OK;
}

/*
 * Allocator only: `tokens` zero rows in every layer, all or nothing. Every
 * layer's pages are reserved first (a refusal discards the ones reserved);
 * then the rows are committed a block at a time, which cannot fail.
 */
static kvp_status lease_append_zeros(const sim *s, lease *l, size_t tokens)
{
    size_t layers = s->config->layers;
    for (size_t i = 0; i < layers; i++) {
        kvp_status status = kvp_cache_reserve_rows(l->caches[i], tokens, s->err);
        if (status != KVP_OK) {
            while (i-- > 0) {
                kvp_cache_discard_rows(l->caches[i], NULL);
            }
            return status;
        }
    }
    size_t block = s->config->block_tokens;
    for (size_t i = 0; i < layers; i++) {
        for (size_t done = 0; done < tokens; done += block) {
            size_t rows = tokens - done < block ? tokens - done : block;
            kvp_status status = kvp_cache_commit_rows(l->caches[i], s->zeros, s->zeros, rows,
                                                      s->err);
            if (status != KVP_OK) {
                return status;
            }
        }
    }
    return KVP_OK;
}

/* An idle lease, or a new one; on failure nothing is taken or left allocated. */
static int take_lease(sim *s, lease *out)
{
    if (s->idle_count > 0) {
        *out = s->idle[--s->idle_count];
        return 0;
    }
    size_t width = s->config->model_width;
    lease l = {NULL, kvp_cli_calloc(2 * width, sizeof(double)), NULL, NULL};
    if (l.input == NULL) {
        return out_of_memory(s, "token buffers", 2 * width * sizeof(double));
    }
    l.output = l.input + width;
    if (!s->config->compute) {
        if (make_caches(s, &l) != 0) {
            lease_free(&l);
            return -1;
        }
    } else if (kvp_sequence_create(s->model, s->pool, 1, s->config->capacity, &l.sequence,
                                   s->err) != KVP_OK) {
        lease_free(&l);
        return fail(s, "creating a sequence");
    }
    *out = l;
    return 0;
}

/*
 * Moves running slot i's lease to the idle list, reset for reuse. Room in
 * the idle list is made first: when that fails nothing has moved and the
 * slot still owns its lease. Once moved, the idle list owns the lease even if
 * the reset then fails (teardown destroys it there).
 */
static int retire_slot(sim *s, size_t i)
{
    if (grow((void **)&s->idle, &s->idle_room, s->idle_count + 1, sizeof *s->idle) != 0) {
        return out_of_memory(s, "the idle sequence list", (s->idle_count + 1) * sizeof *s->idle);
    }
    lease l = s->running[i].lease;
    s->running[i] = s->running[--s->running_count];
    s->idle[s->idle_count++] = l;
    if (lease_reset(s, &l) != KVP_OK) {
        return fail(s, "resetting a sequence");
    }
    return 0;
}

static void queue_push_back(sim *s, size_t request)
{
    size_t n = s->workload->count;
    s->waiting[(s->waiting_head + s->waiting_count) % n] = request;
    s->waiting_count++;
}

static void queue_push_front(sim *s, size_t request)
{
    size_t n = s->workload->count;
    s->waiting_head = (s->waiting_head + n - 1) % n;
    s->waiting[s->waiting_head] = request;
    s->waiting_count++;
}

static size_t queue_pop_front(sim *s)
{
    size_t request = s->waiting[s->waiting_head];
    s->waiting_head = (s->waiting_head + 1) % s->workload->count;
    s->waiting_count--;
    return request;
}

/* Tokens to prefill for the request in running slot i: its prompt and what it generated. */
static size_t prefill_tokens(const sim *s, size_t i)
{
    const slot *r = &s->running[i];
    return s->workload->requests[r->request].prompt_tokens + r->generated;
}

/*
 * Prefills the requests admitted in this step (running slots from
 * first_admitted on) as one batch of decoder jobs, each with its own rows of
 * the shared prompt buffer. Without compute, admit_one appended them already.
 */
static int prefill_admitted(sim *s)
{
    const kvp_sim_config *c = s->config;
    size_t first = s->first_admitted;
    s->first_admitted = s->running_count;
    if (!c->compute || first >= s->running_count) {
        return 0;
    }
    size_t count = s->running_count - first;
    size_t rows = 0;
    for (size_t i = first; i < s->running_count; i++) {
        rows += prefill_tokens(s, i);
    }
    if (grow((void **)&s->jobs, &s->jobs_room, count, sizeof *s->jobs) != 0) {
        return out_of_memory(s, "prefill jobs", count * sizeof *s->jobs);
    }
    if (grow((void **)&s->prompts, &s->prompt_room, rows, c->model_width * sizeof *s->prompts) !=
        0) {
        return out_of_memory(s, "the prompt buffers", rows * c->model_width * sizeof *s->prompts);
    }
    double *row = s->prompts;
    for (size_t i = first; i < s->running_count; i++) {
        slot *r = &s->running[i];
        size_t tokens = prefill_tokens(s, i);
        for (size_t t = 0; t < tokens; t++) {
            embed(c->seed, r->request, t, row + t * c->model_width, c->model_width);
        }
        kvp_decode_job *job = &s->jobs[i - first];
        memset(job, 0, sizeof *job);
        job->kind = KVP_JOB_PREFILL;
        job->sequence = r->lease.sequence;
        job->input = kvp_tensor3(row, 1, tokens, c->model_width);
        row += tokens * c->model_width;
    }
    if (kvp_decoder_step(s->decoder, s->jobs, count, NULL, NULL, s->err) != KVP_OK) {
        return fail(s, "prefilling the admitted requests");
    }
    for (size_t j = 0; j < count; j++) {
        if (s->jobs[j].status != KVP_OK) {
            *s->err = s->jobs[j].error;
            return fail(s, "prefilling an admitted request");
        }
        s->result->prefill_tokens += prefill_tokens(s, first + j);
    }
    return 0;
}

/*
 * Tokens a request is admitted for: its prompt, what it generated before a
 * preemption, and the decoding reserve, but never more than the request's
 * whole length. So a request whose whole length fits an empty pool is always
 * admitted once the pool empties: the schedule cannot stall.
 */
static size_t admission_tokens(const sim *s, size_t request)
{
    const kvp_request *r = &s->workload->requests[request];
    size_t tokens = r->prompt_tokens + s->generated[request] + s->config->reserve_tokens;
    size_t whole = r->prompt_tokens + r->output_tokens;
    return tokens < whole ? tokens : whole;
}

static int admit_one(sim *s, size_t request)
{
    size_t tokens = s->workload->requests[request].prompt_tokens + s->generated[request];
    if (grow((void **)&s->running, &s->running_room, s->running_count + 1, sizeof *s->running) !=
        0) {
        return out_of_memory(s, "the running set", (s->running_count + 1) * sizeof *s->running);
    }
    lease l;
    if (take_lease(s, &l) != 0) {
        return -1;
    }
    /* The slot owns the lease before anything else can fail (teardown frees it). */
    slot *r = &s->running[s->running_count++];
    r->lease = l;
    r->request = request;
    r->generated = s->generated[request];
    r->admitted = s->admissions++;
    size_t promise = kvp_pool_pages_for(s->pool, s->lanes, admission_tokens(s, request));
    if (lease_promise(s, &l, promise) != KVP_OK) {
        return fail(s, "admitting a request");
    }
    if (s->config->compute) {
        return 0; /* prefill_admitted runs it with the others admitted in this step */
    }
    if (lease_append_zeros(s, &l, tokens) != KVP_OK) {
        return fail(s, "prefilling an admitted request");
    }
    s->result->prefill_tokens += tokens;
    return 0;
}

/* FCFS admission while the head of the queue fits now. */
static int admit(sim *s)
{
    while (s->waiting_count > 0) {
        size_t request = s->waiting[s->waiting_head];
        const kvp_request *r = &s->workload->requests[request];
        kvp_admission whole;
        kvp_admission now;
        size_t need = kvp_pool_pages_for(s->pool, s->lanes, admission_tokens(s, request));
        size_t full = kvp_pool_pages_for(s->pool, s->lanes, r->prompt_tokens + r->output_tokens);
        if (kvp_pool_admit(s->pool, full, s->watermark_pages, &whole, s->err) != KVP_OK ||
            kvp_pool_admit(s->pool, need, s->watermark_pages, &now, s->err) != KVP_OK) {
            return fail(s, "asking for admission");
        }
        if (whole == KVP_ADMIT_NEVER) {
            queue_pop_front(s);
            s->result->requests_rejected++;
            continue;
        }
        if (now != KVP_ADMIT_NOW) {
            break;
        }
        queue_pop_front(s);
        if (admit_one(s, request) != 0) {
            return -1;
        }
    }
    return 0;
}

static size_t free_pages(sim *s)
{
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    return kvp_pool_stats_get(s->pool, &stats, NULL) == KVP_OK ? stats.free_pages : 0;
}

/* Preempts the most recently admitted sequences until this step's pages fit. */
static int make_room(sim *s)
{
    for (;;) {
        size_t needed = 0;
        size_t newest = 0;
        for (size_t i = 0; i < s->running_count; i++) {
            slot *r = &s->running[i];
            needed += lease_pages_for(s, &r->lease, lease_len(&r->lease) + 1);
            if (r->admitted > s->running[newest].admitted) {
                newest = i;
            }
        }
        if (s->running_count == 0 || needed <= free_pages(s)) {
            return 0;
        }
        size_t request = s->running[newest].request;
        size_t generated = s->running[newest].generated;
        if (retire_slot(s, newest) != 0) {
            return -1;
        }
        s->generated[request] = generated;
        queue_push_front(s, request);
        s->result->preemptions++;
    }
}

static int decode(sim *s)
{
    const kvp_sim_config *c = s->config;
    if (s->running_count == 0) {
        return 0;
    }
    if (!c->compute) {
        for (size_t i = 0; i < s->running_count; i++) {
            if (lease_append_zeros(s, &s->running[i].lease, 1) != KVP_OK) {
                return fail(s, "decoding (allocator only)");
            }
        }
        return 0;
    }
    if (grow((void **)&s->jobs, &s->jobs_room, s->running_count, sizeof *s->jobs) != 0) {
        return out_of_memory(s, "decode jobs", s->running_count * sizeof *s->jobs);
    }
    for (size_t i = 0; i < s->running_count; i++) {
        slot *r = &s->running[i];
        size_t position = kvp_sequence_len(r->lease.sequence);
        embed(c->seed, r->request, position, r->lease.input, c->model_width);
        kvp_decode_job *job = &s->jobs[i];
        memset(job, 0, sizeof *job);
        job->sequence = r->lease.sequence;
        job->input = kvp_tensor3(r->lease.input, 1, 1, c->model_width);
        job->output = r->lease.output;
        job->output_len = c->model_width;
    }
    if (kvp_decoder_step(s->decoder, s->jobs, s->running_count, NULL, NULL, s->err) != KVP_OK) {
        return fail(s, "decoding");
    }
    for (size_t i = 0; i < s->running_count; i++) {
        if (s->jobs[i].status != KVP_OK) {
            *s->err = s->jobs[i].error;
            return fail(s, "decoding a sequence");
        }
        s->result->output_checksum += s->running[i].lease.output[0];
    }
    return 0;
}

/* Counts the decoded token, retires finished requests, records the step. */
static int finish_step(sim *s)
{
    const kvp_sim_config *c = s->config;
    double used = 0.0;
    for (size_t i = 0; i < s->running_count;) {
        slot *r = &s->running[i];
        r->generated++;
        s->result->tokens_generated++;
        if (r->generated < s->workload->requests[r->request].output_tokens) {
            used += (double)(s->lanes * lease_len(&r->lease));
            i++;
            continue;
        }
        size_t request = r->request;
        size_t generated = r->generated;
        if (retire_slot(s, i) != 0) {
            return -1;
        }
        s->generated[request] = generated;
        s->result->requests_completed++;
        s->finished_this_step++;
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    if (kvp_pool_stats_get(s->pool, &stats, s->err) != KVP_OK) {
        return fail(s, "reading pool stats");
    }
    kvp_sim_result *res = s->result;
    if (grow((void **)&res->samples, &s->samples_room, res->steps + 1, sizeof *res->samples) != 0) {
        return out_of_memory(s, "step samples", (res->steps + 1) * sizeof *res->samples);
    }
    /* Pages held at the end of the step are the running sequences' pages. */
    double held = (double)stats.held_pages;
    res->samples[res->steps] = (kvp_sim_sample){(uint32_t)stats.held_pages,
                                                (uint32_t)s->running_count};
    res->steps++;
    s->held_slots += held * (double)c->block_tokens;
    s->used_slots += used;
    double utilization = held / (double)stats.total_pages;
    s->utilization_sum += utilization;
    res->peak_utilization = utilization > res->peak_utilization ? utilization
                                                                : res->peak_utilization;
    s->running_sum += (double)s->running_count + (double)s->finished_this_step;
    s->finished_this_step = 0;
    return 0;
}

static int audit(sim *s)
{
    s->result->audits++;
    kvp_error err;
    if (kvp_pool_check(s->pool, NULL, NULL, &err) != KVP_OK) {
        s->result->audit_failures++;
    }
    return 0;
}

static int step_once(sim *s, size_t step)
{
    const kvp_workload *w = s->workload;
    while (s->next_arrival < w->count && w->requests[s->next_arrival].arrival_step <= step) {
        queue_push_back(s, s->next_arrival++);
    }
    s->first_admitted = s->running_count;
    if (admit(s) != 0 || prefill_admitted(s) != 0 || make_room(s) != 0) {
        return -1;
    }
    if (s->running_count == 0 && s->waiting_count > 0) {
        /* Cannot happen (see admission_tokens); refuse to spin if it ever does. */
        *s->err = (kvp_error){.status = KVP_POOL_EXHAUSTED,
                              .needed = kvp_pool_pages_for(s->pool, s->lanes,
                                                           admission_tokens(s, s->waiting[s->waiting_head])),
                              .available = free_pages(s)};
        return fail(s, "admitting the first waiting request into an idle pool");
    }
    /* Concurrency counts the sequences that really decode in this step. */
    if (s->running_count > s->result->peak_concurrent) {
        s->result->peak_concurrent = s->running_count;
    }
    if (decode(s) != 0 || finish_step(s) != 0) {
        return -1;
    }
    if (s->config->audit_every != 0 && s->result->steps % s->config->audit_every == 0) {
        audit(s);
    }
    return 0;
}

static int run_loop(sim *s, kvp_sim_progress_fn progress, void *ctx)
{
    const kvp_workload *w = s->workload;
    size_t step = 0;
    double start = now_seconds();
    while (s->result->requests_completed + s->result->requests_rejected < w->count) {
        if (s->running_count == 0 && s->waiting_count == 0 && s->next_arrival < w->count &&
            w->requests[s->next_arrival].arrival_step > step) {
            step = w->requests[s->next_arrival].arrival_step; /* skip idle steps */
        }
        if (step_once(s, step) != 0) {
            return -1;
        }
        step++;
        if (progress != NULL) {
            progress(ctx, s->result->requests_completed + s->result->requests_rejected, w->count,
                     s->result->steps);
        }
    }
    s->result->seconds = now_seconds() - start;
    return 0;
}

/* Destroys every sequence, then audits what is left: nothing may be held. */
static void teardown(sim *s)
{
    for (size_t i = 0; i < s->running_count; i++) {
        lease_free(&s->running[i].lease);
    }
    for (size_t i = 0; i < s->idle_count; i++) {
        lease_free(&s->idle[i]);
    }
    if (s->pool != NULL) {
        kvp_pool_stats stats;
        kvp_pool_stats_init(&stats);
        audit(s);
        if (kvp_pool_stats_get(s->pool, &stats, NULL) == KVP_OK) {
            s->result->pages_leaked = stats.held_pages;
            s->result->acquires = stats.acquires;
            s->result->releases = stats.releases;
        }
        if (kvp_pool_destroy(s->pool, NULL) != KVP_OK) {
            s->result->audit_failures++;
        }
    }
    if (s->decoder != NULL) {
        kvp_decoder_destroy(s->decoder, NULL);
    }
    if (s->model != NULL) {
        kvp_model_destroy(s->model, NULL);
    }
    kvp_cli_free(s->running);
    kvp_cli_free(s->idle);
    kvp_cli_free(s->jobs);
    kvp_cli_free(s->generated);
    kvp_cli_free(s->waiting);
    kvp_cli_free(s->prompts);
    kvp_cli_free(s->zeros);
}

static void summarize(sim *s)
{
    const kvp_sim_config *c = s->config;
    kvp_sim_result *res = s->result;
    if (res->steps > 0) {
        res->mean_concurrent = s->running_sum / (double)res->steps;
        res->mean_utilization = s->utilization_sum / (double)res->steps;
    }
    if (s->held_slots > 0.0) {
        res->internal_fragmentation = (s->held_slots - s->used_slots) / s->held_slots;
    }
    if (res->seconds > 0.0) {
        res->tokens_per_second = (double)res->tokens_generated / res->seconds;
    }
    /*
     * The seed's layout: every sequence reserves [B, H_kv, C, d_h] keys and
     * values per layer, here in the pool's dtype, so the ratio measures paging
     * alone.
     */
    double kv_width = (double)kvp_sim_kv_heads(c) * (double)(c->model_width / c->heads);
    double per_sequence = (double)c->layers * (double)c->capacity * 2.0 * kv_width *
                          (double)kvp_dtype_bytes(c->kv_dtype);
    res->contiguous_baseline = (size_t)floor((double)c->budget_bytes / per_sequence);
    res->concurrency_ratio = res->contiguous_baseline > 0
                                 ? (double)res->peak_concurrent / (double)res->contiguous_baseline
                                 : INFINITY;
}

int kvp_sim_run(const kvp_sim_config *config, const kvp_workload *workload,
                kvp_sim_progress_fn progress, void *progress_ctx, kvp_sim_result *out,
                kvp_error *err, const char **context)
{
    sim s;
    memset(&s, 0, sizeof s);
    memset(out, 0, sizeof *out);
    s.config = config;
    s.workload = workload;
    s.result = out;
    s.err = err;
    s.context = context;
    out->requests = workload->count;
    int status = setup(&s);
    if (status == 0) {
        status = run_loop(&s, progress, progress_ctx);
    }
    teardown(&s);
    summarize(&s);
    return status;
}

void kvp_sim_result_free(kvp_sim_result *result)
{
    kvp_cli_free(result->samples);
    result->samples = NULL;
}
