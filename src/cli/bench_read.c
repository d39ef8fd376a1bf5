/*
 * bench_read.c: `kvpager bench`'s read loop, the figure every "% of read" is
 * a percentage of.
 *
 * Owns: the read array (bench_reader: memory advised for huge pages exactly
 * as the pool advises its slab, src/pager/alloc.c), the sum kernels
 * (portable C with eight accumulators, one stream or two; AVX2; AVX-512F
 * with four vector accumulators, one stream or four; the wide ones compiled
 * for their level through target attributes), which of them run (the
 * portable ones and those of the best level this CPU runs,
 * __builtin_cpu_supports, or the lower one KVP_ISA names, as the library's
 * gather kernels choose theirs), the reader pair (a helper thread that
 * reads the second half while the caller reads the first, both released by
 * one barrier and joined by another), and the timed read cases: a set of
 * one case per kernel, on this thread or as two halves on the pair. A read
 * figure is the best kernel's median. Public API only, like all of src/cli.
 * Invariants: a case reads each byte of its prefix once per iteration, with
 * the loads independent of the sums; the array is written before it is read,
 * so no page is a zero page.
 * Callers: the bench*.c files (bench.h); a pair's helper thread runs only
 * read_helper.
 */
#define _DEFAULT_SOURCE /* madvise, MADV_HUGEPAGE */

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "alloc.h"
#include "bench.h"
#include "cli.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define BENCH_X86 1
#include <immintrin.h>
#endif

#define HUGE_BYTES ((size_t)2 << 20)
#define READERS 8 /* accumulators of the portable loop */

typedef double (*read_fn)(const unsigned char *data, size_t bytes);

/*
 * The portable loop: doubles summed into READERS independent accumulators
 * (compiled for baseline x86-64, GCC makes it SSE2: 16-byte loads).
 */
static double read_scalar(const unsigned char *data, size_t bytes)
{
    const double *p = (const double *)(const void *)data;
    size_t count = bytes / sizeof(double);
    double acc[READERS] = {0};
    for (size_t i = 0; i + READERS <= count; i += READERS) {
        for (size_t r = 0; r < READERS; r++) {
            acc[r] += p[i + r];
        }
    }
    double sum = 0.0;
    for (size_t r = 0; r < READERS; r++) {
        sum += acc[r];
    }
    return sum;
}

/* The same over the two halves at once: two streams for the prefetchers. */
static double read_scalar_2(const unsigned char *data, size_t bytes)
{
    const double *p = (const double *)(const void *)data;
    size_t half = bytes / sizeof(double) / 2;
    const double *q = p + half;
    double acc[READERS] = {0};
    for (size_t i = 0; i + READERS / 2 <= half; i += READERS / 2) {
        for (size_t r = 0; r < READERS / 2; r++) {
            acc[r] += p[i + r];
            acc[READERS / 2 + r] += q[i + r];
        }
    }
    double sum = 0.0;
    for (size_t r = 0; r < READERS; r++) {
        sum += acc[r];
    }
    return sum;
}

#ifdef BENCH_X86
/* 64-byte lines, two 32-byte loads each, four accumulators. */
__attribute__((target("avx2"))) static double read_avx2(const unsigned char *data,
                                                        size_t bytes)
{
    const double *p = (const double *)(const void *)data;
    size_t count = bytes / sizeof(double);
    __m256d a0 = _mm256_setzero_pd();
    __m256d a1 = _mm256_setzero_pd();
    __m256d a2 = _mm256_setzero_pd();
    __m256d a3 = _mm256_setzero_pd();
    for (size_t i = 0; i + 16 <= count; i += 16) {
        a0 = _mm256_add_pd(a0, _mm256_load_pd(p + i));
        a1 = _mm256_add_pd(a1, _mm256_load_pd(p + i + 4));
        a2 = _mm256_add_pd(a2, _mm256_load_pd(p + i + 8));
        a3 = _mm256_add_pd(a3, _mm256_load_pd(p + i + 12));
    }
    __m256d s = _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3));
    double lanes[4];
    _mm256_storeu_pd(lanes, s);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

/* One 64-byte load per line, four accumulators. */
__attribute__((target("avx512f"))) static double read_avx512(const unsigned char *data,
                                                             size_t bytes)
{
    const double *p = (const double *)(const void *)data;
    size_t count = bytes / sizeof(double);
    __m512d a0 = _mm512_setzero_pd();
    __m512d a1 = _mm512_setzero_pd();
    __m512d a2 = _mm512_setzero_pd();
    __m512d a3 = _mm512_setzero_pd();
    for (size_t i = 0; i + 32 <= count; i += 32) {
        a0 = _mm512_add_pd(a0, _mm512_load_pd(p + i));
        a1 = _mm512_add_pd(a1, _mm512_load_pd(p + i + 8));
        a2 = _mm512_add_pd(a2, _mm512_load_pd(p + i + 16));
        a3 = _mm512_add_pd(a3, _mm512_load_pd(p + i + 24));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
}

/* Four streams (the quarters), one 64-byte load each per step. */
__attribute__((target("avx512f"))) static double read_avx512_4(const unsigned char *data,
                                                               size_t bytes)
{
    const double *p = (const double *)(const void *)data;
    size_t quarter = bytes / sizeof(double) / 4;
    __m512d a0 = _mm512_setzero_pd();
    __m512d a1 = _mm512_setzero_pd();
    __m512d a2 = _mm512_setzero_pd();
    __m512d a3 = _mm512_setzero_pd();
    for (size_t i = 0; i + 8 <= quarter; i += 8) {
        a0 = _mm512_add_pd(a0, _mm512_load_pd(p + i));
        a1 = _mm512_add_pd(a1, _mm512_load_pd(p + quarter + i));
        a2 = _mm512_add_pd(a2, _mm512_load_pd(p + 2 * quarter + i));
        a3 = _mm512_add_pd(a3, _mm512_load_pd(p + 3 * quarter + i));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
}
#endif

/*
 * The read kernels, each with the ISA level it needs and the granule its
 * bytes are a multiple of (whole steps over every stream). On this kind of
 * machine the widest loads are not always the fastest read of DRAM (16-byte
 * SSE2 loads read more than 64-byte AVX-512 ones on the machine the docs
 * were measured on), so the read figure is the best of them all.
 */
typedef struct read_kernel {
    const char *name;
    int level; /* 0 portable, 1 avx2, 2 avx512 */
    size_t granule;
    read_fn fn;
} read_kernel;

static const read_kernel kernels[] = {
    {"portable", 0, READERS * sizeof(double), read_scalar},
    {"portable-2", 0, READERS * sizeof(double), read_scalar_2},
#ifdef BENCH_X86
    {"avx2", 1, 128, read_avx2},
    {"avx512", 2, 256, read_avx512},
    {"avx512-4", 2, 256, read_avx512_4},
#endif
};

static const char *const level_names[] = {"scalar", "avx2", "avx512"};

/*
 * The read's ISA level, 0 portable (scalar), 1 avx2, 2 avx512: the best the
 * CPU runs (__builtin_cpu_supports, which also checks that the OS saves the
 * wider registers), or a lower one KVP_ISA names, so that KVP_ISA forces the
 * read and the library's gather kernels alike. An unknown name or a level
 * the CPU lacks leaves the best (the library says so on stderr).
 */
static int choose_level(void)
{
    int best = 0;
#ifdef BENCH_X86
    __builtin_cpu_init();
    best = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    const char *wanted = getenv("KVP_ISA");
    for (int level = 0; wanted != NULL && level < best; level++) {
        if (strcmp(wanted, level_names[level]) == 0) {
            return level;
        }
    }
    return best;
}

/* Chosen once, on the first call (the bench's own thread, before any helper runs). */
static int active_level(void)
{
    static int level = -1;
    if (level < 0) {
        level = choose_level();
    }
    return level;
}

/*
 * The portable loops and the active level's: with AVX-512 the AVX2 loop is
 * left out (it read no faster than both neighbours here, and every kernel
 * adds a case to each shape's rounds).
 */
static int kernel_used(size_t k)
{
    return kernels[k].level == 0 || kernels[k].level == active_level();
}

size_t bench_read_kernels(size_t *used, size_t max)
{
    size_t n = 0;
    for (size_t k = 0; k < sizeof kernels / sizeof kernels[0] && n < max; k++) {
        if (kernel_used(k)) {
            used[n++] = k;
        }
    }
    return n;
}

const char *bench_read_kernel_name(size_t kernel)
{
    return kernels[kernel].name;
}

const char *bench_read_isa(void)
{
    return level_names[active_level()];
}

const char *bench_thp_mode(char *buf, size_t size)
{
    snprintf(buf, size, "unknown");
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (f == NULL) {
        return buf;
    }
    char line[128];
    if (fgets(line, sizeof line, f) != NULL) {
        char *open = strchr(line, '[');
        char *close = open != NULL ? strchr(open, ']') : NULL;
        if (close != NULL) {
            *close = '\0';
            snprintf(buf, size, "%s", open + 1);
        }
    }
    fclose(f);
    return buf;
}

int bench_reader_open(bench_reader *r, size_t bytes)
{
    memset(r, 0, sizeof *r);
    bytes &= ~(size_t)63;
    r->block = kvp_cli_alloc(bytes + HUGE_BYTES, 1);
    if (r->block == NULL) {
        return -1;
    }
    uintptr_t at = ((uintptr_t)r->block + HUGE_BYTES - 1) & ~(uintptr_t)(HUGE_BYTES - 1);
    r->data = (unsigned char *)at;
    r->bytes = bytes;
    /* As the pool's slab: the 2 MiB-aligned interior, a hint only. */
    size_t whole = bytes & ~(HUGE_BYTES - 1);
    r->advised = whole > 0 && madvise(r->data, whole, MADV_HUGEPAGE) == 0;
    double *p = (double *)(void *)r->data;
    for (size_t i = 0; i < bytes / sizeof(double); i++) {
        p[i] = (double)(i & 1023) * 0.5;
    }
    return 0;
}

void bench_reader_close(bench_reader *r)
{
    kvp_cli_free(r->block);
    memset(r, 0, sizeof *r);
}

/* ---- the reader pair ---- */

struct bench_pair {
    pthread_t helper;
    pthread_barrier_t start; /* both threads pass it to begin a read (or the helper to quit) */
    pthread_barrier_t done;  /* both pass it when their half is read */
    const bench_read_ctx *job;
    double sum;              /* the helper's half */
    int quit;
};

static void *read_helper(void *arg)
{
    bench_pair *p = arg;
    for (;;) {
        pthread_barrier_wait(&p->start);
        if (p->quit) {
            return NULL;
        }
        const bench_read_ctx *c = p->job;
        size_t half = c->bytes / 2;
        p->sum = kernels[c->kernel].fn(c->reader->data + half, half);
        pthread_barrier_wait(&p->done);
    }
}

int bench_pair_open(bench_pair **out)
{
    bench_pair *p = kvp_cli_calloc(1, sizeof *p);
    *out = NULL;
    if (p == NULL) {
        kvp_cli_report_oom("bench", "the reader pair", sizeof *p);
        return -1;
    }
    int error = pthread_barrier_init(&p->start, NULL, 2);
    if (error == 0 && (error = pthread_barrier_init(&p->done, NULL, 2)) != 0) {
        pthread_barrier_destroy(&p->start);
    }
    if (error == 0 && (error = pthread_create(&p->helper, NULL, read_helper, p)) != 0) {
        pthread_barrier_destroy(&p->start);
        pthread_barrier_destroy(&p->done);
    }
    if (error != 0) {
        fprintf(stderr, "kvpager bench: starting the reader thread: %s\n", strerror(error));
        kvp_cli_free(p);
        return -1;
    }
    *out = p;
    return 0;
}

void bench_pair_close(bench_pair *p)
{
    if (p == NULL) {
        return;
    }
    p->quit = 1;
    pthread_barrier_wait(&p->start);
    pthread_join(p->helper, NULL);
    pthread_barrier_destroy(&p->start);
    pthread_barrier_destroy(&p->done);
    kvp_cli_free(p);
}

/* ---- the read cases ---- */

void bench_read_init(bench_read_ctx *c, const bench_reader *reader, size_t bytes,
                     size_t kernel, bench_pair *pair)
{
    size_t granule = 2 * kernels[kernel].granule; /* two halves of whole steps */
    bytes = bytes < reader->bytes ? bytes : reader->bytes;
    bytes -= bytes % granule;
    c->reader = reader;
    c->bytes = bytes >= granule ? bytes : granule;
    c->kernel = kernel;
    c->pair = pair;
    c->sink = 0.0;
}

/* One read split in two halves: the helper's starts as the caller's does. */
static double read_split(const bench_read_ctx *c)
{
    bench_pair *p = c->pair;
    p->job = c;
    pthread_barrier_wait(&p->start);
    double sum = kernels[c->kernel].fn(c->reader->data, c->bytes / 2);
    pthread_barrier_wait(&p->done);
    return sum + p->sum;
}

void bench_read_run(void *ctx, size_t iterations)
{
    bench_read_ctx *c = ctx;
    for (size_t i = 0; i < iterations; i++) {
        c->sink += c->pair == NULL ? kernels[c->kernel].fn(c->reader->data, c->bytes)
                                   : read_split(c);
    }
}

double bench_read_gbps(const bench_read_ctx *c, double ns)
{
    return (double)c->bytes / ns;
}

size_t bench_read_set_init(bench_read_set *set, const bench_reader *reader, size_t bytes,
                           bench_pair *pair, kvp_measure_case *cases)
{
    size_t used[BENCH_READ_KERNELS];
    set->count = bench_read_kernels(used, BENCH_READ_KERNELS);
    for (size_t i = 0; i < set->count; i++) {
        bench_read_init(&set->ctx[i], reader, bytes, used[i], pair);
        cases[i] = (kvp_measure_case){bench_read_run, &set->ctx[i]};
    }
    return set->count;
}

double bench_read_set_best(const bench_read_set *set, const double *ns, size_t *kernel)
{
    double best = 0.0;
    for (size_t i = 0; i < set->count; i++) {
        double gbps = bench_read_gbps(&set->ctx[i], ns[i]);
        if (gbps > best) {
            best = gbps;
            *kernel = set->ctx[i].kernel;
        }
    }
    return best;
}

int bench_measure_read(const bench_options *o, bench_results *r)
{
    bench_read_set one;
    bench_read_set two;
    kvp_measure_case cases[2 * BENCH_READ_KERNELS];
    size_t n = bench_read_set_init(&one, &r->reader, o->read_bytes, NULL, cases);
    bench_read_set_init(&two, &r->reader, o->read_bytes, r->pair, cases + n);
    double ns[2 * BENCH_READ_KERNELS];
    if (kvp_measure_alternating(cases, 2 * n, o->repetitions, BENCH_MIN_NS, ns) != 0) {
        kvp_cli_report_oom("bench", "the timing scratch", 2 * n * o->repetitions * 8);
        return KVP_CLI_USAGE;
    }
    r->read_gbps = bench_read_set_best(&one, ns, &r->read_kernel);
    r->read_gbps_two = bench_read_set_best(&two, ns + n, &r->read_kernel_two);
    return KVP_CLI_OK;
}
