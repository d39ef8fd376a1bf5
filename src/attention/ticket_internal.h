/*
 * ticket_internal.h: struct kvp_ticket and the entry points steps use.
 *
 * A ticket is the seed's PreparedIncrementalAttention plus the workspace the
 * computation needs, allocated once so prepare and commit never touch the
 * heap.
 *
 * States:
 *   EMPTY     --prepare ok-->  PREPARED   (row, result and reserved pages held)
 *   PREPARED  --commit ok-->   COMMITTED  (row visible in the cache; result kept)
 *   PREPARED  --discard-->     EMPTY      (pages back to the pool)
 *   COMMITTED --prepare ok-->  PREPARED;  any failed prepare leaves EMPTY
 * Invariants: the reservation holds pages only in PREPARED; cache_serial,
 * cache_epoch and cache_len name the cache state the row was computed for.
 * Callers: src/attention and src/serve (sequences own tickets).
 */
#ifndef KVPAGER_ATTENTION_TICKET_INTERNAL_H
#define KVPAGER_ATTENTION_TICKET_INTERNAL_H

#include "kvpager/attention.h"
#include "attention/parallel.h"
#include "pager/reservation.h"

typedef enum kvpi_ticket_state {
    KVPI_TICKET_EMPTY,
    KVPI_TICKET_PREPARED,
    KVPI_TICKET_COMMITTED
} kvpi_ticket_state;

struct kvp_ticket {
    size_t batch_size;
    size_t heads;              /* query heads */
    size_t kv_heads;           /* KV heads: the heads of the cache's rows */
    size_t head_width;
    size_t model_width;
    size_t capacity;
    kvpi_ticket_state state;
    uint64_t cache_serial;
    uint64_t cache_epoch;
    size_t cache_len;          /* len at prepare */
    size_t keys;               /* positions the prepared token attended to (result.keys) */
    kvp_attention_work work;
    double *query;             /* [B, D]: rotated query, heads as contiguous slices */
    double *key;               /* [B, H_kv, 1, d_h]: the candidate rotated key */
    double *value;             /* [B, H_kv, 1, d_h]: the candidate value */
    double *weights;           /* [B, H, 1, keys] within B * H * capacity */
    double *head_outputs;      /* [B, H, 1, d_h] == merged [B, 1, D] */
    double *output;            /* [B, 1, D] */
    uint32_t *reserved;        /* [B]: storage of `reservation` */
    kvpi_reservation reservation;
};

/*
 * Prepare, with the page reservation optional: a multi-layer step prepares
 * every layer with reserve_pages == 0, reserves all their pages at once, and
 * commits each ticket with kvpi_ticket_commit_with. The attention's gather
 * runs on `par` (NULL: the calling thread), with the same bits either way.
 */
kvp_status kvpi_attention_prepare(const kvp_layer *layer, const kvp_tensor *input,
                                  const kvp_cache *cache, kvp_ticket *ticket, int reserve_pages,
                                  const kvpi_parallel *par, kvp_error *err);

/* Commit taking the new block's pages, if any, from `pages`. `ticket` is not NULL. */
kvp_status kvpi_ticket_commit_with(kvp_ticket *ticket, kvp_cache *cache,
                                   kvpi_reservation *pages, kvp_error *err);

#endif /* KVPAGER_ATTENTION_TICKET_INTERNAL_H */
