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
 *   - on failure, nothing the call could have changed has changed (pool,
 *     cache lengths, logical rows, page tables, statistics), unless the call's
 *     own documentation says otherwise.
 *
 * Error texts: for the variants inherited from the seed chapter's
 * LayerKvCacheError and IncrementalAttentionError, kvp_error_format renders
 * the seed's Display text byte for byte (shapes as Rust's `{:?}` of a
 * Vec<usize>, floats as Rust's `{:?}` of an f64).
 */
#ifndef KVPAGER_STATUS_H
#define KVPAGER_STATUS_H

#include "kvpager/common.h"
#include "kvpager/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * X(SUFFIX, "Name", "short message"). The Name is the seed's variant name
 * where one exists. Append new statuses at the end of their group; the
 * numeric values are not part of the ABI contract before 1.0.
 */
#define KVP_STATUS_MAP(X)                                                                   \
    X(OK, "Ok", "success")                                                                  \
    /* caller mistakes */                                                                   \
    X(NULL_ARGUMENT, "NullArgument", "a required argument was NULL")                        \
    X(INVALID_ARGUMENT, "InvalidArgument", "an argument is invalid")                        \
    X(OUT_OF_RANGE, "OutOfRange", "an index argument is out of range")                      \
    X(BUFFER_TOO_SMALL, "BufferTooSmall", "an output buffer is too small")                  \
    /* pool */                                                                              \
    X(ZERO_SIZE, "ZeroSize", "a pool size is zero")                                         \
    X(SIZE_OVERFLOW, "SizeOverflow", "a pool size overflows")                               \
    X(BUDGET_TOO_SMALL, "BudgetTooSmall", "the pool budget is below one page")              \
    X(ALLOCATION_FAILED, "AllocationFailed", "a heap allocation failed")                    \
    X(POOL_EXHAUSTED, "PoolExhausted", "the page pool has too few free pages")              \
    X(POOL_BUSY, "PoolBusy", "the page pool still has attached caches or held pages")       \
    X(GEOMETRY_MISMATCH, "GeometryMismatch", "cache geometry differs from the pool's")      \
    X(AUDIT_FAILED, "AuditFailed", "the page pool audit found mismatches")                  \
    /* layer cache (the seed's LayerKvCacheError) */                                        \
    X(ZERO_BATCH_SIZE, "ZeroBatchSize", "KV cache batch size must be nonzero")              \
    X(ZERO_CAPACITY, "ZeroCapacity", "KV cache capacity must be nonzero")                   \
    X(CAPACITY_EXCEEDS_POSITIONS, "CapacityExceedsPositions",                               \
      "KV cache capacity exceeds RoPE position capacity")                                   \
    X(ELEMENT_COUNT_OVERFLOW, "ElementCountOverflow", "KV cache element count overflows")   \
    X(FULL, "Full", "KV cache is full")                                                     \
    X(KEY_SHAPE_MISMATCH, "KeyShapeMismatch", "appended key has the wrong shape")           \
    X(VALUE_SHAPE_MISMATCH, "ValueShapeMismatch", "appended value has the wrong shape")     \
    X(NONFINITE_KEY, "NonFiniteKey", "appended key is not finite")                          \
    X(NONFINITE_VALUE, "NonFiniteValue", "appended value is not finite")

typedef enum kvp_status {
#define KVP_STATUS_ENUM_(suffix, name, message) KVP_##suffix,
    KVP_STATUS_MAP(KVP_STATUS_ENUM_)
#undef KVP_STATUS_ENUM_
    KVP_STATUS_COUNT_
} kvp_status;

/* The invariants of DESIGN.md that kvp_pool_check recomputes. */
typedef enum kvp_invariant {
    KVP_INVARIANT_STATS = 0,        /* cached counters agree with recomputed ones */
    KVP_INVARIANT_CONSERVATION = 1, /* I1: free + held == total */
    KVP_INVARIANT_NO_DUPLICATES = 2,/* I2: no page on the free list twice */
    KVP_INVARIANT_REFERENCES = 3,   /* I3: refcount == references from tables and reservations */
    KVP_INVARIANT_LANE_COVERAGE = 4 /* I4: a lane of length len maps ceil(len/block) pages */
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

typedef struct kvp_geometry {
    size_t heads;
    size_t head_width;
} kvp_geometry;

/*
 * Detail of a failure. Only the fields listed for the status are meaningful;
 * the rest are zero.
 */
typedef struct kvp_error {
    kvp_status status;

    /* NULL_ARGUMENT, INVALID_ARGUMENT, OUT_OF_RANGE, BUFFER_TOO_SMALL, ZERO_SIZE:
     * the parameter (or field) name. */
    const char *argument;
    /* INVALID_ARGUMENT: why; ALLOCATION_FAILED: the object being allocated. */
    const char *what;

    /* OUT_OF_RANGE: index must be below limit.
     * NONFINITE_KEY / NONFINITE_VALUE: flat index and the value found. */
    size_t index;
    size_t limit;
    double value;

    /* KEY_SHAPE_MISMATCH / VALUE_SHAPE_MISMATCH. */
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
     * BUFFER_TOO_SMALL: elements needed and elements available. */
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
} kvp_error;

/* "FULL" -> "Full"; unknown values give "Unknown". Never NULL. */
KVP_API const char *kvp_status_name(kvp_status status);

/* A short, static description of the status. Never NULL. */
KVP_API const char *kvp_status_message(kvp_status status);

/*
 * Renders `err` like snprintf: writes at most `size` bytes including the
 * terminating NUL and returns the length the full text needs. A NULL `err`
 * renders "no error detail"; a NULL `buf` with size 0 only measures.
 */
KVP_API size_t kvp_error_format(const kvp_error *err, char *buf, size_t size);

/* Renders one audit finding, with the same return convention. */
KVP_API size_t kvp_mismatch_format(const kvp_mismatch *mismatch, char *buf, size_t size);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_STATUS_H */
