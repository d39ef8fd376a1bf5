/*
 * sched_fixture.h: what the scheduler tests' two fixtures share, and
 * nothing else: the model geometry (LAYERS x WIDTH, HEADS query heads over
 * KV_HEADS, BLOCK-token pages, CAPACITY tokens a sequence), the fixture
 * (model, pool, decoder, scheduler), the scheduler config they start from
 * and stats_of, the scheduler's counters now. Included by sched_support.h (test_scheduler*.c) and
 * sched_tier_support.h (the tier tests); each of those owns its own setup,
 * teardown, book and seeds. Static inline; tests only.
 */
#ifndef KVPAGER_TESTS_SCHED_FIXTURE_H
#define KVPAGER_TESTS_SCHED_FIXTURE_H

#include "support.h"

#define WIDTH 8
#define HEADS 2
#define KV_HEADS 1
#define HEAD_WIDTH (WIDTH / HEADS)
#define LAYERS 2
#define BLOCK 4
#define CAPACITY 64

typedef struct fixture {
    kvp_model *model;
    kvp_pool *pool;
    kvp_decoder *decoder;
    kvp_scheduler *scheduler;
} fixture;

/*
 * The scheduler config both fixtures start from: CAPACITY tokens a
 * sequence, no watermark, 4 reserve tokens, `identity` (each fixture's SEED).
 */
static inline void sched_fixture_config(kvp_scheduler_config *config, uint64_t identity)
{
    kvp_scheduler_config_init(config);
    config->capacity = CAPACITY;
    config->watermark = 0.0;
    config->reserve_tokens = 4;
    config->identity = identity;
}

/* The scheduler's counters now. */
static inline kvp_scheduler_stats stats_of(const fixture *f)
{
    kvp_scheduler_stats stats;
    kvp_scheduler_stats_init(&stats);
    kvpt_assert_ok(kvp_scheduler_stats_get(f->scheduler, &stats, NULL), NULL);
    return stats;
}

#endif
