/*
 * bench.h: what the files of `kvpager bench` share (internal to src/cli).
 *
 *   bench.c         the command line, the grid, the order of the run, the entry point;
 *   bench_read.c    the read loop: one kernel per ISA level the CPU runs, on memory
 *                   advised like the pool's slab, on 1 thread or on a pair of 2;
 *   bench_gather.c  the gather measurements (kvp_paged_attention, the public call):
 *                   paged against a same-order contiguous layout, alternating with
 *                   a read of the shape's own size;
 *   bench_sim.c     page acquire + release (a cache's row reserve + discard),
 *                   and simulate against its bound;
 *   bench_report.c  the tables, --json and --plot.
 * Invariants: every figure is a median of alternating repetitions (measure.h);
 * every ratio is between figures of one run; "% of read" is given only for
 * DRAM-resident shapes (bench_dram_resident), and always against a read of
 * the shape's own size measured in the same alternation.
 * Callers: the bench*.c files only.
 */
#ifndef KVPAGER_CLI_BENCH_H
#define KVPAGER_CLI_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "kvpager/kvpager.h"
#include "measure.h"
#include "plot.h"
#include "progress.h"

#define BENCH_MAX_LIST 16
#define BENCH_MIN_NS 5e6 /* each repetition of a case lasts at least 5 ms */
#define BENCH_SIM_REPETITIONS 3
/* DRAM-resident: at least this many bytes of K+V (bench_dram_resident). */
#define BENCH_DRAM_BYTES ((size_t)256 << 20)

typedef struct bench_list {
    size_t value[BENCH_MAX_LIST];
    size_t count;
} bench_list;

/* The storage dtypes bench knows, in grid order (bench.c; one line per dtype). */
extern const kvp_dtype bench_dtypes[];
extern const size_t bench_dtype_count;

typedef struct bench_options {
    const char *plot;
    const char *max_bytes_text; /* as given, or the default's text */
    bench_list lens;
    bench_list blocks;
    bench_list dtypes;  /* kvp_dtype values */
    bench_list accums;  /* kvp_accum values; KVP_ACCUM_FAST applies to narrow dtypes only */
    bench_list kinds;   /* the grid's (dtype, accum) pairs: dtype * 2 + accum */
    bench_list groups;  /* query heads per KV head: kv_heads = heads / group */
    bench_list batches;
    bench_list heads;
    bench_list widths;
    size_t max_bytes;
    size_t read_bytes;
    size_t repetitions;
    size_t requests;
    int quick;
    int json;
    int quiet;
    int help;
} bench_options;

/* One cell of the grid. */
typedef struct bench_shape {
    kvp_dtype dtype;
    kvp_accum accum;
    size_t batch;
    size_t heads;    /* query heads H */
    size_t kv_heads; /* stored heads: H / group */
    size_t width;    /* d_h */
    size_t len;
} bench_shape;

/* K+V bytes of a B x H_kv x L x d_h cache as stored, or SIZE_MAX on overflow. */
size_t bench_kv_bytes(const bench_shape *s);

/*
 * 1 when a cache of `bytes` of K+V is DRAM-resident: at least
 * BENCH_DRAM_BYTES (256 MiB). The last-level cache this machine reports
 * (sysconf) is the host's, shared with every guest, so it cannot decide;
 * the table's same-size read column shows what each size gets.
 */
int bench_dram_resident(size_t bytes);

/* ---- the read loop (bench_read.c) ---- */

/*
 * An array for the read loop: allocated through alloc.h with 2 MiB of slack,
 * its 2 MiB-aligned interior advised MADV_HUGEPAGE as the pool advises its
 * slab (src/pager/alloc.c), then written (so the pages are committed).
 */
typedef struct bench_reader {
    void *block;          /* what kvp_cli_alloc returned */
    unsigned char *data;  /* 2 MiB-aligned */
    size_t bytes;         /* usable from data, a multiple of 64 */
    int advised;          /* madvise accepted the hint */
} bench_reader;

int bench_reader_open(bench_reader *r, size_t bytes);
void bench_reader_close(bench_reader *r);

/*
 * The read's ISA level ("scalar", "avx2" or "avx512"), the highest the read
 * kernels use: the best this CPU runs, or a lower one KVP_ISA names (the
 * variable that forces the library's gather kernels too).
 */
const char *bench_read_isa(void);

/* The transparent huge pages mode (/sys/kernel/mm/transparent_hugepage/enabled). */
const char *bench_thp_mode(char *buf, size_t size);

#define BENCH_READ_KERNELS 8

/* The read kernels this run uses (indices into bench_read.c's table); returns how many. */
size_t bench_read_kernels(size_t *used, size_t max);
const char *bench_read_kernel_name(size_t kernel);

/*
 * The reader pair: this thread and one helper thread (pthreads), which
 * read the two halves of a 2-thread read case; a barrier starts both
 * halves together and another waits for both. Open once, used by one
 * thread at a time, closed when no read runs. open: 0, or -1 after one
 * line on stderr (*out NULL).
 */
typedef struct bench_pair bench_pair;
int bench_pair_open(bench_pair **out);
void bench_pair_close(bench_pair *pair); /* NULL is ignored */

/*
 * One timed case: summing the first `bytes` (rounded down to the kernel's
 * granule, at least one) of the reader's array with read kernel `kernel`,
 * on this thread (pair NULL) or split in two halves, the first read by this
 * thread and the second by the pair's helper at the same time.
 */
typedef struct bench_read_ctx {
    const bench_reader *reader;
    size_t bytes;
    size_t kernel;
    bench_pair *pair;
    double sink;
} bench_read_ctx;

void bench_read_init(bench_read_ctx *c, const bench_reader *reader, size_t bytes,
                     size_t kernel, bench_pair *pair);
void bench_read_run(void *ctx, size_t iterations);
/* GB/s of a case from its median ns per iteration. */
double bench_read_gbps(const bench_read_ctx *c, double ns);

/* A read of one size by every kernel: the read figure is the best of them. */
typedef struct bench_read_set {
    bench_read_ctx ctx[BENCH_READ_KERNELS];
    size_t count;
} bench_read_set;

/* Fills set and cases[0..n) (n returned, at most BENCH_READ_KERNELS) for one size. */
size_t bench_read_set_init(bench_read_set *set, const bench_reader *reader, size_t bytes,
                           bench_pair *pair, kvp_measure_case *cases);
/* The best GB/s from the cases' medians ns[0..count); *kernel gets its kernel. */
double bench_read_set_best(const bench_read_set *set, const double *ns, size_t *kernel);

/* ---- results ---- */

typedef struct bench_row {
    bench_shape s;
    size_t block_tokens;
    size_t threads;        /* 1, or 2: a decoder of 2 threads, the second assisting */
    double paged_ns;
    double contiguous_ns;  /* the same pages, in lane order, adjacent in memory */
    double gbps;           /* K+V bytes / paged time */
    double read_gbps;      /* 1 thread: a read of the shape's own K+V size, alternated */
    size_t read_kernel;    /* the read kernel that gave it */
    double percent_of_read;      /* DRAM-resident, 1 thread: 100 gbps / read_gbps; else NAN */
    double percent_of_size_read; /* 1 thread: 100 gbps / read_gbps; else NAN */
    int dram;
    int identical;
} bench_row;

typedef struct bench_skipped {
    bench_shape s;
    size_t bytes;
} bench_skipped;

typedef struct bench_results {
    kvp_decoder *decoder;  /* 2 threads: the gathers' `threads` */
    bench_pair *pair;      /* 2 threads: splits the reads */
    bench_reader reader;   /* --read-bytes, for every read */
    double read_gbps;      /* the whole array, 1 thread */
    double read_gbps_two;  /* the whole array, 2 threads */
    size_t read_kernel;    /* the kernels that gave them */
    size_t read_kernel_two;
    bench_row *rows;
    size_t row_count;
    bench_skipped *skips;
    size_t skip_count;
    double page_ns[6];     /* kvpager, jemalloc, glibc; then per batch of 64, the same order */
    size_t page_bytes;
    double sim_tokens_per_second;
    double sim_bound;
    double sim_bytes_per_token;  /* K+V bytes the steps read / generated tokens */
    double sim_mean_step_bytes;
    size_t sim_steps;
    size_t sim_threads;
    size_t sim_requests;
    size_t sim_sizes;            /* read sizes measured for the bound */
} bench_results;

/* bench_read.c: the whole array on 1 and 2 threads, alternating. */
int bench_measure_read(const bench_options *o, bench_results *r);
/* bench_gather.c: one shape, every block_tokens; appends rows to r->rows. */
int bench_measure_shape(const bench_options *o, const bench_shape *s, bench_results *r,
                        kvp_progress *progress, size_t *done, size_t total);
/* bench_sim.c */
int bench_measure_pages(const bench_options *o, bench_results *r);
int bench_measure_simulate(const bench_options *o, bench_results *r);
/* bench_report.c */
void bench_print_tables(const bench_options *o, const bench_results *r);
void bench_print_json(const bench_options *o, const bench_results *r);
int bench_write_plot(const bench_options *o, const bench_results *r, kvp_plot *plot);

#endif /* KVPAGER_CLI_BENCH_H */
