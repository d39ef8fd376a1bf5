/*
 * test_simulate_outage.c: issue 20's "Redis killed in the middle of a run,
 * then restarted" for a whole `kvpager simulate` process, forced: no
 * request fails, no output is wrong, and the tier is used again after the
 * reconnection.
 *
 * The test starts its own redis-server on a loopback port
 * (tests/redis_server.c; one that cannot start fails the test, never skips
 * it) and a TCP proxy thread in front of it on another random loopback
 * port. The real program runs as a child process against the proxy with
 * --tier-retry-ms 0 (every batch after a failure connects again) and
 * --verify. The proxy parses the RESP commands and replies it forwards:
 *   1. a reference run passes through (no cut): C commands counted, its
 *      output checksum kept; the server is emptied (FLUSHALL) after it;
 *   2. the outage run: at the K-th command (K = C / 3) the proxy closes
 *      every connection (the in-flight batch and anything unforwarded are
 *      lost, as when the server is killed); then it refuses: the next M = 3
 *      connections are closed at accept (their handshake fails: failed
 *      connects, the ones --tier-retry-ms waits after), then each one is
 *      let through the handshake (SELECT) and closed at its first command,
 *      until one is closed at a read (a GET: the reader's batch failed, so
 *      the run's tier errors are forced above 0, not hoped for); after
 *      that it forwards again, and counts the commands and the GET and SET
 *      replies it forwards on the connections made after the refusals.
 * Asserted: the child exits 0 with every request completed, --verify's
 * 0 mismatches and the reference's output checksum; tier errors above 0;
 * one cut, the refusals, and GET and SET replies forwarded after them.
 * Why that holds under any scheduling: the run's tier traffic is its
 * workload's (GETs at admissions, SETs at evictions), so at a third of the
 * reference's commands two thirds of it is still to come (measured: C =
 * 430 to 432 commands, about 230 GETs and 200 SETs, K = 143 or 144; after
 * the refusals 92 to 121 GETs and 112 to 149 SETs were forwarded);
 * every read during the refusals fails (one must, to end them), and with
 * retry 0 every batch after them connects again: the tier is used again
 * by construction. With the old fixed 1 s backoff the refused connects
 * hold the tier off for the rest of the run: nothing is forwarded after
 * them and the test fails. How many of those GETs find a block is not
 * asserted: the writer thread writes evicted blocks asynchronously, so
 * whether one is in Redis when read again depends on timing (measured 0
 * to 44 hits a run, the reference's included). Timeouts play no part
 * (--tier-timeout-ms 10000: a loaded machine is never taken for a dead
 * server).
 * Usage: test_simulate_outage KVPAGER (the program under test).
 * Callers: ctest (test_simulate_outage).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <hiredis/hiredis.h>

#include "../redis_server.h"
#include "sim_json.h"

/* ---- RESP, parsed as it streams through ------------------------------------ */

/* Kinds of command, as the proxy tells them apart. */
enum { KIND_OTHER, KIND_GET, KIND_SET, KIND_HANDSHAKE };

typedef struct resp_parser {
    char line[128];
    size_t line_len;
    long long bulk_left; /* bytes of a bulk string and its CRLF still to come */
    long long remaining[8];
    int depth;
    int naming;    /* the next bulk string is a command's name */
    int capturing; /* this bulk string is */
    char name[8];
    size_t name_len;
    int bad; /* not RESP as hiredis and Redis speak it */
    char top_type; /* the last top-level message's type, and whether it was a null */
    int top_null;
} resp_parser;

/* An element ended: 1 when that ended the top-level message. */
static int element_done(resp_parser *p)
{
    while (p->depth > 0) {
        if (--p->remaining[p->depth - 1] > 0) {
            return 0;
        }
        p->depth--;
    }
    return 1;
}

static int header_line(resp_parser *p)
{
    char type = p->line[0];
    long long n = strtoll(p->line + 1, NULL, 10);
    if (p->depth == 0) {
        p->top_type = type;
        p->top_null = n < 0;
    }
    if (type == '*' && n > 0) {
        if (p->depth == 8) {
            p->bad = 1;
            return 0;
        }
        p->remaining[p->depth++] = n;
        if (p->depth == 1) {
            p->naming = 1;
            p->name_len = 0;
        }
        return 0;
    }
    if (type == '$' && n >= 0) {
        p->bulk_left = n + 2;
        p->capturing = p->naming;
        p->naming = 0;
        return 0;
    }
    return element_done(p); /* +OK, -ERR, :n, $-1, *0, *-1 */
}

/* Consumes bytes of buf up to the end of one message (*done = 1) or all of them. */
static size_t resp_feed(resp_parser *p, const char *buf, size_t n, int *done)
{
    size_t i = 0;
    *done = 0;
    while (i < n && !*done) {
        if (p->bulk_left > 0) {
            size_t take = p->capturing ? 1 : (size_t)p->bulk_left < n - i ? (size_t)p->bulk_left
                                                                          : n - i;
            if (p->capturing && p->bulk_left > 2 && p->name_len + 1 < sizeof p->name) {
                p->name[p->name_len++] = buf[i];
            }
            p->bulk_left -= (long long)take;
            i += take;
            if (p->bulk_left == 0) {
                p->capturing = 0;
                p->name[p->name_len] = '\0';
                *done = element_done(p);
            }
            continue;
        }
        char c = buf[i++];
        if (c == '\n') {
            if (p->line_len == 0 || p->line[p->line_len - 1] != '\r') {
                p->bad = 1;
            }
            p->line[p->line_len > 0 ? p->line_len - 1 : 0] = '\0';
            p->line_len = 0;
            *done = header_line(p);
        } else if (p->line_len + 1 < sizeof p->line) {
            p->line[p->line_len++] = c;
        } else {
            p->bad = 1;
        }
    }
    return i;
}

static int kind_of(const char *name)
{
    if (strcasecmp(name, "GET") == 0) {
        return KIND_GET;
    }
    if (strcasecmp(name, "SET") == 0) {
        return KIND_SET;
    }
    if (strcasecmp(name, "SELECT") == 0 || strcasecmp(name, "AUTH") == 0) {
        return KIND_HANDSHAKE;
    }
    return KIND_OTHER;
}

/* ---- the proxy ------------------------------------------------------------- */

enum { PHASE_BEFORE, PHASE_REFUSING, PHASE_AFTER };
#define LINKS_MAX 16
#define RING 8192 /* commands awaiting their replies on one connection */
#define AFTER_BIT 0x80

typedef struct conn {
    int fd[2]; /* client, server; fd[0] == -1: a free slot */
    char buf[2][1 << 16]; /* bytes read from side d, to write to the other side */
    size_t len[2];
    size_t off[2];
    resp_parser parser[2];
    unsigned char kinds[RING]; /* each command's kind, AFTER_BIT: sent after the refusals */
    size_t head;
    size_t tail;
} conn;

typedef struct proxy {
    int listen_fd;
    int wake[2];
    unsigned port;
    unsigned redis_port;
    pthread_t thread;
    pthread_mutex_t mutex; /* guards everything below */
    int stop;
    unsigned long long cut_at; /* K: the command that cuts (0: never) */
    unsigned refuse_min;       /* M */
    int phase;
    unsigned long long commands; /* counted since the run began (the handshakes too) */
    unsigned long long cuts;
    unsigned refused;                /* connections closed at accept (a failed connect) */
    unsigned refused_commands;       /* then, connections closed at their first command */
    unsigned refused_reads;          /* of those, at a command other than SET */
    unsigned long long after_commands; /* after the refusals (handshakes apart) */
    unsigned long long after_gets;     /* GET replies forwarded after them */
    unsigned long long after_sets;     /* SET replies forwarded after them */
    unsigned long long after_hits;     /* of those, GETs that found a block */
    unsigned long long accepted;
    unsigned long long upstream_failures;
    unsigned long long protocol_errors;
    conn links[LINKS_MAX];
} proxy;

static void conn_close(conn *l)
{
    for (int d = 0; d < 2; d++) {
        if (l->fd[d] >= 0) {
            close(l->fd[d]);
        }
        l->fd[d] = -1;
    }
}

static void cut_all(proxy *px)
{
    for (int i = 0; i < LINKS_MAX; i++) {
        conn_close(&px->links[i]);
    }
}

static int connect_upstream(unsigned port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)port);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        fd = -1;
    }
    if (fd >= 0) {
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    }
    return fd;
}

static void accept_one(proxy *px)
{
    int fd = accept4(px->listen_fd, NULL, NULL, SOCK_NONBLOCK);
    if (fd < 0) {
        return;
    }
    px->accepted++;
    if (px->phase == PHASE_REFUSING && px->refused < px->refuse_min) {
        close(fd); /* the handshake fails: a failed connect, the backoff's business */
        px->refused++;
        return;
    }
    conn *free_link = NULL;
    for (int i = 0; i < LINKS_MAX && free_link == NULL; i++) {
        free_link = px->links[i].fd[0] < 0 ? &px->links[i] : NULL;
    }
    int up = free_link != NULL ? connect_upstream(px->redis_port) : -1;
    if (up < 0) {
        px->upstream_failures++;
        close(fd);
        return;
    }
    memset(free_link, 0, sizeof *free_link);
    free_link->fd[0] = fd;
    free_link->fd[1] = up;
}

/* A client's command ended: 0 when the conn (or every conn) was closed for it. */
static int client_command(proxy *px, conn *l)
{
    int kind = kind_of(l->parser[0].name);
    px->commands++;
    if (px->phase == PHASE_BEFORE && px->cut_at != 0 && px->commands == px->cut_at) {
        cut_all(px); /* the server "killed": every connection, in-flight batches lost */
        px->cuts++;
        px->phase = PHASE_REFUSING;
        return 0;
    }
    if (px->phase == PHASE_REFUSING && kind != KIND_HANDSHAKE) {
        conn_close(l); /* refused after the handshake: its batch fails */
        px->refused_commands++;
        px->refused_reads += kind != KIND_SET;
        if (px->refused_reads >= 1) {
            px->phase = PHASE_AFTER;
        }
        return 0;
    }
    int after = px->phase == PHASE_AFTER && kind != KIND_HANDSHAKE;
    px->after_commands += (unsigned long long)after;
    if (l->tail - l->head == RING) {
        px->protocol_errors++;
        return 1;
    }
    l->kinds[l->tail++ % RING] = (unsigned char)(kind | (after ? AFTER_BIT : 0));
    return 1;
}

static void server_reply(proxy *px, conn *l)
{
    if (l->head == l->tail) {
        px->protocol_errors++; /* a reply to no command */
        return;
    }
    unsigned char k = l->kinds[l->head++ % RING];
    int kind = k & ~AFTER_BIT;
    px->after_gets += (k & AFTER_BIT) && kind == KIND_GET;
    px->after_sets += (k & AFTER_BIT) && kind == KIND_SET;
    px->after_hits += (k & AFTER_BIT) && kind == KIND_GET && l->parser[1].top_type == '$' &&
                      !l->parser[1].top_null;
}

/* Parses what was read from side d; 0 when the conn (or every conn) was closed. */
static int parse(proxy *px, conn *l, int d)
{
    size_t pos = 0;
    while (pos < l->len[d]) {
        int done = 0;
        pos += resp_feed(&l->parser[d], l->buf[d] + pos, l->len[d] - pos, &done);
        if (l->parser[d].bad) {
            px->protocol_errors++;
            l->parser[d].bad = 0;
        }
        if (done && d == 0 && !client_command(px, l)) {
            return 0;
        }
        if (done && d == 1) {
            server_reply(px, l);
        }
    }
    return 1;
}

/* Moves bytes for one conn; 0 when a cut closed every conn (the poll set is stale). */
static int serve_link(proxy *px, conn *l, const struct pollfd *pfd)
{
    for (int d = 0; d < 2 && l->fd[0] >= 0; d++) {
        short in = pfd[d].revents;
        short out = pfd[1 - d].revents;
        if (l->len[d] == 0 && (in & (POLLIN | POLLHUP | POLLERR))) {
            ssize_t n = read(l->fd[d], l->buf[d], sizeof l->buf[d]);
            if (n <= 0) {
                conn_close(l);
                return 1;
            }
            l->len[d] = (size_t)n;
            l->off[d] = 0;
            unsigned long long cuts = px->cuts;
            if (!parse(px, l, d)) {
                return px->cuts == cuts;
            }
        } else if (l->len[d] != 0 && (out & (POLLOUT | POLLHUP | POLLERR))) {
            ssize_t n = send(l->fd[1 - d], l->buf[d] + l->off[d], l->len[d] - l->off[d],
                             MSG_NOSIGNAL);
            if (n <= 0) {
                conn_close(l);
                return 1;
            }
            l->off[d] += (size_t)n;
            if (l->off[d] == l->len[d]) {
                l->len[d] = l->off[d] = 0;
            }
        }
    }
    return 1;
}

static void *proxy_main(void *arg)
{
    proxy *px = arg;
    struct pollfd pfd[2 + 2 * LINKS_MAX];
    int which[LINKS_MAX];
    for (;;) {
        pthread_mutex_lock(&px->mutex);
        int stop = px->stop;
        size_t n = 2;
        pfd[0] = (struct pollfd){.fd = px->wake[0], .events = POLLIN};
        pfd[1] = (struct pollfd){.fd = px->listen_fd, .events = POLLIN};
        int count = 0;
        for (int i = 0; i < LINKS_MAX; i++) {
            conn *l = &px->links[i];
            if (l->fd[0] < 0) {
                continue;
            }
            which[count++] = i;
            for (int d = 0; d < 2; d++) {
                short ev = (short)((l->len[d] == 0 ? POLLIN : 0) | (l->len[1 - d] ? POLLOUT : 0));
                pfd[n++] = (struct pollfd){.fd = l->fd[d], .events = ev};
            }
        }
        pthread_mutex_unlock(&px->mutex);
        if (stop) {
            return NULL;
        }
        if (poll(pfd, n, -1) < 0) {
            continue; /* EINTR */
        }
        pthread_mutex_lock(&px->mutex);
        if (pfd[1].revents & POLLIN) {
            accept_one(px);
        }
        for (int c = 0; c < count; c++) {
            if (!serve_link(px, &px->links[which[c]], &pfd[2 + 2 * c])) {
                break;
            }
        }
        pthread_mutex_unlock(&px->mutex);
        if (pfd[0].revents & POLLIN) {
            char byte;
            (void)!read(px->wake[0], &byte, 1);
        }
    }
}

static void proxy_start(proxy *px, unsigned redis_port)
{
    memset(px, 0, sizeof *px);
    for (int i = 0; i < LINKS_MAX; i++) {
        px->links[i].fd[0] = px->links[i].fd[1] = -1;
    }
    px->redis_port = redis_port;
    px->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    assert_true(px->listen_fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK); /* port 0: a free one */
    socklen_t len = sizeof a;
    assert_int_equal(bind(px->listen_fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(px->listen_fd, 64), 0);
    assert_int_equal(getsockname(px->listen_fd, (struct sockaddr *)&a, &len), 0);
    px->port = ntohs(a.sin_port);
    assert_int_equal(pipe(px->wake), 0);
    assert_int_equal(pthread_mutex_init(&px->mutex, NULL), 0);
    assert_int_equal(pthread_create(&px->thread, NULL, proxy_main, px), 0);
}

static void proxy_stop(proxy *px)
{
    pthread_mutex_lock(&px->mutex);
    px->stop = 1;
    pthread_mutex_unlock(&px->mutex);
    assert_int_equal(write(px->wake[1], "x", 1), 1);
    assert_int_equal(pthread_join(px->thread, NULL), 0);
    cut_all(px);
    close(px->listen_fd);
    close(px->wake[0]);
    close(px->wake[1]);
    pthread_mutex_destroy(&px->mutex);
}

/* Between runs (no child running): the next run's cut and refusals, counters zeroed. */
static void proxy_arm(proxy *px, unsigned long long cut_at, unsigned refuse_min)
{
    pthread_mutex_lock(&px->mutex);
    cut_all(px); /* the last run's connections, closed by its exit */
    px->cut_at = cut_at;
    px->refuse_min = refuse_min;
    px->phase = PHASE_BEFORE;
    px->commands = px->cuts = px->after_commands = 0;
    px->after_gets = px->after_sets = px->after_hits = 0;
    px->refused = px->refused_commands = px->refused_reads = 0;
    px->accepted = px->upstream_failures = px->protocol_errors = 0;
    pthread_mutex_unlock(&px->mutex);
}

/* ---- the runs ---------------------------------------------------------------- */

static const char *kvpager;
static kvpt_redis_server server;
static proxy px;
static char dir[64];

#define REQUESTS 32

typedef struct run_figures {
    unsigned long long completed;
    unsigned long long verify_mismatches;
    unsigned long long prefill_tokens;
    unsigned long long hit_blocks;
    unsigned long long errors;
    unsigned long long write_failures;
    unsigned long long writes;
    char checksum[64];
} run_figures;

/* A conversation workload: evicted blocks are written, and later turns read them. */
static run_figures simulate(void)
{
    char command[2048];
    snprintf(command, sizeof command,
             "'%s' simulate --profile conversation --requests %d --layers 1 --model-width 32 "
             "--heads 2 --block-tokens 8 --prompt-mean 64 --output-mean 8 --capacity 256 "
             "--budget 256KiB --seed 5 --tier redis://127.0.0.1:%u --tier-secret-file %s/secret "
             "--tier-loads always --tier-retry-ms 0 --tier-timeout-ms 10000 --verify 4 --json "
             "--quiet 2>%s/stderr",
             kvpager, REQUESTS, px.port, dir, dir);
    static char json[1 << 16];
    int status = json_run(command, json, sizeof json);
    if (status != 0) {
        char path[128];
        char err[2048] = "";
        snprintf(path, sizeof path, "%s/stderr", dir);
        FILE *f = fopen(path, "r");
        size_t got = f != NULL ? fread(err, 1, sizeof err - 1, f) : 0;
        err[got] = '\0';
        if (f != NULL) {
            fclose(f);
        }
        fail_msg("kvpager simulate exited with status %d: %s", status, err);
    }
    run_figures r;
    memset(&r, 0, sizeof r);
    r.completed = json_number(json, "requests_completed");
    r.verify_mismatches = json_number(json, "verify_mismatches");
    r.prefill_tokens = json_number(json, "prefill_tokens");
    const char *tier = strstr(json, "\"tier\":{");
    assert_non_null(tier);
    r.hit_blocks = json_number(tier, "hit_blocks");
    r.errors = json_number(tier, "errors");
    r.write_failures = json_number(tier, "write_failures");
    r.writes = json_number(tier, "writes");
    json_text(json, "output_checksum", r.checksum, sizeof r.checksum);
    return r;
}

static void flushall(void)
{
    redisContext *c = redisConnect("127.0.0.1", (int)server.port);
    assert_non_null(c);
    assert_int_equal(c->err, 0);
    redisReply *r = redisCommand(c, "FLUSHALL");
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_STATUS);
    freeReplyObject(r);
    redisFree(c);
}

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/kvp-sim-outage-XXXXXX");
    assert_non_null(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/secret", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("the outage test's deployment secret, 44 bytes\n", f);
    assert_int_equal(fclose(f), 0);
    if (!kvpt_redis_start(&server, NULL)) {
        fail_msg("redis-server did not start: %s", server.why); /* never a skip */
    }
    proxy_start(&px, server.port);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    proxy_stop(&px);
    kvpt_redis_stop(&server);
    char command[160];
    snprintf(command, sizeof command, "rm -rf '%s'", dir);
    return system(command) == 0 ? 0 : -1;
}

#define REFUSE_MIN 3

/* The proxy's counters after a run. */
typedef struct proxy_counts {
    int phase;
    unsigned long long cuts;
    unsigned refused;
    unsigned refused_commands;
    unsigned refused_reads;
    unsigned long long after_commands;
    unsigned long long after_gets;
    unsigned long long after_sets;
    unsigned long long after_hits;
    unsigned long long upstream_failures;
    unsigned long long protocol_errors;
} proxy_counts;

static void test_simulate_outage_redis_cut_mid_run_then_used_again(void **state)
{
    (void)state;
    proxy_arm(&px, 0, 0);
    run_figures ref = simulate();
    pthread_mutex_lock(&px.mutex);
    unsigned long long total = px.commands;
    unsigned long long ref_errors = px.protocol_errors + px.upstream_failures;
    pthread_mutex_unlock(&px.mutex);
    assert_int_equal(ref.completed, REQUESTS);
    assert_int_equal(ref.verify_mismatches, 0);
    assert_int_equal(ref.errors, 0);
    assert_int_equal(ref.write_failures, 0);
    assert_int_equal(ref_errors, 0);
    assert_true(total >= 100); /* enough tier traffic for a third to be mid-run */

    flushall(); /* the outage run starts from the same empty server */
    unsigned long long cut_at = total / 3;
    proxy_arm(&px, cut_at, REFUSE_MIN);
    run_figures out = simulate();
    pthread_mutex_lock(&px.mutex);
    proxy_counts seen = {.phase = px.phase,
                         .cuts = px.cuts,
                         .refused = px.refused,
                         .refused_commands = px.refused_commands,
                         .refused_reads = px.refused_reads,
                         .after_commands = px.after_commands,
                         .after_gets = px.after_gets,
                         .after_sets = px.after_sets,
                         .after_hits = px.after_hits,
                         .upstream_failures = px.upstream_failures,
                         .protocol_errors = px.protocol_errors};
    pthread_mutex_unlock(&px.mutex);
    printf("outage: %llu commands in the reference run; cut at K = %llu; %u connections "
           "refused at accept (M = %d), then %u at their first command (%u at a read); after: %llu commands, %llu GET replies (%llu "
           "hits), %llu SET replies; run: %llu tier errors, %llu failed writes, %llu tier "
           "hits (reference %llu)\n",
           total, cut_at, seen.refused, REFUSE_MIN, seen.refused_commands, seen.refused_reads, seen.after_commands,
           seen.after_gets, seen.after_hits, seen.after_sets, out.errors, out.write_failures,
           out.hit_blocks, ref.hit_blocks);
    /* The outage happened as forced. */
    assert_int_equal(seen.cuts, 1);
    assert_int_equal(seen.refused, REFUSE_MIN);
    assert_true(seen.refused_reads >= 1);
    assert_int_equal(seen.phase, PHASE_AFTER);
    assert_int_equal(seen.protocol_errors, 0);
    assert_int_equal(seen.upstream_failures, 0);
    /* No request failed, no output is wrong. */
    assert_int_equal(out.completed, REQUESTS);
    assert_int_equal(out.verify_mismatches, 0);
    assert_string_equal(out.checksum, ref.checksum);
    /* The run saw the outage (a read refused: its blocks counted as errors) ... */
    assert_true(out.errors > 0);
    /* ... and used the tier again after it: commands and GET/SET replies forwarded on the
     * connections made after the refusals. */
    assert_true(seen.after_commands > 0);
    assert_true(seen.after_gets > 0);
    assert_true(seen.after_sets > 0);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_simulate_outage KVPAGER\n");
        return 2;
    }
    kvpager = argv[1];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_simulate_outage_redis_cut_mid_run_then_used_again),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
