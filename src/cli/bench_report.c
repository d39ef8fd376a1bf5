/*
 * bench_report.c: what `kvpager bench` prints: the tables, the --json
 * object and the --plot SVG, from the results bench.c gathered.
 *
 * Owns: the layout of every figure, and the summaries computed from the rows
 * (the 2-thread speedups). "% read" appears only for DRAM-resident rows
 * (bench_dram_resident); a cache-resident row's percentage of a read of its
 * own size is shown in parentheses, never as "% of read".
 * Callers: bench.c (bench.h).
 */
#include <math.h>
#include <stdio.h>

#include "alloc.h"
#include "bench.h"
#include "cli.h"
#include "json.h"
#include "plot.h"

static const char *accum_name(kvp_accum accum)
{
    return accum == KVP_ACCUM_FAST ? "fast" : "exact";
}

/*
 * 2 threads against 1: the median over the grid's (shape, block) pairs of
 * paged time on 1 thread / on 2, among the pairs `keep` accepts (NULL: all);
 * *count gets how many. Rows come in pairs, threads 1 then 2.
 */
static double two_thread_speedup(const bench_results *r, int (*keep)(const bench_row *),
                                 size_t *count)
{
    double *ratios = kvp_cli_alloc(r->row_count / 2 + 1, sizeof *ratios);
    size_t n = 0;
    for (size_t i = 0; ratios != NULL && i + 1 < r->row_count; i += 2) {
        const bench_row *one = &r->rows[i];
        if (keep == NULL || keep(one)) {
            ratios[n++] = one->paged_ns / r->rows[i + 1].paged_ns;
        }
    }
    double median = n > 0 ? kvp_measure_median(ratios, n) : 0.0;
    kvp_cli_free(ratios);
    *count = n;
    return median;
}

/* The two-thread targets: B = 8, and B = 1 at L >= 2048. */
static int batch8(const bench_row *g)
{
    return g->s.batch == 8;
}

static int batch1_long(const bench_row *g)
{
    return g->s.batch == 1 && g->s.len >= 2048;
}

static void print_row(const bench_row *g)
{
    char buf[32];
    char percent[16] = "      -";
    char read[16] = "     -";
    if (g->threads == 1) {
        snprintf(read, sizeof read, "%6.2f", g->read_gbps);
        snprintf(percent, sizeof percent, g->dram ? "%6.1f " : "(%5.1f)",
                 g->percent_of_size_read);
    }
    printf("%-5s %-5s %5zu %3zu %3zu %3zu %4zu %4zu %6zu %10s %11.0f %11.0f %5.3f %7.2f %s "
           "%s%s\n",
           kvp_dtype_name(g->s.dtype), accum_name(g->s.accum), g->block_tokens, g->threads,
           g->s.batch, g->s.heads, g->s.kv_heads, g->s.width, g->s.len,
           kvp_cli_format_bytes(bench_kv_bytes(&g->s), buf, sizeof buf), g->paged_ns,
           g->contiguous_ns, g->paged_ns / g->contiguous_ns, g->gbps, read, percent,
           g->identical ? "" : "  RESULTS DIFFER");
}

static void print_skipped(const bench_options *o, const bench_results *r)
{
    char buf[32];
    if (r->skip_count == 0) {
        return;
    }
    printf("\nskipped, K+V above the %s cap (--max-bytes):",
           kvp_cli_format_bytes(o->max_bytes, buf, sizeof buf));
    for (size_t i = 0; i < r->skip_count; i++) {
        const bench_skipped *s = &r->skips[i];
        printf("%s %s/%s B=%zu H=%zu kv_H=%zu d_h=%zu L=%zu (%s)", i % 3 == 0 ? "\n " : ",",
               kvp_dtype_name(s->s.dtype), accum_name(s->s.accum), s->s.batch, s->s.heads,
               s->s.kv_heads, s->s.width, s->s.len,
               kvp_cli_format_bytes(s->bytes, buf, sizeof buf));
    }
    printf("\n");
}

static void print_two_threads(const bench_results *r)
{
    size_t counts[3] = {0, 0, 0};
    const double medians[3] = {two_thread_speedup(r, NULL, &counts[0]),
                               two_thread_speedup(r, batch8, &counts[1]),
                               two_thread_speedup(r, batch1_long, &counts[2])};
    char shown[3][32];
    for (int i = 0; i < 3; i++) {
        if (counts[i] > 0) {
            snprintf(shown[i], sizeof shown[i], "%.2fx over %zu", medians[i], counts[i]);
        } else {
            snprintf(shown[i], sizeof shown[i], "none measured");
        }
    }
    printf("\n2 threads against 1 (paged time on 1 / on 2, median): %s rows;\n"
           "  B = 8: %s; B = 1 at L >= 2048: %s\n",
           shown[0], shown[1], shown[2]);
}

static void print_pages_and_simulate(const bench_options *o, const bench_results *r)
{
    char buf[32];
    const double *p = r->page_ns;
    printf("\npage acquire + release (%s pages)   kvpager  jemalloc     glibc\n",
           kvp_cli_format_bytes(r->page_bytes, buf, sizeof buf));
    printf("  kvpager: kvp_cache_reserve_rows of 1 or 64 blocks on an external cache, then\n"
           "  kvp_cache_discard_rows (the pages taken and put back, tentative); the peers\n"
           "  allocate and free as many objects of the page's size\n");
    printf("  one page, ns                      %8.1f  %8.1f  %8.1f\n", p[0], p[1], p[2]);
    printf("  a batch of 64, ns                 %8.1f  %8.1f  %8.1f\n", p[3], p[4], p[5]);
    printf("  peer time / kvpager time: one page %.2fx jemalloc, %.2fx glibc; batch of 64\n"
           "  %.2fx jemalloc, %.2fx glibc\n",
           p[1] / p[0], p[2] / p[0], p[4] / p[3], p[5] / p[3]);
    size_t runs = o->repetitions < BENCH_SIM_REPETITIONS ? o->repetitions
                                                         : (size_t)BENCH_SIM_REPETITIONS;
    printf("\nsimulate (default model, sharegpt, %zu requests, %zu thread%s, median of %zu runs)\n"
           "  %.0f tokens/s; bound %.0f tokens/s: %.1f%% of the bound.\n"
           "  The bound: over its %zu steps, the K+V each step reads (the pages held less\n"
           "  the internal fragmentation; %.1f MiB a step on average, %.1f KiB per generated\n"
           "  token) at the read bandwidth of that size (best of 1 and 2 threads, %zu sizes\n"
           "  from 64 KiB, measured after each run)\n",
           r->sim_requests, r->sim_threads, r->sim_threads == 1 ? "" : "s", runs,
           r->sim_tokens_per_second, r->sim_bound,
           100.0 * r->sim_tokens_per_second / r->sim_bound, r->sim_steps,
           r->sim_mean_step_bytes / 1048576.0, r->sim_bytes_per_token / 1024.0, r->sim_sizes);
}

void bench_print_tables(const bench_options *o, const bench_results *r)
{
    char buf[32];
    char thp[32];
    printf("kvpager bench: read kernels up to %s (this CPU's best, or KVP_ISA's); medians of\n"
           "%zu alternating repetitions%s\n\n",
           bench_read_isa(), o->repetitions, o->quick ? " (--quick grid)" : "");
    size_t used[BENCH_READ_KERNELS];
    size_t n = bench_read_kernels(used, BENCH_READ_KERNELS);
    char names[128] = "";
    for (size_t i = 0, at = 0; i < n && at < sizeof names; i++) {
        int w = snprintf(names + at, sizeof names - at, "%s%s", i == 0 ? "" : ", ",
                         bench_read_kernel_name(used[i]));
        at += w > 0 ? (size_t)w : 0;
    }
    printf("read bandwidth: the best of the read loops %s,\n"
           "over a %s array advised for huge pages as the pool's slab (%s; THP mode %s)\n"
           "  %.2f GB/s on 1 thread (%s), %.2f GB/s on 2 threads (%s; halves read at once)\n\n",
           names, kvp_cli_format_bytes(r->reader.bytes, buf, sizeof buf),
           r->reader.advised ? "accepted" : "not applied", bench_thp_mode(thp, sizeof thp),
           r->read_gbps, bench_read_kernel_name(r->read_kernel), r->read_gbps_two,
           bench_read_kernel_name(r->read_kernel_two));
    printf("gather: kvp_paged_attention, the public call (scores + softmax + values over\n"
           "every lane's retained rows and a candidate, the loops kvp_attention_prepare\n"
           "runs) at the accumulation level shown; paged (pages shuffled) against\n"
           "contiguous (the same pages, each lane's adjacent and in order), on 1 thread and\n"
           "on a decoder of 2 (thr); p/c = paged / contiguous time; GB/s = K+V bytes as\n"
           "stored / paged time; read = the best read loop over the same size on 1 thread,\n"
           "alternating with the gathers; %% read = GB/s / read for DRAM-resident shapes\n"
           "(K+V >= 256 MiB); in parentheses for cache-resident ones, whose own-size read\n"
           "is a cache read\n\n");
    printf("dtype accum block thr   B   H kv_H  d_h    len        K+V    paged ns   contig ns"
           "   p/c    GB/s   read  %% read\n");
    for (size_t i = 0; i < r->row_count; i++) {
        print_row(&r->rows[i]);
    }
    print_skipped(o, r);
    print_two_threads(r);
    print_pages_and_simulate(o, r);
}

void bench_print_json(const bench_options *o, const bench_results *r)
{
    kvp_json json;
    kvp_json_init(&json, stdout);
    kvp_json_object_begin(&json, NULL);
    kvp_json_string(&json, "isa", bench_read_isa());
    kvp_json_bool(&json, "read_huge_pages_advised", r->reader.advised);
    kvp_json_string(&json, "read_kernel", bench_read_kernel_name(r->read_kernel));
    kvp_json_uint(&json, "repetitions", o->repetitions);
    kvp_json_uint(&json, "read_bytes", r->reader.bytes);
    kvp_json_double(&json, "read_gbps", r->read_gbps);
    kvp_json_double(&json, "read_gbps_2_threads", r->read_gbps_two);
    kvp_json_uint(&json, "max_bytes", o->max_bytes);
    kvp_json_uint(&json, "dram_bytes", BENCH_DRAM_BYTES);
    kvp_json_array_begin(&json, "gather");
    for (size_t i = 0; i < r->row_count; i++) {
        const bench_row *g = &r->rows[i];
        kvp_json_object_begin(&json, NULL);
        kvp_json_string(&json, "dtype", kvp_dtype_name(g->s.dtype));
        kvp_json_string(&json, "accum", accum_name(g->s.accum));
        kvp_json_uint(&json, "block_tokens", g->block_tokens);
        kvp_json_uint(&json, "batch", g->s.batch);
        kvp_json_uint(&json, "heads", g->s.heads);
        kvp_json_uint(&json, "kv_heads", g->s.kv_heads);
        kvp_json_uint(&json, "head_width", g->s.width);
        kvp_json_uint(&json, "len", g->s.len);
        kvp_json_uint(&json, "threads", g->threads);
        kvp_json_uint(&json, "kv_bytes", bench_kv_bytes(&g->s));
        kvp_json_double(&json, "paged_ns", g->paged_ns);
        kvp_json_double(&json, "contiguous_ns", g->contiguous_ns);
        kvp_json_double(&json, "gbps", g->gbps);
        kvp_json_bool(&json, "dram", g->dram);
        kvp_json_double(&json, "read_gbps", g->read_gbps);
        kvp_json_string(&json, "read_kernel",
                        g->threads == 1 ? bench_read_kernel_name(g->read_kernel) : "");
        kvp_json_double(&json, "percent_of_read", g->percent_of_read);
        kvp_json_double(&json, "percent_of_size_read", g->percent_of_size_read);
        kvp_json_bool(&json, "identical", g->identical);
        kvp_json_object_end(&json);
    }
    kvp_json_array_end(&json);
    kvp_json_array_begin(&json, "skipped");
    for (size_t i = 0; i < r->skip_count; i++) {
        const bench_skipped *s = &r->skips[i];
        kvp_json_object_begin(&json, NULL);
        kvp_json_string(&json, "dtype", kvp_dtype_name(s->s.dtype));
        kvp_json_string(&json, "accum", accum_name(s->s.accum));
        kvp_json_uint(&json, "batch", s->s.batch);
        kvp_json_uint(&json, "heads", s->s.heads);
        kvp_json_uint(&json, "kv_heads", s->s.kv_heads);
        kvp_json_uint(&json, "head_width", s->s.width);
        kvp_json_uint(&json, "len", s->s.len);
        kvp_json_uint(&json, "kv_bytes", s->bytes);
        kvp_json_object_end(&json);
    }
    kvp_json_array_end(&json);
    kvp_json_object_begin(&json, "page_ops");
    kvp_json_uint(&json, "page_bytes", r->page_bytes);
    kvp_json_double(&json, "kvpager_ns", r->page_ns[0]);
    kvp_json_double(&json, "jemalloc_ns", r->page_ns[1]);
    kvp_json_double(&json, "glibc_ns", r->page_ns[2]);
    kvp_json_double(&json, "batch64_kvpager_ns", r->page_ns[3]);
    kvp_json_double(&json, "batch64_jemalloc_ns", r->page_ns[4]);
    kvp_json_double(&json, "batch64_glibc_ns", r->page_ns[5]);
    kvp_json_object_end(&json);
    kvp_json_object_begin(&json, "simulate");
    kvp_json_uint(&json, "requests", r->sim_requests);
    kvp_json_uint(&json, "threads", r->sim_threads);
    kvp_json_double(&json, "tokens_per_second", r->sim_tokens_per_second);
    kvp_json_double(&json, "bytes_per_token", r->sim_bytes_per_token);
    kvp_json_double(&json, "bound_tokens_per_second", r->sim_bound);
    kvp_json_uint(&json, "steps", r->sim_steps);
    kvp_json_double(&json, "mean_step_bytes", r->sim_mean_step_bytes);
    kvp_json_object_end(&json);
    size_t n = 0;
    kvp_json_object_begin(&json, "two_threads"); /* paged time on 1 thread / on 2, medians */
    kvp_json_double(&json, "speedup", two_thread_speedup(r, NULL, &n));
    kvp_json_uint(&json, "rows", n);
    kvp_json_double(&json, "batch8_speedup", two_thread_speedup(r, batch8, &n));
    kvp_json_uint(&json, "batch8_rows", n);
    kvp_json_double(&json, "batch1_len2048_speedup", two_thread_speedup(r, batch1_long, &n));
    kvp_json_uint(&json, "batch1_len2048_rows", n);
    kvp_json_object_end(&json);
    kvp_json_array_begin(&json, "not_available"); /* nothing of the grid is missing */
    kvp_json_array_end(&json);
    kvp_json_object_end(&json);
    fputc('\n', stdout);
}

/* The plot's block_tokens: 16 when measured, else the largest measured. */
static size_t plot_block(const bench_results *r)
{
    size_t best = 0;
    for (size_t i = 0; i < r->row_count; i++) {
        size_t b = r->rows[i].block_tokens;
        if (b == 16) {
            return 16;
        }
        best = b > best ? b : best;
    }
    return best;
}

#define PW 960.0
#define PH 480.0
#define PL 80.0
#define PR 40.0
#define PT 50.0
#define PB 70.0

/* The level plotted for a dtype: fast when measured for it (narrow dtypes), else exact. */
static kvp_accum plot_accum(const bench_options *o, kvp_dtype dtype)
{
    for (size_t i = 0; i < o->accums.count && dtype != KVP_F64; i++) {
        if (o->accums.value[i] == KVP_ACCUM_FAST) {
            return KVP_ACCUM_FAST;
        }
    }
    return KVP_ACCUM_EXACT;
}

/* Per dtype of the grid: the median GB/s at each measured L, and the range to plot. */
typedef struct plot_series {
    double lens[BENCH_MAX_LIST][BENCH_MAX_LIST];
    double gbps[BENCH_MAX_LIST][BENCH_MAX_LIST];
    size_t points[BENCH_MAX_LIST];
    double top; /* the highest GB/s, the read included */
    double lo;  /* log2 of the shortest and longest L measured */
    double hi;
} plot_series;

/* The axes: log2 L from lo to hi across w, GB/s from 0 to top (ticks every step) down h. */
typedef struct plot_frame {
    double lo;
    double hi;
    double top;
    double step;
    double w;
    double h;
} plot_frame;

/* The median GB/s of the one-thread rows of (L, dtype) at `block` and the dtype's level. */
static size_t plot_point(const bench_options *o, const bench_results *r, size_t block,
                         size_t k, size_t l, double *median)
{
    double values[64];
    kvp_accum accum = plot_accum(o, (kvp_dtype)o->dtypes.value[k]);
    size_t n = 0;
    for (size_t i = 0; i < r->row_count && n < 64; i++) {
        const bench_row *g = &r->rows[i];
        if (g->s.len == o->lens.value[l] && g->block_tokens == block && g->threads == 1 &&
            g->s.dtype == (kvp_dtype)o->dtypes.value[k] && g->s.accum == accum) {
            values[n++] = g->gbps;
        }
    }
    if (n > 0) {
        *median = kvp_measure_median(values, n);
    }
    return n;
}

/* Step 1: the series of every dtype, and the range they span. */
static void plot_collect(const bench_options *o, const bench_results *r, size_t block,
                         plot_series *s)
{
    s->top = r->read_gbps;
    s->lo = INFINITY;
    s->hi = -INFINITY;
    for (size_t k = 0; k < o->dtypes.count; k++) {
        s->points[k] = 0;
        for (size_t l = 0; l < o->lens.count; l++) {
            double y = 0.0;
            if (plot_point(o, r, block, k, l, &y) == 0) {
                continue;
            }
            double x = (double)o->lens.value[l];
            s->lens[k][s->points[k]] = x;
            s->gbps[k][s->points[k]++] = y;
            s->top = y > s->top ? y : s->top;
            s->lo = log2(x) < s->lo ? log2(x) : s->lo;
            s->hi = log2(x) > s->hi ? log2(x) : s->hi;
        }
    }
}

/* Step 2: the frame around the series: round ticks, at least one octave wide. */
static plot_frame plot_fit(const plot_series *s)
{
    plot_frame f = {s->lo, s->hi, s->top, 0.0, PW - PL - PR, PH - PT - PB};
    if (!(f.lo <= f.hi)) { /* nothing measured: an empty frame around L = 1 */
        f.lo = 0.0;
        f.hi = 0.0;
    }
    f.step = kvp_plot_tick_step(f.top);
    f.top = ceil(f.top / f.step) * f.step;
    if (f.hi - f.lo < 1.0) {
        f.lo -= 0.5;
        f.hi += 0.5;
    }
    return f;
}

static double x_of(const plot_frame *f, double len)
{
    return PL + (log2(len) - f->lo) / (f->hi - f->lo) * f->w;
}

static double y_of(const plot_frame *f, double v)
{
    return PT + f->h - v / f->top * f->h;
}

/* Step 3: the title, the GB/s and L ticks, the frame and the dashed read line. */
static void plot_axes(FILE *out, const bench_options *o, const bench_results *r, size_t block,
                      const plot_frame *f)
{
    fprintf(out,
            "<text x=\"%.1f\" y=\"28\" font-size=\"16\" text-anchor=\"middle\">kvpager bench: "
            "paged gather GB/s against L (block_tokens %zu, median over shapes)</text>\n",
            PW / 2.0, block);
    for (double v = 0.0; v <= f->top + 0.5 * f->step; v += f->step) {
        fprintf(out,
                "<text class=\"tick-left\" x=\"%.1f\" y=\"%.1f\" font-size=\"12\" "
                "text-anchor=\"end\">%g</text>\n<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" "
                "y2=\"%.1f\" stroke=\"#ddd\"/>\n",
                PL - 8.0, y_of(f, v) + 4.0, v, PL, y_of(f, v), PW - PR, y_of(f, v));
    }
    for (size_t l = 0; l < o->lens.count; l++) {
        double x = (double)o->lens.value[l];
        if (log2(x) >= f->lo && log2(x) <= f->hi) {
            fprintf(out,
                    "<text class=\"tick-x\" x=\"%.1f\" y=\"%.1f\" font-size=\"12\" "
                    "text-anchor=\"middle\">%.0f</text>\n",
                    x_of(f, x), PT + f->h + 20.0, x);
        }
    }
    fprintf(out,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
            "stroke=\"#333\"/>\n<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
            "stroke=\"#d62728\" stroke-dasharray=\"6 4\"/>\n<text x=\"%.1f\" y=\"%.1f\" "
            "font-size=\"12\" fill=\"#d62728\" text-anchor=\"end\">read bandwidth, 1 thread "
            "(%.2f GB/s)</text>\n",
            PL, PT, f->w, f->h, PL, y_of(f, r->read_gbps), PW - PR, y_of(f, r->read_gbps),
            PW - PR - 4.0, y_of(f, r->read_gbps) - 6.0, r->read_gbps);
}

/* Step 4: one polyline and label per dtype. */
static void plot_lines(FILE *out, const bench_options *o, const plot_series *s,
                       const plot_frame *f)
{
    static const char *const colors[6] = {"#1f77b4", "#2ca02c", "#9467bd",
                                          "#ff7f0e", "#8c564b", "#17becf"};
    for (size_t k = 0; k < o->dtypes.count; k++) {
        const char *name = kvp_dtype_name((kvp_dtype)o->dtypes.value[k]);
        fprintf(out, "<polyline class=\"dtype-%s\" fill=\"none\" stroke=\"%s\" "
                     "stroke-width=\"2\" points=\"",
                name, colors[k % 6]);
        for (size_t i = 0; i < s->points[k]; i++) {
            fprintf(out, "%.1f,%.1f ", x_of(f, s->lens[k][i]), y_of(f, s->gbps[k][i]));
        }
        fprintf(out, "\"/>\n<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" fill=\"%s\">%s"
                     "</text>\n",
                PL + 8.0, PT + 16.0 + 16.0 * (double)k, colors[k % 6], name);
    }
}

/*
 * GB/s against L (log scale, one tick per measured length): for each dtype
 * present, the median GB/s over the shapes at the plotted block_tokens and
 * accumulation level (plot_accum); the one-thread whole-array read dashed.
 */
int bench_write_plot(const bench_options *o, const bench_results *r, kvp_plot *plot)
{
    FILE *out = plot->out;
    size_t block = plot_block(r);
    plot_series s;
    plot_collect(o, r, block, &s);
    plot_frame f = plot_fit(&s);
    plot_axes(out, o, r, block, &f);
    plot_lines(out, o, &s, &f);
    fprintf(out,
            "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\">retained "
            "positions L (log scale)</text>\n<text x=\"18\" y=\"%.1f\" font-size=\"13\" "
            "transform=\"rotate(-90 18 %.1f)\" text-anchor=\"middle\">GB/s (K+V bytes / paged "
            "time)</text>\n",
            PL + f.w / 2.0, PH - 18.0, PT + f.h / 2.0, PT + f.h / 2.0);
    return kvp_plot_close(plot);
}

