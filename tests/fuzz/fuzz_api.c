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
 * Built only by the `fuzz` preset (clang, -fsanitize=fuzzer,address,undefined).
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpager/kvpager.h"
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_D 8
#define MAX_H 2
#define MAX_B 2
#define MAX_CAP 16
#define MAX_POSITIONS 16
#define N_LAYERS 3
#define N_PSETS 2
#define MAX_MODEL 2
#define N_CACHES 4
#define N_TICKETS 4
#define N_SEQS 3
#define MAX_OPS 400
#define MAX_PROMPT 4
#define TOLERANCE 1e-12

/* ---- failure reporting ------------------------------------------------- */

static size_t g_op_index;
static const char *g_op_name = "setup";

#define fail fz_fail
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
static int g_auditing; /* check_world's own calls are not the operation's */
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

static void check_status(kvp_status got, kvp_status want, const kvp_error *err)
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

static uint8_t rd(reader *r)
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
static double unit(uint64_t *state)
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
static void read_values(reader *r, double *out, size_t n)
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

/* ---- the shadow -------------------------------------------------------- */

/* K and V rows of a set of lanes: [B][H][cap][d_h]. */
typedef struct skv {
    size_t len;
    double k[MAX_B][MAX_H][MAX_CAP][MAX_D];
    double v[MAX_B][MAX_H][MAX_CAP][MAX_D];
} skv;

typedef struct sparams {
    double w[KVP_PARAM_COUNT][MAX_D * MAX_D];
    uint64_t version[KVP_PARAM_COUNT];
} sparams;

typedef struct slayer {
    kvp_layer *layer;
    int pset;
    double base;
} slayer;

typedef struct scache {
    kvp_cache *cache;
    int live;
    int layer;
    size_t batch;
    size_t capacity;
    uint64_t version[KVP_PARAM_COUNT];
    uint64_t uid;
    uint64_t epoch;
    skv kv;
    double x[MAX_CAP][MAX_B * MAX_D]; /* the input row of every committed position */
} scache;

enum { T_EMPTY, T_PREPARED, T_COMMITTED };

typedef struct sticket {
    kvp_ticket *ticket;
    int live;
    size_t batch;
    size_t capacity;
    int state;
    uint64_t cache_uid;
    uint64_t cache_epoch;
    size_t len_at;
    size_t reserved;
    /* Of the reserved pages, the shadow ids of those borrowed from the LRU
     * list (taken after the free ones), in the order taken. */
    uint8_t borrowed[MAX_B];
    size_t borrowed_count;
    double key[MAX_B * MAX_D];
    double value[MAX_B * MAX_D];
    double x[MAX_B * MAX_D];
} sticket;

typedef struct sseq {
    kvp_sequence *seq;
    int live;
    size_t batch;
    size_t capacity;
    size_t promise;
    uint64_t version[MAX_MODEL][KVP_PARAM_COUNT];
    skv kv[MAX_MODEL];
    /* Sharing: the shadow page of every (layer, lane, block), each layer's
     * copy-on-write mark, and layer 0's input row of every position. */
    uint8_t table[MAX_MODEL][MAX_B][MAX_CAP];
    int cow[MAX_MODEL];
    double x[MAX_CAP][MAX_B * MAX_D];
} sseq;

/*
 * A prefix key as the shadow sees it: the layer, the revisions every layer's
 * binding captured, and the lane's input rows of blocks 0..j (the chain).
 */
typedef struct skey {
    size_t layer;
    uint64_t version[MAX_MODEL][KVP_PARAM_COUNT];
    size_t tokens;
    double rows[MAX_CAP * MAX_D];
} skey;

/*
 * A page that sequences name (held, refs > 0) or the prefix index keeps
 * (evictable: registered, refs 0, on the LRU list by stamp), or a cached
 * page a take borrowed (DESIGN.md, "Transactions and cached pages"): held by
 * its reservation (refs 1), still registered (cached) with its key and
 * stamp, but off the LRU list and skipped by lookups, until the reservation
 * maps it (evicted) or gives it back (restored). Its id is the shadow's own;
 * check_world maps ids to the library's page ids one to one.
 */
typedef struct spage {
    int used;
    unsigned refs;
    int registered;
    int borrowed;
    uint64_t stamp;
    skey key;
    double k[MAX_H][3][MAX_D]; /* the block's rows, for adopters (block_tokens <= 3) */
    double v[MAX_H][3][MAX_D];
} spage;

#define MAX_SPAGES 32

typedef struct world {
    /* geometry */
    size_t d, heads, hd, bt, layers, threads;
    kvp_pool_config pool_config;
    size_t total;
    /* objects */
    kvp_pool *pool;
    kvp_decoder *decoder;
    kvp_model *model;
    sparams params[N_PSETS];
    slayer layer[N_LAYERS];
    kvp_layer *alien;   /* the same model width split into another head count */
    size_t alien_heads;
    kvp_layer *wide;    /* twice the model width, as many heads */
    int next_mode;      /* 0: the residual stream (NULL); 1: next_half */
    int model_layer[MAX_MODEL];
    scache cache[N_CACHES];
    sticket ticket[N_TICKETS];
    sseq seq[N_SEQS];
    uint64_t next_uid;
    /* the pool's counters as the shadow predicts them */
    size_t anon; /* pages held by standalone caches and tickets (never shared) */
    uint64_t acquires, releases, exhaustions;
    size_t high_water;
    /* sharing: pages of sequences and the prefix index */
    spage page[MAX_SPAGES];
    uint64_t clock; /* LRU stamps */
    uint64_t hits, misses, evictions, cow_copies;
} world;

static world W;

static size_t blocks_for(size_t tokens)
{
    return tokens / W.bt + (tokens % W.bt != 0);
}

/* Pages some table or reservation names. */
static size_t held_pages(void)
{
    size_t held = W.anon;
    for (int i = 0; i < MAX_SPAGES; i++) {
        held += W.page[i].used && W.page[i].refs > 0;
    }
    return held;
}

static size_t evictable_pages(void)
{
    size_t n = 0;
    for (int i = 0; i < MAX_SPAGES; i++) {
        n += W.page[i].used && W.page[i].refs == 0;
    }
    return n;
}

static size_t cached_pages(void)
{
    size_t n = 0;
    for (int i = 0; i < MAX_SPAGES; i++) {
        n += W.page[i].used && W.page[i].registered;
    }
    return n;
}

/* What a take can have: free and evictable pages (the pool's "available"). */
static size_t free_pages(void)
{
    return W.total - held_pages();
}

static void raise_high_water(void)
{
    if (held_pages() > W.high_water) {
        W.high_water = held_pages();
    }
}

/* Evicts the least recently used evictable page. */
static void evict_one(void)
{
    int lru = -1;
    for (int i = 0; i < MAX_SPAGES; i++) {
        if (W.page[i].used && W.page[i].refs == 0 &&
            (lru < 0 || W.page[i].stamp < W.page[lru].stamp)) {
            lru = i;
        }
    }
    CHECK(lru >= 0, "the shadow took a page from an empty pool");
    W.page[lru].used = 0;
    W.page[lru].registered = 0;
    W.evictions++;
}

/*
 * One page for a take: a free one if any (-1), else the least recently used
 * evictable page, borrowed (its id): held by the taker, still cached.
 */
static int take_one(void)
{
    if (W.total - held_pages() - evictable_pages() != 0) {
        return -1;
    }
    int lru = -1;
    for (int i = 0; i < MAX_SPAGES; i++) {
        if (W.page[i].used && W.page[i].refs == 0 &&
            (lru < 0 || W.page[i].stamp < W.page[lru].stamp)) {
            lru = i;
        }
    }
    CHECK(lru >= 0, "the shadow took a page from an empty pool");
    CHECK(W.page[lru].registered && !W.page[lru].borrowed, "the shadow borrowed page id %d twice",
          lru);
    W.page[lru].borrowed = 1;
    W.page[lru].refs = 1;
    return lru;
}

/* The registered page under `key` that lookups find (borrowed ones are skipped), or -1. */
static int index_find(const skey *key);

/* A borrowed page is mapped: final, so evicted (its key dropped, counted). */
static void evict_borrowed(uint8_t id)
{
    spage *p = &W.page[id];
    CHECK(p->used && p->borrowed && p->refs == 1, "the shadow mapped page id %u as borrowed", id);
    p->borrowed = 0;
    p->registered = 0;
    memset(&p->key, 0, sizeof p->key);
    W.evictions++;
}

/*
 * A borrowed page comes back unused: at its LRU place again (its stamp is
 * unchanged), unless a page published under its key meanwhile holds the key
 * now; then it leaves the index and goes free. Not an eviction.
 */
static void restore_borrowed(uint8_t id)
{
    spage *p = &W.page[id];
    CHECK(p->used && p->borrowed && p->refs == 1, "the shadow gave back page id %u unborrowed",
          id);
    int other = index_find(&p->key); /* lookups skip p while it is borrowed */
    p->borrowed = 0;
    p->refs = 0;
    if (other >= 0) {
        p->used = 0;
        p->registered = 0;
    }
}

/* A ticket's take of n pages: free ones (counted in anon), then borrowed ones. */
static void take_pages(sticket *t, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int id = take_one();
        if (id < 0) {
            W.anon++;
        } else {
            t->borrowed[t->borrowed_count++] = (uint8_t)id;
        }
    }
    W.acquires += n;
    raise_high_water();
}

static void give_pages(size_t n)
{
    W.anon -= n;
    W.releases += n;
}

/* A ticket's reservation goes back unused: its free pages free, its borrowed ones restored. */
static void give_ticket_pages(sticket *t)
{
    give_pages(t->reserved - t->borrowed_count);
    for (size_t i = 0; i < t->borrowed_count; i++) {
        restore_borrowed(t->borrowed[i]);
        W.releases++;
    }
    t->reserved = 0;
    t->borrowed_count = 0;
}

/* A ticket's reservation moves into a standalone cache's table: borrowed pages evicted. */
static void map_ticket_pages(sticket *t)
{
    for (size_t i = 0; i < t->borrowed_count; i++) {
        evict_borrowed(t->borrowed[i]);
        W.page[t->borrowed[i]].used = 0; /* an anonymous page from now on */
        W.anon++;
    }
    t->reserved = 0;
    t->borrowed_count = 0;
}

/*
 * A new page for a sequence (refs 1): a fresh id for a free page, or the
 * borrowed page's own id (evicted when mapped, seq_map_token). Counted by the
 * caller (acquires).
 */
static uint8_t spage_new(void)
{
    int borrowed = take_one();
    if (borrowed >= 0) {
        return (uint8_t)borrowed;
    }
    for (int i = 0; i < MAX_SPAGES; i++) {
        if (!W.page[i].used) {
            memset(&W.page[i], 0, sizeof W.page[i]);
            W.page[i].used = 1;
            W.page[i].refs = 1;
            return (uint8_t)i;
        }
    }
    fail("the shadow ran out of page ids");
}

/* A sequence maps a page it took: a borrowed one is evicted now. */
static uint8_t map_new(uint8_t id)
{
    if (W.page[id].borrowed) {
        evict_borrowed(id);
    }
    return id;
}

static void spage_ref(uint8_t id)
{
    if (W.page[id].refs++ == 0) {
        W.acquires++; /* an evictable page held again counts as acquired */
        raise_high_water();
    }
}

static void spage_put(uint8_t id)
{
    spage *p = &W.page[id];
    CHECK(p->used && p->refs > 0, "the shadow put page id %u twice", id);
    if (--p->refs != 0) {
        return;
    }
    W.releases++;
    if (p->registered) {
        p->stamp = ++W.clock; /* the LRU list's tail */
    } else {
        p->used = 0;
    }
}

static size_t promised_total(void)
{
    size_t sum = 0;
    for (int i = 0; i < N_SEQS; i++) {
        sum += W.seq[i].live ? W.seq[i].promise : 0;
    }
    return sum;
}

/* ---- sequences' pages: sharing and copy-on-write ------------------------- */

/* A truncate recomputes the marks: a partial last page shared or registered. */
static void seq_cow_refresh(sseq *s)
{
    size_t len = s->kv[0].len;
    for (size_t l = 0; l < W.layers; l++) {
        s->cow[l] = 0;
        for (size_t b = 0; b < s->batch && len % W.bt != 0; b++) {
            const spage *p = &W.page[s->table[l][b][len / W.bt]];
            s->cow[l] |= p->refs > 1 || p->registered;
        }
    }
}

/* The library's order: blocks from the last, layers from the last, lanes from the last. */
static void seq_truncate_to(sseq *s, size_t new_len)
{
    size_t keep = blocks_for(new_len);
    for (size_t block = blocks_for(s->kv[0].len); block-- > keep;) {
        for (size_t l = W.layers; l-- > 0;) {
            for (size_t b = s->batch; b-- > 0;) {
                spage_put(s->table[l][b][block]);
            }
        }
    }
    for (size_t l = 0; l < W.layers; l++) {
        s->kv[l].len = new_len;
    }
    seq_cow_refresh(s);
}

/* The copies the next write makes: B per marked layer (mid-block only). */
static size_t seq_copies(const sseq *s)
{
    size_t copies = 0;
    for (size_t l = 0; l < W.layers; l++) {
        copies += s->cow[l] && s->kv[0].len % W.bt != 0 ? s->batch : 0;
    }
    return copies;
}

/* kvp_sequence_pages_for: new blocks of every layer and lane, plus the copies. */
static size_t seq_pages_for(const sseq *s, size_t tokens)
{
    size_t len = s->kv[0].len;
    if (tokens <= len) {
        return 0;
    }
    return W.layers * s->batch * (blocks_for(tokens) - blocks_for(len)) + seq_copies(s);
}

/*
 * A prefill failed while computing: of its `pages` (free ones first, then
 * borrowed from the LRU list, oldest first), those the rows of its first
 * `committed` tokens were mapped to were written, in the order taken. The
 * borrowed ones among them are evicted; the others came back unchanged. A
 * prefill in blocks (no next_input) commits nothing before its failing
 * block, and MAX_PROMPT tokens fit in one block: it writes no page.
 */
static void forget_written_borrowed(const sseq *s, size_t len, size_t pages, size_t committed)
{
    size_t free_now = W.total - held_pages() - evictable_pages();
    size_t written = committed > 0 ? seq_pages_for(s, len + committed) : 0;
    for (size_t i = free_now; i < written && i < pages; i++) {
        evict_one();
    }
}

/*
 * Maps the pages of the token at the current length from ids[*next ..]: a
 * new block, or the copies of marked layers (the originals put now, or kept
 * in saved[][] for a prefill, which puts them when it succeeds).
 */
static void seq_map_token(sseq *s, const uint8_t *ids, size_t *next,
                          uint8_t saved[MAX_MODEL][MAX_B], int defer)
{
    size_t len = s->kv[0].len;
    for (size_t l = 0; l < W.layers; l++) {
        if (len % W.bt == 0) {
            for (size_t b = 0; b < s->batch; b++) {
                s->table[l][b][len / W.bt] = map_new(ids[(*next)++]);
            }
        } else if (s->cow[l]) {
            for (size_t b = 0; b < s->batch; b++) {
                uint8_t original = s->table[l][b][len / W.bt];
                s->table[l][b][len / W.bt] = map_new(ids[(*next)++]);
                if (defer) {
                    saved[l][b] = original;
                } else {
                    spage_put(original);
                }
            }
            W.cow_copies += s->batch;
            s->cow[l] = 0;
        }
    }
}

/* A step's pages: taken (and counted) at once, then mapped, originals put. */
static void seq_step_pages(sseq *s, size_t pages)
{
    uint8_t ids[MAX_MODEL * MAX_B * 2];
    for (size_t i = 0; i < pages; i++) {
        ids[i] = spage_new();
    }
    W.acquires += pages;
    raise_high_water();
    size_t next = 0;
    seq_map_token(s, ids, &next, NULL, 0);
    CHECK(next == pages, "a step mapped %zu of its %zu pages", next, pages);
}

/* ---- the shadow's copy of the documented math -------------------------- */

/*
 * The same operations in the same order as attention.h documents (y = x W
 * summed over i in order, RoPE over pairs, scaled dot products, a softmax
 * that subtracts the row maximum, values mixed over positions in order), so
 * whether an intermediate is finite is decided exactly as the library's.
 */
static void s_project(const double *x, const double *w, size_t d, double *y)
{
    for (size_t f = 0; f < d; f++) {
        y[f] = 0.0;
    }
    for (size_t i = 0; i < d; i++) {
        for (size_t f = 0; f < d; f++) {
            y[f] += x[i] * w[i * d + f];
        }
    }
}

static void s_rope(double base, size_t width, double *features, size_t position)
{
    for (size_t i = 0; i < width / 2; i++) {
        double theta = pow(base, -(double)(2 * i) / (double)width);
        double angle = (double)position * theta;
        double c = cos(angle);
        double s = sin(angle);
        double x0 = features[2 * i];
        double x1 = features[2 * i + 1];
        features[2 * i] = x0 * c - x1 * s;
        features[2 * i + 1] = x0 * s + x1 * c;
    }
}

static double s_dot(const double *a, const double *b, size_t n)
{
    double sum = 0.0;
    for (size_t f = 0; f < n; f++) {
        sum += a[f] * b[f];
    }
    return sum;
}

static void s_axpy(double *acc, double weight, const double *v, size_t n)
{
    for (size_t f = 0; f < n; f++) {
        acc[f] += weight * v[f];
    }
}

static size_t first_nonfinite(const double *v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(v[i])) {
            return i;
        }
    }
    return n;
}

/* What one prepare should give: a status with its detail, or the row. */
typedef struct expect {
    kvp_status status;
    const char *what; /* NONFINITE_PROJECTION */
    size_t index;     /* NONFINITE_* */
    size_t parameter; /* CACHE_LAYER_REVISION_MISMATCH */
    double out[MAX_B * MAX_D];
    double key[MAX_B * MAX_D];
    double value[MAX_B * MAX_D];
} expect;

static kvp_status set_nonfinite(expect *e, kvp_status status, const char *what, size_t index)
{
    e->status = status;
    e->what = what;
    e->index = index;
    return status;
}

/* The incremental computation on `kv` for input x [B][D] through `layer`. */
static kvp_status s_attend(const slayer *layer, const skv *kv, size_t batch, const double *x,
                           expect *e)
{
    size_t d = W.d, heads = W.heads, hd = W.hd, len = kv->len, keys = len + 1;
    const sparams *p = &W.params[layer->pset];
    double proj[3][MAX_B * MAX_D];
    static const char *const names[3] = {"query", "key", "value"};
    for (int which = 0; which < 3; which++) {
        for (size_t lane = 0; lane < batch; lane++) {
            s_project(x + lane * d, p->w[which], d, proj[which] + lane * d);
        }
    }
    for (int which = 0; which < 3; which++) {
        size_t at = first_nonfinite(proj[which], batch * d);
        if (at < batch * d) {
            return set_nonfinite(e, KVP_NONFINITE_PROJECTION, names[which], at);
        }
    }
    double *q = proj[0], *k = proj[1], *v = proj[2];
    for (size_t lane = 0; lane < batch; lane++) {
        for (size_t h = 0; h < heads; h++) {
            s_rope(layer->base, hd, q + lane * d + h * hd, len);
            s_rope(layer->base, hd, k + lane * d + h * hd, len);
        }
    }
    double scale = 1.0 / sqrt((double)hd);
    double scores[MAX_B * MAX_H * (MAX_CAP + 1)];
    for (size_t lane = 0; lane < batch; lane++) {
        for (size_t h = 0; h < heads; h++) {
            double *row = scores + (lane * heads + h) * keys;
            const double *query = q + lane * d + h * hd;
            for (size_t t = 0; t < len; t++) {
                row[t] = s_dot(query, kv->k[lane][h][t], hd) * scale;
            }
            row[len] = s_dot(query, k + lane * d + h * hd, hd) * scale;
        }
    }
    size_t at = first_nonfinite(scores, batch * heads * keys);
    if (at < batch * heads * keys) {
        return set_nonfinite(e, KVP_NONFINITE_SCORE, "score", at);
    }
    double merged[MAX_B * MAX_D];
    for (size_t lane = 0; lane < batch; lane++) {
        for (size_t h = 0; h < heads; h++) {
            double *row = scores + (lane * heads + h) * keys;
            double max = row[0];
            for (size_t t = 1; t < keys; t++) {
                if (row[t] > max) {
                    max = row[t];
                }
            }
            double sum = 0.0;
            for (size_t t = 0; t < keys; t++) {
                row[t] = exp(row[t] - max);
                sum += row[t];
            }
            for (size_t t = 0; t < keys; t++) {
                row[t] /= sum;
            }
            double *head = merged + lane * d + h * hd;
            for (size_t f = 0; f < hd; f++) {
                head[f] = 0.0;
            }
            for (size_t t = 0; t < len; t++) {
                s_axpy(head, row[t], kv->v[lane][h][t], hd);
            }
            s_axpy(head, row[len], v + lane * d + h * hd, hd);
        }
    }
    for (size_t lane = 0; lane < batch; lane++) {
        s_project(merged + lane * d, p->w[KVP_PARAM_OUTPUT], d, e->out + lane * d);
    }
    at = first_nonfinite(e->out, batch * d);
    if (at < batch * d) {
        return set_nonfinite(e, KVP_NONFINITE_OUTPUT, "output", at);
    }
    /* [B, H, 1, d_h] flattens like [B, D]. */
    at = first_nonfinite(k, batch * d);
    if (at < batch * d) {
        return set_nonfinite(e, KVP_NONFINITE_KEY, NULL, at);
    }
    at = first_nonfinite(v, batch * d);
    if (at < batch * d) {
        return set_nonfinite(e, KVP_NONFINITE_VALUE, NULL, at);
    }
    memcpy(e->key, k, batch * d * sizeof *k);
    memcpy(e->value, v, batch * d * sizeof *v);
    e->status = KVP_OK;
    return KVP_OK;
}

static void skv_append(skv *kv, size_t batch, const double *key, const double *value)
{
    for (size_t lane = 0; lane < batch; lane++) {
        for (size_t h = 0; h < W.heads; h++) {
            memcpy(kv->k[lane][h][kv->len], key + lane * W.d + h * W.hd, W.hd * sizeof *key);
            memcpy(kv->v[lane][h][kv->len], value + lane * W.d + h * W.hd, W.hd * sizeof *value);
        }
    }
    kv->len++;
}

/* The first parameter whose revision a binding captured differs from now, or -1. */
static int stale_parameter(const uint64_t *captured, int pset)
{
    for (int p = 0; p < KVP_PARAM_COUNT; p++) {
        if (captured[p] != W.params[pset].version[p]) {
            return p;
        }
    }
    return -1;
}

/* ---- checks shared by every operation ----------------------------------- */

/*
 * got within TOLERANCE of want, relative to `scale` (at least |want| and 1).
 * The library and the shadow may differ in the last bits of a step (the
 * library's vector exp against libm's): an element that cancels to far
 * below its row's other elements keeps the absolute error of the row's
 * terms, so compare_rows passes its row's largest |want|.
 */
static int close_enough(double got, double want, double scale)
{
    scale = fabs(want) > scale ? fabs(want) : scale;
    scale = scale > 1.0 ? scale : 1.0;
    return fabs(got - want) <= TOLERANCE * scale;
}

/* The largest |want| of the `row`-element row holding element i. */
static double row_scale(const double *want, size_t n, size_t row, size_t i)
{
    size_t first = i - i % row;
    size_t end = first + row < n ? first + row : n;
    double scale = 0.0;
    for (size_t j = first; j < end; j++) {
        scale = fabs(want[j]) > scale ? fabs(want[j]) : scale;
    }
    return scale;
}

/* Rows of W.d outputs (or the whole block when n is not a multiple of it). */
static void compare_rows(const char *what, const double *got, const double *want, size_t n)
{
    size_t row = W.d != 0 && n % W.d == 0 ? W.d : n;
    for (size_t i = 0; i < n; i++) {
        CHECK(close_enough(got[i], want[i], row_scale(want, n, row, i)),
              "%s[%zu] = %.17g, expected %.17g", what, i, got[i], want[i]);
    }
}

/* Compares the error detail the shadow predicted for a failed prepare. */
static void check_detail(const kvp_error *err, const expect *e)
{
    CHECK(err->status == e->status, "err.status %s, expected %s", kvp_status_name(err->status),
          kvp_status_name(e->status));
    switch (e->status) {
    case KVP_NONFINITE_PROJECTION:
        CHECK(err->what != NULL && strcmp(err->what, e->what) == 0,
              "non-finite projection names %s, expected %s", err->what ? err->what : "NULL",
              e->what);
        /* fall through */
    case KVP_NONFINITE_SCORE:
    case KVP_NONFINITE_OUTPUT:
    case KVP_NONFINITE_KEY:
    case KVP_NONFINITE_VALUE:
        CHECK(err->index == e->index, "non-finite index %zu, expected %zu", err->index, e->index);
        CHECK(!isfinite(err->value), "non-finite error reports a finite value %g", err->value);
        break;
    case KVP_CACHE_LAYER_REVISION_MISMATCH:
        CHECK(err->parameter == e->parameter, "stale parameter %zu, expected %zu",
              err->parameter, e->parameter);
        break;
    default:
        break;
    }
}

static uint64_t cache_digest(const kvp_cache *cache)
{
    uint64_t digest = 0;
    kvp_error err;
    int auditing = g_auditing;
    g_auditing = 1;
    kvp_status status = kvp_cache_digest(cache, &digest, &err);
    check_status(status, KVP_OK, &err);
    g_auditing = auditing;
    return digest;
}

/* Digests of every live cache, the standalone ones and each sequence's layers. */
typedef struct digests {
    uint64_t cache[N_CACHES];
    uint64_t seq[N_SEQS][MAX_MODEL];
} digests;

static void take_digests(digests *out)
{
    memset(out, 0, sizeof *out);
    for (int i = 0; i < N_CACHES; i++) {
        if (W.cache[i].live) {
            out->cache[i] = cache_digest(W.cache[i].cache);
        }
    }
    for (int i = 0; i < N_SEQS; i++) {
        for (size_t l = 0; W.seq[i].live && l < W.layers; l++) {
            out->seq[i][l] = cache_digest(kvp_sequence_cache(W.seq[i].seq, l));
        }
    }
}

static void check_unchanged(const digests *before)
{
    digests now;
    take_digests(&now);
    for (int i = 0; i < N_CACHES; i++) {
        CHECK(now.cache[i] == before->cache[i], "a failed call changed cache slot %d", i);
    }
    for (int i = 0; i < N_SEQS; i++) {
        for (size_t l = 0; l < W.layers; l++) {
            CHECK(now.seq[i][l] == before->seq[i][l],
                  "a failed call changed layer %zu of sequence slot %d", l, i);
        }
    }
}

static void on_mismatch(void *ctx, const kvp_mismatch *mismatch)
{
    (void)ctx;
    char text[256];
    kvp_mismatch_format(mismatch, text, sizeof text);
    fprintf(stderr, "kvpager fuzz: audit: %s\n", text);
}

static void check_cache_rows(int slot)
{
    const scache *c = &W.cache[slot];
    double rows[MAX_B * MAX_H * MAX_CAP * MAX_D];
    size_t n = c->batch * W.heads * c->kv.len * W.hd;
    kvp_error err;
    for (int which = 0; which < 2; which++) {
        kvp_status status = which == 0 ? kvp_cache_keys(c->cache, rows, n, &err)
                                       : kvp_cache_values(c->cache, rows, n, &err);
        check_status(status, KVP_OK, &err);
        for (size_t lane = 0; lane < c->batch; lane++) {
            for (size_t h = 0; h < W.heads; h++) {
                for (size_t t = 0; t < c->kv.len; t++) {
                    const double *got = rows + ((lane * W.heads + h) * c->kv.len + t) * W.hd;
                    const double *want = which == 0 ? c->kv.k[lane][h][t] : c->kv.v[lane][h][t];
                    compare_rows(which == 0 ? "cache key" : "cache value", got, want, W.hd);
                }
            }
        }
    }
}

/*
 * The page tables through kvp_cache_page: every mapped (lane, block) names a
 * page of this pool that no other table names, and the first unmapped block
 * and lane are OUT_OF_RANGE.
 */
static void check_tables(const kvp_cache *cache, size_t batch, size_t len, unsigned char *seen)
{
    size_t blocks = blocks_for(len);
    uint32_t page = UINT32_MAX;
    kvp_error err;
    for (size_t lane = 0; lane < batch; lane++) {
        for (size_t block = 0; block < blocks; block++) {
            kvp_status status = kvp_cache_page(cache, lane, block, &page, &err);
            check_status(status, KVP_OK, &err);
            CHECK(page < W.total, "lane %zu block %zu maps page %u of %zu", lane, block,
                  (unsigned)page, W.total);
            CHECK(!seen[page], "page %u is mapped twice", (unsigned)page);
            seen[page] = 1;
        }
        kvp_status status = kvp_cache_page(cache, lane, blocks, &page, &err);
        check_status(status, KVP_OUT_OF_RANGE, &err);
    }
    kvp_status status = kvp_cache_page(cache, batch, 0, &page, &err);
    check_status(status, KVP_OUT_OF_RANGE, &err);
}

/*
 * A sequence layer's tables: every shadow page id stands for one library page
 * and back (ids[] and pages[] fill as they are met), sharing exactly as the
 * shadow says; no standalone cache's page (`seen`) among them.
 */
static void check_seq_tables(const sseq *s, size_t l, int *ids, int *pages,
                             const unsigned char *seen)
{
    const kvp_cache *cache = kvp_sequence_cache(s->seq, l);
    size_t blocks = blocks_for(s->kv[0].len);
    kvp_error err;
    for (size_t b = 0; b < s->batch; b++) {
        for (size_t block = 0; block < blocks; block++) {
            uint32_t page = UINT32_MAX;
            kvp_status status = kvp_cache_page(cache, b, block, &page, &err);
            check_status(status, KVP_OK, &err);
            CHECK(page < W.total && !seen[page], "layer %zu lane %zu block %zu maps page %u", l,
                  b, block, (unsigned)page);
            int id = s->table[l][b][block];
            CHECK(W.page[id].used && W.page[id].refs > 0, "the shadow maps a dead page id %d", id);
            if (ids[page] < 0 && pages[id] < 0) {
                ids[page] = id;
                pages[id] = (int)page;
            }
            CHECK(ids[page] == id && pages[id] == (int)page,
                  "layer %zu lane %zu block %zu: page %u, shadow id %d (pages shared otherwise "
                  "than the shadow says)",
                  l, b, block, (unsigned)page, id);
        }
        uint32_t page = UINT32_MAX;
        kvp_status status = kvp_cache_page(cache, b, blocks, &page, &err);
        check_status(status, KVP_OUT_OF_RANGE, &err);
    }
}

/* Everything the shadow knows about, against the library, after every operation. */
static void check_world(void)
{
    g_auditing = 1;
    size_t caches = 0, reservations = 0;
    unsigned char seen[64];
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < N_CACHES; i++) {
        const scache *c = &W.cache[i];
        if (!c->live) {
            continue;
        }
        caches++;
        CHECK(kvp_cache_len(c->cache) == c->kv.len, "cache slot %d len %zu, expected %zu", i,
              kvp_cache_len(c->cache), c->kv.len);
        kvp_cache_info info;
        kvp_cache_info_init(&info);
        kvp_error err;
        kvp_status status = kvp_cache_info_get(c->cache, &info, &err);
        check_status(status, KVP_OK, &err);
        CHECK(info.mapped_pages == c->batch * blocks_for(c->kv.len),
              "cache slot %d maps %zu pages, expected %zu", i, info.mapped_pages,
              c->batch * blocks_for(c->kv.len));
        CHECK(info.capacity == c->capacity && info.batch_size == c->batch,
              "cache slot %d geometry changed", i);
        check_cache_rows(i);
        check_tables(c->cache, c->batch, c->kv.len, seen);
    }
    for (int i = 0; i < N_TICKETS; i++) {
        const sticket *t = &W.ticket[i];
        if (!t->live) {
            continue;
        }
        reservations += t->reserved != 0;
        kvp_attention_result result;
        kvp_error err;
        kvp_status status = kvp_ticket_result(t->ticket, &result, &err);
        check_status(status, t->state == T_EMPTY ? KVP_TICKET_EMPTY : KVP_OK, &err);
        if (status == KVP_OK) {
            CHECK(result.reserved_pages == t->reserved, "ticket slot %d reserves %zu, expected %zu",
                  i, result.reserved_pages, t->reserved);
            CHECK(result.committed == (t->state == T_COMMITTED),
                  "ticket slot %d committed flag %d", i, result.committed);
            CHECK(result.keys == t->len_at + 1, "ticket slot %d keys %zu, expected %zu", i,
                  result.keys, t->len_at + 1);
        }
    }
    int ids[64];
    int pages[MAX_SPAGES];
    memset(ids, 0xff, sizeof ids);
    memset(pages, 0xff, sizeof pages);
    for (int i = 0; i < N_SEQS; i++) {
        const sseq *s = &W.seq[i];
        if (!s->live) {
            continue;
        }
        caches += W.layers;
        size_t len = s->kv[0].len;
        CHECK(kvp_sequence_len(s->seq) == len, "sequence slot %d len %zu, expected %zu", i,
              kvp_sequence_len(s->seq), len);
        size_t held = W.layers * s->batch * blocks_for(len);
        CHECK(kvp_sequence_held_pages(s->seq) == held, "sequence slot %d holds %zu, expected %zu",
              i, kvp_sequence_held_pages(s->seq), held);
        CHECK(kvp_sequence_promised_pages(s->seq) == s->promise,
              "sequence slot %d promised %zu, expected %zu", i,
              kvp_sequence_promised_pages(s->seq), s->promise);
        for (size_t l = 0; l < W.layers; l++) {
            CHECK(kvp_cache_len(kvp_sequence_cache(s->seq, l)) == len,
                  "sequence slot %d layer %zu len differs", i, l);
            check_seq_tables(s, l, ids, pages, seen);
        }
        CHECK(kvp_sequence_cache(s->seq, W.layers) == NULL, "sequence slot %d has a layer %zu",
              i, W.layers);
        for (size_t more = 0; more <= 3; more++) {
            size_t want = seq_pages_for(s, len + more);
            CHECK(kvp_sequence_pages_for(s->seq, len + more) == want,
                  "sequence slot %d pages_for(%zu) = %zu, expected %zu", i, len + more,
                  kvp_sequence_pages_for(s->seq, len + more), want);
        }
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvp_error err;
    kvp_status status = kvp_pool_stats_get(W.pool, &stats, &err);
    check_status(status, KVP_OK, &err);
    CHECK(stats.total_pages == W.total, "total pages %zu, expected %zu", stats.total_pages,
          W.total);
    size_t held = held_pages(), evictable = evictable_pages();
    CHECK(stats.held_pages == held, "held pages %zu, expected %zu", stats.held_pages, held);
    CHECK(stats.free_pages == W.total - held - evictable, "free pages %zu, expected %zu",
          stats.free_pages, W.total - held - evictable);
    CHECK(stats.evictable_pages == evictable, "evictable pages %zu, expected %zu",
          stats.evictable_pages, evictable);
    CHECK(stats.cached_pages == cached_pages(), "cached pages %zu, expected %zu",
          stats.cached_pages, cached_pages());
    CHECK(stats.prefix_hits == W.hits && stats.prefix_misses == W.misses,
          "prefix hits %llu misses %llu, expected %llu %llu",
          (unsigned long long)stats.prefix_hits, (unsigned long long)stats.prefix_misses,
          (unsigned long long)W.hits, (unsigned long long)W.misses);
    CHECK(stats.evictions == W.evictions, "evictions %llu, expected %llu",
          (unsigned long long)stats.evictions, (unsigned long long)W.evictions);
    CHECK(stats.cow_copies == W.cow_copies, "cow copies %llu, expected %llu",
          (unsigned long long)stats.cow_copies, (unsigned long long)W.cow_copies);
    CHECK(stats.promised_pages == promised_total(), "promised pages %zu, expected %zu",
          stats.promised_pages, promised_total());
    CHECK(stats.attached_caches == caches, "attached caches %zu, expected %zu",
          stats.attached_caches, caches);
    CHECK(stats.attached_reservations == reservations, "attached reservations %zu, expected %zu",
          stats.attached_reservations, reservations);
    CHECK(stats.acquires == W.acquires, "acquires %llu, expected %llu",
          (unsigned long long)stats.acquires, (unsigned long long)W.acquires);
    CHECK(stats.releases == W.releases, "releases %llu, expected %llu",
          (unsigned long long)stats.releases, (unsigned long long)W.releases);
    CHECK(stats.exhaustions == W.exhaustions, "exhaustions %llu, expected %llu",
          (unsigned long long)stats.exhaustions, (unsigned long long)W.exhaustions);
    CHECK(stats.high_water_pages == W.high_water, "high water %zu, expected %zu",
          stats.high_water_pages, W.high_water);
    status = kvp_pool_check(W.pool, on_mismatch, NULL, &err);
    check_status(status, KVP_OK, &err);
    g_auditing = 0;
}

/* A kvp_error full of a pattern, to prove a successful call left it alone. */
static void poison(kvp_error *err)
{
    memset(err, 0xA5, sizeof *err);
}

static void check_untouched(const kvp_error *err)
{
    kvp_error pattern;
    poison(&pattern);
    CHECK(memcmp(err, &pattern, sizeof pattern) == 0, "a successful call wrote *err");
}

/* ---- operations ---------------------------------------------------------- */

static void op_cache_create(reader *r)
{
    int slot = rd(r) % N_CACHES;
    uint8_t layer_byte = rd(r);
    int layer = layer_byte % N_LAYERS;
    /* Now and then a binding that is inconsistent (6) or of another geometry (7). */
    int tamper = layer_byte < 248 ? 0 : 6 + layer_byte % 2;
    uint8_t b = rd(r);
    size_t batch = b < 8 ? 0 : 1 + b % MAX_B;
    size_t capacity = rd(r) % (MAX_CAP + 2); /* 0 and MAX_POSITIONS + 1 are refused */
    if (W.cache[slot].live) {
        return;
    }
    g_op_name = "cache_create";
    kvp_binding binding;
    kvp_error err;
    kvp_status status = kvp_layer_binding_get(W.layer[layer].layer, &binding, &err);
    check_status(status, KVP_OK, &err);
    kvp_status want = batch == 0      ? KVP_ZERO_BATCH_SIZE
                      : capacity == 0 ? KVP_ZERO_CAPACITY
                      : capacity > MAX_POSITIONS ? KVP_CAPACITY_EXCEEDS_POSITIONS
                                                 : KVP_OK;
    if (tamper == 6) {
        binding.kind = 0; /* neither kind: refused first */
        want = KVP_INVALID_ARGUMENT;
    } else if (tamper == 7) {
        binding.kv_heads = W.alien_heads; /* a valid MHA page geometry of another pool */
        binding.head_width = W.d / W.alien_heads;
        want = want != KVP_OK ? want : KVP_GEOMETRY_MISMATCH;
    }
    kvp_cache *sentinel = (kvp_cache *)&W, *cache = sentinel;
    poison(&err);
    status = kvp_cache_create(W.pool, &binding, batch, capacity, &cache, &err);
    check_status(status, want, &err);
    if (status != KVP_OK) {
        CHECK(cache == sentinel, "a failed cache_create wrote *out");
        return;
    }
    check_untouched(&err);
    scache *c = &W.cache[slot];
    memset(c, 0, sizeof *c);
    c->cache = cache;
    c->live = 1;
    c->layer = layer;
    c->batch = batch;
    c->capacity = capacity;
    c->uid = ++W.next_uid;
    memcpy(c->version, W.params[W.layer[layer].pset].version, sizeof c->version);
}

static void op_cache_destroy(reader *r)
{
    scache *c = &W.cache[rd(r) % N_CACHES];
    if (!c->live) {
        return;
    }
    g_op_name = "cache_destroy";
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_cache_destroy(c->cache, &err);
    check_status(status, KVP_OK, &err);
    check_untouched(&err);
    give_pages(c->batch * blocks_for(c->kv.len));
    c->live = 0;
}

static void op_cache_reset(reader *r)
{
    scache *c = &W.cache[rd(r) % N_CACHES];
    if (!c->live) {
        return;
    }
    g_op_name = "cache_reset";
    kvp_error err;
    kvp_status status = kvp_cache_reset(c->cache, &err);
    check_status(status, KVP_OK, &err);
    give_pages(c->batch * blocks_for(c->kv.len));
    c->kv.len = 0;
    c->epoch++;
}

/* Truncate: to a shorter length (pages past it back, epoch on), the same (no-op), or past the end. */
static void op_cache_truncate(reader *r)
{
    scache *c = &W.cache[rd(r) % N_CACHES];
    size_t new_len = rd(r);
    if (!c->live) {
        return;
    }
    new_len %= c->kv.len + 2;
    g_op_name = "cache_truncate";
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_cache_truncate(c->cache, new_len, &err);
    check_status(status, new_len > c->kv.len ? KVP_OUT_OF_RANGE : KVP_OK, &err);
    if (status != KVP_OK) {
        return;
    }
    check_untouched(&err);
    give_pages(c->batch * (blocks_for(c->kv.len) - blocks_for(new_len)));
    if (new_len < c->kv.len) {
        c->epoch++;
    }
    c->kv.len = new_len;
}

static void op_ticket_create(reader *r)
{
    sticket *t = &W.ticket[rd(r) % N_TICKETS];
    const scache *c = &W.cache[rd(r) % N_CACHES];
    if (t->live || !c->live) {
        return;
    }
    g_op_name = "ticket_create";
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_ticket_create(c->cache, &t->ticket, &err);
    check_status(status, KVP_OK, &err);
    check_untouched(&err);
    t->live = 1;
    t->batch = c->batch;
    t->capacity = c->capacity;
    t->state = T_EMPTY;
    t->reserved = 0;
    t->borrowed_count = 0;
}

static void op_ticket_destroy(reader *r)
{
    sticket *t = &W.ticket[rd(r) % N_TICKETS];
    if (!t->live) {
        return;
    }
    g_op_name = "ticket_destroy";
    kvp_error err;
    kvp_status status = kvp_ticket_destroy(t->ticket, &err);
    check_status(status, KVP_OK, &err);
    give_ticket_pages(t);
    t->live = 0;
}

static void op_ticket_discard(reader *r)
{
    sticket *t = &W.ticket[rd(r) % N_TICKETS];
    if (!t->live) {
        return;
    }
    g_op_name = "ticket_discard";
    kvp_error err;
    kvp_status status = kvp_ticket_discard(t->ticket, &err);
    check_status(status, KVP_OK, &err);
    give_ticket_pages(t);
    t->state = T_EMPTY;
}

/* Commit's refusals, in the documented order. */
static kvp_status expect_commit(const sticket *t, const scache *c)
{
    if (t->state != T_PREPARED) {
        return KVP_TICKET_EMPTY;
    }
    if (t->cache_uid != c->uid) {
        return KVP_TICKET_FOREIGN_CACHE;
    }
    if (t->cache_epoch != c->epoch) {
        return KVP_TICKET_STALE;
    }
    return KVP_OK;
}

static void apply_commit(sticket *t, scache *c)
{
    memcpy(c->x[c->kv.len], t->x, sizeof t->x);
    skv_append(&c->kv, c->batch, t->key, t->value);
    c->epoch++;
    map_ticket_pages(t); /* the reserved pages moved into the cache's tables */
    t->state = T_COMMITTED;
}

static void op_commit(reader *r)
{
    sticket *t = &W.ticket[rd(r) % N_TICKETS];
    scache *c = &W.cache[rd(r) % N_CACHES];
    if (!t->live || !c->live) {
        return;
    }
    g_op_name = "ticket_commit";
    kvp_status want = expect_commit(t, c);
    digests before;
    take_digests(&before);
    kvp_error err;
    poison(&err);
    kvp_status status = kvp_ticket_commit(t->ticket, c->cache, &err);
    check_status(status, want, &err);
    if (status != KVP_OK) {
        check_unchanged(&before);
        return;
    }
    check_untouched(&err);
    apply_commit(t, c);
}

enum { SHAPE_OK, SHAPE_RANK, SHAPE_TOKENS, SHAPE_BATCH, SHAPE_WIDTH };

/* prepare's checks before any arithmetic, in the seed's order, then the math. */
static kvp_status expect_prepare(int shape, int alien, const slayer *layer, const scache *c,
                                 const sticket *t, const double *x, expect *e)
{
    memset(e, 0, sizeof *e);
    static const kvp_status shape_status[] = {KVP_OK, KVP_INPUT_RANK, KVP_SINGLE_TOKEN_REQUIRED,
                                              KVP_INPUT_BATCH_MISMATCH,
                                              KVP_INPUT_WIDTH_MISMATCH};
    if (shape != SHAPE_OK) {
        return e->status = shape_status[shape];
    }
    if (alien) {
        return e->status = alien == 1 ? KVP_CACHE_HEAD_COUNT_MISMATCH
                                      : KVP_CACHE_MODEL_WIDTH_MISMATCH;
    }
    const slayer *bound = &W.layer[c->layer];
    if (layer->pset != bound->pset) {
        return e->status = KVP_CACHE_LAYER_MISMATCH;
    }
    int stale = stale_parameter(c->version, layer->pset);
    if (stale >= 0) {
        e->parameter = (size_t)stale;
        return e->status = KVP_CACHE_LAYER_REVISION_MISMATCH;
    }
    if (layer->base != bound->base) {
        return e->status = KVP_CACHE_ROPE_MISMATCH;
    }
    if (c->kv.len == c->capacity) {
        return e->status = KVP_FULL;
    }
    if (t->state == T_PREPARED) {
        return e->status = KVP_TICKET_BUSY;
    }
    if (t->batch != c->batch || t->capacity < c->capacity) {
        return e->status = KVP_TICKET_GEOMETRY_MISMATCH;
    }
    if (s_attend(layer, &c->kv, c->batch, x, e) != KVP_OK) {
        return e->status;
    }
    size_t needed = c->kv.len % W.bt == 0 ? c->batch : 0;
    if (needed > free_pages()) {
        return e->status = KVP_POOL_EXHAUSTED;
    }
    return e->status = KVP_OK;
}

/* The prepared row against the full-prefix reference on the shadow's inputs. */
static void compare_with_reference(const slayer *layer, const scache *c, const sticket *t,
                                   const expect *e)
{
    kvp_attention_result result;
    kvp_error err;
    g_auditing = 1;
    kvp_status status = kvp_ticket_result(t->ticket, &result, &err);
    check_status(status, KVP_OK, &err);
    size_t d = W.d, tokens = c->kv.len + 1;
    CHECK(result.keys == tokens, "result keys %zu, expected %zu", result.keys, tokens);
    compare_rows("output vs shadow", result.output, e->out, c->batch * d);

    double input[MAX_B * (MAX_CAP + 1) * MAX_D];
    double output[MAX_B * (MAX_CAP + 1) * MAX_D];
    for (size_t lane = 0; lane < c->batch; lane++) {
        for (size_t pos = 0; pos < tokens; pos++) {
            const double *row = pos < c->kv.len ? c->x[pos] : t->x;
            memcpy(input + (lane * tokens + pos) * d, row + lane * d, d * sizeof *row);
        }
    }
    kvp_tensor view = kvp_tensor3(input, c->batch, tokens, d);
    status = kvp_attention_reference(layer->layer, &view, output, c->batch * tokens * d, NULL,
                                     NULL, 0, &err);
    check_status(status, KVP_OK, &err);
    for (size_t lane = 0; lane < c->batch; lane++) {
        compare_rows("output vs kvp_attention_reference", result.output + lane * d,
                     output + (lane * tokens + tokens - 1) * d, d);
    }
    g_auditing = 0;
}

/* Shared by prepare and forward: decode, predict, call, check, apply. */
static void prepare_or_forward(reader *r, int forward)
{
    uint8_t sel = rd(r);
    scache *c = &W.cache[rd(r) % N_CACHES];
    sticket *t = &W.ticket[rd(r) % N_TICKETS];
    uint8_t shape_byte = rd(r);
    int shape = shape_byte < 240 ? SHAPE_OK : 1 + shape_byte % 4;
    double x[2 * (MAX_B + 1) * (MAX_D + 2)];
    memset(x, 0, sizeof x);
    if (!c->live || !t->live) {
        return;
    }
    read_values(r, x, c->batch * W.d);
    g_op_name = forward ? "attention_forward" : "attention_prepare";
    int which = sel % 8 < 6 ? c->layer : (c->layer + 1 + sel % 2) % N_LAYERS;
    const slayer *layer = &W.layer[which];
    int alien = sel % 16 == 15 ? 1 : sel % 16 == 14 ? 2 : 0; /* W.alien, W.wide */

    kvp_tensor input = kvp_tensor3(x, c->batch, 1, W.d);
    if (shape == SHAPE_RANK) {
        input.shape.rank = 2;
        input.shape.dims[1] = W.d;
    } else if (shape == SHAPE_TOKENS) {
        input.shape.dims[1] = 2;
    } else if (shape == SHAPE_BATCH) {
        input.shape.dims[0] = c->batch + 1;
    } else if (shape == SHAPE_WIDTH) {
        input.shape.dims[2] = W.d + 2;
    } else if (alien == 2) {
        input.shape.dims[2] = 2 * W.d; /* the wide layer's width */
    }
    expect e;
    kvp_status want = expect_prepare(shape, alien, layer, c, t, x, &e);
    digests before;
    take_digests(&before);
    kvp_error err;
    poison(&err);
    const kvp_layer *callee = alien == 1 ? W.alien : alien == 2 ? W.wide : layer->layer;
    kvp_status status = forward ? kvp_attention_forward(callee, &input, c->cache, t->ticket, &err)
                                : kvp_attention_prepare(callee, &input, c->cache, t->ticket, &err);
    check_status(status, want, &err);
    if (status != KVP_OK) {
        check_detail(&err, &e);
        if (want == KVP_POOL_EXHAUSTED) {
            W.exhaustions++;
            CHECK(err.needed == c->batch && err.available == free_pages(),
                  "exhausted: needed %zu available %zu, expected %zu and %zu", err.needed,
                  err.available, c->batch, free_pages());
        }
        check_unchanged(&before);
        /* A ticket holding a prepared row keeps it; any other ends up empty. */
        if (t->state != T_PREPARED) {
            t->state = T_EMPTY;
        }
        return;
    }
    check_untouched(&err);
    size_t needed = c->kv.len % W.bt == 0 ? c->batch : 0;
    CHECK(t->reserved == 0 && t->borrowed_count == 0, "a prepare over a reservation");
    take_pages(t, needed);
    t->state = T_PREPARED;
    t->reserved = needed;
    t->cache_uid = c->uid;
    t->cache_epoch = c->epoch;
    t->len_at = c->kv.len;
    memcpy(t->key, e.key, sizeof t->key);
    memcpy(t->value, e.value, sizeof t->value);
    memcpy(t->x, x, c->batch * W.d * sizeof *x);
    compare_with_reference(layer, c, t, &e);
    if (forward) {
        apply_commit(t, c);
    }
}

static void op_prepare(reader *r)
{
    prepare_or_forward(r, 0);
}

static void op_forward(reader *r)
{
    prepare_or_forward(r, 1);
}

/* ---- sequences ------------------------------------------------------------ */


static void op_seq_create(reader *r)
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

static void op_seq_destroy(reader *r)
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

static void op_seq_reset(reader *r)
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

static void op_seq_truncate(reader *r)
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

static void op_seq_promise(reader *r)
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

static void op_seq_step(reader *r)
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

static void op_seq_prefill(reader *r)
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

static void op_seq_fork(reader *r)
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

/* The shadow key of block j of lane b of layer l, for a [B, T, D] prompt. */
static void make_key(const uint64_t version[MAX_MODEL][KVP_PARAM_COUNT], size_t l,
                     const double *prompt, size_t tokens, size_t b, size_t j, skey *out)
{
    memset(out, 0, sizeof *out);
    out->layer = l;
    memcpy(out->version, version, sizeof out->version);
    out->tokens = (j + 1) * W.bt;
    memcpy(out->rows, prompt + b * tokens * W.d, out->tokens * W.d * sizeof(double));
}

static int key_eq(const skey *a, const skey *b)
{
    return a->layer == b->layer && a->tokens == b->tokens &&
           memcmp(a->version, b->version, sizeof a->version) == 0 &&
           memcmp(a->rows, b->rows, a->tokens * W.d * sizeof(double)) == 0;
}

/* The registered page under `key` that lookups find (borrowed ones are skipped), or -1. */
static int index_find(const skey *key)
{
    for (int i = 0; i < MAX_SPAGES; i++) {
        if (W.page[i].used && W.page[i].registered && !W.page[i].borrowed &&
            key_eq(&W.page[i].key, key)) {
            return i;
        }
    }
    return -1;
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
static void op_seq_publish(reader *r)
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
static void op_seq_adopt(reader *r)
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

static void op_admit(reader *r)
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

static void op_param_update(reader *r)
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
static void op_decoder_step(reader *r)
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
