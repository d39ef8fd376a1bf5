/*
 * test_pool.c: the page pool — creation errors, acquire/release through
 * reservations, exhaustion, LIFO reuse, exact stats, the audit (and that it
 * catches each kind of corruption, calls back only after unlocking, so the
 * callback may call the pool, and passes at most KVP_POOL_CHECK_REPORTS
 * findings while counting all), busy destroy, and the memcheck view of
 * pages. Unit test: uses internal headers.
 */
#include "support.h"

#include <stdio.h>
#include <string.h>
#include <valgrind/memcheck.h>

#include "pager/cache_internal.h"
#include "pager/reservation.h"

#define PAGE_BYTES(bt, h, d) (2 * (h) * (bt) * (d) * sizeof(double))

static void test_pool_create_rejects_zero_sizes(void **state)
{
    (void)state;
    static const char *const fields[] = {"block_tokens", "heads", "head_width", "budget_bytes"};
    for (size_t field = 0; field < 4; field++) {
        kvp_pool_config config;
        kvp_pool_config_init(&config);
        config.block_tokens = 4;
        config.heads = 2;
        config.head_width = 8;
        config.budget_bytes = 1 << 20;
        config.dtype = KVP_F64;
        size_t *sizes[] = {&config.block_tokens, &config.heads, &config.head_width,
                           &config.budget_bytes};
        *sizes[field] = 0;
        kvp_pool *pool = (kvp_pool *)0x1;
        kvp_error err;
        assert_int_equal(kvp_pool_create(&config, &pool, &err), KVP_ZERO_SIZE);
        assert_int_equal(err.status, KVP_ZERO_SIZE);
        assert_string_equal(err.argument, fields[field]);
        assert_ptr_equal(pool, (kvp_pool *)0x1); /* out untouched on failure */
        char expected[128];
        snprintf(expected, sizeof expected, "page pool %s must be nonzero", fields[field]);
        kvpt_assert_error_text(&err, expected);
    }
}

static void test_pool_create_rejects_overflow_and_small_budget(void **state)
{
    (void)state;
    kvp_pool *pool = NULL;
    kvp_error err;
    kvp_pool_config huge;
    kvp_pool_config_init(&huge);
    huge.block_tokens = SIZE_MAX / 4;
    huge.heads = 2;
    huge.head_width = 2;
    huge.budget_bytes = 1 << 20;
    huge.dtype = KVP_F64;
    assert_int_equal(kvp_pool_create(&huge, &pool, &err), KVP_SIZE_OVERFLOW);
    assert_int_equal(err.block_tokens, SIZE_MAX / 4);
    assert_null(pool);

    /* More pages than a 32-bit page id can name. */
    kvp_pool_config many;
    kvp_pool_config_init(&many);
    many.block_tokens = 1;
    many.heads = 1;
    many.head_width = 1;
    many.budget_bytes = (size_t)16 << 32;
    many.dtype = KVP_F64;
    assert_int_equal(kvp_pool_create(&many, &pool, &err), KVP_SIZE_OVERFLOW);

    kvp_pool_config small;
    kvp_pool_config_init(&small);
    small.block_tokens = 4;
    small.heads = 2;
    small.head_width = 8;
    small.budget_bytes = PAGE_BYTES(4, 2, 8) - 1;
    small.dtype = KVP_F64;
    assert_int_equal(kvp_pool_create(&small, &pool, &err), KVP_BUDGET_TOO_SMALL);
    assert_int_equal(err.page_bytes, PAGE_BYTES(4, 2, 8));
    assert_int_equal(err.budget_bytes, PAGE_BYTES(4, 2, 8) - 1);
    kvpt_assert_error_text(&err, "page pool budget of 1023 bytes is below one page of 1024 bytes");
    assert_null(pool);

    assert_int_equal(kvp_pool_create(NULL, &pool, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "config");
    assert_int_equal(kvp_pool_create(&small, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
}

static void test_pool_page_count_is_budget_over_page_bytes(void **state)
{
    (void)state;
    size_t page = PAGE_BYTES(3, 2, 4); /* 384 */
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = 3;
    config.heads = 2;
    config.head_width = 4;
    config.budget_bytes = 10 * page + page - 1;
    config.dtype = KVP_F64;
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.total_pages, 10);
    assert_int_equal(stats.free_pages, 10);
    assert_int_equal(stats.held_pages, 0);
    assert_int_equal(stats.page_bytes, 384);
    assert_int_equal(stats.slab_bytes, 3840);
    assert_int_equal(stats.high_water_pages, 0);
    assert_int_equal(stats.acquires, 0);
    assert_int_equal(stats.releases, 0);
    assert_int_equal(stats.exhaustions, 0);
    kvpt_destroy_pool(pool);
}

static void test_pool_exactly_n_pages_then_exhausted(void **state)
{
    (void)state;
    enum { N = 7 };
    kvp_pool *pool = kvpt_pool(2, 1, 2, N);
    uint32_t storage[N + 1];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, N + 1);
    kvp_error err;
    for (size_t i = 0; i < N; i++) {
        kvpt_assert_ok(kvpi_reservation_fill(&res, 1, &err), &err);
        assert_int_equal(storage[i], i); /* LIFO stack hands out 0, 1, 2, ... */
        kvp_pool_stats stats = kvpt_stats(pool);
        assert_int_equal(stats.free_pages, N - i - 1);
        assert_int_equal(stats.held_pages, i + 1);
        assert_int_equal(stats.high_water_pages, i + 1);
        assert_int_equal(stats.acquires, i + 1);
        assert_int_equal(stats.attached_reservations, 1);
        kvpt_assert_pool_ok(pool);
    }
    kvp_pool_stats before = kvpt_stats(pool);
    assert_int_equal(kvpi_reservation_fill(&res, 1, &err), KVP_POOL_EXHAUSTED);
    assert_int_equal(err.needed, 1);
    assert_int_equal(err.available, 0);
    kvpt_assert_error_text(&err, "page pool exhausted: 1 pages needed, 0 free");
    kvp_pool_stats after = kvpt_stats(pool);
    assert_int_equal(after.exhaustions, before.exhaustions + 1);
    after.exhaustions = before.exhaustions;
    assert_memory_equal(&before, &after, sizeof before);
    assert_int_equal(kvpi_reservation_remaining(&res), N);
    kvpt_assert_pool_ok(pool);

    kvpi_reservation_release(&res);
    kvp_pool_stats released = kvpt_stats(pool);
    assert_int_equal(released.free_pages, N);
    assert_int_equal(released.releases, N);
    assert_int_equal(released.high_water_pages, N);
    assert_int_equal(released.attached_reservations, 0);
    kvpt_destroy_pool(pool);
}

static void test_pool_take_is_all_or_nothing(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(1, 1, 1, 5);
    uint32_t storage[8];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, 8);
    kvp_error err;
    kvpt_assert_ok(kvpi_reservation_fill(&res, 3, &err), &err);
    kvp_pool_stats before = kvpt_stats(pool);
    assert_int_equal(kvpi_reservation_fill(&res, 3, &err), KVP_POOL_EXHAUSTED);
    assert_int_equal(err.needed, 3);
    assert_int_equal(err.available, 2);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_int_equal(after.free_pages, 2);
    assert_int_equal(after.acquires, before.acquires);
    assert_int_equal(kvpi_reservation_remaining(&res), 3);
    kvpt_assert_pool_ok(pool);
    kvpi_reservation_release(&res);
    kvpt_destroy_pool(pool);
}

static void test_pool_release_acquire_cycles_return_same_page(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(4, 2, 2, 6);
    uint32_t keep_storage[2];
    uint32_t cycle_storage[1];
    kvpi_reservation keep;
    kvpi_reservation cycle;
    kvpi_reservation_init(&keep, pool, keep_storage, 2);
    kvpi_reservation_init(&cycle, pool, cycle_storage, 1);
    kvp_error err;
    kvpt_assert_ok(kvpi_reservation_fill(&keep, 2, &err), &err);
    kvpt_assert_ok(kvpi_reservation_fill(&cycle, 1, &err), &err);
    uint32_t first = cycle_storage[0];
    assert_int_equal(first, 2);
    for (int i = 0; i < 100; i++) {
        kvpi_reservation_release(&cycle);
        kvpt_assert_pool_ok(pool);
        kvpt_assert_ok(kvpi_reservation_fill(&cycle, 1, &err), &err);
        assert_int_equal(cycle_storage[0], first);
        kvp_pool_stats stats = kvpt_stats(pool);
        assert_int_equal(stats.held_pages, 3);
        assert_int_equal(stats.acquires, 3 + (uint64_t)i + 1);
        assert_int_equal(stats.releases, (uint64_t)i + 1);
        assert_int_equal(stats.high_water_pages, 3);
        kvpt_assert_pool_ok(pool);
    }
    kvpi_reservation_release(&cycle);
    kvpi_reservation_release(&keep);
    kvpt_destroy_pool(pool);
}

/*
 * The high-water mark only rises: pages released and fewer taken again leave
 * it at the earlier peak, and a take above the peak raises it exactly.
 */
static void test_pool_high_water_stays_after_release(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 1, 2, 6);
    uint32_t storage[6];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, 6);
    kvp_error err;
    kvpt_assert_ok(kvpi_reservation_fill(&res, 3, &err), &err);
    assert_int_equal(kvpt_stats(pool).high_water_pages, 3);
    kvpi_reservation_release(&res);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats released = kvpt_stats(pool);
    assert_int_equal(released.held_pages, 0);
    assert_int_equal(released.high_water_pages, 3);
    /* Fewer pages than the peak: held 1, the mark stays 3. */
    kvpt_assert_ok(kvpi_reservation_fill(&res, 1, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats lower = kvpt_stats(pool);
    assert_int_equal(lower.held_pages, 1);
    assert_int_equal(lower.high_water_pages, 3);
    /* Back up to 2, still under the peak; then past it to 5. */
    kvpt_assert_ok(kvpi_reservation_fill(&res, 1, &err), &err);
    assert_int_equal(kvpt_stats(pool).high_water_pages, 3);
    kvpt_assert_ok(kvpi_reservation_fill(&res, 3, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).high_water_pages, 5);
    kvpi_reservation_release(&res);
    assert_int_equal(kvpt_stats(pool).high_water_pages, 5);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_pool(pool);
}

/* A fill past the reservation's storage is refused, taking nothing, even when it is not empty. */
static void test_pool_reservation_fill_respects_capacity(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 1, 2, 8);
    uint32_t storage[3];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, 3);
    kvp_error err;
    kvpt_assert_ok(kvpi_reservation_fill(&res, 2, &err), &err);
    kvp_pool_stats before = kvpt_stats(pool);
    assert_int_equal(kvpi_reservation_fill(&res, 2, &err), KVP_INVALID_ARGUMENT);
    kvpt_assert_error_text(&err, "argument `pages` is invalid: more pages than the reservation "
                                 "can hold");
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
    assert_int_equal(kvpi_reservation_remaining(&res), 2);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvpi_reservation_fill(&res, 1, &err), &err); /* exactly full is fine */
    assert_int_equal(kvpi_reservation_remaining(&res), 3);
    kvpt_assert_pool_ok(pool);
    kvpi_reservation_release(&res);
    kvpt_destroy_pool(pool);
}

static void test_pool_destroy_refuses_while_busy(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 2, 2, 4);
    uint32_t storage[2];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, 2);
    kvp_error err;
    kvpt_assert_ok(kvpi_reservation_fill(&res, 2, &err), &err);

    kvp_binding binding = kvpt_binding(2, 2, 64);
    kvp_cache *cache = kvpt_cache(pool, &binding, 1, 8);

    kvp_pool_stats before = kvpt_stats(pool);
    assert_int_equal(kvp_pool_destroy(pool, &err), KVP_POOL_BUSY);
    assert_int_equal(err.attached_caches, 1);
    assert_int_equal(err.attached_reservations, 1);
    assert_int_equal(err.held_pages, 2);
    kvpt_assert_error_text(&err, "page pool is busy: 1 caches attached, 1 reservations held, "
                                 "2 pages held");
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
    kvpt_assert_pool_ok(pool);

    kvpt_destroy_cache(cache, pool);
    assert_int_equal(kvp_pool_destroy(pool, &err), KVP_POOL_BUSY);
    assert_int_equal(err.attached_caches, 0);
    kvpi_reservation_release(&res);
    kvpt_destroy_pool(pool);
}

static void test_pool_null_handles_are_typed_errors(void **state)
{
    (void)state;
    kvp_error err;
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    /* Destroying NULL does nothing, as free(NULL); err is untouched. */
    memset(&err, 0x5A, sizeof err);
    {
        const kvp_error err_before = err;
        assert_int_equal(kvp_pool_destroy(NULL, &err), KVP_OK);
        assert_memory_equal(&err, &err_before, sizeof err);
    }
    assert_int_equal(kvp_pool_stats_get(NULL, &stats, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_pool_check(NULL, NULL, NULL, &err), KVP_NULL_ARGUMENT);
    kvp_pool *pool = kvpt_pool(1, 1, 1, 1);
    assert_int_equal(kvp_pool_stats_get(pool, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    /* err itself is optional. */
    assert_int_equal(kvp_pool_stats_get(pool, NULL, NULL), KVP_NULL_ARGUMENT);
    kvpt_destroy_pool(pool);
}

static int has_invariant(const kvpt_findings *c, kvp_invariant invariant)
{
    for (size_t i = 0; i < c->count && i < KVPT_FINDINGS_KEPT; i++) {
        if (c->items[i].invariant == invariant) {
            return 1;
        }
    }
    return 0;
}

/* Each corruption must be reported, with the right invariant, then repaired. */
static void test_pool_check_reports_every_corruption(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 1, 2, 6);
    kvp_binding binding = kvpt_binding(1, 2, 64);
    kvp_cache *cache = kvpt_cache(pool, &binding, 2, 8);
    kvp_error err;
    uint32_t storage[1];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, 1);
    kvpt_assert_ok(kvpi_reservation_fill(&res, 1, &err), &err);
    kvpt_assert_pool_ok(pool);

    /* I2: a page on the free list twice (and I1 then fails too). */
    uint32_t saved_entry = pool->free_stack[0];
    pool->free_stack[0] = pool->free_stack[1];
    kvpt_findings found = {0};
    assert_int_equal(kvp_pool_check(pool, kvpt_collect_finding, &found, &err), KVP_AUDIT_FAILED);
    assert_true(has_invariant(&found, KVP_INVARIANT_NO_DUPLICATES));
    assert_true(has_invariant(&found, KVP_INVARIANT_CONSERVATION));
    assert_int_equal(err.mismatches, found.count);
    pool->free_stack[0] = saved_entry;
    kvpt_assert_pool_ok(pool);

    /* I3: a held page whose count disagrees with the references to it. */
    pool->refcount[storage[0]] = 2;
    memset(&found, 0, sizeof found);
    assert_int_equal(kvp_pool_check(pool, kvpt_collect_finding, &found, &err), KVP_AUDIT_FAILED);
    assert_true(has_invariant(&found, KVP_INVARIANT_REFERENCES));
    assert_int_equal(err.first_mismatch.page, storage[0]);
    assert_int_equal(err.first_mismatch.expected, 1);
    assert_int_equal(err.first_mismatch.actual, 2);
    kvpt_assert_error_text(&err, "page pool audit found 1 mismatch; first: I3 references: "
                                 "references from page tables and reservations (page 0): "
                                 "expected 1, found 2");
    pool->refcount[storage[0]] = 1;
    kvpt_assert_pool_ok(pool);

    /* I1 / stats: a counter that disagrees with the pages. */
    pool->acquires++;
    memset(&found, 0, sizeof found);
    assert_int_equal(kvp_pool_check(pool, kvpt_collect_finding, &found, &err), KVP_AUDIT_FAILED);
    assert_true(has_invariant(&found, KVP_INVARIANT_STATS));
    pool->acquires--;

    /* I4: a lane whose length says one page but maps none. */
    cache->len = 1;
    memset(&found, 0, sizeof found);
    assert_int_equal(kvp_pool_check(pool, kvpt_collect_finding, &found, &err), KVP_AUDIT_FAILED);
    assert_true(has_invariant(&found, KVP_INVARIANT_LANE_COVERAGE));
    assert_int_equal(found.count, 2); /* both lanes */
    assert_int_equal(found.items[1].lane, 1);
    cache->len = 0;
    kvpt_assert_pool_ok(pool);

    kvpi_reservation_release(&res);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

/* A callback that calls back into the pool it is auditing. */
typedef struct reentrant {
    kvp_pool *pool;
    size_t calls;
    kvp_pool_stats stats[2];
    kvp_status stats_status[2];
    kvp_status nested_check;
    size_t nested_mismatches;
} reentrant;

static void call_pool_back(void *ctx, const kvp_mismatch *m)
{
    (void)m;
    reentrant *r = ctx;
    if (r->calls < 2) {
        kvp_error err;
        kvp_pool_stats_init(&r->stats[r->calls]);
        r->stats_status[r->calls] = kvp_pool_stats_get(r->pool, &r->stats[r->calls], &err);
        if (r->calls == 0) {
            r->nested_check = kvp_pool_check(r->pool, NULL, NULL, &err);
            r->nested_mismatches = err.mismatches;
        }
    }
    r->calls++;
}

/*
 * The callback runs after the audit has released the pool lock: one that
 * calls kvp_pool_stats_get (and even kvp_pool_check) on the pool it audits
 * gets its answers instead of deadlocking. The planted mismatch: a held page
 * whose reference count says 2 (I3), with 3 pages held of 6.
 */
static void test_pool_check_callback_may_call_the_pool(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 1, 2, 6);
    uint32_t storage[3];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, 3);
    kvp_error err;
    kvpt_assert_ok(kvpi_reservation_fill(&res, 3, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats before = kvpt_stats(pool);

    pool->refcount[storage[1]] = 2;
    reentrant r = {.pool = pool, .nested_check = KVP_STATUS_COUNT_};
    assert_int_equal(kvp_pool_check(pool, call_pool_back, &r, &err), KVP_AUDIT_FAILED);
    assert_int_equal(err.mismatches, 1);
    assert_int_equal(r.calls, 1);
    kvpt_assert_ok(r.stats_status[0], NULL);
    assert_int_equal(r.stats[0].total_pages, 6);
    assert_int_equal(r.stats[0].held_pages, 3);
    assert_int_equal(r.stats[0].free_pages, 3);
    assert_memory_equal(&r.stats[0], &before, sizeof before);
    assert_int_equal(r.nested_check, KVP_AUDIT_FAILED);
    assert_int_equal(r.nested_mismatches, 1);
    pool->refcount[storage[1]] = 1;
    kvpt_assert_pool_ok(pool);

    kvpi_reservation_release(&res);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_pool(pool);
}

/* Counts findings; keeps the first two. */
static void count_findings(void *ctx, const kvp_mismatch *m)
{
    kvpt_findings *c = ctx;
    if (c->count < 2) {
        c->items[c->count] = *m;
    }
    c->count++;
}

/*
 * More findings than the audit's fixed array: the callback gets exactly the
 * first KVP_POOL_CHECK_REPORTS, in order; err.mismatches counts all of them.
 * Planted: every page of an idle 100-page pool says it has one reference.
 * Findings, in audit order: 100 free pages with a reference count (I2), then
 * free + held = 200 (I1), acquires - releases = 0 against 100 held, the
 * high-water mark 0 below 100 (stats), and 100 reference counts that no
 * table or reservation accounts for (I3): 203.
 */
static void test_pool_check_reports_the_first_findings_and_counts_all(void **state)
{
    (void)state;
    enum { PAGES = 100 };
    kvp_pool *pool = kvpt_pool(2, 1, 2, PAGES);
    for (size_t p = 0; p < PAGES; p++) {
        pool->refcount[p] = 1;
    }
    kvpt_findings found = {0};
    kvp_error err;
    assert_int_equal(kvp_pool_check(pool, count_findings, &found, &err), KVP_AUDIT_FAILED);
    assert_int_equal(KVP_POOL_CHECK_REPORTS, 64);
    assert_int_equal(found.count, KVP_POOL_CHECK_REPORTS);
    assert_int_equal(err.mismatches, 2 * PAGES + 3);
    assert_int_equal(found.items[0].invariant, KVP_INVARIANT_NO_DUPLICATES);
    assert_string_equal(found.items[0].what, "reference count of a free page");
    assert_int_equal(found.items[0].page, pool->free_stack[0]);
    assert_int_equal(found.items[1].page, pool->free_stack[1]);
    /* Field by field: the struct has padding. */
    assert_int_equal(err.first_mismatch.invariant, found.items[0].invariant);
    assert_ptr_equal(err.first_mismatch.what, found.items[0].what);
    assert_int_equal(err.first_mismatch.page, found.items[0].page);
    assert_int_equal(err.first_mismatch.lane, SIZE_MAX);
    assert_int_equal(err.first_mismatch.expected, 0);
    assert_int_equal(err.first_mismatch.actual, 1);
    for (size_t p = 0; p < PAGES; p++) {
        pool->refcount[p] = 0;
    }
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_pool(pool);
}

/* Plants one corruption, audits with and without a callback, expects `what`, repairs. */
#define expect_corruption(pool, invariant, what) \
    expect_corruption_at((pool), (invariant), (what), __FILE__, __LINE__)
static void expect_corruption_at(kvp_pool *pool, kvp_invariant invariant, const char *what,
                                 const char *file, int line)
{
    kvpt_findings found = {0};
    kvp_error err;
    kvp_pool_stats before = kvpt_stats(pool);
    if (kvp_pool_check(pool, kvpt_collect_finding, &found, &err) != KVP_AUDIT_FAILED ||
        kvp_pool_check(pool, NULL, NULL, &err) != KVP_AUDIT_FAILED) {
        print_error("%s:%d: the audit missed a planted corruption\n", file, line);
        fail();
    }
    int seen = 0;
    for (size_t i = 0; i < found.count && i < KVPT_FINDINGS_KEPT; i++) {
        seen |= found.items[i].invariant == invariant && strcmp(found.items[i].what, what) == 0;
    }
    if (!seen || err.mismatches != found.count) {
        print_error("%s:%d: no \"%s\" among %zu mismatches\n", file, line, what, found.count);
        fail();
    }
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before); /* the audit changes nothing */
}

/* Every check of the audit fires on its own corruption. */
static void test_pool_check_reports_each_check(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 1, 2, 6);
    kvp_binding binding = kvpt_binding(1, 2, 64);
    kvp_cache *cache = kvpt_cache(pool, &binding, 1, 8);
    double row[2] = {1.0, 2.0};
    kvp_tensor key = kvp_tensor4(row, 1, 1, 1, 2);
    kvp_error err;
    for (int t = 0; t < 3; t++) {
        kvpt_assert_ok(kvpi_cache_append(cache, &key, &key, &err), &err);
    }
    kvpt_assert_pool_ok(pool); /* len 3: blocks 0 and 1 mapped */

    uint32_t saved = cache->tables[1];
    cache->tables[1] = 1000; /* a page id past the pool */
    expect_corruption(pool, KVP_INVARIANT_REFERENCES, "page id below total pages");
    cache->tables[1] = saved;

    cache->tables[2] = cache->tables[1]; /* block 2 mapped, block 1 not: same count, a gap */
    cache->tables[1] = KVPI_NO_PAGE;
    expect_corruption(pool, KVP_INVARIANT_LANE_COVERAGE, "pages mapped contiguously from block 0");
    cache->tables[1] = cache->tables[2];
    cache->tables[2] = KVPI_NO_PAGE;

    cache->len = 9; /* past capacity 8 */
    expect_corruption(pool, KVP_INVARIANT_LANE_COVERAGE, "cache length within capacity");
    cache->len = 3;

    saved = pool->free_stack[0];
    pool->free_stack[0] = 999;
    expect_corruption(pool, KVP_INVARIANT_NO_DUPLICATES, "free-list entry is a page id");
    pool->free_stack[0] = saved;

    pool->refcount[saved] = 1; /* a free page with a reference count */
    expect_corruption(pool, KVP_INVARIANT_NO_DUPLICATES, "reference count of a free page");
    pool->refcount[saved] = 0;

    pool->tentative = 5; /* more tentative pages than held */
    expect_corruption(pool, KVP_INVARIANT_STATS, "tentative pages at most held pages");
    pool->tentative = 0;

    pool->high_water_pages = 1;
    expect_corruption(pool, KVP_INVARIANT_STATS,
                      "high-water mark at least held pages that are not tentative");
    pool->high_water_pages = 2;

    pool->attached_caches++;
    expect_corruption(pool, KVP_INVARIANT_STATS, "attached caches");
    pool->attached_caches--;

    pool->attached_reservations++;
    expect_corruption(pool, KVP_INVARIANT_STATS, "attached reservations");
    pool->attached_reservations--;

    /* A reservation linked into the pool while it holds nothing. */
    uint32_t storage[1];
    kvpi_reservation empty;
    kvpi_reservation_init(&empty, pool, storage, 1);
    kvpi_pool_lock(pool);
    kvpi_pool_attach_locked(pool, &empty.holder);
    kvpi_pool_unlock(pool);
    expect_corruption(pool, KVP_INVARIANT_STATS, "an attached reservation holds pages");
    empty.count = 5; /* more entries than its storage: reported, never read */
    expect_corruption(pool, KVP_INVARIANT_STATS, "an attached reservation holds pages");
    empty.count = 0;
    kvpi_pool_lock(pool);
    kvpi_pool_detach_locked(pool, &empty.holder);
    kvpi_pool_unlock(pool);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

/*
 * I4 contiguity, lane by lane: a lane whose page sits at the wrong block maps
 * the right number of pages, yet not from block 0 on. Each lane of a
 * two-lane cache, in a first block and in a later one, is reported with its
 * lane number and the count of pages in place.
 */
static void test_pool_check_reports_a_page_at_the_wrong_block(void **state)
{
    (void)state;
    enum { BT = 2, LANES = 2, CAPACITY = 8 };
    kvp_pool *pool = kvpt_pool(BT, 1, 2, 8);
    kvp_binding binding = kvpt_binding(1, 2, 64);
    kvp_cache *cache = kvpt_cache(pool, &binding, LANES, CAPACITY);
    double row[LANES * 2] = {1.0, 2.0, 3.0, 4.0};
    kvp_tensor key = kvp_tensor4(row, LANES, 1, 1, 2);
    kvp_error err;
    kvpt_assert_ok(kvpi_cache_append(cache, &key, &key, &err), &err);
    kvpt_assert_pool_ok(pool); /* len 1: block 0 of each lane mapped */
    size_t blocks = cache->blocks_per_lane;
    for (size_t lane = 0; lane < LANES; lane++) {
        uint32_t *table = cache->tables + lane * blocks;
        /* The lane's only page at block 1 instead of block 0. */
        table[1] = table[0];
        table[0] = KVPI_NO_PAGE;
        kvpt_findings found = {0};
        assert_int_equal(kvp_pool_check(pool, kvpt_collect_finding, &found, &err), KVP_AUDIT_FAILED);
        assert_int_equal(found.count, 1);
        assert_int_equal(found.items[0].invariant, KVP_INVARIANT_LANE_COVERAGE);
        assert_string_equal(found.items[0].what, "pages mapped contiguously from block 0");
        assert_int_equal(found.items[0].lane, lane);
        assert_int_equal(found.items[0].expected, 1);
        assert_int_equal(found.items[0].actual, 0);
        table[0] = table[1];
        table[1] = KVPI_NO_PAGE;
        kvpt_assert_pool_ok(pool);
    }
    /* len 3: blocks 0 and 1; the second page moved to block 3 in lane 1 only. */
    for (int t = 0; t < 2; t++) {
        kvpt_assert_ok(kvpi_cache_append(cache, &key, &key, &err), &err);
    }
    kvpt_assert_pool_ok(pool);
    uint32_t *table = cache->tables + 1 * blocks;
    table[3] = table[1];
    table[1] = KVPI_NO_PAGE;
    kvpt_findings found = {0};
    assert_int_equal(kvp_pool_check(pool, kvpt_collect_finding, &found, &err), KVP_AUDIT_FAILED);
    assert_int_equal(found.count, 1);
    assert_string_equal(found.items[0].what, "pages mapped contiguously from block 0");
    assert_int_equal(found.items[0].lane, 1);
    assert_int_equal(found.items[0].expected, 2);
    assert_int_equal(found.items[0].actual, 1);
    table[1] = table[3];
    table[3] = KVPI_NO_PAGE;
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

/*
 * The primitives' edges: a page with two references goes back only with its
 * last; a reservation refuses more pages than its storage; destroy refuses a
 * pool whose only holder is a reservation, or whose pages are held by no one.
 */
static void test_pool_primitive_edges(void **state)
{
    (void)state;
    kvp_pool_config_init(NULL); /* ignored, as documented */
    kvp_pool *pool = kvpt_pool(2, 1, 2, 4);
    kvp_error err;
    uint32_t page = 0;
    kvpi_pool_lock(pool);
    kvpt_assert_ok(kvpi_pool_take_locked(pool, 1, &page, &err), &err);
    pool->refcount[page]++; /* a second reference */
    kvpi_pool_put_locked(pool, page);
    assert_int_equal(pool->refcount[page], 1);
    assert_int_equal(pool->free_count, 3);
    kvpi_pool_unlock(pool);
    /* Held by no holder: destroy refuses, naming the held page. */
    assert_int_equal(kvp_pool_destroy(pool, &err), KVP_POOL_BUSY);
    assert_int_equal(err.held_pages, 1);
    assert_int_equal(err.attached_caches, 0);
    assert_int_equal(err.attached_reservations, 0);
    kvpi_pool_lock(pool);
    kvpi_pool_put_locked(pool, page);
    kvpi_pool_unlock(pool);
    kvpt_assert_pool_ok(pool);

    uint32_t storage[2];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, 2);
    kvp_pool_stats before = kvpt_stats(pool);
    assert_int_equal(kvpi_reservation_fill(&res, 3, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "pages");
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
    kvpt_assert_ok(kvpi_reservation_fill(&res, 2, &err), &err);
    assert_int_equal(kvpi_reservation_remaining(&res), 2);
    assert_int_equal(kvp_pool_destroy(pool, &err), KVP_POOL_BUSY);
    assert_int_equal(err.attached_caches, 0);
    assert_int_equal(err.attached_reservations, 1);
    assert_int_equal(err.held_pages, 2);
    kvpi_reservation_release(&res);
    kvpi_reservation_release(&res); /* idempotent */
    /* A reservation that never had a pool releases nothing. */
    kvpi_reservation orphan;
    kvpi_reservation_init(&orphan, NULL, storage, 2);
    kvpi_reservation_release(&orphan);

    /* Tentative pages: counted only once confirmed; cancelled, no counter remembers them. */
    before = kvpt_stats(pool);
    uint32_t pages[2];
    kvpi_pool_lock(pool);
    kvpt_assert_ok(kvpi_pool_take_tentative_locked(pool, 2, pages, &err), &err);
    kvpi_pool_unlock(pool);
    kvp_pool_stats during = kvpt_stats(pool);
    assert_int_equal(during.tentative_pages, 2);
    assert_int_equal(during.held_pages, 2);
    assert_int_equal(during.acquires, before.acquires);
    assert_int_equal(during.high_water_pages, before.high_water_pages);
    kvpi_pool_lock(pool);
    assert_int_equal(kvpi_pool_take_tentative_locked(pool, 3, pages, &err), KVP_POOL_EXHAUSTED);
    kvpi_pool_put_locked(pool, pages[1]);
    kvpi_pool_put_locked(pool, pages[0]);
    kvpi_pool_tentative_cancel_locked(pool, 2);
    kvpi_pool_unlock(pool);
    after = kvpt_stats(pool);
    assert_int_equal(after.exhaustions, before.exhaustions + 1);
    after.exhaustions = before.exhaustions;
    assert_memory_equal(&before, &after, sizeof before);
    kvpt_assert_pool_ok(pool);
    uint32_t three[3];
    kvpi_pool_lock(pool);
    kvpt_assert_ok(kvpi_pool_take_tentative_locked(pool, 3, three, &err), &err);
    kvpi_pool_tentative_confirm_locked(pool, 3);
    kvpi_pool_unlock(pool);
    after = kvpt_stats(pool);
    assert_int_equal(after.acquires, before.acquires + 3);
    assert_int_equal(after.high_water_pages, 3);
    assert_int_equal(after.tentative_pages, 0);
    kvpi_pool_lock(pool);
    for (size_t i = 3; i-- > 0;) {
        kvpi_pool_put_locked(pool, three[i]);
    }
    kvpi_pool_unlock(pool);
    kvpt_destroy_pool(pool);
}

/* Under memcheck, free pages are NOACCESS and held pages addressable. */
static void test_pool_pages_are_tracked_by_memcheck(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 1, 2, 3);
    uint32_t storage[1];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, 1);
    kvp_error err;
    kvpt_assert_ok(kvpi_reservation_fill(&res, 1, &err), &err);
    char vbits[8];
    const double *held = kvpi_pool_page(pool, storage[0]);
    const double *free_page = kvpi_pool_page(pool, 1);
    if (RUNNING_ON_VALGRIND) {
        assert_int_equal(VALGRIND_GET_VBITS(held, vbits, sizeof vbits), 1);
        assert_int_equal(VALGRIND_GET_VBITS(free_page, vbits, sizeof vbits), 3);
    } else {
        assert_int_equal(VALGRIND_GET_VBITS(held, vbits, sizeof vbits), 0);
    }
    kvpi_reservation_release(&res);
    if (RUNNING_ON_VALGRIND) {
        assert_int_equal(VALGRIND_GET_VBITS(held, vbits, sizeof vbits), 3);
    }
    kvpt_destroy_pool(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_create_rejects_zero_sizes),
        cmocka_unit_test(test_pool_create_rejects_overflow_and_small_budget),
        cmocka_unit_test(test_pool_page_count_is_budget_over_page_bytes),
        cmocka_unit_test(test_pool_exactly_n_pages_then_exhausted),
        cmocka_unit_test(test_pool_take_is_all_or_nothing),
        cmocka_unit_test(test_pool_high_water_stays_after_release),
        cmocka_unit_test(test_pool_reservation_fill_respects_capacity),
        cmocka_unit_test(test_pool_release_acquire_cycles_return_same_page),
        cmocka_unit_test(test_pool_destroy_refuses_while_busy),
        cmocka_unit_test(test_pool_null_handles_are_typed_errors),
        cmocka_unit_test(test_pool_check_reports_every_corruption),
        cmocka_unit_test(test_pool_check_reports_each_check),
        cmocka_unit_test(test_pool_check_reports_a_page_at_the_wrong_block),
        cmocka_unit_test(test_pool_check_callback_may_call_the_pool),
        cmocka_unit_test(test_pool_check_reports_the_first_findings_and_counts_all),
        cmocka_unit_test(test_pool_primitive_edges),
        cmocka_unit_test(test_pool_pages_are_tracked_by_memcheck),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
