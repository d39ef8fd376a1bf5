/*
 * latency.h: per-request latency of a simulate run, as percentiles
 * (vLLM's `bench serve` figures), from the run's request log and step
 * record (sim.h).
 *
 * Owns: the definitions and the percentile rule. For a request submitted
 * before step index s, first admitted in step a, whose first token was
 * decoded in step f and which finished in step e (scheduler step indexes;
 * clock(k) is step k's number on the run's clock, start(k) and end(k) its
 * wall-clock timestamps), with n output tokens:
 *   queueing            clock(a) - clock(s) steps; start(a) - start(s) s
 *   time to first token clock(f) - clock(s) + 1 steps; end(f) - start(s) s
 *   end to end          clock(e) - clock(s) + 1 steps; end(e) - start(s) s
 *   time per output token (end to end - time to first token) / (n - 1),
 *                       requests with n >= 2 only (as vLLM)
 *   recomputed tokens   tokens prefilled again after preemption
 * over the completed requests (rejected ones have no schedule).
 * Percentile rule: nearest rank. The p-th percentile of n sorted values
 * v[1..n] is v[ceil(p / 100 x n)] (rank at least 1): always one of the
 * values, never an interpolation; NaN when n is 0.
 * Callers: simulate_report.c, the CLI's tests.
 * Threads: none kept; each call owns what it allocates.
 */
#ifndef KVPAGER_CLI_LATENCY_H
#define KVPAGER_CLI_LATENCY_H

#include <stddef.h>

#include "sim.h"

typedef struct kvp_latency_stat {
    size_t count; /* values the percentiles are over */
    double p50;
    double p90;
    double p99;
} kvp_latency_stat;

typedef struct kvp_latency {
    kvp_latency_stat queue_steps;
    kvp_latency_stat ttft_steps;
    kvp_latency_stat tpot_steps;
    kvp_latency_stat e2e_steps;
    kvp_latency_stat recomputed_tokens;
    kvp_latency_stat queue_seconds;
    kvp_latency_stat ttft_seconds;
    kvp_latency_stat tpot_seconds;
    kvp_latency_stat e2e_seconds;
} kvp_latency;

/* The nearest-rank percentile (1 to 100) of sorted[0..n); NaN when n is 0. */
double kvp_percentile_nearest_rank(const double *sorted, size_t n, unsigned percent);

/* Sorts values[0..n) and fills *out with their count and percentiles. */
void kvp_latency_stat_of(double *values, size_t n, kvp_latency_stat *out);

/* Every figure of `r` (its request_log and samples). 0, or -1 when out of memory
 * (through alloc.h; *out untouched). */
int kvp_latency_compute(const kvp_sim_result *r, kvp_latency *out);

#endif /* KVPAGER_CLI_LATENCY_H */
