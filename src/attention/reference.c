/*
 * reference.c: the full-prefix causal attention pass (see
 * kvp_attention_reference in kvpager/attention.h).
 *
 * Owns: the oracle. It projects every position of the input, rotates Q and K
 * at their absolute positions, and lets position t attend to 0..t, keeping
 * K and V in contiguous arrays of its own; no cache, page or pool is used.
 * With a window W and sinks S (kvp_layer_set_window) position t attends to
 * [0, min(S, lo)) then [lo, t], lo = max(0, t - W + 1), each once and in
 * that order: the scores, the softmax and the value sum run over that list.
 * It shares only the arithmetic kernels with the incremental path.
 * It goes token by token and checks each token exactly where and in the
 * order the incremental path checks its one token, so a non-finite input,
 * projection, score or output gives the same status, what, flat index and
 * value as decoding the same rows one at a time would (plus err.token).
 * Out-parameters are written only on success: outputs go to scratch first.
 * With a storage dtype (kvp_attention_reference_stored), each token's rotated
 * key and value rows are checked and rounded to the dtype right after
 * rotation, where prepare rounds its candidate, so every later use (and the
 * exported K/V) sees the stored values; f64 skips that step entirely. For
 * fp8 the rounded rows are the elements e = round(x / scale) (the layer's K
 * and V scales), and the stored-dtype rule of attention applies: a score is
 * dot(q, e) * (scale * k_scale), the product computed once, and a head's
 * output feature v_scale * (sum_p w_p e_p), multiplied once at the end; the
 * exported K/V are e * k_scale and e * v_scale, as kvp_cache_keys gives.
 * Every other dtype uses 1.0 for both, which changes no bit.
 * Callers: the public API (tests, the demo, benchmarks).
 */
#include <math.h>
#include <string.h>

#include "kvpager/attention.h"
#include "attention/kernels.h"
#include "attention/layer_internal.h"
#include "pager/alloc.h"
#include "pager/dtype.h"
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
    if (overflow || elements > SIZE_MAX / sizeof(double) / 8) {
        return kvpi_fail_invalid(err, "input", "element count overflows");
    }
    if (output_len < elements) {
        return kvpi_fail_buffer(err, "output", elements, output_len);
    }
    /* K and V hold H_kv of the H heads: elements / H * H_kv, exactly. */
    size_t kv_elements = elements / layer->heads * layer->kv_heads;
    if ((keys != NULL || values != NULL) && kv_len < kv_elements) {
        return kvpi_fail_buffer(err, keys != NULL ? "keys" : "values", kv_elements, kv_len);
    }
    return KVP_OK;
}

/*
 * Rotated K and unrotated V of [B, T, H_kv * d_h] scratch, written as
 * [B, H_kv, T, d_h], times `scale` (fp8's K or V scale; 1.0 copies).
 */
static void export_heads(const kvp_layer *layer, const double *rows, size_t batch, size_t tokens,
                         double scale, double *out)
{
    size_t hd = layer->head_width;
    size_t kv = layer->kv_heads;
    size_t kv_width = kv * hd;
    for (size_t b = 0; b < batch; b++) {
        for (size_t h = 0; h < kv; h++) {
            for (size_t t = 0; t < tokens; t++) {
                double *to = out + ((b * kv + h) * tokens + t) * hd;
                memcpy(to, rows + (b * tokens + t) * kv_width + h * hd, hd * sizeof *out);
                for (size_t i = 0; scale != 1.0 && i < hd; i++) {
                    to[i] *= scale;
                }
            }
        }
    }
}

/*
 * Reports the first non-finite value of values[0..n) with `status`, as the
 * incremental path does, plus the token whose computation produced it.
 */
static kvp_status check_finite(const double *values, size_t n, kvp_status status,
                               const char *what, size_t token, kvp_error *err)
{
    kvp_status checked = kvpi_check_finite(values, n, status, what, err);
    if (checked != KVP_OK && err != NULL) {
        err->token = token;
    }
    return checked;
}

/* rows[b][t] of every lane b, [B, D], gathered from [B, T, D] into out. */
static void gather_token(const double *rows, size_t batch, size_t tokens, size_t d, size_t t,
                         double *out)
{
    for (size_t b = 0; b < batch; b++) {
        memcpy(out + b * d, rows + (b * tokens + t) * d, d * sizeof *out);
    }
}

/* Scratch of the reference: projections, one token's rows, scores and outputs. */
typedef struct reference_scratch {
    double *q;       /* [B, T, D], rotated */
    double *k;       /* [B, T, H_kv * d_h], rotated */
    double *v;       /* [B, T, H_kv * d_h] */
    double *out;     /* [B, T, D], copied to the caller's output on success */
    double *row;     /* [B, D]: one token of every lane, in the incremental layout */
    double *scores;  /* [B, H, keys] for the current token t (t + 1 without a window) */
    double *merged;  /* [B, D]: token t's heads merged, every lane */
    double k_scale;  /* fp8's K and V scales (the layer's); 1.0 for every other dtype */
    double v_scale;
} reference_scratch;

/*
 * The i-th position token t attends to (its span sp, the layer's window
 * rule): the sinks [0, sp.sinks), then the window from sp.lo on.
 */
static size_t attended(kvpi_window_span sp, size_t i)
{
    return i < sp.sinks ? i : sp.lo + (i - sp.sinks);
}

/*
 * Checks token t the way the incremental path checks its one token, in its
 * order: the Q, K and V projections (before rotation) of every lane, the
 * scores of every lane and head, the output of every lane, then the rotated
 * key and the value rows (the seed's append checks). Computes scores and
 * outputs of token t on the way.
 */
static kvp_status reference_token(const kvp_layer *layer, const reference_scratch *s, size_t batch,
                                  size_t tokens, size_t t, kvp_error *err)
{
    size_t d = layer->model_width;
    size_t hd = layer->head_width;
    size_t heads = layer->heads;
    size_t group = heads / layer->kv_heads;
    size_t kv_width = layer->kv_heads * hd;
    kvpi_window_span sp = kvpi_window_span_at(layer->window, layer->sink_tokens, t);
    size_t keys = kvpi_window_keys(sp, t);
    double scale = 1.0 / sqrt((double)hd) * s->k_scale; /* exact when k_scale is 1 */
    kvp_status status = KVP_OK;
    for (size_t b = 0; b < batch; b++) {
        for (size_t h = 0; h < heads; h++) {
            const double *query = s->q + (b * tokens + t) * d + h * hd;
            double *scores = s->scores + (b * heads + h) * keys;
            for (size_t i = 0; i < keys; i++) {
                const double *key =
                    s->k + (b * tokens + attended(sp, i)) * kv_width + (h / group) * hd;
                scores[i] = kvpi_dot(query, key, hd) * scale;
            }
        }
    }
    status = check_finite(s->scores, batch * heads * keys, KVP_NONFINITE_SCORE, "score", t, err);
    if (status != KVP_OK) {
        return status;
    }
    const double *w_output = kvp_param_values(layer->params[KVP_PARAM_OUTPUT]);
    for (size_t b = 0; b < batch; b++) {
        for (size_t h = 0; h < heads; h++) {
            double *weights = s->scores + (b * heads + h) * keys;
            kvpi_softmax(weights, keys);
            double *head = s->merged + b * d + h * hd;
            memset(head, 0, hd * sizeof *head);
            for (size_t i = 0; i < keys; i++) {
                kvpi_axpy(head, weights[i],
                          s->v + (b * tokens + attended(sp, i)) * kv_width + (h / group) * hd,
                          hd);
            }
            for (size_t i = 0; s->v_scale != 1.0 && i < hd; i++) {
                head[i] *= s->v_scale;
            }
        }
    }
    kvpi_project_rows(s->merged, d, batch, w_output, d, d, s->out + t * d, tokens * d);
    gather_token(s->out, batch, tokens, d, t, s->row);
    status = check_finite(s->row, batch * d, KVP_NONFINITE_OUTPUT, "output", t, err);
    if (status == KVP_OK) {
        gather_token(s->k, batch, tokens, kv_width, t, s->row);
        status = check_finite(s->row, batch * kv_width, KVP_NONFINITE_KEY, NULL, t, err);
    }
    if (status == KVP_OK) {
        gather_token(s->v, batch, tokens, kv_width, t, s->row);
        status = check_finite(s->row, batch * kv_width, KVP_NONFINITE_VALUE, NULL, t, err);
    }
    return status;
}

/*
 * Token t's rotated key, then value, rows (`width` = H_kv * d_h per lane) as
 * a `dtype` pool stores them: the first finite element the dtype cannot hold
 * is refused as prepare refuses it (kvpi_cache_check_storable), else the rows
 * are rounded in place.
 */
static kvp_status store_token(const reference_scratch *s, kvp_dtype dtype, size_t batch,
                              size_t tokens, size_t width, size_t t, kvp_error *err)
{
    if (dtype == KVP_F64) {
        return KVP_OK;
    }
    static const kvp_status statuses[2] = {KVP_NONFINITE_KEY, KVP_NONFINITE_VALUE};
    double *const rows[2] = {s->k, s->v};
    const double scales[2] = {s->k_scale, s->v_scale};
    for (size_t which = 0; which < 2; which++) {
        gather_token(rows[which], batch, tokens, width, t, s->row);
        size_t i = kvpi_dtype_first_overflow_scaled(dtype, scales[which], s->row, batch * width);
        if (i < batch * width) {
            kvp_error e = kvpi_error_begin(statuses[which]);
            e.what = kvp_dtype_name(dtype);
            e.index = i;
            e.value = s->row[i];
            e.token = t;
            return kvpi_error_emit(err, &e);
        }
    }
    for (size_t which = 0; which < 2; which++) {
        for (size_t b = 0; b < batch; b++) {
            kvpi_dtype_round_rows_scaled(dtype, scales[which],
                                         rows[which] + (b * tokens + t) * width, width);
        }
    }
    return KVP_OK;
}

/*
 * The unrotated projections of token t, checked query, key, value, as the
 * incremental path; widths[which] is D for the query, H_kv * d_h for K and V.
 */
static kvp_status check_projections(const reference_scratch *s, size_t batch, size_t tokens,
                                    const size_t widths[3], size_t t, kvp_error *err)
{
    static const char *const names[3] = {"query", "key", "value"};
    const double *const projected[3] = {s->q, s->k, s->v};
    for (size_t which = 0; which < 3; which++) {
        gather_token(projected[which], batch, tokens, widths[which], t, s->row);
        kvp_status status = check_finite(s->row, batch * widths[which],
                                         KVP_NONFINITE_PROJECTION, names[which], t, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    return KVP_OK;
}

kvp_status kvp_attention_reference(const kvp_layer *layer, const kvp_tensor *input,
                                   double *output, size_t output_len, double *keys,
                                   double *values, size_t kv_len, kvp_error *err)
{
    return kvp_attention_reference_stored(layer, KVP_F64, input, output, output_len, keys,
                                          values, kv_len, err);
}

kvp_status kvp_attention_reference_stored(const kvp_layer *layer, kvp_dtype dtype,
                                          const kvp_tensor *input, double *output,
                                          size_t output_len, double *keys, double *values,
                                          size_t kv_len, kvp_error *err)
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
    if (kvp_dtype_bytes(dtype) == 0) {
        return kvpi_fail_invalid(err, "dtype", KVPI_DTYPE_VALUES);
    }
    kvp_status status = validate_reference(layer, input, output_len, keys, values, kv_len, err);
    if (status != KVP_OK) {
        return status;
    }
    size_t batch = input->shape.dims[0];
    size_t tokens = input->shape.dims[1];
    size_t d = layer->model_width;
    size_t kv_width = layer->kv_heads * layer->head_width;
    size_t rows = batch * tokens * d;
    size_t kv_rows = batch * tokens * kv_width;
    /* q, k, v and out rows, one token's row of every lane, scores, one merged row per lane. */
    size_t score_doubles = batch * layer->heads * tokens;
    size_t bytes = (2 * rows + 2 * kv_rows + 2 * batch * d + score_doubles) * sizeof(double);
    double *scratch = kvpi_alloc(KVPI_SITE_SCRATCH, bytes);
    if (scratch == NULL) {
        return kvpi_fail_alloc(err, "full-prefix attention scratch", bytes);
    }
    reference_scratch s;
    s.q = scratch;
    s.k = s.q + rows;
    s.v = s.k + kv_rows;
    s.out = s.v + kv_rows;
    s.row = s.out + rows;
    s.scores = s.row + batch * d;
    s.merged = s.scores + score_doubles;
    s.k_scale = dtype == KVP_FP8_E4M3 ? layer->k_scale : 1.0;
    s.v_scale = dtype == KVP_FP8_E4M3 ? layer->v_scale : 1.0;
    double *const projected[3] = {s.q, s.k, s.v};
    const size_t widths[3] = {d, kv_width, kv_width};
    for (size_t which = 0; which < 3; which++) {
        const double *w = kvp_param_values(layer->params[which]);
        kvpi_project_rows(input->data, d, batch * tokens, w, d, widths[which], projected[which],
                          widths[which]);
    }
    for (size_t t = 0; t < tokens && status == KVP_OK; t++) {
        status = check_projections(&s, batch, tokens, widths, t, err);
        if (status != KVP_OK) {
            break;
        }
        for (size_t b = 0; b < batch; b++) {
            kvpi_layer_rope_qk(layer, s.q + (b * tokens + t) * d, layer->heads,
                               s.k + (b * tokens + t) * kv_width, layer->kv_heads, t);
        }
        status = store_token(&s, dtype, batch, tokens, kv_width, t, err);
        if (status == KVP_OK) {
            status = reference_token(layer, &s, batch, tokens, t, err);
        }
    }
    if (status == KVP_OK) {
        memcpy(output, s.out, rows * sizeof *output);
        if (keys != NULL) {
            export_heads(layer, s.k, batch, tokens, s.k_scale, keys);
        }
        if (values != NULL) {
            export_heads(layer, s.v, batch, tokens, s.v_scale, values);
        }
    }
    kvpi_free(scratch);
    return status;
}
