/*
 * simulate.c: `kvpager simulate`, many concurrent sequences under one budget.
 *
 * Owns: the order of the command's steps, the runs and the exit status. The
 * flags are simulate_flags.c's, the checks simulate_checks.c's, the report
 * and --json simulate_report.c's (simulate.h maps them); the schedule itself
 * is in sim.c, the workloads in workload.c, the --plot chart in plot.c.
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
 *   4. run (a sharing workload twice: with sharing, then without, for the
 *      side-by-side figures), report, finish the plot.
 * A Mooncake trace without --capacity sets the capacity when it is read: the
 * range checks against the capacity (--reserve-tokens) wait for it, and run
 * again once it is read. A command line with comma lists or --format goes to
 * simulate_sweep.c, which calls steps 1-2 (kvp_simulate_prepare) for every
 * combination before step 4 (kvp_simulate_execute) for each.
 * The first problem found is printed as one line naming the flag and the
 * value. Exit status: 0 when the run finished with every audit clean and no
 * page leaked; 1 when an audit failed or a page leaked; 2 on bad input, an
 * output that cannot be written, or a library error (out of memory
 * included: "AllocationFailed").
 * Callers: dispatch.c (kvp_cli_main) and the CLI tests, through cli.h.
 */
#include <stdlib.h>
#include <string.h>

#include "plot.h"
#include "progress.h"
#include "simulate.h"

/* --samples above 1, --shared-prefix above 0 or --profile conversation. */
static int sharing_workload(const simulate_options *o)
{
    return o->sim.samples > 1 ||
           (o->trace == NULL && (o->workload.shared_prefix > 0 ||
                                 o->workload.profile == KVP_PROFILE_CONVERSATION));
}

/*
 * --trace's rows, in its --trace-format. A Mooncake trace without --capacity
 * sets the capacity to its longest request (prompt + output); with it, a
 * longer line is refused by its number. 0, or -1 with the message printed.
 */
static int load_trace(simulate_options *o, kvp_workload *workload)
{
    char message[512];
    int explicit_capacity = o->value[FLAG_CAPACITY] != NULL;
    int status = o->mooncake
                     ? kvp_workload_load_mooncake(o->trace,
                                                  explicit_capacity ? o->sim.capacity : SIZE_MAX,
                                                  o->ms_per_step, workload, message,
                                                  sizeof message)
                     : kvp_workload_load_trace(o->trace, o->sim.capacity, workload, message,
                                               sizeof message);
    if (status != 0) {
        fprintf(stderr, "kvpager simulate: %s%s\n",
                status == KVP_TRACE_OUT_OF_MEMORY ? "" : "--trace ", message);
        return -1;
    }
    if (o->mooncake && !explicit_capacity) {
        size_t longest = MIN_CAPACITY;
        for (size_t i = 0; i < workload->count; i++) {
            const kvp_workload_request *r = &workload->requests[i];
            longest = r->prompt_tokens + r->output_tokens > longest
                          ? r->prompt_tokens + r->output_tokens
                          : longest;
        }
        o->sim.capacity = longest;
    }
    return 0;
}

/* Steps 1 and 2: every input read and checked; the workload made (simulate.h). */
int kvp_simulate_prepare(int argc, char **argv, simulate_options *o, kvp_workload *workload)
{
    kvp_cli_problems p = {.found = 0};
    kvp_simulate_parse(argc, argv, o, &p);
    if (o->help) {
        kvp_simulate_usage(stdout);
        return -1;
    }
    size_t page_bytes = 0;
    kvp_simulate_check_ranges(o, &p);
    kvp_simulate_tier_check(o, &p);
    if (!p.found) {
        kvp_simulate_check_sizes(o, &p, &page_bytes);
    }
    kvp_simulate_check_workload(o, &p);
    kvp_simulate_check_outputs(o, &p);
    if (p.found) {
        fprintf(stderr, "kvpager simulate: %s\n", p.line);
        return KVP_CLI_USAGE;
    }
    /* The workload is input too: a bad trace row is refused before anything runs. */
    size_t requests = o->workload.requests;
    if (o->trace != NULL) {
        if (load_trace(o, workload) != 0) {
            return KVP_CLI_USAGE;
        }
        requests = workload->count;
        /* 2a again: the checks against the capacity a Mooncake trace set waited for it. */
        o->capacity_pending = 0;
        kvp_simulate_check_ranges(o, &p);
    }
    kvp_simulate_check_memory(o, requests, page_bytes, &p);
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
static int open_outputs(const simulate_options *o, kvp_plot *plot)
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

void kvp_simulate_runs_free(simulate_runs *runs)
{
    kvp_sim_result_free(&runs->result);
    kvp_sim_result_free(&runs->off);
    kvp_sim_result_free(&runs->full);
}

int kvp_simulate_runs_clean(const simulate_runs *runs)
{
    return runs->result.audit_failures == 0 && runs->result.pages_leaked == 0 &&
           runs->off.audit_failures == 0 && runs->off.pages_leaked == 0 &&
           runs->full.audit_failures == 0 && runs->full.pages_leaked == 0;
}

/*
 * Step 4: the run, and for a sharing workload (unless --no-sharing, or in a
 * sweep) the same workload without sharing, not verified, for the side-by-side
 * figures. 0, or nonzero with *err and *context filled.
 */
static int run_all(const simulate_options *o, const kvp_workload *workload, const char *label,
                   simulate_runs *runs, kvp_error *err, const char **context)
{
    runs->compare = sharing_workload(o) && !o->no_sharing && !o->sweep;
    int failed = 0;
    char off_label[64];
    snprintf(off_label, sizeof off_label, "%s --no-sharing", label);
    for (int run = 0; run < 1 + runs->compare && failed == 0; run++) {
        kvp_sim_config config = o->sim;
        if (run == 1) {
            config.sharing = 0;
            config.verify_every = 0;
            config.tier.count = 0; /* nothing published: nothing for a tier */
        }
        kvp_progress progress;
        kvp_progress_init(&progress, run == 0 ? label : off_label, o->quiet);
        failed = kvp_sim_run(&config, workload, kvp_progress_update, &progress,
                             run == 0 ? &runs->result : &runs->off, err, context);
        kvp_progress_finish(&progress);
    }
    return failed;
}

/* The block references of a workload with block ids (0 without). */
static size_t trace_references(const kvp_workload *w)
{
    size_t n = 0;
    for (size_t i = 0; i < w->count; i++) {
        n += w->requests[i].block_count;
    }
    return n;
}

/*
 * The trace's reference figures (simulate.h), for a workload with block ids:
 * its ceiling and an LRU of the blocks the run's pool holds. 0, or -1 when
 * out of memory.
 */
static int trace_figures(simulate_options *o, const kvp_workload *w, const kvp_sim_result *r)
{
    simulate_trace_figures *f = &o->figures;
    memset(f, 0, sizeof *f);
    if (trace_references(w) == 0) {
        return 0;
    }
    kvp_trace_keys keys;
    if (kvp_trace_keys_build(w, KVP_TRACE_KEY_CHAIN, &keys) != 0) {
        return -1;
    }
    kvp_trace_keys_ceiling(&keys, &f->ceiling);
    /* A position takes a page slot in every layer: the pool holds pages / layers positions
     * of every layer, in pages of block_tokens positions. */
    f->lru_blocks = kvp_trace_blocks_of_pages(r->total_pages / o->sim.layers,
                                              o->sim.block_tokens);
    int status = kvp_trace_keys_lru(&keys, f->lru_blocks, &f->lru);
    size_t tier_pages = kvp_simulate_tier_pages(o); /* and one over the pool and its tiers */
    if (status == 0 && tier_pages != 0) {
        f->tier_lru_blocks = kvp_trace_blocks_of_pages(
            (r->total_pages + tier_pages) / o->sim.layers, o->sim.block_tokens);
        status = kvp_trace_keys_lru(&keys, f->tier_lru_blocks, &f->tier_lru);
    }
    kvp_trace_keys_free(&keys);
    for (size_t i = 0; i < w->count; i++) {
        f->workload_prompt_tokens += w->requests[i].prompt_tokens;
    }
    f->present = status == 0;
    return status;
}

/* Step 4 without the outputs (simulate.h). */
int kvp_simulate_execute(simulate_options *o, const kvp_workload *workload, const char *label,
                         simulate_runs *runs)
{
    memset(runs, 0, sizeof *runs);
    kvp_error err;
    const char *context = NULL;
    if (run_all(o, workload, label, runs, &err, &context) != 0 ||
        kvp_simulate_window_run(o, workload, label, runs, &err, &context) != 0) {
        kvp_cli_report("simulate", context != NULL ? context : "running", &err);
        return KVP_CLI_USAGE;
    }
    if (trace_figures(o, workload, &runs->result) != 0) {
        kvp_cli_report_oom("simulate", "the trace's block keys",
                           trace_references(workload) * 2 * sizeof(size_t));
        return KVP_CLI_USAGE;
    }
    if (kvp_latency_compute(&runs->result, &runs->latency) != 0) {
        kvp_cli_report_oom("simulate", "the latency figures",
                           runs->result.requests * sizeof(double));
        return KVP_CLI_USAGE;
    }
    return KVP_CLI_OK;
}

/* Step 4's end: the chart's title and closing; a write error exits 2. */
static int finish_plot(const simulate_options *o, const kvp_workload *workload,
                       const kvp_sim_result *result, const kvp_sim_result *off, kvp_plot *plot,
                       int exit_code)
{
    char title[160];
    snprintf(title, sizeof title, "kvpager simulate: %s, %zu requests, %zu pages",
             o->trace ? "trace" : kvp_profile_name(o->workload.profile), workload->count,
             result->total_pages);
    int error = kvp_plot_finish(plot, result, off, title);
    if (error != 0) {
        fprintf(stderr, "kvpager simulate: --plot %s: %s\n", o->plot, strerror(error));
        return KVP_CLI_USAGE;
    }
    if (!o->json) {
        printf("plot                    %s\n", o->plot);
    }
    return exit_code;
}

/* The report or --json, then the plot: the exit status of a finished run. */
static int report(const simulate_options *o, const kvp_workload *workload,
                  const simulate_runs *runs, kvp_plot *plot)
{
    const kvp_sim_result *r = &runs->result;
    const kvp_sim_result *off = runs->compare ? &runs->off : NULL;
    if (o->json) {
        kvp_simulate_print_json(o, workload, r, off, &runs->latency);
    } else {
        kvp_simulate_print_report(o, workload, r, off, &runs->latency);
    }
    int exit_code = kvp_simulate_runs_clean(runs) ? KVP_CLI_OK : KVP_CLI_FAILED;
    return o->plot != NULL ? finish_plot(o, workload, r, off, plot, exit_code) : exit_code;
}

int kvp_cli_simulate(int argc, char **argv)
{
    if (kvp_simulate_has_list(argc, argv)) {
        return kvp_simulate_sweep(argc, argv);
    }
    simulate_options o;
    kvp_workload workload = {NULL, 0};
    int status = kvp_simulate_prepare(argc, argv, &o, &workload);
    if (status != KVP_CLI_OK) {
        return status < 0 ? KVP_CLI_OK : status;
    }
    if (o.format != SIMULATE_TABLE_NONE) {
        kvp_workload_free(&workload); /* a one-row table: the sweep's path */
        return kvp_simulate_sweep(argc, argv);
    }
    kvp_plot plot = {NULL, NULL, 0, NULL};
    status = open_outputs(&o, &plot);
    if (status != KVP_CLI_OK) {
        kvp_workload_free(&workload);
        return status;
    }
    simulate_runs runs;
    status = kvp_simulate_execute(&o, &workload, "simulate", &runs);
    if (status == KVP_CLI_OK) {
        status = report(&o, &workload, &runs, &plot);
    } else if (o.plot != NULL) {
        kvp_plot_abandon(&plot);
    }
    kvp_simulate_runs_free(&runs);
    kvp_workload_free(&workload);
    return status;
}
