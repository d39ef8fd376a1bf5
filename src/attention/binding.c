/*
 * binding.c: attention's owner record in a cache's binding (kvpager/cache.h,
 * kvp_binding; DESIGN.md, "External caches").
 *
 * Owns: what attention writes into a layer binding's opaque parts and how it
 * reads them back from a cache: the record (model width, query heads, each
 * parameter's node id and revision, the RoPE configuration, the attention
 * window W and sink tokens S (zero for a full layer, so its record bytes are
 * those from before windows)), the owner
 * digest (BLAKE2b-128 of the record bytes, so it covers every field above)
 * and the owner revision (the sum of the four parameter revisions: it grows
 * with every in-place update). The pager copies these at cache creation,
 * hashes them into the cache's binding digest and never reads them.
 * Invariants: a layer binding's record starts with KVPI_LAYER_RECORD_MAGIC,
 * holds heads * head_width == model_width and kv_heads dividing heads (a
 * layer's invariants); a cache's record view (kvpi_cache_layer_record) is
 * that record for a layer-bound cache and, for an external cache, the record
 * the pager's binding gave external caches before 0.2 (query heads = KV
 * heads, every parameter (identity, revision), no RoPE), so attention refuses
 * an external cache with the same errors as then.
 * Callers: src/attention, src/serve (paged attention's default query heads),
 * tests and bench/ (hand-made layer bindings).
 */
#include "attention/layer_internal.h"

#include <sodium.h>
#include <stddef.h>
#include <string.h>

#include "pager/cache_internal.h"

_Static_assert(sizeof(kvpi_layer_record) <= KVP_BINDING_RECORD_BYTES,
               "attention's record fits a binding's record bytes");

/*
 * The pager's window reader (kvpi_pager_set_window_reader): W and S of a
 * layer binding's record, the way kvpi_cache_window reads them. Registered
 * before the first layer binding exists, so every cache of one releases the
 * blocks its window no longer needs.
 */
static void binding_window(const kvp_binding *b, size_t *window, size_t *sinks)
{
    uint64_t magic = 0, w = 0, s = 0;
    memcpy(&magic, b->record + offsetof(kvpi_layer_record, magic), sizeof magic);
    memcpy(&w, b->record + offsetof(kvpi_layer_record, window), sizeof w);
    memcpy(&s, b->record + offsetof(kvpi_layer_record, sink_tokens), sizeof s);
    *window = magic == KVPI_LAYER_RECORD_MAGIC ? (size_t)w : 0;
    *sinks = magic == KVPI_LAYER_RECORD_MAGIC && w != 0 ? (size_t)s : 0;
}

void kvpi_layer_record_binding(const kvpi_layer_record *record, size_t kv_heads,
                               size_t head_width, double k_scale, double v_scale,
                               kvp_binding *out)
{
    kvpi_pager_set_window_reader(binding_window);
    kvp_binding binding;
    memset(&binding, 0, sizeof binding);
    binding.kind = KVP_BINDING_LAYER;
    binding.kv_heads = kv_heads;
    binding.head_width = head_width;
    binding.max_positions = (size_t)record->rope_max_positions;
    binding.k_scale = k_scale;
    binding.v_scale = v_scale;
    memcpy(binding.record, record, sizeof *record);
    unsigned char digest[16];
    /* Unkeyed: the digest names the record; the pool's keyed hash covers it again. */
    (void)crypto_generichash(digest, sizeof digest, binding.record, sizeof binding.record, NULL,
                             0);
    memcpy(binding.owner_digest, digest, sizeof digest);
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        binding.owner_revision += record->revision[i];
    }
    *out = binding;
}

void kvpi_layer_record_of(const kvp_layer *layer, kvpi_layer_record *out)
{
    kvpi_layer_record r;
    memset(&r, 0, sizeof r);
    r.magic = KVPI_LAYER_RECORD_MAGIC;
    r.model_width = layer->model_width;
    r.heads = layer->heads;
    r.rope_feature_width = layer->rope.feature_width;
    r.rope_max_positions = layer->rope.max_positions;
    memcpy(&r.rope_base_bits, &layer->rope.base, sizeof r.rope_base_bits);
    r.window = layer->window;
    r.sink_tokens = layer->sink_tokens;
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        r.node_id[i] = kvp_param_id(layer->params[i]);
        r.revision[i] = kvp_param_revision(layer->params[i]);
    }
    *out = r;
}

void kvpi_layer_binding(const kvp_layer *layer, kvp_binding *out)
{
    kvpi_layer_record r;
    kvpi_layer_record_of(layer, &r);
    kvpi_layer_record_binding(&r, layer->kv_heads, layer->head_width, layer->k_scale,
                              layer->v_scale, out);
}

void kvpi_binding_layer_record(const kvp_binding *binding, kvpi_layer_record *out)
{
    kvpi_layer_record r;
    memset(&r, 0, sizeof r);
    if (binding->kind == KVP_BINDING_EXTERNAL) {
        r.magic = KVPI_LAYER_RECORD_MAGIC;
        r.model_width = binding->kv_heads * binding->head_width;
        r.heads = binding->kv_heads;
        r.rope_max_positions = binding->max_positions;
        for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
            r.node_id[i] = binding->owner_digest[0];
            r.revision[i] = binding->owner_revision;
        }
    } else {
        memcpy(&r, binding->record, sizeof r);
        if (r.magic != KVPI_LAYER_RECORD_MAGIC) {
            memset(&r, 0, sizeof r); /* not attention's record: matches no layer */
        }
    }
    *out = r;
}

void kvpi_cache_layer_record(const kvp_cache *cache, kvpi_layer_record *out)
{
    kvpi_binding_layer_record(kvpi_cache_binding(cache), out);
}
