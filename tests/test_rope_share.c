/*
 * test_rope_share.c: one RoPE table per configuration, shared by the layers
 * that use it (attention/layer_internal.h, Sharing).
 *
 * A random model's layers all point at one table, with the bits of a layer
 * built alone; a model made from separately built layers shares one table
 * per configuration (two configurations: two tables); destroying the
 * owning layer first leaves the angles to the others (ASan and memcheck
 * see no leak and no stale read); two models sharing their source layers'
 * table are destroyed on two threads at once after a barrier (the
 * reference count is atomic; TSan and helgrind see it).
 * Unit test: reads struct kvp_layer through attention/layer_internal.h.
 */
#include "support.h"

#include <pthread.h>
#include <string.h>

#include "attention/layer_internal.h"

enum { WIDTH = 16, HEADS = 2, POSITIONS = 64, LAYERS = 4 };

#define BASE 10000.0

/* The same angles, bit for bit, as a layer that computed its own. */
static void assert_same_angles(const kvp_layer *a, const kvp_layer *b)
{
    size_t hd = a->head_width;
    assert_int_equal(hd, b->head_width);
    assert_memory_equal(a->rope_theta, b->rope_theta, hd / 2 * sizeof(double));
    assert_non_null(a->rope_table);
    assert_memory_equal(a->rope_table, b->rope_table,
                        a->rope.max_positions * hd * sizeof(double));
}

static void test_rope_random_model_shares_one_table(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, WIDTH, HEADS, POSITIONS, BASE, 5);
    kvp_layer *alone = kvpt_random_layer(WIDTH, HEADS, POSITIONS, BASE, 99);
    const kvp_layer *first = kvp_model_layer(model, 0);
    for (size_t l = 0; l < LAYERS; l++) {
        const kvp_layer *layer = kvp_model_layer(model, l);
        assert_ptr_equal(layer->rope_table, first->rope_table);
        assert_ptr_equal(layer->rope_theta, first->rope_theta);
        assert_ptr_equal(layer->rope_owner, first->rope_owner);
        assert_same_angles(layer, alone);
    }
    /* The model's layers, and nothing else: its templates are gone. */
    assert_int_equal(atomic_load(&first->rope_owner->rope_refs), LAYERS);
    kvpt_destroy_layer(alone);
    kvpt_destroy_model(model);
}

/* Four layers built alone, two RoPE bases: a model of them holds two tables. */
static void test_rope_model_of_separate_layers(void **state)
{
    (void)state;
    static const double bases[LAYERS] = {BASE, 500.0, BASE, 500.0};
    kvp_layer *layers[LAYERS];
    for (size_t l = 0; l < LAYERS; l++) {
        layers[l] = kvpt_random_layer(WIDTH, HEADS, POSITIONS, bases[l], 10 + l);
        assert_ptr_equal(layers[l]->rope_owner, layers[l]);
    }
    kvp_model *model = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_model_create((const kvp_layer *const *)layers, LAYERS, &model, &err),
                   &err);
    const kvp_layer *m[LAYERS];
    for (size_t l = 0; l < LAYERS; l++) {
        m[l] = kvp_model_layer(model, l);
        assert_same_angles(m[l], layers[l]);
    }
    /* Layers 0 and 2 share layer 0's source's table, 1 and 3 layer 1's. */
    assert_ptr_equal(m[0]->rope_owner, layers[0]);
    assert_ptr_equal(m[2]->rope_owner, layers[0]);
    assert_ptr_equal(m[1]->rope_owner, layers[1]);
    assert_ptr_equal(m[3]->rope_owner, layers[1]);
    assert_true(m[0]->rope_table != m[1]->rope_table);
    /* The sources go first: the model keeps their angles alive and correct. */
    for (size_t l = 0; l < LAYERS; l++) {
        kvpt_destroy_layer(layers[l]);
    }
    kvp_layer *again = kvpt_random_layer(WIDTH, HEADS, POSITIONS, 500.0, 1);
    assert_same_angles(m[3], again);
    kvpt_destroy_layer(again);
    /* A sequence still computes with the shared angles. */
    kvp_pool *pool = kvpt_pool(4, HEADS, WIDTH / HEADS, LAYERS * 2);
    kvp_sequence *seq = kvpt_sequence(model, pool, 1, 8);
    double x[WIDTH];
    double out[WIDTH];
    kvpt_fill_random(x, WIDTH, 3);
    kvp_tensor view = kvp_tensor3(x, 1, 1, WIDTH);
    kvpt_assert_ok(kvp_sequence_step(seq, &view, NULL, NULL, out, WIDTH, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

typedef struct destroyer {
    pthread_barrier_t *barrier;
    kvp_model *model;
    kvp_status status;
} destroyer;

static void *destroy_after_barrier(void *arg)
{
    destroyer *d = arg;
    pthread_barrier_wait(d->barrier);
    kvp_error err;
    d->status = kvp_model_destroy(d->model, &err);
    return NULL;
}

/*
 * Two models made from the same source layers share the sources' table;
 * the sources are destroyed, then both models on two threads released by
 * one barrier: whichever drops the last reference frees the table, once.
 */
static void test_rope_concurrent_destroys(void **state)
{
    (void)state;
    kvp_layer *layers[LAYERS];
    for (size_t l = 0; l < LAYERS; l++) {
        layers[l] = kvpt_random_layer(WIDTH, HEADS, POSITIONS, BASE, 20 + l);
    }
    kvp_model *models[2];
    kvp_error err;
    for (size_t i = 0; i < 2; i++) {
        kvpt_assert_ok(kvp_model_create((const kvp_layer *const *)layers, LAYERS, &models[i],
                                        &err),
                       &err);
    }
    const kvp_layer *owner = layers[0];
    assert_int_equal(atomic_load(&owner->rope_refs), 1 + 2 * LAYERS); /* itself, both models */
    for (size_t l = 0; l < LAYERS; l++) {
        kvpt_destroy_layer(layers[l]);
    }
    /* Only the models' layers hold the table now (the other sources' tables are gone). */
    assert_int_equal(atomic_load(&kvp_model_layer(models[0], 0)->rope_owner->rope_refs),
                     2 * LAYERS);
    pthread_barrier_t barrier;
    assert_int_equal(pthread_barrier_init(&barrier, NULL, 2), 0);
    destroyer d[2] = {{&barrier, models[0], KVP_OK}, {&barrier, models[1], KVP_OK}};
    pthread_t thread;
    assert_int_equal(pthread_create(&thread, NULL, destroy_after_barrier, &d[1]), 0);
    destroy_after_barrier(&d[0]);
    assert_int_equal(pthread_join(thread, NULL), 0);
    pthread_barrier_destroy(&barrier);
    assert_int_equal(d[0].status, KVP_OK);
    assert_int_equal(d[1].status, KVP_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rope_random_model_shares_one_table),
        cmocka_unit_test(test_rope_model_of_separate_layers),
        cmocka_unit_test(test_rope_concurrent_destroys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
