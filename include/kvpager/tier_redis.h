/*
 * kvpager/tier_redis.h: a kvp_tier over a Redis server (DESIGN.md, "The
 * Redis tier"): evicted blocks shared between processes and machines.
 *
 * The tier stores each block under "kvp:" [namespace ":"] and the 32 hex
 * digits of its chain key (no token content in a key name) as one Redis
 * string. contains (STRLEN) and get (GET) send one pipelined round trip per
 * batch from the tier's reader thread and complete the batch there; put
 * copies the blocks into a bounded queue and completes at once (a full
 * queue completes the block TIER_UNAVAILABLE: a dropped write, counted),
 * and the tier's writer thread writes the queue in pipelined batches. So a
 * put never waits on the network: the pool may call it under its lock.
 *
 * The tier does not look inside blocks: the pool's verification
 * (kvp_tier_block_verify: size, MAC, geometry, key, binding) rejects a value
 * of the wrong size, another deployment's, another key's or garbage.
 *
 * Failures: a batch the server cannot answer (down, refused, timed out,
 * AUTH refused, an error reply) completes with every block
 * TIER_UNAVAILABLE; a dead connection is reconnected by the next batch, no
 * sooner than the backoff allows. The server being down at create does not
 * fail the create.
 *
 * Threads: every call here is thread-safe unless its own line says
 * otherwise.
 */
#ifndef KVPAGER_TIER_REDIS_H
#define KVPAGER_TIER_REDIS_H

#include "kvpager/common.h"
#include "kvpager/status.h"
#include "kvpager/tier.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * A Redis tier's configuration. A growing struct (kvp_tier_redis_config_init);
 * zero means the default for every field but url.
 *   url:                redis://[user:password@]host[:port][/db] (port 6379,
 *                       db 0 when left out); user and password %XX-encoded;
 *                       a user means AUTH user password (ACL), a password
 *                       alone AUTH password. The tier keeps a parsed copy.
 *   name_space:         NULL or "": keys "kvp:<hex>"; else 1-64 of
 *                       [A-Za-z0-9_.-]: keys "kvp:<ns>:<hex>".
 *   connect_timeout_ms: 0: 1000.
 *   command_timeout_ms: 0: 1000; a socket silent this long fails the batch.
 *   ttl_seconds:        0: blocks never expire; else SET ... EX ttl.
 *   queue_entries:      0: 1024; most puts waiting for the writer.
 *   queue_bytes:        0: no bound; else most block bytes waiting.
 *   write_batch:        0: 64; most SETs per round trip of the writer.
 *   read_jobs:          0: 64; most contains/get batches waiting for the
 *                       reader (one more is refused TIER_UNAVAILABLE).
 *   backoff_min_ms:     wait after a failed connect before the next try
 *                       (0: retry at once), doubling up to backoff_max_ms
 *                       (0: 30000; >= backoff_min_ms).
 */
typedef struct kvp_tier_redis_config {
    size_t struct_size;
    const char *url;
    const char *name_space;
    unsigned connect_timeout_ms;
    unsigned command_timeout_ms;
    unsigned ttl_seconds;
    size_t queue_entries;
    size_t queue_bytes;
    size_t write_batch;
    size_t read_jobs;
    unsigned backoff_min_ms;
    unsigned backoff_max_ms;
    /* first release ends here */
} kvp_tier_redis_config;

/*
 * Zeroes *config (every default, no url), sets struct_size. NULL is ignored.
 * Threads: thread-safe (touches only *config).
 */
KVP_API void kvp_tier_redis_config_init(kvp_tier_redis_config *config);

/*
 * Creates a Redis tier (its name: "redis") and starts its reader and writer
 * threads; connects lazily (the first batch of each thread).
 * Errors, nothing allocated: NULL_ARGUMENT (config, out; "url");
 * INVALID_ARGUMENT ("struct_size"; "url" with `what` the bad part: "scheme",
 * "user", "password", "host", "port", "database" or "url"; never the
 * password's text; "name_space", "backoff_max_ms", ... for a bad field);
 * ALLOCATION_FAILED; THREAD_FAILED.
 * Threads: thread-safe.
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_redis_create(const kvp_tier_redis_config *config,
                                                       kvp_tier **out, kvp_error *err);

/*
 * Waits until every put queued so far is written or has failed, at most
 * timeout_ms. KVP_OK then; TIER_UNAVAILABLE ("drain") when the time ran
 * out; NULL_ARGUMENT (tier); INVALID_ARGUMENT ("tier": not a Redis tier).
 * Threads: thread-safe; never from a tier's done or with a pool's lock held.
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_redis_flush(kvp_tier *tier, unsigned timeout_ms,
                                                      kvp_error *err);

/*
 * A Redis tier's counters (kvp_tier_redis_stats_get). A growing struct.
 *   round_trips:   exchanges of lookups and writes (connect handshakes apart);
 *   lookups:       keys asked by contains and get; hits, misses of those;
 *   too_big:       get values longer than the caller's buffer (not copied);
 *   bytes_read:    block bytes get copied out;
 *   puts:          blocks accepted into the write queue;
 *   writes:        blocks the server acknowledged; bytes_written their bytes;
 *   queue_drops:   puts dropped because the queue was full;
 *   write_errors:  queued blocks whose write failed;
 *   read_drops:    contains/get batches refused because the reader was full;
 *   errors:        failed exchanges or connect attempts; timeouts of those;
 *   connects:      connections made (both threads); reconnects: of those,
 *                  the ones after that thread's connection died;
 *   queued, queued_bytes: puts waiting now and their bytes.
 */
typedef struct kvp_tier_redis_stats {
    size_t struct_size;
    uint64_t round_trips;
    uint64_t lookups;
    uint64_t hits;
    uint64_t misses;
    uint64_t too_big;
    uint64_t bytes_read;
    uint64_t puts;
    uint64_t writes;
    uint64_t bytes_written;
    uint64_t queue_drops;
    uint64_t write_errors;
    uint64_t read_drops;
    uint64_t errors;
    uint64_t timeouts;
    uint64_t connects;
    uint64_t reconnects;
    size_t queued;
    size_t queued_bytes;
    /* first release ends here */
} kvp_tier_redis_stats;

/*
 * Zeroes *stats, sets struct_size. NULL is ignored.
 * Threads: thread-safe (touches only *stats).
 */
KVP_API void kvp_tier_redis_stats_init(kvp_tier_redis_stats *stats);

/*
 * A consistent snapshot of a Redis tier's counters. Errors: NULL_ARGUMENT
 * (tier, out); INVALID_ARGUMENT ("tier": not a Redis tier; "struct_size").
 * Threads: thread-safe.
 */
KVP_API KVP_NODISCARD kvp_status kvp_tier_redis_stats_get(kvp_tier *tier,
                                                          kvp_tier_redis_stats *out,
                                                          kvp_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_TIER_REDIS_H */
