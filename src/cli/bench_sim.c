/*
 * bench_sim.c: `kvpager bench`'s page operations and its simulate figure.
 *
 * Owns:
 *   page ops  page acquire + release through the public API: a row
 *             reservation of one block (one page) or of 64 blocks (64
 *             pages) on an external cache of one lane, then its discard
 *             (kvp_cache_reserve_rows + kvp_cache_discard_rows: the pages
 *             are taken from the pool's free list and put back under its
 *             mutex, tentative, with no row written and nothing allocated),
 *             against jemalloc mallocx/sdallocx and glibc malloc/free of as
 *             many objects of the page's bytes;
 *   simulate  the default `kvpager simulate` workload run in-process
 *             (sim.h), its tokens/s against a bound: the time the K+V bytes
 *             its steps read take at the read bandwidth of their own size.
 *             For each step, the bytes are the pages held at the step's
 *             end less the run's internal fragmentation (the retained rows
 *             every running sequence's attention reads in every layer; a
 *             sequence finishing in the step has given its pages back, so
 *             this counts low, and the bound is higher); the bandwidth is
 *             the best of 1 and 2 threads of the read loop (bench_read.c)
 *             over the largest power of two of bytes not above that size
 *             (smaller reads are faster, so this errs high too), measured
 *             alternately with the simulate runs. The bound is the
 *             generated tokens over the sum of those times: no run can
 *             reach it unless its attention reads faster than the read loop.
 * Callers: bench.c (bench.h).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <jemalloc/jemalloc.h>

#include "alloc.h"
#include "bench.h"
#include "cli.h"
#include "sim.h"
#include "workload.h"

/*
 * glibc's own allocator. The program links jemalloc ahead of libc, so plain
 * malloc is jemalloc's; glibc exports its allocator under these names too.
 */
extern void *__libc_malloc(size_t size);
extern void __libc_free(void *ptr);

#define BATCH 64          /* pages per batched acquire + release */
#define MIN_SIZE_LOG2 16  /* the bound's smallest read: 64 KiB */
#define MAX_SIZES 40


typedef struct page_ctx {
    kvp_cache *cache;      /* the kvpager cases' external cache (one lane) */
    size_t rows;           /* rows per reservation: 1 or BATCH blocks */
    size_t bytes;
    void *volatile sink;   /* keeps the compiler from pairing away malloc and free */
    int failed;
    void *held[BATCH];
} page_ctx;

/*
 * Pages acquired and released through the public API: reserving c->rows
 * rows of an empty cache takes their pages (one per block) from the pool,
 * and discarding the reservation puts them back (kvpager/cache.h). Nothing
 * is written into the pages and nothing is allocated on the heap, so this
 * is the pool's take + put with the cache's checks and bookkeeping around
 * it, as every append and release pays.
 */
static void pool_pages(void *arg, size_t iterations)
{
    page_ctx *c = arg;
    for (size_t i = 0; i < iterations; i++) {
        if (kvp_cache_reserve_rows(c->cache, c->rows, NULL) != KVP_OK) {
            c->failed = 1;
            return;
        }
        kvp_status discarded = kvp_cache_discard_rows(c->cache, NULL); /* NULL_ARGUMENT only */
        (void)discarded;
    }
}

static void jemalloc_single(void *arg, size_t iterations)
{
    page_ctx *c = arg;
    for (size_t i = 0; i < iterations; i++) {
        void *p = mallocx(c->bytes, 0);
        if (p == NULL) {
            c->failed = 1;
            return;
        }
        c->sink = p;
        sdallocx(p, c->bytes, 0);
    }
}

static void jemalloc_batch(void *arg, size_t iterations)
{
    page_ctx *c = arg;
    for (size_t i = 0; i < iterations; i++) {
        for (size_t p = 0; p < BATCH; p++) {
            c->held[p] = mallocx(c->bytes, 0);
            c->failed |= c->held[p] == NULL;
        }
        for (size_t p = 0; p < BATCH; p++) {
            if (c->held[p] != NULL) {
                sdallocx(c->held[p], c->bytes, 0);
            }
        }
    }
}

static void glibc_single(void *arg, size_t iterations)
{
    page_ctx *c = arg;
    for (size_t i = 0; i < iterations; i++) {
        void *p = __libc_malloc(c->bytes);
        if (p == NULL) {
            c->failed = 1;
            return;
        }
        c->sink = p;
        __libc_free(p);
    }
}

static void glibc_batch(void *arg, size_t iterations)
{
    page_ctx *c = arg;
    for (size_t i = 0; i < iterations; i++) {
        for (size_t p = 0; p < BATCH; p++) {
            c->held[p] = __libc_malloc(c->bytes);
            c->failed |= c->held[p] == NULL;
        }
        for (size_t p = 0; p < BATCH; p++) {
            __libc_free(c->held[p]);
        }
    }
}

/* An external cache of one lane with room for BATCH blocks: the kvpager cases' pages. */
static int page_cache(kvp_pool *pool, const kvp_pool_config *config, kvp_cache **cache)
{
    kvp_binding binding;
    kvp_error err;
    size_t rows = BATCH * config->block_tokens;
    if (kvp_binding_init_external(&binding, config->heads, config->head_width, rows, 1, 1,
                                  &err) != KVP_OK ||
        kvp_cache_create(pool, &binding, 1, rows, cache, &err) != KVP_OK) {
        kvp_cli_report("bench", "creating the page cache", &err);
        return -1;
    }
    return 0;
}

/* Times the six cases alternately; 0, or -1 when one failed. */
static int time_pages(const bench_options *o, kvp_cache *cache, size_t block_tokens,
                      size_t page_bytes, bench_results *r)
{
    page_ctx *ctx = kvp_cli_calloc(6, sizeof *ctx);
    if (ctx == NULL) {
        kvp_cli_report_oom("bench", "the page contexts", 6 * sizeof *ctx);
        return -1;
    }
    static const kvp_measure_fn fns[6] = {pool_pages, jemalloc_single, glibc_single,
                                          pool_pages, jemalloc_batch,  glibc_batch};
    kvp_measure_case cases[6];
    for (size_t i = 0; i < 6; i++) {
        ctx[i].cache = cache;
        ctx[i].rows = (i < 3 ? 1 : BATCH) * block_tokens;
        ctx[i].bytes = page_bytes;
        cases[i].run = fns[i];
        cases[i].ctx = &ctx[i];
    }
    int failed = kvp_measure_alternating(cases, 6, o->repetitions, BENCH_MIN_NS, r->page_ns);
    for (size_t i = 0; i < 6; i++) {
        failed |= ctx[i].failed;
    }
    kvp_cli_free(ctx);
    if (failed != 0) {
        kvp_cli_report_oom("bench", "a page", page_bytes);
        return -1;
    }
    return 0;
}

/*
 * Pages of the simulated model's geometry (kvp_sim_config_init: 16 positions
 * of width 64, 16 KiB), the pages the simulate figure below moves.
 */
int bench_measure_pages(const bench_options *o, bench_results *r)
{
    kvp_sim_config sim;
    kvp_sim_config_init(&sim);
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = sim.block_tokens;
    config.heads = sim.heads;
    config.head_width = sim.model_width / sim.heads;
    size_t page_bytes = 2 * config.block_tokens * config.heads * config.head_width *
                        sizeof(double);
    config.budget_bytes = 4 * BATCH * page_bytes;
    kvp_error err;
    kvp_pool *pool = NULL;
    if (kvp_pool_create(&config, &pool, &err) != KVP_OK) {
        kvp_cli_report("bench", "creating the page pool", &err);
        return KVP_CLI_USAGE;
    }
    kvp_cache *cache = NULL;
    int status = page_cache(pool, &config, &cache) != 0 ||
                         time_pages(o, cache, config.block_tokens, page_bytes, r) != 0
                     ? KVP_CLI_USAGE
                     : KVP_CLI_OK;
    if (cache != NULL) {
        kvp_status ignored = kvp_cache_destroy(cache, NULL); /* holds no page: cannot fail */
        (void)ignored;
    }
    if (kvp_pool_destroy(pool, &err) != KVP_OK && status == KVP_CLI_OK) {
        kvp_cli_report("bench", "destroying the page pool", &err);
        status = KVP_CLI_USAGE;
    }
    r->page_bytes = page_bytes;
    return status;
}

/* ---- simulate ---------------------------------------------------------------- */

/* The bound's read sizes: 2^(MIN_SIZE_LOG2 + i) bytes, i < count. */
typedef struct size_reads {
    size_t count;
    double best[BENCH_SIM_REPETITIONS][MAX_SIZES]; /* GB/s, best of 1 and 2 threads */
    double gbps[MAX_SIZES];                        /* median over the rounds */
} size_reads;

/* K+V bytes step `step` reads (see the top of the file). */
static double step_bytes(const kvp_sim_result *res, size_t step)
{
    double held = (double)res->samples[step].held_pages * (double)res->page_bytes;
    return held * (1.0 - res->internal_fragmentation);
}

/* The index of the largest size not above `bytes` (the smallest one below it). */
static size_t size_index(const size_reads *s, double bytes)
{
    size_t i = 0;
    while (i + 1 < s->count && ldexp(1.0, (int)(MIN_SIZE_LOG2 + i + 1)) <= bytes) {
        i++;
    }
    return i;
}

/* The sizes a run's steps need, up to the read array's size. */
static void plan_sizes(const kvp_sim_result *res, const bench_reader *reader, size_reads *s)
{
    double largest = 0.0;
    for (size_t i = 0; i < res->steps; i++) {
        double b = step_bytes(res, i);
        largest = b > largest ? b : largest;
    }
    largest = largest < (double)reader->bytes ? largest : (double)reader->bytes;
    s->count = 1;
    while (s->count < MAX_SIZES && ldexp(1.0, (int)(MIN_SIZE_LOG2 + s->count)) <= largest) {
        s->count++;
    }
}

/* One round of the bound's reads: every size on 1 and 2 threads, every kernel, alternating. */
static int read_sizes(const bench_results *r, size_reads *s, size_t round)
{
    bench_read_set sets[2 * MAX_SIZES];
    kvp_measure_case cases[2 * MAX_SIZES * BENCH_READ_KERNELS];
    double ns[2 * MAX_SIZES * BENCH_READ_KERNELS];
    size_t start[2 * MAX_SIZES];
    size_t n = 0;
    for (size_t i = 0; i < 2 * s->count; i++) {
        size_t bytes = (size_t)1 << (MIN_SIZE_LOG2 + i / 2);
        start[i] = n;
        n += bench_read_set_init(&sets[i], &r->reader, bytes, i % 2 == 0 ? NULL : r->pair,
                                 cases + n);
    }
    if (kvp_measure_alternating(cases, n, 1, BENCH_MIN_NS, ns) != 0) {
        kvp_cli_report_oom("bench", "the timing scratch", n * sizeof(double));
        return -1;
    }
    for (size_t i = 0; i < s->count; i++) {
        size_t kernel = 0;
        double one = bench_read_set_best(&sets[2 * i], ns + start[2 * i], &kernel);
        double two = bench_read_set_best(&sets[2 * i + 1], ns + start[2 * i + 1], &kernel);
        s->best[round][i] = one > two ? one : two;
    }
    return 0;
}

/* Fills r's simulate bound from the last run's steps and the rounds' reads. */
static void set_bound(const kvp_sim_result *res, size_reads *s, size_t rounds, bench_results *r)
{
    for (size_t i = 0; i < s->count; i++) {
        double values[BENCH_SIM_REPETITIONS];
        for (size_t k = 0; k < rounds; k++) {
            values[k] = s->best[k][i];
        }
        s->gbps[i] = kvp_measure_median(values, rounds);
    }
    double seconds = 0.0;
    double bytes = 0.0;
    for (size_t i = 0; i < res->steps; i++) {
        double b = step_bytes(res, i);
        bytes += b;
        seconds += b / (s->gbps[size_index(s, b)] * 1e9);
    }
    double tokens = (double)res->tokens_generated;
    r->sim_steps = res->steps;
    r->sim_sizes = s->count;
    r->sim_mean_step_bytes = res->steps > 0 ? bytes / (double)res->steps : 0.0;
    r->sim_bytes_per_token = tokens > 0.0 ? bytes / tokens : 0.0;
    r->sim_bound = seconds > 0.0 ? tokens / seconds : 0.0;
}

static int sim_workload(const bench_options *o, const kvp_sim_config *config,
                        kvp_workload *workload)
{
    kvp_workload_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.profile = KVP_PROFILE_SHAREGPT;
    spec.arrival = KVP_ARRIVAL_POISSON;
    spec.rate = 1.0;
    spec.requests = o->requests;
    spec.capacity = config->capacity;
    spec.seed = config->seed;
    kvp_workload_spec_defaults(&spec);
    if (kvp_workload_generate(&spec, workload) != 0) {
        kvp_cli_report_oom("bench", "the request list", o->requests * sizeof(kvp_workload_request));
        return -1;
    }
    return 0;
}

/* Runs, each followed by a round of the bound's reads; the last run's steps set the bound. */
int bench_measure_simulate(const bench_options *o, bench_results *r)
{
    kvp_sim_config config;
    kvp_sim_config_init(&config);
    config.audit_every = 0;
    kvp_workload workload = {NULL, 0};
    if (sim_workload(o, &config, &workload) != 0) {
        return KVP_CLI_USAGE;
    }
    double rates[BENCH_SIM_REPETITIONS];
    size_reads sizes;
    memset(&sizes, 0, sizeof sizes);
    size_t runs = o->repetitions < BENCH_SIM_REPETITIONS ? o->repetitions
                                                         : (size_t)BENCH_SIM_REPETITIONS;
    kvp_sim_result result;
    memset(&result, 0, sizeof result);
    int status = KVP_CLI_OK;
    for (size_t i = 0; i < runs && status == KVP_CLI_OK; i++) {
        kvp_error err;
        const char *context = NULL;
        kvp_sim_result_free(&result);
        if (kvp_sim_run(&config, &workload, NULL, NULL, &result, &err, &context) != 0) {
            kvp_cli_report("bench", context != NULL ? context : "simulating", &err);
            status = KVP_CLI_USAGE;
            break;
        }
        rates[i] = result.tokens_per_second;
        r->sim_threads = result.threads;
        if (i == 0) {
            plan_sizes(&result, &r->reader, &sizes);
        }
        if (read_sizes(r, &sizes, i) != 0) {
            status = KVP_CLI_USAGE;
        }
    }
    if (status == KVP_CLI_OK) {
        r->sim_tokens_per_second = kvp_measure_median(rates, runs);
        r->sim_requests = workload.count;
        set_bound(&result, &sizes, runs, r);
    }
    kvp_sim_result_free(&result);
    kvp_workload_free(&workload);
    return status;
}
