/*
 * scheduler_prefill.c: the batched prefill of the requests a step admits
 * (the scheduler's rooms: scheduler_internal.h).
 *
 * Owns: the step's prefill jobs (s->jobs while prefilling) and the two
 * phases that run them: prompts (every request adopts its indexed prefix,
 * then each loads from the tier, promises, appends the prompt) and forks
 * (publish the prompt's blocks, fork sample 0 into the other samples,
 * promise exactly, append what each sample generated
 * before a preemption: with sliding layers in block-aligned chunks, one
 * decoder batch a round, append_tails). Appends go through the lease
 * (lease_append): a computed lease adds a decoder job, an allocator-only
 * one appends zero rows at once, so the phases read the same for both.
 *
 * Invariants: the admitted requests' slots are [first, running_count), in
 * plan order, each request's samples together; the prompt batch runs in
 * the decoder's step slot the step reserved before admitting, so it
 * cannot be refused; a failed job fails its whole request after the phase
 * (mark, then fail), and a request that failed publishes and forks
 * nothing; the statistics count the requests that did not fail; with
 * sharing, sample 0's caches release nothing their windows let go from the
 * prompt phase until the fork phase published the prompt's blocks
 * (kvpi_cache_hold_release_many), so later prompts find every block a
 * sliding layer may need, not only those it still holds at the end.
 * Callers: scheduler_step.c (kvp_scheduler_step, after admit). Calls the
 * queue room and leases.
 */
#include <string.h>

#include "pager/cache_internal.h"
#include "pager/pool_internal.h"
#include "serve/scheduler_internal.h"
#include "serve/sequence_internal.h"

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

/* After run_jobs: marks the requests whose jobs failed, and forgets the jobs. */
static void collect_jobs(kvp_scheduler *s, size_t first)
{
    for (size_t i = first; i < s->running_count; i++) {
        slot *r = &s->running[i];
        if (r->job != NO_JOB && s->jobs[r->job].status != KVP_OK) {
            kvpi_sched_mark_failed(s, r->id, &s->jobs[r->job].error);
        }
        r->job = NO_JOB;
    }
}

/* A failed allocator-only append fails slot r's request (a computed one's job tells later). */
static void append(kvp_scheduler *s, slot *r, size_t row, size_t tokens, size_t *jobs)
{
    kvp_error e;
    memset(&e, 0, sizeof e);
    if (lease_append(s, r, row, tokens, jobs, &e) != KVP_OK) {
        kvpi_sched_mark_failed(s, r->id, &e);
    }
}

/*
 * Blocks the planned request adopts from the prefix index into sample 0's
 * lease `l0` (its prompt's adoptable ones the index holds, in order).
 */
static size_t adopt_prefix(kvp_scheduler *s, const planned *pl, size_t prompt, lease *l0)
{
    if (pl->key_blocks == 0) {
        return 0;
    }
    size_t adoptable = (prompt - 1) / s->block_tokens;
    size_t blocks = 0;
    /* A page published under another binding (a forged key) is no hit: adopt nothing. */
    if (kvp_cache_group_adopt(lease_caches(l0), s->layers, s->keys + pl->keys,
                              adoptable < pl->key_blocks ? adoptable : pl->key_blocks, &blocks,
                              NULL) != KVP_OK) {
        blocks = 0;
    }
    return blocks;
}

/*
 * Promises: what each of the request's leases (slots at..at + n) will newly
 * take; forked samples' pages past the prompt are promised to their own
 * (still empty) leases. A lease's promise is capped at what one sequence
 * can hold; the promises are set exactly after the fork (prefill_forks).
 */
static void promise_samples(kvp_scheduler *s, const record *rec, size_t at, size_t adopted)
{
    size_t n = rec->request.samples;
    size_t x = sample_tokens(s, rec);
    size_t cap = s->layers * blocks_of(s, s->config.capacity);
    for (size_t k = 0; k < n; k++) {
        lease *l = &s->running[at + k].lease;
        size_t want;
        if (s->windows != NULL) {
            /* what admission asked for it, with the blocks sample 0 adopted */
            want = kvpi_sched_window_sample_pages(s, rec, x, k, adopted / s->block_tokens);
            if (k == 0 && adopted != 0) {
                /*
                 * That level counts every page held, the adopted ones too,
                 * which sample 0 holds now: promise only what it may still
                 * take, its prefill's blocks or its level less what it holds.
                 */
                size_t prefill = lease_pages_for(s, l, rec->request.prompt_tokens);
                size_t level = lease_level_for(s, l, rec->request.prompt_tokens + x);
                want = prefill > level ? prefill : level;
            }
        } else if (n == 1 || !s->config.sharing || k == 0) {
            want = lease_pages_for(s, l, rec->request.prompt_tokens + x);
        } else {
            want = sample_pages(s, rec, x);
        }
        kvp_status status = lease_promise(s, l, want < cap ? want : cap, NULL);
        assert(status == KVP_OK); /* within the cap */
        (void)status;
    }
}

/*
 * Every admitted request (slots from `first`, in plan order) adopts its
 * indexed prefix into sample 0's lease, pl->adopted its tokens, before any
 * of them loads or appends: those take fresh pages, and with none free a
 * take borrows the least recently used cached page, maybe an evictable hit
 * a later request's admission counted (it would then compute that block
 * and every hit after it, held ones admission charged nothing). Adopted,
 * the hits are held (DESIGN.md "Admission and promises").
 */
static void adopt_prefixes(kvp_scheduler *s, const plan *p, size_t first)
{
    size_t at = first;
    for (size_t i = 0; i < p->popped; i++) {
        planned *pl = &s->plan[i];
        if (pl->admit) {
            const record *rec = record_of(s, pl->id);
            pl->adopted = s->block_tokens *
                          adopt_prefix(s, pl, rec->request.prompt_tokens, &s->running[at].lease);
            at += rec->request.samples;
        }
    }
}

/*
 * Phase 1 of the admitted requests' prefill (slots [first, running_count),
 * in plan order, each request's samples together): every request adopts
 * its indexed prefix (sharing; adopt_prefixes), then each in turn loads
 * the rest of its chain from the tier, promises, and appends the prompt
 * (sharing: once, in
 * sample 0; off: every sample its prompt and continuation). Computed
 * leases' appends are one batch of decoder jobs, in the decoder's step
 * slot the step reserved (prefills_on_decoder), so it cannot be refused.
 */
void kvpi_sched_prefill_prompts(kvp_scheduler *s, const plan *p, size_t first)
{
    size_t count = 0;
    size_t at = first;
    size_t computed = 0; /* prompt tokens the batch computes (the tier's cost model) */
    adopt_prefixes(s, p, first);
    for (size_t i = 0; i < p->popped; i++) {
        planned *pl = &s->plan[i];
        if (!pl->admit) {
            continue;
        }
        const record *rec = record_of(s, pl->id);
        size_t n = rec->request.samples;
        size_t prompt = rec->request.prompt_tokens;
        size_t g = rec->generated;
        if (pl->key_blocks != 0) { /* then the tier's blocks, after the index's (scheduler_tier.c) */
            size_t bt = s->block_tokens;
            pl->adopted += bt * kvpi_sched_tier_load(s, pl, pl->adopted / bt, (prompt - 1) / bt,
                                                     &s->running[at].lease);
        }
        promise_samples(s, rec, at, pl->adopted);
        if (s->config.sharing) {
            /* Windows release nothing until fork_samples published the prompt's blocks. */
            kvpi_cache_hold_release_many(lease_caches(&s->running[at].lease), s->layers);
            /* Windows: the generated tokens go in chunks after the fork (append_tails). */
            size_t tokens = prompt - pl->adopted + (n == 1 && s->windows == NULL ? g : 0);
            append(s, &s->running[at], pl->rows + pl->adopted, tokens, &count);
            computed += tokens;
        } else {
            size_t tokens = prompt + (s->windows == NULL ? g : 0); /* as above */
            for (size_t k = 0; k < n; k++) {
                append(s, &s->running[at + k], pl->rows + k * (prompt + g), tokens, &count);
            }
        }
        at += n;
    }
    if (prefills_on_decoder(s, p)) {
        double t0 = kvpi_sched_tier_clock();
        kvpi_decoder_step_reserved(s->decoder, s->jobs, count);
        kvpi_sched_tier_prefilled(s, computed, kvpi_sched_tier_clock() - t0);
        collect_jobs(s, first);
    }
}

/*
 * Sharing: the request's prompt blocks are published, sample 0 (slot
 * `here`) forks into its other samples' leases, each lease is promised
 * exactly its pages to come, and each forked sample appends the tokens it
 * generated before a preemption (its rows after the prompt's; sliding
 * layers: append_tails, after every fork).
 */
static void fork_samples(kvp_scheduler *s, const planned *pl, record *rec, size_t here,
                         size_t *count)
{
    size_t n = rec->request.samples;
    size_t prompt = rec->request.prompt_tokens;
    size_t g = rec->generated;
    kvp_cache *const *parent = lease_caches(&s->running[here].lease);
    rec->prompt_registered = 0;
    if (pl->key_blocks != 0) {
        /* Fresh pages, or pages registered under these very keys: cannot be refused. */
        size_t left = 0;
        kvp_status status = kvpi_cache_group_publish_range(parent, s->layers, s->keys + pl->keys,
                                                           0, pl->key_blocks, &left, NULL);
        assert(status == KVP_OK);
        (void)status;
        /*
         * Every page registered: held, they stay so until the request's pages
         * go back (but those a window releases below, which wait on the LRU list).
         */
        rec->prompt_registered = left == 0;
    }
    /*
     * Published, the blocks no window needs go (to the LRU list: later
     * prompts still adopt them) before the fork, which shares only live ones.
     */
    size_t released = kvpi_cache_resume_release_many(parent, s->layers);
    if (n == 1 && (released != 0 || s->windows != NULL)) {
        /*
         * The prefill's settle refunded nothing: its promise, exactly, from
         * here: its level (a sliding layer's peak), within what admission
         * asked for it (kvpi_sched_window_sample_pages).
         */
        lease *l0 = &s->running[here].lease;
        size_t cap = s->layers * blocks_of(s, s->config.capacity);
        size_t want = lease_level_for(s, l0, prompt + sample_tokens(s, rec));
        kvp_status status = lease_promise(s, l0, want < cap ? want : cap, NULL);
        assert(status == KVP_OK); /* within the cap */
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
        return;
    }
    size_t x = sample_tokens(s, rec);
    for (size_t k = 0; k < n; k++) {
        lease *l = &s->running[here + k].lease;
        /* Its level: without windows every block (lease_pages_for's count). */
        kvp_status status = lease_promise(s, l, lease_level_for(s, l, prompt + x), NULL);
        assert(status == KVP_OK);
        (void)status;
        if (g != 0 && s->windows == NULL) { /* windows: append_tails, in chunks */
            append(s, &s->running[here + k], pl->rows + prompt + k * g, g, count);
        }
    }
}

/* The prefill statistics of the step's admitted requests that did not fail. */
static void count_prefill(const kvp_scheduler *s, const plan *p, kvp_step_stats *st)
{
    for (size_t i = 0; i < p->popped; i++) {
        const planned *pl = &s->plan[i];
        if (!pl->admit) {
            continue;
        }
        record *rec = record_of(s, pl->id);
        size_t n = rec->request.samples;
        size_t prompt = rec->request.prompt_tokens;
        size_t g = rec->generated;
        if (rec->failed) {
            continue;
        }
        size_t computed = s->config.sharing ? prompt - pl->adopted + n * g : n * (prompt + g);
        st->prompt_tokens += prompt;
        st->prefix_hit_tokens += pl->adopted;
        st->prefill_tokens += computed;
        if (rec->admissions++ == 0) { /* the request's figures (kvp_request_result) */
            rec->first_hit_tokens = pl->adopted;
            rec->admitted_step = s->stats.steps;
        } else {
            rec->recomputed_tokens += computed;
        }
    }
}

/*
 * Sliding layers: once request `rec`'s prefill (slots here..here + n) ended
 * and its windows released, each sample's promise is set to its level
 * (lease_level_for): the pages it holds plus the promise are then at most
 * what admission asked for it, and the prefill's peak is no longer counted.
 */
static void promise_levels(kvp_scheduler *s, const record *rec, size_t here)
{
    size_t x = sample_tokens(s, rec);
    for (size_t k = 0; k < rec->request.samples; k++) {
        lease *l = &s->running[here + k].lease;
        kvp_status status =
            lease_promise(s, l, lease_level_for(s, l, rec->request.prompt_tokens + x), NULL);
        assert(status == KVP_OK); /* below the prefill's promise */
        (void)status;
    }
}

/*
 * Chunk `round` of a sample's tail, the g tokens it generated before a
 * preemption, appended after a prompt of `prompt` tokens: positions
 * [*lo, *lo + the count returned), 0 when the tail has no such chunk.
 * Chunk 0 fills the prompt's partial block (no new block), each later one
 * exactly one block [j bt, (j + 1) bt) (the last maybe partial).
 */
static size_t tail_chunk(size_t bt, size_t prompt, size_t g, size_t round, size_t *lo)
{
    size_t from = round == 0 ? prompt : (prompt / bt + round) * bt;
    size_t to = (prompt / bt + round + 1) * bt;
    to = to < prompt + g ? to : prompt + g;
    *lo = from;
    return to > from ? to - from : 0;
}

/*
 * Adds chunk `round` of every tail of the admitted requests that did not
 * fail (each sample's, its rows after its prompt's: sharing on, sample k's
 * at prompt + k g; off, after its own prompt's) to s->jobs; returns the
 * chunks added.
 */
static size_t tail_round(kvp_scheduler *s, const plan *p, size_t first, size_t round,
                         size_t *count)
{
    size_t chunks = 0;
    size_t at = first;
    for (size_t i = 0; i < p->popped; i++) {
        const planned *pl = &s->plan[i];
        if (!pl->admit) {
            continue;
        }
        const record *rec = record_of(s, pl->id);
        size_t n = rec->request.samples;
        size_t prompt = rec->request.prompt_tokens;
        size_t g = rec->generated;
        size_t here = at;
        size_t lo = 0;
        at += n;
        size_t c = rec->failed ? 0 : tail_chunk(s->block_tokens, prompt, g, round, &lo);
        for (size_t k = 0; c != 0 && k < n; k++) {
            size_t base = s->config.sharing ? pl->rows + prompt + k * g
                                            : pl->rows + k * (prompt + g) + prompt;
            append(s, &s->running[here + k], base + (lo - prompt), c, count);
            chunks++;
        }
    }
    return chunks;
}

/*
 * Sliding layers: the preempted requests' tails (what their samples
 * generated before a preemption) after their prompts, once each sample's
 * windows released and its promise is its level. One transaction holds
 * every block it writes until its end, so a tail in one would hold the
 * blocks of all of it in every layer, more than admission asks (and than
 * the pool, for a long one); in block-aligned chunks, one decoder batch a
 * round, each chunk holds what the single step into its block holds, at
 * most the level (DESIGN.md "Sliding windows and sinks", the re-prefill
 * in chunks). A failed chunk fails its request, whose later chunks are
 * not run.
 */
static void append_tails(kvp_scheduler *s, const plan *p, size_t first)
{
    for (size_t round = 0;; round++) {
        size_t count = 0;
        if (tail_round(s, p, first, round, &count) == 0) {
            return;
        }
        run_jobs(s, count); /* a refusal runs them here */
        collect_jobs(s, first);
    }
}

/*
 * Phase 2 (sharing on): every admitted request that prefilled its prompt
 * forks its samples (fork_samples; sliding layers, sharing off: each
 * sample's promise goes down to its level, promise_levels), the forked
 * samples' appends a second batch of decoder jobs (a refusal runs them on
 * this thread). Then the statistics count, and the requests whose jobs
 * failed finish.
 */
void kvpi_sched_prefill_forks(kvp_scheduler *s, const plan *p, size_t first, kvp_step_stats *st)
{
    size_t count = 0;
    size_t at = first;
    for (size_t i = 0; i < p->popped; i++) {
        const planned *pl = &s->plan[i];
        if (!pl->admit) {
            continue;
        }
        record *rec = record_of(s, pl->id);
        size_t here = at;
        at += rec->request.samples;
        if (s->config.sharing && !rec->failed) {
            fork_samples(s, pl, rec, here, &count);
        } else if (s->config.sharing) {
            (void)kvpi_cache_resume_release_many(lease_caches(&s->running[here].lease),
                                                 s->layers); /* its pages go back anyway */
        } else if (s->windows != NULL && !rec->failed) {
            promise_levels(s, rec, here);
        }
    }
    run_jobs(s, count); /* a refusal runs them here: cannot fail (no jobs: nothing) */
    collect_jobs(s, first);
    if (s->windows != NULL) {
        append_tails(s, p, first);
    }
    count_prefill(s, p, st);
    kvpi_sched_fail_marked(s, first, st);
}
