/*
 * scheduler_plan.c: admission planning and cache-aware ranking (the
 * scheduler's rooms: scheduler_internal.h).
 *
 * Owns: the step's plan (s->plan, and struct plan: the queue entries a
 * step takes, each admitted or rejected), the pages a request asks
 * admission for (request_pages), the parked and ranked prompt keys
 * (s->parked, s->ranked: keysets kept across steps so a waiting request
 * is not read and hashed again), the cache-aware window's order,
 * taking the plan (admit: leases to slots, entries out of the queue, the
 * prompt's block keys into the record for publication: keep_chain), and
 * a request's chain keys (kvpi_sched_keys: from its block digests, or from
 * its rows), which publication in scheduler_step.c uses too.
 *
 * Invariants: planning changes nothing but the scratch it grows (rows,
 * keys, plan) and the keysets it parks, which change no decision: the
 * same id, rows and bindings give the same keys; the plan asks
 * kvp_pool_admit for each request's pages plus those planned before it,
 * so admitting the whole plan decides as admitting each in turn would; a
 * plan is taken in its order, and the queue keeps the order of the rest.
 * Callers: scheduler_step.c (kvp_scheduler_step: plan, then admit, then
 * count_skips once the step stands). Calls the queue room and leases.
 */
#include <string.h>

#include "pager/cache_internal.h"
#include "pager/error.h"
#include "serve/scheduler_internal.h"
#include "serve/share_internal.h"

/*
 * The most pages one empty lane of the model holds at once while single
 * steps bring it to `tokens`: a sliding layer's peak
 * (kvpi_window_pages_held_max: its sinks and window), a full layer's
 * blocks. What kvp_sequence_pages_for gives for an empty one-lane sequence.
 */
size_t kvpi_sched_window_level(const kvp_scheduler *s, size_t tokens)
{
    size_t pages = 0;
    for (size_t l = 0; l < s->layers; l++) {
        pages += kvpi_window_pages_held_max(s->windows[2 * l], s->windows[2 * l + 1],
                                            s->block_tokens, tokens);
    }
    return pages;
}

static size_t add_sat(size_t a, size_t b)
{
    return a > SIZE_MAX - b ? SIZE_MAX : a + b;
}

/*
 * With sliding layers: the most pages sample k of request r newly takes at
 * once from admission to `past_prompt` tokens past its prompt, when `hits`
 * prompt blocks are adopted. Its prompt's prefill (one transaction) holds
 * every block it writes until its end; then its windows release, and what
 * it generated before a preemption is appended in block-aligned chunks
 * (scheduler_prefill.c, append_tails), each holding what the single step
 * into its block holds, so steps and chunks hold at most the level
 * (kvpi_sched_window_level, which counts every page held, shared ones too:
 * a safe over-count of the new ones). The larger of the two. Who prefills
 * what in one transaction:
 *   - sharing off: every sample its prompt, every block of every layer, no hit;
 *   - sharing on, sample 0: the prompt past its `hits` adopted blocks:
 *     those are pages the index already holds, so adopting them takes none
 *     (a sliding layer adopts only its window's blocks, fewer still; an
 *     evictable hit is counted by the plan);
 *   - sharing on, a forked sample: nothing (it shares sample 0's live
 *     blocks; its chunks, its copy of a partial block too, stay within
 *     the level).
 */
static size_t window_prefill(const kvp_scheduler *s, const record *r, size_t k, size_t hits)
{
    size_t prompt = r->request.prompt_tokens;
    if (!s->config.sharing) {
        return s->layers * blocks_of(s, prompt);
    }
    if (k == 0) {
        size_t b = blocks_of(s, prompt);
        return s->layers * (b - (hits < b ? hits : b));
    }
    return 0;
}

size_t kvpi_sched_window_sample_pages(const kvp_scheduler *s, const record *r,
                                      size_t past_prompt, size_t k, size_t hits)
{
    size_t prefill = window_prefill(s, r, k, hits);
    size_t level = kvpi_sched_window_level(s, r->request.prompt_tokens + past_prompt);
    return prefill > level ? prefill : level;
}

/*
 * Pages a request newly takes to hold `past_prompt` tokens per sample when
 * `hits` prompt blocks are adopted, `evictable` of their pages from the LRU
 * list (adopting them takes them from what a take can get): shared pages
 * counted once. Sliding layers: each sample its peak
 * (kvpi_sched_window_sample_pages), sample 0's prefill with the evictable
 * hits it adopts (its level counts every page it holds, those included).
 * Never more with hits than the whole-length count without (NEVER): a
 * request that fits an empty pool is admitted once the pool empties.
 */
static size_t window_request_pages(const kvp_scheduler *s, const record *r, size_t past_prompt,
                                   size_t hits, size_t evictable)
{
    size_t n = r->request.samples;
    size_t prefill = add_sat(window_prefill(s, r, 0, hits), evictable);
    size_t level = kvpi_sched_window_level(s, r->request.prompt_tokens + past_prompt);
    size_t first = prefill > level ? prefill : level;
    return first + (n - 1) * kvpi_sched_window_sample_pages(s, r, past_prompt, 1, 0);
}

/*
 * Pages a request newly takes to hold `past_prompt` tokens per sample when
 * `hits` prompt blocks are adopted (none of them evictable): shared pages
 * counted once. One sample: its own blocks. Forked samples: sample 0's own
 * blocks (it writes the partial prompt page in place), plus each other
 * sample's blocks past the prompt's full ones (its copy). Sharing off:
 * every sample its own. Sliding layers: window_request_pages.
 */
static size_t request_pages(const kvp_scheduler *s, const record *r, size_t past_prompt,
                            size_t hits)
{
    if (s->windows != NULL) {
        return window_request_pages(s, r, past_prompt, hits, 0);
    }
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

/* request_pages with `evictable` of the hits' pages taken from the LRU list. */
static size_t request_need(const kvp_scheduler *s, const record *r, size_t past_prompt,
                           size_t hits, size_t evictable)
{
    if (s->windows != NULL) {
        return window_request_pages(s, r, past_prompt, hits, evictable);
    }
    return add_sat(request_pages(s, r, past_prompt, hits), evictable);
}

/*
 * Keys from block digests, as kvpi_prompt_keys_from chains rows (one lane):
 * the same context (every layer's binding digest and the salt) and layer
 * ids, but each block's chain key is over its 16-byte digest with the
 * context passed as a context too, so no digest's key equals a row key.
 */
static void digest_keys(const kvp_scheduler *s, kvp_cache *const *caches, uint64_t id,
                        size_t sample, size_t from, size_t blocks, kvp_block_key *keys)
{
    const kvp_request *q = &record_of(s, id)->request;
    size_t layers = s->layers;
    kvp_block_key *chain = kvpi_prompt_keys_chain(keys, layers, 1, blocks);
    kvp_block_key context = kvpi_prompt_keys_context(caches, layers, &q->salt, chain + blocks);
    size_t bt = s->block_tokens;
    for (size_t j = from; j < blocks; j++) {
        kvp_block_key digest = {0, 0};
        q->block_digest(q->ctx, id, (j + 1) * bt <= q->prompt_tokens ? 0 : sample, j, &digest);
        chain[j] = kvpi_block_key_chain(s->pool, j == 0 ? NULL : &chain[j - 1], &context,
                                        &digest, sizeof digest, &context);
    }
    kvpi_prompt_keys_derive(layers, 1, blocks, from, blocks, keys);
}

void kvpi_sched_keys(const kvp_scheduler *s, kvp_cache *const *caches, uint64_t id,
                     size_t sample, const double *rows, size_t len, size_t from, size_t blocks,
                     kvp_block_key *keys)
{
    const kvp_request *q = &record_of(s, id)->request;
    if (q->block_digest != NULL) {
        digest_keys(s, caches, id, sample, from, blocks, keys);
    } else {
        kvpi_prompt_keys_from(caches, s->layers, &q->salt, rows, len, s->width, from, blocks,
                              keys);
    }
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
        return; /* nothing keyed, or parked already (parked_keys checked the digests) */
    }
    set->id = NO_REQUEST;
    if (kvpi_sched_grow((void **)&set->keys, &set->room, count + s->layers,
                        sizeof *set->keys) != 0) {
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
 * Request `id`'s prompt keys when they are parked (s->parked, or a slot of
 * s->ranked), made under the bindings idle[0] has now; NULL when they must
 * be computed. The same id, rows and bindings give the same keys
 * (kvpi_prompt_keys reads nothing else), so no admission changes: the plan
 * only skips the rows and the hashing a waiting request would redo, and
 * probes the parked keys where they are (copied to the step's keys only
 * when admitted).
 */
static const kvp_block_key *parked_keys(const kvp_scheduler *s, uint64_t id, size_t count)
{
    const keyset *set = keyset_valid(s, &s->parked, id, count) ? &s->parked : NULL;
    for (size_t i = 0; set == NULL && i < WINDOW; i++) {
        set = keyset_valid(s, &s->ranked[i], id, count) ? &s->ranked[i] : NULL;
    }
    return set != NULL ? set->keys : NULL;
}

/*
 * The prompt blocks request `q`'s keys cover (0: not keyed), and in
 * *adoptable those it may adopt (the last prompt token is always computed).
 */
static size_t key_blocks_of(const kvp_scheduler *s, const kvp_request *q, size_t *adoptable)
{
    size_t bt = s->block_tokens;
    *adoptable = 0;
    if (!kvpi_sched_keyed(s, q)) {
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
 * Window position i of n: *first when it goes first (preempted, overtaken
 * KVP_SCHEDULE_MAX_SKIPS times, or never fitting), else *hits, the prompt
 * blocks the index holds now (0 when not keyed or when even its best case
 * is not admitted now: then no rows are read and nothing is hashed).
 */
static kvp_status rank_entry(kvp_scheduler *s, const plan *p, size_t i, size_t n, int *first,
                             size_t *hits, kvp_error *err)
{
    uint64_t id = p->ids[i];
    const record *r = record_of(s, id);
    const kvp_request *q = &r->request;
    kvp_admission whole;
    kvp_status status = kvp_pool_admit(s->pool, request_pages(s, r, q->max_new_tokens, 0),
                                       s->watermark_pages, &whole, err);
    if (status != KVP_OK) {
        return status;
    }
    *first = r->preemptions > 0 || r->skips >= KVP_SCHEDULE_MAX_SKIPS ||
             whole == KVP_ADMIT_NEVER;
    *hits = 0;
    size_t adoptable;
    size_t key_blocks = key_blocks_of(s, q, &adoptable);
    if (*first || key_blocks == 0) {
        return KVP_OK;
    }
    kvp_admission best;
    status = kvp_pool_admit(s->pool, request_pages(s, r, sample_tokens(s, r), adoptable),
                            s->watermark_pages, &best, err);
    if (status != KVP_OK || best != KVP_ADMIT_NOW) {
        return status;
    }
    size_t key_count = kvpi_prompt_keys_count(s->layers, 1, key_blocks);
    if (kvpi_sched_grow((void **)&s->keys, &s->keys_room, key_count, sizeof *s->keys) != 0 ||
        kvpi_sched_grow((void **)&s->rows, &s->rows_room, kvpi_sched_rows_needed(s, r),
                        s->width * sizeof *s->rows) != 0) {
        return kvpi_fail_alloc(err, "scheduler prefix keys", key_count * sizeof *s->keys);
    }
    const kvp_block_key *keys = parked_keys(s, id, key_count);
    if (keys == NULL) {
        kvpi_sched_fill_request(s, id, s->rows);
        kvpi_sched_keys(s, lease_caches(&s->idle[0]), id, 0, s->rows, q->prompt_tokens, 0,
                        key_blocks, s->keys);
        park_keys(s, ranked_slot(s, id, p->ids, n), id, s->keys, key_count);
        keys = s->keys;
    }
    size_t evictable;
    *hits = kvpi_prefix_probe(s->pool, keys, s->layers, s->windows, s->block_tokens, adoptable,
                              &evictable);
    return KVP_OK;
}

/* p->order: insertion sort by (first desc, hits desc, position asc): stable, n <= WINDOW. */
static void sort_window(plan *p, const int *first, const size_t *hits, size_t n)
{
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
        kvp_status status = rank_entry(s, p, i, n, &first[i], &hits[i], err);
        if (status != KVP_OK) {
            return status;
        }
    }
    sort_window(p, first, hits, n);
    p->window = n;
    return KVP_OK;
}

/* The plan's totals so far: pages asked, rows read and keys made by the requests it admitted. */
typedef struct totals {
    size_t asked;
    size_t rows;
    size_t keys;
} totals;

/* One queue entry the plan considers. */
typedef struct candidate {
    uint64_t id;
    size_t pos;          /* its queue position */
    const record *r;
    size_t key_blocks;   /* prompt blocks keyed (0: not keyed) */
    size_t adoptable;    /* of which it may adopt */
    size_t need_rows;    /* rows its admission reads (rows_needed) */
    double *at;          /* where they go: s->rows + totals.rows * width, or NULL (none) */
    int filled;          /* its rows are read */
    size_t key_count;    /* its keys, at s->keys + totals.keys once admitted */
    const kvp_block_key *keys; /* where they are now: there, or parked */
    size_t hits;         /* prompt blocks the index holds now */
    size_t evictable;    /* of their pages, those evictable (adopting takes them) */
} candidate;

/* 1 when the running sequences and those planned leave no room for q's samples. */
static int max_running_reached(const kvp_scheduler *s, const plan *p, const kvp_request *q)
{
    size_t busy = s->running_count + p->slots;
    /* A request with more samples than max_running runs alone. */
    return s->config.max_running != 0 && busy + q->samples > s->config.max_running && busy > 0;
}

/* *now: kvp_pool_admit answers NOW for `pages` above the watermark. */
static kvp_status admits_now(const kvp_scheduler *s, size_t pages, int *now, kvp_error *err)
{
    kvp_admission admission;
    kvp_status status = kvp_pool_admit(s->pool, pages, s->watermark_pages, &admission, err);
    *now = status == KVP_OK && admission == KVP_ADMIT_NOW;
    return status;
}

/* The plan takes candidate c: admitted (its rows and keys at the totals t) or rejected. */
static void plan_take(kvp_scheduler *s, plan *p, const candidate *c, int admit, const totals *t)
{
    if (admit) {
        s->plan[p->popped++] = (planned){c->id, c->pos, 1, t->rows, t->keys, c->key_blocks, 0};
    } else {
        s->plan[p->popped++] = (planned){c->id, c->pos, 0, 0, 0, 0, 0};
    }
    p->span = c->pos + 1 > p->span ? c->pos + 1 : p->span;
}

/* Room for c's rows after the totals' (read later, or by key_prompt). */
static kvp_status room_for_rows(kvp_scheduler *s, candidate *c, const totals *t, kvp_error *err)
{
    c->need_rows = kvpi_sched_rows_needed(s, c->r);
    if (kvpi_sched_grow((void **)&s->rows, &s->rows_room, t->rows + c->need_rows,
                        s->width * sizeof *s->rows) != 0) {
        return kvpi_fail_alloc(err, "scheduler prompt rows",
                               (t->rows + c->need_rows) * s->width * sizeof(double));
    }
    /* NULL when it reads no rows (allocator-only, nothing keyed): never NULL + 0 */
    c->at = c->need_rows != 0 ? s->rows + t->rows * s->width : NULL;
    return KVP_OK;
}

/*
 * c's prompt keys after the totals' (parked ones, or made from its rows,
 * read now), and the prompt blocks the prefix index holds now.
 */
static kvp_status key_prompt(kvp_scheduler *s, candidate *c, const totals *t, kvp_error *err)
{
    const kvp_request *q = &c->r->request;
    c->key_count = kvpi_prompt_keys_count(s->layers, 1, c->key_blocks);
    if (kvpi_sched_grow((void **)&s->keys, &s->keys_room, t->keys + c->key_count,
                        sizeof *s->keys) != 0) {
        return kvpi_fail_alloc(err, "scheduler prefix keys",
                               (t->keys + c->key_count) * sizeof *s->keys);
    }
    kvp_block_key *k = s->keys + t->keys;
    c->keys = parked_keys(s, c->id, c->key_count);
    if (c->keys == NULL) {
        kvpi_sched_fill_request(s, c->id, c->at);
        c->filled = 1;
        kvpi_sched_keys(s, lease_caches(&s->idle[0]), c->id, 0, c->at, q->prompt_tokens, 0,
                        c->key_blocks, k);
        c->keys = k;
    }
    /* adoption's rule, windows included: the blocks and evictable pages adopt_prompt will find */
    c->hits = kvpi_prefix_probe(s->pool, c->keys, s->layers, s->windows, s->block_tokens,
                                c->adoptable, &c->evictable);
    return KVP_OK;
}

/*
 * Plans queue position `pos`: rejected when it can never fit; admitted when
 * it fits now, its rows read and keys made; else the plan stops there
 * (*more 0), its keys parked for the next plans (park_keys).
 */
static kvp_status plan_entry(kvp_scheduler *s, plan *p, size_t pos, totals *t, int *more,
                             kvp_error *err)
{
    candidate c;
    memset(&c, 0, sizeof c);
    c.pos = pos;
    c.id = s->waiting[queue_at(s, pos)];
    c.r = record_of(s, c.id);
    const kvp_request *q = &c.r->request;
    *more = 0;
    if (max_running_reached(s, p, q)) {
        return KVP_OK;
    }
    kvp_admission whole;
    kvp_status status = kvp_pool_admit(s->pool, request_pages(s, c.r, q->max_new_tokens, 0),
                                       s->watermark_pages, &whole, err);
    if (status != KVP_OK || whole == KVP_ADMIT_NEVER) {
        if (status == KVP_OK) {
            plan_take(s, p, &c, 0, t);
            *more = 1;
        }
        return status;
    }
    c.key_blocks = key_blocks_of(s, q, &c.adoptable);
    /*
     * The best case first: every adoptable block a hit, no evictable
     * page taken. The pages asked below are at least these (fewer hits
     * ask more, evictable ones add), and kvp_pool_admit is monotone in
     * the pages asked, so when even the best case is not NOW the request
     * is not admitted now: stop before reading and hashing its rows.
     */
    int now;
    status = admits_now(
        s, add_sat(request_pages(s, c.r, sample_tokens(s, c.r), c.adoptable), t->asked), &now,
        err);
    if (status != KVP_OK || !now) {
        return status;
    }
    status = room_for_rows(s, &c, t, err);
    if (status == KVP_OK && c.key_blocks != 0) {
        status = key_prompt(s, &c, t, err);
    }
    size_t need = request_need(s, c.r, sample_tokens(s, c.r), c.hits, c.evictable);
    if (status == KVP_OK) {
        status = admits_now(s, add_sat(need, t->asked), &now, err);
    }
    if (status != KVP_OK || !now) {
        if (status == KVP_OK) {
            park_keys(s, &s->parked, c.id, c.keys, c.key_count);
        }
        return status;
    }
    if (!c.filled) {
        kvpi_sched_fill_request(s, c.id, c.at);
    }
    if (c.key_count != 0 && c.keys != s->keys + t->keys) {
        memcpy(s->keys + t->keys, c.keys, c.key_count * sizeof *c.keys); /* parked ones */
    }
    t->asked = add_sat(t->asked, need);
    plan_take(s, p, &c, 1, t);
    t->rows += c.need_rows;
    t->keys += c.key_count;
    p->admitted++;
    p->slots += q->samples;
    *more = 1;
    return KVP_OK;
}

/*
 * Admission while the next request fits now, decided without changing
 * anything. The order: the queue's (FCFS), or with the cache-aware schedule
 * the window's rank (rank_window), then the queue's past the window. Each
 * request asks kvp_pool_admit for the pages it will newly take (its prompt
 * pages not covered by the prefix the index holds now, plus the evictable
 * pages adopting that prefix takes from the available ones, plus its
 * samples' pages) plus what the requests planned before it in this step
 * asked (plan_entry). The rows each admitted request's prefill reads, and
 * its prompt keys, are made here (the scratch grows: an ALLOCATION_FAILED
 * still changes nothing); the keys of the request it stops at are parked
 * for the next plans (park_keys). Needs a lease with current bindings in
 * idle[0] when a request is keyed (kvp_scheduler_step makes one).
 */
kvp_status kvpi_sched_plan_admission(kvp_scheduler *s, plan *p, kvp_error *err)
{
    memset(p, 0, sizeof *p);
    if (s->config.schedule == KVP_SCHEDULE_CACHE_AWARE) {
        kvp_status status = rank_window(s, p, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    totals t = {0, 0, 0};
    int more = 1;
    for (size_t i = 0; more && i < s->waiting_count; i++) {
        kvp_status status = plan_entry(s, p, i < p->window ? p->order[i] : i, &t, &more, err);
        if (status != KVP_OK) {
            return status;
        }
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
        (void)kvpi_sched_queue_pop_front(s);
    }
}

/*
 * The record keeps the prompt's block keys and layer ids the plan made
 * (planned.keys), for publication to continue (scheduler_step.c: prepare
 * made the room).
 */
static void keep_chain(kvp_scheduler *s, const planned *pl, record *rec)
{
    rec->chain_blocks = 0;
    rec->prompt_registered = 0; /* until its prefill publishes the prompt (fork_samples) */
    size_t count = pl->key_blocks + s->layers;
    if (pl->key_blocks == 0 || rec->chain_room < count) {
        return;
    }
    const kvp_block_key *chain =
        kvpi_prompt_keys_chain(s->keys + pl->keys, s->layers, 1, pl->key_blocks);
    memcpy(rec->chain, chain, count * sizeof *chain);
    rec->chain_blocks = pl->key_blocks;
}

/* Takes the plan's entries: rejected ones finish, admitted ones take a lease per sample. */
void kvpi_sched_admit(kvp_scheduler *s, const plan *p, kvp_step_stats *st)
{
    for (size_t i = 0; i < p->popped; i++) {
        uint64_t id = s->plan[i].id;
        if (!s->plan[i].admit) {
            kvpi_sched_finish(s, id, 1, KVP_OK, NULL);
            st->rejected++;
            continue;
        }
        record *rec = record_of(s, id);
        keep_chain(s, &s->plan[i], rec);
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
void kvpi_sched_count_skips(kvp_scheduler *s, const plan *p)
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
