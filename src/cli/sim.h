/*
 * sim.h: the run behind `kvpager simulate`: a workload served by the
 * library's continuous-batching scheduler (kvpager/scheduler.h: admission,
 * batched prefill, preemption by recompute, decode on the decoder's
 * threads), and the numbers the report prints.
 *
 * Owns: one pool, one model, one decoder and one scheduler per run. Each
 * step, the requests due by then are submitted, the scheduler steps once,
 * and the step's pages and running sequences are recorded. A request of
 * turn 0 (workload.h) is due at its arrival step; a conversation's later
 * turn is closed-loop: due at the step after the turn before it finished
 * (completed, or rejected: the user sends the next message anyway) plus its
 * think_steps. Scheduler ids go in submit order (request i of the workload
 * is id i when there are no later turns).
 * Token inputs are pseudo-embeddings of (stream, sample, position) drawn
 * from the seed (workload.h: a request's stream, and its shared prefix), so a
 * recomputed request sees exactly the inputs it saw before. A prompt position
 * p of a request with block ids (a Mooncake trace) is the row of (block id
 * block_ids[p / 512], p % 512) under a fixed salt: equal ids, equal rows,
 * equal chain keys.
 * Optionally, between steps, every layer's parameters are updated in place
 * (a revision bump with a small seeded perturbation: update_every), and
 * finished requests are recomputed from scratch on a private pool, each
 * token under the weights it was decoded with, and compared bit for bit
 * (verify_every; verify.h).
 */
#ifndef KVPAGER_CLI_SIM_H
#define KVPAGER_CLI_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "kvpager/kvpager.h"
#include "sim_tier.h"
#include "workload.h"

/*
 * The default --audit-every: an audit every KVP_SIM_AUDIT_STEPS steps for
 * each KVP_SIM_AUDIT_PAGES pages of the pool, rounded up, so the audits
 * (each checks every page) cost about as much per step at any budget (a
 * few percent of a Mooncake replay's), but at most KVP_SIM_AUDIT_MAX steps
 * apart, so a long run is audited along the way at any budget. An explicit
 * N (the largest size_t aside) audits every N steps.
 */
#define KVP_SIM_AUDIT_SCALED SIZE_MAX
#define KVP_SIM_AUDIT_STEPS 64
#define KVP_SIM_AUDIT_PAGES 16384
#define KVP_SIM_AUDIT_MAX 16384

typedef struct kvp_sim_config {
    size_t layers;
    size_t model_width;
    size_t heads;
    size_t kv_heads;        /* KV heads, dividing heads; 0 means heads (plain MHA) */
    size_t block_tokens;
    size_t budget_bytes;
    kvp_dtype kv_dtype;     /* pages' storage type (kvpager/pool.h); the model computes in f64 */
    kvp_accum accum;        /* the layers' decode attention level (kvp_model_set_accum) */
    size_t capacity;
    size_t threads;         /* 0: one per core */
    uint64_t seed;
    double watermark;       /* fraction of all pages kept free at admission */
    size_t reserve_tokens;  /* decoding reserve promised at admission */
    int compute;            /* 0: allocator-only */
    int fuse_layers;        /* allocator-only: fuse the layers' pages when exact (sim.c,
                               fused_layers; default 1); 0 keeps a page per layer */
    size_t audit_every;     /* steps between pool audits (0: only the final one);
                               KVP_SIM_AUDIT_SCALED, the default: kvp_sim_audit_interval */
    size_t samples;         /* continuations per request (kvp_request.samples) */
    int sharing;            /* kvp_scheduler_config.sharing: fork, prefix index (default 1) */
    int schedule;           /* kvp_scheduler_config.schedule: a kvp_schedule (default FCFS) */
    size_t update_every;    /* scheduler steps between weight updates; 0: never */
    size_t verify_every;    /* verify requests 0, N, 2N, ... (by workload index); 0: none */
    size_t session_ttl;     /* kvp_scheduler_config.session_ttl: steps a finished turn's
                               sequence is kept for its conversation (default 128; only
                               requests with a session, conversation turns, use it) */
    size_t max_running;     /* kvp_scheduler_config.max_running: most sequences running
                               at once; 0: no limit but the pool (default 0; simulate's
                               --max-running defaults to 256) */
    kvp_sim_tier_config tier; /* --tier and its flags (sim_tier.h); count 0: none */
    /* Sliding windows (issue 21; simulate_window.c): kvp_sim_layer_window */
    size_t window;          /* W of the sliding layers; 0: every layer full (default) */
    size_t full_every;      /* with a window: layers K-1, 2K-1, ... full (Gemma 3: 6); 0: none */
    size_t sink_tokens;     /* S of the sliding layers (attention sinks) */
    /* The pool's slab from the caller (KVP_SLAB_CUSTOM; kvpager/pool.h), for a
       benchmark that keeps one slab's memory faulted in across runs
       (bench/tier_overhead.c); NULL (the default): the default source.
       Compute runs only. */
    kvp_slab_alloc_fn slab_alloc;
    kvp_slab_free_fn slab_free;
    void *slab_ctx;
} kvp_sim_config;

/* One scheduler step, for the plot and the latency figures. */
typedef struct kvp_sim_sample {
    uint32_t held_pages;
    uint32_t running;
    uint32_t cached_pages;    /* pages the prefix index names, held or evictable */
    uint32_t evictable_pages; /* cached pages no sequence holds */
    size_t clock;             /* the run's step number (arrivals' clock: idle steps skipped
                                 between requests still count) */
    double start_seconds;     /* wall-clock seconds from the run's start to the step's start */
    double end_seconds;       /* ... and to its end (after its finished requests are taken) */
} kvp_sim_sample;

/*
 * One workload request's schedule (list order). Steps here are scheduler
 * step indexes: samples[k] is the k-th step (its clock and timestamps).
 */
typedef struct kvp_sim_request {
    size_t submit_step;       /* the index of the step it was submitted before */
    size_t output_tokens;     /* tokens each sample generates */
    int finished;             /* collected: completed, or rejected */
    int rejected;
    size_t admissions;        /* kvp_request_result's: 0 never admitted, 2+ preempted */
    size_t first_hit_tokens;  /* prompt tokens adopted at its first admission */
    size_t recomputed_tokens; /* tokens prefilled again after preemption */
    size_t admitted_step;     /* first admission, first token, finish: step indexes */
    size_t first_token_step;
    size_t finished_step;
} kvp_sim_request;

/*
 * The steps from one weight update to the next (the first window starts at
 * step 0): the prompt tokens admitted in them and how many were prefix hits,
 * overall and in the window's first step that admitted any prompt tokens.
 */
typedef struct kvp_sim_window {
    size_t step;                  /* first step of the window (steps counted from 0) */
    uint64_t prompt_tokens;
    uint64_t prefix_hit_tokens;
    size_t first_step;            /* the first step admitting prompt tokens; SIZE_MAX: none */
    uint64_t first_prompt_tokens; /* that step's */
    uint64_t first_hit_tokens;
} kvp_sim_window;

typedef struct kvp_sim_result {
    size_t requests;
    size_t requests_completed;
    size_t requests_rejected;
    uint64_t tokens_generated;     /* decode tokens */
    uint64_t prefill_tokens;       /* prompt tokens processed, recomputation included */
    double seconds;
    double tokens_per_second;      /* generated tokens per wall-clock second */
    size_t steps;
    size_t peak_concurrent;
    double mean_concurrent;
    double peak_utilization;
    double mean_utilization;
    double internal_fragmentation; /* sum(held - used slots) / sum(held slots) */
    size_t preemptions;
    size_t contiguous_baseline;    /* sequences the budget holds at full capacity each, contiguous,
                                      in the same dtype */
    double concurrency_ratio;      /* peak_concurrent / contiguous_baseline */
    size_t total_pages;            /* one-layer pages (a fused pool's times fused_layers) */
    size_t page_bytes;             /* of a one-layer page */
    size_t fused_layers;           /* layers a pool page holds: 1, or layers when fused (sim.c) */
    kvp_dtype kv_dtype;            /* the pool's, from its stats */
    size_t element_bytes;          /* bytes of one stored K or V element */
    size_t full_sequences;         /* sequences of full capacity the pool's pages hold */
    size_t f64_full_sequences;     /* the same for f64 pages of the same budget */
    size_t audits;
    size_t audit_failures;
    size_t pages_leaked;           /* pages still held after every sequence is gone */
    uint64_t acquires;
    uint64_t releases;
    size_t threads;
    double output_checksum;        /* sum of every decode output's first value */
    kvp_sim_sample *samples;       /* [steps] */
    kvp_sim_request *request_log;  /* [requests]: each request's schedule, list order */
    uint64_t first_hit_tokens;     /* prompt tokens adopted at requests' first admissions
                                      (each request's prompt once, no recomputation) */
    /* sharing (kvpager/scheduler.h) */
    uint64_t prompt_tokens;        /* prompt tokens of admissions, recomputation included */
    uint64_t prefix_hit_tokens;    /* of those, adopted from the prefix index */
    double prefix_hit_rate;        /* prefix_hit_tokens / prompt_tokens (0 when none) */
    double unshared_page_steps;    /* sum over steps of the pages the running sequences
                                      would hold if nothing were shared */
    double held_page_steps;        /* sum over steps of the pages held */
    double pages_saved_ratio;      /* unshared_page_steps / held_page_steps (1: none saved) */
    size_t peak_held_pages;
    double mean_held_pages;
    uint64_t forks;
    uint64_t evictions;            /* the pool's, at the end of the run */
    uint64_t cow_copies;           /* the pool's, at the end of the run */
    uint64_t stale_preemptions;    /* sequences preempted because the weights changed */
    size_t weight_updates;
    kvp_sim_window *windows;       /* [window_count]: one, plus one per weight update */
    size_t window_count;
    size_t verified;               /* sample sequences recomputed and compared */
    size_t verify_segments;        /* their prefills: one per weight version (epoch) each
                                      sample decoded tokens in */
    size_t verify_replayed;        /* weight updates replayed on the verifier's own model */
    size_t verify_mismatches;      /* decoded tokens whose outputs differed from the recompute
                                      of their epoch (or that never came) */
    size_t verify_skipped;         /* completed chosen requests not verified: none since every
                                      token is checked under its own weights (verify.h); kept
                                      in the report and --json, where 0 says so */
    /* conversations (workload.h: turns above 0) */
    size_t later_turns;            /* turns submitted after the turn before them finished */
    size_t turn_gap_min;           /* the fewest steps from a turn finishing to its next turn's
                                      submission; 0 would be a turn submitted before the one
                                      before it finished (open loop). 0 when later_turns is 0 */
    uint64_t session_keeps;        /* finished turns whose sequence was kept (scheduler stats) */
    uint64_t session_hits;         /* next turns admitted while their conversation's was kept */
    uint64_t session_drops;        /* kept sequences given back before their next turn came */
    kvp_sim_tier_result tier;      /* the second tier's figures (present: --tier given) */
    /* sliding windows (config.window) */
    size_t peak_sliding_pages;     /* most pages the sliding layers held after a step */
    size_t peak_full_pages;        /* most pages the full layers held after a step */
    uint64_t window_releases;      /* pages the windows released (the pool's, at the end) */
} kvp_sim_result;

typedef void (*kvp_sim_progress_fn)(void *ctx, size_t done, size_t total, size_t step);

/* Defaults of every knob (docs/simulate.md documents them). */
void kvp_sim_config_init(kvp_sim_config *config);

/*
 * Layers one pool page holds (sim_fused.c): c->layers when an allocator-only
 * run fuses them (exactly: DESIGN.md, "Fused allocator-only pages"), else 1.
 */
size_t kvp_sim_fused_layers(const kvp_sim_config *c);
/* The run's pool (sim_fused.c): pages of the KV heads of kvp_sim_fused_layers
 * layers, the budget, the --kv-dtype, the slab (none allocator-only; the
 * config's hooks when given) and, with tiers, the key secret they share. */
void kvp_sim_pool_config(const kvp_sim_config *c, kvp_pool_config *pool_config);
/* A fused run's step figures in one-layer pages: page counts and token slots times lanes. */
void kvp_sim_fused_step(size_t lanes, kvp_step_stats *st);

/* Steps between audits for `audit_every` (KVP_SIM_AUDIT_SCALED: scaled) and a pool of `pages`. */
size_t kvp_sim_audit_interval(size_t audit_every, size_t pages);

/*
 * The KV heads a run stores: config->kv_heads, or heads when it is 0. Pages
 * hold this many heads, so K/V bytes per token are 2 x layers x kv_heads x
 * (model_width / heads) x 8.
 */
size_t kvp_sim_kv_heads(const kvp_sim_config *config);

/*
 * Runs the workload. Returns 0, or -1 with *err and *context describing a
 * library failure. The result's samples and windows must be freed with
 * kvp_sim_result_free.
 */
int kvp_sim_run(const kvp_sim_config *config, const kvp_workload *workload,
                kvp_sim_progress_fn progress, void *progress_ctx, kvp_sim_result *out,
                kvp_error *err, const char **context);

void kvp_sim_result_free(kvp_sim_result *result);

/* simulate_window.c */

/* Layer l's window: 0 (full) without a window or when l + 1 is a multiple of full_every. */
size_t kvp_sim_layer_window(const kvp_sim_config *config, size_t l);
/* The model's sliding layers (kvp_sim_layer_window above 0). */
size_t kvp_sim_sliding_layers(const kvp_sim_config *config);
/*
 * The run's model with its windows: kvp_sim_model_create's weights (the
 * same seeds, one layer at a time), each layer's window and sinks set
 * before the model copies it.
 */
kvp_status kvp_sim_windowed_model_create(const kvp_sim_config *c, kvp_model **out,
                                         kvp_error *err);

#endif /* KVPAGER_CLI_SIM_H */
