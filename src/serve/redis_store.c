/*
 * redis_store.c: the Redis store of blocks (redis_store.h): config, the
 * reader thread (batch lookups, one pipelined round trip each, completion
 * on that thread), the writer thread (the bounded put queue, written in
 * pipelined batches of SET [EX ttl]), drain, hold and the counters.
 *
 * Invariants, all under `mu`: queued/queued_bytes are the entries and value
 * bytes on the put list, never above config.queue_entries/queue_bytes;
 * read_queued counts the lookup list, never above config.read_jobs;
 * writer_busy while the writer holds entries it took off the list; no
 * network I/O and no callback run with `mu` held; once `closing`, nothing
 * is accepted, the writer empties the list (hold ignored) and the reader
 * completes what waits with CLOSED. Each connection is touched only by its
 * thread; both threads run with every signal blocked (SIGPIPE from a
 * closed socket stays pending on them, harmlessly).
 * Callers: see redis_store.h.
 */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <hiredis/hiredis.h>

#include "serve/redis_conn.h"
#include "serve/redis_store.h"

typedef struct put_entry {
    struct put_entry *next;
    kvp_block_key key;
    size_t length;
    unsigned char data[];
} put_entry;

struct kvpi_redis_store {
    kvpi_redis_config config; /* defaults filled; url and name_space not kept */
    kvpi_redis_url url;
    char name_space[KVPI_REDIS_NAMESPACE_MAX + 1];
    char ttl[16];

    pthread_mutex_t mu;
    pthread_cond_t writer_wake, reader_wake, idle, sync_done;
    bool closing, hold, writer_busy;
    bool writer_idle; /* the writer waits for a first put (a put must wake it) */
    size_t draining;  /* drains waiting: the writer does not linger */
    put_entry *put_head, *put_tail;
    kvpi_redis_lookup *read_head, *read_tail;
    size_t read_queued;
    kvpi_redis_stats stats;
    kvpi_redis_error write_error; /* the last failed write's; code OK when none */

    pthread_t writer, reader;
    kvpi_redis_conn writer_conn, reader_conn;
    /* the writer's pipeline, for config.write_batch SETs */
    char *w_names;
    const char **w_argv;
    size_t *w_lens;
    int *w_argc;
    const char *const **w_argvp;
    const size_t **w_lensp;
    void **w_replies;
};

static void add_events(kvpi_redis_stats *s, const kvpi_redis_events *ev) {
    s->round_trips += ev->round_trips;
    s->errors += ev->errors;
    s->timeouts += ev->timeouts;
    s->connects += ev->connects;
    s->reconnects += ev->reconnects;
}

/* ---- the writer ------------------------------------------------------------- */

/*
 * SET per entry in one round trip; frees the entries. `give_up`: count them
 * failed without I/O (closing after a failed batch). Returns whether the
 * exchange itself failed.
 */
static bool write_entries(kvpi_redis_store *st, put_entry *list, size_t count, bool give_up) {
    size_t args = st->config.ttl_seconds != 0 ? 5 : 3;
    size_t i = 0;
    for (put_entry *e = list; e != NULL; e = e->next, i++) {
        char *name = st->w_names + i * KVPI_REDIS_KEY_MAX;
        const char **argv = st->w_argv + i * 5;
        size_t *lens = st->w_lens + i * 5;
        argv[0] = "SET";
        lens[0] = 3;
        argv[1] = name;
        lens[1] = kvpi_redis_key_name(st->name_space, &e->key, name);
        argv[2] = (const char *)e->data;
        lens[2] = e->length;
        argv[3] = "EX";
        lens[3] = 2;
        argv[4] = st->ttl;
        lens[4] = strlen(st->ttl);
        st->w_argc[i] = (int)args;
        st->w_argvp[i] = argv;
        st->w_lensp[i] = lens;
    }
    kvpi_redis_events ev = {0};
    kvpi_redis_error err = {.code = KVPI_REDIS_OK};
    kvpi_redis_code code = KVPI_REDIS_CLOSED;
    uint64_t t0 = kvpi_redis_now_ns();
    if (give_up) {
        kvpi_redis_fail(&err, code, "SET", "the redis store closed after a failed write");
    } else {
        code = kvpi_redis_conn_exchange(&st->writer_conn, count, st->w_argc, st->w_argvp,
                                        st->w_lensp, st->w_replies, "SET", &ev, &err);
    }
    uint64_t took = kvpi_redis_now_ns() - t0;
    uint64_t written = 0, bytes = 0;
    i = 0;
    for (put_entry *e = list; code == KVPI_REDIS_OK && e != NULL; e = e->next, i++) {
        const redisReply *r = st->w_replies[i];
        if (r->type == REDIS_REPLY_STATUS) {
            written++;
            bytes += e->length;
        } else if (err.code == KVPI_REDIS_OK) { /* the first bad reply names the failure */
            bool error = r->type == REDIS_REPLY_ERROR;
            kvpi_redis_fail(&err, KVPI_REDIS_REPLY, "SET", "redis at %s:%u answered SET with %s%.80s",
                            st->url.host, st->url.port,
                            error ? "an error: " : "an unexpected reply", error ? r->str : "");
        }
    }
    if (code == KVPI_REDIS_OK && written < count) {
        ev.errors++; /* error replies (OOM under maxmemory, ...) */
    }
    kvpi_redis_replies_free(st->w_replies, code == KVPI_REDIS_OK ? count : 0);
    while (list != NULL) {
        put_entry *next = list->next;
        free(list);
        list = next;
    }
    pthread_mutex_lock(&st->mu);
    add_events(&st->stats, &ev);
    st->stats.write_ns += took;
    st->stats.writes += written;
    st->stats.bytes_written += bytes;
    st->stats.write_errors += count - written;
    if (err.code != KVPI_REDIS_OK) {
        st->write_error = err;
    }
    pthread_mutex_unlock(&st->mu);
    return code != KVPI_REDIS_OK;
}

/* Whether the writer may keep waiting for puts rather than write or sleep (under mu). */
static bool may_linger(const kvpi_redis_store *st, bool empty_only) {
    if (st->closing || st->hold || st->draining > 0) {
        return false;
    }
    return empty_only ? st->put_head == NULL : st->stats.queued < st->config.write_batch;
}

/* The longest sleep of a lingering writer between two looks at the queue. */
#define LINGER_SLICE_NS 200000L
/* How long a writer that emptied the queue keeps looking for puts before it
 * goes idle, and its sleep between two looks meanwhile. */
#define AWAIT_PUTS_NS 50000000L
#define AWAIT_SLICE_NS 1000000L

static long elapsed_ns(const struct timespec *from, const struct timespec *to) {
    return (long)(to->tv_sec - from->tv_sec) * 1000000000L + (to->tv_nsec - from->tv_nsec);
}

/*
 * Under mu: waits while may_linger(empty_only) holds, at most write_linger_us
 * (puts queued) or AWAIT_PUTS_NS (none). Two uses. With puts queued
 * (empty_only false): for the batch to fill; fewer, fuller batches are fewer
 * round trips, syscalls and wake-ups for this thread, the putting threads and
 * the server. With the queue just emptied by a batch (empty_only true): for
 * the next put, so that a stream of puts, even with pauses of a decode step
 * or two, finds this thread awake and never has to wake it (a wake-up is a
 * futex call on the putting thread, which is often the stepping one, and
 * tends to pull this thread onto that thread's core); only a queue empty for
 * AWAIT_PUTS_NS sends it idle (writer_idle), where the next put wakes it. It
 * sleeps in slices (0.2 ms, 1 ms while the queue is empty) with mu released
 * and looks again after each, so a full batch, a put, a drain, hold or
 * destroy ends the wait within a slice. Not a timed condition wait: glibc's
 * timeout path may signal the condition itself with mu released
 * (__condvar_cancel_waiting), which helgrind reports as a signal without its
 * lock, whatever the caller does.
 */
static void linger(kvpi_redis_store *st, bool empty_only) {
    long budget = empty_only ? (st->config.write_linger_us > 0 ? AWAIT_PUTS_NS : 0)
                             : (long)st->config.write_linger_us * 1000L;
    long max_slice = empty_only ? AWAIT_SLICE_NS : LINGER_SLICE_NS;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    now = start;
    while (budget > 0 && may_linger(st, empty_only) && elapsed_ns(&start, &now) < budget) {
        long left = budget - elapsed_ns(&start, &now);
        struct timespec slice = {0, left < max_slice ? left : max_slice};
        pthread_mutex_unlock(&st->mu);
        nanosleep(&slice, NULL);
        pthread_mutex_lock(&st->mu);
        clock_gettime(CLOCK_MONOTONIC, &now);
    }
}

static void *writer_main(void *arg) {
    kvpi_redis_store *st = arg;
    bool give_up = false; /* closing, and a batch failed: fail the rest at once */
    pthread_mutex_lock(&st->mu);
    for (;;) {
        while (!st->closing && (st->hold || st->put_head == NULL)) {
            st->writer_idle = true;
            pthread_cond_wait(&st->writer_wake, &st->mu);
            st->writer_idle = false;
        }
        if (st->put_head == NULL) {
            break; /* closing, and nothing left */
        }
        linger(st, false);
        if (st->hold && !st->closing) {
            continue; /* held while lingering */
        }
        put_entry *list = st->put_head, *last = list;
        size_t count = 1;
        st->stats.queued_bytes -= last->length;
        while (count < st->config.write_batch && last->next != NULL) {
            last = last->next;
            st->stats.queued_bytes -= last->length;
            count++;
        }
        st->put_head = last->next;
        if (st->put_head == NULL) {
            st->put_tail = NULL;
        }
        last->next = NULL;
        st->stats.queued -= count;
        st->writer_busy = true;
        bool closing = st->closing;
        pthread_mutex_unlock(&st->mu);
        bool failed = write_entries(st, list, count, give_up);
        give_up |= closing && failed;
        pthread_mutex_lock(&st->mu);
        st->writer_busy = false;
        pthread_cond_broadcast(&st->idle);
        linger(st, true);
    }
    pthread_mutex_unlock(&st->mu);
    kvpi_redis_conn_close(&st->writer_conn);
    return NULL;
}

/* ---- the reader ------------------------------------------------------------- */

/* Checks every reply of a lookup; the first bad one as an error. */
static kvpi_redis_code check_replies(const kvpi_redis_store *st, const kvpi_redis_lookup *lk,
                                     void *const *replies, const char *what,
                                     kvpi_redis_error *err) {
    for (size_t i = 0; i < lk->count; i++) {
        const redisReply *r = replies[i];
        bool ok = lk->values != NULL
                      ? r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_NIL
                      : r->type == REDIS_REPLY_INTEGER;
        if (ok) {
            continue;
        }
        bool noauth = r->type == REDIS_REPLY_ERROR && strncmp(r->str, "NOAUTH", 6) == 0;
        kvpi_redis_fail(err, noauth ? KVPI_REDIS_AUTH : KVPI_REDIS_REPLY, what,
                        "redis at %s:%u answered %s with %s%.80s", st->url.host, st->url.port,
                        what, r->type == REDIS_REPLY_ERROR ? "an error: " : "an unexpected reply",
                        r->type == REDIS_REPLY_ERROR ? r->str : "");
        return err->code;
    }
    return KVPI_REDIS_OK;
}

/* Copies the checked replies out and counts them into *s (a local tally:
 * the copy runs without the store's lock, so puts never wait on it). */
static void copy_results(kvpi_redis_lookup *lk, void *const *replies, kvpi_redis_stats *s) {
    for (size_t i = 0; i < lk->count; i++) {
        const redisReply *r = replies[i];
        bool hit;
        if (lk->values == NULL) {
            hit = r->integer > 0;
            if (lk->lengths != NULL) {
                lk->lengths[i] = hit ? (size_t)r->integer : 0;
            }
        } else {
            kvpi_redis_value *v = &lk->values[i];
            hit = r->type == REDIS_REPLY_STRING;
            v->length = hit ? r->len : 0;
            v->found = KVPI_REDIS_MISS;
            if (hit && r->len > v->capacity) {
                v->found = KVPI_REDIS_TOO_BIG;
                s->too_big++;
            } else if (hit) {
                memcpy(v->data, r->str, r->len);
                v->found = KVPI_REDIS_HIT;
                s->bytes_read += r->len;
            }
        }
        if (lk->found != NULL) {
            lk->found[i] = hit;
        }
        s->hits += hit;
        s->misses += !hit;
    }
    s->lookups += lk->count;
}

/* One lookup: EXISTS or GET per key (or one PING), in one round trip. */
static void run_lookup(kvpi_redis_store *st, kvpi_redis_lookup *lk) {
    size_t count = lk->ping_ ? 1 : lk->count;
    const char *what = lk->ping_             ? "PING"
                       : lk->values != NULL  ? "GET"
                       : lk->lengths != NULL ? "STRLEN"
                                             : "EXISTS";
    lk->error.code = KVPI_REDIS_OK;
    lk->error.part = NULL;
    lk->error.text[0] = '\0';
    if (count == 0) {
        return;
    }
    size_t bytes = count * (KVPI_REDIS_KEY_MAX + 2 * sizeof(char *) + 2 * sizeof(size_t) +
                            sizeof(int) + sizeof(char **) + sizeof(size_t *) + sizeof(void *));
    char *block = malloc(bytes);
    if (block == NULL) {
        kvpi_redis_fail(&lk->error, KVPI_REDIS_NO_MEMORY, what,
                        "out of memory for a redis lookup of %zu keys", count);
        return;
    }
    /* pointers first (alignment), then the lengths, argc and the names */
    const char **argv = (const char **)block;
    const char *const **argvp = (const char *const **)(argv + 2 * count);
    const size_t **lensp = (const size_t **)(argvp + count);
    void **replies = (void **)(lensp + count);
    size_t *lens = (size_t *)(replies + count);
    int *argc = (int *)(lens + 2 * count);
    char *names = (char *)(argc + count);
    for (size_t i = 0; i < count; i++) {
        argv[2 * i] = what;
        lens[2 * i] = strlen(what);
        argc[i] = lk->ping_ ? 1 : 2;
        if (!lk->ping_) {
            argv[2 * i + 1] = names + i * KVPI_REDIS_KEY_MAX;
            lens[2 * i + 1] = kvpi_redis_key_name(st->name_space, &lk->keys[i],
                                                  names + i * KVPI_REDIS_KEY_MAX);
        }
        argvp[i] = argv + 2 * i;
        lensp[i] = lens + 2 * i;
        replies[i] = NULL;
    }
    kvpi_redis_events ev = {0};
    uint64_t t0 = kvpi_redis_now_ns();
    kvpi_redis_code code = kvpi_redis_conn_exchange(&st->reader_conn, count, argc, argvp, lensp,
                                                    replies, what, &ev, &lk->error);
    uint64_t took = kvpi_redis_now_ns() - t0;
    bool exchanged = code == KVPI_REDIS_OK; /* then replies[] holds count replies */
    if (exchanged && !lk->ping_) {
        code = check_replies(st, lk, replies, what, &lk->error);
        ev.errors += code != KVPI_REDIS_OK;
    }
    kvpi_redis_stats tally = {0};
    if (code == KVPI_REDIS_OK && !lk->ping_) {
        copy_results(lk, replies, &tally);
    }
    kvpi_redis_replies_free(replies, exchanged ? count : 0);
    free(block);
    pthread_mutex_lock(&st->mu);
    add_events(&st->stats, &ev);
    st->stats.read_ns += took;
    st->stats.lookups += tally.lookups;
    st->stats.hits += tally.hits;
    st->stats.misses += tally.misses;
    st->stats.too_big += tally.too_big;
    st->stats.bytes_read += tally.bytes_read;
    pthread_mutex_unlock(&st->mu);
}

static void *reader_main(void *arg) {
    kvpi_redis_store *st = arg;
    pthread_mutex_lock(&st->mu);
    for (;;) {
        while (!st->closing && st->read_head == NULL) {
            pthread_cond_wait(&st->reader_wake, &st->mu);
        }
        kvpi_redis_lookup *lk = st->read_head;
        if (lk == NULL) {
            break;
        }
        st->read_head = lk->next_;
        if (st->read_head == NULL) {
            st->read_tail = NULL;
        }
        st->read_queued--;
        bool closing = st->closing;
        pthread_mutex_unlock(&st->mu);
        if (closing) {
            kvpi_redis_fail(&lk->error, KVPI_REDIS_CLOSED, "queue",
                            "the redis store closed before this lookup ran");
        } else {
            run_lookup(st, lk);
        }
        lk->done(lk, lk->context); /* lk may be gone after this */
        pthread_mutex_lock(&st->mu);
    }
    pthread_mutex_unlock(&st->mu);
    kvpi_redis_conn_close(&st->reader_conn);
    return NULL;
}

/* ---- create and destroy ------------------------------------------------------ */

static kvpi_redis_code check_config(const kvpi_redis_config *in, kvpi_redis_config *c,
                                    kvpi_redis_error *err) {
    *c = *in;
    c->connect_timeout_ms = c->connect_timeout_ms ? c->connect_timeout_ms : 1000;
    c->command_timeout_ms = c->command_timeout_ms ? c->command_timeout_ms : 1000;
    c->queue_entries = c->queue_entries ? c->queue_entries : 1024;
    c->write_batch = c->write_batch ? c->write_batch : 64;
    c->read_jobs = c->read_jobs ? c->read_jobs : 64;
    c->backoff_max_ms = c->backoff_max_ms ? c->backoff_max_ms : 30000;
    const char *bad = NULL;
    if (c->name_space != NULL && c->name_space[0] != '\0' &&
        !kvpi_redis_namespace_valid(c->name_space)) {
        bad = "name_space";
    } else if (c->backoff_min_ms > c->backoff_max_ms) {
        bad = "backoff_min_ms";
    } else if (c->write_batch > 100000) {
        bad = "write_batch";
    }
    if (bad != NULL) {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_ARGUMENT, bad,
                        "redis store config: bad %s (name_space: 1-%d of [A-Za-z0-9_.-]; "
                        "backoff_min_ms <= backoff_max_ms; write_batch <= 100000)",
                        bad, KVPI_REDIS_NAMESPACE_MAX);
        return KVPI_REDIS_BAD_ARGUMENT;
    }
    return KVPI_REDIS_OK;
}

static void free_store(kvpi_redis_store *st) {
    free(st->w_names);
    free(st->w_argv);
    free(st->w_lens);
    free(st->w_argc);
    free(st->w_argvp);
    free(st->w_lensp);
    free(st->w_replies);
    free(st);
}

static kvpi_redis_store *alloc_store(size_t batch) {
    kvpi_redis_store *st = calloc(1, sizeof *st);
    if (st == NULL) {
        return NULL;
    }
    st->w_names = malloc(batch * KVPI_REDIS_KEY_MAX);
    st->w_argv = malloc(batch * 5 * sizeof *st->w_argv);
    st->w_lens = malloc(batch * 5 * sizeof *st->w_lens);
    st->w_argc = malloc(batch * sizeof *st->w_argc);
    st->w_argvp = malloc(batch * sizeof *st->w_argvp);
    st->w_lensp = malloc(batch * sizeof *st->w_lensp);
    st->w_replies = calloc(batch, sizeof *st->w_replies);
    if (st->w_names == NULL || st->w_argv == NULL || st->w_lens == NULL || st->w_argc == NULL ||
        st->w_argvp == NULL || st->w_lensp == NULL || st->w_replies == NULL) {
        free_store(st);
        return NULL;
    }
    return st;
}

static int init_sync(kvpi_redis_store *st) {
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0) {
        return -1;
    }
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    int failed = pthread_mutex_init(&st->mu, NULL);
    failed |= pthread_cond_init(&st->writer_wake, &attr);
    failed |= pthread_cond_init(&st->reader_wake, &attr);
    failed |= pthread_cond_init(&st->idle, &attr);
    failed |= pthread_cond_init(&st->sync_done, &attr);
    pthread_condattr_destroy(&attr);
    return failed != 0 ? -1 : 0;
}

static void destroy_sync(kvpi_redis_store *st) {
    pthread_cond_destroy(&st->sync_done);
    pthread_cond_destroy(&st->idle);
    pthread_cond_destroy(&st->reader_wake);
    pthread_cond_destroy(&st->writer_wake);
    pthread_mutex_destroy(&st->mu);
}

/* Both threads, with every signal blocked; on failure none runs. */
static kvpi_redis_code start_threads(kvpi_redis_store *st, kvpi_redis_error *err) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int failed = pthread_create(&st->writer, NULL, writer_main, st);
    if (failed == 0) {
        failed = pthread_create(&st->reader, NULL, reader_main, st);
        if (failed != 0) {
            pthread_mutex_lock(&st->mu);
            st->closing = true;
            pthread_cond_broadcast(&st->writer_wake);
            pthread_mutex_unlock(&st->mu);
            pthread_join(st->writer, NULL);
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (failed != 0) {
        kvpi_redis_fail(err, KVPI_REDIS_THREAD, "thread",
                        "cannot start the redis store's threads");
        return KVPI_REDIS_THREAD;
    }
    return KVPI_REDIS_OK;
}

kvpi_redis_code kvpi_redis_create(const kvpi_redis_config *config, kvpi_redis_store **out,
                                  kvpi_redis_error *err) {
    if (config == NULL || out == NULL) {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_ARGUMENT, config == NULL ? "config" : "out",
                        "redis store: %s is NULL", config == NULL ? "config" : "out");
        return KVPI_REDIS_BAD_ARGUMENT;
    }
    kvpi_redis_config c;
    kvpi_redis_url url;
    kvpi_redis_code code = check_config(config, &c, err);
    if (code == KVPI_REDIS_OK) {
        code = kvpi_redis_url_parse(config->url, &url, err);
    }
    if (code != KVPI_REDIS_OK) {
        return code;
    }
    kvpi_redis_store *st = alloc_store(c.write_batch);
    if (st == NULL || init_sync(st) != 0) {
        if (st != NULL) {
            free_store(st);
        }
        kvpi_redis_fail(err, KVPI_REDIS_NO_MEMORY, "store", "out of memory for a redis store");
        return KVPI_REDIS_NO_MEMORY;
    }
    st->url = url;
    st->config = c;
    st->config.url = NULL;
    st->config.name_space = NULL;
    if (c.name_space != NULL) {
        strcpy(st->name_space, c.name_space); /* length checked by check_config */
    }
    snprintf(st->ttl, sizeof st->ttl, "%u", c.ttl_seconds);
    kvpi_redis_conn_init(&st->writer_conn, &st->url, &st->config);
    kvpi_redis_conn_init(&st->reader_conn, &st->url, &st->config);
    code = start_threads(st, err);
    if (code != KVPI_REDIS_OK) {
        destroy_sync(st);
        free_store(st);
        return code;
    }
    *out = st;
    return KVPI_REDIS_OK;
}

void kvpi_redis_destroy(kvpi_redis_store *st) {
    if (st == NULL) {
        return;
    }
    pthread_mutex_lock(&st->mu);
    st->closing = true;
    pthread_cond_broadcast(&st->writer_wake);
    pthread_cond_broadcast(&st->reader_wake);
    pthread_mutex_unlock(&st->mu);
    pthread_join(st->writer, NULL);
    pthread_join(st->reader, NULL);
    destroy_sync(st);
    free_store(st);
}

/* ---- calls ---------------------------------------------------------------------- */

static kvpi_redis_code submit(kvpi_redis_store *st, kvpi_redis_lookup *lk, bool ping,
                              kvpi_redis_error *err) {
    if (st == NULL || lk == NULL || lk->done == NULL ||
        (lk->count > 0 &&
         (lk->keys == NULL || (lk->found == NULL && lk->values == NULL && lk->lengths == NULL)))) {
        const char *what = st == NULL ? "store" : lk == NULL ? "lookup"
                                                  : lk->done == NULL ? "done"
                                                  : lk->keys == NULL ? "keys" : "found";
        kvpi_redis_fail(err, KVPI_REDIS_BAD_ARGUMENT, what, "redis lookup: %s is NULL", what);
        return KVPI_REDIS_BAD_ARGUMENT;
    }
    for (size_t i = 0; lk->values != NULL && i < lk->count; i++) {
        if (lk->values[i].data == NULL && lk->values[i].capacity > 0) {
            kvpi_redis_fail(err, KVPI_REDIS_BAD_ARGUMENT, "values",
                            "redis lookup: values[%zu].data is NULL", i);
            return KVPI_REDIS_BAD_ARGUMENT;
        }
    }
    pthread_mutex_lock(&st->mu);
    kvpi_redis_code code = KVPI_REDIS_OK;
    if (st->closing) {
        code = KVPI_REDIS_CLOSED;
        kvpi_redis_fail(err, code, "queue", "the redis store is closing");
    } else if (st->read_queued >= st->config.read_jobs) {
        code = KVPI_REDIS_QUEUE_FULL;
        st->stats.read_drops++;
        kvpi_redis_fail(err, code, "queue", "the redis reader's queue holds %zu lookups already",
                        st->read_queued);
    } else {
        lk->next_ = NULL;
        lk->ping_ = ping;
        if (st->read_tail != NULL) {
            st->read_tail->next_ = lk;
        } else {
            st->read_head = lk;
        }
        st->read_tail = lk;
        st->read_queued++;
        pthread_cond_signal(&st->reader_wake);
    }
    pthread_mutex_unlock(&st->mu);
    return code;
}

kvpi_redis_code kvpi_redis_submit(kvpi_redis_store *store, kvpi_redis_lookup *lookup,
                                  kvpi_redis_error *err) {
    return submit(store, lookup, false, err);
}

/*
 * A synchronous call: submit, then wait for `done`, which sets the flag
 * under the store's lock and wakes `sync_done`. The store's mutex and
 * condition outlive the wait (a per-call pair on the stack would be
 * destroyed while the reader may still be returning from its unlock).
 */
typedef struct waiter {
    kvpi_redis_store *store;
    bool done;
} waiter;

static void wake_waiter(kvpi_redis_lookup *lk, void *context) {
    (void)lk;
    waiter *w = context;
    kvpi_redis_store *st = w->store;
    pthread_mutex_lock(&st->mu);
    w->done = true;
    pthread_cond_broadcast(&st->sync_done);
    pthread_mutex_unlock(&st->mu);
}

static kvpi_redis_code run_sync(kvpi_redis_store *st, kvpi_redis_lookup *lk, bool ping,
                                kvpi_redis_error *err) {
    waiter w = {.store = st, .done = false};
    lk->done = wake_waiter;
    lk->context = &w;
    kvpi_redis_code code = submit(st, lk, ping, err);
    if (code == KVPI_REDIS_OK) {
        pthread_mutex_lock(&st->mu);
        while (!w.done) {
            pthread_cond_wait(&st->sync_done, &st->mu);
        }
        pthread_mutex_unlock(&st->mu);
        code = lk->error.code;
        if (code != KVPI_REDIS_OK && err != NULL) {
            *err = lk->error;
        }
    }
    return code;
}

kvpi_redis_code kvpi_redis_contains(kvpi_redis_store *store, const kvp_block_key *keys,
                                    size_t count, bool *found, kvpi_redis_error *err) {
    kvpi_redis_lookup lk = {.keys = keys, .count = count, .found = found};
    if (found == NULL && count > 0) {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_ARGUMENT, "found", "redis lookup: found is NULL");
        return KVPI_REDIS_BAD_ARGUMENT;
    }
    return run_sync(store, &lk, false, err);
}

kvpi_redis_code kvpi_redis_get(kvpi_redis_store *store, const kvp_block_key *keys, size_t count,
                               kvpi_redis_value *values, kvpi_redis_error *err) {
    kvpi_redis_lookup lk = {.keys = keys, .count = count, .values = values};
    if (values == NULL && count > 0) {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_ARGUMENT, "values", "redis lookup: values is NULL");
        return KVPI_REDIS_BAD_ARGUMENT;
    }
    return run_sync(store, &lk, false, err);
}

kvpi_redis_code kvpi_redis_ping(kvpi_redis_store *store, kvpi_redis_error *err) {
    kvpi_redis_lookup lk = {.count = 0};
    return run_sync(store, &lk, true, err);
}

/* Queues one copy of a block, or drops it (counted). */
static kvpi_redis_code put_one(kvpi_redis_store *st, const kvp_block_key *key, const void *data,
                               size_t length, kvpi_redis_error *err) {
    put_entry *e = malloc(sizeof *e + length);
    if (e != NULL) {
        e->next = NULL;
        e->key = *key;
        e->length = length;
        memcpy(e->data, data, length);
    }
    pthread_mutex_lock(&st->mu);
    kvpi_redis_stats *s = &st->stats;
    kvpi_redis_code code = KVPI_REDIS_OK;
    if (st->closing) {
        code = KVPI_REDIS_CLOSED;
        kvpi_redis_fail(err, code, "queue", "the redis store is closing");
    } else if (e == NULL) {
        code = KVPI_REDIS_NO_MEMORY;
        s->queue_drops++;
        kvpi_redis_fail(err, code, "queue", "out of memory copying a %zu-byte block", length);
    } else if (s->queued >= st->config.queue_entries ||
               (st->config.queue_bytes != 0 && length > st->config.queue_bytes - s->queued_bytes)) {
        code = KVPI_REDIS_QUEUE_FULL;
        s->queue_drops++;
        kvpi_redis_fail(err, code, "queue",
                        "the redis write queue is full (%zu blocks, %zu bytes): block dropped",
                        s->queued, s->queued_bytes);
    } else {
        if (st->put_tail != NULL) {
            st->put_tail->next = e;
        } else {
            st->put_head = e;
        }
        st->put_tail = e;
        s->queued++;
        s->queued_bytes += length;
        s->puts++;
        e = NULL;
    }
    pthread_mutex_unlock(&st->mu);
    free(e);
    return code;
}

kvpi_redis_code kvpi_redis_put(kvpi_redis_store *store, const kvp_block_key *keys,
                               const void *const *data, const size_t *lengths, size_t count,
                               size_t *accepted, kvpi_redis_error *err) {
    if (store == NULL || (count > 0 && (keys == NULL || data == NULL || lengths == NULL))) {
        const char *what = store == NULL ? "store" : keys == NULL ? "keys"
                                                     : data == NULL ? "data" : "lengths";
        kvpi_redis_fail(err, KVPI_REDIS_BAD_ARGUMENT, what, "redis put: %s is NULL", what);
        return KVPI_REDIS_BAD_ARGUMENT;
    }
    size_t queued = 0;
    kvpi_redis_code result = KVPI_REDIS_OK;
    kvpi_redis_error first;
    for (size_t i = 0; i < count && result != KVPI_REDIS_CLOSED; i++) {
        kvpi_redis_error e;
        kvpi_redis_code code = put_one(store, &keys[i], data[i], lengths[i], &e);
        if (code == KVPI_REDIS_OK) {
            queued++;
        } else if (result == KVPI_REDIS_OK || code == KVPI_REDIS_CLOSED) {
            result = code;
            first = e;
        }
    }
    if (queued > 0) {
        /* An idle writer is woken; a lingering one (linger) looks again itself. */
        pthread_mutex_lock(&store->mu);
        if (store->config.write_linger_us == 0 || store->writer_idle) {
            pthread_cond_signal(&store->writer_wake);
        }
        pthread_mutex_unlock(&store->mu);
    }
    if (accepted != NULL) {
        *accepted = queued;
    }
    if (result != KVPI_REDIS_OK && err != NULL) {
        *err = first;
    }
    return result;
}

kvpi_redis_code kvpi_redis_drain(kvpi_redis_store *st, unsigned timeout_ms,
                                 kvpi_redis_error *err) {
    if (st == NULL) {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_ARGUMENT, "store", "redis drain: store is NULL");
        return KVPI_REDIS_BAD_ARGUMENT;
    }
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    kvpi_redis_code code = KVPI_REDIS_OK;
    pthread_mutex_lock(&st->mu);
    st->draining++; /* the writer stops lingering */
    pthread_cond_signal(&st->writer_wake);
    while (st->put_head != NULL || st->writer_busy) {
        if (pthread_cond_timedwait(&st->idle, &st->mu, &deadline) != 0 &&
            (st->put_head != NULL || st->writer_busy)) {
            code = KVPI_REDIS_TIMEOUT;
            kvpi_redis_fail(err, code, "drain",
                            "the redis write queue did not drain within %u ms (%zu blocks "
                            "queued%s)",
                            timeout_ms, st->stats.queued,
                            st->writer_busy ? ", a batch in flight" : "");
            break;
        }
    }
    st->draining--;
    pthread_mutex_unlock(&st->mu);
    return code;
}

void kvpi_redis_hold_writes(kvpi_redis_store *st, bool hold) {
    pthread_mutex_lock(&st->mu);
    st->hold = hold;
    pthread_cond_signal(&st->writer_wake);
    pthread_mutex_unlock(&st->mu);
}

bool kvpi_redis_last_write_error(kvpi_redis_store *st, kvpi_redis_error *out) {
    pthread_mutex_lock(&st->mu);
    bool any = st->write_error.code != KVPI_REDIS_OK;
    if (any) {
        *out = st->write_error;
    }
    pthread_mutex_unlock(&st->mu);
    return any;
}

void kvpi_redis_stats_get(kvpi_redis_store *st, kvpi_redis_stats *out) {
    pthread_mutex_lock(&st->mu);
    *out = st->stats;
    pthread_mutex_unlock(&st->mu);
}
