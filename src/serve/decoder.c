/*
 * decoder.c: batched decoding of many sequences on a fixed set of threads
 * (see kvp_decoder_* in kvpager/sequence.h).
 *
 * Owns: threads - 1 worker threads, started at creation and joined at
 * destruction, the hand-off of one batch at a time, and the "assist"
 * executor (attention/parallel.h) through which threads without a job help
 * the running jobs.
 *
 * Protocol (all shared fields under `lock`):
 *   kvp_decoder_step publishes the batch (jobs, count, next = 0), bumps
 *   `generation`, wakes the workers and works itself; each thread claims job
 *   indices under the lock until none are left, then assists (below) until
 *   no job is left running, and reports when it is done; the caller returns
 *   once `busy` reaches 0. One step at a time: `stepping` is set when a step
 *   takes the batch slot and cleared when it returns, and a step that finds
 *   it set is refused with DECODER_BUSY before it writes anything (a second
 *   thread, or a next_input callback calling back in).
 *   Jobs are independent sequences, so each job's result equals a lone
 *   kvp_sequence_step (a step job) or kvp_sequence_prefill (a prefill job).
 *   Plain mutexes and condition variables only, so helgrind and DRD can
 *   follow every hand-off.
 *
 * Assist (one long sequence uses every thread):
 *   A job runs its attention's phases on the decoder's executor. Running a
 *   phase of n >= 2 parts posts a task (on the poster's stack) to `tasks`,
 *   wakes the threads waiting in assist(), and claims parts itself, one at a
 *   time under the lock, until none is left unclaimed (the task is then
 *   unlinked, so no thread can claim from it again); then it waits on
 *   `part_done` until every claimed part has finished, and returns. A thread
 *   whose claim of a job finds none left calls assist(): it claims parts of
 *   posted tasks while there are any, and sleeps on `assist_ready` while
 *   there are none but some job is still running; it returns once no job
 *   is left to claim or running.
 *   - No deadlock: a poster never waits for a part that is not running (it
 *     runs every part nobody else claimed), and parts never wait.
 *   - No busy waiting: idle threads sleep on a condition variable, woken
 *     when a task is posted or the last job ends.
 *   - A helper touches a task only under the lock, and the poster leaves
 *     only after every part's completion was counted under the lock, so the
 *     stack task outlives every use.
 *   - Bits: the parts of a phase are an exact partition (gather.h), so a
 *     job's results do not depend on who ran which part.
 *   Test hook (decoder_internal.h): held tasks make their poster wait until
 *   another thread has claimed a part, so a test can force the assist under
 *   any scheduling; only with fewer jobs than threads, where some thread
 *   has no job and is bound to come and help.
 * Global state: the thread-start fault injector (decoder_internal.h).
 * Callers: the public API; kvpi_decoder_run for benchmarks and tests;
 * kvpi_decoder_reserve and kvpi_decoder_step_reserved for the scheduler,
 * which takes the step slot before its admissions change anything (a
 * reserved slot refuses other callers as a running step does).
 */
#include "kvpager/sequence.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "serve/decoder_internal.h"

#include "attention/parallel.h"
#include "pager/alloc.h"
#include "pager/error.h"
#include "serve/sequence_internal.h"

/* A phase posted for assist; lives on its poster's stack (see the protocol). */
typedef struct assist_task {
    kvpi_part_fn fn;
    void *ctx;
    size_t parts;
    size_t next;               /* the next unclaimed part */
    size_t done;               /* parts finished */
    size_t helped;             /* parts claimed by other threads */
    int held;                  /* test hook: the poster waits for a helper first */
    struct assist_task *link;  /* the next posted task with unclaimed parts */
} assist_task;

struct kvp_decoder {
    size_t threads;             /* workers + the calling thread */
    pthread_t *workers;         /* [threads - 1] */
    pthread_mutex_t lock;
    pthread_cond_t work_ready;
    pthread_cond_t work_done;
    uint64_t generation;        /* bumped once per published batch */
    int shutdown;
    kvp_decode_job *jobs;
    size_t count;
    size_t next;                /* the next unclaimed job */
    size_t busy;                /* workers still on the current batch */
    int stepping;               /* a kvp_decoder_step owns the batch slot */
    kvp_next_input_fn next_input;
    void *ctx;
    kvpi_decoder_solo_fn solo;  /* kvpi_decoder_run's one job, or NULL */
    void *solo_ctx;
    /* Assist. */
    pthread_cond_t assist_ready;
    pthread_cond_t part_done;
    assist_task *tasks;         /* posted tasks with unclaimed parts, oldest first */
    size_t running;             /* jobs claimed and not finished */
    size_t hold;                /* test hook: tasks still to hold */
    uint64_t assisted;          /* test hook: parts run by a thread other than the poster */
    kvpi_parallel executor;     /* {decoder_run_parts, this decoder} */
};

static atomic_uint_fast64_t thread_calls;  /* thread starts since arm */
static atomic_uint_fast64_t thread_target; /* 0: disarmed */
static atomic_int thread_fired;

void kvpi_thread_fault_arm(uint64_t nth)
{
    atomic_store(&thread_target, 0);
    atomic_store(&thread_calls, 0);
    atomic_store(&thread_fired, 0);
    atomic_store(&thread_target, (uint_fast64_t)nth);
}

uint64_t kvpi_thread_fault_calls(void)
{
    return (uint64_t)atomic_load(&thread_calls);
}

int kvpi_thread_fault_fired(void)
{
    return atomic_load(&thread_fired);
}

/* pthread_create, unless the injector fails this start (EAGAIN, nothing started). */
static int thread_start(pthread_t *thread, void *(*fn)(void *), void *arg)
{
    uint_fast64_t call = atomic_fetch_add(&thread_calls, 1) + 1;
    if (call == atomic_load(&thread_target)) {
        atomic_store(&thread_fired, 1);
        return EAGAIN;
    }
    return pthread_create(thread, NULL, fn, arg);
}

size_t kvpi_decoder_default_threads(long cores)
{
    if (cores <= 0) {
        return 1;
    }
    return cores > 4096 ? 4096 : (size_t)cores;
}

/* Removes `task` from the posted list. Under the lock. */
static void unlink_task(kvp_decoder *d, assist_task *task)
{
    assist_task **at = &d->tasks;
    while (*at != task) {
        at = &(*at)->link;
    }
    *at = task->link;
}

/*
 * Claims the next part of `task` for this thread. Under the lock; the task
 * has an unclaimed part. Unlinks it once its last part is claimed.
 */
static size_t claim_part(kvp_decoder *d, assist_task *task)
{
    size_t part = task->next++;
    if (task->next == task->parts) {
        unlink_task(d, task);
    }
    return part;
}

/* The executor's run: posts the parts, runs what nobody else claims, waits for the rest. */
static void decoder_run_parts(const kvpi_parallel *self, kvpi_part_fn fn, void *ctx,
                              size_t parts)
{
    kvp_decoder *d = self->impl;
    assist_task task = {.fn = fn, .ctx = ctx, .parts = parts};
    pthread_mutex_lock(&d->lock);
    if (d->hold > 0 && d->count < d->threads) {
        d->hold--;
        task.held = 1;
    }
    assist_task **tail = &d->tasks; /* first in, first helped: at most one task per thread */
    while (*tail != NULL) {
        tail = &(*tail)->link;
    }
    *tail = &task;
    pthread_cond_broadcast(&d->assist_ready);
    while (task.held && task.helped == 0) {
        pthread_cond_wait(&d->part_done, &d->lock);
    }
    while (task.next < task.parts) {
        size_t part = claim_part(d, &task);
        pthread_mutex_unlock(&d->lock);
        fn(ctx, part);
        pthread_mutex_lock(&d->lock);
        task.done++;
    }
    while (task.done < task.parts) {
        pthread_cond_wait(&d->part_done, &d->lock);
    }
    pthread_mutex_unlock(&d->lock);
}

/*
 * Runs posted parts until no job is left to claim or running; sleeps while
 * none is posted. Called without the lock held.
 */
static void assist(kvp_decoder *d)
{
    pthread_mutex_lock(&d->lock);
    for (;;) {
        assist_task *task = d->tasks;
        if (task != NULL) {
            size_t part = claim_part(d, task);
            kvpi_part_fn fn = task->fn;
            void *ctx = task->ctx;
            task->helped++;
            pthread_mutex_unlock(&d->lock);
            fn(ctx, part);
            pthread_mutex_lock(&d->lock);
            task->done++; /* the task may end once the lock is released */
            d->assisted++;
            pthread_cond_broadcast(&d->part_done);
            continue;
        }
        if (d->running == 0 && d->next >= d->count) {
            break;
        }
        pthread_cond_wait(&d->assist_ready, &d->lock);
    }
    pthread_mutex_unlock(&d->lock);
}

/* One job, its attention on `par` (NULL with one thread). */
static void run_job(kvp_decode_job *job, kvp_next_input_fn next_input, void *ctx,
                    const kvpi_parallel *par)
{
    if (job->kind == KVP_JOB_PREFILL) {
        job->status = kvpi_sequence_prefill_on(job->sequence, &job->input, next_input, ctx,
                                               job->output, job->output_len, par, &job->error);
    } else {
        job->status = kvpi_sequence_step_on(job->sequence, &job->input, next_input, ctx,
                                            job->output, job->output_len, par, &job->error);
    }
}

/* Claims and runs jobs until none are left. Called without the lock held. */
static void run_jobs(kvp_decoder *d)
{
    const kvpi_parallel *par = d->threads > 1 ? &d->executor : NULL;
    for (;;) {
        pthread_mutex_lock(&d->lock);
        size_t index = d->next < d->count ? d->next++ : d->count;
        kvp_decode_job *jobs = d->jobs;
        kvp_next_input_fn next_input = d->next_input;
        void *ctx = d->ctx;
        kvpi_decoder_solo_fn solo = d->solo;
        void *solo_ctx = d->solo_ctx;
        size_t count = d->count;
        if (index < count) {
            d->running++;
        }
        pthread_mutex_unlock(&d->lock);
        if (index >= count) {
            return;
        }
        if (solo != NULL) {
            solo(solo_ctx, par);
        } else {
            run_job(&jobs[index], next_input, ctx, par);
        }
        pthread_mutex_lock(&d->lock);
        if (--d->running == 0 && d->next >= d->count) {
            pthread_cond_broadcast(&d->assist_ready);
        }
        pthread_mutex_unlock(&d->lock);
    }
}

static void *worker_main(void *arg)
{
    kvp_decoder *d = arg;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&d->lock);
        while (!d->shutdown && d->generation == seen) {
            pthread_cond_wait(&d->work_ready, &d->lock);
        }
        if (d->shutdown) {
            pthread_mutex_unlock(&d->lock);
            return NULL;
        }
        seen = d->generation;
        pthread_mutex_unlock(&d->lock);
        run_jobs(d);
        assist(d);
        pthread_mutex_lock(&d->lock);
        if (--d->busy == 0) {
            pthread_cond_signal(&d->work_done);
        }
        pthread_mutex_unlock(&d->lock);
    }
}

/* Stops and joins the first `started` workers, then frees the decoder. */
static void decoder_free(kvp_decoder *d, size_t started)
{
    pthread_mutex_lock(&d->lock);
    d->shutdown = 1;
    pthread_cond_broadcast(&d->work_ready);
    pthread_mutex_unlock(&d->lock);
    for (size_t i = 0; i < started; i++) {
        pthread_join(d->workers[i], NULL);
    }
    pthread_cond_destroy(&d->part_done);
    pthread_cond_destroy(&d->assist_ready);
    pthread_cond_destroy(&d->work_done);
    pthread_cond_destroy(&d->work_ready);
    pthread_mutex_destroy(&d->lock);
    kvpi_free(d->workers);
    kvpi_free(d);
}

kvp_status kvp_decoder_create(size_t threads, kvp_decoder **out, kvp_error *err)
{
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (threads == 0) {
        threads = kvpi_decoder_default_threads(sysconf(_SC_NPROCESSORS_ONLN));
    }
    if (threads > 4096) {
        return kvpi_fail_invalid(err, "threads", "at most 4096 threads");
    }
    kvp_decoder *d = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *d);
    if (d == NULL) {
        return kvpi_fail_alloc(err, "decoder", sizeof *d);
    }
    d->workers = kvpi_calloc(KVPI_SITE_SCRATCH, threads, sizeof *d->workers);
    if (d->workers == NULL) {
        kvpi_free(d);
        return kvpi_fail_alloc(err, "decoder threads", threads * sizeof(pthread_t));
    }
    d->threads = threads;
    pthread_mutex_init(&d->lock, NULL);
    pthread_cond_init(&d->work_ready, NULL);
    pthread_cond_init(&d->work_done, NULL);
    pthread_cond_init(&d->assist_ready, NULL);
    pthread_cond_init(&d->part_done, NULL);
    d->executor = (kvpi_parallel){decoder_run_parts, d};
    for (size_t i = 0; i + 1 < threads; i++) {
        if (thread_start(&d->workers[i], worker_main, d) != 0) {
            decoder_free(d, i);
            kvp_error e = kvpi_error_begin(KVP_THREAD_FAILED);
            e.index = i;
            e.limit = threads - 1;
            return kvpi_error_emit(err, &e);
        }
    }
    *out = d;
    return KVP_OK;
}

kvp_status kvp_decoder_destroy(kvp_decoder *decoder, kvp_error *err)
{
    (void)err;
    if (decoder == NULL) {
        return KVP_OK; /* destroying NULL does nothing, as free(NULL) */
    }
    decoder_free(decoder, decoder->threads - 1);
    return KVP_OK;
}

size_t kvp_decoder_threads(const kvp_decoder *decoder)
{
    return decoder != NULL ? decoder->threads : 0;
}

/*
 * INVALID_ARGUMENT when two jobs share a sequence (they would race) or a
 * job's kind is unknown. O(n^2), n small.
 */
static kvp_status check_jobs(const kvp_decode_job *jobs, size_t count, kvp_error *err)
{
    for (size_t i = 0; i < count; i++) {
        if (jobs[i].sequence == NULL) {
            return kvpi_fail_null(err, "jobs[i].sequence");
        }
        if (jobs[i].kind != KVP_JOB_STEP && jobs[i].kind != KVP_JOB_PREFILL) {
            return kvpi_fail_invalid(err, "jobs[i].kind", "a step or a prefill");
        }
        for (size_t j = 0; j < i; j++) {
            if (jobs[j].sequence == jobs[i].sequence) {
                return kvpi_fail_invalid(err, "jobs", "two jobs name the same sequence");
            }
        }
    }
    return KVP_OK;
}

/*
 * Publishes a batch of `count` jobs (or solo's one), works on it with the
 * workers, and returns when every job is done. Called with the lock held
 * and `stepping` clear (or set by the caller's kvpi_decoder_reserve);
 * returns with it released and `stepping` clear.
 */
static void run_batch_locked(kvp_decoder *d, kvp_decode_job *jobs, size_t count,
                             kvpi_decoder_solo_fn solo, void *solo_ctx,
                             kvp_next_input_fn next_input, void *ctx)
{
    d->stepping = 1;
    d->jobs = jobs;
    d->count = count;
    d->next = 0;
    d->solo = solo;
    d->solo_ctx = solo_ctx;
    d->next_input = next_input;
    d->ctx = ctx;
    d->busy = d->threads - 1;
    d->generation++;
    pthread_cond_broadcast(&d->work_ready);
    pthread_mutex_unlock(&d->lock);

    run_jobs(d);
    assist(d);

    pthread_mutex_lock(&d->lock);
    while (d->busy > 0) {
        pthread_cond_wait(&d->work_done, &d->lock);
    }
    d->jobs = NULL;
    d->count = 0;
    d->solo = NULL;
    d->solo_ctx = NULL;
    d->stepping = 0;
    pthread_mutex_unlock(&d->lock);
}

kvp_status kvp_decoder_step(kvp_decoder *decoder, kvp_decode_job *jobs, size_t count,
                            kvp_next_input_fn next_input, void *ctx, kvp_error *err)
{
    if (decoder == NULL) {
        return kvpi_fail_null(err, "decoder");
    }
    if (jobs == NULL && count != 0) {
        return kvpi_fail_null(err, "jobs");
    }
    kvp_status status = check_jobs(jobs, count, err);
    if (status != KVP_OK) {
        return status;
    }
    pthread_mutex_lock(&decoder->lock);
    if (decoder->stepping) {
        pthread_mutex_unlock(&decoder->lock);
        kvp_error e = kvpi_error_begin(KVP_DECODER_BUSY);
        return kvpi_error_emit(err, &e);
    }
    if (count == 0) {
        pthread_mutex_unlock(&decoder->lock);
        return KVP_OK;
    }
    run_batch_locked(decoder, jobs, count, NULL, NULL, next_input, ctx);
    return KVP_OK;
}

kvp_status kvpi_decoder_run(kvp_decoder *decoder, kvpi_decoder_solo_fn fn, void *ctx,
                            kvp_error *err)
{
    if (decoder == NULL) {
        return kvpi_fail_null(err, "decoder");
    }
    if (fn == NULL) {
        return kvpi_fail_null(err, "fn");
    }
    pthread_mutex_lock(&decoder->lock);
    if (decoder->stepping) {
        pthread_mutex_unlock(&decoder->lock);
        kvp_error e = kvpi_error_begin(KVP_DECODER_BUSY);
        return kvpi_error_emit(err, &e);
    }
    run_batch_locked(decoder, NULL, 1, fn, ctx, NULL, NULL);
    return KVP_OK;
}

kvp_status kvpi_decoder_reserve(kvp_decoder *decoder, kvp_error *err)
{
    pthread_mutex_lock(&decoder->lock);
    if (decoder->stepping) {
        pthread_mutex_unlock(&decoder->lock);
        kvp_error e = kvpi_error_begin(KVP_DECODER_BUSY);
        return kvpi_error_emit(err, &e);
    }
    decoder->stepping = 1; /* every other caller is refused from now on */
    pthread_mutex_unlock(&decoder->lock);
    return KVP_OK;
}

void kvpi_decoder_step_reserved(kvp_decoder *decoder, kvp_decode_job *jobs, size_t count)
{
    pthread_mutex_lock(&decoder->lock);
    if (count == 0) {
        decoder->stepping = 0;
        pthread_mutex_unlock(&decoder->lock);
        return;
    }
    run_batch_locked(decoder, jobs, count, NULL, NULL, NULL, NULL);
}

void kvpi_decoder_hold_tasks(kvp_decoder *decoder, size_t tasks)
{
    pthread_mutex_lock(&decoder->lock);
    decoder->hold = tasks;
    pthread_mutex_unlock(&decoder->lock);
}

uint64_t kvpi_decoder_assisted_parts(kvp_decoder *decoder)
{
    pthread_mutex_lock(&decoder->lock);
    uint64_t parts = decoder->assisted;
    pthread_mutex_unlock(&decoder->lock);
    return parts;
}
