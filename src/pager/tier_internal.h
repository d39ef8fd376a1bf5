/*
 * tier_internal.h: tiers as the pager sees them.
 *
 * Owns: struct kvp_tier (a copy of the implementation's vtable and its
 * state), the tier block codec (tier_block.c) and the pool's tier state
 * (struct kvpi_pool_tier: the secret, the policy, the pack buffer, the ring
 * of puts in flight, the users and the counters; tier_pool.c attaches,
 * writes and detaches it, tier_load.c loads and prefetches through it).
 *
 * Calls: tier_pool.c calls pool.c, prefix.c, share.c, tier.c and
 * tier_block.c; tier_load.c calls tier_pool.c (users), pool.c, prefix.c,
 * share.c, tier.c and tier_block.c; pool.c and share.c reach the tier only through the two hooks
 * in struct kvp_pool (tier_write_locked, tier_release), which
 * kvp_pool_tier_attach sets, so no file of src/pager calls another in a
 * circle (cmake/check_calls.py).
 * Callers: src/pager only.
 */
#ifndef KVPAGER_PAGER_TIER_INTERNAL_H
#define KVPAGER_PAGER_TIER_INTERNAL_H

#include <pthread.h>

#include "kvpager/tier.h"
#include "pager/pool_internal.h"

struct kvp_tier {
    kvp_tier_vtable vtable; /* the library's size; the caller's fields copied in */
    void *impl;
    /* kvp_tier_run's rendezvous: the handle's, not the waiter's stack, so the
     * pair outlives a done that is still returning from its unlock. */
    pthread_mutex_t wait_lock;
    pthread_cond_t wait_cond;
};

/*
 * The lock and condition of every count that a tier's completion may drop
 * last (an attachment's users and counters, tier_pool.c; a prefetch's
 * references, completion and waits, tier_load.c; a composed tier's batches
 * in flight, tier_compose.c): library-wide and
 * never destroyed (tier.c defines them). A count's owner that waits for it
 * to reach zero and then frees its state would otherwise destroy a mutex a
 * completion on another thread has just unlocked: glibc's unlock writes the
 * mutex after the release helgrind records, and helgrind reports the
 * destroy as a race (it did, for both, in timing-dependent runs). Critical
 * sections under it are short and call nothing that locks.
 */
extern pthread_mutex_t kvpi_tier_count_lock;
extern pthread_cond_t kvpi_tier_count_cond;

/* tier's implementation when its vtable's name is `name` (the same static
 * text, compared by address: an implementation's own tiers), else NULL.
 * For an implementation's own calls on its handles (tier_redis.h). */
void *kvpi_tier_impl_of(kvp_tier *tier, const char *name);

/* Why a block failed verification (kvpi_tier_block_verify). */
typedef enum kvpi_tier_reject {
    KVPI_TIER_BLOCK_OK = 0,
    KVPI_TIER_REJECT_SIZE,
    KVPI_TIER_REJECT_MAGIC,
    KVPI_TIER_REJECT_VERSION,
    KVPI_TIER_REJECT_MAC,
    KVPI_TIER_REJECT_GEOMETRY,
    KVPI_TIER_REJECT_KEY,
    KVPI_TIER_REJECT_BINDING
} kvpi_tier_reject;

/* "size", "magic", ... for a rejection; NULL for KVPI_TIER_BLOCK_OK. */
const char *kvpi_tier_reject_name(kvpi_tier_reject reject);

/* Bytes of a tier block's nonce (tier_block.c's layout). */
#define KVPI_TIER_NONCE_BYTES 16

/*
 * Packs page `page` of `pool` (its rows as stored) under `key` and `binding`
 * into out[0 .. KVP_TIER_HEADER_BYTES + page_bytes), MAC'd with `secret`
 * under `nonce`, which no other block packed under this secret may carry
 * (random, or a random prefix and a counter). Reads the page's bytes: the
 * caller makes sure nobody writes them (the pool lock for a borrowed or
 * evictable page; the cache's owner otherwise).
 */
void kvpi_tier_block_pack(const kvp_pool *pool, uint32_t page, const kvp_block_key *key,
                          const kvp_block_key *binding, const unsigned char *secret,
                          const unsigned char nonce[KVPI_TIER_NONCE_BYTES], unsigned char *out);

/*
 * Verifies block[0..bytes) as the block of `key` under `binding` for pages
 * of `pool`'s geometry (the checks and their order: kvp_tier_block_verify).
 * KVPI_TIER_BLOCK_OK, *payload then pointing at its page bytes.
 */
kvpi_tier_reject kvpi_tier_block_verify(const kvp_pool *pool, const kvp_block_key *key,
                                        const kvp_block_key *binding,
                                        const unsigned char *secret, const void *block,
                                        size_t bytes, const unsigned char **payload);

/* A block's size for `pool`: KVP_TIER_HEADER_BYTES + page_bytes. */
static inline size_t kvpi_tier_block_bytes(const kvp_pool *pool)
{
    return KVP_TIER_HEADER_BYTES + pool->page_bytes;
}

/*
 * The adopt-side checks of a group (share.c, the same ones
 * kvp_cache_group_adopt makes, in its order): *room = n capped to the
 * blocks every cache still has room for.
 */
kvp_status kvpi_cache_group_adopt_check(kvp_cache *const *caches, size_t count,
                                        const kvp_block_key *keys, size_t n, size_t *room,
                                        kvp_error *err);

/* ---- the pool's tier state (tier_pool.c; loads and prefetches: tier_load.c) ---- */

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
    /* the next block's nonce: 8 random bytes drawn at attach, then a count of
       the blocks packed (under the pool lock), so no two blocks share one */
    unsigned char nonce[KVPI_TIER_NONCE_BYTES];
    size_t users;          /* puts in flight, loads running, prefetches in flight
                              (under kvpi_tier_count_lock, as the stats) */
    uint64_t serial;       /* this attachment's number (a prefetch maps only under it) */
    kvp_pool_tier_stats stats;
    put_slot ring[KVPI_TIER_RING];
};

/* The pool's tier state with one more user, or NULL when it has none (tier_pool.c). */
kvpi_pool_tier *kvpi_pool_tier_use(kvp_pool *pool);
/* One user less (takes kvpi_tier_count_lock); t may be freed by a detach once it returns. */
void kvpi_pool_tier_unuse(kvpi_pool_tier *t);
/* The same, with kvpi_tier_count_lock held (a done's). */
void kvpi_pool_tier_user_done_locked(kvpi_pool_tier *t);

#endif /* KVPAGER_PAGER_TIER_INTERNAL_H */
