/*
 * tier_block.c: the tier block format (DESIGN.md, "Tier block format"):
 * packing a page into a block and verifying a block before its page bytes
 * may be mapped.
 *
 * Layout (every header field little-endian; the payload is the page's bytes
 * as the pool stores them, in the host's byte order, which the flags word
 * records):
 *     0  magic "KVPT" (4)      4  version (2)        6  flags (2: bit 0 big-endian payload)
 *     8  dtype (4)            12  element_bytes (4)
 *    16  block_tokens (8)     24  heads (8)          32  head_width (8)
 *    40  payload_bytes (8)    48  chain key lo, hi (16)
 *    64  binding digest lo, hi (16)
 *    80  nonce (16): never the same twice under one secret (the pool's
 *        write: 8 random bytes drawn at attach, then a count; the public
 *        kvp_tier_block_pack: 16 random bytes)
 *    96  tag (16): Poly1305 over bytes [0, 96) then the payload, under a
 *        one-time key: the keyed BLAKE2b-256 (the deployment secret) of
 *        bytes [0, 96), nonce included (DESIGN.md says why not BLAKE2b
 *        over the whole block: four times the cost)
 *   112  payload (page_bytes)
 *
 * Invariant: kvpi_tier_block_verify returns OK only for a block whose MAC
 * verifies (constant-time compare) and whose every header field matches the
 * expectation; a caller maps a block's payload only after that.
 * Pure functions; no state. Callers: tier_pool.c and the public API.
 */
#include "pager/tier_internal.h"

#include <sodium.h>
#include <string.h>

#include "pager/cache_internal.h"
#include "pager/error.h"

#define MAGIC 0x5450564bu /* "KVPT" read little-endian */
#define NONCE_AT 80
#define NONCE_BYTES KVPI_TIER_NONCE_BYTES
#define MAC_AT 96 /* the tag; it covers bytes [0, MAC_AT), the nonce included */
#define MAC_BYTES crypto_onetimeauth_BYTES
_Static_assert(NONCE_AT + NONCE_BYTES == MAC_AT, "the nonce is the last field the tag covers");
_Static_assert(MAC_AT + MAC_BYTES == KVP_TIER_HEADER_BYTES, "the header ends with its MAC");
_Static_assert(crypto_onetimeauth_KEYBYTES == 32, "a BLAKE2b-256 output is a Poly1305 key");

static void put_le(unsigned char *p, uint64_t v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static uint64_t get_le(const unsigned char *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = n; i > 0; i--) {
        v = (v << 8) | p[i - 1];
    }
    return v;
}

static unsigned host_flags(void)
{
    const uint16_t one = 1;
    unsigned char first;
    memcpy(&first, &one, 1);
    return first == 1 ? 0u : 1u;
}

/*
 * The tag of header bytes [0, MAC_AT) and the payload: Poly1305 under a key
 * used for this block alone, the keyed BLAKE2b of those header bytes, whose
 * random nonce makes the key fresh even when one chain key is written twice
 * with other bytes (Poly1305 must never tag two messages under one key).
 */
static void block_mac(const unsigned char *header, const unsigned char *payload,
                      size_t payload_bytes, const unsigned char *secret,
                      unsigned char out[MAC_BYTES])
{
    unsigned char one_time[crypto_onetimeauth_KEYBYTES];
    (void)crypto_generichash(one_time, sizeof one_time, header, MAC_AT, secret,
                             KVP_TIER_SECRET_BYTES);
    crypto_onetimeauth_state state;
    (void)crypto_onetimeauth_init(&state, one_time);
    (void)crypto_onetimeauth_update(&state, header, MAC_AT);
    (void)crypto_onetimeauth_update(&state, payload, payload_bytes);
    (void)crypto_onetimeauth_final(&state, out);
    sodium_memzero(one_time, sizeof one_time);
    sodium_memzero(&state, sizeof state);
}

/* Header fields [0, NONCE_AT) for `pool`'s pages. */
static void write_header(const kvp_pool *pool, const kvp_block_key *key,
                         const kvp_block_key *binding, unsigned char *h)
{
    put_le(h, MAGIC, 4);
    put_le(h + 4, KVP_TIER_FORMAT_VERSION, 2);
    put_le(h + 6, host_flags(), 2);
    put_le(h + 8, (uint64_t)pool->dtype, 4);
    put_le(h + 12, pool->element_bytes, 4);
    put_le(h + 16, pool->block_tokens, 8);
    put_le(h + 24, pool->heads, 8);
    put_le(h + 32, pool->head_width, 8);
    put_le(h + 40, pool->page_bytes, 8);
    put_le(h + 48, key->lo, 8);
    put_le(h + 56, key->hi, 8);
    put_le(h + 64, binding->lo, 8);
    put_le(h + 72, binding->hi, 8);
}

void kvpi_tier_block_pack(const kvp_pool *pool, uint32_t page, const kvp_block_key *key,
                          const kvp_block_key *binding, const unsigned char *secret,
                          const unsigned char nonce[KVPI_TIER_NONCE_BYTES], unsigned char *out)
{
    write_header(pool, key, binding, out);
    memcpy(out + NONCE_AT, nonce, NONCE_BYTES);
    memcpy(out + KVP_TIER_HEADER_BYTES, kvpi_pool_page(pool, page), pool->page_bytes);
    block_mac(out, out + KVP_TIER_HEADER_BYTES, pool->page_bytes, secret, out + MAC_AT);
}

const char *kvpi_tier_reject_name(kvpi_tier_reject reject)
{
    static const char *const names[] = {NULL,       "size",     "magic", "version",
                                        "mac",      "geometry", "key",   "binding"};
    return (size_t)reject < sizeof names / sizeof names[0] ? names[reject] : "unknown";
}

/* The header's geometry against the pool's: dtype, element size, shape, flags. */
static int geometry_matches(const kvp_pool *pool, const unsigned char *h)
{
    unsigned char want[NONCE_AT];
    static const kvp_block_key zero = {0, 0};
    write_header(pool, &zero, &zero, want);
    return memcmp(h + 6, want + 6, 48 - 6) == 0;
}

kvpi_tier_reject kvpi_tier_block_verify(const kvp_pool *pool, const kvp_block_key *key,
                                        const kvp_block_key *binding,
                                        const unsigned char *secret, const void *block,
                                        size_t bytes, const unsigned char **payload)
{
    const unsigned char *h = block;
    if (bytes < KVP_TIER_HEADER_BYTES) {
        return KVPI_TIER_REJECT_SIZE;
    }
    if (get_le(h, 4) != MAGIC) {
        return KVPI_TIER_REJECT_MAGIC;
    }
    if (get_le(h + 4, 2) != KVP_TIER_FORMAT_VERSION) {
        return KVPI_TIER_REJECT_VERSION;
    }
    uint64_t payload_bytes = get_le(h + 40, 8);
    if (payload_bytes != bytes - KVP_TIER_HEADER_BYTES) {
        return KVPI_TIER_REJECT_SIZE;
    }
    unsigned char mac[MAC_BYTES];
    block_mac(h, h + KVP_TIER_HEADER_BYTES, (size_t)payload_bytes, secret, mac);
    if (sodium_memcmp(mac, h + MAC_AT, MAC_BYTES) != 0) {
        return KVPI_TIER_REJECT_MAC;
    }
    if (!geometry_matches(pool, h)) {
        return KVPI_TIER_REJECT_GEOMETRY;
    }
    if (get_le(h + 48, 8) != key->lo || get_le(h + 56, 8) != key->hi) {
        return KVPI_TIER_REJECT_KEY;
    }
    if (get_le(h + 64, 8) != binding->lo || get_le(h + 72, 8) != binding->hi) {
        return KVPI_TIER_REJECT_BINDING;
    }
    *payload = h + KVP_TIER_HEADER_BYTES;
    return KVPI_TIER_BLOCK_OK;
}

/* ---- the public pair ---------------------------------------------------------- */

kvp_status kvp_tier_block_pack(const kvp_cache *cache, size_t lane, size_t block,
                               const unsigned char *secret, void *out, size_t capacity,
                               size_t *bytes, kvp_error *err)
{
    static const char *const names[] = {"cache", "secret", "out", "bytes"};
    const void *args[] = {cache, secret, out, bytes};
    for (size_t i = 0; i < 4; i++) {
        if (args[i] == NULL) {
            return kvpi_fail_null(err, names[i]);
        }
    }
    if (lane >= cache->batch_size) {
        return kvpi_fail_out_of_range(err, "lane", lane, cache->batch_size);
    }
    size_t full = cache->len / cache->block_tokens;
    if (block >= full) {
        return kvpi_fail_out_of_range(err, "block", block, full);
    }
    kvp_pool *pool = cache->pool;
    if (!kvpi_pool_has_data(pool)) {
        return kvpi_fail_invalid(err, "cache", "its pool holds no data (KVP_SLAB_RESERVED)");
    }
    size_t need = kvpi_tier_block_bytes(pool);
    if (capacity < need) {
        return kvpi_fail_buffer(err, "out", need, capacity);
    }
    uint32_t page = kvpi_cache_lane_table(cache, lane)[block];
    if (page == KVPI_NO_PAGE) {
        kvp_error e = kvpi_error_begin(KVP_BLOCK_RELEASED);
        e.index = block;
        e.position = block * cache->block_tokens;
        e.what = "pack";
        return kvpi_error_emit(err, &e);
    }
    kvpi_pool_lock(pool);
    int published = pool->registered[page] != 0;
    kvp_block_key key = pool->page_key[page];
    kvp_block_key binding = pool->page_binding[page];
    kvpi_pool_unlock(pool);
    if (!published) {
        return kvpi_fail_invalid(err, "block", "its page is not published");
    }
    /* A full page of a held cache is never written again: no lock needed to read it. */
    unsigned char nonce[NONCE_BYTES];
    randombytes_buf(nonce, sizeof nonce);
    kvpi_tier_block_pack(pool, page, &key, &binding, secret, nonce, out);
    *bytes = need;
    return KVP_OK;
}

kvp_status kvp_tier_block_verify(const kvp_cache *cache, const kvp_block_key *key,
                                 const unsigned char *secret, const void *block, size_t bytes,
                                 kvp_error *err)
{
    static const char *const names[] = {"cache", "key", "secret", "block"};
    const void *args[] = {cache, key, secret, block};
    for (size_t i = 0; i < 4; i++) {
        if (args[i] == NULL) {
            return kvpi_fail_null(err, names[i]);
        }
    }
    kvp_block_key binding = kvpi_cache_binding_key(cache);
    const unsigned char *payload = NULL;
    kvpi_tier_reject reject =
        kvpi_tier_block_verify(cache->pool, key, &binding, secret, block, bytes, &payload);
    if (reject == KVPI_TIER_BLOCK_OK) {
        return KVP_OK;
    }
    kvp_error e = kvpi_error_begin(KVP_TIER_BLOCK_REJECTED);
    e.what = kvpi_tier_reject_name(reject);
    e.bytes = bytes;
    return kvpi_error_emit(err, &e);
}
