/*
 * planted_stale_read.c: a read through a page id after the page went back.
 *
 * Wrong on purpose. Under memcheck the read must be reported as an invalid
 * read (the released page is NOACCESS), which proves the pages' mempool
 * tracking catches stale page-table use. Registered only as an expected
 * failure.
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
    kvp_pool *pool = NULL;
    kvp_error err;
    if (kvp_pool_create(&config, &pool, &err) != KVP_OK) {
        return 2;
    }
    uint32_t storage[1];
    kvpi_reservation reservation;
    kvpi_reservation_init(&reservation, pool, storage, 1);
    if (kvpi_reservation_fill(&reservation, 1, &err) != KVP_OK) {
        return 2;
    }
    double *page = kvpi_pool_page(pool, storage[0]);
    page[0] = 1.0;
    kvpi_reservation_release(&reservation);
    volatile double stale = page[0]; /* the planted bug */
    printf("planted stale read: %g\n", stale);
    return kvp_pool_destroy(pool, &err) == KVP_OK ? 0 : 2;
}
