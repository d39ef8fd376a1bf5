/*
 * keys.c: what one prefix-index chain key costs per block, by hash.
 *
 * A chain key (kvp_block_key_chain, src/pager/share.c) hashes a short header
 * (binding digest, parent key, context digest, flags and the byte count: 64
 * bytes) and then the block's input rows. This program times one key over
 * inputs the size of a block's rows, in alternating repetitions of one run
 * (median nanoseconds per key), for:
 *   murmur      MurmurHash3 x64 128 with a fixed seed, fed as a stream: the
 *               library's earlier keys (copied here as the baseline);
 *   blake2b     libsodium's crypto_generichash (BLAKE2b) keyed with a 32-byte
 *               secret, 16-byte output, fed as a stream: the keys now;
 *   siphash     libsodium's crypto_shorthash_siphashx24 (SipHash-2-4, 128-bit
 *               output) keyed with a 16-byte secret: one-shot only, so the
 *               input is hashed first and the header with that digest after.
 * Sizes: block_tokens x model width x 8 bytes of f64 input rows; by default
 * 16 x 512 (the default pool's 8 heads of 64: 64 KiB) and 16 x 4096 (a 7B
 * model's width: 512 KiB), and 16 x 64 (8 KiB) for short rows.
 * Then a sequence's keys of one block of one lane for 32 layers:
 *   before      what src/serve/share.c did: one MurmurHash3 chain key per
 *               layer, each over the block's rows;
 *   after       kvpi_prompt_keys itself (the library's code): the rows
 *               hashed once with keyed BLAKE2b, each layer chaining that
 *               digest.
 * Flags (bench/args.h; --help lists them): --repetitions N (default 15),
 * --min-ns X (each sample's minimum duration, default 2e7). Exit status 0,
 * 1 when the library fails, or 2 on a usage error (one line naming the flag
 * and value). Speed is reported, never enforced.
 */
#include <sodium.h>

#include "kvpager/kvpager.h"
#include "args.h"
#include "measure.h"
#include "serve/share_internal.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define VARIANTS 3

/* ---- the baseline: MurmurHash3 x64 128 as a stream (as share.c had it) ---- */

typedef struct murmur {
    uint64_t h1;
    uint64_t h2;
    unsigned char tail[16];
    size_t tail_len;
    uint64_t total;
} murmur;

static uint64_t rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static uint64_t fmix64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

static uint64_t load64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static void murmur_block(murmur *h, const unsigned char *p)
{
    const uint64_t c1 = 0x87c37b91114253d5ull;
    const uint64_t c2 = 0x4cf5ad432745937full;
    uint64_t k1 = load64(p) * c1;
    uint64_t k2 = load64(p + 8) * c2;
    h->h1 ^= rotl64(k1, 31) * c2;
    h->h1 = rotl64(h->h1, 27) + h->h2;
    h->h1 = h->h1 * 5 + 0x52dce729;
    h->h2 ^= rotl64(k2, 33) * c1;
    h->h2 = rotl64(h->h2, 31) + h->h1;
    h->h2 = h->h2 * 5 + 0x38495ab5;
}

static void murmur_bytes(murmur *h, const unsigned char *p, size_t n)
{
    h->total += n;
    if (h->tail_len != 0) {
        size_t take = 16 - h->tail_len < n ? 16 - h->tail_len : n;
        memcpy(h->tail + h->tail_len, p, take);
        h->tail_len += take;
        p += take;
        n -= take;
        if (h->tail_len < 16) {
            return;
        }
        murmur_block(h, h->tail);
        h->tail_len = 0;
    }
    for (; n >= 16; p += 16, n -= 16) {
        murmur_block(h, p);
    }
    memcpy(h->tail, p, n);
    h->tail_len = n;
}

static void murmur_final(murmur *h, unsigned char out[16])
{
    unsigned char last[16] = {0};
    memcpy(last, h->tail, h->tail_len);
    h->h2 ^= rotl64(load64(last + 8) * 0x4cf5ad432745937full, 33) * 0x87c37b91114253d5ull;
    h->h1 ^= rotl64(load64(last) * 0x87c37b91114253d5ull, 31) * 0x4cf5ad432745937full;
    h->h1 ^= h->total;
    h->h2 ^= h->total;
    h->h1 += h->h2;
    h->h2 += h->h1;
    h->h1 = fmix64(h->h1);
    h->h2 = fmix64(h->h2);
    h->h1 += h->h2;
    h->h2 += h->h1;
    memcpy(out, &h->h1, 8);
    memcpy(out + 8, &h->h2, 8);
}

/* ---- one key per variant ---------------------------------------------------- */

typedef struct key_ctx {
    const unsigned char *input;
    size_t bytes;
    unsigned char header[64];
    unsigned char secret[crypto_generichash_KEYBYTES];
    unsigned char out[16];
    uint64_t sink; /* keeps every key observable */
} key_ctx;

static void run_key(key_ctx *c, size_t variant)
{
    if (variant == 0) {
        murmur h = {0x6b7670616765722dull, 0x626c6f636b2d7631ull, {0}, 0, 0};
        murmur_bytes(&h, c->header, sizeof c->header);
        murmur_bytes(&h, c->input, c->bytes);
        murmur_final(&h, c->out);
    } else if (variant == 1) {
        crypto_generichash_state st;
        crypto_generichash_init(&st, c->secret, sizeof c->secret, sizeof c->out);
        crypto_generichash_update(&st, c->header, sizeof c->header);
        crypto_generichash_update(&st, c->input, c->bytes);
        crypto_generichash_final(&st, c->out, sizeof c->out);
    } else {
        unsigned char second[sizeof c->header + crypto_shorthash_siphashx24_BYTES];
        memcpy(second, c->header, sizeof c->header);
        crypto_shorthash_siphashx24(second + sizeof c->header, c->input, c->bytes, c->secret);
        crypto_shorthash_siphashx24(c->out, second, sizeof second, c->secret);
    }
    c->sink += c->out[0];
}

/* ---- a sequence's keys of one block, 32 layers: before and after ---------------- */

enum { LAYERS = 32 };

typedef struct prompt_ctx {
    kvp_cache *caches[LAYERS];
    const double *rows;
    size_t width;
    kvp_block_key keys[LAYERS + 1 + LAYERS]; /* kvpi_prompt_keys_count(LAYERS, 1, 1) */
    unsigned char header[64];
    uint64_t sink;
} prompt_ctx;

static void run_prompt(prompt_ctx *c, size_t variant)
{
    if (variant == 0) {
        for (size_t l = 0; l < LAYERS; l++) {
            murmur h = {0x6b7670616765722dull, 0x626c6f636b2d7631ull, {0}, 0, 0};
            c->header[0] = (unsigned char)l;
            murmur_bytes(&h, c->header, sizeof c->header);
            murmur_bytes(&h, (const unsigned char *)c->rows, 16 * c->width * sizeof(double));
            murmur_final(&h, (unsigned char *)&c->keys[l]);
        }
    } else {
        kvpi_prompt_keys(c->caches, LAYERS, NULL, c->rows, 16, c->width, 1, c->keys);
    }
    c->sink += c->keys[LAYERS - 1].lo;
}

/* One variant of a key_ctx or prompt_ctx, as a case of kvp_measure_alternating. */
typedef struct variant_case {
    void *ctx;
    size_t variant;
} variant_case;

static void time_key(void *ctx, size_t iterations)
{
    const variant_case *k = ctx;
    for (size_t i = 0; i < iterations; i++) {
        run_key(k->ctx, k->variant);
    }
}

static void time_prompt(void *ctx, size_t iterations)
{
    const variant_case *k = ctx;
    for (size_t i = 0; i < iterations; i++) {
        run_prompt(k->ctx, k->variant);
    }
}

/*
 * The median ns per call of each of `count` variants of `ctx`, alternating
 * (src/cli/measure.h). Returns 0, or 1 after saying it is out of memory.
 */
static int time_variants(kvp_measure_fn run, void *ctx, size_t count, size_t repetitions,
                         double min_ns, double *ns)
{
    variant_case k[VARIANTS];
    kvp_measure_case cases[VARIANTS];
    for (size_t v = 0; v < count; v++) {
        k[v] = (variant_case){ctx, v};
        cases[v] = (kvp_measure_case){run, &k[v]};
    }
    if (kvp_measure_alternating(cases, count, repetitions, min_ns, ns) != 0) {
        fprintf(stderr, "bench-keys: out of memory\n");
        return 1;
    }
    return 0;
}

static int prompt_bench(size_t repetitions, double min_ns)
{
    static const size_t widths[] = {512, 4096};
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.heads = 1;
    config.head_width = 4;
    config.budget_bytes = (size_t)1 << 20;
    kvp_pool *pool = NULL;
    kvp_error err;
    if (kvp_pool_create(&config, &pool, &err) != KVP_OK) {
        fprintf(stderr, "bench-keys: pool create failed\n");
        return 1;
    }
    prompt_ctx c;
    memset(&c, 0, sizeof c);
    for (size_t l = 0; l < LAYERS; l++) {
        kvp_binding binding;
        if (kvp_binding_init_external(&binding, 1, 4, 64, l + 1, 1, &err) != KVP_OK ||
            kvp_cache_create(pool, &binding, 1, 64, &c.caches[l], &err) != KVP_OK) {
            fprintf(stderr, "bench-keys: cache create failed\n");
            return 1;
        }
    }
    printf("\n%-8s %-9s %14s %9s   (one block of one lane, %d layers)\n", "width", "keys",
           "ns/block", "vs before", LAYERS);
    for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
        size_t n = 16 * widths[w];
        double *rows = malloc(n * sizeof *rows);
        if (rows == NULL) {
            fprintf(stderr, "bench-keys: out of memory\n");
            return 1;
        }
        for (size_t i = 0; i < n; i++) {
            rows[i] = (double)(i % 977) / 977.0; /* finite values */
        }
        c.rows = rows;
        c.width = widths[w];
        double ns[2];
        if (time_variants(time_prompt, &c, 2, repetitions, min_ns, ns) != 0) {
            free(rows);
            return 1;
        }
        double before = ns[0];
        double after = ns[1];
        printf("%-8zu %-9s %14.0f %8.2fx\n", widths[w], "before", before, 1.0);
        printf("%-8zu %-9s %14.0f %8.2fx\n", widths[w], "after", after, after / before);
        free(rows);
    }
    int failed = 0;
    for (size_t l = 0; l < LAYERS; l++) {
        failed |= kvp_cache_destroy(c.caches[l], NULL) != KVP_OK;
    }
    failed |= kvp_pool_destroy(pool, NULL) != KVP_OK;
    return failed || c.sink == UINT64_MAX;
}

int main(int argc, char **argv)
{
    size_t repetitions = 15;
    double min_ns = 2e7;
    bench_arg table[] = {
        BENCH_SIZE("--repetitions", &repetitions, 1, 1000000, "N", "alternating repetitions"),
        BENCH_DOUBLE("--min-ns", &min_ns, 0.0, 1e12, "NS", "each sample's minimum duration"),
    };
    bench_args args = BENCH_ARGS("bench-keys",
                                 "Times one prefix-index chain key per block by hash (murmur, "
                                 "blake2b,\nsiphash), then a sequence's keys of one block for 32 "
                                 "layers.",
                                 table);
    int parsed = bench_args_parse(&args, argc, argv);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    if (sodium_init() < 0) {
        fprintf(stderr, "bench-keys: sodium_init failed\n");
        return 1;
    }
    static const size_t widths[] = {64, 512, 4096};
    static const char *const names[VARIANTS] = {"murmur", "blake2b", "siphash"};
    const size_t block_tokens = 16;
    printf("%-8s %-9s %10s %14s %9s %8s\n", "width", "hash", "bytes", "ns/block", "GB/s",
           "vs murmur");
    for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
        key_ctx c;
        memset(&c, 0, sizeof c);
        c.bytes = block_tokens * widths[w] * sizeof(double);
        unsigned char *input = malloc(c.bytes);
        if (input == NULL) {
            fprintf(stderr, "bench-keys: out of memory\n");
            return 1;
        }
        randombytes_buf(input, c.bytes);
        randombytes_buf(c.header, sizeof c.header);
        randombytes_buf(c.secret, sizeof c.secret);
        c.input = input;
        double ns[VARIANTS];
        if (time_variants(time_key, &c, VARIANTS, repetitions, min_ns, ns) != 0) {
            free(input);
            return 1;
        }
        for (size_t v = 0; v < VARIANTS; v++) {
            printf("%-8zu %-9s %10zu %14.0f %9.2f %8.2fx\n", widths[w], names[v], c.bytes, ns[v],
                   (double)c.bytes / ns[v], ns[v] / ns[0]);
        }
        free(input);
        if (c.sink == UINT64_MAX) {
            printf("(unlikely)\n");
        }
    }
    return prompt_bench(repetitions, min_ns);
}
