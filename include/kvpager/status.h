/*
 * kvpager/status.h: the one status enum, the error-detail struct, and the
 * formatter that renders an error as text.
 *
 * Owns: KVP_STATUS_MAP, the single list from which the enum, the name table
 * and the message table are generated, so the three can never drift apart.
 *
 * Contract shared by every fallible kvpager call:
 *   - it returns KVP_OK or one typed status;
 *   - its last parameter is an optional `kvp_error *err` (NULL is allowed);
 *     on failure *err is overwritten with the status and its detail fields,
 *     on success it is left untouched;
 *   - out-parameters are written only on success;
 *   - on failure, nothing the call could have changed has changed: pool
 *     free list and reference counts, promises, cache lengths, logical rows,
 *     page tables, attached holders, and every statistic of kvp_pool_stats
 *     (acquires, releases, high-water mark included), unless the call's own
 *     documentation says otherwise. The one counter that counts failures is
 *     kvp_pool_stats.exhaustions: it is the number of requests refused with
 *     POOL_EXHAUSTED, so a call failing with POOL_EXHAUSTED adds exactly one
 *     to it (that refusal is what it records); no other failure changes it.
 *     A prefill takes its pages tentatively (kvp_pool_stats in pool.h), so
 *     even one that fails after computing some tokens leaves every counter as
 *     it was. The test suite checks all of this for every failing call of
 *     every public function.
 *
 * Error texts: for the variants inherited from the seed chapter's
 * LayerKvCacheError and IncrementalAttentionError, kvp_error_format renders
 * the seed's Display text byte for byte (shapes as Rust's `{:?}` of a
 * Vec<usize>, floats as Rust's `{:?}` of an f64).
 */
#ifndef KVPAGER_STATUS_H
#define KVPAGER_STATUS_H

#include "kvpager/common.h"
#include "kvpager/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * X(SUFFIX, value, "Name", "short message"). The Name is the seed's variant
 * name where one exists.
 *
 * The values are part of the ABI: a status keeps its number forever. A new
 * status is appended at the END of the list with the next number (the last
 * value + 1), never inserted into a group, and no status is ever renumbered
 * or reused, so a program compiled against an older kvpager reads every
 * status it knows with its old meaning. The values are dense (0 .. count-1,
 * in list order), which the name and message tables rely on; test_status
 * pins them.
 */
#define KVP_STATUS_MAP(X)                                                                          \
    X(OK, 0, "Ok", "success")                                                                      \
    /* caller mistakes */                                                                          \
    X(NULL_ARGUMENT, 1, "NullArgument", "a required argument was NULL")                            \
    X(INVALID_ARGUMENT, 2, "InvalidArgument", "an argument is invalid")                            \
    X(OUT_OF_RANGE, 3, "OutOfRange", "an index argument is out of range")                          \
    X(BUFFER_TOO_SMALL, 4, "BufferTooSmall", "an output buffer is too small")                      \
    /* pool */                                                                                     \
    X(ZERO_SIZE, 5, "ZeroSize", "a pool size is zero")                                             \
    X(SIZE_OVERFLOW, 6, "SizeOverflow", "a pool size overflows")                                   \
    X(BUDGET_TOO_SMALL, 7, "BudgetTooSmall", "the pool budget is below one page")                  \
    X(ALLOCATION_FAILED, 8, "AllocationFailed", "a heap allocation failed")                        \
    X(POOL_EXHAUSTED, 9, "PoolExhausted", "the page pool has too few free pages")                  \
    X(POOL_BUSY, 10, "PoolBusy", "the page pool still has attached caches or held pages")          \
    X(GEOMETRY_MISMATCH, 11, "GeometryMismatch", "cache geometry differs from the pool's")         \
    X(AUDIT_FAILED, 12, "AuditFailed", "the page pool audit found mismatches")                     \
    /* layer cache (the seed's LayerKvCacheError) */                                               \
    X(ZERO_BATCH_SIZE, 13, "ZeroBatchSize", "KV cache batch size must be nonzero")                 \
    X(ZERO_CAPACITY, 14, "ZeroCapacity", "KV cache capacity must be nonzero")                      \
    X(CAPACITY_EXCEEDS_POSITIONS, 15, "CapacityExceedsPositions",                                  \
      "KV cache capacity exceeds RoPE position capacity")                                          \
    X(ELEMENT_COUNT_OVERFLOW, 16, "ElementCountOverflow", "KV cache element count overflows")      \
    X(FULL, 17, "Full", "KV cache is full")                                                        \
    X(KEY_SHAPE_MISMATCH, 18, "KeyShapeMismatch", "appended key has the wrong shape")              \
    X(VALUE_SHAPE_MISMATCH, 19, "ValueShapeMismatch", "appended value has the wrong shape")        \
    X(NONFINITE_KEY, 20, "NonFiniteKey", "appended key is not finite")                             \
    X(NONFINITE_VALUE, 21, "NonFiniteValue", "appended value is not finite")                       \
    /* incremental attention (the seed's IncrementalAttentionError, then tickets) */               \
    X(INPUT_RANK, 22, "InputRank", "incremental attention input must have rank three")             \
    X(SINGLE_TOKEN_REQUIRED, 23, "SingleTokenRequired",                                            \
      "incremental attention needs exactly one new token")                                         \
    X(INPUT_BATCH_MISMATCH, 24, "InputBatchMismatch", "input batch differs from the cache's")      \
    X(INPUT_WIDTH_MISMATCH, 25, "InputWidthMismatch", "input width differs from the model's")      \
    X(CACHE_MODEL_WIDTH_MISMATCH, 26, "CacheModelWidthMismatch",                                   \
      "KV cache model width differs from the layer's")                                             \
    X(CACHE_HEAD_COUNT_MISMATCH, 27, "CacheHeadCountMismatch",                                     \
      "KV cache head count differs from the layer's")                                              \
    X(CACHE_HEAD_WIDTH_MISMATCH, 28, "CacheHeadWidthMismatch",                                     \
      "KV cache head width differs from the layer's")                                              \
    X(CACHE_LAYER_MISMATCH, 29, "CacheLayerMismatch",                                              \
      "KV cache parameter identity does not match this attention layer")                           \
    X(CACHE_LAYER_REVISION_MISMATCH, 30, "CacheLayerRevisionMismatch",                             \
      "KV cache parameter revision does not match the layer's")                                    \
    X(CACHE_ROPE_MISMATCH, 31, "CacheRopeMismatch", "KV cache RoPE configuration differs")         \
    X(NONFINITE_PROJECTION, 32, "NonFiniteProjection", "a Q/K/V projection is not finite")         \
    X(NONFINITE_SCORE, 33, "NonFiniteScore", "an attention score is not finite")                   \
    X(NONFINITE_OUTPUT, 34, "NonFiniteOutput", "the attention output is not finite")               \
    X(TICKET_BUSY, 35, "TicketBusy", "the ticket already holds a prepared row")                    \
    X(TICKET_EMPTY, 36, "TicketEmpty", "the ticket holds no prepared row")                         \
    X(TICKET_FOREIGN_CACHE, 37, "TicketForeignCache", "the ticket was prepared for another cache") \
    X(TICKET_STALE, 38, "TicketStale", "the cache changed since the ticket was prepared")          \
    X(TICKET_GEOMETRY_MISMATCH, 39, "TicketGeometryMismatch", "the ticket does not fit the cache") \
    /* layers, parameters and RoPE */                                                              \
    X(ROPE_INVALID_WIDTH, 40, "RopeInvalidWidth", "RoPE feature width must be even and nonzero")   \
    X(ROPE_ZERO_POSITIONS, 41, "RopeZeroPositions", "RoPE max positions must be nonzero")          \
    X(ROPE_INVALID_BASE, 42, "RopeInvalidBase", "RoPE base must be finite and positive")           \
    X(ROPE_POSITION_OUT_OF_RANGE, 43, "RopePositionOutOfRange", "a RoPE position is out of range") \
    X(PARAMETER_WIDTH_MISMATCH, 44, "ParameterWidthMismatch",                                      \
      "an attention parameter has the wrong width")                                                \
    X(HEADS_DO_NOT_DIVIDE_WIDTH, 45, "HeadsDoNotDivideWidth",                                      \
      "the model width is not a nonzero multiple of the head count")                               \
    X(REFERENCE_INPUT_SHAPE, 46, "ReferenceInputShape", "full-prefix input has the wrong shape")   \
    /* models, sequences and decoders */                                                           \
    X(MODEL_GEOMETRY_MISMATCH, 47, "ModelGeometryMismatch",                                        \
      "a model layer's head geometry differs from layer 0's")                                      \
    X(THREAD_FAILED, 48, "ThreadFailed", "a worker thread could not be started")                   \
    /* appended after 0.1.0 (the groups above are closed: new statuses go here) */                 \
    X(DECODER_BUSY, 49, "DecoderBusy", "the decoder is already running a step")                    \
    X(MODEL_BUSY, 50, "ModelBusy", "the model still has live sequences")                              \
    X(KV_HEADS_DO_NOT_DIVIDE_HEADS, 51, "KvHeadsDoNotDivideHeads",                                 \
      "the head count is not a nonzero multiple of the KV head count")                             \
    X(CACHE_KV_HEAD_COUNT_MISMATCH, 52, "CacheKvHeadCountMismatch",                                \
      "KV cache KV head count differs from the layer's")                                           \
    X(CACHE_LAYER_BOUND, 53, "CacheLayerBound",                                                    \
      "rows enter a layer-bound cache only through attention")                                     \
    X(ROWS_RESERVED, 54, "RowsReserved", "the cache already holds a row reservation")              \
    X(ROWS_NOT_RESERVED, 55, "RowsNotReserved", "more rows committed than the cache reserved")     \
    X(PAGE_NOT_HELD, 56, "PageNotHeld",                                                            \
      "the page is not held (free or evictable): only held pages have data")                       \
    X(NOT_AT_BLOCK_BOUNDARY, 57, "NotAtBlockBoundary",                                             \
      "the cache length is not a multiple of block_tokens")                                        \
    X(PAGE_PUBLISHED, 58, "PagePublished", "the page is already published under another key")      \
    X(BLOCK_BINDING_MISMATCH, 59, "BlockBindingMismatch",                                          \
      "a published block was computed under another binding than the adopting cache's")            \
    X(REQUEST_UNKNOWN, 60, "RequestUnknown",                                                       \
      "the scheduler holds no request with this id: collected, or never submitted")             \
    X(CACHE_WINDOW_MISMATCH, 61, "CacheWindowMismatch",                                            \
      "KV cache attention window or sink tokens differ from the layer's")                          \
    X(TIER_BLOCK_REJECTED, 62, "TierBlockRejected",                                               \
      "a tier block failed verification: it is never mapped")                                    \
    X(TIER_UNAVAILABLE, 63, "TierUnavailable", "the tier could not serve the block or batch")    \
    X(BLOCK_RELEASED, 64, "BlockReleased",                                                         \
      "the block's page was released: it fell outside the attention window")

typedef enum kvp_status {
#define KVP_STATUS_ENUM_(suffix, value, name, message) KVP_##suffix = value,
    KVP_STATUS_MAP(KVP_STATUS_ENUM_)
#undef KVP_STATUS_ENUM_
    KVP_STATUS_COUNT_ /* one past the last status: grows with each appended status */
} kvp_status;

/* The invariants of DESIGN.md that kvp_pool_check recomputes. */
typedef enum kvp_invariant {
    KVP_INVARIANT_STATS = 0,        /* cached counters agree with recomputed ones */
    KVP_INVARIANT_CONSERVATION = 1, /* I1: free + evictable + held == total */
    KVP_INVARIANT_NO_DUPLICATES = 2,/* I2: no page on the free list twice */
    KVP_INVARIANT_REFERENCES = 3,   /* I3: refcount == references from tables and reservations */
    KVP_INVARIANT_LANE_COVERAGE = 4, /* I4: a lane of length len maps ceil(len/block) pages */
    KVP_INVARIANT_PREFIX = 5        /* I5: prefix index, LRU list and copy-on-write marks */
} kvp_invariant;

/* One audit finding. `page` or `lane` is SIZE_MAX where it does not apply. */
typedef struct kvp_mismatch {
    kvp_invariant invariant;
    const char *what;   /* static text naming the quantity that disagrees */
    size_t page;
    size_t lane;
    size_t expected;    /* the value recomputed from scratch */
    size_t actual;      /* the value the pool or cache holds */
} kvp_mismatch;

/*
 * Detail of a failure. Only the fields listed for the status are meaningful;
 * the rest are zero.
 *
 * Size and layout: callers allocate kvp_error (and kvp_decode_job embeds
 * one), so its size and field offsets are part of the ABI. It may grow only
 * behind a `struct_size` field that the caller sets, by which the library
 * knows how much of the struct an older caller has; until that field exists,
 * no field is added, removed or moved. A new status reports its detail
 * through the fields already here (DECODER_BUSY and MODEL_BUSY need none).
 */
typedef struct kvp_error {
    kvp_status status;

    /* NULL_ARGUMENT, INVALID_ARGUMENT, OUT_OF_RANGE, BUFFER_TOO_SMALL, ZERO_SIZE:
     * the parameter (or field) name. */
    const char *argument;
    /* INVALID_ARGUMENT: why; ALLOCATION_FAILED: the object being allocated;
     * INPUT_RANK and FULL: "prompt" when the input was a prefill prompt (NULL
     * for a decode input); FULL: "rows" for kvp_cache_append_rows and
     * kvp_cache_reserve_rows; NONFINITE_PROJECTION: "query", "key" or "value";
     * PAGE_NOT_HELD: "free" (on the free list) or "evictable" (cached in the
     * prefix index, but no page table names it);
     * NONFINITE_KEY and NONFINITE_VALUE: NULL when the element is not finite,
     * or the pool's storage type ("f32", "bf16") when it is a finite f64
     * that the type cannot hold (it would round to infinity; pool.h). */
    const char *what;

    /* OUT_OF_RANGE: index must be below limit. PAGE_NOT_HELD: index is the page.
     * PAGE_PUBLISHED, BLOCK_BINDING_MISMATCH: index is the page, `layer` the
     * cache within the group (the sequence's layer; 0 for one cache), and for
     * BLOCK_BINDING_MISMATCH `position` the block's first position.
     * REQUEST_UNKNOWN: index is the request id, limit the next id submit gives.
     * TIER_BLOCK_REJECTED: `what` the check that failed ("size", "magic",
     * "version", "mac", "geometry", "key", "binding"; kvpager/tier.h),
     * `bytes` the block's size. TIER_UNAVAILABLE: `what` the tier's name.
     * NONFINITE_*: flat index and the value found (NONFINITE_PROJECTION names
     * the projection, "query", "key" or "value", in `what`). */
    size_t index;
    size_t limit;
    double value;

    /* KEY_SHAPE_MISMATCH / VALUE_SHAPE_MISMATCH; REFERENCE_INPUT_SHAPE (actual);
     * PARAMETER_WIDTH_MISMATCH: [rows, cols] of the parameter expected and found. */
    kvp_shape expected;
    kvp_shape actual;

    /* ZERO_*, CAPACITY_EXCEEDS_POSITIONS, ELEMENT_COUNT_OVERFLOW, FULL,
     * SIZE_OVERFLOW: the sizes involved. */
    size_t batch_size;
    size_t heads;
    size_t capacity;
    size_t head_width;
    size_t max_positions;
    size_t block_tokens;

    /* ALLOCATION_FAILED: bytes requested. BUDGET_TOO_SMALL: budget and page size. */
    size_t bytes;
    size_t budget_bytes;
    size_t page_bytes;

    /* POOL_EXHAUSTED: pages needed and pages free.
     * BUFFER_TOO_SMALL: elements needed and elements available.
     * FULL for a prompt or rows: `available` positions were left, `tokens` needed.
     * ROWS_RESERVED: `tokens` rows are reserved. ROWS_NOT_RESERVED: `tokens`
     * rows were to be committed, `available` rows are reserved. */
    size_t needed;
    size_t available;

    /* GEOMETRY_MISMATCH: the pool's and the binding's (heads, head width). */
    kvp_geometry pool_geometry;
    kvp_geometry binding_geometry;

    /* POOL_BUSY: what is still attached. */
    size_t attached_caches;
    size_t attached_reservations;
    size_t held_pages;

    /* AUDIT_FAILED: how many mismatches, and the first one. */
    size_t mismatches;
    kvp_mismatch first_mismatch;

    /* INPUT_RANK, SINGLE_TOKEN_REQUIRED, FULL for a prompt: what the input had. */
    size_t rank;
    size_t tokens;
    /* INPUT_BATCH_MISMATCH: expected = cache batch, actual = input batch.
     * INPUT_WIDTH_MISMATCH: expected = model width. PARAMETER_WIDTH_MISMATCH:
     * the first dimension of the parameter that differs (rows, else cols). */
    size_t expected_size;
    size_t actual_size;
    /* CACHE_MODEL_WIDTH/HEAD_COUNT/KV_HEAD_COUNT/HEAD_WIDTH_MISMATCH: the layer's and
     * the cache's. CACHE_WINDOW_MISMATCH: the same, of the field named in `what`
     * ("window", then "sink_tokens"). */
    size_t layer_size;
    size_t cache_size;
    /* CACHE_LAYER_REVISION_MISMATCH, PARAMETER_WIDTH_MISMATCH: parameter index. */
    size_t parameter;
    uint64_t cache_revision;
    uint64_t layer_revision;
    /* CACHE_ROPE_MISMATCH: both configurations. ROPE_*: the rejected one in
     * layer_rope, and for ROPE_POSITION_OUT_OF_RANGE the position. */
    kvp_rope_config cache_rope;
    kvp_rope_config layer_rope;
    size_t position;
    /* HEADS_DO_NOT_DIVIDE_WIDTH, REFERENCE_INPUT_SHAPE: the model width. */
    size_t model_width;
    /* TICKET_STALE: the cache length at prepare and now. */
    size_t prepared_len;
    size_t current_len;
    /* Sequence steps and prefill: the layer whose prepare failed (SIZE_MAX when
     * the failure is the step's own, e.g. POOL_EXHAUSTED); MODEL_GEOMETRY_MISMATCH:
     * the layer that differs, with layer 0's geometry in pool_geometry and its
     * own in binding_geometry. */
    size_t layer;
    /* Prefill: the prompt token whose step failed. kvp_attention_reference's
     * NONFINITE_*: the token (position) whose computation failed. */
    size_t token;
    /* KV_HEADS_DO_NOT_DIVIDE_HEADS: the KV head count (the head count in `heads`).
     * TICKET_GEOMETRY_MISMATCH: the ticket's KV heads (its query heads in `heads`).
     * MODEL_GEOMETRY_MISMATCH: layer `layer`'s KV heads, and layer 0's. */
    size_t kv_heads;
    size_t expected_kv_heads;
} kvp_error;

/*
 * "FULL" -> "Full"; unknown values give "Unknown". Never NULL.
 * Threads: thread-safe (static strings).
 */
KVP_API const char *kvp_status_name(kvp_status status);

/*
 * A short, static description of the status. Never NULL.
 * Threads: thread-safe (static strings).
 */
KVP_API const char *kvp_status_message(kvp_status status);

/*
 * Renders `err` like snprintf: writes at most `size` bytes including the
 * terminating NUL and returns the length the full text needs. A NULL `err`
 * renders "no error detail"; a NULL `buf` with size 0 only measures.
 * Threads: thread-safe (reads *err, writes only buf).
 */
KVP_API size_t kvp_error_format(const kvp_error *err, char *buf, size_t size);

/*
 * Renders one audit finding, with the same return convention.
 * Threads: thread-safe (reads *mismatch, writes only buf).
 */
KVP_API size_t kvp_mismatch_format(const kvp_mismatch *mismatch, char *buf, size_t size);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_STATUS_H */
