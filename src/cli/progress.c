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

/* Draws "label [=====     ] done/total <what>" when enabled and due. */
static void draw(kvp_progress *progress, size_t done, size_t total, const char *what, size_t step,
                 int with_step)
{
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
    if (with_step) {
        fprintf(stderr, "\r%s [%s] %zu/%zu %s (step %zu)", progress->label, bar, done, total,
                what, step);
    } else {
        fprintf(stderr, "\r\033[K%s [%s] %zu/%zu %s", progress->label, bar, done, total, what);
    }
    fflush(stderr);
}

void kvp_progress_update(void *arg, size_t done, size_t total, size_t step)
{
    draw(arg, done, total, "requests", step, 1);
}

void kvp_progress_note(kvp_progress *progress, size_t done, size_t total, const char *what)
{
    draw(progress, done, total, what, 0, 0);
}

void kvp_progress_finish(kvp_progress *progress)
{
    if (progress->enabled) {
        fprintf(stderr, "\r\033[K");
        fflush(stderr);
    }
}
