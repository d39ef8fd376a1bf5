/*
 * trace_stats.c: a trace's ceiling and LRU hit rates (see trace_stats.h).
 *
 * Owns: the interning of block keys (an open-addressing hash map from
 * (parent key, id) to a dense key, built and freed within one call), and an
 * LRU list over dense keys (two index arrays, built and freed within one
 * call). A chain key is interned as (the previous block's dense key, id),
 * so equal chains get equal dense keys exactly, with no hash of the chain
 * that could collide; an id alone is (ROOT, id).
 * Invariants: dense keys are numbered 0, 1, ... in order of first
 * reference, so a reference is new exactly when its key equals the count of
 * keys before it; the LRU holds at most `blocks` keys.
 * Callers: see trace_stats.h.
 */
#include "trace_stats.h"

#include <stdint.h>
#include <string.h>

#include "alloc.h"

#define ROOT UINT64_MAX /* the parent of a request's first block, and of every id-alone key */
#define NONE SIZE_MAX   /* no entry, no list neighbour */

typedef struct intern_entry {
    uint64_t parent;
    uint64_t id;
    size_t key; /* NONE: empty slot */
} intern_entry;

static uint64_t mix(uint64_t parent, uint64_t id)
{
    uint64_t z = parent * 0x9E3779B97F4A7C15ull ^ id;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The dense key of (parent, id), numbering it `*distinct` when new. */
static size_t intern(intern_entry *table, size_t mask, uint64_t parent, uint64_t id,
                     size_t *distinct)
{
    for (size_t slot = (size_t)mix(parent, id) & mask;; slot = (slot + 1) & mask) {
        intern_entry *e = &table[slot];
        if (e->key == NONE) {
            *e = (intern_entry){parent, id, (*distinct)++};
            return e->key;
        }
        if (e->parent == parent && e->id == id) {
            return e->key;
        }
    }
}

/* Sum of the requests' block counts; SIZE_MAX on overflow (no allocation can hold it). */
static size_t count_references(const kvp_workload *w)
{
    size_t total = 0;
    for (size_t i = 0; i < w->count; i++) {
        if (w->requests[i].block_count > SIZE_MAX - total) {
            return SIZE_MAX;
        }
        total += w->requests[i].block_count;
    }
    return total;
}

int kvp_trace_keys_build(const kvp_workload *w, kvp_trace_keying keying, kvp_trace_keys *out)
{
    size_t references = count_references(w);
    /* Slots: a power of two at least twice the references (the most keys there can be). */
    size_t slots = 16;
    while (slots < references && slots <= SIZE_MAX / 4) {
        slots *= 2;
    }
    slots *= 2;
    size_t per_reference = sizeof(size_t) + sizeof(uint32_t);
    size_t *key = references > SIZE_MAX / per_reference ? NULL
                                                          : kvp_cli_alloc(references, per_reference);
    intern_entry *table = slots / 2 < references ? NULL : kvp_cli_alloc(slots, sizeof *table);
    if (key == NULL || table == NULL) {
        kvp_cli_free(key);
        kvp_cli_free(table);
        return -1;
    }
    for (size_t s = 0; s < slots; s++) {
        table[s].key = NONE;
    }
    uint32_t *tokens = (uint32_t *)(void *)(key + references);
    size_t distinct = 0;
    size_t next = 0;
    for (size_t i = 0; i < w->count; i++) {
        const kvp_workload_request *r = &w->requests[i];
        uint64_t parent = ROOT;
        for (size_t b = 0; b < r->block_count; b++) {
            size_t k = intern(table, slots - 1, parent, r->block_ids[b], &distinct);
            size_t start = b * KVP_MOONCAKE_BLOCK_TOKENS; /* b < ceil(prompt / 512): no overflow */
            size_t left = r->prompt_tokens > start ? r->prompt_tokens - start : 0;
            tokens[next] = (uint32_t)(left < KVP_MOONCAKE_BLOCK_TOKENS ? left
                                                                       : KVP_MOONCAKE_BLOCK_TOKENS);
            key[next++] = k;
            parent = keying == KVP_TRACE_KEY_CHAIN ? (uint64_t)k : ROOT;
        }
    }
    kvp_cli_free(table);
    *out = (kvp_trace_keys){key, tokens, references, distinct};
    return 0;
}

void kvp_trace_keys_free(kvp_trace_keys *keys)
{
    kvp_cli_free(keys->key);
    *keys = (kvp_trace_keys){NULL, NULL, 0, 0};
}

void kvp_trace_keys_ceiling(const kvp_trace_keys *keys, kvp_trace_hits *out)
{
    /* Each distinct key misses once, at its first reference (where it takes the next
       number); every other reference hits. */
    size_t numbered = 0;
    size_t tokens = 0;
    size_t hit_tokens = 0;
    for (size_t i = 0; i < keys->references; i++) {
        tokens += keys->tokens[i];
        if (keys->key[i] == numbered) {
            numbered++;
        } else {
            hit_tokens += keys->tokens[i];
        }
    }
    *out = (kvp_trace_hits){keys->references, keys->references - keys->distinct, keys->distinct,
                            tokens, hit_tokens};
}

/* The LRU list: prev/next over dense keys, head the most recent, tail the least. */
typedef struct lru_list {
    size_t *prev;
    size_t *next;
    unsigned char *held;
    size_t head;
    size_t tail;
    size_t count;
} lru_list;

static void lru_unlink(lru_list *l, size_t k)
{
    if (l->prev[k] != NONE) {
        l->next[l->prev[k]] = l->next[k];
    } else {
        l->head = l->next[k];
    }
    if (l->next[k] != NONE) {
        l->prev[l->next[k]] = l->prev[k];
    } else {
        l->tail = l->prev[k];
    }
}

static void lru_push_front(lru_list *l, size_t k)
{
    l->prev[k] = NONE;
    l->next[k] = l->head;
    if (l->head != NONE) {
        l->prev[l->head] = k;
    } else {
        l->tail = k;
    }
    l->head = k;
}

/* One reference: 1 when it hits. */
static int lru_reference(lru_list *l, size_t blocks, size_t k)
{
    if (l->held[k]) {
        lru_unlink(l, k);
        lru_push_front(l, k);
        return 1;
    }
    if (blocks == 0) {
        return 0; /* a cache of nothing holds nothing */
    }
    if (l->count == blocks) {
        size_t victim = l->tail;
        lru_unlink(l, victim);
        l->held[victim] = 0;
        l->count--;
    }
    lru_push_front(l, k);
    l->held[k] = 1;
    l->count++;
    return 0;
}

int kvp_trace_keys_lru(const kvp_trace_keys *keys, size_t blocks, kvp_trace_hits *out)
{
    size_t n = keys->distinct;
    size_t per_key = 2 * sizeof(size_t) + 1;
    unsigned char *memory = n > SIZE_MAX / per_key ? NULL : kvp_cli_alloc(n, per_key);
    if (memory == NULL) {
        return -1;
    }
    lru_list l = {.prev = (size_t *)(void *)memory,
                  .next = (size_t *)(void *)(memory + n * sizeof(size_t)),
                  .held = memory + 2 * n * sizeof(size_t),
                  .head = NONE,
                  .tail = NONE};
    memset(l.held, 0, n);
    size_t hits = 0;
    size_t tokens = 0;
    size_t hit_tokens = 0;
    for (size_t i = 0; i < keys->references; i++) {
        tokens += keys->tokens[i];
        if (lru_reference(&l, blocks, keys->key[i])) {
            hits++;
            hit_tokens += keys->tokens[i];
        }
    }
    kvp_cli_free(memory);
    *out = (kvp_trace_hits){keys->references, hits, n, tokens, hit_tokens};
    return 0;
}

int kvp_trace_ceiling(const kvp_workload *w, kvp_trace_keying keying, kvp_trace_hits *out)
{
    kvp_trace_keys keys;
    if (kvp_trace_keys_build(w, keying, &keys) != 0) {
        return -1;
    }
    kvp_trace_keys_ceiling(&keys, out);
    kvp_trace_keys_free(&keys);
    return 0;
}

int kvp_trace_lru(const kvp_workload *w, kvp_trace_keying keying, size_t blocks,
                  kvp_trace_hits *out)
{
    kvp_trace_keys keys;
    if (kvp_trace_keys_build(w, keying, &keys) != 0) {
        return -1;
    }
    int status = kvp_trace_keys_lru(&keys, blocks, out);
    kvp_trace_keys_free(&keys);
    return status;
}

size_t kvp_trace_blocks_of_pages(size_t pages, size_t page_tokens)
{
    if (page_tokens != 0 && pages > SIZE_MAX / page_tokens) {
        return SIZE_MAX;
    }
    return pages * page_tokens / KVP_MOONCAKE_BLOCK_TOKENS;
}

double kvp_trace_rate(const kvp_trace_hits *h)
{
    return h->references == 0 ? 0.0 : (double)h->hits / (double)h->references;
}

double kvp_trace_token_rate(const kvp_trace_hits *h)
{
    return h->tokens == 0 ? 0.0 : (double)h->hit_tokens / (double)h->tokens;
}
