/*
 * lines.c: the trace readers' line reader (see lines.h).
 * Callers: workload.c (CSV traces) and mooncake.c (Mooncake JSONL).
 */
#include "lines.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"
#include "workload.h"

#define LINES_FIRST_ROOM 256 /* the buffer's first size; it doubles up to the limit */

typedef struct line_state {
    const kvp_lines *r;
    char *text;
    size_t len;
    size_t room;
    size_t line;   /* 1-based number of the line being assembled */
    size_t offset; /* bytes of the file consumed */
} line_state;

/* Room for one more character and the NUL: 0, or KVP_TRACE_OUT_OF_MEMORY. */
static int grow(line_state *s)
{
    if (s->len + 2 <= s->room) {
        return 0;
    }
    size_t bigger = s->room ? s->room : LINES_FIRST_ROOM;
    while (bigger < s->len + 2) {
        bigger = bigger > SIZE_MAX / 2 ? s->len + 2 : 2 * bigger;
    }
    char *grown = kvp_cli_realloc(s->text, bigger, 1);
    if (grown == NULL) {
        snprintf(s->r->message, s->r->message_size,
                 "out of memory: cannot allocate the trace's line buffer (%zu bytes) "
                 "(AllocationFailed)",
                 bigger);
        return KVP_TRACE_OUT_OF_MEMORY;
    }
    s->text = grown;
    s->room = bigger;
    return 0;
}

/* Hands the line assembled so far to the handler (an empty one has no buffer yet). */
static int end_line(line_state *s)
{
    static char empty[1];
    char *text = s->text != NULL ? s->text : empty;
    size_t len = s->len;
    text[len] = '\0';
    s->len = 0;
    return s->r->handle(s->r->context, text, len, s->line);
}

/* Consumes `n` bytes of the file. */
static int consume(line_state *s, const unsigned char *bytes, size_t n)
{
    static const unsigned char bom[3] = {0xEF, 0xBB, 0xBF};
    const kvp_lines *r = s->r;
    size_t i = 0;
    if (s->offset == 0 && n >= 3 && memcmp(bytes, bom, 3) == 0) {
        i = 3; /* a UTF-8 byte order mark opens the file: skip it */
    }
    s->offset += n;
    for (; i < n; i++) {
        unsigned char c = bytes[i];
        if (c == '\n') {
            int status = end_line(s);
            if (status != 0) {
                return status;
            }
            s->line++;
            continue;
        }
        if (c == '\0') {
            snprintf(r->message, r->message_size, "%s:%zu: a NUL byte at column %zu", r->path,
                     s->line, s->len + 1);
            return -1;
        }
        if (s->len == r->max_len) {
            snprintf(r->message, r->message_size, "%s:%zu: line longer than %zu characters",
                     r->path, s->line, r->max_shown);
            return -1;
        }
        int status = grow(s);
        if (status != 0) {
            return status;
        }
        s->text[s->len++] = (char)c;
    }
    return 0;
}

/* The file, opened for reading; -1 with the message (a directory is EISDIR). */
static int open_file(const kvp_lines *r)
{
    int fd = open(r->path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
        close(fd);
        fd = -1;
        errno = EISDIR;
    }
    if (fd < 0) {
        snprintf(r->message, r->message_size, "%s: %s", r->path, strerror(errno));
    }
    return fd;
}

int kvp_lines_read(const kvp_lines *r)
{
    int fd = open_file(r);
    if (fd < 0) {
        return -1;
    }
    line_state s = {.r = r, .line = 1};
    unsigned char chunk[16384];
    int status = 0;
    for (;;) {
        ssize_t got = read(fd, chunk, sizeof chunk);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got < 0) {
            snprintf(r->message, r->message_size, "%s: %s", r->path, strerror(errno));
            status = -1;
            break;
        }
        if (got == 0) {
            status = s.len > 0 ? end_line(&s) : 0;
            break;
        }
        status = consume(&s, chunk, (size_t)got);
        if (status != 0) {
            break;
        }
    }
    close(fd);
    kvp_cli_free(s.text);
    return status;
}
