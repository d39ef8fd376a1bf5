/*
 * redis_tier.c: the Redis tier (kvpager/tier_redis.h): the kvp_tier vtable
 * over the internal Redis store (serve/redis_store.h).
 *
 * Owns: the tier's store and, per contains/get batch in flight, one job (the
 * store's lookup, its key, length and value arrays, the caller's blocks,
 * done and ctx), allocated when the batch is issued and freed by the
 * store's completion on the reader thread, just before the caller's done.
 *
 * Mapping (DESIGN.md, "The Redis tier"): contains is a STRLEN lookup (the
 * stored size, 0 when absent), get a GET lookup into the caller's buffers,
 * both one round trip per batch, completed on the store's reader thread;
 * a lookup that failed completes every block TIER_UNAVAILABLE; a value
 * longer than the buffer BUFFER_TOO_SMALL (bytes = its size); a shorter or
 * foreign value comes back as it is, for the pool's verification to reject.
 * put queues copies (kvpi_redis_put, one block at a time so each block's
 * status is its own) and completes inline: KVP_OK queued, TIER_UNAVAILABLE
 * dropped. Store codes map onto kvp_status in status_of.
 *
 * Invariants: every accepted batch gets exactly one done; a refused one
 * (the reader's queue full, the store closing) none, and its job is freed.
 * Callers: the kvp_tier handle (src/pager/tier.c), any thread; the public
 * calls of tier_redis.h.
 */
#include "kvpager/tier_redis.h"

#include <string.h>

#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/error.h"
#include "pager/tier_internal.h"
#include "serve/redis_store.h"

static const char redis_name[] = "redis";

/*
 * How long the store's writer waits for a fuller batch of puts (2 ms):
 * without it a tier written at a steady rate sent about one SET per round
 * trip, each with its wake-ups and syscalls here and in the server
 * (bench/tier_overhead.c, docs/bench.md). A block becomes visible to other
 * processes up to this much later; a flush (drain) never waits for it.
 */
#define REDIS_WRITE_LINGER_US 2000u

typedef struct redis_tier {
    kvpi_redis_store *store;
} redis_tier;

/* One contains/get batch in flight. */
typedef struct redis_job {
    kvpi_redis_lookup lookup;
    kvp_tier_block *blocks;
    size_t count;
    kvp_tier_done_fn done;
    void *ctx;
    kvp_block_key *keys;
    size_t *lengths;         /* contains */
    kvpi_redis_value *values; /* get */
} redis_job;

/* A store code as a kvp_status (OK for OK). */
static kvp_status status_of(kvpi_redis_code code)
{
    switch (code) {
    case KVPI_REDIS_OK:
        return KVP_OK;
    case KVPI_REDIS_BAD_URL:
    case KVPI_REDIS_BAD_ARGUMENT:
        return KVP_INVALID_ARGUMENT;
    case KVPI_REDIS_NO_MEMORY:
        return KVP_ALLOCATION_FAILED;
    case KVPI_REDIS_THREAD:
        return KVP_THREAD_FAILED;
    default:
        return KVP_TIER_UNAVAILABLE;
    }
}

/* Fills *err from a store error: the part in `argument` (bad URL, field) or `what`. */
static kvp_status fail_with(kvp_error *err, kvpi_redis_code code, const kvpi_redis_error *e)
{
    kvp_error out = kvpi_error_begin(status_of(code));
    if (code == KVPI_REDIS_BAD_URL) {
        out.argument = "url";
        out.what = e->part; /* the URL's part, never its text */
    } else if (code == KVPI_REDIS_BAD_ARGUMENT) {
        out.argument = e->part;
        out.what = "a bad Redis tier setting";
    } else if (code == KVPI_REDIS_NO_MEMORY) {
        out.what = "redis tier";
    } else {
        out.what = e->part; /* "queue", "drain", "connect", "GET", ... */
    }
    return kvpi_error_emit(err, &out);
}

/* The store's completion, on its reader thread: fills the blocks, frees the job, calls done. */
static void job_done(kvpi_redis_lookup *lookup, void *context)
{
    redis_job *job = context;
    (void)lookup;
    int ok = job->lookup.error.code == KVPI_REDIS_OK;
    for (size_t i = 0; i < job->count; i++) {
        kvp_tier_block *b = &job->blocks[i];
        b->bytes = 0;
        b->status = ok ? KVP_OK : KVP_TIER_UNAVAILABLE;
        if (!ok) {
            continue;
        }
        if (job->values == NULL) {
            b->bytes = job->lengths[i];
            continue;
        }
        const kvpi_redis_value *v = &job->values[i];
        b->bytes = v->found == KVPI_REDIS_MISS ? 0 : v->length;
        if (v->found == KVPI_REDIS_TOO_BIG) {
            b->status = KVP_BUFFER_TOO_SMALL;
        }
    }
    kvp_tier_done_fn done = job->done;
    void *ctx = job->ctx;
    kvp_tier_block *blocks = job->blocks;
    size_t count = job->count;
    kvpi_free(job);
    done(ctx, blocks, count);
}

/* One allocation: the job, then keys, then lengths or values. */
static redis_job *job_new(kvp_tier_block *blocks, size_t count, int get)
{
    size_t per = sizeof(kvp_block_key) + (get ? sizeof(kvpi_redis_value) : sizeof(size_t));
    if (count > (SIZE_MAX - sizeof(redis_job)) / per) {
        return NULL;
    }
    redis_job *job = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *job + count * per);
    if (job == NULL) {
        return NULL;
    }
    unsigned char *at = (unsigned char *)(job + 1);
    job->keys = (kvp_block_key *)at;
    at += count * sizeof(kvp_block_key);
    if (get) {
        job->values = (kvpi_redis_value *)at;
    } else {
        job->lengths = (size_t *)at;
    }
    for (size_t i = 0; i < count; i++) {
        job->keys[i] = blocks[i].key;
        if (get) {
            job->values[i].data = blocks[i].data;
            job->values[i].capacity = blocks[i].data != NULL ? blocks[i].capacity : 0;
        }
    }
    job->blocks = blocks;
    job->count = count;
    job->lookup.keys = job->keys;
    job->lookup.count = count;
    job->lookup.lengths = job->lengths;
    job->lookup.values = job->values;
    job->lookup.done = job_done;
    job->lookup.context = job;
    return job;
}

static kvp_status redis_lookup(void *impl, kvp_tier_block *blocks, size_t count,
                               kvp_tier_done_fn done, void *ctx, int get, kvp_error *err)
{
    redis_tier *r = impl;
    redis_job *job = job_new(blocks, count, get);
    if (job == NULL) {
        return kvpi_fail_alloc(err, "redis tier batch", count * sizeof(kvpi_redis_value));
    }
    job->done = done;
    job->ctx = ctx;
    kvpi_redis_error e;
    kvpi_redis_code code = kvpi_redis_submit(r->store, &job->lookup, &e);
    if (code != KVPI_REDIS_OK) {
        kvpi_free(job);
        return fail_with(err, code, &e);
    }
    return KVP_OK; /* job_done frees the job and calls done */
}

static kvp_status redis_contains(void *impl, kvp_tier_block *blocks, size_t count,
                                 kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    return redis_lookup(impl, blocks, count, done, ctx, 0, err);
}

static kvp_status redis_get(void *impl, kvp_tier_block *blocks, size_t count,
                            kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    return redis_lookup(impl, blocks, count, done, ctx, 1, err);
}

static kvp_status redis_put(void *impl, kvp_tier_block *blocks, size_t count,
                            kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    redis_tier *r = impl;
    (void)err;
    for (size_t i = 0; i < count; i++) {
        kvp_tier_block *b = &blocks[i];
        kvpi_redis_error e;
        const void *data = b->data;
        size_t bytes = b->bytes;
        kvpi_redis_code code = KVPI_REDIS_BAD_ARGUMENT;
        if (data != NULL && bytes != 0) {
            code = kvpi_redis_put(r->store, &b->key, &data, &bytes, 1, NULL, &e);
        }
        b->status = code == KVPI_REDIS_OK ? KVP_OK : KVP_TIER_UNAVAILABLE;
    }
    done(ctx, blocks, count);
    return KVP_OK;
}

static void redis_destroy(void *impl)
{
    redis_tier *r = impl;
    kvpi_redis_destroy(r->store);
    kvpi_free(r);
}

void kvp_tier_redis_config_init(kvp_tier_redis_config *config)
{
    if (config != NULL) {
        memset(config, 0, sizeof *config);
        config->struct_size = sizeof *config;
    }
}

/* The caller's config, its missing tail zero (defaults). */
static kvp_status config_copy(const kvp_tier_redis_config *config, kvp_tier_redis_config *c,
                              kvp_error *err)
{
    kvp_status status = kvpi_struct_size_check(config->struct_size, sizeof *config, err);
    if (status != KVP_OK) {
        return status;
    }
    status = kvpi_struct_tail_check(config, config->struct_size, sizeof *config, err);
    if (status != KVP_OK) {
        return status;
    }
    kvp_tier_redis_config_init(c);
    memcpy(c, config, sizeof *c);
    if (c->url == NULL) {
        return kvpi_fail_null(err, "url");
    }
    return KVP_OK;
}

kvp_status kvp_tier_redis_create(const kvp_tier_redis_config *config, kvp_tier **out,
                                 kvp_error *err)
{
    if (config == NULL) {
        return kvpi_fail_null(err, "config");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_tier_redis_config c;
    kvp_status status = config_copy(config, &c, err);
    if (status != KVP_OK) {
        return status;
    }
    kvpi_redis_config sc = {
        .url = c.url, .name_space = c.name_space, .connect_timeout_ms = c.connect_timeout_ms,
        .command_timeout_ms = c.command_timeout_ms, .ttl_seconds = c.ttl_seconds,
        .queue_entries = c.queue_entries, .queue_bytes = c.queue_bytes,
        .write_batch = c.write_batch, .read_jobs = c.read_jobs,
        .write_linger_us = REDIS_WRITE_LINGER_US,
        .backoff_min_ms = c.backoff_min_ms, .backoff_max_ms = c.backoff_max_ms};
    redis_tier *r = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *r);
    if (r == NULL) {
        return kvpi_fail_alloc(err, "redis tier", sizeof *r);
    }
    kvpi_redis_error e;
    kvpi_redis_code code = kvpi_redis_create(&sc, &r->store, &e);
    if (code != KVPI_REDIS_OK) {
        kvpi_free(r);
        return fail_with(err, code, &e);
    }
    kvp_tier_vtable v;
    kvp_tier_vtable_init(&v);
    v.name = redis_name;
    v.contains = redis_contains;
    v.get = redis_get;
    v.put = redis_put;
    v.destroy = redis_destroy;
    status = kvp_tier_create(&v, r, out, err);
    if (status != KVP_OK) {
        redis_destroy(r);
    }
    return status;
}

/* The Redis tier behind `tier` (not NULL), or NULL with *err filled (INVALID_ARGUMENT). */
static redis_tier *redis_of(kvp_tier *tier, kvp_error *err)
{
    redis_tier *r = kvpi_tier_impl_of(tier, redis_name);
    if (r == NULL) {
        kvpi_fail_invalid(err, "tier", "not a Redis tier (kvp_tier_redis_create)");
    }
    return r;
}

kvp_status kvp_tier_redis_flush(kvp_tier *tier, unsigned timeout_ms, kvp_error *err)
{
    if (tier == NULL) {
        return kvpi_fail_null(err, "tier");
    }
    redis_tier *r = redis_of(tier, err);
    if (r == NULL) {
        return KVP_INVALID_ARGUMENT;
    }
    kvpi_redis_error e;
    kvpi_redis_code code = kvpi_redis_drain(r->store, timeout_ms, &e);
    return code == KVPI_REDIS_OK ? KVP_OK : fail_with(err, code, &e);
}

void kvp_tier_redis_stats_init(kvp_tier_redis_stats *stats)
{
    if (stats != NULL) {
        memset(stats, 0, sizeof *stats);
        stats->struct_size = sizeof *stats;
    }
}

kvp_status kvp_tier_redis_stats_get(kvp_tier *tier, kvp_tier_redis_stats *out, kvp_error *err)
{
    if (tier == NULL) {
        return kvpi_fail_null(err, "tier");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    redis_tier *r = redis_of(tier, err);
    if (r == NULL) {
        return KVP_INVALID_ARGUMENT;
    }
    kvpi_redis_stats s;
    kvpi_redis_stats_get(r->store, &s);
    kvp_tier_redis_stats snap;
    kvp_tier_redis_stats_init(&snap);
    snap.round_trips = s.round_trips;
    snap.lookups = s.lookups;
    snap.hits = s.hits;
    snap.misses = s.misses;
    snap.too_big = s.too_big;
    snap.bytes_read = s.bytes_read;
    snap.puts = s.puts;
    snap.writes = s.writes;
    snap.bytes_written = s.bytes_written;
    snap.queue_drops = s.queue_drops;
    snap.write_errors = s.write_errors;
    snap.read_drops = s.read_drops;
    snap.errors = s.errors;
    snap.timeouts = s.timeouts;
    snap.connects = s.connects;
    snap.reconnects = s.reconnects;
    snap.queued = s.queued;
    snap.queued_bytes = s.queued_bytes;
    return kvpi_struct_out(out, &snap, sizeof snap, sizeof snap, err);
}
