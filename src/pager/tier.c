/*
 * tier.c: the kvp_tier handle (kvpager/tier.h): a copy of an
 * implementation's vtable and its state, the checked batch call
 * (kvp_tier_issue) and the waiting one (kvp_tier_run).
 *
 * Invariants: a handle's vtable has every function (kvp_tier_create checks);
 * kvp_tier_issue calls the implementation only with valid arguments; a
 * waiter of kvp_tier_run lives on its caller's stack until its batch's done
 * has set its flag under the handle's wait_lock; the lock and condition
 * are the handle's (they live until kvp_tier_destroy), never the stack's,
 * so a done still returning from its unlock touches no freed memory (the
 * pattern helgrind flags, and the Redis store avoids too).
 * Callers: the public API; tier_pool.c (write-back and load).
 */
#include "pager/tier_internal.h"

#include <pthread.h>
#include <string.h>

#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/error.h"

pthread_mutex_t kvpi_tier_count_lock = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t kvpi_tier_count_cond = PTHREAD_COND_INITIALIZER;

#define KVPI_TIER_VTABLE_SIZE_FIRST sizeof(kvp_tier_vtable)

void kvp_tier_vtable_init(kvp_tier_vtable *vtable)
{
    if (vtable != NULL) {
        memset(vtable, 0, sizeof *vtable);
        vtable->struct_size = sizeof *vtable;
    }
}

kvp_status kvp_tier_create(const kvp_tier_vtable *vtable, void *impl, kvp_tier **out,
                           kvp_error *err)
{
    if (vtable == NULL) {
        return kvpi_fail_null(err, "vtable");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_status status =
        kvpi_struct_size_check(vtable->struct_size, KVPI_TIER_VTABLE_SIZE_FIRST, err);
    if (status == KVP_OK) {
        status = kvpi_struct_tail_check(vtable, vtable->struct_size, sizeof *vtable, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    static const char *const names[] = {"contains", "get", "put"};
    const kvp_tier_batch_fn calls[] = {vtable->contains, vtable->get, vtable->put};
    for (size_t i = 0; i < 3; i++) {
        if (calls[i] == NULL) {
            return kvpi_fail_null(err, names[i]);
        }
    }
    if (vtable->destroy == NULL) {
        return kvpi_fail_null(err, "destroy");
    }
    kvp_tier *tier = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *tier);
    if (tier == NULL) {
        return kvpi_fail_alloc(err, "tier", sizeof *tier);
    }
    memcpy(&tier->vtable, vtable, KVPI_TIER_VTABLE_SIZE_FIRST);
    tier->vtable.struct_size = sizeof tier->vtable;
    if (tier->vtable.name == NULL) {
        tier->vtable.name = "unnamed";
    }
    tier->impl = impl;
    pthread_mutex_init(&tier->wait_lock, NULL);
    pthread_cond_init(&tier->wait_cond, NULL);
    *out = tier;
    return KVP_OK;
}

kvp_status kvp_tier_destroy(kvp_tier *tier, kvp_error *err)
{
    (void)err;
    if (tier == NULL) {
        return KVP_OK;
    }
    tier->vtable.destroy(tier->impl);
    pthread_cond_destroy(&tier->wait_cond);
    pthread_mutex_destroy(&tier->wait_lock);
    kvpi_free(tier);
    return KVP_OK;
}

const char *kvp_tier_name(const kvp_tier *tier)
{
    return tier == NULL ? "none" : tier->vtable.name;
}

void *kvpi_tier_impl_of(kvp_tier *tier, const char *name)
{
    return tier != NULL && tier->vtable.name == name ? tier->impl : NULL;
}

kvp_status kvp_tier_issue(kvp_tier *tier, kvp_tier_op op, kvp_tier_block *blocks, size_t count,
                          kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    if (tier == NULL) {
        return kvpi_fail_null(err, "tier");
    }
    if (blocks == NULL && count != 0) {
        return kvpi_fail_null(err, "blocks");
    }
    if (done == NULL) {
        return kvpi_fail_null(err, "done");
    }
    kvp_tier_batch_fn call = NULL;
    switch (op) {
    case KVP_TIER_CONTAINS:
        call = tier->vtable.contains;
        break;
    case KVP_TIER_GET:
        call = tier->vtable.get;
        break;
    case KVP_TIER_PUT:
        call = tier->vtable.put;
        break;
    default:
        return kvpi_fail_invalid(err, "op", "must be KVP_TIER_CONTAINS, GET or PUT");
    }
    if (count == 0) {
        done(ctx, blocks, 0);
        return KVP_OK;
    }
    return call(tier->impl, blocks, count, done, ctx, err);
}

/* kvp_tier_run's rendezvous with the batch's done. */
typedef struct waiter {
    kvp_tier *tier;
    int finished;
} waiter;

static void waiter_done(void *ctx, kvp_tier_block *blocks, size_t count)
{
    (void)blocks;
    (void)count;
    waiter *w = ctx;
    kvp_tier *tier = w->tier;
    pthread_mutex_lock(&tier->wait_lock);
    w->finished = 1;
    pthread_cond_broadcast(&tier->wait_cond); /* waiters of other batches recheck */
    pthread_mutex_unlock(&tier->wait_lock);
}

kvp_status kvp_tier_run(kvp_tier *tier, kvp_tier_op op, kvp_tier_block *blocks, size_t count,
                        kvp_error *err)
{
    waiter w = {.tier = tier, .finished = 0};
    kvp_status status = kvp_tier_issue(tier, op, blocks, count, waiter_done, &w, err);
    if (status == KVP_OK) {
        pthread_mutex_lock(&tier->wait_lock);
        while (!w.finished) {
            pthread_cond_wait(&tier->wait_cond, &tier->wait_lock);
        }
        pthread_mutex_unlock(&tier->wait_lock);
    }
    return status;
}
