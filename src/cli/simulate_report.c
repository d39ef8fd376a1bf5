/*
 * simulate_report.c: what `kvpager simulate` prints after a run: the human
 * report and the --json object.
 *
 * Owns: the report's lines and the JSON keys (docs/simulate.md documents
 * both), the sharegpt targets (a run that completed no request meets none),
 * and the derived figures (means of the workload, K/V bytes per token, the
 * gain over f64 pages, hit rates of weight-update windows).
 * Invariants: reads the options and the results only; a ratio whose
 * denominator is 0 is NaN (JSON null, "-" in the report); the figures of
 * the run without sharing appear only when that run was made (off != NULL).
 * Callers: simulate.c, once per finished run.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>

#include "json.h"
#include "latency.h"
#include "simulate.h"

/* The level decode attention ran at: f64 pages are always exact. */
static const char *accum_name(const kvp_sim_config *c)
{
    return c->accum == KVP_ACCUM_FAST && c->kv_dtype != KVP_F64 ? "fast" : "exact";
}

/* The workload's prompt tokens, each request's once (samples share a prompt). */
static uint64_t workload_prompt_tokens(const kvp_workload *w)
{
    uint64_t sum = 0;
    for (size_t i = 0; i < w->count; i++) {
        sum += w->requests[i].prompt_tokens;
    }
    return sum;
}

/* Tokens prefilled again after preemption, over every request (kvp_request_result's). */
static uint64_t recomputed_tokens(const kvp_sim_result *r)
{
    uint64_t sum = 0;
    for (size_t i = 0; r->request_log != NULL && i < r->requests; i++) {
        sum += r->request_log[i].recomputed_tokens;
    }
    return sum;
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

/* The first-admission hit rate: prefix hits over the workload's prompt tokens, each once. */
static double first_admission_rate(const simulate_options *o, const kvp_sim_result *r)
{
    return ratio((double)r->first_hit_tokens, (double)o->figures.workload_prompt_tokens);
}

/* A trace with block ids: its ceiling, the same-capacity LRU, kvpager against the ceiling. */
static void print_trace(const simulate_options *o, const kvp_sim_result *r)
{
    const simulate_trace_figures *f = &o->figures;
    if (!f->present) {
        return;
    }
    double ceiling = kvp_trace_token_rate(&f->ceiling);
    printf("trace ceiling           %.1f%% of prompt tokens (%zu of %zu; %.1f%% of %zu block "
           "references):\n"
           "                        what a prefix cache that never forgets would hit\n",
           100.0 * ceiling, f->ceiling.hit_tokens, f->ceiling.tokens,
           100.0 * kvp_trace_rate(&f->ceiling), f->ceiling.references);
    printf("same-capacity LRU       %.1f%% of prompt tokens (%.1f%% of blocks): an LRU of %zu "
           "blocks of %d tokens,\n"
           "                        what the pool's pages hold\n",
           100.0 * kvp_trace_token_rate(&f->lru), 100.0 * kvp_trace_rate(&f->lru),
           f->lru_blocks, KVP_MOONCAKE_BLOCK_TOKENS);
    if (f->tier_lru_blocks != 0) {
        printf("pool+tier LRU           %.1f%% of prompt tokens (%.1f%% of blocks): an LRU of %zu "
               "blocks of %d tokens,\n"
               "                        what the pool's pages and the --tier sizes hold\n",
               100.0 * kvp_trace_token_rate(&f->tier_lru), 100.0 * kvp_trace_rate(&f->tier_lru),
               f->tier_lru_blocks, KVP_MOONCAKE_BLOCK_TOKENS);
    }
    double rate = first_admission_rate(o, r);
    printf("kvpager prefix hits     %.1f%% of prompt tokens (%llu of %llu, first admissions "
           "only): %.1f%% of the ceiling\n",
           100.0 * rate, (unsigned long long)r->first_hit_tokens,
           (unsigned long long)f->workload_prompt_tokens, 100.0 * ratio(rate, ceiling));
}

/* The --json keys of print_trace (null without block ids). */
static void json_trace(kvp_json *json, const simulate_options *o, const kvp_sim_result *r)
{
    const simulate_trace_figures *f = &o->figures;
    int on = f->present;
    double ceiling = on ? kvp_trace_token_rate(&f->ceiling) : NAN;
    double rate = on ? first_admission_rate(o, r) : NAN;
    kvp_json_double(json, "trace_ceiling_hit_rate", ceiling);
    kvp_json_double(json, "trace_ceiling_block_hit_rate", on ? kvp_trace_rate(&f->ceiling) : NAN);
    kvp_json_double(json, "trace_lru_blocks", on ? (double)f->lru_blocks : NAN);
    kvp_json_double(json, "trace_lru_hit_rate", on ? kvp_trace_token_rate(&f->lru) : NAN);
    kvp_json_double(json, "trace_lru_block_hit_rate", on ? kvp_trace_rate(&f->lru) : NAN);
    int tier = on && f->tier_lru_blocks != 0; /* pool+tier LRU: null without a host tier */
    kvp_json_double(json, "trace_tier_lru_blocks", tier ? (double)f->tier_lru_blocks : NAN);
    kvp_json_double(json, "trace_tier_lru_hit_rate",
                    tier ? kvp_trace_token_rate(&f->tier_lru) : NAN);
    kvp_json_uint(json, "first_admission_hit_tokens", r->first_hit_tokens);
    kvp_json_double(json, "first_admission_hit_rate", rate);
    kvp_json_double(json, "hit_rate_of_ceiling", on ? ratio(rate, ceiling) : NAN);
}

/* The figures of the latency lines: label, --json key, unit (1: seconds), decimals. */
typedef struct latency_row {
    const char *label;
    const char *key;
    size_t offset; /* of its kvp_latency_stat in kvp_latency */
    int seconds;
    int decimals;
} latency_row;

#define LATENCY_ROW(label, field, seconds, decimals) \
    {label, #field, offsetof(kvp_latency, field), seconds, decimals}

static const latency_row latency_rows[] = {
    LATENCY_ROW("queueing", queue_steps, 0, 0),
    LATENCY_ROW("time to first token", ttft_steps, 0, 0),
    LATENCY_ROW("time per output token", tpot_steps, 0, 2),
    LATENCY_ROW("end to end", e2e_steps, 0, 0),
    LATENCY_ROW("recomputed tokens", recomputed_tokens, 0, 0),
    LATENCY_ROW("queueing", queue_seconds, 1, 4),
    LATENCY_ROW("time to first token", ttft_seconds, 1, 4),
    LATENCY_ROW("time per output token", tpot_seconds, 1, 4),
    LATENCY_ROW("end to end", e2e_seconds, 1, 4),
};
#define LATENCY_ROWS (sizeof latency_rows / sizeof latency_rows[0])

static const kvp_latency_stat *latency_stat(const kvp_latency *l, const latency_row *row)
{
    return (const kvp_latency_stat *)(const void *)((const char *)l + row->offset);
}

/* Per-request latency percentiles (latency.h); seconds only for a computed run. */
static void print_latency(const simulate_options *o, const kvp_latency *l)
{
    printf("latency in steps        p50 / p90 / p99 (nearest rank) over %zu completed requests\n",
           l->e2e_steps.count);
    for (size_t i = 0; i < LATENCY_ROWS; i++) {
        const latency_row *row = &latency_rows[i];
        if (row->seconds && !o->sim.compute) {
            continue;
        }
        if (row->seconds && !latency_rows[i - 1].seconds) {
            printf("latency in seconds      p50 / p90 / p99, from the steps' timestamps\n");
        }
        const kvp_latency_stat *st = latency_stat(l, row);
        char unit[16];
        snprintf(unit, sizeof unit, "%s", row->seconds ? " s" : i == 4 ? " tokens" : " steps");
        printf("  %-22s%.*f / %.*f / %.*f%s\n", row->label, row->decimals, st->p50,
               row->decimals, st->p90, row->decimals, st->p99, unit);
    }
}

static void json_latency(kvp_json *json, const simulate_options *o, const kvp_latency *l)
{
    kvp_json_object_begin(json, "latency");
    kvp_json_uint(json, "requests", l->e2e_steps.count);
    for (size_t i = 0; i < LATENCY_ROWS; i++) {
        const latency_row *row = &latency_rows[i];
        const kvp_latency_stat *st = latency_stat(l, row);
        int shown = !row->seconds || o->sim.compute;
        kvp_json_object_begin(json, row->key);
        kvp_json_double(json, "p50", shown ? st->p50 : NAN);
        kvp_json_double(json, "p90", shown ? st->p90 : NAN);
        kvp_json_double(json, "p99", shown ? st->p99 : NAN);
        kvp_json_object_end(json);
    }
    kvp_json_object_end(json);
}

/* The sharing figures, the weight updates, verification and the run without sharing. */
static void print_sharing(const simulate_options *o, const kvp_sim_result *r,
                          const kvp_sim_result *off)
{
    const kvp_sim_config *c = &o->sim;
    printf("sharing                 %s: prefix hits %llu of %llu prompt tokens admitted "
           "(%.1f%%;\n"
           "                        recomputation included), %llu forks\n",
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
    if (off == NULL && c->sharing && o->figures.present) {
        printf("comparison run          none: a trace's sharing is measured against its ceiling "
               "and the\n"
               "                        same-capacity LRU below; run it again with --no-sharing "
               "for the\n"
               "                        figures without sharing (a second replay of the trace)\n");
    }
    if (off != NULL) {
        printf("comparison run          the same workload again without sharing (--no-sharing),\n"
               "                        run after this one for the figures below: %.2f s\n",
               off->seconds);
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

void kvp_simulate_print_report(const simulate_options *o, const kvp_workload *w,
                               const kvp_sim_result *r, const kvp_sim_result *off,
                               const kvp_latency *latency)
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
           "(%zu positions, kv_dtype %s, %s attention); capacity %zu; %zu thread%s%s%s\n\n",
           c->layers, c->model_width, c->heads, kvp_sim_kv_heads(c),
           kvp_cli_format_bytes(kv_bytes_per_token(c), per_token, sizeof per_token),
           kvp_cli_format_bytes(c->budget_bytes, budget, sizeof budget), r->total_pages,
           kvp_cli_format_bytes(r->page_bytes, page, sizeof page), c->block_tokens,
           kvp_dtype_name(r->kv_dtype), accum_name(c), c->capacity, r->threads, r->threads == 1 ? "" : "s",
           c->compute ? "" : ", allocator only",
           r->fused_layers > 1 ? " (pages fused: each pool page a block of every layer)" : "");
    printf("requests completed      %zu of %zu (%zu rejected as never fitting)\n",
           r->requests_completed, r->requests, r->requests_rejected);
    printf("tokens generated        %llu\n", (unsigned long long)r->tokens_generated);
    printf("prompt tokens           %llu (the workload's, each request's once), %llu of them "
           "adopted\n"
           "                        from the prefix cache at first admission\n",
           (unsigned long long)workload_prompt_tokens(w), (unsigned long long)r->first_hit_tokens);
    printf("recomputed tokens       %llu (prefilled again after preemption)\n",
           (unsigned long long)recomputed_tokens(r));
    if (c->compute) {
        printf("throughput              %.1f generated tokens/s over %.2f s\n",
               r->tokens_per_second, r->seconds);
    } else {
        printf("throughput              %.1f steps/s over %.2f s (allocator only: no token is "
               "computed)\n",
               ratio((double)r->steps, r->seconds), r->seconds);
    }
    printf("steps                   %zu\n", r->steps);
    printf("concurrent sequences    peak %zu, mean %.1f\n", r->peak_concurrent,
           r->mean_concurrent);
    printf("pool utilization        peak %.1f%%, mean %.1f%%\n", 100.0 * r->peak_utilization,
           100.0 * r->mean_utilization);
    printf("internal fragmentation  %.2f%% of held slots\n", 100.0 * r->internal_fragmentation);
    printf("preemptions             %zu\n", r->preemptions);
    print_latency(o, latency);
    print_sharing(o, r, off);
    kvp_simulate_tier_report(o, r);
    kvp_simulate_print_window(o, r);
    print_trace(o, r);
    if (r->contiguous_baseline > 0) {
        printf("contiguous baseline     %zu sequences fit when each reserves its full capacity;\n"
               "                        paging held %zu at peak: %.2fx\n",
               r->contiguous_baseline, r->peak_concurrent, r->concurrency_ratio);
    } else {
        printf("contiguous baseline     0 sequences: one full-capacity reservation exceeds the "
               "budget\n");
    }
    if (r->kv_dtype == KVP_F64) {
        printf("kv dtype                f64, 8 bytes per element: the pages hold %zu "
               "full-capacity sequences\n",
               r->full_sequences);
    } else {
        printf("kv dtype                %s, %zu bytes per element: the pages hold %zu "
               "full-capacity sequences,\n"
               "                        %zu in f64 pages of the same budget: %+lld (%.2fx)\n",
               kvp_dtype_name(r->kv_dtype), r->element_bytes, r->full_sequences,
               r->f64_full_sequences,
               (long long)r->full_sequences - (long long)r->f64_full_sequences, dtype_gain(r));
    }
    printf("final audit             %s: %zu of %zu audits failed, %zu pages leaked, "
           "acquires %llu, releases %llu\n",
           r->audit_failures == 0 && r->pages_leaked == 0 ? "ok" : "FAILED", r->audit_failures,
           r->audits, r->pages_leaked, (unsigned long long)r->acquires,
           (unsigned long long)r->releases);
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
    kvp_json_double(json, "seconds", off->seconds);
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

void kvp_simulate_print_json(const simulate_options *o, const kvp_workload *w,
                             const kvp_sim_result *r, const kvp_sim_result *off,
                             const kvp_latency *latency)
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
    kvp_json_uint(&json, "workload_prompt_tokens", workload_prompt_tokens(w));
    kvp_json_uint(&json, "recomputed_tokens", recomputed_tokens(r));
    kvp_json_double(&json, "steps_per_second", ratio((double)r->steps, r->seconds));
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
    kvp_simulate_tier_json(&json, r);
    json_trace(&json, o, r);
    kvp_simulate_json_window(&json, o, r);
    json_latency(&json, o, latency);
    kvp_json_object_begin(&json, "config");
    kvp_json_string(&json, "workload", o->trace ? o->trace : kvp_profile_name(o->workload.profile));
    kvp_json_string(&json, "arrival", o->trace ? "trace" : kvp_arrival_name(o->workload.arrival));
    kvp_json_string(&json, "trace_format", o->trace ? (o->mooncake ? "mooncake" : "csv") : "none");
    kvp_json_uint(&json, "ms_per_step", o->ms_per_step);
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
