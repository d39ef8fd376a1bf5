/*
 * simulate_window.c: `kvpager simulate --window W --full-every K
 * --sink-tokens S`, sliding-window and hybrid models (issue 21).
 *
 * Owns: the window flags' --help part and checks (which layers slide and
 * the windowed model are sim_window.c's), the run with every layer full
 * that the report compares against, and the report's and --json's window
 * figures.
 * Invariants: without --window nothing here changes a run, the report or
 * --json (the hooks print nothing and run nothing); with it, the checks
 * refuse what cannot run yet: allocator-only runs (their external caches
 * carry no window), as one line naming the flag and the value.
 * Callers: simulate.c, simulate_flags.c, simulate_checks.c,
 * simulate_report.c (their hooks). Public headers only.
 */
#include <math.h>
#include <string.h>

#include "json.h"
#include "progress.h"
#include "simulate.h"

void kvp_simulate_window_usage(FILE *out)
{
    fprintf(out,
            "\nsliding windows (issue 21; docs/simulate.md):\n"
            "  --window W           sliding layers attend to the last W positions (1 to\n"
            "                       --capacity); their pages outside every window go back\n"
            "                       to the pool, and admission counts the pages a sliding\n"
            "                       layer can hold at once (about W / block-tokens + 2),\n"
            "                       not the full length. The report adds pages held by\n"
            "                       kind of layer, sliding-layer pages released, and a\n"
            "                       second run of the same workload with every layer full\n"
            "                       (timed) for the concurrency against it. With sharing,\n"
            "                       a sliding layer's prefix hit needs only the blocks of\n"
            "                       its window. Needs a computed run (not --no-compute:\n"
            "                       allocator-only caches carry no window) (default:\n"
            "                       every layer full)\n"
            "  --full-every K       one full layer per K layers, the rest sliding: layers\n"
            "                       K-1, 2K-1, ... (counting from 0) are full. K = 6 is\n"
            "                       Gemma 3's 5:1 pattern (layers 5, 11, ... full). K >= 2;\n"
            "                       needs --window (default: every layer slides)\n"
            "  --sink-tokens S      the sliding layers also attend to positions 0 .. S-1\n"
            "                       (StreamingLLM's attention sinks; their pages are never\n"
            "                       released), 0 to --capacity; needs --window (default 0)\n");
}

/* "<flag> <value> needs <what>" for a given flag. */
static void needs(kvp_cli_problems *p, const simulate_options *o, simulate_flag f,
                  const char *what)
{
    kvp_cli_problem(p, "invalid value for %s: '%s': needs %s", kvp_simulate_flag_names[f],
                    o->value[f], what);
}

/* Each window flag's range; a capacity a Mooncake trace sets is checked once read. */
static void window_ranges(simulate_options *o, kvp_cli_problems *p)
{
    const kvp_sim_config *c = &o->sim;
    char why[96];
    int capacity_known = !o->capacity_pending && c->capacity >= MIN_CAPACITY;
    snprintf(why, sizeof why, "must be from 1 to --capacity %zu (the positions a layer holds)",
             c->capacity);
    if (o->value[FLAG_WINDOW] != NULL &&
        (c->window == 0 || (capacity_known && c->window > c->capacity))) {
        kvp_simulate_invalid(p, FLAG_WINDOW, o->value[FLAG_WINDOW],
                             capacity_known ? why : "must be at least 1");
    }
    if (o->value[FLAG_FULL_EVERY] != NULL && c->full_every < 2) {
        kvp_simulate_invalid(p, FLAG_FULL_EVERY, o->value[FLAG_FULL_EVERY],
                             "must be at least 2 (1 would make every layer full)");
    }
    snprintf(why, sizeof why, "must be from 0 to --capacity %zu", c->capacity);
    if (o->value[FLAG_SINK_TOKENS] != NULL && capacity_known && c->sink_tokens > c->capacity) {
        kvp_simulate_invalid(p, FLAG_SINK_TOKENS, o->value[FLAG_SINK_TOKENS], why);
    }
}

void kvp_simulate_check_window(simulate_options *o, simulate_flag f, kvp_cli_problems *p)
{
    (void)f;
    window_ranges(o, p);
    if (o->value[FLAG_WINDOW] == NULL) {
        if (o->value[FLAG_FULL_EVERY] != NULL) {
            needs(p, o, FLAG_FULL_EVERY, "--window (it says which layers stay full)");
        }
        if (o->value[FLAG_SINK_TOKENS] != NULL) {
            needs(p, o, FLAG_SINK_TOKENS, "--window (sinks belong to sliding layers)");
        }
        return;
    }
    if (!o->sim.compute) {
        needs(p, o, FLAG_WINDOW,
              "a computed run, not --no-compute: the allocator-only run's external caches "
              "carry no window yet");
    }
}

int kvp_simulate_window_run(simulate_options *o, const kvp_workload *workload,
                            const char *label, simulate_runs *runs, kvp_error *err,
                            const char **context)
{
    o->every_layer_full = NULL;
    if (o->sim.window == 0 || o->sweep) {
        return 0;
    }
    kvp_sim_config config = o->sim;
    config.window = 0;
    config.full_every = 0;
    config.sink_tokens = 0;
    config.verify_every = 0;
    char full_label[64];
    snprintf(full_label, sizeof full_label, "%s (every layer full)", label);
    kvp_progress progress;
    kvp_progress_init(&progress, full_label, o->quiet);
    int failed = kvp_sim_run(&config, workload, kvp_progress_update, &progress, &runs->full,
                             err, context);
    kvp_progress_finish(&progress);
    if (failed == 0) {
        o->every_layer_full = &runs->full;
    }
    return failed;
}

static double ratio_of(double a, double b)
{
    return b > 0.0 ? a / b : NAN;
}

/* "layers 5, 11" (the full ones), at most a few named, into buf. */
static void full_layers_named(const kvp_sim_config *c, char *buf, size_t size)
{
    size_t used = 0;
    size_t named = 0;
    buf[0] = '\0';
    for (size_t l = 0; l < c->layers && used < size; l++) {
        if (kvp_sim_layer_window(c, l) != 0) {
            continue;
        }
        if (named == 4) {
            snprintf(buf + used, size - used, ", ...");
            return;
        }
        int n = snprintf(buf + used, size - used, "%s%zu", named == 0 ? "" : ", ", l);
        used += n > 0 ? (size_t)n : 0;
        named++;
    }
    if (named == 0) {
        snprintf(buf, size, "none");
    }
}

void kvp_simulate_print_window(const simulate_options *o, const kvp_sim_result *r)
{
    const kvp_sim_config *c = &o->sim;
    if (c->window == 0) {
        return;
    }
    char full[64];
    full_layers_named(c, full, sizeof full);
    size_t sliding = kvp_sim_sliding_layers(c);
    printf("sliding windows         W %zu, sink tokens %zu: %zu sliding and %zu full layers "
           "(full: %s)\n",
           c->window, c->sink_tokens, sliding, c->layers - sliding, full);
    printf("pages held by kind      peak after a step: sliding layers %zu, full layers %zu\n",
           r->peak_sliding_pages, r->peak_full_pages);
    printf("sliding pages released  %llu (blocks no window reaches any more, back to the "
           "pool)\n",
           (unsigned long long)r->window_releases);
    const kvp_sim_result *f = o->every_layer_full;
    if (f == NULL) {
        return;
    }
    printf("every layer full        the same workload again with every layer full, run after "
           "this one\n"
           "                        for the figures below: %.2f s\n",
           f->seconds);
    printf("side by side            %-14s%-14sratio\n", "windows", "every full");
    const struct {
        const char *label;
        double a, b;
        int decimals;
    } rows[] = {
        {"concurrent peak", (double)r->peak_concurrent, (double)f->peak_concurrent, 0},
        {"concurrent mean", r->mean_concurrent, f->mean_concurrent, 1},
        {"throughput (tok/s)", r->tokens_per_second, f->tokens_per_second, 1},
        {"held pages peak", (double)r->peak_held_pages, (double)f->peak_held_pages, 0},
        {"steps", (double)r->steps, (double)f->steps, 0},
        {"preemptions", (double)r->preemptions, (double)f->preemptions, 0},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        char a[32];
        char b[32];
        snprintf(a, sizeof a, "%.*f", rows[i].decimals, rows[i].a);
        snprintf(b, sizeof b, "%.*f", rows[i].decimals, rows[i].b);
        double x = ratio_of(rows[i].a, rows[i].b);
        if (isnan(x)) {
            printf("  %-22s%-14s%-14s-\n", rows[i].label, a, b);
        } else {
            printf("  %-22s%-14s%-14s%.2fx\n", rows[i].label, a, b, x);
        }
    }
    if (o->sim.sharing) { /* the hit rule for windows against every layer full */
        printf("  %-22s%-14.1f%-14.1f%+.1f points\n", "prefix hit rate (%)",
               100.0 * r->prefix_hit_rate, 100.0 * f->prefix_hit_rate,
               100.0 * (r->prefix_hit_rate - f->prefix_hit_rate));
    }
}

void kvp_simulate_json_window(kvp_json *json, const simulate_options *o,
                              const kvp_sim_result *r)
{
    const kvp_sim_config *c = &o->sim;
    if (c->window == 0) {
        return;
    }
    kvp_json_object_begin(json, "windows");
    kvp_json_uint(json, "window", c->window);
    kvp_json_uint(json, "full_every", c->full_every);
    kvp_json_uint(json, "sink_tokens", c->sink_tokens);
    kvp_json_uint(json, "sliding_layers", kvp_sim_sliding_layers(c));
    kvp_json_uint(json, "full_layers", c->layers - kvp_sim_sliding_layers(c));
    kvp_json_uint(json, "peak_sliding_pages", r->peak_sliding_pages);
    kvp_json_uint(json, "peak_full_pages", r->peak_full_pages);
    kvp_json_uint(json, "sliding_pages_released", r->window_releases);
    const kvp_sim_result *f = o->every_layer_full;
    if (f == NULL) {
        kvp_json_double(json, "full_concurrency_ratio", NAN);
        kvp_json_double(json, "every_layer_full", NAN);
        kvp_json_object_end(json);
        return;
    }
    kvp_json_double(json, "full_concurrency_ratio",
                    ratio_of((double)r->peak_concurrent, (double)f->peak_concurrent));
    kvp_json_object_begin(json, "every_layer_full");
    kvp_json_uint(json, "requests_completed", f->requests_completed);
    kvp_json_uint(json, "tokens_generated", f->tokens_generated);
    kvp_json_double(json, "tokens_per_second", f->tokens_per_second);
    kvp_json_double(json, "seconds", f->seconds);
    kvp_json_uint(json, "steps", f->steps);
    kvp_json_uint(json, "peak_concurrent_sequences", f->peak_concurrent);
    kvp_json_double(json, "mean_concurrent_sequences", f->mean_concurrent);
    kvp_json_uint(json, "peak_held_pages", f->peak_held_pages);
    kvp_json_uint(json, "preemptions", f->preemptions);
    kvp_json_double(json, "prefix_hit_rate", f->prefix_hit_rate);
    kvp_json_uint(json, "pages_leaked", f->pages_leaked);
    kvp_json_uint(json, "audit_failures", f->audit_failures);
    kvp_json_object_end(json);
    kvp_json_object_end(json);
}
