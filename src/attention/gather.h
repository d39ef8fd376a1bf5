/*
 * gather.h: the page-walking loops of incremental attention, and their exact
 * partition into parts that threads may run (see gather.c).
 * Callers: src/attention, and bench/ and src/cli (to time the real loops).
 */
#ifndef KVPAGER_ATTENTION_GATHER_H
#define KVPAGER_ATTENTION_GATHER_H

#include <stddef.h>

#include "attention/kernels.h"
#include "attention/parallel.h"
#include "kvpager/attention.h"
#include "pager/cache_internal.h"

/*
 * dot_rows over `rows` stored rows of `dtype` at `keys` (d_h apart), any
 * dtype (dot_group for one head: the same bits). fp8 elements only: the
 * caller multiplies scale by the cache's k_scale.
 */
static inline void kvpi_dot_stored_rows(const kvpi_kernels *k, kvp_dtype dtype, const double *q,
                                        const void *keys, size_t rows, size_t d, double scale,
                                        double *out)
{
    k->dot_group((kvpi_rows)dtype, q, 1, keys, d, rows, d, scale, out, 0, NULL);
}

/*
 * axpy_rows over features [f0, f0 + n) of `rows` stored rows (d_h apart) of
 * `dtype` starting at `values`; acc points at feature f0. fp8 elements only:
 * the caller multiplies the sum by the cache's v_scale.
 */
static inline void kvpi_axpy_stored_rows(const kvpi_kernels *k, kvp_dtype dtype, double *acc,
                                         const double *weights, const void *values, size_t rows,
                                         size_t d, size_t f0, size_t n)
{
    k->axpy_group((kvpi_rows)dtype, acc, 0, weights, 0, 1, (const unsigned char *)values +
                  f0 * kvpi_rows_bytes((kvpi_rows)dtype), d, rows, n, NULL);
}

/*
 * Scores of every query head of `lane`, [H][keys]: (query_h . key_p) *
 * scale for the retained keys of KV head h / (H / H_kv) the cache's window
 * attends to (all len without a window), then for its candidate key; keys
 * is kvpi_gather_job_keys of a job with a candidate. queries are [H][d_h] and candidates [H_kv][d_h], the lane's
 * slices of the ticket's rows; H is kvpi_cache_query_heads(cache), H_kv cache->heads.
 */
void kvpi_gather_scores(const kvp_cache *cache, const double *queries, const double *candidates,
                        size_t lane, double scale, double *scores);

/*
 * Head outputs of `lane`, [H][d_h]: for each query head the sum over
 * attended positions of weights[h][i] * value of its KV head, the retained
 * values first (in kvpi_gather_scores' order), then the candidate's
 * ([H_kv][d_h]) with the row's last weight. weights is [H][keys] as above.
 */
void kvpi_gather_values(const kvp_cache *cache, const double *weights, const double *candidates,
                        size_t lane, double *outputs);

/*
 * One decode step's attention over every lane of a cache, as three phases of
 * independent parts (gather.c): scores by position chunks, the softmax by
 * rows, the value mixture by runs of KV heads and feature slices. Every phase gives
 * the bits of the serial loops above (and of kvpi_softmax per row) whatever
 * executor runs it, with any number of threads.
 */
typedef struct kvpi_gather_job {
    const kvp_cache *cache;
    const double *queries;    /* [B][H][d_h], rotated */
    const double *keys;       /* [B][H_kv][d_h]: the candidate keys, rounded to the dtype
                                 (for fp8 pages: the e4m3 elements, unscaled, like the
                                 pages); NULL: no candidate row (values NULL too) */
    const double *values;     /* [B][H_kv][d_h]: the candidate values, likewise */
    double scale;             /* 1 / sqrt(d_h) for a layer */
    double *weights;          /* [B][H][keys]: scores, then the softmax in place; keys is
                                 kvpi_gather_job_keys: without a window len + 1 with a
                                 candidate, len without (at least 1); with one (the
                                 cache's binding: kvpi_cache_window) the attended
                                 positions, sinks then window, then the candidate.
                                 At the fast level (kvpi_gather_job_fast) the phases keep
                                 f32 scores in base 2 and f32 weights there instead, packed
                                 [B][H][keys] floats from its start (docs/DESIGN.md,
                                 Accumulation levels): half the buffer is used */
    double *outputs;          /* [B][H][d_h]: the head outputs */
    size_t heads;             /* H, query heads, a multiple of the cache's KV heads;
                                 0: the binding's heads */
    kvp_accum accum;          /* the accumulation level (kvpager/attention.h); FAST
                                 reads narrow pages in f32 (docs/DESIGN.md, Accumulation
                                 levels), f64 pages stay exact */
} kvpi_gather_job;

/*
 * The grain of the partition; gather.c gives the defaults. A test hook: the
 * parts change with it, the bits never do. set(NULL) restores the defaults.
 * Global state: call only while no attention runs (before a decoder step).
 */
typedef struct kvpi_gather_grain {
    size_t chunk_bytes;        /* keys per scores part, in whole blocks (at least one) */
    size_t min_parallel_bytes; /* below this many bytes of keys, phases run serially */
    size_t softmax_elements;   /* softmax elements per part, in whole rows */
    size_t value_units;        /* about this many value parts in all lanes (heads, then slices) */
} kvpi_gather_grain;
void kvpi_gather_grain_set(const kvpi_gather_grain *grain);
kvpi_gather_grain kvpi_gather_grain_get(void);

/* Each phase's number of parts: a function of the cache's shape only. */
size_t kvpi_gather_score_parts(const kvp_cache *cache);
size_t kvpi_gather_softmax_parts(const kvp_cache *cache);
size_t kvpi_gather_value_parts(const kvp_cache *cache);

/*
 * The phases, on `par` (NULL: this thread). A cache too small to be worth
 * the hand-off runs on this thread whatever par is. The softmax needs finite
 * scores (incremental.c checks them in between).
 */
void kvpi_gather_scores_on(const kvpi_gather_job *job, const kvpi_parallel *par);
void kvpi_gather_softmax_on(const kvpi_gather_job *job, const kvpi_parallel *par);
void kvpi_gather_values_on(const kvpi_gather_job *job, const kvpi_parallel *par);

/*
 * Scores (weights) per (lane, query head) row of the job: the retained
 * positions its cache's window attends to (every one without a window;
 * docs/DESIGN.md, Sliding windows and sinks), plus the candidate if any.
 */
size_t kvpi_gather_job_keys(const kvpi_gather_job *job);

/* 1 if the job runs the fast level: its weights buffer then holds f32 (above). */
int kvpi_gather_job_fast(const kvpi_gather_job *job);

/*
 * After the values phase: a fast job's f32 weights widened in place to the
 * f64 [B][H][keys] layout (exact), so a ticket's result reads them as at the
 * exact level. Nothing for an exact job.
 */
void kvpi_gather_widen_weights(const kvpi_gather_job *job);

/*
 * After the scores phase: KVP_OK if every score is finite, else
 * KVP_NONFINITE_SCORE ("score", the first index and its value) in err. Reads
 * the scores in the job's type (f32 at the fast level).
 */
kvp_status kvpi_gather_check_scores(const kvpi_gather_job *job, kvp_error *err);

/*
 * The three phases in turn, without incremental.c's finite checks: what a
 * step's attention reads and computes, for benchmarks (finite inputs).
 */
void kvpi_gather_attend_on(const kvpi_gather_job *job, const kvpi_parallel *par);

#endif /* KVPAGER_ATTENTION_GATHER_H */
