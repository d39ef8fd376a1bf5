/*
 * simulate.c: `kvpager simulate`, many concurrent sequences under one budget.
 *
 * Owns: the command line (every knob of sim.h and workload.h has a flag), the
 * human report, the --json object and the --plot chart. The schedule itself is
 * in sim.c, the workloads in workload.c.
 * Exit status: 0 when the run finished with every audit clean and no page
 * leaked; 1 when an audit failed or a page leaked; 2 on usage, trace or
 * library errors (a bad trace runs nothing).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json.h"
#include "plot.h"
#include "progress.h"
#include "sim.h"
#include "workload.h"

typedef struct options {
    kvp_sim_config sim;
    kvp_workload_spec workload;
    const char *trace;
    const char *plot;
    int json;
    int quiet;
} options;

static void simulate_usage(FILE *out)
{
    kvp_sim_config d;
    kvp_sim_config_init(&d);
    fprintf(out,
            "usage: kvpager simulate [options]\n\n"
            "Serves a stream of requests by continuous batching: many sequences, one cache\n"
            "per layer each, all drawing pages from one pool under one memory budget.\n"
            "Requests are admitted first come first served while pages allow (keeping a\n"
            "watermark free), every running sequence decodes one token per step with real\n"
            "attention, and when a step cannot get its pages the newest sequence is\n"
            "preempted by recompute. The report compares peak concurrency with the\n"
            "contiguous layout that reserves [B,H,C,d_h] per layer up front.\n\n"
            "model and pool:\n"
            "  --layers N           decoder layers (default %zu)\n"
            "  --model-width N      model width D (default %zu)\n"
            "  --heads N            attention heads; D must be a multiple (default %zu)\n"
            "  --block-tokens N     positions per page (default %zu)\n"
            "  --budget SIZE        pool budget, e.g. 64MiB, 1GiB, 500MB (default 32MiB)\n"
            "  --capacity N         positions a sequence may hold (default %zu)\n"
            "workload:\n"
            "  --requests N         number of requests (default 128)\n"
            "  --profile NAME       sharegpt (prompt ~161, output ~338, heavy-tailed),\n"
            "                       alpaca (~19, ~58) or uniform (default sharegpt)\n"
            "  --prompt-mean X      mean prompt length (default: the profile's)\n"
            "  --output-mean X      mean output length (default: the profile's)\n"
            "  --sigma X            lognormal shape of lengths (default: the profile's)\n"
            "  --arrival NAME       poisson, uniform or burst (default poisson)\n"
            "  --rate X             arrivals per scheduler step (default 1.0)\n"
            "  --trace FILE         read requests from a CSV of\n"
            "                       arrival_step,prompt_tokens,output_tokens instead\n"
            "scheduling and run:\n"
            "  --watermark F        fraction of pages kept free at admission (default %.2f)\n"
            "  --reserve-tokens N   decoding reserve promised at admission (default %zu)\n"
            "  --threads N          decoder threads, 0 = one per core (default 0)\n"
            "  --seed N             seed of weights, lengths, arrivals, inputs (default %llu)\n"
            "  --no-compute         allocator-only run: pages move, no attention math\n"
            "  --audit-every N      steps between pool audits (default %zu)\n"
            "output:\n"
            "  --json               print one JSON object instead of the report\n"
            "  --plot FILE.svg      draw pages in use and running sequences per step\n"
            "  --quiet              no progress line (it shows only on a terminal anyway)\n"
            "  --help               show this help\n\n"
            "exit status: 0 clean run, 1 audit failure or leaked pages, 2 errors.\n",
            d.layers, d.model_width, d.heads, d.block_tokens, d.capacity, d.watermark,
            d.reserve_tokens, (unsigned long long)d.seed, d.audit_every);
}

static int bad_value(const char *flag, const char *value)
{
    fprintf(stderr, "kvpager simulate: invalid value for %s: '%s'\n", flag, value);
    return KVP_CLI_USAGE;
}

/* Parses one "--flag value" pair; returns KVP_CLI_OK or an exit code. */
static int parse_valued(options *o, const char *flag, const char *value)
{
    static const struct {
        const char *flag;
        size_t offset;
    } sizes[] = {
        {"--layers", offsetof(options, sim.layers)},
        {"--model-width", offsetof(options, sim.model_width)},
        {"--heads", offsetof(options, sim.heads)},
        {"--block-tokens", offsetof(options, sim.block_tokens)},
        {"--capacity", offsetof(options, sim.capacity)},
        {"--requests", offsetof(options, workload.requests)},
        {"--reserve-tokens", offsetof(options, sim.reserve_tokens)},
        {"--threads", offsetof(options, sim.threads)},
        {"--audit-every", offsetof(options, sim.audit_every)},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        if (strcmp(flag, sizes[i].flag) == 0) {
            size_t *field = (size_t *)(void *)((char *)o + sizes[i].offset);
            return kvp_cli_parse_size(value, field) == 0 ? KVP_CLI_OK : bad_value(flag, value);
        }
    }
    static const struct {
        const char *flag;
        size_t offset;
    } reals[] = {
        {"--prompt-mean", offsetof(options, workload.prompt_mean)},
        {"--output-mean", offsetof(options, workload.output_mean)},
        {"--sigma", offsetof(options, workload.sigma)},
        {"--rate", offsetof(options, workload.rate)},
        {"--watermark", offsetof(options, sim.watermark)},
    };
    for (size_t i = 0; i < sizeof reals / sizeof reals[0]; i++) {
        if (strcmp(flag, reals[i].flag) == 0) {
            double *field = (double *)(void *)((char *)o + reals[i].offset);
            return kvp_cli_parse_double(value, field) == 0 && *field >= 0.0
                       ? KVP_CLI_OK
                       : bad_value(flag, value);
        }
    }
    size_t seed = 0;
    if (strcmp(flag, "--seed") == 0) {
        if (kvp_cli_parse_size(value, &seed) != 0) {
            return bad_value(flag, value);
        }
        o->sim.seed = seed;
        o->workload.seed = seed;
        return KVP_CLI_OK;
    }
    if (strcmp(flag, "--budget") == 0) {
        return kvp_cli_parse_bytes(value, &o->sim.budget_bytes) == 0 ? KVP_CLI_OK
                                                                      : bad_value(flag, value);
    }
    if (strcmp(flag, "--profile") == 0) {
        return kvp_profile_parse(value, &o->workload.profile) == 0 ? KVP_CLI_OK
                                                                     : bad_value(flag, value);
    }
    if (strcmp(flag, "--arrival") == 0) {
        return kvp_arrival_parse(value, &o->workload.arrival) == 0 ? KVP_CLI_OK
                                                                     : bad_value(flag, value);
    }
    if (strcmp(flag, "--trace") == 0) {
        o->trace = value;
        return KVP_CLI_OK;
    }
    if (strcmp(flag, "--plot") == 0) {
        o->plot = value;
        return KVP_CLI_OK;
    }
    fprintf(stderr, "kvpager simulate: unknown option '%s'\n", flag);
    return KVP_CLI_USAGE;
}

static int parse_options(int argc, char **argv, options *o)
{
    memset(o, 0, sizeof *o);
    kvp_sim_config_init(&o->sim);
    o->workload.profile = KVP_PROFILE_SHAREGPT;
    o->workload.arrival = KVP_ARRIVAL_POISSON;
    o->workload.rate = 1.0;
    o->workload.requests = 128;
    o->workload.seed = o->sim.seed;
    for (int i = 1; i < argc; i++) {
        const char *flag = argv[i];
        if (strcmp(flag, "--help") == 0 || strcmp(flag, "-h") == 0) {
            simulate_usage(stdout);
            return -1;
        }
        if (strcmp(flag, "--json") == 0) {
            o->json = 1;
        } else if (strcmp(flag, "--quiet") == 0) {
            o->quiet = 1;
        } else if (strcmp(flag, "--no-compute") == 0) {
            o->sim.compute = 0;
        } else if (i + 1 < argc) {
            int status = parse_valued(o, flag, argv[++i]);
            if (status != KVP_CLI_OK) {
                return status;
            }
        } else {
            fprintf(stderr, "kvpager simulate: %s needs a value (see --help)\n", flag);
            return KVP_CLI_USAGE;
        }
    }
    if (o->sim.layers == 0 || o->sim.capacity == 0 || o->workload.requests == 0 ||
        o->workload.rate <= 0.0 || o->sim.watermark >= 1.0) {
        fprintf(stderr, "kvpager simulate: --layers, --capacity, --requests and --rate must be "
                        "positive and --watermark below 1\n");
        return KVP_CLI_USAGE;
    }
    o->workload.capacity = o->sim.capacity;
    kvp_workload_spec_defaults(&o->workload);
    return KVP_CLI_OK;
}

static double mean_of(const kvp_workload *w, int prompt)
{
    double sum = 0.0;
    for (size_t i = 0; i < w->count; i++) {
        sum += (double)(prompt ? w->requests[i].prompt_tokens : w->requests[i].output_tokens);
    }
    return w->count > 0 ? sum / (double)w->count : 0.0;
}

/* The targets of the sharegpt profile at the default budget. */
static int targets_met(const kvp_sim_result *r)
{
    return r->concurrency_ratio >= 3.0 && r->internal_fragmentation < 0.05 &&
           r->pages_leaked == 0 && r->audit_failures == 0;
}

static void print_report(const options *o, const kvp_workload *w, const kvp_sim_result *r)
{
    const kvp_sim_config *c = &o->sim;
    char budget[32];
    char page[32];
    printf("kvpager simulate: %s, %zu requests (mean prompt %.1f, mean output %.1f tokens)\n",
           o->trace ? o->trace : kvp_profile_name(o->workload.profile), w->count,
           mean_of(w, 1), mean_of(w, 0));
    printf("model: %zu layers, width %zu, %zu heads; pool: %s budget = %zu pages of %s "
           "(%zu positions); capacity %zu; %zu thread%s%s\n\n",
           c->layers, c->model_width, c->heads,
           kvp_cli_format_bytes(c->budget_bytes, budget, sizeof budget), r->total_pages,
           kvp_cli_format_bytes(r->page_bytes, page, sizeof page), c->block_tokens, c->capacity,
           r->threads, r->threads == 1 ? "" : "s", c->compute ? "" : ", allocator only");
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
    if (r->contiguous_baseline > 0) {
        printf("contiguous baseline     %zu sequences fit when each reserves its full capacity;\n"
               "                        paging held %zu at peak: %.2fx\n",
               r->contiguous_baseline, r->peak_concurrent, r->concurrency_ratio);
    } else {
        printf("contiguous baseline     0 sequences: one full-capacity reservation exceeds the "
               "budget\n");
    }
    printf("final audit             %s: %zu of %zu audits failed, %zu pages leaked, "
           "acquires %llu, releases %llu\n",
           r->audit_failures == 0 && r->pages_leaked == 0 ? "ok" : "FAILED", r->audit_failures,
           r->audits, r->pages_leaked, (unsigned long long)r->acquires,
           (unsigned long long)r->releases);
    if (o->trace == NULL && o->workload.profile == KVP_PROFILE_SHAREGPT) {
        printf("sharegpt targets        concurrency ratio >= 3: %s, fragmentation < 5%%: %s, "
               "no leaks: %s, clean audits: %s\n",
               r->concurrency_ratio >= 3.0 ? "yes" : "no",
               r->internal_fragmentation < 0.05 ? "yes" : "no",
               r->pages_leaked == 0 ? "yes" : "no", r->audit_failures == 0 ? "yes" : "no");
    }
}

static void print_json(const options *o, const kvp_workload *w, const kvp_sim_result *r)
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
    kvp_json_double(&json, "output_checksum", r->output_checksum);
    kvp_json_bool(&json, "targets_met", targets_met(r));
    kvp_json_object_begin(&json, "config");
    kvp_json_string(&json, "workload", o->trace ? o->trace : kvp_profile_name(o->workload.profile));
    kvp_json_string(&json, "arrival", o->trace ? "trace" : kvp_arrival_name(o->workload.arrival));
    kvp_json_double(&json, "rate", o->workload.rate);
    kvp_json_double(&json, "mean_prompt_tokens", mean_of(w, 1));
    kvp_json_double(&json, "mean_output_tokens", mean_of(w, 0));
    kvp_json_uint(&json, "layers", c->layers);
    kvp_json_uint(&json, "model_width", c->model_width);
    kvp_json_uint(&json, "heads", c->heads);
    kvp_json_uint(&json, "block_tokens", c->block_tokens);
    kvp_json_uint(&json, "budget_bytes", c->budget_bytes);
    kvp_json_uint(&json, "capacity", c->capacity);
    kvp_json_uint(&json, "threads", r->threads);
    kvp_json_uint(&json, "seed", c->seed);
    kvp_json_double(&json, "watermark", c->watermark);
    kvp_json_uint(&json, "reserve_tokens", c->reserve_tokens);
    kvp_json_bool(&json, "compute", c->compute);
    kvp_json_object_end(&json);
    kvp_json_object_end(&json);
}

int kvp_cli_simulate(int argc, char **argv)
{
    options o;
    int status = parse_options(argc, argv, &o);
    if (status != KVP_CLI_OK) {
        return status < 0 ? KVP_CLI_OK : status;
    }
    kvp_workload workload = {NULL, 0};
    char message[512];
    if (o.trace != NULL) {
        if (kvp_workload_load_trace(o.trace, o.sim.capacity, &workload, message,
                                    sizeof message) != 0) {
            fprintf(stderr, "kvpager simulate: %s\n", message);
            return KVP_CLI_USAGE;
        }
    } else if (kvp_workload_generate(&o.workload, &workload) != 0) {
        fprintf(stderr, "kvpager simulate: out of memory for the workload\n");
        return KVP_CLI_USAGE;
    }
    kvp_progress progress;
    kvp_progress_init(&progress, "simulate", o.quiet);
    kvp_sim_result result;
    kvp_error err;
    const char *context = NULL;
    int failed = kvp_sim_run(&o.sim, &workload, kvp_progress_update, &progress, &result, &err,
                             &context);
    kvp_progress_finish(&progress);
    if (failed != 0) {
        kvp_cli_report("simulate", context != NULL ? context : "running", &err);
        kvp_sim_result_free(&result);
        kvp_workload_free(&workload);
        return KVP_CLI_USAGE;
    }
    if (o.json) {
        print_json(&o, &workload, &result);
    } else {
        print_report(&o, &workload, &result);
    }
    int exit_code = result.audit_failures == 0 && result.pages_leaked == 0 ? KVP_CLI_OK
                                                                            : KVP_CLI_FAILED;
    if (o.plot != NULL) {
        char title[160];
        snprintf(title, sizeof title, "kvpager simulate: %s, %zu requests, %zu pages",
                 o.trace ? "trace" : kvp_profile_name(o.workload.profile), workload.count,
                 result.total_pages);
        if (kvp_plot_write_svg(o.plot, &result, title) != 0) {
            fprintf(stderr, "kvpager simulate: cannot write %s\n", o.plot);
            exit_code = KVP_CLI_USAGE;
        } else if (!o.json) {
            printf("plot                    %s\n", o.plot);
        }
    }
    kvp_sim_result_free(&result);
    kvp_workload_free(&workload);
    return exit_code;
}
