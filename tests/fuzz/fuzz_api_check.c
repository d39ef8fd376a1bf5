/*
 * fuzz_api_check.c: the checks of the kvp_fuzz_api target that every
 * operation shares (see fuzz_api.c for the whole target): tolerant row
 * comparison, the error detail against the shadow's expectation, cache
 * digests for "a failure changed nothing", the logical rows and page tables
 * of caches and sequences, and check_world, the full audit of the library
 * against the shadow W after every operation (pool statistics,
 * kvp_pool_check, sharing counters, page ids mapped one to one).
 *
 * Invariants: a check only reads the library and W (its own library calls
 * run with g_auditing set, so they are not tallied as the operation's); any
 * difference calls fail() (fz_fail), which aborts.
 *
 * Callers: fuzz_api.c (after each operation), fuzz_api_cache.c and
 * fuzz_api_seq.c, through fuzz_api.h.
 */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_api.h"

/* ---- checks shared by every operation ----------------------------------- */

/*
 * got within TOLERANCE of want, relative to `scale` (at least |want| and 1).
 * The library and the shadow may differ in the last bits of a step (the
 * library's vector exp against libm's): an element that cancels to far
 * below its row's other elements keeps the absolute error of the row's
 * terms, so compare_rows passes its row's largest |want|.
 */
static int close_enough(double got, double want, double scale)
{
    scale = fabs(want) > scale ? fabs(want) : scale;
    scale = scale > 1.0 ? scale : 1.0;
    return fabs(got - want) <= TOLERANCE * scale;
}

/* The largest |want| of the `row`-element row holding element i. */
static double row_scale(const double *want, size_t n, size_t row, size_t i)
{
    size_t first = i - i % row;
    size_t end = first + row < n ? first + row : n;
    double scale = 0.0;
    for (size_t j = first; j < end; j++) {
        scale = fabs(want[j]) > scale ? fabs(want[j]) : scale;
    }
    return scale;
}

/* Rows of W.d outputs (or the whole block when n is not a multiple of it). */
void compare_rows(const char *what, const double *got, const double *want, size_t n)
{
    size_t row = W.d != 0 && n % W.d == 0 ? W.d : n;
    for (size_t i = 0; i < n; i++) {
        CHECK(close_enough(got[i], want[i], row_scale(want, n, row, i)),
              "%s[%zu] = %.17g, expected %.17g", what, i, got[i], want[i]);
    }
}

/* Compares the error detail the shadow predicted for a failed prepare. */
void check_detail(const kvp_error *err, const expect *e)
{
    CHECK(err->status == e->status, "err.status %s, expected %s", kvp_status_name(err->status),
          kvp_status_name(e->status));
    switch (e->status) {
    case KVP_NONFINITE_PROJECTION:
        CHECK(err->what != NULL && strcmp(err->what, e->what) == 0,
              "non-finite projection names %s, expected %s", err->what ? err->what : "NULL",
              e->what);
        /* fall through */
    case KVP_NONFINITE_SCORE:
    case KVP_NONFINITE_OUTPUT:
    case KVP_NONFINITE_KEY:
    case KVP_NONFINITE_VALUE:
        CHECK(err->index == e->index, "non-finite index %zu, expected %zu", err->index, e->index);
        CHECK(!isfinite(err->value), "non-finite error reports a finite value %g", err->value);
        break;
    case KVP_CACHE_LAYER_REVISION_MISMATCH:
        CHECK(err->parameter == e->parameter, "stale parameter %zu, expected %zu",
              err->parameter, e->parameter);
        break;
    default:
        break;
    }
}

static uint64_t cache_digest(const kvp_cache *cache)
{
    uint64_t digest = 0;
    kvp_error err;
    int auditing = g_auditing;
    g_auditing = 1;
    kvp_status status = kvp_cache_digest(cache, &digest, &err);
    check_status(status, KVP_OK, &err);
    g_auditing = auditing;
    return digest;
}

void take_digests(digests *out)
{
    memset(out, 0, sizeof *out);
    for (int i = 0; i < N_CACHES; i++) {
        if (W.cache[i].live) {
            out->cache[i] = cache_digest(W.cache[i].cache);
        }
    }
    for (int i = 0; i < N_SEQS; i++) {
        for (size_t l = 0; W.seq[i].live && l < W.layers; l++) {
            out->seq[i][l] = cache_digest(kvp_sequence_cache(W.seq[i].seq, l));
        }
    }
}

void check_unchanged(const digests *before)
{
    digests now;
    take_digests(&now);
    for (int i = 0; i < N_CACHES; i++) {
        CHECK(now.cache[i] == before->cache[i], "a failed call changed cache slot %d", i);
    }
    for (int i = 0; i < N_SEQS; i++) {
        for (size_t l = 0; l < W.layers; l++) {
            CHECK(now.seq[i][l] == before->seq[i][l],
                  "a failed call changed layer %zu of sequence slot %d", l, i);
        }
    }
}

void on_mismatch(void *ctx, const kvp_mismatch *mismatch)
{
    (void)ctx;
    char text[256];
    kvp_mismatch_format(mismatch, text, sizeof text);
    fprintf(stderr, "kvpager fuzz: audit: %s\n", text);
}

static void check_cache_rows(int slot)
{
    const scache *c = &W.cache[slot];
    double rows[MAX_B * MAX_H * MAX_CAP * MAX_D];
    size_t n = c->batch * W.heads * c->kv.len * W.hd;
    kvp_error err;
    for (int which = 0; which < 2; which++) {
        kvp_status status = which == 0 ? kvp_cache_keys(c->cache, rows, n, &err)
                                       : kvp_cache_values(c->cache, rows, n, &err);
        check_status(status, KVP_OK, &err);
        for (size_t lane = 0; lane < c->batch; lane++) {
            for (size_t h = 0; h < W.heads; h++) {
                for (size_t t = 0; t < c->kv.len; t++) {
                    const double *got = rows + ((lane * W.heads + h) * c->kv.len + t) * W.hd;
                    const double *want = which == 0 ? c->kv.k[lane][h][t] : c->kv.v[lane][h][t];
                    compare_rows(which == 0 ? "cache key" : "cache value", got, want, W.hd);
                }
            }
        }
    }
}

/*
 * The page tables through kvp_cache_page: every mapped (lane, block) names a
 * page of this pool that no other table names, and the first unmapped block
 * and lane are OUT_OF_RANGE.
 */
static void check_tables(const kvp_cache *cache, size_t batch, size_t len, unsigned char *seen)
{
    size_t blocks = blocks_for(len);
    uint32_t page = UINT32_MAX;
    kvp_error err;
    for (size_t lane = 0; lane < batch; lane++) {
        for (size_t block = 0; block < blocks; block++) {
            kvp_status status = kvp_cache_page(cache, lane, block, &page, &err);
            check_status(status, KVP_OK, &err);
            CHECK(page < W.total, "lane %zu block %zu maps page %u of %zu", lane, block,
                  (unsigned)page, W.total);
            CHECK(!seen[page], "page %u is mapped twice", (unsigned)page);
            seen[page] = 1;
        }
        kvp_status status = kvp_cache_page(cache, lane, blocks, &page, &err);
        check_status(status, KVP_OUT_OF_RANGE, &err);
    }
    kvp_status status = kvp_cache_page(cache, batch, 0, &page, &err);
    check_status(status, KVP_OUT_OF_RANGE, &err);
}

/*
 * A sequence layer's tables: every shadow page id stands for one library page
 * and back (ids[] and pages[] fill as they are met), sharing exactly as the
 * shadow says; no standalone cache's page (`seen`) among them.
 */
static void check_seq_tables(const sseq *s, size_t l, int *ids, int *pages,
                             const unsigned char *seen)
{
    const kvp_cache *cache = kvp_sequence_cache(s->seq, l);
    size_t blocks = blocks_for(s->kv[0].len);
    kvp_error err;
    for (size_t b = 0; b < s->batch; b++) {
        for (size_t block = 0; block < blocks; block++) {
            uint32_t page = UINT32_MAX;
            kvp_status status = kvp_cache_page(cache, b, block, &page, &err);
            check_status(status, KVP_OK, &err);
            CHECK(page < W.total && !seen[page], "layer %zu lane %zu block %zu maps page %u", l,
                  b, block, (unsigned)page);
            int id = s->table[l][b][block];
            CHECK(W.page[id].used && W.page[id].refs > 0, "the shadow maps a dead page id %d", id);
            if (ids[page] < 0 && pages[id] < 0) {
                ids[page] = id;
                pages[id] = (int)page;
            }
            CHECK(ids[page] == id && pages[id] == (int)page,
                  "layer %zu lane %zu block %zu: page %u, shadow id %d (pages shared otherwise "
                  "than the shadow says)",
                  l, b, block, (unsigned)page, id);
        }
        uint32_t page = UINT32_MAX;
        kvp_status status = kvp_cache_page(cache, b, blocks, &page, &err);
        check_status(status, KVP_OUT_OF_RANGE, &err);
    }
}

/* Everything the shadow knows about, against the library, after every operation. */
void check_world(void)
{
    g_auditing = 1;
    size_t caches = 0, reservations = 0;
    unsigned char seen[64];
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < N_CACHES; i++) {
        const scache *c = &W.cache[i];
        if (!c->live) {
            continue;
        }
        caches++;
        CHECK(kvp_cache_len(c->cache) == c->kv.len, "cache slot %d len %zu, expected %zu", i,
              kvp_cache_len(c->cache), c->kv.len);
        kvp_cache_info info;
        kvp_cache_info_init(&info);
        kvp_error err;
        kvp_status status = kvp_cache_info_get(c->cache, &info, &err);
        check_status(status, KVP_OK, &err);
        CHECK(info.mapped_pages == c->batch * blocks_for(c->kv.len),
              "cache slot %d maps %zu pages, expected %zu", i, info.mapped_pages,
              c->batch * blocks_for(c->kv.len));
        CHECK(info.capacity == c->capacity && info.batch_size == c->batch,
              "cache slot %d geometry changed", i);
        check_cache_rows(i);
        check_tables(c->cache, c->batch, c->kv.len, seen);
    }
    for (int i = 0; i < N_TICKETS; i++) {
        const sticket *t = &W.ticket[i];
        if (!t->live) {
            continue;
        }
        reservations += t->reserved != 0;
        kvp_attention_result result;
        kvp_error err;
        kvp_status status = kvp_ticket_result(t->ticket, &result, &err);
        check_status(status, t->state == T_EMPTY ? KVP_TICKET_EMPTY : KVP_OK, &err);
        if (status == KVP_OK) {
            CHECK(result.reserved_pages == t->reserved, "ticket slot %d reserves %zu, expected %zu",
                  i, result.reserved_pages, t->reserved);
            CHECK(result.committed == (t->state == T_COMMITTED),
                  "ticket slot %d committed flag %d", i, result.committed);
            CHECK(result.keys == t->len_at + 1, "ticket slot %d keys %zu, expected %zu", i,
                  result.keys, t->len_at + 1);
        }
    }
    int ids[64];
    int pages[MAX_SPAGES];
    memset(ids, 0xff, sizeof ids);
    memset(pages, 0xff, sizeof pages);
    for (int i = 0; i < N_SEQS; i++) {
        const sseq *s = &W.seq[i];
        if (!s->live) {
            continue;
        }
        caches += W.layers;
        size_t len = s->kv[0].len;
        CHECK(kvp_sequence_len(s->seq) == len, "sequence slot %d len %zu, expected %zu", i,
              kvp_sequence_len(s->seq), len);
        size_t held = W.layers * s->batch * blocks_for(len);
        CHECK(kvp_sequence_held_pages(s->seq) == held, "sequence slot %d holds %zu, expected %zu",
              i, kvp_sequence_held_pages(s->seq), held);
        CHECK(kvp_sequence_promised_pages(s->seq) == s->promise,
              "sequence slot %d promised %zu, expected %zu", i,
              kvp_sequence_promised_pages(s->seq), s->promise);
        for (size_t l = 0; l < W.layers; l++) {
            CHECK(kvp_cache_len(kvp_sequence_cache(s->seq, l)) == len,
                  "sequence slot %d layer %zu len differs", i, l);
            check_seq_tables(s, l, ids, pages, seen);
        }
        CHECK(kvp_sequence_cache(s->seq, W.layers) == NULL, "sequence slot %d has a layer %zu",
              i, W.layers);
        for (size_t more = 0; more <= 3; more++) {
            size_t want = seq_pages_for(s, len + more);
            CHECK(kvp_sequence_pages_for(s->seq, len + more) == want,
                  "sequence slot %d pages_for(%zu) = %zu, expected %zu", i, len + more,
                  kvp_sequence_pages_for(s->seq, len + more), want);
        }
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvp_error err;
    kvp_status status = kvp_pool_stats_get(W.pool, &stats, &err);
    check_status(status, KVP_OK, &err);
    CHECK(stats.total_pages == W.total, "total pages %zu, expected %zu", stats.total_pages,
          W.total);
    size_t held = held_pages(), evictable = evictable_pages();
    CHECK(stats.held_pages == held, "held pages %zu, expected %zu", stats.held_pages, held);
    CHECK(stats.free_pages == W.total - held - evictable, "free pages %zu, expected %zu",
          stats.free_pages, W.total - held - evictable);
    CHECK(stats.evictable_pages == evictable, "evictable pages %zu, expected %zu",
          stats.evictable_pages, evictable);
    CHECK(stats.cached_pages == cached_pages(), "cached pages %zu, expected %zu",
          stats.cached_pages, cached_pages());
    CHECK(stats.prefix_hits == W.hits && stats.prefix_misses == W.misses,
          "prefix hits %llu misses %llu, expected %llu %llu",
          (unsigned long long)stats.prefix_hits, (unsigned long long)stats.prefix_misses,
          (unsigned long long)W.hits, (unsigned long long)W.misses);
    CHECK(stats.evictions == W.evictions, "evictions %llu, expected %llu",
          (unsigned long long)stats.evictions, (unsigned long long)W.evictions);
    CHECK(stats.cow_copies == W.cow_copies, "cow copies %llu, expected %llu",
          (unsigned long long)stats.cow_copies, (unsigned long long)W.cow_copies);
    CHECK(stats.promised_pages == promised_total(), "promised pages %zu, expected %zu",
          stats.promised_pages, promised_total());
    CHECK(stats.attached_caches == caches, "attached caches %zu, expected %zu",
          stats.attached_caches, caches);
    CHECK(stats.attached_reservations == reservations, "attached reservations %zu, expected %zu",
          stats.attached_reservations, reservations);
    CHECK(stats.acquires == W.acquires, "acquires %llu, expected %llu",
          (unsigned long long)stats.acquires, (unsigned long long)W.acquires);
    CHECK(stats.releases == W.releases, "releases %llu, expected %llu",
          (unsigned long long)stats.releases, (unsigned long long)W.releases);
    CHECK(stats.exhaustions == W.exhaustions, "exhaustions %llu, expected %llu",
          (unsigned long long)stats.exhaustions, (unsigned long long)W.exhaustions);
    CHECK(stats.high_water_pages == W.high_water, "high water %zu, expected %zu",
          stats.high_water_pages, W.high_water);
    status = kvp_pool_check(W.pool, on_mismatch, NULL, &err);
    check_status(status, KVP_OK, &err);
    g_auditing = 0;
}

/* A kvp_error full of a pattern, to prove a successful call left it alone. */
void poison(kvp_error *err)
{
    memset(err, 0xA5, sizeof *err);
}

void check_untouched(const kvp_error *err)
{
    kvp_error pattern;
    poison(&pattern);
    CHECK(memcmp(err, &pattern, sizeof pattern) == 0, "a successful call wrote *err");
}
