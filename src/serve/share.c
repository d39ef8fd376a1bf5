/*
 * share.c: sharing at the sequence level (kvpager/sequence.h "Sharing"):
 * fork, truncate, and the prefix cache of prompts.
 *
 * Owns nothing of its own: every call works on all the sequence's layer
 * caches at once, through the pager's group calls (src/pager/share.c: fork
 * and truncate of many caches, kvp_cache_group_adopt and _publish), each in
 * one hold of the pool lock, so the layers stay the same length (the
 * sequence invariant) and other threads see either all of a change or none
 * of it. It reads no pool field and takes no lock itself.
 *
 * Prompt keys: block j of lane b is keyed once, by the chain
 *   chain[j][b]  = BLAKE2b(chain[j-1][b], context, prompt rows of lane b, block j)
 *   key[j][l][b] = SipHash-2-4-128 keyed with chain[j][b] over id[l]
 *   id[l]        = BLAKE2b(binding digest of layer l, its index l)
 * where context digests every layer's binding (kvp_cache_binding_key) and
 * the salt, so a layer's K/V are found only under the exact model
 * (identities, revisions, RoPE, geometry, dtype), salt and prompt prefix
 * that produced them; every BLAKE2b is keyed with the pool's secret, and
 * the per-layer keys are a PRF of a secret block key (pager/share.c,
 * kvpi_block_key_layers; DESIGN.md "Threat model"): one keyed hash per
 * block, not one per layer.
 * The key helpers (share_internal.h) serve the scheduler too, so the blocks
 * it publishes are the ones sequences adopt; it also keys the blocks a request decoded, by the same chain over their
 * input rows, so a later prompt holding prompt and reply adopts them.
 * Callers: the public API; src/serve (share_internal.h).
 */
#include "serve/sequence_internal.h"
#include "serve/share_internal.h"

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
    kvpi_cache_fork_many(parent->caches, made->caches, parent->layers);
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
    /* A sliding layer may have released a block the window at new_len needs
     * (kvp_cache_truncate's check; only the owner's calls move released_end). */
    for (size_t l = 0; l < sequence->layers; l++) {
        kvp_status status = kvpi_cache_truncate_check(sequence->caches[l], new_len, err);
        if (status != KVP_OK) {
            if (err != NULL) {
                err->layer = l;
            }
            return status;
        }
    }
    for (size_t l = 0; l < sequence->layers; l++) {
        (void)kvp_ticket_discard(sequence->tickets[l], NULL);
    }
    kvpi_cache_truncate_many(sequence->caches, sequence->layers, new_len);
    return KVP_OK;
}

/* The prompt's rank, batch and width, as a prefill checks them. */
static kvp_status check_prompt(const kvp_sequence *seq, const kvp_tensor *prompt, kvp_error *err)
{
    if (prompt == NULL || prompt->data == NULL) {
        return kvpi_fail_null(err, "prompt");
    }
    return kvpi_sequence_check_prompt_shape(seq, &prompt->shape, err);
}

size_t kvpi_prompt_keys_count(size_t layers, size_t batch, size_t blocks)
{
    if (layers == SIZE_MAX || (batch != 0 && layers + 1 > SIZE_MAX / batch)) {
        return SIZE_MAX;
    }
    size_t per_block = (layers + 1) * batch; /* each layer's key and the block key */
    if (per_block != 0 && blocks > (SIZE_MAX - layers) / per_block) {
        return SIZE_MAX;
    }
    return blocks * per_block + layers;
}

void kvpi_prompt_keys(kvp_cache *const *caches, size_t layers, const kvp_block_key *salt,
                      const double *rows, size_t tokens, size_t width, size_t blocks,
                      kvp_block_key *keys)
{
    kvpi_prompt_keys_from(caches, layers, salt, rows, tokens, width, 0, blocks, keys);
}

static int salted(const kvp_block_key *salt)
{
    return salt != NULL && (salt->lo != 0 || salt->hi != 0);
}

kvp_block_key kvpi_prompt_keys_context(kvp_cache *const *caches, size_t layers,
                                       const kvp_block_key *salt, kvp_block_key *ids)
{
    const kvp_pool *pool = caches[0]->pool;
    for (size_t l = 0; l < layers; l++) {
        ids[l] = kvpi_cache_binding_key(caches[l]);
    }
    /* Every layer's binding, and the salt: tenants with other salts share nothing. */
    kvp_block_key context = kvpi_block_key_chain(pool, NULL, &ids[0], ids, layers * sizeof *ids,
                                                 salted(salt) ? salt : NULL);
    /*
     * Each layer's digest with its index: layers may share parameters (and
     * external caches one identity), so equal digests must still give
     * each layer its own keys, or one layer would adopt another's K/V.
     */
    for (size_t l = 0; l < layers; l++) {
        uint64_t index = l;
        ids[l] = kvpi_block_key_chain(pool, NULL, &ids[l], &index, sizeof index, NULL);
    }
    return context;
}

void kvpi_prompt_keys_derive(size_t layers, size_t batch, size_t blocks, size_t from,
                             size_t to, kvp_block_key *keys)
{
    const kvp_block_key *chain = kvpi_prompt_keys_chain(keys, layers, batch, blocks);
    const kvp_block_key *ids = chain + blocks * batch;
    for (size_t j = from; j < to; j++) {
        for (size_t b = 0; b < batch; b++) {
            kvpi_block_key_layers(&chain[j * batch + b], ids, layers,
                                  &keys[j * layers * batch + b], batch);
        }
    }
}

void kvpi_prompt_keys_from(kvp_cache *const *caches, size_t layers, const kvp_block_key *salt,
                           const double *rows, size_t tokens, size_t width, size_t from,
                           size_t blocks, kvp_block_key *keys)
{
    const kvp_pool *pool = caches[0]->pool;
    size_t batch = caches[0]->batch_size;
    kvp_block_key *chain = kvpi_prompt_keys_chain(keys, layers, batch, blocks);
    kvp_block_key context = kvpi_prompt_keys_context(caches, layers, salt, chain + blocks * batch);
    size_t bt = caches[0]->block_tokens;
    for (size_t j = from; j < blocks; j++) {
        for (size_t b = 0; b < batch; b++) {
            /* One keyed hash per block and lane over its rows; the layers' keys derive from it. */
            const double *block = rows + (b * tokens + j * bt) * width;
            const kvp_block_key *parent = j == 0 ? NULL : &chain[(j - 1) * batch + b];
            chain[j * batch + b] = kvpi_block_key_chain(pool, parent, &context, block,
                                                        bt * width * sizeof *block, NULL);
        }
    }
    kvpi_prompt_keys_derive(layers, batch, blocks, from, blocks, keys);
}

/* The keys of the first `blocks` blocks of the prompt, in a new allocation (kvpi_free). */
static kvp_status prompt_keys(const kvp_sequence *seq, const kvp_tensor *prompt,
                              const kvp_block_key *salt, size_t blocks, kvp_block_key **out,
                              kvp_error *err)
{
    /* bounded by the reservation's page count: cannot saturate */
    size_t bytes = kvpi_prompt_keys_count(seq->layers, seq->batch_size, blocks) *
                   sizeof(kvp_block_key);
    kvp_block_key *keys = kvpi_alloc(KVPI_SITE_SCRATCH, bytes);
    if (keys == NULL) {
        return kvpi_fail_alloc(err, "prefix keys", bytes);
    }
    kvpi_prompt_keys(seq->caches, seq->layers, salt, prompt->data, prompt->shape.dims[1],
                     seq->model_width, blocks, keys);
    *out = keys;
    return KVP_OK;
}

kvp_status kvp_sequence_adopt_prefix(kvp_sequence *sequence, const kvp_tensor *prompt,
                                     size_t *tokens_adopted, kvp_error *err)
{
    return kvp_sequence_adopt_prefix_salted(sequence, prompt, NULL, tokens_adopted, err);
}

kvp_status kvp_sequence_adopt_prefix_salted(kvp_sequence *sequence, const kvp_tensor *prompt,
                                            const kvp_block_key *salt, size_t *tokens_adopted,
                                            kvp_error *err)
{
    if (sequence == NULL) {
        return kvpi_fail_null(err, "sequence");
    }
    kvp_status status = check_prompt(sequence, prompt, err);
    if (status != KVP_OK) {
        return status;
    }
    if (prompt->shape.dims[1] == 0) { /* as prefill refuses it */
        return kvpi_fail_invalid(err, "prompt", "a prompt needs at least one token");
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
    size_t blocks = (tokens - 1) / bt;
    if (blocks > sequence->capacity / bt) {
        blocks = sequence->capacity / bt;
    }
    if (blocks == 0) {
        *tokens_adopted = 0;
        return KVP_OK;
    }
    kvp_block_key *keys = NULL;
    status = prompt_keys(sequence, prompt, salt, blocks, &keys, err);
    if (status != KVP_OK) {
        return status;
    }
    size_t adopted = 0;
    status =
        kvp_cache_group_adopt(sequence->caches, sequence->layers, keys, blocks, &adopted, err);
    kvpi_free(keys);
    if (status == KVP_OK) {
        *tokens_adopted = adopted * bt;
    }
    return status;
}

kvp_status kvp_sequence_publish_prefix(kvp_sequence *sequence, const kvp_tensor *prompt,
                                       size_t *blocks_published, kvp_error *err)
{
    return kvp_sequence_publish_prefix_salted(sequence, prompt, NULL, blocks_published, err);
}

kvp_status kvp_sequence_publish_prefix_salted(kvp_sequence *sequence, const kvp_tensor *prompt,
                                              const kvp_block_key *salt,
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
    status = prompt_keys(sequence, prompt, salt, blocks, &keys, err);
    if (status != KVP_OK) {
        return status;
    }
    status = kvp_cache_group_publish(sequence->caches, sequence->layers, keys, blocks, err);
    kvpi_free(keys);
    if (status == KVP_OK && blocks_published != NULL) {
        *blocks_published = blocks;
    }
    return status;
}
