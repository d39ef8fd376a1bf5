/*
 * support.c: test helpers (see support.h).
 */
#include "support.h"

#include <jemalloc/jemalloc.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <valgrind/valgrind.h>

#include "attention/kernels.h"
#include "attention/layer_internal.h"
#include "pager/cache_internal.h"
#include "pager/pool_internal.h"

/* cmocka's assertion functions, reporting the caller's file and line. */
#define INT_EQUAL_AT(a, b, file, line) \
    _assert_int_equal(cast_to_largest_integral_type(a), cast_to_largest_integral_type(b), \
                      (file), (line))
#define TRUE_AT(c, file, line) _assert_true(cast_to_largest_integral_type(c), #c, (file), (line))

static void print_mismatch(void *ctx, const kvp_mismatch *mismatch)
{
    (void)ctx;
    char text[256];
    kvp_mismatch_format(mismatch, text, sizeof text);
    print_error("  audit: %s\n", text);
}

void kvpt_assert_pool_ok_at(kvp_pool *pool, const char *file, int line)
{
    kvp_error err;
    kvp_status status = kvp_pool_check(pool, print_mismatch, NULL, &err);
    if (status != KVP_OK) {
        char text[512];
        kvp_error_format(&err, text, sizeof text);
        print_error("%s:%d: pool audit failed: %s\n", file, line, text);
        fail();
    }
}

void kvpt_commitment(kvp_pool *pool, size_t *high_water, size_t *overdrawn)
{
    kvpi_pool_lock(pool);
    *high_water = pool->commit_high_water;
    *overdrawn = pool->overdrawn;
    kvpi_pool_unlock(pool);
}

void kvpt_assert_committed_at(kvp_pool *pool, const char *file, int line)
{
    size_t high_water = 0;
    size_t overdrawn = 0;
    kvpt_commitment(pool, &high_water, &overdrawn);
    size_t total = kvpt_stats(pool).total_pages;
    if (overdrawn == 0 && high_water > total) {
        print_error("%s:%d: held + promised reached %zu pages of %zu, no page overdrawn\n",
                    file, line, high_water, total);
        fail();
    }
}

void kvpt_assert_ok_at(kvp_status status, const kvp_error *err, const char *file, int line)
{
    if (status == KVP_OK) {
        return;
    }
    char text[512] = "";
    if (err != NULL) {
        kvp_error_format(err, text, sizeof text);
    }
    print_error("%s:%d: expected Ok, got %s: %s\n", file, line, kvp_status_name(status), text);
    fail();
}

void kvpt_assert_error_text_at(const kvp_error *e, const char *text, const char *file, int line)
{
    char buf[512];
    memset(buf, '#', sizeof buf);
    size_t n = kvp_error_format(e, buf, sizeof buf);
    if (strcmp(buf, text) != 0 || n != strlen(text)) {
        print_error("%s:%d: rendered \"%s\" (length %zu), expected \"%s\"\n", file, line, buf, n,
                    text);
        fail();
    }
    INT_EQUAL_AT(kvp_error_format(e, NULL, 0), strlen(text), file, line);
}

void kvpt_assert_close_at(double actual, double expected, double tolerance, const char *file,
                          int line)
{
    if (!(fabs(actual - expected) <= tolerance)) {
        print_error("%s:%d: %.17g differs from %.17g by more than %g\n", file, line, actual,
                    expected, tolerance);
        fail();
    }
}

double kvpt_max_abs_diff(const double *a, const double *b, size_t n)
{
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double diff = fabs(a[i] - b[i]);
        if (isnan(diff)) {
            return INFINITY;
        }
        if (diff > worst) {
            worst = diff;
        }
    }
    return worst;
}

void kvpt_fill(double *out, size_t n, double value)
{
    for (size_t i = 0; i < n; i++) {
        out[i] = value;
    }
}

void kvpt_assert_filled_at(const double *out, size_t n, double value, const char *file, int line)
{
    for (size_t i = 0; i < n; i++) {
        if (!(out[i] == value)) {
            print_error("%s:%d: element %zu of %zu is %.17g, expected it untouched at %.17g\n",
                        file, line, i, n, out[i], value);
            fail();
        }
    }
}

kvp_pool *kvpt_dtype_pool(size_t block_tokens, size_t heads, size_t head_width, size_t pages,
                          kvp_dtype dtype)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = block_tokens;
    config.heads = heads;
    config.head_width = head_width;
    config.budget_bytes =
        pages * 2 * heads * block_tokens * head_width * kvp_dtype_bytes(dtype);
    config.dtype = dtype;
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).total_pages, pages);
    return pool;
}

kvp_pool *kvpt_pool(size_t block_tokens, size_t heads, size_t head_width, size_t pages)
{
    return kvpt_dtype_pool(block_tokens, heads, head_width, pages, KVP_F64);
}

kvp_decoder *kvpt_decoder(size_t threads)
{
    kvp_decoder *decoder = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_decoder_create(threads, &decoder, &err), &err);
    return decoder;
}

void kvpt_destroy_decoder(kvp_decoder *decoder)
{
    kvp_error err;
    kvpt_assert_ok(kvp_decoder_destroy(decoder, &err), &err);
}

void kvpt_destroy_pool_at(kvp_pool *pool, const char *file, int line)
{
    kvpt_assert_pool_ok_at(pool, file, line);
    kvp_pool_stats stats = kvpt_stats(pool);
    INT_EQUAL_AT(stats.held_pages, 0, file, line);
    INT_EQUAL_AT(stats.free_pages, stats.total_pages, file, line);
    INT_EQUAL_AT(stats.attached_caches, 0, file, line);
    INT_EQUAL_AT(stats.attached_reservations, 0, file, line);
    INT_EQUAL_AT(stats.promised_pages, 0, file, line);
    kvp_error err;
    kvpt_assert_ok_at(kvp_pool_destroy(pool, &err), &err, file, line);
}

kvp_binding kvpt_binding(size_t heads, size_t head_width, size_t max_positions)
{
    kvpi_layer_record record;
    memset(&record, 0, sizeof record);
    record.magic = KVPI_LAYER_RECORD_MAGIC;
    record.model_width = heads * head_width;
    record.heads = heads;
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        record.node_id[i] = 1000 + i;
        record.revision[i] = 0;
    }
    record.rope_feature_width = head_width;
    record.rope_max_positions = max_positions;
    double base = 10000.0;
    memcpy(&record.rope_base_bits, &base, sizeof base);
    kvp_binding binding;
    kvpi_layer_record_binding(&record, heads, head_width, 0.0, 0.0, &binding);
    return binding;
}

kvpi_layer_record kvpt_record(const kvp_binding *binding)
{
    kvpi_layer_record record;
    kvpi_binding_layer_record(binding, &record);
    return record;
}

kvp_binding kvpt_rebind(const kvp_binding *binding, const kvpi_layer_record *record)
{
    kvp_binding out;
    kvpi_layer_record_binding(record, binding->kv_heads, binding->head_width, binding->k_scale,
                              binding->v_scale, &out);
    return out;
}

kvp_pool_stats kvpt_stats(kvp_pool *pool)
{
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_stats_get(pool, &stats, &err), &err);
    return stats;
}

kvp_cache *kvpt_cache(kvp_pool *pool, const kvp_binding *binding, size_t batch, size_t capacity)
{
    kvp_cache *cache = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_create(pool, binding, batch, capacity, &cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    return cache;
}

void kvpt_destroy_cache(kvp_cache *cache, kvp_pool *pool)
{
    kvp_error err;
    kvpt_assert_ok(kvp_cache_destroy(cache, &err), &err);
    kvpt_assert_pool_ok(pool);
}

kvp_ticket *kvpt_ticket(const kvp_cache *cache)
{
    kvp_ticket *ticket = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_ticket_create(cache, &ticket, &err), &err);
    return ticket;
}

void kvpt_destroy_ticket(kvp_ticket *ticket, kvp_pool *pool)
{
    kvp_error err;
    kvpt_assert_ok(kvp_ticket_destroy(ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
}

kvp_layer *kvpt_random_layer(size_t model_width, size_t heads, size_t max_positions, double base,
                             uint64_t seed)
{
    kvp_layer *layer = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create_random(model_width, heads, max_positions, base, seed, &layer,
                                           &err),
                   &err);
    return layer;
}

kvp_layer *kvpt_layer_from_matrices(size_t width, const double *const w[KVP_PARAM_COUNT],
                                    size_t heads, size_t max_positions, double base)
{
    kvp_param *params[KVP_PARAM_COUNT];
    kvp_error err;
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        kvpt_assert_ok(kvp_param_create(width, w[i], &params[i], &err), &err);
    }
    kvp_layer *layer = NULL;
    kvpt_assert_ok(kvp_layer_create(params[0], params[1], params[2], params[3], heads,
                                    max_positions, base, &layer, &err),
                   &err);
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        kvpt_assert_ok(kvp_param_release(params[i], &err), &err);
    }
    return layer;
}

void kvpt_destroy_layer(kvp_layer *layer)
{
    kvp_error err;
    kvpt_assert_ok(kvp_layer_destroy(layer, &err), &err);
}

kvp_model *kvpt_random_model(size_t layers, size_t model_width, size_t heads, size_t max_positions,
                             double base, uint64_t seed)
{
    kvp_model *model = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_model_create_random(layers, model_width, heads, max_positions, base, seed,
                                           &model, &err),
                   &err);
    return model;
}

kvp_model *kvpt_model_of_one_layer(kvp_layer *layer, size_t layers)
{
    const kvp_layer *list[64];
    assert_true(layers >= 1 && layers <= sizeof list / sizeof list[0]);
    for (size_t l = 0; l < layers; l++) {
        list[l] = layer;
    }
    kvp_model *model = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_model_create(list, layers, &model, &err), &err);
    kvpt_destroy_layer(layer);
    return model;
}

void kvpt_destroy_model(kvp_model *model)
{
    kvp_error err;
    kvpt_assert_ok(kvp_model_destroy(model, &err), &err);
}

kvp_sequence *kvpt_sequence(const kvp_model *model, kvp_pool *pool, size_t batch, size_t capacity)
{
    kvp_sequence *seq = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_create(model, pool, batch, capacity, &seq, &err), &err);
    kvpt_assert_pool_ok(pool);
    return seq;
}

void kvpt_destroy_sequence(kvp_sequence *seq, kvp_pool *pool)
{
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_destroy(seq, &err), &err);
    kvpt_assert_pool_ok(pool);
}

void kvpt_assert_layer_info_at(const kvp_layer *layer, size_t model_width, size_t heads,
                               size_t head_width, size_t max_positions, double base,
                               const char *file, int line)
{
    kvp_layer_info info;
    kvp_layer_info_init(&info);
    kvp_error err;
    kvpt_assert_ok_at(kvp_layer_info_get(layer, &info, &err), &err, file, line);
    INT_EQUAL_AT(info.model_width, model_width, file, line);
    INT_EQUAL_AT(info.heads, heads, file, line);
    INT_EQUAL_AT(info.head_width, head_width, file, line);
    INT_EQUAL_AT(info.rope.feature_width, head_width, file, line);
    INT_EQUAL_AT(info.rope.max_positions, max_positions, file, line);
    TRUE_AT(info.rope.base == base, file, line);
}

size_t kvpt_sequence_layers(const kvp_sequence *seq)
{
    size_t layers = 0;
    while (kvp_sequence_cache(seq, layers) != NULL) {
        layers++;
    }
    return layers;
}

void kvpt_assert_same_rows_at(const kvp_sequence *a, const kvp_sequence *b, const char *file,
                              int line)
{
    size_t layers = kvpt_sequence_layers(a);
    INT_EQUAL_AT(kvpt_sequence_layers(b), layers, file, line);
    INT_EQUAL_AT(kvp_sequence_len(a), kvp_sequence_len(b), file, line);
    kvp_error err;
    for (size_t l = 0; l < layers; l++) {
        const kvp_cache *ca = kvp_sequence_cache(a, l);
        const kvp_cache *cb = kvp_sequence_cache(b, l);
        kvp_cache_info info;
        kvp_cache_info_init(&info);
        kvpt_assert_ok_at(kvp_cache_info_get(ca, &info, &err), &err, file, line);
        size_t n = info.batch_size * info.binding.kv_heads * info.len * info.binding.head_width;
        double *ra = kvpt_doubles(n);
        double *rb = kvpt_doubles(n);
        kvpt_assert_ok_at(kvp_cache_keys(ca, ra, n, &err), &err, file, line);
        kvpt_assert_ok_at(kvp_cache_keys(cb, rb, n, &err), &err, file, line);
        _assert_memory_equal(ra, rb, n * sizeof *ra, file, line);
        kvpt_assert_ok_at(kvp_cache_values(ca, ra, n, &err), &err, file, line);
        kvpt_assert_ok_at(kvp_cache_values(cb, rb, n, &err), &err, file, line);
        _assert_memory_equal(ra, rb, n * sizeof *ra, file, line);
        free(ra);
        free(rb);
    }
}

void kvpt_state_capture(kvp_cache *cache, kvp_pool *pool, kvpt_state *state)
{
    memset(state, 0, sizeof *state);
    kvp_cache_info info;
    kvp_cache_info_init(&info);
    kvp_error err;
    kvpt_assert_ok(kvp_cache_info_get(cache, &info, &err), &err);
    state->len = info.len;
    state->elements = info.batch_size * info.binding.kv_heads * info.capacity *
                      info.binding.head_width;
    state->keys = kvpt_doubles(state->elements);
    state->values = kvpt_doubles(state->elements);
    kvpt_assert_ok(kvp_cache_keys(cache, state->keys, state->elements, &err), &err);
    kvpt_assert_ok(kvp_cache_values(cache, state->values, state->elements, &err), &err);
    size_t mapped = (info.len + info.block_tokens - 1) / info.block_tokens;
    state->pages = info.batch_size * mapped;
    state->tables = calloc(state->pages + 1, sizeof(uint32_t));
    assert_non_null(state->tables);
    for (size_t lane = 0; lane < info.batch_size; lane++) {
        for (size_t block = 0; block < mapped; block++) {
            kvpt_assert_ok(kvp_cache_page(cache, lane, block, &state->tables[lane * mapped + block],
                                          &err),
                           &err);
        }
    }
    state->stats = kvpt_stats(pool);
}

void kvpt_assert_state_equal_at(const kvpt_state *a, const kvpt_state *b, const char *file,
                                int line)
{
    const char *what = NULL;
    if (a->len != b->len) {
        what = "len";
    } else if (a->elements != b->elements ||
               memcmp(a->keys, b->keys, a->elements * sizeof(double)) != 0) {
        what = "logical keys";
    } else if (memcmp(a->values, b->values, a->elements * sizeof(double)) != 0) {
        what = "logical values";
    } else if (a->pages != b->pages ||
               memcmp(a->tables, b->tables, a->pages * sizeof(uint32_t)) != 0) {
        what = "page tables";
    } else if (memcmp(&a->stats, &b->stats, sizeof a->stats) != 0) {
        what = "pool stats";
    }
    if (what != NULL) {
        print_error("%s:%d: state changed: %s\n", file, line, what);
        fail();
    }
}

void kvpt_assert_state_unchanged_at(const kvpt_state *before, kvp_cache *cache, kvp_pool *pool,
                                    uint64_t exhaustions, const char *file, int line)
{
    kvpt_assert_pool_ok_at(pool, file, line);
    kvpt_state now;
    kvpt_state_capture(cache, pool, &now);
    INT_EQUAL_AT(now.stats.exhaustions, before->stats.exhaustions + exhaustions, file, line);
    now.stats.exhaustions = before->stats.exhaustions;
    kvpt_assert_state_equal_at(before, &now, file, line);
    kvpt_state_free(&now);
}

void kvpt_state_free(kvpt_state *state)
{
    free(state->keys);
    free(state->values);
    free(state->tables);
    memset(state, 0, sizeof *state);
}

void kvpt_snapshot_init(kvpt_snapshot *s, kvp_pool *pool)
{
    memset(s, 0, sizeof *s);
    s->pool = pool;
}

void kvpt_snapshot_add_cache(kvpt_snapshot *s, const kvp_cache *cache)
{
    assert_true(s->ncaches < KVPT_SNAPSHOT_MAX);
    s->caches[s->ncaches++] = cache;
}

void kvpt_snapshot_add_sequence(kvpt_snapshot *s, const kvp_sequence *sequence)
{
    assert_true(s->nsequences < KVPT_SNAPSHOT_MAX);
    s->sequences[s->nsequences++] = sequence;
}

void kvpt_snapshot_add_param(kvpt_snapshot *s, const kvp_param *param)
{
    assert_true(s->nparams < KVPT_SNAPSHOT_MAX);
    s->params[s->nparams++] = param;
}

void kvpt_snapshot_add_ticket(kvpt_snapshot *s, const kvp_ticket *ticket)
{
    assert_true(s->ntickets < KVPT_SNAPSHOT_MAX);
    s->tickets[s->ntickets++] = ticket;
}

static uint64_t fnv1a(uint64_t hash, const void *data, size_t bytes)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < bytes; i++) {
        hash = (hash ^ p[i]) * 0x100000001b3ull;
    }
    return hash;
}

void kvpt_snapshot_take_at(kvpt_snapshot *s, const char *file, int line)
{
    kvp_error err;
    if (s->pool != NULL) {
        kvpt_assert_pool_ok_at(s->pool, file, line);
        kvp_pool_stats_init(&s->stats);
        kvpt_assert_ok_at(kvp_pool_stats_get(s->pool, &s->stats, &err), &err, file, line);
        /* A reserved pool's pages hold no data to digest (KVP_SLAB_RESERVED): 0. */
        s->pool_digest = 0;
        if (s->stats.slab_source != KVP_SLAB_RESERVED) {
            kvpt_assert_ok_at(kvp_pool_digest(s->pool, &s->pool_digest, &err), &err, file, line);
        }
    }
    for (size_t i = 0; i < s->ncaches; i++) {
        kvp_cache_info_init(&s->cache_info[i]);
        kvpt_assert_ok_at(kvp_cache_info_get(s->caches[i], &s->cache_info[i], &err), &err, file,
                          line);
        s->cache_digest[i] = 0;
        if (s->pool == NULL || s->stats.slab_source != KVP_SLAB_RESERVED) {
            kvpt_assert_ok_at(kvp_cache_digest(s->caches[i], &s->cache_digest[i], &err), &err,
                              file, line);
        }
    }
    for (size_t i = 0; i < s->nsequences; i++) {
        const kvp_sequence *seq = s->sequences[i];
        s->seq_len[i] = kvp_sequence_len(seq);
        s->seq_held[i] = kvp_sequence_held_pages(seq);
        s->seq_promised[i] = kvp_sequence_promised_pages(seq);
        s->seq_pages_next[i] = kvp_sequence_pages_for(seq, s->seq_len[i] + 1);
        uint64_t hash = 0xcbf29ce484222325ull;
        for (size_t l = 0; kvp_sequence_cache(seq, l) != NULL; l++) {
            uint64_t digest = 0;
            kvpt_assert_ok_at(kvp_cache_digest(kvp_sequence_cache(seq, l), &digest, &err), &err,
                              file, line);
            hash = fnv1a(hash, &digest, sizeof digest);
        }
        s->seq_digest[i] = hash;
    }
    for (size_t i = 0; i < s->nparams; i++) {
        const kvp_param *param = s->params[i];
        size_t count = kvp_param_rows(param) * kvp_param_cols(param);
        s->param_id[i] = kvp_param_id(param);
        s->param_revision[i] = kvp_param_revision(param);
        s->param_digest[i] = fnv1a(0xcbf29ce484222325ull, kvp_param_values(param),
                                   count * sizeof(double));
    }
    for (size_t i = 0; i < s->ntickets; i++) {
        kvp_attention_result *r = &s->ticket_result[i];
        memset(r, 0, sizeof *r);
        s->ticket_status[i] = kvp_ticket_result(s->tickets[i], r, NULL);
        s->ticket_digest[i] = 0;
        if (s->ticket_status[i] == KVP_OK) {
            uint64_t hash = fnv1a(0xcbf29ce484222325ull, r->output,
                                  r->batch_size * r->model_width * sizeof(double));
            s->ticket_digest[i] = fnv1a(hash, r->weights,
                                        r->batch_size * r->heads * r->keys * sizeof(double));
        }
    }
}

void kvpt_assert_unchanged_at(const kvpt_snapshot *before, uint64_t exhaustions, const char *file,
                              int line)
{
    kvpt_snapshot now = *before;
    kvpt_snapshot_take_at(&now, file, line);
    const char *what = NULL;
    size_t which = 0;
    if (before->pool != NULL) {
        kvp_pool_stats expected = before->stats;
        expected.exhaustions += exhaustions;
        if (now.stats.exhaustions != expected.exhaustions) {
            what = "pool exhaustions";
        } else if (memcmp(&now.stats, &expected, sizeof expected) != 0) {
            what = "pool stats";
        } else if (now.pool_digest != before->pool_digest) {
            what = "pool digest (slab bytes)";
        }
    }
    for (size_t i = 0; what == NULL && i < before->ncaches; i++) {
        which = i;
        if (memcmp(&now.cache_info[i], &before->cache_info[i], sizeof now.cache_info[i]) != 0) {
            what = "cache info";
        } else if (now.cache_digest[i] != before->cache_digest[i]) {
            what = "cache digest";
        }
    }
    for (size_t i = 0; what == NULL && i < before->nsequences; i++) {
        which = i;
        if (now.seq_len[i] != before->seq_len[i] || now.seq_held[i] != before->seq_held[i] ||
            now.seq_promised[i] != before->seq_promised[i] ||
            now.seq_pages_next[i] != before->seq_pages_next[i]) {
            what = "sequence length, held, promised or next token's pages";
        } else if (now.seq_digest[i] != before->seq_digest[i]) {
            what = "sequence cache digests";
        }
    }
    for (size_t i = 0; what == NULL && i < before->nparams; i++) {
        which = i;
        if (now.param_id[i] != before->param_id[i] ||
            now.param_revision[i] != before->param_revision[i] ||
            now.param_digest[i] != before->param_digest[i]) {
            what = "parameter id, revision or values";
        }
    }
    for (size_t i = 0; what == NULL && i < before->ntickets; i++) {
        which = i;
        if (now.ticket_status[i] != before->ticket_status[i] ||
            memcmp(&now.ticket_result[i], &before->ticket_result[i],
                   sizeof now.ticket_result[i]) != 0 ||
            now.ticket_digest[i] != before->ticket_digest[i]) {
            what = "ticket result";
        }
    }
    if (what != NULL) {
        print_error("%s:%d: a failed call changed %s (object %zu)\n", file, line, what, which);
        fail();
    }
}

static uint64_t read_counter(const char *name)
{
    uint64_t value = 0;
    size_t size = sizeof value;
    assert_int_equal(mallctl(name, &value, &size, NULL, 0), 0);
    return value;
}

uint64_t kvpt_thread_allocated(void)
{
    return read_counter("thread.allocated");
}

uint64_t kvpt_thread_deallocated(void)
{
    return read_counter("thread.deallocated");
}

int kvpt_malloc_is_counted(void)
{
    uint64_t before = kvpt_thread_allocated();
    void *volatile probe = malloc(4096);
    uint64_t after = kvpt_thread_allocated();
    free(probe);
    return after > before;
}

void kvpt_heap_window_open_at(kvpt_heap_window *w, const char *file, int line)
{
    memset(w, 0, sizeof *w);
    w->counted = kvpt_malloc_is_counted();
#if !defined(__SANITIZE_ADDRESS__)
    /* Natively jemalloc serves malloc; only Valgrind replaces it here. */
    if (!RUNNING_ON_VALGRIND) {
        TRUE_AT(w->counted, file, line);
    }
#else
    (void)file;
    (void)line;
#endif
    (void)kvpt_thread_allocated();
    (void)kvpt_thread_deallocated();
    w->allocated_before = kvpt_thread_allocated();
    w->deallocated_before = kvpt_thread_deallocated();
}

void kvpt_heap_window_close(kvpt_heap_window *w)
{
    w->allocated_after = kvpt_thread_allocated();
    w->deallocated_after = kvpt_thread_deallocated();
}

void kvpt_assert_no_heap_traffic_at(const kvpt_heap_window *w, const char *file, int line)
{
    if (!w->counted) {
        return;
    }
    INT_EQUAL_AT(w->allocated_after - w->allocated_before, 0, file, line);
    INT_EQUAL_AT(w->deallocated_after - w->deallocated_before, 0, file, line);
    /* ... and the counters are live: an allocation and a free do move them. */
    uint64_t allocated = kvpt_thread_allocated();
    uint64_t deallocated = kvpt_thread_deallocated();
    void *volatile probe = malloc(1024);
    uint64_t allocated_probe = kvpt_thread_allocated();
    free(probe);
    uint64_t deallocated_probe = kvpt_thread_deallocated();
    TRUE_AT(allocated_probe - allocated >= 1024, file, line);
    TRUE_AT(deallocated_probe - deallocated >= 1024, file, line);
}

int kvpt_disarm(void **state)
{
    (void)state;
    kvpi_fault_arm(0);
    return 0;
}

void kvpt_fault_step_arm(kvpt_fault_step *s, uint64_t nth)
{
    memset(s, 0, sizeof *s);
    memset(&s->err, 0x5A, sizeof s->err);
    kvpi_fault_arm(nth);
}

void kvpt_fault_step_finish(kvpt_fault_step *s, kvp_status status)
{
    s->status = status;
    s->fired = kvpi_fault_fired();
    s->site = kvpi_fault_last_site();
    s->calls = kvpi_fault_calls();
    kvpi_fault_arm(0);
}

void kvpt_assert_fault_failed_at(const kvpt_fault_step *s, uint64_t nth, const char *file, int line)
{
    INT_EQUAL_AT(s->status, KVP_ALLOCATION_FAILED, file, line);
    INT_EQUAL_AT(s->err.status, KVP_ALLOCATION_FAILED, file, line);
    TRUE_AT((unsigned)s->site < (unsigned)KVPI_SITE_COUNT_, file, line);
    INT_EQUAL_AT(s->calls, nth, file, line); /* the call stopped at the failure */
    TRUE_AT(s->err.what != NULL, file, line);
    TRUE_AT(s->err.bytes > 0, file, line);
    char expected[160];
    snprintf(expected, sizeof expected, "cannot allocate %s (%zu bytes)", s->err.what,
             s->err.bytes);
    kvpt_assert_error_text_at(&s->err, expected, file, line);
}

uint64_t kvpt_rand_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double kvpt_rand_unit(uint64_t *state)
{
    return (double)(kvpt_rand_next(state) >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

void kvpt_fill_random(double *out, size_t n, uint64_t seed)
{
    uint64_t rng = seed;
    for (size_t i = 0; i < n; i++) {
        out[i] = kvpt_rand_unit(&rng);
    }
}

double *kvpt_doubles(size_t n)
{
    double *p = calloc(n + 1, sizeof(double));
    assert_non_null(p);
    return p;
}

typedef struct watchdog {
    const char *program;
    unsigned seconds;
} watchdog;

static void *watchdog_main(void *arg)
{
    const watchdog *w = arg;
    struct timespec left = {.tv_sec = (time_t)w->seconds, .tv_nsec = 0};
    while (nanosleep(&left, &left) != 0) {
    }
    fprintf(stderr, "%s: watchdog: still running after %u s, a hang; aborting\n", w->program,
            w->seconds);
    abort();
}

void kvpt_watchdog(const char *program, unsigned seconds)
{
    static watchdog w;
    w.program = program;
    w.seconds = RUNNING_ON_VALGRIND ? 20 * seconds : seconds;
    pthread_t thread;
    if (pthread_create(&thread, NULL, watchdog_main, &w) != 0 || pthread_detach(thread) != 0) {
        fprintf(stderr, "%s: cannot start the watchdog\n", program);
        abort();
    }
}

void kvpt_collect_finding(void *ctx, const kvp_mismatch *m)
{
    kvpt_findings *c = ctx;
    if (c->count < KVPT_FINDINGS_KEPT) {
        c->items[c->count] = *m;
    }
    c->count++;
}

size_t kvpt_lru_order(kvp_pool *pool, uint32_t *order)
{
    size_t n = 0;
    kvpi_pool_lock(pool);
    for (uint32_t p = pool->lru_head; p != KVPI_NO_PAGE; p = pool->lru_next[p]) {
        order[n++] = p;
    }
    kvpi_pool_unlock(pool);
    return n;
}

void kvpt_documented_softmax_fast(float *s, size_t n)
{
    if (n == 0) {
        return;
    }
    float m = s[0];
    for (size_t i = 1; i < n; i++) {
        m = fmaxf(m, s[i]);
    }
    float lanes[16] = {0};
    size_t n16 = n / 16 * 16;
    for (size_t i = 0; i < n; i++) {
        s[i] = kvpi_exp2f(s[i] - m);
        if (i < n16) {
            lanes[i % 16] += s[i];
        }
    }
    float t[8];
    for (int l = 0; l < 8; l++) {
        t[l] = lanes[l] + lanes[l + 8];
    }
    float sum = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
    for (size_t i = n16; i < n; i++) {
        sum += s[i];
    }
    for (size_t i = 0; i < n; i++) {
        s[i] /= sum;
    }
}

int kvpt_same_bits(double a, double b)
{
    return memcmp(&a, &b, sizeof a) == 0;
}

double kvpt_round_to_format(double x, int bits, int emin)
{
    double a = fabs(x);
    if (a == 0.0) {
        return x;
    }
    int e = ilogb(a);
    double quantum = ldexp(1.0, (e < emin ? emin : e) - (bits - 1));
    double lo = floor(a / quantum) * quantum;
    double hi = lo + quantum;
    double r;
    if (a - lo < hi - a) {
        r = lo;
    } else if (a - lo > hi - a) {
        r = hi;
    } else {
        r = fmod(lo / quantum, 2.0) == 0.0 ? lo : hi;
    }
    return copysign(r, x);
}
