/*
 * alloc.h: the one door between libkvpager and the heap.
 *
 * Owns: every heap allocation the library makes, and the fault injector that
 * can make the Nth of them fail. Nothing in src/ calls malloc, free, mallocx
 * or mallctl directly; it calls kvpi_alloc / kvpi_slab_alloc with a fault
 * site (a stable id naming the call site, as SQLite's fault ids do).
 *
 * General allocations go to the process's malloc (jemalloc's, in every
 * kvpager executable, because they link jemalloc ahead of libc; under
 * Valgrind, memcheck's, through --soname-synonyms). Each page slab has a
 * jemalloc arena of its own while it lives. Arenas are recycled, never
 * destroyed: jemalloc keeps about 4 KiB of every destroyed arena's metadata,
 * which made each pool create/destroy cycle leak. A freed slab's arena is
 * reset, purged (its pages go back to the system) and parked on a
 * process-wide list; the next slab takes a parked arena before it creates a
 * new one. So the arenas a process holds never outnumber the most pools it
 * ever had alive at once.
 *
 * Global state (documented, the library's only mutable globals besides id
 * counters): the fault injector's counters, kept in atomics; and the list of
 * parked slab arenas, a fixed array of indexes under a mutex (no heap, so
 * nothing is left for a leak checker at exit). Parked arenas live until the
 * process ends.
 * Callers: src/ only. Tests reach the fault injector through this header.
 */
#ifndef KVPAGER_PAGER_ALLOC_H
#define KVPAGER_PAGER_ALLOC_H

#include <stddef.h>
#include <stdint.h>

/* Stable ids of the library's allocation sites. */
#define KVPI_FAULT_SITE_MAP(X)                                 \
    X(POOL_STRUCT, "pool struct")                              \
    X(POOL_METADATA, "pool free list and reference counts")    \
    X(POOL_SLAB, "page slab")                                  \
    X(CACHE_STRUCT, "KV cache")                                \
    X(CACHE_TABLES, "KV cache page tables")                    \
    X(PARAM, "parameter node")                                 \
    X(LAYER, "attention layer")                                \
    X(TICKET, "attention ticket")                              \
    X(SEQUENCE, "sequence")                                    \
    X(MODEL, "model")                                          \
    X(SCRATCH, "scratch buffer")

typedef enum kvpi_fault_site {
#define KVPI_FAULT_SITE_ENUM_(name, text) KVPI_SITE_##name,
    KVPI_FAULT_SITE_MAP(KVPI_FAULT_SITE_ENUM_)
#undef KVPI_FAULT_SITE_ENUM_
    KVPI_SITE_COUNT_
} kvpi_fault_site;

/* The static name of a site, for messages ("page slab"). */
const char *kvpi_fault_site_name(kvpi_fault_site site);

/* Uninitialized memory, or NULL (out of memory or an injected fault). */
void *kvpi_alloc(kvpi_fault_site site, size_t bytes);
/* Zeroed memory for n * size bytes, NULL on overflow too. */
void *kvpi_calloc(kvpi_fault_site site, size_t n, size_t size);
void kvpi_free(void *ptr);

/*
 * A 64-byte aligned slab from a jemalloc arena that serves nothing else while
 * the slab lives (a parked one, or a new one). *arena receives the arena
 * index for kvpi_slab_free, and is written only on success. Counts as one
 * allocation for the fault injector, however many jemalloc calls it makes;
 * a failure parks any arena it took, so it leaves nothing behind. Both calls
 * are thread-safe.
 */
void *kvpi_slab_alloc(size_t bytes, unsigned *arena);
/* Frees the slab, returns its pages to the system and parks its arena. */
void kvpi_slab_free(void *slab, unsigned arena);

/*
 * Fault injection. kvpi_fault_arm(n) makes the nth allocation call from now
 * (n >= 1) fail, once; n == 0 disarms. kvpi_fault_calls counts allocation
 * calls since the last arm; kvpi_fault_fired says whether the armed fault has
 * fired, and kvpi_fault_last_site which site it hit.
 */
void kvpi_fault_arm(uint64_t nth);
uint64_t kvpi_fault_calls(void);
int kvpi_fault_fired(void);
kvpi_fault_site kvpi_fault_last_site(void);

#endif /* KVPAGER_PAGER_ALLOC_H */
