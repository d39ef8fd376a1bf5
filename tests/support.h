/*
 * support.h: helpers shared by the cmocka test programs.
 *
 * Owns: the audit assertion every test runs after every operation, state
 * fingerprints for "nothing changed" checks, jemalloc's per-thread
 * allocation counters and the "no heap traffic" window over them, the
 * allocation fault injector's step record, error-text and numeric
 * assertions, and small constructors and destructors that assert success.
 * Test-only code; it may use the library's internal headers.
 *
 * Assertion helpers are macros over a *_at function taking __FILE__ and
 * __LINE__, so that a failure points at the calling test.
 */
#ifndef KVPAGER_TESTS_SUPPORT_H
#define KVPAGER_TESTS_SUPPORT_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "kvpager/kvpager.h"
#include "attention/layer_internal.h"
#include "pager/alloc.h"

/* The number of elements of an array (not a pointer). */
#define KVPT_COUNT_OF(a) (sizeof(a) / sizeof((a)[0]))
/* ceil(a / b) for unsigned a and nonzero b. */
#define KVPT_CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

/* ---- assertions ---------------------------------------------------------- */

/* Runs kvp_pool_check; on any mismatch prints every one and fails the test. */
#define kvpt_assert_pool_ok(pool) kvpt_assert_pool_ok_at((pool), __FILE__, __LINE__)
void kvpt_assert_pool_ok_at(kvp_pool *pool, const char *file, int line);

/*
 * Admission's guarantee (DESIGN "Admission and promises"): while no page was
 * taken beyond its taker's promise (the pool's `overdrawn` is 0), held +
 * promised pages never exceeded the pool after any take, adoption of an
 * evictable page or promise set (its `commit_high_water`). Fails, printing
 * both, otherwise. kvpt_commitment reads the two under the pool lock.
 */
#define kvpt_assert_committed(pool) kvpt_assert_committed_at((pool), __FILE__, __LINE__)
void kvpt_assert_committed_at(kvp_pool *pool, const char *file, int line);
void kvpt_commitment(kvp_pool *pool, size_t *high_water, size_t *overdrawn);

/* Asserts `status` is KVP_OK, printing the rendered error otherwise. */
#define kvpt_assert_ok(status, err) kvpt_assert_ok_at((status), (err), __FILE__, __LINE__)
void kvpt_assert_ok_at(kvp_status status, const kvp_error *err, const char *file, int line);

/*
 * kvp_error_format renders `e` as exactly `text` into a roomy buffer and
 * returns its length; measuring (NULL, 0) returns the same length.
 */
#define kvpt_assert_error_text(e, text) kvpt_assert_error_text_at((e), (text), __FILE__, __LINE__)
void kvpt_assert_error_text_at(const kvp_error *e, const char *text, const char *file, int line);

/* |actual - expected| <= tolerance (so never for a NaN). */
#define kvpt_assert_close(actual, expected, tolerance) \
    kvpt_assert_close_at((actual), (expected), (tolerance), __FILE__, __LINE__)
void kvpt_assert_close_at(double actual, double expected, double tolerance, const char *file,
                          int line);

/* The largest |a[i] - b[i]|; infinity when any difference is not a number. */
double kvpt_max_abs_diff(const double *a, const double *b, size_t n);

/* Sets out[0..n) to `value`, a sentinel for "nothing was written". */
void kvpt_fill(double *out, size_t n, double value);
/* Every one of out[0..n) still equals `value`. */
#define kvpt_assert_filled(out, n, value) \
    kvpt_assert_filled_at((out), (n), (value), __FILE__, __LINE__)
void kvpt_assert_filled_at(const double *out, size_t n, double value, const char *file, int line);

/* ---- constructors and destructors that assert success -------------------- */

/* A pool of the given geometry holding exactly `pages` pages; audited. */
kvp_pool *kvpt_pool(size_t block_tokens, size_t heads, size_t head_width, size_t pages);

/*
 * The same with pages of `dtype`; asserts the pool holds exactly `pages`
 * pages. kvpt_pool is this with KVP_F64.
 */
kvp_pool *kvpt_dtype_pool(size_t block_tokens, size_t heads, size_t head_width, size_t pages,
                          kvp_dtype dtype);

/* A decoder of `threads` threads; destroyed with kvpt_destroy_decoder (asserting success). */
kvp_decoder *kvpt_decoder(size_t threads);
void kvpt_destroy_decoder(kvp_decoder *decoder);

/*
 * Audits and destroys a pool that must be idle: no held or promised page, no
 * cache and no reservation attached, every page free.
 */
#define kvpt_destroy_pool(pool) kvpt_destroy_pool_at((pool), __FILE__, __LINE__)
void kvpt_destroy_pool_at(kvp_pool *pool, const char *file, int line);

/*
 * A layer binding of the given geometry (KV heads = heads) with fixed,
 * distinct parameter ids 1000 + i, revisions 0, RoPE (head_width,
 * max_positions, 10000.0), scales 0 (1.0).
 */
kvp_binding kvpt_binding(size_t heads, size_t head_width, size_t max_positions);
/* The record attention compares a binding with (kvpi_binding_layer_record). */
kvpi_layer_record kvpt_record(const kvp_binding *binding);
/* `binding` with its owner record replaced by `record` (digest and revision recomputed). */
kvp_binding kvpt_rebind(const kvp_binding *binding, const kvpi_layer_record *record);

kvp_pool_stats kvpt_stats(kvp_pool *pool);

/* A cache over `pool` (kvp_cache_create); the pool is audited after. */
kvp_cache *kvpt_cache(kvp_pool *pool, const kvp_binding *binding, size_t batch, size_t capacity);
/* Destroys a cache, then audits the pool it returned its pages to. */
void kvpt_destroy_cache(kvp_cache *cache, kvp_pool *pool);

kvp_ticket *kvpt_ticket(const kvp_cache *cache);
/* Destroys a ticket, returning any pages it holds to `pool`; audits the pool. */
void kvpt_destroy_ticket(kvp_ticket *ticket, kvp_pool *pool);

/* kvp_layer_create_random. */
kvp_layer *kvpt_random_layer(size_t model_width, size_t heads, size_t max_positions, double base,
                             uint64_t seed);
/*
 * A layer over fresh parameter nodes holding the width x width matrices
 * w[0..3] (W_q, W_k, W_v, W_o); the layer holds the only references.
 */
kvp_layer *kvpt_layer_from_matrices(size_t width, const double *const w[KVP_PARAM_COUNT],
                                    size_t heads, size_t max_positions, double base);
void kvpt_destroy_layer(kvp_layer *layer);

/* kvp_model_create_random. */
/* A model of `layers` layers that are all `layer` (one parameter set); the model keeps its
   own reference, and the caller's is destroyed. */
kvp_model *kvpt_model_of_one_layer(kvp_layer *layer, size_t layers);
kvp_model *kvpt_random_model(size_t layers, size_t model_width, size_t heads, size_t max_positions,
                             double base, uint64_t seed);
void kvpt_destroy_model(kvp_model *model);

/* A sequence over `pool` (kvp_sequence_create); the pool is audited after. */
kvp_sequence *kvpt_sequence(const kvp_model *model, kvp_pool *pool, size_t batch, size_t capacity);
/* Destroys a sequence, then audits the pool it returned its pages to. */
void kvpt_destroy_sequence(kvp_sequence *seq, kvp_pool *pool);

/* ---- layers and sequences --------------------------------------------------- */

/*
 * kvp_layer_info_get reports the given geometry, and RoPE over head_width
 * features with max_positions positions and exactly `base`.
 */
#define kvpt_assert_layer_info(layer, model_width, heads, head_width, max_positions, base) \
    kvpt_assert_layer_info_at((layer), (model_width), (heads), (head_width), (max_positions), \
                              (base), __FILE__, __LINE__)
void kvpt_assert_layer_info_at(const kvp_layer *layer, size_t model_width, size_t heads,
                               size_t head_width, size_t max_positions, double base,
                               const char *file, int line);

/* The number of layers (caches) of a sequence. */
size_t kvpt_sequence_layers(const kvp_sequence *seq);

/*
 * Both sequences have the same length and number of layers, and each layer's
 * cache holds the same logical keys and values, bit for bit.
 */
#define kvpt_assert_same_rows(a, b) kvpt_assert_same_rows_at((a), (b), __FILE__, __LINE__)
void kvpt_assert_same_rows_at(const kvp_sequence *a, const kvp_sequence *b, const char *file,
                              int line);

/* ---- state fingerprints ------------------------------------------------------ */

/*
 * Everything a failed call must leave unchanged: len, logical keys and
 * values, every page-table entry of the mapped prefix, and the pool stats.
 * Buffers are sized for the cache's capacity at capture time.
 */
typedef struct kvpt_state {
    size_t len;
    size_t elements;
    double *keys;
    double *values;
    size_t pages;
    uint32_t *tables;
    kvp_pool_stats stats;
} kvpt_state;

void kvpt_state_capture(kvp_cache *cache, kvp_pool *pool, kvpt_state *state);
/* Compares byte for byte; fails the test with what differs. */
#define kvpt_assert_state_equal(a, b) kvpt_assert_state_equal_at((a), (b), __FILE__, __LINE__)
void kvpt_assert_state_equal_at(const kvpt_state *a, const kvpt_state *b, const char *file,
                                int line);
/*
 * Audits the pool, captures `cache` and `pool` now and compares with
 * `before` byte for byte, except that the pool counted `exhaustions` more
 * exhaustions. Frees the new capture; `before` stays the caller's.
 */
#define kvpt_assert_state_unchanged(before, cache, pool, exhaustions) \
    kvpt_assert_state_unchanged_at((before), (cache), (pool), (exhaustions), __FILE__, __LINE__)
void kvpt_assert_state_unchanged_at(const kvpt_state *before, kvp_cache *cache, kvp_pool *pool,
                                    uint64_t exhaustions, const char *file, int line);
void kvpt_state_free(kvpt_state *state);

/* ---- audit findings ------------------------------------------------------------ */

#define KVPT_FINDINGS_KEPT 16

/* What kvp_pool_check reported: every finding counted, the first 16 kept. */
typedef struct kvpt_findings {
    size_t count;
    kvp_mismatch items[KVPT_FINDINGS_KEPT];
} kvpt_findings;

/*
 * The pool's LRU list of evictable pages from its head (least recently
 * used), into order[0..evictable); returns its length. Reads it under the
 * pool's lock (internal fields: a white-box check of the eviction order).
 */
size_t kvpt_lru_order(kvp_pool *pool, uint32_t *order);

/* kvp_pool_check's on_mismatch: ctx is a zeroed kvpt_findings. */
void kvpt_collect_finding(void *ctx, const kvp_mismatch *m);

/* ---- snapshots of everything a failed call must leave unchanged --------------- */

#define KVPT_SNAPSHOT_MAX 8

/*
 * The objects a snapshot watches (register them once) and their observable
 * state: the pool's stats (all of them, high water included), its slab
 * digest and a passing audit; each cache's length, info and digest (logical
 * rows and page tables); each sequence's length, held and promised pages
 * and its caches; each parameter's id, revision and values digest; each
 * ticket's result (or TicketEmpty) and the bytes of its output and weights.
 * Everything not registered (e.g. a NULL pool) is skipped.
 */
typedef struct kvpt_snapshot {
    kvp_pool *pool;
    size_t ncaches;
    const kvp_cache *caches[KVPT_SNAPSHOT_MAX];
    size_t nsequences;
    const kvp_sequence *sequences[KVPT_SNAPSHOT_MAX];
    size_t nparams;
    const kvp_param *params[KVPT_SNAPSHOT_MAX];
    size_t ntickets;
    const kvp_ticket *tickets[KVPT_SNAPSHOT_MAX];

    /* Filled by kvpt_snapshot_take. */
    kvp_pool_stats stats;
    uint64_t pool_digest;
    kvp_cache_info cache_info[KVPT_SNAPSHOT_MAX];
    uint64_t cache_digest[KVPT_SNAPSHOT_MAX];
    size_t seq_len[KVPT_SNAPSHOT_MAX];
    size_t seq_held[KVPT_SNAPSHOT_MAX];
    size_t seq_promised[KVPT_SNAPSHOT_MAX];
    size_t seq_pages_next[KVPT_SNAPSHOT_MAX]; /* pages_for(len + 1): copy-on-write marks too */
    uint64_t seq_digest[KVPT_SNAPSHOT_MAX]; /* over every layer's cache digest */
    uint64_t param_id[KVPT_SNAPSHOT_MAX];
    uint64_t param_revision[KVPT_SNAPSHOT_MAX];
    uint64_t param_digest[KVPT_SNAPSHOT_MAX];
    kvp_status ticket_status[KVPT_SNAPSHOT_MAX];
    kvp_attention_result ticket_result[KVPT_SNAPSHOT_MAX];
    uint64_t ticket_digest[KVPT_SNAPSHOT_MAX]; /* output and weights bytes */
} kvpt_snapshot;

/* An empty snapshot watching `pool` (may be NULL). */
void kvpt_snapshot_init(kvpt_snapshot *s, kvp_pool *pool);
void kvpt_snapshot_add_cache(kvpt_snapshot *s, const kvp_cache *cache);
void kvpt_snapshot_add_sequence(kvpt_snapshot *s, const kvp_sequence *sequence);
void kvpt_snapshot_add_param(kvpt_snapshot *s, const kvp_param *param);
void kvpt_snapshot_add_ticket(kvpt_snapshot *s, const kvp_ticket *ticket);
/* Audits the pool (the audit must pass) and records the state of every watched object. */
#define kvpt_snapshot_take(s) kvpt_snapshot_take_at((s), __FILE__, __LINE__)
void kvpt_snapshot_take_at(kvpt_snapshot *s, const char *file, int line);
/*
 * Takes a new snapshot of the same objects and compares it with `before`
 * field by field: equal, except that the pool's exhaustions counter may be
 * exactly `exhaustions` higher (the one counter that counts refusals).
 * Fails naming the first field that differs.
 */
#define kvpt_assert_unchanged(before, exhaustions) \
    kvpt_assert_unchanged_at((before), (exhaustions), __FILE__, __LINE__)
void kvpt_assert_unchanged_at(const kvpt_snapshot *before, uint64_t exhaustions, const char *file,
                              int line);

/* ---- the heap ----------------------------------------------------------------- */

/* jemalloc's counters of bytes this thread allocated / deallocated. */
uint64_t kvpt_thread_allocated(void);
uint64_t kvpt_thread_deallocated(void);
/*
 * 1 when malloc in this process is jemalloc's (so thread.allocated sees it):
 * true in release builds, false under ASan or Valgrind, which replace malloc.
 */
int kvpt_malloc_is_counted(void);

/*
 * This thread's heap traffic over a window of code under test. _open checks
 * that the counters see malloc wherever they must (natively jemalloc serves
 * malloc; only ASan or Valgrind replace it), warms both counters (first use
 * may set up per-thread state) and reads them; _close reads them again.
 * Only the code under test may run between the two.
 */
typedef struct kvpt_heap_window {
    int counted;
    uint64_t allocated_before;
    uint64_t deallocated_before;
    uint64_t allocated_after;
    uint64_t deallocated_after;
} kvpt_heap_window;

#define kvpt_heap_window_open(w) kvpt_heap_window_open_at((w), __FILE__, __LINE__)
void kvpt_heap_window_open_at(kvpt_heap_window *w, const char *file, int line);
void kvpt_heap_window_close(kvpt_heap_window *w);
/*
 * Where the counters see malloc: the window allocated and freed no byte, and
 * the counters are live (a 1024-byte malloc and free move both).
 */
#define kvpt_assert_no_heap_traffic(w) kvpt_assert_no_heap_traffic_at((w), __FILE__, __LINE__)
void kvpt_assert_no_heap_traffic_at(const kvpt_heap_window *w, const char *file, int line);

/* ---- allocation fault injection --------------------------------------------------- */

/* A cmocka teardown: leaves the fault injector disarmed, even after a failed assertion. */
int kvpt_disarm(void **state);

/* The outcome of one call made with the nth allocation call armed to fail. */
typedef struct kvpt_fault_step {
    kvp_status status;    /* what the call returned */
    kvp_error err;        /* pass &s.err to the call; 0x5A bytes until it writes */
    int fired;            /* the armed fault fired */
    kvpi_fault_site site; /* where it fired */
    uint64_t calls;       /* allocation calls the call made */
} kvpt_fault_step;

/* Clears `s`, fills s->err with 0x5A and arms the injector at the nth call. */
void kvpt_fault_step_arm(kvpt_fault_step *s, uint64_t nth);
/* Records the call's status, reads the injector, then disarms it. */
void kvpt_fault_step_finish(kvpt_fault_step *s, kvp_status status);
/*
 * A failed step: AllocationFailed (status and err.status) at a real site,
 * stopped at the nth call, naming what it allocated and a nonzero size, and
 * rendered "cannot allocate <what> (<bytes> bytes)".
 */
#define kvpt_assert_fault_failed(s, nth) kvpt_assert_fault_failed_at((s), (nth), __FILE__, __LINE__)
void kvpt_assert_fault_failed_at(const kvpt_fault_step *s, uint64_t nth, const char *file,
                                 int line);

/* ---- test data ---------------------------------------------------------------------- */

/* SplitMix64, for reproducible test data. */
uint64_t kvpt_rand_next(uint64_t *state);
/* Uniform in [-1, 1). */
double kvpt_rand_unit(uint64_t *state);
/* n values uniform in [-1, 1) from SplitMix64(seed). */
void kvpt_fill_random(double *out, size_t n, uint64_t seed);

/*
 * The fast level's softmax written out from its definition (docs/DESIGN.md,
 * Accumulation levels), the tests' reference: the maximum m, then
 * 2^(s_i - m) by kvpi_exp2f on the f32 difference, the sum in sixteen lane
 * sums (i mod 16) + the fixed tree + the tail in order, one divide each.
 * n == 0 does nothing.
 */
void kvpt_documented_softmax_fast(float *s, size_t n);

/* 1 when a and b have the same bits (so -0 != +0 and a NaN can equal itself). */
int kvpt_same_bits(double a, double b);

/*
 * x rounded to a binary format with `bits` significant bits and smallest
 * normal exponent `emin` (subnormal quantum 2^(emin - bits + 1)), to nearest
 * with ties to even, written out from the definition: the two neighbours
 * on the format's grid and the nearer one (the even one on a tie). Every
 * step is exact in f64 for the formats tested (bits <= 24). The tests'
 * independent model of the pages' rounding (f32, bf16, f16, e4m3).
 */
double kvpt_round_to_format(double x, int bits, int emin);

/* n + 1 zeroed doubles (never NULL; the spare one makes n == 0 fine). Free with free(). */
double *kvpt_doubles(size_t n);

/*
 * Aborts the test program, naming `program`, if it is still running after
 * `seconds` (20 times that under Valgrind): a hang in threaded code becomes a
 * fast, explicit failure instead of a ctest or mutation-run timeout. Call
 * once, first thing in main.
 */
void kvpt_watchdog(const char *program, unsigned seconds);

#endif /* KVPAGER_TESTS_SUPPORT_H */
