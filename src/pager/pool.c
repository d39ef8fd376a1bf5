/*
 * pool.c: the shared page pool.
 *
 * Owns: the slab, the LIFO free list, per-page reference counts, the
 * counters and the registry of holders (caches and reservations). The
 * audit that recomputes them is audit.c.
 *
 * Invariants (DESIGN.md numbering; kvp_pool_check recomputes all of them):
 *   I1  free_count + evictable + |{p : refcount[p] > 0}| == total_pages
 *   I2  free_stack[0..free_count) has no duplicate, and each entry has
 *       refcount 0
 *   I3  refcount[p] == number of page-table slots and reservation entries
 *       naming p, over every attached holder
 *   I4  (checked by each cache holder) a lane of length len maps exactly
 *       ceil(len / block_tokens) pages, from block 0 on
 *   I5  (prefix.c) the prefix index names registered pages under their own
 *       keys; the LRU list is exactly the registered pages at refcount 0;
 *       (each cache holder) a partial last page that is shared or registered
 *       is marked copy-on-write
 *   and the counters: acquires - releases + tentative == held pages, and
 *   high water >= held - tentative.
 *
 * Tentative pages are taken by a transaction that may still be undone (a
 * prefill): they leave the free list like any page, but acquires and the
 * high-water mark count them only once the transaction is confirmed; undone,
 * they go back and no counter remembers them.
 *
 * Page life:
 *   free --take_locked--> held (refcount 1) --put_locked (refcount 0)--> free
 *   held --ref_locked--> held (refcount + 1: a fork or an adopter shares it)
 *   held, registered --put_locked (refcount 0)--> evictable (LRU, still indexed)
 *   evictable --ref_locked--> held
 *   evictable --take_locked, no free page--> borrowed (held by a reservation,
 *     still indexed but hidden from lookups, off the LRU list; takes use
 *     free pages first)
 *   borrowed --evict_borrowed_locked (the reservation maps it)--> held
 *     (evicted: its index entry dropped, `evictions` + 1)
 *   borrowed --put_locked (returned unused)--> evictable, at its LRU place
 * So a cancelled transaction gives cached pages back exactly; only a page
 * written (mapped) loses its key (pool_internal.h, DESIGN.md "Sharing").
 * Every transition happens under `lock` (see pool_internal.h). Reference
 * counts are written (under the lock) with relaxed atomic stores, so that
 * kvp_pool_page_data can tell a held page without the lock (an atomic load).
 *
 * Callers: the public API (kvpager/pool.h) and src/pager.
 */
#include "pager/pool_internal.h"

#include <sodium.h>
#include <string.h>

#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/dtype.h"
#include "pager/error.h"
#include "pager/track.h"

void kvp_pool_config_init(kvp_pool_config *config)
{
    if (config == NULL) {
        return;
    }
    memset(config, 0, sizeof *config);
    config->struct_size = sizeof *config;
    config->block_tokens = 16;
    config->heads = 8;
    config->head_width = 64;
    config->budget_bytes = (size_t)64 << 20;
    config->dtype = KVP_F64;
    config->slab_source = KVP_SLAB_DEFAULT;
}

void kvp_pool_stats_init(kvp_pool_stats *stats)
{
    if (stats == NULL) {
        return;
    }
    memset(stats, 0, sizeof *stats);
    stats->struct_size = sizeof *stats;
}

const char *kvp_slab_source_name(kvp_slab_source source)
{
    switch (source) {
    case KVP_SLAB_DEFAULT:
        return "default";
    case KVP_SLAB_JEMALLOC:
        return "jemalloc";
    case KVP_SLAB_MMAP:
        return "mmap";
    case KVP_SLAB_CUSTOM:
        return "custom";
    case KVP_SLAB_RESERVED:
        return "reserved";
    default:
        return "unknown";
    }
}

const char *kvp_dtype_name(kvp_dtype dtype)
{
    switch (dtype) {
    case KVP_F64:
        return "f64";
    case KVP_F32:
        return "f32";
    case KVP_BF16:
        return "bf16";
    case KVP_F16:
        return "f16";
    case KVP_FP8_E4M3:
        return "fp8_e4m3";
    default:
        return "unknown";
    }
}

size_t kvp_dtype_bytes(kvp_dtype dtype)
{
    switch (dtype) {
    case KVP_F64:
        return sizeof(double);
    case KVP_F32:
        return sizeof(float);
    case KVP_BF16:
    case KVP_F16:
        return sizeof(uint16_t);
    case KVP_FP8_E4M3:
        return sizeof(uint8_t);
    default:
        return 0;
    }
}

/*
 * The caller's config as this library's struct: the fields its struct_size
 * covers, defaults (kvp_pool_config_init) for the rest. Reads no byte at or
 * past the caller's struct_size.
 */
static kvp_status pool_config_read(const kvp_pool_config *caller, kvp_pool_config *config,
                                   kvp_error *err)
{
    size_t size = caller->struct_size;
    kvp_status status = kvpi_struct_size_check(size, KVPI_POOL_CONFIG_SIZE_FIRST, err);
    if (status != KVP_OK) {
        return status;
    }
    status = kvpi_struct_tail_check(caller, size, sizeof *config, err);
    if (status != KVP_OK) {
        return status;
    }
    kvp_pool_config_init(config);
    memcpy(config, caller, KVPI_POOL_CONFIG_SIZE_FIRST); /* the first release's fields */
#define KVPI_CONFIG_GROWN_(field)                                                        \
    if (kvpi_struct_covers(size, offsetof(kvp_pool_config, field), sizeof config->field)) { \
        config->field = caller->field;                                                   \
    }
    KVPI_CONFIG_GROWN_(slab_alloc)
    KVPI_CONFIG_GROWN_(slab_free)
    KVPI_CONFIG_GROWN_(slab_ctx)
    KVPI_CONFIG_GROWN_(slab_source)
#undef KVPI_CONFIG_GROWN_
    if (kvpi_struct_covers(size, offsetof(kvp_pool_config, key_secret),
                           sizeof config->key_secret)) {
        memcpy(config->key_secret, caller->key_secret, sizeof config->key_secret);
    }
    config->struct_size = sizeof *config;
    return KVP_OK;
}

/*
 * The slab source a create uses (DEFAULT resolved), or the refusal:
 * INVALID_ARGUMENT "slab_source", then NULL_ARGUMENT for a missing hook.
 */
static kvp_status pool_slab_source(const kvp_pool_config *config, kvp_slab_source *out,
                                   kvp_error *err)
{
    int jemalloc = kvpi_slab_jemalloc_available();
    switch (config->slab_source) {
    case KVP_SLAB_DEFAULT:
        *out = jemalloc ? KVP_SLAB_JEMALLOC : KVP_SLAB_MMAP;
        return KVP_OK;
    case KVP_SLAB_JEMALLOC:
        if (!jemalloc) {
            return kvpi_fail_invalid(err, "slab_source",
                                     "KVP_SLAB_JEMALLOC, but jemalloc is not in the process");
        }
        break;
    case KVP_SLAB_MMAP:
    case KVP_SLAB_RESERVED:
        break;
    case KVP_SLAB_CUSTOM:
        if (config->slab_alloc == NULL) {
            return kvpi_fail_null(err, "slab_alloc");
        }
        if (config->slab_free == NULL) {
            return kvpi_fail_null(err, "slab_free");
        }
        break;
    default:
        return kvpi_fail_invalid(err, "slab_source", "must be a kvp_slab_source");
    }
    *out = config->slab_source;
    return KVP_OK;
}

/* Validates sizes and derives the page geometry; see kvp_pool_create's order. */
static kvp_status pool_geometry(const kvp_pool_config *config, kvp_slab_source *source,
                                size_t *page_bytes_out, size_t *total_pages, kvp_error *err)
{
    static const char *const names[] = {"block_tokens", "heads", "head_width", "budget_bytes"};
    const size_t sizes[] = {config->block_tokens, config->heads, config->head_width,
                            config->budget_bytes};
    for (size_t i = 0; i < 4; i++) {
        if (sizes[i] == 0) {
            kvp_error e = kvpi_error_begin(KVP_ZERO_SIZE);
            e.argument = names[i];
            return kvpi_error_emit(err, &e);
        }
    }
    if (kvp_dtype_bytes(config->dtype) == 0) {
        return kvpi_fail_invalid(err, "dtype", KVPI_DTYPE_VALUES);
    }
    kvp_status status = pool_slab_source(config, source, err);
    if (status != KVP_OK) {
        return status;
    }
    kvp_error overflow = kvpi_error_begin(KVP_SIZE_OVERFLOW);
    overflow.block_tokens = config->block_tokens;
    overflow.heads = config->heads;
    overflow.head_width = config->head_width;
    overflow.budget_bytes = config->budget_bytes;
    size_t doubles = 2;
    const size_t factors[] = {config->heads, config->block_tokens, config->head_width,
                              kvp_dtype_bytes(config->dtype)};
    for (size_t i = 0; i < 4; i++) {
        if (doubles > SIZE_MAX / factors[i]) {
            return kvpi_error_emit(err, &overflow);
        }
        doubles *= factors[i];
    }
    size_t page_bytes = doubles; /* the last factor made it bytes */
    size_t pages = config->budget_bytes / page_bytes;
    if (pages == 0) {
        kvp_error e = kvpi_error_begin(KVP_BUDGET_TOO_SMALL);
        e.budget_bytes = config->budget_bytes;
        e.page_bytes = page_bytes;
        return kvpi_error_emit(err, &e);
    }
    if (pages >= (size_t)KVPI_NO_PAGE) {
        return kvpi_error_emit(err, &overflow);
    }
    *page_bytes_out = page_bytes;
    *total_pages = pages;
    return KVP_OK;
}

static pthread_once_t sodium_once = PTHREAD_ONCE_INIT;
static int sodium_ready;

static void sodium_start(void)
{
    sodium_ready = sodium_init() >= 0;
}

/*
 * The pool's key secret: the config's, or KVP_KEY_SECRET_BYTES random bytes
 * when it is all zero. libsodium is initialized once per process
 * (pthread_once: thread-safe, as pool creation is).
 */
static kvp_status pool_secret(const kvp_pool_config *config,
                              unsigned char out[KVP_KEY_SECRET_BYTES], kvp_error *err)
{
    memcpy(out, config->key_secret, KVP_KEY_SECRET_BYTES);
    unsigned char any = 0;
    for (size_t i = 0; i < KVP_KEY_SECRET_BYTES; i++) {
        any |= out[i];
    }
    (void)pthread_once(&sodium_once, sodium_start);
    if (!sodium_ready) {                                            /* GCOVR_EXCL_BR_LINE */
        return kvpi_fail_alloc(err, "key secret (sodium_init)", 0); /* GCOVR_EXCL_LINE */
    }
    if (any == 0) {
        randombytes_buf(out, KVP_KEY_SECRET_BYTES);
    }
    return KVP_OK;
}

kvp_status kvp_pool_create(const kvp_pool_config *caller_config, kvp_pool **out, kvp_error *err)
{
    if (caller_config == NULL) {
        return kvpi_fail_null(err, "config");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_pool_config config_copy;
    kvp_status status = pool_config_read(caller_config, &config_copy, err);
    if (status != KVP_OK) {
        return status;
    }
    const kvp_pool_config *config = &config_copy;
    kvp_slab_source source = KVP_SLAB_DEFAULT;
    size_t page_bytes = 0;
    size_t total = 0;
    status = pool_geometry(config, &source, &page_bytes, &total, err);
    if (status != KVP_OK) {
        return status;
    }
    unsigned char secret[KVP_KEY_SECRET_BYTES];
    status = pool_secret(config, secret, err);
    sodium_memzero(config_copy.key_secret, sizeof config_copy.key_secret);
    if (status != KVP_OK) {
        return status; /* GCOVR_EXCL_LINE: sodium_init cannot fail on Linux */
    }

    kvp_pool *pool = kvpi_calloc(KVPI_SITE_POOL_STRUCT, 1, sizeof *pool);
    if (pool == NULL) {
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_POOL_STRUCT), sizeof *pool);
    }
    /*
     * One allocation: the page keys and binding digests, the LRU stamps,
     * then six uint32 arrays of total entries (free stack, refcounts, audit
     * scratch, registered, LRU links) and the index. total < 2^32, so this
     * cannot overflow size_t on 64-bit.
     */
    size_t slots = kvpi_prefix_slots(total);
    size_t metadata_bytes = total * (2 * sizeof(kvp_block_key) + sizeof(uint64_t)) +
                            (6 * total + slots) * sizeof(uint32_t);
    unsigned char *metadata = kvpi_calloc(KVPI_SITE_POOL_METADATA, 1, metadata_bytes);
    if (metadata == NULL) {
        kvpi_free(pool);
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_POOL_METADATA),
                               metadata_bytes);
    }
    size_t slab_bytes = total * page_bytes; /* <= budget_bytes */
    kvpi_slab slab_from;
    if (kvpi_slab_alloc(source, config->slab_alloc, config->slab_free, config->slab_ctx,
                        slab_bytes, &slab_from) != 0) {
        kvpi_free(metadata);
        kvpi_free(pool);
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_POOL_SLAB), slab_bytes);
    }
    /* glibc's pthread_mutex_init with default attributes cannot fail; POSIX allows it. */
    if (pthread_mutex_init(&pool->lock, NULL) != 0) { /* GCOVR_EXCL_BR_LINE */
        kvpi_slab_free(&slab_from);                    /* GCOVR_EXCL_LINE */
        kvpi_free(metadata);                           /* GCOVR_EXCL_LINE */
        kvpi_free(pool);                               /* GCOVR_EXCL_LINE */
        return kvpi_fail_alloc(err, "pool mutex", sizeof pool->lock); /* GCOVR_EXCL_LINE */
    }
    pool->block_tokens = config->block_tokens;
    pool->heads = config->heads;
    pool->head_width = config->head_width;
    pool->dtype = config->dtype;
    pool->element_bytes = kvp_dtype_bytes(config->dtype);
    pool->page_bytes = page_bytes;
    pool->total_pages = total;
    void *slab = slab_from.base;
    pool->slab = slab;
    pool->slab_from = slab_from;
    pool->metadata = metadata;
    memcpy(pool->key_secret, secret, sizeof pool->key_secret);
    sodium_memzero(secret, sizeof secret);
    pool->page_key = (kvp_block_key *)(void *)metadata;
    pool->page_binding = pool->page_key + total;
    pool->lru_stamp = (uint64_t *)(void *)(pool->page_binding + total);
    uint32_t *words = (uint32_t *)(void *)(pool->lru_stamp + total);
    pool->free_stack = words;
    pool->refcount = words + total;
    pool->audit_counts = words + 2 * total;
    pool->registered = words + 3 * total;
    pool->lru_prev = words + 4 * total;
    pool->lru_next = words + 5 * total;
    pool->index = words + 6 * total;
    pool->index_slots = slots;
    kvpi_prefix_init(pool);
    /* The top of the stack is page 0, so pages are handed out 0, 1, 2, ... */
    for (size_t i = 0; i < total; i++) {
        pool->free_stack[i] = (uint32_t)(total - 1 - i);
    }
    pool->free_count = total;
    pool->holders.prev = &pool->holders;
    pool->holders.next = &pool->holders;
    kvpi_track_pool_create(slab, slab_bytes);
    *out = pool;
    return KVP_OK;
}

kvp_status kvp_pool_destroy(kvp_pool *pool, kvp_error *err)
{
    if (pool == NULL) {
        return KVP_OK; /* destroying NULL does nothing, as free(NULL) */
    }
    kvpi_pool_lock(pool);
    size_t held = pool->total_pages - kvpi_pool_available_locked(pool);
    if (pool->attached_caches != 0 || pool->attached_reservations != 0 || held != 0) {
        kvp_error e = kvpi_error_begin(KVP_POOL_BUSY);
        e.attached_caches = pool->attached_caches;
        e.attached_reservations = pool->attached_reservations;
        e.held_pages = held;
        kvpi_pool_unlock(pool);
        return kvpi_error_emit(err, &e);
    }
    kvpi_pool_unlock(pool);
    if (pool->tier != NULL) {
        pool->tier_release(pool); /* waits for the puts in flight */
    }
    pthread_mutex_destroy(&pool->lock);
    size_t slab_bytes = pool->total_pages * pool->page_bytes;
    kvpi_track_pool_destroy(pool->slab, slab_bytes);
    kvpi_slab_free(&pool->slab_from);
    kvpi_free(pool->metadata);
    sodium_memzero(pool->key_secret, sizeof pool->key_secret);
    kvpi_free(pool);
    return KVP_OK;
}

kvp_status kvp_pool_stats_get(kvp_pool *pool, kvp_pool_stats *out, kvp_error *err)
{
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_pool_stats stats;
    memset(&stats, 0, sizeof stats);
    stats.struct_size = sizeof stats;
    kvpi_pool_lock(pool);
    stats.total_pages = pool->total_pages;
    stats.free_pages = pool->free_count;
    stats.held_pages = pool->total_pages - kvpi_pool_available_locked(pool);
    stats.high_water_pages = pool->high_water_pages;
    stats.acquires = pool->acquires;
    stats.releases = pool->releases;
    stats.exhaustions = pool->exhaustions;
    stats.page_bytes = pool->page_bytes;
    stats.slab_bytes = pool->total_pages * pool->page_bytes;
    stats.attached_caches = pool->attached_caches;
    stats.attached_reservations = pool->attached_reservations;
    stats.slab_address = (uintptr_t)pool->slab;
    stats.promised_pages = pool->promised;
    stats.tentative_pages = pool->tentative;
    stats.dtype = pool->dtype;
    stats.element_bytes = pool->element_bytes;
    stats.slab_source = pool->slab_from.source;
    stats.cached_pages = pool->cached;
    stats.evictable_pages = pool->evictable;
    stats.prefix_hits = pool->prefix_hits;
    stats.prefix_misses = pool->prefix_misses;
    stats.evictions = pool->evictions;
    stats.cow_copies = pool->cow_copies;
    stats.window_releases = pool->window_releases;
    kvpi_pool_unlock(pool);
    return kvpi_struct_out(out, &stats, sizeof stats, KVPI_POOL_STATS_SIZE_FIRST, err);
}

kvp_status kvp_pool_admit(kvp_pool *pool, size_t pages, size_t watermark_pages,
                          kvp_admission *out, kvp_error *err)
{
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_admission admission = KVP_ADMIT_LATER;
    kvpi_pool_lock(pool);
    if (pages > pool->total_pages || watermark_pages > pool->total_pages - pages) {
        admission = KVP_ADMIT_NEVER;
    } else if (kvpi_pool_available_locked(pool) >= pool->promised &&
               kvpi_pool_available_locked(pool) - pool->promised >= pages + watermark_pages) {
        admission = KVP_ADMIT_NOW;
    }
    kvpi_pool_unlock(pool);
    *out = admission;
    return KVP_OK;
}

size_t kvp_pool_pages_for(const kvp_pool *pool, size_t lanes, size_t tokens)
{
    if (pool == NULL) {
        return 0;
    }
    size_t blocks = tokens / pool->block_tokens + (tokens % pool->block_tokens != 0);
    if (blocks != 0 && lanes > SIZE_MAX / blocks) {
        return SIZE_MAX; /* saturate: admission answers NEVER, not a wrapped small count */
    }
    return lanes * blocks;
}

void kvpi_pool_note_commit_locked(kvp_pool *pool, size_t uncovered)
{
    size_t committed = pool->total_pages - kvpi_pool_available_locked(pool) + pool->promised;
    if (committed > pool->commit_high_water) {
        pool->commit_high_water = committed;
    }
    pool->overdrawn += uncovered;
}

void kvpi_pool_promise_set_locked(kvp_pool *pool, size_t *promise, size_t pages)
{
    pool->promised = pool->promised - *promise + pages;
    *promise = pages;
    kvpi_pool_note_commit_locked(pool, 0);
}

void kvpi_pool_promise_consume_locked(kvp_pool *pool, size_t *promise, size_t taken)
{
    size_t consumed = taken < *promise ? taken : *promise;
    *promise -= consumed;
    pool->promised -= consumed;
    kvpi_pool_note_commit_locked(pool, taken - consumed);
}

kvp_status kvpi_pool_fail_no_data(kvp_error *err)
{
    return kvpi_fail_invalid(err, "pool",
                             "its pages hold no data (slab_source KVP_SLAB_RESERVED)");
}

kvp_status kvp_pool_digest(kvp_pool *pool, uint64_t *out, kvp_error *err)
{
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (!kvpi_pool_has_data(pool)) {
        return kvpi_pool_fail_no_data(err);
    }
    kvpi_pool_lock(pool);
    size_t bytes = pool->total_pages * pool->page_bytes;
    const unsigned char *slab = (const unsigned char *)pool->slab;
    uint64_t hash = 0xcbf29ce484222325ull;
    kvpi_track_audit_read_begin(pool->slab, bytes);
    for (size_t i = 0; i < bytes; i++) {
        hash = (hash ^ slab[i]) * 0x100000001b3ull;
    }
    kvpi_track_audit_read_end(pool->slab, bytes, &hash, sizeof hash);
    kvpi_pool_unlock(pool);
    *out = hash;
    return KVP_OK;
}

/* The page format (kvpager/pool.h); geometry never changes after creation. */
static kvp_page_layout page_layout(const kvp_pool *pool)
{
    kvp_page_layout l;
    memset(&l, 0, sizeof l);
    l.struct_size = sizeof l;
    size_t head_stride = pool->block_tokens * pool->head_width;
    l.dtype = pool->dtype;
    l.element_bytes = pool->element_bytes;
    l.heads = pool->heads;
    l.block_tokens = pool->block_tokens;
    l.head_width = pool->head_width;
    l.head_stride = head_stride;
    l.row_stride = pool->head_width;
    l.head_stride_bytes = head_stride * pool->element_bytes;
    l.row_stride_bytes = pool->head_width * pool->element_bytes;
    l.values_offset_bytes = pool->heads * head_stride * pool->element_bytes;
    l.page_bytes = pool->page_bytes;
    return l;
}

kvp_status kvp_pool_page_data(kvp_pool *pool, uint32_t page, const void **keys,
                              const void **values, kvp_page_layout *layout, kvp_error *err)
{
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    if (keys == NULL) {
        return kvpi_fail_null(err, "keys");
    }
    if (values == NULL) {
        return kvpi_fail_null(err, "values");
    }
    if (!kvpi_pool_has_data(pool)) {
        return kvpi_pool_fail_no_data(err);
    }
    if (layout != NULL) {
        kvp_status status = kvpi_struct_size_check(layout->struct_size,
                                                   KVPI_PAGE_LAYOUT_SIZE_FIRST, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    /* total_pages never changes after creation; a page's reference count does. */
    if (page >= pool->total_pages) {
        return kvpi_fail_out_of_range(err, "page", page, pool->total_pages);
    }
    /*
     * A held page is told without the lock (an atomic load: the caller's
     * cache holds it and nobody can free it meanwhile); only a refusal takes
     * the lock, to tell free from evictable consistently.
     */
    if (__atomic_load_n(&pool->refcount[page], __ATOMIC_RELAXED) == 0) {
        kvpi_pool_lock(pool);
        int held = pool->refcount[page] != 0;
        int evictable = !held && pool->registered[page] != 0;
        kvpi_pool_unlock(pool);
        if (!held) {
            kvp_error e = kvpi_error_begin(KVP_PAGE_NOT_HELD);
            e.index = page;
            e.what = evictable ? "evictable" : "free";
            return kvpi_error_emit(err, &e);
        }
    }
    kvp_page_layout l = page_layout(pool);
    const unsigned char *base = kvpi_pool_page(pool, page);
    if (layout != NULL) {
        /* Cannot fail: the struct_size was checked above. */
        (void)kvpi_struct_out(layout, &l, sizeof l, KVPI_PAGE_LAYOUT_SIZE_FIRST, NULL);
    }
    *keys = base;
    *values = base + l.values_offset_bytes;
    return KVP_OK;
}

kvp_status kvp_pool_page_base(const kvp_pool *pool, void **base, size_t *page_stride,
                              size_t *pages, kvp_error *err)
{
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    if (base == NULL) {
        return kvpi_fail_null(err, "base");
    }
    if (page_stride == NULL) {
        return kvpi_fail_null(err, "page_stride");
    }
    if (!kvpi_pool_has_data(pool)) {
        return kvpi_pool_fail_no_data(err);
    }
    /* Fixed at creation: slab, page_bytes and total_pages never change. */
    *base = pool->slab;
    *page_stride = pool->page_bytes;
    if (pages != NULL) {
        *pages = pool->total_pages;
    }
    return KVP_OK;
}

kvp_status kvp_pool_page_layout_get(const kvp_pool *pool, kvp_page_layout *out, kvp_error *err)
{
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_page_layout l = page_layout(pool);
    return kvpi_struct_out(out, &l, sizeof l, KVPI_PAGE_LAYOUT_SIZE_FIRST, err);
}

void kvp_page_layout_init(kvp_page_layout *layout)
{
    if (layout != NULL) {
        memset(layout, 0, sizeof *layout);
        layout->struct_size = sizeof *layout;
    }
}

/* The high-water mark follows held pages that are not tentative. */
static void raise_high_water_locked(kvp_pool *pool)
{
    size_t held = pool->total_pages - kvpi_pool_available_locked(pool) - pool->tentative;
    if (held > pool->high_water_pages) {
        pool->high_water_pages = held;
    }
}

void kvpi_pool_lock(kvp_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
}

void kvpi_pool_unlock(kvp_pool *pool)
{
    pthread_mutex_unlock(&pool->lock);
}

void kvpi_pool_attach_locked(kvp_pool *pool, kvpi_holder *holder)
{
    holder->prev = pool->holders.prev;
    holder->next = &pool->holders;
    pool->holders.prev->next = holder;
    pool->holders.prev = holder;
    if (holder->ops->kind == KVPI_HOLDER_CACHE) {
        pool->attached_caches++;
    } else {
        pool->attached_reservations++;
    }
}

void kvpi_pool_detach_locked(kvp_pool *pool, kvpi_holder *holder)
{
    holder->prev->next = holder->next;
    holder->next->prev = holder->prev;
    holder->prev = NULL;
    holder->next = NULL;
    if (holder->ops->kind == KVPI_HOLDER_CACHE) {
        pool->attached_caches--;
    } else {
        pool->attached_reservations--;
    }
}

/*
 * The only writes of refcount[page]: under the lock, atomic, so that
 * kvp_pool_page_data's unlocked read is not a data race.
 */
static void refcount_store(kvp_pool *pool, uint32_t page, uint32_t count)
{
    __atomic_store_n(&pool->refcount[page], count, __ATOMIC_RELAXED);
}

/* Takes n pages; counted ones raise acquires and the high-water mark now. */
static kvp_status take_pages_locked(kvp_pool *pool, size_t n, uint32_t *out, int tentative,
                                    kvp_error *err)
{
    if (n > kvpi_pool_available_locked(pool)) {
        pool->exhaustions++;
        kvp_error e = kvpi_error_begin(KVP_POOL_EXHAUSTED);
        e.needed = n;
        e.available = kvpi_pool_available_locked(pool);
        return kvpi_error_emit(err, &e);
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t page;
        if (pool->free_count != 0) {
            page = pool->free_stack[--pool->free_count];
            kvpi_track_page_acquired(pool->slab, kvpi_pool_page(pool, page), pool->page_bytes);
        } else {
            /*
             * Borrow the least recently used cached page: it keeps its key,
             * index slot and stamp, hidden from lookups, until its
             * reservation maps it (evicted) or gives it back (restored). Its
             * rows stay defined for Valgrind: a restored page is read again.
             */
            if (pool->tier != NULL) { /* write-back: its rows are still intact */
                pool->tier_write_locked(pool, pool->lru_head, 0);
            }
            page = pool->lru_head;
            kvpi_lru_unlink_locked(pool, page);
            pool->registered[page] = KVPI_PAGE_BORROWED;
        }
        refcount_store(pool, page, 1);
        out[i] = page;
    }
    if (tentative) {
        pool->tentative += n;
    } else {
        pool->acquires += n;
        raise_high_water_locked(pool);
    }
    return KVP_OK;
}

kvp_status kvpi_pool_take_locked(kvp_pool *pool, size_t n, uint32_t *out, kvp_error *err)
{
    return take_pages_locked(pool, n, out, 0, err);
}

kvp_status kvpi_pool_take_tentative_locked(kvp_pool *pool, size_t n, uint32_t *out,
                                           kvp_error *err)
{
    return take_pages_locked(pool, n, out, 1, err);
}

void kvpi_pool_tentative_confirm_locked(kvp_pool *pool, size_t n)
{
    pool->tentative -= n;
    pool->acquires += n;
    raise_high_water_locked(pool);
}

void kvpi_pool_tentative_cancel_locked(kvp_pool *pool, size_t n)
{
    /* The n pages went back through kvpi_pool_put_locked, which counted them. */
    pool->tentative -= n;
    pool->releases -= n;
}

/*
 * A borrowed page comes back unused: visible again at its LRU place, or, when
 * a page published under its key meanwhile holds the key, out of the index.
 * Returns 1 when it went back to the LRU list.
 */
static int restore_borrowed_locked(kvp_pool *pool, uint32_t page)
{
    if (kvpi_prefix_lookup_locked(pool, &pool->page_key[page]) != KVPI_NO_PAGE) {
        kvpi_prefix_remove_locked(pool, page);
        return 0;
    }
    pool->registered[page] = KVPI_PAGE_INDEXED;
    kvpi_lru_restore_locked(pool, page);
    return 1;
}

void kvpi_pool_put_locked(kvp_pool *pool, uint32_t page)
{
    uint32_t left = pool->refcount[page] - 1;
    refcount_store(pool, page, left);
    if (left != 0) {
        return;
    }
    pool->releases++;
    if (pool->registered[page] == KVPI_PAGE_BORROWED) {
        if (restore_borrowed_locked(pool, page)) {
            return;
        }
    } else if (pool->registered[page]) {
        /* Its rows stay valid for a later adopter: no Valgrind release. */
        kvpi_lru_push_locked(pool, page);
        return;
    }
    kvpi_track_page_released(pool->slab, kvpi_pool_page(pool, page));
    pool->free_stack[pool->free_count++] = page;
}

void kvpi_pool_evict_borrowed_locked(kvp_pool *pool, uint32_t page)
{
    if (pool->registered[page] != KVPI_PAGE_BORROWED) {
        return;
    }
    kvpi_prefix_remove_locked(pool, page);
    pool->evictions++;
}

void kvpi_pool_ref_locked(kvp_pool *pool, uint32_t page)
{
    uint32_t count = pool->refcount[page];
    refcount_store(pool, page, count + 1);
    if (count != 0) {
        return;
    }
    /* An evictable page comes back: it counts as acquired again. */
    kvpi_lru_unlink_locked(pool, page);
    pool->acquires++;
    raise_high_water_locked(pool);
    kvpi_pool_note_commit_locked(pool, 0); /* admission counted it, no promise */
}
