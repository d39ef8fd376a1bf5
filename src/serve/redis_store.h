/*
 * redis_store.h: a Redis store of opaque blocks by 128-bit chain key, the
 * second tier's remote backend (issue 20; docs/DESIGN.md, "The Redis store").
 *
 * Owns the API of src/serve/redis_store.c (the store: its threads, queues and
 * statistics), src/serve/redis_conn.c (one connection: connect, AUTH, SELECT,
 * timeouts, reconnect with backoff, pipelined exchanges) and
 * src/serve/redis_url.c (URL parsing, key names, error texts).
 *
 * The store speaks to Redis only from its two background threads, each with
 * its own connection: the reader runs batch lookups (contains, get), each ONE
 * pipelined round trip, and calls their completion; the writer takes puts
 * from a bounded queue and writes them in pipelined batches. A put never
 * waits on the network: when the queue is full it drops the block (counted)
 * and returns. A failed exchange marks that thread's connection dead; the
 * next batch reconnects, no sooner than the backoff allows.
 *
 * Key names carry no token content: "kvp:" [namespace ":"] and the 32
 * lowercase hex digits of the chain key (hi word first).
 *
 * Errors are typed (kvpi_redis_code) with one line of text that names the
 * bad part and never holds a password. A wrapper that makes the store a
 * kvp_tier maps the codes onto its statuses.
 * Callers: src/serve (the tier wrapper), tests/test_redis_store.c.
 */
#ifndef KVPAGER_SERVE_REDIS_STORE_H
#define KVPAGER_SERVE_REDIS_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvpager/pool.h"

typedef enum kvpi_redis_code {
    KVPI_REDIS_OK = 0,
    KVPI_REDIS_BAD_URL,      /* the URL does not parse; `part` names the bad part */
    KVPI_REDIS_BAD_ARGUMENT, /* a NULL or out-of-range argument; `part` names it */
    KVPI_REDIS_NO_MEMORY,    /* an allocation failed */
    KVPI_REDIS_THREAD,       /* a background thread could not be started */
    KVPI_REDIS_CONNECT,      /* the TCP connection failed (refused, timed out, unresolved) */
    KVPI_REDIS_AUTH,         /* AUTH refused, or the server wants AUTH (NOAUTH) */
    KVPI_REDIS_SELECT,       /* SELECT db refused */
    KVPI_REDIS_TIMEOUT,      /* the server did not answer within the command timeout */
    KVPI_REDIS_IO,           /* the connection broke (closed, reset, protocol error) */
    KVPI_REDIS_REPLY,        /* the server answered a command with an error (OOM, ...) */
    KVPI_REDIS_DOWN,         /* the connection is dead and the backoff forbids a retry yet */
    KVPI_REDIS_QUEUE_FULL,   /* a bounded queue is full: the work was dropped (counted) */
    KVPI_REDIS_CLOSED        /* the store is shutting down: the work was not done */
} kvpi_redis_code;

/* Bytes of kvpi_redis_error.text, terminating NUL included. */
#define KVPI_REDIS_ERROR_TEXT 224

typedef struct kvpi_redis_error {
    kvpi_redis_code code;
    /* Static text naming what failed: for BAD_URL the URL part ("scheme",
     * "user", "password", "host", "port", "database", "url"); for
     * BAD_ARGUMENT the argument; otherwise the step or command ("connect",
     * "AUTH", "SELECT", "EXISTS", "STRLEN", "GET", "SET", "queue", "drain"). */
    const char *part;
    char text[KVPI_REDIS_ERROR_TEXT]; /* one line; never a password */
} kvpi_redis_error;

/* "BadUrl" for KVPI_REDIS_BAD_URL, ...; "Unknown" for other values. */
const char *kvpi_redis_code_name(kvpi_redis_code code);

/* ---- URLs and key names (redis_url.c) --------------------------------------- */

#define KVPI_REDIS_HOST_MAX 255
#define KVPI_REDIS_USER_MAX 128
#define KVPI_REDIS_PASSWORD_MAX 256
#define KVPI_REDIS_NAMESPACE_MAX 64

/* A parsed redis://[user:password@]host[:port][/db] URL (port 6379 and db 0
 * when left out). User and password are percent-decoded. */
typedef struct kvpi_redis_url {
    char host[KVPI_REDIS_HOST_MAX + 1]; /* brackets of an IPv6 literal removed */
    char user[KVPI_REDIS_USER_MAX + 1];         /* "" when none: AUTH password alone */
    char password[KVPI_REDIS_PASSWORD_MAX + 1]; /* "" when none: no AUTH */
    unsigned port;                              /* 1..65535 */
    unsigned db;                                /* 0..2147483647 */
} kvpi_redis_url;

/*
 * Parses `text` strictly: scheme "redis" (lowercase), optional userinfo
 * "user:password" or ":password" (no user without a password; '@', ':' and
 * other reserved bytes in them written %XX), host (letters, digits, '-',
 * '.', or a bracketed IPv6 literal), optional ":port" (1-65535), optional
 * "/db" (decimal, 0-2147483647), nothing after. On failure returns
 * KVPI_REDIS_BAD_URL with `part` and a text naming the part (the password
 * is never echoed), and leaves *out unchanged.
 * Threads: thread-safe.
 */
kvpi_redis_code kvpi_redis_url_parse(const char *text, kvpi_redis_url *out, kvpi_redis_error *err);

/* Renders `url` with the password as "***", like snprintf. Threads: thread-safe. */
size_t kvpi_redis_url_format(const kvpi_redis_url *url, char *buf, size_t size);

/* A namespace is 1..KVPI_REDIS_NAMESPACE_MAX of [A-Za-z0-9_.-]. */
bool kvpi_redis_namespace_valid(const char *ns);

/* Bytes of the longest key name, terminating NUL included. */
#define KVPI_REDIS_KEY_MAX (4 + KVPI_REDIS_NAMESPACE_MAX + 1 + 32 + 1)

/* Writes the key name of `key` under `ns` (NULL or "": none) into
 * buf[KVPI_REDIS_KEY_MAX] and returns its length. Threads: thread-safe. */
size_t kvpi_redis_key_name(const char *ns, const kvp_block_key *key, char *buf);

/* ---- the store (redis_store.c) ------------------------------------------- */

typedef struct kvpi_redis_config {
    const char *url;       /* required; parsed by kvpi_redis_url_parse */
    const char *name_space; /* NULL or "": keys "kvp:<hex>"; else "kvp:<ns>:<hex>" */
    unsigned connect_timeout_ms; /* 0: 1000 */
    unsigned command_timeout_ms; /* 0: 1000; a socket silent this long fails (TIMEOUT) */
    unsigned ttl_seconds;        /* 0: blocks never expire; else SET ... EX ttl */
    size_t queue_entries;        /* 0: 1024; most puts waiting for the writer */
    size_t queue_bytes;          /* 0: no byte bound; else most value bytes waiting */
    size_t write_batch;          /* 0: 64; most SETs the writer pipelines per round trip */
    unsigned write_linger_us;    /* 0: none; else, finding fewer than write_batch puts queued,
                                    the writer waits up to this long for more before writing
                                    (fewer round trips and wake-ups); a full batch, drain,
                                    hold and destroy cut the wait short */
    size_t read_jobs;            /* 0: 64; most lookups waiting for the reader */
    unsigned backoff_min_ms;     /* after a failed connect attempt; 0 allowed (retry at once) */
    unsigned backoff_max_ms;     /* doubling up to this; 0: 30000. >= backoff_min_ms */
} kvpi_redis_config;

typedef struct kvpi_redis_stats {
    uint64_t round_trips;   /* completed exchanges of lookups and writes (handshakes apart) */
    uint64_t lookups;       /* keys looked up (contains and get) */
    uint64_t hits;          /* keys found */
    uint64_t misses;        /* keys not found */
    uint64_t too_big;       /* get: values longer than the caller's buffer (not copied) */
    uint64_t bytes_read;    /* value bytes copied out by get */
    uint64_t puts;          /* blocks accepted into the write queue */
    uint64_t writes;        /* blocks the server acknowledged */
    uint64_t bytes_written; /* value bytes of those */
    uint64_t queue_drops;   /* puts dropped because the write queue was full */
    uint64_t write_errors;  /* queued blocks whose write failed (down, timeout, error reply) */
    uint64_t read_drops;    /* lookups refused because the reader's queue was full */
    uint64_t errors;        /* failed exchanges or connect attempts, every kind */
    uint64_t timeouts;      /* of those, timeouts */
    uint64_t read_ns;       /* time in lookups' exchanges (bytes_read / read_ns: the
                             * observed load bandwidth a cost model weighs) */
    uint64_t write_ns;      /* time in the writer's exchanges */
    uint64_t connects;      /* successful connections (handshake done), both threads */
    uint64_t reconnects;    /* of those, the ones after a connection of that thread died */
    size_t queued;          /* puts waiting now */
    size_t queued_bytes;    /* their value bytes */
} kvpi_redis_stats;

typedef struct kvpi_redis_store kvpi_redis_store;

/*
 * Checks the config, parses the URL and starts the two threads; connects
 * lazily (the first batch of each thread), so a server that is down at start
 * does not fail the create: kvpi_redis_ping tells. On failure nothing is
 * allocated and *out is unchanged.
 * Threads: thread-safe.
 */
kvpi_redis_code kvpi_redis_create(const kvpi_redis_config *config, kvpi_redis_store **out,
                                  kvpi_redis_error *err);

/*
 * Stops accepting work, lets the writer write what is queued (once a batch
 * fails, the rest fail at once, so a dead or silent server costs at most
 * one connect and command timeout or two),
 * completes queued lookups with KVPI_REDIS_CLOSED, joins both threads and
 * frees everything. NULL is a no-op.
 * Threads: not while another call on the store runs.
 */
void kvpi_redis_destroy(kvpi_redis_store *store);

/* A lookup value: the caller's buffer, filled by a get. */
typedef enum kvpi_redis_found {
    KVPI_REDIS_MISS = 0, /* no such key (or expired) */
    KVPI_REDIS_HIT = 1,  /* data[0..length) holds the value */
    KVPI_REDIS_TOO_BIG = 2 /* the value is longer than capacity: length says how long */
} kvpi_redis_found;

typedef struct kvpi_redis_value {
    void *data;
    size_t capacity;
    size_t length;          /* out */
    kvpi_redis_found found; /* out */
} kvpi_redis_value;

typedef struct kvpi_redis_lookup kvpi_redis_lookup;
/* Called once per submitted lookup, on the reader thread, after the results
 * are in place (on success) or untouched (on failure). */
typedef void (*kvpi_redis_done)(kvpi_redis_lookup *lookup, void *context);

/*
 * One batch lookup. The caller fills the first block and keeps the struct,
 * keys and outputs alive until `done` runs; the store owns the rest.
 * `values` NULL: EXISTS per key into found[count], or, when `lengths` is not
 * NULL, STRLEN per key into lengths[count] (0: no such key; `found` may then
 * be NULL). `values` non-NULL: GET per key into values[count] (`found` may
 * then be NULL or receives HIT as true; `lengths` is ignored).
 * Outputs change only when the whole batch succeeds.
 */
struct kvpi_redis_lookup {
    const kvp_block_key *keys;
    size_t count;
    bool *found;
    size_t *lengths; /* contains with sizes: STRLEN (see above) */
    kvpi_redis_value *values;
    kvpi_redis_done done;
    void *context;
    /* out, set before `done` runs */
    kvpi_redis_error error; /* code KVPI_REDIS_OK on success */
    /* the store's */
    kvpi_redis_lookup *next_;
    bool ping_;
};

/*
 * Queues `lookup` for the reader (count 0 allowed: completes OK without a
 * round trip). On success `done` will run exactly once, on the reader
 * thread. Fails with QUEUE_FULL (counted in read_drops) when config.read_jobs
 * lookups wait, CLOSED during destroy, BAD_ARGUMENT for NULLs; then `done`
 * never runs.
 * Threads: thread-safe.
 */
kvpi_redis_code kvpi_redis_submit(kvpi_redis_store *store, kvpi_redis_lookup *lookup,
                                  kvpi_redis_error *err);

/*
 * kvpi_redis_submit, then waits for the completion: which keys exist (one
 * EXISTS per key, one round trip).
 * Threads: thread-safe; never from a `done` callback.
 */
kvpi_redis_code kvpi_redis_contains(kvpi_redis_store *store, const kvp_block_key *keys,
                                    size_t count, bool *found, kvpi_redis_error *err);

/* The same with GET into values[count]. Threads: as kvpi_redis_contains. */
kvpi_redis_code kvpi_redis_get(kvpi_redis_store *store, const kvp_block_key *keys, size_t count,
                               kvpi_redis_value *values, kvpi_redis_error *err);

/*
 * Copies `count` blocks (data[i], lengths[i] bytes) into the write queue and
 * returns without waiting on the network. Each block that does not fit
 * (config.queue_entries or queue_bytes reached) is dropped and counted in
 * queue_drops; *accepted (may be NULL) gets how many were queued. Returns OK
 * when all were queued, QUEUE_FULL when any was dropped, NO_MEMORY when a
 * copy could not be allocated (that block and the rest are dropped and
 * counted), CLOSED during destroy.
 * Threads: thread-safe.
 */
kvpi_redis_code kvpi_redis_put(kvpi_redis_store *store, const kvp_block_key *keys,
                               const void *const *data, const size_t *lengths, size_t count,
                               size_t *accepted, kvpi_redis_error *err);

/*
 * Waits until the write queue is empty and the writer idle (every queued put
 * written or failed), at most timeout_ms; TIMEOUT when it was not. Does not
 * wait through kvpi_redis_hold_writes: a held queue times out.
 * Threads: thread-safe.
 */
kvpi_redis_code kvpi_redis_drain(kvpi_redis_store *store, unsigned timeout_ms,
                                 kvpi_redis_error *err);

/*
 * hold true: the writer takes nothing more from the queue (puts still queue,
 * and drop when it is full) until hold false. For a caller that wants no
 * write traffic for a while, and for tests that fill the queue exactly.
 * Threads: thread-safe.
 */
void kvpi_redis_hold_writes(kvpi_redis_store *store, bool hold);

/*
 * One round trip on the reader's connection (connecting first if needed):
 * OK when the server answers. For a caller that warns once at start when
 * the server is down.
 * Threads: as kvpi_redis_contains.
 */
kvpi_redis_code kvpi_redis_ping(kvpi_redis_store *store, kvpi_redis_error *err);

/*
 * The last failed write's error (the writer has no caller to return it to):
 * false when no write failed yet, else true with *out filled.
 * Threads: thread-safe.
 */
bool kvpi_redis_last_write_error(kvpi_redis_store *store, kvpi_redis_error *out);

/* A consistent copy of the counters. Threads: thread-safe. */
void kvpi_redis_stats_get(kvpi_redis_store *store, kvpi_redis_stats *out);

#endif /* KVPAGER_SERVE_REDIS_STORE_H */
