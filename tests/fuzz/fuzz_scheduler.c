/*
 * fuzz_scheduler.c: a libFuzzer target over the continuous-batching
 * scheduler (kvpager/scheduler.h) and, on the same pool, direct sequence
 * sharing (fork, truncate, adopt, publish: kvpager/sequence.h).
 *
 * Owns nothing but its own world; checks the public contracts only:
 *   - the input decodes a world (model geometry, pool size, block size, the
 *     scheduler's config: compute, sharing, schedule, watermark, reserve,
 *     max_running, sessions) and a script of operations: submits (samples,
 *     sessions, prompts that continue an earlier request's prompt and a
 *     sample's reply, rows given as an array or by the input callback, and
 *     refused submits), steps, collects (cap 0 with NULL too), weight
 *     updates, and direct sequences that adopt, prefill, publish, fork,
 *     truncate, step and are destroyed between the scheduler's steps;
 *     with bit 6 of the model byte, sliding layers: each layer's window
 *     and sinks from one byte (W = 1, block edges, W >= capacity, sinks 0,
 *     1 or a block), so every operation runs over front truncation's null
 *     entries, and a direct truncate into released blocks must be refused
 *     (BlockReleased, its detail checked, the length unchanged);
 *   - after every operation: kvp_pool_check (I1 to I5), the step's stats
 *     against the pool's and the scheduler's, retained pages within the
 *     session cap and within the pages held, the session counts
 *     (keeps = hits + drops + kept now), refused calls changing nothing;
 *   - every decoded token is seen once, and its output is bit for bit a
 *     fresh sequence's (another pool) prefilled with the same rows under the
 *     weights it was decoded with (checked before each weight update, at
 *     collect and at the end); every direct prefill and step likewise;
 *   - every finished request's result: complete with every token, rejected
 *     only when it can never fit, failed only with POOL_EXHAUSTED when
 *     direct sequences hold pages of the pool;
 *   - teardown gives every page back.
 * Any mismatch prints `kvpager fuzz_scheduler: MISMATCH at op N (name)`
 * and aborts. Built only by the `fuzz` preset (tests/fuzz/README.md).
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpager/kvpager.h"
#include "pager/alloc.h" /* the fault injector: a step's allocations fail one at a time */

#define FUZZ_WORLD_TARGET "fuzz_scheduler"
#include "fuzz_world.h" /* the failure report, CHECK, the reader, on_mismatch, the pool */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_D 8
#define MAX_CAP 24
#define MAX_POSITIONS 32
#define MAX_REQ 40
#define MAX_SAMPLES 3
#define N_DIRECT 3
#define MAX_OPS 240
#define PSEUDO 4 /* direct sources of their own rows: ids MAX_REQ .. MAX_REQ + PSEUDO - 1 */

/* ---- failure reporting ------------------------------------------------- */

static void check_status(kvp_status got, kvp_status want, const kvp_error *err)
{
    if (got != want) {
        char text[256] = "";
        if (err != NULL && got != KVP_OK) {
            (void)kvp_error_format(err, text, sizeof text);
        }
        fail("status %s, expected %s (%s)", kvp_status_name(got), kvp_status_name(want), text);
    }
}

/* ---- the world ---------------------------------------------------------- */

/* A request as the fuzzer submitted it, and what its callbacks saw. */
typedef struct req {
    int live;      /* submitted, not collected */
    int finished;  /* collected */
    size_t prompt;
    size_t new_tokens;
    size_t samples;
    uint64_t session;
    uint64_t parent;     /* its first `upto` rows are parent's (sample parent_sample) */
    size_t parent_sample;
    size_t upto;
    double rows[MAX_CAP * MAX_D]; /* the prompt array, when given */
    double out[MAX_SAMPLES][MAX_CAP][MAX_D];
    unsigned char seen[MAX_SAMPLES][MAX_CAP];
    unsigned char verified[MAX_SAMPLES][MAX_CAP];
    uint32_t epoch[MAX_SAMPLES][MAX_CAP];
    size_t tokens[MAX_SAMPLES];
} req;

/* A sequence the fuzzer drives itself on the scheduler's pool. */
typedef struct direct {
    kvp_sequence *seq;
    uint64_t source; /* its rows are source's (sample source_sample) */
    size_t source_sample;
    uint32_t epoch;  /* the weights its caches are bound to */
} direct;

typedef struct world {
    size_t d, heads, kv_heads, hd, layers, bt, pages, threads, cap;
    kvp_scheduler_config config;
    size_t kept_cap;
    kvp_model *model;
    kvp_pool *pool;
    kvp_pool *ref_pool; /* the fresh sequences of the bit-for-bit checks */
    kvp_decoder *decoder;
    kvp_scheduler *scheduler;
    req r[MAX_REQ];
    size_t submitted;
    direct dir[N_DIRECT];
    int direct_used; /* a direct sequence has held pages: requests may fail for pages */
    int job_faulted; /* an injected fault hit a step that went on: a job may have failed */
    uint32_t epoch;  /* weight updates so far */
    size_t window[2], sinks[2]; /* each layer's (W, S): 0 = full (kvp_layer_set_window) */
    int windowed;               /* some layer slides */
} world;

static world W;

/* Deterministic rows in [-1, 1]: a function of (key, sample, position). */
static void mix_row(uint64_t key, size_t sample, size_t position, double *row)
{
    for (size_t i = 0; i < W.d; i++) {
        uint64_t z = key * 0x9e3779b97f4a7c15u + sample * 0xbf58476d1ce4e5b9u +
                     position * 0x94d049bb133111ebu + i * 0x2545f4914f6cdd1du;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
        z ^= z >> 31;
        row[i] = (double)(z >> 11) * 0x1.0p-52 - 1.0;
    }
}

/*
 * The row of (id, sample, position): a request's first `upto` rows are its
 * parent's (a continued conversation, a shared prefix), its other prompt
 * rows its own (every sample's), then each sample's own. Pseudo ids (direct
 * sources) have rows of their own.
 */
static void row_of(uint64_t id, size_t sample, size_t position, double *row)
{
    while (id < MAX_REQ && position < W.r[id].upto) {
        sample = W.r[id].parent_sample;
        id = W.r[id].parent;
    }
    if (id >= MAX_REQ) {
        mix_row(id, sample, position, row);
    } else if (position < W.r[id].prompt) {
        mix_row(id, 0, position, row);
    } else {
        mix_row(id, sample + 1, position, row);
    }
}

static void input_cb(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                     size_t width)
{
    (void)ctx;
    CHECK(id < W.submitted && W.r[id].live, "input for request %llu", (unsigned long long)id);
    CHECK(width == W.d, "input width %zu", width);
    CHECK(sample < W.r[id].samples, "input sample %zu", sample);
    CHECK(position < W.r[id].prompt + W.r[id].new_tokens, "input position %zu", position);
    CHECK(position >= W.r[id].prompt || sample == 0, "prompt row asked for sample %zu", sample);
    row_of(id, sample, position, row);
}

static void token_cb(void *ctx, uint64_t id, size_t sample, size_t position,
                     const double *output, size_t width)
{
    (void)ctx;
    CHECK(id < W.submitted && W.r[id].live, "token of request %llu", (unsigned long long)id);
    req *q = &W.r[id];
    CHECK(width == W.d && sample < q->samples, "token width %zu sample %zu", width, sample);
    CHECK(position >= q->prompt && position < q->prompt + q->new_tokens,
          "token of request %llu at position %zu (prompt %zu, budget %zu)",
          (unsigned long long)id, position, q->prompt, q->new_tokens);
    CHECK(!q->seen[sample][position], "token (%llu, %zu, %zu) decoded twice",
          (unsigned long long)id, sample, position);
    q->seen[sample][position] = 1;
    q->epoch[sample][position] = W.epoch;
    memcpy(q->out[sample][position], output, width * sizeof *output);
    q->tokens[sample]++;
}

static kvp_pool_stats pool_stats(kvp_pool *pool)
{
    kvp_pool_stats st;
    kvp_pool_stats_init(&st);
    kvp_error err;
    check_status(kvp_pool_stats_get(pool, &st, &err), KVP_OK, &err);
    return st;
}

static kvp_scheduler_stats sched_stats(void)
{
    kvp_scheduler_stats st;
    kvp_scheduler_stats_init(&st);
    kvp_error err;
    check_status(kvp_scheduler_stats_get(W.scheduler, &st, &err), KVP_OK, &err);
    return st;
}

/* ---- bit-for-bit references ------------------------------------------- */

/*
 * The outputs of a fresh sequence (on the reference pool, current weights)
 * prefilled with rows [0, len) of (id, sample): out[len][d].
 */
static void reference(uint64_t id, size_t sample, size_t len, double *out)
{
    static double rows[MAX_CAP * MAX_D];
    for (size_t t = 0; t < len; t++) {
        row_of(id, sample, t, rows + t * W.d);
    }
    kvp_sequence *seq = NULL;
    kvp_error err;
    check_status(kvp_sequence_create(W.model, W.ref_pool, 1, W.cap, &seq, &err), KVP_OK, &err);
    kvp_tensor input = kvp_tensor3(rows, 1, len, W.d);
    check_status(kvp_sequence_prefill(seq, &input, NULL, NULL, out, len * W.d, &err), KVP_OK,
                 &err);
    check_status(kvp_sequence_destroy(seq, &err), KVP_OK, &err);
}

/* Every token of request id decoded under the current weights and not yet checked. */
static void verify_request(uint64_t id)
{
    req *q = &W.r[id];
    static double out[MAX_CAP * MAX_D];
    for (size_t k = 0; k < q->samples; k++) {
        size_t len = 0;
        for (size_t p = q->prompt; p < q->prompt + q->new_tokens; p++) {
            if (q->seen[k][p] && !q->verified[k][p] && q->epoch[k][p] == W.epoch) {
                len = p + 1;
            }
        }
        if (len == 0) {
            continue;
        }
        reference(id, k, len, out);
        for (size_t p = q->prompt; p < len; p++) {
            if (q->seen[k][p] && !q->verified[k][p] && q->epoch[k][p] == W.epoch) {
                CHECK(memcmp(q->out[k][p], out + p * W.d, W.d * sizeof(double)) == 0,
                      "request %llu sample %zu position %zu: output differs from a fresh "
                      "sequence's (%.17g vs %.17g)",
                      (unsigned long long)id, k, p, q->out[k][p][0], out[p * W.d]);
                q->verified[k][p] = 1;
            }
        }
    }
}

static void verify_all(void)
{
    if (!W.config.compute) {
        return;
    }
    for (uint64_t id = 0; id < W.submitted; id++) {
        verify_request(id);
    }
}

/* ---- checks after every operation -------------------------------------- */

static void check_world(void)
{
    kvp_error err;
    check_status(kvp_pool_check(W.pool, on_mismatch, NULL, &err), KVP_OK, &err);
    kvp_pool_stats pool = pool_stats(W.pool);
    kvp_scheduler_stats s = sched_stats();
    CHECK(s.retained_pages <= W.kept_cap, "retained pages %zu above the cap %zu",
          s.retained_pages, W.kept_cap);
    CHECK(s.retained_pages <= pool.held_pages, "retained pages %zu, the pool holds %zu",
          s.retained_pages, pool.held_pages);
    CHECK(s.session_keeps == s.session_hits + s.session_drops + s.retained,
          "session keeps %llu != hits %llu + drops %llu + kept %zu",
          (unsigned long long)s.session_keeps, (unsigned long long)s.session_hits,
          (unsigned long long)s.session_drops, s.retained);
    CHECK(s.submitted == W.submitted, "submitted %llu, the fuzzer %zu",
          (unsigned long long)s.submitted, W.submitted);
    CHECK(s.prefix_hit_tokens <= s.prompt_tokens, "hit tokens above prompt tokens");
    static int trace = -1;
    if (trace < 0) {
        trace = getenv("KVP_FUZZ_TRACE") != NULL;
    }
    if (trace) {
        fprintf(stderr,
                "op %zu %s: running %zu waiting %zu completed %llu rejected %llu failed %llu "
                "hit tokens %llu kept %zu (%zu pages) keeps %llu hits %llu drops %llu; pool "
                "held %zu evictable %zu\n",
                g_op_index, g_op_name, s.running, s.waiting, (unsigned long long)s.completed,
                (unsigned long long)s.rejected, (unsigned long long)s.failed,
                (unsigned long long)s.prefix_hit_tokens, s.retained, s.retained_pages,
                (unsigned long long)s.session_keeps, (unsigned long long)s.session_hits,
                (unsigned long long)s.session_drops, pool.held_pages, pool.evictable_pages);
    }
}

/* ---- operations ------------------------------------------------------- */

static void op_submit(reader *r)
{
    g_op_name = "submit";
    if (W.submitted == MAX_REQ) {
        return;
    }
    uint64_t id = W.submitted;
    req *q = &W.r[id];
    memset(q, 0, sizeof *q);
    uint8_t a = rd(r);
    uint8_t b = rd(r);
    uint8_t c = rd(r);
    uint8_t e = rd(r);
    uint8_t f = rd(r);
    q->prompt = 1 + a % (W.cap - 1);
    size_t room = W.cap - q->prompt;
    q->new_tokens = 1 + b % (room < 8 ? room : 8);
    q->samples = 1 + (b >> 4) % MAX_SAMPLES;
    q->session = c % 4;
    q->parent = MAX_REQ; /* none */
    if (id > 0 && (c & 0x80)) {
        /* continues an earlier request: its prompt and (part of) a sample's reply */
        q->parent = e % id;
        const req *p = &W.r[q->parent];
        q->parent_sample = (e >> 5) % p->samples;
        size_t len = p->prompt + p->new_tokens;
        size_t upto = len < q->prompt ? len : q->prompt;
        q->upto = (c & 0x40) ? upto : 1 + f % upto;
    }
    kvp_request request;
    kvp_request_init(&request);
    request.prompt_tokens = q->prompt;
    request.max_new_tokens = q->new_tokens;
    request.samples = q->samples;
    request.session = q->session;
    request.on_token = token_cb;
    request.input = input_cb;
    int use_array = (c >> 4) & 1;
    if (use_array) {
        for (size_t t = 0; t < q->prompt; t++) {
            row_of(id, 0, t, q->rows + t * W.d);
        }
        request.prompt = q->rows;
    }
    if (!W.config.compute && (c & 0x20) && !use_array) {
        request.input = NULL; /* allocator-only: no rows at all */
    }
    /* Now and then a refused submit first: nothing changes, no id used. */
    kvp_status want = KVP_OK;
    kvp_request bad = request;
    switch ((a >> 5) % 8) {
    case 1:
        bad.prompt_tokens = 0;
        want = KVP_INVALID_ARGUMENT;
        break;
    case 2:
        bad.samples = (a & 1) ? 0 : 257;
        want = KVP_INVALID_ARGUMENT;
        break;
    case 3:
        bad.max_new_tokens = W.cap - q->prompt + 1;
        want = KVP_FULL;
        break;
    case 4:
        bad.max_new_tokens = 0;
        want = KVP_INVALID_ARGUMENT;
        break;
    default:
        break;
    }
    kvp_error err;
    uint64_t got = 12345;
    if (want != KVP_OK) {
        kvp_scheduler_stats before = sched_stats();
        check_status(kvp_scheduler_submit(W.scheduler, &bad, &got, &err), want, &err);
        CHECK(got == 12345, "a refused submit wrote its id");
        kvp_scheduler_stats after = sched_stats();
        CHECK(memcmp(&before, &after, sizeof before) == 0, "a refused submit changed stats");
    }
    q->live = 1; /* the callbacks may run from now on */
    W.submitted++;
    check_status(kvp_scheduler_submit(W.scheduler, &request, &got, &err), KVP_OK, &err);
    CHECK(got == id, "id %llu, expected %llu", (unsigned long long)got,
          (unsigned long long)id);
}

static void op_step(reader *r)
{
    g_op_name = "step";
    size_t steps = 1 + rd(r) % 4;
    for (size_t i = 0; i < steps; i++) {
        kvp_step_stats st;
        kvp_step_stats_init(&st);
        kvp_error err;
        check_status(kvp_scheduler_step(W.scheduler, &st, &err), KVP_OK, &err);
        kvp_pool_stats pool = pool_stats(W.pool);
        kvp_scheduler_stats s = sched_stats();
        CHECK(st.held_pages == pool.held_pages, "step held %zu, pool %zu", st.held_pages,
              pool.held_pages);
        CHECK(st.total_pages == W.pages, "step total %zu", st.total_pages);
        CHECK(st.running == s.running && st.waiting == s.waiting, "step running/waiting");
        CHECK(st.retained_pages == s.retained_pages, "step retained %zu, stats %zu",
              st.retained_pages, s.retained_pages);
        CHECK(W.config.max_running == 0 || st.decoded <= W.config.max_running ||
                  st.decoded <= MAX_SAMPLES,
              "decoded %zu above max_running", st.decoded);
        CHECK(st.prefix_hit_tokens <= st.prompt_tokens, "step hits above prompt tokens");
        if (i + 1 < steps) {
            check_world();
        }
    }
}

/*
 * A step whose nth allocation fails (1 <= n <= 16): ALLOCATION_FAILED
 * changes nothing, the scheduler's counters and the pool's (every field)
 * included; a step that makes fewer allocations goes on as any step.
 */
static void op_step_fault(reader *r)
{
    g_op_name = "step_fault";
    uint64_t nth = 1 + rd(r) % 16;
    kvp_scheduler_stats before = sched_stats();
    kvp_pool_stats pool_before = pool_stats(W.pool);
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    kvp_error err;
    kvpi_fault_arm(nth);
    kvp_status status = kvp_scheduler_step(W.scheduler, &st, &err);
    int fired = kvpi_fault_fired();
    kvpi_fault_arm(0);
    if (status == KVP_OK) {
        W.job_faulted |= fired; /* a decoder job's allocation: its request fails */
        return;
    }
    CHECK(fired, "step failed with %s, no fault fired", kvp_status_name(status));
    check_status(status, KVP_ALLOCATION_FAILED, &err);
    kvp_scheduler_stats after = sched_stats();
    CHECK(memcmp(&before, &after, sizeof before) == 0,
          "a failed step changed the scheduler's counters (held samples %zu -> %zu)",
          before.held_samples, after.held_samples);
    kvp_pool_stats pool_after = pool_stats(W.pool);
    CHECK(memcmp(&pool_before, &pool_after, sizeof pool_before) == 0,
          "a failed step changed the pool's counters (held %zu -> %zu, caches %zu -> %zu, "
          "hits %llu -> %llu)",
          pool_before.held_pages, pool_after.held_pages, pool_before.attached_caches,
          pool_after.attached_caches, (unsigned long long)pool_before.prefix_hits,
          (unsigned long long)pool_after.prefix_hits);
}

static void op_collect(reader *r)
{
    g_op_name = "collect";
    uint8_t a = rd(r);
    size_t cap = a % 5;
    kvp_request_result done[4];
    for (size_t i = 0; i < 4; i++) {
        kvp_request_result_init(&done[i]);
    }
    size_t n = 99;
    kvp_error err;
    kvp_scheduler_stats before = sched_stats();
    check_status(kvp_scheduler_collect(W.scheduler, cap == 0 && (a & 8) ? NULL : done,
                                       cap < 4 ? cap : 4, &n, &err),
                 KVP_OK, &err);
    CHECK(n <= cap && n <= before.uncollected, "collected %zu of %zu (cap %zu)", n,
          before.uncollected, cap);
    CHECK(sched_stats().uncollected == before.uncollected - n, "uncollected");
    for (size_t i = 0; i < n; i++) {
        const kvp_request_result *res = &done[i];
        CHECK(res->id < W.submitted && W.r[res->id].live, "collected id %llu",
              (unsigned long long)res->id);
        req *q = &W.r[res->id];
        if (W.config.compute) {
            verify_request(res->id);
        }
        if (res->rejected) {
            CHECK(res->tokens_generated == 0 && res->status == KVP_OK,
                  "request %llu rejected after %zu tokens, status %s (prompt %zu, %zu new, %zu "
                  "samples)",
                  (unsigned long long)res->id, res->tokens_generated,
                  kvp_status_name(res->status), q->prompt, q->new_tokens, q->samples);
        } else if (res->status == KVP_OK) {
            CHECK(res->tokens_generated == q->samples * q->new_tokens,
                  "request %llu generated %zu of %zu", (unsigned long long)res->id,
                  res->tokens_generated, q->samples * q->new_tokens);
            for (size_t k = 0; W.config.compute && k < q->samples; k++) {
                CHECK(q->tokens[k] == q->new_tokens, "request %llu sample %zu saw %zu tokens",
                      (unsigned long long)res->id, k, q->tokens[k]);
            }
        } else {
            CHECK((res->status == KVP_POOL_EXHAUSTED && W.direct_used) ||
                      (res->status == KVP_ALLOCATION_FAILED && W.job_faulted),
                  "request %llu failed with %s", (unsigned long long)res->id,
                  kvp_status_name(res->status));
        }
        q->live = 0;
        q->finished = 1;
    }
}

static void bump(void *ctx, double *values, size_t width)
{
    (void)ctx;
    (void)width;
    values[0] = values[0] * 0.5 + 0.125;
}

static void op_update(reader *r)
{
    g_op_name = "update";
    uint8_t a = rd(r);
    verify_all(); /* every token decoded under the weights about to change */
    kvp_error err;
    kvp_param *p = kvp_model_param_mut(W.model, a % W.layers, (a >> 1) % KVP_PARAM_COUNT);
    CHECK(p != NULL, "no parameter");
    check_status(kvp_param_update_with(p, bump, NULL, &err), KVP_OK, &err);
    W.epoch++;
}

/* A direct sequence's outputs from position `from` to its length, against a fresh one. */
static void verify_direct(const direct *x, size_t from, const double *got)
{
    size_t len = kvp_sequence_len(x->seq);
    static double out[MAX_CAP * MAX_D];
    reference(x->source, x->source_sample, len, out);
    for (size_t p = from; p < len; p++) {
        CHECK(memcmp(got + (p - from) * W.d, out + p * W.d, W.d * sizeof(double)) == 0,
              "direct sequence (source %llu) position %zu differs from a fresh sequence's",
              (unsigned long long)x->source, p);
    }
}

static void direct_destroy(direct *x)
{
    if (x->seq != NULL) {
        kvp_error err;
        check_status(kvp_sequence_destroy(x->seq, &err), KVP_OK, &err);
        x->seq = NULL;
    }
}

/* Rows [from, to) of the direct sequence's source into rows. */
static void direct_rows(const direct *x, size_t from, size_t to, double *rows)
{
    for (size_t t = from; t < to; t++) {
        row_of(x->source, x->source_sample, t, rows + (t - from) * W.d);
    }
}

/* A fresh direct sequence adopts what the index holds of its source's rows, then prefills. */
static void op_direct_adopt(reader *r)
{
    g_op_name = "direct_adopt";
    uint8_t a = rd(r);
    uint8_t b = rd(r);
    direct *x = &W.dir[a % N_DIRECT];
    direct_destroy(x);
    if (W.submitted > 0 && (b & 1)) {
        x->source = (b >> 1) % W.submitted;
        x->source_sample = (a >> 2) % W.r[x->source].samples;
    } else {
        x->source = MAX_REQ + (b >> 1) % PSEUDO;
        x->source_sample = 0;
    }
    size_t tokens = 1 + rd(r) % W.cap;
    kvp_error err;
    check_status(kvp_sequence_create(W.model, W.pool, 1, W.cap, &x->seq, &err), KVP_OK, &err);
    x->epoch = W.epoch;
    static double rows[MAX_CAP * MAX_D];
    static double out[MAX_CAP * MAX_D];
    direct_rows(x, 0, tokens, rows);
    kvp_tensor prompt = kvp_tensor3(rows, 1, tokens, W.d);
    size_t adopted = 999;
    check_status(kvp_sequence_adopt_prefix(x->seq, &prompt, &adopted, &err), KVP_OK, &err);
    CHECK(adopted < tokens && adopted % W.bt == 0, "adopted %zu of %zu", adopted, tokens);
    W.direct_used = 1;
    kvp_tensor rest = kvp_tensor3(rows + adopted * W.d, 1, tokens - adopted, W.d);
    kvp_status status = kvp_sequence_prefill(x->seq, &rest, NULL, NULL, out,
                                             (tokens - adopted) * W.d, &err);
    if (status == KVP_POOL_EXHAUSTED) {
        CHECK(kvp_sequence_len(x->seq) == adopted, "a refused prefill changed the length");
        return;
    }
    check_status(status, KVP_OK, &err);
    verify_direct(x, adopted, out);
    if (a & 0x80) {
        size_t blocks = 999;
        check_status(kvp_sequence_publish_prefix(x->seq, &prompt, &blocks, &err), KVP_OK, &err);
        CHECK(blocks == tokens / W.bt, "published %zu blocks of %zu tokens", blocks, tokens);
    }
}

/* One more token of its source's rows (refused when its weights changed or it is full). */
static void op_direct_step(reader *r)
{
    g_op_name = "direct_step";
    direct *x = &W.dir[rd(r) % N_DIRECT];
    if (x->seq == NULL) {
        return;
    }
    size_t len = kvp_sequence_len(x->seq);
    if (len == W.cap) {
        return;
    }
    double row[MAX_D];
    double out[MAX_D];
    direct_rows(x, len, len + 1, row);
    kvp_tensor one = kvp_tensor3(row, 1, 1, W.d);
    kvp_error err;
    kvp_status status = kvp_sequence_step(x->seq, &one, NULL, NULL, out, W.d, &err);
    if (x->epoch != W.epoch) {
        check_status(status, KVP_CACHE_LAYER_REVISION_MISMATCH, &err);
        return;
    }
    if (status == KVP_POOL_EXHAUSTED) {
        return;
    }
    check_status(status, KVP_OK, &err);
    verify_direct(x, len, out);
}

static void op_direct_fork(reader *r)
{
    g_op_name = "direct_fork";
    uint8_t a = rd(r);
    direct *from = &W.dir[a % N_DIRECT];
    direct *to = &W.dir[(a % N_DIRECT + 1 + (a >> 2) % (N_DIRECT - 1)) % N_DIRECT];
    if (from->seq == NULL) {
        return;
    }
    direct_destroy(to);
    kvp_error err;
    check_status(kvp_sequence_fork(from->seq, &to->seq, &err), KVP_OK, &err);
    to->source = from->source;
    to->source_sample = from->source_sample;
    to->epoch = from->epoch;
    CHECK(kvp_sequence_len(to->seq) == kvp_sequence_len(from->seq), "fork length");
}

static void op_direct_truncate(reader *r)
{
    g_op_name = "direct_truncate";
    uint8_t a = rd(r);
    direct *x = &W.dir[a % N_DIRECT];
    if (x->seq == NULL) {
        return;
    }
    size_t len = kvp_sequence_len(x->seq);
    size_t to = (a >> 2) % (len + 1);
    kvp_error err;
    kvp_status status = kvp_sequence_truncate(x->seq, to, &err);
    if (status == KVP_BLOCK_RELEASED) {
        /* a sliding layer released a block the window at `to` needs (cache.h) */
        CHECK(W.windowed && to > 0 && to < len, "truncate %zu -> %zu refused BlockReleased",
              len, to);
        CHECK(err.layer < W.layers && W.window[err.layer] != 0,
              "BlockReleased names layer %zu", err.layer);
        size_t w = W.window[err.layer];
        size_t lo = to > w ? to - w : 0;
        size_t sink_blocks = (W.sinks[err.layer] + W.bt - 1) / W.bt;
        CHECK(err.tokens == to && err.index == err.position / W.bt && err.position < to &&
                  err.index >= sink_blocks &&
                  (err.position >= lo || err.index * W.bt + W.bt > lo),
              "BlockReleased detail: tokens %zu block %zu position %zu (truncate to %zu)",
              err.tokens, err.index, err.position, to);
        CHECK(kvp_sequence_len(x->seq) == len, "a refused truncate changed the length");
        return;
    }
    check_status(status, KVP_OK, &err);
    CHECK(kvp_sequence_len(x->seq) == to, "truncated to %zu", kvp_sequence_len(x->seq));
}

static void op_direct_publish(reader *r)
{
    g_op_name = "direct_publish";
    direct *x = &W.dir[rd(r) % N_DIRECT];
    if (x->seq == NULL || kvp_sequence_len(x->seq) == 0) {
        return;
    }
    size_t len = kvp_sequence_len(x->seq);
    static double rows[MAX_CAP * MAX_D];
    direct_rows(x, 0, len, rows);
    kvp_tensor prompt = kvp_tensor3(rows, 1, len, W.d);
    size_t blocks = 999;
    kvp_error err;
    check_status(kvp_sequence_publish_prefix(x->seq, &prompt, &blocks, &err), KVP_OK, &err);
    CHECK(blocks == len / W.bt, "published %zu blocks of %zu tokens", blocks, len);
}

static void op_direct_destroy(reader *r)
{
    g_op_name = "direct_destroy";
    direct_destroy(&W.dir[rd(r) % N_DIRECT]);
}

typedef void (*op_fn)(reader *r);
static const op_fn g_ops[] = {
    op_submit,          op_step,           op_step,         op_collect,
    op_update,          op_direct_adopt,   op_direct_step,  op_direct_fork,
    op_direct_truncate, op_direct_publish, op_direct_destroy, op_submit,
    op_step,            op_step_fault,
};

/* ---- setup and teardown ------------------------------------------------ */

/* (width, heads, kv heads) */
static const size_t g_geometries[][3] = {{4, 1, 1}, {4, 2, 1}, {4, 2, 2}, {8, 2, 1}, {8, 2, 2}};
static const double g_fractions[] = {0.0, 0.25, 0.5, 1.0};

/* A fixed secret: keys, and so index slots and coverage, repeat run to run. */
static kvp_pool *make_pool(size_t pages)
{
    kvp_pool *pool = NULL;
    kvp_error err;
    check_status(fz_world_pool(W.bt, W.kv_heads, W.hd, pages, 0x6b7670616765720full, 1, &pool,
                               &err),
                 KVP_OK, &err);
    return pool;
}

/*
 * Bit 6 of the model byte: the layers slide, each with a window and sinks
 * the input chooses (one byte a layer): full, W = 1, block edges (bt,
 * bt + 1, 2 bt - 1), 3, and W >= capacity (the capacity, the RoPE
 * positions); sinks 0, 1 or a block, only with a window.
 */
static void make_windowed_model(reader *r, uint8_t seed)
{
    kvp_error err;
    kvp_layer *made[2] = {NULL, NULL};
    const kvp_layer *layers[2];
    for (size_t l = 0; l < W.layers; l++) {
        uint8_t w = rd(r);
        const size_t windows[8] = {0, 1, W.bt, W.bt + 1, 2 * W.bt - 1, 3, W.cap, MAX_POSITIONS};
        const size_t sinks[4] = {0, 0, 1, W.bt};
        W.window[l] = windows[w % 8];
        W.sinks[l] = W.window[l] != 0 ? sinks[(w >> 3) % 4] : 0;
        W.windowed |= W.window[l] != 0;
        check_status(kvp_layer_create_random_grouped(W.d, W.heads, W.kv_heads, MAX_POSITIONS,
                                                     10000.0, seed * 2u + l, &made[l], &err),
                     KVP_OK, &err);
        check_status(kvp_layer_set_window(made[l], W.window[l], W.sinks[l], &err), KVP_OK,
                     &err);
        layers[l] = made[l];
    }
    check_status(kvp_model_create(layers, W.layers, &W.model, &err), KVP_OK, &err);
    for (size_t l = 0; l < W.layers; l++) {
        check_status(kvp_layer_destroy(made[l], &err), KVP_OK, &err);
    }
}

static void setup(reader *r)
{
    memset(&W, 0, sizeof W);
    g_op_name = "setup";
    uint8_t g = rd(r);
    W.d = g_geometries[g % 5][0];
    W.heads = g_geometries[g % 5][1];
    W.kv_heads = g_geometries[g % 5][2];
    W.hd = W.d / W.heads;
    W.bt = 1 + rd(r) % 4;
    W.pages = 4 + rd(r) % 32;
    uint8_t m = rd(r);
    W.layers = 1 + (m & 1);
    W.threads = 1 + ((m >> 1) & 1);
    uint8_t caps = rd(r);
    W.cap = 4 + caps % (MAX_CAP - 3);
    uint8_t reserve = rd(r);
    uint8_t sessions = rd(r);
    uint8_t seed = rd(r);

    kvp_error err;
    if ((m >> 6) & 1) {
        /*
         * Small pools too: a preempted windowed request re-prefills its
         * prompt and appends what it generated in block-sized chunks,
         * within what admission asked (scheduler_prefill.c).
         */
        make_windowed_model(r, seed);
    } else {
        check_status(kvp_model_create_random_grouped(W.layers, W.d, W.heads, W.kv_heads,
                                                     MAX_POSITIONS, 10000.0, seed, &W.model,
                                                     &err),
                     KVP_OK, &err);
    }
    W.pool = make_pool(W.pages);
    W.ref_pool = make_pool(W.layers * (MAX_CAP / W.bt + 1));
    kvp_scheduler_config *c = &W.config;
    kvp_scheduler_config_init(c);
    c->capacity = W.cap;
    c->compute = !((m >> 2) & 1);
    c->sharing = !((m >> 3) & 1);
    c->schedule = (m >> 4) & 1 ? KVP_SCHEDULE_CACHE_AWARE : KVP_SCHEDULE_FCFS;
    c->watermark = (m >> 5) & 1 ? 0.1 : 0.0;
    c->reserve_tokens = reserve % 8;
    c->max_running = (reserve >> 3) % 5;
    c->identity = seed;
    c->session_ttl = (sessions & 7) % 6;
    c->session_fraction = g_fractions[(sessions >> 3) % 4];
    W.kept_cap = (size_t)floor(c->session_fraction * (double)W.pages);
    if (c->compute) {
        check_status(kvp_decoder_create(W.threads, &W.decoder, &err), KVP_OK, &err);
    }
    check_status(kvp_scheduler_create(W.model, W.pool, W.decoder, c, &W.scheduler, &err),
                 KVP_OK, &err);
    check_world();
}

static void teardown(void)
{
    g_op_name = "teardown";
    verify_all();
    kvp_error err;
    check_status(kvp_scheduler_destroy(W.scheduler, &err), KVP_OK, &err);
    for (size_t i = 0; i < N_DIRECT; i++) {
        direct_destroy(&W.dir[i]);
    }
    check_status(kvp_pool_check(W.pool, on_mismatch, NULL, &err), KVP_OK, &err);
    kvp_pool_stats pool = pool_stats(W.pool);
    CHECK(pool.held_pages == 0 && pool.promised_pages == 0 && pool.attached_caches == 0,
          "teardown left %zu pages held, %zu promised, %zu caches", pool.held_pages,
          pool.promised_pages, pool.attached_caches);
    check_status(kvp_pool_destroy(W.pool, &err), KVP_OK, &err);
    check_status(kvp_pool_destroy(W.ref_pool, &err), KVP_OK, &err);
    if (W.decoder != NULL) {
        check_status(kvp_decoder_destroy(W.decoder, &err), KVP_OK, &err);
    }
    check_status(kvp_model_destroy(W.model, &err), KVP_OK, &err);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reader r = {data, size, 0};
    setup(&r);
    for (g_op_index = 1; r.at < r.size && g_op_index <= MAX_OPS; g_op_index++) {
        uint8_t op = rd(&r);
        g_ops[op % (sizeof g_ops / sizeof g_ops[0])](&r);
        check_world();
    }
    teardown();
    return 0;
}
