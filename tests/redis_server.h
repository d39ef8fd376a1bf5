/*
 * redis_server.h: a private redis-server for one test (tests/redis_server.c).
 *
 * Owns the server's process, its scratch directory (config, log) and its
 * port: 127.0.0.1 only, a free port found by binding 127.0.0.1:0, retried
 * on a collision; `save ""`, `appendonly no`, so nothing outlives the test.
 * The server dies with the test process (a parent-death signal) and is never one
 * a user runs. Start failures are returned with the reason (the log's tail)
 * for the test to fail on: a tier test never skips.
 * Callers: tests/test_redis_store.c, tests/test_tier_redis.c (one thread).
 */
#ifndef KVPAGER_TESTS_REDIS_SERVER_H
#define KVPAGER_TESTS_REDIS_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

typedef struct kvpt_redis_server {
    pid_t pid;            /* 0 when not running */
    unsigned port;
    bool stopped;         /* SIGSTOPped */
    char dir[64];         /* scratch directory */
    char extra[1024];     /* config lines appended to the defaults */
    char why[512];        /* the last start failure */
} kvpt_redis_server;

/* Starts a server on a fresh port with `extra` config lines (NULL: none). */
bool kvpt_redis_start(kvpt_redis_server *s, const char *extra);

/* Starts it again on the same port and config (after kvpt_redis_kill). */
bool kvpt_redis_restart(kvpt_redis_server *s);

/* SIGKILL and reap; the directory stays (for a restart). */
void kvpt_redis_kill(kvpt_redis_server *s);

/* SIGSTOP (true) or SIGCONT (false): a server that stops answering. */
void kvpt_redis_pause(kvpt_redis_server *s, bool pause);

/* Kills it if running and removes the directory. */
void kvpt_redis_stop(kvpt_redis_server *s);

#endif /* KVPAGER_TESTS_REDIS_SERVER_H */
