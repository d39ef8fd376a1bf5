/*
 * soak.c: the scheduler runs for ever in bounded memory.
 *
 * Submits, steps and collects `--requests` requests through the public
 * scheduler API, allocator-only (compute off) with sharing, sessions and
 * parallel samples on, at most `--inflight` requests submitted and not yet
 * collected at a time:
 *   - plain requests: 1 to 3 samples, prompts of 1 to 24 tokens whose first
 *     blocks come from one of 8 shared prefixes (prefix hits, forks);
 *   - conversations (8 at a time): each turn's prompt is the previous
 *     turn's prompt, its sample 0 reply and a few new tokens, sent when the
 *     previous turn was collected, under a session id (session keeps and
 *     hits); a conversation that would outgrow the capacity ends and a new
 *     one, with a new session id, starts.
 * Every step is followed by a collect of everything finished. Every result
 * must be a completion (no rejection, no failure), its id must be one in
 * flight, collected once, and afterwards kvp_scheduler_request_state must
 * refuse it (REQUEST_UNKNOWN). The pool is audited every 4096 steps and at
 * the end, when it must hold only the kept sessions' pages.
 *
 * Memory is read after `--warmup` requests were collected and again at the
 * end: jemalloc's stats.allocated (after an epoch refresh and a flush of
 * this thread's cache) and the resident set of /proc/self/statm. The RSS
 * may grow by at most `--max-growth` bytes, the allocated bytes by at most
 * `--max-allocated` (flat but for the scheduler's arrays and idle sequences
 * reaching a new peak of concurrency, which a random workload may first
 * hit after the warmup: tens of KiB, then none; one record per request
 * served would be ~700 bytes each). The program's own bookkeeping is
 * fixed-size (a ring of in-flight requests), so all growth is the
 * library's.
 *
 * Where the numbers say nothing the check is skipped, and the output says
 * so: under Valgrind malloc and the RSS are the tool's; under ASan or TSan
 * malloc is the sanitizer's (jemalloc's stats do not see it) and the RSS
 * holds shadow memory and quarantine.
 *
 * Exit status 0 when all of that holds, 1 otherwise, 2 on usage errors.
 */
#include <jemalloc/jemalloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <valgrind/valgrind.h>

#include "stress_common.h"

#define PROGRAM "stress-soak"
#define LAYERS 2
#define WIDTH 8
#define HEADS 2
#define KV_HEADS 1
#define BLOCK 4
#define CAPACITY 64
#define PAGES 192
#define RING 1024 /* in-flight slots; --inflight must stay below */
#define CONVERSATIONS 8
#define PREFIXES 8

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SKIP_REASON "malloc is the sanitizer's and the RSS holds its shadow memory"
#else
#define SKIP_REASON NULL
#endif

/* One request in flight: what its input callback needs. */
typedef struct flight {
    uint64_t id;       /* UINT64_MAX: free */
    uint64_t key;      /* its rows' stream: a conversation's, or the request's own */
    uint64_t prefix;   /* plain requests: the shared prefix group */
    size_t shared;     /* plain requests: positions taken from the prefix group */
    size_t prompt;
    size_t conversation; /* CONVERSATIONS: none */
} flight;

typedef struct conversation {
    uint64_t session; /* 0: none started */
    uint64_t key;
    size_t prompt;    /* the next turn's prompt: every earlier turn with its reply */
    int busy;         /* a turn is in flight */
} conversation;

typedef struct soak {
    kvp_scheduler *scheduler;
    flight ring[RING];
    conversation talks[CONVERSATIONS];
    size_t inflight;
    uint64_t rng;
    uint64_t next_key;
    uint64_t next_session;
    uint64_t submitted;
    uint64_t collected;
    uint64_t turns;
} soak;

typedef struct memory {
    size_t allocated; /* jemalloc stats.allocated */
    size_t rss;       /* /proc/self/statm resident pages, in bytes */
} memory;

static int memory_read(memory *out)
{
    uint64_t epoch = 1;
    size_t epoch_size = sizeof epoch;
    size_t size = sizeof(size_t);
    memory m = {0, 0};
    (void)mallctl("thread.tcache.flush", NULL, NULL, NULL, 0);
    if (mallctl("epoch", &epoch, &epoch_size, &epoch, epoch_size) != 0 ||
        mallctl("stats.allocated", &m.allocated, &size, NULL, 0) != 0) {
        fprintf(stderr, PROGRAM ": cannot read jemalloc's stats\n");
        return 1;
    }
    if (stress_rss_bytes(PROGRAM, &m.rss) != 0) {
        return 1;
    }
    *out = m;
    return 0;
}

static flight *flight_of(soak *k, uint64_t id)
{
    flight *f = &k->ring[id % RING];
    return f->id == id ? f : NULL;
}

static void row_mix(uint64_t key, size_t position, double *row, size_t width)
{
    uint64_t state = key * 0x9E3779B97F4A7C15ull + position;
    stress_fill(row, width, &state);
}

/* Rows: the prefix group's, then the request's (or conversation's) own; samples > 0 their own. */
static void input_row(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                      size_t width)
{
    soak *k = ctx;
    const flight *f = flight_of(k, id);
    if (f == NULL) {
        fprintf(stderr, PROGRAM ": input asked for request %llu, not in flight\n",
                (unsigned long long)id);
        exit(1);
    }
    if (position < f->shared) {
        row_mix(f->prefix, position, row, width);
    } else if (position < f->prompt || sample == 0) {
        row_mix(f->key, position, row, width);
    } else {
        row_mix(f->key ^ (0x51ull << 56) ^ sample, position, row, width);
    }
}

static size_t draw_in(soak *k, size_t lo, size_t hi)
{
    return lo + (size_t)(stress_rand(&k->rng) % (hi - lo + 1));
}

static int submit_one(soak *k, const kvp_request *request, const flight *f)
{
    /* The ring entry is written first: the id is the next one (0, 1, 2, ... in submit order). */
    flight *slot = &k->ring[k->submitted % RING];
    if (slot->id != UINT64_MAX) {
        fprintf(stderr, PROGRAM ": ring slot of request %llu still in flight\n",
                (unsigned long long)k->submitted);
        return 1;
    }
    *slot = *f;
    slot->id = k->submitted;
    uint64_t id = 0;
    kvp_error err;
    if (kvp_scheduler_submit(k->scheduler, request, &id, &err) != KVP_OK) {
        return stress_fail(PROGRAM, "submit", &err);
    }
    if (id != k->submitted) {
        fprintf(stderr, PROGRAM ": submit gave id %llu, expected %llu\n",
                (unsigned long long)id, (unsigned long long)k->submitted);
        return 1;
    }
    k->submitted++;
    k->inflight++;
    return 0;
}

/* The next turn of conversation c, or a new conversation when it would outgrow the capacity. */
static int submit_turn(soak *k, size_t c)
{
    conversation *t = &k->talks[c];
    size_t fresh = draw_in(k, 1, 6);
    size_t new_tokens = draw_in(k, 1, 8);
    if (t->session == 0 || t->prompt + fresh + new_tokens > CAPACITY) {
        t->session = ++k->next_session;
        t->key = ++k->next_key;
        t->prompt = 0;
    }
    kvp_request request;
    kvp_request_init(&request);
    request.prompt_tokens = t->prompt + fresh;
    request.max_new_tokens = new_tokens;
    request.samples = draw_in(k, 1, 2);
    request.input = input_row;
    request.ctx = k;
    request.session = t->session;
    flight f = {0, t->key, 0, 0, request.prompt_tokens, c};
    t->prompt = request.prompt_tokens + new_tokens; /* the next turn holds this reply */
    t->busy = 1;
    k->turns++;
    return submit_one(k, &request, &f);
}

static int submit_plain(soak *k)
{
    kvp_request request;
    kvp_request_init(&request);
    request.prompt_tokens = draw_in(k, 1, 24);
    request.max_new_tokens = draw_in(k, 1, 6);
    request.samples = draw_in(k, 1, 3);
    request.input = input_row;
    request.ctx = k;
    size_t shared = BLOCK * draw_in(k, 0, 4);
    flight f = {0, ++k->next_key, 1u + draw_in(k, 0, PREFIXES - 1),
                shared < request.prompt_tokens ? shared : request.prompt_tokens,
                request.prompt_tokens, CONVERSATIONS};
    return submit_one(k, &request, &f);
}

/* Keeps `inflight` requests in flight (stopping at `limit` submissions); turns go first. */
static int refill(soak *k, size_t inflight, uint64_t limit)
{
    for (size_t c = 0; c < CONVERSATIONS && k->submitted < limit; c++) {
        if (!k->talks[c].busy && k->inflight < inflight) {
            if (submit_turn(k, c) != 0) {
                return 1;
            }
        }
    }
    while (k->inflight < inflight && k->submitted < limit) {
        if (submit_plain(k) != 0) {
            return 1;
        }
    }
    return 0;
}

static int collect(soak *k)
{
    kvp_request_result results[16];
    size_t n = 0;
    do {
        kvp_request_result_init(&results[0]);
        kvp_error err;
        if (kvp_scheduler_collect(k->scheduler, results, 16, &n, &err) != KVP_OK) {
            return stress_fail(PROGRAM, "collect", &err);
        }
        for (size_t i = 0; i < n; i++) {
            const kvp_request_result *r = &results[i];
            flight *f = flight_of(k, r->id);
            if (f == NULL || r->rejected || r->status != KVP_OK) {
                fprintf(stderr, PROGRAM ": result of request %llu: %s, rejected %d, status %s\n",
                        (unsigned long long)r->id, f == NULL ? "not in flight" : "in flight",
                        r->rejected, kvp_status_name(r->status));
                return 1;
            }
            kvp_request_state state;
            if (kvp_scheduler_request_state(k->scheduler, r->id, &state, &err) !=
                KVP_REQUEST_UNKNOWN) {
                fprintf(stderr, PROGRAM ": collected request %llu is still known\n",
                        (unsigned long long)r->id);
                return 1;
            }
            if (f->conversation < CONVERSATIONS) {
                k->talks[f->conversation].busy = 0;
            }
            f->id = UINT64_MAX;
            k->inflight--;
            k->collected++;
        }
    } while (n == 16);
    return 0;
}

static int audit(kvp_pool *pool)
{
    kvp_error err;
    if (kvp_pool_check(pool, NULL, NULL, &err) != KVP_OK) {
        return stress_fail(PROGRAM, "pool audit", &err);
    }
    return 0;
}

/* Steps until `until` requests were collected. */
static int run_until(soak *k, kvp_pool *pool, uint64_t until, uint64_t limit, size_t inflight,
                     uint64_t *steps)
{
    while (k->collected < until) {
        if (refill(k, inflight, limit) != 0) {
            return 1;
        }
        kvp_error err;
        if (kvp_scheduler_step(k->scheduler, NULL, &err) != KVP_OK) {
            return stress_fail(PROGRAM, "step", &err);
        }
        if (collect(k) != 0) {
            return 1;
        }
        if (++*steps % 4096 == 0 && audit(pool) != 0) {
            return 1;
        }
    }
    return 0;
}

static int check_growth(const char *name, size_t before, size_t after, uint64_t requests,
                        size_t limit, const char *skip)
{
    long long grown = (long long)after - (long long)before;
    double per = requests != 0 ? (double)grown / (double)requests : 0.0;
    int bad = skip == NULL && grown > (long long)limit;
    printf("  %-9s %12zu -> %12zu bytes: %+lld (%+.2f per request)%s%s\n", name, before, after,
           grown, per, bad ? "  TOO MUCH" : "", skip != NULL ? "  (not checked)" : "");
    return bad;
}

static int make_scheduler(kvp_model **model, kvp_pool **pool, soak *k)
{
    kvp_error err;
    kvp_pool_config pc;
    kvp_pool_config_init(&pc);
    pc.block_tokens = BLOCK;
    pc.heads = KV_HEADS;
    pc.head_width = WIDTH / HEADS;
    pc.budget_bytes = PAGES * (2 * KV_HEADS * BLOCK * (WIDTH / HEADS) * sizeof(double));
    kvp_scheduler_config sc;
    kvp_scheduler_config_init(&sc);
    sc.capacity = CAPACITY;
    sc.compute = 0;
    sc.reserve_tokens = 4;
    sc.session_ttl = 16;
    sc.session_fraction = 0.25;
    if (kvp_model_create_random_grouped(LAYERS, WIDTH, HEADS, KV_HEADS, CAPACITY, 10000.0, 7,
                                        model, &err) != KVP_OK ||
        kvp_pool_create(&pc, pool, &err) != KVP_OK ||
        kvp_scheduler_create(*model, *pool, NULL, &sc, &k->scheduler, &err) != KVP_OK) {
        return stress_fail(PROGRAM, "setting up", &err);
    }
    return 0;
}

/* The counters say every request completed, and sessions, forks and prefix hits happened. */
static int check_counters(const soak *k, kvp_pool *pool)
{
    kvp_scheduler_stats st;
    kvp_scheduler_stats_init(&st);
    kvp_pool_stats ps;
    kvp_pool_stats_init(&ps);
    kvp_error err;
    if (kvp_scheduler_stats_get(k->scheduler, &st, &err) != KVP_OK ||
        kvp_pool_stats_get(pool, &ps, &err) != KVP_OK) {
        return stress_fail(PROGRAM, "reading stats", &err);
    }
    printf("%s: submitted %llu completed %llu turns %llu session keeps %llu hits %llu drops "
           "%llu forks %llu prefix hit tokens %llu of %llu, preemptions %llu, steps %llu\n",
           PROGRAM, (unsigned long long)st.submitted, (unsigned long long)st.completed,
           (unsigned long long)k->turns, (unsigned long long)st.session_keeps,
           (unsigned long long)st.session_hits, (unsigned long long)st.session_drops,
           (unsigned long long)st.forks, (unsigned long long)st.prefix_hit_tokens,
           (unsigned long long)st.prompt_tokens, (unsigned long long)st.preemptions,
           (unsigned long long)st.steps);
    int bad = st.completed != k->submitted || st.rejected != 0 || st.failed != 0 ||
              st.running != 0 || st.waiting != 0 || st.uncollected != 0;
    bad |= k->submitted > 1000 && (st.session_hits == 0 || st.forks == 0 ||
                                   st.prefix_hit_tokens == 0);
    bad |= ps.held_pages != st.retained_pages;
    if (bad) {
        fprintf(stderr, PROGRAM ": counters do not add up (pool holds %zu, kept %zu)\n",
                ps.held_pages, st.retained_pages);
    }
    return bad | audit(pool);
}

int main(int argc, char **argv)
{
    size_t requests = 2000000;
    size_t warmup = 200000;
    size_t inflight = 48;
    size_t max_growth = 1u << 20;
    size_t max_allocated = 64u << 10;
    size_t seed = 1;
    stress_option options[] = {
        {"--requests", &requests, "requests submitted, stepped and collected"},
        {"--warmup", &warmup, "requests collected before memory is first read"},
        {"--inflight", &inflight, "requests submitted and not yet collected, at most"},
        {"--max-growth", &max_growth, "bytes the RSS may grow after the warmup"},
        {"--max-allocated", &max_allocated, "bytes jemalloc's allocated may grow after it"},
        {"--seed", &seed, "seed of the workload"},
    };
    int parsed = stress_parse(argc, argv,
                              "Submit, step and collect many requests (allocator-only, "
                              "sessions and samples on); jemalloc's allocated bytes and the "
                              "RSS must stay flat.",
                              options, sizeof options / sizeof options[0]);
    if (parsed != 0) {
        return parsed == 1 ? 0 : 2;
    }
    if (inflight == 0 || inflight >= RING || warmup >= requests) {
        fprintf(stderr, PROGRAM ": need 0 < --inflight < %d and --warmup < --requests\n", RING);
        return 2;
    }
    const char *skip = SKIP_REASON;
    if (RUNNING_ON_VALGRIND) {
        skip = "under Valgrind malloc and RSS are the tool's";
    }
    soak *k = calloc(1, sizeof *k);
    if (k == NULL) {
        fprintf(stderr, PROGRAM ": out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < RING; i++) {
        k->ring[i].id = UINT64_MAX;
    }
    k->rng = seed * 0x9E3779B97F4A7C15ull + 1;
    kvp_model *model = NULL;
    kvp_pool *pool = NULL;
    int failed = make_scheduler(&model, &pool, k);
    memory before = {0, 0};
    memory after = {0, 0};
    uint64_t steps = 0;
    double start = stress_seconds();
    failed = failed || run_until(k, pool, warmup, requests, inflight, &steps) ||
             memory_read(&before);
    double measured = stress_seconds();
    failed = failed || run_until(k, pool, requests, requests, inflight, &steps) ||
             memory_read(&after);
    double end = stress_seconds();
    if (!failed) {
        printf("%s: %zu requests in %llu steps, %.2f s (%.0f requests/s); memory from request "
               "%zu to %zu (%.2f s):\n",
               PROGRAM, requests, (unsigned long long)steps, end - start,
               (double)requests / (end - start), warmup, requests, end - measured);
        failed |= check_growth("allocated", before.allocated, after.allocated,
                               requests - warmup, max_allocated, skip);
        failed |= check_growth("rss", before.rss, after.rss, requests - warmup, max_growth,
                               skip);
        failed |= check_counters(k, pool);
    }
    kvp_error err;
    if (kvp_scheduler_destroy(k->scheduler, &err) != KVP_OK ||
        (pool != NULL && kvp_pool_destroy(pool, &err) != KVP_OK) ||
        (model != NULL && kvp_model_destroy(model, &err) != KVP_OK)) {
        failed |= stress_fail(PROGRAM, "tearing down", &err);
    }
    free(k);
    if (skip != NULL) {
        printf("%s: memory growth not checked: %s\n", PROGRAM, skip);
    }
    printf("%s: %zu requests, growth limits %zu bytes (rss), %zu (allocated): %s\n", PROGRAM,
           requests, max_growth, max_allocated, failed ? "FAILED" : "ok");
    return failed;
}
