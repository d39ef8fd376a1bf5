/*
 * test_scheduler_sessions.c: the scheduler's sessions (kvpager/scheduler.h)
 * through its public API:
 *   - a finished turn's sequence is kept so the conversation's next turn
 *     adopts its blocks across eviction pressure (outputs as without
 *     sessions) and goes to the front of the queue;
 *   - it is given back on each rule (expiry at its ttl, replacement,
 *     session_fraction, running sequences' pages before any preemption,
 *     stale parameters, a stalled queue), counted exactly; the largest ttl
 *     never expires; kept sessions count shared pages once;
 *   - under seeded random conversations the audit, the cap and the counts
 *     hold and outputs stay exact;
 *   - fairness: a steady stream of session turns overtakes a plain request
 *     at most KVP_SESSION_MAX_OVERTAKES times.
 * The fixture: sched_support.h. kvp_pool_check runs after every step. Unit
 * test: public API. Run by ctest (test_scheduler_sessions).
 */
#include "sched_support.h"

/*
 * A conversation's next turn adopts its first turn's blocks across
 * eviction pressure: in a 24-page pool, turn 1 (session 1) completes,
 * then two requests of 28 prompt tokens and 4 decoded (16 pages each) run
 * one after the other. Without sessions (ttl 0) turn 1's 8 evictable pages
 * are the least recently used and the second filler evicts them: turn 2
 * adopts nothing. With sessions turn 1's sequence is kept (held, 8 pages,
 * so the fillers evict each other's instead) and turn 2 adopts its 16
 * tokens; the kept sequence is then given back (a session hit) and turn 2
 * is kept in turn (12 pages, at most half the pool). Every output is
 * bit-identical between the two runs and to a fresh sequence's.
 */
static void test_scheduler_session_keeps_turn_across_pressure(void **state)
{
    (void)state;
    static book runs[2];
    static const size_t ttls[2] = {0, 100};
    for (size_t r = 0; r < 2; r++) {
        size_t ttl = ttls[r];
        int on = ttl != 0;
        fixture f;
        setup_fixture_sessions(&f, 24, ttl, 0.5);
        book *b = &runs[r];
        memset(b, 0, sizeof *b);
        static const uint64_t turns[2] = {0, 3};
        book_conversation(b, turns, 2, 0); /* requests 1 and 2 (the fillers): their own rows */
        submit_session(&f, b, TURN1_PROMPT, TURN1_NEW, NULL, 1, 1);
        run(&f, 0);
        assert_sessions(&f, on, 0, 0, on, on ? TURN1_PAGES : 0);
        kvp_pool_stats pool = pool_of(&f);
        assert_int_equal(pool.held_pages, on ? TURN1_PAGES : 0);
        assert_int_equal(pool.evictable_pages, on ? 0 : TURN1_PAGES);
        for (size_t i = 0; i < 2; i++) {
            submit_session(&f, b, 28, 4, NULL, 1, 0);
            kvp_step_stats st = step_once(&f);
            assert_int_equal(st.admitted, 1);
            assert_int_equal(st.prefix_hit_tokens, 0);
            assert_int_equal(st.retained_pages, on ? TURN1_PAGES : 0);
            run(&f, 0);
        }
        assert_sessions(&f, on, 0, 0, on, on ? TURN1_PAGES : 0);
        submit_session(&f, b, TURN2_PROMPT, TURN2_NEW, NULL, 1, 1);
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.admitted, 1);
        assert_int_equal(st.prompt_tokens, TURN2_PROMPT);
        assert_int_equal(st.prefix_hit_tokens, on ? 16 : 0);
        assert_int_equal(st.retained_pages, 0); /* given back once turn 2 adopted it */
        assert_sessions(&f, on, on, 0, 0, 0);
        run(&f, 0);
        assert_sessions(&f, 2 * (uint64_t)on, on, 0, on, on ? TURN2_PAGES : 0);
        assert_int_equal(pool_of(&f).held_pages, on ? TURN2_PAGES : 0);
        kvp_scheduler_stats s = stats_of(&f);
        assert_int_equal(s.prefix_hit_tokens, on ? 16 : 0);
        assert_int_equal(s.preemptions, 0);
        assert_int_equal(s.completed, 4);
        assert_samples_exact(b, 0, 1, TURN1_PROMPT, TURN1_NEW);
        assert_samples_exact(b, 1, 1, 28, 4);
        assert_samples_exact(b, 2, 1, 28, 4);
        assert_samples_exact(b, 3, 1, TURN2_PROMPT, TURN2_NEW);
        teardown_collected(&f, 4); /* the kept turn 2 gives its pages back: none held */
    }
    assert_memory_equal(runs[0].outputs, runs[1].outputs, sizeof runs[0].outputs);
    assert_memory_equal(runs[0].tokens, runs[1].tokens, sizeof runs[0].tokens);
}

/*
 * A request submitted while its session's sequence is kept goes to the
 * front of the queue: turn 1 (session 1) is kept (8 pages of 24); request
 * 1 (20 prompt tokens, 4 decoded: 12 pages) runs; request 2 (8 + 2
 * tokens: 6 pages) waits, 4 pages being left. Turn 2 of session 1 (4 new
 * pages past its 4 adopted blocks) is then admitted ahead of request 2.
 * Submitted under session 2 (nothing kept), the same request queues behind
 * request 2 and FCFS admits neither. Outputs exact either way.
 */
static void test_scheduler_session_request_goes_first(void **state)
{
    (void)state;
    for (uint64_t session = 1; session <= 2; session++) {
        int first = session == 1;
        fixture f;
        setup_fixture_sessions(&f, 24, 100, 0.5);
        static book b;
        memset(&b, 0, sizeof b);
        static const uint64_t turns[2] = {0, 3};
        book_conversation(&b, turns, 2, 0);
        submit_session(&f, &b, TURN1_PROMPT, TURN1_NEW, NULL, 1, 1);
        run(&f, 0);
        submit_session(&f, &b, 20, 4, NULL, 1, 0);
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.admitted, 1);
        assert_int_equal(st.held_pages, TURN1_PAGES + 12);
        submit_session(&f, &b, 8, 2, NULL, 1, 0);
        st = step_once(&f);
        assert_int_equal(st.admitted, 0);
        assert_int_equal(st.waiting, 1);
        submit_session(&f, &b, TURN2_PROMPT, TURN2_NEW, NULL, 1, session);
        st = step_once(&f);
        assert_int_equal(st.admitted, first);
        assert_int_equal(st.prefix_hit_tokens, first ? 16 : 0);
        assert_int_equal(st.waiting, first ? 1 : 2);
        assert_int_equal(b.tokens[3][0], first);
        assert_int_equal(b.tokens[2][0], 0);
        assert_sessions(&f, 1, first, 0, !first, first ? 0 : TURN1_PAGES);
        assert_int_equal(stats_of(&f).preemptions, 0);
        run(&f, 0);
        assert_int_equal(stats_of(&f).completed, 4);
        assert_samples_exact(&b, 0, 1, TURN1_PROMPT, TURN1_NEW);
        assert_samples_exact(&b, 1, 1, 20, 4);
        assert_samples_exact(&b, 2, 1, 8, 2);
        assert_samples_exact(&b, 3, 1, TURN2_PROMPT, TURN2_NEW);
        teardown_collected(&f, 4);
    }
}

/*
 * Expiry: with ttl 3 turn 1's sequence is kept through the 3 steps after
 * the one it finished in (a request admitted in the third adopts it: a
 * session hit) and given back at the end of the third (a drop: its pages
 * evictable, still indexed, so the next turn still hits the index).
 */
static void test_scheduler_session_expires_after_ttl(void **state)
{
    (void)state;
    const size_t ttl = 3;
    for (size_t waits = ttl - 1; waits <= ttl; waits++) {
        int kept = waits < ttl;
        fixture f;
        setup_fixture_sessions(&f, 24, ttl, 0.5);
        static book b;
        kvp_step_stats st = run_turn1(&f, &b);
        assert_int_equal(st.retained_pages, TURN1_PAGES);
        assert_int_equal(st.held_pages, TURN1_PAGES);
        for (size_t j = 1; j <= waits; j++) {
            st = step_once(&f); /* nothing runs or waits */
            assert_int_equal(st.retained_pages, j < ttl ? TURN1_PAGES : 0);
            assert_int_equal(st.held_pages, j < ttl ? TURN1_PAGES : 0);
        }
        assert_sessions(&f, 1, 0, !kept, kept, kept ? TURN1_PAGES : 0);
        assert_int_equal(pool_of(&f).evictable_pages, kept ? 0 : TURN1_PAGES);
        submit_session(&f, &b, TURN2_PROMPT, TURN2_NEW, NULL, 1, 1);
        st = step_once(&f);
        assert_int_equal(st.admitted, 1);
        assert_int_equal(st.prefix_hit_tokens, 16);
        assert_sessions(&f, 1, kept, !kept, 0, 0);
        run(&f, 0);
        assert_sessions(&f, 2, kept, !kept, 1, TURN2_PAGES);
        assert_samples_exact(&b, 0, 1, TURN1_PROMPT, TURN1_NEW);
        assert_samples_exact(&b, 1, 1, TURN2_PROMPT, TURN2_NEW);
        teardown_collected(&f, 2);
    }
}

/*
 * Replacement: two requests of session 1 run together (6 prompt tokens of
 * their own; 2 and 5 decoded). The first completes at step 2 and is kept
 * (8 tokens: 4 pages); the second completes at step 5 and is kept instead
 * (11 tokens: 6 pages), the first given back (a drop).
 */
static void test_scheduler_session_replaced_by_same_session(void **state)
{
    (void)state;
    fixture f;
    setup_fixture_sessions(&f, 24, 100, 0.5);
    static book b;
    memset(&b, 0, sizeof b);
    submit_session(&f, &b, 6, 2, NULL, 1, 1);
    submit_session(&f, &b, 6, 5, NULL, 1, 1);
    for (size_t step = 1; step <= 5; step++) {
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.admitted, step == 1 ? 2 : 0);
        assert_int_equal(st.finished, step == 2 || step == 5);
        assert_int_equal(st.retained_pages, step < 2 ? 0 : step < 5 ? 4 : 6);
        if (step < 5) {
            assert_sessions(&f, step >= 2, 0, 0, step >= 2, step < 2 ? 0 : 4);
        }
    }
    assert_sessions(&f, 2, 0, 1, 1, 6);
    kvp_pool_stats pool = pool_of(&f);
    assert_int_equal(pool.held_pages, 6);
    assert_int_equal(stats_of(&f).running, 0);
    assert_samples_exact(&b, 0, 1, 6, 2);
    assert_samples_exact(&b, 1, 1, 6, 5);
    teardown_collected(&f, 2);
}

/*
 * session_fraction caps the kept pages: fraction 0 keeps nothing, nor does
 * 0.25 (6 of 24 pages) a sequence of 8 pages; at 0.5 (12 pages) a second
 * session's 8 pages push the oldest out (a drop), keeping one.
 */
static void test_scheduler_session_fraction_caps_kept_pages(void **state)
{
    (void)state;
    static const double fractions[2] = {0.0, 0.25};
    for (size_t i = 0; i < 2; i++) {
        fixture f;
        setup_fixture_sessions(&f, 24, 100, fractions[i]);
        static book b;
        kvp_step_stats st = run_turn1(&f, &b);
        assert_int_equal(st.retained_pages, 0);
        assert_sessions(&f, 0, 0, 0, 0, 0);
        kvp_pool_stats pool = pool_of(&f);
        assert_int_equal(pool.held_pages, 0);
        assert_int_equal(pool.evictable_pages, TURN1_PAGES);
        teardown_collected(&f, 1);
    }
    fixture f;
    static book b;
    start_conversation(&f, &b);
    assert_sessions(&f, 1, 0, 0, 1, TURN1_PAGES);
    b.shared[1] = 0; /* request 1: session 2, its own rows, as long */
    submit_session(&f, &b, TURN1_PROMPT, TURN1_NEW, NULL, 1, 2);
    run(&f, 0);
    assert_sessions(&f, 2, 0, 1, 1, TURN1_PAGES);
    kvp_pool_stats pool = pool_of(&f);
    assert_int_equal(pool.held_pages, TURN1_PAGES);
    assert_int_equal(pool.evictable_pages, TURN1_PAGES); /* session 1's, given back */
    /* Session 2's is the one kept: its next turn goes first, session 1's does not. */
    b.shared[2] = 0;
    submit_session(&f, &b, 8, 2, NULL, 1, 1);
    b.shared[3] = 0;
    submit_session(&f, &b, 8, 2, NULL, 1, 2);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.admitted, 2);
    assert_sessions(&f, 2, 1, 1, 0, 0);
    run(&f, 0);
    assert_samples_exact(&b, 0, 1, TURN1_PROMPT, TURN1_NEW);
    assert_samples_exact(&b, 1, 1, TURN1_PROMPT, TURN1_NEW);
    teardown_collected(&f, 4);
}

/*
 * Running sequences' pages come before kept ones: turn 1 is kept (8 of 24
 * pages); request 1 (8 prompt tokens of its own, 30 decoded) grows to 38
 * tokens, 20 pages, more than the 16 beside the kept sequence. The kept
 * sequence is given back (a drop) in the step the running one first needs
 * a ninth block (step 25 decodes its 33rd token: 18 pages, 16 available
 * beside the kept 8), not before, and nothing is ever preempted.
 */
static void test_scheduler_session_given_back_before_preemption(void **state)
{
    (void)state;
    fixture f;
    static book b;
    start_conversation(&f, &b);
    b.shared[1] = 0;
    submit_session(&f, &b, 8, 30, NULL, 1, 0);
    size_t dropped_at = SIZE_MAX;
    for (size_t step = 1; stats_of(&f).running + stats_of(&f).waiting > 0; step++) {
        assert_true(step <= 30);
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.preempted, 0);
        assert_int_equal(st.decoded, 1);
        if (st.retained_pages == 0 && dropped_at == SIZE_MAX) {
            dropped_at = step;
            assert_int_equal(b.tokens[1][0], 25); /* 8 + 25 = 33 tokens: a ninth block */
        }
        assert_int_equal(st.retained_pages, step < 25 ? TURN1_PAGES : 0);
    }
    assert_int_equal(dropped_at, 25);
    assert_sessions(&f, 1, 0, 1, 0, 0);
    assert_int_equal(stats_of(&f).preemptions, 0);
    assert_int_equal(pool_of(&f).held_pages, 0);
    assert_samples_exact(&b, 0, 1, TURN1_PROMPT, TURN1_NEW);
    assert_samples_exact(&b, 1, 1, 8, 30);
    teardown_collected(&f, 2);
}

/*
 * A kept sequence whose parameters changed is given back at the end of the
 * next step (a drop); its blocks are of the old weights, so the session's
 * next turn adopts nothing, and its outputs are the new weights'.
 */
static void test_scheduler_session_stale_given_back(void **state)
{
    (void)state;
    fixture f;
    static book b;
    start_conversation(&f, &b);
    assert_sessions(&f, 1, 0, 0, 1, TURN1_PAGES);
    update_weights(f.model);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.retained_pages, 0);
    assert_int_equal(st.held_pages, 0);
    assert_sessions(&f, 1, 0, 1, 0, 0);
    submit_session(&f, &b, TURN2_PROMPT, TURN2_NEW, NULL, 1, 1);
    st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.prefix_hit_tokens, 0);
    run(&f, 0);
    assert_sessions(&f, 2, 0, 1, 1, TURN2_PAGES);
    assert_sample_exact_range(&b, 0, 0, TURN1_PROMPT, TURN1_NEW, 0, CAPACITY, 0);
    assert_sample_exact_range(&b, 1, 0, TURN2_PROMPT, TURN2_NEW, 0, CAPACITY, 1);
    teardown_collected(&f, 2);
}

/*
 * A kept sequence made stale by a weight update between steps is no session
 * hit: turn 2, submitted before the next step, does not go first for it,
 * adopts nothing (its keys hold the new digests), and the stale sequence
 * given back at its admission counts as a drop, not a hit.
 */
static void test_scheduler_session_stale_is_no_hit(void **state)
{
    (void)state;
    fixture f;
    static book b;
    start_conversation(&f, &b);
    update_weights(f.model);
    submit_session(&f, &b, TURN2_PROMPT, TURN2_NEW, NULL, 1, 1);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.prefix_hit_tokens, 0);
    assert_sessions(&f, 1, 0, 1, 0, 0);
    run(&f, 0);
    assert_sessions(&f, 2, 0, 1, 1, TURN2_PAGES);
    assert_sample_exact_range(&b, 1, 0, TURN2_PROMPT, TURN2_NEW, 0, CAPACITY, 1);
    teardown_collected(&f, 2);
}

/* splitmix64: the seeded draws of the random cases below. */
static uint64_t draw(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

/* A draw in [lo, hi]. */
static size_t draw_in(uint64_t *state, size_t lo, size_t hi)
{
    return lo + (size_t)(draw(state) % (hi - lo + 1));
}

#define RANDOM_CASES 24
#define CONVERSATIONS 5

/*
 * Sessions under random conversations, seeded (every run draws the same
 * cases): 5 conversations of 1 to 4 turns (16 requests at most), each
 * turn's prompt its conversation's earlier prompts and replies plus 1 to 6
 * new tokens, its reply 1 to 12, sent 0 to 3 steps after the turn before
 * it finished, over a pool of 34 to 44 pages (some cases preempt) with a
 * ttl of 1 to 24 steps, a session_fraction
 * of 0.25, 0.5 or 1, FCFS or cache-aware, 1 or 2 threads: keeps, hits,
 * expiries, pressure and evictions fall where they may. Whatever they do,
 * the pool's audit holds after every step, kept pages never pass the
 * fraction of the pool, every kept sequence is accounted for (keeps = hits
 * + drops + kept now), every request completes with outputs bit-identical
 * to a fresh sequence fed its rows alone, and destroying the scheduler
 * gives every page back. Over the cases, sessions hit and drop (the cases
 * exercise both).
 */
static void test_scheduler_sessions_random_conversations(void **state)
{
    (void)state;
    static book b;
    static const double fractions[3] = {0.25, 0.5, 1.0};
    uint64_t hits = 0;
    uint64_t drops = 0;
    for (uint64_t c = 0; c < RANDOM_CASES; c++) {
        uint64_t rng = 0x5e5510u + c;
        size_t pages = draw_in(&rng, 34, 44);
        size_t ttl = draw_in(&rng, 1, 24);
        double fraction = fractions[draw_in(&rng, 0, 2)];
        kvp_schedule schedule = draw_in(&rng, 0, 1) ? KVP_SCHEDULE_CACHE_AWARE
                                                      : KVP_SCHEDULE_FCFS;
        fixture f;
        setup_fixture_full(&f, pages, 1 + (size_t)(c % 2), 1, 0, 1, schedule, ttl, fraction);
        size_t cap = (size_t)floor(fraction * (double)pool_of(&f).total_pages);
        memset(&b, 0, sizeof b);
        size_t context[CONVERSATIONS];
        size_t due[CONVERSATIONS];
        size_t turns[CONVERSATIONS];
        uint64_t in_flight[CONVERSATIONS];
        size_t new_tokens[MAX_REQUESTS];
        for (size_t k = 0; k < CONVERSATIONS; k++) {
            context[k] = 0;
            due[k] = draw_in(&rng, 0, 6);
            turns[k] = draw_in(&rng, 1, 4);
            in_flight[k] = UINT64_MAX;
        }
        size_t submitted = 0;
        for (size_t step = 0;; step++) {
            assert_true(step < 4000);
            int pending = 0;
            for (size_t k = 0; k < CONVERSATIONS; k++) {
                uint64_t id = in_flight[k];
                if (id != UINT64_MAX && b.tokens[id][0] == new_tokens[id]) {
                    in_flight[k] = UINT64_MAX; /* finished: the next turn after a think time */
                    due[k] = step + draw_in(&rng, 0, 3);
                    turns[k]--;
                }
                size_t message = draw_in(&rng, 1, 6);
                size_t reply = draw_in(&rng, 1, 12);
                if (in_flight[k] == UINT64_MAX && turns[k] > 0 &&
                    (submitted == MAX_REQUESTS || context[k] + message + reply > CAPACITY)) {
                    turns[k] = 0; /* the conversation ends */
                }
                if (in_flight[k] == UINT64_MAX && turns[k] > 0 && step >= due[k]) {
                    b.shared[submitted] = CAPACITY; /* every row is the conversation's */
                    b.group[submitted] = k;
                    id = submit_session(&f, &b, context[k] + message, reply, NULL, 1, k + 1);
                    new_tokens[id] = reply;
                    context[k] += message + reply;
                    in_flight[k] = id;
                    submitted++;
                }
                pending |= in_flight[k] != UINT64_MAX || turns[k] > 0;
            }
            if (!pending) {
                break;
            }
            kvp_step_stats st = step_once(&f); /* audits the pool */
            assert_true(st.retained_pages <= cap);
            kvp_scheduler_stats s = stats_of(&f);
            assert_true(s.retained_pages <= cap);
            assert_int_equal(s.session_keeps, s.session_hits + s.session_drops + s.retained);
        }
        kvp_scheduler_stats s = stats_of(&f);
        assert_int_equal(s.completed, submitted);
        assert_int_equal(s.running + s.waiting, 0);
        hits += s.session_hits;
        drops += s.session_drops;
        for (size_t id = 0; id < submitted; id++) {
            assert_outputs_exact(&b, id, b.prompt[id], new_tokens[id]);
        }
        teardown_collected(&f, submitted);
    }
    assert_true(hits > 0);
    assert_true(drops > 0);
}

/*
 * Kept sequences never stall the queue: turn 1 is kept (8 of 24 pages);
 * request 1 (36 prompt tokens of its own, 2 decoded: 20 pages) does not fit
 * beside it and nothing runs, so the step that admits nothing gives every
 * kept sequence back (a drop), and the next step admits it.
 */
static void test_scheduler_session_stall_gives_back(void **state)
{
    (void)state;
    fixture f;
    static book b;
    start_conversation(&f, &b);
    b.shared[1] = 0;
    submit_session(&f, &b, 36, 2, NULL, 1, 0);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.admitted, 0);
    assert_int_equal(st.decoded, 0);
    assert_int_equal(st.waiting, 1);
    assert_int_equal(st.retained_pages, 0);
    assert_int_equal(st.held_pages, 0);
    assert_sessions(&f, 1, 0, 1, 0, 0);
    st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.held_pages, 20);
    run(&f, 0);
    assert_int_equal(stats_of(&f).preemptions, 0);
    assert_samples_exact(&b, 0, 1, TURN1_PROMPT, TURN1_NEW);
    assert_samples_exact(&b, 1, 1, 36, 2);
    teardown_collected(&f, 2);
}

/*
 * The largest ttl never expires: turn 1 kept with session_ttl SIZE_MAX
 * (its expiry step saturates) is still kept after 5 more steps and adopted
 * by the next turn (a session hit, no drop).
 */
static void test_scheduler_session_largest_ttl_never_expires(void **state)
{
    (void)state;
    fixture f;
    setup_fixture_sessions(&f, 24, SIZE_MAX, 0.5);
    static book b;
    kvp_step_stats st = run_turn1(&f, &b);
    assert_int_equal(st.retained_pages, TURN1_PAGES);
    for (size_t j = 0; j < 5; j++) {
        assert_int_equal(step_once(&f).retained_pages, TURN1_PAGES);
    }
    assert_sessions(&f, 1, 0, 0, 1, TURN1_PAGES);
    submit_session(&f, &b, TURN2_PROMPT, TURN2_NEW, NULL, 1, 1);
    st = step_once(&f);
    assert_int_equal(st.prefix_hit_tokens, 16);
    assert_sessions(&f, 1, 1, 0, 0, 0);
    run(&f, 0);
    assert_sessions(&f, 2, 1, 0, 1, TURN2_PAGES);
    assert_samples_exact(&b, 1, 1, TURN2_PROMPT, TURN2_NEW);
    teardown_collected(&f, 2);
}

/*
 * Kept sequences that share pages count them once: session 1's turn (5
 * prompt tokens, the first 4 of group 0, and 3 decoded: 2 blocks x 2
 * layers, 4 pages) is kept; session 2's request (5 tokens, the same first
 * block) adopts that block from it, and is kept too: 8 pages counted one by
 * one, 6 distinct, all the pool holds. Under session_fraction 0.25 (6 of 24
 * pages) both are kept (the old sum, 8, dropped session 1's); under 0.5 too
 * (the old sum said 8 while the pool held 6). Session 1's next turn (its 8
 * rows and 1 more, 1 decoded: 3 blocks, 6 pages) adopts its 2 blocks (a
 * session hit, 4 pages left kept: session 2's); kept in turn, it shares
 * block 0 with session 2's: 8 distinct pages, within 0.5's cap (12) beside
 * it, over 0.25's (6), which gives session 2's back (a drop). retained_pages
 * equals the pool's held pages throughout.
 */
static void test_scheduler_kept_sessions_count_shared_pages_once(void **state)
{
    (void)state;
    static const double fractions[2] = {0.25, 0.5};
    for (size_t i = 0; i < 2; i++) {
        int small = i == 0;
        fixture f;
        setup_fixture_sessions(&f, 24, 100, fractions[i]);
        static book b;
        memset(&b, 0, sizeof b);
        static const uint64_t turns[2] = {0, 2};
        book_conversation(&b, turns, 2, 0);
        b.shared[1] = 4; /* session 2: group 0's first block, then its own rows */
        b.group[1] = 0;
        submit_session(&f, &b, 5, 3, NULL, 1, 1);
        run(&f, 0);
        assert_sessions(&f, 1, 0, 0, 1, 4);
        submit_session(&f, &b, 5, 3, NULL, 1, 2);
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.prefix_hit_tokens, 4);
        run(&f, 0);
        assert_sessions(&f, 2, 0, 0, 2, 6);
        assert_int_equal(pool_of(&f).held_pages, 6);
        submit_session(&f, &b, 9, 1, NULL, 1, 1);
        st = step_once(&f);
        assert_int_equal(st.prefix_hit_tokens, 8);
        assert_int_equal(st.finished, 1);
        assert_int_equal(st.retained_pages, small ? 6 : 8);
        assert_sessions(&f, 3, 1, small, small ? 1 : 2, small ? 6 : 8);
        assert_int_equal(pool_of(&f).held_pages, small ? 6 : 8);
        assert_samples_exact(&b, 0, 1, 5, 3);
        assert_samples_exact(&b, 1, 1, 5, 3);
        assert_samples_exact(&b, 2, 1, 9, 1);
        teardown_collected(&f, 3);
    }
}

/* A one-token request of `session` (0: none) over stream_input rows; returns its id. */
static uint64_t submit_stream(fixture *f, size_t prompt, uint64_t session)
{
    kvp_request q;
    kvp_request_init(&q);
    q.prompt_tokens = prompt;
    q.max_new_tokens = 1;
    q.input = stream_input;
    q.session = session;
    uint64_t id = UINT64_MAX;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_submit(f->scheduler, &q, &id, &err), &err);
    return id;
}

/* One step, then collects what finished into done[] (at most 8); returns how many. */
static size_t step_collect(fixture *f, kvp_request_result *done)
{
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_step(f->scheduler, NULL, &err), &err);
    kvpt_assert_pool_ok(f->pool);
    return collect_all(f, done, 8);
}

/*
 * Fairness (issue 16, 5.): a steady stream of session turns cannot starve a
 * plain request. max_running 1 and one-token requests (compute off), so
 * each step admits the head of the queue alone and finishes it; after each
 * step in which a turn finished its session sends the next turn, which goes
 * ahead of the queue as its sequence is kept. The plain request, queued
 * behind the first turn, is overtaken by exactly KVP_SESSION_MAX_OVERTAKES
 * turns and admitted at step 2 + KVP_SESSION_MAX_OVERTAKES, while the
 * stream goes on around it (every later turn a session hit). Before, every
 * turn went to the very front: the plain request waited as long as the
 * stream lasted (here 100 steps, never admitted).
 */
static void test_scheduler_session_stream_cannot_starve(void **state)
{
    (void)state;
    fixture f;
    setup_fixture_full(&f, 64, 1, 0, 1, 1, KVP_SCHEDULE_FCFS, 1000, 1.0);
    (void)submit_stream(&f, 5, 1); /* nothing kept yet: at the back */
    uint64_t plain = submit_stream(&f, 6, 0);
    size_t admitted_at = 0;
    for (size_t step = 1; step <= 100; step++) {
        kvp_request_result done[8];
        size_t n = step_collect(&f, done);
        assert_int_equal(n, 1); /* the head alone, finished in its step */
        if (done[0].id == plain) {
            admitted_at = step;
        }
        kvp_request_state st;
        assert_int_equal(kvp_scheduler_request_state(f.scheduler, plain, &st, NULL),
                         admitted_at != 0 ? KVP_REQUEST_UNKNOWN : KVP_OK);
        if (done[0].id != plain) {
            (void)submit_stream(&f, 5, 1); /* the session's next turn: kept, it goes ahead */
        }
    }
    assert_int_equal(admitted_at, 2 + KVP_SESSION_MAX_OVERTAKES);
    kvp_scheduler_stats s = stats_of(&f);
    assert_int_equal(s.session_hits, 98); /* turns 1 to 98: all but the first admitted */
    assert_int_equal(s.completed, 100);
    run(&f, 1); /* the turn still waiting */
    assert_int_equal(collect_all(&f, NULL, 0), 0);
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 1);
    teardown_fixture(&f);
}

/* argv[1], when given, runs only the tests it names (a cmocka pattern; CMakeLists.txt). */
int main(int argc, char **argv)
{
    if (argc > 1) {
        cmocka_set_test_filter(argv[1]);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scheduler_session_keeps_turn_across_pressure),
        cmocka_unit_test(test_scheduler_session_request_goes_first),
        cmocka_unit_test(test_scheduler_session_expires_after_ttl),
        cmocka_unit_test(test_scheduler_session_largest_ttl_never_expires),
        cmocka_unit_test(test_scheduler_session_replaced_by_same_session),
        cmocka_unit_test(test_scheduler_session_fraction_caps_kept_pages),
        cmocka_unit_test(test_scheduler_session_given_back_before_preemption),
        cmocka_unit_test(test_scheduler_session_stale_given_back),
        cmocka_unit_test(test_scheduler_session_stale_is_no_hit),
        cmocka_unit_test(test_scheduler_sessions_random_conversations),
        cmocka_unit_test(test_scheduler_session_stall_gives_back),
        cmocka_unit_test(test_scheduler_session_stream_cannot_starve),
        cmocka_unit_test(test_scheduler_kept_sessions_count_shared_pages_once),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
