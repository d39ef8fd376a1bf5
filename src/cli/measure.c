/*
 * measure.c: the timing primitives (see measure.h).
 */
#include "measure.h"

#include <stdlib.h>
#include <time.h>

#include "alloc.h"
#include "pager/pool_internal.h"
#include "pager/reservation.h"

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

int kvp_measure_shuffle_pool(kvp_pool *pool, uint64_t *state)
{
    size_t total = pool->total_pages;
    if (pool->free_count != total || total == 0) {
        return -1;
    }
    uint32_t *entries = kvp_cli_alloc(total, sizeof *entries);
    if (entries == NULL) {
        return -1;
    }
    kvpi_reservation all;
    kvpi_reservation_init(&all, pool, entries, total);
    if (kvpi_reservation_fill(&all, total, NULL) != KVP_OK) {
        kvp_cli_free(entries);
        return -1;
    }
    for (size_t i = total - 1; i > 0; i--) {
        size_t j = (size_t)((kvp_measure_unit(state) + 1.0) / 2.0 * (double)(i + 1)) % (i + 1);
        uint32_t t = entries[i];
        entries[i] = entries[j];
        entries[j] = t;
    }
    kvpi_reservation_release(&all);
    kvp_cli_free(entries);
    return 0;
}
