/*
 * pool_internal.h: the pool as the rest of the library sees it.
 *
 * Owns: struct kvp_pool, the holder registry through which the audit finds
 * every page reference, and the locked page primitives.
 *
 * Locking rule (makes kvp_pool_check exact while other threads work): the
 * pool's free list, reference counts, counters, holder list, and every
 * holder's reference state (a cache's len and page tables, a reservation's
 * entries) change only while pool->lock is held. Row data inside a page is
 * not reference state; the page's single owner writes it without the lock.
 *
 * Callers: src/pager (cache.c, reservation.c); attention reads pages through
 * kvpi_pool_page only.
 */
#ifndef KVPAGER_PAGER_POOL_INTERNAL_H
#define KVPAGER_PAGER_POOL_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "kvpager/pool.h"
#include "pager/alloc.h"

/* A page-table slot that maps no page. Page ids are below it. */
#define KVPI_NO_PAGE UINT32_MAX

/*
 * registered[page]: the index names the page and lookups find it (INDEXED),
 * or the index still holds its entry but the page is borrowed by a
 * transaction that took it from the LRU list, and lookups skip it
 * (BORROWED). Either is nonzero: "registered".
 */
#define KVPI_PAGE_INDEXED 1u
#define KVPI_PAGE_BORROWED 2u

typedef struct kvpi_audit kvpi_audit;
typedef struct kvpi_holder kvpi_holder;

typedef enum kvpi_holder_kind { KVPI_HOLDER_CACHE, KVPI_HOLDER_RESERVATION } kvpi_holder_kind;

typedef struct kvpi_holder_ops {
    kvpi_holder_kind kind;
    /*
     * Called by the audit under the pool lock: report every page reference the
     * holder owns with kvpi_audit_reference, and any broken invariant of the
     * holder's own with kvpi_audit_report.
     */
    void (*audit)(const kvpi_holder *holder, kvpi_audit *audit);
} kvpi_holder_ops;

/* Embedded in each cache and reservation; linked into the pool while attached. */
struct kvpi_holder {
    kvpi_holder *prev;
    kvpi_holder *next;
    const kvpi_holder_ops *ops;
};

struct kvp_pool {
    pthread_mutex_t lock;
    size_t block_tokens;
    size_t heads;
    size_t head_width;
    kvp_dtype dtype;       /* the pages' element type (kvpager/pool.h) */
    size_t element_bytes;  /* kvp_dtype_bytes(dtype) */
    size_t page_bytes;     /* 2 * heads * block_tokens * head_width * element_bytes */
    size_t total_pages;
    void *slab;            /* total_pages * page_bytes, never moves */
    kvpi_slab slab_from;   /* the slab's source, for kvpi_slab_free; .base == slab */
    uint32_t *free_stack;  /* [total_pages]; the top is free_stack[free_count - 1] */
    size_t free_count;
    uint32_t *refcount;    /* [total_pages]; 0 exactly for free pages */
    uint32_t *audit_counts;/* [total_pages]; scratch of the audit, so it allocates nothing */
    kvpi_holder holders;   /* sentinel of the circular holder list */
    size_t attached_caches;
    size_t attached_reservations;
    size_t high_water_pages;
    uint64_t acquires;
    uint64_t releases;
    uint64_t exhaustions;
    size_t promised;       /* pages promised to sequences and not yet taken */
    /*
     * Commitment (kvpi_pool_note_commit_locked; DESIGN "Admission and
     * promises"): the most held + promised pages seen at once, noted after
     * every take (its promise drawn), adoption of an evictable page and
     * promise set; and the pages taken beyond the taker's promise (or
     * with none). While `overdrawn` is 0, `commit_high_water` <= total
     * is what admission guarantees. Diagnostics for the tests: read
     * nowhere else.
     */
    size_t commit_high_water;
    size_t overdrawn;
    size_t tentative;      /* held pages of transactions not yet confirmed (prefills) */
    /*
     * Sharing (prefix.c): the prefix index and the evictable LRU list. A
     * page is `registered` while the index names it, under page_key[page].
     * A registered page at refcount 0 is evictable: on the LRU list (oldest
     * at lru_head), neither free nor held. All under `lock`.
     * A take that finds no free page *borrows* the least recently used
     * evictable page (registered = KVPI_PAGE_BORROWED): it leaves the LRU
     * list and is held by the taker's reservation, but keeps its key, its
     * index slot and its LRU stamp, and lookups do not see it. When the
     * reservation hands it to a page table (the take is final and the page
     * written), it is evicted: its index entry goes and `evictions` counts
     * it. When it goes back unused (a cancelled transaction), it returns to
     * the index's view and to its place on the LRU list (lru_stamp order).
     */
    void *metadata;        /* the one allocation every array below lives in */
    kvp_block_key *page_key; /* [total_pages] */
    kvp_block_key *page_binding; /* [total_pages]; the binding digest a registered page was
                                    published under (the publisher's), zero when unregistered */
    uint64_t *lru_stamp;   /* [total_pages]; lru_clock when the page last went on the LRU list */
    uint64_t lru_clock;    /* stamps handed out; the LRU list is in increasing stamp order */
    uint32_t *registered;  /* [total_pages]; 0, KVPI_PAGE_INDEXED or KVPI_PAGE_BORROWED */
    uint32_t *lru_prev;    /* [total_pages]; KVPI_NO_PAGE ends the list */
    uint32_t *lru_next;    /* [total_pages] */
    uint32_t lru_head;     /* least recently used evictable page, or KVPI_NO_PAGE */
    uint32_t lru_tail;     /* most recently used */
    size_t evictable;      /* pages on the LRU list */
    uint32_t *index;       /* [index_slots]: page ids (KVPI_NO_PAGE empty), linear probing */
    size_t index_slots;    /* a power of two >= 2 * total_pages */
    size_t cached;         /* registered pages (index entries) */
    uint64_t prefix_hits;
    uint64_t prefix_misses;
    uint64_t evictions;
    uint64_t cow_copies;
    uint64_t window_releases; /* pages front truncation released (cache_window.c) */
    /* The key of the prefix-index hash (share.c): the config's, or random. Never changes. */
    unsigned char key_secret[KVP_KEY_SECRET_BYTES];
    /*
     * The second tier (tier_pool.c, kvpager/tier.h), NULL when none; set and
     * cleared under `lock`. While set, the two hooks are too: pool.c and
     * share.c call them under the lock, never tier_pool.c itself.
     * tier_write_locked: `page` (registered, its rows intact) is about to be
     * evicted (publish 0: a take borrowed it) or was just published
     * (publish 1); it packs the page and puts it to the tier when the policy
     * says so, never waiting. tier_release: kvp_pool_destroy detaches.
     */
    struct kvpi_pool_tier *tier;
    void (*tier_write_locked)(kvp_pool *pool, uint32_t page, int publish);
    void (*tier_release)(kvp_pool *pool);
};

/* The first byte of `page`; its elements are of type pool->dtype. */
/* 0 for a KVP_SLAB_RESERVED pool: its pages hold no data (fixed at creation). */
static inline int kvpi_pool_has_data(const kvp_pool *pool)
{
    return pool->slab_from.source != KVP_SLAB_RESERVED;
}

/* INVALID_ARGUMENT ("pool"): a reserved pool's page data was asked for (pool.c). */
kvp_status kvpi_pool_fail_no_data(kvp_error *err);

static inline void *kvpi_pool_page(const kvp_pool *pool, uint32_t page)
{
    return (unsigned char *)pool->slab + (size_t)page * pool->page_bytes;
}

void kvpi_pool_lock(kvp_pool *pool);
void kvpi_pool_unlock(kvp_pool *pool);

void kvpi_pool_attach_locked(kvp_pool *pool, kvpi_holder *holder);
void kvpi_pool_detach_locked(kvp_pool *pool, kvpi_holder *holder);

/*
 * Takes n pages, all or none, each with reference count 1, written to
 * out[0..n): free pages first, in the order the LIFO free list yields them,
 * then evictable pages borrowed from the LRU list, oldest first (see
 * struct kvp_pool). So a transaction that uses its pages in order writes
 * free pages before borrowed ones. POOL_EXHAUSTED (and the exhaustion
 * counter) when fewer than n are free or evictable.
 */
kvp_status kvpi_pool_take_locked(kvp_pool *pool, size_t n, uint32_t *out, kvp_error *err);

/*
 * Tentative pages, for a transaction that may fail after taking its pages
 * (a prefill). take_tentative is take, except that acquires and the
 * high-water mark do not count the pages yet. Exactly one of:
 *   confirm: the transaction succeeded; acquires and the high-water mark
 *            count the n pages now;
 *   cancel:  the n pages have all gone back through kvpi_pool_put_locked
 *            (in the same lock hold); the releases that counted are undone,
 *            so the counters are as if the pages had never been taken.
 * Borrowed pages are settled one by one, not here: kvpi_pool_evict_borrowed
 * when a reservation hands one to a page table, kvpi_pool_put_locked
 * (restored) when one goes back unused.
 */
kvp_status kvpi_pool_take_tentative_locked(kvp_pool *pool, size_t n, uint32_t *out,
                                           kvp_error *err);
void kvpi_pool_tentative_confirm_locked(kvp_pool *pool, size_t n);
void kvpi_pool_tentative_cancel_locked(kvp_pool *pool, size_t n);

/*
 * Drops one reference; at zero the page goes back on top of the free list,
 * or, when the prefix index names it, to the most recent end of the LRU list
 * of evictable pages (it stays in the index). A borrowed page (never mapped:
 * its rows are the cached block's) is restored instead: visible to lookups
 * again and back at its place on the LRU list, unless a page published
 * under the same key meanwhile took its key, in which case it leaves the
 * index and goes to the free list.
 */
void kvpi_pool_put_locked(kvp_pool *pool, uint32_t page);

/*
 * A reservation hands `page` to a page table: the take is final and the
 * page is (being) written. A borrowed page is evicted now: its index entry
 * is dropped and `evictions` counts it. Any other page: nothing.
 */
void kvpi_pool_evict_borrowed_locked(kvp_pool *pool, uint32_t page);

/*
 * Adds one reference to a page that is held or evictable (a fork's or an
 * adopter's share). An evictable page leaves the LRU list and counts as
 * acquired again (acquires and the high-water mark), as a take would.
 */
void kvpi_pool_ref_locked(kvp_pool *pool, uint32_t page);

/* Pages a take can get: free plus evictable. */
static inline size_t kvpi_pool_available_locked(const kvp_pool *pool)
{
    return pool->free_count + pool->evictable;
}

/* ---- prefix index and LRU (prefix.c) ---------------------------------- */

/* Slots of the index for `total` pages: the power of two >= 2 * total. */
size_t kvpi_prefix_slots(size_t total);
/* Empties the index and the LRU list (pool creation). */
void kvpi_prefix_init(kvp_pool *pool);
/* The page registered under `key` and not borrowed, or KVPI_NO_PAGE. */
uint32_t kvpi_prefix_lookup_locked(const kvp_pool *pool, const kvp_block_key *key);
/*
 * Registers held `page` (not registered) under `key` (not in the index),
 * recording `binding`, the digest of the binding it was published under.
 */
void kvpi_prefix_insert_locked(kvp_pool *pool, uint32_t page, const kvp_block_key *key,
                               const kvp_block_key *binding);
/* Removes registered `page` from the index. */
void kvpi_prefix_remove_locked(kvp_pool *pool, uint32_t page);
/*
 * LRU list: append as most recent (a new stamp), unlink, and put back a page
 * at the place its stamp gives it (a borrowed page returned unused).
 */
void kvpi_lru_push_locked(kvp_pool *pool, uint32_t page);
void kvpi_lru_unlink_locked(kvp_pool *pool, uint32_t page);
void kvpi_lru_restore_locked(kvp_pool *pool, uint32_t page);
/* I5 (see pool.c); `seen` is the audit's scratch, as the free-list pass left it. */
void kvpi_prefix_audit_locked(const kvp_pool *pool, kvpi_audit *audit, uint32_t *seen);

/*
 * Promise bookkeeping. A holder's promise (*promise) is pages it may take
 * later; the pool counts the sum so admission can see it.
 *   set:     *promise becomes `pages`
 *   consume: `taken` pages were just taken; the promise shrinks by as many
 */
void kvpi_pool_promise_set_locked(kvp_pool *pool, size_t *promise, size_t pages);
void kvpi_pool_promise_consume_locked(kvp_pool *pool, size_t *promise, size_t taken);
/* Notes held + promised now in commit_high_water, and `uncovered` pages taken in overdrawn. */
void kvpi_pool_note_commit_locked(kvp_pool *pool, size_t uncovered);

/* Audit callbacks for holders. */
/*
 * The findings of one audit (audit.c runs it, audit_findings.c records into it), gathered under the pool lock and handed to the
 * caller's callback only after the lock is released (so the callback may call
 * back into the pool). A fixed array, on the auditor's stack: the audit
 * allocates nothing. `mismatches` counts every finding; found[] keeps the
 * first KVP_POOL_CHECK_REPORTS of them, in the order found.
 */
struct kvpi_audit {
    const kvp_pool *pool;
    size_t mismatches;
    kvp_mismatch found[KVP_POOL_CHECK_REPORTS];
};

void kvpi_audit_reference(kvpi_audit *audit, uint32_t page);
void kvpi_audit_report(kvpi_audit *audit, kvp_invariant invariant, const char *what, size_t page,
                       size_t lane, size_t expected, size_t actual);

#endif /* KVPAGER_PAGER_POOL_INTERNAL_H */
