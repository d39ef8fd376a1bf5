/*
 * scheduler.c: continuous batching over one model, pool and decoder
 * (kvpager/scheduler.h has the schedule and the contracts).
 *
 * Owns: the request records (requests.c), the waiting queue (a ring of ids), the running
 * slots, the idle leases kept for reuse, the leases kept for sessions (5.
 * in the header: a finished request's sample 0 lease, pages held, until
 * its session's next request is admitted), the finished results awaiting
 * collection, the parked prompt keys of the request the last plan
 * stopped at, and (cache-aware schedule) those of the requests the last
 * ranks keyed. The model, pool and decoder are the caller's.
 *
 * Invariants:
 *   - a request is in exactly one of: waiting, running, finished (in `done`,
 *     not collected), collected;
 *   - every running slot holds one lease (a sequence, or with compute off
 *     one external cache per layer, plus its token buffers); finished and
 *     preempted leases are reset and kept in `idle`, so steady state
 *     allocates nothing per admission or per step. A lease is owned by
 *     exactly one place, a running slot, the idle list or the kept list
 *     (whose leases hold their pages and at most one per session;
 *     kept_refs[p] counts the kept leases naming page p, and kept_pages,
 *     the pages with a count, is at most kept_cap: a page two kept
 *     sequences share counts once);
 *   - a step allocates only before it changes anything: it first grows every
 *     array to what the worst case of this step needs (every waiting request
 *     admitted or rejected, every running one retired, the longest request
 *     that may complete keying its decoded blocks), plans the admissions
 *     without side effects (but parking the prompt keys of the request it
 *     stopped at: a cache that changes no decision), and makes the leases
 *     and prompt rows the plan needs. A failure there changes nothing;
 *     nor does a decoder refusal of the prefill batch: the step reserves
 *     the decoder's step slot before it admits. Idle leases bound to old
 *     weights are freed only once the step stands;
 *   - a request waiting at the head of the queue costs a step no rows and
 *     no hashing: the plan stops before them when even every adoptable
 *     block a hit would not be admitted now, and reuses its parked keys
 *     while the bindings they were made with are current; so does one in
 *     the cache-aware window (rank_window), whose keys stay in `ranked`;
 *   - the plan takes queue entries in its order (the queue's, or with the
 *     cache-aware schedule the window's rank, then the queue's), and
 *     admission removes them from the queue keeping the order of the rest;
 *   - a waiting request's `overtaken` counts the session requests placed
 *     ahead of it (queue_jump) and never passes KVP_SESSION_MAX_OVERTAKES:
 *     at the bound none goes ahead of it; cache-aware, its `skips` counts
 *     the steps that admitted a request behind it from the window, up to
 *     KVP_SCHEDULE_MAX_SKIPS, from which the window ranks it first;
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
#include "pager/cache_internal.h"
#include "pager/pool_internal.h"
#include "serve/decoder_internal.h"
#include "serve/requests_internal.h"
#include "serve/sequence_internal.h"
#include "serve/share_internal.h"

/* A record's state; a collected request has no record (requests_internal.h). */
enum { STATE_WAITING, STATE_RUNNING, STATE_FINISHED };

typedef kvpi_record record;

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
    size_t pos;        /* its position in the queue at the plan */
    int admit;
    size_t rows;       /* its rows start at s->rows + rows * width (layout: rows_needed) */
    size_t keys;       /* its prefix keys start at s->keys + keys */
    size_t key_blocks; /* prompt blocks keyed: the full ones within the capacity; 0: no keys */
    size_t adopted;    /* tokens adopted from the prefix index (set when it is prefilled) */
} planned;

/* A finished request's sample 0 lease, its pages held for its session's next request (5.). */
typedef struct kept_lease {
    uint64_t session;
    uint64_t expires; /* the step count (stats.steps) from which it is given back */
    size_t pages;     /* the pages its page tables name (shared ones included) */
    lease lease;
} kept_lease;

typedef struct slot {
    lease lease;
    uint64_t id;
    size_t sample;     /* 0 .. samples - 1 */
    uint64_t admitted; /* admission order, one per request; the largest is preempted first */
    size_t job;        /* its job in this step, or NO_JOB */
} slot;

#define NO_JOB SIZE_MAX
#define NO_REQUEST UINT64_MAX
#define MAX_SAMPLES 256
#define WINDOW KVP_SCHEDULE_WINDOW

/*
 * The prompt keys of one request, kept across steps: `count` keys, then the
 * `layers` binding digests of the lease that made them. Valid for request
 * `id` while idle[0]'s digests are the same (the rows are the same: the
 * input callback is deterministic).
 */
typedef struct keyset {
    uint64_t id; /* NO_REQUEST: none */
    kvp_block_key *keys;
    size_t count;
    size_t room;
} keyset;

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

    kvpi_requests requests; /* the records of the requests not yet collected, by id */
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
    kept_lease *kept;  /* sessions' kept leases, oldest first */
    size_t kept_count;
    size_t kept_room;
    size_t kept_pages; /* the distinct pages their tables name */
    size_t kept_cap;   /* config.session_fraction of the pool's pages */
    uint32_t *kept_refs; /* [pool pages] with sessions: kept leases naming each page */
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
    kvp_block_key *keys; /* the step's prefix keys, back to back (share_internal.h layout) */
    size_t keys_room;
    /* The prompt keys of the request the last plan stopped at (it waits at
       the head of the queue, usually for several steps). */
    keyset parked;
    /* Cache-aware: those of the requests the last ranks keyed (rank_window). */
    keyset ranked[WINDOW];
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

/* The record of request `id`, held: waiting, running or finished, not collected. */
static record *record_of(const kvp_scheduler *s, uint64_t id)
{
    record *r = kvpi_requests_find(&s->requests, id);
    assert(r != NULL);
    return r;
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

/*
 * A session's request whose sequence is kept (5.): at the front of the
 * queue, but behind every waiting request overtaken
 * KVP_SESSION_MAX_OVERTAKES times already; each request it goes ahead of
 * counts one more overtaking. So no waiting request is overtaken more than
 * KVP_SESSION_MAX_OVERTAKES times by session requests (the bound of
 * scheduler.h, 5.). Room was made first.
 */
static void queue_jump(kvp_scheduler *s, uint64_t id)
{
    size_t at = 0;
    for (size_t i = 0; i < s->waiting_count; i++) {
        const record *r = record_of(s, s->waiting[queue_at(s, i)]);
        if (r->overtaken >= KVP_SESSION_MAX_OVERTAKES) {
            at = i + 1;
        }
    }
    for (size_t i = at; i < s->waiting_count; i++) {
        record_of(s, s->waiting[queue_at(s, i)])->overtaken++;
    }
    s->waiting_count++;
    for (size_t i = s->waiting_count - 1; i > at; i--) {
        s->waiting[queue_at(s, i)] = s->waiting[queue_at(s, i - 1)];
    }
    s->waiting[queue_at(s, at)] = id;
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

/* The lease's layer caches, one per layer. */
static kvp_cache *const *lease_caches(const lease *l)
{
    return l->sequence != NULL ? l->sequence->caches : l->caches;
}

/* New pages to grow to `tokens`, copy-on-write copies included. */
static size_t lease_pages_for(const kvp_scheduler *s, const lease *l, size_t tokens)
{
    if (l->sequence != NULL) {
        return kvp_sequence_pages_for(l->sequence, tokens);
    }
    size_t pages = 0;
    for (size_t i = 0; i < s->layers; i++) {
        pages += kvp_cache_pages_for(l->caches[i], tokens);
    }
    return pages;
}

/* 1 when a layer's cache is bound to a parameter revision that is no longer current. */
static int lease_stale(const kvp_scheduler *s, const lease *l)
{
    if (l->sequence == NULL) {
        return 0; /* external caches bind the configured identity: never stale */
    }
    (void)s;
    return kvpi_sequence_stale(l->sequence);
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
    /*
     * External caches: promises to 0, then every layer at once, so pages go
     * back (to the free or evictable list) in the order a sequence's reset
     * gives them back: both runs see the same LRU order. No rows are
     * reserved between steps (lease_append_zeros commits or discards).
     */
    for (size_t i = 0; l->sequence == NULL && i < s->layers; i++) {
        kvp_status layer = kvp_cache_promise(l->caches[i], 0, NULL);
        status = status != KVP_OK ? status : layer;
    }
    if (l->sequence == NULL) {
        kvpi_cache_truncate_many(l->caches, s->layers, 0);
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

static size_t blocks_of(const kvp_scheduler *s, size_t tokens)
{
    return tokens / s->block_tokens + (tokens % s->block_tokens != 0);
}

/*
 * Tokens each sample is admitted for past the prompt: what it generated
 * before a preemption plus the decoding reserve, but never more than its
 * budget. So a request whose whole length fits an empty pool is always
 * admitted once the pool empties.
 */
static size_t sample_tokens(const kvp_scheduler *s, const record *r)
{
    size_t tokens = r->generated + s->config.reserve_tokens;
    return tokens < r->request.max_new_tokens ? tokens : r->request.max_new_tokens;
}

/*
 * Pages one forked sample takes past the prompt's full blocks (its copy of a
 * partial one too). Sample 0 writes the partial page in place (prefill_forks):
 * n samples, n - 1 copies.
 */
static size_t sample_pages(const kvp_scheduler *s, const record *r, size_t past_prompt)
{
    size_t prompt = r->request.prompt_tokens;
    return s->layers * (blocks_of(s, prompt + past_prompt) - prompt / s->block_tokens);
}

/*
 * Pages a request newly takes to hold `past_prompt` tokens per sample when
 * `hits` prompt blocks are adopted: shared pages counted once. One sample:
 * its own blocks. Forked samples: sample 0's own blocks (it writes the
 * partial prompt page in place), plus each other sample's blocks past the
 * prompt's full ones (its copy). Sharing off: every sample its own.
 */
static size_t request_pages(const kvp_scheduler *s, const record *r, size_t past_prompt,
                            size_t hits)
{
    size_t prompt = r->request.prompt_tokens;
    size_t n = r->request.samples;
    size_t own = s->layers * blocks_of(s, prompt + past_prompt);
    if (n == 1) {
        return own - s->layers * hits;
    }
    if (s->config.sharing) {
        return s->layers * (blocks_of(s, prompt + past_prompt) - hits) +
               (n - 1) * sample_pages(s, r, past_prompt);
    }
    return n * own;
}

/* 1 when the request's prompt rows can be keyed (sharing on, and rows to read). */
static int keyed(const kvp_scheduler *s, const kvp_request *q)
{
    return s->config.sharing && (s->config.compute || q->prompt != NULL || q->input != NULL);
}

/* 1 when a completed request publishes its decoded blocks (sharing on, and their rows to key). */
static int publishes(const kvp_scheduler *s, const kvp_request *q)
{
    return s->config.sharing && q->input != NULL;
}

/*
 * The rows a request's admission reads, back to back:
 *   compute, sharing on: the prompt, then each sample's generated tokens;
 *   compute, sharing off: each sample's prompt and generated tokens;
 *   compute off: the prompt when it is keyed (its keys), else nothing.
 */
static size_t rows_needed(const kvp_scheduler *s, const record *r)
{
    const kvp_request *q = &r->request;
    if (!s->config.compute) {
        return keyed(s, q) ? q->prompt_tokens : 0;
    }
    if (s->config.sharing) {
        return q->prompt_tokens + q->samples * r->generated;
    }
    return q->samples * (q->prompt_tokens + r->generated);
}

/* Request `id`'s rows [from, to) of sample `sample` into `rows` (prompt rows are sample 0's). */
static void fill_rows(kvp_scheduler *s, uint64_t id, size_t sample, size_t from, size_t to,
                      double *rows)
{
    const kvp_request *q = &record_of(s, id)->request;
    for (size_t t = from; t < to; t++) {
        double *row = rows + (t - from) * s->width;
        if (t < q->prompt_tokens && q->prompt != NULL) {
            memcpy(row, q->prompt + t * s->width, s->width * sizeof *row);
        } else {
            q->input(q->ctx, id, t < q->prompt_tokens ? 0 : sample, t, row, s->width);
        }
    }
}

/* Fills request `id`'s rows in the rows_needed layout. */
static void fill_request(kvp_scheduler *s, uint64_t id, double *rows)
{
    const record *r = record_of(s, id);
    size_t prompt = r->request.prompt_tokens;
    size_t g = r->generated;
    if (!s->config.compute || s->config.sharing) {
        if (rows_needed(s, r) == 0) {
            return;
        }
        fill_rows(s, id, 0, 0, prompt, rows);
        for (size_t k = 0; s->config.compute && k < r->request.samples; k++) {
            fill_rows(s, id, k, prompt, prompt + g, rows + (prompt + k * g) * s->width);
        }
        return;
    }
    for (size_t k = 0; k < r->request.samples; k++) {
        fill_rows(s, id, k, 0, prompt + g, rows + k * (prompt + g) * s->width);
    }
}

/* Appends a finished request's result (room was made at the start of the step). */
static void finish(kvp_scheduler *s, uint64_t id, int rejected, kvp_status status,
                   const kvp_error *error)
{
    record *r = record_of(s, id);
    kvp_request_result *out = &s->done[s->done_count++];
    kvp_request_result_init(out);
    out->id = id;
    out->tokens_generated = r->generated * r->request.samples;
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
    record_of(s, s->running[i].id)->slots--;
    s->running[i] = s->running[--s->running_count];
    lease_reset(s, &l);
    s->idle[s->idle_count++] = l;
}

/* Retires every running slot of request `id`, from the back. */
static void retire_request(kvp_scheduler *s, uint64_t id)
{
    for (size_t i = s->running_count; i-- > 0;) {
        if (s->running[i].id == id) {
            retire_slot(s, i);
        }
    }
}

/* ---- sessions (5.) ------------------------------------------------------ */

/*
 * Kept pages, each once (5.): kept_refs[p] counts the kept leases whose
 * tables name page p, and kept_pages the pages with a count. A kept lease
 * changes no table while kept, so adding it on keeping and removing it on
 * giving back (before its reset) costs only its own pages, and allocates
 * nothing (kept_refs is made with the scheduler).
 */
static void kept_refs_add(kvp_scheduler *s, const lease *l, int delta)
{
    kvp_cache *const *caches = lease_caches(l);
    for (size_t i = 0; i < s->layers; i++) {
        const uint32_t *table = kvpi_cache_lane_table(caches[i], 0);
        size_t blocks = kvpi_cache_mapped_blocks(caches[i]);
        for (size_t b = 0; b < blocks; b++) {
            uint32_t *refs = &s->kept_refs[table[b]];
            if (delta > 0) {
                s->kept_pages += (*refs)++ == 0;
            } else {
                s->kept_pages -= --(*refs) == 0;
            }
        }
    }
}

/* The pages lease l's tables name that no kept lease names (what keeping it adds). */
static size_t kept_refs_new(const kvp_scheduler *s, const lease *l)
{
    size_t pages = 0;
    kvp_cache *const *caches = lease_caches(l);
    for (size_t i = 0; i < s->layers; i++) {
        const uint32_t *table = kvpi_cache_lane_table(caches[i], 0);
        size_t blocks = kvpi_cache_mapped_blocks(caches[i]);
        for (size_t b = 0; b < blocks; b++) {
            pages += s->kept_refs[table[b]] == 0;
        }
    }
    return pages;
}

/*
 * Gives kept lease i back: reset (its pages become evictable, still
 * indexed), to the idle list (room was made first). `used`: a request of
 * its session was admitted and adopted what it holds.
 */
static void drop_kept(kvp_scheduler *s, size_t i, int used)
{
    kept_lease *k = &s->kept[i];
    kept_refs_add(s, &k->lease, -1);
    lease_reset(s, &k->lease);
    s->idle[s->idle_count++] = k->lease;
    if (used) {
        s->stats.session_hits++;
    } else {
        s->stats.session_drops++;
    }
    memmove(k, k + 1, (s->kept_count - i - 1) * sizeof *k);
    s->kept_count--;
}

/* The kept lease of `session`, or SIZE_MAX. */
static size_t kept_of(const kvp_scheduler *s, uint64_t session)
{
    for (size_t i = 0; i < s->kept_count; i++) {
        if (s->kept[i].session == session) {
            return i;
        }
    }
    return SIZE_MAX;
}

/*
 * Request `id` completed (and published): its sample 0 lease leaves the
 * running slots for the kept list when its request names a session and
 * sessions are on, replacing the session's older one and giving back the
 * oldest while the kept pages would pass kept_cap (room was made first).
 */
static void keep_session(kvp_scheduler *s, uint64_t id)
{
    record *rec = record_of(s, id);
    const kvp_request *q = &rec->request;
    if (q->session == 0 || s->config.session_ttl == 0 || !publishes(s, q)) {
        return;
    }
    size_t i = 0;
    while (s->running[i].id != id || s->running[i].sample != 0) {
        i++; /* a completed request holds its sample 0 slot */
    }
    const lease *l = &s->running[i].lease;
    size_t pages = s->layers * blocks_of(s, lease_len(l));
    if (lease_stale(s, l) || pages > s->kept_cap) {
        return;
    }
    size_t old = kept_of(s, q->session);
    if (old != SIZE_MAX) {
        drop_kept(s, old, 0);
    }
    while (s->kept_pages + kept_refs_new(s, l) > s->kept_cap) {
        drop_kept(s, 0, 0); /* ends: with none kept, its own pages fit the cap */
    }
    kept_lease *k = &s->kept[s->kept_count++];
    k->session = q->session;
    uint64_t ttl = s->config.session_ttl;
    /* Saturating: the largest ttls never expire rather than wrap to now. */
    k->expires = ttl < UINT64_MAX - 1 - s->stats.steps ? s->stats.steps + 1 + ttl : UINT64_MAX;
    k->pages = pages;
    k->lease = *l;
    kept_refs_add(s, l, 1);
    s->stats.session_keeps++;
    rec->slots--;
    s->running[i] = s->running[--s->running_count];
}

/*
 * At the end of a step that admitted `admitted` requests: the kept leases
 * whose time is up at the next step or whose parameters changed go back;
 * and all of them when the step admitted nothing and nothing runs while
 * requests wait, so kept pages never stall the queue.
 */
static void drop_sessions(kvp_scheduler *s, size_t admitted)
{
    int stalled = admitted == 0 && s->running_count == 0 && s->waiting_count > 0;
    for (size_t i = s->kept_count; i-- > 0;) {
        const kept_lease *k = &s->kept[i];
        if (stalled || k->expires <= s->stats.steps || lease_stale(s, &k->lease)) {
            drop_kept(s, i, 0);
        }
    }
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
    config->session_fraction = 0.5;
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
    kvpi_free(s->kept);
    kvpi_free(s->kept_refs);
    kvpi_requests_free(&s->requests);
    kvpi_free(s->waiting);
    kvpi_free(s->running);
    kvpi_free(s->idle);
    kvpi_free(s->done);
    kvpi_free(s->jobs);
    kvpi_free(s->rows);
    kvpi_free(s->zeros);
    kvpi_free(s->plan);
    kvpi_free(s->keys);
    kvpi_free(s->parked.keys);
    for (size_t i = 0; i < WINDOW; i++) {
        kvpi_free(s->ranked[i].keys);
    }
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
    s->kept_cap = (size_t)floor(config.session_fraction * (double)pool_stats.total_pages);
    kvp_scheduler_stats_init(&s->stats);
    kvpi_requests_init(&s->requests);
    s->parked.id = NO_REQUEST;
    for (size_t i = 0; i < WINDOW; i++) {
        s->ranked[i].id = NO_REQUEST;
    }
    if (config.session_ttl > 0) {
        size_t pages = pool_stats.total_pages;
        s->kept_refs = kvpi_calloc(KVPI_SITE_SCRATCH, pages, sizeof *s->kept_refs);
        if (s->kept_refs == NULL) {
            scheduler_free(s);
            return kvpi_fail_alloc(err, "scheduler kept page counts", pages * sizeof(uint32_t));
        }
    }
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
    if (kvpi_requests_reserve(&s->requests, 1) != 0 || queue_grow(s, s->waiting_count + 1) != 0) {
        return kvpi_fail_alloc(err, "scheduler request records",
                               (s->requests.live + 1) * sizeof(record));
    }
    record *r = kvpi_requests_add(&s->requests);
    uint64_t next = r->id;
    r->request = copy;
    r->state = STATE_WAITING;
    /* A session's next request goes ahead while its sequence is kept, current (5.). */
    size_t k = copy.session != 0 ? kept_of(s, copy.session) : SIZE_MAX;
    if (k != SIZE_MAX && !lease_stale(s, &s->kept[k].lease)) {
        queue_jump(s, next);
    } else {
        queue_push_back(s, next);
    }
    s->stats.submitted++;
    *id = next;
    return KVP_OK;
}

/* ---- public: step ------------------------------------------------------- */

/* The admission plan of one step: a prefix of the queue, each admitted or rejected. */
typedef struct plan {
    size_t popped;    /* queue entries the step takes */
    size_t admitted;  /* of which admitted (the rest rejected) */
    size_t slots;     /* sequences the admitted take: their samples */
    size_t span;      /* the entries taken lie in queue positions [0, span) */
    size_t window;    /* cache-aware: queue positions ranked (0: FCFS, the queue's order) */
    size_t order[WINDOW]; /* the window's positions in the order the plan considers them */
    uint64_t ids[WINDOW]; /* the window's ids, by queue position */
} plan;

static size_t add_sat(size_t a, size_t b)
{
    return a > SIZE_MAX - b ? SIZE_MAX : a + b;
}

/* idle[0]'s binding digest of layer l: what a request's prompt keys depend on besides its rows. */
static kvp_block_key binding_digest(const kvp_scheduler *s, size_t l)
{
    return kvpi_cache_binding_key(lease_caches(&s->idle[0])[l]);
}

/*
 * Keeps the `count` prompt keys of request `id` in `set` for the next plans
 * (the request the plan stops at: s->parked; one the cache-aware rank keyed:
 * a slot of s->ranked). Best effort: when the room cannot grow, nothing is
 * kept.
 */
static void park_keys(kvp_scheduler *s, keyset *set, uint64_t id, const kvp_block_key *keys,
                      size_t count)
{
    if (count == 0 || set->id == id) {
        return; /* nothing keyed, or parked already (unpark_keys checked the digests) */
    }
    set->id = NO_REQUEST;
    if (grow((void **)&set->keys, &set->room, count + s->layers, sizeof *set->keys) != 0) {
        return;
    }
    memcpy(set->keys, keys, count * sizeof *keys);
    for (size_t l = 0; l < s->layers; l++) {
        set->keys[count + l] = binding_digest(s, l);
    }
    set->id = id;
    set->count = count;
}

/* 1 when `set` holds request `id`'s `count` keys, made under the bindings idle[0] has now. */
static int keyset_valid(const kvp_scheduler *s, const keyset *set, uint64_t id, size_t count)
{
    if (set->id != id || set->count != count) {
        return 0;
    }
    for (size_t l = 0; l < s->layers; l++) {
        kvp_block_key now = binding_digest(s, l);
        if (now.lo != set->keys[count + l].lo || now.hi != set->keys[count + l].hi) {
            return 0; /* a weight update since: the keys would differ */
        }
    }
    return 1;
}

/*
 * 1 when request `id`'s prompt keys are parked (s->parked, or a slot of
 * s->ranked), made under the bindings idle[0] has now, and copied to
 * `keys`; 0 when they must be computed. The same id, rows and bindings give
 * the same keys (kvpi_prompt_keys reads nothing else), so no admission
 * changes: the plan only skips the rows and the hashing a waiting request
 * would redo.
 */
static int unpark_keys(const kvp_scheduler *s, uint64_t id, kvp_block_key *keys, size_t count)
{
    const keyset *set = keyset_valid(s, &s->parked, id, count) ? &s->parked : NULL;
    for (size_t i = 0; set == NULL && i < WINDOW; i++) {
        set = keyset_valid(s, &s->ranked[i], id, count) ? &s->ranked[i] : NULL;
    }
    if (set == NULL) {
        return 0;
    }
    memcpy(keys, set->keys, count * sizeof *keys);
    return 1;
}

/*
 * The prompt blocks request `q`'s keys cover (0: not keyed), and in
 * *adoptable those it may adopt (the last prompt token is always computed).
 */
static size_t key_blocks_of(const kvp_scheduler *s, const kvp_request *q, size_t *adoptable)
{
    size_t bt = s->block_tokens;
    *adoptable = 0;
    if (!keyed(s, q)) {
        return 0;
    }
    size_t key_blocks = q->prompt_tokens / bt;
    if (key_blocks > s->config.capacity / bt) {
        key_blocks = s->config.capacity / bt;
    }
    size_t a = (q->prompt_tokens - 1) / bt;
    *adoptable = a < key_blocks ? a : key_blocks;
    return key_blocks;
}

/*
 * The slot of s->ranked for request `id`: its own, else one no request of
 * the window `ids` ([n], n <= WINDOW) holds (there is one: the window's
 * other requests hold at most n - 1).
 */
static keyset *ranked_slot(kvp_scheduler *s, uint64_t id, const uint64_t *ids, size_t n)
{
    for (size_t i = 0; i < WINDOW; i++) {
        if (s->ranked[i].id == id) {
            return &s->ranked[i];
        }
    }
    for (size_t i = 0; i < WINDOW; i++) {
        int held = 0;
        for (size_t j = 0; j < n && !held; j++) {
            held = s->ranked[i].id == ids[j];
        }
        if (!held) {
            return &s->ranked[i];
        }
    }
    return &s->ranked[0]; /* not reached */
}

/*
 * Cache-aware: the order the plan considers the first WINDOW queue
 * positions in (p->order, p->window). First those preempted (they wait at
 * the front of the queue), never fitting (rejected at once) or overtaken in
 * KVP_SCHEDULE_MAX_SKIPS steps, in queue order; then the others by the
 * prompt blocks the prefix index holds now, most first, in queue order on
 * ties. A request whose best case (every adoptable block a hit) is not
 * admitted now counts 0 hits and costs no rows or hashing, as at the head
 * under FCFS; the keys computed go to s->ranked for the next steps. Changes
 * nothing else (the scratch grows: ALLOCATION_FAILED changes nothing).
 */
static kvp_status rank_window(kvp_scheduler *s, plan *p, kvp_error *err)
{
    size_t n = s->waiting_count < WINDOW ? s->waiting_count : WINDOW;
    int first[WINDOW]; /* 1: goes first, in queue order; 0: ranked by hits */
    size_t hits[WINDOW];
    for (size_t i = 0; i < n; i++) {
        p->ids[i] = s->waiting[queue_at(s, i)];
    }
    for (size_t i = 0; i < n; i++) {
        uint64_t id = p->ids[i];
        const record *r = record_of(s, id);
        const kvp_request *q = &r->request;
        kvp_admission whole;
        kvp_status status = kvp_pool_admit(s->pool, request_pages(s, r, q->max_new_tokens, 0),
                                           s->watermark_pages, &whole, err);
        if (status != KVP_OK) {
            return status;
        }
        first[i] = r->preemptions > 0 || r->skips >= KVP_SCHEDULE_MAX_SKIPS ||
                   whole == KVP_ADMIT_NEVER;
        hits[i] = 0;
        size_t adoptable;
        size_t key_blocks = key_blocks_of(s, q, &adoptable);
        if (first[i] || key_blocks == 0) {
            continue;
        }
        kvp_admission best;
        status = kvp_pool_admit(s->pool, request_pages(s, r, sample_tokens(s, r), adoptable),
                                s->watermark_pages, &best, err);
        if (status != KVP_OK) {
            return status;
        }
        if (best != KVP_ADMIT_NOW) {
            continue;
        }
        size_t key_count = kvpi_prompt_keys_count(s->layers, 1, key_blocks);
        if (grow((void **)&s->keys, &s->keys_room, key_count, sizeof *s->keys) != 0 ||
            grow((void **)&s->rows, &s->rows_room, rows_needed(s, r),
                 s->width * sizeof *s->rows) != 0) {
            return kvpi_fail_alloc(err, "scheduler prefix keys", key_count * sizeof *s->keys);
        }
        if (!unpark_keys(s, id, s->keys, key_count)) {
            fill_request(s, id, s->rows);
            kvpi_prompt_keys(lease_caches(&s->idle[0]), s->layers, &q->salt, s->rows,
                             q->prompt_tokens, s->width, key_blocks, s->keys);
            park_keys(s, ranked_slot(s, id, p->ids, n), id, s->keys, key_count);
        }
        size_t evictable;
        hits[i] = kvpi_prefix_probe(s->pool, s->keys, s->layers, adoptable, &evictable);
    }
    /* Insertion sort by (first desc, hits desc, position asc): stable, n <= WINDOW. */
    for (size_t i = 0; i < n; i++) {
        size_t j = i;
        while (j > 0) {
            size_t b = p->order[j - 1];
            int ahead = first[i] != first[b] ? first[i] > first[b]
                                             : !first[i] && hits[i] > hits[b];
            if (!ahead) {
                break;
            }
            p->order[j] = b;
            j--;
        }
        p->order[j] = i;
    }
    p->window = n;
    return KVP_OK;
}

/*
 * Admission while the next request fits now, decided without changing
 * anything. The order: the queue's (FCFS), or with the cache-aware schedule
 * the window's rank (rank_window), then the queue's past the window. Each
 * request each request asks kvp_pool_admit for the pages it
 * will newly take (its prompt pages not covered by the prefix the index
 * holds now, plus the evictable pages adopting that prefix takes from the
 * available ones, plus its samples' pages) plus what the requests planned
 * before it in this step asked. The rows each admitted request's prefill
 * reads, and its prompt keys, are made here (the scratch grows: an
 * ALLOCATION_FAILED still changes nothing); the keys of the request it
 * stops at are parked for the next plans (park_keys). Needs a lease with current
 * bindings in idle[0] when a request is keyed (kvp_scheduler_step makes one).
 */
static kvp_status plan_admission(kvp_scheduler *s, plan *p, kvp_error *err)
{
    memset(p, 0, sizeof *p);
    if (s->config.schedule == KVP_SCHEDULE_CACHE_AWARE) {
        kvp_status status = rank_window(s, p, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    size_t asked = 0;
    size_t rows = 0;
    size_t keys = 0;
    for (size_t i = 0; i < s->waiting_count; i++) {
        size_t pos = i < p->window ? p->order[i] : i;
        uint64_t id = s->waiting[queue_at(s, pos)];
        const record *r = record_of(s, id);
        const kvp_request *q = &r->request;
        size_t busy = s->running_count + p->slots;
        /* A request with more samples than max_running runs alone. */
        if (s->config.max_running != 0 && busy + q->samples > s->config.max_running &&
            busy > 0) {
            break;
        }
        size_t full = request_pages(s, r, q->max_new_tokens, 0);
        kvp_admission whole;
        kvp_admission now;
        kvp_status status = kvp_pool_admit(s->pool, full, s->watermark_pages, &whole, err);
        if (status != KVP_OK) {
            return status;
        }
        if (whole == KVP_ADMIT_NEVER) {
            s->plan[p->popped++] = (planned){id, pos, 0, 0, 0, 0, 0};
            p->span = pos + 1 > p->span ? pos + 1 : p->span;
            continue;
        }
        size_t adoptable; /* the prompt blocks it may adopt */
        size_t key_blocks = key_blocks_of(s, q, &adoptable);
        /*
         * The best case first: every adoptable block a hit, no evictable
         * page taken. The pages asked below are at least these (fewer hits
         * ask more, evictable ones add), and kvp_pool_admit is monotone in
         * the pages asked, so when even the best case is not NOW the request
         * is not admitted now: stop before reading and hashing its rows.
         */
        status = kvp_pool_admit(s->pool,
                                add_sat(request_pages(s, r, sample_tokens(s, r), adoptable),
                                        asked),
                                s->watermark_pages, &now, err);
        if (status != KVP_OK) {
            return status;
        }
        if (now != KVP_ADMIT_NOW) {
            break;
        }
        size_t need_rows = rows_needed(s, r);
        if (grow((void **)&s->rows, &s->rows_room, rows + need_rows,
                 s->width * sizeof *s->rows) != 0) {
            return kvpi_fail_alloc(err, "scheduler prompt rows",
                                   (rows + need_rows) * s->width * sizeof(double));
        }
        /* NULL when it reads no rows (allocator-only, nothing keyed): never NULL + 0 */
        double *at = need_rows != 0 ? s->rows + rows * s->width : NULL;
        int filled = 0;
        size_t key_count = 0;
        size_t hits = 0;
        size_t evictable = 0;
        if (key_blocks != 0) {
            key_count = kvpi_prompt_keys_count(s->layers, 1, key_blocks);
            if (grow((void **)&s->keys, &s->keys_room, keys + key_count, sizeof *s->keys) != 0) {
                return kvpi_fail_alloc(err, "scheduler prefix keys",
                                       (keys + key_count) * sizeof *s->keys);
            }
            kvp_block_key *k = s->keys + keys;
            if (!unpark_keys(s, id, k, key_count)) {
                fill_request(s, id, at);
                filled = 1;
                kvpi_prompt_keys(lease_caches(&s->idle[0]), s->layers, &q->salt, at,
                                 q->prompt_tokens, s->width, key_blocks, k);
            }
            hits = kvpi_prefix_probe(s->pool, k, s->layers, adoptable, &evictable);
        }
        size_t need = add_sat(request_pages(s, r, sample_tokens(s, r), hits), evictable);
        status = kvp_pool_admit(s->pool, add_sat(need, asked), s->watermark_pages, &now, err);
        if (status != KVP_OK) {
            return status;
        }
        if (now != KVP_ADMIT_NOW) {
            park_keys(s, &s->parked, id, s->keys + keys, key_count);
            break;
        }
        if (!filled) {
            fill_request(s, id, at);
        }
        asked = add_sat(asked, need);
        s->plan[p->popped++] = (planned){id, pos, 1, rows, keys, key_blocks, 0};
        p->span = pos + 1 > p->span ? pos + 1 : p->span;
        rows += need_rows;
        keys += key_count;
        p->admitted++;
        p->slots += q->samples;
    }
    return KVP_OK;
}

/*
 * The longest request that may complete in this step's decode and publish
 * its decoded blocks (publish_decoded): the running and newly admitted
 * requests one token short of their budget. 0: none.
 */
static size_t publish_tokens(const kvp_scheduler *s, const plan *p)
{
    size_t longest = 0;
    for (size_t i = 0; i < s->running_count + p->popped; i++) {
        uint64_t id;
        if (i < s->running_count) {
            id = s->running[i].id;
        } else if (s->plan[i - s->running_count].admit) {
            id = s->plan[i - s->running_count].id;
        } else {
            continue;
        }
        const record *r = record_of(s, id);
        const kvp_request *q = &r->request;
        size_t len = q->prompt_tokens + q->max_new_tokens; /* within the capacity */
        if (publishes(s, q) && r->generated + 1 >= q->max_new_tokens && len > longest) {
            longest = len;
        }
    }
    return longest;
}

/* The idle leases bound to parameters that changed (kvp_scheduler_step frees them). */
static size_t stale_idle(const kvp_scheduler *s)
{
    size_t stale = 0;
    for (size_t i = 0; i < s->idle_count; i++) {
        stale += lease_stale(s, &s->idle[i]);
    }
    return stale;
}

/* Swaps an idle lease bound to current parameters into idle[0] (the plan keys with it); 0: none. */
static int current_idle_first(kvp_scheduler *s)
{
    for (size_t i = 0; i < s->idle_count; i++) {
        if (!lease_stale(s, &s->idle[i])) {
            lease l = s->idle[0];
            s->idle[0] = s->idle[i];
            s->idle[i] = l;
            return 1;
        }
    }
    return 0;
}

/*
 * Makes room for the worst case of this step and the leases the plan
 * needs. New leases go to the idle list; on failure they are destroyed
 * again, so nothing changed.
 */
static kvp_status prepare(kvp_scheduler *s, const plan *p, kvp_error *err)
{
    size_t slots = s->running_count + p->slots;
    /* Every lease may end up idle: the running ones, the kept ones, the new ones. */
    size_t usable = s->idle_count - stale_idle(s); /* stale ones go once the step stands */
    size_t leases = s->running_count + s->idle_count + s->kept_count +
                    (p->slots > usable ? p->slots - usable : 0);
    /* Each request finishes once: the ones taken now and the running ones. */
    size_t finishing = s->done_count + p->popped + s->running_count;
    size_t publish = publish_tokens(s, p);
    size_t publish_keys = kvpi_prompt_keys_count(s->layers, 1, publish / s->block_tokens);
    if (grow((void **)&s->rows, &s->rows_room, publish, s->width * sizeof *s->rows) != 0 ||
        grow((void **)&s->keys, &s->keys_room, publish_keys, sizeof *s->keys) != 0) {
        return kvpi_fail_alloc(err, "scheduler publication scratch",
                               publish * s->width * sizeof(double));
    }
    if (grow((void **)&s->running, &s->running_room, slots, sizeof *s->running) != 0 ||
        grow((void **)&s->idle, &s->idle_room, leases, sizeof *s->idle) != 0 ||
        grow((void **)&s->done, &s->done_room, finishing, sizeof *s->done) != 0 ||
        grow((void **)&s->jobs, &s->jobs_room, slots, sizeof *s->jobs) != 0 ||
        grow((void **)&s->kept, &s->kept_room, s->kept_count + slots, sizeof *s->kept) != 0) {
        return kvpi_fail_alloc(err, "scheduler step arrays", slots * sizeof(slot));
    }
    size_t made = 0;
    while (usable + made < p->slots) {
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

/*
 * Removes the entries the plan took from queue positions [0, span), keeping
 * the order of the others (FCFS: the plan took exactly those, a prefix).
 * Taken entries are no longer STATE_WAITING.
 */
static void queue_remove_taken(kvp_scheduler *s, size_t span)
{
    size_t kept = span;
    for (size_t i = span; i-- > 0;) {
        uint64_t id = s->waiting[queue_at(s, i)];
        if (record_of(s, id)->state == STATE_WAITING) {
            s->waiting[queue_at(s, --kept)] = id;
        }
    }
    while (kept-- > 0) {
        (void)queue_pop_front(s);
    }
}

/* Takes the plan's entries: rejected ones finish, admitted ones take a lease per sample. */
static void admit(kvp_scheduler *s, const plan *p, kvp_step_stats *st)
{
    for (size_t i = 0; i < p->popped; i++) {
        uint64_t id = s->plan[i].id;
        if (!s->plan[i].admit) {
            finish(s, id, 1, KVP_OK, NULL);
            st->rejected++;
            continue;
        }
        record *rec = record_of(s, id);
        for (size_t k = 0; k < rec->request.samples; k++) {
            slot *r = &s->running[s->running_count++];
            r->lease = s->idle[--s->idle_count];
            r->id = id;
            r->sample = k;
            r->admitted = s->admissions;
            r->job = NO_JOB;
        }
        s->admissions++;
        rec->slots = rec->request.samples;
        rec->state = STATE_RUNNING;
        rec->failed = 0;
        st->admitted++;
    }
    queue_remove_taken(s, p->span);
}

/*
 * Cache-aware, once the step's admissions stand: every request of the
 * window still waiting that a request behind it in the queue overtook this
 * step counts one more skip (rank_window puts it first from
 * KVP_SCHEDULE_MAX_SKIPS on).
 */
static void count_skips(kvp_scheduler *s, const plan *p)
{
    for (size_t j = 0; j < p->window; j++) {
        record *r = record_of(s, p->ids[j]);
        int overtaken = 0;
        for (size_t i = 0; i < p->popped && !overtaken; i++) {
            overtaken = s->plan[i].admit && s->plan[i].pos > j;
        }
        if (r->state == STATE_WAITING && overtaken) {
            r->skips++;
        }
    }
}

/* A job of request `id` failed: the first failure is kept; the request fails after the phase. */
static void mark_failed(kvp_scheduler *s, uint64_t id, const kvp_error *error)
{
    record *rec = record_of(s, id);
    if (!rec->failed) {
        rec->failed = 1;
        rec->error = *error;
    }
}

/* Every request of slots [first, running_count) marked failed finishes with its status. */
static void fail_marked(kvp_scheduler *s, size_t first, kvp_step_stats *st)
{
    for (size_t i = s->running_count; i-- > first;) {
        if (i >= s->running_count) {
            continue; /* a retire moved the last slot into a place already visited */
        }
        uint64_t id = s->running[i].id;
        record *rec = record_of(s, id);
        if (!rec->failed) {
            continue;
        }
        retire_request(s, id);
        kvp_error error = rec->error;
        rec->failed = 0;
        finish(s, id, 0, error.status, &error);
        st->failed++;
        i = s->running_count; /* retiring moved slots: scan again from the back */
    }
}

/*
 * Runs the prefill jobs [0, count) on the decoder, whose job j belongs to
 * the slot whose `job` is j. A refusal (DECODER_BUSY) runs them on this
 * thread instead, one after another (the same results, bit for bit).
 */
static void run_jobs(kvp_scheduler *s, size_t count)
{
    if (count == 0 ||
        kvp_decoder_step(s->decoder, s->jobs, count, NULL, NULL, NULL) == KVP_OK) {
        return;
    }
    for (size_t j = 0; j < count; j++) {
        kvp_decode_job *job = &s->jobs[j];
        memset(&job->error, 0, sizeof job->error);
        job->status = kvp_sequence_prefill(job->sequence, &job->input, NULL, NULL, NULL, 0,
                                           &job->error);
    }
}

/* A prefill job of `tokens` rows at `rows` for slot i. */
static void prefill_job(kvp_scheduler *s, size_t *count, size_t i, const double *rows,
                        size_t tokens)
{
    kvp_decode_job *job = &s->jobs[*count];
    memset(job, 0, sizeof *job);
    job->kind = KVP_JOB_PREFILL;
    job->sequence = s->running[i].lease.sequence;
    job->input = kvp_tensor3(rows, 1, tokens, s->width);
    s->running[i].job = (*count)++;
}

/* After run_jobs: marks the requests whose jobs failed, and forgets the jobs. */
static void collect_jobs(kvp_scheduler *s, size_t first)
{
    for (size_t i = first; i < s->running_count; i++) {
        slot *r = &s->running[i];
        if (r->job != NO_JOB && s->jobs[r->job].status != KVP_OK) {
            mark_failed(s, r->id, &s->jobs[r->job].error);
        }
        r->job = NO_JOB;
    }
}

/* Compute off: `tokens` zero rows for slot i, a failure marking its request. */
static void append_zeros(kvp_scheduler *s, size_t i, size_t tokens)
{
    kvp_error e;
    memset(&e, 0, sizeof e);
    if (tokens > 0 && lease_append_zeros(s, &s->running[i].lease, tokens, &e) != KVP_OK) {
        mark_failed(s, s->running[i].id, &e);
    }
}

/*
 * 1 when the step's prompts are prefilled on the decoder (compute on and a
 * request admitted: each has a prefill job). The step then reserves the
 * decoder's step slot before admission changes anything, so a refusal
 * (DECODER_BUSY) comes first and changes nothing.
 */
static int prefills_on_decoder(const kvp_scheduler *s, const plan *p)
{
    return s->config.compute && p->admitted > 0;
}

/*
 * Phase 1 of the admitted requests' prefill (slots [first, running_count),
 * in plan order, each request's samples together): adopt the indexed
 * prefix (sharing), promise, and compute the prompt (sharing: once, in
 * sample 0; off: every sample its prompt and continuation) as one batch of
 * decoder jobs, in the decoder's step slot the step reserved
 * (prefills_on_decoder), so it cannot be refused.
 */
static void prefill_prompts(kvp_scheduler *s, const plan *p, size_t first)
{
    size_t count = 0;
    size_t at = first;
    size_t bt = s->block_tokens;
    for (size_t i = 0; i < p->popped; i++) {
        planned *pl = &s->plan[i];
        if (!pl->admit) {
            continue;
        }
        const record *rec = record_of(s, pl->id);
        const kvp_request *q = &rec->request;
        size_t n = q->samples;
        size_t prompt = q->prompt_tokens;
        size_t g = rec->generated;
        size_t x = sample_tokens(s, rec);
        /* Compute off reads no rows here, and may have none (s->rows NULL) */
        const double *rows = s->config.compute ? s->rows + pl->rows * s->width : NULL;
        lease *l0 = &s->running[at].lease;
        pl->adopted = 0;
        if (pl->key_blocks != 0) {
            size_t adoptable = (prompt - 1) / bt;
            size_t blocks = 0;
            /* A page published under another binding (a forged key) is no hit: adopt nothing. */
            if (kvp_cache_group_adopt(lease_caches(l0), s->layers, s->keys + pl->keys,
                                      adoptable < pl->key_blocks ? adoptable : pl->key_blocks,
                                      &blocks, NULL) != KVP_OK) {
                blocks = 0;
            }
            pl->adopted = blocks * bt;
        }
        /*
         * Promises: what each lease will newly take; forked samples' pages
         * past the prompt are promised to their own (still empty) leases.
         * A lease's promise is capped at what one sequence can hold; the
         * promises are set exactly after the fork (prefill_forks).
         */
        size_t cap = s->layers * blocks_of(s, s->config.capacity);
        for (size_t k = 0; k < n; k++) {
            lease *l = &s->running[at + k].lease;
            size_t want;
            if (n == 1 || !s->config.sharing || k == 0) {
                want = lease_pages_for(s, l, prompt + x);
            } else {
                want = sample_pages(s, rec, x);
            }
            kvp_status status = lease_promise(s, l, want < cap ? want : cap, NULL);
            assert(status == KVP_OK); /* within the cap */
            (void)status;
        }
        if (s->config.sharing) {
            size_t tokens = prompt - pl->adopted + (n == 1 ? g : 0);
            if (s->config.compute) {
                prefill_job(s, &count, at, rows + pl->adopted * s->width, tokens);
            } else {
                append_zeros(s, at, tokens);
            }
        } else {
            for (size_t k = 0; k < n; k++) {
                if (s->config.compute) {
                    prefill_job(s, &count, at + k, rows + k * (prompt + g) * s->width,
                                prompt + g);
                } else {
                    append_zeros(s, at + k, prompt + g);
                }
            }
        }
        at += n;
    }
    if (prefills_on_decoder(s, p)) {
        kvpi_decoder_step_reserved(s->decoder, s->jobs, count);
        collect_jobs(s, first);
    }
}

/*
 * After the step's prefills: the kept lease of every admitted request's
 * session is given back. The request adopted what the index held of its
 * prompt, so the kept pages it shares stay held by it.
 */
static void use_sessions(kvp_scheduler *s, const plan *p)
{
    for (size_t i = 0; i < p->popped && s->kept_count > 0; i++) {
        const planned *pl = &s->plan[i];
        uint64_t session = record_of(s, pl->id)->request.session;
        size_t k = pl->admit && session != 0 ? kept_of(s, session) : SIZE_MAX;
        if (k != SIZE_MAX) {
            /* A stale one held nothing the request could adopt: not a hit. */
            drop_kept(s, k, !lease_stale(s, &s->kept[k].lease));
        }
    }
}

/*
 * Phase 2 (sharing on): every admitted request that prefilled its prompt
 * publishes the prompt's full blocks, forks sample 0 into its other
 * samples' leases, and promises each lease exactly its pages to come; then
 * each forked sample computes the tokens it generated before a preemption
 * (a second batch of decoder jobs; a refusal runs them on this thread).
 * Then the requests whose jobs failed finish, and the statistics count.
 */
static void prefill_forks(kvp_scheduler *s, const plan *p, size_t first, kvp_step_stats *st)
{
    size_t count = 0;
    size_t at = first;
    for (size_t i = 0; i < p->popped; i++) {
        const planned *pl = &s->plan[i];
        if (!pl->admit) {
            continue;
        }
        record *rec = record_of(s, pl->id);
        const kvp_request *q = &rec->request;
        size_t n = q->samples;
        size_t prompt = q->prompt_tokens;
        size_t g = rec->generated;
        size_t here = at;
        at += n;
        if (!s->config.sharing || rec->failed) {
            continue;
        }
        kvp_cache *const *parent = lease_caches(&s->running[here].lease);
        if (pl->key_blocks != 0) {
            /* Fresh pages, or pages registered under these very keys: cannot be refused. */
            kvp_status status = kvp_cache_group_publish(parent, s->layers, s->keys + pl->keys,
                                                        pl->key_blocks, NULL);
            assert(status == KVP_OK);
            (void)status;
        }
        kvpi_pool_lock(s->pool);
        for (size_t k = 1; k < n; k++) {
            kvp_cache *const *child = lease_caches(&s->running[here + k].lease);
            for (size_t l = 0; l < s->layers; l++) {
                kvpi_cache_fork_writer_locked(parent[l], child[l]); /* sample 0 writes */
            }
        }
        kvpi_pool_unlock(s->pool);
        s->stats.forks += n - 1;
        if (n == 1) {
            continue;
        }
        size_t x = sample_tokens(s, rec);
        for (size_t k = 0; k < n; k++) {
            lease *l = &s->running[here + k].lease;
            kvp_status status = lease_promise(s, l, lease_pages_for(s, l, prompt + x), NULL);
            assert(status == KVP_OK);
            (void)status;
            if (g == 0) {
                continue;
            }
            if (s->config.compute) {
                const double *rows = s->rows + (pl->rows + prompt + k * g) * s->width;
                prefill_job(s, &count, here + k, rows, g);
            } else {
                append_zeros(s, here + k, g);
            }
        }
    }
    if (s->config.compute) {
        run_jobs(s, count); /* a refusal runs them here: cannot fail */
        collect_jobs(s, first);
    }
    at = first;
    for (size_t i = 0; i < p->popped; i++) {
        const planned *pl = &s->plan[i];
        if (!pl->admit) {
            continue;
        }
        const record *rec = record_of(s, pl->id);
        size_t n = rec->request.samples;
        size_t prompt = rec->request.prompt_tokens;
        size_t g = rec->generated;
        at += n;
        if (rec->failed) {
            continue;
        }
        st->prompt_tokens += prompt;
        st->prefix_hit_tokens += pl->adopted;
        st->prefill_tokens += s->config.sharing ? prompt - pl->adopted + n * g : n * (prompt + g);
    }
    fail_marked(s, first, st);
}

/* Pages a take can get: free plus evictable (a take evicts the least recently used). */
static size_t available_pages(const kvp_scheduler *s)
{
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    if (kvp_pool_stats_get(s->pool, &stats, NULL) != KVP_OK) {
        return 0;
    }
    return stats.free_pages + stats.evictable_pages;
}

/* Request `id` (all its samples) gives its pages back and returns to the front of the queue. */
static void preempt_request(kvp_scheduler *s, uint64_t id, int stale, kvp_step_stats *st)
{
    record *r = record_of(s, id);
    size_t n = r->slots;
    retire_request(s, id);
    r->state = STATE_WAITING;
    r->preemptions++;
    queue_push_front(s, id);
    s->stats.preemptions += n;
    st->preempted += n;
    if (stale) {
        s->stats.stale_preemptions += n;
        st->stale_preempted += n;
    }
}

/* The running slot of the most recently admitted request that `stale_only` allows, or SIZE_MAX. */
static size_t newest_slot(const kvp_scheduler *s, int stale_only)
{
    size_t newest = SIZE_MAX;
    for (size_t i = 0; i < s->running_count; i++) {
        const slot *r = &s->running[i];
        if (stale_only && !lease_stale(s, &r->lease)) {
            continue;
        }
        if (newest == SIZE_MAX || r->admitted > s->running[newest].admitted) {
            newest = i;
        }
    }
    return newest;
}

/*
 * Preempts, newest first (so the queue keeps admission order): every
 * request with a sequence bound to parameters that changed, then requests
 * until this step's pages fit what a take can get.
 */
static void make_room(kvp_scheduler *s, kvp_step_stats *st)
{
    for (size_t i; (i = newest_slot(s, 1)) != SIZE_MAX;) {
        preempt_request(s, s->running[i].id, 1, st);
    }
    for (;;) {
        size_t needed = 0;
        for (size_t i = 0; i < s->running_count; i++) {
            const lease *l = &s->running[i].lease;
            needed += lease_pages_for(s, l, lease_len(l) + 1);
        }
        if (s->running_count == 0 || needed <= available_pages(s)) {
            return;
        }
        if (s->kept_count > 0) {
            drop_kept(s, 0, 0); /* kept sessions go before running requests */
            continue;
        }
        preempt_request(s, s->running[newest_slot(s, 0)].id, 0, st);
    }
}

/*
 * Sharing: request `id` completed. Before its pages go back, each sample
 * publishes the full blocks of its whole sequence, prompt and decoded
 * tokens, under the chain keys the plan computes for a prompt of the same
 * rows (kvpi_prompt_keys): a later prompt holding this prompt and a
 * sample's reply (a conversation's next turn) adopts them. The prompt's
 * blocks are keyed once (they are published already: publishing them again
 * changes nothing); each sample continues the chain over its own rows, as
 * any sample's reply may be the one a later prompt holds. A stale lease
 * publishes nothing. The rows and keys are the step's scratch, free once
 * the prefills ran (prepare made the room: publish_tokens).
 */
static void publish_decoded(kvp_scheduler *s, uint64_t id)
{
    const record *rec = record_of(s, id);
    const kvp_request *q = &rec->request;
    size_t prompt = q->prompt_tokens;
    size_t len = prompt + rec->generated;
    size_t from = prompt / s->block_tokens;
    size_t blocks = len / s->block_tokens;
    if (!publishes(s, q) || blocks == from) {
        return; /* nothing to key, or no full block holds a decoded token */
    }
    fill_rows(s, id, 0, 0, prompt, s->rows);
    int prompt_keyed = 0;
    for (size_t i = 0; i < s->running_count; i++) {
        const slot *r = &s->running[i];
        if (r->id != id || lease_stale(s, &r->lease)) {
            continue;
        }
        assert(lease_len(&r->lease) == len);
        kvp_cache *const *caches = lease_caches(&r->lease);
        fill_rows(s, id, r->sample, prompt, len, s->rows + prompt * s->width);
        kvpi_prompt_keys_from(caches, s->layers, &q->salt, s->rows, len, s->width,
                              prompt_keyed ? from : 0, blocks, s->keys);
        prompt_keyed = 1;
        /* The prompt's pages are registered under these very keys, the rest are fresh. */
        kvp_status status = kvp_cache_group_publish(caches, s->layers, s->keys, blocks, NULL);
        assert(status == KVP_OK);
        (void)status;
    }
}

/*
 * One token for every running sequence. A job's failure fails its request
 * (all its samples); a decoder refusal is returned with nothing decoded.
 * Then every decoded token counts, its output goes to on_token, and the
 * requests whose every sample has its budget retire.
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
            q->input(q->ctx, r->id, r->sample, position, r->lease.input, s->width);
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
                q->on_token(q->ctx, r->id, r->sample, kvp_sequence_len(r->lease.sequence) - 1,
                            r->lease.output, s->width);
            }
        }
    }
    for (size_t i = 0; i < count; i++) {
        s->running[i].job = i;
        if (s->jobs[i].status != KVP_OK) {
            mark_failed(s, s->running[i].id, &s->jobs[i].error);
        }
    }
    for (size_t i = 0; i < count; i++) {
        slot *r = &s->running[i];
        record *rec = record_of(s, r->id);
        if (!rec->failed) {
            s->stats.tokens_generated++;
            st->decoded++;
            rec->generated += r->sample == 0; /* the samples advance together */
        }
        r->job = NO_JOB;
    }
    fail_marked(s, 0, st);
    /* The requests whose samples all have their budget finish. */
    for (size_t i = s->running_count; i-- > 0;) {
        if (i >= s->running_count) {
            continue;
        }
        uint64_t id = s->running[i].id;
        record *rec = record_of(s, id);
        if (rec->generated < rec->request.max_new_tokens) {
            continue;
        }
        publish_decoded(s, id);
        keep_session(s, id);
        retire_request(s, id);
        finish(s, id, 0, KVP_OK, NULL);
        st->finished++;
        i = s->running_count;
    }
    return KVP_OK;
}

/*
 * Frees the idle leases bound to parameters that changed; they cannot serve
 * a request again. Only once the step cannot fail: a failed step keeps them
 * (they hold no page or promise, but they are held samples and attached
 * caches, and a failure changes nothing).
 */
static void drop_stale_idle(kvp_scheduler *s)
{
    for (size_t i = s->idle_count; i-- > 0;) {
        if (lease_stale(s, &s->idle[i])) {
            lease_free(&s->idle[i]);
            s->idle[i] = s->idle[--s->idle_count];
        }
    }
}

/*
 * Puts a lease bound to current parameters in idle[0] when the plan may key
 * prompts with it: an idle one (reordering the idle list changes nothing
 * observable), else a new one (*made 1; step_failed frees it again).
 */
static kvp_status key_lease(kvp_scheduler *s, int *made, kvp_error *err)
{
    *made = 0;
    if (current_idle_first(s) || s->waiting_count == 0 || !s->config.sharing) {
        return KVP_OK;
    }
    if (grow((void **)&s->idle, &s->idle_room, s->running_count + s->idle_count + 1,
             sizeof *s->idle) != 0) {
        return kvpi_fail_alloc(err, "scheduler idle list", sizeof *s->idle);
    }
    kvp_status status = lease_make(s, &s->idle[s->idle_count], err);
    if (status != KVP_OK) {
        return status;
    }
    s->idle_count++;
    (void)current_idle_first(s); /* the new lease goes to idle[0] */
    *made = 1;
    return KVP_OK;
}

/*
 * A step failed before it changed anything: the leases it made (key_lease's,
 * swapped back behind the `before` idle leases it found, and prepare's) are
 * freed, so the idle list is what it was, in another order.
 */
static void step_failed(kvp_scheduler *s, size_t before, int made)
{
    if (made) {
        lease l = s->idle[0];
        s->idle[0] = s->idle[before];
        s->idle[before] = l;
    }
    while (s->idle_count > before) {
        lease_free(&s->idle[--s->idle_count]);
    }
}

kvp_status kvp_scheduler_step(kvp_scheduler *scheduler, kvp_step_stats *stats, kvp_error *err)
{
    if (scheduler == NULL) {
        return kvpi_fail_null(err, "scheduler");
    }
    kvp_status status = KVP_OK;
    if (stats != NULL) {
        status = kvpi_struct_size_check(stats->struct_size, KVPI_STEP_STATS_SIZE_FIRST, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    kvp_scheduler *s = scheduler;
    /* Preempted requests return to the queue: room for every running one. */
    if (grow((void **)&s->plan, &s->plan_room, s->waiting_count, sizeof *s->plan) != 0 ||
        queue_grow(s, s->waiting_count + s->running_count) != 0) {
        return kvpi_fail_alloc(err, "scheduler admission plan",
                               s->waiting_count * sizeof *s->plan);
    }
    size_t idle_before = s->idle_count;
    int made = 0;
    status = key_lease(s, &made, err); /* the plan keys prompts with idle[0]'s bindings */
    plan p;
    if (status == KVP_OK) {
        status = plan_admission(s, &p, err);
    }
    if (status == KVP_OK) {
        status = prepare(s, &p, err);
    }
    if (status == KVP_OK && prefills_on_decoder(s, &p)) {
        status = kvpi_decoder_reserve(s->decoder, err);
    }
    if (status != KVP_OK) {
        step_failed(s, idle_before, made);
        return status;
    }
    drop_stale_idle(s); /* the step stands from here on */
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    size_t first = s->running_count;
    admit(s, &p, &st);
    prefill_prompts(s, &p, first);
    prefill_forks(s, &p, first, &st);
    use_sessions(s, &p);
    count_skips(s, &p);
    s->stats.prefill_tokens += st.prefill_tokens;
    s->stats.prompt_tokens += st.prompt_tokens;
    s->stats.prefix_hit_tokens += st.prefix_hit_tokens;
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
    drop_sessions(s, st.admitted);
    st.retained_pages = s->kept_pages;
    kvp_pool_stats pool;
    kvp_pool_stats_init(&pool);
    if (kvp_pool_stats_get(s->pool, &pool, NULL) == KVP_OK) {
        st.held_pages = pool.held_pages;
        st.total_pages = pool.total_pages;
        st.cached_pages = pool.cached_pages;
        st.evictable_pages = pool.evictable_pages;
    }
    for (size_t i = 0; i < s->running_count; i++) {
        size_t len = lease_len(&s->running[i].lease);
        st.used_slots += s->layers * len;
        st.unshared_pages += s->layers * blocks_of(s, len);
    }
    for (size_t i = 0; i < s->kept_count; i++) {
        st.used_slots += s->layers * lease_len(&s->kept[i].lease);
        st.unshared_pages += s->kept[i].pages;
    }
    st.running = s->running_count;
    st.waiting = s->waiting_count;
    if (stats != NULL) {
        (void)kvpi_struct_out(stats, &st, sizeof st, KVPI_STEP_STATS_SIZE_FIRST, NULL);
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
    return kvpi_struct_out(out, &stats, sizeof stats, KVPI_SCHEDULER_STATS_SIZE_FIRST, err);
}
