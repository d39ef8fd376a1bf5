/*
 * dlopen_probe.c: a host that loads libkvpager.so at run time, as a plugin
 * loader or a language binding would, without linking kvpager or jemalloc.
 * Built and run by tests/package/run.sh: argv[1] is the installed library.
 *
 * Before libkvpager.so stopped depending on jemalloc, this dlopen failed on
 * Debian with "libjemalloc.so.2: cannot allocate memory in static TLS block"
 * (jemalloc's initial-exec TLS cannot be placed after start-up). Now the
 * library loads, and with no jemalloc in the process its pools take their
 * slab from mmap: the probe runs a pool create, 24 decode steps that append
 * a K/V row each to a cache (kvp_attention_forward), the audit, and every
 * destroy, all through dlsym, and checks the slab source and that asking for
 * jemalloc explicitly is refused.
 * Uses only the public headers (for the types); links only libc and libdl.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kvpager/kvpager.h"

static void *library;

/* The symbol, or exit: the probe needs every one it names. */
static void *need(const char *name)
{
    void *symbol = dlsym(library, name);
    if (symbol == NULL) {
        fprintf(stderr, "dlopen probe: %s: %s\n", name, dlerror());
    }
    return symbol;
}

#define BIND(type, name) type name##_ = (type)need(#name)

typedef void (*config_init_fn)(kvp_pool_config *);
typedef void (*stats_init_fn)(kvp_pool_stats *);
typedef kvp_status (*pool_create_fn)(const kvp_pool_config *, kvp_pool **, kvp_error *);
typedef kvp_status (*pool_destroy_fn)(kvp_pool *, kvp_error *);
typedef kvp_status (*stats_get_fn)(kvp_pool *, kvp_pool_stats *, kvp_error *);
typedef kvp_status (*check_fn)(kvp_pool *, kvp_mismatch_fn, void *, kvp_error *);
typedef kvp_status (*layer_random_fn)(size_t, size_t, size_t, double, uint64_t, kvp_layer **,
                                      kvp_error *);
typedef kvp_status (*layer_binding_fn)(const kvp_layer *, kvp_binding *, kvp_error *);
typedef kvp_status (*layer_destroy_fn)(kvp_layer *, kvp_error *);
typedef kvp_status (*cache_create_fn)(kvp_pool *, const kvp_binding *, size_t, size_t,
                                      kvp_cache **, kvp_error *);
typedef kvp_status (*cache_destroy_fn)(kvp_cache *, kvp_error *);
typedef size_t (*cache_len_fn)(const kvp_cache *);
typedef kvp_status (*ticket_create_fn)(const kvp_cache *, kvp_ticket **, kvp_error *);
typedef kvp_status (*ticket_destroy_fn)(kvp_ticket *, kvp_error *);
typedef kvp_status (*forward_fn)(const kvp_layer *, const kvp_tensor *, kvp_cache *,
                                 kvp_ticket *, kvp_error *);
typedef kvp_tensor (*tensor3_fn)(const double *, size_t, size_t, size_t);

static int fail(const char *what)
{
    fprintf(stderr, "dlopen probe: %s\n", what);
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        return fail("usage: dlopen_probe LIBKVPAGER_SO");
    }
    library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        fprintf(stderr, "dlopen probe: dlopen(%s): %s\n", argv[1], dlerror());
        return 1;
    }
    if (dlsym(RTLD_DEFAULT, "mallocx") != NULL) {
        return fail("jemalloc is in the process: the probe must not link it");
    }
    BIND(config_init_fn, kvp_pool_config_init);
    BIND(stats_init_fn, kvp_pool_stats_init);
    BIND(pool_create_fn, kvp_pool_create);
    BIND(pool_destroy_fn, kvp_pool_destroy);
    BIND(stats_get_fn, kvp_pool_stats_get);
    BIND(check_fn, kvp_pool_check);
    BIND(layer_random_fn, kvp_layer_create_random);
    BIND(layer_binding_fn, kvp_layer_binding_get);
    BIND(layer_destroy_fn, kvp_layer_destroy);
    BIND(cache_create_fn, kvp_cache_create);
    BIND(cache_destroy_fn, kvp_cache_destroy);
    BIND(cache_len_fn, kvp_cache_len);
    BIND(ticket_create_fn, kvp_ticket_create);
    BIND(ticket_destroy_fn, kvp_ticket_destroy);
    BIND(forward_fn, kvp_attention_forward);
    BIND(tensor3_fn, kvp_tensor3);
    if (!kvp_pool_config_init_ || !kvp_pool_stats_init_ || !kvp_pool_create_ ||
        !kvp_pool_destroy_ || !kvp_pool_stats_get_ || !kvp_pool_check_ ||
        !kvp_layer_create_random_ || !kvp_layer_binding_get_ || !kvp_layer_destroy_ ||
        !kvp_cache_create_ || !kvp_cache_destroy_ || !kvp_cache_len_ || !kvp_ticket_create_ ||
        !kvp_ticket_destroy_ || !kvp_attention_forward_ || !kvp_tensor3_) {
        return 1;
    }

    kvp_error err;
    kvp_layer *layer = NULL;
    if (kvp_layer_create_random_(32, 4, 256, 10000.0, 7, &layer, &err) != KVP_OK) {
        return fail("layer");
    }
    kvp_pool_config config;
    kvp_pool_config_init_(&config);
    config.heads = 4;
    config.head_width = 8;
    config.budget_bytes = 1 << 20;
    kvp_pool *pool = NULL;
    /* No jemalloc in the process: asking for it is refused, the default is mmap. */
    config.slab_source = KVP_SLAB_JEMALLOC;
    if (kvp_pool_create_(&config, &pool, &err) != KVP_INVALID_ARGUMENT ||
        strcmp(err.argument, "slab_source") != 0 || pool != NULL) {
        return fail("KVP_SLAB_JEMALLOC without jemalloc was not refused");
    }
    config.slab_source = KVP_SLAB_DEFAULT;
    if (kvp_pool_create_(&config, &pool, &err) != KVP_OK) {
        return fail("pool");
    }
    kvp_binding binding;
    kvp_cache *cache = NULL;
    kvp_ticket *ticket = NULL;
    if (kvp_layer_binding_get_(layer, &binding, &err) != KVP_OK ||
        kvp_cache_create_(pool, &binding, 2, 64, &cache, &err) != KVP_OK ||
        kvp_ticket_create_(cache, &ticket, &err) != KVP_OK) {
        return fail("cache");
    }
    double x[2 * 32];
    for (int t = 0; t < 24; t++) {
        for (int i = 0; i < 2 * 32; i++) {
            x[i] = sin(0.01 * (t * 64 + i));
        }
        kvp_tensor input = kvp_tensor3_(x, 2, 1, 32);
        if (kvp_attention_forward_(layer, &input, cache, ticket, &err) != KVP_OK) {
            return fail("forward");
        }
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init_(&stats);
    if (kvp_pool_stats_get_(pool, &stats, &err) != KVP_OK ||
        kvp_pool_check_(pool, NULL, NULL, &err) != KVP_OK) {
        return fail("stats or audit");
    }
    /* 24 positions in pages of 16, two lanes: 2 pages each. */
    if (kvp_cache_len_(cache) != 24 || stats.held_pages != 4 ||
        stats.slab_source != KVP_SLAB_MMAP) {
        fprintf(stderr, "dlopen probe: len %zu, held %zu, slab source %d\n",
                kvp_cache_len_(cache), stats.held_pages, (int)stats.slab_source);
        return 1;
    }
    if (kvp_ticket_destroy_(ticket, &err) != KVP_OK || kvp_cache_destroy_(cache, &err) != KVP_OK ||
        kvp_layer_destroy_(layer, &err) != KVP_OK || kvp_pool_destroy_(pool, &err) != KVP_OK) {
        return fail("destroy");
    }
    printf("dlopen probe: len 24, 4 pages held from an mmap slab, all destroyed\n");
    return dlclose(library) == 0 ? 0 : fail("dlclose");
}
