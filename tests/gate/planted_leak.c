/*
 * planted_leak.c: a page that is acquired and never returned.
 *
 * This program is wrong on purpose. Run under memcheck it must fail the run
 * with "definitely lost", which proves the memcheck gate can fail. The pool
 * stays reachable (a global), so the only lost block is the page itself: a
 * mempool chunk no pointer refers to. Registered only as an expected failure
 * (see tests/CMakeLists.txt), once per slab source (argv[1]); never run as
 * a passing test.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpager/kvpager.h"
#include "pager/reservation.h"

/* The custom slab source: aligned_alloc, so the slab is a malloc block. */
static void *custom_alloc(void *ctx, size_t bytes, size_t alignment)
{
    (void)ctx;
    return aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
}

static void custom_free(void *ctx, void *slab, size_t bytes)
{
    (void)ctx;
    (void)bytes;
    free(slab);
}

/* argv[1]: the slab source, "jemalloc", "mmap" or "custom" (default: the default). */
static int choose_source(kvp_pool_config *config, int argc, char **argv)
{
    if (argc < 2) {
        return 0;
    }
    if (strcmp(argv[1], "jemalloc") == 0) {
        config->slab_source = KVP_SLAB_JEMALLOC;
    } else if (strcmp(argv[1], "mmap") == 0) {
        config->slab_source = KVP_SLAB_MMAP;
    } else if (strcmp(argv[1], "custom") == 0) {
        config->slab_source = KVP_SLAB_CUSTOM;
        config->slab_alloc = custom_alloc;
        config->slab_free = custom_free;
    } else {
        fprintf(stderr, "unknown slab source %s\n", argv[1]);
        return -1;
    }
    return 0;
}

static kvp_pool *reachable_pool;

int main(int argc, char **argv)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = 2;
    config.heads = 1;
    config.head_width = 4;
    config.budget_bytes = 4 * 2 * 2 * 4 * sizeof(double);
    config.dtype = KVP_F64;
    if (choose_source(&config, argc, argv) != 0) {
        return 2;
    }
    kvp_error err;
    if (kvp_pool_create(&config, &reachable_pool, &err) != KVP_OK) {
        return 2;
    }
    uint32_t storage[2];
    kvpi_reservation reservation;
    kvpi_reservation_init(&reservation, reachable_pool, storage, 2);
    if (kvpi_reservation_fill(&reservation, 2, &err) != KVP_OK) {
        return 2;
    }
    /* Take both pages out of the reservation, give page 0 back, drop page 1. */
    kvpi_pool_lock(reachable_pool);
    uint32_t kept = kvpi_reservation_consume_locked(&reservation);
    uint32_t lost = kvpi_reservation_consume_locked(&reservation);
    kvpi_pool_put_locked(reachable_pool, kept);
    kvpi_pool_unlock(reachable_pool);
    printf("planted leak: page %u is never returned\n", (unsigned)lost);
    return 0;
}
