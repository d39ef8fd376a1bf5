/*
 * abi.h: growing structs, the library side (kvpager/pool.h, "Growing
 * structs").
 *
 * Owns: the check of a caller's struct_size and the prefix-only reads and
 * writes that let a newer library serve an older caller's shorter struct.
 * Invariant: nothing here reads or writes a byte of the caller's struct at
 * or past its struct_size, and a refused struct is left untouched.
 * The KVPI_*_SIZE_FIRST constants are each struct's first-release size, the
 * smallest struct_size accepted; they never change once released. This
 * header holds the pager's structs' own; each other layer keeps its structs'
 * beside them, in its internal header (attention/layer_internal.h,
 * serve/model_internal.h, serve/requests_internal.h), with the same
 * KVPI_FIRST_RELEASE_ALIGNED check, so no pager header includes a header of
 * a layer above.
 * Callers: src/ only (the public getters and kvp_pool_create), and the tests
 * that emulate an older caller.
 */
#ifndef KVPAGER_PAGER_ABI_H
#define KVPAGER_PAGER_ABI_H

#include <stddef.h>
#include <string.h>

#include "kvpager/cache.h"
#include "kvpager/pool.h"
#include "pager/error.h"

#define KVPI_POOL_CONFIG_SIZE_FIRST offsetof(kvp_pool_config, slab_alloc)
/* The release that added slab sources, before key_secret (issue 16). */
#define KVPI_POOL_CONFIG_SIZE_SLAB offsetof(kvp_pool_config, key_secret)
#define KVPI_POOL_STATS_SIZE_FIRST offsetof(kvp_pool_stats, slab_source)
#define KVPI_CACHE_INFO_SIZE_FIRST sizeof(kvp_cache_info)
#define KVPI_PAGE_LAYOUT_SIZE_FIRST sizeof(kvp_page_layout)

/*
 * A release's size is its sizeof, tail padding included: an older caller
 * passes that. So the first field a release adds starts at or past it, never
 * in the padding, or an older caller's garbage padding would be read as the
 * new field. These hold when the first added field starts on the struct's
 * alignment, as the previous sizeof does.
 */
#define KVPI_FIRST_RELEASE_ALIGNED(type, first_size)                                         \
    _Static_assert((first_size) % _Alignof(type) == 0,                                        \
                   #type ": a new field starts inside the first release's tail padding")
KVPI_FIRST_RELEASE_ALIGNED(kvp_pool_config, KVPI_POOL_CONFIG_SIZE_FIRST);
KVPI_FIRST_RELEASE_ALIGNED(kvp_pool_stats, KVPI_POOL_STATS_SIZE_FIRST);
KVPI_FIRST_RELEASE_ALIGNED(kvp_pool_config, KVPI_POOL_CONFIG_SIZE_SLAB);
_Static_assert(KVPI_POOL_CONFIG_SIZE_SLAB >= offsetof(kvp_pool_config, slab_source) +
                                                 sizeof(kvp_slab_source),
               "key_secret follows slab_source");

/* 1 when a struct of `struct_size` bytes holds all of the member at [offset, offset + size). */
static inline int kvpi_struct_covers(size_t struct_size, size_t offset, size_t size)
{
    return struct_size >= offset && struct_size - offset >= size;
}

/* KVP_OK when struct_size is at least the first release's size. */
static inline kvp_status kvpi_struct_size_check(size_t struct_size, size_t first_size,
                                                kvp_error *err)
{
    if (struct_size == 0) {
        return kvpi_fail_invalid(err, "struct_size", "is zero: call the struct's _init first");
    }
    if (struct_size < first_size) {
        return kvpi_fail_invalid(err, "struct_size",
                                 "is smaller than the struct's first release");
    }
    return KVP_OK;
}

/*
 * An input struct longer than the library's (a newer caller): KVP_OK only
 * when every byte the library does not know, [known_size, struct_size), is
 * zero, so no setting the caller made is silently ignored.
 */
static inline kvp_status kvpi_struct_tail_check(const void *caller, size_t struct_size,
                                                size_t known_size, kvp_error *err)
{
    const unsigned char *bytes = (const unsigned char *)caller;
    for (size_t i = known_size; i < struct_size; i++) {
        if (bytes[i] != 0) {
            return kvpi_fail_invalid(err, "struct_size",
                                     "covers fields this library does not know, set nonzero");
        }
    }
    return KVP_OK;
}

/*
 * Writes an output struct: checks the caller's struct_size (the first
 * member, a size_t), then copies `full` (the library's whole struct) after
 * the struct_size member, up to the caller's struct_size or the library's
 * size, whichever is smaller. The caller's struct_size is kept.
 */
static inline kvp_status kvpi_struct_out(void *caller, const void *full, size_t full_size,
                                         size_t first_size, kvp_error *err)
{
    size_t struct_size;
    memcpy(&struct_size, caller, sizeof struct_size);
    kvp_status status = kvpi_struct_size_check(struct_size, first_size, err);
    if (status != KVP_OK) {
        return status;
    }
    size_t n = struct_size < full_size ? struct_size : full_size;
    memcpy((unsigned char *)caller + sizeof(size_t), (const unsigned char *)full + sizeof(size_t),
           n - sizeof(size_t));
    return KVP_OK;
}

#endif /* KVPAGER_PAGER_ABI_H */
