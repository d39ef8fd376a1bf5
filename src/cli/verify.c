/*
 * verify.c: `kvpager simulate --verify` (verify.h has the contract) and the
 * run's weight updates.
 *
 * Owns: the kept outputs and token epochs of chosen requests, the private
 * pool, model and sequence the recompute runs on, and the counts it
 * reports. The private model is the run's model regenerated from the seed
 * (kvp_sim_model_create) and moved forward one update at a time
 * (kvp_sim_update_weights, the same function the run applies); a segment of
 * an older epoch than the model's makes it again from the seed, so no
 * revision's weights are ever stored.
 * Invariants: a request's segments run in increasing epoch, all samples of
 * an epoch before the next, so one request moves the private model only
 * forward; the sequence is made again after every move (its caches are
 * bound to the revisions they were made under).
 * Callers: sim.c (sim.h's run). Public headers only.
 */
#include "verify.h"

#include <string.h>

#include "alloc.h"
#include "cli.h"

#ifdef KVP_SIM_TEST_HOOKS
kvp_sim_test_flip kvp_sim_test_flip_one = {.request = SIZE_MAX};
#endif

/* What one weight update adds to a parameter: a seeded perturbation in [-1e-3, 1e-3). */
typedef struct perturbation {
    uint64_t seed;
    size_t count; /* rows x cols */
} perturbation;

static void perturb(void *ctx, double *values, size_t width)
{
    (void)width;
    const perturbation *p = ctx;
    uint64_t state = p->seed;
    for (size_t i = 0; i < p->count; i++) {
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        values[i] += ((double)(z >> 11) * 0x1.0p-53 * 2.0 - 1.0) * 1e-3;
    }
}

kvp_status kvp_sim_model_create(const kvp_sim_config *c, kvp_model **out, kvp_error *err)
{
    kvp_model *model = NULL;
    kvp_status status = c->window != 0
                            ? kvp_sim_windowed_model_create(c, &model, err)
                            : kvp_model_create_random_grouped(c->layers, c->model_width,
                                                              c->heads, kvp_sim_kv_heads(c),
                                                              c->capacity, 10000.0, c->seed,
                                                              &model, err);
    if (status == KVP_OK) {
        status = kvp_model_set_accum(model, c->accum, err);
    }
    if (status != KVP_OK) {
        if (model != NULL) {
            (void)kvp_model_destroy(model, NULL);
        }
        return status;
    }
    *out = model;
    return KVP_OK;
}

int kvp_sim_update_weights(kvp_model *model, const kvp_sim_config *c, size_t epoch,
                           kvp_error *err)
{
    for (size_t layer = 0; layer < c->layers; layer++) {
        for (size_t index = 0; index < KVP_PARAM_COUNT; index++) {
            kvp_param *param = kvp_model_param_mut(model, layer, index);
            perturbation p = {
                .seed = c->seed ^ (0xA0761D6478BD642Full * epoch) ^
                        (0xE7037ED1A0B428DBull * (layer * KVP_PARAM_COUNT + index + 1)),
                .count = kvp_param_rows(param) * kvp_param_cols(param)};
            if (kvp_param_update_with(param, perturb, &p, err) != KVP_OK) {
                return -1;
            }
        }
    }
    return 0;
}

/* Checked a * b and a + b that latch *overflow. */
static size_t mul(size_t a, size_t b, int *overflow)
{
    size_t out = SIZE_MAX;
    *overflow |= kvp_cli_mul(a, b, &out) != 0;
    return out;
}

static size_t add(size_t a, size_t b, int *overflow)
{
    size_t out = SIZE_MAX;
    *overflow |= kvp_cli_add(a, b, &out) != 0;
    return out;
}

size_t kvp_sim_verify_bytes(const kvp_sim_config *c, size_t requests, size_t page_bytes,
                            size_t model_bytes, int *overflow)
{
    if (c->verify_every == 0 || !c->compute) {
        return 0;
    }
    size_t d = c->model_width;
    size_t blocks = c->capacity / c->block_tokens + 1;
    size_t pool = mul(mul(c->layers, blocks, overflow), page_bytes, overflow);
    size_t buffers = mul(mul(2 * sizeof(double), c->capacity, overflow), d, overflow);
    size_t chosen = requests / c->verify_every + 1;
    size_t per_token = add(mul(d, sizeof(double), overflow), sizeof(size_t), overflow);
    size_t kept = mul(mul(mul(chosen, c->samples, overflow), c->capacity, overflow), per_token,
                      overflow);
    return add(add(model_bytes, pool, overflow), add(buffers, kept, overflow), overflow);
}

int kvp_sim_verifier_init(kvp_sim_verifier *v, const kvp_sim_config *c, size_t count,
                          size_t page_bytes, kvp_error *err, const char **context)
{
    memset(v, 0, sizeof *v);
    v->config = c;
    v->count = count;
    v->kept = kvp_cli_calloc(count, sizeof *v->kept);
    size_t rows = c->capacity * c->model_width;
    v->rows = kvp_cli_alloc(rows, sizeof(double));
    v->out = kvp_cli_alloc(rows, sizeof(double));
    if (v->kept == NULL || v->rows == NULL || v->out == NULL) {
        *err = (kvp_error){.status = KVP_ALLOCATION_FAILED, .what = "the verification buffers",
                           .bytes = count * sizeof *v->kept + 2 * rows * sizeof(double)};
        *context = "out of memory";
        return -1;
    }
    kvp_pool_config pool_config;
    kvp_pool_config_init(&pool_config);
    pool_config.block_tokens = c->block_tokens;
    pool_config.heads = kvp_sim_kv_heads(c);
    pool_config.head_width = c->model_width / c->heads;
    pool_config.dtype = c->kv_dtype;
    size_t blocks = c->capacity / c->block_tokens + (c->capacity % c->block_tokens != 0);
    pool_config.budget_bytes = c->layers * blocks * page_bytes;
    if (kvp_pool_create(&pool_config, &v->pool, err) != KVP_OK) {
        *context = "creating the verification pool";
        return -1;
    }
    return 0;
}

size_t kvp_sim_verifier_token(kvp_sim_verifier *v, size_t i, const kvp_workload_request *r,
                              size_t sample, size_t token, size_t epoch, const double *output)
{
    size_t width = v->config->model_width;
    size_t tokens = v->config->samples * r->output_tokens;
    kvp_sim_kept *k = &v->kept[i];
    if (k->outputs == NULL) {
        k->outputs = kvp_cli_calloc(tokens * width, sizeof(double));
        k->epochs = kvp_cli_alloc(tokens, sizeof(size_t));
        if (k->outputs == NULL || k->epochs == NULL) {
            kvp_cli_free(k->outputs);
            kvp_cli_free(k->epochs);
            *k = (kvp_sim_kept){NULL, NULL};
            return tokens * (width * sizeof(double) + sizeof(size_t));
        }
        for (size_t t = 0; t < tokens; t++) {
            k->epochs[t] = SIZE_MAX;
        }
    }
    size_t at = sample * r->output_tokens + token;
#ifdef KVP_SIM_TEST_HOOKS
    kvp_sim_test_flip *f = &kvp_sim_test_flip_one;
    if (f->drop && i == f->request && sample == f->sample && token == f->token) {
        f->epoch = epoch;
        f->flipped = 1;
        return 0; /* as if this output never came */
    }
#endif
    memcpy(k->outputs + at * width, output, width * sizeof(double));
    k->epochs[at] = epoch;
#ifdef KVP_SIM_TEST_HOOKS
    if (!f->drop && i == f->request && sample == f->sample && token == f->token) {
        uint64_t bits;
        memcpy(&bits, k->outputs + at * width, sizeof bits);
        bits ^= 1;
        memcpy(k->outputs + at * width, &bits, sizeof bits);
        f->epoch = epoch;
        f->flipped = 1;
    }
#endif
    return 0;
}

/* The smallest epoch at least `from` among `n` kept tokens; SIZE_MAX when none. */
static size_t next_epoch(const size_t *epochs, size_t n, size_t from)
{
    size_t next = SIZE_MAX;
    for (size_t t = 0; t < n; t++) {
        next = epochs[t] >= from && epochs[t] < next ? epochs[t] : next;
    }
    return next;
}

/*
 * Brings the private model to `epoch` (made again from the seed when it is
 * past it) and makes a sequence bound to it.
 */
static int model_at(kvp_sim_verifier *v, size_t epoch, kvp_error *err, const char **context)
{
    const kvp_sim_config *c = v->config;
    if (v->model != NULL && v->model_epoch != epoch && v->sequence != NULL) {
        kvp_sequence_destroy(v->sequence, NULL); /* bound to the model's current revisions */
        v->sequence = NULL;
    }
    if (v->model != NULL && v->model_epoch > epoch) {
        kvp_model_destroy(v->model, NULL);
        v->model = NULL;
    }
    if (v->model == NULL) {
        v->model_epoch = 0;
        if (kvp_sim_model_create(c, &v->model, err) != KVP_OK) {
            *context = "creating the verification model";
            return -1;
        }
    }
    for (; v->model_epoch < epoch; v->epochs_replayed++) {
        if (kvp_sim_update_weights(v->model, c, ++v->model_epoch, err) != 0) {
            *context = "replaying a weight update for verification";
            return -1;
        }
    }
    if (v->sequence == NULL && kvp_sequence_create(v->model, v->pool, 1, c->capacity,
                                                   &v->sequence, err) != KVP_OK) {
        *context = "creating the verification sequence";
        return -1;
    }
    return 0;
}

/*
 * One segment: prefills `sample`'s rows up to its last token of `epoch` on
 * the private sequence and compares each token of that epoch.
 */
static int segment(kvp_sim_verifier *v, const kvp_sim_kept *k, const kvp_workload_request *r,
                   size_t sample, size_t epoch, kvp_sim_row_fn row, void *ctx, kvp_error *err)
{
    size_t width = v->config->model_width;
    const size_t *epochs = k->epochs + sample * r->output_tokens;
    const double *kept = k->outputs + sample * r->output_tokens * width;
    size_t last = SIZE_MAX;
    for (size_t t = 0; t < r->output_tokens; t++) {
        last = epochs[t] == epoch ? t : last;
    }
    if (last == SIZE_MAX) {
        return 0;
    }
    size_t tokens = r->prompt_tokens + last + 1;
    for (size_t t = 0; t < tokens; t++) {
        row(ctx, sample, t, v->rows + t * width, width);
    }
    kvp_tensor rows = kvp_tensor3(v->rows, 1, tokens, width);
    if (kvp_sequence_reset(v->sequence, err) != KVP_OK ||
        kvp_sequence_prefill(v->sequence, &rows, NULL, NULL, v->out, tokens * width, err) !=
            KVP_OK) {
        return -1;
    }
    v->segments++;
    for (size_t t = 0; t <= last; t++) {
        const double *fresh = v->out + (r->prompt_tokens + t) * width;
        if (epochs[t] == epoch && memcmp(fresh, kept + t * width, width * sizeof(double)) != 0) {
            v->mismatches++;
        }
    }
    return 0;
}

int kvp_sim_verifier_check(kvp_sim_verifier *v, size_t i, const kvp_workload_request *r,
                           kvp_sim_row_fn row, void *ctx, kvp_error *err, const char **context)
{
    kvp_sim_kept *k = &v->kept[i];
    size_t samples = v->config->samples;
    size_t n = samples * r->output_tokens;
    int status = 0;
    if (k->outputs == NULL) {
        return 0;
    }
    for (size_t e = next_epoch(k->epochs, n, 0); e != SIZE_MAX && status == 0;
         e = next_epoch(k->epochs, n, e + 1)) {
        status = model_at(v, e, err, context);
        for (size_t sample = 0; sample < samples && status == 0; sample++) {
            if (segment(v, k, r, sample, e, row, ctx, err) != 0) {
                *context = "verifying a request";
                status = -1;
            }
        }
    }
    if (status == 0) {
        for (size_t t = 0; t < n; t++) {
            v->mismatches += k->epochs[t] == SIZE_MAX; /* an output that never came */
        }
        v->verified += samples;
    }
    kvp_cli_free(k->outputs);
    kvp_cli_free(k->epochs);
    *k = (kvp_sim_kept){NULL, NULL};
    return status;
}

void kvp_sim_verifier_free(kvp_sim_verifier *v, size_t *audit_failures)
{
    if (v->sequence != NULL) {
        kvp_sequence_destroy(v->sequence, NULL);
    }
    if (v->model != NULL) {
        kvp_model_destroy(v->model, NULL);
    }
    if (v->pool != NULL && kvp_pool_destroy(v->pool, NULL) != KVP_OK) {
        (*audit_failures)++;
    }
    if (v->kept != NULL) {
        for (size_t i = 0; i < v->count; i++) {
            kvp_cli_free(v->kept[i].outputs);
            kvp_cli_free(v->kept[i].epochs);
        }
    }
    kvp_cli_free(v->kept);
    kvp_cli_free(v->rows);
    kvp_cli_free(v->out);
    memset(v, 0, sizeof *v);
}
