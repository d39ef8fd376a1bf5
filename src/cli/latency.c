/*
 * latency.c: the per-request latency percentiles of a simulate run
 * (latency.h has the definitions and the nearest-rank rule).
 * Invariants: reads the result only; one scratch array, freed before
 * returning. Callers: simulate_report.c, the CLI's tests.
 */
#include "latency.h"

#include <math.h>
#include <stdlib.h>

#include "alloc.h"

double kvp_percentile_nearest_rank(const double *sorted, size_t n, unsigned percent)
{
    if (n == 0) {
        return NAN;
    }
    size_t rank = ((size_t)percent * n + 99) / 100; /* ceil(percent x n / 100), in integers */
    rank = rank < 1 ? 1 : rank > n ? n : rank;
    return sorted[rank - 1];
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a;
    double y = *(const double *)b;
    return (x > y) - (x < y);
}

void kvp_latency_stat_of(double *values, size_t n, kvp_latency_stat *out)
{
    qsort(values, n, sizeof *values, by_value);
    out->count = n;
    out->p50 = kvp_percentile_nearest_rank(values, n, 50);
    out->p90 = kvp_percentile_nearest_rank(values, n, 90);
    out->p99 = kvp_percentile_nearest_rank(values, n, 99);
}

/* Which figure one pass collects. */
typedef enum figure {
    QUEUE_STEPS, TTFT_STEPS, TPOT_STEPS, E2E_STEPS, RECOMPUTED,
    QUEUE_SECONDS, TTFT_SECONDS, TPOT_SECONDS, E2E_SECONDS, FIGURES
} figure;

/* Figure `f` of request q into *v: 1, or 0 when q has none. */
static int value_of(const kvp_sim_result *r, const kvp_sim_request *q, figure f, double *v)
{
    if (!q->finished || q->rejected || q->admissions == 0) {
        return 0;
    }
    const kvp_sim_sample *s = &r->samples[q->submit_step];
    const kvp_sim_sample *a = &r->samples[q->admitted_step];
    const kvp_sim_sample *t = &r->samples[q->first_token_step];
    const kvp_sim_sample *e = &r->samples[q->finished_step];
    double ttft_steps = (double)(t->clock - s->clock + 1);
    double e2e_steps = (double)(e->clock - s->clock + 1);
    double per = q->output_tokens >= 2 ? (double)(q->output_tokens - 1) : NAN;
    switch (f) {
    case QUEUE_STEPS: *v = (double)(a->clock - s->clock); break;
    case TTFT_STEPS: *v = ttft_steps; break;
    case TPOT_STEPS: *v = (e2e_steps - ttft_steps) / per; break;
    case E2E_STEPS: *v = e2e_steps; break;
    case RECOMPUTED: *v = (double)q->recomputed_tokens; break;
    case QUEUE_SECONDS: *v = a->start_seconds - s->start_seconds; break;
    case TTFT_SECONDS: *v = t->end_seconds - s->start_seconds; break;
    case TPOT_SECONDS: *v = (e->end_seconds - t->end_seconds) / per; break;
    default: *v = e->end_seconds - s->start_seconds; break;
    }
    return !isnan(*v);
}

int kvp_latency_compute(const kvp_sim_result *r, kvp_latency *out)
{
    double *values = kvp_cli_alloc(r->requests > 0 ? r->requests : 1, sizeof *values);
    if (values == NULL) {
        return -1;
    }
    kvp_latency_stat *stats[FIGURES] = {
        &out->queue_steps,   &out->ttft_steps,   &out->tpot_steps,
        &out->e2e_steps,     &out->recomputed_tokens, &out->queue_seconds,
        &out->ttft_seconds,  &out->tpot_seconds, &out->e2e_seconds};
    for (int f = 0; f < FIGURES; f++) {
        size_t n = 0;
        for (size_t i = 0; r->request_log != NULL && i < r->requests; i++) {
            n += (size_t)value_of(r, &r->request_log[i], (figure)f, &values[n]);
        }
        kvp_latency_stat_of(values, n, stats[f]);
    }
    kvp_cli_free(values);
    return 0;
}
