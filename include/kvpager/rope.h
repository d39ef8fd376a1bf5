/*
 * kvpager/rope.h: rotary position embedding (kvp_rope_config in types.h).
 *
 * Pairs (2i, 2i+1) of a feature vector are rotated by p * theta_i with
 * theta_i = base^(-2i / feature_width):
 *     x'[2i]   = x[2i] cos - x[2i+1] sin
 *     x'[2i+1] = x[2i] sin + x[2i+1] cos
 * Pure functions.
 */
#ifndef KVPAGER_ROPE_H
#define KVPAGER_ROPE_H

#include "kvpager/common.h"
#include "kvpager/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * In this order: NULL_ARGUMENT; ROPE_INVALID_WIDTH (odd or zero);
 * ROPE_ZERO_POSITIONS; ROPE_INVALID_BASE when the base is not finite, not
 * above zero, or so small that some rotation angle p * theta_i with
 * p < max_positions is not finite (e.g. base 5e-324, where theta overflows).
 * The rejected configuration is in err.layer_rope.
 * Threads: thread-safe (pure).
 */
KVP_API KVP_NODISCARD kvp_status kvp_rope_validate(const kvp_rope_config *rope, kvp_error *err);

/*
 * Rotates `features` (feature_width values) in place for `position`.
 * ROPE_POSITION_OUT_OF_RANGE when position >= max_positions; nothing changes
 * then.
 * Threads: thread-safe (writes only `features`).
 */
KVP_API KVP_NODISCARD kvp_status kvp_rope_rotate(const kvp_rope_config *rope, double *features,
                                                 size_t position, kvp_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_ROPE_H */
