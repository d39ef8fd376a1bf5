/*
 * scheduler_session.c: sessions, leases kept for a conversation's next
 * request (5. in kvpager/scheduler.h; the scheduler's rooms:
 * scheduler_internal.h).
 *
 * Owns: the kept list (s->kept, oldest first), kept_refs (per pool page,
 * the kept leases naming it) and kept_pages. A completed request of a
 * session leaves its sample 0 lease here, pages held, until its session's
 * next request is admitted (and adopts them), its ttl runs out, its
 * parameters change, the queue stalls, or running requests need the pages.
 *
 * Invariants: at most one kept lease per session; kept_pages counts the
 * distinct pages the kept leases' tables name (a page two share counts
 * once; a block a sliding window released names none and is skipped) and
 * is at most kept_cap; a kept lease changes no table while kept.
 * Nothing here allocates: kept_refs is made with the scheduler and the
 * step makes room in `kept` and `idle` first.
 * Callers: scheduler.c (submit asks kvpi_sched_kept_of) and
 * scheduler_step.c. Calls leases only.
 */
#include <string.h>

#include "pager/cache_internal.h"
#include "serve/scheduler_internal.h"

/*
 * Kept pages, each once (5.): kept_refs[p] counts the kept leases whose
 * tables name page p, and kept_pages the pages with a count. A kept lease
 * changes no table while kept, so adding it on keeping and removing it on
 * giving back (before its reset) costs only its own pages, and allocates
 * nothing (kept_refs is made with the scheduler).
 */
static void kept_refs_add(kvp_scheduler *s, const lease *l, int delta)
{
    kvp_cache *const *caches = lease_caches(l);
    for (size_t i = 0; i < s->layers; i++) {
        const uint32_t *table = kvpi_cache_lane_table(caches[i], 0);
        size_t blocks = kvpi_cache_mapped_blocks(caches[i]);
        for (size_t b = 0; b < blocks; b++) {
            if (kvpi_cache_block_released(caches[i], b)) {
                continue; /* a window released it: a null entry names no page */
            }
            uint32_t *refs = &s->kept_refs[table[b]];
            if (delta > 0) {
                s->kept_pages += (*refs)++ == 0;
            } else {
                s->kept_pages -= --(*refs) == 0;
            }
        }
    }
}

/* The pages lease l's tables name that no kept lease names (what keeping it adds). */
static size_t kept_refs_new(const kvp_scheduler *s, const lease *l)
{
    size_t pages = 0;
    kvp_cache *const *caches = lease_caches(l);
    for (size_t i = 0; i < s->layers; i++) {
        const uint32_t *table = kvpi_cache_lane_table(caches[i], 0);
        size_t blocks = kvpi_cache_mapped_blocks(caches[i]);
        for (size_t b = 0; b < blocks; b++) {
            pages += !kvpi_cache_block_released(caches[i], b) && s->kept_refs[table[b]] == 0;
        }
    }
    return pages;
}

/*
 * Gives kept lease i back: reset (its pages become evictable, still
 * indexed), to the idle list (room was made first). `used`: a request of
 * its session was admitted and adopted what it holds.
 */
void kvpi_sched_drop_kept(kvp_scheduler *s, size_t i, int used)
{
    kept_lease *k = &s->kept[i];
    kept_refs_add(s, &k->lease, -1);
    lease_reset(s, &k->lease);
    s->idle[s->idle_count++] = k->lease;
    if (used) {
        s->stats.session_hits++;
    } else {
        s->stats.session_drops++;
    }
    memmove(k, k + 1, (s->kept_count - i - 1) * sizeof *k);
    s->kept_count--;
}

/* The kept lease of `session`, or SIZE_MAX. */
size_t kvpi_sched_kept_of(const kvp_scheduler *s, uint64_t session)
{
    for (size_t i = 0; i < s->kept_count; i++) {
        if (s->kept[i].session == session) {
            return i;
        }
    }
    return SIZE_MAX;
}

/*
 * Request `id` completed (and published): its sample 0 lease leaves the
 * running slots for the kept list when its request names a session and
 * sessions are on, replacing the session's older one and giving back the
 * oldest while the kept pages would pass kept_cap (room was made first).
 */
void kvpi_sched_keep_session(kvp_scheduler *s, uint64_t id)
{
    record *rec = record_of(s, id);
    const kvp_request *q = &rec->request;
    if (q->session == 0 || s->config.session_ttl == 0 || !publishes(s, q)) {
        return;
    }
    size_t i = 0;
    while (s->running[i].id != id || s->running[i].sample != 0) {
        i++; /* a completed request holds its sample 0 slot */
    }
    const lease *l = &s->running[i].lease;
    size_t pages = s->layers * blocks_of(s, lease_len(l));
    if (lease_stale(s, l) || pages > s->kept_cap) {
        return;
    }
    size_t old = kvpi_sched_kept_of(s, q->session);
    if (old != SIZE_MAX) {
        kvpi_sched_drop_kept(s, old, 0);
    }
    while (s->kept_pages + kept_refs_new(s, l) > s->kept_cap) {
        kvpi_sched_drop_kept(s, 0, 0); /* ends: with none kept, its own pages fit the cap */
    }
    kept_lease *k = &s->kept[s->kept_count++];
    k->session = q->session;
    uint64_t ttl = s->config.session_ttl;
    /* Saturating: the largest ttls never expire rather than wrap to now. */
    k->expires = ttl < UINT64_MAX - 1 - s->stats.steps ? s->stats.steps + 1 + ttl : UINT64_MAX;
    k->pages = pages;
    k->lease = *l;
    kept_refs_add(s, l, 1);
    s->stats.session_keeps++;
    rec->slots--;
    s->running[i] = s->running[--s->running_count];
}

/*
 * At the end of a step that admitted `admitted` requests: the kept leases
 * whose time is up at the next step or whose parameters changed go back;
 * and all of them when the step admitted nothing and nothing runs while
 * requests wait, so kept pages never stall the queue.
 */
void kvpi_sched_drop_sessions(kvp_scheduler *s, size_t admitted)
{
    int stalled = admitted == 0 && s->running_count == 0 && s->waiting_count > 0;
    for (size_t i = s->kept_count; i-- > 0;) {
        const kept_lease *k = &s->kept[i];
        if (stalled || k->expires <= s->stats.steps || lease_stale(s, &k->lease)) {
            kvpi_sched_drop_kept(s, i, 0);
        }
    }
}

/*
 * After the step's prefills: the kept lease of every admitted request's
 * session is given back. The request adopted what the index held of its
 * prompt, so the kept pages it shares stay held by it.
 */
void kvpi_sched_use_sessions(kvp_scheduler *s, const plan *p)
{
    for (size_t i = 0; i < p->popped && s->kept_count > 0; i++) {
        const planned *pl = &s->plan[i];
        uint64_t session = record_of(s, pl->id)->request.session;
        size_t k = pl->admit && session != 0 ? kvpi_sched_kept_of(s, session) : SIZE_MAX;
        if (k != SIZE_MAX) {
            /* A stale one held nothing the request could adopt: not a hit. */
            kvpi_sched_drop_kept(s, k, !lease_stale(s, &s->kept[k].lease));
        }
    }
}
