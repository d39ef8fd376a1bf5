/*
 * test_trace.c: the Mooncake trace loader (src/cli/mooncake.c) and the
 * trace's reference hit rates (src/cli/trace_stats.c), through the
 * kvpager_cli library (cmocka).
 *
 * - every malformed line is refused with "<file>:<line>:" and what is wrong;
 * - a good file's requests: arrival steps (rounded down), lengths, block ids
 *   in one allocation; every other workload leaves the block ids empty;
 * - a hand-made trace's ceiling and LRU figures, computed by hand below,
 *   under both keyings (chain and id alone), where they differ;
 * - the repository's trace (data/traces): its ceiling, 64.0% of 121,877
 *   blocks (43,924 distinct), and the published LRU figures at Llama-3-8B
 *   bf16 sizes (2.1%, 14.6%, 37.8%, 53.1% at 16, 128, 512, 1024 GiB), with
 *   the time each takes;
 * - every allocation failure of the loader and of the figures leaves
 *   nothing allocated (the sanitizers' leak check, memcheck in release) and
 *   the output untouched.
 * KVP_TRACE_FILE (set by tests/CMakeLists.txt) names the repository's trace.
 */
#define _DEFAULT_SOURCE /* mkdtemp */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "alloc.h"
#include "lines.h"
#include "trace_stats.h"
#include "workload.h"

static char dir[256];
static char path[300];

static int make_dir(void **state)
{
    (void)state;
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/kvp_trace_XXXXXX", tmp != NULL && *tmp != '\0' ? tmp : "/tmp");
    if (mkdtemp(dir) == NULL) {
        return -1;
    }
    snprintf(path, sizeof path, "%s/trace.jsonl", dir);
    return 0;
}

static int remove_dir(void **state)
{
    (void)state;
    unlink(path);
    return rmdir(dir);
}

/* Writes `n` bytes of `text` to `path`. */
static void write_bytes(const char *text, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static void write_text(const char *text)
{
    write_bytes(text, strlen(text));
}

/* Loading `text` fails with -1 and a message holding "<path>:<line>:" and `what`. */
static void expect_refused(const char *text, size_t capacity, size_t line, const char *what)
{
    write_text(text);
    kvp_workload w = {NULL, 77};
    char message[512] = "";
    int status = kvp_workload_load_mooncake(path, capacity, 1, &w, message, sizeof message);
    char where[320];
    snprintf(where, sizeof where, "%s:%zu: ", path, line);
    if (status != -1 || strstr(message, where) != message || strstr(message, what) == NULL) {
        print_error("input:\n%s\nstatus %d, message: %s\nwanted: %s...%s\n", text, status,
                    message, where, what);
        fail();
    }
    assert_null(w.requests); /* untouched */
    assert_int_equal(w.count, 77);
}

#define GOOD "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [1, 2]}\n"

/* Each malformed line, after a good line 1 (so the line number is 2, or as given). */
static void test_trace_refuses_each_malformed_line(void **state)
{
    (void)state;
    static const struct {
        const char *line;
        const char *what;
    } bad[] = {
        /* missing fields */
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1}", "missing key \"hash_ids\""},
        {"{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}", "missing key \"timestamp\""},
        {"{\"timestamp\": 7, \"output_length\": 1, \"hash_ids\": [3]}", "missing key \"input_length\""},
        {"{\"timestamp\": 7, \"input_length\": 10, \"hash_ids\": [3]}", "missing key \"output_length\""},
        {"{}", "missing key \"timestamp\""},
        /* negative values */
        {"{\"timestamp\": -7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
         "key \"timestamp\": '-7' is negative"},
        {"{\"timestamp\": 7, \"input_length\": -10, \"output_length\": 1, \"hash_ids\": [3]}",
         "key \"input_length\": '-10' is negative"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": -1, \"hash_ids\": [3]}",
         "key \"output_length\": '-1' is negative"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3, -4]}",
         "key \"hash_ids\": '-4' is negative"},
        {"{\"timestamp\": -0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
         "'-0' is negative"},
        /* not whole numbers */
        {"{\"timestamp\": 7.5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
         "key \"timestamp\": '7.5' is not a whole number"},
        {"{\"timestamp\": 7, \"input_length\": 1e3, \"output_length\": 1, \"hash_ids\": [3]}",
         "key \"input_length\": '1e3' is not a whole number"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1.0, \"hash_ids\": [3]}",
         "key \"output_length\": '1.0' is not a whole number"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3.25]}",
         "key \"hash_ids\": '3.25' is not a whole number"},
        {"{\"timestamp\": +7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
         "'+7' is not a whole number"},
        {"{\"timestamp\": 07, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
         "'07' has a leading zero"},
        {"{\"timestamp\": \"7\", \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
         "column 15: expected a whole number, found '\"'"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": 3}",
         "expected '[' (hash_ids is an array)"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3, \"a\"]}",
         "expected a hash id"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [null]}",
         "expected a hash id"},
        /* overflow */
        {"{\"timestamp\": 18446744073709551616, \"input_length\": 10, \"output_length\": 1, "
         "\"hash_ids\": [3]}",
         "'18446744073709551616' is above 18446744073709551615"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, "
         "\"hash_ids\": [99999999999999999999]}",
         "key \"hash_ids\": '99999999999999999999' is above"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 18446744073709551615, "
         "\"hash_ids\": [3]}",
         "input_length + output_length = 10 + 18446744073709551615 exceeds --capacity"},
        /* empty hash_ids, and counts that disagree with the length */
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [ ]}",
         "key \"hash_ids\": empty"},
        {"{\"timestamp\": 7, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": [3]}",
         "1 ids for input_length 0, which needs ceil(0 / 512) = 0"},
        {"{\"timestamp\": 7, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [3]}",
         "1 ids for input_length 513, which needs ceil(513 / 512) = 2"},
        {"{\"timestamp\": 7, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [3, 4]}",
         "2 ids for input_length 512, which needs ceil(512 / 512) = 1"},
        /* no output */
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 0, \"hash_ids\": [3]}",
         "key \"output_length\": '0'"},
        /* keys: unknown, repeated */
        {"{\"timestamp\": 7, \"input_len\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
         "unknown key \"input_len\""},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3], "
         "\"session\": 1}",
         "unknown key \"session\""},
        {"{\"timestamp\": 7, \"timestamp\": 8, \"input_length\": 10, \"output_length\": 1, "
         "\"hash_ids\": [3]}",
         "key \"timestamp\" appears twice"},
        {"{\"time\\u0073tamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
         "unknown key"},
        /* JSON syntax */
        {"[7, 10, 1, [3]]", "column 1: expected '{' (each line is one JSON object)"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]} x",
         "expected the end of the line after the object, found 'x'"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3],}",
         "expected a key after ','"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3,]}",
         "expected a hash id"},
        {"{\"timestamp\": 7 \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
         "expected ',' or '}'"},
        {"{\"timestamp\" 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
         "expected ':'"},
        {"{timestamp: 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
         "expected a key in double quotes"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3",
         "expected ',' or ']', found the end of the line"},
        {"{\"timestamp\": 7, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]",
         "expected ',' or '}', found the end of the line"},
        {"{\"timestamp", "expected the key's closing '\"'"},
        /* over capacity (1000 below) */
        {"{\"timestamp\": 7, \"input_length\": 990, \"output_length\": 11, \"hash_ids\": [3, 4]}",
         "input_length + output_length = 990 + 11 exceeds --capacity 1000"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[1024];
        snprintf(text, sizeof text, GOOD "%s\n" GOOD, bad[i].line);
        expect_refused(text, 1000, 2, bad[i].what);
    }
}

/* Problems that span lines, and the file as a whole. */
static void test_trace_refuses_bad_files(void **state)
{
    (void)state;
    /* non-monotone timestamps: line 3 goes back to 4 after 5 (blank line 2 counts) */
    expect_refused(GOOD "\n{\"timestamp\": 4, \"input_length\": 1, \"output_length\": 1, "
                        "\"hash_ids\": [9]}\n",
                   1000, 3, "key \"timestamp\": '4' is before the previous line's 5");
    /* equal timestamps are fine, the refusal comes at line 4 */
    expect_refused(GOOD GOOD GOOD "{\"timestamp\": 5, \"input_length\": 1}\n", 1000, 4,
                   "missing key");
    /* a NUL byte */
    write_bytes(GOOD "{\"times\0", sizeof(GOOD "{\"times\0") - 1);
    kvp_workload w = {NULL, 0};
    char message[512] = "";
    assert_int_equal(kvp_workload_load_mooncake(path, 1000, 1, &w, message, sizeof message), -1);
    assert_non_null(strstr(message, ":2: a NUL byte at column 8"));
    assert_null(w.requests);
    /* a line over 1 MiB (spaces are JSON whitespace: only its length is wrong) */
    size_t long_line = strlen(GOOD) + ((size_t)1 << 20) + 1;
    char *text = malloc(long_line + 1);
    assert_non_null(text);
    memcpy(text, GOOD, strlen(GOOD));
    memset(text + strlen(GOOD), ' ', long_line - strlen(GOOD));
    text[long_line] = '\0';
    expect_refused(text, 1000, 2, "line longer than 1048576 characters");
    free(text);
    /* no requests: an empty file, and blank lines only */
    static const char *const empty[] = {"", "\n \r\n\t\n"};
    for (size_t i = 0; i < 2; i++) {
        write_text(empty[i]);
        assert_int_equal(kvp_workload_load_mooncake(path, 1000, 1, &w, message, sizeof message),
                         -1);
        assert_non_null(strstr(message, ": no requests"));
    }
    /* a directory, a missing file, no milliseconds per step */
    assert_int_equal(kvp_workload_load_mooncake(dir, 1000, 1, &w, message, sizeof message), -1);
    assert_non_null(strstr(message, "Is a directory"));
    unlink(path);
    assert_int_equal(kvp_workload_load_mooncake(path, 1000, 1, &w, message, sizeof message), -1);
    assert_non_null(strstr(message, "No such file"));
    write_text(GOOD);
    assert_int_equal(kvp_workload_load_mooncake(path, 1000, 0, &w, message, sizeof message), -1);
    assert_non_null(strstr(message, "milliseconds per step"));
    assert_null(w.requests);
}

/* What the line reader handed over: each line's length and number, and a copy of line 3. */
typedef struct seen_lines {
    size_t count;
    size_t len[8];
    size_t number[8];
    char third[8];
} seen_lines;

static int record_line(void *context, char *text, size_t len, size_t line)
{
    seen_lines *seen = context;
    assert_int_equal(strlen(text), len); /* NUL-terminated, no newline */
    if (seen->count < 8) {
        seen->len[seen->count] = len;
        seen->number[seen->count] = line;
    }
    if (line == 3) {
        snprintf(seen->third, sizeof seen->third, "%s", text);
    }
    seen->count++;
    return line == 6 ? 42 : 0; /* the handler's status stops the reading */
}

/*
 * The shared line reader (src/cli/lines.c) both trace formats use: a byte
 * order mark skipped, empty lines handed over, lines numbered from 1, a line
 * far longer than the buffer's first 256 bytes, the last line without its
 * newline, the handler's status returned; the limit and its message; and the
 * CSV reader keeps its limit, 510 characters and a CR.
 */
static void test_trace_line_reader(void **state)
{
    (void)state;
    char *text = malloc(6000);
    assert_non_null(text);
    memcpy(text, "\357\273\277ab\n\nxyz\r\n", 12);
    memset(text + 12, 'q', 5000);
    memcpy(text + 5012, "\nend", 5);
    write_text(text);
    char message[256] = "";
    seen_lines seen = {0};
    kvp_lines lines = {.path = path, .max_len = 5000, .max_shown = 5000,
                       .handle = record_line, .context = &seen, .message = message,
                       .message_size = sizeof message};
    assert_int_equal(kvp_lines_read(&lines), 0);
    assert_int_equal(seen.count, 5);
    const size_t lens[5] = {2, 0, 4, 5000, 3};
    for (size_t i = 0; i < 5; i++) {
        assert_int_equal(seen.len[i], lens[i]);
        assert_int_equal(seen.number[i], i + 1);
    }
    assert_string_equal(seen.third, "xyz\r");
    /* one character over the limit: refused with the line and the limit named */
    lines.max_len = 4999;
    lines.max_shown = 4998;
    seen.count = 0;
    assert_int_equal(kvp_lines_read(&lines), -1);
    snprintf(text, 6000, "%s:4: line longer than 4998 characters", path);
    assert_string_equal(message, text);
    /* the handler's status: line 6 stops the reading */
    write_text("1\n2\n3\n4\n5\n6\n7\n");
    lines.max_len = 10;
    seen.count = 0;
    assert_int_equal(kvp_lines_read(&lines), 42);
    assert_int_equal(seen.count, 6);
    /* CSV: 511 characters, a CR included, are a row; 512 are refused as before */
    memset(text, '0', 506);
    memcpy(text + 506, ",5,4\r\n", 7);
    write_text(text);
    kvp_workload w = {NULL, 0};
    assert_int_equal(kvp_workload_load_trace(path, 100, &w, message, sizeof message), 0);
    assert_int_equal(w.count, 1);
    assert_int_equal(w.requests[0].prompt_tokens, 5);
    kvp_workload_free(&w);
    memset(text, '0', 507);
    memcpy(text + 507, ",5,4\r\n", 7);
    write_text(text);
    assert_int_equal(kvp_workload_load_trace(path, 100, &w, message, sizeof message), -1);
    assert_non_null(strstr(message, ":1: line longer than 510 characters"));
    assert_null(w.requests);
    free(text);
}

/*
 * A good file: keys in any order, JSON whitespace, CRLF, a byte order mark,
 * blank lines, no final newline; arrival_step = floor(timestamp / 10).
 */
static void test_trace_reads_requests_and_their_ids(void **state)
{
    (void)state;
    write_text("\xEF\xBB\xBF{\"timestamp\":0,\"input_length\":1,\"output_length\":2,\"hash_ids\":[7]}\r\n"
               "\n"
               "  { \"hash_ids\" : [ 7 , 8 ,9 ] ,\t\"output_length\": 5, \"input_length\": 1025,"
               " \"timestamp\": 9 }  \n"
               "{\"output_length\": 1, \"timestamp\": 10, \"hash_ids\": [18446744073709551615],"
               " \"input_length\": 512}\n"
               "{\"timestamp\": 25, \"input_length\": 600, \"output_length\": 400, \"hash_ids\": "
               "[0, 1]}");
    kvp_workload w = {NULL, 0};
    char message[512] = "";
    int status = kvp_workload_load_mooncake(path, 1030, 10, &w, message, sizeof message);
    if (status != 0) {
        print_error("%s\n", message);
    }
    assert_int_equal(status, 0);
    assert_int_equal(w.count, 4);
    static const size_t steps[4] = {0, 0, 1, 2};
    static const size_t prompts[4] = {1, 1025, 512, 600};
    static const size_t outputs[4] = {2, 5, 1, 400};
    static const uint64_t ids[] = {7, 7, 8, 9, UINT64_MAX, 0, 1};
    static const size_t counts[4] = {1, 3, 1, 2};
    /* the ids follow the requests in the list's one allocation, in a row */
    const uint64_t *all = (const uint64_t *)(const void *)(w.requests + w.count);
    size_t next = 0;
    for (size_t i = 0; i < w.count; i++) {
        const kvp_workload_request *r = &w.requests[i];
        assert_int_equal(r->arrival_step, steps[i]);
        assert_int_equal(r->prompt_tokens, prompts[i]);
        assert_int_equal(r->output_tokens, outputs[i]);
        assert_int_equal(r->stream, i);
        assert_int_equal(r->shared_tokens + r->turn + r->think_steps + r->session, 0);
        assert_int_equal(r->block_count, counts[i]);
        assert_ptr_equal(r->block_ids, all + next);
        for (size_t b = 0; b < r->block_count; b++) {
            assert_true(r->block_ids[b] == ids[next + b]);
        }
        next += r->block_count;
    }
    kvp_workload_free(&w);
    assert_null(w.requests);
    /* capacity is inclusive: 600 + 399 fits 999 exactly, 600 + 400 on line 5 does not */
    expect_refused("{\"timestamp\": 25, \"input_length\": 600, \"output_length\": 399, "
                   "\"hash_ids\": [0, 1]}\n\n\n\n{\"timestamp\": 25, \"input_length\": 600, "
                   "\"output_length\": 400, \"hash_ids\": [0, 1]}\n",
                   999, 5, "input_length + output_length = 600 + 400 exceeds --capacity 999");
    expect_refused("{\"timestamp\": 0, \"input_length\": 1025, \"output_length\": 5, "
                   "\"hash_ids\": [7, 8, 9]}\n", 1029, 1, "1025 + 5 exceeds --capacity 1029");
}

/* Every generated workload and the CSV trace leave the block ids empty. */
static void test_trace_other_workloads_have_no_block_ids(void **state)
{
    (void)state;
    for (int profile = 0; profile < 4; profile++) {
        kvp_workload_spec spec = {.profile = (kvp_profile)profile,
                                  .arrival = KVP_ARRIVAL_POISSON, .rate = 1.0, .requests = 100,
                                  .capacity = 2048, .seed = 3, .shared_prefix = 5};
        kvp_workload_spec_defaults(&spec);
        kvp_workload w = {NULL, 0};
        assert_int_equal(kvp_workload_generate(&spec, &w), 0);
        for (size_t i = 0; i < w.count; i++) {
            assert_null(w.requests[i].block_ids);
            assert_int_equal(w.requests[i].block_count, 0);
        }
        kvp_trace_hits h;
        assert_int_equal(kvp_trace_ceiling(&w, KVP_TRACE_KEY_CHAIN, &h), 0);
        assert_int_equal(h.references + h.hits + h.distinct, 0);
        kvp_workload_free(&w);
    }
    write_text("arrival_step,prompt_tokens,output_tokens\n0,5,5\n3,7,1\n");
    kvp_workload w = {NULL, 0};
    char message[512] = "";
    assert_int_equal(kvp_workload_load_trace(path, 100, &w, message, sizeof message), 0);
    assert_int_equal(w.count, 2);
    for (size_t i = 0; i < w.count; i++) {
        assert_null(w.requests[i].block_ids);
        assert_int_equal(w.requests[i].block_count, 0);
    }
    kvp_workload_free(&w);
}

/*
 * The hand-made trace. Requests and their ids (input lengths give
 * ceil(input / 512) ids):
 *   R0 [1 2 3]  R1 [1 2 4]  R2 [5]  R3 [1 2 3 6]  R4 [7 2]
 * Chain keys: a=(1) b=(1,2) c=(1,2,3) d=(1,2,4) e=(5) f=(1,2,3,6) g=(7)
 * h=(7,2); the references are a b c | a b d | e | a b c f | g h: 13, of
 * 8 distinct keys, so the ceiling is 13 - 8 = 5 hits (R1's a b, R3's a b c).
 * By id alone, 7 distinct ids: 6 hits (R4's 2 also hits, after 1 not 7).
 * LRU by chain (most recent first):
 *   N=2: every reference misses (a request's scan of 3 keys pushes out its
 *        own first): 0.
 *   N=3: a b c [c b a]; a hit, b hit [b a c]; d miss, out c [d b a]; e, out
 *        a [e d b]; a, out b; b, out d; c, out e [c b a]; f, g, h miss: 2.
 *   N=4: a b c; a b hit; d [d b a c]; e, out c [e d b a]; a hit, b hit
 *        [b a e d]; c, out d; f, out e; g, out a; h, out b: 4.
 *   N=5: as N=4 but e does not push c out, so R3's c hits too: 5 = ceiling.
 * LRU by id:
 *   N=3: 1 2 3; 1 2 hit [2 1 3]; 4, out 3 [4 2 1]; 5, out 1 [5 4 2]; 1, out
 *        2; 2, out 4; 3, out 5 [3 2 1]; 6, out 1; 7, out 2; 2, out 3: 2.
 *   N=4: 1 2 3; 1 2 hit; 4 [4 2 1 3]; 5, out 3 [5 4 2 1]; 1 hit, 2 hit
 *        [2 1 5 4]; 3, out 4 [3 2 1 5]; 6, out 5 [6 3 2 1]; 7, out 1
 *        [7 6 3 2]; 2 hit: 5.
 *   N=7: 6 = ceiling.
 * Weighted by tokens (inputs 1500, 1100, 100, 2000, 600: 5300 tokens; a
 * block holds 512 but the last, which holds the rest): R0 a b c = 512 512
 * 476, R1 a b d = 512 512 76, R2 e = 100, R3 a b c f = 512 512 512 464, R4
 * g h = 512 88. Chain ceiling: R1's a b and R3's a b c, 5 x 512 = 2560; by
 * id, R4's 2 adds its 88: 2648. LRU by chain: N=3 R1's a b, 1024; N=4 and
 * R3's a b, 2048; N=5 2560. By id: N=3 1024; N=4 R1's and R3's 1 2 and
 * R4's 2, 4 x 512 + 88 = 2136; N=7 2648.
 */
#define HAND                                                                                  \
    "{\"timestamp\": 0, \"input_length\": 1500, \"output_length\": 4, \"hash_ids\": [1, 2, 3]}\n" \
    "{\"timestamp\": 1, \"input_length\": 1100, \"output_length\": 4, \"hash_ids\": [1, 2, 4]}\n" \
    "{\"timestamp\": 2, \"input_length\": 100, \"output_length\": 4, \"hash_ids\": [5]}\n"       \
    "{\"timestamp\": 3, \"input_length\": 2000, \"output_length\": 4, \"hash_ids\": [1, 2, 3, 6]}\n" \
    "{\"timestamp\": 4, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [7, 2]}\n"

static void expect_hits(const kvp_trace_hits *h, size_t references, size_t hits, size_t distinct)
{
    assert_int_equal(h->references, references);
    assert_int_equal(h->hits, hits);
    assert_int_equal(h->distinct, distinct);
}

static void test_trace_hand_made_figures(void **state)
{
    (void)state;
    write_text(HAND);
    kvp_workload w = {NULL, 0};
    char message[512] = "";
    assert_int_equal(kvp_workload_load_mooncake(path, 4096, 1, &w, message, sizeof message), 0);
    kvp_trace_hits h;
    assert_int_equal(kvp_trace_ceiling(&w, KVP_TRACE_KEY_CHAIN, &h), 0);
    expect_hits(&h, 13, 5, 8);
    assert_true(kvp_trace_rate(&h) == 5.0 / 13.0);
    assert_int_equal(h.tokens, 5300);
    assert_int_equal(h.hit_tokens, 2560);
    assert_true(kvp_trace_token_rate(&h) == 2560.0 / 5300.0);
    assert_int_equal(kvp_trace_ceiling(&w, KVP_TRACE_KEY_ID, &h), 0);
    expect_hits(&h, 13, 6, 7);
    assert_int_equal(h.hit_tokens, 2648);
    static const struct {
        kvp_trace_keying keying;
        size_t blocks;
        size_t hits;
        size_t hit_tokens;
    } lru[] = {{KVP_TRACE_KEY_CHAIN, 0, 0, 0},           {KVP_TRACE_KEY_CHAIN, 1, 0, 0},
               {KVP_TRACE_KEY_CHAIN, 2, 0, 0},           {KVP_TRACE_KEY_CHAIN, 3, 2, 1024},
               {KVP_TRACE_KEY_CHAIN, 4, 4, 2048},        {KVP_TRACE_KEY_CHAIN, 5, 5, 2560},
               {KVP_TRACE_KEY_CHAIN, 8, 5, 2560},        {KVP_TRACE_KEY_CHAIN, SIZE_MAX, 5, 2560},
               {KVP_TRACE_KEY_ID, 3, 2, 1024},           {KVP_TRACE_KEY_ID, 4, 5, 2136},
               {KVP_TRACE_KEY_ID, 7, 6, 2648},           {KVP_TRACE_KEY_ID, SIZE_MAX, 6, 2648}};
    for (size_t i = 0; i < sizeof lru / sizeof lru[0]; i++) {
        assert_int_equal(kvp_trace_lru(&w, lru[i].keying, lru[i].blocks, &h), 0);
        expect_hits(&h, 13, lru[i].hits, lru[i].keying == KVP_TRACE_KEY_CHAIN ? 8 : 7);
        assert_int_equal(h.tokens, 5300);
        assert_int_equal(h.hit_tokens, lru[i].hit_tokens);
    }
    kvp_workload_free(&w);
    /* a pool's pages in trace blocks */
    assert_int_equal(kvp_trace_blocks_of_pages(8192, 16), 256);
    assert_int_equal(kvp_trace_blocks_of_pages(31, 16), 0);
    assert_int_equal(kvp_trace_blocks_of_pages(33, 16), 1);
    assert_true(kvp_trace_blocks_of_pages(SIZE_MAX, 16) == SIZE_MAX);
}

static double seconds_since(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) * 1e-9;
}

/*
 * The repository's trace: 3,993 requests, 121,877 block references, 43,924
 * distinct under either keying (its ids are prefix hashes), a ceiling of
 * 77,953 hits (64.0%), and an LRU of budget / (128 KiB x 512) blocks, Llama-3-8B
 * in bf16 (2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token).
 */
static void test_trace_full_file_figures(void **state)
{
    (void)state;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kvp_workload w = {NULL, 0};
    char message[512] = "";
    int status = kvp_workload_load_mooncake(KVP_TRACE_FILE, SIZE_MAX, 1, &w, message,
                                            sizeof message);
    if (status != 0) {
        print_error("%s\n", message);
    }
    assert_int_equal(status, 0);
    print_message("load %.2f ms\n", 1e3 * seconds_since(&t0));
    assert_int_equal(w.count, 3993);
    size_t input = 0;
    size_t output = 0;
    for (size_t i = 0; i < w.count; i++) {
        input += w.requests[i].prompt_tokens;
        output += w.requests[i].output_tokens;
    }
    assert_int_equal(input, 61194628);  /* mean 15,325.5 */
    assert_int_equal(output, 595432);   /* mean 149.1 */
    assert_int_equal(w.requests[w.count - 1].arrival_step, 1022025);
    static const size_t gib[4] = {16, 128, 512, 1024};
    static const size_t blocks[4] = {256, 2048, 8192, 16384};
    static const size_t hits[4] = {2508, 17800, 46065, 64724};
    /* of 61,194,628 prompt tokens: 2.10%, 14.88%, 38.49%, 54.08% */
    static const size_t hit_tokens[4] = {1283896, 9106996, 23556205, 33092507};
    static const char *const shown[4] = {"2.1", "14.6", "37.8", "53.1"};
    for (int keying = 0; keying < 2; keying++) {
        clock_gettime(CLOCK_MONOTONIC, &t0);
        kvp_trace_keys keys;
        assert_int_equal(kvp_trace_keys_build(&w, (kvp_trace_keying)keying, &keys), 0);
        kvp_trace_hits h;
        kvp_trace_keys_ceiling(&keys, &h);
        expect_hits(&h, 121877, 77953, 43924);
        assert_int_equal(h.tokens, 61194628);
        assert_int_equal(h.hit_tokens, 39852661); /* 65.1% of prompt tokens */
        char text[16];
        snprintf(text, sizeof text, "%.1f", 100.0 * kvp_trace_rate(&h));
        assert_string_equal(text, "64.0");
        print_message("%s keys and ceiling %.2f ms: %zu of %zu (%.2f%%; %.2f%% of tokens)\n",
                      keying == KVP_TRACE_KEY_CHAIN ? "chain" : "id", 1e3 * seconds_since(&t0), h.hits,
                      h.references, 100.0 * kvp_trace_rate(&h), 100.0 * kvp_trace_token_rate(&h));
        for (int b = 0; b < 4; b++) {
            size_t pages = (gib[b] << 30) / ((size_t)128 * 1024 * 16); /* 16-token pages */
            assert_int_equal(kvp_trace_blocks_of_pages(pages, 16), blocks[b]);
            clock_gettime(CLOCK_MONOTONIC, &t0);
            assert_int_equal(kvp_trace_keys_lru(&keys, blocks[b], &h), 0);
            double took = seconds_since(&t0);
            expect_hits(&h, 121877, hits[b], 43924);
            assert_int_equal(h.hit_tokens, hit_tokens[b]);
            snprintf(text, sizeof text, "%.1f", 100.0 * kvp_trace_rate(&h));
            assert_string_equal(text, shown[b]);
            print_message("  LRU %zu GiB = %zu blocks: %zu hits (%.2f%%; %.2f%% of tokens) in "
                          "%.2f ms\n", gib[b], blocks[b], h.hits, 100.0 * kvp_trace_rate(&h),
                          100.0 * kvp_trace_token_rate(&h), 1e3 * took);
        }
        assert_int_equal(kvp_trace_keys_lru(&keys, 43924, &h), 0);
        expect_hits(&h, 121877, 77953, 43924); /* as many blocks as keys: the ceiling */
        kvp_trace_keys_free(&keys);
    }
    kvp_workload_free(&w);
}

/*
 * Every allocation of the loader (the full file: the line buffer, the ids
 * and the requests grow several times, then join) and of the figures fails
 * in turn: the call fails, `out` is untouched, nothing stays allocated.
 */
static void test_trace_allocation_failures_leave_nothing(void **state)
{
    (void)state;
    char message[512];
    uint64_t n = 1;
    for (;; n++) {
        kvp_workload w = {NULL, 77};
        kvp_cli_fault_arm(n);
        int status = kvp_workload_load_mooncake(KVP_TRACE_FILE, SIZE_MAX, 1, &w, message,
                                                sizeof message);
        int fired = kvp_cli_fault_fired();
        kvp_cli_fault_arm(0);
        if (!fired) {
            assert_int_equal(status, 0);
            kvp_workload_free(&w);
            break;
        }
        assert_int_equal(status, KVP_TRACE_OUT_OF_MEMORY);
        assert_non_null(strstr(message, "(AllocationFailed)"));
        assert_null(w.requests);
        assert_int_equal(w.count, 77);
    }
    assert_true(n > 15); /* each array grew, and the join ran */
    write_text(HAND);
    kvp_workload w = {NULL, 0};
    assert_int_equal(kvp_workload_load_mooncake(path, 4096, 1, &w, message, sizeof message), 0);
    kvp_trace_keys keys = {NULL, NULL, 5, 5};
    for (n = 1; n <= 2; n++) {
        kvp_cli_fault_arm(n);
        assert_int_equal(kvp_trace_keys_build(&w, KVP_TRACE_KEY_CHAIN, &keys), -1);
        assert_null(keys.key);
        assert_int_equal(keys.references + keys.distinct, 10);
    }
    kvp_trace_hits h = {1, 2, 3, 4, 5};
    kvp_cli_fault_arm(1);
    assert_int_equal(kvp_trace_ceiling(&w, KVP_TRACE_KEY_ID, &h), -1);
    for (n = 1; n <= 3; n++) {
        kvp_cli_fault_arm(n);
        assert_int_equal(kvp_trace_lru(&w, KVP_TRACE_KEY_ID, 4, &h), -1);
    }
    kvp_cli_fault_arm(4);
    assert_int_equal(kvp_trace_lru(&w, KVP_TRACE_KEY_ID, 4, &h), 0);
    assert_false(kvp_cli_fault_fired());
    kvp_cli_fault_arm(0);
    expect_hits(&h, 13, 5, 7);
    kvp_workload_free(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_trace_refuses_each_malformed_line),
        cmocka_unit_test(test_trace_refuses_bad_files),
        cmocka_unit_test(test_trace_line_reader),
        cmocka_unit_test(test_trace_reads_requests_and_their_ids),
        cmocka_unit_test(test_trace_other_workloads_have_no_block_ids),
        cmocka_unit_test(test_trace_hand_made_figures),
        cmocka_unit_test(test_trace_full_file_figures),
        cmocka_unit_test(test_trace_allocation_failures_leave_nothing),
    };
    return cmocka_run_group_tests(tests, make_dir, remove_dir);
}
