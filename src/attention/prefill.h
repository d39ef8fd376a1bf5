/*
 * prefill.h: one layer's attention for a block of consecutive new tokens,
 * visiting each page of the cache once for the whole block (see prefill.c).
 *
 * The contract is the token-by-token one, bit for bit: row t of a block
 * gets exactly the values, errors and stored key/value rows that
 * kvpi_attention_prepare followed by a commit would give it, token after
 * token, with the same kernels in the same per-row order. Only the order in
 * which pages are read (and rows computed) changes.
 * Callers: src/serve/sequence.c (prefill), bench/ and tests/.
 */
#ifndef KVPAGER_ATTENTION_PREFILL_H
#define KVPAGER_ATTENTION_PREFILL_H

#include <stddef.h>

#include "kvpager/layer.h"
#include "attention/parallel.h"
#include "pager/cache_internal.h"

/*
 * The workspace of a block of up to `tokens` rows of `batch` lanes whose
 * positions stay below `keys`, for `layers` layers of at most `heads` query
 * heads, `model_width` and `kv_width` (= kv_heads * head_width), in storage
 * its owner provides (a sequence allocates it with its buffers, so a
 * prefill allocates nothing). Rows are token-major: row t of a
 * [tokens][batch][width] buffer is the [batch][width] slice at
 * t * batch * width, the layout of a ticket's buffers, so a row's error
 * indexes are a ticket's.
 */
typedef struct kvpi_prefill_work {
    size_t tokens, batch, model_width, heads, kv_width, keys, layers;
    double *input;        /* [tokens][B][D]: the layer's input rows (the caller's) */
    double *next;         /* [tokens][B][D]: the next layer's (the caller's) */
    double *query;        /* [tokens][B][D]: rotated queries */
    double *head_outputs; /* [tokens][B][D] */
    double *output;       /* [tokens][B][D]: the attention outputs */
    double *key;          /* [layers][tokens][B][kv_width] (see below): rotated keys, rounded */
    double *value;        /* likewise: values, rounded to the dtype */
    double *weights;      /* row t at t * B * heads * keys: [B][H][P_t + 1], or with a
                             window [B][H][its attended positions] */
} kvpi_prefill_work;

/* Doubles of storage per token of a block, saturated at SIZE_MAX. */
size_t kvpi_prefill_work_doubles(size_t batch, size_t model_width, size_t heads, size_t kv_width,
                                 size_t keys, size_t layers);

/* Points the work at `storage`, tokens * kvpi_prefill_work_doubles(...) doubles. */
void kvpi_prefill_work_init(kvpi_prefill_work *work, double *storage, size_t tokens,
                            size_t batch, size_t model_width, size_t heads, size_t kv_width,
                            size_t keys, size_t layers);

/*
 * Row t of slot `slot`'s rounded keys, or values: [B][kv_width] packed, with
 * the slot's layer's kv_width (each slot holds [tokens][B][kv_width] of it).
 */
static inline const double *kvpi_prefill_work_key(const kvpi_prefill_work *w, size_t slot,
                                                  size_t t, size_t kv_width)
{
    return w->key + slot * w->tokens * w->batch * w->kv_width + t * w->batch * kv_width;
}
static inline const double *kvpi_prefill_work_value(const kvpi_prefill_work *w, size_t slot,
                                                    size_t t, size_t kv_width)
{
    return w->value + slot * w->tokens * w->batch * w->kv_width + t * w->batch * kv_width;
}

/*
 * Layer `layer` (the work's layer slot `slot`) for rows 0..tokens-1 of the
 * work's input, the tokens at positions cache->len, cache->len + 1, ...
 * (nothing of the block is in the cache yet): checks each row as
 * kvpi_attention_prepare would (projections, storable key/value, scores,
 * output, append), in row order, and computes its output as a prepare at
 * length cache->len + t would, bit for bit. Returns the number r of leading
 * rows that passed: rows 0..r-1 have their outputs (work->output) and their
 * rounded keys and values (kvpi_prefill_work_key/value, slot), which the
 * caller commits; when r < tokens, *failure holds row r's error (the one a
 * token-by-token prepare of row r reports; err.layer and err.token are
 * left for the caller). The cache's bindings were checked by the caller
 * (they cannot change during a prefill) and it has room for every row.
 * Writes nothing but the work. Attention runs on `par` (NULL: this thread)
 * with the same bits for any executor.
 */
size_t kvpi_prefill_layer(const kvp_layer *layer, const kvp_cache *cache, size_t slot,
                          kvpi_prefill_work *work, size_t tokens, const kvpi_parallel *par,
                          kvp_error *failure);

#endif /* KVPAGER_ATTENTION_PREFILL_H */
