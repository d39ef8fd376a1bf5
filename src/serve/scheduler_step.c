/*
 * scheduler_step.c: a step of the scheduler: room, preemption, decode and
 * publication (kvp_scheduler_step; the scheduler's rooms:
 * scheduler_internal.h).
 *
 * Owns: the order of a step. First what may fail, changing nothing: room
 * for the worst case of the step (prepare), a lease with current bindings
 * to key prompts with (key_lease), the plan, the decoder's slot for the
 * prefills. Then, the step standing: admission, prefill, sessions, room
 * for this step's pages (make_room: kept sessions go first, then stale
 * requests, then the newest ones are preempted by recompute), one token
 * for every running sequence (decode, through its lease), publication of
 * completed requests' decoded blocks, and the step's statistics.
 *
 * Invariants: the scheduler's (scheduler_internal.h); here in particular,
 * a failure before the step stands frees only the leases it made (the
 * idle list is what it was, in another order) and changes nothing else;
 * idle leases bound to old weights are freed only once the step stands;
 * before decode the pages a take can get cover every running sequence's
 * new pages this step.
 * Callers: the public API (kvp_scheduler_step), one caller at a time per
 * scheduler. Calls every other room.
 */
#include <string.h>

#include "pager/abi.h"
#include "pager/cache_internal.h"
#include "pager/error.h"
#include "serve/scheduler_internal.h"
#include "serve/share_internal.h"

void kvp_step_stats_init(kvp_step_stats *stats)
{
    if (stats == NULL) {
        return;
    }
    memset(stats, 0, sizeof *stats);
    stats->struct_size = sizeof *stats;
}

/*
 * The longest request that may complete in this step's decode and publish
 * its decoded blocks (publish_decoded): the running and newly admitted
 * requests one token short of their budget. 0: none. *rows: the longest
 * of those keyed by rows (their rows are read); digests read none.
 */
static size_t publish_tokens(const kvp_scheduler *s, const plan *p, size_t *rows)
{
    *rows = 0;
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
        if (!publishes(s, q) || r->generated + 1 < q->max_new_tokens) {
            continue;
        }
        longest = len > longest ? len : longest;
        if (q->block_digest == NULL && len > *rows) {
            *rows = len; /* keyed by rows: read them (digests need none) */
        }
    }
    return longest;
}

/*
 * Before the step stands: room in each admitted request's record for the
 * prompt keys the plan made (kvpi_sched_admit keeps them there for
 * publication). ALLOCATION_FAILED changes nothing (a record's buffer is
 * scratch no decision reads).
 */
static kvp_status room_for_chains(kvp_scheduler *s, const plan *p, kvp_error *err)
{
    for (size_t i = 0; i < p->popped; i++) {
        const planned *pl = &s->plan[i];
        if (!pl->admit || pl->key_blocks == 0) {
            continue;
        }
        record *rec = record_of(s, pl->id);
        size_t count = pl->key_blocks + s->layers;
        if (kvpi_sched_grow((void **)&rec->chain, &rec->chain_room, count,
                            sizeof *rec->chain) != 0) {
            return kvpi_fail_alloc(err, "scheduler prompt keys", count * sizeof *rec->chain);
        }
    }
    return KVP_OK;
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
    size_t publish_rows;
    size_t publish = publish_tokens(s, p, &publish_rows);
    size_t publish_keys = kvpi_prompt_keys_count(s->layers, 1, publish / s->block_tokens);
    if (kvpi_sched_grow((void **)&s->rows, &s->rows_room, publish_rows,
                        s->width * sizeof *s->rows) != 0 ||
        kvpi_sched_grow((void **)&s->keys, &s->keys_room, publish_keys, sizeof *s->keys) != 0) {
        return kvpi_fail_alloc(err, "scheduler publication scratch",
                               publish_rows * s->width * sizeof(double));
    }
    kvp_status kept = room_for_chains(s, p, err);
    if (kept != KVP_OK) {
        return kept;
    }
    if (kvpi_sched_grow((void **)&s->running, &s->running_room, slots, sizeof *s->running) != 0 ||
        kvpi_sched_grow((void **)&s->idle, &s->idle_room, leases, sizeof *s->idle) != 0 ||
        kvpi_sched_grow((void **)&s->done, &s->done_room, finishing, sizeof *s->done) != 0 ||
        kvpi_sched_grow((void **)&s->jobs, &s->jobs_room, slots, sizeof *s->jobs) != 0 ||
        kvpi_sched_grow((void **)&s->kept, &s->kept_room, s->kept_count + slots,
                        sizeof *s->kept) != 0) {
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
    kvpi_sched_retire_request(s, id);
    r->state = STATE_WAITING;
    r->preemptions++;
    kvpi_sched_queue_push_front(s, id);
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
            kvpi_sched_drop_kept(s, 0, 0); /* kept sessions go before running requests */
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
 * sample's reply (a conversation's next turn) adopts them. The prompt is
 * not keyed again: its block keys are the record's, kept from admission
 * (keep_chain), made under the layer ids checked here (a lease that is not
 * stale has them; one that is publishes nothing). When its prefill
 * registered every prompt page (rec->prompt_registered; held since, they
 * still are) only the blocks past the prompt's are published; else the
 * prompt's per-layer keys are derived again, once, and published with them
 * (pages registered under their keys stay so; one the prefill left
 * unregistered, its key naming another page then, may be registered now).
 * Each sample continues the chain over its own blocks, as any sample's
 * reply may be the one a later prompt holds. Without kept keys (a prompt
 * with no full block) the prompt is keyed again, from its rows or digests. The rows and keys are the step's
 * scratch, free once the prefills ran (prepare made the room:
 * publish_tokens).
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
    int rows = q->block_digest == NULL; /* digests key it without rows */
    int kept = rec->chain_blocks == from && from != 0;
    /* Its prompt's pages are registered under these keys (held since): publish past them. */
    size_t first_block = kept && rec->prompt_registered ? from : 0;
    if (rows) { /* the prompt's, or with kept keys only those of its partial last block */
        size_t first = kept ? from * s->block_tokens : 0;
        kvpi_sched_fill_rows(s, id, 0, first, prompt, s->rows + first * s->width);
    }
    kvp_block_key *chain = kvpi_prompt_keys_chain(s->keys, s->layers, 1, blocks);
    if (kept) {
        memcpy(chain, rec->chain, from * sizeof *chain);
    }
    int prompt_keyed = 0;
    for (size_t i = 0; i < s->running_count; i++) {
        const slot *r = &s->running[i];
        if (r->id != id || lease_stale(s, &r->lease)) {
            continue;
        }
        assert(lease_len(&r->lease) == len);
        kvp_cache *const *caches = lease_caches(&r->lease);
        if (rows) {
            kvpi_sched_fill_rows(s, id, r->sample, prompt, len, s->rows + prompt * s->width);
        }
        kvpi_sched_keys(s, caches, id, r->sample, s->rows, len, kept || prompt_keyed ? from : 0,
                        blocks, s->keys);
        if (kept && memcmp(chain + blocks, rec->chain + from, s->layers * sizeof *chain) != 0) {
            continue; /* the prompt was keyed under other bindings: not reached (not stale) */
        }
        if (kept && !prompt_keyed && first_block == 0) {
            kvpi_prompt_keys_derive(s->layers, 1, blocks, 0, from, s->keys);
        }
        prompt_keyed = 1;
        /* The prompt's pages are registered under these very keys, the rest are fresh. */
        kvp_status status = kvpi_cache_group_publish_range(caches, s->layers, s->keys,
                                                           first_block, blocks, NULL, NULL);
        assert(status == KVP_OK);
        (void)status;
    }
}

/* After the decode of slots [0, count): failed jobs mark their requests; the others count. */
static void count_decoded(kvp_scheduler *s, size_t count, kvp_step_stats *st)
{
    for (size_t i = 0; i < count; i++) {
        s->running[i].job = i;
        if (s->jobs[i].status != KVP_OK) {
            kvpi_sched_mark_failed(s, s->running[i].id, &s->jobs[i].error);
        }
    }
    for (size_t i = 0; i < count; i++) {
        slot *r = &s->running[i];
        record *rec = record_of(s, r->id);
        if (!rec->failed) {
            s->stats.tokens_generated++;
            st->decoded++;
            if (r->sample == 0 && rec->generated == 0) {
                rec->first_token_step = s->stats.steps;
            }
            rec->generated += r->sample == 0; /* the samples advance together */
        }
        r->job = NO_JOB;
    }
}

/* The requests whose samples all have their budget publish, keep their session and finish. */
static void finish_complete(kvp_scheduler *s, kvp_step_stats *st)
{
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
        kvpi_sched_keep_session(s, id);
        kvpi_sched_retire_request(s, id);
        kvpi_sched_finish(s, id, 0, KVP_OK, NULL);
        st->finished++;
        i = s->running_count;
    }
}

/*
 * One token for every running sequence, through its lease: the inputs (an
 * allocator-only lease appends its zero row here), the decoder's batch (a
 * refusal is returned with nothing decoded), the outputs to on_token.
 * Then a job's failure fails its request (all its samples), every decoded
 * token counts, and the requests whose every sample has its budget retire.
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
    for (size_t i = 0; i < count; i++) {
        slot *r = &s->running[i];
        lease_decode_input(s, r, &record_of(s, r->id)->request, &s->jobs[i]);
    }
    kvp_status status = leases_decode(s, count, err);
    if (status != KVP_OK) {
        return status;
    }
    for (size_t i = 0; i < count; i++) {
        slot *r = &s->running[i];
        lease_decode_output(s, r, &record_of(s, r->id)->request, &s->jobs[i]);
    }
    count_decoded(s, count, st);
    kvpi_sched_fail_marked(s, 0, st);
    finish_complete(s, st);
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
    if (kvpi_sched_grow((void **)&s->idle, &s->idle_room, s->running_count + s->idle_count + 1,
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

/*
 * A lease of a model with sliding layers, in the step's figures: a block a
 * window released holds no page and no position, so the lease's own pages
 * and used slots count its held blocks (whole blocks were released), and
 * its sliding layers' pages are counted apart.
 */
static void count_windows(const kvp_scheduler *s, const lease *l, kvp_step_stats *st)
{
    kvp_cache *const *caches = lease_caches(l);
    size_t len = lease_len(l);
    for (size_t k = 0; k < s->layers; k++) {
        size_t held = kvpi_cache_held_blocks(caches[k]);
        size_t released = blocks_of(s, len) - held;
        st->unshared_pages -= released;
        st->used_slots -= released * s->block_tokens;
        if (s->windows[2 * k] != 0) {
            st->sliding_held_pages += held;
        }
    }
}

/* The end of a step's statistics: kept, pool and page-table usage, running and waiting. */
static void step_usage(const kvp_scheduler *s, kvp_step_stats *st)
{
    st->retained_pages = s->kept_pages;
    kvp_pool_stats pool;
    kvp_pool_stats_init(&pool);
    if (kvp_pool_stats_get(s->pool, &pool, NULL) == KVP_OK) {
        st->held_pages = pool.held_pages;
        st->total_pages = pool.total_pages;
        st->cached_pages = pool.cached_pages;
        st->evictable_pages = pool.evictable_pages;
    }
    for (size_t i = 0; i < s->running_count; i++) {
        size_t len = lease_len(&s->running[i].lease);
        st->used_slots += s->layers * len;
        st->unshared_pages += s->layers * blocks_of(s, len);
        if (s->windows != NULL) {
            count_windows(s, &s->running[i].lease, st);
        }
    }
    for (size_t i = 0; i < s->kept_count; i++) {
        st->used_slots += s->layers * lease_len(&s->kept[i].lease);
        st->unshared_pages += s->kept[i].pages;
    }
    st->running = s->running_count;
    st->waiting = s->waiting_count;
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
    if (kvpi_sched_grow((void **)&s->plan, &s->plan_room, s->waiting_count,
                        sizeof *s->plan) != 0 ||
        kvpi_sched_queue_grow(s, s->waiting_count + s->running_count) != 0) {
        return kvpi_fail_alloc(err, "scheduler admission plan",
                               s->waiting_count * sizeof *s->plan);
    }
    size_t idle_before = s->idle_count;
    int made = 0;
    status = key_lease(s, &made, err); /* the plan keys prompts with idle[0]'s bindings */
    plan p;
    if (status == KVP_OK) {
        status = kvpi_sched_plan_admission(s, &p, err);
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
    kvpi_sched_tier_prefetch(s, &p); /* waiting requests' missed blocks, asked now */
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    size_t first = s->running_count;
    kvpi_sched_admit(s, &p, &st);
    kvpi_sched_prefill_prompts(s, &p, first);
    kvpi_sched_prefill_forks(s, &p, first, &st);
    kvpi_sched_use_sessions(s, &p);
    kvpi_sched_count_skips(s, &p);
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
    kvpi_sched_drop_sessions(s, st.admitted);
    step_usage(s, &st);
    if (stats != NULL) {
        (void)kvpi_struct_out(stats, &st, sizeof st, KVPI_STEP_STATS_SIZE_FIRST, NULL);
    }
    return KVP_OK;
}
