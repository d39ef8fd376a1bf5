/*
 * ticket.c: ticket life (create, commit, discard, result, destroy); see
 * ticket_internal.h for its states. The computation is in incremental.c.
 */
#include "attention/ticket_internal.h"

#include <string.h>

#include "attention/layer_internal.h"
#include "pager/alloc.h"
#include "pager/cache_internal.h"
#include "pager/error.h"

kvp_status kvp_ticket_create(const kvp_cache *cache, kvp_ticket **out, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvpi_layer_record rec; /* query heads and model width: the owner record's (binding.c) */
    kvpi_cache_layer_record(cache, &rec);
    size_t b = cache->batch_size;
    size_t heads = (size_t)rec.heads; /* query heads; the cache stores cache->heads */
    size_t d = (size_t)rec.model_width;
    if (heads == 0 || heads % cache->heads != 0 || d != heads * cache->head_width) {
        /* Only a hand-made binding whose record is not a layer's gets here. */
        return kvpi_fail_invalid(err, "cache", "its binding's owner record is not a layer's");
    }
    /* query, head outputs and output rows of D each, the candidate key and
     * value rows of kv_heads * d_h each, then [B, H, capacity] weights. */
    size_t row_doubles = b * d;
    size_t kv_doubles = b * cache->heads * cache->head_width; /* bounded by the cache */
    size_t weight_doubles = b * heads * cache->capacity;
    size_t doubles = 3 * row_doubles + 2 * kv_doubles + weight_doubles;
    /*
     * Defensive: the cache bounded b * kv_heads * capacity * d_h and allocated
     * b * blocks table entries, so on any real machine batch and row width are
     * far below these limits, even with many query heads per KV head.
     */
    if (d > SIZE_MAX / 8 / b || heads > SIZE_MAX / b / cache->capacity || /* GCOVR_EXCL_BR_LINE */
        doubles < weight_doubles ||                                      /* GCOVR_EXCL_BR_LINE */
        doubles > (SIZE_MAX - b * sizeof(uint32_t)) / sizeof(double)) { /* GCOVR_EXCL_BR_LINE */
        /* GCOVR_EXCL_START: unreachable, see above */
        return kvpi_fail_invalid(err, "cache", "ticket buffers overflow size_t");
        /* GCOVR_EXCL_STOP */
    }
    size_t bytes = doubles * sizeof(double) + b * sizeof(uint32_t);
    kvp_ticket *ticket = kvpi_calloc(KVPI_SITE_TICKET, 1, sizeof *ticket);
    if (ticket == NULL) {
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_TICKET), sizeof *ticket);
    }
    double *buffer = kvpi_alloc(KVPI_SITE_SCRATCH, bytes);
    if (buffer == NULL) {
        kvpi_free(ticket);
        return kvpi_fail_alloc(err, "attention ticket buffers", bytes);
    }
    ticket->batch_size = b;
    ticket->heads = heads;
    ticket->kv_heads = cache->heads;
    ticket->head_width = cache->head_width;
    ticket->model_width = d;
    ticket->capacity = cache->capacity;
    ticket->state = KVPI_TICKET_EMPTY;
    ticket->query = buffer;
    ticket->key = buffer + row_doubles;
    ticket->value = ticket->key + kv_doubles;
    ticket->head_outputs = ticket->value + kv_doubles;
    ticket->output = ticket->head_outputs + row_doubles;
    ticket->weights = ticket->output + row_doubles;
    ticket->reserved = (uint32_t *)(void *)(buffer + doubles);
    kvpi_reservation_init(&ticket->reservation, cache->pool, ticket->reserved, b);
    *out = ticket;
    return KVP_OK;
}

kvp_status kvp_ticket_discard(kvp_ticket *ticket, kvp_error *err)
{
    if (ticket == NULL) {
        return kvpi_fail_null(err, "ticket");
    }
    kvpi_reservation_release(&ticket->reservation);
    ticket->state = KVPI_TICKET_EMPTY;
    return KVP_OK;
}

kvp_status kvp_ticket_destroy(kvp_ticket *ticket, kvp_error *err)
{
    (void)err;
    if (ticket == NULL) {
        return KVP_OK; /* destroying NULL does nothing, as free(NULL) */
    }
    kvpi_reservation_release(&ticket->reservation);
    kvpi_free(ticket->query);
    kvpi_free(ticket);
    return KVP_OK;
}

kvp_status kvpi_ticket_commit_with(kvp_ticket *ticket, kvp_cache *cache,
                                   kvpi_reservation *pages, kvp_error *err)
{
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (ticket->state != KVPI_TICKET_PREPARED) {
        return kvpi_error_emit(err, &(kvp_error){.status = KVP_TICKET_EMPTY});
    }
    if (cache->serial != ticket->cache_serial) {
        return kvpi_error_emit(err, &(kvp_error){.status = KVP_TICKET_FOREIGN_CACHE});
    }
    if (cache->epoch != ticket->cache_epoch) {
        kvp_error e = kvpi_error_begin(KVP_TICKET_STALE);
        e.prepared_len = ticket->cache_len;
        e.current_len = cache->len;
        return kvpi_error_emit(err, &e);
    }
    kvpi_cache_commit(cache, ticket->key, ticket->value, pages);
    ticket->state = KVPI_TICKET_COMMITTED;
    return KVP_OK;
}

kvp_status kvp_ticket_commit(kvp_ticket *ticket, kvp_cache *cache, kvp_error *err)
{
    if (ticket == NULL) {
        return kvpi_fail_null(err, "ticket");
    }
    return kvpi_ticket_commit_with(ticket, cache, &ticket->reservation, err);
}

kvp_status kvp_ticket_result(const kvp_ticket *ticket, kvp_attention_result *out, kvp_error *err)
{
    if (ticket == NULL) {
        return kvpi_fail_null(err, "ticket");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (ticket->state == KVPI_TICKET_EMPTY) {
        return kvpi_error_emit(err, &(kvp_error){.status = KVP_TICKET_EMPTY});
    }
    kvp_attention_result result;
    memset(&result, 0, sizeof result);
    result.output = ticket->output;
    result.weights = ticket->weights;
    result.batch_size = ticket->batch_size;
    result.heads = ticket->heads;
    result.model_width = ticket->model_width;
    result.keys = ticket->keys;
    result.work = ticket->work;
    result.reserved_pages = kvpi_reservation_remaining(&ticket->reservation);
    result.committed = ticket->state == KVPI_TICKET_COMMITTED;
    *out = result;
    return KVP_OK;
}
