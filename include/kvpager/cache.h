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
 * Two kinds of cache, told apart by their binding's kind (kvp_binding_kind):
 *   - layer-bound: the binding came from an attention layer
 *     (kvp_layer_binding_get). Rows reach it only through attention's
 *     prepare/commit, which checks the binding first: the seed keeps the raw
 *     append private, so no caller can bypass that check. The raw-row calls
 *     below refuse it with CACHE_LAYER_BOUND.
 *   - external: the binding came from kvp_binding_init_external (an identity
 *     and revision of the caller's choosing). The pager's rules
 *     (pages, budget, audit, transactions) hold for it without any attention
 *     code: the caller appends rows it computed itself (kvp_cache_append_rows,
 *     or reserve / commit / discard) and reads them through the block table
 *     (kvp_cache_block_table) and the page data (kvp_pool_page_data). Attention
 *     refuses an external cache (its binding matches no layer).
 *
 * Threads: a cache has one owner at a time. The calls that change it (reset,
 * destroy, the raw-row calls, promise, and attention's or a sequence's
 * commits) come from its owner, one at a time. The calls that only read it
 * (those taking a const kvp_cache *: info, snapshots, page, digest, block
 * table, plain queries) may run on several threads at once, but never while
 * a change runs. Caches of one pool may be used on different threads at
 * once: the pool's mutex guards what they share.
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

/*
 * Who owns a cache's rows, and so who may append them (kvp_binding.kind).
 *   KVP_BINDING_LAYER: an attention layer's (kvp_layer_binding_get). Rows
 *     reach the cache only through attention, which checks its own rules
 *     against the owner record first; the raw-row calls refuse it
 *     (CACHE_LAYER_BOUND).
 *   KVP_BINDING_EXTERNAL: an engine's own (kvp_binding_init_external). The
 *     raw-row calls serve it; attention refuses it.
 * Any other value is refused by kvp_cache_create (INVALID_ARGUMENT).
 */
typedef enum kvp_binding_kind {
    KVP_BINDING_LAYER = 1,
    KVP_BINDING_EXTERNAL = 2
} kvp_binding_kind;

/* Bytes of a binding's opaque owner record (kvp_binding.record). */
#define KVP_BINDING_RECORD_BYTES 128

/*
 * What a cache captures from its owner at creation. The pager reads only the
 * page geometry (kv_heads, head_width), the capacity limit (max_positions),
 * the fp8 scales (storage) and the kind. The rest is the owner's record:
 * a 128-bit digest and a revision the owner computed from whatever its rows
 * depend on (attention: its parameters' identities and revisions, heads,
 * model width and RoPE; an engine: its weights' identity and revision), and
 * record bytes only the owner reads back. The pager copies all of it at
 * creation, never interprets it, and covers every byte of it in the
 * cache's binding digest (kvp_cache_binding_key), so blocks published under
 * another owner record are never shared. Reset refreshes none of it: a
 * cache whose owner was rebuilt or updated must be replaced.
 * Since 0.2 (DESIGN.md, "External caches"); before, the pager held
 * attention's fields (query heads, model width, parameters, RoPE) itself.
 */
typedef struct kvp_binding {
    size_t kv_heads;         /* H_kv: the heads a page stores (the pool's heads) */
    size_t head_width;       /* d_h (the pool's head_width) */
    size_t max_positions;    /* the largest capacity a cache of it may have */
    /*
     * fp8 scales (vLLM's k_scale, v_scale): a KVP_FP8_E4M3 page stores a key
     * element x as e = round(x / k_scale), and e stands for e * k_scale;
     * values likewise with v_scale (pool.h, kvp_dtype). Every other dtype
     * ignores them. Each must be finite, normal and > 0, or 0, which means
     * 1.0 (a binding zeroed by a caller that sets no scale; the cache keeps
     * the 0 in its binding). kvp_binding_init_external and kvp_layer_binding_get give 1.0 unless
     * the layer's scales were set (kvp_layer_set_kv_scales). An fp8 cache's
     * scales are part of its binding digest (kvp_cache_binding_key), so
     * blocks stored under other scales are never shared.
     */
    double k_scale;
    double v_scale;
    uint32_t kind;           /* a kvp_binding_kind */
    uint32_t reserved;       /* 0 */
    uint64_t owner_digest[2]; /* the owner's 128-bit digest */
    uint64_t owner_revision;  /* the owner's revision (its weights') */
    unsigned char record[KVP_BINDING_RECORD_BYTES]; /* the owner's, opaque to the pager */
} kvp_binding;

/*
 * Fills *out with an external binding: kind KVP_BINDING_EXTERNAL, the page
 * geometry (kv_heads, head_width), max_positions, the largest capacity a
 * cache of it may have, owner_digest = {identity, 0}, owner_revision =
 * revision, record all zero, and k_scale = v_scale = 1.0 (set them before
 * kvp_cache_create for an fp8 pool). The pager never interprets identity
 * and revision: they are the caller's record of what the cache's rows
 * belong to (its weights' identity and version, say), returned by
 * kvp_cache_info_get. They are in the cache's binding digest, so block keys
 * (kvp_block_key_chain) change with them: blocks computed under an older
 * revision are never adopted by a cache of a newer one.
 * Errors, in this order: NULL_ARGUMENT;
 * ZERO_SIZE (argument "kv_heads", "head_width" or "max_positions");
 * INVALID_ARGUMENT (argument "head_width": kv_heads * head_width overflows).
 * Threads: thread-safe (touches only *out).
 */
KVP_API KVP_NODISCARD kvp_status kvp_binding_init_external(kvp_binding *out, size_t kv_heads,
                                                           size_t head_width,
                                                           size_t max_positions,
                                                           uint64_t identity, uint64_t revision,
                                                           kvp_error *err);

/*
 * 1 when `binding` is external (kind KVP_BINDING_EXTERNAL), else 0; NULL
 * gives 0.
 * Threads: thread-safe.
 */
KVP_API int kvp_binding_is_external(const kvp_binding *binding);

/* A growing struct (pool.h): struct_size first, set by kvp_cache_info_init. */
typedef struct kvp_cache_info {
    size_t struct_size;
    size_t batch_size;
    size_t capacity;
    size_t len;
    size_t block_tokens;
    size_t blocks_per_lane;   /* ceil(capacity / block_tokens) */
    size_t mapped_pages;      /* pages held across all lanes: batch * ceil(len / block), less
                                 the blocks a sliding window released */
    uintptr_t tables_address; /* for audits: page tables are allocated once */
    kvp_binding binding;
} kvp_cache_info;

/*
 * Creates an empty cache drawing pages from `pool`. Errors, in this order:
 * NULL_ARGUMENT; INVALID_ARGUMENT (argument "binding": a kind that is not a
 * kvp_binding_kind, reserved nonzero, or zero kv_heads or head_width;
 * then argument "k_scale" or "v_scale": negative, subnormal, infinite or NaN);
 * ZERO_BATCH_SIZE; ZERO_CAPACITY; CAPACITY_EXCEEDS_POSITIONS (capacity >
 * max_positions); ELEMENT_COUNT_OVERFLOW (batch * kv_heads * capacity *
 * head_width); GEOMETRY_MISMATCH (binding (kv_heads, head_width) differs from
 * the pool's (heads, head_width): a page stores the KV heads);
 * ALLOCATION_FAILED. No page is taken until the first append.
 * Threads: thread-safe (attaching to the pool takes its mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_create(kvp_pool *pool, const kvp_binding *binding,
                                                  size_t batch_size, size_t capacity,
                                                  kvp_cache **out, kvp_error *err);

/*
 * Returns every page to the pool (a pending row reservation's too), sets the
 * promise to 0, detaches and frees the cache.
 * NULL: nothing happens and KVP_OK is returned, as free(NULL) (kvpager.h).
 * Threads: not safe while any other call uses this cache (a ticket's
 * prepare or commit included); other caches of the same pool may be used
 * concurrently.
 */
KVP_API kvp_status kvp_cache_destroy(kvp_cache *cache, kvp_error *err);

/*
 * len = 0 and every page back to the pool, a pending row reservation
 * discarded and the promise set to 0. Capacity and binding are kept;
 * nothing is allocated or freed on the heap, and a replay receives the same
 * physical pages (the pool's free list is LIFO).
 * Threads: one caller at a time per cache (its owner), and not while a read
 * of it runs; other caches of the same pool may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_reset(kvp_cache *cache, kvp_error *err);

/*
 * Zeroes *info and sets struct_size to sizeof(kvp_cache_info). NULL is ignored.
 * Threads: thread-safe (touches only *info).
 */
KVP_API void kvp_cache_info_init(kvp_cache_info *info);

/*
 * Writes the fields out->struct_size covers. Errors: NULL_ARGUMENT;
 * INVALID_ARGUMENT ("struct_size"; pool.h's "Growing structs"), writing nothing.
 * Threads: not safe while a call changes this cache; reads of one cache may
 * overlap, and other caches of the pool may change meanwhile.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_info_get(const kvp_cache *cache, kvp_cache_info *out,
                                                    kvp_error *err);

/*
 * Logical snapshots: copy the [B, H_kv, len, d_h] rotated keys (or unrotated
 * values) into `out`, which holds `out_len` doubles. BUFFER_TOO_SMALL when
 * out_len < B*H_kv*len*d_h; nothing is written then. Each stored element
 * is widened exactly; an fp8 element e is exported as the value it stands
 * for, e * k_scale (keys) or e * v_scale (values), one f64 multiplication.
 * The rows of a block a sliding window released (kvp_cache_page gives
 * KVP_PAGE_RELEASED for it) read as 0.0.
 * Threads: not safe while a call changes this cache; reads of one cache may
 * overlap, and other caches of the pool may change meanwhile.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_keys(const kvp_cache *cache, double *out,
                                                size_t out_len, kvp_error *err);
KVP_API KVP_NODISCARD kvp_status kvp_cache_values(const kvp_cache *cache, double *out,
                                                  size_t out_len, kvp_error *err);

/* The page id kvp_cache_page gives for a block released by a sliding window. */
#define KVP_PAGE_RELEASED UINT32_MAX

/*
 * The physical page id of (lane, block), for audits. OUT_OF_RANGE when
 * lane >= batch or block >= ceil(len / block_tokens). A block a windowed
 * cache released (front truncation, DESIGN.md "Sliding windows and sinks":
 * past the sink blocks and entirely below len - W) reads as
 * KVP_PAGE_RELEASED, with KVP_OK.
 * Threads: not safe while a call changes this cache; reads of one cache may
 * overlap, and other caches of the pool may change meanwhile.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_page(const kvp_cache *cache, size_t lane, size_t block,
                                                uint32_t *out, kvp_error *err);

/*
 * For audits: a 64-bit FNV-1a digest of len, capacity, the pool's dtype,
 * the K and V scales the cache uses (1.0 and 1.0 unless fp8), the stored bytes
 * of the logical keys and values, and every mapped page-table entry. Two equal digests around a call
 * show that the call changed none of them. Allocates nothing.
 * Threads: not safe while a call changes this cache; reads of one cache may
 * overlap, and other caches of the pool may change meanwhile.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_digest(const kvp_cache *cache, uint64_t *out,
                                                  kvp_error *err);

/* ---- external caches: raw rows, block tables ---------------------------- */

/*
 * Appends `rows` rows per lane, computed by the caller, to an external cache,
 * all or nothing. keys and values each hold [B, H_kv, rows, d_h] f64 (B the
 * batch, H_kv the binding's kv_heads, d_h its head_width), row-major, the
 * layout kvp_cache_keys exports: element (b, h, r, i) at
 * ((b * H_kv + h) * rows + r) * d_h + i; row r lands at position len + r.
 * Each element is rounded once to the pool's dtype (kvp_dtype, pool.h), as
 * attention's commits round (fp8: x / k_scale or x / v_scale rounded). `rows` may be anything up to the room left;
 * rows == 0 succeeds and changes nothing (keys and values may then be NULL).
 * Errors, in this order, all before any page is taken: NULL_ARGUMENT (cache);
 * CACHE_LAYER_BOUND; ROWS_RESERVED (a reservation is pending, below);
 * NULL_ARGUMENT (keys, values); FULL (err.what "rows", err.tokens = rows,
 * err.available = capacity - len); NONFINITE_KEY, then NONFINITE_VALUE: the
 * first element not finite as stored (err.index its flat index in keys or
 * values, err.what NULL or the dtype's name, as status.h says); then
 * POOL_EXHAUSTED when the pages of every lane cannot all be taken. On any
 * error nothing changed. Pages are taken lane by lane within each new block,
 * block by block, as attention takes them.
 * Threads: one caller at a time per cache (its owner), and not while a read
 * of it runs; other caches of the same pool may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_append_rows(kvp_cache *cache, const double *keys,
                                                       const double *values, size_t rows,
                                                       kvp_error *err);

/*
 * kvp_cache_append_rows with rows in another format: keys and values hold
 * [B, H_kv, rows, d_h] elements of src_dtype, laid out as above: KVP_F64
 * (double), KVP_F32 (float), KVP_BF16 (uint16_t bfloat16 bits) or KVP_F16
 * (uint16_t IEEE binary16 bits), in the host's byte order. Each element is
 * widened to f64 (exact for all four) and then treated as an f64 row is:
 * checked (NONFINITE_KEY / NONFINITE_VALUE on the widened value: not
 * finite, or overflowing the pool's dtype) and rounded once to the pool's
 * dtype. So rows already in the pool's dtype are stored bit for bit (an f32
 * row in an f32 pool, bf16 in bf16), and f32 rows in a bf16 pool are
 * rounded once, directly. Errors: kvp_cache_append_rows's, in its order,
 * with INVALID_ARGUMENT (argument "src_dtype": none of the four) right
 * after ROWS_RESERVED. kvp_cache_append_rows is this call with KVP_F64.
 * Threads: one caller at a time per cache (its owner), and not while a read
 * of it runs; other caches of the same pool may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_append_rows_typed(kvp_cache *cache,
                                                             kvp_dtype src_dtype,
                                                             const void *keys,
                                                             const void *values, size_t rows,
                                                             kvp_error *err);

/*
 * The same transaction in two halves, for callers that compute rows after
 * making sure they will fit: reserve takes now every page that `rows` more
 * rows need (all lanes; all or none); commit writes rows into them later, and
 * cannot run out of pages; discard gives back what is left. A cache holds at
 * most one reservation, inside it (nothing is allocated). While it is
 * pending, its pages are held by the cache's reservation (kvp_pool_check
 * counts them, I3; attached_reservations counts it while it holds a page:
 * rows that fit the last block's free slots need none) and are tentative
 * (kvp_pool_stats.tentative_pages): acquires and the high-water mark count a
 * page only when a commit uses it, so reserve + discard leaves every counter
 * as it was. Pages come from the cache's promise first (kvp_cache_promise);
 * discard gives the promise back for the pages it returns.
 *
 * reserve: rows == 0 succeeds and reserves nothing. Errors, in this order:
 * NULL_ARGUMENT; CACHE_LAYER_BOUND; ROWS_RESERVED (err.tokens = the rows
 * already reserved); FULL (as append_rows); POOL_EXHAUSTED.
 * Threads: one caller at a time per cache (its owner), and not while a read
 * of it runs; other caches of the same pool may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_reserve_rows(kvp_cache *cache, size_t rows,
                                                        kvp_error *err);

/*
 * Commits the first `rows` of the reserved rows (keys and values laid out as
 * for kvp_cache_append_rows with this `rows`); the rest stays reserved for
 * later commits. rows == 0 succeeds and changes nothing. Errors, in this
 * order: NULL_ARGUMENT (cache); CACHE_LAYER_BOUND; ROWS_NOT_RESERVED (rows >
 * reserved rows: err.tokens = rows, err.available = the rows reserved);
 * NULL_ARGUMENT (keys, values); NONFINITE_KEY; NONFINITE_VALUE. On error
 * nothing changed and the reservation is still pending.
 * Threads: one caller at a time per cache (its owner), and not while a read
 * of it runs; other caches of the same pool may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_commit_rows(kvp_cache *cache, const double *keys,
                                                       const double *values, size_t rows,
                                                       kvp_error *err);

/*
 * kvp_cache_commit_rows with rows of src_dtype (kvp_cache_append_rows_typed
 * says how they are widened, checked and rounded). Errors:
 * kvp_cache_commit_rows's, in its order, with INVALID_ARGUMENT (argument
 * "src_dtype") right after CACHE_LAYER_BOUND. kvp_cache_commit_rows is this
 * call with KVP_F64.
 * Threads: one caller at a time per cache (its owner), and not while a read
 * of it runs; other caches of the same pool may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_commit_rows_typed(kvp_cache *cache,
                                                             kvp_dtype src_dtype,
                                                             const void *keys,
                                                             const void *values, size_t rows,
                                                             kvp_error *err);

/*
 * Writing in place (vLLM's reshape_and_cache): after kvp_cache_reserve_rows,
 * a kernel writes the reserved rows straight into their pages, in the
 * page's format (kvp_page_layout: the pool's dtype, host byte order), then
 * kvp_cache_commit_written makes them visible, or kvp_cache_discard_rows
 * gives the pages back. A span is a run of consecutive reserved rows of one
 * lane that lie in one page:
 *     key element (KV head h, reserved row row + i, feature f), i < rows, at
 *         (unsigned char *)keys + h * head_stride_bytes + i * row_stride_bytes
 *                                + f * element_bytes
 *     and the value element at the same offset from `values`.
 * Reserved row r is position len + r. A fixed layout (an array element):
 * it never grows; a later need gets a new struct and call.
 */
typedef struct kvp_slot_span {
    size_t row;               /* the span's first reserved row (position len + row) */
    size_t rows;              /* consecutive reserved rows in the span, all in `page` */
    uint32_t page;            /* the page holding them (kvp_pool_page_base: its address) */
    void *keys;               /* key element (head 0, row `row`, feature 0) */
    void *values;             /* value element (head 0, row `row`, feature 0) */
    size_t row_stride_bytes;  /* from a row to the next, same head: head_width elements */
    size_t head_stride_bytes; /* from a head to the next, same row: block_tokens rows */
} kvp_slot_span;

/*
 * Where a kernel writes the pending reservation's rows of `lane`: the spans
 * in row order (out[0].row == 0, each span's row = the previous row + rows,
 * the last ending at kvp_cache_reserved_rows), one per block the rows
 * touch: at most reserved / block_tokens + 2.
 * *count = the spans. out == NULL with max == 0 asks for the count only
 * (and evicts nothing).
 * With no reservation pending, *count = 0. The addresses are valid until
 * the reservation ends (a commit of those rows, a discard, a reset or
 * destroy); after a partial commit ask again (rows renumber from the new
 * len). Write only these slots, and every element of them before a commit
 * (commit_written reads them). A shared partial last page is never given
 * out: its rows go to the copy the reservation took (copy-on-write; the
 * commit copies the older rows over). A reserved page borrowed from the
 * prefix cache's evictable list (pool.h, "Sharing") is evicted by this call
 * (its cached block could not survive the writes): its index entry goes,
 * `evictions` counts it, and a later discard returns it to the free list.
 * Errors, in this order: NULL_ARGUMENT ("cache", "count", "out" when max >
 * 0); CACHE_LAYER_BOUND; OUT_OF_RANGE ("lane"); BUFFER_TOO_SMALL ("out",
 * err.needed = the spans, when max is smaller and out not NULL). Nothing
 * changes on error.
 * Threads: one caller at a time per cache (its owner; it may evict), not
 * while a read of it runs. Kernels may then write disjoint spans from any
 * threads; the owner's commit must happen after every write (join them).
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_reserved_slots(kvp_cache *cache, size_t lane,
                                                          kvp_slot_span *out, size_t max,
                                                          size_t *count, kvp_error *err);

/*
 * Commits the first `rows` reserved rows as written in place (the rest stay
 * reserved), exactly as kvp_cache_commit_rows commits rows handed over: the
 * same pages, the same copy-on-write, counters and epoch. Before anything
 * changes, every element of those rows is read back from its page, widened,
 * and must be finite: NONFINITE_KEY, then NONFINITE_VALUE (err.index the
 * flat index in the [B, H_kv, rows, d_h] layout of append_rows, err.value
 * the widened element, err.what NULL). rows == 0 succeeds and changes
 * nothing. Errors, in this order: NULL_ARGUMENT; CACHE_LAYER_BOUND;
 * ROWS_NOT_RESERVED (as commit_rows); NONFINITE_KEY; NONFINITE_VALUE. On
 * error nothing changed and the reservation is still pending (a discard
 * then gives the pages back, their bytes as the kernel left them).
 * Threads: one caller at a time per cache (its owner), and not while a read
 * of it runs; every write into the slots must have happened before (joined
 * threads); other caches of the same pool may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_commit_written(kvp_cache *cache, size_t rows,
                                                          kvp_error *err);

/*
 * Ends the reservation: its unused pages go back to the pool (newest first)
 * with their promise, and the counters forget them. Without a reservation it
 * does nothing. NULL_ARGUMENT only.
 * Threads: one caller at a time per cache (its owner), and not while a read
 * of it runs; other caches of the same pool may be used concurrently.
 */
KVP_API kvp_status kvp_cache_discard_rows(kvp_cache *cache, kvp_error *err);

/*
 * Rows reserved and not yet committed (0: no reservation). NULL gives 0.
 * Threads: not safe while a call changes this cache; reads of one cache may
 * overlap, and other caches of the pool may change meanwhile.
 */
KVP_API size_t kvp_cache_reserved_rows(const kvp_cache *cache);

/*
 * Sets an external cache's promise to `pages` pages it will take later
 * (replacing the old one), as kvp_sequence_promise does for a sequence:
 * kvp_pool_admit counts promised pages as used, and the cache's reserves and
 * appends draw from its promise first. Reset and destroy set it back to 0.
 * Errors: NULL_ARGUMENT; CACHE_LAYER_BOUND (a sequence promises for its
 * layers); OUT_OF_RANGE (pages > B * ceil(capacity / block_tokens), the pages
 * the cache can ever hold).
 * Threads: one caller at a time per cache (its owner), and not while a read
 * of it runs; other caches of the same pool may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_promise(kvp_cache *cache, size_t pages,
                                                   kvp_error *err);

/*
 * The cache's promise not yet taken. NULL gives 0.
 * Threads: not safe while a call changes this cache; reads of one cache may
 * overlap, and other caches of the pool may change meanwhile.
 */
KVP_API size_t kvp_cache_promised_pages(const kvp_cache *cache);

/*
 * Pages the cache needs to grow from its length to `tokens` positions:
 * B * (ceil(tokens / block_tokens) - ceil(len / block_tokens)), plus B when
 * the partial last page is shared and the next append must copy it first
 * (copy-on-write; see "Sharing" below); 0 when tokens <= len. Reserve,
 * promise and admit with this count. NULL gives 0.
 * Threads: not safe while a call changes this cache; reads of one cache may
 * overlap, and other caches of the pool may change meanwhile.
 */
KVP_API size_t kvp_cache_pages_for(const kvp_cache *cache, size_t tokens);

/*
 * The most pages the cache holds at once while single steps bring it from
 * empty to `len` positions: for a cache of a sliding layer (window W, sinks
 * S, front truncation) B * the largest, over n <= len, count of blocks
 * covering [0, min(S, n)) and [max(0, n - 1 - W), n) (during the commit to
 * n the new block is taken before the oldest goes), at most
 * B * (ceil(S / bt) + ceil((W + 1) / bt) + 1); B * ceil(len / bt) for a full
 * or external cache. Admission of a sliding layer counts this, not the full
 * length. A prefill (one transaction) releases only at its end, so it holds
 * every block it writes until then. NULL gives 0.
 * Threads: thread-safe for a cache no call is destroying (reads fields set
 * at creation).
 */
KVP_API size_t kvp_cache_pages_held_max(const kvp_cache *cache, size_t len);

/*
 * The block table of `lane`: *table receives the page ids of blocks 0 ..
 * *blocks - 1, in position order (position p lives in page (*table)[p /
 * block_tokens] at slot p % block_tokens; kvp_pool_page_data gives its
 * address), and *blocks = ceil(len / block_tokens). Any cache, layer-bound or
 * external. A block a sliding window released (past the sink blocks and
 * entirely below len - W) reads as KVP_PAGE_RELEASED: no page, never to be
 * passed to kvp_pool_page_data. The table is the cache's own, read-only, and valid until the next
 * call that changes this cache (an append, commit, reserve, discard, reset,
 * destroy, or a step, prefill or reset of the sequence that owns it); the
 * page ids stay held, and their data valid, as long. Errors: NULL_ARGUMENT
 * (cache, table, blocks); OUT_OF_RANGE (lane >= B). Allocates nothing.
 * Threads: not safe while a call changes this cache, and neither is reading
 * the table or its pages' rows; reads of one cache may overlap (an external
 * kernel may gather on many threads), and other caches of the pool may
 * change meanwhile.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_block_table(const kvp_cache *cache, size_t lane,
                                                       const uint32_t **table, size_t *blocks,
                                                       kvp_error *err);

/*
 * Plain queries. A NULL cache reads as 0 / false; they never fail.
 * Threads: not safe while a call changes this cache; reads of one cache may
 * overlap, and other caches of the pool may change meanwhile.
 */
KVP_API size_t kvp_cache_len(const kvp_cache *cache);
KVP_API size_t kvp_cache_capacity(const kvp_cache *cache);
KVP_API int kvp_cache_is_empty(const kvp_cache *cache);
KVP_API int kvp_cache_is_full(const kvp_cache *cache);

/* ---- sharing: fork, truncate, the prefix index --------------------------- */

/*
 * Pages are reference counted: several caches' page tables may name one page
 * (kvp_pool_check's I3 counts every name). A full page is never written
 * again, so it is shared as is. A partial last page that is shared (after a
 * fork) or published (after a truncate into a published block) is copied
 * before the next append of EITHER side writes to it: copy-on-write. The
 * copy is taken in the same transaction as the append (attention's prepare
 * and a step or prefill reserve it, kvp_cache_append_rows and
 * kvp_cache_reserve_rows reserve it; kvp_cache_pages_for counts it), so a
 * POOL_EXHAUSTED append changes nothing, the copy included.
 */

/*
 * Creates *child with the parent's binding, batch, capacity and length,
 * sharing every page of the parent (each page's reference count + 1), the
 * partial last page included; the child's promise is 0. When the length is
 * mid-block both caches are marked copy-on-write and the parent's epoch
 * advances (a ticket prepared on the parent before the fork must be
 * prepared again: TICKET_STALE). Forks of forks work; destroying any of
 * them, in any order, returns exactly the pages no other cache names.
 * Errors, in this order: NULL_ARGUMENT ("parent", "child"); ROWS_RESERVED
 * (the parent holds a row reservation); kvp_cache_create's
 * ALLOCATION_FAILED. Nothing changes on failure.
 * Threads: one caller at a time per parent (its owner), and not while a read
 * of it runs; other caches of the pool, even those sharing its pages, may be
 * used concurrently (the pool's mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_fork(kvp_cache *parent, kvp_cache **child,
                                                kvp_error *err);

/*
 * Shortens the cache to new_len: the pages of blocks wholly past new_len
 * lose this cache's reference (a page no table names goes back to the
 * pool, or to the evictable list if published). A now-partial last page
 * that is shared or published is not copied now: the next append copies it
 * (copy-on-write). The epoch advances (prepared tickets become stale). The
 * promise is unchanged. new_len == len succeeds and changes nothing.
 * Errors, in this order: NULL_ARGUMENT; ROWS_RESERVED; OUT_OF_RANGE
 * ("new_len", when new_len > len). Nothing changes on failure.
 * Threads: one caller at a time per cache (its owner), and not while a read
 * of it runs; other caches of the same pool may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_truncate(kvp_cache *cache, size_t new_len,
                                                    kvp_error *err);

/*
 * The binding digest of the cache: a kvp_block_key over every field of its
 * kvp_binding (kind, KV heads, head width, max_positions, the owner's
 * digest, revision and record bytes, and the K and V scales the cache uses:
 * its binding's for an fp8 pool, 1.0 and 1.0 for any other) and of the
 * pool's page format (dtype, block_tokens, heads, head_width). So an owner's
 * new revision (a layer's parameter update, an engine's new weights) gives
 * new keys. Callers chain several of them into the
 * `context` of kvp_block_key_chain (a sequence digests all its layers).
 * Errors: NULL_ARGUMENT.
 * Threads: not safe while a call changes this cache (it reads the binding);
 * reads of one cache may overlap.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_binding_key(const kvp_cache *cache,
                                                       kvp_block_key *out, kvp_error *err);

/*
 * The chain key of one block of one lane: a 128-bit BLAKE2b keyed with the
 * pool's secret (kvp_pool_config.key_secret: random unless given, so only
 * this process, or those given the secret, can predict or collide keys) over
 * the cache's binding digest (always: a key can only be made from a cache, so a
 * revision bump or a RoPE change gives keys no older block can match),
 * `parent` (the previous block's key; NULL for block 0), `context` (an
 * optional digest of whatever else the rows depend on, NULL for none: a
 * sequence passes the digest of all its layers' bindings) and the `bytes`
 * bytes at `input` (the block's input rows, as the caller defines them).
 * Never the all-zero key. Errors: NULL_ARGUMENT ("cache"; "input" when bytes
 * > 0; "out").
 * Threads: thread-safe with other reads of the cache (reads its binding).
 */
KVP_API KVP_NODISCARD kvp_status kvp_block_key_chain(const kvp_block_key *parent,
                                                     const kvp_cache *cache, const void *input,
                                                     size_t bytes,
                                                     const kvp_block_key *context,
                                                     kvp_block_key *out, kvp_error *err);

/*
 * Registers the page of (lane, block), a full block, in the pool's prefix
 * index under `key`, so kvp_cache_adopt_prefix of any cache can share it.
 * The page stays in the index until it is evicted: when no table names it,
 * it waits on the pool's LRU list of evictable pages (not the free list),
 * and a take that finds no free page reuses the least recently used one.
 * The page records the cache's binding digest: adopt refuses it to a cache
 * of another binding, whatever the key (BLOCK_BINDING_MISMATCH).
 * Already registered under `key`, or `key` already naming another page:
 * success, nothing changes. Errors, in this order: NULL_ARGUMENT ("cache",
 * "key"); OUT_OF_RANGE ("lane"; "block" when block >= len / block_tokens,
 * i.e. not full); BLOCK_RELEASED (the window released that block: there is
 * no page to name; kvp_cache_group_publish skips such blocks instead);
 * PAGE_PUBLISHED (the page is registered under another key).
 * Threads: one caller at a time per cache (its owner); other caches of the
 * pool may be used concurrently (the index is under the pool's mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_publish_block(kvp_cache *cache, size_t lane,
                                                         size_t block, const kvp_block_key *key,
                                                         kvp_error *err);

/*
 * Shares published blocks (counted in blocks, not tokens: a sequence's
 * kvp_sequence_adopt_prefix counts tokens, and each parameter names its
 * unit): for b = 0, 1, .. blocks-1, looks up keys[b * B + lane]
 * for every lane (block len / block_tokens + b of each lane); at the first
 * block where a lane misses it stops (one prefix miss); every block before
 * it is mapped (each page's reference count + 1, an evictable page held
 * again, one prefix hit per page) and len grows by block_tokens per block.
 * Blocks past the capacity are not looked up. A cache with a sliding
 * window (kvp_layer_set_window) needs only the blocks it would keep at the
 * prefix's length L: its sink blocks and those covering [L - W, L); it
 * adopts the longest prefix whose needed blocks all hit (so a miss before
 * the window does not end it), and its other blocks stay null entries
 * (KVP_PAGE_RELEASED), as if computed and released (see
 * kvp_cache_group_adopt). *blocks_adopted = blocks
 * adopted (0 is success). Errors, in this order: NULL_ARGUMENT ("cache",
 * "keys" when blocks > 0, "adopted"); ROWS_RESERVED; NOT_AT_BLOCK_BOUNDARY (len is not a
 * multiple of block_tokens); BLOCK_BINDING_MISMATCH (a page of a block that
 * would be adopted was published by a cache of another binding digest: its
 * key was made elsewhere; err.index is the page, err.position the block's
 * first position). A mismatch is an error, not a miss: a key made from this
 * cache can reach such a page only through a forged or misdirected publish.
 * Nothing changes on failure (no hit or miss counted either).
 * Threads: one caller at a time per cache (its owner); other caches of the
 * pool may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_adopt_prefix(kvp_cache *cache,
                                                        const kvp_block_key *keys, size_t blocks,
                                                        size_t *blocks_adopted, kvp_error *err);

/*
 * Sharing for a group of caches at once: the layers of one sequence (an
 * engine's external caches, one per layer, or layer-bound ones), which must
 * stay the same length. Each call holds the pool's mutex for the whole
 * group, so no other thread can evict or publish a block between one
 * cache's lookup and the next's: the group adopts block j in every cache or
 * in none. `caches` are `count` (>= 1) caches of one pool, one batch size B
 * and one length; keys[(j * count + c) * B + lane] is block j of cache c,
 * lane `lane` (counted from the caches' length for probe and adopt, from
 * block 0 for publish). Group errors, checked first: NULL_ARGUMENT
 * ("caches", also for a NULL entry); INVALID_ARGUMENT ("count" zero;
 * "caches": not one pool, batch size and length). Nothing changes on
 * failure.
 */

/*
 * What kvp_cache_group_adopt would adopt now: *blocks = the prefix length
 * (at most n, and at most what every cache has room for) its rule finds
 * (windows included); *evictable_pages (may be NULL) = how many of the
 * pages it would map no table names (adopting takes them from the pool's
 * available pages).
 * Changes nothing, counters included. A later adopt may find less: other
 * threads publish and evict meanwhile. Errors: the group's; NULL_ARGUMENT
 * ("keys" when n > 0, "blocks"); BLOCK_BINDING_MISMATCH (as adopt).
 * Threads: not safe while a call changes a cache of the group (reads their
 * bindings and lengths); any other call may run at once (the pool's mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_group_probe(const kvp_cache *const *caches,
                                                       size_t count, const kvp_block_key *keys,
                                                       size_t n, size_t *blocks,
                                                       size_t *evictable_pages, kvp_error *err);

/*
 * kvp_cache_adopt_prefix for a group, all or nothing per block: the group
 * adopts the longest prefix of h blocks (at most `blocks`) for which every
 * cache hits every block it needs at length L = len + h * block_tokens, in
 * every lane: a full cache (no window) every block, found left to right; a
 * sliding cache (window W, S sink tokens) its sink blocks (those covering
 * [0, S)) and the blocks covering [L - W, L), found right to left within
 * the length the full caches allow; a sliding cache's miss at block m
 * leaves only prefixes ending before m, which moves every sliding cache's
 * window, so the rule runs to a fixpoint (vLLM's hybrid rule; DESIGN.md
 * "Prefix hits with windows"). A shorter prefix than `blocks` counts one
 * prefix miss; each page mapped one prefix hit. Every cache maps the
 * blocks it needs; a sliding cache's other blocks stay null entries
 * (released), so an adopted cache is the cache that computed those rows
 * and released what its window let go; each length grows by
 * block_tokens per block.
 * *blocks_adopted = blocks adopted. Errors, in this order: the group's;
 * NULL_ARGUMENT ("keys" when blocks > 0, "adopted"); ROWS_RESERVED,
 * NOT_AT_BLOCK_BOUNDARY (the first cache that has one);
 * BLOCK_BINDING_MISMATCH (err.layer = the cache; see kvp_cache_adopt_prefix):
 * nothing adopted in any cache.
 * Threads: one caller at a time per cache of the group (their owner); other
 * caches of the pool may be used at once, those sharing its pages included.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_group_adopt(kvp_cache *const *caches, size_t count,
                                                       const kvp_block_key *keys, size_t blocks,
                                                       size_t *blocks_adopted, kvp_error *err);

/*
 * kvp_cache_publish_block for the first `blocks` full blocks of every cache
 * and lane of a group, all or nothing: PAGE_PUBLISHED (err.index = the page,
 * err.layer = its cache) when any page is registered under another key, and
 * then nothing is registered. Each cache publishes what it holds: a block
 * its window released (a null entry) has no page and is skipped, never
 * refused (a sliding cache's adopters need only the blocks it keeps; to
 * publish a block before the window lets it go, publish as it fills). Pages already registered under their key, or
 * whose key names another page, are left as they are. Each page records its
 * cache's binding digest. Errors, in this order: the group's; NULL_ARGUMENT
 * ("keys" when blocks > 0); OUT_OF_RANGE ("blocks" > len / block_tokens);
 * PAGE_PUBLISHED.
 * Threads: one caller at a time per cache of the group (their owner); other
 * caches of the pool may be used at once (the index is under the pool's
 * mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_group_publish(kvp_cache *const *caches, size_t count,
                                                         const kvp_block_key *keys,
                                                         size_t blocks, kvp_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_CACHE_H */
