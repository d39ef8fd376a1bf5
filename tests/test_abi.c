/*
 * test_abi.c: growing structs (kvpager/pool.h, "Growing structs"). An older
 * caller is emulated by a struct cut to its first-release prefix: the
 * library must read (config, request) or write (stats, info) exactly the bytes the
 * caller's struct_size covers. Each emulated struct is checked twice: at the
 * very end of a heap block of exactly struct_size bytes, so that ASan (debug
 * preset) and memcheck (release preset) catch any access past it, and
 * followed by guard bytes that must come back unchanged. A zero or too small
 * struct_size is refused with INVALID_ARGUMENT naming it, changing nothing.
 * Unit test: uses internal headers (pager/abi.h and the layers' internal
 * headers, for the first-release sizes).
 */
#include "support.h"

#include <stdlib.h>
#include <string.h>

#include "attention/layer_internal.h"
#include "pager/abi.h"
#include "serve/model_internal.h"
#include "serve/requests_internal.h"
#include "pager/alloc.h"

#define GUARD 0xA5
#define GUARD_BYTES 64

/* A heap block of exactly `size` bytes filled with `fill` (no slack for a stray access). */
static unsigned char *exact_block(size_t size, int fill)
{
    unsigned char *block = malloc(size);
    assert_non_null(block);
    memset(block, fill, size);
    return block;
}

static void assert_guard(const unsigned char *bytes, size_t from, size_t to)
{
    for (size_t i = from; i < to; i++) {
        if (bytes[i] != GUARD) {
            print_error("byte %zu (past struct_size %zu) was written: 0x%02x\n", i, from,
                        bytes[i]);
            fail();
        }
    }
}

static kvp_pool_config small_config(void)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = 4;
    config.heads = 2;
    config.head_width = 8;
    config.budget_bytes = 6 * 2 * 2 * 4 * 8 * sizeof(double);
    return config;
}

static void assert_refused_struct_size(kvp_status status, const kvp_error *err)
{
    assert_int_equal(status, KVP_INVALID_ARGUMENT);
    assert_int_equal(err->status, KVP_INVALID_ARGUMENT);
    assert_string_equal(err->argument, "struct_size");
}

/* The first release of kvp_pool_config is every field up to dtype. */
static void test_abi_first_release_sizes(void **state)
{
    (void)state;
    /* The first release's sizeof (dtype padded to 8): an old caller's struct_size. */
    assert_int_equal(KVPI_POOL_CONFIG_SIZE_FIRST, 6 * sizeof(size_t));
    assert_int_equal(KVPI_POOL_STATS_SIZE_FIRST, offsetof(kvp_pool_stats, element_bytes) +
                                                     sizeof(size_t));
    kvp_pool_config config;
    memset(&config, 0x5A, sizeof config);
    kvp_pool_config_init(&config);
    assert_int_equal(config.struct_size, sizeof config);
    assert_int_equal(config.slab_source, KVP_SLAB_DEFAULT);
    assert_null(config.slab_alloc);
    assert_null(config.slab_free);
    assert_null(config.slab_ctx);
    kvp_pool_stats stats;
    memset(&stats, 0x5A, sizeof stats);
    kvp_pool_stats_init(&stats);
    assert_int_equal(stats.struct_size, sizeof stats);
    assert_int_equal(stats.total_pages, 0);
    kvp_cache_info cache_info;
    kvp_cache_info_init(&cache_info);
    assert_int_equal(cache_info.struct_size, sizeof cache_info);
    kvp_layer_info layer_info;
    kvp_layer_info_init(&layer_info);
    assert_int_equal(layer_info.struct_size, sizeof layer_info);
    kvp_model_info model_info;
    kvp_model_info_init(&model_info);
    assert_int_equal(model_info.struct_size, sizeof model_info);
    /* NULL is ignored. */
    kvp_pool_config_init(NULL);
    kvp_pool_stats_init(NULL);
    kvp_cache_info_init(NULL);
    kvp_layer_info_init(NULL);
    kvp_model_info_init(NULL);
}

/*
 * An old caller's config (first release: no slab fields) is read up to its
 * struct_size only: the slab fields default, whatever lies past it.
 */
static void test_abi_pool_config_old_caller(void **state)
{
    (void)state;
    kvp_pool_config full = small_config();
    full.struct_size = KVPI_POOL_CONFIG_SIZE_FIRST;

    /* At the end of an exact heap block: a read past it is a sanitizer or memcheck error. */
    unsigned char *exact = exact_block(KVPI_POOL_CONFIG_SIZE_FIRST, 0);
    memcpy(exact, &full, KVPI_POOL_CONFIG_SIZE_FIRST);
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create((const kvp_pool_config *)(void *)exact, &pool, &err), &err);
    free(exact);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.total_pages, 6);
    assert_int_equal(stats.slab_source, KVP_SLAB_JEMALLOC); /* the default: tests link jemalloc */
    kvpt_destroy_pool(pool);

    /* Followed by guard bytes that would be a custom source with garbage hooks if read. */
    unsigned char guarded[sizeof(kvp_pool_config) + GUARD_BYTES];
    memset(guarded, GUARD, sizeof guarded);
    memcpy(guarded, &full, KVPI_POOL_CONFIG_SIZE_FIRST);
    pool = NULL;
    kvpt_assert_ok(kvp_pool_create((const kvp_pool_config *)(void *)guarded, &pool, &err), &err);
    assert_guard(guarded, KVPI_POOL_CONFIG_SIZE_FIRST, sizeof guarded);
    stats = kvpt_stats(pool);
    assert_int_equal(stats.slab_source, KVP_SLAB_JEMALLOC);
    kvpt_destroy_pool(pool);

    /* A caller whose struct ends right after slab_source gets that source. */
    full.slab_source = KVP_SLAB_MMAP;
    full.struct_size = offsetof(kvp_pool_config, slab_source) + sizeof full.slab_source;
    unsigned char *with_source = exact_block(full.struct_size, 0);
    memcpy(with_source, &full, full.struct_size);
    pool = NULL;
    kvpt_assert_ok(kvp_pool_create((const kvp_pool_config *)(void *)with_source, &pool, &err),
                   &err);
    free(with_source);
    stats = kvpt_stats(pool);
    assert_int_equal(stats.slab_source, KVP_SLAB_MMAP);
    kvpt_destroy_pool(pool);

    /* A struct_size that ends inside a field does not cover it: the default holds. */
    full.struct_size = offsetof(kvp_pool_config, slab_source) + 3;
    pool = NULL;
    kvpt_assert_ok(kvp_pool_create(&full, &pool, &err), &err);
    stats = kvpt_stats(pool);
    assert_int_equal(stats.slab_source, KVP_SLAB_JEMALLOC);
    kvpt_destroy_pool(pool);
}

/* Zero, or below the first release: INVALID_ARGUMENT "struct_size", nothing allocated. */
static void test_abi_pool_config_size_refused(void **state)
{
    (void)state;
    const size_t sizes[] = {0, sizeof(size_t), KVPI_POOL_CONFIG_SIZE_FIRST - 1};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        kvp_pool_config config = small_config();
        config.struct_size = sizes[i];
        kvp_pool *pool = (kvp_pool *)(void *)&config; /* a sentinel that must survive */
        kvp_error err;
        kvpi_fault_arm(0);
        assert_refused_struct_size(kvp_pool_create(&config, &pool, &err), &err);
        assert_ptr_equal(pool, (void *)&config);
        assert_int_equal(kvpi_fault_calls(), 0);
    }
    /* The struct_size check comes before every field check. */
    kvp_pool_config zero = small_config();
    zero.struct_size = 0;
    zero.heads = 0;
    zero.dtype = (kvp_dtype)9;
    kvp_pool *pool = NULL;
    kvp_error err;
    assert_refused_struct_size(kvp_pool_create(&zero, &pool, &err), &err);
    assert_null(pool);
    /* NULL config still comes first. */
    assert_int_equal(kvp_pool_create(NULL, &pool, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "config");
}

/*
 * A newer caller's longer config: accepted when the bytes this library does
 * not know are zero, refused when any is set (a setting it cannot honour).
 */
static void test_abi_pool_config_newer_caller(void **state)
{
    (void)state;
    unsigned char longer[sizeof(kvp_pool_config) + 16];
    memset(longer, 0, sizeof longer);
    kvp_pool_config config = small_config();
    config.struct_size = sizeof longer;
    memcpy(longer, &config, sizeof config);
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create((const kvp_pool_config *)(void *)longer, &pool, &err), &err);
    kvpt_destroy_pool(pool);

    longer[sizeof longer - 1] = 1;
    pool = NULL;
    assert_refused_struct_size(
        kvp_pool_create((const kvp_pool_config *)(void *)longer, &pool, &err), &err);
    assert_null(pool);
}

/*
 * An output struct: fills exactly [0, struct_size) past the struct_size
 * member with the prefix of the full answer, keeps struct_size, and leaves
 * every byte after it alone. `get` fills *out of the given struct size.
 */
typedef kvp_status (*get_fn)(void *ctx, void *out, kvp_error *err);

static void check_output_struct(get_fn get, void *ctx, size_t full_size, size_t first_size)
{
    /* The full answer, from a caller of this library's size. */
    unsigned char *full = exact_block(full_size, 0);
    memcpy(full, &full_size, sizeof full_size);
    kvp_error err;
    kvpt_assert_ok(get(ctx, full, &err), &err);

    /* The first release's caller, at the end of an exact heap block. */
    unsigned char *exact = exact_block(first_size, 0);
    memcpy(exact, &first_size, sizeof first_size);
    kvpt_assert_ok(get(ctx, exact, &err), &err);
    assert_memory_equal(exact + sizeof(size_t), full + sizeof(size_t),
                        first_size - sizeof(size_t));
    size_t kept;
    memcpy(&kept, exact, sizeof kept);
    assert_int_equal(kept, first_size);
    free(exact);

    /* Every prefix size from the first release up, followed by guard bytes. */
    unsigned char guarded[1024];
    assert_true(full_size + GUARD_BYTES <= sizeof guarded);
    for (size_t size = first_size; size <= full_size + GUARD_BYTES; size++) {
        memset(guarded, GUARD, sizeof guarded);
        memcpy(guarded, &size, sizeof size);
        kvpt_assert_ok(get(ctx, guarded, &err), &err);
        size_t written = size < full_size ? size : full_size;
        assert_memory_equal(guarded + sizeof(size_t), full + sizeof(size_t),
                            written - sizeof(size_t));
        assert_guard(guarded, written, sizeof guarded);
        memcpy(&kept, guarded, sizeof kept);
        assert_int_equal(kept, size);
    }

    /* Zero or too small: refused, nothing written. */
    const size_t refused[] = {0, 1, first_size - 1};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        memset(guarded, GUARD, sizeof guarded);
        memcpy(guarded, &refused[i], sizeof refused[i]);
        assert_refused_struct_size(get(ctx, guarded, &err), &err);
        assert_guard(guarded, sizeof(size_t), sizeof guarded);
    }
    free(full);
}

static kvp_status get_pool_stats(void *ctx, void *out, kvp_error *err)
{
    return kvp_pool_stats_get(ctx, out, err);
}

static kvp_status get_cache_info(void *ctx, void *out, kvp_error *err)
{
    return kvp_cache_info_get(ctx, out, err);
}

static kvp_status get_layer_info(void *ctx, void *out, kvp_error *err)
{
    return kvp_layer_info_get(ctx, out, err);
}

static kvp_status get_model_info(void *ctx, void *out, kvp_error *err)
{
    return kvp_model_info_get(ctx, out, err);
}

static void test_abi_pool_stats_old_caller(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(4, 2, 8, 6);
    check_output_struct(get_pool_stats, pool, sizeof(kvp_pool_stats),
                        KVPI_POOL_STATS_SIZE_FIRST);
    /* The first release's caller gets the counters (not the slab source). */
    unsigned char old[sizeof(kvp_pool_stats)];
    memset(old, GUARD, sizeof old);
    size_t first = KVPI_POOL_STATS_SIZE_FIRST;
    memcpy(old, &first, sizeof first);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_stats_get(pool, (kvp_pool_stats *)(void *)old, &err), &err);
    kvp_pool_stats view;
    memcpy(&view, old, first);
    assert_int_equal(view.total_pages, 6);
    assert_int_equal(view.free_pages, 6);
    assert_int_equal(view.element_bytes, sizeof(double));
    assert_guard(old, first, sizeof old);
    kvpt_destroy_pool(pool);
}

static void test_abi_info_structs(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(4, 2, 8, 6);
    kvp_binding binding = kvpt_binding(2, 8, 64);
    kvp_cache *cache = kvpt_cache(pool, &binding, 1, 16);
    check_output_struct(get_cache_info, cache, sizeof(kvp_cache_info),
                        KVPI_CACHE_INFO_SIZE_FIRST);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);

    kvp_layer *layer = kvpt_random_layer(16, 2, 64, 10000.0, 7);
    check_output_struct(get_layer_info, layer, sizeof(kvp_layer_info),
                        KVPI_LAYER_INFO_SIZE_FIRST);
    kvpt_destroy_layer(layer);

    kvp_model *model = kvpt_random_model(2, 16, 2, 64, 10000.0, 7);
    check_output_struct(get_model_info, model, sizeof(kvp_model_info),
                        KVPI_MODEL_INFO_SIZE_FIRST);
    kvpt_destroy_model(model);
}

/*
 * An old caller's scheduler config (first release: no schedule) is read up
 * to its struct_size only: the schedule defaults to FCFS, whatever lies past
 * it (guard bytes there would be an invalid schedule, refused, if read).
 */
static void test_abi_scheduler_config_old_caller(void **state)
{
    (void)state;
    assert_int_equal(KVPI_SCHEDULER_CONFIG_SIZE_FIRST, 8 * sizeof(uint64_t));
    kvp_pool_config pool_config = small_config();
    kvp_pool *pool = NULL;
    kvp_model *model = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&pool_config, &pool, &err), &err);
    kvpt_assert_ok(kvp_model_create_random_grouped(1, 16, 2, 2, 8, 10000.0, 1, &model, &err),
                   &err);
    kvp_scheduler_config full;
    kvp_scheduler_config_init(&full);
    assert_int_equal(full.schedule, KVP_SCHEDULE_FCFS);
    full.struct_size = KVPI_SCHEDULER_CONFIG_SIZE_FIRST;
    full.capacity = 8;
    full.compute = 0;

    unsigned char *exact = exact_block(KVPI_SCHEDULER_CONFIG_SIZE_FIRST, 0);
    memcpy(exact, &full, KVPI_SCHEDULER_CONFIG_SIZE_FIRST);
    kvp_scheduler *scheduler = NULL;
    kvpt_assert_ok(kvp_scheduler_create(model, pool, NULL,
                                        (const kvp_scheduler_config *)(void *)exact,
                                        &scheduler, &err),
                   &err);
    free(exact);
    kvpt_assert_ok(kvp_scheduler_destroy(scheduler, NULL), NULL);

    unsigned char guarded[sizeof(kvp_scheduler_config) + GUARD_BYTES];
    memset(guarded, GUARD, sizeof guarded);
    memcpy(guarded, &full, KVPI_SCHEDULER_CONFIG_SIZE_FIRST);
    scheduler = NULL;
    kvpt_assert_ok(kvp_scheduler_create(model, pool, NULL,
                                        (const kvp_scheduler_config *)(void *)guarded,
                                        &scheduler, &err),
                   &err);
    assert_guard(guarded, KVPI_SCHEDULER_CONFIG_SIZE_FIRST, sizeof guarded);
    kvpt_assert_ok(kvp_scheduler_destroy(scheduler, NULL), NULL);
    kvpt_assert_ok(kvp_model_destroy(model, NULL), NULL);
    kvpt_destroy_pool(pool);
}

/* After the scheduler: nothing held (published blocks stay evictable), then the pool goes. */
static void destroy_shared_pool(kvp_pool *pool)
{
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvpt_assert_ok(kvp_pool_stats_get(pool, &stats, NULL), NULL);
    assert_int_equal(stats.held_pages, 0);
    assert_int_equal(stats.attached_caches, 0);
    assert_int_equal(stats.free_pages + stats.evictable_pages, stats.total_pages);
    kvpt_assert_ok(kvp_pool_destroy(pool, NULL), NULL);
}

/* Compute off: the rows key the prompt and the decoded blocks only. */
static void abi_rows(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                     size_t width)
{
    (void)ctx;
    for (size_t i = 0; i < width; i++) {
        row[i] = (double)(id * 100 + sample * 10 + position) + (double)i / 16.0;
    }
}

static kvp_status get_scheduler_stats(void *ctx, void *out, kvp_error *err)
{
    return kvp_scheduler_stats_get(ctx, out, err);
}

/* The chain key of one block of fixed input for a fresh external cache of `pool`. */
static kvp_block_key pool_key(kvp_pool *pool)
{
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&binding, 2, 8, 64, 3, 1, &err), &err);
    kvp_cache *cache = kvpt_cache(pool, &binding, 1, 8);
    static const char input[] = "the same block";
    kvp_block_key key;
    kvpt_assert_ok(kvp_block_key_chain(NULL, cache, input, sizeof input, NULL, &key, &err), &err);
    kvpt_destroy_cache(cache, pool);
    return key;
}

static int same_key(kvp_block_key a, kvp_block_key b)
{
    return a.lo == b.lo && a.hi == b.hi;
}

/* A pool made from `config` (any struct_size), its key, and the pool destroyed. */
static kvp_block_key key_of_config(const kvp_pool_config *config)
{
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(config, &pool, &err), &err);
    kvp_block_key key = pool_key(pool);
    kvpt_destroy_pool(pool);
    return key;
}

/*
 * key_secret: two pools given one secret make the same keys, another secret
 * or none (a random one each) other keys. A caller of the release before
 * key_secret (struct_size ends at slab_source) gets a random secret: at the
 * end of an exact heap block, and followed by guard bytes, which are not
 * read as a secret (a pool given 0xA5 bytes makes other keys).
 */
static void test_abi_pool_config_key_secret_old_caller(void **state)
{
    (void)state;
    const size_t slab = KVPI_POOL_CONFIG_SIZE_SLAB;
    assert_int_equal(slab, offsetof(kvp_pool_config, slab_source) + sizeof(uint64_t));
    kvp_pool_config config = small_config();
    for (size_t i = 0; i < KVPT_COUNT_OF(config.key_secret); i++) {
        assert_int_equal(config.key_secret[i], 0); /* the default: random */
    }
    kvp_block_key random1 = key_of_config(&config);
    kvp_block_key random2 = key_of_config(&config);
    assert_false(same_key(random1, random2));
    for (size_t i = 0; i < KVPT_COUNT_OF(config.key_secret); i++) {
        config.key_secret[i] = 0x0123456789abcdefull * (i + 1);
    }
    kvp_block_key shared1 = key_of_config(&config);
    kvp_block_key shared2 = key_of_config(&config);
    assert_true(same_key(shared1, shared2));
    assert_false(same_key(shared1, random1));
    config.key_secret[3] ^= 1;
    assert_false(same_key(key_of_config(&config), shared1));
    memset(config.key_secret, GUARD, sizeof config.key_secret);
    kvp_block_key guard_secret = key_of_config(&config);

    kvp_pool_config old = small_config();
    old.struct_size = slab;
    unsigned char *exact = exact_block(slab, 0);
    memcpy(exact, &old, slab);
    kvp_block_key exact_key = key_of_config((const kvp_pool_config *)(void *)exact);
    free(exact);
    unsigned char guarded[sizeof(kvp_pool_config) + GUARD_BYTES];
    memset(guarded, GUARD, sizeof guarded);
    memcpy(guarded, &old, slab);
    kvp_block_key guarded_key = key_of_config((const kvp_pool_config *)(void *)guarded);
    assert_guard(guarded, slab, sizeof guarded);
    assert_false(same_key(guarded_key, guard_secret));
    assert_false(same_key(guarded_key, exact_key));
    assert_false(same_key(exact_key, shared1));
}

/*
 * A secret is given when any of its bytes is nonzero, wherever that byte
 * is: {1, 2, 3, 4} (each word's high bytes zero, the last byte too), or a
 * single nonzero byte first, in the middle or last. Two pools given the
 * same such secret make the same keys (not a random secret each), and the
 * secrets make keys different from each other's and from a random one.
 */
static void test_abi_pool_config_key_secret_any_byte(void **state)
{
    (void)state;
    static const size_t lone[] = {0, 13, KVP_KEY_SECRET_BYTES - 1};
    enum { SECRETS = KVPT_COUNT_OF(lone) + 1 };
    kvp_block_key keys[SECRETS + 1];
    for (size_t k = 0; k < SECRETS; k++) {
        kvp_pool_config config = small_config();
        if (k == 0) {
            for (size_t i = 0; i < KVPT_COUNT_OF(config.key_secret); i++) {
                config.key_secret[i] = i + 1;
            }
        } else {
            ((unsigned char *)config.key_secret)[lone[k - 1]] = 0x5a;
        }
        keys[k] = key_of_config(&config);
        assert_true(same_key(key_of_config(&config), keys[k]));
    }
    kvp_pool_config unset = small_config(); /* all zero: a random secret each */
    keys[SECRETS] = key_of_config(&unset);
    assert_false(same_key(key_of_config(&unset), keys[SECRETS]));
    for (size_t a = 0; a <= SECRETS; a++) {
        for (size_t b = a + 1; b <= SECRETS; b++) {
            assert_false(same_key(keys[a], keys[b]));
        }
    }
}

/* An idle scheduler's step (nothing runs or waits, a session kept for long): the same each time. */
static kvp_status get_step_stats(void *ctx, void *out, kvp_error *err)
{
    return kvp_scheduler_step(ctx, out, err);
}

/* A scheduler (compute off, sharing on) that keeps finished sessions for 100000 steps. */
/* A request of 4 prompt tokens and 2 new ones, rows from abi_rows, of `session`. */
static kvp_request abi_request(uint64_t session)
{
    kvp_request request;
    kvp_request_init(&request);
    assert_int_equal(request.session, 0); /* the default */
    request.prompt_tokens = 4;
    request.max_new_tokens = 2;
    request.input = abi_rows;
    request.session = session;
    return request;
}

/* A pool, a one-layer model and a compute-off scheduler that keeps every session. */
typedef struct session_world {
    kvp_pool *pool;
    kvp_model *model;
    kvp_scheduler *scheduler;
} session_world;

static session_world session_world_make(void)
{
    session_world w;
    kvp_pool_config pool_config = small_config();
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&pool_config, &w.pool, &err), &err);
    kvpt_assert_ok(kvp_model_create_random_grouped(1, 16, 2, 2, 8, 10000.0, 1, &w.model, &err),
                   &err);
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    config.capacity = 8;
    config.compute = 0;
    config.watermark = 0.0;
    config.reserve_tokens = 2;
    config.session_ttl = 100000;
    config.session_fraction = 1.0;
    w.scheduler = NULL;
    kvpt_assert_ok(kvp_scheduler_create(w.model, w.pool, NULL, &config, &w.scheduler, &err),
                   &err);
    return w;
}

static void session_world_free(session_world *w)
{
    kvpt_assert_ok(kvp_scheduler_destroy(w->scheduler, NULL), NULL);
    kvpt_assert_ok(kvp_model_destroy(w->model, NULL), NULL);
    destroy_shared_pool(w->pool);
}

/* Submits `request` (of any struct_size) and steps until nothing runs or waits. */
static void run_request(kvp_scheduler *scheduler, const kvp_request *request, uint64_t want_id)
{
    uint64_t id = UINT64_MAX;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_submit(scheduler, request, &id, &err), &err);
    assert_int_equal(id, want_id);
    for (size_t i = 0; i < 16; i++) {
        kvpt_assert_ok(kvp_scheduler_step(scheduler, NULL, &err), &err);
        kvp_scheduler_stats stats;
        kvp_scheduler_stats_init(&stats);
        kvpt_assert_ok(kvp_scheduler_stats_get(scheduler, &stats, &err), &err);
        if (stats.running == 0 && stats.waiting == 0) {
            return;
        }
    }
    fail();
}

static kvp_scheduler_stats scheduler_stats(const kvp_scheduler *scheduler)
{
    kvp_scheduler_stats stats;
    kvp_scheduler_stats_init(&stats);
    kvpt_assert_ok(kvp_scheduler_stats_get(scheduler, &stats, NULL), NULL);
    return stats;
}

/*
 * An old caller's kvp_request (first release: no session) is read up to its
 * struct_size only: at the end of an exact heap block it is accepted, and
 * followed by guard bytes (a nonzero session, if read) its request keeps
 * nothing for a session, where a full request naming that session does.
 * Too small a struct_size is refused, nothing submitted.
 */
static void test_abi_request_old_caller(void **state)
{
    (void)state;
    const size_t first = KVPI_REQUEST_SIZE_FIRST;
    assert_int_equal(first, offsetof(kvp_request, session));
    session_world w = session_world_make();
    kvp_scheduler *scheduler = w.scheduler;
    kvp_error err;
    kvp_request full = abi_request(0);
    full.struct_size = first;

    unsigned char *exact = exact_block(first, 0);
    memcpy(exact, &full, first);
    run_request(scheduler, (const kvp_request *)(void *)exact, 0);
    free(exact);

    unsigned char guarded[sizeof(kvp_request) + GUARD_BYTES];
    memset(guarded, GUARD, sizeof guarded);
    memcpy(guarded, &full, first);
    run_request(scheduler, (const kvp_request *)(void *)guarded, 1);
    assert_guard(guarded, first, sizeof guarded);
    kvp_scheduler_stats stats = scheduler_stats(scheduler);
    assert_int_equal(stats.completed, 2);
    assert_int_equal(stats.session_keeps, 0); /* the guard bytes were not read as a session */
    assert_int_equal(stats.retained, 0);

    /* The same session, named by a caller of this library's size, is kept. */
    memcpy(&full.session, guarded + first, sizeof full.session);
    full.struct_size = sizeof full;
    run_request(scheduler, &full, 2);
    stats = scheduler_stats(scheduler);
    assert_int_equal(stats.session_keeps, 1);
    assert_int_equal(stats.retained, 1);
    assert_int_equal(stats.retained_pages, 2); /* 6 tokens: 2 blocks x 1 layer */

    /* Zero or too small: refused, nothing submitted. */
    const size_t refused[] = {0, 1, first - 1};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        full.struct_size = refused[i];
        uint64_t id = UINT64_MAX;
        assert_refused_struct_size(kvp_scheduler_submit(scheduler, &full, &id, &err), &err);
        assert_int_equal(id, UINT64_MAX);
    }
    assert_int_equal(scheduler_stats(scheduler).submitted, 3);
    session_world_free(&w);
}

/* A 5-token prompt of fixed rows (width 16): its first block is shared between requests. */
static const double *salt_prompt(void)
{
    static double rows[5 * 16];
    for (size_t i = 0; i < KVPT_COUNT_OF(rows); i++) {
        rows[i] = (double)i / 8.0;
    }
    return rows;
}

/*
 * salt: a request of the release before salt (struct_size ends at session)
 * is read up to its struct_size, so guard bytes behind it (a nonzero salt,
 * if read) are no salt: it adopts an unsalted request's block. A request of
 * this library's size naming those bytes as its salt adopts nothing from the
 * unsalted ones, and what a request of its own salt published.
 */
static void test_abi_request_salt_old_caller(void **state)
{
    (void)state;
    const size_t session = KVPI_REQUEST_SIZE_SESSION;
    assert_int_equal(session, offsetof(kvp_request, session) + sizeof(uint64_t));
    session_world w = session_world_make();
    kvp_scheduler *scheduler = w.scheduler;
    kvp_request full = abi_request(0);
    assert_true(full.salt.lo == 0 && full.salt.hi == 0); /* the default: none */
    full.prompt_tokens = 5;
    full.prompt = salt_prompt();
    run_request(scheduler, &full, 0); /* unsalted: publishes its first block */
    assert_int_equal(scheduler_stats(scheduler).prefix_hit_tokens, 0);

    unsigned char guarded[sizeof(kvp_request) + GUARD_BYTES];
    memset(guarded, GUARD, sizeof guarded);
    full.struct_size = session;
    memcpy(guarded, &full, session);
    run_request(scheduler, (const kvp_request *)(void *)guarded, 1);
    assert_guard(guarded, session, sizeof guarded);
    assert_int_equal(scheduler_stats(scheduler).prefix_hit_tokens, 4); /* no salt read */

    full.struct_size = sizeof full;
    memcpy(&full.salt, guarded + session, sizeof full.salt);
    run_request(scheduler, &full, 2);
    assert_int_equal(scheduler_stats(scheduler).prefix_hit_tokens, 4); /* salted: no hit */
    run_request(scheduler, &full, 3);
    assert_int_equal(scheduler_stats(scheduler).prefix_hit_tokens, 8); /* its own salt's */
    session_world_free(&w);
}

/*
 * The scheduler's output structs: a first-release kvp_step_stats or
 * kvp_scheduler_stats (no session fields) is written only up to its
 * struct_size, while a session is kept (the later fields nonzero).
 */
static void test_abi_scheduler_stats_old_caller(void **state)
{
    (void)state;
    assert_int_equal(KVPI_STEP_STATS_SIZE_FIRST, offsetof(kvp_step_stats, retained_pages));
    assert_int_equal(KVPI_SCHEDULER_STATS_SIZE_FIRST, offsetof(kvp_scheduler_stats, retained));
    session_world w = session_world_make();
    kvp_scheduler *scheduler = w.scheduler;
    kvp_error err;
    kvp_request request = abi_request(9);
    run_request(scheduler, &request, 0);
    assert_int_equal(scheduler_stats(scheduler).retained_pages, 2);
    check_output_struct(get_scheduler_stats, scheduler, sizeof(kvp_scheduler_stats),
                        KVPI_SCHEDULER_STATS_SIZE_FIRST);
    check_output_struct(get_step_stats, scheduler, sizeof(kvp_step_stats),
                        KVPI_STEP_STATS_SIZE_FIRST);
    kvp_step_stats step;
    kvp_step_stats_init(&step);
    kvpt_assert_ok(kvp_scheduler_step(scheduler, &step, &err), &err);
    assert_int_equal(step.retained_pages, 2); /* still kept: the later field is real */
    assert_int_equal(step.held_pages, 2);
    session_world_free(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_abi_first_release_sizes),
        cmocka_unit_test(test_abi_pool_config_old_caller),
        cmocka_unit_test(test_abi_pool_config_size_refused),
        cmocka_unit_test(test_abi_pool_config_newer_caller),
        cmocka_unit_test(test_abi_pool_stats_old_caller),
        cmocka_unit_test(test_abi_info_structs),
        cmocka_unit_test(test_abi_scheduler_config_old_caller),
        cmocka_unit_test(test_abi_request_old_caller),
        cmocka_unit_test(test_abi_request_salt_old_caller),
        cmocka_unit_test(test_abi_pool_config_key_secret_old_caller),
        cmocka_unit_test(test_abi_pool_config_key_secret_any_byte),
        cmocka_unit_test(test_abi_scheduler_stats_old_caller),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
