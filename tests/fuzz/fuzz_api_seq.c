/*
 * fuzz_api_seq.c: the kvp_fuzz_api target's operations on sequences and the
 * decoder (see fuzz_api.c for the whole target): sequence create, destroy,
 * reset, truncate, promise, step, prefill, fork, publish and adopt (prefix
 * sharing), admit, parameter updates and the decoder's step over several
 * sequences, with the shadow's chained activations (residual stream or the
 * target's own next_input function).
 *
 * Invariants: as fuzz_api_cache.c: the status is predicted from W before
 * the call, W changes only as the library's contract says (prefill: the
 * documented tokens before a failure), and a failure leaves the rest as it
 * was; the decoder alone is nondeterministic (which job gets the last free
 * pages), and its check accepts exactly the outcomes the contract allows.
 *
 * Callers: fuzz_api.c's operation table (g_ops), through fuzz_api.h.
 */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_api.h"

/* ---- sequences ------------------------------------------------------------ */


void op_seq_create(reader *r)
{
    sseq *s = &W.seq[rd(r) % N_SEQS];
    uint8_t b = rd(r);
    size_t batch = b < 8 ? 0 : 1 + b % MAX_B;
    size_t capacity = rd(r) % (MAX_CAP + 2);
    if (s->live) {
        return;
    }
    g_op_name = "sequence_create";
    kvp_status want = batch == 0      ? KVP_ZERO_BATCH_SIZE
                      : capacity == 0 ? KVP_ZERO_CAPACITY
                      : capacity > MAX_POSITIONS ? KVP_CAPACITY_EXCEEDS_POSITIONS
                                                 : KVP_OK;
    kvp_sequence *sentinel = (kvp_sequence *)&W, *seq = sentinel;
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_sequence_create(W.model, W.pool, batch, capacity, &seq, &err);
    check_status(status, want, &err);
    if (status != KVP_OK) {
        CHECK(seq == sentinel, "a failed sequence_create wrote *out");
        return;
    }
    check_untouched(&err);
    memset(s, 0, sizeof *s);
    s->seq = seq;
    s->live = 1;
    s->batch = batch;
    s->capacity = capacity;
    for (size_t l = 0; l < W.layers; l++) {
        memcpy(s->version[l], W.params[W.layer[W.model_layer[l]].pset].version,
               sizeof s->version[l]);
    }
}

void op_seq_destroy(reader *r)
{
    sseq *s = &W.seq[rd(r) % N_SEQS];
    if (!s->live) {
        return;
    }
    g_op_name = "sequence_destroy";
    kvp_error err;
    kvp_status status = kvp_sequence_destroy(s->seq, &err);
    check_status(status, KVP_OK, &err);
    seq_truncate_to(s, 0);
    s->live = 0;
}

void op_seq_reset(reader *r)
{
    sseq *s = &W.seq[rd(r) % N_SEQS];
    if (!s->live) {
        return;
    }
    g_op_name = "sequence_reset";
    kvp_error err;
    kvp_status status = kvp_sequence_reset(s->seq, &err);
    check_status(status, KVP_OK, &err);
    seq_truncate_to(s, 0);
    s->promise = 0;
}

void op_seq_truncate(reader *r)
{
    sseq *s = &W.seq[rd(r) % N_SEQS];
    size_t new_len = rd(r);
    if (!s->live) {
        return;
    }
    size_t len = s->kv[0].len;
    new_len %= len + 2;
    g_op_name = "sequence_truncate";
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_sequence_truncate(s->seq, new_len, &err);
    check_status(status, new_len > len ? KVP_OUT_OF_RANGE : KVP_OK, &err);
    if (status != KVP_OK) {
        return;
    }
    check_untouched(&err);
    if (new_len != len) { /* the same length changes nothing, the marks included */
        seq_truncate_to(s, new_len);
    }
}

void op_seq_promise(reader *r)
{
    sseq *s = &W.seq[rd(r) % N_SEQS];
    size_t pages = rd(r) % 24;
    if (!s->live) {
        return;
    }
    g_op_name = "sequence_promise";
    size_t limit = W.layers * s->batch * blocks_for(s->capacity);
    kvp_error err;
    kvp_status status = kvp_sequence_promise(s->seq, pages, &err);
    check_status(status, pages > limit ? KVP_OUT_OF_RANGE : KVP_OK, &err);
    if (status == KVP_OK) {
        s->promise = pages;
    }
}

/* What one sequence token should give: a status (with the layer), or the rows. */
typedef struct seq_expect {
    kvp_status status;
    size_t layer; /* SIZE_MAX for the step's own failures */
    expect e;     /* the failing layer's detail */
    double out[MAX_B * MAX_D];
    double key[MAX_MODEL][MAX_B * MAX_D];
    double value[MAX_MODEL][MAX_B * MAX_D];
} seq_expect;

/*
 * The other way to chain layers: next = output - input / 2, a pure function
 * (the decoder calls it from several threads). ctx must be &W.
 */
static void next_half(void *ctx, size_t layer, const double *input, const double *output,
                      size_t elements, double *next)
{
    CHECK(ctx == &W && layer < W.layers, "next_input called with ctx %p, layer %zu", ctx, layer);
    for (size_t i = 0; i < elements; i++) {
        next[i] = output[i] - input[i] / 2.0;
    }
}

static kvp_next_input_fn next_fn(void)
{
    return W.next_mode ? next_half : NULL;
}

/* Every layer's prepare for one token on `kv` (not changed), chaining the residual. */
static kvp_status expect_token(const sseq *s, const skv *kv, const double *x0, seq_expect *se)
{
    double x[MAX_B * MAX_D];
    size_t n = s->batch * W.d;
    memcpy(x, x0, n * sizeof *x);
    for (size_t l = 0; l < W.layers; l++) {
        const slayer *layer = &W.layer[W.model_layer[l]];
        memset(&se->e, 0, sizeof se->e);
        se->layer = l;
        int stale = stale_parameter(s->version[l], layer->pset);
        if (stale >= 0) {
            se->e.parameter = (size_t)stale;
            return se->status = se->e.status = KVP_CACHE_LAYER_REVISION_MISMATCH;
        }
        if (kv[l].len == s->capacity) {
            return se->status = se->e.status = KVP_FULL;
        }
        if (s_attend(layer, &kv[l], s->batch, x, &se->e) != KVP_OK) {
            return se->status = se->e.status;
        }
        memcpy(se->key[l], se->e.key, n * sizeof *x);
        memcpy(se->value[l], se->e.value, n * sizeof *x);
        for (size_t i = 0; i < n; i++) {
            x[i] = W.next_mode ? se->e.out[i] - x[i] / 2.0 : x[i] + se->e.out[i];
        }
    }
    memcpy(se->out, x, n * sizeof *x);
    se->layer = SIZE_MAX;
    return se->status = KVP_OK;
}

static size_t step_pages(const sseq *s)
{
    return seq_pages_for(s, s->kv[0].len + 1);
}

static void apply_token(skv *kv, size_t batch, const seq_expect *se)
{
    for (size_t l = 0; l < W.layers; l++) {
        skv_append(&kv[l], batch, se->key[l], se->value[l]);
    }
}

static void consume_promise(sseq *s, size_t pages)
{
    s->promise -= pages < s->promise ? pages : s->promise;
}

static void check_seq_failure(const kvp_error *err, const seq_expect *se)
{
    CHECK(err->layer == se->layer, "err.layer %zu, expected %zu", err->layer, se->layer);
    if (se->layer != SIZE_MAX) {
        check_detail(err, &se->e);
    }
}

/* Fills an output buffer before a call, to see what a failed call wrote. */
#define UNTOUCHED (-12345.25)

static void fill_untouched(double *out, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        out[i] = UNTOUCHED;
    }
}

static void check_untouched_rows(const char *what, const double *out, size_t from, size_t to)
{
    for (size_t i = from; i < to; i++) {
        CHECK(out[i] == UNTOUCHED, "a failed call wrote %s[%zu] = %g", what, i, out[i]);
    }
}

void op_seq_step(reader *r)
{
    sseq *s = &W.seq[rd(r) % N_SEQS];
    double x[MAX_B * MAX_D];
    if (!s->live) {
        return;
    }
    read_values(r, x, s->batch * W.d);
    g_op_name = "sequence_step";
    seq_expect se;
    kvp_status want = expect_token(s, s->kv, x, &se);
    size_t pages = step_pages(s);
    if (want == KVP_OK && pages > free_pages()) {
        want = se.status = KVP_POOL_EXHAUSTED;
        se.layer = SIZE_MAX;
    }
    digests before;
    take_digests(&before);
    double out[MAX_B * MAX_D];
    fill_untouched(out, MAX_B * MAX_D);
    kvp_tensor input = kvp_tensor3(x, s->batch, 1, W.d);
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_sequence_step(s->seq, &input, next_fn(), &W, out, s->batch * W.d, &err);
    check_status(status, want, &err);
    if (status != KVP_OK) {
        check_seq_failure(&err, &se);
        check_untouched_rows("step output", out, 0, MAX_B * MAX_D);
        if (status == KVP_POOL_EXHAUSTED) {
            W.exhaustions++;
        }
        check_unchanged(&before);
        return;
    }
    check_untouched(&err);
    compare_rows("sequence step output", out, se.out, s->batch * W.d);
    seq_step_pages(s, pages);
    consume_promise(s, pages);
    memcpy(s->x[s->kv[0].len], x, sizeof s->x[0]);
    apply_token(s->kv, s->batch, &se);
}

/* Token t of a [B, T, D] prompt, as the [B, D] input of one step. */
static void prompt_token(const double *prompt, size_t batch, size_t tokens, size_t t, double *x)
{
    for (size_t b = 0; b < batch; b++) {
        memcpy(x + b * W.d, prompt + (b * tokens + t) * W.d, W.d * sizeof *x);
    }
}

/*
 * The prefill contract's early finite check (sequence.h): a token t > 0 whose
 * input holds a NaN or an infinity fails as layer 0's query projection of
 * that token would, before anything is computed. OK when every input is finite.
 */
static kvp_status expect_finite_prompt(const sseq *s, const double *prompt, size_t tokens,
                                       size_t *token, seq_expect *se)
{
    size_t n = s->batch * W.d;
    const sparams *p = &W.params[W.layer[W.model_layer[0]].pset];
    for (size_t t = 1; t < tokens; t++) {
        double x[MAX_B * MAX_D];
        prompt_token(prompt, s->batch, tokens, t, x);
        if (first_nonfinite(x, n) == n) {
            continue;
        }
        double query[MAX_B * MAX_D];
        for (size_t lane = 0; lane < s->batch; lane++) {
            s_project(x + lane * W.d, p->w[0], W.d, query + lane * W.d);
        }
        memset(&se->e, 0, sizeof se->e);
        se->layer = 0;
        *token = t;
        return se->status = set_nonfinite(&se->e, KVP_NONFINITE_PROJECTION, "query",
                                          first_nonfinite(query, n));
    }
    return KVP_OK;
}

void op_seq_prefill(reader *r)
{
    sseq *s = &W.seq[rd(r) % N_SEQS];
    uint8_t tokens_byte = rd(r);
    size_t tokens = tokens_byte % (MAX_PROMPT + 1);
    /* Now and then a prompt of the wrong rank, batch or width. */
    int shape = tokens_byte < 250 ? 0 : 1 + (tokens_byte - 250) % 3;
    double prompt[MAX_B * MAX_PROMPT * MAX_D];
    if (!s->live) {
        return;
    }
    read_values(r, prompt, s->batch * (tokens ? tokens : 1) * W.d);
    g_op_name = "sequence_prefill";
    seq_expect se;
    memset(&se, 0, sizeof se);
    se.layer = SIZE_MAX;
    size_t len = s->kv[0].len, token = 0;
    int computing = 0; /* the failure came while computing token `token` > 0 */
    size_t pages = tokens > 0 ? seq_pages_for(s, len + tokens) : 0;
    kvp_status want = KVP_OK;
    skv *work = malloc(sizeof s->kv);
    CHECK(work != NULL, "out of memory in the fuzz target");
    memcpy(work, s->kv, sizeof s->kv);
    double outputs[MAX_B * MAX_PROMPT * MAX_D];
    static const kvp_status shape_status[] = {KVP_OK, KVP_INPUT_RANK, KVP_INPUT_BATCH_MISMATCH,
                                              KVP_INPUT_WIDTH_MISMATCH};
    if (shape != 0) {
        want = shape_status[shape];
    } else if (tokens == 0) {
        want = KVP_INVALID_ARGUMENT;
    } else if (tokens > s->capacity - len) {
        want = KVP_FULL;
    } else {
        /* sequence.h's order: token 0 in every layer, then the other tokens'
         * inputs must be finite, then every page at once, then token by token. */
        double x[MAX_B * MAX_D];
        prompt_token(prompt, s->batch, tokens, 0, x);
        want = expect_token(s, work, x, &se);
        if (want == KVP_OK) {
            want = expect_finite_prompt(s, prompt, tokens, &token, &se);
        }
        if (want == KVP_OK && pages > free_pages()) {
            want = KVP_POOL_EXHAUSTED;
        }
        for (size_t t = 0; t < tokens && want == KVP_OK; t++) {
            prompt_token(prompt, s->batch, tokens, t, x);
            want = expect_token(s, work, x, &se);
            if (want != KVP_OK) {
                token = t;
                computing = 1;
                break;
            }
            apply_token(work, s->batch, &se);
            for (size_t b = 0; b < s->batch; b++) {
                memcpy(outputs + (b * tokens + t) * W.d, se.out + b * W.d, W.d * sizeof *x);
            }
        }
    }
    digests before;
    take_digests(&before);
    double out[MAX_B * MAX_PROMPT * MAX_D];
    fill_untouched(out, MAX_B * MAX_PROMPT * MAX_D);
    kvp_tensor input = kvp_tensor3(prompt, s->batch, tokens, W.d);
    if (shape == 1) {
        input.shape.rank = 4;
        input.shape.dims[3] = 1;
    } else if (shape == 2) {
        input.shape.dims[0] = s->batch % MAX_B + 1;
    } else if (shape == 3) {
        input.shape.dims[2] = W.d / 2;
    }
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_sequence_prefill(s->seq, &input, next_fn(), &W, out,
                                             s->batch * tokens * W.d, &err);
    check_status(status, want, &err);
    if (status != KVP_OK) {
        if (status != KVP_INVALID_ARGUMENT) {
            check_seq_failure(&err, &se);
        }
        if (status == KVP_POOL_EXHAUSTED) {
            W.exhaustions++;
        }
        if (se.layer != SIZE_MAX) {
            CHECK(err.token == token, "err.token %zu, expected %zu", err.token, token);
        }
        if (computing) {
            /* The documented exception: rows before the failing token hold
             * outputs. Its pages went back uncounted, and the cached pages it
             * borrowed came back to the LRU list, but for those it wrote
             * (DESIGN.md, "The one exception"): evicted, and free now. */
            forget_written_borrowed(s, len, pages, next_fn() != NULL ? token : 0);
            for (size_t b = 0; b < s->batch; b++) {
                size_t row = b * tokens * W.d;
                compare_rows("rows before the failing token", out + row, outputs + row,
                             token * W.d);
                check_untouched_rows("prefill output", out, row + token * W.d,
                                     row + tokens * W.d);
            }
        } else {
            check_untouched_rows("prefill output", out, 0, MAX_B * MAX_PROMPT * MAX_D);
        }
        check_unchanged(&before);
        free(work);
        return;
    }
    check_untouched(&err);
    compare_rows("prefill output", out, outputs, s->batch * tokens * W.d);
    /* Every page taken at once (tentatively), mapped token by token, the
     * copied originals put at the end, then counted. */
    uint8_t ids[MAX_MODEL * MAX_B * (MAX_CAP + 1)];
    uint8_t saved[MAX_MODEL][MAX_B];
    for (size_t i = 0; i < pages; i++) {
        ids[i] = spage_new();
    }
    size_t next = 0;
    int copied[MAX_MODEL];
    for (size_t l = 0; l < W.layers; l++) {
        copied[l] = s->cow[l] && len % W.bt != 0;
    }
    for (size_t t = 0; t < tokens; t++) {
        seq_map_token(s, ids, &next, saved, 1);
        prompt_token(prompt, s->batch, tokens, t, s->x[len + t]);
        for (size_t l = 0; l < W.layers; l++) {
            s->kv[l].len++;
        }
    }
    CHECK(next == pages, "a prefill mapped %zu of its %zu pages", next, pages);
    for (size_t l = 0; l < W.layers; l++) {
        for (size_t b = 0; b < s->batch && copied[l]; b++) {
            spage_put(saved[l][b]);
        }
    }
    W.acquires += pages;
    raise_high_water();
    consume_promise(s, pages);
    memcpy(s->kv, work, sizeof s->kv);
    free(work);
}

/* ---- sharing: fork, publish, adopt ---------------------------------------- */

void op_seq_fork(reader *r)
{
    sseq *parent = &W.seq[rd(r) % N_SEQS];
    sseq *child = &W.seq[rd(r) % N_SEQS];
    if (!parent->live || child->live) {
        return;
    }
    g_op_name = "sequence_fork";
    kvp_sequence *made = NULL;
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_sequence_fork(parent->seq, &made, &err);
    check_status(status, KVP_OK, &err);
    check_untouched(&err);
    memcpy(child, parent, sizeof *child);
    child->seq = made;
    child->promise = 0;
    size_t len = parent->kv[0].len;
    for (size_t l = 0; l < W.layers; l++) {
        for (size_t b = 0; b < parent->batch; b++) {
            for (size_t block = 0; block < blocks_for(len); block++) {
                spage_ref(parent->table[l][b][block]);
            }
        }
        if (len % W.bt != 0) {
            parent->cow[l] = 1;
            child->cow[l] = 1;
        }
    }
}


/* The sequence's own input rows [0, tokens) as a [B, T, D] prompt. */
static void own_prompt(const sseq *s, size_t tokens, double *prompt)
{
    for (size_t b = 0; b < s->batch; b++) {
        for (size_t t = 0; t < tokens; t++) {
            memcpy(prompt + (b * tokens + t) * W.d, s->x[t] + b * W.d, W.d * sizeof *prompt);
        }
    }
}

/*
 * Publish the sequence's own first T rows (the caller's precondition holds by
 * construction). A model of one layer twice publishes both layers: the keys
 * carry the layer index.
 */
void op_seq_publish(reader *r)
{
    sseq *s = &W.seq[rd(r) % N_SEQS];
    uint8_t t_byte = rd(r);
    if (!s->live || s->kv[0].len == 0) {
        return;
    }
    g_op_name = "sequence_publish";
    size_t len = s->kv[0].len;
    size_t tokens = 1 + t_byte % len;
    double prompt[MAX_B * MAX_CAP * MAX_D];
    own_prompt(s, tokens, prompt);
    size_t blocks = tokens / W.bt;
    kvp_status want = KVP_OK;
    size_t bad_layer = SIZE_MAX;
    for (size_t j = 0; j < blocks && want == KVP_OK; j++) {
        for (size_t l = 0; l < W.layers && want == KVP_OK; l++) {
            for (size_t b = 0; b < s->batch && want == KVP_OK; b++) {
                skey key;
                make_key(s->version, l, prompt, tokens, b, j, &key);
                const spage *p = &W.page[s->table[l][b][j]];
                if (p->registered && !key_eq(&p->key, &key)) {
                    want = KVP_PAGE_PUBLISHED;
                    bad_layer = l;
                }
            }
        }
    }
    digests before;
    take_digests(&before);
    kvp_tensor input = kvp_tensor3(prompt, s->batch, tokens, W.d);
    size_t published = 777;
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_sequence_publish_prefix(s->seq, &input, &published, &err);
    check_status(status, want, &err);
    if (status != KVP_OK) {
        CHECK(err.layer == bad_layer, "PagePublished names layer %zu, expected %zu", err.layer,
              bad_layer);
        CHECK(published == 777, "a failed publish wrote *blocks_published");
        check_unchanged(&before);
        return;
    }
    check_untouched(&err);
    CHECK(published == blocks, "published %zu blocks, expected %zu", published, blocks);
    for (size_t j = 0; j < blocks; j++) {
        for (size_t l = 0; l < W.layers; l++) {
            for (size_t b = 0; b < s->batch; b++) {
                skey key;
                make_key(s->version, l, prompt, tokens, b, j, &key);
                spage *p = &W.page[s->table[l][b][j]];
                if (p->registered || index_find(&key) >= 0) {
                    continue;
                }
                p->registered = 1;
                p->key = key;
                for (size_t h = 0; h < W.heads; h++) {
                    for (size_t row = 0; row < W.bt; row++) {
                        memcpy(p->k[h][row], s->kv[l].k[b][h][j * W.bt + row], sizeof p->k[h][row]);
                        memcpy(p->v[h][row], s->kv[l].v[b][h][j * W.bt + row], sizeof p->v[h][row]);
                    }
                }
            }
        }
    }
}

/* Adopt: another sequence's rows (hits), with one more row or not, or random rows. */
void op_seq_adopt(reader *r)
{
    sseq *s = &W.seq[rd(r) % N_SEQS];
    uint8_t how = rd(r);
    uint8_t t_byte = rd(r);
    const sseq *src = &W.seq[how % N_SEQS];
    if (!s->live) {
        return;
    }
    double prompt[MAX_B * (MAX_CAP + 1) * MAX_D];
    size_t tokens;
    if ((how & 8) && src->live && src->kv[0].len > 0) {
        size_t len = src->kv[0].len;
        tokens = len + (how >> 4) % 2;
        for (size_t b = 0; b < s->batch; b++) {
            for (size_t t = 0; t < tokens; t++) {
                double *row = prompt + (b * tokens + t) * W.d;
                if (t < len) {
                    memcpy(row, src->x[t] + (b % src->batch) * W.d, W.d * sizeof *row);
                } else {
                    read_values(r, row, W.d);
                }
            }
        }
    } else {
        tokens = 1 + t_byte % MAX_CAP;
        read_values(r, prompt, s->batch * tokens * W.d);
    }
    g_op_name = "sequence_adopt";
    kvp_status want = s->kv[0].len != 0 ? KVP_INVALID_ARGUMENT : KVP_OK;
    size_t blocks = (tokens - 1) / W.bt;
    if (blocks > s->capacity / W.bt) {
        blocks = s->capacity / W.bt;
    }
    size_t hit_blocks = 0;
    int missed = 0;
    for (; want == KVP_OK && hit_blocks < blocks; hit_blocks++) {
        int hit = 1;
        for (size_t l = 0; l < W.layers && hit; l++) {
            for (size_t b = 0; b < s->batch && hit; b++) {
                skey key;
                make_key(s->version, l, prompt, tokens, b, hit_blocks, &key);
                hit = index_find(&key) >= 0;
            }
        }
        if (!hit) {
            missed = 1;
            break;
        }
    }
    digests before;
    take_digests(&before);
    kvp_tensor input = kvp_tensor3(prompt, s->batch, tokens, W.d);
    size_t adopted = 777;
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_sequence_adopt_prefix(s->seq, &input, &adopted, &err);
    check_status(status, want, &err);
    if (status != KVP_OK) {
        CHECK(adopted == 777, "a failed adopt wrote *tokens_adopted");
        check_unchanged(&before);
        return;
    }
    check_untouched(&err);
    CHECK(adopted == hit_blocks * W.bt, "adopted %zu tokens, expected %zu", adopted,
          hit_blocks * W.bt);
    W.misses += missed;
    for (size_t j = 0; j < hit_blocks; j++) {
        for (size_t l = 0; l < W.layers; l++) {
            for (size_t b = 0; b < s->batch; b++) {
                skey key;
                make_key(s->version, l, prompt, tokens, b, j, &key);
                int id = index_find(&key);
                spage_ref((uint8_t)id);
                s->table[l][b][j] = (uint8_t)id;
                const spage *p = &W.page[id];
                for (size_t h = 0; h < W.heads; h++) {
                    for (size_t row = 0; row < W.bt; row++) {
                        memcpy(s->kv[l].k[b][h][j * W.bt + row], p->k[h][row], sizeof p->k[h][row]);
                        memcpy(s->kv[l].v[b][h][j * W.bt + row], p->v[h][row], sizeof p->v[h][row]);
                    }
                }
            }
        }
        W.hits += W.layers * s->batch;
    }
    for (size_t t = 0; t < adopted; t++) {
        for (size_t b = 0; b < s->batch; b++) {
            memcpy(s->x[t] + b * W.d, prompt + (b * tokens + t) * W.d, W.d * sizeof(double));
        }
    }
    for (size_t l = 0; l < W.layers; l++) {
        s->kv[l].len = adopted;
    }
}

void op_admit(reader *r)
{
    size_t pages = rd(r) % (W.total + 3);
    size_t watermark = rd(r) % 4;
    g_op_name = "pool_admit";
    size_t avail = free_pages(), promised = promised_total();
    kvp_admission want = KVP_ADMIT_LATER;
    if (pages + watermark > W.total) {
        want = KVP_ADMIT_NEVER;
    } else if (avail >= promised && avail - promised >= pages + watermark) {
        want = KVP_ADMIT_NOW;
    }
    kvp_admission got = (kvp_admission)77;
    kvp_error err;
    kvp_status status = kvp_pool_admit(W.pool, pages, watermark, &got, &err);
    check_status(status, KVP_OK, &err);
    CHECK(got == want, "admit(%zu, %zu) = %d, expected %d (free %zu, promised %zu)", pages,
          watermark, (int)got, (int)want, avail, promised);
    /* The same two numbers as lanes and tokens. */
    CHECK(kvp_pool_pages_for(W.pool, watermark, pages) == watermark * blocks_for(pages),
          "pool_pages_for(%zu, %zu) = %zu", watermark, pages,
          kvp_pool_pages_for(W.pool, watermark, pages));
}

static void keep_values(void *ctx, double *values, size_t width)
{
    (void)ctx;
    (void)values;
    (void)width;
}

void op_param_update(reader *r)
{
    int pset = rd(r) % N_PSETS;
    int index = rd(r) % KVP_PARAM_COUNT;
    uint8_t kind = rd(r);
    uint8_t seed = rd(r);
    g_op_name = "param_update";
    kvp_param *param = kvp_layer_param_mut(W.layer[pset].layer, (size_t)index);
    CHECK(param != NULL, "layer %d has no parameter %d", pset, index);
    sparams *p = &W.params[pset];
    size_t n = W.d * W.d;
    kvp_error err;
    kvp_status status;
    if (kind % 4 == 0) {
        /* An update that changes nothing still advances the revision. */
        status = kvp_param_update_with(param, keep_values, NULL, &err);
    } else {
        /* New weights; now and then large ones, so scores can overflow. */
        uint64_t state = 0xabcdull + seed;
        double scale = (kind % 4 == 3 ? 1e150 : 1.0) / sqrt((double)W.d);
        for (size_t i = 0; i < n; i++) {
            p->w[index][i] = scale * unit(&state);
        }
        status = kvp_param_update(param, p->w[index], &err);
    }
    check_status(status, KVP_OK, &err);
    p->version[index]++;
}

/* The decoder: jobs on distinct sequences, or a duplicate that must be refused. */
void op_decoder_step(reader *r)
{
    uint8_t mask = rd(r);
    int dup = rd(r) >= 0xF0;
    kvp_decode_job jobs[N_SEQS + 1];
    int slots[N_SEQS + 1];
    double inputs[N_SEQS + 1][MAX_B * MAX_D];
    double outputs[N_SEQS + 1][MAX_B * MAX_D];
    size_t count = 0;
    for (int i = 0; i < N_SEQS; i++) {
        if ((mask >> i) & 1 && W.seq[i].live) {
            slots[count] = i;
            read_values(r, inputs[count], W.seq[i].batch * W.d);
            count++;
        }
    }
    if (count == 0) {
        return;
    }
    for (size_t j = 0; j < count; j++) {
        /* A job's copy puts an original while another job takes: which page an
         * eviction then finds would depend on timing. Only jobs that take. */
        if (seq_copies(&W.seq[slots[j]]) != 0) {
            return;
        }
    }
    g_op_name = "decoder_step";
    if (dup) {
        slots[count] = slots[0];
        memcpy(inputs[count], inputs[0], sizeof inputs[0]);
        count++;
    }
    seq_expect *se = malloc(count * sizeof *se);
    CHECK(se != NULL, "out of memory in the fuzz target");
    for (size_t j = 0; j < count; j++) {
        sseq *s = &W.seq[slots[j]];
        memset(&jobs[j], 0, sizeof jobs[j]);
        jobs[j].sequence = s->seq;
        jobs[j].input = kvp_tensor3(inputs[j], s->batch, 1, W.d);
        jobs[j].output = outputs[j];
        fill_untouched(outputs[j], MAX_B * MAX_D);
        jobs[j].output_len = s->batch * W.d;
        jobs[j].status = KVP_STATUS_COUNT_;
        (void)expect_token(s, s->kv, inputs[j], &se[j]);
    }
    digests before;
    take_digests(&before);
    kvp_error err;
    kvp_status status = kvp_decoder_step(W.decoder, jobs, count, next_fn(), &W, &err);
    check_status(status, dup ? KVP_INVALID_ARGUMENT : KVP_OK, &err);
    if (dup) {
        for (size_t j = 0; j < count; j++) {
            CHECK(jobs[j].status == KVP_STATUS_COUNT_, "a refused decoder step ran job %zu", j);
        }
        check_unchanged(&before);
        free(se);
        return;
    }
    /*
     * Jobs that fail before their pages are independent of timing. Among the
     * others, the successful ones must fit in the free pages, and each refused
     * one must not have fit in what the successful ones could have left.
     */
    size_t avail = free_pages(), taken = 0;
    for (size_t j = 0; j < count; j++) {
        if (se[j].status != KVP_OK) {
            CHECK(jobs[j].status == se[j].status, "job %zu: status %s, expected %s", j,
                  kvp_status_name(jobs[j].status), kvp_status_name(se[j].status));
            check_seq_failure(&jobs[j].error, &se[j]);
            check_untouched_rows("decoder output", outputs[j], 0, MAX_B * MAX_D);
        } else if (jobs[j].status == KVP_OK) {
            taken += step_pages(&W.seq[slots[j]]);
        } else {
            CHECK(jobs[j].status == KVP_POOL_EXHAUSTED, "job %zu: status %s, expected Ok or "
                  "PoolExhausted", j, kvp_status_name(jobs[j].status));
        }
    }
    CHECK(taken <= avail, "decoder jobs took %zu pages with %zu free", taken, avail);
    for (size_t j = 0; j < count; j++) {
        sseq *s = &W.seq[slots[j]];
        if (se[j].status != KVP_OK) {
            continue;
        }
        size_t pages = step_pages(s);
        if (jobs[j].status == KVP_POOL_EXHAUSTED) {
            CHECK(pages > avail - taken, "job %zu refused %zu pages although %zu stayed free", j,
                  pages, avail - taken);
            CHECK(jobs[j].error.layer == SIZE_MAX, "job %zu: exhausted names layer %zu", j,
                  jobs[j].error.layer);
            check_untouched_rows("decoder output", outputs[j], 0, MAX_B * MAX_D);
            W.exhaustions++;
            continue;
        }
        compare_rows("decoder output", outputs[j], se[j].out, s->batch * W.d);
        seq_step_pages(s, pages);
        consume_promise(s, pages);
        memcpy(s->x[s->kv[0].len], inputs[j], sizeof s->x[0]);
        apply_token(s->kv, s->batch, &se[j]);
    }
    free(se);
}
