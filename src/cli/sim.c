/*
 * sim.c: `kvpager simulate`'s run: a workload generator and a report around
 * the library's scheduler (kvpager/scheduler.h has the schedule).
 *
 * Owns: the pool, model and decoder of a run, the scheduler over them, the
 * arrival of the workload's requests, and the per-step record the report
 * and the plot read. A request of turn 0 is submitted at its arrival step; a
 * conversation's later turn (workload.h) is closed-loop: submitted at the
 * step after the turn before it finished (completed or rejected: the user
 * sends the next message anyway) plus its think steps, so its prompt, which
 * holds that turn's reply, can adopt the reply's published blocks. The
 * requests a step submits go in list order; scheduler ids follow submit
 * order (index_of maps them back to the list), so without conversations
 * request i has id i. Finishing steps are the scheduler's, deterministic,
 * so the schedule does not depend on threads or timing.
 * Token inputs are pseudo-embeddings of (stream, sample, position) drawn
 * from the seed: a request's own stream is its index, positions below its
 * shared_tokens use one stream common to every request (a system prompt),
 * and the turns of one conversation share the conversation's stream. The
 * prompt is every sample's; a generated position of sample 0 is the
 * stream's own row (so a conversation's next turn, whose prompt holds this
 * turn's reply, sees the rows sample 0 decoded), and sample s > 0 draws its
 * generated positions from a stream of its own. So a recomputed request sees
 * exactly the inputs it saw before, and two requests that share a prefix see
 * the same rows for it. An allocator-only run (compute off) builds no model,
 * its pool is KVP_SLAB_RESERVED (no memory behind the pages), and its
 * prefix keys come from block digests of what the rows are drawn from
 * (block_digest), so it draws no row at all.
 * Weight updates (update_every): between two steps, every parameter of
 * every layer gets a small seeded perturbation through kvp_param_update_with,
 * which bumps its revision; the scheduler then preempts the running requests
 * for recompute, and the prefix index can match no block of the old weights.
 * Verification (verify_every): the decoded outputs of requests 0, N, 2N, ...
 * of the workload list are kept with the weight version (epoch) each token
 * was decoded in, and when such a request is collected each sample is
 * prefilled from scratch, once per epoch its tokens came from, under that
 * epoch's weights, on a private pool (no sharing), and every token compared
 * bit for bit with the prefill of its own epoch (verify.c). Nothing is
 * skipped: a run that spans weight updates is verified segment by segment.
 * Callers: simulate.c and bench.c, through sim.h. Public headers only.
 */
#include "sim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "verify.h"

void kvp_sim_config_init(kvp_sim_config *config)
{
    memset(config, 0, sizeof *config); /* a field added later starts at 0, never garbage */
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
    config->fuse_layers = 1;
    config->audit_every = KVP_SIM_AUDIT_SCALED;
    config->samples = 1;
    config->sharing = 1;
    config->schedule = KVP_SCHEDULE_FCFS;
    config->update_every = 0;
    config->verify_every = 0;
    config->session_ttl = 128;
}

/* The stream every request's shared prefix is drawn from (no request index reaches it). */
#define SHARED_STREAM UINT64_MAX
/* Mixed into the seed for a trace's prompt blocks, whose ids are their streams. */
#define BLOCK_SALT 0xA5C3E1F00F1E3C5Aull

typedef struct sim {
    const kvp_sim_config *config;
    const kvp_workload *workload;
    kvp_sim_result *result;
    kvp_error *err;
    const char **context;
    kvp_pool *pool;
    kvp_model *model;
    kvp_decoder *decoder;
    kvp_scheduler *scheduler;
    kvp_request_result *finished; /* [requests]: one collect's room */
    size_t next_arrival;   /* list index of the next turn-0 request to submit */
    size_t submitted;      /* requests submitted: the next scheduler id */
    size_t *index_of;      /* [requests]: scheduler id -> list index */
    size_t *finish_step;   /* [requests]: the step each finished in; SIZE_MAX until then */
    size_t *pending;       /* [requests]: later turns whose previous turn finished, unsent */
    size_t *due;           /* [requests]: pending[k]'s submit step is due[pending[k]] */
    size_t pending_count;
    size_t *batch;         /* [requests]: one step's due later turns, in list order */
    double held_slots;
    double used_slots;
    double utilization_sum;
    double running_sum;
    size_t samples_room;
    size_t windows_room;
    size_t epoch;          /* weight updates so far */
    /* verification (verify_every > 0, compute on) */
    int verifying;
    kvp_sim_verifier verifier;
    size_t callback_bytes; /* an allocation on_token could not make; 0: none failed */
    double start;          /* now_seconds() when the run loop began */
    size_t audit_interval; /* steps between audits (0: only the final one) */
    kvp_sim_tier tier; /* the run's tiers (sim_tier.c) */
    size_t lanes;          /* layers a pool page holds (kvp_sim_fused_layers); figures
                              count one-layer pages: the pool's times lanes */
} sim;

size_t kvp_sim_audit_interval(size_t audit_every, size_t pages)
{
    if (audit_every != KVP_SIM_AUDIT_SCALED) {
        return audit_every;
    }
    size_t units = pages / KVP_SIM_AUDIT_PAGES + (pages % KVP_SIM_AUDIT_PAGES != 0);
    if (units > KVP_SIM_AUDIT_MAX / KVP_SIM_AUDIT_STEPS) {
        return KVP_SIM_AUDIT_MAX;
    }
    return KVP_SIM_AUDIT_STEPS * (units > 0 ? units : 1);
}

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

/* The pseudo-embedding of token `position` of `stream`: uniform in [-1, 1). */
static void embed(uint64_t seed, uint64_t stream, size_t position, double *row, size_t width)
{
    uint64_t state = seed ^ (0x9E3779B97F4A7C15ull * (stream + 1)) ^
                     (0xC2B2AE3D27D4EB4Full * (position + 1));
    for (size_t i = 0; i < width; i++) {
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        row[i] = (double)(z >> 11) * 0x1.0p-53 * 2.0 - 1.0;
    }
}

/* What a row is drawn from: embed's seed, stream and position. */
typedef struct row_source {
    uint64_t seed;
    uint64_t stream;
    size_t position;
} row_source;

/*
 * The source of the row of `position` of `sample` of workload request `r`
 * (the top of this file): the prompt is every sample's, and a generated
 * position of sample s > 0 is drawn with the seed mixed with s. A prompt
 * position of a request with block ids is its block's: (id, position within
 * the block), salted, so equal ids give equal rows (sim.h). request_row
 * draws the row; block_digest names a block by its rows' sources.
 */
static row_source source_of(uint64_t seed, const kvp_workload_request *r, size_t sample,
                            size_t position)
{
    if (r->block_ids != NULL && position < r->prompt_tokens) {
        return (row_source){seed ^ BLOCK_SALT,
                            r->block_ids[position / KVP_MOONCAKE_BLOCK_TOKENS],
                            position % KVP_MOONCAKE_BLOCK_TOKENS};
    }
    uint64_t stream = position < r->shared_tokens ? SHARED_STREAM : r->stream;
    if (position >= r->prompt_tokens && sample > 0) {
        seed ^= 0xD6E8FEB86659FD93ull * (uint64_t)sample;
    }
    return (row_source){seed, stream, position};
}

static void request_row(uint64_t seed, const kvp_workload_request *r, size_t sample,
                        size_t position, double *row, size_t width)
{
    row_source k = source_of(seed, r, sample, position);
    embed(k.seed, k.stream, k.position, row, width);
}

/* Whether list request `i`'s outputs are verified: 0, N, 2N, ... */
static int chosen(const sim *s, size_t i)
{
    return s->config->verify_every != 0 && i % s->config->verify_every == 0;
}

/* The scheduler's input callback: request `id` is workload request index_of[id]. */
static void input_row(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                      size_t width)
{
    sim *s = ctx;
    size_t i = s->index_of[id];
    request_row(s->config->seed, &s->workload->requests[i], sample, position, row, width);
}

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/*
 * The scheduler's block digest (allocator-only runs, which read no rows):
 * block `block` of sample `sample` of request `id` named by what each of
 * its rows is drawn from (source_of, the rule request_row draws by), into
 * two independent 64-bit lanes. Equal rows give equal digests, and
 * different draws different ones (but for a 2^-128 collision), so the
 * prefix keys match exactly where the rows' keys would, at the cost of a
 * few multiplications per position instead of drawing and hashing width
 * doubles.
 */
static void block_digest(void *ctx, uint64_t id, size_t sample, size_t block,
                         kvp_block_key *digest)
{
    const sim *s = ctx;
    const kvp_workload_request *r = &s->workload->requests[s->index_of[id]];
    size_t bt = s->config->block_tokens;
    uint64_t lo = 0x6A09E667F3BCC908ull;
    uint64_t hi = 0xBB67AE8584CAA73Bull;
    for (size_t p = block * bt; p < (block + 1) * bt; p++) {
        row_source k = source_of(s->config->seed, r, sample, p);
        lo = mix64(mix64(mix64(lo ^ k.seed) ^ k.stream) ^ (uint64_t)k.position);
        hi = mix64(mix64(mix64(hi + k.seed) + k.stream) + (uint64_t)k.position +
                   0x9E3779B97F4A7C15ull);
    }
    digest->lo = lo;
    digest->hi = hi;
}

/*
 * The scheduler's token callback: the checksum sums every decode output's
 * first value; a chosen request's outputs are kept for verification with
 * the epoch that decoded them (weight updates run between steps, and the
 * callback runs inside one).
 */
static void on_token(void *ctx, uint64_t id, size_t sample, size_t position,
                     const double *output, size_t width)
{
    sim *s = ctx;
    s->result->output_checksum += output[0];
    size_t i = s->index_of[id];
    (void)width;
    if (!s->verifying || !chosen(s, i) || s->callback_bytes != 0) {
        return;
    }
    const kvp_workload_request *r = &s->workload->requests[i];
    s->callback_bytes = kvp_sim_verifier_token(&s->verifier, i, r, sample,
                                               position - r->prompt_tokens, s->epoch, output);
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

/* What verification needs (verify.h), when it runs: compute on. */
static int setup_verify(sim *s, size_t page_bytes)
{
    s->verifying = 1;
    return kvp_sim_verifier_init(&s->verifier, s->config, s->workload->count, page_bytes, s->err,
                                 s->context);
}

static int setup(sim *s)
{
    const kvp_sim_config *c = s->config;
    size_t kv_heads = kvp_sim_kv_heads(c);
    s->lanes = 1;
    /* simulate_checks.c validated the shape; never divide by zero if a caller did not. */
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
    kvp_pool_config pool_config;
    size_t lanes = kvp_sim_fused_layers(c);
    kvp_sim_pool_config(c, &pool_config);
    if (kvp_pool_create(&pool_config, &s->pool, s->err) != KVP_OK) {
        return fail(s, "creating the page pool");
    }
    if (kvp_sim_tier_open(&c->tier, s->pool, &s->tier, s->err) != KVP_OK) {
        return fail(s, "opening the tier");
    }
    kvp_pool_stats pool_stats;
    kvp_pool_stats_init(&pool_stats);
    s->lanes = lanes;
    size_t pages = kvp_pool_stats_get(s->pool, &pool_stats, NULL) == KVP_OK
                       ? pool_stats.total_pages * lanes
                       : 0;
    s->audit_interval = kvp_sim_audit_interval(c->audit_every, pages);
    /* An allocator-only run builds no weights: the scheduler takes the geometry
       from its config and the pool. */
    if (c->compute && kvp_sim_model_create(c, &s->model, s->err) != KVP_OK) {
        return fail(s, "creating the model");
    }
    if (c->compute && kvp_decoder_create(c->threads, &s->decoder, s->err) != KVP_OK) {
        return fail(s, "starting the decoder threads");
    }
    kvp_scheduler_config scheduler_config;
    kvp_scheduler_config_init(&scheduler_config);
    scheduler_config.capacity = c->capacity;
    scheduler_config.watermark = c->watermark;
    scheduler_config.reserve_tokens = c->reserve_tokens;
    scheduler_config.compute = c->compute;
    scheduler_config.identity = c->seed; /* compute off: the external caches' identity */
    scheduler_config.sharing = c->sharing;
    scheduler_config.schedule = (uint64_t)c->schedule;
    scheduler_config.session_ttl = c->session_ttl;
    scheduler_config.max_running = c->max_running;
    scheduler_config.layers = c->layers / lanes; /* fused: one lease cache of every layer */
    scheduler_config.model_width = c->model_width;
    scheduler_config.tier_loads = (uint64_t)c->tier.loads;
    if (kvp_scheduler_create(s->model, s->pool, s->decoder, &scheduler_config, &s->scheduler,
                             s->err) != KVP_OK) {
        return fail(s, "creating the scheduler");
    }
    size_t n = s->workload->count;
    s->finished = kvp_cli_calloc(n, sizeof *s->finished);
    if (s->finished == NULL) {
        return out_of_memory(s, "the finished requests", n * sizeof *s->finished);
    }
    size_t **lists[] = {&s->index_of, &s->finish_step, &s->pending, &s->due, &s->batch};
    for (size_t k = 0; k < sizeof lists / sizeof lists[0]; k++) {
        *lists[k] = kvp_cli_alloc(n, sizeof(size_t));
        if (*lists[k] == NULL) {
            return out_of_memory(s, "the request schedule", n * sizeof(size_t));
        }
    }
    for (size_t i = 0; i < n; i++) {
        s->finish_step[i] = SIZE_MAX;
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    if (kvp_pool_stats_get(s->pool, &stats, s->err) != KVP_OK) {
        return fail(s, "reading pool stats");
    }
    s->result->fused_layers = lanes;
    s->result->total_pages = stats.total_pages * lanes;
    s->result->page_bytes = stats.page_bytes / lanes;
    s->result->kv_dtype = stats.dtype;
    s->result->element_bytes = stats.element_bytes;
    /*
     * Sequences of full capacity the pages hold (one lane per layer each),
     * against f64 pages of the same geometry and budget: the dtype's gain in
     * sequences, counted in whole pages.
     */
    size_t per_sequence = c->layers * (c->capacity / c->block_tokens +
                                       (c->capacity % c->block_tokens != 0));
    size_t f64_page_bytes = s->result->page_bytes / stats.element_bytes * sizeof(double);
    s->result->full_sequences = s->result->total_pages / per_sequence;
    s->result->f64_full_sequences = c->budget_bytes / f64_page_bytes / per_sequence;
    s->result->threads = s->decoder != NULL ? kvp_decoder_threads(s->decoder) : 1;
    s->result->windows = kvp_cli_calloc(1, sizeof *s->result->windows);
    if (s->result->windows == NULL) {
        return out_of_memory(s, "the update windows", sizeof *s->result->windows);
    }
    s->windows_room = 1;
    s->result->window_count = 1;
    s->result->windows[0].first_step = SIZE_MAX;
    return c->verify_every != 0 && c->compute ? setup_verify(s, stats.page_bytes) : 0;
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

/*
 * Submits request i of the workload at `step`; its scheduler id is the
 * count submitted before it. A later turn's gap after its previous turn
 * finished goes into the figures (0: that turn had not finished).
 */
static int submit(sim *s, size_t i, size_t step)
{
    const kvp_workload_request *w = &s->workload->requests[i];
    kvp_sim_result *res = s->result;
    if (w->turn > 0) {
        size_t finished = s->finish_step[i - 1];
        size_t gap = finished < step ? step - finished : 0;
        if (res->later_turns == 0 || gap < res->turn_gap_min) {
            res->turn_gap_min = gap;
        }
        res->later_turns++;
    }
    s->index_of[s->submitted] = i; /* before submitting: the callbacks may look it up */
    res->request_log[i].submit_step = res->steps;
    res->request_log[i].output_tokens = w->output_tokens;
    kvp_request request;
    kvp_request_init(&request);
    request.prompt_tokens = w->prompt_tokens;
    request.input = input_row;
    /* Allocator-only: keys from block digests, no row drawn (block_digest). */
    request.block_digest = s->config->compute ? NULL : block_digest;
    request.on_token = on_token;
    request.ctx = s;
    request.max_new_tokens = w->output_tokens;
    request.samples = s->config->samples;
    request.session = w->session;
    uint64_t id;
    if (kvp_scheduler_submit(s->scheduler, &request, &id, s->err) != KVP_OK) {
        return fail(s, "submitting a request");
    }
    s->submitted++;
    return 0;
}

/* Moves next_arrival past later turns: they are submitted when their previous turn finishes. */
static void skip_later_turns(sim *s)
{
    const kvp_workload *w = s->workload;
    while (s->next_arrival < w->count && w->requests[s->next_arrival].turn > 0) {
        s->next_arrival++;
    }
}

/* The next step something is due to be submitted at; SIZE_MAX when nothing is. */
static size_t next_due(const sim *s)
{
    const kvp_workload *w = s->workload;
    size_t next = s->next_arrival < w->count ? w->requests[s->next_arrival].arrival_step
                                             : SIZE_MAX;
    for (size_t k = 0; k < s->pending_count; k++) {
        next = s->due[s->pending[k]] < next ? s->due[s->pending[k]] : next;
    }
    return next;
}

/*
 * Submits what is due at `step`, in list order: the turn-0 requests that
 * have arrived and the later turns whose think time after their previous
 * turn is over.
 */
static int submit_due(sim *s, size_t step)
{
    const kvp_workload *w = s->workload;
    size_t ready = 0;
    size_t kept = 0;
    for (size_t k = 0; k < s->pending_count; k++) {
        size_t i = s->pending[k];
        if (s->due[i] <= step) {
            size_t j = ready++;
            for (; j > 0 && s->batch[j - 1] > i; j--) {
                s->batch[j] = s->batch[j - 1];
            }
            s->batch[j] = i;
        } else {
            s->pending[kept++] = i;
        }
    }
    s->pending_count = kept;
    size_t b = 0;
    skip_later_turns(s);
    for (;;) {
        size_t arrived = s->next_arrival < w->count &&
                                 w->requests[s->next_arrival].arrival_step <= step
                             ? s->next_arrival
                             : SIZE_MAX;
        size_t later = b < ready ? s->batch[b] : SIZE_MAX;
        if (arrived == SIZE_MAX && later == SIZE_MAX) {
            return 0;
        }
        if (arrived < later) {
            s->next_arrival++;
            skip_later_turns(s);
        } else {
            b++;
        }
        if (submit(s, arrived < later ? arrived : later, step) != 0) {
            return -1;
        }
    }
}

/*
 * Request i finished (completed or rejected) in `step`: its conversation's
 * next turn, if any, is due at the next step plus its think time.
 */
static void finished_at(sim *s, size_t i, size_t step)
{
    const kvp_workload *w = s->workload;
    s->finish_step[i] = step;
    if (i + 1 < w->count && w->requests[i + 1].turn > 0) {
        s->due[i + 1] = step + 1 + w->requests[i + 1].think_steps;
        s->pending[s->pending_count++] = i + 1;
    }
}

/* The input rows of one request, for its verification. */
typedef struct verify_rows {
    uint64_t seed;
    const kvp_workload_request *request;
} verify_rows;

static void verify_row(void *ctx, size_t sample, size_t position, double *row, size_t width)
{
    const verify_rows *v = ctx;
    request_row(v->seed, v->request, sample, position, row, width);
}

/* A finished request: verified when chosen (verify.c), segment by segment. */
static int check_finished(sim *s, const kvp_request_result *done)
{
    size_t i = s->index_of[done->id];
    if (!s->verifying || !chosen(s, i) || done->rejected) {
        return 0;
    }
    verify_rows rows = {s->config->seed, &s->workload->requests[i]};
    return kvp_sim_verifier_check(&s->verifier, i, rows.request, verify_row, &rows, s->err,
                                  s->context);
}

/* A collected request's schedule into the request log. */
static void log_finished(sim *s, const kvp_request_result *done)
{
    kvp_sim_request *q = &s->result->request_log[s->index_of[done->id]];
    q->finished = 1;
    q->rejected = done->rejected;
    q->admissions = done->admissions;
    q->first_hit_tokens = done->first_hit_tokens;
    q->recomputed_tokens = done->recomputed_tokens;
    q->admitted_step = (size_t)done->admitted_step;
    q->first_token_step = (size_t)done->first_token_step;
    q->finished_step = (size_t)done->finished_step;
    s->result->first_hit_tokens += done->first_hit_tokens;
}

/*
 * Takes the requests that finished in `step`; one that failed fails the run
 * with its error.
 */
static int collect(sim *s, size_t step)
{
    size_t n = 0;
    if (s->workload->count > 0) {
        kvp_request_result_init(&s->finished[0]);
    }
    if (kvp_scheduler_collect(s->scheduler, s->finished, s->workload->count, &n, s->err) !=
        KVP_OK) {
        return fail(s, "collecting finished requests");
    }
    for (size_t i = 0; i < n; i++) {
        if (s->finished[i].status != KVP_OK) {
            *s->err = s->finished[i].error;
            return fail(s, "serving a request");
        }
        log_finished(s, &s->finished[i]);
        finished_at(s, s->index_of[s->finished[i].id], step);
        if (check_finished(s, &s->finished[i]) != 0) {
            return -1;
        }
    }
    return 0;
}

/*
 * A weight update between two steps: every parameter of every layer moves
 * by a perturbation seeded by (seed, update, layer, parameter) and its
 * revision advances; a new update window opens.
 */
static int update_weights(sim *s)
{
    const kvp_sim_config *c = s->config;
    kvp_sim_result *res = s->result;
    if (grow((void **)&res->windows, &s->windows_room, res->window_count + 1,
             sizeof *res->windows) != 0) {
        return out_of_memory(s, "the update windows",
                             (res->window_count + 1) * sizeof *res->windows);
    }
    s->epoch++;
    if (kvp_sim_update_weights(s->model, c, s->epoch, s->err) != 0) {
        return fail(s, "updating the weights");
    }
    res->weight_updates++;
    res->windows[res->window_count++] = (kvp_sim_window){.step = res->steps,
                                                         .first_step = SIZE_MAX};
    return 0;
}

/* Records the step for the report and the plot. */
static int record_step(sim *s, const kvp_step_stats *st, size_t clock, double start)
{
    kvp_sim_result *res = s->result;
    if (grow((void **)&res->samples, &s->samples_room, res->steps + 1, sizeof *res->samples) != 0) {
        return out_of_memory(s, "step samples", (res->steps + 1) * sizeof *res->samples);
    }
    /* Concurrency counts the sequences that really decoded in this step. */
    if (st->decoded > res->peak_concurrent) {
        res->peak_concurrent = st->decoded;
    }
    /* Pages held at the end of the step are the running and kept sequences' pages. */
    double held = (double)st->held_pages;
    res->samples[res->steps] = (kvp_sim_sample){(uint32_t)st->held_pages, (uint32_t)st->running,
                                                (uint32_t)st->cached_pages,
                                                (uint32_t)st->evictable_pages, clock,
                                                start - s->start, now_seconds() - s->start};
    kvp_sim_window *window = &res->windows[res->window_count - 1];
    window->prompt_tokens += st->prompt_tokens;
    window->prefix_hit_tokens += st->prefix_hit_tokens;
    if (window->first_step == SIZE_MAX && st->prompt_tokens > 0) {
        window->first_step = res->steps;
        window->first_prompt_tokens = st->prompt_tokens;
        window->first_hit_tokens = st->prefix_hit_tokens;
    }
    res->held_page_steps += held;
    res->unshared_page_steps += (double)st->unshared_pages;
    res->peak_held_pages = st->held_pages > res->peak_held_pages ? st->held_pages
                                                                 : res->peak_held_pages;
    /* Sharing is off with windows: the pages held are the running sequences'. */
    size_t full_pages = st->held_pages - st->sliding_held_pages;
    res->peak_sliding_pages = st->sliding_held_pages > res->peak_sliding_pages
                                  ? st->sliding_held_pages
                                  : res->peak_sliding_pages;
    res->peak_full_pages = full_pages > res->peak_full_pages ? full_pages : res->peak_full_pages;
    res->steps++;
    /*
     * Fragmentation is each sequence's own: the slots of the pages its page
     * tables name against the positions it holds, a shared page counted by
     * every sequence naming it (as used_slots counts its positions). Without
     * sharing these are exactly the pages held.
     */
    s->held_slots += (double)st->unshared_pages * (double)s->config->block_tokens;
    s->used_slots += (double)st->used_slots;
    double utilization = held / (double)st->total_pages;
    s->utilization_sum += utilization;
    res->peak_utilization = utilization > res->peak_utilization ? utilization
                                                                : res->peak_utilization;
    s->running_sum += (double)st->decoded;
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

/* Copies the scheduler's counters into the result; final: the run's last read. */
static void read_counters(sim *s, int final)
{
    kvp_scheduler_stats stats;
    kvp_scheduler_stats_init(&stats);
    if (s->scheduler == NULL || kvp_scheduler_stats_get(s->scheduler, &stats, NULL) != KVP_OK) {
        return;
    }
    s->result->requests_completed = (size_t)stats.completed;
    s->result->requests_rejected = (size_t)stats.rejected;
    s->result->preemptions = (size_t)stats.preemptions;
    s->result->tokens_generated = stats.tokens_generated;
    s->result->prefill_tokens = stats.prefill_tokens;
    s->result->prompt_tokens = stats.prompt_tokens;
    s->result->prefix_hit_tokens = stats.prefix_hit_tokens;
    s->result->stale_preemptions = stats.stale_preemptions;
    s->result->forks = stats.forks;
    s->result->session_keeps = stats.session_keeps;
    s->result->session_hits = stats.session_hits;
    s->result->session_drops = stats.session_drops;
    kvp_sim_tier_read(&s->tier, s->pool, &stats, final, &s->result->tier);
}

static int step_once(sim *s, size_t step)
{
    double start = now_seconds();
    if (submit_due(s, step) != 0) {
        return -1;
    }
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    if (kvp_scheduler_step(s->scheduler, &st, s->err) != KVP_OK) {
        return fail(s, "running a scheduler step");
    }
    kvp_sim_fused_step(s->lanes, &st);
    if (s->callback_bytes != 0) {
        return out_of_memory(s, "a verified request's outputs", s->callback_bytes);
    }
    if (collect(s, step) != 0) {
        return -1;
    }
    if (st.decoded == 0 && st.running == 0 && st.waiting > 0 && st.preempted == 0) {
        /*
         * Cannot happen (a request that fits an empty pool is admitted); refuse
         * to spin. A step that preempted every running request (stale weights)
         * emptied the pool: the next one admits.
         */
        kvp_pool_stats stats;
        kvp_pool_stats_init(&stats);
        size_t free_pages = kvp_pool_stats_get(s->pool, &stats, NULL) == KVP_OK
                                ? stats.free_pages * s->lanes
                                : 0;
        *s->err = (kvp_error){.status = KVP_POOL_EXHAUSTED, .available = free_pages};
        return fail(s, "admitting the first waiting request into an idle pool");
    }
    if (record_step(s, &st, step, start) != 0) {
        return -1;
    }
    read_counters(s, 0);
    if (s->audit_interval != 0 && s->result->steps % s->audit_interval == 0) {
        audit(s);
    }
    return 0;
}

static int run_loop(sim *s, kvp_sim_progress_fn progress, void *ctx)
{
    const kvp_workload *w = s->workload;
    size_t step = 0;
    double start = now_seconds();
    s->start = start;
    while (s->result->requests_completed + s->result->requests_rejected < w->count) {
        kvp_scheduler_stats stats;
        kvp_scheduler_stats_init(&stats);
        if (kvp_scheduler_stats_get(s->scheduler, &stats, s->err) != KVP_OK) {
            return fail(s, "reading scheduler stats");
        }
        if (stats.running == 0 && stats.waiting == 0) {
            skip_later_turns(s);
            size_t next = next_due(s);
            if (next != SIZE_MAX && next > step) {
                step = next; /* skip idle steps */
            }
        }
        size_t every = s->config->update_every;
        if (every != 0 && s->result->steps > 0 && s->result->steps % every == 0 &&
            update_weights(s) != 0) {
            return -1;
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

/* Destroys the scheduler (every sequence), then audits what is left: nothing may be held. */
static void teardown(sim *s)
{
    read_counters(s, 1);
    if (s->scheduler != NULL) {
        kvp_scheduler_destroy(s->scheduler, NULL);
    }
    if (s->pool != NULL) {
        kvp_pool_stats stats;
        kvp_pool_stats_init(&stats);
        audit(s);
        if (kvp_pool_stats_get(s->pool, &stats, NULL) == KVP_OK) {
            s->result->pages_leaked = stats.held_pages * s->lanes;
            s->result->acquires = stats.acquires * s->lanes;
            s->result->releases = stats.releases * s->lanes;
            s->result->evictions = stats.evictions * s->lanes;
            s->result->cow_copies = stats.cow_copies * s->lanes;
            s->result->window_releases = stats.window_releases * s->lanes;
        }
        if (kvp_pool_destroy(s->pool, NULL) != KVP_OK) {
            s->result->audit_failures++;
        }
    }
    kvp_sim_tier_close(&s->tier); /* after the pool: its destroy detached the tier */
    if (s->decoder != NULL) {
        kvp_decoder_destroy(s->decoder, NULL);
    }
    s->result->verified = s->verifier.verified;
    s->result->verify_segments = s->verifier.segments;
    s->result->verify_replayed = s->verifier.epochs_replayed;
    s->result->verify_mismatches = s->verifier.mismatches;
    kvp_sim_verifier_free(&s->verifier, &s->result->audit_failures);
    if (s->model != NULL) {
        kvp_model_destroy(s->model, NULL);
    }
    kvp_cli_free(s->finished);
    kvp_cli_free(s->index_of);
    kvp_cli_free(s->finish_step);
    kvp_cli_free(s->pending);
    kvp_cli_free(s->due);
    kvp_cli_free(s->batch);
}

static void summarize(sim *s)
{
    const kvp_sim_config *c = s->config;
    kvp_sim_result *res = s->result;
    if (res->steps > 0) {
        res->mean_concurrent = s->running_sum / (double)res->steps;
        res->mean_utilization = s->utilization_sum / (double)res->steps;
        res->mean_held_pages = res->held_page_steps / (double)res->steps;
    }
    if (res->prompt_tokens > 0) {
        res->prefix_hit_rate = (double)res->prefix_hit_tokens / (double)res->prompt_tokens;
    }
    res->pages_saved_ratio = res->held_page_steps > 0.0
                                 ? res->unshared_page_steps / res->held_page_steps
                                 : 1.0;
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
    out->request_log = kvp_cli_calloc(workload->count > 0 ? workload->count : 1,
                                      sizeof *out->request_log);
    int status = out->request_log != NULL
                     ? setup(&s)
                     : out_of_memory(&s, "the request log",
                                     workload->count * sizeof *out->request_log);
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
    kvp_cli_free(result->request_log);
    result->request_log = NULL;
    kvp_cli_free(result->windows);
    result->windows = NULL;
    result->window_count = 0;
}
