/*
 * cache_internal.h: the layer cache as attention and steps see it.
 *
 * Owns: struct kvp_cache, the private append path (validate, reserve,
 * commit) and the page-walking accessors the attention gather uses.
 *
 * Invariants:
 *   - 0 <= len <= capacity <= binding.max_positions;
 *   - for every lane, tables[lane][0..ceil(len/block_tokens)) name held
 *     pages and the rest are KVPI_NO_PAGE (I4);
 *   - heads == binding.kv_heads == the pool's heads: a cache stores KV heads
 *     only; the pager knows no query heads (they are in attention's owner
 *     record, binding.record, which the pager never reads);
 *   - position p of lane b, KV head h lives in page tables[b][p / block_tokens]
 *     at slot p % block_tokens: keys at page + (h*block_tokens + slot)*d_h,
 *     values at page + ((H + h)*block_tokens + slot)*d_h, in elements of the
 *     pool's dtype (kvpager/pool.h), rounded from f64 once, at commit;
 *   - epoch advances on every commit and reset, so a ticket can tell that
 *     the cache changed since it was prepared;
 *   - len and tables change only under the pool lock (pool_internal.h);
 *   - sharing (share.c): a page may be named by several caches' tables
 *     (forks, adopters of the prefix index). Full pages are never written
 *     again. The partial last page is written in place only when `cow` is
 *     0; cow is 1 whenever that page is registered, or shared unless the
 *     cache is its one writer (kvpi_cache_fork_writer_locked; I5), and the
 *     next append first copies it, in every lane, to pages it reserved
 *     with the append (kvpi_cache_pages_needed counts them; cache_cow.c);
 *   - an external cache (binding.kind == KVP_BINDING_EXTERNAL) takes rows from
 *     its owner (kvp_cache_append_rows, reserve/commit/discard) and never
 *     from attention; a layer-bound cache the other way round.
 *
 * Callers: src/pager, src/attention and src/serve. Not part of the public API: the raw
 * append stays private, as in the seed.
 */
#ifndef KVPAGER_PAGER_CACHE_INTERNAL_H
#define KVPAGER_PAGER_CACHE_INTERNAL_H

#include "kvpager/cache.h"
#include "kvpager/types.h"
#include "pager/pool_internal.h"
#include "pager/reservation.h"

struct kvp_cache {
    kvpi_holder holder;
    kvp_pool *pool;
    kvp_binding binding;
    size_t batch_size;
    size_t capacity;
    size_t len;
    size_t heads;            /* stored heads: binding.kv_heads (the pool's heads) */
    size_t head_width;
    size_t block_tokens;
    size_t blocks_per_lane;
    uint32_t *tables;        /* [batch_size][blocks_per_lane] */
    uint32_t *spare_entries; /* [batch_size], storage of spare_reservation */
    kvpi_reservation spare_reservation; /* used by the private append only */
    uint64_t serial;         /* unique in the process, never reused */
    uint64_t epoch;
    /*
     * External caches only (kvp_binding_is_external): the pending row
     * reservation of kvp_cache_reserve_rows. row_entries has batch_size *
     * blocks_per_lane slots (in the tables allocation). While reserved_rows
     * > 0, row_reservation holds exactly kvp_cache_pages_for(len +
     * reserved_rows) tentative pages, block by block, lane by lane, of which
     * promise_drawn came from `promise`. All four change under the pool lock.
     */
    uint32_t *row_entries;
    kvpi_reservation row_reservation;
    size_t reserved_rows;
    size_t promise_drawn;
    size_t promise;          /* this cache's share of pool->promised */
    /*
     * Copy-on-write (cache_cow.c). cow: the next append copies every lane's
     * partial last page before writing. cow_defer: a transaction (a
     * sequence's prefill) keeps the pages a copy replaced in cow_saved
     * (each with its reference) until kvpi_cache_cow_settle_many_locked or
     * kvpi_cache_cow_undo_many_locked; cow_saved[lane] is KVPI_NO_PAGE otherwise.
     */
    int cow;
    int cow_defer;
    uint32_t *cow_saved;     /* [batch_size], in the tables allocation */
    /*
     * Front truncation (sliding windows, DESIGN "Sliding windows and
     * sinks"). window and sinks: the owner's W and S, read once at creation
     * through the binding's window reader (kvpi_pager_set_window_reader; 0
     * and 0, never released, for an external binding or when no reader is
     * set). released_end: every lane's blocks [sink_blocks, released_end)
     * are KVPI_NO_PAGE, released; none when released_end <= sink_blocks
     * (kvpi_cache_sink_blocks). Changes under the pool lock.
     * release_hold: releases wait (kvpi_cache_hold_release_many) until
     * kvpi_cache_resume_release_many, so an owner can publish a prefill's
     * blocks before its window lets them go; cleared by a reset.
     */
    size_t window;
    size_t sinks;
    size_t released_end;
    int release_hold;
};

/*
 * The owner's reading of a binding's window: W and S of a layer-bound
 * binding (attention registers it, src/attention/layer.c), so the pager
 * never reads the record itself. Set once per process; later calls with
 * the same function change nothing. Threads: thread-safe (atomic).
 */
typedef void (*kvpi_binding_window_fn)(const kvp_binding *binding, size_t *window,
                                       size_t *sinks);
void kvpi_pager_set_window_reader(kvpi_binding_window_fn fn);

/* Blocks covering the sink tokens [0, S) of blocks of bt tokens: never released. */
static inline size_t kvpi_window_sink_blocks(size_t sinks, size_t bt)
{
    return (sinks + bt - 1) / bt;
}

/*
 * The first block still needed at length len past the sinks for a window W
 * (0: none) and blocks of bt tokens: blocks entirely below len - W (every
 * reader's window start, the paged read without a candidate's q = len - 1
 * included) are never read again.
 */
static inline size_t kvpi_window_live_from(size_t window, size_t bt, size_t len)
{
    return window == 0 || len <= window ? 0 : (len - window) / bt;
}

/* Blocks covering the sink tokens [0, S): never released. */
static inline size_t kvpi_cache_sink_blocks(const kvp_cache *cache)
{
    return kvpi_window_sink_blocks(cache->sinks, cache->block_tokens);
}

/* kvpi_window_live_from for the cache's window and block size. */
static inline size_t kvpi_cache_live_from(const kvp_cache *cache, size_t len)
{
    return kvpi_window_live_from(cache->window, cache->block_tokens, len);
}

/* 1 when every lane's block `block` was released (a null entry). */
static inline int kvpi_cache_block_released(const kvp_cache *cache, size_t block)
{
    return block >= kvpi_cache_sink_blocks(cache) && block < cache->released_end;
}

/* Blocks a lane holds a page for: the mapped ones less the released run. */
static inline size_t kvpi_cache_held_blocks(const kvp_cache *cache)
{
    size_t mapped = cache->len / cache->block_tokens + (cache->len % cache->block_tokens != 0);
    size_t sb = kvpi_cache_sink_blocks(cache);
    return mapped - (cache->released_end > sb ? cache->released_end - sb : 0);
}

/*
 * Under the pool lock: releases every lane's blocks past the sinks that lie
 * entirely below len - W (kvpi_cache_live_from), block by block, lane by
 * lane: a page whose last reference this was goes to the free list, or to
 * the LRU list when published; a shared page drops this table's reference.
 * Does nothing under cow_defer (a transaction releases at its settle) or for
 * a cache without a window. Cannot fail. Returns the pages released (blocks
 * times lanes), for the committer's promise refund.
 */
size_t kvpi_cache_release_front_locked(kvp_cache *cache);
/*
 * hold_release_many: the caches release nothing (every commit, settle and
 * adoption keeps its blocks) until resume_release_many, which releases what
 * their windows no longer need and returns the pages released (no promise
 * refunded: the caller sets its promise again). Each takes the pool lock.
 * The scheduler holds a prompt's prefill so it can publish the prompt's
 * blocks before they go: a prefill holds every block it writes until its
 * end anyway, so the hold adds nothing to its peak.
 */
void kvpi_cache_hold_release_many(kvp_cache *const *caches, size_t count);
size_t kvpi_cache_resume_release_many(kvp_cache *const *caches, size_t count);
/* Sets window, sinks (the reader's) and released_end = 0 at creation (cache_window.c). */
void kvpi_cache_window_init(kvp_cache *cache, const kvp_binding *binding);
/*
 * KVP_OK when truncating to `len` keeps every block the window at len needs
 * (the sinks and [len - W, len)); else BLOCK_RELEASED (index = the first
 * released block needed, position its first needed position, tokens = len,
 * what "new_len"). len 0 needs nothing.
 */
kvp_status kvpi_cache_truncate_check(const kvp_cache *cache, size_t len, kvp_error *err);
/* Per lane: kvp_cache_pages_held_max for a window, sinks and block size. */
size_t kvpi_window_pages_held_max(size_t window, size_t sinks, size_t bt, size_t len);

/*
 * The binding the cache captured at creation, owner record included: the
 * way its owner (attention) reads its record back. The pager never
 * interprets binding->owner_digest, owner_revision or record.
 */
static inline const kvp_binding *kvpi_cache_binding(const kvp_cache *cache)
{
    return &cache->binding;
}

/* The copy-on-write pages the next append takes: batch_size when cow, else 0. */
static inline size_t kvpi_cache_cow_pages(const kvp_cache *cache)
{
    return cache->cow && cache->len % cache->block_tokens != 0 ? cache->batch_size : 0;
}

/* Blocks a lane maps at the current length. */
static inline size_t kvpi_cache_mapped_blocks(const kvp_cache *cache)
{
    return cache->len / cache->block_tokens + (cache->len % cache->block_tokens != 0);
}

static inline const uint32_t *kvpi_cache_lane_table(const kvp_cache *cache, size_t lane)
{
    return cache->tables + lane * cache->blocks_per_lane;
}

/* The pool's storage type: every page of this cache holds elements of it. */
/* 0 when the cache's pool holds no page data (KVP_SLAB_RESERVED): its rows cannot be read. */
static inline int kvpi_cache_has_data(const kvp_cache *cache)
{
    return kvpi_pool_has_data(cache->pool);
}

static inline kvp_dtype kvpi_cache_dtype(const kvp_cache *cache)
{
    return cache->pool->dtype;
}

/*
 * The block_tokens key rows of `head` in `page`, contiguous, [block_tokens][d_h]
 * elements of kvpi_cache_dtype(cache).
 */
static inline const void *kvpi_cache_page_keys(const kvp_cache *cache, uint32_t page,
                                               size_t head)
{
    return (const unsigned char *)kvpi_pool_page(cache->pool, page) +
           head * cache->block_tokens * cache->head_width * cache->pool->element_bytes;
}

/* The block_tokens value rows of `head` in `page`, as kvpi_cache_page_keys. */
static inline const void *kvpi_cache_page_values(const kvp_cache *cache, uint32_t page,
                                                 size_t head)
{
    return (const unsigned char *)kvpi_pool_page(cache->pool, page) +
           (cache->heads + head) * cache->block_tokens * cache->head_width *
               cache->pool->element_bytes;
}

/*
 * Storage type and fp8 scales (cache_dtype.c).
 * kvpi_cache_kv_scales: the K and V scales of an fp8 cache (its binding's);
 *   1.0 and 1.0 for every other dtype. A stored fp8 element e of a key stands
 *   for e * k_scale, of a value for e * v_scale.
 * kvpi_cache_row_scale: the one of them for keys (values == 0) or values.
 * kvpi_cache_round_rows: rounds n key (values == 0) or value elements in
 *   place to what the cache's pages store, widened (f64: unchanged; fp8: the
 *   element round(x / scale), not multiplied back). The candidate of a
 *   prepare and the rows of a prefill go through it, so kvpi_cache_commit
 *   stores them exactly. None may overflow (kvpi_cache_check_storable).
 * kvpi_binding_check_scales: INVALID_ARGUMENT ("k_scale", then "v_scale")
 *   for a scale that is not 0 and not finite, normal and > 0.
 * kvpi_binding_scale: the scale a binding's field means: 1.0 for 0, else itself.
 */
void kvpi_cache_kv_scales(const kvp_cache *cache, double *k_scale, double *v_scale);
double kvpi_cache_row_scale(const kvp_cache *cache, int values);
void kvpi_cache_round_rows(const kvp_cache *cache, int values, double *rows, size_t n);
kvp_status kvpi_binding_check_scales(const kvp_binding *binding, kvp_error *err);
double kvpi_binding_scale(double scale);

/*
 * The seed's validate_append, in the seed's order: key shape [B,H,1,d_h],
 * value shape, FULL, first key not finite as stored, first such value. "Not
 * finite as stored": non-finite in f64 (err.what NULL), or finite but
 * overflowing the pool's dtype (err.what its name; for fp8, x / k_scale or
 * x / v_scale above 464; dtype.h).
 */
kvp_status kvpi_cache_validate_append(const kvp_cache *cache, const kvp_tensor *key,
                                      const kvp_tensor *value, kvp_error *err);

/*
 * Pages the next append needs: batch_size when it opens a new block or
 * copies a shared partial page (cow), else 0.
 * Precondition: the cache is not full (every caller checked FULL first).
 */
size_t kvpi_cache_pages_needed(const kvp_cache *cache);

/*
 * Makes one validated row per lane visible: stores key and value ([B,H,1,d_h]
 * flat) into their page slots, rounded to the pool's dtype (dtype.h) at
 * scale 1: rows already rounded by kvpi_cache_round_rows (for fp8, the
 * elements themselves) are stored exactly; the private append, whose rows
 * are the values, divides by the fp8 scales first. Maps
 * pages taken from `reservation` when the row opens a block, or, when cow,
 * first copies each lane's partial page to a page taken from `reservation`
 * and maps the copy instead (the original loses this cache's reference, or
 * goes to cow_saved under cow_defer), then len += 1 and epoch += 1.
 * Preconditions: kvpi_cache_validate_append succeeded for these rows, and
 * the reservation holds at least kvpi_cache_pages_needed pages.
 */
void kvpi_cache_commit(kvp_cache *cache, const double *key, const double *value,
                       kvpi_reservation *reservation);

/*
 * KVP_OK when no element of rows[0..n) overflows the cache's storage type;
 * otherwise `status` (NONFINITE_KEY or NONFINITE_VALUE) with what = the
 * type's name, the flat index and the f64 value of the first that does.
 * The status also says which fp8 scale applies: keys' for NONFINITE_KEY,
 * values' for NONFINITE_VALUE. Non-finite elements are not its business.
 * Always KVP_OK for f64.
 */
kvp_status kvpi_cache_check_storable(const kvp_cache *cache, const double *rows, size_t n,
                                     kvp_status status, kvp_error *err);

/*
 * Rolls `count` caches of one pool, all of the same length, back to `len`:
 * pages of blocks past ceil(len / block_tokens) go back to the pool in the
 * exact reverse of the order steps took them (block by block, last layer
 * first, last lane first), so a replay receives the same physical pages.
 * Each cache's epoch advances. Sequences use it to reset and to undo a failed
 * prefill.
 */
void kvpi_cache_truncate_many(kvp_cache *const *caches, size_t count, size_t len);
/* The same, with the pool lock already held; len must not exceed the caches' length. */
void kvpi_cache_truncate_many_locked(kvp_cache *const *caches, size_t count, size_t len);

/*
 * Sharing (share.c), all under the pool lock.
 * fork_into: `child` (empty, same pool, batch and capacity) shares every
 *   page of `parent` (refcount + 1) and takes its length; both are marked
 *   cow when the length is mid-block, and the parent's epoch advances then.
 * adopt_locked: for blocks b = 0, 1, .. n-1 past the caches' common length
 *   (a block boundary), looks up keys[(b * count + c) * batch + lane] for
 *   every cache c and lane; adopts the longest prefix group_hits_locked
 *   allows (a shorter one than n counts one prefix miss); shares the pages
 *   each cache needs at that length (group_needs; prefix_hits counts them),
 *   advances len by block_tokens per block and the epochs, and releases
 *   what the windows no longer need (a sliding cache's blocks before its
 *   window stay null entries, released).
 *   *adopted = the blocks adopted. BLOCK_BINDING_MISMATCH, changing
 *   nothing (no hit or miss counted either), when a page of a hit block was
 *   published under another binding digest than its adopter's.
 * cow_defer / settle / undo (cache_cow.c): a transaction's copy-on-write. settle
 *   drops the saved originals' references; undo maps the originals back,
 *   returns the copies (newest first) and marks cow again. Both end defer.
 */
void kvpi_cache_fork_into_locked(kvp_cache *parent, kvp_cache *child);
/*
 * fork_into, but the parent keeps its mark (share.c): unmarked, it stays the
 * one writer of the shared partial last page and appends in place, while the
 * child (marked) copies. n sharers, n - 1 copies. The scheduler's samples.
 */
void kvpi_cache_fork_writer_locked(kvp_cache *parent, kvp_cache *child);
/*
 * The audit's I5 check of an unmarked cache whose partial page `page` (block
 * `block`) is shared: reports every other cache naming it there that is
 * unmarked or longer. Under the pool lock, from cache.c's audit (cache_cow.c).
 */
void kvpi_cache_audit_writer(const kvp_cache *writer, size_t block, uint32_t page,
                             kvpi_audit *audit);
/* fork_into for `count` parents of one pool, in one hold of the lock (a sequence's layers). */
void kvpi_cache_fork_many(kvp_cache *const *parents, kvp_cache *const *children, size_t count);
/*
 * The prefix hit rule with windows (share_window.c). group_needs: 1 when
 *   cache (of a group whose common length is block `first`) needs block
 *   first + j for a prefix of first + hits blocks: always for a full cache
 *   (and one whose releases are held: it keeps every block until it
 *   resumes); for a sliding one its sink blocks and those from kvpi_cache_live_from
 *   at that length (what a cache of that length keeps). group_hits_locked:
 *   the largest hits <= n for which every needed block of every cache has
 *   every lane's key indexed (full caches left to right, sliding ones right
 *   to left within that length, to a fixpoint); *evictable (may be NULL) =
 *   of the needed pages, those no table names. Changes nothing.
 */
int kvpi_group_needs(const kvp_cache *cache, size_t first, size_t hits, size_t j);
/*
 * The rule itself, over a group described without caches so that admission
 * (which has no caches yet) and adoption run the same code: `count` layers
 * at the common length of `first` blocks of `block_tokens`, `batch` lanes,
 * keys[(j * count + c) * batch + lane] for block first + j; each layer's
 * window from its cache (caches non-NULL: a held cache reads as full) or
 * from windows[2c] (W, 0: full) and windows[2c + 1] (S) (windows NULL:
 * every layer full). The predicate "layer c holds block first + j" is:
 * every lane's key is in the pool's index. hit_group_run: the hit length
 * (largest <= n) and, when evictable is non-NULL, the needed pages no table
 * names, as group_hits_locked; hit_group_needs: group_needs for layer c.
 * Under the pool lock; change nothing.
 */
typedef struct kvpi_hit_group {
    const kvp_pool *pool;
    const kvp_block_key *keys;
    size_t count;
    size_t batch;
    size_t block_tokens;
    size_t first;
    const kvp_cache *const *caches;
    const size_t *windows;
} kvpi_hit_group;
size_t kvpi_hit_group_run(const kvpi_hit_group *g, size_t n, size_t *evictable);
int kvpi_hit_group_needs(const kvpi_hit_group *g, size_t c, size_t hits, size_t j);
size_t kvpi_group_hits_locked(const kvp_cache *const *caches, size_t count,
                              const kvp_block_key *keys, size_t n, size_t *evictable);
kvp_status kvpi_cache_adopt_locked(kvp_cache *const *caches, size_t count,
                                   const kvp_block_key *keys, size_t n, size_t *adopted,
                                   kvp_error *err);
/*
 * publish_locked: kvp_cache_group_publish with the lock held and the
 *   arguments checked: PAGE_PUBLISHED (err.layer = the cache) registering
 *   nothing, else every page registered that is not yet and whose key names
 *   no page, recording its cache's binding digest.
 * prefix_probe: how many leading blocks of `keys` (each block `per_block`
 *   keys, one per layer, one lane) an empty group of caches of layers with
 *   `windows` (as kvpi_hit_group's, NULL: every layer full) and blocks of
 *   `block_tokens` would adopt now (the same rule, kvpi_hit_group_run), and
 *   of the pages it would map how many are evictable (adopting takes them
 *   from the available pages). Changes nothing, not even the hit and miss counters;
 *   takes the pool lock. It does not check bindings: adopt refuses a page
 *   of another binding, which a caller keying its own blocks never meets.
 */
kvp_status kvpi_cache_publish_locked(kvp_cache *const *caches, size_t count,
                                     const kvp_block_key *keys, size_t blocks, kvp_error *err);
/*
 * publish_range_locked: publish_locked for blocks [from, blocks) only
 *   (keys laid out from block 0; those of blocks below `from` are not
 *   read), and *left (may be NULL) = the pages it left unregistered because
 *   their key names another page. group_publish_range: the same, taking the
 *   pool lock; the caller checked the arguments as kvp_cache_group_publish
 *   does (the scheduler: its own leases, full blocks).
 */
kvp_status kvpi_cache_publish_range_locked(kvp_cache *const *caches, size_t count,
                                           const kvp_block_key *keys, size_t from, size_t blocks,
                                           size_t *left, kvp_error *err);
kvp_status kvpi_cache_group_publish_range(kvp_cache *const *caches, size_t count,
                                          const kvp_block_key *keys, size_t from, size_t blocks,
                                          size_t *left, kvp_error *err);
size_t kvpi_prefix_probe(kvp_pool *pool, const kvp_block_key *keys, size_t per_block,
                         const size_t *windows, size_t block_tokens, size_t blocks,
                         size_t *evictable_pages);
void kvpi_cache_cow_defer_many(kvp_cache *const *caches, size_t count);
size_t kvpi_cache_cow_settle_many_locked(kvp_cache *const *caches, size_t count);
void kvpi_cache_cow_undo_many_locked(kvp_cache *const *caches, size_t count);
/*
 * After len changed under the lock: cow = the partial last page is shared or
 * registered (cache_cow.c).
 */
void kvpi_cache_cow_refresh_locked(kvp_cache *cache);
/* kvp_cache_binding_key and kvp_block_key_chain, which cannot fail here. */
kvp_block_key kvpi_cache_binding_key(const kvp_cache *cache);
kvp_block_key kvpi_block_key_chain(const kvp_pool *pool, const kvp_block_key *parent,
                                   const kvp_block_key *binding, const void *input, size_t bytes,
                                   const kvp_block_key *context);
/*
 * One block's key for each of `layers` layers, out[l * stride], from its
 * block key (a kvpi_block_key_chain output) and each layer's id (ids[l]):
 * SipHash-2-4-128 keyed with the block key over the id (share.c). Never
 * the all-zero key. The serve layer keys a sequence's blocks once per
 * block this way, not once per layer (src/serve/share.c).
 */
void kvpi_block_key_layers(const kvp_block_key *block, const kvp_block_key *ids, size_t layers,
                           kvp_block_key *out, size_t stride);
/*
 * Commits the first `rows` reserved rows of an external cache as
 * kvp_cache_commit_written does (the same pages, copy-on-write, counters
 * and epoch), without writing or reading them: the allocator alone (the
 * scheduler with compute off), whose rows nobody reads. Their content is
 * whatever the pages held. Errors as kvp_cache_commit_written's but the
 * nonfinite ones; nothing changes on error (external.c).
 */
kvp_status kvpi_cache_commit_unwritten(kvp_cache *cache, size_t rows, kvp_error *err);
/* Copies rows [0, rows) of every head's keys and values from page `from` to `to` (cache_cow.c). */
void kvpi_cache_copy_rows(const kvp_cache *cache, uint32_t to, uint32_t from, size_t rows);

/*
 * For external.c (the external caches' rows), from cache.c:
 * check_stored: the first element of rows[0..n) not finite as stored
 *   (non-finite in f64, err.what NULL; or overflowing the pool's dtype,
 *   err.what its name), as `status`; KVP_OK when there is none.
 * cow_map_locked: under the pool lock, maps the copies a copy-on-write took
 *   (the next batch_size pages of `reservation`, lane order) over `block`
 *   and lets the originals go (or keeps them in cow_saved under cow_defer).
 * discard_rows_locked: under the pool lock, ends the pending row
 *   reservation, if any: its pages go back newest first, forgotten by the
 *   counters (they were tentative), and the promise they drew is restored.
 */
kvp_status kvpi_cache_check_stored(const kvp_cache *cache, const double *rows, size_t n,
                                   kvp_status status, kvp_error *err);
void kvpi_cache_cow_map_locked(kvp_cache *cache, size_t block, kvpi_reservation *reservation);
void kvpi_cache_discard_rows_locked(kvp_cache *cache);

/*
 * The private raw append: validate, reserve the lanes' pages (all or none),
 * commit. Any error leaves the cache and the pool as they were.
 */
kvp_status kvpi_cache_append(kvp_cache *cache, const kvp_tensor *key, const kvp_tensor *value,
                             kvp_error *err);

#endif /* KVPAGER_PAGER_CACHE_INTERNAL_H */
