/*
 * fuzz_api_shadow.c: the shadow model of the kvp_fuzz_api target (see
 * fuzz_api.c for the whole target): the world W itself, the shadow's pages
 * (spage: reference counts, the prefix index and its keys, the LRU list of
 * evictable pages, borrowed pages of reservations), the pool's counters as
 * the shadow predicts them, a sequence's page bookkeeping (truncate, copies,
 * copy-on-write, mapping a step's pages), and the shadow's own copy of the
 * documented attention math (projection, RoPE, softmax, non-finite checks).
 *
 * Invariants: W mirrors the library's state after every completed operation;
 * a take follows the library's order (free pages first, then the least
 * recently used cached page, borrowed until mapped); the math does the same
 * operations in the same order as attention.h documents, so a value is
 * finite here exactly when it is finite in the library.
 *
 * Callers: the other fuzz_api*.c files, through fuzz_api.h. Nothing here
 * calls the library; it only predicts it.
 */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_api.h"

world W;

size_t blocks_for(size_t tokens)
{
    return tokens / W.bt + (tokens % W.bt != 0);
}

/* Pages some table or reservation names. */
size_t held_pages(void)
{
    size_t held = W.anon;
    for (int i = 0; i < MAX_SPAGES; i++) {
        held += W.page[i].used && W.page[i].refs > 0;
    }
    return held;
}

size_t evictable_pages(void)
{
    size_t n = 0;
    for (int i = 0; i < MAX_SPAGES; i++) {
        n += W.page[i].used && W.page[i].refs == 0;
    }
    return n;
}

size_t cached_pages(void)
{
    size_t n = 0;
    for (int i = 0; i < MAX_SPAGES; i++) {
        n += W.page[i].used && W.page[i].registered;
    }
    return n;
}

/* What a take can have: free and evictable pages (the pool's "available"). */
size_t free_pages(void)
{
    return W.total - held_pages();
}

void raise_high_water(void)
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
void take_pages(sticket *t, size_t n)
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

void give_pages(size_t n)
{
    W.anon -= n;
    W.releases += n;
}

/* A ticket's reservation goes back unused: its free pages free, its borrowed ones restored. */
void give_ticket_pages(sticket *t)
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
void map_ticket_pages(sticket *t)
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
uint8_t spage_new(void)
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

void spage_ref(uint8_t id)
{
    if (W.page[id].refs++ == 0) {
        W.acquires++; /* an evictable page held again counts as acquired */
        raise_high_water();
    }
}

void spage_put(uint8_t id)
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

size_t promised_total(void)
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
void seq_truncate_to(sseq *s, size_t new_len)
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
size_t seq_copies(const sseq *s)
{
    size_t copies = 0;
    for (size_t l = 0; l < W.layers; l++) {
        copies += s->cow[l] && s->kv[0].len % W.bt != 0 ? s->batch : 0;
    }
    return copies;
}

/* kvp_sequence_pages_for: new blocks of every layer and lane, plus the copies. */
size_t seq_pages_for(const sseq *s, size_t tokens)
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
void forget_written_borrowed(const sseq *s, size_t len, size_t pages, size_t committed)
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
void seq_map_token(sseq *s, const uint8_t *ids, size_t *next,
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
void seq_step_pages(sseq *s, size_t pages)
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

/* The shadow key of block j of lane b of layer l, for a [B, T, D] prompt. */
void make_key(const uint64_t version[MAX_MODEL][KVP_PARAM_COUNT], size_t l,
              const double *prompt, size_t tokens, size_t b, size_t j, skey *out)
{
    memset(out, 0, sizeof *out);
    out->layer = l;
    memcpy(out->version, version, sizeof out->version);
    out->tokens = (j + 1) * W.bt;
    memcpy(out->rows, prompt + b * tokens * W.d, out->tokens * W.d * sizeof(double));
}

int key_eq(const skey *a, const skey *b)
{
    return a->layer == b->layer && a->tokens == b->tokens &&
           memcmp(a->version, b->version, sizeof a->version) == 0 &&
           memcmp(a->rows, b->rows, a->tokens * W.d * sizeof(double)) == 0;
}

/* The registered page under `key` that lookups find (borrowed ones are skipped), or -1. */
int index_find(const skey *key)
{
    for (int i = 0; i < MAX_SPAGES; i++) {
        if (W.page[i].used && W.page[i].registered && !W.page[i].borrowed &&
            key_eq(&W.page[i].key, key)) {
            return i;
        }
    }
    return -1;
}


/* ---- the shadow's copy of the documented math -------------------------- */

/*
 * The same operations in the same order as attention.h documents (y = x W
 * summed over i in order, RoPE over pairs, scaled dot products, a softmax
 * that subtracts the row maximum, values mixed over positions in order), so
 * whether an intermediate is finite is decided exactly as the library's.
 */
void s_project(const double *x, const double *w, size_t d, double *y)
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

size_t first_nonfinite(const double *v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(v[i])) {
            return i;
        }
    }
    return n;
}

kvp_status set_nonfinite(expect *e, kvp_status status, const char *what, size_t index)
{
    e->status = status;
    e->what = what;
    e->index = index;
    return status;
}

/* The incremental computation on `kv` for input x [B][D] through `layer`. */
kvp_status s_attend(const slayer *layer, const skv *kv, size_t batch, const double *x,
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

void skv_append(skv *kv, size_t batch, const double *key, const double *value)
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
int stale_parameter(const uint64_t *captured, int pset)
{
    for (int p = 0; p < KVP_PARAM_COUNT; p++) {
        if (captured[p] != W.params[pset].version[p]) {
            return p;
        }
    }
    return -1;
}
