/*
 * fuzz_api.c: a libFuzzer target that drives the PUBLIC API (kvpager.h only)
 * with operations decoded from the input bytes, and checks every result
 * against a shadow model it keeps itself.
 *
 * Owns: one small world per input -- a pool of a few pages, three layers over
 * two parameter sets (layer 2 shares layer 0's parameters with another RoPE
 * base) and two layers of another geometry, a model of one or two of the
 * three, a decoder of one or two threads, and slots for up to 4 caches,
 * 4 tickets and 3 sequences -- plus the shadow of all of it: lengths, inputs,
 * rotated keys and values, ticket states, promises, parameter revisions and
 * the pool's counters.
 *
 * Sharing, for sequences: truncate, fork (the child shares every page; the
 * next write of either side copies a shared partial page), publish and
 * adopt (prefix hits). The shadow keeps its own pages (spage): reference
 * counts, the prefix index (the shadow key: layer, every layer's captured
 * revisions, the lane's input rows of the chain) and the LRU list of
 * evictable pages in the library's order, and predicts every take (free
 * first, then the least recently used cached page, borrowed: still cached,
 * held by the reservation, hidden from lookups, evicted when the reservation
 * maps it, back at its LRU place when it goes back unused), hit, miss,
 * eviction and copy. Tickets remember the pages they borrowed.
 * Standalone caches hold pages no one shares (counted only); a ticket
 * counts the free pages it took and names the cached ones it borrowed.
 * The two library bugs the model found are fixed and modelled: prompt keys
 * carry the layer index (a layer used twice no longer shares keys), and a
 * fork keeps its parent's captured revisions (tests/fuzz/README.md).
 *
 * Invariants checked after EVERY operation (any mismatch prints a message
 * and calls abort(), which libFuzzer reports as a crash):
 *   - the status is exactly the one the shadow predicts, derived from the
 *     shadow state and the headers' contracts (validation order, FULL,
 *     POOL_EXHAUSTED, stale bindings, the non-finite checks computed by the
 *     shadow's own copy of the documented math), with its detail fields;
 *   - *err is untouched on success and out-parameters on failure;
 *   - every cache's and sequence's length, mapped, held and promised pages,
 *     and the pool's statistics (total, free, held, promised, attached
 *     caches and reservations, acquires, releases, exhaustions, high water);
 *   - kvp_pool_check passes (I1..I5); a standalone cache's page is named by
 *     one table; sequences' pages are shared exactly as the shadow says (its
 *     page ids map one to one onto the library's); cached, evictable, prefix
 *     hits and misses, evictions and copy-on-write copies equal the shadow's;
 *   - a failed call leaves every cache's digest and its outputs unchanged
 *     (prefill: the documented exception for tokens before the failure);
 *   - each cache's logical keys and values equal the shadow's;
 *   - every successful prepare's output equals kvp_attention_reference on
 *     the shadow's copy of the inputs, and the shadow's own output, at 1e-12
 *     (relative to the magnitude where that exceeds 1); step, prefill and
 *     decoder outputs equal the shadow's chained activations (residual
 *     stream, or the target's own next_input function).
 *
 * Two more operations: op_set_accum (a layer's or the model's accumulation
 * level; the pool is f64, so every predicted bit stays), and op_paged, the
 * typed sub-world of fuzz_paged.c (pools of every dtype, the typed and
 * in-place writes, kvp_paged_attention; fuzz_common.h is what they share).
 *
 * The decoder is the one source of nondeterminism: when jobs compete for the
 * last free pages, which of them is refused depends on thread timing, so
 * the shadow accepts exactly the outcomes the contract allows.
 *
 * The target is five files behind fuzz_api.h: this one owns the entry point
 * (LLVMFuzzerTestOneInput), the reader, the failure report, the status
 * tally, the operation table, setup, teardown and the pool-wide operations;
 * fuzz_api_shadow.c the world W and the shadow model with its math;
 * fuzz_api_check.c the checks (check_world after every operation);
 * fuzz_api_cache.c the cache and ticket operations; fuzz_api_seq.c the
 * sequence, parameter and decoder operations. Only libFuzzer calls in here.
 *
 * Built only by the `fuzz` preset (clang, -fsanitize=fuzzer,address,undefined).
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpager/kvpager.h"
#include "fuzz_api.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);


/* ---- failure reporting ------------------------------------------------- */

static size_t g_op_index;
const char *g_op_name = "setup";

void fz_fail(const char *fmt, ...)
{
    va_list args;
    va_start(args, fmt);
    fprintf(stderr, "kvpager fuzz: MISMATCH at op %zu (%s): ", g_op_index, g_op_name);
    vfprintf(stderr, fmt, args);
    fprintf(stderr, "\n");
    va_end(args);
    abort();
}

/*
 * With KVP_FUZZ_STATS set in the environment, the target tallies the
 * statuses each operation returned and prints the table at exit, to show
 * which paths a corpus reaches (tests/fuzz/README.md).
 */
#define N_OP_NAMES 64
static const char *g_tally_names[N_OP_NAMES];
static unsigned long g_tally[N_OP_NAMES][KVP_STATUS_COUNT_];
static int g_tally_on = -1;
int g_auditing; /* check_world's own calls are not the operation's */
/* Sharing events over every input (pool counters, summed as each pool goes). */
static unsigned long long g_shared[4]; /* hits, misses, evictions, cow copies */

static void print_tally(void)
{
    fprintf(stderr, "kvpager fuzz: sharing: %llu prefix hits, %llu misses, %llu evictions, "
                    "%llu cow copies\n",
            g_shared[0], g_shared[1], g_shared[2], g_shared[3]);
    for (int i = 0; i < N_OP_NAMES && g_tally_names[i] != NULL; i++) {
        for (int s = 0; s < KVP_STATUS_COUNT_; s++) {
            if (g_tally[i][s] != 0) {
                fprintf(stderr, "kvpager fuzz: %-18s %-26s %lu\n", g_tally_names[i],
                        kvp_status_name((kvp_status)s), g_tally[i][s]);
            }
        }
    }
}

static void tally(kvp_status status)
{
    if (g_tally_on < 0) {
        g_tally_on = getenv("KVP_FUZZ_STATS") != NULL;
        if (g_tally_on) {
            atexit(print_tally);
        }
    }
    if (!g_tally_on || g_auditing || (int)status < 0 || status >= KVP_STATUS_COUNT_) {
        return;
    }
    int i = 0;
    while (i < N_OP_NAMES - 1 && g_tally_names[i] != NULL && g_tally_names[i] != g_op_name) {
        i++;
    }
    g_tally_names[i] = g_op_name;
    g_tally[i][status]++;
}

void check_status(kvp_status got, kvp_status want, const kvp_error *err)
{
    tally(got);
    if (got != want) {
        char text[512];
        kvp_error_format(err, text, sizeof text);
        fail("status %s, expected %s (error text: %s)", kvp_status_name(got),
             kvp_status_name(want), text);
    }
}

/* ---- input decoding ---------------------------------------------------- */

uint8_t rd(reader *r)
{
    return r->at < r->size ? r->data[r->at++] : 0;
}

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
double unit(uint64_t *state)
{
    return (double)(splitmix64(state) >> 11) * 0x1.0p-52 - 1.0;
}

/* The shared helpers fuzz_paged.c calls (fuzz_common.h). */
uint8_t fz_rd(reader *r)
{
    return rd(r);
}

double fz_unit(uint64_t *state)
{
    return unit(state);
}

void fz_check_status(kvp_status got, kvp_status want, const kvp_error *err)
{
    check_status(got, want, err);
}

void fz_set_op(const char *name)
{
    g_op_name = name;
}

void fz_set_auditing(int on)
{
    g_auditing = on;
}

static const double g_specials[8] = {NAN,   INFINITY, -INFINITY, 1e308,
                                     -1e308, 1e154,   1e300,     -1e200};

/*
 * n values from two or three bytes: a seed for moderate values in [-2, 2),
 * then a selector that, at 0xE0 and above, plants one special value (NaN,
 * +-Inf or a huge magnitude) at a position given by one more byte.
 */
void read_values(reader *r, double *out, size_t n)
{
    uint64_t state = 0x5eedull * (uint64_t)(rd(r) + 1);
    for (size_t i = 0; i < n; i++) {
        out[i] = 2.0 * unit(&state);
    }
    uint8_t special = rd(r);
    if (special >= 0xE0) {
        out[rd(r) % n] = g_specials[special & 7];
    }
}


static void add_shared_events(void)
{
    g_shared[0] += W.hits;
    g_shared[1] += W.misses;
    g_shared[2] += W.evictions;
    g_shared[3] += W.cow_copies;
}

/* Destroying the pool: refused while anything is attached or held, else rebuilt. */
static void op_pool_destroy(reader *r)
{
    (void)r;
    g_op_name = "pool_destroy";
    size_t caches = 0, reservations = 0;
    for (int i = 0; i < N_CACHES; i++) {
        caches += W.cache[i].live;
    }
    for (int i = 0; i < N_SEQS; i++) {
        caches += W.seq[i].live ? W.layers : 0;
    }
    for (int i = 0; i < N_TICKETS; i++) {
        reservations += W.ticket[i].live && W.ticket[i].reserved != 0;
    }
    int busy = caches != 0 || reservations != 0 || held_pages() != 0;
    kvp_error err;
    kvp_status status = kvp_pool_destroy(W.pool, &err);
    check_status(status, busy ? KVP_POOL_BUSY : KVP_OK, &err);
    if (busy) {
        CHECK(err.attached_caches == caches && err.attached_reservations == reservations &&
                  err.held_pages == held_pages(),
              "pool busy: %zu caches %zu reservations %zu held, expected %zu %zu %zu",
              err.attached_caches, err.attached_reservations, err.held_pages, caches,
              reservations, held_pages());
        return;
    }
    status = kvp_pool_create(&W.pool_config, &W.pool, &err);
    check_status(status, KVP_OK, &err);
    W.acquires = W.releases = W.exhaustions = 0;
    W.high_water = 0;
    memset(W.page, 0, sizeof W.page); /* the index went with the pool */
    add_shared_events();
    W.hits = W.misses = W.evictions = W.cow_copies = 0;
}

/*
 * The accumulation level of a layer (kvp_layer_set_accum) or of the model
 * (kvp_model_set_accum), now and then a value that is no kvp_accum (refused,
 * changing no layer's level). The world's pool is f64, which ignores the
 * level, so every output the shadow predicts stays exact: the target checks
 * that the fast level changes no f64 bit (DESIGN.md, "Accumulation levels").
 */
static kvp_accum layer_accum(const kvp_layer *layer)
{
    kvp_layer_info info;
    kvp_layer_info_init(&info);
    kvp_error err;
    check_status(kvp_layer_info_get(layer, &info, &err), KVP_OK, &err);
    return info.accum;
}

static void op_set_accum(reader *r)
{
    uint8_t sel = rd(r);
    kvp_accum want_level = (kvp_accum)(sel & 1);
    int bad = (sel >> 1) % 8 == 7;
    kvp_accum level = bad ? (kvp_accum)(2 + sel % 3) : want_level;
    int on_model = (sel >> 4) & 1;
    g_op_name = on_model ? "model_set_accum" : "layer_set_accum";
    const kvp_layer *target[MAX_MODEL + 1];
    size_t n = 0;
    if (on_model) {
        for (size_t l = 0; l < W.layers; l++) {
            target[n++] = kvp_model_layer(W.model, l);
        }
    } else {
        target[n++] = W.layer[(sel >> 5) % N_LAYERS].layer;
    }
    kvp_accum before[MAX_MODEL + 1];
    for (size_t i = 0; i < n; i++) {
        before[i] = layer_accum(target[i]);
    }
    kvp_error err;
    poison(&err);
    kvp_status status = on_model ? kvp_model_set_accum(W.model, level, &err)
                                 : kvp_layer_set_accum(W.layer[(sel >> 5) % N_LAYERS].layer,
                                                       level, &err);
    check_status(status, bad ? KVP_INVALID_ARGUMENT : KVP_OK, &err);
    if (!bad) {
        check_untouched(&err);
    }
    for (size_t i = 0; i < n; i++) {
        kvp_accum got = layer_accum(target[i]);
        CHECK(got == (bad ? before[i] : level), "layer %zu accum %d after set_accum(%d)", i,
              (int)got, (int)level);
    }
}

/* The typed sub-world (fuzz_paged.c), behind one operation byte. */
static void op_paged(reader *r)
{
    fz_paged_op(r);
}

kvp_decoder *fz_decoder(void)
{
    return W.decoder;
}

/* ---- one input ------------------------------------------------------------ */

typedef void (*op_fn)(reader *r);

/* Weighted: the operations that move data come up more often. */
static const op_fn g_ops[] = {
    op_cache_create, op_cache_create, op_cache_destroy, op_cache_reset,   op_ticket_create,
    op_ticket_create, op_ticket_destroy, op_prepare,    op_prepare,       op_prepare,
    op_commit,       op_commit,       op_ticket_discard, op_forward,      op_forward,
    op_forward,      op_seq_create,   op_seq_destroy,    op_seq_reset,    op_seq_step,
    op_seq_step,     op_seq_prefill,  op_seq_promise,    op_admit,        op_param_update,
    op_decoder_step, op_decoder_step, op_pool_destroy,  op_cache_truncate, op_seq_truncate,
    op_seq_fork,     op_seq_fork,     op_seq_publish,    op_seq_adopt,    op_seq_adopt,
    op_set_accum,    op_paged,        op_paged,          op_paged,        op_paged,
};

static const size_t g_geometries[][2] = {{4, 1}, {4, 2}, {6, 1}, {8, 1}, {8, 2}};
static const double g_bases[] = {10000.0, 10.0, 2.0, 1e6};

static void setup(reader *r)
{
    memset(&W, 0, sizeof W);
    g_op_name = "setup";
    uint8_t g = rd(r);
    W.d = g_geometries[g % 5][0];
    W.heads = g_geometries[g % 5][1];
    W.hd = W.d / W.heads;
    W.bt = 1 + rd(r) % 3;
    size_t pages = 2 + rd(r) % 11;
    uint8_t m = rd(r);
    W.layers = 1 + m % 2;
    W.model_layer[0] = (m >> 1) % N_LAYERS;
    W.model_layer[1] = (m >> 3) % N_LAYERS;
    W.threads = 1 + (m >> 5) % 2;
    uint8_t weights_seed = rd(r);
    uint8_t base_byte = rd(r);
    double base = g_bases[base_byte % 4];
    W.next_mode = (base_byte >> 2) & 1;

    kvp_pool_config_init(&W.pool_config);
    W.pool_config.block_tokens = W.bt;
    W.pool_config.heads = W.heads;
    W.pool_config.head_width = W.hd;
    /* A fixed secret: keys, and so index slots and coverage, repeat run to run. */
    for (size_t i = 0; i < KVP_KEY_SECRET_BYTES / sizeof(uint64_t); i++) {
        W.pool_config.key_secret[i] = 0x6b7670616765720full + i;
    }
    size_t page_bytes = 2 * W.heads * W.bt * W.hd * sizeof(double);
    W.pool_config.budget_bytes = pages * page_bytes + rd(r) % page_bytes;
    W.total = pages;
    kvp_error err;
    kvp_status status = kvp_pool_create(&W.pool_config, &W.pool, &err);
    check_status(status, KVP_OK, &err);

    uint64_t state = 0x77ull * (weights_seed + 1);
    for (int s = 0; s < N_PSETS; s++) {
        for (int p = 0; p < KVP_PARAM_COUNT; p++) {
            for (size_t i = 0; i < W.d * W.d; i++) {
                W.params[s].w[p][i] = unit(&state) / sqrt((double)W.d);
            }
        }
    }
    kvp_param *params[N_PSETS][KVP_PARAM_COUNT];
    for (int s = 0; s < N_PSETS; s++) {
        for (int p = 0; p < KVP_PARAM_COUNT; p++) {
            status = kvp_param_create(W.d, W.params[s].w[p], &params[s][p], &err);
            check_status(status, KVP_OK, &err);
        }
    }
    /* Layer 2 shares layer 0's parameters under another RoPE base. */
    const int pset_of[N_LAYERS] = {0, 1, 0};
    const double base_of[N_LAYERS] = {base, base, base * 2.0};
    for (int l = 0; l < N_LAYERS; l++) {
        kvp_param **p = params[pset_of[l]];
        status = kvp_layer_create(p[0], p[1], p[2], p[3], W.heads, MAX_POSITIONS, base_of[l],
                                  &W.layer[l].layer, &err);
        check_status(status, KVP_OK, &err);
        W.layer[l].pset = pset_of[l];
        W.layer[l].base = base_of[l];
    }
    for (int s = 0; s < N_PSETS; s++) {
        for (int p = 0; p < KVP_PARAM_COUNT; p++) {
            (void)kvp_param_release(params[s][p], NULL); /* the layers hold theirs */
        }
    }
    /* (4,1)<->(4,2), (8,1)<->(8,2), (6,1)->(6,3): every head width stays even. */
    W.alien_heads = W.heads == 2 ? 1 : W.d == 6 ? 3 : 2;
    status = kvp_layer_create_random(W.d, W.alien_heads, MAX_POSITIONS, base, weights_seed,
                                     &W.alien, &err);
    check_status(status, KVP_OK, &err);
    status = kvp_layer_create_random(2 * W.d, W.heads, MAX_POSITIONS, base, weights_seed, &W.wide,
                                     &err);
    check_status(status, KVP_OK, &err);
    const kvp_layer *model_layers[MAX_MODEL];
    for (size_t l = 0; l < W.layers; l++) {
        model_layers[l] = W.layer[W.model_layer[l]].layer;
    }
    status = kvp_model_create(model_layers, W.layers, &W.model, &err);
    check_status(status, KVP_OK, &err);
    status = kvp_decoder_create(W.threads, &W.decoder, &err);
    check_status(status, KVP_OK, &err);
    fz_paged_setup();
    check_world();
}

static void teardown(void)
{
    g_op_name = "teardown";
    add_shared_events();
    fz_paged_teardown();
    kvp_error err;
    for (int i = 0; i < N_TICKETS; i++) {
        if (W.ticket[i].live) {
            check_status(kvp_ticket_destroy(W.ticket[i].ticket, &err), KVP_OK, &err);
        }
    }
    for (int i = 0; i < N_CACHES; i++) {
        if (W.cache[i].live) {
            check_status(kvp_cache_destroy(W.cache[i].cache, &err), KVP_OK, &err);
        }
    }
    for (int i = 0; i < N_SEQS; i++) {
        if (W.seq[i].live) {
            check_status(kvp_sequence_destroy(W.seq[i].seq, &err), KVP_OK, &err);
        }
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    check_status(kvp_pool_stats_get(W.pool, &stats, &err), KVP_OK, &err);
    CHECK(stats.held_pages == 0 && stats.promised_pages == 0 && stats.attached_caches == 0 &&
              stats.attached_reservations == 0,
          "teardown left %zu pages held, %zu promised", stats.held_pages, stats.promised_pages);
    check_status(kvp_pool_check(W.pool, on_mismatch, NULL, &err), KVP_OK, &err);
    check_status(kvp_pool_destroy(W.pool, &err), KVP_OK, &err);
    check_status(kvp_decoder_destroy(W.decoder, &err), KVP_OK, &err);
    check_status(kvp_model_destroy(W.model, &err), KVP_OK, &err);
    for (int l = 0; l < N_LAYERS; l++) {
        check_status(kvp_layer_destroy(W.layer[l].layer, &err), KVP_OK, &err);
    }
    check_status(kvp_layer_destroy(W.alien, &err), KVP_OK, &err);
    check_status(kvp_layer_destroy(W.wide, &err), KVP_OK, &err);
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
