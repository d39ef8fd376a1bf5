/*
 * fuzz_paged_attention.c: kvp_paged_attention in the typed sub-world of the
 * kvp_fuzz_api target (fuzz_paged.h): on external and layer-bound caches of
 * every dtype, at both accumulation levels, f64 and f32 io, H any multiple
 * of H_kv, with and without candidate rows, and each refusal of paged.h in
 * its order.
 *
 * Owns: the shadow's f64 attention over its own copy of the stored rows and
 * the checks of one call: the exact status and detail; a refusal writes no
 * output and changes no digest or counter; a success gives finite outputs
 * within the level's tolerance of the shadow (1e-10 of sum w|v| exact,
 * 1e-3 fast, plus f32 io's rounding; only determinism when an element
 * beyond 16 makes the f64 scores' own rounding swing the weights), and the
 * same bits again on the calling thread, on the world's decoder and on an
 * external twin cache holding the same stored elements.
 * Called only by fuzz_paged.c's dispatch.
 */
#include <math.h>
#include <string.h>

#include "fuzz_paged.h"

#define P pz_world

/* ---- kvp_paged_attention --------------------------------------------------- */

typedef struct pa_call {
    size_t heads, keys;
    int f32, candidate;
    double scale;
    kvp_accum accum;
    double q[P_OUT], ck[P_ELEMS], cv[P_ELEMS]; /* widened */
} pa_call;

/* The shadow's attention in f64; returns the first nonfinite score or SIZE_MAX. */
static size_t pa_shadow(const pcache *c, const pa_call *a, double *out, double *mass, int *big)
{
    size_t g = a->heads / P.hkv;
    double scale = a->scale == 0.0 ? 1.0 / sqrt((double)P.dh) : a->scale;
    size_t first = SIZE_MAX;
    *big = 0;
    for (size_t b = 0; b < c->batch; b++) {
        for (size_t h = 0; h < a->heads; h++) {
            size_t kh = h / g;
            const double *q = &a->q[(b * a->heads + h) * P.dh];
            double s[P_MAX_CAP + 1], w[P_MAX_CAP + 1];
            const double *vrow[P_MAX_CAP + 1];
            double cand_k[P_MAX_DH], cand_v[P_MAX_DH];
            double mx = -INFINITY;
            for (size_t p = 0; p < a->keys; p++) {
                const double *k = c->k[b][kh][p];
                vrow[p] = c->v[b][kh][p];
                if (p == c->len) {
                    for (size_t f = 0; f < P.dh; f++) {
                        size_t i = (b * P.hkv + kh) * P.dh + f;
                        cand_k[f] = pz_store(P.dtype, c->ks, a->ck[i]);
                        cand_v[f] = pz_store(P.dtype, c->vs, a->cv[i]);
                    }
                    k = cand_k;
                    vrow[p] = cand_v;
                }
                double dot = 0.0;
                for (size_t f = 0; f < P.dh; f++) {
                    dot += q[f] * k[f];
                    *big |= fabs(k[f]) > 16.0 || fabs(vrow[p][f]) > 16.0;
                }
                s[p] = dot * scale;
                if (!isfinite(s[p]) && first == SIZE_MAX) {
                    first = (b * a->heads + h) * a->keys + p;
                }
                mx = s[p] > mx ? s[p] : mx;
            }
            double sum = 0.0;
            for (size_t p = 0; p < a->keys; p++) {
                w[p] = exp(s[p] - mx);
                sum += w[p];
            }
            for (size_t f = 0; f < P.dh; f++) {
                double o = 0.0, m = 0.0;
                for (size_t p = 0; p < a->keys; p++) {
                    o += w[p] / sum * vrow[p][f];
                    m += w[p] / sum * fabs(vrow[p][f]);
                }
                out[(b * a->heads + h) * P.dh + f] = o;
                mass[(b * a->heads + h) * P.dh + f] = m;
            }
        }
    }
    return first;
}

static void pa_read(const pa_call *a, const unsigned char *buf, size_t n, double *out)
{
    for (size_t i = 0; i < n; i++) {
        if (a->f32) {
            float f;
            memcpy(&f, buf + i * sizeof f, sizeof f);
            out[i] = f;
        } else {
            memcpy(&out[i], buf + i * sizeof(double), sizeof(double));
        }
    }
}

static void pa_encode(int f32, const double *x, size_t n, unsigned char *buf)
{
    pz_encode(f32 ? KVP_F32 : KVP_F64, x, n, buf);
}

/* One call: its arguments, their buffers and what the shadow expects. */
typedef struct pa_op {
    pa_call a;
    kvp_paged_attention_args args;
    size_t nq, nc;
    unsigned char qb[P_OUT * 8], kb[P_ELEMS * 8], vb[P_ELEMS * 8];
    unsigned char out[P_OUT * 8], untouched[P_OUT * 8];
    kvp_status want;
    const char *argument;
    size_t index;
    double value;
    double ref[P_OUT], mass[P_OUT];
    int big;
} pa_op;

/* The call sel asks for, on inputs qd, kd, vd (widened as the library will). */
static void pa_build(pa_op *o, const pcache *c, uint8_t sel, double *qd, const double *kd,
                     const double *vd)
{
    pa_call *a = &o->a;
    static const size_t mult[] = {0, 2, 3, 1};
    size_t heads_arg = P.hkv * mult[sel % 4]; /* 0: the binding's heads */
    a->heads = heads_arg == 0 ? (c->bound ? P.heads : P.hkv) : heads_arg;
    a->f32 = (sel >> 2) & 1;
    a->accum = (kvp_accum)((sel >> 3) & 1);
    a->candidate = (sel >> 4) & 1;
    static const double scales[] = {0.0, 0.5, 1.0, 0.125};
    a->scale = scales[(sel >> 5) % 4];
    a->keys = c->len + (size_t)a->candidate;
    o->nq = c->batch * a->heads * P.dh;
    o->nc = c->batch * P.hkv * P.dh;
    /* queries: moderate, or now and then a NaN or an infinity (never a huge finite value) */
    for (size_t i = 0; i < o->nq; i++) {
        if (isfinite(qd[i]) && fabs(qd[i]) > 2.0) {
            qd[i] = 0.25;
        }
    }
    pa_encode(a->f32, qd, o->nq, o->qb);
    pa_encode(a->f32, kd, o->nc, o->kb);
    pa_encode(a->f32, vd, o->nc, o->vb);
    pa_read(a, o->qb, o->nq, a->q);
    pa_read(a, o->kb, o->nc, a->ck);
    pa_read(a, o->vb, o->nc, a->cv);
    kvp_paged_attention_args *args = &o->args;
    kvp_paged_attention_args_init(args);
    args->cache = c->cache;
    args->heads = heads_arg;
    args->io_dtype = a->f32 ? KVP_F32 : KVP_F64;
    args->queries = o->qb;
    args->keys = a->candidate ? o->kb : NULL;
    args->values = a->candidate ? o->vb : NULL;
    args->scale = a->scale;
    args->accum = a->accum;
    memset(o->out, 0xA7, sizeof o->out);
    memcpy(o->untouched, o->out, sizeof o->out);
    args->outputs = o->out;
}

/* At most one fault (1-8), in paged.h's order of checks. */
static void pa_fault(pa_op *o, int fault)
{
    kvp_paged_attention_args *args = &o->args;
    static const char *const names[] = {NULL,    "heads", "io_dtype", "accum", NULL,
                                        "scale", "scale", "queries",  "outputs"};
    if (fault == 0 || (fault == 1 && P.hkv == 1)) {
        return; /* every H is a multiple of one KV head */
    }
    o->want = fault >= 7 ? KVP_NULL_ARGUMENT : KVP_INVALID_ARGUMENT;
    o->argument = names[fault];
    if (fault == 1) {
        args->heads = P.hkv * 2 + 1;
    } else if (fault == 2) {
        args->io_dtype = KVP_BF16;
    } else if (fault == 3) {
        args->accum = (kvp_accum)7;
    } else if (fault == 4) {
        args->values = args->keys == NULL ? o->vb : NULL; /* "keys" or "values" */
    } else if (fault == 5 || fault == 6) {
        args->scale = fault == 5 ? -0.5 : NAN;
    } else if (fault == 7) {
        args->queries = NULL;
    } else {
        args->outputs = NULL;
    }
}

/* The status of a call without a fault: empty, candidate rows, scores. */
static void pa_expect(pa_op *o, const pcache *c)
{
    if (o->want != KVP_OK) {
        return;
    }
    if (o->a.keys == 0) {
        o->want = KVP_INVALID_ARGUMENT;
        o->argument = "keys";
        return;
    }
    if (o->a.candidate) {
        o->want = pz_nonfinite_rows(c, o->a.ck, o->a.cv, o->nc, &o->index, &o->value);
        if (o->want != KVP_OK) {
            return;
        }
    }
    size_t first = pa_shadow(c, &o->a, o->ref, o->mass, &o->big);
    if (o->big && o->a.accum == KVP_ACCUM_FAST && P.dtype != KVP_F64) {
        /* f32 accumulation of elements beyond 16 may overflow: not predicted */
        o->a.accum = o->args.accum = KVP_ACCUM_EXACT;
    }
    if (first != SIZE_MAX) {
        o->want = KVP_NONFINITE_SCORE;
        o->index = first;
    }
}

static void pa_check_refusal(const pa_op *o, kvp_status status, const kvp_error *err)
{
    CHECK(memcmp(o->out, o->untouched, sizeof o->out) == 0,
          "a refused paged_attention wrote outputs");
    if (o->argument != NULL) {
        CHECK(err->argument != NULL && strcmp(err->argument, o->argument) == 0,
              "paged_attention: argument %s, expected %s",
              err->argument ? err->argument : "NULL", o->argument);
    }
    if (status == KVP_NONFINITE_KEY || status == KVP_NONFINITE_VALUE) {
        pz_nonfinite_detail(err, o->index, o->value);
    } else if (status == KVP_NONFINITE_SCORE) {
        CHECK(err->index == o->index, "nonfinite score at %zu, expected %zu", err->index,
              o->index);
    }
}

/* Outputs against the shadow, then the same bits twice more (one on the decoder). */
static void pa_check_success(pa_op *o)
{
    const pa_call *a = &o->a;
    double got[P_OUT];
    pa_read(a, o->out, o->nq, got);
    int fast = a->accum == KVP_ACCUM_FAST && P.dtype != KVP_F64;
    for (size_t i = 0; i < o->nq && !o->big; i++) {
        /* Elements beyond 16 (planted 500 to 1e39) make the f64 scores' own
         * rounding (ulps of 1e23) swing the weights: only determinism is
         * checked then, and an f32 output may round to infinity. */
        /* plus, fast, f32's subnormal spacing 2^-149 per accumulation step */
        double tol = (fast ? 1e-3 : 1e-10) * o->mass[i] +
                     (a->f32 ? 1.2e-7 * fabs(o->ref[i]) + 0x1p-149 : 0.0) +
                     (fast ? 0x1p-149 * 4.0 * (double)(a->keys + 1) : 0.0) + 1e-300;
        CHECK(isfinite(got[i]) && fabs(got[i] - o->ref[i]) <= tol,
              "paged_attention (%s, %s, %s io, heads %zu of %zu kv, %zu keys) output %zu: %a, "
              "shadow %a (tolerance %g)",
              pz_dtype_name(P.dtype), fast ? "fast" : "exact", a->f32 ? "f32" : "f64", a->heads,
              P.hkv, a->keys, i, got[i], o->ref[i], tol);
    }
    unsigned char again[P_OUT * 8];
    kvp_paged_attention_args args = o->args;
    args.outputs = again;
    size_t bytes = o->nq * (a->f32 ? sizeof(float) : sizeof(double));
    kvp_error err;
    fz_check_status(kvp_paged_attention(&args, NULL, &err), KVP_OK, &err);
    CHECK(memcmp(again, o->out, bytes) == 0, "paged_attention twice: other bits");
    memset(again, 0xA7, sizeof again);
    fz_check_status(kvp_paged_attention(&args, fz_decoder(), &err), KVP_OK, &err);
    CHECK(memcmp(again, o->out, bytes) == 0, "paged_attention on the decoder: other bits");
}

/*
 * The same call on a twin: an external cache on the same pool holding the
 * cache's rows, appended as the f64 values it exports (each rounds back to
 * the stored element), with its K/V scales. Same elements, other pages (and
 * an external binding where c is bound): the same bits. Skipped when the
 * pool lacks the pages. Called after the refusal checks: the twin's pages
 * move the pool's acquire and release counters.
 */
static void pa_twin(const pa_op *o, const pcache *c)
{
    size_t pages = c->batch * ((c->len + P.bt - 1) / P.bt);
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvp_error err;
    fz_check_status(kvp_pool_stats_get(P.pool, &stats, &err), KVP_OK, &err);
    if (pages > stats.free_pages) {
        return;
    }
    kvp_binding binding;
    fz_check_status(kvp_binding_init_external(&binding, P.hkv, P.dh, P_MAX_CAP, 777, 1, &err),
                    KVP_OK, &err);
    binding.k_scale = c->ks;
    binding.v_scale = c->vs;
    kvp_cache *twin;
    fz_check_status(kvp_cache_create(P.pool, &binding, c->batch, c->cap, &twin, &err), KVP_OK,
                    &err);
    size_t n = c->batch * P.hkv * c->len * P.dh;
    double k[P_ELEMS], v[P_ELEMS];
    fz_check_status(kvp_cache_keys(c->cache, k, n, &err), KVP_OK, &err);
    fz_check_status(kvp_cache_values(c->cache, v, n, &err), KVP_OK, &err);
    fz_check_status(kvp_cache_append_rows(twin, k, v, c->len, &err), KVP_OK, &err);
    kvp_paged_attention_args args = o->args;
    args.cache = twin;
    args.heads = o->a.heads;
    unsigned char out[P_OUT * 8];
    args.outputs = out;
    fz_check_status(kvp_paged_attention(&args, NULL, &err), KVP_OK, &err);
    size_t bytes = o->nq * (o->a.f32 ? sizeof(float) : sizeof(double));
    CHECK(memcmp(out, o->out, bytes) == 0,
          "paged_attention on a twin external cache (same elements): other bits");
    fz_check_status(kvp_cache_destroy(twin, &err), KVP_OK, &err);
}

void pz_attend(reader *r, pcache *c)
{
    uint8_t sel = fz_rd(r), fault_byte = fz_rd(r);
    double qd[P_OUT], kd[P_ELEMS], vd[P_ELEMS];
    pz_values(r, qd, P_OUT);
    pz_values(r, kd, P_ELEMS);
    pz_values(r, vd, P_ELEMS);
    if (!c->live) {
        return;
    }
    fz_set_op("paged_attention");
    static pa_op o; /* large: kept off the fuzzer's stack */
    memset(&o, 0, sizeof o);
    pa_build(&o, c, sel, qd, kd, vd);
    pa_fault(&o, fault_byte >= 224 ? 1 + fault_byte % 8 : 0);
    pa_expect(&o, c);
    pz_snapshot before;
    pz_snap(&before);
    kvp_error err;
    kvp_status status = kvp_paged_attention(&o.args, NULL, &err);
    fz_check_status(status, o.want, &err);
    pz_unchanged(&before, 0);
    if (status != KVP_OK) {
        pa_check_refusal(&o, status, &err);
        return;
    }
    pa_check_success(&o);
    pz_unchanged(&before, 0);
    pa_twin(&o, c);
}
