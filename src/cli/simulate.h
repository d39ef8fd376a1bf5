/*
 * simulate.h: what the files of `kvpager simulate` share (internal to src/cli).
 *
 *   simulate.c         the driver: the order of the steps, the runs (with sharing,
 *                      then without for the side-by-side figures), the exit status;
 *   simulate_flags.c   the flags, --help and their defaults, --model's presets,
 *                      and step 1: reading the command line (syntax only);
 *   simulate_checks.c  step 2: each flag's range (a table), flags that depend on
 *                      each other, sizes, the workload's mean request, outputs
 *                      that name inputs, and the run's memory against physical
 *                      memory;
 *   simulate_report.c  the human report and the --json object;
 *   simulate_tier.c    --tier and its flags, their checks, the tier's report lines;
 *   simulate_sweep.c   comma lists of --model, --kv-dtype, --block-tokens and
 *                      --budget: every combination prepared (checked) before
 *                      any runs, then one --format table or --json's array.
 * Invariants: nothing runs on bad input. Parsing reads every argument and
 * checks only syntax; the checks run in a fixed order and only the first
 * problem is kept (kvp_cli_problems), so the line printed for a command
 * line does not depend on which file a check lives in. No check or parse
 * allocates or touches a file except --trace's rows (read by the driver),
 * kvp_cli_same_file's lookups and simulate_tier.c's check (--tier-secret-file
 * read; a Redis URL parsed by making and destroying the tier, never
 * connected).
 * Callers: the simulate*.c files only.
 */
#ifndef KVPAGER_CLI_SIMULATE_H
#define KVPAGER_CLI_SIMULATE_H

#include <stddef.h>
#include <stdio.h>

#include "cli.h"
#include "json.h"
#include "latency.h"
#include "sim.h"
#include "trace_stats.h"
#include "workload.h"

/* The flags that take a value, in --help order. */
#define FLAG_MAP(X)                                                                       \
    X(MODEL, "--model")                                                                   \
    X(LAYERS, "--layers")                                                                 \
    X(MODEL_WIDTH, "--model-width")                                                       \
    X(HEADS, "--heads")                                                                   \
    X(KV_HEADS, "--kv-heads")                                                             \
    X(WINDOW, "--window")                                                                 \
    X(FULL_EVERY, "--full-every")                                                         \
    X(SINK_TOKENS, "--sink-tokens")                                                       \
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
    X(TRACE_FORMAT, "--trace-format")                                                     \
    X(MS_PER_STEP, "--ms-per-step")                                                       \
    X(SHARED_PREFIX, "--shared-prefix")                                                   \
    X(SAMPLES, "--samples")                                                               \
    X(SCHEDULE, "--schedule")                                                             \
    X(SESSION_TTL, "--session-ttl")                                                       \
    X(MAX_RUNNING, "--max-running")                                                       \
    X(UPDATE_WEIGHTS_EVERY, "--update-weights-every")                                     \
    X(VERIFY, "--verify")                                                                 \
    X(WATERMARK, "--watermark")                                                           \
    X(RESERVE_TOKENS, "--reserve-tokens")                                                 \
    X(THREADS, "--threads")                                                               \
    X(SEED, "--seed")                                                                     \
    X(AUDIT_EVERY, "--audit-every")                                                       \
    X(PLOT, "--plot")                                                                     \
    X(FORMAT, "--format")

typedef enum simulate_flag {
#define FLAG_ENUM_(name, text) FLAG_##name,
    FLAG_MAP(FLAG_ENUM_)
#undef FLAG_ENUM_
    FLAG_COUNT_
} simulate_flag;

/* "--model", "--layers", ...: indexed by simulate_flag. */
extern const char *const kvp_simulate_flag_names[FLAG_COUNT_];

/* Ranges of the numeric flags (also printed by --help). */
#define MIN_CAPACITY 2           /* one prompt token and one generated token */
#define MAX_THREADS 4096         /* the decoder's limit */
#define MIN_RATE 0.001
#define MAX_RATE 1000000.0
#define MIN_SIGMA 0.05
#define MAX_SIGMA 4.0
#define MAX_POOL_PAGES 4294967294u /* pages are named by 32-bit ids (kvpager/pool.h) */
#define MAX_SAMPLES 256
#define MAX_SWEEP_RUNS 256       /* combinations of one sweep (simulate_sweep.c) */

/* --max-running's default: vLLM's max_num_seqs default. It bounds the leases a run
 * makes, so the memory check (simulate_checks.c) charges at most this many sequences. */
#define DEFAULT_MAX_RUNNING 256

/* --ms-per-step's default: a Mooncake timestamp's milliseconds per scheduler step. */
#define DEFAULT_MS_PER_STEP 25

/*
 * The reference figures of a trace with block ids (trace_stats.h), computed
 * by the driver after the run: the ceiling, and an LRU of the blocks the
 * pool's pages hold (kvp_trace_blocks_of_pages); workload_prompt_tokens is
 * the sum of the requests' prompts, each once.
 */
typedef struct simulate_trace_figures {
    int present; /* the workload carries block ids and the figures were computed */
    kvp_trace_hits ceiling;
    size_t lru_blocks;
    kvp_trace_hits lru;
    size_t tier_lru_blocks; /* with --tier: an LRU of the pool's and the tiers' blocks; else 0 */
    kvp_trace_hits tier_lru;
    uint64_t workload_prompt_tokens;
} simulate_trace_figures;

/* The second tier's flags as given (simulate_tier.c); the values go to sim.tier. */
typedef struct simulate_tier_options {
    const char *values[KVP_SIM_TIERS_MAX]; /* each --tier, in order */
    size_t count;
    const char *given[6];                  /* --tier-secret-file, --tier-policy, --tier-loads,
                                              --tier-timeout-ms, --tier-retry-ms (indexes
                                              1..5; 0 unused: --tier repeats) */
} simulate_tier_options;

typedef struct simulate_options {
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
    int mooncake;        /* --trace-format mooncake (0: csv) */
    size_t ms_per_step;  /* --ms-per-step */
    int format;          /* --format: SIMULATE_TABLE_* (0: the report) */
    int sweep;           /* one run of a sweep or a --format table: no comparison run */
    int capacity_pending; /* a Mooncake trace without --capacity sets the capacity: the
                             checks against it wait until the trace is read */
    simulate_trace_figures figures; /* filled by the driver after the run */
    simulate_tier_options tier;     /* --tier and its flags (simulate_tier.c) */
    /* --window: the run with every layer full (simulate_window.c), or NULL */
    const kvp_sim_result *every_layer_full;
} simulate_options;

/* --format's tables (simulate_sweep.c). */
enum { SIMULATE_TABLE_NONE = 0, SIMULATE_TABLE_MD, SIMULATE_TABLE_CSV, SIMULATE_TABLE_JSON };

/* simulate_flags.c */

/* `kvpager simulate --help`, with the defaults of kvp_sim_config_init. */
void kvp_simulate_usage(FILE *out);
/* Step 1: reads the whole command line into *o (defaults first, then --model's
 * geometry for the flags not given); remembers the first problem in *p. */
void kvp_simulate_parse(int argc, char **argv, simulate_options *o, kvp_cli_problems *p);
/* Records "invalid value for <flag>: '<value>': <why>". */
void kvp_simulate_invalid(kvp_cli_problems *p, simulate_flag f, const char *value,
                          const char *why);
/* The option's size_t or double field that flag f sets, or NULL when it sets neither. */
size_t *kvp_simulate_size_field(simulate_options *o, simulate_flag f);
double *kvp_simulate_real_field(simulate_options *o, simulate_flag f);

/* simulate_checks.c: step 2, in this order; each records only a first problem. */

/* 2a: each flag on its own, then flags that depend on each other. */
void kvp_simulate_check_ranges(simulate_options *o, kvp_cli_problems *p);
/* 2b: one page's bytes (*page_bytes) against the budget; call only when 2a found nothing. */
void kvp_simulate_check_sizes(simulate_options *o, kvp_cli_problems *p, size_t *page_bytes);
/* 2c: the mean request of a generated workload (fills its defaults) fits a sequence. */
void kvp_simulate_check_workload(simulate_options *o, kvp_cli_problems *p);
/* 2d: no output names an input (--plot over --trace). */
void kvp_simulate_check_outputs(const simulate_options *o, kvp_cli_problems *p);
/* 2e: the run's memory for `requests` requests against physical memory. Nothing when
 * 2a-2d found a problem; the driver reads --trace's rows first (`requests` is their count). */
void kvp_simulate_check_memory(simulate_options *o, size_t requests, size_t page_bytes,
                               kvp_cli_problems *p);

/* simulate_tier.c: the second tier's flags, checks and report lines. */

/* --help's second-tier section. */
void kvp_simulate_tier_usage(FILE *out);
/* Step 1 for argv[*i] when it is one of the tier flags (then 1, *i past its value);
 * 0 when it is not. */
int kvp_simulate_tier_take(int argc, char **argv, int *i, simulate_options *o,
                           kvp_cli_problems *p);
/* Step 2 (after the ranges): combinations, Redis URLs (parsed, never connected), the
 * secret file (read and hashed into o->sim.tier.secret). */
void kvp_simulate_tier_check(simulate_options *o, kvp_cli_problems *p);
/* The report's tier lines and the --json "tier" object (null without a tier). */
void kvp_simulate_tier_report(const simulate_options *o, const kvp_sim_result *r);
void kvp_simulate_tier_json(kvp_json *json, const kvp_sim_result *r);
/* One-layer pages the run's tiers' bytes hold (the sum of host:SIZE; 0 without a host tier). */
size_t kvp_simulate_tier_pages(const simulate_options *o);

/* simulate.c: what a sweep (simulate_sweep.c) shares with the single run. */

/* The results of one command line: the run, the run without sharing when compared,
 * the latency figures. */
typedef struct simulate_runs {
    kvp_sim_result result;
    kvp_sim_result off;
    int compare; /* off was run: a sharing workload without --no-sharing, not in a sweep */
    kvp_latency latency;
    kvp_sim_result full; /* --window: the same run with every layer full (not in a sweep) */
} simulate_runs;

/* Steps 1 and 2 for one command line: KVP_CLI_OK with the workload made, -1 when
 * --help was printed, or KVP_CLI_USAGE with the problem printed. */
int kvp_simulate_prepare(int argc, char **argv, simulate_options *o, kvp_workload *workload);
/* Step 4 without the outputs: the run(s) (progress labelled `label`), the trace's
 * figures, the latency. KVP_CLI_OK, or KVP_CLI_USAGE with the error printed
 * (*runs freed either way by kvp_simulate_runs_free). */
int kvp_simulate_execute(simulate_options *o, const kvp_workload *workload, const char *label,
                         simulate_runs *runs);
void kvp_simulate_runs_free(simulate_runs *runs);
/* The run finished with every audit clean and no page leaked. */
int kvp_simulate_runs_clean(const simulate_runs *runs);

/* simulate_sweep.c: comma lists and --format tables. */

/* Whether a --model, --kv-dtype, --block-tokens or --budget value holds a comma. */
int kvp_simulate_has_list(int argc, char **argv);
/* The whole command for a command line with lists or --format: every combination
 * checked, then run, then one table (or --json's array). The exit status. */
int kvp_simulate_sweep(int argc, char **argv);

/* simulate_report.c: the outputs of a finished run (off: the run without sharing, or NULL). */

void kvp_simulate_print_report(const simulate_options *o, const kvp_workload *w,
                               const kvp_sim_result *r, const kvp_sim_result *off,
                               const kvp_latency *latency);
void kvp_simulate_print_json(const simulate_options *o, const kvp_workload *w,
                             const kvp_sim_result *r, const kvp_sim_result *off,
                             const kvp_latency *latency);

/* simulate_window.c: --window, --full-every, --sink-tokens (issue 21). */

/* The window flags' part of --help. */
void kvp_simulate_window_usage(FILE *out);
/* 2a's rule for the window flags: ranges, then what they need (--no-sharing, compute). */
void kvp_simulate_check_window(simulate_options *o, simulate_flag f, kvp_cli_problems *p);
/* With --window, not in a sweep: the same workload again with every layer full, announced
 * and timed like the run without sharing (runs->full; o->every_layer_full points to it).
 * 0, or nonzero with *err and *context filled. */
int kvp_simulate_window_run(simulate_options *o, const kvp_workload *workload,
                            const char *label, simulate_runs *runs, kvp_error *err,
                            const char **context);
/* The report's and --json's window figures (nothing without --window). */
void kvp_simulate_print_window(const simulate_options *o, const kvp_sim_result *r);
struct kvp_json;
void kvp_simulate_json_window(struct kvp_json *json, const simulate_options *o,
                              const kvp_sim_result *r);

#endif /* KVPAGER_CLI_SIMULATE_H */
