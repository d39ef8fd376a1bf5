/*
 * external.c: external caches' rows (see kvpager/cache.h, "external caches"):
 * external bindings, raw-row appends, the row reservation (reserve, commit,
 * discard), promises and block tables.
 *
 * Owns: the row transaction of an external cache. Rows are checked (room,
 * finite as stored) before any page is taken; pages are taken tentatively
 * into the cache's row reservation; rows are stored without the pool lock
 * (the pages are this cache's and nobody reads slots past len); the new
 * blocks are mapped, the pages confirmed and len advanced under the lock.
 * Rows come in f64, f32, bf16 or f16 (the typed calls): each element is
 * widened to f64 (exact), checked and rounded from there, exactly as an f64
 * row; rows already in the pool's dtype are copied (the same bits). Or a
 * kernel writes the reserved rows in place (reserved_slots gives their
 * addresses) and commit_written checks what it wrote, as stored, before it
 * commits them the same way.
 *
 * Transitions (all under the pool lock):
 *   reserve_rows    the pages of `rows` more rows, tentative, into the
 *                   cache's row reservation
 *   reserved_slots  pages the reservation borrowed from the LRU list are
 *                   evicted (their cached rows are about to be overwritten)
 *   commit_rows     rows stored (or written in place), a shared partial
 *   commit_written  page copied first, their new blocks mapped from the
 *                   reservation, len -> len + rows, the pages confirmed
 *   discard_rows    the reservation's pages back, their promise restored
 *                   (kvpi_cache_discard_rows_locked, cache.c)
 *
 * Callers: the public API only.
 */
#include "pager/cache_internal.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pager/dtype.h"
#include "pager/error.h"

kvp_status kvp_binding_init_external(kvp_binding *out, size_t kv_heads, size_t head_width,
                                     size_t max_positions, uint64_t identity, uint64_t revision,
                                     kvp_error *err)
{
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    static const char *const names[] = {"kv_heads", "head_width", "max_positions"};
    const size_t sizes[] = {kv_heads, head_width, max_positions};
    for (size_t i = 0; i < 3; i++) {
        if (sizes[i] == 0) {
            kvp_error e = kvpi_error_begin(KVP_ZERO_SIZE);
            e.argument = names[i];
            return kvpi_error_emit(err, &e);
        }
    }
    if (head_width > SIZE_MAX / kv_heads) {
        return kvpi_fail_invalid(err, "head_width", "kv_heads * head_width overflows");
    }
    kvp_binding binding;
    memset(&binding, 0, sizeof binding);
    binding.kind = KVP_BINDING_EXTERNAL;
    binding.kv_heads = kv_heads;
    binding.head_width = head_width;
    binding.max_positions = max_positions;
    binding.owner_digest[0] = identity;
    binding.owner_revision = revision;
    binding.k_scale = 1.0;
    binding.v_scale = 1.0;
    *out = binding;
    return KVP_OK;
}

static int cache_is_external(const kvp_cache *cache)
{
    return kvp_binding_is_external(&cache->binding);
}

static kvp_status fail_layer_bound(kvp_error *err)
{
    return kvpi_error_emit(err, &(kvp_error){.status = KVP_CACHE_LAYER_BOUND});
}

static kvp_status fail_rows_reserved(const kvp_cache *cache, kvp_error *err)
{
    kvp_error e = kvpi_error_begin(KVP_ROWS_RESERVED);
    e.tokens = cache->reserved_rows;
    return kvpi_error_emit(err, &e);
}

/*
 * The first checks of every call on an external cache's rows, in order:
 * NULL_ARGUMENT, CACHE_LAYER_BOUND (an attention cache), then, when
 * `no_reservation`, ROWS_RESERVED (rows are reserved and not committed).
 */
static kvp_status check_row_cache(const kvp_cache *cache, int no_reservation, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (!cache_is_external(cache)) {
        return fail_layer_bound(err);
    }
    if (no_reservation && cache->reserved_rows != 0) {
        return fail_rows_reserved(cache, err);
    }
    return KVP_OK;
}

/* The calls that read or write rows: a reserved pool's pages hold none (pool.h). */
static kvp_status check_has_data(const kvp_cache *cache, kvp_error *err)
{
    return kvpi_pool_has_data(cache->pool) ? KVP_OK : kvpi_pool_fail_no_data(err);
}

/* FULL for `rows` more rows, with the prompt-style detail ("rows"). */
static kvp_status check_room(const kvp_cache *cache, size_t rows, kvp_error *err)
{
    size_t room = cache->capacity - cache->len;
    if (rows <= room) {
        return KVP_OK;
    }
    kvp_error e = kvpi_error_begin(KVP_FULL);
    e.what = "rows";
    e.capacity = cache->capacity;
    e.tokens = rows;
    e.available = room;
    return kvpi_error_emit(err, &e);
}

/* ---- rows in the caller's formats ---------------------------------------------- */

/*
 * Where committed rows come from: the caller's keys and values, elements of
 * `dtype` (f64, f32, bf16 or f16), laid out [B, H_kv, rows, d_h].
 */
typedef struct row_source {
    kvp_dtype dtype;
    const void *keys;
    const void *values;
} row_source;

/* Elements widened per step: a stack buffer, so no row size allocates. */
#define WIDEN_CHUNK 64

static int source_dtype_ok(kvp_dtype dtype)
{
    return dtype == KVP_F64 || dtype == KVP_F32 || dtype == KVP_BF16 || dtype == KVP_F16;
}

/*
 * Stores the d elements at element `at` of `rows` (of src_dtype) at dst,
 * each rounded to the pool's dtype from its widened f64 value (fp8: divided
 * by the cache's key or value scale first, kvpi_dtype_store_scaled). A row
 * already in the pool's dtype is copied: widening it and rounding it back
 * gives its bits (finite values; the caller checked them; never fp8, which
 * is no source dtype).
 */
static void store_row(const kvp_cache *cache, unsigned char *dst, kvp_dtype src_dtype,
                      const void *rows, size_t at, size_t d, int values)
{
    kvp_dtype dtype = kvpi_cache_dtype(cache);
    double scale = kvpi_cache_row_scale(cache, values);
    if (src_dtype == KVP_F64) {
        kvpi_dtype_store_scaled(dtype, scale, dst, (const double *)rows + at, d);
        return;
    }
    size_t bytes = kvp_dtype_bytes(src_dtype);
    const unsigned char *src = (const unsigned char *)rows + at * bytes;
    if (src_dtype == dtype) {
        memcpy(dst, src, d * bytes);
        return;
    }
    double chunk[WIDEN_CHUNK];
    for (size_t i = 0; i < d; i += WIDEN_CHUNK) {
        size_t m = d - i < WIDEN_CHUNK ? d - i : WIDEN_CHUNK;
        kvpi_dtype_load(src_dtype, src + i * bytes, chunk, m);
        kvpi_dtype_store_scaled(dtype, scale, dst + i * cache->pool->element_bytes, chunk, m);
    }
}

/* The first of n source elements not finite as stored, widened first (as f64 rows are checked). */
static kvp_status check_source_finite(const kvp_cache *cache, kvp_dtype src_dtype,
                                      const void *rows, size_t n, kvp_status status,
                                      kvp_error *err)
{
    if (src_dtype == KVP_F64) {
        return kvpi_cache_check_stored(cache, rows, n, status, err);
    }
    size_t bytes = kvp_dtype_bytes(src_dtype);
    double chunk[WIDEN_CHUNK];
    for (size_t at = 0; at < n; at += WIDEN_CHUNK) {
        size_t m = n - at < WIDEN_CHUNK ? n - at : WIDEN_CHUNK;
        kvpi_dtype_load(src_dtype, (const unsigned char *)rows + at * bytes, chunk, m);
        kvp_error e;
        if (kvpi_cache_check_stored(cache, chunk, m, status, &e) != KVP_OK) {
            e.index += at; /* earlier chunks were clean: this is the first */
            return kvpi_error_emit(err, &e);
        }
    }
    return KVP_OK;
}

static kvp_status check_source(const row_source *src, kvp_error *err)
{
    if (src->keys == NULL) {
        return kvpi_fail_null(err, "keys");
    }
    if (src->values == NULL) {
        return kvpi_fail_null(err, "values");
    }
    return KVP_OK;
}

/* The first key, then value, not finite as stored. */
static kvp_status check_rows_finite(const kvp_cache *cache, const row_source *src, size_t rows,
                                    kvp_error *err)
{
    /* rows <= capacity - len, and B * H * capacity * d_h was bounded at creation. */
    size_t n = cache->batch_size * cache->heads * rows * cache->head_width;
    kvp_status status =
        check_source_finite(cache, src->dtype, src->keys, n, KVP_NONFINITE_KEY, err);
    if (status == KVP_OK) {
        status = check_source_finite(cache, src->dtype, src->values, n, KVP_NONFINITE_VALUE, err);
    }
    return status;
}

/* Reserves the pages of `rows` more rows (rows > 0, room checked), tentatively. */
static kvp_status reserve_rows(kvp_cache *cache, size_t rows, kvp_error *err)
{
    size_t pages = kvp_cache_pages_for(cache, cache->len + rows);
    kvpi_pool_lock(cache->pool);
    size_t drawn = pages < cache->promise ? pages : cache->promise;
    kvp_status status =
        kvpi_reservation_fill_tentative_locked(&cache->row_reservation, pages, &cache->promise,
                                               err);
    if (status == KVP_OK) {
        cache->reserved_rows = rows;
        cache->promise_drawn = drawn;
    }
    kvpi_pool_unlock(cache->pool);
    return status;
}

/*
 * The page that holds reserved position `position` (len <= position < len +
 * reserved) of `lane`: the copy-on-write copy for the partial block (the
 * reservation's first batch pages, lane by lane), the mapped partial page,
 * or a new block's page (then block by block, lane by lane).
 */
static uint32_t row_page(const kvp_cache *cache, size_t lane, size_t position)
{
    size_t bt = cache->block_tokens;
    size_t batch = cache->batch_size;
    size_t mapped = kvpi_cache_mapped_blocks(cache);
    size_t copies = kvpi_cache_cow_pages(cache);
    size_t block = position / bt;
    if (copies != 0 && block == cache->len / bt) {
        return kvpi_reservation_peek(&cache->row_reservation, lane);
    }
    if (block < mapped) {
        return kvpi_cache_lane_table(cache, lane)[block];
    }
    return kvpi_reservation_peek(&cache->row_reservation,
                                 copies + (block - mapped) * batch + lane);
}

/*
 * Makes the first `rows` reserved rows visible (validated, rows <= reserved):
 * stores them from `src` (NULL: written in place already), rounded to the
 * dtype, in their pages without the lock (the pages are this cache's, and
 * nobody reads slots past len), copies a shared partial page's rows first
 * (copy-on-write), then under the lock maps the new blocks' pages lane by
 * lane, confirms them, and advances len and epoch.
 */
static void commit_rows(kvp_cache *cache, const row_source *src, size_t rows)
{
    size_t bt = cache->block_tokens;
    size_t d = cache->head_width;
    size_t heads = cache->heads;
    size_t batch = cache->batch_size;
    size_t mapped = kvpi_cache_mapped_blocks(cache);
    size_t row_bytes = d * cache->pool->element_bytes;
    /* A copy-on-write takes the reservation's first batch pages, lane by lane. */
    size_t copies = kvpi_cache_cow_pages(cache);
    size_t partial = cache->len / bt; /* the partial block, when copies != 0 */
    for (size_t lane = 0; lane < batch; lane++) {
        const uint32_t *table = kvpi_cache_lane_table(cache, lane);
        if (copies != 0) {
            kvpi_cache_copy_rows(cache, kvpi_reservation_peek(&cache->row_reservation, lane),
                                 table[partial], cache->len % bt);
        }
        for (size_t r = 0; src != NULL && r < rows; r++) {
            size_t slot = (cache->len + r) % bt;
            unsigned char *base = kvpi_pool_page(cache->pool, row_page(cache, lane, cache->len + r));
            for (size_t head = 0; head < heads; head++) {
                size_t at = ((lane * heads + head) * rows + r) * d;
                store_row(cache, base + (head * bt + slot) * row_bytes, src->dtype, src->keys,
                          at, d, 0);
                store_row(cache, base + ((heads + head) * bt + slot) * row_bytes, src->dtype,
                          src->values, at, d, 1);
            }
        }
    }
    size_t len = cache->len + rows;
    size_t blocks = len / bt + (len % bt != 0);
    size_t pages = (blocks - mapped) * batch + copies;
    kvpi_pool_lock(cache->pool);
    if (copies != 0) {
        kvpi_cache_cow_map_locked(cache, partial, &cache->row_reservation);
    }
    for (size_t block = mapped; block < blocks; block++) {
        for (size_t lane = 0; lane < batch; lane++) {
            cache->tables[lane * cache->blocks_per_lane + block] =
                kvpi_reservation_consume_locked(&cache->row_reservation);
        }
    }
    kvpi_pool_tentative_confirm_locked(cache->pool, pages);
    cache->promise_drawn -= pages < cache->promise_drawn ? pages : cache->promise_drawn;
    cache->reserved_rows -= rows;
    cache->len = len;
    cache->epoch++;
    kvpi_pool_unlock(cache->pool);
}

static kvp_status check_source_dtype(kvp_dtype dtype, kvp_error *err)
{
    if (source_dtype_ok(dtype)) {
        return KVP_OK;
    }
    return kvpi_fail_invalid(err, "src_dtype", "must be KVP_F64, KVP_F32, KVP_BF16 or KVP_F16");
}

kvp_status kvp_cache_append_rows_typed(kvp_cache *cache, kvp_dtype src_dtype, const void *keys,
                                       const void *values, size_t rows, kvp_error *err)
{
    kvp_status status = check_row_cache(cache, 1, err);
    if (status == KVP_OK) {
        status = check_source_dtype(src_dtype, err);
    }
    if (status == KVP_OK) {
        status = check_has_data(cache, err);
    }
    if (status != KVP_OK || rows == 0) {
        return status;
    }
    row_source src = {src_dtype, keys, values};
    status = check_source(&src, err);
    if (status == KVP_OK) {
        status = check_room(cache, rows, err);
    }
    if (status == KVP_OK) {
        status = check_rows_finite(cache, &src, rows, err);
    }
    if (status == KVP_OK) {
        status = reserve_rows(cache, rows, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    commit_rows(cache, &src, rows);
    return KVP_OK;
}

kvp_status kvp_cache_append_rows(kvp_cache *cache, const double *keys, const double *values,
                                 size_t rows, kvp_error *err)
{
    return kvp_cache_append_rows_typed(cache, KVP_F64, keys, values, rows, err);
}

kvp_status kvp_cache_reserve_rows(kvp_cache *cache, size_t rows, kvp_error *err)
{
    kvp_status checked = check_row_cache(cache, 1, err);
    if (checked != KVP_OK) {
        return checked;
    }
    if (rows == 0) {
        return KVP_OK;
    }
    kvp_status status = check_room(cache, rows, err);
    if (status != KVP_OK) {
        return status;
    }
    return reserve_rows(cache, rows, err);
}

/* ROWS_NOT_RESERVED when more than the reserved rows would be committed. */
static kvp_status check_reserved(const kvp_cache *cache, size_t rows, kvp_error *err)
{
    if (rows <= cache->reserved_rows) {
        return KVP_OK;
    }
    kvp_error e = kvpi_error_begin(KVP_ROWS_NOT_RESERVED);
    e.tokens = rows;
    e.available = cache->reserved_rows;
    return kvpi_error_emit(err, &e);
}

kvp_status kvp_cache_commit_rows_typed(kvp_cache *cache, kvp_dtype src_dtype, const void *keys,
                                       const void *values, size_t rows, kvp_error *err)
{
    kvp_status status = check_row_cache(cache, 0, err);
    if (status == KVP_OK) {
        status = check_source_dtype(src_dtype, err);
    }
    if (status == KVP_OK) {
        status = check_has_data(cache, err);
    }
    if (status == KVP_OK) {
        status = check_reserved(cache, rows, err);
    }
    if (status != KVP_OK || rows == 0) {
        return status;
    }
    row_source src = {src_dtype, keys, values};
    status = check_source(&src, err);
    if (status == KVP_OK) {
        status = check_rows_finite(cache, &src, rows, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    commit_rows(cache, &src, rows);
    return KVP_OK;
}

kvp_status kvp_cache_commit_rows(kvp_cache *cache, const double *keys, const double *values,
                                 size_t rows, kvp_error *err)
{
    return kvp_cache_commit_rows_typed(cache, KVP_F64, keys, values, rows, err);
}

/* ---- writing in place ---------------------------------------------------------------- */

/* Spans of a lane's reserved rows: one per block they touch (none without a reservation). */
static size_t reserved_spans(const kvp_cache *cache)
{
    if (cache->reserved_rows == 0) {
        return 0;
    }
    size_t bt = cache->block_tokens;
    return (cache->len + cache->reserved_rows - 1) / bt - cache->len / bt + 1;
}

/*
 * Under the pool lock: pages the reservation borrowed from the LRU list
 * are evicted now, before a kernel overwrites their cached rows; a discard
 * then frees them instead of putting them back. Idempotent.
 */
static void evict_reserved_locked(kvp_cache *cache)
{
    size_t pages = kvpi_reservation_remaining(&cache->row_reservation);
    for (size_t i = 0; i < pages; i++) {
        kvpi_pool_evict_borrowed_locked(cache->pool,
                                        kvpi_reservation_peek(&cache->row_reservation, i));
    }
}

/* Writes the lane's spans to out[0..spans). */
static void fill_spans(const kvp_cache *cache, size_t lane, kvp_slot_span *out, size_t spans)
{
    size_t bt = cache->block_tokens;
    size_t row_bytes = cache->head_width * cache->pool->element_bytes;
    size_t head_bytes = bt * row_bytes;
    size_t row = 0;
    for (size_t i = 0; i < spans; i++) {
        size_t position = cache->len + row;
        size_t slot = position % bt;
        size_t rows = bt - slot < cache->reserved_rows - row ? bt - slot
                                                             : cache->reserved_rows - row;
        uint32_t page = row_page(cache, lane, position);
        unsigned char *base = kvpi_pool_page(cache->pool, page);
        out[i] = (kvp_slot_span){
            .row = row,
            .rows = rows,
            .page = page,
            .keys = base + slot * row_bytes,
            .values = base + cache->heads * head_bytes + slot * row_bytes,
            .row_stride_bytes = row_bytes,
            .head_stride_bytes = head_bytes,
        };
        row += rows;
    }
}

kvp_status kvp_cache_reserved_slots(kvp_cache *cache, size_t lane, kvp_slot_span *out,
                                    size_t max, size_t *count, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (count == NULL) {
        return kvpi_fail_null(err, "count");
    }
    if (out == NULL && max > 0) {
        return kvpi_fail_null(err, "out");
    }
    kvp_status status = check_row_cache(cache, 0, err);
    if (status == KVP_OK) {
        status = check_has_data(cache, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    if (lane >= cache->batch_size) {
        return kvpi_fail_out_of_range(err, "lane", lane, cache->batch_size);
    }
    size_t spans = reserved_spans(cache);
    if (out == NULL) {
        *count = spans;
        return KVP_OK;
    }
    if (max < spans) {
        return kvpi_fail_buffer(err, "out", spans, max);
    }
    kvpi_pool_lock(cache->pool);
    evict_reserved_locked(cache);
    kvpi_pool_unlock(cache->pool);
    fill_spans(cache, lane, out, spans);
    *count = spans;
    return KVP_OK;
}

/*
 * The first element of the `rows` reserved rows written in place, keys
 * (values == 0) or values, that is not finite once widened, in the flat
 * [B, H_kv, rows, d_h] order: `status` with its index and value.
 */
static kvp_status check_written(const kvp_cache *cache, int values, size_t rows,
                                kvp_status status, kvp_error *err)
{
    size_t bt = cache->block_tokens;
    size_t d = cache->head_width;
    size_t heads = cache->heads;
    size_t row_bytes = d * cache->pool->element_bytes;
    double chunk[WIDEN_CHUNK];
    for (size_t lane = 0; lane < cache->batch_size; lane++) {
        for (size_t head = 0; head < heads; head++) {
            for (size_t r = 0; r < rows; r++) {
                size_t slot = (cache->len + r) % bt;
                const unsigned char *row =
                    (const unsigned char *)kvpi_pool_page(cache->pool,
                                                          row_page(cache, lane, cache->len + r)) +
                    ((values ? heads : 0) * bt + head * bt + slot) * row_bytes;
                for (size_t f = 0; f < d; f += WIDEN_CHUNK) {
                    size_t m = d - f < WIDEN_CHUNK ? d - f : WIDEN_CHUNK;
                    kvpi_dtype_load(kvpi_cache_dtype(cache),
                                    row + f * cache->pool->element_bytes, chunk, m);
                    size_t bad = kvpi_first_nonfinite(chunk, m);
                    if (bad < m) {
                        kvp_error e = kvpi_error_begin(status);
                        e.index = ((lane * heads + head) * rows + r) * d + f + bad;
                        e.value = chunk[bad];
                        return kvpi_error_emit(err, &e);
                    }
                }
            }
        }
    }
    return KVP_OK;
}

kvp_status kvp_cache_commit_written(kvp_cache *cache, size_t rows, kvp_error *err)
{
    kvp_status status = check_row_cache(cache, 0, err);
    if (status == KVP_OK) {
        status = check_has_data(cache, err);
    }
    if (status == KVP_OK) {
        status = check_reserved(cache, rows, err);
    }
    if (status != KVP_OK || rows == 0) {
        return status;
    }
    status = check_written(cache, 0, rows, KVP_NONFINITE_KEY, err);
    if (status == KVP_OK) {
        status = check_written(cache, 1, rows, KVP_NONFINITE_VALUE, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    commit_rows(cache, NULL, rows);
    return KVP_OK;
}

kvp_status kvpi_cache_commit_unwritten(kvp_cache *cache, size_t rows, kvp_error *err)
{
    kvp_status status = check_row_cache(cache, 0, err);
    if (status == KVP_OK) {
        status = check_reserved(cache, rows, err);
    }
    if (status != KVP_OK || rows == 0) {
        return status;
    }
    commit_rows(cache, NULL, rows); /* no source: nothing written, nothing read */
    return KVP_OK;
}

kvp_status kvp_cache_discard_rows(kvp_cache *cache, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    kvpi_pool_lock(cache->pool);
    kvpi_cache_discard_rows_locked(cache);
    kvpi_pool_unlock(cache->pool);
    return KVP_OK;
}

size_t kvp_cache_reserved_rows(const kvp_cache *cache)
{
    return cache != NULL ? cache->reserved_rows : 0;
}

kvp_status kvp_cache_promise(kvp_cache *cache, size_t pages, kvp_error *err)
{
    kvp_status checked = check_row_cache(cache, 0, err);
    if (checked != KVP_OK) {
        return checked;
    }
    /* Bounded by the tables, so the pool's sum of promises cannot wrap. */
    size_t most = cache->batch_size * cache->blocks_per_lane;
    if (pages > most) {
        return kvpi_fail_out_of_range(err, "pages", pages, most + 1);
    }
    kvpi_pool_lock(cache->pool);
    kvpi_pool_promise_set_locked(cache->pool, &cache->promise, pages);
    kvpi_pool_unlock(cache->pool);
    return KVP_OK;
}

size_t kvp_cache_promised_pages(const kvp_cache *cache)
{
    return cache != NULL ? cache->promise : 0;
}

kvp_status kvp_cache_block_table(const kvp_cache *cache, size_t lane, const uint32_t **table,
                                 size_t *blocks, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (table == NULL) {
        return kvpi_fail_null(err, "table");
    }
    if (blocks == NULL) {
        return kvpi_fail_null(err, "blocks");
    }
    if (lane >= cache->batch_size) {
        return kvpi_fail_out_of_range(err, "lane", lane, cache->batch_size);
    }
    *table = kvpi_cache_lane_table(cache, lane);
    *blocks = kvpi_cache_mapped_blocks(cache);
    return KVP_OK;
}
