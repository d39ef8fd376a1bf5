/*
 * scheduler_internal.h: the scheduler's state (struct kvp_scheduler) and
 * what its rooms share. The scheduler is continuous batching over one
 * model, pool and decoder (kvpager/scheduler.h has the schedule and the
 * contracts); it is cut into rooms, each a file of src/serve:
 *   scheduler.c          the public calls: create, submit, collect, state, stats;
 *   scheduler_lease.c    leases: what a running request holds, computed or allocator-only;
 *   scheduler_queue.c    the waiting queue, a request's rows, finishing and failing requests;
 *   scheduler_session.c  sessions: leases kept for a conversation's next request;
 *   scheduler_plan.c     admission planning, cache-aware ranking, admitting the plan;
 *   scheduler_prefill.c  the admitted requests' batched prefill and forks;
 *   scheduler_step.c     a step: room, preemption, decode, publication.
 * Calls run one way: scheduler_step.c calls every other room but
 * scheduler.c; scheduler.c calls session, queue and lease; plan and
 * prefill call queue and lease; session and queue call lease; lease calls
 * no room. No room includes another's file.
 *
 * Invariants (all rooms keep them):
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
 *     that may complete keying its decoded blocks, each admitted request's
 *     record room for its prompt's block keys), plans the admissions
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
 * Callers: src/serve/scheduler*.c only, one caller at a time per scheduler
 * (the public calls' rule).
 */
#ifndef KVPAGER_SERVE_SCHEDULER_INTERNAL_H
#define KVPAGER_SERVE_SCHEDULER_INTERNAL_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>

#include "kvpager/cache.h"
#include "kvpager/scheduler.h"
#include "kvpager/tier.h"
/* Every internal header a room includes comes before the short type names below. */
#include "pager/cache_internal.h"
#include "pager/pool_internal.h"
#include "serve/decoder_internal.h"
#include "serve/requests_internal.h"
#include "serve/sequence_internal.h"
#include "serve/share_internal.h"

/* A record's state; a collected request has no record (requests_internal.h). */
enum { STATE_WAITING, STATE_RUNNING, STATE_FINISHED };

typedef kvpi_record record;

typedef struct lease_kind lease_kind;

/*
 * A sequence (or external caches) with its token buffers, reused between
 * requests. Its kind says which it holds (scheduler_lease.c): the rooms
 * use it only through the lease_* calls below.
 */
typedef struct lease {
    const lease_kind *kind;
    kvp_sequence *sequence; /* computed: the sequence */
    kvp_cache **caches;     /* allocator-only: [layers + 1], NULL-terminated */
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

/* A waiting request's prefetch of its missed prompt blocks (scheduler_tier.c). */
typedef struct prefetch_slot {
    uint64_t id;             /* NO_REQUEST: free */
    kvp_tier_prefetch *prefetch;
    size_t first;            /* its first block: the probe's hits at the issue */
    size_t blocks;           /* blocks asked: [first, first + blocks) */
    kvp_block_key head;      /* block first's layer-0 key (the admission's must match) */
} prefetch_slot;

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
    /* [2 * layers]: each layer's window W and sinks S (kvp_layer_set_window)
       when a computed run's model has a sliding layer (sharing is then off),
       else NULL: admission counts a sliding layer's peak, not its length. */
    size_t *windows;
    const lease_kind *leases; /* the kind of every lease it makes (config.compute) */

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
    /* The tier's cost model (scheduler_tier.c): prompt tokens the prefills computed
       and the time their batches took; the moving average of the rate of loads that
       brought blocks (0: none yet); asks refused in a row. */
    struct {
        uint64_t prefill_tokens;
        double prefill_seconds;
        double bytes_per_second;
        uint64_t refused_in_row;
    } tier;
    /* Prefetches in flight or completed, for waiting requests (config.tier_prefetch of
       them in use at most). */
    prefetch_slot prefetches[KVP_TIER_PREFETCH_MAX];
};

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

/* ---- leases (scheduler_lease.c) ------------------------------------------ */

/*
 * What a lease's run is made of, behind one set of calls: a computed run
 * holds a sequence of the model and its appends and decodes are decoder
 * jobs; an allocator-only run (compute off) holds one external cache per
 * layer and appends rows at once, unwritten. Every lease of a scheduler has its
 * scheduler's kind (s->leases).
 */
struct lease_kind {
    /* 1 when appends are decoder jobs (the step reserves the decoder for its prefills). */
    int on_decoder;
    /* What the scheduler allocates for this kind at create (freed with the scheduler). */
    kvp_status (*setup)(kvp_scheduler *s, kvp_error *err);
    kvp_status (*make)(kvp_scheduler *s, lease *l, kvp_error *err);
    void (*free)(lease *l);
    kvp_cache *const *(*caches)(const lease *l);
    size_t (*pages_for)(const kvp_scheduler *s, const lease *l, size_t tokens);
    /* Pages it may still take stepping to `tokens` (a sliding layer's level). */
    size_t (*level_for)(const kvp_scheduler *s, const lease *l, size_t tokens);
    int (*stale)(const kvp_scheduler *s, const lease *l);
    kvp_status (*promise)(const kvp_scheduler *s, lease *l, size_t pages, kvp_error *err);
    void (*reset)(const kvp_scheduler *s, lease *l);
    kvp_status (*append)(kvp_scheduler *s, slot *r, size_t row, size_t tokens, size_t *jobs,
                         kvp_error *err);
    void (*decode_input)(kvp_scheduler *s, slot *r, const kvp_request *q, kvp_decode_job *job);
    kvp_status (*decode_run)(kvp_scheduler *s, size_t count, kvp_error *err);
    void (*decode_output)(slot *r, const kvp_request *q, const kvp_decode_job *job,
                          size_t width);
};

/* The two kinds: a sequence with the model, and external caches with no weights. */
extern const lease_kind kvpi_lease_computed;
extern const lease_kind kvpi_lease_external;

/* A new lease of the scheduler's kind; on failure nothing is left allocated. */
static inline kvp_status lease_make(kvp_scheduler *s, lease *out, kvp_error *err)
{
    return s->leases->make(s, out, err);
}

static inline void lease_free(lease *l)
{
    l->kind->free(l);
}

/* The lease's layer caches, one per layer. */
static inline kvp_cache *const *lease_caches(const lease *l)
{
    return l->kind->caches(l);
}

/* Tokens it holds (every layer holds as many). */
static inline size_t lease_len(const lease *l)
{
    return kvp_cache_len(lease_caches(l)[0]);
}

/* New pages to grow to `tokens`, copy-on-write copies included. */
static inline size_t lease_pages_for(const kvp_scheduler *s, const lease *l, size_t tokens)
{
    return l->kind->pages_for(s, l, tokens);
}

/*
 * New pages stepping to `tokens` may still take: for a sliding layer its
 * peak less what it holds (a level), for a full layer its new blocks.
 * Equal to lease_pages_for without windows.
 */
static inline size_t lease_level_for(const kvp_scheduler *s, const lease *l, size_t tokens)
{
    return l->kind->level_for(s, l, tokens);
}

/* 1 when a layer's cache is bound to a parameter revision that is no longer current. */
static inline int lease_stale(const kvp_scheduler *s, const lease *l)
{
    return l->kind->stale(s, l);
}

static inline kvp_status lease_promise(const kvp_scheduler *s, lease *l, size_t pages,
                                       kvp_error *err)
{
    return l->kind->promise(s, l, pages, err);
}

/* Returns its pages and promises; cannot fail on a valid lease. */
static inline void lease_reset(const kvp_scheduler *s, lease *l)
{
    l->kind->reset(s, l);
}

/*
 * Slot r's lease takes `tokens` rows, those at s->rows + row * width: a
 * computed lease adds a prefill job over them to s->jobs[*jobs] (run with
 * the step's batch, its failure found in the job), an allocator-only one
 * appends that many rows now (unwritten), all or nothing (a failure returned).
 */
static inline kvp_status lease_append(kvp_scheduler *s, slot *r, size_t row, size_t tokens,
                                      size_t *jobs, kvp_error *err)
{
    return r->lease.kind->append(s, r, row, tokens, jobs, err);
}

/*
 * A decode in three calls: lease_decode_input readies slot r's job (a
 * computed lease reads its next input row; an allocator-only one appends
 * its row now, the outcome in the job); leases_decode runs the jobs
 * (the decoder, or nothing; a refusal returned, nothing decoded);
 * lease_decode_output hands a computed job's output to on_token.
 */
static inline void lease_decode_input(kvp_scheduler *s, slot *r, const kvp_request *q,
                                      kvp_decode_job *job)
{
    r->lease.kind->decode_input(s, r, q, job);
}

static inline kvp_status leases_decode(kvp_scheduler *s, size_t count, kvp_error *err)
{
    return s->leases->decode_run(s, count, err);
}

static inline void lease_decode_output(const kvp_scheduler *s, slot *r, const kvp_request *q,
                                       const kvp_decode_job *job)
{
    r->lease.kind->decode_output(r, q, job, s->width);
}

/* ---- small shared helpers ------------------------------------------------ */

/* The record of request `id`, held: waiting, running or finished, not collected. */
static inline record *record_of(const kvp_scheduler *s, uint64_t id)
{
    record *r = kvpi_requests_find(&s->requests, id);
    assert(r != NULL);
    return r;
}

static inline size_t queue_at(const kvp_scheduler *s, size_t i)
{
    return (s->waiting_head + i) % s->waiting_room;
}

static inline size_t blocks_of(const kvp_scheduler *s, size_t tokens)
{
    return tokens / s->block_tokens + (tokens % s->block_tokens != 0);
}

/*
 * Tokens each sample is admitted for past the prompt: what it generated
 * before a preemption plus the decoding reserve, but never more than its
 * budget. So a request whose whole length fits an empty pool is always
 * admitted once the pool empties.
 */
static inline size_t sample_tokens(const kvp_scheduler *s, const record *r)
{
    size_t tokens = r->generated + s->config.reserve_tokens;
    return tokens < r->request.max_new_tokens ? tokens : r->request.max_new_tokens;
}

/*
 * Pages one forked sample takes past the prompt's full blocks (its copy of a
 * partial one too). Sample 0 writes the partial page in place (prefill_forks):
 * n samples, n - 1 copies.
 */
static inline size_t sample_pages(const kvp_scheduler *s, const record *r, size_t past_prompt)
{
    size_t prompt = r->request.prompt_tokens;
    return s->layers * (blocks_of(s, prompt + past_prompt) - prompt / s->block_tokens);
}

/* 1 when a completed request publishes its decoded blocks (sharing on, and their rows to key). */
static inline int publishes(const kvp_scheduler *s, const kvp_request *q)
{
    return s->config.sharing && (q->input != NULL || q->block_digest != NULL);
}

/*
 * Request `id`'s chain keys of blocks [from, blocks) of sample `sample`
 * over `caches`' bindings, keys of blocks [0, from) given (the layout of
 * kvpi_prompt_keys, room for its count): from the request's block digests
 * when it has them, else from `rows` (len rows: the prompt's, then the
 * sample's), as kvpi_prompt_keys_from (scheduler_plan.c).
 */
void kvpi_sched_keys(const kvp_scheduler *s, kvp_cache *const *caches, uint64_t id,
                     size_t sample, const double *rows, size_t len, size_t from, size_t blocks,
                     kvp_block_key *keys);

/*
 * 1 when the step's prompts are prefilled on the decoder (computed leases
 * and a request admitted: each has a prefill job). The step then reserves
 * the decoder's step slot before admission changes anything, so a refusal
 * (DECODER_BUSY) comes first and changes nothing.
 */
static inline int prefills_on_decoder(const kvp_scheduler *s, const plan *p)
{
    return s->leases->on_decoder && p->admitted > 0;
}

/* ---- the second tier (scheduler_tier.c) ---------------------------------- */

/*
 * After planned request pl adopted `adopted` prompt blocks into sample 0's
 * lease l0 (of `adoptable` it may adopt): loads the next ones the pool's
 * tier holds (when a tier is attached, and the cost model says so), and
 * counts. Returns the blocks loaded (0 when none, refused or failed: then
 * nothing changed).
 */
size_t kvpi_sched_tier_load(kvp_scheduler *s, const planned *pl, size_t adopted, size_t adoptable,
                            lease *l0);
/*
 * After a step's plan, once the step stands: cancels the prefetches of
 * requests no longer waiting (counted wasted), then issues one for each
 * request whose keys the plan parked or ranked, not in plan p, whose
 * probe misses adoptable blocks, while slots are free (config.tier_prefetch).
 */
void kvpi_sched_tier_prefetch(kvp_scheduler *s, const plan *p);
/* Cancels every prefetch (the scheduler's destroy). */
void kvpi_sched_tier_prefetch_drop_all(kvp_scheduler *s);
/* The monotonic clock, in seconds. */
double kvpi_sched_tier_clock(void);
/* The cost model learns that a prefill batch computed `tokens` prompt tokens in `seconds`. */
void kvpi_sched_tier_prefilled(kvp_scheduler *s, size_t tokens, double seconds);

/* ---- the queue and the requests (scheduler_queue.c) ---------------------- */

/* Grows a heap array of `size`-byte items to hold `need`; 0, or -1 changing nothing. */
int kvpi_sched_grow(void **items, size_t *room, size_t need, size_t size);

void kvpi_sched_queue_push_back(kvp_scheduler *s, uint64_t id);
void kvpi_sched_queue_push_front(kvp_scheduler *s, uint64_t id);
uint64_t kvpi_sched_queue_pop_front(kvp_scheduler *s);
void kvpi_sched_queue_jump(kvp_scheduler *s, uint64_t id);
int kvpi_sched_queue_grow(kvp_scheduler *s, size_t need);

/* 1 when the request's prompt rows can be keyed (sharing on, and rows to read). */
int kvpi_sched_keyed(const kvp_scheduler *s, const kvp_request *q);
size_t kvpi_sched_rows_needed(const kvp_scheduler *s, const record *r);
void kvpi_sched_fill_rows(kvp_scheduler *s, uint64_t id, size_t sample, size_t from, size_t to,
                          double *rows);
void kvpi_sched_fill_request(kvp_scheduler *s, uint64_t id, double *rows);

void kvpi_sched_finish(kvp_scheduler *s, uint64_t id, int rejected, kvp_status status,
                       const kvp_error *error);
void kvpi_sched_retire_request(kvp_scheduler *s, uint64_t id);
void kvpi_sched_mark_failed(kvp_scheduler *s, uint64_t id, const kvp_error *error);
void kvpi_sched_fail_marked(kvp_scheduler *s, size_t first, kvp_step_stats *st);

/* ---- sessions (scheduler_session.c) -------------------------------------- */

size_t kvpi_sched_kept_of(const kvp_scheduler *s, uint64_t session);
void kvpi_sched_drop_kept(kvp_scheduler *s, size_t i, int used);
void kvpi_sched_keep_session(kvp_scheduler *s, uint64_t id);
void kvpi_sched_use_sessions(kvp_scheduler *s, const plan *p);
void kvpi_sched_drop_sessions(kvp_scheduler *s, size_t admitted);

/* ---- admission (scheduler_plan.c) ---------------------------------------- */

kvp_status kvpi_sched_plan_admission(kvp_scheduler *s, plan *p, kvp_error *err);
size_t kvpi_sched_window_level(const kvp_scheduler *s, size_t tokens);
size_t kvpi_sched_window_sample_pages(const kvp_scheduler *s, const record *r,
                                      size_t past_prompt, size_t k, size_t hits);
void kvpi_sched_admit(kvp_scheduler *s, const plan *p, kvp_step_stats *st);
void kvpi_sched_count_skips(kvp_scheduler *s, const plan *p);

/* ---- prefill (scheduler_prefill.c) --------------------------------------- */

void kvpi_sched_prefill_prompts(kvp_scheduler *s, const plan *p, size_t first);
void kvpi_sched_prefill_forks(kvp_scheduler *s, const plan *p, size_t first,
                              kvp_step_stats *st);

#endif /* KVPAGER_SERVE_SCHEDULER_INTERNAL_H */
