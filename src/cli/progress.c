/*
 * progress.c: the terminal progress line (see progress.h).
 */
#include "progress.h"

#include <stdio.h>
#include <time.h>
#include <unistd.h>

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void kvp_progress_init(kvp_progress *progress, const char *label, int quiet)
{
    progress->enabled = !quiet && isatty(STDERR_FILENO);
    progress->last_draw = 0.0;
    progress->label = label;
}

void kvp_progress_update(void *arg, size_t done, size_t total, size_t step)
{
    kvp_progress *progress = arg;
    if (!progress->enabled) {
        return;
    }
    double now = now_seconds();
    if (now - progress->last_draw < 0.1 && done < total) {
        return;
    }
    progress->last_draw = now;
    enum { WIDTH = 30 };
    size_t filled = total > 0 ? done * WIDTH / total : WIDTH;
    char bar[WIDTH + 1];
    for (size_t i = 0; i < WIDTH; i++) {
        bar[i] = i < filled ? '=' : ' ';
    }
    bar[WIDTH] = '\0';
    fprintf(stderr, "\r%s [%s] %zu/%zu requests (step %zu)", progress->label, bar, done, total,
            step);
    fflush(stderr);
}

void kvp_progress_finish(kvp_progress *progress)
{
    if (progress->enabled) {
        fprintf(stderr, "\r\033[K");
        fflush(stderr);
    }
}
