/*
 * parallel.h: the fork-join executor that attention's exact partitions run on.
 *
 * Owns: the interface, and the serial default. An executor runs fn(ctx, p)
 * exactly once for every part p < parts, on any of its threads and in any
 * order, and returns only when every part has returned; whatever the parts
 * wrote is then visible to the caller (the hand-off goes through a mutex, so
 * ThreadSanitizer and helgrind see it). A NULL executor is serial: the
 * calling thread runs parts 0, 1, ..., parts-1 in order.
 *
 * Contract for the parts: they write disjoint memory, never wait on one
 * another and never run an executor themselves, so an executor may run them
 * in any interleaving. Attention's partitions (gather.h) are built so that
 * every output element is computed by one part with the serial loop's
 * operations in the serial loop's order: the bits do not depend on the
 * executor or on how many threads it has.
 *
 * Implementation: the decoder's "assist" (src/serve/decoder.c), where
 * threads without a job of their own run the parts a running job posts.
 * Callers: src/attention (incremental attention), src/serve, bench/, tests/.
 */
#ifndef KVPAGER_ATTENTION_PARALLEL_H
#define KVPAGER_ATTENTION_PARALLEL_H

#include <stddef.h>

typedef void (*kvpi_part_fn)(void *ctx, size_t part);

typedef struct kvpi_parallel kvpi_parallel;
struct kvpi_parallel {
    /* Runs every part as above; called with parts >= 2 only. */
    void (*run)(const kvpi_parallel *self, kvpi_part_fn fn, void *ctx, size_t parts);
    void *impl; /* the implementation's state */
};

/* fn(ctx, p) for every p < parts: on `par`, or in order on this thread when par is NULL. */
static inline void kvpi_parallel_run(const kvpi_parallel *par, kvpi_part_fn fn, void *ctx,
                                     size_t parts)
{
    if (par == NULL || parts < 2) {
        for (size_t p = 0; p < parts; p++) {
            fn(ctx, p);
        }
        return;
    }
    par->run(par, fn, ctx, parts);
}

#endif /* KVPAGER_ATTENTION_PARALLEL_H */
