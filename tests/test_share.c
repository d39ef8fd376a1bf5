/*
 * test_share.c: pages shared between sequences (src/serve/share.c over
 * src/pager/share.c and prefix.c): bit-identical outputs of forked,
 * prefix-cached and truncated-and-replayed sequences against fresh ones; a
 * fork of a stale sequence is stale; adoption stops at one layer's miss;
 * layers sharing parameters keep their own keys; failures change nothing and
 * a prefill rollback restores the shared page; and threads that fork, adopt
 * and truncate while other sequences of the pool step. Invariant:
 * kvp_pool_check runs after every operation (kvpt_assert_pool_ok). External
 * caches sharing pages are test_share_cache.c; what a hit may be trusted for
 * (bindings, keys, salts, groups) is test_share_keys.c; fixtures in
 * share_support.h. Unit test (ctest test_share, memcheck.test_share in
 * release, the tsan preset and helgrind.test_share for the threads): uses
 * pager/pool_internal.h, pager/reservation.h and serve/sequence_internal.h.
 */
#include "share_support.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "pager/pool_internal.h"
#include "pager/reservation.h"
#include "serve/sequence_internal.h"

/* ---- sequences ------------------------------------------------------------- */


static void step(kvp_sequence *seq, kvp_pool *pool, const double *in, double *out)
{
    double row[SB * D];
    memcpy(row, in, sizeof row);
    kvp_tensor t = kvp_tensor3(row, SB, 1, D);
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_step(seq, &t, NULL, NULL, out, SB * D, &err), &err);
    kvpt_assert_pool_ok(pool);
}

static void steps_all(kvp_sequence *seq, kvp_pool *pool, double in[STEPS][SB * D], outputs *o)
{
    for (size_t s = 0; s < STEPS; s++) {
        step(seq, pool, in[s], o->steps[s]);
    }
}

/* Prompt rows [from, to) of two outputs, bit for bit. */
static void assert_rows_equal(const outputs *a, const outputs *b, size_t from, size_t to)
{
    for (size_t lane = 0; lane < SB; lane++) {
        assert_memory_equal(a->prompt + (lane * PROMPT + from) * D,
                            b->prompt + (lane * PROMPT + from) * D,
                            (to - from) * D * sizeof(double));
    }
}

/* Prefills the prompt past `adopted`, checks those rows against `want`, destroys `seq`. */
static void prefill_rest_matches(kvp_sequence *seq, kvp_pool *pool, const double *prompt,
                                 size_t adopted, const outputs *want)
{
    static outputs got;
    prefill(seq, pool, prompt, adopted, PROMPT, got.prompt);
    assert_rows_equal(&got, want, adopted, PROMPT);
    kvpt_destroy_sequence(seq, pool);
}

static void assert_steps_equal(const outputs *a, const outputs *b)
{
    assert_memory_equal(a->steps, b->steps, sizeof a->steps);
}

/* The fresh run: prefill the whole prompt, then the steps. */
static void fresh(const kvp_model *model, kvp_pool *pool, const double *prompt,
                  double in[STEPS][SB * D], outputs *o)
{
    kvp_sequence *seq = kvpt_sequence(model, pool, SB, SCAP);
    prefill(seq, pool, prompt, 0, PROMPT, o->prompt);
    steps_all(seq, pool, in, o);
    kvpt_destroy_sequence(seq, pool);
}

/* Fork mid-block (6) and on a block edge (8): both sides continue bit for bit as fresh. */
static void test_share_sequence_fork_bit_identical(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 5);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    static outputs want;
    fresh(model, pool, prompt, in, &want);
    static const size_t cuts[] = {6, 8};
    for (size_t k = 0; k < KVPT_COUNT_OF(cuts); k++) {
        size_t cut = cuts[k];
        static outputs p;
        static outputs c;
        kvp_sequence *parent = kvpt_sequence(model, pool, SB, SCAP);
        prefill(parent, pool, prompt, 0, cut, p.prompt);
        size_t held_before = held(pool);
        kvp_sequence *child = NULL;
        kvp_error err;
        kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
        kvpt_assert_pool_ok(pool);
        assert_int_equal(held(pool), held_before);
        assert_int_equal(kvp_sequence_len(child), cut);
        /* The child's promise counts only pages it will take: its copies or new block. */
        size_t lanes = LAYERS * SB;
        assert_int_equal(kvp_sequence_pages_for(child, cut + 1), lanes);
        assert_int_equal(kvp_sequence_pages_for(child, cut), 0);
        kvpt_assert_ok(kvp_sequence_promise(child, kvp_sequence_pages_for(child, PROMPT), &err),
                       &err);
        prefill(child, pool, prompt, cut, PROMPT, c.prompt);
        assert_int_equal(kvp_sequence_promised_pages(child), 0);
        steps_all(child, pool, in, &c);
        assert_rows_equal(&c, &want, cut, PROMPT);
        assert_steps_equal(&c, &want);
        prefill(parent, pool, prompt, cut, PROMPT, p.prompt);
        steps_all(parent, pool, in, &p);
        assert_rows_equal(&p, &want, 0, PROMPT);
        assert_steps_equal(&p, &want);
        assert_int_equal(kvpt_stats(pool).cow_copies, cut % BT != 0 ? 2 * lanes * (k + 1) : 2 * lanes);
        kvpt_assert_same_rows(parent, child);
        kvpt_destroy_sequence(parent, pool);
        kvpt_destroy_sequence(child, pool);
        assert_int_equal(held(pool), 0);
    }
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* Layer 1's parameter `which` gets value[index] += delta: a new revision. */
static void bump_revision(kvp_model *model, size_t which, size_t index, double delta)
{
    kvp_param *w = kvp_model_param_mut(model, 1, which);
    double values[D * D];
    memcpy(values, kvp_param_values(w), sizeof values);
    values[index] += delta;
    kvp_error err;
    kvpt_assert_ok(kvp_param_update(w, values, &err), &err);
}

/*
 * A fork of a stale sequence keeps the parent's captured revisions: parent
 * and child are refused the same way, and neither steps on K/V of the old
 * weights under the new ones.
 */
static void test_share_fork_of_stale_sequence_is_stale(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 9);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    static outputs o;
    kvp_sequence *parent = kvpt_sequence(model, pool, SB, SCAP);
    prefill(parent, pool, prompt, 0, 6, o.prompt);
    bump_revision(model, KVP_PARAM_VALUE, 3, -0.5);
    kvp_error err;
    kvp_sequence *child = NULL;
    kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
    kvpt_assert_pool_ok(pool);
    size_t held_before = held(pool);
    kvp_tensor t = kvp_tensor3(in[0], SB, 1, D);
    double out[SB * D];
    kvp_sequence *both[] = {parent, child};
    for (size_t i = 0; i < 2; i++) {
        assert_int_equal(kvp_sequence_step(both[i], &t, NULL, NULL, out, SB * D, &err),
                         KVP_CACHE_LAYER_REVISION_MISMATCH);
        assert_int_equal(err.layer, 1);
        assert_int_equal(err.parameter, KVP_PARAM_VALUE);
        assert_int_equal(kvp_sequence_len(both[i]), 6);
    }
    assert_int_equal(held(pool), held_before);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_sequence(child, pool);
    kvpt_destroy_sequence(parent, pool);
    assert_int_equal(held(pool), 0);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* A prompt prefix adopted from the index: the rest computed, bit for bit as fresh. */
static void test_share_sequence_prefix_bit_identical(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 6);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    static outputs want;
    fresh(model, pool, prompt, in, &want);
    kvp_tensor whole = kvp_tensor3(prompt, SB, PROMPT, D);

    kvp_sequence *a = kvpt_sequence(model, pool, SB, SCAP);
    static outputs o;
    prefill(a, pool, prompt, 0, PROMPT, o.prompt);
    size_t published = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_publish_prefix(a, &whole, &published, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(published, PROMPT / BT);
    assert_int_equal(kvpt_stats(pool).cached_pages, LAYERS * SB * (PROMPT / BT));
    kvpt_destroy_sequence(a, pool);

    kvp_sequence *b = kvpt_sequence(model, pool, SB, SCAP);
    size_t adopted = adopt_whole(b, pool, &whole);
    assert_int_equal(adopted, 8); /* (10 - 1) / 4 blocks: the last token is left */
    assert_int_equal(kvp_sequence_len(b), 8);
    assert_int_equal(kvpt_stats(pool).prefix_hits, LAYERS * SB * 2);
    static outputs got;
    prefill(b, pool, prompt, adopted, PROMPT, got.prompt);
    steps_all(b, pool, in, &got);
    assert_rows_equal(&got, &want, adopted, PROMPT);
    assert_steps_equal(&got, &want);
    /* Not empty any more: refused, nothing changed. */
    assert_int_equal(kvp_sequence_adopt_prefix(b, &whole, &adopted, &err), KVP_INVALID_ARGUMENT);
    kvpt_destroy_sequence(b, pool);

    /* A revision bump: the same prompt finds nothing, and the recomputed rows differ. */
    bump_revision(model, KVP_PARAM_KEY, 0, 0.25);
    kvp_sequence *c = kvpt_sequence(model, pool, SB, SCAP);
    uint64_t misses = kvpt_stats(pool).prefix_misses;
    kvpt_assert_ok(kvp_sequence_adopt_prefix(c, &whole, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, 0);
    assert_int_equal(kvp_sequence_len(c), 0);
    assert_int_equal(kvpt_stats(pool).prefix_misses, misses + 1);
    kvpt_destroy_sequence(c, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/*
 * A block is adopted only when every layer's page of it hits: with the last
 * layer's page of block 1 (its last lane) taken by a reservation (borrowed:
 * hidden from lookups) and layer 0's still indexed, the prefix stops after
 * block 0, and the rest recomputes alike.
 */
static void test_share_sequence_adopt_stops_at_one_layers_miss(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 6);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, LAYERS * SB * 3);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    kvp_tensor whole = kvp_tensor3(prompt, SB, PROMPT, D);
    kvp_sequence *a = kvpt_sequence(model, pool, SB, SCAP);
    static outputs want;
    prefill(a, pool, prompt, 0, PROMPT, want.prompt);
    size_t published = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_publish_prefix(a, &whole, &published, &err), &err);
    assert_int_equal(published, 2);
    uint32_t evicted = page_of(a->caches[LAYERS - 1], SB - 1, 1);
    uint32_t kept = page_of(a->caches[0], SB - 1, 1);
    /* Layer 0 outlives a in a fork of its cache: the other layers' pages go evictable first. */
    kvp_cache *layer0 = NULL;
    kvpt_assert_ok(kvp_cache_fork(a->caches[0], &layer0, &err), &err);
    kvpt_destroy_sequence(a, pool);
    kvpt_destroy_cache(layer0, pool);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.evictable_pages, LAYERS * SB * 2);

    /* Every free page and one more: the least recently used, the last layer's. */
    uint32_t storage[LAYERS * SB * 3];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, s.free_pages + 1);
    kvpt_assert_ok(kvpi_reservation_fill(&res, s.free_pages + 1, &err), &err);
    kvpt_assert_pool_ok(pool);
    /* Borrowed, not evicted: hidden from lookups until the reservation maps or returns it. */
    assert_int_equal(kvpt_stats(pool).evictions, 0);
    assert_int_equal(pool->registered[evicted], KVPI_PAGE_BORROWED);
    assert_int_equal(pool->registered[kept], KVPI_PAGE_INDEXED);

    kvp_sequence *b = kvpt_sequence(model, pool, SB, SCAP);
    uint64_t misses = kvpt_stats(pool).prefix_misses;
    size_t adopted = adopt_whole(b, pool, &whole);
    assert_int_equal(adopted, BT);
    assert_int_equal(kvp_sequence_len(b), BT);
    s = kvpt_stats(pool);
    assert_int_equal(s.prefix_misses, misses + 1);
    assert_int_equal(s.prefix_hits, LAYERS * SB);
    kvpi_reservation_release(&res);
    kvpt_assert_pool_ok(pool);
    prefill_rest_matches(b, pool, prompt, adopted, &want);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/*
 * Layers over the same parameters have equal binding digests: each layer's
 * index still gives it its own keys, so every layer publishes its own pages
 * and an adopter reads each layer's own K/V (bit for bit the same outputs).
 */
static void test_share_layers_sharing_parameters_keep_their_own_keys(void **state)
{
    (void)state;
    kvp_layer *layer = kvpt_random_layer(D, HEADS, SCAP, BASE, 21);
    kvp_model *model = kvpt_model_of_one_layer(layer, LAYERS);
    kvp_error err;
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 64);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    kvp_tensor whole = kvp_tensor3(prompt, SB, PROMPT, D);
    kvp_sequence *a = kvpt_sequence(model, pool, SB, SCAP);
    static outputs want;
    prefill(a, pool, prompt, 0, PROMPT, want.prompt);
    size_t published = 0;
    kvpt_assert_ok(kvp_sequence_publish_prefix(a, &whole, &published, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(published, 2);
    assert_int_equal(kvpt_stats(pool).cached_pages, LAYERS * SB * 2);
    kvpt_destroy_sequence(a, pool);

    kvp_sequence *b = kvpt_sequence(model, pool, SB, SCAP);
    size_t adopted = adopt_whole(b, pool, &whole);
    assert_int_equal(adopted, 2 * BT);
    for (size_t j = 0; j < 2; j++) {
        assert_true(page_of(b->caches[0], 0, j) != page_of(b->caches[1], 0, j));
    }
    prefill_rest_matches(b, pool, prompt, adopted, &want);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* Truncate and replay the same inputs by steps: bit for bit the first outputs. */
static void test_share_sequence_truncate_replay_bit_identical(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 7);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    static outputs want;
    fresh(model, pool, prompt, in, &want);
    kvp_sequence *seq = kvpt_sequence(model, pool, SB, SCAP);
    static outputs got;
    prefill(seq, pool, prompt, 0, PROMPT, got.prompt);
    steps_all(seq, pool, in, &got);
    kvp_error err;
    assert_int_equal(kvp_sequence_truncate(seq, PROMPT + STEPS + 1, &err), KVP_OUT_OF_RANGE);
    kvpt_assert_ok(kvp_sequence_truncate(seq, PROMPT + STEPS, &err), &err); /* same: no-op */
    kvpt_assert_ok(kvp_sequence_truncate(seq, 7, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_len(seq), 7);
    assert_int_equal(held(pool), LAYERS * SB * 2);
    /* Replay tokens 7..9 one step at a time, then the steps. */
    for (size_t t = 7; t < PROMPT; t++) {
        double row[SB * D];
        double out[SB * D];
        slice(prompt, t, t + 1, row);
        step(seq, pool, row, out);
        for (size_t b = 0; b < SB; b++) {
            assert_memory_equal(out + b * D, want.prompt + (b * PROMPT + t) * D,
                                D * sizeof(double));
        }
    }
    steps_all(seq, pool, in, &got);
    assert_steps_equal(&got, &want);
    kvpt_destroy_sequence(seq, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* A step after a fork whose copies cannot be had, and a failed fork: nothing changes. */
static void test_share_sequence_failures_change_nothing(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 8);
    size_t pages = LAYERS * SB * 2; /* exactly the pages of 6 tokens */
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, pages);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    kvp_sequence *parent = kvpt_sequence(model, pool, SB, SCAP);
    static outputs o;
    prefill(parent, pool, prompt, 0, 6, o.prompt);
    kvp_sequence *child = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats before = kvpt_stats(pool);
    uint64_t pool_digest = 0;
    kvpt_assert_ok(kvp_pool_digest(pool, &pool_digest, &err), &err);
    double row[SB * D];
    double out[SB * D];
    memcpy(row, in[0], sizeof row);
    kvp_tensor t = kvp_tensor3(row, SB, 1, D);
    assert_int_equal(kvp_sequence_step(child, &t, NULL, NULL, out, SB * D, &err),
                     KVP_POOL_EXHAUSTED);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats after = kvpt_stats(pool);
    after.exhaustions--;
    assert_memory_equal(&before, &after, sizeof before);
    uint64_t digest_after = 0;
    kvpt_assert_ok(kvp_pool_digest(pool, &digest_after, &err), &err);
    assert_true(digest_after == pool_digest);
    assert_int_equal(kvp_sequence_len(child), 6);
    /* A prefill of the rest fails too, before any token: nothing changed. */
    double part[SB * 4 * D];
    slice(prompt, 6, PROMPT, part);
    kvp_tensor rest = kvp_tensor3(part, SB, 4, D);
    assert_int_equal(kvp_sequence_prefill(child, &rest, NULL, NULL, NULL, 0, &err),
                     KVP_POOL_EXHAUSTED);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).cow_copies, 0);
    assert_int_equal(kvpt_stats(pool).held_pages, before.held_pages);
    kvpt_assert_same_rows(parent, child);
    /* A fork whose allocations fail: nothing changed, at every allocation. */
    for (uint64_t nth = 1;; nth++) {
        kvp_sequence *made = (kvp_sequence *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_sequence_fork(parent, &made, &s.err));
        kvpt_assert_pool_ok(pool);
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            kvpt_destroy_sequence(made, pool);
            break;
        }
        kvpt_assert_fault_failed(&s, nth);
        assert_ptr_equal(made, (kvp_sequence *)0x1);
        after = kvpt_stats(pool);
        assert_int_equal(after.attached_caches, before.attached_caches);
        assert_int_equal(after.held_pages, before.held_pages);
        assert_int_equal(after.acquires, before.acquires);
    }
    kvpt_destroy_sequence(child, pool);
    kvpt_destroy_sequence(parent, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* The residual stream, except that layer 0's output of the third call is infinite. */
static void poison_third(void *ctx, size_t layer, const double *input, const double *output,
                         size_t n, double *next)
{
    size_t *calls = ctx;
    for (size_t i = 0; i < n; i++) {
        next[i] = input[i] + output[i];
    }
    if (layer == 0 && ++*calls == 3) {
        next[0] = 1.0 / 0.0;
    }
}

/* A prefill that fails after its first token copied the shared pages rolls the copies back. */
static void test_share_prefill_rollback_restores_shared_page(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 9);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    kvp_sequence *parent = kvpt_sequence(model, pool, SB, SCAP);
    static outputs o;
    prefill(parent, pool, prompt, 0, 6, o.prompt);
    kvp_sequence *child = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
    kvpt_assert_ok(kvp_sequence_promise(child, 5, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats before = kvpt_stats(pool);
    uint32_t page_before = 0;
    kvpt_assert_ok(kvp_cache_page(kvp_sequence_cache(child, 1), 1, 1, &page_before, &err), &err);
    double part[SB * 4 * D];
    slice(prompt, 6, PROMPT, part);
    kvp_tensor rest = kvp_tensor3(part, SB, 4, D);
    size_t calls = 0;
    assert_int_equal(kvp_sequence_prefill(child, &rest, poison_third, &calls, NULL, 0, &err),
                     KVP_NONFINITE_PROJECTION);
    assert_int_equal(err.token, 2);
    assert_int_equal(calls, 3);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
    uint32_t page_after = 0;
    kvpt_assert_ok(kvp_cache_page(kvp_sequence_cache(child, 1), 1, 1, &page_after, &err), &err);
    assert_int_equal(page_after, page_before);
    assert_int_equal(kvp_sequence_len(child), 6);
    assert_int_equal(kvp_sequence_promised_pages(child), 5);
    /* Still shared: the next prefill copies again, and matches the parent bit for bit. */
    assert_int_equal(kvp_sequence_pages_for(child, 7), LAYERS * SB);
    static outputs c;
    static outputs p;
    prefill(child, pool, prompt, 6, PROMPT, c.prompt);
    prefill(parent, pool, prompt, 6, PROMPT, p.prompt);
    assert_rows_equal(&c, &p, 6, PROMPT);
    kvpt_destroy_sequence(child, pool);
    kvpt_destroy_sequence(parent, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* ---- threads: sharing while other sequences of the pool step ---------------- */

#define ROUNDS 3

typedef struct share_thread {
    const kvp_model *model;
    kvp_pool *pool;
    kvp_sequence *parent;          /* this thread's own fork of the shared base */
    const double *prompt;
    double (*in)[SB * D];
    const outputs *want;
    pthread_barrier_t *barrier;
    int adopter;                   /* adopt the published block instead of forking */
    int failures;
} share_thread;

static int rows_match(const double *got, const outputs *want, size_t from, size_t to)
{
    for (size_t b = 0; b < SB; b++) {
        if (memcmp(got + b * (to - from) * D, want->prompt + (b * PROMPT + from) * D,
                   (to - from) * D * sizeof(double)) != 0) {
            return 0;
        }
    }
    return 1;
}

/* Prefill tokens [from, PROMPT), then the steps; 1 when every output matches `want`. */
static int finish_and_compare(share_thread *t, kvp_sequence *seq, size_t from)
{
    double part[SB * PROMPT * D];
    double out[SB * PROMPT * D];
    slice(t->prompt, from, PROMPT, part);
    kvp_tensor rest = kvp_tensor3(part, SB, PROMPT - from, D);
    if (kvp_sequence_prefill(seq, &rest, NULL, NULL, out, KVPT_COUNT_OF(out), NULL) != KVP_OK ||
        !rows_match(out, t->want, from, PROMPT)) {
        return 0;
    }
    for (size_t s = 0; s < STEPS; s++) {
        double row[SB * D];
        double got[SB * D];
        memcpy(row, t->in[s], sizeof row);
        kvp_tensor x = kvp_tensor3(row, SB, 1, D);
        if (kvp_sequence_step(seq, &x, NULL, NULL, got, SB * D, NULL) != KVP_OK ||
            memcmp(got, t->want->steps[s], sizeof got) != 0) {
            return 0;
        }
    }
    return 1;
}

static void *share_worker(void *arg)
{
    share_thread *t = arg;
    kvp_tensor whole = kvp_tensor3((double *)(uintptr_t)t->prompt, SB, PROMPT, D);
    for (size_t r = 0; r < ROUNDS; r++) {
        pthread_barrier_wait(t->barrier);
        kvp_sequence *seq = NULL;
        size_t from = 0;
        if (t->adopter) {
            size_t adopted = 0;
            if (kvp_sequence_create(t->model, t->pool, SB, SCAP, &seq, NULL) != KVP_OK ||
                kvp_sequence_adopt_prefix(seq, &whole, &adopted, NULL) != KVP_OK ||
                adopted != BT) {
                t->failures++;
                if (seq != NULL) {
                    (void)kvp_sequence_destroy(seq, NULL);
                }
                continue;
            }
            from = adopted;
        } else {
            if (kvp_sequence_fork(t->parent, &seq, NULL) != KVP_OK) {
                t->failures++;
                continue;
            }
            from = kvp_sequence_len(seq);
        }
        t->failures += !finish_and_compare(t, seq, from);
        /* Truncate into the prompt and replay: the same outputs again. */
        if (kvp_sequence_truncate(seq, from + 1, NULL) != KVP_OK) {
            t->failures++;
        } else {
            t->failures += !finish_and_compare(t, seq, from + 1);
        }
        (void)kvp_sequence_destroy(seq, NULL);
    }
    return NULL;
}

/* Two threads fork, adopt, step and truncate sequences that share pages; audit after. */
static void test_share_threads_fork_adopt_truncate(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 10);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 512);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    static outputs want;
    fresh(model, pool, prompt, in, &want);
    /* The base holds 6 tokens (block 0 published, block 1 partial); two forks of it. */
    kvp_sequence *base = kvpt_sequence(model, pool, SB, SCAP);
    static outputs o;
    prefill(base, pool, prompt, 0, 6, o.prompt);
    double head[SB * 6 * D];
    slice(prompt, 0, 6, head);
    kvp_tensor six = kvp_tensor3(head, SB, 6, D);
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_publish_prefix(base, &six, NULL, &err), &err);
    kvp_sequence *mine[2];
    for (size_t i = 0; i < 2; i++) {
        kvpt_assert_ok(kvp_sequence_fork(base, &mine[i], &err), &err);
    }
    pthread_barrier_t barrier;
    assert_int_equal(pthread_barrier_init(&barrier, NULL, 3), 0);
    share_thread t[3];
    pthread_t threads[3];
    for (size_t i = 0; i < 3; i++) {
        t[i] = (share_thread){model, pool, i < 2 ? mine[i] : NULL, prompt, in, &want,
                              &barrier, i == 2, 0};
        assert_int_equal(pthread_create(&threads[i], NULL, share_worker, &t[i]), 0);
    }
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(pthread_join(threads[i], NULL), 0);
        assert_int_equal(t[i].failures, 0);
    }
    pthread_barrier_destroy(&barrier);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.prefix_hits, ROUNDS * LAYERS * SB);
    assert_int_equal(held(pool), LAYERS * SB * 2); /* base and its two forks share them all */
    kvpt_destroy_sequence(mine[0], pool);
    kvpt_destroy_sequence(mine[1], pool);
    kvpt_destroy_sequence(base, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}
int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_share_sequence_fork_bit_identical),
        cmocka_unit_test(test_share_fork_of_stale_sequence_is_stale),
        cmocka_unit_test(test_share_sequence_prefix_bit_identical),
        cmocka_unit_test(test_share_sequence_adopt_stops_at_one_layers_miss),
        cmocka_unit_test(test_share_layers_sharing_parameters_keep_their_own_keys),
        cmocka_unit_test(test_share_sequence_truncate_replay_bit_identical),
        cmocka_unit_test_teardown(test_share_sequence_failures_change_nothing, kvpt_disarm),
        cmocka_unit_test(test_share_prefill_rollback_restores_shared_page),
        cmocka_unit_test(test_share_threads_fork_adopt_truncate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
