/*
 * kvpager/cache.h: the layer-bound KV cache, paged.
 *
 * A cache keeps, for each of its B lanes, a logical prefix of `len` rotated
 * key rows and unrotated value rows of shape [H_kv, d_h] (H_kv = the layer's
 * KV heads, kvpager/layer.h), bound to one attention
 * layer by a kvp_binding captured at creation. Rows live in pages of the pool
 * the cache was created from; each lane has a page table of
 * ceil(capacity / block_tokens) entries, allocated once at creation. A lane
 * takes a page only when an append crosses into a new block, so memory follows
 * len, not capacity. All lanes advance together.
 *
 * Appends reach a cache only through attention's prepare/commit (the seed keeps
 * its raw append private); this header offers creation, inspection, reset and
 * destruction.
 *
 * Threads: a cache has one owner at a time. Its pool may be shared.
 */
#ifndef KVPAGER_CACHE_H
#define KVPAGER_CACHE_H

#include "kvpager/common.h"
#include "kvpager/pool.h"
#include "kvpager/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_cache kvp_cache;

/* The four parameters of an attention layer, in the seed's stable order. */
enum { KVP_PARAM_QUERY = 0, KVP_PARAM_KEY = 1, KVP_PARAM_VALUE = 2, KVP_PARAM_OUTPUT = 3,
       KVP_PARAM_COUNT = 4 };

typedef struct kvp_param_binding {
    uint64_t node_id;  /* process-unique identity of the parameter node */
    uint64_t revision; /* value revision at capture */
} kvp_param_binding;

/*
 * What a cache captures from its layer. Reset refreshes none of it: a cache
 * whose layer was rebuilt or updated in place must be replaced.
 */
typedef struct kvp_binding {
    size_t model_width;      /* D == heads * head_width */
    size_t heads;            /* H, query heads */
    size_t kv_heads;         /* H_kv, KV heads: divides H; the heads a page stores */
    size_t head_width;       /* d_h */
    kvp_param_binding params[KVP_PARAM_COUNT];
    size_t rope_feature_width;
    size_t rope_max_positions;
    uint64_t rope_base_bits; /* the bit pattern of the RoPE base (an f64) */
} kvp_binding;

/* A growing struct (pool.h): struct_size first, set by kvp_cache_info_init. */
typedef struct kvp_cache_info {
    size_t struct_size;
    size_t batch_size;
    size_t capacity;
    size_t len;
    size_t block_tokens;
    size_t blocks_per_lane;   /* ceil(capacity / block_tokens) */
    size_t mapped_pages;      /* pages held across all lanes: batch * ceil(len / block) */
    uintptr_t tables_address; /* for audits: page tables are allocated once */
    kvp_binding binding;
} kvp_cache_info;

/*
 * Creates an empty cache drawing pages from `pool`. Errors, in this order:
 * NULL_ARGUMENT; INVALID_ARGUMENT (a binding with zero heads or head width,
 * model_width != heads * head_width, or kv_heads 0 or not dividing heads);
 * ZERO_BATCH_SIZE; ZERO_CAPACITY; CAPACITY_EXCEEDS_POSITIONS (capacity >
 * rope_max_positions); ELEMENT_COUNT_OVERFLOW (batch * kv_heads * capacity *
 * head_width); GEOMETRY_MISMATCH (binding (kv_heads, head_width) differs from
 * the pool's (heads, head_width): a page stores the KV heads);
 * ALLOCATION_FAILED. No page is taken until the first append.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_create(kvp_pool *pool, const kvp_binding *binding,
                                                  size_t batch_size, size_t capacity,
                                                  kvp_cache **out, kvp_error *err);

/* Returns every page to the pool, detaches and frees the cache. */
KVP_API kvp_status kvp_cache_destroy(kvp_cache *cache, kvp_error *err);

/*
 * len = 0 and every page back to the pool. Capacity and binding are kept;
 * nothing is allocated or freed on the heap, and a replay receives the same
 * physical pages (the pool's free list is LIFO).
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_reset(kvp_cache *cache, kvp_error *err);

/* Zeroes *info and sets struct_size to sizeof(kvp_cache_info). NULL is ignored. */
KVP_API void kvp_cache_info_init(kvp_cache_info *info);

/*
 * Writes the fields out->struct_size covers. Errors: NULL_ARGUMENT;
 * INVALID_ARGUMENT ("struct_size"; pool.h's "Growing structs"), writing nothing.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_info_get(const kvp_cache *cache, kvp_cache_info *out,
                                                    kvp_error *err);

/*
 * Logical snapshots: copy the [B, H_kv, len, d_h] rotated keys (or unrotated
 * values) into `out`, which holds `out_len` doubles. BUFFER_TOO_SMALL when
 * out_len < B*H_kv*len*d_h; nothing is written then.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_keys(const kvp_cache *cache, double *out,
                                                size_t out_len, kvp_error *err);
KVP_API KVP_NODISCARD kvp_status kvp_cache_values(const kvp_cache *cache, double *out,
                                                  size_t out_len, kvp_error *err);

/*
 * The physical page id of (lane, block), for audits. OUT_OF_RANGE when
 * lane >= batch or block >= ceil(len / block_tokens).
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_page(const kvp_cache *cache, size_t lane, size_t block,
                                                uint32_t *out, kvp_error *err);

/*
 * For audits: a 64-bit FNV-1a digest of len, capacity, the logical keys and
 * values, and every mapped page-table entry. Two equal digests around a call
 * show that the call changed none of them. Allocates nothing. Like the
 * snapshots, call it from the cache's owner.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_digest(const kvp_cache *cache, uint64_t *out,
                                                  kvp_error *err);

/* Plain queries. A NULL cache reads as 0 / false; they never fail. */
KVP_API size_t kvp_cache_len(const kvp_cache *cache);
KVP_API size_t kvp_cache_capacity(const kvp_cache *cache);
KVP_API int kvp_cache_is_empty(const kvp_cache *cache);
KVP_API int kvp_cache_is_full(const kvp_cache *cache);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_CACHE_H */
