/*
 * mooncake.c: reading a Mooncake trace into a request list
 * (kvp_workload_load_mooncake, workload.h; the format: data/traces/README.md).
 *
 * Owns: a strict parser for exactly one JSON shape, one object per line:
 *   {"timestamp": T, "input_length": I, "output_length": O, "hash_ids": [h, ...]}
 * keys in any order, JSON whitespace (space, tab, CR) anywhere between
 * tokens. Unknown keys are refused, not skipped: the shape is fixed, and a
 * misspelt key ("input_len") is then named as what it is, not reported as a
 * missing one; refusing also spares this parser strings, floats and nested
 * values, which no such trace holds. Keys are plain ASCII: a key with a
 * backslash escape is refused as unknown. Numbers are JSON integers without
 * a sign, a fraction or an exponent (a leading zero is JSON's error too).
 * Invariants: the list is built in two growing arrays (requests, ids) and
 * joined at the end into one allocation, requests first and the ids behind
 * them, so kvp_workload_free frees both; every failure frees what was
 * built and leaves `out` untouched. Lines come from lines.c's reader, whose
 * buffer grows to the longest line (at most MC_LINE_MAX), never through stdio.
 * Callers: the kvpager program (simulate) and the CLI's tests.
 */
#include "workload.h"

#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "lines.h"

#define MC_LINE_MAX ((size_t)1 << 20) /* characters of one line, newline excluded */
#define MC_SHOWN 40                   /* characters of a value or key a message shows */

_Static_assert(sizeof(kvp_workload_request) % _Alignof(uint64_t) == 0,
               "the ids follow the requests in one allocation");

enum { KEY_TIMESTAMP, KEY_INPUT, KEY_OUTPUT, KEY_HASH_IDS, KEY_COUNT };
static const char *const key_names[KEY_COUNT] = {"timestamp", "input_length", "output_length",
                                                 "hash_ids"};

typedef struct mc_reader {
    const char *path;
    size_t capacity;
    uint64_t ms_per_step;
    kvp_workload_request *requests;
    size_t count;
    size_t room;
    uint64_t *ids; /* every request's ids in a row; request i's start after request i - 1's */
    size_t id_count;
    size_t id_room;
    size_t line;   /* 1-based number of the line being parsed */
    uint64_t last_timestamp;
    char *message;
    size_t message_size;
} mc_reader;

/* One line's values while it is parsed. */
typedef struct mc_line {
    const char *start; /* the line's text: columns count from here */
    const char *p;     /* the cursor */
    unsigned seen;     /* bit k: key k was given */
    uint64_t values[3]; /* timestamp, input_length, output_length */
    size_t first_id;   /* index in ids of this line's first id */
} mc_line;

static int out_of_memory(mc_reader *r, const char *what, size_t bytes)
{
    snprintf(r->message, r->message_size,
             "out of memory: cannot allocate the trace's %s (%zu bytes) (AllocationFailed)", what,
             bytes);
    return KVP_TRACE_OUT_OF_MEMORY;
}

/* Grows `*items` (of `size`-byte items, `*room` of them) to hold `need`; doubling. */
static int grow(mc_reader *r, void **items, size_t *room, size_t need, size_t size,
                size_t first, const char *what)
{
    if (need <= *room) {
        return 0;
    }
    size_t bigger = *room ? *room : first;
    while (bigger < need) {
        bigger = bigger > SIZE_MAX / 2 ? need : 2 * bigger;
    }
    void *grown = kvp_cli_realloc(*items, bigger, size);
    if (grown == NULL) {
        return out_of_memory(r, what, bigger > SIZE_MAX / size ? SIZE_MAX : bigger * size);
    }
    *items = grown;
    *room = bigger;
    return 0;
}

static void skip_space(mc_line *l)
{
    while (*l->p == ' ' || *l->p == '\t' || *l->p == '\r') {
        l->p++;
    }
}

static size_t column(const mc_line *l)
{
    return (size_t)(l->p - l->start) + 1;
}

/* "<file>:<line>: column C: expected X, found 'c'" (or "the end of the line"). */
static int syntax(mc_reader *r, const mc_line *l, const char *expected)
{
    if (*l->p == '\0') {
        snprintf(r->message, r->message_size, "%s:%zu: column %zu: expected %s, found the end "
                 "of the line", r->path, r->line, column(l), expected);
    } else {
        snprintf(r->message, r->message_size, "%s:%zu: column %zu: expected %s, found '%c'",
                 r->path, r->line, column(l), expected, *l->p);
    }
    return -1;
}

/* A key: a string of plain characters (no escape), which must be one of the four. */
static int parse_key(mc_reader *r, mc_line *l, int *key)
{
    if (*l->p != '"') {
        return syntax(r, l, "a key in double quotes");
    }
    const char *name = ++l->p;
    while (*l->p != '"' && *l->p != '\0') {
        l->p++;
    }
    if (*l->p == '\0') {
        return syntax(r, l, "the key's closing '\"'");
    }
    size_t n = (size_t)(l->p - name);
    l->p++;
    for (int k = 0; k < KEY_COUNT; k++) {
        if (strlen(key_names[k]) == n && memcmp(name, key_names[k], n) == 0) {
            if (l->seen & (1u << k)) {
                snprintf(r->message, r->message_size, "%s:%zu: key \"%s\" appears twice",
                         r->path, r->line, key_names[k]);
                return -1;
            }
            l->seen |= 1u << k;
            *key = k;
            return 0;
        }
    }
    snprintf(r->message, r->message_size,
             "%s:%zu: unknown key \"%.*s\" (a line holds exactly timestamp, input_length, "
             "output_length and hash_ids)",
             r->path, r->line, (int)(n < MC_SHOWN ? n : MC_SHOWN), name);
    return -1;
}

/* A value's problem: "<file>:<line>: key "K": 'V' <why>". */
static int bad_value(mc_reader *r, int key, const char *text, size_t n, const char *why)
{
    snprintf(r->message, r->message_size, "%s:%zu: key \"%s\": '%.*s' %s", r->path, r->line,
             key_names[key], (int)(n < MC_SHOWN ? n : MC_SHOWN), text, why);
    return -1;
}

/*
 * A whole number at the cursor, at most `max`. The token is every character
 * a JSON number may hold, so "-3", "1.5" and "2e3" are named whole.
 */
static int parse_number(mc_reader *r, mc_line *l, int key, uint64_t max, uint64_t *out)
{
    const char *text = l->p;
    size_t n = strspn(text, "0123456789+-.eE");
    if (n == 0) {
        return syntax(r, l, key == KEY_HASH_IDS ? "a hash id (a whole number)" : "a whole number");
    }
    l->p += n;
    if (text[0] == '-') {
        return bad_value(r, key, text, n, "is negative");
    }
    if (strspn(text, "0123456789") != n) {
        return bad_value(r, key, text, n, "is not a whole number");
    }
    if (text[0] == '0' && n > 1) {
        return bad_value(r, key, text, n, "has a leading zero (not JSON)");
    }
    uint64_t value = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned digit = (unsigned)(text[i] - '0');
        if (value > (max - digit) / 10) {
            char why[64];
            snprintf(why, sizeof why, "is above %ju", (uintmax_t)max);
            return bad_value(r, key, text, n, why);
        }
        value = value * 10 + digit;
    }
    *out = value;
    return 0;
}

/* hash_ids: a non-empty array of whole numbers, appended to the reader's ids. */
static int parse_ids(mc_reader *r, mc_line *l)
{
    if (*l->p != '[') {
        return syntax(r, l, "'[' (hash_ids is an array)");
    }
    l->p++;
    skip_space(l);
    if (*l->p == ']') {
        snprintf(r->message, r->message_size,
                 "%s:%zu: key \"hash_ids\": empty (a request has at least one block)", r->path,
                 r->line);
        return -1;
    }
    for (;;) {
        uint64_t id;
        if (parse_number(r, l, KEY_HASH_IDS, UINT64_MAX, &id) != 0) {
            return -1;
        }
        int status = grow(r, (void **)&r->ids, &r->id_room, r->id_count + 1, sizeof *r->ids,
                          1024, "hash ids");
        if (status != 0) {
            return status;
        }
        r->ids[r->id_count++] = id;
        skip_space(l);
        if (*l->p == ']') {
            l->p++;
            return 0;
        }
        if (*l->p != ',') {
            return syntax(r, l, "',' or ']'");
        }
        l->p++;
        skip_space(l);
    }
}

static int parse_value(mc_reader *r, mc_line *l, int key)
{
    if (key == KEY_HASH_IDS) {
        return parse_ids(r, l);
    }
    return parse_number(r, l, key, key == KEY_TIMESTAMP ? UINT64_MAX : (uint64_t)SIZE_MAX,
                        &l->values[key]);
}

/* The object: '{' key ':' value (',' key ':' value)* '}' and nothing after it. */
static int parse_object(mc_reader *r, mc_line *l)
{
    skip_space(l);
    if (*l->p != '{') {
        return syntax(r, l, "'{' (each line is one JSON object)");
    }
    l->p++;
    skip_space(l);
    while (*l->p != '}') {
        int key = 0;
        int status = parse_key(r, l, &key);
        skip_space(l);
        if (status == 0 && *l->p != ':') {
            status = syntax(r, l, "':'");
        }
        if (status != 0) {
            return status;
        }
        l->p++;
        skip_space(l);
        if ((status = parse_value(r, l, key)) != 0) {
            return status;
        }
        skip_space(l);
        if (*l->p == ',') {
            l->p++;
            skip_space(l);
            if (*l->p == '}') {
                return syntax(r, l, "a key after ','");
            }
        } else if (*l->p != '}') {
            return syntax(r, l, "',' or '}'");
        }
    }
    l->p++;
    skip_space(l);
    return *l->p == '\0' ? 0 : syntax(r, l, "the end of the line after the object");
}

/* The checks across keys, once the object parsed. */
static int check_request(mc_reader *r, const mc_line *l)
{
    for (int k = 0; k < KEY_COUNT; k++) {
        if (!(l->seen & (1u << k))) {
            snprintf(r->message, r->message_size, "%s:%zu: missing key \"%s\"", r->path, r->line,
                     key_names[k]);
            return -1;
        }
    }
    uint64_t input = l->values[KEY_INPUT];
    uint64_t output = l->values[KEY_OUTPUT];
    size_t ids = r->id_count - l->first_id;
    uint64_t blocks = input / KVP_MOONCAKE_BLOCK_TOKENS + (input % KVP_MOONCAKE_BLOCK_TOKENS != 0);
    if (output == 0) {
        snprintf(r->message, r->message_size,
                 "%s:%zu: key \"output_length\": '0' (a request generates at least one token)",
                 r->path, r->line);
        return -1;
    }
    if (blocks != ids) {
        snprintf(r->message, r->message_size,
                 "%s:%zu: key \"hash_ids\": %zu ids for input_length %ju, which needs "
                 "ceil(%ju / %d) = %ju",
                 r->path, r->line, ids, (uintmax_t)input, (uintmax_t)input,
                 KVP_MOONCAKE_BLOCK_TOKENS, (uintmax_t)blocks);
        return -1;
    }
    if (output > SIZE_MAX - input || input + output > r->capacity) {
        snprintf(r->message, r->message_size,
                 "%s:%zu: input_length + output_length = %ju + %ju exceeds --capacity %zu",
                 r->path, r->line, (uintmax_t)input, (uintmax_t)output, r->capacity);
        return -1;
    }
    uint64_t timestamp = l->values[KEY_TIMESTAMP];
    if (r->count > 0 && timestamp < r->last_timestamp) {
        snprintf(r->message, r->message_size,
                 "%s:%zu: key \"timestamp\": '%ju' is before the previous line's %ju (lines "
                 "must be sorted by timestamp)",
                 r->path, r->line, (uintmax_t)timestamp, (uintmax_t)r->last_timestamp);
        return -1;
    }
    if (timestamp / r->ms_per_step > SIZE_MAX) {
        snprintf(r->message, r->message_size, "%s:%zu: key \"timestamp\": '%ju' overflows the "
                 "step count", r->path, r->line, (uintmax_t)timestamp);
        return -1;
    }
    return 0;
}

/* One complete line (NUL-terminated, newline removed): a kvp_line_fn. */
static int end_line(void *context, char *text, size_t len, size_t line)
{
    mc_reader *r = context;
    r->line = line;
    if (len == 0 || text[strspn(text, " \t\r")] == '\0') {
        return 0; /* an empty or blank line */
    }
    mc_line l = {.start = text, .p = text, .first_id = r->id_count};
    int status = parse_object(r, &l);
    if (status == 0) {
        status = check_request(r, &l);
    }
    if (status == 0) {
        status = grow(r, (void **)&r->requests, &r->room, r->count + 1, sizeof *r->requests, 64,
                      "requests");
    }
    if (status != 0) {
        return status;
    }
    kvp_workload_request *q = &r->requests[r->count];
    memset(q, 0, sizeof *q);
    q->arrival_step = (size_t)(l.values[KEY_TIMESTAMP] / r->ms_per_step);
    q->prompt_tokens = (size_t)l.values[KEY_INPUT];
    q->output_tokens = (size_t)l.values[KEY_OUTPUT];
    q->stream = r->count;
    q->block_count = r->id_count - l.first_id; /* block_ids are set when the list is joined */
    r->last_timestamp = l.values[KEY_TIMESTAMP];
    r->count++;
    return 0;
}

/* Joins requests and ids into one allocation (requests first) and points each request at its ids. */
static int join(mc_reader *r, kvp_workload *out)
{
    size_t head = r->count * sizeof *r->requests;
    if (r->id_count > (SIZE_MAX - head) / sizeof *r->ids) {
        return out_of_memory(r, "requests and hash ids", SIZE_MAX);
    }
    size_t bytes = head + r->id_count * sizeof *r->ids;
    kvp_workload_request *all = kvp_cli_realloc(r->requests, bytes, 1);
    if (all == NULL) {
        return out_of_memory(r, "requests and hash ids", bytes);
    }
    r->requests = NULL; /* now `all` */
    uint64_t *ids = (uint64_t *)(void *)((char *)all + head);
    memcpy(ids, r->ids, r->id_count * sizeof *ids);
    size_t next = 0;
    for (size_t i = 0; i < r->count; i++) {
        all[i].block_ids = ids + next;
        next += all[i].block_count;
    }
    out->requests = all;
    out->count = r->count;
    return 0;
}

int kvp_workload_load_mooncake(const char *path, size_t capacity, uint64_t ms_per_step,
                               kvp_workload *out, char *message, size_t message_size)
{
    if (ms_per_step == 0) {
        snprintf(message, message_size, "%s: milliseconds per step must be at least 1", path);
        return -1;
    }
    mc_reader r = {.path = path, .capacity = capacity, .ms_per_step = ms_per_step, .line = 1,
                   .message = message, .message_size = message_size};
    const kvp_lines lines = {.path = path, .max_len = MC_LINE_MAX, .max_shown = MC_LINE_MAX,
                             .handle = end_line, .context = &r, .message = message,
                             .message_size = message_size};
    int status = kvp_lines_read(&lines);
    if (status == 0 && r.count == 0) {
        snprintf(message, message_size, "%s: no requests", path);
        status = -1;
    }
    if (status == 0) {
        status = join(&r, out);
    }
    kvp_cli_free(r.requests);
    kvp_cli_free(r.ids);
    return status;
}
