/*
 * progress.h: a one-line progress display on stderr, drawn only when stderr
 * is a terminal (so CI logs and pipes stay clean), at most ten times a second.
 */
#ifndef KVPAGER_CLI_PROGRESS_H
#define KVPAGER_CLI_PROGRESS_H

#include <stddef.h>

typedef struct kvp_progress {
    int enabled;
    double last_draw;
    const char *label;
} kvp_progress;

/* Enabled when stderr is a terminal and `quiet` is 0. */
void kvp_progress_init(kvp_progress *progress, const char *label, int quiet);

/* Draws "label [=====     ] done/total (step N)" when enabled and due. */
void kvp_progress_update(void *progress, size_t done, size_t total, size_t step);

/* Draws "label [=====     ] done/total <what>" when enabled and due (any command). */
void kvp_progress_note(kvp_progress *progress, size_t done, size_t total, const char *what);

/* Clears the line. */
void kvp_progress_finish(kvp_progress *progress);

#endif /* KVPAGER_CLI_PROGRESS_H */
