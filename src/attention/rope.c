/*
 * rope.c: checked RoPE entry points (see kvpager/rope.h). The arithmetic is
 * kvpi_rope_apply in kernels.c.
 */
#include "kvpager/rope.h"

#include <math.h>

#include "attention/kernels.h"
#include "pager/error.h"

kvp_status kvp_rope_validate(const kvp_rope_config *rope, kvp_error *err)
{
    if (rope == NULL) {
        return kvpi_fail_null(err, "rope");
    }
    kvp_status status = KVP_OK;
    if (rope->feature_width == 0 || rope->feature_width % 2 != 0) {
        status = KVP_ROPE_INVALID_WIDTH;
    } else if (rope->max_positions == 0) {
        status = KVP_ROPE_ZERO_POSITIONS;
    } else if (!isfinite(rope->base) || !(rope->base > 0.0)) {
        status = KVP_ROPE_INVALID_BASE;
    }
    if (status == KVP_OK) {
        return KVP_OK;
    }
    kvp_error e = kvpi_error_begin(status);
    e.layer_rope = *rope;
    return kvpi_error_emit(err, &e);
}

kvp_status kvp_rope_rotate(const kvp_rope_config *rope, double *features, size_t position,
                           kvp_error *err)
{
    kvp_status status = kvp_rope_validate(rope, err);
    if (status != KVP_OK) {
        return status;
    }
    if (features == NULL) {
        return kvpi_fail_null(err, "features");
    }
    if (position >= rope->max_positions) {
        kvp_error e = kvpi_error_begin(KVP_ROPE_POSITION_OUT_OF_RANGE);
        e.layer_rope = *rope;
        e.position = position;
        return kvpi_error_emit(err, &e);
    }
    kvpi_rope_apply(rope, features, position);
    return KVP_OK;
}
