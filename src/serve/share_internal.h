/*
 * share_internal.h: the prompt prefix keys of src/serve/share.c, without
 * allocation, for callers that keep their own key buffers (the scheduler: sequences and, with compute off, a set of
 * external layer caches).
 *
 * Key layout, for `blocks` blocks of `batch` lanes and `layers` layers:
 *   keys[(j * layers + l) * batch + b]   block j of lane b of layer l (what
 *                                        the pager's group calls take);
 *   then chain[j * batch + b]            block j's block key (the chain);
 *   then `layers` scratch entries        each layer's id,
 * so a buffer holds kvpi_prompt_keys_count(layers, batch, blocks) entries
 * (kvpi_prompt_keys_chain finds the chain). Keys are exactly those
 * kvp_sequence_adopt_prefix and kvp_sequence_publish_prefix compute, so
 * blocks one publishes the other adopts.
 * Callers: src/serve.
 */
#ifndef KVPAGER_SERVE_SHARE_INTERNAL_H
#define KVPAGER_SERVE_SHARE_INTERNAL_H

#include <stddef.h>

#include "kvpager/cache.h"
#include "kvpager/pool.h"

/* Entries a key buffer for `blocks` blocks needs (saturating). */
size_t kvpi_prompt_keys_count(size_t layers, size_t batch, size_t blocks);

/*
 * The keys of the first `blocks` blocks of `rows` ([batch][tokens][width]
 * doubles) for the `layers` caches (one per model layer, in order; their
 * bindings and pool format give the digests; the pool's secret keys the
 * hash), under `salt` (NULL or all zero: none; another salt gives keys no
 * other salt's blocks match). blocks * block_tokens <= tokens.
 */
void kvpi_prompt_keys(kvp_cache *const *caches, size_t layers, const kvp_block_key *salt,
                      const double *rows, size_t tokens, size_t width, size_t blocks,
                      kvp_block_key *keys);

/*
 * kvpi_prompt_keys for blocks [from, blocks) only, the chain entries of
 * blocks [0, from) given (made from the same first from * block_tokens
 * rows, bindings and salt, in a buffer of `blocks` blocks; the chain
 * continues from them; their per-layer entries are not read). The
 * scheduler keys each sample's decoded blocks this way, after the
 * prompt's blocks they all share.
 */
void kvpi_prompt_keys_from(kvp_cache *const *caches, size_t layers, const kvp_block_key *salt,
                           const double *rows, size_t tokens, size_t width, size_t from,
                           size_t blocks, kvp_block_key *keys);

/* The chain entries of a key buffer of `blocks` blocks (the layout above). */
static inline kvp_block_key *kvpi_prompt_keys_chain(kvp_block_key *keys, size_t layers,
                                                    size_t batch, size_t blocks)
{
    return keys + blocks * layers * batch;
}

/*
 * The context of a keying (every layer's binding digest and the salt,
 * chained), returned, and each layer's id in ids[layers]: what the chain
 * and the per-layer keys depend on besides the rows.
 */
kvp_block_key kvpi_prompt_keys_context(kvp_cache *const *caches, size_t layers,
                                       const kvp_block_key *salt, kvp_block_key *ids);

/*
 * The per-layer keys of blocks [from, to) of a buffer of `blocks` blocks
 * from their chain entries and the layer ids in the buffer's scratch
 * (kvpi_block_key_layers): no keyed BLAKE2b, one SipHash per layer key.
 */
void kvpi_prompt_keys_derive(size_t layers, size_t batch, size_t blocks, size_t from,
                             size_t to, kvp_block_key *keys);

/*
 * Probing, adopting and publishing a group of caches (a sequence's layers)
 * are the pager's: kvpi_prefix_probe (pager/cache_internal.h),
 * kvp_cache_group_adopt and kvp_cache_group_publish (kvpager/cache.h).
 */

#endif /* KVPAGER_SERVE_SHARE_INTERNAL_H */
