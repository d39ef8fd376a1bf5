/*
 * redis_conn.c: one connection of the Redis store, over hiredis's blocking
 * API: connect with a timeout, handshake (AUTH, SELECT) in one round trip,
 * SO_RCVTIMEO/SO_SNDTIMEO as the command timeout, pipelined exchanges (the
 * commands framed here and written with writev from the callers' arguments,
 * the replies parsed by hiredis), and reconnection with a doubling backoff.
 *
 * Invariants (redis_conn.h): `ctx` is NULL or handshaken with every reply
 * read; any failed exchange frees it (a late reply would otherwise answer
 * the next command); a connect attempt that fails pushes retry_at_ns
 * backoff_ms ahead and doubles backoff_ms up to the max; a success resets
 * it to the min. The password goes to the server in AUTH and nowhere else.
 * Callers: src/serve/redis_store.c only, one thread per connection, with
 * SIGPIPE blocked (writev(2) and hiredis's write(2), not send(MSG_NOSIGNAL)).
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>

#include <hiredis/hiredis.h>

#include "serve/redis_conn.h"

uint64_t kvpi_redis_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static struct timeval timeval_ms(unsigned ms) {
    struct timeval tv;
    tv.tv_sec = (time_t)(ms / 1000);
    tv.tv_usec = (suseconds_t)(ms % 1000) * 1000;
    return tv;
}

void kvpi_redis_conn_init(kvpi_redis_conn *conn, const kvpi_redis_url *url,
                          const kvpi_redis_config *config) {
    memset(conn, 0, sizeof *conn);
    conn->url = url;
    conn->connect_timeout_ms = config->connect_timeout_ms;
    conn->command_timeout_ms = config->command_timeout_ms;
    conn->backoff_min_ms = config->backoff_min_ms;
    conn->backoff_max_ms = config->backoff_max_ms;
    conn->backoff_ms = config->backoff_min_ms;
}

void kvpi_redis_conn_close(kvpi_redis_conn *conn) {
    if (conn->ctx != NULL) {
        redisFree(conn->ctx);
        conn->ctx = NULL;
        conn->was_live = true;
    }
}

void kvpi_redis_replies_free(void **replies, size_t count) {
    for (size_t i = 0; i < count; i++) {
        if (replies[i] != NULL) {
            freeReplyObject(replies[i]);
            replies[i] = NULL;
        }
    }
}

/* A failed connect attempt: no retry before the backoff, which doubles. */
static void attempt_failed(kvpi_redis_conn *conn) {
    conn->retry_at_ns = kvpi_redis_now_ns() + (uint64_t)conn->backoff_ms * 1000000u;
    unsigned next = conn->backoff_ms > conn->backoff_max_ms / 2 ? conn->backoff_max_ms
                                                                : conn->backoff_ms * 2;
    conn->backoff_ms = next > conn->backoff_min_ms ? next : conn->backoff_min_ms;
}

/*
 * The context's failure as a code and text; kills the connection. `saved`
 * is errno right after the failing call (a receive or send timeout reads
 * as EAGAIN on a blocking socket).
 */
static kvpi_redis_code context_failed(kvpi_redis_conn *conn, int saved, const char *what,
                                      kvpi_redis_events *ev, kvpi_redis_error *err) {
    redisContext *c = conn->ctx;
    const kvpi_redis_url *u = conn->url;
    kvpi_redis_code code;
    if (c->err == REDIS_ERR_IO && (saved == EAGAIN || saved == EWOULDBLOCK)) {
        code = KVPI_REDIS_TIMEOUT;
        ev->timeouts++;
        kvpi_redis_fail(err, code, what, "redis at %s:%u did not answer %s within %u ms", u->host,
                        u->port, what, conn->command_timeout_ms);
    } else {
        code = KVPI_REDIS_IO;
        kvpi_redis_fail(err, code, what, "redis at %s:%u: connection lost during %s: %s",
                        u->host, u->port, what, c->errstr[0] != '\0' ? c->errstr : "closed");
    }
    kvpi_redis_conn_close(conn);
    return code;
}

/*
 * Sending. hiredis's redisAppendCommandArgv copies each argument into a
 * formatted command and that into its output buffer: two copies of every
 * value (a 32 KiB tier block: most of the writer thread's CPU beside the
 * send itself). Instead the commands are framed here (RESP: *argc, then
 * $len CRLF arg CRLF per argument) and written with writev straight from
 * the callers' arguments: arguments of INLINE_MAX bytes or more are their
 * own iovec; the framing and the shorter arguments are copied into one
 * frame buffer. hiredis then only reads the replies (redisGetReply finds
 * its output buffer empty). A send that the socket's SO_SNDTIMEO cuts
 * short fails as a timeout, as hiredis's own write would.
 */
#define INLINE_MAX 256
#define FRAME_HEAD 24
#ifndef IOV_MAX
#define IOV_MAX 1024 /* Linux's UIO_MAXIOV; <limits.h> names it only for X/Open */
#endif /* "*N\r\n" or "$N\r\n": a 20-digit count at most, and CRLF */

typedef struct frame {
    char *buf, *at, *seg; /* the buffer; where the next byte goes; the open segment's start */
    struct iovec *iov;
    size_t iovs;
} frame;

static void frame_close(frame *f) {
    if (f->at > f->seg) {
        f->iov[f->iovs++] = (struct iovec){.iov_base = f->seg, .iov_len = (size_t)(f->at - f->seg)};
    }
    f->seg = f->at;
}

static void frame_arg(frame *f, const char *arg, size_t len) {
    f->at += snprintf(f->at, FRAME_HEAD, "$%zu\r\n", len);
    if (len < INLINE_MAX) {
        memcpy(f->at, arg, len);
        f->at += len;
    } else {
        frame_close(f);
        f->iov[f->iovs++] = (struct iovec){.iov_base = (void *)arg, .iov_len = len};
    }
    memcpy(f->at, "\r\n", 2);
    f->at += 2;
}

/* Writes every iovec, resuming after short writes; 0, or -1 with errno set. */
static int write_all(int fd, struct iovec *iov, size_t n) {
    size_t i = 0;
    while (i < n) {
        int chunk = n - i > IOV_MAX ? IOV_MAX : (int)(n - i);
        ssize_t w = writev(fd, iov + i, chunk);
        if (w < 0 && errno == EINTR) {
            continue;
        }
        if (w <= 0) {
            if (w == 0) {
                errno = EPIPE;
            }
            return -1;
        }
        for (size_t left = (size_t)w; left > 0;) {
            size_t take = left < iov[i].iov_len ? left : iov[i].iov_len;
            iov[i].iov_base = (char *)iov[i].iov_base + take;
            iov[i].iov_len -= take;
            left -= take;
            i += iov[i].iov_len == 0;
        }
    }
    return 0;
}

/* Frames and writes the commands (the comment above); the failure kills the connection. */
static kvpi_redis_code send_commands(kvpi_redis_conn *conn, size_t count, const int *argc,
                                     const char *const *const *argv,
                                     const size_t *const *argvlen, const char *what,
                                     kvpi_redis_events *ev, kvpi_redis_error *err) {
    size_t bytes = 0, iovs = 1;
    for (size_t i = 0; i < count; i++) {
        bytes += FRAME_HEAD;
        for (int j = 0; j < argc[i]; j++) {
            bytes += FRAME_HEAD + 2 + (argvlen[i][j] < INLINE_MAX ? argvlen[i][j] : 0);
            iovs += argvlen[i][j] < INLINE_MAX ? 0 : 2;
        }
    }
    frame f = {.buf = malloc(bytes), .iov = malloc(iovs * sizeof *f.iov)};
    if (f.buf == NULL || f.iov == NULL) {
        free(f.buf);
        free(f.iov);
        kvpi_redis_conn_close(conn);
        ev->errors++;
        kvpi_redis_fail(err, KVPI_REDIS_NO_MEMORY, what,
                        "out of memory framing %s for the redis pipeline", what);
        return KVPI_REDIS_NO_MEMORY;
    }
    f.at = f.seg = f.buf;
    for (size_t i = 0; i < count; i++) {
        f.at += snprintf(f.at, FRAME_HEAD, "*%d\r\n", argc[i]);
        for (int j = 0; j < argc[i]; j++) {
            frame_arg(&f, argv[i][j], argvlen[i][j]);
        }
    }
    frame_close(&f);
    redisContext *c = conn->ctx;
    errno = 0;
    int failed = write_all(c->fd, f.iov, f.iovs);
    int saved = errno;
    free(f.buf);
    free(f.iov);
    if (!failed) {
        return KVPI_REDIS_OK;
    }
    ev->errors++;
    c->err = REDIS_ERR_IO; /* as hiredis records a failed write, for context_failed */
    if (strerror_r(saved, c->errstr, sizeof c->errstr) != 0) {
        snprintf(c->errstr, sizeof c->errstr, "error %d", saved);
    }
    return context_failed(conn, saved, what, ev, err);
}

/* Sends the commands and reads every reply, or fails and kills the connection. */
static kvpi_redis_code round_trip(kvpi_redis_conn *conn, size_t count, const int *argc,
                                  const char *const *const *argv, const size_t *const *argvlen,
                                  void **replies, const char *what, kvpi_redis_events *ev,
                                  kvpi_redis_error *err) {
    redisContext *c = conn->ctx;
    kvpi_redis_code sent = send_commands(conn, count, argc, argv, argvlen, what, ev, err);
    if (sent != KVPI_REDIS_OK) {
        return sent;
    }
    for (size_t i = 0; i < count; i++) {
        errno = 0;
        if (redisGetReply(c, &replies[i]) != REDIS_OK || replies[i] == NULL) {
            int saved = errno;
            kvpi_redis_replies_free(replies, i + 1);
            ev->errors++;
            return context_failed(conn, saved, what, ev, err);
        }
    }
    return KVPI_REDIS_OK;
}

/* AUTH (when the URL has a password) and SELECT db, in one round trip. */
static kvpi_redis_code handshake(kvpi_redis_conn *conn, kvpi_redis_events *ev,
                                 kvpi_redis_error *err) {
    const kvpi_redis_url *u = conn->url;
    char db[16];
    snprintf(db, sizeof db, "%u", u->db);
    const char *auth[3] = {"AUTH", u->user, u->password};
    size_t auth_len[3] = {4, strlen(u->user), strlen(u->password)};
    if (u->user[0] == '\0') {
        auth[1] = u->password;
        auth_len[1] = auth_len[2];
    }
    const char *select[2] = {"SELECT", db};
    const size_t select_len[2] = {6, strlen(db)};
    const bool has_auth = u->password[0] != '\0';
    const int argc[2] = {u->user[0] != '\0' ? 3 : 2, 2};
    const char *const *argv[2] = {auth, select};
    const size_t *const lens[2] = {auth_len, select_len};
    void *replies[2] = {NULL, NULL};
    size_t first = has_auth ? 0 : 1;
    kvpi_redis_code code = round_trip(conn, 2 - first, argc + first, argv + first, lens + first,
                                      replies, has_auth ? "AUTH" : "SELECT", ev, err);
    if (code != KVPI_REDIS_OK) {
        return code;
    }
    for (size_t i = 0; i < 2 - first && code == KVPI_REDIS_OK; i++) {
        const redisReply *r = replies[i];
        if (r->type != REDIS_REPLY_ERROR) {
            continue;
        }
        bool is_auth = i + first == 0 || strncmp(r->str, "NOAUTH", 6) == 0;
        code = is_auth ? KVPI_REDIS_AUTH : KVPI_REDIS_SELECT;
        if (is_auth && u->user[0] != '\0') {
            kvpi_redis_fail(err, code, "AUTH", "redis at %s:%u refused AUTH as user \"%s\": %.80s",
                            u->host, u->port, u->user, r->str);
        } else if (is_auth) {
            kvpi_redis_fail(err, code, "AUTH", "redis at %s:%u refused AUTH: %.80s", u->host,
                            u->port, r->str);
        } else {
            kvpi_redis_fail(err, code, "SELECT", "redis at %s:%u refused SELECT %u: %.80s",
                            u->host, u->port, u->db, r->str);
        }
    }
    kvpi_redis_replies_free(replies, 2);
    if (code != KVPI_REDIS_OK) {
        kvpi_redis_conn_close(conn);
    }
    return code;
}

static kvpi_redis_code connect_now(kvpi_redis_conn *conn, kvpi_redis_events *ev,
                                   kvpi_redis_error *err) {
    const kvpi_redis_url *u = conn->url;
    redisContext *c = redisConnectWithTimeout(u->host, (int)u->port,
                                              timeval_ms(conn->connect_timeout_ms));
    if (c == NULL) {
        kvpi_redis_fail(err, KVPI_REDIS_NO_MEMORY, "connect",
                        "out of memory connecting to redis at %s:%u", u->host, u->port);
        return KVPI_REDIS_NO_MEMORY;
    }
    if (c->err != 0) {
        kvpi_redis_fail(err, KVPI_REDIS_CONNECT, "connect", "cannot connect to redis at %s:%u: %s",
                        u->host, u->port, c->errstr);
        redisFree(c);
        return KVPI_REDIS_CONNECT;
    }
    if (redisSetTimeout(c, timeval_ms(conn->command_timeout_ms)) != REDIS_OK) {
        kvpi_redis_fail(err, KVPI_REDIS_CONNECT, "connect",
                        "cannot set the command timeout on redis at %s:%u: %s", u->host, u->port,
                        c->errstr);
        redisFree(c);
        return KVPI_REDIS_CONNECT;
    }
    bool was_live = conn->was_live;
    conn->ctx = c;
    kvpi_redis_code code = handshake(conn, ev, err);
    if (code != KVPI_REDIS_OK) {
        conn->was_live = was_live; /* the handshake's connection never counted as live */
        return code;
    }
    ev->connects++;
    if (was_live) {
        ev->reconnects++;
    }
    return KVPI_REDIS_OK;
}

kvpi_redis_code kvpi_redis_conn_ready(kvpi_redis_conn *conn, kvpi_redis_events *ev,
                                      kvpi_redis_error *err) {
    if (conn->ctx != NULL) {
        return KVPI_REDIS_OK;
    }
    uint64_t now = kvpi_redis_now_ns();
    if (now < conn->retry_at_ns) {
        const kvpi_redis_url *u = conn->url;
        kvpi_redis_fail(err, KVPI_REDIS_DOWN, "connect",
                        "redis at %s:%u is down; next attempt in %llu ms", u->host, u->port,
                        (unsigned long long)((conn->retry_at_ns - now + 999999u) / 1000000u));
        return KVPI_REDIS_DOWN;
    }
    kvpi_redis_code code = connect_now(conn, ev, err);
    if (code != KVPI_REDIS_OK) {
        if (code != KVPI_REDIS_TIMEOUT && code != KVPI_REDIS_IO) {
            ev->errors++; /* a failed round trip counted itself */
        }
        attempt_failed(conn);
        return code;
    }
    conn->backoff_ms = conn->backoff_min_ms;
    conn->retry_at_ns = 0;
    return KVPI_REDIS_OK;
}

kvpi_redis_code kvpi_redis_conn_exchange(kvpi_redis_conn *conn, size_t count, const int *argc,
                                         const char *const *const *argv,
                                         const size_t *const *argvlen, void **replies,
                                         const char *what, kvpi_redis_events *ev,
                                         kvpi_redis_error *err) {
    /* A connection from an earlier call may have died unseen (the server
     * restarted): when it breaks (IO, not a timeout), one retry on a fresh
     * connection, so the first batch after a restart is not lost. The
     * commands (EXISTS, GET, SET, PING) may run twice. */
    bool reused = conn->ctx != NULL;
    kvpi_redis_code code = kvpi_redis_conn_ready(conn, ev, err);
    if (code == KVPI_REDIS_OK) {
        code = round_trip(conn, count, argc, argv, argvlen, replies, what, ev, err);
    }
    if (code == KVPI_REDIS_IO && reused) {
        code = kvpi_redis_conn_ready(conn, ev, err);
        if (code == KVPI_REDIS_OK) {
            code = round_trip(conn, count, argc, argv, argvlen, replies, what, ev, err);
        }
    }
    if (code == KVPI_REDIS_OK) {
        ev->round_trips++;
    }
    return code;
}
