/*
 * test_window_share.c: prefix caching with sliding windows and sinks (issue
 * 21, part 3; docs/DESIGN.md "Sharing", "Prefix hits with windows").
 *
 * Checks, with kvp_pool_check after every operation:
 *   - the hybrid rule on a hand-worked example (a full cache, W = 4, and
 *     W = 2 with 2 sinks, block size 2, blocks left out of the index): the
 *     exact hit length (3 blocks where every-block-everywhere finds 0, and 0
 *     for a request of 2 blocks), which pages each cache maps and which stay
 *     null (released), the hit and miss counters, and that every adopted
 *     cache then computes the same outputs as the caches that published,
 *     bit for bit, releasing by the window rule at every step;
 *   - the rule against a brute force written out separately (for every
 *     block size 1..3, W 1..7 with the block edges on either side, sinks
 *     0..3, each block in turn missing, several request lengths, and in
 *     two calls, the second from the first's length): the hit length and
 *     every table entry;
 *   - admission's probe (kvpi_prefix_probe: keys and windows, no caches)
 *     against adoption over the same index, a full and a sliding layer, the
 *     same ranges with each block of either layer missing in turn: the same
 *     hit length, and its evictable pages exactly those adoption takes;
 *   - a failed adopt (a needed page published under another binding)
 *     changes nothing in any cache of the group, while the same forged page
 *     before a sliding cache's window is never looked at;
 *   - publishing: a group publish of a sliding cache registers the pages it
 *     holds and skips its released blocks (one call, nothing refused); a
 *     cache whose releases are held adopts as a full one;
 *   - a windowed model (a full layer, W = 5, W = 3 with 3 sinks): a
 *     sequence that adopts a published prefix and prefills the rest
 *     computes the outputs of one that prefills the whole prompt, bit for
 *     bit at f64, and so do their next steps.
 * Deterministic: no threads, fixed inputs.
 */
#include "support.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pager/cache_internal.h"

enum { WIDTH = 8, HEADS = 2, BATCH = 2, POSITIONS = 64 };

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

/* Written out: a cache of length len keeps block b (the window rule of cache_window.c). */
static int kept(size_t window, size_t sinks, size_t bt, size_t len, size_t b)
{
    if (window == 0 || b < ceil_div(sinks, bt) || len <= window) {
        return 1;
    }
    return (b + 1) * bt > len - window;
}

static void row_of(const double *input, size_t tokens, size_t t, double *row)
{
    for (size_t b = 0; b < BATCH; b++) {
        memcpy(row + b * WIDTH, input + (b * tokens + t) * WIDTH, sizeof(double) * WIDTH);
    }
}

/* One decode step; writes the [B, D] output at position t of out ([B, tokens, D]). */
static void step(kvp_layer *layer, kvp_cache *cache, kvp_ticket *ticket, const double *input,
                 size_t tokens, size_t t, double *out)
{
    double row[BATCH * WIDTH];
    row_of(input, tokens, t, row);
    kvp_tensor x = kvp_tensor3(row, BATCH, 1, WIDTH);
    kvp_error err;
    kvpt_assert_ok(kvp_attention_forward(layer, &x, cache, ticket, &err), &err);
    kvp_attention_result r;
    kvpt_assert_ok(kvp_ticket_result(ticket, &r, &err), &err);
    for (size_t b = 0; b < BATCH; b++) {
        memcpy(out + (b * tokens + t) * WIDTH, r.output + b * WIDTH, sizeof(double) * WIDTH);
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

static kvp_cache *cache_of(kvp_pool *pool, const kvp_layer *layer, size_t capacity)
{
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    return kvpt_cache(pool, &binding, BATCH, capacity);
}

/* kvpt_destroy_pool, where published pages may wait on the evictable list. */
static void close_pool(kvp_pool *pool)
{
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.held_pages, 0);
    assert_int_equal(s.free_pages + s.evictable_pages, s.total_pages);
    assert_int_equal(s.evictable_pages, s.cached_pages);
    assert_int_equal(s.attached_caches, 0);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_destroy(pool, &err), &err);
}

/* ---- a group of layer caches, published block by block ---------------------------- */

enum { MAXC = 3, MAXB = 16 };

typedef struct group {
    size_t count, bt, tokens;
    size_t window[MAXC], sinks[MAXC];
    kvp_layer *layers[MAXC];
    kvp_cache *publishers[MAXC];
    double *input;            /* [B, tokens, D] */
    double *want[MAXC];       /* the publishers' outputs */
    kvp_block_key keys[MAXB * MAXC * BATCH]; /* keys[(j * count + c) * B + lane] */
    uint32_t pages[MAXB * MAXC * BATCH];     /* the page published under each key */
} group;

/*
 * Each publisher computes every token; each full block is published the
 * moment it fills (before any window releases it), unless holes[c] has its
 * bit: that block of that cache is never in the index.
 */
static void group_open(group *g, kvp_pool *pool, size_t count, size_t bt, size_t tokens,
                       const size_t *window, const size_t *sinks, const unsigned *holes)
{
    kvp_error err;
    g->count = count;
    g->bt = bt;
    g->tokens = tokens;
    g->input = kvpt_doubles(BATCH * tokens * WIDTH);
    kvpt_fill_random(g->input, BATCH * tokens * WIDTH, 5);
    for (size_t c = 0; c < count; c++) {
        g->window[c] = window[c];
        g->sinks[c] = sinks[c];
        g->layers[c] = windowed_layer(window[c], sinks[c], 31 + c);
        g->publishers[c] = cache_of(pool, g->layers[c], tokens);
        g->want[c] = kvpt_doubles(BATCH * tokens * WIDTH);
        kvp_ticket *ticket = kvpt_ticket(g->publishers[c]);
        for (size_t j = 0; j < tokens / bt; j++) {
            for (size_t lane = 0; lane < BATCH; lane++) {
                uint64_t data[3] = {c, j, lane};
                kvpt_assert_ok(kvp_block_key_chain(NULL, g->publishers[c], data, sizeof data,
                                                   NULL, &g->keys[(j * count + c) * BATCH + lane],
                                                   &err),
                               &err);
            }
        }
        for (size_t t = 0; t < tokens; t++) {
            step(g->layers[c], g->publishers[c], ticket, g->input, tokens, t, g->want[c]);
            kvpt_assert_pool_ok(pool);
            size_t j = t / bt;
            if ((t + 1) % bt != 0 || (holes[c] >> j & 1u)) {
                continue;
            }
            for (size_t lane = 0; lane < BATCH; lane++) {
                size_t i = (j * count + c) * BATCH + lane;
                kvpt_assert_ok(kvp_cache_publish_block(g->publishers[c], lane, j, &g->keys[i], &err),
                               &err);
                kvpt_assert_ok(kvp_cache_page(g->publishers[c], lane, j, &g->pages[i], &err), &err);
            }
        }
        kvpt_destroy_ticket(ticket, pool);
    }
}

static void group_close(group *g, kvp_pool *pool)
{
    for (size_t c = 0; c < g->count; c++) {
        kvpt_destroy_cache(g->publishers[c], pool);
        kvpt_destroy_layer(g->layers[c]);
        free(g->want[c]);
    }
    free(g->input);
}

/* Fresh caches of the group's layers. */
static void adopters(const group *g, kvp_pool *pool, kvp_cache **out)
{
    for (size_t c = 0; c < g->count; c++) {
        out[c] = cache_of(pool, g->layers[c], g->tokens);
    }
}

/* Every table entry after adopting `hits` blocks: the published page where kept, null else. */
static void check_adopted(const group *g, kvp_cache *const *caches, size_t hits)
{
    kvp_error err;
    for (size_t c = 0; c < g->count; c++) {
        assert_int_equal(kvp_cache_len(caches[c]), hits * g->bt);
        for (size_t j = 0; j < hits; j++) {
            for (size_t lane = 0; lane < BATCH; lane++) {
                uint32_t page = 0;
                kvpt_assert_ok(kvp_cache_page(caches[c], lane, j, &page, &err), &err);
                if (kept(g->window[c], g->sinks[c], g->bt, hits * g->bt, j)) {
                    assert_int_equal(page, g->pages[(j * g->count + c) * BATCH + lane]);
                } else {
                    assert_int_equal(page, KVP_PAGE_RELEASED);
                }
            }
        }
    }
}

/* ---- the hybrid rule, by hand -------------------------------------------------------- */

/*
 * Block size 2, 16 tokens (blocks 0..7), three caches:
 *   F: full, block 6 missing;
 *   A: W = 4, blocks 0 and 4 missing;
 *   K: W = 2 with 2 sinks (sink block 0), block 3 missing.
 * Full caches left to right: F hits blocks 0..5, so at most 6 blocks.
 * Sliding caches right to left within that length:
 *   A at 6 blocks (12 tokens) needs the blocks of [8, 12), 4 and 5: 4 is
 *     missing, so at most 4 blocks; at 4 (8 tokens) it needs 2, 3: hits;
 *   K at 4 needs its sink block 0 and [6, 8), block 3: missing, so 3; at 3
 *     (6 tokens) it needs 0 and [4, 6), block 2: hits;
 *   A again at 3 needs [2, 6), blocks 1 and 2: hits. So 3 blocks, 6 tokens.
 * Every block everywhere (the rule of full attention) stops at A's block 0.
 * A request of 2 blocks: A at 2 (4 tokens <= W) needs blocks 0 and 1, and 0
 * is missing; at 1 it needs block 0: no hit at all.
 */
static void test_window_share_hybrid_rule_by_hand(void **state)
{
    (void)state;
    kvp_error err;
    kvp_pool *pool = kvpt_pool(2, 1, WIDTH / HEADS, 256);
    group g;
    size_t window[3] = {0, 4, 2};
    size_t sinks[3] = {0, 0, 2};
    unsigned holes[3] = {1u << 6, 1u << 0 | 1u << 4, 1u << 3};
    group_open(&g, pool, 3, 2, 16, window, sinks, holes);
    kvp_cache *caches[3];
    adopters(&g, pool, caches);
    kvp_pool_stats before = kvpt_stats(pool);
    size_t got = 99;
    size_t probed = 99, evictable = 99;
    kvpt_assert_ok(kvp_cache_group_probe((const kvp_cache *const *)caches, 3, g.keys, 2, &probed,
                                         &evictable, &err),
                   &err);
    assert_int_equal(probed, 0);
    kvpt_assert_ok(kvp_cache_group_adopt(caches, 3, g.keys, 2, &got, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(got, 0);
    assert_int_equal(kvpt_stats(pool).prefix_misses, before.prefix_misses + 1);
    assert_int_equal(kvpt_stats(pool).prefix_hits, before.prefix_hits);

    kvpt_assert_ok(kvp_cache_group_probe((const kvp_cache *const *)caches, 3, g.keys, 8, &probed,
                                         &evictable, &err),
                   &err);
    assert_int_equal(probed, 3);
    /*
     * Of the 14 pages (F's 3, A's blocks 1 and 2, K's 0 and 2), the ones the
     * publishers' windows released wait on the LRU list: A's 1, 2 and K's 2.
     */
    assert_int_equal(evictable, BATCH * 3);
    kvpt_assert_ok(kvp_cache_group_adopt(caches, 3, g.keys, 8, &got, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(got, 3);
    /* F maps 3 blocks, A blocks 1 and 2 (0 released), K blocks 0 and 2 (1 released). */
    assert_int_equal(kvpt_stats(pool).prefix_hits, before.prefix_hits + BATCH * (3 + 2 + 2));
    assert_int_equal(kvpt_stats(pool).prefix_misses, before.prefix_misses + 2);
    check_adopted(&g, caches, 3);
    /* Each adopted cache computes the rest as its publisher did, bit for bit. */
    for (size_t c = 0; c < 3; c++) {
        double *out = kvpt_doubles(BATCH * 16 * WIDTH);
        memcpy(out, g.want[c], sizeof(double) * BATCH * 16 * WIDTH);
        for (size_t b = 0; b < BATCH; b++) {
            kvpt_fill(out + (b * 16 + 6) * WIDTH, 10 * WIDTH, -1.0);
        }
        kvp_ticket *ticket = kvpt_ticket(caches[c]);
        for (size_t t = 6; t < 16; t++) {
            step(g.layers[c], caches[c], ticket, g.input, 16, t, out);
            kvpt_assert_pool_ok(pool);
            for (size_t j = 0; j < ceil_div(t + 1, 2); j++) {
                uint32_t page = 0;
                kvpt_assert_ok(kvp_cache_page(caches[c], 0, j, &page, &err), &err);
                assert_int_equal(page == KVP_PAGE_RELEASED, !kept(window[c], sinks[c], 2, t + 1, j));
            }
        }
        assert_same_bits(out, g.want[c], BATCH * 16 * WIDTH);
        kvpt_destroy_ticket(ticket, pool);
        free(out);
    }
    for (size_t c = 0; c < 3; c++) {
        kvpt_destroy_cache(caches[c], pool);
    }
    group_close(&g, pool);
    close_pool(pool);
}

/* ---- the rule against a brute force ----------------------------------------------------- */

/* The longest h <= n whose needed blocks (kept at h * bt) are all published. */
static size_t brute_hits(size_t window, size_t sinks, size_t bt, unsigned holes, size_t n)
{
    for (size_t h = n;; h--) {
        int ok = 1;
        for (size_t b = 0; b < h; b++) {
            if (kept(window, sinks, bt, h * bt, b) && (holes >> b & 1u)) {
                ok = 0;
            }
        }
        if (ok || h == 0) {
            return h;
        }
    }
}

/* The same from a cache already `first` blocks long: only blocks >= first are looked up. */
static size_t brute_hits_from(size_t window, size_t sinks, size_t bt, unsigned holes,
                              size_t first, size_t n)
{
    for (size_t h = n;; h--) {
        int ok = 1;
        for (size_t b = first; b < first + h; b++) {
            if (kept(window, sinks, bt, (first + h) * bt, b) && (holes >> b & 1u)) {
                ok = 0;
            }
        }
        if (ok || h == 0) {
            return h;
        }
    }
}

/* Adopts in two calls: half the blocks, then the rest from there. */
static void adopt_twice(const group *g, kvp_pool *pool, unsigned holes)
{
    kvp_error err;
    size_t blocks = g->tokens / g->bt;
    kvp_cache *cache;
    adopters(g, pool, &cache);
    size_t got = 99, more = 99;
    kvpt_assert_ok(kvp_cache_group_adopt(&cache, 1, g->keys, blocks / 2, &got, &err), &err);
    assert_int_equal(got, brute_hits(g->window[0], g->sinks[0], g->bt, holes, blocks / 2));
    kvpt_assert_ok(kvp_cache_group_adopt(&cache, 1, g->keys + got * BATCH, blocks - got, &more,
                                         &err),
                   &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(more, brute_hits_from(g->window[0], g->sinks[0], g->bt, holes, got,
                                           blocks - got));
    check_adopted(g, &cache, got + more);
    kvpt_destroy_cache(cache, pool);
}

static void test_window_share_rule_matches_brute_force(void **state)
{
    (void)state;
    enum { TOKENS = 12 };
    static const size_t windows[] = {1, 2, 3, 4, 5, 7};
    kvp_error err;
    size_t cases = 0, partial = 0;
    for (size_t bt = 1; bt <= 3; bt++) {
        size_t blocks = TOKENS / bt;
        for (size_t w = 0; w < sizeof windows / sizeof *windows; w++) {
            for (size_t s = 0; s <= 3; s++) {
                for (size_t hole = 0; hole <= blocks; hole++) {
                    unsigned holes = hole < blocks ? 1u << hole : 0u;
                    kvp_pool *pool = kvpt_pool(bt, 1, WIDTH / HEADS, 128);
                    group g;
                    group_open(&g, pool, 1, bt, TOKENS, &windows[w], &s, &holes);
                    size_t asks[3] = {blocks, blocks - 1, blocks / 2};
                    for (size_t a = 0; a < 3; a++) {
                        kvp_cache *cache;
                        adopters(&g, pool, &cache);
                        size_t got = 99;
                        kvpt_assert_ok(kvp_cache_group_adopt(&cache, 1, g.keys, asks[a], &got,
                                                             &err),
                                       &err);
                        kvpt_assert_pool_ok(pool);
                        size_t want = brute_hits(windows[w], s, bt, holes, asks[a]);
                        if (got != want) {
                            print_error("bt %zu W %zu S %zu hole %zu ask %zu: %zu != %zu\n", bt,
                                        windows[w], s, hole, asks[a], got, want);
                            fail();
                        }
                        check_adopted(&g, &cache, got);
                        cases++;
                        /* A hit past a missing block: the full rule would have stopped. */
                        partial += hole < got;
                        kvpt_destroy_cache(cache, pool);
                    }
                    adopt_twice(&g, pool, holes);
                    group_close(&g, pool);
                    close_pool(pool);
                }
            }
        }
    }
    assert_int_equal(cases, 3 * 6 * 4 * (13 + 7 + 5));
    assert_true(partial > 100); /* the cases the rule exists for are many */
}

/* ---- admission's probe against adoption -------------------------------------------------- */

/*
 * kvpi_prefix_probe (admission: keys and the layers' windows only, one
 * lane) against kvp_cache_group_adopt of fresh caches over the same index:
 * a full layer and a sliding one (W, S), every block size 1..3, W 1..7,
 * sinks 0..3, no block missing or each block of either layer missing in
 * turn, three request lengths. The probe's hit equals the blocks adopted,
 * and its evictable pages (per lane) are exactly the pages the adoption
 * takes off the LRU list. The full rule (the probe with every layer full)
 * would find less wherever a sliding layer's missing block lies before its
 * window: counted, so the cases the window rule gains are many.
 */
static void probe_against_adopt(const group *g, kvp_pool *pool, size_t ask, size_t *gained)
{
    kvp_error err;
    size_t windows[2 * MAXC];
    kvp_block_key lane0[MAXB * MAXC];
    for (size_t c = 0; c < g->count; c++) {
        windows[2 * c] = g->window[c];
        windows[2 * c + 1] = g->sinks[c];
    }
    for (size_t i = 0; i < (g->tokens / g->bt) * g->count; i++) {
        lane0[i] = g->keys[i * BATCH];
    }
    size_t evictable = 99, full_evictable = 99;
    size_t probed = kvpi_prefix_probe(pool, lane0, g->count, windows, g->bt, ask, &evictable);
    size_t full = kvpi_prefix_probe(pool, lane0, g->count, NULL, g->bt, ask, &full_evictable);
    kvp_cache *caches[MAXC];
    adopters(g, pool, caches);
    kvp_pool_stats before = kvpt_stats(pool);
    size_t got = 99;
    kvpt_assert_ok(kvp_cache_group_adopt(caches, g->count, g->keys, ask, &got, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats after = kvpt_stats(pool);
    if (probed != got || before.evictable_pages - after.evictable_pages != BATCH * evictable) {
        print_error("bt %zu W %zu S %zu ask %zu: probe %zu (%zu evictable), adopted %zu (%zu)\n",
                    g->bt, g->window[1], g->sinks[1], ask, probed, evictable, got,
                    (size_t)(before.evictable_pages - after.evictable_pages));
        fail();
    }
    assert_true(full <= got);
    *gained += full < got;
    check_adopted(g, caches, got);
    for (size_t c = 0; c < g->count; c++) {
        kvpt_destroy_cache(caches[c], pool);
    }
}

static void test_window_share_probe_matches_adopt(void **state)
{
    (void)state;
    enum { TOKENS = 12 };
    static const size_t windows[] = {1, 2, 3, 4, 5, 7};
    size_t cases = 0, gained = 0;
    for (size_t bt = 1; bt <= 3; bt++) {
        size_t blocks = TOKENS / bt;
        for (size_t w = 0; w < sizeof windows / sizeof *windows; w++) {
            for (size_t s = 0; s <= 3; s++) {
                for (size_t hole = 0; hole <= 2 * blocks; hole++) {
                    /* hole < blocks: the full layer's; then the sliding layer's; last: none */
                    unsigned holes[2] = {hole < blocks ? 1u << hole : 0u,
                                         hole >= blocks && hole < 2 * blocks
                                             ? 1u << (hole - blocks)
                                             : 0u};
                    size_t win[2] = {0, windows[w]};
                    size_t sinks[2] = {0, s};
                    kvp_pool *pool = kvpt_pool(bt, 1, WIDTH / HEADS, 256);
                    group g;
                    group_open(&g, pool, 2, bt, TOKENS, win, sinks, holes);
                    size_t asks[3] = {blocks, blocks - 1, blocks / 2};
                    for (size_t a = 0; a < 3; a++) {
                        probe_against_adopt(&g, pool, asks[a], &gained);
                        cases++;
                    }
                    group_close(&g, pool);
                    close_pool(pool);
                }
            }
        }
    }
    assert_int_equal(cases, 3 * 6 * 4 * (25 + 13 + 9));
    assert_true(gained > 100); /* where admission credited less before */
}

/* ---- a failed adopt changes nothing ------------------------------------------------------ */

static void test_window_share_failed_adopt_changes_nothing(void **state)
{
    (void)state;
    kvp_error err;
    kvp_pool *pool = kvpt_pool(2, 1, WIDTH / HEADS, 256);
    group g;
    size_t window[3] = {0, 4, 2};
    size_t sinks[3] = {0, 0, 2};
    unsigned holes[3] = {0, 0, 0};
    group_open(&g, pool, 3, 2, 16, window, sinks, holes);
    /* A page of another layer's cache, published under a key of its own. */
    kvp_layer *other = windowed_layer(0, 0, 77);
    kvp_cache *forger = cache_of(pool, other, 16);
    kvp_ticket *ticket = kvpt_ticket(forger);
    double *out = kvpt_doubles(BATCH * 16 * WIDTH);
    for (size_t t = 0; t < 2; t++) {
        step(other, forger, ticket, g.input, 16, t, out);
    }
    kvp_block_key forged;
    uint64_t data = 4242;
    kvpt_assert_ok(kvp_block_key_chain(NULL, forger, &data, sizeof data, NULL, &forged, &err), &err);
    kvpt_assert_ok(kvp_cache_publish_block(forger, 0, 0, &forged, &err), &err);
    kvpt_assert_pool_ok(pool);
    /* A (cache 1) at 3 blocks needs blocks 1 and 2, not block 0: the forged key there is not read. */
    kvp_block_key keys[8 * 3 * BATCH];
    memcpy(keys, g.keys, sizeof keys);
    keys[(0 * 3 + 1) * BATCH + 0] = forged;
    kvp_cache *caches[3];
    adopters(&g, pool, caches);
    size_t got = 99;
    kvpt_assert_ok(kvp_cache_group_adopt(caches, 3, keys, 3, &got, &err), &err);
    assert_int_equal(got, 3);
    check_adopted(&g, caches, 3);
    kvpt_assert_pool_ok(pool);
    for (size_t c = 0; c < 3; c++) {
        kvpt_destroy_cache(caches[c], pool);
    }
    /* At 3 blocks A needs block 2: a forged page there refuses the whole adopt, changing nothing. */
    keys[(2 * 3 + 1) * BATCH + 1] = forged;
    adopters(&g, pool, caches);
    kvpt_state before[3];
    for (size_t c = 0; c < 3; c++) {
        kvpt_state_capture(caches[c], pool, &before[c]);
    }
    size_t probed = 99;
    got = 99;
    assert_int_equal(kvp_cache_group_probe((const kvp_cache *const *)caches, 3, keys, 3, &probed,
                                           NULL, &err),
                     KVP_BLOCK_BINDING_MISMATCH);
    assert_int_equal(probed, 99);
    assert_int_equal(kvp_cache_group_adopt(caches, 3, keys, 3, &got, &err),
                     KVP_BLOCK_BINDING_MISMATCH);
    assert_int_equal(err.layer, 1);
    assert_int_equal(err.position, 4);
    assert_int_equal(got, 99);
    for (size_t c = 0; c < 3; c++) {
        kvpt_assert_state_unchanged(&before[c], caches[c], pool, 0);
        kvpt_state_free(&before[c]);
    }
    for (size_t c = 0; c < 3; c++) {
        kvpt_destroy_cache(caches[c], pool);
    }
    free(out);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(forger, pool);
    kvpt_destroy_layer(other);
    group_close(&g, pool);
    close_pool(pool);
}

/* ---- publish what each kind keeps --------------------------------------------------------- */

static void test_window_share_group_publish_skips_released(void **state)
{
    (void)state;
    kvp_error err;
    kvp_pool *pool = kvpt_pool(2, 1, WIDTH / HEADS, 64);
    group g;
    size_t window[2] = {0, 3};
    size_t sinks[2] = {0, 0};
    unsigned holes[2] = {~0u, ~0u}; /* nothing published while computing */
    group_open(&g, pool, 2, 2, 12, window, sinks, holes);
    /* At 12 tokens W = 3 keeps [9, 12): blocks 4 and 5; blocks 0..3 are released. */
    assert_int_equal(kvpt_stats(pool).cached_pages, 0);
    kvp_cache *caches[2] = {g.publishers[0], g.publishers[1]};
    kvpt_assert_ok(kvp_cache_group_publish(caches, 2, g.keys, 6, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).cached_pages, BATCH * (6 + 2));
    /* A cache of one layer adopts them: the rule of each kind. */
    kvp_cache *fresh[2];
    adopters(&g, pool, fresh);
    size_t got = 99;
    /* Releases held (the scheduler's prompt), W = 3 keeps every block: block 0 is missing. */
    kvpi_cache_hold_release_many(&fresh[1], 1);
    kvpt_assert_ok(kvp_cache_group_adopt(fresh, 2, g.keys, 6, &got, &err), &err);
    assert_int_equal(got, 0);
    assert_int_equal(kvpi_cache_resume_release_many(&fresh[1], 1), 0);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_cache_group_adopt(fresh, 2, g.keys, 6, &got, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(got, 6);
    for (size_t c = 0; c < 2; c++) {
        for (size_t j = 0; j < 6; j++) {
            for (size_t lane = 0; lane < BATCH; lane++) {
                uint32_t want = 0, page = 0;
                kvpt_assert_ok(kvp_cache_page(caches[c], lane, j, &want, &err), &err);
                kvpt_assert_ok(kvp_cache_page(fresh[c], lane, j, &page, &err), &err);
                assert_int_equal(page, want);
            }
        }
        kvpt_destroy_cache(fresh[c], pool);
    }
    /* One named block that is gone is still refused: there is no page to name. */
    assert_int_equal(kvp_cache_publish_block(caches[1], 0, 1, &g.keys[(1 * 2 + 1) * BATCH], &err),
                     KVP_BLOCK_RELEASED);
    group_close(&g, pool);
    close_pool(pool);
}

/* ---- a windowed model's sequences ----------------------------------------------------------- */

enum { SL = 3, SBT = 2, PROMPT = 21, PREFIX = 12, STEPS = 4 };

static kvp_model *hybrid_model(void)
{
    kvp_error err;
    size_t windows[SL] = {0, 5, 3};
    size_t sinks[SL] = {0, 0, 3};
    kvp_layer *made[SL];
    const kvp_layer *layers[SL];
    for (size_t l = 0; l < SL; l++) {
        made[l] = windowed_layer(windows[l], sinks[l], 90 + l);
        layers[l] = made[l];
    }
    kvp_model *model = NULL;
    kvpt_assert_ok(kvp_model_create(layers, SL, &model, &err), &err);
    for (size_t l = 0; l < SL; l++) {
        kvpt_destroy_layer(made[l]);
    }
    return model;
}

/* The tokens [from, to) of prompt ([B, PROMPT, D]) prefilled; outputs into out at [from, to). */
static void prefill_part(kvp_sequence *seq, kvp_pool *pool, const double *prompt, size_t from,
                         size_t to, double *out)
{
    double part[BATCH * PROMPT * WIDTH];
    double got[BATCH * PROMPT * WIDTH];
    for (size_t b = 0; b < BATCH; b++) {
        memcpy(part + b * (to - from) * WIDTH, prompt + (b * PROMPT + from) * WIDTH,
               (to - from) * WIDTH * sizeof(double));
    }
    kvp_tensor t = kvp_tensor3(part, BATCH, to - from, WIDTH);
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_prefill(seq, &t, NULL, NULL, got, BATCH * (to - from) * WIDTH,
                                        &err),
                   &err);
    kvpt_assert_pool_ok(pool);
    for (size_t b = 0; b < BATCH; b++) {
        memcpy(out + (b * PROMPT + from) * WIDTH, got + b * (to - from) * WIDTH,
               (to - from) * WIDTH * sizeof(double));
    }
}

static void steps(kvp_sequence *seq, kvp_pool *pool, double *out)
{
    kvp_error err;
    for (size_t s = 0; s < STEPS; s++) {
        double x[BATCH * WIDTH];
        kvpt_fill_random(x, BATCH * WIDTH, 500 + s);
        kvp_tensor in = kvp_tensor3(x, BATCH, 1, WIDTH);
        kvpt_assert_ok(kvp_sequence_step(seq, &in, NULL, NULL, out + s * BATCH * WIDTH,
                                         BATCH * WIDTH, &err),
                       &err);
        kvpt_assert_pool_ok(pool);
    }
}

/*
 * A sequence prefills the 12-token prefix and publishes it: the full layer
 * all 6 blocks, W = 5 the blocks of [7, 12) (3..5), W = 3 with 3 sinks the
 * sink blocks 0, 1 and [9, 12) (4, 5). A 21-token prompt starting with it
 * adopts all 12 tokens (full left to right: 6 blocks, then a miss; at 6
 * blocks each sliding layer finds what it keeps), prefills 9, and computes
 * the outputs of a sequence that prefills all 21, bit for bit, steps after
 * included. Before the hit rule the publish was refused (BLOCK_RELEASED).
 */
static void test_window_share_sequence_prefill_with_hit(void **state)
{
    (void)state;
    kvp_error err;
    kvp_model *model = hybrid_model();
    kvp_pool *pool = kvpt_pool(SBT, 1, WIDTH / HEADS, 256);
    double *prompt = kvpt_doubles(BATCH * PROMPT * WIDTH);
    kvpt_fill_random(prompt, BATCH * PROMPT * WIDTH, 17);
    double *want = kvpt_doubles(BATCH * PROMPT * WIDTH);
    double *got = kvpt_doubles(BATCH * PROMPT * WIDTH);
    double want_steps[STEPS * BATCH * WIDTH], got_steps[STEPS * BATCH * WIDTH];

    kvp_sequence *fresh = kvpt_sequence(model, pool, BATCH, 32);
    prefill_part(fresh, pool, prompt, 0, PROMPT, want);
    steps(fresh, pool, want_steps);

    kvp_sequence *publisher = kvpt_sequence(model, pool, BATCH, 32);
    double scratch[BATCH * PROMPT * WIDTH];
    prefill_part(publisher, pool, prompt, 0, PREFIX, scratch);
    double head[BATCH * PREFIX * WIDTH];
    for (size_t b = 0; b < BATCH; b++) {
        memcpy(head + b * PREFIX * WIDTH, prompt + b * PROMPT * WIDTH,
               PREFIX * WIDTH * sizeof(double));
    }
    kvp_tensor prefix = kvp_tensor3(head, BATCH, PREFIX, WIDTH);
    size_t published = 0;
    uint64_t cached = kvpt_stats(pool).cached_pages;
    kvpt_assert_ok(kvp_sequence_publish_prefix(publisher, &prefix, &published, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(published, 6);
    assert_int_equal(kvpt_stats(pool).cached_pages, cached + BATCH * (6 + 3 + 4));

    kvp_sequence *adopter = kvpt_sequence(model, pool, BATCH, 32);
    kvp_tensor whole = kvp_tensor3(prompt, BATCH, PROMPT, WIDTH);
    size_t adopted = 0;
    uint64_t hits = kvpt_stats(pool).prefix_hits;
    kvpt_assert_ok(kvp_sequence_adopt_prefix(adopter, &whole, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, PREFIX);
    assert_int_equal(kvpt_stats(pool).prefix_hits, hits + BATCH * (6 + 3 + 4));
    assert_int_equal(kvp_sequence_held_pages(adopter), BATCH * (6 + 3 + 4));
    kvpt_fill(got, BATCH * PROMPT * WIDTH, -1.0);
    prefill_part(adopter, pool, prompt, PREFIX, PROMPT, got);
    steps(adopter, pool, got_steps);
    for (size_t b = 0; b < BATCH; b++) {
        assert_same_bits(got + (b * PROMPT + PREFIX) * WIDTH, want + (b * PROMPT + PREFIX) * WIDTH,
                         (PROMPT - PREFIX) * WIDTH);
    }
    assert_same_bits(got_steps, want_steps, STEPS * BATCH * WIDTH);
    assert_int_equal(kvp_sequence_held_pages(adopter), kvp_sequence_held_pages(fresh));

    kvpt_destroy_sequence(adopter, pool);
    kvpt_destroy_sequence(publisher, pool);
    kvpt_destroy_sequence(fresh, pool);
    free(got);
    free(want);
    free(prompt);
    kvpt_destroy_model(model);
    close_pool(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_share_hybrid_rule_by_hand),
        cmocka_unit_test(test_window_share_rule_matches_brute_force),
        cmocka_unit_test(test_window_share_probe_matches_adopt),
        cmocka_unit_test(test_window_share_failed_adopt_changes_nothing),
        cmocka_unit_test(test_window_share_group_publish_skips_released),
        cmocka_unit_test(test_window_share_sequence_prefill_with_hit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
