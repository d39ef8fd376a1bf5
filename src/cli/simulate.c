/*
 * simulate.c: `kvpager simulate`, many concurrent sequences under one budget.
 *
 * Owns: the command line (every knob of sim.h and workload.h has a flag), the
 * human report, the --json object and the --plot chart. The schedule itself is
 * in sim.c, the workloads in workload.c.
 * Order (nothing runs on bad input):
 *   1. parse: every argument is read (unknown options, missing values,
 *      duplicates and malformed numbers are found here);
 *   2. validate: each flag's range, then flags that depend on each other
 *      (heads divide the width, KV heads divide the heads, a page of the
 *      --kv-dtype within the budget, the mean request
 *      within the capacity, --trace against the generated-workload flags,
 *      no output naming an input: --plot not the --trace file), the trace
 *      file's rows, and the memory every part of the run needs
 *      against physical memory (each product overflow-checked);
 *   3. open the outputs (--plot), so an unwritable path is refused;
 *   4. run, report, finish the plot.
 * The first problem found is printed as one line naming the flag and the
 * value. Exit status: 0 when the run finished with every audit clean and no
 * page leaked; 1 when an audit failed or a page leaked; 2 on bad input, an
 * output that cannot be written, or a library error (out of memory
 * included: "AllocationFailed").
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json.h"
#include "plot.h"
#include "progress.h"
#include "sim.h"
#include "verify.h"
#include "workload.h"

/* The flags that take a value, in --help order. */
#define FLAG_MAP(X)                                                                       \
    X(MODEL, "--model")                                                                   \
    X(LAYERS, "--layers")                                                                 \
    X(MODEL_WIDTH, "--model-width")                                                       \
    X(HEADS, "--heads")                                                                   \
    X(KV_HEADS, "--kv-heads")                                                             \
    X(BLOCK_TOKENS, "--block-tokens")                                                     \
    X(BUDGET, "--budget")                                                                 \
    X(KV_DTYPE, "--kv-dtype")                                                             \
    X(ACCUM, "--accum")                                                                   \
    X(CAPACITY, "--capacity")                                                             \
    X(REQUESTS, "--requests")                                                             \
    X(PROFILE, "--profile")                                                               \
    X(PROMPT_MEAN, "--prompt-mean")                                                       \
    X(OUTPUT_MEAN, "--output-mean")                                                       \
    X(SIGMA, "--sigma")                                                                   \
    X(ARRIVAL, "--arrival")                                                               \
    X(RATE, "--rate")                                                                     \
    X(TRACE, "--trace")                                                                   \
    X(SHARED_PREFIX, "--shared-prefix")                                                   \
    X(SAMPLES, "--samples")                                                               \
    X(SCHEDULE, "--schedule")                                                             \
    X(SESSION_TTL, "--session-ttl")                                                       \
    X(UPDATE_WEIGHTS_EVERY, "--update-weights-every")                                     \
    X(VERIFY, "--verify")                                                                 \
    X(WATERMARK, "--watermark")                                                           \
    X(RESERVE_TOKENS, "--reserve-tokens")                                                 \
    X(THREADS, "--threads")                                                               \
    X(SEED, "--seed")                                                                     \
    X(AUDIT_EVERY, "--audit-every")                                                       \
    X(PLOT, "--plot")

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

/* Ranges of the numeric flags (also printed by --help). */
#define MIN_CAPACITY 2           /* one prompt token and one generated token */
#define MAX_THREADS 4096         /* the decoder's limit */
#define MIN_RATE 0.001
#define MAX_RATE 1000000.0
#define MIN_SIGMA 0.05
#define MAX_SIGMA 4.0
#define MAX_POOL_PAGES 4294967294u /* pages are named by 32-bit ids (kvpager/pool.h) */
#define MAX_SAMPLES 256

typedef struct options {
    kvp_sim_config sim;
    kvp_workload_spec workload;
    const char *trace;
    const char *plot;
    const char *value[FLAG_COUNT_]; /* the text given for each flag, NULL if absent */
    int json;
    int quiet;
    int help;
    int allow_overcommit;
    int no_sharing;
} options;

static void simulate_usage(FILE *out)
{
    kvp_sim_config d;
    kvp_sim_config_init(&d);
    char budget[32];
    fprintf(out,
            "usage: kvpager simulate [options]\n\n"
            "Serves a stream of requests by continuous batching: many sequences, one cache\n"
            "per layer each, all drawing pages from one pool under one memory budget.\n"
            "Requests are admitted first come first served while pages allow (keeping a\n"
            "watermark free), every running sequence decodes one token per step with real\n"
            "attention, and when a step cannot get its pages the newest sequence is\n"
            "preempted by recompute. The report compares peak concurrency with the\n"
            "contiguous layout that reserves [B,H_kv,C,d_h] per layer up front.\n\n"
            "Every value is checked before anything runs: a bad one prints one line naming\n"
            "the option and the value, and exits 2. N is a whole number, X a decimal.\n\n"
            "model and pool:\n"
            "  --model NAME         a published geometry; --layers, --model-width, --heads\n"
            "                       and --kv-heads given as well override it. Head width\n"
            "                       128 in each: llama-3-8b (32 layers, D 4096, 32 heads,\n"
            "                       8 KV heads), llama-3-70b (80, 8192, 64, 8), qwen2.5-7b\n"
            "                       (28, 3584, 28, 4), mistral-7b (32, 4096, 32, 8). Weights\n"
            "                       are random f64; a computed run whose weights do not fit\n"
            "                       memory is refused (try --layers 2, or --no-compute)\n"
            "  --layers N           decoder layers, >= 1 (default %zu)\n"
            "  --model-width N      model width D, >= 1 (default %zu)\n"
            "  --heads N            attention heads, >= 1, dividing D (default %zu)\n"
            "  --kv-heads N         KV heads (grouped-query attention), >= 1, dividing\n"
            "                       --heads: each KV head serves heads / kv-heads query heads\n"
            "                       and pages store only the KV heads, so a token takes\n"
            "                       kv-heads / heads of the memory; 1 is multi-query\n"
            "                       (default: --heads, plain multi-head attention)\n"
            "  --block-tokens N     positions per page, >= 1 (default %zu)\n"
            "  --budget SIZE        pool budget: bytes, or a number with a unit B, KiB, MiB,\n"
            "                       GiB, TiB (1024-based) or KB, MB, GB, TB (1000-based),\n"
            "                       naming a whole byte count (1.5KiB yes, 1.5 no); at least\n"
            "                       one page (2 x block-tokens x D x element bytes, times\n"
            "                       kv-heads / heads) and at most physical memory\n"
            "                       (default %s)\n"
            "  --kv-dtype NAME      how pages store K and V: f64 (8 bytes), f32 (4), bf16 (2),\n"
            "                       f16 (2) or fp8_e4m3 (1; also \"fp8\", K/V scales 1),\n"
            "                       rounded once to nearest even when appended; the model\n"
            "                       still computes in f64. f64 is the default because it is\n"
            "                       exact: outputs equal the f64 reference bit for bit. The\n"
            "                       others fit 2x, 4x, 4x and 8x the tokens in the budget,\n"
            "                       within a measured error (DESIGN.md) (default f64)\n"
            "  --accum LEVEL        decode attention over narrow pages: exact (widened to\n"
            "                       f64, the reference's bits) or fast (f32 with FMA, in one\n"
            "                       fixed order; DESIGN.md's Accumulation levels); f64 pages\n"
            "                       are always exact; prefill is exact (default exact)\n"
            "  --allow-overcommit   accept a budget above physical memory\n"
            "  --capacity N         positions a sequence may hold, >= %d and >= the mean\n"
            "                       request (prompt mean + output mean) (default %zu)\n"
            "workload (generated; none of these may be given with --trace):\n"
            "  --requests N         number of requests, >= 1 (default 128)\n"
            "  --profile NAME       sharegpt (prompt ~161, output ~338, sigma 1.0),\n"
            "                       alpaca (~19, ~58, sigma 0.6), uniform (lengths uniform\n"
            "                       on [1, 2 x mean - 1]) or conversation (multi-turn chats,\n"
            "                       ShareGPT's 3.51 turns on average: each turn's prompt is\n"
            "                       the whole earlier conversation plus a new message of\n"
            "                       ~94 tokens, reply ~348, sigma 1.0; --requests counts\n"
            "                       turns; a first turn arrives by --arrival, each later\n"
            "                       turn is closed-loop: sent an exponential think time\n"
            "                       (mean 16 steps) after the turn before it finished, as a\n"
            "                       user reads the reply first, so it can reuse the reply's\n"
            "                       cached K/V) (default sharegpt)\n"
            "  --prompt-mean X      mean prompt tokens, 1 to capacity - 1 (default: the\n"
            "                       profile's)\n"
            "  --output-mean X      mean output tokens, 1 to capacity - 1 (default: the\n"
            "                       profile's)\n"
            "  --sigma X            lognormal shape of lengths, %.2f to %.0f; sharegpt and\n"
            "                       alpaca only (default: the profile's)\n"
            "  --arrival NAME       poisson, uniform or burst (default poisson)\n"
            "  --rate X             arrivals per scheduler step, %g to %.0f (default 1)\n"
            "  --trace FILE         read the requests from a CSV of\n"
            "                       arrival_step,prompt_tokens,output_tokens instead: an\n"
            "                       optional header and UTF-8 byte order mark, rows sorted\n"
            "                       by arrival, prompt >= 1, output >= 1, prompt + output\n"
            "                       <= capacity\n"
            "  --shared-prefix N    every prompt starts with the same N tokens (a system\n"
            "                       prompt: the same inputs at those positions), 0 to\n"
            "                       capacity - 2; generated workloads only (default 0)\n"
            "scheduling and run:\n"
            "  --samples N          continuations per request (parallel sampling), 1 to 256:\n"
            "                       one prompt, forked into N sequences that share its pages;\n"
            "                       each decodes the request's output tokens (default %zu)\n"
            "  --no-sharing         no fork and no prefix cache: every sample prefills its\n"
            "                       own copy of the prompt and nothing is looked up. When a\n"
            "                       sharing workload is given (--samples above 1,\n"
            "                       --shared-prefix above 0 or --profile conversation),\n"
            "                       the run is done twice, with sharing and then without,\n"
            "                       and the report puts concurrency, throughput and held\n"
            "                       pages side by side; with --no-sharing only the run\n"
            "                       without sharing is done\n"
            "  --schedule NAME      the order waiting requests are admitted in: fcfs (the\n"
            "                       queue's) or cache-aware (of the first 8 waiting, those\n"
            "                       with the most prompt blocks in the prefix cache first;\n"
            "                       preempted ones, and any overtaken in 8 steps, keep\n"
            "                       their place) (default fcfs)\n"
            "  --session-ttl N      conversation turns: steps a finished turn's sequence\n"
            "                       (its pages) is kept for the conversation's next turn,\n"
            "                       which goes to the front of the queue and adopts its\n"
            "                       blocks instead of finding them evicted. Kept pages\n"
            "                       count as held (at most half the pool) and go back\n"
            "                       first when running sequences need pages; 0 keeps\n"
            "                       none (default %zu)\n"
            "  --update-weights-every N\n"
            "                       between steps, every N steps, update every layer's\n"
            "                       parameters in place (a small seeded perturbation: a\n"
            "                       new revision). The scheduler recomputes the running\n"
            "                       requests and no cached block of the old weights can\n"
            "                       match: the report gives the prefix hit rate of each\n"
            "                       window between updates, and of its first step that\n"
            "                       admits prompt tokens (0%%). N >= 1; not with\n"
            "                       --no-compute (default: no updates)\n"
            "  --verify N           recompute requests 0, N, 2N, ... (each sample) from\n"
            "                       scratch when they finish, on a private pool with\n"
            "                       nothing shared, and compare every decoded output bit\n"
            "                       for bit (verified, verify_mismatches). Each token is\n"
            "                       recomputed under the weights it was decoded with: a\n"
            "                       run that spans weight updates is prefilled once per\n"
            "                       weight version (verify_segments), older versions\n"
            "                       regenerated from the seed. The run without sharing is\n"
            "                       not verified. N >= 1; not with --no-compute (default:\n"
            "                       no verification)\n"
            "  --watermark X        fraction of pages kept free at admission, >= 0 and < 1\n"
            "                       (default %.2f)\n"
            "  --reserve-tokens N   decoding reserve promised at admission, 0 to capacity\n"
            "                       (default %zu)\n"
            "  --threads N          decoder threads, 0 (one per core) to %d (default 0)\n"
            "  --seed N             seed of weights, lengths, arrivals, inputs, 0 to 2^64 - 1\n"
            "                       (default %llu)\n"
            "  --no-compute         allocator-only run: pages move, no attention math\n"
            "  --audit-every N      steps between pool audits, 0 = only the final audit\n"
            "                       (default %zu)\n"
            "output:\n"
            "  --json               print one JSON object instead of the report\n"
            "  --plot FILE.svg      draw pages in use, cached pages (held or evictable),\n"
            "                       evictable pages and running sequences per step; the\n"
            "                       file is opened and its first bytes written before the\n"
            "                       run, so an unwritable path is refused up front (exit 2;\n"
            "                       a write error after the run also exits 2)\n"
            "  --quiet              no progress line (it shows only on a terminal anyway)\n"
            "  --help, -h           show this help\n\n"
            "Sharing figures: prefix hit rate = prompt tokens adopted from the prefix cache\n"
            "over all prompt tokens admitted (recomputation included); pages saved = the sum\n"
            "over steps of the pages the running sequences would hold if nothing were\n"
            "shared, over the sum over steps of the pages held (1.00x: nothing saved);\n"
            "evictions and copy-on-write copies are the pool's counters.\n\n"
            "Sizes whose memory (pool, model, sequences) would exceed physical memory are\n"
            "refused with the size. A run that completes no request meets no target.\n"
            "exit status: 0 clean run, 1 audit failure or leaked pages, 2 bad input or an\n"
            "error (out of memory included).\n",
            d.layers, d.model_width, d.heads, d.block_tokens,
            kvp_cli_format_bytes(d.budget_bytes, budget, sizeof budget), MIN_CAPACITY,
            d.capacity, MIN_SIGMA, MAX_SIGMA, MIN_RATE, MAX_RATE, d.samples, d.session_ttl,
            d.watermark,
            d.reserve_tokens,
            MAX_THREADS, (unsigned long long)d.seed, d.audit_every);
}

static void invalid(kvp_cli_problems *p, flag f, const char *value, const char *why)
{
    kvp_cli_problem(p, "invalid value for %s: '%s': %s", flag_names[f], value, why);
}

static size_t *size_field(options *o, flag f)
{
    switch (f) {
    case FLAG_LAYERS: return &o->sim.layers;
    case FLAG_MODEL_WIDTH: return &o->sim.model_width;
    case FLAG_HEADS: return &o->sim.heads;
    case FLAG_KV_HEADS: return &o->sim.kv_heads;
    case FLAG_BLOCK_TOKENS: return &o->sim.block_tokens;
    case FLAG_CAPACITY: return &o->sim.capacity;
    case FLAG_REQUESTS: return &o->workload.requests;
    case FLAG_RESERVE_TOKENS: return &o->sim.reserve_tokens;
    case FLAG_THREADS: return &o->sim.threads;
    case FLAG_AUDIT_EVERY: return &o->sim.audit_every;
    case FLAG_SHARED_PREFIX: return &o->workload.shared_prefix;
    case FLAG_SAMPLES: return &o->sim.samples;
    case FLAG_UPDATE_WEIGHTS_EVERY: return &o->sim.update_every;
    case FLAG_VERIFY: return &o->sim.verify_every;
    case FLAG_SESSION_TTL: return &o->sim.session_ttl;
    default: return NULL;
    }
}

static double *real_field(options *o, flag f)
{
    switch (f) {
    case FLAG_PROMPT_MEAN: return &o->workload.prompt_mean;
    case FLAG_OUTPUT_MEAN: return &o->workload.output_mean;
    case FLAG_SIGMA: return &o->workload.sigma;
    case FLAG_RATE: return &o->workload.rate;
    case FLAG_WATERMARK: return &o->sim.watermark;
    default: return NULL;
    }
}

/* Published geometries (the models' config.json): what --model sets unless a flag says otherwise. */
typedef struct model_preset {
    const char *name;
    size_t layers, model_width, heads, kv_heads; /* head width = model_width / heads = 128 */
} model_preset;
static const model_preset presets[] = {
    {"llama-3-8b", 32, 4096, 32, 8},
    {"llama-3-70b", 80, 8192, 64, 8},
    {"qwen2.5-7b", 28, 3584, 28, 4},
    {"mistral-7b", 32, 4096, 32, 8},
};
#define PRESET_COUNT (sizeof presets / sizeof presets[0])

/* The preset named `value`, or NULL. */
static const model_preset *find_preset(const char *value)
{
    for (size_t i = 0; i < PRESET_COUNT; i++) {
        if (strcmp(value, presets[i].name) == 0) {
            return &presets[i];
        }
    }
    return NULL;
}

/* The preset's geometry, for the flags not given on the command line. */
static void apply_preset(options *o, const model_preset *m)
{
    const flag flags[] = {FLAG_LAYERS, FLAG_MODEL_WIDTH, FLAG_HEADS, FLAG_KV_HEADS};
    size_t *fields[] = {&o->sim.layers, &o->sim.model_width, &o->sim.heads, &o->sim.kv_heads};
    const size_t values[] = {m->layers, m->model_width, m->heads, m->kv_heads};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        if (o->value[flags[i]] == NULL) {
            *fields[i] = values[i];
        }
    }
}

/* "f64", "f32", "bf16", "f16" or "fp8_e4m3" (kvp_dtype_name's names), or "fp8": 0 and *out, or -1. */
static int parse_dtype(const char *value, kvp_dtype *out)
{
    static const kvp_dtype dtypes[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16, KVP_FP8_E4M3};
    if (strcmp(value, "fp8") == 0) {
        *out = KVP_FP8_E4M3;
        return 0;
    }
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
        if (strcmp(value, kvp_dtype_name(dtypes[i])) == 0) {
            *out = dtypes[i];
            return 0;
        }
    }
    return -1;
}

/* Reads one flag's value; its syntax only (ranges are checked later). */
static void parse_value(options *o, flag f, const char *value, kvp_cli_problems *p)
{
    size_t *size = size_field(o, f);
    double *real = real_field(o, f);
    size_t seed = 0;
    if (size != NULL) {
        if (kvp_cli_parse_size(value, size) != 0) {
            invalid(p, f, value, "not a whole number (digits only, below 2^64)");
        }
    } else if (real != NULL) {
        if (kvp_cli_parse_double(value, real) != 0) {
            invalid(p, f, value, "not a finite decimal number");
        }
    } else if (f == FLAG_SEED) {
        if (kvp_cli_parse_size(value, &seed) != 0) {
            invalid(p, f, value, "not a whole number (digits only, below 2^64)");
        }
        o->sim.seed = seed;
        o->workload.seed = seed;
    } else if (f == FLAG_BUDGET) {
        if (kvp_cli_parse_bytes(value, &o->sim.budget_bytes) != 0) {
            invalid(p, f, value,
                    "not a whole byte count (a number with an optional unit B, KiB, MiB, "
                    "GiB, TiB, KB, MB, GB or TB, below 2^64 bytes)");
        }
    } else if (f == FLAG_KV_DTYPE) {
        if (parse_dtype(value, &o->sim.kv_dtype) != 0) {
            invalid(p, f, value, "not a storage type (f64, f32, bf16, f16, fp8_e4m3 or fp8)");
        }
    } else if (f == FLAG_MODEL) {
        if (find_preset(value) == NULL) {
            invalid(p, f, value,
                    "not a model preset (llama-3-8b, llama-3-70b, qwen2.5-7b or mistral-7b)");
        }
    } else if (f == FLAG_ACCUM) {
        if (strcmp(value, "exact") == 0 || strcmp(value, "fast") == 0) {
            o->sim.accum = value[0] == 'f' ? KVP_ACCUM_FAST : KVP_ACCUM_EXACT;
        } else {
            invalid(p, f, value, "not an accumulation level (exact or fast)");
        }
    } else if (f == FLAG_PROFILE) {
        if (kvp_profile_parse(value, &o->workload.profile) != 0) {
            invalid(p, f, value, "not a profile (sharegpt, alpaca, uniform or conversation)");
        }
    } else if (f == FLAG_ARRIVAL) {
        if (kvp_arrival_parse(value, &o->workload.arrival) != 0) {
            invalid(p, f, value, "not an arrival process (poisson, uniform or burst)");
        }
    } else if (f == FLAG_SCHEDULE) {
        if (strcmp(value, "fcfs") == 0) {
            o->sim.schedule = KVP_SCHEDULE_FCFS;
        } else if (strcmp(value, "cache-aware") == 0) {
            o->sim.schedule = KVP_SCHEDULE_CACHE_AWARE;
        } else {
            invalid(p, f, value, "not a schedule (fcfs or cache-aware)");
        }
    } else if (f == FLAG_TRACE) {
        o->trace = value;
    } else {
        o->plot = value;
    }
}

static void defaults(options *o)
{
    memset(o, 0, sizeof *o);
    kvp_sim_config_init(&o->sim);
    o->workload.profile = KVP_PROFILE_SHAREGPT;
    o->workload.arrival = KVP_ARRIVAL_POISSON;
    o->workload.rate = 1.0;
    o->workload.requests = 128;
    o->workload.seed = o->sim.seed;
}

/* Step 1: reads the whole command line; remembers the first problem. */
static void parse_options(int argc, char **argv, options *o, kvp_cli_problems *p)
{
    defaults(o);
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            o->help = 1;
            continue;
        }
        if (strcmp(arg, "--json") == 0) {
            o->json = 1;
            continue;
        }
        if (strcmp(arg, "--quiet") == 0) {
            o->quiet = 1;
            continue;
        }
        if (strcmp(arg, "--no-compute") == 0) {
            o->sim.compute = 0;
            continue;
        }
        if (strcmp(arg, "--allow-overcommit") == 0) {
            o->allow_overcommit = 1;
            continue;
        }
        if (strcmp(arg, "--no-sharing") == 0) {
            o->no_sharing = 1;
            o->sim.sharing = 0;
            continue;
        }
        int f = kvp_cli_take_flag(argc, argv, &i, "simulate", flag_names, FLAG_COUNT_, o->value,
                                  p);
        if (f >= 0) {
            parse_value(o, (flag)f, o->value[f], p);
        }
    }
    const model_preset *m = o->value[FLAG_MODEL] != NULL ? find_preset(o->value[FLAG_MODEL]) : NULL;
    if (m != NULL) {
        apply_preset(o, m);
    }
}

/* The text of a flag for messages: what was given, or "<default>" rendering. */
static const char *shown(const options *o, flag f, char *buf, size_t size, size_t fallback)
{
    if (o->value[f] != NULL) {
        return o->value[f];
    }
    snprintf(buf, size, "%zu", fallback);
    return buf;
}

/* Step 2a: each flag on its own, then flags that depend on each other. */
static void check_ranges(options *o, kvp_cli_problems *p)
{
    const kvp_sim_config *c = &o->sim;
    static const flag generated_only[] = {FLAG_PROFILE, FLAG_REQUESTS, FLAG_PROMPT_MEAN,
                                          FLAG_OUTPUT_MEAN, FLAG_SIGMA, FLAG_ARRIVAL,
                                          FLAG_RATE, FLAG_SHARED_PREFIX};
    if (o->trace != NULL) {
        for (size_t i = 0; i < sizeof generated_only / sizeof generated_only[0]; i++) {
            flag f = generated_only[i];
            if (o->value[f] != NULL) {
                kvp_cli_problem(p, "%s %s conflicts with --trace %s: the trace gives every request",
                        flag_names[f], o->value[f], o->trace);
            }
        }
    }
    static const flag at_least_one[] = {FLAG_LAYERS, FLAG_MODEL_WIDTH, FLAG_HEADS,
                                        FLAG_BLOCK_TOKENS, FLAG_REQUESTS};
    for (size_t i = 0; i < sizeof at_least_one / sizeof at_least_one[0]; i++) {
        flag f = at_least_one[i];
        if (*size_field(o, f) == 0) {
            invalid(p, f, o->value[f], "must be at least 1");
        }
    }
    if (c->capacity < MIN_CAPACITY) {
        invalid(p, FLAG_CAPACITY, o->value[FLAG_CAPACITY],
                "must be at least 2 (one prompt token and one generated token)");
    }
    if (c->heads > 0 && c->model_width % c->heads != 0) {
        char other[32];
        if (o->value[FLAG_HEADS] != NULL) {
            kvp_cli_problem(p, "invalid value for --heads: '%s': must divide --model-width %s",
                    o->value[FLAG_HEADS],
                    shown(o, FLAG_MODEL_WIDTH, other, sizeof other, c->model_width));
        } else {
            kvp_cli_problem(p, "invalid value for --model-width: '%s': must be a multiple of --heads %s",
                    o->value[FLAG_MODEL_WIDTH],
                    shown(o, FLAG_HEADS, other, sizeof other, c->heads));
        }
    }
    /* After the width check, as the library orders them. */
    if (o->value[FLAG_KV_HEADS] != NULL) {
        char heads[32];
        if (c->kv_heads == 0) {
            invalid(p, FLAG_KV_HEADS, o->value[FLAG_KV_HEADS], "must be at least 1");
        } else if (c->heads > 0 && c->heads % c->kv_heads != 0) {
            kvp_cli_problem(p, "invalid value for --kv-heads: '%s': must divide --heads %s",
                            o->value[FLAG_KV_HEADS],
                            shown(o, FLAG_HEADS, heads, sizeof heads, c->heads));
        }
    }
    if (o->value[FLAG_RATE] != NULL && !(o->workload.rate >= MIN_RATE && o->workload.rate <= MAX_RATE)) {
        invalid(p, FLAG_RATE, o->value[FLAG_RATE], "must be from 0.001 to 1000000 arrivals per step");
    }
    if (!(c->watermark >= 0.0 && c->watermark < 1.0)) {
        invalid(p, FLAG_WATERMARK, o->value[FLAG_WATERMARK], "must be at least 0 and below 1");
    }
    if (c->samples < 1 || c->samples > MAX_SAMPLES) {
        invalid(p, FLAG_SAMPLES, o->value[FLAG_SAMPLES], "must be from 1 to 256");
    }
    static const flag computed_only[] = {FLAG_UPDATE_WEIGHTS_EVERY, FLAG_VERIFY};
    for (size_t i = 0; i < 2; i++) {
        flag f = computed_only[i];
        if (o->value[f] == NULL) {
            continue;
        }
        if (*size_field(o, f) == 0) {
            invalid(p, f, o->value[f], "must be at least 1 (leave it out for none)");
        } else if (!c->compute) {
            kvp_cli_problem(p, "%s %s needs real attention: it cannot be given with --no-compute",
                            flag_names[f], o->value[f]);
        }
    }
    if (o->value[FLAG_SHARED_PREFIX] != NULL && c->capacity >= MIN_CAPACITY &&
        o->workload.shared_prefix > c->capacity - MIN_CAPACITY) {
        char capacity[32];
        kvp_cli_problem(p,
                        "invalid value for --shared-prefix: '%s': must be from 0 to %zu "
                        "(--capacity %s less one prompt token and one generated token)",
                        o->value[FLAG_SHARED_PREFIX], c->capacity - MIN_CAPACITY,
                        shown(o, FLAG_CAPACITY, capacity, sizeof capacity, c->capacity));
    }
    if (c->threads > MAX_THREADS) {
        invalid(p, FLAG_THREADS, o->value[FLAG_THREADS], "must be from 0 (one per core) to 4096");
    }
    if (o->value[FLAG_RESERVE_TOKENS] != NULL && c->capacity >= MIN_CAPACITY &&
        c->reserve_tokens > c->capacity) {
        char capacity[32];
        kvp_cli_problem(p, "invalid value for --reserve-tokens: '%s': must be from 0 to --capacity %s",
                o->value[FLAG_RESERVE_TOKENS],
                shown(o, FLAG_CAPACITY, capacity, sizeof capacity, c->capacity));
    }
    static const flag means[] = {FLAG_PROMPT_MEAN, FLAG_OUTPUT_MEAN};
    for (size_t i = 0; i < 2 && c->capacity >= MIN_CAPACITY; i++) {
        double *mean = real_field(o, means[i]);
        if (o->value[means[i]] != NULL && !(*mean >= 1.0 && *mean <= (double)(c->capacity - 1))) {
            char capacity[32];
            kvp_cli_problem(p, "invalid value for %s: '%s': must be from 1 to %zu (--capacity %s less "
                       "one token)",
                    flag_names[means[i]], o->value[means[i]], c->capacity - 1,
                    shown(o, FLAG_CAPACITY, capacity, sizeof capacity, c->capacity));
        }
    }
    if (o->value[FLAG_SIGMA] != NULL) {
        if (!(o->workload.sigma >= MIN_SIGMA && o->workload.sigma <= MAX_SIGMA)) {
            invalid(p, FLAG_SIGMA, o->value[FLAG_SIGMA], "must be from 0.05 to 4");
        } else if (o->workload.profile == KVP_PROFILE_UNIFORM) {
            kvp_cli_problem(p, "--sigma %s has no effect with --profile uniform (lognormal profiles only)",
                    o->value[FLAG_SIGMA]);
        }
    }
}

/* Step 2b: sizes derived from several flags, all overflow-checked. */
static void check_sizes(options *o, kvp_cli_problems *p, size_t *page_bytes)
{
    const kvp_sim_config *c = &o->sim;
    char buf[3][32];
    /*
     * A page holds keys and values of the KV heads: 2 x block_tokens x
     * kv_width elements of the --kv-dtype, kv_width = kv_heads x d_h (D
     * itself without --kv-heads).
     */
    size_t element = kvp_dtype_bytes(c->kv_dtype);
    size_t kv_width = c->model_width / c->heads * kvp_sim_kv_heads(c);
    size_t bytes = 0;
    if (kvp_cli_mul(2 * element, c->block_tokens, &bytes) != 0 ||
        kvp_cli_mul(bytes, kv_width, &bytes) != 0) {
        kvp_cli_problem(p, "invalid value for --block-tokens: '%s': a page of 2 x %zu positions x "
                   "--model-width %s x %zu bytes overflows",
                shown(o, FLAG_BLOCK_TOKENS, buf[0], sizeof buf[0], c->block_tokens),
                c->block_tokens, shown(o, FLAG_MODEL_WIDTH, buf[1], sizeof buf[1], c->model_width),
                element);
        return;
    }
    *page_bytes = bytes;
    if (c->budget_bytes < bytes && kv_width != c->model_width) {
        kvp_cli_problem(p, "invalid value for --budget: '%s': below one page of %s (2 x --block-tokens "
                   "%zu x --kv-heads %zu x head width %zu x %zu bytes of %s)",
                o->value[FLAG_BUDGET] ? o->value[FLAG_BUDGET] : "32MiB",
                kvp_cli_format_bytes(bytes, buf[0], sizeof buf[0]), c->block_tokens,
                kvp_sim_kv_heads(c), c->model_width / c->heads, element,
                kvp_dtype_name(c->kv_dtype));
    } else if (c->budget_bytes < bytes) {
        kvp_cli_problem(p, "invalid value for --budget: '%s': below one page of %s (2 x --block-tokens "
                   "%zu x --model-width %zu x %zu bytes of %s)",
                o->value[FLAG_BUDGET] ? o->value[FLAG_BUDGET] : "32MiB",
                kvp_cli_format_bytes(bytes, buf[0], sizeof buf[0]), c->block_tokens,
                c->model_width, element, kvp_dtype_name(c->kv_dtype));
    } else if (c->budget_bytes / bytes > MAX_POOL_PAGES) {
        kvp_cli_problem(p, "invalid value for --budget: '%s': %zu pages of %s, more than the pool's "
                   "%u (32-bit page ids)",
                o->value[FLAG_BUDGET], c->budget_bytes / bytes,
                kvp_cli_format_bytes(bytes, buf[0], sizeof buf[0]), MAX_POOL_PAGES);
    }
}

/* Step 2c: the mean request of a generated workload must fit a sequence. */
static void check_workload(options *o, kvp_cli_problems *p)
{
    if (o->trace != NULL || p->found) {
        return;
    }
    o->workload.capacity = o->sim.capacity;
    kvp_workload_spec_defaults(&o->workload);
    double mean = o->workload.prompt_mean + o->workload.output_mean;
    size_t shared = o->workload.shared_prefix;
    if (shared > 0 && (double)shared + mean > (double)o->sim.capacity) {
        char capacity[32];
        kvp_cli_problem(p, "invalid value for --shared-prefix: '%s': with the mean request of %.0f "
                        "tokens (prompt mean %g + output mean %g) it exceeds --capacity %s",
                        o->value[FLAG_SHARED_PREFIX], mean, o->workload.prompt_mean,
                        o->workload.output_mean,
                        shown(o, FLAG_CAPACITY, capacity, sizeof capacity, o->sim.capacity));
    } else if (mean > (double)o->sim.capacity) {
        char capacity[32];
        kvp_cli_problem(p, "invalid value for --capacity: '%s': below the mean request of %.0f tokens "
                   "(prompt mean %g + output mean %g)",
                shown(o, FLAG_CAPACITY, capacity, sizeof capacity, o->sim.capacity), mean,
                o->workload.prompt_mean, o->workload.output_mean);
    }
}

/*
 * No output may name an input: --plot over the --trace file would replace
 * the trace with the chart. The same file by device and inode, or by
 * resolved path when one does not exist yet (kvp_cli_same_file).
 */
static void check_outputs(const options *o, kvp_cli_problems *p)
{
    if (p->found || o->plot == NULL || o->trace == NULL) {
        return;
    }
    if (kvp_cli_same_file(o->plot, o->trace)) {
        kvp_cli_problem(p, "invalid value for --plot: '%s': it names the input file of --trace %s, "
                        "which the plot would overwrite",
                        o->plot, o->trace);
    }
}

/* Checked a * b and a + b that latch *overflow (then the result is SIZE_MAX). */
static size_t mul(size_t a, size_t b, int *overflow)
{
    size_t out = 0;
    *overflow |= kvp_cli_mul(a, b, &out) != 0;
    return out;
}

static size_t add(size_t a, size_t b, int *overflow)
{
    size_t out = 0;
    *overflow |= kvp_cli_add(a, b, &out) != 0;
    return out;
}

/* A size flag's value, for messages about flags left at their defaults. */
static size_t flag_value(const options *o, flag f, size_t requests)
{
    switch (f) {
    case FLAG_MODEL_WIDTH: return o->sim.model_width;
    case FLAG_LAYERS: return o->sim.layers;
    case FLAG_CAPACITY: return o->sim.capacity;
    case FLAG_REQUESTS: return requests;
    default: return o->sim.budget_bytes;
    }
}

/* One part of the run's memory, and the flag that sets it. */
typedef struct memory_part {
    const char *what;
    flag flag;
    flag other; /* the other flag it grows with, or FLAG_COUNT_ */
    size_t bytes;
} memory_part;

/*
 * Step 2d: what the run will hold at most, against physical memory. The parts
 * are the library's own sizes: the page slab (the budget) and its metadata
 * (12 bytes per page); the model (4 D x D parameters per layer, plus one
 * more while a layer is made, and RoPE tables); per sequence, one ticket per
 * layer (5 D + heads x capacity doubles), page tables and activations; the
 * prompt buffer, which holds the prompts admitted in one step (at most what
 * the pool can hold, pages x block-tokens / layers positions, and at least
 * capacity) of D doubles each; the request list. At most min(requests,
 * pages / layers) sequences exist at once, since each holds a page per layer.
 * With --verify, its own model, pool, buffers and kept outputs (verify.h).
 */
/* The largest RoPE cos/sin table a layer keeps (the library's cap). */
#define ROPE_TABLE_CAP_BYTES ((size_t)4 << 20)

static void check_memory(options *o, size_t requests, size_t page_bytes, kvp_cli_problems *p)
{
    const kvp_sim_config *c = &o->sim;
    size_t physical = kvp_cli_physical_memory();
    char buf[4][32];
    if (p->found || physical == 0) {
        return;
    }
    if (c->budget_bytes > physical && !o->allow_overcommit) {
        kvp_cli_problem(p, "invalid value for --budget: '%s': %s is more than the %s of physical memory "
                   "(add --allow-overcommit to run anyway)",
                o->value[FLAG_BUDGET], kvp_cli_format_bytes(c->budget_bytes, buf[0], sizeof buf[0]),
                kvp_cli_format_bytes(physical, buf[1], sizeof buf[1]));
        return;
    }
    size_t pages = c->budget_bytes / page_bytes;
    size_t d = c->model_width;
    size_t blocks = c->capacity / c->block_tokens + 1;
    size_t sequences = pages / c->layers;
    sequences = sequences < requests ? sequences : requests;
    sequences = sequences > 0 ? sequences : 1;
    int overflow = 0;
    /* model: (4 L + 1) D^2 doubles, and each layer's RoPE table of capacity x d_h
     * doubles (the library caps one at 4 MiB), twice while the model is made */
    size_t model = mul(add(mul(4, c->layers, &overflow), 1, &overflow),
                       mul(mul(d, d, &overflow), sizeof(double), &overflow), &overflow);
    size_t rope = mul(mul(c->capacity, d / c->heads, &overflow), sizeof(double), &overflow);
    rope = overflow || rope > ROPE_TABLE_CAP_BYTES ? ROPE_TABLE_CAP_BYTES : rope;
    model = add(model, mul(mul(2, c->layers, &overflow), rope, &overflow), &overflow);
    /* per layer of a sequence: a ticket of 5 D + heads x capacity doubles, page tables */
    size_t ticket = mul(add(mul(c->heads, c->capacity, &overflow), mul(5, d, &overflow),
                            &overflow),
                        sizeof(double), &overflow);
    ticket = add(ticket, add(mul(2 * sizeof(uint32_t), blocks, &overflow), 512, &overflow),
                 &overflow);
    /* per sequence: its layers, activations and token buffers of (L + 4) D doubles */
    size_t per_sequence = add(mul(ticket, c->layers, &overflow),
                              mul(mul(add(c->layers, 4, &overflow), d, &overflow),
                                  sizeof(double), &overflow),
                              &overflow);
    per_sequence = mul(per_sequence, sequences, &overflow);
    size_t prompt_rows = mul(pages, c->block_tokens, &overflow) / c->layers;
    prompt_rows = prompt_rows > c->capacity ? prompt_rows : c->capacity;
    size_t prompt = mul(mul(prompt_rows, d, &overflow), sizeof(double), &overflow);
    size_t list = mul(requests, sizeof(kvp_workload_request) + 7 * sizeof(size_t), &overflow);
    size_t metadata = mul(pages, 3 * sizeof(uint32_t), &overflow);
    memory_part parts[] = {
        {"the pool", FLAG_BUDGET, FLAG_COUNT_,
         o->allow_overcommit ? metadata : add(c->budget_bytes, metadata, &overflow)},
        {"the model", FLAG_MODEL_WIDTH, FLAG_LAYERS, model},
        {"the sequences", FLAG_CAPACITY, FLAG_LAYERS, per_sequence},
        {"the prompt buffer", FLAG_CAPACITY, FLAG_MODEL_WIDTH, c->compute ? prompt : 0},
        {"the request list", FLAG_REQUESTS, FLAG_COUNT_, list},
        {"the verification", FLAG_VERIFY, FLAG_CAPACITY,
         kvp_sim_verify_bytes(c, requests, page_bytes, model, &overflow)},
    };
    size_t total = 0;
    size_t largest = 0;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        total = add(total, parts[i].bytes, &overflow);
        largest = parts[i].bytes > parts[largest].bytes ? i : largest;
    }
    if (!overflow && total <= physical) {
        return;
    }
    const memory_part *big = &parts[largest];
    /* Name the flag the user gave: of the part's two, the given one (the first if both). */
    flag named = big->flag;
    flag other = big->other;
    if (o->value[named] == NULL && other != FLAG_COUNT_ && o->value[other] != NULL) {
        named = big->other;
        other = big->flag;
    }
    char given[2][32];
    const char *value = shown(o, named, given[0], sizeof given[0], flag_value(o, named, requests));
    if (o->value[named] == NULL && o->value[FLAG_MODEL] != NULL &&
        (named == FLAG_MODEL_WIDTH || named == FLAG_LAYERS)) {
        value = o->value[FLAG_MODEL]; /* the preset set it: name what the user typed */
        named = FLAG_MODEL;
    }
    char with[96] = "";
    if (other != FLAG_COUNT_) {
        snprintf(with, sizeof with, " with %s %s", flag_names[other],
                 shown(o, other, given[1], sizeof given[1], flag_value(o, other, requests)));
    }
    if (overflow) {
        kvp_cli_problem(p, "invalid value for %s: '%s': the memory for %s%s overflows a 64-bit size",
                flag_names[named], value, big->what, with);
        return;
    }
    kvp_cli_problem(p, "invalid value for %s: '%s': the run would need %s (%s %s%s), more than the %s "
               "of physical memory",
            flag_names[named], value, kvp_cli_format_bytes(total, buf[0], sizeof buf[0]),
            big->what, kvp_cli_format_bytes(big->bytes, buf[1], sizeof buf[1]), with,
            kvp_cli_format_bytes(physical, buf[2], sizeof buf[2]));
}

/* The level decode attention ran at: f64 pages are always exact. */
static const char *accum_name(const kvp_sim_config *c)
{
    return c->accum == KVP_ACCUM_FAST && c->kv_dtype != KVP_F64 ? "fast" : "exact";
}

static double mean_of(const kvp_workload *w, int prompt)
{
    double sum = 0.0;
    for (size_t i = 0; i < w->count; i++) {
        sum += (double)(prompt ? w->requests[i].prompt_tokens : w->requests[i].output_tokens);
    }
    return w->count > 0 ? sum / (double)w->count : 0.0;
}

/*
 * The targets of the sharegpt profile at the default budget. A run that
 * completed no request meets none: its ratio and fragmentation say nothing.
 */
static int ratio_met(const kvp_sim_result *r)
{
    return r->requests_completed > 0 && r->concurrency_ratio >= 3.0;
}

static int fragmentation_met(const kvp_sim_result *r)
{
    return r->requests_completed > 0 && r->internal_fragmentation < 0.05;
}

static int targets_met(const kvp_sim_result *r)
{
    return ratio_met(r) && fragmentation_met(r) && r->pages_leaked == 0 &&
           r->audit_failures == 0;
}

/* full_sequences / f64_full_sequences (1 when f64 holds none: no gain is measurable). */
static double dtype_gain(const kvp_sim_result *r)
{
    return r->f64_full_sequences > 0
               ? (double)r->full_sequences / (double)r->f64_full_sequences
               : 1.0;
}

/* K and V of one position in every layer: 2 x layers x kv_heads x d_h elements of the dtype. */
static size_t kv_bytes_per_token(const kvp_sim_config *c)
{
    return 2 * kvp_dtype_bytes(c->kv_dtype) * c->layers * kvp_sim_kv_heads(c) *
           (c->model_width / c->heads);
}

/* --samples above 1, --shared-prefix above 0 or --profile conversation. */
static int sharing_workload(const options *o)
{
    return o->sim.samples > 1 ||
           (o->trace == NULL && (o->workload.shared_prefix > 0 ||
                                 o->workload.profile == KVP_PROFILE_CONVERSATION));
}

/* a / b as a ratio, NaN (JSON null, "-" in the report) when b is 0. */
static double ratio(double a, double b)
{
    return b > 0.0 ? a / b : NAN;
}

static double window_rate(uint64_t hits, uint64_t prompt)
{
    return ratio((double)hits, (double)prompt);
}

static void print_ratio(const char *label, double on, double off, int decimals)
{
    char a[32];
    char b[32];
    snprintf(a, sizeof a, "%.*f", decimals, on);
    snprintf(b, sizeof b, "%.*f", decimals, off);
    double x = ratio(on, off);
    if (isnan(x)) {
        printf("  %-22s%-14s%-14s-\n", label, a, b);
    } else {
        printf("  %-22s%-14s%-14s%.2fx\n", label, a, b, x);
    }
}

/* The sharing figures, the weight updates, verification and the run without sharing. */
static void print_sharing(const options *o, const kvp_sim_result *r, const kvp_sim_result *off)
{
    const kvp_sim_config *c = &o->sim;
    printf("sharing                 %s: prefix hits %llu of %llu prompt tokens (%.1f%%), "
           "%llu forks\n",
           c->sharing ? "on" : "off (--no-sharing)", (unsigned long long)r->prefix_hit_tokens,
           (unsigned long long)r->prompt_tokens, 100.0 * r->prefix_hit_rate,
           (unsigned long long)r->forks);
    printf("pages saved             %.2fx (pages the sequences would hold unshared, over pages "
           "held);\n"
           "                        evictions %llu, copy-on-write copies %llu\n",
           r->pages_saved_ratio, (unsigned long long)r->evictions,
           (unsigned long long)r->cow_copies);
    if (c->update_every != 0) {
        printf("weight updates          %zu (every %zu steps), %llu sequences preempted as stale\n",
               r->weight_updates, c->update_every, (unsigned long long)r->stale_preemptions);
        for (size_t i = 0; i < r->window_count; i++) {
            const kvp_sim_window *w = &r->windows[i];
            double rate = window_rate(w->prefix_hit_tokens, w->prompt_tokens);
            printf("  from step %-8zu hit rate %5.1f%% of %llu prompt tokens", w->step,
                   100.0 * (isnan(rate) ? 0.0 : rate), (unsigned long long)w->prompt_tokens);
            if (w->first_step != SIZE_MAX) {
                printf("; its first admitting step %zu: %.1f%%", w->first_step,
                       100.0 * window_rate(w->first_hit_tokens, w->first_prompt_tokens));
            }
            printf("\n");
        }
    }
    if (r->later_turns > 0) {
        printf("conversation turns      %zu later turns sent closed-loop: each at least %zu "
               "step%s after\n"
               "                        the turn before it finished\n",
               r->later_turns, r->turn_gap_min, r->turn_gap_min == 1 ? "" : "s");
        printf("sessions                %llu finished turns kept up to %zu steps "
               "(--session-ttl): %llu next turns\n"
               "                        admitted while kept, %llu given back unused "
               "(expired, or pages needed)\n",
               (unsigned long long)r->session_keeps, c->session_ttl,
               (unsigned long long)r->session_hits, (unsigned long long)r->session_drops);
    }
    if (c->verify_every != 0) {
        printf("verify                  %zu sample sequences recomputed from scratch (requests "
               "0, %zu, %zu, ...): %zu mismatches;\n"
               "                        %zu prefills, one per weight version a sequence "
               "decoded under; %zu skipped\n",
               r->verified, c->verify_every, 2 * c->verify_every, r->verify_mismatches,
               r->verify_segments, r->verify_skipped);
    }
    if (off != NULL) {
        printf("side by side            %-14s%-14sratio\n", "sharing", "--no-sharing");
        print_ratio("concurrent peak", (double)r->peak_concurrent,
                    (double)off->peak_concurrent, 0);
        print_ratio("concurrent mean", r->mean_concurrent, off->mean_concurrent, 1);
        print_ratio("throughput (tok/s)", r->tokens_per_second, off->tokens_per_second,
                    1);
        print_ratio("held pages peak", (double)r->peak_held_pages,
                    (double)off->peak_held_pages, 0);
        print_ratio("held pages mean", r->mean_held_pages, off->mean_held_pages, 1);
        print_ratio("prefill tokens", (double)r->prefill_tokens, (double)off->prefill_tokens,
                    0);
        print_ratio("steps", (double)r->steps, (double)off->steps, 0);
        print_ratio("preemptions", (double)r->preemptions, (double)off->preemptions, 0);
    }
}

static void print_report(const options *o, const kvp_workload *w, const kvp_sim_result *r,
                         const kvp_sim_result *off)
{
    const kvp_sim_config *c = &o->sim;
    char budget[32];
    char page[32];
    printf("kvpager simulate: %s, %zu requests (mean prompt %.1f, mean output %.1f tokens)\n",
           o->trace ? o->trace : kvp_profile_name(o->workload.profile), w->count,
           mean_of(w, 1), mean_of(w, 0));
    char per_token[32];
    printf("model: %zu layers, width %zu, %zu heads, %zu KV heads (%s of K/V per token); "
           "pool: %s budget = %zu pages of %s "
           "(%zu positions, kv_dtype %s, %s attention); capacity %zu; %zu thread%s%s\n\n",
           c->layers, c->model_width, c->heads, kvp_sim_kv_heads(c),
           kvp_cli_format_bytes(kv_bytes_per_token(c), per_token, sizeof per_token),
           kvp_cli_format_bytes(c->budget_bytes, budget, sizeof budget), r->total_pages,
           kvp_cli_format_bytes(r->page_bytes, page, sizeof page), c->block_tokens,
           kvp_dtype_name(r->kv_dtype), accum_name(c), c->capacity, r->threads, r->threads == 1 ? "" : "s",
           c->compute ? "" : ", allocator only");
    printf("requests completed      %zu of %zu (%zu rejected as never fitting)\n",
           r->requests_completed, r->requests, r->requests_rejected);
    printf("tokens generated        %llu (plus %llu prompt tokens prefilled)\n",
           (unsigned long long)r->tokens_generated, (unsigned long long)r->prefill_tokens);
    printf("throughput              %.1f generated tokens/s over %.2f s\n", r->tokens_per_second,
           r->seconds);
    printf("steps                   %zu\n", r->steps);
    printf("concurrent sequences    peak %zu, mean %.1f\n", r->peak_concurrent,
           r->mean_concurrent);
    printf("pool utilization        peak %.1f%%, mean %.1f%%\n", 100.0 * r->peak_utilization,
           100.0 * r->mean_utilization);
    printf("internal fragmentation  %.2f%% of held slots\n", 100.0 * r->internal_fragmentation);
    printf("preemptions             %zu\n", r->preemptions);
    print_sharing(o, r, off);
    if (r->contiguous_baseline > 0) {
        printf("contiguous baseline     %zu sequences fit when each reserves its full capacity;\n"
               "                        paging held %zu at peak: %.2fx\n",
               r->contiguous_baseline, r->peak_concurrent, r->concurrency_ratio);
    } else {
        printf("contiguous baseline     0 sequences: one full-capacity reservation exceeds the "
               "budget\n");
    }
    printf("kv dtype                %s, %zu bytes per element: the pages hold %zu full-capacity "
           "sequences,\n"
           "                        %zu in f64 pages of the same budget: %+lld (%.2fx)\n",
           kvp_dtype_name(r->kv_dtype), r->element_bytes, r->full_sequences,
           r->f64_full_sequences,
           (long long)r->full_sequences - (long long)r->f64_full_sequences, dtype_gain(r));
    printf("final audit             %s: %zu of %zu audits failed, %zu pages leaked, "
           "acquires %llu, releases %llu\n",
           r->audit_failures == 0 && r->pages_leaked == 0 ? "ok" : "FAILED", r->audit_failures,
           r->audits, r->pages_leaked, (unsigned long long)r->acquires,
           (unsigned long long)r->releases);
    if (o->trace == NULL && o->workload.profile == KVP_PROFILE_SHAREGPT) {
        printf("sharegpt targets        concurrency ratio >= 3: %s, fragmentation < 5%%: %s, "
               "no leaks: %s, clean audits: %s\n",
               ratio_met(r) ? "yes" : "no", fragmentation_met(r) ? "yes" : "no",
               r->pages_leaked == 0 ? "yes" : "no", r->audit_failures == 0 ? "yes" : "no");
    }
}

/* The sharing keys of --json (print_sharing's figures). */
static void json_sharing(kvp_json *json, const kvp_sim_result *r, const kvp_sim_result *off)
{
    kvp_json_uint(json, "prompt_tokens", r->prompt_tokens);
    kvp_json_uint(json, "prefix_hit_tokens", r->prefix_hit_tokens);
    kvp_json_double(json, "prefix_hit_rate", r->prefix_hit_rate);
    kvp_json_double(json, "pages_saved_ratio", r->pages_saved_ratio);
    kvp_json_uint(json, "peak_held_pages", r->peak_held_pages);
    kvp_json_double(json, "mean_held_pages", r->mean_held_pages);
    kvp_json_uint(json, "forks", r->forks);
    kvp_json_uint(json, "evictions", r->evictions);
    kvp_json_uint(json, "cow_copies", r->cow_copies);
    kvp_json_uint(json, "weight_updates", r->weight_updates);
    kvp_json_uint(json, "stale_preemptions", r->stale_preemptions);
    kvp_json_array_begin(json, "update_windows");
    for (size_t i = 0; i < r->window_count; i++) {
        const kvp_sim_window *w = &r->windows[i];
        kvp_json_object_begin(json, NULL);
        kvp_json_uint(json, "step", w->step);
        kvp_json_uint(json, "prompt_tokens", w->prompt_tokens);
        kvp_json_uint(json, "prefix_hit_tokens", w->prefix_hit_tokens);
        kvp_json_double(json, "hit_rate", window_rate(w->prefix_hit_tokens, w->prompt_tokens));
        kvp_json_double(json, "first_step", w->first_step == SIZE_MAX ? NAN
                                                                     : (double)w->first_step);
        kvp_json_double(json, "first_step_hit_rate",
                        window_rate(w->first_hit_tokens, w->first_prompt_tokens));
        kvp_json_object_end(json);
    }
    kvp_json_array_end(json);
    kvp_json_uint(json, "verified", r->verified);
    kvp_json_uint(json, "verify_mismatches", r->verify_mismatches);
    kvp_json_uint(json, "verify_segments", r->verify_segments);
    kvp_json_uint(json, "verify_skipped", r->verify_skipped);
    kvp_json_uint(json, "later_turns", r->later_turns);
    kvp_json_double(json, "turn_gap_min", r->later_turns > 0 ? (double)r->turn_gap_min : NAN);
    kvp_json_uint(json, "session_keeps", r->session_keeps);
    kvp_json_uint(json, "session_hits", r->session_hits);
    kvp_json_uint(json, "session_drops", r->session_drops);
    if (off == NULL) {
        kvp_json_double(json, "sharing_concurrency_ratio", NAN);
        kvp_json_double(json, "no_sharing", NAN);
        return;
    }
    kvp_json_double(json, "sharing_concurrency_ratio",
                    ratio((double)r->peak_concurrent, (double)off->peak_concurrent));
    kvp_json_object_begin(json, "no_sharing");
    kvp_json_uint(json, "requests_completed", off->requests_completed);
    kvp_json_uint(json, "tokens_generated", off->tokens_generated);
    kvp_json_uint(json, "prefill_tokens", off->prefill_tokens);
    kvp_json_double(json, "tokens_per_second", off->tokens_per_second);
    kvp_json_uint(json, "steps", off->steps);
    kvp_json_uint(json, "peak_concurrent_sequences", off->peak_concurrent);
    kvp_json_double(json, "mean_concurrent_sequences", off->mean_concurrent);
    kvp_json_uint(json, "peak_held_pages", off->peak_held_pages);
    kvp_json_double(json, "mean_held_pages", off->mean_held_pages);
    kvp_json_uint(json, "preemptions", off->preemptions);
    kvp_json_uint(json, "later_turns", off->later_turns);
    kvp_json_double(json, "turn_gap_min",
                    off->later_turns > 0 ? (double)off->turn_gap_min : NAN);
    kvp_json_uint(json, "pages_leaked", off->pages_leaked);
    kvp_json_uint(json, "audit_failures", off->audit_failures);
    kvp_json_object_end(json);
}

static void print_json(const options *o, const kvp_workload *w, const kvp_sim_result *r,
                       const kvp_sim_result *off)
{
    const kvp_sim_config *c = &o->sim;
    kvp_json json;
    kvp_json_init(&json, stdout);
    kvp_json_object_begin(&json, NULL);
    kvp_json_uint(&json, "requests", r->requests);
    kvp_json_uint(&json, "requests_completed", r->requests_completed);
    kvp_json_uint(&json, "requests_rejected", r->requests_rejected);
    kvp_json_uint(&json, "tokens_generated", r->tokens_generated);
    kvp_json_uint(&json, "prefill_tokens", r->prefill_tokens);
    kvp_json_double(&json, "tokens_per_second", r->tokens_per_second);
    kvp_json_double(&json, "seconds", r->seconds);
    kvp_json_uint(&json, "steps", r->steps);
    kvp_json_uint(&json, "peak_concurrent_sequences", r->peak_concurrent);
    kvp_json_double(&json, "mean_concurrent_sequences", r->mean_concurrent);
    kvp_json_uint(&json, "contiguous_baseline_sequences", r->contiguous_baseline);
    kvp_json_double(&json, "concurrency_ratio", r->concurrency_ratio);
    kvp_json_double(&json, "peak_pool_utilization", r->peak_utilization);
    kvp_json_double(&json, "mean_pool_utilization", r->mean_utilization);
    kvp_json_double(&json, "internal_fragmentation", r->internal_fragmentation);
    kvp_json_uint(&json, "preemptions", r->preemptions);
    kvp_json_uint(&json, "pages_leaked", r->pages_leaked);
    kvp_json_uint(&json, "audit_failures", r->audit_failures);
    kvp_json_uint(&json, "audits", r->audits);
    kvp_json_uint(&json, "page_acquires", r->acquires);
    kvp_json_uint(&json, "page_releases", r->releases);
    kvp_json_uint(&json, "total_pages", r->total_pages);
    kvp_json_uint(&json, "page_bytes", r->page_bytes);
    kvp_json_string(&json, "kv_dtype", kvp_dtype_name(r->kv_dtype));
    kvp_json_uint(&json, "kv_element_bytes", r->element_bytes);
    kvp_json_uint(&json, "full_capacity_sequences", r->full_sequences);
    kvp_json_uint(&json, "f64_full_capacity_sequences", r->f64_full_sequences);
    kvp_json_double(&json, "sequences_vs_f64", dtype_gain(r));
    kvp_json_double(&json, "output_checksum", r->output_checksum);
    kvp_json_bool(&json, "targets_met", targets_met(r));
    json_sharing(&json, r, off);
    kvp_json_object_begin(&json, "config");
    kvp_json_string(&json, "workload", o->trace ? o->trace : kvp_profile_name(o->workload.profile));
    kvp_json_string(&json, "arrival", o->trace ? "trace" : kvp_arrival_name(o->workload.arrival));
    kvp_json_double(&json, "rate", o->workload.rate);
    kvp_json_double(&json, "mean_prompt_tokens", mean_of(w, 1));
    kvp_json_double(&json, "mean_output_tokens", mean_of(w, 0));
    kvp_json_uint(&json, "layers", c->layers);
    kvp_json_uint(&json, "model_width", c->model_width);
    kvp_json_uint(&json, "heads", c->heads);
    kvp_json_uint(&json, "kv_heads", kvp_sim_kv_heads(c));
    kvp_json_uint(&json, "kv_bytes_per_token", kv_bytes_per_token(c));
    kvp_json_uint(&json, "block_tokens", c->block_tokens);
    kvp_json_uint(&json, "budget_bytes", c->budget_bytes);
    kvp_json_string(&json, "kv_dtype", kvp_dtype_name(c->kv_dtype));
    kvp_json_string(&json, "accum", accum_name(c));
    kvp_json_uint(&json, "capacity", c->capacity);
    kvp_json_uint(&json, "threads", r->threads);
    kvp_json_uint(&json, "seed", c->seed);
    kvp_json_double(&json, "watermark", c->watermark);
    kvp_json_uint(&json, "reserve_tokens", c->reserve_tokens);
    kvp_json_bool(&json, "compute", c->compute);
    kvp_json_uint(&json, "samples", c->samples);
    kvp_json_uint(&json, "shared_prefix", o->trace ? 0 : o->workload.shared_prefix);
    kvp_json_bool(&json, "sharing", c->sharing);
    kvp_json_string(&json, "schedule",
                    c->schedule == KVP_SCHEDULE_CACHE_AWARE ? "cache-aware" : "fcfs");
    kvp_json_uint(&json, "update_weights_every", c->update_every);
    kvp_json_uint(&json, "verify_every", c->verify_every);
    kvp_json_uint(&json, "session_ttl", c->session_ttl);
    kvp_json_object_end(&json);
    kvp_json_object_end(&json);
}

/* Steps 1 and 2: every input read and checked; the workload made. */
static int prepare(int argc, char **argv, options *o, kvp_workload *workload)
{
    kvp_cli_problems p = {.found = 0};
    parse_options(argc, argv, o, &p);
    if (o->help) {
        simulate_usage(stdout);
        return -1;
    }
    size_t page_bytes = 0;
    check_ranges(o, &p);
    if (!p.found) {
        check_sizes(o, &p, &page_bytes);
    }
    check_workload(o, &p);
    check_outputs(o, &p);
    if (p.found) {
        fprintf(stderr, "kvpager simulate: %s\n", p.line);
        return KVP_CLI_USAGE;
    }
    /* The workload is input too: a bad trace row is refused before anything runs. */
    size_t requests = o->workload.requests;
    if (o->trace != NULL) {
        char message[512];
        int status = kvp_workload_load_trace(o->trace, o->sim.capacity, workload, message,
                                             sizeof message);
        if (status != 0) {
            fprintf(stderr, "kvpager simulate: %s%s\n",
                    status == KVP_TRACE_OUT_OF_MEMORY ? "" : "--trace ", message);
            return KVP_CLI_USAGE;
        }
        requests = workload->count;
    }
    check_memory(o, requests, page_bytes, &p);
    if (p.found) {
        fprintf(stderr, "kvpager simulate: %s\n", p.line);
        kvp_workload_free(workload);
        return KVP_CLI_USAGE;
    }
    if (o->trace == NULL && kvp_workload_generate(&o->workload, workload) != 0) {
        kvp_cli_report_oom("simulate", "the request list",
                           o->workload.requests * sizeof(kvp_workload_request));
        return KVP_CLI_USAGE;
    }
    return KVP_CLI_OK;
}

/* Step 3: the outputs, before any work. */
static int open_outputs(const options *o, kvp_plot *plot)
{
    if (o->plot == NULL) {
        return KVP_CLI_OK;
    }
    int error = kvp_plot_open(plot, o->plot);
    if (error < 0) {
        kvp_cli_report_oom("simulate", "the plot's buffer", 8192);
        return KVP_CLI_USAGE;
    }
    if (error > 0) {
        fprintf(stderr, "kvpager simulate: --plot %s: %s\n", o->plot, strerror(error));
        return KVP_CLI_USAGE;
    }
    return KVP_CLI_OK;
}

int kvp_cli_simulate(int argc, char **argv)
{
    options o;
    kvp_workload workload = {NULL, 0};
    int status = prepare(argc, argv, &o, &workload);
    if (status != KVP_CLI_OK) {
        return status < 0 ? KVP_CLI_OK : status;
    }
    kvp_plot plot = {NULL, NULL, 0, NULL};
    status = open_outputs(&o, &plot);
    if (status != KVP_CLI_OK) {
        kvp_workload_free(&workload);
        return status;
    }
    /*
     * The run, and for a sharing workload (unless --no-sharing) the same
     * workload without sharing, not verified, for the side-by-side figures.
     */
    int compare = sharing_workload(&o) && !o.no_sharing;
    kvp_sim_result result;
    kvp_sim_result off;
    memset(&off, 0, sizeof off);
    kvp_error err;
    const char *context = NULL;
    int failed = 0;
    for (int run = 0; run < 1 + compare && failed == 0; run++) {
        kvp_sim_config config = o.sim;
        if (run == 1) {
            config.sharing = 0;
            config.verify_every = 0;
        }
        kvp_progress progress;
        kvp_progress_init(&progress, run == 0 ? "simulate" : "simulate --no-sharing", o.quiet);
        failed = kvp_sim_run(&config, &workload, kvp_progress_update, &progress,
                             run == 0 ? &result : &off, &err, &context);
        kvp_progress_finish(&progress);
    }
    if (failed != 0) {
        kvp_cli_report("simulate", context != NULL ? context : "running", &err);
        if (o.plot != NULL) {
            kvp_plot_abandon(&plot);
        }
        kvp_sim_result_free(&result);
        kvp_sim_result_free(&off);
        kvp_workload_free(&workload);
        return KVP_CLI_USAGE;
    }
    if (o.json) {
        print_json(&o, &workload, &result, compare ? &off : NULL);
    } else {
        print_report(&o, &workload, &result, compare ? &off : NULL);
    }
    int exit_code = result.audit_failures == 0 && result.pages_leaked == 0 &&
                            off.audit_failures == 0 && off.pages_leaked == 0
                        ? KVP_CLI_OK
                        : KVP_CLI_FAILED;
    if (o.plot != NULL) {
        char title[160];
        snprintf(title, sizeof title, "kvpager simulate: %s, %zu requests, %zu pages",
                 o.trace ? "trace" : kvp_profile_name(o.workload.profile), workload.count,
                 result.total_pages);
        int error = kvp_plot_finish(&plot, &result, title);
        if (error != 0) {
            fprintf(stderr, "kvpager simulate: --plot %s: %s\n", o.plot, strerror(error));
            exit_code = KVP_CLI_USAGE;
        } else if (!o.json) {
            printf("plot                    %s\n", o.plot);
        }
    }
    kvp_sim_result_free(&result);
    kvp_sim_result_free(&off);
    kvp_workload_free(&workload);
    return exit_code;
}
