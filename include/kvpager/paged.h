/*
 * kvpager/paged.h: paged attention for engines that project Q, K and V
 * themselves (vLLM's paged_attention): one decode step's attention for every
 * lane of a cache over its retained rows, read through the cache's page
 * table, optionally plus one candidate row per lane.
 *
 * Owns: kvp_paged_attention_args and kvp_paged_attention.
 * Works on external caches (the caller's rows, kvp_cache_append_rows or
 * writes in place) and on attention caches (a layer's), in every page dtype,
 * with grouped queries: query head h reads KV head h / (H / H_kv).
 *
 * Threads: see kvp_paged_attention.
 */
#ifndef KVPAGER_PAGED_H
#define KVPAGER_PAGED_H

#include "kvpager/attention.h"
#include "kvpager/cache.h"
#include "kvpager/common.h"
#include "kvpager/sequence.h"
#include "kvpager/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * A growing struct (pool.h): struct_size first, set by
 * kvp_paged_attention_args_init, which also sets the defaults (io_dtype
 * KVP_F64, accum KVP_ACCUM_EXACT, scale 0, heads 0, every pointer NULL).
 * B is the cache's batch, H_kv its KV heads, d_h its head width.
 */
typedef struct kvp_paged_attention_args {
    size_t struct_size;
    const kvp_cache *cache;
    size_t heads;        /* H, query heads: a multiple of H_kv; 0 = the cache's (a
                            layer-bound cache: its layer's heads; external: H_kv) */
    kvp_dtype io_dtype;  /* KVP_F64 or KVP_F32: the element type of queries, keys,
                            values and outputs */
    const void *queries; /* [B][H][d_h], already rotated if the model uses RoPE */
    const void *keys;    /* NULL, or the candidate rows [B][H_kv][d_h], scored after
                            the retained ones as if stored (rounded to the pool's dtype) */
    const void *values;  /* NULL exactly when keys is NULL; [B][H_kv][d_h] */
    double scale;        /* the scores' factor; 0 = 1 / sqrt(d_h) */
    kvp_accum accum;     /* the accumulation level (attention.h) */
    void *outputs;       /* [B][H][d_h]: written only on success */
} kvp_paged_attention_args;

/*
 * Zeroes *args, sets struct_size and the defaults above. NULL is ignored.
 * Threads: thread-safe (touches only *args).
 */
KVP_API void kvp_paged_attention_args_init(kvp_paged_attention_args *args);

/*
 * outputs[b][h] = sum over the lane's retained positions p (and the
 * candidate) of softmax_p(scale * q[b][h] . k_p) * v_p, with k and v of KV
 * head h / (H / H_kv), read from the pages in the pool's dtype at the
 * requested accumulation level. At KVP_ACCUM_EXACT, on an attention cache
 * with the layer's H, scale and candidate rows, the outputs are the bits of
 * the head outputs kvp_attention_prepare computes.
 * io_dtype KVP_F32: queries and candidate rows are widened to f64 (exactly)
 * and the f64 outputs rounded once to f32 (to nearest, ties to even).
 * Candidate rows are rounded to the pool's dtype as an append would store
 * them (kvp_cache_append_rows), and refused as it refuses them.
 * The cache may hold a pending row reservation (kvp_cache_reserve_rows):
 * only its len rows are read. outputs must not overlap the inputs.
 * `threads`: NULL runs on the calling thread; a decoder runs the step on its
 * threads, with the same bits.
 * Workspace: the calling thread keeps one buffer (scores [B][H][keys], and
 * for f32 io the widened rows), grown by half again when a call needs more
 * and freed when the thread exits; a call that needs no more allocates
 * nothing.
 * Errors, in this order (nothing is written on error, outputs included):
 * NULL_ARGUMENT ("args", "cache", "queries", "outputs"); INVALID_ARGUMENT
 * ("struct_size"; "heads": not a multiple of H_kv; "io_dtype"; "accum";
 * "keys"/"values": not both NULL or both set; "scale": not finite or
 * negative; "keys" when the cache is empty and there is no candidate);
 * ALLOCATION_FAILED (the workspace); NONFINITE_KEY, then NONFINITE_VALUE
 * (a candidate element not finite, or overflowing the pool's dtype: err.what
 * NULL or the dtype's name, err.index its flat index in [B][H_kv][d_h]);
 * DECODER_BUSY (`threads` is running a step or another call);
 * NONFINITE_SCORE (err.index its flat index in [B][H][keys], keys = len + 1
 * with a candidate, len without).
 * Threads: not safe while a call changes the cache; calls reading the same
 * cache or other caches may run at once, but a decoder serves one call at a
 * time (DECODER_BUSY for the others).
 */
KVP_API KVP_NODISCARD kvp_status kvp_paged_attention(const kvp_paged_attention_args *args,
                                                     kvp_decoder *threads, kvp_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_PAGED_H */
