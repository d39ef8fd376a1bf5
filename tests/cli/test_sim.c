/*
 * test_sim.c: `kvpager simulate`'s run (src/cli/sim.c, verify.c) on small
 * hand-made workloads (cmocka), built against kvpager_cli_hooks: the CLI's
 * run compiled with KVP_SIM_TEST_HOOKS, whose only addition is a hook that
 * flips one bit of one kept output, or drops it (verify.h). The program
 * itself is built without it.
 *   - --verify checks every token of a run that spans weight updates, each
 *     under the weights it was decoded with (one prefill per weight
 *     version), skipping nothing; a one-bit error in a token decoded under
 *     an older version, or under the last, is one mismatch, and so is a
 *     token whose output never came.
 *   - prefix_hit_rate and pages_saved_ratio equal figures computed by hand
 *     from the scheduler's rules (scheduler.h), written out below, with
 *     compute on and off.
 *   - a request with block ids (a Mooncake trace) takes its prompt rows
 *     from its ids: equal leading ids hit, an equal later id after a
 *     different first one does not (chain keys).
 *   - latency (latency.h): the nearest-rank rule on hand-picked values, the
 *     percentiles of a hand-made schedule, and a real run's exact figures.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "latency.h"
#include "pager/alloc.h"
#include "sim.h"
#include "verify.h"
#include "workload.h"

/*
 * A tiny model and pool: 1 layer, width 8, 2 heads of 4 (2 KV heads),
 * pages of 4 positions (2 x 2 heads x 4 positions x 4 features x 8 bytes =
 * 512 bytes), 64 KiB = 128 pages, far more than the runs below hold, so
 * nothing is evicted or preempted for pages. One thread: the schedule does
 * not depend on it, and the test stays light under Valgrind.
 */
static kvp_sim_config tiny_config(void)
{
    kvp_sim_config c;
    kvp_sim_config_init(&c);
    c.layers = 1;
    c.model_width = 8;
    c.heads = 2;
    c.block_tokens = 4;
    c.budget_bytes = 64 << 10;
    c.capacity = 64;
    c.threads = 1;
    c.audit_every = 1;
    c.session_ttl = 0;
    return c;
}

static kvp_workload_request plain(size_t arrival, size_t prompt, size_t output, size_t shared,
                                  uint64_t stream)
{
    kvp_workload_request r;
    memset(&r, 0, sizeof r);
    r.arrival_step = arrival;
    r.prompt_tokens = prompt;
    r.output_tokens = output;
    r.shared_tokens = shared;
    r.stream = stream;
    return r;
}

static void run(const kvp_sim_config *c, kvp_workload_request *requests, size_t count,
                kvp_sim_result *out)
{
    kvp_workload w = {requests, count};
    kvp_error err;
    const char *context = NULL;
    assert_int_equal(kvp_sim_run(c, &w, NULL, NULL, out, &err, &context), 0);
    assert_int_equal(out->requests_completed, count);
    assert_int_equal(out->audit_failures, 0);
    assert_int_equal(out->pages_leaked, 0);
}

/*
 * One request of 8 prompt and 30 output tokens, 2 samples, weights updated
 * every 7 steps. The request decodes one token per step from step 0; each
 * update (before steps 7, 14, 21, 28) makes it stale, and the scheduler
 * preempts and recomputes it within the step, so its tokens come from
 * epochs 0 (tokens 0-6), 1 (7-13), 2 (14-20), 3 (21-27) and 4 (28-29):
 * 5 prefills per sample, 10 in all, 4 updates replayed on the verifier's
 * model. Before issue 16 this request was skipped (verified 0).
 */
static kvp_sim_config spanning_config(void)
{
    kvp_sim_config c = tiny_config();
    c.samples = 2;
    c.update_every = 7;
    c.verify_every = 1;
    return c;
}

static void test_sim_verify_checks_every_epoch_of_a_spanning_run(void **state)
{
    (void)state;
    kvp_sim_config c = spanning_config();
    kvp_workload_request r = plain(0, 8, 30, 0, 0);
    kvp_sim_result res;
    kvp_sim_test_flip_one = (kvp_sim_test_flip){.request = SIZE_MAX};
    run(&c, &r, 1, &res);
    assert_int_equal(res.weight_updates, 4);
    assert_int_equal(res.verified, 2);
    assert_int_equal(res.verify_segments, 10);
    assert_int_equal(res.verify_replayed, 4);
    assert_int_equal(res.verify_skipped, 0);
    assert_int_equal(res.verify_mismatches, 0);
    kvp_sim_result_free(&res);
}

/*
 * One kept token corrupted by the test hook, a bit flipped or (drop) its
 * output never reaching on_token, is exactly one mismatch, whatever its
 * epoch: the request is not reported verified clean. Every segment still
 * runs, so its epoch's other tokens are checked too.
 */
static void corrupt_and_expect(size_t sample, size_t token, size_t epoch, int drop)
{
    kvp_sim_config c = spanning_config();
    kvp_workload_request r = plain(0, 8, 30, 0, 0);
    kvp_sim_result res;
    kvp_sim_test_flip_one = (kvp_sim_test_flip){
        .request = 0, .sample = sample, .token = token, .drop = drop};
    run(&c, &r, 1, &res);
    assert_true(kvp_sim_test_flip_one.flipped);
    assert_int_equal(kvp_sim_test_flip_one.epoch, epoch);
    assert_int_equal(res.verified, 2);
    assert_int_equal(res.verify_segments, 10);
    assert_int_equal(res.verify_skipped, 0);
    assert_int_equal(res.verify_mismatches, 1);
    kvp_sim_test_flip_one = (kvp_sim_test_flip){.request = SIZE_MAX};
    kvp_sim_result_free(&res);
}

static void test_sim_verify_catches_one_flipped_bit(void **state)
{
    (void)state;
    corrupt_and_expect(1, 3, 0, 0);  /* sample 1, under the first weights */
    corrupt_and_expect(0, 10, 1, 0); /* sample 0, under an intermediate version */
    corrupt_and_expect(0, 29, 4, 0); /* the last token, under the last weights */
}

static void test_sim_verify_counts_a_missing_output(void **state)
{
    (void)state;
    corrupt_and_expect(1, 3, 0, 1);
    corrupt_and_expect(0, 10, 1, 1);
    corrupt_and_expect(0, 29, 4, 1);
}

/*
 * The prefix hit rate, by hand. Pages of 4 positions; requests arrive far
 * apart (each finishes, 2 decode steps, long before the next arrives), and
 * nothing is evicted (128 pages). Positions below shared_tokens have the
 * same rows in every request, so the same block keys.
 *   r0: prompt 9 (8 shared): the index is empty, 0 hits. After its prefill
 *       it publishes its 2 full prompt blocks (positions 0-7); at the end
 *       its 9 + 2 = 11 positions still have 2 full blocks, the same ones.
 *   r1: prompt 9 (8 shared): adopts both blocks, 8 hits (at most 9 - 1).
 *   r2: prompt 6, nothing shared (its own stream): 0 hits.
 *   r3: prompt 8, all shared: a sequence adopts at most T - 1 = 7 tokens
 *       (its last token is computed), so block 1 (positions 4-7) is not
 *       adopted: 4 hits.
 * prompt tokens 9 + 9 + 6 + 8 = 32, hits 0 + 8 + 0 + 4 = 12: 12 / 32 = 0.375.
 * No samples, so no page is shared between running sequences: every step
 * holds exactly what its sequences would hold unshared, pages saved 1.0.
 */
static void test_sim_prefix_hit_rate_by_hand(void **state)
{
    (void)state;
    for (int compute = 1; compute >= 0; compute--) {
        kvp_sim_config c = tiny_config();
        c.compute = compute;
        kvp_workload_request r[4] = {plain(0, 9, 2, 8, 0), plain(10, 9, 2, 8, 1),
                                     plain(20, 6, 2, 0, 2), plain(30, 8, 2, 8, 3)};
        kvp_sim_result res;
        run(&c, r, 4, &res);
        assert_int_equal(res.prompt_tokens, 32);
        assert_int_equal(res.prefix_hit_tokens, 12);
        assert_true(res.prefix_hit_rate == 0.375);
        assert_true(res.pages_saved_ratio == 1.0);
        kvp_sim_result_free(&res);
    }
}

/*
 * Pages saved, by hand: one request, prompt 6, 5 output tokens, 2 samples,
 * pages of 4 positions. The step admits, prefills, forks, then decodes;
 * its held pages are the pool's after the step and its unshared pages the
 * sum of each running sequence's own page count.
 *   step 0: the prefill fills block 0 (positions 0-3) and half of block 1
 *           (4-5); the fork shares both pages. Each sample appends position
 *           6 into block 1, a shared partial page, so it writes its own
 *           copy: block 0 is shared, each sample has its own block 1.
 *           held 1 + 2 = 3; unshared 2 + 2 = 4.
 *   step 1: position 7 fills block 1: held 3, unshared 4.
 *   step 2: position 8 opens block 2 in each sample: held 3 + 2 = 5,
 *           unshared 3 + 3 = 6.
 *   step 3: position 9: held 5, unshared 6.
 *   step 4: position 10, the 5th token: the request finishes and gives its
 *           pages back (block 0, published, stays cached but evictable, not
 *           held): held 0, unshared 0.
 * Sums over the 5 steps: unshared 4 + 4 + 6 + 6 + 0 = 20, held 3 + 3 + 5 +
 * 5 + 0 = 16: pages saved 20 / 16 = 1.25. The prompt had no earlier blocks
 * to adopt: hit rate 0 of 6.
 */
static void test_sim_pages_saved_ratio_by_hand(void **state)
{
    (void)state;
    for (int compute = 1; compute >= 0; compute--) {
        kvp_sim_config c = tiny_config();
        c.compute = compute;
        c.samples = 2;
        kvp_workload_request r = plain(0, 6, 5, 0, 0);
        kvp_sim_result res;
        run(&c, &r, 1, &res);
        assert_int_equal(res.steps, 5);
        assert_true(res.unshared_page_steps == 20.0);
        assert_true(res.held_page_steps == 16.0);
        assert_true(res.pages_saved_ratio == 1.25);
        assert_int_equal(res.peak_held_pages, 5);
        assert_int_equal(res.prompt_tokens, 6);
        assert_int_equal(res.prefix_hit_tokens, 0);
        assert_true(res.prefix_hit_rate == 0.0);
        kvp_sim_result_free(&res);
    }
}

/*
 * Block ids. Pages of 4 positions, 1 MiB (2048 pages), requests far apart:
 *   r0: 600 tokens, ids [5, 9]: nothing cached.
 *   r1: 520 tokens, ids [5, 11]: block 5 is r0's first 512 positions: 512 hits.
 *   r2: 520 tokens, ids [6, 9]: its first block differs, so nothing hits,
 *       though its second id is r0's (a chain key covers every earlier token).
 * Hits 512 of 1640 prompt tokens, all at first admissions.
 */
static void test_sim_block_ids_give_prefix_hits(void **state)
{
    (void)state;
    static const uint64_t ids[3][2] = {{5, 9}, {5, 11}, {6, 9}};
    for (int compute = 1; compute >= 0; compute--) {
        kvp_sim_config c = tiny_config();
        c.compute = compute;
        c.budget_bytes = 1 << 20;
        c.capacity = 640;
        kvp_workload_request r[3] = {plain(0, 600, 2, 0, 0), plain(10, 520, 2, 0, 1),
                                     plain(20, 520, 2, 0, 2)};
        for (size_t i = 0; i < 3; i++) {
            r[i].block_ids = ids[i];
            r[i].block_count = 2;
        }
        kvp_sim_result res;
        run(&c, r, 3, &res);
        assert_int_equal(res.prompt_tokens, 1640);
        assert_int_equal(res.prefix_hit_tokens, 512);
        assert_int_equal(res.first_hit_tokens, 512);
        assert_int_equal(res.request_log[1].first_hit_tokens, 512);
        assert_int_equal(res.request_log[2].first_hit_tokens, 0);
        kvp_sim_result_free(&res);
    }
}

static void test_sim_percentile_nearest_rank(void **state)
{
    (void)state;
    double v[200];
    for (size_t i = 0; i < 200; i++) {
        v[i] = (double)(i + 1);
    }
    /* n = 10: ranks ceil(5) = 5, ceil(9) = 9, ceil(9.9) = 10. */
    assert_true(kvp_percentile_nearest_rank(v, 10, 50) == 5.0);
    assert_true(kvp_percentile_nearest_rank(v, 10, 90) == 9.0);
    assert_true(kvp_percentile_nearest_rank(v, 10, 99) == 10.0);
    /* n = 200: ranks 100, 180, 198. n = 4: ranks 2, ceil(3.6) = 4, 4. n = 1: the value. */
    assert_true(kvp_percentile_nearest_rank(v, 200, 50) == 100.0);
    assert_true(kvp_percentile_nearest_rank(v, 200, 90) == 180.0);
    assert_true(kvp_percentile_nearest_rank(v, 200, 99) == 198.0);
    assert_true(kvp_percentile_nearest_rank(v, 4, 50) == 2.0);
    assert_true(kvp_percentile_nearest_rank(v, 4, 90) == 4.0);
    assert_true(kvp_percentile_nearest_rank(v, 1, 99) == 1.0);
    assert_true(isnan(kvp_percentile_nearest_rank(v, 0, 50)));
}

/*
 * A schedule by hand: 5 steps with clocks 0, 1, 2, 5, 6 (idle steps 3 and 4
 * skipped), step k starting at k s and ending at k + 0.5 s.
 *   r0: submitted before step 0, admitted 0, first token 0, finished 2, 3 tokens:
 *       queue 0, TTFT 1, E2E 3, TPOT (3 - 1) / 2 = 1 steps; queue 0 s, E2E 2.5 s
 *   r1: submitted 0, admitted 1, first token 1, finished 4, 4 tokens:
 *       queue 1, TTFT 2, E2E 6 - 0 + 1 = 7, TPOT 5 / 3; queue 1 s
 *   r2: submitted 1, admitted 3 (preempted once: 7 tokens recomputed), first
 *       token 3, finished 3, 1 token: queue 5 - 1 = 4, TTFT 5, E2E 5, no TPOT;
 *       queue start(3) - start(1) = 2 s
 *   r3: rejected: no figures.
 *   r4: submitted 2, admitted 2, first token 3, finished 4, 2 tokens:
 *       queue 0, TTFT 5 - 2 + 1 = 4, E2E 6 - 2 + 1 = 5, TPOT 1; queue 0 s
 * Sorted: queue 0 0 1 4 (p50 rank 2: 0; p90 rank 4: 4), TTFT 1 2 4 5 (2, 5),
 * E2E 3 5 5 7 (5, 7), TPOT 1 1 5/3 (rank 2: 1; rank 3: 5/3), recomputed
 * 0 0 0 7 (0, 7), queue seconds 0 0 1 2 (0, 2).
 */
static void test_sim_latency_of_a_hand_made_schedule(void **state)
{
    (void)state;
    kvp_sim_sample steps[5];
    static const size_t clocks[5] = {0, 1, 2, 5, 6};
    for (size_t k = 0; k < 5; k++) {
        memset(&steps[k], 0, sizeof steps[k]);
        steps[k].clock = clocks[k];
        steps[k].start_seconds = (double)k;
        steps[k].end_seconds = (double)k + 0.5;
    }
    kvp_sim_request log[5];
    memset(log, 0, sizeof log);
    /* submit, output, finished, rejected, admissions, hits, recomputed, admitted, first, end */
    log[0] = (kvp_sim_request){0, 3, 1, 0, 1, 0, 0, 0, 0, 2};
    log[1] = (kvp_sim_request){0, 4, 1, 0, 1, 0, 0, 1, 1, 4};
    log[2] = (kvp_sim_request){1, 1, 1, 0, 2, 0, 7, 3, 3, 3};
    log[3] = (kvp_sim_request){1, 5, 1, 1, 0, 0, 0, 0, 0, 1};
    log[4] = (kvp_sim_request){2, 2, 1, 0, 1, 0, 0, 2, 3, 4};
    kvp_sim_result r;
    memset(&r, 0, sizeof r);
    r.requests = 5;
    r.steps = 5;
    r.samples = steps;
    r.request_log = log;
    kvp_latency l;
    assert_int_equal(kvp_latency_compute(&r, &l), 0);
    assert_int_equal(l.queue_steps.count, 4);
    assert_true(l.queue_steps.p50 == 0.0 && l.queue_steps.p90 == 4.0 && l.queue_steps.p99 == 4.0);
    assert_true(l.ttft_steps.p50 == 2.0 && l.ttft_steps.p90 == 5.0);
    assert_true(l.e2e_steps.p50 == 5.0 && l.e2e_steps.p90 == 7.0);
    assert_int_equal(l.tpot_steps.count, 3);
    assert_true(l.tpot_steps.p50 == 1.0 && l.tpot_steps.p90 == 5.0 / 3.0);
    assert_true(l.recomputed_tokens.p50 == 0.0 && l.recomputed_tokens.p90 == 7.0);
    assert_true(l.queue_seconds.p50 == 0.0 && l.queue_seconds.p90 == 2.0);
    /* TTFT seconds: end(first) - start(submit): 0.5, 1.5, 2.5, 1.5: sorted p50 1.5, p90 2.5. */
    assert_true(l.ttft_seconds.p50 == 1.5 && l.ttft_seconds.p90 == 2.5);
}

/*
 * A real run's latency: the prefix-hit workload above (4 requests far
 * apart, 2 tokens each, nothing queued): each is admitted in its arrival
 * step and decodes its first token there (queue 0, TTFT 1 step) and its
 * second in the next (E2E 2, TPOT 1); nothing recomputed.
 */
static void test_sim_latency_of_a_run(void **state)
{
    (void)state;
    kvp_sim_config c = tiny_config();
    kvp_workload_request r[4] = {plain(0, 9, 2, 8, 0), plain(10, 9, 2, 8, 1),
                                 plain(20, 6, 2, 0, 2), plain(30, 8, 2, 8, 3)};
    kvp_sim_result res;
    run(&c, r, 4, &res);
    kvp_latency l;
    assert_int_equal(kvp_latency_compute(&res, &l), 0);
    assert_int_equal(l.e2e_steps.count, 4);
    assert_true(l.queue_steps.p99 == 0.0 && l.ttft_steps.p50 == 1.0 && l.ttft_steps.p99 == 1.0);
    assert_true(l.e2e_steps.p50 == 2.0 && l.e2e_steps.p99 == 2.0);
    assert_true(l.tpot_steps.p99 == 1.0 && l.recomputed_tokens.p99 == 0.0);
    assert_true(l.queue_seconds.p99 >= 0.0 && l.e2e_seconds.p50 > 0.0);
    assert_int_equal(res.first_hit_tokens, 12);
    kvp_sim_result_free(&res);
}

/*
 * The library allocation sites of a run, counted through the fault
 * injector (pager/alloc.h): the nth allocation is made to fail, for n = 1,
 * 2, ... until a run makes fewer than n, and the site each one hit is
 * counted. A run a fault stops fails cleanly (the sanitizers watch it).
 */
static void sites_of_run(int compute, uint64_t counts[KVPI_SITE_COUNT_])
{
    memset(counts, 0, KVPI_SITE_COUNT_ * sizeof counts[0]);
    kvp_sim_config c = tiny_config();
    c.compute = compute;
    kvp_workload_request r[2] = {plain(0, 9, 2, 8, 0), plain(1, 6, 2, 0, 1)};
    kvp_workload w = {r, 2};
    for (uint64_t nth = 1;; nth++) {
        kvp_sim_result res;
        kvp_error err;
        const char *context = NULL;
        kvpi_fault_arm(nth);
        int rc = kvp_sim_run(&c, &w, NULL, NULL, &res, &err, &context);
        int fired = kvpi_fault_fired();
        kvpi_fault_site site = kvpi_fault_last_site();
        kvpi_fault_arm(0);
        kvp_sim_result_free(&res); /* failed or not (sim.h) */
        if (!fired) {
            assert_int_equal(rc, 0);
            break;
        }
        assert_true((unsigned)site < (unsigned)KVPI_SITE_COUNT_);
        counts[site]++;
        assert_true(nth < 100000);
    }
}

/*
 * An allocator-only run (--no-compute) builds no weights: no parameter and
 * no model is allocated, while the computed run of the same workload
 * allocates both (so the count sees them).
 */
static void test_sim_allocator_only_creates_no_parameter(void **state)
{
    (void)state;
    uint64_t computed[KVPI_SITE_COUNT_];
    uint64_t allocator_only[KVPI_SITE_COUNT_];
    sites_of_run(1, computed);
    sites_of_run(0, allocator_only);
    assert_true(computed[KVPI_SITE_PARAM] > 0);
    assert_true(computed[KVPI_SITE_MODEL] > 0);
    assert_int_equal(allocator_only[KVPI_SITE_PARAM], 0);
    assert_int_equal(allocator_only[KVPI_SITE_MODEL], 0);
    assert_int_equal(allocator_only[KVPI_SITE_LAYER], 0);
    assert_true(allocator_only[KVPI_SITE_CACHE_STRUCT] > 0); /* its external caches */
}

/*
 * Fused allocator-only pages (sim.c, fused_layers; DESIGN.md): a pool page
 * holding a block of all 3 layers runs the same schedule as one page per
 * layer, and reports the same figures in one-layer pages. The workload
 * fills the pool: shared prefixes hit, evictions and preemptions happen, two
 * samples fork. 3 layers of 512-byte pages (2 KV heads x 4 positions x 4
 * wide x K and V x 8 bytes), 18 KiB: 36 pages, 12 blocks of every layer.
 */
static void compare_fused(const kvp_sim_result *f, const kvp_sim_result *p)
{
    const size_t sizes[][2] = {
        {f->steps, p->steps}, {f->requests_completed, p->requests_completed},
        {f->requests_rejected, p->requests_rejected}, {f->preemptions, p->preemptions},
        {f->prompt_tokens, p->prompt_tokens}, {f->prefix_hit_tokens, p->prefix_hit_tokens},
        {f->first_hit_tokens, p->first_hit_tokens}, {f->prefill_tokens, p->prefill_tokens},
        {f->tokens_generated, p->tokens_generated}, {f->forks, p->forks},
        {f->peak_concurrent, p->peak_concurrent}, {f->total_pages, p->total_pages},
        {f->page_bytes, p->page_bytes}, {f->peak_held_pages, p->peak_held_pages},
        {f->acquires, p->acquires}, {f->releases, p->releases},
        {f->evictions, p->evictions}, {f->cow_copies, p->cow_copies},
        {f->audits, p->audits}, {f->full_sequences, p->full_sequences},
        {f->f64_full_sequences, p->f64_full_sequences}};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        assert_int_equal(sizes[i][0], sizes[i][1]);
    }
    const double ratios[][2] = {
        {f->held_page_steps, p->held_page_steps}, {f->unshared_page_steps, p->unshared_page_steps},
        {f->mean_concurrent, p->mean_concurrent}, {f->peak_utilization, p->peak_utilization},
        {f->mean_utilization, p->mean_utilization},
        {f->internal_fragmentation, p->internal_fragmentation}};
    for (size_t i = 0; i < sizeof ratios / sizeof ratios[0]; i++) {
        assert_true(ratios[i][0] == ratios[i][1]);
    }
    for (size_t i = 0; i < f->requests; i++) {
        const kvp_sim_request *a = &f->request_log[i];
        const kvp_sim_request *b = &p->request_log[i];
        assert_int_equal(a->admissions, b->admissions);
        assert_int_equal(a->first_hit_tokens, b->first_hit_tokens);
        assert_int_equal(a->recomputed_tokens, b->recomputed_tokens);
        assert_int_equal(a->admitted_step, b->admitted_step);
        assert_int_equal(a->first_token_step, b->first_token_step);
        assert_int_equal(a->finished_step, b->finished_step);
    }
    for (size_t i = 0; i < f->steps; i++) {
        assert_int_equal(f->samples[i].held_pages, p->samples[i].held_pages);
        assert_int_equal(f->samples[i].cached_pages, p->samples[i].cached_pages);
        assert_int_equal(f->samples[i].evictable_pages, p->samples[i].evictable_pages);
    }
}

static void test_sim_fused_pages_run_the_per_layer_schedule(void **state)
{
    (void)state;
    kvp_sim_config c = tiny_config();
    c.compute = 0;
    c.layers = 3;
    c.samples = 2;
    c.budget_bytes = 18 << 10;
    c.watermark = 0.0;
    c.reserve_tokens = 0;
    kvp_workload_request r[12];
    for (size_t i = 0; i < 12; i++) {
        r[i] = plain(i / 3, 9 + i % 4, 3 + i % 5, i % 2 == 0 ? 8 : 0, i);
    }
    kvp_sim_result fused;
    kvp_sim_result per_layer;
    run(&c, r, 12, &fused);
    c.fuse_layers = 0;
    run(&c, r, 12, &per_layer);
    assert_int_equal(fused.fused_layers, 3);
    assert_int_equal(per_layer.fused_layers, 1);
    assert_int_equal(fused.total_pages, 36);
    assert_int_equal(fused.page_bytes, 512);
    /* The workload exercises what fusing must keep: hits, evictions, preemption, forks. */
    assert_true(fused.prefix_hit_tokens > 0 && fused.evictions > 0);
    assert_true(fused.preemptions > 0 && fused.forks > 0);
    compare_fused(&fused, &per_layer);
    kvp_sim_result_free(&fused);
    kvp_sim_result_free(&per_layer);
    /* Not exact, not fused: 37 one-layer pages are not whole blocks of 3 layers. */
    c.fuse_layers = 1;
    c.budget_bytes = 37 * 512;
    run(&c, r, 12, &per_layer);
    assert_int_equal(per_layer.fused_layers, 1);
    assert_int_equal(per_layer.total_pages, 37);
    kvp_sim_result_free(&per_layer);
    /* A computed run keeps a page per layer. */
    c.compute = 1;
    c.budget_bytes = 18 << 10;
    run(&c, r, 12, &per_layer);
    assert_int_equal(per_layer.fused_layers, 1);
    kvp_sim_result_free(&per_layer);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sim_verify_checks_every_epoch_of_a_spanning_run),
        cmocka_unit_test(test_sim_verify_catches_one_flipped_bit),
        cmocka_unit_test(test_sim_verify_counts_a_missing_output),
        cmocka_unit_test(test_sim_prefix_hit_rate_by_hand),
        cmocka_unit_test(test_sim_pages_saved_ratio_by_hand),
        cmocka_unit_test(test_sim_block_ids_give_prefix_hits),
        cmocka_unit_test(test_sim_percentile_nearest_rank),
        cmocka_unit_test(test_sim_latency_of_a_hand_made_schedule),
        cmocka_unit_test(test_sim_latency_of_a_run),
        cmocka_unit_test(test_sim_allocator_only_creates_no_parameter),
        cmocka_unit_test(test_sim_fused_pages_run_the_per_layer_schedule),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
