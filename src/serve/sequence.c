/*
 * sequence.c: sequences and their transactional steps (see
 * kvpager/sequence.h and sequence_internal.h).
 *
 * Owns: one cache and one ticket per layer, the activations between layers,
 * one reservation big enough for every page the sequence can hold, and the
 * sequence's promise: a level (held + promised) that a sliding window's
 * releases refill through the reservation's refund (sequence.h), so
 * pages_for counts a sliding layer's peak and prefill_pages its blocks.
 *
 * A step, or each token of a prefill:
 *   prepare_layers  prepare layer 0..L-1 (no pages reserved), chaining inputs;
 *                   a failure discards the tickets prepared so far
 *   reserve         the new pages of every layer and lane at once
 *                   (a prefill reserves all its tokens' pages before its first)
 *   commit_layers   commit every ticket, taking pages from the reservation
 * Until commit_layers nothing visible has changed; commit cannot fail.
 * Callers: the public API and decoder.c.
 */
#include "serve/sequence_internal.h"

#include <string.h>

#include "serve/model_internal.h"
#include "attention/kernels.h"
#include "attention/layer_internal.h"
#include "attention/prefill.h"
#include "attention/ticket_internal.h"
#include "pager/alloc.h"
#include "pager/cache_internal.h"
#include "pager/error.h"

static void free_sequence(kvp_sequence *seq)
{
    for (size_t l = 0; l < seq->layers; l++) {
        if (seq->tickets[l] != NULL) {
            kvp_ticket_destroy(seq->tickets[l], NULL);
        }
        if (seq->caches[l] != NULL) {
            kvp_cache_destroy(seq->caches[l], NULL);
        }
    }
    if (seq->promise != 0) {
        kvpi_pool_lock(seq->pool);
        kvpi_pool_promise_set_locked(seq->pool, &seq->promise, 0);
        kvpi_pool_unlock(seq->pool);
    }
    kvpi_free(seq->caches);
    kvpi_free(seq);
}

/*
 * a * b, saturated at SIZE_MAX. The probe cache already allocated batch *
 * blocks table entries, so these products fit on any real machine; the
 * saturation only keeps an impossible size from wrapping into a small one.
 */
static size_t mul_sat(size_t a, size_t b)
{
    size_t r = 0;
    return __builtin_mul_overflow(a, b, &r) ? SIZE_MAX : r; /* GCOVR_EXCL_BR_LINE: see above */
}

/*
 * The blocked prefill's workspace: tokens per block (0: none) and doubles
 * per token, for the model's widest layer and positions below capacity.
 */
static size_t prefill_block(const kvp_sequence *seq, size_t *per_token, size_t *max_heads,
                            size_t *max_kv_width)
{
    size_t heads = 0;
    size_t kv_width = 0;
    for (size_t l = 0; l < seq->layers; l++) {
        const kvp_layer *layer = seq->model->layers[l];
        heads = layer->heads > heads ? layer->heads : heads;
        size_t width = layer->kv_heads * layer->head_width;
        kv_width = width > kv_width ? width : kv_width;
    }
    *per_token = kvpi_prefill_work_doubles(seq->batch_size, seq->model_width, heads, kv_width,
                                           seq->capacity, seq->layers);
    size_t fit = KVPI_PREFILL_WORK_BYTES / sizeof(double) / *per_token;
    size_t tokens = fit < KVPI_PREFILL_BLOCK_DEFAULT ? fit : KVPI_PREFILL_BLOCK_DEFAULT;
    *max_heads = heads;
    *max_kv_width = kv_width;
    return tokens >= 2 ? tokens : 0;
}

/* One allocation for the pointer arrays, activations, prefill workspace and reservation storage. */
static kvp_status alloc_buffers(kvp_sequence *seq, size_t blocks_per_lane, kvp_error *err)
{
    size_t per_token = 0;
    size_t heads = 0;
    size_t kv_width = 0;
    size_t block = prefill_block(seq, &per_token, &heads, &kv_width);
    size_t pages = mul_sat(mul_sat(seq->layers, seq->batch_size), blocks_per_lane);
    size_t activations = mul_sat(seq->layers + 2, mul_sat(seq->batch_size, seq->model_width));
    size_t rows = activations + block * per_token; /* the workspace is below 8 MiB */
    size_t pointers = 2 * seq->layers; /* the model allocated `layers` pointers */
    size_t sizes[3] = {mul_sat(pointers, sizeof(void *)), mul_sat(rows, sizeof(double)),
                       mul_sat(pages, sizeof(uint32_t))};
    size_t bytes = sizes[0] + sizes[1] + sizes[2];
    if (sizes[0] > SIZE_MAX / 4 || sizes[1] > SIZE_MAX / 4 || /* GCOVR_EXCL_BR_LINE: see above */
        sizes[2] > SIZE_MAX / 4) {                         /* GCOVR_EXCL_BR_LINE: see above */
        return kvpi_fail_alloc(err, "sequence buffers", SIZE_MAX); /* GCOVR_EXCL_LINE: above */
    }
    void **memory = kvpi_calloc(KVPI_SITE_SEQUENCE, 1, bytes);
    if (memory == NULL) {
        return kvpi_fail_alloc(err, "sequence buffers", bytes);
    }
    seq->caches = (kvp_cache **)memory;
    seq->tickets = (kvp_ticket **)(memory + seq->layers);
    seq->activations = (double *)(void *)(memory + pointers);
    seq->zero_row = seq->activations + (seq->layers + 1) * seq->batch_size * seq->model_width;
    if (block > 0) {
        kvpi_prefill_work_init(&seq->prefill, seq->activations + activations, block,
                               seq->batch_size, seq->model_width, heads, kv_width, seq->capacity,
                               seq->layers);
    }
    seq->reserved = (uint32_t *)(void *)(seq->activations + rows);
    kvpi_reservation_init(&seq->reservation, seq->pool, seq->reserved, pages);
    /* A window's release gives its pages back to the promise (sequence.h). */
    seq->reservation.refund_promise = &seq->promise;
    return KVP_OK;
}

kvp_status kvp_sequence_create(const kvp_model *model, kvp_pool *pool, size_t batch_size,
                               size_t capacity, kvp_sequence **out, kvp_error *err)
{
    if (model == NULL) {
        return kvpi_fail_null(err, "model");
    }
    if (pool == NULL) {
        return kvpi_fail_null(err, "pool");
    }
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    kvp_binding binding;
    kvpi_layer_binding(model->layers[0], &binding);
    kvp_cache *probe = NULL;
    /* The first cache validates batch, capacity and geometry before anything else. */
    kvp_status status = kvp_cache_create(pool, &binding, batch_size, capacity, &probe, err);
    if (status != KVP_OK) {
        return status;
    }
    kvp_sequence *seq = kvpi_calloc(KVPI_SITE_SEQUENCE, 1, sizeof *seq);
    if (seq == NULL) {
        kvp_cache_destroy(probe, NULL);
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_SEQUENCE), sizeof *seq);
    }
    seq->model = model;
    seq->pool = pool;
    seq->layers = model->count;
    seq->batch_size = batch_size;
    seq->capacity = capacity;
    seq->model_width = model->model_width;
    status = alloc_buffers(seq, probe->blocks_per_lane, err);
    if (status != KVP_OK) {
        kvp_cache_destroy(probe, NULL);
        kvpi_free(seq);
        return status;
    }
    seq->caches[0] = probe;
    for (size_t l = 0; l < seq->layers && status == KVP_OK; l++) {
        if (l > 0) {
            kvpi_layer_binding(model->layers[l], &binding);
            status = kvp_cache_create(pool, &binding, batch_size, capacity, &seq->caches[l], err);
        }
        if (status == KVP_OK) {
            status = kvp_ticket_create(seq->caches[l], &seq->tickets[l], err);
        }
    }
    if (status != KVP_OK) {
        free_sequence(seq);
        return status;
    }
    kvpi_model_sequence_added(model);
    *out = seq;
    return KVP_OK;
}

kvp_status kvp_sequence_destroy(kvp_sequence *sequence, kvp_error *err)
{
    (void)err;
    if (sequence == NULL) {
        return KVP_OK; /* destroying NULL does nothing, as free(NULL) */
    }
    kvpi_reservation_release(&sequence->reservation);
    /* The same page order as reset, so a new sequence gets these pages back in turn. */
    kvpi_cache_truncate_many(sequence->caches, sequence->layers, 0);
    kvpi_model_sequence_removed(sequence->model);
    free_sequence(sequence);
    return KVP_OK;
}

kvp_status kvp_sequence_reset(kvp_sequence *sequence, kvp_error *err)
{
    if (sequence == NULL) {
        return kvpi_fail_null(err, "sequence");
    }
    for (size_t l = 0; l < sequence->layers; l++) {
        (void)kvp_ticket_discard(sequence->tickets[l], NULL);
    }
    kvpi_reservation_release(&sequence->reservation);
    kvpi_cache_truncate_many(sequence->caches, sequence->layers, 0);
    kvpi_pool_lock(sequence->pool);
    kvpi_pool_promise_set_locked(sequence->pool, &sequence->promise, 0);
    sequence->reservation.refund_deficit = 0;
    kvpi_pool_unlock(sequence->pool);
    return KVP_OK;
}

kvp_status kvp_sequence_promise(kvp_sequence *sequence, size_t pages, kvp_error *err)
{
    if (sequence == NULL) {
        return kvpi_fail_null(err, "sequence");
    }
    /*
     * A promise is bounded by the pages the sequence can ever hold, so the
     * pool's sum of promises is bounded by allocated page tables: it cannot
     * wrap and make admission see a small promise.
     */
    if (pages > sequence->reservation.capacity) {
        return kvpi_fail_out_of_range(err, "pages", pages, sequence->reservation.capacity + 1);
    }
    kvpi_pool_lock(sequence->pool);
    kvpi_pool_promise_set_locked(sequence->pool, &sequence->promise, pages);
    sequence->reservation.refund_deficit = 0; /* the new level: what it holds plus `pages` */
    kvpi_pool_unlock(sequence->pool);
    return KVP_OK;
}

static size_t blocks_for(const kvp_sequence *seq, size_t tokens)
{
    size_t bt = seq->caches[0]->block_tokens;
    return tokens / bt + (tokens % bt != 0);
}

/*
 * The pages a windowed layer may take beyond those it holds, growing to
 * `tokens` step by step: its peak (kvp_cache_pages_held_max) less what it
 * holds, at most its new blocks. Full layers: their new blocks.
 */
static size_t layer_pages_for(const kvp_sequence *seq, size_t l, size_t tokens, size_t blocks)
{
    const kvp_cache *cache = seq->caches[l];
    size_t full = seq->batch_size * blocks; /* bounded by the reservation */
    size_t peak = kvp_cache_pages_held_max(cache, tokens);
    size_t held = seq->batch_size * kvpi_cache_held_blocks(cache);
    size_t room = peak > held ? peak - held : 0;
    return room < full ? room : full;
}

size_t kvp_sequence_pages_for(const kvp_sequence *sequence, size_t tokens)
{
    if (sequence == NULL) {
        return 0;
    }
    size_t len = sequence->caches[0]->len;
    if (tokens <= len) {
        return 0;
    }
    if (tokens > sequence->capacity) {
        return kvp_sequence_prefill_pages(sequence, tokens); /* as before: SIZE_MAX-safe count */
    }
    size_t blocks = blocks_for(sequence, tokens) - blocks_for(sequence, len);
    size_t pages = 0;
    for (size_t l = 0; l < sequence->layers; l++) {
        pages += layer_pages_for(sequence, l, tokens, blocks) +
                 kvpi_cache_cow_pages(sequence->caches[l]);
    }
    return pages;
}

size_t kvp_sequence_prefill_pages(const kvp_sequence *sequence, size_t tokens)
{
    if (sequence == NULL) {
        return 0;
    }
    size_t len = sequence->caches[0]->len;
    if (tokens <= len) {
        return 0;
    }
    size_t blocks = blocks_for(sequence, tokens) - blocks_for(sequence, len);
    size_t lanes = sequence->layers * sequence->batch_size; /* bounded by the reservation */
    if (blocks != 0 && lanes > SIZE_MAX / blocks) {
        return SIZE_MAX; /* saturate, as kvp_pool_pages_for */
    }
    /* Copy-on-write pages of shared partial pages (share.c): at most one per lane. */
    size_t copies = 0;
    for (size_t l = 0; l < sequence->layers; l++) {
        copies += kvpi_cache_cow_pages(sequence->caches[l]);
    }
    return lanes * blocks > SIZE_MAX - copies ? SIZE_MAX : lanes * blocks + copies;
}

static void residual(const double *input, const double *output, size_t n, double *next)
{
    for (size_t i = 0; i < n; i++) {
        next[i] = input[i] + output[i];
    }
}

static void discard_tickets(kvp_sequence *seq, size_t count)
{
    for (size_t l = 0; l < count; l++) {
        (void)kvp_ticket_discard(seq->tickets[l], NULL);
    }
}

/* Prepares every layer; on failure discards the earlier tickets and names the layer. */
static kvp_status prepare_layers(kvp_sequence *seq, const kvp_tensor *input,
                                 kvp_next_input_fn next_input, void *ctx,
                                 const kvpi_parallel *par, kvp_error *err)
{
    size_t n = seq->batch_size * seq->model_width;
    kvp_tensor view = *input;
    for (size_t l = 0; l < seq->layers; l++) {
        kvp_status status = kvpi_attention_prepare(seq->model->layers[l], &view, seq->caches[l],
                                                   seq->tickets[l], 0, par, err);
        if (status != KVP_OK) {
            discard_tickets(seq, l);
            if (err != NULL) {
                err->layer = l;
            }
            return status;
        }
        double *next = seq->activations + (l + 1) * n;
        if (next_input != NULL) {
            next_input(ctx, l, view.data, seq->tickets[l]->output, n, next);
        } else {
            residual(view.data, seq->tickets[l]->output, n, next);
        }
        view = kvp_tensor3(next, seq->batch_size, 1, seq->model_width);
    }
    return KVP_OK;
}

static size_t step_pages(const kvp_sequence *seq)
{
    size_t pages = 0;
    for (size_t l = 0; l < seq->layers; l++) {
        pages += kvpi_cache_pages_needed(seq->caches[l]);
    }
    return pages;
}

static kvp_status reserve(kvp_sequence *seq, size_t pages, kvp_error *err)
{
    kvp_status status =
        kvpi_reservation_fill_promised(&seq->reservation, pages, &seq->promise, err);
    if (status != KVP_OK && err != NULL) {
        err->layer = SIZE_MAX;
    }
    return status;
}

/* Cannot fail: every ticket was just prepared against its own, unchanged cache. */
static void commit_layers(kvp_sequence *seq)
{
    for (size_t l = 0; l < seq->layers; l++) {
        (void)kvpi_ticket_commit_with(seq->tickets[l], seq->caches[l], &seq->reservation, NULL);
    }
}

kvp_status kvp_sequence_step(kvp_sequence *sequence, const kvp_tensor *input,
                             kvp_next_input_fn next_input, void *ctx, double *output,
                             size_t output_len, kvp_error *err)
{
    return kvpi_sequence_step_on(sequence, input, next_input, ctx, output, output_len, NULL, err);
}

kvp_status kvpi_sequence_step_on(kvp_sequence *sequence, const kvp_tensor *input,
                                 kvp_next_input_fn next_input, void *ctx, double *output,
                                 size_t output_len, const kvpi_parallel *par, kvp_error *err)
{
    if (sequence == NULL) {
        return kvpi_fail_null(err, "sequence");
    }
    if (input == NULL || input->data == NULL) {
        return kvpi_fail_null(err, "input");
    }
    if (output == NULL) {
        return kvpi_fail_null(err, "output");
    }
    size_t n = sequence->batch_size * sequence->model_width;
    if (output_len < n) {
        return kvpi_fail_buffer(err, "output", n, output_len);
    }
    kvp_status status = prepare_layers(sequence, input, next_input, ctx, par, err);
    if (status != KVP_OK) {
        return status;
    }
    status = reserve(sequence, step_pages(sequence), err);
    if (status != KVP_OK) {
        discard_tickets(sequence, sequence->layers);
        return status;
    }
    commit_layers(sequence);
    memcpy(output, sequence->activations + sequence->layers * n, n * sizeof *output);
    return KVP_OK;
}

/*
 * Tokens 1..T-1 of the prompt must be finite: a non-finite value at token t
 * would make layer 0's query projection of that token non-finite, so it is
 * refused before any page is taken, with the error that projection gives,
 * err.layer 0 and err.token t. Called after token 0 was prepared, whose
 * layer-0 ticket no longer needs its query row: that row is the scratch.
 */
static kvp_status check_prompt_finite(kvp_sequence *seq, const kvp_tensor *prompt,
                                      kvp_error *err)
{
    size_t tokens = prompt->shape.dims[1];
    size_t d = seq->model_width;
    size_t n = seq->batch_size * d;
    for (size_t t = 1; t < tokens; t++) {
        int finite = 1;
        for (size_t b = 0; b < seq->batch_size && finite; b++) {
            finite = kvpi_first_nonfinite(prompt->data + (b * tokens + t) * d, d) == d;
        }
        if (finite) {
            continue;
        }
        const double *w_query = kvp_param_values(kvp_layer_param(seq->model->layers[0],
                                                                 KVP_PARAM_QUERY));
        double *query = seq->tickets[0]->query;
        kvpi_project_rows(prompt->data + t * d, tokens * d, seq->batch_size, w_query, d, d, query,
                          d);
        kvp_error e = kvpi_error_begin(KVP_NONFINITE_PROJECTION);
        e.what = "query";
        e.index = kvpi_first_nonfinite(query, n);
        e.value = query[e.index];
        e.layer = 0;
        e.token = t;
        return kvpi_error_emit(err, &e);
    }
    return KVP_OK;
}

/* Prompt shape, room and output buffer, before anything is computed. */
kvp_status kvpi_sequence_check_prompt_shape(const kvp_sequence *seq, const kvp_shape *shape,
                                            kvp_error *err)
{
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

static kvp_status validate_prompt(const kvp_sequence *seq, const kvp_tensor *prompt,
                                  size_t output_len, const double *output, kvp_error *err)
{
    const kvp_shape *shape = &prompt->shape;
    size_t room = seq->capacity - seq->caches[0]->len;
    kvp_status status = kvpi_sequence_check_prompt_shape(seq, shape, err);
    if (status != KVP_OK) {
        return status;
    }
    if (shape->dims[1] == 0) {
        return kvpi_fail_invalid(err, "prompt", "a prompt needs at least one token");
    }
    if (shape->dims[1] > room) {
        kvp_error e = kvpi_error_begin(KVP_FULL);
        e.what = "prompt";
        e.capacity = seq->capacity;
        e.tokens = shape->dims[1];
        e.available = room;
        e.layer = SIZE_MAX;
        return kvpi_error_emit(err, &e);
    }
    /* batch * tokens * width <= batch * capacity * width, bounded at cache creation. */
    size_t elements = seq->batch_size * shape->dims[1] * seq->model_width;
    if (output != NULL && output_len < elements) {
        return kvpi_fail_buffer(err, "output", elements, output_len);
    }
    return KVP_OK;
}

/*
 * Undoes a prefill that failed after its first token, in one hold of the pool
 * lock: the unused reserved pages and then the committed rows go back, newest
 * first, so the free list is as before; the tentative pages are cancelled, so
 * acquires, releases and the high-water mark are as before; the promise is
 * restored.
 */
static void roll_back(kvp_sequence *seq, size_t len, size_t promise, size_t deficit,
                      size_t pages)
{
    kvpi_pool_lock(seq->pool);
    /*
     * Truncate only when a row was committed: a truncate recomputes the
     * copy-on-write marks, and a mark outlives the other side's release
     * (share.c), so a prefill that committed nothing leaves the marks alone.
     */
    kvpi_reservation_release_locked(&seq->reservation);
    if (seq->caches[0]->len != len) {
        kvpi_cache_truncate_many_locked(seq->caches, seq->layers, len);
    }
    kvpi_cache_cow_undo_many_locked(seq->caches, seq->layers);
    kvpi_pool_tentative_cancel_locked(seq->pool, pages);
    kvpi_pool_promise_set_locked(seq->pool, &seq->promise, promise);
    seq->reservation.refund_deficit = deficit;
    kvpi_pool_unlock(seq->pool);
}

kvp_status kvp_sequence_prefill(kvp_sequence *sequence, const kvp_tensor *prompt,
                                kvp_next_input_fn next_input, void *ctx, double *output,
                                size_t output_len, kvp_error *err)
{
    return kvpi_sequence_prefill_on(sequence, prompt, next_input, ctx, output, output_len, NULL,
                                    err);
}

/*
 * Tokens per block of the blocked prefill (prefill_blocks); 0 computes
 * every token alone, as steps. A test and benchmark hook
 * (kvpi_sequence_prefill_block_set): the bits never depend on it.
 */
static size_t prefill_block_want = KVPI_PREFILL_BLOCK_DEFAULT;

int kvpi_sequence_stale(const kvp_sequence *sequence)
{
    for (size_t i = 0; i < sequence->layers; i++) {
        kvpi_layer_record rec;
        kvpi_cache_layer_record(sequence->caches[i], &rec);
        const kvp_layer *layer = kvp_model_layer(sequence->model, i);
        for (size_t k = 0; k < KVP_PARAM_COUNT; k++) {
            if (rec.revision[k] != kvp_param_revision(kvp_layer_param(layer, k))) {
                return 1;
            }
        }
    }
    return 0;
}

void kvpi_sequence_prefill_block_set(size_t tokens)
{
    prefill_block_want = tokens;
}

size_t kvpi_sequence_prefill_block_get(void)
{
    return prefill_block_want;
}

/*
 * Tokens per block for tokens 1..T-1 of a prompt, or 0: compute them one by
 * one. Blocks run the residual stream only: a next_input function is called
 * in token-major order (kvp_sequence_prefill's contract), which a block,
 * computed layer after layer, cannot keep.
 */
static size_t prefill_block_for(const kvp_sequence *seq, size_t tokens,
                                kvp_next_input_fn next_input)
{
    if (tokens < 2 || next_input != NULL) {
        return 0;
    }
    size_t block = seq->prefill.tokens < prefill_block_want ? seq->prefill.tokens
                                                            : prefill_block_want;
    return block >= 1 ? block : 0;
}

/*
 * Tokens [t0, t0 + count) of the prompt through every layer, layer by layer
 * (kvpi_prefill_layer, which reads each page once per layer for the whole
 * block), then their rows committed token after token, layer by layer
 * within a token, as single steps commit them: the same bits, rows and
 * physical pages as computing them token by token. When a layer fails at
 * row r, the later layers compute rows < r only (a token's errors depend on
 * earlier tokens alone), and a later failure at a smaller row replaces it:
 * the error reported is the first in token-major order, the one
 * token-by-token computation meets, with err.token and err.layer set. The
 * outputs of the rows before it are written, as token by token; their rows
 * are not committed (the caller rolls the prefill back).
 */
static kvp_status prefill_rows(kvp_sequence *seq, const kvp_tensor *prompt, size_t t0,
                               size_t count, double *output, const kvpi_parallel *par,
                               kvp_error *err)
{
    kvpi_prefill_work *work = &seq->prefill;
    size_t tokens = prompt->shape.dims[1];
    size_t d = seq->model_width;
    size_t n = seq->batch_size * d;
    for (size_t t = 0; t < count; t++) {
        for (size_t b = 0; b < seq->batch_size; b++) {
            memcpy(work->input + t * n + b * d, prompt->data + (b * tokens + t0 + t) * d,
                   d * sizeof(double));
        }
    }
    kvp_error failure = kvpi_error_begin(KVP_OK);
    size_t failed_layer = SIZE_MAX;
    for (size_t l = 0; l < seq->layers && count > 0; l++) {
        kvp_error e = kvpi_error_begin(KVP_OK);
        size_t passed =
            kvpi_prefill_layer(seq->model->layers[l], seq->caches[l], l, work, count, par, &e);
        if (passed < count) {
            failure = e;
            failed_layer = l;
            count = passed;
        }
        residual(work->input, work->output, count * n, work->next);
        double *swap = work->input;
        work->input = work->next;
        work->next = swap;
    }
    /*
     * A failing block commits nothing: the roll-back would give its rows back
     * at once, and pages it did not write can go back to the LRU list with
     * their keys (pool_internal.h, borrowed pages). Outputs are written.
     */
    int commit = failure.status == KVP_OK;
    for (size_t t = 0; t < count; t++) {
        for (size_t l = 0; l < seq->layers && commit; l++) {
            kvp_cache *cache = seq->caches[l];
            size_t kv_width = cache->heads * cache->head_width;
            kvpi_cache_commit(cache, kvpi_prefill_work_key(work, l, t, kv_width),
                              kvpi_prefill_work_value(work, l, t, kv_width), &seq->reservation);
        }
        if (output != NULL) {
            for (size_t b = 0; b < seq->batch_size; b++) {
                memcpy(output + (b * tokens + t0 + t) * d, work->input + t * n + b * d,
                       d * sizeof *output);
            }
        }
    }
    if (failure.status == KVP_OK) {
        return KVP_OK;
    }
    failure.layer = failed_layer;
    failure.token = t0 + count;
    return kvpi_error_emit(err, &failure);
}

/* Every token of the prompt, from token 0, in blocks of `block` tokens (prefill_rows). */
static kvp_status prefill_blocks(kvp_sequence *seq, const kvp_tensor *prompt, size_t block,
                                 double *output, const kvpi_parallel *par, kvp_error *err)
{
    size_t tokens = prompt->shape.dims[1];
    for (size_t t = 0; t < tokens; t += block) {
        size_t count = tokens - t < block ? tokens - t : block;
        kvp_status status = prefill_rows(seq, prompt, t, count, output, par, err);
        if (status != KVP_OK) {
            return status;
        }
    }
    return KVP_OK;
}

kvp_status kvpi_sequence_prefill_on(kvp_sequence *sequence, const kvp_tensor *prompt,
                                    kvp_next_input_fn next_input, void *ctx, double *output,
                                    size_t output_len, const kvpi_parallel *par, kvp_error *err)
{
    if (sequence == NULL) {
        return kvpi_fail_null(err, "sequence");
    }
    if (prompt == NULL || prompt->data == NULL) {
        return kvpi_fail_null(err, "prompt");
    }
    kvp_status status = validate_prompt(sequence, prompt, output_len, output, err);
    if (status != KVP_OK) {
        return status;
    }
    size_t tokens = prompt->shape.dims[1];
    size_t d = sequence->model_width;
    size_t n = sequence->batch_size * d;
    size_t start = sequence->caches[0]->len;
    size_t promise = sequence->promise;
    size_t deficit = sequence->reservation.refund_deficit;
    size_t pages = kvp_sequence_prefill_pages(sequence, start + tokens);
    /*
     * With a workspace, token 0 is prepared alone (every check before a page
     * is taken) and then every token goes in blocks; else one by one.
     */
    size_t block = prefill_block_for(sequence, tokens, next_input);
    double *row = sequence->activations; /* x_0 of each token, gathered from [B, T, D] */
    for (size_t t = 0; t < tokens; t++) {
        for (size_t b = 0; b < sequence->batch_size; b++) {
            memcpy(row + b * d, prompt->data + (b * tokens + t) * d, d * sizeof *row);
        }
        kvp_tensor input = kvp_tensor3(row, sequence->batch_size, 1, d);
        status = prepare_layers(sequence, &input, next_input, ctx, par, err);
        if (status != KVP_OK) {
            if (t > 0) {
                roll_back(sequence, start, promise, deficit, pages);
            }
            if (err != NULL) {
                err->token = t;
            }
            return status;
        }
        if (t == 0) {
            /*
             * The first token is prepared (every binding and the first row
             * checked) before any page is taken, and the other tokens'
             * inputs are checked; then the pages of every token are taken,
             * tentatively, so that a later failure leaves no trace in the
             * pool's counters. The bindings cannot change during the call
             * (kvp_sequence_prefill's contract), so the blocks of later
             * tokens need not check them again.
             */
            status = check_prompt_finite(sequence, prompt, err);
            if (status == KVP_OK) {
                status = kvpi_reservation_fill_tentative(&sequence->reservation, pages,
                                                         &sequence->promise, err);
                if (status != KVP_OK && err != NULL) {
                    err->layer = SIZE_MAX;
                }
            }
            if (status != KVP_OK) {
                discard_tickets(sequence, sequence->layers);
                return status;
            }
            kvpi_cache_cow_defer_many(sequence->caches, sequence->layers);
            if (block > 0) {
                /*
                 * Token 0 again, as the first row of the blocks: a failing
                 * block writes no page (prefill_rows), so a prefill that
                 * fails in its first block gives back every page unwritten
                 * (pages borrowed from the LRU list keep their keys).
                 */
                discard_tickets(sequence, sequence->layers);
                status = prefill_blocks(sequence, prompt, block, output, par, err);
                if (status != KVP_OK) {
                    roll_back(sequence, start, promise, deficit, pages);
                    return status;
                }
                break;
            }
        }
        commit_layers(sequence);
        if (output != NULL) {
            const double *last = sequence->activations + sequence->layers * n;
            for (size_t b = 0; b < sequence->batch_size; b++) {
                memcpy(output + (b * tokens + t) * d, last + b * d, d * sizeof *output);
            }
        }
    }
    kvpi_pool_lock(sequence->pool);
    size_t released = kvpi_cache_cow_settle_many_locked(sequence->caches, sequence->layers);
    kvpi_reservation_refund_locked(&sequence->reservation, released);
    kvpi_pool_tentative_confirm_locked(sequence->pool, pages);
    kvpi_pool_unlock(sequence->pool);
    return KVP_OK;
}

kvp_status kvpi_sequence_append_uncomputed(kvp_sequence *sequence, size_t tokens,
                                           kvp_error *err)
{
    if (sequence == NULL) {
        return kvpi_fail_null(err, "sequence");
    }
    size_t len = sequence->caches[0]->len;
    if (tokens > sequence->capacity - len) {
        kvp_error e = kvpi_error_begin(KVP_FULL);
        e.capacity = sequence->capacity;
        e.layer = SIZE_MAX;
        return kvpi_error_emit(err, &e);
    }
    kvp_status status = reserve(sequence, kvp_sequence_prefill_pages(sequence, len + tokens), err);
    if (status != KVP_OK) {
        return status;
    }
    for (size_t t = 0; t < tokens; t++) {
        for (size_t l = 0; l < sequence->layers; l++) {
            kvpi_cache_commit(sequence->caches[l], sequence->zero_row, sequence->zero_row,
                              &sequence->reservation);
        }
    }
    return KVP_OK;
}

size_t kvp_sequence_len(const kvp_sequence *sequence)
{
    return sequence != NULL ? sequence->caches[0]->len : 0;
}

size_t kvp_sequence_capacity(const kvp_sequence *sequence)
{
    return sequence != NULL ? sequence->capacity : 0;
}

size_t kvp_sequence_held_pages(const kvp_sequence *sequence)
{
    if (sequence == NULL) {
        return 0;
    }
    size_t blocks = 0; /* a window's released blocks hold no page */
    for (size_t l = 0; l < sequence->layers; l++) {
        blocks += kvpi_cache_held_blocks(sequence->caches[l]);
    }
    return sequence->batch_size * blocks;
}

size_t kvp_sequence_promised_pages(const kvp_sequence *sequence)
{
    return sequence != NULL ? sequence->promise : 0;
}

const kvp_cache *kvp_sequence_cache(const kvp_sequence *sequence, size_t layer)
{
    if (sequence == NULL || layer >= sequence->layers) {
        return NULL;
    }
    return sequence->caches[layer];
}
