/*
 * plot.h: an SVG chart of a simulation, drawn by the program itself: pages
 * in use, cached pages (the prefix index's, held or evictable) and evictable
 * pages (left axis) and running sequences (right axis) over the scheduler
 * steps (x axis), with a legend naming every series; a sharing workload's
 * run without sharing is drawn too, dashed (its held pages and running
 * sequences). Every axis is labelled at round steps (1, 2 or 5 x 10^k,
 * never below 1, since all three count whole things), from 0 to the first
 * such multiple at or above the axis's largest value. Tick labels carry
 * class="tick-x", "tick-left" or "tick-right" so tests can read them.
 *
 * The file is opened, and the SVG's fixed opening written and flushed,
 * before the run (kvp_plot_open), so a path that cannot be written (missing
 * directory, a directory, no permission, a full device such as /dev/full) is
 * refused before any work. Write errors after that are still reported, with
 * their strerror, by kvp_plot_finish.
 * Callers: simulate.c and the CLI tests.
 */
#ifndef KVPAGER_CLI_PLOT_H
#define KVPAGER_CLI_PLOT_H

#include <stdio.h>

#include "sim.h"

typedef struct kvp_plot {
    FILE *out;
    char *buffer;     /* stdio buffer, from the program's allocation hook */
    int regular;      /* the path is a regular file (removed if the run fails) */
    const char *path;
} kvp_plot;

/*
 * Opens `path` for writing and writes the SVG's opening. Returns 0, an errno
 * value when the path cannot be opened or written (nothing is left open;
 * a regular file that was created is removed), or -1 when out of memory.
 */
int kvp_plot_open(kvp_plot *plot, const char *path);

/*
 * Writes the chart and closes the file: 0, or an errno value (the file is
 * closed either way). `off`, when not NULL, is the run without sharing of
 * the same workload: its held pages and running sequences are drawn dashed
 * on the same axes (which then cover both runs), and the legend says so.
 */
int kvp_plot_finish(kvp_plot *plot, const kvp_sim_result *result, const kvp_sim_result *off,
                    const char *title);

/*
 * Writes the SVG's closing tag and closes the file: 0, or an errno value (the
 * file is closed either way). For other charts (bench.c) drawn into plot->out.
 */
int kvp_plot_close(kvp_plot *plot);

/* Closes the file and removes it if it is a regular file: the run produced no chart. */
void kvp_plot_abandon(kvp_plot *plot);

/* The round tick step for an axis from 0 to `max` with about five ticks (>= 1). */
double kvp_plot_tick_step(double max);

#endif /* KVPAGER_CLI_PLOT_H */
