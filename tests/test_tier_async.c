/*
 * test_tier_async.c: a tier that completes its batches on its own thread
 * (as a network tier does): the pool's evictions never wait for it, detach
 * waits for every write in flight, and a load through it maps bit-identical
 * rows, alone and behind a host tier (kvp_tier_compose_create). Threaded:
 * the pass conditions hold under any scheduling (a gate the
 * test opens holds every completion back); one that never completes drops
 * the writes past the pool's ring of 64. And a tier that fails: refused
 * writes, failed blocks and a refused batch are counted or change nothing.
 * The load in two halves: a prefetch in flight, then mapped (or refused).
 * kvp_pool_check after every operation.
 */
#include "tier_support.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ---- a tier that completes on its own thread --------------------------------------- */

/*
 * An asynchronous tier over a host tier: batches are queued (puts copy their
 * bytes first) and completed by a worker thread, which waits at a gate the
 * test opens. So while the gate is closed, every write the pool issued is
 * provably in flight; the pass conditions hold under any scheduling.
 */
typedef struct job {
    struct job *next;
    kvp_tier_op op;
    kvp_tier_block *blocks; /* the caller's array: completed in place */
    size_t count;
    kvp_tier_done_fn done;
    void *ctx;
    kvp_tier_block *copies; /* put: blocks over own copies of the bytes */
} job;

typedef struct async_tier {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int open;
    int stop;
    job *head;
    job *tail;
    size_t queued;
    kvp_tier *inner;
    pthread_t thread;
} async_tier;

static void job_run(async_tier *a, job *j)
{
    kvp_error err;
    kvp_tier_block *blocks = j->op == KVP_TIER_PUT ? j->copies : j->blocks;
    kvpt_assert_ok(kvp_tier_run(a->inner, j->op, blocks, j->count, &err), &err);
    for (size_t i = 0; j->op == KVP_TIER_PUT && i < j->count; i++) {
        j->blocks[i].status = j->copies[i].status;
        free(j->copies[i].data);
    }
    j->done(j->ctx, j->blocks, j->count);
    free(j->copies);
    free(j);
}

static void *async_worker(void *arg)
{
    async_tier *a = arg;
    pthread_mutex_lock(&a->lock);
    for (;;) {
        while (!(a->open && a->head != NULL) && !(a->stop && a->head == NULL)) {
            pthread_cond_wait(&a->wake, &a->lock);
        }
        if (a->head == NULL) {
            break; /* stopping, and nothing left */
        }
        job *j = a->head;
        a->head = j->next;
        if (a->head == NULL) {
            a->tail = NULL;
        }
        a->queued--;
        pthread_mutex_unlock(&a->lock);
        job_run(a, j);
        pthread_mutex_lock(&a->lock);
    }
    pthread_mutex_unlock(&a->lock);
    return NULL;
}

static kvp_status async_enqueue(async_tier *a, kvp_tier_op op, kvp_tier_block *blocks,
                                size_t count, kvp_tier_done_fn done, void *ctx)
{
    job *j = calloc(1, sizeof *j);
    assert_non_null(j);
    j->op = op;
    j->blocks = blocks;
    j->count = count;
    j->done = done;
    j->ctx = ctx;
    if (op == KVP_TIER_PUT) {
        j->copies = calloc(count, sizeof *j->copies);
        for (size_t i = 0; i < count; i++) {
            j->copies[i] = blocks[i];
            j->copies[i].data = malloc(blocks[i].bytes);
            memcpy(j->copies[i].data, blocks[i].data, blocks[i].bytes);
        }
    }
    pthread_mutex_lock(&a->lock);
    if (a->tail != NULL) {
        a->tail->next = j;
    } else {
        a->head = j;
    }
    a->tail = j;
    a->queued++;
    pthread_cond_signal(&a->wake);
    pthread_mutex_unlock(&a->lock);
    return KVP_OK;
}

static kvp_status async_contains(void *impl, kvp_tier_block *blocks, size_t count,
                                 kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    (void)err;
    return async_enqueue(impl, KVP_TIER_CONTAINS, blocks, count, done, ctx);
}

static kvp_status async_get(void *impl, kvp_tier_block *blocks, size_t count,
                            kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    (void)err;
    return async_enqueue(impl, KVP_TIER_GET, blocks, count, done, ctx);
}

static kvp_status async_put(void *impl, kvp_tier_block *blocks, size_t count,
                            kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    (void)err;
    return async_enqueue(impl, KVP_TIER_PUT, blocks, count, done, ctx);
}

static void async_destroy(void *impl)
{
    async_tier *a = impl;
    pthread_mutex_lock(&a->lock);
    a->stop = 1;
    a->open = 1;
    pthread_cond_broadcast(&a->wake);
    pthread_mutex_unlock(&a->lock);
    pthread_join(a->thread, NULL);
    pthread_cond_destroy(&a->wake);
    pthread_mutex_destroy(&a->lock);
    free(a);
}

static kvp_tier *async_tier_create(kvp_tier *inner, async_tier **out)
{
    async_tier *a = calloc(1, sizeof *a);
    assert_non_null(a);
    pthread_mutex_init(&a->lock, NULL);
    pthread_cond_init(&a->wake, NULL);
    a->inner = inner;
    assert_int_equal(pthread_create(&a->thread, NULL, async_worker, a), 0);
    kvp_tier_vtable v;
    kvp_tier_vtable_init(&v);
    v.name = "async";
    v.contains = async_contains;
    v.get = async_get;
    v.put = async_put;
    v.destroy = async_destroy;
    kvp_tier *tier = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_create(&v, a, &tier, &err), &err);
    *out = a;
    return tier;
}

static void async_open(async_tier *a, int open)
{
    pthread_mutex_lock(&a->lock);
    a->open = open;
    pthread_cond_broadcast(&a->wake);
    pthread_mutex_unlock(&a->lock);
}

static size_t async_queued(async_tier *a)
{
    pthread_mutex_lock(&a->lock);
    size_t n = a->queued;
    pthread_mutex_unlock(&a->lock);
    return n;
}

/* A thread that detaches the pool's tier: it must wait for the writes in flight. */
static void *detacher(void *arg)
{
    kvp_error err;
    kvpt_assert_ok(kvp_pool_tier_detach(arg, &err), &err);
    return NULL;
}

/*
 * Evictions hand their blocks to a tier that completes later, on its own
 * thread: the evicting takes never wait (the gate is closed while they run),
 * detach waits for every completion, and then the blocks are in the store.
 * A load through the same asynchronous tier completes from its thread and
 * maps bit-identical rows.
 */
static void test_tier_async_completion(void **state)
{
    (void)state;
    enum { B = 2, PAGES = 8 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *store = host_tier(1 << 20);
    async_tier *a = NULL;
    kvp_tier *tier = async_tier_create(store, &a);
    assert_string_equal(kvp_tier_name(tier), "async");
    attach(pool, tier, 0);
    kvp_block_key keys[2 * B];
    kvp_cache *src = published_cache(pool, B, keys);
    size_t n = B * KV_HEADS * 2 * BT * HEAD_WIDTH;
    double *ks = kvpt_doubles(n);
    double *vs = kvpt_doubles(n);
    export_rows(src, n, ks, vs);
    kvpt_destroy_cache(src, pool);
    churn(pool, PAGES); /* the gate is closed: all four writes stay queued */
    assert_int_equal(tier_stats(pool).writes, 4);
    assert_int_equal(async_queued(a), 4);
    assert_int_equal(host_stats(store).puts, 0);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, detacher, pool), 0);
    async_open(a, 1); /* the detacher returns only once all four completed */
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(host_stats(store).puts, 4);
    assert_int_equal(host_stats(store).blocks, 4);
    assert_int_equal(async_queued(a), 0);
    /* Load through the asynchronous tier. */
    attach(pool, tier, 0);
    kvp_cache *c = external_cache(pool, B, 1);
    size_t loaded = 0;
    kvp_status stop = KVP_FULL;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_group_tier_load(&c, 1, keys, 2, &loaded, &stop, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, 2);
    double *kc = kvpt_doubles(n);
    double *vc = kvpt_doubles(n);
    export_rows(c, n, kc, vc);
    assert_memory_equal(kc, ks, n * sizeof(double));
    assert_memory_equal(vc, vs, n * sizeof(double));
    assert_int_equal(tier_stats(pool).loads, 4);
    kvpt_destroy_cache(c, pool);
    free(ks);
    free(vs);
    free(kc);
    free(vc);
    detach_and_destroy(pool, tier);
    kvpt_assert_ok(kvp_tier_destroy(store, &err), &err);
    destroy_pool(pool);
}

/*
 * The load's two halves through the asynchronous tier (kvp_pool_tier_prefetch,
 * kvp_cache_group_tier_map): while the gate is closed the prefetch is in
 * flight (a map is refused, changing nothing; one destroyed then is freed by
 * its completion); once completed it maps bit-identical rows, once; a map
 * past its blocks, or under another attachment than the issuing one, is
 * refused and changes nothing; bad arguments are refused.
 */
static void test_tier_async_prefetch_then_map(void **state)
{
    (void)state;
    enum { B = 2, PAGES = 8 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *store = host_tier(1 << 20);
    async_tier *a = NULL;
    kvp_tier *tier = async_tier_create(store, &a);
    async_open(a, 1);
    attach(pool, tier, 0);
    kvp_block_key keys[2 * B];
    kvp_cache *src = published_cache(pool, B, keys);
    size_t n = B * KV_HEADS * 2 * BT * HEAD_WIDTH;
    double *ks = kvpt_doubles(n);
    double *vs = kvpt_doubles(n);
    export_rows(src, n, ks, vs);
    kvpt_destroy_cache(src, pool);
    churn(pool, PAGES);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_tier_detach(pool, &err), &err); /* waits for the four writes */
    assert_int_equal(host_stats(store).blocks, 4);
    attach(pool, tier, 0);
    async_open(a, 0);
    kvp_cache *c = external_cache(pool, B, 1);
    kvpt_state before;
    kvpt_state_capture(c, pool, &before);
    kvp_pool_tier_stats ts = tier_stats(pool);
    kvp_tier_prefetch *p = NULL;
    assert_int_equal(kvp_pool_tier_prefetch(NULL, keys, 2, B, &p, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_pool_tier_prefetch(pool, NULL, 2, B, &p, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_pool_tier_prefetch(pool, keys, 2, B, NULL, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_pool_tier_prefetch(pool, keys, 2, 0, &p, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "per");
    assert_null(p);
    /* One cancelled in flight: its completion frees it (ASan and memcheck see no leak). */
    kvpt_assert_ok(kvp_pool_tier_prefetch(pool, keys, 2, B, &p, &err), &err);
    kvp_tier_prefetch_destroy(p);
    kvpt_assert_ok(kvp_pool_tier_prefetch(pool, keys, 2, B, &p, &err), &err);
    assert_int_equal(async_queued(a), 2);
    assert_int_equal(kvp_tier_prefetch_ready(p, NULL), 0);
    size_t loaded = 7;
    assert_int_equal(kvp_cache_group_tier_map(&c, 1, p, 0, &loaded, NULL, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "prefetch"); /* in flight */
    async_open(a, 1);
    kvp_tier_prefetch_wait(p);
    double seconds = -1.0;
    assert_int_equal(kvp_tier_prefetch_ready(p, &seconds), 1);
    assert_true(seconds >= 0.0);
    assert_int_equal(kvp_cache_group_tier_map(&c, 1, p, 3, &loaded, NULL, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "skip");
    assert_int_equal(kvp_cache_group_tier_map(&c, 1, NULL, 0, &loaded, NULL, &err),
                     KVP_NULL_ARGUMENT);
    assert_int_equal(loaded, 7);
    kvpt_assert_state_unchanged(&before, c, pool, 0);
    kvp_pool_tier_stats tnow = tier_stats(pool);
    assert_memory_equal(&tnow, &ts, sizeof ts);
    kvp_status stop = KVP_FULL;
    kvpt_assert_ok(kvp_cache_group_tier_map(&c, 1, p, 0, &loaded, &stop, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, 2);
    assert_int_equal(stop, KVP_OK);
    assert_int_equal(tier_stats(pool).loads, 4);
    double *kc = kvpt_doubles(n);
    double *vc = kvpt_doubles(n);
    export_rows(c, n, kc, vc);
    assert_memory_equal(kc, ks, n * sizeof(double));
    assert_memory_equal(vc, vs, n * sizeof(double));
    assert_int_equal(kvp_cache_group_tier_map(&c, 1, p, 0, &loaded, NULL, &err),
                     KVP_INVALID_ARGUMENT); /* maps once */
    kvp_tier_prefetch_destroy(p);
    kvpt_destroy_cache(c, pool);
    /* Issued under one attachment, refused under the next one. */
    c = external_cache(pool, B, 1);
    kvpt_assert_ok(kvp_pool_tier_prefetch(pool, keys, 2, B, &p, &err), &err);
    kvp_tier_prefetch_wait(p);
    kvpt_assert_ok(kvp_pool_tier_detach(pool, &err), &err);
    attach(pool, tier, 0);
    assert_int_equal(kvp_cache_group_tier_map(&c, 1, p, 0, &loaded, NULL, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "pool");
    assert_int_equal(kvp_cache_len(c), 0);
    kvp_tier_prefetch_destroy(p);
    kvpt_destroy_cache(c, pool);
    kvpt_state_free(&before);
    free(ks);
    free(vs);
    free(kc);
    free(vc);
    detach_and_destroy(pool, tier);
    kvpt_assert_ok(kvp_tier_destroy(store, &err), &err);
    destroy_pool(pool);
}

/*
 * A host tier of one block's budget in front of the asynchronous tier: the
 * pool's evictions reach both (the far half completes on the worker
 * thread once the gate opens); a load finds at most one block near and the
 * rest far, completed from the worker thread, and maps bit-identical rows.
 */
static void test_tier_async_composed(void **state)
{
    (void)state;
    enum { B = 2, PAGES = 8 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *store = host_tier(1 << 20);
    async_tier *a = NULL;
    kvp_tier *far = async_tier_create(store, &a);
    kvp_tier *near = host_tier(block_bytes(pool));
    kvp_tier *both = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_compose_create(near, far, &both, &err), &err);
    attach(pool, both, 0);
    kvp_block_key keys[2 * B];
    kvp_cache *src = published_cache(pool, B, keys);
    size_t n = B * KV_HEADS * 2 * BT * HEAD_WIDTH;
    double *ks = kvpt_doubles(n);
    double *vs = kvpt_doubles(n);
    export_rows(src, n, ks, vs);
    kvpt_destroy_cache(src, pool);
    churn(pool, PAGES);
    assert_int_equal(tier_stats(pool).writes, 4);
    assert_int_equal(host_stats(near).puts, 4); /* inline: each evicted the one before */
    assert_int_equal(host_stats(near).blocks, 1);
    assert_int_equal(async_queued(a), 4); /* the far halves wait at the gate */
    async_open(a, 1);
    kvp_cache *c = external_cache(pool, B, 1);
    size_t loaded = 0;
    kvp_status stop = KVP_FULL;
    kvpt_assert_ok(kvp_cache_group_tier_load(&c, 1, keys, 2, &loaded, &stop, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, 2);
    assert_int_equal(stop, KVP_OK);
    double *kc = kvpt_doubles(n);
    double *vc = kvpt_doubles(n);
    export_rows(c, n, kc, vc);
    assert_memory_equal(kc, ks, n * sizeof(double));
    assert_memory_equal(vc, vs, n * sizeof(double));
    kvp_pool_tier_stats ts = tier_stats(pool);
    assert_int_equal(ts.loads, 4);
    assert_int_equal(ts.write_failures, 0);
    assert_int_equal(host_stats(near).hits + host_stats(store).hits, 4);
    assert_true(host_stats(store).hits >= 3);
    kvpt_destroy_cache(c, pool);
    free(ks);
    free(vs);
    free(kc);
    free(vc);
    detach_and_destroy(pool, both);
    kvpt_assert_ok(kvp_tier_destroy(far, &err), &err);
    kvpt_assert_ok(kvp_tier_destroy(near, &err), &err);
    kvpt_assert_ok(kvp_tier_destroy(store, &err), &err);
    destroy_pool(pool);
}

/* ---- a tier that fails ---------------------------------------------------------- */

/* refuse_gets: the get batch itself is refused; else every block fails TIER_UNAVAILABLE. */
typedef struct failing_tier {
    int refuse_gets;
    size_t puts_refused;
} failing_tier;

static kvp_status failing_fail_each(void *impl, kvp_tier_block *blocks, size_t count,
                                    kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    failing_tier *f = impl;
    if (f->refuse_gets) {
        if (err != NULL) {
            memset(err, 0, sizeof *err);
            err->status = KVP_TIER_UNAVAILABLE;
            err->what = "failing";
        }
        return KVP_TIER_UNAVAILABLE;
    }
    for (size_t i = 0; i < count; i++) {
        blocks[i].bytes = 0;
        blocks[i].status = KVP_TIER_UNAVAILABLE;
    }
    done(ctx, blocks, count);
    return KVP_OK;
}

static kvp_status failing_put(void *impl, kvp_tier_block *blocks, size_t count,
                              kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    (void)blocks;
    (void)done;
    (void)ctx;
    (void)err;
    failing_tier *f = impl;
    f->puts_refused += count;
    return KVP_TIER_UNAVAILABLE; /* refused: done is never called */
}

static void failing_destroy(void *impl)
{
    (void)impl;
}

/*
 * Writes the tier refuses are counted as failures and change nothing else;
 * blocks it fails stop a load at once (TIER_UNAVAILABLE, counted); a get
 * batch it refuses fails the load, changing nothing.
 */
static void test_tier_failing_tier(void **state)
{
    (void)state;
    enum { PAGES = 4 };
    failing_tier f = {0, 0};
    kvp_tier_vtable v;
    kvp_tier_vtable_init(&v);
    v.name = "failing";
    v.contains = failing_fail_each;
    v.get = failing_fail_each;
    v.put = failing_put;
    kvp_tier *tier = NULL;
    kvp_error err;
    assert_int_equal(kvp_tier_create(&v, &f, &tier, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "destroy");
    v.destroy = failing_destroy;
    kvpt_assert_ok(kvp_tier_create(&v, &f, &tier, &err), &err);
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    attach(pool, tier, 0);
    kvp_block_key keys[2];
    kvp_cache *src = published_cache(pool, 1, keys);
    kvpt_destroy_cache(src, pool);
    churn(pool, PAGES);
    assert_int_equal(f.puts_refused, 2);
    kvp_pool_tier_stats ts = tier_stats(pool);
    assert_int_equal(ts.writes, 2);
    assert_int_equal(ts.write_failures, 2);
    kvp_cache *c = external_cache(pool, 1, 1);
    size_t loaded = 9;
    kvp_status stop = KVP_OK;
    kvpt_assert_ok(kvp_cache_group_tier_load(&c, 1, keys, 2, &loaded, &stop, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(loaded, 0);
    assert_int_equal(stop, KVP_TIER_UNAVAILABLE);
    assert_int_equal(tier_stats(pool).load_failures, 2);
    assert_int_equal(kvp_cache_len(c), 0);
    f.refuse_gets = 1;
    kvpt_state before;
    kvpt_state_capture(c, pool, &before);
    ts = tier_stats(pool);
    loaded = 9;
    assert_int_equal(kvp_cache_group_tier_load(&c, 1, keys, 2, &loaded, &stop, &err),
                     KVP_TIER_UNAVAILABLE);
    assert_string_equal(err.what, "failing");
    assert_int_equal(loaded, 9);
    kvpt_assert_state_unchanged(&before, c, pool, 0);
    kvp_pool_tier_stats now = tier_stats(pool);
    assert_memory_equal(&now, &ts, sizeof ts);
    kvpt_state_free(&before);
    kvpt_destroy_cache(c, pool);
    detach_and_destroy(pool, tier);
    destroy_pool(pool);
}

/*
 * A tier that does not complete (its gate stays closed) never holds up an
 * eviction: 80 published pages are evicted, the first 64 writes wait in
 * flight (the pool's ring), the other 16 are dropped and counted; once the
 * gate opens, detach returns with all 64 completed.
 */
static void test_tier_async_stuck_tier_drops_writes(void **state)
{
    (void)state;
    enum { CACHES = 5, LANES = 4, PAGES = CACHES * LANES * (CAPACITY / BT) };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_tier *store = host_tier(1 << 24);
    async_tier *a = NULL;
    kvp_tier *tier = async_tier_create(store, &a);
    attach(pool, tier, 0);
    kvp_error err;
    for (size_t c = 0; c < CACHES; c++) {
        kvp_cache *cache = external_cache(pool, LANES, 1);
        append(cache, pool, LANES, CAPACITY, (double)c);
        kvp_block_key keys[LANES * (CAPACITY / BT)];
        for (size_t j = 0; j < CAPACITY / BT; j++) {
            for (size_t lane = 0; lane < LANES; lane++) {
                keys[j * LANES + lane].lo = 1 + c * 1000 + j * 10 + lane;
                keys[j * LANES + lane].hi = 7;
                kvpt_assert_ok(kvp_cache_publish_block(cache, lane, j, &keys[j * LANES + lane],
                                                       &err),
                               &err);
            }
        }
        kvpt_destroy_cache(cache, pool);
    }
    assert_int_equal(kvpt_stats(pool).evictable_pages, PAGES);
    kvp_cache *fillers[CACHES];
    for (size_t c = 0; c < CACHES; c++) { /* every page taken: all 80 evicted */
        fillers[c] = external_cache(pool, LANES, 2);
        append(fillers[c], pool, LANES, CAPACITY, 50.0);
    }
    for (size_t c = 0; c < CACHES; c++) {
        kvpt_destroy_cache(fillers[c], pool);
    }
    assert_int_equal(kvpt_stats(pool).evictions, PAGES);
    kvp_pool_tier_stats ts = tier_stats(pool);
    assert_int_equal(ts.writes, PAGES);
    assert_int_equal(ts.write_failures, PAGES - 64);
    assert_int_equal(async_queued(a), 64);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, detacher, pool), 0);
    async_open(a, 1);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(host_stats(store).puts, 64);
    assert_int_equal(async_queued(a), 0);
    kvpt_assert_ok(kvp_tier_destroy(tier, &err), &err);
    kvpt_assert_ok(kvp_tier_destroy(store, &err), &err);
    destroy_pool(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tier_async_completion),
        cmocka_unit_test(test_tier_async_prefetch_then_map),
        cmocka_unit_test(test_tier_async_composed),
        cmocka_unit_test(test_tier_async_stuck_tier_drops_writes),
        cmocka_unit_test(test_tier_failing_tier),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
