/*
 * prefill.c: does the blocked prefill pay?
 *
 * Times kvp_sequence_prefill of a prompt of --tokens T tokens (batch 1)
 * into a sequence that already holds --len positions (uncomputed rows of zeros,
 * kvpi_sequence_append_uncomputed: the attention reads them like any rows),
 * in blocks (the library's default) and token by token
 * (kvpi_sequence_prefill_block_set(0)), alternating in one run
 * (src/cli/measure.h: medians of --repetitions rounds). Each iteration is
 * reset + append of the context + prefill; a third case times reset +
 * append alone, and the prefill's time is the difference. Before timing it
 * checks that both modes give the same outputs bit for bit. Each iteration
 * ends with a reset (the pool holds one sequence's pages).
 * Prints one row per mode: tokens/s, and the ratio blocked / token by token.
 * The context's K+V bytes per layer are printed too: above the last-level
 * cache (32 MiB here) token by token streams them from DRAM once per token.
 *
 * Flags (bench/args.h; --help lists them with their ranges and defaults):
 * --len 256, --tokens 64, --layers 1, --width 512, --heads 8, --kv-heads 8,
 * --block 16, --repetitions 5, --min-ns 2e8.
 *
 * Exit status 0 when the results agree, 1 otherwise (speed is reported, not
 * enforced: the machine may be shared), 2 on usage or setup errors (a bad
 * flag or value: one line naming both).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpager/kvpager.h"
#include "args.h"
#include "measure.h"
#include "serve/sequence_internal.h"

typedef struct prefill_config {
    size_t len;
    size_t tokens;
    size_t layers;
    size_t width;
    size_t heads;
    size_t kv_heads;
    size_t block;
    size_t repetitions;
    size_t min_ns;
} prefill_config;

typedef struct prefill_case {
    kvp_sequence *seq;
    const prefill_config *c;
    double *prompt;
    double *out;
    size_t want; /* blocks of this many tokens; 0 token by token; SIZE_MAX no prefill */
    int failed;
} prefill_case;

static void run_case(void *ctx, size_t iterations)
{
    prefill_case *p = ctx;
    kvp_error err;
    kvp_tensor prompt = kvp_tensor3(p->prompt, 1, p->c->tokens, p->c->width);
    for (size_t i = 0; i < iterations; i++) {
        if (kvp_sequence_reset(p->seq, &err) != KVP_OK ||
            kvpi_sequence_append_uncomputed(p->seq, p->c->len, &err) != KVP_OK) {
            p->failed = 1;
            return;
        }
        kvp_status status = KVP_OK;
        if (p->want != SIZE_MAX) {
            kvpi_sequence_prefill_block_set(p->want);
            status = kvp_sequence_prefill(p->seq, &prompt, NULL, NULL, p->out,
                                          p->c->tokens * p->c->width, &err);
            kvpi_sequence_prefill_block_set(KVPI_PREFILL_BLOCK_DEFAULT);
        }
        /* The pool holds one sequence's pages: give them back for the next case. */
        if (status != KVP_OK || kvp_sequence_reset(p->seq, &err) != KVP_OK) {
            p->failed = 1;
            return;
        }
    }
}

/* Parses the flags into c: BENCH_ARGS_RUN, or the exit status (bench/args.h). */
static int parse(int argc, char **argv, prefill_config *c)
{
    bench_arg table[] = {
        BENCH_SIZE("--len", &c->len, 0, (size_t)1 << 24, "N", "positions already in the sequence"),
        BENCH_SIZE("--tokens", &c->tokens, 2, (size_t)1 << 20, "T", "the prompt's tokens"),
        BENCH_SIZE("--layers", &c->layers, 1, 1024, "L", "layers of the model"),
        BENCH_SIZE("--width", &c->width, 2, 65536, "D", "model width"),
        BENCH_SIZE("--heads", &c->heads, 1, 65536, "H", "query heads (dividing D, D / H even)"),
        BENCH_SIZE("--kv-heads", &c->kv_heads, 1, 65536, "K", "KV heads (dividing H)"),
        BENCH_SIZE("--block", &c->block, 1, 65536, "B", "block_tokens of the pool's pages"),
        BENCH_SIZE("--repetitions", &c->repetitions, 1, 1000000, "R", "alternating rounds"),
        BENCH_SIZE("--min-ns", &c->min_ns, 0, 1000000000000, "NS",
                   "each sample's minimum duration"),
    };
    bench_args args = BENCH_ARGS("bench-prefill",
                                 "Times kvp_sequence_prefill of T tokens after N positions, in "
                                 "blocks and\ntoken by token, in one run.",
                                 table);
    int parsed = bench_args_parse(&args, argc, argv);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    if (c->width % c->heads != 0 || (c->width / c->heads) % 2 != 0) {
        return bench_args_refuse(&args, "--heads",
                                 "a divisor of --width %zu leaving an even head width", c->width);
    }
    if (c->heads % c->kv_heads != 0) {
        return bench_args_refuse(&args, "--kv-heads", "a divisor of --heads %zu", c->heads);
    }
    return BENCH_ARGS_RUN;
}

int main(int argc, char **argv)
{
    prefill_config c = {.len = 256, .tokens = 64, .layers = 1, .width = 512, .heads = 8,
                        .kv_heads = 8, .block = 16, .repetitions = 5, .min_ns = 200000000};
    int parsed = parse(argc, argv, &c);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    size_t capacity = c.len + c.tokens;
    size_t head_width = c.width / c.heads;
    size_t pages = c.layers * (capacity / c.block + 1);
    kvp_error err;
    kvp_model *model = NULL;
    kvp_pool *pool = NULL;
    kvp_sequence *seqs[3] = {NULL, NULL, NULL};
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = c.block;
    config.heads = c.kv_heads;
    config.head_width = head_width;
    config.budget_bytes = pages * 2 * c.block * c.kv_heads * head_width * sizeof(double);
    if (kvp_model_create_random_grouped(c.layers, c.width, c.heads, c.kv_heads, capacity,
                                        10000.0, 7, &model, &err) != KVP_OK ||
        kvp_pool_create(&config, &pool, &err) != KVP_OK) {
        fprintf(stderr, "bench-prefill: setup: %s\n", kvp_status_name(err.status));
        return 2;
    }
    for (size_t i = 0; i < 3; i++) {
        if (kvp_sequence_create(model, pool, 1, capacity, &seqs[i], &err) != KVP_OK) {
            fprintf(stderr, "bench-prefill: sequence: %s\n", kvp_status_name(err.status));
            return 2;
        }
    }
    size_t n = c.tokens * c.width;
    double *prompt = malloc(n * sizeof *prompt);
    double *outs[2] = {malloc(n * sizeof(double)), malloc(n * sizeof(double))};
    if (prompt == NULL || outs[0] == NULL || outs[1] == NULL) {
        return 2;
    }
    uint64_t state = 99;
    for (size_t i = 0; i < n; i++) {
        prompt[i] = kvp_measure_unit(&state);
    }
    prefill_case cases[3] = {
        {seqs[0], &c, prompt, outs[0], KVPI_PREFILL_BLOCK_DEFAULT, 0},
        {seqs[1], &c, prompt, outs[1], 0, 0},
        {seqs[2], &c, prompt, NULL, SIZE_MAX, 0},
    };
    /* Only one sequence holds pages at a time: each iteration resets its own at the end. */
    for (size_t i = 0; i < 2; i++) {
        run_case(&cases[i], 1);
    }
    int agree = !cases[0].failed && !cases[1].failed &&
                memcmp(outs[0], outs[1], n * sizeof(double)) == 0;
    kvp_measure_case measured[3];
    for (size_t i = 0; i < 3; i++) {
        measured[i] = (kvp_measure_case){run_case, &cases[i]};
    }
    double ns[3];
    int ok = agree && kvp_measure_alternating(measured, 3, c.repetitions, (double)c.min_ns, ns) == 0;
    ok = ok && !cases[0].failed && !cases[1].failed && !cases[2].failed;
    size_t kv_bytes = c.len * 2 * c.kv_heads * head_width * sizeof(double);
    printf("prefill len=%zu tokens=%zu layers=%zu width=%zu heads=%zu kv_heads=%zu block=%zu "
           "context_kv_bytes_per_layer=%zu results_agree=%s\n",
           c.len, c.tokens, c.layers, c.width, c.heads, c.kv_heads, c.block, kv_bytes,
           agree ? "yes" : "NO");
    if (ok) {
        double blocked = ns[0] - ns[2];
        double single = ns[1] - ns[2];
        printf("  blocked        %10.1f tokens/s  (%.3f ms per prompt)\n",
               c.tokens / (blocked * 1e-9), blocked * 1e-6);
        printf("  token-by-token %10.1f tokens/s  (%.3f ms per prompt)\n",
               c.tokens / (single * 1e-9), single * 1e-6);
        printf("  context setup  %10.3f ms (subtracted)\n", ns[2] * 1e-6);
        printf("  ratio blocked/token-by-token %.2fx\n", single / blocked);
    }
    int teardown = 1;
    for (size_t i = 0; i < 3; i++) {
        teardown = teardown && kvp_sequence_destroy(seqs[i], &err) == KVP_OK;
    }
    teardown = teardown && kvp_pool_destroy(pool, &err) == KVP_OK;
    teardown = teardown && kvp_model_destroy(model, &err) == KVP_OK;
    free(prompt);
    free(outs[0]);
    free(outs[1]);
    if (!teardown) {
        fprintf(stderr, "bench-prefill: teardown: %s\n", kvp_status_name(err.status));
        return 2;
    }
    return agree && ok ? 0 : 1;
}
