/*
 * layer_internal.h: struct kvp_layer, for the attention sources.
 *
 * Invariants: model_width == heads * head_width; kv_heads divides heads;
 * the layer holds one reference to each params[i]; W_q and W_o are
 * model_width x model_width, W_k and W_v model_width x (kv_heads *
 * head_width); query head h reads KV head h / (heads / kv_heads);
 * rope.feature_width == head_width and rope is valid.
 *
 * The layer's RoPE angles are written once, when the first layer of a RoPE
 * configuration is made, and only read afterwards (so threads share them
 * freely): rope_theta[i] = base^(-2i / d_h) for i < d_h / 2, and, when it
 * takes at most KVPI_ROPE_TABLE_MAX_BYTES, rope_table[(p * d_h / 2 + i) * 2
 * + {0, 1}] = cos, sin of (double)p * rope_theta[i] for every p <
 * max_positions; above that cap rope_table is NULL and each rotation
 * computes cos and sin once per call (per position, for every head and
 * lane). Either way the bits are those of kvpi_rope_apply_rows: the same
 * formulas, the same libm.
 *
 * Sharing: the angles live in the allocation of one layer, their owner
 * (rope_owner == the layer itself); a layer made with the same RoPE
 * configuration (head width, max_positions, base bits) as an existing
 * layer, through kvpi_layer_create_sharing (models do this for all their
 * layers), points at the owner's angles instead of computing its own, and
 * its allocation is the struct alone. The owner's rope_refs counts the
 * layers using its angles, itself included (atomically: layers of several
 * models may be destroyed on several threads at once); the owner's
 * allocation is freed when the last of them is destroyed, so destroying
 * the owner first leaves its angles to the others. The angles are the same
 * bits whether computed or shared.
 * Callers: src/attention and src/serve (models own layers).
 */
#ifndef KVPAGER_ATTENTION_LAYER_INTERNAL_H
#define KVPAGER_ATTENTION_LAYER_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvpager/layer.h"
#include "pager/abi.h"
#include "pager/cache_internal.h"

/* kvp_layer_info's first-release size (pager/abi.h, "Growing structs"). */
#define KVPI_LAYER_INFO_SIZE_FIRST offsetof(kvp_layer_info, accum)
KVPI_FIRST_RELEASE_ALIGNED(kvp_layer_info, KVPI_LAYER_INFO_SIZE_FIRST);

struct kvp_layer {
    kvp_param *params[KVP_PARAM_COUNT];
    size_t model_width;
    size_t heads;
    size_t kv_heads;
    size_t head_width;
    double k_scale, v_scale;  /* fp8 K and V scales its bindings carry (kvp_layer_set_kv_scales) */
    kvp_rope_config rope;
    kvp_accum accum;          /* decode steps' level (kvp_layer_set_accum); 0: EXACT */
    size_t window;            /* W (kvp_layer_set_window); 0: full attention */
    size_t sink_tokens;       /* S; 0 when window is 0 */
    const double *rope_theta; /* [d_h / 2], in the owner's rope_data */
    const double *rope_table; /* [max_positions][d_h / 2][cos, sin] there too, or NULL */
    struct kvp_layer *rope_owner; /* the layer whose allocation holds the angles */
    atomic_size_t rope_refs;      /* on an owner: the layers using its angles */
    double rope_data[];           /* an owner's angles; empty in a sharing layer */
};

/* The largest RoPE table a layer keeps: 4 MiB (8192 positions at d_h = 64). */
#define KVPI_ROPE_TABLE_MAX_BYTES ((size_t)4 << 20)

/*
 * The bytes of a layer's one allocation when it owns its angles: the struct,
 * its thetas and, within the cap, its table. head_width is even and nonzero.
 * A sharing layer allocates sizeof(struct kvp_layer).
 */
size_t kvpi_layer_alloc_bytes(size_t head_width, size_t max_positions);

/*
 * kvp_layer_create_grouped, sharing the RoPE angles of `rope_from` when it
 * is not NULL and has this layer's RoPE configuration (else the layer
 * computes its own). Same checks, errors and results, bit for bit; one
 * allocation (site LAYER) either way.
 */
kvp_status kvpi_layer_create_sharing(kvp_param *w_query, kvp_param *w_key, kvp_param *w_value,
                                     kvp_param *w_output, size_t heads, size_t kv_heads,
                                     size_t max_positions, double rope_base,
                                     const kvp_layer *rope_from, kvp_layer **out,
                                     kvp_error *err);

/* kvp_layer_create_random_grouped, sharing `rope_from`'s angles as above. */
kvp_status kvpi_layer_create_random_sharing(size_t model_width, size_t heads, size_t kv_heads,
                                            size_t max_positions, double rope_base,
                                            uint64_t seed, const kvp_layer *rope_from,
                                            kvp_layer **out, kvp_error *err);

/* Whether two layers' RoPE configurations are equal (the base bit for bit). */
int kvpi_layer_same_rope(const kvp_layer *a, const kvp_layer *b);

/*
 * Attention's owner record in a layer binding (binding.c): the fields the
 * seed's binding rule compares, as 64-bit words, in kvp_binding.record.
 */
#define KVPI_LAYER_RECORD_MAGIC 0x3172636572747461ull /* "attnrec1" */
typedef struct kvpi_layer_record {
    uint64_t magic;
    uint64_t model_width;
    uint64_t heads; /* query heads */
    uint64_t rope_feature_width;
    uint64_t rope_max_positions;
    uint64_t rope_base_bits; /* the RoPE base's f64 bits */
    uint64_t node_id[KVP_PARAM_COUNT];
    uint64_t revision[KVP_PARAM_COUNT];
    /* Sliding windows: 0 and 0 for full attention, so a full layer's record
     * bytes (and digest) are those before windows existed. */
    uint64_t window;
    uint64_t sink_tokens;
} kvpi_layer_record;

/* kvp_layer_binding_get for a layer known to exist: cannot fail. */
void kvpi_layer_binding(const kvp_layer *layer, kvp_binding *out);
/* The layer's record now (its parameters' current revisions). */
void kvpi_layer_record_of(const kvp_layer *layer, kvpi_layer_record *out);
/*
 * A layer binding from a record: kind KVP_BINDING_LAYER, the page geometry,
 * max_positions = the record's RoPE positions, the scales, the record bytes,
 * owner_digest = BLAKE2b-128 of them, owner_revision = the sum of the
 * record's revisions. kvpi_layer_binding is this for the layer's record;
 * tests and benchmarks build bindings of layers they do not have with it.
 */
void kvpi_layer_record_binding(const kvpi_layer_record *record, size_t kv_heads,
                               size_t head_width, double k_scale, double v_scale,
                               kvp_binding *out);
/*
 * The record attention compares a binding (a cache's: kvpi_cache_layer_record)
 * with: a layer binding's record; for an external binding, (model width
 * kv_heads * head_width, heads kv_heads, every parameter (identity,
 * revision), RoPE (0, max_positions, 0)), the fields its binding had before
 * 0.2; all zero for a layer binding whose record is not attention's.
 */
void kvpi_binding_layer_record(const kvp_binding *binding, kvpi_layer_record *out);
void kvpi_cache_layer_record(const kvp_cache *cache, kvpi_layer_record *out);
/*
 * The query heads of a cache: its record's (an external cache's: its KV
 * heads; 0 for a record that is not attention's). Inline: gathers ask per row.
 */
static inline size_t kvpi_cache_query_heads(const kvp_cache *cache)
{
    const kvp_binding *b = kvpi_cache_binding(cache);
    if (b->kind == KVP_BINDING_EXTERNAL) {
        return b->kv_heads;
    }
    uint64_t magic, heads;
    memcpy(&magic, b->record + offsetof(kvpi_layer_record, magic), sizeof magic);
    memcpy(&heads, b->record + offsetof(kvpi_layer_record, heads), sizeof heads);
    return magic == KVPI_LAYER_RECORD_MAGIC ? (size_t)heads : 0;
}

/*
 * The attention window W and sink tokens S a cache was bound with (its
 * record's; 0 and 0, full attention, for an external cache or a record that
 * is not attention's). Inline: gathers ask per call.
 */
static inline void kvpi_cache_window(const kvp_cache *cache, size_t *window, size_t *sinks)
{
    const kvp_binding *b = kvpi_cache_binding(cache);
    uint64_t magic = 0, w = 0, s = 0;
    if (b->kind != KVP_BINDING_EXTERNAL) {
        memcpy(&magic, b->record + offsetof(kvpi_layer_record, magic), sizeof magic);
        memcpy(&w, b->record + offsetof(kvpi_layer_record, window), sizeof w);
        memcpy(&s, b->record + offsetof(kvpi_layer_record, sink_tokens), sizeof s);
    }
    *window = magic == KVPI_LAYER_RECORD_MAGIC ? (size_t)w : 0;
    *sinks = magic == KVPI_LAYER_RECORD_MAGIC && w != 0 ? (size_t)s : 0;
}

/*
 * The positions a query at position q attends to under window W and sinks
 * S (layer.h, kvp_layer_set_window): [0, sinks) then [lo, q], each once.
 * W = 0: sinks = 0, lo = 0.
 */
typedef struct kvpi_window_span {
    size_t sinks; /* min(S, lo): the sink positions before the window */
    size_t lo;    /* the window's first position */
} kvpi_window_span;

static inline kvpi_window_span kvpi_window_span_at(size_t window, size_t sink_tokens, size_t q)
{
    kvpi_window_span s = {0, 0};
    if (window != 0 && q + 1 > window) {
        s.lo = q + 1 - window;
        s.sinks = sink_tokens < s.lo ? sink_tokens : s.lo;
    }
    return s;
}

/* Positions attended at q: the sinks plus the window's q - lo + 1. */
static inline size_t kvpi_window_keys(kvpi_window_span s, size_t q)
{
    return s.sinks + (q - s.lo + 1);
}

/*
 * Rotates `count` vectors of d_h features each of `a` and, unless NULL, of
 * `b` (packed, head_width apart) at `position` < max_positions, with the
 * layer's table or its thetas: the bits of kvpi_rope_apply_rows.
 */
void kvpi_layer_rope(const kvp_layer *layer, double *a, double *b, size_t count,
                     size_t position);

/*
 * Rotates `queries` vectors of q and `keys` vectors of k (packed, d_h each)
 * at `position`: with kv_heads < heads there are fewer key vectors than query
 * vectors. The bits of kvpi_layer_rope on each.
 */
void kvpi_layer_rope_qk(const kvp_layer *layer, double *q, size_t queries, double *k,
                        size_t keys, size_t position);

#endif /* KVPAGER_ATTENTION_LAYER_INTERNAL_H */
