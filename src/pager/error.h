/*
 * error.h: building kvp_error values on failure paths.
 *
 * Owns: the helpers every module uses to report a typed failure, and the
 * small shape and value checks that decide one. Each
 * returns the status it reports, so a failure path reads
 * `return kvpi_fail_null(err, "pool");`. They write *err only when err is
 * not NULL, and always write a whole, zeroed-then-filled struct.
 * Callers: src/ only.
 */
#ifndef KVPAGER_PAGER_ERROR_H
#define KVPAGER_PAGER_ERROR_H

#include "kvpager/status.h"

/* Starts a detail struct for `status`, all other fields zero. */
kvp_error kvpi_error_begin(kvp_status status);

/* Copies `detail` to err (when not NULL) and returns detail->status. */
kvp_status kvpi_error_emit(kvp_error *err, const kvp_error *detail);

kvp_status kvpi_fail_null(kvp_error *err, const char *argument);
kvp_status kvpi_fail_invalid(kvp_error *err, const char *argument, const char *why);
kvp_status kvpi_fail_out_of_range(kvp_error *err, const char *argument, size_t index,
                                  size_t limit);
kvp_status kvpi_fail_buffer(kvp_error *err, const char *argument, size_t needed,
                            size_t available);
kvp_status kvpi_fail_alloc(kvp_error *err, const char *what, size_t bytes);

/* Fills a shape from explicit dimensions. */
kvp_shape kvpi_shape4(size_t d0, size_t d1, size_t d2, size_t d3);

/* 1 when the two shapes have the same rank and dimensions. */
int kvpi_shape_equal(const kvp_shape *a, const kvp_shape *b);

/* Product of the dimensions; 0 with *overflow set when it overflows size_t. */
size_t kvpi_shape_elements(const kvp_shape *shape, int *overflow);

/* Index of the first non-finite value of values[0..n), or n when all are finite. */
size_t kvpi_first_nonfinite(const double *values, size_t n);

/*
 * KVP_OK when values[0..n) are all finite; otherwise reports `status` with
 * `what`, the flat index and the value of the first non-finite one.
 */
kvp_status kvpi_check_finite(const double *values, size_t n, kvp_status status, const char *what,
                             kvp_error *err);

#endif /* KVPAGER_PAGER_ERROR_H */
