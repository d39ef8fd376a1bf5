/*
 * layer_internal.h: struct kvp_layer, for the attention sources.
 *
 * Invariants: model_width == heads * head_width; every params[i] is a
 * model_width x model_width parameter the layer holds one reference to;
 * rope.feature_width == head_width and rope is valid.
 * Callers: src/attention and src/serve (models own layers).
 */
#ifndef KVPAGER_ATTENTION_LAYER_INTERNAL_H
#define KVPAGER_ATTENTION_LAYER_INTERNAL_H

#include "kvpager/layer.h"

struct kvp_layer {
    kvp_param *params[KVP_PARAM_COUNT];
    size_t model_width;
    size_t heads;
    size_t head_width;
    kvp_rope_config rope;
};

/* kvp_layer_binding for a layer known to exist: cannot fail. */
void kvpi_layer_binding(const kvp_layer *layer, kvp_binding *out);

#endif /* KVPAGER_ATTENTION_LAYER_INTERNAL_H */
