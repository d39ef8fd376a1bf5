/*
 * kvpager/attention.h: incremental attention through a paged cache, and the
 * full-prefix reference it must match.
 *
 * Incremental decoding is two-phase, as in the seed:
 *   kvp_attention_prepare  validates (in the seed's order), computes the
 *                          newest position's output against the retained rows
 *                          (gathered through the cache's page table) plus the
 *                          candidate row, and holds the candidate rotated key,
 *                          unrotated value and any page the commit will need
 *                          in a ticket. It changes no cache.
 *   kvp_ticket_commit      makes the candidate row visible (len += 1).
 *   kvp_ticket_discard     drops it and returns its reserved pages.
 * kvp_attention_forward is prepare + commit. With the cache and ticket made,
 * prepare and commit allocate nothing on the heap.
 *
 * Every prepare error leaves the cache's len, logical rows, page tables and
 * the pool exactly as they were: rank, tokens, batch, width, cache model
 * width, head count, KV head count, head width, parameter identities,
 * revisions, RoPE configuration, window then sink tokens
 * (CACHE_WINDOW_MISMATCH, err.what the field), capacity (FULL), ticket state and geometry,
 * non-finite projection, a rotated candidate key (then value) element that
 * the pool's dtype cannot hold (NONFINITE_KEY / NONFINITE_VALUE with err.what
 * "f32" or "bf16"; checked right after the projections, never for f64),
 * non-finite score or output, non-finite candidate key or value, and
 * POOL_EXHAUSTED when the new block's pages cannot all be reserved.
 *
 * Storage precision (kvp_dtype, kvpager/pool.h): right after the rotation,
 * the candidate key and value are rounded to the pool's dtype and widened
 * back, and only then used, so the new token attends to exactly the rows its
 * commit stores. Retained rows are read from the pages widened (exact). So
 * prepare's output equals kvp_attention_reference_stored with the pool's
 * dtype, bit for bit; for f64 nothing is rounded.
 *
 * Math (f64 throughout, no reassociation): y = x W for every projection;
 * heads split Q's model width into H contiguous slices of d_h, and K's and V's
 * H_kv * d_h features into H_kv slices (kvpager/layer.h); query head h uses
 * KV head h / (H / H_kv); Q's H heads and K's H_kv heads are rotated at
 * position = old len; scores are (q . k) * (1 / sqrt(d_h)); the
 * softmax subtracts the row maximum; head outputs sum weight * value over
 * positions in order; heads merge back in order; output = merged W_o.
 * A layer with a window W (kvp_layer_set_window) lets the token at position
 * t attend to [0, min(S, lo)) then [lo, t], lo = max(0, t - W + 1): the
 * softmax and the sums run over those positions only, in that order.
 *
 * Threads: a ticket, like a cache, has one owner at a time. A prepare only
 * reads its layer and cache, so prepares on different tickets may share
 * them; a commit changes the cache, so it is the cache owner's call. A
 * parameter update must not overlap any computation with a layer using the
 * parameter (kvpager/param.h).
 */
#ifndef KVPAGER_ATTENTION_H
#define KVPAGER_ATTENTION_H

#include "kvpager/cache.h"
#include "kvpager/common.h"
#include "kvpager/layer.h"
#include "kvpager/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* kvp_accum, the accumulation levels, is in kvpager/layer.h (a layer's setting). */

typedef struct kvp_ticket kvp_ticket;

/* The seed's IncrementalAttentionWork: projection rows, not time. */
typedef struct kvp_attention_work {
    size_t position;                        /* old len: the RoPE position */
    size_t full_prefix_rows_per_projection; /* len + 1 */
    size_t incremental_rows_per_projection; /* 1 */
    size_t reused_key_value_rows;           /* len */
} kvp_attention_work;

/* A view of a ticket's result; pointers stay valid until the next prepare. */
typedef struct kvp_attention_result {
    const double *output;  /* [B, 1, D] */
    const double *weights; /* [B, H, 1, keys] */
    size_t batch_size;
    size_t heads;
    size_t model_width;
    size_t keys;           /* len + 1: retained rows plus the candidate; with a window
                              (kvp_layer_set_window) the positions attended, sinks then
                              window, the candidate last */
    kvp_attention_work work;
    size_t reserved_pages; /* pages held for the commit (B at a block boundary, else 0) */
    int committed;         /* 1 once kvp_ticket_commit has made the row visible */
} kvp_attention_result;

/*
 * A ticket sized for `cache`: its batch, query heads, KV heads, head width and
 * capacity. It serves any cache with the same batch, heads, KV heads and head
 * width and a capacity no larger. Errors: NULL_ARGUMENT, ALLOCATION_FAILED.
 * Threads: thread-safe (reads only the cache's fixed geometry).
 */
KVP_API KVP_NODISCARD kvp_status kvp_ticket_create(const kvp_cache *cache, kvp_ticket **out,
                                                   kvp_error *err);

/*
 * Discards any prepared row (returning its pages) and frees the ticket.
 * NULL: nothing happens and KVP_OK is returned, as free(NULL) (kvpager.h).
 * Threads: not safe while any other call uses this ticket.
 */
KVP_API kvp_status kvp_ticket_destroy(kvp_ticket *ticket, kvp_error *err);

/*
 * Commits the prepared row to `cache`. Refuses, changing nothing:
 * TICKET_EMPTY (nothing prepared, or already committed or discarded),
 * TICKET_FOREIGN_CACHE (prepared for another cache), TICKET_STALE (the cache
 * was committed to or reset since prepare). A refused ticket keeps its row
 * and pages until it is discarded.
 * Threads: one caller at a time per ticket and per cache: the commit changes
 * `cache`, so it is its owner's call, not while a read of the cache runs.
 */
KVP_API KVP_NODISCARD kvp_status kvp_ticket_commit(kvp_ticket *ticket, kvp_cache *cache,
                                                   kvp_error *err);

/*
 * Drops a prepared row and returns its reserved pages. Idempotent.
 * Threads: one caller at a time per ticket; the cache it was prepared for
 * is not touched, and other tickets may be used concurrently.
 */
KVP_API kvp_status kvp_ticket_discard(kvp_ticket *ticket, kvp_error *err);

/*
 * The last prepare's result. TICKET_EMPTY when there is none.
 * Threads: not safe while a call changes this ticket (prepare, commit,
 * discard, destroy), and neither is reading the result's arrays; reads of
 * one ticket may overlap.
 */
KVP_API KVP_NODISCARD kvp_status kvp_ticket_result(const kvp_ticket *ticket,
                                                   kvp_attention_result *out, kvp_error *err);

/*
 * input: [B, 1, D]. See the header comment for the order of checks. A failed
 * prepare leaves the ticket empty (no result, no pages), except that a ticket
 * already holding a prepared row keeps it.
 * Threads: one caller at a time per ticket; not safe while another thread
 * changes `cache` or updates a parameter of `layer`. Prepares on other
 * tickets may read the same layer and cache at once.
 */
KVP_API KVP_NODISCARD kvp_status kvp_attention_prepare(const kvp_layer *layer,
                                                       const kvp_tensor *input,
                                                       const kvp_cache *cache,
                                                       kvp_ticket *ticket, kvp_error *err);

/*
 * prepare + commit. On any error no cache or pool has changed, and the ticket
 * is empty unless it already held a prepared row (TICKET_BUSY), which it keeps.
 * Threads: one caller at a time per ticket and per cache (it commits: the
 * cache owner's call, not while a read of the cache runs); not safe while a
 * parameter of `layer` is updated.
 */
KVP_API KVP_NODISCARD kvp_status kvp_attention_forward(const kvp_layer *layer,
                                                       const kvp_tensor *input, kvp_cache *cache,
                                                       kvp_ticket *ticket, kvp_error *err);

/*
 * The full-prefix causal reference, independent of any cache: input
 * [B, T, D] -> output [B, T, D], position t attending to 0..t, or with a
 * window to the positions of the layer's rule (kvp_layer_set_window). Optionally also
 * writes the rotated keys and unrotated values, [B, H_kv, T, d_h] each, the
 * layer's KV heads as a cache stores them (pass NULL to skip; kv_len is their
 * capacity in doubles). Errors: NULL_ARGUMENT,
 * REFERENCE_INPUT_SHAPE, ROPE_POSITION_OUT_OF_RANGE (T > max positions),
 * INVALID_ARGUMENT (element count overflows), BUFFER_TOO_SMALL,
 * ALLOCATION_FAILED, and the incremental path's NONFINITE_PROJECTION,
 * NONFINITE_SCORE, NONFINITE_OUTPUT, NONFINITE_KEY and NONFINITE_VALUE: token
 * t is checked where and in the order prepare checks its one token when the
 * cache holds tokens 0..t-1, so the status, `what`, flat `index` (within
 * that token's [B, 1, D] rows or [B, H, 1, keys] scores, keys = t + 1 or the
 * attended positions) and `value` are
 * prepare's; err.token is t. Nothing is written on error. It is the oracle
 * the tests compare against; it allocates its own scratch.
 * Threads: not safe while a parameter of `layer` is updated; otherwise any
 * number of threads may run it on one layer at once (it touches no cache).
 */
KVP_API KVP_NODISCARD kvp_status kvp_attention_reference(const kvp_layer *layer,
                                                         const kvp_tensor *input, double *output,
                                                         size_t output_len, double *keys,
                                                         double *values, size_t kv_len,
                                                         kvp_error *err);

/*
 * kvp_attention_reference as a `dtype` pool would store K and V: right after
 * token t's key is rotated, its key and value rows are checked (a finite
 * element the dtype cannot hold gives prepare's NONFINITE_KEY or
 * NONFINITE_VALUE, what = the dtype's name, err.token = t) and rounded to the
 * dtype (pool.h's rule) and back; every later use, and the keys and values
 * written out, are the rounded rows. For KVP_FP8_E4M3 the layer's scales
 * (kvp_layer_set_kv_scales) apply: rows are rounded to the elements
 * e = round(x / k_scale) and round(x / v_scale), a score is
 * (q . e) * ((1 / sqrt(d_h)) * k_scale), the product computed once, a head's
 * output feature is v_scale * (sum over positions of weight * e), multiplied
 * once at the end, and the keys and values written out are e * k_scale and
 * e * v_scale (as kvp_cache_keys exports them). So it equals decoding the
 * same rows one at a time through a cache of a `dtype` pool, bit for bit. KVP_F64 is
 * kvp_attention_reference exactly. Errors: kvp_attention_reference's, with
 * INVALID_ARGUMENT ("dtype" not a kvp_dtype) right after the NULL checks.
 * Threads: not safe while a parameter of `layer` is updated; otherwise any
 * number of threads may run it on one layer at once (it touches no cache).
 */
KVP_API KVP_NODISCARD kvp_status kvp_attention_reference_stored(
    const kvp_layer *layer, kvp_dtype dtype, const kvp_tensor *input, double *output,
    size_t output_len, double *keys, double *values, size_t kv_len, kvp_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_ATTENTION_H */
