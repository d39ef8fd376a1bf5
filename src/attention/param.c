/*
 * param.c: reference-counted parameter nodes with identity and revision
 * (see kvpager/param.h).
 *
 * Invariants: id is unique in the process and never reused (taken from
 * `next_param_id`); revision only grows; refs >= 1 while the node exists;
 * rows, cols >= 1 and values holds rows * cols doubles.
 * Threads: refs and revision are C11 atomics. An update writes the values,
 * then advances the revision with a release store, and readers load it with
 * acquire, so a reader that sees revision r also sees the values of update r
 * once the updater is done (the values themselves are not atomic: see
 * kvpager/param.h for who may read them during an update).
 * Global state: `next_param_id`, the process-wide identity counter.
 */
#include "kvpager/param.h"

#include <stdatomic.h>
#include <string.h>

#include "pager/alloc.h"
#include "pager/error.h"

struct kvp_param {
    atomic_size_t refs;
    uint64_t id;
    atomic_uint_fast64_t revision;
    size_t rows;
    size_t cols;
    double values[];
};

static atomic_uint_fast64_t next_param_id = 1;

kvp_status kvp_param_create_matrix(size_t rows, size_t cols, const double *values,
                                  kvp_param **out, kvp_error *err)
{
    if (values == NULL) {
        return kvpi_fail_null(err, "values");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (rows == 0) {
        return kvpi_fail_invalid(err, "rows", "a parameter needs a nonzero row count");
    }
    if (cols == 0) {
        return kvpi_fail_invalid(err, "cols", "a parameter needs a nonzero column count");
    }
    if (rows > SIZE_MAX / cols ||
        rows * cols > (SIZE_MAX - sizeof(kvp_param)) / sizeof(double)) {
        return kvpi_fail_invalid(err, "cols", "rows * cols overflows");
    }
    size_t count = rows * cols;
    size_t bytes = sizeof(kvp_param) + count * sizeof(double);
    kvp_param *param = kvpi_alloc(KVPI_SITE_PARAM, bytes);
    if (param == NULL) {
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_PARAM), bytes);
    }
    atomic_init(&param->refs, 1);
    param->id = atomic_fetch_add(&next_param_id, 1);
    atomic_init(&param->revision, 0);
    param->rows = rows;
    param->cols = cols;
    memcpy(param->values, values, count * sizeof(double));
    *out = param;
    return KVP_OK;
}

kvp_status kvp_param_create(size_t width, const double *values, kvp_param **out, kvp_error *err)
{
    if (values == NULL) {
        return kvpi_fail_null(err, "values");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (width == 0) {
        return kvpi_fail_invalid(err, "width", "a parameter needs a nonzero width");
    }
    if (width > SIZE_MAX / width ||
        width * width > (SIZE_MAX - sizeof(kvp_param)) / sizeof(double)) {
        return kvpi_fail_invalid(err, "width", "width * width overflows");
    }
    return kvp_param_create_matrix(width, width, values, out, err);
}

kvp_status kvp_param_retain(kvp_param *param, kvp_error *err)
{
    if (param == NULL) {
        return kvpi_fail_null(err, "param");
    }
    atomic_fetch_add(&param->refs, 1);
    return KVP_OK;
}

kvp_status kvp_param_release(kvp_param *param, kvp_error *err)
{
    (void)err;
    if (param == NULL) {
        return KVP_OK; /* destroying NULL does nothing, as free(NULL) */
    }
    if (atomic_fetch_sub(&param->refs, 1) == 1) {
        kvpi_free(param);
    }
    return KVP_OK;
}

kvp_status kvp_param_update(kvp_param *param, const double *values, kvp_error *err)
{
    if (param == NULL) {
        return kvpi_fail_null(err, "param");
    }
    if (values == NULL) {
        return kvpi_fail_null(err, "values");
    }
    memmove(param->values, values, param->rows * param->cols * sizeof(double));
    atomic_fetch_add_explicit(&param->revision, 1, memory_order_acq_rel);
    return KVP_OK;
}

kvp_status kvp_param_update_with(kvp_param *param, kvp_param_update_fn fn, void *ctx,
                                 kvp_error *err)
{
    if (param == NULL) {
        return kvpi_fail_null(err, "param");
    }
    if (fn == NULL) {
        return kvpi_fail_null(err, "fn");
    }
    fn(ctx, param->values, param->rows);
    atomic_fetch_add_explicit(&param->revision, 1, memory_order_acq_rel);
    return KVP_OK;
}

uint64_t kvp_param_id(const kvp_param *param)
{
    return param != NULL ? param->id : 0;
}

uint64_t kvp_param_revision(const kvp_param *param)
{
    return param != NULL ? (uint64_t)atomic_load_explicit(&param->revision, memory_order_acquire)
                         : 0;
}

size_t kvp_param_rows(const kvp_param *param)
{
    return param != NULL ? param->rows : 0;
}

size_t kvp_param_cols(const kvp_param *param)
{
    return param != NULL ? param->cols : 0;
}

const double *kvp_param_values(const kvp_param *param)
{
    return param != NULL ? param->values : NULL;
}
