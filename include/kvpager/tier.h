/*
 * kvpager/tier.h: a second tier for evicted prefix blocks (host memory, a
 * network store), the block format it stores, and the pool's write-back to
 * and load from it.
 *
 * A tier stores opaque blocks by chain key (kvp_block_key). A block is one
 * page's bytes behind a header (DESIGN.md, "Tier block format"): magic and
 * format version, dtype and page geometry, the chain key, the binding digest
 * of the cache that published the page, a random nonce, and a MAC over all
 * of it (Poly1305 under a one-time key, the keyed BLAKE2b of the header
 * under a deployment secret the caller supplies). A pool given a tier
 * (kvp_pool_tier_attach) writes every published page it evicts to the tier
 * (write-back; optionally every page it publishes: write-through), and
 * kvp_cache_group_tier_load maps blocks the tier holds into fresh pages,
 * verified, in chain order, all or nothing per block.
 *
 * The tier interface is a vtable (kvp_tier_vtable) an implementation fills,
 * wrapped in an opaque kvp_tier handle (kvp_tier_create). Calls are batches
 * with asynchronous completion: each accepted batch ends with exactly one
 * call of the caller's `done`, from any thread, possibly before the call that
 * issued the batch returns (a host tier completes inline; a network tier from
 * its own thread). kvp_tier_run issues a batch and waits for it.
 *
 * Threads: every call here is thread-safe unless its own line says
 * otherwise; see each declaration.
 */
#ifndef KVPAGER_TIER_H
#define KVPAGER_TIER_H

#include "kvpager/cache.h"
#include "kvpager/common.h"
#include "kvpager/pool.h"
#include "kvpager/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_tier kvp_tier;

/* Bytes of a tier's MAC secret (kvp_tier_policy.secret): a BLAKE2b key. */
#define KVP_TIER_SECRET_BYTES 32
/* Bytes of a tier block's header; a block is this plus the pool's page_bytes. */
#define KVP_TIER_HEADER_BYTES 112
/* The block format's version (DESIGN.md, "Tier block format"). */
#define KVP_TIER_FORMAT_VERSION 2

/*
 * One block of a batch. The caller fills key and, for put, data and bytes;
 * for get, data and capacity. The tier fills `bytes` (contains, get) and
 * `status` before it calls done.
 *   contains: bytes = the stored block's size, 0 when the tier holds none.
 *   get:      as contains, and the block's bytes copied to data when
 *             bytes <= capacity (BUFFER_TOO_SMALL in status otherwise).
 *   put:      data/bytes are the block; the tier copies what it keeps before
 *             the put call returns, so the caller may reuse data at once.
 * status: KVP_OK (held or not: bytes says which), or why this block failed
 * (TIER_UNAVAILABLE: the store could not be asked; BUFFER_TOO_SMALL).
 */
typedef struct kvp_tier_block {
    kvp_block_key key;
    void *data;
    size_t capacity;
    size_t bytes;
    kvp_status status;
} kvp_tier_block;

/*
 * Completion of one batch: `blocks` is the array the batch was issued with,
 * every status and bytes filled. Called exactly once per accepted batch,
 * from any thread (possibly inside the call that issued it, and then with
 * whatever locks that caller holds: a done must not block and must not call
 * back into the tier or a pool).
 */
typedef void (*kvp_tier_done_fn)(void *ctx, kvp_tier_block *blocks, size_t count);

/*
 * An implementation's batch call: KVP_OK when it accepted the batch (done
 * will be called exactly once), or a typed failure (done is never called).
 * Contracts every implementation keeps:
 *   - a call never blocks on I/O: put, in particular, is called by the pool
 *     with the pool's lock held (write-back on evict), so it copies or
 *     queues the blocks and returns; when its queue is full it completes the
 *     block with TIER_UNAVAILABLE (a dropped write), never waits;
 *   - it never calls into a kvpager pool or cache;
 *   - it is thread-safe: batches may be issued from many threads at once.
 */
typedef kvp_status (*kvp_tier_batch_fn)(void *impl, kvp_tier_block *blocks, size_t count,
                                        kvp_tier_done_fn done, void *ctx, kvp_error *err);

/*
 * The vtable. A growing struct (pool.h, "Growing structs"): struct_size is
 * the implementer's sizeof, set by kvp_tier_vtable_init.
 * destroy: completes every batch still pending (its done called, statuses
 * TIER_UNAVAILABLE for blocks not served), joins the implementation's
 * threads and frees impl. Called once, by kvp_tier_destroy.
 */
typedef struct kvp_tier_vtable {
    size_t struct_size;
    const char *name; /* static text, e.g. "host", "redis" */
    kvp_tier_batch_fn contains;
    kvp_tier_batch_fn get;
    kvp_tier_batch_fn put;
    void (*destroy)(void *impl);
    /* first release ends here */
} kvp_tier_vtable;

/*
 * Zeroes *vtable and sets struct_size. NULL is ignored.
 * Threads: thread-safe (touches only *vtable).
 */
KVP_API void kvp_tier_vtable_init(kvp_tier_vtable *vtable);

/*
 * Wraps an implementation: the handle keeps a copy of *vtable and `impl`.
 * Errors: NULL_ARGUMENT (vtable, out; "contains", "get", "put", "destroy"
 * for a missing function); INVALID_ARGUMENT ("struct_size");
 * ALLOCATION_FAILED. On failure impl is not destroyed.
 * Threads: thread-safe.
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_create(const kvp_tier_vtable *vtable, void *impl,
                                                 kvp_tier **out, kvp_error *err);

/*
 * Calls the implementation's destroy (completing pending batches), then
 * frees the handle. NULL does nothing. The tier must not be attached to a
 * pool (kvp_pool_tier_detach first).
 * Threads: not safe while any other call uses the tier.
 */
KVP_API kvp_status kvp_tier_destroy(kvp_tier *tier, kvp_error *err);

/*
 * The vtable's name ("host", ...); "none" for NULL.
 * Threads: thread-safe.
 */
KVP_API const char *kvp_tier_name(const kvp_tier *tier);

/* Which batch call (kvp_tier_run). Values are stable (ABI). */
typedef enum kvp_tier_op { KVP_TIER_CONTAINS = 0, KVP_TIER_GET = 1, KVP_TIER_PUT = 2 } kvp_tier_op;

/*
 * Issues one batch (as the vtable's call, see kvp_tier_batch_fn). Errors
 * before the implementation is asked: NULL_ARGUMENT (tier; blocks when
 * count > 0; done); INVALID_ARGUMENT ("op"). count 0: done is called at
 * once with no block, and KVP_OK.
 * Threads: thread-safe (implementations are).
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_issue(kvp_tier *tier, kvp_tier_op op,
                                                kvp_tier_block *blocks, size_t count,
                                                kvp_tier_done_fn done, void *ctx,
                                                kvp_error *err);

/*
 * Issues one batch and waits for its completion (a condition variable: the
 * calling thread sleeps). KVP_OK when the batch completed (look at each
 * block's status and bytes); kvp_tier_issue's errors and the
 * implementation's refusal otherwise.
 * Threads: thread-safe. Never call it with a pool's lock held or from a done.
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_run(kvp_tier *tier, kvp_tier_op op,
                                              kvp_tier_block *blocks, size_t count,
                                              kvp_error *err);

/* ---- the host-memory tier ------------------------------------------------ */

/*
 * Counters of a host tier (kvp_tier_host_stats_get). A growing struct.
 * hits and misses count get blocks (contains asks count neither); puts count
 * blocks stored (a put of a key already held replaces it and counts);
 * evictions count blocks dropped to stay within the budget; rejected_puts
 * blocks larger than the whole budget, empty or without data (completed
 * TIER_UNAVAILABLE).
 */
typedef struct kvp_tier_host_stats {
    size_t struct_size;
    size_t budget_bytes;
    size_t bytes;        /* block bytes held now (payload only: the blocks' sizes) */
    size_t blocks;       /* blocks held now */
    uint64_t hits;
    uint64_t misses;
    uint64_t puts;
    uint64_t evictions;
    uint64_t rejected_puts;
    /* first release ends here */
} kvp_tier_host_stats;

/*
 * Zeroes *stats, sets struct_size. NULL is ignored.
 * Threads: thread-safe (touches only *stats).
 */
KVP_API void kvp_tier_host_stats_init(kvp_tier_host_stats *stats);

/*
 * A tier in this process's memory: at most budget_bytes of block bytes (the
 * sum of the blocks' sizes), least recently used block dropped first (a get
 * hit or a put makes a block the most recent). Completes every batch inline,
 * under its own mutex. Errors: NULL_ARGUMENT (out); ZERO_SIZE
 * ("budget_bytes"); ALLOCATION_FAILED.
 * Threads: thread-safe; the tier's calls are thread-safe.
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_host_create(size_t budget_bytes, kvp_tier **out,
                                                      kvp_error *err);

/*
 * A keys-only host tier, for allocator-only pools (KVP_SLAB_RESERVED: no
 * page bytes exist to store). The same table, LRU and byte budget as
 * kvp_tier_host_create, and the same counters, but it keeps no bytes: a
 * put records the block's key and counts the block at its size (`bytes`,
 * what a byte tier would hold; `data` is not read and may be NULL) against
 * budget_bytes; a get of a held key fills `bytes` with that size, copies
 * nothing (`data`, `capacity` ignored) and makes it the most recent. So
 * its hits, evictions and bytes held are those a byte tier of the same
 * budget would have over the same puts and gets: what a capacity planner
 * sizes a real tier with. Only a pool without data attaches it
 * (kvp_pool_tier_attach); kvp_tier_name says "host-keys";
 * kvp_tier_host_stats_get reads its counters. Errors as
 * kvp_tier_host_create.
 * Threads: thread-safe; the tier's calls are thread-safe.
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_host_keys_create(size_t budget_bytes, kvp_tier **out,
                                                           kvp_error *err);

/*
 * 1 when `tier` keeps keys only (made by kvp_tier_host_keys_create), else 0
 * (NULL included).
 * Threads: thread-safe (reads the handle's name, fixed at creation).
 */
KVP_API int kvp_tier_keys_only(const kvp_tier *tier);

/*
 * A snapshot of a host tier's counters. Errors: NULL_ARGUMENT;
 * INVALID_ARGUMENT ("tier": not a host tier; "struct_size").
 * Threads: thread-safe (one snapshot under the tier's mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_host_stats_get(kvp_tier *tier,
                                                         kvp_tier_host_stats *out,
                                                         kvp_error *err);

/* ---- two tiers as one ------------------------------------------------------ */

/*
 * A tier made of two: `near` (host memory) in front of `far` (a shared
 * store). contains and get ask near first, then far for the blocks near did
 * not hold (or failed), in one batch; a get far serves is put to near
 * (promoted) before the caller's done. put goes to both (a block is stored,
 * KVP_OK, when either took it; else it has far's failure). The composition does not own the two tiers:
 * destroy it first (its destroy waits for its batches in flight), then them.
 * near's calls run inside far's completions, so near must complete without
 * blocking (the host tier does). Errors: NULL_ARGUMENT (near, far, out);
 * INVALID_ARGUMENT ("far": the same tier as near; "near" or "far": a
 * keys-only tier, which composes with nothing); ALLOCATION_FAILED.
 * Threads: thread-safe; the composed tier's calls are thread-safe.
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_compose_create(kvp_tier *near, kvp_tier *far,
                                                         kvp_tier **out, kvp_error *err);

/* ---- a pool's tier --------------------------------------------------------- */

/*
 * How a pool uses its tier. A growing struct (kvp_tier_policy_init).
 * secret: the deployment secret that keys the blocks' MAC; all zero is
 * refused (every process sharing a tier must agree on it, so it cannot be
 * drawn at random). write_through: 0 (the default) writes a page when the
 * pool evicts it (write-back); 1 writes every page when it is first
 * published instead, and nothing at eviction (write-through; DESIGN.md
 * says which suits which workload).
 */
typedef struct kvp_tier_policy {
    size_t struct_size;
    unsigned char secret[KVP_TIER_SECRET_BYTES];
    int write_through;
    /* first release ends here */
} kvp_tier_policy;

/*
 * Zeroes *policy (write-back, no secret), sets struct_size. NULL is ignored.
 * Threads: thread-safe (touches only *policy).
 */
KVP_API void kvp_tier_policy_init(kvp_tier_policy *policy);

/*
 * The pool's tier counters (kvp_pool_tier_stats_get). A growing struct.
 *   writes:          blocks handed to the tier's put (evictions and, under
 *                    write-through, publishes);
 *   write_failures:  of those, blocks the tier refused or failed, and writes
 *                    dropped because 64 were in flight already;
 *   loads:           pages mapped from tier blocks (kvp_cache_group_tier_load);
 *   load_bytes:      block bytes those pages came from;
 *   misses:          pages a load asked for that the tier did not hold;
 *   load_failures:   pages the tier failed to read (TIER_UNAVAILABLE);
 *   rejected:        blocks that failed verification, never mapped, and by
 *                    reason: rejected_header (size, magic, version),
 *                    rejected_mac, rejected_geometry (dtype or geometry),
 *                    rejected_key, rejected_binding.
 */
typedef struct kvp_pool_tier_stats {
    size_t struct_size;
    size_t block_bytes; /* KVP_TIER_HEADER_BYTES + page_bytes */
    uint64_t writes;
    uint64_t write_failures;
    uint64_t loads;
    uint64_t load_bytes;
    uint64_t misses;
    uint64_t load_failures;
    uint64_t rejected;
    uint64_t rejected_header;
    uint64_t rejected_mac;
    uint64_t rejected_geometry;
    uint64_t rejected_key;
    uint64_t rejected_binding;
    /* first release ends here */
} kvp_pool_tier_stats;

/*
 * Zeroes *stats, sets struct_size. NULL is ignored.
 * Threads: thread-safe (touches only *stats).
 */
KVP_API void kvp_pool_tier_stats_init(kvp_pool_tier_stats *stats);

/*
 * Gives `pool` a tier (it does not own it: the tier outlives the
 * attachment). From now on, each published page the pool evicts (under
 * write-through: each page it publishes) is packed into a block and put to
 * the tier: at the moment a take borrows it from
 * the LRU list (the last moment its rows are intact; DESIGN.md), copied
 * under the pool lock into a buffer of the pool's, handed to put, which
 * copies it and returns without waiting on I/O; its completion only counts.
 * Errors: NULL_ARGUMENT (pool, tier, policy); INVALID_ARGUMENT
 * ("struct_size"; "secret": all zero; "write_through": not 0 or 1; "pool":
 * a tier is attached already, or the pool holds no data, KVP_SLAB_RESERVED,
 * and the tier is not keys-only; "tier": a keys-only tier given to a pool
 * that holds data); ALLOCATION_FAILED.
 * A keys-only tier (kvp_tier_host_keys_create) is the one tier a pool
 * without data takes: an evicted (or published) page is written as its key
 * alone, counted at the block size (KVP_TIER_HEADER_BYTES + page_bytes),
 * and nothing is packed, MAC'd or read; kvp_cache_group_tier_load then maps
 * fresh pages for the keys the tier holds, unwritten (as an allocator-only
 * append commits rows), and verifies only the size (the chain keys already
 * digest the binding). A byte tier's path (pack, MAC, verify) is unchanged.
 * Counters start at zero.
 * Threads: thread-safe (under the pool's mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_tier_attach(kvp_pool *pool, kvp_tier *tier,
                                                      const kvp_tier_policy *policy,
                                                      kvp_error *err);

/*
 * Detaches the pool's tier: no write starts after it; it waits until every
 * put already issued has completed, then forgets the tier, its counters and
 * the secret (zeroed). A pool without a tier: KVP_OK, nothing happens.
 * kvp_pool_destroy detaches too.
 * Threads: thread-safe; never from a tier's done.
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_tier_detach(kvp_pool *pool, kvp_error *err);

/*
 * The pool's tier counters. Errors: NULL_ARGUMENT; INVALID_ARGUMENT
 * ("struct_size"; "pool": no tier attached).
 * Threads: thread-safe.
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_tier_stats_get(kvp_pool *pool,
                                                         kvp_pool_tier_stats *out,
                                                         kvp_error *err);

/* ---- blocks ----------------------------------------------------------------- */

/*
 * Packs the page of `lane`, block `block` of `cache` into out[0..bytes):
 * header, then the page's bytes, MAC'd under `secret`. The page must be
 * published (registered in the pool's index): its key and binding digest go
 * into the header. *bytes = KVP_TIER_HEADER_BYTES + page_bytes.
 * Errors: NULL_ARGUMENT (cache, secret, out, bytes); OUT_OF_RANGE ("lane",
 * "block": a full block); INVALID_ARGUMENT ("block": its page is not
 * published; "cache": its pool holds no data); BUFFER_TOO_SMALL ("out").
 * Threads: one caller at a time per cache (as its owner reads its rows).
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_block_pack(const kvp_cache *cache, size_t lane,
                                                     size_t block,
                                                     const unsigned char *secret, void *out,
                                                     size_t capacity, size_t *bytes,
                                                     kvp_error *err);

/*
 * Verifies `block` (`bytes` long) as the block of `key` for `cache`: KVP_OK
 * when its size, magic and version are right, its MAC verifies under
 * `secret`, its dtype and geometry are the cache's pool's, its key is `key`
 * and its binding digest is the cache's (kvp_cache_binding_key). Otherwise
 * TIER_BLOCK_REJECTED with err.what the first check that failed, in that
 * order: "size", "magic", "version", "mac", "geometry", "key", "binding".
 * NULL_ARGUMENT (cache, key, secret, block). Changes nothing, counts nothing.
 * Threads: thread-safe (reads the cache's binding, fixed at creation).
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_block_verify(const kvp_cache *cache,
                                                       const kvp_block_key *key,
                                                       const unsigned char *secret,
                                                       const void *block, size_t bytes,
                                                       kvp_error *err);

/*
 * Loads the next blocks of a group of caches (one cache: count 1) from the
 * pool's tier. keys as kvp_cache_group_adopt: keys[(j * count + c) * batch
 * + lane] names block j past the caches' common length (a block boundary) of
 * cache c, lane `lane`; at most n blocks, fewer when a cache has no room.
 * It gets every key from the tier in one batch (waiting for it, without the
 * pool lock), verifies each block (kvp_tier_block_verify under the pool's
 * secret), and takes the longest run of leading blocks j whose pages, in
 * every cache and lane, were all found and verified. In one hold of the
 * pool lock it then takes fresh pages for them (a take may evict, writing
 * the evicted pages back), copies each block's page bytes in, maps them in
 * chain order, publishes each under its key (unless the index holds the key
 * already), and advances every cache by block_tokens per block.
 * *loaded = the blocks loaded (0 .. n). *stop, when not NULL, says why the
 * run ended: KVP_OK (n blocks, or a block the tier did not hold),
 * TIER_BLOCK_REJECTED (a block failed verification, or the tier held a
 * value longer than a block: BUFFER_TOO_SMALL in its status, counted as a
 * rejection by size), TIER_UNAVAILABLE (the tier failed a block). Counted (kvp_pool_tier_stats):
 * loads, load_bytes, misses, load_failures and rejections of every block
 * the batch returned. A block past the run is never mapped, whatever it held.
 * Errors, changing nothing (no page, no counter): NULL_ARGUMENT (caches,
 * keys when n > 0, loaded); INVALID_ARGUMENT (as group adopt; "pool": no
 * tier attached); ROWS_RESERVED; NOT_AT_BLOCK_BOUNDARY; ALLOCATION_FAILED;
 * the tier's refusal of the batch; POOL_EXHAUSTED (too few free or
 * evictable pages for the run: exhaustions + 1, as every refusal).
 * Threads: one caller at a time per cache; never with the pool's lock held.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_group_tier_load(kvp_cache *const *caches,
                                                           size_t count,
                                                           const kvp_block_key *keys, size_t n,
                                                           size_t *loaded, kvp_status *stop,
                                                           kvp_error *err);

/* A tier get in flight or completed, and the buffers it fills (kvp_pool_tier_prefetch). */
typedef struct kvp_tier_prefetch kvp_tier_prefetch;

/*
 * A load in two halves (DESIGN.md, "Load" and "Prefetch while a request
 * waits"): the tier's get issued now, the mapping later. kvp_pool_tier_prefetch issues
 * one get for n blocks' keys (per keys a block: count * batch of the caches
 * that will map them, laid out as kvp_cache_group_tier_load's) into buffers
 * the handle owns, and returns at once; the get completes on the tier's
 * time. kvp_cache_group_tier_map maps from a completed prefetch exactly as
 * kvp_cache_group_tier_load maps from its own get (which is a prefetch
 * waited for and mapped: the same code), starting `skip` blocks in (those
 * the caches gained meanwhile, e.g. by adoption from the index). The pool's
 * detach waits for every prefetch in flight (as for loads), and a prefetch
 * issued under one attachment never maps under another.
 * Errors of kvp_pool_tier_prefetch, changing nothing: NULL_ARGUMENT (pool,
 * keys when n > 0, out); INVALID_ARGUMENT ("per": 0; "pool": no tier
 * attached); ALLOCATION_FAILED; the tier's refusal of the batch.
 * Threads: thread-safe; never with the pool's lock held or from a done.
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_tier_prefetch(kvp_pool *pool,
                                                        const kvp_block_key *keys, size_t n,
                                                        size_t per, kvp_tier_prefetch **out,
                                                        kvp_error *err);

/*
 * 1 when the prefetch's get completed (it may be mapped), with *seconds
 * (when not NULL) its time from issue to completion; 0 while in flight.
 * NULL: 0.
 * Threads: thread-safe (under the handle's mutex).
 */
KVP_API int kvp_tier_prefetch_ready(kvp_tier_prefetch *prefetch, double *seconds);

/*
 * Sleeps until the prefetch's get completed. NULL does nothing.
 * Threads: thread-safe; never with a pool's lock held or from a done.
 */
KVP_API void kvp_tier_prefetch_wait(kvp_tier_prefetch *prefetch);

/*
 * Maps blocks [skip, n) of a completed prefetch into the caches, as
 * kvp_cache_group_tier_load maps its batch (verified, the leading run of
 * blocks all of whose pages were found and verified, one hold of the pool
 * lock, published, counted in kvp_pool_tier_stats: the blocks from skip on
 * only). keys[skip * per ...] must name the blocks past the caches' common
 * length. A prefetch maps once. *loaded, *stop: as the load's.
 * Errors, changing nothing: NULL_ARGUMENT (caches, prefetch, loaded);
 * INVALID_ARGUMENT ("prefetch": still in flight, or mapped already;
 * "skip": past n; "count": count * batch is not the prefetch's per;
 * "caches": not the prefetch's pool; "pool": its tier was detached since
 * the issue); the load's other errors.
 * Threads: one caller at a time per cache and per prefetch; never with the
 * pool's lock held.
 */
KVP_API KVP_NODISCARD kvp_status kvp_cache_group_tier_map(kvp_cache *const *caches,
                                                          size_t count,
                                                          kvp_tier_prefetch *prefetch,
                                                          size_t skip, size_t *loaded,
                                                          kvp_status *stop, kvp_error *err);

/*
 * Frees the prefetch; one in flight is cancelled without waiting: its
 * buffers are freed when its get completes (the completion holds the last
 * reference). NULL does nothing.
 * Threads: one caller at a time per prefetch (its completion may run
 * meanwhile, on any thread).
 */
KVP_API void kvp_tier_prefetch_destroy(kvp_tier_prefetch *prefetch);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_TIER_H */
