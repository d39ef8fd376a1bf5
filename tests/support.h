/*
 * support.h: helpers shared by the cmocka test programs.
 *
 * Owns: the audit assertion every test runs after every operation, state
 * fingerprints for "nothing changed" checks, jemalloc's per-thread
 * allocation counters, and small constructors. Test-only code; it may use the
 * library's internal headers.
 */
#ifndef KVPAGER_TESTS_SUPPORT_H
#define KVPAGER_TESTS_SUPPORT_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "kvpager/kvpager.h"

/* Runs kvp_pool_check; on any mismatch prints every one and fails the test. */
#define kvpt_assert_pool_ok(pool) kvpt_assert_pool_ok_at((pool), __FILE__, __LINE__)
void kvpt_assert_pool_ok_at(kvp_pool *pool, const char *file, int line);

/* Asserts `status` is KVP_OK, printing the rendered error otherwise. */
#define kvpt_assert_ok(status, err) kvpt_assert_ok_at((status), (err), __FILE__, __LINE__)
void kvpt_assert_ok_at(kvp_status status, const kvp_error *err, const char *file, int line);

/* A pool of the given geometry holding exactly `pages` pages. */
kvp_pool *kvpt_pool(size_t block_tokens, size_t heads, size_t head_width, size_t pages);

/* A binding of the given geometry with fixed, distinct parameter ids. */
kvp_binding kvpt_binding(size_t heads, size_t head_width, size_t max_positions);

kvp_pool_stats kvpt_stats(kvp_pool *pool);

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
void kvpt_state_free(kvpt_state *state);

/* jemalloc's counters of bytes this thread allocated / deallocated. */
uint64_t kvpt_thread_allocated(void);
uint64_t kvpt_thread_deallocated(void);
/*
 * 1 when malloc in this process is jemalloc's (so thread.allocated sees it):
 * true in release builds, false under ASan or Valgrind, which replace malloc.
 */
int kvpt_malloc_is_counted(void);

/* SplitMix64, for reproducible test data. */
uint64_t kvpt_rand_next(uint64_t *state);
/* Uniform in [-1, 1). */
double kvpt_rand_unit(uint64_t *state);

#endif /* KVPAGER_TESTS_SUPPORT_H */
