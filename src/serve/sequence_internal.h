/*
 * sequence_internal.h: struct kvp_sequence and the allocator-only step.
 *
 * Invariants: every layer's cache has the same len; the reservation holds
 * pages only during a step or prefill (it is empty between calls); promise
 * is this sequence's share of pool->promised.
 * Callers: src/serve, and first-party programs (simulate --no-compute,
 * stress) that exercise paging without attention arithmetic.
 */
#ifndef KVPAGER_SERVE_SEQUENCE_INTERNAL_H
#define KVPAGER_SERVE_SEQUENCE_INTERNAL_H

#include "kvpager/attention.h"
#include "kvpager/sequence.h"
#include "attention/parallel.h"
#include "attention/prefill.h"
#include "pager/reservation.h"

struct kvp_sequence {
    const kvp_model *model;
    kvp_pool *pool;
    size_t layers;
    size_t batch_size;
    size_t capacity;
    size_t model_width;
    kvp_cache **caches;     /* [layers] */
    kvp_ticket **tickets;   /* [layers] */
    double *activations;    /* [layers + 1][B * D]: layer inputs x_0 .. x_L */
    double *zero_row;       /* [B * D] zeros, the rows of allocator-only steps */
    uint32_t *reserved;     /* storage for every page the sequence can hold */
    kvpi_reservation reservation;
    size_t promise;
    kvpi_prefill_work prefill; /* the blocked prefill's workspace; tokens 0: none */
};

/*
 * A [B, T, D] prompt's rank, batch and width, in prefill's order
 * (INPUT_RANK, INPUT_BATCH_MISMATCH, INPUT_WIDTH_MISMATCH, layer SIZE_MAX):
 * shared by prefill and the prefix-cache calls (share.c).
 */
kvp_status kvpi_sequence_check_prompt_shape(const kvp_sequence *seq, const kvp_shape *shape,
                                            kvp_error *err);

/*
 * Appends `tokens` rows of zeros to every layer without attention: the same
 * all-or-nothing page transaction as a step (FULL, POOL_EXHAUSTED), for
 * allocator-only runs. Never part of the public API: it bypasses the binding
 * checks, as the seed's private raw append does.
 */
kvp_status kvpi_sequence_append_uncomputed(kvp_sequence *sequence, size_t tokens,
                                           kvp_error *err);

/*
 * kvp_sequence_step and kvp_sequence_prefill with every layer's attention
 * gather on `par` (NULL: the calling thread, which is what the public calls
 * do). Same validation, results, bits and pages as the public calls, for any
 * executor. The decoder passes its assist executor (decoder.c).
 */
kvp_status kvpi_sequence_step_on(kvp_sequence *sequence, const kvp_tensor *input,
                                 kvp_next_input_fn next_input, void *ctx, double *output,
                                 size_t output_len, const kvpi_parallel *par, kvp_error *err);
kvp_status kvpi_sequence_prefill_on(kvp_sequence *sequence, const kvp_tensor *prompt,
                                    kvp_next_input_fn next_input, void *ctx, double *output,
                                    size_t output_len, const kvpi_parallel *par, kvp_error *err);

/*
 * The prefill computes tokens 1..T-1 of a prompt in blocks of up to this
 * many tokens, layer after layer, each page read once per block and layer
 * (src/attention/prefill.h); token 0 is computed alone (it validates every
 * layer before a page is taken). 0: every token alone, as steps. Results,
 * errors and pages are the same bits either way. A test and benchmark hook:
 * global state, set only while no prefill runs.
 */
#define KVPI_PREFILL_BLOCK_DEFAULT 64
/*
 * A sequence's prefill workspace (allocated with its buffers) holds at most
 * KVPI_PREFILL_BLOCK_DEFAULT tokens and at most this many bytes; a sequence
 * where fewer than 2 tokens fit has none and prefills token by token.
 */
#define KVPI_PREFILL_WORK_BYTES ((size_t)8 << 20)
void kvpi_sequence_prefill_block_set(size_t tokens);
size_t kvpi_sequence_prefill_block_get(void);

/*
 * 1 when a layer's cache is bound to a parameter revision that is no longer
 * its layer's (an in-place update since the cache was made: its next step
 * would be CACHE_LAYER_REVISION_MISMATCH), else 0. Reads the caches' owner
 * records (attention/binding.c). The scheduler's leases ask it.
 */
int kvpi_sequence_stale(const kvp_sequence *sequence);

#endif /* KVPAGER_SERVE_SEQUENCE_INTERNAL_H */
