/*
 * test_share_keys.c: what a prefix-index hit may be trusted for (issue 16):
 * adoption refuses a page published under another binding (forged keys
 * both ways between external and attention caches, two layers over the
 * same parameters at different revisions); an engine's external caches'
 * keys change with its weights' revision; the I5 audit reports a key
 * indexed twice; probe, adopt and publish of a group of caches are all or
 * nothing per block, and publish checks every cache and lane against its
 * own key; salts (one half zero included) keep tenants apart; an update of
 * any parameter of any layer makes the old keys of that layer and every
 * later one unfindable; a block-aligned prompt keeps its last token to
 * compute; an empty prompt is refused as prefill refuses it.
 * kvp_pool_check runs after every operation (kvpt_assert_pool_ok).
 */
#include "share_support.h"

#include <stdlib.h>
#include <string.h>

#include "pager/pool_internal.h"
#include "serve/sequence_internal.h"
#include "serve/share_internal.h"

/* ---- the audit ---------------------------------------------------------------- */

/*
 * A key indexed twice (a second page registered under a key the index
 * holds, which publish never does): the audit names the duplicate, not only
 * the entry a lookup cannot reach. Removing the duplicate heals it.
 */
static void test_share_audit_reports_key_indexed_twice(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 4);
    kvp_cache *a = external_cache(pool, 1, 1);
    append(a, pool, 1, 2 * BT, 0.0);
    kvp_block_key key;
    chain_keys(a, 1, 1, 0.0, &key);
    publish_all(a, pool, 1, 1, &key);
    uint32_t twin = page_of(a, 0, 1);
    kvpi_pool_lock(pool);
    kvpi_prefix_insert_locked(pool, twin, &key, &pool->page_binding[page_of(a, 0, 0)]);
    kvpi_pool_unlock(pool);
    expect_finding(pool, KVP_INVARIANT_PREFIX, "a key is indexed once");
    kvpi_pool_lock(pool);
    kvpi_prefix_remove_locked(pool, twin);
    kvpi_pool_unlock(pool);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_cache(a, pool);
    destroy_pool(pool);
}

/* ---- groups of caches: probe, adopt and publish in one lock hold -------------- */

/* Group keys [(j * 2 + c) * batch + lane] of two caches from each one's chain keys. */
static void group_keys(const kvp_block_key *first, const kvp_block_key *second, size_t batch,
                       size_t blocks, kvp_block_key *out)
{
    for (size_t j = 0; j < blocks; j++) {
        for (size_t lane = 0; lane < batch; lane++) {
            out[(j * 2 + 0) * batch + lane] = first[j * batch + lane];
            out[(j * 2 + 1) * batch + lane] = second[j * batch + lane];
        }
    }
}

/*
 * Group calls are all or nothing where a cache-by-cache loop would split:
 * a publish refused for the second cache registers nothing of the first; an
 * index state where the first cache's two blocks are published but the
 * second's second block is not gives both caches one block (a loop would
 * give them different lengths); a page of another binding in the second
 * cache refuses the adopt in both. Group argument errors change nothing.
 */
static void test_share_group_all_or_nothing(void **state)
{
    (void)state;
    enum { B = 2, BLOCKS = 2 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 32);
    kvp_cache *a = external_cache(pool, B, 1);
    kvp_cache *b = external_cache(pool, B, 2); /* another binding digest */
    append(a, pool, B, BLOCKS * BT, 0.0);
    append(b, pool, B, BLOCKS * BT, 0.5);
    kvp_block_key ka[BLOCKS * B];
    kvp_block_key kb[BLOCKS * B];
    chain_keys(a, B, BLOCKS, 0.0, ka);
    chain_keys(b, B, BLOCKS, 0.5, kb);
    kvp_block_key keys[BLOCKS * 2 * B];
    group_keys(ka, kb, B, BLOCKS, keys);
    kvp_error err;
    /* b's block 1, lane 1 is published under another key first. */
    kvp_block_key other = {0x5eed, 0xbeef};
    kvpt_assert_ok(kvp_cache_publish_block(b, 1, 1, &other, &err), &err);
    kvp_cache *ab[] = {a, b};
    kvp_pool_stats before = kvpt_stats(pool);
    assert_int_equal(kvp_cache_group_publish(ab, 2, keys, BLOCKS, &err), KVP_PAGE_PUBLISHED);
    assert_int_equal(err.layer, 1);
    assert_int_equal(err.index, page_of(b, 1, 1));
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before); /* a's pages not registered */
    /* Block 0 of both, and a's block 1 alone. */
    kvpt_assert_ok(kvp_cache_group_publish(ab, 2, keys, 1, &err), &err);
    kvpt_assert_ok(kvp_cache_publish_block(a, 0, 1, &ka[B], &err), &err);
    kvpt_assert_ok(kvp_cache_publish_block(a, 1, 1, &ka[B + 1], &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).cached_pages, 1 + 2 * B + B);
    kvpt_destroy_cache(b, pool);
    kvpt_destroy_cache(a, pool);

    /* Probe and adopt: one block for both, as the index holds block 1 of the first only. */
    kvp_cache *a2 = external_cache(pool, B, 1);
    kvp_cache *b2 = external_cache(pool, B, 2);
    const kvp_cache *probe[] = {a2, b2};
    size_t blocks = 99;
    size_t evictable = 99;
    kvpt_assert_ok(kvp_cache_group_probe(probe, 2, keys, BLOCKS, &blocks, &evictable, &err),
                   &err);
    assert_int_equal(blocks, 1);
    assert_int_equal(evictable, 2 * B);
    size_t alone = 0;
    kvpt_assert_ok(kvp_cache_group_probe(probe, 1, ka, BLOCKS, &alone, NULL, &err), &err);
    assert_int_equal(alone, 2); /* the first cache alone would take two */
    kvp_cache *ab2[] = {a2, b2};
    size_t hits = kvpt_stats(pool).prefix_hits;
    size_t adopted = 99;
    kvpt_assert_ok(kvp_cache_group_adopt(ab2, 2, keys, BLOCKS, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, 1);
    assert_int_equal(kvp_cache_len(a2), BT);
    assert_int_equal(kvp_cache_len(b2), BT);
    assert_int_equal(kvpt_stats(pool).prefix_hits, hits + 2 * B);
    assert_int_equal(kvpt_stats(pool).evictable_pages, B + 1);

    /* The second cache of the group (binding 1) would adopt pages of binding 2: neither does. */
    kvp_cache *a3 = external_cache(pool, B, 1);
    kvp_cache *c3 = external_cache(pool, B, 1);
    kvp_cache *ac[] = {a3, c3};
    before = kvpt_stats(pool);
    adopted = 99;
    assert_int_equal(kvp_cache_group_adopt(ac, 2, keys, BLOCKS, &adopted, &err),
                     KVP_BLOCK_BINDING_MISMATCH);
    assert_int_equal(err.layer, 1);
    assert_int_equal(err.index, page_of(b2, 0, 0));
    assert_int_equal(adopted, 99);
    assert_int_equal(kvp_cache_len(a3), 0);
    assert_int_equal(kvp_cache_len(c3), 0);
    kvpt_assert_pool_ok(pool);
    after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);

    /* Group errors, nothing changed: no cache, a NULL one, unequal lengths. */
    assert_int_equal(kvp_cache_group_adopt(ac, 0, keys, 1, &adopted, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "count");
    kvp_cache *with_null[] = {a3, NULL};
    assert_int_equal(kvp_cache_group_adopt(with_null, 2, keys, 1, &adopted, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "caches");
    kvp_cache *unequal[] = {a2, a3};
    assert_int_equal(kvp_cache_group_adopt(unequal, 2, keys, 1, &adopted, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "caches");
    assert_int_equal(kvp_cache_group_publish(unequal, 2, keys, 1, &err), KVP_INVALID_ARGUMENT);
    assert_int_equal(kvp_cache_group_publish(ab2, 2, keys, 2, &err), KVP_OUT_OF_RANGE);
    assert_string_equal(err.argument, "blocks");
    const kvp_cache *unequal_probe[] = {a2, a3};
    assert_int_equal(kvp_cache_group_probe(unequal_probe, 2, keys, 1, &blocks, NULL, &err),
                     KVP_INVALID_ARGUMENT);
    kvpt_assert_pool_ok(pool);
    after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
    assert_int_equal(adopted, 99);
    kvpt_destroy_cache(c3, pool);
    kvpt_destroy_cache(a3, pool);
    kvpt_destroy_cache(b2, pool);
    kvpt_destroy_cache(a2, pool);
    destroy_pool(pool);
}

/*
 * Publish checks each block of each cache and lane against its own key
 * (keys[(j * count + c) * batch + lane]), with batch 2 and 2 caches:
 * publishing an already published group again is OK and changes nothing;
 * a page of any one cache and lane (block 1) registered under another key
 * first refuses the whole group with PAGE_PUBLISHED naming that page and
 * cache, registering nothing, for each of the four (cache, lane).
 */
static void test_share_group_publish_checks_each_cache_lane(void **state)
{
    (void)state;
    enum { B = 2, BLOCKS = 2 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 64);
    kvp_error err;
    for (size_t round = 0; round <= 2 * B; round++) {
        double salt = (double)round + 0.25; /* other rows and keys each round */
        kvp_cache *a = external_cache(pool, B, 1);
        kvp_cache *b = external_cache(pool, B, 2);
        append(a, pool, B, BLOCKS * BT, salt);
        append(b, pool, B, BLOCKS * BT, salt + 0.5);
        kvp_block_key ka[BLOCKS * B];
        kvp_block_key kb[BLOCKS * B];
        chain_keys(a, B, BLOCKS, salt, ka);
        chain_keys(b, B, BLOCKS, salt + 0.5, kb);
        kvp_block_key keys[BLOCKS * 2 * B];
        group_keys(ka, kb, B, BLOCKS, keys);
        kvp_cache *ab[] = {a, b};
        size_t cached = kvpt_stats(pool).cached_pages;
        if (round == 2 * B) {
            /* The whole group, then the same group again: OK, nothing new. */
            kvpt_assert_ok(kvp_cache_group_publish(ab, 2, keys, BLOCKS, &err), &err);
            kvpt_assert_pool_ok(pool);
            assert_int_equal(kvpt_stats(pool).cached_pages, cached + BLOCKS * 2 * B);
            kvp_pool_stats before = kvpt_stats(pool);
            kvpt_assert_ok(kvp_cache_group_publish(ab, 2, keys, BLOCKS, &err), &err);
            kvpt_assert_pool_ok(pool);
            kvp_pool_stats after = kvpt_stats(pool);
            assert_memory_equal(&before, &after, sizeof before);
        } else {
            /* Block 1 of cache c, lane `lane` is registered under another key first. */
            size_t c = round / B;
            size_t lane = round % B;
            kvp_block_key other = {0x5eed + round, 0xbeef};
            kvpt_assert_ok(kvp_cache_publish_block(ab[c], lane, 1, &other, &err), &err);
            kvp_pool_stats before = kvpt_stats(pool);
            assert_int_equal(before.cached_pages, cached + 1);
            assert_int_equal(kvp_cache_group_publish(ab, 2, keys, BLOCKS, &err),
                             KVP_PAGE_PUBLISHED);
            assert_int_equal(err.layer, c);
            assert_int_equal(err.index, page_of(ab[c], lane, 1));
            kvpt_assert_pool_ok(pool);
            kvp_pool_stats after = kvpt_stats(pool);
            assert_memory_equal(&before, &after, sizeof before);
            /* Nothing of the group was registered: a fresh pair finds no block. */
            kvp_cache *a2 = external_cache(pool, B, 1);
            kvp_cache *b2 = external_cache(pool, B, 2);
            const kvp_cache *probe[] = {a2, b2};
            size_t blocks = 99;
            kvpt_assert_ok(kvp_cache_group_probe(probe, 2, keys, BLOCKS, &blocks, NULL, &err),
                           &err);
            assert_int_equal(blocks, 0);
            kvpt_destroy_cache(b2, pool);
            kvpt_destroy_cache(a2, pool);
        }
        kvpt_destroy_cache(b, pool);
        kvpt_destroy_cache(a, pool);
    }
    destroy_pool(pool);
}

/* ---- published blocks keep their binding ------------------------------------ */

/* The chain key of one block of `bytes` input bytes for `cache` (block 0: no parent). */
static kvp_block_key key_of(const kvp_cache *cache, const void *input, size_t bytes)
{
    kvp_block_key key;
    kvp_error err;
    kvpt_assert_ok(kvp_block_key_chain(NULL, cache, input, bytes, NULL, &key, &err), &err);
    return key;
}

static kvp_binding binding_of(const kvp_layer *layer)
{
    kvp_binding b;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &b, &err), &err);
    return b;
}

/* BT tokens of `input` ([1, BT, D]) through the layer into its cache, one at a time. */
static void attend_block(const kvp_layer *layer, kvp_cache *cache, kvp_pool *pool,
                         const double *input)
{
    kvp_ticket *ticket = kvpt_ticket(cache);
    kvp_error err;
    for (size_t t = 0; t < BT; t++) {
        kvp_tensor x = kvp_tensor3((double *)(uintptr_t)(input + t * D), 1, 1, D);
        kvpt_assert_ok(kvp_attention_forward(layer, &x, cache, ticket, &err), &err);
    }
    kvpt_destroy_ticket(ticket, pool);
    kvpt_assert_pool_ok(pool);
}

/*
 * `adopter` adopts one block under `key`, which names a page published by a
 * cache of another binding: BLOCK_BINDING_MISMATCH naming that page, and
 * nothing changed (length, rows, tables, every statistic: no hit, no miss).
 */
static void assert_adopt_refused(kvp_cache *adopter, kvp_pool *pool, const kvp_block_key *key,
                                 uint32_t page)
{
    kvpt_state before;
    kvpt_state_capture(adopter, pool, &before);
    size_t adopted = 99;
    kvp_error err;
    assert_int_equal(kvp_cache_adopt_prefix(adopter, key, 1, &adopted, &err),
                     KVP_BLOCK_BINDING_MISMATCH);
    assert_int_equal(err.index, page);
    assert_int_equal(err.layer, 0);
    assert_int_equal(err.position, kvp_cache_len(adopter));
    assert_int_equal(adopted, 99);
    kvpt_assert_state_unchanged(&before, adopter, pool, 0);
    kvpt_state_free(&before);
}

/*
 * A forged key, both ways between an external cache and an attention
 * cache: raw rows published under a key made from the layer-bound cache are
 * not adopted into it (that would bypass CACHE_LAYER_BOUND), and attention's
 * rows published under a key made from the external cache are not adopted
 * into that one.
 */
static void test_share_forged_key_is_refused_across_kinds(void **state)
{
    (void)state;
    kvp_layer *layer = kvpt_random_layer(D, HEADS, SCAP, BASE, 21);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 16);
    kvp_error err;
    kvp_binding ext_binding;
    kvpt_assert_ok(kvp_binding_init_external(&ext_binding, HEADS, D / HEADS, SCAP, 7, 1, &err),
                   &err);
    kvp_cache *ext = kvpt_cache(pool, &ext_binding, 1, SCAP);
    kvp_binding att_binding = binding_of(layer);
    kvp_cache *att = kvpt_cache(pool, &att_binding, 1, SCAP);
    double input[BT * D];
    uint64_t seed = 5;
    for (size_t i = 0; i < BT * D; i++) {
        input[i] = kvpt_rand_unit(&seed);
    }

    /* External rows under the attention cache's key: published, never adopted. */
    double rows[HEADS * BT * (D / HEADS)];
    kvpt_fill(rows, KVPT_COUNT_OF(rows), 3.0);
    kvpt_assert_ok(kvp_cache_append_rows(ext, rows, rows, BT, &err), &err);
    kvp_block_key forged = key_of(att, input, sizeof input);
    kvpt_assert_ok(kvp_cache_publish_block(ext, 0, 0, &forged, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_adopt_refused(att, pool, &forged, page_of(ext, 0, 0));
    /* The attention cache computes the block itself and still works. */
    attend_block(layer, att, pool, input);
    assert_int_equal(kvp_cache_len(att), BT);

    /* Attention's rows under a key made from another (empty) external cache. */
    kvp_cache *ext2 = kvpt_cache(pool, &ext_binding, 1, SCAP);
    kvp_block_key forged2 = key_of(ext2, input, sizeof input);
    kvpt_assert_ok(kvp_cache_publish_block(att, 0, 0, &forged2, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_adopt_refused(ext2, pool, &forged2, page_of(att, 0, 0));
    /* A key of the same binding is adopted as before: the check refuses only others. */
    kvpt_assert_ok(kvp_cache_append_rows(ext, rows, rows, BT, &err), &err);
    kvp_block_key own = key_of(ext, "own", 3);
    kvpt_assert_ok(kvp_cache_publish_block(ext, 0, 1, &own, &err), &err);
    size_t adopted = 0;
    kvpt_assert_ok(kvp_cache_adopt_prefix(ext2, &own, 1, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, 1);
    assert_int_equal(page_of(ext2, 0, 0), page_of(ext, 0, 1));
    kvpt_destroy_cache(ext2, pool);
    kvpt_destroy_cache(att, pool);
    kvpt_destroy_cache(ext, pool);
    destroy_pool(pool);
    kvpt_destroy_layer(layer);
}

/*
 * An engine's own weights (external caches, kvp_binding_init_external): its
 * prefix keys change with its weights' revision and identity, as a layer's
 * do with its parameters'. A block published by a cache of revision 1 is
 * never found by the keys of a cache of revision 2, and refused under a key
 * forged from revision 1; a cache of the same identity and revision adopts
 * it. The binding digest also covers the kind and every byte of the owner
 * record, which the pager never reads.
 */
static void test_share_external_weight_revision_changes_keys(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 16);
    kvp_error err;
    kvp_cache *old = external_cache(pool, 1, 1); /* identity 7, revision 1 */
    kvp_cache *same = external_cache(pool, 1, 1);
    kvp_cache *updated = external_cache(pool, 1, 2);
    append(old, pool, 1, BT, 0.5);
    const char input[] = "the prompt's first block";
    kvp_block_key k_old = key_of(old, input, sizeof input);
    kvp_block_key k_same = key_of(same, input, sizeof input);
    kvp_block_key k_new = key_of(updated, input, sizeof input);
    assert_memory_equal(&k_old, &k_same, sizeof k_old);
    assert_memory_not_equal(&k_old, &k_new, sizeof k_old);
    kvp_block_key b_old, b_new;
    kvpt_assert_ok(kvp_cache_binding_key(old, &b_old, &err), &err);
    kvpt_assert_ok(kvp_cache_binding_key(updated, &b_new, &err), &err);
    assert_memory_not_equal(&b_old, &b_new, sizeof b_old);
    kvpt_assert_ok(kvp_cache_publish_block(old, 0, 0, &k_old, &err), &err);
    kvpt_assert_pool_ok(pool);

    /* The updated engine's own key misses; the old key is refused. */
    size_t adopted = 99;
    kvpt_assert_ok(kvp_cache_adopt_prefix(updated, &k_new, 1, &adopted, &err), &err);
    assert_int_equal(adopted, 0);
    assert_int_equal(kvp_cache_len(updated), 0);
    assert_adopt_refused(updated, pool, &k_old, page_of(old, 0, 0));
    /* The same identity and revision adopts it. */
    kvpt_assert_ok(kvp_cache_adopt_prefix(same, &k_same, 1, &adopted, &err), &err);
    assert_int_equal(adopted, 1);
    assert_int_equal(page_of(same, 0, 0), page_of(old, 0, 0));
    kvpt_assert_pool_ok(pool);

    /* Another identity, the kind, a byte of the record: each another digest. */
    kvp_binding base;
    kvpt_assert_ok(kvp_binding_init_external(&base, KV_HEADS, HEAD_WIDTH, 64, 7, 1, &err), &err);
    kvp_binding variants[3] = {base, base, base};
    variants[0].owner_digest[0] = 8;
    variants[1].kind = KVP_BINDING_LAYER;
    variants[2].record[KVP_BINDING_RECORD_BYTES - 1] = 1;
    kvp_block_key seen[4] = {b_old};
    for (size_t v = 0; v < 3; v++) {
        kvp_cache *c = kvpt_cache(pool, &variants[v], 1, CAPACITY);
        kvpt_assert_ok(kvp_cache_binding_key(c, &seen[v + 1], &err), &err);
        for (size_t u = 0; u <= v; u++) {
            assert_memory_not_equal(&seen[v + 1], &seen[u], sizeof seen[u]);
        }
        kvpt_destroy_cache(c, pool);
    }
    kvpt_destroy_cache(updated, pool);
    kvpt_destroy_cache(same, pool);
    kvpt_destroy_cache(old, pool);
    destroy_pool(pool);
}

/*
 * Two layers over the same parameter nodes, their caches made at different
 * revisions: the stale cache's rows, published under a key made from the
 * current one, are refused; under its own key they are simply never found.
 */
static void test_share_same_parameters_other_revision_is_refused(void **state)
{
    (void)state;
    kvp_layer *first = kvpt_random_layer(D, HEADS, SCAP, BASE, 22);
    kvp_error err;
    kvp_layer *second = NULL;
    kvpt_assert_ok(kvp_layer_create(kvp_layer_param_mut(first, 0), kvp_layer_param_mut(first, 1),
                                    kvp_layer_param_mut(first, 2), kvp_layer_param_mut(first, 3),
                                    HEADS, SCAP, BASE, &second, &err),
                   &err);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 16);
    double input[2 * BT * D];
    uint64_t seed = 6;
    for (size_t i = 0; i < 2 * BT * D; i++) {
        input[i] = kvpt_rand_unit(&seed);
    }
    kvp_binding old_binding = binding_of(first);
    kvp_cache *old = kvpt_cache(pool, &old_binding, 1, SCAP);
    attend_block(first, old, pool, input);
    attend_block(first, old, pool, input + BT * D); /* a second block: other rows */
    /* W_v moves on: a new revision for both layers (they share the node). */
    kvp_param *w = kvp_layer_param_mut(first, KVP_PARAM_VALUE);
    double values[D * D];
    memcpy(values, kvp_param_values(w), sizeof values);
    values[1] += 0.25;
    kvpt_assert_ok(kvp_param_update(w, values, &err), &err);
    kvp_binding now_binding = binding_of(second);
    kvp_cache *now = kvpt_cache(pool, &now_binding, 1, SCAP);

    kvp_block_key stale_key = key_of(old, input, BT * D * sizeof *input);
    kvp_block_key current_key = key_of(now, input, BT * D * sizeof *input);
    assert_true(stale_key.lo != current_key.lo || stale_key.hi != current_key.hi);
    /* Under its own key: no key of the current binding finds it. */
    kvpt_assert_ok(kvp_cache_publish_block(old, 0, 0, &stale_key, &err), &err);
    size_t adopted = 99;
    kvpt_assert_ok(kvp_cache_adopt_prefix(now, &current_key, 1, &adopted, &err), &err);
    assert_int_equal(adopted, 0);
    /* Under the current binding's key (forged): found, and refused. */
    kvpt_assert_ok(kvp_cache_publish_block(old, 0, 1, &current_key, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_adopt_refused(now, pool, &current_key, page_of(old, 0, 1));
    /* The current cache computes the block under the new weights instead. */
    attend_block(second, now, pool, input);
    kvpt_destroy_cache(now, pool);
    kvpt_destroy_cache(old, pool);
    destroy_pool(pool);
    kvpt_destroy_layer(second);
    kvpt_destroy_layer(first);
}

/* ---- salts, stale keys, prompt edges (sequences) ------------------------------ */

/* Prefills the whole prompt into a new sequence, publishes it under `salt`, destroys it. */
static void publish_fresh(const kvp_model *model, kvp_pool *pool, const double *prompt,
                          const kvp_block_key *salt)
{
    kvp_sequence *seq = kvpt_sequence(model, pool, SB, SCAP);
    static double out[SB * PROMPT * D];
    prefill(seq, pool, prompt, 0, PROMPT, out);
    kvp_tensor whole = kvp_tensor3((double *)(uintptr_t)prompt, SB, PROMPT, D);
    size_t published = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_publish_prefix_salted(seq, &whole, salt, &published, &err), &err);
    assert_int_equal(published, PROMPT / BT);
    kvpt_destroy_sequence(seq, pool);
}

/* Tokens a new sequence adopts of the prompt under `salt`; the sequence is destroyed. */
static size_t adopt_fresh(const kvp_model *model, kvp_pool *pool, const double *prompt,
                          const kvp_block_key *salt)
{
    kvp_sequence *seq = kvpt_sequence(model, pool, SB, SCAP);
    kvp_tensor whole = kvp_tensor3((double *)(uintptr_t)prompt, SB, PROMPT, D);
    size_t adopted = 99;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_adopt_prefix_salted(seq, &whole, salt, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_len(seq), adopted);
    kvpt_destroy_sequence(seq, pool);
    return adopted;
}

/*
 * Salts: a prompt published under one tenant's salt is adopted under that
 * salt only: not unsalted, not under another salt; an all-zero salt is no
 * salt, but a salt with one 64-bit half zero ({x, 0} or {0, x}) is a
 * salt. Each tenant's lookups of another's prompt miss, as for a prompt
 * never seen (no hit to time).
 */
static void test_share_salts_keep_tenants_apart(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 31);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    const kvp_block_key alice = {0x1111, 0x2222};
    const kvp_block_key bob = {0x1111, 0x2223};
    const kvp_block_key none = {0, 0};
    publish_fresh(model, pool, prompt, &alice);
    assert_int_equal(adopt_fresh(model, pool, prompt, &bob), 0);
    assert_int_equal(adopt_fresh(model, pool, prompt, NULL), 0);
    assert_int_equal(adopt_fresh(model, pool, prompt, &none), 0);
    assert_int_equal(adopt_fresh(model, pool, prompt, &alice), 8);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.prefix_misses, 3);
    assert_int_equal(s.prefix_hits, 2 * LAYERS * SB);
    /* Unsalted: the zero salt and NULL are the same keys, the plain calls' too. */
    publish_fresh(model, pool, prompt, &none);
    assert_int_equal(adopt_fresh(model, pool, prompt, NULL), 8);
    kvp_sequence *seq = kvpt_sequence(model, pool, SB, SCAP);
    kvp_tensor whole = kvp_tensor3(prompt, SB, PROMPT, D);
    assert_int_equal(adopt_whole(seq, pool, &whole), 8);
    kvpt_destroy_sequence(seq, pool);
    assert_int_equal(adopt_fresh(model, pool, prompt, &bob), 0);
    /* A salt with one 64-bit half zero is a salt all the same: apart from unsalted and others. */
    const kvp_block_key low_only = {0x1111, 0};
    const kvp_block_key high_only = {0, 0x2222};
    assert_int_equal(adopt_fresh(model, pool, prompt, &low_only), 0);
    assert_int_equal(adopt_fresh(model, pool, prompt, &high_only), 0);
    publish_fresh(model, pool, prompt, &low_only);
    assert_int_equal(adopt_fresh(model, pool, prompt, &high_only), 0);
    assert_int_equal(adopt_fresh(model, pool, prompt, &low_only), 8);
    s = kvpt_stats(pool);
    assert_int_equal(s.prefix_misses, 3 + 1 + 3);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* A 0-token prompt is refused as prefill refuses it, nothing changed. */
static void test_share_adopt_refuses_empty_prompt(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 32);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 64);
    kvp_sequence *seq = kvpt_sequence(model, pool, SB, SCAP);
    double row[SB * D] = {0};
    kvp_tensor empty = kvp_tensor3(row, SB, 0, D);
    kvp_pool_stats before = kvpt_stats(pool);
    kvp_error prefill_err;
    assert_int_equal(kvp_sequence_prefill(seq, &empty, NULL, NULL, NULL, 0, &prefill_err),
                     KVP_INVALID_ARGUMENT);
    size_t adopted = 99;
    kvp_error err;
    assert_int_equal(kvp_sequence_adopt_prefix(seq, &empty, &adopted, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, prefill_err.argument);
    assert_string_equal(err.what, prefill_err.what);
    assert_int_equal(adopted, 99);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
    assert_int_equal(kvp_sequence_len(seq), 0);
    kvpt_destroy_sequence(seq, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/*
 * A block-aligned prompt (3 whole blocks) whose every block is published:
 * adopt leaves the last block, so the last token is computed and its output
 * is the prefill's, bit for bit as a fresh prefill of the whole prompt.
 */
static void test_share_aligned_prompt_keeps_last_token(void **state)
{
    (void)state;
    enum { T = 3 * BT };
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 33);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * T * D];
    uint64_t seed = 77;
    for (size_t i = 0; i < KVPT_COUNT_OF(prompt); i++) {
        prompt[i] = kvpt_rand_unit(&seed);
    }
    kvp_tensor whole = kvp_tensor3(prompt, SB, T, D);
    static double want[SB * T * D];
    kvp_error err;
    kvp_sequence *a = kvpt_sequence(model, pool, SB, SCAP);
    kvpt_assert_ok(kvp_sequence_prefill(a, &whole, NULL, NULL, want, KVPT_COUNT_OF(want), &err),
                   &err);
    size_t published = 0;
    kvpt_assert_ok(kvp_sequence_publish_prefix(a, &whole, &published, &err), &err);
    assert_int_equal(published, 3); /* every block, the last one included */
    kvpt_destroy_sequence(a, pool);

    kvp_sequence *b = kvpt_sequence(model, pool, SB, SCAP);
    size_t adopted = adopt_whole(b, pool, &whole);
    assert_int_equal(adopted, 2 * BT); /* not 3 * BT: the last token is left to compute */
    static double rest[SB * BT * D];
    static double got[SB * BT * D];
    for (size_t lane = 0; lane < SB; lane++) {
        memcpy(rest + lane * BT * D, prompt + (lane * T + 2 * BT) * D, BT * D * sizeof(double));
    }
    kvp_tensor tail = kvp_tensor3(rest, SB, BT, D);
    kvpt_assert_ok(kvp_sequence_prefill(b, &tail, NULL, NULL, got, KVPT_COUNT_OF(got), &err),
                   &err);
    for (size_t lane = 0; lane < SB; lane++) {
        assert_memory_equal(got + lane * BT * D, want + (lane * T + 2 * BT) * D,
                            BT * D * sizeof(double));
    }
    assert_int_equal(kvp_sequence_len(b), T);
    kvpt_destroy_sequence(b, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/*
 * Stale keys: the prompt keys' context covers every layer's binding. For
 * each layer of a 3-layer model and each of its four parameters (W_o
 * included), an update makes every old block unadoptable: a new sequence
 * of the updated model adopts nothing of a prompt published before, in
 * any layer, although the index still holds every old page. (The K/V of
 * layer l > 0 depend on every earlier layer's output, W_o included, so no
 * layer's old block may be reused after any earlier update; an update of a
 * later layer leaves earlier layers' K/V right but the keys are per prompt
 * for all layers at once, so the prompt misses as a whole.)
 */
static void test_share_any_parameter_update_makes_old_keys_stale(void **state)
{
    (void)state;
    enum { L3 = 3 };
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    for (size_t layer = 0; layer < L3; layer++) {
        for (size_t which = 0; which < KVP_PARAM_COUNT; which++) {
            kvp_model *model = kvpt_random_model(L3, D, HEADS, SCAP, BASE, 40 + layer);
            kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
            publish_fresh(model, pool, prompt, NULL);
            assert_int_equal(adopt_fresh(model, pool, prompt, NULL), 8); /* still current */
            kvp_param *w = kvp_model_param_mut(model, layer, which);
            double values[D * D];
            memcpy(values, kvp_param_values(w), sizeof values);
            values[layer + which] += 0.125;
            kvp_error err;
            kvpt_assert_ok(kvp_param_update(w, values, &err), &err);
            size_t hits = kvpt_stats(pool).prefix_hits;
            assert_int_equal(adopt_fresh(model, pool, prompt, NULL), 0);
            assert_int_equal(kvpt_stats(pool).prefix_hits, hits);
            assert_int_equal(kvpt_stats(pool).cached_pages, L3 * SB * (PROMPT / BT));
            /* Layer by layer: no key of the updated layer or a later one is indexed. */
            kvp_sequence *seq = kvpt_sequence(model, pool, SB, SCAP);
            enum { BLOCKS = PROMPT / BT };
            kvp_block_key keys[BLOCKS * (L3 + 1) * SB + L3]; /* kvpi_prompt_keys_count */
            kvpi_prompt_keys(seq->caches, L3, NULL, prompt, PROMPT, D, BLOCKS, keys);
            for (size_t j = 0; j < BLOCKS; j++) {
                for (size_t l = layer; l < L3; l++) {
                    for (size_t b = 0; b < SB; b++) {
                        kvpi_pool_lock(pool);
                        uint32_t page =
                            kvpi_prefix_lookup_locked(pool, &keys[(j * L3 + l) * SB + b]);
                        kvpi_pool_unlock(pool);
                        if (page != KVPI_NO_PAGE) {
                            print_error("parameter %zu of layer %zu updated: layer %zu block "
                                        "%zu lane %zu still found\n",
                                        which, layer, l, j, b);
                            fail();
                        }
                    }
                }
            }
            kvpt_destroy_sequence(seq, pool);
            destroy_pool(pool);
            kvpt_destroy_model(model);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_share_audit_reports_key_indexed_twice),
        cmocka_unit_test(test_share_group_all_or_nothing),
        cmocka_unit_test(test_share_group_publish_checks_each_cache_lane),
        cmocka_unit_test(test_share_forged_key_is_refused_across_kinds),
        cmocka_unit_test(test_share_external_weight_revision_changes_keys),
        cmocka_unit_test(test_share_same_parameters_other_revision_is_refused),
        cmocka_unit_test(test_share_salts_keep_tenants_apart),
        cmocka_unit_test(test_share_adopt_refuses_empty_prompt),
        cmocka_unit_test(test_share_aligned_prompt_keeps_last_token),
        cmocka_unit_test(test_share_any_parameter_update_makes_old_keys_stale),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
