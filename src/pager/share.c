/*
 * share.c: pages shared between caches (kvpager/cache.h "Sharing").
 *
 * Owns: fork (and the scheduler's fork that keeps the parent the one writer
 * of the shared partial page), truncate, the chain keys of the prefix
 * index (a 128-bit BLAKE2b stream keyed with the pool's secret, over the
 * binding digest, the parent key, an optional context and the block's
 * input bytes; and the per-layer keys a block key derives, SipHash-2-4-128
 * keyed with it: kvpi_block_key_layers), publishing full blocks and adopting published prefixes,
 * for one cache or a group of caches (a sequence's layers) in one hold of
 * the pool lock: publish and adopt exist only here.
 *
 * Invariants (with pool.c and prefix.c; I5 in DESIGN.md):
 *   - a page's refcount counts every table slot naming it, across caches;
 *     a full page is never written again, so sharing it needs no copy;
 *   - a cache writes its partial last page in place only when cow == 0, and
 *     cow == 1 whenever that page is registered, or shared (refcount > 1)
 *     unless the cache is the page's one writer: the parent of
 *     kvpi_cache_fork_writer_locked, unmarked, no shorter than any other
 *     cache naming the page, every one of them marked; fork, truncate and a
 *     deferred undo set it; the append that copies (cache.c) clears it, and
 *     a truncate recomputes it (cache_cow.c) (a truncated writer is marked while shared);
 *   - a chain key covers the cache's binding digest (its kind, geometry and
 *     max_positions, the owner's digest, revision and record bytes, the
 *     pool's dtype and block_tokens, an fp8 cache's K and V scales) by
 *     construction: no caller can build a key without one, so whatever
 *     changes the owner's record (attention: a parameter's revision, RoPE;
 *     an engine: its weights' revision) makes every older key unreachable;
 *   - a registered page records the binding digest of the cache that
 *     published it, and is adopted only into caches of that digest, whatever
 *     key a caller built (BLOCK_BINDING_MISMATCH otherwise, nothing changed);
 *   - a group adopts block j in every cache or in none, and a group publish
 *     refused for one page registers none.
 * Everything that changes reference state runs under the pool lock.
 * Callers: the public API, src/serve (sequences and the scheduler fork,
 * truncate, probe, adopt and publish every layer at once).
 */
#include "pager/cache_internal.h"

#include <sodium.h>
#include <stddef.h>
#include <string.h>

#include "pager/error.h"
#include "pager/tier_internal.h"

/* ---- fork ---------------------------------------------------------------- */

/*
 * The child takes the parent's captured binding too, not the one it was
 * created with: K/V computed under older revisions stay bound to them, so a
 * fork of a stale cache is as stale as its parent (its steps are refused the
 * same way) instead of binding the new weights over old rows.
 */
static void fork_locked(kvp_cache *parent, kvp_cache *child, int parent_writes)
{
    child->binding = parent->binding;
    size_t mapped = kvpi_cache_mapped_blocks(parent);
    for (size_t lane = 0; lane < parent->batch_size; lane++) {
        const uint32_t *from = kvpi_cache_lane_table(parent, lane);
        uint32_t *to = child->tables + lane * child->blocks_per_lane;
        for (size_t block = 0; block < mapped; block++) {
            if (from[block] == KVPI_NO_PAGE) {
                continue; /* released: a fork shares only the live blocks */
            }
            kvpi_pool_ref_locked(parent->pool, from[block]);
            to[block] = from[block];
        }
    }
    child->released_end = parent->released_end;
    child->len = parent->len;
    child->epoch++;
    if (parent->len % parent->block_tokens != 0 && !parent_writes) {
        parent->cow = 1;
        child->cow = 1;
        parent->epoch++; /* a ticket prepared before the fork did not reserve the copy */
    } else if (parent->len % parent->block_tokens != 0) {
        child->cow = 1; /* the parent keeps its mark, and its tickets stay valid */
    }
}

void kvpi_cache_fork_into_locked(kvp_cache *parent, kvp_cache *child)
{
    fork_locked(parent, child, 0);
}

/*
 * The parent keeps its mark: unmarked, it stays the one writer of its
 * partial last page and appends in place (at positions >= its length, which
 * no child reads: a child reads below the fork's length and copies before
 * it writes). So n sharers make n - 1 copies. The audit checks the writer
 * (kvpi_cache_audit_writer, I5). Only the scheduler uses it: every sample of a request
 * lives and dies together, so the parent never lets its children outgrow it.
 */
void kvpi_cache_fork_writer_locked(kvp_cache *parent, kvp_cache *child)
{
    fork_locked(parent, child, 1);
}

void kvpi_cache_fork_many(kvp_cache *const *parents, kvp_cache *const *children, size_t count)
{
    kvp_pool *pool = parents[0]->pool;
    kvpi_pool_lock(pool);
    for (size_t c = 0; c < count; c++) {
        kvpi_cache_fork_into_locked(parents[c], children[c]);
    }
    kvpi_pool_unlock(pool);
}

kvp_status kvp_cache_fork(kvp_cache *parent, kvp_cache **child, kvp_error *err)
{
    if (parent == NULL) {
        return kvpi_fail_null(err, "parent");
    }
    if (child == NULL) {
        return kvpi_fail_null(err, "child");
    }
    if (parent->reserved_rows != 0) {
        kvp_error e = kvpi_error_begin(KVP_ROWS_RESERVED);
        e.tokens = parent->reserved_rows;
        return kvpi_error_emit(err, &e);
    }
    kvp_cache *made = NULL;
    kvp_status status = kvp_cache_create(parent->pool, &parent->binding, parent->batch_size,
                                         parent->capacity, &made, err);
    if (status != KVP_OK) {
        return status;
    }
    kvpi_pool_lock(parent->pool);
    kvpi_cache_fork_into_locked(parent, made);
    kvpi_pool_unlock(parent->pool);
    *child = made;
    return KVP_OK;
}

/* ---- truncate ------------------------------------------------------------ */

kvp_status kvp_cache_truncate(kvp_cache *cache, size_t new_len, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (cache->reserved_rows != 0) {
        kvp_error e = kvpi_error_begin(KVP_ROWS_RESERVED);
        e.tokens = cache->reserved_rows;
        return kvpi_error_emit(err, &e);
    }
    if (new_len > cache->len) {
        return kvpi_fail_out_of_range(err, "new_len", new_len, cache->len + 1);
    }
    if (new_len == cache->len) {
        return KVP_OK;
    }
    kvpi_pool_lock(cache->pool);
    kvp_status status = kvpi_cache_truncate_check(cache, new_len, err);
    if (status != KVP_OK) {
        kvpi_pool_unlock(cache->pool);
        return status;
    }
    kvpi_cache_truncate_many_locked(&cache, 1, new_len);
    kvpi_pool_unlock(cache->pool);
    return KVP_OK;
}

/* ---- chain keys ---------------------------------------------------------- */

/*
 * Keyed BLAKE2b (libsodium's crypto_generichash), 16-byte output, fed as a
 * stream, keyed with the pool's secret: nobody without the secret can
 * choose inputs whose keys collide, or tell from a key what was hashed.
 * (bench/keys.c measures it against the MurmurHash3 it replaced.)
 */
typedef struct hash128 {
    crypto_generichash_state state;
} hash128;

static void hash_init(hash128 *h, const kvp_pool *pool)
{
    /* Cannot fail with these lengths (16 <= out <= 64, key <= 64 bytes). */
    (void)crypto_generichash_init(&h->state, pool->key_secret, sizeof pool->key_secret,
                                  sizeof(kvp_block_key));
}

static void hash_bytes(hash128 *h, const void *data, size_t n)
{
    (void)crypto_generichash_update(&h->state, data, n);
}

static void hash_u64(hash128 *h, uint64_t v)
{
    unsigned char b[8];
    for (int i = 0; i < 8; i++) {
        b[i] = (unsigned char)(v >> (8 * i));
    }
    hash_bytes(h, b, sizeof b);
}

/* Eight bytes read little-endian, whatever the host. */
static uint64_t load64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

static kvp_block_key hash_final(hash128 *h)
{
    unsigned char out[sizeof(kvp_block_key)];
    (void)crypto_generichash_final(&h->state, out, sizeof out);
    kvp_block_key key = {load64(out), load64(out + 8)};
    if (key.lo == 0 && key.hi == 0) {
        key.lo = 1; /* the zero key is never produced */
    }
    return key;
}

static void hash_key(hash128 *h, const kvp_block_key *key)
{
    hash_u64(h, key->lo);
    hash_u64(h, key->hi);
}

/*
 * Every field of the binding and of the pool's page format, one by one (no
 * padding); of the fp8 scales, the ones the cache uses (kvpi_cache_kv_scales).
 */
kvp_block_key kvpi_cache_binding_key(const kvp_cache *cache)
{
    const kvp_binding *b = &cache->binding;
    hash128 h;
    hash_init(&h, cache->pool);
    hash_u64(&h, 0x62696e64696e67ull); /* "binding" */
    hash_u64(&h, b->kind);
    hash_u64(&h, b->kv_heads);
    hash_u64(&h, b->head_width);
    hash_u64(&h, b->max_positions);
    hash_u64(&h, b->owner_digest[0]);
    hash_u64(&h, b->owner_digest[1]);
    hash_u64(&h, b->owner_revision);
    hash_bytes(&h, b->record, sizeof b->record); /* opaque: every byte, uninterpreted */
    hash_u64(&h, (uint64_t)cache->pool->dtype);
    hash_u64(&h, cache->pool->block_tokens);
    hash_u64(&h, cache->pool->heads);
    hash_u64(&h, cache->pool->head_width);
    /* The scales fp8 elements stand under (1.0 and 1.0 for other dtypes): the bits. */
    double scales[2];
    kvpi_cache_kv_scales(cache, &scales[0], &scales[1]);
    for (size_t i = 0; i < 2; i++) {
        uint64_t bits;
        memcpy(&bits, &scales[i], sizeof bits);
        hash_u64(&h, bits);
    }
    return hash_final(&h);
}

kvp_status kvp_cache_binding_key(const kvp_cache *cache, kvp_block_key *out, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    *out = kvpi_cache_binding_key(cache);
    return KVP_OK;
}

kvp_status kvp_block_key_chain(const kvp_block_key *parent, const kvp_cache *cache,
                               const void *input, size_t bytes, const kvp_block_key *context,
                               kvp_block_key *out, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (input == NULL && bytes != 0) {
        return kvpi_fail_null(err, "input");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_block_key binding = kvpi_cache_binding_key(cache);
    *out = kvpi_block_key_chain(cache->pool, parent, &binding, input, bytes, context);
    return KVP_OK;
}

kvp_block_key kvpi_block_key_chain(const kvp_pool *pool, const kvp_block_key *parent,
                                   const kvp_block_key *binding, const void *input, size_t bytes,
                                   const kvp_block_key *context)
{
    hash128 h;
    hash_init(&h, pool);
    hash_key(&h, binding);
    hash_u64(&h, parent != NULL);
    if (parent != NULL) {
        hash_key(&h, parent);
    }
    hash_u64(&h, context != NULL);
    if (context != NULL) {
        hash_key(&h, context);
    }
    hash_u64(&h, bytes);
    if (bytes != 0) {
        hash_bytes(&h, input, bytes);
    }
    return hash_final(&h);
}

/*
 * Per-layer keys of one block from its block key: SipHash-2-4 with a
 * 128-bit output (libsodium's crypto_shorthash_siphashx24, a PRF) keyed
 * with the block key over each layer's id. The block key is a keyed
 * BLAKE2b output under the pool's secret (kvpi_block_key_chain), so it is
 * as secret as the secret, and each derived key is unpredictable without
 * it; distinct (block key, id) pairs collide only by chance (2^-128 a pair).
 */
void kvpi_block_key_layers(const kvp_block_key *block, const kvp_block_key *ids, size_t layers,
                           kvp_block_key *out, size_t stride)
{
    unsigned char k[crypto_shorthash_siphashx24_KEYBYTES];
    for (int i = 0; i < 8; i++) {
        k[i] = (unsigned char)(block->lo >> (8 * i));
        k[8 + i] = (unsigned char)(block->hi >> (8 * i));
    }
    for (size_t l = 0; l < layers; l++) {
        unsigned char in[sizeof(kvp_block_key)];
        for (int i = 0; i < 8; i++) {
            in[i] = (unsigned char)(ids[l].lo >> (8 * i));
            in[8 + i] = (unsigned char)(ids[l].hi >> (8 * i));
        }
        unsigned char o[crypto_shorthash_siphashx24_BYTES];
        (void)crypto_shorthash_siphashx24(o, in, sizeof in, k);
        kvp_block_key key = {load64(o), load64(o + 8)};
        if (key.lo == 0 && key.hi == 0) {
            key.lo = 1; /* the zero key is never produced */
        }
        out[l * stride] = key;
    }
}

/* ---- publish and adopt ------------------------------------------------------ */

/*
 * Keys of a group: keys[(j * count + c) * batch + lane] is block j (past the
 * caches' common length for adopt, from block 0 for publish) of cache c,
 * lane `lane`. Publish and adopt exist once, here: kvp_cache_publish_block
 * is a group of one page, the sequence (src/serve) calls the group.
 */

static int key_equal(const kvp_block_key *a, const kvp_block_key *b)
{
    return a->lo == b->lo && a->hi == b->hi;
}

/* PAGE_PUBLISHED when `page` is registered under another key than `key`. */
static kvp_status publish_check_locked(const kvp_pool *pool, uint32_t page,
                                       const kvp_block_key *key, size_t which, kvp_error *err)
{
    if (pool->registered[page] && !key_equal(&pool->page_key[page], key)) {
        kvp_error e = kvpi_error_begin(KVP_PAGE_PUBLISHED);
        e.index = page;
        e.layer = which;
        return kvpi_error_emit(err, &e);
    }
    return KVP_OK;
}

/*
 * Registers `page` under `key` unless it is registered or the key names
 * another page; 1 when the page is left unregistered (the key's).
 */
static int publish_insert_locked(kvp_pool *pool, uint32_t page, const kvp_block_key *key,
                                 const kvp_block_key *binding)
{
    if (pool->registered[page]) {
        return 0;
    }
    if (kvpi_prefix_lookup_locked(pool, key) != KVPI_NO_PAGE) {
        return 1;
    }
    kvpi_prefix_insert_locked(pool, page, key, binding);
    if (pool->tier != NULL) {
        pool->tier_write_locked(pool, page, 1); /* write-through, when the policy says */
    }
    return 0;
}

/* BLOCK_RELEASED for publishing released block `block` (of cache `layer` of a group). */
static kvp_status released_error(size_t block, size_t bt, size_t layer, kvp_error *err)
{
    kvp_error e = kvpi_error_begin(KVP_BLOCK_RELEASED);
    e.index = block;
    e.position = block * bt;
    e.layer = layer;
    e.what = "publish";
    return kvpi_error_emit(err, &e);
}

kvp_status kvpi_cache_publish_locked(kvp_cache *const *caches, size_t count,
                                     const kvp_block_key *keys, size_t blocks, kvp_error *err)
{
    return kvpi_cache_publish_range_locked(caches, count, keys, 0, blocks, NULL, err);
}

kvp_status kvpi_cache_group_publish_range(kvp_cache *const *caches, size_t count,
                                          const kvp_block_key *keys, size_t from, size_t blocks,
                                          size_t *left, kvp_error *err)
{
    kvpi_pool_lock(caches[0]->pool);
    kvp_status status =
        kvpi_cache_publish_range_locked(caches, count, keys, from, blocks, left, err);
    kvpi_pool_unlock(caches[0]->pool);
    return status;
}

kvp_status kvpi_cache_publish_range_locked(kvp_cache *const *caches, size_t count,
                                           const kvp_block_key *keys, size_t from, size_t blocks,
                                           size_t *left, kvp_error *err)
{
    kvp_pool *pool = caches[0]->pool;
    size_t batch = caches[0]->batch_size;
    /* First pass: refuse before registering anything. */
    for (size_t i = from * count * batch; i < blocks * count * batch; i++) {
        size_t c = (i / batch) % count;
        uint32_t page = kvpi_cache_lane_table(caches[c], i % batch)[i / (count * batch)];
        if (page == KVPI_NO_PAGE) {
            continue; /* released by a window: nothing to register (DESIGN.md) */
        }
        kvp_status status = publish_check_locked(pool, page, &keys[i], c, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    size_t unregistered = 0;
    for (size_t c = 0; c < count; c++) {
        kvp_block_key binding = kvpi_cache_binding_key(caches[c]);
        for (size_t j = from; j < blocks; j++) {
            for (size_t lane = 0; lane < batch; lane++) {
                uint32_t page = kvpi_cache_lane_table(caches[c], lane)[j];
                if (page == KVPI_NO_PAGE) {
                    continue;
                }
                unregistered += (size_t)publish_insert_locked(
                    pool, page, &keys[(j * count + c) * batch + lane], &binding);
            }
        }
    }
    if (left != NULL) {
        *left = unregistered;
    }
    return KVP_OK;
}

kvp_status kvp_cache_publish_block(kvp_cache *cache, size_t lane, size_t block,
                                   const kvp_block_key *key, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (key == NULL) {
        return kvpi_fail_null(err, "key");
    }
    if (lane >= cache->batch_size) {
        return kvpi_fail_out_of_range(err, "lane", lane, cache->batch_size);
    }
    size_t full = cache->len / cache->block_tokens;
    if (block >= full) {
        return kvpi_fail_out_of_range(err, "block", block, full);
    }
    kvp_pool *pool = cache->pool;
    uint32_t page = kvpi_cache_lane_table(cache, lane)[block];
    if (page == KVPI_NO_PAGE) {
        return released_error(block, cache->block_tokens, 0, err);
    }
    kvp_block_key binding = kvpi_cache_binding_key(cache);
    kvpi_pool_lock(pool);
    kvp_status status = publish_check_locked(pool, page, key, 0, err);
    if (status == KVP_OK) {
        publish_insert_locked(pool, page, key, &binding);
    }
    kvpi_pool_unlock(pool);
    return status;
}

size_t kvpi_prefix_probe(kvp_pool *pool, const kvp_block_key *keys, size_t per_block,
                         const size_t *windows, size_t block_tokens, size_t blocks,
                         size_t *evictable_pages)
{
    /* An empty group of one lane: adoption's rule (share_window.c) over the index as it is now. */
    kvpi_hit_group g = {pool, keys, per_block, 1, block_tokens, 0, NULL, windows};
    kvpi_pool_lock(pool);
    size_t found = kvpi_hit_group_run(&g, blocks, evictable_pages);
    kvpi_pool_unlock(pool);
    return found;
}

/*
 * BLOCK_BINDING_MISMATCH for the first page of the `blocks` hit blocks that
 * was published under another binding digest than its adopter's.
 */
static kvp_status group_check_bindings_locked(const kvp_cache *const *caches, size_t count,
                                              const kvp_block_key *keys, size_t blocks,
                                              kvp_error *err)
{
    const kvp_pool *pool = caches[0]->pool;
    size_t batch = caches[0]->batch_size;
    size_t first = caches[0]->len / caches[0]->block_tokens;
    for (size_t c = 0; c < count; c++) {
        kvp_block_key mine = kvpi_cache_binding_key(caches[c]);
        for (size_t j = 0; j < blocks; j++) {
            if (!kvpi_group_needs(caches[c], first, blocks, j)) {
                continue; /* a sliding cache's block before its window: not adopted */
            }
            for (size_t lane = 0; lane < batch; lane++) {
                uint32_t page =
                    kvpi_prefix_lookup_locked(pool, &keys[(j * count + c) * batch + lane]);
                if (!key_equal(&pool->page_binding[page], &mine)) {
                    kvp_error e = kvpi_error_begin(KVP_BLOCK_BINDING_MISMATCH);
                    e.index = page;
                    e.layer = c;
                    e.position = (first + j) * caches[c]->block_tokens;
                    return kvpi_error_emit(err, &e);
                }
            }
        }
    }
    return KVP_OK;
}

kvp_status kvpi_cache_adopt_locked(kvp_cache *const *caches, size_t count,
                                   const kvp_block_key *keys, size_t n, size_t *adopted,
                                   kvp_error *err)
{
    kvp_pool *pool = caches[0]->pool;
    size_t batch = caches[0]->batch_size;
    size_t first = caches[0]->len / caches[0]->block_tokens;
    /* The hit rule for full and sliding caches (share_window.c). */
    size_t hits = kvpi_group_hits_locked((const kvp_cache *const *)caches, count, keys, n, NULL);
    kvp_status status =
        group_check_bindings_locked((const kvp_cache *const *)caches, count, keys, hits, err);
    if (status != KVP_OK) {
        return status; /* nothing mapped, no hit or miss counted */
    }
    size_t pages = 0;
    for (size_t j = 0; j < hits; j++) {
        const kvp_block_key *row = keys + j * count * batch;
        for (size_t c = 0; c < count; c++) {
            if (!kvpi_group_needs(caches[c], first, hits, j)) {
                continue; /* before a sliding cache's window: stays a null entry, released */
            }
            for (size_t lane = 0; lane < batch; lane++) {
                uint32_t page = kvpi_prefix_lookup_locked(pool, &row[c * batch + lane]);
                kvpi_pool_ref_locked(pool, page);
                caches[c]->tables[lane * caches[c]->blocks_per_lane + first + j] = page;
            }
            pages += batch;
        }
    }
    pool->prefix_hits += pages;
    pool->prefix_misses += hits < n;
    if (hits != 0) {
        for (size_t c = 0; c < count; c++) {
            caches[c]->len += hits * caches[c]->block_tokens;
            caches[c]->epoch++;
            kvpi_cache_release_front_locked(caches[c]);
        }
    }
    *adopted = hits;
    return KVP_OK;
}

/* ---- the public group calls ----------------------------------------------- */

/*
 * A group's own checks: NULL_ARGUMENT ("caches"), INVALID_ARGUMENT ("count"
 * zero; "caches": not one pool, batch, block size and length).
 */
static kvp_status group_check(const kvp_cache *const *caches, size_t count, kvp_error *err)
{
    if (caches == NULL) {
        return kvpi_fail_null(err, "caches");
    }
    if (count == 0) {
        return kvpi_fail_invalid(err, "count", "a group needs at least one cache");
    }
    for (size_t c = 0; c < count; c++) {
        if (caches[c] == NULL) {
            return kvpi_fail_null(err, "caches");
        }
    }
    const kvp_cache *a = caches[0];
    for (size_t c = 1; c < count; c++) {
        const kvp_cache *b = caches[c];
        if (b->pool != a->pool || b->batch_size != a->batch_size || b->len != a->len) {
            return kvpi_fail_invalid(err, "caches",
                                     "must share one pool, batch size and length");
        }
    }
    return KVP_OK;
}

/* The adopt-side checks of every cache: ROWS_RESERVED, NOT_AT_BLOCK_BOUNDARY. */
static kvp_status adopt_check(const kvp_cache *cache, kvp_error *err)
{
    if (cache->reserved_rows != 0) {
        kvp_error e = kvpi_error_begin(KVP_ROWS_RESERVED);
        e.tokens = cache->reserved_rows;
        return kvpi_error_emit(err, &e);
    }
    if (cache->len % cache->block_tokens != 0) {
        kvp_error e = kvpi_error_begin(KVP_NOT_AT_BLOCK_BOUNDARY);
        e.current_len = cache->len;
        e.block_tokens = cache->block_tokens;
        return kvpi_error_emit(err, &e);
    }
    return KVP_OK;
}

/* The blocks every cache of the group still has room for, at most n. */
static size_t group_room(const kvp_cache *const *caches, size_t count, size_t n)
{
    for (size_t c = 0; c < count; c++) {
        size_t room = (caches[c]->capacity - caches[c]->len) / caches[c]->block_tokens;
        n = room < n ? room : n;
    }
    return n;
}

kvp_status kvp_cache_group_probe(const kvp_cache *const *caches, size_t count,
                                 const kvp_block_key *keys, size_t n, size_t *blocks,
                                 size_t *evictable_pages, kvp_error *err)
{
    kvp_status status = group_check(caches, count, err);
    if (status != KVP_OK) {
        return status;
    }
    if (keys == NULL && n != 0) {
        return kvpi_fail_null(err, "keys");
    }
    if (blocks == NULL) {
        return kvpi_fail_null(err, "blocks");
    }
    n = group_room(caches, count, n);
    kvp_pool *pool = caches[0]->pool;
    size_t evictable = 0;
    kvpi_pool_lock(pool);
    size_t hits = kvpi_group_hits_locked(caches, count, keys, n, &evictable);
    status = group_check_bindings_locked(caches, count, keys, hits, err);
    kvpi_pool_unlock(pool);
    if (status == KVP_OK) {
        *blocks = hits;
        if (evictable_pages != NULL) {
            *evictable_pages = evictable;
        }
    }
    return status;
}

kvp_status kvp_cache_group_adopt(kvp_cache *const *caches, size_t count,
                                 const kvp_block_key *keys, size_t n, size_t *adopted,
                                 kvp_error *err)
{
    kvp_status status = group_check((const kvp_cache *const *)caches, count, err);
    if (status != KVP_OK) {
        return status;
    }
    if (keys == NULL && n != 0) {
        return kvpi_fail_null(err, "keys");
    }
    if (adopted == NULL) {
        return kvpi_fail_null(err, "adopted");
    }
    for (size_t c = 0; c < count; c++) {
        status = adopt_check(caches[c], err);
        if (status != KVP_OK) {
            return status;
        }
    }
    n = group_room((const kvp_cache *const *)caches, count, n);
    size_t got = 0;
    kvpi_pool_lock(caches[0]->pool);
    status = kvpi_cache_adopt_locked(caches, count, keys, n, &got, err);
    kvpi_pool_unlock(caches[0]->pool);
    if (status == KVP_OK) {
        *adopted = got;
    }
    return status;
}

kvp_status kvp_cache_group_publish(kvp_cache *const *caches, size_t count,
                                   const kvp_block_key *keys, size_t blocks, kvp_error *err)
{
    kvp_status status = group_check((const kvp_cache *const *)caches, count, err);
    if (status != KVP_OK) {
        return status;
    }
    if (keys == NULL && blocks != 0) {
        return kvpi_fail_null(err, "keys");
    }
    size_t full = caches[0]->len / caches[0]->block_tokens;
    if (blocks > full) {
        return kvpi_fail_out_of_range(err, "blocks", blocks, full + 1);
    }
    if (blocks == 0) {
        return KVP_OK;
    }
    kvpi_pool_lock(caches[0]->pool);
    status = kvpi_cache_publish_locked(caches, count, keys, blocks, err);
    kvpi_pool_unlock(caches[0]->pool);
    return status;
}

kvp_status kvp_cache_adopt_prefix(kvp_cache *cache, const kvp_block_key *keys, size_t n,
                                  size_t *adopted, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    return kvp_cache_group_adopt(&cache, 1, keys, n, adopted, err);
}

/* ---- for the tier's load (tier_pool.c) -------------------------------------- */

kvp_status kvpi_cache_group_adopt_check(kvp_cache *const *caches, size_t count,
                                        const kvp_block_key *keys, size_t n, size_t *room,
                                        kvp_error *err)
{
    kvp_status status = group_check((const kvp_cache *const *)caches, count, err);
    if (status != KVP_OK) {
        return status;
    }
    if (keys == NULL && n != 0) {
        return kvpi_fail_null(err, "keys");
    }
    for (size_t c = 0; c < count; c++) {
        status = adopt_check(caches[c], err);
        if (status != KVP_OK) {
            return status;
        }
    }
    *room = group_room((const kvp_cache *const *)caches, count, n);
    return KVP_OK;
}
