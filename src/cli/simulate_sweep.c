/*
 * simulate_sweep.c: `kvpager simulate` over comma lists of its main knobs,
 * as llama-bench takes them, and the --format tables.
 *
 * Owns: the lists (--model, --kv-dtype, --block-tokens and --budget may each
 * hold several values separated by commas), their combinations (in that flag
 * order, the last varying fastest), the table of one row per combination
 * (--format md, csv or json; md when a sweep gives no --format) and --json's
 * array (one full object per combination, in the table's order).
 * Invariants: nothing runs until every combination's command line has passed
 * every check of a single run (simulate.c's kvp_simulate_prepare: each
 * value's syntax and range, the sizes against overflow, the run's memory
 * against physical memory), so a bad value of any list is refused with one
 * line naming its flag and that value, exit 2, before the first run. A
 * sweep's runs make no comparison run without sharing (a sharing workload's
 * comparison is a sweep of its own, with --no-sharing); --plot draws one run
 * and is refused with a sweep or a table; --json and --format exclude each
 * other. A command line without lists and without --format never comes here:
 * its report is the single run's.
 * Callers: simulate.c (kvp_cli_simulate).
 */
#include <math.h>
#include <string.h>

#include "alloc.h"
#include "json.h"
#include "simulate.h"

/* The flags that take lists, outermost first. */
static const simulate_flag list_flags[] = {FLAG_MODEL, FLAG_KV_DTYPE, FLAG_BLOCK_TOKENS,
                                           FLAG_BUDGET};
#define LIST_FLAGS (sizeof list_flags / sizeof list_flags[0])

/* One flag's list: where its value is in argv and its items. */
typedef struct sweep_list {
    int arg;          /* argv index of the value (or of "--flag=value"), -1: not given */
    int inline_form;  /* the value came as --flag=value */
    char *text;       /* a copy of the value, commas replaced by NULs */
    const char **items;
    size_t count;     /* 1 when not given */
    char *rebuilt;    /* "--flag=item" for the inline form */
} sweep_list;

typedef struct sweep_plan {
    sweep_list lists[LIST_FLAGS];
    size_t combinations;
    char **argv; /* one combination's command line */
} sweep_plan;

/* The value of `name` in argv (its first occurrence): 1 with *arg and *inline_form, or 0. */
static int find_value(int argc, char **argv, const char *name, int *arg, int *inline_form)
{
    size_t len = strlen(name);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], name) == 0 && i + 1 < argc) {
            *arg = i + 1;
            *inline_form = 0;
            return 1;
        }
        if (strncmp(argv[i], name, len) == 0 && argv[i][len] == '=') {
            *arg = i;
            *inline_form = 1;
            return 1;
        }
    }
    return 0;
}

static const char *value_text(char **argv, const sweep_list *l, const char *name)
{
    return l->inline_form ? argv[l->arg] + strlen(name) + 1 : argv[l->arg];
}

int kvp_simulate_has_list(int argc, char **argv)
{
    for (size_t f = 0; f < LIST_FLAGS; f++) {
        const char *name = kvp_simulate_flag_names[list_flags[f]];
        sweep_list l = {.arg = -1};
        if (find_value(argc, argv, name, &l.arg, &l.inline_form) &&
            strchr(value_text(argv, &l, name), ',') != NULL) {
            return 1;
        }
    }
    return 0;
}

static void plan_free(sweep_plan *plan)
{
    for (size_t f = 0; f < LIST_FLAGS; f++) {
        kvp_cli_free(plan->lists[f].text);
        kvp_cli_free(plan->lists[f].items);
        kvp_cli_free(plan->lists[f].rebuilt);
    }
    kvp_cli_free(plan->argv);
}

/* Splits one list; 0, or KVP_CLI_USAGE with the problem printed. */
static int split_list(char **argv, const char *name, sweep_list *l)
{
    const char *value = value_text(argv, l, name);
    size_t len = strlen(value);
    size_t commas = 0;
    for (const char *c = value; *c != '\0'; c++) {
        commas += *c == ',';
    }
    l->text = kvp_cli_alloc(len + 1, 1);
    l->items = kvp_cli_alloc(commas + 1, sizeof *l->items);
    l->rebuilt = kvp_cli_alloc(strlen(name) + len + 2, 1);
    if (l->text == NULL || l->items == NULL || l->rebuilt == NULL) {
        kvp_cli_report_oom("simulate", "the sweep's lists", 2 * len + strlen(name) + 2);
        return KVP_CLI_USAGE;
    }
    memcpy(l->text, value, len + 1);
    l->count = 0;
    for (char *item = l->text;; item++) {
        char *comma = strchr(item, ',');
        l->items[l->count++] = item;
        if (comma == NULL) {
            break;
        }
        *comma = '\0';
        item = comma;
    }
    for (size_t i = 0; i < l->count; i++) {
        if (l->items[i][0] == '\0') {
            fprintf(stderr,
                    "kvpager simulate: invalid value for %s: '%s': an empty item in the list "
                    "(values are separated by single commas)\n",
                    name, value);
            return KVP_CLI_USAGE;
        }
    }
    return 0;
}

/* Reads the lists of argv; 0, or KVP_CLI_USAGE with the problem printed. */
static int plan_make(int argc, char **argv, sweep_plan *plan)
{
    memset(plan, 0, sizeof *plan);
    plan->combinations = 1;
    plan->argv = kvp_cli_alloc((size_t)argc + 1, sizeof *plan->argv);
    if (plan->argv == NULL) {
        kvp_cli_report_oom("simulate", "the sweep's command line",
                           ((size_t)argc + 1) * sizeof *plan->argv);
        return KVP_CLI_USAGE;
    }
    for (size_t f = 0; f < LIST_FLAGS; f++) {
        sweep_list *l = &plan->lists[f];
        const char *name = kvp_simulate_flag_names[list_flags[f]];
        l->arg = -1;
        l->count = 1;
        if (!find_value(argc, argv, name, &l->arg, &l->inline_form)) {
            continue;
        }
        if (split_list(argv, name, l) != 0) {
            return KVP_CLI_USAGE;
        }
        plan->combinations *= l->count <= MAX_SWEEP_RUNS ? l->count : MAX_SWEEP_RUNS + 1;
        if (plan->combinations > MAX_SWEEP_RUNS) {
            fprintf(stderr,
                    "kvpager simulate: invalid value for %s: '%s': the lists make more than %d "
                    "combinations (runs)\n",
                    name, value_text(argv, l, name), MAX_SWEEP_RUNS);
            return KVP_CLI_USAGE;
        }
    }
    return 0;
}

/* Combination `c`'s command line in plan->argv (argc entries and a NULL). */
static char **plan_argv(sweep_plan *plan, int argc, char **argv, size_t c)
{
    memcpy(plan->argv, argv, (size_t)argc * sizeof *argv);
    plan->argv[argc] = NULL;
    for (size_t f = LIST_FLAGS; f-- > 0;) {
        sweep_list *l = &plan->lists[f];
        const char *item = l->arg >= 0 ? l->items[c % l->count] : NULL;
        c /= l->count;
        if (item == NULL) {
            continue;
        }
        if (l->inline_form) {
            sprintf(l->rebuilt, "%s=%s", kvp_simulate_flag_names[list_flags[f]], item);
            item = l->rebuilt;
        }
        plan->argv[l->arg] = (char *)(uintptr_t)item;
    }
    return plan->argv;
}

/* What a table row shows of one run. */
typedef struct sweep_row {
    char model[32];
    size_t layers, model_width, heads, kv_heads;
    kvp_dtype kv_dtype;
    size_t block_tokens;
    size_t budget_bytes;
    size_t pages;
    size_t peak_concurrent;
    double mean_concurrent;
    double hit_rate; /* prefix hits at first admission over the workload's prompt tokens */
    size_t preemptions;
    double ttft_p50, ttft_p99, e2e_p50, e2e_p99; /* steps */
    size_t completed, requests;
    size_t steps;
    double seconds;
    int clean;
} sweep_row;

static void fill_row(const simulate_options *o, const kvp_workload *w, const simulate_runs *runs,
                     sweep_row *row)
{
    const kvp_sim_result *r = &runs->result;
    uint64_t prompt = 0;
    for (size_t i = 0; i < w->count; i++) {
        prompt += w->requests[i].prompt_tokens;
    }
    snprintf(row->model, sizeof row->model, "%s",
             o->value[FLAG_MODEL] != NULL ? o->value[FLAG_MODEL] : "-");
    row->layers = o->sim.layers;
    row->model_width = o->sim.model_width;
    row->heads = o->sim.heads;
    row->kv_heads = kvp_sim_kv_heads(&o->sim);
    row->kv_dtype = o->sim.kv_dtype;
    row->block_tokens = o->sim.block_tokens;
    row->budget_bytes = o->sim.budget_bytes;
    row->pages = r->total_pages;
    row->peak_concurrent = r->peak_concurrent;
    row->mean_concurrent = r->mean_concurrent;
    row->hit_rate = prompt > 0 ? (double)r->first_hit_tokens / (double)prompt : NAN;
    row->preemptions = r->preemptions;
    row->ttft_p50 = runs->latency.ttft_steps.p50;
    row->ttft_p99 = runs->latency.ttft_steps.p99;
    row->e2e_p50 = runs->latency.e2e_steps.p50;
    row->e2e_p99 = runs->latency.e2e_steps.p99;
    row->completed = r->requests_completed;
    row->requests = r->requests;
    row->steps = r->steps;
    row->seconds = r->seconds;
    row->clean = kvp_simulate_runs_clean(runs);
}

/* The table's columns: the knobs, then the figures (docs/simulate.md). */
static const char *const columns[] = {
    "model", "layers", "model_width", "heads", "kv_heads", "kv_dtype", "block_tokens",
    "budget_bytes", "pages", "peak_concurrent", "mean_concurrent", "hit_rate", "preemptions",
    "ttft_p50_steps", "ttft_p99_steps", "e2e_p50_steps", "e2e_p99_steps", "completed",
    "requests", "steps", "seconds"};
#define COLUMNS (sizeof columns / sizeof columns[0])

/* Column k's number (k neither "model" nor "kv_dtype"); NaN when it has none. */
static double column_value(const sweep_row *row, size_t k)
{
    const double values[COLUMNS] = {
        NAN, (double)row->layers, (double)row->model_width, (double)row->heads,
        (double)row->kv_heads, NAN, (double)row->block_tokens, (double)row->budget_bytes,
        (double)row->pages, (double)row->peak_concurrent, row->mean_concurrent, row->hit_rate,
        (double)row->preemptions, row->ttft_p50, row->ttft_p99, row->e2e_p50, row->e2e_p99,
        (double)row->completed, (double)row->requests, (double)row->steps, row->seconds};
    return values[k];
}

enum { COLUMN_MODEL = 0, COLUMN_DTYPE = 5, COLUMN_BUDGET = 7, COLUMN_MEAN = 10,
       COLUMN_HIT_RATE = 11, COLUMN_SECONDS = 20 };

/* Column k of a row as text: md renders the budget and the hit rate for reading; a
 * figure without a value is "-" in md and empty in csv. */
static void cell(const sweep_row *row, size_t k, int md, char *out, size_t size)
{
    double v = column_value(row, k);
    if (k == COLUMN_MODEL) {
        snprintf(out, size, "%s", row->model);
    } else if (k == COLUMN_DTYPE) {
        snprintf(out, size, "%s", kvp_dtype_name(row->kv_dtype));
    } else if (k == COLUMN_BUDGET && md) {
        kvp_cli_format_bytes(row->budget_bytes, out, size);
    } else if (isnan(v)) {
        snprintf(out, size, "%s", md ? "-" : "");
    } else if (k == COLUMN_HIT_RATE && md) {
        snprintf(out, size, "%.1f%%", 100.0 * v);
    } else if (k == COLUMN_HIT_RATE || k == COLUMN_MEAN || k == COLUMN_SECONDS) {
        snprintf(out, size, md ? "%.2f" : "%.6g", v);
    } else {
        snprintf(out, size, "%.0f", v); /* counts, and nearest-rank steps */
    }
}

static void print_json_table(const sweep_row *rows, size_t n)
{
    char text[48];
    kvp_json json;
    kvp_json_init(&json, stdout);
    kvp_json_array_begin(&json, NULL);
    for (size_t i = 0; i < n; i++) {
        kvp_json_object_begin(&json, NULL);
        for (size_t k = 0; k < COLUMNS; k++) {
            if (k == COLUMN_MODEL || k == COLUMN_DTYPE) {
                cell(&rows[i], k, 0, text, sizeof text);
                kvp_json_string(&json, columns[k], text);
            } else {
                kvp_json_double(&json, columns[k], column_value(&rows[i], k));
            }
        }
        kvp_json_object_end(&json);
    }
    kvp_json_array_end(&json);
    printf("\n");
}

/* One line of the md or csv table: the header when row is NULL. */
static void print_line(const sweep_row *row, int md)
{
    char text[48];
    for (size_t k = 0; k < COLUMNS; k++) {
        if (row != NULL) {
            cell(row, k, md, text, sizeof text);
        }
        const char *shown = row != NULL ? text : columns[k];
        if (md) {
            printf("| %s ", shown);
        } else {
            printf("%s%s", k > 0 ? "," : "", shown);
        }
    }
    printf("%s\n", md ? "|" : "");
}

static void print_table(const sweep_row *rows, size_t n, int format)
{
    if (format == SIMULATE_TABLE_JSON) {
        print_json_table(rows, n);
        return;
    }
    int md = format == SIMULATE_TABLE_MD;
    print_line(NULL, md);
    for (size_t k = 0; md && k < COLUMNS; k++) {
        printf("%s", k == COLUMN_MODEL || k == COLUMN_DTYPE ? "| --- " : "| ---: ");
    }
    if (md) {
        printf("|\n");
    }
    for (size_t i = 0; i < n; i++) {
        print_line(&rows[i], md);
    }
}

/*
 * Every combination through kvp_simulate_prepare, nothing run; then the
 * rules of the whole command line. KVP_CLI_OK with *first (combination 0's
 * options), -1 after --help, or KVP_CLI_USAGE with the problem printed.
 */
static int check_all(sweep_plan *plan, int argc, char **argv, simulate_options *first)
{
    for (size_t c = 0; c < plan->combinations; c++) {
        simulate_options o;
        kvp_workload w = {NULL, 0};
        int status = kvp_simulate_prepare(argc, plan_argv(plan, argc, argv, c), &o, &w);
        kvp_workload_free(&w);
        if (status != KVP_CLI_OK) {
            return status;
        }
        if (c == 0) {
            *first = o;
        }
    }
    const char *sweep = plan->combinations > 1 ? "a sweep (a list of values)" : "--format";
    if (first->json && first->value[FLAG_FORMAT] != NULL) {
        fprintf(stderr,
                "kvpager simulate: --format %s cannot be given with --json (--json prints the "
                "whole report of each run, --format one table)\n",
                first->value[FLAG_FORMAT]);
        return KVP_CLI_USAGE;
    }
    if (first->plot != NULL) {
        fprintf(stderr, "kvpager simulate: --plot %s draws one run's report: it cannot be given "
                        "with %s\n",
                first->plot, sweep);
        return KVP_CLI_USAGE;
    }
    return KVP_CLI_OK;
}

/* Combination c: prepared again (its values passed), run, its row filled, --json's object. */
static int run_one(sweep_plan *plan, int argc, char **argv, size_t c, sweep_row *row)
{
    simulate_options o;
    kvp_workload w = {NULL, 0};
    int status = kvp_simulate_prepare(argc, plan_argv(plan, argc, argv, c), &o, &w);
    if (status != KVP_CLI_OK) {
        return KVP_CLI_USAGE; /* the inputs changed under us (a trace file rewritten) */
    }
    o.sweep = 1;
    char label[48];
    snprintf(label, sizeof label, "simulate %zu/%zu", c + 1, plan->combinations);
    simulate_runs runs;
    status = kvp_simulate_execute(&o, &w, label, &runs);
    if (status == KVP_CLI_OK) {
        fill_row(&o, &w, &runs, row);
        if (o.json) {
            printf("%s", c == 0 ? "[\n" : ",\n");
            kvp_simulate_print_json(&o, &w, &runs.result, NULL, &runs.latency);
        }
    }
    kvp_simulate_runs_free(&runs);
    kvp_workload_free(&w);
    return status;
}

int kvp_simulate_sweep(int argc, char **argv)
{
    sweep_plan plan;
    simulate_options first;
    memset(&first, 0, sizeof first);
    int status = plan_make(argc, argv, &plan);
    if (status == KVP_CLI_OK) {
        status = check_all(&plan, argc, argv, &first);
    }
    sweep_row *rows = NULL;
    if (status == KVP_CLI_OK) {
        rows = kvp_cli_calloc(plan.combinations, sizeof *rows);
        if (rows == NULL) {
            kvp_cli_report_oom("simulate", "the sweep's table", plan.combinations * sizeof *rows);
            status = KVP_CLI_USAGE;
        }
    }
    int clean = 1;
    for (size_t c = 0; status == KVP_CLI_OK && c < plan.combinations; c++) {
        status = run_one(&plan, argc, argv, c, &rows[c]);
        clean &= status != KVP_CLI_OK || rows[c].clean;
    }
    if (status == KVP_CLI_OK && first.json) {
        printf("]\n");
    } else if (status == KVP_CLI_OK) {
        print_table(rows, plan.combinations,
                    first.format != SIMULATE_TABLE_NONE ? first.format : SIMULATE_TABLE_MD);
    }
    kvp_cli_free(rows);
    plan_free(&plan);
    if (status != KVP_CLI_OK) {
        return status < 0 ? KVP_CLI_OK : status;
    }
    return clean ? KVP_CLI_OK : KVP_CLI_FAILED;
}
