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
 *
 * Transitions (all under the pool lock):
 *   reserve_rows    the pages of `rows` more rows, tentative, into the
 *                   cache's row reservation
 *   commit_rows     rows stored, their new blocks mapped from the
 *                   reservation, len -> len + rows, the pages confirmed
 *   discard_rows    the reservation's pages back, their promise restored
 *                   (kvpi_cache_discard_rows_locked, cache.c)
 *
 * Callers: the public API only.
 */
#include "pager/cache_internal.h"

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
    binding.model_width = kv_heads * head_width;
    binding.heads = kv_heads;
    binding.kv_heads = kv_heads;
    binding.head_width = head_width;
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        binding.params[i] = (kvp_param_binding){identity, revision};
    }
    binding.rope_feature_width = 0;
    binding.rope_max_positions = max_positions;
    binding.rope_base_bits = 0;
    *out = binding;
    return KVP_OK;
}

int kvp_binding_is_external(const kvp_binding *binding)
{
    return binding != NULL && binding->rope_feature_width == 0;
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

static kvp_status check_rows_present(const double *keys, const double *values, kvp_error *err)
{
    if (keys == NULL) {
        return kvpi_fail_null(err, "keys");
    }
    if (values == NULL) {
        return kvpi_fail_null(err, "values");
    }
    return KVP_OK;
}

/* The first key, then value, not finite as stored. */
static kvp_status check_rows_finite(const kvp_cache *cache, const double *keys,
                                    const double *values, size_t rows, kvp_error *err)
{
    /* rows <= capacity - len, and B * H * capacity * d_h was bounded at creation. */
    size_t n = cache->batch_size * cache->heads * rows * cache->head_width;
    kvp_status status = kvpi_cache_check_stored(cache, keys, n, KVP_NONFINITE_KEY, err);
    if (status == KVP_OK) {
        status = kvpi_cache_check_stored(cache, values, n, KVP_NONFINITE_VALUE, err);
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
 * Makes the first `rows` reserved rows visible (validated, rows <= reserved):
 * stores them, rounded to the dtype, in their pages without the lock (the
 * pages are this cache's, and nobody reads slots past len), then under the
 * lock maps the new blocks' pages lane by lane, confirms them, and advances
 * len and epoch.
 */
static void commit_rows(kvp_cache *cache, const double *keys, const double *values, size_t rows)
{
    size_t bt = cache->block_tokens;
    size_t d = cache->head_width;
    size_t heads = cache->heads;
    size_t batch = cache->batch_size;
    size_t mapped = kvpi_cache_mapped_blocks(cache);
    size_t row_bytes = d * cache->pool->element_bytes;
    kvp_dtype dtype = kvpi_cache_dtype(cache);
    /* A copy-on-write takes the reservation's first batch pages, lane by lane. */
    size_t copies = kvpi_cache_cow_pages(cache);
    size_t partial = cache->len / bt; /* the partial block, when copies != 0 */
    for (size_t lane = 0; lane < batch; lane++) {
        const uint32_t *table = kvpi_cache_lane_table(cache, lane);
        if (copies != 0) {
            kvpi_cache_copy_rows(cache, kvpi_reservation_peek(&cache->row_reservation, lane),
                                 table[partial], cache->len % bt);
        }
        for (size_t r = 0; r < rows; r++) {
            size_t position = cache->len + r;
            size_t block = position / bt;
            size_t slot = position % bt;
            uint32_t page =
                copies != 0 && block == partial
                    ? kvpi_reservation_peek(&cache->row_reservation, lane)
                : block < mapped
                    ? table[block]
                    : kvpi_reservation_peek(&cache->row_reservation,
                                            copies + (block - mapped) * batch + lane);
            unsigned char *base = kvpi_pool_page(cache->pool, page);
            for (size_t head = 0; head < heads; head++) {
                size_t at = ((lane * heads + head) * rows + r) * d;
                kvpi_dtype_store(dtype, base + (head * bt + slot) * row_bytes, keys + at, d);
                kvpi_dtype_store(dtype, base + ((heads + head) * bt + slot) * row_bytes,
                                 values + at, d);
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

kvp_status kvp_cache_append_rows(kvp_cache *cache, const double *keys, const double *values,
                                 size_t rows, kvp_error *err)
{
    kvp_status checked = check_row_cache(cache, 1, err);
    if (checked != KVP_OK) {
        return checked;
    }
    if (rows == 0) {
        return KVP_OK;
    }
    kvp_status status = check_rows_present(keys, values, err);
    if (status == KVP_OK) {
        status = check_room(cache, rows, err);
    }
    if (status == KVP_OK) {
        status = check_rows_finite(cache, keys, values, rows, err);
    }
    if (status == KVP_OK) {
        status = reserve_rows(cache, rows, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    commit_rows(cache, keys, values, rows);
    return KVP_OK;
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

kvp_status kvp_cache_commit_rows(kvp_cache *cache, const double *keys, const double *values,
                                 size_t rows, kvp_error *err)
{
    kvp_status checked = check_row_cache(cache, 0, err);
    if (checked != KVP_OK) {
        return checked;
    }
    if (rows > cache->reserved_rows) {
        kvp_error e = kvpi_error_begin(KVP_ROWS_NOT_RESERVED);
        e.tokens = rows;
        e.available = cache->reserved_rows;
        return kvpi_error_emit(err, &e);
    }
    if (rows == 0) {
        return KVP_OK;
    }
    kvp_status status = check_rows_present(keys, values, err);
    if (status == KVP_OK) {
        status = check_rows_finite(cache, keys, values, rows, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    commit_rows(cache, keys, values, rows);
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
