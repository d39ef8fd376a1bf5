/*
 * measure.c: the timing primitives (see measure.h).
 */
#include "measure.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "kvpager/cache.h"

/* Calibration stops doubling here, whatever the case costs. */
#define MAX_ITERATIONS ((size_t)1 << 26)

double kvp_measure_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a;
    double y = *(const double *)b;
    return (x > y) - (x < y);
}

double kvp_measure_median(double *values, size_t n)
{
    qsort(values, n, sizeof *values, compare_doubles);
    return values[n / 2];
}

int kvp_measure_alternating(const kvp_measure_case *cases, size_t count, size_t repetitions,
                            double min_ns, double *median_ns)
{
    double *times = kvp_cli_alloc(count * repetitions, sizeof *times);
    size_t *iterations = kvp_cli_alloc(count, sizeof *iterations);
    if (times == NULL || iterations == NULL) {
        kvp_cli_free(times);
        kvp_cli_free(iterations);
        return -1;
    }
    for (size_t c = 0; c < count; c++) {
        size_t n = 1;
        for (;;) {
            double start = kvp_measure_now_ns();
            cases[c].run(cases[c].ctx, n);
            if (kvp_measure_now_ns() - start >= min_ns || n >= MAX_ITERATIONS) {
                break;
            }
            n *= 2;
        }
        iterations[c] = n;
    }
    for (size_t r = 0; r < repetitions; r++) {
        for (size_t c = 0; c < count; c++) {
            double start = kvp_measure_now_ns();
            cases[c].run(cases[c].ctx, iterations[c]);
            times[c * repetitions + r] = (kvp_measure_now_ns() - start) / (double)iterations[c];
        }
    }
    for (size_t c = 0; c < count; c++) {
        median_ns[c] = kvp_measure_median(times + c * repetitions, repetitions);
    }
    kvp_cli_free(times);
    kvp_cli_free(iterations);
    return 0;
}

double kvp_measure_unit(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

/* Destroys caches[count - 1] .. caches[0], in that order: each pushes its page. */
static void destroy_backwards(kvp_cache **caches, size_t count)
{
    while (count-- > 0) {
        kvp_cache_destroy(caches[count], NULL);
    }
}

/* How to reorder the caches holding the free list's pages (a permutation of caches[0..total)). */
typedef void (*reorder_fn)(void *ctx, kvp_cache **caches, size_t total);

/*
 * Public API only: one single-lane external cache per page, caches[i]
 * holding the i-th page the free list gave (its one zero row took it).
 * Reordered, then destroyed from the last to the first: each destroy pushes
 * its page, so the free list ends up in the new order, caches[0]'s page on
 * top. On failure the caches made so far are destroyed newest first, which
 * restores the free list's order.
 */
static int reorder_pool(kvp_pool *pool, reorder_fn reorder, void *ctx)
{
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvp_page_layout layout;
    kvp_page_layout_init(&layout);
    kvp_binding binding;
    if (kvp_pool_stats_get(pool, &stats, NULL) != KVP_OK || stats.held_pages != 0 ||
        stats.total_pages == 0 || kvp_pool_page_layout_get(pool, &layout, NULL) != KVP_OK ||
        kvp_binding_init_external(&binding, layout.heads, layout.head_width, 1, 0, 0, NULL) !=
            KVP_OK) {
        return -1;
    }
    size_t total = stats.total_pages;
    kvp_cache **caches = kvp_cli_calloc(total, sizeof *caches);
    double *row = kvp_cli_calloc(layout.heads * layout.head_width, sizeof *row);
    if (caches == NULL || row == NULL) {
        kvp_cli_free(row);
        kvp_cli_free(caches);
        return -1;
    }
    for (size_t i = 0; i < total; i++) {
        if (kvp_cache_create(pool, &binding, 1, 1, &caches[i], NULL) != KVP_OK) {
            destroy_backwards(caches, i);
            kvp_cli_free(row);
            kvp_cli_free(caches);
            return -1;
        }
        if (kvp_cache_append_rows(caches[i], row, row, 1, NULL) != KVP_OK) {
            destroy_backwards(caches, i + 1);
            kvp_cli_free(row);
            kvp_cli_free(caches);
            return -1;
        }
    }
    reorder(ctx, caches, total);
    destroy_backwards(caches, total);
    kvp_cli_free(row);
    kvp_cli_free(caches);
    return 0;
}

static void shuffle(void *ctx, kvp_cache **caches, size_t total)
{
    uint64_t *state = ctx;
    for (size_t i = total - 1; i > 0; i--) {
        size_t j = (size_t)((kvp_measure_unit(state) + 1.0) / 2.0 * (double)(i + 1)) % (i + 1);
        kvp_cache *t = caches[i];
        caches[i] = caches[j];
        caches[j] = t;
    }
}

int kvp_measure_shuffle_pool(kvp_pool *pool, uint64_t *state)
{
    return reorder_pool(pool, shuffle, state);
}

typedef struct lane_order {
    size_t lanes;
    size_t blocks;
    int failed;
} lane_order;

/*
 * Take k (k < lanes * blocks; appends take block by block, lane by lane, so
 * take k is block k / lanes of lane k % lanes) gets the page of address rank
 * (k % lanes) * blocks + k / lanes. A fresh pool hands out its pages in
 * address order, so caches[i] holds the page of rank i.
 */
static void lane_major(void *ctx, kvp_cache **caches, size_t total)
{
    lane_order *o = ctx;
    size_t n = o->lanes * o->blocks;
    kvp_cache **order = kvp_cli_alloc(n, sizeof *order);
    if (order == NULL || n > total) {
        kvp_cli_free(order);
        o->failed = 1;
        return;
    }
    for (size_t k = 0; k < n; k++) {
        order[k] = caches[(k % o->lanes) * o->blocks + k / o->lanes];
    }
    memcpy(caches, order, n * sizeof *order);
    kvp_cli_free(order);
}

int kvp_measure_lane_major_pool(kvp_pool *pool, size_t lanes, size_t blocks)
{
    lane_order o = {lanes, blocks, 0};
    int failed = reorder_pool(pool, lane_major, &o);
    return failed != 0 || o.failed ? -1 : 0;
}
