/*
 * trace_stats.h: reference hit rates of a trace's prefix blocks, computed
 * from the trace alone (the report's ceiling and same-capacity
 * LRU lines).
 *
 * Owns: pure functions over a loaded workload whose requests carry block
 * ids (a Mooncake trace: workload.h, block_ids). The sequence of block
 * references is every request's blocks in list order, each request's in
 * prompt order. A reference hits when its key was referenced before:
 *   - KVP_TRACE_KEY_CHAIN (the figures' rule): a block's key is its id
 *     together with every earlier id of its request, its whole prefix, as
 *     a prefix cache keys a block (kvpager's chain keys cover every earlier
 *     token). A chain never repeats within one request, so "referenced
 *     before" is "referenced by an earlier request".
 *   - KVP_TRACE_KEY_ID: the id alone. Mooncake's ids are prefix hashes
 *     (an id stands for its block and everything before it), so on such a
 *     trace both keyings give the same figures; where they differ, the ids
 *     are not prefix hashes (or repeat within a request).
 * Ceiling: the fraction of references an unbounded cache would hit:
 * (references - distinct keys) / references. Every figure is also weighted
 * by tokens (a hit counts its block's tokens in the referencing request:
 * 512, or fewer for a partial last block), simulate's unit: its prefix hit
 * rate is a fraction of prompt tokens.
 * LRU of N blocks: each reference looks its key up; a hit makes it the most
 * recent; a miss inserts it as the most recent and, when N keys are held,
 * first evicts the least recent. A request's blocks are looked up and
 * inserted one by one in order, not looked up all before any is inserted
 * (the rule that gives the figures; data/traces/README.md). With N at
 * least the distinct keys, it equals the ceiling. Time O(references)
 * expected (one hash map), memory O(references).
 * Callers: the kvpager program's report (simulate), the CLI's tests.
 * Threads: none kept; each call owns what it allocates.
 */
#ifndef KVPAGER_CLI_TRACE_STATS_H
#define KVPAGER_CLI_TRACE_STATS_H

#include <stddef.h>
#include <stdint.h>

#include "workload.h"

typedef enum kvp_trace_keying { KVP_TRACE_KEY_CHAIN, KVP_TRACE_KEY_ID } kvp_trace_keying;

/*
 * A trace's block references as dense keys: key[i] < distinct, numbered by
 * first reference; tokens[i]: the prompt tokens the reference's block holds
 * (KVP_MOONCAKE_BLOCK_TOKENS, or fewer for a request's partial last block).
 * One allocation, `key`.
 */
typedef struct kvp_trace_keys {
    size_t *key;      /* [references] */
    uint32_t *tokens; /* [references], in key's allocation */
    size_t references;
    size_t distinct;
} kvp_trace_keys;

/*
 * A figure: hits of `references`, and the distinct keys among them; and the
 * same weighted by tokens: the hit references' tokens of all references'
 * (the prompt tokens), the unit of simulate's prefix hit rate. A hit counts
 * the tokens its block holds in the referencing request.
 */
typedef struct kvp_trace_hits {
    size_t references;
    size_t hits;
    size_t distinct;
    size_t tokens;
    size_t hit_tokens;
} kvp_trace_hits;

/*
 * Numbers every block reference of `w` by its key under `keying`. Returns 0,
 * or -1 when out of memory (through alloc.h), leaving `out` untouched and
 * nothing allocated. A workload without block ids gives 0 references.
 */
int kvp_trace_keys_build(const kvp_workload *w, kvp_trace_keying keying, kvp_trace_keys *out);
void kvp_trace_keys_free(kvp_trace_keys *keys);

/* The ceiling (no allocation). */
void kvp_trace_keys_ceiling(const kvp_trace_keys *keys, kvp_trace_hits *out);
/* An LRU of `blocks` keys. Returns 0, or -1 when out of memory (nothing allocated). */
int kvp_trace_keys_lru(const kvp_trace_keys *keys, size_t blocks, kvp_trace_hits *out);

/* The same over a workload (keys built and freed inside); 0, or -1 when out of memory. */
int kvp_trace_ceiling(const kvp_workload *w, kvp_trace_keying keying, kvp_trace_hits *out);
int kvp_trace_lru(const kvp_workload *w, kvp_trace_keying keying, size_t blocks,
                  kvp_trace_hits *out);

/*
 * Trace blocks a pool holds: the tokens of `pages` pages of `page_tokens`
 * positions, in whole KVP_MOONCAKE_BLOCK_TOKENS-token blocks (rounded down);
 * SIZE_MAX when the product overflows (an unbounded cache in effect).
 */
size_t kvp_trace_blocks_of_pages(size_t pages, size_t page_tokens);

/* hits / references, and hit_tokens / tokens; 0 for none. */
double kvp_trace_rate(const kvp_trace_hits *h);
double kvp_trace_token_rate(const kvp_trace_hits *h);

#endif /* KVPAGER_CLI_TRACE_STATS_H */
