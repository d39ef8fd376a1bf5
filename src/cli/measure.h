/*
 * measure.h: the timing primitives of `kvpager bench` (bench.c) and the
 * bench-gather program (bench/gather.c), kept in one place so both measure
 * the same way.
 *
 * Owns: a monotonic clock in nanoseconds, the median, alternating
 * repetitions of several cases, a deterministic uniform generator, and a
 * fragmented free list (a pool whose pages are handed out in shuffled order),
 * and its opposite (each lane's pages adjacent, in lane order).
 * Method: each case is calibrated on its own (its iteration count doubles
 * until one repetition lasts at least min_ns; the calibration runs are the
 * warm-up), then the cases run one after another, repetition after
 * repetition, so a slow phase of a shared machine hits every case alike.
 * The figure of a case is the median over the repetitions of ns per
 * iteration. Ratios are only ever taken between cases of one call.
 * Callers: src/cli/bench.c and bench/ (through the kvpager_cli library).
 * Scratch memory comes from the program's allocation hook (alloc.h).
 */
#ifndef KVPAGER_CLI_MEASURE_H
#define KVPAGER_CLI_MEASURE_H

#include <stddef.h>
#include <stdint.h>

#include "kvpager/pool.h"

/* Runs the measured operation `iterations` times. */
typedef void (*kvp_measure_fn)(void *ctx, size_t iterations);

typedef struct kvp_measure_case {
    kvp_measure_fn run;
    void *ctx;
} kvp_measure_case;

/* CLOCK_MONOTONIC in nanoseconds. */
double kvp_measure_now_ns(void);

/* The median of values[0..n) (n >= 1): sorts them in place, returns values[n / 2]. */
double kvp_measure_median(double *values, size_t n);

/*
 * Times `count` cases in `repetitions` (>= 1) alternating rounds, as above;
 * writes the median ns per iteration of case i to median_ns[i]. Returns 0, or
 * -1 when the scratch memory cannot be had (then nothing ran).
 */
int kvp_measure_alternating(const kvp_measure_case *cases, size_t count, size_t repetitions,
                            double min_ns, double *median_ns);

/* The next value of a splitmix64 stream, uniform on [-1, 1). */
double kvp_measure_unit(uint64_t *state);

/*
 * Takes every free page of `pool`, shuffles their order with `state`, and
 * gives them back: later acquisitions get scattered pages, as in a pool that
 * has served many sequences. Through the public API only: one external
 * cache per page, destroyed in the shuffled order. Returns 0, or -1 when out
 * of memory or when the pool has pages held (then the free list's order is
 * as it was; acquires and releases have counted the pages taken back).
 */
int kvp_measure_shuffle_pool(kvp_pool *pool, uint64_t *state);

/*
 * Puts the free list of a fresh `pool` (no page ever held, so pages come in
 * address order) in the order that makes a cache of `lanes` lanes, appended
 * block by block (lane by lane within a block, as appends take pages), get
 * each lane's `blocks` pages adjacent and ascending in memory: the paged
 * layout read in the same order as the paged one, but contiguous. Through
 * the public API only. Returns 0, or -1 as kvp_measure_shuffle_pool (also
 * when the pool has fewer than lanes * blocks pages); on -1 after the caches
 * were made, the free list is in address order.
 */
int kvp_measure_lane_major_pool(kvp_pool *pool, size_t lanes, size_t blocks);

#endif /* KVPAGER_CLI_MEASURE_H */
