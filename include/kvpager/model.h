/*
 * kvpager/model.h: a stack of attention layers sharing one head geometry.
 *
 * A model is what a sequence runs: L layers with the same (heads, kv_heads,
 * head_width), so one pool (pages of kv_heads heads) can serve every layer's
 * cache. A model built
 * from existing layers shares their parameters (same identities, as the
 * seed's from_parameters), so caches bound to those layers stay compatible.
 *
 * Threads: immutable after creation (except through parameter updates);
 * any number of sequences on any threads may run one model at once. A model
 * must outlive the sequences that run it: kvp_model_destroy refuses with
 * MODEL_BUSY while any is alive. Destroying a model while another thread
 * creates a sequence on it is the caller's race.
 */
#ifndef KVPAGER_MODEL_H
#define KVPAGER_MODEL_H

#include "kvpager/common.h"
#include "kvpager/layer.h"
#include "kvpager/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_model kvp_model;

/* A growing struct (pool.h): struct_size first, set by kvp_model_info_init. */
typedef struct kvp_model_info {
    size_t struct_size;
    size_t layers;
    size_t model_width;
    size_t heads;    /* query heads */
    size_t kv_heads; /* KV heads, the heads a page stores (== heads for MHA) */
    size_t head_width;
} kvp_model_info;

/*
 * A model over `count` layers, each sharing the parameters of layers[i].
 * Errors, in order: NULL_ARGUMENT (layers, out); INVALID_ARGUMENT (more
 * layers than a model can address, before any entry is read; then count 0);
 * entry by entry, NULL_ARGUMENT (a NULL entry) or MODEL_GEOMETRY_MISMATCH
 * (layer i's heads, KV heads or head width differ from layer 0's; err.layer
 * = i, err.kv_heads and err.expected_kv_heads the two KV head counts);
 * ALLOCATION_FAILED.
 * Threads: thread-safe (the layers are only read, their parameters retained
 * atomically).
 */
KVP_API KVP_NODISCARD kvp_status kvp_model_create(const kvp_layer *const *layers, size_t count,
                                                  kvp_model **out, kvp_error *err);

/*
 * L random layers; layer l is kvp_layer_create_random(..., seed + l).
 * Threads: thread-safe.
 */
KVP_API KVP_NODISCARD kvp_status kvp_model_create_random(size_t layers, size_t model_width,
                                                         size_t heads, size_t max_positions,
                                                         double rope_base, uint64_t seed,
                                                         kvp_model **out, kvp_error *err);

/*
 * L random grouped layers; layer l is kvp_layer_create_random_grouped(...,
 * seed + l). kvp_model_create_random is this with kv_heads == heads.
 * Threads: thread-safe.
 */
KVP_API KVP_NODISCARD kvp_status kvp_model_create_random_grouped(size_t layers,
                                                                 size_t model_width, size_t heads,
                                                                 size_t kv_heads,
                                                                 size_t max_positions,
                                                                 double rope_base, uint64_t seed,
                                                                 kvp_model **out, kvp_error *err);

/*
 * Frees the model and its layers (the parameters lose a reference each).
 * MODEL_BUSY, changing nothing, while sequences created on the model are
 * still alive: destroy them first (as kvp_pool_destroy refuses with
 * POOL_BUSY while caches are attached).
 * NULL: nothing happens and KVP_OK is returned, as free(NULL) (kvpager.h).
 * Threads: not safe while any other call uses the model, kvp_sequence_create
 * on it included: MODEL_BUSY counts live sequences (atomically), not calls
 * running on other threads.
 */
KVP_API kvp_status kvp_model_destroy(kvp_model *model, kvp_error *err);

/*
 * Zeroes *info and sets struct_size to sizeof(kvp_model_info). NULL is ignored.
 * Threads: thread-safe (touches only *info).
 */
KVP_API void kvp_model_info_init(kvp_model_info *info);

/*
 * Writes the fields out->struct_size covers. Errors: NULL_ARGUMENT;
 * INVALID_ARGUMENT ("struct_size"; pool.h's "Growing structs"), writing nothing.
 * Threads: thread-safe (the geometry never changes).
 */
KVP_API KVP_NODISCARD kvp_status kvp_model_info_get(const kvp_model *model, kvp_model_info *out,
                                                    kvp_error *err);

/*
 * A borrowed pointer to layer `index`, or NULL when out of range.
 * Threads: thread-safe (the layers never change).
 */
KVP_API const kvp_layer *kvp_model_layer(const kvp_model *model, size_t index);

/*
 * A borrowed, mutable pointer to parameter `index` (KVP_PARAM_*) of layer
 * `layer`, for updating it in place; NULL when either is out of range. The
 * layers themselves stay read-only (kvp_model_layer).
 * Threads: thread-safe (the pointers never change); updating the parameter
 * has kvp_param_update's rules (no computation with a layer using it
 * meanwhile, this model's sequences' steps and prefills included).
 */
KVP_API kvp_param *kvp_model_param_mut(kvp_model *model, size_t layer, size_t index);

/*
 * Sets the accumulation level of every layer's decode steps
 * (kvp_layer_set_accum): all layers or none. Errors: NULL_ARGUMENT;
 * INVALID_ARGUMENT ("accum") for a value that is not a kvp_accum.
 * Threads: not safe while a sequence, decoder or scheduler of this model steps.
 */
KVP_API KVP_NODISCARD kvp_status kvp_model_set_accum(kvp_model *model, kvp_accum accum,
                                                     kvp_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_MODEL_H */
