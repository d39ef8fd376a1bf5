/*
 * fuzz_api_cache.c: the kvp_fuzz_api target's operations on standalone
 * caches and tickets (see fuzz_api.c for the whole target): cache create,
 * destroy, reset and truncate, ticket create, destroy and discard, commit,
 * prepare and forward (the latter compared with kvp_attention_reference).
 *
 * Invariants: each operation predicts the status from W before the call,
 * checks it exactly, applies the change to W only on success, and on failure
 * checks that nothing changed (digests, *err, outputs).
 *
 * Callers: fuzz_api.c's operation table (g_ops), one operation per
 * selector byte; each op_* reads its own further bytes from the reader.
 */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_api.h"

/* ---- operations ---------------------------------------------------------- */

void op_cache_create(reader *r)
{
    int slot = rd(r) % N_CACHES;
    uint8_t layer_byte = rd(r);
    int layer = layer_byte % N_LAYERS;
    /* Now and then a binding that is inconsistent (6) or of another geometry (7). */
    int tamper = layer_byte < 248 ? 0 : 6 + layer_byte % 2;
    uint8_t b = rd(r);
    size_t batch = b < 8 ? 0 : 1 + b % MAX_B;
    size_t capacity = rd(r) % (MAX_CAP + 2); /* 0 and MAX_POSITIONS + 1 are refused */
    if (W.cache[slot].live) {
        return;
    }
    g_op_name = "cache_create";
    kvp_binding binding;
    kvp_error err;
    kvp_status status = kvp_layer_binding_get(W.layer[layer].layer, &binding, &err);
    check_status(status, KVP_OK, &err);
    kvp_status want = batch == 0      ? KVP_ZERO_BATCH_SIZE
                      : capacity == 0 ? KVP_ZERO_CAPACITY
                      : capacity > MAX_POSITIONS ? KVP_CAPACITY_EXCEEDS_POSITIONS
                                                 : KVP_OK;
    if (tamper == 6) {
        binding.kind = 0; /* neither kind: refused first */
        want = KVP_INVALID_ARGUMENT;
    } else if (tamper == 7) {
        binding.kv_heads = W.alien_heads; /* a valid MHA page geometry of another pool */
        binding.head_width = W.d / W.alien_heads;
        want = want != KVP_OK ? want : KVP_GEOMETRY_MISMATCH;
    }
    kvp_cache *sentinel = (kvp_cache *)&W, *cache = sentinel;
    poison(&err);
    status = kvp_cache_create(W.pool, &binding, batch, capacity, &cache, &err);
    check_status(status, want, &err);
    if (status != KVP_OK) {
        CHECK(cache == sentinel, "a failed cache_create wrote *out");
        return;
    }
    check_untouched(&err);
    scache *c = &W.cache[slot];
    memset(c, 0, sizeof *c);
    c->cache = cache;
    c->live = 1;
    c->layer = layer;
    c->batch = batch;
    c->capacity = capacity;
    c->uid = ++W.next_uid;
    memcpy(c->version, W.params[W.layer[layer].pset].version, sizeof c->version);
}

void op_cache_destroy(reader *r)
{
    scache *c = &W.cache[rd(r) % N_CACHES];
    if (!c->live) {
        return;
    }
    g_op_name = "cache_destroy";
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_cache_destroy(c->cache, &err);
    check_status(status, KVP_OK, &err);
    check_untouched(&err);
    give_pages(c->batch * blocks_for(c->kv.len));
    c->live = 0;
}

void op_cache_reset(reader *r)
{
    scache *c = &W.cache[rd(r) % N_CACHES];
    if (!c->live) {
        return;
    }
    g_op_name = "cache_reset";
    kvp_error err;
    kvp_status status = kvp_cache_reset(c->cache, &err);
    check_status(status, KVP_OK, &err);
    give_pages(c->batch * blocks_for(c->kv.len));
    c->kv.len = 0;
    c->epoch++;
}

/* Truncate: to a shorter length (pages past it back, epoch on), the same (no-op), or past the end. */
void op_cache_truncate(reader *r)
{
    scache *c = &W.cache[rd(r) % N_CACHES];
    size_t new_len = rd(r);
    if (!c->live) {
        return;
    }
    new_len %= c->kv.len + 2;
    g_op_name = "cache_truncate";
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_cache_truncate(c->cache, new_len, &err);
    check_status(status, new_len > c->kv.len ? KVP_OUT_OF_RANGE : KVP_OK, &err);
    if (status != KVP_OK) {
        return;
    }
    check_untouched(&err);
    give_pages(c->batch * (blocks_for(c->kv.len) - blocks_for(new_len)));
    if (new_len < c->kv.len) {
        c->epoch++;
    }
    c->kv.len = new_len;
}

void op_ticket_create(reader *r)
{
    sticket *t = &W.ticket[rd(r) % N_TICKETS];
    const scache *c = &W.cache[rd(r) % N_CACHES];
    if (t->live || !c->live) {
        return;
    }
    g_op_name = "ticket_create";
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_ticket_create(c->cache, &t->ticket, &err);
    check_status(status, KVP_OK, &err);
    check_untouched(&err);
    t->live = 1;
    t->batch = c->batch;
    t->capacity = c->capacity;
    t->state = T_EMPTY;
    t->reserved = 0;
    t->borrowed_count = 0;
}

void op_ticket_destroy(reader *r)
{
    sticket *t = &W.ticket[rd(r) % N_TICKETS];
    if (!t->live) {
        return;
    }
    g_op_name = "ticket_destroy";
    kvp_error err;
    kvp_status status = kvp_ticket_destroy(t->ticket, &err);
    check_status(status, KVP_OK, &err);
    give_ticket_pages(t);
    t->live = 0;
}

void op_ticket_discard(reader *r)
{
    sticket *t = &W.ticket[rd(r) % N_TICKETS];
    if (!t->live) {
        return;
    }
    g_op_name = "ticket_discard";
    kvp_error err;
    kvp_status status = kvp_ticket_discard(t->ticket, &err);
    check_status(status, KVP_OK, &err);
    give_ticket_pages(t);
    t->state = T_EMPTY;
}

/* Commit's refusals, in the documented order. */
static kvp_status expect_commit(const sticket *t, const scache *c)
{
    if (t->state != T_PREPARED) {
        return KVP_TICKET_EMPTY;
    }
    if (t->cache_uid != c->uid) {
        return KVP_TICKET_FOREIGN_CACHE;
    }
    if (t->cache_epoch != c->epoch) {
        return KVP_TICKET_STALE;
    }
    return KVP_OK;
}

static void apply_commit(sticket *t, scache *c)
{
    memcpy(c->x[c->kv.len], t->x, sizeof t->x);
    skv_append(&c->kv, c->batch, t->key, t->value);
    c->epoch++;
    map_ticket_pages(t); /* the reserved pages moved into the cache's tables */
    t->state = T_COMMITTED;
}

void op_commit(reader *r)
{
    sticket *t = &W.ticket[rd(r) % N_TICKETS];
    scache *c = &W.cache[rd(r) % N_CACHES];
    if (!t->live || !c->live) {
        return;
    }
    g_op_name = "ticket_commit";
    kvp_status want = expect_commit(t, c);
    digests before;
    take_digests(&before);
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_ticket_commit(t->ticket, c->cache, &err);
    check_status(status, want, &err);
    if (status != KVP_OK) {
        check_unchanged(&before);
        return;
    }
    check_untouched(&err);
    apply_commit(t, c);
}

enum { SHAPE_OK, SHAPE_RANK, SHAPE_TOKENS, SHAPE_BATCH, SHAPE_WIDTH };

/* prepare's checks before any arithmetic, in the seed's order, then the math. */
static kvp_status expect_prepare(int shape, int alien, const slayer *layer, const scache *c,
                                 const sticket *t, const double *x, expect *e)
{
    memset(e, 0, sizeof *e);
    static const kvp_status shape_status[] = {KVP_OK, KVP_INPUT_RANK, KVP_SINGLE_TOKEN_REQUIRED,
                                              KVP_INPUT_BATCH_MISMATCH,
                                              KVP_INPUT_WIDTH_MISMATCH};
    if (shape != SHAPE_OK) {
        return e->status = shape_status[shape];
    }
    if (alien) {
        return e->status = alien == 1 ? KVP_CACHE_HEAD_COUNT_MISMATCH
                                      : KVP_CACHE_MODEL_WIDTH_MISMATCH;
    }
    const slayer *bound = &W.layer[c->layer];
    if (layer->pset != bound->pset) {
        return e->status = KVP_CACHE_LAYER_MISMATCH;
    }
    int stale = stale_parameter(c->version, layer->pset);
    if (stale >= 0) {
        e->parameter = (size_t)stale;
        return e->status = KVP_CACHE_LAYER_REVISION_MISMATCH;
    }
    if (layer->base != bound->base) {
        return e->status = KVP_CACHE_ROPE_MISMATCH;
    }
    if (c->kv.len == c->capacity) {
        return e->status = KVP_FULL;
    }
    if (t->state == T_PREPARED) {
        return e->status = KVP_TICKET_BUSY;
    }
    if (t->batch != c->batch || t->capacity < c->capacity) {
        return e->status = KVP_TICKET_GEOMETRY_MISMATCH;
    }
    if (s_attend(layer, &c->kv, c->batch, x, e) != KVP_OK) {
        return e->status;
    }
    size_t needed = c->kv.len % W.bt == 0 ? c->batch : 0;
    if (needed > free_pages()) {
        return e->status = KVP_POOL_EXHAUSTED;
    }
    return e->status = KVP_OK;
}

/* The prepared row against the full-prefix reference on the shadow's inputs. */
static void compare_with_reference(const slayer *layer, const scache *c, const sticket *t,
                                   const expect *e)
{
    kvp_attention_result result;
    kvp_error err;
    g_auditing = 1;
    kvp_status status = kvp_ticket_result(t->ticket, &result, &err);
    check_status(status, KVP_OK, &err);
    size_t d = W.d, tokens = c->kv.len + 1;
    CHECK(result.keys == tokens, "result keys %zu, expected %zu", result.keys, tokens);
    compare_rows("output vs shadow", result.output, e->out, c->batch * d);

    double input[MAX_B * (MAX_CAP + 1) * MAX_D];
    double output[MAX_B * (MAX_CAP + 1) * MAX_D];
    for (size_t lane = 0; lane < c->batch; lane++) {
        for (size_t pos = 0; pos < tokens; pos++) {
            const double *row = pos < c->kv.len ? c->x[pos] : t->x;
            memcpy(input + (lane * tokens + pos) * d, row + lane * d, d * sizeof *row);
        }
    }
    kvp_tensor view = kvp_tensor3(input, c->batch, tokens, d);
    status = kvp_attention_reference(layer->layer, &view, output, c->batch * tokens * d, NULL,
                                     NULL, 0, &err);
    check_status(status, KVP_OK, &err);
    for (size_t lane = 0; lane < c->batch; lane++) {
        compare_rows("output vs kvp_attention_reference", result.output + lane * d,
                     output + (lane * tokens + tokens - 1) * d, d);
    }
    g_auditing = 0;
}

/* Shared by prepare and forward: decode, predict, call, check, apply. */
static void prepare_or_forward(reader *r, int forward)
{
    uint8_t sel = rd(r);
    scache *c = &W.cache[rd(r) % N_CACHES];
    sticket *t = &W.ticket[rd(r) % N_TICKETS];
    uint8_t shape_byte = rd(r);
    int shape = shape_byte < 240 ? SHAPE_OK : 1 + shape_byte % 4;
    double x[2 * (MAX_B + 1) * (MAX_D + 2)];
    memset(x, 0, sizeof x);
    if (!c->live || !t->live) {
        return;
    }
    read_values(r, x, c->batch * W.d);
    g_op_name = forward ? "attention_forward" : "attention_prepare";
    int which = sel % 8 < 6 ? c->layer : (c->layer + 1 + sel % 2) % N_LAYERS;
    const slayer *layer = &W.layer[which];
    int alien = sel % 16 == 15 ? 1 : sel % 16 == 14 ? 2 : 0; /* W.alien, W.wide */

    kvp_tensor input = kvp_tensor3(x, c->batch, 1, W.d);
    if (shape == SHAPE_RANK) {
        input.shape.rank = 2;
        input.shape.dims[1] = W.d;
    } else if (shape == SHAPE_TOKENS) {
        input.shape.dims[1] = 2;
    } else if (shape == SHAPE_BATCH) {
        input.shape.dims[0] = c->batch + 1;
    } else if (shape == SHAPE_WIDTH) {
        input.shape.dims[2] = W.d + 2;
    } else if (alien == 2) {
        input.shape.dims[2] = 2 * W.d; /* the wide layer's width */
    }
    expect e;
    kvp_status want = expect_prepare(shape, alien, layer, c, t, x, &e);
    digests before;
    take_digests(&before);
    kvp_error err;
    poison(&err);
    const kvp_layer *callee = alien == 1 ? W.alien : alien == 2 ? W.wide : layer->layer;
    kvp_status status = forward ? kvp_attention_forward(callee, &input, c->cache, t->ticket, &err)
                                : kvp_attention_prepare(callee, &input, c->cache, t->ticket, &err);
    check_status(status, want, &err);
    if (status != KVP_OK) {
        check_detail(&err, &e);
        if (want == KVP_POOL_EXHAUSTED) {
            W.exhaustions++;
            CHECK(err.needed == c->batch && err.available == free_pages(),
                  "exhausted: needed %zu available %zu, expected %zu and %zu", err.needed,
                  err.available, c->batch, free_pages());
        }
        check_unchanged(&before);
        /* A ticket holding a prepared row keeps it; any other ends up empty. */
        if (t->state != T_PREPARED) {
            t->state = T_EMPTY;
        }
        return;
    }
    check_untouched(&err);
    size_t needed = c->kv.len % W.bt == 0 ? c->batch : 0;
    CHECK(t->reserved == 0 && t->borrowed_count == 0, "a prepare over a reservation");
    take_pages(t, needed);
    t->state = T_PREPARED;
    t->reserved = needed;
    t->cache_uid = c->uid;
    t->cache_epoch = c->epoch;
    t->len_at = c->kv.len;
    memcpy(t->key, e.key, sizeof t->key);
    memcpy(t->value, e.value, sizeof t->value);
    memcpy(t->x, x, c->batch * W.d * sizeof *x);
    compare_with_reference(layer, c, t, &e);
    if (forward) {
        apply_commit(t, c);
    }
}

void op_prepare(reader *r)
{
    prepare_or_forward(r, 0);
}

void op_forward(reader *r)
{
    prepare_or_forward(r, 1);
}
