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
 * its value); nothing here allocates or runs.
 * Callers: simulate.c's prepare, in simulate.h's order.
 */
#include <math.h>
#include <string.h>

#include "simulate.h"
#include "verify.h"

/* The text of a simulate_flag for messages: what was given, or "<default>" rendering. */
static const char *shown(const simulate_options *o, simulate_flag f, char *buf, size_t size, size_t fallback)
{
    if (o->value[f] != NULL) {
        return o->value[f];
    }
    snprintf(buf, size, "%zu", fallback);
    return buf;
}

/* Step 2a: each flag on its own, then flags that depend on each other. */
void kvp_simulate_check_ranges(simulate_options *o, kvp_cli_problems *p)
{
    const kvp_sim_config *c = &o->sim;
    static const simulate_flag generated_only[] = {FLAG_PROFILE, FLAG_REQUESTS, FLAG_PROMPT_MEAN,
                                          FLAG_OUTPUT_MEAN, FLAG_SIGMA, FLAG_ARRIVAL,
                                          FLAG_RATE, FLAG_SHARED_PREFIX};
    if (o->trace != NULL) {
        for (size_t i = 0; i < sizeof generated_only / sizeof generated_only[0]; i++) {
            simulate_flag f = generated_only[i];
            if (o->value[f] != NULL) {
                kvp_cli_problem(p, "%s %s conflicts with --trace %s: the trace gives every request",
                        kvp_simulate_flag_names[f], o->value[f], o->trace);
            }
        }
    }
    static const simulate_flag at_least_one[] = {FLAG_LAYERS, FLAG_MODEL_WIDTH, FLAG_HEADS,
                                        FLAG_BLOCK_TOKENS, FLAG_REQUESTS};
    for (size_t i = 0; i < sizeof at_least_one / sizeof at_least_one[0]; i++) {
        simulate_flag f = at_least_one[i];
        if (*kvp_simulate_size_field(o, f) == 0) {
            kvp_simulate_invalid(p, f, o->value[f], "must be at least 1");
        }
    }
    if (c->capacity < MIN_CAPACITY) {
        kvp_simulate_invalid(p, FLAG_CAPACITY, o->value[FLAG_CAPACITY],
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
            kvp_simulate_invalid(p, FLAG_KV_HEADS, o->value[FLAG_KV_HEADS], "must be at least 1");
        } else if (c->heads > 0 && c->heads % c->kv_heads != 0) {
            kvp_cli_problem(p, "invalid value for --kv-heads: '%s': must divide --heads %s",
                            o->value[FLAG_KV_HEADS],
                            shown(o, FLAG_HEADS, heads, sizeof heads, c->heads));
        }
    }
    if (o->value[FLAG_RATE] != NULL && !(o->workload.rate >= MIN_RATE && o->workload.rate <= MAX_RATE)) {
        kvp_simulate_invalid(p, FLAG_RATE, o->value[FLAG_RATE], "must be from 0.001 to 1000000 arrivals per step");
    }
    if (!(c->watermark >= 0.0 && c->watermark < 1.0)) {
        kvp_simulate_invalid(p, FLAG_WATERMARK, o->value[FLAG_WATERMARK], "must be at least 0 and below 1");
    }
    if (c->samples < 1 || c->samples > MAX_SAMPLES) {
        kvp_simulate_invalid(p, FLAG_SAMPLES, o->value[FLAG_SAMPLES], "must be from 1 to 256");
    }
    static const simulate_flag computed_only[] = {FLAG_UPDATE_WEIGHTS_EVERY, FLAG_VERIFY};
    for (size_t i = 0; i < 2; i++) {
        simulate_flag f = computed_only[i];
        if (o->value[f] == NULL) {
            continue;
        }
        if (*kvp_simulate_size_field(o, f) == 0) {
            kvp_simulate_invalid(p, f, o->value[f], "must be at least 1 (leave it out for none)");
        } else if (!c->compute) {
            kvp_cli_problem(p, "%s %s needs real attention: it cannot be given with --no-compute",
                            kvp_simulate_flag_names[f], o->value[f]);
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
        kvp_simulate_invalid(p, FLAG_THREADS, o->value[FLAG_THREADS], "must be from 0 (one per core) to 4096");
    }
    if (o->value[FLAG_RESERVE_TOKENS] != NULL && c->capacity >= MIN_CAPACITY &&
        c->reserve_tokens > c->capacity) {
        char capacity[32];
        kvp_cli_problem(p, "invalid value for --reserve-tokens: '%s': must be from 0 to --capacity %s",
                o->value[FLAG_RESERVE_TOKENS],
                shown(o, FLAG_CAPACITY, capacity, sizeof capacity, c->capacity));
    }
    static const simulate_flag means[] = {FLAG_PROMPT_MEAN, FLAG_OUTPUT_MEAN};
    for (size_t i = 0; i < 2 && c->capacity >= MIN_CAPACITY; i++) {
        double *mean = kvp_simulate_real_field(o, means[i]);
        if (o->value[means[i]] != NULL && !(*mean >= 1.0 && *mean <= (double)(c->capacity - 1))) {
            char capacity[32];
            kvp_cli_problem(p, "invalid value for %s: '%s': must be from 1 to %zu (--capacity %s less "
                       "one token)",
                    kvp_simulate_flag_names[means[i]], o->value[means[i]], c->capacity - 1,
                    shown(o, FLAG_CAPACITY, capacity, sizeof capacity, c->capacity));
        }
    }
    if (o->value[FLAG_SIGMA] != NULL) {
        if (!(o->workload.sigma >= MIN_SIGMA && o->workload.sigma <= MAX_SIGMA)) {
            kvp_simulate_invalid(p, FLAG_SIGMA, o->value[FLAG_SIGMA], "must be from 0.05 to 4");
        } else if (o->workload.profile == KVP_PROFILE_UNIFORM) {
            kvp_cli_problem(p, "--sigma %s has no effect with --profile uniform (lognormal profiles only)",
                    o->value[FLAG_SIGMA]);
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

void kvp_simulate_check_memory(simulate_options *o, size_t requests, size_t page_bytes, kvp_cli_problems *p)
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
    simulate_flag named = big->flag;
    simulate_flag other = big->other;
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
        snprintf(with, sizeof with, " with %s %s", kvp_simulate_flag_names[other],
                 shown(o, other, given[1], sizeof given[1], flag_value(o, other, requests)));
    }
    if (overflow) {
        kvp_cli_problem(p, "invalid value for %s: '%s': the memory for %s%s overflows a 64-bit size",
                kvp_simulate_flag_names[named], value, big->what, with);
        return;
    }
    kvp_cli_problem(p, "invalid value for %s: '%s': the run would need %s (%s %s%s), more than the %s "
               "of physical memory",
            kvp_simulate_flag_names[named], value, kvp_cli_format_bytes(total, buf[0], sizeof buf[0]),
            big->what, kvp_cli_format_bytes(big->bytes, buf[1], sizeof buf[1]), with,
            kvp_cli_format_bytes(physical, buf[2], sizeof buf[2]));
}
