/*
 * test_scheduler_sharing.c: the scheduler's sharing, samples and weight
 * updates (kvpager/scheduler.h) through its public API:
 *   - samples: every sample's outputs bit-identical to a fresh sequence fed
 *     its rows alone, with sharing on and off; forked samples over a partial
 *     prompt page hold it once and are counted exactly (copy on write on 1
 *     and 3 decoder threads); more samples than max_running run alone;
 *   - sharing: prompt prefixes and a completed request's decoded blocks
 *     (each sample's own) are adopted by later prompts holding them,
 *     outputs unchanged; admission counts adopted pages once; compute off
 *     shares alike, prefix keys from rows or from block digests;
 *   - the cache-aware schedule admits a cached-prefix request ahead of an
 *     uncached head that does not fit, within its starvation bound, with
 *     every output as under FCFS;
 *   - a weight update recomputes, and an output-projection update makes
 *     running and kept sequences stale.
 * The fixture: sched_support.h. kvp_pool_check runs after every step. Unit
 * test: public API. Run by ctest (test_scheduler_sharing, and alone for
 * its copy-on-write cases: test_scheduler.cow_samples, .cow_promises).
 */
#include "sched_support.h"

/* ---- sharing: samples, the prefix index, weight updates ---------------- */

/* The requests of the sample runs: (prompt, new tokens); prompts end mid-block and on one. */
static const size_t sample_lengths[3][2] = {{5, 9}, {8, 6}, {3, 5}};

typedef struct sample_run {
    kvp_scheduler_stats stats;
    size_t max_held;
    size_t request_preemptions; /* summed over the requests' results */
} sample_run;

/*
 * The three requests with `samples` samples each, under sharing on or off,
 * over `pages` pages; every sample's outputs checked against a fresh sequence.
 */
static sample_run run_samples(size_t samples, int sharing, size_t pages, size_t threads)
{
    fixture f;
    setup_fixture_sharing(&f, pages, threads, 1, 0, sharing);
    static book b;
    memset(&b, 0, sizeof b);
    for (size_t i = 0; i < 3; i++) {
        submit_samples(&f, &b, sample_lengths[i][0], sample_lengths[i][1], NULL, samples);
    }
    sample_run out;
    memset(&out, 0, sizeof out);
    for (size_t steps = 0;; steps++) {
        kvp_scheduler_stats s = stats_of(&f);
        if (s.running == 0 && s.waiting == 0) {
            break;
        }
        assert_true(steps < 10000);
        kvp_step_stats st;
        kvp_step_stats_init(&st);
        kvp_error err;
        kvpt_assert_ok(kvp_scheduler_step(f.scheduler, &st, &err), &err);
        kvpt_assert_pool_ok(f.pool);
        assert_int_equal(st.running % samples, 0); /* samples run together */
        assert_int_equal(st.preempted % samples, 0);
        assert_true(st.held_pages <= st.unshared_pages);
        if (!sharing) {
            assert_int_equal(st.held_pages, st.unshared_pages); /* nothing shared */
            assert_int_equal(st.prefix_hit_tokens, 0);
            assert_int_equal(st.cached_pages, 0);
        }
        if (st.held_pages > out.max_held) {
            out.max_held = st.held_pages;
        }
    }
    kvp_request_result done[4];
    assert_int_equal(collect_all(&f, done, 4), 3);
    size_t prompt_tokens = 0;
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(done[i].status, KVP_OK);
        assert_int_equal(done[i].tokens_generated, samples * sample_lengths[done[i].id][1]);
        out.request_preemptions += done[i].preemptions;
        /* every admission's prompt, recomputation included */
        prompt_tokens += sample_lengths[done[i].id][0] * (1 + done[i].preemptions);
    }
    for (size_t i = 0; i < 3; i++) {
        assert_samples_exact(&b, i, samples, sample_lengths[i][0], sample_lengths[i][1]);
    }
    out.stats = stats_of(&f);
    assert_int_equal(out.stats.completed, 3);
    /* A fork per extra sample at every admission, recomputation included. */
    assert_int_equal(out.stats.forks,
                     sharing ? (samples - 1) * (3 + out.request_preemptions) : 0);
    assert_int_equal(out.stats.preemptions, samples * out.request_preemptions);
    assert_int_equal(out.stats.prompt_tokens, prompt_tokens);
    teardown_fixture(&f);
    return out;
}

static void test_scheduler_samples_exact_with_and_without_sharing(void **state)
{
    (void)state;
    for (size_t n = 1; n <= SAMPLES; n++) {
        for (int sharing = 0; sharing <= 1; sharing++) {
            /* Room for everything: no preemption. */
            sample_run roomy = run_samples(n, sharing, 128, 1 + (n % 2));
            assert_int_equal(roomy.request_preemptions, 0);
            assert_int_equal(roomy.stats.prompt_tokens, 5 + 8 + 3);
            assert_int_equal(roomy.stats.prefill_tokens,
                             sharing ? 5 + 8 + 3 : n * (5 + 8 + 3));
            /*
             * Tight: the first two requests are admitted together (with a
             * 4-token reserve, sharing: 4 + 4n and 4 + 2n pages; without:
             * 6n each) but cannot both grow to their whole length (sharing:
             * 8 + 10n; without: 16n), so growth preempts. One sample: 12
             * pages, as the preemption test above.
             */
            size_t pages = n == 1 ? 12 : sharing ? 6 * n + 9 : 12 * n + 2;
            sample_run tight = run_samples(n, sharing, pages, 2);
            assert_true(tight.request_preemptions > 0);
            assert_true(tight.max_held <= pages);
        }
    }
}

/*
 * Pages held with 4 samples of a 9-token prompt after the first step:
 * sharing holds the prompt's 2 full blocks once (x 2 layers) plus the
 * partial block, which sample 0 writes in place while the 3 others copy it
 * (4 x 2): 12, and never more: 3 copies x 2 layers (6, not 8) and the high
 * water mark 12 (copying in all 4 samples held the original beside 4
 * copies: 14). Without sharing every sample holds 3 blocks x 2 layers: 24.
 * On 1 and on 3 decoder threads (the 4 samples' first tokens run at once:
 * sample 0's in-place row beside the others' copies of the rows below it),
 * the pool audited after every step, outputs equal to fresh sequences. After
 * the run the published blocks stay cached and evictable: the prompt's, and
 * each sample's full third block (9 + 3 tokens), published when it completes.
 */

static void test_scheduler_sharing_holds_fewer_pages(void **state)
{
    (void)state;
    for (int run_ = 0; run_ < 3; run_++) {
        int sharing = run_ > 0;
        size_t threads = run_ == 2 ? 3 : 1;
        fixture f;
        setup_fixture_sharing(&f, 64, threads, 1, 0, sharing);
        static book b;
        memset(&b, 0, sizeof b);
        submit_samples(&f, &b, 9, 3, NULL, 4);
        kvp_step_stats st;
        kvp_step_stats_init(&st);
        kvp_error err;
        kvpt_assert_ok(kvp_scheduler_step(f.scheduler, &st, &err), &err);
        kvpt_assert_pool_ok(f.pool);
        assert_int_equal(st.admitted, 1);
        assert_int_equal(st.running, 4);
        assert_int_equal(st.decoded, 4);
        assert_int_equal(st.prompt_tokens, 9);
        assert_int_equal(st.prefill_tokens, sharing ? 9 : 36);
        assert_int_equal(st.unshared_pages, 24);
        assert_int_equal(st.held_pages, sharing ? 12 : 24);
        assert_int_equal(st.cached_pages, sharing ? 4 : 0);
        assert_int_equal(st.evictable_pages, 0);
        assert_int_equal(stats_of(&f).forks, sharing ? 3 : 0);
        kvp_pool_stats pool = pool_of(&f);
        assert_int_equal(pool.cow_copies, sharing ? 6 : 0); /* 3 forked samples x 2 layers */
        assert_int_equal(pool.high_water_pages, sharing ? 12 : 24);
        assert_int_equal(pool.promised_pages, 0);
        run(&f, 0);
        pool = pool_of(&f);
        assert_int_equal(pool.held_pages, 0);
        /* the prompt's 2 blocks, and each sample's third, full at completion */
        assert_int_equal(pool.evictable_pages, sharing ? 4 + 4 * 2 : 0);
        assert_int_equal(pool.cow_copies, sharing ? 6 : 0);
        assert_int_equal(pool.high_water_pages, sharing ? 12 : 24);
        assert_samples_exact(&b, 0, 4, 9, 3);
        kvp_request_result done[2];
        assert_int_equal(collect_all(&f, done, 2), 1);
        teardown_fixture(&f);
    }
}

/*
 * Admission counts an adopted prefix's pages once: request 0 (12 tokens of
 * group 0, still running) holds its prompt's 3 full blocks, published; request
 * 1 (13 tokens, the first 12 of group 0) adopts them and needs only its own
 * pages past them (13 + 2 tokens: 4 blocks, 3 adopted) x 2 layers, which a
 * pool of 10 pages has beside request 0's 8 (12 + 4 reserve tokens: 4 blocks
 * x 2 layers). Counted as its own, the prompt would not fit until request 0
 * completes.
 */
static void test_scheduler_admission_counts_adopted_pages_once(void **state)
{
    (void)state;
    fixture f;
    setup_fixture_sharing(&f, 10, 1, 1, 0, 1);
    static book b;
    memset(&b, 0, sizeof b);
    b.shared[0] = 12;
    b.shared[1] = 12;
    submit_samples(&f, &b, 12, 8, NULL, 1);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.held_pages, 8); /* 12 prompt + 4 reserve tokens: 4 blocks x 2 layers */
    submit_samples(&f, &b, 13, 2, NULL, 1);
    st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.prefix_hit_tokens, 12);
    assert_int_equal(st.held_pages, 10);
    assert_int_equal(st.running, 2);
    run(&f, 0);
    assert_samples_exact(&b, 0, 1, 12, 8);
    assert_samples_exact(&b, 1, 1, 13, 2);
    kvp_request_result done[4];
    assert_int_equal(collect_all(&f, done, 4), 2);
    teardown_fixture(&f);
}

/*
 * Prompts sharing a prefix hit the prefix index: request 0 (10 tokens of
 * group 0) publishes 2 full blocks; a later request with 13 tokens, the
 * first 10 of group 0, adopts both (8 tokens; at most (13 - 1) / 4 blocks);
 * one with the same 10 tokens adopts 8 (at most (10 - 1) / 4 = 2 blocks);
 * one with 8 tokens of the group adopts 4 (its last token is computed);
 * one of another group adopts nothing. Outputs stay exact, samples too;
 * sharing off never hits.
 */
static void test_scheduler_shared_prefixes_hit_the_index(void **state)
{
    (void)state;
    static const size_t prompts[5] = {10, 13, 10, 8, 10};
    static const size_t shared[5] = {10, 10, 10, 8, 10};
    static const uint64_t groups[5] = {0, 0, 0, 0, 1};
    static const size_t hits[5] = {0, 8, 8, 4, 0};
    for (int sharing = 0; sharing <= 1; sharing++) {
        fixture f;
        setup_fixture_sharing(&f, 64, 2, 1, 0, sharing);
        static book b;
        memset(&b, 0, sizeof b);
        size_t total_hits = 0;
        for (size_t i = 0; i < 5; i++) {
            b.shared[i] = shared[i];
            b.group[i] = groups[i];
            submit_samples(&f, &b, prompts[i], 3, NULL, 1 + i % 2);
            kvp_step_stats st = step_once(&f);
            assert_int_equal(st.admitted, 1);
            assert_int_equal(st.prompt_tokens, prompts[i]);
            assert_int_equal(st.prefix_hit_tokens, sharing ? hits[i] : 0);
            total_hits += sharing ? hits[i] : 0;
        }
        run(&f, 0);
        kvp_scheduler_stats s = stats_of(&f);
        assert_int_equal(s.prefix_hit_tokens, total_hits);
        assert_int_equal(s.prompt_tokens, 10 + 13 + 10 + 8 + 10);
        for (size_t i = 0; i < 5; i++) {
            assert_samples_exact(&b, i, 1 + i % 2, prompts[i], 3);
        }
        kvp_request_result done[8];
        assert_int_equal(collect_all(&f, done, 8), 5);
        for (size_t k = 0; k < 5; k++) {
            /* Request i was admitted alone in step i, with its hits; it decoded its first
             * token in that step and its 3 tokens in steps i .. i + 2. */
            uint64_t i = done[k].id;
            assert_int_equal(done[k].admissions, 1);
            assert_int_equal(done[k].first_hit_tokens, sharing ? hits[i] : 0);
            assert_int_equal(done[k].recomputed_tokens, 0);
            assert_int_equal(done[k].admitted_step, i);
            assert_int_equal(done[k].first_token_step, i);
            assert_int_equal(done[k].finished_step, i + 2);
        }
        teardown_fixture(&f);
    }
}

/*
 * A weight update between steps: the running requests (2 samples each) are
 * preempted as stale and recomputed under the new weights; a new request
 * with the same prefix gets no hit of the old blocks, then later ones hit
 * the new blocks; every token decoded after the update equals a fresh
 * sequence under the new weights, bit for bit.
 */
static void test_scheduler_weight_update_recomputes(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 64, 2, 1, 0);
    static book b;
    memset(&b, 0, sizeof b);
    for (size_t i = 0; i < 4; i++) {
        b.shared[i] = 9;
        b.group[i] = 0;
    }
    submit_samples(&f, &b, 9, 10, NULL, 2);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.prefix_hit_tokens, 0);
    submit_samples(&f, &b, 11, 10, NULL, 2);
    st = step_once(&f);
    assert_int_equal(st.prefix_hit_tokens, 8); /* request 0's 2 blocks */
    st = step_once(&f);
    assert_int_equal(st.running, 4);
    size_t before_update[2] = {b.tokens[0][0], b.tokens[1][0]};
    assert_int_equal(before_update[0], 3);
    assert_int_equal(before_update[1], 2);
    update_weights(f.model);
    st = step_once(&f); /* the two stale requests go back to the queue, nothing decodes */
    assert_int_equal(st.stale_preempted, 4);
    assert_int_equal(st.preempted, 4);
    assert_int_equal(st.decoded, 0);
    assert_int_equal(st.running, 0);
    assert_int_equal(st.waiting, 2);
    submit_samples(&f, &b, 10, 4, NULL, 1); /* request 2: the same prefix */
    st = step_once(&f); /* all three admitted together: no block of the new weights yet */
    assert_int_equal(st.admitted, 3);
    assert_int_equal(st.prefix_hit_tokens, 0);
    assert_int_equal(st.prompt_tokens, 9 + 11 + 10);
    assert_int_equal(st.prefill_tokens, 9 + 2 * 3 + 11 + 2 * 2 + 10);
    assert_int_equal(st.stale_preempted, 0);
    submit_samples(&f, &b, 12, 2, NULL, 1); /* request 3: hits the new blocks */
    st = step_once(&f);
    assert_int_equal(st.prefix_hit_tokens, 8);
    run(&f, 0);
    kvp_scheduler_stats s = stats_of(&f);
    assert_int_equal(s.stale_preemptions, 4);
    assert_int_equal(s.preemptions, 4);
    assert_int_equal(s.prefix_hit_tokens, 16);
    assert_int_equal(s.completed, 4);
    for (size_t k = 0; k < 2; k++) {
        assert_sample_exact_range(&b, 0, k, 9, 10, 9 + before_update[0], CAPACITY, 1);
        assert_sample_exact_range(&b, 1, k, 11, 10, 11 + before_update[1], CAPACITY, 1);
        /* Before the update, the outputs were the old weights'. */
        assert_sample_exact_range(&b, 0, k, 9, 10, 0, 9 + before_update[0], 0);
        assert_sample_exact_range(&b, 1, k, 11, 10, 0, 11 + before_update[1], 0);
    }
    assert_sample_exact_range(&b, 2, 0, 10, 4, 0, CAPACITY, 1);
    assert_sample_exact_range(&b, 3, 0, 12, 2, 0, CAPACITY, 1);
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 4);
    for (size_t i = 0; i < 4; i++) {
        assert_int_equal(done[i].status, KVP_OK);
    }
    teardown_fixture(&f);
}

/* The schedule of shared-prefix requests with samples: compute on and off alike. */
static void schedule_shared(int compute, size_t pages, kvp_step_stats *steps, size_t *count)
{
    fixture f;
    setup_fixture(&f, pages, 1, compute, 0);
    static book b;
    memset(&b, 0, sizeof b);
    *count = 0;
    for (size_t i = 0;; i++) {
        if (i < 6) { /* one request a step, so later ones find earlier ones' blocks */
            b.shared[i] = 8;
            b.group[i] = i % 2;
            submit_samples(&f, &b, 9 + i, 3 + i % 3, NULL, 1 + i % 3);
        }
        kvp_scheduler_stats s = stats_of(&f);
        if (s.running == 0 && s.waiting == 0) {
            break;
        }
        assert_true(*count < 256);
        steps[(*count)++] = step_once(&f);
    }
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 6);
    teardown_fixture(&f);
}

static void test_scheduler_compute_off_shares_alike(void **state)
{
    (void)state;
    static kvp_step_stats on[256];
    static kvp_step_stats off[256];
    size_t pages[] = {96, 20};
    for (size_t i = 0; i < 2; i++) {
        size_t n_on = 0;
        size_t n_off = 0;
        schedule_shared(1, pages[i], on, &n_on);
        schedule_shared(0, pages[i], off, &n_off);
        assert_int_equal(n_on, n_off);
        size_t hit = 0;
        for (size_t k = 0; k < n_on; k++) {
            assert_memory_equal(&on[k], &off[k], sizeof on[k]);
            hit += on[k].prefix_hit_tokens;
        }
        assert_true(hit > 0);
        /* Without a model (the config's geometry): the same steps, hits included;
           and with block digests instead of rows too. */
        fixture_without_model = 1;
        for (int digests = 0; digests <= 1; digests++) {
            requests_by_digest = digests;
            digest_calls = 0;
            schedule_shared(0, pages[i], off, &n_off);
            assert_true(digests ? digest_calls > 0 : digest_calls == 0);
            assert_int_equal(n_on, n_off);
            for (size_t k = 0; k < n_on; k++) {
                assert_memory_equal(&on[k], &off[k], sizeof on[k]);
            }
        }
        requests_by_digest = 0;
        fixture_without_model = 0;
    }
}

/*
 * A completed request publishes its decoded blocks too: request 0 (6 prompt
 * tokens, 10 decoded: 4 full blocks, the last 3 holding decoded tokens)
 * runs to completion; request 1, whose prompt is request 0's 16 rows and 3
 * more (a conversation's next turn), adopts all 4 blocks ((19 - 1) / 4 = 4:
 * 16 tokens), not only the prompt's first. With 2 samples each sample
 * publishes its own blocks (here their rows are the same: the second finds
 * the keys taken and leaves them). Outputs equal a fresh sequence's, and
 * sharing off's, bit for bit; compute off hits alike, keyed by rows or,
 * with no model, by block digests (no row read); after a weight update
 * nothing of the old blocks is adopted.
 */
static void test_scheduler_publishes_decoded_blocks(void **state)
{
    (void)state;
    static double off_outputs[3][2][CAPACITY][WIDTH]; /* request 1's, sharing off, by samples */
    /* mode 2: computed; 1: allocator-only; 0: allocator-only, no model, block digests */
    for (int mode = 2; mode >= 0; mode--) {
        int compute = mode == 2;
        fixture_without_model = requests_by_digest = mode == 0;
        for (size_t samples = 1; samples <= 2; samples++) {
            for (int sharing = 0; sharing <= 1; sharing++) {
                /* compute off binds the configured identity: no update to make */
                for (int update = 0; update <= (sharing && compute); update++) {
                    fixture f;
                    setup_fixture_sharing(&f, 64, 2, compute, 0, sharing);
                    static book b;
                    memset(&b, 0, sizeof b);
                    for (size_t i = 0; i < 2; i++) {
                        b.shared[i] = CAPACITY; /* every row of both is group 0's */
                        b.group[i] = 0;
                    }
                    submit_samples(&f, &b, 6, 10, NULL, samples);
                    run(&f, 0);
                    assert_int_equal(stats_of(&f).completed, 1);
                    if (update) {
                        update_weights(f.model);
                    }
                    submit_samples(&f, &b, 19, 2, NULL, 1);
                    kvp_step_stats st = step_once(&f);
                    assert_int_equal(st.admitted, 1);
                    assert_int_equal(st.prompt_tokens, 19);
                    assert_int_equal(st.prefix_hit_tokens, sharing && !update ? 16 : 0);
                    run(&f, 0);
                    if (compute) {
                        assert_samples_exact(&b, 0, samples, 6, 10);
                        assert_sample_exact_range(&b, 1, 0, 19, 2, 0, CAPACITY, (size_t)update);
                        if (!sharing) {
                            memcpy(off_outputs[samples], b.outputs[1], sizeof off_outputs[0]);
                        } else if (!update) {
                            assert_memory_equal(off_outputs[samples], b.outputs[1],
                                                sizeof off_outputs[0]);
                        }
                    }
                    teardown_collected(&f, 2);
                }
            }
        }
    }
    fixture_without_model = requests_by_digest = 0;
}

/*
 * Publication continues the prompt's block keys kept from its admission, and
 * reads its own rows for the rest: request 0 (6 prompt tokens, the last 2
 * in a partial block, 10 decoded) is admitted, then request 1 (rows of its
 * own, 6 tokens, 2 decoded) in the next step, whose rows replace request
 * 0's in the step's scratch; request 0 completes after it. Request 2,
 * request 0's 16 rows and 3 more, adopts 4 blocks (16 tokens): the block
 * holding the prompt's partial rows and the decoded ones was keyed from
 * request 0's rows, not the scratch's (computed, and allocator-only keyed
 * by rows or by block digests).
 */
static void test_scheduler_publication_keys_its_own_partial_block(void **state)
{
    (void)state;
    for (int mode = 2; mode >= 0; mode--) {
        int compute = mode == 2;
        fixture_without_model = requests_by_digest = mode == 0;
        fixture f;
        setup_fixture_sharing(&f, 64, 1, compute, 0, 1);
        static book b;
        memset(&b, 0, sizeof b);
        b.shared[0] = b.shared[2] = CAPACITY; /* requests 0 and 2: group 0's rows */
        b.group[0] = b.group[2] = 0;
        submit_samples(&f, &b, 6, 10, NULL, 1);
        assert_int_equal(step_once(&f).admitted, 1);
        submit_samples(&f, &b, 6, 2, NULL, 1); /* rows of its own */
        assert_int_equal(step_once(&f).admitted, 1);
        run(&f, 0);
        assert_int_equal(stats_of(&f).completed, 2);
        submit_samples(&f, &b, 19, 2, NULL, 1);
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.admitted, 1);
        assert_int_equal(st.prompt_tokens, 19);
        assert_int_equal(st.prefix_hit_tokens, 16);
        run(&f, 0);
        if (compute) {
            assert_samples_exact(&b, 0, 1, 6, 10);
            assert_samples_exact(&b, 2, 1, 19, 2);
        }
        teardown_collected(&f, 3);
    }
    fixture_without_model = requests_by_digest = 0;
}

/*
 * Outputs of a request whose prompt rows were given (`rows`, its first
 * `prompt`) and whose decoded rows come from the book, against a fresh
 * sequence fed the same rows alone, bit for bit.
 */
static void assert_given_prompt_exact(const book *b, uint64_t id, const double *rows,
                                      size_t prompt, size_t new_tokens)
{
    kvp_model *model = make_model();
    kvp_pool *pool = kvpt_pool(BLOCK, KV_HEADS, HEAD_WIDTH, 64);
    kvp_sequence *seq = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_create(model, pool, 1, CAPACITY, &seq, &err), &err);
    kvp_tensor input = kvp_tensor3((double *)(uintptr_t)rows, 1, prompt, WIDTH);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &input, NULL, NULL, NULL, 0, &err), &err);
    assert_int_equal(b->tokens[id][0], new_tokens);
    for (size_t position = prompt; position < prompt + new_tokens; position++) {
        double row[WIDTH];
        double out[WIDTH];
        row_at(b, id, 0, position, row);
        kvp_tensor one = kvp_tensor3(row, 1, 1, WIDTH);
        kvpt_assert_ok(kvp_sequence_step(seq, &one, NULL, NULL, out, WIDTH, &err), &err);
        assert_true(b->seen[id][0][position]);
        assert_memory_equal(out, b->outputs[id][0][position], sizeof out);
    }
    kvpt_assert_ok(kvp_sequence_destroy(seq, NULL), NULL);
    kvpt_assert_ok(kvp_pool_destroy(pool, NULL), NULL);
    kvpt_assert_ok(kvp_model_destroy(model, NULL), NULL);
}

/*
 * Each sample publishes its own decoded blocks, chained from the prompt:
 * request 0 (6 prompt tokens, 10 decoded, 2 samples whose decoded rows
 * differ) completes; then request 1 + k, whose 19-token prompt is request
 * 0's prompt, sample k's 10 rows and 3 of its own (the next turn after
 * sample k's reply), adopts 4 blocks (16 tokens) for each k: both samples'
 * chains, the one keyed first and the one keyed after it, reach every
 * decoded block. With sharing off nothing is adopted; compute off hits
 * alike; outputs equal a fresh sequence's bit for bit. One decoder thread.
 */
static void test_scheduler_publishes_each_samples_decoded_blocks(void **state)
{
    (void)state;
    enum { PROMPT = 6, NEW = 10, NEXT = 19 };
    static double rows[2][NEXT][WIDTH];
    for (int compute = 1; compute >= 0; compute--) {
        for (int sharing = 0; sharing <= 1; sharing++) {
            fixture f;
            setup_fixture_sharing(&f, 64, 1, compute, 0, sharing);
            static book b;
            memset(&b, 0, sizeof b); /* nothing shared: sample k > 0 decodes its own rows */
            submit_samples(&f, &b, PROMPT, NEW, NULL, 2);
            run(&f, 0);
            assert_int_equal(stats_of(&f).completed, 1);
            for (size_t k = 0; k < 2; k++) {
                uint64_t id = 1 + k;
                for (size_t t = 0; t < NEXT; t++) {
                    if (t < PROMPT + NEW) {
                        row_at(&b, 0, k, t, rows[k][t]); /* the prompt, then sample k's reply */
                    } else {
                        row_at(&b, id, 0, t, rows[k][t]);
                    }
                }
                assert_int_equal(submit(&f, &b, NEXT, 2, &rows[k][0][0]), id);
                kvp_step_stats st = step_once(&f);
                assert_int_equal(st.admitted, 1);
                assert_int_equal(st.prompt_tokens, NEXT);
                assert_int_equal(st.prefix_hit_tokens, sharing ? 16 : 0);
                run(&f, 0);
            }
            /* The replies differ from position PROMPT on: two chains, not one. */
            assert_memory_not_equal(rows[0][PROMPT], rows[1][PROMPT], sizeof rows[0][PROMPT]);
            if (compute) {
                assert_samples_exact(&b, 0, 2, PROMPT, NEW);
                for (size_t k = 0; k < 2; k++) {
                    assert_given_prompt_exact(&b, 1 + k, &rows[k][0][0], NEXT, 2);
                }
            }
            teardown_collected(&f, 3);
        }
    }
}

/*
 * One run of the overtaking scenario under `schedule`: request 0 (33
 * tokens of group 0, 30 new) runs and holds most of a 32-page pool; request
 * 1 (25 tokens of its own) waits at the head, never fitting beside it (14
 * pages asked, at most 12 available); requests 2 .. 13 (33 tokens of group
 * 0, 1 new), one submitted before each step, adopt request 0's 8 prompt
 * blocks and fit in 2 pages. Writes the step each request was admitted at
 * (its first decoded token) and the steps that admitted a request behind
 * request 1 while it waited.
 */
#define OVERTAKERS 12
static void run_overtaking(kvp_schedule schedule, book *b, size_t *admitted_at,
                           size_t *overtaking_steps)
{
    fixture f;
    setup_fixture_schedule(&f, 32, 2, 1, 0, 1, schedule);
    memset(b, 0, sizeof *b);
    for (size_t i = 0; i < 2 + OVERTAKERS; i++) {
        b->shared[i] = i == 1 ? 0 : 33;
        b->group[i] = 0;
        admitted_at[i] = SIZE_MAX;
    }
    submit_samples(&f, b, 33, 30, NULL, 1);
    assert_int_equal(step_once(&f).admitted, 1);
    submit_samples(&f, b, 25, 3, NULL, 1);
    *overtaking_steps = 0;
    for (size_t step = 1; stats_of(&f).running + stats_of(&f).waiting > 0; step++) {
        assert_true(step < 1000);
        if (step <= OVERTAKERS) {
            submit_samples(&f, b, 33, 1, NULL, 1);
        }
        kvp_step_stats st = step_once(&f);
        if (step == 1) {
            /* Only the cached request fits: cache-aware admits it ahead of the head. */
            assert_int_equal(st.admitted, schedule == KVP_SCHEDULE_CACHE_AWARE);
            assert_int_equal(st.prefix_hit_tokens, 32 * st.admitted);
        }
        int overtaken = 0;
        for (size_t i = 0; i < 2 + OVERTAKERS; i++) {
            if (admitted_at[i] == SIZE_MAX && b->tokens[i][0] > 0) {
                admitted_at[i] = step;
                overtaken |= i > 1 && admitted_at[1] == SIZE_MAX;
            }
        }
        *overtaking_steps += (size_t)overtaken;
    }
    for (size_t i = 0; i < 2 + OVERTAKERS; i++) {
        assert_true(admitted_at[i] != SIZE_MAX);
        assert_sample_exact_range(b, i, 0, i == 1 ? 25 : 33, i == 0 ? 30 : i == 1 ? 3 : 1, 0,
                                  CAPACITY, 0);
    }
    kvp_request_result done[2 + OVERTAKERS];
    assert_int_equal(collect_all(&f, done, 2 + OVERTAKERS), 2 + OVERTAKERS);
    teardown_fixture(&f);
}

/*
 * Cache-aware admission: a request whose prompt prefix the index holds is
 * admitted ahead of an uncached head that does not fit; the head is
 * overtaken in at most KVP_SCHEDULE_MAX_SKIPS steps, after which nothing
 * behind it goes first; every request's outputs are bit-identical to FCFS's
 * (and to a fresh sequence's).
 */
static void test_scheduler_cache_aware_admits_cached_prefix_first(void **state)
{
    (void)state;
    static book fcfs;
    static book aware;
    size_t fcfs_at[2 + OVERTAKERS];
    size_t aware_at[2 + OVERTAKERS];
    size_t fcfs_overtakes;
    size_t aware_overtakes;
    run_overtaking(KVP_SCHEDULE_FCFS, &fcfs, fcfs_at, &fcfs_overtakes);
    run_overtaking(KVP_SCHEDULE_CACHE_AWARE, &aware, aware_at, &aware_overtakes);
    assert_int_equal(fcfs_overtakes, 0);
    assert_int_equal(aware_overtakes, KVP_SCHEDULE_MAX_SKIPS); /* reached, and held */
    for (size_t i = 2; i < 2 + OVERTAKERS; i++) {
        assert_true(fcfs_at[i] >= fcfs_at[1]);
        /* The first MAX_SKIPS overtakers went first; the rest waited behind request 1. */
        if (i < 2 + KVP_SCHEDULE_MAX_SKIPS) {
            assert_true(aware_at[i] < aware_at[1]);
        } else {
            assert_true(aware_at[i] >= aware_at[1]);
        }
    }
    assert_memory_equal(fcfs.outputs, aware.outputs, sizeof fcfs.outputs);
    assert_memory_equal(fcfs.tokens, aware.tokens, sizeof fcfs.tokens);
}

/*
 * A request with more samples than max_running (3 > 2) is admitted only
 * when nothing runs, and then runs alone: request 0 (1 sample) runs first;
 * request 1 (3 samples) waits until it finished, then decodes 3 sequences a
 * step, request 2 (1 sample) waiting behind it until it finishes.
 */
static void test_scheduler_more_samples_than_max_running_run_alone(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 64, 1, 1, 2);
    static book b;
    memset(&b, 0, sizeof b);
    submit(&f, &b, 5, 2, NULL);
    submit_samples(&f, &b, 5, 2, NULL, 3);
    submit(&f, &b, 5, 2, NULL);
    static const size_t admitted[5] = {1, 0, 1, 0, 1};
    static const size_t decoded[5] = {1, 1, 3, 3, 1};
    for (size_t i = 0; i < 5; i++) {
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.admitted, admitted[i]);
        assert_int_equal(st.decoded, decoded[i]);
    }
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.decoded, 1);
    assert_int_equal(st.finished, 1);
    assert_int_equal(stats_of(&f).peak_running, 3);
    assert_samples_exact(&b, 1, 3, 5, 2);
    teardown_collected(&f, 3);
}

/*
 * Page accounting of forked samples over a partial prompt page (issue 16,
 * 5. and 9.): request 0 has 3 samples of a 6-token prompt (1 full block and
 * a partial one) and 2 new tokens. It takes the prompt's 2 blocks once (x 2
 * layers: 4 pages); sample 0 then writes the partial page in place and each
 * other sample copies it (x 2 layers: 4 pages): 8 pages, n - 1 copies for n
 * samples. Beside it, request 1 (3 + 1 tokens) needs 2 pages. With 10
 * pages both are admitted in the first step and fill the pool exactly
 * (counting a copy per sample, 10 + 2, request 1 waited); with 9, request 1 waits (admission
 * counts the promises exactly: counting no copies, 4 + 2, it would be
 * admitted) and runs when request 0 finishes. After the first step (the
 * copies made) nothing is promised; the audit holds after every step.
 * Compute off (external caches), and compute on with 1 and 3 decoder
 * threads, whose 3 samples' first tokens run at once.
 */
static void test_scheduler_forked_samples_count_partial_prompt_page(void **state)
{
    (void)state;
    for (size_t pages = 9; pages <= 10; pages++) {
        for (int mode = 0; mode < 3; mode++) {
            fixture f;
            setup_fixture(&f, pages, mode == 2 ? 3 : 1, mode > 0, 0);
            (void)submit_rows(&f, 6, 2, 3);
            (void)submit_rows(&f, 3, 1, 1);
            kvp_step_stats st = step_once(&f);
            int both = pages == 10;
            assert_int_equal(st.admitted, both ? 2 : 1);
            assert_int_equal(st.rejected, 0);
            assert_int_equal(st.preempted, 0);
            assert_int_equal(st.waiting, both ? 0 : 1);
            assert_int_equal(st.decoded, both ? 4 : 3);
            kvp_pool_stats pool = pool_of(&f);
            /* the full block shared, the partial one and 2 copies, x 2 layers; request 1's 2
               until it finished (its 1 token) */
            assert_int_equal(st.finished, both ? 1 : 0);
            assert_int_equal(pool.held_pages, 8);
            assert_int_equal(pool.high_water_pages, both ? 10 : 8);
            assert_int_equal(pool.promised_pages, 0);
            assert_int_equal(pool.cow_copies, 4);
            assert_int_equal(st.unshared_pages, 12); /* 3 samples x 2 blocks x 2 layers */
            run(&f, 0);
            kvp_request_result done[8];
            assert_int_equal(collect_all(&f, done, 8), 2);
            assert_int_equal(stats_of(&f).preemptions, 0);
            assert_int_equal(stats_of(&f).forks, 2);
            assert_int_equal(pool_of(&f).cow_copies, 4);
            teardown_fixture(&f);
        }
    }
}

/* Updates parameter `index` of layer `layer` in place (its revision + 1). */
static void update_param(kvp_model *model, size_t layer, size_t index)
{
    kvp_error err;
    kvpt_assert_ok(kvp_param_update_with(kvp_model_param_mut(model, layer, index), scale_values,
                                         NULL, &err),
                   &err);
}

/*
 * A kept or leased sequence is stale after an output-projection update
 * (issue 16, 9.): W_o of the last layer changes none of the K/V a sequence
 * holds, but its binding covers it. So a running request is preempted for
 * recompute (a stale preemption) and the kept sequence of a finished turn
 * is given back as stale (a drop), its blocks no longer adoptable; the
 * recomputed request then finishes. Checking only W_q, W_k and W_v, or
 * only layer 0, would keep both.
 */
static void test_scheduler_output_projection_update_is_stale(void **state)
{
    (void)state;
    fixture f;
    static book b;
    start_conversation(&f, &b);
    assert_sessions(&f, 1, 0, 0, 1, TURN1_PAGES);
    uint64_t other = submit(&f, &b, 5, 6, NULL);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    update_param(f.model, LAYERS - 1, KVP_PARAM_OUTPUT);
    st = step_once(&f);
    assert_int_equal(st.stale_preempted, 1);
    assert_int_equal(st.preempted, 1);
    assert_int_equal(st.decoded, 0);
    assert_int_equal(st.retained_pages, 0);
    assert_sessions(&f, 1, 0, 1, 0, 0);
    assert_int_equal(stats_of(&f).stale_preemptions, 1);
    run(&f, 0);
    assert_int_equal(b.tokens[other][0], 6);
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 2);
    assert_int_equal(done[1].id, other);
    assert_int_equal(done[1].preemptions, 1);
    teardown_fixture(&f);
}

/* argv[1], when given, runs only the tests it names (a cmocka pattern; CMakeLists.txt). */
int main(int argc, char **argv)
{
    if (argc > 1) {
        cmocka_set_test_filter(argv[1]);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scheduler_samples_exact_with_and_without_sharing),
        cmocka_unit_test(test_scheduler_sharing_holds_fewer_pages),
        cmocka_unit_test(test_scheduler_admission_counts_adopted_pages_once),
        cmocka_unit_test(test_scheduler_shared_prefixes_hit_the_index),
        cmocka_unit_test(test_scheduler_weight_update_recomputes),
        cmocka_unit_test(test_scheduler_compute_off_shares_alike),
        cmocka_unit_test(test_scheduler_publishes_decoded_blocks),
        cmocka_unit_test(test_scheduler_publication_keys_its_own_partial_block),
        cmocka_unit_test(test_scheduler_publishes_each_samples_decoded_blocks),
        cmocka_unit_test(test_scheduler_cache_aware_admits_cached_prefix_first),
        cmocka_unit_test(test_scheduler_forked_samples_count_partial_prompt_page),
        cmocka_unit_test(test_scheduler_output_projection_update_is_stale),
        cmocka_unit_test(test_scheduler_more_samples_than_max_running_run_alone),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
