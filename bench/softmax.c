/*
 * softmax.c: what the softmax and one decode step cost, per ISA level.
 *
 * Times, in alternating repetitions of one run (median nanoseconds):
 *   softmax     kvpi_softmax over `n` scores (1024 and 8192 by default) at
 *               every level this CPU runs, against `libm`: the same stable
 *               softmax written here with the C library's exp and a
 *               left-to-right sum (what kvpi_softmax did before it had its
 *               own exp). Each call first copies the scores into place (the
 *               copy is timed in every variant alike).
 *   decode      one decode step of a layer, model width 512, 8 heads, at
 *               cache length 1024: kvp_attention_prepare then
 *               kvp_ticket_discard (the whole computation of
 *               kvp_attention_forward, without appending the row, so the
 *               length stays 1024), at every level.
 * It uses only kvpi_softmax, the level switch, the public API and
 * bench/args.c (the flags), so the same file builds against an older library
 * for a before/after run. Flags (--help lists them): --repetitions N
 * (default 21), --min-ns NS (default 2e6).
 * Exit status 0, or 1 when the library fails, 2 on usage errors (one line
 * naming the flag and value). Speed is reported, never enforced.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpager/kvpager.h"
#include "args.h"
#include "attention/kernels.h"

#define MAX_VARIANTS 8

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a;
    double y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, size_t n)
{
    qsort(v, n, sizeof *v, by_value);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static double unit(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

/* The softmax before the library had its own exp: libm, summed left to right. */
static void libm_softmax(double *s, size_t n)
{
    double max = s[0];
    for (size_t i = 1; i < n; i++) {
        if (s[i] > max) {
            max = s[i];
        }
    }
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) {
        s[i] = exp(s[i] - max);
        sum += s[i];
    }
    for (size_t i = 0; i < n; i++) {
        s[i] /= sum;
    }
}

/* One timed thing: `run(ctx, variant)` once per call. */
typedef struct bench_case {
    const char *names[MAX_VARIANTS];
    int isa[MAX_VARIANTS]; /* the level to force, or -1 for none */
    size_t variants;
    void (*run)(void *ctx, size_t variant);
    void *ctx;
} bench_case;

/* Median ns per call of each variant, repetitions alternating between variants. */
static void time_case(const bench_case *c, size_t repetitions, double min_ns,
                      double out[MAX_VARIANTS])
{
    double *samples = calloc(repetitions * c->variants, sizeof *samples);
    if (samples == NULL) {
        fprintf(stderr, "bench-softmax: out of memory\n");
        exit(1);
    }
    for (size_t r = 0; r < repetitions; r++) {
        for (size_t v = 0; v < c->variants; v++) {
            if (c->isa[v] >= 0) {
                (void)kvpi_kernels_use((kvpi_isa)c->isa[v]);
            }
            size_t calls = 0;
            double start = now_ns();
            double elapsed = 0.0;
            do {
                c->run(c->ctx, v);
                calls++;
                elapsed = now_ns() - start;
            } while (elapsed < min_ns);
            samples[v * repetitions + r] = elapsed / (double)calls;
        }
    }
    for (size_t v = 0; v < c->variants; v++) {
        out[v] = median(samples + v * repetitions, repetitions);
    }
    free(samples);
}

typedef struct softmax_ctx {
    const double *scores;
    double *work;
    size_t n;
} softmax_ctx;

static void run_softmax(void *p, size_t variant)
{
    softmax_ctx *c = p;
    memcpy(c->work, c->scores, c->n * sizeof *c->work);
    if (variant == 0) {
        libm_softmax(c->work, c->n);
    } else {
        kvpi_softmax(c->work, c->n);
    }
}

typedef struct decode_ctx {
    kvp_layer *layer;
    kvp_cache *cache;
    kvp_ticket *ticket;
    double *input;
    int failed;
} decode_ctx;

static void run_decode(void *p, size_t variant)
{
    (void)variant;
    decode_ctx *c = p;
    kvp_tensor in = kvp_tensor3(c->input, 1, 1, 512);
    kvp_error err;
    if (kvp_attention_prepare(c->layer, &in, c->cache, c->ticket, &err) != KVP_OK) {
        c->failed = 1;
    }
    (void)kvp_ticket_discard(c->ticket, NULL);
}

/* The levels this CPU runs, as variants first .. of c. */
static void add_levels(bench_case *c, const char *prefix)
{
    static char names[KVPI_ISA_COUNT][32];
    for (int isa = 0; isa < KVPI_ISA_COUNT; isa++) {
        if (kvpi_kernels_level((kvpi_isa)isa) != NULL) {
            snprintf(names[isa], sizeof names[isa], "%s%s", prefix, kvpi_isa_name((kvpi_isa)isa));
            c->names[c->variants] = names[isa];
            c->isa[c->variants] = isa;
            c->variants++;
        }
    }
}

static void report(const char *what, const bench_case *c, const double ns[MAX_VARIANTS])
{
    for (size_t v = 0; v < c->variants; v++) {
        printf("%-22s %-14s %12.0f ns  %6.2fx\n", what, c->names[v], ns[v], ns[0] / ns[v]);
    }
}

static void fail(const char *what, const kvp_error *err)
{
    char text[512];
    (void)kvp_error_format(err, text, sizeof text);
    fprintf(stderr, "bench-softmax: %s failed: %s\n", what, text);
}

static int decode_bench(size_t repetitions, double min_ns)
{
    enum { WIDTH = 512, HEADS = 8, LEN = 1024 };
    kvp_error err;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.heads = HEADS;
    config.head_width = WIDTH / HEADS;
    config.budget_bytes = (size_t)32 << 20;
    kvp_pool *pool = NULL;
    decode_ctx c = {NULL, NULL, NULL, NULL, 0};
    kvp_binding binding;
    if (kvp_pool_create(&config, &pool, &err) != KVP_OK ||
        kvp_layer_create_random(WIDTH, HEADS, 2 * LEN, 10000.0, 7, &c.layer, &err) != KVP_OK ||
        kvp_layer_binding_get(c.layer, &binding, &err) != KVP_OK ||
        kvp_cache_create(pool, &binding, 1, LEN + 1, &c.cache, &err) != KVP_OK ||
        kvp_ticket_create(c.cache, &c.ticket, &err) != KVP_OK) {
        fail("setup", &err);
        return 1;
    }
    c.input = malloc(WIDTH * sizeof *c.input);
    if (c.input == NULL) {
        return 1;
    }
    for (size_t t = 0; t < LEN; t++) {
        for (size_t i = 0; i < WIDTH; i++) {
            c.input[i] = unit();
        }
        kvp_tensor in = kvp_tensor3(c.input, 1, 1, WIDTH);
        if (kvp_attention_forward(c.layer, &in, c.cache, c.ticket, &err) != KVP_OK) {
            fail("fill", &err);
            return 1;
        }
    }
    bench_case bc = {{NULL}, {0}, 0, run_decode, &c};
    add_levels(&bc, "");
    double ns[MAX_VARIANTS];
    time_case(&bc, repetitions, min_ns, ns);
    report("decode D=512 H=8 L=1024", &bc, ns);
    free(c.input);
    (void)kvp_ticket_destroy(c.ticket, NULL);
    (void)kvp_cache_destroy(c.cache, NULL);
    (void)kvp_layer_destroy(c.layer, NULL);
    if (kvp_pool_destroy(pool, &err) != KVP_OK) {
        fail("teardown", &err);
        return 1;
    }
    return c.failed;
}

int main(int argc, char **argv)
{
    size_t repetitions = 21;
    double min_ns = 2e6;
    bench_arg table[] = {
        BENCH_SIZE("--repetitions", &repetitions, 1, 1000000, "N", "alternating repetitions"),
        BENCH_DOUBLE("--min-ns", &min_ns, 0.0, 1e12, "NS", "each sample's minimum duration"),
    };
    bench_args args = BENCH_ARGS("bench-softmax",
                                 "Times kvpi_softmax against a libm softmax, and one decode step, "
                                 "at\nevery ISA level this CPU runs.",
                                 table);
    int parsed = bench_args_parse(&args, argc, argv);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    printf("%-22s %-14s %15s  %7s\n", "what", "variant", "median", "vs 1st");
    static const size_t lengths[] = {1024, 8192};
    for (size_t l = 0; l < sizeof lengths / sizeof lengths[0]; l++) {
        size_t n = lengths[l];
        double *scores = malloc(n * sizeof *scores);
        double *work = malloc(n * sizeof *work);
        if (scores == NULL || work == NULL) {
            return 1;
        }
        for (size_t i = 0; i < n; i++) {
            scores[i] = 4.0 * unit(); /* about the spread of scaled dot products */
        }
        softmax_ctx ctx = {scores, work, n};
        bench_case bc = {{"libm"}, {-1}, 1, run_softmax, &ctx};
        add_levels(&bc, "");
        double ns[MAX_VARIANTS];
        time_case(&bc, repetitions, min_ns, ns);
        char what[32];
        snprintf(what, sizeof what, "softmax n=%zu", n);
        report(what, &bc, ns);
        free(scores);
        free(work);
    }
    return decode_bench(repetitions, min_ns);
}
