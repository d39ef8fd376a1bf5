/*
 * kv_scales_stub.c: a placeholder for kvpi_cache_kv_scales (cache_internal.h)
 * so the kernels branch links before fp8 pages exist: pools refuse
 * KVP_FP8_E4M3 there, so every cache's scales are 1.0 and 1.0.
 * The dtypes branch (fp8 pages, per-layer K and V scales) replaces it with
 * the real accessor; this file is deleted when the two are merged.
 * Callers: src/attention/gather.c.
 */
#include "pager/cache_internal.h"

void kvpi_cache_kv_scales(const kvp_cache *cache, double *k_scale, double *v_scale)
{
    (void)cache;
    *k_scale = 1.0;
    *v_scale = 1.0;
}
