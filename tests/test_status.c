/*
 * test_status.c: the status table and the error renderer — every status has a
 * distinct name and message generated from KVP_STATUS_MAP, names are the
 * seed's variant names, kvp_error_format renders every status to its exact
 * text (the seed's Display text for the inherited variants, with shapes as
 * Rust's `{:?}` of a Vec<usize> and floats as Rust's `{:?}` of an f64),
 * snprintf return and truncation semantics, and kvp_mismatch_format.
 * Public API only: errors are built by hand, no pool is needed.
 */
#include "support.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "pager/error.h"

/* Expected name of every pager status, in enum order. */
static const struct {
    kvp_status status;
    const char *name;
} expected_names[] = {
    {KVP_OK, "Ok"},
    {KVP_NULL_ARGUMENT, "NullArgument"},
    {KVP_INVALID_ARGUMENT, "InvalidArgument"},
    {KVP_OUT_OF_RANGE, "OutOfRange"},
    {KVP_BUFFER_TOO_SMALL, "BufferTooSmall"},
    {KVP_ZERO_SIZE, "ZeroSize"},
    {KVP_SIZE_OVERFLOW, "SizeOverflow"},
    {KVP_BUDGET_TOO_SMALL, "BudgetTooSmall"},
    {KVP_ALLOCATION_FAILED, "AllocationFailed"},
    {KVP_POOL_EXHAUSTED, "PoolExhausted"},
    {KVP_POOL_BUSY, "PoolBusy"},
    {KVP_GEOMETRY_MISMATCH, "GeometryMismatch"},
    {KVP_AUDIT_FAILED, "AuditFailed"},
    {KVP_ZERO_BATCH_SIZE, "ZeroBatchSize"},
    {KVP_ZERO_CAPACITY, "ZeroCapacity"},
    {KVP_CAPACITY_EXCEEDS_POSITIONS, "CapacityExceedsPositions"},
    {KVP_ELEMENT_COUNT_OVERFLOW, "ElementCountOverflow"},
    {KVP_FULL, "Full"},
    {KVP_KEY_SHAPE_MISMATCH, "KeyShapeMismatch"},
    {KVP_VALUE_SHAPE_MISMATCH, "ValueShapeMismatch"},
    {KVP_NONFINITE_KEY, "NonFiniteKey"},
    {KVP_NONFINITE_VALUE, "NonFiniteValue"},
};

/* A detail struct with every field zero except the status. */
static kvp_error error_of(kvp_status status)
{
    kvp_error e;
    memset(&e, 0, sizeof e);
    e.status = status;
    return e;
}

/* The text of a NONFINITE_VALUE error carrying `value`, i.e. Rust's `{:?}`. */
static void render_value(double value, char *buf, size_t size)
{
    kvp_error e = error_of(KVP_NONFINITE_VALUE);
    e.index = 0;
    e.value = value;
    char text[256];
    size_t n = kvp_error_format(&e, text, sizeof text);
    assert_true(n < sizeof text);
    static const char prefix[] = "appended value at flat index 0 must be finite, got ";
    assert_int_equal(strncmp(text, prefix, sizeof prefix - 1), 0);
    size_t rest = n - (sizeof prefix - 1);
    assert_true(rest < size);
    memcpy(buf, text + sizeof prefix - 1, rest + 1);
}

static void test_status_names_are_seed_variant_names(void **state)
{
    (void)state;
    /* The pager's statuses come first; other modules append theirs after. */
    assert_true(KVPT_COUNT_OF(expected_names) <= KVP_STATUS_COUNT_);
    for (size_t i = 0; i < KVPT_COUNT_OF(expected_names); i++) {
        assert_int_equal(expected_names[i].status, i);
        assert_string_equal(kvp_status_name(expected_names[i].status), expected_names[i].name);
    }
    assert_string_equal(kvp_status_name(KVP_FULL), "Full");
    assert_string_equal(kvp_status_name(KVP_KEY_SHAPE_MISMATCH), "KeyShapeMismatch");
    assert_string_equal(kvp_status_name(KVP_POOL_EXHAUSTED), "PoolExhausted");
}

static void test_status_names_and_messages_are_nonempty_and_distinct(void **state)
{
    (void)state;
    for (int i = 0; i < KVP_STATUS_COUNT_; i++) {
        const char *name = kvp_status_name((kvp_status)i);
        const char *message = kvp_status_message((kvp_status)i);
        assert_non_null(name);
        assert_non_null(message);
        assert_true(strlen(name) > 0);
        assert_true(strlen(message) > 0);
        assert_string_not_equal(name, "Unknown");
        assert_string_not_equal(message, "unknown status");
        for (int j = 0; j < i; j++) {
            assert_string_not_equal(name, kvp_status_name((kvp_status)j));
            assert_string_not_equal(message, kvp_status_message((kvp_status)j));
        }
    }
    assert_string_equal(kvp_status_message(KVP_OK), "success");
    assert_string_equal(kvp_status_message(KVP_FULL), "KV cache is full");
    assert_string_equal(kvp_status_message(KVP_POOL_EXHAUSTED),
                        "the page pool has too few free pages");
}

static void test_status_out_of_range_is_unknown(void **state)
{
    (void)state;
    assert_string_equal(kvp_status_name(KVP_STATUS_COUNT_), "Unknown");
    assert_string_equal(kvp_status_name((kvp_status)1000), "Unknown");
    assert_string_equal(kvp_status_message(KVP_STATUS_COUNT_), "unknown status");
    assert_string_equal(kvp_status_message((kvp_status)1000), "unknown status");

    kvp_error e = error_of(KVP_STATUS_COUNT_);
    char expected[64];
    snprintf(expected, sizeof expected, "unknown kvpager status %d", (int)KVP_STATUS_COUNT_);
    kvpt_assert_error_text(&e, expected);
    e.status = (kvp_status)1000;
    kvpt_assert_error_text(&e, "unknown kvpager status 1000");
    kvpt_assert_error_text(NULL, "no error detail");
}

static void test_status_format_caller_and_pool_errors(void **state)
{
    (void)state;
    kvp_error e = error_of(KVP_OK);
    kvpt_assert_error_text(&e, "ok");

    e = error_of(KVP_NULL_ARGUMENT);
    e.argument = "pool";
    kvpt_assert_error_text(&e, "argument `pool` must not be NULL");
    e.argument = NULL;
    kvpt_assert_error_text(&e, "argument `?` must not be NULL");

    e = error_of(KVP_INVALID_ARGUMENT);
    e.argument = "binding";
    e.what = "heads and head_width must be nonzero";
    kvpt_assert_error_text(&e,
                           "argument `binding` is invalid: heads and head_width must be nonzero");

    e = error_of(KVP_OUT_OF_RANGE);
    e.argument = "lane";
    e.index = 3;
    e.limit = 2;
    kvpt_assert_error_text(&e, "argument `lane` is 3, which is out of range (must be below 2)");

    e = error_of(KVP_BUFFER_TOO_SMALL);
    e.argument = "out";
    e.needed = 16;
    e.available = 15;
    kvpt_assert_error_text(&e, "buffer `out` holds 15 values but 16 are needed");

    e = error_of(KVP_ZERO_SIZE);
    e.argument = "heads";
    kvpt_assert_error_text(&e, "page pool heads must be nonzero");

    e = error_of(KVP_SIZE_OVERFLOW);
    e.block_tokens = 4;
    e.heads = 2;
    e.head_width = 8;
    e.budget_bytes = 1048576;
    kvpt_assert_error_text(&e, "page pool size overflows for block_tokens 4, 2 heads, head width 8 "
                               "and budget 1048576 bytes");

    e = error_of(KVP_BUDGET_TOO_SMALL);
    e.budget_bytes = 1023;
    e.page_bytes = 1024;
    kvpt_assert_error_text(&e, "page pool budget of 1023 bytes is below one page of 1024 bytes");

    e = error_of(KVP_ALLOCATION_FAILED);
    e.what = "page slab";
    e.bytes = 4096;
    kvpt_assert_error_text(&e, "cannot allocate page slab (4096 bytes)");

    e = error_of(KVP_POOL_EXHAUSTED);
    e.needed = 3;
    e.available = 2;
    kvpt_assert_error_text(&e, "page pool exhausted: 3 pages needed, 2 free");

    e = error_of(KVP_POOL_BUSY);
    e.attached_caches = 2;
    e.attached_reservations = 1;
    e.held_pages = 5;
    kvpt_assert_error_text(&e, "page pool is busy: 2 caches attached, 1 reservations held, "
                               "5 pages held");

    e = error_of(KVP_GEOMETRY_MISMATCH);
    e.pool_geometry = (kvp_geometry){2, 2};
    e.binding_geometry = (kvp_geometry){4, 1};
    kvpt_assert_error_text(&e, "cache geometry (4 heads, head width 1) does not match page pool "
                               "geometry (2 heads, head width 2)");

    e = error_of(KVP_AUDIT_FAILED);
    e.mismatches = 1;
    e.first_mismatch = (kvp_mismatch){KVP_INVARIANT_REFERENCES,
                                      "references from page tables and reservations", 7,
                                      SIZE_MAX, 1, 2};
    kvpt_assert_error_text(&e, "page pool audit found 1 mismatch; first: I3 references: references "
                               "from page tables and reservations (page 7): expected 1, found 2");
    e.mismatches = 3;
    e.first_mismatch = (kvp_mismatch){KVP_INVARIANT_LANE_COVERAGE,
                                      "pages mapped by a lane, ceil(len / block_tokens)",
                                      SIZE_MAX, 1, 2, 0};
    kvpt_assert_error_text(&e, "page pool audit found 3 mismatches; first: I4 lane coverage: pages "
                               "mapped by a lane, ceil(len / block_tokens) (lane 1): expected 2, "
                               "found 0");
}

static void test_status_format_seed_cache_errors(void **state)
{
    (void)state;
    kvp_error e = error_of(KVP_ZERO_BATCH_SIZE);
    kvpt_assert_error_text(&e, "KV cache batch size must be nonzero");

    e = error_of(KVP_ZERO_CAPACITY);
    kvpt_assert_error_text(&e, "KV cache capacity must be nonzero");

    e = error_of(KVP_CAPACITY_EXCEEDS_POSITIONS);
    e.capacity = 9;
    e.max_positions = 8;
    kvpt_assert_error_text(&e, "KV cache capacity 9 exceeds RoPE position capacity 8");

    e = error_of(KVP_ELEMENT_COUNT_OVERFLOW);
    e.batch_size = 3;
    e.heads = 4;
    e.capacity = 5;
    e.head_width = 6;
    kvpt_assert_error_text(&e, "KV cache element count overflows for batch 3, 4 heads, capacity 5, "
                               "and head width 6");
    e.batch_size = SIZE_MAX;
    char expected[160];
    snprintf(expected, sizeof expected,
             "KV cache element count overflows for batch %zu, 4 heads, capacity 5, and head "
             "width 6",
             (size_t)SIZE_MAX);
    kvpt_assert_error_text(&e, expected);

    e = error_of(KVP_FULL);
    e.capacity = 4;
    kvpt_assert_error_text(&e, "KV cache is full at capacity 4");

    e = error_of(KVP_KEY_SHAPE_MISMATCH);
    e.expected = (kvp_shape){4, {1, 2, 1, 2}};
    e.actual = (kvp_shape){4, {1, 2, 2, 2}};
    kvpt_assert_error_text(&e, "appended key must have shape [1, 2, 1, 2], got [1, 2, 2, 2]");

    e.status = KVP_VALUE_SHAPE_MISMATCH;
    e.actual = (kvp_shape){3, {1, 2, 2}};
    kvpt_assert_error_text(&e, "appended value must have shape [1, 2, 1, 2], got [1, 2, 2]");

    e = error_of(KVP_NONFINITE_KEY);
    e.index = 3;
    e.value = NAN;
    kvpt_assert_error_text(&e, "appended key value at flat index 3 must be finite, got NaN");

    e = error_of(KVP_NONFINITE_VALUE);
    e.index = 0;
    e.value = INFINITY;
    kvpt_assert_error_text(&e, "appended value at flat index 0 must be finite, got inf");
    e.index = 17;
    e.value = -INFINITY;
    kvpt_assert_error_text(&e, "appended value at flat index 17 must be finite, got -inf");
}

/*
 * The grouped-query statuses, appended after every earlier one (no value
 * moved), and the texts that name KV heads; multi-head details keep the
 * texts they had before kv_heads existed.
 */
static void test_status_format_grouped_head_errors(void **state)
{
    (void)state;
    assert_true(KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS > KVP_THREAD_FAILED);
    assert_int_equal(KVP_CACHE_KV_HEAD_COUNT_MISMATCH, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS + 1);
    assert_string_equal(kvp_status_name(KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS),
                        "KvHeadsDoNotDivideHeads");
    assert_string_equal(kvp_status_name(KVP_CACHE_KV_HEAD_COUNT_MISMATCH),
                        "CacheKvHeadCountMismatch");
    assert_string_equal(kvp_status_message(KVP_CACHE_KV_HEAD_COUNT_MISMATCH),
                        "KV cache KV head count differs from the layer's");

    kvp_error e = error_of(KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS);
    e.heads = 8;
    e.kv_heads = 3;
    kvpt_assert_error_text(&e, "attention head count 8 must be a nonzero multiple of 3 KV heads");

    e = error_of(KVP_CACHE_KV_HEAD_COUNT_MISMATCH);
    e.cache_size = 8;
    e.layer_size = 2;
    kvpt_assert_error_text(&e, "KV cache KV head count 8 must match attention layer KV head "
                               "count 2");

    e = error_of(KVP_PARAMETER_WIDTH_MISMATCH);
    e.parameter = 1;
    e.expected = (kvp_shape){2, {32, 8}};
    e.actual = (kvp_shape){2, {32, 32}};
    kvpt_assert_error_text(&e, "attention parameter 1 is 32x32, expected 32x8");
    e.expected.rank = 0; /* no shapes: both square, from the sizes */
    e.expected_size = 4;
    e.actual_size = 3;
    kvpt_assert_error_text(&e, "attention parameter 1 is 3x3, expected 4x4");

    e = error_of(KVP_TICKET_GEOMETRY_MISMATCH);
    e.batch_size = 1;
    e.heads = 8;
    e.head_width = 4;
    e.capacity = 16;
    kvpt_assert_error_text(&e, "attention ticket for batch 1, 8 heads, head width 4 and capacity "
                               "16 does not fit this KV cache");
    e.kv_heads = 8;
    kvpt_assert_error_text(&e, "attention ticket for batch 1, 8 heads, head width 4 and capacity "
                               "16 does not fit this KV cache");
    e.kv_heads = 2;
    kvpt_assert_error_text(&e, "attention ticket for batch 1, 8 heads (2 KV heads), head width 4 "
                               "and capacity 16 does not fit this KV cache");

    e = error_of(KVP_MODEL_GEOMETRY_MISMATCH);
    e.layer = 1;
    e.pool_geometry = (kvp_geometry){8, 4};
    e.binding_geometry = (kvp_geometry){8, 4};
    e.kv_heads = 8;
    e.expected_kv_heads = 8;
    kvpt_assert_error_text(&e, "model layer 1 geometry (8 heads, head width 4) differs from "
                               "layer 0 geometry (8 heads, head width 4)");
    e.kv_heads = 2;
    kvpt_assert_error_text(&e, "model layer 1 geometry (8 heads, 2 KV heads, head width 4) "
                               "differs from layer 0 geometry (8 heads, 8 KV heads, head width "
                               "4)");
}

static void test_status_shapes_render_as_rust_vec_debug(void **state)
{
    (void)state;
    kvp_error e = error_of(KVP_KEY_SHAPE_MISMATCH);
    e.expected = (kvp_shape){4, {1, 2, 1, 2}};
    e.actual = (kvp_shape){0, {0}};
    kvpt_assert_error_text(&e, "appended key must have shape [1, 2, 1, 2], got []");
    e.actual = (kvp_shape){1, {7}};
    kvpt_assert_error_text(&e, "appended key must have shape [1, 2, 1, 2], got [7]");
    e.actual = (kvp_shape){KVP_MAX_RANK, {1, 2, 3, 4, 5, 6, 7, 8}};
    kvpt_assert_error_text(&e, "appended key must have shape [1, 2, 1, 2], got "
                               "[1, 2, 3, 4, 5, 6, 7, 8]");
    /* A rank beyond what kvp_shape can hold is elided, never read past dims. */
    e.actual = (kvp_shape){KVP_MAX_RANK + 3, {1, 2, 3, 4, 5, 6, 7, 8}};
    kvpt_assert_error_text(&e, "appended key must have shape [1, 2, 1, 2], got "
                               "[1, 2, 3, 4, 5, 6, 7, 8, ...]");
    e.actual = (kvp_shape){2, {SIZE_MAX, 0}};
    char expected[128];
    snprintf(expected, sizeof expected, "appended key must have shape [1, 2, 1, 2], got [%zu, 0]",
             (size_t)SIZE_MAX);
    kvpt_assert_error_text(&e, expected);
}

static void test_status_floats_render_as_rust_f64_debug(void **state)
{
    (void)state;
    static const struct {
        double value;
        const char *text;
    } cases[] = {
        {NAN, "NaN"},
        {INFINITY, "inf"},
        {-INFINITY, "-inf"},
        {1.0, "1.0"},
        {0.1, "0.1"},
        {-0.0, "-0.0"},
        {0.0, "0.0"},
        {1e16, "1e16"},
        {1e15, "1000000000000000.0"},
        {1.5e-5, "1.5e-5"},
        {0.0001, "0.0001"},
        {123.456, "123.456"},
        {DBL_MAX, "1.7976931348623157e308"},
        {5e-324, "5e-324"},
        {2.5, "2.5"},
        {1e-7, "1e-7"},
        {-2.5, "-2.5"},
        {-1e16, "-1e16"},
        {100.0, "100.0"},
        {1.0 / 3.0, "0.3333333333333333"},
        {9999999999999998.0, "9999999999999998.0"},
        {1.2345e20, "1.2345e20"},
        {-1.5e-5, "-1.5e-5"},
        {0.00012, "0.00012"},
    };
    for (size_t i = 0; i < KVPT_COUNT_OF(cases); i++) {
        char text[64];
        render_value(cases[i].value, text, sizeof text);
        if (strcmp(text, cases[i].text) != 0) {
            print_error("case %zu: rendered \"%s\", expected \"%s\"\n", i, text, cases[i].text);
            fail();
        }
    }
    /* -NaN renders as NaN too, as Rust does. */
    char text[64];
    render_value(-NAN, text, sizeof text);
    assert_string_equal(text, "NaN");
}

/* Every buffer size from 0 to past the end: snprintf's contract, exactly. */
static void test_status_format_truncates_like_snprintf(void **state)
{
    (void)state;
    kvp_error e = error_of(KVP_KEY_SHAPE_MISMATCH);
    e.expected = (kvp_shape){4, {1, 2, 1, 2}};
    e.actual = (kvp_shape){4, {1, 2, 2, 2}};
    static const char full[] = "appended key must have shape [1, 2, 1, 2], got [1, 2, 2, 2]";
    size_t len = sizeof full - 1;
    assert_int_equal(kvp_error_format(&e, NULL, 0), len);

    for (size_t size = 0; size <= len + 4; size++) {
        char buf[sizeof full + 8];
        memset(buf, '#', sizeof buf);
        assert_int_equal(kvp_error_format(&e, buf, size), len);
        if (size == 0) {
            assert_int_equal(buf[0], '#'); /* nothing written at all */
            continue;
        }
        size_t kept = size - 1 < len ? size - 1 : len;
        assert_memory_equal(buf, full, kept);
        assert_int_equal(buf[kept], '\0');
        for (size_t i = kept + 1; i < sizeof buf; i++) {
            assert_int_equal(buf[i], '#'); /* never past size */
        }
    }

    /* The float path is built from several pieces; truncating inside it works too. */
    kvp_error nonfinite = error_of(KVP_NONFINITE_KEY);
    nonfinite.index = 3;
    nonfinite.value = 123.456;
    static const char float_text[] = "appended key value at flat index 3 must be finite, got "
                                     "123.456";
    size_t float_len = sizeof float_text - 1;
    for (size_t size = 1; size <= float_len + 1; size++) {
        char buf[sizeof float_text + 8];
        memset(buf, '#', sizeof buf);
        assert_int_equal(kvp_error_format(&nonfinite, buf, size), float_len);
        assert_memory_equal(buf, float_text, size - 1);
        assert_int_equal(buf[size - 1], '\0');
        assert_int_equal(buf[size], '#');
    }

    /* A NULL error measures and truncates the same way. */
    assert_int_equal(kvp_error_format(NULL, NULL, 0), strlen("no error detail"));
    char small[4];
    assert_int_equal(kvp_error_format(NULL, small, sizeof small), strlen("no error detail"));
    assert_string_equal(small, "no ");
}

static void test_status_mismatch_format_exact_text(void **state)
{
    (void)state;
    char buf[256];
    kvp_mismatch m = {KVP_INVARIANT_STATS, "acquires - releases", SIZE_MAX, SIZE_MAX, 3, 4};
    assert_int_equal(kvp_mismatch_format(&m, buf, sizeof buf),
                     strlen("stats: acquires - releases: expected 3, found 4"));
    assert_string_equal(buf, "stats: acquires - releases: expected 3, found 4");

    m = (kvp_mismatch){KVP_INVARIANT_CONSERVATION, "free + held pages", SIZE_MAX, SIZE_MAX, 8, 9};
    kvp_mismatch_format(&m, buf, sizeof buf);
    assert_string_equal(buf, "I1 conservation: free + held pages: expected 8, found 9");

    m = (kvp_mismatch){KVP_INVARIANT_NO_DUPLICATES, "times the page is on the free list", 5,
                       SIZE_MAX, 1, 2};
    kvp_mismatch_format(&m, buf, sizeof buf);
    assert_string_equal(buf, "I2 no duplicates: times the page is on the free list (page 5): "
                             "expected 1, found 2");

    m = (kvp_mismatch){KVP_INVARIANT_REFERENCES, "references from page tables and reservations",
                       0, SIZE_MAX, 1, 2};
    kvp_mismatch_format(&m, buf, sizeof buf);
    assert_string_equal(buf, "I3 references: references from page tables and reservations "
                             "(page 0): expected 1, found 2");

    m = (kvp_mismatch){KVP_INVARIANT_LANE_COVERAGE, "pages mapped contiguously from block 0",
                       SIZE_MAX, 2, 3, 1};
    kvp_mismatch_format(&m, buf, sizeof buf);
    assert_string_equal(buf, "I4 lane coverage: pages mapped contiguously from block 0 (lane 2): "
                             "expected 3, found 1");

    /* Both locations, an unknown invariant and a missing `what`. */
    m = (kvp_mismatch){(kvp_invariant)99, NULL, 1, 2, 0, 0};
    size_t n = kvp_mismatch_format(&m, buf, sizeof buf);
    assert_string_equal(buf, "unknown invariant: ? (page 1) (lane 2): expected 0, found 0");
    assert_int_equal(n, strlen(buf));

    assert_int_equal(kvp_mismatch_format(NULL, buf, sizeof buf), strlen("no mismatch"));
    assert_string_equal(buf, "no mismatch");

    /* snprintf semantics here too. */
    m = (kvp_mismatch){KVP_INVARIANT_STATS, "acquires - releases", SIZE_MAX, SIZE_MAX, 3, 4};
    size_t full = kvp_mismatch_format(&m, NULL, 0);
    assert_int_equal(full, strlen("stats: acquires - releases: expected 3, found 4"));
    char small[8];
    memset(small, '#', sizeof small);
    assert_int_equal(kvp_mismatch_format(&m, small, 7), full);
    assert_string_equal(small, "stats:");
    assert_int_equal(small[7], '#');
}

/* The version, and texts that depend on `what`: only "prompt" selects the prefill texts. */
static void test_status_version_and_prompt_texts(void **state)
{
    (void)state;
    assert_string_equal(kvp_version(), KVP_VERSION_STRING);
    assert_string_equal(kvp_version(), "0.2.0");
    assert_int_equal(KVP_VERSION_MAJOR, 0);
    assert_int_equal(KVP_VERSION_MINOR, 2);
    assert_int_equal(KVP_VERSION_PATCH, 0);
    assert_int_equal(KVP_VERSION_NUMBER, 2000);
    assert_int_equal(kvp_version_number(), KVP_VERSION_NUMBER);
    kvp_error e;
    memset(&e, 0, sizeof e);
    e.status = KVP_FULL;
    e.capacity = 8;
    e.tokens = 9;
    e.available = 3;
    kvpt_assert_error_text(&e, "KV cache is full at capacity 8");
    e.what = "other";
    kvpt_assert_error_text(&e, "KV cache is full at capacity 8");
    e.what = "prompt";
    kvpt_assert_error_text(&e, "prompt of 9 tokens does not fit: 3 of capacity 8 left");
    memset(&e, 0, sizeof e);
    e.status = KVP_INPUT_RANK;
    e.rank = 2;
    kvpt_assert_error_text(&e, "incremental attention input must have rank three [batch, 1, "
                               "model_width], got rank 2");
    e.what = "prompt";
    kvpt_assert_error_text(&e, "prefill prompt must have rank three [batch, tokens, "
                               "model_width], got rank 2");
    memset(&e, 0, sizeof e);
    e.status = KVP_ROPE_INVALID_BASE;
    e.layer_rope = (kvp_rope_config){64, 8, 5e-324};
    kvpt_assert_error_text(&e, "RoPE base 5e-324 gives a non-finite rotation angle within 8 "
                               "positions of 64 features");
    e.layer_rope.base = -INFINITY;
    kvpt_assert_error_text(&e, "RoPE base must be finite and greater than zero, got -inf");

    /* kvp_mismatch_format measures like snprintf. */
    kvp_mismatch m = {KVP_INVARIANT_STATS, "attached caches", SIZE_MAX, SIZE_MAX, 1, 2};
    char buf[128];
    size_t n = kvp_mismatch_format(&m, buf, sizeof buf);
    assert_string_equal(buf, "stats: attached caches: expected 1, found 2");
    assert_int_equal(kvp_mismatch_format(&m, NULL, 0), n);
    buf[0] = 'x';
    assert_int_equal(kvp_mismatch_format(&m, buf, 0), n);
    assert_int_equal(buf[0], 'x'); /* size 0 writes nothing */
    assert_int_equal(kvp_mismatch_format(NULL, buf, sizeof buf), strlen("no mismatch"));
}

/*
 * Status values are ABI: pinned numbers (today's, computed when they were made
 * explicit), and the list is dense and in order, so an appended status can
 * only take the next number.
 */
static void test_status_values_are_pinned_and_append_only(void **state)
{
    (void)state;
    assert_int_equal(KVP_OK, 0);
    assert_int_equal(KVP_NULL_ARGUMENT, 1);
    assert_int_equal(KVP_POOL_EXHAUSTED, 9);
    assert_int_equal(KVP_POOL_BUSY, 10);
    assert_int_equal(KVP_FULL, 17);
    assert_int_equal(KVP_TICKET_STALE, 38);
    assert_int_equal(KVP_THREAD_FAILED, 48);
    assert_int_equal(KVP_DECODER_BUSY, 49);
    assert_int_equal(KVP_MODEL_BUSY, 50);
    assert_int_equal(KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS, 51);
    assert_int_equal(KVP_CACHE_KV_HEAD_COUNT_MISMATCH, 52);
    assert_int_equal(KVP_CACHE_LAYER_BOUND, 53);
    assert_int_equal(KVP_ROWS_RESERVED, 54);
    assert_int_equal(KVP_ROWS_NOT_RESERVED, 55);
    assert_int_equal(KVP_PAGE_NOT_HELD, 56);
    assert_int_equal(KVP_NOT_AT_BLOCK_BOUNDARY, 57);
    assert_int_equal(KVP_PAGE_PUBLISHED, 58);
    assert_int_equal(KVP_BLOCK_BINDING_MISMATCH, 59);
    assert_int_equal(KVP_REQUEST_UNKNOWN, 60);
    assert_int_equal(KVP_CACHE_WINDOW_MISMATCH, 61);
    assert_int_equal(KVP_TIER_BLOCK_REJECTED, 62);
    assert_int_equal(KVP_TIER_UNAVAILABLE, 63);
    assert_int_equal(KVP_BLOCK_RELEASED, 64);
    assert_int_equal(KVP_STATUS_COUNT_, 65);

    static const int values[] = {
#define KVPT_VALUE_(suffix, value, name, message) value,
        KVP_STATUS_MAP(KVPT_VALUE_)
#undef KVPT_VALUE_
    };
    assert_int_equal(KVPT_COUNT_OF(values), KVP_STATUS_COUNT_);
    for (size_t i = 0; i < KVPT_COUNT_OF(values); i++) {
        assert_int_equal(values[i], i);
    }
    assert_string_equal(kvp_status_name(KVP_DECODER_BUSY), "DecoderBusy");
    assert_string_equal(kvp_status_name(KVP_MODEL_BUSY), "ModelBusy");
    kvp_error e = error_of(KVP_DECODER_BUSY);
    kvpt_assert_error_text(
        &e, "decoder is busy: another kvp_decoder_step is running on it (one caller at a "
            "time)");
    e = error_of(KVP_MODEL_BUSY);
    kvpt_assert_error_text(&e, "model still has live sequences; destroy them before the model");
}

/* The statuses of external caches and page data, with their details. */
static void test_status_format_external_cache_errors(void **state)
{
    (void)state;
    assert_string_equal(kvp_status_name(KVP_CACHE_LAYER_BOUND), "CacheLayerBound");
    assert_string_equal(kvp_status_name(KVP_ROWS_RESERVED), "RowsReserved");
    assert_string_equal(kvp_status_name(KVP_ROWS_NOT_RESERVED), "RowsNotReserved");
    assert_string_equal(kvp_status_name(KVP_PAGE_NOT_HELD), "PageNotHeld");
    assert_string_equal(kvp_status_message(KVP_PAGE_NOT_HELD),
                        "the page is not held (free or evictable): only held pages have "
                        "data");
    kvp_error e = error_of(KVP_CACHE_LAYER_BOUND);
    kvpt_assert_error_text(&e, "KV cache is bound to an attention layer: its rows enter only "
                               "through attention's prepare and commit (raw rows go to "
                               "external caches)");
    e = error_of(KVP_ROWS_RESERVED);
    e.tokens = 3;
    kvpt_assert_error_text(&e, "KV cache already holds a reservation of 3 rows; commit or "
                               "discard it first");
    e = error_of(KVP_ROWS_NOT_RESERVED);
    e.tokens = 4;
    e.available = 1;
    kvpt_assert_error_text(&e, "cannot commit 4 rows: the KV cache has 1 rows reserved");
    e = error_of(KVP_PAGE_NOT_HELD);
    e.index = 7;
    kvpt_assert_error_text(&e, "page 7 is free: only held pages have data");
    e.what = "free";
    kvpt_assert_error_text(&e, "page 7 is free: only held pages have data");
    e.what = "evictable";
    kvpt_assert_error_text(&e, "page 7 is evictable (cached, but no page table holds it): only "
                               "held pages have data");
    e = error_of(KVP_FULL);
    e.what = "rows";
    e.tokens = 5;
    e.available = 2;
    e.capacity = 8;
    kvpt_assert_error_text(&e, "5 rows do not fit: 2 of capacity 8 left");
    assert_string_equal(kvp_status_name(KVP_NOT_AT_BLOCK_BOUNDARY), "NotAtBlockBoundary");
    assert_string_equal(kvp_status_name(KVP_PAGE_PUBLISHED), "PagePublished");
    e = error_of(KVP_NOT_AT_BLOCK_BOUNDARY);
    e.current_len = 5;
    e.block_tokens = 4;
    kvpt_assert_error_text(&e, "KV cache length 5 is not a multiple of block_tokens 4");
    e = error_of(KVP_PAGE_PUBLISHED);
    e.index = 3;
    kvpt_assert_error_text(&e, "page 3 is already published under another key");
    assert_string_equal(kvp_status_name(KVP_BLOCK_BINDING_MISMATCH), "BlockBindingMismatch");
    assert_string_equal(kvp_status_message(KVP_BLOCK_BINDING_MISMATCH),
                        "a published block was computed under another binding than the adopting "
                        "cache's");
    e = error_of(KVP_BLOCK_BINDING_MISMATCH);
    e.index = 6;
    e.layer = 2;
    e.position = 8;
    kvpt_assert_error_text(&e, "page 6 was published under another binding than the adopting "
                               "cache's (cache 2 of the group, position 8): its rows were not "
                               "computed by this cache's layer");
    assert_string_equal(kvp_status_name(KVP_REQUEST_UNKNOWN), "RequestUnknown");
    e = error_of(KVP_REQUEST_UNKNOWN);
    e.index = 4;
    e.limit = 9;
    kvpt_assert_error_text(&e, "request 4 is not held by the scheduler: collected already (ids "
                               "below 9 were given)");
    e.index = 9;
    kvpt_assert_error_text(&e, "request 9 is not held by the scheduler: never submitted (ids "
                               "below 9 were given)");
    assert_string_equal(kvp_status_name(KVP_CACHE_WINDOW_MISMATCH), "CacheWindowMismatch");
    e = error_of(KVP_CACHE_WINDOW_MISMATCH);
    e.what = "window";
    e.cache_size = 0;
    e.layer_size = 1024;
    kvpt_assert_error_text(&e, "KV cache attention window 0 must match attention layer "
                               "attention window 1024");
    e.what = "sink_tokens";
    e.cache_size = 4;
    e.layer_size = 0;
    kvpt_assert_error_text(&e, "KV cache sink tokens 4 must match attention layer sink tokens 0");
    assert_string_equal(kvp_status_name(KVP_TIER_BLOCK_REJECTED), "TierBlockRejected");
    e = error_of(KVP_TIER_BLOCK_REJECTED);
    e.bytes = 240;
    e.what = "mac";
    kvpt_assert_error_text(&e, "tier block of 240 bytes rejected: its mac does not match");
    assert_string_equal(kvp_status_name(KVP_TIER_UNAVAILABLE), "TierUnavailable");
    e = error_of(KVP_TIER_UNAVAILABLE);
    e.what = "redis";
    kvpt_assert_error_text(&e, "the redis tier could not serve the request");
    assert_string_equal(kvp_status_name(KVP_BLOCK_RELEASED), "BlockReleased");
    e = error_of(KVP_BLOCK_RELEASED);
    e.index = 2;
    e.position = 8;
    e.what = "new_len";
    kvpt_assert_error_text(&e, "block 2 (position 8) was released: it fell outside the attention "
                               "window, so new_len cannot use it");
}

/* The shape helpers every validation uses. */
static void test_status_shape_helpers(void **state)
{
    (void)state;
    kvp_shape a = kvpi_shape4(2, 3, 0, 4);
    kvp_shape b = a;
    assert_true(kvpi_shape_equal(&a, &b));
    b.dims[3] = 5;
    assert_false(kvpi_shape_equal(&a, &b));
    b = a;
    b.rank = 3;
    assert_false(kvpi_shape_equal(&a, &b));
    a.rank = b.rank = KVP_MAX_RANK + 1; /* an error-only rank never compares equal */
    assert_false(kvpi_shape_equal(&a, &b));
    int overflow = 1;
    kvp_shape zero = kvpi_shape4(SIZE_MAX, 0, SIZE_MAX, 2);
    assert_int_equal(kvpi_shape_elements(&zero, &overflow), 0);
    assert_false(overflow);
    kvp_shape big = kvpi_shape4(SIZE_MAX / 2, 3, 1, 1);
    assert_int_equal(kvpi_shape_elements(&big, &overflow), 0);
    assert_true(overflow);
    kvp_shape fits = kvpi_shape4(SIZE_MAX / 4, 2, 2, 1);
    assert_int_equal(kvpi_shape_elements(&fits, &overflow), (SIZE_MAX / 4) * 4);
    assert_false(overflow);
    kvp_shape wide = kvpi_shape4(2, 2, 2, 2);
    wide.rank = KVP_MAX_RANK + 3; /* counts the KVP_MAX_RANK dims it has */
    for (size_t i = 4; i < KVP_MAX_RANK; i++) {
        wide.dims[i] = 1;
    }
    assert_int_equal(kvpi_shape_elements(&wide, &overflow), 16);
    double values[3] = {1.0, NAN, INFINITY};
    assert_int_equal(kvpi_first_nonfinite(values, 1), 1);
    assert_int_equal(kvpi_first_nonfinite(values, 3), 1);
    assert_int_equal(kvpi_first_nonfinite(values + 2, 1), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_version_and_prompt_texts),
        cmocka_unit_test(test_status_shape_helpers),
        cmocka_unit_test(test_status_names_are_seed_variant_names),
        cmocka_unit_test(test_status_values_are_pinned_and_append_only),
        cmocka_unit_test(test_status_format_external_cache_errors),
        cmocka_unit_test(test_status_names_and_messages_are_nonempty_and_distinct),
        cmocka_unit_test(test_status_out_of_range_is_unknown),
        cmocka_unit_test(test_status_format_caller_and_pool_errors),
        cmocka_unit_test(test_status_format_seed_cache_errors),
        cmocka_unit_test(test_status_format_grouped_head_errors),
        cmocka_unit_test(test_status_shapes_render_as_rust_vec_debug),
        cmocka_unit_test(test_status_floats_render_as_rust_f64_debug),
        cmocka_unit_test(test_status_format_truncates_like_snprintf),
        cmocka_unit_test(test_status_mismatch_format_exact_text),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
