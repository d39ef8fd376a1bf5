/*
 * kvpager/scheduler.h: continuous batching of many requests over one model,
 * one pool and one decoder, under the pool's budget.
 *
 * A request brings a prompt, an output budget and a sample count (parallel
 * sampling: `samples` continuations of one prompt). kvp_scheduler_step runs
 * one scheduler step:
 *   0. stale parameters: every running request one of whose sequences is
 *      bound to a parameter revision that is no longer current (the caller
 *      ran kvp_param_update between steps) is preempted for recompute, all
 *      its samples at once; its recompute runs under the new weights;
 *   1. admission, first come first served: the head of the waiting queue is
 *      admitted when kvp_pool_admit says NOW for the pages it will newly
 *      take (below), keeping a watermark of free pages; its sequences are
 *      promised those pages. A request whose whole length (prompt +
 *      max_new_tokens, per sample) can never fit the pool is rejected. A
 *      model with sliding layers (kvp_layer_set_window; compute 1, sharing
 *      0): each sample is admitted for the larger of its prefill (every
 *      block of every layer, held until the prefill ends) and its level (a
 *      sliding layer's kvp_cache_pages_held_max, a full layer's blocks), and
 *      promised the level once its prefill ended. The
 *      requests admitted in a step are prefilled together, as one batch of
 *      jobs on the decoder's threads. With config.max_running, admission
 *      also stops at the first request whose samples would take the
 *      running sequences past it; a request with more samples than
 *      max_running is admitted only when nothing runs, and then runs
 *      alone, over the limit (so it is never refused for good). With
 *      config.schedule KVP_SCHEDULE_CACHE_AWARE (longest prefix match first, SGLang's
 *      policy) the first KVP_SCHEDULE_WINDOW waiting requests are
 *      considered in another order: those preempted (back at the front of
 *      the queue), rejected or already overtaken KVP_SCHEDULE_MAX_SKIPS
 *      times first, in queue order; then the rest by the prompt blocks the
 *      prefix index holds now (2.), most first, ties in queue order; the
 *      requests past the window follow in queue order. Admission goes down
 *      that order and stops at the first request that does not fit, as FCFS
 *      stops at the head, all or nothing, shared pages counted once. A
 *      request is overtaken (a request behind it in the queue admitted
 *      while it waits in the window) at most KVP_SCHEDULE_MAX_SKIPS times
 *      in all; then only requests ahead of it in that order, which are
 *      ahead of it in the queue too, go before it. Outputs do not depend on
 *      the order: each request's are bit-identical under either schedule;
 *   2. sharing (config.sharing 1, the default): before prefilling, an
 *      admitted request adopts the longest prefix of its prompt that the
 *      pool's prefix index holds (its keys include every layer's binding
 *      digest, so blocks computed under older parameters never match) and
 *      prefills only the rest; after prefilling, it publishes the prompt's
 *      full blocks (and its decoded ones when it finishes: 4.), and its
 *      first sequence is forked samples - 1 times (as kvp_sequence_fork,
 *      but sample 0 stays the one writer of the shared partial last page
 *      and appends to it in place, while each other sample copies it on
 *      its first append: n samples make n - 1 copies). Admission counts
 *      shared pages once: a request needs only the prompt pages its
 *      adoptable prefix does not cover, plus each sample's decoding reserve
 *      and, for samples 1 .. n - 1, its copy-on-write copy; each sample is
 *      promised exactly the pages it will take.
 *      With sharing 0 every sample is its own sequence that prefills the
 *      whole prompt, and nothing is published or adopted;
 *   3. preemption by recompute: while the running sequences need more new
 *      pages this step than are free, the most recently admitted request
 *      gives all its samples' pages back and returns to the front of the
 *      queue; when it is admitted again, its prompt and each sample's
 *      generated tokens are prefilled again from the same input rows, so
 *      its outputs are bit-identical to a run without preemption;
 *   4. decode: every running sequence (one per sample) advances one token on
 *      the decoder's threads (or, with compute off, appends one row of zeros
 *      to external caches: the allocator alone; sharing then works at cache
 *      level, kvp_cache_fork and prefix keys over the input rows the `input`
 *      callback gives); a request whose every sample has generated
 *      max_new_tokens finishes and gives its pages back. With sharing, just
 *      before that, each sample publishes the full blocks of its whole
 *      sequence, prompt and decoded tokens, keyed by the same chain over
 *      its input rows as a prompt's (the `input` callback gives the decoded
 *      tokens' rows again; a request without one publishes only its
 *      prompt), so a later prompt that holds this prompt and one sample's
 *      reply (a conversation's next turn) adopts them. Every sample
 *      publishes its own blocks: any continuation may be the one a later
 *      prompt holds, and its keys match only its own rows.
 *   5. sessions (config.session_ttl > 0, sharing on): a request with a
 *      nonzero `session` that completes keeps its sample 0 sequence, its
 *      pages held, for up to session_ttl steps, so its published blocks
 *      (4.) cannot be evicted before the session's next request (a
 *      conversation's next turn, whose prompt holds this turn's reply)
 *      adopts them (2.); an LRU pool under load otherwise evicts them while
 *      that request waits for a think time and then in the queue. A
 *      request submitted while its session's sequence is kept (and bound
 *      to current parameters) goes to the front of the queue, ahead of
 *      preempted ones (its prefix is held, so it needs only the pages of
 *      its new tokens) and of earlier such requests, but behind every
 *      waiting request that let KVP_SESSION_MAX_OVERTAKES session
 *      requests go ahead of it already (each request it goes ahead of
 *      counts one). The bound: a waiting request lets at
 *      most KVP_SESSION_MAX_OVERTAKES session requests go ahead of it;
 *      then only the requests ahead of it in the queue, and preempted ones
 *      returning to the front, are admitted before it. Under FCFS each
 *      step in which the head of the queue fits admits at least the head,
 *      so a request is admitted within (its place in the queue at submit
 *      + the preempted requests that return ahead of it +
 *      KVP_SESSION_MAX_OVERTAKES + 1) such steps: a steady stream of
 *      session requests cannot starve it (cache-aware: the bound of 1.
 *      for its window as well). The kept sequence is given back (its
 *      pages become evictable, still indexed) when a request of its session is
 *      admitted, once that request adopted its prefix (a session hit,
 *      unless the sequence was stale); when it expires; when another
 *      request of the session completes and is kept instead; when its
 *      parameters change; oldest first, when keeping one would hold more
 *      than session_fraction of the pool's pages (a page kept sequences
 *      share counts once), and before any running
 *      request is preempted for pages (3.); and all of them when a step
 *      admitted nothing and nothing runs while requests wait, so kept
 *      sequences never stall the queue. Expiry, changed parameters and
 *      stalls are seen at the end of a step. Kept pages are held pages:
 *      admission counts them as taken, the cost of sessions. Outputs do
 *      not change; admission order does. A session's requests should
 *      come one at a time, each after the one before it finished (a
 *      conversation's turns): only a finished request's sequence is kept,
 *      one per session.
 *   6. the second tier (a tier attached to the pool: kvp_pool_tier_attach,
 *      sharing on): after an admitted request adopted what the
 *      prefix index holds (2.), the next prompt blocks it may adopt are
 *      asked from the tier and the run of them the tier holds and that
 *      verify is loaded into fresh pages (kvp_cache_group_tier_load) before
 *      the rest is computed; a failed, refused or short load changes
 *      nothing but what is computed. Loaded rows are the published pages'
 *      bytes, so outputs are bit-identical. config.tier_loads decides
 *      whether to ask: KVP_TIER_LOADS_MODEL (the default) asks when a
 *      block's load, at the tier's observed bytes per second, is expected
 *      to take no longer than computing its tokens at the measured prefill
 *      tokens per second (an optimistic prior until the first of each is
 *      measured; every 16th refused ask loads anyway, to follow the tier);
 *      the stats count the blocks decided so (tier_recomputes).
 *      Prefetch (config.tier_prefetch): after a step's plan, a waiting
 *      request the plan stopped at for want of pages because its prefix
 *      missed (or, cache-aware, one the window ranked) has the missed run
 *      of its adoptable blocks asked from the tier at once
 *      (kvp_pool_tier_prefetch), at most tier_prefetch requests at a time.
 *      At its admission a completed prefetch is mapped after what the
 *      index gave (kvp_cache_group_tier_map: no second round trip); one
 *      still in flight is cancelled, never waited for, and those blocks
 *      are computed (tier_prefetch_late). Outputs do not change.
 *      Allocator-only (compute off, a pool without data and a keys-only
 *      tier, kvp_tier_host_keys_create): the same read, the pages mapped
 *      unwritten; MODEL then always loads (nothing is computed or moved,
 *      so there is no rate to compare).
 * Finished requests wait for kvp_scheduler_collect.
 *
 * Inputs (prefix keys from block digests instead: kvp_request.block_digest):
 * a request's rows come from its `prompt` array, or from its `input`
 * callback, called with (request id, sample, position) for every position it
 * needs, again when a preempted request is recomputed and when a finished
 * one keys its decoded blocks (sharing); it must give the same row for the
 * same (id, sample, position) every time, and a decoded position's row must
 * be the one that was decoded there, since a later prompt with the same
 * rows adopts that block instead of computing it. Positions below
 * prompt_tokens are the prompt: the scheduler asks for them with sample 0
 * and every sample shares that row; positions from prompt_tokens on are
 * each sample's own. The outputs of decoded tokens go to the request's
 * optional `on_token` callback, with the sample that decoded them. Both run
 * on the thread that calls kvp_scheduler_step, never on the decoder's
 * threads.
 *
 * Memory: the scheduler keeps a record of each request from submit until
 * it is collected (its copy of the kvp_request, its counters and its last
 * error: about 700 bytes on a 64-bit target, plus 16 bytes of id index),
 * and then recycles it for a later request; its queue, running slots,
 * finished results, kept and idle sequences and scratch grow to the most
 * the workload ever holds at once and are reused, never to the number of
 * requests served. So memory is bounded by the peak of requests held (not
 * yet collected) and of sequences running or kept, however many requests
 * pass, and a steady state allocates nothing per step. The pool's prefix
 * index is sized with the pool (pool.h). A caller that never collects keeps
 * every finished request's record.
 *
 * Threads: a scheduler has one owner at a time: its calls must not overlap
 * (one caller at a time per scheduler). Its model, pool and decoder may be
 * shared with other users, as their own headers allow; the scheduler
 * counts only the pages kvp_pool_admit and kvp_pool_stats_get report.
 */
#ifndef KVPAGER_SCHEDULER_H
#define KVPAGER_SCHEDULER_H

#include <stddef.h>
#include <stdint.h>

#include "kvpager/common.h"
#include "kvpager/model.h"
#include "kvpager/pool.h"
#include "kvpager/sequence.h"
#include "kvpager/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_scheduler kvp_scheduler;

/* A growing struct (pool.h): struct_size first, set by kvp_scheduler_config_init. */
typedef struct kvp_scheduler_config {
    size_t struct_size;
    size_t capacity;       /* positions each sequence may hold; 0 is refused (ZERO_CAPACITY) */
    double watermark;      /* fraction of the pool's pages kept free at admission, in [0, 1) */
    size_t reserve_tokens; /* decoding reserve promised at admission */
    size_t max_running;    /* most sequences running at once; 0: no limit but the pool.
                              A request with more samples than this is admitted only
                              when nothing runs, and then runs alone */
    int compute;           /* 1: real attention on the decoder; 0: the allocator alone */
    uint64_t identity;     /* compute 0: the identity the external caches bind (cache.h) */
    int sharing;           /* 1: fork samples, adopt prompt prefixes from the pool's
                              prefix index, publish prompt and decoded blocks in it;
                              0: every sample prefills its own copy of the prompt and
                              the index is neither read nor written */
    /* first release ends here; later fields default when struct_size does not cover
       them (8-aligned, so none lies in the first release's tail padding) */
    uint64_t schedule;     /* the admission order: a kvp_schedule (1. above) */
    size_t session_ttl;    /* sessions (5. above): steps a finished request's sequence is
                              kept for its session's next request; 0: none are kept */
    double session_fraction; /* sessions: most of the pool's pages kept sequences may hold,
                                in [0, 1] */
    /* Allocator-only runs without a model (compute 0, model NULL): the geometry the
       model would give. The KV heads and head width are the pool's. 0: the model's
       (with a model they must be 0 or equal the model's) */
    size_t layers;         /* layers, each one external cache per lease */
    size_t model_width;    /* the width of the input rows the `input` callback gives
                              (prefix keys chain them) */
    /* The pool's second tier (kvpager/tier.h; used when one is attached): whether a
       prompt block the prefix index misses is loaded from the tier or recomputed,
       a kvp_tier_loads (6. above) */
    uint64_t tier_loads;
    /* The second tier's prefetch (6. above): waiting requests with a tier get in flight
       at once, at most (0: none are prefetched; at most KVP_TIER_PREFETCH_MAX) */
    size_t tier_prefetch;
} kvp_scheduler_config;

/* kvp_scheduler_config.tier_prefetch: its largest value. */
#define KVP_TIER_PREFETCH_MAX 16

/* kvp_scheduler_config.tier_loads: load a missed prompt block from the tier, or recompute it. */
typedef enum kvp_tier_loads {
    KVP_TIER_LOADS_MODEL = 0,  /* per block, from the measured cost model (the default) */
    KVP_TIER_LOADS_ALWAYS = 1, /* every block the tier holds is loaded */
    KVP_TIER_LOADS_NEVER = 2   /* the tier is never read (the pool still writes to it) */
} kvp_tier_loads;

/* kvp_scheduler_config.schedule: the order admission considers waiting requests in. */
typedef enum kvp_schedule {
    KVP_SCHEDULE_FCFS = 0,       /* the queue's order (the default) */
    KVP_SCHEDULE_CACHE_AWARE = 1 /* the first KVP_SCHEDULE_WINDOW of the queue by prompt
                                    blocks the prefix index holds, most first (1. above) */
} kvp_schedule;

/* Cache-aware: waiting requests ranked per step, and overtakings a request bears. */
#define KVP_SCHEDULE_WINDOW 8
#define KVP_SCHEDULE_MAX_SKIPS 8
/* Sessions: session requests a waiting request lets go ahead of it, at most (5.). */
#define KVP_SESSION_MAX_OVERTAKES 64

/*
 * Sets struct_size and the defaults: capacity 0 (the caller must set it),
 * watermark 0.01, reserve_tokens 16, max_running 0, compute 1, identity 0,
 * sharing 1, schedule KVP_SCHEDULE_FCFS, session_ttl 0 (no session keeps
 * a sequence), session_fraction 0.5, layers 0 and model_width 0 (the model's),
 * tier_loads KVP_TIER_LOADS_MODEL, tier_prefetch 2.
 * NULL is ignored.
 * Threads: thread-safe (touches only *config).
 */
KVP_API void kvp_scheduler_config_init(kvp_scheduler_config *config);

/*
 * The input row of token `position` of sample `sample` of request
 * `request_id`: `width` doubles (the model's width) into `row`. For
 * positions below the request's prompt_tokens the scheduler passes sample 0
 * and the row is every sample's; from prompt_tokens on, each sample
 * (0 .. samples - 1) has its own rows. Must be deterministic in
 * (request_id, sample, position) and give finite values.
 */
typedef void (*kvp_scheduler_input_fn)(void *ctx, uint64_t request_id, size_t sample,
                                       size_t position, double *row, size_t width);

/* The output of sample `sample`'s decoded token at `position` ([1, 1, width],
 * the residual stream). */
typedef void (*kvp_scheduler_token_fn)(void *ctx, uint64_t request_id, size_t sample,
                                       size_t position, const double *output, size_t width);

/*
 * The content digest of block `block` of sample `sample` of request
 * `request_id`: positions [block x block_tokens, (block + 1) x
 * block_tokens) (the pool's block_tokens), 16 bytes into *digest. For a
 * block wholly below the request's prompt_tokens the scheduler passes
 * sample 0 and the digest is every sample's. Must be deterministic in
 * (request_id, sample, block), and equal for equal content: two blocks
 * with equal digests (under the same earlier blocks, bindings and salt)
 * share one key, so one adopts the other's pages. A trace that names its
 * blocks by hash (Mooncake's hash_ids, one per 512 tokens) gives block b
 * the digest of (hash_ids[b x block_tokens / 512], b x block_tokens % 512 /
 * block_tokens) when block_tokens divides 512.
 */
typedef void (*kvp_scheduler_block_fn)(void *ctx, uint64_t request_id, size_t sample,
                                       size_t block, kvp_block_key *digest);

/* A growing struct (pool.h): struct_size first, set by kvp_request_init. */
typedef struct kvp_request {
    size_t struct_size;
    size_t prompt_tokens;           /* >= 1 */
    const double *prompt;           /* [prompt_tokens][width], or NULL: `input` gives them */
    kvp_scheduler_input_fn input;   /* rows past the prompt (all rows when prompt is NULL);
                                       required with compute 1 */
    void *ctx;                      /* passed to input and on_token */
    kvp_scheduler_token_fn on_token;/* optional */
    size_t max_new_tokens;          /* the output budget, >= 1 */
    size_t samples;                 /* continuations of the prompt, 1 .. 256; each decodes
                                       max_new_tokens tokens */
    /* first release ends here; later fields default (0) when struct_size does not cover them */
    uint64_t session;               /* 0: none; else the conversation this request is a turn
                                       of (5. above): with config.session_ttl its finished
                                       sequence is kept for the session's next request */
    kvp_block_key salt;             /* all zero: none; else the request's blocks are keyed
                                       under this salt (vLLM's cache_salt), so it adopts and
                                       publishes only blocks of requests with the same salt
                                       (kvp_sequence_adopt_prefix_salted). One per tenant */
    kvp_scheduler_block_fn block_digest; /* optional: prefix keys chain each block's 16-byte
                                       digest (with sharing) instead of its rows, so an
                                       allocator-only request needs neither `prompt` nor
                                       `input`, and a key costs a block, not its
                                       block_tokens x width doubles. The decoded blocks a
                                       finished request publishes are keyed by it too.
                                       Keys of digests never equal keys of rows: give the
                                       requests that should share one kind */
} kvp_request;

/* Sets struct_size, samples 1 and every other field 0 / NULL. NULL is ignored.
 * Threads: thread-safe (touches only *request). */
KVP_API void kvp_request_init(kvp_request *request);

/* One finished request, as kvp_scheduler_collect hands it back. */
typedef struct kvp_request_result {
    size_t struct_size;
    uint64_t id;
    size_t tokens_generated; /* over all samples (samples x max_new_tokens when complete) */
    size_t preemptions;  /* times it was preempted and recomputed (stale parameters included) */
    int rejected;        /* 1: its whole length can never fit the pool; nothing was run */
    kvp_status status;   /* KVP_OK, or why its prefill or a decode step failed */
    kvp_error error;     /* the failure's detail when status is not KVP_OK */
    /* first release ends here; the steps below count kvp_scheduler_step calls from 0
       (kvp_scheduler_stats.steps when the step began) */
    size_t admissions;        /* times admitted: 1 + re-admissions after preemption; 0: never */
    size_t first_hit_tokens;  /* prompt tokens adopted from the prefix index at its first
                                 admission (later admissions' hits not counted) */
    size_t recomputed_tokens; /* tokens prefilled again at its re-admissions after preemption */
    uint64_t admitted_step;   /* the step of its first admission (0 when never admitted) */
    uint64_t first_token_step; /* the step that decoded its first token (0 when none) */
    uint64_t finished_step;   /* the step it finished or was rejected in */
} kvp_request_result;

/* Sets struct_size and zeroes the rest. NULL is ignored.
 * Threads: thread-safe (touches only *result). */
KVP_API void kvp_request_result_init(kvp_request_result *result);

/* What one kvp_scheduler_step did, and the pool after it. */
typedef struct kvp_step_stats {
    size_t struct_size;
    size_t admitted;        /* requests admitted (and prefilled) */
    size_t rejected;        /* requests rejected */
    size_t preempted;       /* sequences preempted by recompute */
    size_t decoded;         /* sequences that decoded a token */
    size_t finished;        /* requests that finished (rejected ones not counted) */
    size_t failed;          /* requests whose prefill or decode failed (finished with a status) */
    size_t running;         /* sequences running after the step */
    size_t waiting;         /* requests waiting after the step */
    size_t prefill_tokens;  /* prompt tokens prefilled, recomputation included */
    size_t used_slots;      /* token slots (positions x layers) of the sequences still running,
                               and of the kept ones (5.); a block a sliding window released
                               holds none */
    size_t held_pages;      /* the pool's, after the step */
    size_t total_pages;
    size_t prompt_tokens;     /* prompt tokens of the requests admitted this step,
                                 recomputation included (each request's prompt once) */
    size_t prefix_hit_tokens; /* of those, adopted from the prefix index, not computed */
    size_t unshared_pages;    /* pages the running and kept (5.) sequences would hold if
                                 nothing were shared: the sum of each one's own page count
                                 (released blocks of sliding windows not counted) */
    size_t cached_pages;      /* the pool's, after the step (kvp_pool_stats) */
    size_t evictable_pages;   /* the pool's, after the step (kvp_pool_stats) */
    size_t stale_preempted;   /* sequences preempted because their parameters changed
                                 (also counted in `preempted`) */
    /* first release ends here */
    size_t retained_pages;    /* pages the kept session sequences hold after the step (5.),
                                 each once however many of them name it */
    size_t sliding_held_pages; /* of held_pages, those the running sequences' sliding layers
                                  (kvp_layer_set_window) hold: released blocks hold none */
} kvp_step_stats;

/* Sets struct_size and zeroes the rest. NULL is ignored.
 * Threads: thread-safe (touches only *stats). */
KVP_API void kvp_step_stats_init(kvp_step_stats *stats);

/* Counters since creation. */
typedef struct kvp_scheduler_stats {
    size_t struct_size;
    uint64_t submitted;
    uint64_t completed;         /* finished with every token generated */
    uint64_t rejected;
    uint64_t failed;            /* finished with a failure status */
    uint64_t preemptions;
    uint64_t tokens_generated;  /* decoded tokens */
    uint64_t prefill_tokens;    /* prompt tokens prefilled, recomputation included */
    uint64_t steps;             /* successful kvp_scheduler_step calls */
    size_t running;             /* sequences running now (one per sample) */
    size_t waiting;             /* requests waiting now */
    size_t uncollected;         /* finished requests not yet collected */
    size_t peak_running;        /* most sequences decoded in one step */
    size_t held_samples;        /* sequences (leases) the scheduler holds, running or idle */
    uint64_t prompt_tokens;     /* prompt tokens of admitted requests, recomputation included */
    uint64_t prefix_hit_tokens; /* of those, adopted from the prefix index */
    uint64_t stale_preemptions; /* sequences preempted because their parameters changed */
    uint64_t forks;             /* sequences (or caches) forked for samples 2 .. n */
    /* first release ends here */
    size_t retained;            /* sessions whose finished sequence is kept now (5.) */
    size_t retained_pages;      /* pages those sequences hold now, each once */
    uint64_t session_keeps;     /* finished sequences kept for their session */
    uint64_t session_hits;      /* requests admitted while their session's sequence was kept */
    uint64_t session_drops;     /* kept sequences given back before their session's next
                                   request was admitted: expired, replaced, over
                                   session_fraction, for running sequences' pages, stale,
                                   or in a stall (5.) */
    /* The pool's second tier (6.): prompt blocks the prefix index missed and the tier
       served, mapped instead of computed (also counted in prefix_hit_tokens) */
    uint64_t tier_hit_blocks;   /* blocks loaded (each of every layer: one) */
    uint64_t tier_hit_tokens;   /* their tokens */
    uint64_t tier_load_bytes;   /* tier block bytes those loads read (every layer's) */
    double tier_load_seconds;   /* time spent in loads (kvp_cache_group_tier_load) */
    uint64_t tier_rejected;     /* blocks the tier returned that failed verification */
    uint64_t tier_errors;       /* blocks the tier failed to read, and loads refused */
    uint64_t tier_recomputes;   /* missed prompt blocks the cost model chose to recompute
                                   rather than ask the tier for */
    double tier_bytes_per_second;   /* the cost model's rates (6.): the tier's, a moving
                                       average over the loads that brought blocks (0:
                                       none yet) */
    double prefill_tokens_per_second; /* and the prompt prefill's (0: none measured yet) */
    /* Prefetch while a request waits (6.): tier gets issued for waiting requests' missed
       prompt blocks; of those, mapped at admission (their blocks are in tier_hit_blocks),
       still in flight at admission (cancelled: the blocks were computed), and cancelled
       unused (the request was admitted without them, finished, failed or dropped, or
       the tier was detached since) */
    uint64_t tier_prefetches;
    uint64_t tier_prefetch_used;
    uint64_t tier_prefetch_late;
    uint64_t tier_prefetch_wasted;
} kvp_scheduler_stats;

/* Sets struct_size and zeroes the rest. NULL is ignored.
 * Threads: thread-safe (touches only *stats). */
KVP_API void kvp_scheduler_stats_init(kvp_scheduler_stats *stats);

/*
 * A scheduler over `model`'s layers, drawing pages from `pool`, decoding on
 * `decoder` (NULL allowed only with compute 0). It holds the three without
 * owning them: they must outlive it. An allocator-only scheduler (compute 0)
 * needs no model: with `model` NULL it takes the layers and the input rows'
 * width from cfg (layers, model_width) and the KV heads and head width from
 * the pool, so it builds and reads no weights. Errors, in order:
 * NULL_ARGUMENT (pool, cfg, out); INVALID_ARGUMENT (cfg's struct_size;
 * "watermark" not in [0, 1); "schedule" not a kvp_schedule;
 * "session_fraction" not in [0, 1]); NULL_ARGUMENT ("model" when compute is
 * 1; "decoder" when compute is 1); INVALID_ARGUMENT ("layers" or
 * "model_width": 0 without a model, or, with one, neither 0 nor the model's);
 * then the errors of creating its first sequence, which checks the model
 * and pool against each other
 * (ZERO_CAPACITY, CAPACITY_EXCEEDS_POSITIONS, GEOMETRY_MISMATCH, ...: see
 * kvp_sequence_create, or kvp_cache_create with compute 0);
 * ALLOCATION_FAILED. *out is written only on success; a failure leaves
 * nothing allocated.
 * Threads: thread-safe (creates a new handle; reads the model and pool).
 */
KVP_API KVP_NODISCARD kvp_status kvp_scheduler_create(const kvp_model *model, kvp_pool *pool,
                                                      kvp_decoder *decoder,
                                                      const kvp_scheduler_config *cfg,
                                                      kvp_scheduler **out, kvp_error *err);

/*
 * Destroys every sequence the scheduler holds (their pages and promises go
 * back to the pool) and frees it; requests not collected are dropped.
 * NULL: nothing happens and KVP_OK is returned, as free(NULL) (kvpager.h).
 * Threads: one caller at a time per scheduler; not while another call uses it.
 */
KVP_API kvp_status kvp_scheduler_destroy(kvp_scheduler *scheduler, kvp_error *err);

/*
 * Queues a request at the back of the waiting queue and gives its id
 * (0, 1, 2, ... in submit order: a 64-bit count, so no id is given twice
 * within 2^64 submissions, though records are recycled once collected).
 * A session's request whose sequence is kept goes ahead of the queue
 * instead, within the bound of 5. above. The request is copied; `prompt`
 * and `ctx` are the caller's and must stay valid until the request is collected
 * (a preempted request reads its rows again). Errors, in order, each
 * changing nothing (no id is used): NULL_ARGUMENT (scheduler, request, id;
 * `input` when compute is 1: the decoded tokens' rows come from it);
 * INVALID_ARGUMENT (struct_size; "prompt_tokens" 0; "max_new_tokens" 0;
 * "samples" 0 or above 256);
 * FULL when prompt_tokens + max_new_tokens exceeds the capacity (err.what
 * "request", err.tokens the length, err.available the capacity);
 * ALLOCATION_FAILED.
 * Threads: one caller at a time per scheduler.
 */
KVP_API KVP_NODISCARD kvp_status kvp_scheduler_submit(kvp_scheduler *scheduler,
                                                      const kvp_request *request, uint64_t *id,
                                                      kvp_error *err);

/*
 * One step (admission and prefill, preemption, decode: the top of this
 * file). A request whose prefill or decode job fails (a non-finite input
 * row, or POOL_EXHAUSTED when another user of the pool took the pages)
 * finishes with that status and its pages go back; the step goes on.
 * `stats` (optional) receives what the step did.
 * Errors: NULL_ARGUMENT; INVALID_ARGUMENT (stats' struct_size);
 * ALLOCATION_FAILED, found before anything changes; the decoder's refusals
 * (DECODER_BUSY when another caller is stepping it): for the prefill
 * batch, found before anything changes (the step takes the decoder's step
 * slot before it admits, so no other caller can take it in between; a step
 * that admits nothing, or runs with compute off, never asks); from the
 * decode batch, the step's admissions, prefills and preemptions (and the
 * session sequences given back for them) stand and no token was decoded
 * (the next step decodes them).
 * Threads: one caller at a time per scheduler; the decoder runs the jobs on
 * its threads; `input` and `on_token` run on the calling thread.
 */
KVP_API KVP_NODISCARD kvp_status kvp_scheduler_step(kvp_scheduler *scheduler,
                                                    kvp_step_stats *stats, kvp_error *err);

/*
 * Moves up to `cap` finished requests, oldest first, into finished[0..n),
 * and writes n. Each entry is written whole (the library's
 * sizeof(kvp_request_result)); finished[0].struct_size must say that much:
 * INVALID_ARGUMENT otherwise, as for NULL_ARGUMENT (scheduler, n; finished
 * when cap > 0), changing nothing.
 * Threads: one caller at a time per scheduler.
 */
KVP_API KVP_NODISCARD kvp_status kvp_scheduler_collect(kvp_scheduler *scheduler,
                                                       kvp_request_result *finished, size_t cap,
                                                       size_t *n, kvp_error *err);

/* Where a request is (kvp_scheduler_request_state). */
typedef enum kvp_request_state {
    KVP_REQUEST_WAITING = 0, /* queued, preempted ones included */
    KVP_REQUEST_RUNNING = 1, /* admitted: its samples hold sequences */
    KVP_REQUEST_FINISHED = 2 /* completed, rejected or failed, waiting for collect */
} kvp_request_state;

/*
 * Where request `id` is now, into *state. Errors, changing nothing:
 * NULL_ARGUMENT (scheduler, state); REQUEST_UNKNOWN when the scheduler holds
 * no request `id`: it was collected (its record is recycled; the id stays
 * stale for good, as ids are never given twice) or never given by submit
 * (err.index the id, err.limit the next id submit gives).
 * Threads: one caller at a time per scheduler.
 */
KVP_API KVP_NODISCARD kvp_status kvp_scheduler_request_state(const kvp_scheduler *scheduler,
                                                             uint64_t id,
                                                             kvp_request_state *state,
                                                             kvp_error *err);

/*
 * The counters. NULL_ARGUMENT; INVALID_ARGUMENT (struct_size); changes nothing.
 * Threads: one caller at a time per scheduler.
 */
KVP_API KVP_NODISCARD kvp_status kvp_scheduler_stats_get(const kvp_scheduler *scheduler,
                                                         kvp_scheduler_stats *out,
                                                         kvp_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_SCHEDULER_H */
