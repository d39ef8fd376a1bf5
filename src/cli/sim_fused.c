/*
 * sim_fused.c: when an allocator-only run fuses its layers' pages, and the
 * unit its figures keep (DESIGN.md, "Fused allocator-only pages").
 *
 * Owns: the fusing rule. An allocator-only run (compute off) reads and
 * writes no row, and its layers are all alike (the same heads, width, block
 * size and no window), so one page of kv_heads x layers heads, a block of
 * every layer's K and V (vLLM's one block id for all layers), holds exactly
 * the bytes the layers' own pages would, at 1/layers of the pager's work.
 * Fused only when exact: the budget's one-layer pages are a whole number of
 * blocks of every layer (a remainder would count as free pages no block can
 * use), and no more than a one-layer pool accepts. A computed run keeps a
 * page per layer; so must any setting that makes layers differ (a window on
 * some layers): it must return 1 here.
 * Invariant: a fused run's figures are in one-layer pages (the pool's times
 * the layers), the unit of a computed run, so they equal the per-layer run's.
 * Also the run's pool configuration, whose page shape the rule decides.
 * Callers: sim.c.
 */
#include "sim.h"

size_t kvp_sim_fused_layers(const kvp_sim_config *c)
{
    size_t factors[] = {2, kvp_sim_kv_heads(c), c->block_tokens,
                        c->heads ? c->model_width / c->heads : 0, kvp_dtype_bytes(c->kv_dtype)};
    size_t page_bytes = 1; /* of a one-layer page */
    for (size_t i = 0; i < sizeof factors / sizeof factors[0]; i++) {
        if (factors[i] == 0 || page_bytes > SIZE_MAX / factors[i]) {
            return 1;
        }
        page_bytes *= factors[i];
    }
    size_t pages = c->budget_bytes / page_bytes;
    if (c->compute || !c->fuse_layers || c->layers < 2 || pages < c->layers ||
        pages % c->layers != 0 || pages >= UINT32_MAX) {
        return 1;
    }
    return c->layers;
}

void kvp_sim_fused_step(size_t lanes, kvp_step_stats *st)
{
    size_t *pages[] = {&st->held_pages,      &st->total_pages,     &st->unshared_pages,
                       &st->cached_pages,    &st->evictable_pages, &st->retained_pages,
                       &st->used_slots};
    for (size_t i = 0; i < sizeof pages / sizeof pages[0]; i++) {
        *pages[i] *= lanes;
    }
}

void kvp_sim_pool_config(const kvp_sim_config *c, kvp_pool_config *pool_config)
{
    kvp_pool_config_init(pool_config);
    pool_config->block_tokens = c->block_tokens;
    /* The KV heads only, of every fused layer: a block of every layer a page. */
    pool_config->heads = kvp_sim_kv_heads(c) * kvp_sim_fused_layers(c);
    pool_config->head_width = c->model_width / c->heads;
    pool_config->budget_bytes = c->budget_bytes;
    pool_config->dtype = c->kv_dtype;
    /* The allocator alone never touches a page: no memory behind them (pool.h). */
    pool_config->slab_source = c->compute ? KVP_SLAB_DEFAULT : KVP_SLAB_RESERVED;
    if (c->compute && c->slab_alloc != NULL) {
        pool_config->slab_source = KVP_SLAB_CUSTOM;
        pool_config->slab_alloc = c->slab_alloc;
        pool_config->slab_free = c->slab_free;
        pool_config->slab_ctx = c->slab_ctx;
    }
    kvp_sim_tier_pool_secret(&c->tier, pool_config); /* processes sharing a tier agree */
}
