/*
 * cache_dtype.c: a cache's storage type as its rows see it: the fp8 scales
 * captured in its binding, and the rounding of rows to the elements its
 * pages store (see kvpager/cache.h, kvp_binding; pager/dtype.h).
 *
 * Owns nothing: reads the cache's binding (fixed at creation) and its
 * pool's dtype (fixed for the pool's life).
 *
 * Rules:
 *   - a binding's k_scale and v_scale are finite, normal and > 0, or 0,
 *     which means 1.0 (kvpi_binding_check_scales refuses the rest); a
 *     cache keeps its binding as given (kvp_cache_info_get returns it) and
 *     reads 0 as 1.0 (kvpi_binding_scale);
 *   - the scales matter to KVP_FP8_E4M3 pools only: kvpi_cache_kv_scales
 *     gives 1.0 and 1.0 for every other dtype, so an f64, f32, bf16 or f16
 *     cache behaves the same whatever scales its binding carries;
 *   - kvpi_cache_round_rows is the one rounding of a candidate or prefill
 *     row (prepare, prefill): the elements the commit then stores exactly.
 * Callers: src/pager (cache.c, share.c), src/attention.
 */
#include <math.h>

#include "pager/cache_internal.h"
#include "pager/dtype.h"
#include "pager/error.h"

double kvpi_binding_scale(double scale)
{
    return scale == 0.0 ? 1.0 : scale;
}

kvp_status kvpi_binding_check_scales(const kvp_binding *binding, kvp_error *err)
{
    static const char *const names[2] = {"k_scale", "v_scale"};
    const double scales[2] = {binding->k_scale, binding->v_scale};
    for (size_t i = 0; i < 2; i++) {
        if (scales[i] != 0.0 && !(isnormal(scales[i]) && scales[i] > 0.0)) {
            return kvpi_fail_invalid(err, names[i], "must be finite, normal and > 0 (or 0: 1.0)");
        }
    }
    return KVP_OK;
}

void kvpi_cache_kv_scales(const kvp_cache *cache, double *k_scale, double *v_scale)
{
    int fp8 = kvpi_cache_dtype(cache) == KVP_FP8_E4M3;
    *k_scale = fp8 ? kvpi_binding_scale(cache->binding.k_scale) : 1.0;
    *v_scale = fp8 ? kvpi_binding_scale(cache->binding.v_scale) : 1.0;
}

double kvpi_cache_row_scale(const kvp_cache *cache, int values)
{
    double k_scale;
    double v_scale;
    kvpi_cache_kv_scales(cache, &k_scale, &v_scale);
    return values ? v_scale : k_scale;
}

void kvpi_cache_round_rows(const kvp_cache *cache, int values, double *rows, size_t n)
{
    kvpi_dtype_round_rows_scaled(kvpi_cache_dtype(cache), kvpi_cache_row_scale(cache, values),
                                 rows, n);
}
