/*
 * kvpager/layer.h: a multi-head attention layer, with grouped-query heads.
 *
 * A layer has model width D, H query heads of width d_h = D / H, and
 * kv_heads KV heads (dividing H): the query heads form kv_heads groups of
 * H / kv_heads consecutive heads, and query head h attends with KV head
 * h / (H / kv_heads). kv_heads == H is plain multi-head attention (MHA),
 * kv_heads == 1 multi-query attention (MQA). The parameters (stable indices
 * KVP_PARAM_QUERY .. OUTPUT) are W_q and W_o, D x D, and W_k and W_v,
 * D x (kv_heads * d_h), so a cache stores kv_heads heads per position. The
 * layer has a RoPE configuration over d_h features. It hands caches their binding
 * (kvp_layer_binding_get): the page geometry, the fp8 K/V scales and an owner
 * record only attention reads: the model width and heads, the four
 * parameters' identities and revisions and the RoPE configuration.
 *
 * A layer may attend through a sliding window (kvp_layer_set_window): the
 * token at position t attends to positions max(0, t - W + 1) .. t, plus the
 * attention sinks 0 .. S-1 when S > 0, each position once (DESIGN.md,
 * "Sliding windows and sinks"). W and S are part of the binding's record and
 * digest, so caches of different windows never share blocks.
 *
 * Threads: a layer is immutable after creation except through its
 * parameters' updates, kvp_layer_set_kv_scales, kvp_layer_set_accum and
 * kvp_layer_set_window; any number of threads may
 * compute with it at once, but not while one of its parameters is updated
 * (kvpager/param.h) or its scales are set.
 */
#ifndef KVPAGER_LAYER_H
#define KVPAGER_LAYER_H

#include "kvpager/cache.h"
#include "kvpager/common.h"
#include "kvpager/param.h"
#include "kvpager/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_layer kvp_layer;

/*
 * Accumulation levels of attention over stored rows.
 *   KVP_ACCUM_EXACT  every stored element is widened to f64 and summed in the
 *                    documented f64 order without fused multiply-add: the bits
 *                    of the full-prefix reference on the stored rows.
 *   KVP_ACCUM_FAST   narrow pages (f32, bf16, f16, fp8) are read in f32 with
 *                    fused multiply-add, in one fixed order, so the bits do
 *                    not depend on block size or thread count on one ISA
 *                    level; its error bound is in docs/DESIGN.md
 *                    ("Accumulation levels"). f64 pages are always exact.
 */
typedef enum kvp_accum {
    KVP_ACCUM_EXACT = 0,
    KVP_ACCUM_FAST = 1
} kvp_accum;

/* A growing struct (pool.h): struct_size first, set by kvp_layer_info_init. */
typedef struct kvp_layer_info {
    size_t struct_size;
    size_t model_width;
    size_t heads;    /* query heads, H */
    size_t kv_heads; /* KV heads, dividing H; == H for multi-head attention */
    size_t head_width;
    kvp_rope_config rope;
    /* Added after the first release (pool.h, "Growing structs"): */
    kvp_accum accum; /* the level of the layer's decode steps (kvp_layer_set_accum) */
    /* Added with sliding windows (kvp_layer_set_window); an older struct_size gets neither: */
    size_t window;      /* W: attention covers the last W positions; 0 = full attention */
    size_t sink_tokens; /* S: plus positions 0 .. S-1 (attention sinks); 0 = none */
} kvp_layer_info;

/*
 * The seed's from_parameters: a multi-head layer (kv_heads == heads) over
 * existing parameters, each of which gains a reference, so layers built from
 * the same parameters share their identities. It is
 * kvp_layer_create_grouped(..., heads, heads, ...): see there for the errors.
 * Threads: thread-safe (retains the parameters atomically, reads only their
 * shapes; an update may overlap it).
 */
KVP_API KVP_NODISCARD kvp_status kvp_layer_create(kvp_param *w_query, kvp_param *w_key,
                                                  kvp_param *w_value, kvp_param *w_output,
                                                  size_t heads, size_t max_positions,
                                                  double rope_base, kvp_layer **out,
                                                  kvp_error *err);

/*
 * A layer with `heads` query heads and `kv_heads` KV heads over existing
 * parameters (D is W_q's row count). Errors, in order: NULL_ARGUMENT;
 * PARAMETER_WIDTH_MISMATCH (the first parameter, by index, whose row count
 * differs from W_q's, or W_q or W_o not D x D; err.expected and err.actual
 * are [rows, cols]); HEADS_DO_NOT_DIVIDE_WIDTH; KV_HEADS_DO_NOT_DIVIDE_HEADS
 * (kv_heads is 0 or does not divide heads); PARAMETER_WIDTH_MISMATCH (W_k,
 * then W_v, without kv_heads * d_h columns); ROPE_* (the RoPE over d_h
 * features); ALLOCATION_FAILED. With kv_heads == heads and square
 * parameters this is exactly the seed's order.
 * Threads: thread-safe (retains the parameters atomically, reads only their
 * shapes; an update may overlap it).
 */
KVP_API KVP_NODISCARD kvp_status kvp_layer_create_grouped(kvp_param *w_query, kvp_param *w_key,
                                                          kvp_param *w_value, kvp_param *w_output,
                                                          size_t heads, size_t kv_heads,
                                                          size_t max_positions, double rope_base,
                                                          kvp_layer **out, kvp_error *err);

/*
 * A layer with fresh parameters drawn from SplitMix64(seed): each entry is
 * uniform in [-1/sqrt(D), 1/sqrt(D)), filled W_q, W_k, W_v, W_o in order, row
 * by row. The same seed gives the same weights on every machine. It is
 * kvp_layer_create_random_grouped(..., heads, heads, ...).
 * Threads: thread-safe (fresh parameters, shared with nobody).
 */
KVP_API KVP_NODISCARD kvp_status kvp_layer_create_random(size_t model_width, size_t heads,
                                                         size_t max_positions, double rope_base,
                                                         uint64_t seed, kvp_layer **out,
                                                         kvp_error *err);

/*
 * The same with kv_heads KV heads: W_k and W_v are D x (kv_heads * d_h) and
 * take that many draws each, so kv_heads == heads gives kvp_layer_create_random's
 * weights. Errors: NULL_ARGUMENT (out), INVALID_ARGUMENT (model_width 0 or
 * D * D doubles do not fit), ALLOCATION_FAILED, then
 * kvp_layer_create_grouped's.
 * Threads: thread-safe (fresh parameters, shared with nobody).
 */
KVP_API KVP_NODISCARD kvp_status kvp_layer_create_random_grouped(size_t model_width, size_t heads,
                                                                 size_t kv_heads,
                                                                 size_t max_positions,
                                                                 double rope_base, uint64_t seed,
                                                                 kvp_layer **out, kvp_error *err);

/*
 * Drops the layer's parameter references and frees it. Caches bound to it
 * keep only its binding, and a model keeps its own layers, so neither
 * depends on it.
 * NULL: nothing happens and KVP_OK is returned, as free(NULL) (kvpager.h).
 * Threads: not safe while any other call uses this layer.
 */
KVP_API kvp_status kvp_layer_destroy(kvp_layer *layer, kvp_error *err);

/*
 * Zeroes *info and sets struct_size to sizeof(kvp_layer_info). NULL is ignored.
 * Threads: thread-safe (touches only *info).
 */
KVP_API void kvp_layer_info_init(kvp_layer_info *info);

/*
 * Writes the fields out->struct_size covers. Errors: NULL_ARGUMENT;
 * INVALID_ARGUMENT ("struct_size"; pool.h's "Growing structs"), writing nothing.
 * Threads: thread-safe (the geometry never changes).
 */
KVP_API KVP_NODISCARD kvp_status kvp_layer_info_get(const kvp_layer *layer, kvp_layer_info *out,
                                                    kvp_error *err);

/*
 * Sets the accumulation level of the layer's incremental attention (decode
 * steps: kvp_attention_prepare/forward and the sequences' steps) over narrow
 * pages: KVP_ACCUM_EXACT (the default) or KVP_ACCUM_FAST. f64 pages, prefill
 * and the full-prefix references are exact at both levels.
 * Errors: NULL_ARGUMENT; INVALID_ARGUMENT ("accum") for any other value.
 * Nothing changes on failure.
 * Threads: not safe while any computation uses the layer (like a parameter
 * update, kvpager/param.h): set the level before steps run.
 */
KVP_API KVP_NODISCARD kvp_status kvp_layer_set_accum(kvp_layer *layer, kvp_accum accum,
                                                     kvp_error *err);

/*
 * Sets the layer's attention window W and attention sinks S (StreamingLLM):
 * the token at position t attends to the positions of
 *   [0, min(S, lo)) and [lo, t], lo = max(0, t - W + 1),
 * in that order, each position once (when S >= lo the two ranges meet and
 * the token attends to 0 .. t). W = 0 is full attention (0 .. t), the
 * default; RoPE positions stay absolute. Bindings handed out from now on
 * (kvp_layer_binding_get) carry W and S in their record and digest; a cache
 * created before keeps its own and prepare refuses it
 * (CACHE_WINDOW_MISMATCH). A windowed token's kvp_attention_result lists
 * only the attended positions (keys = their count, weights in the order
 * above); the reference applies the same rule.
 * Errors, in order: NULL_ARGUMENT ("layer"); INVALID_ARGUMENT ("window":
 * above the layer's RoPE positions; "sink_tokens": above them, or nonzero
 * with W = 0). Nothing changes on failure.
 * Threads: not safe while any computation uses the layer or a cache is
 * created for it (like kvp_layer_set_accum): set it before steps run.
 */
KVP_API KVP_NODISCARD kvp_status kvp_layer_set_window(kvp_layer *layer, size_t window,
                                                      size_t sink_tokens, kvp_error *err);

/*
 * The layer's current binding, as a cache created now would capture it:
 * kind KVP_BINDING_LAYER, kv_heads, head_width, max_positions = the RoPE
 * positions, the layer's fp8 scales; owner_digest = a 128-bit digest of
 * attention's record (model width, heads, the parameters' identities and
 * revisions, RoPE), owner_revision = the sum of the four parameter
 * revisions, record = that record (opaque: fill a binding only from this
 * call; attention refuses a cache whose record is not a layer's own).
 * (kvp_layer_binding before 0.2: getters end in _get, kvpager.h.)
 * Threads: thread-safe, also while a parameter is updated (revisions are
 * read atomically: the binding has each one's revision before or after).
 */
KVP_API KVP_NODISCARD kvp_status kvp_layer_binding_get(const kvp_layer *layer,
                                                       kvp_binding *out, kvp_error *err);

/*
 * Sets the layer's fp8 scales (vLLM's k_scale and v_scale; both 1.0 when a
 * layer is made): the K and V scales of the bindings it hands out from now
 * on (kvp_binding.k_scale, v_scale), so caches created afterwards on a
 * KVP_FP8_E4M3 pool store a key element x as round(x / k_scale) and a value
 * element as round(x / v_scale) (pool.h, kvp_dtype), and
 * kvp_attention_reference_stored uses them. A cache keeps the scales it
 * was created with; other dtypes ignore them. Errors: NULL_ARGUMENT;
 * INVALID_ARGUMENT ("k_scale", then "v_scale": not finite, normal and > 0),
 * changing nothing.
 * Threads: not safe while any other call uses this layer (prepares,
 * references, kvp_layer_binding_get, its model's sequences).
 */
KVP_API KVP_NODISCARD kvp_status kvp_layer_set_kv_scales(kvp_layer *layer, double k_scale,
                                                         double v_scale, kvp_error *err);

/*
 * A borrowed, read-only pointer to parameter `index` (KVP_PARAM_*); NULL when
 * out of range. A const layer gives only const parameters.
 * Threads: thread-safe (the pointers never change).
 */
KVP_API const kvp_param *kvp_layer_param(const kvp_layer *layer, size_t index);

/*
 * The same parameter, mutable, for updating it (kvp_param_update) or sharing
 * it (kvp_param_retain, kvp_layer_create): needs a non-const layer.
 * Threads: thread-safe (the pointers never change); updating the parameter
 * has kvp_param_update's rules.
 */
KVP_API kvp_param *kvp_layer_param_mut(kvp_layer *layer, size_t index);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_LAYER_H */
