/*
 * tier_overhead.c: what a second tier costs a run it never helps (issue 20:
 * with a tier and no hits, throughput >= 0.95x the run without one),
 * measured in one process, alternating.
 *
 * The workload is `kvpager simulate`'s default (sharegpt, unique prompts,
 * the default model geometry; sim.h, kvp_sim_run in this process), run
 * --rounds times in each of three cases, one after the other within each
 * round, the order rotated round by round:
 *   none   no tier;
 *   host   --tier host:--host-mib MiB (the tier's write path without a
 *          network: the pool's packing and MAC, the host tier's copy);
 *   redis  a Redis tier: a private redis-server on a free 127.0.0.1 port
 *          (tests/redis_server.c; stopped at the end), emptied (FLUSHALL)
 *          before every redis run, or the server at --redis URL (never
 *          emptied: the user's data; --redis-pid names its process, to
 *          measure its CPU when it runs here). Every tier run draws a fresh random
 *          deployment secret, so its chain keys are new and nothing it looks
 *          up was written before: no hits.
 * --policy publish (the default) writes every block the run computes, and
 * at the default --budget-mib 1024 nothing is evicted, so every lookup
 * misses; --policy evict writes the pages the pool evicts. Per run: tokens/s
 * (kvp_sim_result), wall seconds, this process's CPU seconds (getrusage:
 * the decoder's threads, the scheduler on this thread, the tier's writer
 * and reader threads), this thread's CPU seconds (CLOCK_THREAD_CPUTIME_ID:
 * the scheduler, where pages are evicted and handed to the tier), and the
 * private redis-server's CPU seconds (/proc/PID/stat utime + stime).
 * Printed: each round; per case the medians, the median of the rounds'
 * ratios to none, CPU microseconds per generated token; and the arithmetic
 * of a CPU-bound machine: none's CPU per token over the redis case's CPU
 * per token (its process and its server), the ratio to expect when every
 * core is busy. Outputs must agree: each run's output checksum equals
 * none's (exit 1 if not), and tier hits are counted (reported; 0 expected).
 *
 * Memory: by default (--memory warm) a server's steady state. Every run's
 * pool takes its slab from one mapping this program faults in once, before
 * the first round, and keeps (KVP_SLAB_CUSTOM, sim.h's slab hooks), as a
 * server's pool is created once and stays in memory; and every host run
 * uses one host tier (sim_tier.h's given tier), made before the first round,
 * then filled to its budget (one untimed host run, then filler blocks under
 * keys no run asks for), so each block a run writes evicts one and reuses
 * its memory, as a host tier that has served a while does. Each run's fresh
 * secret still makes every lookup miss. With --memory fresh each run makes
 * its own: a pool on the default source (a jemalloc arena purged when the
 * pool is freed) and an empty host tier, so each run faults in its pool's
 * pages and its tier's blocks again: on this VM the pool's alone costs 0.5
 * to 1.5 s of a 3.5 s run, varying from run to run by more than the tier's
 * whole cost (docs/bench.md).
 *
 * Flags (bench/args.h; --help lists them): --rounds, --requests,
 * --budget-mib, --host-mib, --threads, --policy, --loads, --memory,
 * --redis, --redis-pid.
 * Exit status 0, 1 on a failure, 2 on a usage error. Speed is reported,
 * never enforced.
 */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "args.h"
#include "measure.h"
#include "redis_server.h"
#include "sim.h"
#include "workload.h"

enum { NONE, HOST, REDIS, CASES };
static const char *const case_names[CASES] = {"none", "host", "redis"};

#define MAX_ROUNDS 1000

typedef struct run_figures {
    double tps, wall, cpu, thread_cpu, server_cpu;
    uint64_t tokens, writes, hits, errors, write_failures;
    size_t block_bytes;
    size_t threads;
    double checksum;
} run_figures;

/* One mapping every run's pool takes as its slab (--pool-memory warm). */
typedef struct warm_slab {
    void *base; /* MAP_FAILED: none */
    size_t bytes;
    int lent;   /* a pool holds it */
} warm_slab;

typedef struct bench {
    kvp_sim_config config;
    warm_slab slab;
    kvp_tier *host_tier; /* --memory warm: every host run's, full */
    kvp_workload workload;
    size_t host_bytes;
    const char *url;         /* the Redis tier's */
    char own_url[64];
    kvpt_redis_server server; /* pid 0: --redis given */
    pid_t server_pid;         /* whose CPU is measured: the private server's, --redis-pid, 0 */
    redisContext *admin;     /* FLUSHALL on the private server */
} bench;

static double seconds_of(struct timeval t)
{
    return (double)t.tv_sec + (double)t.tv_usec * 1e-6;
}

static double process_cpu(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return seconds_of(u.ru_utime) + seconds_of(u.ru_stime);
}

static double thread_cpu(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* utime + stime of a process in seconds (/proc/PID/stat fields 14, 15); 0 when unknown. */
static double pid_cpu(pid_t pid)
{
    if (pid <= 0) {
        return 0.0;
    }
    char path[64], text[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        return 0.0;
    }
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    const char *p = strrchr(text, ')'); /* the command name may hold spaces */
    unsigned long long utime = 0, stime = 0;
    if (p == NULL || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu",
                            &utime, &stime) != 2) {
        return 0.0;
    }
    return (double)(utime + stime) / (double)sysconf(_SC_CLK_TCK);
}

static int flush_private(bench *b)
{
    if (b->admin == NULL) {
        return 0;
    }
    redisReply *r = redisCommand(b->admin, "FLUSHALL");
    int ok = r != NULL && r->type == REDIS_REPLY_STATUS;
    if (r != NULL) {
        freeReplyObject(r);
    }
    if (!ok) {
        fprintf(stderr, "bench-tier-overhead: FLUSHALL on the private redis-server failed\n");
    }
    return ok ? 0 : -1;
}

/* kvp_slab_alloc_fn: the warm mapping, when it is free and large enough. */
static void *slab_lend(void *ctx, size_t bytes, size_t alignment)
{
    warm_slab *w = ctx;
    if (w->lent || bytes > w->bytes || alignment > 4096) {
        return NULL; /* the pool's create fails: ALLOCATION_FAILED */
    }
    w->lent = 1;
    return w->base;
}

/* kvp_slab_free_fn: the mapping back, its pages still in memory. */
static void slab_return(void *ctx, void *slab, size_t bytes)
{
    warm_slab *w = ctx;
    (void)slab;
    (void)bytes;
    w->lent = 0;
}

/*
 * Maps `bytes` (the budget: a pool's slab is at most that) with huge pages
 * where the kernel gives them, and writes every page once, so no run
 * faults it in. 0, or 1 (the exit status) after a message.
 */
static int slab_warm(bench *b, size_t bytes)
{
    b->slab.bytes = bytes;
    b->slab.base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (b->slab.base == MAP_FAILED) {
        fprintf(stderr, "bench-tier-overhead: mapping %zu bytes for the pool failed\n", bytes);
        return 1;
    }
    (void)madvise(b->slab.base, bytes, MADV_HUGEPAGE); /* a hint: fine if refused */
    memset(b->slab.base, 0x5a, bytes);
    b->config.slab_alloc = slab_lend;
    b->config.slab_free = slab_return;
    b->config.slab_ctx = &b->slab;
    return 0;
}

static int run_case(bench *b, int which, run_figures *out);

/*
 * --memory warm: the host tier every host run uses, filled to its budget:
 * one untimed host run (which also learns the block size), then filler
 * blocks of that size under keys no run asks for, until the tier evicts.
 * 0, or 1 (the exit status) after a message.
 */
static int host_warm(bench *b)
{
    kvp_error err;
    if (kvp_tier_host_create(b->host_bytes, &b->host_tier, &err) != KVP_OK) {
        fprintf(stderr, "bench-tier-overhead: host tier: %s\n", kvp_status_name(err.status));
        return 1;
    }
    run_figures first;
    if (run_case(b, HOST, &first) != 0) {
        return 1;
    }
    unsigned char *filler = calloc(1, first.block_bytes);
    kvp_tier_host_stats hs;
    kvp_tier_host_stats_init(&hs);
    int failed = filler == NULL;
    for (uint64_t n = 1; !failed && hs.evictions == 0; n++) {
        kvp_tier_block blk = {.key = {n, ~n}, .data = filler, .bytes = first.block_bytes};
        failed = kvp_tier_run(b->host_tier, KVP_TIER_PUT, &blk, 1, &err) != KVP_OK ||
                 blk.status != KVP_OK ||
                 kvp_tier_host_stats_get(b->host_tier, &hs, &err) != KVP_OK;
    }
    free(filler);
    if (failed) {
        fprintf(stderr, "bench-tier-overhead: filling the host tier failed\n");
        return 1;
    }
    return 0;
}

/* One run of case `which`: 0, or -1 after a message. */
static int run_case(bench *b, int which, run_figures *out)
{
    kvp_sim_config c = b->config;
    if (which != NONE) {
        c.tier.count = 1;
        c.tier.tiers[0].redis = which == REDIS;
        c.tier.tiers[0].host_bytes = b->host_bytes;
        c.tier.tiers[0].url = b->url;
        c.tier.tiers[0].given = which == HOST ? b->host_tier : NULL;
        if (getrandom(c.tier.secret, sizeof c.tier.secret, 0) != (ssize_t)sizeof c.tier.secret) {
            fprintf(stderr, "bench-tier-overhead: getrandom failed\n");
            return -1;
        }
    }
    if (which == REDIS && flush_private(b) != 0) {
        return -1;
    }
    kvp_sim_result result;
    memset(&result, 0, sizeof result);
    kvp_error err;
    const char *context = NULL;
    double cpu0 = process_cpu(), thread0 = thread_cpu(), server0 = pid_cpu(b->server_pid);
    int failed = kvp_sim_run(&c, &b->workload, NULL, NULL, &result, &err, &context);
    double cpu1 = process_cpu(), thread1 = thread_cpu(), server1 = pid_cpu(b->server_pid);
    if (failed != 0) {
        fprintf(stderr, "bench-tier-overhead: %s: %s\n", context != NULL ? context : "simulate",
                kvp_status_name(err.status));
        return -1;
    }
    *out = (run_figures){.tps = result.tokens_per_second, .wall = result.seconds,
                         .cpu = cpu1 - cpu0, .thread_cpu = thread1 - thread0,
                         .server_cpu = server1 - server0, .tokens = result.tokens_generated,
                         .writes = result.tier.writes, .hits = result.tier.hit_blocks,
                         .errors = result.tier.errors,
                         .write_failures = result.tier.write_failures,
                         .threads = result.threads,
                         .block_bytes = result.tier.block_bytes,
                         .checksum = result.output_checksum};
    kvp_sim_result_free(&result);
    return 0;
}

static double median_of(run_figures runs[][CASES], size_t rounds, int which, size_t field)
{
    double v[MAX_ROUNDS];
    for (size_t r = 0; r < rounds; r++) {
        v[r] = *(const double *)((const char *)&runs[r][which] + field);
    }
    return kvp_measure_median(v, rounds);
}

static double median_ratio(run_figures runs[][CASES], size_t rounds, int which)
{
    double v[MAX_ROUNDS];
    for (size_t r = 0; r < rounds; r++) {
        v[r] = runs[r][NONE].tps > 0.0 ? runs[r][which].tps / runs[r][NONE].tps : 0.0;
    }
    return kvp_measure_median(v, rounds);
}

/* Microseconds per generated token of a median CPU figure. */
static double us_per_token(double seconds, const run_figures *any)
{
    return any->tokens > 0 ? seconds / (double)any->tokens * 1e6 : 0.0;
}

static void report(run_figures runs[][CASES], size_t rounds, const bench *b)
{
    printf("\nmedians of %zu rounds (%zu requests, %llu generated tokens a run, %zu decoder "
           "threads, %ld cores online):\n",
           rounds, b->workload.count, (unsigned long long)runs[0][NONE].tokens,
           runs[0][NONE].threads, sysconf(_SC_NPROCESSORS_ONLN));
    printf("%-6s %10s %11s %8s %11s %12s %12s %8s %6s\n", "case", "tokens/s", "ratio",
           "wall s", "cpu us/tok", "thread us/t", "server us/t", "writes", "hits");
    double cpu[CASES], server[CASES];
    for (int k = 0; k < CASES; k++) {
        cpu[k] = median_of(runs, rounds, k, offsetof(run_figures, cpu));
        server[k] = median_of(runs, rounds, k, offsetof(run_figures, server_cpu));
        char server_text[32] = "-";
        if (k == REDIS && b->server_pid > 0) {
            snprintf(server_text, sizeof server_text, "%.1f",
                     us_per_token(server[k], &runs[0][k]));
        }
        printf("%-6s %10.1f %10.3fx %8.3f %11.1f %12.1f %12s %8llu %6llu\n", case_names[k],
               median_of(runs, rounds, k, offsetof(run_figures, tps)),
               median_ratio(runs, rounds, k),
               median_of(runs, rounds, k, offsetof(run_figures, wall)),
               us_per_token(cpu[k], &runs[0][k]),
               us_per_token(median_of(runs, rounds, k, offsetof(run_figures, thread_cpu)),
                            &runs[0][k]),
               server_text, (unsigned long long)runs[0][k].writes,
               (unsigned long long)runs[0][k].hits);
    }
    printf("ratio: the median of the rounds' tokens/s over none's in the same round; cpu: this "
           "process (decoders, scheduler, tier threads); thread: this thread (the scheduler)\n");
    double tier_cpu = cpu[REDIS] + server[REDIS];
    printf("redis tier CPU per token: %.1f us in this process (%+.1f us over none) + %.1f us in "
           "redis-server%s\n",
           us_per_token(cpu[REDIS], &runs[0][REDIS]),
           us_per_token(cpu[REDIS] - cpu[NONE], &runs[0][REDIS]),
           us_per_token(server[REDIS], &runs[0][REDIS]),
           b->server_pid > 0 ? "" : " (not measured: --redis without --redis-pid)");
    if (tier_cpu > 0.0) {
        printf("CPU-bound expectation (every core busy): none's CPU / redis's CPU = %.3fx\n",
               cpu[NONE] / tier_cpu);
    }
    uint64_t hits = 0, errors = 0, failures = 0;
    for (size_t r = 0; r < rounds; r++) {
        for (int k = HOST; k < CASES; k++) {
            hits += runs[r][k].hits;
            errors += runs[r][k].errors;
            failures += runs[r][k].write_failures;
        }
    }
    printf("tier runs: %llu hit blocks, %llu errors, %llu failed writes (all runs)\n",
           (unsigned long long)hits, (unsigned long long)errors,
           (unsigned long long)failures);
}

static int run_rounds(bench *b, size_t rounds)
{
    run_figures (*runs)[CASES] = calloc(rounds, sizeof *runs);
    if (runs == NULL) {
        fprintf(stderr, "bench-tier-overhead: out of memory\n");
        return 1;
    }
    int status = 0;
    for (size_t r = 0; r < rounds && status == 0; r++) {
        for (int i = 0; i < CASES && status == 0; i++) {
            int which = (int)((r + (size_t)i) % CASES);
            status = run_case(b, which, &runs[r][which]) != 0 ? 1 : 0;
        }
        if (status != 0) {
            break;
        }
        for (int k = HOST; k < CASES; k++) {
            if (runs[r][k].checksum != runs[r][NONE].checksum) {
                fprintf(stderr, "bench-tier-overhead: round %zu: %s's output checksum %.17g "
                        "differs from none's %.17g\n",
                        r + 1, case_names[k], runs[r][k].checksum, runs[r][NONE].checksum);
                status = 1;
            }
        }
        printf("round %zu: none %.1f, host %.1f (%.3fx), redis %.1f (%.3fx) tokens/s; "
               "redis writes %llu, hits %llu\n",
               r + 1, runs[r][NONE].tps, runs[r][HOST].tps, runs[r][HOST].tps / runs[r][NONE].tps,
               runs[r][REDIS].tps, runs[r][REDIS].tps / runs[r][NONE].tps,
               (unsigned long long)runs[r][REDIS].writes,
               (unsigned long long)runs[r][REDIS].hits);
        fflush(stdout);
    }
    if (status == 0) {
        report(runs, rounds, b);
    }
    free(runs);
    return status;
}

static int prepare(bench *b, size_t requests)
{
    kvp_workload_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.profile = KVP_PROFILE_SHAREGPT;
    spec.arrival = KVP_ARRIVAL_POISSON;
    spec.rate = 1.0;
    spec.requests = requests;
    spec.capacity = b->config.capacity;
    spec.seed = b->config.seed;
    kvp_workload_spec_defaults(&spec);
    if (kvp_workload_generate(&spec, &b->workload) != 0) {
        fprintf(stderr, "bench-tier-overhead: out of memory for the request list\n");
        return 1;
    }
    if (b->url != NULL) {
        return 0;
    }
    if (!kvpt_redis_start(&b->server, NULL)) {
        fprintf(stderr, "bench-tier-overhead: redis-server did not start: %s\n", b->server.why);
        return 1;
    }
    b->server_pid = b->server.pid;
    snprintf(b->own_url, sizeof b->own_url, "redis://127.0.0.1:%u", b->server.port);
    b->url = b->own_url;
    b->admin = redisConnect("127.0.0.1", (int)b->server.port);
    if (b->admin == NULL || b->admin->err != 0) {
        fprintf(stderr, "bench-tier-overhead: cannot connect to the private redis-server\n");
        return 1;
    }
    return 0;
}

/* A Redis tier on `url` can be made (the URL parses): 0, or 2 after the refusal. */
static int check_url(const bench_args *args, const char *url)
{
    kvp_tier_redis_config rc;
    kvp_tier_redis_config_init(&rc);
    rc.url = url;
    kvp_tier *tier = NULL;
    kvp_error err;
    if (kvp_tier_redis_create(&rc, &tier, &err) != KVP_OK) {
        return bench_args_refuse(args, "--redis", "a redis://[user:password@]host[:port][/db] "
                                 "URL: %s", err.what != NULL ? err.what : "refused");
    }
    (void)kvp_tier_destroy(tier, NULL);
    return 0;
}

int main(int argc, char **argv)
{
    size_t rounds = 7, requests = 128, budget_mib = 1024, host_mib = 1024, threads = 0;
    size_t redis_pid = 0;
    int policy = 1, loads = 0, memory = 0;
    const char *url = NULL;
    static const char *const policies[] = {"evict", "publish", NULL};
    static const char *const load_words[] = {"model", "always", "never", NULL};
    static const char *const memories[] = {"warm", "fresh", NULL};
    bench_arg table[] = {
        BENCH_SIZE("--rounds", &rounds, 1, MAX_ROUNDS, "N", "rounds of none, host, redis"),
        BENCH_SIZE("--requests", &requests, 1, 100000, "N", "requests of the workload"),
        BENCH_SIZE("--budget-mib", &budget_mib, 1, 65536, "N", "the pool's budget in MiB"),
        BENCH_SIZE("--host-mib", &host_mib, 1, 65536, "N", "the host tier's size in MiB"),
        BENCH_SIZE("--threads", &threads, 0, 64, "N", "decoder threads (0: one per core)"),
        BENCH_CHOICE("--policy", &policy, policies, "WORD", "the tiers' write policy"),
        BENCH_CHOICE("--loads", &loads, load_words, "WORD", "the scheduler's tier loads"),
        BENCH_CHOICE("--memory", &memory, memories, "WORD",
                     "warm: one pool slab faulted in once and one full host tier for "
                     "every run; fresh: each run's own"),
        BENCH_TEXT("--redis", &url, "URL",
                   "a Redis server to use (never emptied); default: a private one"),
        BENCH_SIZE("--redis-pid", &redis_pid, 1, 4194304, "PID",
                   "with --redis: its server's process id, whose CPU is measured"),
    };
    bench_args args = BENCH_ARGS("bench-tier-overhead",
                                 "A tier's cost to a run with no hits: none, host and Redis "
                                 "alternating in one process.",
                                 table);
    int parsed = bench_args_parse(&args, argc, argv);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    if (url != NULL && check_url(&args, url) != 0) {
        return 2;
    }
    if (redis_pid != 0 && url == NULL) {
        return bench_args_refuse(&args, "--redis-pid", "only with --redis");
    }
    bench b;
    memset(&b, 0, sizeof b);
    b.slab.base = MAP_FAILED;
    kvp_sim_config_init(&b.config);
    b.config.audit_every = 0;
    b.config.max_running = 256; /* simulate's default --max-running */
    b.config.budget_bytes = budget_mib << 20;
    b.config.threads = threads;
    b.config.tier.write_through = policy == 1;
    b.config.tier.loads = loads;
    b.host_bytes = host_mib << 20;
    b.url = url;
    b.server_pid = (pid_t)redis_pid;
    int status = prepare(&b, requests);
    if (status == 0 && memory == 0) {
        status = slab_warm(&b, b.config.budget_bytes);
    }
    if (status == 0 && memory == 0) {
        status = host_warm(&b);
    }
    if (status == 0) {
        printf("tier overhead: %zu requests (sharegpt, unique prompts), budget %zu MiB, policy "
               "%s, loads %s, memory %s; redis %s%s\n",
               requests, budget_mib, policies[policy], load_words[loads], memories[memory],
               b.server.pid > 0 ? "private at " : "", b.url);
        status = run_rounds(&b, rounds);
    }
    if (b.admin != NULL) {
        redisFree(b.admin);
    }
    if (b.server.dir[0] != '\0') {
        kvpt_redis_stop(&b.server);
    }
    kvp_workload_free(&b.workload);
    if (b.host_tier != NULL) {
        (void)kvp_tier_destroy(b.host_tier, NULL);
    }
    if (b.slab.base != MAP_FAILED) {
        munmap(b.slab.base, b.slab.bytes);
    }
    return status;
}
