/*
 * test_cli.c: unit tests of the kvpager program's helpers (cmocka), through
 * the kvpager_cli library: strict number and byte-size parsing, checked size
 * arithmetic, the program's allocation hook and its fault injector, the JSON
 * writer, the plot's round tick steps, and the workload names. The commands
 * themselves are checked end to end by the shell checks in this folder and
 * by sweep_cli.c.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "alloc.h"
#include "cli.h"
#include "json.h"
#include "measure.h"
#include "plot.h"
#include "workload.h"

static void test_cli_parse_size_is_digits_only(void **state)
{
    (void)state;
    size_t v = 7;
    assert_int_equal(kvp_cli_parse_size("0", &v), 0);
    assert_int_equal(v, 0);
    assert_int_equal(kvp_cli_parse_size("18446744073709551615", &v), 0);
    assert_true(v == SIZE_MAX);
    v = 7;
    const char *bad[] = {"", "-1", "+1", " 1", "1 ", "1.0", "1e3", "0x10", "18446744073709551616",
                         "99999999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(kvp_cli_parse_size(bad[i], &v), -1);
    }
    assert_int_equal(kvp_cli_parse_size(NULL, &v), -1);
    assert_int_equal(v, 7); /* a failed parse writes nothing */
}

static void test_cli_parse_bytes_units_and_whole_counts(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        size_t bytes;
    } good[] = {{"0", 0},
                {"512", 512},
                {"7B", 7},
                {"2KiB", 2048},
                {"1.5KiB", 1536},
                {"3MiB", (size_t)3 << 20},
                {"1GiB", (size_t)1 << 30},
                {"1TiB", (size_t)1 << 40},
                {"0.0000152587890625TiB", (size_t)1 << 24},
                {"2KB", 2000},
                {"2kB", 2000},
                {"1.5MB", 1500000},
                {"4GB", 4000000000},
                {"0.000016TB", 16000000}};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        size_t v = 1;
        assert_int_equal(kvp_cli_parse_bytes(good[i].text, &v), 0);
        assert_true(v == good[i].bytes);
    }
    const char *bad[] = {"",       "1.5",   "1.1KiB", "1.",    ".5KiB", "-1",
                         "1 KiB",  "1XB",   "1kiB",   "1.5.5", "1e3",   "20000000TiB",
                         "18446744073709551616", "16383.99999999999999999TiB"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t v = 9;
        assert_int_equal(kvp_cli_parse_bytes(bad[i], &v), -1);
        assert_int_equal(v, 9);
    }
    size_t v = 9;
    assert_int_equal(kvp_cli_parse_bytes(NULL, &v), -1);
}

static void test_cli_parse_double_finite_decimals_only(void **state)
{
    (void)state;
    double v = 0.0;
    assert_int_equal(kvp_cli_parse_double("1.25", &v), 0);
    assert_true(v == 1.25);
    assert_int_equal(kvp_cli_parse_double("-0.5", &v), 0);
    assert_true(v == -0.5);
    assert_int_equal(kvp_cli_parse_double("1e308", &v), 0);
    assert_true(v == 1e308);
    assert_int_equal(kvp_cli_parse_double(".5", &v), 0);
    const char *bad[] = {"", "nan", "inf", "-inf", "1e999", "0x10", " 1", "1 ", "abc", "1,5"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        v = 3.0;
        assert_int_equal(kvp_cli_parse_double(bad[i], &v), -1);
        assert_true(v == 3.0);
    }
    assert_int_equal(kvp_cli_parse_double(NULL, &v), -1);
}

static void test_cli_checked_arithmetic_saturates(void **state)
{
    (void)state;
    size_t v = 0;
    assert_int_equal(kvp_cli_mul(3, 4, &v), 0);
    assert_int_equal(v, 12);
    assert_int_equal(kvp_cli_mul(SIZE_MAX, 0, &v), 0);
    assert_int_equal(v, 0);
    assert_int_equal(kvp_cli_mul(SIZE_MAX / 2 + 1, 2, &v), -1);
    assert_true(v == SIZE_MAX);
    assert_int_equal(kvp_cli_add(SIZE_MAX - 1, 1, &v), 0);
    assert_true(v == SIZE_MAX);
    assert_int_equal(kvp_cli_add(SIZE_MAX, 1, &v), -1);
    assert_true(v == SIZE_MAX);
    assert_true(kvp_cli_physical_memory() > 0);
}

static void test_cli_format_bytes_units(void **state)
{
    (void)state;
    char buf[32];
    assert_string_equal(kvp_cli_format_bytes(512, buf, sizeof buf), "512 B");
    assert_string_equal(kvp_cli_format_bytes(1536, buf, sizeof buf), "1.5 KiB");
    assert_string_equal(kvp_cli_format_bytes((size_t)1 << 40, buf, sizeof buf), "1.0 TiB");
    assert_string_equal(kvp_cli_format_bytes(SIZE_MAX, buf, sizeof buf), "16.0 EiB");
}

static void test_cli_alloc_fault_fires_once_at_n(void **state)
{
    (void)state;
    kvp_cli_fault_arm(2);
    void *a = kvp_cli_alloc(4, 8);
    assert_non_null(a);
    assert_false(kvp_cli_fault_fired());
    void *b = kvp_cli_calloc(4, 8);
    assert_null(b);
    assert_true(kvp_cli_fault_fired());
    b = kvp_cli_calloc(4, 8);
    assert_non_null(b);
    assert_int_equal(((char *)b)[31], 0);
    assert_int_equal(kvp_cli_fault_calls(), 3);
    /* A failed realloc leaves the old block as it was. */
    ((char *)a)[0] = 'k';
    kvp_cli_fault_arm(1);
    assert_null(kvp_cli_realloc(a, 64, 8));
    assert_int_equal(((char *)a)[0], 'k');
    kvp_cli_fault_arm(0);
    void *c = kvp_cli_realloc(a, 64, 8);
    assert_non_null(c);
    assert_int_equal(((char *)c)[0], 'k');
    /* n * size overflow is a failure, never a short block. */
    assert_null(kvp_cli_alloc(SIZE_MAX / 2, 4));
    assert_null(kvp_cli_calloc(SIZE_MAX / 2, 4));
    assert_null(kvp_cli_realloc(NULL, SIZE_MAX / 2, 4));
    void *zero = kvp_cli_alloc(0, 8);
    assert_non_null(zero);
    kvp_cli_free(zero);
    kvp_cli_free(b);
    kvp_cli_free(c);
    kvp_cli_free(NULL);
    assert_false(kvp_cli_fault_fired());
}

static void test_cli_json_writer_nests_escapes_and_nulls(void **state)
{
    (void)state;
    char *text = NULL;
    size_t size = 0;
    FILE *out = open_memstream(&text, &size);
    assert_non_null(out);
    kvp_json json;
    kvp_json_init(&json, out);
    kvp_json_object_begin(&json, NULL);
    kvp_json_string(&json, "s", "a\"b\\c\n");
    kvp_json_double(&json, "inf", INFINITY);
    kvp_json_double(&json, "half", 0.5);
    kvp_json_bool(&json, "t", 1);
    kvp_json_bool(&json, "f", 0);
    kvp_json_array_begin(&json, "a");
    kvp_json_uint(&json, NULL, 1);
    kvp_json_uint(&json, NULL, 2);
    kvp_json_array_end(&json);
    kvp_json_object_end(&json);
    fclose(out);
    assert_string_equal(text, "{\"s\":\"a\\\"b\\\\c\\u000a\",\"inf\":null,\"half\":0.5,"
                              "\"t\":true,\"f\":false,\"a\":[1,2]}\n");
    free(text);

    /* Nested scopes keep their own member counts. */
    out = open_memstream(&text, &size);
    kvp_json_init(&json, out);
    kvp_json_array_begin(&json, NULL);
    kvp_json_object_begin(&json, NULL);
    kvp_json_uint(&json, "x", 1);
    kvp_json_object_end(&json);
    kvp_json_object_begin(&json, NULL);
    kvp_json_array_begin(&json, "y");
    kvp_json_array_end(&json);
    kvp_json_object_end(&json);
    kvp_json_array_end(&json);
    fclose(out);
    assert_string_equal(text, "[{\"x\":1},{\"y\":[]}]");
    free(text);
}

static void test_cli_plot_tick_steps_are_round(void **state)
{
    (void)state;
    static const struct {
        double max;
        double step;
    } cases[] = {{0.0, 1.0},   {1.0, 1.0},   {5.0, 1.0},   {6.0, 2.0},    {8.0, 2.0},
                 {10.0, 2.0},  {11.0, 5.0},  {25.0, 5.0},  {26.0, 10.0},  {99.0, 20.0},
                 {2048.0, 500.0}, {1e6, 200000.0}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_true(kvp_plot_tick_step(cases[i].max) == cases[i].step);
    }
}

static void test_cli_workload_names_round_trip(void **state)
{
    (void)state;
    kvp_profile profile = KVP_PROFILE_SHAREGPT;
    assert_int_equal(kvp_profile_parse("alpaca", &profile), 0);
    assert_string_equal(kvp_profile_name(profile), "alpaca");
    assert_int_equal(kvp_profile_parse("Alpaca", &profile), -1);
    assert_int_equal(profile, KVP_PROFILE_ALPACA);
    assert_int_equal(kvp_profile_parse("conversation", &profile), 0);
    assert_string_equal(kvp_profile_name(profile), "conversation");
    assert_int_equal(kvp_profile_parse("alpaca", &profile), 0);
    assert_int_equal(profile, KVP_PROFILE_ALPACA);
    kvp_arrival arrival = KVP_ARRIVAL_POISSON;
    assert_int_equal(kvp_arrival_parse("burst", &arrival), 0);
    assert_string_equal(kvp_arrival_name(arrival), "burst");
    assert_int_equal(kvp_arrival_parse("", &arrival), -1);
    assert_int_equal(arrival, KVP_ARRIVAL_BURST);
}

/* A generated workload: sorted, every length within capacity, and uniform gaps. */
static void test_cli_workload_generate_keeps_its_invariants(void **state)
{
    (void)state;
    kvp_workload_spec spec = {.profile = KVP_PROFILE_UNIFORM, .arrival = KVP_ARRIVAL_UNIFORM,
                              .rate = 0.5, .requests = 50, .capacity = 40, .seed = 9};
    kvp_workload_spec_defaults(&spec);
    assert_true(spec.prompt_mean == 161.0 && spec.sigma == 0.0);
    spec.prompt_mean = 10.0;
    spec.output_mean = 10.0;
    kvp_workload w = {NULL, 0};
    assert_int_equal(kvp_workload_generate(&spec, &w), 0);
    assert_int_equal(w.count, 50);
    for (size_t i = 0; i < w.count; i++) {
        const kvp_workload_request *r = &w.requests[i];
        assert_true(r->prompt_tokens >= 1 && r->output_tokens >= 1);
        assert_true(r->prompt_tokens + r->output_tokens <= spec.capacity);
        assert_int_equal(r->arrival_step, 2 * i);
    }
    kvp_workload_free(&w);
    assert_null(w.requests);
    kvp_cli_fault_arm(1);
    assert_int_equal(kvp_workload_generate(&spec, &w), -1);
    kvp_cli_fault_arm(0);
    assert_null(w.requests);
}

/*
 * long-context: prompts within [mean / 2, 2 x mean] (4k to 16k at the
 * default 8192), outputs at least 1, and the band really reached at sigma 1.
 */
static void test_cli_workload_long_context_keeps_its_band(void **state)
{
    (void)state;
    kvp_profile profile = KVP_PROFILE_SHAREGPT;
    assert_int_equal(kvp_profile_parse("long-context", &profile), 0);
    assert_string_equal(kvp_profile_name(profile), "long-context");
    kvp_workload_spec spec = {.profile = KVP_PROFILE_LONG_CONTEXT,
                              .arrival = KVP_ARRIVAL_BURST, .rate = 1.0, .requests = 400,
                              .capacity = 20000, .seed = 3};
    kvp_workload_spec_defaults(&spec);
    assert_true(spec.prompt_mean == 8192.0 && spec.output_mean == 256.0 && spec.sigma == 0.3);
    spec.sigma = 1.0; /* wide: the band's ends are met */
    kvp_workload w = {NULL, 0};
    assert_int_equal(kvp_workload_generate(&spec, &w), 0);
    size_t lo = SIZE_MAX;
    size_t hi = 0;
    for (size_t i = 0; i < w.count; i++) {
        const kvp_workload_request *r = &w.requests[i];
        assert_true(r->prompt_tokens >= 4096 && r->prompt_tokens <= 16384);
        assert_true(r->output_tokens >= 1 && r->prompt_tokens + r->output_tokens <= 20000);
        lo = r->prompt_tokens < lo ? r->prompt_tokens : lo;
        hi = r->prompt_tokens > hi ? r->prompt_tokens : hi;
    }
    assert_int_equal(lo, 4096);
    assert_int_equal(hi, 16384);
    kvp_workload_free(&w);
}

/*
 * --shared-prefix: every prompt starts with the same tokens, within
 * capacity; with 0 the list is the one the profile always gave.
 */
static void test_cli_workload_shared_prefix_prepends_the_same_tokens(void **state)
{
    (void)state;
    kvp_workload_spec spec = {.profile = KVP_PROFILE_SHAREGPT, .arrival = KVP_ARRIVAL_POISSON,
                              .rate = 1.0, .requests = 200, .capacity = 2048, .seed = 5};
    kvp_workload_spec_defaults(&spec);
    kvp_workload plain = {NULL, 0};
    assert_int_equal(kvp_workload_generate(&spec, &plain), 0);
    spec.shared_prefix = 100;
    kvp_workload shared = {NULL, 0};
    assert_int_equal(kvp_workload_generate(&spec, &shared), 0);
    int clamped = 0;
    for (size_t i = 0; i < shared.count; i++) {
        const kvp_workload_request *a = &plain.requests[i];
        const kvp_workload_request *b = &shared.requests[i];
        assert_int_equal(a->shared_tokens, 0);
        assert_int_equal(a->stream, i);
        assert_int_equal(b->shared_tokens, 100);
        assert_int_equal(b->stream, i);
        assert_int_equal(a->arrival_step, b->arrival_step); /* arrivals are their own stream */
        assert_true(b->prompt_tokens > 100);
        assert_true(b->prompt_tokens + b->output_tokens <= spec.capacity);
        if (a->prompt_tokens + 100 == b->prompt_tokens) {
            continue; /* the same draw, behind the prefix */
        }
        clamped++; /* a long draw clamped to the room the prefix leaves */
        assert_int_equal(b->prompt_tokens, spec.capacity - 1);
    }
    /* P(a draw above 1947 | lognormal, mean 161, sigma 1) is 0.14%: a clamp is rare. */
    assert_true(clamped < 5);
    kvp_workload_free(&plain);
    kvp_workload_free(&shared);
}

/*
 * --profile conversation: each conversation's turns in a row, the first
 * turns sorted by arrival; a later turn has no arrival step of its own (it
 * is sent think_steps after the turn before it finishes: closed loop) and
 * has the whole earlier conversation as its prompt's start, so its prompt is
 * at least the previous turn's prompt + output + 1; the turns average near
 * ShareGPT's 3.51 per conversation and the think times near 16 steps.
 */
static void test_cli_workload_conversation_grows_each_turn(void **state)
{
    (void)state;
    kvp_workload_spec spec = {.profile = KVP_PROFILE_CONVERSATION, .arrival = KVP_ARRIVAL_POISSON,
                              .rate = 0.05, .requests = 4000, .capacity = 1000000, .seed = 3,
                              .shared_prefix = 7};
    kvp_workload_spec_defaults(&spec);
    assert_true(spec.turns_mean == 3.51 && spec.prompt_mean == 94.0 &&
                spec.output_mean == 348.0 && spec.sigma == 1.0);
    kvp_workload w = {NULL, 0};
    assert_int_equal(kvp_workload_generate(&spec, &w), 0);
    assert_int_equal(w.count, 4000);
    size_t streams = 0;
    size_t last_arrival = 0;
    double think = 0.0;
    for (size_t i = 0; i < w.count; i++) {
        const kvp_workload_request *r = &w.requests[i];
        assert_int_equal(r->shared_tokens, 7);
        assert_true(r->output_tokens >= 1 && r->prompt_tokens + r->output_tokens <= spec.capacity);
        if (r->turn == 0) {
            assert_int_equal(r->stream, streams); /* numbered without gaps, in order */
            assert_true(r->arrival_step >= last_arrival);
            assert_int_equal(r->think_steps, 0);
            assert_true(r->prompt_tokens >= 8); /* the prefix and a message */
            last_arrival = r->arrival_step;
            streams++;
        } else {
            const kvp_workload_request *before = &w.requests[i - 1];
            assert_true(i > 0 && before->stream == r->stream && before->turn + 1 == r->turn);
            assert_int_equal(r->arrival_step, 0);
            assert_true(r->prompt_tokens >= before->prompt_tokens + before->output_tokens + 1);
            think += (double)r->think_steps;
        }
    }
    double mean = (double)w.count / (double)streams;
    assert_true(mean > 3.0 && mean < 4.0);
    /* floor of an exponential of mean 16: mean near 15.5 */
    think /= (double)(w.count - streams);
    assert_true(think > 14.0 && think < 17.0);
    kvp_workload_free(&w);
    /* The list failing is out of memory, with nothing left allocated. */
    spec.requests = 10;
    kvp_cli_fault_arm(1);
    assert_int_equal(kvp_workload_generate(&spec, &w), -1);
    kvp_cli_fault_arm(0);
    assert_null(w.requests);
}

/*
 * The bench's fragmented free list (measure.c, public API only): after a
 * shuffle, pages are handed out in the Fisher-Yates order of the same
 * stream, as they were when the shuffle released an internal reservation.
 */
static void test_cli_shuffle_pool_orders_the_free_list(void **state)
{
    (void)state;
    enum { PAGES = 9 };
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = 2;
    config.heads = 1;
    config.head_width = 2;
    config.budget_bytes = PAGES * 2 * 1 * 2 * 2 * sizeof(double);
    kvp_pool *pool = NULL;
    assert_int_equal(kvp_pool_create(&config, &pool, NULL), KVP_OK);
    uint64_t rng = 42;
    assert_int_equal(kvp_measure_shuffle_pool(pool, &rng), 0);
    uint32_t expected[PAGES];
    for (uint32_t i = 0; i < PAGES; i++) {
        expected[i] = i;
    }
    uint64_t again = 42;
    for (size_t i = PAGES - 1; i > 0; i--) {
        size_t j = (size_t)((kvp_measure_unit(&again) + 1.0) / 2.0 * (double)(i + 1)) % (i + 1);
        uint32_t t = expected[i];
        expected[i] = expected[j];
        expected[j] = t;
    }
    assert_int_equal(rng, again);
    kvp_binding binding;
    assert_int_equal(kvp_binding_init_external(&binding, 1, 2, 1, 0, 0, NULL), KVP_OK);
    kvp_cache *cache = NULL;
    assert_int_equal(kvp_cache_create(pool, &binding, PAGES, 1, &cache, NULL), KVP_OK);
    double row[PAGES * 2] = {0};
    assert_int_equal(kvp_cache_append_rows(cache, row, row, 1, NULL), KVP_OK);
    for (size_t lane = 0; lane < PAGES; lane++) {
        const uint32_t *table = NULL;
        size_t blocks = 0;
        assert_int_equal(kvp_cache_block_table(cache, lane, &table, &blocks, NULL), KVP_OK);
        assert_int_equal(blocks, 1);
        assert_int_equal(table[0], expected[lane]);
    }
    assert_int_equal(kvp_measure_shuffle_pool(pool, &rng), -1); /* pages held */
    assert_int_equal(kvp_cache_destroy(cache, NULL), KVP_OK);
    assert_int_equal(kvp_pool_check(pool, NULL, NULL, NULL), KVP_OK);
    assert_int_equal(kvp_pool_destroy(pool, NULL), KVP_OK);
}

/*
 * The bench's contiguous layout (measure.c, public API only): after
 * kvp_measure_lane_major_pool, a cache of LANES lanes appended block by
 * block gets each lane's pages adjacent and ascending (lane b, block j on
 * page b * BLOCKS + j), in one append and in row-by-row appends alike; a
 * pool too small for the layout, or with pages held, is refused.
 */
static void test_cli_lane_major_pool_makes_lanes_contiguous(void **state)
{
    (void)state;
    enum { LANES = 3, BLOCKS = 4, SPARE = 2, PAGES = LANES * BLOCKS + SPARE, BT = 2 };
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BT;
    config.heads = 1;
    config.head_width = 2;
    config.budget_bytes = PAGES * 2 * 1 * BT * 2 * sizeof(double);
    kvp_binding binding;
    assert_int_equal(kvp_binding_init_external(&binding, 1, 2, BLOCKS * BT, 0, 0, NULL), KVP_OK);
    double rows[LANES * BLOCKS * BT * 2] = {0};
    for (int one_append = 0; one_append <= 1; one_append++) {
        kvp_pool *pool = NULL;
        assert_int_equal(kvp_pool_create(&config, &pool, NULL), KVP_OK);
        assert_int_equal(kvp_measure_lane_major_pool(pool, LANES, PAGES), -1); /* too few */
        assert_int_equal(kvp_measure_lane_major_pool(pool, LANES, BLOCKS), 0);
        kvp_cache *cache = NULL;
        assert_int_equal(kvp_cache_create(pool, &binding, LANES, BLOCKS * BT, &cache, NULL),
                         KVP_OK);
        for (size_t p = 0; p < (one_append ? 1 : BLOCKS * BT); p++) {
            size_t n = one_append ? BLOCKS * BT : 1;
            assert_int_equal(kvp_cache_append_rows(cache, rows, rows, n, NULL), KVP_OK);
        }
        for (size_t lane = 0; lane < LANES; lane++) {
            const uint32_t *table = NULL;
            size_t blocks = 0;
            assert_int_equal(kvp_cache_block_table(cache, lane, &table, &blocks, NULL), KVP_OK);
            assert_int_equal(blocks, BLOCKS);
            for (size_t j = 0; j < BLOCKS; j++) {
                assert_int_equal(table[j], lane * BLOCKS + j);
            }
        }
        assert_int_equal(kvp_measure_lane_major_pool(pool, LANES, BLOCKS), -1); /* held */
        assert_int_equal(kvp_cache_destroy(cache, NULL), KVP_OK);
        assert_int_equal(kvp_pool_check(pool, NULL, NULL, NULL), KVP_OK);
        assert_int_equal(kvp_pool_destroy(pool, NULL), KVP_OK);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cli_parse_size_is_digits_only),
        cmocka_unit_test(test_cli_shuffle_pool_orders_the_free_list),
        cmocka_unit_test(test_cli_lane_major_pool_makes_lanes_contiguous),
        cmocka_unit_test(test_cli_parse_bytes_units_and_whole_counts),
        cmocka_unit_test(test_cli_parse_double_finite_decimals_only),
        cmocka_unit_test(test_cli_checked_arithmetic_saturates),
        cmocka_unit_test(test_cli_format_bytes_units),
        cmocka_unit_test(test_cli_alloc_fault_fires_once_at_n),
        cmocka_unit_test(test_cli_json_writer_nests_escapes_and_nulls),
        cmocka_unit_test(test_cli_plot_tick_steps_are_round),
        cmocka_unit_test(test_cli_workload_names_round_trip),
        cmocka_unit_test(test_cli_workload_generate_keeps_its_invariants),
        cmocka_unit_test(test_cli_workload_long_context_keeps_its_band),
        cmocka_unit_test(test_cli_workload_shared_prefix_prepends_the_same_tokens),
        cmocka_unit_test(test_cli_workload_conversation_grows_each_turn),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
