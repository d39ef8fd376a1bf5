/*
 * sim_window.c: the sliding-window model of a simulated run (issue 21;
 * `kvpager simulate --window`, simulate_window.c).
 *
 * Owns: which layers slide (kvp_sim_layer_window: with full_every K, layers
 * K-1, 2K-1, ... stay full, as Gemma 3's 5:1 pattern with K = 6; the rest
 * attend through the last W positions plus the first S) and the windowed
 * model (kvp_sim_windowed_model_create), which the run and the verifier
 * both build (verify.c's kvp_sim_model_create), so a verified token is
 * recomputed under the same windows.
 * Invariants: layer l's weights are those kvp_model_create_random_grouped
 * gives layer l (seed + l); window 0 builds no model here.
 * Callers: sim.c, verify.c, simulate_window.c, through sim.h. Public headers only.
 */
#include <string.h>

#include "alloc.h"
#include "sim.h"

size_t kvp_sim_layer_window(const kvp_sim_config *config, size_t l)
{
    if (config->window == 0 || (config->full_every != 0 && (l + 1) % config->full_every == 0)) {
        return 0;
    }
    return config->window;
}

size_t kvp_sim_sliding_layers(const kvp_sim_config *config)
{
    size_t n = 0;
    for (size_t l = 0; l < config->layers; l++) {
        n += kvp_sim_layer_window(config, l) != 0;
    }
    return n;
}

/* Layer l as kvp_model_create_random_grouped makes it (seed + l), with its window set. */
static kvp_status windowed_layer(const kvp_sim_config *c, size_t l, kvp_layer **out,
                                 kvp_error *err)
{
    kvp_status status = kvp_layer_create_random_grouped(c->model_width, c->heads,
                                                        kvp_sim_kv_heads(c), c->capacity,
                                                        10000.0, c->seed + l, out, err);
    size_t w = kvp_sim_layer_window(c, l);
    if (status == KVP_OK && w != 0) {
        status = kvp_layer_set_window(*out, w, c->sink_tokens, err);
    }
    return status;
}

kvp_status kvp_sim_windowed_model_create(const kvp_sim_config *c, kvp_model **out,
                                         kvp_error *err)
{
    kvp_layer **made = kvp_cli_calloc(c->layers, sizeof *made);
    if (made == NULL) {
        kvp_error e = {.status = KVP_ALLOCATION_FAILED, .what = "the windowed layers"};
        *err = e;
        return KVP_ALLOCATION_FAILED;
    }
    kvp_status status = KVP_OK;
    for (size_t l = 0; l < c->layers && status == KVP_OK; l++) {
        status = windowed_layer(c, l, &made[l], err);
    }
    if (status == KVP_OK) {
        status = kvp_model_create((const kvp_layer *const *)made, c->layers, out, err);
    }
    /* The model holds its own copies (windows included): these were templates. */
    for (size_t l = 0; l < c->layers; l++) {
        if (made[l] != NULL) {
            (void)kvp_layer_destroy(made[l], NULL);
        }
    }
    kvp_cli_free(made);
    return status;
}
