/*
 * tier_pool.c: a pool's second tier (kvpager/tier.h): attaching a tier,
 * writing evicted (or, under write-through, published) pages to it, and
 * loading verified blocks from it into fresh pages.
 *
 * Owns: struct kvpi_pool_tier: the tier, the deployment secret, the policy,
 * the pack buffer (written only under the pool lock), the ring of puts in
 * flight, the count of users (puts in flight and loads running), and the
 * counters (kvp_pool_tier_stats).
 *
 * Locks: the pool lock, then `lock` (never the other way round). A put's
 * done may run inline, under the pool lock, or on the tier's thread; it
 * takes only `lock`. Detach clears pool->tier under the pool lock (no write
 * or load starts after), then waits under `lock` until users == 0, so a
 * done never touches freed state.
 *
 * Invariants: users == busy ring slots + loads running; a busy slot's block
 * belongs to the tier until its done; counters change only under `lock`.
 * A load maps a block's payload only after kvpi_tier_block_verify accepted
 * it, and maps blocks in chain order, all lanes and caches of a block or
 * none (one hold of the pool lock); a windowed cache then releases what its
 * window no longer needs, in the same hold, as a commit does.
 * Keys only (a pool without data, KVP_SLAB_RESERVED, given a keys-only
 * tier): a write puts the page's key alone, counted at block_bytes, with no
 * pack buffer; a load asks the keys, takes a held key whose size is
 * block_bytes as found (any other size is rejected as "size"), and maps
 * fresh pages unwritten; nothing reads or writes a page's bytes.
 * Callers: the public API; pool.c and share.c through the pool's hooks.
 */
#include "pager/tier_internal.h"

#include <pthread.h>
#include <sodium.h>
#include <string.h>

#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/cache_internal.h"
#include "pager/error.h"

#define KVPI_TIER_RING 64 /* puts in flight per pool; a write finding none free is dropped */

typedef struct kvpi_pool_tier kvpi_pool_tier;

typedef struct put_slot {
    kvp_tier_block block;
    kvpi_pool_tier *owner;
    int busy;
} put_slot;

struct kvpi_pool_tier {
    kvp_tier *tier;
    unsigned char secret[KVP_TIER_SECRET_BYTES];
    int write_through;
    int keys_only;         /* the tier keeps keys only; the pool holds no data */
    size_t block_bytes;
    unsigned char *buffer; /* [block_bytes]: the block being put, under the pool lock;
                              NULL when keys only */
    pthread_mutex_t lock;
    pthread_cond_t idle;
    size_t users;
    kvp_pool_tier_stats stats;
    put_slot ring[KVPI_TIER_RING];
};

#define KVPI_TIER_POLICY_SIZE_FIRST sizeof(kvp_tier_policy)

void kvp_tier_policy_init(kvp_tier_policy *policy)
{
    if (policy != NULL) {
        memset(policy, 0, sizeof *policy);
        policy->struct_size = sizeof *policy;
    }
}

void kvp_pool_tier_stats_init(kvp_pool_tier_stats *stats)
{
    if (stats != NULL) {
        memset(stats, 0, sizeof *stats);
        stats->struct_size = sizeof *stats;
    }
}

/* ---- write ------------------------------------------------------------------ */

static void user_done_locked(kvpi_pool_tier *t)
{
    t->users--;
    if (t->users == 0) {
        pthread_cond_broadcast(&t->idle);
    }
}

static void put_done(void *ctx, kvp_tier_block *blocks, size_t count)
{
    put_slot *slot = ctx;
    kvpi_pool_tier *t = slot->owner;
    pthread_mutex_lock(&t->lock);
    t->stats.write_failures += count == 1 && blocks[0].status != KVP_OK;
    slot->busy = 0;
    user_done_locked(t);
    pthread_mutex_unlock(&t->lock); /* t may be freed by a detach from here on */
}

/* A free ring slot, busy and counted as a user; NULL (the write dropped) when none. */
static put_slot *slot_take(kvpi_pool_tier *t)
{
    put_slot *slot = NULL;
    pthread_mutex_lock(&t->lock);
    t->stats.writes++;
    for (size_t i = 0; i < KVPI_TIER_RING && slot == NULL; i++) {
        if (!t->ring[i].busy) {
            slot = &t->ring[i];
            slot->busy = 1;
            t->users++;
        }
    }
    t->stats.write_failures += slot == NULL;
    pthread_mutex_unlock(&t->lock);
    return slot;
}

/* The hook pool.c and share.c call under the pool lock (pool_internal.h). */
static void tier_write_locked(kvp_pool *pool, uint32_t page, int publish)
{
    kvpi_pool_tier *t = pool->tier;
    if (publish != t->write_through) {
        return; /* write-back writes on evict, write-through on publish */
    }
    put_slot *slot = slot_take(t);
    if (slot == NULL) {
        return;
    }
    if (!t->keys_only) {
        kvpi_tier_block_pack(pool, page, &pool->page_key[page], &pool->page_binding[page],
                             t->secret, t->buffer);
    }
    memset(&slot->block, 0, sizeof slot->block);
    slot->block.key = pool->page_key[page];
    slot->block.data = t->buffer; /* the tier copies it before put returns; keys only: NULL */
    slot->block.capacity = t->keys_only ? 0 : t->block_bytes;
    slot->block.bytes = t->block_bytes;
    if (kvp_tier_issue(t->tier, KVP_TIER_PUT, &slot->block, 1, put_done, slot, NULL) != KVP_OK) {
        pthread_mutex_lock(&t->lock);
        t->stats.write_failures++;
        slot->busy = 0;
        user_done_locked(t);
        pthread_mutex_unlock(&t->lock);
    }
}

/* ---- attach, detach, stats ------------------------------------------------------- */

static void tier_state_free(kvpi_pool_tier *t)
{
    pthread_cond_destroy(&t->idle);
    pthread_mutex_destroy(&t->lock);
    sodium_memzero(t->secret, sizeof t->secret);
    kvpi_free(t->buffer);
    kvpi_free(t);
}

/* Waits for every user to finish, then frees; t is no longer reachable from the pool. */
static void tier_state_retire(kvpi_pool_tier *t)
{
    pthread_mutex_lock(&t->lock);
    while (t->users != 0) {
        pthread_cond_wait(&t->idle, &t->lock);
    }
    pthread_mutex_unlock(&t->lock);
    tier_state_free(t);
}

static void tier_release(kvp_pool *pool)
{
    kvpi_pool_lock(pool);
    kvpi_pool_tier *t = pool->tier;
    pool->tier = NULL;
    kvpi_pool_unlock(pool);
    if (t != NULL) {
        tier_state_retire(t);
    }
}

static kvp_status policy_read(const kvp_tier_policy *caller, kvp_tier_policy *policy,
                              kvp_error *err)
{
    kvp_status status =
        kvpi_struct_size_check(caller->struct_size, KVPI_TIER_POLICY_SIZE_FIRST, err);
    if (status == KVP_OK) {
        status = kvpi_struct_tail_check(caller, caller->struct_size, sizeof *policy, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    memcpy(policy, caller, KVPI_TIER_POLICY_SIZE_FIRST);
    unsigned char any = 0;
    for (size_t i = 0; i < KVP_TIER_SECRET_BYTES; i++) {
        any |= policy->secret[i];
    }
    if (any == 0) {
        return kvpi_fail_invalid(err, "secret", "is all zero: give the deployment's secret");
    }
    if (policy->write_through != 0 && policy->write_through != 1) {
        return kvpi_fail_invalid(err, "write_through", "must be 0 or 1");
    }
    return KVP_OK;
}

static kvpi_pool_tier *tier_state_new(kvp_pool *pool, kvp_tier *tier,
                                      const kvp_tier_policy *policy)
{
    kvpi_pool_tier *t = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *t);
    size_t block_bytes = kvpi_tier_block_bytes(pool);
    int keys_only = kvp_tier_keys_only(tier);
    unsigned char *buffer =
        t == NULL || keys_only ? NULL : kvpi_alloc(KVPI_SITE_SCRATCH, block_bytes);
    if (t == NULL || (buffer == NULL && !keys_only)) {
        kvpi_free(t);
        return NULL;
    }
    t->keys_only = keys_only;
    pthread_mutex_init(&t->lock, NULL);
    pthread_cond_init(&t->idle, NULL);
    t->tier = tier;
    memcpy(t->secret, policy->secret, sizeof t->secret);
    t->write_through = policy->write_through;
    t->block_bytes = block_bytes;
    t->buffer = buffer;
    kvp_pool_tier_stats_init(&t->stats);
    t->stats.block_bytes = block_bytes;
    for (size_t i = 0; i < KVPI_TIER_RING; i++) {
        t->ring[i].owner = t;
    }
    return t;
}

kvp_status kvp_pool_tier_attach(kvp_pool *pool, kvp_tier *tier, const kvp_tier_policy *policy,
                                kvp_error *err)
{
    static const char *const names[] = {"pool", "tier", "policy"};
    const void *args[] = {pool, tier, policy};
    for (size_t i = 0; i < 3; i++) {
        if (args[i] == NULL) {
            return kvpi_fail_null(err, names[i]);
        }
    }
    kvp_tier_policy copy;
    kvp_status status = policy_read(policy, &copy, err);
    sodium_memzero(copy.secret, sizeof copy.secret);
    if (status != KVP_OK) {
        return status;
    }
    int keys_only = kvp_tier_keys_only(tier);
    if (!kvpi_pool_has_data(pool) && !keys_only) {
        return kvpi_pool_fail_no_data(err);
    }
    if (kvpi_pool_has_data(pool) && keys_only) {
        return kvpi_fail_invalid(err, "tier",
                                 "keeps keys only: it serves a pool without data "
                                 "(KVP_SLAB_RESERVED); give this pool a byte tier");
    }
    kvpi_pool_tier *t = tier_state_new(pool, tier, policy);
    if (t == NULL) {
        return kvpi_fail_alloc(err, "pool tier", sizeof *t + kvpi_tier_block_bytes(pool));
    }
    kvpi_pool_lock(pool);
    int busy = pool->tier != NULL;
    if (!busy) {
        pool->tier_write_locked = tier_write_locked;
        pool->tier_release = tier_release;
        pool->tier = t;
    }
    kvpi_pool_unlock(pool);
    if (busy) {
        tier_state_free(t);
        return kvpi_fail_invalid(err, "pool", "has a tier already: detach it first");
    }
    return KVP_OK;
}

kvp_status kvp_pool_tier_detach(kvp_pool *pool, kvp_error *err)
{
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    tier_release(pool);
    return KVP_OK;
}

/* The pool's tier state with one more user, or NULL when it has none. */
static kvpi_pool_tier *tier_use(kvp_pool *pool)
{
    kvpi_pool_lock(pool);
    kvpi_pool_tier *t = pool->tier;
    if (t != NULL) {
        pthread_mutex_lock(&t->lock);
        t->users++;
        pthread_mutex_unlock(&t->lock);
    }
    kvpi_pool_unlock(pool);
    return t;
}

static void tier_unuse(kvpi_pool_tier *t)
{
    pthread_mutex_lock(&t->lock);
    user_done_locked(t);
    pthread_mutex_unlock(&t->lock);
}

kvp_status kvp_pool_tier_stats_get(kvp_pool *pool, kvp_pool_tier_stats *out, kvp_error *err)
{
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_status status = kvpi_struct_size_check(out->struct_size, sizeof *out, err);
    if (status != KVP_OK) {
        return status;
    }
    kvp_pool_tier_stats snapshot;
    kvpi_pool_lock(pool);
    kvpi_pool_tier *t = pool->tier;
    if (t != NULL) {
        pthread_mutex_lock(&t->lock);
        snapshot = t->stats;
        pthread_mutex_unlock(&t->lock);
    }
    kvpi_pool_unlock(pool);
    if (t == NULL) {
        return kvpi_fail_invalid(err, "pool", "has no tier (kvp_pool_tier_attach)");
    }
    return kvpi_struct_out(out, &snapshot, sizeof snapshot, sizeof snapshot, err);
}

/* ---- load ----------------------------------------------------------------------- */

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
    pthread_mutex_lock(&t->lock);
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
    pthread_mutex_unlock(&t->lock);
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

/* Gets keys[0, b->total) from the tier in one batch, waiting for its completion. */
static kvp_status load_fetch(const kvp_block_key *keys, kvpi_pool_tier *t, load_batch *b,
                             kvp_error *err)
{
    for (size_t i = 0; i < b->total; i++) {
        b->blocks[i].key = keys[i];
        b->blocks[i].data = t->keys_only ? NULL : b->buffers + i * t->block_bytes;
        b->blocks[i].capacity = t->keys_only ? 0 : t->block_bytes;
    }
    return kvp_tier_run(t->tier, KVP_TIER_GET, b->blocks, b->total, err);
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
    kvp_pool *pool = caches[0]->pool;
    kvpi_pool_tier *t = tier_use(pool);
    if (t == NULL) {
        return kvpi_fail_invalid(err, "pool", "has no tier (kvp_pool_tier_attach)");
    }
    size_t per = count * caches[0]->batch_size;
    load_batch b;
    memset(&b, 0, sizeof b);
    kvp_status why = KVP_OK;
    size_t run = 0;
    if (room != 0) {
        status = load_batch_new(&b, room * per, t->keys_only ? 0 : t->block_bytes, err);
        if (status == KVP_OK) {
            status = load_fetch(keys, t, &b, err);
        }
        if (status == KVP_OK) {
            run = load_verify(caches, count, t, &b, per, &why);
            kvpi_pool_lock(pool);
            status = load_map_locked(caches, count, &b, run, per, err);
            kvpi_pool_unlock(pool);
        }
        if (status == KVP_OK) {
            load_count(t, &b, run * per);
        }
        load_batch_free(&b);
    }
    tier_unuse(t);
    if (status == KVP_OK) {
        *loaded = run;
        if (stop != NULL) {
            *stop = why;
        }
    }
    return status;
}
