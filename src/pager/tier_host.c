/*
 * tier_host.c: the host-memory tier (kvp_tier_host_create, kvpager/tier.h).
 *
 * Owns: a hash table of blocks by chain key (chained buckets, a power of
 * two, doubled when the blocks outnumber the buckets), the LRU list through
 * the blocks (head least recent), the byte budget and the counters, all
 * under one mutex. Every batch completes inline: done is called before the
 * batch call returns, after the mutex is released.
 *
 * Invariants (under `lock`): bytes == the sum of the held blocks' sizes <=
 * budget; every held block is in exactly one bucket chain (its key's) and
 * once on the LRU list; blocks == both lengths; a key is held at most once.
 * Keys only (kvp_tier_host_keys_create): the same table, LRU, budget and
 * counters, but an entry holds no bytes: a put records its key and counts
 * the block's size (b->bytes, data not read), a get reports that size and
 * copies nothing (for allocator-only pools, which write no page bytes).
 * Callers: the kvp_tier handle (tier.c), from any thread.
 */
#include "pager/tier_internal.h"

#include <pthread.h>
#include <string.h>

#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/error.h"

typedef struct entry {
    kvp_block_key key;
    struct entry *chain; /* next in the bucket */
    struct entry *prev;  /* LRU: toward the least recent */
    struct entry *next;  /* LRU: toward the most recent */
    size_t bytes;
    unsigned char data[];
} entry;

typedef struct host_tier {
    pthread_mutex_t lock;
    entry **buckets;
    size_t bucket_count; /* a power of two */
    entry *lru_head;     /* least recently used */
    entry *lru_tail;
    int keys_only; /* entries hold no bytes (kvp_tier_host_keys_create) */
    kvp_tier_host_stats stats;
} host_tier;

static const char host_name[] = "host";
static const char host_keys_name[] = "host-keys";

static size_t bucket_of(const host_tier *h, const kvp_block_key *key)
{
    return (size_t)(key->lo ^ (key->hi >> 13)) & (h->bucket_count - 1);
}

static entry *find(const host_tier *h, const kvp_block_key *key)
{
    for (entry *e = h->buckets[bucket_of(h, key)]; e != NULL; e = e->chain) {
        if (e->key.lo == key->lo && e->key.hi == key->hi) {
            return e;
        }
    }
    return NULL;
}

static void lru_unlink(host_tier *h, entry *e)
{
    if (e->prev != NULL) {
        e->prev->next = e->next;
    } else {
        h->lru_head = e->next;
    }
    if (e->next != NULL) {
        e->next->prev = e->prev;
    } else {
        h->lru_tail = e->prev;
    }
    e->prev = NULL;
    e->next = NULL;
}

static void lru_append(host_tier *h, entry *e)
{
    e->prev = h->lru_tail;
    e->next = NULL;
    if (h->lru_tail != NULL) {
        h->lru_tail->next = e;
    } else {
        h->lru_head = e;
    }
    h->lru_tail = e;
}

/* Unlinks e from its bucket and the LRU list and frees it. */
static void drop(host_tier *h, entry *e)
{
    entry **at = &h->buckets[bucket_of(h, &e->key)];
    while (*at != e) {
        at = &(*at)->chain;
    }
    *at = e->chain;
    lru_unlink(h, e);
    h->stats.bytes -= e->bytes;
    h->stats.blocks--;
    kvpi_free(e);
}

/* Doubles the buckets when blocks outnumber them; on allocation failure keeps the old ones. */
static void maybe_grow(host_tier *h)
{
    if (h->stats.blocks < h->bucket_count) {
        return;
    }
    size_t count = h->bucket_count * 2;
    entry **fresh = kvpi_calloc(KVPI_SITE_SCRATCH, count, sizeof *fresh);
    if (fresh == NULL) {
        return; /* longer chains, still correct */
    }
    for (size_t b = 0; b < h->bucket_count; b++) {
        entry *e = h->buckets[b];
        while (e != NULL) {
            entry *next = e->chain;
            size_t to = (size_t)(e->key.lo ^ (e->key.hi >> 13)) & (count - 1);
            e->chain = fresh[to];
            fresh[to] = e;
            e = next;
        }
    }
    kvpi_free(h->buckets);
    h->buckets = fresh;
    h->bucket_count = count;
}

static kvp_status put_one(host_tier *h, const kvp_tier_block *b)
{
    if (b->bytes == 0 || b->bytes > h->stats.budget_bytes || (b->data == NULL && !h->keys_only)) {
        h->stats.rejected_puts++;
        return KVP_TIER_UNAVAILABLE;
    }
    entry *old = find(h, &b->key);
    if (old != NULL) {
        drop(h, old);
    }
    while (h->stats.bytes + b->bytes > h->stats.budget_bytes) {
        drop(h, h->lru_head);
        h->stats.evictions++;
    }
    entry *e = kvpi_alloc(KVPI_SITE_SCRATCH, sizeof *e + (h->keys_only ? 0 : b->bytes));
    if (e == NULL) {
        h->stats.rejected_puts++;
        return KVP_TIER_UNAVAILABLE;
    }
    e->key = b->key;
    e->bytes = b->bytes; /* keys only: counted at its size, no byte kept */
    if (!h->keys_only) {
        memcpy(e->data, b->data, b->bytes);
    }
    size_t at = bucket_of(h, &e->key);
    e->chain = h->buckets[at];
    h->buckets[at] = e;
    lru_append(h, e);
    h->stats.bytes += e->bytes;
    h->stats.blocks++;
    h->stats.puts++;
    maybe_grow(h);
    return KVP_OK;
}

static kvp_status get_one(host_tier *h, kvp_tier_block *b, int copy)
{
    entry *e = find(h, &b->key);
    b->bytes = e != NULL ? e->bytes : 0;
    if (!copy) {
        return KVP_OK;
    }
    if (e == NULL) {
        h->stats.misses++;
        return KVP_OK;
    }
    h->stats.hits++;
    lru_unlink(h, e);
    lru_append(h, e);
    if (h->keys_only) {
        return KVP_OK; /* its size in bytes; nothing to copy */
    }
    if (b->data == NULL || b->capacity < e->bytes) {
        return KVP_BUFFER_TOO_SMALL;
    }
    memcpy(b->data, e->data, e->bytes);
    return KVP_OK;
}

typedef enum host_op { HOST_CONTAINS, HOST_GET, HOST_PUT } host_op;

static kvp_status host_batch(void *impl, kvp_tier_block *blocks, size_t count,
                             kvp_tier_done_fn done, void *ctx, host_op op)
{
    host_tier *h = impl;
    pthread_mutex_lock(&h->lock);
    for (size_t i = 0; i < count; i++) {
        blocks[i].status =
            op == HOST_PUT ? put_one(h, &blocks[i]) : get_one(h, &blocks[i], op == HOST_GET);
    }
    pthread_mutex_unlock(&h->lock);
    done(ctx, blocks, count);
    return KVP_OK;
}

static kvp_status host_contains(void *impl, kvp_tier_block *blocks, size_t count,
                                kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    (void)err;
    return host_batch(impl, blocks, count, done, ctx, HOST_CONTAINS);
}

static kvp_status host_get(void *impl, kvp_tier_block *blocks, size_t count,
                           kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    (void)err;
    return host_batch(impl, blocks, count, done, ctx, HOST_GET);
}

static kvp_status host_put(void *impl, kvp_tier_block *blocks, size_t count,
                           kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    (void)err;
    return host_batch(impl, blocks, count, done, ctx, HOST_PUT);
}

static void host_destroy(void *impl)
{
    host_tier *h = impl;
    while (h->lru_head != NULL) {
        drop(h, h->lru_head);
    }
    kvpi_free(h->buckets);
    pthread_mutex_destroy(&h->lock);
    kvpi_free(h);
}

void kvp_tier_host_stats_init(kvp_tier_host_stats *stats)
{
    if (stats != NULL) {
        memset(stats, 0, sizeof *stats);
        stats->struct_size = sizeof *stats;
    }
}

static kvp_status host_create(size_t budget_bytes, int keys_only, kvp_tier **out,
                              kvp_error *err)
{
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (budget_bytes == 0) {
        kvp_error e = kvpi_error_begin(KVP_ZERO_SIZE);
        e.argument = "budget_bytes";
        return kvpi_error_emit(err, &e);
    }
    host_tier *h = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *h);
    entry **buckets = h == NULL ? NULL : kvpi_calloc(KVPI_SITE_SCRATCH, 64, sizeof *buckets);
    if (buckets == NULL) {
        kvpi_free(h);
        kvpi_free(buckets);
        return kvpi_fail_alloc(err, "host tier", sizeof *h + 64 * sizeof *buckets);
    }
    pthread_mutex_init(&h->lock, NULL);
    h->buckets = buckets;
    h->bucket_count = 64;
    h->keys_only = keys_only;
    kvp_tier_host_stats_init(&h->stats);
    h->stats.budget_bytes = budget_bytes;
    kvp_tier_vtable v;
    kvp_tier_vtable_init(&v);
    v.name = keys_only ? host_keys_name : host_name;
    v.contains = host_contains;
    v.get = host_get;
    v.put = host_put;
    v.destroy = host_destroy;
    kvp_status status = kvp_tier_create(&v, h, out, err);
    if (status != KVP_OK) {
        host_destroy(h);
    }
    return status;
}

kvp_status kvp_tier_host_create(size_t budget_bytes, kvp_tier **out, kvp_error *err)
{
    return host_create(budget_bytes, 0, out, err);
}

kvp_status kvp_tier_host_keys_create(size_t budget_bytes, kvp_tier **out, kvp_error *err)
{
    return host_create(budget_bytes, 1, out, err);
}

int kvp_tier_keys_only(const kvp_tier *tier)
{
    return tier != NULL && tier->vtable.name == host_keys_name;
}

kvp_status kvp_tier_host_stats_get(kvp_tier *tier, kvp_tier_host_stats *out, kvp_error *err)
{
    if (tier == NULL) {
        return kvpi_fail_null(err, "tier");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (tier->vtable.name != host_name && tier->vtable.name != host_keys_name) {
        return kvpi_fail_invalid(err, "tier", "not a host tier (kvp_tier_host_create)");
    }
    host_tier *h = tier->impl;
    pthread_mutex_lock(&h->lock);
    kvp_tier_host_stats snapshot = h->stats;
    pthread_mutex_unlock(&h->lock);
    return kvpi_struct_out(out, &snapshot, sizeof snapshot, sizeof snapshot, err);
}
