/*
 * kvpager/layer.h: a multi-head attention layer.
 *
 * A layer has model width D, H heads of width d_h = D / H, the four D x D
 * parameters W_q, W_k, W_v, W_o (stable indices KVP_PARAM_QUERY .. OUTPUT),
 * and a RoPE configuration over d_h features. It hands caches their binding:
 * geometry, the four parameters' identities and revisions, and the RoPE
 * configuration (kvp_layer_binding).
 *
 * Threads: a layer is immutable after creation except through its
 * parameters' updates; any number of threads may compute with it at once.
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

typedef struct kvp_layer_info {
    size_t model_width;
    size_t heads;
    size_t head_width;
    kvp_rope_config rope;
} kvp_layer_info;

/*
 * The seed's from_parameters: a layer over existing parameters, each of which
 * gains a reference, so layers built from the same parameters share their
 * identities. Errors, in order: NULL_ARGUMENT; PARAMETER_WIDTH_MISMATCH (the
 * four widths differ from W_q's); HEADS_DO_NOT_DIVIDE_WIDTH; ROPE_* (the
 * RoPE over d_h features); ALLOCATION_FAILED.
 */
KVP_API KVP_NODISCARD kvp_status kvp_layer_create(kvp_param *w_query, kvp_param *w_key,
                                                  kvp_param *w_value, kvp_param *w_output,
                                                  size_t heads, size_t max_positions,
                                                  double rope_base, kvp_layer **out,
                                                  kvp_error *err);

/*
 * A layer with fresh parameters drawn from SplitMix64(seed): each entry is
 * uniform in [-1/sqrt(D), 1/sqrt(D)), filled W_q, W_k, W_v, W_o in order, row
 * by row. The same seed gives the same weights on every machine.
 */
KVP_API KVP_NODISCARD kvp_status kvp_layer_create_random(size_t model_width, size_t heads,
                                                         size_t max_positions, double rope_base,
                                                         uint64_t seed, kvp_layer **out,
                                                         kvp_error *err);

/* Drops the layer's parameter references and frees it. */
KVP_API kvp_status kvp_layer_destroy(kvp_layer *layer, kvp_error *err);

KVP_API KVP_NODISCARD kvp_status kvp_layer_info_get(const kvp_layer *layer, kvp_layer_info *out,
                                                    kvp_error *err);

/* The layer's current binding, as a cache created now would capture it. */
KVP_API KVP_NODISCARD kvp_status kvp_layer_binding(const kvp_layer *layer, kvp_binding *out,
                                                   kvp_error *err);

/*
 * A borrowed, read-only pointer to parameter `index` (KVP_PARAM_*); NULL when
 * out of range. A const layer gives only const parameters.
 */
KVP_API const kvp_param *kvp_layer_param(const kvp_layer *layer, size_t index);

/*
 * The same parameter, mutable, for updating it (kvp_param_update) or sharing
 * it (kvp_param_retain, kvp_layer_create): needs a non-const layer.
 */
KVP_API kvp_param *kvp_layer_param_mut(kvp_layer *layer, size_t index);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_LAYER_H */
