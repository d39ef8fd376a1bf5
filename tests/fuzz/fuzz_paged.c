/*
 * fuzz_paged.c: the typed sub-world of the kvp_fuzz_api target -- a second
 * pool in any page dtype (f64, f32, bf16, f16, fp8 e4m3), its external and
 * layer-bound caches, the typed write paths and kvp_paged_attention -- with
 * its own shadow. fuzz_api.c reaches it through one operation byte
 * (op_paged) and sets it up and tears it down with every input
 * (fuzz_common.h).
 *
 * Owns: the sub-world P: one pool (created by the first paged operation and
 * replaced by a "pool" operation once empty), a grouped layer over it (H
 * query heads over H_kv KV heads, fp8 K/V scales and an accumulation level
 * the input sets), and 3 cache slots, each external (kvp_binding_init_external
 * with K/V scales: 1, powers of two and non-powers) or bound to the layer.
 *
 * The shadow's ground truth is its own: every dtype's rounding is written
 * here from pool.h's description (round once from f64 to p significand bits
 * above the dtype's smallest normal exponent, ties to even; fp8 rounds
 * x / scale and stands for e * scale) and the overflow thresholds pool.h
 * documents; source rows (f32, bf16, f16 bits) and in-place writes (page
 * format) are encoded here too. Nothing from src/ is used.
 *
 * Checked after every operation: the exact status in the headers' order
 * (cache.h, paged.h) with its detail; each cache's len, reserved rows and
 * exported keys and values bit for bit against the shadow's (external
 * caches; a bound cache's rows are read back after each forward and must
 * then never change); the pool's held, free, tentative pages, attached
 * caches and reservations and exhaustions; kvp_pool_check. A refused call
 * changes no digest, no pool counter (but exhaustions) and writes no
 * output. A successful kvp_paged_attention gives finite outputs within the
 * level's tolerance of the shadow's f64 attention, and the same bits again
 * on the calling thread and on the world's decoder.
 *
 * Built only by the `fuzz` preset, into kvp_fuzz_api.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static struct {
    int live;
    kvp_pool *pool;
    kvp_dtype dtype;
    size_t hkv, heads, dh, bt, total;
    kvp_layer *layer;
    double ks, vs; /* the layer's scales */
    pcache c[P_CACHES];
    uint64_t exhaustions;
    uint64_t next_identity;
} P;

static const double g_scales[] = {1.0, 2.0, 0.25, 0.3, 3.7, 0.0 /* = 1 */};

/* ---- the shadow's own dtypes -------------------------------------------- */

/* x rounded once to p significand bits, exponent at least emin, ties to even. */
static double round_bits(double x, int p, int emin)
{
    if (x == 0.0 || !isfinite(x)) {
        return x;
    }
    int e = ilogb(x);
    if (e < emin) {
        e = emin;
    }
    return ldexp(nearbyint(ldexp(x, p - 1 - e)), e - (p - 1));
}

/* The element a dtype stores for x (fp8: for x already divided by its scale). */
static double s_round(kvp_dtype dt, double x)
{
    switch (dt) {
    case KVP_F32:
        return round_bits(x, 24, -126);
    case KVP_BF16:
        return round_bits(x, 8, -126);
    case KVP_F16:
        return round_bits(x, 11, -14);
    case KVP_FP8_E4M3:
        return round_bits(x, 4, -6);
    default:
        return x;
    }
}

/* pool.h's overflow thresholds: 1 when the finite x cannot be stored. */
static int s_overflows(kvp_dtype dt, double scale, double x)
{
    double a = fabs(x);
    switch (dt) {
    case KVP_F32:
        return isfinite(x) && a >= 0x1.ffffffp+127;
    case KVP_BF16:
        return isfinite(x) && a >= 0x1.ffp+127;
    case KVP_F16:
        return isfinite(x) && a >= 65520.0;
    case KVP_FP8_E4M3:
        return isfinite(x) && a / scale > 464.0;
    default:
        return 0;
    }
}

/* What an export gives for x stored: the element, times the scale for fp8. */
static double s_store(kvp_dtype dt, double scale, double x)
{
    if (dt == KVP_FP8_E4M3) {
        return s_round(dt, x / scale) * scale;
    }
    return s_round(dt, x);
}

static const char *s_dtype_name(kvp_dtype dt)
{
    static const char *names[] = {"f64", "f32", "bf16", "f16", "fp8_e4m3"};
    return names[dt];
}

/* ---- encoders (value already on the type's grid, or special) ------------ */

static float enc_f32(double x)
{
    return fabs(x) >= 0x1.ffffffp+127 && isfinite(x) ? (float)copysign(INFINITY, x)
                                                      : (float)round_bits(x, 24, -126);
}

static uint16_t enc_bf16(double x)
{
    if (isnan(x)) {
        return 0x7fc0;
    }
    double r = fabs(x) >= 0x1.ffp+127 ? copysign(INFINITY, x) : round_bits(x, 8, -126);
    float f = (float)r;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)(bits >> 16);
}

static uint16_t enc_f16(double x)
{
    if (isnan(x)) {
        return 0x7e00;
    }
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    double a = fabs(x) >= 65520.0 ? INFINITY : fabs(round_bits(x, 11, -14));
    if (isinf(a)) {
        return sign | 0x7c00;
    }
    if (a >= 0x1p-14) {
        int e = ilogb(a);
        return sign | (uint16_t)((e + 15) << 10) | (uint16_t)(ldexp(a, 10 - e) - 1024.0);
    }
    return sign | (uint16_t)ldexp(a, 24);
}

/* e on the e4m3 grid, |e| <= 448, or NaN (0x7f). */
static uint8_t enc_e4m3(double e)
{
    if (isnan(e)) {
        return 0x7f;
    }
    uint8_t sign = signbit(e) ? 0x80 : 0;
    double a = fabs(e);
    if (a >= 0x1p-6) {
        int x = ilogb(a);
        return sign | (uint8_t)((x + 7) << 3) | (uint8_t)(ldexp(a, 3 - x) - 8.0);
    }
    return sign | (uint8_t)ldexp(a, 9);
}

/* Widened value of x given as a source row of src (f64, f32, bf16, f16). */
static double src_widened(kvp_dtype src, double x)
{
    switch (src) {
    case KVP_F32:
        return (double)enc_f32(x);
    case KVP_BF16: {
        uint32_t bits = (uint32_t)enc_bf16(x) << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return (double)f;
    }
    case KVP_F16:
        return isnan(x) ? NAN : fabs(x) >= 65520.0 ? copysign(INFINITY, x) : round_bits(x, 11, -14);
    default:
        return x;
    }
}

static void src_encode(kvp_dtype src, const double *x, size_t n, void *out)
{
    for (size_t i = 0; i < n; i++) {
        if (src == KVP_F32) {
            ((float *)out)[i] = enc_f32(x[i]);
        } else if (src == KVP_BF16) {
            ((uint16_t *)out)[i] = enc_bf16(x[i]);
        } else if (src == KVP_F16) {
            ((uint16_t *)out)[i] = enc_f16(x[i]);
        } else {
            ((double *)out)[i] = x[i];
        }
    }
}

/* One element in the page's format: x (finite, storable) or a NaN. */
static void page_write(kvp_dtype dt, double scale, unsigned char *at, double x, int nan)
{
    if (dt == KVP_F64) {
        double y = nan ? NAN : x;
        memcpy(at, &y, sizeof y);
    } else if (dt == KVP_F32) {
        float y = nan ? NAN : enc_f32(x);
        memcpy(at, &y, sizeof y);
    } else if (dt == KVP_BF16) {
        uint16_t y = enc_bf16(nan ? NAN : x);
        memcpy(at, &y, sizeof y);
    } else if (dt == KVP_F16) {
        uint16_t y = enc_f16(nan ? NAN : x);
        memcpy(at, &y, sizeof y);
    } else {
        *at = enc_e4m3(nan ? NAN : s_round(dt, x / scale));
    }
}

/* ---- values from the input ---------------------------------------------- */

/* Per dtype a value it cannot hold, or NaN / Inf; or a big value f64 keeps. */
static const double g_big[] = {NAN, INFINITY, -INFINITY, 1e6, 70000.0, 500.0, 1e39, -3e38};

static void p_values(reader *r, double *out, size_t n)
{
    uint64_t state = 0x9a9edull * (uint64_t)(fz_rd(r) + 1);
    for (size_t i = 0; i < n; i++) {
        out[i] = 2.0 * fz_unit(&state);
    }
    uint8_t special = fz_rd(r);
    if (special >= 0xE0 && n != 0) {
        out[fz_rd(r) % n] = g_big[special & 7];
    }
}

/* ---- the pool's counters and the audit ---------------------------------- */

static size_t blocks(size_t tokens)
{
    return (tokens + P.bt - 1) / P.bt;
}

static size_t p_held(void)
{
    size_t held = 0;
    for (int i = 0; i < P_CACHES; i++) {
        const pcache *c = &P.c[i];
        held += c->live ? c->batch * blocks(c->len + c->reserved) : 0;
    }
    return held;
}

static size_t p_free(void)
{
    return P.total - p_held();
}

static void on_mismatch(void *ctx, const kvp_mismatch *m)
{
    (void)ctx;
    fz_fail("typed pool audit: %s (page %zu, lane %zu): expected %zu, actual %zu", m->what,
            m->page, m->lane, m->expected, m->actual);
}

static void p_stats(kvp_pool_stats *s)
{
    kvp_pool_stats_init(s);
    kvp_error err;
    fz_check_status(kvp_pool_stats_get(P.pool, s, &err), KVP_OK, &err);
}

static void p_export(const pcache *c, double *k, double *v)
{
    size_t n = c->batch * P.hkv * c->len * P.dh;
    kvp_error err;
    fz_check_status(kvp_cache_keys(c->cache, k, n, &err), KVP_OK, &err);
    fz_check_status(kvp_cache_values(c->cache, v, n, &err), KVP_OK, &err);
}

static void p_check(void)
{
    fz_set_auditing(1);
    size_t caches = 0, reservations = 0, tentative = 0;
    for (int i = 0; i < P_CACHES; i++) {
        const pcache *c = &P.c[i];
        if (!c->live) {
            continue;
        }
        caches++;
        /* a reservation holding no page (its rows fit the last block) is not attached */
        size_t pending = c->batch * (blocks(c->len + c->reserved) - blocks(c->len));
        reservations += pending != 0;
        tentative += pending;
        CHECK(kvp_cache_len(c->cache) == c->len, "typed cache %d len %zu, expected %zu", i,
              kvp_cache_len(c->cache), c->len);
        CHECK(kvp_cache_reserved_rows(c->cache) == c->reserved,
              "typed cache %d reserved %zu, expected %zu", i, kvp_cache_reserved_rows(c->cache),
              c->reserved);
        double k[P_ELEMS], v[P_ELEMS];
        p_export(c, k, v);
        size_t at = 0;
        for (size_t b = 0; b < c->batch; b++) {
            for (size_t h = 0; h < P.hkv; h++) {
                for (size_t t = 0; t < c->len; t++) {
                    for (size_t f = 0; f < P.dh; f++, at++) {
                        CHECK(memcmp(&k[at], &c->k[b][h][t][f], sizeof(double)) == 0 &&
                                  memcmp(&v[at], &c->v[b][h][t][f], sizeof(double)) == 0,
                              "typed cache %d (%s) lane %zu head %zu pos %zu feature %zu: "
                              "k %a v %a, expected %a %a",
                              i, s_dtype_name(P.dtype), b, h, t, f, k[at], v[at],
                              c->k[b][h][t][f], c->v[b][h][t][f]);
                    }
                }
            }
        }
    }
    kvp_pool_stats s;
    p_stats(&s);
    CHECK(s.held_pages == p_held() && s.free_pages == p_free() &&
              s.tentative_pages == tentative && s.attached_caches == caches &&
              s.attached_reservations == reservations && s.exhaustions == P.exhaustions,
          "typed pool: held %zu free %zu tentative %zu caches %zu reservations %zu "
          "exhaustions %llu, expected %zu %zu %zu %zu %zu %llu",
          s.held_pages, s.free_pages, s.tentative_pages, s.attached_caches,
          s.attached_reservations, (unsigned long long)s.exhaustions, p_held(), p_free(),
          tentative, caches, reservations, (unsigned long long)P.exhaustions);
    kvp_error err;
    fz_check_status(kvp_pool_check(P.pool, on_mismatch, NULL, &err), KVP_OK, &err);
    fz_set_auditing(0);
}

/* Everything a refusal must leave as it was. */
typedef struct snapshot {
    uint64_t digest[P_CACHES];
    kvp_pool_stats stats;
} snapshot;

static void p_snap(snapshot *out)
{
    fz_set_auditing(1);
    memset(out, 0, sizeof *out);
    for (int i = 0; i < P_CACHES; i++) {
        if (P.c[i].live) {
            kvp_error err;
            fz_check_status(kvp_cache_digest(P.c[i].cache, &out->digest[i], &err), KVP_OK, &err);
        }
    }
    p_stats(&out->stats);
    fz_set_auditing(0);
}

static void p_unchanged(const snapshot *before, int exhausted)
{
    snapshot now;
    p_snap(&now);
    for (int i = 0; i < P_CACHES; i++) {
        CHECK(now.digest[i] == before->digest[i], "a refused call changed typed cache %d", i);
    }
    now.stats.exhaustions -= (uint64_t)exhausted;
    CHECK(memcmp(&now.stats, &before->stats, sizeof now.stats) == 0,
          "a refused call changed the typed pool's counters");
}

/* ---- the sub-world ------------------------------------------------------- */

void fz_paged_setup(void)
{
    memset(&P, 0, sizeof P);
}

static void p_destroy_all(void)
{
    kvp_error err;
    for (int i = 0; i < P_CACHES; i++) {
        if (P.c[i].live) {
            fz_check_status(kvp_cache_destroy(P.c[i].cache, &err), KVP_OK, &err);
            P.c[i].live = 0;
        }
    }
    if (P.live) {
        p_check();
        fz_check_status(kvp_pool_destroy(P.pool, &err), KVP_OK, &err);
        fz_check_status(kvp_layer_destroy(P.layer, &err), KVP_OK, &err);
    }
    memset(&P, 0, sizeof P);
}

void fz_paged_teardown(void)
{
    fz_set_op("paged_teardown");
    p_destroy_all();
}

/* A pool of any dtype, H_kv in {1, 2}, G in {1, 2, 4}, d_h in {2, 4}, 2-10 pages. */
static void p_create(reader *r)
{
    uint8_t a = fz_rd(r), b = fz_rd(r), c = fz_rd(r);
    fz_set_op("paged_pool");
    p_destroy_all();
    P.dtype = (kvp_dtype)(a % 5);
    P.hkv = 1 + (a / 5) % 2;
    static const size_t groups[] = {1, 2, 4};
    P.heads = P.hkv * groups[(a / 10) % 3];
    P.dh = (a / 30) % 2 ? 4 : 2;
    P.bt = 1 + b % 3;
    size_t pages = 2 + (b / 3) % 9;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.dtype = P.dtype;
    config.block_tokens = P.bt;
    config.heads = P.hkv;
    config.head_width = P.dh;
    for (size_t i = 0; i < KVP_KEY_SECRET_BYTES / sizeof(uint64_t); i++) {
        config.key_secret[i] = 0x70616765642d6b76ull + i;
    }
    config.budget_bytes = pages * 2 * P.hkv * P.bt * P.dh * kvp_dtype_bytes(P.dtype);
    kvp_error err;
    fz_check_status(kvp_pool_create(&config, &P.pool, &err), KVP_OK, &err);
    kvp_pool_stats s;
    p_stats(&s);
    CHECK(s.total_pages == pages && s.element_bytes == kvp_dtype_bytes(P.dtype),
          "typed pool of %zu pages of %s: %zu pages of %zu-byte elements", pages,
          s_dtype_name(P.dtype), s.total_pages, s.element_bytes);
    P.total = pages;
    fz_check_status(kvp_layer_create_random_grouped(P.heads * P.dh, P.heads, P.hkv, P_MAX_CAP,
                                                    10000.0, c, &P.layer, &err),
                    KVP_OK, &err);
    P.ks = P.vs = 1.0;
    P.live = 1;
}

static pcache *p_slot(reader *r)
{
    return &P.c[fz_rd(r) % P_CACHES];
}

static void p_cache_create(reader *r)
{
    pcache *c = p_slot(r);
    uint8_t kind = fz_rd(r), sb = fz_rd(r), geo = fz_rd(r);
    if (c->live) {
        return;
    }
    fz_set_op("paged_cache_create");
    int bound = kind % 3 == 0;
    size_t batch = geo % 16 == 15 ? 0 : 1 + geo % P_MAX_B;
    size_t cap = geo >= 248 ? (geo % 2 ? 0 : P_MAX_CAP + 1) : 1 + (geo / 2) % P_MAX_CAP;
    kvp_binding binding;
    kvp_error err;
    double ks = 1.0, vs = 1.0;
    const char *bad = NULL;
    if (bound) {
        fz_check_status(kvp_layer_binding(P.layer, &binding, &err), KVP_OK, &err);
        ks = P.ks;
        vs = P.vs;
    } else {
        fz_check_status(kvp_binding_init_external(&binding, P.hkv, P.dh, P_MAX_CAP,
                                                  ++P.next_identity, 1, &err),
                        KVP_OK, &err);
        binding.k_scale = g_scales[sb % 6];
        binding.v_scale = g_scales[(sb / 6) % 6];
        if (sb >= 250) { /* not finite, normal and > 0 */
            static const double invalid[] = {-1.0, 1e-310, INFINITY};
            if (sb % 2) {
                binding.k_scale = invalid[sb % 3];
                bad = "k_scale";
            } else {
                binding.v_scale = invalid[sb % 3];
                bad = "v_scale";
            }
        }
        ks = binding.k_scale == 0.0 ? 1.0 : binding.k_scale;
        vs = binding.v_scale == 0.0 ? 1.0 : binding.v_scale;
    }
    if (P.dtype != KVP_FP8_E4M3) {
        ks = vs = 1.0;
    }
    kvp_status want = bad != NULL     ? KVP_INVALID_ARGUMENT
                      : batch == 0    ? KVP_ZERO_BATCH_SIZE
                      : cap == 0      ? KVP_ZERO_CAPACITY
                      : cap > P_MAX_CAP ? KVP_CAPACITY_EXCEEDS_POSITIONS
                                        : KVP_OK;
    snapshot before;
    p_snap(&before);
    kvp_cache *out = NULL;
    kvp_status status = kvp_cache_create(P.pool, &binding, batch, cap, &out, &err);
    fz_check_status(status, want, &err);
    if (status != KVP_OK) {
        CHECK(out == NULL, "a refused cache_create wrote *out");
        if (bad != NULL) {
            CHECK(err.argument != NULL && strcmp(err.argument, bad) == 0,
                  "invalid scale: argument %s, expected %s", err.argument ? err.argument : "NULL",
                  bad);
        }
        p_unchanged(&before, 0);
        return;
    }
    memset(c, 0, sizeof *c);
    c->cache = out;
    c->live = 1;
    c->bound = bound;
    c->batch = batch;
    c->cap = cap;
    c->ks = ks;
    c->vs = vs;
    c->lks = P.ks;
    c->lvs = P.vs;
    c->poison_row = SIZE_MAX;
}

static void p_cache_end(reader *r)
{
    pcache *c = p_slot(r);
    uint8_t how = fz_rd(r);
    if (!c->live) {
        return;
    }
    kvp_error err;
    if (how % 2) {
        fz_set_op("paged_cache_destroy");
        fz_check_status(kvp_cache_destroy(c->cache, &err), KVP_OK, &err);
        c->live = 0;
        return;
    }
    fz_set_op("paged_cache_reset");
    fz_check_status(kvp_cache_reset(c->cache, &err), KVP_OK, &err);
    c->len = c->reserved = c->written = 0;
    c->poison_row = SIZE_MAX;
}

/* The first element of rows [B][H_kv][rows][d_h] not storable, or SIZE_MAX. */
static size_t first_bad(const double *x, size_t n, double scale)
{
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i]) || s_overflows(P.dtype, scale, x[i])) {
            return i;
        }
    }
    return SIZE_MAX;
}

/* Predicts NONFINITE_KEY / NONFINITE_VALUE of widened rows, and checks the detail. */
static kvp_status nonfinite_rows(const pcache *c, const double *k, const double *v, size_t n,
                                 size_t *index, double *value)
{
    size_t i = first_bad(k, n, c->ks);
    if (i != SIZE_MAX) {
        *index = i;
        *value = k[i];
        return KVP_NONFINITE_KEY;
    }
    i = first_bad(v, n, c->vs);
    if (i != SIZE_MAX) {
        *index = i;
        *value = v[i];
        return KVP_NONFINITE_VALUE;
    }
    return KVP_OK;
}

static void check_nonfinite_detail(const kvp_error *err, size_t index, double value)
{
    const char *want_what = isfinite(value) ? s_dtype_name(P.dtype) : NULL;
    CHECK(err->index == index && (memcmp(&err->value, &value, sizeof value) == 0 ||
                                  (isnan(err->value) && isnan(value))),
          "nonfinite detail: index %zu value %a, expected %zu %a", err->index, err->value, index,
          value);
    CHECK((want_what == NULL) == (err->what == NULL) &&
              (want_what == NULL || strcmp(want_what, err->what) == 0),
          "nonfinite detail: what %s, expected %s", err->what ? err->what : "NULL",
          want_what ? want_what : "NULL");
}

/* Stores rows [B][H_kv][rows][d_h] (widened) at positions len.. of the shadow. */
static void store_rows(pcache *c, const double *k, const double *v, size_t rows)
{
    size_t at = 0;
    for (size_t b = 0; b < c->batch; b++) {
        for (size_t h = 0; h < P.hkv; h++) {
            for (size_t t = 0; t < rows; t++) {
                for (size_t f = 0; f < P.dh; f++, at++) {
                    c->k[b][h][c->len + t][f] = s_store(P.dtype, c->ks, k[at]);
                    c->v[b][h][c->len + t][f] = s_store(P.dtype, c->vs, v[at]);
                }
            }
        }
    }
}

/* The reservation's first n rows are gone (committed): the rest renumber. */
static void shift_pending(pcache *c, size_t n)
{
    for (size_t b = 0; b < c->batch; b++) {
        for (size_t h = 0; h < P.hkv; h++) {
            for (size_t t = n; t < c->reserved; t++) {
                memcpy(c->pk[b][h][t - n], c->pk[b][h][t], sizeof c->pk[b][h][t]);
                memcpy(c->pv[b][h][t - n], c->pv[b][h][t], sizeof c->pv[b][h][t]);
            }
        }
    }
    c->written = c->written > n ? c->written - n : 0;
    if (c->poison_row != SIZE_MAX) {
        c->poison_row = c->poison_row >= n ? c->poison_row - n : SIZE_MAX;
    }
    c->reserved -= n;
    c->len += n;
}

static const kvp_dtype g_src[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16};

/* Append or commit rows handed over, of a source dtype. */
static void p_rows(reader *r, int commit)
{
    pcache *c = p_slot(r);
    uint8_t sel = fz_rd(r);
    size_t rows = fz_rd(r) % 5;
    double kd[P_ELEMS], vd[P_ELEMS];
    if (!c->live) {
        return;
    }
    size_t n = c->batch * P.hkv * rows * P.dh;
    p_values(r, kd, n);
    p_values(r, vd, n);
    fz_set_op(commit ? "paged_commit_rows" : "paged_append_rows");
    int bad_src = sel >= 250;
    kvp_dtype src = bad_src ? (kvp_dtype)(4 + sel % 3) : g_src[sel % 4];
    int null_keys = sel % 64 == 33 && rows != 0;
    double kw[P_ELEMS], vw[P_ELEMS];
    for (size_t i = 0; i < n; i++) {
        kw[i] = src_widened(src, kd[i]);
        vw[i] = src_widened(src, vd[i]);
    }
    unsigned char kb[P_ELEMS * 8], vb[P_ELEMS * 8];
    src_encode(src, kd, n, kb);
    src_encode(src, vd, n, vb);
    if (rows == 0 && (c->bound || c->reserved != 0 || bad_src)) {
        return; /* what a zero-row call checks first is not specified */
    }
    size_t index = 0;
    double value = 0;
    size_t need = c->batch * (blocks(c->len + rows) - blocks(c->len));
    kvp_status want;
    if (c->bound) {
        want = KVP_CACHE_LAYER_BOUND;
    } else if (!commit && c->reserved != 0) {
        want = KVP_ROWS_RESERVED;
    } else if (bad_src) {
        want = KVP_INVALID_ARGUMENT;
    } else if (commit && rows > c->reserved) {
        want = KVP_ROWS_NOT_RESERVED;
    } else if (null_keys) {
        want = KVP_NULL_ARGUMENT;
    } else if (!commit && rows > c->cap - c->len) {
        want = KVP_FULL;
    } else if ((want = nonfinite_rows(c, kw, vw, n, &index, &value)) != KVP_OK) {
    } else if (!commit && need > p_free()) {
        want = KVP_POOL_EXHAUSTED;
    }
    snapshot before;
    p_snap(&before);
    kvp_error err;
    const void *keys = null_keys ? NULL : (const void *)kb;
    kvp_status status = commit ? kvp_cache_commit_rows_typed(c->cache, src, keys, vb, rows, &err)
                               : kvp_cache_append_rows_typed(c->cache, src, keys, vb, rows, &err);
    fz_check_status(status, want, &err);
    if (status != KVP_OK) {
        if (status == KVP_NONFINITE_KEY || status == KVP_NONFINITE_VALUE) {
            check_nonfinite_detail(&err, index, value);
        } else if (status == KVP_ROWS_NOT_RESERVED) {
            CHECK(err.tokens == rows && err.available == c->reserved,
                  "rows not reserved: tokens %zu available %zu, expected %zu %zu", err.tokens,
                  err.available, rows, c->reserved);
        } else if (status == KVP_FULL) {
            CHECK(err.tokens == rows && err.available == c->cap - c->len,
                  "full: tokens %zu available %zu", err.tokens, err.available);
        } else if (status == KVP_INVALID_ARGUMENT) {
            CHECK(err.argument != NULL && strcmp(err.argument, "src_dtype") == 0,
                  "invalid source dtype: argument %s", err.argument ? err.argument : "NULL");
        }
        P.exhaustions += status == KVP_POOL_EXHAUSTED;
        p_unchanged(&before, status == KVP_POOL_EXHAUSTED);
        return;
    }
    store_rows(c, kw, vw, rows);
    if (commit) {
        shift_pending(c, rows);
    } else {
        c->len += rows;
    }
}

static void p_reserve(reader *r)
{
    pcache *c = p_slot(r);
    size_t rows = 1 + fz_rd(r) % 4;
    if (!c->live) {
        return;
    }
    fz_set_op("paged_reserve");
    size_t need = c->batch * (blocks(c->len + rows) - blocks(c->len));
    kvp_status want = c->bound               ? KVP_CACHE_LAYER_BOUND
                      : c->reserved != 0     ? KVP_ROWS_RESERVED
                      : rows > c->cap - c->len ? KVP_FULL
                      : need > p_free()      ? KVP_POOL_EXHAUSTED
                                             : KVP_OK;
    snapshot before;
    p_snap(&before);
    kvp_error err;
    kvp_status status = kvp_cache_reserve_rows(c->cache, rows, &err);
    fz_check_status(status, want, &err);
    if (status != KVP_OK) {
        if (status == KVP_ROWS_RESERVED) {
            CHECK(err.tokens == c->reserved, "rows reserved: tokens %zu, expected %zu",
                  err.tokens, c->reserved);
        }
        P.exhaustions += status == KVP_POOL_EXHAUSTED;
        p_unchanged(&before, status == KVP_POOL_EXHAUSTED);
        return;
    }
    c->reserved = rows;
    c->written = 0;
    c->poison_row = SIZE_MAX;
}

/* The spans of every lane; writes rows written..reserved-1 in the page format. */
static void p_write(reader *r)
{
    pcache *c = p_slot(r);
    uint8_t sel = fz_rd(r);
    double kd[P_ELEMS], vd[P_ELEMS];
    p_values(r, kd, P_ELEMS);
    p_values(r, vd, P_ELEMS);
    if (!c->live) {
        return;
    }
    fz_set_op("paged_reserved_slots");
    kvp_error err;
    size_t count = 99;
    snapshot before;
    p_snap(&before);
    size_t lane = sel % 32 == 31 ? c->batch : 0; /* OUT_OF_RANGE now and then */
    kvp_status want = c->bound ? KVP_CACHE_LAYER_BOUND
                      : lane >= c->batch ? KVP_OUT_OF_RANGE
                                         : KVP_OK;
    kvp_status status = kvp_cache_reserved_slots(c->cache, lane, NULL, 0, &count, &err);
    fz_check_status(status, want, &err);
    if (status != KVP_OK) {
        p_unchanged(&before, 0);
        return;
    }
    size_t spans = c->reserved == 0 ? 0 : blocks(c->len + c->reserved) - c->len / P.bt;
    CHECK(count == spans, "reserved_slots: %zu spans, expected %zu", count, spans);
    if (spans == 0) {
        return;
    }
    kvp_page_layout layout;
    kvp_page_layout_init(&layout);
    fz_check_status(kvp_pool_page_layout(P.pool, &layout, &err), KVP_OK, &err);
    int poison = sel % 8 == 7;
    c->poison_row = SIZE_MAX; /* every reserved row is written again */
    size_t at = 0;
    for (size_t b = 0; b < c->batch; b++) {
        kvp_slot_span span[P_MAX_CAP + 2];
        size_t got = 0;
        if (sel % 32 == 30 && spans > 1) {
            status = kvp_cache_reserved_slots(c->cache, b, span, spans - 1, &got, &err);
            fz_check_status(status, KVP_BUFFER_TOO_SMALL, &err);
            CHECK(err.needed == spans, "buffer too small: needed %zu, expected %zu", err.needed,
                  spans);
            p_unchanged(&before, 0);
        }
        fz_check_status(kvp_cache_reserved_slots(c->cache, b, span, P_MAX_CAP + 2, &got, &err),
                        KVP_OK, &err);
        CHECK(got == spans, "lane %zu: %zu spans, expected %zu", b, got, spans);
        size_t row = 0;
        for (size_t s = 0; s < got; s++) {
            CHECK(span[s].row == row && span[s].rows >= 1 &&
                      span[s].row_stride_bytes == layout.row_stride_bytes &&
                      span[s].head_stride_bytes == layout.head_stride_bytes &&
                      (unsigned char *)span[s].values - (unsigned char *)span[s].keys ==
                          (ptrdiff_t)layout.values_offset_bytes,
                  "lane %zu span %zu: row %zu rows %zu strides %zu %zu", b, s, span[s].row,
                  span[s].rows, span[s].row_stride_bytes, span[s].head_stride_bytes);
            for (size_t i = 0; i < span[s].rows; i++, row++) {
                for (size_t h = 0; h < P.hkv; h++) {
                    for (size_t f = 0; f < P.dh; f++, at++) {
                        size_t off = h * span[s].head_stride_bytes +
                                     i * span[s].row_stride_bytes + f * layout.element_bytes;
                        double k = kd[at % P_ELEMS], v = vd[at % P_ELEMS];
                        if (!isfinite(k) || s_overflows(P.dtype, c->ks, k)) {
                            k = 1.0;
                        }
                        if (!isfinite(v) || s_overflows(P.dtype, c->vs, v)) {
                            v = -1.0;
                        }
                        int nan_k = poison && row == c->reserved - 1 && b == c->batch - 1 &&
                                    h == 0 && f == 0 && sel % 16 < 8;
                        int nan_v = poison && row == c->reserved - 1 && b == c->batch - 1 &&
                                    h == P.hkv - 1 && f == P.dh - 1 && sel % 16 >= 8;
                        page_write(P.dtype, c->ks, (unsigned char *)span[s].keys + off, k, nan_k);
                        page_write(P.dtype, c->vs, (unsigned char *)span[s].values + off, v,
                                   nan_v);
                        c->pk[b][h][row][f] = s_store(P.dtype, c->ks, k);
                        c->pv[b][h][row][f] = s_store(P.dtype, c->vs, v);
                        if (nan_k || nan_v) {
                            c->poison_row = row;
                            c->poison_b = b;
                            c->poison_h = h;
                            c->poison_f = f;
                            c->poison_value = nan_v;
                        }
                    }
                }
            }
        }
        CHECK(row == c->reserved, "lane %zu: spans end at %zu, expected %zu", b, row,
              c->reserved);
    }
    c->written = c->reserved;
}

/* Commit written rows, or discard the reservation. */
static void p_commit_written(reader *r)
{
    pcache *c = p_slot(r);
    uint8_t sel = fz_rd(r);
    if (!c->live) {
        return;
    }
    kvp_error err;
    snapshot before;
    p_snap(&before);
    if (sel % 4 == 3) {
        fz_set_op("paged_discard_rows");
        fz_check_status(kvp_cache_discard_rows(c->cache, &err), KVP_OK, &err);
        if (!c->bound) {
            c->reserved = c->written = 0;
            c->poison_row = SIZE_MAX;
        } else {
            p_unchanged(&before, 0);
        }
        return;
    }
    size_t rows = sel % 16 == 14 ? c->reserved + 1 : 1 + (sel / 4) % (c->written + 1);
    if (!c->bound && rows > c->written && rows <= c->reserved) {
        return; /* rows not written yet: commit_written would read garbage */
    }
    fz_set_op("paged_commit_written");
    kvp_status want = c->bound               ? KVP_CACHE_LAYER_BOUND
                      : rows > c->reserved   ? KVP_ROWS_NOT_RESERVED
                      : c->poison_row < rows ? (c->poison_value ? KVP_NONFINITE_VALUE
                                                                : KVP_NONFINITE_KEY)
                                             : KVP_OK;
    kvp_status status = kvp_cache_commit_written(c->cache, rows, &err);
    fz_check_status(status, want, &err);
    if (status != KVP_OK) {
        if (status == KVP_NONFINITE_KEY || status == KVP_NONFINITE_VALUE) {
            size_t index = ((c->poison_b * P.hkv + c->poison_h) * rows + c->poison_row) * P.dh +
                           c->poison_f;
            CHECK(err.index == index && isnan(err.value) && err.what == NULL,
                  "commit_written nonfinite: index %zu value %a, expected %zu NaN", err.index,
                  err.value, index);
        }
        p_unchanged(&before, 0);
        return;
    }
    for (size_t b = 0; b < c->batch; b++) {
        for (size_t h = 0; h < P.hkv; h++) {
            for (size_t t = 0; t < rows; t++) {
                memcpy(c->k[b][h][c->len + t], c->pk[b][h][t], sizeof c->pk[b][h][t]);
                memcpy(c->v[b][h][c->len + t], c->pv[b][h][t], sizeof c->pv[b][h][t]);
            }
        }
    }
    shift_pending(c, rows);
}

/* A decode step through the layer (a bound cache's rows), read back after. */
static void p_forward(reader *r)
{
    pcache *c = p_slot(r);
    double x[P_MAX_B * P_MAX_H * P_MAX_DH];
    p_values(r, x, sizeof x / sizeof x[0]);
    if (!c->live || !c->bound || c->lks != P.ks || c->lvs != P.vs) {
        return; /* scales set since the cache was made: not modelled */
    }
    for (size_t i = 0; i < sizeof x / sizeof x[0]; i++) {
        x[i] = isfinite(x[i]) && fabs(x[i]) <= 2.0 ? x[i] : 0.5;
    }
    fz_set_op("paged_forward");
    kvp_error err;
    kvp_ticket *ticket;
    fz_check_status(kvp_ticket_create(c->cache, &ticket, &err), KVP_OK, &err);
    size_t need = c->len % P.bt == 0 ? c->batch : 0;
    kvp_status want = c->len == c->cap ? KVP_FULL
                      : need > p_free() ? KVP_POOL_EXHAUSTED
                                        : KVP_OK;
    snapshot before;
    p_snap(&before);
    kvp_tensor input = kvp_tensor3(x, c->batch, 1, P.heads * P.dh);
    kvp_status status = kvp_attention_forward(P.layer, &input, c->cache, ticket, &err);
    fz_check_status(status, want, &err);
    fz_check_status(kvp_ticket_destroy(ticket, &err), KVP_OK, &err);
    if (status != KVP_OK) {
        P.exhaustions += status == KVP_POOL_EXHAUSTED;
        p_unchanged(&before, status == KVP_POOL_EXHAUSTED);
        return;
    }
    c->len++;
    double k[P_ELEMS], v[P_ELEMS];
    p_export(c, k, v);
    size_t at = 0;
    for (size_t b = 0; b < c->batch; b++) {
        for (size_t h = 0; h < P.hkv; h++) {
            for (size_t t = 0; t < c->len; t++) {
                for (size_t f = 0; f < P.dh; f++, at++) {
                    if (t + 1 < c->len) {
                        continue; /* older rows: p_check compares them */
                    }
                    /* the new row: on the dtype's grid (fp8: a multiple of the scale's) */
                    double ek = P.dtype == KVP_FP8_E4M3 ? k[at] / c->ks : k[at];
                    double ev = P.dtype == KVP_FP8_E4M3 ? v[at] / c->vs : v[at];
                    CHECK(P.dtype == KVP_FP8_E4M3 ||
                              (s_round(P.dtype, ek) == ek && s_round(P.dtype, ev) == ev),
                          "forward stored %a %a, not %s", k[at], v[at], s_dtype_name(P.dtype));
                    c->k[b][h][t][f] = k[at];
                    c->v[b][h][t][f] = v[at];
                }
            }
        }
    }
}

static void p_layer_settings(reader *r)
{
    uint8_t sel = fz_rd(r), s2 = fz_rd(r);
    kvp_error err;
    if (sel % 2) {
        fz_set_op("paged_layer_set_accum");
        kvp_accum level = sel % 8 == 7 ? (kvp_accum)3 : (kvp_accum)((sel >> 1) & 1);
        fz_check_status(kvp_layer_set_accum(P.layer, level, &err),
                        level == 3 ? KVP_INVALID_ARGUMENT : KVP_OK, &err);
        return;
    }
    fz_set_op("paged_layer_set_kv_scales");
    double ks = g_scales[s2 % 5], vs = g_scales[(s2 / 5) % 5];
    const char *bad = NULL;
    if (s2 >= 240) {
        if (s2 % 2) {
            ks = -ks;
            bad = "k_scale";
        } else {
            vs = NAN;
            bad = "v_scale";
        }
    }
    kvp_status status = kvp_layer_set_kv_scales(P.layer, ks, vs, &err);
    fz_check_status(status, bad ? KVP_INVALID_ARGUMENT : KVP_OK, &err);
    if (status == KVP_OK) {
        P.ks = ks;
        P.vs = vs;
    }
    kvp_binding binding;
    fz_check_status(kvp_layer_binding(P.layer, &binding, &err), KVP_OK, &err);
    CHECK(binding.k_scale == P.ks && binding.v_scale == P.vs,
          "layer scales %g %g, expected %g %g", binding.k_scale, binding.v_scale, P.ks, P.vs);
}

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
                        cand_k[f] = s_store(P.dtype, c->ks, a->ck[i]);
                        cand_v[f] = s_store(P.dtype, c->vs, a->cv[i]);
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
    src_encode(f32 ? KVP_F32 : KVP_F64, x, n, buf);
}

static void p_attend(reader *r)
{
    pcache *c = p_slot(r);
    uint8_t sel = fz_rd(r), fault_byte = fz_rd(r);
    double qd[P_OUT], kd[P_ELEMS], vd[P_ELEMS];
    p_values(r, qd, P_OUT);
    p_values(r, kd, P_ELEMS);
    p_values(r, vd, P_ELEMS);
    if (!c->live) {
        return;
    }
    fz_set_op("paged_attention");
    pa_call a;
    memset(&a, 0, sizeof a);
    static const size_t mult[] = {0, 1, 2, 3};
    size_t heads_arg = c->bound && sel % 4 == 0 ? 0 : P.hkv * mult[1 + sel % 3];
    if (sel % 4 == 0) {
        heads_arg = 0;
    }
    a.heads = heads_arg == 0 ? (c->bound ? P.heads : P.hkv) : heads_arg;
    a.f32 = (sel >> 2) & 1;
    a.accum = (kvp_accum)((sel >> 3) & 1);
    a.candidate = (sel >> 4) & 1;
    static const double scales[] = {0.0, 0.5, 1.0, 0.125};
    a.scale = scales[(sel >> 5) % 4];
    a.keys = c->len + (size_t)a.candidate;
    size_t nq = c->batch * a.heads * P.dh, nc = c->batch * P.hkv * P.dh;
    /* queries: moderate, or now and then a NaN or an infinity (never a huge finite value) */
    for (size_t i = 0; i < nq; i++) {
        if (isfinite(qd[i]) && fabs(qd[i]) > 2.0) {
            qd[i] = 0.25;
        }
    }
    unsigned char qb[P_OUT * 8], kb[P_ELEMS * 8], vb[P_ELEMS * 8];
    pa_encode(a.f32, qd, nq, qb);
    pa_encode(a.f32, kd, nc, kb);
    pa_encode(a.f32, vd, nc, vb);
    pa_read(&a, qb, nq, a.q);
    pa_read(&a, kb, nc, a.ck);
    pa_read(&a, vb, nc, a.cv);
    kvp_paged_attention_args args;
    kvp_paged_attention_args_init(&args);
    args.cache = c->cache;
    args.heads = heads_arg;
    args.io_dtype = a.f32 ? KVP_F32 : KVP_F64;
    args.queries = qb;
    args.keys = a.candidate ? kb : NULL;
    args.values = a.candidate ? vb : NULL;
    args.scale = a.scale;
    args.accum = a.accum;
    unsigned char out[P_OUT * 8], untouched[P_OUT * 8];
    memset(out, 0xA7, sizeof out);
    memcpy(untouched, out, sizeof out);
    args.outputs = out;
    /* at most one fault, in paged.h's order */
    int fault = fault_byte >= 224 ? 1 + fault_byte % 8 : 0;
    kvp_status want = KVP_OK;
    const char *argument = NULL;
    if (fault == 1 && P.hkv > 1) {
        args.heads = P.hkv * 2 + 1;
        want = KVP_INVALID_ARGUMENT;
        argument = "heads";
    } else if (fault == 2) {
        args.io_dtype = KVP_BF16;
        want = KVP_INVALID_ARGUMENT;
        argument = "io_dtype";
    } else if (fault == 3) {
        args.accum = (kvp_accum)7;
        want = KVP_INVALID_ARGUMENT;
        argument = "accum";
    } else if (fault == 4) {
        args.values = args.keys == NULL ? vb : NULL;
        want = KVP_INVALID_ARGUMENT;
    } else if (fault == 5 || fault == 6) {
        args.scale = fault == 5 ? -0.5 : NAN;
        want = KVP_INVALID_ARGUMENT;
        argument = "scale";
    } else if (fault == 7) {
        args.queries = NULL;
        want = KVP_NULL_ARGUMENT;
        argument = "queries";
    } else if (fault == 8) {
        args.outputs = NULL;
        want = KVP_NULL_ARGUMENT;
        argument = "outputs";
    }
    size_t index = 0;
    double value = 0.0;
    double ref[P_OUT], mass[P_OUT];
    int big = 0;
    if (want == KVP_OK && a.keys == 0) {
        want = KVP_INVALID_ARGUMENT;
        argument = "keys";
    }
    if (want == KVP_OK && a.candidate) {
        want = nonfinite_rows(c, a.ck, a.cv, nc, &index, &value);
    }
    if (want == KVP_OK) {
        size_t first = pa_shadow(c, &a, ref, mass, &big);
        if (big && a.accum == KVP_ACCUM_FAST && P.dtype != KVP_F64) {
            /* f32 accumulation of elements beyond 16 may overflow: not predicted */
            a.accum = args.accum = KVP_ACCUM_EXACT;
        }
        if (first != SIZE_MAX) {
            want = KVP_NONFINITE_SCORE;
            index = first;
        }
    }
    snapshot before;
    p_snap(&before);
    kvp_error err;
    kvp_status status = kvp_paged_attention(&args, NULL, &err);
    fz_check_status(status, want, &err);
    p_unchanged(&before, 0);
    if (status != KVP_OK) {
        CHECK(memcmp(out, untouched, sizeof out) == 0, "a refused paged_attention wrote outputs");
        if (argument != NULL) {
            CHECK(err.argument != NULL && strcmp(err.argument, argument) == 0,
                  "paged_attention: argument %s, expected %s",
                  err.argument ? err.argument : "NULL", argument);
        }
        if (status == KVP_NONFINITE_KEY || status == KVP_NONFINITE_VALUE) {
            check_nonfinite_detail(&err, index, value);
        } else if (status == KVP_NONFINITE_SCORE) {
            CHECK(err.index == index, "nonfinite score at %zu, expected %zu", err.index, index);
        }
        return;
    }
    double got[P_OUT];
    pa_read(&a, out, nq, got);
    int fast = a.accum == KVP_ACCUM_FAST && P.dtype != KVP_F64;
    for (size_t i = 0; i < nq && !big; i++) {
        /* Elements beyond 16 (planted 500 to 1e39) make the f64 scores' own
         * rounding (ulps of 1e23) swing the weights: only determinism is
         * checked then, and an f32 output may round to infinity. */
        double tol = (fast ? 1e-3 : 1e-10) * mass[i] + (a.f32 ? 1.2e-7 * fabs(ref[i]) : 0.0) +
                     1e-300;
        CHECK(isfinite(got[i]) && fabs(got[i] - ref[i]) <= tol,
              "paged_attention (%s, %s, %s io, heads %zu of %zu kv, %zu keys) output %zu: %a, "
              "shadow %a (tolerance %g)",
              s_dtype_name(P.dtype), fast ? "fast" : "exact", a.f32 ? "f32" : "f64", a.heads,
              P.hkv, a.keys, i, got[i], ref[i], tol);
    }
    /* the same bits again, and on the decoder's threads */
    unsigned char again[P_OUT * 8];
    args.outputs = again;
    fz_check_status(kvp_paged_attention(&args, NULL, &err), KVP_OK, &err);
    size_t bytes = nq * (a.f32 ? sizeof(float) : sizeof(double));
    CHECK(memcmp(again, out, bytes) == 0, "paged_attention twice: other bits");
    fz_check_status(kvp_paged_attention(&args, fz_decoder(), &err), KVP_OK, &err);
    CHECK(memcmp(again, out, bytes) == 0, "paged_attention on the decoder: other bits");
    p_unchanged(&before, 0);
}

/* ---- dispatch -------------------------------------------------------------- */

void fz_paged_op(reader *r)
{
    uint8_t which = fz_rd(r);
    if (!P.live || which % 16 == 0) {
        p_create(r);
        p_check();
        if (which % 16 == 0) {
            return;
        }
    }
    switch (which % 16) {
    case 1:
    case 2:
        p_cache_create(r);
        break;
    case 3:
        p_cache_end(r);
        break;
    case 4:
    case 5:
        p_rows(r, 0);
        break;
    case 6:
        p_reserve(r);
        break;
    case 7:
        p_rows(r, 1);
        break;
    case 8:
    case 9:
        p_write(r);
        break;
    case 10:
        p_commit_written(r);
        break;
    case 11:
        p_forward(r);
        break;
    case 12:
        p_layer_settings(r);
        break;
    default:
        p_attend(r);
        break;
    }
    p_check();
}
