/*
 * simulate_checks.c: step 2 of `kvpager simulate`: every value checked
 * before anything runs.
 *
 * Owns: each flag's range (one table, in the order problems are reported),
 * the rules between flags (heads divide the width, KV heads divide the
 * heads, means and prefixes within the capacity, --trace against the
 * generated-workload flags, --verify and --update-weights-every against
 * --no-compute), a page against the budget and the 32-bit page ids, the
 * generated workload's mean request against the capacity, --plot against
 * --trace, and the memory every part of the run needs against physical
 * memory (each product overflow-checked).
 * Invariants: a check records at most one problem and only the first
 * problem of a command line is kept (kvp_cli_problems), so the order of the
 * checks is the order of the messages; a message names the flag the user
 * typed and the value as typed (a flag left at its default is shown with
 * its value; a geometry --model set is named --model, a capacity a Mooncake
 * trace's longest request set is named --trace); a check against a capacity
 * a Mooncake trace will set waits while capacity_pending (simulate.c runs 2a
 * again once the trace is read); nothing here allocates or runs.
 * Callers: simulate.c's prepare, in simulate.h's order.
 */
#include <math.h>
#include <string.h>

#include "simulate.h"
#include "verify.h"

/* The text of a flag for messages: what was given, or "<default>" rendering. */
static const char *shown(const simulate_options *o, simulate_flag f, char *buf, size_t size,
                         size_t fallback)
{
    if (o->value[f] != NULL) {
        return o->value[f];
    }
    snprintf(buf, size, "%zu", fallback);
    return buf;
}

/*
 * Step 2a, checked in the order of `ranges` below (the first problem is the
 * one reported). A row is either a range: the value of `flag` (the size_t or
 * double field it sets) within [min, max], max excluded with BELOW_MAX, or
 * "invalid value for <flag>: '<value>': <why>"; checked always, or only when
 * the flag was given (IF_GIVEN: a default always passes, or depends on a flag
 * checked later). Or a rule between flags (`rule`), about `flag`.
 */
typedef void range_rule(simulate_options *o, simulate_flag f, kvp_cli_problems *p);

typedef struct range_check {
    simulate_flag flag;
    double min;
    double max;
    unsigned when;
    const char *why;
    range_rule *rule;
} range_check;

enum { ALWAYS = 0, IF_GIVEN = 1, BELOW_MAX = 2 };

/* The generated-workload flags conflict with --trace (f unused: all of them). */
static void trace_conflicts(simulate_options *o, simulate_flag f, kvp_cli_problems *p)
{
    static const simulate_flag generated_only[] = {FLAG_PROFILE, FLAG_REQUESTS, FLAG_PROMPT_MEAN,
                                                   FLAG_OUTPUT_MEAN, FLAG_SIGMA, FLAG_ARRIVAL,
                                                   FLAG_RATE, FLAG_SHARED_PREFIX};
    (void)f;
    for (size_t i = 0; o->trace != NULL && i < sizeof generated_only / sizeof generated_only[0];
         i++) {
        simulate_flag g = generated_only[i];
        if (o->value[g] != NULL) {
            kvp_cli_problem(p, "%s %s conflicts with --trace %s: the trace gives every request",
                            kvp_simulate_flag_names[g], o->value[g], o->trace);
        }
    }
}

/* --trace-format needs --trace, and --ms-per-step the mooncake format. */
static void trace_format_rules(simulate_options *o, simulate_flag f, kvp_cli_problems *p)
{
    if (o->value[f] == NULL) {
        return;
    }
    if (f == FLAG_TRACE_FORMAT && o->trace == NULL) {
        kvp_cli_problem(p, "--trace-format %s needs --trace FILE", o->value[f]);
    } else if (f == FLAG_MS_PER_STEP && !o->mooncake) {
        kvp_cli_problem(p,
                        "--ms-per-step %s needs --trace-format mooncake (a CSV trace's arrivals "
                        "are steps already)",
                        o->value[f]);
    }
}

/* --heads divides --model-width: named by --heads when given, else by --model-width. */
static void heads_divide_width(simulate_options *o, simulate_flag f, kvp_cli_problems *p)
{
    const kvp_sim_config *c = &o->sim;
    char other[32];
    (void)f;
    if (c->heads == 0 || c->model_width % c->heads == 0) {
        return;
    }
    if (o->value[FLAG_HEADS] != NULL) {
        kvp_cli_problem(p, "invalid value for --heads: '%s': must divide --model-width %s",
                        o->value[FLAG_HEADS],
                        shown(o, FLAG_MODEL_WIDTH, other, sizeof other, c->model_width));
    } else {
        kvp_cli_problem(p,
                        "invalid value for --model-width: '%s': must be a multiple of --heads %s",
                        o->value[FLAG_MODEL_WIDTH],
                        shown(o, FLAG_HEADS, other, sizeof other, c->heads));
    }
}

/* A given --kv-heads divides --heads (after the width check, as the library orders them). */
static void kv_heads_divide_heads(simulate_options *o, simulate_flag f, kvp_cli_problems *p)
{
    const kvp_sim_config *c = &o->sim;
    char heads[32];
    if (o->value[f] != NULL && c->kv_heads != 0 && c->heads > 0 && c->heads % c->kv_heads != 0) {
        kvp_cli_problem(p, "invalid value for --kv-heads: '%s': must divide --heads %s",
                        o->value[f], shown(o, FLAG_HEADS, heads, sizeof heads, c->heads));
    }
}

/* --update-weights-every and --verify need real attention. */
static void needs_compute(simulate_options *o, simulate_flag f, kvp_cli_problems *p)
{
    if (o->value[f] != NULL && !o->sim.compute) {
        kvp_cli_problem(p, "%s %s needs real attention: it cannot be given with --no-compute",
                        kvp_simulate_flag_names[f], o->value[f]);
    }
}

/* A given --shared-prefix leaves one prompt token and one generated token of --capacity. */
static void shared_prefix_within_capacity(simulate_options *o, simulate_flag f,
                                          kvp_cli_problems *p)
{
    const kvp_sim_config *c = &o->sim;
    if (o->value[f] != NULL && c->capacity >= MIN_CAPACITY &&
        o->workload.shared_prefix > c->capacity - MIN_CAPACITY) {
        char capacity[32];
        kvp_cli_problem(p,
                        "invalid value for --shared-prefix: '%s': must be from 0 to %zu "
                        "(--capacity %s less one prompt token and one generated token)",
                        o->value[f], c->capacity - MIN_CAPACITY,
                        shown(o, FLAG_CAPACITY, capacity, sizeof capacity, c->capacity));
    }
}

/* A given --reserve-tokens is at most --capacity. */
static void reserve_within_capacity(simulate_options *o, simulate_flag f, kvp_cli_problems *p)
{
    const kvp_sim_config *c = &o->sim;
    if (o->value[f] == NULL || o->capacity_pending || c->capacity < MIN_CAPACITY ||
        c->reserve_tokens <= c->capacity) {
        return; /* a capacity the trace sets is checked once the trace is read */
    }
    if (o->trace != NULL && o->mooncake && o->value[FLAG_CAPACITY] == NULL) {
        kvp_cli_problem(p,
                        "invalid value for --reserve-tokens: '%s': must be from 0 to %zu (the "
                        "capacity of --trace %s: its longest request)",
                        o->value[f], c->capacity, o->trace);
        return;
    }
    char capacity[32];
    kvp_cli_problem(p, "invalid value for --reserve-tokens: '%s': must be from 0 to --capacity %s",
                    o->value[f], shown(o, FLAG_CAPACITY, capacity, sizeof capacity, c->capacity));
}

/* A given --prompt-mean or --output-mean is from 1 to --capacity less one token. */
static void mean_within_capacity(simulate_options *o, simulate_flag f, kvp_cli_problems *p)
{
    const kvp_sim_config *c = &o->sim;
    double *mean = kvp_simulate_real_field(o, f);
    if (o->value[f] != NULL && c->capacity >= MIN_CAPACITY &&
        !(*mean >= 1.0 && *mean <= (double)(c->capacity - 1))) {
        char capacity[32];
        kvp_cli_problem(p,
                        "invalid value for %s: '%s': must be from 1 to %zu (--capacity %s less "
                        "one token)",
                        kvp_simulate_flag_names[f], o->value[f], c->capacity - 1,
                        shown(o, FLAG_CAPACITY, capacity, sizeof capacity, c->capacity));
    }
}

/* A given --sigma shapes lognormal lengths: --profile uniform has none. */
static void sigma_needs_lognormal(simulate_options *o, simulate_flag f, kvp_cli_problems *p)
{
    if (o->value[f] != NULL && o->workload.profile == KVP_PROFILE_UNIFORM) {
        kvp_cli_problem(p,
                        "--sigma %s has no effect with --profile uniform (lognormal profiles only)",
                        o->value[f]);
    }
}

#define AT_LEAST_1 1.0, INFINITY, ALWAYS, "must be at least 1"
#define RULE(f, fn) {f, 0.0, 0.0, ALWAYS, NULL, fn}

static const range_check ranges[] = {
    RULE(FLAG_TRACE, trace_conflicts),
    RULE(FLAG_TRACE_FORMAT, trace_format_rules),
    {FLAG_MS_PER_STEP, 1.0, INFINITY, IF_GIVEN, "must be at least 1 (milliseconds per step)",
     NULL},
    RULE(FLAG_MS_PER_STEP, trace_format_rules),
    {FLAG_LAYERS, AT_LEAST_1, NULL},
    {FLAG_MODEL_WIDTH, AT_LEAST_1, NULL},
    {FLAG_HEADS, AT_LEAST_1, NULL},
    {FLAG_BLOCK_TOKENS, AT_LEAST_1, NULL},
    {FLAG_REQUESTS, AT_LEAST_1, NULL},
    {FLAG_CAPACITY, MIN_CAPACITY, INFINITY, ALWAYS,
     "must be at least 2 (one prompt token and one generated token)", NULL},
    RULE(FLAG_HEADS, heads_divide_width),
    {FLAG_KV_HEADS, 1.0, INFINITY, IF_GIVEN, "must be at least 1", NULL},
    RULE(FLAG_KV_HEADS, kv_heads_divide_heads),
    {FLAG_RATE, MIN_RATE, MAX_RATE, IF_GIVEN, "must be from 0.001 to 1000000 arrivals per step",
     NULL},
    {FLAG_WATERMARK, 0.0, 1.0, BELOW_MAX, "must be at least 0 and below 1", NULL},
    {FLAG_SAMPLES, 1.0, MAX_SAMPLES, ALWAYS, "must be from 1 to 256", NULL},
    {FLAG_UPDATE_WEIGHTS_EVERY, 1.0, INFINITY, IF_GIVEN,
     "must be at least 1 (leave it out for none)", NULL},
    RULE(FLAG_UPDATE_WEIGHTS_EVERY, needs_compute),
    {FLAG_VERIFY, 1.0, INFINITY, IF_GIVEN, "must be at least 1 (leave it out for none)", NULL},
    RULE(FLAG_VERIFY, needs_compute),
    RULE(FLAG_SHARED_PREFIX, shared_prefix_within_capacity),
    {FLAG_THREADS, 0.0, MAX_THREADS, ALWAYS, "must be from 0 (one per core) to 4096", NULL},
    RULE(FLAG_RESERVE_TOKENS, reserve_within_capacity),
    RULE(FLAG_PROMPT_MEAN, mean_within_capacity),
    RULE(FLAG_OUTPUT_MEAN, mean_within_capacity),
    {FLAG_SIGMA, MIN_SIGMA, MAX_SIGMA, IF_GIVEN, "must be from 0.05 to 4", NULL},
    RULE(FLAG_SIGMA, sigma_needs_lognormal),
    RULE(FLAG_WINDOW, kvp_simulate_check_window),
};

/* The value of a range row's flag: its size_t field (as a double: exact at the
 * bounds used here) or its double field. */
static double range_value(simulate_options *o, simulate_flag f)
{
    size_t *size = kvp_simulate_size_field(o, f);
    return size != NULL ? (double)*size : *kvp_simulate_real_field(o, f);
}

static int in_range(const range_check *r, double v)
{
    return v >= r->min && ((r->when & BELOW_MAX) ? v < r->max : v <= r->max);
}

/* Step 2a: each flag on its own, then flags that depend on each other (simulate.h). */
void kvp_simulate_check_ranges(simulate_options *o, kvp_cli_problems *p)
{
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
        const range_check *r = &ranges[i];
        if (r->rule != NULL) {
            r->rule(o, r->flag, p);
        } else if (!((r->when & IF_GIVEN) && o->value[r->flag] == NULL) &&
                   !in_range(r, range_value(o, r->flag))) {
            kvp_simulate_invalid(p, r->flag, o->value[r->flag], r->why);
        }
    }
}

/* Step 2b: sizes derived from several flags, all overflow-checked. */
void kvp_simulate_check_sizes(simulate_options *o, kvp_cli_problems *p, size_t *page_bytes)
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
void kvp_simulate_check_workload(simulate_options *o, kvp_cli_problems *p)
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
void kvp_simulate_check_outputs(const simulate_options *o, kvp_cli_problems *p)
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
static size_t flag_value(const simulate_options *o, simulate_flag f, size_t requests)
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
    simulate_flag flag;
    simulate_flag other; /* the other flag it grows with, or FLAG_COUNT_ */
    size_t bytes;
} memory_part;

enum { MEMORY_PARTS = 6 };

/*
 * Step 2e: what the run will hold at most, against physical memory. The parts
 * are the library's own sizes: the page slab (the budget) and its metadata
 * (12 bytes per page; allocator-only: no slab, about 80 bytes a page); the
 * model (4 D x D parameters per layer, plus one more while a layer is made,
 * and RoPE tables; allocator-only: none); per sequence (a lease of the
 * scheduler), computed: one ticket per layer (5 D + heads x capacity
 * doubles), page tables and activations, allocator-only: what ext_make
 * allocates, one external cache per layer (its struct and 2 ceil(capacity /
 * block-tokens) + 2 table entries) and two token rows; the prompt buffer
 * (computed only), which holds the prompts admitted in one step (at most what
 * the pool can hold, pages x block-tokens / layers positions, and at least
 * capacity) of D doubles each; the request list.
 * The sequences: the scheduler keeps every lease it made (idle ones are
 * reused), so it holds at most the peak of running + kept sequences, plus one
 * lease it keys prompts with. Running ones are at most --max-running (a request
 * with more samples runs alone: at most --samples), kept ones (conversation
 * turns only) at most one per request; and every running or kept sequence
 * holds a page per layer, so at most min(requests, pages / layers) exist.
 * --max-running 0 leaves the pool's bound alone, which at a large budget is
 * far above the real concurrency (1 TiB of Llama-3-8B bf16 pages: 524,288).
 * With --verify, its own model, pool, buffers and kept outputs (verify.h).
 */
/* The largest RoPE cos/sin table a layer keeps (the library's cap). */
#define ROPE_TABLE_CAP_BYTES ((size_t)4 << 20)

/* A budget above physical memory needs --allow-overcommit: 1 when refused. */
static int budget_above_physical(const simulate_options *o, size_t physical, kvp_cli_problems *p)
{
    char buf[2][32];
    if (o->sim.budget_bytes <= physical || o->allow_overcommit) {
        return 0;
    }
    kvp_cli_problem(p,
                    "invalid value for --budget: '%s': %s is more than the %s of physical memory "
                    "(add --allow-overcommit to run anyway)",
                    o->value[FLAG_BUDGET],
                    kvp_cli_format_bytes(o->sim.budget_bytes, buf[0], sizeof buf[0]),
                    kvp_cli_format_bytes(physical, buf[1], sizeof buf[1]));
    return 1;
}

/* The model: (4 L + 1) D^2 doubles, and each layer's RoPE table of capacity x d_h
 * doubles (the library caps one at 4 MiB), twice while the model is made. The
 * first part computed: a table is taken at its cap when the model overflowed. */
static size_t model_bytes(const kvp_sim_config *c, int *overflow)
{
    size_t d = c->model_width;
    size_t model = mul(add(mul(4, c->layers, overflow), 1, overflow),
                       mul(mul(d, d, overflow), sizeof(double), overflow), overflow);
    size_t rope = mul(mul(c->capacity, d / c->heads, overflow), sizeof(double), overflow);
    rope = *overflow || rope > ROPE_TABLE_CAP_BYTES ? ROPE_TABLE_CAP_BYTES : rope;
    return add(model, mul(mul(2, c->layers, overflow), rope, overflow), overflow);
}

/* The struct of one cache (kvp_cache), rounded up generously: the CLI cannot see it. */
#define CACHE_STRUCT_BYTES 1024

/* `sequences` sequences. Computed: per layer a ticket of 5 D + heads x capacity
 * doubles and page tables; per sequence activations and token buffers of
 * (L + 4) D doubles. Allocator-only: per layer a cache of 2 ceil(capacity /
 * block-tokens) + 2 entries; per sequence L + 1 cache pointers and 2 D doubles. */
static size_t sequences_bytes(const kvp_sim_config *c, size_t sequences, int *overflow)
{
    size_t d = c->model_width;
    size_t per_sequence = 0;
    if (!c->compute) {
        size_t blocks = c->capacity / c->block_tokens + (c->capacity % c->block_tokens != 0);
        size_t cache = add(mul(add(mul(2, blocks, overflow), 2, overflow), sizeof(uint32_t),
                               overflow),
                           CACHE_STRUCT_BYTES, overflow);
        per_sequence = add(mul(cache, c->layers, overflow),
                           add(mul(add(c->layers, 1, overflow), sizeof(void *), overflow),
                               mul(mul(2, d, overflow), sizeof(double), overflow), overflow),
                           overflow);
        return mul(per_sequence, sequences, overflow);
    }
    size_t blocks = c->capacity / c->block_tokens + 1;
    size_t ticket = mul(add(mul(c->heads, c->capacity, overflow), mul(5, d, overflow), overflow),
                        sizeof(double), overflow);
    ticket = add(ticket, add(mul(2 * sizeof(uint32_t), blocks, overflow), 512, overflow),
                 overflow);
    per_sequence = add(mul(ticket, c->layers, overflow),
                       mul(mul(add(c->layers, 4, overflow), d, overflow), sizeof(double),
                           overflow),
                       overflow);
    return mul(per_sequence, sequences, overflow);
}

/* The most sequences (leases) the run holds at once (step 2e's comment). */
static size_t sequences_bound(const simulate_options *o, size_t requests, size_t pages)
{
    const kvp_sim_config *c = &o->sim;
    size_t sequences = pages / c->layers;
    sequences = sequences < requests ? sequences : requests;
    if (c->max_running != 0) {
        size_t running = c->max_running > c->samples ? c->max_running : c->samples;
        int sessions = o->trace == NULL && o->workload.profile == KVP_PROFILE_CONVERSATION &&
                       c->session_ttl > 0;
        size_t kept = sessions ? sequences : 0;
        size_t leases = running + kept + 1; /* + the lease prompts are keyed with */
        sequences = leases < sequences ? leases : sequences;
    }
    return sequences > 0 ? sequences : 1;
}

/* The prompt buffer: max(pages x block-tokens / layers, capacity) rows of D doubles. */
static size_t prompt_bytes(const kvp_sim_config *c, size_t pages, int *overflow)
{
    size_t prompt_rows = mul(pages, c->block_tokens, overflow) / c->layers;
    prompt_rows = prompt_rows > c->capacity ? prompt_rows : c->capacity;
    return mul(mul(prompt_rows, c->model_width, overflow), sizeof(double), overflow);
}

/* Fills parts[] with the run's memory; *overflow latches any overflow. */
static void memory_parts(const simulate_options *o, size_t requests, size_t page_bytes,
                         memory_part parts[MEMORY_PARTS], int *overflow)
{
    const kvp_sim_config *c = &o->sim;
    size_t pages = c->budget_bytes / page_bytes;
    size_t sequences = sequences_bound(o, requests, pages);
    size_t model = c->compute ? model_bytes(c, overflow) : 0; /* allocator-only: no weights */
    size_t per_sequence = sequences_bytes(c, sequences, overflow);
    size_t prompt = prompt_bytes(c, pages, overflow);
    size_t list = mul(requests, sizeof(kvp_workload_request) + 7 * sizeof(size_t), overflow);
    size_t metadata = mul(pages, 3 * sizeof(uint32_t), overflow);
    if (!c->compute) {
        /* Pages with no memory behind them (KVP_SLAB_RESERVED): only the pool's
           metadata, keys, LRU and index included, about 80 bytes a page. */
        metadata = mul(pages, 80, overflow);
    }
    const memory_part all[MEMORY_PARTS] = {
        {"the pool", FLAG_BUDGET, FLAG_COUNT_,
         o->allow_overcommit || !c->compute ? metadata
                                            : add(c->budget_bytes, metadata, overflow)},
        {"the model", FLAG_MODEL_WIDTH, FLAG_LAYERS, model},
        {"the sequences", FLAG_CAPACITY, FLAG_LAYERS, per_sequence},
        {"the prompt buffer", FLAG_CAPACITY, FLAG_MODEL_WIDTH, c->compute ? prompt : 0},
        {"the request list", FLAG_REQUESTS, FLAG_COUNT_, list},
        {"the verification", FLAG_VERIFY, FLAG_CAPACITY,
         kvp_sim_verify_bytes(c, requests, page_bytes, model, overflow)},
    };
    memcpy(parts, all, sizeof all);
}

/* The capacity was set by --trace (a Mooncake trace's longest request), not typed. */
static int capacity_from_trace(const simulate_options *o)
{
    return o->mooncake && o->value[FLAG_CAPACITY] == NULL;
}

/* " <flag> <value>" of a part's flag as the user set it: --model for the geometry a
 * preset set, the trace's longest request for a capacity the trace set. */
static void flag_text(const simulate_options *o, simulate_flag f, size_t requests, char *out,
                      size_t size)
{
    char buf[32];
    if (f == FLAG_CAPACITY && capacity_from_trace(o)) {
        snprintf(out, size, " a capacity of %zu tokens (--trace's longest request)",
                 o->sim.capacity);
    } else if (o->value[f] == NULL && o->value[FLAG_MODEL] != NULL &&
               (f == FLAG_MODEL_WIDTH || f == FLAG_LAYERS)) {
        snprintf(out, size, " --model %s", o->value[FLAG_MODEL]);
    } else {
        snprintf(out, size, " %s %s", kvp_simulate_flag_names[f],
                 shown(o, f, buf, sizeof buf, flag_value(o, f, requests)));
    }
}

/*
 * The flag a memory refusal names, and the text of its value: of the part's
 * two flags the given one (the first if both, or neither); --model when the
 * preset set the width or the layers; --trace when the trace's longest request
 * set the capacity. *with: " with <other flag> <value>" (the capacity a trace
 * set as " with a capacity of N tokens (--trace's longest request)").
 */
static simulate_flag memory_flag(const simulate_options *o, const memory_part *big,
                                 size_t requests, char given[2][32], const char **value,
                                 char *with, size_t with_size)
{
    simulate_flag named = big->flag;
    simulate_flag other = big->other;
    if (o->value[named] == NULL && other != FLAG_COUNT_ && o->value[other] != NULL) {
        named = big->other;
        other = big->flag;
    }
    *value = shown(o, named, given[0], 32, flag_value(o, named, requests));
    if (o->value[named] == NULL && o->value[FLAG_MODEL] != NULL &&
        (named == FLAG_MODEL_WIDTH || named == FLAG_LAYERS)) {
        *value = o->value[FLAG_MODEL]; /* the preset set it: name what the user typed */
        named = FLAG_MODEL;
    }
    with[0] = '\0';
    if (named == FLAG_CAPACITY && capacity_from_trace(o)) {
        *value = o->trace; /* the trace set it: name what the user typed */
        named = FLAG_TRACE;
        snprintf(with, with_size, " with a capacity of %zu tokens (its longest request)",
                 o->sim.capacity);
        if (other != FLAG_COUNT_) {
            size_t used = strlen(with);
            snprintf(with + used, with_size - used, " and");
            used = strlen(with);
            flag_text(o, other, requests, with + used, with_size - used);
        }
        return named;
    }
    if (other != FLAG_COUNT_) {
        snprintf(with, with_size, " with");
        flag_text(o, other, requests, with + 5, with_size - 5);
    }
    return named;
}

void kvp_simulate_check_memory(simulate_options *o, size_t requests, size_t page_bytes,
                               kvp_cli_problems *p)
{
    size_t physical = kvp_cli_physical_memory();
    /* An allocator-only run's pages have no memory behind them: only its metadata counts. */
    if (p->found || physical == 0 || (o->sim.compute && budget_above_physical(o, physical, p))) {
        return;
    }
    int overflow = 0;
    memory_part parts[MEMORY_PARTS];
    memory_parts(o, requests, page_bytes, parts, &overflow);
    size_t total = 0;
    size_t largest = 0;
    for (size_t i = 0; i < MEMORY_PARTS; i++) {
        total = add(total, parts[i].bytes, &overflow);
        largest = parts[i].bytes > parts[largest].bytes ? i : largest;
    }
    if (!overflow && total <= physical) {
        return;
    }
    const memory_part *big = &parts[largest];
    char given[2][32];
    char with[160];
    const char *value = NULL;
    simulate_flag named = memory_flag(o, big, requests, given, &value, with, sizeof with);
    if (overflow) {
        kvp_cli_problem(p,
                        "invalid value for %s: '%s': the memory for %s%s overflows a 64-bit size",
                        kvp_simulate_flag_names[named], value, big->what, with);
        return;
    }
    char buf[3][32];
    kvp_cli_problem(p,
                    "invalid value for %s: '%s': the run would need %s (%s %s%s), more than the "
                    "%s of physical memory",
                    kvp_simulate_flag_names[named], value,
                    kvp_cli_format_bytes(total, buf[0], sizeof buf[0]), big->what,
                    kvp_cli_format_bytes(big->bytes, buf[1], sizeof buf[1]), with,
                    kvp_cli_format_bytes(physical, buf[2], sizeof buf[2]));
}
