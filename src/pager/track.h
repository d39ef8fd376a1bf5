/*
 * track.h: what the pool tells Valgrind memcheck about its pages.
 *
 * Owns: the mapping of page life to memcheck's mempool client requests. The
 * slab is the pool anchor; a free page is NOACCESS, a held page is a mempool
 * allocation (addressable, undefined until written). So under memcheck a read
 * through a stale page id is an invalid read, and a page never returned shows
 * as a leak. Outside Valgrind each request is a few no-op instructions.
 * Built with KVPI_VALGRIND (the KVP_VALGRIND option, on when
 * valgrind/memcheck.h is found); without it every function here is empty.
 * Callers: pool.c only.
 */
#ifndef KVPAGER_PAGER_TRACK_H
#define KVPAGER_PAGER_TRACK_H

#include <stddef.h>

#ifdef KVPI_VALGRIND
#include <valgrind/memcheck.h>

static inline void kvpi_track_pool_create(void *slab, size_t bytes)
{
    VALGRIND_CREATE_MEMPOOL(slab, 0, 0);
    VALGRIND_MAKE_MEM_NOACCESS(slab, bytes);
}

static inline void kvpi_track_page_acquired(void *slab, void *page, size_t bytes)
{
    VALGRIND_MEMPOOL_ALLOC(slab, page, bytes);
}

static inline void kvpi_track_page_released(void *slab, void *page)
{
    VALGRIND_MEMPOOL_FREE(slab, page);
}

/*
 * An audit that reads every byte of the slab (kvp_pool_digest): free pages are
 * NOACCESS and unwritten slots undefined, so reports for the range are
 * suspended during the read and the result is declared defined after it.
 */
static inline void kvpi_track_audit_read_begin(void *slab, size_t bytes)
{
    VALGRIND_DISABLE_ADDR_ERROR_REPORTING_IN_RANGE(slab, bytes);
}

static inline void kvpi_track_audit_read_end(void *slab, size_t bytes, void *result,
                                             size_t result_bytes)
{
    VALGRIND_ENABLE_ADDR_ERROR_REPORTING_IN_RANGE(slab, bytes);
    VALGRIND_MAKE_MEM_DEFINED(result, result_bytes);
}

/* Hands the slab back to jemalloc as ordinary (undefined) memory. */
static inline void kvpi_track_pool_destroy(void *slab, size_t bytes)
{
    VALGRIND_DESTROY_MEMPOOL(slab);
    VALGRIND_MAKE_MEM_UNDEFINED(slab, bytes);
}

#else /* no Valgrind headers: the requests compile out */

static inline void kvpi_track_pool_create(void *slab, size_t bytes)
{
    (void)slab;
    (void)bytes;
}

static inline void kvpi_track_page_acquired(void *slab, void *page, size_t bytes)
{
    (void)slab;
    (void)page;
    (void)bytes;
}

static inline void kvpi_track_page_released(void *slab, void *page)
{
    (void)slab;
    (void)page;
}

static inline void kvpi_track_audit_read_begin(void *slab, size_t bytes)
{
    (void)slab;
    (void)bytes;
}

static inline void kvpi_track_audit_read_end(void *slab, size_t bytes, void *result,
                                             size_t result_bytes)
{
    (void)slab;
    (void)bytes;
    (void)result;
    (void)result_bytes;
}

static inline void kvpi_track_pool_destroy(void *slab, size_t bytes)
{
    (void)slab;
    (void)bytes;
}

#endif /* KVPI_VALGRIND */

#endif /* KVPAGER_PAGER_TRACK_H */
