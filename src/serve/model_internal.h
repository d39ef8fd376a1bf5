/*
 * model_internal.h: struct kvp_model, for the serving sources.
 * Invariant: layers[0..count) are owned and share one (heads, kv_heads, head_width).
 * Callers: src/serve only.
 */
#ifndef KVPAGER_SERVE_MODEL_INTERNAL_H
#define KVPAGER_SERVE_MODEL_INTERNAL_H

#include "kvpager/model.h"

struct kvp_model {
    size_t count;
    size_t model_width;
    size_t heads;
    size_t kv_heads;
    size_t head_width;
    kvp_layer *layers[];
};

#endif /* KVPAGER_SERVE_MODEL_INTERNAL_H */
