/*
 * requests_internal.h: the scheduler's request records, recycled, and the
 * map from request ids to them (src/serve/requests.c).
 *
 * Ids are 0, 1, 2, ... in the order records are added: a 64-bit counter,
 * so an id is never given twice (2^64 adds would be needed). A record lives
 * from its add (submit) to its remove (collect); its slot then goes back to
 * a free list and serves a later request, under that request's new id, so
 * the table holds as many records as requests are held at once (waiting,
 * running or finished and not collected), never one per request served.
 * Finding an id that was removed, or never added, gives NULL.
 *
 * Records move when the table grows (kvpi_requests_reserve): pointers to
 * them are valid until the next reserve.
 * Callers: the scheduler's rooms (src/serve/scheduler*.c), one caller at a time (the
 * scheduler's).
 */
#ifndef KVPAGER_SERVE_REQUESTS_INTERNAL_H
#define KVPAGER_SERVE_REQUESTS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvpager/scheduler.h"
#include "pager/abi.h"

/*
 * The first-release sizes of the scheduler's growing structs
 * (kvpager/scheduler.h; pager/abi.h, "Growing structs"), and of kvp_request
 * the release that added sessions, before salt.
 */
#define KVPI_SCHEDULER_CONFIG_SIZE_FIRST offsetof(kvp_scheduler_config, schedule)
#define KVPI_REQUEST_SIZE_FIRST offsetof(kvp_request, session)
#define KVPI_REQUEST_SIZE_SESSION offsetof(kvp_request, salt)
#define KVPI_STEP_STATS_SIZE_FIRST offsetof(kvp_step_stats, retained_pages)
#define KVPI_SCHEDULER_STATS_SIZE_FIRST offsetof(kvp_scheduler_stats, retained)
KVPI_FIRST_RELEASE_ALIGNED(kvp_scheduler_config, KVPI_SCHEDULER_CONFIG_SIZE_FIRST);
KVPI_FIRST_RELEASE_ALIGNED(kvp_request, KVPI_REQUEST_SIZE_FIRST);
KVPI_FIRST_RELEASE_ALIGNED(kvp_request, KVPI_REQUEST_SIZE_SESSION);
KVPI_FIRST_RELEASE_ALIGNED(kvp_step_stats, KVPI_STEP_STATS_SIZE_FIRST);
KVPI_FIRST_RELEASE_ALIGNED(kvp_scheduler_stats, KVPI_SCHEDULER_STATS_SIZE_FIRST);

typedef struct kvpi_record {
    uint64_t id;
    kvp_request request;  /* the caller's, copied (struct_size the library's) */
    size_t generated;     /* tokens each sample generated so far, kept across preemption */
    size_t preemptions;
    size_t admissions;        /* kvp_request_result's: times admitted, */
    size_t first_hit_tokens;  /* adopted at the first admission, */
    size_t recomputed_tokens; /* prefilled again at later admissions, */
    uint64_t admitted_step;   /* the step of the first admission */
    uint64_t first_token_step; /* and of the first token */
    size_t skips;         /* cache-aware: steps that admitted a request behind it in the queue
                             while it waited in the window */
    size_t overtaken;     /* session requests placed ahead of it while it waited (queue_jump) */
    size_t slots;         /* running slots (samples) it holds: samples while running, else 0 */
    int state;            /* the scheduler's; KVPI_RECORD_FREE while the slot is free */
    int failed;           /* a job of this step failed; `error` says why */
    kvp_error error;
    size_t next_free;     /* free slots: the next free slot, or SIZE_MAX */
    /*
     * The prompt's block keys of its last admission, lane 0
     * (share_internal.h's chain entries), then the `layers` layer ids they
     * were made under: `chain_blocks` blocks (0: none). Publication
     * continues the chain from them instead of keying the prompt again
     * (scheduler_step.c). The buffer (chain_room entries) stays with the
     * slot when the record is recycled, and goes with kvpi_requests_free.
     */
    kvp_block_key *chain;
    size_t chain_room;
    size_t chain_blocks;
    /* Every page of the prompt's chain_blocks blocks was registered under its key by
       the last prefill's publication (sample 0's: the samples share them). */
    int prompt_registered;
} kvpi_record;

#define KVPI_RECORD_FREE (-1)

typedef struct kvpi_requests {
    kvpi_record *records; /* [room] */
    size_t room;
    size_t live;          /* records held */
    size_t free_head;     /* the first free slot, or SIZE_MAX */
    size_t *index;        /* [index_room], a power of two >= 2 * room: slot + 1, 0 empty */
    size_t index_room;
    uint64_t next_id;     /* the id of the next add */
} kvpi_requests;

/* An empty table (allocates nothing). */
void kvpi_requests_init(kvpi_requests *t);

void kvpi_requests_free(kvpi_requests *t);

/* Room for `more` adds without allocating: 0, or -1 changing nothing. */
int kvpi_requests_reserve(kvpi_requests *t, size_t more);

/* A new record, zeroed but its id (the next one) and its slot's chain buffer; room was reserved. */
kvpi_record *kvpi_requests_add(kvpi_requests *t);

/* The record of `id`, or NULL when the table does not hold it. */
kvpi_record *kvpi_requests_find(const kvpi_requests *t, uint64_t id);

/* Recycles the record of `id` (held). */
void kvpi_requests_remove(kvpi_requests *t, uint64_t id);

#endif /* KVPAGER_SERVE_REQUESTS_INTERNAL_H */
