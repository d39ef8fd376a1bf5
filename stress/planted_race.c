/*
 * planted_race.c: a data race planted on purpose, to prove the race gate can
 * fail.
 *
 * Two threads step two different sequences on one pool, which is correct,
 * but they share one input buffer that the first thread rewrites while the
 * second reads it: the bug a caller makes by reusing a token buffer across
 * threads. helgrind must report it ("Possible data race") and exit with its
 * error code. Registered only as an expected failure.
 */
#include <pthread.h>
#include <stdio.h>

#include "stress_common.h"

#define WIDTH 16
#define STEPS 8

typedef struct racer {
    kvp_sequence *sequence;
    double *shared_input; /* the planted bug: one buffer, two threads, no lock */
    int writes;
    uint64_t rng;
} racer;

static void *race(void *arg)
{
    racer *r = arg;
    double output[WIDTH];
    for (int step = 0; step < STEPS; step++) {
        if (r->writes) {
            stress_fill(r->shared_input, WIDTH, &r->rng);
        }
        kvp_tensor input = kvp_tensor3(r->shared_input, 1, 1, WIDTH);
        if (kvp_sequence_step(r->sequence, &input, NULL, NULL, output, WIDTH, NULL) != KVP_OK) {
            break;
        }
    }
    return NULL;
}

int main(void)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = 4;
    config.heads = 2;
    config.head_width = 8;
    config.budget_bytes = 64 * 2 * 2 * 4 * 8 * sizeof(double);
    config.dtype = KVP_F64;
    kvp_pool *pool = NULL;
    kvp_model *model = NULL;
    kvp_error err;
    if (kvp_pool_create(&config, &pool, &err) != KVP_OK ||
        kvp_model_create_random(1, WIDTH, 2, 64, 10000.0, 7, &model, &err) != KVP_OK) {
        return stress_fail("planted-race", "setting up", &err);
    }
    double shared_input[WIDTH] = {0};
    racer racers[2] = {{NULL, shared_input, 1, 1}, {NULL, shared_input, 0, 2}};
    pthread_t threads[2];
    for (int i = 0; i < 2; i++) {
        if (kvp_sequence_create(model, pool, 1, 64, &racers[i].sequence, &err) != KVP_OK) {
            return stress_fail("planted-race", "creating a sequence", &err);
        }
    }
    for (int i = 0; i < 2; i++) {
        pthread_create(&threads[i], NULL, race, &racers[i]);
    }
    for (int i = 0; i < 2; i++) {
        pthread_join(threads[i], NULL);
        kvp_sequence_destroy(racers[i].sequence, NULL);
    }
    kvp_model_destroy(model, NULL);
    printf("planted race: two threads shared one input buffer\n");
    return kvp_pool_destroy(pool, &err) == KVP_OK ? 0 : 1;
}
