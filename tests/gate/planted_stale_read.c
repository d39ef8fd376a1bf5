/*
 * planted_stale_read.c: a read through a page id after the page went back.
 *
 * Wrong on purpose. Under memcheck the read must be reported as an invalid
 * read (the released page is NOACCESS), which proves the pages' mempool
 * tracking catches stale page-table use. Registered only as an expected
 * failure.
 */
#include <stdio.h>

#include "kvpager/kvpager.h"
#include "pager/reservation.h"

int main(void)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = 2;
    config.heads = 1;
    config.head_width = 4;
    config.budget_bytes = 4 * 2 * 2 * 4 * sizeof(double);
    config.dtype = KVP_F64;
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
