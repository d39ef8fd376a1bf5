/*
 * test_faults.c: allocation fault injection. For pool and cache creation,
 * sweeps N = 1, 2, ... making the Nth allocation fail until the call succeeds;
 * at each failing N asserts the typed error naming the site, the bytes, an
 * untouched out-parameter and an unchanged pool. Leaks of a failed step are
 * caught by the memcheck run of this program (ctest), so every object that
 * is created is destroyed. Also checks that the appends, resets and
 * destruction make no allocation call at all. Unit test: uses pager/alloc.h
 * and the private append (pager/cache_internal.h).
 */
#include "support.h"

#include "pager/alloc.h"
#include "pager/cache_internal.h"

/* A pool of 5 pages of 256 bytes: block_tokens 2, 2 heads of width 4. */
#define SWEEP_PAGE_BYTES (2 * 2 * 2 * 4 * sizeof(double))
#define SWEEP_PAGES 5

/* Stops the sweep at a generous bound, so a broken injector cannot loop. */
#define SWEEP_LIMIT 64

static kvp_pool_config sweep_config(void)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = 2;
    config.heads = 2;
    config.head_width = 4;
    config.budget_bytes = SWEEP_PAGES * SWEEP_PAGE_BYTES + SWEEP_PAGE_BYTES - 1;
    config.dtype = KVP_F64;
    return config;
}

/* A failed step: AllocationFailed naming the site that failed, with its bytes. */
static void assert_step_failed(const kvpt_fault_step *s, uint64_t nth)
{
    kvpt_assert_fault_failed(s, nth);
    assert_string_equal(s->err.what, kvpi_fault_site_name(s->site));
}

static void test_faults_pool_create_sweep(void **state)
{
    (void)state;
    kvp_pool_config config = sweep_config();
    uint64_t failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvp_pool *pool = (kvp_pool *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_pool_create(&config, &pool, &s.err));
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_ptr_not_equal(pool, (kvp_pool *)0x1);
            assert_int_equal(s.calls, failures); /* one allocation call per failing step */
            kvpt_assert_pool_ok(pool);
            kvp_pool_stats stats = kvpt_stats(pool);
            assert_int_equal(stats.total_pages, SWEEP_PAGES);
            assert_int_equal(stats.free_pages, SWEEP_PAGES);
            assert_int_equal(stats.page_bytes, SWEEP_PAGE_BYTES);
            kvpt_destroy_pool(pool);
            break;
        }
        failures++;
        assert_step_failed(&s, nth);
        assert_ptr_equal(pool, (kvp_pool *)0x1); /* out untouched */
    }
    /* The struct, the metadata and the slab at least. */
    assert_true(failures >= 3);
}

/* The sites fail in allocation order, each with the bytes it asked for. */
static void test_faults_pool_create_sites_in_order(void **state)
{
    (void)state;
    kvp_pool_config config = sweep_config();
    static const kvpi_fault_site sites[] = {KVPI_SITE_POOL_STRUCT, KVPI_SITE_POOL_METADATA,
                                            KVPI_SITE_POOL_SLAB};
    static const char *const names[] = {"pool struct", "pool free list and reference counts",
                                        "page slab"};
    /* Page keys and binding digests, LRU stamps, six uint32 arrays of pages
     * (free stack, reference counts, audit scratch, registered, LRU links) and
     * the prefix index, a power of two of at least 2 * pages slots (16 for 5
     * pages). */
    const size_t bytes[] = {0, SWEEP_PAGES * (2 * sizeof(kvp_block_key) + sizeof(uint64_t)) +
                                   (6 * SWEEP_PAGES + 16) * sizeof(uint32_t),
                            SWEEP_PAGES * SWEEP_PAGE_BYTES};
    for (uint64_t nth = 1; nth <= 3; nth++) {
        kvp_pool *pool = (kvp_pool *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_pool_create(&config, &pool, &s.err));
        assert_true(s.fired);
        assert_step_failed(&s, nth);
        assert_int_equal(s.site, sites[nth - 1]);
        assert_string_equal(s.err.what, names[nth - 1]);
        assert_string_equal(kvpi_fault_site_name(sites[nth - 1]), names[nth - 1]);
        if (bytes[nth - 1] != 0) {
            assert_int_equal(s.err.bytes, bytes[nth - 1]);
        }
        assert_ptr_equal(pool, (kvp_pool *)0x1);
    }
    /* Disarmed, nothing fires and the site stays "none". */
    kvpi_fault_arm(0);
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    assert_false(kvpi_fault_fired());
    assert_int_equal(kvpi_fault_last_site(), KVPI_SITE_COUNT_);
    assert_int_equal(kvpi_fault_calls(), 3);
    kvpt_destroy_pool(pool);
    assert_string_equal(kvpi_fault_site_name(KVPI_SITE_COUNT_), "unknown allocation");
}

static void test_faults_cache_create_sweep(void **state)
{
    (void)state;
    enum { BATCH = 3, CAPACITY = 7, BLOCK = 2 };
    kvp_pool *pool = kvpt_pool(BLOCK, 2, 2, 4);
    kvp_binding binding = kvpt_binding(2, 2, 8);
    kvp_pool_stats before = kvpt_stats(pool);
    static const kvpi_fault_site sites[] = {KVPI_SITE_CACHE_STRUCT, KVPI_SITE_CACHE_TABLES};
    /* B page tables of ceil(C / block) entries, B spare entries, as many
     * row-reservation entries as table entries, and B copy-on-write entries. */
    const size_t table_bytes = (2 * BATCH * ((CAPACITY + BLOCK - 1) / BLOCK) + 2 * BATCH) *
                               sizeof(uint32_t);
    uint64_t failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvp_cache *cache = (kvp_cache *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s,
                               kvp_cache_create(pool, &binding, BATCH, CAPACITY, &cache, &s.err));
        kvpt_assert_pool_ok(pool);
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_int_equal(s.calls, failures);
            kvp_pool_stats stats = kvpt_stats(pool);
            assert_int_equal(stats.attached_caches, 1);
            assert_int_equal(stats.free_pages, before.free_pages);
            kvp_cache_info info;
            kvp_cache_info_init(&info);
            kvp_error err;
            kvpt_assert_ok(kvp_cache_info_get(cache, &info, &err), &err);
            assert_int_equal(info.batch_size, BATCH);
            assert_int_equal(info.capacity, CAPACITY);
            assert_int_equal(info.blocks_per_lane, 4);
            kvpt_destroy_cache(cache, pool);
            break;
        }
        failures++;
        assert_step_failed(&s, nth);
        if (nth <= 2) {
            assert_int_equal(s.site, sites[nth - 1]);
        }
        if (s.site == KVPI_SITE_CACHE_TABLES) {
            assert_string_equal(s.err.what, "KV cache page tables");
            assert_int_equal(s.err.bytes, table_bytes);
        }
        assert_ptr_equal(cache, (kvp_cache *)0x1);
        kvp_pool_stats after = kvpt_stats(pool);
        assert_memory_equal(&before, &after, sizeof before);
        assert_int_equal(after.attached_caches, 0);
    }
    assert_true(failures >= 2);
    kvpt_destroy_pool(pool);
}

/*
 * Appends, snapshots, reset, replay and destruction reach no allocation site:
 * the injector counts zero calls, and an armed fault never fires.
 */
static void test_faults_steady_state_makes_no_allocation_call(void **state)
{
    (void)state;
    enum { BATCH = 2, CAPACITY = 5 };
    kvp_pool *pool = kvpt_pool(2, 1, 2, 6);
    kvp_binding binding = kvpt_binding(1, 2, CAPACITY);
    kvp_cache *cache = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_create(pool, &binding, BATCH, CAPACITY, &cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    double rows[BATCH * 2] = {1.0, -2.0, 0.5, 4.0};
    kvp_tensor row = kvp_tensor4(rows, BATCH, 1, 1, 2);
    double snapshot[BATCH * CAPACITY * 2];

    kvpi_fault_arm(1); /* would fail the very first allocation call */
    for (int cycle = 0; cycle < 3; cycle++) {
        for (size_t t = 0; t < CAPACITY; t++) {
            kvpt_assert_ok(kvpi_cache_append(cache, &row, &row, &err), &err);
            kvpt_assert_pool_ok(pool);
        }
        assert_int_equal(kvpi_cache_append(cache, &row, &row, &err), KVP_FULL);
        kvpt_assert_ok(kvp_cache_keys(cache, snapshot, BATCH * CAPACITY * 2, &err), &err);
        assert_true(snapshot[BATCH * CAPACITY * 2 - 1] == 4.0);
        kvpt_assert_ok(kvp_cache_values(cache, snapshot, BATCH * CAPACITY * 2, &err), &err);
        kvpt_assert_ok(kvp_cache_reset(cache, &err), &err);
        kvpt_assert_pool_ok(pool);
    }
    kvpt_assert_ok(kvpi_cache_append(cache, &row, &row, &err), &err);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
    assert_int_equal(kvpi_fault_calls(), 0);
    assert_false(kvpi_fault_fired());
    kvpi_fault_arm(0);
}

/* Zero-byte requests still give a distinct, freeable block, and count as calls. */
static void test_faults_zero_and_overflowing_requests(void **state)
{
    (void)state;
    kvpi_fault_arm(0);
    void *a = kvpi_alloc(KVPI_SITE_SCRATCH, 0);
    void *b = kvpi_calloc(KVPI_SITE_SCRATCH, 0, 8);
    void *c = kvpi_calloc(KVPI_SITE_SCRATCH, 8, 0);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(c);
    assert_int_equal(*(unsigned char *)b, 0);
    assert_int_equal(kvpi_fault_calls(), 3);
    assert_false(kvpi_fault_fired());
    kvpi_free(a);
    kvpi_free(b);
    kvpi_free(c);
    kvpi_free(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_faults_zero_and_overflowing_requests, kvpt_disarm),
        cmocka_unit_test_teardown(test_faults_pool_create_sweep, kvpt_disarm),
        cmocka_unit_test_teardown(test_faults_pool_create_sites_in_order, kvpt_disarm),
        cmocka_unit_test_teardown(test_faults_cache_create_sweep, kvpt_disarm),
        cmocka_unit_test_teardown(test_faults_steady_state_makes_no_allocation_call, kvpt_disarm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
