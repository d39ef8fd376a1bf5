/*
 * plot.c: the SVG chart (see plot.h). Long runs are drawn from at most
 * MAX_POINTS evenly spaced steps, keeping each bucket's maximum so peaks stay
 * visible.
 */
#include "plot.h"

#include <stdio.h>

#define WIDTH 960.0
#define HEIGHT 480.0
#define LEFT 80.0
#define RIGHT 80.0
#define TOP 50.0
#define BOTTOM 60.0
#define MAX_POINTS 1200

static double nice_max(double value)
{
    double step = 1.0;
    while (step * 10.0 <= value) {
        step *= 10.0;
    }
    double top = step;
    while (top < value) {
        top += step / 2.0 > 1.0 ? step / 2.0 : 1.0;
    }
    return top > 0.0 ? top : 1.0;
}

static void series(FILE *out, const kvp_sim_result *r, int pages, double ymax, const char *color)
{
    double plot_w = WIDTH - LEFT - RIGHT;
    double plot_h = HEIGHT - TOP - BOTTOM;
    size_t steps = r->steps;
    size_t buckets = steps < MAX_POINTS ? steps : MAX_POINTS;
    fprintf(out, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"", color);
    for (size_t b = 0; b < buckets; b++) {
        size_t first = b * steps / buckets;
        size_t last = (b + 1) * steps / buckets;
        double value = 0.0;
        for (size_t i = first; i < last; i++) {
            double v = pages ? r->samples[i].held_pages : r->samples[i].running;
            value = v > value ? v : value;
        }
        double x = LEFT + (steps > 1 ? (double)first / (double)(steps - 1) : 0.0) * plot_w;
        double y = TOP + plot_h - value / ymax * plot_h;
        fprintf(out, "%.1f,%.1f ", x, y);
    }
    fprintf(out, "\"/>\n");
}

static void ticks(FILE *out, double max, double x, const char *anchor, const char *color)
{
    double plot_h = HEIGHT - TOP - BOTTOM;
    for (int i = 0; i <= 5; i++) {
        double value = max * i / 5.0;
        double y = TOP + plot_h - plot_h * i / 5.0;
        fprintf(out,
                "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" text-anchor=\"%s\" fill=\"%s\">"
                "%.0f</text>\n",
                x, y + 4.0, anchor, color, value);
        if (anchor[0] == 'e') {
            fprintf(out,
                    "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n",
                    LEFT, y, WIDTH - RIGHT, y);
        }
    }
}

int kvp_plot_write_svg(const char *path, const kvp_sim_result *r, const char *title)
{
    FILE *out = fopen(path, "w");
    if (out == NULL) {
        return -1;
    }
    double max_pages = 1.0;
    double max_running = 1.0;
    for (size_t i = 0; i < r->steps; i++) {
        max_pages = r->samples[i].held_pages > max_pages ? r->samples[i].held_pages : max_pages;
        max_running = r->samples[i].running > max_running ? r->samples[i].running : max_running;
    }
    double pages_axis = nice_max(r->total_pages > 0 ? (double)r->total_pages : max_pages);
    double running_axis = nice_max(max_running);
    double plot_w = WIDTH - LEFT - RIGHT;
    double plot_h = HEIGHT - TOP - BOTTOM;
    fprintf(out,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
            "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\">\n"
            "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            WIDTH, HEIGHT, WIDTH, HEIGHT);
    fprintf(out, "<text x=\"%.1f\" y=\"28\" font-size=\"16\" text-anchor=\"middle\">",
            WIDTH / 2.0);
    for (const char *p = title; *p != '\0'; p++) {
        if (*p == '<' || *p == '>' || *p == '&') {
            fprintf(out, "%s", *p == '<' ? "&lt;" : *p == '>' ? "&gt;" : "&amp;");
        } else {
            fputc(*p, out);
        }
    }
    fprintf(out, "</text>\n");
    ticks(out, pages_axis, LEFT - 8.0, "end", "#1f77b4");
    ticks(out, running_axis, WIDTH - RIGHT + 8.0, "start", "#d62728");
    fprintf(out,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
            "stroke=\"#333\"/>\n",
            LEFT, TOP, plot_w, plot_h);
    if (r->total_pages > 0) {
        double y = TOP + plot_h - (double)r->total_pages / pages_axis * plot_h;
        fprintf(out,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#1f77b4\" "
                "stroke-dasharray=\"6 4\"/>\n",
                LEFT, y, WIDTH - RIGHT, y);
    }
    if (r->steps > 0) {
        series(out, r, 1, pages_axis, "#1f77b4");
        series(out, r, 0, running_axis, "#d62728");
    }
    fprintf(out,
            "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\">scheduler step "
            "(%zu steps)</text>\n",
            LEFT + plot_w / 2.0, HEIGHT - 20.0, r->steps);
    fprintf(out,
            "<text x=\"18\" y=\"%.1f\" font-size=\"13\" fill=\"#1f77b4\" "
            "transform=\"rotate(-90 18 %.1f)\" text-anchor=\"middle\">pages in use (dashed: "
            "all %zu)</text>\n",
            TOP + plot_h / 2.0, TOP + plot_h / 2.0, r->total_pages);
    fprintf(out,
            "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" fill=\"#d62728\" "
            "transform=\"rotate(90 %.1f %.1f)\" text-anchor=\"middle\">running sequences</text>\n",
            WIDTH - 18.0, TOP + plot_h / 2.0, WIDTH - 18.0, TOP + plot_h / 2.0);
    fprintf(out, "</svg>\n");
    return fclose(out) == 0 ? 0 : -1;
}
