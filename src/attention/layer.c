/*
 * layer.c: attention layers, their construction and their binding
 * (see kvpager/layer.h).
 *
 * Owns: one reference to each of the layer's four parameters, and either
 * the RoPE thetas and table of its configuration, in the same allocation,
 * or a reference to another layer's (layer_internal.h, Sharing).
 * Callers: the public API; attention sources read struct kvp_layer through
 * layer_internal.h.
 */
#include "attention/layer_internal.h"

#include <math.h>
#include <string.h>

#include "kvpager/rope.h"
#include "attention/kernels.h"
#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/error.h"

/*
 * The columns W_k and W_v must have: kv_heads * d_h when heads and kv_heads
 * are valid, else the model width (the heads checks then refuse the layer).
 * With kv_heads == heads it is the model width, as for square parameters.
 */
static size_t kv_columns(size_t model_width, size_t heads, size_t kv_heads)
{
    if (heads == 0 || model_width % heads != 0 || kv_heads == 0 || heads % kv_heads != 0) {
        return model_width;
    }
    return kv_heads * (model_width / heads);
}

/*
 * PARAMETER_WIDTH_MISMATCH for parameter `index`: expected and actual are
 * [rows, cols]; expected_size and actual_size are the first dimension that
 * differs (rows, else cols), as they were when every parameter was square.
 */
static kvp_status fail_parameter_shape(const kvp_param *param, size_t index, size_t rows,
                                       size_t cols, kvp_error *err)
{
    kvp_error e = kvpi_error_begin(KVP_PARAMETER_WIDTH_MISMATCH);
    e.parameter = index;
    e.expected = (kvp_shape){2, {rows, cols}};
    e.actual = (kvp_shape){2, {kvp_param_rows(param), kvp_param_cols(param)}};
    int rows_differ = kvp_param_rows(param) != rows;
    e.expected_size = rows_differ ? rows : cols;
    e.actual_size = rows_differ ? kvp_param_rows(param) : kvp_param_cols(param);
    return kvpi_error_emit(err, &e);
}

/*
 * The layer checks in their documented order (kvpager/layer.h): NULLs; every
 * parameter has W_q's rows and W_q, W_o are square; heads divide the width;
 * kv_heads divide heads; W_k and W_v have kv_heads * d_h columns; RoPE.
 */
static kvp_status validate_layer(kvp_param *const params[KVP_PARAM_COUNT], size_t heads,
                                 size_t kv_heads, const kvp_rope_config *rope_without_width,
                                 size_t *head_width, kvp_error *err)
{
    static const char *const names[] = {"w_query", "w_key", "w_value", "w_output"};
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        if (params[i] == NULL) {
            return kvpi_fail_null(err, names[i]);
        }
    }
    size_t width = kvp_param_rows(params[0]);
    size_t kv_cols = kv_columns(width, heads, kv_heads);
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        int square = i == KVP_PARAM_QUERY || i == KVP_PARAM_OUTPUT;
        /* Columns of W_k and W_v wait for the heads checks (below). */
        size_t cols = square ? width : kvp_param_cols(params[i]);
        if (kvp_param_rows(params[i]) != width || kvp_param_cols(params[i]) != cols) {
            return fail_parameter_shape(params[i], i, width, square ? width : kv_cols, err);
        }
    }
    if (heads == 0 || width % heads != 0) {
        kvp_error e = kvpi_error_begin(KVP_HEADS_DO_NOT_DIVIDE_WIDTH);
        e.model_width = width;
        e.heads = heads;
        return kvpi_error_emit(err, &e);
    }
    if (kv_heads == 0 || heads % kv_heads != 0) {
        kvp_error e = kvpi_error_begin(KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS);
        e.heads = heads;
        e.kv_heads = kv_heads;
        return kvpi_error_emit(err, &e);
    }
    size_t kv_width = kv_heads * (width / heads);
    for (size_t i = KVP_PARAM_KEY; i <= KVP_PARAM_VALUE; i++) {
        if (kvp_param_cols(params[i]) != kv_width) {
            return fail_parameter_shape(params[i], i, width, kv_width, err);
        }
    }
    kvp_rope_config rope = *rope_without_width;
    rope.feature_width = width / heads;
    kvp_status status = kvp_rope_validate(&rope, err);
    if (status == KVP_OK) {
        *head_width = width / heads;
    }
    return status;
}

/* Whether max_positions x head_width doubles fit KVPI_ROPE_TABLE_MAX_BYTES. */
static int table_fits(size_t head_width, size_t max_positions)
{
    return max_positions <= KVPI_ROPE_TABLE_MAX_BYTES / sizeof(double) / head_width;
}

size_t kvpi_layer_alloc_bytes(size_t head_width, size_t max_positions)
{
    size_t doubles = head_width / 2;
    if (table_fits(head_width, max_positions)) {
        doubles += max_positions * head_width;
    }
    return sizeof(kvp_layer) + doubles * sizeof(double);
}

void kvpi_layer_rope(const kvp_layer *layer, double *a, double *b, size_t count,
                     size_t position)
{
    size_t hd = layer->head_width;
    if (layer->rope_table == NULL) {
        kvpi_rope_apply_thetas(layer->rope_theta, hd / 2, a, b, hd, count, position);
        return;
    }
    const double *cos_sin = layer->rope_table + position * hd;
    kvpi_rope_apply_table(cos_sin, hd / 2, a, hd, count);
    if (b != NULL) {
        kvpi_rope_apply_table(cos_sin, hd / 2, b, hd, count);
    }
}

void kvpi_layer_rope_qk(const kvp_layer *layer, double *q, size_t queries, double *k,
                        size_t keys, size_t position)
{
    if (queries == keys) {
        kvpi_layer_rope(layer, q, k, queries, position); /* one cos/sin pass for both */
        return;
    }
    kvpi_layer_rope(layer, q, NULL, queries, position);
    kvpi_layer_rope(layer, k, NULL, keys, position);
}

kvp_status kvp_layer_create(kvp_param *w_query, kvp_param *w_key, kvp_param *w_value,
                            kvp_param *w_output, size_t heads, size_t max_positions,
                            double rope_base, kvp_layer **out, kvp_error *err)
{
    return kvp_layer_create_grouped(w_query, w_key, w_value, w_output, heads, heads,
                                    max_positions, rope_base, out, err);
}

kvp_status kvp_layer_create_grouped(kvp_param *w_query, kvp_param *w_key, kvp_param *w_value,
                                    kvp_param *w_output, size_t heads, size_t kv_heads,
                                    size_t max_positions, double rope_base, kvp_layer **out,
                                    kvp_error *err)
{
    return kvpi_layer_create_sharing(w_query, w_key, w_value, w_output, heads, kv_heads,
                                     max_positions, rope_base, NULL, out, err);
}

static int same_rope(const kvp_rope_config *a, const kvp_rope_config *b)
{
    return a->feature_width == b->feature_width && a->max_positions == b->max_positions &&
           memcmp(&a->base, &b->base, sizeof a->base) == 0;
}

int kvpi_layer_same_rope(const kvp_layer *a, const kvp_layer *b)
{
    return same_rope(&a->rope, &b->rope);
}

/* The layer's own angles, in its allocation (kvpi_layer_alloc_bytes). */
static void compute_angles(kvp_layer *layer)
{
    size_t head_width = layer->head_width;
    size_t half = head_width / 2;
    double *theta = layer->rope_data;
    for (size_t i = 0; i < half; i++) {
        theta[i] = kvpi_rope_theta(layer->rope.base, head_width, i);
    }
    layer->rope_theta = theta;
    if (table_fits(head_width, layer->rope.max_positions)) {
        kvpi_rope_fill_table(theta, half, layer->rope.max_positions, theta + half);
        layer->rope_table = theta + half;
    }
    layer->rope_owner = layer;
    atomic_init(&layer->rope_refs, 1);
}

kvp_status kvpi_layer_create_sharing(kvp_param *w_query, kvp_param *w_key, kvp_param *w_value,
                                     kvp_param *w_output, size_t heads, size_t kv_heads,
                                     size_t max_positions, double rope_base,
                                     const kvp_layer *rope_from, kvp_layer **out,
                                     kvp_error *err)
{
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_param *params[KVP_PARAM_COUNT] = {w_query, w_key, w_value, w_output};
    kvp_rope_config rope = {0, max_positions, rope_base};
    size_t head_width = 0;
    kvp_status status = validate_layer(params, heads, kv_heads, &rope, &head_width, err);
    if (status != KVP_OK) {
        return status;
    }
    rope.feature_width = head_width;
    int share = rope_from != NULL && same_rope(&rope_from->rope, &rope);
    size_t bytes = share ? sizeof(kvp_layer) : kvpi_layer_alloc_bytes(head_width, max_positions);
    kvp_layer *layer = kvpi_alloc(KVPI_SITE_LAYER, bytes);
    if (layer == NULL) {
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_LAYER), bytes);
    }
    memset(layer, 0, sizeof *layer);
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        (void)kvp_param_retain(params[i], NULL); /* cannot fail: checked non-NULL */
        layer->params[i] = params[i];
    }
    layer->model_width = kvp_param_rows(w_query);
    layer->heads = heads;
    layer->kv_heads = kv_heads;
    layer->head_width = head_width;
    layer->k_scale = 1.0;
    layer->v_scale = 1.0;
    layer->rope = rope;
    if (share) {
        /* The owner outlives this reference: only destroys drop references. */
        kvp_layer *owner = rope_from->rope_owner;
        atomic_fetch_add_explicit(&owner->rope_refs, 1, memory_order_relaxed);
        layer->rope_owner = owner;
        layer->rope_theta = owner->rope_theta;
        layer->rope_table = owner->rope_table;
        atomic_init(&layer->rope_refs, 0);
    } else {
        compute_angles(layer);
    }
    *out = layer;
    return KVP_OK;
}

/* SplitMix64, the documented generator of kvp_layer_create_random. */
static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

kvp_status kvp_layer_create_random(size_t model_width, size_t heads, size_t max_positions,
                                   double rope_base, uint64_t seed, kvp_layer **out,
                                   kvp_error *err)
{
    return kvp_layer_create_random_grouped(model_width, heads, heads, max_positions, rope_base,
                                           seed, out, err);
}

kvp_status kvp_layer_create_random_grouped(size_t model_width, size_t heads, size_t kv_heads,
                                           size_t max_positions, double rope_base, uint64_t seed,
                                           kvp_layer **out, kvp_error *err)
{
    return kvpi_layer_create_random_sharing(model_width, heads, kv_heads, max_positions,
                                            rope_base, seed, NULL, out, err);
}

kvp_status kvpi_layer_create_random_sharing(size_t model_width, size_t heads, size_t kv_heads,
                                            size_t max_positions, double rope_base,
                                            uint64_t seed, const kvp_layer *rope_from,
                                            kvp_layer **out, kvp_error *err)
{
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (model_width == 0 || model_width > SIZE_MAX / model_width / sizeof(double)) {
        return kvpi_fail_invalid(err, "model_width", "must be nonzero and model_width^2 "
                                                     "doubles must fit in memory");
    }
    size_t count = model_width * model_width;
    double *values = kvpi_alloc(KVPI_SITE_SCRATCH, count * sizeof *values);
    if (values == NULL) {
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_SCRATCH),
                               count * sizeof *values);
    }
    double scale = 1.0 / sqrt((double)model_width);
    size_t kv_width = kv_columns(model_width, heads, kv_heads);
    uint64_t state = seed;
    kvp_param *params[KVP_PARAM_COUNT] = {NULL, NULL, NULL, NULL};
    kvp_status status = KVP_OK;
    for (size_t p = 0; p < KVP_PARAM_COUNT && status == KVP_OK; p++) {
        int square = p == KVP_PARAM_QUERY || p == KVP_PARAM_OUTPUT;
        size_t cols = square ? model_width : kv_width;
        for (size_t i = 0; i < model_width * cols; i++) {
            double unit = (double)(splitmix64(&state) >> 11) * 0x1.0p-53; /* [0, 1) */
            values[i] = (2.0 * unit - 1.0) * scale;
        }
        status = kvp_param_create_matrix(model_width, cols, values, &params[p], err);
    }
    kvpi_free(values);
    if (status == KVP_OK) {
        status = kvpi_layer_create_sharing(params[0], params[1], params[2], params[3], heads,
                                           kv_heads, max_positions, rope_base, rope_from, out,
                                           err);
    }
    /* The layer holds its own references; drop the creation ones either way. */
    for (size_t p = 0; p < KVP_PARAM_COUNT; p++) {
        if (params[p] != NULL) {
            (void)kvp_param_release(params[p], NULL);
        }
    }
    return status;
}

kvp_status kvp_layer_destroy(kvp_layer *layer, kvp_error *err)
{
    (void)err;
    if (layer == NULL) {
        return KVP_OK; /* destroying NULL does nothing, as free(NULL) */
    }
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        (void)kvp_param_release(layer->params[i], NULL);
    }
    /*
     * The owner's allocation holds the angles: it goes with the last layer
     * using them (acq_rel: every user's reads happen before the free).
     */
    kvp_layer *owner = layer->rope_owner;
    int last = atomic_fetch_sub_explicit(&owner->rope_refs, 1, memory_order_acq_rel) == 1;
    if (layer != owner) {
        kvpi_free(layer);
    }
    if (last) {
        kvpi_free(owner);
    }
    return KVP_OK;
}

void kvp_layer_info_init(kvp_layer_info *info)
{
    if (info == NULL) {
        return;
    }
    memset(info, 0, sizeof *info);
    info->struct_size = sizeof *info;
}

kvp_status kvp_layer_info_get(const kvp_layer *layer, kvp_layer_info *out, kvp_error *err)
{
    if (layer == NULL) {
        return kvpi_fail_null(err, "layer");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_layer_info info;
    memset(&info, 0, sizeof info); /* the padding after accum too: callers see every byte */
    info.struct_size = sizeof info;
    info.model_width = layer->model_width;
    info.heads = layer->heads;
    info.kv_heads = layer->kv_heads;
    info.head_width = layer->head_width;
    info.rope = layer->rope;
    info.accum = layer->accum;
    info.window = layer->window;
    info.sink_tokens = layer->sink_tokens;
    return kvpi_struct_out(out, &info, sizeof info, KVPI_LAYER_INFO_SIZE_FIRST, err);
}

kvp_status kvp_layer_set_accum(kvp_layer *layer, kvp_accum accum, kvp_error *err)
{
    if (layer == NULL) {
        return kvpi_fail_null(err, "layer");
    }
    if (accum != KVP_ACCUM_EXACT && accum != KVP_ACCUM_FAST) {
        return kvpi_fail_invalid(err, "accum", "must be KVP_ACCUM_EXACT or KVP_ACCUM_FAST");
    }
    layer->accum = accum;
    return KVP_OK;
}

kvp_status kvp_layer_set_window(kvp_layer *layer, size_t window, size_t sink_tokens,
                                kvp_error *err)
{
    if (layer == NULL) {
        return kvpi_fail_null(err, "layer");
    }
    if (window > layer->rope.max_positions) {
        return kvpi_fail_invalid(err, "window", "must be at most the layer's RoPE positions");
    }
    if (sink_tokens > layer->rope.max_positions) {
        return kvpi_fail_invalid(err, "sink_tokens",
                                 "must be at most the layer's RoPE positions");
    }
    if (sink_tokens != 0 && window == 0) {
        return kvpi_fail_invalid(err, "sink_tokens", "needs a window (full attention has none)");
    }
    layer->window = window;
    layer->sink_tokens = sink_tokens;
    return KVP_OK;
}

kvp_status kvp_layer_binding_get(const kvp_layer *layer, kvp_binding *out, kvp_error *err)
{
    if (layer == NULL) {
        return kvpi_fail_null(err, "layer");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvpi_layer_binding(layer, out);
    return KVP_OK;
}


kvp_status kvp_layer_set_kv_scales(kvp_layer *layer, double k_scale, double v_scale,
                                   kvp_error *err)
{
    if (layer == NULL) {
        return kvpi_fail_null(err, "layer");
    }
    static const char *const names[2] = {"k_scale", "v_scale"};
    const double scales[2] = {k_scale, v_scale};
    for (size_t i = 0; i < 2; i++) {
        if (!(isnormal(scales[i]) && scales[i] > 0.0)) {
            return kvpi_fail_invalid(err, names[i], "must be finite, normal and > 0");
        }
    }
    layer->k_scale = k_scale;
    layer->v_scale = v_scale;
    return KVP_OK;
}

const kvp_param *kvp_layer_param(const kvp_layer *layer, size_t index)
{
    if (layer == NULL || index >= KVP_PARAM_COUNT) {
        return NULL;
    }
    return layer->params[index];
}

kvp_param *kvp_layer_param_mut(kvp_layer *layer, size_t index)
{
    if (layer == NULL || index >= KVP_PARAM_COUNT) {
        return NULL;
    }
    return layer->params[index];
}
