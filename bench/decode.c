/*
 * decode.c (bench-decode): one lane's decode attention (the three gather
 * phases a step runs: scores, softmax, values) on one thread, at the exact
 * and the fast accumulation level, against a plain read of the same bytes.
 *
 * Cases, timed in alternating repetitions (src/cli/measure.h):
 *   read   the lane's pages, K and V, in the gather's order (the page table's
 *          blocks), each byte loaded once with the best vector loads the CPU
 *          has (AVX-512, else AVX2): what memory gives;
 *   exact  kvpi_gather_attend_on at KVP_ACCUM_EXACT;
 *   fast   the same at KVP_ACCUM_FAST (f64 pages: exact again).
 * Pages are handed out shuffled (a fragmented pool). GB/s is the K+V bytes
 * of the lane's pages over the median time; "% read" is read_ns / case_ns.
 *   read2  the same bytes as two passes, every page's keys then every page's
 *          values: the gather's order of streams (scores, then values);
 *   fast-scores, fast-softmax, fast-values (with --phases): the fast
 *          level's phases timed apart (GB/s still over all K+V bytes).
 * Usage: bench-decode [--dtype f64|f32|bf16|f16|fp8] [--heads 32] [--kv-heads 8]
 *        [--head-width 128] [--block 16] [--len 4096] [--repetitions 9]
 *        [--min-ns 200000000] [--phases] [--only read|read2|exact|fast|
 *        fast-scores|fast-softmax|fast-values] (that case alone: perf stat);
 *        --help, and --flag=value as well (bench/args.h).
 * Exit status 0, 2 on usage errors (one line naming the flag and the value)
 * or when the cache cannot be built.
 */
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/gather.h"
#include "attention/kernels.h"
#include "args.h"
#include "measure.h"
#include "pager/cache_internal.h"

typedef struct decode_config {
    size_t heads, kv_heads, head_width, block, len, repetitions, min_ns;
    kvp_dtype dtype;
    int phases;       /* --phases: also time the fast level's three phases apart */
    const char *only; /* --only NAME: time that case alone (for perf stat), or NULL */
} decode_config;

/* The cases, in the order they alternate; the phases only with --phases. */
#define CASES 7
static const char *const case_names[CASES] = {"read",        "read2",        "exact",
                                              "fast",        "fast-scores",  "fast-softmax",
                                              "fast-values"};

static uint64_t rng_state = 4242;

typedef struct decode_case {
    kvpi_gather_job job;
    const kvp_cache *cache;
    size_t page_bytes; /* K and V of one page */
    int phase;         /* run_job: 0 all three phases, 1 scores, 2 softmax, 3 values */
    volatile double sink;
} decode_case;

__attribute__((target("avx512f"))) static double read_avx512(const unsigned char *p, size_t n)
{
    __m512d a0 = _mm512_setzero_pd();
    __m512d a1 = _mm512_setzero_pd();
    __m512d a2 = _mm512_setzero_pd();
    __m512d a3 = _mm512_setzero_pd();
    for (size_t i = 0; i + 256 <= n; i += 256) {
        a0 = _mm512_add_pd(a0, _mm512_loadu_pd((const double *)(const void *)(p + i)));
        a1 = _mm512_add_pd(a1, _mm512_loadu_pd((const double *)(const void *)(p + i + 64)));
        a2 = _mm512_add_pd(a2, _mm512_loadu_pd((const double *)(const void *)(p + i + 128)));
        a3 = _mm512_add_pd(a3, _mm512_loadu_pd((const double *)(const void *)(p + i + 192)));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
}

__attribute__((target("avx2"))) static double read_avx2(const unsigned char *p, size_t n)
{
    __m256d a0 = _mm256_setzero_pd();
    __m256d a1 = _mm256_setzero_pd();
    for (size_t i = 0; i + 64 <= n; i += 64) {
        a0 = _mm256_add_pd(a0, _mm256_loadu_pd((const double *)(const void *)(p + i)));
        a1 = _mm256_add_pd(a1, _mm256_loadu_pd((const double *)(const void *)(p + i + 32)));
    }
    double out[4];
    _mm256_storeu_pd(out, _mm256_add_pd(a0, a1));
    return out[0] + out[1] + out[2] + out[3];
}

static void run_read(void *ctx, size_t iterations)
{
    decode_case *c = ctx;
    const kvp_cache *cache = c->cache;
    size_t blocks = (cache->len + cache->block_tokens - 1) / cache->block_tokens;
    const uint32_t *table = kvpi_cache_lane_table(cache, 0);
    int avx512 = __builtin_cpu_supports("avx512f");
    double s = 0.0;
    for (size_t it = 0; it < iterations; it++) {
        for (size_t b = 0; b < blocks; b++) {
            const unsigned char *page = kvpi_cache_page_keys(cache, table[b], 0);
            s += avx512 ? read_avx512(page, c->page_bytes) : read_avx2(page, c->page_bytes);
        }
    }
    c->sink = s;
}

/* The keys of every page, then the values: the gather's two passes over memory. */
static void run_read2(void *ctx, size_t iterations)
{
    decode_case *c = ctx;
    const kvp_cache *cache = c->cache;
    size_t blocks = (cache->len + cache->block_tokens - 1) / cache->block_tokens;
    const uint32_t *table = kvpi_cache_lane_table(cache, 0);
    int avx512 = __builtin_cpu_supports("avx512f");
    size_t half = c->page_bytes / 2;
    double s = 0.0;
    for (size_t it = 0; it < iterations; it++) {
        for (size_t pass = 0; pass < 2; pass++) {
            for (size_t b = 0; b < blocks; b++) {
                const unsigned char *page =
                    (const unsigned char *)kvpi_cache_page_keys(cache, table[b], 0) + pass * half;
                s += avx512 ? read_avx512(page, half) : read_avx2(page, half);
            }
        }
    }
    c->sink = s;
}

static void run_job(void *ctx, size_t iterations)
{
    decode_case *c = ctx;
    for (size_t it = 0; it < iterations; it++) {
        switch (c->phase) {
        case 1:
            kvpi_gather_scores_on(&c->job, NULL);
            break;
        case 2:
            kvpi_gather_softmax_on(&c->job, NULL);
            break;
        case 3:
            kvpi_gather_values_on(&c->job, NULL);
            break;
        default:
            kvpi_gather_attend_on(&c->job, NULL);
            break;
        }
    }
}

static int parse(int argc, char **argv, decode_config *c)
{
    *c = (decode_config){32, 8, 128, 16, 4096, 9, 200000000, KVP_BF16, 0, NULL};
    static const char *const dtype_names[] = {"f64", "f32", "bf16", "f16", "fp8", NULL};
    static const kvp_dtype dtypes[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16, KVP_FP8_E4M3};
    const char *only_names[CASES + 1] = {NULL};
    for (size_t k = 0; k < CASES; k++) {
        only_names[k] = case_names[k];
    }
    int dtype = 2; /* bf16 */
    int only = -1;
    bench_arg table[] = {
        BENCH_CHOICE("--dtype", &dtype, dtype_names, "DTYPE", "the pages' dtype"),
        BENCH_SIZE("--heads", &c->heads, 1, 4096, "N", "query heads"),
        BENCH_SIZE("--kv-heads", &c->kv_heads, 1, 4096, "N", "KV heads, dividing --heads"),
        BENCH_SIZE("--head-width", &c->head_width, 2, 65536, "N", "d_h, even"),
        BENCH_SIZE("--block", &c->block, 1, 65536, "N", "block_tokens of the pool's pages"),
        BENCH_SIZE("--len", &c->len, 1, (size_t)1 << 26, "N", "retained positions of the lane"),
        BENCH_SIZE("--repetitions", &c->repetitions, 1, 1000000, "N", "alternating repetitions"),
        BENCH_SIZE("--min-ns", &c->min_ns, 0, 1000000000000, "N",
                   "each sample's minimum duration"),
        BENCH_SWITCH("--phases", &c->phases, "also time the fast level's three phases apart"),
        BENCH_CHOICE("--only", &only, only_names, "CASE",
                     "time that case alone, for perf stat (default: every case)"),
    };
    bench_args args = BENCH_ARGS("bench-decode",
                                 "One lane's decode attention at the exact and the fast level "
                                 "against a\nplain read of the same pages, on one thread.",
                                 table);
    int parsed = bench_args_parse(&args, argc, argv);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    c->dtype = dtypes[dtype];
    c->only = only >= 0 ? case_names[only] : NULL;
    if (c->heads % c->kv_heads != 0) {
        return bench_args_refuse(&args, "--kv-heads", "a divisor of --heads %zu", c->heads);
    }
    if (c->head_width % 2 != 0) {
        return bench_args_refuse(&args, "--head-width", "an even number");
    }
    return BENCH_ARGS_RUN;
}

/* One lane of len random rows in a shuffled pool. Returns 0, or -1. */
static int make_cache(const decode_config *c, kvp_pool **pool, kvp_cache **cache)
{
    size_t d = c->head_width;
    size_t kv = c->kv_heads;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = c->block;
    config.heads = kv;
    config.head_width = d;
    config.budget_bytes = (c->len / c->block + 2) * 2 * kv * c->block * d *
                          kvp_dtype_bytes(c->dtype);
    config.dtype = c->dtype;
    kvp_layer *layer = NULL;
    kvp_binding binding;
    double *row = malloc(2 * kv * d * sizeof *row);
    if (row == NULL ||
        kvp_layer_create_random_grouped(c->heads * d, c->heads, kv, c->len + 1, 10000.0, 1,
                                        &layer, NULL) != KVP_OK ||
        kvp_layer_binding_get(layer, &binding, NULL) != KVP_OK ||
        kvp_pool_create(&config, pool, NULL) != KVP_OK ||
        kvp_measure_shuffle_pool(*pool, &rng_state) != 0 ||
        kvp_cache_create(*pool, &binding, 1, c->len + 1, cache, NULL) != KVP_OK) {
        return -1;
    }
    for (size_t p = 0; p < c->len; p++) {
        for (size_t i = 0; i < 2 * kv * d; i++) {
            row[i] = kvp_measure_unit(&rng_state);
        }
        kvp_tensor key = kvp_tensor4(row, 1, kv, 1, d);
        kvp_tensor value = kvp_tensor4(row + kv * d, 1, kv, 1, d);
        if (kvpi_cache_append(*cache, &key, &value, NULL) != KVP_OK) {
            return -1;
        }
    }
    if (kvp_layer_destroy(layer, NULL) != KVP_OK) {
        return -1;
    }
    free(row);
    return 0;
}

int main(int argc, char **argv)
{
    decode_config c;
    int status = parse(argc, argv, &c);
    if (status != BENCH_ARGS_RUN) {
        return status;
    }
    kvp_pool *pool = NULL;
    kvp_cache *cache = NULL;
    if (make_cache(&c, &pool, &cache) != 0) {
        fprintf(stderr, "bench-decode: cannot build the cache\n");
        return 2;
    }
    size_t d = c.head_width;
    size_t keys = c.len + 1;
    double *q = malloc(c.heads * d * sizeof *q);
    double *cand = malloc(2 * c.kv_heads * d * sizeof *cand);
    double *w = malloc(3 * c.heads * keys * sizeof *w);
    double *o = malloc(3 * c.heads * d * sizeof *o);
    if (q == NULL || cand == NULL || w == NULL || o == NULL) {
        return 2;
    }
    for (size_t i = 0; i < c.heads * d; i++) {
        q[i] = kvp_measure_unit(&rng_state);
    }
    for (size_t i = 0; i < 2 * c.kv_heads * d; i++) {
        cand[i] = kvpi_bf16_widen((uint16_t)(0x3F00 + (i % 128))); /* exact in every dtype */
    }
    static decode_case cases[CASES];
    size_t page_bytes = 2 * c.kv_heads * c.block * d * kvp_dtype_bytes(c.dtype);
    kvp_measure_case runs[CASES];
    size_t which[CASES];
    size_t count = 0;
    for (size_t k = 0; k < CASES; k++) {
        size_t buf = k >= 4 ? 2 : k >= 3; /* the phases keep their own weights, outputs */
        int fast = k >= 3;
        cases[k].cache = cache;
        cases[k].page_bytes = page_bytes;
        cases[k].phase = k >= 4 ? (int)k - 3 : 0;
        cases[k].job = (kvpi_gather_job){.cache = cache, .queries = q, .keys = cand,
                                         .values = cand + c.kv_heads * d,
                                         .scale = 1.0 / sqrt((double)d),
                                         .weights = w + buf * c.heads * keys,
                                         .outputs = o + buf * c.heads * d,
                                         .accum = fast ? KVP_ACCUM_FAST : KVP_ACCUM_EXACT};
        int wanted = c.only != NULL ? strcmp(c.only, case_names[k]) == 0 : k < 4 || c.phases;
        if (wanted) {
            runs[count] = (kvp_measure_case){k == 0 ? run_read : k == 1 ? run_read2 : run_job,
                                             &cases[k]};
            which[count++] = k;
        }
    }
    /* The phases read the weights and outputs of a whole fast step. */
    run_job(&cases[2], 1);
    run_job(&cases[3], 1);
    kvpi_gather_attend_on(&cases[4].job, NULL); /* the phases' buffers */
    double ns[CASES];
    if (kvp_measure_alternating(runs, count, c.repetitions, (double)c.min_ns, ns) != 0) {
        return 2;
    }
    double max_diff = 0.0;
    double max_out = 0.0;
    for (size_t i = 0; i < c.heads * d; i++) {
        max_diff = fmax(max_diff, fabs(o[i] - o[c.heads * d + i]));
        max_out = fmax(max_out, fabs(o[i]));
    }
    double bytes = (double)((c.len + c.block - 1) / c.block) * (double)page_bytes;
    printf("dtype %s level %s heads %zu kv_heads %zu d_h %zu block %zu len %zu: %.1f MiB K+V\n",
           kvp_dtype_name(c.dtype), kvpi_kernels_active()->name, c.heads, c.kv_heads, d,
           c.block, c.len, bytes / 1048576.0);
    for (size_t k = 0; k < count; k++) {
        printf("  %-12s %12.0f ns  %6.2f GB/s  %5.1f%% of read\n", case_names[which[k]], ns[k],
               bytes / ns[k], which[0] == 0 ? 100.0 * ns[0] / ns[k] : 0.0);
    }
    printf("  fast vs exact: max |diff| %.3g, max |output| %.3g\n", max_diff, max_out);
    if (kvp_cache_destroy(cache, NULL) != KVP_OK || kvp_pool_destroy(pool, NULL) != KVP_OK) {
        fprintf(stderr, "bench-decode: the cache or pool refused to go\n");
    }
    free(q);
    free(cand);
    free(w);
    free(o);
    return 0;
}
