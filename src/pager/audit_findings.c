/*
 * audit_findings.c: where an audit's findings go (pool_internal.h, kvpi_audit).
 *
 * Owns: kvpi_audit_report (one broken invariant, kept among the first
 * KVP_POOL_CHECK_REPORTS) and kvpi_audit_reference (one reference a holder
 * owns, counted against the page's reference count).
 * Invariants: a finding is counted whether or not it is kept; nothing here
 * allocates or takes a lock (the audit holds the pool's).
 * Callers: audit.c (kvp_pool_check) and the holders' audit parts (cache.c,
 * prefix.c) under the pool's lock. Calls nothing in src/pager, so every
 * audit part can call it without a circle (layers.files_call_one_way).
 */
#include "pager/pool_internal.h"

void kvpi_audit_report(kvpi_audit *audit, kvp_invariant invariant, const char *what, size_t page,
                       size_t lane, size_t expected, size_t actual)
{
    if (audit->mismatches < KVP_POOL_CHECK_REPORTS) {
        audit->found[audit->mismatches] =
            (kvp_mismatch){invariant, what, page, lane, expected, actual};
    }
    audit->mismatches++;
}

void kvpi_audit_reference(kvpi_audit *audit, uint32_t page)
{
    if (page >= audit->pool->total_pages) {
        kvpi_audit_report(audit, KVP_INVARIANT_REFERENCES, "page id below total pages", page,
                          SIZE_MAX, audit->pool->total_pages, page);
        return;
    }
    audit->pool->audit_counts[page]++;
}
