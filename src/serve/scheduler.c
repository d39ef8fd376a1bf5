/*
 * scheduler.c: the scheduler's public calls (kvpager/scheduler.h has the
 * schedule and the contracts; the rooms behind them:
 * scheduler_internal.h).
 *
 * Owns: the init calls of the config, a request and the statistics (a
 * result's is in scheduler_queue.c, a step's statistics' in
 * scheduler_step.c, beside their users) and the reading of those structs
 * (struct_size: an older caller's shorter struct reads defaults for the
 * rest), create
 * (a table of checks, then the fields, then what is allocated up front)
 * and destroy, submit (a checked copy of the request, queued, a session's
 * request ahead while its lease is kept), collect, a request's state, and
 * the statistics. A step is kvp_scheduler_step (scheduler_step.c).
 *
 * Invariants: every failure changes nothing (a submit that fails queues
 * nothing and counts nothing; a create that fails frees all it made); a
 * collected request's id is unknown from then on (REQUEST_UNKNOWN).
 * Callers: the public API only. Calls the queue, session and lease rooms.
 */
#include "kvpager/scheduler.h"

#include <math.h>
#include <string.h>

#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/error.h"
#include "pager/pool_internal.h"
#include "serve/scheduler_internal.h"

/* ---- public: setup ------------------------------------------------------ */

void kvp_scheduler_config_init(kvp_scheduler_config *config)
{
    if (config == NULL) {
        return;
    }
    memset(config, 0, sizeof *config);
    config->struct_size = sizeof *config;
    config->watermark = 0.01;
    config->reserve_tokens = 16;
    config->compute = 1;
    config->sharing = 1;
    config->session_fraction = 0.5;
    config->tier_prefetch = 2;
}

void kvp_request_init(kvp_request *request)
{
    if (request == NULL) {
        return;
    }
    memset(request, 0, sizeof *request);
    request->struct_size = sizeof *request;
    request->samples = 1;
}

void kvp_scheduler_stats_init(kvp_scheduler_stats *stats)
{
    if (stats == NULL) {
        return;
    }
    memset(stats, 0, sizeof *stats);
    stats->struct_size = sizeof *stats;
}

/*
 * The caller's config, checked: struct_size, then the watermark and the
 * schedule. Only the bytes its struct_size covers are read (an older
 * caller's shorter struct: defaults for the rest).
 */
static kvp_status config_read(const kvp_scheduler_config *caller, kvp_scheduler_config *config,
                              kvp_error *err)
{
    size_t size = caller->struct_size;
    kvp_status status = kvpi_struct_size_check(size, KVPI_SCHEDULER_CONFIG_SIZE_FIRST, err);
    if (status == KVP_OK) {
        status = kvpi_struct_tail_check(caller, size, sizeof *config, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    kvp_scheduler_config_init(config);
    memcpy(config, caller, size < sizeof *config ? size : sizeof *config);
    config->struct_size = sizeof *config;
    if (!(config->watermark >= 0.0 && config->watermark < 1.0)) {
        return kvpi_fail_invalid(err, "watermark", "must be in [0, 1)");
    }
    if (config->schedule != KVP_SCHEDULE_FCFS && config->schedule != KVP_SCHEDULE_CACHE_AWARE) {
        return kvpi_fail_invalid(err, "schedule", "must be KVP_SCHEDULE_FCFS or _CACHE_AWARE");
    }
    if (!(config->session_fraction >= 0.0 && config->session_fraction <= 1.0)) {
        return kvpi_fail_invalid(err, "session_fraction", "must be in [0, 1]");
    }
    if (config->tier_loads > KVP_TIER_LOADS_NEVER) {
        return kvpi_fail_invalid(err, "tier_loads", "must be a kvp_tier_loads");
    }
    if (config->tier_prefetch > KVP_TIER_PREFETCH_MAX) {
        return kvpi_fail_invalid(err, "tier_prefetch", "must be at most KVP_TIER_PREFETCH_MAX");
    }
    config->compute = config->compute != 0;
    config->sharing = config->sharing != 0;
    return KVP_OK;
}

static void scheduler_free(kvp_scheduler *s)
{
    for (size_t i = 0; i < s->running_count; i++) {
        lease_free(&s->running[i].lease);
    }
    for (size_t i = 0; i < s->idle_count; i++) {
        lease_free(&s->idle[i]);
    }
    for (size_t i = 0; i < s->kept_count; i++) {
        lease_free(&s->kept[i].lease);
    }
    kvpi_sched_tier_prefetch_drop_all(s);
    kvpi_free(s->kept);
    kvpi_free(s->kept_refs);
    kvpi_free(s->windows);
    kvpi_requests_free(&s->requests);
    kvpi_free(s->waiting);
    kvpi_free(s->running);
    kvpi_free(s->idle);
    kvpi_free(s->done);
    kvpi_free(s->jobs);
    kvpi_free(s->rows);
    kvpi_free(s->plan);
    kvpi_free(s->keys);
    kvpi_free(s->parked.keys);
    for (size_t i = 0; i < WINDOW; i++) {
        kvpi_free(s->ranked[i].keys);
    }
    kvpi_free(s);
}

/* What create is given and what it reads before it allocates (create_checks). */
typedef struct create_inputs {
    const kvp_model *model;
    kvp_pool *pool;
    kvp_decoder *decoder;
    const kvp_scheduler_config *cfg;
    kvp_scheduler **out;
    kvp_scheduler_config config;
    kvp_model_info info;
    kvp_pool_stats pool_stats;
} create_inputs;

static kvp_status check_arguments(create_inputs *in, kvp_error *err)
{
    const struct {
        const void *pointer;
        const char *name;
    } arguments[] = {
        {in->pool, "pool"}, {in->cfg, "cfg"}, {in->out, "out"}};
    for (size_t i = 0; i < sizeof arguments / sizeof arguments[0]; i++) {
        if (arguments[i].pointer == NULL) {
            return kvpi_fail_null(err, arguments[i].name);
        }
    }
    return KVP_OK;
}

static kvp_status check_config(create_inputs *in, kvp_error *err)
{
    kvp_status status = config_read(in->cfg, &in->config, err);
    if (status == KVP_OK && in->config.compute && in->model == NULL) {
        return kvpi_fail_null(err, "model");
    }
    if (status == KVP_OK && in->config.compute && in->decoder == NULL) {
        return kvpi_fail_null(err, "decoder");
    }
    return status;
}

/* A configured geometry field: 0 takes the model's; without a model it must be set. */
static kvp_status check_geometry(const create_inputs *in, size_t configured, size_t model,
                                 const char *name, kvp_error *err)
{
    if (in->model == NULL && configured == 0) {
        return kvpi_fail_invalid(err, name, "must be at least 1 without a model");
    }
    if (in->model != NULL && configured != 0 && configured != model) {
        return kvpi_fail_invalid(err, name, "must be 0 or the model's");
    }
    return KVP_OK;
}

/*
 * The geometry: the model's, or without one (compute 0) cfg's layers and
 * model_width and the pool's KV heads and head width.
 */
static kvp_status read_model(create_inputs *in, kvp_error *err)
{
    kvp_model_info_init(&in->info);
    if (in->model != NULL) {
        kvp_status status = kvp_model_info_get(in->model, &in->info, err);
        if (status != KVP_OK) {
            return status;
        }
    } else {
        in->info.layers = in->config.layers;
        in->info.model_width = in->config.model_width;
        in->info.kv_heads = in->pool->heads; /* fixed at the pool's creation */
        in->info.head_width = in->pool->head_width;
    }
    kvp_status status = check_geometry(in, in->config.layers, in->info.layers, "layers", err);
    if (status == KVP_OK) {
        status = check_geometry(in, in->config.model_width, in->info.model_width,
                                "model_width", err);
    }
    return status;
}

static kvp_status read_pool(create_inputs *in, kvp_error *err)
{
    kvp_pool_stats_init(&in->pool_stats);
    return kvp_pool_stats_get(in->pool, &in->pool_stats, err);
}

/* Create's checks, in the order it reports the first failure. */
static kvp_status (*const create_checks[])(create_inputs *, kvp_error *) = {
    check_arguments, /* NULL pool, cfg, out */
    check_config,    /* config_read's checks, then a model and a decoder when computing */
    read_model,      /* the model's geometry, or cfg's and the pool's without one */
    read_pool,
};

/* A new scheduler's fields from its checked inputs (allocates nothing). */
static void scheduler_init(kvp_scheduler *s, const create_inputs *in)
{
    size_t total = in->pool_stats.total_pages;
    s->model = in->model;
    s->pool = in->pool;
    s->decoder = in->config.compute ? in->decoder : NULL;
    s->config = in->config;
    s->layers = in->info.layers;
    s->width = in->info.model_width;
    s->kv_heads = in->info.kv_heads;
    s->head_width = in->info.head_width;
    s->block_tokens = in->pool->block_tokens; /* fixed at the pool's creation */
    s->watermark_pages = (size_t)ceil(in->config.watermark * (double)total);
    s->kept_cap = (size_t)floor(in->config.session_fraction * (double)total);
    s->leases = in->config.compute ? &kvpi_lease_computed : &kvpi_lease_external;
    kvp_scheduler_stats_init(&s->stats);
    kvpi_requests_init(&s->requests);
    s->parked.id = NO_REQUEST;
    for (size_t i = 0; i < WINDOW; i++) {
        s->ranked[i].id = NO_REQUEST;
    }
    for (size_t i = 0; i < KVP_TIER_PREFETCH_MAX; i++) {
        s->prefetches[i].id = NO_REQUEST;
    }
}

/*
 * s->windows: each layer's (W, S) when the run computes with a model that
 * has a sliding layer, else NULL (every layer full, or compute 0: its
 * external caches carry no window and release nothing, so admission counts
 * full lengths). The model's layers are valid.
 */
static kvp_status windows_read(kvp_scheduler *s, kvp_error *err)
{
    size_t *w = NULL;
    for (size_t i = 0; s->config.compute && s->model != NULL && i < s->layers; i++) {
        kvp_layer_info layer;
        kvp_layer_info_init(&layer);
        if (kvp_layer_info_get(kvp_model_layer(s->model, i), &layer, NULL) != KVP_OK ||
            (layer.window == 0 && w == NULL)) {
            continue;
        }
        if (w == NULL) {
            w = kvpi_calloc(KVPI_SITE_SCRATCH, 2 * s->layers, sizeof *w);
            if (w == NULL) {
                return kvpi_fail_alloc(err, "scheduler layer windows",
                                       2 * s->layers * sizeof *w);
            }
        }
        w[2 * i] = layer.window;
        w[2 * i + 1] = layer.sink_tokens;
    }
    s->windows = w;
    return KVP_OK;
}

/*
 * What a scheduler allocates up front: the kept page counts (sessions on),
 * what its lease kind needs (nothing yet), and the first lease, made now: it checks
 * the model and pool against each other. On failure the caller frees s.
 */
static kvp_status scheduler_alloc(kvp_scheduler *s, size_t total_pages, kvp_error *err)
{
    if (s->config.session_ttl > 0) {
        s->kept_refs = kvpi_calloc(KVPI_SITE_SCRATCH, total_pages, sizeof *s->kept_refs);
        if (s->kept_refs == NULL) {
            return kvpi_fail_alloc(err, "scheduler kept page counts",
                                   total_pages * sizeof(uint32_t));
        }
    }
    kvp_status status = windows_read(s, err);
    if (status == KVP_OK) {
        status = s->leases->setup(s, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    if (kvpi_sched_grow((void **)&s->idle, &s->idle_room, 1, sizeof *s->idle) != 0) {
        return kvpi_fail_alloc(err, "scheduler idle list", 16 * sizeof *s->idle);
    }
    status = lease_make(s, &s->idle[0], err);
    s->idle_count = status == KVP_OK;
    return status;
}

kvp_status kvp_scheduler_create(const kvp_model *model, kvp_pool *pool, kvp_decoder *decoder,
                                const kvp_scheduler_config *cfg, kvp_scheduler **out,
                                kvp_error *err)
{
    create_inputs in = {.model = model, .pool = pool, .decoder = decoder, .cfg = cfg, .out = out};
    for (size_t i = 0; i < sizeof create_checks / sizeof create_checks[0]; i++) {
        kvp_status status = create_checks[i](&in, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    kvp_scheduler *s = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *s);
    if (s == NULL) {
        return kvpi_fail_alloc(err, "scheduler", sizeof *s);
    }
    scheduler_init(s, &in);
    kvp_status status = scheduler_alloc(s, in.pool_stats.total_pages, err);
    if (status != KVP_OK) {
        scheduler_free(s);
        return status;
    }
    *out = s;
    return KVP_OK;
}

kvp_status kvp_scheduler_destroy(kvp_scheduler *scheduler, kvp_error *err)
{
    (void)err;
    if (scheduler != NULL) {
        scheduler_free(scheduler);
    }
    return KVP_OK;
}

/* ---- public: submit ----------------------------------------------------- */

static kvp_status request_read(const kvp_scheduler *s, const kvp_request *caller,
                               kvp_request *request, kvp_error *err)
{
    size_t size = caller->struct_size;
    kvp_status status = kvpi_struct_size_check(size, KVPI_REQUEST_SIZE_FIRST, err);
    if (status == KVP_OK) {
        status = kvpi_struct_tail_check(caller, size, sizeof *request, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    /* Only the bytes struct_size covers: an older caller's later fields default. */
    kvp_request_init(request);
    memcpy(request, caller, size < sizeof *request ? size : sizeof *request);
    request->struct_size = sizeof *request;
    if (s->config.compute && request->input == NULL) {
        return kvpi_fail_null(err, "input");
    }
    if (request->prompt_tokens == 0) {
        return kvpi_fail_invalid(err, "prompt_tokens", "must be at least 1");
    }
    if (request->max_new_tokens == 0) {
        return kvpi_fail_invalid(err, "max_new_tokens", "must be at least 1");
    }
    if (request->samples == 0) {
        return kvpi_fail_invalid(err, "samples", "must be at least 1");
    }
    if (request->samples > MAX_SAMPLES) {
        return kvpi_fail_invalid(err, "samples", "must be at most 256");
    }
    size_t capacity = s->config.capacity;
    if (request->prompt_tokens > capacity ||
        request->max_new_tokens > capacity - request->prompt_tokens) {
        if (err != NULL) {
            kvp_error e;
            memset(&e, 0, sizeof e);
            e.status = KVP_FULL;
            e.what = "request";
            e.tokens = request->prompt_tokens > SIZE_MAX - request->max_new_tokens
                           ? SIZE_MAX
                           : request->prompt_tokens + request->max_new_tokens;
            e.available = capacity;
            e.capacity = capacity;
            *err = e;
        }
        return KVP_FULL;
    }
    return KVP_OK;
}

kvp_status kvp_scheduler_submit(kvp_scheduler *scheduler, const kvp_request *request,
                                uint64_t *id, kvp_error *err)
{
    if (scheduler == NULL) {
        return kvpi_fail_null(err, "scheduler");
    }
    if (request == NULL) {
        return kvpi_fail_null(err, "request");
    }
    if (id == NULL) {
        return kvpi_fail_null(err, "id");
    }
    kvp_scheduler *s = scheduler;
    kvp_request copy;
    kvp_status status = request_read(s, request, &copy, err);
    if (status != KVP_OK) {
        return status;
    }
    if (kvpi_requests_reserve(&s->requests, 1) != 0 ||
        kvpi_sched_queue_grow(s, s->waiting_count + 1) != 0) {
        return kvpi_fail_alloc(err, "scheduler request records",
                               (s->requests.live + 1) * sizeof(record));
    }
    record *r = kvpi_requests_add(&s->requests);
    uint64_t next = r->id;
    r->request = copy;
    r->state = STATE_WAITING;
    /* A session's next request goes ahead while its sequence is kept, current (5.). */
    size_t k = copy.session != 0 ? kvpi_sched_kept_of(s, copy.session) : SIZE_MAX;
    if (k != SIZE_MAX && !lease_stale(s, &s->kept[k].lease)) {
        kvpi_sched_queue_jump(s, next);
    } else {
        kvpi_sched_queue_push_back(s, next);
    }
    s->stats.submitted++;
    *id = next;
    return KVP_OK;
}

/* ---- public: collect and stats ------------------------------------------ */

kvp_status kvp_scheduler_collect(kvp_scheduler *scheduler, kvp_request_result *finished,
                                 size_t cap, size_t *n, kvp_error *err)
{
    if (scheduler == NULL) {
        return kvpi_fail_null(err, "scheduler");
    }
    if (n == NULL) {
        return kvpi_fail_null(err, "n");
    }
    if (cap > 0 && finished == NULL) {
        return kvpi_fail_null(err, "finished");
    }
    if (cap > 0 && finished[0].struct_size != sizeof *finished) {
        return kvpi_fail_invalid(err, "struct_size",
                                 "of finished[0] must be sizeof(kvp_request_result)");
    }
    kvp_scheduler *s = scheduler;
    size_t take = s->done_count < cap ? s->done_count : cap;
    for (size_t i = 0; i < take; i++) {
        finished[i] = s->done[i];
        kvpi_requests_remove(&s->requests, s->done[i].id); /* its id is stale from now on */
    }
    if (take > 0) { /* done is NULL until a step first makes room */
        memmove(s->done, s->done + take, (s->done_count - take) * sizeof *s->done);
        s->done_count -= take;
    }
    *n = take;
    return KVP_OK;
}

kvp_status kvp_scheduler_request_state(const kvp_scheduler *scheduler, uint64_t id,
                                       kvp_request_state *state, kvp_error *err)
{
    if (scheduler == NULL) {
        return kvpi_fail_null(err, "scheduler");
    }
    if (state == NULL) {
        return kvpi_fail_null(err, "state");
    }
    const record *r = kvpi_requests_find(&scheduler->requests, id);
    if (r == NULL) {
        if (err != NULL) {
            kvp_error e;
            memset(&e, 0, sizeof e);
            e.status = KVP_REQUEST_UNKNOWN;
            e.index = (size_t)id;
            e.limit = (size_t)scheduler->requests.next_id;
            *err = e;
        }
        return KVP_REQUEST_UNKNOWN;
    }
    *state = r->state == STATE_WAITING   ? KVP_REQUEST_WAITING
             : r->state == STATE_RUNNING ? KVP_REQUEST_RUNNING
                                         : KVP_REQUEST_FINISHED;
    return KVP_OK;
}

kvp_status kvp_scheduler_stats_get(const kvp_scheduler *scheduler, kvp_scheduler_stats *out,
                                   kvp_error *err)
{
    if (scheduler == NULL) {
        return kvpi_fail_null(err, "scheduler");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_scheduler_stats stats = scheduler->stats;
    stats.struct_size = sizeof stats;
    stats.running = scheduler->running_count;
    stats.waiting = scheduler->waiting_count;
    stats.uncollected = scheduler->done_count;
    stats.held_samples = scheduler->running_count + scheduler->idle_count + scheduler->kept_count;
    stats.retained = scheduler->kept_count;
    stats.retained_pages = scheduler->kept_pages;
    stats.tier_bytes_per_second = scheduler->tier.bytes_per_second;
    stats.prefill_tokens_per_second =
        scheduler->tier.prefill_seconds > 0.0
            ? (double)scheduler->tier.prefill_tokens / scheduler->tier.prefill_seconds
            : 0.0;
    return kvpi_struct_out(out, &stats, sizeof stats, KVPI_SCHEDULER_STATS_SIZE_FIRST, err);
}
