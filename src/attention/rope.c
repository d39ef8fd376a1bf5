/*
 * rope.c: checked RoPE entry points (see kvpager/rope.h). The arithmetic is
 * kvpi_rope_apply_rows in kernels.c.
 */
#include "kvpager/rope.h"

#include <math.h>

#include "attention/kernels.h"
#include "pager/error.h"

/*
 * Every rotation angle p * theta_i, p < max_positions, is finite. theta_i =
 * base^(-2i / width) is monotonic in i (rising for a base below 1, falling
 * above), so the largest angle is (max_positions - 1) times theta at i = 0 or
 * at the last pair; both are computed exactly as kvpi_rope_apply_rows does. theta
 * itself must be finite too, or position 0 would give 0 * inf = NaN.
 */
static int angles_finite(const kvp_rope_config *rope)
{
    size_t last = rope->base < 1.0 ? rope->feature_width / 2 - 1 : 0;
    double theta = kvpi_rope_theta(rope->base, rope->feature_width, last);
    double angle = (double)(rope->max_positions - 1) * theta;
    return isfinite(theta) && isfinite(angle);
}

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
    } else if (!isfinite(rope->base) || !(rope->base > 0.0) || !angles_finite(rope)) {
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
