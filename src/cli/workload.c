/*
 * workload.c: request generation and trace loading (see workload.h).
 */
#include "workload.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const profile_names[] = {"sharegpt", "alpaca", "uniform"};
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
    for (int i = 0; i < 3; i++) {
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
    static const double prompt_means[] = {161.0, 19.0, 161.0};
    static const double output_means[] = {338.0, 58.0, 338.0};
    static const double sigmas[] = {1.0, 0.6, 0.0};
    if (spec->prompt_mean <= 0.0) {
        spec->prompt_mean = prompt_means[spec->profile];
    }
    if (spec->output_mean <= 0.0) {
        spec->output_mean = output_means[spec->profile];
    }
    if (spec->sigma <= 0.0) {
        spec->sigma = sigmas[spec->profile];
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

int kvp_workload_generate(const kvp_workload_spec *spec, kvp_workload *out)
{
    kvp_request *requests = calloc(spec->requests ? spec->requests : 1, sizeof *requests);
    if (requests == NULL) {
        return -1;
    }
    uint64_t lengths = spec->seed ^ 0x6C656E67746873ull;  /* independent streams */
    uint64_t arrivals = spec->seed ^ 0x617272697661ull;
    double clock = 0.0;
    size_t limit = spec->capacity > 1 ? spec->capacity - 1 : 1;
    for (size_t i = 0; i < spec->requests; i++) {
        kvp_request *r = &requests[i];
        r->prompt_tokens = draw_length(spec, spec->prompt_mean, limit, &lengths);
        size_t room = spec->capacity - r->prompt_tokens;
        r->output_tokens = draw_length(spec, spec->output_mean, room, &lengths);
        switch (spec->arrival) {
        case KVP_ARRIVAL_BURST:
            r->arrival_step = 0;
            break;
        case KVP_ARRIVAL_UNIFORM:
            r->arrival_step = (size_t)floor((double)i / spec->rate);
            break;
        case KVP_ARRIVAL_POISSON:
            r->arrival_step = (size_t)floor(clock);
            clock += -log(unit_open(&arrivals)) / spec->rate;
            break;
        }
    }
    out->requests = requests;
    out->count = spec->requests;
    return 0;
}

typedef struct ordered_request {
    kvp_request request;
    size_t line_order;
} ordered_request;

/* By arrival, then by file order: a stable sort through qsort. */
static int compare_arrival(const void *a, const void *b)
{
    const ordered_request *x = a;
    const ordered_request *y = b;
    if (x->request.arrival_step != y->request.arrival_step) {
        return x->request.arrival_step < y->request.arrival_step ? -1 : 1;
    }
    return x->line_order < y->line_order ? -1 : x->line_order > y->line_order;
}

static int sort_by_arrival(kvp_request *requests, size_t count)
{
    ordered_request *ordered = malloc(count * sizeof *ordered);
    if (ordered == NULL) {
        return -1;
    }
    for (size_t i = 0; i < count; i++) {
        ordered[i].request = requests[i];
        ordered[i].line_order = i;
    }
    qsort(ordered, count, sizeof *ordered, compare_arrival);
    for (size_t i = 0; i < count; i++) {
        requests[i] = ordered[i].request;
    }
    free(ordered);
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

static int parse_row(char *text, const char *path, size_t line, size_t capacity, kvp_request *r,
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
    if (values[1] > capacity || values[2] > capacity - values[1]) {
        snprintf(message, size,
                 "%s:%zu: column output_tokens: '%zu': prompt_tokens + output_tokens = %zu "
                 "exceeds the capacity of %zu positions",
                 path, line, values[2], values[1] + values[2], capacity);
        return -1;
    }
    r->arrival_step = values[0];
    r->prompt_tokens = values[1];
    r->output_tokens = values[2];
    return 0;
}

int kvp_workload_load_trace(const char *path, size_t capacity, kvp_workload *out, char *message,
                            size_t message_size)
{
    FILE *file = fopen(path, "r");
    if (file == NULL) {
        snprintf(message, message_size, "%s: %s", path, strerror(errno));
        return -1;
    }
    kvp_request *requests = NULL;
    size_t count = 0;
    size_t room = 0;
    char text[512];
    size_t line = 0;
    int status = 0;
    while (status == 0 && fgets(text, sizeof text, file) != NULL) {
        line++;
        size_t len = strlen(text);
        if (len == sizeof text - 1 && text[len - 1] != '\n') {
            snprintf(message, message_size, "%s:%zu: line longer than %zu characters", path, line,
                     sizeof text - 2);
            status = -1;
            break;
        }
        text[strcspn(text, "\r\n")] = '\0';
        if (text[strspn(text, " \t")] == '\0') {
            continue;
        }
        if (line == 1 && strcmp(text, "arrival_step,prompt_tokens,output_tokens") == 0) {
            continue;
        }
        if (count == room) {
            room = room ? 2 * room : 64;
            kvp_request *grown = realloc(requests, room * sizeof *grown);
            if (grown == NULL) {
                snprintf(message, message_size, "%s: out of memory", path);
                status = -1;
                break;
            }
            requests = grown;
        }
        status = parse_row(text, path, line, capacity, &requests[count], message, message_size);
        count += status == 0;
    }
    fclose(file);
    if (status == 0 && count == 0) {
        snprintf(message, message_size, "%s: no requests", path);
        status = -1;
    }
    if (status != 0) {
        free(requests);
        return -1;
    }
    if (sort_by_arrival(requests, count) != 0) {
        snprintf(message, message_size, "%s: out of memory", path);
        free(requests);
        return -1;
    }
    out->requests = requests;
    out->count = count;
    return 0;
}

void kvp_workload_free(kvp_workload *workload)
{
    free(workload->requests);
    workload->requests = NULL;
    workload->count = 0;
}
