/*
 * bench_gather.c: `kvpager bench`'s gather measurements.
 *
 * Owns: for one shape of the grid and each block_tokens, the public
 * paged-attention call (kvp_paged_attention, kvpager/paged.h: scores,
 * softmax and values over every lane's retained rows plus a candidate row,
 * the loops kvp_attention_prepare runs, at the shape's accumulation level)
 * for every lane and query head of an external cache of B lanes x L rows,
 * in two layouts of the same pages:
 *   paged       the pages shuffled over the pool's slab (a pool that has
 *               served many sequences);
 *   contiguous  the same block_tokens, each lane's pages adjacent and in
 *               order ([L / bt][2][H_kv][bt][d_h] per lane, one run of
 *               memory), so the loops read the same bytes in the same order
 *               and paged / contiguous measures the page table's
 *               indirection and the scattering only;
 * each on one thread and on a 2-thread decoder (the call's `threads`),
 * alternating with a read of the shape's own K+V size on one thread by
 * every read kernel (the best of them is the row's read figure;
 * bench_read.c). All four outputs must be bit for bit equal (the row says
 * so; the command exits 1 otherwise). Public API only.
 * Callers: bench.c (bench.h).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "bench.h"
#include "cli.h"
#include "kvpager/paged.h"

#define ROW_VARIANTS 7 /* distinct random rows cycled through a cache */

#define APPEND_ROWS 64 /* rows per kvp_cache_append_rows call */

/* One timed case: kvp_paged_attention on this thread (decoder NULL) or on a decoder's. */
typedef struct gather_ctx {
    kvp_paged_attention_args args;
    kvp_decoder *decoder;
    int failed; /* the call was refused (cannot happen: checked once before timing) */
} gather_ctx;

static void gather_once(gather_ctx *g)
{
    kvp_error err;
    if (kvp_paged_attention(&g->args, g->decoder, &err) != KVP_OK) {
        g->failed = 1;
    }
}

static void gather_run(void *arg, size_t iterations)
{
    for (size_t i = 0; i < iterations; i++) {
        gather_once(arg);
    }
}

/* The gather cases of one (shape, block), in each round before the reads (bench_read_set). */
enum { PAGED_1, CONTIGUOUS_1, PAGED_2, CONTIGUOUS_2, GATHERS };
#define CASES (GATHERS + BENCH_READ_KERNELS)

/* Buffers shared by every cache of one shape. */
typedef struct gather_space {
    double *rows;    /* [ROW_VARIANTS][2][B][H_kv][d_h]: key then value rows, cycled */
    double *staging; /* [2][B][H_kv][APPEND_ROWS][d_h]: kvp_cache_append_rows' layout */
    double *queries;
    double *candidates;
    double *outputs[GATHERS];
} gather_space;

static void space_free(gather_space *w)
{
    kvp_cli_free(w->rows);
    kvp_cli_free(w->staging);
    kvp_cli_free(w->queries);
    kvp_cli_free(w->candidates);
    for (int i = 0; i < GATHERS; i++) {
        kvp_cli_free(w->outputs[i]);
    }
    memset(w, 0, sizeof *w);
}

static int space_alloc(const bench_shape *s, gather_space *w, uint64_t *rng)
{
    size_t bhd = s->batch * s->heads * s->width;
    size_t bkd = s->batch * s->kv_heads * s->width;
    memset(w, 0, sizeof *w);
    w->rows = kvp_cli_alloc(ROW_VARIANTS * 2 * bkd, sizeof(double));
    w->staging = kvp_cli_alloc(2 * APPEND_ROWS * bkd, sizeof(double));
    w->queries = kvp_cli_alloc(bhd, sizeof(double));
    w->candidates = kvp_cli_alloc(bkd, sizeof(double));
    int failed = w->rows == NULL || w->staging == NULL || w->queries == NULL ||
                 w->candidates == NULL;
    for (int i = 0; i < GATHERS; i++) {
        w->outputs[i] = kvp_cli_alloc(bhd, sizeof(double));
        failed |= w->outputs[i] == NULL;
    }
    if (failed) {
        space_free(w);
        kvp_cli_report_oom("bench", "the gather buffers",
                           ((ROW_VARIANTS * 2 + 2 * APPEND_ROWS + 1) * bkd +
                            (GATHERS + 1) * bhd) * 8);
        return -1;
    }
    for (size_t i = 0; i < ROW_VARIANTS * 2 * bkd; i++) {
        w->rows[i] = kvp_measure_unit(rng);
    }
    for (size_t i = 0; i < bhd; i++) {
        w->queries[i] = kvp_measure_unit(rng) * 0.1;
    }
    for (size_t i = 0; i < bkd; i++) {
        w->candidates[i] = kvp_measure_unit(rng);
    }
    return 0;
}

typedef struct built {
    kvp_pool *pool;
    kvp_cache *cache;
} built;

/* Destroys what was built; -1 when the pool refused (a page still held: a bug). */
static int built_destroy(built *b)
{
    int failed = 0;
    if (b->cache != NULL) {
        failed |= kvp_cache_destroy(b->cache, NULL) != KVP_OK;
    }
    if (b->pool != NULL) {
        failed |= kvp_pool_destroy(b->pool, NULL) != KVP_OK;
    }
    b->cache = NULL;
    b->pool = NULL;
    return failed ? -1 : 0;
}

/* A pool's free list: shuffled (paged) or each lane's pages adjacent (contiguous). */
static int arrange(kvp_pool *pool, const bench_shape *s, size_t blocks, int shuffled,
                   uint64_t *rng)
{
    return shuffled ? kvp_measure_shuffle_pool(pool, rng)
                    : kvp_measure_lane_major_pool(pool, s->batch, blocks);
}

/* Rows [p0, p0 + n) of the cycled rows in kvp_cache_append_rows' layout, keys then values. */
static void stage_rows(const bench_shape *s, const gather_space *w, size_t p0, size_t n)
{
    size_t bkd = s->batch * s->kv_heads * s->width;
    size_t lanes = s->batch * s->kv_heads;
    for (size_t r = 0; r < n; r++) {
        const double *key = w->rows + ((p0 + r) % ROW_VARIANTS) * 2 * bkd;
        for (size_t lh = 0; lh < lanes; lh++) {
            size_t at = (lh * n + r) * s->width;
            memcpy(w->staging + at, key + lh * s->width, s->width * sizeof(double));
            memcpy(w->staging + n * bkd + at, key + bkd + lh * s->width,
                   s->width * sizeof(double));
        }
    }
}

/* A pool of `block` positions per page holding B lanes of L rows, its pages arranged. */
static int build_cache(const bench_shape *s, size_t block, int shuffled, const gather_space *w,
                       uint64_t *rng, built *out)
{
    kvp_error err;
    const char *context = "creating a pool";
    size_t pages_per_lane = (s->len + block - 1) / block;
    size_t page_bytes = 2 * s->kv_heads * block * s->width * kvp_dtype_bytes(s->dtype);
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = block;
    config.heads = s->kv_heads;
    config.head_width = s->width;
    config.budget_bytes = (s->batch * pages_per_lane + 8) * page_bytes;
    config.dtype = s->dtype;
    memset(out, 0, sizeof *out);
    kvp_status status = kvp_pool_create(&config, &out->pool, &err);
    if (status == KVP_OK && arrange(out->pool, s, pages_per_lane, shuffled, rng) != 0) {
        built_destroy(out);
        kvp_cli_report_oom("bench", "arranging the free list",
                           (s->batch * pages_per_lane + 8) * sizeof(void *));
        return -1;
    }
    kvp_binding binding;
    if (status == KVP_OK) {
        context = "making an external binding";
        status = kvp_binding_init_external(&binding, s->kv_heads, s->width, s->len, 1, 1, &err);
    }
    if (status == KVP_OK) {
        context = "creating a cache";
        status = kvp_cache_create(out->pool, &binding, s->batch, s->len, &out->cache, &err);
    }
    size_t bkd = s->batch * s->kv_heads * s->width;
    for (size_t p = 0; status == KVP_OK && p < s->len; p += APPEND_ROWS) {
        size_t n = s->len - p < APPEND_ROWS ? s->len - p : APPEND_ROWS;
        stage_rows(s, w, p, n);
        context = "appending rows";
        status = kvp_cache_append_rows(out->cache, w->staging, w->staging + n * bkd, n, &err);
    }
    if (status != KVP_OK) {
        kvp_cli_report("bench", context, &err);
        built_destroy(out);
        return -1;
    }
    return 0;
}

/* The two rows (1 thread, 2 threads) of one (shape, block) from its medians. */
static void add_rows(const bench_shape *s, size_t block, int identical, const double *ns,
                     const bench_read_set *read, bench_results *r)
{
    size_t bytes = bench_kv_bytes(s);
    size_t kernel = 0;
    double read_gbps = bench_read_set_best(read, ns + GATHERS, &kernel);
    for (size_t t = 1; t <= 2; t++) {
        bench_row *row = &r->rows[r->row_count++];
        row->s = *s;
        row->block_tokens = block;
        row->threads = t;
        row->identical = identical;
        row->paged_ns = ns[t == 1 ? PAGED_1 : PAGED_2];
        row->contiguous_ns = ns[t == 1 ? CONTIGUOUS_1 : CONTIGUOUS_2];
        row->gbps = (double)bytes / row->paged_ns;
        row->dram = bench_dram_resident(bytes);
        row->read_gbps = t == 1 ? read_gbps : NAN;
        row->read_kernel = kernel;
        row->percent_of_size_read = t == 1 ? 100.0 * row->gbps / read_gbps : NAN;
        row->percent_of_read = t == 1 && row->dram ? row->percent_of_size_read : NAN;
    }
}

/* One block_tokens of one shape: both layouts built, timed alternately with the read. */
static int measure_block(const bench_options *o, const bench_shape *s, size_t block,
                         gather_space *w, uint64_t *rng, bench_results *r)
{
    built paged;
    built contiguous;
    if (build_cache(s, block, 1, w, rng, &paged) != 0) {
        return KVP_CLI_USAGE;
    }
    if (build_cache(s, block, 0, w, rng, &contiguous) != 0) {
        built_destroy(&paged);
        return KVP_CLI_USAGE;
    }
    size_t bhd = s->batch * s->heads * s->width;
    gather_ctx ctx[GATHERS];
    int refused = 0;
    for (int c = 0; c < GATHERS; c++) {
        const built *cache = c == PAGED_1 || c == PAGED_2 ? &paged : &contiguous;
        kvp_paged_attention_args_init(&ctx[c].args);
        ctx[c].args.cache = cache->cache;
        ctx[c].args.heads = s->heads;
        ctx[c].args.io_dtype = KVP_F64;
        ctx[c].args.queries = w->queries;
        ctx[c].args.keys = w->candidates;
        ctx[c].args.values = w->candidates;
        ctx[c].args.scale = 1.0 / sqrt((double)s->width);
        ctx[c].args.accum = s->accum;
        ctx[c].args.outputs = w->outputs[c];
        ctx[c].decoder = c == PAGED_2 || c == CONTIGUOUS_2 ? r->decoder : NULL;
        ctx[c].failed = 0;
        kvp_error err;
        if (!refused && kvp_paged_attention(&ctx[c].args, ctx[c].decoder, &err) != KVP_OK) {
            kvp_cli_report("bench", "kvp_paged_attention", &err);
            refused = 1;
        }
    }
    if (refused) {
        built_destroy(&paged);
        built_destroy(&contiguous);
        return KVP_CLI_USAGE;
    }
    int identical = 1;
    for (int c = 1; c < GATHERS; c++) {
        identical &= memcmp(w->outputs[0], w->outputs[c], bhd * sizeof(double)) == 0;
    }
    kvp_measure_case cases[CASES];
    for (int c = 0; c < GATHERS; c++) {
        cases[c] = (kvp_measure_case){gather_run, &ctx[c]};
    }
    bench_read_set read;
    size_t count = GATHERS + bench_read_set_init(&read, &r->reader, bench_kv_bytes(s), NULL,
                                                 cases + GATHERS);
    double ns[CASES];
    int status = KVP_CLI_OK;
    if (kvp_measure_alternating(cases, count, o->repetitions, BENCH_MIN_NS, ns) != 0) {
        kvp_cli_report_oom("bench", "the timing scratch", CASES * o->repetitions * 8);
        status = KVP_CLI_USAGE;
    } else if (ctx[PAGED_1].failed || ctx[CONTIGUOUS_1].failed || ctx[PAGED_2].failed ||
               ctx[CONTIGUOUS_2].failed) {
        fprintf(stderr, "kvpager bench: kvp_paged_attention refused a timed call\n");
        status = KVP_CLI_USAGE;
    } else {
        add_rows(s, block, identical, ns, &read, r);
    }
    int destroyed = built_destroy(&paged) | built_destroy(&contiguous);
    if (destroyed != 0 && status == KVP_CLI_OK) {
        fprintf(stderr, "kvpager bench: destroying a cache's pool failed\n");
        status = KVP_CLI_USAGE;
    }
    return status;
}

int bench_measure_shape(const bench_options *o, const bench_shape *s, bench_results *r,
                        kvp_progress *progress, size_t *done, size_t total)
{
    uint64_t rng = 20240601u + s->len * 31u + s->batch * 7u + s->heads * 3u + s->width +
                   s->kv_heads * 101u + (uint64_t)s->dtype * 1009u;
    gather_space w;
    if (space_alloc(s, &w, &rng) != 0) {
        return KVP_CLI_USAGE;
    }
    int status = KVP_CLI_OK;
    for (size_t b = 0; b < o->blocks.count && status == KVP_CLI_OK; b++) {
        size_t block = o->blocks.value[b] < s->len ? o->blocks.value[b] : s->len;
        status = measure_block(o, s, block, &w, &rng, r);
        *done += 1;
        kvp_progress_note(progress, *done, total, "measurements");
    }
    space_free(&w);
    return status;
}
