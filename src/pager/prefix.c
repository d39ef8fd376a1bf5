/*
 * prefix.c: the pool's prefix index and its LRU list of evictable pages.
 *
 * Owns: pool->index (open addressing, linear probing, backward-shift
 * deletion, so there are no tombstones), page_key[], page_binding[] and
 * registered[] of each page, and the doubly linked LRU list through
 * lru_prev[] / lru_next[].
 *
 * Invariants (I5 in DESIGN.md; kvpi_prefix_audit_locked recomputes them):
 *   - an index slot holds KVPI_NO_PAGE or a registered page p, and p is found
 *     by probing from the home slot of page_key[p] without crossing an empty
 *     slot; each registered page is in exactly one slot, and no two slots
 *     hold the same key unless one of them is borrowed (a page published
 *     under a borrowed page's key wins it when the borrowed one comes back);
 *     cached == entries;
 *   - page_binding[p] (the publisher's binding digest, never zero) is set
 *     exactly while p is registered (indexed or borrowed);
 *   - the LRU list holds exactly the indexed (not borrowed) pages with
 *     refcount 0, once each, oldest at lru_head, in increasing lru_stamp;
 *     evictable == its length;
 *   - a borrowed page (KVPI_PAGE_BORROWED) keeps its slot and key, lookups
 *     skip it, and it is held by its taker's reservation alone (refcount 1);
 *   - a free page is not registered.
 * Page life with sharing (pool.c performs the transitions):
 *   held --put (refcount 0, registered)--> evictable --ref--> held
 *   evictable --take finds no free page--> borrowed by the taker
 *   borrowed --mapped from the reservation--> held, unregistered (evicted)
 *   borrowed --returned unused--> evictable, at its stamp's LRU place
 * Everything here runs under the pool lock. Callers: pool.c and share.c.
 */
#include "pager/pool_internal.h"

#include <string.h>

size_t kvpi_prefix_slots(size_t total)
{
    size_t slots = 2;
    while (slots < 2 * total) {
        slots *= 2;
    }
    return slots;
}

void kvpi_prefix_init(kvp_pool *pool)
{
    for (size_t i = 0; i < pool->index_slots; i++) {
        pool->index[i] = KVPI_NO_PAGE;
    }
    for (size_t p = 0; p < pool->total_pages; p++) {
        pool->lru_prev[p] = KVPI_NO_PAGE;
        pool->lru_next[p] = KVPI_NO_PAGE;
    }
    pool->lru_head = KVPI_NO_PAGE;
    pool->lru_tail = KVPI_NO_PAGE;
}

static int key_equal(const kvp_block_key *a, const kvp_block_key *b)
{
    return a->lo == b->lo && a->hi == b->hi;
}

/* The key is already a hash: its low word picks the home slot. */
static size_t home_slot(const kvp_pool *pool, const kvp_block_key *key)
{
    return (size_t)(key->lo ^ (key->hi >> 7)) & (pool->index_slots - 1);
}

uint32_t kvpi_prefix_lookup_locked(const kvp_pool *pool, const kvp_block_key *key)
{
    size_t mask = pool->index_slots - 1;
    for (size_t i = home_slot(pool, key);; i = (i + 1) & mask) {
        uint32_t page = pool->index[i];
        if (page == KVPI_NO_PAGE) {
            return KVPI_NO_PAGE;
        }
        /* A borrowed page keeps its entry but is not found (pool_internal.h). */
        if (key_equal(&pool->page_key[page], key) &&
            pool->registered[page] != KVPI_PAGE_BORROWED) {
            return page;
        }
    }
}

void kvpi_prefix_insert_locked(kvp_pool *pool, uint32_t page, const kvp_block_key *key,
                               const kvp_block_key *binding)
{
    size_t mask = pool->index_slots - 1;
    size_t i = home_slot(pool, key);
    while (pool->index[i] != KVPI_NO_PAGE) { /* at most half full: an empty slot exists */
        i = (i + 1) & mask;
    }
    pool->index[i] = page;
    pool->page_key[page] = *key;
    pool->page_binding[page] = *binding;
    pool->registered[page] = KVPI_PAGE_INDEXED;
    pool->cached++;
}

void kvpi_prefix_remove_locked(kvp_pool *pool, uint32_t page)
{
    size_t mask = pool->index_slots - 1;
    size_t i = home_slot(pool, &pool->page_key[page]);
    while (pool->index[i] != page) {
        i = (i + 1) & mask;
    }
    /* Backward shift: move later entries of the run into the hole when their home allows. */
    size_t hole = i;
    for (size_t j = (hole + 1) & mask; pool->index[j] != KVPI_NO_PAGE; j = (j + 1) & mask) {
        size_t home = home_slot(pool, &pool->page_key[pool->index[j]]);
        /* The entry at j may fill the hole when its home is not in (hole, j]. */
        int home_between = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!home_between) {
            pool->index[hole] = pool->index[j];
            hole = j;
        }
    }
    pool->index[hole] = KVPI_NO_PAGE;
    pool->registered[page] = 0;
    memset(&pool->page_key[page], 0, sizeof pool->page_key[page]);
    memset(&pool->page_binding[page], 0, sizeof pool->page_binding[page]);
    pool->cached--;
}

void kvpi_lru_push_locked(kvp_pool *pool, uint32_t page)
{
    pool->lru_prev[page] = pool->lru_tail;
    pool->lru_next[page] = KVPI_NO_PAGE;
    if (pool->lru_tail != KVPI_NO_PAGE) {
        pool->lru_next[pool->lru_tail] = page;
    } else {
        pool->lru_head = page;
    }
    pool->lru_tail = page;
    pool->lru_stamp[page] = ++pool->lru_clock;
    pool->evictable++;
}

/*
 * Before the first page with a larger stamp. A restored page is among the
 * oldest (it was the head when borrowed), so the walk from the head is short.
 */
void kvpi_lru_restore_locked(kvp_pool *pool, uint32_t page)
{
    uint32_t next = pool->lru_head;
    while (next != KVPI_NO_PAGE && pool->lru_stamp[next] < pool->lru_stamp[page]) {
        next = pool->lru_next[next];
    }
    uint32_t prev = next == KVPI_NO_PAGE ? pool->lru_tail : pool->lru_prev[next];
    pool->lru_prev[page] = prev;
    pool->lru_next[page] = next;
    if (prev != KVPI_NO_PAGE) {
        pool->lru_next[prev] = page;
    } else {
        pool->lru_head = page;
    }
    if (next != KVPI_NO_PAGE) {
        pool->lru_prev[next] = page;
    } else {
        pool->lru_tail = page;
    }
    pool->evictable++;
}

void kvpi_lru_unlink_locked(kvp_pool *pool, uint32_t page)
{
    uint32_t prev = pool->lru_prev[page];
    uint32_t next = pool->lru_next[page];
    if (prev != KVPI_NO_PAGE) {
        pool->lru_next[prev] = next;
    } else {
        pool->lru_head = next;
    }
    if (next != KVPI_NO_PAGE) {
        pool->lru_prev[next] = prev;
    } else {
        pool->lru_tail = prev;
    }
    pool->lru_prev[page] = KVPI_NO_PAGE;
    pool->lru_next[page] = KVPI_NO_PAGE;
    pool->evictable--;
}

/* The LRU half of I5: walks at most total_pages links from the head. */
static void audit_lru(const kvp_pool *pool, kvpi_audit *audit, uint32_t *seen)
{
    size_t walked = 0;
    uint32_t prev = KVPI_NO_PAGE;
    for (uint32_t p = pool->lru_head; p != KVPI_NO_PAGE; p = pool->lru_next[p]) {
        if (p >= pool->total_pages || walked == pool->total_pages) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX, "LRU list within the pool's pages",
                              p, SIZE_MAX, pool->total_pages, walked);
            return;
        }
        walked++;
        if (seen[p]++ != 0) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX,
                              "times an evictable page is free or on the LRU list", p, SIZE_MAX,
                              1, seen[p]);
        }
        if (pool->registered[p] != KVPI_PAGE_INDEXED || pool->refcount[p] != 0) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX,
                              "an evictable page is registered with reference count 0", p,
                              SIZE_MAX, 0, pool->refcount[p]);
        }
        if (pool->lru_prev[p] != prev) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX, "LRU back link", p, SIZE_MAX, prev,
                              pool->lru_prev[p]);
        } else if (prev != KVPI_NO_PAGE && pool->lru_stamp[p] <= pool->lru_stamp[prev]) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX, "LRU list in stamp order", p,
                              SIZE_MAX, (size_t)pool->lru_stamp[prev] + 1,
                              (size_t)pool->lru_stamp[p]);
        }
        prev = p;
    }
    if (prev != pool->lru_tail) {
        kvpi_audit_report(audit, KVP_INVARIANT_PREFIX, "LRU tail", SIZE_MAX, SIZE_MAX, prev,
                          pool->lru_tail);
    }
    if (walked != pool->evictable) {
        kvpi_audit_report(audit, KVP_INVARIANT_PREFIX, "evictable pages on the LRU list",
                          SIZE_MAX, SIZE_MAX, walked, pool->evictable);
    }
}

/* The index half of I5. */
static void audit_index(const kvp_pool *pool, kvpi_audit *audit)
{
    size_t entries = 0;
    size_t mask = pool->index_slots - 1;
    for (size_t i = 0; i < pool->index_slots; i++) {
        uint32_t page = pool->index[i];
        if (page == KVPI_NO_PAGE) {
            continue;
        }
        entries++;
        if (page >= pool->total_pages || !pool->registered[page]) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX, "an index entry names a registered page",
                              page, SIZE_MAX, 1, 0);
            continue;
        }
        /*
         * Reachable: no empty slot between the key's home slot and i; indexed
         * once (a borrowed page's key may be held by a page published meanwhile).
         */
        int borrowed = pool->registered[page] == KVPI_PAGE_BORROWED;
        size_t j = home_slot(pool, &pool->page_key[page]);
        while (j != i && pool->index[j] != KVPI_NO_PAGE) {
            uint32_t other = pool->index[j];
            if (other < pool->total_pages && !borrowed &&
                pool->registered[other] != KVPI_PAGE_BORROWED &&
                key_equal(&pool->page_key[other], &pool->page_key[page])) {
                kvpi_audit_report(audit, KVP_INVARIANT_PREFIX, "a key is indexed once", page,
                                  SIZE_MAX, j, i);
            }
            j = (j + 1) & mask;
        }
        if (borrowed && pool->refcount[page] != 1) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX,
                              "a borrowed page is held by its reservation alone", page,
                              SIZE_MAX, 1, pool->refcount[page]);
        }
        /* A borrowed page is skipped by lookups; another page may hold its key meanwhile. */
        if (j != i ||
            (!borrowed && kvpi_prefix_lookup_locked(pool, &pool->page_key[page]) != page)) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX,
                              "an index entry is found under its page's key", page, SIZE_MAX, i,
                              j);
        }
    }
    static const kvp_block_key zero = {0, 0};
    size_t registered = 0;
    for (size_t p = 0; p < pool->total_pages; p++) {
        registered += pool->registered[p] != 0;
        if ((pool->registered[p] != 0) == key_equal(&pool->page_binding[p], &zero)) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX,
                              "a page records a binding digest exactly while registered", p,
                              SIZE_MAX, pool->registered[p] != 0,
                              !key_equal(&pool->page_binding[p], &zero));
        }
        if (pool->registered[p] && pool->refcount[p] == 0 && pool->lru_prev[p] == KVPI_NO_PAGE &&
            pool->lru_head != p) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX,
                              "a registered page at reference count 0 is on the LRU list", p,
                              SIZE_MAX, 1, 0);
        }
    }
    if (entries != registered || entries != pool->cached) {
        kvpi_audit_report(audit, KVP_INVARIANT_PREFIX, "index entries, registered pages",
                          SIZE_MAX, SIZE_MAX, registered, entries);
    }
    if (pool->cached != registered) {
        kvpi_audit_report(audit, KVP_INVARIANT_STATS, "cached pages", SIZE_MAX, SIZE_MAX,
                          registered, pool->cached);
    }
}

void kvpi_prefix_audit_locked(const kvp_pool *pool, kvpi_audit *audit, uint32_t *seen)
{
    for (size_t i = 0; i < pool->free_count; i++) {
        uint32_t page = pool->free_stack[i];
        if (page < pool->total_pages && pool->registered[page]) {
            kvpi_audit_report(audit, KVP_INVARIANT_PREFIX, "a free page is not registered", page,
                              SIZE_MAX, 0, 1);
        }
    }
    audit_lru(pool, audit, seen);
    audit_index(pool, audit);
}
