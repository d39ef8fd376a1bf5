/*
 * pool_cycles.c: pools made and unmade, over and over, in flat memory.
 *
 * Two phases, each run by T threads at once (the slab arenas are recycled
 * through one process-wide list, so the threads contend for it):
 *   pools   `--cycles` pool create/destroy cycles. Each thread keeps its
 *           previous pool alive while it creates the next one, and budgets
 *           alternate between a small and a large slab, so recycled arenas
 *           serve slabs of other sizes and come back out of order.
 *   caches  `--cache-cycles` cycles of pool + layer + cache + ticket: a few
 *           forwards and allocator-only appends, a reset, a few more
 *           forwards, then everything destroyed. Every status, length and
 *           the pool's final counters are checked.
 * Memory is read after the first `--warmup` cycles of a phase and again at
 * its end: jemalloc's stats.resident and stats.metadata (after an epoch
 * refresh) and the resident set of /proc/self/statm. Each may grow by at
 * most `--max-growth` bytes.
 *
 * Nothing that scheduling or time decides may move the numbers. Memory is
 * read only while every thread waits at a barrier, after each has flushed
 * its thread cache (cached blocks count as active) and main has purged every
 * arena (dirty pages count as resident until the decay clock purges them).
 * A new slab arena costs about 90 KiB of metadata once, so before its warmup
 * every thread holds two pools at once (as many as a phase ever keeps alive
 * per thread); and the threads live through both phases. So no arena,
 * thread cache or automatic arena binding is first needed after the
 * baseline, however the threads interleave.
 *
 * Where the numbers say nothing the check is skipped, and the output says
 * so: under Valgrind, malloc is the tool's and the process's RSS is the
 * tool's; under ASan or TSan the RSS holds shadow memory and quarantine (the
 * jemalloc stats are still checked there, as jemalloc still serves the
 * slabs).
 *
 * Exit status 0 when all of that holds, 1 otherwise, 2 on usage errors.
 */
#include <jemalloc/jemalloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <valgrind/valgrind.h>

#include "pager/cache_internal.h"
#include "stress_common.h"

#define PROGRAM "stress-pool-cycles"
#define WIDTH 16
#define HEADS 2
#define BLOCK 4
#define CAPACITY 32
#define FORWARDS 5
#define APPENDS 3

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define RSS_SKIP_REASON "RSS not checked: the sanitizer's shadow memory and quarantine are in it"
#else
#define RSS_SKIP_REASON NULL
#endif
static const char *const rss_skip_reason = RSS_SKIP_REASON;

typedef struct memory {
    size_t resident; /* jemalloc stats.resident */
    size_t metadata; /* jemalloc stats.metadata */
    size_t rss;      /* /proc/self/statm resident pages, in bytes */
} memory;

typedef enum phase_kind { PHASE_POOLS, PHASE_CACHES, PHASE_COUNT } phase_kind;

static const char *const phase_names[PHASE_COUNT] = {"pools", "caches"};

/* What main and the cyclers share; the barrier counts them all. */
typedef struct plan {
    size_t threads;
    size_t cycles[PHASE_COUNT];
    size_t warmup;
    pthread_barrier_t barrier;
} plan;

typedef struct cycler {
    size_t id;
    pthread_t thread;
    plan *plan;
    uint64_t rng;
    int failed;
    char failure[512];
} cycler;

static void cycler_fail(cycler *c, const char *what, const kvp_error *err)
{
    if (c->failed) {
        return;
    }
    c->failed = 1;
    char text[384] = "";
    if (err != NULL) {
        kvp_error_format(err, text, sizeof text);
    }
    snprintf(c->failure, sizeof c->failure, "thread %zu: %s: %s", c->id, what, text);
}

/*
 * Purges first: the automatic arenas keep freed pages dirty for a while
 * (opt.dirty_decay_ms), and stats.resident and the RSS count them, so the
 * decay clock would otherwise decide the numbers.
 */
static int memory_read(memory *out)
{
    char purge[64];
    snprintf(purge, sizeof purge, "arena.%u.purge", (unsigned)MALLCTL_ARENAS_ALL);
    uint64_t epoch = 1;
    size_t epoch_size = sizeof epoch;
    size_t size = sizeof(size_t);
    memory m = {0, 0, 0};
    if (mallctl(purge, NULL, NULL, NULL, 0) != 0 ||
        mallctl("epoch", &epoch, &epoch_size, &epoch, epoch_size) != 0 ||
        mallctl("stats.resident", &m.resident, &size, NULL, 0) != 0 ||
        mallctl("stats.metadata", &m.metadata, &size, NULL, 0) != 0) {
        fprintf(stderr, PROGRAM ": cannot read jemalloc's stats\n");
        return 1;
    }
    if (stress_rss_bytes(PROGRAM, &m.rss) != 0) {
        return 1;
    }
    *out = m;
    return 0;
}

/* Budgets alternate: 16 pages, then 1024 pages (a 1 MiB slab, the largest). */
static kvp_pool_config pool_config(size_t cycle)
{
    size_t page_bytes = 2 * HEADS * BLOCK * (WIDTH / HEADS) * sizeof(double);
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BLOCK;
    config.heads = HEADS;
    config.head_width = WIDTH / HEADS;
    config.budget_bytes = (cycle % 2 == 0 ? 16 : 1024) * page_bytes;
    config.dtype = KVP_F64;
    return config;
}

static void cycle_pools(cycler *c, size_t cycles)
{
    kvp_pool *previous = NULL;
    for (size_t i = 0; i < cycles && !c->failed; i++) {
        kvp_pool_config config = pool_config(i);
        kvp_pool *pool = NULL;
        kvp_error err;
        if (kvp_pool_create(&config, &pool, &err) != KVP_OK) {
            cycler_fail(c, "creating a pool", &err);
            break;
        }
        if (previous != NULL && kvp_pool_destroy(previous, &err) != KVP_OK) {
            cycler_fail(c, "destroying a pool", &err);
        }
        previous = pool;
    }
    kvp_error err;
    if (previous != NULL && kvp_pool_destroy(previous, &err) != KVP_OK) {
        cycler_fail(c, "destroying the last pool", &err);
    }
}

/* Forwards `count` random tokens; the cache must grow by exactly as many. */
static void forward_tokens(cycler *c, kvp_layer *layer, kvp_cache *cache, kvp_ticket *ticket,
                           size_t count)
{
    kvp_cache_info before;
    kvp_cache_info_init(&before);
    kvp_cache_info after;
    kvp_cache_info_init(&after);
    kvp_error err;
    if (kvp_cache_info_get(cache, &before, &err) != KVP_OK) {
        cycler_fail(c, "reading the cache", &err);
        return;
    }
    for (size_t t = 0; t < count && !c->failed; t++) {
        double row[WIDTH];
        stress_fill(row, WIDTH, &c->rng);
        kvp_tensor input = kvp_tensor3(row, 1, 1, WIDTH);
        if (kvp_attention_forward(layer, &input, cache, ticket, &err) != KVP_OK) {
            cycler_fail(c, "a forward", &err);
        }
    }
    if (!c->failed && (kvp_cache_info_get(cache, &after, &err) != KVP_OK ||
                       after.len != before.len + count)) {
        cycler_fail(c, "forwards did not grow the cache by one row each", NULL);
    }
}

static void append_rows(cycler *c, kvp_cache *cache, size_t count)
{
    double key[WIDTH] = {0};
    double value[WIDTH] = {0};
    kvp_tensor k = kvp_tensor4(key, 1, HEADS, 1, WIDTH / HEADS);
    kvp_tensor v = kvp_tensor4(value, 1, HEADS, 1, WIDTH / HEADS);
    for (size_t t = 0; t < count && !c->failed; t++) {
        kvp_error err;
        stress_fill(key, WIDTH, &c->rng);
        stress_fill(value, WIDTH, &c->rng);
        if (kvpi_cache_append(cache, &k, &v, &err) != KVP_OK) {
            cycler_fail(c, "an append", &err);
        }
    }
}

/* One pool with a layer, a cache and a ticket attached and used. */
static void cycle_cache_once(cycler *c, size_t i)
{
    kvp_pool_config config = pool_config(i);
    kvp_pool *pool = NULL;
    kvp_layer *layer = NULL;
    kvp_cache *cache = NULL;
    kvp_ticket *ticket = NULL;
    kvp_binding binding;
    kvp_error err;
    if (kvp_pool_create(&config, &pool, &err) != KVP_OK ||
        kvp_layer_create_random(WIDTH, HEADS, CAPACITY, 10000.0, c->rng, &layer, &err) !=
            KVP_OK ||
        kvp_layer_binding_get(layer, &binding, &err) != KVP_OK ||
        kvp_cache_create(pool, &binding, 1, CAPACITY, &cache, &err) != KVP_OK ||
        kvp_ticket_create(cache, &ticket, &err) != KVP_OK) {
        cycler_fail(c, "setting up a pool with a cache", &err);
    }
    if (!c->failed) {
        forward_tokens(c, layer, cache, ticket, FORWARDS);
        append_rows(c, cache, APPENDS);
        if (kvp_cache_reset(cache, &err) != KVP_OK) {
            cycler_fail(c, "resetting the cache", &err);
        }
        forward_tokens(c, layer, cache, ticket, FORWARDS);
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvp_ticket_destroy(ticket, NULL);
    kvp_cache_destroy(cache, NULL);
    if (!c->failed && pool != NULL &&
        (kvp_pool_stats_get(pool, &stats, &err) != KVP_OK ||
         stats.free_pages != stats.total_pages || stats.acquires != stats.releases ||
         stats.acquires == 0 || stats.attached_caches != 0)) {
        cycler_fail(c, "the pool is not whole after its cache is destroyed", NULL);
    }
    kvp_layer_destroy(layer, NULL);
    if (pool != NULL && kvp_pool_destroy(pool, &err) != KVP_OK) {
        cycler_fail(c, "destroying a pool", &err);
    }
}

static void run_kind(cycler *c, phase_kind kind, size_t cycles)
{
    if (kind == PHASE_POOLS) {
        cycle_pools(c, cycles);
        return;
    }
    for (size_t i = 0; i < cycles && !c->failed; i++) {
        cycle_cache_once(c, i);
    }
}

/* This thread's share of n cycles. */
static size_t share(const cycler *c, size_t n)
{
    size_t threads = c->plan->threads;
    return n / threads + (c->id < n % threads);
}

/*
 * Every thread holds two pools at once (the most a phase ever has alive per
 * thread) until all do, then frees them. So every slab arena the phase will
 * need exists, parked, before memory is first read, whatever the scheduling;
 * and each has served the largest slab, so none must map (and index) a
 * larger region later, whichever arena serves which slab.
 */
static void hold_pools(cycler *c)
{
    kvp_pool *held[2] = {NULL, NULL};
    for (size_t i = 0; i < 2 && !c->failed; i++) {
        kvp_pool_config config = pool_config(1); /* the large one */
        kvp_error err;
        if (kvp_pool_create(&config, &held[i], &err) != KVP_OK) {
            cycler_fail(c, "creating a pool", &err);
        }
    }
    pthread_barrier_wait(&c->plan->barrier); /* 1: all pools held */
    for (size_t i = 0; i < 2; i++) {
        kvp_error err;
        if (held[i] != NULL && kvp_pool_destroy(held[i], &err) != KVP_OK) {
            cycler_fail(c, "destroying a pool", &err);
        }
    }
}

/*
 * Freed blocks this thread's cache keeps count as active in stats.resident;
 * how many it keeps at a barrier depends on the interleaving, so each thread
 * empties its cache before memory is read.
 */
static void flush_thread_cache(void)
{
    (void)mallctl("thread.tcache.flush", NULL, NULL, NULL, 0);
}

/*
 * The threads live through both phases, so their own allocator state (thread
 * caches, the automatic arena each is bound to) also exists before memory is
 * first read. Every thread passes every barrier, failed or not.
 */
static void *cycler_main(void *arg)
{
    cycler *c = arg;
    plan *p = c->plan;
    for (int kind = 0; kind < PHASE_COUNT; kind++) {
        size_t total = p->cycles[kind];
        size_t first = p->warmup < total ? p->warmup : total;
        hold_pools(c);
        run_kind(c, (phase_kind)kind, share(c, first));
        flush_thread_cache();
        pthread_barrier_wait(&p->barrier); /* 2: warmup over, main reads memory */
        pthread_barrier_wait(&p->barrier); /* 3: read */
        run_kind(c, (phase_kind)kind, share(c, total - first));
        flush_thread_cache();
        pthread_barrier_wait(&p->barrier); /* 4: phase over, main reads memory */
        pthread_barrier_wait(&p->barrier); /* 5: read */
    }
    return NULL;
}

static long long growth(size_t before, size_t after)
{
    return (long long)after - (long long)before;
}

/* Checks one measure; prints it either way. */
static int check_growth(const char *phase, const char *name, size_t before, size_t after,
                        size_t cycles, size_t limit, const char *skip)
{
    long long grown = growth(before, after);
    double per_cycle = cycles != 0 ? (double)grown / (double)cycles : 0.0;
    int bad = skip == NULL && grown > (long long)limit;
    printf("  %-6s %-9s %12zu -> %12zu bytes: %+lld (%+.1f per cycle)%s%s\n", phase, name, before,
           after, grown, per_cycle, bad ? "  TOO MUCH" : "", skip != NULL ? "  (not checked)" : "");
    return bad;
}

/* Main's side of one phase: the same barriers as cycler_main, and the checks. */
static int run_phase(plan *p, phase_kind kind, size_t limit, const char *skip_all)
{
    const char *phase = phase_names[kind];
    size_t first = p->warmup < p->cycles[kind] ? p->warmup : p->cycles[kind];
    memory before;
    memory after;
    double start = stress_seconds();
    pthread_barrier_wait(&p->barrier); /* 1 */
    pthread_barrier_wait(&p->barrier); /* 2 */
    int unread = memory_read(&before);
    pthread_barrier_wait(&p->barrier); /* 3 */
    pthread_barrier_wait(&p->barrier); /* 4 */
    unread |= memory_read(&after);
    pthread_barrier_wait(&p->barrier); /* 5 */
    if (unread) {
        return 1;
    }
    size_t measured = p->cycles[kind] - first;
    printf("%s: %s: %zu cycles on %zu threads, memory from cycle %zu to %zu (%.2f s):\n",
           PROGRAM, phase, p->cycles[kind], p->threads, first, p->cycles[kind],
           stress_seconds() - start);
    const char *rss_skip = skip_all != NULL ? skip_all : rss_skip_reason;
    int bad = check_growth(phase, "resident", before.resident, after.resident, measured, limit,
                           skip_all);
    bad |= check_growth(phase, "metadata", before.metadata, after.metadata, measured, limit,
                        skip_all);
    bad |= check_growth(phase, "rss", before.rss, after.rss, measured, limit, rss_skip);
    return bad;
}

int main(int argc, char **argv)
{
    size_t cycles = 100000;
    size_t cache_cycles = 10000;
    size_t warmup = 100;
    size_t threads = 1;
    size_t max_growth = 1u << 20;
    size_t seed = 1;
    stress_option options[] = {
        {"--cycles", &cycles, "pool create/destroy cycles"},
        {"--cache-cycles", &cache_cycles, "cycles with a layer, cache and ticket used"},
        {"--warmup", &warmup, "cycles of each phase before memory is first read"},
        {"--threads", &threads, "threads sharing each phase's cycles"},
        {"--max-growth", &max_growth, "bytes each measure may grow after the warmup"},
        {"--seed", &seed, "seed of weights and inputs"},
    };
    int parsed = stress_parse(argc, argv,
                              "Create and destroy pools (bare, then with caches used) many "
                              "times; jemalloc's resident and metadata bytes and the RSS must "
                              "stay flat.",
                              options, sizeof options / sizeof options[0]);
    if (parsed != 0) {
        return parsed == 1 ? 0 : 2;
    }
    if (threads == 0) {
        fprintf(stderr, PROGRAM ": --threads must be positive\n");
        return 2;
    }
    const char *skip_all = NULL;
    if (RUNNING_ON_VALGRIND) {
        skip_all = "under Valgrind malloc and RSS are the tool's";
    }
    plan p;
    memset(&p, 0, sizeof p);
    p.threads = threads;
    p.cycles[PHASE_POOLS] = cycles;
    p.cycles[PHASE_CACHES] = cache_cycles;
    p.warmup = warmup;
    cycler *cyclers = calloc(threads, sizeof *cyclers);
    if (cyclers == NULL || pthread_barrier_init(&p.barrier, NULL, (unsigned)threads + 1) != 0) {
        fprintf(stderr, PROGRAM ": out of memory\n");
        return 1;
    }
    for (size_t t = 0; t < threads; t++) {
        cycler *c = &cyclers[t];
        c->id = t;
        c->plan = &p;
        c->rng = seed * 1000003u + t;
        if (pthread_create(&c->thread, NULL, cycler_main, c) != 0) {
            /* The started threads would wait at the first barrier for this one. */
            fprintf(stderr, PROGRAM ": cannot start thread %zu\n", t);
            exit(1);
        }
    }
    int failed = 0;
    for (int kind = 0; kind < PHASE_COUNT; kind++) {
        failed |= run_phase(&p, (phase_kind)kind, max_growth, skip_all);
    }
    for (size_t t = 0; t < threads; t++) {
        pthread_join(cyclers[t].thread, NULL);
        if (cyclers[t].failed) {
            fprintf(stderr, PROGRAM ": %s\n", cyclers[t].failure);
            failed = 1;
        }
    }
    pthread_barrier_destroy(&p.barrier);
    free(cyclers);
    if (skip_all != NULL) {
        printf("%s: memory growth not checked: %s\n", PROGRAM, skip_all);
    } else if (rss_skip_reason != NULL) {
        printf("%s: %s\n", PROGRAM, rss_skip_reason);
    }
    printf("%s: %zu + %zu cycles, growth limit %zu bytes: %s\n", PROGRAM, cycles, cache_cycles,
           max_growth, failed ? "FAILED" : "ok");
    return failed;
}
