/*
 * bench.c: `kvpager bench`, the library's speed against honest baselines,
 * in one run.
 *
 * Owns: the command line, the grid (storage dtype x accumulation level x
 * KV-head group x B x H x d_h x L, each shape for every block_tokens), the
 * memory check, and the order of the run: the whole-array read, every
 * shape's gathers (bench_gather.c: the public kvp_paged_attention, each
 * alternating with a read of its own size), page operations and simulate (bench_sim.c), then the report
 * (bench_report.c). The read loop is bench_read.c's.
 * The dtypes it knows are bench_dtypes below: adding a dtype is one line.
 * Order (nothing runs on bad input): parse every argument, validate every
 * value and the memory the grid needs, open the --plot file, then measure.
 * Exit status: 0, 1 when a paged and a contiguous gather disagree, 2 on bad
 * input, an unwritable output or an error (out of memory included).
 * Callers: dispatch.c. Allocations of its own go through alloc.h.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "bench.h"
#include "cli.h"

#define MAX_LEN ((size_t)1 << 22)
#define MAX_BLOCK ((size_t)1 << 20)
#define MAX_REPETITIONS 1001
#define MAX_REQUESTS 100000
#define MIN_READ_BYTES ((size_t)64 << 10)
#define MAX_LIST BENCH_MAX_LIST

/* The storage dtypes bench measures, in grid order: one line per dtype. */
const kvp_dtype bench_dtypes[] = {
    KVP_F64,
    KVP_F32,
    KVP_BF16,
    KVP_F16,      /* on request (--dtypes): the default grid stops at bf16 */
    KVP_FP8_E4M3, /* on request */
};
/* The default grid's dtypes: the first DEFAULT_DTYPES of bench_dtypes (--quick's cost in --help). */
#define DEFAULT_DTYPES 3
const size_t bench_dtype_count = sizeof bench_dtypes / sizeof bench_dtypes[0];

/* The flags that take a value, in --help order. */
#define FLAG_MAP(X)                                                                       \
    X(PLOT, "--plot")                                                                     \
    X(LENS, "--lens")                                                                     \
    X(BLOCKS, "--blocks")                                                                 \
    X(DTYPES, "--dtypes")                                                                 \
    X(ACCUM, "--accum")                                                                   \
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

typedef bench_list size_list;

/* The command line: the flags' texts beside the options they set. */
typedef struct options {
    bench_options b;
    const char *value[FLAG_COUNT_];
} options;

/*
 * The grids: the shapes (B in {1, 8}, 32 query heads over 32 or 8 KV
 * heads, d_h 128, L in {512, 4096, 32768}); the full one for every
 * block_tokens, --quick's at block_tokens 16.
 */
static const size_list grid_lens = {{512, 4096, 32768}, 3};
static const size_list full_blocks = {{1, 4, 16, 64}, 4};
static const size_list grid_batches = {{1, 8}, 2};
static const size_list grid_heads = {{32}, 1};
static const size_list grid_widths = {{128}, 1};
static const size_list grid_groups = {{1, 4}, 2};
static const size_list all_accums = {{KVP_ACCUM_EXACT, KVP_ACCUM_FAST}, 2};
static const size_list quick_blocks = {{16}, 1};

/* "f64, f32, bf16": the known dtypes' names, for --help and refusals. */
static const char *dtype_names(void)
{
    static char names[128];
    size_t used = 0;
    names[0] = '\0';
    for (size_t k = 0; k < bench_dtype_count && used < sizeof names; k++) {
        int n = snprintf(names + used, sizeof names - used, "%s%s", k == 0 ? "" : ", ",
                         kvp_dtype_name(bench_dtypes[k]));
        used += n > 0 ? (size_t)n : 0;
    }
    return names;
}

static void bench_usage(FILE *out)
{
    fprintf(out,
            "usage: kvpager bench [options]\n\n"
            "Measures, in one run, on this machine: the read bandwidth of a large array\n"
            "(1 and 2 threads, the best of the portable read loops and those of the\n"
            "kernels' SIMD level, on memory advised for huge pages as the pool's slab);\n"
            "the public kvp_paged_attention (scores, softmax and values over the retained\n"
            "rows, every lane and query head) against the same call over the same pages\n"
            "laid out adjacent and in order, alternating with a read of the shape's own\n"
            "size, for each block_tokens, over a grid of storage dtype (%s) x\n"
            "accumulation level (exact; fast for narrow dtypes), batch B in {1, 8}, 32\n"
            "query heads over KV heads in {32, 8}, head width 128 and length L in {512,\n"
            "4096, 32768}, with its GB/s (bytes of K+V as stored) and, for DRAM-resident\n"
            "shapes (K+V >= 256 MiB), its percentage of the read; page acquire + release\n"
            "against jemalloc and glibc; and `kvpager simulate`'s tokens/s against the\n"
            "bound its steps' K+V bytes set at the read bandwidth of their size.\n"
            "Each call runs on 1 thread and on a decoder of 2 threads (its `threads`; the\n"
            "results are bit-identical), and the run reports the speedup. Figures are\n"
            "medians of alternating repetitions; ratios are within the run.\n\n"
            "Every value is checked before anything runs: a bad one prints one line naming\n"
            "the option and the value, and exits 2. N is a whole number.\n\n"
            "options:\n"
            "  --quick              the same shapes at block_tokens 16 only, 5 repetitions,\n"
            "                       32 simulated requests: 4.6 to 4.9 minutes and a peak\n"
            "                       resident set of 5.1 to 5.3 GiB here (measured with\n"
            "                       /usr/bin/time -v): two copies of the largest shape\n"
            "                       under the 2 GiB cap, and the 1 GiB read array\n"
            "                       (--max-bytes, --read-bytes)\n"
            "  --json               print one JSON object instead of the tables\n"
            "  --plot FILE.svg      draw GB/s against L (one line per dtype, the read figure\n"
            "                       dashed); the file is opened before the run, so an\n"
            "                       unwritable path is refused up front (exit 2)\n"
            "  --quiet              no progress line (it shows only on a terminal anyway)\n"
            "  --help, -h           show this help\n"
            "grid overrides (for tests and quick looks):\n"
            "  --lens N,N,...       lengths L, each 1 to %zu (default 512,4096,32768)\n"
            "  --blocks N,N,...     block_tokens, each 1 to %zu (default 1,4,16,64; quick\n"
            "                       16)\n"
            "  --dtypes D,D,...     storage dtypes among %s\n"
            "                       (default f64, f32, bf16)\n"
            "  --accum A,A,...      accumulation levels, exact and/or fast (default both;\n"
            "                       fast is measured for narrow dtypes only)\n"
            "  --groups N,N,...     query heads per KV head (kv_heads = H / N), each 1, 2, 4\n"
            "                       or 8, dividing every H of the grid (default 1,4)\n"
            "  --max-bytes SIZE     skip shapes whose K+V bytes exceed SIZE; the run holds\n"
            "                       two copies (paged, contiguous) (default 2GiB)\n"
            "  --read-bytes SIZE    the read figure's array, at least 64KiB (default 1GiB);\n"
            "                       a shape's own-size read reads at most this much\n"
            "  --repetitions N      repetitions per figure, 1 to %d (default 7; quick 5)\n"
            "  --requests N         simulated requests, 1 to %d (default 128; quick 32)\n\n"
            "exit status: 0 success, 1 a paged gather differs from the contiguous one,\n"
            "2 bad input or an error (out of memory included).\n",
            dtype_names(), MAX_LEN, MAX_BLOCK, dtype_names(), MAX_REPETITIONS, MAX_REQUESTS);
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

/* The dtype named by text[0..n) (a kvp_dtype_name, or "fp8"), or -1 when unknown. */
static int known_dtype(const char *text, size_t n)
{
    for (size_t k = 0; k < bench_dtype_count; k++) {
        const char *name = kvp_dtype_name(bench_dtypes[k]);
        int alias = bench_dtypes[k] == KVP_FP8_E4M3 && n == 3 && strncmp(text, "fp8", 3) == 0;
        if ((strlen(name) == n && strncmp(text, name, n) == 0) || alias) {
            return (int)bench_dtypes[k];
        }
    }
    return -1;
}

/* "exact" or "fast" from text[0..n), or -1. */
static int known_accum(const char *text, size_t n)
{
    if (n == 5 && strncmp(text, "exact", 5) == 0) {
        return KVP_ACCUM_EXACT;
    }
    return n == 4 && strncmp(text, "fast", 4) == 0 ? KVP_ACCUM_FAST : -1;
}

/* "a,b,...": distinct names `known` maps to values, at most MAX_LIST. 0, or -1. */
static int parse_names(const char *text, int (*known)(const char *, size_t), size_list *out)
{
    size_list list = {{0}, 0};
    const char *p = text;
    for (;;) {
        size_t n = strcspn(p, ",");
        int found = known(p, n);
        for (size_t i = 0; found >= 0 && i < list.count; i++) {
            found = list.value[i] == (size_t)found ? -1 : found;
        }
        if (found < 0 || list.count == MAX_LIST) {
            return -1;
        }
        list.value[list.count++] = (size_t)found;
        if (p[n] == '\0') {
            break;
        }
        p += n + 1;
    }
    *out = list;
    return 0;
}

/* --plot: the file, opened once every value is checked. */
static void parse_plot(bench_options *o, flag f, const char *value, kvp_cli_problems *p)
{
    (void)f;
    (void)p;
    o->plot = value;
}

/* --lens, --blocks: lists of whole numbers from 1 to the flag's maximum. */
static void parse_sizes(bench_options *o, flag f, const char *value, kvp_cli_problems *p)
{
    char why[160];
    size_t max = f == FLAG_LENS ? MAX_LEN : MAX_BLOCK;
    snprintf(why, sizeof why, "not a comma-separated list of up to %d whole numbers from 1 "
                              "to %zu",
             MAX_LIST, max);
    if (parse_list(value, max, f == FLAG_LENS ? &o->lens : &o->blocks) != 0) {
        invalid(p, f, value, why);
    }
}

static void parse_dtypes(bench_options *o, flag f, const char *value, kvp_cli_problems *p)
{
    char why[160];
    snprintf(why, sizeof why, "not a comma-separated list of distinct dtypes among %s",
             dtype_names());
    if (parse_names(value, known_dtype, &o->dtypes) != 0) {
        invalid(p, f, value, why);
    }
}

static void parse_accums(bench_options *o, flag f, const char *value, kvp_cli_problems *p)
{
    if (parse_names(value, known_accum, &o->accums) != 0) {
        invalid(p, f, value, "not a comma-separated list of distinct levels exact, fast");
    }
}

/* --groups: a list of powers of two up to 8. */
static void parse_groups(bench_options *o, flag f, const char *value, kvp_cli_problems *p)
{
    int bad = parse_list(value, 8, &o->groups) != 0;
    for (size_t i = 0; !bad && i < o->groups.count; i++) {
        size_t g = o->groups.value[i];
        bad = (g & (g - 1)) != 0;
    }
    if (bad) {
        invalid(p, f, value, "not a comma-separated list of 1, 2, 4 or 8");
    }
}

/* --max-bytes, --read-bytes: byte sizes. */
static void parse_byte_size(bench_options *o, flag f, const char *value, kvp_cli_problems *p)
{
    if (kvp_cli_parse_bytes(value, f == FLAG_MAX_BYTES ? &o->max_bytes : &o->read_bytes) != 0) {
        invalid(p, f, value,
                "not a whole byte count (a number with an optional unit B, KiB, MiB, "
                "GiB, TiB, KB, MB, GB or TB, below 2^64 bytes)");
    }
}

/* --repetitions, --requests: whole numbers from 1 to the flag's maximum. */
static void parse_count(bench_options *o, flag f, const char *value, kvp_cli_problems *p)
{
    char why[160];
    size_t *field = f == FLAG_REPETITIONS ? &o->repetitions : &o->requests;
    size_t max = f == FLAG_REPETITIONS ? MAX_REPETITIONS : MAX_REQUESTS;
    snprintf(why, sizeof why, "must be a whole number from 1 to %zu", max);
    if (kvp_cli_parse_size(value, field) != 0 || *field < 1 || *field > max) {
        invalid(p, f, value, why);
    }
}

/* How each flag's value is read (syntax and range: bench's values depend on no other flag). */
static const struct {
    flag flag;
    void (*parse)(bench_options *o, flag f, const char *value, kvp_cli_problems *p);
} value_parsers[] = {
    {FLAG_PLOT, parse_plot},          {FLAG_LENS, parse_sizes},
    {FLAG_BLOCKS, parse_sizes},       {FLAG_DTYPES, parse_dtypes},
    {FLAG_ACCUM, parse_accums},       {FLAG_GROUPS, parse_groups},
    {FLAG_MAX_BYTES, parse_byte_size}, {FLAG_READ_BYTES, parse_byte_size},
    {FLAG_REPETITIONS, parse_count},  {FLAG_REQUESTS, parse_count},
};

static void parse_value(bench_options *o, flag f, const char *value, kvp_cli_problems *p)
{
    for (size_t i = 0; i < sizeof value_parsers / sizeof value_parsers[0]; i++) {
        if (value_parsers[i].flag == f) {
            value_parsers[i].parse(o, f, value, p);
        }
    }
}

static void parse_options(int argc, char **argv, options *cl, kvp_cli_problems *p)
{
    memset(cl, 0, sizeof *cl);
    bench_options *o = &cl->b;
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
        int f = kvp_cli_take_flag(argc, argv, &i, "bench", flag_names, FLAG_COUNT_, cl->value,
                                  p);
        if (f >= 0) {
            parse_value(o, (flag)f, cl->value[f], p);
        }
    }
}


/* ---- the grid ---------------------------------------------------------------- */

size_t bench_kv_bytes(const bench_shape *s)
{
    size_t bytes = 2 * kvp_dtype_bytes(s->dtype);
    if (kvp_cli_mul(bytes, s->batch, &bytes) != 0 || kvp_cli_mul(bytes, s->kv_heads, &bytes) != 0 ||
        kvp_cli_mul(bytes, s->width, &bytes) != 0 || kvp_cli_mul(bytes, s->len, &bytes) != 0) {
        return SIZE_MAX;
    }
    return bytes;
}

int bench_dram_resident(size_t bytes)
{
    return bytes >= BENCH_DRAM_BYTES;
}

static size_t grid_cells(const bench_options *o)
{
    return o->kinds.count * o->groups.count * o->batches.count * o->heads.count *
           o->widths.count * o->lens.count;
}

/* Cell i of the grid: L varies fastest, then d_h, H, B, the group, the (dtype, accum). */
static bench_shape grid_shape(const bench_options *o, size_t i)
{
    bench_shape s;
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
    s.dtype = (kvp_dtype)(o->kinds.value[i] / 2);
    s.accum = (kvp_accum)(o->kinds.value[i] % 2);
    return s;
}

/* The (dtype, accum) pairs: every dtype at every level asked, fast for narrow dtypes only. */
static void set_kinds(bench_options *o)
{
    o->kinds.count = 0;
    for (size_t d = 0; d < o->dtypes.count; d++) {
        for (size_t a = 0; a < o->accums.count; a++) {
            if (o->accums.value[a] == KVP_ACCUM_EXACT || o->dtypes.value[d] != KVP_F64) {
                o->kinds.value[o->kinds.count++] = o->dtypes.value[d] * 2 + o->accums.value[a];
            }
        }
    }
}

static void set_defaults(options *cl)
{
    bench_options *o = &cl->b;
    if (cl->value[FLAG_LENS] == NULL) {
        o->lens = grid_lens;
    }
    if (cl->value[FLAG_BLOCKS] == NULL) {
        o->blocks = o->quick ? quick_blocks : full_blocks;
    }
    if (cl->value[FLAG_DTYPES] == NULL) {
        o->dtypes.count = DEFAULT_DTYPES;
        for (size_t k = 0; k < DEFAULT_DTYPES; k++) {
            o->dtypes.value[k] = (size_t)bench_dtypes[k];
        }
    }
    if (cl->value[FLAG_ACCUM] == NULL) {
        o->accums = all_accums;
    }
    if (cl->value[FLAG_GROUPS] == NULL) {
        o->groups = grid_groups;
    }
    o->batches = grid_batches;
    o->heads = grid_heads;
    o->widths = grid_widths;
    set_kinds(o);
    o->max_bytes_text = cl->value[FLAG_MAX_BYTES] != NULL ? cl->value[FLAG_MAX_BYTES] : "2GiB";
    if (cl->value[FLAG_MAX_BYTES] == NULL) {
        o->max_bytes = (size_t)2 << 30;
    }
    if (cl->value[FLAG_READ_BYTES] == NULL) {
        o->read_bytes = (size_t)1 << 30;
    }
    if (cl->value[FLAG_REPETITIONS] == NULL) {
        o->repetitions = o->quick ? 5 : 7;
    }
    if (cl->value[FLAG_REQUESTS] == NULL) {
        o->requests = o->quick ? 32 : 128;
    }
}

/* Every group divides every H of the grid. 0, or -1 with the problem noted. */
static int check_groups(const options *cl, kvp_cli_problems *p)
{
    const bench_options *o = &cl->b;
    for (size_t g = 0; g < o->groups.count && cl->value[FLAG_GROUPS] != NULL; g++) {
        for (size_t h = 0; h < o->heads.count; h++) {
            if (o->heads.value[h] % o->groups.value[g] != 0) {
                char why[96];
                snprintf(why, sizeof why, "%zu does not divide the grid's %zu heads",
                         o->groups.value[g], o->heads.value[h]);
                invalid(p, FLAG_GROUPS, cl->value[FLAG_GROUPS], why);
                return -1;
            }
        }
    }
    return 0;
}

/* The ranges, and the memory the grid needs. */
static void check_options(options *cl, kvp_cli_problems *p)
{
    set_defaults(cl);
    bench_options *o = &cl->b;
    size_t physical = kvp_cli_physical_memory();
    char shown[32];
    const char *read = cl->value[FLAG_READ_BYTES] != NULL ? cl->value[FLAG_READ_BYTES] : "1GiB";
    if (o->read_bytes < MIN_READ_BYTES) {
        invalid(p, FLAG_READ_BYTES, read, "must be at least 64KiB");
    } else if (physical > 0 && o->read_bytes > physical / 2) {
        char why[96];
        snprintf(why, sizeof why, "must be at most half of physical memory (%s)",
                 kvp_cli_format_bytes(physical, shown, sizeof shown));
        invalid(p, FLAG_READ_BYTES, read, why);
    }
    if (o->kinds.count == 0) {
        invalid(p, FLAG_ACCUM, cl->value[FLAG_ACCUM],
                "the fast level applies to narrow dtypes only, and only f64 was asked");
        return;
    }
    if (check_groups(cl, p) != 0) {
        return;
    }
    /* The smallest shape must fit the cap, and two copies of the largest run must fit memory. */
    size_t smallest = SIZE_MAX;
    size_t largest = 0;
    for (size_t i = 0; i < grid_cells(o); i++) {
        bench_shape s = grid_shape(o, i);
        size_t bytes = bench_kv_bytes(&s);
        smallest = bytes < smallest ? bytes : smallest;
        if (bytes <= o->max_bytes && bytes > largest) {
            largest = bytes;
        }
    }
    if (smallest > o->max_bytes) {
        char why[128];
        snprintf(why, sizeof why, "below the grid's smallest shape (%s of K+V): nothing to measure",
                 kvp_cli_format_bytes(smallest, shown, sizeof shown));
        invalid(p, FLAG_MAX_BYTES, o->max_bytes_text, why);
    } else if (physical > 0 && largest > physical / 3) {
        char why[160];
        snprintf(why, sizeof why,
                 "the largest shape measured holds %s of K+V twice (paged and contiguous), "
                 "above two thirds of physical memory",
                 kvp_cli_format_bytes(largest, shown, sizeof shown));
        invalid(p, FLAG_MAX_BYTES, o->max_bytes_text, why);
    }
}

/* ---- the command -------------------------------------------------------------- */

static int prepare(int argc, char **argv, options *cl)
{
    kvp_cli_problems p = {.found = 0};
    parse_options(argc, argv, cl, &p);
    if (cl->b.help) {
        bench_usage(stdout);
        return -1;
    }
    if (!p.found) {
        check_options(cl, &p);
    }
    if (p.found) {
        fprintf(stderr, "kvpager bench: %s\n", p.line);
        return KVP_CLI_USAGE;
    }
    return KVP_CLI_OK;
}

/* Fills r->rows and r->skips from the grid; the caller frees both. */
static int plan(const bench_options *o, bench_results *r, size_t *shapes)
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
        bench_shape s = grid_shape(o, i);
        size_t bytes = bench_kv_bytes(&s);
        if (bytes > o->max_bytes) {
            r->skips[r->skip_count].s = s;
            r->skips[r->skip_count++].bytes = bytes;
        } else {
            *shapes += 1;
        }
    }
    return 0;
}

/* The decoder, the reader pair and the read array every measurement shares. */
static int open_shared(const bench_options *o, bench_results *r)
{
    kvp_error err;
    if (kvp_decoder_create(2, &r->decoder, &err) != KVP_OK) {
        kvp_cli_report("bench", "creating a decoder of 2 threads", &err);
        return KVP_CLI_USAGE;
    }
    if (bench_pair_open(&r->pair) != 0) {
        return KVP_CLI_USAGE;
    }
    if (bench_reader_open(&r->reader, o->read_bytes) != 0) {
        kvp_cli_report_oom("bench", "the read bandwidth array", o->read_bytes);
        return KVP_CLI_USAGE;
    }
    return KVP_CLI_OK;
}

static int run(const bench_options *o, bench_results *r, kvp_progress *progress)
{
    size_t shapes = 0;
    if (plan(o, r, &shapes) != 0) {
        return KVP_CLI_USAGE;
    }
    size_t total = shapes * o->blocks.count + 3;
    size_t done = 0;
    kvp_progress_note(progress, done, total, "measurements");
    int status = open_shared(o, r);
    if (status == KVP_CLI_OK) {
        status = bench_measure_read(o, r);
        kvp_progress_note(progress, ++done, total, "measurements");
    }
    for (size_t i = 0; i < grid_cells(o) && status == KVP_CLI_OK; i++) {
        bench_shape s = grid_shape(o, i);
        if (bench_kv_bytes(&s) <= o->max_bytes) {
            status = bench_measure_shape(o, &s, r, progress, &done, total);
        }
    }
    if (status == KVP_CLI_OK) {
        status = bench_measure_pages(o, r);
        kvp_progress_note(progress, ++done, total, "measurements");
    }
    if (status == KVP_CLI_OK) {
        status = bench_measure_simulate(o, r);
        kvp_progress_note(progress, ++done, total, "measurements");
    }
    return status;
}

/* Writes the plot when one was asked; the status after it. */
static int finish_plot(const bench_options *o, const bench_results *r, kvp_plot *plot,
                       int status)
{
    if (o->plot == NULL) {
        return status;
    }
    if (status == KVP_CLI_USAGE) {
        kvp_plot_abandon(plot);
        return status;
    }
    int error = bench_write_plot(o, r, plot);
    if (error != 0) {
        fprintf(stderr, "kvpager bench: --plot %s: %s\n", o->plot, strerror(error));
        return KVP_CLI_USAGE;
    }
    if (!o->json) {
        printf("\nplot: %s\n", o->plot);
    }
    return status;
}

static void release(bench_results *r)
{
    kvp_cli_free(r->rows);
    kvp_cli_free(r->skips);
    bench_reader_close(&r->reader);
    bench_pair_close(r->pair);
    if (r->decoder != NULL) {
        kvp_status destroyed = kvp_decoder_destroy(r->decoder, NULL); /* idle: cannot fail */
        (void)destroyed;
    }
}

int kvp_cli_bench(int argc, char **argv)
{
    options cl;
    int status = prepare(argc, argv, &cl);
    if (status != KVP_CLI_OK) {
        return status < 0 ? KVP_CLI_OK : status;
    }
    const bench_options *o = &cl.b;
    kvp_plot plot = {NULL, NULL, 0, NULL};
    if (o->plot != NULL) {
        int error = kvp_plot_open(&plot, o->plot);
        if (error != 0) {
            if (error < 0) {
                kvp_cli_report_oom("bench", "the plot's buffer", 8192);
            } else {
                fprintf(stderr, "kvpager bench: --plot %s: %s\n", o->plot, strerror(error));
            }
            return KVP_CLI_USAGE;
        }
    }
    bench_results r;
    memset(&r, 0, sizeof r);
    kvp_progress progress;
    kvp_progress_init(&progress, "bench", o->quiet);
    status = run(o, &r, &progress);
    kvp_progress_finish(&progress);
    if (status == KVP_CLI_OK) {
        if (o->json) {
            bench_print_json(o, &r);
        } else {
            bench_print_tables(o, &r);
        }
        for (size_t i = 0; i < r.row_count; i++) {
            status = r.rows[i].identical ? status : KVP_CLI_FAILED;
        }
    }
    status = finish_plot(o, &r, &plot, status);
    release(&r);
    return status;
}
