/*
 * tier_compose.c: two tiers as one (kvp_tier_compose_create, kvpager/tier.h):
 * a near tier (host memory) in front of a far one (a shared store).
 *
 * Owns: the composition (the two tiers, which it does not own, and a count
 * of its batches in flight) and each batch's call record.
 *   contains, get: the near tier first; the blocks it does not hold (or
 *     failed) are asked of the far tier in one batch; a get the far tier
 *     serves is put to the near tier (promoted) before the caller's done.
 *   put: to both, each with its own copy of the block array; a block is
 *     stored (KVP_OK) when either tier took it, else it has the far tier's
 *     failure.
 * Invariants: a call record lives until its batch's done has returned;
 * `inflight` counts call records (under kvpi_tier_count_lock, library-wide:
 * tier_internal.h), and destroy waits for it to reach zero, so no
 * completion touches a freed composition.
 * Callers: the kvp_tier handle (tier.c), from any thread; the two tiers'
 * completions, from theirs.
 */
#include "pager/tier_internal.h"

#include <pthread.h>
#include <string.h>

#include "pager/alloc.h"
#include "pager/error.h"

typedef struct compose {
    kvp_tier *near;
    kvp_tier *far;
    size_t inflight; /* under kvpi_tier_count_lock (tier_internal.h) */
} compose;

typedef struct call {
    compose *c;
    kvp_tier_op op;
    kvp_tier_block *blocks; /* the caller's */
    size_t count;
    kvp_tier_done_fn done;
    void *ctx;
    kvp_tier_block *sub; /* [count]: the far tier's batch (get, contains) or copies (put) */
    size_t *map;         /* [count]: sub[i] is blocks[map[i]] */
    size_t nsub;
    kvp_tier_block *near_copy; /* put: the near tier's copy of the array */
    int pending;               /* put: completions still to come */
} call;

static const char compose_name[] = "compose";

static void compose_release(compose *c)
{
    pthread_mutex_lock(&kvpi_tier_count_lock);
    if (--c->inflight == 0) {
        pthread_cond_broadcast(&kvpi_tier_count_cond);
    }
    pthread_mutex_unlock(&kvpi_tier_count_lock);
}

/* Completes the caller's batch and frees the record. */
static void call_finish(call *k)
{
    compose *c = k->c;
    k->done(k->ctx, k->blocks, k->count);
    kvpi_free(k->sub);
    kvpi_free(k->map);
    kvpi_free(k->near_copy);
    kvpi_free(k);
    compose_release(c);
}

static void promote_done(void *ctx, kvp_tier_block *blocks, size_t count)
{
    (void)blocks;
    (void)count;
    kvpi_free(ctx);
}

/* Puts the far tier's get hits to the near tier (which copies them at once). */
static void promote(call *k)
{
    kvp_tier_block *up = kvpi_calloc(KVPI_SITE_SCRATCH, k->nsub, sizeof *up);
    if (up == NULL) {
        return; /* not promoted: a later get asks the far tier again */
    }
    size_t n = 0;
    for (size_t i = 0; i < k->nsub; i++) {
        const kvp_tier_block *b = &k->sub[i];
        if (b->status == KVP_OK && b->bytes != 0) {
            up[n] = *b;
            up[n].status = KVP_OK;
            n++;
        }
    }
    if (n == 0 || kvp_tier_issue(k->c->near, KVP_TIER_PUT, up, n, promote_done, up, NULL) !=
                      KVP_OK) {
        kvpi_free(up);
    }
}

static void far_done(void *ctx, kvp_tier_block *blocks, size_t count)
{
    call *k = ctx;
    for (size_t i = 0; i < count; i++) {
        k->blocks[k->map[i]].bytes = blocks[i].bytes;
        k->blocks[k->map[i]].status = blocks[i].status;
    }
    if (k->op == KVP_TIER_GET) {
        promote(k);
    }
    call_finish(k);
}

static void near_done(void *ctx, kvp_tier_block *blocks, size_t count)
{
    call *k = ctx;
    k->nsub = 0;
    for (size_t i = 0; i < count; i++) {
        if (blocks[i].status != KVP_OK || blocks[i].bytes == 0) {
            k->sub[k->nsub] = blocks[i];
            k->sub[k->nsub].bytes = 0;
            k->sub[k->nsub].status = KVP_OK;
            k->map[k->nsub++] = i;
        }
    }
    if (k->nsub == 0 ||
        kvp_tier_issue(k->c->far, k->op, k->sub, k->nsub, far_done, k, NULL) != KVP_OK) {
        call_finish(k); /* the near tier's answers stand */
    }
}

static void put_half_done(void *ctx, kvp_tier_block *blocks, size_t count)
{
    (void)blocks;
    (void)count;
    call *k = ctx;
    pthread_mutex_lock(&kvpi_tier_count_lock);
    int last = --k->pending == 0;
    pthread_mutex_unlock(&kvpi_tier_count_lock);
    if (!last) {
        return;
    }
    for (size_t i = 0; i < k->count; i++) {
        kvp_status near = k->near_copy[i].status;
        k->blocks[i].status = near == KVP_OK ? KVP_OK : k->sub[i].status;
    }
    call_finish(k);
}

/* A call record for a batch, counted in flight; NULL when it cannot be allocated. */
static call *call_new(compose *c, kvp_tier_op op, kvp_tier_block *blocks, size_t count,
                      kvp_tier_done_fn done, void *ctx)
{
    call *k = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *k);
    if (k == NULL || (k->sub = kvpi_calloc(KVPI_SITE_SCRATCH, count, sizeof *k->sub)) == NULL ||
        (k->map = kvpi_calloc(KVPI_SITE_SCRATCH, count, sizeof *k->map)) == NULL ||
        (op == KVP_TIER_PUT &&
         (k->near_copy = kvpi_calloc(KVPI_SITE_SCRATCH, count, sizeof *k->near_copy)) == NULL)) {
        if (k != NULL) {
            kvpi_free(k->sub);
            kvpi_free(k->map);
            kvpi_free(k);
        }
        return NULL;
    }
    k->c = c;
    k->op = op;
    k->blocks = blocks;
    k->count = count;
    k->done = done;
    k->ctx = ctx;
    pthread_mutex_lock(&kvpi_tier_count_lock);
    c->inflight++;
    pthread_mutex_unlock(&kvpi_tier_count_lock);
    return k;
}

/* Both puts are issued before this returns, so both tiers have copied the bytes. */
static void put_both(call *k)
{
    memcpy(k->near_copy, k->blocks, k->count * sizeof *k->blocks);
    memcpy(k->sub, k->blocks, k->count * sizeof *k->blocks);
    k->pending = 2;
    kvp_tier_block *halves[2] = {k->near_copy, k->sub};
    kvp_tier *tiers[2] = {k->c->near, k->c->far};
    for (size_t h = 0; h < 2; h++) {
        if (kvp_tier_issue(tiers[h], KVP_TIER_PUT, halves[h], k->count, put_half_done, k,
                           NULL) != KVP_OK) {
            for (size_t i = 0; i < k->count; i++) {
                halves[h][i].status = KVP_TIER_UNAVAILABLE;
            }
            put_half_done(k, halves[h], k->count);
        }
    }
}

static kvp_status compose_batch(void *impl, kvp_tier_op op, kvp_tier_block *blocks,
                                size_t count, kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    call *k = call_new(impl, op, blocks, count, done, ctx);
    if (k == NULL) {
        return kvpi_fail_alloc(err, "composed tier batch", count * sizeof *blocks);
    }
    if (op == KVP_TIER_PUT) {
        put_both(k);
        return KVP_OK;
    }
    kvp_status status = kvp_tier_issue(k->c->near, op, blocks, count, near_done, k, err);
    if (status != KVP_OK) {
        /* Not accepted: done is never called, nothing is left in flight. */
        kvpi_free(k->sub);
        kvpi_free(k->map);
        kvpi_free(k);
        compose_release(impl);
    }
    return status;
}

static kvp_status compose_contains(void *impl, kvp_tier_block *blocks, size_t count,
                                   kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    return compose_batch(impl, KVP_TIER_CONTAINS, blocks, count, done, ctx, err);
}

static kvp_status compose_get(void *impl, kvp_tier_block *blocks, size_t count,
                              kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    return compose_batch(impl, KVP_TIER_GET, blocks, count, done, ctx, err);
}

static kvp_status compose_put(void *impl, kvp_tier_block *blocks, size_t count,
                              kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    return compose_batch(impl, KVP_TIER_PUT, blocks, count, done, ctx, err);
}

/* Waits for every batch in flight (they complete through the two tiers), then frees. */
static void compose_destroy(void *impl)
{
    compose *c = impl;
    pthread_mutex_lock(&kvpi_tier_count_lock);
    while (c->inflight != 0) {
        pthread_cond_wait(&kvpi_tier_count_cond, &kvpi_tier_count_lock);
    }
    pthread_mutex_unlock(&kvpi_tier_count_lock);
    kvpi_free(c);
}

kvp_status kvp_tier_compose_create(kvp_tier *near, kvp_tier *far, kvp_tier **out,
                                   kvp_error *err)
{
    static const char *const names[] = {"near", "far", "out"};
    const void *args[] = {near, far, out};
    for (size_t i = 0; i < 3; i++) {
        if (args[i] == NULL) {
            return kvpi_fail_null(err, names[i]);
        }
    }
    if (near == far) {
        return kvpi_fail_invalid(err, "far", "is the near tier itself");
    }
    if (kvp_tier_keys_only(near) || kvp_tier_keys_only(far)) {
        return kvpi_fail_invalid(err, kvp_tier_keys_only(near) ? "near" : "far",
                                 "keeps keys only (kvp_tier_host_keys_create): it composes "
                                 "with no tier");
    }
    compose *c = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *c);
    if (c == NULL) {
        return kvpi_fail_alloc(err, "composed tier", sizeof *c);
    }
    c->near = near;
    c->far = far;
    kvp_tier_vtable v;
    kvp_tier_vtable_init(&v);
    v.name = compose_name;
    v.contains = compose_contains;
    v.get = compose_get;
    v.put = compose_put;
    v.destroy = compose_destroy;
    kvp_status status = kvp_tier_create(&v, c, out, err);
    if (status != KVP_OK) {
        compose_destroy(c);
    }
    return status;
}
