/*
 * layer_support.h: what the test_layer*.c programs share — the RoPE base and
 * position count of their layers (ROPE_BASE, MAX_POSITIONS), the ramp fill
 * (entry k = scale * k + offset) and the square parameter built from it,
 * the release that asserts success, and the update callback that counts its
 * calls and changes nothing. Everything is static inline, so a program that
 * uses only some of them builds without warnings. Included only by
 * tests/test_layer*.c (unit tests).
 */
#ifndef KVPT_LAYER_SUPPORT_H
#define KVPT_LAYER_SUPPORT_H

#include "support.h"

#define ROPE_BASE 10000.0
#define MAX_POSITIONS 8

/* A width x width matrix with entry (i, j) = scale * (i * width + j) + offset. */
static inline void fill_ramp(double *values, size_t width, double scale, double offset)
{
    for (size_t i = 0; i < width * width; i++) {
        values[i] = scale * (double)i + offset;
    }
}

static inline kvp_param *make_param(size_t width, double scale, double offset)
{
    double values[64 * 64];
    assert_true(width * width <= KVPT_COUNT_OF(values));
    fill_ramp(values, width, scale, offset);
    kvp_param *param = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_param_create(width, values, &param, &err), &err);
    return param;
}

static inline void release(kvp_param *param)
{
    kvp_error err;
    kvpt_assert_ok(kvp_param_release(param, &err), &err);
}

/* An update callback that counts its calls and changes no value. */
static inline void change_nothing(void *ctx, double *values, size_t width)
{
    size_t *calls = ctx;
    (*calls)++;
    (void)values;
    (void)width;
}

#endif /* KVPT_LAYER_SUPPORT_H */
