/*
 * verify.h: `kvpager simulate --verify`: the decoded outputs of chosen
 * requests, each token recomputed from scratch under the weights that
 * produced it, and the one definition of the run's weight updates.
 *
 * Owns: per chosen request, its kept outputs and the weight version (epoch:
 * the count of weight updates before it) of each decoded token; a private
 * pool of one full-capacity sequence's pages, shared with nothing; a
 * private model, the run's model regenerated from the seed and brought to
 * the epoch a segment needs by replaying the same updates
 * (kvp_sim_update_weights), and one sequence over it.
 * Why each token's epoch is enough: the scheduler preempts a request whose
 * caches are bound to older revisions before anything else in a step, and
 * attention refuses a stale cache, so a token decoded in epoch e attends to
 * K/V computed under epoch e's weights only. Its output is then the output
 * of that position in a full prefill of the same rows under epoch e's
 * weights, bit for bit.
 * Invariants: memory stays bounded by one extra model, one sequence's pages
 * and buffers, and the kept outputs of chosen requests not yet collected; no
 * revision's weights are stored (an older epoch is regenerated). A kept
 * token's epoch is SIZE_MAX until its output arrives; such a token counts
 * as a mismatch.
 * Callers: sim.c. Public headers only.
 */
#ifndef KVPAGER_CLI_VERIFY_H
#define KVPAGER_CLI_VERIFY_H

#include <stddef.h>
#include <stdint.h>

#include "kvpager/kvpager.h"
#include "sim.h"
#include "workload.h"

/* What one chosen request keeps until it is collected. */
typedef struct kvp_sim_kept {
    double *outputs; /* [samples][output_tokens][width] */
    size_t *epochs;  /* [samples][output_tokens]: the epoch each output came from */
} kvp_sim_kept;

/* The input row of (sample, position) of the request being verified. */
typedef void (*kvp_sim_row_fn)(void *ctx, size_t sample, size_t position, double *row,
                               size_t width);

typedef struct kvp_sim_verifier {
    const kvp_sim_config *config;
    size_t count;          /* workload requests */
    kvp_sim_kept *kept;    /* [count] */
    kvp_pool *pool;        /* one full-capacity sequence's pages */
    kvp_model *model;      /* the run's model at model_epoch; NULL until needed */
    size_t model_epoch;
    kvp_sequence *sequence; /* over model at model_epoch; NULL when it must be made */
    double *rows;          /* [capacity][width] */
    double *out;           /* [capacity][width] */
    size_t verified;       /* sample sequences recomputed and compared */
    size_t segments;       /* prefills run: one per (sample, epoch) a sequence ran in */
    size_t epochs_replayed; /* weight updates replayed on the private model */
    size_t mismatches;     /* tokens whose outputs differed */
} kvp_sim_verifier;

/* The run's model from the seed: the weights of epoch 0. */
kvp_status kvp_sim_model_create(const kvp_sim_config *config, kvp_model **out, kvp_error *err);

/*
 * Every layer's parameters of `model` get weight update number `epoch`
 * (1, 2, ...): a perturbation in [-1e-3, 1e-3) seeded by (seed, epoch,
 * layer, parameter), through kvp_param_update_with (a revision bump). The
 * run and the verifier both call it, so the verifier's replay gives the
 * run's weights bit for bit.
 */
int kvp_sim_update_weights(kvp_model *model, const kvp_sim_config *config, size_t epoch,
                           kvp_error *err);

/*
 * The most memory verification holds in a run of `requests` requests
 * (simulate's check against physical memory): a second model (`model_bytes`,
 * as the caller counts the run's), a private pool of one full-capacity
 * sequence's pages, its row and output buffers (2 capacity x D doubles), and
 * the outputs kept until a chosen request is collected, at most every chosen
 * request at once, each sample at most capacity tokens of D doubles and an
 * epoch. 0 without verification; an overflow sets *overflow.
 */
size_t kvp_sim_verify_bytes(const kvp_sim_config *config, size_t requests, size_t page_bytes,
                            size_t model_bytes, int *overflow);

/* Sets up the verifier of `count` requests; -1 with *err and *context set on failure. */
int kvp_sim_verifier_init(kvp_sim_verifier *v, const kvp_sim_config *config, size_t count,
                          size_t page_bytes, kvp_error *err, const char **context);

/*
 * Keeps decoded token `token` of `sample` of chosen request `i` and the
 * epoch that produced it. Returns 0, or the bytes it could not allocate.
 */
size_t kvp_sim_verifier_token(kvp_sim_verifier *v, size_t i, const kvp_workload_request *r,
                              size_t sample, size_t token, size_t epoch, const double *output);

/*
 * Recomputes every sample of finished request `i` (rows from `row`), one
 * prefill per epoch its tokens came from, and compares each token with the
 * prefill of its own epoch, bit for bit; then frees what it kept. A
 * request that kept nothing (no token decoded) verifies nothing.
 */
int kvp_sim_verifier_check(kvp_sim_verifier *v, size_t i, const kvp_workload_request *r,
                           kvp_sim_row_fn row, void *ctx, kvp_error *err, const char **context);

/* Frees everything; counts a pool that would not go in *audit_failures. */
void kvp_sim_verifier_free(kvp_sim_verifier *v, size_t *audit_failures);

#ifdef KVP_SIM_TEST_HOOKS
/*
 * Test builds only (tests/CMakeLists.txt, kvpager_cli_hooks): flips the
 * lowest bit of the first value of one kept output, as a wrong token would
 * be, so a test can see verification catch it; with `drop` set, keeps
 * nothing of that token instead, as if its output never reached on_token.
 * `epoch` and `flipped` report the epoch of the token and whether it was
 * met (flipped or dropped).
 */
typedef struct kvp_sim_test_flip {
    size_t request; /* workload index; SIZE_MAX: none */
    size_t sample;
    size_t token;
    size_t epoch;
    int flipped;
    int drop; /* 1: drop the token's output instead of flipping a bit */
} kvp_sim_test_flip;
extern kvp_sim_test_flip kvp_sim_test_flip_one;
#endif

#endif /* KVPAGER_CLI_VERIFY_H */
