/*
 * tier_pool.c: a pool's second tier (kvpager/tier.h): attaching a tier,
 * writing evicted (or, under write-through, published) pages to it, and
 * detaching it (loads and prefetches: tier_load.c).
 *
 * Owns: struct kvpi_pool_tier: the tier, the deployment secret, the policy,
 * the pack buffer (written only under the pool lock), the ring of puts in
 * flight, the count of users (puts in flight, loads running and prefetches
 * in flight: tier_load.c), and the counters (kvp_pool_tier_stats).
 *
 * Locks: the pool lock, then kvpi_tier_count_lock, "the count lock"
 * (library-wide: tier_internal.h says why; never the other way round). A put's
 * done may run inline, under the pool lock, or on the tier's thread; it
 * takes only the count lock. Detach clears pool->tier under the pool lock (no write
 * or load starts after), then waits under the count lock until users == 0, so a
 * done never touches freed state.
 *
 * Invariants: users == busy ring slots + loads running + prefetches whose
 * done has not run; a busy slot's block
 * belongs to the tier until its done; counters change only under the count lock.
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
#include <stdatomic.h>
#include <sodium.h>
#include <string.h>

#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/cache_internal.h"
#include "pager/error.h"

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

void kvpi_pool_tier_user_done_locked(kvpi_pool_tier *t)
{
    t->users--;
    if (t->users == 0) {
        pthread_cond_broadcast(&kvpi_tier_count_cond);
    }
}

static void put_done(void *ctx, kvp_tier_block *blocks, size_t count)
{
    put_slot *slot = ctx;
    kvpi_pool_tier *t = slot->owner;
    pthread_mutex_lock(&kvpi_tier_count_lock);
    t->stats.write_failures += count == 1 && blocks[0].status != KVP_OK;
    slot->busy = 0;
    kvpi_pool_tier_user_done_locked(t);
    pthread_mutex_unlock(&kvpi_tier_count_lock); /* t may be freed by a detach from here on */
}

/* A free ring slot, busy and counted as a user; NULL (the write dropped) when none. */
static put_slot *slot_take(kvpi_pool_tier *t)
{
    put_slot *slot = NULL;
    pthread_mutex_lock(&kvpi_tier_count_lock);
    t->stats.writes++;
    for (size_t i = 0; i < KVPI_TIER_RING && slot == NULL; i++) {
        if (!t->ring[i].busy) {
            slot = &t->ring[i];
            slot->busy = 1;
            t->users++;
        }
    }
    t->stats.write_failures += slot == NULL;
    pthread_mutex_unlock(&kvpi_tier_count_lock);
    return slot;
}

/* The nonce's count (its last 8 bytes, little-endian) plus one. */
static void nonce_next(unsigned char nonce[KVPI_TIER_NONCE_BYTES])
{
    for (size_t i = KVPI_TIER_NONCE_BYTES / 2; i < KVPI_TIER_NONCE_BYTES; i++) {
        if (++nonce[i] != 0) {
            return;
        }
    }
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
                             t->secret, t->nonce, t->buffer);
        nonce_next(t->nonce);
    }
    memset(&slot->block, 0, sizeof slot->block);
    slot->block.key = pool->page_key[page];
    slot->block.data = t->buffer; /* the tier copies it before put returns; keys only: NULL */
    slot->block.capacity = t->keys_only ? 0 : t->block_bytes;
    slot->block.bytes = t->block_bytes;
    if (kvp_tier_issue(t->tier, KVP_TIER_PUT, &slot->block, 1, put_done, slot, NULL) != KVP_OK) {
        pthread_mutex_lock(&kvpi_tier_count_lock);
        t->stats.write_failures++;
        slot->busy = 0;
        kvpi_pool_tier_user_done_locked(t);
        pthread_mutex_unlock(&kvpi_tier_count_lock);
    }
}

/* ---- attach, detach, stats ------------------------------------------------------- */

static void tier_state_free(kvpi_pool_tier *t)
{
    sodium_memzero(t->secret, sizeof t->secret);
    kvpi_free(t->buffer);
    kvpi_free(t);
}

/* Waits for every user to finish, then frees; t is no longer reachable from the pool. */
static void tier_state_retire(kvpi_pool_tier *t)
{
    pthread_mutex_lock(&kvpi_tier_count_lock);
    while (t->users != 0) {
        pthread_cond_wait(&kvpi_tier_count_cond, &kvpi_tier_count_lock);
    }
    pthread_mutex_unlock(&kvpi_tier_count_lock);
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
    static atomic_uint_fast64_t serials;
    t->serial = (uint64_t)atomic_fetch_add(&serials, 1) + 1;
    t->keys_only = keys_only;
    t->tier = tier;
    memcpy(t->secret, policy->secret, sizeof t->secret);
    randombytes_buf(t->nonce, KVPI_TIER_NONCE_BYTES / 2); /* the count starts at 0 */
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
kvpi_pool_tier *kvpi_pool_tier_use(kvp_pool *pool)
{
    kvpi_pool_lock(pool);
    kvpi_pool_tier *t = pool->tier;
    if (t != NULL) {
        pthread_mutex_lock(&kvpi_tier_count_lock);
        t->users++;
        pthread_mutex_unlock(&kvpi_tier_count_lock);
    }
    kvpi_pool_unlock(pool);
    return t;
}

void kvpi_pool_tier_unuse(kvpi_pool_tier *t)
{
    pthread_mutex_lock(&kvpi_tier_count_lock);
    kvpi_pool_tier_user_done_locked(t);
    pthread_mutex_unlock(&kvpi_tier_count_lock);
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
        pthread_mutex_lock(&kvpi_tier_count_lock);
        snapshot = t->stats;
        pthread_mutex_unlock(&kvpi_tier_count_lock);
    }
    kvpi_pool_unlock(pool);
    if (t == NULL) {
        return kvpi_fail_invalid(err, "pool", "has no tier (kvp_pool_tier_attach)");
    }
    return kvpi_struct_out(out, &snapshot, sizeof snapshot, sizeof snapshot, err);
}
