/*
 * share.c: sharing at the sequence level (kvpager/sequence.h "Sharing"):
 * fork, truncate, and the prefix cache of prompts.
 *
 * Owns nothing of its own: every call works on all the sequence's layer
 * caches at once, through the pager's sharing (src/pager/share.c), in one
 * hold of the pool lock, so the layers stay the same length (the sequence
 * invariant) and other threads see either all of a change or none of it.
 *
 * Prompt keys: block j of lane b of layer l is keyed by the chain
 *   key[j][l][b] = kvp_block_key_chain(key[j-1][l][b], cache l,
 *                                      prompt rows of lane b, block j,
 *                                      context)
 * where context digests every layer's binding (kvp_cache_binding_key), so a
 * layer's K/V are found only under the exact model (identities, revisions,
 * RoPE, geometry, dtype) and prompt prefix that produced them.
 * Callers: the public API.
 */
#include "serve/sequence_internal.h"

#include <string.h>

#include "pager/alloc.h"
#include "pager/cache_internal.h"
#include "pager/error.h"

kvp_status kvp_sequence_fork(kvp_sequence *parent, kvp_sequence **child, kvp_error *err)
{
    if (parent == NULL) {
        return kvpi_fail_null(err, "parent");
    }
    if (child == NULL) {
        return kvpi_fail_null(err, "child");
    }
    kvp_sequence *made = NULL;
    kvp_status status = kvp_sequence_create(parent->model, parent->pool, parent->batch_size,
                                            parent->capacity, &made, err);
    if (status != KVP_OK) {
        return status; /* the partial child was destroyed by create: nothing changed */
    }
    kvpi_pool_lock(parent->pool);
    for (size_t l = 0; l < parent->layers; l++) {
        kvpi_cache_fork_into_locked(parent->caches[l], made->caches[l]);
    }
    kvpi_pool_unlock(parent->pool);
    *child = made;
    return KVP_OK;
}

kvp_status kvp_sequence_truncate(kvp_sequence *sequence, size_t new_len, kvp_error *err)
{
    if (sequence == NULL) {
        return kvpi_fail_null(err, "sequence");
    }
    size_t len = sequence->caches[0]->len;
    if (new_len > len) {
        return kvpi_fail_out_of_range(err, "new_len", new_len, len + 1);
    }
    if (new_len == len) {
        return KVP_OK;
    }
    for (size_t l = 0; l < sequence->layers; l++) {
        (void)kvp_ticket_discard(sequence->tickets[l], NULL);
    }
    kvpi_pool_lock(sequence->pool);
    kvpi_cache_truncate_many_locked(sequence->caches, sequence->layers, new_len);
    kvpi_pool_unlock(sequence->pool);
    return KVP_OK;
}

/* The prompt's rank, batch and width, as a prefill checks them. */
static kvp_status check_prompt(const kvp_sequence *seq, const kvp_tensor *prompt, kvp_error *err)
{
    if (prompt == NULL || prompt->data == NULL) {
        return kvpi_fail_null(err, "prompt");
    }
    const kvp_shape *shape = &prompt->shape;
    kvp_error e = kvpi_error_begin(KVP_OK);
    if (shape->rank != 3) {
        e.status = KVP_INPUT_RANK;
        e.rank = shape->rank;
        e.what = "prompt";
    } else if (shape->dims[0] != seq->batch_size) {
        e.status = KVP_INPUT_BATCH_MISMATCH;
        e.expected_size = seq->batch_size;
        e.actual_size = shape->dims[0];
    } else if (shape->dims[2] != seq->model_width) {
        e.status = KVP_INPUT_WIDTH_MISMATCH;
        e.expected_size = seq->model_width;
        e.actual_size = shape->dims[2];
    }
    if (e.status != KVP_OK) {
        e.layer = SIZE_MAX;
        return kvpi_error_emit(err, &e);
    }
    return KVP_OK;
}

/*
 * The keys of the first `blocks` blocks of the prompt, [blocks][layers][batch],
 * in a new allocation (kvpi_free) at *out, or ALLOCATION_FAILED.
 */
static kvp_status prompt_keys(const kvp_sequence *seq, const kvp_tensor *prompt, size_t blocks,
                              kvp_block_key **out, kvp_error *err)
{
    size_t per_block = seq->layers * seq->batch_size;
    size_t count = blocks * per_block; /* bounded by the reservation's page count */
    size_t bytes = (count + seq->layers) * sizeof(kvp_block_key);
    kvp_block_key *keys = kvpi_alloc(KVPI_SITE_SCRATCH, bytes);
    if (keys == NULL) {
        return kvpi_fail_alloc(err, "prefix keys", bytes);
    }
    kvp_block_key *bindings = keys + count; /* each layer's binding digest */
    for (size_t l = 0; l < seq->layers; l++) {
        bindings[l] = kvpi_cache_binding_key(seq->caches[l]);
    }
    kvp_block_key context = kvpi_block_key_chain(NULL, &bindings[0], bindings,
                                                 seq->layers * sizeof *bindings, NULL);
    size_t bt = seq->caches[0]->block_tokens;
    size_t d = seq->model_width;
    size_t tokens = prompt->shape.dims[1];
    for (size_t j = 0; j < blocks; j++) {
        for (size_t l = 0; l < seq->layers; l++) {
            for (size_t b = 0; b < seq->batch_size; b++) {
                const double *rows = prompt->data + (b * tokens + j * bt) * d;
                const kvp_block_key *parent =
                    j == 0 ? NULL : &keys[((j - 1) * seq->layers + l) * seq->batch_size + b];
                keys[(j * seq->layers + l) * seq->batch_size + b] = kvpi_block_key_chain(
                    parent, &bindings[l], rows, bt * d * sizeof *rows, &context);
            }
        }
    }
    *out = keys;
    return KVP_OK;
}

kvp_status kvp_sequence_adopt_prefix(kvp_sequence *sequence, const kvp_tensor *prompt,
                                     size_t *tokens_adopted, kvp_error *err)
{
    if (sequence == NULL) {
        return kvpi_fail_null(err, "sequence");
    }
    kvp_status status = check_prompt(sequence, prompt, err);
    if (status != KVP_OK) {
        return status;
    }
    if (tokens_adopted == NULL) {
        return kvpi_fail_null(err, "tokens_adopted");
    }
    if (sequence->caches[0]->len != 0) {
        return kvpi_fail_invalid(err, "sequence",
                                 "must be empty: prompt keys chain from the first token");
    }
    size_t bt = sequence->caches[0]->block_tokens;
    size_t tokens = prompt->shape.dims[1];
    /* At least the last token is left to compute: its output is the caller's next input. */
    size_t blocks = tokens == 0 ? 0 : (tokens - 1) / bt;
    if (blocks > sequence->capacity / bt) {
        blocks = sequence->capacity / bt;
    }
    if (blocks == 0) {
        *tokens_adopted = 0;
        return KVP_OK;
    }
    kvp_block_key *keys = NULL;
    status = prompt_keys(sequence, prompt, blocks, &keys, err);
    if (status != KVP_OK) {
        return status;
    }
    kvpi_pool_lock(sequence->pool);
    size_t adopted = kvpi_cache_adopt_locked(sequence->caches, sequence->layers, keys, blocks);
    kvpi_pool_unlock(sequence->pool);
    kvpi_free(keys);
    *tokens_adopted = adopted * bt;
    return KVP_OK;
}

kvp_status kvp_sequence_publish_prefix(kvp_sequence *sequence, const kvp_tensor *prompt,
                                       size_t *blocks_published, kvp_error *err)
{
    if (sequence == NULL) {
        return kvpi_fail_null(err, "sequence");
    }
    kvp_status status = check_prompt(sequence, prompt, err);
    if (status != KVP_OK) {
        return status;
    }
    size_t bt = sequence->caches[0]->block_tokens;
    size_t len = sequence->caches[0]->len;
    size_t tokens = prompt->shape.dims[1];
    size_t blocks = (tokens < len ? tokens : len) / bt;
    if (blocks == 0) {
        if (blocks_published != NULL) {
            *blocks_published = 0;
        }
        return KVP_OK;
    }
    kvp_block_key *keys = NULL;
    status = prompt_keys(sequence, prompt, blocks, &keys, err);
    if (status != KVP_OK) {
        return status;
    }
    kvp_pool *pool = sequence->pool;
    size_t batch = sequence->batch_size;
    kvpi_pool_lock(pool);
    /* First pass: refuse before registering anything. */
    for (size_t i = 0; i < blocks * sequence->layers * batch && status == KVP_OK; i++) {
        size_t j = i / (sequence->layers * batch);
        const kvp_cache *cache = sequence->caches[(i / batch) % sequence->layers];
        uint32_t page = kvpi_cache_lane_table(cache, i % batch)[j];
        const kvp_block_key *had = &pool->page_key[page];
        if (pool->registered[page] && (had->lo != keys[i].lo || had->hi != keys[i].hi)) {
            kvp_error e = kvpi_error_begin(KVP_PAGE_PUBLISHED);
            e.index = page;
            e.layer = (i / batch) % sequence->layers;
            status = kvpi_error_emit(err, &e);
        }
    }
    for (size_t i = 0; i < blocks * sequence->layers * batch && status == KVP_OK; i++) {
        size_t j = i / (sequence->layers * batch);
        const kvp_cache *cache = sequence->caches[(i / batch) % sequence->layers];
        uint32_t page = kvpi_cache_lane_table(cache, i % batch)[j];
        if (!pool->registered[page] && kvpi_prefix_lookup_locked(pool, &keys[i]) == KVPI_NO_PAGE) {
            kvpi_prefix_insert_locked(pool, page, &keys[i]);
        }
    }
    kvpi_pool_unlock(pool);
    kvpi_free(keys);
    if (status == KVP_OK && blocks_published != NULL) {
        *blocks_published = blocks;
    }
    return status;
}
