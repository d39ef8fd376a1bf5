/*
 * bench.c: `kvpager bench`, the numbers of issue 8 side by side, in one run.
 *
 * Owns: the command line, the grid, and the measurements:
 *   read      a STREAM-like read bandwidth figure: the sum of a large array
 *             (1 GiB by default) with eight independent accumulators, on one
 *             thread and on two (each summing half);
 *   gather    the library's own gather loops (kvpi_gather_scores and
 *             kvpi_gather_values, the ones kvp_attention_prepare runs, as
 *             bench/gather.c times them), every lane and head of a cache of
 *             B lanes x L retained rows, paged (pages shuffled over the slab)
 *             against the same loops over one page per lane holding all L
 *             positions (contiguous: one table lookup, [H,L,d_h] memory).
 *             Both caches hold the same rows; their results must be bit for
 *             bit equal (exit 1 otherwise). GB/s = K+V bytes / paged time;
 *             its percentage is of the same run's one-thread read figure;
 *   page ops  one page acquire + release (the pool's locked take/put
 *             primitives) against jemalloc mallocx/sdallocx and glibc
 *             malloc/free of the same bytes, single and in batches of 64;
 *   simulate  the default `kvpager simulate` workload run in-process
 *             (sim.h), tokens/s against the bound read bandwidth / bytes of
 *             K+V read per generated token.
 * Every figure is the median of alternating repetitions (measure.h); every
 * ratio is between figures of this run.
 * What issue 8's grid asks and the library does not have yet (f32/bf16
 * storage, kv_heads < heads, threaded attention) is listed as not available,
 * never faked.
 * Order (nothing runs on bad input): parse every argument, validate every
 * value and the memory the grid needs, open the --plot file, then measure.
 * Exit status: 0, 1 when a paged and a contiguous gather disagree, 2 on bad
 * input, an unwritable output or an error (out of memory included).
 * Callers: dispatch.c. Allocations of its own go through alloc.h.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <jemalloc/jemalloc.h>

#include "alloc.h"
#include "attention/gather.h"
#include "attention/kernels.h"
#include "cli.h"
#include "json.h"
#include "measure.h"
#include "pager/cache_internal.h"
#include "pager/pool_internal.h"
#include "plot.h"
#include "progress.h"
#include "sim.h"
#include "workload.h"

/*
 * glibc's own allocator. The program links jemalloc ahead of libc, so plain
 * malloc is jemalloc's; glibc exports its allocator under these names too.
 */
extern void *__libc_malloc(size_t size);
extern void __libc_free(void *ptr);

#define MAX_LIST 16
#define MAX_LEN ((size_t)1 << 22)
#define MAX_BLOCK ((size_t)1 << 20)
#define MAX_REPETITIONS 1001
#define MAX_REQUESTS 100000
#define MIN_READ_BYTES ((size_t)64 << 10)
#define MIN_NS 5e6                 /* each repetition of a case lasts at least 5 ms */
#define READERS 8                  /* independent accumulators of the read loop */
#define ROW_VARIANTS 7             /* distinct random rows cycled through a cache */
#define BATCH 64                   /* pages per batched acquire + release */
#define SIM_REPETITIONS 3

/* The flags that take a value, in --help order. */
#define FLAG_MAP(X)                                                                       \
    X(PLOT, "--plot")                                                                     \
    X(LENS, "--lens")                                                                     \
    X(BLOCKS, "--blocks")                                                                 \
    X(MAX_BYTES, "--max-bytes")                                                           \
    X(READ_BYTES, "--read-bytes")                                                         \
    X(REPETITIONS, "--repetitions")                                                       \
    X(REQUESTS, "--requests")

typedef enum flag {
#define FLAG_ENUM_(name, text) FLAG_##name,
    FLAG_MAP(FLAG_ENUM_)
#undef FLAG_ENUM_
    FLAG_COUNT_
} flag;

static const char *const flag_names[FLAG_COUNT_] = {
#define FLAG_NAME_(name, text) text,
    FLAG_MAP(FLAG_NAME_)
#undef FLAG_NAME_
};

typedef struct size_list {
    size_t value[MAX_LIST];
    size_t count;
} size_list;

typedef struct options {
    const char *value[FLAG_COUNT_];
    const char *plot;
    size_list lens;
    size_list blocks;
    size_list batches;
    size_list heads;
    size_list widths;
    size_t max_bytes;
    size_t read_bytes;
    size_t repetitions;
    size_t requests;
    int quick;
    int json;
    int quiet;
    int help;
} options;

/* The grids (issue 8): the full one, and --quick's, which keeps one DRAM-resident length. */
static const size_list full_lens = {{256, 2048, 8192, 65536}, 4};
static const size_list full_blocks = {{1, 4, 16, 64}, 4};
static const size_list full_batches = {{1, 8}, 2};
static const size_list full_heads = {{8, 32}, 2};
static const size_list full_widths = {{64, 128}, 2};
static const size_list quick_lens = {{256, 2048, 65536}, 3};
static const size_list quick_blocks = {{16, 64}, 2};
static const size_list quick_heads = {{8}, 1};
static const size_list quick_widths = {{64}, 1};

static const char *const not_available[] = {
    "dtype f32 and bf16: pages store f64 only",
    "kv_heads = heads/4: grouped-query attention is not built (kv_heads = heads)",
    "2 threads against 1: attention over one cache runs on one thread",
};
#define NOT_AVAILABLE (sizeof not_available / sizeof not_available[0])

static void bench_usage(FILE *out)
{
    fprintf(out,
            "usage: kvpager bench [options]\n\n"
            "Measures, in one run, on this machine: the read bandwidth of a large array\n"
            "(STREAM-like, 1 and 2 threads); the library's paged gather (scores and values\n"
            "over the retained rows, every lane and head) against the same loops over a\n"
            "contiguous cache, for each block_tokens, over a grid of batch B in {1, 8},\n"
            "heads H in {8, 32}, head width d_h in {64, 128} and length L in {256, 2048,\n"
            "8192, 65536}, with its GB/s and their percentage of the read figure; page\n"
            "acquire + release against jemalloc and glibc; and `kvpager simulate`'s\n"
            "tokens/s against the bound set by the bytes it reads per generated token.\n"
            "Figures are medians of alternating repetitions; ratios are within the run.\n"
            "Storage is f64 with kv_heads = heads on one thread: the f32/bf16, grouped-query\n"
            "and two-thread parts of the grid are listed as not available yet.\n\n"
            "Every value is checked before anything runs: a bad one prints one line naming\n"
            "the option and the value, and exits 2. N is a whole number.\n\n"
            "options:\n"
            "  --quick              a reduced grid (B in {1, 8}, H 8, d_h 64, L in {256, 2048,\n"
            "                       65536}, block_tokens 16 and 64, 5 repetitions, 32\n"
            "                       simulated requests): under a minute, and L = 65536 is\n"
            "                       DRAM-resident (512 MiB of K+V)\n"
            "  --json               print one JSON object instead of the tables\n"
            "  --plot FILE.svg      draw GB/s against L (one line per dtype, the read figure\n"
            "                       dashed); the file is opened before the run, so an\n"
            "                       unwritable path is refused up front (exit 2)\n"
            "  --quiet              no progress line (it shows only on a terminal anyway)\n"
            "  --help, -h           show this help\n"
            "grid overrides (for tests and quick looks):\n"
            "  --lens N,N,...       lengths L, each 1 to %zu (default: the grid's)\n"
            "  --blocks N,N,...     block_tokens, each 1 to %zu (default 1,4,16,64; quick\n"
            "                       16,64)\n"
            "  --max-bytes SIZE     skip shapes whose K+V bytes exceed SIZE; the run holds\n"
            "                       two copies (paged, contiguous) (default 2GiB)\n"
            "  --read-bytes SIZE    the read figure's array, at least 64KiB (default 1GiB)\n"
            "  --repetitions N      repetitions per figure, 1 to %d (default 7; quick 5)\n"
            "  --requests N         simulated requests, 1 to %d (default 128; quick 32)\n\n"
            "exit status: 0 success, 1 a paged gather differs from the contiguous one,\n"
            "2 bad input or an error (out of memory included).\n",
            MAX_LEN, MAX_BLOCK, MAX_REPETITIONS, MAX_REQUESTS);
}

/* ---- command line ------------------------------------------------------------ */

static void invalid(kvp_cli_problems *p, flag f, const char *value, const char *why)
{
    kvp_cli_problem(p, "invalid value for %s: '%s': %s", flag_names[f], value, why);
}

/* "N,N,...": whole numbers from 1 to max, at most MAX_LIST. 0, or -1. */
static int parse_list(const char *text, size_t max, size_list *out)
{
    size_list list = {{0}, 0};
    const char *p = text;
    for (;;) {
        char item[32];
        size_t n = strcspn(p, ",");
        if (n == 0 || n >= sizeof item || list.count == MAX_LIST) {
            return -1;
        }
        memcpy(item, p, n);
        item[n] = '\0';
        size_t value = 0;
        if (kvp_cli_parse_size(item, &value) != 0 || value < 1 || value > max) {
            return -1;
        }
        list.value[list.count++] = value;
        if (p[n] == '\0') {
            break;
        }
        p += n + 1;
    }
    *out = list;
    return 0;
}

static void parse_value(options *o, flag f, const char *value, kvp_cli_problems *p)
{
    char why[128];
    switch (f) {
    case FLAG_PLOT:
        o->plot = value;
        break;
    case FLAG_LENS:
    case FLAG_BLOCKS: {
        size_t max = f == FLAG_LENS ? MAX_LEN : MAX_BLOCK;
        snprintf(why, sizeof why, "not a comma-separated list of up to %d whole numbers from 1 "
                                  "to %zu",
                 MAX_LIST, max);
        if (parse_list(value, max, f == FLAG_LENS ? &o->lens : &o->blocks) != 0) {
            invalid(p, f, value, why);
        }
        break;
    }
    case FLAG_MAX_BYTES:
    case FLAG_READ_BYTES:
        if (kvp_cli_parse_bytes(value, f == FLAG_MAX_BYTES ? &o->max_bytes : &o->read_bytes) !=
            0) {
            invalid(p, f, value,
                    "not a whole byte count (a number with an optional unit B, KiB, MiB, "
                    "GiB, TiB, KB, MB, GB or TB, below 2^64 bytes)");
        }
        break;
    case FLAG_REPETITIONS:
    case FLAG_REQUESTS: {
        size_t *field = f == FLAG_REPETITIONS ? &o->repetitions : &o->requests;
        size_t max = f == FLAG_REPETITIONS ? MAX_REPETITIONS : MAX_REQUESTS;
        snprintf(why, sizeof why, "must be a whole number from 1 to %zu", max);
        if (kvp_cli_parse_size(value, field) != 0 || *field < 1 || *field > max) {
            invalid(p, f, value, why);
        }
        break;
    }
    default:
        break;
    }
}

static void parse_options(int argc, char **argv, options *o, kvp_cli_problems *p)
{
    memset(o, 0, sizeof *o);
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            o->help = 1;
            continue;
        }
        int *toggle = strcmp(arg, "--json") == 0    ? &o->json
                      : strcmp(arg, "--quick") == 0 ? &o->quick
                      : strcmp(arg, "--quiet") == 0 ? &o->quiet
                                                    : NULL;
        if (toggle != NULL) {
            *toggle = 1;
            continue;
        }
        int f = kvp_cli_take_flag(argc, argv, &i, "bench", flag_names, FLAG_COUNT_, o->value,
                                  p);
        if (f >= 0) {
            parse_value(o, (flag)f, o->value[f], p);
        }
    }
}

/* K+V bytes of a B x H x L x d_h f64 cache, or SIZE_MAX on overflow. */
static size_t kv_bytes(size_t batch, size_t heads, size_t width, size_t len)
{
    size_t bytes = 2 * sizeof(double);
    if (kvp_cli_mul(bytes, batch, &bytes) != 0 || kvp_cli_mul(bytes, heads, &bytes) != 0 ||
        kvp_cli_mul(bytes, width, &bytes) != 0 || kvp_cli_mul(bytes, len, &bytes) != 0) {
        return SIZE_MAX;
    }
    return bytes;
}

/* The defaults, then the ranges and the memory the grid needs. */
static void check_options(options *o, kvp_cli_problems *p)
{
    if (o->value[FLAG_LENS] == NULL) {
        o->lens = o->quick ? quick_lens : full_lens;
    }
    if (o->value[FLAG_BLOCKS] == NULL) {
        o->blocks = o->quick ? quick_blocks : full_blocks;
    }
    o->batches = full_batches;
    o->heads = o->quick ? quick_heads : full_heads;
    o->widths = o->quick ? quick_widths : full_widths;
    if (o->value[FLAG_MAX_BYTES] == NULL) {
        o->max_bytes = (size_t)2 << 30;
    }
    if (o->value[FLAG_READ_BYTES] == NULL) {
        o->read_bytes = (size_t)1 << 30;
    }
    if (o->value[FLAG_REPETITIONS] == NULL) {
        o->repetitions = o->quick ? 5 : 7;
    }
    if (o->value[FLAG_REQUESTS] == NULL) {
        o->requests = o->quick ? 32 : 128;
    }
    size_t physical = kvp_cli_physical_memory();
    char shown[32];
    if (o->read_bytes < MIN_READ_BYTES) {
        invalid(p, FLAG_READ_BYTES, o->value[FLAG_READ_BYTES], "must be at least 64KiB");
    } else if (physical > 0 && o->read_bytes > physical / 2) {
        char why[96];
        snprintf(why, sizeof why, "must be at most half of physical memory (%s)",
                 kvp_cli_format_bytes(physical, shown, sizeof shown));
        invalid(p, FLAG_READ_BYTES, o->value[FLAG_READ_BYTES], why);
    }
    /* The smallest shape must fit the cap, and two copies of the largest run must fit memory. */
    size_t smallest = SIZE_MAX;
    size_t largest = 0;
    for (size_t b = 0; b < o->batches.count; b++) {
        for (size_t h = 0; h < o->heads.count; h++) {
            for (size_t w = 0; w < o->widths.count; w++) {
                for (size_t l = 0; l < o->lens.count; l++) {
                    size_t bytes = kv_bytes(o->batches.value[b], o->heads.value[h],
                                            o->widths.value[w], o->lens.value[l]);
                    smallest = bytes < smallest ? bytes : smallest;
                    if (bytes <= o->max_bytes && bytes > largest) {
                        largest = bytes;
                    }
                }
            }
        }
    }
    const char *cap = o->value[FLAG_MAX_BYTES] != NULL ? o->value[FLAG_MAX_BYTES] : "2GiB";
    if (smallest > o->max_bytes) {
        char why[128];
        snprintf(why, sizeof why, "below the grid's smallest shape (%s of K+V): nothing to measure",
                 kvp_cli_format_bytes(smallest, shown, sizeof shown));
        invalid(p, FLAG_MAX_BYTES, cap, why);
    } else if (physical > 0 && largest > physical / 3) {
        char why[160];
        snprintf(why, sizeof why,
                 "the largest shape measured holds %s of K+V twice (paged and contiguous), "
                 "above two thirds of physical memory",
                 kvp_cli_format_bytes(largest, shown, sizeof shown));
        invalid(p, FLAG_MAX_BYTES, cap, why);
    }
}

/* ---- read bandwidth ---------------------------------------------------------- */

typedef struct read_ctx {
    const double *data;
    size_t count;        /* doubles */
    double sink;
    int thread_error;    /* pthread_create's error, 0 if none */
} read_ctx;

typedef struct read_part {
    const double *data;
    size_t count;
    double sum;
} read_part;

/* The sum of data[0..count) with READERS independent accumulators. */
static double read_sum(const double *data, size_t count)
{
    double acc[READERS] = {0};
    size_t i = 0;
    for (; i + READERS <= count; i += READERS) {
        for (size_t r = 0; r < READERS; r++) {
            acc[r] += data[i + r];
        }
    }
    for (; i < count; i++) {
        acc[0] += data[i];
    }
    double sum = 0.0;
    for (size_t r = 0; r < READERS; r++) {
        sum += acc[r];
    }
    return sum;
}

static void *read_thread(void *arg)
{
    read_part *part = arg;
    part->sum = read_sum(part->data, part->count);
    return NULL;
}

static void read_one(void *arg, size_t iterations)
{
    read_ctx *c = arg;
    for (size_t i = 0; i < iterations; i++) {
        c->sink += read_sum(c->data, c->count);
    }
}

/* Two threads: this one sums the first half, a second thread the other. */
static void read_two(void *arg, size_t iterations)
{
    read_ctx *c = arg;
    for (size_t i = 0; i < iterations; i++) {
        size_t half = c->count / 2;
        read_part parts[2] = {{c->data, half, 0.0}, {c->data + half, c->count - half, 0.0}};
        pthread_t other;
        int error = pthread_create(&other, NULL, read_thread, &parts[1]);
        if (error != 0) {
            c->thread_error = error;
            return;
        }
        read_thread(&parts[0]);
        pthread_join(other, NULL);
        c->sink += parts[0].sum + parts[1].sum;
    }
}

typedef struct read_result {
    double gbps;          /* one thread */
    double gbps_two;      /* two threads */
} read_result;

static int measure_read(const options *o, read_result *out)
{
    size_t count = o->read_bytes / sizeof(double);
    double *data = kvp_cli_alloc(count, sizeof *data);
    if (data == NULL) {
        kvp_cli_report_oom("bench", "the read bandwidth array", count * sizeof(double));
        return KVP_CLI_USAGE;
    }
    for (size_t i = 0; i < count; i++) {
        data[i] = (double)(i & 1023) * 0.5;
    }
    read_ctx one = {data, count, 0.0, 0};
    read_ctx two = {data, count, 0.0, 0};
    kvp_measure_case cases[2] = {{read_one, &one}, {read_two, &two}};
    double ns[2];
    int failed = kvp_measure_alternating(cases, 2, o->repetitions, MIN_NS, ns);
    kvp_cli_free(data);
    if (failed != 0) {
        kvp_cli_report_oom("bench", "the timing scratch", 2 * o->repetitions * sizeof(double));
        return KVP_CLI_USAGE;
    }
    if (two.thread_error != 0) {
        fprintf(stderr, "kvpager bench: starting a reader thread: %s\n",
                strerror(two.thread_error));
        return KVP_CLI_USAGE;
    }
    double bytes = (double)(count * sizeof(double));
    out->gbps = bytes / ns[0];
    out->gbps_two = bytes / ns[1];
    return KVP_CLI_OK;
}

/* ---- gather ------------------------------------------------------------------ */

typedef struct shape {
    size_t batch;
    size_t heads;
    size_t width;
    size_t len;
} shape;

typedef struct gather_row {
    shape s;
    size_t block_tokens;
    double paged_ns;
    double contiguous_ns;
    double gbps;
    double percent_of_read;
    int identical;
} gather_row;

typedef struct gather_ctx {
    const kvp_cache *cache;
    shape s;
    const double *queries;    /* [B][H][d_h] */
    const double *candidates; /* [B][H][d_h] */
    double *scores;           /* [B][H][L + 1] */
    double *outputs;          /* [B][H][d_h] */
} gather_ctx;

/* What incremental attention runs for every lane of a step: scores, then values. */
static void gather_all(const gather_ctx *g)
{
    size_t hd = g->s.heads * g->s.width;
    double scale = 1.0 / sqrt((double)g->s.width);
    for (size_t lane = 0; lane < g->s.batch; lane++) {
        double *scores = g->scores + lane * g->s.heads * (g->s.len + 1);
        kvpi_gather_scores(g->cache, g->queries + lane * hd, g->candidates + lane * hd, lane,
                           scale, scores);
        kvpi_gather_values(g->cache, scores, g->candidates + lane * hd, lane,
                           g->outputs + lane * hd);
    }
}

static void gather_run(void *arg, size_t iterations)
{
    for (size_t i = 0; i < iterations; i++) {
        gather_all(arg);
    }
}

/* Buffers shared by every cache of one shape. */
typedef struct gather_space {
    double *rows;          /* [ROW_VARIANTS][2][B][H][d_h]: key then value rows, cycled */
    double *queries;
    double *candidates;
    double *scores[2];     /* paged, contiguous */
    double *outputs[2];
} gather_space;

static void space_free(gather_space *w)
{
    kvp_cli_free(w->rows);
    kvp_cli_free(w->queries);
    kvp_cli_free(w->candidates);
    for (int i = 0; i < 2; i++) {
        kvp_cli_free(w->scores[i]);
        kvp_cli_free(w->outputs[i]);
    }
    memset(w, 0, sizeof *w);
}

static int space_alloc(const shape *s, gather_space *w, uint64_t *rng)
{
    size_t bhd = s->batch * s->heads * s->width;
    size_t nscores = s->batch * s->heads * (s->len + 1);
    memset(w, 0, sizeof *w);
    w->rows = kvp_cli_alloc(ROW_VARIANTS * 2 * bhd, sizeof(double));
    w->queries = kvp_cli_alloc(bhd, sizeof(double));
    w->candidates = kvp_cli_alloc(bhd, sizeof(double));
    for (int i = 0; i < 2; i++) {
        w->scores[i] = kvp_cli_alloc(nscores, sizeof(double));
        w->outputs[i] = kvp_cli_alloc(bhd, sizeof(double));
    }
    if (w->rows == NULL || w->queries == NULL || w->candidates == NULL || w->scores[0] == NULL ||
        w->scores[1] == NULL || w->outputs[0] == NULL || w->outputs[1] == NULL) {
        space_free(w);
        kvp_cli_report_oom("bench", "the gather buffers", (ROW_VARIANTS * 2 + 4) * bhd * 8 +
                                                              2 * nscores * 8);
        return -1;
    }
    for (size_t i = 0; i < ROW_VARIANTS * 2 * bhd; i++) {
        w->rows[i] = kvp_measure_unit(rng);
    }
    for (size_t i = 0; i < bhd; i++) {
        w->queries[i] = kvp_measure_unit(rng) * 0.1;
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

/* A pool of `block` positions per page holding B lanes of L rows; pages shuffled when paged. */
static int build_cache(const shape *s, size_t block, const gather_space *w, uint64_t *rng,
                       built *out)
{
    kvp_error err;
    const char *context = "creating a pool";
    size_t pages_per_lane = (s->len + block - 1) / block;
    size_t page_bytes = 2 * s->heads * block * s->width * sizeof(double);
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = block;
    config.heads = s->heads;
    config.head_width = s->width;
    config.budget_bytes = (s->batch * pages_per_lane + 8) * page_bytes;
    config.dtype = KVP_F64;
    kvp_binding binding;
    memset(&binding, 0, sizeof binding);
    binding.model_width = s->heads * s->width;
    binding.heads = s->heads;
    binding.kv_heads = s->heads;
    binding.head_width = s->width;
    binding.rope_feature_width = s->width;
    binding.rope_max_positions = s->len;
    memset(out, 0, sizeof *out);
    kvp_status status = kvp_pool_create(&config, &out->pool, &err);
    if (status == KVP_OK && block < s->len && kvp_measure_shuffle_pool(out->pool, rng) != 0) {
        size_t ids = out->pool->total_pages * sizeof(uint32_t);
        built_destroy(out);
        kvp_cli_report_oom("bench", "shuffling the free list", ids);
        return -1;
    }
    if (status == KVP_OK) {
        context = "creating a cache";
        status = kvp_cache_create(out->pool, &binding, s->batch, s->len, &out->cache, &err);
    }
    size_t bhd = s->batch * s->heads * s->width;
    for (size_t p = 0; status == KVP_OK && p < s->len; p++) {
        const double *key = w->rows + (p % ROW_VARIANTS) * 2 * bhd;
        kvp_tensor k = kvp_tensor4(key, s->batch, s->heads, 1, s->width);
        kvp_tensor v = kvp_tensor4(key + bhd, s->batch, s->heads, 1, s->width);
        context = "appending rows";
        status = kvpi_cache_append(out->cache, &k, &v, &err);
    }
    if (status != KVP_OK) {
        kvp_cli_report("bench", context, &err);
        built_destroy(out);
        return -1;
    }
    return 0;
}

typedef struct skipped {
    shape s;
    size_t bytes;
} skipped;

typedef struct results {
    read_result read;
    gather_row *rows;
    size_t row_count;
    skipped *skips;
    size_t skip_count;
    double page_ns[6];     /* kvpager, jemalloc, glibc; then per batch of 64, the same order */
    size_t page_bytes;
    double sim_tokens_per_second;
    double sim_bound;
    double sim_bytes_per_token;
    size_t sim_threads;
    size_t sim_requests;
} results;

/* One shape: the contiguous cache once, then a paged one per block_tokens. */
static int measure_shape(const options *o, const shape *s, results *r, kvp_progress *progress,
                         size_t *done, size_t total)
{
    uint64_t rng = 20240601u + s->len * 31u + s->batch * 7u + s->heads * 3u + s->width;
    gather_space w;
    if (space_alloc(s, &w, &rng) != 0) {
        return KVP_CLI_USAGE;
    }
    built contiguous;
    if (build_cache(s, s->len, &w, &rng, &contiguous) != 0) {
        space_free(&w);
        return KVP_CLI_USAGE;
    }
    double bytes = (double)kv_bytes(s->batch, s->heads, s->width, s->len);
    size_t nscores = s->batch * s->heads * (s->len + 1);
    size_t bhd = s->batch * s->heads * s->width;
    int status = KVP_CLI_OK;
    for (size_t b = 0; b < o->blocks.count && status == KVP_CLI_OK; b++) {
        size_t block = o->blocks.value[b] < s->len ? o->blocks.value[b] : s->len;
        built paged;
        if (build_cache(s, block, &w, &rng, &paged) != 0) {
            status = KVP_CLI_USAGE;
            break;
        }
        gather_ctx ctx[2] = {
            {paged.cache, *s, w.queries, w.candidates, w.scores[0], w.outputs[0]},
            {contiguous.cache, *s, w.queries, w.candidates, w.scores[1], w.outputs[1]},
        };
        gather_all(&ctx[0]);
        gather_all(&ctx[1]);
        gather_row *row = &r->rows[r->row_count];
        row->s = *s;
        row->block_tokens = block;
        row->identical =
            memcmp(w.scores[0], w.scores[1], nscores * sizeof(double)) == 0 &&
            memcmp(w.outputs[0], w.outputs[1], bhd * sizeof(double)) == 0;
        kvp_measure_case cases[2] = {{gather_run, &ctx[0]}, {gather_run, &ctx[1]}};
        double ns[2];
        if (kvp_measure_alternating(cases, 2, o->repetitions, MIN_NS, ns) != 0) {
            kvp_cli_report_oom("bench", "the timing scratch", 2 * o->repetitions * 8);
            status = KVP_CLI_USAGE;
        } else {
            row->paged_ns = ns[0];
            row->contiguous_ns = ns[1];
            row->gbps = bytes / ns[0];
            row->percent_of_read = 100.0 * row->gbps / r->read.gbps;
            r->row_count++;
        }
        if (built_destroy(&paged) != 0 && status == KVP_CLI_OK) {
            fprintf(stderr, "kvpager bench: destroying a paged cache's pool failed\n");
            status = KVP_CLI_USAGE;
        }
        *done += 1;
        kvp_progress_note(progress, *done, total, "measurements");
    }
    if (built_destroy(&contiguous) != 0 && status == KVP_CLI_OK) {
        fprintf(stderr, "kvpager bench: destroying the contiguous cache's pool failed\n");
        status = KVP_CLI_USAGE;
    }
    space_free(&w);
    return status;
}

/* ---- page operations -------------------------------------------------------- */

typedef struct page_ctx {
    kvp_pool *pool;
    size_t bytes;
    void *volatile sink;   /* keeps the compiler from pairing away malloc and free */
    int failed;
    void *held[BATCH];
    uint32_t ids[BATCH];
} page_ctx;

/*
 * One page acquire + release through the pool's own primitives: the public
 * API hands out pages only inside caches and sequences (with tables and
 * promises around them), so this uses the internal locked take and put
 * (src/pager/pool_internal.h), as every cache append and release does.
 */
static void pool_single(void *arg, size_t iterations)
{
    page_ctx *c = arg;
    for (size_t i = 0; i < iterations; i++) {
        uint32_t id;
        kvpi_pool_lock(c->pool);
        if (kvpi_pool_take_locked(c->pool, 1, &id, NULL) == KVP_OK) {
            kvpi_pool_put_locked(c->pool, id);
        } else {
            c->failed = 1;
        }
        kvpi_pool_unlock(c->pool);
    }
}

static void pool_batch(void *arg, size_t iterations)
{
    page_ctx *c = arg;
    for (size_t i = 0; i < iterations; i++) {
        kvpi_pool_lock(c->pool);
        if (kvpi_pool_take_locked(c->pool, BATCH, c->ids, NULL) == KVP_OK) {
            for (size_t p = 0; p < BATCH; p++) {
                kvpi_pool_put_locked(c->pool, c->ids[p]);
            }
        } else {
            c->failed = 1;
        }
        kvpi_pool_unlock(c->pool);
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

/*
 * Pages of the simulated model's geometry (kvp_sim_config_init: 16 positions
 * of width 64, 16 KiB), the pages the simulate figure below moves.
 */
static int measure_pages(const options *o, results *r)
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
    page_ctx *ctx = kvp_cli_calloc(6, sizeof *ctx);
    if (ctx == NULL) {
        kvp_status ignored = kvp_pool_destroy(pool, NULL); /* holds no page: cannot fail */
        (void)ignored;
        kvp_cli_report_oom("bench", "the page contexts", 6 * sizeof *ctx);
        return KVP_CLI_USAGE;
    }
    static const kvp_measure_fn fns[6] = {pool_single, jemalloc_single, glibc_single,
                                          pool_batch,  jemalloc_batch,  glibc_batch};
    kvp_measure_case cases[6];
    for (size_t i = 0; i < 6; i++) {
        ctx[i].pool = pool;
        ctx[i].bytes = page_bytes;
        cases[i].run = fns[i];
        cases[i].ctx = &ctx[i];
    }
    int failed = kvp_measure_alternating(cases, 6, o->repetitions, MIN_NS, r->page_ns);
    int op_failed = 0;
    for (size_t i = 0; i < 6; i++) {
        op_failed |= ctx[i].failed;
    }
    kvp_cli_free(ctx);
    kvp_status destroyed = kvp_pool_destroy(pool, &err);
    if (failed != 0 || op_failed) {
        kvp_cli_report_oom("bench", "a page", page_bytes);
        return KVP_CLI_USAGE;
    }
    if (destroyed != KVP_OK) {
        kvp_cli_report("bench", "destroying the page pool", &err);
        return KVP_CLI_USAGE;
    }
    r->page_bytes = page_bytes;
    return KVP_CLI_OK;
}

/* ---- simulate ---------------------------------------------------------------- */

/*
 * K+V bytes a run must read per generated token: each prompt row attends to
 * the rows before it, each generated token to every retained row (prompt and
 * tokens generated so far), in every layer; 2 x D doubles per row and layer.
 * Recomputation after a preemption reads more, so the bound this gives is an
 * upper bound.
 */
static double bytes_per_token(const kvp_sim_config *c, const kvp_workload *w)
{
    double rows = 0.0;
    double generated = 0.0;
    for (size_t i = 0; i < w->count; i++) {
        double prompt = (double)w->requests[i].prompt_tokens;
        double output = (double)w->requests[i].output_tokens;
        rows += prompt * (prompt - 1.0) / 2.0 + output * prompt + output * (output - 1.0) / 2.0;
        generated += output;
    }
    double row_bytes = 2.0 * (double)c->model_width * (double)sizeof(double) * (double)c->layers;
    return generated > 0.0 ? rows * row_bytes / generated : 0.0;
}

static int measure_simulate(const options *o, results *r)
{
    kvp_sim_config config;
    kvp_sim_config_init(&config);
    config.audit_every = 0;
    kvp_workload_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.profile = KVP_PROFILE_SHAREGPT;
    spec.arrival = KVP_ARRIVAL_POISSON;
    spec.rate = 1.0;
    spec.requests = o->requests;
    spec.capacity = config.capacity;
    spec.seed = config.seed;
    kvp_workload_spec_defaults(&spec);
    kvp_workload workload = {NULL, 0};
    if (kvp_workload_generate(&spec, &workload) != 0) {
        kvp_cli_report_oom("bench", "the request list", o->requests * sizeof(kvp_request));
        return KVP_CLI_USAGE;
    }
    double rates[SIM_REPETITIONS];
    size_t runs = o->repetitions < SIM_REPETITIONS ? o->repetitions : SIM_REPETITIONS;
    for (size_t i = 0; i < runs; i++) {
        kvp_sim_result result;
        kvp_error err;
        const char *context = NULL;
        if (kvp_sim_run(&config, &workload, NULL, NULL, &result, &err, &context) != 0) {
            kvp_cli_report("bench", context != NULL ? context : "simulating", &err);
            kvp_sim_result_free(&result);
            kvp_workload_free(&workload);
            return KVP_CLI_USAGE;
        }
        rates[i] = result.tokens_per_second;
        r->sim_threads = result.threads;
        kvp_sim_result_free(&result);
    }
    r->sim_tokens_per_second = kvp_measure_median(rates, runs);
    r->sim_bytes_per_token = bytes_per_token(&config, &workload);
    r->sim_requests = workload.count;
    double read = r->sim_threads >= 2 ? r->read.gbps_two : r->read.gbps;
    r->sim_bound = r->sim_bytes_per_token > 0.0 ? read * 1e9 / r->sim_bytes_per_token : 0.0;
    kvp_workload_free(&workload);
    return KVP_CLI_OK;
}

/* ---- output ------------------------------------------------------------------ */

static const char *isa_name(void)
{
    return kvpi_kernels_active()->name;
}

static void print_tables(const options *o, const results *r)
{
    char buf[32];
    printf("kvpager bench: f64 storage, kv_heads = heads, attention on 1 thread; kernels %s;\n"
           "medians of %zu alternating repetitions%s\n\n",
           isa_name(), o->repetitions, o->quick ? " (--quick grid)" : "");
    printf("read bandwidth (%s array, %d accumulators)   %.2f GB/s on 1 thread, %.2f GB/s on "
           "2 threads\n\n",
           kvp_cli_format_bytes(o->read_bytes, buf, sizeof buf), READERS, r->read.gbps,
           r->read.gbps_two);
    printf("gather: scores + values over every lane's retained rows, the loops\n"
           "kvp_attention_prepare runs; paged (pages shuffled) against one page per lane\n"
           "(contiguous); ratio = contiguous / paged time; GB/s = K+V bytes / paged time\n\n");
    printf("dtype  block   B   H  kv_H  d_h    len     K+V      paged ns  contig ns  ratio"
           "    GB/s  %% read\n");
    for (size_t i = 0; i < r->row_count; i++) {
        const gather_row *g = &r->rows[i];
        printf("f64   %6zu  %2zu  %2zu  %4zu  %3zu  %5zu  %9s  %11.0f  %9.0f  %5.3f  %6.2f  "
               "%6.1f%s\n",
               g->block_tokens, g->s.batch, g->s.heads, g->s.heads, g->s.width, g->s.len,
               kvp_cli_format_bytes(kv_bytes(g->s.batch, g->s.heads, g->s.width, g->s.len), buf,
                                    sizeof buf),
               g->paged_ns, g->contiguous_ns, g->contiguous_ns / g->paged_ns, g->gbps,
               g->percent_of_read, g->identical ? "" : "  RESULTS DIFFER");
    }
    if (r->skip_count > 0) {
        printf("\nskipped, K+V above the %s cap (--max-bytes):",
               kvp_cli_format_bytes(o->max_bytes, buf, sizeof buf));
        for (size_t i = 0; i < r->skip_count; i++) {
            const skipped *s = &r->skips[i];
            printf("%s B=%zu H=%zu d_h=%zu L=%zu (%s)", i % 3 == 0 ? "\n " : ",", s->s.batch,
                   s->s.heads, s->s.width, s->s.len,
                   kvp_cli_format_bytes(s->bytes, buf, sizeof buf));
        }
        printf("\n");
    }
    const double *p = r->page_ns;
    printf("\npage acquire + release (%s pages)   kvpager  jemalloc     glibc\n",
           kvp_cli_format_bytes(r->page_bytes, buf, sizeof buf));
    printf("  one page, ns                      %8.1f  %8.1f  %8.1f\n", p[0], p[1], p[2]);
    printf("  a batch of 64, ns                 %8.1f  %8.1f  %8.1f\n", p[3], p[4], p[5]);
    printf("  peer time / kvpager time: one page %.2fx jemalloc, %.2fx glibc; batch of 64\n"
           "  %.2fx jemalloc, %.2fx glibc\n",
           p[1] / p[0], p[2] / p[0], p[4] / p[3], p[5] / p[3]);
    printf("\nsimulate (default model, sharegpt, %zu requests, %zu thread%s, median of %zu runs)\n"
           "  %.0f tokens/s; bound %.0f tokens/s (%.2f GB/s read / %.1f KiB of K+V per\n"
           "  generated token): %.1f%% of the bound\n",
           r->sim_requests, r->sim_threads, r->sim_threads == 1 ? "" : "s",
           o->repetitions < SIM_REPETITIONS ? o->repetitions : (size_t)SIM_REPETITIONS,
           r->sim_tokens_per_second, r->sim_bound,
           r->sim_threads >= 2 ? r->read.gbps_two : r->read.gbps, r->sim_bytes_per_token / 1024.0,
           100.0 * r->sim_tokens_per_second / r->sim_bound);
    printf("\nnot available yet:\n");
    for (size_t i = 0; i < NOT_AVAILABLE; i++) {
        printf("  %s\n", not_available[i]);
    }
}

static void print_json(const options *o, const results *r)
{
    kvp_json json;
    kvp_json_init(&json, stdout);
    kvp_json_object_begin(&json, NULL);
    kvp_json_string(&json, "isa", isa_name());
    kvp_json_uint(&json, "repetitions", o->repetitions);
    kvp_json_uint(&json, "read_bytes", o->read_bytes);
    kvp_json_double(&json, "read_gbps", r->read.gbps);
    kvp_json_double(&json, "read_gbps_2_threads", r->read.gbps_two);
    kvp_json_uint(&json, "max_bytes", o->max_bytes);
    kvp_json_array_begin(&json, "gather");
    for (size_t i = 0; i < r->row_count; i++) {
        const gather_row *g = &r->rows[i];
        kvp_json_object_begin(&json, NULL);
        kvp_json_string(&json, "dtype", "f64");
        kvp_json_uint(&json, "block_tokens", g->block_tokens);
        kvp_json_uint(&json, "batch", g->s.batch);
        kvp_json_uint(&json, "heads", g->s.heads);
        kvp_json_uint(&json, "kv_heads", g->s.heads);
        kvp_json_uint(&json, "head_width", g->s.width);
        kvp_json_uint(&json, "len", g->s.len);
        kvp_json_uint(&json, "threads", 1);
        kvp_json_uint(&json, "kv_bytes", kv_bytes(g->s.batch, g->s.heads, g->s.width, g->s.len));
        kvp_json_double(&json, "paged_ns", g->paged_ns);
        kvp_json_double(&json, "contiguous_ns", g->contiguous_ns);
        kvp_json_double(&json, "gbps", g->gbps);
        kvp_json_double(&json, "percent_of_read", g->percent_of_read);
        kvp_json_bool(&json, "identical", g->identical);
        kvp_json_object_end(&json);
    }
    kvp_json_array_end(&json);
    kvp_json_array_begin(&json, "skipped");
    for (size_t i = 0; i < r->skip_count; i++) {
        const skipped *s = &r->skips[i];
        kvp_json_object_begin(&json, NULL);
        kvp_json_uint(&json, "batch", s->s.batch);
        kvp_json_uint(&json, "heads", s->s.heads);
        kvp_json_uint(&json, "head_width", s->s.width);
        kvp_json_uint(&json, "len", s->s.len);
        kvp_json_uint(&json, "kv_bytes", s->bytes);
        kvp_json_object_end(&json);
    }
    kvp_json_array_end(&json);
    kvp_json_object_begin(&json, "page_ops");
    kvp_json_uint(&json, "page_bytes", r->page_bytes);
    kvp_json_double(&json, "kvpager_ns", r->page_ns[0]);
    kvp_json_double(&json, "jemalloc_ns", r->page_ns[1]);
    kvp_json_double(&json, "glibc_ns", r->page_ns[2]);
    kvp_json_double(&json, "batch64_kvpager_ns", r->page_ns[3]);
    kvp_json_double(&json, "batch64_jemalloc_ns", r->page_ns[4]);
    kvp_json_double(&json, "batch64_glibc_ns", r->page_ns[5]);
    kvp_json_object_end(&json);
    kvp_json_object_begin(&json, "simulate");
    kvp_json_uint(&json, "requests", r->sim_requests);
    kvp_json_uint(&json, "threads", r->sim_threads);
    kvp_json_double(&json, "tokens_per_second", r->sim_tokens_per_second);
    kvp_json_double(&json, "bytes_per_token", r->sim_bytes_per_token);
    kvp_json_double(&json, "bound_tokens_per_second", r->sim_bound);
    kvp_json_object_end(&json);
    kvp_json_array_begin(&json, "not_available");
    for (size_t i = 0; i < NOT_AVAILABLE; i++) {
        kvp_json_string(&json, NULL, not_available[i]);
    }
    kvp_json_array_end(&json);
    kvp_json_object_end(&json);
    fputc('\n', stdout);
}

/* The plot's block_tokens: 16 when measured, else the largest measured. */
static size_t plot_block(const results *r)
{
    size_t best = 0;
    for (size_t i = 0; i < r->row_count; i++) {
        size_t b = r->rows[i].block_tokens;
        if (b == 16) {
            return 16;
        }
        best = b > best ? b : best;
    }
    return best;
}

#define PW 960.0
#define PH 480.0
#define PL 80.0
#define PR 40.0
#define PT 50.0
#define PB 70.0

/*
 * GB/s against L (log scale, one tick per measured length): for each dtype
 * present, the median GB/s over the shapes at the plotted block_tokens; the
 * one-thread read figure dashed.
 */
static int write_plot(const options *o, const results *r, kvp_plot *plot)
{
    FILE *out = plot->out;
    size_t block = plot_block(r);
    double lens[MAX_LIST];
    double gbps[MAX_LIST];
    size_t points = 0;
    double values[64];
    for (size_t l = 0; l < o->lens.count; l++) {
        size_t n = 0;
        for (size_t i = 0; i < r->row_count && n < 64; i++) {
            if (r->rows[i].s.len == o->lens.value[l] && r->rows[i].block_tokens == block) {
                values[n++] = r->rows[i].gbps;
            }
        }
        if (n > 0) {
            lens[points] = (double)o->lens.value[l];
            gbps[points] = kvp_measure_median(values, n);
            points++;
        }
    }
    double top = r->read.gbps;
    for (size_t i = 0; i < points; i++) {
        top = gbps[i] > top ? gbps[i] : top;
    }
    double step = kvp_plot_tick_step(top);
    top = ceil(top / step) * step;
    double lo = log2(lens[0]);
    double hi = log2(lens[0]);
    for (size_t i = 0; i < points; i++) {
        lo = log2(lens[i]) < lo ? log2(lens[i]) : lo;
        hi = log2(lens[i]) > hi ? log2(lens[i]) : hi;
    }
    if (hi - lo < 1.0) {
        lo -= 0.5;
        hi += 0.5;
    }
    double w = PW - PL - PR;
    double h = PH - PT - PB;
#define X_OF(len) (PL + (log2(len) - lo) / (hi - lo) * w)
#define Y_OF(v) (PT + h - (v) / top * h)
    fprintf(out,
            "<text x=\"%.1f\" y=\"28\" font-size=\"16\" text-anchor=\"middle\">kvpager bench: "
            "paged gather GB/s against L (block_tokens %zu, median over shapes)</text>\n",
            PW / 2.0, block);
    for (double v = 0.0; v <= top + 0.5 * step; v += step) {
        fprintf(out,
                "<text class=\"tick-left\" x=\"%.1f\" y=\"%.1f\" font-size=\"12\" "
                "text-anchor=\"end\">%g</text>\n<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" "
                "y2=\"%.1f\" stroke=\"#ddd\"/>\n",
                PL - 8.0, Y_OF(v) + 4.0, v, PL, Y_OF(v), PW - PR, Y_OF(v));
    }
    for (size_t i = 0; i < points; i++) {
        fprintf(out,
                "<text class=\"tick-x\" x=\"%.1f\" y=\"%.1f\" font-size=\"12\" "
                "text-anchor=\"middle\">%.0f</text>\n",
                X_OF(lens[i]), PT + h + 20.0, lens[i]);
    }
    fprintf(out,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
            "stroke=\"#333\"/>\n<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
            "stroke=\"#d62728\" stroke-dasharray=\"6 4\"/>\n<text x=\"%.1f\" y=\"%.1f\" "
            "font-size=\"12\" fill=\"#d62728\" text-anchor=\"end\">read bandwidth, 1 thread "
            "(%.2f GB/s)</text>\n",
            PL, PT, w, h, PL, Y_OF(r->read.gbps), PW - PR, Y_OF(r->read.gbps), PW - PR - 4.0,
            Y_OF(r->read.gbps) - 6.0, r->read.gbps);
    fprintf(out, "<polyline class=\"dtype-f64\" fill=\"none\" stroke=\"#1f77b4\" "
                 "stroke-width=\"2\" points=\"");
    for (size_t i = 0; i < points; i++) {
        fprintf(out, "%.1f,%.1f ", X_OF(lens[i]), Y_OF(gbps[i]));
    }
    fprintf(out, "\"/>\n<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" fill=\"#1f77b4\">f64"
                 "</text>\n",
            PL + 8.0, PT + 16.0);
    fprintf(out,
            "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\">retained "
            "positions L (log scale)</text>\n<text x=\"18\" y=\"%.1f\" font-size=\"13\" "
            "transform=\"rotate(-90 18 %.1f)\" text-anchor=\"middle\">GB/s (K+V bytes / paged "
            "time)</text>\n",
            PL + w / 2.0, PH - 18.0, PT + h / 2.0, PT + h / 2.0);
#undef X_OF
#undef Y_OF
    return kvp_plot_close(plot);
}

/* ---- the command -------------------------------------------------------------- */

static int prepare(int argc, char **argv, options *o)
{
    kvp_cli_problems p = {.found = 0};
    parse_options(argc, argv, o, &p);
    if (o->help) {
        bench_usage(stdout);
        return -1;
    }
    if (!p.found) {
        check_options(o, &p);
    }
    if (p.found) {
        fprintf(stderr, "kvpager bench: %s\n", p.line);
        return KVP_CLI_USAGE;
    }
    return KVP_CLI_OK;
}

/* Fills r->rows and r->skips from the grid; the caller frees both. */
static int plan(const options *o, results *r, size_t *shapes)
{
    size_t cells = o->batches.count * o->heads.count * o->widths.count * o->lens.count;
    r->rows = kvp_cli_alloc(cells * o->blocks.count, sizeof *r->rows);
    r->skips = kvp_cli_alloc(cells, sizeof *r->skips);
    if (r->rows == NULL || r->skips == NULL) {
        kvp_cli_report_oom("bench", "the result table", cells * o->blocks.count * sizeof *r->rows);
        return -1;
    }
    *shapes = 0;
    for (size_t b = 0; b < o->batches.count; b++) {
        for (size_t h = 0; h < o->heads.count; h++) {
            for (size_t w = 0; w < o->widths.count; w++) {
                for (size_t l = 0; l < o->lens.count; l++) {
                    shape s = {o->batches.value[b], o->heads.value[h], o->widths.value[w],
                               o->lens.value[l]};
                    size_t bytes = kv_bytes(s.batch, s.heads, s.width, s.len);
                    if (bytes > o->max_bytes) {
                        r->skips[r->skip_count].s = s;
                        r->skips[r->skip_count++].bytes = bytes;
                    } else {
                        *shapes += 1;
                    }
                }
            }
        }
    }
    return 0;
}

static int run(const options *o, results *r, kvp_progress *progress)
{
    size_t shapes = 0;
    if (plan(o, r, &shapes) != 0) {
        return KVP_CLI_USAGE;
    }
    size_t total = shapes * o->blocks.count + 3;
    size_t done = 0;
    kvp_progress_note(progress, done, total, "measurements");
    int status = measure_read(o, &r->read);
    kvp_progress_note(progress, ++done, total, "measurements");
    for (size_t b = 0; b < o->batches.count && status == KVP_CLI_OK; b++) {
        for (size_t h = 0; h < o->heads.count && status == KVP_CLI_OK; h++) {
            for (size_t w = 0; w < o->widths.count && status == KVP_CLI_OK; w++) {
                for (size_t l = 0; l < o->lens.count && status == KVP_CLI_OK; l++) {
                    shape s = {o->batches.value[b], o->heads.value[h], o->widths.value[w],
                               o->lens.value[l]};
                    if (kv_bytes(s.batch, s.heads, s.width, s.len) <= o->max_bytes) {
                        status = measure_shape(o, &s, r, progress, &done, total);
                    }
                }
            }
        }
    }
    if (status == KVP_CLI_OK) {
        status = measure_pages(o, r);
        kvp_progress_note(progress, ++done, total, "measurements");
    }
    if (status == KVP_CLI_OK) {
        status = measure_simulate(o, r);
        kvp_progress_note(progress, ++done, total, "measurements");
    }
    return status;
}

int kvp_cli_bench(int argc, char **argv)
{
    options o;
    int status = prepare(argc, argv, &o);
    if (status != KVP_CLI_OK) {
        return status < 0 ? KVP_CLI_OK : status;
    }
    kvp_plot plot = {NULL, NULL, 0, NULL};
    if (o.plot != NULL) {
        int error = kvp_plot_open(&plot, o.plot);
        if (error != 0) {
            if (error < 0) {
                kvp_cli_report_oom("bench", "the plot's buffer", 8192);
            } else {
                fprintf(stderr, "kvpager bench: --plot %s: %s\n", o.plot, strerror(error));
            }
            return KVP_CLI_USAGE;
        }
    }
    results r;
    memset(&r, 0, sizeof r);
    kvp_progress progress;
    kvp_progress_init(&progress, "bench", o.quiet);
    status = run(&o, &r, &progress);
    kvp_progress_finish(&progress);
    if (status == KVP_CLI_OK) {
        if (o.json) {
            print_json(&o, &r);
        } else {
            print_tables(&o, &r);
        }
        for (size_t i = 0; i < r.row_count; i++) {
            status = r.rows[i].identical ? status : KVP_CLI_FAILED;
        }
    }
    if (o.plot != NULL) {
        if (status == KVP_CLI_USAGE) {
            kvp_plot_abandon(&plot);
        } else {
            int error = write_plot(&o, &r, &plot);
            if (error != 0) {
                fprintf(stderr, "kvpager bench: --plot %s: %s\n", o.plot, strerror(error));
                status = KVP_CLI_USAGE;
            } else if (!o.json) {
                printf("\nplot: %s\n", o.plot);
            }
        }
    }
    kvp_cli_free(r.rows);
    kvp_cli_free(r.skips);
    return status;
}
