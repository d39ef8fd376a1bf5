/*
 * workload.c: request generation and trace loading (see workload.h).
 */
#include "workload.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "lines.h"

static const char *const profile_names[] = {"sharegpt", "alpaca", "uniform", "conversation",
                                             "long-context"};
static const char *const arrival_names[] = {"poisson", "uniform", "burst"};

const char *kvp_profile_name(kvp_profile profile)
{
    return profile_names[profile];
}

const char *kvp_arrival_name(kvp_arrival arrival)
{
    return arrival_names[arrival];
}

int kvp_profile_parse(const char *text, kvp_profile *out)
{
    for (int i = 0; i < 5; i++) {
        if (strcmp(text, profile_names[i]) == 0) {
            *out = (kvp_profile)i;
            return 0;
        }
    }
    return -1;
}

int kvp_arrival_parse(const char *text, kvp_arrival *out)
{
    for (int i = 0; i < 3; i++) {
        if (strcmp(text, arrival_names[i]) == 0) {
            *out = (kvp_arrival)i;
            return 0;
        }
    }
    return -1;
}

void kvp_workload_spec_defaults(kvp_workload_spec *spec)
{
    /* conversation: per turn, the new message's and the reply's means (workload.h) */
    static const double prompt_means[] = {161.0, 19.0, 161.0, 94.0, 8192.0};
    static const double output_means[] = {338.0, 58.0, 338.0, 348.0, 256.0};
    static const double sigmas[] = {1.0, 0.6, 0.0, 1.0, 0.3};
    if (spec->prompt_mean <= 0.0) {
        spec->prompt_mean = prompt_means[spec->profile];
    }
    if (spec->output_mean <= 0.0) {
        spec->output_mean = output_means[spec->profile];
    }
    if (spec->sigma <= 0.0) {
        spec->sigma = sigmas[spec->profile];
    }
    if (spec->turns_mean <= 0.0) {
        spec->turns_mean = KVP_CONVERSATION_TURNS_MEAN;
    }
}

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in (0, 1): never 0, so logs are finite. */
static double unit_open(uint64_t *state)
{
    return ((double)(splitmix64(state) >> 11) + 0.5) * 0x1.0p-53;
}

static double normal(uint64_t *state)
{
    double u1 = unit_open(state);
    double u2 = unit_open(state);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);
}

static size_t clamp_length(double value, size_t limit)
{
    if (!(value >= 1.0)) {
        return 1;
    }
    if (value >= (double)limit) {
        return limit;
    }
    return (size_t)llround(value);
}

static size_t draw_length(const kvp_workload_spec *spec, double mean, size_t limit,
                          uint64_t *state)
{
    if (spec->profile == KVP_PROFILE_UNIFORM) {
        /* Uniform on [1, 2 * mean - 1], whose mean is `mean`. */
        double span = 2.0 * mean - 1.0;
        return clamp_length(1.0 + floor(unit_open(state) * (span < 1.0 ? 1.0 : span)), limit);
    }
    double mu = log(mean) - spec->sigma * spec->sigma / 2.0;
    return clamp_length(exp(mu + spec->sigma * normal(state)), limit);
}

/* The arrival step of request i of a single-turn list, advancing the poisson clock. */
static size_t draw_arrival(const kvp_workload_spec *spec, size_t i, double *clock,
                           uint64_t *arrivals)
{
    size_t step = 0;
    switch (spec->arrival) {
    case KVP_ARRIVAL_BURST:
        step = 0;
        break;
    case KVP_ARRIVAL_UNIFORM:
        step = (size_t)floor((double)i / spec->rate);
        break;
    case KVP_ARRIVAL_POISSON:
        step = (size_t)floor(*clock);
        *clock += -log(unit_open(arrivals)) / spec->rate;
        break;
    }
    return step;
}

/*
 * Multi-turn chats (workload.h): conversations start by the arrival process;
 * a later turn's think time is drawn where the open-loop generator drew it
 * (the arrivals stream, after the turn before it), so lengths and think
 * times are what they were when turns arrived at fixed steps.
 */
static void generate_conversations(const kvp_workload_spec *spec,
                                   kvp_workload_request *requests)
{
    uint64_t lengths = spec->seed ^ 0x6C656E67746873ull; /* independent streams */
    uint64_t arrivals = spec->seed ^ 0x617272697661ull;
    uint64_t turns = spec->seed ^ 0x7475726E73ull;
    double clock = 0.0;
    size_t count = 0;
    size_t shared = spec->shared_prefix;
    /* Geometric on {1, 2, ...} with mean m: continue after each turn with 1 - 1/m. */
    double next_turn = 1.0 - 1.0 / (spec->turns_mean > 1.0 ? spec->turns_mean : 1.0);
    for (uint64_t conversation = 0; count < spec->requests; conversation++) {
        size_t step = draw_arrival(spec, (size_t)conversation, &clock, &arrivals);
        size_t context = shared;
        size_t think = 0;
        for (size_t turn = 0;; turn++) {
            /* Room for at least one message token and one reply token. */
            if (context + 2 > spec->capacity) {
                break;
            }
            kvp_workload_request *r = &requests[count];
            size_t message = draw_length(spec, spec->prompt_mean, spec->capacity - context - 1,
                                         &lengths);
            r->prompt_tokens = context + message;
            r->output_tokens = draw_length(spec, spec->output_mean,
                                           spec->capacity - r->prompt_tokens, &lengths);
            r->arrival_step = turn == 0 ? step : 0;
            r->shared_tokens = shared;
            r->stream = conversation;
            r->session = conversation + 1;
            r->turn = turn;
            r->think_steps = think;
            count++;
            context = r->prompt_tokens + r->output_tokens;
            think = (size_t)floor(-log(unit_open(&arrivals)) * KVP_CONVERSATION_THINK_STEPS);
            if (count == spec->requests || unit_open(&turns) >= next_turn) {
                break;
            }
        }
    }
}

/*
 * long-context: a drawn prompt length kept within [mean / 2, 2 x mean] (4k to
 * 16k tokens at the default mean 8192), and within `limit`; other profiles:
 * as drawn.
 */
static size_t long_band(const kvp_workload_spec *spec, size_t length, size_t limit)
{
    if (spec->profile != KVP_PROFILE_LONG_CONTEXT) {
        return length;
    }
    size_t lo = (size_t)ceil(spec->prompt_mean / 2.0);
    size_t hi = (size_t)floor(spec->prompt_mean * 2.0);
    length = length < lo ? lo : length > hi ? hi : length;
    return length < limit ? length : limit;
}

int kvp_workload_generate(const kvp_workload_spec *spec, kvp_workload *out)
{
    kvp_workload_request *requests = kvp_cli_calloc(spec->requests, sizeof *requests);
    if (requests == NULL) {
        return -1;
    }
    if (spec->profile == KVP_PROFILE_CONVERSATION) {
        generate_conversations(spec, requests);
        out->requests = requests;
        out->count = spec->requests;
        return 0;
    }
    uint64_t lengths = spec->seed ^ 0x6C656E67746873ull;  /* independent streams */
    uint64_t arrivals = spec->seed ^ 0x617272697661ull;
    double clock = 0.0;
    size_t shared = spec->shared_prefix;
    size_t limit = spec->capacity > shared + 1 ? spec->capacity - shared - 1 : 1;
    for (size_t i = 0; i < spec->requests; i++) {
        kvp_workload_request *r = &requests[i];
        r->stream = i;
        r->shared_tokens = shared;
        r->prompt_tokens = shared + long_band(spec, draw_length(spec, spec->prompt_mean, limit,
                                                                 &lengths), limit);
        size_t room = spec->capacity - r->prompt_tokens;
        r->output_tokens = draw_length(spec, spec->output_mean, room, &lengths);
        r->arrival_step = draw_arrival(spec, i, &clock, &arrivals);
    }
    out->requests = requests;
    out->count = spec->requests;
    return 0;
}

/* Parses one decimal field; writes a message naming line, column and value on error. */
static int parse_field(const char *text, size_t min, const char *column, const char *path,
                       size_t line, size_t *out, char *message, size_t size)
{
    errno = 0;
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    if (*text == '\0' || *text == '-' || *text == '+' || errno != 0 || *end != '\0' ||
        value < min) {
        snprintf(message, size, "%s:%zu: column %s: '%s' is not an integer >= %zu", path, line,
                 column, text, min);
        return -1;
    }
    *out = (size_t)value;
    return 0;
}

/* Splits `text` (modified) at commas into exactly three trimmed fields. */
static int split_row(char *text, char *fields[3])
{
    size_t n = 0;
    char *start = text;
    for (char *p = text;; p++) {
        if (*p == ',' || *p == '\0') {
            int last = *p == '\0';
            if (n == 3) {
                return -1;
            }
            *p = '\0';
            while (*start == ' ' || *start == '\t') {
                start++;
            }
            char *end = p;
            while (end > start && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r')) {
                *--end = '\0';
            }
            fields[n++] = start;
            start = p + 1;
            if (last) {
                break;
            }
        }
    }
    return n == 3 ? 0 : -1;
}

static int parse_row(char *text, const char *path, size_t line, size_t capacity, kvp_workload_request *r,
                     char *message, size_t size)
{
    static const char *const columns[3] = {"arrival_step", "prompt_tokens", "output_tokens"};
    char *fields[3];
    if (split_row(text, fields) != 0) {
        snprintf(message, size, "%s:%zu: expected 3 columns (%s,%s,%s)", path, line, columns[0],
                 columns[1], columns[2]);
        return -1;
    }
    size_t values[3];
    for (int c = 0; c < 3; c++) {
        if (parse_field(fields[c], c == 0 ? 0 : 1, columns[c], path, line, &values[c], message,
                        size) != 0) {
            return -1;
        }
    }
    if (values[1] >= capacity) {
        snprintf(message, size,
                 "%s:%zu: column prompt_tokens: '%zu' leaves no room for output under "
                 "--capacity %zu",
                 path, line, values[1], capacity);
        return -1;
    }
    if (values[2] > capacity - values[1]) {
        snprintf(message, size,
                 "%s:%zu: column output_tokens: '%zu': prompt_tokens + output_tokens = %zu "
                 "exceeds --capacity %zu",
                 path, line, values[2], values[1] + values[2], capacity);
        return -1;
    }
    memset(r, 0, sizeof *r);
    r->arrival_step = values[0];
    r->prompt_tokens = values[1];
    r->output_tokens = values[2];
    return 0;
}

/* The CSV reader's state; lines come from lines.c. */
typedef struct trace_reader {
    const char *path;
    size_t capacity;
    kvp_workload *list;
    size_t room;
    size_t last_arrival;  /* arrival step of the previous row */
    char *message;
    size_t message_size;
} trace_reader;

/* A CSV line's characters, a trailing CR included; the refusal names one fewer. */
#define TRACE_LINE_MAX 511

static int add_request(trace_reader *t, const kvp_workload_request *r)
{
    if (t->list->count == t->room) {
        size_t room = t->room ? 2 * t->room : 64;
        kvp_workload_request *grown = kvp_cli_realloc(t->list->requests, room, sizeof *grown);
        if (grown == NULL) {
            snprintf(t->message, t->message_size,
                     "out of memory: cannot allocate the trace's requests (%zu bytes) "
                     "(AllocationFailed)",
                     room * sizeof *grown);
            return KVP_TRACE_OUT_OF_MEMORY;
        }
        t->list->requests = grown;
        t->room = room;
    }
    t->list->requests[t->list->count] = *r;
    t->list->requests[t->list->count].stream = t->list->count;
    t->list->count++;
    return 0;
}

/* One complete line (without its newline): a kvp_line_fn. */
static int trace_line(void *context, char *text, size_t len, size_t line)
{
    trace_reader *t = context;
    if (len > 0 && text[len - 1] == '\r') {
        text[--len] = '\0';
    }
    if (text[strspn(text, " \t")] == '\0') {
        return 0;
    }
    if (line == 1 && strcmp(text, "arrival_step,prompt_tokens,output_tokens") == 0) {
        return 0;
    }
    kvp_workload_request r;
    if (parse_row(text, t->path, line, t->capacity, &r, t->message, t->message_size) != 0) {
        return -1;
    }
    if (t->list->count > 0 && r.arrival_step < t->last_arrival) {
        snprintf(t->message, t->message_size,
                 "%s:%zu: column arrival_step: '%zu' is before the previous row's step %zu "
                 "(rows must be sorted by arrival)",
                 t->path, line, r.arrival_step, t->last_arrival);
        return -1;
    }
    t->last_arrival = r.arrival_step;
    return add_request(t, &r);
}

int kvp_workload_load_trace(const char *path, size_t capacity, kvp_workload *out, char *message,
                            size_t message_size)
{
    kvp_workload list = {NULL, 0};
    trace_reader t = {.path = path, .capacity = capacity, .list = &list,
                      .message = message, .message_size = message_size};
    const kvp_lines lines = {.path = path, .max_len = TRACE_LINE_MAX,
                             .max_shown = TRACE_LINE_MAX - 1, .handle = trace_line,
                             .context = &t, .message = message, .message_size = message_size};
    int status = kvp_lines_read(&lines);
    if (status == 0 && list.count == 0) {
        snprintf(message, message_size, "%s: no requests", path);
        status = -1;
    }
    if (status != 0) {
        kvp_cli_free(list.requests);
        return status;
    }
    *out = list;
    return 0;
}

void kvp_workload_free(kvp_workload *workload)
{
    kvp_cli_free(workload->requests);
    workload->requests = NULL;
    workload->count = 0;
}
