/*
 * redis_conn.h: one connection of the Redis store (src/serve/redis_conn.c):
 * connect with a timeout, the handshake (AUTH, SELECT) in one round trip,
 * the command timeout, pipelined exchanges, death on any failure and
 * reconnection with a doubling backoff.
 *
 * Invariants: `ctx` is NULL (dead) or a connection whose handshake
 * succeeded and whose replies are all read (no exchange is left half done:
 * a failed exchange frees the context). A retry after a failed connect
 * attempt waits backoff_ms (doubling from min to max, reset on success);
 * the first attempt after a live connection died is immediate.
 * Callers: src/serve/redis_store.c only, each connection from one thread
 * (its owner's), with SIGPIPE blocked in that thread.
 */
#ifndef KVPAGER_SERVE_REDIS_CONN_H
#define KVPAGER_SERVE_REDIS_CONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "serve/redis_store.h"

/* What one call did, for the store's counters. */
typedef struct kvpi_redis_events {
    unsigned connects;   /* handshakes done */
    unsigned reconnects; /* of those, after this connection had been live */
    unsigned errors;     /* failed attempts or exchanges */
    unsigned timeouts;   /* of those, timeouts */
    unsigned round_trips;
} kvpi_redis_events;

typedef struct kvpi_redis_conn {
    const kvpi_redis_url *url;
    unsigned connect_timeout_ms;
    unsigned command_timeout_ms;
    unsigned backoff_min_ms;
    unsigned backoff_max_ms;
    void *ctx;               /* redisContext *, NULL when dead */
    bool was_live;           /* a connection existed before this one died */
    unsigned backoff_ms;     /* the wait after the next failed attempt */
    uint64_t retry_at_ns;    /* monotonic; no attempt before this */
} kvpi_redis_conn;

/* A dead connection with these settings (no I/O). */
void kvpi_redis_conn_init(kvpi_redis_conn *conn, const kvpi_redis_url *url,
                          const kvpi_redis_config *config);

/* Closes the connection if live. */
void kvpi_redis_conn_close(kvpi_redis_conn *conn);

/* A live connection: connects (and runs the handshake) when dead, unless the
 * backoff forbids it yet (DOWN). */
kvpi_redis_code kvpi_redis_conn_ready(kvpi_redis_conn *conn, kvpi_redis_events *ev,
                                      kvpi_redis_error *err);

/*
 * One pipelined round trip on a ready connection: appends the `count`
 * commands (argv[i] with argc[i] arguments and lengths argvlen[i]), then
 * reads `count` replies into replies[] (redisReply *; the caller frees them
 * with kvpi_redis_replies_free). On TIMEOUT or IO the connection dies and
 * no reply is returned. Error replies are returned as replies, not as
 * failures. `what` names the command for error texts.
 */
kvpi_redis_code kvpi_redis_conn_exchange(kvpi_redis_conn *conn, size_t count, const int *argc,
                                         const char *const *const *argv,
                                         const size_t *const *argvlen, void **replies,
                                         const char *what, kvpi_redis_events *ev,
                                         kvpi_redis_error *err);

/* Frees replies[0..count) (NULL entries allowed) and sets them to NULL. */
void kvpi_redis_replies_free(void **replies, size_t count);

/* Fills err: code, part and a printf-style text. */
void kvpi_redis_fail(kvpi_redis_error *err, kvpi_redis_code code, const char *part,
                     const char *format, ...) __attribute__((format(printf, 4, 5)));

/* The monotonic clock in nanoseconds. */
uint64_t kvpi_redis_now_ns(void);

#endif /* KVPAGER_SERVE_REDIS_CONN_H */
