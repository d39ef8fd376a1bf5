/*
 * reservation.c: reserved pages (see reservation.h).
 */
#include "pager/reservation.h"

#include "pager/error.h"

static void reservation_audit(const kvpi_holder *holder, kvpi_audit *audit);

static const kvpi_holder_ops reservation_ops = {KVPI_HOLDER_RESERVATION, reservation_audit};

static const kvpi_reservation *reservation_of(const kvpi_holder *holder)
{
    return (const kvpi_reservation *)(const void *)((const char *)holder -
                                                     offsetof(kvpi_reservation, holder));
}

static void reservation_audit(const kvpi_holder *holder, kvpi_audit *audit)
{
    const kvpi_reservation *r = reservation_of(holder);
    if (r->next >= r->count || r->count > r->capacity) {
        kvpi_audit_report(audit, KVP_INVARIANT_STATS, "an attached reservation holds pages",
                          SIZE_MAX, SIZE_MAX, 1, 0);
        return;
    }
    for (size_t i = r->next; i < r->count; i++) {
        kvpi_audit_reference(audit, r->entries[i]);
    }
}

void kvpi_reservation_init(kvpi_reservation *r, kvp_pool *pool, uint32_t *storage,
                           size_t capacity)
{
    r->holder.prev = NULL;
    r->holder.next = NULL;
    r->holder.ops = &reservation_ops;
    r->pool = pool;
    r->entries = storage;
    r->capacity = capacity;
    r->count = 0;
    r->next = 0;
    r->refund_promise = NULL;
    r->refund_deficit = 0;
}

void kvpi_reservation_refund_locked(kvpi_reservation *r, size_t released)
{
    if (r->refund_promise == NULL) {
        return;
    }
    size_t paid = released < r->refund_deficit ? released : r->refund_deficit;
    r->refund_deficit -= paid;
    if (released > paid) {
        kvpi_pool_promise_set_locked(r->pool, r->refund_promise,
                                     *r->refund_promise + (released - paid));
    }
}

size_t kvpi_reservation_remaining(const kvpi_reservation *r)
{
    return r->count - r->next;
}

kvp_status kvpi_reservation_fill(kvpi_reservation *r, size_t n, kvp_error *err)
{
    return kvpi_reservation_fill_promised(r, n, NULL, err);
}

static kvp_status fill_locked(kvpi_reservation *r, size_t n, size_t *promise, int tentative,
                              kvp_error *err)
{
    if (n == 0) {
        return KVP_OK;
    }
    if (r->next == r->count) {
        /* Empty: restart at the front of the storage. */
        r->next = 0;
        r->count = 0;
    }
    if (n > r->capacity - r->count) {
        return kvpi_fail_invalid(err, "pages", "more pages than the reservation can hold");
    }
    kvp_status status =
        tentative ? kvpi_pool_take_tentative_locked(r->pool, n, r->entries + r->count, err)
                  : kvpi_pool_take_locked(r->pool, n, r->entries + r->count, err);
    if (status == KVP_OK) {
        if (r->next == r->count) {
            kvpi_pool_attach_locked(r->pool, &r->holder);
        }
        r->count += n;
        if (promise != NULL) {
            size_t before = *promise;
            kvpi_pool_promise_consume_locked(r->pool, promise, n);
            if (promise == r->refund_promise) {
                r->refund_deficit += n - (before - *promise); /* taken beyond the promise */
            }
        } else {
            kvpi_pool_note_commit_locked(r->pool, n);
        }
    }
    return status;
}

static kvp_status fill(kvpi_reservation *r, size_t n, size_t *promise, int tentative,
                       kvp_error *err)
{
    if (n == 0) {
        return KVP_OK;
    }
    kvpi_pool_lock(r->pool);
    kvp_status status = fill_locked(r, n, promise, tentative, err);
    kvpi_pool_unlock(r->pool);
    return status;
}

kvp_status kvpi_reservation_fill_tentative_locked(kvpi_reservation *r, size_t n, size_t *promise,
                                                  kvp_error *err)
{
    return fill_locked(r, n, promise, 1, err);
}

kvp_status kvpi_reservation_fill_promised(kvpi_reservation *r, size_t n, size_t *promise,
                                          kvp_error *err)
{
    return fill(r, n, promise, 0, err);
}

kvp_status kvpi_reservation_fill_tentative(kvpi_reservation *r, size_t n, size_t *promise,
                                           kvp_error *err)
{
    return fill(r, n, promise, 1, err);
}

uint32_t kvpi_reservation_consume_locked(kvpi_reservation *r)
{
    uint32_t page = r->entries[r->next++];
    /* Mapped, so final and written: a page borrowed from the LRU list loses its key now. */
    kvpi_pool_evict_borrowed_locked(r->pool, page);
    if (r->next == r->count) {
        kvpi_pool_detach_locked(r->pool, &r->holder);
        r->next = 0;
        r->count = 0;
    }
    return page;
}

uint32_t kvpi_reservation_peek(const kvpi_reservation *r, size_t ahead)
{
    return r->entries[r->next + ahead];
}

void kvpi_reservation_release_locked(kvpi_reservation *r)
{
    if (r->next == r->count) {
        return;
    }
    /* Newest first, so the free list gives the pages back in reservation order. */
    for (size_t i = r->count; i > r->next; i--) {
        kvpi_pool_put_locked(r->pool, r->entries[i - 1]);
    }
    kvpi_pool_detach_locked(r->pool, &r->holder);
    r->next = 0;
    r->count = 0;
}

void kvpi_reservation_release(kvpi_reservation *r)
{
    if (r->pool == NULL || r->next == r->count) {
        return;
    }
    kvpi_pool_lock(r->pool);
    kvpi_reservation_release_locked(r);
    kvpi_pool_unlock(r->pool);
}
