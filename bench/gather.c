/*
 * gather.c: how much does paging cost attention?
 *
 * Times the library's real gather loops (kvpi_gather_scores and
 * kvpi_gather_values, the ones kvp_attention_prepare runs) over a cache of
 * `len` retained rows in pages of block_tokens positions, against two
 * baselines holding the same rows contiguously, as the seed's LayerKvCache
 * stores them ([H, C, d_h] keys, then values):
 *   contiguous  the same library loops over a cache whose single page holds
 *               all C positions (block_tokens = C): identical code, one table
 *               lookup, contiguous memory. The ratio against it is the cost
 *               of paging itself.
 *   hand loop   a plain loop over separate [H, C, d_h] arrays, written here.
 * All three use the same kernels in the same order; the program checks that
 * their results are bit-for-bit equal before timing them.
 *
 * Pages are handed out in a shuffled order (a fragmented pool), so a lane's
 * blocks are scattered over the slab. The clock, the alternating repetitions
 * and the shuffle are src/cli/measure.h's, shared with `kvpager bench`.
 *
 * Every ISA level of the dot/axpy kernels this CPU runs is measured in the
 * same run (or one, with --isa), so the speedup of each level over the
 * portable one reads off one table; GB/s is the K+V bytes one gather reads
 * (2 * H * len * d_h * 8) over its median time. The loops are timed in alternating
 * repetitions; the report gives median nanoseconds per gather and the speed
 * ratio baseline_time / paged_time (1.0 means paging costs nothing; the
 * target is >= 0.95 against `contiguous` for block_tokens >= 16).
 *
 * Flags: bench/args.h's rules (--help lists them with their ranges and
 * defaults; --flag value or --flag=value).
 *
 * Exit status 0 when the results agree, 1 otherwise (speed is reported, not
 * enforced: the machine may be shared and noisy), 2 on usage errors (a bad
 * flag or value: one line naming both).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "attention/gather.h"
#include "attention/kernels.h"
#include "attention/layer_internal.h"
#include "measure.h"
#include "pager/cache_internal.h"

typedef struct bench_config {
    size_t heads;
    size_t head_width;
    size_t len;
    size_t repetitions;
    size_t min_ns;     /* time each repetition for at least this long */
    size_t block;      /* only this block_tokens, or 0 for the default list */
    int json;
    int sequential;    /* pages in pool order instead of shuffled */
    int isa;           /* the one level to run, or -1 for every level the CPU runs */
} bench_config;

typedef struct bench_row {
    kvpi_isa isa;
    size_t block_tokens;
    double paged_ns;
    double contiguous_ns;  /* the library loops over one contiguous page */
    double hand_ns;        /* the hand-written loop over [H, C, d_h] arrays */
    double ratio;          /* contiguous_ns / paged_ns */
    double hand_ratio;     /* hand_ns / paged_ns */
    double gbps;           /* K+V bytes read per paged gather / paged_ns */
    double speedup;        /* the portable level's paged_ns / this paged_ns (0: not run) */
    int identical;
} bench_row;

static uint64_t rng_state = 12345;

static double unit(void)
{
    return kvp_measure_unit(&rng_state);
}

/* The paged loops, as incremental attention runs them for one lane. */
static void paged_gather(const kvp_cache *cache, const double *query, const double *candidate,
                         double *scores, double *out)
{
    double scale = 1.0 / sqrt((double)cache->head_width);
    kvpi_gather_scores(cache, query, candidate, 0, scale, scores);
    kvpi_gather_values(cache, scores, candidate, 0, out);
}

/* The same loops over contiguous [H, C, d_h] keys and values. */
static void contiguous_gather(const double *keys, const double *values, size_t heads,
                              size_t capacity, size_t len, size_t d, const double *query,
                              const double *candidate, double *scores, double *out)
{
    double scale = 1.0 / sqrt((double)d);
    for (size_t h = 0; h < heads; h++) {
        double *s = scores + h * (len + 1);
        const double *q = query + h * d;
        const double *k = keys + h * capacity * d;
        const double *v = values + h * capacity * d;
        for (size_t p = 0; p < len; p++) {
            s[p] = kvpi_dot(q, k + p * d, d) * scale;
        }
        s[len] = kvpi_dot(q, candidate + h * d, d) * scale;
        double *o = out + h * d;
        memset(o, 0, d * sizeof *o);
        for (size_t p = 0; p < len; p++) {
            kvpi_axpy(o, s[p], v + p * d, d);
        }
        kvpi_axpy(o, s[len], candidate + h * d, d);
    }
}

typedef struct workspace {
    double *query;
    double *candidate;
    double *scores_paged;
    double *scores_contiguous;
    double *out_paged;
    double *out_contiguous;
    double *keys;        /* contiguous [H, C, d_h] */
    double *values;
    double *row;         /* [H, d_h] one appended row */
} workspace;

static int fill_cache(kvp_cache *cache, const bench_config *c, workspace *w)
{
    size_t d = c->head_width;
    size_t hd = c->heads * d;
    double *key_row = w->row;
    double *value_row = w->row + hd;
    for (size_t p = 0; p < c->len; p++) {
        for (size_t i = 0; i < hd; i++) {
            key_row[i] = unit();
            value_row[i] = unit();
        }
        kvp_tensor key = kvp_tensor4(key_row, 1, c->heads, 1, d);
        kvp_tensor value = kvp_tensor4(value_row, 1, c->heads, 1, d);
        if (kvpi_cache_append(cache, &key, &value, NULL) != KVP_OK) {
            return -1;
        }
        for (size_t h = 0; h < c->heads; h++) {
            memcpy(w->keys + (h * c->len + p) * d, key_row + h * d, d * sizeof(double));
            memcpy(w->values + (h * c->len + p) * d, value_row + h * d, d * sizeof(double));
        }
    }
    return 0;
}

typedef struct loop_ctx {
    const kvp_cache *cache;    /* NULL: the hand loop */
    const bench_config *c;
    workspace *w;
} loop_ctx;

static void run_loop(void *arg, size_t iterations)
{
    const loop_ctx *l = arg;
    workspace *w = l->w;
    for (size_t i = 0; i < iterations; i++) {
        if (l->cache != NULL) {
            paged_gather(l->cache, w->query, w->candidate, w->scores_paged, w->out_paged);
        } else {
            contiguous_gather(w->keys, w->values, l->c->heads, l->c->len, l->c->len,
                              l->c->head_width, w->query, w->candidate, w->scores_contiguous,
                              w->out_contiguous);
        }
    }
}

/* Median ns per gather of each loop, in alternating repetitions (src/cli/measure.h). */
static int time_loops(const kvp_cache *cache, const kvp_cache *single, const bench_config *c,
                      workspace *w, bench_row *row)
{
    loop_ctx ctx[3] = {{cache, c, w}, {single, c, w}, {NULL, c, w}};
    kvp_measure_case cases[3] = {{run_loop, &ctx[0]}, {run_loop, &ctx[1]}, {run_loop, &ctx[2]}};
    double ns[3];
    if (kvp_measure_alternating(cases, 3, c->repetitions, (double)c->min_ns, ns) != 0) {
        return -1;
    }
    row->paged_ns = ns[0];
    row->contiguous_ns = ns[1];
    row->hand_ns = ns[2];
    row->ratio = row->contiguous_ns / row->paged_ns;
    row->gbps = 2.0 * (double)(c->heads * c->len * c->head_width * sizeof(double)) / row->paged_ns;
    row->hand_ratio = row->hand_ns / row->paged_ns;
    return 0;
}

/* A pool of the given block size holding one lane of `len` rows, pages shuffled. */
static int make_cache(const bench_config *c, size_t block_tokens, workspace *w, kvp_pool **pool,
                      kvp_cache **cache)
{
    size_t d = c->head_width;
    size_t page_bytes = 2 * c->heads * block_tokens * d * sizeof(double);
    size_t pages = (c->len + block_tokens - 1) / block_tokens;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = block_tokens;
    config.heads = c->heads;
    config.head_width = d;
    config.budget_bytes = (pages + 8) * page_bytes;
    config.dtype = KVP_F64;
    kvpi_layer_record record; /* a layer binding of no layer: the gather reads only heads */
    memset(&record, 0, sizeof record);
    record.magic = KVPI_LAYER_RECORD_MAGIC;
    record.model_width = c->heads * d;
    record.heads = c->heads;
    record.rope_feature_width = d;
    record.rope_max_positions = c->len;
    kvp_binding binding;
    kvpi_layer_record_binding(&record, c->heads, d, 0.0, 0.0, &binding);
    uint64_t saved = rng_state; /* every cache gets the same rows */
    int failed = kvp_pool_create(&config, pool, NULL) != KVP_OK ||
                 (!c->sequential && kvp_measure_shuffle_pool(*pool, &rng_state) != 0) ||
                 kvp_cache_create(*pool, &binding, 1, c->len, cache, NULL) != KVP_OK;
    rng_state = saved;
    if (failed || fill_cache(*cache, c, w) != 0) {
        fprintf(stderr, "bench-gather: setup failed for block_tokens %zu\n", block_tokens);
        return -1;
    }
    return 0;
}

static int bench_block(const bench_config *c, size_t block_tokens, workspace *w, bench_row *row)
{
    kvp_pool *pool = NULL;
    kvp_pool *single_pool = NULL;
    kvp_cache *cache = NULL;
    kvp_cache *single = NULL;
    uint64_t start_state = rng_state;
    if (make_cache(c, block_tokens, w, &pool, &cache) != 0) {
        return -1;
    }
    rng_state = start_state;
    if (make_cache(c, c->len, w, &single_pool, &single) != 0) {
        return -1;
    }
    /* The caches hold len rows; the candidate is the (len+1)-th, outside every buffer. */
    size_t nscores = c->heads * (c->len + 1);
    size_t nout = c->heads * c->head_width;
    paged_gather(cache, w->query, w->candidate, w->scores_paged, w->out_paged);
    paged_gather(single, w->query, w->candidate, w->scores_contiguous, w->out_contiguous);
    int same = memcmp(w->scores_paged, w->scores_contiguous, nscores * sizeof(double)) == 0 &&
               memcmp(w->out_paged, w->out_contiguous, nout * sizeof(double)) == 0;
    contiguous_gather(w->keys, w->values, c->heads, c->len, c->len, c->head_width, w->query,
                      w->candidate, w->scores_contiguous, w->out_contiguous);
    same = same && memcmp(w->scores_paged, w->scores_contiguous, nscores * sizeof(double)) == 0 &&
           memcmp(w->out_paged, w->out_contiguous, nout * sizeof(double)) == 0;
    row->block_tokens = block_tokens;
    row->identical = same;
    int timed = time_loops(cache, single, c, w, row);
    kvp_cache_destroy(cache, NULL);
    kvp_cache_destroy(single, NULL);
    int failed = kvp_pool_destroy(pool, NULL) != KVP_OK;
    failed |= kvp_pool_destroy(single_pool, NULL) != KVP_OK;
    return failed || timed != 0 ? -1 : 0;
}

/* Parses the flags into c: BENCH_ARGS_RUN, or the exit status (bench/args.h). */
static int parse(int argc, char **argv, bench_config *c)
{
    const char *isa_names[KVPI_ISA_COUNT + 1] = {NULL};
    for (int isa = 0; isa < KVPI_ISA_COUNT; isa++) {
        isa_names[isa] = kvpi_isa_name((kvpi_isa)isa);
    }
    bench_arg table[] = {
        BENCH_SIZE("--len", &c->len, 1, (size_t)1 << 24, "N", "retained rows of the cache"),
        BENCH_SIZE("--heads", &c->heads, 1, 1024, "N", "heads"),
        BENCH_SIZE("--head-width", &c->head_width, 1, 4096, "N", "d_h"),
        BENCH_SIZE("--block", &c->block, 1, 65536, "N",
                   "only this block_tokens (default: 1, 4, 16, 32 and 64)"),
        BENCH_SIZE("--repetitions", &c->repetitions, 1, 1000000, "N", "alternating repetitions"),
        BENCH_SIZE("--min-ns", &c->min_ns, 0, 1000000000000, "N",
                   "each repetition's minimum duration"),
        BENCH_CHOICE("--isa", &c->isa, isa_names, "LEVEL",
                     "only this ISA level (default: every level the CPU runs)"),
        BENCH_SWITCH("--sequential", &c->sequential, "pages in pool order instead of shuffled"),
        BENCH_SWITCH("--json", &c->json, "print the rows as JSON"),
    };
    bench_args args = BENCH_ARGS(
        "bench-gather",
        "Times the paged gather loops against the same loops over a contiguous\n"
        "[H,C,d_h] buffer, for block_tokens 1, 4, 16, 32 and 64 (or --block), at\n"
        "every ISA level the CPU runs (or --isa scalar|avx2|avx512), and prints the\n"
        "median ns per gather, the speed ratio (contiguous / paged), the K+V GB/s\n"
        "and each level's speedup over the portable one.",
        table);
    int parsed = bench_args_parse(&args, argc, argv);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    if (c->isa >= 0 && kvpi_kernels_level((kvpi_isa)c->isa) == NULL) {
        return bench_args_refuse(&args, "--isa", "a level this CPU runs");
    }
    return BENCH_ARGS_RUN;
}

int main(int argc, char **argv)
{
    bench_config c = {8, 64, 1024, 21, 2000000, 0, 0, 0, -1};
    int parsed = parse(argc, argv, &c);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    size_t d = c.head_width;
    size_t hd = c.heads * d;
    workspace w = {
        malloc(hd * sizeof(double)), malloc(hd * sizeof(double)),
        malloc(c.heads * (c.len + 1) * sizeof(double)),
        malloc(c.heads * (c.len + 1) * sizeof(double)),
        malloc(hd * sizeof(double)), malloc(hd * sizeof(double)),
        malloc(c.heads * c.len * d * sizeof(double)), malloc(c.heads * c.len * d * sizeof(double)),
        malloc(2 * hd * sizeof(double)),
    };
    if (w.query == NULL || w.candidate == NULL || w.scores_paged == NULL ||
        w.scores_contiguous == NULL || w.out_paged == NULL || w.out_contiguous == NULL ||
        w.keys == NULL || w.values == NULL || w.row == NULL) {
        fprintf(stderr, "bench-gather: out of memory\n");
        return 2;
    }
    for (size_t i = 0; i < hd; i++) {
        w.query[i] = unit() * 0.1;
        w.candidate[i] = unit();
    }
    static const size_t default_blocks[] = {1, 4, 16, 32, 64};
    const size_t *blocks = c.block ? &c.block : default_blocks;
    size_t nblocks = c.block ? 1 : sizeof default_blocks / sizeof default_blocks[0];
    kvpi_isa levels[KVPI_ISA_COUNT];
    size_t nlevels = 0;
    for (int isa = 0; isa < KVPI_ISA_COUNT; isa++) {
        if ((c.isa < 0 || c.isa == isa) && kvpi_kernels_level((kvpi_isa)isa) != NULL) {
            levels[nlevels++] = (kvpi_isa)isa;
        }
    }
    bench_row rows[KVPI_ISA_COUNT * (sizeof default_blocks / sizeof default_blocks[0])];
    size_t nrows = 0;
    int ok = 1;
    for (size_t l = 0; l < nlevels; l++) {
        if (kvpi_kernels_use(levels[l]) != 0) {
            return 2;
        }
        for (size_t b = 0; b < nblocks; b++) {
            bench_row *row = &rows[nrows++];
            if (bench_block(&c, blocks[b], &w, row) != 0) {
                return 2;
            }
            row->isa = levels[l];
            row->speedup = levels[0] == KVPI_ISA_SCALAR ? rows[b].paged_ns / row->paged_ns : 0.0;
            ok = ok && row->identical;
        }
    }
    if (c.json) {
        printf("{\"heads\":%zu,\"head_width\":%zu,\"len\":%zu,\"repetitions\":%zu,"
               "\"kv_bytes\":%zu,\"rows\":[",
               c.heads, c.head_width, c.len, c.repetitions,
               2 * c.heads * c.len * c.head_width * sizeof(double));
        for (size_t r = 0; r < nrows; r++) {
            printf("%s{\"isa\":\"%s\",\"block_tokens\":%zu,\"paged_ns\":%.1f,"
                   "\"contiguous_ns\":%.1f,\"hand_loop_ns\":%.1f,\"speed_ratio\":%.4f,"
                   "\"hand_loop_ratio\":%.4f,\"gbps\":%.3f,\"speedup_over_scalar\":%.4f,"
                   "\"identical\":%s}",
                   r ? "," : "", kvpi_isa_name(rows[r].isa), rows[r].block_tokens,
                   rows[r].paged_ns, rows[r].contiguous_ns, rows[r].hand_ns, rows[r].ratio,
                   rows[r].hand_ratio, rows[r].gbps, rows[r].speedup,
                   rows[r].identical ? "true" : "false");
        }
        printf("]}\n");
    } else {
        printf("gather over %zu retained rows, %zu heads of width %zu (%.1f MiB of K+V), pages in\n"
               "%s order; median ns per gather of %zu alternating repetitions; ratio = baseline /\n"
               "paged; contiguous: the same loops over one page of all %zu positions; hand loop:\n"
               "a plain loop over [H,C,d_h] arrays; GB/s: K+V bytes / paged time; speedup: the\n"
               "scalar level's paged time / this level's\n\n",
               c.len, c.heads, c.head_width,
               (double)(2 * c.heads * c.len * c.head_width * sizeof(double)) / 1048576.0,
               c.sequential ? "pool" : "shuffled", c.repetitions, c.len);
        printf("isa     block_tokens     paged  contiguous  ratio   hand loop  ratio   GB/s  "
               "speedup  results\n");
        for (size_t r = 0; r < nrows; r++) {
            printf("%-6s  %12zu  %8.0f  %10.0f  %5.3f  %10.0f  %5.3f  %5.2f  ",
                   kvpi_isa_name(rows[r].isa), rows[r].block_tokens, rows[r].paged_ns,
                   rows[r].contiguous_ns, rows[r].ratio, rows[r].hand_ns, rows[r].hand_ratio,
                   rows[r].gbps);
            if (rows[r].speedup > 0.0) {
                printf("%7.2f  ", rows[r].speedup);
            } else {
                printf("%7s  ", "-");
            }
            printf("%s\n", rows[r].identical ? "bit-identical" : "DIFFER");
        }
    }
    free(w.query);
    free(w.candidate);
    free(w.scores_paged);
    free(w.scores_contiguous);
    free(w.out_paged);
    free(w.out_contiguous);
    free(w.keys);
    free(w.values);
    free(w.row);
    return ok ? 0 : 1;
}
