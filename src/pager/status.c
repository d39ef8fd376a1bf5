/*
 * status.c: status names and messages, and the rendering of kvp_error and
 * kvp_mismatch as text.
 *
 * Owns: the name and message tables (generated from KVP_STATUS_MAP), the
 * table of one text formatter per status (generated from the same map, so a
 * new status needs its formatter to compile) and the seed-exact renderers:
 * shapes as Rust's `{:?}` of a Vec<usize> ("[1, 2]"), f64 values as Rust's
 * `{:?}` of an f64 ("1.0", "NaN", "inf", "1e300").
 * Pure functions; no state.
 */
#include "kvpager/status.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const status_names[] = {
#define KVPI_STATUS_NAME_(suffix, value, name, message) [value] = name,
    KVP_STATUS_MAP(KVPI_STATUS_NAME_)
#undef KVPI_STATUS_NAME_
};

static const char *const status_messages[] = {
#define KVPI_STATUS_MESSAGE_(suffix, value, name, message) [value] = message,
    KVP_STATUS_MAP(KVPI_STATUS_MESSAGE_)
#undef KVPI_STATUS_MESSAGE_
};

const char *kvp_status_name(kvp_status status)
{
    if ((unsigned)status >= (unsigned)KVP_STATUS_COUNT_) {
        return "Unknown";
    }
    return status_names[status];
}

const char *kvp_status_message(kvp_status status)
{
    if ((unsigned)status >= (unsigned)KVP_STATUS_COUNT_) {
        return "unknown status";
    }
    return status_messages[status];
}

/* An snprintf-style sink: counts every byte, stores what fits. */
typedef struct text_sink {
    char *buf;
    size_t size;
    size_t len;
} text_sink;

static void sink_printf(text_sink *sink, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

static void sink_printf(text_sink *sink, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    char *at = NULL;
    size_t room = 0;
    if (sink->buf != NULL && sink->len < sink->size) {
        at = sink->buf + sink->len;
        room = sink->size - sink->len;
    }
    int written = vsnprintf(at, room, format, args);
    va_end(args);
    if (written > 0) {
        sink->len += (size_t)written;
    }
}

static void sink_shape(text_sink *sink, const kvp_shape *shape)
{
    sink_printf(sink, "[");
    size_t rank = shape->rank < KVP_MAX_RANK ? shape->rank : KVP_MAX_RANK;
    for (size_t i = 0; i < rank; i++) {
        sink_printf(sink, "%s%zu", i == 0 ? "" : ", ", shape->dims[i]);
    }
    if (shape->rank > KVP_MAX_RANK) {
        sink_printf(sink, ", ...");
    }
    sink_printf(sink, "]");
}

/*
 * Rust's `{:?}` for f64: the shortest digits that round-trip, in plain
 * decimal with at least one fractional digit when 1e-4 <= |x| < 1e16 (or x is
 * zero), otherwise as d.ddde<exp>.
 */
static void sink_rust_f64(text_sink *sink, double x)
{
    if (isnan(x)) {
        sink_printf(sink, "NaN");
        return;
    }
    if (isinf(x)) {
        sink_printf(sink, "%sinf", x < 0 ? "-" : "");
        return;
    }
    const char *sign = signbit(x) ? "-" : "";
    double mag = fabs(x);
    if (mag == 0.0) {
        sink_printf(sink, "%s0.0", sign);
        return;
    }
    char sci[40];
    /* 17 significant digits always round-trip, so the loop always breaks. */
    for (int precision = 0; precision < 17; precision++) { /* GCOVR_EXCL_BR_LINE */
        snprintf(sci, sizeof sci, "%.*e", precision, mag);
        if (strtod(sci, NULL) == mag) {
            break;
        }
    }
    /* sci is "d.ddde[+-]xx" or "de[+-]xx": split digits and exponent. */
    char digits[24];
    size_t ndigits = 0;
    const char *p = sci;
    for (; *p != 'e'; p++) {
        if (*p != '.') {
            digits[ndigits++] = *p;
        }
    }
    digits[ndigits] = '\0';
    int exponent = atoi(p + 1);
    /* The shortest round-trip digits never end in 0; kept for safety. */
    while (ndigits > 1 && digits[ndigits - 1] == '0') { /* GCOVR_EXCL_BR_LINE */
        digits[--ndigits] = '\0';                      /* GCOVR_EXCL_LINE */
    }
    if (mag < 1e-4 || mag >= 1e16) {
        sink_printf(sink, "%s%c", sign, digits[0]);
        if (ndigits > 1) {
            sink_printf(sink, ".%s", digits + 1);
        }
        sink_printf(sink, "e%d", exponent);
        return;
    }
    sink_printf(sink, "%s", sign);
    if (exponent < 0) {
        sink_printf(sink, "0.");
        for (int i = -1; i > exponent; i--) {
            sink_printf(sink, "0");
        }
        sink_printf(sink, "%s", digits);
        return;
    }
    size_t integer_digits = (size_t)exponent + 1;
    for (size_t i = 0; i < integer_digits; i++) {
        sink_printf(sink, "%c", i < ndigits ? digits[i] : '0');
    }
    sink_printf(sink, ".%s", ndigits > integer_digits ? digits + integer_digits : "0");
}

static const char *invariant_label(kvp_invariant invariant)
{
    switch (invariant) {
    case KVP_INVARIANT_STATS: return "stats";
    case KVP_INVARIANT_CONSERVATION: return "I1 conservation";
    case KVP_INVARIANT_NO_DUPLICATES: return "I2 no duplicates";
    case KVP_INVARIANT_REFERENCES: return "I3 references";
    case KVP_INVARIANT_LANE_COVERAGE: return "I4 lane coverage";
    case KVP_INVARIANT_PREFIX: return "I5 prefix index";
    }
    return "unknown invariant";
}

static void sink_mismatch(text_sink *sink, const kvp_mismatch *m)
{
    sink_printf(sink, "%s: %s", invariant_label(m->invariant), m->what != NULL ? m->what : "?");
    if (m->page != SIZE_MAX) {
        sink_printf(sink, " (page %zu)", m->page);
    }
    if (m->lane != SIZE_MAX) {
        sink_printf(sink, " (lane %zu)", m->lane);
    }
    sink_printf(sink, ": expected %zu, found %zu", m->expected, m->actual);
}

static const char *or_unknown(const char *text)
{
    return text != NULL ? text : "?";
}

/* INPUT_RANK and FULL about a prefill prompt rather than a decode input. */
static int is_prompt(const kvp_error *e)
{
    return e->what != NULL && strcmp(e->what, "prompt") == 0;
}

/*
 * Whether a detail names a grouped geometry: kv_heads recorded (nonzero) and
 * below heads. Multi-head details keep their texts from before kv_heads.
 */
static int is_grouped(size_t heads, size_t kv_heads)
{
    return kv_heads != 0 && kv_heads != heads;
}

/*
 * The text of each status, one formatter per status (text_<SUFFIX>): a
 * status's detail fields rendered into the seed's Display text (or
 * kvpager's own, for the statuses the seed does not have). The table
 * `error_texts` below is generated from KVP_STATUS_MAP, so a status added
 * to the map without a formatter does not compile.
 */
typedef void error_text(text_sink *sink, const kvp_error *e);

/* A message without detail fields: the status's whole text. */
#define KVPI_FIXED_TEXT_(suffix, text)                                                         \
    static void text_##suffix(text_sink *sink, const kvp_error *e)                             \
    {                                                                                          \
        (void)e;                                                                               \
        sink_printf(sink, "%s", text);                                                         \
    }

KVPI_FIXED_TEXT_(OK, "ok")
KVPI_FIXED_TEXT_(ZERO_BATCH_SIZE, "KV cache batch size must be nonzero")
KVPI_FIXED_TEXT_(ZERO_CAPACITY, "KV cache capacity must be nonzero")
KVPI_FIXED_TEXT_(CACHE_LAYER_MISMATCH,
                 "KV cache parameter identity does not match this attention layer")
KVPI_FIXED_TEXT_(TICKET_BUSY, "attention ticket already holds a prepared row; commit or discard it "
                 "first")
KVPI_FIXED_TEXT_(TICKET_EMPTY, "attention ticket holds no prepared row")
KVPI_FIXED_TEXT_(TICKET_FOREIGN_CACHE, "attention ticket was prepared for another KV cache")
KVPI_FIXED_TEXT_(ROPE_ZERO_POSITIONS, "RoPE max positions must be nonzero")
KVPI_FIXED_TEXT_(DECODER_BUSY, "decoder is busy: another kvp_decoder_step is running on it (one "
                 "caller at a time)")
KVPI_FIXED_TEXT_(MODEL_BUSY, "model still has live sequences; destroy them before the model")
KVPI_FIXED_TEXT_(CACHE_LAYER_BOUND,
                 "KV cache is bound to an attention layer: its rows enter only through "
                 "attention's prepare and commit (raw rows go to external caches)")

/* "KV cache <what> N must match attention layer <layer_what> M" (cache_size, layer_size). */
static void sink_cache_vs_layer(text_sink *sink, const kvp_error *e, const char *what,
                                const char *layer_what)
{
    sink_printf(sink, "KV cache %s %zu must match attention layer %s %zu", what, e->cache_size,
                layer_what, e->layer_size);
}

static void text_NULL_ARGUMENT(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "argument `%s` must not be NULL", or_unknown(e->argument));
}

static void text_INVALID_ARGUMENT(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "argument `%s` is invalid: %s", or_unknown(e->argument),
                or_unknown(e->what));
}

static void text_OUT_OF_RANGE(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "argument `%s` is %zu, which is out of range (must be below %zu)",
                or_unknown(e->argument), e->index, e->limit);
}

static void text_BUFFER_TOO_SMALL(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "buffer `%s` holds %zu values but %zu are needed",
                or_unknown(e->argument), e->available, e->needed);
}

static void text_ZERO_SIZE(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "page pool %s must be nonzero", or_unknown(e->argument));
}

static void text_SIZE_OVERFLOW(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink,
                "page pool size overflows for block_tokens %zu, %zu heads, head width %zu "
                "and budget %zu bytes",
                e->block_tokens, e->heads, e->head_width, e->budget_bytes);
}

static void text_BUDGET_TOO_SMALL(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "page pool budget of %zu bytes is below one page of %zu bytes",
                e->budget_bytes, e->page_bytes);
}

static void text_ALLOCATION_FAILED(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "cannot allocate %s (%zu bytes)", or_unknown(e->what), e->bytes);
}

static void text_POOL_EXHAUSTED(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "page pool exhausted: %zu pages needed, %zu free", e->needed,
                e->available);
}

static void text_POOL_BUSY(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink,
                "page pool is busy: %zu caches attached, %zu reservations held, "
                "%zu pages held",
                e->attached_caches, e->attached_reservations, e->held_pages);
}

static void text_GEOMETRY_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink,
                "cache geometry (%zu heads, head width %zu) does not match page pool "
                "geometry (%zu heads, head width %zu)",
                e->binding_geometry.heads, e->binding_geometry.head_width,
                e->pool_geometry.heads, e->pool_geometry.head_width);
}

static void text_AUDIT_FAILED(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "page pool audit found %zu mismatch%s; first: ", e->mismatches,
                e->mismatches == 1 ? "" : "es");
    sink_mismatch(sink, &e->first_mismatch);
}

static void text_CAPACITY_EXCEEDS_POSITIONS(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "KV cache capacity %zu exceeds RoPE position capacity %zu", e->capacity,
                e->max_positions);
}

static void text_ELEMENT_COUNT_OVERFLOW(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink,
                "KV cache element count overflows for batch %zu, %zu heads, capacity %zu, "
                "and head width %zu",
                e->batch_size, e->heads, e->capacity, e->head_width);
}

static void text_FULL(text_sink *sink, const kvp_error *e)
{
    if (is_prompt(e)) {
        sink_printf(sink, "prompt of %zu tokens does not fit: %zu of capacity %zu left",
                    e->tokens, e->available, e->capacity);
        return;
    }
    if (e->what != NULL && strcmp(e->what, "rows") == 0) {
        sink_printf(sink, "%zu rows do not fit: %zu of capacity %zu left", e->tokens,
                    e->available, e->capacity);
        return;
    }
    sink_printf(sink, "KV cache is full at capacity %zu", e->capacity);
}

static void text_KEY_SHAPE_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "appended %s must have shape ",
                e->status == KVP_KEY_SHAPE_MISMATCH ? "key" : "value");
    sink_shape(sink, &e->expected);
    sink_printf(sink, ", got ");
    sink_shape(sink, &e->actual);
}

static void text_NONFINITE_KEY(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "appended %s at flat index %zu must be finite",
                e->status == KVP_NONFINITE_KEY ? "key value" : "value", e->index);
    if (e->what != NULL) {
        sink_printf(sink, " in %s storage", e->what);
    }
    sink_printf(sink, ", got ");
    sink_rust_f64(sink, e->value);
}

static void text_INPUT_RANK(text_sink *sink, const kvp_error *e)
{
    if (is_prompt(e)) {
        sink_printf(sink,
                    "prefill prompt must have rank three [batch, tokens, model_width], "
                    "got rank %zu",
                    e->rank);
        return;
    }
    sink_printf(sink,
                "incremental attention input must have rank three [batch, 1, model_width], "
                "got rank %zu",
                e->rank);
}

static void text_SINGLE_TOKEN_REQUIRED(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "incremental attention needs exactly one new token, got %zu", e->tokens);
}

static void text_INPUT_BATCH_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "incremental attention input batch %zu must match cache batch %zu",
                e->actual_size, e->expected_size);
}

static void text_INPUT_WIDTH_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "incremental attention input width must equal model width %zu, got %zu",
                e->expected_size, e->actual_size);
}

static void text_CACHE_MODEL_WIDTH_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_cache_vs_layer(sink, e, "model width", "width");
}

static void text_CACHE_HEAD_COUNT_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_cache_vs_layer(sink, e, "head count", "head count");
}

static void text_CACHE_HEAD_WIDTH_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_cache_vs_layer(sink, e, "head width", "head width");
}

static void text_CACHE_LAYER_REVISION_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink,
                "KV cache parameter revision %llu at stable index %zu does not match layer "
                "revision %llu",
                (unsigned long long)e->cache_revision, e->parameter,
                (unsigned long long)e->layer_revision);
}

static void text_CACHE_ROPE_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "KV cache RoPE configuration (%zu features, %zu positions, base ",
                e->cache_rope.feature_width, e->cache_rope.max_positions);
    sink_rust_f64(sink, e->cache_rope.base);
    sink_printf(sink, ") does not match layer configuration (%zu features, %zu positions, base ",
                e->layer_rope.feature_width, e->layer_rope.max_positions);
    sink_rust_f64(sink, e->layer_rope.base);
    sink_printf(sink, ")");
}

static void text_NONFINITE_PROJECTION(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "incremental Q/K/V projection: %s at flat index %zu must be finite, got ",
                or_unknown(e->what), e->index);
    sink_rust_f64(sink, e->value);
}

static void text_NONFINITE_SCORE(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "incremental softmax: attention score at flat index %zu must be finite, "
                      "got ",
                e->index);
    sink_rust_f64(sink, e->value);
}

static void text_NONFINITE_OUTPUT(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "incremental output projection: output at flat index %zu must be "
                      "finite, got ",
                e->index);
    sink_rust_f64(sink, e->value);
}

static void text_TICKET_STALE(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink,
                "attention ticket is stale: it was prepared at cache length %zu and the "
                "cache has changed since (length %zu now)",
                e->prepared_len, e->current_len);
}

static void text_TICKET_GEOMETRY_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "attention ticket for batch %zu, %zu heads", e->batch_size, e->heads);
    if (is_grouped(e->heads, e->kv_heads)) {
        sink_printf(sink, " (%zu KV heads)", e->kv_heads);
    }
    sink_printf(sink, ", head width %zu and capacity %zu does not fit this KV cache",
                e->head_width, e->capacity);
}

static void text_ROPE_INVALID_WIDTH(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "RoPE feature width must be even and nonzero, got %zu",
                e->layer_rope.feature_width);
}

static void text_ROPE_INVALID_BASE(text_sink *sink, const kvp_error *e)
{
    if (isfinite(e->layer_rope.base) && e->layer_rope.base > 0.0) {
        sink_printf(sink, "RoPE base ");
        sink_rust_f64(sink, e->layer_rope.base);
        sink_printf(sink,
                    " gives a non-finite rotation angle within %zu positions of %zu features",
                    e->layer_rope.max_positions, e->layer_rope.feature_width);
        return;
    }
    sink_printf(sink, "RoPE base must be finite and greater than zero, got ");
    sink_rust_f64(sink, e->layer_rope.base);
}

static void text_ROPE_POSITION_OUT_OF_RANGE(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "RoPE position %zu is out of range for %zu positions", e->position,
                e->layer_rope.max_positions);
}

static void text_PARAMETER_WIDTH_MISMATCH(text_sink *sink, const kvp_error *e)
{
    if (e->expected.rank == 2 && e->actual.rank == 2) {
        sink_printf(sink, "attention parameter %zu is %zux%zu, expected %zux%zu", e->parameter,
                    e->actual.dims[0], e->actual.dims[1], e->expected.dims[0],
                    e->expected.dims[1]);
        return;
    }
    /* A detail without shapes: both parameters square. */
    sink_printf(sink, "attention parameter %zu is %zux%zu, expected %zux%zu", e->parameter,
                e->actual_size, e->actual_size, e->expected_size, e->expected_size);
}

static void text_HEADS_DO_NOT_DIVIDE_WIDTH(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "attention model width %zu must be a nonzero multiple of %zu heads",
                e->model_width, e->heads);
}

static void text_REFERENCE_INPUT_SHAPE(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink,
                "full-prefix attention input must have shape [batch, tokens, %zu] with "
                "nonzero batch and tokens, got ",
                e->model_width);
    sink_shape(sink, &e->actual);
}

static void text_MODEL_GEOMETRY_MISMATCH(text_sink *sink, const kvp_error *e)
{
    if (is_grouped(e->binding_geometry.heads, e->kv_heads) ||
        is_grouped(e->pool_geometry.heads, e->expected_kv_heads)) {
        sink_printf(sink,
                    "model layer %zu geometry (%zu heads, %zu KV heads, head width %zu) "
                    "differs from layer 0 geometry (%zu heads, %zu KV heads, head width %zu)",
                    e->layer, e->binding_geometry.heads, e->kv_heads,
                    e->binding_geometry.head_width, e->pool_geometry.heads,
                    e->expected_kv_heads, e->pool_geometry.head_width);
        return;
    }
    sink_printf(sink,
                "model layer %zu geometry (%zu heads, head width %zu) differs from layer 0 "
                "geometry (%zu heads, head width %zu)",
                e->layer, e->binding_geometry.heads, e->binding_geometry.head_width,
                e->pool_geometry.heads, e->pool_geometry.head_width);
}

static void text_THREAD_FAILED(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "cannot start decoder worker thread %zu of %zu", e->index, e->limit);
}

static void text_KV_HEADS_DO_NOT_DIVIDE_HEADS(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "attention head count %zu must be a nonzero multiple of %zu KV heads",
                e->heads, e->kv_heads);
}

static void text_CACHE_KV_HEAD_COUNT_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_cache_vs_layer(sink, e, "KV head count", "KV head count");
}

static void text_ROWS_RESERVED(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "KV cache already holds a reservation of %zu rows; commit or discard "
                      "it first",
                e->tokens);
}

static void text_ROWS_NOT_RESERVED(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "cannot commit %zu rows: the KV cache has %zu rows reserved", e->tokens,
                e->available);
}

static void text_PAGE_NOT_HELD(text_sink *sink, const kvp_error *e)
{
    /* An evictable page is registered, at reference count 0: not free, not held. */
    sink_printf(sink, "page %zu is %s: only held pages have data", e->index,
                e->what != NULL && strcmp(e->what, "evictable") == 0
                    ? "evictable (cached, but no page table holds it)"
                    : "free");
}

static void text_NOT_AT_BLOCK_BOUNDARY(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "KV cache length %zu is not a multiple of block_tokens %zu",
                e->current_len, e->block_tokens);
}

static void text_PAGE_PUBLISHED(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "page %zu is already published under another key", e->index);
}

static void text_BLOCK_BINDING_MISMATCH(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink,
                "page %zu was published under another binding than the adopting cache's "
                "(cache %zu of the group, position %zu): its rows were not computed by "
                "this cache's layer",
                e->index, e->layer, e->position);
}

static void text_REQUEST_UNKNOWN(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink,
                "request %zu is not held by the scheduler: %s (ids below %zu were given)",
                e->index, e->index < e->limit ? "collected already" : "never submitted",
                e->limit);
}

static void text_CACHE_WINDOW_MISMATCH(text_sink *sink, const kvp_error *e)
{
    const char *what = e->what != NULL && strcmp(e->what, "sink_tokens") == 0
                           ? "sink tokens"
                           : "attention window";
    sink_cache_vs_layer(sink, e, what, what);
}

static void text_TIER_BLOCK_REJECTED(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "tier block of %zu bytes rejected: its %s does not match", e->bytes,
                e->what != NULL ? e->what : "content");
}

static void text_TIER_UNAVAILABLE(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink, "the %s tier could not serve the request",
                e->what != NULL ? e->what : "unnamed");
}

static void text_BLOCK_RELEASED(text_sink *sink, const kvp_error *e)
{
    sink_printf(sink,
                "block %zu (position %zu) was released: it fell outside the attention window, "
                "so %s cannot use it",
                e->index, e->position, e->what != NULL ? e->what : "the call");
}

/* Statuses that share one formatter (it reads e->status). */
#define text_VALUE_SHAPE_MISMATCH text_KEY_SHAPE_MISMATCH
#define text_NONFINITE_VALUE text_NONFINITE_KEY

static error_text *const error_texts[KVP_STATUS_COUNT_] = {
#define KVPI_ERROR_TEXT_(suffix, value, name, message) [value] = text_##suffix,
    KVP_STATUS_MAP(KVPI_ERROR_TEXT_)
#undef KVPI_ERROR_TEXT_
};

static void sink_error(text_sink *sink, const kvp_error *e)
{
    if ((unsigned)e->status >= (unsigned)KVP_STATUS_COUNT_) {
        sink_printf(sink, "unknown kvpager status %d", (int)e->status);
        return;
    }
    error_texts[e->status](sink, e);
}

size_t kvp_error_format(const kvp_error *err, char *buf, size_t size)
{
    text_sink sink = {buf, size, 0};
    if (buf != NULL && size > 0) {
        buf[0] = '\0';
    }
    if (err == NULL) {
        sink_printf(&sink, "no error detail");
    } else {
        sink_error(&sink, err);
    }
    return sink.len;
}

size_t kvp_mismatch_format(const kvp_mismatch *mismatch, char *buf, size_t size)
{
    text_sink sink = {buf, size, 0};
    if (buf != NULL && size > 0) {
        buf[0] = '\0';
    }
    if (mismatch == NULL) {
        sink_printf(&sink, "no mismatch");
    } else {
        sink_mismatch(&sink, mismatch);
    }
    return sink.len;
}
