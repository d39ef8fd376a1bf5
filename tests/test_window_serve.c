/*
 * test_window_serve.c: admission and promises of sequences with sliding
 * layers (issue 21, part 2; docs/DESIGN.md, "Sliding windows and sinks",
 * "What paging adds": admission and promises).
 *
 * Checks, with kvp_pool_check after every operation:
 *   - kvp_sequence_pages_for of a two-layer windowed model equals the
 *     counts written out by hand (each layer's peak, at most its new
 *     blocks), and kvp_sequence_prefill_pages the full blocks;
 *   - a promise is a level: after every step held + promised equals the
 *     level set (a window's release refills the promise), held never above
 *     it, and kvp_sequence_held_pages counts no released block; re-promising
 *     mid-run still covers every step; a prefill's promise refills at its
 *     end;
 *   - a scheduler with sharing over a windowed model is made;
 *   - the scheduler (sharing 0) admits a windowed request for the larger of
 *     its prefill (every block) and its level (a sliding layer's peak), then
 *     promises the level: exact admitted counts and pages on a hybrid model,
 *     against the same model with every layer full, run to the end without
 *     preemption, the audit after every step; the step's
 *     sliding_held_pages and the pool's window_releases, hand-counted;
 *     without a reserve, a full layer's growth preempts, and every request
 *     still completes with the audit clean;
 *   - a pool of exactly N windowed promises admits N sequences and refuses
 *     the next (nothing changed), and the N run to the end on it, where the
 *     same model with full layers admits one;
 *   - a windowed cache's table: the blocks kvpi_cache_block_released names
 *     (what the scheduler's kept-page count skips) are exactly the
 *     KVP_PAGE_RELEASED entries (test_window_sched.c runs windowed
 *     sessions);
 *   - kvp_sequence_truncate into a window's released blocks is refused
 *     (BlockReleased, err.layer the layer), changing nothing;
 *   - a tier load into a windowed cache releases what the window no longer
 *     needs, as a commit does.
 * Deterministic: no threads, fixed inputs.
 */
#include "support.h"

#include <stdint.h>
#include <string.h>

#include "pager/cache_internal.h"

enum { WIDTH = 8, HEADS = 2, BATCH = 2, POSITIONS = 64, BT = 2, T = 16, L = 2 };

/* Layer 0: W = 4, S = 0; layer 1: W = 1, S = 0 (windows 0: full attention). */
static kvp_model *model_of(size_t w0, size_t w1)
{
    kvp_error err;
    size_t windows[L] = {w0, w1};
    kvp_layer *made[L];
    const kvp_layer *layers[L];
    for (size_t l = 0; l < L; l++) {
        made[l] = NULL;
        kvpt_assert_ok(kvp_layer_create_random_grouped(WIDTH, HEADS, 1, POSITIONS, 10000.0,
                                                       70 + l, &made[l], &err),
                       &err);
        kvpt_assert_ok(kvp_layer_set_window(made[l], windows[l], 0, &err), &err);
        layers[l] = made[l];
    }
    kvp_model *model = NULL;
    kvpt_assert_ok(kvp_model_create(layers, L, &model, &err), &err);
    for (size_t l = 0; l < L; l++) {
        kvpt_destroy_layer(made[l]);
    }
    return model;
}

static void step_once(kvp_sequence *seq, uint64_t seed)
{
    kvp_error err;
    double x[BATCH * WIDTH];
    double y[BATCH * WIDTH];
    kvpt_fill_random(x, BATCH * WIDTH, seed);
    kvp_tensor in = kvp_tensor3(x, BATCH, 1, WIDTH);
    kvpt_assert_ok(kvp_sequence_step(seq, &in, NULL, NULL, y, BATCH * WIDTH, &err), &err);
}

/* The pages the caches' infos count: the live blocks of every layer and lane. */
static size_t mapped_pages(const kvp_sequence *seq)
{
    kvp_error err;
    size_t pages = 0;
    for (size_t l = 0; l < L; l++) {
        kvp_cache_info info;
        kvp_cache_info_init(&info);
        kvpt_assert_ok(kvp_cache_info_get(kvp_sequence_cache(seq, l), &info, &err), &err);
        pages += info.mapped_pages;
    }
    return pages;
}

static void test_window_serve_promises_are_hand_counted(void **state)
{
    (void)state;
    kvp_model *model = model_of(4, 1);
    kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, 64);
    kvp_sequence *seq = kvpt_sequence(model, pool, BATCH, T);
    /*
     * Per lane, the peak over n <= T of the blocks covering [n - 1 - W, n):
     * W = 4 spans 5 positions, 3 blocks of 2 (from n = 5 on); W = 1 spans
     * 2 positions, at most 2 blocks (from n = 3 on). Times 2 lanes.
     */
    assert_int_equal(kvp_sequence_pages_for(seq, T), 2 * 3 + 2 * 2);
    assert_int_equal(kvp_sequence_pages_for(seq, 5), 2 * 3 + 2 * 2);
    /* n <= 4: W = 4 holds [0, 4), 2 blocks; W = 1 peaks at n = 3 (blocks 0, 1). */
    assert_int_equal(kvp_sequence_pages_for(seq, 4), 2 * 2 + 2 * 2);
    assert_int_equal(kvp_sequence_pages_for(seq, 2), 2 * 1 + 2 * 1);
    assert_int_equal(kvp_sequence_pages_for(seq, 0), 0);
    size_t sum = kvp_cache_pages_held_max(kvp_sequence_cache(seq, 0), T) +
                 kvp_cache_pages_held_max(kvp_sequence_cache(seq, 1), T);
    assert_int_equal(kvp_sequence_pages_for(seq, T), sum);
    /* A prefill holds every block it writes until its end. */
    assert_int_equal(kvp_sequence_prefill_pages(seq, T), L * BATCH * (T / BT));
    assert_int_equal(kvp_sequence_prefill_pages(seq, 5), L * BATCH * 3);
    assert_int_equal(kvp_sequence_prefill_pages(NULL, 5), 0);
    /* Full layers: both counts are the new blocks, as before windows. */
    kvp_model *full = model_of(0, 0);
    kvp_sequence *plain = kvpt_sequence(full, pool, BATCH, T);
    assert_int_equal(kvp_sequence_pages_for(plain, T), L * BATCH * (T / BT));
    assert_int_equal(kvp_sequence_prefill_pages(plain, T), L * BATCH * (T / BT));
    /* At length 7 (steps): W = 4 holds blocks 1..3 (at its peak), W = 1 block 3. */
    for (size_t t = 0; t < 7; t++) {
        step_once(seq, 100 + t);
        kvpt_assert_pool_ok(pool);
    }
    assert_int_equal(kvp_sequence_held_pages(seq), 2 * 3 + 2 * 1);
    assert_int_equal(kvp_sequence_held_pages(seq), mapped_pages(seq));
    assert_int_equal(kvp_sequence_pages_for(seq, T), 0 + 2 * 1);
    assert_int_equal(kvp_sequence_pages_for(seq, 8), 0);  /* position 7 is in block 3 */
    assert_int_equal(kvp_sequence_pages_for(seq, 9), 0 + 2 * 1); /* block 4 */
    assert_int_equal(kvp_sequence_prefill_pages(seq, T), L * BATCH * (T / BT - 4));
    kvpt_destroy_sequence(plain, pool);
    kvpt_destroy_sequence(seq, pool);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(full);
    kvpt_destroy_model(model);
}

/* held + promised == level after every step; the pool never runs short. */
static void run_to_end(kvp_sequence *seq, kvp_pool *pool, size_t level, uint64_t seed)
{
    while (kvp_sequence_len(seq) < T) {
        step_once(seq, seed + kvp_sequence_len(seq));
        kvpt_assert_pool_ok(pool);
        size_t held = kvp_sequence_held_pages(seq);
        assert_true(held <= level);
        assert_int_equal(held + kvp_sequence_promised_pages(seq), level);
        assert_int_equal(held, mapped_pages(seq));
    }
}

static void test_window_serve_promise_is_a_level(void **state)
{
    (void)state;
    kvp_error err;
    kvp_model *model = model_of(4, 1);
    enum { LEVEL = 10 };
    /* A pool of exactly the level: a step past its promise would exhaust it. */
    kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, LEVEL);
    kvp_sequence *seq = kvpt_sequence(model, pool, BATCH, T);
    kvpt_assert_ok(kvp_sequence_promise(seq, kvp_sequence_pages_for(seq, T), &err), &err);
    assert_int_equal(kvpt_stats(pool).promised_pages, LEVEL);
    run_to_end(seq, pool, LEVEL, 0x100);
    assert_int_equal(kvpt_stats(pool).promised_pages, kvp_sequence_promised_pages(seq));
    /* Re-promised mid-run (length 7, at W = 4's peak): the new level covers the rest. */
    kvpt_assert_ok(kvp_sequence_reset(seq, &err), &err);
    assert_int_equal(kvp_sequence_promised_pages(seq), 0);
    for (size_t t = 0; t < 7; t++) {
        step_once(seq, 0x200 + t);
        kvpt_assert_pool_ok(pool);
        /* Taken beyond a promise of 0: the releases pay for those, refilling nothing. */
        assert_int_equal(kvp_sequence_promised_pages(seq), 0);
        assert_int_equal(kvpt_stats(pool).promised_pages, 0);
    }
    size_t held = kvp_sequence_held_pages(seq);
    kvpt_assert_ok(kvp_sequence_promise(seq, kvp_sequence_pages_for(seq, T), &err), &err);
    assert_int_equal(held + kvp_sequence_promised_pages(seq), LEVEL);
    run_to_end(seq, pool, LEVEL, 0x300);
    /* A prefill holds its blocks to its end, then releases and refills the promise. */
    kvpt_assert_ok(kvp_sequence_reset(seq, &err), &err);
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_pool(pool);
    pool = kvpt_pool(BT, 1, WIDTH / HEADS, 16);
    seq = kvpt_sequence(model, pool, BATCH, T);
    enum { P = 8 };
    size_t prefill = kvp_sequence_prefill_pages(seq, P);
    assert_int_equal(prefill, L * BATCH * (P / BT));
    kvpt_assert_ok(kvp_sequence_promise(seq, prefill, &err), &err);
    double prompt[BATCH * P * WIDTH];
    kvpt_fill_random(prompt, BATCH * P * WIDTH, 0x400);
    kvp_tensor p = kvp_tensor3(prompt, BATCH, P, WIDTH);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &p, NULL, NULL, NULL, 0, &err), &err);
    kvpt_assert_pool_ok(pool);
    /* At 8: W = 4 keeps blocks 2, 3; W = 1 block 3. The rest went back into the promise. */
    assert_int_equal(kvp_sequence_held_pages(seq), 2 * 2 + 2 * 1);
    assert_int_equal(kvp_sequence_promised_pages(seq), prefill - (2 * 2 + 2 * 1));
    assert_int_equal(kvpt_stats(pool).promised_pages, prefill - 6);
    kvpt_assert_ok(kvp_sequence_promise(seq, kvp_sequence_pages_for(seq, T), &err), &err);
    assert_int_equal(kvp_sequence_promised_pages(seq), (2 * 3 - 2 * 2) + (2 * 2 - 2 * 1));
    run_to_end(seq, pool, LEVEL, 0x500);
    kvpt_destroy_sequence(seq, pool);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).promised_pages, 0);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

static size_t admitted(kvp_pool *pool, kvp_sequence *const *seqs, size_t count)
{
    kvp_error err;
    size_t n = 0;
    for (size_t i = 0; i < count; i++) {
        kvp_admission a = KVP_ADMIT_NEVER;
        kvpt_snapshot before;
        kvpt_snapshot_init(&before, pool);
        kvpt_snapshot_add_sequence(&before, seqs[i]);
        kvpt_snapshot_take(&before);
        size_t pages = kvp_sequence_pages_for(seqs[i], T);
        kvpt_assert_ok(kvp_pool_admit(pool, pages, 0, &a, &err), &err);
        if (a != KVP_ADMIT_NOW) {
            assert_int_equal(a, KVP_ADMIT_LATER);
            kvpt_assert_unchanged(&before, 0); /* a refusal changes nothing */
            break;
        }
        kvpt_assert_ok(kvp_sequence_promise(seqs[i], pages, &err), &err);
        kvpt_assert_pool_ok(pool);
        n++;
    }
    return n;
}

static void test_window_serve_admits_n_where_full_admits_one(void **state)
{
    (void)state;
    enum { N = 4, LEVEL = 10, FULL = L * BATCH * (T / BT) };
    kvp_model *models[2] = {model_of(4, 1), model_of(0, 0)};
    size_t expect[2] = {N, 1};
    for (size_t m = 0; m < 2; m++) {
        kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, N * LEVEL);
        kvp_sequence *seqs[N + 1];
        for (size_t i = 0; i <= N; i++) {
            seqs[i] = kvpt_sequence(models[m], pool, BATCH, T);
        }
        assert_int_equal(kvp_sequence_pages_for(seqs[0], T), m == 0 ? LEVEL : FULL);
        size_t n = admitted(pool, seqs, N + 1);
        assert_int_equal(n, expect[m]);
        /* The admitted run to the end together, round robin, on exactly their pages. */
        for (size_t t = 0; t < T; t++) {
            for (size_t i = 0; i < n; i++) {
                step_once(seqs[i], 0x1000 * (i + 1) + t);
                kvpt_assert_pool_ok(pool);
                size_t held = kvp_sequence_held_pages(seqs[i]);
                assert_int_equal(held + kvp_sequence_promised_pages(seqs[i]),
                                 m == 0 ? LEVEL : FULL);
            }
        }
        for (size_t i = 0; i <= N; i++) {
            kvpt_destroy_sequence(seqs[i], pool);
        }
        kvpt_assert_pool_ok(pool);
        kvpt_destroy_pool(pool);
        kvpt_destroy_model(models[m]);
    }
}

/*
 * A scheduler with sharing over a windowed model is made (the prefix rule
 * with windows, test_window_sched.c runs it), and so is one without.
 */
static void test_window_serve_scheduler_shares_over_windows(void **state)
{
    (void)state;
    kvp_model *model = model_of(4, 0);
    kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, 64);
    kvp_decoder *decoder = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_decoder_create(1, &decoder, &err), &err);
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    config.capacity = T;
    assert_int_equal(config.sharing, 1);
    for (int sharing = 1; sharing >= 0; sharing--) {
        config.sharing = sharing;
        kvp_scheduler *s = NULL;
        kvpt_assert_ok(kvp_scheduler_create(model, pool, decoder, &config, &s, &err), &err);
        kvpt_assert_ok(kvp_scheduler_destroy(s, &err), &err);
        kvpt_assert_pool_ok(pool);
    }
    kvpt_destroy_decoder(decoder);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* What scheduler_session.c's kept-page count skips: exactly the null entries. */
static void test_window_serve_released_blocks_are_the_null_entries(void **state)
{
    (void)state;
    kvp_error err;
    kvp_model *model = model_of(4, 1);
    kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, 64);
    kvp_sequence *seq = kvpt_sequence(model, pool, BATCH, T);
    size_t released = 0;
    for (size_t t = 0; t < T; t++) {
        step_once(seq, 0x2000 + t);
        for (size_t l = 0; l < L; l++) {
            const kvp_cache *cache = kvp_sequence_cache(seq, l);
            size_t blocks = kvpi_cache_mapped_blocks(cache);
            for (size_t b = 0; b < blocks; b++) {
                for (size_t lane = 0; lane < BATCH; lane++) {
                    uint32_t page = 0;
                    kvpt_assert_ok(kvp_cache_page(cache, lane, b, &page, &err), &err);
                    assert_int_equal(page == KVP_PAGE_RELEASED,
                                     kvpi_cache_block_released(cache, b));
                    released += page == KVP_PAGE_RELEASED;
                }
            }
        }
    }
    assert_true(released > 0);
    kvpt_destroy_sequence(seq, pool);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* ---- the scheduler's admission with sliding layers ------------------------ */

enum { SCHED_PROMPT = 12, SCHED_NEW = 4, SCHED_REQUESTS = 6 };

static void sched_input(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                        size_t width)
{
    (void)ctx;
    (void)sample;
    for (size_t j = 0; j < width; j++) {
        row[j] = 0.01 * (double)((id * 31 + position * 7 + j * 3) % 17) - 0.08;
    }
}

/* 0: sched_run_with runs allocator-only (external caches: no window). */
static int sched_compute = 1;

typedef struct sched_run {
    size_t first_admitted;  /* requests the first step admits */
    size_t used_after_first; /* held + promised pages after it */
    size_t sliding_after_first; /* its step stats' sliding_held_pages */
    size_t decoded_first;   /* sequences it decoded */
    uint64_t window_releases; /* the pool's at the end */
    size_t peak_running;    /* most sequences running after a step */
    size_t finished;        /* requests that completed (status OK, not rejected) */
    size_t rejected;
    size_t preemptions;
} sched_run;

/*
 * Runs `count` requests of SCHED_PROMPT + SCHED_NEW tokens on a pool of
 * `pages` pages (watermark 0, reserve SCHED_NEW, sharing 0), the audit after
 * every step, to the end.
 */
static sched_run sched_run_with(kvp_model *model, size_t pages, size_t count, size_t new_tokens,
                                size_t reserve)
{
    kvp_error err;
    kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, pages);
    kvp_decoder *decoder = NULL;
    kvpt_assert_ok(kvp_decoder_create(1, &decoder, &err), &err);
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    config.capacity = 32;
    config.sharing = 0;
    config.watermark = 0.0;
    config.reserve_tokens = reserve;
    config.compute = sched_compute;
    kvp_scheduler *s = NULL;
    kvpt_assert_ok(kvp_scheduler_create(model, pool, decoder, &config, &s, &err), &err);
    for (size_t i = 0; i < count; i++) {
        kvp_request q;
        kvp_request_init(&q);
        q.prompt_tokens = SCHED_PROMPT;
        q.max_new_tokens = new_tokens;
        q.input = sched_input;
        uint64_t id = 0;
        kvpt_assert_ok(kvp_scheduler_submit(s, &q, &id, &err), &err);
    }
    sched_run run;
    memset(&run, 0, sizeof run);
    for (size_t step = 0; step < 100; step++) {
        kvp_step_stats st;
        kvp_step_stats_init(&st);
        kvpt_assert_ok(kvp_scheduler_step(s, &st, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvpt_assert_committed(pool);
        kvp_pool_stats ps;
        kvp_pool_stats_init(&ps);
        kvpt_assert_ok(kvp_pool_stats_get(pool, &ps, &err), &err);
        assert_true(ps.held_pages + ps.promised_pages <= pages);
        /* Nothing shared: each sequence's own pages (released blocks none) are the pool's. */
        assert_int_equal(st.unshared_pages, ps.held_pages);
        if (step == 0) {
            run.first_admitted = st.admitted;
            run.used_after_first = ps.held_pages + ps.promised_pages;
            run.sliding_after_first = st.sliding_held_pages;
            run.decoded_first = st.decoded;
        }
        run.peak_running = st.running > run.peak_running ? st.running : run.peak_running;
        run.preemptions += st.preempted;
        kvp_request_result done[SCHED_REQUESTS];
        kvp_request_result_init(&done[0]);
        size_t n = 0;
        kvpt_assert_ok(kvp_scheduler_collect(s, done, SCHED_REQUESTS, &n, &err), &err);
        for (size_t i = 0; i < n; i++) {
            run.rejected += done[i].rejected != 0;
            run.finished += !done[i].rejected && done[i].status == KVP_OK &&
                            done[i].tokens_generated == new_tokens;
        }
        if (st.running == 0 && st.waiting == 0) {
            break;
        }
    }
    kvpt_assert_ok(kvp_scheduler_destroy(s, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats ps;
    kvp_pool_stats_init(&ps);
    kvpt_assert_ok(kvp_pool_stats_get(pool, &ps, &err), &err);
    run.window_releases = ps.window_releases;
    kvpt_destroy_decoder(decoder);
    kvpt_destroy_pool(pool);
    return run;
}

static sched_run sched_run_on(kvp_model *model, size_t pages, size_t count)
{
    return sched_run_with(model, pages, count, SCHED_NEW, SCHED_NEW);
}

/*
 * Admission counts a sliding layer's peak. Layer 0: W = 4 (bt = 2: at most
 * 3 blocks at once, as above), layer 1 full. A request of 12 prompt tokens
 * admitted for 12 + 4 = 16: its prefill holds every block of both layers
 * until its end, 2 * 6 = 12 pages; after it, steps to 16 hold at most the
 * level 3 + 8 = 11. Admission asks max(12, 11) = 12, the promise goes down
 * to the level after the prefill: on 40 pages the first step admits 3
 * (36; the 4th would need 48), leaving 3 * 11 = 33 held + promised. Every
 * layer full asks 2 * 8 = 16 per request: 2 on 40 pages.
 */
static void test_window_serve_scheduler_admits_the_level(void **state)
{
    (void)state;
    kvp_model *hybrid = model_of(4, 0);
    kvp_model *full = model_of(0, 0);
    sched_run w = sched_run_on(hybrid, 40, SCHED_REQUESTS);
    assert_int_equal(w.first_admitted, 3);
    assert_int_equal(w.used_after_first, 33);
    /* The first step decodes token 13 too: the sliding layer holds blocks 4..6. */
    assert_int_equal(w.decoded_first, 3);
    assert_int_equal(w.sliding_after_first, 3 * 3);
    /* Each request ends at 16 tokens: blocks 0..5 released ((b + 1) * 2 <= 16 - 4). */
    assert_int_equal(w.window_releases, SCHED_REQUESTS * 6);
    assert_int_equal(w.peak_running, 3);
    assert_int_equal(w.finished, SCHED_REQUESTS);
    assert_int_equal(w.preemptions, 0);
    sched_run f = sched_run_on(full, 40, SCHED_REQUESTS);
    assert_int_equal(f.first_admitted, 2);
    assert_int_equal(f.used_after_first, 2 * 16);
    assert_int_equal(f.peak_running, 2);
    assert_int_equal(f.finished, SCHED_REQUESTS);
    assert_int_equal(f.sliding_after_first, 0);
    assert_int_equal(f.window_releases, 0);
    kvpt_destroy_model(full);
    kvpt_destroy_model(hybrid);
}

/*
 * The whole length: a windowed request of 16 tokens needs 12 pages at once
 * (its prefill), so a pool of 12 runs it and one of 11 rejects it; with
 * every layer full it needs 16 (rejected on 12).
 */
static void test_window_serve_scheduler_rejects_by_the_peak(void **state)
{
    (void)state;
    kvp_model *hybrid = model_of(4, 0);
    kvp_model *full = model_of(0, 0);
    sched_run fits = sched_run_on(hybrid, 12, 2);
    assert_int_equal(fits.finished, 2);
    assert_int_equal(fits.rejected, 0);
    assert_int_equal(fits.peak_running, 1);
    sched_run tight = sched_run_on(hybrid, 11, 1);
    assert_int_equal(tight.rejected, 1);
    assert_int_equal(tight.finished, 0);
    sched_run f = sched_run_on(full, 12, 1);
    assert_int_equal(f.rejected, 1);
    kvpt_destroy_model(full);
    kvpt_destroy_model(hybrid);
}

/*
 * Preemption stays exact with windows: no decoding reserve, 16 new tokens
 * each. Admission asks max(2 * 6, 3 + 6) = 12 per request, so 30 pages
 * admit 2; their full layers then grow to 14 blocks each (3 + 14 = 17 pages
 * a sequence at 28 tokens, 34 for two), so the newer is preempted and
 * recomputed. Every request completes, the audit after every step holds,
 * held + promised never passes the pool, and the windows released pages.
 */
static void test_window_serve_scheduler_preempts_exactly(void **state)
{
    (void)state;
    kvp_model *hybrid = model_of(4, 0);
    sched_run w = sched_run_with(hybrid, 30, 3, 16, 0);
    assert_int_equal(w.first_admitted, 2);
    assert_int_equal(w.finished, 3);
    assert_true(w.preemptions > 0);
    assert_true(w.window_releases > 0);
    kvpt_destroy_model(hybrid);
}

/*
 * Allocator-only (compute 0) over the same hybrid model: the external
 * caches carry no window and release nothing, so admission counts full
 * lengths, as every layer full: 2 on 40 pages, nothing released.
 */
static void test_window_serve_scheduler_allocator_only_counts_full(void **state)
{
    (void)state;
    kvp_model *hybrid = model_of(4, 0);
    sched_compute = 0;
    sched_run a = sched_run_on(hybrid, 40, SCHED_REQUESTS);
    sched_compute = 1;
    assert_int_equal(a.first_admitted, 2);
    assert_int_equal(a.used_after_first, 2 * 16);
    assert_int_equal(a.finished, SCHED_REQUESTS);
    assert_int_equal(a.sliding_after_first, 0);
    assert_int_equal(a.window_releases, 0);
    kvpt_destroy_model(hybrid);
}

/*
 * Sharing on, admission credits forked samples: W = 4 and a full layer,
 * bt = 2, one request of 12 prompt tokens, 4 new, 3 samples, reserve 4.
 * Sample 0 prefills the prompt (every block of both layers, held to its
 * end): max(2 * 6, 3 + 8) = 12 pages; each forked sample shares its live
 * blocks and takes at most its level, 3 + 8 = 11 (before, each was asked
 * sample 0's prefill again: 3 * 12 = 36). So 34 pages admit it at the first
 * step and run it to the end (held + promised within the pool, the audit
 * after every step), where 33 reject it as never fitting.
 */
typedef struct fork_run {
    size_t first_admitted;
    size_t rejected;
    size_t finished;
    size_t preemptions;
} fork_run;

static fork_run fork_run_on(kvp_model *model, size_t pages)
{
    enum { SAMPLES = 3 };
    kvp_error err;
    kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, pages);
    kvp_decoder *decoder = NULL;
    kvpt_assert_ok(kvp_decoder_create(1, &decoder, &err), &err);
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    config.capacity = 32;
    config.sharing = 1;
    config.watermark = 0.0;
    config.reserve_tokens = SCHED_NEW;
    kvp_scheduler *s = NULL;
    kvpt_assert_ok(kvp_scheduler_create(model, pool, decoder, &config, &s, &err), &err);
    kvp_request q;
    kvp_request_init(&q);
    q.prompt_tokens = SCHED_PROMPT;
    q.max_new_tokens = SCHED_NEW;
    q.samples = SAMPLES;
    q.input = sched_input;
    uint64_t id = 0;
    kvpt_assert_ok(kvp_scheduler_submit(s, &q, &id, &err), &err);
    fork_run run;
    memset(&run, 0, sizeof run);
    for (size_t step = 0; step < 20; step++) {
        kvp_step_stats st;
        kvp_step_stats_init(&st);
        kvpt_assert_ok(kvp_scheduler_step(s, &st, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvp_pool_stats ps = kvpt_stats(pool);
        assert_true(ps.held_pages + ps.promised_pages <= pages);
        if (step == 0) {
            run.first_admitted = st.admitted;
        }
        run.preemptions += st.preempted;
        kvp_request_result done[1];
        kvp_request_result_init(&done[0]);
        size_t n = 0;
        kvpt_assert_ok(kvp_scheduler_collect(s, done, 1, &n, &err), &err);
        if (n == 1) {
            run.rejected += done[0].rejected != 0;
            run.finished += !done[0].rejected && done[0].status == KVP_OK &&
                            done[0].tokens_generated == SAMPLES * SCHED_NEW;
        }
        if (st.running == 0 && st.waiting == 0) {
            break;
        }
    }
    kvpt_assert_ok(kvp_scheduler_destroy(s, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_decoder(decoder);
    kvp_pool_stats ps = kvpt_stats(pool);
    assert_int_equal(ps.held_pages, 0);
    assert_int_equal(ps.promised_pages, 0);
    kvpt_assert_ok(kvp_pool_destroy(pool, &err), &err);
    return run;
}

static void test_window_serve_scheduler_credits_forked_samples(void **state)
{
    (void)state;
    kvp_model *hybrid = model_of(4, 0);
    fork_run fits = fork_run_on(hybrid, 34);
    assert_int_equal(fits.first_admitted, 1);
    assert_int_equal(fits.finished, 1);
    assert_int_equal(fits.rejected, 0);
    assert_int_equal(fits.preemptions, 0);
    fork_run tight = fork_run_on(hybrid, 33);
    assert_int_equal(tight.first_admitted, 0);
    assert_int_equal(tight.rejected, 1);
    assert_int_equal(tight.finished, 0);
    kvpt_destroy_model(hybrid);
}

/* Rows of every request alike: a function of the position only. */
static void same_rows(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                      size_t width)
{
    (void)ctx;
    (void)id;
    (void)sample;
    for (size_t j = 0; j < width; j++) {
        row[j] = 0.01 * (double)((position * 7 + j * 3) % 17) - 0.08;
    }
}

/*
 * Sharing on, admission credits prefix hits: W = 4 and a full layer, bt = 2,
 * reserve 0. A direct sequence holds and publishes the first 4 rows (2
 * blocks of each layer: 4 pages, none released at length 4). A request of
 * those rows and 8 more (12 prompt tokens, 4 new) hits both blocks, so its
 * prefill takes 2 * (6 - 2) = 8 new pages and its level at 12 tokens is
 * 3 + 6 = 9: it asks max(8, 9) = 9 (before: max(2 * 6, 9) = 12). On 13
 * pages (9 free) the first step admits it, on 12 (8 free) it waits. Once the
 * direct sequence is gone its 4 hit pages are evictable: adopting them
 * takes them from the LRU list, so sample 0's prefill counts them,
 * max(8 + 4, 9) = 12, within the 12-page pool (before: 12 + 4 evictable =
 * 16, and the request waited forever on an empty pool it fits); it runs to
 * the end, the audit after every step.
 */
static size_t hit_run_on(kvp_model *model, size_t pages)
{
    kvp_error err;
    kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, pages);
    double rows[4 * WIDTH];
    for (size_t t = 0; t < 4; t++) {
        same_rows(NULL, 0, 0, t, rows + t * WIDTH, WIDTH);
    }
    kvp_sequence *holder = kvpt_sequence(model, pool, 1, 32);
    kvp_tensor prompt = kvp_tensor3(rows, 1, 4, WIDTH);
    double out[4 * WIDTH];
    kvpt_assert_ok(kvp_sequence_prefill(holder, &prompt, NULL, NULL, out, 4 * WIDTH, &err), &err);
    size_t published = 0;
    kvpt_assert_ok(kvp_sequence_publish_prefix(holder, &prompt, &published, &err), &err);
    assert_int_equal(published, 2);
    assert_int_equal(kvpt_stats(pool).held_pages, 4);
    kvpt_assert_pool_ok(pool);
    kvp_decoder *decoder = NULL;
    kvpt_assert_ok(kvp_decoder_create(1, &decoder, &err), &err);
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    config.capacity = 32;
    config.sharing = 1;
    config.watermark = 0.0;
    config.reserve_tokens = 0;
    kvp_scheduler *s = NULL;
    kvpt_assert_ok(kvp_scheduler_create(model, pool, decoder, &config, &s, &err), &err);
    kvp_request q;
    kvp_request_init(&q);
    q.prompt_tokens = SCHED_PROMPT;
    q.max_new_tokens = SCHED_NEW;
    q.input = same_rows;
    uint64_t id = 0;
    kvpt_assert_ok(kvp_scheduler_submit(s, &q, &id, &err), &err);
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    kvpt_assert_ok(kvp_scheduler_step(s, &st, &err), &err);
    kvpt_assert_pool_ok(pool);
    size_t admitted = st.admitted;
    if (admitted == 1) {
        assert_int_equal(st.prefix_hit_tokens, 4);
    }
    kvpt_destroy_sequence(holder, pool);
    kvpt_assert_pool_ok(pool);
    size_t finished = 0;
    for (size_t step = 0; step < 40 && !finished; step++) {
        kvp_step_stats_init(&st);
        kvpt_assert_ok(kvp_scheduler_step(s, &st, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvp_pool_stats ps = kvpt_stats(pool);
        assert_true(ps.held_pages + ps.promised_pages <= pages);
        kvp_request_result done[1];
        kvp_request_result_init(&done[0]);
        size_t n = 0;
        kvpt_assert_ok(kvp_scheduler_collect(s, done, 1, &n, &err), &err);
        if (n == 1) {
            assert_false(done[0].rejected);
            assert_int_equal(done[0].status, KVP_OK);
            assert_int_equal(done[0].tokens_generated, SCHED_NEW);
            finished = 1;
        }
    }
    assert_true(finished);
    kvpt_assert_ok(kvp_scheduler_destroy(s, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_decoder(decoder);
    kvpt_assert_ok(kvp_pool_destroy(pool, &err), &err);
    return admitted;
}

static void test_window_serve_scheduler_credits_prefix_hits(void **state)
{
    (void)state;
    kvp_model *hybrid = model_of(4, 0);
    assert_int_equal(hit_run_on(hybrid, 13), 1);
    assert_int_equal(hit_run_on(hybrid, 12), 0);
    kvpt_destroy_model(hybrid);
}

/*
 * kvp_sequence_truncate into a window's released blocks is refused
 * (BlockReleased, naming the layer), changing nothing, as kvp_cache_truncate
 * is; before, the sequence's truncate skipped the check and left a window
 * of null entries that the next step read.
 */
static void test_window_serve_sequence_truncate_into_released_is_refused(void **state)
{
    (void)state;
    kvp_model *model = model_of(4, 1);
    kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, 64);
    kvp_sequence *seq = kvpt_sequence(model, pool, BATCH, T);
    for (size_t t = 0; t < 7; t++) {
        step_once(seq, 300 + t);
        kvpt_assert_pool_ok(pool);
    }
    /* Length 7: W = 4 released block 0 ((0 + 1)·2 <= 3); W = 1 blocks 0..2 (<= 6). */
    kvpt_snapshot before;
    kvpt_snapshot_init(&before, pool);
    kvpt_snapshot_add_sequence(&before, seq);
    kvpt_snapshot_take(&before);
    kvp_error err;
    /* To 6: layer 0 needs [2, 6) (held); layer 1 needs [5, 6): block 2, released. */
    assert_int_equal(kvp_sequence_truncate(seq, 6, &err), KVP_BLOCK_RELEASED);
    assert_int_equal(err.layer, 1);
    assert_int_equal(err.index, 2);
    assert_int_equal(err.position, 5);
    assert_int_equal(err.tokens, 6);
    kvpt_assert_unchanged(&before, 0);
    /* To 5: layer 0 needs [1, 5): block 0, released (layer 0 is checked first). */
    assert_int_equal(kvp_sequence_truncate(seq, 5, &err), KVP_BLOCK_RELEASED);
    assert_int_equal(err.layer, 0);
    assert_int_equal(err.index, 0);
    assert_int_equal(err.position, 1);
    assert_int_equal(err.tokens, 5);
    kvpt_assert_unchanged(&before, 0);
    /* Its length succeeds and changes nothing; 0 needs nothing. */
    kvpt_assert_ok(kvp_sequence_truncate(seq, 7, &err), &err);
    kvpt_assert_unchanged(&before, 0);
    kvpt_assert_ok(kvp_sequence_truncate(seq, 0, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_len(seq), 0);
    assert_int_equal(kvp_sequence_held_pages(seq), 0);
    for (size_t t = 0; t < 3; t++) {
        step_once(seq, 400 + t);
        kvpt_assert_pool_ok(pool);
    }
    kvpt_destroy_sequence(seq, pool);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_serve_promises_are_hand_counted),
        cmocka_unit_test(test_window_serve_promise_is_a_level),
        cmocka_unit_test(test_window_serve_admits_n_where_full_admits_one),
        cmocka_unit_test(test_window_serve_released_blocks_are_the_null_entries),
        cmocka_unit_test(test_window_serve_scheduler_admits_the_level),
        cmocka_unit_test(test_window_serve_scheduler_rejects_by_the_peak),
        cmocka_unit_test(test_window_serve_scheduler_preempts_exactly),
        cmocka_unit_test(test_window_serve_scheduler_allocator_only_counts_full),
        cmocka_unit_test(test_window_serve_scheduler_shares_over_windows),
        cmocka_unit_test(test_window_serve_sequence_truncate_into_released_is_refused),
        cmocka_unit_test(test_window_serve_scheduler_credits_forked_samples),
        cmocka_unit_test(test_window_serve_scheduler_credits_prefix_hits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
