/*
 * concurrent.c: many threads, one pool.
 *
 * T threads each own several sequences of one shared model on one shared
 * pool that is too small for all of them, and perform random steps,
 * prefills, allocator-only appends, resets, destroys and promises, from
 * fixed seeds. Every operation that fails must fail with POOL_EXHAUSTED or
 * FULL and leave its sequence exactly as it was (len, held pages and a
 * digest of every layer's rows and page tables). Every thread runs the pool
 * audit every K operations while the others keep working. At the end every
 * page is free, nothing is promised, and acquires equal releases exactly.
 *
 * Whether random operations ever exhaust the pool depends on how the threads
 * are scheduled (under Valgrind they run one at a time), so the run forces
 * it: at `--storms` fixed points of every thread's operations, all threads
 * stop together (a barrier), then each grows every one of its sequences one
 * step at a time until each has been refused, checking every refusal as
 * above. Steps take their pages all or none and nothing gives pages back
 * during a storm, so once a sequence is refused it stays refused. When all
 * threads are done, one thread checks, with the others parked at the
 * barrier, that the pool is spent: the audit passes, at least one refusal of
 * the storm was POOL_EXHAUSTED, and no sequence below its capacity could take
 * another step. The options must make that certain: the sequences together
 * must be able to hold more pages than the pool has (checked up front).
 *
 * The decoder is forced the same way: at `--decoder-rounds` fixed points all
 * threads stop (a barrier), and one thread, the round's owner, resets every
 * thread's sequences (the pool is then certain to hold the batch) and runs
 * them all as one batch of step and prefill jobs on the decoder all threads
 * share. Its next_input callback, on its first call, holds the step open:
 * it calls back into the decoder itself, then lets every other thread try a
 * step of its own on the same decoder (a barrier), and waits until they
 * have (another). Every one of those calls must be refused with
 * DECODER_BUSY, writing nothing; every job of the batch must succeed and
 * grow its sequence by exactly its tokens. None of it depends on scheduling.
 *
 * Exit status 0 when all of that holds, 1 otherwise, 2 on usage errors.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "serve/sequence_internal.h"
#include "stress_common.h"

#define PROGRAM "stress-concurrent"
#define MAX_PREFILL 8
/* Prompt tokens of a decoder round's prefill jobs. */
#define ROUND_PREFILL 3

struct worker;

typedef struct shared {
    kvp_pool *pool;
    kvp_model *model;
    size_t capacity;
    size_t width;
    size_t ops;
    size_t audit_every;
    size_t sequences;
    size_t storms;
    size_t rounds;
    uint64_t seed;
    size_t threads;
    struct worker *workers;
    pthread_barrier_t barrier; /* every worker: storms and rounds start and end together */
    /* Written only by the thread that checks a storm, between barriers. */
    size_t storms_checked;
    int storm_failed;
    char storm_failure[512];
    /* Decoder rounds: the shared decoder, and the owner's batch (between barriers). */
    kvp_decoder *decoder;
    kvp_decode_job *jobs;  /* [threads * sequences] */
    double *job_inputs;    /* [threads * sequences][ROUND_PREFILL][D] */
    double *job_outputs;   /* [threads * sequences][ROUND_PREFILL][D] */
    pthread_mutex_t round_lock;
    int round_entered;     /* the callback held this round's step open */
    size_t rounds_run;     /* written by each round's owner, between barriers */
    size_t round_jobs;
} shared;

typedef struct counters {
    size_t steps;
    size_t prefills;
    size_t appends;
    size_t resets;
    size_t recreates;
    size_t promises;
    size_t exhausted;
    size_t full;
    size_t audits;
    size_t storm_steps;
    size_t storm_exhausted;
    size_t busy_refusals; /* decoder steps refused with DECODER_BUSY, as they must be */
} counters;

typedef struct worker {
    size_t id;
    pthread_t thread;
    shared *sh;
    kvp_sequence **sequences;
    double *rows;      /* [MAX_PREFILL][D]: inputs */
    double *output;    /* [MAX_PREFILL][D] */
    unsigned char *refused; /* [sequences]: refused in the current storm */
    kvp_sequence *probe;    /* never in a batch: the job of this thread's busy decoder call */
    size_t storm_exhausted_now; /* PoolExhausted refusals of the last storm */
    uint64_t rng;
    counters count;
    int failed;
    char failure[512];
} worker;

static void record_failure(worker *w, const char *what, const kvp_error *err)
{
    if (w->failed) {
        return;
    }
    w->failed = 1;
    char text[384] = "";
    if (err != NULL) {
        kvp_error_format(err, text, sizeof text);
    }
    snprintf(w->failure, sizeof w->failure, "thread %zu: %s: %s", w->id, what, text);
}

/* A refused operation must be a typed capacity error and change nothing. */
static void check_refusal(worker *w, kvp_status status, const kvp_error *err,
                          const kvp_sequence *sequence, uint64_t digest, size_t len,
                          size_t held)
{
    if (status == KVP_POOL_EXHAUSTED) {
        w->count.exhausted++;
    } else if (status == KVP_FULL) {
        w->count.full++;
    } else {
        record_failure(w, "unexpected error", err);
        return;
    }
    if (stress_sequence_digest(sequence) != digest || kvp_sequence_len(sequence) != len ||
        kvp_sequence_held_pages(sequence) != held) {
        record_failure(w, "a refused operation changed its sequence", err);
    }
}

/* One random operation on sequence `index`. */
static void operate(worker *w, size_t index)
{
    const shared *sh = w->sh;
    kvp_sequence *sequence = w->sequences[index];
    uint64_t digest = stress_sequence_digest(sequence);
    size_t len = kvp_sequence_len(sequence);
    size_t held = kvp_sequence_held_pages(sequence);
    kvp_error err;
    kvp_status status = KVP_OK;
    size_t choice = stress_rand(&w->rng) % 100;
    size_t grew = 0;
    if (choice < 62) {
        stress_fill(w->rows, sh->width, &w->rng);
        kvp_tensor input = kvp_tensor3(w->rows, 1, 1, sh->width);
        status = kvp_sequence_step(sequence, &input, NULL, NULL, w->output, sh->width, &err);
        w->count.steps += status == KVP_OK;
        grew = 1;
    } else if (choice < 78) {
        size_t tokens = 1 + stress_rand(&w->rng) % MAX_PREFILL;
        stress_fill(w->rows, tokens * sh->width, &w->rng);
        kvp_tensor prompt = kvp_tensor3(w->rows, 1, tokens, sh->width);
        status = kvp_sequence_prefill(sequence, &prompt, NULL, NULL, w->output,
                                      MAX_PREFILL * sh->width, &err);
        w->count.prefills += status == KVP_OK;
        grew = tokens;
    } else if (choice < 92) {
        size_t tokens = 1 + stress_rand(&w->rng) % 4;
        status = kvpi_sequence_append_uncomputed(sequence, tokens, &err);
        w->count.appends += status == KVP_OK;
        grew = tokens;
    } else if (choice < 96) {
        status = kvp_sequence_reset(sequence, &err);
        w->count.resets++;
        if (status == KVP_OK && (kvp_sequence_len(sequence) != 0 ||
                                 kvp_sequence_held_pages(sequence) != 0 ||
                                 kvp_sequence_promised_pages(sequence) != 0)) {
            record_failure(w, "reset left rows, pages or a promise", NULL);
        }
        return;
    } else if (choice < 98) {
        kvp_sequence_destroy(sequence, NULL);
        w->sequences[index] = NULL;
        status = kvp_sequence_create(sh->model, sh->pool, 1, sh->capacity, &w->sequences[index],
                                     &err);
        w->count.recreates++;
        if (status != KVP_OK) {
            record_failure(w, "recreating a sequence", &err);
        }
        return;
    } else {
        status = kvp_sequence_promise(sequence, stress_rand(&w->rng) % 8, &err);
        w->count.promises++;
        if (status != KVP_OK) {
            record_failure(w, "promising pages", &err);
        }
        return;
    }
    if (status == KVP_OK) {
        if (kvp_sequence_len(sequence) != len + grew) {
            record_failure(w, "a successful operation grew the sequence wrongly", NULL);
        }
        return;
    }
    check_refusal(w, status, &err, sequence, digest, len, held);
}

/* Steps every sequence of this thread in turn until each has been refused. */
static void storm_grow(worker *w)
{
    const shared *sh = w->sh;
    size_t remaining = sh->sequences;
    unsigned char *refused = w->refused;
    memset(refused, 0, sh->sequences);
    while (remaining > 0 && !w->failed) {
        for (size_t s = 0; s < sh->sequences && !w->failed; s++) {
            if (refused[s]) {
                continue;
            }
            kvp_sequence *sequence = w->sequences[s];
            uint64_t digest = stress_sequence_digest(sequence);
            size_t len = kvp_sequence_len(sequence);
            size_t held = kvp_sequence_held_pages(sequence);
            stress_fill(w->rows, sh->width, &w->rng);
            kvp_tensor input = kvp_tensor3(w->rows, 1, 1, sh->width);
            kvp_error err;
            kvp_status status =
                kvp_sequence_step(sequence, &input, NULL, NULL, w->output, sh->width, &err);
            if (status == KVP_OK) {
                w->count.storm_steps++;
                if (kvp_sequence_len(sequence) != len + 1) {
                    record_failure(w, "a storm step grew the sequence wrongly", NULL);
                }
                continue;
            }
            w->count.storm_exhausted += status == KVP_POOL_EXHAUSTED;
            check_refusal(w, status, &err, sequence, digest, len, held);
            refused[s] = 1;
            remaining--;
        }
    }
}

/*
 * Run by one thread while every other worker waits at the barrier: the pool
 * must be spent. Sets sh->storm_failed with the reason when it is not.
 */
static void storm_check(shared *sh, size_t storm)
{
    sh->storms_checked++;
    size_t exhausted = 0;
    for (size_t t = 0; t < sh->threads; t++) {
        if (sh->workers[t].failed) {
            return; /* that failure is reported; the pool proves nothing now */
        }
        exhausted += sh->workers[t].storm_exhausted_now;
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvp_error err;
    const char *why = NULL;
    char text[384] = "";
    if (kvp_pool_check(sh->pool, NULL, NULL, &err) != KVP_OK ||
        kvp_pool_stats_get(sh->pool, &stats, &err) != KVP_OK) {
        kvp_error_format(&err, text, sizeof text);
        why = "the audit after the storm failed";
    } else if (exhausted == 0) {
        why = "no storm step was refused with PoolExhausted";
    }
    for (size_t t = 0; t < sh->threads && why == NULL; t++) {
        for (size_t s = 0; s < sh->sequences && why == NULL; s++) {
            const kvp_sequence *sequence = sh->workers[t].sequences[s];
            size_t len = kvp_sequence_len(sequence);
            size_t need = kvp_sequence_pages_for(sequence, len + 1);
            if (len < sh->capacity && need <= stats.free_pages) {
                snprintf(text, sizeof text, "thread %zu sequence %zu needs %zu pages, %zu free", t,
                         s, need, stats.free_pages);
                why = "a refused sequence could still grow";
            }
        }
    }
    if (why != NULL && !sh->storm_failed) {
        sh->storm_failed = 1;
        snprintf(sh->storm_failure, sizeof sh->storm_failure, "storm %zu: %s: %s", storm, why,
                 text);
    }
}

/* A storm: all threads stop, grow until refused, and one checks the pool. */
static void storm(worker *w, size_t index)
{
    shared *sh = w->sh;
    pthread_barrier_wait(&sh->barrier); /* every thread has stopped its random operations */
    size_t before = w->count.storm_exhausted;
    if (!w->failed) {
        storm_grow(w);
    }
    w->storm_exhausted_now = w->count.storm_exhausted - before;
    if (pthread_barrier_wait(&sh->barrier) == PTHREAD_BARRIER_SERIAL_THREAD) {
        storm_check(sh, index);
    }
    pthread_barrier_wait(&sh->barrier); /* checked: back to random operations */
}

/*
 * A decoder step on the shared decoder while a step is open on it: must be
 * refused with DECODER_BUSY and write nothing, neither the job nor the probe.
 */
static void busy_call(worker *w)
{
    kvp_decode_job job;
    memset(&job, 0, sizeof job);
    double input[64];
    double output[64];
    size_t width = w->sh->width;
    stress_fill(input, width, &w->rng);
    memset(output, 0, sizeof output);
    job.sequence = w->probe;
    job.input = kvp_tensor3(input, 1, 1, width);
    job.output = output;
    job.output_len = width;
    job.status = KVP_STATUS_COUNT_;
    kvp_error err;
    kvp_status status = kvp_decoder_step(w->sh->decoder, &job, 1, NULL, NULL, &err);
    if (status != KVP_DECODER_BUSY) {
        record_failure(w, "a decoder step during another was not refused as busy",
                       status == KVP_OK ? NULL : &err);
        return;
    }
    if (job.status != KVP_STATUS_COUNT_ || kvp_sequence_len(w->probe) != 0 || output[0] != 0.0) {
        record_failure(w, "a decoder step refused as busy wrote something", NULL);
        return;
    }
    w->count.busy_refusals++;
}

typedef struct round_ctx {
    worker *owner;
    int reentered;  /* the callback's own call back in was refused */
} round_ctx;

/*
 * The batch's next_input: the residual. Its first call holds the step open
 * while the owner's own call back in and every other thread's call are made.
 */
static void round_next_input(void *ctx, size_t layer, const double *input, const double *output,
                             size_t elements, double *next)
{
    (void)layer;
    round_ctx *round = ctx;
    shared *sh = round->owner->sh;
    pthread_mutex_lock(&sh->round_lock);
    int first = !sh->round_entered;
    sh->round_entered = 1;
    pthread_mutex_unlock(&sh->round_lock);
    if (first) {
        busy_call(round->owner); /* the callback calling back in */
        round->reentered = 1;
        pthread_barrier_wait(&sh->barrier); /* the others may call now */
        pthread_barrier_wait(&sh->barrier); /* they have */
    }
    for (size_t i = 0; i < elements; i++) {
        next[i] = input[i] + output[i];
    }
}

/* The owner's part of a round: reset, one batch of every sequence, check each job. */
static void round_run(worker *w)
{
    shared *sh = w->sh;
    size_t count = sh->threads * sh->sequences;
    size_t width = sh->width;
    kvp_error err;
    for (size_t j = 0; j < count; j++) {
        kvp_sequence *sequence = sh->workers[j / sh->sequences].sequences[j % sh->sequences];
        if (kvp_sequence_reset(sequence, &err) != KVP_OK) {
            record_failure(w, "resetting a sequence for a decoder round", &err);
        }
        size_t tokens = j % 2 ? ROUND_PREFILL : 1;
        double *input = sh->job_inputs + j * ROUND_PREFILL * width;
        double *output = sh->job_outputs + j * ROUND_PREFILL * width;
        stress_fill(input, tokens * width, &w->rng);
        memset(output, 0, ROUND_PREFILL * width * sizeof *output);
        kvp_decode_job *job = &sh->jobs[j];
        memset(job, 0, sizeof *job);
        job->kind = tokens > 1 ? KVP_JOB_PREFILL : KVP_JOB_STEP;
        job->sequence = sequence;
        job->input = kvp_tensor3(input, 1, tokens, width);
        job->output = output;
        job->output_len = tokens * width;
        job->status = KVP_STATUS_COUNT_;
    }
    round_ctx round = {w, 0};
    pthread_mutex_lock(&sh->round_lock);
    sh->round_entered = 0;
    pthread_mutex_unlock(&sh->round_lock);
    if (kvp_decoder_step(sh->decoder, sh->jobs, count, round_next_input, &round, &err) != KVP_OK) {
        record_failure(w, "a decoder round's step", &err);
    }
    if (!round.reentered) {
        /* The callback never ran: keep the barrier count so no thread waits forever. */
        record_failure(w, "a decoder round's callback never ran", NULL);
        pthread_barrier_wait(&sh->barrier);
        pthread_barrier_wait(&sh->barrier);
    }
    for (size_t j = 0; j < count && !w->failed; j++) {
        const kvp_decode_job *job = &sh->jobs[j];
        size_t tokens = job->kind == KVP_JOB_PREFILL ? ROUND_PREFILL : 1;
        if (job->status != KVP_OK) {
            record_failure(w, "a decoder round's job failed", &job->error);
        } else if (kvp_sequence_len(job->sequence) != tokens) {
            record_failure(w, "a decoder round's job grew its sequence wrongly", NULL);
        } else if (job->output[tokens * width - 1] == 0.0) {
            record_failure(w, "a decoder round's job wrote no output", NULL);
        }
    }
    sh->rounds_run++;
    sh->round_jobs += count;
}

/* A decoder round: all threads stop; the owner runs the batch, the others call in. */
static void decoder_round(worker *w, size_t index)
{
    shared *sh = w->sh;
    pthread_barrier_wait(&sh->barrier); /* every thread has stopped its random operations */
    if (index % sh->threads == w->id) {
        round_run(w);
    } else {
        pthread_barrier_wait(&sh->barrier); /* the owner's step is open */
        busy_call(w);
        pthread_barrier_wait(&sh->barrier); /* tried: the owner's step may finish */
    }
    pthread_barrier_wait(&sh->barrier); /* the batch is checked: back to random operations */
}

/* Round k comes before operation (2k + 1) * ops / (2 * (rounds + 1)) of every thread. */
static size_t round_point(const shared *sh, size_t k)
{
    return (2 * k + 1) * sh->ops / (2 * (sh->rounds + 1));
}

/* Storm k comes before operation (k + 1) * ops / (storms + 1) of every thread. */
static size_t storm_point(const shared *sh, size_t k)
{
    return (k + 1) * sh->ops / (sh->storms + 1);
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    shared *sh = w->sh;
    size_t next_storm = 0;
    size_t next_round = 0;
    for (size_t op = 0; op <= sh->ops; op++) {
        /* Every thread meets every storm and round, failed or not, or the others would
         * wait forever. */
        while (next_storm < sh->storms && storm_point(sh, next_storm) == op) {
            storm(w, next_storm++);
        }
        while (next_round < sh->rounds && round_point(sh, next_round) == op) {
            decoder_round(w, next_round++);
        }
        if (op == sh->ops || w->failed) {
            continue;
        }
        operate(w, (size_t)(stress_rand(&w->rng) % sh->sequences));
        if (sh->audit_every != 0 && (op + 1) % sh->audit_every == 0) {
            kvp_error err;
            w->count.audits++;
            if (kvp_pool_check(sh->pool, NULL, NULL, &err) != KVP_OK) {
                record_failure(w, "pool audit while other threads work", &err);
            }
        }
    }
    return NULL;
}

/*
 * Gives back what start_workers gave a worker: its sequences (a slot never
 * filled is NULL and skipped) and buffers. Used by finish and by the early
 * exits, so a usage error leaks nothing either.
 */
static void free_worker(worker *w, const shared *sh)
{
    for (size_t s = 0; w->sequences != NULL && s < sh->sequences; s++) {
        if (w->sequences[s] != NULL) {
            kvp_sequence_destroy(w->sequences[s], NULL);
        }
    }
    if (w->probe != NULL) {
        kvp_sequence_destroy(w->probe, NULL);
    }
    free(w->sequences);
    free(w->rows);
    free(w->output);
    free(w->refused);
    memset(w, 0, sizeof *w);
}

static int start_workers(worker *workers, size_t threads, shared *sh)
{
    for (size_t t = 0; t < threads; t++) {
        worker *w = &workers[t];
        w->id = t;
        w->sh = sh;
        w->rng = sh->seed * 1000003u + t;
        w->sequences = calloc(sh->sequences, sizeof *w->sequences);
        w->rows = calloc(MAX_PREFILL * sh->width, sizeof *w->rows);
        w->output = calloc(MAX_PREFILL * sh->width, sizeof *w->output);
        w->refused = calloc(sh->sequences, 1);
        if (w->sequences == NULL || w->rows == NULL || w->output == NULL || w->refused == NULL) {
            fprintf(stderr, PROGRAM ": out of memory\n");
            return 1;
        }
        kvp_error probe_err;
        if (kvp_sequence_create(sh->model, sh->pool, 1, sh->capacity, &w->probe, &probe_err) !=
            KVP_OK) {
            return stress_fail(PROGRAM, "creating a probe sequence", &probe_err);
        }
        for (size_t s = 0; s < sh->sequences; s++) {
            kvp_error err;
            if (kvp_sequence_create(sh->model, sh->pool, 1, sh->capacity, &w->sequences[s],
                                    &err) != KVP_OK) {
                return stress_fail(PROGRAM, "creating a sequence", &err);
            }
        }
    }
    /* The storms can prove exhaustion only if the sequences can outgrow the pool. */
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvp_error err;
    if (kvp_pool_stats_get(sh->pool, &stats, &err) != KVP_OK) {
        return stress_fail(PROGRAM, "reading stats", &err);
    }
    size_t most = threads * sh->sequences *
                  kvp_sequence_pages_for(workers[0].sequences[0], sh->capacity);
    if (most <= stats.total_pages) {
        fprintf(stderr,
                PROGRAM ": %zu threads x %zu sequences hold at most %zu pages, so a storm "
                        "cannot exhaust %zu (use fewer --pages)\n",
                threads, sh->sequences, most, stats.total_pages);
        return 2;
    }
    for (size_t t = 0; t < threads; t++) {
        if (pthread_create(&workers[t].thread, NULL, worker_main, &workers[t]) != 0) {
            /* The started threads would wait at the first storm for this one. */
            fprintf(stderr, PROGRAM ": cannot start thread %zu\n", t);
            exit(1);
        }
    }
    return 0;
}

/* Joins, destroys every sequence, and checks the pool is whole again. */
static int finish(worker *workers, size_t threads, shared *sh, double seconds)
{
    int failed = 0;
    counters total;
    memset(&total, 0, sizeof total);
    for (size_t t = 0; t < threads; t++) {
        worker *w = &workers[t];
        if (w->failed) {
            fprintf(stderr, PROGRAM ": %s\n", w->failure);
            failed = 1;
        }
        size_t *sum = (size_t *)(void *)&total;
        const size_t *part = (const size_t *)(const void *)&w->count;
        for (size_t i = 0; i < sizeof total / sizeof(size_t); i++) {
            sum[i] += part[i];
        }
        free_worker(w, sh);
    }
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvp_error err;
    if (kvp_pool_check(sh->pool, NULL, NULL, &err) != KVP_OK) {
        failed |= stress_fail(PROGRAM, "final audit", &err);
    }
    if (kvp_pool_stats_get(sh->pool, &stats, &err) != KVP_OK) {
        return stress_fail(PROGRAM, "reading stats", &err);
    }
    int whole = stats.free_pages == stats.total_pages && stats.acquires == stats.releases &&
                stats.promised_pages == 0 && stats.attached_caches == 0;
    if (sh->storm_failed) {
        fprintf(stderr, PROGRAM ": %s\n", sh->storm_failure);
        failed = 1;
    }
    if (sh->storms_checked != sh->storms) {
        fprintf(stderr, PROGRAM ": %zu of %zu storms were checked\n", sh->storms_checked,
                sh->storms);
        failed = 1;
    }
    /* Each round: the owner's call back in and every other thread's call, all refused. */
    if (!failed && (sh->rounds_run != sh->rounds || total.busy_refusals != sh->rounds * threads)) {
        fprintf(stderr, PROGRAM ": %zu of %zu decoder rounds ran, %zu of %zu busy calls refused\n",
                sh->rounds_run, sh->rounds, total.busy_refusals, sh->rounds * threads);
        failed = 1;
    }
    printf("%s: %zu threads x %zu ops: %zu steps, %zu prefills, %zu appends, %zu resets, "
           "%zu recreates, %zu promises; refused %zu exhausted, %zu full; %zu audits; "
           "%zu storms spent the pool (%zu steps, %zu refused exhausted); "
           "%zu decoder rounds (%zu jobs, %zu busy calls refused); "
           "%llu acquires, %llu releases, %zu of %zu pages free; %.2f s: %s\n",
           PROGRAM, threads, sh->ops, total.steps, total.prefills, total.appends, total.resets,
           total.recreates, total.promises, total.exhausted, total.full, total.audits,
           sh->storms_checked, total.storm_steps, total.storm_exhausted, sh->rounds_run,
           sh->round_jobs, total.busy_refusals,
           (unsigned long long)stats.acquires, (unsigned long long)stats.releases,
           stats.free_pages, stats.total_pages, seconds, whole && !failed ? "ok" : "FAILED");
    return failed || !whole;
}

int main(int argc, char **argv)
{
    size_t threads = 2 * stress_cores();
    size_t sequences = 4;
    size_t ops = 20000;
    size_t audit_every = 100;
    size_t pages = 160;
    size_t storms = 2;
    size_t rounds = 2;
    size_t seed = 1;
    stress_option options[] = {
        {"--threads", &threads, "worker threads"},
        {"--sequences", &sequences, "sequences per thread"},
        {"--ops", &ops, "operations per thread"},
        {"--audit-every", &audit_every, "operations between audits, per thread"},
        {"--pages", &pages, "pages in the shared pool"},
        {"--storms", &storms, "storms that grow every sequence until the pool is spent"},
        {"--decoder-rounds", &rounds, "batches of every sequence on the shared decoder"},
        {"--seed", &seed, "seed of every random choice"},
    };
    int parsed = stress_parse(argc, argv,
                              "Threads with their own sequences race for one small pool; every "
                              "refusal must change nothing and the pool must end whole.",
                              options, sizeof options / sizeof options[0]);
    if (parsed != 0) {
        return parsed == 1 ? 0 : 2;
    }
    if (threads == 0 || sequences == 0 || pages == 0 || storms == 0) {
        fprintf(stderr,
                PROGRAM ": --threads, --sequences, --pages and --storms must be positive\n");
        return 2;
    }
    shared sh;
    memset(&sh, 0, sizeof sh);
    sh.capacity = 64;
    sh.width = 16;
    sh.ops = ops;
    sh.audit_every = audit_every;
    sh.sequences = sequences;
    sh.storms = storms;
    sh.rounds = rounds;
    sh.seed = seed;
    sh.threads = threads;
    kvp_error err;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = 4;
    config.heads = 2;
    config.head_width = 8;
    config.budget_bytes = pages * 2 * 2 * 4 * 8 * sizeof(double);
    config.dtype = KVP_F64;
    if (kvp_pool_create(&config, &sh.pool, &err) != KVP_OK) {
        return stress_fail(PROGRAM, "creating the pool", &err);
    }
    if (kvp_model_create_random(2, sh.width, 2, sh.capacity, 10000.0, seed, &sh.model, &err) !=
        KVP_OK) {
        return stress_fail(PROGRAM, "creating the model", &err);
    }
    worker *workers = calloc(threads, sizeof *workers);
    if (workers == NULL || pthread_barrier_init(&sh.barrier, NULL, (unsigned)threads) != 0) {
        fprintf(stderr, PROGRAM ": out of memory\n");
        return 1;
    }
    sh.workers = workers;
    /* The decoder rounds' shared decoder (one worker and the calling owner) and batch. */
    size_t jobs = threads * sequences;
    sh.jobs = calloc(jobs, sizeof *sh.jobs);
    sh.job_inputs = calloc(jobs * ROUND_PREFILL * sh.width, sizeof *sh.job_inputs);
    sh.job_outputs = calloc(jobs * ROUND_PREFILL * sh.width, sizeof *sh.job_outputs);
    if (sh.jobs == NULL || sh.job_inputs == NULL || sh.job_outputs == NULL ||
        pthread_mutex_init(&sh.round_lock, NULL) != 0) {
        fprintf(stderr, PROGRAM ": out of memory\n");
        return 1;
    }
    if (kvp_decoder_create(2, &sh.decoder, &err) != KVP_OK) {
        return stress_fail(PROGRAM, "creating the decoder", &err);
    }
    double start = stress_seconds();
    int failed = start_workers(workers, threads, &sh);
    if (failed) {
        for (size_t t = 0; t < threads; t++) {
            free_worker(&workers[t], &sh);
        }
    } else {
        for (size_t t = 0; t < threads; t++) {
            pthread_join(workers[t].thread, NULL);
        }
        failed = finish(workers, threads, &sh, stress_seconds() - start);
    }
    pthread_barrier_destroy(&sh.barrier);
    if (kvp_decoder_destroy(sh.decoder, &err) != KVP_OK) {
        failed |= stress_fail(PROGRAM, "destroying the decoder", &err);
    }
    pthread_mutex_destroy(&sh.round_lock);
    free(sh.jobs);
    free(sh.job_inputs);
    free(sh.job_outputs);
    free(workers);
    kvp_model_destroy(sh.model, NULL);
    if (kvp_pool_destroy(sh.pool, &err) != KVP_OK) {
        failed |= stress_fail(PROGRAM, "destroying the pool", &err);
    }
    return failed;
}
