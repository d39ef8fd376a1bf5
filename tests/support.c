/*
 * support.c: test helpers (see support.h).
 */
#include "support.h"

#include <jemalloc/jemalloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pager/cache_internal.h"

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

kvp_pool *kvpt_pool(size_t block_tokens, size_t heads, size_t head_width, size_t pages)
{
    kvp_pool_config config = {block_tokens, heads, head_width,
                              pages * 2 * heads * block_tokens * head_width * sizeof(double)};
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    return pool;
}

kvp_binding kvpt_binding(size_t heads, size_t head_width, size_t max_positions)
{
    kvp_binding binding;
    memset(&binding, 0, sizeof binding);
    binding.model_width = heads * head_width;
    binding.heads = heads;
    binding.head_width = head_width;
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        binding.params[i].node_id = 1000 + i;
        binding.params[i].revision = 0;
    }
    binding.rope_feature_width = head_width;
    binding.rope_max_positions = max_positions;
    double base = 10000.0;
    memcpy(&binding.rope_base_bits, &base, sizeof base);
    return binding;
}

kvp_pool_stats kvpt_stats(kvp_pool *pool)
{
    kvp_pool_stats stats;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_stats_get(pool, &stats, &err), &err);
    return stats;
}

void kvpt_state_capture(kvp_cache *cache, kvp_pool *pool, kvpt_state *state)
{
    memset(state, 0, sizeof *state);
    kvp_cache_info info;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_info_get(cache, &info, &err), &err);
    state->len = info.len;
    state->elements = info.batch_size * info.binding.heads * info.capacity *
                      info.binding.head_width;
    state->keys = calloc(state->elements + 1, sizeof(double));
    state->values = calloc(state->elements + 1, sizeof(double));
    assert_non_null(state->keys);
    assert_non_null(state->values);
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

void kvpt_state_free(kvpt_state *state)
{
    free(state->keys);
    free(state->values);
    free(state->tables);
    memset(state, 0, sizeof *state);
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
