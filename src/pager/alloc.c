/*
 * alloc.c: the allocation hook and fault injector (see alloc.h).
 *
 * Invariant: every path that returns NULL has allocated nothing, so callers
 * only ever unwind what they themselves obtained.
 */
/* jemalloc's MALLOCX_ALIGN expands to ffs: gcc knows it as a builtin, clang
 * needs <strings.h>, which declares it for XSI (POSIX alone hides it). */
#define _XOPEN_SOURCE 700
#include "pager/alloc.h"

#include <jemalloc/jemalloc.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>

#define KVPI_SLAB_ALIGN 64

static atomic_uint_fast64_t fault_calls;  /* allocation calls since arm */
static atomic_uint_fast64_t fault_target; /* 0: disarmed */
static atomic_int fault_fired;
static atomic_int fault_site;

static const char *const site_names[] = {
#define KVPI_FAULT_SITE_NAME_(name, text) text,
    KVPI_FAULT_SITE_MAP(KVPI_FAULT_SITE_NAME_)
#undef KVPI_FAULT_SITE_NAME_
};

const char *kvpi_fault_site_name(kvpi_fault_site site)
{
    if ((unsigned)site >= (unsigned)KVPI_SITE_COUNT_) {
        return "unknown allocation";
    }
    return site_names[site];
}

/* Counts the call; returns 1 when this call must fail by injection. */
static int fault_should_fail(kvpi_fault_site site)
{
    uint_fast64_t call = atomic_fetch_add(&fault_calls, 1) + 1;
    uint_fast64_t target = atomic_load(&fault_target);
    if (target != 0 && call == target) {
        atomic_store(&fault_fired, 1);
        atomic_store(&fault_site, (int)site);
        return 1;
    }
    return 0;
}

void *kvpi_alloc(kvpi_fault_site site, size_t bytes)
{
    if (fault_should_fail(site)) {
        return NULL;
    }
    return malloc(bytes == 0 ? 1 : bytes);
}

void *kvpi_calloc(kvpi_fault_site site, size_t n, size_t size)
{
    if (fault_should_fail(site)) {
        return NULL;
    }
    if (n == 0 || size == 0) {
        return calloc(1, 1);
    }
    return calloc(n, size);
}

void kvpi_free(void *ptr)
{
    free(ptr);
}

static void arena_destroy(unsigned arena)
{
    char name[64];
    snprintf(name, sizeof name, "arena.%u.destroy", arena);
    /* Failure leaves an empty arena behind, which wastes nothing but an index. */
    (void)mallctl(name, NULL, NULL, NULL, 0);
}

void *kvpi_slab_alloc(size_t bytes, unsigned *arena)
{
    if (fault_should_fail(KVPI_SITE_POOL_SLAB)) {
        return NULL;
    }
    unsigned index = 0;
    size_t index_size = sizeof index;
    if (mallctl("arenas.create", &index, &index_size, NULL, 0) != 0) {
        return NULL;
    }
    void *slab = mallocx(bytes, MALLOCX_ARENA(index) | MALLOCX_TCACHE_NONE |
                                    MALLOCX_ALIGN(KVPI_SLAB_ALIGN));
    if (slab == NULL) {
        arena_destroy(index);
        return NULL;
    }
    *arena = index;
    return slab;
}

void kvpi_slab_free(void *slab, unsigned arena)
{
    if (slab == NULL) {
        return;
    }
    dallocx(slab, MALLOCX_TCACHE_NONE);
    arena_destroy(arena);
}

void kvpi_fault_arm(uint64_t nth)
{
    atomic_store(&fault_target, 0);
    atomic_store(&fault_calls, 0);
    atomic_store(&fault_fired, 0);
    atomic_store(&fault_site, (int)KVPI_SITE_COUNT_);
    atomic_store(&fault_target, (uint_fast64_t)nth);
}

uint64_t kvpi_fault_calls(void)
{
    return (uint64_t)atomic_load(&fault_calls);
}

int kvpi_fault_fired(void)
{
    return atomic_load(&fault_fired);
}

kvpi_fault_site kvpi_fault_last_site(void)
{
    return (kvpi_fault_site)atomic_load(&fault_site);
}
