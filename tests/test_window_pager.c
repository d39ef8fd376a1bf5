/*
 * test_window_pager.c: the pager frees what no window needs (issue 21, part
 * 2: front truncation; docs/DESIGN.md, "Sliding windows and sinks").
 *
 * Checks, with kvp_pool_check after every operation (and that it reports
 * a cache whose released run disagrees with its null entries):
 *   - a block is released exactly when it lies past the sink blocks and
 *     entirely below len - W, for W and the length on either side of block
 *     edges, W = 1, sinks inside, at and past a block edge, block sizes 1..4;
 *     kvp_cache_page reads KVP_PAGE_RELEASED there, the live page otherwise;
 *   - the pages held after every step are exactly the live blocks and never
 *     above B * (ceil(S / bt) + ceil(W / bt) + 1), on a pool of exactly
 *     kvp_cache_pages_held_max pages: positions go far past W times the
 *     pages held, and the outputs equal the windowed reference bit for bit;
 *   - a model copies its layers' windows: a two-layer windowed model's
 *     prefill and steps equal the layer-by-layer windowed reference, and its
 *     caches release (at the prefill's end, then at each step);
 *   - fork shares only the live blocks; truncate is refused with
 *     BLOCK_RELEASED when a block the window at the new length needs is gone
 *     (nothing changes) and allowed when not; publishing a released block
 *     is refused (a group publish skips it); reset gives every page back and a
 *     replay runs again;
 *   - a published page the window releases goes to the LRU list and is
 *     adopted by another cache;
 *   - on a pool one page short of kvp_cache_pages_held_max, the step that
 *     needs the peak fails with POOL_EXHAUSTED and changes nothing; so does
 *     a two-layer sequence step that would both release (the sliding
 *     layer's commit) and take (both layers), refused for lack of pages
 *     (snapshot of the sequence, its caches and the pool);
 *   - under memcheck (memcheck.test_window_pager) a page the window
 *     released to the free list is NOACCESS, as every free page is
 *     (src/pager/track.h): any later read through its id is an invalid read;
 *     a published one, on the LRU list, stays addressable with its rows for
 *     an adopter; steps far past the window read no released page.
 * Deterministic: no threads, fixed inputs.
 */
#include "support.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <valgrind/memcheck.h>

#include "attention/layer_internal.h"
#include "pager/cache_internal.h"
#include "pager/pool_internal.h"

enum { WIDTH = 8, HEADS = 2, BATCH = 2, POSITIONS = 128 };

static kvp_layer *windowed_layer(size_t window, size_t sinks, uint64_t seed)
{
    kvp_layer *layer = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create_random_grouped(WIDTH, HEADS, 1, POSITIONS, 10000.0, seed,
                                                   &layer, &err),
                   &err);
    kvpt_assert_ok(kvp_layer_set_window(layer, window, sinks, &err), &err);
    return layer;
}

static size_t ceil_div(size_t a, size_t b)
{
    return a / b + (a % b != 0);
}

/* The rule written out: block b of a cache of length len is released. */
static int expect_released(size_t window, size_t sinks, size_t bt, size_t len, size_t b)
{
    return b >= ceil_div(sinks, bt) && len >= window && (b + 1) * bt <= len - window;
}

/* Checks every lane's table against the rule; returns the pages the cache holds. */
static size_t check_tables(const kvp_cache *cache, size_t window, size_t sinks, size_t bt)
{
    kvp_error err;
    size_t len = kvp_cache_len(cache);
    size_t held = 0;
    for (size_t lane = 0; lane < BATCH; lane++) {
        for (size_t b = 0; b < ceil_div(len, bt); b++) {
            uint32_t page = 0;
            kvpt_assert_ok(kvp_cache_page(cache, lane, b, &page, &err), &err);
            if (expect_released(window, sinks, bt, len, b)) {
                assert_int_equal(page, KVP_PAGE_RELEASED);
            } else {
                assert_true(page != KVP_PAGE_RELEASED);
                held++;
            }
        }
    }
    return held;
}

static void row_of(const double *input, size_t tokens, size_t t, double *row)
{
    for (size_t b = 0; b < BATCH; b++) {
        memcpy(row + b * WIDTH, input + (b * tokens + t) * WIDTH, sizeof(double) * WIDTH);
    }
}

/* One decode step of `layer` on `cache`; writes the [B, D] output to out (may be NULL). */
static void step(kvp_layer *layer, kvp_cache *cache, kvp_ticket *ticket, const double *input,
                 size_t tokens, size_t t, double *out)
{
    double row[BATCH * WIDTH];
    row_of(input, tokens, t, row);
    kvp_tensor x = kvp_tensor3(row, BATCH, 1, WIDTH);
    kvp_error err;
    kvpt_assert_ok(kvp_attention_forward(layer, &x, cache, ticket, &err), &err);
    if (out != NULL) {
        kvp_attention_result r;
        kvpt_assert_ok(kvp_ticket_result(ticket, &r, &err), &err);
        for (size_t b = 0; b < BATCH; b++) {
            memcpy(out + (b * tokens + t) * WIDTH, r.output + b * WIDTH, sizeof(double) * WIDTH);
        }
    }
}

static void assert_same_bits(const double *a, const double *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!kvpt_same_bits(a[i], b[i])) {
            print_error("element %zu: %.17g != %.17g\n", i, a[i], b[i]);
            fail();
        }
    }
}

/* ---- release at every block edge ------------------------------------------------ */

static size_t run_case(size_t bt, size_t window, size_t sinks, const double *input, size_t T)
{
    kvp_error err;
    kvp_layer *layer = windowed_layer(window, sinks, 21);
    size_t n = BATCH * T * WIDTH;
    double *ref = kvpt_doubles(n);
    double *out = kvpt_doubles(n);
    kvp_tensor x = kvp_tensor3((double *)input, BATCH, T, WIDTH);
    kvpt_assert_ok(kvp_attention_reference(layer, &x, ref, n, NULL, NULL, 0, &err), &err);
    /* The pool holds exactly the most pages the cache may hold: none to spare. */
    size_t most = kvpi_window_pages_held_max(window, sinks, bt, T);
    kvp_pool *pool = kvpt_pool(bt, 1, WIDTH / HEADS, BATCH * most);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *cache = kvpt_cache(pool, &binding, BATCH, T);
    assert_int_equal(kvp_cache_pages_held_max(cache, T), BATCH * most);
    assert_true(most <= ceil_div(sinks, bt) + ceil_div(window + 1, bt) + 1);
    kvp_ticket *ticket = kvpt_ticket(cache);
    size_t bound = BATCH * (ceil_div(sinks, bt) + ceil_div(window, bt) + 1);
    size_t released_seen = 0;
    for (size_t t = 0; t < T; t++) {
        step(layer, cache, ticket, input, T, t, out);
        kvpt_assert_pool_ok(pool);
        size_t held = check_tables(cache, window, sinks, bt);
        assert_true(held <= bound);
        assert_int_equal(kvpt_stats(pool).held_pages, held);
        released_seen = BATCH * ceil_div(t + 1, bt) - held;
    }
    assert_same_bits(out, ref, n);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).free_pages, BATCH * most);
    kvpt_destroy_pool(pool);
    kvpt_destroy_layer(layer);
    free(ref);
    free(out);
    return released_seen;
}

static void test_window_pager_releases_exactly_outside_the_window(void **state)
{
    (void)state;
    enum { T = 41 };
    size_t n = BATCH * T * WIDTH;
    double *input = kvpt_doubles(n);
    kvpt_fill_random(input, n, 0x51D);
    size_t cases = 0;
    for (size_t bt = 1; bt <= 4; bt++) {
        const size_t ws[] = {1, bt - 1, bt, bt + 1, 2 * bt - 1, 2 * bt, 2 * bt + 1, 7};
        for (size_t wi = 0; wi < KVPT_COUNT_OF(ws); wi++) {
            if (ws[wi] == 0) {
                continue;
            }
            const size_t ss[] = {0, 1, bt - 1, bt, bt + 1, 2 * bt + 1};
            for (size_t si = 0; si < KVPT_COUNT_OF(ss); si++) {
                if (si > 0 && ss[si] == ss[si - 1]) {
                    continue;
                }
                size_t released = run_case(bt, ws[wi], ss[si], input, T);
                /* 41 positions: the window and sinks cover far fewer blocks. */
                assert_true(released > 0);
                cases++;
            }
        }
    }
    printf("# %zu (bt, W, S) cases: releases at the rule, outputs bit for bit\n", cases);
    free(input);
}

/* ---- a model's windowed layers ------------------------------------------------------- */

static void test_window_pager_model_copies_the_window(void **state)
{
    (void)state;
    enum { T = 23, PRE = 9, MID = 16, L = 2, W = 3, S = 1, BT = 2 };
    kvp_error err;
    const kvp_layer *layers[L];
    kvp_layer *made[L];
    for (size_t l = 0; l < L; l++) {
        made[l] = windowed_layer(W, S, 40 + l);
        layers[l] = made[l];
    }
    kvp_model *model = NULL;
    kvpt_assert_ok(kvp_model_create(layers, L, &model, &err), &err);
    for (size_t l = 0; l < L; l++) {
        kvp_layer_info info;
        kvp_layer_info_init(&info);
        kvpt_assert_ok(kvp_layer_info_get(kvp_model_layer(model, l), &info, &err), &err);
        assert_int_equal(info.window, W);
        assert_int_equal(info.sink_tokens, S);
        kvpt_destroy_layer(made[l]);
    }
    size_t n = BATCH * T * WIDTH;
    double *input = kvpt_doubles(n);
    double *ref = kvpt_doubles(n);
    double *y = kvpt_doubles(n);
    double *out = kvpt_doubles(n);
    kvpt_fill_random(input, n, 0xA11);
    /* x_{l+1} = x_l + ref_l(x_l): the sequence's residual stream. */
    memcpy(ref, input, n * sizeof *ref);
    for (size_t l = 0; l < L; l++) {
        kvp_tensor view = kvp_tensor3(ref, BATCH, T, WIDTH);
        kvpt_assert_ok(
            kvp_attention_reference(kvp_model_layer(model, l), &view, y, n, NULL, NULL, 0, &err),
            &err);
        for (size_t i = 0; i < n; i++) {
            ref[i] += y[i];
        }
    }
    kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, 64);
    kvp_sequence *seq = kvpt_sequence(model, pool, BATCH, T);
    /* The prefill releases at its end: only the live blocks stay. */
    double *prompt = kvpt_doubles(BATCH * PRE * WIDTH);
    double *pout = kvpt_doubles(BATCH * PRE * WIDTH);
    for (size_t b = 0; b < BATCH; b++) {
        memcpy(prompt + b * PRE * WIDTH, input + b * T * WIDTH, PRE * WIDTH * sizeof *prompt);
    }
    kvp_tensor p = kvp_tensor3(prompt, BATCH, PRE, WIDTH);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &p, NULL, NULL, pout, BATCH * PRE * WIDTH, &err),
                   &err);
    kvpt_assert_pool_ok(pool);
    for (size_t b = 0; b < BATCH; b++) {
        memcpy(out + b * T * WIDTH, pout + b * PRE * WIDTH, PRE * WIDTH * sizeof *out);
    }
    size_t bound = L * BATCH * (ceil_div(S, BT) + ceil_div(W, BT) + 1);
    assert_true(kvpt_stats(pool).held_pages <= bound);
    assert_true(kvpt_stats(pool).held_pages < L * BATCH * ceil_div(PRE, BT));
    double row[BATCH * WIDTH];
    double o[BATCH * WIDTH];
    for (size_t t = PRE; t < MID; t++) {
        row_of(input, T, t, row);
        kvp_tensor x = kvp_tensor3(row, BATCH, 1, WIDTH);
        kvpt_assert_ok(kvp_sequence_step(seq, &x, NULL, NULL, o, BATCH * WIDTH, &err), &err);
        kvpt_assert_pool_ok(pool);
        assert_true(kvpt_stats(pool).held_pages <= bound);
        for (size_t b = 0; b < BATCH; b++) {
            memcpy(out + (b * T + t) * WIDTH, o + b * WIDTH, WIDTH * sizeof *out);
        }
    }
    /* A second prefill on caches that released blocks reads only live ones. */
    enum { REST = T - MID };
    double rest[BATCH * REST * WIDTH];
    double rout[BATCH * REST * WIDTH];
    for (size_t b = 0; b < BATCH; b++) {
        memcpy(rest + b * REST * WIDTH, input + (b * T + MID) * WIDTH, REST * WIDTH * sizeof *rest);
    }
    kvp_tensor r = kvp_tensor3(rest, BATCH, REST, WIDTH);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &r, NULL, NULL, rout, BATCH * REST * WIDTH, &err),
                   &err);
    kvpt_assert_pool_ok(pool);
    assert_true(kvpt_stats(pool).held_pages <= bound);
    for (size_t l = 0; l < L; l++) {
        kvp_cache_info ci;
        kvp_cache_info_init(&ci);
        kvpt_assert_ok(kvp_cache_info_get(kvp_sequence_cache(seq, l), &ci, &err), &err);
        assert_int_equal(ci.mapped_pages, check_tables(kvp_sequence_cache(seq, l), W, S, BT));
    }
    for (size_t b = 0; b < BATCH; b++) {
        memcpy(out + (b * T + MID) * WIDTH, rout + b * REST * WIDTH, REST * WIDTH * sizeof *out);
    }
    assert_true(kvpt_max_abs_diff(out, ref, n) <= 1e-12);
    assert_same_bits(out, ref, n);
    kvpt_destroy_sequence(seq, pool);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
    free(input);
    free(ref);
    free(y);
    free(out);
    free(prompt);
    free(pout);
}

/* ---- fork, truncate, publish, reset ----------------------------------------------------- */

typedef struct fixture {
    kvp_layer *layer;
    kvp_pool *pool;
    kvp_cache *cache;
    kvp_ticket *ticket;
    double *input;
    size_t tokens;
} fixture;

enum { F_TOKENS = 32, F_BT = 2, F_W = 4 };

static void fixture_open(fixture *f, size_t window, size_t sinks, size_t pages)
{
    kvp_error err;
    f->tokens = F_TOKENS;
    f->layer = windowed_layer(window, sinks, 7);
    f->pool = kvpt_pool(F_BT, 1, WIDTH / HEADS, pages);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(f->layer, &binding, &err), &err);
    f->cache = kvpt_cache(f->pool, &binding, BATCH, F_TOKENS);
    f->ticket = kvpt_ticket(f->cache);
    f->input = kvpt_doubles(BATCH * F_TOKENS * WIDTH);
    kvpt_fill_random(f->input, BATCH * F_TOKENS * WIDTH, 0xF1);
}

static void fixture_decode(fixture *f, size_t from, size_t to)
{
    for (size_t t = from; t < to; t++) {
        step(f->layer, f->cache, f->ticket, f->input, f->tokens, t, NULL);
        kvpt_assert_pool_ok(f->pool);
    }
}

static void fixture_close(fixture *f)
{
    kvpt_destroy_ticket(f->ticket, f->pool);
    kvpt_destroy_cache(f->cache, f->pool);
    kvpt_assert_pool_ok(f->pool);
    /* kvpt_destroy_pool, where published pages may wait on the evictable list. */
    kvp_pool_stats s = kvpt_stats(f->pool);
    assert_int_equal(s.held_pages, 0);
    assert_int_equal(s.free_pages + s.evictable_pages, s.total_pages);
    assert_int_equal(s.evictable_pages, s.cached_pages);
    assert_int_equal(s.attached_caches, 0);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_destroy(f->pool, &err), &err);
    kvpt_destroy_layer(f->layer);
    free(f->input);
}

static void test_window_pager_fork_shares_only_live_blocks(void **state)
{
    (void)state;
    fixture f;
    fixture_open(&f, F_W, 0, 64);
    fixture_decode(&f, 0, 15); /* len 15: blocks 0..4 released (below 11), 5..7 live */
    kvp_pool_stats before = kvpt_stats(f.pool);
    assert_int_equal(before.held_pages, BATCH * 3);
    kvp_cache *child = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_fork(f.cache, &child, &err), &err);
    kvpt_assert_pool_ok(f.pool);
    assert_int_equal(kvpt_stats(f.pool).held_pages, before.held_pages); /* shared, not copied */
    assert_int_equal(check_tables(child, F_W, 0, F_BT), BATCH * 3);
    for (size_t lane = 0; lane < BATCH; lane++) {
        for (size_t b = 0; b < 8; b++) {
            uint32_t a = 0, c = 0;
            kvpt_assert_ok(kvp_cache_page(f.cache, lane, b, &a, &err), &err);
            kvpt_assert_ok(kvp_cache_page(child, lane, b, &c, &err), &err);
            assert_int_equal(a, c);
        }
    }
    /* Both go on: the child copies the shared partial page, both release by the rule. */
    kvp_ticket *ct = kvpt_ticket(child);
    for (size_t t = 15; t < 24; t++) {
        step(f.layer, child, ct, f.input, f.tokens, t, NULL);
        kvpt_assert_pool_ok(f.pool);
        check_tables(child, F_W, 0, F_BT);
    }
    fixture_decode(&f, 15, 20);
    check_tables(f.cache, F_W, 0, F_BT);
    kvpt_destroy_ticket(ct, f.pool);
    kvpt_destroy_cache(child, f.pool);
    kvpt_assert_pool_ok(f.pool);
    fixture_close(&f);
}

static void test_window_pager_truncate_refused_when_blocks_are_gone(void **state)
{
    (void)state;
    fixture f;
    fixture_open(&f, F_W, 0, 64);
    fixture_decode(&f, 0, 21); /* released: blocks below (21 - 4) / 2 = 8 */
    kvp_error err;
    kvpt_state before;
    kvpt_state_capture(f.cache, f.pool, &before);
    /* Length 19 needs [15, 19): block 7 is gone. */
    assert_int_equal(kvp_cache_truncate(f.cache, 19, &err), KVP_BLOCK_RELEASED);
    assert_int_equal(err.index, 7);
    assert_int_equal(err.position, 15);
    kvpt_assert_state_unchanged(&before, f.cache, f.pool, 0);
    assert_int_equal(kvp_cache_truncate(f.cache, 17, &err), KVP_BLOCK_RELEASED);
    kvpt_assert_state_unchanged(&before, f.cache, f.pool, 0);
    kvpt_assert_pool_ok(f.pool);
    kvpt_state_free(&before);
    /* Length 20 needs [16, 20): blocks 8 and 9, live. */
    kvpt_assert_ok(kvp_cache_truncate(f.cache, 20, &err), &err);
    kvpt_assert_pool_ok(f.pool);
    assert_int_equal(kvp_cache_len(f.cache), 20);
    check_tables(f.cache, F_W, 0, F_BT);
    fixture_decode(&f, 20, 26);
    check_tables(f.cache, F_W, 0, F_BT);
    /* Length 0 needs nothing: allowed, every page back. */
    kvpt_assert_ok(kvp_cache_truncate(f.cache, 0, &err), &err);
    kvpt_assert_pool_ok(f.pool);
    assert_int_equal(kvpt_stats(f.pool).held_pages, 0);
    fixture_close(&f);
}

static void test_window_pager_truncate_with_sinks(void **state)
{
    (void)state;
    fixture f;
    fixture_open(&f, F_W, 3, 64); /* sink blocks 0, 1 kept */
    fixture_decode(&f, 0, 21);
    kvp_error err;
    /* Length 3 needs only the sinks' blocks [0, 3) and [0, 3): kept, allowed. */
    kvpt_assert_ok(kvp_cache_truncate(f.cache, 3, &err), &err);
    kvpt_assert_pool_ok(f.pool);
    assert_int_equal(kvpt_stats(f.pool).held_pages, BATCH * 2);
    fixture_decode(&f, 3, 12);
    check_tables(f.cache, F_W, 3, F_BT);
    /* Length 9 needs [5, 9): block 2 is gone (released below (12 - 4) / 2 = 4). */
    kvpt_state before;
    kvpt_state_capture(f.cache, f.pool, &before);
    assert_int_equal(kvp_cache_truncate(f.cache, 9, &err), KVP_BLOCK_RELEASED);
    kvpt_assert_state_unchanged(&before, f.cache, f.pool, 0);
    kvpt_state_free(&before);
    fixture_close(&f);
}

static void test_window_pager_publish_of_released_block_refused(void **state)
{
    (void)state;
    fixture f;
    fixture_open(&f, F_W, 0, 64);
    fixture_decode(&f, 0, 12); /* blocks 0..3 released */
    kvp_error err;
    kvp_block_key key;
    uint64_t data = 42;
    kvpt_assert_ok(kvp_block_key_chain(NULL, f.cache, &data, sizeof data, NULL, &key, &err), &err);
    kvpt_state before;
    kvpt_state_capture(f.cache, f.pool, &before);
    assert_int_equal(kvp_cache_publish_block(f.cache, 0, 1, &key, &err), KVP_BLOCK_RELEASED);
    assert_int_equal(err.index, 1);
    kvpt_assert_state_unchanged(&before, f.cache, f.pool, 0);
    assert_int_equal(kvpt_stats(f.pool).cached_pages, 0);
    /*
     * The group call publishes what the window keeps and skips the released
     * blocks (the contract since prefix hits with windows): blocks 0..5, 0..3
     * released, so blocks 4 and 5 of each lane are registered.
     */
    kvp_block_key keys[6 * BATCH];
    for (size_t i = 0; i < 6 * BATCH; i++) {
        uint64_t d = 1000 + i;
        kvpt_assert_ok(kvp_block_key_chain(NULL, f.cache, &d, sizeof d, NULL, &keys[i], &err),
                       &err);
    }
    kvpt_state_free(&before);
    kvp_cache *group[1] = {f.cache};
    kvpt_assert_ok(kvp_cache_group_publish(group, 1, keys, 6, &err), &err);
    kvpt_assert_pool_ok(f.pool);
    assert_int_equal(kvpt_stats(f.pool).cached_pages, 2 * BATCH);
    for (size_t b = 0; b < 6; b++) {
        uint32_t page = 0;
        kvpt_assert_ok(kvp_cache_page(f.cache, 0, b, &page, &err), &err);
        assert_int_equal(page == KVP_PAGE_RELEASED, b < 4);
    }
    /* A live full block publishes (under a new key: its page keeps the one it has). */
    kvpt_assert_ok(kvp_cache_publish_block(f.cache, 0, 4, &keys[4 * BATCH], &err), &err);
    kvpt_assert_pool_ok(f.pool);
    fixture_close(&f);
}

/*
 * Reset gives every page back, released blocks' nulls included, and a replay
 * runs again on the same pool sized to kvp_cache_pages_held_max: the same
 * acquisitions, the same pages held at every step (which pages: the free
 * list's order after releases, not the first run's).
 */
static void test_window_pager_reset_reuses_pages(void **state)
{
    (void)state;
    fixture f;
    size_t most = kvpi_window_pages_held_max(F_W, 1, F_BT, F_TOKENS);
    fixture_open(&f, F_W, 1, BATCH * most);
    kvp_error err;
    uint64_t per_round = 0;
    for (int round = 0; round < 3; round++) {
        uint64_t acquires = kvpt_stats(f.pool).acquires;
        for (size_t t = 0; t < F_TOKENS; t++) {
            fixture_decode(&f, t, t + 1);
            assert_int_equal(check_tables(f.cache, F_W, 1, F_BT), kvpt_stats(f.pool).held_pages);
        }
        uint64_t taken = kvpt_stats(f.pool).acquires - acquires;
        assert_int_equal(taken, BATCH * (F_TOKENS / F_BT));
        if (round > 0) {
            assert_int_equal(taken, per_round);
        }
        per_round = taken;
        kvpt_assert_ok(kvp_cache_reset(f.cache, &err), &err);
        kvpt_assert_pool_ok(f.pool);
        kvp_pool_stats s = kvpt_stats(f.pool);
        assert_int_equal(s.held_pages, 0);
        assert_int_equal(s.free_pages, BATCH * most);
        assert_int_equal(kvp_cache_len(f.cache), 0);
        for (size_t lane = 0; lane < BATCH; lane++) {
            uint32_t page = 0;
            assert_int_equal(kvp_cache_page(f.cache, lane, 0, &page, &err), KVP_OUT_OF_RANGE);
        }
    }
    fixture_close(&f);
}

static void test_window_pager_released_published_page_is_adopted(void **state)
{
    (void)state;
    fixture f;
    fixture_open(&f, 2, 0, 64);
    fixture_decode(&f, 0, 2); /* block 0 full */
    kvp_error err;
    kvp_block_key keys[BATCH];
    for (size_t lane = 0; lane < BATCH; lane++) {
        uint64_t data = 100 + lane;
        kvpt_assert_ok(kvp_block_key_chain(NULL, f.cache, &data, sizeof data, NULL, &keys[lane],
                                           &err),
                       &err);
        kvpt_assert_ok(kvp_cache_publish_block(f.cache, lane, 0, &keys[lane], &err), &err);
    }
    kvpt_assert_pool_ok(f.pool);
    assert_int_equal(kvpt_stats(f.pool).evictable_pages, 0);
    fixture_decode(&f, 2, 4); /* length 4: block 0 lies below 4 - 2: released, to the LRU */
    check_tables(f.cache, 2, 0, F_BT);
    kvp_pool_stats s = kvpt_stats(f.pool);
    assert_int_equal(s.evictable_pages, BATCH);
    assert_int_equal(s.cached_pages, BATCH);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(f.layer, &binding, &err), &err);
    kvp_cache *other = kvpt_cache(f.pool, &binding, BATCH, F_TOKENS);
    size_t adopted = 0;
    kvpt_assert_ok(kvp_cache_adopt_prefix(other, keys, 1, &adopted, &err), &err);
    assert_int_equal(adopted, 1);
    assert_int_equal(kvp_cache_len(other), F_BT);
    kvpt_assert_pool_ok(f.pool);
    assert_int_equal(kvpt_stats(f.pool).evictable_pages, 0);
    kvpt_destroy_cache(other, f.pool);
    kvpt_assert_pool_ok(f.pool);
    assert_int_equal(kvpt_stats(f.pool).evictable_pages, BATCH);
    fixture_close(&f);
}

/*
 * A pool one page short of kvp_cache_pages_held_max: the step that needs the
 * peak fails with POOL_EXHAUSTED before it takes or releases anything, and
 * changes nothing; the pager's count is the exact peak.
 */
static void test_window_pager_exhaustion_changes_nothing(void **state)
{
    (void)state;
    enum { T = 20, W = 3, S = 1, BT = 2 };
    kvp_error err;
    kvp_layer *layer = windowed_layer(W, S, 5);
    size_t most = kvpi_window_pages_held_max(W, S, BT, T);
    kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, BATCH * most - 1);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *cache = kvpt_cache(pool, &binding, BATCH, T);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double *input = kvpt_doubles(BATCH * T * WIDTH);
    kvpt_fill_random(input, BATCH * T * WIDTH, 0xE7);
    size_t failed_at = SIZE_MAX;
    for (size_t t = 0; t < T && failed_at == SIZE_MAX; t++) {
        kvpt_state before;
        kvpt_state_capture(cache, pool, &before);
        double row[BATCH * WIDTH];
        row_of(input, T, t, row);
        kvp_tensor x = kvp_tensor3(row, BATCH, 1, WIDTH);
        kvp_status status = kvp_attention_forward(layer, &x, cache, ticket, &err);
        if (status == KVP_POOL_EXHAUSTED) {
            kvpt_assert_state_unchanged(&before, cache, pool, 1);
            failed_at = t;
        } else {
            kvpt_assert_ok(status, &err);
            kvpt_assert_pool_ok(pool);
            check_tables(cache, W, S, BT);
        }
        kvpt_state_free(&before);
    }
    /* The first step whose commit needs the peak: len -> n with the held blocks of n - 1 - W. */
    assert_true(failed_at != SIZE_MAX);
    assert_int_equal(kvpi_window_pages_held_max(W, S, BT, failed_at), most - 1);
    assert_int_equal(kvpi_window_pages_held_max(W, S, BT, failed_at + 1), most);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_layer(layer);
    free(input);
}


/*
 * Under memcheck: a page front truncation sends to the free list is
 * NOACCESS (VALGRIND_GET_VBITS answers 3: unaddressable), exactly as
 * test_pool checks a free page, so no later read of it can go unreported;
 * a published page the window releases waits on the LRU list, addressable,
 * its rows intact, for an adopter. Natively the client request answers 0.
 */
static void test_window_pager_released_page_is_noaccess(void **state)
{
    (void)state;
    fixture f;
    fixture_open(&f, 2, 0, 64);
    fixture_decode(&f, 0, 2); /* block 0 full in both lanes */
    kvp_error err;
    uint32_t page[BATCH];
    for (size_t lane = 0; lane < BATCH; lane++) {
        kvpt_assert_ok(kvp_cache_page(f.cache, lane, 0, &page[lane], &err), &err);
        assert_true(page[lane] != KVP_PAGE_RELEASED);
    }
    /* Lane 1's block 0 published: its page goes to the LRU list, lane 0's to the free list. */
    kvp_block_key key;
    uint64_t data = 77;
    kvpt_assert_ok(kvp_block_key_chain(NULL, f.cache, &data, sizeof data, NULL, &key, &err), &err);
    kvpt_assert_ok(kvp_cache_publish_block(f.cache, 1, 0, &key, &err), &err);
    const double *freed = kvpi_pool_page(f.pool, page[0]);
    const double *cached = kvpi_pool_page(f.pool, page[1]);
    size_t page_doubles = 2 * F_BT * (WIDTH / HEADS);
    double kept[2 * F_BT * (WIDTH / HEADS)];
    memcpy(kept, cached, sizeof kept);
    char vbits[2 * F_BT * (WIDTH / HEADS) * sizeof(double)];
    assert_int_equal(sizeof vbits, page_doubles * sizeof(double));
    if (RUNNING_ON_VALGRIND) {
        assert_int_equal(VALGRIND_GET_VBITS(freed, vbits, sizeof vbits), 1);
        assert_int_equal(VALGRIND_GET_VBITS(cached, vbits, sizeof vbits), 1);
    }
    uint64_t releases = kvpt_stats(f.pool).window_releases;
    fixture_decode(&f, 2, 4); /* length 4: block 0 lies below 4 - 2: released */
    check_tables(f.cache, 2, 0, F_BT);
    kvp_pool_stats s = kvpt_stats(f.pool);
    assert_int_equal(s.window_releases, releases + BATCH);
    assert_int_equal(s.evictable_pages, 1);
    for (size_t lane = 0; lane < BATCH; lane++) {
        uint32_t now = 0;
        kvpt_assert_ok(kvp_cache_page(f.cache, lane, 0, &now, &err), &err);
        assert_int_equal(now, KVP_PAGE_RELEASED);
    }
    if (RUNNING_ON_VALGRIND) {
        assert_int_equal(VALGRIND_GET_VBITS(freed, vbits, sizeof vbits), 3);
        assert_int_equal(VALGRIND_GET_VBITS(cached, vbits, sizeof vbits), 1);
    } else {
        assert_int_equal(VALGRIND_GET_VBITS(freed, vbits, sizeof vbits), 0);
    }
    assert_memory_equal(cached, kept, sizeof kept); /* readable: an adopter gets these rows */
    /*
     * Far past the window: every step's reads (under memcheck an invalid read
     * of a released page fails the run) and the page back on the free list
     * stays NOACCESS until a take hands it out again.
     */
    fixture_decode(&f, 4, F_TOKENS);
    check_tables(f.cache, 2, 0, F_BT);
    fixture_close(&f);
}


/*
 * One sequence step that both releases (the sliding layer's commit lets a
 * block go) and takes (both layers start a block), refused for lack of
 * pages: W = 3 and a full layer, bt = 2, 2 lanes, 12 pages. The steps to
 * lengths 1, 3 and 5 take 4 pages each (5 also releases block 0 of the
 * sliding layer: 10 held); the step to 7 needs 4 with 2 free. On a large
 * pool that very step takes 4 pages and releases 2 (block 1), so the
 * refused step is a release-and-take one: POOL_EXHAUSTED, the sequence, its
 * caches and the pool unchanged (exhaustions + 1), nothing released, the
 * audit clean; the outputs buffer is not asserted (the contract's).
 */
static void test_window_pager_exhausted_release_and_take_changes_nothing(void **state)
{
    (void)state;
    enum { L = 2, BT = 2, W = 3, T = 8, SMALL = 12 };
    kvp_error err;
    kvp_layer *made[L] = {windowed_layer(W, 0, 60), windowed_layer(0, 0, 61)};
    const kvp_layer *layers[L] = {made[0], made[1]};
    kvp_model *model = NULL;
    kvpt_assert_ok(kvp_model_create(layers, L, &model, &err), &err);
    double *input = kvpt_doubles(BATCH * T * WIDTH);
    kvpt_fill_random(input, BATCH * T * WIDTH, 0xA7);
    double y[BATCH * WIDTH];
    /* The large pool: what each step takes and releases. */
    kvp_pool *big = kvpt_pool(BT, 1, WIDTH / HEADS, 64);
    kvp_sequence *free_run = kvpt_sequence(model, big, BATCH, T);
    size_t took[T], released[T];
    for (size_t t = 0; t < T; t++) {
        kvp_pool_stats before = kvpt_stats(big);
        double row[BATCH * WIDTH];
        row_of(input, T, t, row);
        kvp_tensor x = kvp_tensor3(row, BATCH, 1, WIDTH);
        kvpt_assert_ok(kvp_sequence_step(free_run, &x, NULL, NULL, y, BATCH * WIDTH, &err), &err);
        kvpt_assert_pool_ok(big);
        kvp_pool_stats after = kvpt_stats(big);
        took[t] = (size_t)(after.acquires - before.acquires);
        released[t] = (size_t)(after.window_releases - before.window_releases);
    }
    assert_int_equal(took[6], L * BATCH);
    assert_int_equal(released[6], BATCH);
    kvpt_destroy_sequence(free_run, big);
    kvpt_destroy_pool(big);
    /* The small pool: the same steps until one is refused. */
    kvp_pool *pool = kvpt_pool(BT, 1, WIDTH / HEADS, SMALL);
    kvp_sequence *seq = kvpt_sequence(model, pool, BATCH, T);
    size_t refused = SIZE_MAX;
    for (size_t t = 0; t < T && refused == SIZE_MAX; t++) {
        kvpt_snapshot before;
        kvpt_snapshot_init(&before, pool);
        kvpt_snapshot_add_sequence(&before, seq);
        kvpt_snapshot_add_cache(&before, kvp_sequence_cache(seq, 0));
        kvpt_snapshot_add_cache(&before, kvp_sequence_cache(seq, 1));
        kvpt_snapshot_take(&before);
        double row[BATCH * WIDTH];
        row_of(input, T, t, row);
        kvp_tensor x = kvp_tensor3(row, BATCH, 1, WIDTH);
        kvp_status status = kvp_sequence_step(seq, &x, NULL, NULL, y, BATCH * WIDTH, &err);
        if (status == KVP_POOL_EXHAUSTED) {
            refused = t;
            assert_int_equal(err.needed, L * BATCH);
            kvpt_assert_unchanged(&before, 1);
        } else {
            kvpt_assert_ok(status, &err);
        }
        kvpt_assert_pool_ok(pool);
        check_tables(kvp_sequence_cache(seq, 0), W, 0, BT);
    }
    assert_int_equal(refused, 6);
    assert_true(took[refused] > 0 && released[refused] > 0);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.window_releases, BATCH); /* block 0 at length 5, nothing since */
    assert_int_equal(s.held_pages, SMALL - 2);
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
    kvpt_destroy_layer(made[0]);
    kvpt_destroy_layer(made[1]);
    free(input);
}

/* Findings of kvp_pool_check naming `what` (any when NULL). */
static size_t findings_of(kvp_pool *pool, const char *what, kvp_invariant invariant)
{
    kvpt_findings f;
    memset(&f, 0, sizeof f);
    kvp_error err;
    kvp_status status = kvp_pool_check(pool, kvpt_collect_finding, &f, &err);
    assert_int_equal(status, f.count == 0 ? KVP_OK : KVP_AUDIT_FAILED);
    size_t n = 0;
    for (size_t i = 0; i < f.count && i < KVPT_FINDINGS_KEPT; i++) {
        n += f.items[i].invariant == invariant &&
             (what == NULL || strcmp(f.items[i].what, what) == 0);
    }
    return n;
}

/*
 * The audit knows null entries: a cache that claims one more released block
 * (its page still mapped) or a released block inside the window is reported
 * (I4); the true state is not.
 */
static void test_window_pager_audit_knows_null_entries(void **state)
{
    (void)state;
    fixture f;
    fixture_open(&f, F_W, 1, 64);
    fixture_decode(&f, 0, 15); /* sink block 0; blocks 1..4 released, 5..7 live */
    assert_int_equal(f.cache->released_end, 5);
    assert_int_equal(findings_of(f.pool, NULL, KVP_INVARIANT_LANE_COVERAGE), 0);
    f.cache->released_end = 6; /* block 5 is mapped, and inside the window at 15 */
    assert_int_equal(
        findings_of(f.pool, "pages mapped by a lane, ceil(len / block_tokens)",
                    KVP_INVARIANT_LANE_COVERAGE),
        BATCH);
    assert_int_equal(findings_of(f.pool, "released blocks lie entirely below len - window",
                                 KVP_INVARIANT_LANE_COVERAGE),
                     1);
    f.cache->released_end = 4; /* block 4 is null but not released */
    assert_int_equal(
        findings_of(f.pool, "pages mapped by a lane, ceil(len / block_tokens)",
                    KVP_INVARIANT_LANE_COVERAGE),
        BATCH);
    f.cache->released_end = 5;
    kvpt_assert_pool_ok(f.pool);
    fixture_close(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_pager_releases_exactly_outside_the_window),
        cmocka_unit_test(test_window_pager_model_copies_the_window),
        cmocka_unit_test(test_window_pager_fork_shares_only_live_blocks),
        cmocka_unit_test(test_window_pager_truncate_refused_when_blocks_are_gone),
        cmocka_unit_test(test_window_pager_truncate_with_sinks),
        cmocka_unit_test(test_window_pager_publish_of_released_block_refused),
        cmocka_unit_test(test_window_pager_reset_reuses_pages),
        cmocka_unit_test(test_window_pager_released_published_page_is_adopted),
        cmocka_unit_test(test_window_pager_exhaustion_changes_nothing),
        cmocka_unit_test(test_window_pager_audit_knows_null_entries),
        cmocka_unit_test(test_window_pager_released_page_is_noaccess),
        cmocka_unit_test(test_window_pager_exhausted_release_and_take_changes_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
