/*
 * model_internal.h: struct kvp_model, for the serving sources.
 * Invariants: layers[0..count) are owned and share one (heads, kv_heads,
 * head_width); `sequences` is the number of live sequences created on the
 * model (changed only by kvpi_model_sequence_added / _removed, from
 * sequence.c), and kvp_model_destroy refuses while it is not 0.
 * Callers: src/serve only.
 */
#ifndef KVPAGER_SERVE_MODEL_INTERNAL_H
#define KVPAGER_SERVE_MODEL_INTERNAL_H

#include <stdatomic.h>

#include "kvpager/model.h"
#include "pager/abi.h"

/* kvp_model_info's first-release size (pager/abi.h, "Growing structs"). */
#define KVPI_MODEL_INFO_SIZE_FIRST sizeof(kvp_model_info)

struct kvp_model {
    atomic_size_t sequences;    /* live sequences running this model */
    size_t count;
    size_t model_width;
    size_t heads;
    size_t kv_heads;
    size_t head_width;
    kvp_layer *layers[];
};

/*
 * A sequence on `model` was created / is being destroyed. The count is the
 * one field of a model that changes after creation; sequences see their
 * model as const (they only read it), so these take a const model and
 * update the counter atomically: sequences on many threads may share one.
 */
void kvpi_model_sequence_added(const kvp_model *model);
void kvpi_model_sequence_removed(const kvp_model *model);

#endif /* KVPAGER_SERVE_MODEL_INTERNAL_H */
