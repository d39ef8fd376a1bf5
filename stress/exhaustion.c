/*
 * exhaustion.c: storms of sequences racing for the last pages.
 *
 * Each round, all threads start together (a barrier) and step their
 * sequences as fast as they can until every sequence has been refused. Every
 * refusal must be POOL_EXHAUSTED (or FULL, once a sequence reaches its
 * capacity) and change nothing in its sequence. When the storm is over the
 * pool must really be spent: fewer free pages than one step needs. Then every
 * sequence is reset, the pool audited, and the next round begins. At the end
 * every page is free and acquires equal releases.
 *
 * Nothing here depends on scheduling. Steps take their pages all or none and
 * no page comes back during a storm, so a refused sequence stays refused and
 * the pool is spent when the storm ends. And each thread's sequences alone
 * can hold more pages than the pool has (checked up front), so in every round
 * every thread meets at least one POOL_EXHAUSTED refusal, which is checked.
 *
 * Exit status 0 when all of that holds, 1 otherwise, 2 on usage errors.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stress_common.h"

#define PROGRAM "stress-exhaustion"
#define WIDTH 16
#define HEADS 2
#define BLOCK 2
#define LAYERS 2
#define CAPACITY 64

typedef struct storm {
    kvp_pool *pool;
    kvp_model *model;
    pthread_barrier_t barrier;
    size_t sequences;
    size_t rounds;
    uint64_t seed;
} storm;

typedef struct racer {
    size_t id;
    pthread_t thread;
    storm *st;
    kvp_sequence **sequences;
    uint64_t rng;
    size_t granted;
    size_t exhausted;
    size_t full;
    size_t dry_rounds; /* rounds without a PoolExhausted refusal */
    int failed;
    char failure[512];
} racer;

static void racer_fail(racer *r, const char *what, const kvp_error *err)
{
    if (r->failed) {
        return;
    }
    r->failed = 1;
    char text[384] = "";
    if (err != NULL) {
        kvp_error_format(err, text, sizeof text);
    }
    snprintf(r->failure, sizeof r->failure, "thread %zu: %s: %s", r->id, what, text);
}

/* Steps one sequence; returns 1 while it may still grow. */
static int push(racer *r, kvp_sequence *sequence)
{
    double input[WIDTH];
    double output[WIDTH];
    stress_fill(input, WIDTH, &r->rng);
    uint64_t digest = stress_sequence_digest(sequence);
    size_t len = kvp_sequence_len(sequence);
    kvp_tensor view = kvp_tensor3(input, 1, 1, WIDTH);
    kvp_error err;
    kvp_status status = kvp_sequence_step(sequence, &view, NULL, NULL, output, WIDTH, &err);
    if (status == KVP_OK) {
        r->granted++;
        return 1;
    }
    if (status == KVP_POOL_EXHAUSTED) {
        r->exhausted++;
    } else if (status == KVP_FULL) {
        r->full++;
    } else {
        racer_fail(r, "a refusal that is not PoolExhausted or Full", &err);
    }
    if (stress_sequence_digest(sequence) != digest || kvp_sequence_len(sequence) != len) {
        racer_fail(r, "a refused step changed its sequence", &err);
    }
    return 0;
}

/* Until every sequence of this thread has been refused once this round. */
static void storm_round(racer *r)
{
    size_t n = r->st->sequences;
    unsigned char refused[64] = {0};
    size_t remaining = n;
    while (remaining > 0 && !r->failed) {
        size_t s = (size_t)(stress_rand(&r->rng) % n);
        if (!refused[s] && !push(r, r->sequences[s])) {
            refused[s] = 1;
            remaining--;
        }
    }
}

static void *racer_main(void *arg)
{
    racer *r = arg;
    storm *st = r->st;
    for (size_t round = 0; round < st->rounds; round++) {
        pthread_barrier_wait(&st->barrier);
        size_t before = r->exhausted;
        storm_round(r);
        r->dry_rounds += r->exhausted == before;
        pthread_barrier_wait(&st->barrier); /* the storm is over: main checks the pool */
        pthread_barrier_wait(&st->barrier);
        for (size_t s = 0; s < st->sequences; s++) {
            kvp_error err;
            if (kvp_sequence_reset(r->sequences[s], &err) != KVP_OK) {
                racer_fail(r, "reset", &err);
            }
        }
    }
    return NULL;
}

/* After a storm, no sequence below capacity could take another step. */
static int check_spent(storm *st, racer *racers, size_t threads, size_t round)
{
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvp_error err;
    if (kvp_pool_check(st->pool, NULL, NULL, &err) != KVP_OK ||
        kvp_pool_stats_get(st->pool, &stats, &err) != KVP_OK) {
        return stress_fail(PROGRAM, "audit after a storm", &err);
    }
    for (size_t t = 0; t < threads; t++) {
        for (size_t s = 0; s < st->sequences; s++) {
            const kvp_sequence *sequence = racers[t].sequences[s];
            size_t len = kvp_sequence_len(sequence);
            size_t need = kvp_sequence_pages_for(sequence, len + 1);
            if (len < CAPACITY && need != 0 && need <= stats.free_pages) {
                fprintf(stderr,
                        PROGRAM ": round %zu: a refused sequence could still grow (%zu pages "
                                "needed, %zu free)\n",
                        round, need, stats.free_pages);
                return 1;
            }
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    size_t threads = 2 * stress_cores();
    size_t sequences = 8;
    size_t rounds = 200;
    size_t pages = 101;
    size_t seed = 1;
    stress_option options[] = {
        {"--threads", &threads, "racing threads"},
        {"--sequences", &sequences, "sequences per thread (at most 64)"},
        {"--rounds", &rounds, "storms"},
        {"--pages", &pages, "pages in the pool"},
        {"--seed", &seed, "seed of every input and choice"},
    };
    int parsed = stress_parse(argc, argv,
                              "Threads race their sequences for the last pages of a pool; every "
                              "refusal must be PoolExhausted and change nothing.",
                              options, sizeof options / sizeof options[0]);
    if (parsed != 0) {
        return parsed == 1 ? 0 : 2;
    }
    if (threads == 0 || sequences == 0 || sequences > 64 || pages == 0) {
        fprintf(stderr, PROGRAM ": --threads, --pages and --sequences (1..64) must be valid\n");
        return 2;
    }
    storm st;
    memset(&st, 0, sizeof st);
    st.sequences = sequences;
    st.rounds = rounds;
    st.seed = seed;
    kvp_error err;
    size_t page_bytes = 2 * HEADS * BLOCK * (WIDTH / HEADS) * sizeof(double);
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BLOCK;
    config.heads = HEADS;
    config.head_width = WIDTH / HEADS;
    config.budget_bytes = pages * page_bytes;
    config.dtype = KVP_F64;
    if (kvp_pool_create(&config, &st.pool, &err) != KVP_OK ||
        kvp_model_create_random(LAYERS, WIDTH, HEADS, CAPACITY, 10000.0, seed, &st.model,
                                &err) != KVP_OK) {
        return stress_fail(PROGRAM, "setting up", &err);
    }
    racer *racers = calloc(threads, sizeof *racers);
    if (racers == NULL || pthread_barrier_init(&st.barrier, NULL, (unsigned)threads + 1) != 0) {
        fprintf(stderr, PROGRAM ": out of memory\n");
        return 1;
    }
    for (size_t t = 0; t < threads; t++) {
        racers[t].id = t;
        racers[t].st = &st;
        racers[t].rng = seed * 7919u + t;
        racers[t].sequences = calloc(sequences, sizeof(kvp_sequence *));
        for (size_t s = 0; s < sequences; s++) {
            if (racers[t].sequences == NULL ||
                kvp_sequence_create(st.model, st.pool, 1, CAPACITY, &racers[t].sequences[s],
                                    &err) != KVP_OK) {
                return stress_fail(PROGRAM, "creating a sequence", &err);
            }
        }
    }
    size_t most = sequences * kvp_sequence_pages_for(racers[0].sequences[0], CAPACITY);
    if (most <= pages) {
        fprintf(stderr,
                PROGRAM ": %zu sequences hold at most %zu pages, so one thread cannot exhaust "
                        "%zu (use fewer --pages or more --sequences)\n",
                sequences, most, pages);
        return 2;
    }
    double start = stress_seconds();
    for (size_t t = 0; t < threads; t++) {
        if (pthread_create(&racers[t].thread, NULL, racer_main, &racers[t]) != 0) {
            /* The started threads would wait at the barrier for this one. */
            fprintf(stderr, PROGRAM ": cannot start thread %zu\n", t);
            exit(1);
        }
    }
    int failed = 0;
    for (size_t round = 0; round < rounds; round++) {
        pthread_barrier_wait(&st.barrier); /* start the storm */
        pthread_barrier_wait(&st.barrier); /* storm over */
        failed |= check_spent(&st, racers, threads, round);
        pthread_barrier_wait(&st.barrier); /* let them reset */
    }
    size_t granted = 0;
    size_t exhausted = 0;
    size_t full = 0;
    for (size_t t = 0; t < threads; t++) {
        pthread_join(racers[t].thread, NULL);
        if (racers[t].failed) {
            fprintf(stderr, PROGRAM ": %s\n", racers[t].failure);
            failed = 1;
        } else if (racers[t].dry_rounds != 0) {
            fprintf(stderr, PROGRAM ": thread %zu: %zu rounds without a PoolExhausted refusal\n",
                    t, racers[t].dry_rounds);
            failed = 1;
        }
        granted += racers[t].granted;
        exhausted += racers[t].exhausted;
        full += racers[t].full;
        for (size_t s = 0; s < sequences; s++) {
            kvp_sequence_destroy(racers[t].sequences[s], NULL);
        }
        free(racers[t].sequences);
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    if (kvp_pool_check(st.pool, NULL, NULL, &err) != KVP_OK ||
        kvp_pool_stats_get(st.pool, &stats, &err) != KVP_OK) {
        failed |= stress_fail(PROGRAM, "final audit", &err);
    } else if (stats.free_pages != stats.total_pages || stats.acquires != stats.releases) {
        fprintf(stderr, PROGRAM ": pages still held at the end\n");
        failed = 1;
    }
    if (exhausted == 0) {
        fprintf(stderr, PROGRAM ": no step was ever refused for want of pages\n");
        failed = 1;
    }
    printf("%s: %zu threads x %zu sequences, %zu storms over %zu pages: %zu steps granted, "
           "%zu refused PoolExhausted, %zu refused Full, %llu pool exhaustions; %.2f s: %s\n",
           PROGRAM, threads, sequences, rounds, pages, granted, exhausted, full,
           (unsigned long long)stats.exhaustions, stress_seconds() - start,
           failed ? "FAILED" : "ok");
    pthread_barrier_destroy(&st.barrier);
    free(racers);
    kvp_model_destroy(st.model, NULL);
    if (kvp_pool_destroy(st.pool, &err) != KVP_OK) {
        failed |= stress_fail(PROGRAM, "destroying the pool", &err);
    }
    return failed;
}
