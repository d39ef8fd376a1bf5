/*
 * reservation.h: pages taken from the pool ahead of the appends that will
 * use them.
 *
 * Owns: a list of reserved page ids whose storage the owner provides
 * (allocated once, with the ticket, step or cache that embeds the
 * reservation), so reserving, consuming and returning pages allocate nothing.
 *
 * Invariants: entries[next..count) are the pages still reserved, each holding
 * one reference; the reservation is attached to its pool exactly while
 * next < count. All changes happen under the pool lock.
 *
 * Life: empty --fill--> holding --consume_locked (each page moves, reference
 * and all, into a page table)--> empty; release returns what is left.
 * Callers: cache.c (its private append and external caches' row
 * reservations), attention tickets and steps.
 */
#ifndef KVPAGER_PAGER_RESERVATION_H
#define KVPAGER_PAGER_RESERVATION_H

#include <stddef.h>
#include <stdint.h>

#include "pager/pool_internal.h"

typedef struct kvpi_reservation {
    kvpi_holder holder;
    kvp_pool *pool;
    uint32_t *entries; /* owner-provided storage of `capacity` ids */
    size_t capacity;
    size_t count;      /* entries filled */
    size_t next;       /* entries consumed */
    /*
     * Refunds (sliding windows, DESIGN "Admission and promises"): when
     * refund_promise is set, it is a level (the pages held plus the promise
     * when it was set). refund_deficit counts the pages fills took beyond
     * *refund_promise and no release has paid back yet; a window release by
     * a commit through this reservation pays that first and gives the rest
     * back to the promise (kvpi_reservation_refund_locked).
     */
    size_t *refund_promise;
    size_t refund_deficit;
} kvpi_reservation;

void kvpi_reservation_init(kvpi_reservation *r, kvp_pool *pool, uint32_t *storage,
                           size_t capacity);

/* Pages reserved and not yet consumed. */
size_t kvpi_reservation_remaining(const kvpi_reservation *r);

/*
 * Reserves n more pages, all or none. POOL_EXHAUSTED when the pool has fewer
 * than n free; INVALID_ARGUMENT when n exceeds the storage left. Takes the
 * pool lock.
 */
kvp_status kvpi_reservation_fill(kvpi_reservation *r, size_t n, kvp_error *err);

/*
 * Under the pool lock: `released` pages of a windowed cache went back to the
 * pool; they pay refund_deficit first and the rest go back into
 * *refund_promise (none without one), so the pages held plus the promise
 * stay at the level, never above, in the same hold of the lock as the
 * release.
 */
void kvpi_reservation_refund_locked(kvpi_reservation *r, size_t released);

/* fill, and the pages taken are drawn from *promise first (see pool_internal.h). */
kvp_status kvpi_reservation_fill_promised(kvpi_reservation *r, size_t n, size_t *promise,
                                          kvp_error *err);

/*
 * fill_promised with tentative pages (kvpi_pool_take_tentative_locked): the
 * caller must later confirm or cancel exactly n pages with the pool.
 */
kvp_status kvpi_reservation_fill_tentative(kvpi_reservation *r, size_t n, size_t *promise,
                                           kvp_error *err);

/* kvpi_reservation_fill_tentative with the pool lock already held. */
kvp_status kvpi_reservation_fill_tentative_locked(kvpi_reservation *r, size_t n, size_t *promise,
                                                  kvp_error *err);

/*
 * Under the pool lock: hands the next reserved page, and its reference, to the
 * caller, who maps it into a page table (and has written or will write it).
 * A page the fill borrowed from the LRU list is evicted then (its index entry
 * dropped, counted in `evictions`; pool_internal.h); pages released unused
 * go back to their LRU place with their keys. Precondition: remaining > 0.
 */
uint32_t kvpi_reservation_consume_locked(kvpi_reservation *r);

/* The page that consume would hand out `ahead` calls from now, without taking it. */
uint32_t kvpi_reservation_peek(const kvpi_reservation *r, size_t ahead);

/* Returns every page still reserved to the pool. Takes the pool lock. */
void kvpi_reservation_release(kvpi_reservation *r);
/* The same, with the pool lock already held. */
void kvpi_reservation_release_locked(kvpi_reservation *r);

#endif /* KVPAGER_PAGER_RESERVATION_H */
