/*
 * plot.c: the SVG chart (see plot.h). Long runs are drawn from at most
 * MAX_POINTS evenly spaced steps, keeping each bucket's maximum so peaks stay
 * visible.
 */
#include "plot.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"

#define WIDTH 960.0
#define HEIGHT 480.0
#define LEFT 80.0
#define RIGHT 80.0
#define TOP 50.0
#define BOTTOM 70.0
#define MAX_POINTS 1200
#define PLOT_W (WIDTH - LEFT - RIGHT)
#define PLOT_H (HEIGHT - TOP - BOTTOM)
#define BUFFER_BYTES 8192

double kvp_plot_tick_step(double max)
{
    double raw = max / 5.0;
    if (!(raw > 1.0)) {
        return 1.0;
    }
    double magnitude = pow(10.0, floor(log10(raw)));
    static const double factors[] = {1.0, 2.0, 5.0, 10.0};
    size_t i = 0;
    while (factors[i] * magnitude < raw) {
        i++;
    }
    return factors[i] * magnitude;
}

/* An axis from 0 to `top`, a whole number of `step`s. */
typedef struct axis {
    double step;
    double top;
} axis;

static axis axis_for(double max)
{
    axis a;
    a.step = kvp_plot_tick_step(max);
    a.top = ceil(max / a.step) * a.step;
    if (a.top < a.step) {
        a.top = a.step;
    }
    return a;
}

/* What a series draws: each one a field of kvp_sim_sample. */
enum { SERIES_HELD, SERIES_RUNNING, SERIES_CACHED, SERIES_EVICTABLE };

static double sample_value(const kvp_sim_result *r, size_t i, int which)
{
    const kvp_sim_sample *s = &r->samples[i];
    switch (which) {
    case SERIES_HELD: return (double)s->held_pages;
    case SERIES_CACHED: return (double)s->cached_pages;
    case SERIES_EVICTABLE: return (double)s->evictable_pages;
    default: return (double)s->running;
    }
}

/* A series' polyline; the run without sharing (dashed) gets class "<name>-no-sharing". */
static void series(FILE *out, const kvp_sim_result *r, int which, axis x, axis y,
                   const char *color, int dashed)
{
    static const char *const classes[] = {"held", "running", "cached", "evictable"};
    size_t steps = r->steps;
    size_t buckets = steps < MAX_POINTS ? steps : MAX_POINTS;
    fprintf(out,
            "<polyline class=\"series-%s%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\"%s "
            "points=\"",
            classes[which], dashed ? "-no-sharing" : "", color,
            dashed ? " stroke-dasharray=\"5 3\" stroke-opacity=\"0.7\"" : "");
    for (size_t b = 0; b < buckets; b++) {
        size_t first = b * steps / buckets;
        size_t last = (b + 1) * steps / buckets;
        double value = 0.0;
        for (size_t i = first; i < last; i++) {
            double v = sample_value(r, i, which);
            value = v > value ? v : value;
        }
        double px = LEFT + (double)first / x.top * PLOT_W;
        double py = TOP + PLOT_H - value / y.top * PLOT_H;
        fprintf(out, "%.1f,%.1f ", px, py);
    }
    fprintf(out, "\"/>\n");
}

/* Labels (and, for the left axis, grid lines) at every step of a vertical axis. */
static void y_ticks(FILE *out, axis a, double x, const char *side, const char *color)
{
    int left = side[0] == 'l';
    for (double value = 0.0; value <= a.top + 0.5 * a.step; value += a.step) {
        double y = TOP + PLOT_H - value / a.top * PLOT_H;
        fprintf(out,
                "<text class=\"tick-%s\" x=\"%.1f\" y=\"%.1f\" font-size=\"12\" "
                "text-anchor=\"%s\" fill=\"%s\">%.0f</text>\n",
                side, x, y + 4.0, left ? "end" : "start", color, value);
        if (left) {
            fprintf(out,
                    "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n",
                    LEFT, y, WIDTH - RIGHT, y);
        }
    }
}

static void x_ticks(FILE *out, axis a)
{
    for (double value = 0.0; value <= a.top + 0.5 * a.step; value += a.step) {
        double x = LEFT + value / a.top * PLOT_W;
        fprintf(out,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>\n"
                "<text class=\"tick-x\" x=\"%.1f\" y=\"%.1f\" font-size=\"12\" "
                "text-anchor=\"middle\">%.0f</text>\n",
                x, TOP + PLOT_H, x, TOP + PLOT_H + 5.0, x, TOP + PLOT_H + 20.0, value);
    }
}

static void write_title(FILE *out, const char *title)
{
    fprintf(out, "<text x=\"%.1f\" y=\"28\" font-size=\"16\" text-anchor=\"middle\">",
            WIDTH / 2.0);
    for (const char *p = title; *p != '\0'; p++) {
        if (*p == '<' || *p == '>' || *p == '&') {
            fputs(*p == '<' ? "&lt;" : *p == '>' ? "&gt;" : "&amp;", out);
        } else {
            fputc(*p, out);
        }
    }
    fprintf(out, "</text>\n");
}

static void close_plot(kvp_plot *plot)
{
    if (plot->out != NULL) {
        (void)fclose(plot->out);
    }
    kvp_cli_free(plot->buffer);
    plot->out = NULL;
    plot->buffer = NULL;
}

void kvp_plot_abandon(kvp_plot *plot)
{
    close_plot(plot);
    if (plot->regular) {
        (void)unlink(plot->path);
    }
    plot->regular = 0;
}

int kvp_plot_open(kvp_plot *plot, const char *path)
{
    plot->out = NULL;
    plot->regular = 0;
    plot->path = path;
    plot->buffer = kvp_cli_alloc(BUFFER_BYTES, 1);
    if (plot->buffer == NULL) {
        return -1;
    }
    plot->out = fopen(path, "w");
    if (plot->out == NULL) {
        int error = errno;
        close_plot(plot);
        return error;
    }
    struct stat st;
    plot->regular = fstat(fileno(plot->out), &st) == 0 && S_ISREG(st.st_mode);
    errno = 0;
    if (setvbuf(plot->out, plot->buffer, _IOFBF, BUFFER_BYTES) != 0 ||
        fprintf(plot->out,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\">\n"
                "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                WIDTH, HEIGHT, WIDTH, HEIGHT) < 0 ||
        fflush(plot->out) != 0) {
        int error = errno != 0 ? errno : EIO;
        kvp_plot_abandon(plot);
        return error;
    }
    return 0;
}

/* The largest pages and running sequences of a run's steps, into *pages and *running. */
static void maxima(const kvp_sim_result *r, double *pages, double *running)
{
    for (size_t i = 0; i < r->steps; i++) {
        *pages = r->samples[i].held_pages > *pages ? r->samples[i].held_pages : *pages;
        *pages = r->samples[i].cached_pages > *pages ? r->samples[i].cached_pages : *pages;
        *running = r->samples[i].running > *running ? r->samples[i].running : *running;
    }
}

/* The legend, above the plot's top: each series' color and name, dashed for the
 * run without sharing. */
static void legend(FILE *out, int with_off)
{
    static const char *const names[] = {"held", "cached (held or evictable)", "evictable",
                                        "running sequences (right)", "dashed: --no-sharing run"};
    static const char *const colors[] = {"#1f77b4", "#2ca02c", "#ff7f0e", "#d62728", "#555"};
    double lx = LEFT;
    const double ly = TOP - 8.0;
    for (size_t i = 0; i < 4 + (size_t)with_off; i++) {
        double wide = 44.0 + 6.5 * (double)strlen(names[i]); /* one row: 792 of 800 wide */
        fprintf(out,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                "stroke-width=\"2\"%s/>\n"
                "<text class=\"legend\" x=\"%.1f\" y=\"%.1f\" font-size=\"12\" "
                "fill=\"%s\">%s</text>\n",
                lx, ly, lx + 16.0, ly, colors[i], i == 4 ? " stroke-dasharray=\"5 3\"" : "",
                lx + 20.0, ly + 4.0, colors[i], names[i]);
        lx += wide;
    }
}

int kvp_plot_finish(kvp_plot *plot, const kvp_sim_result *r, const kvp_sim_result *off,
                    const char *title)
{
    FILE *out = plot->out;
    double max_pages = (double)r->total_pages;
    double max_running = 1.0;
    maxima(r, &max_pages, &max_running);
    size_t steps = r->steps;
    if (off != NULL) {
        maxima(off, &max_pages, &max_running);
        steps = off->steps > steps ? off->steps : steps;
    }
    axis x = axis_for(steps > 1 ? (double)(steps - 1) : 1.0);
    axis pages = axis_for(max_pages > 1.0 ? max_pages : 1.0);
    axis running = axis_for(max_running);
    write_title(out, title);
    y_ticks(out, pages, LEFT - 8.0, "left", "#1f77b4");
    y_ticks(out, running, WIDTH - RIGHT + 8.0, "right", "#d62728");
    x_ticks(out, x);
    fprintf(out,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
            "stroke=\"#333\"/>\n",
            LEFT, TOP, PLOT_W, PLOT_H);
    if (r->total_pages > 0) {
        double y = TOP + PLOT_H - (double)r->total_pages / pages.top * PLOT_H;
        fprintf(out,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#1f77b4\" "
                "stroke-dasharray=\"6 4\"/>\n",
                LEFT, y, WIDTH - RIGHT, y);
    }
    if (off != NULL && off->steps > 0) {
        series(out, off, SERIES_HELD, x, pages, "#1f77b4", 1);
        series(out, off, SERIES_RUNNING, x, running, "#d62728", 1);
    }
    if (r->steps > 0) {
        series(out, r, SERIES_HELD, x, pages, "#1f77b4", 0);
        series(out, r, SERIES_CACHED, x, pages, "#2ca02c", 0);
        series(out, r, SERIES_EVICTABLE, x, pages, "#ff7f0e", 0);
        series(out, r, SERIES_RUNNING, x, running, "#d62728", 0);
    }
    legend(out, off != NULL);
    if (off != NULL) {
        fprintf(out,
                "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\">scheduler "
                "step (%zu steps; --no-sharing: %zu)</text>\n",
                LEFT + PLOT_W / 2.0, HEIGHT - 18.0, r->steps, off->steps);
    } else {
        fprintf(out,
                "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\">scheduler "
                "step (%zu steps)</text>\n",
                LEFT + PLOT_W / 2.0, HEIGHT - 18.0, r->steps);
    }
    fprintf(out,
            "<text x=\"18\" y=\"%.1f\" font-size=\"13\" fill=\"#1f77b4\" "
            "transform=\"rotate(-90 18 %.1f)\" text-anchor=\"middle\">pages (dashed: "
            "all %zu)</text>\n",
            TOP + PLOT_H / 2.0, TOP + PLOT_H / 2.0, r->total_pages);
    fprintf(out,
            "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" fill=\"#d62728\" "
            "transform=\"rotate(90 %.1f %.1f)\" text-anchor=\"middle\">running sequences</text>\n",
            WIDTH - 18.0, TOP + PLOT_H / 2.0, WIDTH - 18.0, TOP + PLOT_H / 2.0);
    return kvp_plot_close(plot);
}

int kvp_plot_close(kvp_plot *plot)
{
    FILE *out = plot->out;
    fprintf(out, "</svg>\n");
    errno = 0;
    int failed = fflush(out) != 0 || ferror(out);
    int error = failed ? (errno != 0 ? errno : EIO) : 0;
    if (fclose(out) != 0 && error == 0) {
        error = errno != 0 ? errno : EIO;
    }
    plot->out = NULL;
    kvp_cli_free(plot->buffer);
    plot->buffer = NULL;
    return error;
}
