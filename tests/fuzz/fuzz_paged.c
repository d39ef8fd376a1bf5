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
 * The shadow's ground truth is its own (fuzz_paged_dtype.c): every dtype's
 * rounding and overflow written from pool.h's description, and the encoders
 * of source rows and of in-place writes. Nothing from src/ is used.
 * kvp_paged_attention's operation is in fuzz_paged_attention.c; the shadow
 * they share is in fuzz_paged.h.
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
#include "fuzz_paged.h"

#define P pz_world

pz_world_t pz_world;

static const double g_scales[] = {1.0, 2.0, 0.25, 0.3, 3.7, 0.0 /* = 1 */};

/* ---- values from the input ---------------------------------------------- */

/* Per dtype a value it cannot hold, or NaN / Inf; or a big value f64 keeps
 * (a selector byte from 0xE0 on); tiny rows from 0xC0 to 0xDF. */
static const double g_big[] = {NAN, INFINITY, -INFINITY, 1e6, 70000.0, 500.0, 1e39, -3e38};

void pz_values(reader *r, double *out, size_t n)
{
    uint64_t state = 0x9a9edull * (uint64_t)(fz_rd(r) + 1);
    for (size_t i = 0; i < n; i++) {
        out[i] = 2.0 * fz_unit(&state);
    }
    uint8_t special = fz_rd(r);
    if (special >= 0xE0 && n != 0) {
        out[fz_rd(r) % n] = g_big[special & 7];
    } else if (special >= 0xC0) {
        /* tiny rows: every dtype's subnormal range (f16 below 2^-14, e4m3
         * below 2^-6 of its scale, f32 and bf16 below 2^-126, f64's) */
        static const double tiny[] = {1e-3, 1e-5, 0x1p-20, 1e-8, 1e-39, 1e-42, 1e-310, 0x1p-24};
        for (size_t i = 0; i < n; i++) {
            out[i] *= tiny[special & 7];
        }
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
                              i, pz_dtype_name(P.dtype), b, h, t, f, k[at], v[at],
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


void pz_snap(pz_snapshot *out)
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

void pz_unchanged(const pz_snapshot *before, int exhausted)
{
    pz_snapshot now;
    pz_snap(&now);
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
          pz_dtype_name(P.dtype), s.total_pages, s.element_bytes);
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
        fz_check_status(kvp_layer_binding_get(P.layer, &binding, &err), KVP_OK, &err);
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
    pz_snapshot before;
    pz_snap(&before);
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
        pz_unchanged(&before, 0);
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
        if (!isfinite(x[i]) || pz_overflows(P.dtype, scale, x[i])) {
            return i;
        }
    }
    return SIZE_MAX;
}

/* Predicts NONFINITE_KEY / NONFINITE_VALUE of widened rows, and checks the detail. */
kvp_status pz_nonfinite_rows(const pcache *c, const double *k, const double *v, size_t n,
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

void pz_nonfinite_detail(const kvp_error *err, size_t index, double value)
{
    const char *want_what = isfinite(value) ? pz_dtype_name(P.dtype) : NULL;
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
                    c->k[b][h][c->len + t][f] = pz_store(P.dtype, c->ks, k[at]);
                    c->v[b][h][c->len + t][f] = pz_store(P.dtype, c->vs, v[at]);
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

/* append_rows_typed / commit_rows_typed's checks before the rows' values. */
static kvp_status rows_expect(const pcache *c, int commit, size_t rows, int bad_src,
                              int null_keys)
{
    if (c->bound) {
        return KVP_CACHE_LAYER_BOUND;
    }
    if (!commit && c->reserved != 0) {
        return KVP_ROWS_RESERVED;
    }
    if (bad_src) {
        return KVP_INVALID_ARGUMENT;
    }
    if (commit && rows > c->reserved) {
        return KVP_ROWS_NOT_RESERVED;
    }
    if (null_keys) {
        return KVP_NULL_ARGUMENT;
    }
    return !commit && rows > c->cap - c->len ? KVP_FULL : KVP_OK;
}

static void rows_refusal_detail(const pcache *c, size_t rows, kvp_status status,
                                const kvp_error *err)
{
    if (status == KVP_ROWS_NOT_RESERVED) {
        CHECK(err->tokens == rows && err->available == c->reserved,
              "rows not reserved: tokens %zu available %zu, expected %zu %zu", err->tokens,
              err->available, rows, c->reserved);
    } else if (status == KVP_FULL) {
        CHECK(err->tokens == rows && err->available == c->cap - c->len,
              "full: tokens %zu available %zu", err->tokens, err->available);
    } else if (status == KVP_INVALID_ARGUMENT) {
        CHECK(err->argument != NULL && strcmp(err->argument, "src_dtype") == 0,
              "invalid source dtype: argument %s", err->argument ? err->argument : "NULL");
    }
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
    pz_values(r, kd, n);
    pz_values(r, vd, n);
    fz_set_op(commit ? "paged_commit_rows" : "paged_append_rows");
    int bad_src = sel >= 250;
    kvp_dtype src = bad_src ? (kvp_dtype)(4 + sel % 3) : g_src[sel % 4];
    int null_keys = sel % 64 == 33 && rows != 0;
    double kw[P_ELEMS], vw[P_ELEMS];
    for (size_t i = 0; i < n; i++) {
        kw[i] = pz_widened(src, kd[i]);
        vw[i] = pz_widened(src, vd[i]);
    }
    unsigned char kb[P_ELEMS * 8], vb[P_ELEMS * 8];
    pz_encode(src, kd, n, kb);
    pz_encode(src, vd, n, vb);
    if (rows == 0 && (c->bound || c->reserved != 0 || bad_src)) {
        return; /* what a zero-row call checks first is not specified */
    }
    size_t index = 0;
    double value = 0;
    kvp_status want = rows_expect(c, commit, rows, bad_src, null_keys);
    if (want == KVP_OK) {
        want = pz_nonfinite_rows(c, kw, vw, n, &index, &value);
    }
    if (want == KVP_OK && !commit &&
        c->batch * (blocks(c->len + rows) - blocks(c->len)) > p_free()) {
        want = KVP_POOL_EXHAUSTED;
    }
    pz_snapshot before;
    pz_snap(&before);
    kvp_error err;
    const void *keys = null_keys ? NULL : (const void *)kb;
    kvp_status status = commit ? kvp_cache_commit_rows_typed(c->cache, src, keys, vb, rows, &err)
                               : kvp_cache_append_rows_typed(c->cache, src, keys, vb, rows, &err);
    fz_check_status(status, want, &err);
    if (status != KVP_OK) {
        if (status == KVP_NONFINITE_KEY || status == KVP_NONFINITE_VALUE) {
            pz_nonfinite_detail(&err, index, value);
        } else {
            rows_refusal_detail(c, rows, status, &err);
        }
        P.exhaustions += status == KVP_POOL_EXHAUSTED;
        pz_unchanged(&before, status == KVP_POOL_EXHAUSTED);
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
    pz_snapshot before;
    pz_snap(&before);
    kvp_error err;
    kvp_status status = kvp_cache_reserve_rows(c->cache, rows, &err);
    fz_check_status(status, want, &err);
    if (status != KVP_OK) {
        if (status == KVP_ROWS_RESERVED) {
            CHECK(err.tokens == c->reserved, "rows reserved: tokens %zu, expected %zu",
                  err.tokens, c->reserved);
        }
        P.exhaustions += status == KVP_POOL_EXHAUSTED;
        pz_unchanged(&before, status == KVP_POOL_EXHAUSTED);
        return;
    }
    c->reserved = rows;
    c->written = 0;
    c->poison_row = SIZE_MAX;
}

/*
 * Writes reserved row `row` of lane b (row i of `span`) in the page format,
 * storable values from kd, vd; poison 1 plants a NaN in its first key
 * element, 2 in its last value element.
 */
static void write_row(pcache *c, const kvp_slot_span *span, const kvp_page_layout *layout,
                      size_t i, size_t b, size_t row, int poison, const double *kd,
                      const double *vd, size_t *at)
{
    for (size_t h = 0; h < P.hkv; h++) {
        for (size_t f = 0; f < P.dh; f++, (*at)++) {
            size_t off = h * span->head_stride_bytes + i * span->row_stride_bytes +
                         f * layout->element_bytes;
            double k = kd[*at % P_ELEMS], v = vd[*at % P_ELEMS];
            if (!isfinite(k) || pz_overflows(P.dtype, c->ks, k)) {
                k = 1.0;
            }
            if (!isfinite(v) || pz_overflows(P.dtype, c->vs, v)) {
                v = -1.0;
            }
            int nan_k = poison == 1 && h == 0 && f == 0;
            int nan_v = poison == 2 && h == P.hkv - 1 && f == P.dh - 1;
            pz_page_write(P.dtype, c->ks, (unsigned char *)span->keys + off, k, nan_k);
            pz_page_write(P.dtype, c->vs, (unsigned char *)span->values + off, v, nan_v);
            c->pk[b][h][row][f] = pz_store(P.dtype, c->ks, k);
            c->pv[b][h][row][f] = pz_store(P.dtype, c->vs, v);
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

/* The spans of every lane; writes rows written..reserved-1 in the page format. */
static void p_write(reader *r)
{
    pcache *c = p_slot(r);
    uint8_t sel = fz_rd(r);
    double kd[P_ELEMS], vd[P_ELEMS];
    pz_values(r, kd, P_ELEMS);
    pz_values(r, vd, P_ELEMS);
    if (!c->live) {
        return;
    }
    fz_set_op("paged_reserved_slots");
    kvp_error err;
    size_t count = 99;
    pz_snapshot before;
    pz_snap(&before);
    size_t lane = sel % 32 == 31 ? c->batch : 0; /* OUT_OF_RANGE now and then */
    kvp_status want = c->bound ? KVP_CACHE_LAYER_BOUND
                      : lane >= c->batch ? KVP_OUT_OF_RANGE
                                         : KVP_OK;
    kvp_status status = kvp_cache_reserved_slots(c->cache, lane, NULL, 0, &count, &err);
    fz_check_status(status, want, &err);
    if (status != KVP_OK) {
        pz_unchanged(&before, 0);
        return;
    }
    size_t spans = c->reserved == 0 ? 0 : blocks(c->len + c->reserved) - c->len / P.bt;
    CHECK(count == spans, "reserved_slots: %zu spans, expected %zu", count, spans);
    if (spans == 0) {
        return;
    }
    kvp_page_layout layout;
    kvp_page_layout_init(&layout);
    fz_check_status(kvp_pool_page_layout_get(P.pool, &layout, &err), KVP_OK, &err);
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
            pz_unchanged(&before, 0);
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
                int kind = poison && row == c->reserved - 1 && b == c->batch - 1
                               ? 1 + (sel % 16 >= 8)
                               : 0;
                write_row(c, &span[s], &layout, i, b, row, kind, kd, vd, &at);
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
    pz_snapshot before;
    pz_snap(&before);
    if (sel % 4 == 3) {
        fz_set_op("paged_discard_rows");
        fz_check_status(kvp_cache_discard_rows(c->cache, &err), KVP_OK, &err);
        if (!c->bound) {
            c->reserved = c->written = 0;
            c->poison_row = SIZE_MAX;
        } else {
            pz_unchanged(&before, 0);
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
        pz_unchanged(&before, 0);
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
    pz_values(r, x, sizeof x / sizeof x[0]);
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
    pz_snapshot before;
    pz_snap(&before);
    kvp_tensor input = kvp_tensor3(x, c->batch, 1, P.heads * P.dh);
    kvp_status status = kvp_attention_forward(P.layer, &input, c->cache, ticket, &err);
    fz_check_status(status, want, &err);
    fz_check_status(kvp_ticket_destroy(ticket, &err), KVP_OK, &err);
    if (status != KVP_OK) {
        P.exhaustions += status == KVP_POOL_EXHAUSTED;
        pz_unchanged(&before, status == KVP_POOL_EXHAUSTED);
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
                              (pz_round(P.dtype, ek) == ek && pz_round(P.dtype, ev) == ev),
                          "forward stored %a %a, not %s", k[at], v[at], pz_dtype_name(P.dtype));
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
    fz_check_status(kvp_layer_binding_get(P.layer, &binding, &err), KVP_OK, &err);
    CHECK(binding.k_scale == P.ks && binding.v_scale == P.vs,
          "layer scales %g %g, expected %g %g", binding.k_scale, binding.v_scale, P.ks, P.vs);
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
        pz_attend(r, p_slot(r));
        break;
    }
    p_check();
}
