/*
 * split.c: does one long sequence use two cores?
 *
 * Times one decode step's attention over a single lane (B = 1) of `len`
 * retained positions, the three phases incremental attention runs (scores,
 * softmax, value mixture: kvpi_gather_attend_on, attention/gather.h), on
 * this thread alone and on a decoder of 2 (or --threads N) threads through
 * the decoder's assist (kvpi_decoder_run, serve/decoder_internal.h: the code
 * path a decoder step takes when it has fewer jobs than threads). Before
 * timing, it checks that the threaded weights and head outputs equal the
 * serial ones bit for bit.
 *
 * The cache is one lane in a shuffled (fragmented) pool, its rows uniform
 * on [-1, 1) rounded to the dtype; queries are scaled by 0.1 so the softmax
 * is not degenerate. Timing is src/cli/measure.h's: alternating
 * repetitions, medians, the ratio taken within one call. GB/s is the K+V
 * bytes one step reads over its median time.
 *
 * Flags: bench/args.h's rules (--help lists them with their ranges and
 * defaults; --flag value or --flag=value).
 *
 * Exit status 0 when the results agree, 1 otherwise (speed is reported, not
 * enforced: the machine may be shared), 2 on usage or setup errors (a bad
 * flag or value: one line naming both).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "attention/gather.h"
#include "kvpager/kvpager.h"
#include "measure.h"
#include "pager/cache_internal.h"
#include "serve/decoder_internal.h"

typedef struct split_config {
    size_t len;
    size_t heads;
    size_t kv_heads; /* 0: heads */
    size_t head_width;
    size_t block;
    size_t threads;
    size_t repetitions;
    size_t min_ns;
    int dtype;       /* one dtype, or -1 for f64 and f32 */
    size_t value_units; /* 0: the library's grain; else kvpi_gather_grain.value_units */
    size_t chunk_kib;   /* 0: the library's grain; else chunk_bytes / 1024 */
} split_config;

static uint64_t rng_state = 777;

/* One step's buffers and the job over them. */
typedef struct split_case {
    kvpi_gather_job job;
    kvp_decoder *decoder;
    size_t iterations;
    int failed;
} split_case;

static void serial_run(void *ctx, size_t iterations)
{
    split_case *s = ctx;
    for (size_t i = 0; i < iterations; i++) {
        kvpi_gather_attend_on(&s->job, NULL);
    }
}

static void solo(void *ctx, const kvpi_parallel *par)
{
    split_case *s = ctx;
    for (size_t i = 0; i < s->iterations; i++) {
        kvpi_gather_attend_on(&s->job, par);
    }
}

static void threaded_run(void *ctx, size_t iterations)
{
    split_case *s = ctx;
    s->iterations = iterations;
    if (kvpi_decoder_run(s->decoder, solo, s, NULL) != KVP_OK) {
        s->failed = 1;
    }
}

/* Parses the flags into c: BENCH_ARGS_RUN, or the exit status (bench/args.h). */
static int parse(int argc, char **argv, split_config *c)
{
    *c = (split_config){65536, 8, 0, 64, 16, 2, 9, 200000000, -1, 0, 0};
    static const char *const dtype_names[] = {"f64", "f32", "bf16", NULL};
    static const kvp_dtype dtypes[] = {KVP_F64, KVP_F32, KVP_BF16};
    int dtype = -1;
    bench_arg table[] = {
        BENCH_SIZE("--len", &c->len, 1, (size_t)1 << 26, "N", "retained positions of the lane"),
        BENCH_SIZE("--heads", &c->heads, 1, 4096, "N", "query heads"),
        BENCH_SIZE("--kv-heads", &c->kv_heads, 1, 4096, "N", "KV heads, dividing --heads "
                                                              "(default: --heads)"),
        BENCH_SIZE("--head-width", &c->head_width, 2, 65536, "N", "d_h, even"),
        BENCH_SIZE("--block", &c->block, 1, 65536, "N", "block_tokens of the pool's pages"),
        BENCH_SIZE("--threads", &c->threads, 2, 1024, "N", "the decoder's threads"),
        BENCH_CHOICE("--dtype", &dtype, dtype_names, "DTYPE", "the pages' dtype (default: f64 "
                                                              "and f32)"),
        BENCH_SIZE("--repetitions", &c->repetitions, 1, 1000000, "N", "alternating repetitions"),
        BENCH_SIZE("--min-ns", &c->min_ns, 0, 1000000000000, "N",
                   "each sample's minimum duration"),
        BENCH_SIZE("--value-units", &c->value_units, 1, (size_t)1 << 20, "N",
                   "the partition's value units, for tuning (default: the library's)"),
        BENCH_SIZE("--chunk-kib", &c->chunk_kib, 1, (size_t)1 << 20, "N",
                   "the partition's chunk in KiB, for tuning (default: the library's)"),
    };
    bench_args args = BENCH_ARGS(
        "bench-split",
        "One lane's decode attention on 1 thread and on a decoder of N (default 2).\n"
        "--value-units and --chunk-kib override the partition's grain, for tuning\n"
        "(attention/gather.h); the results stay bit-identical.",
        table);
    int parsed = bench_args_parse(&args, argc, argv);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    c->dtype = dtype >= 0 ? (int)dtypes[dtype] : -1;
    if (c->kv_heads == 0) {
        c->kv_heads = c->heads;
    }
    if (c->heads % c->kv_heads != 0) {
        return bench_args_refuse(&args, "--kv-heads", "a divisor of --heads %zu", c->heads);
    }
    if (c->head_width % 2 != 0) {
        return bench_args_refuse(&args, "--head-width", "an even number");
    }
    return BENCH_ARGS_RUN;
}

/* Destroys the cache (unless NULL), then the pool; a refusal is reported. */
static void drop(kvp_cache *cache, kvp_pool *pool)
{
    if (cache != NULL) {
        (void)kvp_cache_destroy(cache, NULL);
    }
    if (kvp_pool_destroy(pool, NULL) != KVP_OK) {
        fprintf(stderr, "bench-split: the pool refused to go\n");
    }
}

/* One lane of len random rows in a shuffled pool. Returns 0, or -1 (nothing left). */
static int make_cache(const split_config *c, kvp_dtype dtype, kvp_pool **pool, kvp_cache **cache)
{
    size_t d = c->head_width;
    size_t kv = c->kv_heads;
    size_t pages = c->len / c->block + 2;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = c->block;
    config.heads = kv;
    config.head_width = d;
    config.budget_bytes = pages * 2 * kv * c->block * d * kvp_dtype_bytes(dtype);
    config.dtype = dtype;
    kvp_layer *layer = NULL;
    kvp_binding binding;
    double *row = malloc(2 * kv * d * sizeof *row);
    int failed = row == NULL ||
                 kvp_layer_create_random_grouped(c->heads * d, c->heads, kv, c->len + 1,
                                                 10000.0, 1, &layer, NULL) != KVP_OK ||
                 kvp_layer_binding_get(layer, &binding, NULL) != KVP_OK ||
                 kvp_pool_create(&config, pool, NULL) != KVP_OK;
    if (!failed && (kvp_measure_shuffle_pool(*pool, &rng_state) != 0 ||
                    kvp_cache_create(*pool, &binding, 1, c->len + 1, cache, NULL) != KVP_OK)) {
        drop(NULL, *pool);
        failed = 1;
    }
    for (size_t p = 0; !failed && p < c->len; p++) {
        for (size_t i = 0; i < 2 * kv * d; i++) {
            row[i] = kvp_measure_unit(&rng_state);
        }
        kvp_tensor key = kvp_tensor4(row, 1, kv, 1, d);
        kvp_tensor value = kvp_tensor4(row + kv * d, 1, kv, 1, d);
        if (kvpi_cache_append(*cache, &key, &value, NULL) != KVP_OK) {
            drop(*cache, *pool);
            failed = 1;
        }
    }
    if (layer != NULL) {
        kvp_layer_destroy(layer, NULL);
    }
    free(row);
    return failed ? -1 : 0;
}

/* Times one dtype; prints its line. Returns 0, 1 (results differ) or 2 (setup failed). */
static int run_dtype(const split_config *c, kvp_dtype dtype, kvp_decoder *decoder)
{
    kvp_pool *pool = NULL;
    kvp_cache *cache = NULL;
    if (make_cache(c, dtype, &pool, &cache) != 0) {
        fprintf(stderr, "bench-split: cannot build the %s cache\n", kvp_dtype_name(dtype));
        return 2;
    }
    size_t d = c->head_width;
    size_t hd = c->heads * d;
    size_t nweights = c->heads * (c->len + 1);
    double *buffers = calloc(2 * hd + 2 * c->kv_heads * d + 4 * nweights + 2 * hd,
                             sizeof(double));
    if (buffers == NULL) {
        fprintf(stderr, "bench-split: out of memory\n");
        drop(cache, pool);
        return 2;
    }
    double *queries = buffers;
    double *keys = queries + hd;
    double *values = keys + c->kv_heads * d;
    double *weights[2] = {values + c->kv_heads * d, values + c->kv_heads * d + nweights};
    double *outputs[2] = {weights[1] + nweights, weights[1] + nweights + hd};
    for (size_t i = 0; i < hd; i++) {
        queries[i] = 0.1 * kvp_measure_unit(&rng_state);
    }
    for (size_t i = 0; i < c->kv_heads * d; i++) {
        keys[i] = kvp_measure_unit(&rng_state);
        values[i] = kvp_measure_unit(&rng_state);
    }
    double scale = 1.0 / sqrt((double)d);
    split_case cases[2];
    for (int k = 0; k < 2; k++) {
        cases[k] = (split_case){{.cache = cache, .queries = queries, .keys = keys, .values = values,
                                  .scale = scale, .weights = weights[k], .outputs = outputs[k]},
                                decoder, 0, 0};
    }
    serial_run(&cases[0], 1);
    uint64_t helped = kvpi_decoder_assisted_parts(decoder);
    threaded_run(&cases[1], 1);
    helped = kvpi_decoder_assisted_parts(decoder) - helped;
    size_t parts = kvpi_gather_score_parts(cache) + kvpi_gather_softmax_parts(cache) +
                   kvpi_gather_value_parts(cache);
    int identical = !cases[1].failed &&
                    memcmp(weights[0], weights[1], nweights * sizeof(double)) == 0 &&
                    memcmp(outputs[0], outputs[1], hd * sizeof(double)) == 0;
    double ns[2] = {0, 0};
    kvp_measure_case measured[2] = {{serial_run, &cases[0]}, {threaded_run, &cases[1]}};
    int timed = kvp_measure_alternating(measured, 2, c->repetitions, (double)c->min_ns, ns) == 0 &&
                !cases[1].failed;
    double bytes = 2.0 * (double)c->len * (double)(c->kv_heads * d) * kvp_dtype_bytes(dtype);
    if (timed) {
        printf("%-5s %8zu %5zu %8zu %5zu %6zu %12.0f %12.0f %7.2f %7.2f %6.2fx %4zu/%-4zu  %s\n",
               kvp_dtype_name(dtype), c->len, c->heads, c->kv_heads, d, c->block, ns[0], ns[1],
               bytes / ns[0], bytes / ns[1], ns[0] / ns[1], (size_t)helped, parts,
               identical ? "identical" : "DIFFERENT");
    } else {
        fprintf(stderr, "bench-split: timing failed\n");
    }
    free(buffers);
    drop(cache, pool);
    return !identical ? 1 : timed ? 0 : 2;
}

int main(int argc, char **argv)
{
    split_config c;
    int parsed = parse(argc, argv, &c);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    if (c.value_units != 0 || c.chunk_kib != 0) {
        kvpi_gather_grain grain = kvpi_gather_grain_get();
        grain.value_units = c.value_units != 0 ? c.value_units : grain.value_units;
        grain.chunk_bytes = c.chunk_kib != 0 ? c.chunk_kib << 10 : grain.chunk_bytes;
        kvpi_gather_grain_set(&grain);
    }
    kvp_decoder *decoder = NULL;
    if (kvp_decoder_create(c.threads, &decoder, NULL) != KVP_OK) {
        fprintf(stderr, "bench-split: cannot start %zu threads\n", c.threads);
        return 2;
    }
    printf("one lane's decode attention (scores, softmax, values), B = 1: 1 thread against a "
           "decoder of %zu\n(median ns per step of %zu alternating repetitions; GB/s of K+V "
           "read)\n",
           c.threads, c.repetitions);
    printf("%-5s %8s %5s %8s %5s %6s %12s %12s %7s %7s %7s %9s\n", "dtype", "len", "heads",
           "kv_heads", "d_h", "block", "ns_1", "ns_n", "GB/s_1", "GB/s_n", "speedup", "helped");
    static const kvp_dtype both[] = {KVP_F64, KVP_F32};
    int status = 0;
    for (size_t i = 0; i < 2 && status != 2; i++) {
        if (c.dtype >= 0 && i > 0) {
            break;
        }
        int result = run_dtype(&c, c.dtype >= 0 ? (kvp_dtype)c.dtype : both[i], decoder);
        status = result > status ? result : status;
    }
    kvp_decoder_destroy(decoder, NULL);
    return status;
}
