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
 * Valgrind, memcheck's, through --soname-synonyms). A page slab comes from
 * its pool's slab source (kvp_slab_source): a jemalloc slab has an arena of
 * its own while it lives. Arenas are recycled, never
 * destroyed: jemalloc keeps about 4 KiB of every destroyed arena's metadata,
 * which made each pool create/destroy cycle leak. A freed slab's arena is
 * reset, purged (its pages go back to the system) and parked on a
 * process-wide list; the next slab takes a parked arena before it creates a
 * new one. So the arenas a process holds never outnumber the most pools it
 * ever had alive at once.
 *
 * Global state here: the fault injector's counters, kept in atomics; and
 * the list of parked slab arenas, a fixed array of indexes under a mutex (no
 * heap, so nothing is left for a leak checker at exit). Parked arenas live
 * until the process ends. The library's other mutable globals, each
 * documented where it lives: the id counters (cache serials in cache.c,
 * parameter ids in param.c, atomics); libsodium's one-time start
 * (sodium_once and sodium_ready, pool.c); the kernel set chosen once from
 * the CPU (dispatch.c); the decoder's thread-start fault injector (atomics,
 * decoder.c); paged attention's per-thread workspace and its pthread key
 * (paged.c); and two test and benchmark knobs set before use, the gather
 * grain (gather.c) and the prefill block (sequence.c).
 * Callers: src/ only. Tests reach the fault injector through this header.
 */
#ifndef KVPAGER_PAGER_ALLOC_H
#define KVPAGER_PAGER_ALLOC_H

#include <stddef.h>
#include <stdint.h>

#include "kvpager/pool.h"

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
 * A pool's slab, from one of the sources of kvp_slab_source (never DEFAULT:
 * kvp_pool_create resolves it first). Filled by kvpi_slab_alloc on success.
 */
typedef struct kvpi_slab {
    void *base;
    size_t bytes;
    kvp_slab_source source;   /* JEMALLOC, MMAP or CUSTOM */
    unsigned arena;           /* JEMALLOC: the arena index */
    kvp_slab_free_fn free_fn; /* CUSTOM: the hook and its context */
    void *ctx;
} kvpi_slab;

/*
 * 1 when jemalloc is in the process: the library refers to jemalloc's
 * mallocx, dallocx and mallctl weakly, so libkvpager.so does not load
 * jemalloc, and they resolve only when the program (or a library loaded
 * before kvpager, or LD_PRELOAD) brought jemalloc in.
 */
int kvpi_slab_jemalloc_available(void);

/*
 * A KVP_SLAB_ALIGNMENT-aligned slab of `bytes` bytes from `source`:
 *   JEMALLOC  an arena that serves nothing else while the slab lives (a
 *             parked one, or a new one); needs kvpi_slab_jemalloc_available;
 *   MMAP      an anonymous private MAP_NORESERVE mapping;
 *   RESERVED  the same, PROT_NONE: address space, never touched;
 *   CUSTOM    alloc_fn(ctx, bytes, KVP_SLAB_ALIGNMENT), once; a pointer that
 *             is not aligned goes straight back to free_fn and counts as a
 *             failure.
 * Returns 0 and fills *out, or -1 having allocated nothing (an arena it took
 * is parked again). Counts as one allocation for the fault injector, however
 * many calls it makes; an injected fault calls no hook. Thread-safe.
 */
int kvpi_slab_alloc(kvp_slab_source source, kvp_slab_alloc_fn alloc_fn, kvp_slab_free_fn free_fn,
                    void *ctx, size_t bytes, kvpi_slab *out);
/*
 * Frees the slab to its source (once): the arena's pages go back to the
 * system and the arena is parked; the mapping is unmapped; the hook is called.
 */
void kvpi_slab_free(const kvpi_slab *slab);

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
