/*
 * bench.c: `kvpager bench`, the numbers of issue 8 side by side, in one run.
 *
 * Owns: the command line, the grid, and the measurements:
 *   read      a STREAM-like read bandwidth figure: the sum of a large array
 *             (1 GiB by default) with eight independent accumulators, on one
 *             thread and on two (each summing half);
 *   gather    the library's own attention loops (kvpi_gather_attend_on:
 *             scores, softmax and values, what kvp_attention_prepare runs
 *             over the retained rows) for every lane and query head of a
 *             cache of B lanes x L retained rows, paged (pages shuffled over
 *             the slab) against the same loops over one page per lane
 *             holding all L positions (contiguous: one table lookup,
 *             [H_kv,L,d_h] memory), each on one thread and as the one job
 *             of a 2-thread decoder step (the second thread assists,
 *             src/serve/decoder.c). All four results must be bit for bit
 *             equal (exit 1 otherwise). GB/s = K+V bytes as stored / paged
 *             time; its percentage is of the same run's one-thread read
 *             figure;
 *   page ops  one page acquire + release (the pool's locked take/put
 *             primitives) against jemalloc mallocx/sdallocx and glibc
 *             malloc/free of the same bytes, single and in batches of 64;
 *   simulate  the default `kvpager simulate` workload run in-process
 *             (sim.h), tokens/s against the bound read bandwidth / bytes of
 *             K+V read per generated token.
 * Every figure is the median of alternating repetitions (measure.h); every
 * ratio is between figures of this run.
 * Anything issue 8's grid asks and the library does not have would be
 * listed as not available, never faked (today the list is empty).
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
#include "serve/decoder_internal.h"
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
    X(DTYPES, "--dtypes")                                                                 \
    X(GROUPS, "--groups")                                                                 \
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
    size_list dtypes;     /* kvp_dtype values */
    size_list groups;     /* query heads per KV head: kv_heads = heads / group */
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
static const size_list all_dtypes = {{KVP_F64, KVP_F32, KVP_BF16}, 3};
static const size_list full_groups = {{1, 4}, 2};
static const size_list quick_lens = {{256, 2048, 65536}, 3};
static const size_list quick_blocks = {{16}, 1};
static const size_list quick_heads = {{8}, 1};
static const size_list quick_widths = {{64}, 1};


static void bench_usage(FILE *out)
{
    fprintf(out,
            "usage: kvpager bench [options]\n\n"
            "Measures, in one run, on this machine: the read bandwidth of a large array\n"
            "(STREAM-like, 1 and 2 threads); the library's paged gather (scores and values\n"
            "over the retained rows, every lane and query head) against the same loops over\n"
            "a contiguous cache, for each block_tokens, over a grid of storage dtype in\n"
            "{f64, f32, bf16}, batch B in {1, 8}, heads H in {8, 32}, KV heads in {H, H/4},\n"
            "head width d_h in {64, 128} and length L in {256, 2048, 8192, 65536}, with its\n"
            "GB/s (bytes of K+V as stored) and their percentage of the read figure; page\n"
            "acquire + release against jemalloc and glibc; and `kvpager simulate`'s\n"
            "tokens/s against the bound set by the bytes it reads per generated token.\n"
            "Each gather runs on 1 thread and as one job of a 2-thread decoder (the second\n"
            "thread assists it; the results are bit-identical), and the run reports the\n"
            "speedup. Figures are medians of alternating repetitions; ratios are within\n"
            "the run.\n\n"
            "Every value is checked before anything runs: a bad one prints one line naming\n"
            "the option and the value, and exits 2. N is a whole number.\n\n"
            "options:\n"
            "  --quick              a reduced grid (every dtype, KV heads H and H/4, B in\n"
            "                       {1, 8}, H 8, d_h 64, L in {256, 2048, 65536},\n"
            "                       block_tokens 16, 5 repetitions, 32 simulated requests):\n"
            "                       about a minute, and L = 65536 is DRAM-resident (512 MiB\n"
            "                       of f64 K+V)\n"
            "  --json               print one JSON object instead of the tables\n"
            "  --plot FILE.svg      draw GB/s against L (one line per dtype, the read figure\n"
            "                       dashed); the file is opened before the run, so an\n"
            "                       unwritable path is refused up front (exit 2)\n"
            "  --quiet              no progress line (it shows only on a terminal anyway)\n"
            "  --help, -h           show this help\n"
            "grid overrides (for tests and quick looks):\n"
            "  --lens N,N,...       lengths L, each 1 to %zu (default: the grid's)\n"
            "  --blocks N,N,...     block_tokens, each 1 to %zu (default 1,4,16,64; quick\n"
            "                       16)\n"
            "  --dtypes D,D,...     storage dtypes, each f64, f32, bf16, f16 or fp8_e4m3\n"
            "                       (default f64, f32, bf16)\n"
            "  --groups N,N,...     query heads per KV head (kv_heads = H / N), each 1, 2, 4\n"
            "                       or 8, dividing every H of the grid (default 1,4)\n"
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

/* "f64,f32,...": distinct storage dtype names, at most MAX_LIST. 0, or -1. */
static int parse_dtypes(const char *text, size_list *out)
{
    static const kvp_dtype known[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16, KVP_FP8_E4M3};
    size_list list = {{0}, 0};
    const char *p = text;
    for (;;) {
        size_t n = strcspn(p, ",");
        int found = -1;
        for (size_t k = 0; k < sizeof known / sizeof known[0]; k++) {
            const char *name = kvp_dtype_name(known[k]);
            if (strlen(name) == n && strncmp(p, name, n) == 0) {
                found = (int)k;
            }
        }
        for (size_t i = 0; found >= 0 && i < list.count; i++) {
            found = list.value[i] == (size_t)known[found] ? -1 : found;
        }
        if (found < 0 || list.count == MAX_LIST) {
            return -1;
        }
        list.value[list.count++] = (size_t)known[found];
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
    case FLAG_DTYPES:
        if (parse_dtypes(value, &o->dtypes) != 0) {
            invalid(p, f, value,
                    "not a comma-separated list of distinct dtypes f64, f32, bf16, f16, fp8_e4m3");
        }
        break;
    case FLAG_GROUPS: {
        int bad = parse_list(value, 8, &o->groups) != 0;
        for (size_t i = 0; !bad && i < o->groups.count; i++) {
            size_t g = o->groups.value[i];
            bad = (g & (g - 1)) != 0;
        }
        if (bad) {
            invalid(p, f, value, "not a comma-separated list of 1, 2, 4 or 8");
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

/* One cell of the grid. */
typedef struct shape {
    kvp_dtype dtype;
    size_t batch;
    size_t heads;    /* query heads H */
    size_t kv_heads; /* stored heads: H / group */
    size_t width;    /* d_h */
    size_t len;
} shape;

static size_t grid_cells(const options *o)
{
    return o->dtypes.count * o->groups.count * o->batches.count * o->heads.count *
           o->widths.count * o->lens.count;
}

/* Cell i of the grid: L varies fastest, then d_h, H, B, the group, the dtype. */
static shape grid_shape(const options *o, size_t i)
{
    shape s;
    s.len = o->lens.value[i % o->lens.count];
    i /= o->lens.count;
    s.width = o->widths.value[i % o->widths.count];
    i /= o->widths.count;
    s.heads = o->heads.value[i % o->heads.count];
    i /= o->heads.count;
    s.batch = o->batches.value[i % o->batches.count];
    i /= o->batches.count;
    s.kv_heads = s.heads / o->groups.value[i % o->groups.count];
    i /= o->groups.count;
    s.dtype = (kvp_dtype)o->dtypes.value[i];
    return s;
}

/* K+V bytes of a B x H_kv x L x d_h cache as stored, or SIZE_MAX on overflow. */
static size_t kv_bytes(const shape *s)
{
    size_t bytes = 2 * kvp_dtype_bytes(s->dtype);
    if (kvp_cli_mul(bytes, s->batch, &bytes) != 0 || kvp_cli_mul(bytes, s->kv_heads, &bytes) != 0 ||
        kvp_cli_mul(bytes, s->width, &bytes) != 0 || kvp_cli_mul(bytes, s->len, &bytes) != 0) {
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
    if (o->value[FLAG_DTYPES] == NULL) {
        o->dtypes = all_dtypes;
    }
    if (o->value[FLAG_GROUPS] == NULL) {
        o->groups = full_groups;
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
    for (size_t g = 0; g < o->groups.count && o->value[FLAG_GROUPS] != NULL; g++) {
        for (size_t h = 0; h < o->heads.count; h++) {
            if (o->heads.value[h] % o->groups.value[g] != 0) {
                char why[96];
                snprintf(why, sizeof why, "%zu does not divide the grid's %zu heads",
                         o->groups.value[g], o->heads.value[h]);
                invalid(p, FLAG_GROUPS, o->value[FLAG_GROUPS], why);
                return;
            }
        }
    }
    size_t smallest = SIZE_MAX;
    size_t largest = 0;
    for (size_t i = 0; i < grid_cells(o); i++) {
        shape s = grid_shape(o, i);
        size_t bytes = kv_bytes(&s);
        smallest = bytes < smallest ? bytes : smallest;
        if (bytes <= o->max_bytes && bytes > largest) {
            largest = bytes;
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

typedef struct gather_row {
    shape s;
    size_t block_tokens;
    size_t threads;       /* 1, or 2: a decoder of 2 threads, the second assisting */
    double paged_ns;
    double contiguous_ns;
    double gbps;
    double percent_of_read;
    int identical;
} gather_row;

/*
 * One timed case: what a decode step's attention computes for every lane
 * (scores, softmax, values: kvpi_gather_attend_on, the loops
 * kvp_attention_prepare runs, without its finite checks), on this thread
 * (decoder NULL) or as the one job of a step of a 2-thread decoder, whose
 * other thread helps through the assist (kvpi_decoder_run). The candidate
 * rows are not rounded to the dtype: the case times, the identity check
 * compares cases with the same inputs.
 */
typedef struct gather_ctx {
    kvpi_gather_job job;
    kvp_decoder *decoder;
    int failed;               /* a decoder step was refused (cannot happen: one caller) */
} gather_ctx;

static void gather_solo(void *arg, const kvpi_parallel *par)
{
    gather_ctx *g = arg;
    kvpi_gather_attend_on(&g->job, par);
}

static void gather_once(gather_ctx *g)
{
    if (g->decoder == NULL) {
        kvpi_gather_attend_on(&g->job, NULL);
    } else if (kvpi_decoder_run(g->decoder, gather_solo, g, NULL) != KVP_OK) {
        g->failed = 1;
    }
}

static void gather_run(void *arg, size_t iterations)
{
    for (size_t i = 0; i < iterations; i++) {
        gather_once(arg);
    }
}

/* The cases of one (shape, block): paged and contiguous, on 1 thread and on 2. */
enum { PAGED_1, CONTIGUOUS_1, PAGED_2, CONTIGUOUS_2, CASES };

/* Buffers shared by every cache of one shape. */
typedef struct gather_space {
    double *rows;          /* [ROW_VARIANTS][2][B][H_kv][d_h]: key then value rows, cycled */
    double *queries;
    double *candidates;
    double *scores[CASES];
    double *outputs[CASES];
} gather_space;

static void space_free(gather_space *w)
{
    kvp_cli_free(w->rows);
    kvp_cli_free(w->queries);
    kvp_cli_free(w->candidates);
    for (int i = 0; i < CASES; i++) {
        kvp_cli_free(w->scores[i]);
        kvp_cli_free(w->outputs[i]);
    }
    memset(w, 0, sizeof *w);
}

static int space_alloc(const shape *s, gather_space *w, uint64_t *rng)
{
    size_t bhd = s->batch * s->heads * s->width;
    size_t bkd = s->batch * s->kv_heads * s->width;
    size_t nscores = s->batch * s->heads * (s->len + 1);
    memset(w, 0, sizeof *w);
    w->rows = kvp_cli_alloc(ROW_VARIANTS * 2 * bkd, sizeof(double));
    w->queries = kvp_cli_alloc(bhd, sizeof(double));
    w->candidates = kvp_cli_alloc(bkd, sizeof(double));
    int failed = w->rows == NULL || w->queries == NULL || w->candidates == NULL;
    for (int i = 0; i < CASES; i++) {
        w->scores[i] = kvp_cli_alloc(nscores, sizeof(double));
        w->outputs[i] = kvp_cli_alloc(bhd, sizeof(double));
        failed |= w->scores[i] == NULL || w->outputs[i] == NULL;
    }
    if (failed) {
        space_free(w);
        kvp_cli_report_oom("bench", "the gather buffers",
                           ((ROW_VARIANTS * 2 + 1) * bkd + (CASES + 1) * bhd +
                            CASES * nscores) * 8);
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

/* A pool of `block` positions per page holding B lanes of L rows; pages shuffled when paged. */
static int build_cache(const shape *s, size_t block, const gather_space *w, uint64_t *rng,
                       built *out)
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
    kvp_binding binding;
    memset(&binding, 0, sizeof binding);
    binding.model_width = s->heads * s->width;
    binding.heads = s->heads;
    binding.kv_heads = s->kv_heads;
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
    size_t bkd = s->batch * s->kv_heads * s->width;
    for (size_t p = 0; status == KVP_OK && p < s->len; p++) {
        const double *key = w->rows + (p % ROW_VARIANTS) * 2 * bkd;
        kvp_tensor k = kvp_tensor4(key, s->batch, s->kv_heads, 1, s->width);
        kvp_tensor v = kvp_tensor4(key + bkd, s->batch, s->kv_heads, 1, s->width);
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
    kvp_decoder *decoder;  /* 2 threads: the gather's second thread assists through it */
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
    uint64_t rng = 20240601u + s->len * 31u + s->batch * 7u + s->heads * 3u + s->width +
                   s->kv_heads * 101u + (uint64_t)s->dtype * 1009u;
    gather_space w;
    if (space_alloc(s, &w, &rng) != 0) {
        return KVP_CLI_USAGE;
    }
    built contiguous;
    if (build_cache(s, s->len, &w, &rng, &contiguous) != 0) {
        space_free(&w);
        return KVP_CLI_USAGE;
    }
    double bytes = (double)kv_bytes(s);
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
        double scale = 1.0 / sqrt((double)s->width);
        gather_ctx ctx[CASES];
        for (int c = 0; c < CASES; c++) {
            const built *cache = c == PAGED_1 || c == PAGED_2 ? &paged : &contiguous;
            ctx[c].job = (kvpi_gather_job){.cache = cache->cache,
                                           .queries = w.queries,
                                           .keys = w.candidates,
                                           .values = w.candidates,
                                           .scale = scale,
                                           .weights = w.scores[c],
                                           .outputs = w.outputs[c]};
            ctx[c].decoder = c == PAGED_2 || c == CONTIGUOUS_2 ? r->decoder : NULL;
            ctx[c].failed = 0;
            gather_once(&ctx[c]);
        }
        int identical = 1;
        for (int c = 1; c < CASES; c++) {
            identical &= memcmp(w.scores[0], w.scores[c], nscores * sizeof(double)) == 0 &&
                         memcmp(w.outputs[0], w.outputs[c], bhd * sizeof(double)) == 0;
        }
        kvp_measure_case cases[CASES];
        for (int c = 0; c < CASES; c++) {
            cases[c] = (kvp_measure_case){gather_run, &ctx[c]};
        }
        double ns[CASES];
        if (kvp_measure_alternating(cases, CASES, o->repetitions, MIN_NS, ns) != 0) {
            kvp_cli_report_oom("bench", "the timing scratch", CASES * o->repetitions * 8);
            status = KVP_CLI_USAGE;
        } else if (ctx[PAGED_2].failed || ctx[CONTIGUOUS_2].failed) {
            fprintf(stderr, "kvpager bench: the decoder refused a step\n");
            status = KVP_CLI_USAGE;
        } else {
            for (size_t t = 1; t <= 2; t++) {
                gather_row *row = &r->rows[r->row_count++];
                row->s = *s;
                row->block_tokens = block;
                row->threads = t;
                row->identical = identical;
                row->paged_ns = ns[t == 1 ? PAGED_1 : PAGED_2];
                row->contiguous_ns = ns[t == 1 ? CONTIGUOUS_1 : CONTIGUOUS_2];
                row->gbps = bytes / row->paged_ns;
                row->percent_of_read = 100.0 * row->gbps / r->read.gbps;
            }
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
 * tokens generated so far), in every layer; 2 x H_kv x d_h elements of the
 * pool's dtype per row and layer.
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
    double kv_width = (double)kvp_sim_kv_heads(c) * (double)(c->model_width / c->heads);
    double row_bytes =
        2.0 * kv_width * (double)kvp_dtype_bytes(c->kv_dtype) * (double)c->layers;
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
        kvp_cli_report_oom("bench", "the request list", o->requests * sizeof(kvp_workload_request));
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

/*
 * 2 threads against 1: the median over the grid's (shape, block) pairs of
 * paged time on 1 thread / on 2, among the pairs `keep` accepts (NULL: all);
 * *count gets how many. Rows come in pairs, threads 1 then 2.
 */
static double two_thread_speedup(const results *r, int (*keep)(const gather_row *),
                                 size_t *count)
{
    double *ratios = kvp_cli_alloc(r->row_count / 2 + 1, sizeof *ratios);
    size_t n = 0;
    for (size_t i = 0; ratios != NULL && i + 1 < r->row_count; i += 2) {
        const gather_row *one = &r->rows[i];
        if (keep == NULL || keep(one)) {
            ratios[n++] = one->paged_ns / r->rows[i + 1].paged_ns;
        }
    }
    double median = n > 0 ? kvp_measure_median(ratios, n) : 0.0;
    kvp_cli_free(ratios);
    *count = n;
    return median;
}

/* The two-thread targets: B = 8, and B = 1 at L >= 2048. */
static int batch8(const gather_row *g)
{
    return g->s.batch == 8;
}

static int batch1_long(const gather_row *g)
{
    return g->s.batch == 1 && g->s.len >= 2048;
}

static void print_tables(const options *o, const results *r)
{
    char buf[32];
    printf("kvpager bench: kernels %s; medians of %zu alternating repetitions%s\n\n",
           isa_name(), o->repetitions, o->quick ? " (--quick grid)" : "");
    printf("read bandwidth (%s array, %d accumulators)   %.2f GB/s on 1 thread, %.2f GB/s on "
           "2 threads\n\n",
           kvp_cli_format_bytes(o->read_bytes, buf, sizeof buf), READERS, r->read.gbps,
           r->read.gbps_two);
    printf("gather: scores + softmax + values over every lane's retained rows, the loops\n"
           "kvp_attention_prepare runs; paged (pages shuffled) against one page per lane\n"
           "(contiguous), on 1 thread and on a decoder of 2 (thr); ratio = contiguous /\n"
           "paged time; GB/s = K+V bytes as stored / paged time\n\n");
    printf("dtype  block thr   B   H  kv_H  d_h    len     K+V      paged ns  contig ns  ratio"
           "    GB/s  %% read\n");
    for (size_t i = 0; i < r->row_count; i++) {
        const gather_row *g = &r->rows[i];
        printf("%-5s %6zu %3zu  %2zu  %2zu  %4zu  %3zu  %5zu  %9s  %11.0f  %9.0f  %5.3f  %6.2f  "
               "%6.1f%s\n",
               kvp_dtype_name(g->s.dtype), g->block_tokens, g->threads, g->s.batch, g->s.heads,
               g->s.kv_heads, g->s.width, g->s.len,
               kvp_cli_format_bytes(kv_bytes(&g->s), buf, sizeof buf),
               g->paged_ns, g->contiguous_ns, g->contiguous_ns / g->paged_ns, g->gbps,
               g->percent_of_read, g->identical ? "" : "  RESULTS DIFFER");
    }
    if (r->skip_count > 0) {
        printf("\nskipped, K+V above the %s cap (--max-bytes):",
               kvp_cli_format_bytes(o->max_bytes, buf, sizeof buf));
        for (size_t i = 0; i < r->skip_count; i++) {
            const skipped *s = &r->skips[i];
            printf("%s %s B=%zu H=%zu kv_H=%zu d_h=%zu L=%zu (%s)", i % 3 == 0 ? "\n " : ",",
                   kvp_dtype_name(s->s.dtype), s->s.batch, s->s.heads, s->s.kv_heads,
                   s->s.width, s->s.len, kvp_cli_format_bytes(s->bytes, buf, sizeof buf));
        }
        printf("\n");
    }
    size_t all = 0;
    size_t eight = 0;
    size_t one_long = 0;
    double median = two_thread_speedup(r, NULL, &all);
    double median8 = two_thread_speedup(r, batch8, &eight);
    double median1 = two_thread_speedup(r, batch1_long, &one_long);
    char shown[3][32];
    const double medians[3] = {median, median8, median1};
    const size_t counts[3] = {all, eight, one_long};
    for (int i = 0; i < 3; i++) {
        if (counts[i] > 0) {
            snprintf(shown[i], sizeof shown[i], "%.2fx over %zu", medians[i], counts[i]);
        } else {
            snprintf(shown[i], sizeof shown[i], "none measured");
        }
    }
    printf("\n2 threads against 1 (paged time on 1 / on 2, median): %s rows;\n"
           "  B = 8: %s; B = 1 at L >= 2048: %s\n",
           shown[0], shown[1], shown[2]);
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
        kvp_json_string(&json, "dtype", kvp_dtype_name(g->s.dtype));
        kvp_json_uint(&json, "block_tokens", g->block_tokens);
        kvp_json_uint(&json, "batch", g->s.batch);
        kvp_json_uint(&json, "heads", g->s.heads);
        kvp_json_uint(&json, "kv_heads", g->s.kv_heads);
        kvp_json_uint(&json, "head_width", g->s.width);
        kvp_json_uint(&json, "len", g->s.len);
        kvp_json_uint(&json, "threads", g->threads);
        kvp_json_uint(&json, "kv_bytes", kv_bytes(&g->s));
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
        kvp_json_string(&json, "dtype", kvp_dtype_name(s->s.dtype));
        kvp_json_uint(&json, "batch", s->s.batch);
        kvp_json_uint(&json, "heads", s->s.heads);
        kvp_json_uint(&json, "kv_heads", s->s.kv_heads);
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
    size_t n = 0;
    kvp_json_object_begin(&json, "two_threads"); /* paged time on 1 thread / on 2, medians */
    kvp_json_double(&json, "speedup", two_thread_speedup(r, NULL, &n));
    kvp_json_uint(&json, "rows", n);
    kvp_json_double(&json, "batch8_speedup", two_thread_speedup(r, batch8, &n));
    kvp_json_uint(&json, "batch8_rows", n);
    kvp_json_double(&json, "batch1_len2048_speedup", two_thread_speedup(r, batch1_long, &n));
    kvp_json_uint(&json, "batch1_len2048_rows", n);
    kvp_json_object_end(&json);
    kvp_json_array_begin(&json, "not_available"); /* nothing of the grid is missing */
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
    /* Per dtype of the grid (at most 3): the median GB/s at each measured L. */
    double lens[3][MAX_LIST];
    double gbps[3][MAX_LIST];
    size_t points[3] = {0, 0, 0};
    double values[64];
    double top = r->read.gbps;
    double lo = INFINITY;
    double hi = -INFINITY;
    for (size_t k = 0; k < o->dtypes.count && k < 3; k++) {
        for (size_t l = 0; l < o->lens.count; l++) {
            size_t n = 0;
            for (size_t i = 0; i < r->row_count && n < 64; i++) {
                const gather_row *g = &r->rows[i];
                if (g->s.len == o->lens.value[l] && g->block_tokens == block && g->threads == 1 &&
                    g->s.dtype == (kvp_dtype)o->dtypes.value[k]) {
                    values[n++] = g->gbps;
                }
            }
            if (n > 0) {
                double x = (double)o->lens.value[l];
                double y = kvp_measure_median(values, n);
                lens[k][points[k]] = x;
                gbps[k][points[k]++] = y;
                top = y > top ? y : top;
                lo = log2(x) < lo ? log2(x) : lo;
                hi = log2(x) > hi ? log2(x) : hi;
            }
        }
    }
    if (!(lo <= hi)) { /* nothing measured: an empty frame around L = 1 */
        lo = 0.0;
        hi = 0.0;
    }
    double step = kvp_plot_tick_step(top);
    top = ceil(top / step) * step;
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
    for (size_t l = 0; l < o->lens.count; l++) {
        double x = (double)o->lens.value[l];
        if (log2(x) >= lo && log2(x) <= hi) {
            fprintf(out,
                    "<text class=\"tick-x\" x=\"%.1f\" y=\"%.1f\" font-size=\"12\" "
                    "text-anchor=\"middle\">%.0f</text>\n",
                    X_OF(x), PT + h + 20.0, x);
        }
    }
    fprintf(out,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
            "stroke=\"#333\"/>\n<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
            "stroke=\"#d62728\" stroke-dasharray=\"6 4\"/>\n<text x=\"%.1f\" y=\"%.1f\" "
            "font-size=\"12\" fill=\"#d62728\" text-anchor=\"end\">read bandwidth, 1 thread "
            "(%.2f GB/s)</text>\n",
            PL, PT, w, h, PL, Y_OF(r->read.gbps), PW - PR, Y_OF(r->read.gbps), PW - PR - 4.0,
            Y_OF(r->read.gbps) - 6.0, r->read.gbps);
    static const char *const colors[3] = {"#1f77b4", "#2ca02c", "#9467bd"};
    for (size_t k = 0; k < o->dtypes.count && k < 3; k++) {
        const char *name = kvp_dtype_name((kvp_dtype)o->dtypes.value[k]);
        fprintf(out, "<polyline class=\"dtype-%s\" fill=\"none\" stroke=\"%s\" "
                     "stroke-width=\"2\" points=\"",
                name, colors[k]);
        for (size_t i = 0; i < points[k]; i++) {
            fprintf(out, "%.1f,%.1f ", X_OF(lens[k][i]), Y_OF(gbps[k][i]));
        }
        fprintf(out, "\"/>\n<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" fill=\"%s\">%s"
                     "</text>\n",
                PL + 8.0, PT + 16.0 + 16.0 * (double)k, colors[k], name);
    }
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
    size_t cells = grid_cells(o);
    r->rows = kvp_cli_alloc(cells * o->blocks.count * 2, sizeof *r->rows);
    r->skips = kvp_cli_alloc(cells, sizeof *r->skips);
    if (r->rows == NULL || r->skips == NULL) {
        kvp_cli_report_oom("bench", "the result table",
                           cells * o->blocks.count * 2 * sizeof *r->rows);
        return -1;
    }
    *shapes = 0;
    for (size_t i = 0; i < cells; i++) {
        shape s = grid_shape(o, i);
        size_t bytes = kv_bytes(&s);
        if (bytes > o->max_bytes) {
            r->skips[r->skip_count].s = s;
            r->skips[r->skip_count++].bytes = bytes;
        } else {
            *shapes += 1;
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
    kvp_error err;
    if (status == KVP_CLI_OK && kvp_decoder_create(2, &r->decoder, &err) != KVP_OK) {
        kvp_cli_report("bench", "creating a decoder of 2 threads", &err);
        status = KVP_CLI_USAGE;
    }
    for (size_t i = 0; i < grid_cells(o) && status == KVP_CLI_OK; i++) {
        shape s = grid_shape(o, i);
        if (kv_bytes(&s) <= o->max_bytes) {
            status = measure_shape(o, &s, r, progress, &done, total);
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
    if (r.decoder != NULL) {
        kvp_status destroyed = kvp_decoder_destroy(r.decoder, NULL); /* idle: cannot fail */
        (void)destroyed;
    }
    return status;
}
