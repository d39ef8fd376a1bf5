/*
 * scheduler.c: continuous batching over one model, pool and decoder
 * (kvpager/scheduler.h has the schedule and the contracts).
 *
 * Owns: the request records, the waiting queue (a ring of ids), the running
 * slots, the idle leases kept for reuse, and the finished results awaiting
 * collection. The model, pool and decoder are the caller's.
 *
 * Invariants:
 *   - a request is in exactly one of: waiting, running, finished (in `done`,
 *     not collected), collected;
 *   - every running slot holds one lease (a sequence, or with compute off
 *     one external cache per layer, plus its token buffers); finished and
 *     preempted leases are reset and kept in `idle`, so steady state
 *     allocates nothing per admission or per step. A lease is owned by
 *     exactly one place, a running slot or the idle list;
 *   - a step allocates only before it changes anything: it first grows every
 *     array to what the worst case of this step needs (every waiting request
 *     admitted or rejected, every running one retired), plans the admissions
 *     without side effects, and makes the leases and prompt rows the plan
 *     needs. A failure there changes nothing;
 *   - before decode, the free pages cover the new pages every running
 *     sequence needs this step (preemption makes it so), so decode fails for
 *     want of pages only when another user of the pool takes them;
 *   - the requests admitted in a step are prefilled together after
 *     admission. Admission decides exactly as if each were prefilled on
 *     admission: kvp_pool_admit counts free pages minus promises not yet
 *     taken, and a prefill draws its pages from its own promise, so taking
 *     them later changes neither side of that difference. The plan asks
 *     kvp_pool_admit for each request's pages plus the promises planned
 *     before it in the step, which is the same question.
 * Callers: the public API only.
 */
#include "kvpager/scheduler.h"

#include <assert.h>
#include <math.h>
#include <string.h>

#include "kvpager/cache.h"
#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/error.h"
#include "pager/pool_internal.h"

enum { STATE_WAITING, STATE_RUNNING, STATE_FINISHED, STATE_COLLECTED };

typedef struct record {
    kvp_request request;  /* the caller's, copied (struct_size the library's) */
    size_t generated;     /* tokens generated so far, kept across preemption */
    size_t preemptions;
    int state;
} record;

/* A sequence (or external caches) with its token buffers, reused between requests. */
typedef struct lease {
    kvp_sequence *sequence; /* compute on */
    kvp_cache **caches;     /* compute off: [layers] */
    double *input;          /* [width] */
    double *output;         /* [width], in the same allocation as input */
} lease;

/* One queue entry a step takes: admitted, or rejected (it can never fit). */
typedef struct planned {
    uint64_t id;
    int admit;
} planned;

typedef struct slot {
    lease lease;
    uint64_t id;
    uint64_t admitted; /* admission order; the largest is preempted first */
    size_t job;        /* its decode job in this step */
} slot;

struct kvp_scheduler {
    const kvp_model *model;
    kvp_pool *pool;
    kvp_decoder *decoder;
    kvp_scheduler_config config;
    size_t layers;
    size_t width;
    size_t kv_heads;
    size_t head_width;
    size_t block_tokens;
    size_t watermark_pages;

    record *records;  /* [count], indexed by id */
    size_t records_count;
    size_t records_room;
    uint64_t *waiting; /* ring of ids */
    size_t waiting_head;
    size_t waiting_count;
    size_t waiting_room;
    slot *running;
    size_t running_count;
    size_t running_room;
    lease *idle;
    size_t idle_count;
    size_t idle_room;
    kvp_request_result *done;
    size_t done_count;
    size_t done_room;
    kvp_decode_job *jobs;
    size_t jobs_room;
    double *rows;       /* the step's prompt rows, back to back */
    size_t rows_room;   /* rows; grown, never shrunk */
    double *zeros;      /* compute off: one block of zero rows */
    planned *plan;      /* the step's plan: queue entries taken, in queue order */
    size_t plan_room;
    uint64_t admissions;
    kvp_scheduler_stats stats;
};

/* ---- small helpers ------------------------------------------------------ */

/* Grows a heap array of `size`-byte items to hold `need`; 0, or -1 changing nothing. */
static int grow(void **items, size_t *room, size_t need, size_t size)
{
    if (need <= *room) {
        return 0;
    }
    size_t bigger = *room ? *room : 16;
    while (bigger < need) {
        if (bigger > SIZE_MAX / 2) {
            return -1;
        }
        bigger *= 2;
    }
    void *grown = kvpi_calloc(KVPI_SITE_SCRATCH, bigger, size);
    if (grown == NULL) {
        return -1;
    }
    if (*items != NULL) {
        memcpy(grown, *items, *room * size);
    }
    kvpi_free(*items);
    *items = grown;
    *room = bigger;
    return 0;
}

static record *record_of(kvp_scheduler *s, uint64_t id)
{
    return &s->records[id];
}

static size_t queue_at(const kvp_scheduler *s, size_t i)
{
    return (s->waiting_head + i) % s->waiting_room;
}

static void queue_push_back(kvp_scheduler *s, uint64_t id)
{
    s->waiting[queue_at(s, s->waiting_count)] = id;
    s->waiting_count++;
}

static void queue_push_front(kvp_scheduler *s, uint64_t id)
{
    s->waiting_head = (s->waiting_head + s->waiting_room - 1) % s->waiting_room;
    s->waiting[s->waiting_head] = id;
    s->waiting_count++;
}

static uint64_t queue_pop_front(kvp_scheduler *s)
{
    uint64_t id = s->waiting[s->waiting_head];
    s->waiting_head = (s->waiting_head + 1) % s->waiting_room;
    s->waiting_count--;
    return id;
}

/* Grows the ring to `need`, keeping the queue's order. */
static int queue_grow(kvp_scheduler *s, size_t need)
{
    if (need <= s->waiting_room) {
        return 0;
    }
    uint64_t *linear = NULL;
    size_t room = 0;
    if (grow((void **)&linear, &room, need, sizeof *linear) != 0) {
        return -1;
    }
    for (size_t i = 0; i < s->waiting_count; i++) {
        linear[i] = s->waiting[queue_at(s, i)];
    }
    kvpi_free(s->waiting);
    s->waiting = linear;
    s->waiting_room = room;
    s->waiting_head = 0;
    return 0;
}

/* ---- leases ------------------------------------------------------------- */

static void lease_free(lease *l)
{
    if (l->sequence != NULL) {
        kvp_sequence_destroy(l->sequence, NULL);
    }
    for (size_t i = 0; l->caches != NULL && l->caches[i] != NULL; i++) {
        kvp_cache_destroy(l->caches[i], NULL);
    }
    kvpi_free(l->caches);
    kvpi_free(l->input);
    memset(l, 0, sizeof *l);
}

/* A new lease; on failure nothing is left allocated. */
static kvp_status lease_make(kvp_scheduler *s, lease *out, kvp_error *err)
{
    lease l;
    memset(&l, 0, sizeof l);
    l.input = kvpi_calloc(KVPI_SITE_SCRATCH, 2 * s->width, sizeof(double));
    if (l.input == NULL) {
        return kvpi_fail_alloc(err, "scheduler token buffers", 2 * s->width * sizeof(double));
    }
    l.output = l.input + s->width;
    kvp_status status = KVP_OK;
    if (s->config.compute) {
        status = kvp_sequence_create(s->model, s->pool, 1, s->config.capacity, &l.sequence, err);
    } else {
        l.caches = kvpi_calloc(KVPI_SITE_SCRATCH, s->layers + 1, sizeof *l.caches);
        if (l.caches == NULL) {
            status = kvpi_fail_alloc(err, "scheduler layer caches",
                                     (s->layers + 1) * sizeof *l.caches);
        }
        kvp_binding binding;
        if (status == KVP_OK) {
            status = kvp_binding_init_external(&binding, s->kv_heads, s->head_width,
                                               s->config.capacity, s->config.identity, 0, err);
        }
        for (size_t i = 0; status == KVP_OK && i < s->layers; i++) {
            status = kvp_cache_create(s->pool, &binding, 1, s->config.capacity, &l.caches[i], err);
        }
    }
    if (status != KVP_OK) {
        lease_free(&l);
        return status;
    }
    *out = l;
    return KVP_OK;
}

static size_t lease_len(const lease *l)
{
    return l->sequence != NULL ? kvp_sequence_len(l->sequence) : kvp_cache_len(l->caches[0]);
}

static size_t lease_pages_for(const kvp_scheduler *s, const lease *l, size_t tokens)
{
    if (l->sequence != NULL) {
        return kvp_sequence_pages_for(l->sequence, tokens);
    }
    size_t have = lease_len(l);
    size_t blocks = tokens / s->block_tokens + (tokens % s->block_tokens != 0);
    size_t held = have / s->block_tokens + (have % s->block_tokens != 0);
    return blocks > held ? s->layers * (blocks - held) : 0;
}

static kvp_status lease_promise(const kvp_scheduler *s, lease *l, size_t pages, kvp_error *err)
{
    if (l->sequence != NULL) {
        return kvp_sequence_promise(l->sequence, pages, err);
    }
    for (size_t i = 0; i < s->layers; i++) {
        kvp_status status = kvp_cache_promise(l->caches[i], pages / s->layers, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    return KVP_OK;
}

static void lease_reset(const kvp_scheduler *s, lease *l)
{
    /* A reset returns pages and promises; it cannot fail on a valid handle. */
    kvp_status status = KVP_OK;
    if (l->sequence != NULL) {
        status = kvp_sequence_reset(l->sequence, NULL);
    }
    for (size_t i = 0; l->sequence == NULL && i < s->layers; i++) {
        kvp_status layer = kvp_cache_reset(l->caches[i], NULL);
        status = status != KVP_OK ? status : layer;
    }
    assert(status == KVP_OK);
    (void)status;
}

/*
 * Compute off: `tokens` zero rows in every layer, all or nothing. Every
 * layer's pages are reserved first (a refusal discards the ones reserved);
 * then the rows are committed a block at a time, which cannot fail.
 */
static kvp_status lease_append_zeros(const kvp_scheduler *s, lease *l, size_t tokens,
                                     kvp_error *err)
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
    size_t block = s->block_tokens;
    for (size_t i = 0; i < s->layers; i++) {
        for (size_t done = 0; done < tokens; done += block) {
            size_t rows = tokens - done < block ? tokens - done : block;
            kvp_status status = kvp_cache_commit_rows(l->caches[i], s->zeros, s->zeros, rows, err);
            if (status != KVP_OK) {
                return status;
            }
        }
    }
    return KVP_OK;
}

/* ---- requests ----------------------------------------------------------- */

/* The prompt plus what it generated before a preemption: the tokens a prefill computes. */
static size_t prefill_tokens(const kvp_scheduler *s, uint64_t id)
{
    const record *r = &s->records[id];
    return r->request.prompt_tokens + r->generated;
}

/*
 * Tokens a request is admitted for: prefill_tokens and the decoding
 * reserve, but never more than its whole length. So a request whose whole
 * length fits an empty pool is always admitted once the pool empties.
 */
static size_t admission_tokens(const kvp_scheduler *s, uint64_t id)
{
    const record *r = &s->records[id];
    size_t tokens = prefill_tokens(s, id) + s->config.reserve_tokens;
    size_t whole = r->request.prompt_tokens + r->request.max_new_tokens;
    return tokens < whole ? tokens : whole;
}

static size_t whole_tokens(const kvp_scheduler *s, uint64_t id)
{
    const record *r = &s->records[id];
    return r->request.prompt_tokens + r->request.max_new_tokens;
}

/* Appends a finished request's result (room was made at the start of the step). */
static void finish(kvp_scheduler *s, uint64_t id, int rejected, kvp_status status,
                   const kvp_error *error)
{
    record *r = record_of(s, id);
    kvp_request_result *out = &s->done[s->done_count++];
    kvp_request_result_init(out);
    out->id = id;
    out->tokens_generated = r->generated;
    out->preemptions = r->preemptions;
    out->rejected = rejected;
    out->status = status;
    if (error != NULL) {
        out->error = *error;
    }
    r->state = STATE_FINISHED;
    if (rejected) {
        s->stats.rejected++;
    } else if (status != KVP_OK) {
        s->stats.failed++;
    } else {
        s->stats.completed++;
    }
}

/* Moves running slot i's lease to the idle list, reset (room was made first). */
static void retire_slot(kvp_scheduler *s, size_t i)
{
    lease l = s->running[i].lease;
    s->running[i] = s->running[--s->running_count];
    lease_reset(s, &l);
    s->idle[s->idle_count++] = l;
}

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

void kvp_request_result_init(kvp_request_result *result)
{
    if (result == NULL) {
        return;
    }
    memset(result, 0, sizeof *result);
    result->struct_size = sizeof *result;
}

void kvp_step_stats_init(kvp_step_stats *stats)
{
    if (stats == NULL) {
        return;
    }
    memset(stats, 0, sizeof *stats);
    stats->struct_size = sizeof *stats;
}

void kvp_scheduler_stats_init(kvp_scheduler_stats *stats)
{
    if (stats == NULL) {
        return;
    }
    memset(stats, 0, sizeof *stats);
    stats->struct_size = sizeof *stats;
}

/* The caller's config, checked: struct_size, then the watermark. */
static kvp_status config_read(const kvp_scheduler_config *caller, kvp_scheduler_config *config,
                              kvp_error *err)
{
    kvp_status status = kvpi_struct_size_check(caller->struct_size, sizeof *config, err);
    if (status == KVP_OK) {
        status = kvpi_struct_tail_check(caller, caller->struct_size, sizeof *config, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    *config = *caller;
    config->struct_size = sizeof *config;
    if (!(config->watermark >= 0.0 && config->watermark < 1.0)) {
        return kvpi_fail_invalid(err, "watermark", "must be in [0, 1)");
    }
    config->compute = config->compute != 0;
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
    kvpi_free(s->records);
    kvpi_free(s->waiting);
    kvpi_free(s->running);
    kvpi_free(s->idle);
    kvpi_free(s->done);
    kvpi_free(s->jobs);
    kvpi_free(s->rows);
    kvpi_free(s->zeros);
    kvpi_free(s->plan);
    kvpi_free(s);
}

kvp_status kvp_scheduler_create(const kvp_model *model, kvp_pool *pool, kvp_decoder *decoder,
                                const kvp_scheduler_config *cfg, kvp_scheduler **out,
                                kvp_error *err)
{
    if (model == NULL) {
        return kvpi_fail_null(err, "model");
    }
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    if (cfg == NULL) {
        return kvpi_fail_null(err, "cfg");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_scheduler_config config;
    kvp_status status = config_read(cfg, &config, err);
    if (status != KVP_OK) {
        return status;
    }
    if (config.compute && decoder == NULL) {
        return kvpi_fail_null(err, "decoder");
    }
    kvp_model_info info;
    kvp_model_info_init(&info);
    status = kvp_model_info_get(model, &info, err);
    if (status != KVP_OK) {
        return status;
    }
    kvp_pool_stats pool_stats;
    kvp_pool_stats_init(&pool_stats);
    status = kvp_pool_stats_get(pool, &pool_stats, err);
    if (status != KVP_OK) {
        return status;
    }
    kvp_scheduler *s = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *s);
    if (s == NULL) {
        return kvpi_fail_alloc(err, "scheduler", sizeof *s);
    }
    s->model = model;
    s->pool = pool;
    s->decoder = config.compute ? decoder : NULL;
    s->config = config;
    s->layers = info.layers;
    s->width = info.model_width;
    s->kv_heads = info.kv_heads;
    s->head_width = info.head_width;
    s->block_tokens = pool->block_tokens; /* fixed at the pool's creation */
    s->watermark_pages = (size_t)ceil(config.watermark * (double)pool_stats.total_pages);
    kvp_scheduler_stats_init(&s->stats);
    if (!config.compute) {
        size_t zeros = s->block_tokens * s->kv_heads * s->head_width;
        s->zeros = kvpi_calloc(KVPI_SITE_SCRATCH, zeros, sizeof *s->zeros);
        if (s->zeros == NULL) {
            scheduler_free(s);
            return kvpi_fail_alloc(err, "scheduler zero rows", zeros * sizeof(double));
        }
    }
    /* The first lease, made now: it checks the model and pool against each other. */
    if (grow((void **)&s->idle, &s->idle_room, 1, sizeof *s->idle) != 0) {
        scheduler_free(s);
        return kvpi_fail_alloc(err, "scheduler idle list", 16 * sizeof *s->idle);
    }
    status = lease_make(s, &s->idle[0], err);
    if (status != KVP_OK) {
        scheduler_free(s);
        return status;
    }
    s->idle_count = 1;
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
    kvp_status status = kvpi_struct_size_check(caller->struct_size, sizeof *request, err);
    if (status == KVP_OK) {
        status = kvpi_struct_tail_check(caller, caller->struct_size, sizeof *request, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    *request = *caller;
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
    if (request->samples > 1) {
        return kvpi_fail_invalid(err, "samples",
                                 "is not supported yet: parallel sampling needs fork");
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
    if (grow((void **)&s->records, &s->records_room, s->records_count + 1, sizeof *s->records) !=
            0 ||
        queue_grow(s, s->waiting_count + 1) != 0) {
        return kvpi_fail_alloc(err, "scheduler request records",
                               (s->records_count + 1) * sizeof *s->records);
    }
    uint64_t next = s->records_count++;
    record *r = &s->records[next];
    memset(r, 0, sizeof *r);
    r->request = copy;
    r->state = STATE_WAITING;
    queue_push_back(s, next);
    s->stats.submitted++;
    *id = next;
    return KVP_OK;
}

/* ---- public: step ------------------------------------------------------- */

/* The admission plan of one step: a prefix of the queue, each admitted or rejected. */
typedef struct plan {
    size_t popped;    /* queue entries the step takes */
    size_t admitted;  /* of which admitted (the rest rejected) */
    size_t rows;      /* prompt rows the admitted need (compute on) */
} plan;

/*
 * FCFS admission while the head of the queue fits now, decided without
 * changing anything: each request asks kvp_pool_admit for its pages plus
 * the pages promised to the ones planned before it.
 */
static kvp_status plan_admission(kvp_scheduler *s, plan *p, kvp_error *err)
{
    memset(p, 0, sizeof *p);
    size_t promised = 0;
    for (size_t i = 0; i < s->waiting_count; i++) {
        uint64_t id = s->waiting[queue_at(s, i)];
        if (s->config.max_running != 0 &&
            s->running_count + p->admitted >= s->config.max_running) {
            break;
        }
        size_t full = kvp_pool_pages_for(s->pool, s->layers, whole_tokens(s, id));
        size_t need = kvp_pool_pages_for(s->pool, s->layers, admission_tokens(s, id));
        kvp_admission whole;
        kvp_admission now;
        kvp_status status = kvp_pool_admit(s->pool, full, s->watermark_pages, &whole, err);
        if (status != KVP_OK) {
            return status;
        }
        if (whole == KVP_ADMIT_NEVER) {
            s->plan[p->popped++] = (planned){id, 0};
            continue;
        }
        size_t ask = need > SIZE_MAX - promised ? SIZE_MAX : need + promised;
        status = kvp_pool_admit(s->pool, ask, s->watermark_pages, &now, err);
        if (status != KVP_OK) {
            return status;
        }
        if (now != KVP_ADMIT_NOW) {
            break;
        }
        promised += need;
        s->plan[p->popped++] = (planned){id, 1};
        p->admitted++;
        p->rows += prefill_tokens(s, id);
    }
    return KVP_OK;
}

/*
 * Makes room for the worst case of this step and the leases and rows the
 * plan needs. New leases go to the idle list; on failure they are destroyed
 * again, so nothing changed.
 */
static kvp_status prepare(kvp_scheduler *s, const plan *p, kvp_error *err)
{
    size_t live = s->running_count + s->waiting_count;
    size_t leases = s->running_count + s->idle_count +
                    (p->admitted > s->idle_count ? p->admitted - s->idle_count : 0);
    if (grow((void **)&s->running, &s->running_room, live, sizeof *s->running) != 0 ||
        grow((void **)&s->idle, &s->idle_room, leases, sizeof *s->idle) != 0 ||
        grow((void **)&s->done, &s->done_room, s->done_count + live, sizeof *s->done) != 0 ||
        grow((void **)&s->jobs, &s->jobs_room, live, sizeof *s->jobs) != 0) {
        return kvpi_fail_alloc(err, "scheduler step arrays", live * sizeof(slot));
    }
    if (s->config.compute &&
        grow((void **)&s->rows, &s->rows_room, p->rows, s->width * sizeof *s->rows) != 0) {
        return kvpi_fail_alloc(err, "scheduler prompt rows", p->rows * s->width * sizeof(double));
    }
    size_t made = 0;
    while (s->idle_count < p->admitted) {
        kvp_status status = lease_make(s, &s->idle[s->idle_count], err);
        if (status != KVP_OK) {
            while (made-- > 0) {
                lease_free(&s->idle[--s->idle_count]);
            }
            return status;
        }
        s->idle_count++;
        made++;
    }
    return KVP_OK;
}

/* Pops the plan's prefix: rejected ones finish, admitted ones take a lease and a promise. */
static void admit(kvp_scheduler *s, const plan *p, kvp_step_stats *st)
{
    for (size_t i = 0; i < p->popped; i++) {
        uint64_t id = queue_pop_front(s);
        if (!s->plan[i].admit) {
            finish(s, id, 1, KVP_OK, NULL);
            st->rejected++;
            continue;
        }
        slot *r = &s->running[s->running_count++];
        r->lease = s->idle[--s->idle_count];
        r->id = id;
        r->admitted = s->admissions++;
        record_of(s, id)->state = STATE_RUNNING;
        st->admitted++;
    }
}

/* A running request failed: it finishes with the status, its pages go back. */
static void fail_slot(kvp_scheduler *s, size_t i, const kvp_error *error, kvp_step_stats *st)
{
    uint64_t id = s->running[i].id;
    retire_slot(s, i);
    finish(s, id, 0, error->status, error);
    st->failed++;
}

/* Fills request `id`'s rows [0, tokens) into `rows`. */
static void fill_rows(kvp_scheduler *s, uint64_t id, size_t tokens, double *rows)
{
    const kvp_request *q = &record_of(s, id)->request;
    size_t from_prompt = q->prompt != NULL ? q->prompt_tokens : 0;
    if (from_prompt > tokens) {
        from_prompt = tokens;
    }
    if (from_prompt > 0) {
        memcpy(rows, q->prompt, from_prompt * s->width * sizeof *rows);
    }
    for (size_t t = from_prompt; t < tokens; t++) {
        q->input(q->ctx, id, 0, t, rows + t * s->width, s->width);
    }
}

/*
 * Promises and prefills the running slots [first, running_count): with
 * compute, as one batch of decoder jobs. A job's failure fails its request.
 * A decoder refusal is returned, every slot still in place.
 */
static kvp_status prefill(kvp_scheduler *s, size_t first, kvp_step_stats *st, kvp_error *err)
{
    size_t count = s->running_count - first;
    if (count == 0) {
        return KVP_OK;
    }
    for (size_t i = first; i < s->running_count; i++) {
        slot *r = &s->running[i];
        size_t promise = kvp_pool_pages_for(s->pool, s->layers, admission_tokens(s, r->id));
        kvp_error e;
        memset(&e, 0, sizeof e);
        if (lease_promise(s, &r->lease, promise, &e) != KVP_OK) {
            /* Cannot happen: submit checked the length against the capacity. */
            if (err != NULL) {
                *err = e;
            }
            return e.status;
        }
    }
    if (!s->config.compute) {
        for (size_t i = first; i < s->running_count;) {
            slot *r = &s->running[i];
            size_t tokens = prefill_tokens(s, r->id);
            kvp_error e;
            memset(&e, 0, sizeof e);
            if (lease_append_zeros(s, &r->lease, tokens, &e) != KVP_OK) {
                fail_slot(s, i, &e, st);
                continue;
            }
            st->prefill_tokens += tokens;
            i++;
        }
        return KVP_OK;
    }
    double *row = s->rows;
    for (size_t i = first; i < s->running_count; i++) {
        slot *r = &s->running[i];
        size_t tokens = prefill_tokens(s, r->id);
        fill_rows(s, r->id, tokens, row);
        kvp_decode_job *job = &s->jobs[i - first];
        memset(job, 0, sizeof *job);
        job->kind = KVP_JOB_PREFILL;
        job->sequence = r->lease.sequence;
        job->input = kvp_tensor3(row, 1, tokens, s->width);
        row += tokens * s->width;
    }
    kvp_status status = kvp_decoder_step(s->decoder, s->jobs, count, NULL, NULL, err);
    if (status != KVP_OK) {
        return status;
    }
    /* Failed jobs retire from the back, so the slots of the jobs before stay put. */
    for (size_t j = count; j-- > 0;) {
        if (s->jobs[j].status != KVP_OK) {
            fail_slot(s, first + j, &s->jobs[j].error, st);
        } else {
            st->prefill_tokens += prefill_tokens(s, s->running[first + j].id);
        }
    }
    return KVP_OK;
}

/*
 * Undoes this step's admissions after the decoder refused the prefill batch
 * (nothing was prefilled): the admitted slots' leases go back to the idle
 * list, the rejections are withdrawn, and the popped ids return to the front
 * of the queue in their order.
 */
static void undo_admission(kvp_scheduler *s, const plan *p, size_t first, size_t done_before,
                           uint64_t admissions_before, kvp_step_stats *st)
{
    while (s->running_count > first) {
        retire_slot(s, s->running_count - 1);
    }
    s->stats.rejected -= s->done_count - done_before;
    s->done_count = done_before;
    for (size_t i = p->popped; i-- > 0;) {
        record_of(s, s->plan[i].id)->state = STATE_WAITING;
        queue_push_front(s, s->plan[i].id);
    }
    s->admissions = admissions_before;
    st->admitted = 0;
    st->rejected = 0;
}

static size_t free_pages(const kvp_scheduler *s)
{
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    return kvp_pool_stats_get(s->pool, &stats, NULL) == KVP_OK ? stats.free_pages : 0;
}

/* Preempts the most recently admitted sequences until this step's pages fit. */
static void make_room(kvp_scheduler *s, kvp_step_stats *st)
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
            return;
        }
        uint64_t id = s->running[newest].id;
        retire_slot(s, newest);
        record *r = record_of(s, id);
        r->state = STATE_WAITING;
        r->preemptions++;
        queue_push_front(s, id);
        s->stats.preemptions++;
        st->preempted++;
    }
}

/*
 * One token for every running sequence. A job's failure fails its request;
 * a decoder refusal is returned with nothing decoded. Then every decoded
 * token counts, its output goes to on_token, and finished requests retire.
 */
static kvp_status decode(kvp_scheduler *s, kvp_step_stats *st, kvp_error *err)
{
    size_t count = s->running_count;
    if (count == 0) {
        return KVP_OK;
    }
    for (size_t i = 0; i < count; i++) {
        kvp_decode_job *job = &s->jobs[i];
        memset(job, 0, sizeof *job);
        job->status = KVP_OK;
    }
    if (!s->config.compute) {
        for (size_t i = 0; i < count; i++) {
            s->jobs[i].status = lease_append_zeros(s, &s->running[i].lease, 1, &s->jobs[i].error);
        }
    } else {
        for (size_t i = 0; i < count; i++) {
            slot *r = &s->running[i];
            const kvp_request *q = &record_of(s, r->id)->request;
            size_t position = kvp_sequence_len(r->lease.sequence);
            q->input(q->ctx, r->id, 0, position, r->lease.input, s->width);
            kvp_decode_job *job = &s->jobs[i];
            job->sequence = r->lease.sequence;
            job->input = kvp_tensor3(r->lease.input, 1, 1, s->width);
            job->output = r->lease.output;
            job->output_len = s->width;
        }
        kvp_status status = kvp_decoder_step(s->decoder, s->jobs, count, NULL, NULL, err);
        if (status != KVP_OK) {
            return status;
        }
        for (size_t i = 0; i < count; i++) {
            slot *r = &s->running[i];
            const kvp_request *q = &record_of(s, r->id)->request;
            if (s->jobs[i].status == KVP_OK && q->on_token != NULL) {
                q->on_token(q->ctx, r->id, 0, kvp_sequence_len(r->lease.sequence) - 1,
                            r->lease.output, s->width);
            }
        }
    }
    /* Jobs follow the slots' order now; retiring moves slots, so each remembers its job. */
    for (size_t i = 0; i < count; i++) {
        s->running[i].job = i;
    }
    /* The last slot moves into a retired one's place and is visited next. */
    for (size_t i = 0; i < s->running_count;) {
        slot *r = &s->running[i];
        const kvp_decode_job *job = &s->jobs[r->job];
        if (job->status != KVP_OK) {
            fail_slot(s, i, &job->error, st);
            continue;
        }
        record *rec = record_of(s, r->id);
        rec->generated++;
        s->stats.tokens_generated++;
        st->decoded++;
        if (rec->generated < rec->request.max_new_tokens) {
            st->used_slots += s->layers * lease_len(&r->lease);
            i++;
            continue;
        }
        uint64_t id = r->id;
        retire_slot(s, i);
        finish(s, id, 0, KVP_OK, NULL);
        st->finished++;
    }
    return KVP_OK;
}

kvp_status kvp_scheduler_step(kvp_scheduler *scheduler, kvp_step_stats *stats, kvp_error *err)
{
    if (scheduler == NULL) {
        return kvpi_fail_null(err, "scheduler");
    }
    kvp_status status = KVP_OK;
    if (stats != NULL) {
        status = kvpi_struct_size_check(stats->struct_size, sizeof *stats, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    kvp_scheduler *s = scheduler;
    if (grow((void **)&s->plan, &s->plan_room, s->waiting_count, sizeof *s->plan) != 0) {
        return kvpi_fail_alloc(err, "scheduler admission plan",
                               s->waiting_count * sizeof *s->plan);
    }
    plan p;
    status = plan_admission(s, &p, err);
    if (status == KVP_OK) {
        status = prepare(s, &p, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    size_t first = s->running_count;
    size_t done_before = s->done_count;
    uint64_t admissions_before = s->admissions;
    admit(s, &p, &st);
    status = prefill(s, first, &st, err);
    if (status != KVP_OK) {
        undo_admission(s, &p, first, done_before, admissions_before, &st);
        return status;
    }
    s->stats.prefill_tokens += st.prefill_tokens;
    make_room(s, &st);
    size_t decoding = s->running_count;
    status = decode(s, &st, err);
    if (status != KVP_OK) {
        return status;
    }
    if (decoding > s->stats.peak_running) {
        s->stats.peak_running = decoding;
    }
    s->stats.steps++;
    kvp_pool_stats pool;
    kvp_pool_stats_init(&pool);
    if (kvp_pool_stats_get(s->pool, &pool, NULL) == KVP_OK) {
        st.held_pages = pool.held_pages;
        st.total_pages = pool.total_pages;
    }
    st.running = s->running_count;
    st.waiting = s->waiting_count;
    if (stats != NULL) {
        (void)kvpi_struct_out(stats, &st, sizeof st, sizeof st, NULL); /* checked above */
    }
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
        record_of(s, s->done[i].id)->state = STATE_COLLECTED;
    }
    memmove(s->done, s->done + take, (s->done_count - take) * sizeof *s->done);
    s->done_count -= take;
    *n = take;
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
    stats.held_samples = scheduler->running_count + scheduler->idle_count;
    return kvpi_struct_out(out, &stats, sizeof stats, sizeof stats, err);
}
