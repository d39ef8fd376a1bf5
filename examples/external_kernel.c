/*
 * external_kernel.c: a tiny "engine" that keeps its KV cache in kvpager pages
 * but computes attention with its own kernel, as an engine with its own
 * kernels (vLLM, TensorRT-LLM, llama.cpp) would.
 *
 * Owns: nothing of kvpager's; it uses the installed public headers only.
 * For each token it projects Q, K and V itself, rotates Q and K
 * (kvp_rope_rotate), appends the K and V rows to an EXTERNAL cache
 * (kvp_cache_append_rows), then gathers every stored row back through the
 * lane's block table (kvp_cache_block_table) and the page data
 * (kvp_pool_page_data: address, dtype, strides) for its own scores, softmax
 * and weighted sum, and projects the output. A layer-bound twin cache
 * decoded by kvp_attention_forward gives the reference outputs.
 *
 * Agreement: within 1e-12 (absolute) of kvp_attention_forward, not bit for
 * bit: kvpager's kernels sum dot products in SIMD lanes and use their own
 * exp, this loop sums in plain order with libm's exp. The stored K/V rows
 * are the same bits (both caches round each row once to the pool's dtype),
 * so a narrow dtype changes both outputs alike. Runs for f64 and bf16 pages
 * with grouped-query heads (4 query heads over 2 KV heads).
 * Exit status 0 when every output agrees, 1 otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvpager/kvpager.h>

enum { D = 16, HEADS = 4, KV_HEADS = 2, HD = D / HEADS, KVW = KV_HEADS * HD };
enum { BATCH = 2, BLOCK = 4, CAPACITY = 24, STEPS = 19 };
#define TOLERANCE 1e-12

static int check(kvp_status status, const kvp_error *err, const char *what)
{
    if (status == KVP_OK) {
        return 0;
    }
    char text[256];
    kvp_error_format(err, text, sizeof text);
    fprintf(stderr, "external_kernel: %s: %s\n", what, text);
    return 1;
}

/* y[0..cols) = x[0..rows) W, W row-major rows x cols (kvpager's convention). */
static void project(const double *x, const double *w, size_t rows, size_t cols, double *y)
{
    for (size_t j = 0; j < cols; j++) {
        double sum = 0.0;
        for (size_t i = 0; i < rows; i++) {
            sum += x[i] * w[i * cols + j];
        }
        y[j] = sum;
    }
}

/* One stored element, widened to f64 (exact). */
static double load(kvp_dtype dtype, const unsigned char *row, size_t i)
{
    switch (dtype) {
    case KVP_F32: {
        float f;
        memcpy(&f, row + i * sizeof f, sizeof f);
        return (double)f;
    }
    case KVP_BF16: {
        uint16_t h;
        memcpy(&h, row + i * sizeof h, sizeof h);
        uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return (double)f;
    }
    default: {
        double x;
        memcpy(&x, row + i * sizeof x, sizeof x);
        return x;
    }
    }
}

/*
 * The engine's attention for one lane at length `len` (the new row already
 * appended): q is the rotated query [D]; out receives the merged heads [D].
 * Every K and V row is read from the pages, through the block table.
 */
static int attend(kvp_pool *pool, const kvp_cache *cache, size_t lane, size_t len,
                  const double *q, double *out)
{
    const uint32_t *table = NULL;
    size_t blocks = 0;
    kvp_error err;
    if (check(kvp_cache_block_table(cache, lane, &table, &blocks, &err), &err, "block table")) {
        return 1;
    }
    double scores[CAPACITY];
    for (size_t h = 0; h < HEADS; h++) {
        size_t kv = h / (HEADS / KV_HEADS); /* the query head's KV head */
        double max = -INFINITY;
        for (size_t p = 0; p < len; p++) {
            const void *keys = NULL;
            const void *values = NULL;
            kvp_page_layout layout;
            kvp_page_layout_init(&layout);
            if (check(kvp_pool_page_data(pool, table[p / BLOCK], &keys, &values, &layout, &err),
                      &err, "page data")) {
                return 1;
            }
            const unsigned char *k = (const unsigned char *)keys + kv * layout.head_stride_bytes +
                                     (p % layout.block_tokens) * layout.row_stride_bytes;
            double dot = 0.0;
            for (size_t i = 0; i < HD; i++) {
                dot += q[h * HD + i] * load(layout.dtype, k, i);
            }
            scores[p] = dot / sqrt((double)HD);
            max = scores[p] > max ? scores[p] : max;
        }
        double sum = 0.0;
        for (size_t p = 0; p < len; p++) {
            scores[p] = exp(scores[p] - max);
            sum += scores[p];
        }
        memset(out + h * HD, 0, HD * sizeof *out);
        for (size_t p = 0; p < len; p++) {
            const void *keys = NULL;
            const void *values = NULL;
            kvp_page_layout layout;
            kvp_page_layout_init(&layout);
            if (check(kvp_pool_page_data(pool, table[p / BLOCK], &keys, &values, &layout, &err),
                      &err, "page data")) {
                return 1;
            }
            const unsigned char *v = (const unsigned char *)values +
                                     kv * layout.head_stride_bytes +
                                     (p % layout.block_tokens) * layout.row_stride_bytes;
            for (size_t i = 0; i < HD; i++) {
                out[h * HD + i] += scores[p] / sum * load(layout.dtype, v, i);
            }
        }
    }
    return 0;
}

/* Decodes STEPS tokens both ways on `dtype` pages; returns the largest difference. */
static int run(kvp_dtype dtype, double *worst)
{
    kvp_error err;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BLOCK;
    config.heads = KV_HEADS;
    config.head_width = HD;
    config.dtype = dtype;
    config.budget_bytes = 64 * 2 * KV_HEADS * BLOCK * HD * kvp_dtype_bytes(dtype);
    kvp_pool *pool = NULL;
    kvp_layer *layer = NULL;
    kvp_cache *twin = NULL;
    kvp_cache *mine = NULL;
    kvp_ticket *ticket = NULL;
    if (check(kvp_pool_create(&config, &pool, &err), &err, "pool") ||
        check(kvp_layer_create_random_grouped(D, HEADS, KV_HEADS, CAPACITY, 10000.0, 7, &layer,
                                              &err),
              &err, "layer")) {
        return 1;
    }
    kvp_layer_info info;
    kvp_layer_info_init(&info);
    kvp_binding bound;
    kvp_binding external;
    if (check(kvp_layer_info_get(layer, &info, &err), &err, "layer info") ||
        check(kvp_layer_binding_get(layer, &bound, &err), &err, "layer binding") ||
        /* Our cache is bound to our own identity (a model version, say). */
        check(kvp_binding_init_external(&external, KV_HEADS, HD, CAPACITY, 0xE1u, 1, &err), &err,
              "external binding") ||
        check(kvp_cache_create(pool, &bound, BATCH, CAPACITY, &twin, &err), &err, "twin") ||
        check(kvp_cache_create(pool, &external, BATCH, CAPACITY, &mine, &err), &err, "cache") ||
        check(kvp_ticket_create(twin, &ticket, &err), &err, "ticket")) {
        return 1;
    }
    const double *w[KVP_PARAM_COUNT];
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        w[i] = kvp_param_values(kvp_layer_param(layer, i));
    }
    uint64_t state = 12345;
    int failed = 0;
    for (size_t t = 0; t < STEPS && !failed; t++) {
        double x[BATCH * D];
        for (size_t i = 0; i < BATCH * D; i++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            x[i] = (double)(state >> 11) * 0x1p-53 * 2.0 - 1.0;
        }
        /* kvpager's attention on the layer-bound twin. */
        kvp_tensor in = kvp_tensor3(x, BATCH, 1, D);
        kvp_attention_result result;
        if (check(kvp_attention_forward(layer, &in, twin, ticket, &err), &err, "forward") ||
            check(kvp_ticket_result(ticket, &result, &err), &err, "result")) {
            return 1;
        }
        /* The engine: project, rotate, append [B, H_kv, 1, d_h] rows, attend. */
        double q[BATCH][D];
        double k[BATCH * KVW]; /* [B][H_kv][1][d_h] == [B][H_kv * d_h] */
        double v[BATCH * KVW];
        for (size_t b = 0; b < BATCH; b++) {
            project(x + b * D, w[KVP_PARAM_QUERY], D, D, q[b]);
            project(x + b * D, w[KVP_PARAM_KEY], D, KVW, k + b * KVW);
            project(x + b * D, w[KVP_PARAM_VALUE], D, KVW, v + b * KVW);
            for (size_t h = 0; h < HEADS && !failed; h++) {
                failed = check(kvp_rope_rotate(&info.rope, q[b] + h * HD, t, &err), &err, "rope");
            }
            for (size_t h = 0; h < KV_HEADS && !failed; h++) {
                failed = check(kvp_rope_rotate(&info.rope, k + b * KVW + h * HD, t, &err), &err,
                               "rope");
            }
        }
        if (failed || check(kvp_cache_append_rows(mine, k, v, 1, &err), &err, "append rows")) {
            return 1;
        }
        for (size_t b = 0; b < BATCH && !failed; b++) {
            double merged[D];
            double out[D];
            failed = attend(pool, mine, b, kvp_cache_len(mine), q[b], merged);
            project(merged, w[KVP_PARAM_OUTPUT], D, D, out);
            for (size_t i = 0; i < D; i++) {
                double diff = fabs(out[i] - result.output[b * D + i]);
                *worst = diff > *worst || isnan(diff) ? diff : *worst;
            }
        }
    }
    failed |= check(kvp_pool_check(pool, NULL, NULL, &err), &err, "audit");
    (void)kvp_ticket_destroy(ticket, NULL);
    (void)kvp_cache_destroy(mine, NULL);
    (void)kvp_cache_destroy(twin, NULL);
    (void)kvp_layer_destroy(layer, NULL);
    failed |= check(kvp_pool_destroy(pool, &err), &err, "pool destroy");
    return failed;
}

int main(void)
{
    static const kvp_dtype dtypes[] = {KVP_F64, KVP_BF16};
    int failed = 0;
    for (size_t i = 0; i < 2; i++) {
        double worst = 0.0;
        int broke = run(dtypes[i], &worst);
        int ok = !broke && worst <= TOLERANCE;
        printf("external_kernel: %s pages, %d tokens x %d lanes: max |ours - kvp_attention_forward|"
               " = %.3g (tolerance %g): %s\n",
               kvp_dtype_name(dtypes[i]), STEPS, BATCH, worst, TOLERANCE, ok ? "ok" : "FAILED");
        failed |= !ok;
    }
    return failed;
}
