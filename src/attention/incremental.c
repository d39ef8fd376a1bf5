/*
 * incremental.c: prepare and forward for one new token (see
 * kvpager/attention.h), with the gather through the cache's page table.
 *
 * Owns: the seed's validation order and the one incremental computation.
 * Retained rows are read through the page table by gather.c; the candidate
 * row comes from the ticket, rounded to the pool's dtype (and widened back)
 * before anything uses it, so the new token attends to exactly the key and
 * value the commit will store, as the stored-dtype reference does.
 *
 * Invariant: nothing here writes to a cache or the pool except
 * kvpi_reservation_fill, which is the last step of a successful prepare.
 * Callers: the public API and steps (through ticket_internal.h).
 */
#include <math.h>
#include <string.h>

#include "attention/gather.h"
#include "attention/kernels.h"
#include "attention/layer_internal.h"
#include "attention/ticket_internal.h"
#include "pager/cache_internal.h"
#include "pager/dtype.h"
#include "pager/error.h"

/*
 * Step 7a of the validation order (DESIGN.md): the window, then the sink
 * tokens, the cache captured against the layer's; sets e->status on a
 * mismatch (CACHE_WINDOW_MISMATCH, what = the field).
 */
static void status_window(const kvp_layer *layer, const kvpi_layer_record *rec, kvp_error *e)
{
    static const char *const names[2] = {"window", "sink_tokens"};
    const uint64_t cached[2] = {rec->window, rec->sink_tokens};
    const size_t own[2] = {layer->window, layer->sink_tokens};
    for (size_t i = 0; i < 2; i++) {
        if (cached[i] != own[i]) {
            e->status = KVP_CACHE_WINDOW_MISMATCH;
            e->what = names[i];
            e->layer_size = own[i];
            e->cache_size = (size_t)cached[i];
            return;
        }
    }
}

/* The seed's validate_incremental_request, up to and including capacity. */
static kvp_status validate_request(const kvp_layer *layer, const kvp_tensor *input,
                                   const kvp_cache *cache, kvp_error *err)
{
    const kvp_shape *shape = &input->shape;
    kvpi_layer_record rec; /* the owner record the cache captured (binding.c) */
    kvpi_cache_layer_record(cache, &rec);
    kvp_error e = kvpi_error_begin(KVP_OK);
    if (shape->rank != 3) {
        e.status = KVP_INPUT_RANK;
        e.rank = shape->rank;
    } else if (shape->dims[1] != 1) {
        e.status = KVP_SINGLE_TOKEN_REQUIRED;
        e.tokens = shape->dims[1];
    } else if (shape->dims[0] != cache->batch_size) {
        e.status = KVP_INPUT_BATCH_MISMATCH;
        e.expected_size = cache->batch_size;
        e.actual_size = shape->dims[0];
    } else if (shape->dims[2] != layer->model_width) {
        e.status = KVP_INPUT_WIDTH_MISMATCH;
        e.expected_size = layer->model_width;
        e.actual_size = shape->dims[2];
    } else if (rec.model_width != layer->model_width) {
        e.status = KVP_CACHE_MODEL_WIDTH_MISMATCH;
        e.layer_size = layer->model_width;
        e.cache_size = (size_t)rec.model_width;
    } else if (rec.heads != layer->heads) {
        e.status = KVP_CACHE_HEAD_COUNT_MISMATCH;
        e.layer_size = layer->heads;
        e.cache_size = (size_t)rec.heads;
    } else if (cache->heads != layer->kv_heads) {
        e.status = KVP_CACHE_KV_HEAD_COUNT_MISMATCH;
        e.layer_size = layer->kv_heads;
        e.cache_size = cache->heads;
    } else if (cache->head_width != layer->head_width) {
        e.status = KVP_CACHE_HEAD_WIDTH_MISMATCH;
        e.layer_size = layer->head_width;
        e.cache_size = cache->head_width;
    }
    if (e.status != KVP_OK) {
        return kvpi_error_emit(err, &e);
    }
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        if (rec.node_id[i] != kvp_param_id(layer->params[i])) {
            return kvpi_error_emit(err, &(kvp_error){.status = KVP_CACHE_LAYER_MISMATCH});
        }
    }
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        uint64_t revision = kvp_param_revision(layer->params[i]);
        if (rec.revision[i] != revision) {
            e.status = KVP_CACHE_LAYER_REVISION_MISMATCH;
            e.parameter = i;
            e.cache_revision = rec.revision[i];
            e.layer_revision = revision;
            return kvpi_error_emit(err, &e);
        }
    }
    uint64_t layer_base_bits = 0;
    memcpy(&layer_base_bits, &layer->rope.base, sizeof layer_base_bits);
    if (rec.rope_feature_width != layer->rope.feature_width ||
        rec.rope_max_positions != layer->rope.max_positions ||
        rec.rope_base_bits != layer_base_bits) {
        e.status = KVP_CACHE_ROPE_MISMATCH;
        e.cache_rope.feature_width = (size_t)rec.rope_feature_width;
        e.cache_rope.max_positions = (size_t)rec.rope_max_positions;
        memcpy(&e.cache_rope.base, &rec.rope_base_bits, sizeof e.cache_rope.base);
        e.layer_rope = layer->rope;
        return kvpi_error_emit(err, &e);
    }
    status_window(layer, &rec, &e);
    if (e.status != KVP_OK) {
        return kvpi_error_emit(err, &e);
    }
    if (cache->len == cache->capacity) {
        e.status = KVP_FULL;
        e.capacity = cache->capacity;
        return kvpi_error_emit(err, &e);
    }
    return KVP_OK;
}

static kvp_status validate_ticket(const kvp_ticket *ticket, const kvp_cache *cache,
                                  kvp_error *err)
{
    if (ticket->state == KVPI_TICKET_PREPARED) {
        return kvpi_error_emit(err, &(kvp_error){.status = KVP_TICKET_BUSY});
    }
    if (ticket->batch_size != cache->batch_size || ticket->heads != kvpi_cache_query_heads(cache) ||
        ticket->kv_heads != cache->heads || ticket->head_width != cache->head_width ||
        ticket->capacity < cache->capacity) {
        kvp_error e = kvpi_error_begin(KVP_TICKET_GEOMETRY_MISMATCH);
        e.batch_size = ticket->batch_size;
        e.heads = ticket->heads;
        e.kv_heads = ticket->kv_heads;
        e.head_width = ticket->head_width;
        e.capacity = ticket->capacity;
        return kvpi_error_emit(err, &e);
    }
    return KVP_OK;
}

/*
 * Q ([B, D]), K and V ([B, H_kv * d_h]) of every lane, then the H query heads
 * of Q and the H_kv heads of K rotated at `position`.
 */
static kvp_status project(const kvp_layer *layer, const double *input, size_t batch,
                          size_t position, kvp_ticket *t, kvp_error *err)
{
    size_t d = layer->model_width;
    size_t kv_width = layer->kv_heads * layer->head_width;
    double *const outputs[3] = {t->query, t->key, t->value};
    const size_t widths[3] = {d, kv_width, kv_width};
    static const char *const names[3] = {"query", "key", "value"};
    for (size_t which = 0; which < 3; which++) {
        const double *w = kvp_param_values(layer->params[which]);
        kvpi_project_rows(input, d, batch, w, d, widths[which], outputs[which], widths[which]);
    }
    for (size_t which = 0; which < 3; which++) {
        kvp_status status = kvpi_check_finite(outputs[which], batch * widths[which],
                                              KVP_NONFINITE_PROJECTION, names[which], err);
        if (status != KVP_OK) {
            return status;
        }
    }
    /* [B, D] rows are [B * H] head vectors of d_h, [B, H_kv * d_h] rows [B * H_kv]. */
    kvpi_layer_rope_qk(layer, t->query, batch * layer->heads, t->key, batch * layer->kv_heads,
                       position);
    return KVP_OK;
}

/*
 * The candidate's rotated key and value as the pool will store them: refuses
 * (NONFINITE_KEY, then NONFINITE_VALUE, what = the dtype's name) a finite
 * element that the dtype cannot hold, else rounds both rows in place. Does
 * nothing for f64.
 */
static kvp_status round_candidate(const kvp_cache *cache, kvp_ticket *t, kvp_error *err)
{
    size_t n = cache->batch_size * cache->heads * cache->head_width;
    kvp_status status = kvpi_cache_check_storable(cache, t->key, n, KVP_NONFINITE_KEY, err);
    if (status == KVP_OK) {
        status = kvpi_cache_check_storable(cache, t->value, n, KVP_NONFINITE_VALUE, err);
    }
    if (status == KVP_OK) {
        kvpi_cache_round_rows(cache, 0, t->key, n);
        kvpi_cache_round_rows(cache, 1, t->value, n);
    }
    return status;
}

/*
 * Scores, stable softmax, value mixture, merge and output projection. The
 * three gather phases run on `par` (NULL: this thread), with the same bits
 * for any executor (gather.h); the finite check between scores and softmax
 * and the projection run on this thread.
 */
static kvp_status attend(const kvp_layer *layer, const kvp_cache *cache, kvp_ticket *t,
                         const kvpi_parallel *par, kvp_error *err)
{
    size_t batch = cache->batch_size;
    size_t d = layer->model_width;
    kvpi_gather_job job = {
        .cache = cache,
        .queries = t->query,
        .keys = t->key,
        .values = t->value,
        .scale = 1.0 / sqrt((double)layer->head_width),
        .weights = t->weights,
        .outputs = t->head_outputs,
        .accum = layer->accum,
    };
    kvpi_gather_scores_on(&job, par);
    kvp_status status = kvpi_gather_check_scores(&job, err);
    if (status != KVP_OK) {
        return status;
    }
    kvpi_gather_softmax_on(&job, par);
    kvpi_gather_values_on(&job, par);
    kvpi_gather_widen_weights(&job); /* the result's weights are f64 at both levels */
    t->keys = kvpi_gather_job_keys(&job);
    /* [B, H, 1, d_h] is already the merged [B, 1, D] layout. */
    const double *w_output = kvp_param_values(layer->params[KVP_PARAM_OUTPUT]);
    kvpi_project_rows(t->head_outputs, d, batch, w_output, d, d, t->output, d);
    return kvpi_check_finite(t->output, batch * d, KVP_NONFINITE_OUTPUT, "output", err);
}

kvp_status kvpi_attention_prepare(const kvp_layer *layer, const kvp_tensor *input,
                                  const kvp_cache *cache, kvp_ticket *ticket, int reserve_pages,
                                  const kvpi_parallel *par, kvp_error *err)
{
    if (layer == NULL) {
        return kvpi_fail_null(err, "layer");
    }
    if (input == NULL || input->data == NULL) {
        return kvpi_fail_null(err, "input");
    }
    if (cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (ticket == NULL) {
        return kvpi_fail_null(err, "ticket");
    }
    kvp_status status = validate_request(layer, input, cache, err);
    if (status == KVP_OK) {
        status = validate_ticket(ticket, cache, err);
    }
    /*
     * A failed prepare leaves the ticket EMPTY, so an old result never passes
     * for this call's; only a ticket holding a prepared row (TICKET_BUSY, or
     * any refusal before the ticket was looked at) keeps it.
     */
    if (ticket->state != KVPI_TICKET_PREPARED) {
        ticket->state = KVPI_TICKET_EMPTY;
    }
    if (status != KVP_OK) {
        return status;
    }
    size_t position = cache->len;
    status = project(layer, input->data, cache->batch_size, position, ticket, err);
    if (status == KVP_OK) {
        status = round_candidate(cache, ticket, err);
    }
    if (status == KVP_OK) {
        status = attend(layer, cache, ticket, par, err);
    }
    if (status == KVP_OK) {
        kvp_tensor key = kvp_tensor4(ticket->key, cache->batch_size, cache->heads, 1,
                                     cache->head_width);
        kvp_tensor value = kvp_tensor4(ticket->value, cache->batch_size, cache->heads, 1,
                                       cache->head_width);
        status = kvpi_cache_validate_append(cache, &key, &value, err);
    }
    if (status == KVP_OK && reserve_pages) {
        kvpi_reservation_init(&ticket->reservation, cache->pool, ticket->reserved,
                              ticket->batch_size);
        status = kvpi_reservation_fill(&ticket->reservation, kvpi_cache_pages_needed(cache), err);
    }
    if (status != KVP_OK) {
        return status;
    }
    ticket->cache_serial = cache->serial;
    ticket->cache_epoch = cache->epoch;
    ticket->cache_len = position;
    ticket->work = (kvp_attention_work){position, position + 1, 1, position};
    ticket->state = KVPI_TICKET_PREPARED;
    return KVP_OK;
}

kvp_status kvp_attention_prepare(const kvp_layer *layer, const kvp_tensor *input,
                                 const kvp_cache *cache, kvp_ticket *ticket, kvp_error *err)
{
    return kvpi_attention_prepare(layer, input, cache, ticket, 1, NULL, err);
}

kvp_status kvp_attention_forward(const kvp_layer *layer, const kvp_tensor *input,
                                 kvp_cache *cache, kvp_ticket *ticket, kvp_error *err)
{
    kvp_status status = kvp_attention_prepare(layer, input, cache, ticket, err);
    if (status != KVP_OK) {
        return status;
    }
    /* Cannot fail: the ticket was just prepared against this very cache. */
    (void)kvpi_ticket_commit_with(ticket, cache, &ticket->reservation, NULL);
    return KVP_OK;
}
