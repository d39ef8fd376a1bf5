/*
 * model.c: models, stacks of layers with one head geometry (see
 * kvpager/model.h).
 *
 * Owns: its layer objects, each sharing the parameters of the layer it was
 * built from, and the RoPE angles of the first layer (of this model, else
 * the source layer) with the same RoPE configuration: one table per
 * configuration, not one per layer (attention/layer_internal.h, Sharing). Invariant: every layer has layer 0's (heads, kv_heads,
 * head_width), so one pool (whose pages hold kv_heads heads) serves them all.
 * Callers: the public API; sequence.c reads struct kvp_model through
 * model_internal.h and counts itself in and out of `sequences`.
 */
#include "serve/model_internal.h"

#include "attention/layer_internal.h"
#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/error.h"

static kvp_status check_geometry(const kvp_layer *const *layers, size_t count, kvp_error *err)
{
    if (count == 0) {
        return kvpi_fail_invalid(err, "count", "a model needs at least one layer");
    }
    for (size_t i = 0; i < count; i++) {
        if (layers[i] == NULL) {
            return kvpi_fail_null(err, "layers[i]");
        }
        if (layers[i]->heads != layers[0]->heads ||
            layers[i]->kv_heads != layers[0]->kv_heads ||
            layers[i]->head_width != layers[0]->head_width) {
            kvp_error e = kvpi_error_begin(KVP_MODEL_GEOMETRY_MISMATCH);
            e.layer = i;
            e.pool_geometry = (kvp_geometry){layers[0]->heads, layers[0]->head_width};
            e.binding_geometry = (kvp_geometry){layers[i]->heads, layers[i]->head_width};
            e.kv_heads = layers[i]->kv_heads;
            e.expected_kv_heads = layers[0]->kv_heads;
            return kvpi_error_emit(err, &e);
        }
    }
    return KVP_OK;
}

static void free_model(kvp_model *model)
{
    for (size_t i = 0; i < model->count; i++) {
        if (model->layers[i] != NULL) {
            kvp_layer_destroy(model->layers[i], NULL);
        }
    }
    kvpi_free(model);
}

kvp_status kvp_model_create(const kvp_layer *const *layers, size_t count, kvp_model **out,
                            kvp_error *err)
{
    if (layers == NULL) {
        return kvpi_fail_null(err, "layers");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    /* Before the geometry check reads layers[0 .. count). */
    if (count > (SIZE_MAX - sizeof(kvp_model)) / sizeof(kvp_layer *)) {
        return kvpi_fail_invalid(err, "count", "too many layers");
    }
    kvp_status status = check_geometry(layers, count, err);
    if (status != KVP_OK) {
        return status;
    }
    size_t bytes = sizeof(kvp_model) + count * sizeof(kvp_layer *);
    kvp_model *model = kvpi_calloc(KVPI_SITE_MODEL, 1, bytes);
    if (model == NULL) {
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_MODEL), bytes);
    }
    atomic_init(&model->sequences, 0);
    model->count = count;
    for (size_t i = 0; i < count; i++) {
        const kvp_layer *src = layers[i];
        const kvp_layer *rope_from = src;
        for (size_t j = 0; j < i; j++) {
            if (kvpi_layer_same_rope(model->layers[j], src)) {
                rope_from = model->layers[j];
                break;
            }
        }
        status = kvpi_layer_create_sharing(src->params[0], src->params[1], src->params[2],
                                           src->params[3], src->heads, src->kv_heads,
                                           src->rope.max_positions, src->rope.base, rope_from,
                                           &model->layers[i], err);
        if (status == KVP_OK) {
            /* The source's settings, valid already: neither call can fail. */
            status = kvp_layer_set_accum(model->layers[i], src->accum, err);
        }
        if (status == KVP_OK) {
            status = kvp_layer_set_kv_scales(model->layers[i], src->k_scale, src->v_scale, err);
        }
        if (status == KVP_OK) {
            /* The window and sinks: a model's sliding layers stay sliding. */
            status = kvp_layer_set_window(model->layers[i], src->window, src->sink_tokens, err);
        }
        if (status != KVP_OK) {
            free_model(model);
            return status;
        }
    }
    model->model_width = layers[0]->model_width;
    model->heads = layers[0]->heads;
    model->kv_heads = layers[0]->kv_heads;
    model->head_width = layers[0]->head_width;
    *out = model;
    return KVP_OK;
}

kvp_status kvp_model_create_random(size_t layers, size_t model_width, size_t heads,
                                   size_t max_positions, double rope_base, uint64_t seed,
                                   kvp_model **out, kvp_error *err)
{
    return kvp_model_create_random_grouped(layers, model_width, heads, heads, max_positions,
                                           rope_base, seed, out, err);
}

kvp_status kvp_model_create_random_grouped(size_t layers, size_t model_width, size_t heads,
                                           size_t kv_heads, size_t max_positions,
                                           double rope_base, uint64_t seed, kvp_model **out,
                                           kvp_error *err)
{
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (layers == 0) {
        return kvpi_fail_invalid(err, "layers", "a model needs at least one layer");
    }
    if (layers > SIZE_MAX / sizeof(kvp_layer *)) {
        return kvpi_fail_invalid(err, "layers", "too many layers");
    }
    kvp_layer **made = kvpi_calloc(KVPI_SITE_SCRATCH, layers, sizeof *made);
    if (made == NULL) {
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_SCRATCH),
                               layers * sizeof *made);
    }
    kvp_status status = KVP_OK;
    for (size_t l = 0; l < layers && status == KVP_OK; l++) {
        /* Every layer shares layer 0's RoPE angles: one table for the model. */
        status = kvpi_layer_create_random_sharing(model_width, heads, kv_heads, max_positions,
                                                  rope_base, seed + l, l > 0 ? made[0] : NULL,
                                                  &made[l], err);
    }
    if (status == KVP_OK) {
        status = kvp_model_create((const kvp_layer *const *)made, layers, out, err);
    }
    /* The model holds its own layers; these were only the templates. */
    for (size_t l = 0; l < layers; l++) {
        if (made[l] != NULL) {
            kvp_layer_destroy(made[l], NULL);
        }
    }
    kvpi_free(made);
    return status;
}

kvp_status kvp_model_destroy(kvp_model *model, kvp_error *err)
{
    if (model == NULL) {
        return KVP_OK; /* destroying NULL does nothing, as free(NULL) */
    }
    if (atomic_load(&model->sequences) != 0) {
        kvp_error e = kvpi_error_begin(KVP_MODEL_BUSY);
        return kvpi_error_emit(err, &e);
    }
    free_model(model);
    return KVP_OK;
}

void kvp_model_info_init(kvp_model_info *info)
{
    if (info == NULL) {
        return;
    }
    memset(info, 0, sizeof *info);
    info->struct_size = sizeof *info;
}

kvp_status kvp_model_info_get(const kvp_model *model, kvp_model_info *out, kvp_error *err)
{
    if (model == NULL) {
        return kvpi_fail_null(err, "model");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_model_info info = {sizeof info, model->count, model->model_width, model->heads,
                           model->kv_heads, model->head_width};
    return kvpi_struct_out(out, &info, sizeof info, KVPI_MODEL_INFO_SIZE_FIRST, err);
}

const kvp_layer *kvp_model_layer(const kvp_model *model, size_t index)
{
    if (model == NULL || index >= model->count) {
        return NULL;
    }
    return model->layers[index];
}

kvp_param *kvp_model_param_mut(kvp_model *model, size_t layer, size_t index)
{
    if (model == NULL || layer >= model->count) {
        return NULL;
    }
    return kvp_layer_param_mut(model->layers[layer], index);
}

kvp_status kvp_model_set_accum(kvp_model *model, kvp_accum accum, kvp_error *err)
{
    if (model == NULL) {
        return kvpi_fail_null(err, "model");
    }
    if (accum != KVP_ACCUM_EXACT && accum != KVP_ACCUM_FAST) {
        return kvpi_fail_invalid(err, "accum", "must be KVP_ACCUM_EXACT or KVP_ACCUM_FAST");
    }
    for (size_t i = 0; i < model->count; i++) {
        kvp_status status = kvp_layer_set_accum(model->layers[i], accum, err);
        if (status != KVP_OK) {
            return status; /* unreachable: the value was checked above */
        }
    }
    return KVP_OK;
}

/*
 * The model was allocated non-const (kvp_model_create); only the sequence
 * counter changes through these const views, as a reference count would.
 */
void kvpi_model_sequence_added(const kvp_model *model)
{
    atomic_fetch_add(&((kvp_model *)model)->sequences, 1);
}

void kvpi_model_sequence_removed(const kvp_model *model)
{
    atomic_fetch_sub(&((kvp_model *)model)->sequences, 1);
}
