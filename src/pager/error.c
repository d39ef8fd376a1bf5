/*
 * error.c: construction of kvp_error values and small shape and value checks
 * (see error.h). Rendering lives in status.c.
 */
#include "pager/error.h"

#include <math.h>
#include <string.h>

kvp_error kvpi_error_begin(kvp_status status)
{
    kvp_error detail;
    memset(&detail, 0, sizeof detail);
    detail.status = status;
    return detail;
}

kvp_status kvpi_error_emit(kvp_error *err, const kvp_error *detail)
{
    if (err != NULL) {
        *err = *detail;
    }
    return detail->status;
}

kvp_status kvpi_fail_null(kvp_error *err, const char *argument)
{
    kvp_error e = kvpi_error_begin(KVP_NULL_ARGUMENT);
    e.argument = argument;
    return kvpi_error_emit(err, &e);
}

kvp_status kvpi_fail_invalid(kvp_error *err, const char *argument, const char *why)
{
    kvp_error e = kvpi_error_begin(KVP_INVALID_ARGUMENT);
    e.argument = argument;
    e.what = why;
    return kvpi_error_emit(err, &e);
}

kvp_status kvpi_fail_out_of_range(kvp_error *err, const char *argument, size_t index,
                                  size_t limit)
{
    kvp_error e = kvpi_error_begin(KVP_OUT_OF_RANGE);
    e.argument = argument;
    e.index = index;
    e.limit = limit;
    return kvpi_error_emit(err, &e);
}

kvp_status kvpi_fail_buffer(kvp_error *err, const char *argument, size_t needed,
                            size_t available)
{
    kvp_error e = kvpi_error_begin(KVP_BUFFER_TOO_SMALL);
    e.argument = argument;
    e.needed = needed;
    e.available = available;
    return kvpi_error_emit(err, &e);
}

kvp_status kvpi_fail_alloc(kvp_error *err, const char *what, size_t bytes)
{
    kvp_error e = kvpi_error_begin(KVP_ALLOCATION_FAILED);
    e.what = what;
    e.bytes = bytes;
    return kvpi_error_emit(err, &e);
}

kvp_shape kvpi_shape4(size_t d0, size_t d1, size_t d2, size_t d3)
{
    kvp_shape shape;
    memset(&shape, 0, sizeof shape);
    shape.rank = 4;
    shape.dims[0] = d0;
    shape.dims[1] = d1;
    shape.dims[2] = d2;
    shape.dims[3] = d3;
    return shape;
}

int kvpi_shape_equal(const kvp_shape *a, const kvp_shape *b)
{
    if (a->rank != b->rank || a->rank > KVP_MAX_RANK) {
        return 0;
    }
    for (size_t i = 0; i < a->rank; i++) {
        if (a->dims[i] != b->dims[i]) {
            return 0;
        }
    }
    return 1;
}

size_t kvpi_shape_elements(const kvp_shape *shape, int *overflow)
{
    size_t count = 1;
    *overflow = 0;
    for (size_t i = 0; i < shape->rank && i < KVP_MAX_RANK; i++) {
        if (shape->dims[i] != 0 && count > SIZE_MAX / shape->dims[i]) {
            *overflow = 1;
            return 0;
        }
        count *= shape->dims[i];
    }
    return count;
}

size_t kvpi_first_nonfinite(const double *values, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(values[i])) {
            return i;
        }
    }
    return n;
}

kvp_status kvpi_check_finite(const double *values, size_t n, kvp_status status, const char *what,
                             kvp_error *err)
{
    size_t index = kvpi_first_nonfinite(values, n);
    if (index == n) {
        return KVP_OK;
    }
    kvp_error e = kvpi_error_begin(status);
    e.what = what;
    e.index = index;
    e.value = values[index];
    return kvpi_error_emit(err, &e);
}
