/*
 * plot.h: an SVG chart of a simulation, drawn by the program itself: pages
 * in use (left axis) and running sequences (right axis) over the scheduler
 * steps.
 */
#ifndef KVPAGER_CLI_PLOT_H
#define KVPAGER_CLI_PLOT_H

#include "sim.h"

/* Returns 0, or -1 when the file cannot be written. */
int kvp_plot_write_svg(const char *path, const kvp_sim_result *result, const char *title);

#endif /* KVPAGER_CLI_PLOT_H */
