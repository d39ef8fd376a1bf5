/*
 * cache.c: the paged layer cache (see kvpager/cache.h, cache_internal.h).
 *
 * Owns: page tables, the logical length, the binding captured at creation
 * (and its kind, kvp_binding_is_external), the pages a length needs
 * (kvp_cache_pages_for), and the cache's registration with its pool.
 *
 * Transitions (all under the pool lock; row copies happen before it is taken):
 *   create          tables all KVPI_NO_PAGE, len 0, attached to the pool
 *   commit          len -> len + 1; at a block boundary each lane maps one
 *                   page consumed from a reservation
 *   reset           every page back (newest first), len -> 0
 *   truncate_many   several caches of one sequence back to a shorter len,
 *                   pages returned in the reverse of the order taken
 *   destroy         reset, detach, free
 *   discard_rows    (external caches) the row reservation's pages back, their
 *                   promise restored; the rest of the row transaction is
 *                   external.c's
 *
 * Global state: `next_serial`, the process-wide cache serial counter.
 * Callers: the public API, src/attention and src/serve (through cache_internal.h).
 */
#include "pager/cache_internal.h"

#include <stdatomic.h>
#include <string.h>

#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/dtype.h"
#include "pager/error.h"

/* A binding of the external kind (cache.h). */
int kvp_binding_is_external(const kvp_binding *binding)
{
    return binding != NULL && binding->kind == KVP_BINDING_EXTERNAL;
}

/* The pages `tokens` positions need beyond what the cache maps (cache.h). */
size_t kvp_cache_pages_for(const kvp_cache *cache, size_t tokens)
{
    if (cache == NULL || tokens <= cache->len) {
        return 0;
    }
    size_t bt = cache->block_tokens;
    size_t blocks = tokens / bt + (tokens % bt != 0) - kvpi_cache_mapped_blocks(cache);
    if (blocks != 0 && cache->batch_size > (SIZE_MAX - cache->batch_size) / blocks) {
        return SIZE_MAX; /* saturate, as kvp_pool_pages_for */
    }
    return cache->batch_size * blocks + kvpi_cache_cow_pages(cache);
}

static atomic_uint_fast64_t next_serial = 1;

static void cache_audit(const kvpi_holder *holder, kvpi_audit *audit);

static const kvpi_holder_ops cache_ops = {KVPI_HOLDER_CACHE, cache_audit};

static const kvp_cache *cache_of(const kvpi_holder *holder)
{
    return (const kvp_cache *)(const void *)((const char *)holder - offsetof(kvp_cache, holder));
}

/* I4 for one lane (null entries exactly at released blocks), and I3's references from it. */
static void cache_audit_lane(const kvp_cache *cache, size_t lane, size_t mapped_blocks,
                             kvpi_audit *audit)
{
    const uint32_t *table = kvpi_cache_lane_table(cache, lane);
    size_t expected = 0;
    size_t mapped = 0;
    size_t placed = 0; /* mapped where a page belongs */
    for (size_t block = 0; block < cache->blocks_per_lane; block++) {
        int belongs = block < mapped_blocks && !kvpi_cache_block_released(cache, block);
        expected += belongs;
        if (table[block] == KVPI_NO_PAGE) {
            continue;
        }
        mapped++;
        placed += belongs;
        kvpi_audit_reference(audit, table[block]);
        /* A mapped page was written: it must have left the index (I5). */
        if (table[block] < cache->pool->total_pages &&
            cache->pool->registered[table[block]] == KVPI_PAGE_BORROWED) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX,
                              "a mapped page is not borrowed from the LRU list", table[block],
                              lane, 0, 1);
        }
    }
    if (mapped != expected) {
        kvpi_audit_report(audit, KVP_INVARIANT_LANE_COVERAGE,
                          "pages mapped by a lane, ceil(len / block_tokens)",
                          SIZE_MAX, lane, expected, mapped);
    } else if (placed != mapped) {
        kvpi_audit_report(audit, KVP_INVARIANT_LANE_COVERAGE,
                          "pages mapped contiguously from block 0",
                          SIZE_MAX, lane, mapped, placed);
    }
}

/* I4 for every lane, and I3's references from this cache's page tables. */
static void cache_audit(const kvpi_holder *holder, kvpi_audit *audit)
{
    const kvp_cache *cache = cache_of(holder);
    if (cache->len > cache->capacity) {
        kvpi_audit_report(audit, KVP_INVARIANT_LANE_COVERAGE, "cache length within capacity",
                          SIZE_MAX, SIZE_MAX, cache->capacity, cache->len);
    }
    /*
     * I4 with released blocks: a lane maps every block below ceil(len / bt)
     * except the released ones ([sink_blocks, released_end), null entries),
     * which lie entirely below len - W; nothing past ceil(len / bt).
     */
    size_t mapped_blocks = kvpi_cache_mapped_blocks(cache);
    if (cache->released_end > kvpi_cache_sink_blocks(cache) &&
        cache->released_end > kvpi_cache_live_from(cache, cache->len)) {
        kvpi_audit_report(audit, KVP_INVARIANT_LANE_COVERAGE,
                          "released blocks lie entirely below len - window", SIZE_MAX, SIZE_MAX,
                          kvpi_cache_live_from(cache, cache->len), cache->released_end);
    }
    for (size_t lane = 0; lane < cache->batch_size; lane++) {
        cache_audit_lane(cache, lane, mapped_blocks, audit);
    }
    /* I3: the originals a deferred copy-on-write still holds. */
    for (size_t lane = 0; lane < cache->batch_size; lane++) {
        if (cache->cow_saved[lane] != KVPI_NO_PAGE) {
            kvpi_audit_reference(audit, cache->cow_saved[lane]);
        }
    }
    /*
     * I5: a registered partial last page is copied before it is written; a
     * shared one is written in place only by its one writer (share.c).
     */
    if (cache->len % cache->block_tokens != 0 && !cache->cow) {
        size_t block = cache->len / cache->block_tokens;
        for (size_t lane = 0; lane < cache->batch_size; lane++) {
            uint32_t page = kvpi_cache_lane_table(cache, lane)[block];
            if (page < cache->pool->total_pages && cache->pool->registered[page]) {
                kvpi_audit_report(audit, KVP_INVARIANT_PREFIX,
                                  "a shared or registered partial page is marked copy-on-write",
                                  page, lane, 1, 0);
            } else if (page < cache->pool->total_pages && cache->pool->refcount[page] > 1) {
                kvpi_cache_audit_writer(cache, block, page, audit);
            }
        }
    }
    /* A pending row reservation holds exactly the pages its rows need. */
    size_t reserved = kvpi_reservation_remaining(&cache->row_reservation);
    size_t needed = cache->reserved_rows <= cache->capacity - cache->len
                        ? kvp_cache_pages_for(cache, cache->len + cache->reserved_rows)
                        : SIZE_MAX;
    if (reserved != needed) {
        kvpi_audit_report(audit, KVP_INVARIANT_REFERENCES,
                          "pages reserved for a cache's pending rows", SIZE_MAX, SIZE_MAX, needed,
                          reserved);
    }
}

/*
 * The pager's part of a binding: its kind, the page geometry and the fp8
 * scales. The owner record (digest, revision, record bytes) is the owner's
 * to check: attention checks its rules at every prepare.
 */
static kvp_status validate_binding(const kvp_binding *binding, kvp_error *err)
{
    if ((binding->kind != KVP_BINDING_LAYER && binding->kind != KVP_BINDING_EXTERNAL) ||
        binding->reserved != 0) {
        return kvpi_fail_invalid(err, "binding",
                                 "kind must be KVP_BINDING_LAYER or KVP_BINDING_EXTERNAL, "
                                 "reserved 0");
    }
    if (binding->kv_heads == 0 || binding->head_width == 0) {
        return kvpi_fail_invalid(err, "binding", "kv_heads and head_width must be nonzero");
    }
    return kvpi_binding_check_scales(binding, err);
}

/* The seed's creation checks, in its order, then the pool's geometry. */
static kvp_status validate_create(const kvp_pool *pool, const kvp_binding *binding,
                                  size_t batch_size, size_t capacity, kvp_error *err)
{
    if (batch_size == 0) {
        return kvpi_error_emit(err, &(kvp_error){.status = KVP_ZERO_BATCH_SIZE});
    }
    if (capacity == 0) {
        return kvpi_error_emit(err, &(kvp_error){.status = KVP_ZERO_CAPACITY});
    }
    if (capacity > binding->max_positions) {
        kvp_error e = kvpi_error_begin(KVP_CAPACITY_EXCEEDS_POSITIONS);
        e.capacity = capacity;
        e.max_positions = binding->max_positions;
        return kvpi_error_emit(err, &e);
    }
    kvp_shape full = kvpi_shape4(batch_size, binding->kv_heads, capacity, binding->head_width);
    int overflow = 0;
    (void)kvpi_shape_elements(&full, &overflow);
    if (overflow) {
        kvp_error e = kvpi_error_begin(KVP_ELEMENT_COUNT_OVERFLOW);
        e.batch_size = batch_size;
        e.heads = binding->kv_heads;
        e.capacity = capacity;
        e.head_width = binding->head_width;
        return kvpi_error_emit(err, &e);
    }
    if (binding->kv_heads != pool->heads || binding->head_width != pool->head_width) {
        kvp_error e = kvpi_error_begin(KVP_GEOMETRY_MISMATCH);
        e.pool_geometry = (kvp_geometry){pool->heads, pool->head_width};
        e.binding_geometry = (kvp_geometry){binding->kv_heads, binding->head_width};
        return kvpi_error_emit(err, &e);
    }
    if (!kvpi_pool_has_data(pool) && !kvp_binding_is_external(binding)) {
        return kvpi_pool_fail_no_data(err); /* a layer's cache writes its rows */
    }
    return KVP_OK;
}

kvp_status kvp_cache_create(kvp_pool *pool, const kvp_binding *binding, size_t batch_size,
                            size_t capacity, kvp_cache **out, kvp_error *err)
{
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    if (binding == NULL) {
        return kvpi_fail_null(err, "binding");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_status status = validate_binding(binding, err);
    if (status == KVP_OK) {
        status = validate_create(pool, binding, batch_size, capacity, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    /* ceil(capacity / block_tokens); capacity + block_tokens - 1 could wrap. */
    size_t blocks = capacity / pool->block_tokens + (capacity % pool->block_tokens != 0);
    /*
     * One allocation: the page tables (batch * blocks), the spare entries
     * (batch) and the row reservation's entries (batch * blocks).
     * batch * blocks <= batch * capacity, which the element check bounded, but
     * with heads * head_width == 1 the entries or the byte count can still
     * overflow: such tables could never be allocated.
     */
    size_t lane_room = SIZE_MAX / sizeof(uint32_t) / batch_size; /* entries per lane that fit */
    if (lane_room < 2 || blocks > (lane_room - 2) / 2) {
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_CACHE_TABLES), SIZE_MAX);
    }
    size_t entries = batch_size * (2 * blocks + 2);
    kvp_cache *cache = kvpi_calloc(KVPI_SITE_CACHE_STRUCT, 1, sizeof *cache);
    if (cache == NULL) {
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_CACHE_STRUCT), sizeof *cache);
    }
    uint32_t *tables = kvpi_calloc(KVPI_SITE_CACHE_TABLES, entries, sizeof *tables);
    if (tables == NULL) {
        kvpi_free(cache);
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_CACHE_TABLES),
                               entries * sizeof *tables);
    }
    for (size_t i = 0; i < entries; i++) {
        tables[i] = KVPI_NO_PAGE;
    }
    cache->holder.ops = &cache_ops;
    cache->pool = pool;
    cache->binding = *binding;
    cache->batch_size = batch_size;
    cache->capacity = capacity;
    cache->len = 0;
    cache->heads = binding->kv_heads;
    cache->head_width = binding->head_width;
    cache->block_tokens = pool->block_tokens;
    cache->blocks_per_lane = blocks;
    cache->tables = tables;
    cache->spare_entries = tables + batch_size * blocks;
    kvpi_reservation_init(&cache->spare_reservation, pool, cache->spare_entries, batch_size);
    cache->row_entries = cache->spare_entries + batch_size;
    kvpi_reservation_init(&cache->row_reservation, pool, cache->row_entries, batch_size * blocks);
    cache->cow_saved = cache->row_entries + batch_size * blocks;
    cache->cow = 0;
    cache->cow_defer = 0;
    cache->reserved_rows = 0;
    cache->promise_drawn = 0;
    cache->promise = 0;
    cache->serial = atomic_fetch_add(&next_serial, 1);
    cache->epoch = 0;
    kvpi_cache_window_init(cache, binding);
    kvpi_pool_lock(pool);
    kvpi_pool_attach_locked(pool, &cache->holder);
    kvpi_pool_unlock(pool);
    *out = cache;
    return KVP_OK;
}

/*
 * Under the pool lock: shortens `count` caches of equal length to `len`,
 * unmapping pages block by block from the last, and within a block from the
 * last cache and the last lane: the reverse of the order appends took them.
 */
void kvpi_cache_truncate_many_locked(kvp_cache *const *caches, size_t count, size_t len)
{
    size_t bt = caches[0]->block_tokens;
    size_t mapped = kvpi_cache_mapped_blocks(caches[0]);
    size_t keep = len / bt + (len % bt != 0);
    for (size_t block = mapped; block-- > keep;) {
        for (size_t c = count; c-- > 0;) {
            kvp_cache *cache = caches[c];
            for (size_t lane = cache->batch_size; lane-- > 0;) {
                uint32_t *slot = &cache->tables[lane * cache->blocks_per_lane + block];
                if (*slot != KVPI_NO_PAGE) { /* a released block has no page to give back */
                    kvpi_pool_put_locked(cache->pool, *slot);
                    *slot = KVPI_NO_PAGE;
                }
            }
        }
    }
    for (size_t c = 0; c < count; c++) {
        if (caches[c]->released_end > keep) {
            caches[c]->released_end = 0; /* every released block was dropped (len 0: reset) */
        }
        if (len == 0) {
            caches[c]->release_hold = 0; /* a reset ends a hold (cache_window.c) */
        }
        caches[c]->len = len;
        caches[c]->epoch++;
        kvpi_cache_cow_refresh_locked(caches[c]);
    }
}

void kvpi_cache_truncate_many(kvp_cache *const *caches, size_t count, size_t len)
{
    kvp_pool *pool = caches[0]->pool;
    kvpi_pool_lock(pool);
    kvpi_cache_truncate_many_locked(caches, count, len < caches[0]->len ? len : caches[0]->len);
    kvpi_pool_unlock(pool);
}

/*
 * Under the pool lock: ends the pending row reservation, if any. Its pages go
 * back newest first and are forgotten by the counters (they were tentative);
 * the promise they drew is restored.
 */
void kvpi_cache_discard_rows_locked(kvp_cache *cache)
{
    size_t pages = kvpi_reservation_remaining(&cache->row_reservation);
    kvpi_reservation_release_locked(&cache->row_reservation);
    kvpi_pool_tentative_cancel_locked(cache->pool, pages);
    kvpi_pool_promise_set_locked(cache->pool, &cache->promise,
                                 cache->promise + cache->promise_drawn);
    cache->promise_drawn = 0;
    cache->reserved_rows = 0;
}

kvp_status kvp_cache_reset(kvp_cache *cache, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    kvpi_pool_lock(cache->pool);
    kvpi_cache_discard_rows_locked(cache);
    kvpi_pool_promise_set_locked(cache->pool, &cache->promise, 0);
    kvpi_cache_truncate_many_locked(&cache, 1, 0);
    kvpi_pool_unlock(cache->pool);
    return KVP_OK;
}

kvp_status kvp_cache_destroy(kvp_cache *cache, kvp_error *err)
{
    (void)err;
    if (cache == NULL) {
        return KVP_OK; /* destroying NULL does nothing, as free(NULL) */
    }
    kvpi_reservation_release(&cache->spare_reservation);
    kvpi_pool_lock(cache->pool);
    kvpi_cache_discard_rows_locked(cache);
    kvpi_pool_promise_set_locked(cache->pool, &cache->promise, 0);
    kvpi_cache_truncate_many_locked(&cache, 1, 0);
    kvpi_pool_detach_locked(cache->pool, &cache->holder);
    kvpi_pool_unlock(cache->pool);
    kvpi_free(cache->tables);
    kvpi_free(cache);
    return KVP_OK;
}

void kvp_cache_info_init(kvp_cache_info *info)
{
    if (info == NULL) {
        return;
    }
    memset(info, 0, sizeof *info);
    info->struct_size = sizeof *info;
}

kvp_status kvp_cache_info_get(const kvp_cache *cache, kvp_cache_info *out, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_cache_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    info.batch_size = cache->batch_size;
    info.capacity = cache->capacity;
    info.len = cache->len;
    info.block_tokens = cache->block_tokens;
    info.blocks_per_lane = cache->blocks_per_lane;
    size_t blocks = kvpi_cache_mapped_blocks(cache);
    size_t sb = kvpi_cache_sink_blocks(cache);
    size_t released = cache->released_end > sb ? cache->released_end - sb : 0;
    info.mapped_pages = cache->batch_size * (blocks - released); /* released blocks hold none */
    info.tables_address = (uintptr_t)cache->tables;
    info.binding = cache->binding;
    return kvpi_struct_out(out, &info, sizeof info, KVPI_CACHE_INFO_SIZE_FIRST, err);
}

/*
 * Visits the logical rows of keys (values == 0) or values block by block, in
 * [lane][head][position] order: `rows` contiguous rows of d_h stored elements
 * (the pool's dtype) at `src` hold positions start .. start + rows of (lane, head).
 */
typedef void (*row_visit_fn)(void *ctx, size_t lane, size_t head, size_t start,
                             const void *src, size_t rows);

static void cache_visit_rows(const kvp_cache *cache, int values, row_visit_fn fn, void *ctx)
{
    size_t bt = cache->block_tokens;
    for (size_t lane = 0; lane < cache->batch_size; lane++) {
        const uint32_t *table = kvpi_cache_lane_table(cache, lane);
        for (size_t head = 0; head < cache->heads; head++) {
            for (size_t start = 0; start < cache->len; start += bt) {
                size_t rows = cache->len - start < bt ? cache->len - start : bt;
                uint32_t page = table[start / bt];
                if (page == KVPI_NO_PAGE) {
                    continue; /* released: the snapshot's zeros stay */
                }
                const void *src = values ? kvpi_cache_page_values(cache, page, head)
                                           : kvpi_cache_page_keys(cache, page, head);
                fn(ctx, lane, head, start, src, rows);
            }
        }
    }
}

typedef struct snapshot_ctx {
    const kvp_cache *cache;
    double *out;
    double scale; /* kvpi_cache_row_scale: fp8 elements are exported times it */
} snapshot_ctx;

static void snapshot_rows(void *ctx, size_t lane, size_t head, size_t start, const void *src,
                          size_t rows)
{
    snapshot_ctx *snap = ctx;
    const kvp_cache *cache = snap->cache;
    size_t d = cache->head_width;
    double *dst = snap->out + ((lane * cache->heads + head) * cache->len + start) * d;
    kvpi_dtype_load_scaled(kvpi_cache_dtype(cache), snap->scale, src, dst, rows * d);
}

/* Copies the logical [B, H_kv, len, d_h] prefix of keys (values == 0) or values. */
static kvp_status cache_snapshot(const kvp_cache *cache, int values, double *out, size_t out_len,
                                 kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    size_t needed = cache->batch_size * cache->heads * cache->len * cache->head_width;
    if (out == NULL && needed != 0) {
        return kvpi_fail_null(err, "out");
    }
    if (out_len < needed) {
        return kvpi_fail_buffer(err, "out", needed, out_len);
    }
    if (cache->released_end > kvpi_cache_sink_blocks(cache)) {
        memset(out, 0, needed * sizeof *out); /* released rows read as 0.0 */
    }
    snapshot_ctx snap = {cache, out, kvpi_cache_row_scale(cache, values)};
    cache_visit_rows(cache, values, snapshot_rows, &snap);
    return KVP_OK;
}

kvp_status kvp_cache_keys(const kvp_cache *cache, double *out, size_t out_len, kvp_error *err)
{
    return cache_snapshot(cache, 0, out, out_len, err);
}

kvp_status kvp_cache_values(const kvp_cache *cache, double *out, size_t out_len, kvp_error *err)
{
    return cache_snapshot(cache, 1, out, out_len, err);
}

kvp_status kvp_cache_page(const kvp_cache *cache, size_t lane, size_t block, uint32_t *out,
                          kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (lane >= cache->batch_size) {
        return kvpi_fail_out_of_range(err, "lane", lane, cache->batch_size);
    }
    size_t mapped = kvpi_cache_mapped_blocks(cache);
    if (block >= mapped) {
        return kvpi_fail_out_of_range(err, "block", block, mapped);
    }
    uint32_t page = kvpi_cache_lane_table(cache, lane)[block];
    *out = page == KVPI_NO_PAGE ? KVP_PAGE_RELEASED : page;
    return KVP_OK;
}

static uint64_t fnv1a(uint64_t hash, const void *data, size_t bytes)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < bytes; i++) {
        hash = (hash ^ p[i]) * 0x100000001b3ull;
    }
    return hash;
}

typedef struct digest_ctx {
    size_t row_bytes; /* head_width stored elements */
    uint64_t hash;
} digest_ctx;

/* Digests the stored bytes, whatever the dtype. */
static void digest_rows(void *ctx, size_t lane, size_t head, size_t start, const void *src,
                        size_t rows)
{
    (void)lane;
    (void)head;
    (void)start;
    digest_ctx *digest = ctx;
    digest->hash = fnv1a(digest->hash, src, rows * digest->row_bytes);
}

kvp_status kvp_cache_digest(const kvp_cache *cache, uint64_t *out, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (!kvpi_pool_has_data(cache->pool)) {
        return kvpi_pool_fail_no_data(err); /* its rows are in no memory */
    }
    uint64_t hash = 0xcbf29ce484222325ull;
    hash = fnv1a(hash, &cache->len, sizeof cache->len);
    hash = fnv1a(hash, &cache->capacity, sizeof cache->capacity);
    /* What the stored bytes mean: the dtype, and the scales fp8 elements stand under. */
    uint64_t dtype = (uint64_t)kvpi_cache_dtype(cache);
    double scales[2];
    kvpi_cache_kv_scales(cache, &scales[0], &scales[1]);
    hash = fnv1a(hash, &dtype, sizeof dtype);
    hash = fnv1a(hash, scales, sizeof scales);
    size_t mapped = kvpi_cache_mapped_blocks(cache);
    digest_ctx digest = {cache->head_width * cache->pool->element_bytes, hash};
    cache_visit_rows(cache, 0, digest_rows, &digest);
    cache_visit_rows(cache, 1, digest_rows, &digest);
    hash = digest.hash;
    for (size_t lane = 0; lane < cache->batch_size; lane++) {
        hash = fnv1a(hash, kvpi_cache_lane_table(cache, lane), mapped * sizeof(uint32_t));
    }
    *out = hash;
    return KVP_OK;
}

size_t kvp_cache_len(const kvp_cache *cache)
{
    return cache != NULL ? cache->len : 0;
}

size_t kvp_cache_capacity(const kvp_cache *cache)
{
    return cache != NULL ? cache->capacity : 0;
}

int kvp_cache_is_empty(const kvp_cache *cache)
{
    return cache != NULL && cache->len == 0;
}

int kvp_cache_is_full(const kvp_cache *cache)
{
    return cache != NULL && cache->len == cache->capacity;
}

/* ---- the private append path ------------------------------------------- */

static kvp_status check_row_shape(const kvp_cache *cache, const kvp_tensor *row,
                                  kvp_status mismatch, kvp_error *err)
{
    kvp_shape expected = kvpi_shape4(cache->batch_size, cache->heads, 1, cache->head_width);
    if (kvpi_shape_equal(&row->shape, &expected)) {
        return KVP_OK;
    }
    kvp_error e = kvpi_error_begin(mismatch);
    e.expected = expected;
    e.actual = row->shape;
    return kvpi_error_emit(err, &e);
}

kvp_status kvpi_cache_check_storable(const kvp_cache *cache, const double *rows, size_t n,
                                     kvp_status status, kvp_error *err)
{
    kvp_dtype dtype = kvpi_cache_dtype(cache);
    double scale = kvpi_cache_row_scale(cache, status == KVP_NONFINITE_VALUE);
    size_t i = kvpi_dtype_first_overflow_scaled(dtype, scale, rows, n);
    if (i == n) {
        return KVP_OK;
    }
    kvp_error e = kvpi_error_begin(status);
    e.what = kvp_dtype_name(dtype);
    e.index = i;
    e.value = rows[i];
    return kvpi_error_emit(err, &e);
}

/* The first element not finite as stored: non-finite in f64, or overflowing the dtype. */
static kvp_status check_stored_finite(const kvp_cache *cache, const double *rows, size_t n,
                                      kvp_status status, kvp_error *err)
{
    size_t nonfinite = kvpi_first_nonfinite(rows, n);
    double scale = kvpi_cache_row_scale(cache, status == KVP_NONFINITE_VALUE);
    size_t overflow =
        kvpi_dtype_first_overflow_scaled(kvpi_cache_dtype(cache), scale, rows, nonfinite);
    if (overflow < nonfinite) {
        return kvpi_cache_check_storable(cache, rows, nonfinite, status, err);
    }
    return kvpi_check_finite(rows, n, status, NULL, err);
}

kvp_status kvpi_cache_check_stored(const kvp_cache *cache, const double *rows, size_t n,
                                   kvp_status status, kvp_error *err)
{
    return check_stored_finite(cache, rows, n, status, err);
}

kvp_status kvpi_cache_validate_append(const kvp_cache *cache, const kvp_tensor *key,
                                      const kvp_tensor *value, kvp_error *err)
{
    if (key == NULL || key->data == NULL) {
        return kvpi_fail_null(err, "key");
    }
    if (value == NULL || value->data == NULL) {
        return kvpi_fail_null(err, "value");
    }
    kvp_status status = check_row_shape(cache, key, KVP_KEY_SHAPE_MISMATCH, err);
    if (status == KVP_OK) {
        status = check_row_shape(cache, value, KVP_VALUE_SHAPE_MISMATCH, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    if (cache->len == cache->capacity) {
        kvp_error e = kvpi_error_begin(KVP_FULL);
        e.capacity = cache->capacity;
        return kvpi_error_emit(err, &e);
    }
    size_t n = cache->batch_size * cache->heads * cache->head_width;
    status = check_stored_finite(cache, key->data, n, KVP_NONFINITE_KEY, err);
    if (status == KVP_OK) {
        status = check_stored_finite(cache, value->data, n, KVP_NONFINITE_VALUE, err);
    }
    return status;
}

size_t kvpi_cache_pages_needed(const kvp_cache *cache)
{
    return cache->len % cache->block_tokens != 0 ? kvpi_cache_cow_pages(cache) : cache->batch_size;
}

/*
 * Under the pool lock: maps the copies taken for a copy-on-write (the next
 * batch_size pages of `reservation`, lane order) over `block`, and lets the
 * originals go (or keeps them in cow_saved under cow_defer).
 */
void kvpi_cache_cow_map_locked(kvp_cache *cache, size_t block,
                               kvpi_reservation *reservation)
{
    for (size_t lane = 0; lane < cache->batch_size; lane++) {
        uint32_t *slot = &cache->tables[lane * cache->blocks_per_lane + block];
        uint32_t original = *slot;
        *slot = kvpi_reservation_consume_locked(reservation);
        if (cache->cow_defer) {
            cache->cow_saved[lane] = original;
        } else {
            kvpi_pool_put_locked(cache->pool, original);
        }
    }
    cache->pool->cow_copies += cache->batch_size;
    cache->cow = 0;
}

/* kvpi_cache_commit, fp8 elements divided by k_scale and v_scale (1.0: stored as given). */
static void commit_scaled(kvp_cache *cache, const double *key, const double *value,
                          kvpi_reservation *reservation, double k_scale, double v_scale)
{
    size_t bt = cache->block_tokens;
    size_t d = cache->head_width;
    size_t block = cache->len / bt;
    size_t slot = cache->len % bt;
    int opens_block = slot == 0;
    int copies = kvpi_cache_cow_pages(cache) != 0;
    kvp_dtype dtype = kvpi_cache_dtype(cache);
    for (size_t lane = 0; lane < cache->batch_size; lane++) {
        uint32_t page = opens_block || copies ? kvpi_reservation_peek(reservation, lane)
                                              : kvpi_cache_lane_table(cache, lane)[block];
        if (copies) {
            /* The shared page keeps this cache's reference until the lock below: nobody writes it. */
            kvpi_cache_copy_rows(cache, page, kvpi_cache_lane_table(cache, lane)[block], slot);
        }
        unsigned char *base = kvpi_pool_page(cache->pool, page);
        size_t row_bytes = d * cache->pool->element_bytes;
        for (size_t head = 0; head < cache->heads; head++) {
            const double *k = key + (lane * cache->heads + head) * d;
            const double *v = value + (lane * cache->heads + head) * d;
            kvpi_dtype_store_scaled(dtype, k_scale, base + (head * bt + slot) * row_bytes, k, d);
            kvpi_dtype_store_scaled(dtype, v_scale,
                                    base + ((cache->heads + head) * bt + slot) * row_bytes, v, d);
        }
    }
    kvpi_pool_lock(cache->pool);
    if (opens_block) {
        for (size_t lane = 0; lane < cache->batch_size; lane++) {
            cache->tables[lane * cache->blocks_per_lane + block] =
                kvpi_reservation_consume_locked(reservation);
        }
    } else if (copies) {
        kvpi_cache_cow_map_locked(cache, block, reservation);
    }
    cache->len++;
    cache->epoch++;
    kvpi_reservation_refund_locked(reservation, kvpi_cache_release_front_locked(cache));
    kvpi_pool_unlock(cache->pool);
}

void kvpi_cache_commit(kvp_cache *cache, const double *key, const double *value,
                       kvpi_reservation *reservation)
{
    commit_scaled(cache, key, value, reservation, 1.0, 1.0);
}

kvp_status kvpi_cache_append(kvp_cache *cache, const kvp_tensor *key, const kvp_tensor *value,
                             kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    kvp_status status = kvpi_cache_validate_append(cache, key, value, err);
    if (status != KVP_OK) {
        return status;
    }
    status = kvpi_reservation_fill(&cache->spare_reservation, kvpi_cache_pages_needed(cache),
                                   err);
    if (status != KVP_OK) {
        return status;
    }
    double k_scale;
    double v_scale;
    kvpi_cache_kv_scales(cache, &k_scale, &v_scale);
    commit_scaled(cache, key->data, value->data, &cache->spare_reservation, k_scale, v_scale);
    return KVP_OK;
}
