/*
 * paged.c: the public paged-attention call (see kvpager/paged.h) for
 * engines that project Q, K and V themselves.
 *
 * Owns: the call's argument checks, its workspace and its hand-off to a
 * decoder's threads. The computation is attention's gather (gather.h), the
 * same three phases, in the same order and with the same finite check
 * between scores and softmax, as incremental.c's attend: so on an attention
 * cache with the layer's heads, scale and candidate rows the outputs are the
 * bits of kvp_attention_prepare's head outputs, and any thread count gives
 * the same bits (gather.h's exact partition).
 *
 * Inputs: f64 queries are read where they are; f32 queries are widened
 * (exactly) into the workspace once. Candidate rows are checked and rounded
 * to the pool's dtype as a commit would store them (incremental.c's rule),
 * in the workspace unless they are f64 rows of an f64 pool, which are read
 * where they are. f64 outputs are written where they go, by the values
 * phase only, which runs after every check; f32 outputs go through the
 * workspace and are rounded once (to nearest, ties to even) at the end.
 *
 * Workspace: one buffer per calling thread (scores [B][H][keys], then the
 * widened queries, candidate rows and f64 outputs when the call needs
 * them), grown by half again whenever a call needs more, so a decode loop
 * whose length grows by one row per step allocates O(log len) times, not
 * once per call. It is freed when the thread exits (a pthread key's
 * destructor; the main thread's when the library unloads, at exit or
 * dlclose, which also deletes the key). The parts a decoder's
 * other threads run read and write the caller's buffer; the decoder's
 * hand-off (a mutex) orders those accesses.
 *
 * Global state: the workspace's pthread key (created once) and the
 * thread-local buffer.
 * Callers: the public API.
 */
#include "kvpager/paged.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "attention/gather.h"
#include "attention/layer_internal.h"
#include "pager/abi.h"
#include "pager/alloc.h"
#include "pager/cache_internal.h"
#include "pager/dtype.h"
#include "pager/error.h"
#include "serve/decoder_internal.h"

/* ---- the per-thread workspace ------------------------------------------------ */

static pthread_once_t workspace_once = PTHREAD_ONCE_INIT;
static pthread_key_t workspace_key;
static int workspace_key_made;
static _Thread_local double *workspace_data;
static _Thread_local size_t workspace_doubles;

static void workspace_release(void *data)
{
    kvpi_free(data);
}

static void workspace_key_create(void)
{
    workspace_key_made = pthread_key_create(&workspace_key, workspace_release) == 0;
}

/*
 * At unload (dlclose, or exit): the key goes, so no thread that exits later
 * calls into unloaded code (a live thread's buffer is then left to the
 * process), and the unloading thread's own buffer is freed.
 */
__attribute__((destructor)) static void workspace_unload(void)
{
    if (workspace_key_made) {
        (void)pthread_key_delete(workspace_key);
        workspace_key_made = 0;
    }
    kvpi_free(workspace_data);
    workspace_data = NULL;
    workspace_doubles = 0;
}

/*
 * This thread's workspace of at least `doubles` doubles (doubles <=
 * SIZE_MAX / sizeof(double)). ALLOCATION_FAILED keeps the old buffer.
 */
static kvp_status workspace_get(size_t doubles, double **out, kvp_error *err)
{
    if (workspace_data != NULL && doubles <= workspace_doubles) {
        *out = workspace_data;
        return KVP_OK;
    }
    size_t grown = workspace_doubles + workspace_doubles / 2;
    size_t want = doubles > grown || grown > SIZE_MAX / sizeof(double) ? doubles : grown;
    pthread_once(&workspace_once, workspace_key_create);
    double *data = workspace_key_made ? kvpi_alloc(KVPI_SITE_SCRATCH, want * sizeof *data) : NULL;
    if (data == NULL || pthread_setspecific(workspace_key, data) != 0) {
        kvpi_free(data);
        return kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_SCRATCH),
                               want * sizeof *data);
    }
    kvpi_free(workspace_data);
    workspace_data = data;
    workspace_doubles = want;
    *out = data;
    return KVP_OK;
}

/* ---- arguments ---------------------------------------------------------------- */

void kvp_paged_attention_args_init(kvp_paged_attention_args *args)
{
    if (args == NULL) {
        return;
    }
    memset(args, 0, sizeof *args);
    args->struct_size = sizeof *args;
    args->io_dtype = KVP_F64;
    args->accum = KVP_ACCUM_EXACT;
}

/* One call's shape: the cache's, the query heads, and the workspace's parts. */
typedef struct paged_shape {
    size_t batch;
    size_t heads;    /* H */
    size_t kv_heads; /* H_kv */
    size_t width;    /* d_h */
    size_t keys;     /* scores per (lane, head): len, + 1 with a candidate */
    kvp_dtype pool_dtype;
    double scale;
    /* Workspace offsets, in doubles, and its size; SIZE_MAX: not used. */
    size_t at_queries;
    size_t at_candidates; /* keys, then values */
    size_t at_outputs;
    size_t doubles;
} paged_shape;

/* *sum += a * b, or 0 when that overflows a workspace's size in doubles. */
static int add_product(size_t *sum, size_t a, size_t b)
{
    size_t limit = SIZE_MAX / sizeof(double);
    if (b != 0 && a > limit / b) {
        return 0;
    }
    if (a * b > limit - *sum) {
        return 0;
    }
    *sum += a * b;
    return 1;
}

/* NULL_ARGUMENT, then INVALID_ARGUMENT ("struct_size"); copies what the caller's struct covers. */
static kvp_status read_args(const kvp_paged_attention_args *args, kvp_paged_attention_args *out,
                            kvp_error *err)
{
    if (args == NULL) {
        return kvpi_fail_null(err, "args");
    }
    kvp_status status = kvpi_struct_size_check(args->struct_size, sizeof *args, err);
    if (status == KVP_OK) {
        status = kvpi_struct_tail_check(args, args->struct_size, sizeof *args, err);
    }
    if (status == KVP_OK) {
        memcpy(out, args, sizeof *out);
    }
    return status;
}

static kvp_status check_pointers(const kvp_paged_attention_args *a, kvp_error *err)
{
    if (a->cache == NULL) {
        return kvpi_fail_null(err, "cache");
    }
    if (a->queries == NULL) {
        return kvpi_fail_null(err, "queries");
    }
    if (a->outputs == NULL) {
        return kvpi_fail_null(err, "outputs");
    }
    return KVP_OK;
}

/* INVALID_ARGUMENT for every field of the contract, in the header's order. */
static kvp_status check_fields(const kvp_paged_attention_args *a, const kvp_cache_info *info,
                               kvp_error *err)
{
    size_t heads = a->heads != 0 ? a->heads : kvpi_cache_query_heads(a->cache);
    if (heads == 0 || heads % info->binding.kv_heads != 0) {
        return kvpi_fail_invalid(err, "heads", "must be a multiple of the cache's KV heads");
    }
    if (a->io_dtype != KVP_F64 && a->io_dtype != KVP_F32) {
        return kvpi_fail_invalid(err, "io_dtype", "must be KVP_F64 or KVP_F32");
    }
    if (a->accum != KVP_ACCUM_EXACT && a->accum != KVP_ACCUM_FAST) {
        return kvpi_fail_invalid(err, "accum", "must be KVP_ACCUM_EXACT or KVP_ACCUM_FAST");
    }
    if ((a->keys == NULL) != (a->values == NULL)) {
        return kvpi_fail_invalid(err, a->keys == NULL ? "keys" : "values",
                                 "keys and values are both NULL or both set");
    }
    if (!isfinite(a->scale) || a->scale < 0) {
        return kvpi_fail_invalid(err, "scale", "must be finite and not negative");
    }
    if (info->len == 0 && a->keys == NULL) {
        return kvpi_fail_invalid(err, "keys", "the cache is empty and there is no candidate");
    }
    return KVP_OK;
}

/*
 * The workspace's layout: scores, then what the call cannot read or write
 * where the caller keeps it. ALLOCATION_FAILED when it cannot be sized.
 */
static kvp_status plan_workspace(const kvp_paged_attention_args *a, paged_shape *s,
                                 kvp_error *err)
{
    size_t n = 0;
    size_t head_rows = 0;
    int ok = add_product(&head_rows, s->batch, s->heads) && add_product(&n, head_rows, s->keys);
    s->at_queries = s->at_candidates = s->at_outputs = SIZE_MAX;
    if (ok && a->io_dtype == KVP_F32) {
        s->at_queries = n;
        ok = add_product(&n, head_rows, s->width);
        s->at_outputs = n;
        ok = ok && add_product(&n, head_rows, s->width);
    }
    if (ok && a->keys != NULL && (a->io_dtype == KVP_F32 || s->pool_dtype != KVP_F64)) {
        s->at_candidates = n;
        ok = add_product(&n, 2 * s->batch * s->kv_heads, s->width);
    }
    s->doubles = n;
    return ok ? KVP_OK : kvpi_fail_alloc(err, kvpi_fault_site_name(KVPI_SITE_SCRATCH), SIZE_MAX);
}

/* Every check the header lists before the computation, and the call's shape. */
static kvp_status check_args(const kvp_paged_attention_args *a, paged_shape *s, kvp_error *err)
{
    kvp_status status = check_pointers(a, err);
    kvp_cache_info info;
    kvp_cache_info_init(&info);
    if (status == KVP_OK) {
        status = kvp_cache_info_get(a->cache, &info, err);
    }
    if (status == KVP_OK) {
        status = check_fields(a, &info, err);
    }
    if (status == KVP_OK && !kvpi_cache_has_data(a->cache)) {
        status = kvpi_pool_fail_no_data(err); /* a reserved pool's pages hold no rows */
    }
    if (status != KVP_OK) {
        return status;
    }
    s->batch = info.batch_size;
    s->heads = a->heads != 0 ? a->heads : kvpi_cache_query_heads(a->cache);
    s->kv_heads = info.binding.kv_heads;
    s->width = info.binding.head_width;
    s->keys = info.len + (a->keys != NULL);
    s->pool_dtype = kvpi_cache_dtype(a->cache);
    s->scale = a->scale != 0 ? a->scale : 1.0 / sqrt((double)s->width);
    return plan_workspace(a, s, err);
}

/* ---- the computation ------------------------------------------------------------- */

/*
 * The candidate rows as the pool would store them, into the job: checked
 * (NONFINITE_KEY, then NONFINITE_VALUE, as an append's) and rounded.
 */
static kvp_status prepare_candidates(const kvp_paged_attention_args *a, const paged_shape *s,
                                     double *ws, kvpi_gather_job *job, kvp_error *err)
{
    size_t n = s->batch * s->kv_heads * s->width;
    const double *keys = a->keys;
    const double *values = a->values;
    if (s->at_candidates != SIZE_MAX) {
        double *k = ws + s->at_candidates;
        kvpi_dtype_load(a->io_dtype, a->keys, k, n);
        kvpi_dtype_load(a->io_dtype, a->values, k + n, n);
        keys = k;
        values = k + n;
    }
    kvp_status status = kvpi_cache_check_stored(a->cache, keys, n, KVP_NONFINITE_KEY, err);
    if (status == KVP_OK) {
        status = kvpi_cache_check_stored(a->cache, values, n, KVP_NONFINITE_VALUE, err);
    }
    if (status == KVP_OK && s->at_candidates != SIZE_MAX) {
        kvpi_cache_round_rows(a->cache, 0, ws + s->at_candidates, n);
        kvpi_cache_round_rows(a->cache, 1, ws + s->at_candidates + n, n);
    }
    job->keys = keys;
    job->values = values;
    return status;
}

typedef struct paged_run {
    kvpi_gather_job job;
    kvp_status status;
    kvp_error err;
} paged_run;

/* The step on `par` (NULL: this thread), as incremental.c's attend; a decoder's solo job. */
static void paged_attend(void *ctx, const kvpi_parallel *par)
{
    paged_run *run = ctx;
    kvpi_gather_scores_on(&run->job, par);
    run->status = kvpi_gather_check_scores(&run->job, &run->err);
    if (run->status != KVP_OK) {
        return;
    }
    kvpi_gather_softmax_on(&run->job, par);
    kvpi_gather_values_on(&run->job, par);
}

static void store_f32(float *out, const double *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        out[i] = (float)x[i];
    }
}

kvp_status kvp_paged_attention(const kvp_paged_attention_args *args, kvp_decoder *threads,
                               kvp_error *err)
{
    kvp_paged_attention_args a;
    paged_shape s;
    double *ws = NULL;
    kvp_status status = read_args(args, &a, err);
    if (status == KVP_OK) {
        status = check_args(&a, &s, err);
    }
    if (status == KVP_OK) {
        status = workspace_get(s.doubles, &ws, err);
    }
    if (status != KVP_OK) {
        return status;
    }
    size_t head_elements = s.batch * s.heads * s.width;
    paged_run run = {
        .job = {.cache = a.cache,
                .queries = a.queries,
                .scale = s.scale,
                .weights = ws,
                .outputs = a.outputs,
                .heads = s.heads,
                .accum = a.accum},
        .status = KVP_OK,
    };
    if (a.io_dtype == KVP_F32) {
        kvpi_dtype_load(KVP_F32, a.queries, ws + s.at_queries, head_elements);
        run.job.queries = ws + s.at_queries;
        run.job.outputs = ws + s.at_outputs;
    }
    if (a.keys != NULL) {
        status = prepare_candidates(&a, &s, ws, &run.job, err);
    }
    if (status == KVP_OK && threads != NULL) {
        status = kvpi_decoder_run(threads, paged_attend, &run, err);
    } else if (status == KVP_OK) {
        paged_attend(&run, NULL);
    }
    if (status == KVP_OK && run.status != KVP_OK) {
        status = kvpi_error_emit(err, &run.err);
    }
    if (status == KVP_OK && a.io_dtype == KVP_F32) {
        store_f32(a.outputs, run.job.outputs, head_elements);
    }
    return status;
}
