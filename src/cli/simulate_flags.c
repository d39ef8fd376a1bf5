/*
 * simulate_flags.c: the command line of `kvpager simulate`.
 *
 * Owns: the flags' names (simulate.h's FLAG_MAP), --help with every default,
 * the --model presets (published geometries), and step 1: reading every
 * argument into a simulate_options. Each value is checked for its syntax
 * only (a whole number, a finite decimal, a byte size, one of a set of
 * words); ranges and flags that depend on each other are
 * simulate_checks.c's.
 * Invariants: every argument is read even after a problem (a later --help
 * wins); only the first problem is kept; nothing here allocates, opens a
 * file or runs anything. A preset's geometry fills only the flags not
 * given on the command line.
 * Callers: simulate.c (kvp_simulate_parse, kvp_simulate_usage) and
 * simulate_checks.c (the field lookups, kvp_simulate_invalid).
 */
#include <string.h>

#include "simulate.h"

const char *const kvp_simulate_flag_names[FLAG_COUNT_] = {
#define FLAG_NAME_(name, text) text,
    FLAG_MAP(FLAG_NAME_)
#undef FLAG_NAME_
};

void kvp_simulate_usage(FILE *out)
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
            "                       memory is refused (try --layers 2, or --no-compute).\n"
            "                       A comma list sweeps (see Sweeps below)\n"
            "  --layers N           decoder layers, >= 1 (default %zu)\n"
            "  --model-width N      model width D, >= 1 (default %zu)\n"
            "  --heads N            attention heads, >= 1, dividing D (default %zu)\n"
            "  --kv-heads N         KV heads (grouped-query attention), >= 1, dividing\n"
            "                       --heads: each KV head serves heads / kv-heads query heads\n"
            "                       and pages store only the KV heads, so a token takes\n"
            "                       kv-heads / heads of the memory; 1 is multi-query\n"
            "                       (default: --heads, plain multi-head attention)\n"
            "  --block-tokens N     positions per page, >= 1; a comma list sweeps (default\n"
            "                       %zu)\n"
            "  --budget SIZE        pool budget: bytes, or a number with a unit B, KiB, MiB,\n"
            "                       GiB, TiB (1024-based) or KB, MB, GB, TB (1000-based),\n"
            "                       naming a whole byte count (1.5KiB yes, 1.5 no); at least\n"
            "                       one page (2 x block-tokens x D x element bytes, times\n"
            "                       kv-heads / heads) and at most physical memory (not\n"
            "                       checked for --no-compute: no memory is behind its\n"
            "                       pages); a comma list sweeps (default %s)\n"
            "  --kv-dtype NAME      how pages store K and V: f64 (8 bytes), f32 (4), bf16\n"
            "                       (2), f16 (2) or fp8_e4m3 (1; also \"fp8\", K/V scales 1),\n"
            "                       rounded once to nearest even when appended; the model\n"
            "                       still computes in f64. f64 is the default because it is\n"
            "                       exact: outputs equal the f64 reference bit for bit. The\n"
            "                       others fit 2x, 4x, 4x and 8x the tokens in the budget,\n"
            "                       within a measured error (DESIGN.md). A comma list\n"
            "                       sweeps (default f64)\n"
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
            "                       cached K/V), or long-context (prompts ~8192, sigma 0.3,\n"
            "                       kept within [mean / 2, 2 x mean]: 4k to 16k tokens;\n"
            "                       output ~256) (default sharegpt)\n"
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
            "  --trace-format NAME  csv (the rows above) or mooncake: the Mooncake trace's\n"
            "                       JSONL (timestamp in ms, input_length, output_length,\n"
            "                       hash_ids: one id per 512-token prompt block; the\n"
            "                       repository's data/traces/mooncake_synthetic_trace.jsonl).\n"
            "                       Never guessed from the file (default csv). A mooncake\n"
            "                       prompt block's inputs are drawn from its hash id, so\n"
            "                       equal ids are real prefix hits, and the report adds the\n"
            "                       trace's ceiling (the hit rate of a cache that never\n"
            "                       forgets) and the hit rate of an LRU of the blocks the\n"
            "                       pool's pages hold. Without --capacity, the capacity is\n"
            "                       the longest request (prompt + output)\n"
            "  --ms-per-step N      mooncake: milliseconds of the trace per scheduler step,\n"
            "                       >= 1; a request arrives at step floor(timestamp / N)\n"
            "                       (default %d)\n"
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
            "  --max-running N      most sequences running at once (vLLM's max_num_seqs);\n"
            "                       a request with more samples runs alone; 0: no limit\n"
            "                       but the pool. It also bounds the sequences the memory\n"
            "                       check charges (default %d)\n"
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
            "                       (default: %d steps per %d pages of the pool, rounded\n"
            "                       up, at most %d: audits cost alike at any budget)\n"
            "output:\n"
            "  --json               print one JSON object instead of the report (a sweep: a\n"
            "                       JSON array of them, one per run, in the table's order)\n"
            "  --format FMT         print one table instead of the report, one row per run:\n"
            "                       md (Markdown), csv or json (an array of the rows as\n"
            "                       objects); a sweep without --format prints md. Not\n"
            "                       with --json or --plot\n"
            "  --plot FILE.svg      draw pages in use, cached pages (held or evictable),\n"
            "                       evictable pages and running sequences per step; the\n"
            "                       file is opened and its first bytes written before the\n"
            "                       run, so an unwritable path is refused up front (exit 2;\n"
            "                       a write error after the run also exits 2)\n"
            "  --quiet              no progress line (it shows only on a terminal anyway)\n"
            "  --help, -h           show this help\n\n"
            "Sweeps: --model, --kv-dtype, --block-tokens and --budget take comma lists, as\n"
            "llama-bench does (--budget 16GiB,32GiB,64GiB --kv-dtype f64,bf16). Every\n"
            "combination is one run (--model outermost, --budget varying fastest; at most\n"
            "256) and one row of the table: the knobs (model, layers, model_width, heads,\n"
            "kv_heads, kv_dtype, block_tokens, budget_bytes, pages), then peak_concurrent,\n"
            "mean_concurrent, hit_rate (prompt tokens adopted from the prefix cache at\n"
            "first admission, over the workload's prompt tokens), preemptions, time to\n"
            "first token and end to end p50 / p99 in steps, completed, requests, steps and\n"
            "seconds. Every value of every list is checked, each combination as a run of\n"
            "its own (sizes, overflow, memory), before the first run. A sweep makes no\n"
            "comparison run without sharing (sweep --no-sharing for those figures).\n\n"
            "Sharing figures: prefix hit rate = prompt tokens adopted from the prefix cache\n"
            "over all prompt tokens admitted (recomputation included); pages saved = the sum\n"
            "over steps of the pages the running sequences would hold if nothing were\n"
            "shared, over the sum over steps of the pages held (1.00x: nothing saved);\n"
            "evictions and copy-on-write copies are the pool's counters.\n\n"
            "Memory (peak resident set, /usr/bin/time -v, release build, this machine): a\n"
            "computed run holds the budget (the pages' slab, 12 bytes of metadata a page\n"
            "beside it), the model's f64 weights, (4 x layers + 1) x D x D x 8 bytes\n"
            "(llama-3-8b: 16.1 GiB; llama-3-70b: 160 GiB, refused here), per running\n"
            "sequence a ticket of (5 D + heads x capacity) doubles per layer, and the\n"
            "prompt rows a step admits, D doubles each: the defaults peak at 120 MiB. An\n"
            "allocator-only run (--no-compute) builds no weights and puts no memory\n"
            "behind its pages: about 80 bytes a page of metadata (the pool's, the prefix\n"
            "index's, the LRU's; 2^24 pages for llama-3-8b bf16 at 1 TiB), each running\n"
            "sequence's page tables, and the prompt rows the prefix cache is keyed from,\n"
            "so it grows with pages and prompt lengths, not with the budget's bytes: 7 MiB\n"
            "at the defaults; the Mooncake trace at llama-3-8b bf16 2.2 GiB at 16 GiB and\n"
            "6.7 GiB at 1 TiB (docs/simulate.md). --verify adds its own model and pool,\n"
            "--trace its rows, a sweep only its largest run (runs go one at a time). Sizes\n"
            "whose memory would exceed physical memory are refused up front, naming the\n"
            "part and its size. A run that completes no request meets no target.\n\n"
            "exit status: 0 clean run, 1 audit failure or leaked pages, 2 bad input or an\n"
            "error (out of memory included).\n",
            d.layers, d.model_width, d.heads, d.block_tokens,
            kvp_cli_format_bytes(d.budget_bytes, budget, sizeof budget), MIN_CAPACITY,
            d.capacity, MIN_SIGMA, MAX_SIGMA, MIN_RATE, MAX_RATE, DEFAULT_MS_PER_STEP, d.samples, d.session_ttl,
            DEFAULT_MAX_RUNNING,
            d.watermark,
            d.reserve_tokens,
            MAX_THREADS, (unsigned long long)d.seed, KVP_SIM_AUDIT_STEPS, KVP_SIM_AUDIT_PAGES,
            KVP_SIM_AUDIT_MAX);
    kvp_simulate_window_usage(out);
    fprintf(out, "\n");
    kvp_simulate_tier_usage(out); /* simulate_tier.c */
}

void kvp_simulate_invalid(kvp_cli_problems *p, simulate_flag f, const char *value, const char *why)
{
    kvp_cli_problem(p, "invalid value for %s: '%s': %s", kvp_simulate_flag_names[f], value, why);
}

size_t *kvp_simulate_size_field(simulate_options *o, simulate_flag f)
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
    case FLAG_MAX_RUNNING: return &o->sim.max_running;
    case FLAG_MS_PER_STEP: return &o->ms_per_step;
    case FLAG_WINDOW: return &o->sim.window;
    case FLAG_FULL_EVERY: return &o->sim.full_every;
    case FLAG_SINK_TOKENS: return &o->sim.sink_tokens;
    default: return NULL;
    }
}

double *kvp_simulate_real_field(simulate_options *o, simulate_flag f)
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
static void apply_preset(simulate_options *o, const model_preset *m)
{
    const simulate_flag flags[] = {FLAG_LAYERS, FLAG_MODEL_WIDTH, FLAG_HEADS, FLAG_KV_HEADS};
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

/* --seed sets the run's and the workload's seed (0 when the text is refused). */
static int parse_seed(simulate_options *o, const char *value)
{
    size_t seed = 0;
    int status = kvp_cli_parse_size(value, &seed);
    o->sim.seed = seed;
    o->workload.seed = seed;
    return status;
}

static int parse_budget(simulate_options *o, const char *value)
{
    return kvp_cli_parse_bytes(value, &o->sim.budget_bytes);
}

static int parse_kv_dtype(simulate_options *o, const char *value)
{
    return parse_dtype(value, &o->sim.kv_dtype);
}

/* --model is only checked here; its geometry is applied once every flag is read. */
static int parse_model(simulate_options *o, const char *value)
{
    (void)o;
    return find_preset(value) != NULL ? 0 : -1;
}

static int parse_accum(simulate_options *o, const char *value)
{
    if (strcmp(value, "exact") != 0 && strcmp(value, "fast") != 0) {
        return -1;
    }
    o->sim.accum = value[0] == 'f' ? KVP_ACCUM_FAST : KVP_ACCUM_EXACT;
    return 0;
}

static int parse_profile(simulate_options *o, const char *value)
{
    return kvp_profile_parse(value, &o->workload.profile);
}

static int parse_arrival(simulate_options *o, const char *value)
{
    return kvp_arrival_parse(value, &o->workload.arrival);
}

static int parse_schedule(simulate_options *o, const char *value)
{
    if (strcmp(value, "fcfs") == 0) {
        o->sim.schedule = KVP_SCHEDULE_FCFS;
    } else if (strcmp(value, "cache-aware") == 0) {
        o->sim.schedule = KVP_SCHEDULE_CACHE_AWARE;
    } else {
        return -1;
    }
    return 0;
}

static int parse_trace(simulate_options *o, const char *value)
{
    o->trace = value;
    return 0;
}

static int parse_trace_format(simulate_options *o, const char *value)
{
    if (strcmp(value, "csv") != 0 && strcmp(value, "mooncake") != 0) {
        return -1;
    }
    o->mooncake = value[0] == 'm';
    return 0;
}

static int parse_plot(simulate_options *o, const char *value)
{
    o->plot = value;
    return 0;
}

static int parse_format(simulate_options *o, const char *value)
{
    static const char *const names[] = {"md", "csv", "json"};
    for (int i = 0; i < 3; i++) {
        if (strcmp(value, names[i]) == 0) {
            o->format = SIMULATE_TABLE_MD + i;
            return 0;
        }
    }
    return -1;
}

/* The flags that set neither a size_t nor a double field: how each is read, and
 * the refusal's reason. */
typedef struct word_flag {
    simulate_flag flag;
    int (*parse)(simulate_options *o, const char *value); /* 0, or -1 when refused */
    const char *why;
} word_flag;

static const word_flag word_flags[] = {
    {FLAG_SEED, parse_seed, "not a whole number (digits only, below 2^64)"},
    {FLAG_BUDGET, parse_budget,
     "not a whole byte count (a number with an optional unit B, KiB, MiB, GiB, TiB, KB, MB, GB "
     "or TB, below 2^64 bytes)"},
    {FLAG_KV_DTYPE, parse_kv_dtype, "not a storage type (f64, f32, bf16, f16, fp8_e4m3 or fp8)"},
    {FLAG_MODEL, parse_model,
     "not a model preset (llama-3-8b, llama-3-70b, qwen2.5-7b or mistral-7b)"},
    {FLAG_ACCUM, parse_accum, "not an accumulation level (exact or fast)"},
    {FLAG_PROFILE, parse_profile, "not a profile (sharegpt, alpaca, uniform, conversation or long-context)"},
    {FLAG_ARRIVAL, parse_arrival, "not an arrival process (poisson, uniform or burst)"},
    {FLAG_SCHEDULE, parse_schedule, "not a schedule (fcfs or cache-aware)"},
    {FLAG_TRACE, parse_trace, "not a file name"}, /* never refused here */
    {FLAG_TRACE_FORMAT, parse_trace_format, "not a trace format (csv or mooncake)"},
    {FLAG_PLOT, parse_plot, "not a file name"},   /* never refused here */
    {FLAG_FORMAT, parse_format, "not a table format (md, csv or json)"},
};

/* Reads one flag's value; its syntax only (ranges are checked later). */
static void parse_value(simulate_options *o, simulate_flag f, const char *value,
                        kvp_cli_problems *p)
{
    size_t *size = kvp_simulate_size_field(o, f);
    double *real = kvp_simulate_real_field(o, f);
    if (size != NULL) {
        if (kvp_cli_parse_size(value, size) != 0) {
            kvp_simulate_invalid(p, f, value, "not a whole number (digits only, below 2^64)");
        }
        return;
    }
    if (real != NULL) {
        if (kvp_cli_parse_double(value, real) != 0) {
            kvp_simulate_invalid(p, f, value, "not a finite decimal number");
        }
        return;
    }
    for (size_t i = 0; i < sizeof word_flags / sizeof word_flags[0]; i++) {
        if (word_flags[i].flag == f && word_flags[i].parse(o, value) != 0) {
            kvp_simulate_invalid(p, f, value, word_flags[i].why);
        }
    }
}

static void defaults(simulate_options *o)
{
    memset(o, 0, sizeof *o);
    kvp_sim_config_init(&o->sim);
    o->workload.profile = KVP_PROFILE_SHAREGPT;
    o->workload.arrival = KVP_ARRIVAL_POISSON;
    o->workload.rate = 1.0;
    o->workload.requests = 128;
    o->workload.seed = o->sim.seed;
    o->ms_per_step = DEFAULT_MS_PER_STEP;
    o->sim.max_running = DEFAULT_MAX_RUNNING;
}

/* Step 1: reads the whole command line; remembers the first problem (simulate.h). */
void kvp_simulate_parse(int argc, char **argv, simulate_options *o, kvp_cli_problems *p)
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
        if (kvp_simulate_tier_take(argc, argv, &i, o, p)) {
            continue;
        }
        int f = kvp_cli_take_flag(argc, argv, &i, "simulate", kvp_simulate_flag_names,
                                  FLAG_COUNT_, o->value, p);
        if (f >= 0) {
            parse_value(o, (simulate_flag)f, o->value[f], p);
        }
    }
    const model_preset *m = o->value[FLAG_MODEL] != NULL ? find_preset(o->value[FLAG_MODEL]) : NULL;
    if (m != NULL) {
        apply_preset(o, m);
    }
    o->capacity_pending = o->trace != NULL && o->mooncake && o->value[FLAG_CAPACITY] == NULL;
}
