/*
 * test_slab.c: the pool's slab sources (kvp_slab_source, pool.h). The
 * default is a jemalloc arena here (test programs link jemalloc); mmap and a
 * caller's hooks serve pools that behave exactly the same: pages are handed
 * out, written, audited, digested and tracked by memcheck (free pages
 * NOACCESS, held pages addressable) whatever the source. A hook is called
 * once per create and once per destroy, with KVP_SLAB_ALIGNMENT; a bad hook
 * answer fails the create and leaves nothing behind. The refusals come in
 * kvp_pool_create's documented order. Unit test: uses internal headers.
 */
#include "support.h"

#include "kvpager/paged.h"

#include <stdlib.h>
#include <string.h>
#include <valgrind/memcheck.h>

#include "pager/alloc.h"
#include "pager/cache_internal.h"
#include "pager/pool_internal.h"
#include "pager/reservation.h"

#define BT 4
#define HEADS 2
#define HD 8
#define PAGES 5
#define PAGE_BYTES (2 * HEADS * BT * HD * sizeof(double))

/* A counting hook: aligned_alloc underneath, or a planted misalignment or failure. */
typedef struct hook {
    size_t alloc_calls;
    size_t free_calls;
    size_t alloc_bytes;
    size_t alloc_alignment;
    size_t free_bytes;
    void *given;   /* what alloc returned */
    void *freed;   /* what free received */
    void *block;   /* the aligned_alloc block behind `given` */
    int misalign;  /* return block + 8 */
    int fail;      /* return NULL */
} hook;

static void *hook_alloc(void *ctx, size_t bytes, size_t alignment)
{
    hook *h = ctx;
    h->alloc_calls++;
    h->alloc_bytes = bytes;
    h->alloc_alignment = alignment;
    if (h->fail) {
        return NULL;
    }
    size_t rounded = (bytes + 2 * alignment - 1) / alignment * alignment; /* room to misalign */
    h->block = aligned_alloc(alignment, rounded);
    h->given = h->misalign ? (char *)h->block + 8 : h->block;
    return h->given;
}

static void hook_free(void *ctx, void *slab, size_t bytes)
{
    hook *h = ctx;
    h->free_calls++;
    h->freed = slab;
    h->free_bytes = bytes;
    free(h->block);
    h->block = NULL;
}

static kvp_pool_config config_for(kvp_slab_source source, hook *h)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BT;
    config.heads = HEADS;
    config.head_width = HD;
    config.budget_bytes = PAGES * PAGE_BYTES + PAGE_BYTES - 1;
    config.slab_source = source;
    if (h != NULL) {
        config.slab_alloc = hook_alloc;
        config.slab_free = hook_free;
        config.slab_ctx = h;
    }
    return config;
}

/*
 * A pool from this source works: pages are handed out and written, the
 * audit and digest pass, and memcheck sees free pages NOACCESS and held ones
 * addressable (the mempool requests of src/pager/track.h).
 */
static void exercise(kvp_pool *pool, kvp_slab_source expected_source)
{
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.slab_source, expected_source);
    assert_int_equal(stats.total_pages, PAGES);
    assert_int_equal(stats.slab_bytes, PAGES * PAGE_BYTES);
    assert_int_equal(stats.slab_address % KVP_SLAB_ALIGNMENT, 0);
    kvpt_assert_pool_ok(pool);

    uint32_t storage[PAGES];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, PAGES);
    kvp_error err;
    kvpt_assert_ok(kvpi_reservation_fill(&res, 2, &err), &err);
    double *held = kvpi_pool_page(pool, storage[0]);
    const double *free_page = kvpi_pool_page(pool, 2);
    char vbits[8];
    if (RUNNING_ON_VALGRIND) {
        assert_int_equal(VALGRIND_GET_VBITS(held, vbits, sizeof vbits), 1);
        assert_int_equal(VALGRIND_GET_VBITS(free_page, vbits, sizeof vbits), 3);
    }
    for (size_t i = 0; i < PAGE_BYTES / sizeof(double); i++) {
        held[i] = (double)i;
    }
    assert_true(held[PAGE_BYTES / sizeof(double) - 1] == (double)(PAGE_BYTES / sizeof(double) - 1));
    uint64_t digest = 0;
    kvpt_assert_ok(kvp_pool_digest(pool, &digest, &err), &err);
    stats = kvpt_stats(pool);
    assert_int_equal(stats.held_pages, 2);
    kvpt_assert_pool_ok(pool);
    kvpi_reservation_release(&res);
    if (RUNNING_ON_VALGRIND) {
        assert_int_equal(VALGRIND_GET_VBITS(held, vbits, sizeof vbits), 3);
    }
    /* Every page once: the whole slab is usable. */
    kvpt_assert_ok(kvpi_reservation_fill(&res, PAGES, &err), &err);
    for (size_t p = 0; p < PAGES; p++) {
        double *page = kvpi_pool_page(pool, storage[p]);
        page[0] = 1.0;
        page[PAGE_BYTES / sizeof(double) - 1] = 2.0;
    }
    kvpi_reservation_release(&res);
}

static void test_slab_default_is_jemalloc_when_linked(void **state)
{
    (void)state;
    assert_true(kvpi_slab_jemalloc_available());
    kvp_pool_config config = config_for(KVP_SLAB_DEFAULT, NULL);
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    exercise(pool, KVP_SLAB_JEMALLOC);
    kvpt_destroy_pool(pool);

    config.slab_source = KVP_SLAB_JEMALLOC;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    exercise(pool, KVP_SLAB_JEMALLOC);
    kvpt_destroy_pool(pool);
}

static void test_slab_mmap(void **state)
{
    (void)state;
    kvp_pool_config config = config_for(KVP_SLAB_MMAP, NULL);
    for (int round = 0; round < 3; round++) {
        kvp_pool *pool = NULL;
        kvp_error err;
        kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
        kvp_pool_stats stats = kvpt_stats(pool);
        assert_int_equal(stats.slab_address % 4096, 0); /* a mapping starts on a page */
        exercise(pool, KVP_SLAB_MMAP);
        kvpt_destroy_pool(pool);
    }
}

static void test_slab_custom_hook_called_once_each_way(void **state)
{
    (void)state;
    hook h;
    memset(&h, 0, sizeof h);
    kvp_pool_config config = config_for(KVP_SLAB_CUSTOM, &h);
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    assert_int_equal(h.alloc_calls, 1);
    assert_int_equal(h.free_calls, 0);
    assert_int_equal(h.alloc_bytes, PAGES * PAGE_BYTES); /* total pages, not the budget */
    assert_int_equal(h.alloc_alignment, KVP_SLAB_ALIGNMENT);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.slab_address, (uintptr_t)h.given);
    exercise(pool, KVP_SLAB_CUSTOM);
    assert_int_equal(h.alloc_calls, 1);
    assert_int_equal(h.free_calls, 0);
    /* A busy destroy frees nothing. */
    uint32_t storage[1];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, 1);
    kvpt_assert_ok(kvpi_reservation_fill(&res, 1, &err), &err);
    assert_int_equal(kvp_pool_destroy(pool, &err), KVP_POOL_BUSY);
    assert_int_equal(h.free_calls, 0);
    kvpi_reservation_release(&res);
    void *given = h.given;
    kvpt_destroy_pool(pool);
    assert_int_equal(h.alloc_calls, 1);
    assert_int_equal(h.free_calls, 1);
    assert_ptr_equal(h.freed, given);
    assert_int_equal(h.free_bytes, PAGES * PAGE_BYTES);
}

/* A misaligned slab goes straight back to the hook; the create fails, nothing leaks. */
static void test_slab_custom_misaligned_or_null_fails(void **state)
{
    (void)state;
    for (int misalign = 0; misalign < 2; misalign++) {
        hook h;
        memset(&h, 0, sizeof h);
        h.misalign = misalign;
        h.fail = !misalign;
        kvp_pool_config config = config_for(KVP_SLAB_CUSTOM, &h);
        kvp_pool *pool = (kvp_pool *)(void *)&h; /* a sentinel that must survive */
        kvp_error err;
        assert_int_equal(kvp_pool_create(&config, &pool, &err), KVP_ALLOCATION_FAILED);
        assert_string_equal(err.what, "page slab");
        assert_int_equal(err.bytes, PAGES * PAGE_BYTES);
        assert_ptr_equal(pool, (void *)&h);
        assert_int_equal(h.alloc_calls, 1);
        assert_int_equal(h.free_calls, misalign ? 1 : 0);
        if (misalign) {
            assert_ptr_equal(h.freed, h.given);
            assert_int_equal(h.free_bytes, PAGES * PAGE_BYTES);
        }
        assert_null(h.block);
    }
}

/* An injected slab fault calls no hook. */
static void test_slab_custom_fault_calls_no_hook(void **state)
{
    (void)state;
    hook h;
    memset(&h, 0, sizeof h);
    kvp_pool_config config = config_for(KVP_SLAB_CUSTOM, &h);
    /* kvp_pool_create allocates the pool struct, its metadata, then the slab. */
    kvpi_fault_arm(3);
    kvp_pool *pool = NULL;
    kvp_error err;
    assert_int_equal(kvp_pool_create(&config, &pool, &err), KVP_ALLOCATION_FAILED);
    assert_true(kvpi_fault_fired());
    assert_int_equal(kvpi_fault_last_site(), KVPI_SITE_POOL_SLAB);
    kvpi_fault_arm(0);
    assert_null(pool);
    assert_int_equal(h.alloc_calls, 0);
    assert_int_equal(h.free_calls, 0);
}

/* The refusals, in kvp_pool_create's order; none calls a hook or allocates. */
static void test_slab_refusals_in_order(void **state)
{
    (void)state;
    hook h;
    memset(&h, 0, sizeof h);
    kvp_pool *pool = NULL;
    kvp_error err;

    kvp_pool_config config = config_for((kvp_slab_source)9, &h);
    kvpi_fault_arm(0);
    assert_int_equal(kvp_pool_create(&config, &pool, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "slab_source");
    /* After the size checks, with the dtype check. */
    config.heads = 0;
    assert_int_equal(kvp_pool_create(&config, &pool, &err), KVP_ZERO_SIZE);
    config.heads = HEADS;
    config.dtype = (kvp_dtype)5;
    assert_int_equal(kvp_pool_create(&config, &pool, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "dtype");

    config = config_for(KVP_SLAB_CUSTOM, &h);
    config.slab_alloc = NULL;
    assert_int_equal(kvp_pool_create(&config, &pool, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "slab_alloc");
    config.slab_alloc = hook_alloc;
    config.slab_free = NULL;
    assert_int_equal(kvp_pool_create(&config, &pool, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "slab_free");
    /* Before the overflow and budget checks. */
    config.budget_bytes = 1;
    assert_int_equal(kvp_pool_create(&config, &pool, &err), KVP_NULL_ARGUMENT);
    config.slab_free = hook_free;
    assert_int_equal(kvp_pool_create(&config, &pool, &err), KVP_BUDGET_TOO_SMALL);

    /* The hooks are read only for KVP_SLAB_CUSTOM. */
    assert_int_equal(kvpi_fault_calls(), 0); /* no refusal allocated anything */
    config = config_for(KVP_SLAB_MMAP, &h);
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    assert_int_equal(kvpi_fault_calls(), 3); /* pool struct, metadata, slab */
    kvpt_destroy_pool(pool);
    assert_int_equal(h.alloc_calls, 0);
    assert_int_equal(h.free_calls, 0);
}

static void test_slab_source_names(void **state)
{
    (void)state;
    assert_string_equal(kvp_slab_source_name(KVP_SLAB_DEFAULT), "default");
    assert_string_equal(kvp_slab_source_name(KVP_SLAB_JEMALLOC), "jemalloc");
    assert_string_equal(kvp_slab_source_name(KVP_SLAB_MMAP), "mmap");
    assert_string_equal(kvp_slab_source_name(KVP_SLAB_CUSTOM), "custom");
    assert_string_equal(kvp_slab_source_name(KVP_SLAB_RESERVED), "reserved");
    assert_string_equal(kvp_slab_source_name((kvp_slab_source)5), "unknown");
    assert_int_equal(KVP_SLAB_DEFAULT, 0);
    assert_int_equal(KVP_SLAB_JEMALLOC, 1);
    assert_int_equal(KVP_SLAB_MMAP, 2);
    assert_int_equal(KVP_SLAB_CUSTOM, 3);
    assert_int_equal(KVP_SLAB_RESERVED, 4);
}

/* The refusal of every page-data call on a reserved pool: INVALID_ARGUMENT naming the pool. */
static void assert_no_data(kvp_status status, const kvp_error *err)
{
    assert_int_equal(status, KVP_INVALID_ARGUMENT);
    assert_int_equal(err->status, KVP_INVALID_ARGUMENT);
    assert_string_equal(err->argument, "pool");
}

/*
 * KVP_SLAB_RESERVED: a PROT_NONE range, never touched. Pages are taken,
 * held, shared by prefix keys and released as in any pool, and the audit
 * passes; every call that would read or write page data is refused with
 * INVALID_ARGUMENT ("pool"), changing nothing (audited snapshot); the
 * allocator-only commit (no data) works. A budget far past physical memory
 * (1 TiB) is created, used and destroyed: only metadata is allocated.
 */
static void test_slab_reserved_holds_no_data(void **state)
{
    (void)state;
    kvp_pool_config config = config_for(KVP_SLAB_RESERVED, NULL);
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.slab_source, KVP_SLAB_RESERVED);
    assert_int_equal(stats.total_pages, PAGES);
    assert_int_equal(stats.slab_address % 4096, 0);
    kvp_binding binding;
    kvpt_assert_ok(kvp_binding_init_external(&binding, HEADS, HD, 64, 7, 0, &err), &err);
    kvp_cache *cache = NULL;
    kvpt_assert_ok(kvp_cache_create(pool, &binding, 1, 64, &cache, &err), &err);
    kvpt_snapshot snap;
    kvpt_snapshot_init(&snap, pool);
    kvpt_snapshot_add_cache(&snap, cache);
    kvpt_snapshot_take(&snap);
    /* Page data: refused before anything else is read. */
    const void *keys = NULL;
    const void *values = NULL;
    assert_no_data(kvp_pool_page_data(pool, 0, &keys, &values, NULL, &err), &err);
    void *base = NULL;
    size_t stride = 0;
    assert_no_data(kvp_pool_page_base(pool, &base, &stride, NULL, &err), &err);
    assert_null(base);
    uint64_t digest = 0;
    assert_no_data(kvp_pool_digest(pool, &digest, &err), &err);
    assert_no_data(kvp_cache_digest(cache, &digest, &err), &err);
    double rows[2 * HEADS * HD] = {0};
    assert_no_data(kvp_cache_append_rows(cache, rows, rows, 1, &err), &err);
    kvpt_assert_unchanged(&snap, 0);
    /* A reservation is page accounting: allowed; its slots and written commit are not. */
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, BT + 1, &err), &err);
    kvp_slot_span spans[4];
    size_t count = 0;
    assert_no_data(kvp_cache_reserved_slots(cache, 0, spans, 4, &count, &err), &err);
    assert_no_data(kvp_cache_commit_written(cache, 1, &err), &err);
    assert_no_data(kvp_cache_commit_rows(cache, rows, rows, 1, &err), &err);
    assert_int_equal(kvp_cache_reserved_rows(cache), BT + 1);
    /* The allocator alone commits them unwritten: two pages held, the audit passes. */
    kvpt_assert_ok(kvpi_cache_commit_unwritten(cache, BT + 1, &err), &err);
    assert_int_equal(kvp_cache_len(cache), BT + 1);
    assert_int_equal(kvpt_stats(pool).held_pages, 2);
    kvpt_assert_pool_ok(pool);
    /* Its rows are in no memory: attention over them is refused, outputs untouched. */
    double queries[HEADS * HD] = {0};
    double outputs[HEADS * HD];
    memset(outputs, 0x5A, sizeof outputs);
    kvp_paged_attention_args args;
    kvp_paged_attention_args_init(&args);
    args.cache = cache;
    args.queries = queries;
    args.outputs = outputs;
    assert_no_data(kvp_paged_attention(&args, NULL, &err), &err);
    for (size_t i = 0; i < sizeof outputs; i++) {
        assert_int_equal(((unsigned char *)outputs)[i], 0x5A);
    }
    /* A layer-bound cache (a sequence's) would write its rows: refused at create. */
    kvp_model *model = kvpt_random_model(1, HEADS * HD, HEADS, 64, 10000.0, 3);
    kvp_sequence *sequence = NULL;
    assert_no_data(kvp_sequence_create(model, pool, 1, 64, &sequence, &err), &err);
    assert_null(sequence);
    kvpt_assert_ok(kvp_model_destroy(model, NULL), NULL);
    kvpt_assert_ok(kvp_cache_destroy(cache, NULL), NULL);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_pool(pool);

    /* 1 TiB of pages: address space only (not under Valgrind, whose client
       address space is smaller than the range). */
    if (RUNNING_ON_VALGRIND) {
        return;
    }
    config.budget_bytes = (size_t)1 << 40;
    config.block_tokens = 16;
    config.heads = 8;
    config.head_width = 128; /* 256 KiB f64 pages: 4 Mi pages */
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    stats = kvpt_stats(pool);
    assert_int_equal(stats.total_pages, ((size_t)1 << 40) / (2 * 8 * 16 * 128 * 8));
    kvpt_assert_ok(kvp_binding_init_external(&binding, 8, 128, 64, 7, 0, &err), &err);
    kvpt_assert_ok(kvp_cache_create(pool, &binding, 1, 64, &cache, &err), &err);
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 64, &err), &err);
    kvpt_assert_ok(kvpi_cache_commit_unwritten(cache, 64, &err), &err);
    assert_int_equal(kvpt_stats(pool).held_pages, 4);
    kvpt_assert_ok(kvp_cache_destroy(cache, NULL), NULL);
    kvpt_destroy_pool(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_slab_default_is_jemalloc_when_linked),
        cmocka_unit_test(test_slab_mmap),
        cmocka_unit_test(test_slab_custom_hook_called_once_each_way),
        cmocka_unit_test(test_slab_custom_misaligned_or_null_fails),
        cmocka_unit_test(test_slab_custom_fault_calls_no_hook),
        cmocka_unit_test(test_slab_refusals_in_order),
        cmocka_unit_test(test_slab_source_names),
        cmocka_unit_test(test_slab_reserved_holds_no_data),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
