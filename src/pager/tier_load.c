/*
 * tier_load.c: loading verified blocks from a pool's tier into fresh pages
 * (kvpager/tier.h): the tier's get issued asynchronously into buffers a
 * prefetch owns (kvp_pool_tier_prefetch), and the mapping from a completed
 * prefetch (kvp_cache_group_tier_map); the synchronous load
 * (kvp_cache_group_tier_load) is a prefetch waited for and mapped.
 *
 * Owns: struct kvp_tier_prefetch: the keys, the batch and its buffers, the
 * verdicts, the issuing attachment (its state and serial), and a reference
 * count of two (the owner's and the completion's) under kvpi_tier_count_lock
 * (library-wide, never destroyed: tier_internal.h):
 * whichever lets go last frees it, so a prefetch destroyed in flight is
 * freed by its completion and a completion never touches freed memory.
 *
 * Invariants: a prefetch in flight counts as one user of the attachment it
 * was issued under (kvpi_pool_tier_use), released by its completion after
 * its last touch of the handle, so a detach waits for it and the state its
 * done reads stays live. A map verifies every block it may map
 * (kvpi_tier_block_verify, under the mapping attachment's secret, which is
 * the issuing one: the serials match), maps blocks in chain order, all
 * lanes and caches of a block or none (one hold of the pool lock); a
 * windowed cache then releases what its window no longer needs, in the same
 * hold, as a commit does. A block past the verified run is never mapped.
 * Keys only (a pool without data and a keys-only tier): the get asks the
 * keys, a held key whose size is block_bytes is taken as found (any other
 * size is rejected as "size"), and fresh pages are mapped unwritten.
 *
 * Locks: the pool lock, then kvpi_tier_count_lock (the attachment's counts,
 * a prefetch's references, completion and waits).
 * Callers: the public API.
 */
#include "pager/tier_internal.h"

#include <pthread.h>
#include <string.h>
#include <time.h>

#include "pager/alloc.h"
#include "pager/cache_internal.h"
#include "pager/error.h"

/* One load's scratch: the batch, its buffers, each block's verdict and payload. */
typedef struct load_batch {
    kvp_tier_block *blocks;       /* [total] */
    unsigned char *buffers;       /* [total][block_bytes] */
    const unsigned char **payload; /* [total]: set for verified blocks */
    uint32_t *pages;              /* [total] */
    kvpi_tier_reject *verdict;    /* [total] */
    size_t total;
} load_batch;

static void load_batch_free(load_batch *b)
{
    kvpi_free(b->blocks);
    kvpi_free(b->buffers);
    kvpi_free(b->payload);
    kvpi_free(b->pages);
    kvpi_free(b->verdict);
    memset(b, 0, sizeof *b); /* freeing twice is harmless */
}

/* block_bytes 0 (keys only): no buffers. */
static kvp_status load_batch_new(load_batch *b, size_t total, size_t block_bytes,
                                 kvp_error *err)
{
    memset(b, 0, sizeof *b);
    b->total = total;
    /* One at a time, stopping at the first failure (the fault injector counts calls). */
    if ((b->blocks = kvpi_calloc(KVPI_SITE_SCRATCH, total, sizeof *b->blocks)) == NULL ||
        (block_bytes != 0 &&
         (b->buffers = kvpi_calloc(KVPI_SITE_SCRATCH, total, block_bytes)) == NULL) ||
        (b->payload = kvpi_calloc(KVPI_SITE_SCRATCH, total, sizeof *b->payload)) == NULL ||
        (b->pages = kvpi_calloc(KVPI_SITE_SCRATCH, total, sizeof *b->pages)) == NULL ||
        (b->verdict = kvpi_calloc(KVPI_SITE_SCRATCH, total, sizeof *b->verdict)) == NULL) {
        load_batch_free(b);
        return kvpi_fail_alloc(err, "tier load batch", total * block_bytes);
    }
    return KVP_OK;
}

/*
 * Verifies every block the tier returned; returns the run: the leading
 * blocks (rows of per pages) whose every page was found and verified, and
 * in *stop why the run ended.
 */
static size_t load_verify(kvp_cache *const *caches, size_t count, const kvpi_pool_tier *t,
                          load_batch *b, size_t per, kvp_status *stop)
{
    const kvp_pool *pool = caches[0]->pool;
    size_t batch = caches[0]->batch_size;
    size_t run = b->total / per;
    *stop = KVP_OK;
    for (size_t i = 0; i < b->total; i++) {
        kvp_tier_block *blk = &b->blocks[i];
        kvp_status why = KVP_OK;
        if (blk->status == KVP_BUFFER_TOO_SMALL) {
            /* A value longer than a block of ours: another geometry's, rejected by size. */
            b->verdict[i] = KVPI_TIER_REJECT_SIZE;
            why = KVP_TIER_BLOCK_REJECTED;
        } else if (blk->status != KVP_OK) {
            why = blk->status;
        } else if (blk->bytes == 0) {
            why = KVP_OK; /* a miss ends the run, and is no failure */
        } else if (t->keys_only) { /* no bytes: the size is all there is to check */
            b->verdict[i] = blk->bytes == t->block_bytes ? KVPI_TIER_BLOCK_OK
                                                         : KVPI_TIER_REJECT_SIZE;
            why = b->verdict[i] == KVPI_TIER_BLOCK_OK ? KVP_OK : KVP_TIER_BLOCK_REJECTED;
        } else {
            kvp_block_key binding = kvpi_cache_binding_key(caches[(i / batch) % count]);
            b->verdict[i] = kvpi_tier_block_verify(pool, &blk->key, &binding, t->secret,
                                                   blk->data, blk->bytes, &b->payload[i]);
            why = b->verdict[i] == KVPI_TIER_BLOCK_OK ? KVP_OK : KVP_TIER_BLOCK_REJECTED;
        }
        int usable = blk->status == KVP_OK && blk->bytes != 0 && b->verdict[i] == 0;
        if (!usable && i / per < run) {
            run = i / per;
            *stop = why;
        }
    }
    return run;
}

/* The counters of a load that succeeded: every block the batch returned, and the run. */
static void load_count(kvpi_pool_tier *t, const load_batch *b, size_t mapped)
{
    pthread_mutex_lock(&kvpi_tier_count_lock);
    kvp_pool_tier_stats *s = &t->stats;
    for (size_t i = 0; i < b->total; i++) {
        const kvp_tier_block *blk = &b->blocks[i];
        int oversized = blk->status == KVP_BUFFER_TOO_SMALL; /* rejected: load_verify */
        s->misses += blk->status == KVP_OK && blk->bytes == 0;
        s->load_failures += blk->status != KVP_OK && !oversized;
        if ((blk->status != KVP_OK && !oversized) || (!oversized && blk->bytes == 0) ||
            b->verdict[i] == KVPI_TIER_BLOCK_OK) {
            continue;
        }
        s->rejected++;
        uint64_t *by[] = {NULL,          &s->rejected_header,   &s->rejected_header,
                          &s->rejected_header, &s->rejected_mac, &s->rejected_geometry,
                          &s->rejected_key,    &s->rejected_binding};
        *by[b->verdict[i]] += 1;
    }
    s->loads += mapped;
    s->load_bytes += (uint64_t)mapped * t->block_bytes;
    pthread_mutex_unlock(&kvpi_tier_count_lock);
}

/*
 * Under the pool lock: takes run * per fresh pages, copies each verified
 * payload in, maps them block by block, publishes each key the index lacks.
 */
static kvp_status load_map_locked(kvp_cache *const *caches, size_t count, load_batch *b,
                                  size_t run, size_t per, kvp_error *err)
{
    kvp_pool *pool = caches[0]->pool;
    size_t batch = caches[0]->batch_size;
    size_t first = caches[0]->len / caches[0]->block_tokens;
    kvp_status status = kvpi_pool_take_locked(pool, run * per, b->pages, err);
    if (status != KVP_OK) {
        return status;
    }
    kvpi_pool_note_commit_locked(pool, 0); /* no promise: admission counted them (prefill) */
    for (size_t i = 0; i < run * per; i++) {
        uint32_t page = b->pages[i];
        kvp_cache *cache = caches[(i / batch) % count];
        const kvp_block_key *key = &b->blocks[i].key;
        kvpi_pool_evict_borrowed_locked(pool, page); /* final: it is written now */
        if (b->payload[i] != NULL) { /* keys only: mapped unwritten, as an append commits */
            memcpy(kvpi_pool_page(pool, page), b->payload[i], pool->page_bytes);
        }
        cache->tables[(i % batch) * cache->blocks_per_lane + first + i / per] = page;
        if (kvpi_prefix_lookup_locked(pool, key) == KVPI_NO_PAGE) {
            kvp_block_key binding = kvpi_cache_binding_key(cache);
            kvpi_prefix_insert_locked(pool, page, key, &binding);
        }
    }
    for (size_t c = 0; c < count && run != 0; c++) {
        caches[c]->len += run * caches[c]->block_tokens;
        caches[c]->epoch++;
        /* A windowed cache gives back what its window no longer needs, as a commit does. */
        (void)kvpi_cache_release_front_locked(caches[c]);
    }
    return KVP_OK;
}

/* ---- prefetch ----------------------------------------------------------------- */

struct kvp_tier_prefetch {
    kvp_pool *pool;
    kvpi_pool_tier *t;  /* the issuing attachment: live while in flight (a user) */
    uint64_t serial;    /* its serial: a map under another attachment is refused */
    size_t n;           /* blocks */
    size_t per;         /* keys a block */
    kvp_block_key *keys; /* [n * per] */
    load_batch b;
    int refs;           /* the owner's and the completion's (under the count lock) */
    int complete;
    int mapped;
    double issued;
    double seconds;     /* issue to completion */
};

/*
 * Every prefetch's references, completion and waits are under the count lock
 * and condition (kvpi_tier_count_lock, _cond), never the prefetch's own: a
 * done still returning from its unlock then touches no memory the owner
 * frees, and freeing destroys no mutex another thread has just released
 * (helgrind flags that as a race). Critical sections are a few stores.
 */

static double prefetch_clock(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void prefetch_free(kvp_tier_prefetch *p)
{
    load_batch_free(&p->b);
    kvpi_free(p->keys);
    kvpi_free(p);
}

/* Drops one reference; the last frees. */
static void prefetch_let_go(kvp_tier_prefetch *p)
{
    pthread_mutex_lock(&kvpi_tier_count_lock);
    int last = --p->refs == 0;
    pthread_mutex_unlock(&kvpi_tier_count_lock);
    if (last) {
        prefetch_free(p);
    }
}

static void prefetch_done(void *ctx, kvp_tier_block *blocks, size_t count)
{
    (void)blocks;
    (void)count;
    kvp_tier_prefetch *p = ctx;
    kvpi_pool_tier *t = p->t;
    double now = prefetch_clock();
    pthread_mutex_lock(&kvpi_tier_count_lock);
    p->complete = 1;
    p->seconds = now - p->issued;
    p->t = NULL; /* no longer a user: a map checks the serial under its own use */
    pthread_cond_broadcast(&kvpi_tier_count_cond);
    int last = --p->refs == 0;
    kvpi_pool_tier_user_done_locked(t); /* t may be freed by a detach once unlocked */
    pthread_mutex_unlock(&kvpi_tier_count_lock);
    if (last) {
        prefetch_free(p); /* destroyed in flight: the cancel ends here */
    }
}

/* A new prefetch of n blocks' keys under attachment t (a user the caller took). */
static kvp_status prefetch_new(kvp_pool *pool, kvpi_pool_tier *t, const kvp_block_key *keys,
                               size_t n, size_t per, kvp_tier_prefetch **out, kvp_error *err)
{
    size_t total = n * per;
    kvp_tier_prefetch *p = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *p);
    if (p == NULL ||
        (total != 0 && (p->keys = kvpi_calloc(KVPI_SITE_SCRATCH, total, sizeof *keys)) == NULL)) {
        kvpi_free(p);
        return kvpi_fail_alloc(err, "tier prefetch", total * sizeof *keys);
    }
    kvp_status status = KVP_OK;
    if (total != 0) {
        status = load_batch_new(&p->b, total, t->keys_only ? 0 : t->block_bytes, err);
    }
    if (status != KVP_OK) {
        kvpi_free(p->keys);
        kvpi_free(p);
        return status;
    }
    memcpy(p->keys, keys, total * sizeof *keys);
    for (size_t i = 0; i < total; i++) {
        p->b.blocks[i].key = keys[i];
        p->b.blocks[i].data = t->keys_only ? NULL : p->b.buffers + i * t->block_bytes;
        p->b.blocks[i].capacity = t->keys_only ? 0 : t->block_bytes;
    }
    p->pool = pool;
    p->t = t;
    p->serial = t->serial;
    p->n = n;
    p->per = per;
    p->refs = 2;
    *out = p;
    return KVP_OK;
}

kvp_status kvp_pool_tier_prefetch(kvp_pool *pool, const kvp_block_key *keys, size_t n,
                                  size_t per, kvp_tier_prefetch **out, kvp_error *err)
{
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    if (keys == NULL && n > 0) {
        return kvpi_fail_null(err, "keys");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (per == 0 || n > SIZE_MAX / per / sizeof *keys) {
        return kvpi_fail_invalid(err, "per", "must be count * batch of the mapping caches");
    }
    kvpi_pool_tier *t = kvpi_pool_tier_use(pool);
    if (t == NULL) {
        return kvpi_fail_invalid(err, "pool", "has no tier (kvp_pool_tier_attach)");
    }
    kvp_tier_prefetch *p = NULL;
    kvp_status status = prefetch_new(pool, t, keys, n, per, &p, err);
    if (status == KVP_OK) {
        p->issued = prefetch_clock();
        status = kvp_tier_issue(t->tier, KVP_TIER_GET, p->b.blocks, n * per, prefetch_done, p,
                                err);
        if (status != KVP_OK) {
            prefetch_free(p); /* refused: done is never called */
        }
    }
    if (status != KVP_OK) {
        kvpi_pool_tier_unuse(t);
        return status;
    }
    *out = p;
    return KVP_OK;
}

int kvp_tier_prefetch_ready(kvp_tier_prefetch *prefetch, double *seconds)
{
    if (prefetch == NULL) {
        return 0;
    }
    pthread_mutex_lock(&kvpi_tier_count_lock);
    int complete = prefetch->complete;
    if (complete && seconds != NULL) {
        *seconds = prefetch->seconds;
    }
    pthread_mutex_unlock(&kvpi_tier_count_lock);
    return complete;
}

void kvp_tier_prefetch_wait(kvp_tier_prefetch *prefetch)
{
    if (prefetch == NULL) {
        return;
    }
    pthread_mutex_lock(&kvpi_tier_count_lock);
    while (!prefetch->complete) {
        pthread_cond_wait(&kvpi_tier_count_cond, &kvpi_tier_count_lock);
    }
    pthread_mutex_unlock(&kvpi_tier_count_lock);
}

void kvp_tier_prefetch_destroy(kvp_tier_prefetch *prefetch)
{
    if (prefetch != NULL) {
        prefetch_let_go(prefetch);
    }
}

/* ---- map -------------------------------------------------------------------------- */

/* The map's argument checks, changing nothing; *room: blocks the caches can take. */
static kvp_status map_check(kvp_cache *const *caches, size_t count, kvp_tier_prefetch *p,
                            size_t skip, size_t *loaded, size_t *room, kvp_error *err)
{
    if (p == NULL) {
        return kvpi_fail_null(err, "prefetch");
    }
    if (!kvp_tier_prefetch_ready(p, NULL) || p->mapped) {
        return kvpi_fail_invalid(err, "prefetch", "is still in flight, or mapped already");
    }
    if (skip > p->n) {
        return kvpi_fail_invalid(err, "skip", "is past the prefetch's blocks");
    }
    kvp_status status =
        kvpi_cache_group_adopt_check(caches, count, p->keys + skip * p->per, p->n - skip, room,
                                     err);
    if (status != KVP_OK) {
        return status;
    }
    if (loaded == NULL) {
        return kvpi_fail_null(err, "loaded");
    }
    if (count * caches[0]->batch_size != p->per) {
        return kvpi_fail_invalid(err, "count", "times the batch is not the prefetch's per");
    }
    if (caches[0]->pool != p->pool) {
        return kvpi_fail_invalid(err, "caches", "are not of the prefetch's pool");
    }
    return KVP_OK;
}

/* The view of blocks [skip, skip + blocks) of the prefetch's batch. */
static load_batch batch_view(const kvp_tier_prefetch *p, size_t skip, size_t blocks)
{
    size_t from = skip * p->per;
    load_batch v;
    memset(&v, 0, sizeof v);
    v.total = blocks * p->per;
    if (v.total != 0) {
        v.blocks = p->b.blocks + from;
        v.payload = p->b.payload + from;
        v.pages = p->b.pages + from;
        v.verdict = p->b.verdict + from;
    }
    return v;
}

kvp_status kvp_cache_group_tier_map(kvp_cache *const *caches, size_t count,
                                    kvp_tier_prefetch *prefetch, size_t skip, size_t *loaded,
                                    kvp_status *stop, kvp_error *err)
{
    size_t room = 0;
    kvp_status status = map_check(caches, count, prefetch, skip, loaded, &room, err);
    if (status != KVP_OK) {
        return status;
    }
    kvp_pool *pool = caches[0]->pool;
    kvpi_pool_tier *t = kvpi_pool_tier_use(pool);
    if (t == NULL || t->serial != prefetch->serial) {
        if (t != NULL) {
            kvpi_pool_tier_unuse(t);
        }
        return kvpi_fail_invalid(err, "pool", "has no tier, or another one since the prefetch");
    }
    load_batch v = batch_view(prefetch, skip, room);
    kvp_status why = KVP_OK;
    size_t run = 0;
    if (v.total != 0) {
        run = load_verify(caches, count, t, &v, prefetch->per, &why);
        kvpi_pool_lock(pool);
        status = load_map_locked(caches, count, &v, run, prefetch->per, err);
        kvpi_pool_unlock(pool);
        if (status == KVP_OK) {
            load_count(t, &v, run * prefetch->per);
        }
    }
    kvpi_pool_tier_unuse(t);
    if (status == KVP_OK) {
        prefetch->mapped = 1;
        *loaded = run;
        if (stop != NULL) {
            *stop = why;
        }
    }
    return status;
}

kvp_status kvp_cache_group_tier_load(kvp_cache *const *caches, size_t count,
                                     const kvp_block_key *keys, size_t n, size_t *loaded,
                                     kvp_status *stop, kvp_error *err)
{
    size_t room = 0;
    kvp_status status = kvpi_cache_group_adopt_check(caches, count, keys, n, &room, err);
    if (status != KVP_OK) {
        return status;
    }
    if (loaded == NULL) {
        return kvpi_fail_null(err, "loaded");
    }
    kvp_tier_prefetch *p = NULL;
    status = kvp_pool_tier_prefetch(caches[0]->pool, keys, room,
                                    count * caches[0]->batch_size, &p, err);
    if (status != KVP_OK) {
        return status;
    }
    kvp_tier_prefetch_wait(p);
    status = kvp_cache_group_tier_map(caches, count, p, 0, loaded, stop, err);
    kvp_tier_prefetch_destroy(p);
    return status;
}
