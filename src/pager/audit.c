/*
 * audit.c: kvp_pool_check, the pool's audit, recomputed from scratch.
 *
 * Owns: the audit's findings (kvpi_audit) and the pool's part of the
 * recomputation: the free list (I2), the held and evictable counts and the
 * counters (I1, STATS), the holders' references (I3, each holder's own
 * check: cache.c for I4 and copy-on-write marks) and the prefix index (I5,
 * prefix.c), all under the pool's lock, with the findings handed to the
 * caller's callback after the lock is released.
 * Invariants: the ones pool.c lists (DESIGN.md numbering); the audit only
 * reads the pool and allocates nothing.
 * Callers: the public API (kvp_pool_check). Holders report their findings
 * through audit_findings.c, which calls nothing here, so the holders' audit
 * parts (cache.c, prefix.c) and this file call one way.
 */
#include "pager/pool_internal.h"

#include <string.h>

#include "pager/abi.h"
#include "pager/error.h"

/* ---- audit ------------------------------------------------------------- */

/* I2 and the free side of I1: walks the free list. Returns pages found free. */
static size_t audit_free_list(const kvp_pool *pool, kvpi_audit *audit)
{
    uint32_t *seen = pool->audit_counts;
    memset(seen, 0, pool->total_pages * sizeof *seen);
    size_t valid = 0;
    for (size_t i = 0; i < pool->free_count; i++) {
        uint32_t page = pool->free_stack[i];
        if (page >= pool->total_pages) {
            kvpi_audit_report(audit, KVP_INVARIANT_NO_DUPLICATES, "free-list entry is a page id",
                              page, SIZE_MAX, pool->total_pages, page);
            continue;
        }
        if (seen[page]++ != 0) {
            kvpi_audit_report(audit, KVP_INVARIANT_NO_DUPLICATES,
                              "times the page is on the free list", page, SIZE_MAX, 1, seen[page]);
            continue;
        }
        if (pool->refcount[page] != 0) {
            kvpi_audit_report(audit, KVP_INVARIANT_NO_DUPLICATES,
                              "reference count of a free page", page, SIZE_MAX, 0,
                              pool->refcount[page]);
        }
        valid++;
    }
    return valid;
}

/* Walks the holder list; returns how many holders of `kind` are linked. */
static size_t audit_holders(const kvp_pool *pool, kvpi_audit *audit, kvpi_holder_kind kind)
{
    size_t count = 0;
    for (const kvpi_holder *h = pool->holders.next; h != &pool->holders; h = h->next) {
        if (h->ops->kind != kind) {
            continue;
        }
        count++;
        h->ops->audit(h, audit);
    }
    return count;
}

static void audit_locked(const kvp_pool *pool, kvpi_audit *audit)
{
    /* The page geometry, the dtype's element size included, is recomputed too. */
    size_t page_bytes = 2 * pool->heads * pool->block_tokens * pool->head_width *
                        kvp_dtype_bytes(pool->dtype);
    if (pool->element_bytes != kvp_dtype_bytes(pool->dtype) || pool->page_bytes != page_bytes) {
        kvpi_audit_report(audit, KVP_INVARIANT_STATS,
                          "page bytes, 2 * heads * block_tokens * head_width * dtype bytes",
                          SIZE_MAX, SIZE_MAX, page_bytes, pool->page_bytes);
    }
    size_t free_found = audit_free_list(pool, audit);
    size_t held = 0;
    for (size_t page = 0; page < pool->total_pages; page++) {
        held += pool->refcount[page] != 0;
    }
    size_t evictable = 0;
    for (uint32_t p = pool->lru_head; p < pool->total_pages && evictable < pool->total_pages;
         p = pool->lru_next[p]) {
        evictable++;
    }
    if (free_found + evictable + held != pool->total_pages) {
        kvpi_audit_report(audit, KVP_INVARIANT_CONSERVATION, "free + evictable + held pages",
                          SIZE_MAX, SIZE_MAX, pool->total_pages, free_found + evictable + held);
    }
    kvpi_prefix_audit_locked(pool, audit, pool->audit_counts);
    size_t counted = (size_t)(pool->acquires - pool->releases) + pool->tentative;
    if (counted != held) {
        kvpi_audit_report(audit, KVP_INVARIANT_STATS, "acquires - releases + tentative pages",
                          SIZE_MAX, SIZE_MAX, held, counted);
    }
    if (pool->tentative > held) {
        kvpi_audit_report(audit, KVP_INVARIANT_STATS, "tentative pages at most held pages",
                          SIZE_MAX, SIZE_MAX, held, pool->tentative);
    } else if (pool->high_water_pages < held - pool->tentative) {
        kvpi_audit_report(audit, KVP_INVARIANT_STATS,
                          "high-water mark at least held pages that are not tentative", SIZE_MAX,
                          SIZE_MAX, held - pool->tentative, pool->high_water_pages);
    }

    /* I3: count every reference the holders own, then compare. */
    memset(pool->audit_counts, 0, pool->total_pages * sizeof *pool->audit_counts);
    size_t caches = audit_holders(pool, audit, KVPI_HOLDER_CACHE);
    size_t reservations = audit_holders(pool, audit, KVPI_HOLDER_RESERVATION);
    if (caches != pool->attached_caches) {
        kvpi_audit_report(audit, KVP_INVARIANT_STATS, "attached caches", SIZE_MAX, SIZE_MAX,
                          caches, pool->attached_caches);
    }
    if (reservations != pool->attached_reservations) {
        kvpi_audit_report(audit, KVP_INVARIANT_STATS, "attached reservations", SIZE_MAX,
                          SIZE_MAX, reservations, pool->attached_reservations);
    }
    for (size_t page = 0; page < pool->total_pages; page++) {
        if (pool->audit_counts[page] != pool->refcount[page]) {
            kvpi_audit_report(audit, KVP_INVARIANT_REFERENCES,
                              "references from page tables and reservations", page, SIZE_MAX,
                              pool->audit_counts[page], pool->refcount[page]);
        }
    }
}

kvp_status kvp_pool_check(kvp_pool *pool, kvp_mismatch_fn on_mismatch, void *ctx,
                          kvp_error *err)
{
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    kvpi_audit audit;
    audit.pool = pool;
    audit.mismatches = 0;
    kvpi_pool_lock(pool);
    audit_locked(pool, &audit);
    kvpi_pool_unlock(pool);
    if (audit.mismatches == 0) {
        return KVP_OK;
    }
    /* Unlocked: the callback may call the pool (kvp_pool_stats_get, ...). */
    size_t reported = audit.mismatches < KVP_POOL_CHECK_REPORTS ? audit.mismatches
                                                                : KVP_POOL_CHECK_REPORTS;
    for (size_t i = 0; on_mismatch != NULL && i < reported; i++) {
        on_mismatch(ctx, &audit.found[i]);
    }
    kvp_error e = kvpi_error_begin(KVP_AUDIT_FAILED);
    e.mismatches = audit.mismatches;
    e.first_mismatch = audit.found[0];
    return kvpi_error_emit(err, &e);
}
