/*
 * reference.c: the full-prefix causal attention pass (see
 * kvp_attention_reference in kvpager/attention.h).
 *
 * Owns: the oracle. It projects every position of the input, rotates Q and K
 * at their absolute positions, and lets position t attend to 0..t, keeping
 * K and V in contiguous arrays of its own; no cache, page or pool is used.
 * It shares only the arithmetic kernels with the incremental path.
 * Callers: the public API (tests, the demo, benchmarks).
 */
#include <math.h>
#include <string.h>

#include "kvpager/attention.h"
#include "attention/kernels.h"
#include "attention/layer_internal.h"
#include "pager/alloc.h"
#include "pager/error.h"

static kvp_status validate_reference(const kvp_layer *layer, const kvp_tensor *input,
                                     size_t output_len, const double *keys,
                                     const double *values, size_t kv_len, kvp_error *err)
{
    const kvp_shape *shape = &input->shape;
    if (shape->rank != 3 || shape->dims[0] == 0 || shape->dims[1] == 0 ||
        shape->dims[2] != layer->model_width) {
        kvp_error e = kvpi_error_begin(KVP_REFERENCE_INPUT_SHAPE);
        e.model_width = layer->model_width;
        e.actual = *shape;
        return kvpi_error_emit(err, &e);
    }
    size_t tokens = shape->dims[1];
    if (tokens > layer->rope.max_positions) {
        kvp_error e = kvpi_error_begin(KVP_ROPE_POSITION_OUT_OF_RANGE);
        e.layer_rope = layer->rope;
        e.position = tokens - 1;
        return kvpi_error_emit(err, &e);
    }
    int overflow = 0;
    size_t elements = kvpi_shape_elements(shape, &overflow);
    if (overflow || elements > SIZE_MAX / sizeof(double) / 4) {
        return kvpi_fail_invalid(err, "input", "element count overflows");
    }
    if (output_len < elements) {
        return kvpi_fail_buffer(err, "output", elements, output_len);
    }
    if ((keys != NULL || values != NULL) && kv_len < elements) {
        return kvpi_fail_buffer(err, keys != NULL ? "keys" : "values", elements, kv_len);
    }
    return KVP_OK;
}

/* Rotated K and unrotated V of [B, T, D] scratch, written as [B, H, T, d_h]. */
static void export_heads(const kvp_layer *layer, const double *rows, size_t batch, size_t tokens,
                         double *out)
{
    size_t d = layer->model_width;
    size_t hd = layer->head_width;
    for (size_t b = 0; b < batch; b++) {
        for (size_t h = 0; h < layer->heads; h++) {
            for (size_t t = 0; t < tokens; t++) {
                memcpy(out + ((b * layer->heads + h) * tokens + t) * hd,
                       rows + (b * tokens + t) * d + h * hd, hd * sizeof *out);
            }
        }
    }
}

kvp_status kvp_attention_reference(const kvp_layer *layer, const kvp_tensor *input,
                                   double *output, size_t output_len, double *keys,
                                   double *values, size_t kv_len, kvp_error *err)
{
    if (layer == NULL) {
        return kvpi_fail_null(err, "layer");
    }
    if (input == NULL || input->data == NULL) {
        return kvpi_fail_null(err, "input");
    }
    if (output == NULL) {
        return kvpi_fail_null(err, "output");
    }
    kvp_status status = validate_reference(layer, input, output_len, keys, values, kv_len, err);
    if (status != KVP_OK) {
        return status;
    }
    size_t batch = input->shape.dims[0];
    size_t tokens = input->shape.dims[1];
    size_t d = layer->model_width;
    size_t hd = layer->head_width;
    size_t rows = batch * tokens * d;
    /* q, k, v rows, then tokens weights and one merged row. */
    size_t bytes = (3 * rows + tokens + d) * sizeof(double);
    double *scratch = kvpi_alloc(KVPI_SITE_SCRATCH, bytes);
    if (scratch == NULL) {
        return kvpi_fail_alloc(err, "full-prefix attention scratch", bytes);
    }
    double *q = scratch;
    double *k = q + rows;
    double *v = k + rows;
    double *weights = v + rows;
    double *merged = weights + tokens;
    double *const projected[3] = {q, k, v};
    for (size_t which = 0; which < 3; which++) {
        const double *w = kvp_param_values(layer->params[which]);
        for (size_t row = 0; row < batch * tokens; row++) {
            kvpi_project_row(input->data + row * d, w, d, projected[which] + row * d);
        }
    }
    for (size_t b = 0; b < batch; b++) {
        for (size_t t = 0; t < tokens; t++) {
            for (size_t h = 0; h < layer->heads; h++) {
                size_t at = (b * tokens + t) * d + h * hd;
                kvpi_rope_apply(&layer->rope, q + at, t);
                kvpi_rope_apply(&layer->rope, k + at, t);
            }
        }
    }
    double scale = 1.0 / sqrt((double)hd);
    const double *w_output = kvp_param_values(layer->params[KVP_PARAM_OUTPUT]);
    for (size_t b = 0; b < batch; b++) {
        for (size_t t = 0; t < tokens; t++) {
            for (size_t h = 0; h < layer->heads; h++) {
                const double *query = q + (b * tokens + t) * d + h * hd;
                for (size_t s = 0; s <= t; s++) {
                    weights[s] = kvpi_dot(query, k + (b * tokens + s) * d + h * hd, hd) * scale;
                }
                kvpi_softmax(weights, t + 1);
                double *head = merged + h * hd;
                memset(head, 0, hd * sizeof *head);
                for (size_t s = 0; s <= t; s++) {
                    kvpi_axpy(head, weights[s], v + (b * tokens + s) * d + h * hd, hd);
                }
            }
            kvpi_project_row(merged, w_output, d, output + (b * tokens + t) * d);
        }
    }
    if (keys != NULL) {
        export_heads(layer, k, batch, tokens, keys);
    }
    if (values != NULL) {
        export_heads(layer, v, batch, tokens, values);
    }
    kvpi_free(scratch);
    return KVP_OK;
}
