/*
 * fuzz_paged.h: the typed sub-world's shadow, shared by fuzz_paged.c (the
 * pool, its caches, the write paths, the checks) and fuzz_paged_attention.c
 * (kvp_paged_attention). Internal to tests/fuzz.
 */
#ifndef KVP_FUZZ_PAGED_H
#define KVP_FUZZ_PAGED_H

#include "fuzz_common.h"

#define P_MAX_B 2
#define P_MAX_HKV 2
#define P_MAX_H 8
#define P_MAX_DH 4
#define P_MAX_CAP 8
#define P_CACHES 3
#define P_ELEMS (P_MAX_B * P_MAX_HKV * P_MAX_CAP * P_MAX_DH)
#define P_OUT (P_MAX_B * P_MAX_H * P_MAX_DH)

typedef struct pcache {
    kvp_cache *cache;
    int live;
    int bound;
    size_t batch, cap, len, reserved;
    size_t written; /* reserved rows 0..written-1 were written in place */
    double ks, vs;  /* the scales the cache uses (1 unless fp8 and set) */
    double lks, lvs; /* a bound cache: the layer's scales when it was created */
    /* exported values (e * scale for fp8): committed rows, then the
     * reservation's rows written in place */
    double k[P_MAX_B][P_MAX_HKV][P_MAX_CAP][P_MAX_DH];
    double v[P_MAX_B][P_MAX_HKV][P_MAX_CAP][P_MAX_DH];
    double pk[P_MAX_B][P_MAX_HKV][P_MAX_CAP][P_MAX_DH];
    double pv[P_MAX_B][P_MAX_HKV][P_MAX_CAP][P_MAX_DH];
    /* a NaN written in place: reserved row poison_row (SIZE_MAX: none) */
    size_t poison_row, poison_b, poison_h, poison_f;
    int poison_value;
} pcache;

typedef struct pz_world_t {
    int live;
    kvp_pool *pool;
    kvp_dtype dtype;
    size_t hkv, heads, dh, bt, total;
    kvp_layer *layer;
    double ks, vs; /* the layer's scales */
    pcache c[P_CACHES];
    uint64_t exhaustions;
    uint64_t next_identity;
} pz_world_t;

extern pz_world_t pz_world;

/* Everything a refusal must leave as it was. */
typedef struct pz_snapshot {
    uint64_t digest[P_CACHES];
    kvp_pool_stats stats;
} pz_snapshot;

/* fuzz_paged_dtype.c: the element dtype stores for x (fp8: for x / scale). */
double pz_round(kvp_dtype dt, double x);
/* 1 when the finite x cannot be stored (pool.h's thresholds; fp8: x / scale). */
int pz_overflows(kvp_dtype dt, double scale, double x);
/* x given as a source row element of src (f64, f32, bf16, f16), widened. */
double pz_widened(kvp_dtype src, double x);
/* One element at `at` in the page's format: x (storable) or a NaN. */
void pz_page_write(kvp_dtype dt, double scale, unsigned char *at, double x, int nan);
/* The element an export gives for x stored: rounded to the dtype (fp8: x / scale, times scale). */
double pz_store(kvp_dtype dt, double scale, double x);
const char *pz_dtype_name(kvp_dtype dt);
/* x[0..n) as src elements (f64, f32, bf16 or f16 bits). */
void pz_encode(kvp_dtype src, const double *x, size_t n, void *out);
/* n values from the input: moderate, or one planted NaN, infinity or big value. */
void pz_values(reader *r, double *out, size_t n);
void pz_snap(pz_snapshot *out);
/* Fails unless every digest and counter is as in *before (exhausted: +1 exhaustion). */
void pz_unchanged(const pz_snapshot *before, int exhausted);
/* NONFINITE_KEY / NONFINITE_VALUE of rows as the cache would store them, or OK. */
kvp_status pz_nonfinite_rows(const pcache *c, const double *k, const double *v, size_t n,
                             size_t *index, double *value);
void pz_nonfinite_detail(const kvp_error *err, size_t index, double value);
/* fuzz_paged_attention.c: one kvp_paged_attention operation. */
void pz_attend(reader *r, pcache *c);

#endif /* KVP_FUZZ_PAGED_H */
