/*
 * reset_reuse.c: reset and replay, over and over.
 *
 * A set of sequences each prefill a prompt and decode a few tokens (the
 * first pass), recording every output and every physical page id. Then, for
 * each of many cycles, every sequence is reset (in the reverse order of first
 * use, so the LIFO free list hands each sequence its own pages back) and the
 * same inputs are replayed. Every cycle must reproduce the first pass's
 * outputs bit for bit and the same physical pages for every layer, lane and
 * block, and jemalloc must count zero bytes allocated or freed on this thread
 * from the end of the first pass to the end of the last cycle.
 *
 * Exit status 0 when all of that holds, 1 otherwise, 2 on usage errors.
 */
#include <jemalloc/jemalloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stress_common.h"

#define PROGRAM "stress-reset-reuse"
#define WIDTH 16
#define HEADS 2
#define BLOCK 4

typedef struct plan {
    size_t sequences;
    size_t prompt;
    size_t decode;
    size_t layers;
    size_t blocks;        /* per lane at the end of a pass */
    size_t out_per_seq;   /* (prompt + decode) * WIDTH doubles */
    size_t pages_per_seq; /* layers * blocks */
} plan;

typedef struct run_state {
    kvp_sequence **sequences;
    double *inputs;    /* [sequences][prompt + decode][WIDTH] */
    double *outputs;   /* [sequences][prompt + decode][WIDTH], written by a pass */
    uint32_t *pages;   /* [sequences][layers][blocks], written by a pass */
} run_state;

static uint64_t heap_traffic(void)
{
    uint64_t allocated = 0;
    uint64_t deallocated = 0;
    size_t size = sizeof allocated;
    mallctl("thread.allocated", &allocated, &size, NULL, 0);
    mallctl("thread.deallocated", &deallocated, &size, NULL, 0);
    return allocated + deallocated;
}

/* True when this process's malloc is jemalloc's, so the counters see it. */
static int malloc_is_counted(void)
{
    uint64_t before = heap_traffic();
    void *volatile probe = malloc(4096);
    free(probe);
    return heap_traffic() > before;
}

/* One pass: prefill and decode every sequence, recording outputs and pages. */
static int pass(const plan *p, run_state *r, kvp_error *err)
{
    size_t tokens = p->prompt + p->decode;
    for (size_t s = 0; s < p->sequences; s++) {
        const double *in = r->inputs + s * p->out_per_seq;
        double *out = r->outputs + s * p->out_per_seq;
        kvp_tensor prompt = kvp_tensor3(in, 1, p->prompt, WIDTH);
        if (kvp_sequence_prefill(r->sequences[s], &prompt, NULL, NULL, out,
                                 p->prompt * WIDTH, err) != KVP_OK) {
            return -1;
        }
        for (size_t t = p->prompt; t < tokens; t++) {
            kvp_tensor input = kvp_tensor3(in + t * WIDTH, 1, 1, WIDTH);
            if (kvp_sequence_step(r->sequences[s], &input, NULL, NULL, out + t * WIDTH, WIDTH,
                                  err) != KVP_OK) {
                return -1;
            }
        }
        for (size_t l = 0; l < p->layers; l++) {
            const kvp_cache *cache = kvp_sequence_cache(r->sequences[s], l);
            for (size_t b = 0; b < p->blocks; b++) {
                if (kvp_cache_page(cache, 0, b, &r->pages[(s * p->layers + l) * p->blocks + b],
                                   err) != KVP_OK) {
                    return -1;
                }
            }
        }
    }
    return 0;
}

static int reset_all(const plan *p, run_state *r, kvp_error *err)
{
    for (size_t s = p->sequences; s-- > 0;) {
        if (kvp_sequence_reset(r->sequences[s], err) != KVP_OK) {
            return -1;
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    size_t sequences = 4;
    size_t cycles = 100000;
    size_t prompt = 6;
    size_t decode = 6;
    size_t layers = 2;
    size_t seed = 1;
    stress_option options[] = {
        {"--sequences", &sequences, "sequences replayed each cycle"},
        {"--cycles", &cycles, "reset/replay cycles after the first pass"},
        {"--prompt", &prompt, "prompt tokens prefilled per sequence"},
        {"--decode", &decode, "tokens decoded per sequence after the prompt"},
        {"--layers", &layers, "model layers"},
        {"--seed", &seed, "seed of weights and inputs"},
    };
    int parsed = stress_parse(argc, argv,
                              "Reset and replay a set of sequences many times: identical "
                              "outputs, the same physical pages, zero heap traffic.",
                              options, sizeof options / sizeof options[0]);
    if (parsed != 0) {
        return parsed == 1 ? 0 : 2;
    }
    if (sequences == 0 || prompt == 0 || layers == 0) {
        fprintf(stderr, PROGRAM ": --sequences, --prompt and --layers must be positive\n");
        return 2;
    }
    size_t tokens = prompt + decode;
    plan p = {sequences, prompt, decode, layers, (tokens + BLOCK - 1) / BLOCK, tokens * WIDTH,
              0};
    p.pages_per_seq = layers * p.blocks;
    kvp_error err;
    kvp_pool *pool = NULL;
    kvp_model *model = NULL;
    size_t page_bytes = 2 * HEADS * BLOCK * (WIDTH / HEADS) * sizeof(double);
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BLOCK;
    config.heads = HEADS;
    config.head_width = WIDTH / HEADS;
    config.budget_bytes = sequences * p.pages_per_seq * page_bytes;
    config.dtype = KVP_F64;
    if (kvp_pool_create(&config, &pool, &err) != KVP_OK ||
        kvp_model_create_random(layers, WIDTH, HEADS, tokens, 10000.0, seed, &model, &err) !=
            KVP_OK) {
        return stress_fail(PROGRAM, "setting up", &err);
    }
    run_state first = {calloc(sequences, sizeof(kvp_sequence *)),
                       calloc(sequences * p.out_per_seq, sizeof(double)),
                       calloc(sequences * p.out_per_seq, sizeof(double)),
                       calloc(sequences * p.pages_per_seq, sizeof(uint32_t))};
    run_state replay = first;
    replay.outputs = calloc(sequences * p.out_per_seq, sizeof(double));
    replay.pages = calloc(sequences * p.pages_per_seq, sizeof(uint32_t));
    if (first.sequences == NULL || first.inputs == NULL || first.outputs == NULL ||
        first.pages == NULL || replay.outputs == NULL || replay.pages == NULL) {
        fprintf(stderr, PROGRAM ": out of memory\n");
        return 1;
    }
    uint64_t rng = seed;
    stress_fill(first.inputs, sequences * p.out_per_seq, &rng);
    for (size_t s = 0; s < sequences; s++) {
        if (kvp_sequence_create(model, pool, 1, tokens, &first.sequences[s], &err) != KVP_OK) {
            return stress_fail(PROGRAM, "creating a sequence", &err);
        }
    }
    double start = stress_seconds();
    if (pass(&p, &first, &err) != 0) {
        return stress_fail(PROGRAM, "first pass", &err);
    }
    int counted = malloc_is_counted();
    uint64_t traffic = heap_traffic();
    int failed = 0;
    size_t cycle = 0;
    for (; cycle < cycles && !failed; cycle++) {
        if (reset_all(&p, &replay, &err) != 0 || pass(&p, &replay, &err) != 0) {
            failed = stress_fail(PROGRAM, "replay", &err);
            break;
        }
        if (memcmp(replay.outputs, first.outputs, sequences * p.out_per_seq * sizeof(double)) !=
            0) {
            fprintf(stderr, PROGRAM ": cycle %zu: outputs differ from the first pass\n", cycle);
            failed = 1;
        } else if (memcmp(replay.pages, first.pages,
                          sequences * p.pages_per_seq * sizeof(uint32_t)) != 0) {
            fprintf(stderr, PROGRAM ": cycle %zu: physical pages differ from the first pass\n",
                    cycle);
            failed = 1;
        }
    }
    uint64_t heap_bytes = heap_traffic() - traffic;
    double seconds = stress_seconds() - start;
    if (counted && heap_bytes != 0) {
        fprintf(stderr, PROGRAM ": %llu heap bytes moved after the first pass\n",
                (unsigned long long)heap_bytes);
        failed = 1;
    }
    for (size_t s = 0; s < sequences; s++) {
        kvp_sequence_destroy(first.sequences[s], NULL);
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    if (kvp_pool_check(pool, NULL, NULL, &err) != KVP_OK ||
        kvp_pool_stats_get(pool, &stats, &err) != KVP_OK) {
        failed |= stress_fail(PROGRAM, "final audit", &err);
    } else if (stats.free_pages != stats.total_pages || stats.acquires != stats.releases) {
        fprintf(stderr, PROGRAM ": pages still held at the end\n");
        failed = 1;
    }
    printf("%s: %zu sequences x %zu cycles of %zu tokens over %zu layers: outputs identical, "
           "same pages, heap bytes after the first pass: %s%llu; %.2f s: %s\n",
           PROGRAM, sequences, cycle, tokens, layers,
           counted ? "" : "(not counted: malloc is not jemalloc's here) ",
           (unsigned long long)heap_bytes, seconds, failed ? "FAILED" : "ok");
    kvp_model_destroy(model, NULL);
    if (kvp_pool_destroy(pool, &err) != KVP_OK) {
        failed |= stress_fail(PROGRAM, "destroying the pool", &err);
    }
    free(first.sequences);
    free(first.inputs);
    free(first.outputs);
    free(first.pages);
    free(replay.outputs);
    free(replay.pages);
    return failed;
}
