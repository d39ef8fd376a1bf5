/*
 * redis_server.c: a private redis-server per test (redis_server.h).
 *
 * Invariants: `pid` is a live child of ours or 0; a start returns only once
 * the server logged "Ready to accept connections" (it listens) or exited;
 * a bind collision (the port taken between our probe and its bind) retries
 * on another port, up to 20 times. The server is spawned through setpriv
 * (util-linux) with a parent-death signal: it never outlives the test.
 * Callers: tests (one thread).
 */
#define _GNU_SOURCE
#include "redis_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static unsigned free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        return 0;
    }
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    unsigned port = 0;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0) {
        port = ntohs(a.sin_port);
    }
    close(fd);
    return port;
}

/* The file's text (at most size - 1 bytes), "" when unreadable. */
static void read_text(const char *path, char *buf, size_t size) {
    buf[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        return;
    }
    size_t n = fread(buf, 1, size - 1, f);
    buf[n] = '\0';
    fclose(f);
}

static bool write_config(kvpt_redis_server *s) {
    char path[128];
    snprintf(path, sizeof path, "%s/redis.conf", s->dir);
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        return false;
    }
    fprintf(f,
            "bind 127.0.0.1\nport %u\nsave \"\"\nappendonly no\ndir %s\nlogfile %s/redis.log\n"
            "daemonize no\n%s\n",
            s->port, s->dir, s->dir, s->extra);
    return fclose(f) == 0;
}

static const char *server_path(void) {
    static const char *const candidates[] = {"/usr/bin/redis-server", "/usr/local/bin/redis-server",
                                             "/usr/sbin/redis-server"};
    for (size_t i = 0; i < sizeof candidates / sizeof candidates[0]; i++) {
        if (access(candidates[i], X_OK) == 0) {
            return candidates[i];
        }
    }
    return NULL;
}

/* One attempt on s->port: 1 ready, 0 the port was taken, -1 failed (s->why). */
static int start_once(kvpt_redis_server *s) {
    char conf[128], log[128], text[8192];
    snprintf(conf, sizeof conf, "%s/redis.conf", s->dir);
    snprintf(log, sizeof log, "%s/redis.log", s->dir);
    const char *exe = server_path();
    if (exe == NULL) {
        snprintf(s->why, sizeof s->why, "redis-server is not installed (scripts/deps.sh)");
        return -1;
    }
    unlink(log);
    if (!write_config(s)) {
        snprintf(s->why, sizeof s->why, "cannot write %s", conf);
        return -1;
    }
    /* posix_spawn, not fork: no atfork handlers run in a child of a
     * threaded test (under helgrind a forked child reports jemalloc's). The
     * server dies with us: setpriv sets its parent-death signal, which the
     * exec of redis-server keeps. */
    posix_spawn_file_actions_t files;
    posix_spawn_file_actions_init(&files);
    posix_spawn_file_actions_addopen(&files, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&files, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&files, 2, "/dev/null", O_WRONLY, 0);
    char *const args[] = {"setpriv", "--pdeathsig", "KILL", "--", (char *)exe, conf, NULL};
    pid_t pid;
    int failed = posix_spawn(&pid, "/usr/bin/setpriv", &files, NULL, args, environ);
    posix_spawn_file_actions_destroy(&files);
    if (failed != 0) {
        snprintf(s->why, sizeof s->why, "posix_spawn setpriv redis-server: %s", strerror(failed));
        return -1;
    }
    s->pid = pid;
    for (int tick = 0; tick < 2000; tick++) { /* 20 s: generous under Valgrind */
        read_text(log, text, sizeof text);
        if (strstr(text, "Ready to accept connections") != NULL) {
            return 1;
        }
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            s->pid = 0;
            if (strstr(text, "Address already in use") != NULL) {
                return 0;
            }
            const char *tail = strlen(text) > 300 ? text + strlen(text) - 300 : text;
            snprintf(s->why, sizeof s->why, "redis-server exited (status %d): %.300s", status, tail);
            return -1;
        }
        struct timespec ten_ms = {0, 10000000L};
        nanosleep(&ten_ms, NULL);
    }
    snprintf(s->why, sizeof s->why, "redis-server on port %u was not ready within 20 s", s->port);
    kvpt_redis_kill(s);
    return -1;
}

bool kvpt_redis_start(kvpt_redis_server *s, const char *extra) {
    memset(s, 0, sizeof *s);
    snprintf(s->extra, sizeof s->extra, "%s", extra != NULL ? extra : "");
    snprintf(s->dir, sizeof s->dir, "/tmp/kvp-redis.XXXXXX");
    if (mkdtemp(s->dir) == NULL) {
        snprintf(s->why, sizeof s->why, "mkdtemp: %s", strerror(errno));
        s->dir[0] = '\0';
        return false;
    }
    for (int attempt = 0; attempt < 20; attempt++) {
        s->port = free_port();
        if (s->port == 0) {
            snprintf(s->why, sizeof s->why, "no free port on 127.0.0.1: %s", strerror(errno));
            return false;
        }
        int r = start_once(s);
        if (r != 0) {
            return r == 1;
        }
    }
    snprintf(s->why, sizeof s->why, "20 ports in a row were taken before redis-server bound them");
    return false;
}

bool kvpt_redis_restart(kvpt_redis_server *s) {
    kvpt_redis_kill(s);
    int r = start_once(s);
    if (r == 0) {
        snprintf(s->why, sizeof s->why, "port %u was taken while the server was down", s->port);
    }
    return r == 1;
}

void kvpt_redis_kill(kvpt_redis_server *s) {
    if (s->pid > 0) {
        kill(s->pid, SIGKILL);
        waitpid(s->pid, NULL, 0);
        s->pid = 0;
        s->stopped = false;
    }
}

void kvpt_redis_pause(kvpt_redis_server *s, bool pause) {
    if (s->pid > 0) {
        kill(s->pid, pause ? SIGSTOP : SIGCONT);
        s->stopped = pause;
    }
}

void kvpt_redis_stop(kvpt_redis_server *s) {
    kvpt_redis_kill(s);
    if (s->dir[0] != '\0') {
        char path[160];
        snprintf(path, sizeof path, "%s/redis.conf", s->dir);
        unlink(path);
        snprintf(path, sizeof path, "%s/redis.log", s->dir);
        unlink(path);
        rmdir(s->dir);
        s->dir[0] = '\0';
    }
}
