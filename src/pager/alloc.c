/*
 * alloc.c: the allocation hook, the fault injector, the slab sources
 * (jemalloc arenas, anonymous mappings, a caller's hooks) and the recycled
 * slab arenas (see alloc.h).
 *
 * Invariant: every path that returns NULL has allocated nothing (a slab
 * arena it took is parked again), so callers only ever unwind what they
 * themselves obtained.
 */
/* jemalloc's MALLOCX_ALIGN expands to ffs: gcc knows it as a builtin, clang
 * needs <strings.h>, which declares it for XSI (POSIX alone hides it). */
#define _XOPEN_SOURCE 700
/* MAP_ANONYMOUS and MAP_NORESERVE are not POSIX. */
#define _DEFAULT_SOURCE
#include "pager/alloc.h"

#include <jemalloc/jemalloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/types.h>

/*
 * jemalloc is referred to weakly: libkvpager.so has no DT_NEEDED entry for
 * it, so loading kvpager never loads jemalloc (whose initial-exec TLS makes
 * a late dlopen fail with "cannot allocate memory in static TLS block").
 * When the process has jemalloc, these resolve to it and the default slab
 * source is a jemalloc arena; otherwise they are NULL and it is mmap.
 */
#pragma weak mallocx
#pragma weak dallocx
#pragma weak mallctl

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

/*
 * Recycled slab arenas. jemalloc never gives back all of an arena's metadata
 * (arena.<i>.destroy leaves about 4 KiB behind), so an arena, once created,
 * is kept for good: a slab free empties it (dallocx, then arena.<i>.reset and
 * arena.<i>.purge, so its pages go back to the system) and parks its index
 * here; the next slab alloc takes a parked arena before it creates one. The
 * lock guards these indexes and the creation of arenas; every other mallctl
 * on an arena runs outside it, by the one caller that holds the arena. Every
 * slab call passes MALLOCX_TCACHE_NONE, so no thread cache ever holds a slab
 * arena's memory, which reset requires.
 *
 * jemalloc numbers arenas below 4096 (MALLOCX_ARENA takes 12 bits), so the
 * list never overflows; if it did, the arena would be destroyed as before.
 */
#define KVPI_ARENA_SPARE_MAX 4096

static pthread_mutex_t arena_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned arena_spare[KVPI_ARENA_SPARE_MAX]; /* idle, empty, purged arenas */
static size_t arena_spare_count;

static int arena_ctl(const char *what, unsigned arena, void *value, size_t size)
{
    char name[64];
    snprintf(name, sizeof name, "arena.%u.%s", arena, what);
    return mallctl(name, NULL, NULL, value, value != NULL ? size : 0);
}

/*
 * A parked arena, else a new one that purges what it frees at once. New
 * arenas are made under the lock too, one at a time: jemalloc publishes a
 * new arena's mutexes through its own atomics, which ThreadSanitizer and
 * helgrind cannot see, so two threads creating arenas at once look to them
 * like a race inside jemalloc. The lock gives them an order they can see.
 * Creating is rare (only while the list is empty), so the lock costs nothing.
 */
static int arena_take(unsigned *arena)
{
    int failed = 0;
    pthread_mutex_lock(&arena_lock);
    if (arena_spare_count > 0) {
        *arena = arena_spare[--arena_spare_count];
    } else {
        unsigned index = 0;
        size_t index_size = sizeof index;
        failed = mallctl("arenas.create", &index, &index_size, NULL, 0) != 0;
        if (!failed) {
            /* Freed pages skip the dirty and muzzy stages: RSS follows the pools. */
            ssize_t immediately = 0;
            (void)arena_ctl("dirty_decay_ms", index, &immediately, sizeof immediately);
            (void)arena_ctl("muzzy_decay_ms", index, &immediately, sizeof immediately);
            *arena = index;
        }
    }
    pthread_mutex_unlock(&arena_lock);
    return failed ? -1 : 0;
}

/* Empties the arena, gives its pages back, and parks it for the next slab. */
static void arena_give_back(unsigned arena)
{
    (void)arena_ctl("reset", arena, NULL, 0);
    (void)arena_ctl("purge", arena, NULL, 0);
    pthread_mutex_lock(&arena_lock);
    int parked = arena_spare_count < KVPI_ARENA_SPARE_MAX;
    if (parked) {
        arena_spare[arena_spare_count++] = arena;
    }
    pthread_mutex_unlock(&arena_lock);
    if (!parked) {
        /* Failure leaves an empty arena behind, which wastes nothing but an index. */
        (void)arena_ctl("destroy", arena, NULL, 0);
    }
}

int kvpi_slab_jemalloc_available(void)
{
    return mallocx != NULL && dallocx != NULL && mallctl != NULL;
}

static void *slab_jemalloc(size_t bytes, unsigned *arena)
{
    unsigned index = 0;
    if (arena_take(&index) != 0) {
        return NULL;
    }
    void *slab = mallocx(bytes, MALLOCX_ARENA(index) | MALLOCX_TCACHE_NONE |
                                    MALLOCX_ALIGN(KVP_SLAB_ALIGNMENT));
    if (slab == NULL) {
        arena_give_back(index);
        return NULL;
    }
    *arena = index;
    return slab;
}

/* Page-aligned, so KVP_SLAB_ALIGNMENT-aligned; committed only when written. */
static void *slab_mmap(size_t bytes)
{
    void *slab = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return slab == MAP_FAILED ? NULL : slab;
}

/* Address space only: never readable or writable, so never committed. */
static void *slab_reserved(size_t bytes)
{
    void *slab = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return slab == MAP_FAILED ? NULL : slab;
}

/*
 * Asks the kernel to back the 2 MiB-aligned interior of a slab with
 * transparent huge pages (MADV_HUGEPAGE; only a hint: a kernel without THP,
 * or one that refuses, changes nothing). A lane's pages are scattered over
 * the slab, so with 4 KiB pages nearly every head run read by the gather is
 * a TLB miss whose page walk misses the cache too.
 */
static void advise_huge(void *slab, size_t bytes)
{
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t begin = ((uintptr_t)slab + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)slab + bytes) & ~(huge - 1);
    if (end > begin) {
        (void)madvise((void *)begin, end - begin, MADV_HUGEPAGE);
    }
}

int kvpi_slab_alloc(kvp_slab_source source, kvp_slab_alloc_fn alloc_fn, kvp_slab_free_fn free_fn,
                    void *ctx, size_t bytes, kvpi_slab *out)
{
    if (fault_should_fail(KVPI_SITE_POOL_SLAB)) {
        return -1;
    }
    kvpi_slab slab = {NULL, bytes, source, 0, NULL, NULL};
    switch (source) {
    case KVP_SLAB_JEMALLOC:
        if (!kvpi_slab_jemalloc_available()) {
            return -1;
        }
        slab.base = slab_jemalloc(bytes, &slab.arena);
        break;
    case KVP_SLAB_MMAP:
        slab.base = slab_mmap(bytes);
        break;
    case KVP_SLAB_RESERVED:
        slab.base = slab_reserved(bytes);
        break;
    case KVP_SLAB_CUSTOM:
        if (alloc_fn == NULL || free_fn == NULL) {
            return -1;
        }
        slab.base = alloc_fn(ctx, bytes, KVP_SLAB_ALIGNMENT);
        slab.free_fn = free_fn;
        slab.ctx = ctx;
        if (slab.base != NULL && (uintptr_t)slab.base % KVP_SLAB_ALIGNMENT != 0) {
            free_fn(ctx, slab.base, bytes);
            return -1;
        }
        break;
    default:
        return -1;
    }
    if (slab.base == NULL) {
        return -1;
    }
    /* a caller's memory is the caller's to advise; a reserved range has none */
    if (source != KVP_SLAB_CUSTOM && source != KVP_SLAB_RESERVED) {
        advise_huge(slab.base, bytes);
    }
    *out = slab;
    return 0;
}

void kvpi_slab_free(const kvpi_slab *slab)
{
    if (slab == NULL || slab->base == NULL) {
        return;
    }
    switch (slab->source) {
    case KVP_SLAB_JEMALLOC:
        dallocx(slab->base, MALLOCX_TCACHE_NONE);
        arena_give_back(slab->arena);
        break;
    case KVP_SLAB_MMAP:
    case KVP_SLAB_RESERVED:
        (void)munmap(slab->base, slab->bytes);
        break;
    case KVP_SLAB_CUSTOM:
        slab->free_fn(slab->ctx, slab->base, slab->bytes);
        break;
    default:
        break;
    }
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
