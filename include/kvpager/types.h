/*
 * kvpager/types.h: plain value types shared by the public headers.
 *
 * Owns: kvp_shape and kvp_tensor (borrowed, row-major f64 views with an
 * explicit shape), kvp_geometry and kvp_rope_config. The caller fills them
 * in; kvpager never keeps a kvp_tensor past the call it was passed to and
 * never writes through one. Also kvp_version() and kvp_version_number(), the
 * running library's version (the pager's src/pager/types.c defines them, so
 * they are declared in a pager header, not the umbrella).
 * Invariant: a view of shape [d0, ..., dn-1] covers exactly d0*...*dn-1
 * doubles at `data`, in row-major order (the last axis is contiguous).
 */
#ifndef KVPAGER_TYPES_H
#define KVPAGER_TYPES_H

#include "kvpager/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_shape {
    size_t rank;                 /* number of axes; may exceed KVP_MAX_RANK only in errors */
    size_t dims[KVP_MAX_RANK];   /* dims[0..rank) */
} kvp_shape;

typedef struct kvp_tensor {
    const double *data;
    kvp_shape shape;
} kvp_tensor;

/* The per-lane shape of a page: heads and features per head. */
typedef struct kvp_geometry {
    size_t heads;
    size_t head_width;
} kvp_geometry;

/*
 * Rotary position embedding over adjacent feature pairs (2i, 2i+1) with
 * theta_i = base^(-2i / feature_width): the pair at position p is rotated by
 * the angle p * theta_i. feature_width is even and nonzero; positions run
 * over [0, max_positions); base is finite and > 0, and every angle p * theta_i
 * of those positions is finite (kvp_rope_validate).
 */
typedef struct kvp_rope_config {
    size_t feature_width;
    size_t max_positions;
    double base;
} kvp_rope_config;

/*
 * A rank-4 view, the shape of appended keys and values: [B, H, T, d_h].
 * Threads: thread-safe (pure).
 */
KVP_API kvp_tensor kvp_tensor4(const double *data, size_t d0, size_t d1, size_t d2, size_t d3);

/*
 * A rank-3 view, the shape of attention inputs: [B, T, D].
 * Threads: thread-safe (pure).
 */
KVP_API kvp_tensor kvp_tensor3(const double *data, size_t d0, size_t d1, size_t d2);

/*
 * The version of the library running, "MAJOR.MINOR.PATCH", and as a number
 * (MAJOR * 1000000 + MINOR * 1000 + PATCH). They may differ from the
 * KVP_VERSION_* macros of kvpager/version.h, which give the headers a program
 * was compiled against. Static storage.
 * Threads: thread-safe.
 */
KVP_API const char *kvp_version(void);
KVP_API long kvp_version_number(void);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_TYPES_H */
