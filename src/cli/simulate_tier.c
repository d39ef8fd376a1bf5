/*
 * simulate_tier.c: `kvpager simulate`'s second-tier flags, their checks and
 * report lines (issue 20; docs/simulate.md, "A second tier").
 *
 * Owns: --tier host:SIZE | redis://... (repeatable, in order: the first is
 * nearest), --tier-secret-file PATH, --tier-policy evict|publish,
 * --tier-loads model|always|never, --tier-timeout-ms MS and --tier-retry-ms
 * MS (a Redis tier's timeouts and reconnect wait: refused without a Redis
 * tier), each as `--flag v` or `--flag=v`; their
 * help text; the checks (a Redis URL is parsed by making the Redis tier,
 * which connects lazily, and destroying it: never connected; the secret
 * file is read and hashed); the report lines and --json keys of a run with
 * a tier.
 * The deployment secret: BLAKE2b-256 of the secret file's bytes (at least
 * 16); without --tier-secret-file, host tiers alone use a fixed documented
 * default (the BLAKE2b-256 of "kvpager simulate default tier secret v1"):
 * a host tier lives and dies with the process, so no one else reads it.
 * A Redis tier without --tier-secret-file is refused: a shared store's
 * blocks must be authenticated under a secret that is not public.
 * Invariants: parsing checks syntax only and touches nothing; the checks
 * run after the range checks and record only a first problem; a password
 * in a Redis URL is never printed (shown as ***).
 * Callers: simulate_flags.c (take, usage), simulate.c (check),
 * simulate_report.c (report, json).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <sodium.h>

#include "simulate.h"

enum {
    TIER_FLAG,
    SECRET_FLAG,
    POLICY_FLAG,
    LOADS_FLAG,
    TIMEOUT_FLAG,
    RETRY_FLAG,
    TIER_FLAG_COUNT
};

static const char *const tier_flag_names[TIER_FLAG_COUNT] = {
    "--tier",        "--tier-secret-file", "--tier-policy",
    "--tier-loads",  "--tier-timeout-ms",  "--tier-retry-ms"};

/* Bounds of --tier-timeout-ms (1 ms to 10 min) and --tier-retry-ms (0 to the Redis
 * tier's longest backoff, 30 s). */
#define TIMEOUT_MS_MAX 600000u
#define RETRY_MS_MAX 30000u

/* Most bytes of a secret file read (its hash is the secret). */
#define SECRET_FILE_MAX 4096
#define SECRET_FILE_MIN 16

static const char default_secret_text[] = "kvpager simulate default tier secret v1";

void kvp_simulate_tier_usage(FILE *out)
{
    fprintf(out,
            "second tier (evicted prefix blocks kept outside the pool, docs/simulate.md):\n"
            "  --tier SPEC          host:SIZE (this process's memory, SIZE as --budget) or\n"
            "                       redis://[user:password@]host[:port][/db]; repeatable, in\n"
            "                       order, nearest first (host then Redis). Evicted blocks are\n"
            "                       written to it; a prompt block the pool misses is loaded\n"
            "                       from it instead of computed (outputs unchanged, bit for\n"
            "                       bit). Needs sharing (not with --no-sharing). With\n"
            "                       --no-compute: one host:SIZE tier that keeps keys only\n"
            "                       (blocks counted at their size, same LRU; no Redis)\n"
            "  --tier-secret-file PATH  the deployment secret (its BLAKE2b-256; at least 16\n"
            "                       bytes): keys the blocks' MAC and the pool's prefix keys,\n"
            "                       so processes given the same file share blocks. Required\n"
            "                       with redis; host tiers alone default to a fixed public one\n"
            "  --tier-policy WORD   evict (write a block when the pool evicts it) or publish\n"
            "                       (write every block when first published: other processes\n"
            "                       see it at once) (default evict)\n"
            "  --tier-loads WORD    model (load a missed block when the tier's measured\n"
            "                       bytes/s beat this model's prefill tokens/s), always or\n"
            "                       never (default model)\n"
            "  --tier-timeout-ms MS the Redis tier's connect and command timeouts, 1 to 600000\n"
            "                       (default 1000); needs a redis:// --tier\n"
            "  --tier-retry-ms MS   the wait after a failed connect to Redis before the next\n"
            "                       try (doubling up to 30 s), 0 to 30000; 0: the next batch\n"
            "                       tries again (default 1000); needs a redis:// --tier\n\n");
}

/* The length of `arg`'s flag name (up to '=' for --flag=value). */
static size_t name_length(const char *arg)
{
    const char *equals = strchr(arg, '=');
    return equals != NULL ? (size_t)(equals - arg) : strlen(arg);
}

/* --tier-timeout-ms (1..TIMEOUT_MS_MAX) or --tier-retry-ms (0..RETRY_MS_MAX). */
static void take_ms(simulate_options *o, int f, const char *value, kvp_cli_problems *p)
{
    size_t ms = 0;
    unsigned low = f == TIMEOUT_FLAG ? 1u : 0u;
    unsigned high = f == TIMEOUT_FLAG ? TIMEOUT_MS_MAX : RETRY_MS_MAX;
    if (kvp_cli_parse_size(value, &ms) != 0 || ms < low || ms > high) {
        kvp_cli_problem(p, "invalid value for %s: '%s': milliseconds, a whole number from %u to %u",
                        tier_flag_names[f], value, low, high);
        return;
    }
    if (f == TIMEOUT_FLAG) {
        o->sim.tier.redis_timeout_ms = (unsigned)ms;
    } else {
        o->sim.tier.redis_retry_ms = (unsigned)ms;
        o->sim.tier.redis_retry_given = 1;
    }
}

/* Syntax of one --tier value into the next spec (a Redis URL is parsed by the check). */
static void take_tier(simulate_options *o, const char *value, kvp_cli_problems *p)
{
    simulate_tier_options *t = &o->tier;
    if (t->count == KVP_SIM_TIERS_MAX) {
        kvp_cli_problem(p, "invalid value for --tier: '%s': at most %d tiers",
                        strncmp(value, "redis://", 8) == 0 ? "redis://..." : value,
                        KVP_SIM_TIERS_MAX);
        return;
    }
    kvp_sim_tier_spec *spec = &o->sim.tier.tiers[t->count];
    t->values[t->count++] = value;
    o->sim.tier.count = t->count;
    if (strncmp(value, "host:", 5) == 0) {
        spec->redis = 0;
        if (kvp_cli_parse_bytes(value + 5, &spec->host_bytes) != 0 || spec->host_bytes == 0) {
            kvp_cli_problem(p, "invalid value for --tier: '%s': host:SIZE needs a byte count "
                            "above 0 (a number with an optional unit B, KiB, MiB, GiB, ...)",
                            value);
        }
        return;
    }
    if (strncmp(value, "redis://", 8) == 0) {
        spec->redis = 1;
        spec->url = value;
        return;
    }
    kvp_cli_problem(p, "invalid value for --tier: '%s': not host:SIZE or redis://...", value);
}

static void take_word(simulate_options *o, int f, const char *value, kvp_cli_problems *p)
{
    static const char *const policies[] = {"evict", "publish"};
    static const char *const loads[] = {"model", "always", "never"};
    const char *const *words = f == POLICY_FLAG ? policies : loads;
    int count = f == POLICY_FLAG ? 2 : 3;
    for (int i = 0; i < count; i++) {
        if (strcmp(value, words[i]) == 0) {
            if (f == POLICY_FLAG) {
                o->sim.tier.write_through = i;
            } else {
                o->sim.tier.loads = i; /* KVP_TIER_LOADS_MODEL, _ALWAYS, _NEVER */
            }
            return;
        }
    }
    kvp_cli_problem(p, "invalid value for %s: '%s': %s", tier_flag_names[f], value,
                    f == POLICY_FLAG ? "not a policy (evict or publish)"
                                     : "not a load decision (model, always or never)");
}

int kvp_simulate_tier_take(int argc, char **argv, int *i, simulate_options *o,
                           kvp_cli_problems *p)
{
    const char *arg = argv[*i];
    size_t n = name_length(arg);
    int f = 0;
    while (f < TIER_FLAG_COUNT &&
           !(strlen(tier_flag_names[f]) == n && strncmp(arg, tier_flag_names[f], n) == 0)) {
        f++;
    }
    if (f == TIER_FLAG_COUNT) {
        return 0;
    }
    const char *once[TIER_FLAG_COUNT] = {NULL}; /* --tier repeats: never "given twice" */
    const char **values = f == TIER_FLAG ? once : o->tier.given;
    int taken = kvp_cli_take_flag(argc, argv, i, "simulate", tier_flag_names, TIER_FLAG_COUNT,
                                  values, p);
    if (taken < 0) {
        return 1;
    }
    const char *value = values[taken];
    if (taken == TIER_FLAG) {
        take_tier(o, value, p);
    } else if (taken == POLICY_FLAG || taken == LOADS_FLAG) {
        take_word(o, taken, value, p);
    } else if (taken == TIMEOUT_FLAG || taken == RETRY_FLAG) {
        take_ms(o, taken, value, p);
    }
    return 1;
}

/* `url` with the password (after user: and before @) as ***, into buf. */
static const char *redacted(const char *url, char *buf, size_t size)
{
    const char *rest = url + 8; /* after redis:// */
    const char *at = strchr(rest, '@');
    const char *colon = at != NULL ? memchr(rest, ':', (size_t)(at - rest)) : NULL;
    if (colon == NULL) {
        snprintf(buf, size, "%s", url);
    } else {
        snprintf(buf, size, "redis://%.*s:***%s", (int)(colon - rest), rest, at);
    }
    return buf;
}

/* The URL parses: the Redis tier is made (it connects lazily: never here) and destroyed. */
static void check_redis(const char *url, kvp_cli_problems *p)
{
    kvp_tier_redis_config config;
    kvp_tier_redis_config_init(&config);
    config.url = url;
    kvp_tier *tier = NULL;
    kvp_error err;
    memset(&err, 0, sizeof err);
    char shown[512];
    if (kvp_tier_redis_create(&config, &tier, &err) != KVP_OK) {
        kvp_cli_problem(p, "invalid value for --tier: '%s': not a redis://[user:password@]"
                        "host[:port][/db] URL (its %s)",
                        redacted(url, shown, sizeof shown),
                        err.what != NULL && err.what[0] != '\0' ? err.what : "syntax");
        return;
    }
    (void)kvp_tier_destroy(tier, NULL);
}

/* The secret file's BLAKE2b-256 into the config's secret. */
static void read_secret(simulate_options *o, kvp_cli_problems *p)
{
    const char *path = o->tier.given[SECRET_FLAG];
    FILE *file = fopen(path, "rb");
    unsigned char bytes[SECRET_FILE_MAX + 1];
    size_t n = file != NULL ? fread(bytes, 1, sizeof bytes, file) : 0;
    int failed = file == NULL || ferror(file);
    if (file != NULL) {
        fclose(file);
    }
    if (failed || n < SECRET_FILE_MIN || n > SECRET_FILE_MAX) {
        kvp_cli_problem(p, "invalid value for --tier-secret-file: '%s': %s", path,
                        failed ? "cannot be read"
                               : "must hold 16 to 4096 bytes (the deployment's secret)");
    } else {
        crypto_generichash(o->sim.tier.secret, sizeof o->sim.tier.secret, bytes, n, NULL, 0);
    }
    sodium_memzero(bytes, sizeof bytes);
}

static int has_redis(const simulate_options *o)
{
    for (size_t i = 0; i < o->sim.tier.count; i++) {
        if (o->sim.tier.tiers[i].redis) {
            return 1;
        }
    }
    return 0;
}

/* The flags that need --tier, and the runs that cannot have one. */
static void check_combinations(simulate_options *o, kvp_cli_problems *p)
{
    const simulate_tier_options *t = &o->tier;
    for (int f = SECRET_FLAG; f < TIER_FLAG_COUNT; f++) {
        if (t->given[f] != NULL && t->count == 0) {
            kvp_cli_problem(p, "%s %s needs --tier", tier_flag_names[f], t->given[f]);
        }
    }
    for (int f = TIMEOUT_FLAG; f <= RETRY_FLAG; f++) {
        if (t->given[f] != NULL && t->count != 0 && !has_redis(o)) {
            kvp_cli_problem(p, "%s %s needs a redis:// --tier: host tiers have no connection",
                            tier_flag_names[f], t->given[f]);
        }
    }
    if (t->count == 0) {
        return;
    }
    char shown[512];
    const char *first = t->values[0];
    if (strncmp(first, "redis://", 8) == 0) {
        first = redacted(first, shown, sizeof shown);
    }
    if (!o->sim.compute && has_redis(o)) {
        kvp_cli_problem(p, "--tier %s cannot be given with --no-compute: an allocator-only "
                        "pool holds no page bytes, and a Redis tier stores and shares bytes "
                        "(a keys-only host:SIZE tier sizes one instead)",
                        first);
    } else if (!o->sim.compute && t->count > 1) {
        kvp_cli_problem(p, "--tier %s cannot be given with --no-compute and another --tier: "
                        "an allocator-only run takes one keys-only host:SIZE tier",
                        first);
    }
    if (o->no_sharing) {
        kvp_cli_problem(p, "--tier %s cannot be given with --no-sharing: nothing is published, "
                        "so nothing is written to or read from a tier",
                        first);
    }
    if (has_redis(o) && t->given[SECRET_FLAG] == NULL) {
        kvp_cli_problem(p, "--tier %s needs --tier-secret-file: a shared store's blocks are "
                        "authenticated under the deployment's secret, never a public default",
                        first);
    }
}

void kvp_simulate_tier_check(simulate_options *o, kvp_cli_problems *p)
{
    for (size_t i = 0; i < o->sim.tier.count && !p->found; i++) {
        if (o->sim.tier.tiers[i].redis) {
            check_redis(o->sim.tier.tiers[i].url, p);
        }
    }
    check_combinations(o, p);
    if (p->found || o->sim.tier.count == 0) {
        return;
    }
    o->sim.tier.keys_only = !o->sim.compute; /* allocator-only: no page bytes to keep */
    if (o->tier.given[SECRET_FLAG] != NULL) {
        read_secret(o, p);
    } else {
        crypto_generichash(o->sim.tier.secret, sizeof o->sim.tier.secret,
                           (const unsigned char *)default_secret_text,
                           sizeof default_secret_text - 1, NULL, 0);
    }
}

size_t kvp_simulate_tier_pages(const simulate_options *o)
{
    const kvp_sim_config *c = &o->sim;
    size_t page_bytes = 2 * kvp_sim_kv_heads(c) * c->block_tokens *
                        (c->heads ? c->model_width / c->heads : 0) * kvp_dtype_bytes(c->kv_dtype);
    size_t pages = 0;
    for (size_t i = 0; i < c->tier.count && page_bytes != 0; i++) {
        pages += c->tier.tiers[i].redis ? 0 : c->tier.tiers[i].host_bytes / page_bytes;
    }
    return pages; /* a Redis tier's size is the server's: not counted */
}

static double share(uint64_t part, uint64_t whole)
{
    return whole != 0 ? 100.0 * (double)part / (double)whole : 0.0;
}

void kvp_simulate_tier_report(const simulate_options *o, const kvp_sim_result *r)
{
    const kvp_sim_tier_result *t = &r->tier;
    if (!t->present) {
        return;
    }
    char tiers[1024] = "";
    char shown[200];
    for (size_t i = 0; i < o->tier.count; i++) {
        const char *v = o->tier.values[i];
        size_t used = strlen(tiers);
        int n = snprintf(tiers + used, sizeof tiers - used, "%s%.200s", i ? " -> " : "",
                         strncmp(v, "redis://", 8) == 0 ? redacted(v, shown, sizeof shown) : v);
        (void)n; /* a longer list is cut: the report line only names the tiers */
    }
    if (t->keys_only) {
        printf("tier                    %s, keys only (allocator-only: no page bytes; each block\n"
               "                        counted at its size, same budget and LRU)\n",
               tiers);
    }
    printf("tier                    %s, %s: %llu blocks (%llu tokens, %.1f%% of prompt\n"
           "                        tokens admitted) loaded instead of computed\n",
           tiers, o->sim.tier.write_through ? "write-through (publish)" : "write-back (evict)",
           (unsigned long long)t->hit_blocks, (unsigned long long)t->hit_tokens,
           share(t->hit_tokens, r->prompt_tokens));
    double mib = (double)t->load_bytes / (1024.0 * 1024.0);
    if (t->keys_only) { /* sizes, not bytes moved: no rate */
        printf("tier loads              %.1f MiB of block sizes in %.3f s (key lookups and "
               "mapping);\n"
               "                        writes %llu (%llu failed); %llu blocks rejected, %llu "
               "errors\n",
               mib, t->load_seconds, (unsigned long long)t->writes,
               (unsigned long long)t->write_failures, (unsigned long long)t->rejected,
               (unsigned long long)t->errors);
    } else {
        printf("tier loads              %.1f MiB in %.3f s (%.0f MiB/s, misses included); "
               "writes %llu (%llu failed);\n"
               "                        %llu blocks rejected, %llu errors, %llu blocks "
               "recomputed by decision\n",
               mib, t->load_seconds, t->load_seconds > 0.0 ? mib / t->load_seconds : 0.0,
               (unsigned long long)t->writes, (unsigned long long)t->write_failures,
               (unsigned long long)t->rejected, (unsigned long long)t->errors,
               (unsigned long long)t->recomputes);
    }
    printf("tier prefetches         %llu issued while their requests waited: %llu used, %llu "
           "late, %llu wasted\n",
           (unsigned long long)t->prefetches, (unsigned long long)t->prefetch_used,
           (unsigned long long)t->prefetch_late, (unsigned long long)t->prefetch_wasted);
    if (t->keys_only) {
        printf("tier cost model         allocator-only: every block the tier holds loads "
               "(nothing is\n"
               "                        computed or moved, so there is no rate to compare)\n");
        return;
    }
    printf("tier cost model         %s: loads of blocks at %.1f MB/s against prefill at %.0f "
           "tokens/s\n"
           "                        (a block loads when its bytes take no longer than its "
           "tokens)\n",
           o->sim.tier.loads == 1 ? "--tier-loads always"
           : o->sim.tier.loads == 2 ? "--tier-loads never"
                                    : "--tier-loads model",
           t->bytes_per_second / 1e6, t->prefill_tokens_per_second);
}

void kvp_simulate_tier_json(kvp_json *json, const kvp_sim_result *r)
{
    const kvp_sim_tier_result *t = &r->tier;
    if (!t->present) {
        kvp_json_double(json, "tier", NAN);
        return;
    }
    kvp_json_object_begin(json, "tier");
    kvp_json_uint(json, "keys_only", (uint64_t)t->keys_only);
    kvp_json_uint(json, "hit_blocks", t->hit_blocks);
    kvp_json_uint(json, "hit_tokens", t->hit_tokens);
    kvp_json_uint(json, "load_bytes", t->load_bytes);
    kvp_json_double(json, "load_seconds", t->load_seconds);
    kvp_json_uint(json, "writes", t->writes);
    kvp_json_uint(json, "write_failures", t->write_failures);
    kvp_json_uint(json, "rejected", t->rejected);
    kvp_json_uint(json, "errors", t->errors);
    kvp_json_uint(json, "recomputes", t->recomputes);
    kvp_json_uint(json, "prefetches", t->prefetches);
    kvp_json_uint(json, "prefetch_used", t->prefetch_used);
    kvp_json_uint(json, "prefetch_late", t->prefetch_late);
    kvp_json_uint(json, "prefetch_wasted", t->prefetch_wasted);
    kvp_json_double(json, "bytes_per_second", t->bytes_per_second);
    kvp_json_double(json, "prefill_tokens_per_second", t->prefill_tokens_per_second);
    kvp_json_object_end(json);
}
