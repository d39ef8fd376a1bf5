/*
 * lines.h: a file read line by line, for the trace readers (workload.c's
 * CSV, mooncake.c's JSONL).
 *
 * Owns: opening the file (a directory is refused as EISDIR), reading it in
 * chunks with read(2) (never stdio), skipping a UTF-8 byte order mark that
 * opens the file, refusing a NUL byte and a line longer than the reader's
 * limit with "<path>:<line>: ..." messages, and a line buffer that grows
 * (doubling, through alloc.h) to the longest line. Each line is handed to
 * the caller's function without its newline and NUL-terminated; the last
 * line may lack its newline; an empty line is handed over too (length 0).
 * Invariants: lines are numbered from 1; the buffer is the reader's and is
 * freed before kvp_lines_read returns; a failure leaves nothing allocated.
 * Callers: workload.c and mooncake.c.
 */
#ifndef KVPAGER_CLI_LINES_H
#define KVPAGER_CLI_LINES_H

#include <stddef.h>

/* A line's handler: 0 to go on, nonzero to stop (that status is returned). `text` may be
 * modified; it is valid until the handler returns. */
typedef int kvp_line_fn(void *context, char *text, size_t len, size_t line);

typedef struct kvp_lines {
    const char *path;
    size_t max_len;       /* characters a line may hold, newline excluded */
    size_t max_shown;     /* the limit "line longer than N characters" names */
    kvp_line_fn *handle;
    void *context;
    char *message;        /* the problem, when the return is nonzero */
    size_t message_size;
} kvp_lines;

/*
 * Reads the whole file through r->handle. 0; or -1 with r->message filled
 * (the file cannot be opened or read, a NUL byte, a line too long);
 * KVP_TRACE_OUT_OF_MEMORY (workload.h) when the line buffer cannot grow;
 * or the handler's nonzero status.
 */
int kvp_lines_read(const kvp_lines *r);

#endif /* KVPAGER_CLI_LINES_H */
